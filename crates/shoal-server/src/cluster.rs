//! The cluster over HTTP: the calls between members (`POST /v1/_internal/{op}`, carrying the
//! cluster secret), the Cluster section of API.md, and routing — a request for a key whose
//! active copy is on another node is forwarded there in one hop, or refused with
//! `not_my_partition` for clients that route themselves.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use serde::Deserialize;
use shoal_meta::{MemberState, MetaCommand, MetaReject, SettingsPatch};
use shoal_node::{ChunkStream, ClusterError, ClusterNode, Op, PeerError, PeerFuture, PeerStreamFuture, Peers, Route};

use crate::copy_io::{CopyIo, COPY_PROTOCOL};
use crate::docs::json_response;
use crate::error::ApiError;
use crate::extract;
use crate::AppState;

/// The header that carries the cluster secret between members.
pub const SECRET_HEADER: &str = "x-shoal-cluster-secret";
/// Set on a request one member forwards to another: the receiver never forwards it again.
/// Its value is the version of the map the request was routed by (older members sent `1`).
pub const FORWARDED_HEADER: &str = "x-shoal-forwarded";
/// Set by clients that route by the map themselves: a misrouted request is refused with
/// `not_my_partition` rather than forwarded.
pub const DIRECT_HEADER: &str = "x-shoal-route";
/// Largest body of a call between members (a Raft snapshot chunk, a pull with its acks).
pub const INTERNAL_BODY_MAX_BYTES: usize = 64 * 1024 * 1024;
/// Largest body of a cluster call from a client (settings, failover, recover, rebalance,
/// add): a few fields.
pub const CLUSTER_BODY_MAX_BYTES: usize = 64 * 1024;
/// Largest answer a member accepts from another (a replication batch).
pub const PEER_ANSWER_MAX_BYTES: usize = 256 * 1024 * 1024;
/// How long a forwarded request may take on the node it went to.
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a request that met a moving partition keeps waiting for the map that says
/// where it went (a hand-over commits it within its freeze) before it answers
/// `not_my_partition`.
pub const HANDOVER_WAIT: Duration = Duration::from_secs(5);
/// Longest a member waits for the map a forwarded request was routed by, when the sender
/// applied it first (members apply a commit within milliseconds of each other; the header
/// is also a client's to set, so the wait is short, and the request goes on after it).
pub const FORWARDED_MAP_WAIT: Duration = Duration::from_secs(1);
/// A forwarded request refused as misrouted is sent again after a newer map, or this long.
pub(crate) const FORWARD_RETRY_PAUSE: Duration = Duration::from_millis(100);
/// The time a request (one key, or the keys of a `_get` / `_bulk`) has to find where its
/// partitions went: refused as misrouted, it was applied nowhere, so it waits for a newer
/// map and is sent again, until [`HANDOVER_WAIT`] has passed.
pub(crate) struct Reroute {
    deadline: tokio::time::Instant,
}

impl Reroute {
    pub(crate) fn start() -> Reroute {
        Reroute { deadline: tokio::time::Instant::now() + HANDOVER_WAIT }
    }

    /// What is left of the wait.
    pub(crate) fn left(&self) -> Duration {
        self.deadline.saturating_duration_since(tokio::time::Instant::now())
    }

    /// After a round routed under map `routed_at` met a misrouted refusal: false when the
    /// wait is over, or true once a newer map is here (or [`FORWARD_RETRY_PAUSE`] passed).
    pub(crate) async fn again(&self, node: &ClusterNode, routed_at: u64) -> bool {
        let left = self.left();
        if left.is_zero() {
            return false;
        }
        node.wait_map_after(routed_at, left.min(FORWARD_RETRY_PAUSE)).await;
        true
    }
}

/// Largest body forwarded (a document or sub-document request; `_bulk` is not forwarded).
pub const FORWARD_BODY_MAX_BYTES: usize = shoal_storage::DOC_MAX_BYTES + 1024 * 1024;

/// How long a call to a member this node is cut off from takes to fail (as a dropped
/// packet would, roughly; never longer than the call's own timeout).
const CUT_CALL_DELAY: Duration = Duration::from_millis(200);

