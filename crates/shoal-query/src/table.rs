//! Collections as DataFusion tables: the schema provider, the table provider, and the scan
//! operator that reads documents by key, through an index, or in key order.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use datafusion::arrow::datatypes::{DataType, Field, SchemaRef};
use datafusion::catalog::{SchemaProvider, Session, TableProvider};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::utils::project_schema;
use datafusion::common::{DataFusionError, ScalarValue};
use datafusion::datasource::TableType;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::{Between, BinaryExpr, Expr, Operator, TableProviderFilterPushDown};
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    ChildrenPropertiesMode, DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties, ReplaceChildrenOptions,
};
use serde_json::Value;
use shoal_index::{Consistency, IndexManager, IndexState, ScanBounds};
use shoal_storage::{Collection, Store};

use crate::convert::to_batch;
use crate::schema::{is_mixed, KEY_COLUMN};
use crate::{SchemaCache, SCAN_BATCH_ROWS};

/// Plan properties of a scan (a leaf) producing `schema` in `partitions` unordered streams.
pub(crate) fn leaf_properties(schema: &SchemaRef, partitions: usize) -> Arc<PlanProperties> {
    Arc::new(PlanProperties::new(
        EquivalenceProperties::new(Arc::clone(schema)),
        Partitioning::UnknownPartitioning(partitions),
        EmissionType::Incremental,
        Boundedness::Bounded,
    ))
}

/// What a query shares with the tables it reads.
pub(crate) struct QueryEnv {
    pub store: Arc<Store>,
    pub indexes: Arc<IndexManager>,
    pub schemas: Arc<SchemaCache>,
    pub consistency: Consistency,
    pub index_timeout: std::time::Duration,
    /// Where partitions not active here are read (a cluster member), if any.
    pub spread: Option<Arc<crate::spread::Spread>>,
    /// How indexes placed on index nodes are read, in a cluster that has them.
    pub placed: Option<Arc<dyn crate::spread::PlacedIndexes>>,
    /// Collections the query has opened as tables.
    pub touched: parking_lot::Mutex<Vec<Arc<Collection>>>,
    /// The columnar shadows (`None` with analytics off): a full scan reads its collection's
    /// shadow when that answers the same rows (see [`columnar`]).
    pub shadows: Option<Arc<crate::shadow::ShadowManager>>,
    /// How the statement's scans read: (from the documents, from the shadows).
    pub scans: parking_lot::Mutex<(usize, usize)>,
    /// On a cluster member that is not every partition's active: the members whose shadows
    /// a full scan may read (see [`columnar`]), and this node's address among them.
    pub cluster: Option<(Arc<crate::distributed::ClusterAnalytics>, String)>,
    /// Output partitions per member of such a scan.
    pub partitions: usize,
}

/// Longest a `request_plus` full scan waits for the shadow to reach the statement's
/// positions before it reads the documents instead.
pub const COLUMNAR_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// Whether `shadow` types every column of `projected` as the table does (so every value
/// converts alike); why not otherwise.
fn typed_alike(projected: &SchemaRef, shadow: &SchemaRef, what: &str) -> Result<(), String> {
    for f in projected.fields() {
        match shadow.field_with_name(f.name()) {
            Ok(sf) if sf.data_type() == f.data_type() => {}
            _ => return Err(format!("column {} is typed otherwise in {what}", f.name())),
        }
    }
    Ok(())
}

/// [`columnar`] on a cluster member that is not every partition's active: a scan of the
/// members' shadows, each member reading its own active partitions (as `/v1/analytics` does
/// there), when every member's shadow holds every write and the merged schema types the
/// columns read as the table does.
async fn members_columnar(
    env: &QueryEnv,
    coll: &Arc<Collection>,
    projected: &SchemaRef,
    filters: &[Expr],
    limit: Option<usize>,
) -> Result<Arc<dyn ExecutionPlan>, String> {
    let (cluster, me) = env.cluster.as_ref().ok_or("the collection's partitions are on several members")?;
    let shadows = env.shadows.as_ref().ok_or("analytics is off on this node")?;
    let table = crate::analytics::members_schema(&env.store, shadows, (cluster, me), coll.name(), env.consistency, env.index_timeout, true)
        .await
        .map_err(|e| format!("the members' shadows: {}", e.find_root()))?;
    typed_alike(projected, &table.schema, "the members' shadows")?;
    let scan = crate::analytics::members_scan(
        cluster,
        coll.name(),
        env.index_timeout,
        Arc::clone(projected),
        filters,
        limit,
        (env.partitions, table.rows, table.stats),
    );
    Ok(Arc::new(scan))
}

