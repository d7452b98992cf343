//! One analytics partition: its segments, open buffers and the key → live row map, how
//! changes land in it, merges, checkpoints, and opening it from its manifest.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::error::ArrowError;
use parking_lot::Mutex;
use shoal_storage::{PartitionId, StreamPosition};

use crate::merge::{adapt_batch, merge_fields, weighted_fields, FieldWeights};
use crate::rows::{ColumnBuffer, ParsedDoc};

use super::{
    io_at, key_column, quarantine, read_segment, segment_path, sorted_by_partition, write_atomically, write_segment, Manifest, Part,
    Segment, SegmentMeta, ShadowError, COMPACT_MIN_SEGMENTS, GROUPS_MAX, GROUP_FIELD, MANIFEST, MANIFEST_VERSION, SEGMENT_BYTES_MAX,
    SEGMENT_ROWS,
};

/// Recent documents of one group, not yet a segment.
#[derive(Default)]
pub(super) struct Buffer {
    pub(super) group: Option<String>,
    pub(super) rows: ColumnBuffer,
    /// The rows as a batch, as last converted for a scan (dropped by any change).
    pub(super) cached: Option<RecordBatch>,
}

impl Buffer {
    pub(super) fn batch(&mut self) -> Result<RecordBatch, ArrowError> {
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
pub(super) enum Loc {
    Seg { id: u32, row: u32 },
    Buf { slot: u16, idx: u32 },
}

pub(super) struct ApState {
    /// Storage partitions feeding this analytics partition and how far each is applied.
    pub(super) cursors: Vec<(PartitionId, StreamPosition)>,
    pub(super) segments: BTreeMap<u32, Segment>,
    /// Slot 0 holds ungrouped documents; the others one group each.
    pub(super) buffers: Vec<Buffer>,
    pub(super) slots: HashMap<String, u16>,
    pub(super) keys: HashMap<Box<str>, Loc>,
    pub(super) next_id: u32,
    pub(super) dirty: bool,
    pub(super) last_checkpoint: Instant,
    pub(super) last_change: Instant,
    /// Files of replaced segments, removed once a manifest no longer names them.
    pub(super) garbage: Vec<PathBuf>,
    /// Rows per segment ([`SEGMENT_ROWS`]; smaller in tests).
    pub(super) segment_rows: usize,
    /// The collection's storage partitions, of which segments' rows are sorted by theirs.
    pub(super) partition_count: u16,
}

/// `batches` (each typed from its own rows) as one batch, each column typed as most of its
/// values are.
pub(super) fn merged(batches: &[RecordBatch]) -> Result<RecordBatch, ArrowError> {
    let fields: Vec<_> = batches.iter().flat_map(weighted_fields).collect();
    let schema = Arc::new(datafusion::arrow::datatypes::Schema::new(merge_fields(&fields)));
    let adapted = batches.iter().map(|b| adapt_batch(b, &schema)).collect::<Result<Vec<_>, _>>()?;
    datafusion::arrow::compute::concat_batches(&schema, &adapted)
}

/// `batch` in consecutive slices of at most `rows` rows (segments).
pub(super) fn chunks(batch: &RecordBatch, rows: usize) -> impl Iterator<Item = RecordBatch> + '_ {
    let rows = rows.max(1);
    (0..batch.num_rows()).step_by(rows).map(move |at| batch.slice(at, rows.min(batch.num_rows() - at)))
}

/// One analytics partition.
pub(super) struct Ap {
    pub(super) dir: PathBuf,
    pub(super) state: Mutex<ApState>,
}

impl ApState {
    pub(super) fn fresh(cursors: Vec<(PartitionId, StreamPosition)>, partition_count: u16) -> ApState {
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
            partition_count,
        }
    }

