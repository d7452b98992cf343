//! File-based copies (the `"files"` method): a new copy of a partition is built from the
//! active's export — a consistent snapshot of the partition's keyspace — and then catches up
//! from the change stream at the export's positions like any replica. This is seed 003's
//! fix: the copy moves files and sorted runs, not changes one by one. The snapshot travels
//! in one of two shapes (the progress's `shipped`):
//! - `files`: the keyspace's table and blob files byte for byte, adopted whole by the
//!   receiver (`Store::export_partition_files` / `import_partition_files`): neither side
//!   decodes a record;
//! - `records`: the snapshot's records in key order, written into new table files on the
//!   receiver (`Store::export_partition` / `ingest_partition`) — when the source cannot
//!   export files (a dropped collection's keys are still being deleted), or the receiver
//!   runs with `--copy-by-records` (the benchmark's comparison).
//!
//! A replica takes this path when its copy of a partition is empty and the active's first
//! answer shows a backfill of at least `COPY_MIN_CHANGES` changes; otherwise (a small
//! partition, or a copy that already holds data — a returning node, which rolls back and
//! catches up) it backfills from the change stream (`"stream"`), which is also the fallback
//! when a copy fails (the half-ingested copy is dropped first).
//!
//! The stream's format is `shoal_storage::copy_stream`'s.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use shoal_cluster::{NodeId, PartitionId};
use shoal_storage::copy_stream::{CopyHeader, Frame, FrameDecoder, FrameEncoder, FrameError};
use shoal_storage::{FilePiece, IngestStats, PartitionError, PartitionState, Store};
use tokio::sync::mpsc;

use crate::elastic::Elastic;
use crate::node::{blocking, ClusterNode};
use crate::peers::{ChunkStream, Op};
use crate::ClusterError;

/// A copy by files starts only when the active's first answer shows at least this many
/// changes to backfill; below it the change stream is as quick.
pub const COPY_MIN_CHANGES: u64 = 4 * crate::replica::PULL_BATCH_CHANGES as u64;
/// Records are sent in chunks of about this many bytes.
pub const COPY_CHUNK_BYTES: usize = 1024 * 1024;
/// A record's value at least this long (a file's chunk) is sent as it is, not copied into
/// a chunk: the copy cost the source CPU that the foreground wanted (perf: the frame
/// encoder's `memcpy` and its fresh pages were a third of the export thread's time).
pub const COPY_UNCOPIED_BYTES: usize = 64 * 1024;
/// Chunks queued between the network and the ingest (and between the export and the network).
const COPY_QUEUE_CHUNKS: usize = 8;
/// A copy whose source sends nothing for this long fails (and falls back to the stream).
pub const COPY_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// A received chunk waits at most this long for the budget before it goes to its ingest.
/// Stream copies take from the same bucket (`Copies::pace_stream`), a whole pull answer at a
/// time, so at a low `rebalance_mb_per_s` the bucket can be booked far ahead; a copy that
/// waited all of that would read nothing for longer than its source's `COPY_IDLE_TIMEOUT`,
/// and the source would close it. Half of it leaves the socket's buffers the rest.
pub const PUMP_WAIT_MAX: Duration = Duration::from_secs(COPY_IDLE_TIMEOUT.as_secs() / 2);
/// A copy waits at most this long for the partition states here to follow the map that
/// made this node a copy (then it tries anyway, and fails to the stream if still dead).
pub const COPY_MAP_WAIT: Duration = Duration::from_secs(10);

/// What an export hands to the connection that carries it: bytes of the copy stream, or a
/// chunk of a file that the connection sends as it stands on disk (`sendfile`), the value
/// of the record whose head came just before.
#[derive(Debug)]
pub enum Outgoing {
    Bytes(Bytes),
    File { file: Arc<std::fs::File>, offset: u64, len: usize },
}

impl Outgoing {
    pub fn len(&self) -> usize {
        match self {
            Outgoing::Bytes(b) => b.len(),
            Outgoing::File { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What a replica asks of the active: an export of `partition`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ExportRequest {
    pub from: NodeId,
    pub partition: u16,
    /// The receiver takes the keyspace's files (else records).
    pub files: bool,
}

/// How a copy is built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CopyMethod {
    /// A backfill from the active's change stream: small partitions, copies that hold data
    /// already, and the fallback of a failed file copy.
    #[default]
    Stream,
    /// A snapshot of the partition's tables, shipped as files (or records) and adopted whole.
    Files,
}

/// Where one copy being built here is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CopyState {
    /// A file copy waiting for a slot (`rebalance_moves_per_node`).
    #[default]
    Queued,
    /// A file copy receiving.
    Copying,
    /// A stream copy backfilling, before its first snapshot's end.
    Streaming,
    /// Whole (a stream copy past its first snapshot).
    Done,
    /// A file copy that failed: the stream takes over.
    Failed,
}

/// How a file copy's snapshot was shipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Shipped {
    /// The keyspace's own files, adopted whole.
    Files,
    /// Its records (the fallback when the files cannot be taken).
    Records,
}

/// How one copy being built here goes (shown in the rebalance's progress).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyProgress {
    pub method: CopyMethod,
    /// A stream copy's total is not known ahead: it is what arrived so far.
    pub bytes_total: u64,
    pub bytes_done: u64,
    pub state: CopyState,
    /// When the copy started receiving and when it was whole, in milliseconds since the
    /// Unix epoch on this node's clock (for the rate over all copies).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_unix_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_unix_ms: Option<u64>,
    /// A file copy's snapshot, once its header arrived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shipped: Option<Shipped>,
    /// Analytics rows taken with a file copy from the source's shadow (`shadow_move`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub analytics_rows: Option<u64>,
}

impl CopyProgress {
    /// A file copy queued or under way: the partition is pending here, not a replica yet.
    pub fn is_building(&self) -> bool {
        matches!(self.state, CopyState::Copying | CopyState::Queued)
    }
}

