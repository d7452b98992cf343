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
//! Segments are derived state and are checked like data: the manifest records each
//! segment file's checksum (XXH3-64), and a file is read with plain reads (an I/O error is
//! an error, never the SIGBUS a memory map would raise) and verified before it is decoded.
//! An analytics partition whose manifest or segments fail their checks is quarantined —
//! its files moved to `<shadow root>/quarantine/` for inspection — and rebuilt from the
//! change streams while the rest of the node serves.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use datafusion::arrow::array::{AsArray, BooleanArray, RecordBatch, StringArray};
use datafusion::arrow::buffer::BooleanBuffer;
use datafusion::arrow::datatypes::{Field, SchemaRef};
use datafusion::arrow::error::ArrowError;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use shoal_storage::{ChangesError, Collection, PartitionId, SeqNo, Store, StreamPosition};
use tokio::sync::watch;

use crate::merge::{adapt_batch, merge_fields, weighted_fields};
use crate::rows::{ColumnBuffer, ParsedDoc};

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

/// What the manifest of one analytics partition records.
#[derive(Serialize, Deserialize)]
struct Manifest {
    version: u32,
    analytics_partitions: usize,
    partitions: u16,
    /// `(partition, seqno, uuid)`: every change up to here is in the segments.
    cursors: Vec<(PartitionId, SeqNo, u64)>,
    segments: Vec<SegmentMeta>,
    next_id: u32,
}

#[derive(Serialize, Deserialize)]
struct SegmentMeta {
    id: u32,
    rows: usize,
    group: Option<String>,
    /// Rows no longer live (updated or deleted since the segment was written).
    dead: Vec<u32>,
    /// XXH3-64 of the segment file.
    checksum: u64,
}

/// One immutable batch of rows and which of them are dead.
struct Segment {
    batch: RecordBatch,
    group: Option<String>,
    dead: Vec<u64>,
    dead_count: usize,
    /// XXH3-64 of its file.
    checksum: u64,
}

impl Segment {
    fn new(batch: RecordBatch, group: Option<String>, checksum: u64) -> Segment {
        let words = batch.num_rows().div_ceil(64);
        Segment { batch, group, dead: vec![0; words], dead_count: 0, checksum }
    }

    fn live(&self) -> usize {
        self.batch.num_rows() - self.dead_count
    }

    fn is_dead(&self, row: usize) -> bool {
        self.dead.get(row / 64).is_some_and(|w| w & (1 << (row % 64)) != 0)
    }

    fn kill(&mut self, row: usize) {
        if let Some(w) = self.dead.get_mut(row / 64) {
            let bit = 1u64 << (row % 64);
            if *w & bit == 0 {
                *w |= bit;
                self.dead_count += 1;
            }
        }
    }

    /// Which rows are live, when some are not.
    fn live_mask(&self) -> Option<BooleanArray> {
        (self.dead_count > 0).then(|| BooleanArray::new(BooleanBuffer::collect_bool(self.batch.num_rows(), |r| !self.is_dead(r)), None))
    }

    fn dead_rows(&self) -> Vec<u32> {
        (0..self.batch.num_rows()).filter(|&r| self.is_dead(r)).map(|r| r as u32).collect()
    }
}

/// Recent documents of one group, not yet a segment.
#[derive(Default)]
struct Buffer {
    group: Option<String>,
    rows: ColumnBuffer,
    /// The rows as a batch, as last converted for a scan (dropped by any change).
    cached: Option<RecordBatch>,
}

impl Buffer {
    fn batch(&mut self) -> Result<RecordBatch, ArrowError> {
        if let Some(b) = &self.cached {
            return Ok(b.clone());
        }
        let b = self.rows.batch()?;
        self.cached = Some(b.clone());
        Ok(b)
    }
}

/// Where a key's live row is.
#[derive(Clone, Copy, Debug)]
enum Loc {
    Seg { id: u32, row: u32 },
    Buf { slot: u16, idx: u32 },
}

/// One piece of an analytics partition a scan reads: a batch and, if some of its rows
/// are dead, which rows are live.
#[derive(Clone)]
pub struct Part {
    pub batch: RecordBatch,
    pub live: Option<BooleanArray>,
}

impl Part {
    pub fn rows(&self) -> usize {
        self.live.as_ref().map_or(self.batch.num_rows(), BooleanArray::true_count)
    }
}

struct ApState {
    /// Storage partitions feeding this analytics partition and how far each is applied.
    cursors: Vec<(PartitionId, StreamPosition)>,
    segments: BTreeMap<u32, Segment>,
    /// Slot 0 holds ungrouped documents; the others one group each.
    buffers: Vec<Buffer>,
    slots: HashMap<String, u16>,
    keys: HashMap<Box<str>, Loc>,
    next_id: u32,
    dirty: bool,
    last_checkpoint: Instant,
    last_change: Instant,
    /// Files of replaced segments, removed once a manifest no longer names them.
    garbage: Vec<PathBuf>,
    /// Rows per segment ([`SEGMENT_ROWS`]; smaller in tests).
    segment_rows: usize,
}

