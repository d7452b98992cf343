//! The analytics path: collections as tables over their columnar shadows, scanned with
//! one stream per analytics partition.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::array::{Array, AsArray, BooleanArray};
use datafusion::arrow::array::{RecordBatch, RecordBatchOptions};
use datafusion::arrow::buffer::BooleanBuffer;
use datafusion::arrow::datatypes::Int64Type;
use datafusion::arrow::datatypes::{DataType, Field, SchemaRef};
use datafusion::catalog::{SchemaProvider, Session, TableProvider};
use datafusion::common::config::ConfigOptions;
use datafusion::common::stats::Precision;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::utils::project_schema;
use datafusion::common::{ColumnStatistics, DataFusionError, ScalarValue, Statistics};
use datafusion::datasource::TableType;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::{BinaryExpr, Expr, Operator, TableProviderFilterPushDown};
use datafusion::physical_expr::expressions::{Column, InListExpr, Literal};
use datafusion::physical_expr::split_conjunction;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr_common::physical_expr::{snapshot_generation, snapshot_physical_expr};
use datafusion::physical_plan::filter_pushdown::{ChildPushdownResult, FilterPushdownPhase, FilterPushdownPropagation, PushedDown};
use datafusion::physical_plan::statistics::StatisticsArgs;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    ChildrenPropertiesMode, DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties, ReplaceChildrenOptions,
};
use shoal_index::Consistency;
use shoal_storage::Store;

use crate::distributed::{ClusterAnalytics, WorkerEnv};
use crate::merge::adapt_batch;
use crate::shadow::stats::{FieldSummary, TableSummary};
use crate::shadow::{Part, Shadow, ShadowError, ShadowManager, GROUP_FIELD};
use crate::table::leaf_properties;
use crate::SCAN_BATCH_ROWS;

/// What an analytics query shares with the tables it reads.
pub(crate) struct AnalyticsEnv {
    pub store: Arc<Store>,
    pub shadows: Arc<ShadowManager>,
    pub consistency: Consistency,
    pub timeout: std::time::Duration,
    /// On a cluster: the members the statement runs on, and this node's address among them.
    pub cluster: Option<(Arc<ClusterAnalytics>, String)>,
    /// Output partitions of a scan in a cluster (per task).
    pub partitions: usize,
    /// Tables opened over the members, by name: each opened once per statement.
    pub opened: parking_lot::Mutex<HashMap<String, Arc<Opening>>>,
    /// The tables over the members that this node's statements last found.
    pub known: Arc<KnownTables>,
}

/// A table being opened over the members, or opened.
pub(crate) type Opening = tokio::sync::OnceCell<Arc<dyn TableProvider>>;

/// A shadow scan in a cluster: one task per member, each reading that member's rows of the
/// partitions active on it under the pinned map (see [`crate::distributed`]).
#[derive(Clone)]
pub(crate) struct ClusterScan {
    pub collection: String,
    pub map_version: u64,
    pub timeout: std::time::Duration,
    pub members: Arc<[String]>,
    /// The member this task reads; `None` until the planner splits the scan into tasks.
    pub member: Option<String>,
    pub group: Option<String>,
}

/// The fields of this node's shadow of `collection`, with their weights, once it can be
/// read at `consistency`; and about how many of its rows are of partitions active here (its
/// rows scaled by the active partitions' share of the bytes held), for the planner's
/// statistics.
///
/// `current` (for `/v1/query`, which reads the shadow only when it answers what the
/// documents would): at `request_plus` wait at most [`crate::table::COLUMNAR_WAIT`], at
/// `not_bounded` refuse a shadow that has not applied every write made so far.
pub(crate) async fn fields_here(
    store: &Store,
    shadows: &ShadowManager,
    collection: &str,
    consistency: Consistency,
    timeout: std::time::Duration,
    current: bool,
) -> Result<crate::distributed::DecodedFields, DataFusionError> {
    let shadow = if current {
        let timeout = timeout.min(crate::table::COLUMNAR_WAIT);
        let shadow = ready_shadow(store, shadows, collection, consistency, timeout).await?;
        let coll = shadow.collection();
        let (highs, applied) = (coll.held_high_seqnos(), shadow.applied_seqnos());
        if highs.iter().zip(&applied).any(|(h, a)| a < h) {
            return Err(external(ShadowError::CatchingUp(0)));
        }
        shadow
    } else {
        ready_shadow(store, shadows, collection, consistency, timeout).await?
    };
    tokio::task::spawn_blocking(move || {
        let coll = shadow.collection();
        let (held, active) = (coll.held_here(), coll.active_here());
        let bytes =
            |keep: &[bool]| -> u64 { keep.iter().enumerate().filter(|(_, k)| **k).map(|(p, _)| coll.partition_bytes(p as u16)).sum() };
        let share = bytes(&active) as f64 / bytes(&held).max(1) as f64;
        let scaled = |n: u64| (n as f64 * share.min(1.0)) as u64;
        // The statistics of the rows held here, the counts scaled to those active here as
        // the rows are (the distinct counts are not: a share of the rows holds most of the
        // values that repeat).
        let mut summary = (*shadow.summary()).clone();
        for s in summary.values_mut() {
            s.values = scaled(s.values);
            s.distinct = s.distinct.min(s.values);
        }
        (shadow.weighted_fields(), scaled(shadow.rows() as u64), Arc::new(summary))
    })
    .await
    .map_err(|e| DataFusionError::External(Box::new(e)))
}

/// This node's shadow of `collection`, waited for: loaded, holding every partition active
/// here whole and, at `request_plus`, every change up to the high seqnos now.
async fn ready_shadow(
    store: &Store,
    shadows: &ShadowManager,
    name: &str,
    consistency: Consistency,
    timeout: std::time::Duration,
) -> Result<Arc<Shadow>, DataFusionError> {
    shadow_when_whole(store, shadows, name, consistency, timeout).await.map_err(external)
}

/// `name`'s shadow once it is loaded, holds every partition active here whole, and (at
/// `request_plus`) every change made before the call: what a scan of it here (a lone
/// node's, or a distributed statement's task) waits for.
pub(crate) async fn shadow_when_whole(
    store: &Store,
    shadows: &ShadowManager,
    name: &str,
    consistency: Consistency,
    timeout: std::time::Duration,
) -> Result<Arc<Shadow>, ShadowError> {
    if shadows.partitions() == 0 {
        return Err(ShadowError::Off);
    }
    let coll = store.collection(name).ok_or_else(|| ShadowError::NotAttached(name.to_string()))?;
    shadows.wait_loaded(timeout).await?;
    let shadow = shadows.shadow(coll.id()).ok_or_else(|| ShadowError::NotAttached(name.to_string()))?;
    if consistency == Consistency::RequestPlus {
        shadow.wait_applied(&coll.held_high_seqnos(), timeout).await?;
    }
    shadow.wait_whole(timeout).await?;
    Ok(shadow)
}