/// A full scan of `coll` over its columnar shadow, when that answers exactly what reading
/// the documents would (TiDB picks TiFlash so): a shadow whole on every partition active
/// here, holding every change up to the high seqnos now (at `request_plus` it may wait
/// [`COLUMNAR_WAIT`] for them; at `not_bounded` it must hold them already, so a statement
/// never sees fewer writes than the documents show), whose columns have the same types as
/// the table's (so every value converts alike). `Err` with why not, for `EXPLAIN`.
async fn columnar(
    env: &QueryEnv,
    coll: &Arc<Collection>,
    projected: &SchemaRef,
    filters: &[Expr],
    limit: Option<usize>,
) -> Result<Arc<dyn ExecutionPlan>, String> {
    if env.spread.is_some() {
        return members_columnar(env, coll, projected, filters, limit).await;
    }
    let shadows = env.shadows.as_ref().ok_or("analytics is off on this node")?;
    let shadow = shadows.shadow(coll.id()).ok_or("no shadow of the collection yet")?;
    let highs = coll.held_high_seqnos();
    match env.consistency {
        Consistency::RequestPlus => shadow.wait_applied(&highs, COLUMNAR_WAIT).await.map_err(|e| e.to_string())?,
        Consistency::NotBounded => {
            let applied = shadow.applied_seqnos();
            if highs.iter().zip(&applied).any(|(h, a)| a < h) {
                return Err("the shadow has not applied the latest writes yet".into());
            }
        }
    }
    shadow.wait_whole(std::time::Duration::ZERO).await.map_err(|e| e.to_string())?;
    let s = Arc::clone(&shadow);
    let shadow_schema = tokio::task::spawn_blocking(move || s.schema()).await.map_err(|e| e.to_string())?;
    typed_alike(projected, &shadow_schema, "the shadow")?;
    let why = Some(match env.consistency {
        Consistency::RequestPlus => "the shadow holds every write made before the statement (request_plus)".to_string(),
        Consistency::NotBounded => "the shadow holds every write made so far".to_string(),
    });
    crate::analytics::shadow_scan(shadow, Arc::clone(projected), filters, limit, why).await.map_err(|e| e.to_string())
}

/// Every collection of the store, as tables of the default schema.
pub(crate) struct Collections(pub Arc<QueryEnv>);

impl fmt::Debug for Collections {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Collections")
    }
}

#[async_trait]
impl SchemaProvider for Collections {
    fn table_names(&self) -> Vec<String> {
        self.0.store.list_collections().into_iter().map(|c| c.name).collect()
    }

    async fn table(&self, name: &str) -> Result<Option<Arc<dyn TableProvider>>, DataFusionError> {
        let Some(coll) = self.0.store.collection(name) else { return Ok(None) };
        self.0.touched.lock().push(Arc::clone(&coll));
        let env = Arc::clone(&self.0);
        let c = Arc::clone(&coll);
        let mut shape = tokio::task::spawn_blocking(move || env.schemas.schema_of(&c))
            .await
            .map_err(|e| DataFusionError::External(Box::new(e)))?
            .map_err(|e| DataFusionError::External(Box::new(e)))?;
        // A cluster member holding none of the collection's documents learns its fields
        // from a page of each other member's.
        if let Some(spread) = self.0.spread.as_ref().filter(|_| self.0.schemas.knows_nothing(&coll)) {
            let members = spread.members();
            let per = (crate::SCHEMA_SAMPLE_DOCS / members.len().max(1)).max(1);
            let pages = members.iter().map(|m| spread.remote.scan(m, name, None, per));
            let mut docs = Vec::new();
            for page in futures::future::join_all(pages).await {
                docs.extend(page.map_err(external)?);
            }
            shape = self.0.schemas.widen_with(&coll, &docs).map_err(|e| DataFusionError::External(Box::new(e)))?;
        }
        Ok(Some(Arc::new(CollectionTable { env: Arc::clone(&self.0), coll, schema: shape.schema, splits: shape.splits })))
    }

    fn table_exist(&self, name: &str) -> bool {
        self.0.store.collection(name).is_some()
    }
}

