//! Segments and their files: the immutable batches an analytics partition keeps, the
//! manifest that names them, and writing, reading, checking and quarantining files.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use datafusion::arrow::array::{AsArray, BooleanArray, RecordBatch, StringArray};
use datafusion::arrow::buffer::BooleanBuffer;
use serde::{Deserialize, Serialize};
use shoal_storage::{PartitionId, SeqNo};

use super::{io_at, ShadowError, QUARANTINE_DIR};

/// What the manifest of one analytics partition records.
#[derive(Serialize, Deserialize)]
pub(super) struct Manifest {
    pub(super) version: u32,
    pub(super) analytics_partitions: usize,
    pub(super) partitions: u16,
    /// `(partition, seqno, uuid)`: every change up to here is in the segments.
    pub(super) cursors: Vec<(PartitionId, SeqNo, u64)>,
    pub(super) segments: Vec<SegmentMeta>,
    pub(super) next_id: u32,
}

#[derive(Serialize, Deserialize)]
pub(super) struct SegmentMeta {
    pub(super) id: u32,
    pub(super) rows: usize,
    pub(super) group: Option<String>,
    /// Rows no longer live (updated or deleted since the segment was written).
    pub(super) dead: Vec<u32>,
    /// XXH3-64 of the segment file.
    pub(super) checksum: u64,
}

/// One immutable batch of rows and which of them are dead.
pub(super) struct Segment {
    pub(super) batch: RecordBatch,
    pub(super) group: Option<String>,
    pub(super) dead: Vec<u64>,
    pub(super) dead_count: usize,
    /// XXH3-64 of its file.
    pub(super) checksum: u64,
    /// Each row's storage partition, worked out from its key once (see [`super::Part`]).
    pub(super) partitions: super::RowPartitions,
    /// Its columns' statistics, worked out when first asked ([`super::stats`]).
    pub(super) stats: super::stats::StatsCell,
}

impl Segment {
    pub(super) fn new(batch: RecordBatch, group: Option<String>, checksum: u64) -> Segment {
        let words = batch.num_rows().div_ceil(64);
        Segment {
            batch,
            group,
            dead: vec![0; words],
            dead_count: 0,
            checksum,
            partitions: super::RowPartitions::default(),
            stats: Arc::default(),
        }
    }

    pub(super) fn live(&self) -> usize {
        self.batch.num_rows() - self.dead_count
    }

    pub(super) fn is_dead(&self, row: usize) -> bool {
        self.dead.get(row / 64).is_some_and(|w| w & (1 << (row % 64)) != 0)
    }

    pub(super) fn kill(&mut self, row: usize) {
        if let Some(w) = self.dead.get_mut(row / 64) {
            let bit = 1u64 << (row % 64);
            if *w & bit == 0 {
                *w |= bit;
                self.dead_count += 1;
            }
        }
    }

    /// Which rows are live, when some are not.
    pub(super) fn live_mask(&self) -> Option<BooleanArray> {
        (self.dead_count > 0).then(|| BooleanArray::new(BooleanBuffer::collect_bool(self.batch.num_rows(), |r| !self.is_dead(r)), None))
    }

    pub(super) fn dead_rows(&self) -> Vec<u32> {
        (0..self.batch.num_rows()).filter(|&r| self.is_dead(r)).map(|r| r as u32).collect()
    }
}

pub(super) fn segment_path(dir: &Path, id: u32) -> PathBuf {
    dir.join(format!("{id}.arrow"))
}

/// A segment's key column (its first).
pub(super) fn key_column<'a>(batch: &'a RecordBatch, path: &Path) -> Result<&'a StringArray, ShadowError> {
    batch
        .column(0)
        .as_string_opt::<i32>()
        .ok_or_else(|| ShadowError::Corrupt { path: path.to_path_buf(), reason: "the first column is not the key".into() })
}

/// Writes a segment file (temporary name, fsync, rename) and answers the batch as read
/// back from it with its checksum.
pub(super) fn write_segment(dir: &Path, id: u32, batch: &RecordBatch) -> Result<(RecordBatch, u64), ShadowError> {
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
pub(super) fn read_segment(path: &Path, checksum: Option<u64>) -> Result<(RecordBatch, u64), ShadowError> {
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
pub(super) fn quarantine(dir: &Path) -> Result<(), ShadowError> {
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
pub(super) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), ShadowError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::to_batch;
    use crate::rows::{ColumnBuffer, ParsedDoc};
    use serde_json::Value;

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
