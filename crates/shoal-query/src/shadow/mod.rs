//! The columnar shadow of every collection: what `/v1/analytics` reads.
//!
//! A collection's rows are split over *analytics partitions*: storage partition `p` feeds
//! analytics partition `p mod n`, and analytics partition `i` lives on data path
//! `i mod paths`. Each analytics partition keeps its rows as immutable Arrow record
//! batches (*segments*, at most [`SEGMENT_ROWS`] rows, typed from their own rows) and
//! open *buffers* of recent documents. Buffers are kept per value of [`GROUP_FIELD`], so a
//! segment holds one JSON "table" and a filter on that field skips whole segments.
//!
//! Changes come from the collection's change streams. An upsert marks the key's old row
//! dead and appends the document to a buffer; a delete or expiry marks it dead. A full
//! buffer becomes a segment, written as an Arrow IPC file; small or mostly dead segments
//! of a group are merged. A checkpoint turns every buffer into a segment and then writes
//! the manifest — segments, dead rows, change-stream positions — atomically (write,
//! fsync, rename). A restart loads the manifest's segments and follows the streams from
//! its positions: nothing is rebuilt. Segment files the manifest does not name are
//! leftovers of an interrupted checkpoint and are removed.
//!
//! A segment holds its rows in storage-partition order ([`sorted_by_partition`]): on a
//! cluster a member's shadow holds its replicas' rows beside its actives', and a scan's
//! mask of the partitions active here is then long runs a filter skips 64 rows at a time;
//! the mask itself is worked out once per segment and map ([`RowPartitions::active`]).
//!
//! A storage partition that leaves the node has its rows dropped; one that arrives by a
//! file copy brings its rows with it, cut from the sender's shadow (`transfer`).
//!
//! Segments are derived state and are checked like data: the manifest records each
//! segment file's checksum (XXH3-64), and a file is read with plain reads (an I/O error is
//! an error, never the SIGBUS a memory map would raise) and verified before it is decoded.
//! An analytics partition whose manifest or segments fail their checks is quarantined —
//! its files moved to `<shadow root>/quarantine/` for inspection — and rebuilt from the
//! change streams while the rest of the node serves.

mod ap;
mod maintain;
mod segment;
pub mod stats;
mod transfer;

use ap::*;
use maintain::*;
use segment::*;
pub use transfer::{decode_batch, encode_batch, IncomingGuard, PartitionRows, SHADOW_MOVE_MAX_BYTES};

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use datafusion::arrow::array::{BooleanArray, RecordBatch, StringArray};
use datafusion::arrow::buffer::BooleanBuffer;
use datafusion::arrow::datatypes::{Field, SchemaRef};
use datafusion::arrow::error::ArrowError;
use parking_lot::Mutex;
use shoal_storage::{ChangesError, Collection, PartitionId, SeqNo, Store, StreamPosition};
use tokio::sync::watch;

use crate::merge::merge_fields;

/// Most rows of one segment.
pub const SEGMENT_ROWS: usize = 32_768;
/// Most document text one buffer holds before it becomes a segment, and most data a merge
/// of segments produces: Arrow string columns hold at most 2 GiB.
pub const SEGMENT_BYTES_MAX: usize = 256 * 1024 * 1024;
/// The field whose string value groups rows into segments (one JSON "table" each).
pub const GROUP_FIELD: &str = "table_name";
/// Most groups buffered separately per analytics partition; rows of further groups share
/// the ungrouped buffer (and their segments are not skipped by group filters).
pub const GROUPS_MAX: usize = 64;
/// Longest time between checkpoints while there are changes.
pub const CHECKPOINT_INTERVAL: Duration = Duration::from_secs(5);
/// Changes read from one partition per step.
pub const APPLY_BATCH: usize = 4096;
/// Changes one analytics partition applies per round before it checks for a checkpoint.
pub const ROUND_CHANGES_MAX: usize = 32_768;
/// Most analytics partitions a node may be configured with.
pub const ANALYTICS_PARTITIONS_MAX: usize = 64;
/// Small segments (under half full) of one group that trigger a merge.
pub const COMPACT_MIN_SEGMENTS: usize = 4;
/// How often an idle maintainer looks for a due checkpoint.
const IDLE_POLL: Duration = Duration::from_secs(1);
/// Quiet time after which an analytics partition checkpoints early, so that scans after
/// a load read segments rather than converting buffers.
const QUIET_CHECKPOINT: Duration = Duration::from_millis(300);
/// 2: segments carry checksums (a version-1 manifest is rebuilt).
const MANIFEST_VERSION: u32 = 2;
const MANIFEST: &str = "manifest.json";
/// Where damaged analytics partitions go, under each shadow root.
const QUARANTINE_DIR: &str = "quarantine";