pub(crate) struct CollectionTable {
    env: Arc<QueryEnv>,
    coll: Arc<Collection>,
    schema: SchemaRef,
    /// Sorted keys a full scan may split at (see [`key_ranges`]).
    splits: Vec<Bytes>,
}

/// A key range `[start, end)` one scan partition reads; `None` is open.
type KeyRange = (Option<Bytes>, Option<Bytes>);

/// Up to `n` key ranges of about equal numbers of sampled keys, covering every key once.
fn key_ranges(splits: &[Bytes], n: usize) -> Vec<KeyRange> {
    let n = n.clamp(1, splits.len() + 1);
    let mut cuts: Vec<Bytes> = (1..n).map(|i| splits[i * splits.len() / n].clone()).collect();
    cuts.dedup();
    let mut out = Vec::with_capacity(cuts.len() + 1);
    let mut start = None;
    for cut in cuts {
        out.push((start, Some(cut.clone())));
        start = Some(cut);
    }
    out.push((start, None));
    out
}

impl fmt::Debug for CollectionTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CollectionTable({})", self.coll.name())
    }
}

#[async_trait]
impl TableProvider for CollectionTable {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    /// Filters are used to choose key lookups and index scans, which return a superset of
    /// the matching rows; DataFusion applies every filter again.
    fn supports_filters_pushdown(&self, filters: &[&Expr]) -> Result<Vec<TableProviderFilterPushDown>, DataFusionError> {
        Ok(vec![TableProviderFilterPushDown::Inexact; filters.len()])
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>, DataFusionError> {
        let mut access = choose_access(&self.env, &self.coll, &self.schema, filters);
        // An index placed on index nodes is read there (one copy of each partition the
        // bounds need), then the documents by key from their actives. Too many keys to read
        // one by one: the documents are read instead.
        if let (Access::Index { name, bounds }, Some(placed)) = (&access, &self.env.placed) {
            let env = &self.env;
            let keys = placed
                .keys(self.coll.name(), name, bounds, env.consistency, env.index_timeout, PLACED_INDEX_KEYS_MAX)
                .await
                .map_err(external)?;
            access = placed_access(access, keys, PLACED_INDEX_KEYS_MAX);
        }
        // Spread over members, an index scan would see only this node's index: the
        // documents are read instead, and DataFusion filters them.
        if self.env.spread.is_some() && matches!(access, Access::Index { .. }) {
            access = Access::Full;
        }
        let projected = project_schema(&self.schema, projection)?;
        let mut why_rows = None;
        if matches!(access, Access::Full) {
            match columnar(&self.env, &self.coll, &projected, filters, limit).await {
                Ok(plan) => {
                    self.env.scans.lock().1 += 1;
                    return Ok(plan);
                }
                Err(why) => why_rows = Some(why),
            }
        }
        self.env.scans.lock().0 += 1;
        // A full read is split into key ranges, one per core, so documents are parsed and
        // converted in parallel; point reads and index scans are one stream. Spread over
        // members, a full read also has one stream per other member.
        let (ranges, remotes) = match access {
            Access::Full => (
                key_ranges(&self.splits, state.config().target_partitions()),
                self.env.spread.as_ref().map(|s| s.members()).unwrap_or_default(),
            ),
            _ => (vec![(None, None)], Vec::new()),
        };
        let properties = leaf_properties(&projected, ranges.len() + remotes.len());
        Ok(Arc::new(ScanExec {
            env: Arc::clone(&self.env),
            coll: Arc::clone(&self.coll),
            schema: Arc::clone(&self.schema),
            projection: projection.cloned(),
            projected,
            access,
            ranges,
            remotes,
            limit,
            properties,
            why_rows,
        }))
    }
}

/// How a scan reads the collection.
#[derive(Clone, Debug)]
pub(crate) enum Access {
    /// `meta_id = ...` or `meta_id IN (...)`: point reads.
    Keys(Vec<String>),
    /// Filters on an index's leading keys: one index scan, then the documents.
    Index { name: String, bounds: ScanBounds },
    /// The same on an index placed on index nodes: its keys, read there, then the documents
    /// by key.
    PlacedIndex { name: String, bounds: ScanBounds, keys: Vec<String> },
    /// Every document, in key order.
    Full,
}

/// Index scan bounds as `EXPLAIN` shows them.
fn show_bounds(bounds: &ScanBounds) -> String {
    match bounds {
        ScanBounds::All => "all".to_string(),
        ScanBounds::Eq(v) => format!("eq {}", Value::Array(v.clone())),
        ScanBounds::Range { low, high, inclusive_low, inclusive_high } => format!(
            "range {}{} .. {}{}",
            if *inclusive_low { "[" } else { "(" },
            low.clone().map(Value::Array).unwrap_or(Value::Null),
            high.clone().map(Value::Array).unwrap_or(Value::Null),
            if *inclusive_high { "]" } else { ")" },
        ),
    }
}

/// Most keys a statement reads through an index placed on index nodes before it reads the
/// documents instead (one index scan's rows).
const PLACED_INDEX_KEYS_MAX: usize = shoal_index::SCAN_ROWS_MAX;

/// The access an index scan becomes once its index's placement answered with `keys` (read
/// with a limit of `max`): `None`, the index is this node's own and `access` stays; `max`
/// keys or more (the read stopped at its limit, so some may be missing), every document
/// instead; fewer, the keys, read by key from their actives.
fn placed_access(access: Access, keys: Option<Vec<String>>, max: usize) -> Access {
    match (access, keys) {
        (Access::Index { name, bounds }, Some(keys)) if keys.len() < max => Access::PlacedIndex { name, bounds, keys },
        (Access::Index { .. }, Some(_)) => Access::Full,
        (access, _) => access,
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Access::Keys(keys) => write!(f, "keys={}", keys.len()),
            Access::PlacedIndex { name, bounds, keys } => {
                write!(f, "index={name} {} on index nodes, keys={}", show_bounds(bounds), keys.len())
            }
            Access::Index { name, bounds } => write!(f, "index={name} {}", show_bounds(bounds)),
            Access::Full => f.write_str("full scan"),
        }
    }
}

