//! Shoal's HTTP server: the API of `shared/API.md` over a [`shoal_storage::Store`].
//!
//! Only this crate knows HTTP. Handlers parse and validate their own input (see
//! [`extract`]) so that every rejection is an API error with a code, never axum's default.

mod changes;
mod collections;
mod cpu;
mod docs;
mod error;
mod extract;
mod indexes;
mod ops;
mod query;
mod subdoc;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::routing::{get, post, put};
use axum::Router;
use shoal_storage::{Store, StoreConfig};
use thiserror::Error;
use tokio::sync::watch;

pub use cpu::lower_this_thread;
pub use error::ApiError;

/// How long a shutdown waits for open requests (long feeds are told to end at once).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

#[derive(Debug, Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error(transparent)]
    Open(#[from] shoal_storage::OpenError),
    #[error("indexes: {0}")]
    Index(#[from] shoal_index::IndexError),
    #[error("analytics: {0}")]
    Shadow(#[from] shoal_query::shadow::ShadowError),
    #[error("server: {0}")]
    Io(#[from] std::io::Error),
}

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub listen: String,
    pub store: StoreConfig,
    /// Index build and maintenance workers (default: one per core).
    pub index_workers: Option<usize>,
    /// Analytics partitions per collection (default: min(cores, analytics memory GiB, 16));
    /// 0 turns the analytics shadows off.
    pub analytics_partitions: Option<usize>,
    /// Memory for analytics in bytes (default: a quarter of the machine's).
    pub analytics_memory: Option<u64>,
}

/// Shared by every handler.
#[derive(Clone)]
pub struct AppState {
    pub store: Arc<Store>,
    pub started: Instant,
    pub metrics: metrics_exporter_prometheus::PrometheusHandle,
    /// Parsed trees of hot large documents, for sub-document requests.
    pub parsed: Arc<subdoc::ParsedDocs>,
    /// Secondary indexes of every collection.
    pub indexes: Arc<shoal_index::IndexManager>,
    /// SQL over collections.
    pub query: Arc<shoal_query::QueryEngine>,
    /// The columnar shadows analytics reads.
    pub shadows: Arc<shoal_query::shadow::ShadowManager>,
    /// Low-priority threads for CPU-heavy request work.
    pub cpu: cpu::CpuPool,
    /// Becomes `true` when the server shuts down; long feeds end then.
    pub shutdown: watch::Receiver<bool>,
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/health", get(ops::health))
        .route("/v1/node", get(ops::node))
        .route("/metrics", get(ops::metrics))
        .route("/v1/collections", get(collections::list))
        .route("/v1/collections/{c}", put(collections::create).delete(collections::drop))
        .route("/v1/collections/{c}/docs/{key}", get(docs::get).put(docs::put).delete(docs::remove))
        .route("/v1/collections/{c}/docs/", get(empty_key).put(empty_key).delete(empty_key))
        .route("/v1/collections/{c}/docs/{key}/touch", post(docs::touch))
        .route("/v1/collections/{c}/docs/{key}/unlock", post(docs::unlock))
        .route("/v1/collections/{c}/docs/{key}/lookup", post(subdoc::lookup))
        .route("/v1/collections/{c}/docs/{key}/mutate", post(subdoc::mutate))
        .route("/v1/collections/{c}/_get", post(docs::multi_get))
        .route("/v1/collections/{c}/_bulk", post(docs::bulk))
        .route("/v1/collections/{c}/changes", get(changes::changes))
        .route("/v1/collections/{c}/indexes", get(indexes::list).post(indexes::create))
        .route("/v1/collections/{c}/indexes/_build", post(indexes::build_many))
        .route("/v1/collections/{c}/indexes/{name}", axum::routing::delete(indexes::drop))
        .route("/v1/collections/{c}/indexes/{name}/build", post(indexes::build))
        .route("/v1/collections/{c}/indexes/{name}/scan", post(indexes::scan))
        .route("/v1/query", post(query::query))
        .route("/v1/analytics", post(query::analytics))
        .fallback(fallback)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn(ops::telemetry))
        .with_state(state)
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
}

impl Server {
    /// Opens the store (recovering it if needed) and binds the listen address.
    pub async fn bind(config: ServerConfig) -> Result<Server, ServerError> {
        let store_config = config.store.clone();
        let store = tokio::task::spawn_blocking(move || Store::open(store_config))
            .await
            .map_err(|e| ServerError::Io(std::io::Error::other(e)))??;
        let listener = tokio::net::TcpListener::bind(&config.listen)
            .await
            .map_err(|source| ServerError::Bind { addr: config.listen.clone(), source })?;
        let workers = config.index_workers.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2));
        let indexes = shoal_index::IndexManager::open(Arc::clone(&store), workers)?;
        let (shutdown_tx, shutdown) = watch::channel(false);
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
        let memory = config.analytics_memory.unwrap_or_else(|| machine_memory() / 4);
        let analytics = config.analytics_partitions.unwrap_or_else(|| shoal_query::shadow::default_partitions(cores, memory));
        let s = Arc::clone(&store);
        let shadows = tokio::task::spawn_blocking(move || shoal_query::shadow::ShadowManager::open(s, analytics))
            .await
            .map_err(|e| ServerError::Io(std::io::Error::other(e)))??;
        let query = Arc::new(shoal_query::QueryEngine::new(Arc::clone(&store), Arc::clone(&indexes), Arc::clone(&shadows), cores));
        let state = AppState {
            store,
            indexes,
            query,
            shadows,
            started: Instant::now(),
            metrics: ops::prometheus(),
            parsed: Arc::default(),
            cpu: cpu::CpuPool::new()?,
            shutdown,
        };
        Ok(Server { listener, state, shutdown_tx })
    }

    pub fn local_addr(&self) -> Result<SocketAddr, ServerError> {
        Ok(self.listener.local_addr()?)
    }

    /// Serves until `shutdown` resolves, then drains requests briefly and closes the store
    /// cleanly (everything flushed and fsynced).
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> Result<(), ServerError> {
        use axum::serve::ListenerExt;
        let Server { listener, state, shutdown_tx } = self;
        let store = Arc::clone(&state.store);
        let indexes = Arc::clone(&state.indexes);
        let shadows = Arc::clone(&state.shadows);
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let (stopping_tx, mut stopping_rx) = watch::channel(false);
        let signal = async move {
            shutdown.await;
            tracing::info!("shutting down");
            let _ = shutdown_tx.send(true);
            let _ = stopping_tx.send(true);
        };
        let serve = axum::serve(listener, router(state)).with_graceful_shutdown(signal);
        let serve = tokio::spawn(async move { serve.await });
        let _ = stopping_rx.wait_for(|s| *s).await;
        if tokio::time::timeout(SHUTDOWN_GRACE, serve).await.is_err() {
            tracing::warn!("requests still open after the grace period; closing anyway");
        }
        shadows.close().await;
        if let Err(e) = indexes.close() {
            tracing::warn!(error = %e, "closing the index database");
        }
        tokio::task::spawn_blocking(move || store.close()).await.map_err(|e| ServerError::Io(std::io::Error::other(e)))??;
        Ok(())
    }
}

/// Physical memory in bytes (`/proc/meminfo`; 4 GiB where it cannot be read).
fn machine_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines().find(|l| l.starts_with("MemTotal:")).and_then(|l| l.split_whitespace().nth(1)).and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(4 << 30, |kb| kb * 1024)
}
