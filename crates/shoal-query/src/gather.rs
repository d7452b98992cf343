//! The small build sides of a distributed statement's broadcast joins, read while it is
//! planned ("gathered"), as Spark's broadcast join collects a small build side at its
//! driver and ships it with the tasks that probe it.
//!
//! datafusion-distributed reads a dimension table of a star join through a stage of its
//! own: one task per member scanning its share, each task's rows broadcast to every fact
//! task (a stage, its task plans and members × members streams, for a few thousand rows).
//! Instead ([`InlineGatheredBroadcasts`], around datafusion-distributed's planner):
//!
//! 1. Before the physical plan is made, every table a join of the logical plan reads that
//!    is estimated at most [`GATHER_ROWS_MAX`] rows ([`SmallRead`]) is asked of every member
//!    at once, its filters applied there ([`serve`]), while the statement goes on planning.
//! 2. Once datafusion-distributed has planned it, a broadcast whose stage crosses no network
//!    and reads only such tables is computed here, once, from their gathered rows (its
//!    filters, projections and joins included), and replaced by the rows it would have
//!    broadcast ([`GatheredExec`]). The fact tasks' plans carry them; the stage and its
//!    streams are gone. Reads no broadcast wanted are cancelled.
//!
//! Each member reads its rows as a task of the statement would (its shadow, the partitions
//! active on it under the pinned map, checked again after the read; `request_plus` was
//! waited for by the fields call that opened the table), so the rows are those a scan would
//! read, each once. A member whose rows would pass [`GATHER_BYTES_MAX`] says so and the
//! broadcast stays; so does one whose filters DataFusion's protobuf cannot carry.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::{Schema, SchemaRef};
use datafusion::common::stats::Precision;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{DFSchema, DataFusionError, Statistics};
use datafusion::execution::context::QueryPlanner;
use datafusion::execution::{SendableRecordBatchStream, SessionState, TaskContext};
use datafusion::logical_expr::utils::conjunction;
use datafusion::logical_expr::{Expr, LogicalPlan};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::memory::MemoryStream;
use datafusion::physical_plan::statistics::StatisticsArgs;
use datafusion::physical_plan::{
    ChildrenPropertiesMode, DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties, ReplaceChildrenOptions,
};
use datafusion_distributed::{BroadcastExec, DistributedLeafExec, NetworkBoundary, NetworkBoundaryExt, NetworkBroadcastExec};
use datafusion_proto::bytes::Serializeable;
use prost::Message;

use crate::analytics::{ClusterScan, ShadowScanExec, ShadowTable};
use crate::distributed::{tag, ClusterAnalytics, Kind, WorkerEnv};
use crate::runtime::AbortOnDrop;
use crate::table::leaf_properties;
use crate::QueryError;

/// Largest table (estimated rows of partitions active on the members, before its filters)
/// a distributed statement reads while it is planned instead of through a stage of its own.
pub const GATHER_ROWS_MAX: usize = 100_000;
/// Most bytes (Arrow IPC) of one member's rows of a gathered table; past it the table is
/// scanned by the members.
pub const GATHER_BYTES_MAX: usize = 8 * 1024 * 1024;

/// A coordinator asks a member for its rows of a small table.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct GatherRequest {
    #[prost(string, tag = "1")]
    collection: String,
    #[prost(uint64, tag = "2")]
    map_version: u64,
    #[prost(uint64, tag = "3")]
    timeout_ms: u64,
    /// The columns wanted, as the statement merged them over the members.
    #[prost(message, optional, tag = "4")]
    schema: Option<datafusion_proto::protobuf::Schema>,
    /// The table's filters (DataFusion's protobuf of logical expressions, columns
    /// unqualified).
    #[prost(bytes = "vec", repeated, tag = "5")]
    filters: Vec<Vec<u8>>,
    #[prost(string, optional, tag = "6")]
    group: Option<String>,
}

/// A member's answer: its rows as an Arrow IPC stream, or none when they would pass
/// [`GATHER_BYTES_MAX`].
#[derive(Clone, PartialEq, prost::Message)]
struct GatherAnswer {
    #[prost(bytes = "vec", optional, tag = "1")]
    rows: Option<Vec<u8>>,
}

/// A table's rows gathered from the members while the statement was planned, yielded whole
/// in every task it runs in (it stands for a broadcast: each consumer task needs them all).
#[derive(Clone)]
pub(crate) struct GatheredExec {
    table: String,
    schema: SchemaRef,
    batches: Arc<Vec<RecordBatch>>,
    properties: Arc<PlanProperties>,
    /// The rows as an Arrow IPC stream, made once for the task plans that carry them.
    ipc: Arc<OnceLock<Vec<u8>>>,
}

impl fmt::Debug for GatheredExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GatheredExec({})", self.table)
    }
}

impl GatheredExec {
    pub(crate) fn new(table: String, schema: SchemaRef, batches: Vec<RecordBatch>) -> GatheredExec {
        let properties = leaf_properties(&schema, 1);
        GatheredExec { table, schema, batches: Arc::new(batches), properties, ipc: Arc::default() }
    }