/// One analytics partition.
struct Ap {
    dir: PathBuf,
    state: Mutex<ApState>,
}

fn segment_path(dir: &Path, id: u32) -> PathBuf {
    dir.join(format!("{id}.arrow"))
}

impl ApState {
    fn fresh(cursors: Vec<(PartitionId, StreamPosition)>) -> ApState {
        ApState {
            cursors,
            segments: BTreeMap::new(),
            buffers: vec![Buffer::default()],
            slots: HashMap::new(),
            keys: HashMap::new(),
            next_id: 1,
            dirty: false,
            last_checkpoint: Instant::now(),
            last_change: Instant::now(),
            garbage: Vec::new(),
            segment_rows: SEGMENT_ROWS,
        }
    }

    fn remove(&mut self, key: &str) {
        match self.keys.remove(key) {
            Some(Loc::Seg { id, row }) => {
                if let Some(s) = self.segments.get_mut(&id) {
                    s.kill(row as usize);
                    self.dirty = true;
                }
            }
            Some(Loc::Buf { slot, idx }) => {
                let buf = &mut self.buffers[usize::from(slot)];
                buf.cached = None;
                if let Some(moved) = buf.rows.swap_remove(idx as usize) {
                    if let Some(loc) = self.keys.get_mut(moved) {
                        *loc = Loc::Buf { slot, idx };
                    }
                }
            }
            None => {}
        }
    }

    fn upsert(&mut self, key: String, doc: ParsedDoc<'_>, dir: &Path) -> Result<(), ShadowError> {
        self.remove(&key);
        let slot = match doc.str_field(GROUP_FIELD) {
            None => 0,
            Some(g) => match self.slots.get(g) {
                Some(&s) => s,
                None if self.buffers.len() < GROUPS_MAX => {
                    let s = self.buffers.len() as u16;
                    self.buffers.push(Buffer { group: Some(g.to_string()), ..Buffer::default() });
                    self.slots.insert(g.to_string(), s);
                    s
                }
                None => 0,
            },
        };
        let buf = &mut self.buffers[usize::from(slot)];
        buf.cached = None;
        self.keys.insert(key.as_str().into(), Loc::Buf { slot, idx: buf.rows.len() as u32 });
        buf.rows.push(key, doc);
        self.dirty = true;
        if buf.rows.len() >= self.segment_rows || buf.rows.bytes() >= SEGMENT_BYTES_MAX {
            self.flush(usize::from(slot), dir)?;
        }
        Ok(())
    }

    /// Turns a buffer into a segment (written to its file), then merges small segments of
    /// its group.
    ///
    /// The buffer is emptied only once its segment is written: a failed write (a full
    /// disk) leaves the rows where they were, to be written by a later attempt, so no
    /// checkpoint can ever record a position past rows it does not hold.
    fn flush(&mut self, slot: usize, dir: &Path) -> Result<(), ShadowError> {
        let buf = &mut self.buffers[slot];
        if buf.rows.is_empty() {
            return Ok(());
        }
        let batch = buf.batch()?;
        let group = buf.group.clone();
        self.add_segment(dir, &batch, group.clone())?;
        let buf = &mut self.buffers[slot];
        buf.rows = ColumnBuffer::default();
        buf.cached = None;
        self.compact(&group, dir)
    }

    /// Writes `batch` as a new segment of `group` and points its keys at their rows there.
    fn add_segment(&mut self, dir: &Path, batch: &RecordBatch, group: Option<String>) -> Result<(), ShadowError> {
        let id = self.next_id;
        let (batch, checksum) = write_segment(dir, id, batch)?;
        self.next_id += 1;
        let keys = key_column(&batch, &segment_path(dir, id))?;
        for row in 0..batch.num_rows() {
            if let Some(loc) = self.keys.get_mut(keys.value(row)) {
                *loc = Loc::Seg { id, row: row as u32 };
            }
        }
        self.segments.insert(id, Segment::new(batch, group, checksum));
        Ok(())
    }