/// The dotted path an expression reads (`a`, `a.b` via struct field access), if any.
fn path_of(e: &Expr) -> Option<String> {
    match e {
        Expr::Column(c) => Some(c.name.clone()),
        Expr::ScalarFunction(f) if f.func.name() == "get_field" && f.args.len() == 2 => {
            let base = path_of(&f.args[0])?;
            match &f.args[1] {
                Expr::Literal(ScalarValue::Utf8(Some(name)) | ScalarValue::Utf8View(Some(name)), _) => Some(format!("{base}.{name}")),
                _ => None,
            }
        }
        _ => None,
    }
}

/// A literal as the JSON value an index holds.
fn json_of(e: &Expr) -> Option<Value> {
    let Expr::Literal(v, _) = e else { return None };
    match v {
        ScalarValue::Utf8(Some(s)) | ScalarValue::LargeUtf8(Some(s)) | ScalarValue::Utf8View(Some(s)) => Some(Value::String(s.clone())),
        ScalarValue::Boolean(Some(b)) => Some(Value::Bool(*b)),
        ScalarValue::Int8(Some(n)) => Some((*n).into()),
        ScalarValue::Int16(Some(n)) => Some((*n).into()),
        ScalarValue::Int32(Some(n)) => Some((*n).into()),
        ScalarValue::Int64(Some(n)) => Some((*n).into()),
        ScalarValue::UInt8(Some(n)) => Some((*n).into()),
        ScalarValue::UInt16(Some(n)) => Some((*n).into()),
        ScalarValue::UInt32(Some(n)) => Some((*n).into()),
        ScalarValue::UInt64(Some(n)) => Some((*n).into()),
        ScalarValue::Float64(Some(f)) => serde_json::Number::from_f64(*f).map(Value::Number),
        ScalarValue::Float32(Some(f)) => serde_json::Number::from_f64(f64::from(*f)).map(Value::Number),
        _ => None,
    }
}

/// A simple condition on one path.
enum Cond {
    Eq(String, Value),
    In(String, Vec<Value>),
    /// (path, bound, inclusive, is_low)
    Bound(String, Value, bool, bool),
}

