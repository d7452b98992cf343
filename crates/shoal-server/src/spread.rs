//! Requests over many keys (`_get`, `_bulk`) in a cluster: each key goes to the node
//! holding its partition's active copy — this one, or another in one concurrent call per
//! node — and the answers are put back in the request's order. A call that arrives
//! forwarded is answered here only (never forwarded twice).

use std::collections::BTreeMap;

use axum::http::{HeaderMap, StatusCode};
use bytes::Bytes;
use shoal_node::Route;

use crate::cluster::{FORWARDED_HEADER, FORWARD_TIMEOUT};
use crate::error::ApiError;
use crate::AppState;

/// Where one key of a many-key request is answered.
pub(crate) enum Place {
    /// Here.
    Local,
    /// By the member at this address.
    Remote(String),
    /// Nowhere now (its partition has no active copy, or this node lost its lease).
    Refused(ApiError),
}

/// Places every key. A forwarded request is answered here for every key (the storage
/// refuses keys of partitions it does not hold with `not_my_partition`).
pub(crate) async fn place<'a>(state: &AppState, headers: &HeaderMap, keys: impl Iterator<Item = Option<&'a str>>) -> Vec<Place> {
    let node = &state.cluster;
    if !node.serving() {
        node.serving_soon().await;
    }
    let serving = node.serving();
    let forwarded = headers.contains_key(FORWARDED_HEADER);
    let local = || if serving { Place::Local } else { Place::Refused(not_serving(state)) };
    keys.map(|key| match key {
        None => Place::Local,
        Some(_) if forwarded => local(),
        Some(key) => match node.route(key.as_bytes()) {
            Route::Local => local(),
            Route::Forward { address, .. } => Place::Remote(address),
            Route::Unavailable { partition, .. } => Place::Refused(no_active(partition)),
        },
    })
    .collect()
}

/// Waits for this node to serve (a node just started is given `STARTUP_WAIT` to enter its
/// cluster), or answers why it does not.
pub(crate) async fn require_serving(state: &AppState) -> Result<(), ApiError> {
    if state.cluster.serving_soon().await {
        return Ok(());
    }
    Err(not_serving(state))
}

/// Why this node does not serve now: still entering its cluster, or cut off from the
/// metadata leader.
pub(crate) fn not_serving(state: &AppState) -> ApiError {
    if !state.cluster.has_served() {
        return ApiError::unavailable("this node is still entering its cluster (starting, joining or rejoining); try again");
    }
    lost_lease()
}

fn lost_lease() -> ApiError {
    ApiError::unavailable("this node lost contact with the cluster's metadata leader; it serves nothing until it is back")
}

/// The positions of the keys each remote member answers, by address (empty when every key
/// is answered here).
pub(crate) fn remote_groups(places: &[Place]) -> BTreeMap<String, Vec<usize>> {
    let mut groups: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (i, place) in places.iter().enumerate() {
        if let Place::Remote(address) = place {
            groups.entry(address.clone()).or_default().push(i);
        }
    }
    groups
}

/// The other members holding active copies, each once (in partition order of their
/// first), for a request over every partition; a partition with no active copy now
/// refuses it.
pub(crate) fn other_actives_in(state: &AppState, meta: &shoal_meta::MetaState) -> Result<Vec<String>, ApiError> {
    let owners = state.cluster.active_owners_in(meta).map_err(no_active)?;
    let mut out: Vec<String> = Vec::new();
    for address in owners.into_iter().flatten() {
        if !out.contains(&address) {
            out.push(address);
        }
    }
    Ok(out)
}

/// Partition `p` has no active copy now.
pub(crate) fn no_active(p: u16) -> ApiError {
    ApiError::unavailable(format!("partition {p} has no active copy now, so the answer would miss it; try again"))
}

/// A failed call to another member: whether the request may have been applied there.
pub(crate) struct CallError {
    pub error: ApiError,
}

/// Posts `body` to `path` on each member concurrently (marked forwarded, by the map version
/// the caller routed them by) and answers their bodies in the same order. A member that answers with an error status answers that
/// error for its whole part; a call that may have reached it and got no answer is
/// `408 timeout` flagged ambiguous (a write may have happened).
pub(crate) async fn call_all(
    state: &AppState,
    path_and_query: &str,
    map_version: u64,
    calls: Vec<(String, Vec<u8>)>,
) -> Vec<Result<Bytes, CallError>> {
    let routed_by = map_version.to_string();
    let routed_by = &routed_by;
    let calls = calls.into_iter().map(|(address, body)| async move {
        if state.faults.is_cut(&address) {
            return Err(CallError { error: crate::cluster::Faults::cut_error(&address) });
        }
        let answer = state
            .forwarder
            .post(format!("http://{address}{path_and_query}"))
            .timeout(FORWARD_TIMEOUT)
            .header(FORWARDED_HEADER, routed_by.as_str())
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .map_err(|e| CallError { error: lost_call(&format!("member {address} holding these keys"), &e) })?;
        let status = answer.status();
        let bytes =
            answer.bytes().await.map_err(|e| CallError { error: lost_call(&format!("member {address} holding these keys"), &e) })?;
        if !status.is_success() {
            let error = ApiError::from_answer(StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY), &bytes);
            return Err(CallError { error });
        }
        Ok(bytes)
    });
    futures::future::join_all(calls).await
}

/// The error for a call to `whom` that failed. Only a call that never connected is known
/// not to have reached it (`unavailable`); any other failure — a timeout, a connection
/// closed after the request went out (the member was killed mid-request), an answer cut
/// short — may follow a write that happened there: `408 timeout`, flagged ambiguous.
/// (Porcupine caught a forwarded write answered `unavailable` that had happened.)
pub(crate) fn lost_call(whom: &str, e: &reqwest::Error) -> ApiError {
    if e.is_connect() {
        return ApiError::unavailable(format!("{whom} is unreachable: {e}"));
    }
    let mut err = ApiError::new(StatusCode::REQUEST_TIMEOUT, "timeout", format!("{whom} did not answer: {e}"));
    err.details.push(("ambiguous", serde_json::Value::Bool(true)));
    err
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// A member that takes the request and dies before answering may have applied it; one
    /// that never took the connection did nothing.
    #[tokio::test]
    async fn a_call_cut_after_it_went_out_is_ambiguous_and_one_never_connected_is_not() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let _ = socket.read(&mut buf).await;
            // Closed without an answer, as by `kill -9` mid-request.
        });
        let http = reqwest::Client::new();
        let cut = http.put(format!("http://{address}/v1/collections/c/docs/k")).body("{}").send().await.unwrap_err();
        let err = lost_call("member", &cut);
        assert_eq!(err.status, StatusCode::REQUEST_TIMEOUT, "{err:?}");
        assert!(err.details.iter().any(|(k, v)| *k == "ambiguous" && *v == serde_json::Value::Bool(true)), "{err:?}");

        // A port nothing listens on: the connection is refused.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let refused = http.put(format!("http://{closed}/v1/collections/c/docs/k")).body("{}").send().await.unwrap_err();
        let err = lost_call("member", &refused);
        assert_eq!(err.status, StatusCode::SERVICE_UNAVAILABLE, "{err:?}");
        assert!(err.details.is_empty(), "{err:?}");
    }
}
