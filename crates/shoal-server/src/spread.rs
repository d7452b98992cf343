//! Requests over many keys (`_get`, `_bulk`) in a cluster: each key goes to the node
//! holding its partition's active copy — this one, or another in one concurrent call per
//! node — and the answers are put back in the request's order. A call that arrives
//! forwarded is answered here only (never forwarded twice).

use std::collections::BTreeMap;

use axum::http::{HeaderMap, StatusCode};
use bytes::Bytes;
use shoal_node::Route;

use crate::error::ApiError;
use crate::routing::{no_active, not_serving, FORWARDED_HEADER, FORWARD_TIMEOUT};
use crate::transport::lost_call;
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
    headers: &axum::http::HeaderMap,
    calls: Vec<(String, Vec<u8>)>,
) -> Vec<Result<Bytes, CallError>> {
    // The user the request runs for, signed by this member (`auth`).
    let user = headers.get(crate::auth::USER_HEADER);
    let routed_by = map_version.to_string();
    let routed_by = &routed_by;
    let calls = calls.into_iter().map(|(address, body)| async move {
        if state.faults.is_cut(&address) {
            return Err(CallError { error: crate::transport::Faults::cut_error(&address) });
        }
        let mut request = state
            .forwarder
            .post(state.member_url(&address, path_and_query))
            .timeout(FORWARD_TIMEOUT)
            .header(FORWARDED_HEADER, routed_by.as_str())
            .header("content-type", "application/json");
        if let Some(user) = user {
            request = request.header(crate::auth::USER_HEADER, user.as_bytes());
        }
        let answer = request
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
