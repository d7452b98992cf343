//! The Cluster section of API.md over HTTP: the cluster's state (`/v1/cluster`, its map),
//! settings, adding nodes, failover, recovery and rebalance — leader-only calls forwarded
//! to the metadata leader. Built on [`crate::routing`] and [`crate::transport`].

use axum::body::Body;
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use serde::Deserialize;
use shoal_meta::{MemberState, MetaCommand, SettingsPatch};

use crate::docs::json_response;
use crate::error::{cluster_error, ApiError};
use crate::extract;
use crate::routing::{forward, FORWARDED_HEADER};
use crate::AppState;

/// Largest body of a cluster call from a client (settings, failover, recover, rebalance,
/// add): a few fields.
pub const CLUSTER_BODY_MAX_BYTES: usize = 64 * 1024;
/// `GET /v1/cluster`.
pub async fn info(State(state): State<AppState>, RawQuery(q): RawQuery) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let node = &state.cluster;
    let meta = node.state();
    // Health is the metadata leader's view (it pings every member); others show `null`.
    let healthy = node.member_health();
    let nodes: Vec<serde_json::Value> = meta
        .members
        .iter()
        .map(|(id, m)| {
            let (active, replica) = meta.map.as_ref().map_or((0, 0), |map| map.load(*id));
            serde_json::json!({
                "id": id.0,
                "address": m.address,
                "state": member_state(m.state),
                "services": m.services.names(),
                "healthy": healthy.as_ref().map(|h| h.get(&id.0).copied().unwrap_or(false)),
                "partitions": {"active": active, "replica": replica},
                "indexes": meta.indexes.values().map(|by_name| by_name.len()).sum::<usize>(),
            })
        })
        .collect();
    let rebalance = node.rebalance_status();
    let body = serde_json::json!({
        "cluster_id": meta.cluster_id,
        "node": node.id(),
        "leader": node.leader().map(|(id, _)| id),
        "map_version": meta.map_version(),
        "replicas": meta.settings.replicas,
        "settings": meta.settings,
        "nodes": nodes,
        "rebalance": if rebalance.state == shoal_node::rebalance::RebalanceState::Running { serde_json::to_value(&rebalance).unwrap_or_default() } else { serde_json::Value::Null },
    });
    Ok(json_response(StatusCode::OK, body.to_string().into_bytes()))
}

fn member_state(s: MemberState) -> &'static str {
    match s {
        MemberState::Added => "added",
        MemberState::Active => "active",
        MemberState::Leaving => "leaving",
        MemberState::Failed => "failed",
        MemberState::Ejected => "ejected",
    }
}

/// `GET /v1/cluster/map`: what smart clients route by, with each member's address.
pub async fn map(State(state): State<AppState>, RawQuery(q): RawQuery) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let meta = state.cluster.state();
    let Some(map) = &meta.map else {
        return Err(ApiError::unavailable("the cluster has no partition map yet"));
    };
    let partitions: Vec<serde_json::Value> = map
        .iter()
        .map(|(p, c)| serde_json::json!({"id": p, "active": c.active.0, "replicas": c.replicas.iter().map(|r| r.0).collect::<Vec<_>>()}))
        .collect();
    let nodes: serde_json::Map<String, serde_json::Value> = meta
        .members
        .iter()
        .map(|(id, m)| (id.0.to_string(), serde_json::json!({"address": m.address, "state": member_state(m.state)})))
        .collect();
    let body = serde_json::json!({"version": map.version, "partitions": partitions, "nodes": nodes});
    Ok(json_response(StatusCode::OK, body.to_string().into_bytes()))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SettingsBody {
    replicas: Option<u8>,
    auto_failover_timeout_s: Option<u32>,
    auto_failover_max_count: Option<u32>,
    rebalance_mb_per_s: Option<u32>,
    rebalance_moves_per_node: Option<u32>,
}

/// `PUT /v1/cluster/settings`.
pub async fn settings(State(state): State<AppState>, RawQuery(q): RawQuery, body: Body) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let body = extract::body(&state, body, CLUSTER_BODY_MAX_BYTES).await?;
    let s: SettingsBody = extract::json_body(&body)?;
    let patch = SettingsPatch {
        replicas: s.replicas,
        auto_failover_timeout_s: s.auto_failover_timeout_s,
        auto_failover_max_count: s.auto_failover_max_count,
        rebalance_mb_per_s: s.rebalance_mb_per_s,
        rebalance_moves_per_node: s.rebalance_moves_per_node,
    };
    state.cluster.propose(MetaCommand::UpdateSettings { patch }).await.map_err(cluster_error)?;
    let settings = state.cluster.state().settings.clone();
    Ok(json_response(StatusCode::OK, serde_json::to_vec(&settings).unwrap_or_default()))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeBody {
    node: shoal_cluster::NodeId,
}