/// This node's file copies: which partitions are being built, their progress, the
/// concurrency limit, and the pacing of exports it serves.
#[derive(Default)]
pub struct Copies {
    building: Mutex<BTreeMap<u16, CopyProgress>>,
    /// Partitions whose file copy failed: they backfill from the change stream instead.
    streamed: Mutex<std::collections::BTreeSet<u16>>,
    /// Copies under way of partitions the map no longer keeps here: each stops at its next
    /// chunk. Its ingest holds the partition's lock until it ends, and the map's drop of the
    /// partition waits for that lock: a paced copy left to finish held the map's application
    /// (and every map after it) for as long as its bytes took.
    cancelled: Mutex<std::collections::BTreeSet<u16>>,
    /// When the next exported chunk may leave (the bandwidth budget).
    pace: Mutex<Option<Instant>>,
    /// When the next received chunk may go to its ingest (the elastic budget alone).
    pace_in: Mutex<Option<Instant>>,
    /// The rate copies may move at while requests wait for cores, as measured here.
    pub(crate) elastic: Arc<Elastic>,
    /// Copies waiting for a slot (`rebalance_moves_per_node` run at once): partition, the
    /// active to copy from and its address.
    queue: Mutex<std::collections::VecDeque<(u16, NodeId, String)>>,
    /// Every copy backfills from the change stream (`ClusterConfig::copy_by_stream`).
    stream_only: bool,
    /// Copies ask for records, not files (`ClusterConfig::copy_by_records`).
    by_records: bool,
    /// Copies by files leave the partition's analytics rows to the stream
    /// (`ClusterConfig::analytics_by_stream`).
    analytics_by_stream: bool,
}

impl Copies {
    /// Whether copies here are built from the change streams only (`--copy-by-stream`; index
    /// partitions too: the benchmark's comparison).
    pub(crate) fn stream_only(&self) -> bool {
        self.stream_only
    }

    pub(crate) fn new(stream_only: bool, by_records: bool, unpaced: bool) -> Copies {
        let elastic = if unpaced { Elastic::off() } else { Elastic::start() };
        Copies { stream_only, by_records, elastic, ..Copies::default() }
    }

    /// Copies by files leave the analytics rows to the stream (the benchmark's comparison).
    pub(crate) fn with_analytics_by_stream(mut self, by_stream: bool) -> Copies {
        self.analytics_by_stream = by_stream;
        self
    }

    /// Whether partition `p` is being built from files here, or waits to be (its parts are
    /// not pulled meanwhile).
    pub fn is_building(&self, p: u16) -> bool {
        self.building.lock().get(&p).is_some_and(CopyProgress::is_building)
    }

    pub fn progress(&self) -> Vec<(u16, CopyProgress)> {
        self.building.lock().iter().map(|(p, c)| (*p, c.clone())).collect()
    }

    /// Forgets the copies of partitions this node holds as a replica no more (they became
    /// active, or went away): what the next rebalance shows is its own.
    pub(crate) fn retain_replicas(&self, replica: impl Fn(u16) -> bool) {
        let mut cancelled = self.cancelled.lock();
        self.building.lock().retain(|p, c| {
            let copying = c.state == CopyState::Copying;
            if copying && !replica(*p) {
                cancelled.insert(*p);
            }
            copying || replica(*p)
        });
        self.streamed.lock().retain(|p| replica(*p));
        self.queue.lock().retain(|(p, _, _)| replica(*p));
    }

    /// Whether the copy of partition `p` under way was cancelled (see `cancelled`).
    fn is_cancelled(&self, p: u16) -> bool {
        self.cancelled.lock().contains(&p)
    }

    /// Whether partition `p` may still be built from files here.
    pub(crate) fn may_copy(&self, p: u16) -> bool {
        !self.stream_only && !self.streamed.lock().contains(&p) && !self.is_building(p)
    }

    /// A copy backfilling from the change stream received `bytes` (keys and values) for
    /// partition `p`; `done` once it reached its snapshot's end. A file copy's own catch-up
    /// is not counted (its bytes came as files); a failed one is a stream copy from here on,
    /// and its progress says so.
    pub(crate) fn add_stream_bytes(&self, p: u16, bytes: u64, done: bool) {
        let mut building = self.building.lock();
        let streaming = || CopyProgress { method: CopyMethod::Stream, state: CopyState::Streaming, ..CopyProgress::default() };
        let c = building.entry(p).or_insert_with(streaming);
        match (c.method, c.state) {
            (_, CopyState::Failed) => *c = streaming(),
            (CopyMethod::Files, _) => return,
            (CopyMethod::Stream, _) => {}
        }
        metrics::counter!("shoal_rebalance_bytes_total", "method" => "stream").increment(bytes);
        c.bytes_done += bytes;
        c.bytes_total = c.bytes_total.max(c.bytes_done);
        c.started_unix_ms.get_or_insert_with(crate::failover::unix_ms);
        if done {
            c.state = CopyState::Done;
            c.finished_unix_ms = Some(crate::failover::unix_ms());
        }
    }

    fn running(&self) -> usize {
        self.building.lock().values().filter(|c| c.state == CopyState::Copying).count()
    }

    fn set(&self, p: u16, f: impl FnOnce(&mut CopyProgress)) {
        f(self.building.lock().entry(p).or_default());
    }

    /// How long an export of `bytes` waits before it leaves: the exports of this node move
    /// at most the elastic budget, and `mb_per_s` (the setting; 0: no limit).
    fn pace(&self, bytes: usize, mb_per_s: u32) -> Duration {
        wait_for(&self.pace, bytes, self.budget(mb_per_s))
    }

    /// The lower of the elastic budget and `mb_per_s` (the setting; 0: no limit), in MB/s;
    /// 0 for no limit at all.
    fn budget(&self, mb_per_s: u32) -> f64 {
        let setting = (mb_per_s > 0).then(|| f64::from(mb_per_s));
        [self.elastic.limit(), setting].into_iter().flatten().reduce(f64::min).unwrap_or(0.0)
    }

