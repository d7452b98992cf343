//! On-disk encodings of the three keyspaces every collection has in each data path.
//!
//! All integers are big-endian so that byte order equals numeric order in the LSM tree.
//!
//! Documents are keyed by their key alone, not by partition: neighbouring keys stay
//! neighbours in the tree whatever the partition count, so reading a run of related
//! documents (an index scan with `include_docs`) touches the same blocks at 16 partitions
//! as at 256. A document's partition is a hash of its key and is kept in the `seq` entry.
//!
//! | keyspace | key | value |
//! |---|---|---|
//! | `docs` | document key | [`DocMeta`] header (with the body's length and checksum) · document bytes |
//! | `seq`  | partition `u16` · seqno `u64`  | flags `u8` · cas `u64` · document key |
//! | `exp`  | expiry `u32` · partition `u16` · document key | empty |

use crate::{Cas, PartitionId, SeqNo};

/// Version byte that leads every `docs` value; bump when the layout changes.
/// 2 adds the body's length and a checksum of the record; 1 (no check) is still read.
const DOC_FORMAT_VERSION: u8 = 2;
const DOC_FORMAT_V1: u8 = 1;
/// Bytes of the version-1 header: version, flags, cas, seqno, expiry.
const DOC_HEADER_V1_BYTES: usize = 1 + 1 + 8 + 8 + 4;
/// Bytes of the `docs` value header: version 1's, then the body's length (u32) and the
/// XXH3-64 of the header's other fields and the body.
pub const DOC_HEADER_BYTES: usize = DOC_HEADER_V1_BYTES + 4 + 8;
const FLAG_DELETED: u8 = 1;

/// Metadata stored in front of every document (and every tombstone).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DocMeta {
    pub cas: Cas,
    pub seqno: SeqNo,
    /// Absolute Unix seconds; 0 = never. For a tombstone: unused (0).
    pub expiry: u32,
    pub deleted: bool,
}

/// The record's checksum: the header's fields up to the length, then the body. The
/// storage engine checks its blocks and blobs, but not everything (a blob's length field,
/// for one): this catches what it lets through.
fn record_checksum(head: &[u8], body: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(body, xxhash_rust::xxh3::xxh3_64(head))
}

pub fn doc_value(meta: &DocMeta, body: &[u8]) -> Vec<u8> {
    debug_assert!(body.len() <= u32::MAX as usize);
    let mut out = Vec::with_capacity(DOC_HEADER_BYTES + body.len());
    out.push(DOC_FORMAT_VERSION);
    out.push(if meta.deleted { FLAG_DELETED } else { 0 });
    out.extend_from_slice(&meta.cas.to_be_bytes());
    out.extend_from_slice(&meta.seqno.to_be_bytes());
    out.extend_from_slice(&meta.expiry.to_be_bytes());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    let sum = record_checksum(&out, body);
    out.extend_from_slice(&sum.to_be_bytes());
    out.extend_from_slice(body);
    out
}

/// Splits a stored `docs` value into its metadata and the document bytes, checking its
/// length and checksum. `None` means the value is corrupt or of an unknown format.
pub fn decode_doc_value(raw: &[u8]) -> Option<(DocMeta, std::ops::Range<usize>)> {
    let header = raw.get(..DOC_HEADER_V1_BYTES)?;
    let meta = DocMeta {
        deleted: header[1] & FLAG_DELETED != 0,
        cas: u64::from_be_bytes(header[2..10].try_into().ok()?),
        seqno: u64::from_be_bytes(header[10..18].try_into().ok()?),
        expiry: u32::from_be_bytes(header[18..22].try_into().ok()?),
    };
    match header[0] {
        DOC_FORMAT_VERSION => {
            let len = u32::from_be_bytes(raw.get(22..26)?.try_into().ok()?) as usize;
            let sum = u64::from_be_bytes(raw.get(26..34)?.try_into().ok()?);
            let body = raw.get(DOC_HEADER_BYTES..)?;
            (body.len() == len && record_checksum(&raw[..26], body) == sum).then_some((meta, DOC_HEADER_BYTES..raw.len()))
        }
        DOC_FORMAT_V1 => Some((meta, DOC_HEADER_V1_BYTES..raw.len())),
        _ => None,
    }
}

