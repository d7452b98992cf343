//! Shoal's HTTP server: the API of `shared/API.md` over a [`shoal_engine::Engine`].
//!
//! Only this crate knows HTTP. Handlers parse and validate their own input (see
//! [`extract`]) so that every rejection is an API error with a code, never axum's default.

mod audit;
pub mod auth;
mod changes;
pub mod cluster;
mod collections;
mod conn;
mod copy_io;
mod cpu;
mod docs;
mod error;
mod extract;
mod indexes;
mod limits;
mod ops;
mod query;
pub mod routing;
mod spread;
mod subdoc;
pub mod tls;
pub mod transport;
mod users;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use shoal_engine::{Engine, EngineConfig};
use shoal_node::{ClusterConfig, ClusterNode};
use thiserror::Error;
use tokio::sync::watch;

pub use conn::{BODY_READ_TIMEOUT, CONNECTIONS_MAX, HEADER_READ_TIMEOUT, IDLE_TIMEOUT};
pub use error::ApiError;

#[derive(Debug, Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error(transparent)]
    Engine(#[from] shoal_engine::EngineError),
    #[error("cluster: {0}")]
    Cluster(#[from] shoal_node::ClusterError),
    #[error("HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    #[error("server: {0}")]
    Io(#[from] std::io::Error),
    #[error("TLS: {0}")]
    Tls(#[from] tls::TlsError),
}

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub listen: String,
    /// The node's database: storage, indexes, analytics, SQL.
    pub engine: EngineConfig,
    /// Connection cap and timeouts.
    pub connections: ConnectionLimits,
    /// How the node takes part in its cluster (an empty `advertise` means the bound address).
    pub cluster: ClusterConfig,
    /// Whether `POST /v1/_internal/faults` may cut this node off from other members (for
    /// fault tests: a network partition without network namespaces).
    pub fault_injection: bool,
    /// The password of the first start's `admin` (`SHOAL_ADMIN_PASSWORD`); `None` generates
    /// one, kept in `<first data path>/admin-password`.
    pub admin_password: Option<String>,
    /// `--tls-cert`, `--tls-key`, `--tls-ca`: the port speaks TLS only, and so do members.
    pub tls: Option<tls::TlsFiles>,
}

/// How many client connections the node holds and how long it waits for slow or idle ones.
#[derive(Clone, Copy, Debug)]
pub struct ConnectionLimits {
    /// Most open connections; one more gets `503` and is closed.
    pub max: usize,
    /// Longest wait for a request's headers (HTTP/1), idle keep-alive included.
    pub header_read_timeout: std::time::Duration,
    /// A connection with nothing in flight and no bytes moving this long is closed.
    pub idle_timeout: std::time::Duration,
    /// A request body's first deadline, extended as bytes arrive (see `extract::body`).
    pub body_read_timeout: std::time::Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max: conn::CONNECTIONS_MAX,
            header_read_timeout: conn::HEADER_READ_TIMEOUT,
            idle_timeout: conn::IDLE_TIMEOUT,
            body_read_timeout: conn::BODY_READ_TIMEOUT,
        }
    }
}

/// Shared by every handler, behind one `Arc`: axum's layers clone the state (and the
/// services below them) on every request, and a clone of the fields one by one cost a dozen
/// contended reference counts per layer; this costs one.
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