    /// How long a received chunk of `bytes` waits before it goes to its ingest: the copies
    /// into this node move at most its elastic budget (a receiver's probe sees its own cores).
    fn pace_in(&self, bytes: usize) -> Duration {
        wait_for(&self.pace_in, bytes, self.elastic.limit().unwrap_or(0.0))
    }

    /// How long a received chunk of `bytes` waits before it goes to its ingest: its turn in
    /// the budget, at most `PUMP_WAIT_MAX`.
    fn pump_wait(&self, bytes: usize) -> Duration {
        self.pace_in(bytes).min(PUMP_WAIT_MAX)
    }

    /// How long new copies built from the change stream wait after taking `bytes`: at most
    /// the lower of the elastic budget and `mb_per_s` (the setting; 0: no limit), in the
    /// same bucket as the file copies into this node (a stream copy has no export to pace).
    pub(crate) fn pace_stream(&self, bytes: usize, mb_per_s: u32) -> Duration {
        if bytes == 0 {
            return Duration::ZERO;
        }
        wait_for(&self.pace_in, bytes, self.budget(mb_per_s))
    }
}

/// What a node reports of its copies (positions in a rebalance's progress, seqnos in a
/// failover's fence): every copy's but those still being built from files (queued or
/// copying), which are not replicas yet. One filter for both, so that no copy is taken for
/// caught up by one and offered for promotion by the other.
pub(crate) fn without_building<P>(
    copies: &[(PartitionId, CopyProgress)],
    reported: impl IntoIterator<Item = (PartitionId, P)>,
) -> Vec<(PartitionId, P)> {
    reported.into_iter().filter(|(p, _)| !copies.iter().any(|(q, c)| q == p && c.is_building())).collect()
}

/// A token bucket of one slot: `bytes` at `mb_per_s` (0 or less: no limit) start when the
/// last ones have had their time, and the caller waits the answer.
fn wait_for(next: &Mutex<Option<Instant>>, bytes: usize, mb_per_s: f64) -> Duration {
    if mb_per_s <= 0.0 {
        return Duration::ZERO;
    }
    let cost = Duration::from_secs_f64(bytes as f64 / (mb_per_s * 1_000_000.0));
    let now = Instant::now();
    let mut next = next.lock();
    let start = next.map_or(now, |n| n.max(now));
    *next = Some(start + cost);
    start - now
}

/// Which of the partitions in a pull answer should be built from files: the copy here is
/// empty (every part this node asked for is at seqno 0), it is not already being built
/// and has not failed before, and some part has at least `COPY_MIN_CHANGES` to backfill.
/// `asked` is (partition, seqno) per part asked; `backlog` (partition, the active's high seqno).
pub(crate) fn choose(copies: &Copies, asked: &[(u16, u64)], backlog: &[(u16, u64)]) -> Vec<u16> {
    let mut chosen: Vec<u16> = backlog
        .iter()
        .filter(|(_, high)| *high >= COPY_MIN_CHANGES)
        .map(|(p, _)| *p)
        .filter(|p| asked.iter().filter(|(q, _)| q == p).all(|(_, seqno)| *seqno == 0))
        .filter(|p| copies.may_copy(*p))
        .collect();
    chosen.sort_unstable();
    chosen.dedup();
    chosen
}

/// Queues copies by files of `partitions` from `source`, and starts as many as the
/// concurrency budget allows.
pub(crate) fn enqueue(node: &Arc<ClusterNode>, source: NodeId, address: &str, partitions: &[u16]) {
    for &p in partitions {
        node.copies.set(p, |c| *c = CopyProgress { method: CopyMethod::Files, state: CopyState::Queued, ..CopyProgress::default() });
        node.copies.queue.lock().push_back((p, source, address.to_string()));
    }
    start_queued(node);
}

/// How many times `rebalance_moves_per_node` copies a node that serves nothing yet builds at
/// once (DESIGN.md: "a concurrency budget, larger towards an empty node"). Such a node — the
/// active of no partition, as a node that joined is until its first moves are handed over —
/// has no requests of its own to protect, so it takes more of its copies in parallel, as
/// Couchbase's rebalance batches more moves towards an empty node; the bandwidth and elastic
/// budgets still bound the bytes.
pub const EMPTY_NODE_COPIES_FACTOR: u32 = 2;

/// Copies a node builds at once: `moves_per_node` (the setting), or
/// [`EMPTY_NODE_COPIES_FACTOR`] times it, within the setting's own bound, on a node that is
/// the active of no partition (`serves_nothing`). Always at least one.
pub fn copy_slots(moves_per_node: u32, serves_nothing: bool) -> usize {
    let slots = if serves_nothing {
        moves_per_node.saturating_mul(EMPTY_NODE_COPIES_FACTOR).min(shoal_meta::state::REBALANCE_MOVES_PER_NODE_MAX).max(moves_per_node)
    } else {
        moves_per_node
    };
    usize::try_from(slots).unwrap_or(usize::MAX).max(1)
}

/// Starts queued copies while fewer than [`copy_slots`] run. A queued copy whose partition
/// this node no longer follows from that source is dropped (the pulls take over).
fn start_queued(node: &Arc<ClusterNode>) {
    loop {
        let state = node.state();
        let me = node.id;
        let serves_nothing = state.map.as_ref().is_some_and(|m| m.partitions.iter().all(|c| c.active != me));
        if node.copies.running() >= copy_slots(state.settings.rebalance_moves_per_node, serves_nothing) {
            return;
        }
        let Some((p, source, address)) = node.copies.queue.lock().pop_front() else { return };
        let still = state
            .map
            .as_ref()
            .and_then(|m| m.partitions.get(usize::from(p)))
            .is_some_and(|c| c.active == source && c.replicas.contains(&me));
        if !still {
            node.copies.building.lock().remove(&p);
            continue;
        }
        start(node, source, address, p, state.map_version());
    }
}