/// Every collection of the store, as tables over their shadows.
pub(crate) struct Shadows(pub Arc<AnalyticsEnv>);

impl fmt::Debug for Shadows {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Shadows")
    }
}

fn external(e: ShadowError) -> DataFusionError {
    DataFusionError::External(Box::new(e))
}

#[async_trait]
impl SchemaProvider for Shadows {
    fn table_names(&self) -> Vec<String> {
        self.0.store.list_collections().into_iter().map(|c| c.name).collect()
    }

    async fn table(&self, name: &str) -> Result<Option<Arc<dyn TableProvider>>, DataFusionError> {
        let env = &self.0;
        if env.store.collection(name).is_none() {
            return Ok(None);
        }
        if let Some((cluster, me)) = &env.cluster {
            let cell = Arc::clone(env.opened.lock().entry(name.to_string()).or_default());
            let table = cell.get_or_try_init(|| self.cluster_table(name, cluster, me)).await?;
            return Ok(Some(Arc::clone(table)));
        }
        let shadow = ready_shadow(&env.store, &env.shadows, name, env.consistency, env.timeout).await?;
        let s = Arc::clone(&shadow);
        let schema = tokio::task::spawn_blocking(move || s.schema()).await.map_err(|e| DataFusionError::External(Box::new(e)))?;
        Ok(Some(Arc::new(ShadowTable { source: Source::Here(shadow), schema, name: name.to_string(), timeout: env.timeout })))
    }

    fn table_exist(&self, name: &str) -> bool {
        self.0.store.collection(name).is_some()
    }
}

/// The members' shadows of `name`: the schema merged from each member's fields (asked of
/// them all at once; each waits until its shadow can be read, see [`fields_here`]) and
/// about how many rows they hold of partitions active on them.
pub(crate) async fn members_schema(
    store: &Store,
    shadows: &ShadowManager,
    (cluster, me): (&ClusterAnalytics, &str),
    name: &str,
    consistency: Consistency,
    timeout: std::time::Duration,
    current: bool,
) -> Result<MembersTable, DataFusionError> {
    let mut tables = members_schemas(store, shadows, (cluster, me), &[name.to_string()], consistency, timeout, current).await?;
    tables.pop().ok_or_else(|| DataFusionError::Internal(format!("no schema of {name} over the members")))
}

/// [`members_schema`] of each of `names` (at most [`crate::distributed::FIELDS_TABLES_MAX`]),
/// in order: one call per member for them all.
pub(crate) async fn members_schemas(
    store: &Store,
    shadows: &ShadowManager,
    (cluster, me): (&ClusterAnalytics, &str),
    names: &[String],
    consistency: Consistency,
    timeout: std::time::Duration,
    current: bool,
) -> Result<Vec<MembersTable>, DataFusionError> {
    let asks = cluster.members.iter().map(|m| async move {
        if m == me {
            let here = names
                .iter()
                .map(|name| async move { fields_here(store, shadows, name, consistency, timeout, current).await.map(Arc::new) });
            futures::future::try_join_all(here).await
        } else {
            let bytes = cluster
                .remote
                .fields(m, names, consistency, timeout, current)
                .await
                .map_err(|e| crate::distributed::tag(crate::distributed::Kind::Unavailable, e))?;
            crate::distributed::decode_fields_list(&bytes, names.len())
        }
    });
    let members = futures::future::try_join_all(asks).await?;
    Ok((0..names.len()).map(|t| merged(members.iter().map(|m| m[t].as_ref()))).collect())
}

/// One table's schema, rows and statistics, merged from each member's.
fn merged<'a>(members: impl Iterator<Item = &'a crate::distributed::DecodedFields> + Clone) -> MembersTable {
    let mut fields = Vec::new();
    let mut rows = 0;
    for member in members.clone() {
        fields.extend(member.0.iter().cloned());
        rows += member.1;
    }
    let stats = crate::shadow::stats::union_members(members.map(|m| m.2.as_ref()));
    fields.insert(0, (Field::new(crate::schema::KEY_COLUMN, datafusion::arrow::datatypes::DataType::Utf8, false), u64::MAX));
    let schema = Arc::new(datafusion::arrow::datatypes::Schema::new(crate::merge::merge_fields(&fields)));
    MembersTable { schema, rows: rows as usize, stats: Arc::new(stats) }
}

/// The members' shadows of a table, as [`members_schema`] merged them.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct MembersTable {
    pub schema: SchemaRef,
    /// About how many rows of partitions active on them they hold.
    pub rows: usize,
    /// Their columns' statistics, merged.
    pub stats: Arc<TableSummary>,
}

/// A scan over the members' shadows of `name`, its schema `projected`, one task per member.
/// `shape`: output partitions per task, about how many rows in all, and the columns'
/// statistics. A small table's scan is marked so that a join broadcasting it gathers it
/// while the statement is planned ([`crate::gather`]).
pub(crate) fn members_scan(
    cluster: &ClusterAnalytics,
    name: &str,
    timeout: std::time::Duration,
    projected: SchemaRef,
    filters: &[Expr],
    limit: Option<usize>,
    (partitions, rows, stats): (usize, usize, Arc<TableSummary>),
) -> ShadowScanExec {
    let scan = ClusterScan {
        collection: name.to_string(),
        map_version: cluster.map_version,
        timeout,
        members: cluster.members.clone().into(),
        member: None,
        group: filters.iter().find_map(group_of),
    };
    let small = crate::gather::gatherable(rows, limit, projected.fields().len());
    let scan = ShadowScanExec::in_cluster(scan, projected, limit, partitions.max(2), rows).with_stats(stats);
    if small {
        scan.with_small(filters)
    } else {
        scan
    }
}

impl Shadows {
    /// A collection over the members' shadows: its schema merged from each member's fields,
    /// asked of them all at once (each waits until its shadow can be read).
    async fn cluster_table(
        &self,
        name: &str,
        cluster: &Arc<ClusterAnalytics>,
        me: &str,
    ) -> Result<Arc<dyn TableProvider>, DataFusionError> {
        let env = &self.0;
        let table = members_schema(&env.store, &env.shadows, (cluster, me), name, env.consistency, env.timeout, false).await?;
        Ok(self.over_members(name, cluster, table))
    }

    fn over_members(&self, name: &str, cluster: &Arc<ClusterAnalytics>, table: MembersTable) -> Arc<dyn TableProvider> {
        let env = &self.0;
        Arc::new(ShadowTable {
            source: Source::Cluster(Arc::clone(cluster), env.partitions, table.rows, table.stats),
            schema: table.schema,
            name: name.to_string(),
            timeout: env.timeout,
        })
    }

