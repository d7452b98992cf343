//! How the index database stores what it keeps besides definitions.
//!
//! Each index partition is one keyspace, `i{index id}.{part}`, holding everything of that
//! part, so that it can be copied as files and dropped whole: its entries
//! (`FWD ++ composite key ++ document key`, empty values), its back entries (`BACK ++
//! document key` → the composite keys the document contributed to this part) and its
//! cursors (`CURSOR ++ data partition` → position and entry count). A build's key-order read
//! of the documents, shared by every part of an index, is recorded under `meta`.

use crate::IndexError;
use serde::{Deserialize, Serialize};
use shoal_storage::{PartitionId, SeqNo, StreamPosition};
use std::ops::Bound;

/// Tag of an entry in a part's keyspace.
const FWD: u8 = 0x01;
/// Tag of a back entry.
const BACK: u8 = 0x02;
/// Tag of a cursor.
const CURSOR: u8 = 0x03;

pub(super) fn legacy_def_key(id: u32) -> Vec<u8> {
    format!("def/{id:08x}").into_bytes()
}

/// Where nodes before index partitions kept cursors (removed at open).
pub(super) const LEGACY_CURSOR_PREFIX: &[u8] = b"cur/";

/// The keyspace of part `part` of index `id`.
pub(super) fn part_keyspace_name(id: u32, part: u16) -> String {
    format!("i{id}.{part}")
}

/// The keyspace of index `id` on this node that names, per document, the parts that may
/// hold its entries (derived from the parts' back entries; not part of any unit).
pub(super) fn located_keyspace_name(id: u32) -> String {
    format!("w{id}")
}

/// The index id of a keyspace named by [`located_keyspace_name`].
pub(super) fn parse_located_keyspace_name(name: &str) -> Option<u32> {
    name.strip_prefix('w')?.parse().ok()
}

/// A `located` value: part numbers, two bytes each.
pub(super) fn encode_parts(parts: &[u16]) -> Vec<u8> {
    parts.iter().flat_map(|p| p.to_be_bytes()).collect()
}

pub(super) fn decode_parts(v: &[u8]) -> Result<Vec<u16>, IndexError> {
    if !v.len().is_multiple_of(2) {
        return Err(IndexError::Corrupt("located entry".into()));
    }
    Ok(v.chunks_exact(2).map(|b| u16::from_be_bytes([b[0], b[1]])).collect())
}

/// The index id and part of a keyspace named by [`part_keyspace_name`].
pub(super) fn parse_part_keyspace_name(name: &str) -> Option<(u32, u16)> {
    let (id, part) = name.strip_prefix('i')?.split_once('.')?;
    Some((id.parse().ok()?, part.parse().ok()?))
}

/// The index id of a keyspace of the layout before index partitions (`x{id}` entries,
/// `b{id}` back entries): such an index is built again in parts.
pub(super) fn parse_legacy_keyspace_name(name: &str) -> Option<u32> {
    name.strip_prefix(['x', 'b']).and_then(|n| n.parse().ok())
}

pub(super) fn cursor_key(p: PartitionId) -> [u8; 3] {
    let [a, b] = p.to_be_bytes();
    [CURSOR, a, b]
}

pub(super) fn cursor_prefix() -> [u8; 1] {
    [CURSOR]
}

/// The data partition of a key under [`cursor_prefix`].
pub(super) fn cursor_partition(key: &[u8]) -> Option<PartitionId> {
    Some(u16::from_be_bytes(key.get(1..3)?.try_into().ok()?))
}

pub(super) fn back_key(doc_key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(doc_key.len() + 1);
    k.push(BACK);
    k.extend_from_slice(doc_key);
    k
}

pub(super) fn back_prefix() -> [u8; 1] {
    [BACK]
}

/// The entry (`composite key ++ document key`) of a key of a part's keyspace, if it is one.
pub(super) fn entry_of(key: &[u8]) -> Option<&[u8]> {
    key.strip_prefix(&[FWD])
}

