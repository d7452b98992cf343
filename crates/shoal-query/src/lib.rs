//! SQL over collections (Apache DataFusion).
//!
//! A collection is a table: `meta_id` (the document key) and one column per top-level
//! field, typed from the documents (see [`schema`]); a value that does not fit its column's
//! type is NULL in that row. Filters on `meta_id` become key lookups and filters on an
//! index's leading keys become index scans; everything else reads the documents in key
//! order. DataFusion does the rest (joins, aggregates, windows, subqueries). Knows nothing
//! of HTTP.

mod analytics;
mod bounded;
pub mod convert;
pub mod distributed;
mod fsum;
pub mod gather;
mod merge;
mod pool;
pub mod rows;
pub mod runtime;
pub mod schema;
pub mod shadow;
pub mod spread;
mod table;
#[cfg(test)]
mod testgen;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use datafusion::common::{DataFusionError, ScalarValue};
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::prelude::{SessionConfig, SessionContext};
use parking_lot::Mutex;
use serde_json::Value;
use shoal_index::{Consistency, IndexManager};
use shoal_storage::changes::FeedPosition;
use shoal_storage::{
    follow, ChangeConsumer, ChangesError, Collection, FollowLimits, PartitionBatch, PartitionId, SeqNo, Store, StreamPosition,
};

use crate::schema::Obj;
use crate::shadow::ShadowManager;
use crate::table::{Collections, QueryEnv};

/// Documents read to infer a collection's schema the first time it is queried.
pub const SCHEMA_SAMPLE_DOCS: usize = 1000;
/// Points of each partition's history the sample reads from.
pub const SCHEMA_SAMPLE_STRATA: usize = 8;
/// Changes read per query to widen a cached schema with new documents.
pub const SCHEMA_WIDEN_CHANGES: usize = 10_000;
/// Rows per record batch a scan produces.
pub const SCAN_BATCH_ROWS: usize = 8192;
/// Most keys of a `meta_id IN (...)` turned into point reads.
pub const KEY_LOOKUPS_MAX: usize = 10_000;
/// Memory one query may use for sorts, joins and aggregates (past it, what can spill does).
pub const QUERY_MEMORY_MAX_BYTES: usize = 512 * 1024 * 1024;
/// Memory all queries of the node may use together, by default.
pub const QUERY_MEMORY_NODE_DEFAULT_BYTES: usize = 2 * 1024 * 1024 * 1024;
/// Disk the node's queries may spill to together, by default (under the first data path).
pub const QUERY_SPILL_DEFAULT_BYTES: u64 = 4 * 1024 * 1024 * 1024;
/// Largest encoded answer (JSON or NDJSON rows): past it the query fails with `too_large`.
pub const ANSWER_MAX_BYTES: usize = 64 * 1024 * 1024;
/// Folder of spill files, under the first data path (emptied at start).
pub const SPILL_DIR: &str = "tmp/query-spill";
/// Largest estimated build side of a join broadcast to every member's task in a
/// distributed statement (bytes, rows); past it both sides are shuffled by hash.
pub const BROADCAST_BUILD_MAX_BYTES: usize = 32 * 1024 * 1024;
pub const BROADCAST_BUILD_MAX_ROWS: usize = 1_000_000;
/// Tables of a distributed statement planned at once (a small one is read from the members
/// as it is planned, see [`gather`]).
const PLANNING_CONCURRENCY: usize = 16;
/// Most groups a distributed statement's final aggregation is estimated to have for it to
/// run in one task, on the coordinator (past it, the groups are shuffled by hash over the
/// members).
pub const ONE_TASK_GROUPS_MAX: usize = 100_000;
/// Longest SQL text accepted.
pub const SQL_MAX_BYTES: usize = 64 * 1024;
/// Most parameters.
pub const PARAMS_MAX: usize = 1024;
/// Most rows in one answer.
pub const RESULT_ROWS_MAX: usize = 100_000;
/// Default and longest time a query may run.
pub const QUERY_TIMEOUT_DEFAULT: Duration = Duration::from_secs(75);
pub const QUERY_TIMEOUT_MAX: Duration = Duration::from_secs(3600);

#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    /// The statement does not parse, plan or run: the user's to fix.
    #[error("{0}")]
    Sql(String),
    /// The statement names a column no table has (as far as their schemas know).
    #[error("{0}")]
    UnknownField(String),
    #[error("{0}")]
    Invalid(String),
    #[error("the query ran out of its memory limit: {0}")]
    Memory(String),
    #[error("the query did not finish in {0:?}")]
    Timeout(Duration),
    #[error("{0}")]
    TooLarge(String),
    #[error("{0}")]
    Unavailable(String),
    /// A statement over the members' shadows that the planner could not place on them (it
    /// runs on the row engine instead).
    #[error("{0}")]
    NotPlaced(String),
    /// A storage fault.
    #[error("{0}")]
    Storage(String),
    /// A fault in the engine (a panic inside DataFusion, say): logged, answered, survived.
    #[error("query engine fault: {0}")]
    Internal(String),
}