fn conds(filters: &[Expr]) -> Vec<Cond> {
    let mut out = Vec::new();
    let mut stack: Vec<&Expr> = filters.iter().collect();
    while let Some(e) = stack.pop() {
        match e {
            Expr::BinaryExpr(BinaryExpr { left, op: Operator::And, right }) => {
                stack.push(left);
                stack.push(right);
            }
            Expr::BinaryExpr(BinaryExpr { left, op, right }) => {
                let (path, value, op) = match (path_of(left), json_of(right), path_of(right), json_of(left)) {
                    (Some(p), Some(v), _, _) => (p, v, *op),
                    (_, _, Some(p), Some(v)) => match op.swap() {
                        Some(op) => (p, v, op),
                        None => continue,
                    },
                    _ => continue,
                };
                match op {
                    Operator::Eq => out.push(Cond::Eq(path, value)),
                    Operator::Gt => out.push(Cond::Bound(path, value, false, true)),
                    Operator::GtEq => out.push(Cond::Bound(path, value, true, true)),
                    Operator::Lt => out.push(Cond::Bound(path, value, false, false)),
                    Operator::LtEq => out.push(Cond::Bound(path, value, true, false)),
                    _ => {}
                }
            }
            Expr::Between(Between { expr, negated: false, low, high }) => {
                if let (Some(p), Some(lo), Some(hi)) = (path_of(expr), json_of(low), json_of(high)) {
                    out.push(Cond::Bound(p.clone(), lo, true, true));
                    out.push(Cond::Bound(p, hi, true, false));
                }
            }
            Expr::InList(list) if !list.negated => {
                if let Some(p) = path_of(&list.expr) {
                    let values: Option<Vec<Value>> = list.list.iter().map(json_of).collect();
                    if let Some(values) = values {
                        out.push(Cond::In(p, values));
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// The field a dotted path names in the table schema, if every step is a struct field.
fn field_at<'a>(schema: &'a SchemaRef, path: &str) -> Option<&'a Field> {
    let mut parts = path.split('.');
    let mut field: &Field = schema.field_with_name(parts.next()?).ok()?;
    for part in parts {
        let DataType::Struct(children) = field.data_type() else { return None };
        field = children.iter().find(|f| f.name() == part)?.as_ref();
    }
    Some(field)
}

/// Picks key lookups, else the ready index whose leading keys the filters fix the most,
/// else a full scan.
fn choose_access(env: &QueryEnv, coll: &Collection, schema: &SchemaRef, filters: &[Expr]) -> Access {
    let conds = conds(filters);
    for c in &conds {
        match c {
            Cond::Eq(p, Value::String(k)) if p == KEY_COLUMN => return Access::Keys(vec![k.clone()]),
            Cond::In(p, keys) if p == KEY_COLUMN && keys.len() <= crate::KEY_LOOKUPS_MAX => {
                let keys: Option<Vec<String>> = keys.iter().map(|k| k.as_str().map(str::to_string)).collect();
                if let Some(keys) = keys {
                    return Access::Keys(keys);
                }
            }
            _ => {}
        }
    }
    // An index gives a superset of the matching rows only where the column holds the JSON
    // values themselves (not text of mixed values) and every document is indexed.
    let usable = |path: &str| field_at(schema, path).is_some_and(|f| !is_mixed(f));
    let mut best: Option<(usize, Access)> = None;
    for status in env.indexes.list(coll) {
        if status.state != IndexState::Ready || status.def.filter.is_some() {
            continue;
        }
        let keys = &status.def.keys;
        if keys.iter().any(|k| !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')) {
            continue;
        }
        let mut prefix = Vec::new();
        for key in keys {
            let eq = conds.iter().find_map(|c| match c {
                Cond::Eq(p, v) if p == key && usable(p) => Some(v.clone()),
                _ => None,
            });
            match eq {
                Some(v) => prefix.push(v),
                None => break,
            }
        }
        let next = keys.get(prefix.len()).filter(|k| usable(k));
        let mut low: Option<(Value, bool)> = None;
        let mut high: Option<(Value, bool)> = None;
        if let Some(key) = next {
            for c in &conds {
                if let Cond::Bound(p, v, inclusive, is_low) = c {
                    if p == key {
                        let slot = if *is_low { &mut low } else { &mut high };
                        slot.get_or_insert((v.clone(), *inclusive));
                    }
                }
            }
        }
        let score = prefix.len() * 2 + usize::from(low.is_some() || high.is_some());
        if score == 0 || best.as_ref().is_some_and(|(s, _)| *s >= score) {
            continue;
        }
        let bounds = if low.is_none() && high.is_none() {
            ScanBounds::Eq(prefix)
        } else {
            let bound = |b: Option<(Value, bool)>| match b {
                Some((v, inclusive)) => (Some(prefix.iter().cloned().chain([v]).collect::<Vec<_>>()), inclusive),
                None => ((!prefix.is_empty()).then(|| prefix.clone()), true),
            };
            let (low, inclusive_low) = bound(low);
            let (high, inclusive_high) = bound(high);
            ScanBounds::Range { low, high, inclusive_low, inclusive_high }
        };
        best = Some((score, Access::Index { name: status.def.name.clone(), bounds }));
    }
    best.map(|(_, a)| a).unwrap_or(Access::Full)
}

/// Reads a collection for one query.
pub(crate) struct ScanExec {
    env: Arc<QueryEnv>,
    coll: Arc<Collection>,
    schema: SchemaRef,
    projection: Option<Vec<usize>>,
    projected: SchemaRef,
    access: Access,
    ranges: Vec<KeyRange>,
    /// Other members a full read pages (after `ranges`, one stream each).
    remotes: Vec<String>,
    limit: Option<usize>,
    properties: Arc<PlanProperties>,
    /// A full read: why it reads the documents rather than the shadow (for `EXPLAIN`).
    why_rows: Option<String>,
}

impl fmt::Debug for ScanExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ShoalScan({}, {})", self.coll.name(), self.access)
    }
}

impl DisplayAs for ScanExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "ShoalScan: collection={}, {}", self.coll.name(), self.access)?;
        if self.ranges.len() > 1 {
            write!(f, ", key ranges={}", self.ranges.len())?;
        }
        if !self.remotes.is_empty() {
            write!(f, ", members={}", self.remotes.len())?;
        }
        if let Some(l) = self.limit {
            write!(f, ", limit={l}")?;
        }
        if let Some(why) = &self.why_rows {
            write!(f, ", rows: {why}")?;
        }
        Ok(())
    }
}