    pub(crate) fn table(&self) -> &str {
        &self.table
    }

    fn rows(&self) -> usize {
        self.batches.iter().map(RecordBatch::num_rows).sum()
    }

    /// The exact row count, so that a join builds on the smaller side.
    fn exact_rows(&self) -> Arc<Statistics> {
        Arc::new(Statistics::new_unknown(&self.schema).with_num_rows(Precision::Exact(self.rows())))
    }

    /// The rows as an Arrow IPC stream.
    pub(crate) fn ipc(&self) -> Result<&[u8], DataFusionError> {
        if let Some(bytes) = self.ipc.get() {
            return Ok(bytes);
        }
        let bytes = encode(&self.schema, &self.batches)?;
        Ok(self.ipc.get_or_init(|| bytes))
    }

    /// Decodes a plan's copy of the rows ([`GatheredExec::ipc`]).
    pub(crate) fn from_ipc(table: String, schema: SchemaRef, ipc: &[u8]) -> Result<GatheredExec, DataFusionError> {
        let batches = decode(&schema, ipc)?;
        Ok(GatheredExec::new(table, schema, batches))
    }
}

impl DisplayAs for GatheredExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "GatheredExec: table={}, rows={}", self.table, self.rows())
    }
}

impl ExecutionPlan for GatheredExec {
    fn name(&self) -> &'static str {
        "GatheredExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn datafusion::physical_expr::PhysicalExpr>) -> Result<TreeNodeRecursion, DataFusionError>,
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

    fn statistics_from_inputs(&self, _input_stats: &[Arc<Statistics>], _args: &StatisticsArgs) -> Result<Arc<Statistics>, DataFusionError> {
        Ok(self.exact_rows())
    }

    #[allow(deprecated)]
    fn partition_statistics(&self, _partition: Option<usize>) -> Result<Arc<Statistics>, DataFusionError> {
        Ok(self.exact_rows())
    }

    fn execute(&self, partition: usize, _context: Arc<TaskContext>) -> Result<SendableRecordBatchStream, DataFusionError> {
        let batches = if partition == 0 { self.batches.to_vec() } else { Vec::new() };
        Ok(Box::pin(MemoryStream::try_new(batches, Arc::clone(&self.schema), None)?))
    }
}

fn encode(schema: &SchemaRef, batches: &[RecordBatch]) -> Result<Vec<u8>, DataFusionError> {
    let mut out = Vec::new();
    let mut w = datafusion::arrow::ipc::writer::StreamWriter::try_new(&mut out, schema)?;
    for b in batches {
        w.write(b)?;
    }
    w.finish()?;
    drop(w);
    Ok(out)
}

/// The batches of an IPC stream, each as of `schema` (the columns must be of its types).
fn decode(schema: &SchemaRef, ipc: &[u8]) -> Result<Vec<RecordBatch>, DataFusionError> {
    let reader = datafusion::arrow::ipc::reader::StreamReader::try_new(std::io::Cursor::new(ipc), None)?;
    let mut out = Vec::new();
    for b in reader {
        let b = b?;
        out.push(RecordBatch::try_new(Arc::clone(schema), b.columns().to_vec())?);
    }
    Ok(out)
}

/// What gathering a small table reads: its rows of every member, `filters` applied there.
#[derive(Clone, Debug)]
pub(crate) struct SmallRead {
    pub collection: String,
    pub map_version: u64,
    pub timeout: Duration,
    pub members: Arc<[String]>,
    pub group: Option<String>,
    pub projected: SchemaRef,
    pub filters: Vec<Expr>,
}

impl SmallRead {
    /// The read a small table's scan stands for.
    fn of_scan(scan: &ShadowScanExec) -> Option<SmallRead> {
        let (on, filters) = (scan.cluster()?, scan.small()?);
        Some(SmallRead {
            collection: on.collection.clone(),
            map_version: on.map_version,
            timeout: on.timeout,
            members: Arc::clone(&on.members),
            group: on.group.clone(),
            projected: Arc::clone(scan.projected()),
            filters: filters.to_vec(),
        })
    }

    /// Equal for the same table, columns and filters (whether or not its columns are
    /// qualified): a read started before the plan is found again by it.
    fn key(&self) -> String {
        let columns: Vec<&str> = self.projected.fields().iter().map(|f| f.name().as_str()).collect();
        let filters: Vec<String> = self.filters.iter().map(|f| unqualified(f).to_string()).collect();
        format!("{}\u{1}{}\u{1}{}", self.collection, columns.join("\u{2}"), filters.join("\u{2}"))
    }
}

/// `e` with its columns unqualified, as a member resolves them against the table alone.
fn unqualified(e: &Expr) -> Expr {
    let done = e.clone().transform(|e| match e {
        Expr::Column(c) => Ok(Transformed::yes(Expr::Column(datafusion::common::Column::new_unqualified(c.name)))),
        e => Ok(Transformed::no(e)),
    });
    match done {
        Ok(t) => t.data,
        Err(_) => e.clone(),
    }
}