impl From<DataFusionError> for QueryError {
    fn from(e: DataFusionError) -> Self {
        // Errors of a distributed statement cross the network as text, their kind tagged.
        if let Some(kind) = distributed::kind_of(&e.to_string()) {
            let text = e.find_root().to_string();
            return match kind {
                distributed::Kind::Unavailable => QueryError::Unavailable(text),
                distributed::Kind::Timeout => QueryError::Timeout(Duration::ZERO),
                distributed::Kind::NotPlaced => QueryError::NotPlaced(text),
            };
        }
        match e.find_root() {
            DataFusionError::ResourcesExhausted(m) => QueryError::Memory(m.clone()),
            root @ DataFusionError::SchemaError(e, _) if matches!(**e, datafusion::common::SchemaError::FieldNotFound { .. }) => {
                QueryError::UnknownField(root.to_string())
            }
            DataFusionError::External(inner) => {
                if let Some(ix) = inner.downcast_ref::<shoal_index::IndexError>() {
                    return match ix {
                        shoal_index::IndexError::Timeout => QueryError::Timeout(Duration::ZERO),
                        shoal_index::IndexError::NotReady { .. } | shoal_index::IndexError::CatchingUp { .. } => {
                            QueryError::Unavailable(ix.to_string())
                        }
                        _ => QueryError::Storage(ix.to_string()),
                    };
                }
                if let Some(s) = inner.downcast_ref::<shadow::ShadowError>() {
                    return match s {
                        shadow::ShadowError::Timeout(t) => QueryError::Timeout(*t),
                        shadow::ShadowError::Off | shadow::ShadowError::NotAttached(_) | shadow::ShadowError::CatchingUp(_) => {
                            QueryError::Unavailable(s.to_string())
                        }
                        _ => QueryError::Storage(s.to_string()),
                    };
                }
                if let Some(r) = inner.downcast_ref::<spread::RemoteError>() {
                    return QueryError::Unavailable(r.to_string());
                }
                if let Some(r) = inner.downcast_ref::<shoal_storage::ReadError>() {
                    return QueryError::Storage(r.to_string());
                }
                QueryError::Sql(inner.to_string())
            }
            root => QueryError::Sql(root.to_string()),
        }
    }
}

/// What a statement reads, for access checks before it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reads {
    /// The documents of a collection (a table in a `FROM`, a join, a subquery).
    Collection(String),
    /// The catalog (`information_schema`, or any schema but `public`): the names and fields
    /// of every collection.
    Catalog,
}

/// Every table `sql` reads, subqueries included (names a `WITH` defines are not tables). A
/// statement that does not parse is refused here as it would be when run.
pub fn reads(sql: &str) -> Result<Vec<Reads>, QueryError> {
    use datafusion::common::TableReference;
    if sql.len() > SQL_MAX_BYTES {
        return Err(QueryError::Invalid(format!("the statement is longer than {SQL_MAX_BYTES} bytes")));
    }
    let statements = datafusion::sql::parser::DFParser::parse_sql(sql).map_err(|e| QueryError::Sql(e.to_string()))?;
    let mut out = Vec::new();
    for statement in &statements {
        let (tables, _ctes) = datafusion::sql::resolve::resolve_table_references(statement, false)?;
        for t in tables {
            let read = match &t {
                TableReference::Bare { table } => Reads::Collection(table.to_string()),
                TableReference::Partial { schema, table } if schema.as_ref() == "public" => Reads::Collection(table.to_string()),
                TableReference::Full { catalog, schema, table } if catalog.as_ref() == "datafusion" && schema.as_ref() == "public" => {
                    Reads::Collection(table.to_string())
                }
                _ => Reads::Catalog,
            };
            if !out.contains(&read) {
                out.push(read);
            }
        }
    }
    Ok(out)
}

/// One statement to run.
#[derive(Clone, Debug)]
pub struct QueryRequest {
    pub sql: String,
    pub params: Vec<Value>,
    pub consistency: Consistency,
    pub timeout: Duration,
    /// On a cluster member that holds only some partitions active: where the others are
    /// read (see [`spread`]). `None` reads every partition here.
    pub spread: Option<Arc<spread::Spread>>,
    /// In a cluster with index nodes: how indexes placed on them are read.
    pub placed: Option<Arc<dyn spread::PlacedIndexes>>,
    /// On a cluster member that is not every partition's active: the members an analytics
    /// statement runs on (see [`distributed`]).
    pub cluster: Option<Arc<distributed::ClusterAnalytics>>,
}

/// How an answer's rows are encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowFormat {
    /// Each row a JSON array, rows separated by commas (to sit inside `"rows": [...]`).
    JsonArrays,
    /// Each row a JSON array on its own line.
    Ndjson,
}