pub fn seq_key(partition: PartitionId, seqno: SeqNo) -> [u8; 10] {
    let mut out = [0u8; 10];
    out[..2].copy_from_slice(&partition.to_be_bytes());
    out[2..].copy_from_slice(&seqno.to_be_bytes());
    out
}

pub fn decode_seq_key(raw: &[u8]) -> Option<(PartitionId, SeqNo)> {
    if raw.len() != 10 {
        return None;
    }
    Some((u16::from_be_bytes(raw[..2].try_into().ok()?), u64::from_be_bytes(raw[2..].try_into().ok()?)))
}

pub fn seq_value(cas: Cas, deleted: bool, key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(9 + key.len());
    out.push(if deleted { FLAG_DELETED } else { 0 });
    out.extend_from_slice(&cas.to_be_bytes());
    out.extend_from_slice(key);
    out
}

/// (cas, deleted, document key)
pub fn decode_seq_value(raw: &[u8]) -> Option<(Cas, bool, &[u8])> {
    let flags = *raw.first()?;
    let cas = u64::from_be_bytes(raw.get(1..9)?.try_into().ok()?);
    Some((cas, flags & FLAG_DELETED != 0, raw.get(9..)?))
}

pub fn exp_key(expiry: u32, partition: PartitionId, key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(6 + key.len());
    out.extend_from_slice(&expiry.to_be_bytes());
    out.extend_from_slice(&partition.to_be_bytes());
    out.extend_from_slice(key);
    out
}

/// (expiry, partition, document key)
pub fn decode_exp_key(raw: &[u8]) -> Option<(u32, PartitionId, &[u8])> {
    let expiry = u32::from_be_bytes(raw.get(..4)?.try_into().ok()?);
    let partition = u16::from_be_bytes(raw.get(4..6)?.try_into().ok()?);
    Some((expiry, partition, raw.get(6..)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doc_value_round_trips() {
        let meta = DocMeta { cas: 7, seqno: 9, expiry: 11, deleted: true };
        let raw = doc_value(&meta, b"{\"a\":1}");
        let (back, body) = decode_doc_value(&raw).unwrap();
        assert_eq!(back, meta);
        assert_eq!(&raw[body], b"{\"a\":1}");
        assert!(decode_doc_value(&raw[..5]).is_none());
    }

    #[test]
    fn any_flipped_bit_or_wrong_length_is_caught() {
        let meta = DocMeta { cas: 7, seqno: 9, expiry: 11, deleted: false };
        let raw = doc_value(&meta, br#"{"name":"Alice","n":[1,2,3]}"#);
        for byte in 0..raw.len() {
            for bit in 0..8 {
                let mut bad = raw.clone();
                bad[byte] ^= 1 << bit;
                assert!(decode_doc_value(&bad).is_none(), "a flip at byte {byte} bit {bit} went unseen");
            }
        }
        // A value longer or shorter than written (what a damaged blob length gives).
        let mut longer = raw.clone();
        longer.extend_from_slice(b"\0\0");
        assert!(decode_doc_value(&longer).is_none());
        assert!(decode_doc_value(&raw[..raw.len() - 1]).is_none());
    }

    #[test]
    fn version_1_records_are_still_read() {
        let mut v1 = vec![1u8, 0];
        v1.extend_from_slice(&5u64.to_be_bytes());
        v1.extend_from_slice(&6u64.to_be_bytes());
        v1.extend_from_slice(&0u32.to_be_bytes());
        v1.extend_from_slice(b"{}");
        let (meta, body) = decode_doc_value(&v1).unwrap();
        assert_eq!((meta.cas, meta.seqno, &v1[body]), (5, 6, &b"{}"[..]));
    }

    #[test]
    fn seq_keys_sort_by_seqno() {
        assert!(seq_key(1, 255) < seq_key(1, 256));
        assert!(seq_key(1, u64::MAX) < seq_key(2, 0));
        assert_eq!(decode_seq_key(&seq_key(3, 99)), Some((3, 99)));
        let v = seq_value(5, true, b"k");
        assert_eq!(decode_seq_value(&v), Some((5, true, &b"k"[..])));
    }

    #[test]
    fn exp_keys_sort_by_time() {
        assert!(exp_key(5, 9, b"z") < exp_key(6, 0, b"a"));
        assert_eq!(decode_exp_key(&exp_key(5, 9, b"z")), Some((5, 9, &b"z"[..])));
    }
}
