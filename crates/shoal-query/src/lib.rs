//! SQL over collections (Apache DataFusion).
//!
//! A collection is a table: `meta_id` (the document key) and one column per top-level
//! field, typed from the documents (see [`schema`]); a value that does not fit its column's
//! type is NULL in that row. Filters on `meta_id` become key lookups and filters on an
//! index's leading keys become index scans; everything else reads the documents in key
//! order. DataFusion does the rest (joins, aggregates, windows, subqueries). Knows nothing
//! of HTTP.

mod analytics;
pub mod convert;
mod merge;
pub mod rows;
pub mod schema;
pub mod shadow;
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
use shoal_storage::{Collection, Store, StreamPosition};

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
/// Memory one query may use for sorts, joins and aggregates.
pub const QUERY_MEMORY_MAX_BYTES: usize = 512 * 1024 * 1024;
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
    Unavailable(String),
    /// A storage fault.
    #[error("{0}")]
    Storage(String),
    /// A fault in the engine (a panic inside DataFusion, say): logged, answered, survived.
    #[error("query engine fault: {0}")]
    Internal(String),
}

impl From<DataFusionError> for QueryError {
    fn from(e: DataFusionError) -> Self {
        match e.find_root() {
            DataFusionError::ResourcesExhausted(m) => QueryError::Memory(m.clone()),
            root @ DataFusionError::SchemaError(e, _) if matches!(**e, datafusion::common::SchemaError::FieldNotFound { .. }) => {
                QueryError::UnknownField(root.to_string())
            }
            DataFusionError::External(inner) => {
                if let Some(ix) = inner.downcast_ref::<shoal_index::IndexError>() {
                    return match ix {
                        shoal_index::IndexError::Timeout => QueryError::Timeout(Duration::ZERO),
                        shoal_index::IndexError::NotReady { .. } => QueryError::Unavailable(ix.to_string()),
                        _ => QueryError::Storage(ix.to_string()),
                    };
                }
                if let Some(s) = inner.downcast_ref::<shadow::ShadowError>() {
                    return match s {
                        shadow::ShadowError::Timeout(t) => QueryError::Timeout(*t),
                        shadow::ShadowError::Off | shadow::ShadowError::NotAttached(_) => QueryError::Unavailable(s.to_string()),
                        _ => QueryError::Storage(s.to_string()),
                    };
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

/// One statement to run.
#[derive(Clone, Debug)]
pub struct QueryRequest {
    pub sql: String,
    pub params: Vec<Value>,
    pub consistency: Consistency,
    pub timeout: Duration,
}

/// Column names and rows of values, in order.
#[derive(Clone, Debug, Default)]
pub struct QueryResult {
    pub columns: Vec<String>,
    pub rows: Vec<Vec<Value>>,
    pub elapsed: Duration,
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
        let changes = coll
            .read_feed(feed, shoal_storage::ReadLimit::items(SCHEMA_WIDEN_CHANGES), true)
            .map_err(|e| QueryError::Storage(e.to_string()))?;
        for change in changes {
            if let Some(body) = change.value {
                if let Ok(Value::Object(map)) = serde_json::from_slice::<Value>(&body) {
                    obj.observe(&map, 0);
                }
            }
        }
        Ok(Shape { schema: obj.table_schema(), splits: keys.clone() })
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
            for change in sub.try_next(per, true).map_err(storage)? {
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
}

impl QueryEngine {
    pub fn new(store: Arc<Store>, indexes: Arc<IndexManager>, shadows: Arc<ShadowManager>, threads: usize) -> QueryEngine {
        QueryEngine { store, indexes, shadows, schemas: Arc::new(SchemaCache::default()), threads: threads.max(1) }
    }

    /// Runs one statement (queries and `EXPLAIN`; no DDL, DML or `SET`) on the
    /// operational path.
    pub async fn query(&self, req: QueryRequest) -> Result<QueryResult, QueryError> {
        self.run(req, Path::Operational).await
    }

    /// Runs one statement over the columnar shadows. Every shadow is complete (typed from
    /// all its rows), so there is no second attempt with completed schemas.
    pub async fn analytics(&self, req: QueryRequest) -> Result<QueryResult, QueryError> {
        if self.shadows.partitions() == 0 {
            return Err(QueryError::Unavailable(shadow::ShadowError::Off.to_string()));
        }
        self.run(req, Path::Analytics).await
    }

    async fn run(&self, req: QueryRequest, path: Path) -> Result<QueryResult, QueryError> {
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
        let (first, touched) = self.attempt(&req, params.clone(), path).await;
        let mut result = match first {
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
                    self.attempt(&req, params, path).await.0?
                } else {
                    first?
                }
            }
            other => other?,
        };
        result.elapsed = started.elapsed();
        Ok(result)
    }

    /// Plans and runs the statement once; also answers which collections it read.
    async fn attempt(
        &self,
        req: &QueryRequest,
        params: Vec<ScalarValue>,
        path: Path,
    ) -> (Result<QueryResult, QueryError>, Vec<Arc<Collection>>) {
        let (ctx, env) = match self.session(req, path) {
            Ok(s) => s,
            Err(e) => return (Err(e), Vec::new()),
        };
        let sql = req.sql.clone();
        let run = async move {
            let options =
                datafusion::execution::context::SQLOptions::new().with_allow_ddl(false).with_allow_dml(false).with_allow_statements(false);
            let mut df = ctx.sql_with_options(&sql, options).await?;
            if !params.is_empty() {
                df = df.with_param_values(params)?;
            }
            let columns: Vec<String> = df.schema().fields().iter().map(|f| f.name().clone()).collect();
            let mut stream = df.execute_stream().await?;
            let mut rows = Vec::new();
            while let Some(batch) = futures::StreamExt::next(&mut stream).await {
                let batch = batch?;
                if rows.len() + batch.num_rows() > RESULT_ROWS_MAX {
                    return Err(QueryError::Invalid(format!("the answer has more than {RESULT_ROWS_MAX} rows; add a LIMIT")));
                }
                for r in 0..batch.num_rows() {
                    let row = batch
                        .columns()
                        .iter()
                        .map(|c| convert::to_json(c.as_ref(), r))
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| QueryError::Sql(e.to_string()))?;
                    rows.push(row);
                }
            }
            Ok::<_, QueryError>(QueryResult { columns, rows, elapsed: Duration::ZERO })
        };
        // On its own task: a panic inside the engine fails this query, not the connection.
        let timeout = req.timeout;
        let task = tokio::spawn(async move { tokio::time::timeout(timeout, run).await });
        let result = match task.await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(QueryError::Timeout(timeout)),
            Err(e) => {
                tracing::error!(error = %e, sql = %req.sql, "query task failed");
                Err(QueryError::Internal(e.to_string()))
            }
        };
        let touched = std::mem::take(&mut *env.touched.lock());
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
        let runtime = RuntimeEnvBuilder::new()
            .with_memory_limit(QUERY_MEMORY_MAX_BYTES, 1.0)
            .build_arc()
            .map_err(|e| QueryError::Storage(e.to_string()))?;
        let ctx = SessionContext::new_with_config_rt(config, runtime);
        let env = Arc::new(QueryEnv {
            store: Arc::clone(&self.store),
            indexes: Arc::clone(&self.indexes),
            schemas: Arc::clone(&self.schemas),
            consistency: req.consistency,
            index_timeout: req.timeout,
            touched: Mutex::new(Vec::new()),
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
                }))),
            )?,
        };
        Ok((ctx, env))
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