impl std::ops::Deref for AppState {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// What [`AppState`] shares.
pub struct Shared {
    /// Storage, indexes, shadows and SQL, with every collection side effect.
    pub engine: Arc<Engine>,
    pub started: Instant,
    pub metrics: metrics_exporter_prometheus::PrometheusHandle,
    /// Parsed trees of hot large documents, for sub-document requests.
    pub parsed: Arc<subdoc::ParsedDocs>,
    /// Low-priority threads for CPU-heavy request work.
    pub cpu: cpu::CpuPool,
    /// Becomes `true` when the server shuts down; long feeds end then.
    pub shutdown: watch::Receiver<bool>,
    /// A request body's first deadline (see `extract::body`).
    pub body_timeout: std::time::Duration,
    /// Per-class concurrency limits.
    pub limits: limits::Limits,
    /// This node as a cluster member: metadata, routing, replication, failover.
    pub cluster: Arc<ClusterNode>,
    /// The HTTP client that forwards requests to the node holding a key.
    pub forwarder: reqwest::Client,
    /// The members this node is cut off from by fault injection.
    pub faults: Arc<transport::Faults>,
    /// The thread that moves partition copies' bytes, off the request threads.
    pub copy_io: Arc<copy_io::CopyIo>,
    /// Verified credentials and failed logins (`auth`).
    pub auth: Arc<auth::Auth>,
    /// The node's TLS, if it speaks TLS (then members call each other over it).
    pub tls: Option<Arc<tls::Tls>>,
}

impl AppState {
    /// The URL of `path` on the member at `address` (`https` when the cluster runs TLS).
    pub(crate) fn member_url(&self, address: &str, path_and_query: &str) -> String {
        transport::member_url(self.tls.is_some(), address, path_and_query)
    }
}

pub fn router(state: AppState) -> Router {
    use axum::routing::MethodFilter;
    // Every route is added here, through its access rule (`auth::RULES`): a route without
    // one stops the server at its start, so none can be served unchecked.
    fn at<H, T>(router: Router<AppState>, method: &'static str, path: &'static str, handler: H) -> Router<AppState>
    where
        H: axum::handler::Handler<T, AppState>,
        T: 'static,
    {
        assert!(auth::rule_of(method, path).is_some(), "route {method} {path} has no access rule in auth::RULES");
        let filter = match method {
            "GET" => MethodFilter::GET,
            "PUT" => MethodFilter::PUT,
            "POST" => MethodFilter::POST,
            "DELETE" => MethodFilter::DELETE,
            other => panic!("route {other} {path}: no such method here"),
        };
        router.route(path, axum::routing::on(filter, handler))
    }
    // Key requests go where the key's active copy is (see `routing::route`).
    let mut keyed = Router::new();
    keyed = at(keyed, "GET", "/v1/collections/{c}/docs/{key}", docs::get);
    keyed = at(keyed, "PUT", "/v1/collections/{c}/docs/{key}", docs::put);
    keyed = at(keyed, "DELETE", "/v1/collections/{c}/docs/{key}", docs::remove);
    keyed = at(keyed, "POST", "/v1/collections/{c}/docs/{key}/touch", docs::touch);
    keyed = at(keyed, "POST", "/v1/collections/{c}/docs/{key}/unlock", docs::unlock);
    keyed = at(keyed, "POST", "/v1/collections/{c}/docs/{key}/lookup", subdoc::lookup);
    keyed = at(keyed, "POST", "/v1/collections/{c}/docs/{key}/mutate", subdoc::mutate);
    let keyed = keyed.route_layer(axum::middleware::from_fn_with_state(state.clone(), routing::route));
    // Calls between members and the cluster API: not limited by the client classes.
    let mut cluster = Router::new();
    cluster = at(cluster, "POST", "/v1/_internal/{op}", transport::internal);
    cluster = at(cluster, "GET", "/v1/cluster", cluster::info);
    cluster = at(cluster, "GET", "/v1/cluster/map", cluster::map);
    cluster = at(cluster, "PUT", "/v1/cluster/settings", cluster::settings);
    cluster = at(cluster, "POST", "/v1/cluster/failover", cluster::failover);
    cluster = at(cluster, "POST", "/v1/cluster/recover", cluster::recover);
    cluster = at(cluster, "POST", "/v1/cluster/nodes", cluster::add_node);
    cluster = at(cluster, "POST", "/v1/cluster/rebalance", cluster::rebalance);
    cluster = at(cluster, "GET", "/v1/cluster/rebalance", cluster::rebalance_status);
    cluster = at(cluster, "DELETE", "/v1/cluster/rebalance", cluster::rebalance_stop);
    cluster = at(cluster, "GET", "/v1/whoami", users::whoami);
    cluster = at(cluster, "GET", "/v1/users", users::list);
    cluster = at(cluster, "PUT", "/v1/users/{name}", users::put);
    cluster = at(cluster, "DELETE", "/v1/users/{name}", users::delete);
    // Every member is a worker of distributed analytics, on this same port (gRPC over h2c).
    let worker = state.engine.query().attach_cluster(Arc::new(transport::WorkerMember {
        node: Arc::clone(&state.cluster),
        tls: state.tls.as_ref().map(|t| t.peer_h2()),
    }));
    let workers = Router::new()
        .route_service(
            &format!("{}{{*call}}", shoal_query::distributed::WORKER_PATH_PREFIX),
            worker.into_worker_server().max_decoding_message_size(shoal_query::distributed::WORKER_MESSAGE_MAX_BYTES),
        )
        .layer(axum::middleware::from_fn(transport::on_query_runtime))
        .layer(axum::middleware::from_fn_with_state(state.clone(), transport::members_only));
    let mut api = Router::new();
    api = at(api, "GET", "/v1/health", ops::health);
    api = at(api, "GET", "/v1/node", ops::node);
    api = at(api, "GET", "/metrics", ops::metrics);
    api = at(api, "GET", "/v1/collections", collections::list);
    api = at(api, "PUT", "/v1/collections/{c}", collections::create);
    api = at(api, "DELETE", "/v1/collections/{c}", collections::drop);
    api = at(api, "GET", "/v1/collections/{c}/docs/", empty_key);
    api = at(api, "PUT", "/v1/collections/{c}/docs/", empty_key);
    api = at(api, "DELETE", "/v1/collections/{c}/docs/", empty_key);
    api = at(api, "POST", "/v1/collections/{c}/_get", docs::multi_get);
    api = at(api, "POST", "/v1/collections/{c}/_bulk", docs::bulk);
    api = at(api, "GET", "/v1/collections/{c}/changes", changes::changes);
    api = at(api, "GET", "/v1/collections/{c}/indexes", indexes::list);
    api = at(api, "POST", "/v1/collections/{c}/indexes", indexes::create);
    api = at(api, "POST", "/v1/collections/{c}/indexes/_build", indexes::build_many);
    api = at(api, "DELETE", "/v1/collections/{c}/indexes/{name}", indexes::drop);
    api = at(api, "POST", "/v1/collections/{c}/indexes/{name}/build", indexes::build);
    api = at(api, "POST", "/v1/collections/{c}/indexes/{name}/scan", indexes::scan);
    api = at(api, "POST", "/v1/query", query::query);
    api = at(api, "POST", "/v1/analytics", query::analytics);
    Router::new()
        .merge(keyed)
        .merge(api)
        .route_layer(axum::middleware::from_fn_with_state(state.limits.clone(), limits::limit))
        .merge(cluster)
        .merge(workers)
        .fallback(fallback)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(state.clone(), front_door))
        .with_state(state)
}