/// Column names and the rows, already encoded (decimals with their exact digits).
#[derive(Clone, Debug, Default)]
pub struct QueryAnswer {
    pub columns: Vec<String>,
    pub rows: usize,
    /// How the statement's table scans read: from the documents, from the columnar shadows.
    pub row_scans: usize,
    pub columnar_scans: usize,
    /// The encoded rows, at most [`ANSWER_MAX_BYTES`].
    pub body: Vec<u8>,
    pub elapsed: Duration,
}

/// Node-wide settings of the SQL engine.
#[derive(Clone, Debug)]
pub struct QueryConfig {
    /// Threads (partitions) of the operational path.
    pub threads: usize,
    /// Memory of all queries together.
    pub node_memory_bytes: usize,
    /// Memory of one query.
    pub query_memory_bytes: usize,
    /// Where spill files go (emptied at start), and how much they may hold together.
    pub spill_dir: std::path::PathBuf,
    pub spill_max_bytes: u64,
}

/// Schemas inferred per collection, widened from the change feed.
#[derive(Default)]
pub(crate) struct SchemaCache {
    by_collection: Mutex<HashMap<u32, Arc<Mutex<Inferred>>>>,
}

struct Inferred {
    obj: Obj,
    feed: FeedPosition,
    /// Built from every document (not a sample).
    complete: bool,
    /// Sorted keys of documents seen while inferring: where parallel scans split the
    /// collection into key ranges.
    keys: Vec<bytes::Bytes>,
}

/// A collection's table shape: its schema and the keys its scans may split at.
pub(crate) struct Shape {
    pub schema: datafusion::arrow::datatypes::SchemaRef,
    pub splits: Vec<bytes::Bytes>,
}

impl SchemaCache {
    /// The collection's current schema: sampled on first use, then widened with the
    /// documents written since (up to [`SCHEMA_WIDEN_CHANGES`] per call).
    pub(crate) fn schema_of(&self, coll: &Collection) -> Result<Shape, QueryError> {
        let slot = {
            let mut map = self.by_collection.lock();
            match map.get(&coll.id()) {
                Some(s) => Arc::clone(s),
                None => {
                    // Positions first, then the sample: every document written after the
                    // positions is seen again by the widening, none is missed.
                    let feed = FeedPosition { partitions: coll.positions() };
                    let (obj, mut keys) = sample(coll, &feed)?;
                    keys.sort_unstable();
                    keys.dedup();
                    let s = Arc::new(Mutex::new(Inferred { obj, feed, complete: false, keys }));
                    map.insert(coll.id(), Arc::clone(&s));
                    s
                }
            }
        };
        let mut inferred = slot.lock();
        let Inferred { obj, feed, keys, .. } = &mut *inferred;
        let now = coll.positions();
        let mut behind: Vec<PartitionId> =
            (0..coll.partition_count()).filter(|&p| feed.partitions.get(usize::from(p)) != now.get(usize::from(p))).collect();
        while !behind.is_empty() {
            // Every partition with news a share of each batch, the call bounded in all.
            let limits = FollowLimits {
                batch_changes: SCHEMA_WIDEN_CHANGES.div_ceil(behind.len()),
                partition_changes_max: SCHEMA_WIDEN_CHANGES,
                total_changes_max: SCHEMA_WIDEN_CHANGES,
                include_docs: true,
            };
            match follow(coll, &behind, limits, &mut Widening { obj, feed }) {
                Ok(_) => break,
                // A cluster member holds no copy of this partition (any more): nothing of
                // it to widen with here.
                Err(ChangesError::NotMyPartition(n)) => behind.retain(|p| *p != n.partition),
                Err(e) => return Err(QueryError::Storage(e.to_string())),
            }
        }
        Ok(Shape { schema: obj.table_schema(), splits: keys.clone() })
    }

    /// Widens the collection's cached schema with documents read on other members (a
    /// cluster member holding none of a collection's documents samples the others').
    pub(crate) fn widen_with(&self, coll: &Collection, docs: &[(bytes::Bytes, bytes::Bytes)]) -> Result<Shape, QueryError> {
        let slot = self.by_collection.lock().get(&coll.id()).cloned();
        let Some(slot) = slot else { return self.schema_of(coll) };
        let mut inferred = slot.lock();
        for (_, body) in docs {
            if let Ok(Value::Object(map)) = serde_json::from_slice::<Value>(body) {
                inferred.obj.observe(&map, 0);
            }
        }
        Ok(Shape { schema: inferred.obj.table_schema(), splits: inferred.keys.clone() })
    }

    /// Whether the cached schema of `coll` has seen no field yet.
    pub(crate) fn knows_nothing(&self, coll: &Collection) -> bool {
        self.by_collection.lock().get(&coll.id()).is_none_or(|s| s.lock().obj.is_empty())
    }