/// A small table's rows over the members (its filters applied where the rows are), or
/// `None` when a filter cannot be sent or a member holds more than [`GATHER_BYTES_MAX`] of
/// them. Nothing is asked of a member before the statement's `gate` opens.
async fn gather(
    cluster: &ClusterAnalytics,
    env: &Arc<WorkerEnv>,
    gate: Option<&OpenGate>,
    read: &SmallRead,
) -> Result<Option<GatheredExec>, DataFusionError> {
    OpenGate::passed(gate).await?;
    let mut encoded = Vec::with_capacity(read.filters.len());
    for f in &read.filters {
        match unqualified(f).to_bytes() {
            Ok(b) => encoded.push(b.to_vec()),
            Err(_) => return Ok(None),
        }
    }
    let req = GatherRequest {
        collection: read.collection.clone(),
        map_version: read.map_version,
        timeout_ms: u64::try_from(read.timeout.as_millis()).unwrap_or(u64::MAX),
        schema: Some(read.projected.as_ref().try_into()?),
        filters: encoded,
        group: read.group.clone(),
    };
    let body = req.encode_to_vec();
    let me = env.local.address();
    let asks = read.members.iter().map(|m| {
        let me = &me;
        let body = &body;
        async move {
            let answer = if m == me {
                answer(env, Parsed::of_read(read)).await?
            } else {
                let body = body.clone();
                cluster.remote.rows(m, body, read.timeout).await.map_err(|e| tag(Kind::Unavailable, e))?
            };
            GatherAnswer::decode(answer.as_slice())
                .map_err(|e| DataFusionError::Internal(format!("a member's rows of {}: {e}", read.collection)))
        }
    });
    let answers = futures::future::try_join_all(asks).await?;
    let mut batches = Vec::new();
    for a in answers {
        let Some(rows) = a.rows else { return Ok(None) };
        batches.extend(decode(&read.projected, &rows)?);
    }
    Ok(Some(GatheredExec::new(read.collection.clone(), Arc::clone(&read.projected), batches)))
}

/// The small tables a join of `plan` reads: those a broadcast may gather, asked for before
/// the statement's physical plan is made.
fn joined_small_reads(plan: &LogicalPlan) -> Vec<SmallRead> {
    let mut out = Vec::new();
    let _ = plan.apply(|node| {
        if !matches!(node, LogicalPlan::Join(_)) {
            return Ok(TreeNodeRecursion::Continue);
        }
        let _ = node.apply(|n| {
            if let LogicalPlan::TableScan(scan) = n {
                let provider = datafusion::datasource::source_as_provider(&scan.source);
                if let Some(table) = provider.as_ref().ok().and_then(|p| p.downcast_ref::<ShadowTable>()) {
                    if let Ok(Some(read)) = table.small_read(scan.projection.as_ref(), &scan.filters, scan.fetch) {
                        out.push(read);
                    }
                }
            }
            Ok(TreeNodeRecursion::Continue)
        });
        Ok(TreeNodeRecursion::Jump)
    });
    out
}

/// A request for a member's rows, decoded whole.
pub struct Parsed {
    collection: String,
    map_version: u64,
    timeout: Duration,
    group: Option<String>,
    schema: SchemaRef,
    filters: Vec<Expr>,
}

impl Parsed {
    /// This node's own part of `read`: nothing to decode.
    fn of_read(read: &SmallRead) -> Parsed {
        Parsed {
            collection: read.collection.clone(),
            map_version: read.map_version,
            timeout: read.timeout,
            group: read.group.clone(),
            schema: Arc::clone(&read.projected),
            filters: read.filters.iter().map(unqualified).collect(),
        }
    }
}

/// The asked side of [`gather`]: this member's rows of a small table, read as a task of the
/// statement reads them, its filters applied.
pub(crate) async fn serve(env: &Arc<WorkerEnv>, request: Parsed) -> Result<Vec<u8>, QueryError> {
    let t0 = std::time::Instant::now();
    let table = request.collection.clone();
    let answer = answer(env, request).await?;
    tracing::debug!(%table, bytes = answer.len(), answered_us = t0.elapsed().as_micros(), "this member's rows of a small table");
    Ok(answer)
}

/// Decodes a request for a member's rows: its columns and filters too. Whatever does not
/// decode is the caller's error ([`QueryError::Invalid`]).
pub fn parse(request: &[u8]) -> Result<Parsed, QueryError> {
    let bad = |e: String| QueryError::Invalid(format!("a request for a table's rows: {e}"));
    let req = GatherRequest::decode(request).map_err(|e| bad(e.to_string()))?;
    let schema: Schema =
        req.schema.as_ref().ok_or_else(|| bad("it names no columns".into()))?.try_into().map_err(|e| bad(format!("{e}")))?;
    let task = TaskContext::from(member_session());
    let filters =
        req.filters.iter().map(|b| Expr::from_bytes_with_ctx(b, &task)).collect::<Result<Vec<_>, _>>().map_err(|e| bad(e.to_string()))?;
    for f in &filters {
        if let Some(c) = f.column_refs().into_iter().find(|c| schema.field_with_name(&c.name).is_err()) {
            return Err(bad(format!("a filter names {}, not one of its columns", c.name)));
        }
    }
    Ok(Parsed {
        collection: req.collection,
        map_version: req.map_version,
        timeout: Duration::from_millis(req.timeout_ms).min(crate::QUERY_TIMEOUT_MAX),
        group: req.group,
        schema: Arc::new(schema),
        filters,
    })
}