/// Where a scan stream is.
enum Cursor {
    Keys(std::vec::IntoIter<String>),
    /// Next page: keys from `low` up to `high` (exclusive).
    Full {
        low: std::ops::Bound<Bytes>,
        high: Option<Bytes>,
    },
    /// Pages of a consistent index read (opened on the first page).
    Index(Option<Box<shoal_index::IndexCursor>>),
    /// Next page of another member's documents: keys after `after`.
    Remote {
        member: String,
        after: Option<Bytes>,
    },
    Done,
}

impl ExecutionPlan for ScanExec {
    fn name(&self) -> &'static str {
        "ShoalScan"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion, DataFusionError>,
    ) -> Result<TreeNodeRecursion, DataFusionError> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn replace_children(
        self: Arc<Self>,
        _children: Vec<Arc<dyn ExecutionPlan>>,
        _options: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>, DataFusionError> {
        Ok(self)
    }

    fn with_new_children(self: Arc<Self>, children: Vec<Arc<dyn ExecutionPlan>>) -> Result<Arc<dyn ExecutionPlan>, DataFusionError> {
        self.replace_children(children, ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute))
    }

    fn execute(&self, partition: usize, _context: Arc<TaskContext>) -> Result<SendableRecordBatchStream, DataFusionError> {
        let start = match &self.access {
            Access::Keys(keys) | Access::PlacedIndex { keys, .. } => Cursor::Keys(keys.clone().into_iter()),
            Access::Index { .. } => Cursor::Index(None),
            Access::Full => match (self.ranges.get(partition), partition.checked_sub(self.ranges.len())) {
                (Some((low, high)), _) => {
                    Cursor::Full { low: low.clone().map_or(std::ops::Bound::Unbounded, std::ops::Bound::Included), high: high.clone() }
                }
                (None, Some(i)) => match self.remotes.get(i) {
                    Some(member) => Cursor::Remote { member: member.clone(), after: None },
                    None => return Err(DataFusionError::Internal(format!("no scan partition {partition}"))),
                },
                (None, None) => return Err(DataFusionError::Internal(format!("no scan partition {partition}"))),
            },
        };
        let env = Arc::clone(&self.env);
        let coll = Arc::clone(&self.coll);
        let schema = Arc::clone(&self.schema);
        let projection = self.projection.clone();
        let access = self.access.clone();
        // Rows still wanted under the limit.
        let left = Arc::new(std::sync::atomic::AtomicUsize::new(self.limit.unwrap_or(usize::MAX)));
        let stream = futures::stream::unfold(start, move |cursor| {
            let (env, coll, schema, projection, access, left) =
                (Arc::clone(&env), Arc::clone(&coll), Arc::clone(&schema), projection.clone(), access.clone(), Arc::clone(&left));
            async move {
                let take = left.load(std::sync::atomic::Ordering::Relaxed).min(SCAN_BATCH_ROWS);
                if take == 0 {
                    return None;
                }
                match next_rows(&env, &coll, &access, cursor, take).await {
                    Ok(None) => None,
                    Ok(Some((rows, next))) => {
                        left.fetch_sub(rows.len().min(take), std::sync::atomic::Ordering::Relaxed);
                        let batch = to_batch(&schema, projection.as_deref(), &rows).map_err(DataFusionError::from);
                        Some((batch, next))
                    }
                    Err(e) => Some((Err(e), Cursor::Done)),
                }
            }
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(Arc::clone(&self.projected), stream)))
    }
}