    /// Infers the collection's schema from every document (when a query names a field the
    /// sample did not see: a rare kind of document in a mixed collection). False if it
    /// already was.
    pub(crate) fn complete(&self, coll: &Collection) -> Result<bool, QueryError> {
        if self.by_collection.lock().get(&coll.id()).is_some_and(|s| s.lock().complete) {
            return Ok(false);
        }
        let feed = FeedPosition { partitions: coll.positions() };
        let mut obj = Obj::default();
        let mut after: Option<bytes::Bytes> = None;
        let mut keys = Vec::new();
        loop {
            let page = coll.scan_docs(after.as_deref(), SCAN_BATCH_ROWS).map_err(|e| QueryError::Storage(e.to_string()))?;
            let Some(last) = page.last().map(|d| d.0.clone()) else { break };
            keys.push(page[0].0.clone());
            for (_, body) in &page {
                if let Ok(Value::Object(map)) = serde_json::from_slice::<Value>(body) {
                    obj.observe(&map, 0);
                }
            }
            after = Some(last);
        }
        let inferred = Arc::new(Mutex::new(Inferred { obj, feed, complete: true, keys }));
        self.by_collection.lock().insert(coll.id(), inferred);
        Ok(true)
    }
}

/// A collection's schema as a consumer of its change streams. The schema only widens, so a
/// partition whose history diverged keeps what it contributed (a wider schema still reads
/// every document) and is read again from the start.
struct Widening<'a> {
    obj: &'a mut Obj,
    feed: &'a mut FeedPosition,
}

impl ChangeConsumer for Widening<'_> {
    type Error = ChangesError;

    fn position(&self, p: PartitionId) -> StreamPosition {
        self.feed.partitions.get(usize::from(p)).copied().unwrap_or_default()
    }

    fn rollback(&mut self, p: PartitionId, _shared: SeqNo) -> Result<(), ChangesError> {
        if let Some(slot) = self.feed.partitions.get_mut(usize::from(p)) {
            *slot = StreamPosition::default();
        }
        Ok(())
    }

    fn apply(&mut self, batch: &[PartitionBatch]) -> Result<(), ChangesError> {
        for part in batch {
            for body in part.changes.iter().filter_map(|c| c.value.as_ref()) {
                if let Ok(Value::Object(map)) = serde_json::from_slice::<Value>(body) {
                    self.obj.observe(&map, 0);
                }
            }
            if let Some(slot) = self.feed.partitions.get_mut(usize::from(part.partition)) {
                *slot = part.position;
            }
        }
        Ok(())
    }
}

/// Reads about [`SCHEMA_SAMPLE_DOCS`] documents spread over the whole collection: from
/// every partition, a few changes at each of [`SCHEMA_SAMPLE_STRATA`] evenly spaced points of
/// its history (so old and new documents, and every kind a collection mixes, are seen).
fn sample(coll: &Collection, now: &FeedPosition) -> Result<(Obj, Vec<bytes::Bytes>), QueryError> {
    let storage = |e: shoal_storage::ChangesError| QueryError::Storage(e.to_string());
    let partitions = now.partitions.len().max(1);
    let per = (SCHEMA_SAMPLE_DOCS / (partitions * SCHEMA_SAMPLE_STRATA)).max(1);
    let mut obj = Obj::default();
    let mut keys = Vec::new();
    for (p, pos) in now.partitions.iter().enumerate() {
        for j in 0..SCHEMA_SAMPLE_STRATA as u64 {
            let from = StreamPosition { seqno: pos.seqno * j / SCHEMA_SAMPLE_STRATA as u64, uuid: pos.uuid };
            let (mut sub, _) = coll.subscribe(p as u16, from).map_err(storage)?;
            let changes = match sub.try_next(per, true) {
                Ok(changes) => changes,
                // A cluster member samples the partitions it holds a copy of.
                Err(ChangesError::NotMyPartition(_)) => break,
                Err(e) => return Err(storage(e)),
            };
            for change in changes {
                if let Some(Ok(Value::Object(map))) = change.value.map(|b| serde_json::from_slice::<Value>(&b)) {
                    obj.observe(&map, 0);
                    keys.push(change.key);
                }
            }
        }
    }
    Ok((obj, keys))
}

/// Which tables a statement reads.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Path {
    /// Documents, through key lookups and indexes (`/v1/query`).
    Operational,
    /// The columnar shadows, one scan stream per analytics partition (`/v1/analytics`).
    Analytics,
}

/// Runs SQL over the store's collections.
pub struct QueryEngine {
    store: Arc<Store>,
    indexes: Arc<IndexManager>,
    shadows: Arc<ShadowManager>,
    schemas: Arc<SchemaCache>,
    threads: usize,
    /// The node's memory pool and spill disk, shared by every query.
    runtime: Arc<datafusion::execution::runtime_env::RuntimeEnv>,
    query_memory_bytes: usize,
    /// In a cluster: this node as a worker of distributed statements.
    member: std::sync::OnceLock<Member>,
    /// The tables over the members its statements last found.
    known: Arc<analytics::KnownTables>,
}

/// This node as a worker of distributed statements.
struct Member {
    env: Arc<distributed::WorkerEnv>,
    local: Arc<dyn distributed::LocalMember>,
    worker: datafusion_distributed::Worker,
    channels: distributed::Channels,
    /// The memory pools of the distributed statements with tasks on this node.
    statements: Arc<pool::StatementPools>,
}