    pub(super) fn remove(&mut self, key: &str) {
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

    pub(super) fn upsert(&mut self, key: String, doc: ParsedDoc<'_>, dir: &Path) -> Result<(), ShadowError> {
        self.remove(&key);
        debug_assert!(!self.keys.contains_key(key.as_str()), "a key has at most one live row");
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
    pub(super) fn flush(&mut self, slot: usize, dir: &Path) -> Result<(), ShadowError> {
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
    pub(super) fn add_segment(&mut self, dir: &Path, batch: &RecordBatch, group: Option<String>) -> Result<(), ShadowError> {
        let (id, seg) = self.write_new_segment(dir, batch, group)?;
        let keys = key_column(&seg.batch, &segment_path(dir, id))?;
        for row in 0..seg.batch.num_rows() {
            if let Some(loc) = self.keys.get_mut(keys.value(row)) {
                *loc = Loc::Seg { id, row: row as u32 };
            }
        }
        self.segments.insert(id, seg);
        Ok(())
    }

    /// Writes `batch`, its rows in partition order, as the file of a new segment of `group`
    /// (not yet in `segments`).
    fn write_new_segment(&mut self, dir: &Path, batch: &RecordBatch, group: Option<String>) -> Result<(u32, Segment), ShadowError> {
        let id = self.next_id;
        let (batch, partitions) = sorted_by_partition(batch, self.partition_count)?;
        let (batch, checksum) = write_segment(dir, id, &batch)?;
        self.next_id += 1;
        let mut seg = Segment::new(batch, group, checksum);
        seg.partitions = partitions;
        Ok((id, seg))
    }

    /// Writes `batch` (rows of keys not live here, moved from another node) as a new
    /// segment and points its keys at their rows. Answers the rows it holds live.
    pub(super) fn adopt_segment(&mut self, dir: &Path, batch: &RecordBatch, group: Option<String>) -> Result<usize, ShadowError> {
        let (id, mut seg) = self.write_new_segment(dir, batch, group)?;
        let keys = key_column(&seg.batch, &segment_path(dir, id))?.clone();
        let mut live = 0;
        for row in 0..seg.batch.num_rows() {
            let key = keys.value(row);
            if self.keys.contains_key(key) {
                seg.kill(row);
            } else {
                self.keys.insert(key.into(), Loc::Seg { id, row: row as u32 });
                live += 1;
            }
        }
        self.segments.insert(id, seg);
        self.dirty = true;
        Ok(live)
    }

    /// Drops segments with no live rows; merges the group's small or mostly dead
    /// segments once there are [`COMPACT_MIN_SEGMENTS`] of them.
    pub(super) fn compact(&mut self, group: &Option<String>, dir: &Path) -> Result<(), ShadowError> {
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
        for id in &small {
            let Some(s) = self.segments.get(id) else { continue };
            let batch = match s.live_mask() {
                Some(mask) => datafusion::arrow::compute::filter_record_batch(&s.batch, &mask)?,
                None => s.batch.clone(),
            };
            live.push(batch);
        }
        for piece in chunks(&merged(&live)?, self.segment_rows) {
            self.add_segment(dir, &piece, group.clone())?;
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
    pub(super) fn checkpoint(&mut self, dir: &Path, aps: usize) -> Result<(), ShadowError> {
        for slot in 0..self.buffers.len() {
            self.flush(slot, dir)?;
        }
        // The manifest's positions cover exactly the segments it names.
        debug_assert!(self.buffers.iter().all(|b| b.rows.is_empty()), "every buffer becomes a segment before the manifest is written");
        debug_assert_eq!(self.live_rows(), self.keys.len(), "a key has at most one live row");
        let manifest = Manifest {
            version: MANIFEST_VERSION,
            analytics_partitions: aps,
            partitions: self.partition_count,
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

    /// How far storage partition `p` is applied (the start for a partition that does not
    /// feed this analytics partition).
    pub(super) fn cursor(&self, p: PartitionId) -> StreamPosition {
        debug_assert!(self.cursors.iter().any(|(q, _)| *q == p), "storage partition {p} does not feed this analytics partition");
        self.cursors.iter().find(|(q, _)| *q == p).map(|(_, c)| *c).unwrap_or_default()
    }

    /// Records that storage partition `p` is applied up to `pos`: call with the rows of
    /// every change up to there already in the state.
    pub(super) fn set_cursor(&mut self, p: PartitionId, pos: StreamPosition) {
        for (q, c) in &mut self.cursors {
            if *q == p {
                *c = pos;
            }
        }
    }

    /// Forgets every row of storage partition `p` (its history diverged): the partition is
    /// read again from the start.
    pub(super) fn reset_partition(&mut self, p: PartitionId) {
        let partitions = self.partition_count;
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

    /// Live rows in segments and buffers: one per key in `keys`.
    pub(super) fn live_rows(&self) -> usize {
        self.segments.values().map(Segment::live).sum::<usize>() + self.buffers.iter().map(|b| b.rows.len()).sum::<usize>()
    }

    /// The pieces a scan reads (segments, and buffers converted now), skipping those whose
    /// group is not `group`.
    pub(super) fn parts(&mut self, group: Option<&str>) -> Result<Vec<Part>, ArrowError> {
        let keep = |g: &Option<String>| match (group, g) {
            (Some(want), Some(have)) => want == have,
            _ => true,
        };
        debug_assert_eq!(self.live_rows(), self.keys.len(), "a key has at most one live row");
        let mut out = Vec::new();
        for s in self.segments.values().filter(|s| keep(&s.group) && s.live() > 0) {
            out.push(Part { batch: s.batch.clone(), live: s.live_mask(), partitions: s.partitions.clone() });
        }
        for b in self.buffers.iter_mut().filter(|b| keep(&b.group) && !b.rows.is_empty()) {
            out.push(Part { batch: b.batch()?, live: None, partitions: super::RowPartitions::default() });
        }
        Ok(out)
    }

    /// The live segments by id, with their batches and the cells their statistics are kept
    /// in (worked out by the caller, outside this partition's lock).
    pub(super) fn stats_cells(&self) -> Vec<(u32, RecordBatch, super::stats::StatsCell)> {
        self.segments.iter().filter(|(_, s)| s.live() > 0).map(|(&id, s)| (id, s.batch.clone(), Arc::clone(&s.stats))).collect()
    }

    /// Each top-level field of the rows with the number of values it holds.
    pub(super) fn fields(&self, into: &mut FieldWeights) {
        for s in self.segments.values().filter(|s| s.live() > 0) {
            into.add_batch(&s.batch);
        }
        for b in self.buffers.iter().filter(|b| !b.rows.is_empty()) {
            for (f, w) in b.rows.weighted_fields() {
                into.add(&f, w);
            }
        }
    }
}

impl Ap {
    /// Opens an analytics partition from its manifest; a missing, foreign or damaged one
    /// starts empty (the partition is then rebuilt from the change streams).
    pub(super) fn open(index: usize, dir: PathBuf, aps: usize, partitions: u16) -> Result<Ap, ShadowError> {
        std::fs::create_dir_all(&dir).map_err(io_at(&dir))?;
        let own: Vec<(PartitionId, StreamPosition)> =
            (0..partitions).filter(|p| usize::from(*p) % aps == index).map(|p| (p, StreamPosition::default())).collect();
        let state = match Self::load(&dir, aps, partitions) {
            Ok(Some(state)) => state,
            Ok(None) => ApState::fresh(own, partitions),
            Err(e) => {
                tracing::warn!(partition = index, error = %e, "analytics partition damaged: quarantined, rebuilding it from the change streams");
                metrics::counter!("shoal_analytics_rebuilds_total").increment(1);
                quarantine(&dir)?;
                ApState::fresh(own, partitions)
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

    pub(super) fn load(dir: &Path, aps: usize, partitions: u16) -> Result<Option<ApState>, ShadowError> {
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
        let mut state = ApState::fresh(m.cursors.iter().map(|&(p, seqno, uuid)| (p, StreamPosition { seqno, uuid })).collect(), partitions);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shadow::QUARANTINE_DIR;
    use serde_json::Value;

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
            // Four storage partitions: segments reorder their rows by partition.
            let mut st = ApState::fresh(vec![(0, StreamPosition::default())], 4);
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
                    Op::Checkpoint => st.checkpoint(dir.path(), 1).unwrap(),
                    Op::Reopen => {
                        st.checkpoint(dir.path(), 1).unwrap();
                        st = Ap::load(dir.path(), 1, 4).unwrap().unwrap();
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
            // Every segment, written here or read back, holds its rows in partition order,
            // and the partitions it remembers are the ones its keys hash to.
            for seg in st.segments.values() {
                let kept = seg.partitions.of(&seg.batch, 4).unwrap();
                let fresh = super::super::RowPartitions::default().of(&seg.batch, 4).unwrap();
                prop_assert!(kept.is_sorted());
                prop_assert_eq!(&*kept, &*fresh);
            }
        }
    }

    /// What a member sends for each table a statement opens does not grow with its
    /// segments: equal fields are summed.
    #[test]
    fn segments_of_one_shape_answer_each_field_once_with_all_its_values() {
        let dir = tempfile::tempdir().unwrap();
        let mut st = ApState::fresh(vec![(0, StreamPosition::default())], 1);
        st.segment_rows = 8;
        for i in 0..100 {
            let text = serde_json::json!({"n": i, "s": "x"}).to_string();
            st.upsert(format!("k{i}"), ParsedDoc::parse(text.as_bytes()), dir.path()).unwrap();
        }
        st.checkpoint(dir.path(), 1).unwrap();
        assert!(st.segments.len() > 1, "the rows span several segments");
        let mut summed = FieldWeights::default();
        st.fields(&mut summed);
        let fields = summed.into_vec();
        let mut names: Vec<&str> = fields.iter().map(|(f, _)| f.name().as_str()).collect();
        let all = names.len();
        names.dedup();
        assert_eq!(names.len(), all, "each field once: {names:?}");
        let n = fields.iter().find(|(f, _)| f.name() == "n").map(|(_, w)| *w);
        assert_eq!(n, Some(100), "the weights of the segments' fields are summed");
    }

    #[test]
    fn a_damaged_partition_is_quarantined_and_starts_empty() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("0");
        std::fs::create_dir_all(&dir).unwrap();
        let mut st = ApState::fresh(vec![(0, StreamPosition::default())], 1);
        for i in 0..10 {
            let text = serde_json::json!({"n": i}).to_string();
            st.upsert(format!("k{i}"), ParsedDoc::parse(text.as_bytes()), &dir).unwrap();
        }
        st.cursors[0].1 = StreamPosition { seqno: 10, uuid: 7 };
        st.checkpoint(&dir, 1).unwrap();
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
        let mut st = ApState::fresh(vec![(0, StreamPosition::default())], 1);
        for i in 0..10 {
            let text = serde_json::json!({"n": i}).to_string();
            st.upsert(format!("k{i}"), ParsedDoc::parse(text.as_bytes()), &dir).unwrap();
        }
        st.cursors[0].1 = StreamPosition { seqno: 10, uuid: 7 };
        assert!(st.checkpoint(&broken, 1).is_err(), "a checkpoint that cannot write is an error");
        st.checkpoint(&dir, 1).unwrap();
        let ap = Ap::open(0, dir.clone(), 1, 1).unwrap();
        let st = ap.state.lock();
        assert_eq!(st.keys.len(), 10, "the rows buffered when the flush failed were written by the next checkpoint");
        assert_eq!(st.cursors[0].1, StreamPosition { seqno: 10, uuid: 7 });
    }
}