    /// Opens the collections among `names` over the members before the statement is
    /// planned: one call per member for them all ([`members_schemas`]), where the planner
    /// would open them one at a time, each with a call per member. It then finds them open.
    ///
    /// When every one of them is as the last two statements found it ([`KnownTables`]) and
    /// the statement's reads can be made to wait for the members (`gate`), they are opened
    /// as they were, the gate is closed until the members answer again, and the statement
    /// is planned meanwhile: the [`Speculation`] returned says, once they answer, whether
    /// the plan may run. Nothing to do on a single node.
    pub(crate) async fn open_all(
        &self,
        names: &[String],
        gate: Option<&crate::gather::OpenGate>,
    ) -> Result<Option<Speculation>, DataFusionError> {
        let env = &self.0;
        let Some((cluster, _)) = &env.cluster else { return Ok(None) };
        let mut names: Vec<String> = names.iter().filter(|n| env.store.collection(n).is_some()).cloned().collect();
        names.sort_unstable();
        names.dedup();
        if names.is_empty() {
            return Ok(None);
        }
        if let (Some(gate), Some(known)) = (gate, env.known.unchanged(&names, cluster.map_version, &cluster.members)) {
            self.set_open(&names, cluster, known.clone());
            let (env, asked) = (Arc::clone(env), names.clone());
            let task = crate::runtime::spawn_started(async move { fetch_tables(&env, &asked).await });
            let fresh: Fresh = futures::FutureExt::shared(futures::FutureExt::boxed(async move {
                match task.join().await {
                    Ok(tables) => tables.map(Arc::new).map_err(Arc::new),
                    Err(e) => Err(Arc::new(DataFusionError::External(Box::new(e)))),
                }
            }));
            gate.close_until(fresh.clone())?;
            let (shadows, cluster) = (Shadows(Arc::clone(&self.0)), Arc::clone(cluster));
            return Ok(Some(Speculation { shadows, cluster, names, known, fresh }));
        }
        let tables = fetch_tables(env, &names).await?;
        env.known.learn(&names, cluster.map_version, &cluster.members, &tables);
        self.set_open(&names, cluster, tables);
        Ok(None)
    }

    /// Sets each of `names` open as `tables` over the members, in place of how it was opened
    /// before, if it was (a statement planned again on the members' answers).
    fn set_open(&self, names: &[String], cluster: &Arc<ClusterAnalytics>, tables: Vec<MembersTable>) {
        debug_assert_eq!(names.len(), tables.len());
        let mut opened = self.0.opened.lock();
        for (name, table) in names.iter().zip(tables) {
            opened.insert(name.clone(), Arc::new(Opening::new_with(Some(self.over_members(name, cluster, table)))));
        }
    }
}

/// [`members_schemas`] of each of `names`, in order, with one call per member for every
/// [`crate::distributed::FIELDS_TABLES_MAX`] of them.
async fn fetch_tables(env: &AnalyticsEnv, names: &[String]) -> Result<Vec<MembersTable>, DataFusionError> {
    let Some((cluster, me)) = &env.cluster else { return Ok(Vec::new()) };
    let asks = names
        .chunks(crate::distributed::FIELDS_TABLES_MAX)
        .map(|names| members_schemas(&env.store, &env.shadows, (cluster, me), names, env.consistency, env.timeout, false));
    Ok(futures::future::try_join_all(asks).await?.into_iter().flatten().collect())
}

/// The members' answers to a statement's fields calls, shared by whatever waits for them:
/// each member answers once its shadows hold the statement's `request_plus` positions.
pub(crate) type Fresh = futures::future::Shared<futures::future::BoxFuture<'static, Result<Arc<Vec<MembersTable>>, Arc<DataFusionError>>>>;

/// A statement planned on the tables as they were known, while the members are asked again.
pub(crate) struct Speculation {
    shadows: Shadows,
    cluster: Arc<ClusterAnalytics>,
    names: Vec<String>,
    known: Vec<MembersTable>,
    fresh: Fresh,
}

impl Speculation {
    /// Waits for the members' answers: whether they are the tables the statement was
    /// planned on, so that its plan is the one they would have made. If not, the tables
    /// are opened again as the members answered, for the statement to be planned again.
    /// Their error is the statement's.
    pub(crate) async fn confirmed(self) -> Result<bool, DataFusionError> {
        let fresh = self.fresh.await.map_err(DataFusionError::Shared)?;
        let cluster = &self.cluster;
        self.shadows.0.known.learn(&self.names, cluster.map_version, &cluster.members, &fresh);
        let same = *fresh == self.known;
        if !same {
            self.shadows.set_open(&self.names, cluster, fresh.to_vec());
        }
        Ok(same)
    }
}

/// Most tables over the members whose schemas a coordinator keeps ([`KnownTables`]); past
/// it, it forgets them all and starts again.
pub const KNOWN_TABLES_MAX: usize = 1024;

/// The tables over the members (schemas, rows, statistics) this node's statements last
/// found, by collection.
///
/// Opening a table over the members asks each member for its fields (which also waits
/// for its shadow to hold the statement's `request_plus` positions): a round trip before
/// planning can start. A statement whose tables were found the same by the last two
/// statements under the same map is planned on them while the members are asked again
/// ([`Shadows::open_all`]); reads wait for the answers, and the plan runs only if they
/// are the tables it was planned on: the plan is the one the answers would have made.
/// Otherwise it is planned again on them. Tables that change between statements are never
/// planned on before the members answer, so that no statement plans twice in a row.
#[derive(Default)]
pub struct KnownTables(parking_lot::Mutex<HashMap<String, Known>>);

struct Known {
    map_version: u64,
    members: Vec<String>,
    table: MembersTable,
    /// Found the same by the last two statements that asked.
    unchanged: bool,
}

impl KnownTables {
    /// `names`' tables under map `map_version` over `members`, if every one of them was
    /// found the same by the last two statements that asked.
    fn unchanged(&self, names: &[String], map_version: u64, members: &[String]) -> Option<Vec<MembersTable>> {
        let known = self.0.lock();
        names
            .iter()
            .map(|name| {
                let k = known.get(name)?;
                (k.unchanged && k.map_version == map_version && k.members == members).then(|| k.table.clone())
            })
            .collect()
    }

    /// The members answered `tables` for `names`.
    fn learn(&self, names: &[String], map_version: u64, members: &[String], tables: &[MembersTable]) {
        debug_assert_eq!(names.len(), tables.len());
        let mut known = self.0.lock();
        for (name, table) in names.iter().zip(tables) {
            let unchanged = known.get(name).is_some_and(|k| k.map_version == map_version && k.members == members && k.table == *table);
            if !unchanged && !known.contains_key(name) && known.len() >= KNOWN_TABLES_MAX {
                known.clear();
            }
            known.insert(name.clone(), Known { map_version, members: members.to_vec(), table: table.clone(), unchanged });
        }
    }
}

/// Where a table's rows are.
enum Source {
    /// This node's shadow holds them all.
    Here(Arc<Shadow>),
    /// The members' shadows, read by a scan split into `.1` partitions per task, about `.2`
    /// rows in all, their columns' statistics `.3`.
    Cluster(Arc<ClusterAnalytics>, usize, usize, Arc<TableSummary>),
}