impl QueryEngine {
    pub fn new(
        store: Arc<Store>,
        indexes: Arc<IndexManager>,
        shadows: Arc<ShadowManager>,
        config: QueryConfig,
    ) -> Result<QueryEngine, QueryError> {
        use datafusion::execution::disk_manager::{DiskManagerBuilder, DiskManagerMode};
        // Spill files of a previous run (a crash leaves them) are of no use.
        let _ = std::fs::remove_dir_all(&config.spill_dir);
        std::fs::create_dir_all(&config.spill_dir).map_err(|e| QueryError::Storage(format!("the spill folder: {e}")))?;
        let node_pool = Arc::new(datafusion::execution::memory_pool::FairSpillPool::new(config.node_memory_bytes));
        let runtime = RuntimeEnvBuilder::new()
            .with_memory_pool(node_pool)
            .with_disk_manager_builder(
                DiskManagerBuilder::default()
                    .with_mode(DiskManagerMode::Directories(vec![config.spill_dir.clone()]))
                    .with_max_temp_directory_size(config.spill_max_bytes),
            )
            .build_arc()
            .map_err(|e| QueryError::Storage(e.to_string()))?;
        Ok(QueryEngine {
            store,
            indexes,
            shadows,
            schemas: Arc::new(SchemaCache::default()),
            threads: config.threads.max(1),
            runtime,
            query_memory_bytes: config.query_memory_bytes.min(config.node_memory_bytes),
            member: std::sync::OnceLock::new(),
            known: Arc::default(),
        })
    }

    /// Makes this node a worker of distributed analytics (once; later calls change nothing)
    /// and answers the worker service to serve on its port under
    /// [`distributed::WORKER_PATH_PREFIX`].
    pub fn attach_cluster(&self, local: Arc<dyn distributed::LocalMember>) -> datafusion_distributed::Worker {
        let member = self.member.get_or_init(|| {
            let env = Arc::new(distributed::WorkerEnv {
                store: Arc::clone(&self.store),
                shadows: Arc::clone(&self.shadows),
                local: Arc::clone(&local),
            });
            let channels = distributed::Channels::new(local.call_headers(), local.tls());
            let statements = Arc::new(pool::StatementPools::default());
            let worker = distributed::worker(
                Arc::clone(&env),
                Arc::clone(&self.runtime),
                self.query_memory_bytes,
                channels.clone(),
                Arc::clone(&statements),
            );
            Member { env, local, worker, channels, statements }
        });
        member.worker.clone()
    }

    /// The fields of this node's shadows of `collections` ([`distributed::encode_fields_list`]),
    /// once each can be read at `consistency`: a member's part of preparing a distributed
    /// statement. One to [`distributed::FIELDS_TABLES_MAX`] collections (the caller checks
    /// a member's request, [`distributed::fields_tables_allowed`]).
    pub async fn shadow_fields(
        &self,
        collections: &[String],
        consistency: Consistency,
        timeout: Duration,
        current: bool,
    ) -> Result<Vec<u8>, QueryError> {
        debug_assert!(distributed::fields_tables_allowed(collections.len()).is_ok(), "{} collections", collections.len());
        if self.shadows.partitions() == 0 {
            return Err(QueryError::Unavailable(shadow::ShadowError::Off.to_string()));
        }
        let tables = collections.iter().map(|c| async move {
            let (fields, rows, stats) = analytics::fields_here(&self.store, &self.shadows, c, consistency, timeout, current).await?;
            Ok::<_, QueryError>(distributed::encode_fields_cached(fields, rows, &stats)?)
        });
        Ok(distributed::encode_fields_list(&futures::future::try_join_all(tables).await?))
    }

    /// This member's rows of a small table a distributed statement reads while it is
    /// planned ([`gather`]): the asked side of [`distributed::ShadowMembers::rows`].
    pub async fn shadow_rows(&self, request: &[u8]) -> Result<Vec<u8>, QueryError> {
        let request = gather::parse(request)?;
        let Some(member) = self.member.get() else {
            return Err(QueryError::Unavailable("this node is not a worker of the cluster yet".into()));
        };
        gather::serve(&member.env, request).await
    }

    /// Runs one statement (queries and `EXPLAIN`; no DDL, DML or `SET`) on the
    /// operational path.
    pub async fn query(&self, req: QueryRequest, format: RowFormat) -> Result<QueryAnswer, QueryError> {
        self.run(req, Path::Operational, format).await
    }

    /// Runs one statement over the columnar shadows. Every shadow is complete (typed from
    /// all its rows), so there is no second attempt with completed schemas.
    pub async fn analytics(&self, req: QueryRequest, format: RowFormat) -> Result<QueryAnswer, QueryError> {
        // A coordinator of a distributed statement needs no shadow of its own.
        if self.shadows.partitions() == 0 && req.cluster.is_none() {
            return Err(QueryError::Unavailable(shadow::ShadowError::Off.to_string()));
        }
        self.run(req, Path::Analytics, format).await
    }