/// Builds this node's copy of partition `p` from `source`'s export, in the background; when
/// it ends (either way), the partition follows the map again and the next queued copy starts.
/// `map_version` is the map that made this node a copy of `p`.
fn start(node: &Arc<ClusterNode>, source: NodeId, address: String, p: u16, map_version: u64) {
    node.copies.set(p, |c| {
        c.state = CopyState::Copying;
        c.started_unix_ms = Some(crate::failover::unix_ms());
    });
    let node = Arc::clone(node);
    tokio::spawn(async move {
        let started = Instant::now();
        let outcome = copy(&node, &address, p, map_version).await;
        node.copies.cancelled.lock().remove(&p);
        match &outcome {
            Ok((stats, phases)) => {
                let secs = started.elapsed().as_secs_f64();
                tracing::info!(
                    partition = p,
                    source = source.0,
                    phases_ms = %phases.summary(),
                    records = stats.records,
                    bytes = stats.bytes,
                    mb_per_s = stats.bytes as f64 / 1e6 / secs.max(1e-9),
                    "partition copied from files"
                );
                node.copies.set(p, |c| {
                    c.state = CopyState::Done;
                    c.bytes_done = stats.bytes;
                    c.bytes_total = stats.bytes;
                    c.finished_unix_ms = Some(crate::failover::unix_ms());
                });
                metrics::counter!("shoal_rebalance_bytes_total", "method" => "files").increment(stats.bytes);
            }
            Err(e) => {
                tracing::warn!(partition = p, source = source.0, error = %e, "copy from files failed; the change stream backfills instead");
                node.copies.streamed.lock().insert(p);
                node.copies.set(p, |c| {
                    c.state = CopyState::Failed;
                    c.method = CopyMethod::Stream;
                    c.started_unix_ms = None;
                });
                // Whatever was ingested goes: the stream starts from an empty copy.
                let store = Arc::clone(node.engine.store());
                if let Ok(Err(e)) = blocking(move || store.drop_partition(p)).await {
                    tracing::warn!(partition = p, error = %e, "dropping a failed copy");
                }
            }
        }
        let applying = Instant::now();
        if let Err(e) = node.apply_current_map().await {
            tracing::warn!(partition = p, error = %e, "applying the map after a copy");
        }
        tracing::debug!(partition = p, ms = applying.elapsed().as_millis(), "the map applied after a copy");
        start_queued(&node);
    });
}

/// One copy: pending, export → ingest, then a replica. The pulls can see the map that
/// made this node a copy of `p` (`map_version`) before the partition states here follow
/// it: the copy waits for them (else it would find the partition still dead here, fail,
/// and leave it to the unpaced change stream).
async fn copy(node: &Arc<ClusterNode>, address: &str, p: u16, map_version: u64) -> Result<(IngestStats, Phases), ClusterError> {
    let mut phases = Phases::start();
    // While the copy runs no shadow here drops or follows the partition: its rows come
    // with it.
    let shadows = Arc::clone(node.engine.shadows());
    let incoming = (shadows.partitions() > 0 && !node.copies.analytics_by_stream).then(|| shadows.incoming(p));
    if !node.copy_states.wait_follows(map_version, COPY_MAP_WAIT).await {
        tracing::warn!(partition = p, map_version, "the partition states here do not follow the map yet");
    }
    let store = Arc::clone(node.engine.store());
    blocking(move || match store.partition_state(p)? {
        PartitionState::Replica => store.set_partition_state(p, PartitionState::Pending),
        PartitionState::Pending => Ok(()),
        state => Err(PartitionError::Malformed(format!("partition {p} is {state} here"))),
    })
    .await?
    .map_err(|e| ClusterError::Storage(e.to_string()))?;
    phases.mark(Phase::Pending);
    // The partition's analytics rows, asked before its export so that their position is
    // at or below the export's snapshot (`shadow_move`); without them (the source keeps
    // no shadow, or they failed to come) the shadow builds the partition from the stream.
    let shadow_rows = match &incoming {
        Some(_) => match crate::shadow_move::fetch(node, address, p).await {
            Ok(rows) => Some(rows),
            Err(e) => {
                tracing::info!(partition = p, error = %e, "analytics rows not moved with the copy; the shadow builds them from the stream");
                None
            }
        },
        None => None,
    };
    phases.mark(Phase::Shadow);
    let request = crate::wire::encode(&ExportRequest { from: node.id, partition: p, files: !node.copies.by_records });
    let mut stream = node.peers.stream(address, Op::Export, request, COPY_IDLE_TIMEOUT).await?;
    let mut decoder = FrameDecoder::default();
    // Counted as the pump counts: a small copy can arrive whole in its first chunk.
    let header = read_header(&mut stream, &mut decoder, |bytes| node.copies.set(p, |c| c.bytes_done += bytes)).await?;
    if header.export.partition != p {
        return Err(ClusterError::BadMessage(format!("asked for partition {p}, got {}", header.export.partition)));
    }
    phases.mark(Phase::Header);
    let files = header.files.clone();
    node.copies.set(p, |c| {
        c.bytes_total = header.bytes_estimate;
        c.shipped = Some(if files.is_some() { Shipped::Files } else { Shipped::Records });
    });
    // The records are decoded on the ingest's thread, below the foreground's priority; the
    // runtime's threads (which serve requests) only move the chunks.
    let (tx, rx) = mpsc::channel::<Result<Bytes, PartitionError>>(COPY_QUEUE_CHUNKS);
    let store = Arc::clone(node.engine.store());
    let export = header.export.clone();
    let ingest = background("shoal-ingest", move || {
        let records = Records::new(rx, decoder);
        match files {
            Some(manifest) => store.import_partition_files(&export, &manifest, records),
            None => store.ingest_partition(&export, records),
        }
    })?;
    let copying = node.copies.elastic.copying();
    let pumped = pump(node, p, &mut stream, &tx).await;
    drop(copying);
    phases.mark(Phase::Received);
    if let Err(e) = &pumped {
        // The ingest must not finish on a part of the copy.
        let _ = tx.send(Err(PartitionError::Malformed(e.to_string()))).await;
    }
    drop(tx);
    let ingested = ingest.await.map_err(|_| ClusterError::Storage("the ingest thread died".into()))?;
    pumped?;
    let stats = ingested.map_err(|e| ClusterError::Storage(e.to_string()))?;
    phases.mark(Phase::Adopted);
    if let Some(rows) = shadow_rows {
        let n = Arc::clone(node);
        match blocking(move || crate::shadow_move::adopt(&n, p, rows)).await? {
            Ok(adopted) => node.copies.set(p, |c| c.analytics_rows = Some(adopted)),
            // Its rows of the partition are then built from the stream (a half-adopted
            // partition is applied from the start: its rows are replaced as they come).
            Err(e) => tracing::warn!(partition = p, error = %e, "adopting moved analytics rows"),
        }
    }
    // A replica now, at the export's positions: the pulls take it from there.
    let store = Arc::clone(node.engine.store());
    blocking(move || store.set_partition_state(p, PartitionState::Replica)).await?.map_err(|e| ClusterError::Storage(e.to_string()))?;
    phases.mark(Phase::Replica);
    drop(incoming);
    Ok((stats, phases))
}