/// A switchable network partition for fault tests (`serve --fault-injection`): the
/// members this node is cut off from. Every call this node makes to them — between
/// members, forwarded requests, fanned-out reads, feeds — fails as unreachable; a test
/// cuts both sides for a full partition, or one side for a one-way one.
pub struct Faults {
    enabled: bool,
    cut: parking_lot::RwLock<std::collections::HashSet<String>>,
}

impl Faults {
    pub fn new(enabled: bool) -> Faults {
        Faults { enabled, cut: Default::default() }
    }

    /// Whether calls to `address` are cut.
    pub fn is_cut(&self, address: &str) -> bool {
        self.enabled && self.cut.read().contains(address)
    }

    /// The error a cut call answers.
    pub fn cut_error(address: &str) -> ApiError {
        ApiError::unavailable(format!("member {address} is unreachable (cut off by fault injection)"))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FaultsBody {
    /// The members (addresses) this node is cut off from; empty heals.
    cut: Vec<String>,
    /// Collections (names) whose replicated changes this node leaves unapplied, as a
    /// replica lagging in one collection would; empty releases them.
    #[serde(default)]
    hold: Vec<String>,
    /// Milliseconds each partition map waits here before the partition states follow it
    /// (the metadata has it at once); 0 or absent: none.
    #[serde(default)]
    map_delay_ms: u64,
}

/// `POST /v1/_internal/faults {"cut": [address, ...], "hold"?: [collection, ...], "map_delay_ms"?: n}` (with the
/// cluster secret, on a node started with `--fault-injection`).
async fn set_faults(state: &AppState, body: &[u8]) -> Result<Response, ApiError> {
    if !state.faults.enabled {
        return Err(ApiError::new(StatusCode::NOT_FOUND, "bad_request", "fault injection is off on this node (serve --fault-injection)"));
    }
    let req: FaultsBody = extract::json_body(body)?;
    let delay = Duration::from_millis(req.map_delay_ms);
    if delay > shoal_node::node::MAP_DELAY_MAX {
        return Err(ApiError::bad_request(format!("map_delay_ms is over {} ms", shoal_node::node::MAP_DELAY_MAX.as_millis())));
    }
    state.cluster.hold_collections(&req.hold).map_err(|e| ApiError::bad_request(e.to_string()))?;
    state.cluster.delay_maps(delay);
    tracing::warn!(cut = ?req.cut, hold = ?req.hold, ?delay, "fault injection: calls to these members fail, replicated changes of these collections wait, maps wait");
    *state.faults.cut.write() = req.cut.into_iter().collect();
    Ok(json_response(StatusCode::OK, b"{}".to_vec()))
}

/// `Peers` over HTTP: one pooled client, the secret in a header; copies on their own
/// client and thread (`copy_io`).
pub struct HttpPeers {
    client: reqwest::Client,
    /// Used only from `copy_io`'s thread, so that its connections live there. HTTP/1.1:
    /// a copy's connection switches protocols.
    copy_client: reqwest::Client,
    copy_io: std::sync::Arc<CopyIo>,
    secret: String,
    faults: std::sync::Arc<Faults>,
}

impl HttpPeers {
    pub fn new(secret: &str, faults: std::sync::Arc<Faults>, copy_io: std::sync::Arc<CopyIo>) -> Result<HttpPeers, reqwest::Error> {
        let client = reqwest::Client::builder().tcp_nodelay(true).no_proxy().pool_max_idle_per_host(64).build()?;
        let copy_client = reqwest::Client::builder().tcp_nodelay(true).no_proxy().http1_only().pool_max_idle_per_host(0).build()?;
        Ok(HttpPeers { client, copy_client, copy_io, secret: secret.to_string(), faults })
    }
}

impl Peers for HttpPeers {
    fn call(&self, address: &str, op: Op, body: Vec<u8>, timeout: Duration) -> PeerFuture {
        self.call_with_secret(&self.secret, address, op, body, timeout)
    }

    fn call_with_secret(&self, secret: &str, address: &str, op: Op, body: Vec<u8>, timeout: Duration) -> PeerFuture {
        if self.faults.is_cut(address) {
            let address = address.to_string();
            return Box::pin(async move {
                tokio::time::sleep(CUT_CALL_DELAY.min(timeout)).await;
                Err(PeerError::Unreachable { address, why: "cut off by fault injection".into() })
            });
        }
        let request = self
            .client
            .post(format!("http://{address}/v1/_internal/{}", op.name()))
            .header(SECRET_HEADER, secret)
            .timeout(timeout)
            .body(body)
            .send();
        let address = address.to_string();
        Box::pin(async move {
            let unreachable = |e: reqwest::Error| PeerError::Unreachable { address: address.clone(), why: error_chain(&e) };
            let response = request.await.map_err(unreachable)?;
            let status = response.status();
            let bytes = response.bytes().await.map_err(unreachable)?;
            if bytes.len() > PEER_ANSWER_MAX_BYTES {
                return Err(PeerError::Refused { address, code: "too_large".into(), message: format!("{} bytes", bytes.len()) });
            }
            if status.is_success() {
                return Ok(bytes.to_vec());
            }
            Err(refusal(address, status, &bytes))
        })
    }

    fn stream(&self, address: &str, op: Op, body: Vec<u8>, timeout: Duration) -> PeerStreamFuture {
        if self.faults.is_cut(address) {
            let address = address.to_string();
            return Box::pin(async move {
                tokio::time::sleep(CUT_CALL_DELAY.min(timeout)).await;
                Err(PeerError::Unreachable { address, why: "cut off by fault injection".into() })
            });
        }
        // No overall timeout: a copy takes as long as its size needs; the caller bounds
        // the gaps between chunks. The answer must start within `timeout`.
        let request =
            self.copy_client.post(format!("http://{address}/v1/_internal/{}", op.name())).header(SECRET_HEADER, &self.secret).body(body);
        let address = address.to_string();
        let (faults, copy_io) = (std::sync::Arc::clone(&self.faults), std::sync::Arc::clone(&self.copy_io));
        Box::pin(async move {
            let chunks = copy_io.receive(&address, request, timeout).await?;
            let chunks = futures::stream::unfold(chunks, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) }).map(move |chunk| {
                // A cut made while the copy runs breaks it, as a dropped link would.
                if faults.is_cut(&address) {
                    return Err(PeerError::Unreachable { address: address.clone(), why: "cut off by fault injection".into() });
                }
                chunk
            });
            Ok(Box::pin(chunks) as ChunkStream)
        })
    }
}

