//! One node's database below any protocol: storage, secondary indexes, analytics shadows and
//! the SQL engine, opened, kept consistent and closed together.
//!
//! Everything that must happen around a collection happens here, whoever asks: a collection
//! created by an HTTP call and one created from the cluster's metadata log (with an id the log
//! assigned) get the same shadow, and a dropped one loses its indexes either way. The
//! server crate is HTTP over an [`Engine`]; the cluster crate drives one too.
//!
//! Time and ids come from the sources in [`shoal_storage::StoreConfig`] (`time`, `ids`), so a
//! test drives an engine's clock without sleeping.

use std::sync::Arc;

use shoal_index::{IndexError, IndexManager};
use shoal_query::shadow::{ShadowError, ShadowManager};
use shoal_query::{QueryEngine, QueryError};
use shoal_storage::{Collection, CollectionError, CollectionInfo, OpenError, SeqNo, Store, StoreConfig};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum EngineError {
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error(transparent)]
    Collection(#[from] CollectionError),
    #[error("indexes: {0}")]
    Index(#[from] IndexError),
    #[error("analytics: {0}")]
    Shadow(#[from] ShadowError),
    #[error("SQL engine: {0}")]
    Query(#[from] QueryError),
    /// A blocking task died (a panic in storage code): a bug, reported, never hidden.
    #[error("engine task failed: {0}")]
    Task(String),
}

/// How an engine is opened.
#[derive(Clone, Debug, Default)]
pub struct EngineConfig {
    pub store: StoreConfig,
    /// Index build and maintenance workers (default: one per core).
    pub index_workers: Option<usize>,
    /// Analytics partitions per collection (default: min(cores, analytics memory GiB, 16));
    /// 0 turns the analytics shadows off.
    pub analytics_partitions: Option<usize>,
    /// Memory for analytics in bytes (default: a quarter of the machine's).
    pub analytics_memory: Option<u64>,
    /// Where the indexes take their changes from when not from this node's partitions (an
    /// index node of a cluster); `None`: from this node's partitions.
    pub index_feed: Option<IndexFeed>,
}

/// An index node's source of changes (see `shoal_index::ChangeFetcher`).
#[derive(Clone)]
pub struct IndexFeed(pub Arc<dyn shoal_index::ChangeFetcher>);

impl std::fmt::Debug for IndexFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IndexFeed")
    }
}

/// An open node database; see the crate documentation.
pub struct Engine {
    store: Arc<Store>,
    indexes: Arc<IndexManager>,
    shadows: Arc<ShadowManager>,
    query: Arc<QueryEngine>,
    cores: usize,
}

impl Engine {
    /// Opens (or creates) the store, recovering it if needed, then its indexes, shadows and
    /// the SQL engine over them.
    pub async fn open(config: EngineConfig) -> Result<Arc<Engine>, EngineError> {
        let store_config = config.store.clone();
        let store = blocking(move || Store::open(store_config)).await??;
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
        let workers = config.index_workers.unwrap_or(cores);
        let indexes = match &config.index_feed {
            Some(feed) => IndexManager::open_fed(Arc::clone(&store), workers, Arc::clone(&feed.0))?,
            None => IndexManager::open(Arc::clone(&store), workers)?,
        };
        let memory = config.analytics_memory.unwrap_or_else(|| machine_memory() / 4);
        let analytics = config.analytics_partitions.unwrap_or_else(|| shoal_query::shadow::default_partitions(cores, memory));
        let s = Arc::clone(&store);
        let shadows = blocking(move || ShadowManager::open(s, analytics)).await??;
        let query_config = shoal_query::QueryConfig {
            threads: cores,
            node_memory_bytes: shoal_query::QUERY_MEMORY_NODE_DEFAULT_BYTES
                .min(usize::try_from(machine_memory() / 4).unwrap_or(usize::MAX)),
            query_memory_bytes: shoal_query::QUERY_MEMORY_MAX_BYTES,
            spill_dir: store.data_paths()[0].join(shoal_query::SPILL_DIR),
            spill_max_bytes: shoal_query::QUERY_SPILL_DEFAULT_BYTES,
        };
        let query = Arc::new(QueryEngine::new(Arc::clone(&store), Arc::clone(&indexes), Arc::clone(&shadows), query_config)?);
        Ok(Arc::new(Engine { store, indexes, shadows, query, cores }))
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    pub fn indexes(&self) -> &Arc<IndexManager> {
        &self.indexes
    }

    pub fn shadows(&self) -> &Arc<ShadowManager> {
        &self.shadows
    }

    /// Where everything derived from `coll` stands in each partition's change stream: the
    /// lowest of its ready indexes' cursors and its analytics shadow's position (`None` when
    /// nothing derives from it: no ready index and no shadow).
    pub fn derived_positions(&self, coll: &Collection) -> Option<Vec<SeqNo>> {
        let indexes = self.indexes.lowest_positions(coll);
        let shadow = self.shadows.shadow(coll.id()).map(|s| s.applied_seqnos());
        match (indexes, shadow) {
            (Some(i), Some(s)) => Some(i.into_iter().zip(s).map(|(a, b)| a.min(b)).collect()),
            (one, other) => one.or(other),
        }
    }

    pub fn query(&self) -> &Arc<QueryEngine> {
        &self.query
    }

    /// Cores the engine sizes its pools by.
    pub fn cores(&self) -> usize {
        self.cores
    }

    /// Creates a collection (with the id the caller gives, e.g. the cluster's metadata log,
    /// or the next free one) and starts its analytics shadow.
    pub async fn create_collection(&self, name: &str, max_ttl: u32, id: Option<u32>) -> Result<CollectionInfo, EngineError> {
        let (store, shadows, name) = (Arc::clone(&self.store), Arc::clone(&self.shadows), name.to_string());
        blocking(move || {
            let coll = store.create_collection_as(&name, max_ttl, id)?;
            if shadows.partitions() > 0 {
                // A new collection's shadow is empty: attaching it fails only on I/O, and the
                // collection is usable without it (analytics answers that it has none).
                if let Err(e) = shadows.attach(Arc::clone(&coll)) {
                    tracing::warn!(collection = %coll.name(), error = %e, "starting the analytics shadow");
                }
            }
            Ok(coll.info())
        })
        .await?
    }

    /// Drops a collection: its documents go (in the background), then its indexes; its
    /// shadow's maintainer sees the drop and removes the shadow.
    pub async fn drop_collection(&self, name: &str) -> Result<(), EngineError> {
        let id = self.store.collection(name).map(|c| c.id());
        let (store, name) = (Arc::clone(&self.store), name.to_string());
        blocking(move || store.drop_collection(&name)).await??;
        if let Some(id) = id {
            self.indexes.drop_collection(id).await?;
        }
        Ok(())
    }

    /// Whether the storage engine was poisoned (a full disk) and the node must reopen it.
    pub fn restart_needed(&self) -> bool {
        self.store.restart_needed()
    }

    /// Stops the maintainers, checkpoints shadows, closes the index database, then flushes
    /// and fsyncs the store (a clean close: the next start reads no document). Once the
    /// engine is dropped nothing holds the store: it can be opened again in this process.
    pub async fn close(&self) -> Result<(), EngineError> {
        self.shadows.close().await;
        self.indexes.stop().await;
        if let Err(e) = self.indexes.close() {
            tracing::warn!(error = %e, "closing the index database");
        }
        let store = Arc::clone(&self.store);
        blocking(move || store.close()).await??;
        Ok(())
    }
}

/// Runs storage work off the async threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, EngineError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| EngineError::Task(e.to_string()))
}

/// Physical memory in bytes (`/proc/meminfo`; 4 GiB where it cannot be read).
pub fn machine_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines().find(|l| l.starts_with("MemTotal:")).and_then(|l| l.split_whitespace().nth(1)).and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(4 << 30, |kb| kb * 1024)
}
