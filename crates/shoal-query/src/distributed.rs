//! `/v1/analytics` across a cluster, on datafusion-distributed.
//!
//! Every member is a worker (its gRPC service shares the node's port, see
//! [`WORKER_PATH_PREFIX`]); the node a statement reaches plans it and coordinates. A shadow
//! scan in a cluster ([`ClusterScan`]) is split into one task per member holding some
//! partition active under the map version the statement pinned, and each task is routed to
//! its member: filters, projections and partial aggregates run where the rows are, and only
//! Arrow batches cross the network. A member reads its own shadow, keeping only the rows
//! of partitions active on it under that map version, so every row is read once.
//!
//! A join that can only run in one task gets its inputs gathered to it over the network
//! ([`GatherSingleTaskJoins`]), its scans still one task per member. What the planner may
//! do that breaks locality — put the scan in fewer tasks than members, or not distribute
//! the plan at all — is refused
//! with [`DistError::NotPlaced`], and the statement runs on the row engine instead (same
//! rows, slower): never a task reading a member's rows on another member.
//!
//! Errors cross the network as text, so the kinds a client must tell apart (unavailable,
//! timeout) are tagged in it ([`tag`], [`kind_of`]).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use datafusion::arrow::datatypes::{Field, Schema};
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::DataFusionError;
use datafusion::config::ConfigOptions;
use datafusion::execution::{SessionState, TaskContext};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::Partitioning;
use datafusion_distributed::{
    DesiredTaskCountEvent, DesiredTaskCountEventResponse, DistributedExt, DistributedLeafExec, RouteTasksEvent, RouteTasksEventResponse,
    ScaleUpLeafNodeEvent, ScaleUpLeafNodeEventResponse, SessionStateBuilderExt, Worker, WorkerQueryContext,
};
use datafusion_proto::physical_plan::{PhysicalExtensionCodec, PhysicalProtoConverterExtension};
use parking_lot::Mutex;
use prost::Message;
use shoal_index::Consistency;
use shoal_storage::Store;

use crate::analytics::{ClusterScan, ShadowScanExec};
use crate::gather::GatheredExec;
use crate::shadow::stats::TableSummary;
use crate::shadow::{ShadowError, ShadowManager};
use crate::spread::RemoteError;

/// The path prefix of the worker service's gRPC calls, served on the node's port.
pub const WORKER_PATH_PREFIX: &str = "/worker.WorkerService/";
/// Field metadata carrying how many values a member's shadow holds of a field (schemas of
/// the members are merged by it, as one node merges its analytics partitions').
const WEIGHT_KEY: &str = "shoal.weight";
/// Schema metadata carrying about how many rows of partitions active there a member holds.
const ROWS_KEY: &str = "shoal.rows";
/// Schema metadata carrying a member's column statistics ([`TableSummary`], JSON).
const STATS_KEY: &str = "shoal.stats";
/// The header each task of a distributed statement carries its statement's id in, so that
/// a member holds all its tasks of the statement to one memory cap ([`StatementPools`]).
const STATEMENT_HEADER: &str = "x-shoal-statement";
/// Longest wait for a connection to another worker.
const WORKER_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest message a worker takes from a coordinator or another worker (a task's plan, its
/// joins' filters included; a request for a stream): a larger one is refused by its length
/// before it is read (datafusion-distributed takes any size).
pub const WORKER_MESSAGE_MAX_BYTES: usize = 64 * 1024 * 1024;

/// Most tables one call for a member's shadow fields names (a statement naming more asks
/// for them in several calls).
pub const FIELDS_TABLES_MAX: usize = 64;

/// Why a distributed statement could not run as planned.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// The plan would read a member's rows somewhere else (or on the coordinator alone).
    #[error("the plan does not place each shadow scan on the members holding its rows: {0}")]
    NotPlaced(String),
}

/// This node as a worker: what its tasks need to know of the cluster.
pub trait LocalMember: Send + Sync {
    /// This member's address, as the others name it.
    fn address(&self) -> String;
    /// Per storage partition, whether it is active here under map `map_version`; an error
    /// when this node's map is another one.
    fn actives_at(&self, map_version: u64) -> Result<Vec<bool>, String>;
    /// Headers every call to another worker carries (the cluster secret).
    fn call_headers(&self) -> Vec<(String, String)>;
    /// The TLS client configuration (h2) calls to other workers use, when members speak
    /// TLS: they verify each other by the cluster's CA.
    fn tls(&self) -> Option<Arc<rustls::ClientConfig>> {
        None
    }
}

/// The asking side of a statement's preparation on the members.
#[async_trait]
pub trait ShadowMembers: Send + Sync {
    /// The fields of `member`'s shadows of `collections` ([`encode_fields_list`]), once
    /// each is ready to be read at `consistency`; `current`: only if it holds every write
    /// made so far (waiting at most `COLUMNAR_WAIT` at `request_plus`), as `/v1/query` reads
    /// it. At most [`FIELDS_TABLES_MAX`] collections.
    async fn fields(
        &self,
        member: &str,
        collections: &[String],
        consistency: Consistency,
        timeout: Duration,
        current: bool,
    ) -> Result<Vec<u8>, RemoteError>;

    /// `member`'s rows of a small table, read while a statement is planned
    /// ([`crate::gather`]): the request and the answer are that module's encodings.
    async fn rows(&self, member: &str, request: Vec<u8>, timeout: Duration) -> Result<Vec<u8>, RemoteError>;

    /// Resolves, with the reason, once one of `members` (a statement's, by the map it
    /// pinned) holds no partition active under this node's newest map: it was failed over
    /// (stopped or cut off) or ejected, and a statement waiting on its tasks would wait
    /// until its timeout. Pending for as long as every member still holds some.
    async fn member_gone(&self, members: &[String]) -> String;
}

/// Where an analytics statement on a cluster runs.
pub struct ClusterAnalytics {
    /// The map version the statement pinned.
    pub map_version: u64,
    /// The members holding some partition active under it, in a fixed order.
    pub members: Vec<String>,
    pub remote: Arc<dyn ShadowMembers>,
}

impl fmt::Debug for ClusterAnalytics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterAnalytics").field("map_version", &self.map_version).field("members", &self.members).finish_non_exhaustive()
    }
}