/// An error and its sources, outermost first: reqwest's own text ("error sending request
/// for url …") hides whether the connect, a reused connection or the answer failed.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The error a member's non-success answer means.
pub(crate) fn refusal(address: String, status: StatusCode, bytes: &[u8]) -> PeerError {
    let (code, message) = HttpPeers::error_of(status, bytes);
    // A member that is busy or between leaders may answer later: retry as if down.
    if status == StatusCode::SERVICE_UNAVAILABLE {
        return PeerError::Unreachable { address, why: format!("{code}: {message}") };
    }
    PeerError::Refused { address, code, message }
}

impl HttpPeers {
    /// The `(code, message)` of an error answer.
    fn error_of(status: StatusCode, bytes: &[u8]) -> (String, String) {
        match serde_json::from_slice::<serde_json::Value>(bytes) {
            Ok(v) => (
                v.get("error").and_then(|c| c.as_str()).unwrap_or("unknown").to_string(),
                v.get("reason").and_then(|c| c.as_str()).unwrap_or("").to_string(),
            ),
            Err(_) => (status.as_u16().to_string(), String::from_utf8_lossy(bytes).chars().take(200).collect()),
        }
    }
}

/// Maps a cluster error to the API's codes.
pub fn cluster_error(e: ClusterError) -> ApiError {
    match e {
        ClusterError::NodeNotFound(n) => ApiError::new(StatusCode::NOT_FOUND, "node_not_found", format!("no member {n}")),
        ClusterError::RebalanceRunning => ApiError::new(StatusCode::CONFLICT, "rebalance_running", "a rebalance is running"),
        ClusterError::Rejected(r) => match r {
            MetaReject::NoSuchMember { node } => ApiError::new(StatusCode::NOT_FOUND, "node_not_found", format!("no member {node}")),
            MetaReject::CollectionExists { name } => {
                ApiError::new(StatusCode::CONFLICT, "collection_exists", format!("collection {name} exists"))
            }
            MetaReject::NoSuchCollection { name } => ApiError::collection_not_found(&name),
            MetaReject::OutOfRange { .. } => ApiError::bad_request(r.to_string()),
            MetaReject::RebalanceRunning => ApiError::new(StatusCode::CONFLICT, "rebalance_running", "a rebalance is running"),
            other => ApiError::new(StatusCode::CONFLICT, "bad_request", other.to_string()),
        },
        ClusterError::Refused(why) => ApiError::new(StatusCode::CONFLICT, "bad_request", why),
        ClusterError::Timeout(why) => ApiError::unavailable(why),
        ClusterError::BadMessage(why) => ApiError::bad_request(why),
        ClusterError::NoLeader(_) | ClusterError::Peer(_) | ClusterError::NotLeader { .. } | ClusterError::ShuttingDown => {
            ApiError::unavailable(e.to_string())
        }
        ClusterError::Index(e) => ApiError::from(e),
        ClusterError::Identity(_) | ClusterError::Meta(_) | ClusterError::Engine(_) | ClusterError::Storage(_) => {
            ApiError::unavailable(e.to_string())
        }
    }
}