fn external<E: std::error::Error + Send + Sync + 'static>(e: E) -> DataFusionError {
    DataFusionError::External(Box::new(e))
}

/// Parses stored documents (validated JSON on the way in; a body that no longer parses
/// becomes an empty object rather than a failed query).
fn parse(key: String, body: &[u8]) -> (String, Value) {
    (key, serde_json::from_slice(body).unwrap_or(Value::Object(Default::default())))
}

/// Reads the next rows of a scan: `None` when it is done.
async fn next_rows(
    env: &QueryEnv,
    coll: &Arc<Collection>,
    access: &Access,
    cursor: Cursor,
    take: usize,
) -> Result<Option<(Vec<(String, Value)>, Cursor)>, DataFusionError> {
    match cursor {
        Cursor::Done => Ok(None),
        Cursor::Full { low, high } => {
            let c = Arc::clone(coll);
            let until = high.clone();
            let spread = env.spread.clone();
            let page = tokio::task::spawn_blocking(move || {
                let low = low.as_ref().map(|b| b.as_ref());
                let docs = match &spread {
                    Some(spread) => c.scan_docs_range_in(low, until.as_deref(), take, &|p| spread.here(p))?,
                    None => c.scan_docs_range(low, until.as_deref(), take)?,
                };
                let last = docs.last().map(|d| d.0.clone());
                let rows: Vec<(String, Value)> = docs.iter().map(|(k, v)| parse(String::from_utf8_lossy(k).into_owned(), v)).collect();
                Ok::<_, shoal_storage::ReadError>((rows, last))
            })
            .await
            .map_err(external)?
            .map_err(external)?;
            match page {
                (rows, Some(last)) if !rows.is_empty() => Ok(Some((rows, Cursor::Full { low: std::ops::Bound::Excluded(last), high }))),
                _ => Ok(None),
            }
        }
        Cursor::Keys(mut keys) => {
            let batch: Vec<String> = keys.by_ref().take(take).collect();
            if batch.is_empty() {
                return Ok(None);
            }
            let rows = match &env.spread {
                Some(spread) => fetch_spread(coll, spread, batch).await?,
                None => fetch(coll, batch).await?,
            };
            Ok(Some((rows, Cursor::Keys(keys))))
        }
        Cursor::Remote { member, after } => {
            let Some(spread) = &env.spread else { return Ok(None) };
            let asked = take.min(crate::spread::REMOTE_PAGE_DOCS);
            let docs = spread.remote.scan(&member, coll.name(), after, asked).await.map_err(external)?;
            // A short page is not the end (a member's answer stops at its byte budget): the
            // member is read until it answers nothing.
            let Some(last) = docs.last().map(|d| d.0.clone()) else { return Ok(None) };
            Ok(Some((remote_rows(docs), Cursor::Remote { member, after: Some(last) })))
        }
        Cursor::Index(None) => {
            let Access::Index { name, bounds } = access else { return Ok(None) };
            let cursor = env.indexes.cursor(coll, name, bounds, env.consistency, env.index_timeout).await.map_err(external)?;
            Box::pin(next_rows(env, coll, access, Cursor::Index(Some(Box::new(cursor))), take)).await
        }
        Cursor::Index(Some(mut cursor)) => {
            // Every matching entry is read, page by page: an index scan never stops short.
            let (page, cursor) = tokio::task::spawn_blocking(move || cursor.next_page(take).map(|p| (p, cursor)))
                .await
                .map_err(external)?
                .map_err(external)?;
            if page.is_empty() {
                return Ok(None);
            }
            // Documents are keyed by key: reading a page's in key order reads neighbours.
            let mut ids: Vec<String> = page.into_iter().map(|r| r.id).collect();
            ids.sort_unstable();
            let rows = fetch(coll, ids).await?;
            Ok(Some((rows, Cursor::Index(Some(cursor)))))
        }
    }
}