#[derive(Debug, thiserror::Error)]
pub enum ShadowError {
    #[error("analytics shadow I/O at {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("analytics shadow file {path} is damaged: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("analytics shadow: {0}")]
    Arrow(#[from] ArrowError),
    #[error(transparent)]
    Changes(#[from] ChangesError),
    #[error("the analytics shadow did not catch up within {0:?}")]
    Timeout(Duration),
    #[error("analytics is off on this node (started with --analytics-partitions 0)")]
    Off,
    #[error("collection {0} has no analytics shadow yet")]
    NotAttached(String),
    /// A partition that came to serve here (moved in, promoted, rolled back) is not yet
    /// whole in the shadow: reading it would miss rows.
    #[error("the analytics shadow is still catching up on partition {0}, which came to this node lately; try again")]
    CatchingUp(PartitionId),
}

fn io_at(path: &Path) -> impl FnOnce(std::io::Error) -> ShadowError + '_ {
    move |source| ShadowError::Io { path: path.to_path_buf(), source }
}

/// The default number of analytics partitions, as Couchbase chooses it:
/// min(cores, analytics memory in GiB, 16).
pub fn default_partitions(cores: usize, memory_bytes: u64) -> usize {
    let gib = usize::try_from(memory_bytes >> 30).unwrap_or(usize::MAX);
    cores.min(gib).clamp(1, 16)
}

/// One piece of an analytics partition a scan reads: a batch and, if some of its rows
/// are dead, which rows are live.
#[derive(Clone)]
pub struct Part {
    pub batch: RecordBatch,
    pub live: Option<BooleanArray>,
    /// Each row's storage partition, shared with its segment so that it is worked out
    /// once per segment (a distributed scan keeps only rows of partitions active here).
    pub partitions: RowPartitions,
}

/// Each row's storage partition of an immutable batch, and which rows are of partitions
/// active here as the last scan asked: both worked out once per batch, not per statement.
#[derive(Clone, Default)]
pub struct RowPartitions(Arc<RowPartitionsOf>);

#[derive(Default)]
struct RowPartitionsOf {
    /// The partition count they were worked out for, and each row's partition.
    ids: std::sync::OnceLock<(u16, Arc<[PartitionId]>)>,
    /// The flags of the last [`RowPartitions::active`] call (one per partition) and its rows.
    active: Mutex<Option<(Vec<bool>, BooleanBuffer)>>,
}

/// The storage partition (of `count`) of each key.
fn partitions_of_keys(keys: &StringArray, count: u16) -> Vec<PartitionId> {
    keys.iter().map(|k| shoal_storage::partition_of(k.unwrap_or("").as_bytes(), count)).collect()
}

impl RowPartitions {
    /// Partitions already worked out (a segment is written sorted by them).
    fn known(count: u16, ids: Arc<[PartitionId]>) -> RowPartitions {
        let of = RowPartitionsOf::default();
        let _ = of.ids.set((count, ids));
        RowPartitions(Arc::new(of))
    }

    /// The partition of each row of `batch` (whose key column is `key`), of `count`.
    pub fn of(&self, batch: &RecordBatch, count: u16) -> Result<Arc<[PartitionId]>, ShadowError> {
        if let Some((c, p)) = self.0.ids.get() {
            if *c == count && p.len() == batch.num_rows() {
                return Ok(Arc::clone(p));
            }
        }
        use datafusion::arrow::array::AsArray;
        let keys = batch
            .column_by_name(crate::schema::KEY_COLUMN)
            .and_then(|c| c.as_string_opt::<i32>())
            .ok_or_else(|| ShadowError::Arrow(ArrowError::SchemaError("a shadow segment without its key column".into())))?;
        let parts: Arc<[PartitionId]> = partitions_of_keys(keys, count).into();
        let _ = self.0.ids.set((count, Arc::clone(&parts)));
        Ok(parts)
    }