/// `POST /v1/_internal/{op}`: a call from another member, if it carries the secret.
pub async fn internal(State(state): State<AppState>, Path(op): Path<String>, request: Request) -> Result<Response, ApiError> {
    let (mut parts, body) = request.into_parts();
    let headers = &parts.headers;
    let node = &state.cluster;
    let given = headers.get(SECRET_HEADER).map(|v| v.as_bytes()).unwrap_or_default();
    // An invitation comes from a cluster whose secret this node does not know yet; only a
    // lone node with no collections takes it (`ClusterNode::invite`).
    if !constant_time_eq(given, node.secret().as_bytes()) && op != Op::Invite.name() {
        return Err(ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "calls between members need the cluster secret"));
    }
    let body = extract::body(&state, body, INTERNAL_BODY_MAX_BYTES).await?;
    if op == "faults" {
        return set_faults(&state, &body).await;
    }
    let op = Op::from_name(&op).ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "bad_request", format!("no internal call {op}")))?;
    if op == Op::Export {
        // The copy's bytes go over the same connection switched to the copy protocol, on
        // the copies' own thread (`copy_io`).
        let asked = parts.headers.get(header::UPGRADE).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(COPY_PROTOCOL.as_bytes()));
        let upgrade = parts.extensions.remove::<hyper::upgrade::OnUpgrade>().filter(|_| asked).ok_or_else(|| {
            ApiError::bad_request(format!("an export answers over HTTP/1.1 switched to `{COPY_PROTOCOL}` (`Upgrade: {COPY_PROTOCOL}`)"))
        })?;
        let chunks = node.export_stream(&body).map_err(cluster_error)?;
        let socket = parts.extensions.remove::<crate::conn::Socket>();
        state.copy_io.send(upgrade, socket, chunks);
        return Ok((StatusCode::SWITCHING_PROTOCOLS, [(header::CONNECTION, "upgrade"), (header::UPGRADE, COPY_PROTOCOL)]).into_response());
    }
    let answer = node.handle(op, &body).await.map_err(cluster_error)?;
    Ok((StatusCode::OK, [(header::CONTENT_TYPE, "application/octet-stream")], answer).into_response())
}

/// Compares secrets in time that does not depend on where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

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
    node: u64,
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
}

