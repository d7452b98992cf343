//! How the index database stores what it keeps besides definitions: cursor and build-scan
//! records under `meta`, back-index values, and entry keys.

use crate::IndexError;
use serde::{Deserialize, Serialize};
use shoal_storage::{PartitionId, SeqNo, StreamPosition};

pub(super) fn legacy_def_key(id: u32) -> Vec<u8> {
    format!("def/{id:08x}").into_bytes()
}

pub(super) fn cursor_key(id: u32, p: PartitionId) -> Vec<u8> {
    format!("cur/{id:08x}/{p:04x}").into_bytes()
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

pub(super) fn entry_key(prefix: &[u8], doc_key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(prefix.len() + doc_key.len());
    k.extend_from_slice(prefix);
    k.extend_from_slice(doc_key);
    k
}
