//! On-disk encodings. A partition is one fjall keyspace (`p0000`, `p0001`, …, in the
//! database of data path `p mod n`) shared by every collection: a unit that can be exported
//! in key order, ingested as files and dropped in O(1) (see ARCHITECTURE.md, "Why a
//! partition is a keyspace").
//!
//! All integers are big-endian so that byte order equals numeric order in the LSM tree.
//! Every key starts with the collection id and a tag, so a collection's documents, its
//! by-sequence index and its expiry index are each one contiguous range of the keyspace:
//!
//! | tag | key | value |
//! |---|---|---|
//! | `d` | collection `u32` · `d` · document key | [`DocMeta`] header (with the body's length and checksum) · document bytes |
//! | `e` | collection `u32` · `e` · expiry `u32` · document key | empty |
//! | `s` | collection `u32` · `s` · seqno `u64` | flags `u8` · cas `u64` · document key |

use crate::{Cas, SeqNo};

/// Tag of a document record.
pub const TAG_DOC: u8 = b'd';
/// Tag of an expiry entry.
pub const TAG_EXP: u8 = b'e';
/// Tag of a by-sequence entry.
pub const TAG_SEQ: u8 = b's';
/// Bytes before a key's own part: collection id and tag.
pub const PREFIX_BYTES: usize = 5;

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

/// Collection id and tag: the first bytes of every key of that kind.
pub fn prefix(collection: u32, tag: u8) -> [u8; PREFIX_BYTES] {
    let mut out = [0u8; PREFIX_BYTES];
    out[..4].copy_from_slice(&collection.to_be_bytes());
    out[4] = tag;
    out
}

/// The keys of one kind of one collection: `[prefix(collection, tag), prefix(collection, tag + 1))`.
pub fn tag_range(collection: u32, tag: u8) -> std::ops::Range<[u8; PREFIX_BYTES]> {
    prefix(collection, tag)..prefix(collection, tag + 1)
}

/// Every key of one collection in a partition: `[collection, collection + 1)` (ids are below `u32::MAX`).
pub fn collection_range(collection: u32) -> std::ops::Range<[u8; 4]> {
    debug_assert!(collection < u32::MAX);
    collection.to_be_bytes()..collection.saturating_add(1).to_be_bytes()
}

pub fn doc_key(collection: u32, key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(PREFIX_BYTES + key.len());
    out.extend_from_slice(&prefix(collection, TAG_DOC));
    out.extend_from_slice(key);
    out
}

/// The document key of a stored `d` key.
pub fn decode_doc_key(raw: &[u8]) -> Option<&[u8]> {
    (raw.get(4) == Some(&TAG_DOC)).then(|| &raw[PREFIX_BYTES..])
}

pub fn seq_key(collection: u32, seqno: SeqNo) -> [u8; PREFIX_BYTES + 8] {
    let mut out = [0u8; PREFIX_BYTES + 8];
    out[..PREFIX_BYTES].copy_from_slice(&prefix(collection, TAG_SEQ));
    out[PREFIX_BYTES..].copy_from_slice(&seqno.to_be_bytes());
    out
}

pub fn decode_seq_key(raw: &[u8]) -> Option<SeqNo> {
    if raw.len() != PREFIX_BYTES + 8 || raw[4] != TAG_SEQ {
        return None;
    }
    Some(u64::from_be_bytes(raw[PREFIX_BYTES..].try_into().ok()?))
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

pub fn exp_key(collection: u32, expiry: u32, key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(PREFIX_BYTES + 4 + key.len());
    out.extend_from_slice(&prefix(collection, TAG_EXP));
    out.extend_from_slice(&expiry.to_be_bytes());
    out.extend_from_slice(key);
    out
}

/// (expiry, document key)
pub fn decode_exp_key(raw: &[u8]) -> Option<(u32, &[u8])> {
    if raw.get(4) != Some(&TAG_EXP) {
        return None;
    }
    let expiry = u32::from_be_bytes(raw.get(PREFIX_BYTES..PREFIX_BYTES + 4)?.try_into().ok()?);
    Some((expiry, raw.get(PREFIX_BYTES + 4..)?))
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
        assert_eq!(decode_seq_key(&seq_key(3, 99)), Some(99));
        assert_eq!(decode_seq_key(&doc_key(3, b"12345678")), None);
        let v = seq_value(5, true, b"k");
        assert_eq!(decode_seq_value(&v), Some((5, true, &b"k"[..])));
    }

    #[test]
    fn exp_keys_sort_by_time() {
        assert!(exp_key(9, 5, b"z") < exp_key(9, 6, b"a"));
        assert_eq!(decode_exp_key(&exp_key(9, 5, b"z")), Some((5, &b"z"[..])));
    }

    #[test]
    fn each_kind_of_each_collection_is_one_range() {
        let keys = [doc_key(7, b"a"), doc_key(7, &[0xff; 250]), exp_key(7, u32::MAX, b"z"), seq_key(7, u64::MAX).to_vec()];
        for k in &keys {
            assert!(collection_range(7).contains(&k[..4].try_into().unwrap()));
            assert!(!collection_range(8).contains(&k[..4].try_into().unwrap()));
        }
        assert!(tag_range(7, TAG_DOC).start[..] <= keys[0][..] && keys[1][..] < tag_range(7, TAG_DOC).end[..]);
        assert_eq!(decode_doc_key(&keys[0]), Some(&b"a"[..]));
        assert_eq!(decode_doc_key(&keys[2]), None);
    }
}