/// The kinds of failure a client must tell apart, as they cross the network in text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Unavailable,
    Timeout,
    NotPlaced,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Unavailable => "[shoal:unavailable] ",
            Kind::Timeout => "[shoal:timeout] ",
            Kind::NotPlaced => "[shoal:not-placed] ",
        }
    }
}

/// An error raised on a worker, its kind written into its text.
pub(crate) fn tag(kind: Kind, e: impl fmt::Display) -> DataFusionError {
    DataFusionError::Execution(format!("{}{e}", kind.label()))
}

/// The kind a tagged error's text carries, or a network failure's.
pub(crate) fn kind_of(text: &str) -> Option<Kind> {
    for k in [Kind::Unavailable, Kind::Timeout, Kind::NotPlaced] {
        if text.contains(k.label().trim_end()) {
            return Some(k);
        }
    }
    // A worker that died or cannot be reached (tonic's transport errors, the planner's
    // connection errors).
    let lower = text.to_ascii_lowercase();
    let network = [
        "transport error",
        "connection",
        "error connecting",
        "broken pipe",
        "h2 protocol",
        "protocol error",
        "channel closed",
        "unavailable",
    ];
    network.iter().any(|n| lower.contains(n)).then_some(Kind::Unavailable)
}

fn shadow_kind(e: &ShadowError) -> Kind {
    match e {
        ShadowError::Timeout(_) => Kind::Timeout,
        _ => Kind::Unavailable,
    }
}

/// `fields`, `rows` and the columns' statistics (`stats`, a [`TableSummary`] as JSON) as
/// bytes for another member: an Arrow schema (protobuf), each field's weight in its
/// metadata, the rows and statistics in the schema's.
pub fn encode_fields(fields: &[(Field, u64)], rows: u64, stats: &str) -> Result<Vec<u8>, DataFusionError> {
    let fields: Vec<Field> = fields
        .iter()
        .map(|(f, w)| {
            let mut meta = f.metadata().clone();
            meta.insert(WEIGHT_KEY.to_string(), w.to_string());
            f.clone().with_metadata(meta)
        })
        .collect();
    let schema =
        Schema::new(fields).with_metadata([(ROWS_KEY.to_string(), rows.to_string()), (STATS_KEY.to_string(), stats.to_string())].into());
    let proto = datafusion_proto::protobuf::Schema::try_from(&schema)?;
    Ok(proto.encode_to_vec())
}

/// Members' encoded fields kept decoded, by their bytes: a member answers the same bytes
/// for as long as its shadow's fields and row count do not change, and every statement
/// asks each member for each table it reads (decoding them was about a tenth of a
/// coordinator's CPU in query 3 on 3 nodes). Keyed by content, so it is never stale.
static DECODED_FIELDS: std::sync::LazyLock<Memo<Vec<u8>, Arc<DecodedFields>>> = std::sync::LazyLock::new(|| Memo::new(FIELDS_MEMO_MAX));
/// This member's fields kept encoded, by the fields and rows encoded: the other side of
/// [`DECODED_FIELDS`] (encoding them was about a twentieth of a member's CPU in query 3 on
/// 3 nodes). Keyed by content, so it is never stale.
static ENCODED_FIELDS: std::sync::LazyLock<Memo<FieldsToEncode, Arc<Vec<u8>>>> = std::sync::LazyLock::new(|| Memo::new(FIELDS_MEMO_MAX));
/// Most distinct entries [`DECODED_FIELDS`] and [`ENCODED_FIELDS`] each keep; past it, a
/// memo starts over.
const FIELDS_MEMO_MAX: usize = 256;

/// A member's fields of a table with their weights, its rows and its columns' statistics
/// ([`encode_fields`]).
pub type DecodedFields = (Vec<(Field, u64)>, u64, Arc<TableSummary>);
/// What [`encode_fields`] takes, the statistics as JSON (the memo's key).
type FieldsToEncode = (Vec<(Field, u64)>, u64, String);

/// Answers by their question, up to `max` of them; past it, it starts over (the questions
/// in use are a few per table and member, so starting over is rare and cheap).
struct Memo<K, V> {
    answers: Mutex<HashMap<K, V>>,
    max: usize,
}

impl<K: std::hash::Hash + Eq, V: Clone> Memo<K, V> {
    fn new(max: usize) -> Memo<K, V> {
        Memo { answers: Mutex::default(), max }
    }

    /// `answer(key)`, or what it answered before for the same key; an error is not kept.
    /// The key is looked up borrowed (bytes as a slice): only a new answer owns a copy.
    fn get_or<Q, E>(&self, key: &Q, answer: impl FnOnce(&Q) -> Result<V, E>) -> Result<V, E>
    where
        K: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        if let Some(v) = self.answers.lock().get(key) {
            return Ok(v.clone());
        }
        let v = answer(key)?;
        let mut memo = self.answers.lock();
        if memo.len() >= self.max {
            memo.clear();
        }
        memo.insert(key.to_owned(), v.clone());
        debug_assert!(memo.len() <= self.max);
        Ok(v)
    }
}

/// [`decode_fields`], answered without decoding for bytes decoded before (see [`DECODED_FIELDS`]).
pub fn decode_fields_cached(bytes: &[u8]) -> Result<Arc<DecodedFields>, DataFusionError> {
    DECODED_FIELDS.get_or(bytes, |b| decode_fields(b).map(Arc::new))
}

/// [`encode_fields`], answered without encoding for fields and rows encoded before (see
/// [`ENCODED_FIELDS`]).
pub fn encode_fields_cached(fields: Vec<(Field, u64)>, rows: u64, stats: &TableSummary) -> Result<Arc<Vec<u8>>, DataFusionError> {
    let stats = serde_json::to_string(stats).map_err(|e| DataFusionError::Internal(format!("column statistics: {e}")))?;
    ENCODED_FIELDS.get_or(&(fields, rows, stats), |(f, r, s)| encode_fields(f, *r, s).map(Arc::new))
}

/// Whether a call for shadow fields may name `tables` collections (1 to
/// [`FIELDS_TABLES_MAX`]), and why not.
pub fn fields_tables_allowed(tables: usize) -> Result<(), String> {
    if tables == 0 || tables > FIELDS_TABLES_MAX {
        return Err(format!("a call for shadow fields names {tables} collections, not 1 to {FIELDS_TABLES_MAX}"));
    }
    Ok(())
}

