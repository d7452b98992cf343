//! A storage partition's shadow rows moved with its copy (issue 42, item 2): the node that
//! receives a partition by files takes the partition's analytics rows from the sender's
//! shadow as Arrow batches — cut from its segments and buffers, never re-read from the
//! documents — and writes them as its own segments, with the change-stream position they
//! hold; its maintainer then follows the partition's stream from there.
//!
//! The order keeps it exact: the receiver asks for the rows *before* the partition's
//! export, so their position is at or below the export's snapshot, and the receiver's copy
//! has every change after it. While the copy is under way the partition is *incoming*
//! ([`ShadowManager::incoming`]): the maintainer neither drops nor follows it, so nothing
//! reads the new copy's documents into the shadow before the rows are adopted. A copy that
//! fails drops the guard without adopting, and the partition is built from the stream as
//! before.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray, BooleanArray, RecordBatch};
use datafusion::arrow::buffer::BooleanBuffer;
use datafusion::arrow::error::ArrowError;
use parking_lot::Mutex;
use shoal_storage::{PartitionId, StreamPosition};

use super::{Part, Shadow, ShadowError, ShadowManager};

/// Most bytes of shadow rows one partition's move carries in memory; a partition with more
/// is built from its change stream on the receiver instead.
pub const SHADOW_MOVE_MAX_BYTES: usize = 1 << 30;

/// The analytics rows of one storage partition, as of `position` in its change stream.
pub struct PartitionRows {
    pub position: StreamPosition,
    /// The rows, in batches of one group each (the group's value of
    /// [`super::GROUP_FIELD`], or `None`); the key column first.
    pub batches: Vec<(Option<String>, RecordBatch)>,
}

impl PartitionRows {
    pub fn rows(&self) -> usize {
        self.batches.iter().map(|(_, b)| b.num_rows()).sum()
    }

    pub fn bytes(&self) -> usize {
        self.batches.iter().map(|(_, b)| b.get_array_memory_size()).sum()
    }
}

impl Shadow {
    /// Partition `p`'s live rows and the position they hold, taken at one moment (under the
    /// lock of its analytics partition; the batches are cut outside it).
    pub fn export_partition(&self, p: PartitionId) -> Result<PartitionRows, ShadowError> {
        let count = self.coll.partition_count();
        if usize::from(p) >= usize::from(count) {
            return Err(ShadowError::Corrupt { path: self.roots[0].clone(), reason: format!("no partition {p}") });
        }
        let ap = &self.aps[usize::from(p) % self.aps.len()];
        let (position, parts) = {
            let mut st = ap.state.lock();
            let position = st.cursor(p);
            (position, st.grouped_parts()?)
        };
        let mut batches = Vec::new();
        for (group, part) in parts {
            let of = part.partitions.of(&part.batch, count)?;
            let mask = BooleanArray::new(
                BooleanBuffer::collect_bool(part.batch.num_rows(), |r| of[r] == p && part.live.as_ref().is_none_or(|l| l.value(r))),
                None,
            );
            if mask.true_count() > 0 {
                batches.push((group, datafusion::arrow::compute::filter_record_batch(&part.batch, &mask)?));
            }
        }
        Ok(PartitionRows { position, batches })
    }

    /// Takes partition `p`'s rows from another node's shadow: any rows of `p` here go, the
    /// rows become segments (merged per group), and the partition is applied up to their
    /// position. Refuses rows whose keys are not of `p`. Answers the rows adopted.
    pub fn adopt_partition(&self, p: PartitionId, rows: PartitionRows) -> Result<usize, ShadowError> {
        let count = self.coll.partition_count();
        let ap = &self.aps[usize::from(p) % self.aps.len()];
        let mut by_group: HashMap<Option<String>, Vec<RecordBatch>> = HashMap::new();
        for (group, batch) in rows.batches {
            check_rows(&batch, p, count)?;
            by_group.entry(group).or_default().push(batch);
        }
        let mut st = ap.state.lock();
        st.reset_partition(p);
        let mut adopted = 0;
        for (group, batches) in by_group {
            let rows = st.segment_rows;
            for piece in super::ap::chunks(&super::ap::merged(&batches)?, rows) {
                adopted += st.adopt_segment(&ap.dir, &piece, group.clone())?;
            }
        }
        st.set_cursor(p, rows.position);
        st.dirty = true;
        st.last_change = std::time::Instant::now();
        self.applied[usize::from(p)].store(rows.position.seqno, Ordering::Release);
        drop(st);
        metrics::counter!("shoal_analytics_rows_adopted_total").increment(adopted as u64);
        Ok(adopted)
    }
}