/// `POST /v1/cluster/nodes` (`shoal cluster add`): asks the lone, empty node at `address`
/// to join this cluster; answers once it is a member (`added`).
pub async fn add_node(State(state): State<AppState>, RawQuery(q): RawQuery, body: Body) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let body = extract::body(&state, body, CLUSTER_BODY_MAX_BYTES).await?;
    let req: AddBody = extract::json_body(&body)?;
    let valid = req.address.rsplit_once(':').is_some_and(|(host, port)| {
        !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0) && !req.address.contains(['/', ' ', '@', '?', '#'])
    });
    if !valid {
        return Err(ApiError::bad_request(format!("address {:?} is not host:port", req.address)));
    }
    let node = state.cluster.invite(&req.address).await.map_err(cluster_error)?;
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
    eject: Vec<u64>,
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
    forward(state, &address, map, method, path, headers, Bytes::copy_from_slice(body)).await.map(Some)
}

/// Routes a key request: passes it on when this node serves the key's partition, forwards
/// it to the node that does, or refuses it.
pub async fn route(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let uri = req.uri().clone();
    let Ok(key) = extract::doc_key(&uri) else { return next.run(req).await };
    let node = &state.cluster;
    if !node.serving() {
        // Just started: give it a moment to enter the cluster, then route by its map.
        node.serving_soon().await;
    }
    if let Some(routed_by) = forwarded_by_map(req.headers()).filter(|v| *v > node.state().map_version()) {
        // A member that applied a newer map sent it here: wait for that map rather than
        // refuse by an older one (the sender would wait for a map newer than its own).
        node.wait_map_after(routed_by - 1, FORWARDED_MAP_WAIT).await;
    }
    let mut route = node.route(key.as_bytes());
    if req.headers().contains_key(FORWARDED_HEADER) || req.headers().contains_key(DIRECT_HEADER) {
        // Relayed by a member, or from a client that routes itself: answered here or refused.
        return match route {
            Route::Local if node.serving() => {
                // As for a client's request below: run once this node's copies follow the
                // map that routed the request here.
                node.wait_copies_follow(key.as_bytes(), node.state().map_version(), HANDOVER_WAIT).await;
                next.run(req).await
            }
            Route::Forward { node: owner, .. } => misdirected(node.state().map_version(), owner),
            other => refuse(&state, other),
        };
    }
    // A client's request gets one answer even while its key's partition moves: a refusal
    // as misrouted (from the node the map names, or from this node's own copy, which a
    // hand-over may freeze between the routing and the read or write) changed nothing, so
    // the request waits for a newer map and goes where it says.
    let (parts, body) = req.into_parts();
    let body = match extract::body(&state, body, FORWARD_BODY_MAX_BYTES).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let (method, headers) = (parts.method.clone(), parts.headers.clone());
    let path = uri.path_and_query().map_or_else(|| uri.path().to_string(), |pq| pq.as_str().to_string());
    let mut local = Some((next, parts));
    let reroute = Reroute::start();
    loop {
        let routed_at = node.state().map_version();
        if route == Route::Local && node.handing_over(key.as_bytes()) {
            // This node is giving the partition up: wait for the map that names its new active.
            node.wait_map_after(routed_at, reroute.left()).await;
            route = node.route(key.as_bytes());
        }
        if route == Route::Local {
            // The map says here: run once this node's copies follow it.
            node.wait_copies_follow(key.as_bytes(), routed_at, reroute.left()).await;
        }
        let answer = match route {
            Route::Local if node.serving() => match local.take() {
                Some((next, parts)) => next.run(Request::from_parts(parts, Body::from(body.clone()))).await,
                // Refused here once already (frozen for a hand-over) and the map still says
                // here: wait for the map that moves the partition (a hand-over commits it
                // within its freeze) and go where it says. (`next` ran once: the request
                // cannot run here again.)
                None => {
                    node.wait_map_after(routed_at, reroute.left()).await;
                    route = node.route(key.as_bytes());
                    if route == Route::Local {
                        return misdirected(routed_at, node.id());
                    }
                    continue;
                }
            },
            Route::Forward { ref address, .. } => {
                match forward(&state, address, routed_at, method.clone(), &path, &headers, body.clone()).await {
                    Ok(r) => r,
                    Err(e) => return e.into_response(),
                }
            }
            other => return refuse(&state, other),
        };
        if answer.status() != StatusCode::MISDIRECTED_REQUEST || !reroute.again(node, routed_at).await {
            return answer;
        }
        route = node.route(key.as_bytes());
    }
}