/// `POST /v1/cluster/failover` (on the leader; another member forwards it there).
pub async fn failover(State(state): State<AppState>, RawQuery(q): RawQuery, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let body = extract::body(&state, body, CLUSTER_BODY_MAX_BYTES).await?;
    let req: NodeBody = extract::json_body(&body)?;
    if let Some(response) = to_leader(&state, Method::POST, "/v1/cluster/failover", &headers, &body).await? {
        return Ok(response);
    }
    let report = shoal_node::failover::failover(&state.cluster, req.node).await.map_err(cluster_error)?;
    metrics::counter!("shoal_failovers_total", "kind" => "manual").increment(1);
    Ok(json_response(StatusCode::OK, serde_json::to_vec(&report).unwrap_or_default()))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AddBody {
    address: String,
    /// An administrator of the node added (Couchbase asks for them too); by default the
    /// caller's own credentials are offered to it.
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    password: Option<String>,
}

/// `POST /v1/cluster/nodes` (`shoal cluster add`): asks the lone, empty node at `address`
/// to join this cluster; answers once it is a member (`added`).
pub async fn add_node(State(state): State<AppState>, RawQuery(q): RawQuery, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let body = extract::body(&state, body, CLUSTER_BODY_MAX_BYTES).await?;
    let req: AddBody = extract::json_body(&body)?;
    let valid = req.address.rsplit_once(':').is_some_and(|(host, port)| {
        !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0) && !req.address.contains(['/', ' ', '@', '?', '#'])
    });
    if !valid {
        return Err(ApiError::bad_request(format!("address {:?} is not host:port", req.address)));
    }
    let admin = match (&req.user, &req.password) {
        (Some(user), password) => {
            use base64::Engine as _;
            let pair = format!("{user}:{}", password.as_deref().unwrap_or(""));
            Some(format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(pair)))
        }
        (None, Some(_)) => return Err(ApiError::bad_request("a password comes with a user")),
        (None, None) => headers.get(axum::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok()).map(str::to_string),
    };
    let node = state.cluster.invite(&req.address, admin).await.map_err(cluster_error)?;
    let answer = serde_json::json!({"node": node, "address": req.address, "state": "added"});
    Ok(json_response(StatusCode::OK, answer.to_string().into_bytes()))
}

/// `POST /v1/cluster/recover` (on the leader).
pub async fn recover(State(state): State<AppState>, RawQuery(q): RawQuery, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let body = extract::body(&state, body, CLUSTER_BODY_MAX_BYTES).await?;
    let req: NodeBody = extract::json_body(&body)?;
    // On the leader: it resets the count of automatic failovers.
    if let Some(response) = to_leader(&state, Method::POST, "/v1/cluster/recover", &headers, &body).await? {
        return Ok(response);
    }
    shoal_node::failover::recover(&state.cluster, req.node).await.map_err(cluster_error)?;
    Ok(json_response(StatusCode::OK, serde_json::json!({"node": req.node}).to_string().into_bytes()))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RebalanceBody {
    #[serde(default)]
    eject: Vec<shoal_cluster::NodeId>,
}

/// `POST /v1/cluster/rebalance` (on the leader).
pub async fn rebalance(State(state): State<AppState>, RawQuery(q): RawQuery, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let body = extract::body(&state, body, CLUSTER_BODY_MAX_BYTES).await?;
    let req: RebalanceBody = if body.iter().all(u8::is_ascii_whitespace) { RebalanceBody::default() } else { extract::json_body(&body)? };
    if let Some(response) = to_leader(&state, Method::POST, "/v1/cluster/rebalance", &headers, &body).await? {
        return Ok(response);
    }
    let moves = shoal_node::rebalance::start(&state.cluster, req.eject).await.map_err(cluster_error)?;
    Ok(json_response(StatusCode::ACCEPTED, serde_json::json!({"moves": moves}).to_string().into_bytes()))
}

/// `DELETE /v1/cluster/rebalance` (on the leader): stops the rebalance under way; before
/// its final map the new copies are given up and the map goes back to what it was.
pub async fn rebalance_stop(State(state): State<AppState>, RawQuery(q): RawQuery, headers: HeaderMap) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    if let Some(response) = to_leader(&state, Method::DELETE, "/v1/cluster/rebalance", &headers, &[]).await? {
        return Ok(response);
    }
    shoal_node::rebalance::stop(&state.cluster).await.map_err(cluster_error)?;
    Ok(json_response(StatusCode::ACCEPTED, b"{\"stopping\":true}".to_vec()))
}

/// `GET /v1/cluster/rebalance` (the leader's view).
pub async fn rebalance_status(State(state): State<AppState>, RawQuery(q): RawQuery, headers: HeaderMap) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    if let Some(response) = to_leader(&state, Method::GET, "/v1/cluster/rebalance", &headers, &[]).await? {
        return Ok(response);
    }
    let status = state.cluster.rebalance_status();
    Ok(json_response(StatusCode::OK, serde_json::to_vec(&status).unwrap_or_default()))
}

/// Sends a leader-only call to the metadata leader when this node is not it; `None` when
/// this node is the leader (or the call was forwarded here already).
async fn to_leader(state: &AppState, method: Method, path: &str, headers: &HeaderMap, body: &[u8]) -> Result<Option<Response>, ApiError> {
    if state.cluster.is_leader() || headers.contains_key(FORWARDED_HEADER) {
        return Ok(None);
    }
    let (_, address) = state.cluster.leader().ok_or_else(|| ApiError::unavailable("no metadata leader now; try again"))?;
    let map = state.cluster.state().map_version();
    let user = headers.get(crate::auth::USER_HEADER);
    forward(state, &address, map, method, path, headers, user, Bytes::copy_from_slice(body)).await.map(Some)
}