/// The steps of one copy, in order, whose ends [`Phases`] times (logged with each copy, so
/// that a slow copy says where its time went).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    /// The node's partition states follow the map, and the copy is pending here.
    Pending,
    /// The partition's analytics rows arrived (or were given up on).
    Shadow,
    /// The source's header arrived: its snapshot is taken.
    Header,
    /// The last chunk arrived and was handed to the import.
    Received,
    /// The import finished: files fsynced and adopted (or records ingested).
    Adopted,
    /// The copy is a replica, durably.
    Replica,
}

/// Milliseconds from a copy's start to the end of each [`Phase`] it reached.
struct Phases {
    started: Instant,
    ends: Vec<(Phase, u64)>,
}

impl Phases {
    fn start() -> Phases {
        Phases { started: Instant::now(), ends: Vec::with_capacity(5) }
    }

    fn mark(&mut self, phase: Phase) {
        debug_assert!(self.ends.last().is_none_or(|(last, _)| *last < phase), "phases end in order");
        self.ends.push((phase, u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)));
    }

    /// Each phase's own milliseconds, e.g. `pending=3 header=12 received=200 adopted=30 replica=4`.
    fn summary(&self) -> String {
        let mut last = 0;
        let mut out = String::new();
        for (phase, end) in &self.ends {
            if !out.is_empty() {
                out.push(' ');
            }
            out.push_str(&format!("{}={}", format!("{phase:?}").to_lowercase(), end.saturating_sub(last)));
            last = *end;
        }
        out
    }
}

/// Runs `work` on a thread of its own at the idle priority
/// (`shoal_storage::threads::idle_this_thread`: the scheduler gives the cores to requests
/// first, so a copy takes what they leave — "foreground requests first", issue 14) and
/// answers its result. Not the runtime's blocking pool: those threads are reused, and a
/// thread's priority once lowered cannot be raised again without privileges.
pub(crate) fn background<T: Send + 'static>(
    name: &str,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<tokio::sync::oneshot::Receiver<T>, ClusterError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            shoal_storage::threads::idle_this_thread();
            let _ = tx.send(work());
        })
        .map_err(|e| ClusterError::Storage(format!("cannot start a copy thread: {e}")))?;
    Ok(rx)
}

/// Moves the copy's chunks from the network to the ingest until the stream ends (the
/// ingest checks that it ended with the end marker).
async fn pump(
    node: &ClusterNode,
    p: u16,
    stream: &mut ChunkStream,
    tx: &mpsc::Sender<Result<Bytes, PartitionError>>,
) -> Result<(), ClusterError> {
    while let Some(chunk) = next_chunk(stream).await? {
        let bytes = chunk.len() as u64;
        let wait = node.copies.pump_wait(chunk.len());
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        if node.copies.is_cancelled(p) {
            return Err(ClusterError::Refused(format!("the map no longer keeps partition {p} here; its copy stops")));
        }
        if tx.send(Ok(chunk)).await.is_err() {
            // The ingest stopped (it refused a record): its error says why.
            return Ok(());
        }
        node.copies.set(p, |c| c.bytes_done += bytes);
    }
    Ok(())
}

/// Reads a copy stream's header, pushing the chunks it came in into `decoder` (the records
/// after it stay there); `received` is told each chunk's length.
pub(crate) async fn read_header(
    stream: &mut ChunkStream,
    decoder: &mut FrameDecoder,
    received: impl Fn(u64),
) -> Result<CopyHeader, ClusterError> {
    loop {
        match decoder.next_frame().map_err(bad)? {
            Some(Frame::Header(h)) => return Ok(h),
            Some(_) => return Err(ClusterError::BadMessage("a copy without its header".into())),
            None => match next_chunk(stream).await? {
                Some(chunk) => {
                    received(chunk.len() as u64);
                    decoder.push_bytes(chunk);
                }
                None => return Err(bad(FrameError::Truncated)),
            },
        }
    }
}

pub(crate) async fn next_chunk(stream: &mut ChunkStream) -> Result<Option<Bytes>, ClusterError> {
    match tokio::time::timeout(COPY_IDLE_TIMEOUT, stream.next()).await {
        Err(_) => Err(ClusterError::Timeout(format!("the copy's source sent nothing for {COPY_IDLE_TIMEOUT:?}"))),
        Ok(None) => Ok(None),
        Ok(Some(chunk)) => Ok(Some(chunk?)),
    }
}

fn bad(e: FrameError) -> ClusterError {
    ClusterError::BadMessage(e.to_string())
}

/// The records of the copy as the ingest reads them, decoded from the chunks the network
/// side passes on (blocking on it). A stream that ends without its end marker, or with
/// anything after it, is an error: the ingest must not finish on part of a copy.
pub(crate) struct Records {
    rx: mpsc::Receiver<Result<Bytes, PartitionError>>,
    decoder: FrameDecoder,
    done: bool,
}

impl Records {
    /// The records of a copy whose header `decoder` has read, the rest of its chunks
    /// coming on `rx`.
    pub(crate) fn new(rx: mpsc::Receiver<Result<Bytes, PartitionError>>, decoder: FrameDecoder) -> Records {
        Records { rx, decoder, done: false }
    }
}