pub(crate) struct ShadowTable {
    source: Source,
    schema: SchemaRef,
    name: String,
    /// The statement's timeout.
    timeout: std::time::Duration,
}

impl fmt::Debug for ShadowTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            Source::Here(_) => write!(f, "ShadowTable({})", self.name),
            Source::Cluster(..) => write!(f, "ShadowTable({}, members)", self.name),
        }
    }
}

impl ShadowTable {
    /// What gathering this table would read ([`crate::gather`]): a table over the members
    /// estimated at most [`crate::gather::GATHER_ROWS_MAX`] rows, read whole (no limit)
    /// for some column. `None` for any other.
    pub(crate) fn small_read(
        &self,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Option<crate::gather::SmallRead>, DataFusionError> {
        let Source::Cluster(cluster, _, rows, _) = &self.source else { return Ok(None) };
        let projected = project_schema(&self.schema, projection)?;
        if !crate::gather::gatherable(*rows, limit, projected.fields().len()) {
            return Ok(None);
        }
        Ok(Some(crate::gather::SmallRead {
            collection: self.name.clone(),
            map_version: cluster.map_version,
            timeout: self.timeout,
            members: cluster.members.clone().into(),
            group: filters.iter().find_map(group_of),
            projected,
            filters: filters.to_vec(),
        }))
    }
}

/// The group a filter `table_name = '...'` (either way round) selects.
fn group_of(e: &Expr) -> Option<String> {
    let Expr::BinaryExpr(BinaryExpr { left, op: Operator::Eq, right }) = e else { return None };
    let lit = |e: &Expr| match e {
        Expr::Literal(ScalarValue::Utf8(Some(s)) | ScalarValue::Utf8View(Some(s)) | ScalarValue::LargeUtf8(Some(s)), _) => Some(s.clone()),
        _ => None,
    };
    let is_group = |e: &Expr| matches!(e, Expr::Column(c) if c.name == GROUP_FIELD);
    if is_group(left) {
        lit(right)
    } else if is_group(right) {
        lit(left)
    } else {
        None
    }
}

#[async_trait]
impl TableProvider for ShadowTable {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    /// A `table_name = '...'` filter skips segments of other groups; DataFusion applies
    /// every filter again.
    fn supports_filters_pushdown(&self, filters: &[&Expr]) -> Result<Vec<TableProviderFilterPushDown>, DataFusionError> {
        Ok(vec![TableProviderFilterPushDown::Inexact; filters.len()])
    }

    async fn scan(
        &self,
        _state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>, DataFusionError> {
        let projected = project_schema(&self.schema, projection)?;
        let shadow = match &self.source {
            Source::Here(shadow) => shadow,
            Source::Cluster(cluster, partitions, rows, stats) => {
                let timeout = self.timeout;
                let scan = members_scan(cluster, &self.name, timeout, projected, filters, limit, (*partitions, *rows, Arc::clone(stats)));
                return Ok(Arc::new(scan));
            }
        };
        shadow_scan(Arc::clone(shadow), projected, filters, limit, None).await
    }
}

/// A scan of a snapshot of `shadow` as of now, one stream per analytics partition; a
/// `table_name = '...'` filter skips other groups' segments. `columnar` says why `/v1/query`
/// reads it (for `EXPLAIN`).
pub(crate) async fn shadow_scan(
    shadow: Arc<Shadow>,
    projected: SchemaRef,
    filters: &[Expr],
    limit: Option<usize>,
    columnar: Option<String>,
) -> Result<Arc<dyn ExecutionPlan>, DataFusionError> {
    let group = filters.iter().find_map(group_of);
    let (s, g) = (Arc::clone(&shadow), group.clone());
    let parts = tokio::task::spawn_blocking(move || s.snapshot(g.as_deref()))
        .await
        .map_err(|e| DataFusionError::External(Box::new(e)))?
        .map_err(external)?;
    let rows = parts.iter().map(|p| p.iter().map(Part::rows).sum()).collect();
    let properties = leaf_properties(&projected, parts.len().max(1));
    Ok(Arc::new(ShadowScanExec {
        name: shadow.collection().name().to_string(),
        parts: Arc::new(parts),
        rows,
        projected,
        group,
        limit,
        properties,
        dynamic: Vec::new(),
        cluster: None,
        columnar,
        stats: None,
        small: None,
    }))
}

/// Reads a snapshot of a shadow: partition `i` of the plan is analytics partition `i`. In a
/// cluster, reads a member's shadow instead (`cluster`).
#[derive(Clone)]
pub(crate) struct ShadowScanExec {
    name: String,
    parts: Arc<Vec<Vec<Part>>>,
    /// Live rows per analytics partition.
    rows: Vec<usize>,
    projected: SchemaRef,
    group: Option<String>,
    limit: Option<usize>,
    properties: Arc<PlanProperties>,
    /// Filters a hash join derives from its build side once built (DataFusion's dynamic
    /// filters, e.g. `ss_item_sk IN (...)`): rows they reject are dropped in the scan.
    dynamic: Vec<Arc<dyn PhysicalExpr>>,
    /// In a cluster: which members' rows, and (on a worker) this node's shadows to read them from.
    cluster: Option<ClusterScan>,
    /// On `/v1/query`: why the shadow is read rather than the documents.
    columnar: Option<String>,
    /// Its table's columns' statistics, for the planner's estimates (a cluster's; see
    /// [`crate::shadow::stats`]).
    stats: Option<Arc<TableSummary>>,
    /// In a cluster, a table small enough to be gathered if it is a broadcast's build side
    /// ([`crate::gather`]): the filters DataFusion pushed to it.
    small: Option<Arc<[Expr]>>,
}

impl fmt::Debug for ShadowScanExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ShadowScan({})", self.name)
    }
}

impl DisplayAs for ShadowScanExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let pieces: usize = self.parts.iter().map(Vec::len).sum();
        match &self.cluster {
            Some(c) => {
                write!(f, "ShadowScan: collection={}, members={}", self.name, c.members.len())?;
                if let Some(m) = &c.member {
                    write!(f, ", member={m}")?;
                }
            }
            None => write!(f, "ShadowScan: collection={}, analytics partitions={}, segments={pieces}", self.name, self.parts.len())?,
        }
        if let Some(g) = &self.group {
            write!(f, ", {GROUP_FIELD}={g:?}")?;
        }
        if let Some(l) = self.limit {
            write!(f, ", limit={l}")?;
        }
        if let Some(why) = &self.columnar {
            write!(f, ", columnar: {why}")?;
        }
        if !self.dynamic.is_empty() {
            let now: Vec<String> = self
                .dynamic
                .iter()
                .map(|d| snapshot_physical_expr(Arc::clone(d)).map_or_else(|e| e.to_string(), |e| e.to_string()))
                .collect();
            write!(f, ", dynamic filters=[{}]", now.join(", "))?;
        }
        Ok(())
    }
}

