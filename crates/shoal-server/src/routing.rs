//! Routing over HTTP: a request for a key goes to the node holding its partition's active
//! copy — run here, forwarded there in one hop (marked with the map version it was routed
//! by), or refused with `not_my_partition` for clients that route themselves — and waits
//! out a hand-over rather than fail. Also the refusals every routed request may answer (not
//! serving, no active copy). Built on [`crate::transport`]; the endpoints build on it.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use shoal_cluster::NodeId;
use shoal_node::{ClusterNode, Route};

use crate::error::ApiError;
use crate::extract;
use crate::transport::{lost_call, Faults};
use crate::AppState;

/// Set on a request one member forwards to another: the receiver never forwards it again.
/// Its value is the version of the map the request was routed by (older members sent `1`).
pub const FORWARDED_HEADER: &str = "x-shoal-forwarded";
/// Set by clients that route by the map themselves: a misrouted request is refused with
/// `not_my_partition` rather than forwarded.
pub const DIRECT_HEADER: &str = "x-shoal-route";
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

/// The routes [`route`] runs in front of: every one under a document's key.
pub(crate) const KEYED_ROUTE_PREFIX: &str = "/v1/collections/{c}/docs/{key}";

/// Whether the matched route `path` is a key request's, which [`route`] sends where its
/// key's active copy is. Only a cost rides on it: such a request is signed for the members
/// only when [`route`] passes it on; any other is signed by `auth` up front.
pub(crate) fn is_keyed(path: &str) -> bool {
    path.starts_with(KEYED_ROUTE_PREFIX)
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
    let (mut route, mut routed_at) = node.route_versioned(key.as_bytes());
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
    // Signed only when the request is passed on (see `auth::authenticate`).
    let principal = parts.extensions.get::<std::sync::Arc<crate::auth::Principal>>().cloned();
    let path = uri.path_and_query().map_or_else(|| uri.path().to_string(), |pq| pq.as_str().to_string());
    let mut local = Some((next, parts));
    let reroute = Reroute::start();
    loop {
        // `routed_at` is the map `route` was read from. Reading the newest version here
        // instead, a request routed before a hand-over's map came in waited for the map
        // after that one (up to HANDOVER_WAIT, then refused), as a client saw once in a
        // scale-out of `shoal bench index-rebalance`.
        if let Some(frozen_under) = node.handing_over(key.as_bytes()).filter(|_| route == Route::Local) {
            // This node is giving the partition up: wait for the map after the one it was
            // frozen under, which names its new active (it may be in already, the freeze
            // not lifted yet).
            node.wait_map_after(frozen_under, reroute.left()).await;
            (route, routed_at) = node.route_versioned(key.as_bytes());
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
                    (route, routed_at) = node.route_versioned(key.as_bytes());
                    if route == Route::Local {
                        return unsettled().into_response();
                    }
                    continue;
                }
            },
            Route::Forward { ref address, .. } => {
                let user = crate::auth::user_to_pass_on(&state, &headers, principal.as_deref());
                match forward(&state, address, routed_at, method.clone(), &path, &headers, user.as_ref(), body.clone()).await {
                    Ok(r) => r,
                    Err(e) => return e.into_response(),
                }
            }
            other => return refuse(&state, other),
        };
        if answer.status() != StatusCode::MISDIRECTED_REQUEST {
            return answer;
        }
        if !reroute.again(node, routed_at).await {
            // A client that does not route itself never sees `not_my_partition`: the
            // request was applied nowhere, and it may simply be sent again.
            return unsettled().into_response();
        }
        (route, routed_at) = node.route_versioned(key.as_bytes());
    }
}

/// `503 unavailable` for a client's request (or a key of its `_get` / `_bulk`) that met its
/// partition moving and did not find where it went within [`HANDOVER_WAIT`]: it was applied
/// nowhere; a retry goes where the map says by then.
pub(crate) fn unsettled() -> ApiError {
    ApiError::unavailable(format!(
        "the key's partition is moving between members and its new place was not settled within {} s; nothing was applied, retry",
        HANDOVER_WAIT.as_secs()
    ))
}

/// `421 not_my_partition`: `owner` holds the key's partition at `map_version`.
fn misdirected(map_version: u64, owner: NodeId) -> Response {
    let mut e = ApiError::new(
        StatusCode::MISDIRECTED_REQUEST,
        "not_my_partition",
        format!("node {} holds this key's partition at map version {map_version}", owner.0),
    );
    e.details.push(("map_version", serde_json::Value::from(map_version)));
    e.details.push(("node", serde_json::Value::from(owner.0)));
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
        _ => not_serving(state).into_response(),
    }
}

/// Headers a forwarded request keeps (the rest are hop-by-hop or the client's own).
const FORWARDED_REQUEST_HEADERS: &[&str] = &["content-type", "if-match", "if-none-match", DIRECT_HEADER];
/// Headers a forwarded answer keeps.
const FORWARDED_ANSWER_HEADERS: &[&str] = &["content-type", "etag", "x-shoal-expiry"];

/// Sends a request to the member at `address`, with the client's `headers` that matter and
/// `user`, the signed user it runs for (`auth::user_to_pass_on`).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn forward(
    state: &AppState,
    address: &str,
    routed_at: u64,
    method: Method,
    path: &str,
    headers: &HeaderMap,
    user: Option<&HeaderValue>,
    body: Bytes,
) -> Result<Response, ApiError> {
    if state.faults.is_cut(address) {
        return Err(Faults::cut_error(address));
    }
    let mut request = state
        .forwarder
        .request(method, state.member_url(address, path))
        .timeout(FORWARD_TIMEOUT)
        .header(FORWARDED_HEADER, routed_at.to_string());
    for name in FORWARDED_REQUEST_HEADERS {
        if let Some(v) = headers.get(*name) {
            request = request.header(*name, v.as_bytes());
        }
    }
    if let Some(user) = user {
        request = request.header(crate::auth::USER_HEADER, user.as_bytes());
    }
    let answer = request.body(body).send().await.map_err(|e| lost_call("the node holding the key", &e))?;
    let status = answer.status();
    let mut out = HeaderMap::new();
    for name in FORWARDED_ANSWER_HEADERS {
        if let Some(v) = answer.headers().get(*name) {
            if let Ok(v) = HeaderValue::from_bytes(v.as_bytes()) {
                out.insert(*name, v);
            }
        }
    }
    let bytes = answer.bytes().await.map_err(|e| lost_call("the node holding the key", &e))?;
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
pub fn forwarder(tls: Option<&crate::tls::Tls>) -> Result<reqwest::Client, reqwest::Error> {
    crate::transport::member_client(reqwest::Client::builder().tcp_nodelay(true).no_proxy().pool_max_idle_per_host(256), tls).build()
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

/// Partition `p` has no active copy now.
pub(crate) fn no_active(p: u16) -> ApiError {
    ApiError::unavailable(format!("partition {p} has no active copy now, so the answer would miss it; try again"))
}