impl Iterator for Records {
    type Item = Result<(Bytes, Bytes), PartitionError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let malformed = |e: FrameError| PartitionError::Malformed(e.to_string());
        loop {
            let failed = match self.decoder.next_frame() {
                Ok(Some(Frame::Record(k, v))) => return Some(Ok((k, v))),
                Ok(Some(Frame::End) | None) => None,
                Ok(Some(Frame::Header(_))) => Some(PartitionError::Malformed("a second header".into())),
                Err(e) => Some(malformed(e)),
            };
            let next = match failed {
                Some(e) => Some(Err(e)),
                None => self.rx.blocking_recv(),
            };
            match next {
                Some(Ok(chunk)) => self.decoder.push_bytes(chunk),
                Some(Err(e)) => {
                    self.done = true;
                    return Some(Err(e));
                }
                None => {
                    self.done = true;
                    return self.decoder.finish().err().map(|e| Err(malformed(e)));
                }
            }
        }
    }
}

/// Copies sent one after another in one stream (a group of index partitions from one
/// source, `index_moves`), read as the import asks (blocking on the network side's chunks):
/// each copy's header, then its records up to its end; after the last, the stream must
/// end. A stream that ends early, or carries anything after the last copy, is an error.
pub(crate) struct ChainedCopies {
    rx: mpsc::Receiver<Result<Bytes, PartitionError>>,
    decoder: FrameDecoder,
    /// Headers read.
    copies: usize,
}

impl ChainedCopies {
    pub(crate) fn new(rx: mpsc::Receiver<Result<Bytes, PartitionError>>) -> ChainedCopies {
        ChainedCopies { rx, decoder: FrameDecoder::chained(), copies: 0 }
    }

    /// The next chunk, into the decoder; the stream's end here is a cut copy.
    fn pull(&mut self) -> Result<(), PartitionError> {
        match self.rx.blocking_recv() {
            Some(Ok(chunk)) => {
                self.decoder.push_bytes(chunk);
                Ok(())
            }
            Some(Err(e)) => Err(e),
            None => Err(malformed(FrameError::Truncated)),
        }
    }

    /// The next copy's header (the one before read to its end).
    pub(crate) fn header(&mut self) -> Result<CopyHeader, PartitionError> {
        if self.copies > 0 {
            self.decoder.next_copy().map_err(malformed)?;
        }
        loop {
            match self.decoder.next_frame().map_err(malformed)? {
                Some(Frame::Header(h)) => {
                    self.copies += 1;
                    return Ok(h);
                }
                Some(_) => return Err(PartitionError::Malformed("a copy without its header".into())),
                None => self.pull()?,
            }
        }
    }

    /// This copy's records, up to its end (an error if the stream ends first).
    pub(crate) fn records(&mut self) -> impl Iterator<Item = Result<(Bytes, Bytes), PartitionError>> + '_ {
        let mut done = false;
        std::iter::from_fn(move || {
            if done {
                return None;
            }
            loop {
                let next = match self.decoder.next_frame() {
                    Ok(Some(Frame::Record(k, v))) => return Some(Ok((k, v))),
                    Ok(Some(Frame::End)) => None,
                    Ok(Some(Frame::Header(_))) => Some(Err(PartitionError::Malformed("a second header".into()))),
                    Ok(None) => match self.pull() {
                        Ok(()) => continue,
                        Err(e) => Some(Err(e)),
                    },
                    Err(e) => Some(Err(malformed(e))),
                };
                done = true;
                return next;
            }
        })
    }

    /// After the last copy: the stream ends, with nothing after it.
    pub(crate) fn finish(mut self) -> Result<(), PartitionError> {
        loop {
            match self.rx.blocking_recv() {
                Some(Ok(chunk)) => self.decoder.push_bytes(chunk),
                Some(Err(e)) => return Err(e),
                None => return self.decoder.finish().map_err(malformed),
            }
        }
    }
}

fn malformed(e: FrameError) -> PartitionError {
    PartitionError::Malformed(e.to_string())
}

/// An export's pieces, of either shape (files or records).
pub(crate) type ExportRecords = dyn Iterator<Item = Result<FilePiece, PartitionError>> + Send;

/// The active's side: an export of the partition, as chunks of the copy stream. Only a
/// member the map names as a replica of a partition this node is active for gets one.
///
/// Only that check runs on the caller's (the runtime's) thread. The export itself, even
/// taking its snapshot (which copies and hashes the memtables' items), runs on the copy's
/// thread below the foreground's priority: on a runtime thread it held a worker for
/// milliseconds per move, and every request queued behind it waited (seen as the
/// foreground's p99 during a rebalance).
pub(crate) fn serve_export(node: &Arc<ClusterNode>, body: &[u8]) -> Result<mpsc::Receiver<Result<Outgoing, ClusterError>>, ClusterError> {
    let req: ExportRequest = crate::wire::decode(body).map_err(ClusterError::BadMessage)?;
    check_exporter(node, req.from, req.partition)?;
    let (tx, rx) = mpsc::channel(COPY_QUEUE_CHUNKS);
    let node = Arc::clone(node);
    // The receiver sees a broken stream if this thread cannot start or dies.
    let asked = Instant::now();
    background("shoal-export", move || {
        let _copying = node.copies.elastic.copying();
        let began = asked.elapsed();
        let (header, export) = match export_of(node.engine.store(), &req) {
            Ok(export) => export,
            Err(e) => {
                // The receiver sees an error, never a header: it keeps nothing.
                let _ = tx.blocking_send(Err(e));
                return;
            }
        };
        tracing::debug!(
            partition = req.partition,
            thread_ms = began.as_millis(),
            snapshot_ms = asked.elapsed().saturating_sub(began).as_millis(),
            "an export's snapshot is taken"
        );
        send_export(&node, &tx, &header, export);
    })?;
    Ok(rx)
}