/// Rows of documents another member sent.
fn remote_rows(docs: Vec<(Bytes, Bytes)>) -> Vec<(String, Value)> {
    docs.into_iter().map(|(k, v)| parse(String::from_utf8_lossy(&k).into_owned(), &v)).collect()
}

/// The documents of `keys` that exist, spread over members: those active here read here,
/// the others asked of their members (one call each, concurrently).
async fn fetch_spread(
    coll: &Arc<Collection>,
    spread: &crate::spread::Spread,
    keys: Vec<String>,
) -> Result<Vec<(String, Value)>, DataFusionError> {
    let mut local = Vec::new();
    let mut remote: std::collections::BTreeMap<&str, Vec<Bytes>> = std::collections::BTreeMap::new();
    for key in &keys {
        match spread.owner_of(key.as_bytes()) {
            None => local.push(key.clone()),
            Some(member) => remote.entry(member).or_default().push(Bytes::copy_from_slice(key.as_bytes())),
        }
    }
    let calls = remote.into_iter().map(|(member, keys)| spread.remote.get(member, coll.name(), keys));
    let (local, answers) = tokio::join!(fetch(coll, local), futures::future::join_all(calls));
    let mut rows = local?;
    for answer in answers {
        rows.extend(remote_rows(answer.map_err(external)?));
    }
    Ok(rows)
}

/// The documents of `keys` that exist, in order.
async fn fetch(coll: &Arc<Collection>, keys: Vec<String>) -> Result<Vec<(String, Value)>, DataFusionError> {
    let c = Arc::clone(coll);
    tokio::task::spawn_blocking(move || {
        let mut rows = Vec::with_capacity(keys.len());
        for key in keys {
            match c.get(&key) {
                Ok(doc) => rows.push(parse(key, &doc.value)),
                Err(shoal_storage::ReadError::NotFound | shoal_storage::ReadError::InvalidKey(_)) => {}
                Err(e) => return Err(external(e)),
            }
        }
        Ok(rows)
    })
    .await
    .map_err(external)?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_placed_index_read_that_reached_its_key_limit_reads_every_document_instead() {
        let index = || Access::Index { name: "by_a".into(), bounds: ScanBounds::All };
        let keys = |n: usize| (0..n).map(|i| format!("k{i}")).collect::<Vec<_>>();
        // (keys the placement answered, limit, the access the statement runs)
        let table: [(Option<Vec<String>>, usize, &str); 5] = [
            (None, 3, "index=by_a all"),
            (Some(keys(0)), 3, "index=by_a all on index nodes, keys=0"),
            (Some(keys(2)), 3, "index=by_a all on index nodes, keys=2"),
            (Some(keys(3)), 3, "full scan"),
            (Some(keys(4)), 3, "full scan"),
        ];
        for (answer, max, want) in table {
            let n = answer.as_ref().map(Vec::len);
            assert_eq!(placed_access(index(), answer, max).to_string(), want, "{n:?} keys, limit {max}");
        }
        // Other accesses are not index scans: the placement's answer does not change them.
        assert_eq!(placed_access(Access::Full, Some(keys(1)), 3).to_string(), "full scan");
        assert_eq!(placed_access(Access::Keys(keys(2)), Some(keys(1)), 3).to_string(), "keys=2");
    }

    #[test]
    fn key_ranges_cover_every_key_once() {
        let keys: Vec<Bytes> = ["b", "d", "f", "h"].iter().map(|k| Bytes::from(k.to_string())).collect();
        let r = key_ranges(&keys, 2);
        assert_eq!(r, vec![(None, Some(Bytes::from("f"))), (Some(Bytes::from("f")), None)]);
        assert_eq!(key_ranges(&keys, 1), vec![(None, None)]);
        assert_eq!(key_ranges(&[], 8), vec![(None, None)]);
        let many = key_ranges(&keys, 64);
        assert_eq!(many.len(), 5, "at most one range per sampled key, plus one");
        for w in many.windows(2) {
            assert_eq!(w[0].1, w[1].0, "ranges meet without gaps");
        }
    }
}