    async fn run(&self, req: QueryRequest, path: Path, format: RowFormat) -> Result<QueryAnswer, QueryError> {
        let started = Instant::now();
        if req.sql.len() > SQL_MAX_BYTES {
            return Err(QueryError::Invalid(format!("the statement is longer than {SQL_MAX_BYTES} bytes")));
        }
        if req.params.len() > PARAMS_MAX {
            return Err(QueryError::Invalid(format!("at most {PARAMS_MAX} parameters")));
        }
        if req.timeout > QUERY_TIMEOUT_MAX {
            return Err(QueryError::Invalid(format!("timeout is at most {} ms", QUERY_TIMEOUT_MAX.as_millis())));
        }
        let params = req.params.iter().map(param).collect::<Result<Vec<_>, _>>()?;
        let _running = Running::start(path);
        let (first, touched) = self.attempt(&req, params.clone(), path, format).await;
        let mut answer = match first {
            // A field the sampled schemas do not know: infer the tables read from every
            // document, then try once more.
            Err(QueryError::UnknownField(_)) if !touched.is_empty() => {
                let schemas = Arc::clone(&self.schemas);
                let completed = tokio::task::spawn_blocking(move || {
                    let mut any = false;
                    for coll in &touched {
                        any |= schemas.complete(coll)?;
                    }
                    Ok::<_, QueryError>(any)
                })
                .await
                .map_err(|e| QueryError::Internal(e.to_string()))??;
                if completed {
                    self.attempt(&req, params, path, format).await.0?
                } else {
                    first?
                }
            }
            other => other?,
        };
        answer.elapsed = started.elapsed();
        Ok(answer)
    }