    /// Drops segments with no live rows; merges the group's small or mostly dead
    /// segments once there are [`COMPACT_MIN_SEGMENTS`] of them.
    fn compact(&mut self, group: &Option<String>, dir: &Path) -> Result<(), ShadowError> {
        let empty: Vec<u32> = self.segments.iter().filter(|(_, s)| s.live() == 0).map(|(&id, _)| id).collect();
        for id in empty {
            self.segments.remove(&id);
            self.garbage.push(segment_path(dir, id));
            self.dirty = true;
        }
        let mut budget = SEGMENT_BYTES_MAX;
        let small: Vec<u32> = self
            .segments
            .iter()
            .filter(|(_, s)| &s.group == group && s.live() < self.segment_rows / 2)
            .take_while(|(_, s)| {
                let size = s.batch.get_array_memory_size();
                budget = budget.saturating_sub(size);
                budget > 0
            })
            .map(|(&id, _)| id)
            .collect();
        if small.len() < COMPACT_MIN_SEGMENTS {
            return Ok(());
        }
        let mut live = Vec::with_capacity(small.len());
        let mut fields = Vec::new();
        for id in &small {
            let Some(s) = self.segments.get(id) else { continue };
            let batch = match s.live_mask() {
                Some(mask) => datafusion::arrow::compute::filter_record_batch(&s.batch, &mask)?,
                None => s.batch.clone(),
            };
            fields.extend(weighted_fields(&batch));
            live.push(batch);
        }
        let schema = Arc::new(datafusion::arrow::datatypes::Schema::new(merge_fields(&fields)));
        let adapted = live.iter().map(|b| adapt_batch(b, &schema)).collect::<Result<Vec<_>, _>>()?;
        let merged = datafusion::arrow::compute::concat_batches(&schema, &adapted)?;
        let mut offset = 0;
        while offset < merged.num_rows() {
            let len = self.segment_rows.min(merged.num_rows() - offset);
            self.add_segment(dir, &merged.slice(offset, len), group.clone())?;
            offset += len;
        }
        for id in small {
            self.segments.remove(&id);
            self.garbage.push(segment_path(dir, id));
        }
        self.dirty = true;
        Ok(())
    }

    /// Every buffer becomes a segment; then the manifest is replaced atomically and the
    /// files it no longer names are removed.
    fn checkpoint(&mut self, dir: &Path, aps: usize, partitions: u16) -> Result<(), ShadowError> {
        for slot in 0..self.buffers.len() {
            self.flush(slot, dir)?;
        }
        let manifest = Manifest {
            version: MANIFEST_VERSION,
            analytics_partitions: aps,
            partitions,
            cursors: self.cursors.iter().map(|(p, c)| (*p, c.seqno, c.uuid)).collect(),
            segments: self
                .segments
                .iter()
                .map(|(&id, s)| SegmentMeta {
                    id,
                    rows: s.batch.num_rows(),
                    group: s.group.clone(),
                    dead: s.dead_rows(),
                    checksum: s.checksum,
                })
                .collect(),
            next_id: self.next_id,
        };
        let bytes = serde_json::to_vec(&manifest).map_err(|e| ShadowError::Corrupt { path: dir.join(MANIFEST), reason: e.to_string() })?;
        write_atomically(&dir.join(MANIFEST), &bytes)?;
        for path in self.garbage.drain(..) {
            if let Err(e) = std::fs::remove_file(&path) {
                tracing::warn!(path = %path.display(), error = %e, "removing a replaced analytics segment");
            }
        }
        self.dirty = false;
        self.last_checkpoint = Instant::now();
        Ok(())
    }

    /// Forgets every row of storage partition `p` (its history diverged): the partition is
    /// read again from the start.
    fn reset_partition(&mut self, p: PartitionId, partitions: u16) {
        let keys: Vec<Box<str>> =
            self.keys.keys().filter(|k| shoal_storage::partition_of(k.as_bytes(), partitions) == p).cloned().collect();
        for k in keys {
            self.remove(&k);
        }
        for (q, c) in &mut self.cursors {
            if *q == p {
                *c = StreamPosition::default();
            }
        }
    }

    /// The pieces a scan reads (segments, and buffers converted now), skipping those whose
    /// group is not `group`.
    fn parts(&mut self, group: Option<&str>) -> Result<Vec<Part>, ArrowError> {
        let keep = |g: &Option<String>| match (group, g) {
            (Some(want), Some(have)) => want == have,
            _ => true,
        };
        let mut out = Vec::new();
        for s in self.segments.values().filter(|s| keep(&s.group) && s.live() > 0) {
            out.push(Part { batch: s.batch.clone(), live: s.live_mask() });
        }
        for b in self.buffers.iter_mut().filter(|b| keep(&b.group) && !b.rows.is_empty()) {
            out.push(Part { batch: b.batch()?, live: None });
        }
        Ok(out)
    }

    /// Each top-level field of the rows with the number of values it holds.
    fn fields(&self) -> Vec<(Field, u64)> {
        let mut out = Vec::new();
        for s in self.segments.values().filter(|s| s.live() > 0) {
            out.extend(weighted_fields(&s.batch));
        }
        for b in self.buffers.iter().filter(|b| !b.rows.is_empty()) {
            out.extend(b.rows.weighted_fields());
        }
        out
    }
}