/// How many rows one conjunct of a dynamic filter has let through of how many it saw.
#[derive(Default, Clone, Copy)]
struct Sieve {
    passed: u64,
    seen: u64,
}

impl Sieve {
    /// The share of rows it keeps (a half until it has seen some).
    fn pass_rate(&self) -> f64 {
        (self.passed as f64 + 1.0) / (self.seen as f64 + 2.0)
    }
}

/// A scan copies the rows its masks keep out of a batch once they are fewer than this share
/// of it (later conjuncts then read fewer rows); until then the masks are combined.
const COPY_OUT_BELOW: f64 = 0.25;

/// Widest range of integers an `IN` list is run as a bitmap over (2 MiB of bits).
const BITMAP_RANGE_MAX: u64 = 1 << 24;

/// A conjunct as the scan runs it. `column IN (integers)` over a narrow range — what a
/// hash join's dynamic filter becomes for a small build side — is a bitmap test, one load
/// per row; DataFusion's hash set costs about 4 ns a row, most of query 3 (profiled).
/// Anything else runs as DataFusion evaluates it.
enum Conjunct {
    Bits { column: usize, min: i64, bits: Vec<u64> },
    Expr(Arc<dyn PhysicalExpr>),
}

impl Conjunct {
    fn compile(e: &Arc<dyn PhysicalExpr>) -> Conjunct {
        let generic = || Conjunct::Expr(Arc::clone(e));
        let Some(list) = e.downcast_ref::<InListExpr>() else { return generic() };
        let Some(column) = list.expr().downcast_ref::<Column>() else { return generic() };
        if list.negated() {
            return generic();
        }
        // A NULL in the list never makes a row pass a filter: it is left out.
        let mut values = Vec::with_capacity(list.len());
        for item in list.list() {
            match item.downcast_ref::<Literal>().map(Literal::value) {
                Some(ScalarValue::Int64(Some(v))) => values.push(*v),
                Some(ScalarValue::Int64(None)) => {}
                _ => return generic(),
            }
        }
        let (Some(&min), Some(&max)) = (values.iter().min(), values.iter().max()) else { return generic() };
        let range = (i128::from(max) - i128::from(min) + 1) as u64;
        if range > BITMAP_RANGE_MAX {
            return generic();
        }
        let mut bits = vec![0u64; range.div_ceil(64) as usize];
        for v in values {
            let at = v.wrapping_sub(min) as u64;
            bits[(at / 64) as usize] |= 1 << (at % 64);
        }
        Conjunct::Bits { column: column.index(), min, bits }
    }

    /// Which rows pass of those `keep` holds (all when `None`): the mask to keep from here.
    fn evaluate(&self, batch: &RecordBatch, keep: Option<&BooleanArray>) -> Result<Option<BooleanArray>, DataFusionError> {
        match self {
            Conjunct::Bits { column, min, bits } => {
                let Some(values) = batch.columns().get(*column).and_then(|c| c.as_primitive_opt::<Int64Type>()) else {
                    return Ok(None);
                };
                let (v, min, bits): (&[i64], i64, &[u64]) = (values.values(), *min, bits);
                let held: Option<Vec<u64>> = keep.map(|k| definite(k).bit_chunks().iter_padded().collect());
                let mut words = vec![0u64; v.len().div_ceil(64)];
                for (w, out) in words.iter_mut().enumerate() {
                    // Runs of rows already dropped (a replica's partitions: segments are in
                    // partition order) are skipped 64 at a time.
                    let kept = held.as_ref().map_or(u64::MAX, |h| h.get(w).copied().unwrap_or(0));
                    if kept == 0 {
                        continue;
                    }
                    let start = w * 64;
                    let mut pass = 0u64;
                    for (j, &x) in v[start..v.len().min(start + 64)].iter().enumerate() {
                        // Past the bitmap is past the range; its last word's spare bits are 0.
                        let at = x.wrapping_sub(min) as u64;
                        let hit = bits.get((at / 64) as usize).map_or(0, |b| (b >> (at % 64)) & 1);
                        pass |= hit << j;
                    }
                    *out = pass & kept;
                }
                let mut pass = BooleanBuffer::new(datafusion::arrow::buffer::Buffer::from_vec(words), 0, v.len());
                if let Some(n) = values.nulls() {
                    pass = &pass & n.inner();
                }
                Ok(Some(BooleanArray::new(pass, None)))
            }
            Conjunct::Expr(e) => {
                let pass = e.evaluate(batch)?.into_array(batch.num_rows())?;
                let Some(pass) = pass.as_any().downcast_ref::<BooleanArray>() else { return Ok(None) };
                Ok(Some(match keep {
                    Some(k) => datafusion::arrow::compute::and(k, pass)?,
                    None => pass.clone(),
                }))
            }
        }
    }
}

/// `mask`'s rows that are set and not null.
fn definite(mask: &BooleanArray) -> BooleanBuffer {
    match mask.nulls() {
        Some(n) => mask.values() & n.inner(),
        None => mask.values().clone(),
    }
}

/// The scan's dynamic filters and what each conjunct of them has done so far, keyed by
/// (filter, conjunct).
struct Sieves {
    filters: Vec<Arc<dyn PhysicalExpr>>,
    stats: HashMap<(usize, usize), Sieve>,
}

/// A part as batches of the projected columns, live rows that pass the dynamic filters
/// only, at most [`SCAN_BATCH_ROWS`] rows each. Each filter is split into its conjuncts
/// (`a >= x AND a <= y AND a IN (...)`), and they run most selective first as measured so
/// far, so the one that keeps few rows spares the others most of their work.
fn project(part: &Part, schema: &SchemaRef, sieves: &mut Sieves) -> Result<Vec<RecordBatch>, DataFusionError> {
    let mut batch = adapt_batch(&part.batch, schema)?;
    // The rows kept so far and not copied out yet: the live rows of partitions active here
    // first (on a cluster, about half of what a member holds are replicas' rows).
    let mut keep = part.live.clone();
    // Each filter as of now (its join's build side is complete by the time the probe side
    // is read; `true` until then), split into conjuncts.
    let mut conjuncts = Vec::new();
    for (i, f) in sieves.filters.iter().enumerate() {
        let now = snapshot_physical_expr(Arc::clone(f))?;
        for (j, c) in split_conjunction(&now).into_iter().enumerate() {
            if !c.downcast_ref::<Literal>().is_some_and(|l| l.value() == &ScalarValue::Boolean(Some(true))) {
                conjuncts.push(((i, j), Conjunct::compile(c)));
            }
        }
    }
    let stats = &mut sieves.stats;
    conjuncts.sort_by(|a, b| {
        let rate = |k| stats.get(k).copied().unwrap_or_default().pass_rate();
        rate(&a.0).total_cmp(&rate(&b.0))
    });
    for (key, c) in conjuncts {
        let kept = keep.as_ref().map_or(batch.num_rows(), BooleanArray::true_count);
        if kept == 0 {
            break;
        }
        // A conjunct (a join's bounds or key lookup: it cannot fail on a row) runs over the
        // rows not copied out yet, dropped ones too, and its answer joins the mask: rows are
        // copied once they are few, or at the end, rather than after every step.
        if let Some(now) = c.evaluate(&batch, keep.as_ref())? {
            keep = None;
            let passed = now.true_count();
            let sieve = stats.entry(key).or_default();
            sieve.seen += kept as u64;
            sieve.passed += passed as u64;
            if (passed as f64) < COPY_OUT_BELOW * batch.num_rows() as f64 {
                batch = keep_rows(&batch, schema, &now)?;
            } else {
                keep = Some(now);
            }
        }
    }
    if let Some(k) = keep {
        batch = keep_rows(&batch, schema, &k)?;
    }
    let mut out = Vec::with_capacity(batch.num_rows().div_ceil(SCAN_BATCH_ROWS));
    let mut offset = 0;
    while offset < batch.num_rows() {
        let len = SCAN_BATCH_ROWS.min(batch.num_rows() - offset);
        out.push(batch.slice(offset, len));
        offset += len;
    }
    Ok(out)
}