    /// Which rows of `batch` are of a partition `actives` flags (one flag per partition, of
    /// `actives.len()`). Remembered: the next statement under the same map asks the same.
    pub fn active(&self, batch: &RecordBatch, actives: &[bool]) -> Result<BooleanBuffer, ShadowError> {
        if let Some((flags, rows)) = &*self.0.active.lock() {
            if flags.as_slice() == actives && rows.len() == batch.num_rows() {
                return Ok(rows.clone());
            }
        }
        let count = u16::try_from(actives.len()).unwrap_or(u16::MAX);
        let ids = self.of(batch, count)?;
        let rows = BooleanBuffer::collect_bool(ids.len(), |i| actives.get(usize::from(ids[i])).copied().unwrap_or(false));
        *self.0.active.lock() = Some((actives.to_vec(), rows.clone()));
        Ok(rows)
    }
}

/// `batch` with its rows ordered by storage partition (of `count`; stable within one), and
/// those partitions. A segment is written so: the rows of one partition are a run, so a
/// scan's mask of the partitions active on its node is long runs of ones and zeros, and
/// its filters skip the replicas' runs 64 rows at a time instead of testing every row.
fn sorted_by_partition(batch: &RecordBatch, count: u16) -> Result<(RecordBatch, RowPartitions), ArrowError> {
    use datafusion::arrow::array::{AsArray, UInt32Array};
    let Some(keys) = batch.column_by_name(crate::schema::KEY_COLUMN).and_then(|c| c.as_string_opt::<i32>()) else {
        return Ok((batch.clone(), RowPartitions::default()));
    };
    let ids = partitions_of_keys(keys, count);
    if ids.is_sorted() {
        return Ok((batch.clone(), RowPartitions::known(count, ids.into())));
    }
    let mut order: Vec<u32> = (0..ids.len() as u32).collect();
    order.sort_by_key(|&row| ids[row as usize]);
    let sorted: Arc<[PartitionId]> = order.iter().map(|&row| ids[row as usize]).collect();
    let batch = datafusion::arrow::compute::take_record_batch(batch, &UInt32Array::from(order))?;
    debug_assert!(sorted.is_sorted(), "a segment's rows are in partition order");
    Ok((batch, RowPartitions::known(count, sorted)))
}

impl Part {
    pub fn rows(&self) -> usize {
        self.live.as_ref().map_or(self.batch.num_rows(), BooleanArray::true_count)
    }
}

/// A shadow's last column summary, by the live segments (analytics partition, id) it was
/// merged from.
type SummaryMemo = (Vec<(usize, u32)>, Arc<stats::TableSummary>);

/// The shadow of one collection.
pub struct Shadow {
    coll: Arc<Collection>,
    aps: Vec<Ap>,
    /// Per storage partition: the last seqno applied.
    applied: Vec<AtomicU64>,
    /// Bumped after every maintenance round.
    progress: watch::Sender<u64>,
    /// `<data path>/shadow/<collection id>` on each data path.
    roots: Vec<PathBuf>,
    /// Storage partitions being copied in with their rows (the manager's).
    incoming: Arc<transfer::Incoming>,
    /// The last [`Shadow::summary`], by the live segments it was merged from.
    summary: Mutex<Option<SummaryMemo>>,
}

impl Shadow {
    pub fn collection(&self) -> &Arc<Collection> {
        &self.coll
    }

    pub fn partitions(&self) -> usize {
        self.aps.len()
    }

    /// Live rows.
    pub fn rows(&self) -> usize {
        self.aps.iter().map(|ap| ap.state.lock().keys.len()).sum()
    }

    /// The table's columns: the key, then every field of the rows, each typed by the kind
    /// most of its values have.
    pub fn schema(&self) -> SchemaRef {
        let mut fields = self.weighted_fields();
        fields.insert(0, (Field::new(crate::schema::KEY_COLUMN, datafusion::arrow::datatypes::DataType::Utf8, false), u64::MAX));
        Arc::new(datafusion::arrow::datatypes::Schema::new(merge_fields(&fields)))
    }

    /// Each top-level field of the rows (the key column aside) with the number of values it
    /// holds, equal fields of the segments summed ([`crate::merge::FieldWeights`]): what
    /// [`Shadow::schema`] merges (and a cluster merges across its members).
    pub fn weighted_fields(&self) -> Vec<(Field, u64)> {
        let mut summed = crate::merge::FieldWeights::default();
        for ap in &self.aps {
            ap.state.lock().fields(&mut summed);
        }
        summed.into_vec()
    }