async fn answer(env: &Arc<WorkerEnv>, req: Parsed) -> Result<Vec<u8>, DataFusionError> {
    let schema = req.schema;
    let state = member_session();
    // The scan reads this member's shadows through the task's configuration.
    let config = state.config().clone().with_extension(Arc::clone(env));
    let task = Arc::new(TaskContext::from(state).with_session_config(config));
    let me = env.local.address();
    let scan = ClusterScan {
        collection: req.collection,
        map_version: req.map_version,
        timeout: req.timeout,
        members: vec![me.clone()].into(),
        member: Some(me),
        group: req.group,
    };
    let mut plan: Arc<dyn ExecutionPlan> = Arc::new(ShadowScanExec::in_cluster(scan, Arc::clone(&schema), None, 1, 0));
    if let Some(predicate) = conjunction(req.filters) {
        let df_schema = DFSchema::try_from(schema.as_ref().clone())?;
        let predicate = state.create_physical_expr(predicate, &df_schema)?;
        plan = Arc::new(FilterExec::try_new(predicate, plan)?);
    }
    let rows = ipc_capped(&schema, plan.execute(0, task)?).await?;
    Ok(GatherAnswer { rows }.encode_to_vec())
}

/// The rows of `stream` as an Arrow IPC stream, or `None` once they pass
/// [`GATHER_BYTES_MAX`] (checked after every batch, so a member stops reading there).
async fn ipc_capped(schema: &SchemaRef, mut stream: SendableRecordBatchStream) -> Result<Option<Vec<u8>>, DataFusionError> {
    let mut out = Vec::new();
    let mut w = datafusion::arrow::ipc::writer::StreamWriter::try_new(&mut out, schema)?;
    while let Some(batch) = futures::StreamExt::next(&mut stream).await {
        w.write(&batch?)?;
        if w.get_ref().len() > GATHER_BYTES_MAX {
            return Ok(None);
        }
    }
    w.finish()?;
    drop(w);
    Ok(Some(out))
}

/// Whether a table over the members may be gathered: estimated at most
/// [`GATHER_ROWS_MAX`] rows, read whole (no limit), for some column.
pub(crate) fn gatherable(estimated_rows: usize, limit: Option<usize>, columns: usize) -> bool {
    estimated_rows <= GATHER_ROWS_MAX && limit.is_none() && columns > 0
}

/// The functions a member decodes a request's filters with and plans them by: built once
/// (a session with DataFusion's functions and Shoal's takes about a millisecond to build).
fn member_session() -> &'static SessionState {
    static SESSION: OnceLock<SessionState> = OnceLock::new();
    SESSION.get_or_init(|| {
        let mut builder = datafusion::execution::SessionStateBuilder::new().with_default_features();
        crate::bounded::wrap(&mut builder);
        crate::fsum::wrap(&mut builder);
        builder.build()
    })
}

/// Wraps datafusion-distributed's planner: a broadcast whose stage reads only small
/// tables is replaced by the stage's plan over their gathered rows.
pub(crate) struct InlineGatheredBroadcasts {
    pub planner: Arc<dyn QueryPlanner + Send + Sync>,
    pub cluster: Arc<ClusterAnalytics>,
}

impl fmt::Debug for InlineGatheredBroadcasts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("InlineGatheredBroadcasts")
    }
}

