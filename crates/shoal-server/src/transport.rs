//! The transport between members: calls to other members (`HttpPeers`, the
//! [`shoal_node::Peers`] the node is given: the cluster secret in a header, copies on their
//! own connection and thread), the endpoint that answers them (`POST /v1/_internal/{op}`),
//! how a failed call maps to an answer ([`lost_call`], [`refusal`]), and the switchable
//! network partition of fault tests. It knows nothing of routing or of the endpoints above.

use std::time::Duration;

use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::Deserialize;
use shoal_node::{ChunkStream, Op, PeerError, PeerFuture, PeerStreamFuture, Peers};

use crate::copy_io::{CopyIo, COPY_PROTOCOL};
use crate::docs::json_response;
use crate::error::{cluster_error, ApiError};
use crate::extract;
use crate::tls::{MemberCert, Tls};
use crate::AppState;

/// The header that carries the cluster secret between members.
pub const SECRET_HEADER: &str = "x-shoal-cluster-secret";
/// Largest body of a call between members (a Raft snapshot chunk, a pull with its acks).
pub const INTERNAL_BODY_MAX_BYTES: usize = 64 * 1024 * 1024;
/// Largest answer a member accepts from another (a replication batch).
pub const PEER_ANSWER_MAX_BYTES: usize = 256 * 1024 * 1024;
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
    /// Collections (names) whose analytics shadows here apply no change, as a shadow on a
    /// slow disk would lag; empty releases them.
    #[serde(default)]
    hold_shadows: Vec<String>,
    /// Milliseconds each partition map waits here before the partition states follow it
    /// (the metadata has it at once); 0 or absent: none.
    #[serde(default)]
    map_delay_ms: u64,
    /// Milliseconds each index copy adopted here waits once built before it answers (a
    /// rebalance holds its copies unnamed that long); 0 or absent: none.
    #[serde(default)]
    index_adopt_delay_ms: u64,
}

/// `POST /v1/_internal/faults {"cut": [address, ...], "hold"?: [collection, ...], "hold_shadows"?: [collection, ...], "map_delay_ms"?: n, "index_adopt_delay_ms"?: n}` (with the
/// cluster secret, on a node started with `--fault-injection`).
async fn set_faults(state: &AppState, body: &[u8]) -> Result<Response, ApiError> {
    if !state.faults.enabled {
        return Err(ApiError::new(StatusCode::NOT_FOUND, "bad_request", "fault injection is off on this node (serve --fault-injection)"));
    }
    let req: FaultsBody = extract::json_body(body)?;
    let delay = Duration::from_millis(req.map_delay_ms);
    let adopt_delay = Duration::from_millis(req.index_adopt_delay_ms);
    for (field, d) in [("map_delay_ms", delay), ("index_adopt_delay_ms", adopt_delay)] {
        if d > shoal_node::faults::MAP_DELAY_MAX {
            return Err(ApiError::bad_request(format!("{field} is over {} ms", shoal_node::faults::MAP_DELAY_MAX.as_millis())));
        }
    }
    let store = state.engine.store();
    let shadows_held = req
        .hold_shadows
        .iter()
        .map(|n| store.collection(n).map(|c| c.id()).ok_or_else(|| ApiError::bad_request(format!("no collection {n}"))))
        .collect::<Result<std::collections::HashSet<u32>, ApiError>>()?;
    state.cluster.hold_collections(&req.hold).map_err(|e| ApiError::bad_request(e.to_string()))?;
    state.engine.shadows().hold(shadows_held);
    state.cluster.delay_maps(delay);
    state.cluster.delay_index_adoptions(adopt_delay);
    tracing::warn!(cut = ?req.cut, hold = ?req.hold, hold_shadows = ?req.hold_shadows, ?delay, ?adopt_delay, "fault injection: calls to these members fail, replicated changes of these collections wait, these shadows wait, maps and index adoptions wait");
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
    /// Whether members speak TLS (`https`).
    https: bool,
    faults: std::sync::Arc<Faults>,
    /// The node's runtime: calls run there whoever makes them (a statement on the query
    /// runtime asking a member), so that the pooled connections they leave behind are
    /// driven by I/O threads, never by a runtime busy with a statement.
    io: Option<tokio::runtime::Handle>,
}