/// Bounds over entries as bounds over a part's keyspace.
pub(super) fn fwd_range(lo: &Bound<Vec<u8>>, hi: &Bound<Vec<u8>>) -> (Bound<Vec<u8>>, Bound<Vec<u8>>) {
    let tagged = |b: &[u8]| {
        let mut k = Vec::with_capacity(b.len() + 1);
        k.push(FWD);
        k.extend_from_slice(b);
        k
    };
    let lo = match lo {
        Bound::Unbounded => Bound::Included(vec![FWD]),
        Bound::Included(b) => Bound::Included(tagged(b)),
        Bound::Excluded(b) => Bound::Excluded(tagged(b)),
    };
    let hi = match hi {
        Bound::Unbounded => Bound::Excluded(vec![FWD + 1]),
        Bound::Included(b) => Bound::Included(tagged(b)),
        Bound::Excluded(b) => Bound::Excluded(tagged(b)),
    };
    (lo, hi)
}

pub(super) fn scan_key(id: u32) -> Vec<u8> {
    format!("scan/{id:08x}").into_bytes()
}

/// A build's read of the documents in key order: the change-stream positions taken before
/// it began (where the index goes on from once it is done), and how far it got.
#[derive(Clone, Debug)]
pub(super) struct ScanState {
    pub(super) start: Vec<StreamPosition>,
    pub(super) after: Option<bytes::Bytes>,
    pub(super) scanned: u64,
    pub(super) total: u64,
}

#[derive(Serialize, Deserialize)]
pub(super) struct ScanRecord {
    start: Vec<(SeqNo, u64)>,
    after: Option<Vec<u8>>,
    scanned: u64,
    total: u64,
}

impl ScanState {
    pub(super) fn encode(&self) -> Vec<u8> {
        let record = ScanRecord {
            start: self.start.iter().map(|p| (p.seqno, p.uuid)).collect(),
            after: self.after.as_ref().map(|a| a.to_vec()),
            scanned: self.scanned,
            total: self.total,
        };
        // Serialising this plain record cannot fail.
        serde_json::to_vec(&record).unwrap_or_default()
    }

    pub(super) fn decode(v: &[u8], partitions: usize) -> Result<ScanState, IndexError> {
        let r: ScanRecord = serde_json::from_slice(v).map_err(|e| IndexError::Corrupt(format!("build scan record: {e}")))?;
        if r.start.len() != partitions {
            return Err(IndexError::Corrupt("build scan record: partition count".into()));
        }
        Ok(ScanState {
            start: r.start.into_iter().map(|(seqno, uuid)| StreamPosition { seqno, uuid }).collect(),
            after: r.after.map(bytes::Bytes::from),
            scanned: r.scanned,
            total: r.total,
        })
    }
}

pub(super) fn encode_cursor(pos: StreamPosition, items: i64) -> [u8; 24] {
    let mut out = [0u8; 24];
    out[..8].copy_from_slice(&pos.seqno.to_be_bytes());
    out[8..16].copy_from_slice(&pos.uuid.to_be_bytes());
    out[16..].copy_from_slice(&items.to_be_bytes());
    out
}

pub(super) fn decode_cursor(v: &[u8]) -> Option<(StreamPosition, i64)> {
    let seqno = u64::from_be_bytes(v.get(..8)?.try_into().ok()?);
    let uuid = u64::from_be_bytes(v.get(8..16)?.try_into().ok()?);
    let items = i64::from_be_bytes(v.get(16..24)?.try_into().ok()?);
    Some((StreamPosition { seqno, uuid }, items))
}

/// The back-index value: the composite keys a document contributed, each length-prefixed.
pub(super) fn encode_list(entries: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(entries.iter().map(|e| e.len() + 2).sum());
    for e in entries {
        out.extend_from_slice(&(e.len() as u16).to_be_bytes());
        out.extend_from_slice(e);
    }
    out
}

pub(super) fn decode_list(mut v: &[u8]) -> Result<Vec<Vec<u8>>, IndexError> {
    let mut out = Vec::new();
    while !v.is_empty() {
        let len =
            v.get(..2).map(|b| usize::from(u16::from_be_bytes([b[0], b[1]]))).ok_or_else(|| IndexError::Corrupt("back entry".into()))?;
        let e = v.get(2..2 + len).ok_or_else(|| IndexError::Corrupt("back entry".into()))?;
        out.push(e.to_vec());
        v = &v[2 + len..];
    }
    Ok(out)
}

/// The key of an entry in a part's keyspace: `FWD ++ composite key ++ document key`.
pub(super) fn entry_key(prefix: &[u8], doc_key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(1 + prefix.len() + doc_key.len());
    k.push(FWD);
    k.extend_from_slice(prefix);
    k.extend_from_slice(doc_key);
    k
}