    /// The columns' statistics over the segments (rows not yet in a segment, and rows that
    /// died since theirs was written, are not counted: estimates). A segment's are worked
    /// out once, when first asked; the merge is kept until the segments change.
    pub fn summary(&self) -> Arc<stats::TableSummary> {
        let cells: Vec<(usize, Vec<_>)> = self.aps.iter().enumerate().map(|(i, ap)| (i, ap.state.lock().stats_cells())).collect();
        let ids: Vec<(usize, u32)> = cells.iter().flat_map(|(i, segs)| segs.iter().map(move |(id, _, _)| (*i, *id))).collect();
        if let Some((at, summary)) = self.summary.lock().as_ref() {
            if *at == ids {
                return Arc::clone(summary);
            }
        }
        let mut all = stats::TableStats::new();
        for (batch, cell) in cells.into_iter().flat_map(|(_, segs)| segs.into_iter().map(|(_, b, c)| (b, c))) {
            stats::merge_into(&mut all, cell.get_or_init(|| Arc::new(stats::batch_stats(&batch))));
        }
        let summary = Arc::new(stats::summarize(&all));
        *self.summary.lock() = Some((ids, Arc::clone(&summary)));
        summary
    }

    /// What a scan reads, per analytics partition, as of now.
    pub fn snapshot(&self, group: Option<&str>) -> Result<Vec<Vec<Part>>, ShadowError> {
        self.aps.iter().map(|ap| ap.state.lock().parts(group).map_err(ShadowError::from)).collect()
    }

    /// Per storage partition: the last seqno the shadow applied.
    pub fn applied_seqnos(&self) -> Vec<SeqNo> {
        self.applied.iter().map(|a| a.load(Ordering::Acquire)).collect()
    }

    /// Where the shadow stands in storage partition `p`'s change stream.
    fn position(&self, p: PartitionId) -> StreamPosition {
        self.aps[usize::from(p) % self.aps.len()].state.lock().cursor(p)
    }

    /// Waits (within `timeout`) until the shadow holds every partition active here whole:
    /// at or past the high seqno its copy opened at, on its history (see
    /// [`Collection::behind_serve_floor`]), at any consistency.
    pub async fn wait_whole(&self, timeout: Duration) -> Result<(), ShadowError> {
        let mut rx = self.progress.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let Some(partition) = self.coll.behind_serve_floor(|p| self.position(p)) else { return Ok(()) };
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(ShadowError::NotAttached(self.coll.name().to_string())),
                Err(_) => return Err(ShadowError::CatchingUp(partition)),
            }
        }
    }

    /// Waits until every change up to `highs` (one seqno per storage partition) is applied.
    pub async fn wait_applied(&self, highs: &[SeqNo], timeout: Duration) -> Result<(), ShadowError> {
        let mut rx = self.progress.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if highs.iter().zip(&self.applied).all(|(h, a)| a.load(Ordering::Acquire) >= *h) {
                return Ok(());
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(ShadowError::NotAttached(self.coll.name().to_string())),
                Err(_) => return Err(ShadowError::Timeout(timeout)),
            }
        }
    }
}

impl Shadow {
    fn checkpoint_all(&self) -> Result<(), ShadowError> {
        for ap in &self.aps {
            let mut st = ap.state.lock();
            if st.dirty {
                st.checkpoint(&ap.dir, self.aps.len())?;
            }
        }
        Ok(())
    }

    fn remove_files(&self) {
        for root in &self.roots {
            if let Err(e) = std::fs::remove_dir_all(root) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(path = %root.display(), error = %e, "removing a dropped collection's analytics shadow");
                }
            }
        }
    }
}

/// The shadows of every collection of a store.
pub struct ShadowManager {
    store: Arc<Store>,
    /// How the maintainers are doing, for `/v1/health`.
    pub health: shoal_storage::TaskHealth,
    partitions: usize,
    shadows: Mutex<HashMap<u32, Arc<Shadow>>>,
    stop: watch::Sender<bool>,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// True once the shadows that existed at start are loaded (they load in the
    /// background, so that the node serves documents at once; analytics waits for this).
    loaded: watch::Sender<bool>,
    loader: Mutex<Option<tokio::task::JoinHandle<()>>>,
    incoming: Arc<transfer::Incoming>,
    /// Collections (by id) whose shadows apply no change until released: fault injection
    /// (`serve --fault-injection`), a shadow lagging as a slow disk would make it. Empty
    /// unless a test asks.
    held: Mutex<std::collections::HashSet<u32>>,
}