impl HttpPeers {
    pub fn new(
        secret: &str,
        faults: std::sync::Arc<Faults>,
        copy_io: std::sync::Arc<CopyIo>,
        tls: Option<&Tls>,
    ) -> Result<HttpPeers, reqwest::Error> {
        let client = member_client(reqwest::Client::builder().tcp_nodelay(true).no_proxy().pool_max_idle_per_host(64), tls).build()?;
        let copy_client =
            member_client(reqwest::Client::builder().tcp_nodelay(true).no_proxy().http1_only().pool_max_idle_per_host(0), tls).build()?;
        let io = tokio::runtime::Handle::try_current().ok();
        Ok(HttpPeers { client, copy_client, copy_io, secret: secret.to_string(), https: tls.is_some(), faults, io })
    }
}

/// A client for calls to other members: over TLS with this node's certificate, verifying
/// theirs by the CA, when the node speaks TLS.
pub(crate) fn member_client(builder: reqwest::ClientBuilder, tls: Option<&Tls>) -> reqwest::ClientBuilder {
    // reqwest builds a TLS configuration for every client, `https` or not, from the
    // process's provider: `ring` (no other is built in).
    let _ = rustls::crypto::ring::default_provider().install_default();
    match tls {
        Some(tls) => builder.tls_backend_preconfigured(tls.peer_http1().as_ref().clone()),
        None => builder,
    }
}

/// The URL of `path_and_query` on the member at `address`.
pub(crate) fn member_url(https: bool, address: &str, path_and_query: &str) -> String {
    let scheme = if https { "https" } else { "http" };
    format!("{scheme}://{address}{path_and_query}")
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
            .post(member_url(self.https, address, &format!("/v1/_internal/{}", op.name())))
            .header(SECRET_HEADER, secret)
            .timeout(timeout)
            .body(body)
            .send();
        let address = address.to_string();
        let called = address.clone();
        let call = async move {
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
        };
        match &self.io {
            Some(io) => {
                let task = shoal_query::runtime::AbortOnDrop(io.spawn(call));
                Box::pin(async move {
                    task.join()
                        .await
                        .unwrap_or_else(|e| Err(PeerError::Unreachable { address: called, why: format!("the call's task ended: {e}") }))
                })
            }
            None => Box::pin(call),
        }
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
        let request = self
            .copy_client
            .post(member_url(self.https, address, &format!("/v1/_internal/{}", op.name())))
            .header(SECRET_HEADER, &self.secret)
            .body(body);
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

/// `POST /v1/_internal/{op}`: a call from another member, if it carries the secret.
pub async fn internal(State(state): State<AppState>, Path(op): Path<String>, request: Request) -> Result<Response, ApiError> {
    let (mut parts, body) = request.into_parts();
    let headers = &parts.headers;
    let node = &state.cluster;
    if let Some(refused) = without_member_cert(&state, &parts.extensions) {
        return Err(refused);
    }
    let given = headers.get(SECRET_HEADER).map(|v| v.as_bytes()).unwrap_or_default();
    // An invitation comes from a cluster whose secret this node does not know yet; only a
    // lone node with no collections takes it (`ClusterNode::invite`).
    let member = constant_time_eq(given, node.secret().as_bytes());
    if !member && op != Op::Invite.name() {
        return Err(ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "calls between members need the cluster secret"));
    }
    let body = extract::body(&state, body, INTERNAL_BODY_MAX_BYTES).await?;
    if !member {
        // An invitation: it must carry an administrator of this node (see `auth`).
        crate::auth::check_invitation(&state, &body, crate::auth::source_of_parts(&parts.extensions)).await?;
    }
    if op == "faults" {
        return set_faults(&state, &body).await;
    }
    let op = Op::from_name(&op).ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "bad_request", format!("no internal call {op}")))?;
    if op.is_streamed() {
        // The copy's bytes go over the same connection switched to the copy protocol, on
        // the copies' own thread (`copy_io`).
        let asked = parts.headers.get(header::UPGRADE).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(COPY_PROTOCOL.as_bytes()));
        let upgrade = parts.extensions.remove::<hyper::upgrade::OnUpgrade>().filter(|_| asked).ok_or_else(|| {
            ApiError::bad_request(format!("an export answers over HTTP/1.1 switched to `{COPY_PROTOCOL}` (`Upgrade: {COPY_PROTOCOL}`)"))
        })?;
        let chunks = node.export_stream(op, &body).map_err(cluster_error)?;
        let socket = parts.extensions.remove::<crate::conn::Socket>();
        state.copy_io.send(upgrade, socket, chunks);
        return Ok((StatusCode::SWITCHING_PROTOCOLS, [(header::CONNECTION, "upgrade"), (header::UPGRADE, COPY_PROTOCOL)]).into_response());
    }
    let answer = node.handle(op, &body).await.map_err(cluster_error)?;
    Ok((StatusCode::OK, [(header::CONTENT_TYPE, "application/octet-stream")], answer).into_response())
}