#[async_trait]
impl QueryPlanner for InlineGatheredBroadcasts {
    async fn create_physical_plan(
        &self,
        logical: &LogicalPlan,
        state: &dyn datafusion::catalog::Session,
    ) -> Result<Arc<dyn ExecutionPlan>, DataFusionError> {
        let Some(env) = state.config().get_extension::<WorkerEnv>() else {
            return self.planner.create_physical_plan(logical, state).await;
        };
        let gate = state.config().get_extension::<OpenGate>();
        // The small tables a join reads are asked for at once, while the statement is
        // planned; those no broadcast reads are cancelled (dropped) after.
        let mut early: HashMap<String, Early> = HashMap::new();
        for read in joined_small_reads(logical) {
            let key = read.key();
            if let std::collections::hash_map::Entry::Vacant(slot) = early.entry(key) {
                let (cluster, env, gate) = (Arc::clone(&self.cluster), Arc::clone(&env), gate.clone());
                slot.insert(crate::runtime::spawn_started(async move { gather(&cluster, &env, gate.as_deref(), &read).await }));
            }
        }
        let t0 = std::time::Instant::now();
        let plan = self.planner.create_physical_plan(logical, state).await?;
        let planned = t0.elapsed();
        let scans = broadcast_small_scans(&plan);
        if scans.is_empty() {
            return Ok(plan);
        }
        let started_before = scans.iter().filter(|(_, read)| early.contains_key(&read.key())).count();
        tracing::debug!(
            broadcast_tables = scans.len(),
            started_before,
            started_unused = early.len() - started_before,
            "gathered build sides"
        );
        let gathers = scans.iter().map(|(_, read)| {
            let started = early.remove(&read.key());
            let (cluster, env, gate) = (&self.cluster, &env, gate.as_deref());
            async move {
                match started {
                    Some(task) => task.join().await.map_err(|e| DataFusionError::External(Box::new(e)))?,
                    None => gather(cluster, env, gate, read).await,
                }
            }
        });
        let gathered = futures::future::try_join_all(gathers).await?;
        let waited = t0.elapsed();
        let by_leaf: HashMap<usize, GatheredExec> = scans.iter().zip(gathered).filter_map(|((leaf, _), g)| g.map(|g| (*leaf, g))).collect();
        // Each build side is computed once, here, from its gathered rows (its filters and
        // projections included): the fact tasks' plans carry only the rows they join.
        let inputs = gathered_inputs(&plan, &by_leaf)?;
        let task = state.task_ctx();
        let builds = inputs.into_iter().map(|(broadcast, input)| {
            let task = Arc::clone(&task);
            async move {
                let (name, schema) = (gathered_tables(&input), input.schema());
                let rows = datafusion::physical_plan::collect(input, task).await?;
                Ok::<_, DataFusionError>((broadcast, GatheredExec::new(name, schema, rows)))
            }
        });
        let built: HashMap<usize, GatheredExec> = futures::future::try_join_all(builds).await?.into_iter().collect();
        // Where planning's time went (`SHOAL_LOG=shoal_query=debug`): the statement planned,
        // its small tables' rows in, their build sides computed.
        tracing::debug!(
            planned_us = planned.as_micros(),
            gathered_us = waited.as_micros(),
            built_us = t0.elapsed().as_micros(),
            "build sides gathered"
        );
        replace_broadcasts(plan, &built)
    }
}

/// What a statement's gathers wait for before they read: the members' answers to the
/// fields calls that opened its tables, when it is planned before they answer
/// ([`crate::analytics::KnownTables`]). A member reads a gathered table as its shadow is
/// then; its answer to the fields call is what says its shadow holds the statement's
/// `request_plus` positions. Open (nothing to wait for) unless closed.
#[derive(Default)]
pub(crate) struct OpenGate(OnceLock<crate::analytics::Fresh>);

impl fmt::Debug for OpenGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OpenGate(closed: {})", self.0.get().is_some())
    }
}

impl OpenGate {
    /// Gathers wait for `fresh` from now on. Once per statement: a second time is refused
    /// (its gathers would wait for the first answers only).
    pub(crate) fn close_until(&self, fresh: crate::analytics::Fresh) -> Result<(), DataFusionError> {
        self.0.set(fresh).map_err(|_| DataFusionError::Internal("a statement's tables are opened once".into()))
    }

    /// Waits until the members have answered; their error, if they failed.
    async fn passed(gate: Option<&OpenGate>) -> Result<(), DataFusionError> {
        match gate.and_then(|g| g.0.get()) {
            Some(fresh) => fresh.clone().await.map(|_| ()).map_err(DataFusionError::Shared),
            None => Ok(()),
        }
    }
}

/// The identity of a plan node (its allocation), to find it again after an `await`.
fn node_id(node: &Arc<dyn ExecutionPlan>) -> usize {
    Arc::as_ptr(node) as *const () as usize
}

/// The small shadow scan under `leaf` (a scan split into its members' tasks, or whole).
fn small_scan(leaf: &Arc<dyn ExecutionPlan>) -> Option<&ShadowScanExec> {
    let scan = match leaf.downcast_ref::<DistributedLeafExec>() {
        Some(split) => split.original().downcast_ref::<ShadowScanExec>()?,
        None => leaf.downcast_ref::<ShadowScanExec>()?,
    };
    scan.small().is_some().then_some(scan)
}

/// A gather started before the plan was made.
type Early = AbortOnDrop<Result<Option<GatheredExec>, DataFusionError>>;

/// The leaves of the broadcasts that read only small tables (each once), with what
/// gathering each reads.
fn broadcast_small_scans(plan: &Arc<dyn ExecutionPlan>) -> Vec<(usize, SmallRead)> {
    let mut out: Vec<(usize, SmallRead)> = Vec::new();
    let _ = plan.apply(|node| {
        if let Some(input) = broadcast_input(node) {
            if let Some(leaves) = small_leaves(input) {
                for leaf in leaves {
                    let id = node_id(&leaf);
                    if let Some(read) = small_scan(&leaf).and_then(SmallRead::of_scan) {
                        if !out.iter().any(|(l, _)| *l == id) {
                            out.push((id, read));
                        }
                    }
                }
            }
        }
        Ok(TreeNodeRecursion::Continue)
    });
    out
}

/// What a network broadcast's stage broadcasts (the input of its `BroadcastExec`).
fn broadcast_input(node: &Arc<dyn ExecutionPlan>) -> Option<&Arc<dyn ExecutionPlan>> {
    let network = node.downcast_ref::<NetworkBroadcastExec>()?;
    let stage = network.input_stage().local_plan()?;
    Some(stage.downcast_ref::<BroadcastExec>()?.input())
}