/// The layer in front of every route: times and counts the request (`ops`) and
/// authenticates it (`auth`). One layer rather than two: each axum layer costs every request
/// a boxed future and a clone of the services below it, which a small get measured.
async fn front_door(
    axum::extract::State(state): axum::extract::State<AppState>,
    matched: Option<axum::extract::MatchedPath>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let path = matched.as_ref().map(axum::extract::MatchedPath::as_str);
    let entry = ops::route_of(req.method().as_str(), path);
    let op = entry.map_or("other", |(_, _, op, _)| op);
    let rule = auth::rule_for(entry, req.method(), path);
    let keyed = path.is_some_and(routing::is_keyed);
    ops::timed(op, auth::authenticate(&state, rule, keyed, req, next)).await
}

async fn empty_key() -> ApiError {
    ApiError::invalid_key("key is empty")
}

async fn fallback() -> ApiError {
    ApiError::new(axum::http::StatusCode::NOT_FOUND, "bad_request", "no such endpoint; see API.md")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(axum::http::StatusCode::METHOD_NOT_ALLOWED, "bad_request", "method not allowed on this endpoint")
}

/// A bound, ready server: the store is open and the socket listens.
pub struct Server {
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown_tx: watch::Sender<bool>,
    connections: ConnectionLimits,
    admin_password: Option<String>,
    first_admin: watch::Sender<Option<auth::FirstAdmin>>,
}