    /// Plans and runs the statement once; also answers which collections it read.
    ///
    /// The statement runs on its own task, aborted when this future is dropped (the
    /// client went away) or the timeout passes, so nothing keeps running for an answer no
    /// one will read. A panic inside the engine fails this query, not the node.
    async fn attempt(
        &self,
        req: &QueryRequest,
        params: Vec<ScalarValue>,
        path: Path,
        format: RowFormat,
    ) -> (Result<QueryAnswer, QueryError>, Vec<Arc<Collection>>) {
        let (ctx, env) = match self.session(req, path) {
            Ok(s) => s,
            Err(e) => return (Err(e), Vec::new()),
        };
        let sql = req.sql.clone();
        let prefetch = req.cluster.is_some() && path == Path::Analytics;
        let distributed = req.cluster.is_some() && self.member.get().is_some();
        let run = async move {
            let t0 = Instant::now();
            // Over the members, opening a table asks each member for its fields:
            // every table the statement names is opened at once, with one call per member,
            // not one after another as the planner would (it then finds them open). Tables
            // found unchanged are planned on while the members are asked again.
            let mut speculation = None;
            if prefetch {
                let state = ctx.state();
                let dialect = state.config().options().sql_parser.dialect;
                let shadows = ctx.catalog("datafusion").and_then(|c| c.schema("public"));
                let shadows = shadows.as_deref().and_then(|s| s.downcast_ref::<analytics::Shadows>());
                if let (Some(shadows), Ok(refs)) =
                    (shadows, state.sql_to_statement(&sql, &dialect).and_then(|s| state.resolve_table_references(&s)))
                {
                    let names: Vec<String> = refs.iter().filter(|r| r.schema().is_none()).map(|r| r.table().to_string()).collect();
                    let gate = state.config().get_extension::<gather::OpenGate>();
                    speculation = shadows.open_all(&names, gate.as_deref()).await?;
                }
            }
            let speculated = speculation.is_some();
            let t1 = Instant::now();
            let mut planned = plan(&ctx, &sql, &params, distributed).await;
            // Planned on tables as they were: it runs only if the members answer the same.
            let mut replanned = false;
            if let Some(s) = speculation {
                replanned = !s.confirmed().await?;
                let outcome = if replanned { "planned_again" } else { "ran" };
                metrics::counter!("shoal_analytics_planned_early_total", "outcome" => outcome).increment(1);
                if replanned {
                    planned = plan(&ctx, &sql, &params, distributed).await;
                }
            }
            let Planned { columns, plan, task } = planned?;
            let t2 = Instant::now();
            let mut stream = datafusion::physical_plan::execute_stream(plan, task)?;
            let t3 = Instant::now();
            let mut answer = QueryAnswer { columns, ..QueryAnswer::default() };
            let mut first = None;
            while let Some(batch) = futures::StreamExt::next(&mut stream).await {
                first.get_or_insert_with(Instant::now);
                encode_rows(&mut answer, &batch?, format)?;
            }
            let t4 = Instant::now();
            // Where a statement's time went (`SHOAL_LOG=shoal_query=debug`): opening its
            // tables (over the members: asking each for its fields, unless planned on them
            // as they were known), its planning (waiting for the members' fields too, then),
            // starting it, its first batch, the whole.
            tracing::debug!(
                open_us = micros(t1 - t0),
                speculated,
                replanned,
                plan_us = micros(t2 - t1),
                execute_us = micros(t3 - t2),
                first_batch_us = first.map_or(0, |f| micros(f - t3)),
                total_us = micros(t4 - t0),
                "statement phases"
            );
            Ok::<_, QueryError>(answer)
        };
        // Across members: a member failed over (stopped, cut off) while the statement runs
        // ends it at once with `503`, rather than at its timeout.
        let cluster = req.cluster.clone();
        let run = async move {
            let Some(cluster) = cluster else { return run.await };
            tokio::select! {
                answer = run => answer,
                why = cluster.remote.member_gone(&cluster.members) => Err(QueryError::Unavailable(why)),
            }
        };
        let timeout = req.timeout;
        // On the query runtime, away from the node's I/O threads (`runtime`).
        let task = runtime::AbortOnDrop(runtime::query_handle().spawn(async move { tokio::time::timeout(timeout, run).await }));
        let result = match task.join().await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(QueryError::Timeout(timeout)),
            Err(e) => {
                tracing::error!(error = %e, sql = %req.sql, "query task failed");
                Err(QueryError::Internal(e.to_string()))
            }
        };
        let touched = std::mem::take(&mut *env.touched.lock());
        let result = result.map(|mut a| {
            (a.row_scans, a.columnar_scans) = *env.scans.lock();
            a
        });
        (result, touched)
    }

    fn session(&self, req: &QueryRequest, path: Path) -> Result<(SessionContext, Arc<QueryEnv>), QueryError> {
        // Analytics runs one stream per analytics partition: the partition count is the
        // parallelism, as in the seed's experiment.
        let partitions = match path {
            Path::Operational => self.threads,
            Path::Analytics => self.shadows.partitions().max(1),
        };
        let mut config = SessionConfig::new().with_target_partitions(partitions).with_information_schema(true);
        // JSON field names are case-sensitive: `firstName` means firstName, quoted or not.
        config.options_mut().sql_parser.enable_ident_normalization = false;
        // `0.06 + 0.01` is exactly 0.07, as in PostgreSQL and DuckDB (a float literal
        // would make it 0.06999999999999999 and drop every row at 0.07).
        config.options_mut().sql_parser.parse_float_as_decimal = true;
        let statement_pool = Arc::new(pool::QueryPool::new(Arc::clone(&self.runtime.memory_pool), self.query_memory_bytes));
        let runtime = Arc::new(datafusion::execution::runtime_env::RuntimeEnv {
            memory_pool: Arc::clone(&statement_pool) as Arc<dyn datafusion::execution::memory_pool::MemoryPool>,
            disk_manager: Arc::clone(&self.runtime.disk_manager),
            cache_manager: Arc::clone(&self.runtime.cache_manager),
            object_store_registry: Arc::clone(&self.runtime.object_store_registry),
        });
        // An analytics statement over the members' shadows is planned to run on them.
        // So is a `/v1/query` statement whose full scans can read the members' shadows.
        let cluster = match (path, &req.cluster, self.member.get()) {
            (_, Some(cluster), Some(member)) => Some((Arc::clone(cluster), member)),
            (Path::Analytics, Some(_), None) => return Err(QueryError::Unavailable("this node is not a worker of the cluster yet".into())),
            _ => None,
        };
        let mut builder = match &cluster {
            None => datafusion::execution::SessionStateBuilder::new()
                .with_default_features()
                .with_config(config)
                .with_runtime_env(runtime)
                .with_physical_optimizer_rule(Arc::new(runtime::YieldingJoins)),
            Some((cluster, member)) => {
                // Across the members a join's build side is broadcast to every task
                // (CollectLeft) up to this size, so that a fact table is joined where its
                // rows are rather than shuffled between the members by hash.
                let mut config = config;
                distributed::broadcast_builds_up_to_limits(&mut config);
                // Every table is planned at once: a small one is read from the members then
                // (`gather`), not one after another.
                config.options_mut().execution.planning_concurrency = PLANNING_CONCURRENCY;
                // Tasks this node runs for itself read its shadows as a worker's do.
                let builder = datafusion::execution::SessionStateBuilder::new()
                    .with_default_features()
                    .with_config(config.with_extension(Arc::clone(&member.env)).with_extension(Arc::new(gather::OpenGate::default())))
                    .with_runtime_env(runtime)
                    .with_physical_optimizer_rule(Arc::new(runtime::YieldingJoins))
                    .with_physical_optimizer_rule(Arc::new(distributed::FewGroupsInOneTask));
                // The tasks this node runs for itself share the statement's pool.
                let statement = uuid::Uuid::new_v4().to_string();
                member.statements.adopt(&statement, &statement_pool);
                distributed::coordinating(builder, cluster, &member.worker, &member.local.address(), member.channels.clone(), &statement)?
            }
        };
        bounded::wrap(&mut builder);
        fsum::wrap(&mut builder);
        let ctx = SessionContext::from(builder.build());
        let env = Arc::new(QueryEnv {
            store: Arc::clone(&self.store),
            indexes: Arc::clone(&self.indexes),
            schemas: Arc::clone(&self.schemas),
            consistency: req.consistency,
            index_timeout: req.timeout,
            spread: req.spread.clone(),
            placed: req.placed.clone(),
            touched: Mutex::new(Vec::new()),
            shadows: (self.shadows.partitions() > 0).then(|| Arc::clone(&self.shadows)),
            scans: Mutex::new((0, 0)),
            cluster: cluster.as_ref().map(|(c, m)| (Arc::clone(c), m.local.address())),
            partitions: self.shadows.partitions().max(1),
        });
        let catalog = ctx.catalog("datafusion").ok_or_else(|| QueryError::Storage("no default catalog".into()))?;
        match path {
            Path::Operational => catalog.register_schema("public", Arc::new(Collections(Arc::clone(&env))))?,
            Path::Analytics => catalog.register_schema(
                "public",
                Arc::new(analytics::Shadows(Arc::new(analytics::AnalyticsEnv {
                    store: Arc::clone(&self.store),
                    shadows: Arc::clone(&self.shadows),
                    consistency: req.consistency,
                    timeout: req.timeout,
                    cluster: cluster.map(|(c, m)| (c, m.local.address())),
                    partitions,
                    opened: parking_lot::Mutex::default(),
                    known: Arc::clone(&self.known),
                }))),
            )?,
        };
        Ok((ctx, env))
    }
}