/// The rows of `batch` that `mask` keeps.
fn keep_rows(batch: &RecordBatch, schema: &SchemaRef, mask: &BooleanArray) -> Result<RecordBatch, DataFusionError> {
    if schema.fields().is_empty() {
        let options = RecordBatchOptions::new().with_row_count(Some(mask.true_count()));
        return Ok(RecordBatch::try_new_with_options(Arc::clone(schema), vec![], &options)?);
    }
    Ok(datafusion::arrow::compute::filter_record_batch(batch, mask)?)
}

/// The bytes of a scan's output: its columns' values, slices counted for their own rows.
fn scanned_bytes(batch: &RecordBatch) -> u64 {
    batch.columns().iter().map(|c| c.to_data().get_slice_memory_size().unwrap_or(0) as u64).sum()
}

/// Which rows of `part` are live and of a storage partition active here.
fn active_rows(part: &Part, actives: &[bool]) -> Result<BooleanArray, DataFusionError> {
    let active = part.partitions.active(&part.batch, actives).map_err(external)?;
    let keep = match &part.live {
        Some(live) => &active & &definite(live),
        None => active,
    };
    Ok(BooleanArray::new(keep, None))
}

/// A member's scan task of a distributed statement, counted while it runs.
struct TaskRunning;

impl TaskRunning {
    fn start() -> TaskRunning {
        metrics::gauge!("shoal_analytics_tasks_running").increment(1.0);
        TaskRunning
    }
}

impl Drop for TaskRunning {
    fn drop(&mut self) {
        metrics::gauge!("shoal_analytics_tasks_running").decrement(1.0);
    }
}

/// At most `limit` rows of `batches`.
fn limited(
    batches: impl Iterator<Item = Result<RecordBatch, DataFusionError>>,
    limit: Option<usize>,
) -> impl Iterator<Item = Result<RecordBatch, DataFusionError>> {
    let mut left = limit.unwrap_or(usize::MAX);
    batches.map_while(move |b| {
        if left == 0 {
            return None;
        }
        Some(b.map(|b| {
            let b = if b.num_rows() > left { b.slice(0, left) } else { b };
            left -= b.num_rows();
            b
        }))
    })
}

impl ShadowScanExec {
    /// A scan over the members' shadows, `partitions` output partitions per task, `rows`
    /// estimated.
    pub(crate) fn in_cluster(
        scan: ClusterScan,
        projected: SchemaRef,
        limit: Option<usize>,
        partitions: usize,
        rows: usize,
    ) -> ShadowScanExec {
        let partitions = partitions.max(1);
        ShadowScanExec {
            name: scan.collection.clone(),
            parts: Arc::new(Vec::new()),
            rows: vec![rows / partitions; partitions],
            properties: leaf_properties(&projected, partitions),
            projected,
            group: scan.group.clone(),
            limit,
            dynamic: Vec::new(),
            cluster: Some(scan),
            columnar: None,
            stats: None,
            small: None,
        }
    }

    /// The scan of a table small enough to be gathered, with the filters pushed to it.
    pub(crate) fn with_small(mut self, filters: &[Expr]) -> ShadowScanExec {
        self.small = Some(filters.into());
        self
    }

    /// A small table's filters: `Some` if it may be gathered.
    pub(crate) fn small(&self) -> Option<&[Expr]> {
        self.small.as_deref()
    }

    /// The projected columns.
    pub(crate) fn projected(&self) -> &SchemaRef {
        &self.projected
    }

    /// The scan with its table's columns' statistics.
    pub(crate) fn with_stats(mut self, stats: Arc<TableSummary>) -> ShadowScanExec {
        self.stats = Some(stats);
        self
    }

    /// In a cluster: which members' rows it reads.
    pub(crate) fn cluster(&self) -> Option<&ClusterScan> {
        self.cluster.as_ref()
    }

    pub(crate) fn limit(&self) -> Option<usize> {
        self.limit
    }

    /// The dynamic filters joins pushed into it.
    pub(crate) fn dynamic(&self) -> &[Arc<dyn PhysicalExpr>] {
        &self.dynamic
    }

    pub(crate) fn with_dynamic(mut self, dynamic: Vec<Arc<dyn PhysicalExpr>>) -> ShadowScanExec {
        self.dynamic = dynamic;
        self
    }

    /// The scan of one task: `member`'s rows.
    pub(crate) fn for_member(&self, member: &str) -> ShadowScanExec {
        let mut out = self.clone();
        if let Some(c) = &mut out.cluster {
            c.member = Some(member.to_string());
        }
        out
    }