/// This node as a worker of distributed analytics (`shoal_query::distributed`): its tasks
/// read by the node's map, and its calls to other workers carry the cluster secret.
pub(crate) struct WorkerMember {
    pub node: std::sync::Arc<shoal_node::ClusterNode>,
    /// The members' TLS client configuration (h2), when the cluster speaks TLS.
    pub tls: Option<std::sync::Arc<rustls::ClientConfig>>,
}

impl shoal_query::distributed::LocalMember for WorkerMember {
    fn address(&self) -> String {
        self.node.address().to_string()
    }

    fn actives_at(&self, map_version: u64) -> Result<Vec<bool>, String> {
        self.node.actives_at(map_version)
    }

    fn call_headers(&self) -> Vec<(String, String)> {
        vec![(SECRET_HEADER.to_string(), self.node.secret().to_string())]
    }

    fn tls(&self) -> Option<std::sync::Arc<rustls::ClientConfig>> {
        self.tls.clone()
    }
}

/// The worker service's calls (gRPC, under `shoal_query::distributed::WORKER_PATH_PREFIX`)
/// come from members only: they carry the cluster secret.
pub async fn members_only(State(state): State<AppState>, request: Request, next: axum::middleware::Next) -> Response {
    if let Some(refused) = without_member_cert(&state, request.extensions()) {
        return refused.into_response();
    }
    let given = request.headers().get(SECRET_HEADER).map(|v| v.as_bytes()).unwrap_or_default();
    if !constant_time_eq(given, state.cluster.secret().as_bytes()) {
        return ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "calls between members need the cluster secret").into_response();
    }
    next.run(request).await
}

/// The worker service's calls run on the query runtime (`shoal_query::runtime`), where
/// the statement tasks they start run too, away from the node's I/O threads.
pub async fn on_query_runtime(request: Request, next: axum::middleware::Next) -> Response {
    let task = shoal_query::runtime::AbortOnDrop(shoal_query::runtime::query_handle().spawn(next.run(request)));
    match task.join().await {
        Ok(response) => response,
        Err(e) => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", format!("the worker call's task ended: {e}")).into_response()
        }
    }
}

/// On a node that speaks TLS, a call between members must come over a connection whose
/// client certificate the CA signed (`tls::MemberCert`), besides carrying the secret.
pub(crate) fn without_member_cert(state: &AppState, extensions: &axum::http::Extensions) -> Option<ApiError> {
    (state.tls.is_some() && extensions.get::<MemberCert>().is_none()).then(|| {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "calls between members need a member's certificate (TLS with a client certificate signed by the cluster's CA)",
        )
    })
}

/// Compares secrets in time that does not depend on where they differ.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

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
        let http = member_client(reqwest::Client::builder(), None).build().unwrap();
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