/// `sql` planned (logically and physically, gathering its small tables over the members).
async fn plan(ctx: &SessionContext, sql: &str, params: &[ScalarValue], distributed: bool) -> Result<Planned, QueryError> {
    let options =
        datafusion::execution::context::SQLOptions::new().with_allow_ddl(false).with_allow_dml(false).with_allow_statements(false);
    let mut df = ctx.sql_with_options(sql, options).await?;
    if distributed {
        df = distributed::analyzed(df)?;
    }
    if !params.is_empty() {
        df = df.with_param_values(params.to_vec())?;
    }
    let columns: Vec<String> = df.schema().fields().iter().map(|f| f.name().clone()).collect();
    let task = Arc::new(df.task_ctx());
    Ok(Planned { columns, plan: df.create_physical_plan().await?, task })
}

/// A statement planned: its columns, its plan and what runs it.
struct Planned {
    columns: Vec<String>,
    plan: Arc<dyn datafusion::physical_plan::ExecutionPlan>,
    task: Arc<datafusion::execution::TaskContext>,
}

fn micros(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Appends `batch`'s rows to the answer, refusing one past [`RESULT_ROWS_MAX`] rows or
/// [`ANSWER_MAX_BYTES`].
fn encode_rows(
    answer: &mut QueryAnswer,
    batch: &datafusion::arrow::record_batch::RecordBatch,
    format: RowFormat,
) -> Result<(), QueryError> {
    if answer.rows + batch.num_rows() > RESULT_ROWS_MAX {
        return Err(QueryError::TooLarge(format!("the answer has more than {RESULT_ROWS_MAX} rows; add a LIMIT")));
    }
    let out = &mut answer.body;
    for r in 0..batch.num_rows() {
        if format == RowFormat::JsonArrays && answer.rows > 0 {
            out.push(b',');
        }
        out.push(b'[');
        for (i, c) in batch.columns().iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            convert::write_json(out, c.as_ref(), r).map_err(|e| QueryError::Sql(e.to_string()))?;
        }
        out.push(b']');
        if format == RowFormat::Ndjson {
            out.push(b'\n');
        }
        answer.rows += 1;
        if out.len() > ANSWER_MAX_BYTES {
            return Err(QueryError::TooLarge(format!(
                "the answer is larger than {ANSWER_MAX_BYTES} bytes; add a LIMIT or select fewer columns"
            )));
        }
    }
    Ok(())
}

/// Counts a statement in `shoal_queries_running` while it runs.
struct Running(Path);

impl Running {
    fn start(path: Path) -> Running {
        metrics::gauge!("shoal_queries_running", "path" => path.label()).increment(1.0);
        Running(path)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        metrics::gauge!("shoal_queries_running", "path" => self.0.label()).decrement(1.0);
    }
}

impl Path {
    fn label(self) -> &'static str {
        match self {
            Path::Operational => "query",
            Path::Analytics => "analytics",
        }
    }
}

/// A JSON parameter as a SQL value; arrays and objects are refused.
fn param(v: &Value) -> Result<ScalarValue, QueryError> {
    Ok(match v {
        Value::Null => ScalarValue::Null,
        Value::Bool(b) => ScalarValue::Boolean(Some(*b)),
        Value::Number(n) => match n.as_i64() {
            Some(i) => ScalarValue::Int64(Some(i)),
            None => ScalarValue::Float64(n.as_f64()),
        },
        Value::String(s) => ScalarValue::Utf8(Some(s.clone())),
        _ => return Err(QueryError::Invalid("parameters are null, booleans, numbers or strings".into())),
    })
}