    /// A task's read of its member's shadow (see [`crate::distributed`]).
    fn execute_in_cluster(
        &self,
        scan: &ClusterScan,
        partition: usize,
        context: &TaskContext,
    ) -> Result<SendableRecordBatchStream, DataFusionError> {
        use crate::distributed::{tag, Kind};
        let Some(member) = &scan.member else {
            return Err(tag(Kind::NotPlaced, format!("the scan of {} was not split over the members", scan.collection)));
        };
        // A worker's sessions, the coordinator's own included, carry its shadows.
        let Some(env) = context.session_config().get_extension::<WorkerEnv>() else {
            return Err(tag(Kind::NotPlaced, format!("the scan of {member}'s rows ran on a coordinator")));
        };
        if env.local.address() != *member {
            return Err(tag(Kind::NotPlaced, format!("the scan of {member}'s rows ran on {}", env.local.address())));
        }
        let scan = scan.clone();
        let schema = Arc::clone(&self.projected);
        let partitions = self.properties.partitioning.partition_count();
        let (limit, dynamic) = (self.limit, self.dynamic.clone());
        let read = async move { env.read(&scan, partition, partitions).await };
        // Counted in `shoal_analytics_tasks_running` until the stream ends or is dropped
        // (its statement done, failed or cancelled).
        let running = TaskRunning::start();
        let batches = futures::StreamExt::flat_map(futures::stream::once(read), move |r| {
            let _ = &running;
            type Batches = Box<dyn Iterator<Item = Result<RecordBatch, DataFusionError>> + Send>;
            let out: Batches = match r {
                Err(e) => Box::new(std::iter::once(Err(e))),
                // A piece at a time, as they are pulled: a join's dynamic filter is complete
                // by the time its probe side is read.
                Ok((parts, actives)) => {
                    let schema = Arc::clone(&schema);
                    let mut sieves = Sieves { filters: dynamic.clone(), stats: HashMap::new() };
                    let pieces = parts.into_iter().flat_map(move |mut part| {
                        let mut one = || -> Result<Vec<RecordBatch>, DataFusionError> {
                            if let Some(actives) = &actives {
                                part.live = Some(active_rows(&part, actives)?);
                            }
                            let batches = project(&part, &schema, &mut sieves)?;
                            let bytes: u64 = batches.iter().map(scanned_bytes).sum();
                            metrics::counter!("shoal_analytics_scanned_bytes_total").increment(bytes);
                            Ok(batches)
                        };
                        match one() {
                            Ok(bs) => bs.into_iter().map(Ok).collect::<Vec<_>>(),
                            Err(e) => vec![Err(e)],
                        }
                    });
                    Box::new(limited(pieces, limit))
                }
            };
            futures::stream::iter(out)
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(Arc::clone(&self.projected), batches)))
    }

    fn stats(&self, partition: Option<usize>) -> Arc<Statistics> {
        let rows = match partition {
            Some(p) => self.rows.get(p).copied().unwrap_or(0),
            None => self.rows.iter().sum(),
        };
        let rows = self.limit.map_or(rows, |l| rows.min(l));
        let mut stats = Statistics::new_unknown(&self.projected).with_num_rows(Precision::Inexact(rows));
        if let Some(summary) = &self.stats {
            // Each column's share of the table's, as the rows are this partition's share.
            let total: usize = self.rows.iter().sum();
            let share = if total == 0 { 0.0 } else { rows as f64 / total as f64 };
            for (field, column) in self.projected.fields().iter().zip(stats.column_statistics.iter_mut()) {
                if let Some(s) = summary.get(field.name()) {
                    *column = column_statistics(field.data_type(), s, share, rows);
                }
            }
        }
        Arc::new(stats)
    }
}

impl ExecutionPlan for ShadowScanExec {
    fn name(&self) -> &'static str {
        "ShadowScan"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![]
    }

    /// The dynamic filters: a join looks for them here to know its filter has a consumer.
    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion, DataFusionError>,
    ) -> Result<TreeNodeRecursion, DataFusionError> {
        for d in &self.dynamic {
            if f(d)? == TreeNodeRecursion::Stop {
                return Ok(TreeNodeRecursion::Stop);
            }
        }
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

    /// Row counts, so that joins build their hash tables on the smaller side.
    fn statistics_from_inputs(&self, _input_stats: &[Arc<Statistics>], args: &StatisticsArgs) -> Result<Arc<Statistics>, DataFusionError> {
        Ok(self.stats(args.partition()))
    }

    #[allow(deprecated)]
    fn partition_statistics(&self, partition: Option<usize>) -> Result<Arc<Statistics>, DataFusionError> {
        Ok(self.stats(partition))
    }

    /// Keeps the dynamic filters joins push down (see [`ShadowScanExec::dynamic`]); every
    /// filter stays with its parent too, so nothing depends on the scan applying it.
    fn handle_child_pushdown_result(
        &self,
        _phase: FilterPushdownPhase,
        child_pushdown_result: ChildPushdownResult,
        _config: &ConfigOptions,
    ) -> Result<FilterPushdownPropagation<Arc<dyn ExecutionPlan>>, DataFusionError> {
        let filters: Vec<Arc<dyn PhysicalExpr>> = child_pushdown_result.parent_filters.iter().map(|f| Arc::clone(&f.filter)).collect();
        let answer = vec![PushedDown::No; filters.len()];
        let dynamic: Vec<Arc<dyn PhysicalExpr>> = filters.into_iter().filter(|f| snapshot_generation(f) != 0).collect();
        let mut result = FilterPushdownPropagation::with_parent_pushdown_result(answer);
        if !dynamic.is_empty() {
            let mut node = self.clone();
            node.dynamic.extend(dynamic);
            result = result.with_updated_node(Arc::new(node) as Arc<dyn ExecutionPlan>);
        }
        Ok(result)
    }

    fn execute(&self, partition: usize, context: Arc<TaskContext>) -> Result<SendableRecordBatchStream, DataFusionError> {
        if let Some(scan) = &self.cluster {
            return self.execute_in_cluster(scan, partition, &context);
        }
        let parts: Vec<Part> = self.parts.get(partition).cloned().unwrap_or_default();
        let schema = Arc::clone(&self.projected);
        let mut sieves = Sieves { filters: self.dynamic.clone(), stats: HashMap::new() };
        let batches = parts.into_iter().flat_map(move |part| match project(&part, &schema, &mut sieves) {
            Ok(bs) => bs.into_iter().map(Ok).collect::<Vec<_>>(),
            Err(e) => vec![Err(e)],
        });
        let batches = limited(batches, self.limit).inspect(|b| {
            if let Ok(b) = b {
                metrics::counter!("shoal_analytics_scanned_bytes_total").increment(scanned_bytes(b));
            }
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(Arc::clone(&self.projected), futures::stream::iter(batches))))
    }
}