impl Server {
    /// Opens the engine (recovering the store if needed) and binds the listen address.
    pub async fn bind(config: ServerConfig) -> Result<Server, ServerError> {
        // First: what opening the store, indexes and shadows counts (rebuilds) is kept.
        let metrics = ops::prometheus();
        // A node running the index service holds the index partitions placed on it, fed
        // from the data partitions' actives wherever they are (`shoal_node::feed`).
        let services = config.cluster.services;
        let feed = services.index.then(shoal_node::feed::FeedLink::new);
        let mut engine_config = config.engine.clone();
        if let Some(link) = &feed {
            engine_config.index_feed = Some(shoal_engine::IndexFeed(Arc::clone(link) as Arc<dyn shoal_index::ChangeFetcher>));
        }
        // Before anything opens: a TLS file that cannot be read stops the start.
        let tls = config.tls.clone().map(tls::Tls::load).transpose()?;
        let engine = Engine::open(engine_config).await?;
        let listener = listen(&config.listen).await.map_err(|source| ServerError::Bind { addr: config.listen.clone(), source })?;
        for path in engine.store().data_paths() {
            error::hide_paths_under(path);
        }
        let (shutdown_tx, shutdown) = watch::channel(false);
        let cores = engine.cores();
        let mut cluster_config = config.cluster.clone();
        if cluster_config.advertise.is_empty() {
            cluster_config.advertise = listener.local_addr()?.to_string();
        }
        let faults = Arc::new(transport::Faults::new(config.fault_injection));
        let peer_faults = Arc::clone(&faults);
        let copy_io = Arc::new(copy_io::CopyIo::start()?);
        let peer_copy_io = Arc::clone(&copy_io);
        let peer_tls = tls.clone();
        let cluster = ClusterNode::open(Arc::clone(&engine), cluster_config, move |secret| {
            transport::HttpPeers::new(secret, peer_faults, peer_copy_io, peer_tls.as_deref())
                .map(|p| Arc::new(p) as Arc<dyn shoal_node::Peers>)
                .map_err(|e| shoal_node::ClusterError::Identity(e.to_string()))
        })
        .await?;
        if let Some(link) = &feed {
            link.attach(&cluster);
        }
        let audit_dir = engine.store().data_paths()[0].clone();
        let state = AppState(Arc::new(Shared {
            engine,
            started: Instant::now(),
            metrics,
            parsed: Arc::default(),
            cpu: cpu::CpuPool::new()?,
            shutdown,
            body_timeout: config.connections.body_read_timeout,
            limits: limits::Limits::new(cores),
            cluster,
            forwarder: routing::forwarder(tls.as_deref())?,
            faults,
            copy_io,
            auth: Arc::new(auth::Auth::new(&audit_dir)),
            tls,
        }));
        let (first_admin, _) = watch::channel(None);
        Ok(Server { listener, state, shutdown_tx, connections: config.connections, admin_password: config.admin_password, first_admin })
    }

    pub fn local_addr(&self) -> Result<SocketAddr, ServerError> {
        Ok(self.listener.local_addr()?)
    }

    /// Told once if this node makes the cluster's first admin with a generated password.
    pub fn first_admin(&self) -> watch::Receiver<Option<auth::FirstAdmin>> {
        self.first_admin.subscribe()
    }