/// A received batch must have the key column first, no null key, and only keys of `p`.
fn check_rows(batch: &RecordBatch, p: PartitionId, count: u16) -> Result<(), ShadowError> {
    let bad = |reason: String| ShadowError::Arrow(ArrowError::InvalidArgumentError(reason));
    let schema = batch.schema();
    if schema.fields().first().map(|f| f.name().as_str()) != Some(crate::schema::KEY_COLUMN) {
        return Err(bad("moved analytics rows without the key column first".into()));
    }
    let keys = batch.column(0).as_string_opt::<i32>().ok_or_else(|| bad("moved analytics rows whose keys are not strings".into()))?;
    if keys.null_count() > 0 {
        return Err(bad("moved analytics rows with a null key".into()));
    }
    if let Some(k) = keys.iter().flatten().find(|k| shoal_storage::partition_of(k.as_bytes(), count) != p) {
        return Err(bad(format!("moved analytics rows of partition {p} hold key {k:?} of another partition")));
    }
    Ok(())
}

/// Storage partitions being copied in: their shadow rows come with the copy.
#[derive(Default)]
pub(super) struct Incoming(Mutex<HashMap<PartitionId, usize>>);

impl Incoming {
    pub(super) fn contains(&self, p: PartitionId) -> bool {
        self.0.lock().contains_key(&p)
    }
}

/// While alive, partition `p` is incoming: no shadow drops or follows it.
pub struct IncomingGuard {
    set: Arc<Incoming>,
    p: PartitionId,
}

impl Drop for IncomingGuard {
    fn drop(&mut self) {
        let mut set = self.set.0.lock();
        if let Some(n) = set.get_mut(&self.p) {
            *n -= 1;
            if *n == 0 {
                set.remove(&self.p);
            }
        }
    }
}

impl ShadowManager {
    /// Marks storage partition `p` as being copied in until the guard drops.
    pub fn incoming(&self, p: PartitionId) -> IncomingGuard {
        *self.incoming.0.lock().entry(p).or_default() += 1;
        IncomingGuard { set: Arc::clone(&self.incoming), p }
    }

    /// Every attached shadow's rows of partition `p`, by collection name.
    pub fn export_partition(&self, p: PartitionId) -> Result<Vec<(String, PartitionRows)>, ShadowError> {
        let shadows: Vec<Arc<Shadow>> = self.shadows.lock().values().cloned().collect();
        shadows.iter().map(|s| Ok((s.coll.name().to_string(), s.export_partition(p)?))).collect()
    }
}

/// Encodes one batch as an Arrow IPC stream (what a move carries).
pub fn encode_batch(batch: &RecordBatch) -> Result<Vec<u8>, ShadowError> {
    let mut out = Vec::new();
    let mut w = datafusion::arrow::ipc::writer::StreamWriter::try_new(&mut out, &batch.schema())?;
    w.write(batch)?;
    w.finish()?;
    drop(w);
    Ok(out)
}

/// Decodes [`encode_batch`]'s bytes: exactly one batch.
pub fn decode_batch(bytes: &[u8]) -> Result<RecordBatch, ShadowError> {
    let mut r = datafusion::arrow::ipc::reader::StreamReader::try_new(std::io::Cursor::new(bytes), None)?;
    let batch = r.next().ok_or_else(|| ShadowError::Arrow(ArrowError::IpcError("moved analytics rows without a batch".into())))??;
    if r.next().is_some() {
        return Err(ShadowError::Arrow(ArrowError::IpcError("moved analytics rows with more than one batch".into())));
    }
    Ok(batch)
}

impl super::ap::ApState {
    /// What a scan reads, each piece with its group.
    pub(super) fn grouped_parts(&mut self) -> Result<Vec<(Option<String>, Part)>, ArrowError> {
        let mut out = Vec::new();
        for s in self.segments.values().filter(|s| s.live() > 0) {
            out.push((s.group.clone(), Part { batch: s.batch.clone(), live: s.live_mask(), partitions: s.partitions.clone() }));
        }
        for b in self.buffers.iter_mut().filter(|b| !b.rows.is_empty()) {
            let group = b.group.clone();
            out.push((group, Part { batch: b.batch()?, live: None, partitions: super::RowPartitions::default() }));
        }
        Ok(out)
    }
}