/// A segment's key column (its first).
fn key_column<'a>(batch: &'a RecordBatch, path: &Path) -> Result<&'a StringArray, ShadowError> {
    batch
        .column(0)
        .as_string_opt::<i32>()
        .ok_or_else(|| ShadowError::Corrupt { path: path.to_path_buf(), reason: "the first column is not the key".into() })
}

/// Writes a segment file (temporary name, fsync, rename) and answers the batch as read
/// back from it with its checksum.
fn write_segment(dir: &Path, id: u32, batch: &RecordBatch) -> Result<(RecordBatch, u64), ShadowError> {
    let path = segment_path(dir, id);
    let tmp = path.with_extension("arrow.tmp");
    let file = std::fs::File::create(&tmp).map_err(io_at(&tmp))?;
    let mut writer = datafusion::arrow::ipc::writer::FileWriter::try_new_buffered(file, &batch.schema())?;
    writer.write(batch)?;
    writer.finish()?;
    let file = writer.into_inner()?.into_inner().map_err(|e| ShadowError::Io { path: tmp.clone(), source: e.into_error() })?;
    file.sync_all().map_err(io_at(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io_at(&path))?;
    read_segment(&path, None)
}

/// Reads a segment file into memory (64-byte aligned, so Arrow decodes it in place),
/// checks it against `checksum` when one is given, and decodes its batch. Plain reads: an
/// I/O error is an error here, where a memory-mapped file would raise SIGBUS.
fn read_segment(path: &Path, checksum: Option<u64>) -> Result<(RecordBatch, u64), ShadowError> {
    use datafusion::arrow::buffer::{Buffer, MutableBuffer};
    use datafusion::arrow::ipc::reader::{read_footer_length, FileDecoder};
    use std::io::Read as _;
    let corrupt = |reason: String| ShadowError::Corrupt { path: path.to_path_buf(), reason };
    let mut file = std::fs::File::open(path).map_err(io_at(path))?;
    let len = usize::try_from(file.metadata().map_err(io_at(path))?.len()).map_err(|_| corrupt("too large".into()))?;
    let mut bytes = MutableBuffer::from_len_zeroed(len);
    file.read_exact(bytes.as_slice_mut()).map_err(io_at(path))?;
    let sum = xxhash_rust::xxh3::xxh3_64(bytes.as_slice());
    if let Some(expected) = checksum {
        if sum != expected {
            return Err(corrupt(format!("checksum {sum:016x}, the manifest says {expected:016x}")));
        }
    }
    let buffer = Buffer::from(bytes);
    let trailer: [u8; 10] =
        buffer.get(len.saturating_sub(10)..).and_then(|t| t.try_into().ok()).ok_or_else(|| corrupt("too short".into()))?;
    let footer_len = read_footer_length(trailer).map_err(|e| corrupt(e.to_string()))?;
    let footer_bytes = len
        .checked_sub(10 + footer_len)
        .and_then(|start| buffer.get(start..len - 10))
        .ok_or_else(|| corrupt("bad footer length".into()))?;
    let footer = datafusion::arrow::ipc::root_as_footer(footer_bytes).map_err(|e| corrupt(e.to_string()))?;
    let schema = footer.schema().ok_or_else(|| corrupt("no schema".into()))?;
    let schema = Arc::new(datafusion::arrow::ipc::convert::fb_to_schema(schema));
    let mut decoder = FileDecoder::new(Arc::clone(&schema), footer.version());
    let block_data = |offset: i64, body: i64, meta: i32| {
        let (offset, size) = (usize::try_from(offset).ok()?, usize::try_from(body).ok()? + usize::try_from(meta).ok()?);
        (offset.checked_add(size)? <= len).then(|| buffer.slice_with_length(offset, size))
    };
    for block in footer.dictionaries().iter().flatten() {
        let data = block_data(block.offset(), block.bodyLength(), block.metaDataLength()).ok_or_else(|| corrupt("bad block".into()))?;
        decoder.read_dictionary(block, &data).map_err(|e| corrupt(e.to_string()))?;
    }
    let mut batches = Vec::new();
    for block in footer.recordBatches().iter().flatten() {
        let data = block_data(block.offset(), block.bodyLength(), block.metaDataLength()).ok_or_else(|| corrupt("bad block".into()))?;
        if let Some(b) = decoder.read_record_batch(block, &data).map_err(|e| corrupt(e.to_string()))? {
            batches.push(b);
        }
    }
    let batch = match batches.len() {
        1 => batches.remove(0),
        _ => datafusion::arrow::compute::concat_batches(&schema, &batches).map_err(|e| corrupt(e.to_string()))?,
    };
    Ok((batch, sum))
}

/// Moves an analytics partition's files into the shadow root's quarantine folder (named
/// after the partition's folder and the time), so that the partition starts empty and the
/// damaged files stay for inspection.
fn quarantine(dir: &Path) -> Result<(), ShadowError> {
    let (Some(root), Some(name)) = (dir.parent(), dir.file_name()) else { return Ok(()) };
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let target = root.join(QUARANTINE_DIR).join(format!("{}-{secs}", name.to_string_lossy()));
    std::fs::create_dir_all(&target).map_err(io_at(&target))?;
    for entry in std::fs::read_dir(dir).map_err(io_at(dir))?.flatten() {
        let to = target.join(entry.file_name());
        std::fs::rename(entry.path(), &to).map_err(io_at(&to))?;
    }
    Ok(())
}

/// Writes `path` so that a crash leaves either the old or the new content.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), ShadowError> {
    use std::io::Write as _;
    let tmp = path.with_extension("tmp");
    let mut file = std::fs::File::create(&tmp).map_err(io_at(&tmp))?;
    file.write_all(bytes).map_err(io_at(&tmp))?;
    file.sync_all().map_err(io_at(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io_at(path))?;
    if let Some(parent) = path.parent() {
        std::fs::File::open(parent).and_then(|d| d.sync_all()).map_err(io_at(parent))?;
    }
    Ok(())
}

impl Ap {
    /// Opens an analytics partition from its manifest; a missing, foreign or damaged one
    /// starts empty (the partition is then rebuilt from the change streams).
    fn open(index: usize, dir: PathBuf, aps: usize, partitions: u16) -> Result<Ap, ShadowError> {
        std::fs::create_dir_all(&dir).map_err(io_at(&dir))?;
        let own: Vec<(PartitionId, StreamPosition)> =
            (0..partitions).filter(|p| usize::from(*p) % aps == index).map(|p| (p, StreamPosition::default())).collect();
        let state = match Self::load(&dir, aps, partitions) {
            Ok(Some(state)) => state,
            Ok(None) => ApState::fresh(own),
            Err(e) => {
                tracing::warn!(partition = index, error = %e, "analytics partition damaged: quarantined, rebuilding it from the change streams");
                metrics::counter!("shoal_analytics_rebuilds_total").increment(1);
                quarantine(&dir)?;
                ApState::fresh(own)
            }
        };
        // Files the manifest does not name: leftovers of an interrupted checkpoint.
        let named: std::collections::HashSet<PathBuf> = state.segments.keys().map(|&id| segment_path(&dir, id)).collect();
        for entry in std::fs::read_dir(&dir).map_err(io_at(&dir))?.flatten() {
            let path = entry.path();
            if path.file_name().is_some_and(|n| n != MANIFEST) && !named.contains(&path) {
                let _ = std::fs::remove_file(&path);
            }
        }
        Ok(Ap { dir, state: Mutex::new(state) })
    }

    fn load(dir: &Path, aps: usize, partitions: u16) -> Result<Option<ApState>, ShadowError> {
        let path = dir.join(MANIFEST);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(ShadowError::Io { path, source: e }),
        };
        let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| ShadowError::Corrupt { path: path.clone(), reason: e.to_string() })?;
        if m.version != MANIFEST_VERSION || m.analytics_partitions != aps || m.partitions != partitions {
            return Ok(None);
        }
        let mut state = ApState::fresh(m.cursors.iter().map(|&(p, seqno, uuid)| (p, StreamPosition { seqno, uuid })).collect());
        state.next_id = m.next_id;
        for meta in m.segments {
            let seg_path = segment_path(dir, meta.id);
            let (batch, checksum) = read_segment(&seg_path, Some(meta.checksum))?;
            if batch.num_rows() != meta.rows {
                return Err(ShadowError::Corrupt {
                    path: seg_path,
                    reason: format!("{} rows, the manifest says {}", batch.num_rows(), meta.rows),
                });
            }
            let mut seg = Segment::new(batch, meta.group, checksum);
            for row in meta.dead {
                seg.kill(row as usize);
            }
            let keys = key_column(&seg.batch, &seg_path)?;
            for row in (0..seg.batch.num_rows()).filter(|&r| !seg.is_dead(r)) {
                state.keys.insert(keys.value(row).into(), Loc::Seg { id: meta.id, row: row as u32 });
            }
            state.segments.insert(meta.id, seg);
        }
        Ok(Some(state))
    }
}

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
        let mut fields = Vec::new();
        for ap in &self.aps {
            fields.extend(ap.state.lock().fields());
        }
        fields.insert(0, (Field::new(crate::schema::KEY_COLUMN, datafusion::arrow::datatypes::DataType::Utf8, false), u64::MAX));
        Arc::new(datafusion::arrow::datatypes::Schema::new(merge_fields(&fields)))
    }

    /// What a scan reads, per analytics partition, as of now.
    pub fn snapshot(&self, group: Option<&str>) -> Result<Vec<Vec<Part>>, ShadowError> {
        self.aps.iter().map(|ap| ap.state.lock().parts(group).map_err(ShadowError::from)).collect()
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

    /// Applies the news of analytics partition `i`; checkpoints when due. True if
    /// anything was applied.
    fn round(&self, i: usize) -> Result<bool, ShadowError> {
        let ap = &self.aps[i];
        let partitions = self.coll.partition_count();
        let cursors = ap.state.lock().cursors.clone();
        let highs = self.coll.high_seqnos();
        let mut budget = ROUND_CHANGES_MAX;
        let mut moved = false;
        for (slot, (p, from)) in cursors.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if highs.get(usize::from(*p)).is_some_and(|h| from.seqno >= *h) {
                continue;
            }
            let (mut sub, rollback) = self.coll.subscribe(*p, *from)?;
            // A new history epoch that began at or after our position lost nothing we saw.
            if rollback.is_some_and(|r| r < from.seqno) {
                ap.state.lock().reset_partition(*p, partitions);
                sub = self.coll.subscribe(*p, StreamPosition::default())?.0;
            }
            loop {
                let changes = sub.try_next(APPLY_BATCH.min(budget), true)?;
                let pos = sub.position();
                budget -= changes.len();
                let newest_cas = changes.last().map(|c| c.cas);
                // Parse outside the lock: scans of this partition are not held up.
                let parsed: Vec<(String, Option<ParsedDoc<'_>>)> = changes
                    .iter()
                    .map(|c| {
                        let key = String::from_utf8_lossy(&c.key).into_owned();
                        (key, (!c.deleted).then(|| c.value.as_deref().map(ParsedDoc::parse).unwrap_or_default()))
                    })
                    .collect();
                let done = parsed.is_empty();
                {
                    let mut st = ap.state.lock();
                    for (key, doc) in parsed {
                        match doc {
                            Some(doc) => st.upsert(key, doc, &ap.dir)?,
                            None => st.remove(&key),
                        }
                    }
                    if st.cursors[slot].1 != pos {
                        st.cursors[slot].1 = pos;
                        st.dirty = true;
                        st.last_change = Instant::now();
                    }
                }
                self.applied[usize::from(*p)].store(pos.seqno, Ordering::Release);
                if let Some(cas) = newest_cas {
                    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
                    let lag = now.saturating_sub(cas);
                    metrics::histogram!("shoal_analytics_lag_seconds").record(lag as f64 / 1e9);
                    moved = true;
                }
                if done || budget == 0 {
                    break;
                }
            }
        }
        let mut st = ap.state.lock();
        let quiet = !moved && st.last_change.elapsed() >= QUIET_CHECKPOINT;
        if st.dirty && (quiet || st.last_checkpoint.elapsed() >= CHECKPOINT_INTERVAL) {
            st.checkpoint(&ap.dir, self.aps.len(), partitions)?;
        }
        Ok(moved)
    }

    fn checkpoint_all(&self) -> Result<(), ShadowError> {
        let partitions = self.coll.partition_count();
        for ap in &self.aps {
            let mut st = ap.state.lock();
            if st.dirty {
                st.checkpoint(&ap.dir, self.aps.len(), partitions)?;
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
        let shadow = Arc::new(Shadow { coll, aps, applied, progress: watch::channel(0).0, roots });
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

/// One collection's maintainer: a round on every analytics partition in parallel while
/// there is news, then waits for a change or the idle poll (checkpoints come due).
async fn maintain(mgr: Arc<ShadowManager>, shadow: Arc<Shadow>, mut stop: watch::Receiver<bool>) {
    let mut changed = shadow.coll.changed();
    let _running = mgr.health.running();
    loop {
        if *stop.borrow() {
            return;
        }
        if shadow.coll.is_dropped() {
            mgr.shadows.lock().remove(&shadow.coll.id());
            let s = Arc::clone(&shadow);
            let _ = tokio::task::spawn_blocking(move || s.remove_files()).await;
            return;
        }
        changed.borrow_and_update();
        let rounds: Vec<_> = (0..shadow.aps.len())
            .map(|i| {
                let s = Arc::clone(&shadow);
                tokio::task::spawn_blocking(move || s.round(i))
            })
            .collect();
        let mut moved = false;
        let mut failed = false;
        for r in futures::future::join_all(rounds).await {
            match r {
                Ok(Ok(m)) => moved |= m,
                Ok(Err(ShadowError::Changes(ChangesError::CollectionDropped))) => {}
                Ok(Err(e)) => {
                    tracing::warn!(collection = %shadow.coll.name(), error = %e, "analytics shadow maintenance failed; retrying");
                    mgr.health.round_failed(&format!("collection {}: {e}", shadow.coll.name()));
                    failed = true;
                }
                Err(e) => {
                    tracing::error!(collection = %shadow.coll.name(), error = %e, "analytics shadow maintenance panicked");
                    mgr.health.round_failed(&format!("collection {}: maintenance panicked", shadow.coll.name()));
                    failed = true;
                }
            }
        }
        if !failed {
            mgr.health.round_succeeded();
        }
        shadow.progress.send_modify(|v| *v = v.wrapping_add(1));
        if failed {
            tokio::time::sleep(IDLE_POLL).await;
        } else if !moved {
            tokio::select! {
                r = changed.changed() => if r.is_err() { tokio::time::sleep(IDLE_POLL).await },
                _ = tokio::time::sleep(IDLE_POLL) => {}
                _ = stop.changed() => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::to_batch;
    use serde_json::Value;

    #[test]
    fn default_partitions_follow_couchbase() {
        assert_eq!(default_partitions(8, 32 << 30), 8);
        assert_eq!(default_partitions(32, 32 << 30), 16);
        assert_eq!(default_partitions(8, 3 << 30), 3);
        assert_eq!(default_partitions(2, 512 << 20), 1, "never zero");
    }

    use proptest::prelude::*;
    use serde_json::json;

    #[derive(Debug, Clone)]
    enum Op {
        Upsert(u8, u8),
        Remove(u8),
        Checkpoint,
        Reopen,
    }

    fn doc(variant: u8) -> Value {
        let group = ["a", "b"].get(usize::from(variant % 3)).map(|g| json!(g)).unwrap_or(Value::Null);
        let mut d = json!({"n": variant, "s": format!("v{variant}"), "table_name": group});
        if variant.is_multiple_of(4) {
            d["o"] = json!({"x": variant});
        }
        if variant.is_multiple_of(5) {
            d.as_object_mut().unwrap().remove("s");
        }
        d
    }

    /// JSON without null members (a missing struct member reads back as null).
    fn strip(v: Value) -> Value {
        match v {
            Value::Object(m) => Value::Object(m.into_iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k, strip(v))).collect()),
            v => v,
        }
    }

    /// What a scan of the state reads: key → document.
    fn read(st: &mut ApState) -> HashMap<String, Value> {
        let mut out = HashMap::new();
        for part in st.parts(None).unwrap() {
            let batch = match &part.live {
                Some(mask) => datafusion::arrow::compute::filter_record_batch(&part.batch, mask).unwrap(),
                None => part.batch.clone(),
            };
            let schema = batch.schema();
            for r in 0..batch.num_rows() {
                let mut m = serde_json::Map::new();
                for (f, c) in schema.fields().iter().zip(batch.columns()).skip(1) {
                    m.insert(f.name().clone(), crate::convert::to_json(c.as_ref(), r).unwrap());
                }
                let key = crate::convert::to_json(batch.column(0).as_ref(), r).unwrap().as_str().unwrap().to_string();
                assert!(out.insert(key, strip(Value::Object(m))).is_none(), "a key is live once");
            }
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Upserts, removes, checkpoints and reopenings from disk against a map of keys to
        /// documents: every live document is read back once, as written.
        #[test]
        fn shadow_matches_a_map_of_documents(ops in proptest::collection::vec(prop_oneof![
            6 => (0u8..40, any::<u8>()).prop_map(|(k, v)| Op::Upsert(k, v)),
            3 => (0u8..40).prop_map(Op::Remove),
            1 => Just(Op::Checkpoint),
            1 => Just(Op::Reopen),
        ], 1..300)) {
            let dir = tempfile::tempdir().unwrap();
            let mut st = ApState::fresh(vec![(0, StreamPosition::default())]);
            st.segment_rows = 8;
            let mut model: HashMap<String, Value> = HashMap::new();
            for op in ops {
                match op {
                    Op::Upsert(k, v) => {
                        let text = doc(v).to_string();
                        st.upsert(format!("k{k}"), ParsedDoc::parse(text.as_bytes()), dir.path()).unwrap();
                        model.insert(format!("k{k}"), strip(doc(v)));
                    }
                    Op::Remove(k) => {
                        st.remove(&format!("k{k}"));
                        model.remove(&format!("k{k}"));
                    }
                    Op::Checkpoint => st.checkpoint(dir.path(), 1, 1).unwrap(),
                    Op::Reopen => {
                        st.checkpoint(dir.path(), 1, 1).unwrap();
                        st = Ap::load(dir.path(), 1, 1).unwrap().unwrap();
                        st.segment_rows = 8;
                    }
                }
                prop_assert_eq!(st.keys.len(), model.len());
            }
            let mut got = read(&mut st);
            for d in got.values_mut() {
                d.as_object_mut().unwrap().retain(|_, v| !v.is_null());
            }
            prop_assert_eq!(got, model);
        }
    }

    #[test]
    fn segment_files_read_back_and_damaged_ones_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let mut buf = ColumnBuffer::default();
        for i in 0..100 {
            let text = serde_json::json!({"n": i, "s": format!("v{i}"), "o": {"x": [i]}}).to_string();
            buf.push(format!("k{i}"), ParsedDoc::parse(text.as_bytes()));
        }
        let batch = buf.batch().unwrap();
        let (written, sum) = write_segment(dir.path(), 1, &batch).unwrap();
        assert_eq!(written, batch);
        assert_eq!(read_segment(&segment_path(dir.path(), 1), Some(sum)).unwrap(), (batch, sum));
        let bytes = std::fs::read(segment_path(dir.path(), 1)).unwrap();
        for cut in [0, 5, 10, 11, bytes.len() / 2, bytes.len() - 11, bytes.len() - 1] {
            std::fs::write(segment_path(dir.path(), 2), &bytes[..cut]).unwrap();
            assert!(read_segment(&segment_path(dir.path(), 2), None).is_err(), "cut at {cut}");
        }
        // A bit flipped anywhere — in a column's values, where decoding alone would not
        // notice — fails the checksum.
        for at in [bytes.len() / 3, bytes.len() / 2, bytes.len() - 12] {
            let mut flipped = bytes.clone();
            flipped[at] ^= 0x10;
            std::fs::write(segment_path(dir.path(), 3), &flipped).unwrap();
            match read_segment(&segment_path(dir.path(), 3), Some(sum)) {
                Err(ShadowError::Corrupt { reason, .. }) => assert!(reason.contains("checksum"), "{reason}"),
                other => panic!("a flipped bit at {at} read as {:?}", other.map(|(b, _)| b.num_rows())),
            }
        }
    }

    #[test]
    fn a_damaged_partition_is_quarantined_and_starts_empty() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("0");
        std::fs::create_dir_all(&dir).unwrap();
        let mut st = ApState::fresh(vec![(0, StreamPosition::default())]);
        for i in 0..10 {
            let text = serde_json::json!({"n": i}).to_string();
            st.upsert(format!("k{i}"), ParsedDoc::parse(text.as_bytes()), &dir).unwrap();
        }
        st.cursors[0].1 = StreamPosition { seqno: 10, uuid: 7 };
        st.checkpoint(&dir, 1, 1).unwrap();
        let seg = segment_path(&dir, 1);
        let mut bytes = std::fs::read(&seg).unwrap();
        let at = bytes.len() / 2;
        bytes[at] ^= 1;
        std::fs::write(&seg, &bytes).unwrap();
        let ap = Ap::open(0, dir.clone(), 1, 1).unwrap();
        let st = ap.state.lock();
        assert!(st.keys.is_empty(), "nothing is read from a damaged segment");
        assert_eq!(st.cursors[0].1, StreamPosition::default(), "the partition is read again from the start");
        let quarantined: Vec<_> = std::fs::read_dir(root.path().join(QUARANTINE_DIR)).unwrap().flatten().collect();
        assert_eq!(quarantined.len(), 1);
        assert!(quarantined[0].path().join("1.arrow").exists() && quarantined[0].path().join(MANIFEST).exists());
    }

    #[test]
    fn a_failed_flush_keeps_its_rows_for_the_next_checkpoint() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("0");
        std::fs::create_dir_all(&dir).unwrap();
        // A "directory" that is a file: every segment write under it fails, as on a full disk.
        let broken = root.path().join("broken");
        std::fs::write(&broken, b"not a directory").unwrap();
        let mut st = ApState::fresh(vec![(0, StreamPosition::default())]);
        for i in 0..10 {
            let text = serde_json::json!({"n": i}).to_string();
            st.upsert(format!("k{i}"), ParsedDoc::parse(text.as_bytes()), &dir).unwrap();
        }
        st.cursors[0].1 = StreamPosition { seqno: 10, uuid: 7 };
        assert!(st.checkpoint(&broken, 1, 1).is_err(), "a checkpoint that cannot write is an error");
        st.checkpoint(&dir, 1, 1).unwrap();
        let ap = Ap::open(0, dir.clone(), 1, 1).unwrap();
        let st = ap.state.lock();
        assert_eq!(st.keys.len(), 10, "the rows buffered when the flush failed were written by the next checkpoint");
        assert_eq!(st.cursors[0].1, StreamPosition { seqno: 10, uuid: 7 });
    }

    #[test]
    fn dead_rows_are_masked_and_counted() {
        let schema = crate::schema::Obj::default().table_schema();
        let rows: Vec<(String, Value)> = (0..130).map(|i| (format!("k{i}"), serde_json::json!({}))).collect();
        let mut s = Segment::new(to_batch(&schema, None, &rows).unwrap(), None, 0);
        assert!(s.live_mask().is_none());
        s.kill(3);
        s.kill(3);
        s.kill(129);
        assert_eq!(s.live(), 128);
        assert_eq!(s.dead_rows(), vec![3, 129]);
        let mask = s.live_mask().unwrap();
        assert_eq!(mask.true_count(), 128);
        assert!(!mask.value(3) && !mask.value(129) && mask.value(4));
    }
}