/// The leaves of `plan` if it crosses no network and every leaf is a small table's scan.
fn small_leaves(plan: &Arc<dyn ExecutionPlan>) -> Option<Vec<Arc<dyn ExecutionPlan>>> {
    let mut leaves = Vec::new();
    let mut other = false;
    let _ = plan.apply(|n| {
        if n.is_network_boundary() {
            other = true;
        } else if n.downcast_ref::<DistributedLeafExec>().is_some() || n.children().is_empty() {
            match small_scan(n) {
                Some(_) => leaves.push(Arc::clone(n)),
                None => other = true,
            }
            return Ok(TreeNodeRecursion::Jump);
        }
        Ok(if other { TreeNodeRecursion::Stop } else { TreeNodeRecursion::Continue })
    });
    (!other && !leaves.is_empty()).then_some(leaves)
}

/// A broadcast (its node's identity) and what it broadcasts.
type BroadcastInput = (usize, Arc<dyn ExecutionPlan>);

/// Per broadcast whose leaves were all gathered (`by_leaf`), by its node: what it
/// broadcast, over the gathered rows.
fn gathered_inputs(plan: &Arc<dyn ExecutionPlan>, by_leaf: &HashMap<usize, GatheredExec>) -> Result<Vec<BroadcastInput>, DataFusionError> {
    let mut out = Vec::new();
    plan.apply(|node| {
        let Some(input) = broadcast_input(node) else { return Ok(TreeNodeRecursion::Continue) };
        let Some(leaves) = small_leaves(input) else { return Ok(TreeNodeRecursion::Continue) };
        if !leaves.iter().all(|l| by_leaf.contains_key(&node_id(l))) {
            return Ok(TreeNodeRecursion::Continue);
        }
        let inlined = Arc::clone(input).transform_down(|n| match by_leaf.get(&node_id(&n)) {
            Some(g) => Ok(Transformed::new(Arc::new(g.clone()) as Arc<dyn ExecutionPlan>, true, TreeNodeRecursion::Jump)),
            None => Ok(Transformed::no(n)),
        })?;
        out.push((node_id(node), inlined.data));
        Ok(TreeNodeRecursion::Jump)
    })?;
    Ok(out)
}

/// `plan` with each broadcast of `built` (by its node) replaced by the rows it broadcasts.
fn replace_broadcasts(
    plan: Arc<dyn ExecutionPlan>,
    built: &HashMap<usize, GatheredExec>,
) -> Result<Arc<dyn ExecutionPlan>, DataFusionError> {
    plan.transform_up(|node| match built.get(&node_id(&node)) {
        Some(g) => Ok(Transformed::yes(Arc::new(g.clone()) as Arc<dyn ExecutionPlan>)),
        None => Ok(Transformed::no(node)),
    })
    .map(|t| t.data)
}