    /// Serves until `shutdown` resolves (or the storage engine must be reopened), then
    /// drains requests briefly and closes the store cleanly (everything flushed and
    /// fsynced). Says whether the caller should start the node again at once.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> Result<RunOutcome, ServerError> {
        let Server { listener, state, shutdown_tx, connections, admin_password, first_admin } = self;
        let engine = Arc::clone(&state.engine);
        let restart = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let fatal: Arc<parking_lot::Mutex<Option<String>>> = Arc::default();
        let signal = {
            let (engine, restart, shutdown_tx) = (Arc::clone(&engine), Arc::clone(&restart), shutdown_tx.clone());
            let (mut cluster_fatal, fatal) = (state.cluster.fatal(), Arc::clone(&fatal));
            let mut rejoin = state.cluster.rejoin();
            async move {
                let engine_poisoned = async {
                    while !engine.restart_needed() {
                        tokio::time::sleep(shoal_storage::DISK_WATCH_INTERVAL).await;
                    }
                };
                tokio::select! {
                    _ = shutdown => tracing::info!("shutting down"),
                    Ok(reason) = cluster_fatal.wait_for(Option::is_some) => {
                        *fatal.lock() = reason.clone();
                    }
                    Ok(_) = rejoin.wait_for(|r| *r) => {
                        tracing::info!("restarting to join the cluster that invited this node");
                        restart.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                    _ = engine_poisoned => {
                        tracing::warn!("restarting to reopen the storage engine after a full disk");
                        restart.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                }
                let _ = shutdown_tx.send(true);
            }
        };
        tokio::spawn(signal);
        state.cluster.start();
        tokio::spawn(auth::ensure_first_admin(state.clone(), admin_password, first_admin));
        if let Some(tls) = &state.tls {
            tokio::spawn(reload_on_hangup(Arc::clone(tls)));
        }
        conn::serve(listener, router(state.clone()), connections, state.tls.clone(), state.shutdown.clone()).await;
        let restart = restart.load(std::sync::atomic::Ordering::SeqCst);
        state.cluster.shutdown().await;
        let closed = engine.close().await;
        if let Some(reason) = fatal.lock().take() {
            return Err(ServerError::Cluster(shoal_node::ClusterError::Refused(reason)));
        }
        match (closed, restart) {
            (Ok(()), false) => Ok(RunOutcome::Stopped),
            // A poisoned engine cannot flush; its journal (in the page cache) has every
            // acknowledged write, and the next start recovers from it.
            (_, true) => Ok(RunOutcome::Restart),
            (Err(e), false) => Err(e.into()),
        }
    }
}

/// Reads the TLS files again on each `SIGHUP` (a renewed certificate, a new CA).
async fn reload_on_hangup(tls: Arc<tls::Tls>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hangups) = signal(SignalKind::hangup()) else {
        tracing::warn!("cannot watch for SIGHUP; TLS files are read at the start only");
        return;
    };
    while hangups.recv().await.is_some() {
        match tls.reload() {
            Ok(()) => {
                metrics::counter!("shoal_tls_reloads_total", "outcome" => "ok").increment(1);
                tracing::info!("TLS certificate, key and CA read again (SIGHUP)");
            }
            Err(e) => {
                metrics::counter!("shoal_tls_reloads_total", "outcome" => "failed").increment(1);
                tracing::warn!(error = %e, "SIGHUP: the TLS files could not be read; the ones loaded stay");
            }
        }
    }
}

/// How [`Server::run`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunOutcome {
    /// Asked to stop; everything is closed cleanly.
    Stopped,
    /// Start the node again (the process re-executes itself): the storage engine was
    /// poisoned by a full disk and space is back, or the node accepted an invitation to
    /// join a cluster.
    Restart,
}

/// Pending connections the kernel queues before `accept` (capped by `net.core.somaxconn`):
/// std's default of 128 drops connection attempts in a burst, and those clients wait a
/// second before they try again.
const LISTEN_BACKLOG: u32 = 4096;

/// Binds the listen address with [`LISTEN_BACKLOG`] (the first address it resolves to).
async fn listen(addr: &str) -> std::io::Result<tokio::net::TcpListener> {
    let addr = tokio::net::lookup_host(addr)
        .await?
        .next()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "the address resolves to nothing"))?;
    let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}
