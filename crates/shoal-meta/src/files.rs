//! Framed, checksummed records and atomically replaced files: the two ways the metadata log
//! writes to disk.
//!
//! A record is `magic u32 · length u32 · xxh3_64(payload) u64 · payload` (little endian).
//! The magic lets `scan_records` tell a torn tail (nothing valid after the first bad record:
//! the last write never finished, and since every write is fsynced before it is
//! acknowledged, it was never acknowledged) from corruption in the middle (a valid record
//! after a bad one: something acknowledged was damaged, which must stop the node).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

/// "SHML": marks the start of every record.
const RECORD_MAGIC: u32 = 0x5348_4D4C;
pub(crate) const RECORD_HEADER_BYTES: usize = 16;
/// A record larger than this is taken as damage, not data: one append of metadata commands
/// (a whole partition map of 1,024 partitions is ~50 KiB of JSON) stays far below it.
pub const RECORD_MAX_BYTES: usize = 64 * 1024 * 1024;

/// Why the metadata files cannot be used.
#[derive(Debug, Error)]
pub enum StoreError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path}: corrupt: {why}")]
    Corrupt { path: PathBuf, why: String },
    #[error("the metadata store failed an earlier write and refuses more until it is reopened")]
    Poisoned,
    #[error("a blocking metadata task failed: {0}")]
    Task(String),
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(io::Error) -> StoreError + '_ {
    move |source| StoreError::Io { path: path.to_path_buf(), source }
}

/// One framed record.
pub(crate) fn frame(payload: &[u8]) -> Vec<u8> {
    debug_assert!(payload.len() <= RECORD_MAX_BYTES);
    let mut out = Vec::with_capacity(RECORD_HEADER_BYTES + payload.len());
    out.extend_from_slice(&RECORD_MAGIC.to_le_bytes());
    // `payload.len() <= RECORD_MAX_BYTES < u32::MAX`, checked by every caller.
    out.extend_from_slice(&u32::try_from(payload.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(&xxh3_64(payload).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

/// The record starting at `pos` if it is whole and its checksum holds: (payload, end).
fn record_at(bytes: &[u8], pos: usize) -> Option<(&[u8], usize)> {
    if u32_at(bytes, pos)? != RECORD_MAGIC {
        return None;
    }
    let len = usize::try_from(u32_at(bytes, pos + 4)?).ok()?;
    if len > RECORD_MAX_BYTES {
        return None;
    }
    let hash = u64_at(bytes, pos + 8)?;
    let start = pos + RECORD_HEADER_BYTES;
    let payload = bytes.get(start..start + len)?;
    (xxh3_64(payload) == hash).then_some((payload, start + len))
}

/// What a scan of a record file found.
pub(crate) struct Scanned<'a> {
    pub records: Vec<&'a [u8]>,
    /// Where the valid records end; bytes past it are a torn tail to cut off.
    pub valid_end: usize,
}

/// Reads every record of a file's bytes. A bad record with nothing valid after it is a torn
/// tail (`valid_end` stops before it); a bad record followed by a valid one is corruption.
pub(crate) fn scan_records<'a>(bytes: &'a [u8], path: &Path) -> Result<Scanned<'a>, StoreError> {
    let mut records = Vec::new();
    let mut pos = 0;
    while pos < bytes.len() {
        match record_at(bytes, pos) {
            Some((payload, next)) => {
                records.push(payload);
                pos = next;
            }
            None => {
                if let Some(later) = (pos + 1..bytes.len()).find(|&p| record_at(bytes, p).is_some()) {
                    return Err(StoreError::Corrupt {
                        path: path.to_path_buf(),
                        why: format!("damaged record at byte {pos} before a valid one at byte {later}"),
                    });
                }
                break;
            }
        }
    }
    Ok(Scanned { records, valid_end: pos })
}

/// Fsyncs a directory, so a rename or a new file in it survives a crash.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(dir))
}

/// Replaces `path` with `records` (each framed) atomically: a temporary file is written and
/// fsynced, renamed over `path`, and the directory fsynced. A crash leaves the old or the new
/// file, never a mix.
pub(crate) fn replace_file(path: &Path, records: &[&[u8]]) -> Result<(), StoreError> {
    let tmp = path.with_extension("tmp");
    let mut file = OpenOptions::new().write(true).create(true).truncate(true).open(&tmp).map_err(io_err(&tmp))?;
    for payload in records {
        if payload.len() > RECORD_MAX_BYTES {
            return Err(StoreError::Corrupt {
                path: path.to_path_buf(),
                why: format!("a record of {} bytes is over the limit", payload.len()),
            });
        }
        file.write_all(&frame(payload)).map_err(io_err(&tmp))?;
    }
    file.sync_all().map_err(io_err(&tmp))?;
    drop(file);
    fs::rename(&tmp, path).map_err(io_err(path))?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// Reads a file written by `replace_file`: `None` if it does not exist. Since it was replaced
/// atomically, anything short of whole, valid records is corruption.
pub(crate) fn read_file(path: &Path) -> Result<Option<Vec<Vec<u8>>>, StoreError> {
    let bytes = match fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(StoreError::Io { path: path.to_path_buf(), source: e }),
    };
    let scanned = scan_records(&bytes, path)?;
    if scanned.valid_end != bytes.len() {
        return Err(StoreError::Corrupt { path: path.to_path_buf(), why: "a replaced file ends in a damaged record".into() });
    }
    Ok(Some(scanned.records.into_iter().map(<[u8]>::to_vec).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torn_tail_is_cut_and_damage_in_the_middle_is_refused() {
        let p = Path::new("x");
        let mut bytes = frame(b"one");
        bytes.extend(frame(b"two"));
        let whole = bytes.len();
        // Every proper prefix of the last record is a torn tail.
        for cut in whole - frame(b"two").len() + 1..whole {
            let s = scan_records(&bytes[..cut], p).unwrap();
            assert_eq!(s.records, vec![b"one".as_slice()]);
            assert_eq!(s.valid_end, frame(b"one").len());
        }
        // A flipped bit in the last payload: torn too (nothing valid follows).
        let mut flipped = bytes.clone();
        flipped[whole - 1] ^= 1;
        assert_eq!(scan_records(&flipped, p).unwrap().records.len(), 1);
        // A flipped bit in the first record, with a valid one after it: corruption.
        let mut middle = bytes.clone();
        middle[RECORD_HEADER_BYTES] ^= 1;
        assert!(matches!(scan_records(&middle, p), Err(StoreError::Corrupt { .. })));
        assert_eq!(scan_records(&bytes, p).unwrap().records.len(), 2);
    }
}