/// Several tables' [`encode_fields`], in one answer.
#[derive(Clone, PartialEq, prost::Message)]
struct FieldsList {
    #[prost(bytes = "vec", repeated, tag = "1")]
    tables: Vec<Vec<u8>>,
}

/// One answer for several tables' fields, each [`encode_fields`]' bytes, in order.
pub fn encode_fields_list(tables: &[Arc<Vec<u8>>]) -> Vec<u8> {
    FieldsList { tables: tables.iter().map(|t| t.as_ref().clone()).collect() }.encode_to_vec()
}

/// The tables [`encode_fields_list`] wrote, decoded ([`decode_fields_cached`]); an error
/// unless there are `expected` of them.
pub fn decode_fields_list(bytes: &[u8], expected: usize) -> Result<Vec<Arc<DecodedFields>>, DataFusionError> {
    let list = FieldsList::decode(bytes).map_err(|e| DataFusionError::Plan(format!("a member's schemas: {e}")))?;
    if list.tables.len() != expected {
        return Err(DataFusionError::Plan(format!("a member answered {} schemas for {expected} tables", list.tables.len())));
    }
    list.tables.iter().map(|t| decode_fields_cached(t)).collect()
}

/// The fields and rows [`encode_fields`] wrote.
pub fn decode_fields(bytes: &[u8]) -> Result<DecodedFields, DataFusionError> {
    let proto = datafusion_proto::protobuf::Schema::decode(bytes).map_err(|e| DataFusionError::Plan(format!("a member's schema: {e}")))?;
    let schema: Schema = (&proto).try_into()?;
    let rows = schema.metadata().get(ROWS_KEY).and_then(|r| r.parse().ok()).unwrap_or(0);
    // Statistics a member could not say are unknown: the planner estimates without them.
    let stats: TableSummary = schema.metadata().get(STATS_KEY).and_then(|s| serde_json::from_str(s).ok()).unwrap_or_default();
    let fields = schema
        .fields()
        .iter()
        .map(|f| {
            let mut meta = f.metadata().clone();
            let w = meta.remove(WEIGHT_KEY).and_then(|w| w.parse().ok()).unwrap_or(1);
            (f.as_ref().clone().with_metadata(meta), w)
        })
        .collect();
    Ok((fields, rows, Arc::new(stats)))
}

/// What a worker's tasks read: this node's shadows.
pub(crate) struct WorkerEnv {
    pub store: Arc<Store>,
    pub shadows: Arc<ShadowManager>,
    pub local: Arc<dyn LocalMember>,
}

impl WorkerEnv {
    /// Partition `partition` (of `partitions`) of a task's scan: the pieces of the
    /// analytics partitions `i` with `i mod partitions == partition`, and which storage
    /// partitions are active here (`None`: all), whose rows alone it may read.
    pub(crate) async fn read(
        &self,
        scan: &ClusterScan,
        partition: usize,
        partitions: usize,
    ) -> Result<(Vec<crate::shadow::Part>, Option<Arc<Vec<bool>>>), DataFusionError> {
        let unavailable = |e: String| tag(Kind::Unavailable, e);
        let actives = self.local.actives_at(scan.map_version).map_err(unavailable)?;
        // `request_plus` was waited for by the coordinator's `shadow-fields` call.
        let shadow =
            crate::analytics::shadow_when_whole(&self.store, &self.shadows, &scan.collection, Consistency::NotBounded, scan.timeout)
                .await
                .map_err(|e| tag(shadow_kind(&e), e))?;
        let (s, g) = (Arc::clone(&shadow), scan.group.clone());
        let parts = tokio::task::spawn_blocking(move || s.snapshot(g.as_deref()))
            .await
            .map_err(|e| DataFusionError::External(Box::new(e)))?
            .map_err(|e| tag(shadow_kind(&e), e))?;
        // The rows read belong to the actives of the pinned map only if the map did not
        // change meanwhile.
        let after = self.local.actives_at(scan.map_version).map_err(unavailable)?;
        if after != actives {
            return Err(unavailable("partitions moved while the statement ran; run it again".into()));
        }
        let mine = parts.into_iter().enumerate().filter(|(i, _)| i % partitions.max(1) == partition).flat_map(|(_, ap)| ap).collect();
        let all = actives.iter().all(|a| *a);
        Ok((mine, (!all).then(|| Arc::new(actives))))
    }
}

/// Encodes and decodes [`ShadowScanExec`] in a cluster for the workers.
pub(crate) struct ScanCodec;

impl fmt::Debug for ScanCodec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ScanCodec")
    }
}

#[derive(Clone, PartialEq, prost::Message)]
struct ScanProto {
    #[prost(message, optional, tag = "1")]
    schema: Option<datafusion_proto::protobuf::Schema>,
    #[prost(string, tag = "2")]
    collection: String,
    #[prost(uint64, tag = "3")]
    map_version: u64,
    #[prost(uint64, tag = "4")]
    timeout_ms: u64,
    #[prost(string, repeated, tag = "5")]
    members: Vec<String>,
    #[prost(string, optional, tag = "6")]
    member: Option<String>,
    #[prost(string, optional, tag = "7")]
    group: Option<String>,
    #[prost(uint64, optional, tag = "8")]
    limit: Option<u64>,
    #[prost(uint64, tag = "9")]
    partitions: u64,
    /// The dynamic filters its joins push into it, encoded as DataFusion's protobuf encodes
    /// them (so that on a worker they are the same filters its joins fill).
    #[prost(message, repeated, tag = "10")]
    dynamic: Vec<datafusion_proto::protobuf::PhysicalExprNode>,
    /// A gathered table's rows ([`GatheredExec`], an Arrow IPC stream) instead of a scan.
    #[prost(bytes = "vec", optional, tag = "11")]
    gathered: Option<Vec<u8>>,
}