/// `421 not_my_partition`: `owner` holds the key's partition at `map_version`.
fn misdirected(map_version: u64, owner: u64) -> Response {
    let mut e = ApiError::new(
        StatusCode::MISDIRECTED_REQUEST,
        "not_my_partition",
        format!("node {owner} holds this key's partition at map version {map_version}"),
    );
    e.details.push(("map_version", serde_json::Value::from(map_version)));
    e.details.push(("node", serde_json::Value::from(owner)));
    e.into_response()
}

/// The answer to a key request no node can take now: this node is not serving (still
/// entering its cluster, or cut off from the leader), or the partition has no active copy.
fn refuse(state: &AppState, route: Route) -> Response {
    match route {
        Route::Unavailable { partition, map_version } => {
            let mut e = ApiError::unavailable(format!(
                "partition {partition} has no active copy now (its node failed and no replica could take it, or a failover is in progress)"
            ));
            e.details.push(("partition", serde_json::Value::from(partition)));
            e.details.push(("map_version", serde_json::Value::from(map_version)));
            e.into_response()
        }
        _ => crate::spread::not_serving(state).into_response(),
    }
}

/// Headers a forwarded request keeps (the rest are hop-by-hop or the client's own).
const FORWARDED_REQUEST_HEADERS: &[&str] = &["content-type", "if-match", "if-none-match", DIRECT_HEADER];
/// Headers a forwarded answer keeps.
const FORWARDED_ANSWER_HEADERS: &[&str] = &["content-type", "etag", "x-shoal-expiry"];

async fn forward(
    state: &AppState,
    address: &str,
    routed_at: u64,
    method: Method,
    path: &str,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    if state.faults.is_cut(address) {
        return Err(Faults::cut_error(address));
    }
    let mut request = state
        .forwarder
        .request(method, format!("http://{address}{path}"))
        .timeout(FORWARD_TIMEOUT)
        .header(FORWARDED_HEADER, routed_at.to_string());
    for name in FORWARDED_REQUEST_HEADERS {
        if let Some(v) = headers.get(*name) {
            request = request.header(*name, v.as_bytes());
        }
    }
    let answer = request.body(body).send().await.map_err(|e| crate::spread::lost_call("the node holding the key", &e))?;
    let status = answer.status();
    let mut out = HeaderMap::new();
    for name in FORWARDED_ANSWER_HEADERS {
        if let Some(v) = answer.headers().get(*name) {
            if let Ok(v) = HeaderValue::from_bytes(v.as_bytes()) {
                out.insert(*name, v);
            }
        }
    }
    let bytes = answer.bytes().await.map_err(|e| crate::spread::lost_call("the node holding the key", &e))?;
    let mut response = Response::new(Body::from(bytes));
    *response.status_mut() = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    *response.headers_mut() = out;
    Ok(response)
}

/// The map version a forwarded request was routed by (its [`FORWARDED_HEADER`]); `None` when
/// not forwarded or unreadable.
pub(crate) fn forwarded_by_map(headers: &HeaderMap) -> Option<u64> {
    headers.get(FORWARDED_HEADER)?.to_str().ok()?.parse().ok()
}

/// The client used to forward requests.
pub fn forwarder() -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder().tcp_nodelay(true).no_proxy().pool_max_idle_per_host(256).build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("{text}")]
    struct Layer {
        text: &'static str,
        #[source]
        cause: Option<Box<Layer>>,
    }

    #[test]
    fn an_unreachable_peer_says_every_cause() {
        let inner = Layer { text: "connection closed before message completed", cause: None };
        let outer = Layer { text: "error sending request for url (http://a/v1/_internal/handover)", cause: Some(Box::new(inner)) };
        assert_eq!(
            error_chain(&outer),
            "error sending request for url (http://a/v1/_internal/handover): connection closed before message completed"
        );
        assert_eq!(error_chain(&Layer { text: "refused", cause: None }), "refused");
    }
}