/// The tables `plan` reads gathered, by name.
fn gathered_tables(plan: &Arc<dyn ExecutionPlan>) -> String {
    let mut names = Vec::new();
    let _ = plan.apply(|n| {
        if let Some(g) = n.downcast_ref::<GatheredExec>() {
            names.push(g.table().to_string());
        }
        Ok(TreeNodeRecursion::Continue)
    });
    names.join(" ⋈ ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::Int64Array;
    use datafusion::arrow::datatypes::{DataType, Field};

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![Field::new("n", DataType::Int64, true)]))
    }

    fn scan(collection: &str) -> ShadowScanExec {
        let on = ClusterScan {
            collection: collection.into(),
            map_version: 1,
            timeout: Duration::from_secs(1),
            members: vec!["a:1".to_string(), "b:1".to_string()].into(),
            member: None,
            group: None,
        };
        ShadowScanExec::in_cluster(on, schema(), None, 2, 10)
    }

    /// A gather of a statement planned before the members answered its fields calls waits
    /// for their answers (which say each shadow holds the statement's `request_plus`
    /// positions), and fails with their error; an open gate does not wait.
    #[tokio::test]
    async fn gathers_wait_for_the_members_answers_when_planned_before_them() {
        use futures::FutureExt;
        assert!(OpenGate::passed(None).now_or_never().is_some_and(|r| r.is_ok()), "no gate");
        assert!(OpenGate::passed(Some(&OpenGate::default())).now_or_never().is_some_and(|r| r.is_ok()), "an open gate");

        let (answer, answered) = tokio::sync::oneshot::channel::<Result<(), String>>();
        let fresh: crate::analytics::Fresh = async move {
            match answered.await {
                Ok(Ok(())) => Ok(Arc::new(Vec::new())),
                Ok(Err(why)) => Err(Arc::new(DataFusionError::Execution(why))),
                Err(_) => Err(Arc::new(DataFusionError::Execution("dropped".into()))),
            }
        }
        .boxed()
        .shared();
        let gate = Arc::new(OpenGate::default());
        gate.close_until(fresh.clone()).unwrap();
        assert!(gate.close_until(fresh.clone()).is_err(), "closed once");
        let mut waiting = Box::pin(OpenGate::passed(Some(&gate)));
        assert!((&mut waiting).now_or_never().is_none(), "waits while the members have not answered");
        answer.send(Ok(())).unwrap();
        assert!(waiting.await.is_ok(), "passes once they have");

        let (answer, answered) = tokio::sync::oneshot::channel::<Result<(), String>>();
        let failed: crate::analytics::Fresh = async move {
            let why = answered.await.unwrap_or(Ok(())).err().unwrap_or_default();
            Err(Arc::new(tag(Kind::Unavailable, why)))
        }
        .boxed()
        .shared();
        let gate = OpenGate::default();
        gate.close_until(failed).unwrap();
        answer.send(Err("member b:1 is down".into())).unwrap();
        let e = OpenGate::passed(Some(&gate)).await.unwrap_err();
        assert!(
            matches!(QueryError::from(e), QueryError::Unavailable(why) if why.contains("member b:1 is down")),
            "their error, its kind kept"
        );
    }

    fn broadcast(leaf: Arc<dyn ExecutionPlan>) -> Arc<dyn ExecutionPlan> {
        let b = Arc::new(BroadcastExec::new(leaf, 2));
        Arc::new(NetworkBroadcastExec::try_new(b, 2).unwrap())
    }

    fn names(plan: &Arc<dyn ExecutionPlan>) -> Vec<String> {
        let mut out = Vec::new();
        let _ = plan.apply(|n| {
            out.push(n.name().to_string());
            Ok(TreeNodeRecursion::Continue)
        });
        out
    }

    fn gathered(rows: i64) -> GatheredExec {
        let batch = RecordBatch::try_new(schema(), vec![Arc::new(Int64Array::from_iter_values(0..rows))]).unwrap();
        GatheredExec::new("dim".into(), schema(), vec![batch])
    }

    #[test]
    fn a_broadcast_of_small_tables_is_replaced_by_their_gathered_rows_and_others_stay() {
        let small: Arc<dyn ExecutionPlan> = Arc::new(scan("dim").with_small(&[]));
        let big: Arc<dyn ExecutionPlan> = Arc::new(scan("fact"));
        let plan =
            datafusion::physical_plan::union::UnionExec::try_new(vec![broadcast(Arc::clone(&small)), broadcast(Arc::clone(&big))]).unwrap();
        // Only the small table's broadcast is a candidate, its scan asked for once.
        let scans = broadcast_small_scans(&plan);
        assert_eq!(
            scans.iter().map(|(id, read)| (*id, Some(read.collection.clone()))).collect::<Vec<_>>(),
            vec![(node_id(&small), Some("dim".to_string()))]
        );
        let by_leaf = HashMap::from([(node_id(&small), gathered(3))]);
        let inputs = gathered_inputs(&plan, &by_leaf).unwrap();
        assert_eq!(inputs.len(), 1);
        assert_eq!(names(&inputs[0].1), vec!["GatheredExec".to_string()], "what the broadcast sent, over the gathered rows");
        let built = inputs.iter().map(|(b, _)| (*b, gathered(3))).collect();
        let replaced = replace_broadcasts(Arc::clone(&plan), &built).unwrap();
        let names = names(&replaced);
        assert_eq!(names.iter().filter(|n| *n == "NetworkBroadcastExec").count(), 1, "{names:?}");
        assert_eq!(names.iter().filter(|n| *n == "GatheredExec").count(), 1, "{names:?}");
        // A small table whose rows were not gathered (too many bytes) keeps its broadcast.
        assert!(gathered_inputs(&plan, &HashMap::new()).unwrap().is_empty());
        let kept = replace_broadcasts(plan, &HashMap::new()).unwrap();
        assert!(!names_of_contains(&kept, "GatheredExec"));
    }

    fn names_of_contains(plan: &Arc<dyn ExecutionPlan>, name: &str) -> bool {
        names(plan).iter().any(|n| n == name)
    }

    #[tokio::test]
    async fn gathered_rows_cross_in_a_plan_whole_and_every_task_yields_them() {
        let g = gathered(5);
        let again = GatheredExec::from_ipc("dim".into(), schema(), g.ipc().unwrap()).unwrap();
        let ctx = Arc::new(TaskContext::default());
        let rows = datafusion::physical_plan::collect(Arc::new(again), ctx).await.unwrap();
        let n: Vec<i64> = rows.iter().flat_map(|b| b.column(0).as_any().downcast_ref::<Int64Array>().unwrap().values().to_vec()).collect();
        assert_eq!(n, vec![0, 1, 2, 3, 4]);
        // Rows of another shape are refused, not misread.
        let other = Arc::new(Schema::new(vec![Field::new("n", DataType::Utf8, true)]));
        assert!(GatheredExec::from_ipc("dim".into(), other, g.ipc().unwrap()).is_err());
    }

    #[test]
    fn a_read_started_from_the_logical_plan_is_found_by_its_scan_s_unqualified_filters() {
        use datafusion::logical_expr::{col, lit};
        let read = |filter: Expr| SmallRead {
            collection: "dim".into(),
            map_version: 1,
            timeout: Duration::from_secs(1),
            members: vec!["a:1".to_string()].into(),
            group: None,
            projected: schema(),
            filters: vec![filter],
        };
        let qualified = Expr::Column(datafusion::common::Column::new(Some("dim"), "n")).eq(lit(11));
        assert_eq!(read(qualified).key(), read(col("n").eq(lit(11))).key());
        assert_ne!(read(col("n").eq(lit(12))).key(), read(col("n").eq(lit(11))).key());
    }

    #[test]
    fn a_malformed_request_for_rows_is_the_caller_s_error() {
        for bad in [&b"\xff\xff garbage"[..], &b""[..]] {
            assert!(matches!(parse(bad), Err(QueryError::Invalid(_))), "{bad:?}");
        }
        let named = GatherRequest { collection: "c".into(), schema: Some(schema().as_ref().try_into().unwrap()), ..Default::default() };
        assert!(parse(&named.encode_to_vec()).is_ok());
        // A filter of a column the request does not name, or bytes that are no filter.
        use datafusion::logical_expr::{col, lit};
        for filter in [col("other").eq(lit(1)).to_bytes().unwrap().to_vec(), b"\x0a\xff".to_vec()] {
            let bad = GatherRequest { filters: vec![filter], ..named.clone() };
            assert!(matches!(parse(&bad.encode_to_vec()), Err(QueryError::Invalid(_))));
        }
        let good = GatherRequest { filters: vec![col("n").eq(lit(1)).to_bytes().unwrap().to_vec()], ..named };
        assert_eq!(parse(&good.encode_to_vec()).unwrap().filters, vec![col("n").eq(lit(1))]);
    }

    #[test]
    fn only_a_table_within_the_row_limit_read_whole_for_some_column_is_gathered() {
        // (estimated rows, limit, columns) → gathered
        let cases = [
            ((0, None, 1), true),
            ((GATHER_ROWS_MAX, None, 3), true),
            ((GATHER_ROWS_MAX + 1, None, 3), false),
            ((10, Some(5), 1), false),
            ((10, None, 0), false),
        ];
        for ((rows, limit, columns), want) in cases {
            assert_eq!(gatherable(rows, limit, columns), want, "{rows} rows, limit {limit:?}, {columns} columns");
        }
    }

    fn text_stream(batches: usize, bytes_each: usize) -> (SchemaRef, SendableRecordBatchStream) {
        use datafusion::arrow::array::StringArray;
        let schema = Arc::new(Schema::new(vec![Field::new("s", DataType::Utf8, false)]));
        let value = "x".repeat(bytes_each);
        let batch = RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(StringArray::from(vec![value.as_str()]))]).unwrap();
        let stream = futures::stream::iter(std::iter::repeat_n(batch, batches).map(Ok));
        let adapter = datafusion::physical_plan::stream::RecordBatchStreamAdapter::new(Arc::clone(&schema), stream);
        (schema, Box::pin(adapter))
    }

    #[tokio::test]
    async fn a_member_s_rows_past_the_byte_limit_are_not_sent_and_rows_within_it_are_whole() {
        let mib = 1024 * 1024;
        assert!(GATHER_BYTES_MAX >= 2 * mib, "the cases below straddle the limit");
        // Within: one MiB short of the limit, sent whole and read back as they were.
        let within = GATHER_BYTES_MAX / mib - 1;
        let (schema, stream) = text_stream(within, mib);
        let ipc = ipc_capped(&schema, stream).await.unwrap().expect("rows within the limit are sent");
        let back = decode(&schema, &ipc).unwrap();
        assert_eq!(back.iter().map(RecordBatch::num_rows).sum::<usize>(), within);
        // Past it by a MiB: none sent (the broadcast stays), whatever follows unread.
        let (schema, stream) = text_stream(GATHER_BYTES_MAX / mib + 1, mib);
        assert!(ipc_capped(&schema, stream).await.unwrap().is_none());
        let (schema, stream) = text_stream(usize::MAX, mib);
        assert!(ipc_capped(&schema, stream).await.unwrap().is_none(), "an endless table stops at the limit");
    }

    proptest::proptest! {
        /// Any bytes, or a valid request with bytes flipped, decode or are the caller's
        /// error; decoding never panics.
        #[test]
        fn any_request_for_rows_decodes_or_is_the_caller_s_error(
            noise in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200),
            flips in proptest::collection::vec((proptest::prelude::any::<usize>(), proptest::prelude::any::<u8>()), 0..6),
        ) {
            use datafusion::logical_expr::{col, lit};
            let valid = GatherRequest {
                collection: "c".into(),
                schema: Some(schema().as_ref().try_into().unwrap()),
                filters: vec![col("n").gt(lit(3)).to_bytes().unwrap().to_vec()],
                ..Default::default()
            }
            .encode_to_vec();
            let mut flipped = valid.clone();
            for (at, byte) in flips {
                let i = at % flipped.len();
                flipped[i] ^= byte;
            }
            for bytes in [noise, flipped] {
                match parse(&bytes) {
                    Ok(_) | Err(QueryError::Invalid(_)) => {}
                    Err(other) => proptest::prop_assert!(false, "{other:?}"),
                }
            }
        }
    }
}