/// A column's statistics for the planner from its table's summary: estimates, the counts
/// scaled by `share` (a partition's part of the rows), the bounds only where the column is
/// of the summary's kind (a number the planner can compare).
fn column_statistics(data_type: &DataType, s: &FieldSummary, share: f64, rows: usize) -> ColumnStatistics {
    let values = ((s.values as f64 * share) as usize).min(rows);
    let bound = |v: Option<f64>| -> Precision<ScalarValue> {
        match (data_type, v) {
            (DataType::Int64, Some(v)) if v.fract() == 0.0 => Precision::Inexact(ScalarValue::Int64(Some(v as i64))),
            (DataType::Float64, Some(v)) => Precision::Inexact(ScalarValue::Float64(Some(v))),
            _ => Precision::Absent,
        }
    };
    ColumnStatistics {
        null_count: Precision::Inexact(rows - values),
        max_value: bound(s.max),
        min_value: bound(s.min),
        sum_value: Precision::Absent,
        distinct_count: Precision::Inexact((s.distinct as usize).clamp(usize::from(values > 0), values.max(1))),
        byte_size: Precision::Absent,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::Int64Array;
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::physical_expr::expressions::{in_list, lit};
    use proptest::prelude::*;

    proptest! {
        /// The bitmap form of `x IN (...)` keeps exactly the rows DataFusion's own
        /// evaluation keeps (NULL rows and NULLs in the list included), of the rows a mask
        /// kept so far (long runs of dropped rows among them, as a replica's partitions
        /// are) — batch and mask slices at any offset.
        #[test]
        fn in_lists_as_bitmaps_keep_what_datafusion_keeps(
            rows in prop::collection::vec(prop::option::of(-50i64..50), 0..300),
            list in prop::collection::vec(prop::option::of(-40i64..40), 1..20),
            runs in prop::option::of(prop::collection::vec((prop::option::of(any::<bool>()), 1usize..130), 0..10)),
            skip in 0usize..70,
        ) {
            let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, true)]));
            let whole = RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(Int64Array::from(rows))]).unwrap();
            let skip = skip.min(whole.num_rows());
            let batch = whole.slice(skip, whole.num_rows() - skip);
            let keep = runs.map(|runs| {
                let mut mask: Vec<Option<bool>> = runs.iter().flat_map(|&(v, n)| std::iter::repeat_n(v, n)).collect();
                mask.resize(batch.num_rows() + 7, Some(false));
                BooleanArray::from(mask).slice(7, batch.num_rows())
            });
            let items: Vec<Arc<dyn PhysicalExpr>> = list.iter().map(|v| lit(ScalarValue::Int64(*v))).collect();
            let expr = in_list(Arc::new(Column::new("x", 0)), items, &false, &schema).unwrap();
            let compiled = Conjunct::compile(&expr);
            let bitmap = matches!(compiled, Conjunct::Bits { .. });
            prop_assert_eq!(bitmap, list.iter().any(Option::is_some), "compiled to a bitmap when the list has values");
            let got = compiled.evaluate(&batch, keep.as_ref()).unwrap().unwrap();
            let want = Conjunct::Expr(expr).evaluate(&batch, keep.as_ref()).unwrap().unwrap();
            let kept = |a: &BooleanArray| (0..a.len()).map(|i| a.is_valid(i) && a.value(i)).collect::<Vec<_>>();
            prop_assert_eq!(kept(&got), kept(&want));
        }
    }

    fn table(column: &str, rows: usize) -> MembersTable {
        let schema = Arc::new(Schema::new(vec![Field::new(column, DataType::Int64, true)]));
        MembersTable { schema, rows, stats: Arc::default() }
    }

    fn members(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    /// A statement is planned before the members answer only on tables the last two
    /// answers found the same, under the same map and members: any change (a column, the
    /// row count, the statistics, the map, the members) waits for the members again.
    #[test]
    fn only_tables_found_the_same_twice_are_planned_on_before_the_members_answer() {
        let ab = members(&["a", "b"]);
        let mut stats = TableSummary::new();
        stats.insert("x".into(), crate::shadow::stats::FieldSummary { values: 3, distinct: 3, min: Some(1.0), max: Some(3.0) });
        let with_stats = MembersTable { stats: Arc::new(stats), ..table("x", 10) };
        // (answers learnt under (map, members), then asked under (map, members): planned on)
        type Answer<'a> = (u64, &'a [String], MembersTable);
        type Case<'a> = (&'a str, Vec<Answer<'a>>, (u64, &'a [String]), Option<MembersTable>);
        let cases: Vec<Case> = vec![
            ("never asked", vec![], (1, &ab), None),
            ("asked once", vec![(1, &ab, table("x", 10))], (1, &ab), None),
            ("the same twice", vec![(1, &ab, table("x", 10)), (1, &ab, table("x", 10))], (1, &ab), Some(table("x", 10))),
            ("the same three times", vec![(1, &ab, table("x", 10)); 3], (1, &ab), Some(table("x", 10))),
            ("a new column", vec![(1, &ab, table("x", 10)), (1, &ab, table("x", 10)), (1, &ab, table("y", 10))], (1, &ab), None),
            ("a row more", vec![(1, &ab, table("x", 10)), (1, &ab, table("x", 11))], (1, &ab), None),
            ("other statistics", vec![(1, &ab, table("x", 10)), (1, &ab, with_stats.clone())], (1, &ab), None),
            (
                "the same twice after a change",
                vec![(1, &ab, table("x", 11)), (1, &ab, table("x", 10)), (1, &ab, table("x", 10))],
                (1, &ab),
                Some(table("x", 10)),
            ),
            ("asked under a newer map", vec![(1, &ab, table("x", 10)); 2], (2, &ab), None),
            ("asked over other members", vec![(1, &ab, table("x", 10)); 2], (1, &ab[..1]), None),
            ("the same under two maps", vec![(1, &ab, table("x", 10)), (2, &ab, table("x", 10))], (2, &ab), None),
        ];
        for (case, answers, (map, over), want) in cases {
            let known = KnownTables::default();
            for (map, over, t) in answers {
                known.learn(&["t".to_string()], map, over, &[t]);
            }
            assert_eq!(known.unchanged(&["t".to_string()], map, over), want.map(|t| vec![t]), "{case}");
        }
    }

    /// A statement naming several tables is planned before the members answer only when
    /// every one of them is unchanged.
    #[test]
    fn a_statement_is_planned_early_only_when_all_its_tables_are_unchanged() {
        let (ab, names) = (members(&["a", "b"]), vec!["s".to_string(), "t".to_string()]);
        let known = KnownTables::default();
        known.learn(&names, 1, &ab, &[table("x", 1), table("y", 2)]);
        known.learn(&names, 1, &ab, &[table("x", 1), table("y", 3)]);
        assert_eq!(known.unchanged(&names, 1, &ab), None, "t changed");
        assert_eq!(known.unchanged(&names[..1], 1, &ab), Some(vec![table("x", 1)]), "s alone did not");
        known.learn(&names[1..], 1, &ab, &[table("y", 3)]);
        assert_eq!(known.unchanged(&names, 1, &ab), Some(vec![table("x", 1), table("y", 3)]));
    }

    /// The tables known are bounded: past the bound they are forgotten and learnt again.
    #[test]
    fn known_tables_are_bounded() {
        let ab = members(&["a", "b"]);
        let known = KnownTables::default();
        for i in 0..=KNOWN_TABLES_MAX {
            known.learn(&[format!("t{i}")], 1, &ab, &[table("x", i)]);
            assert!(known.0.lock().len() <= KNOWN_TABLES_MAX);
        }
        assert_eq!(known.0.lock().len(), 1, "forgotten all, then the last learnt");
        known.learn(&["t0".to_string()], 1, &ab, &[table("x", 0)]);
        assert_eq!(known.unchanged(&["t0".to_string()], 1, &ab), None, "forgotten: asked once since");
    }
}