impl PhysicalExtensionCodec for ScanCodec {
    fn try_decode(
        &self,
        buf: &[u8],
        inputs: &[Arc<dyn ExecutionPlan>],
        ctx: &TaskContext,
        proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<Arc<dyn ExecutionPlan>, DataFusionError> {
        if !inputs.is_empty() {
            return Err(DataFusionError::Internal("a shadow scan has no inputs".into()));
        }
        let p = ScanProto::decode(buf).map_err(|e| DataFusionError::Internal(format!("a shadow scan's encoding: {e}")))?;
        let schema: Schema =
            p.schema.as_ref().ok_or_else(|| DataFusionError::Internal("a shadow scan without its schema".into()))?.try_into()?;
        if let Some(rows) = &p.gathered {
            return Ok(Arc::new(GatheredExec::from_ipc(p.collection, Arc::new(schema), rows)?));
        }
        let scan = ClusterScan {
            collection: p.collection,
            map_version: p.map_version,
            timeout: Duration::from_millis(p.timeout_ms),
            members: p.members.into(),
            member: p.member,
            group: p.group,
        };
        let limit = p.limit.map(|l| usize::try_from(l).unwrap_or(usize::MAX));
        let partitions = usize::try_from(p.partitions).unwrap_or(1).max(1);
        let decoding = datafusion_proto::physical_plan::PhysicalPlanDecodeContext::new(ctx, self);
        let dynamic =
            p.dynamic.iter().map(|d| proto_converter.proto_to_physical_expr(d, &schema, &decoding)).collect::<Result<Vec<_>, _>>()?;
        Ok(Arc::new(ShadowScanExec::in_cluster(scan, Arc::new(schema), limit, partitions, 0).with_dynamic(dynamic)))
    }

    fn try_encode(
        &self,
        node: Arc<dyn ExecutionPlan>,
        buf: &mut Vec<u8>,
        proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<(), DataFusionError> {
        // A plan whose stage sent to a worker holds another leaf (a `/v1/query` read of the
        // documents by key) runs on the rows instead.
        if let Some(g) = node.downcast_ref::<GatheredExec>() {
            let proto = ScanProto {
                schema: Some(node.schema().as_ref().try_into()?),
                collection: g.table().to_string(),
                gathered: Some(g.ipc()?.to_vec()),
                ..ScanProto::default()
            };
            return proto.encode(buf).map_err(|e| DataFusionError::Internal(format!("encoding gathered rows: {e}")));
        }
        let Some(exec) = node.downcast_ref::<ShadowScanExec>() else {
            return Err(tag(Kind::NotPlaced, format!("a stage sent to a worker reads {}", node.name())));
        };
        let Some(scan) = exec.cluster() else {
            return Err(DataFusionError::Internal("a shadow scan of this node alone is not sent to workers".into()));
        };
        let proto = ScanProto {
            schema: Some(node.schema().as_ref().try_into()?),
            collection: scan.collection.clone(),
            map_version: scan.map_version,
            timeout_ms: u64::try_from(scan.timeout.as_millis()).unwrap_or(u64::MAX),
            members: scan.members.to_vec(),
            member: scan.member.clone(),
            group: scan.group.clone(),
            limit: exec.limit().map(|l| l as u64),
            partitions: exec.properties().partitioning.partition_count() as u64,
            dynamic: exec.dynamic().iter().map(|d| proto_converter.physical_expr_to_proto(d, self)).collect::<Result<Vec<_>, _>>()?,
            gathered: None,
        };
        proto.encode(buf).map_err(|e| DataFusionError::Internal(format!("encoding a shadow scan: {e}")))
    }
}

/// One task per member holding actives.
fn desired_tasks(ev: DesiredTaskCountEvent) -> Option<Result<DesiredTaskCountEventResponse, DataFusionError>> {
    let scan = ev.plan.downcast_ref::<ShadowScanExec>()?.cluster()?;
    Some(Ok(DesiredTaskCountEventResponse::desired(scan.members.len())))
}

/// A distributed statement's final aggregation by groups estimated few (at most
/// [`crate::ONE_TASK_GROUPS_MAX`]) runs in one partition over its input's partial
/// aggregates gathered (`Final` over `CoalescePartitionsExec`, where DataFusion shuffles
/// them by hash into `FinalPartitioned`): datafusion-distributed then runs it on the
/// coordinator, the partial aggregates coming to it from the members, instead of a stage
/// of one task per member and a hash shuffle between them (a stage of streams for a few
/// rows). The estimate is DataFusion's, from the shadows' column statistics (distinct
/// counts of the group columns, capped by the rows left after filters and joins; see
/// [`crate::shadow::stats`]); with none, the groups are not known to be few and stay
/// shuffled. Runs after DataFusion's own rules, before the plan is distributed.
#[derive(Debug)]
pub(crate) struct FewGroupsInOneTask;

impl PhysicalOptimizerRule for FewGroupsInOneTask {
    fn optimize(&self, plan: Arc<dyn ExecutionPlan>, _config: &ConfigOptions) -> Result<Arc<dyn ExecutionPlan>, DataFusionError> {
        plan.transform_up(|p| {
            let Some(agg) = p.downcast_ref::<AggregateExec>() else { return Ok(Transformed::no(p)) };
            let Some(shuffle) = agg.input().downcast_ref::<RepartitionExec>() else { return Ok(Transformed::no(p)) };
            if !matches!(shuffle.partitioning(), Partitioning::Hash(..)) || agg.limit_options().is_some() || !few_groups(agg) {
                return Ok(Transformed::no(p));
            }
            let gathered = Arc::new(CoalescePartitionsExec::new(Arc::clone(shuffle.input())));
            let one = AggregateExec::try_new(
                AggregateMode::Final,
                agg.group_expr().clone(),
                agg.aggr_expr().to_vec(),
                agg.filter_expr().to_vec(),
                gathered,
                agg.input_schema(),
            )?;
            Ok(Transformed::yes(Arc::new(one) as Arc<dyn ExecutionPlan>))
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "few_groups_in_one_task"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Whether `agg` is a final aggregation by groups estimated at most
/// [`crate::ONE_TASK_GROUPS_MAX`].
fn few_groups(agg: &AggregateExec) -> bool {
    if *agg.mode() != AggregateMode::FinalPartitioned || agg.group_expr().is_empty() {
        return false;
    }
    let stats = datafusion::physical_plan::statistics::StatisticsContext::new()
        .compute(agg, &datafusion::physical_plan::statistics::StatisticsArgs::new());
    stats.is_ok_and(|s| groups_fit_one_task(s.num_rows))
}

/// Whether an aggregation estimated to answer `groups` rows runs in one task: only when
/// the estimate is known and at most [`crate::ONE_TASK_GROUPS_MAX`].
fn groups_fit_one_task(groups: datafusion::common::stats::Precision<usize>) -> bool {
    matches!(groups.get_value(), Some(&n) if n <= crate::ONE_TASK_GROUPS_MAX)
}

/// The scan of task `i` reads member `i`; any other task count is refused.
fn scale_up(ev: ScaleUpLeafNodeEvent) -> Option<Result<ScaleUpLeafNodeEventResponse, DataFusionError>> {
    let exec = ev.plan.downcast_ref::<ShadowScanExec>()?;
    let scan = exec.cluster()?;
    if ev.task_count != scan.members.len() {
        let why = format!("the scan of {} would run in {} tasks over {} members", scan.collection, ev.task_count, scan.members.len());
        return Some(Err(tag(Kind::NotPlaced, DistError::NotPlaced(why))));
    }
    let variants = scan.members.iter().map(|m| Arc::new(exec.for_member(m)) as Arc<dyn ExecutionPlan>);
    Some(DistributedLeafExec::try_new(Arc::clone(ev.plan), variants).map(|leaf| ScaleUpLeafNodeEventResponse::new(Arc::new(leaf))))
}

/// A stage reading a shadow scan runs task `i` on member `i`.
fn route(ev: RouteTasksEvent) -> Option<Result<RouteTasksEventResponse, DataFusionError>> {
    use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
    let mut members: Option<Vec<String>> = None;
    let walked = ev.plan.apply(|node| {
        if let Some(leaf) = node.downcast_ref::<DistributedLeafExec>() {
            if let Some(scan) = leaf.original().downcast_ref::<ShadowScanExec>().and_then(ShadowScanExec::cluster) {
                members = Some(scan.members.to_vec());
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        Ok(TreeNodeRecursion::Continue)
    });
    if let Err(e) = walked {
        return Some(Err(e));
    }
    let members = members?;
    if members.len() != ev.task_count {
        let why = format!("a stage of {} tasks reads a scan over {} members", ev.task_count, members.len());
        return Some(Err(tag(Kind::NotPlaced, DistError::NotPlaced(why))));
    }
    Some(members.iter().map(|m| worker_url(m)).collect::<Result<Vec<_>, _>>().map(RouteTasksEventResponse::new))
}

/// Gathers the inputs of the joins datafusion-distributed runs in one task — a null-aware
/// anti join (`NOT IN`, TPC-H q16), whose null checks cannot span tasks, and a full
/// nested-loop join — through a coalesce, which it turns into a network boundary: the
/// scans below still run one task per member and only their filtered rows come to the
/// join. Without it the join's stage, its scans included, ran in one task, which would
/// read every member's rows in one place (refused as not placed, so run on the rows).
#[derive(Debug, Default)]
pub(crate) struct GatherSingleTaskJoins;

/// Whether `plan` is a join datafusion-distributed caps to one task.
fn runs_in_one_task(plan: &Arc<dyn ExecutionPlan>) -> bool {
    use datafusion::common::JoinType;
    use datafusion::physical_plan::joins::{HashJoinExec, NestedLoopJoinExec, PartitionMode};
    if let Some(join) = plan.downcast_ref::<HashJoinExec>() {
        return join.null_aware && join.mode == PartitionMode::CollectLeft;
    }
    plan.downcast_ref::<NestedLoopJoinExec>().is_some_and(|join| join.join_type() == &JoinType::Full)
}

/// Whether `plan` reads a shadow scan across the members.
fn scans_members(plan: &Arc<dyn ExecutionPlan>) -> bool {
    use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
    let mut found = false;
    let _ = plan.apply(|node| {
        found = node.downcast_ref::<ShadowScanExec>().is_some_and(|s| s.cluster().is_some());
        Ok(if found { TreeNodeRecursion::Stop } else { TreeNodeRecursion::Continue })
    });
    found
}

impl datafusion::physical_optimizer::PhysicalOptimizerRule for GatherSingleTaskJoins {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &datafusion::config::ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>, DataFusionError> {
        use datafusion::common::tree_node::{Transformed, TreeNode};
        use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
        plan.transform_up(|p| {
            if !runs_in_one_task(&p) {
                return Ok(Transformed::no(p));
            }
            let mut changed = false;
            let children = p
                .children()
                .into_iter()
                .map(|child| {
                    if child.downcast_ref::<CoalescePartitionsExec>().is_some() || !scans_members(child) {
                        return Arc::clone(child);
                    }
                    changed = true;
                    Arc::new(CoalescePartitionsExec::new(Arc::clone(child))) as Arc<dyn ExecutionPlan>
                })
                .collect();
            Ok(match changed {
                true => Transformed::yes(datafusion::physical_plan::execution_plan::replace_children_if_necessary(p, children)?),
                false => Transformed::no(p),
            })
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "gather_single_task_joins"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// A member's worker URL.
pub(crate) fn worker_url(member: &str) -> Result<url::Url, DataFusionError> {
    url::Url::parse(&format!("http://{member}")).map_err(|e| DataFusionError::Plan(format!("member address {member}: {e}")))
}

/// The workers of one statement: its members.
struct Members(Vec<url::Url>);

impl datafusion_distributed::WorkerResolver for Members {
    fn get_urls(&self) -> Result<Vec<url::Url>, DataFusionError> {
        Ok(self.0.clone())
    }
}

/// Connections to the other workers, one per member for the node's life, each call
/// carrying the cluster secret.
#[derive(Clone)]
pub(crate) struct Channels {
    headers: Arc<Vec<(http::HeaderName, http::HeaderValue)>>,
    tls: Option<Arc<rustls::ClientConfig>>,
    by_url: Arc<Mutex<HashMap<url::Url, datafusion_distributed::grpc::BoxCloneSyncChannel>>>,
}

impl Channels {
    pub(crate) fn new(headers: Vec<(String, String)>, tls: Option<Arc<rustls::ClientConfig>>) -> Channels {
        let headers = headers
            .into_iter()
            .filter_map(|(k, v)| Some((http::HeaderName::try_from(k).ok()?, http::HeaderValue::try_from(v).ok()?)))
            .collect();
        Channels { headers: Arc::new(headers), tls, by_url: Arc::default() }
    }

    fn channel(&self, url: &url::Url) -> Result<datafusion_distributed::grpc::BoxCloneSyncChannel, DataFusionError> {
        let mut map = self.by_url.lock();
        if let Some(c) = map.get(url) {
            return Ok(c.clone());
        }
        let endpoint = tonic::transport::Channel::from_shared(url.to_string())
            .map_err(|e| DataFusionError::Plan(format!("worker URL {url}: {e}")))?
            .connect_timeout(WORKER_CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(10));
        let channel = match &self.tls {
            None => endpoint.connect_lazy(),
            // The URL stays `http://`: TLS is this connector's, not tonic's.
            Some(tls) => endpoint.connect_with_connector_lazy(tls_connector(Arc::clone(tls))),
        };
        let headers = Arc::clone(&self.headers);
        let svc = tower::ServiceBuilder::new()
            .map_request(move |mut req: http::Request<tonic::body::Body>| {
                for (k, v) in headers.iter() {
                    req.headers_mut().insert(k.clone(), v.clone());
                }
                req
            })
            .service(channel);
        let boxed = datafusion_distributed::grpc::BoxCloneSyncChannel::new(svc);
        map.insert(url.clone(), boxed.clone());
        Ok(boxed)
    }
}

/// Connects to a worker over TLS: TCP, then the handshake naming the member's host.
fn tls_connector(
    config: Arc<rustls::ClientConfig>,
) -> impl tower::Service<
    http::Uri,
    Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>,
    Error = std::io::Error,
    Future = impl Send,
> + Send
       + Clone
       + 'static {
    tower::service_fn(move |uri: http::Uri| {
        let connector = tokio_rustls::TlsConnector::from(Arc::clone(&config));
        async move {
            let invalid = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, why);
            let host = uri.host().ok_or_else(|| invalid(format!("worker URL {uri} has no host")))?;
            let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
            let port = uri.port_u16().unwrap_or(80);
            let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            let name = rustls::pki_types::ServerName::try_from(host).map_err(|e| invalid(e.to_string()))?;
            Ok(hyper_util::rt::TokioIo::new(connector.connect(name, tcp).await?))
        }
    })
}

#[async_trait]
impl datafusion_distributed::ChannelResolver for Channels {
    async fn get_worker_client_for_url(&self, url: &url::Url) -> Result<Box<dyn datafusion_distributed::WorkerChannel>, DataFusionError> {
        Ok(datafusion_distributed::grpc::create_worker_client(self.channel(url)?))
    }
}

/// Adds what a distributed statement needs to a coordinating session.
pub(crate) fn coordinating(
    builder: datafusion::execution::SessionStateBuilder,
    cluster: &Arc<ClusterAnalytics>,
    worker: &Worker,
    me: &str,
    channels: Channels,
    statement: &str,
) -> Result<datafusion::execution::SessionStateBuilder, DataFusionError> {
    let urls = cluster.members.iter().map(|m| worker_url(m)).collect::<Result<Vec<_>, _>>()?;
    let mut headers = http::HeaderMap::new();
    let id = http::HeaderValue::try_from(statement).map_err(|e| DataFusionError::Plan(format!("statement id {statement}: {e}")))?;
    headers.insert(http::HeaderName::from_static(STATEMENT_HEADER), id);
    let mut builder = builder
        .with_distributed_passthrough_headers(headers)?
        .with_physical_optimizer_rule(Arc::new(GatherSingleTaskJoins))
        .with_distributed_worker_resolver(Members(urls))
        .with_distributed_channel_resolver(channels)
        .with_distributed_local_worker_context(worker.to_local_worker_context(worker_url(me)?))
        .with_distributed_planner()
        // Tasks send their metrics back to the coordinator only for `EXPLAIN ANALYZE`
        // ([`analyzed`]): gathering and encoding them cost every statement otherwise.
        .with_distributed_metrics_collection(false)?
        .with_distributed_user_codec(ScanCodec)
        .with_distributed_desired_task_count_handler(desired_tasks)
        .with_distributed_scale_up_leaf_node_handler(scale_up)
        .with_distributed_route_tasks_handler(route);
    // Broadcasts of gathered tables are inlined once datafusion-distributed has planned.
    let distributed = builder.query_planner().take();
    Ok(match distributed {
        Some(planner) => {
            builder.with_query_planner(Arc::new(crate::gather::InlineGatheredBroadcasts { planner, cluster: Arc::clone(cluster) }))
        }
        None => builder,
    })
}

/// `df` with its tasks' metrics collected if it is an `EXPLAIN ANALYZE`, which shows them
/// (a coordinating session leaves them off).
pub(crate) fn analyzed(df: datafusion::dataframe::DataFrame) -> Result<datafusion::dataframe::DataFrame, DataFusionError> {
    if !matches!(df.logical_plan(), datafusion::logical_expr::LogicalPlan::Analyze(_)) {
        return Ok(df);
    }
    let (mut state, plan) = df.into_parts();
    state.set_distributed_metrics_collection(true)?;
    Ok(datafusion::dataframe::DataFrame::new(state, plan))
}

/// This node's worker: tasks from coordinators, read from this node's shadows.
pub(crate) fn worker(
    env: Arc<WorkerEnv>,
    runtime: Arc<datafusion::execution::runtime_env::RuntimeEnv>,
    query_memory_bytes: usize,
    channels: Channels,
    statements: Arc<crate::pool::StatementPools>,
) -> Worker {
    let node_runtime = Arc::clone(&runtime);
    let build = move |ctx: WorkerQueryContext| {
        let env = Arc::clone(&env);
        let runtime = Arc::clone(&runtime);
        let channels = channels.clone();
        let statements = Arc::clone(&statements);
        async move {
            // The statement's tasks here share its cap, within the node's pool and spill
            // disk (a task without the statement's id has a cap of its own).
            let pool = match ctx.headers.get(STATEMENT_HEADER).and_then(|v| v.to_str().ok()) {
                Some(id) => statements.pool(id, &runtime.memory_pool, query_memory_bytes),
                None => Arc::new(crate::pool::QueryPool::new(Arc::clone(&runtime.memory_pool), query_memory_bytes)),
            };
            let task_runtime = Arc::new(datafusion::execution::runtime_env::RuntimeEnv {
                memory_pool: pool,
                disk_manager: Arc::clone(&runtime.disk_manager),
                cache_manager: Arc::clone(&runtime.cache_manager),
                object_store_registry: Arc::clone(&runtime.object_store_registry),
            });
            let mut builder = ctx
                .builder
                .with_runtime_env(task_runtime)
                .with_distributed_user_codec(ScanCodec)
                .with_distributed_channel_resolver(channels);
            crate::bounded::wrap(&mut builder);
            crate::fsum::wrap(&mut builder);
            let mut state: SessionState = builder.build();
            state.config_mut().set_extension(env);
            Ok::<_, DataFusionError>(state)
        }
    };
    Worker::from_session_builder(build).with_runtime_env(node_runtime)
}

/// Sets a distributed statement's joins to broadcast a build side estimated below
/// [`crate::BROADCAST_BUILD_MAX_BYTES`] (or, its bytes unknown, [`crate::BROADCAST_BUILD_MAX_ROWS`])
/// to every member's task (`CollectLeft`), so that a fact table is joined where its rows
/// are; a bigger one is shuffled between the members by hash with the other side.
pub(crate) fn broadcast_builds_up_to_limits(config: &mut datafusion::prelude::SessionConfig) {
    let optimizer = &mut config.options_mut().optimizer;
    optimizer.hash_join_single_partition_threshold = crate::BROADCAST_BUILD_MAX_BYTES;
    optimizer.hash_join_single_partition_threshold_rows = crate::BROADCAST_BUILD_MAX_ROWS;
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::Int64Array;
    use datafusion::arrow::datatypes::DataType;
    use datafusion::arrow::record_batch::RecordBatch;

    /// The join mode the planner picks for `a JOIN b` with `a` of `rows_a` and `b` of
    /// `rows_b` rows of one 8-byte column, under the distributed statement's settings.
    async fn join_mode(rows_a: i64, rows_b: i64) -> String {
        let mut config = datafusion::prelude::SessionConfig::new().with_target_partitions(2);
        broadcast_builds_up_to_limits(&mut config);
        let ctx = datafusion::prelude::SessionContext::new_with_config(config);
        for (name, rows) in [("a", rows_a), ("b", rows_b)] {
            let batch = RecordBatch::try_from_iter([("k", Arc::new(Int64Array::from_iter_values(0..rows)) as _)]).unwrap();
            ctx.register_batch(name, batch).unwrap();
        }
        let plan = ctx.sql("SELECT count(*) FROM a JOIN b ON a.k = b.k").await.unwrap().create_physical_plan().await.unwrap();
        let text = datafusion::physical_plan::displayable(plan.as_ref()).indent(true).to_string();
        let join = text.lines().find(|l| l.contains("HashJoinExec")).unwrap_or_else(|| panic!("no hash join in {text}"));
        ["CollectLeft", "Partitioned"].into_iter().find(|m| join.contains(m)).unwrap_or_else(|| panic!("no mode in {join}")).to_string()
    }

    #[tokio::test]
    async fn a_join_build_side_past_the_broadcast_limit_is_shuffled_not_broadcast() {
        let rows_at_limit = i64::try_from(crate::BROADCAST_BUILD_MAX_BYTES / 8).unwrap();
        // 16 MiB, past DataFusion's own default of 1 MiB: broadcast.
        assert_eq!(join_mode(rows_at_limit / 2, rows_at_limit * 2).await, "CollectLeft");
        // Both sides past the limit: the smaller one is not broadcast either.
        assert_eq!(join_mode(rows_at_limit + 1024, rows_at_limit + 2048).await, "Partitioned");
    }

    #[test]
    fn a_final_aggregation_runs_in_one_task_only_when_its_groups_are_known_few() {
        use datafusion::common::stats::Precision;
        let max = crate::ONE_TASK_GROUPS_MAX;
        for (groups, one) in [
            (Precision::Absent, false),
            (Precision::Inexact(3_018), true),
            (Precision::Exact(max), true),
            (Precision::Inexact(max + 1), false),
            (Precision::Inexact(1_500_000), false),
        ] {
            assert_eq!(groups_fit_one_task(groups), one, "{groups:?}");
        }
    }

    fn summary(distinct: u64) -> TableSummary {
        TableSummary::from([("a".to_string(), crate::shadow::stats::FieldSummary { values: 7, distinct, min: Some(-1.5), max: Some(9.0) })])
    }

    fn json(s: &TableSummary) -> String {
        serde_json::to_string(s).unwrap()
    }

    #[test]
    fn fields_cross_members_with_their_weights_and_statistics() {
        let fields = vec![(Field::new("a", DataType::Int64, true), 7), (Field::new("b", DataType::Utf8, true), 1 << 40)];
        let back = decode_fields(&encode_fields(&fields, 1234, &json(&summary(5))).unwrap()).unwrap();
        assert_eq!(back, (fields.clone(), 1234, Arc::new(summary(5))));
        // Statistics a member could not say (unreadable, or an older member's bytes) are
        // unknown, and the fields still come.
        let back = decode_fields(&encode_fields(&fields, 1, "not json").unwrap()).unwrap();
        assert_eq!(back, (fields, 1, Arc::new(TableSummary::new())));
    }

    #[test]
    fn one_call_s_tables_come_back_in_order_and_a_short_or_bad_answer_is_refused() {
        let a = vec![(Field::new("list_a", DataType::Int64, true), 2)];
        let b = vec![(Field::new("list_b", DataType::Utf8, true), 9)];
        let tables = [Arc::new(encode_fields(&a, 4, &json(&summary(1))).unwrap()), Arc::new(encode_fields(&b, 8, "{}").unwrap())];
        let back = decode_fields_list(&encode_fields_list(&tables), 2).unwrap();
        assert_eq!(back.iter().map(|t| (t.0.clone(), t.1)).collect::<Vec<_>>(), vec![(a, 4), (b, 8)]);
        // An answer for fewer (or more) tables than asked, or not a list at all.
        assert!(decode_fields_list(&encode_fields_list(&tables[..1]), 2).is_err());
        assert!(decode_fields_list(&encode_fields_list(&tables), 1).is_err());
        assert!(decode_fields_list(b"\xff\xff not a list", 2).is_err());
        // A call names 1 to FIELDS_TABLES_MAX tables.
        assert!(fields_tables_allowed(0).is_err());
        assert!(fields_tables_allowed(1).is_ok());
        assert!(fields_tables_allowed(FIELDS_TABLES_MAX).is_ok());
        assert!(fields_tables_allowed(FIELDS_TABLES_MAX + 1).is_err());
    }

    #[test]
    fn a_member_s_fields_seen_before_are_not_decoded_again_and_changed_ones_are() {
        let fields = vec![(Field::new("memo_a", DataType::Int64, true), 3)];
        let bytes = encode_fields(&fields, 10, &json(&summary(2))).unwrap();
        let first = decode_fields_cached(&bytes).unwrap();
        assert_eq!(*first, (fields.clone(), 10, Arc::new(summary(2))));
        assert!(Arc::ptr_eq(&first, &decode_fields_cached(&bytes).unwrap()), "the same bytes: the same decoding");
        // Another row count (the member took writes): other bytes, decoded afresh.
        let more = decode_fields_cached(&encode_fields(&fields, 11, &json(&summary(2))).unwrap()).unwrap();
        assert_eq!(*more, (fields, 11, Arc::new(summary(2))));
        assert!(decode_fields_cached(b"\xff not a schema").is_err(), "bad bytes are refused, not kept");
    }

    #[test]
    fn this_member_s_fields_seen_before_are_not_encoded_again_and_changed_ones_are() {
        let fields = vec![(Field::new("memo_enc", DataType::Utf8, true), 5)];
        let first = encode_fields_cached(fields.clone(), 7, &summary(3)).unwrap();
        // (The schema's metadata is a map: two encodings of it may order it differently.)
        assert_eq!(decode_fields(&first).unwrap(), decode_fields(&encode_fields(&fields, 7, &json(&summary(3))).unwrap()).unwrap());
        assert!(Arc::ptr_eq(&first, &encode_fields_cached(fields.clone(), 7, &summary(3)).unwrap()), "the same fields: the same bytes");
        // A field's weight changed: encoded afresh, and decodes to the change.
        let changed = vec![(Field::new("memo_enc", DataType::Utf8, true), 6)];
        let again = encode_fields_cached(changed.clone(), 7, &summary(3)).unwrap();
        assert!(!Arc::ptr_eq(&first, &again));
        assert_eq!(decode_fields(&again).unwrap(), (changed, 7, Arc::new(summary(3))));
        // Another row count, or other statistics: other bytes too.
        assert_eq!(
            decode_fields(&encode_fields_cached(fields.clone(), 8, &summary(3)).unwrap()).unwrap(),
            (fields.clone(), 8, Arc::new(summary(3)))
        );
        assert_eq!(
            decode_fields(&encode_fields_cached(fields.clone(), 7, &summary(4)).unwrap()).unwrap(),
            (fields, 7, Arc::new(summary(4)))
        );
    }

    /// A memo is bounded: past its most entries it starts over, and what it held is
    /// answered afresh when asked (the process-wide ones keep `FIELDS_MEMO_MAX`).
    #[test]
    fn the_fields_memo_starts_over_past_its_most_entries() {
        assert_eq!(DECODED_FIELDS.max, FIELDS_MEMO_MAX);
        assert_eq!(ENCODED_FIELDS.max, FIELDS_MEMO_MAX);
        let memo: Memo<Vec<u8>, Arc<DecodedFields>> = Memo::new(2);
        let decode = |b: &[u8]| decode_fields(b).map(Arc::new);
        let fields = vec![(Field::new("memo_b", DataType::Utf8, true), 1)];
        let enc: Vec<Vec<u8>> = (0..3).map(|rows| encode_fields(&fields, rows, "{}").unwrap()).collect();
        let first = memo.get_or(&*enc[0], decode).unwrap();
        let second = memo.get_or(&*enc[1], decode).unwrap();
        assert!(Arc::ptr_eq(&first, &memo.get_or(&*enc[0], decode).unwrap()), "held: not decoded again");
        assert_eq!(memo.answers.lock().len(), 2);
        // A third entry: the memo starts over and holds it alone.
        assert_eq!(*memo.get_or(&*enc[2], decode).unwrap(), (fields.clone(), 2, Arc::new(TableSummary::new())));
        assert_eq!(memo.answers.lock().len(), 1);
        let again = memo.get_or(&*enc[0], decode).unwrap();
        assert!(!Arc::ptr_eq(&first, &again), "decoded again after the start over");
        assert_eq!(*again, *first);
        assert!(!Arc::ptr_eq(&second, &memo.get_or(&*enc[1], decode).unwrap()));
    }

    /// A member whose address takes no connection (its accept queue full: a stopped
    /// process's fills once its backlog does) fails a call to it at
    /// `WORKER_CONNECT_TIMEOUT`, never later: the statement answers `503` instead of
    /// hanging. Under tokio's paused clock: the timeout is reached without waiting for it.
    #[tokio::test(start_paused = true)]
    async fn a_worker_that_takes_no_connection_fails_the_call_at_the_connect_timeout() {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(0).unwrap();
        let addr = listener.local_addr().unwrap();
        // Fill the accept queue with connections the listener never accepts, until the
        // kernel drops the next one's handshake.
        let mut queued = Vec::new();
        while let Ok(s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(300)) {
            queued.push(s);
            assert!(queued.len() < 64, "the accept queue never filled");
        }
        let channel = Channels::new(Vec::new(), None).channel(&worker_url(&addr.to_string()).unwrap()).unwrap();
        let start = tokio::time::Instant::now();
        let call = tower::ServiceExt::oneshot(channel, http::Request::new(tonic::body::Body::empty()));
        let failed = tokio::time::timeout(WORKER_CONNECT_TIMEOUT * 3, call)
            .await
            .expect("the call ends by the connect timeout, never hangs")
            .expect_err("no connection was taken");
        let took = start.elapsed();
        assert!(took >= WORKER_CONNECT_TIMEOUT && took < WORKER_CONNECT_TIMEOUT + Duration::from_secs(1), "{took:?}: {failed:?}");
        drop(listener);
    }

    #[test]
    fn error_kinds_survive_the_text_they_cross_in() {
        for k in [Kind::Unavailable, Kind::Timeout, Kind::NotPlaced] {
            let e = tag(k, "why");
            assert_eq!(kind_of(&e.to_string()), Some(k));
            assert_eq!(kind_of(&format!("worker said: {e}")), Some(k), "wrapped");
        }
        assert_eq!(kind_of("Error connecting to Distributed DataFusion worker on 'http://x'"), Some(Kind::Unavailable));
        assert_eq!(kind_of("Arrow error: Divide by zero error"), None);
    }
}