/// Refuses an export of `partition` unless this node is its active and `from` one of its
/// replicas in the map here.
pub(crate) fn check_exporter(node: &ClusterNode, from: NodeId, partition: u16) -> Result<(), ClusterError> {
    let state = node.state();
    let map = state.map.as_ref().ok_or_else(|| ClusterError::Refused("no partition map yet".into()))?;
    let copies = map.partitions.get(usize::from(partition)).ok_or_else(|| ClusterError::BadMessage(format!("no partition {partition}")))?;
    if copies.active != node.id || !copies.replicas.contains(&from) {
        return Err(ClusterError::Refused(format!(
            "not the active of partition {partition} for node {from} at map version {}",
            map.version
        )));
    }
    Ok(())
}

/// Sends an export as the copy stream's chunks on `tx` (on the export's thread): the
/// header, its pieces, the end marker, paced by the rebalance's budget. Stops when the
/// receiver goes away; an error reaches the receiver in place of the end marker. Answers
/// whether the whole copy went out, its end marker included.
pub(crate) fn send_export(
    node: &ClusterNode,
    tx: &mpsc::Sender<Result<Outgoing, ClusterError>>,
    header: &CopyHeader,
    export: Box<ExportRecords>,
) -> bool {
    let mut out = BytesMut::with_capacity(COPY_CHUNK_BYTES + 64 * 1024);
    FrameEncoder::header(&mut out, header);
    let mut encoder = FrameEncoder::default();
    let send = |out: Outgoing| {
        let wait = node.copies.pace(out.len(), node.state().settings.rebalance_mb_per_s);
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
        tx.blocking_send(Ok(out)).is_ok()
    };
    let bytes = |b: &mut BytesMut| Outgoing::Bytes(b.split().freeze());
    for piece in export {
        // A file's chunk (from the file itself) or a long value goes out as it is, behind
        // its frame's head; shorter values and memtable items are framed into the chunk
        // being filled, sent once it is full.
        let apart = match piece {
            Ok(FilePiece::Chunk { key, file, offset, len }) => Some((key, Outgoing::File { file, offset, len })),
            Ok(FilePiece::Record(k, v)) if v.len() >= COPY_UNCOPIED_BYTES => Some((k, Outgoing::Bytes(v))),
            Ok(FilePiece::Record(k, v)) => {
                encoder.record(&mut out, &k, &v);
                None
            }
            Ok(FilePiece::Item(item)) => {
                FilePiece::frame_item(&mut encoder, &mut out, &item);
                None
            }
            Err(e) => {
                // The receiver sees an error, never an end marker: it keeps nothing.
                let _ = tx.blocking_send(Err(ClusterError::Storage(e.to_string())));
                return false;
            }
        };
        let Some((key, value)) = apart else {
            if out.len() >= COPY_CHUNK_BYTES && !send(bytes(&mut out)) {
                return false; // the receiver went away
            }
            continue;
        };
        encoder.record_head(&mut out, &key, value.len());
        if !send(bytes(&mut out)) || !send(value) {
            return false; // the receiver went away
        }
    }
    encoder.end(&mut out);
    send(bytes(&mut out))
}