impl ShadowManager {
    /// Opens the shadows of every collection (call within a tokio runtime; blocking).
    /// Shadow directories of collections that no longer exist are removed; with analytics
    /// off (`partitions` 0) the others stay on disk, untouched, for a later start with it on.
    /// The shadows themselves load in the background (their segments are read into memory:
    /// seconds for millions of rows); [`ShadowManager::wait_loaded`] waits for them.
    pub fn open(store: Arc<Store>, partitions: usize) -> Result<Arc<ShadowManager>, ShadowError> {
        let (stop, _) = watch::channel(false);
        let mgr = Arc::new(ShadowManager {
            store: Arc::clone(&store),
            health: shoal_storage::TaskHealth::default(),
            partitions: partitions.min(ANALYTICS_PARTITIONS_MAX),
            shadows: Mutex::new(HashMap::new()),
            stop,
            tasks: Mutex::new(Vec::new()),
            loaded: watch::channel(false).0,
            loader: Mutex::new(None),
            incoming: Arc::default(),
            held: Mutex::default(),
        });
        let live: std::collections::HashSet<String> =
            store.list_collections().iter().filter_map(|c| store.collection(&c.name)).map(|c| c.id().to_string()).collect();
        for path in store.data_paths() {
            let root = path.join("shadow");
            let Ok(entries) = std::fs::read_dir(&root) else { continue };
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if !live.contains(&name) {
                    let _ = std::fs::remove_dir_all(entry.path());
                }
            }
        }
        let loader = Arc::clone(&mgr);
        let handle = tokio::runtime::Handle::current().spawn_blocking(move || {
            if loader.partitions > 0 {
                for info in loader.store.list_collections() {
                    if *loader.stop.borrow() {
                        break;
                    }
                    if let Some(coll) = loader.store.collection(&info.name) {
                        if let Err(e) = loader.attach(coll) {
                            // Its analytics answers `unavailable` (no shadow); the rest serves.
                            tracing::error!(collection = %info.name, error = %e, "an analytics shadow failed to load");
                            loader.health.round_failed(&format!("the analytics shadow of {} failed to load: {e}", info.name));
                        }
                    }
                }
            }
            loader.loaded.send_replace(true);
        });
        *mgr.loader.lock() = Some(handle);
        Ok(mgr)
    }

    /// Waits until the shadows that existed at start are loaded, at most `timeout`.
    pub async fn wait_loaded(&self, timeout: std::time::Duration) -> Result<(), ShadowError> {
        let mut rx = self.loaded.subscribe();
        let loaded = tokio::time::timeout(timeout, async { rx.wait_for(|l| *l).await.is_ok() }).await;
        match loaded {
            Ok(_) => Ok(()),
            Err(_) => Err(ShadowError::Timeout(timeout)),
        }
    }

    /// Fault injection: the shadows of these collections (by id) apply no change until
    /// called again without them.
    pub fn hold(&self, collection_ids: std::collections::HashSet<u32>) {
        *self.held.lock() = collection_ids;
    }

    fn is_held(&self, collection_id: u32) -> bool {
        self.held.lock().contains(&collection_id)
    }

    /// Analytics partitions per collection (0: analytics is off).
    pub fn partitions(&self) -> usize {
        self.partitions
    }

    /// Starts keeping `coll`'s shadow (idempotent). Blocking: loads its segments.
    pub fn attach(self: &Arc<Self>, coll: Arc<Collection>) -> Result<Arc<Shadow>, ShadowError> {
        if self.partitions == 0 {
            return Err(ShadowError::Off);
        }
        if let Some(s) = self.shadows.lock().get(&coll.id()) {
            return Ok(Arc::clone(s));
        }
        let paths = self.store.data_paths();
        let roots: Vec<PathBuf> = paths.iter().map(|p| p.join("shadow").join(coll.id().to_string())).collect();
        let partitions = coll.partition_count();
        let aps = (0..self.partitions)
            .map(|i| Ap::open(i, roots[i % roots.len()].join(i.to_string()), self.partitions, partitions))
            .collect::<Result<Vec<_>, _>>()?;
        let applied: Vec<AtomicU64> = (0..partitions).map(|_| AtomicU64::new(0)).collect();
        for ap in &aps {
            for (p, c) in &ap.state.lock().cursors {
                applied[usize::from(*p)].store(c.seqno, Ordering::Release);
            }
        }
        let shadow = Arc::new(Shadow {
            coll,
            aps,
            applied,
            progress: watch::channel(0).0,
            roots,
            incoming: Arc::clone(&self.incoming),
            summary: Mutex::default(),
        });
        let rows = shadow.rows();
        {
            let mut map = self.shadows.lock();
            if let Some(s) = map.get(&shadow.coll.id()) {
                return Ok(Arc::clone(s));
            }
            map.insert(shadow.coll.id(), Arc::clone(&shadow));
        }
        tracing::info!(collection = %shadow.coll.name(), rows, partitions = self.partitions, "analytics shadow opened");
        let task = tokio::spawn(maintain(Arc::clone(self), Arc::clone(&shadow), self.stop.subscribe()));
        self.tasks.lock().push(task);
        Ok(shadow)
    }

    pub fn shadow(&self, collection_id: u32) -> Option<Arc<Shadow>> {
        self.shadows.lock().get(&collection_id).cloned()
    }

    /// Stops the maintainers and checkpoints every shadow (a clean restart replays nothing).
    pub async fn close(&self) {
        // `send_replace`, not `send`: `send` stores nothing when no maintainer is listening
        // yet (shadows still loading), and one started later would never stop.
        self.stop.send_replace(true);
        let loader = self.loader.lock().take();
        if let Some(loader) = loader {
            let _ = loader.await;
        }
        let tasks = std::mem::take(&mut *self.tasks.lock());
        for t in tasks {
            let _ = t.await;
        }
        let shadows: Vec<Arc<Shadow>> = self.shadows.lock().values().cloned().collect();
        for s in shadows {
            let name = s.coll.name().to_string();
            match tokio::task::spawn_blocking(move || s.checkpoint_all()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(collection = %name, error = %e, "analytics checkpoint at shutdown"),
                Err(e) => tracing::warn!(collection = %name, error = %e, "analytics checkpoint at shutdown"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_partitions_follow_couchbase() {
        assert_eq!(default_partitions(8, 32 << 30), 8);
        assert_eq!(default_partitions(32, 32 << 30), 16);
        assert_eq!(default_partitions(8, 3 << 30), 3);
        assert_eq!(default_partitions(2, 512 << 20), 1, "never zero");
    }

    fn keyed(keys: &[String]) -> RecordBatch {
        let schema = Arc::new(datafusion::arrow::datatypes::Schema::new(vec![
            Field::new(crate::schema::KEY_COLUMN, datafusion::arrow::datatypes::DataType::Utf8, false),
            Field::new("n", datafusion::arrow::datatypes::DataType::Int64, false),
        ]));
        let n: Vec<i64> = (0..keys.len() as i64).collect();
        RecordBatch::try_new(
            schema,
            vec![Arc::new(StringArray::from(keys.to_vec())), Arc::new(datafusion::arrow::array::Int64Array::from(n))],
        )
        .unwrap()
    }

    #[test]
    fn a_scans_active_rows_are_the_rows_of_its_active_partitions_under_any_flags() {
        let count = 8u16;
        let keys: Vec<String> = (0..500).map(|i| format!("doc-{i}")).collect();
        let (batch, partitions) = sorted_by_partition(&keyed(&keys), count).unwrap();
        let ids = partitions.of(&batch, count).unwrap();
        assert!(ids.is_sorted(), "rows in partition order");
        let mut all: Vec<i64> = batch.column(1).as_any().downcast_ref::<datafusion::arrow::array::Int64Array>().unwrap().values().to_vec();
        all.sort_unstable();
        assert_eq!(all, (0..500).collect::<Vec<i64>>(), "every row kept once");
        // Asked again with other flags (a new map), the mask follows them, not the cache.
        for flags in [
            vec![true, false, true, false, true, false, true, false],
            vec![false; 8],
            vec![true; 8],
            vec![true, false, true, false, true, false, true, false],
        ] {
            let rows = partitions.active(&batch, &flags).unwrap();
            for (row, &p) in ids.iter().enumerate() {
                assert_eq!(rows.value(row), flags[usize::from(p)], "row {row} of partition {p}");
            }
        }
        // An unsorted batch's partitions are worked out from its keys.
        let lazy = RowPartitions::default();
        let raw = keyed(&keys);
        let of = lazy.of(&raw, count).unwrap();
        for (row, key) in keys.iter().enumerate() {
            assert_eq!(of[row], shoal_storage::partition_of(key.as_bytes(), count));
        }
    }
}