/// The export the receiver asked for: the partition's files where it asked for them and
/// they can be sent, its records otherwise; with the copy's header.
fn export_of(store: &Store, req: &ExportRequest) -> Result<(CopyHeader, Box<ExportRecords>), ClusterError> {
    let files = if req.files {
        store
            .export_partition_files(req.partition)
            .map_err(|e| tracing::info!(partition = req.partition, error = %e, "sending records"))
            .ok()
    } else {
        None
    };
    Ok(match files {
        Some(mut files) => {
            let (manifest, header) = (files.manifest().clone(), files.header().clone());
            let bytes_estimate = manifest.file_bytes();
            let pieces = std::iter::from_fn(move || files.next_piece());
            (CopyHeader { export: header, bytes_estimate, files: Some(manifest) }, Box::new(pieces))
        }
        None => {
            let records = store.export_partition(req.partition).map_err(|e| ClusterError::Storage(e.to_string()))?;
            let header = CopyHeader { export: records.header().clone(), bytes_estimate: records.estimated_bytes(), files: None };
            (header, Box::new(records.map(|r| r.map(|(k, v)| FilePiece::Record(k, v)))))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stream copies booking the shared bucket far ahead (a big pull answer at a low
    /// setting) hold a received chunk for at most `PUMP_WAIT_MAX`, inside its source's idle
    /// timeout.
    #[test]
    fn a_received_chunk_waits_less_than_its_source_lets_it_be_idle() {
        let copies = Copies::default();
        assert!(copies.pace_stream(100 * 1_000_000, 1).is_zero(), "the first booking goes at once");
        let wait = copies.pump_wait(1_000_000);
        assert_eq!(wait, PUMP_WAIT_MAX, "the bucket is booked 100 s ahead");
        assert!(PUMP_WAIT_MAX < COPY_IDLE_TIMEOUT);
    }

    /// A node that serves nothing builds twice the setting's copies at once, within the
    /// setting's bound; any other, the setting; never none.
    #[test]
    fn an_empty_node_builds_more_copies_at_once() {
        let max = shoal_meta::state::REBALANCE_MOVES_PER_NODE_MAX;
        for (moves_per_node, serves_nothing, slots) in [
            (4, false, 4),
            (4, true, 8),
            (1, true, 2),
            (1, false, 1),
            (max / 2 + 1, true, max as usize),
            (max, true, max as usize),
            (max, false, max as usize),
            (0, false, 1),
            (0, true, 1),
            (u32::MAX, true, u32::MAX as usize),
        ] {
            assert_eq!(copy_slots(moves_per_node, serves_nothing), slots, "{moves_per_node} per node, serves nothing: {serves_nothing}");
        }
    }

    /// A copy under way of a partition the map no longer keeps here is cancelled (its pump
    /// stops at the next chunk); one the map still wants, or one merely queued, is not.
    #[test]
    fn a_copy_under_way_whose_partition_moves_away_is_cancelled() {
        let copies = Copies::default();
        for p in [1, 2, 3] {
            copies.set(p, |c| c.state = CopyState::Copying);
        }
        copies.set(4, |c| c.state = CopyState::Queued);
        // The map keeps 1 here, and moves 2, 3 and 4 away.
        copies.retain_replicas(|p| p == 1);
        assert!(!copies.is_cancelled(1), "still a copy here");
        assert!(copies.is_cancelled(2) && copies.is_cancelled(3), "moved away while copying");
        assert!(!copies.is_cancelled(4) && !copies.is_building(4), "a queued copy is forgotten, not cancelled");
        assert!(copies.is_building(2), "a cancelled copy shows until it ends");
    }

    /// The ingest's side of a copy: `chunks` (a stream cut anywhere) through `Records`.
    fn records_of(stream: &[u8], cut: usize) -> Vec<Result<(Bytes, Bytes), String>> {
        let mut decoder = FrameDecoder::default();
        let mut at = 0;
        // The header is read on the network side first, as `copy` does.
        loop {
            match decoder.next_frame().unwrap() {
                Some(Frame::Header(_)) => break,
                Some(f) => panic!("{f:?} before the header"),
                None => {
                    let end = (at + cut).min(stream.len());
                    decoder.push(&stream[at..end]);
                    at = end;
                }
            }
        }
        let (tx, rx) = mpsc::channel(COPY_QUEUE_CHUNKS);
        let rest: Vec<Bytes> = stream[at..].chunks(cut).map(Bytes::copy_from_slice).collect();
        std::thread::scope(|s| {
            s.spawn(move || {
                for chunk in rest {
                    tx.blocking_send(Ok(chunk)).unwrap();
                }
            });
            Records { rx, decoder, done: false }.map(|r| r.map_err(|e| e.to_string())).collect()
        })
    }

    #[test]
    fn the_ingest_decodes_whole_copies_and_refuses_cut_or_padded_ones() {
        let mut out = BytesMut::new();
        FrameEncoder::header(
            &mut out,
            &CopyHeader { export: shoal_storage::ExportHeader { partition: 1, collections: Vec::new() }, bytes_estimate: 0, files: None },
        );
        let mut encoder = FrameEncoder::default();
        for i in 0..50u32 {
            encoder.record(&mut out, format!("k{i}").as_bytes(), &[7u8; 300]);
        }
        let body = out.clone();
        encoder.end(&mut out);
        for cut in [1, 7, 64, 4096] {
            let got = records_of(&out, cut);
            assert_eq!(got.len(), 50, "cut {cut}");
            assert!(got.iter().all(Result::is_ok), "cut {cut}");
            assert_eq!(got[49].as_ref().unwrap().0, Bytes::from("k49"));
            let cut_off = records_of(&body, cut);
            assert!(cut_off.last().is_some_and(Result::is_err), "a copy without its end marker fails (cut {cut})");
            let mut padded = out.clone();
            padded.extend_from_slice(b"x");
            assert!(records_of(&padded, cut).last().is_some_and(Result::is_err), "bytes after the end fail (cut {cut})");
        }
    }

    #[test]
    fn only_empty_copies_with_a_backlog_are_chosen() {
        let copies = Copies::default();
        let asked = [(1, 0), (1, 0), (2, 5), (3, 0), (4, 0), (5, 0), (6, 0)];
        let backlog = [
            (1, COPY_MIN_CHANGES),
            (2, 10 * COPY_MIN_CHANGES),
            (3, COPY_MIN_CHANGES - 1),
            (4, COPY_MIN_CHANGES),
            (5, COPY_MIN_CHANGES),
            (6, COPY_MIN_CHANGES),
        ];
        assert_eq!(choose(&copies, &asked, &backlog), vec![1, 4, 5, 6], "2 holds data, 3 is small");
        copies.set(1, |c| c.state = CopyState::Copying);
        copies.set(6, |c| c.state = CopyState::Queued);
        copies.streamed.lock().insert(4);
        assert_eq!(choose(&copies, &asked, &backlog), vec![5], "one runs, one waits, one failed before");
        assert!(copies.is_building(6) && copies.is_building(1) && !copies.is_building(5));
        assert_eq!(
            choose(&Copies::new(true, false, true), &asked, &backlog),
            Vec::<u16>::new(),
            "a node told to copy by stream never copies files"
        );
    }

    #[test]
    fn pacing_spreads_chunks_over_the_budget() {
        let slot = Mutex::new(None);
        assert_eq!(wait_for(&slot, 1_000_000, 0.0), Duration::ZERO);
        let first = wait_for(&slot, 1_000_000, 10.0);
        let second = wait_for(&slot, 1_000_000, 10.0);
        assert!(first <= Duration::from_millis(5), "{first:?}");
        assert!(second >= Duration::from_millis(90) && second <= Duration::from_millis(100), "{second:?}");
    }

    #[test]
    fn exports_take_the_lower_of_the_setting_and_the_elastic_budget() {
        // The elastic budget starts at 4× its floor (64 MB/s): 64 MB take a second.
        let copies = Copies::default();
        copies.pace(64_000_000, 0);
        let elastic = copies.pace(1, 0);
        assert!(elastic >= Duration::from_millis(900) && elastic <= Duration::from_secs(1), "{elastic:?}");
        // A setting below it rules: 10 MB at 10 MB/s.
        let copies = Copies::default();
        copies.pace(10_000_000, 10);
        let setting = copies.pace(1, 10);
        assert!(setting >= Duration::from_millis(900) && setting <= Duration::from_secs(1), "{setting:?}");
        // Received chunks wait on the elastic budget, in a bucket of their own.
        assert!(copies.pace_in(1) <= Duration::from_millis(5));
        // Without the elastic budget, only the setting paces.
        let copies = Copies::new(false, false, true);
        copies.pace(64_000_000, 0);
        assert_eq!(copies.pace(1, 0), Duration::ZERO);
        copies.pace(10_000_000, 10);
        assert!(copies.pace(1, 10) >= Duration::from_millis(900));
        assert_eq!(copies.pace_in(64_000_000), Duration::ZERO);
    }
}
