//! The stream a partition's copy travels in between nodes (hand-written: a plain framing
//! that no crate does better, and a parser we fuzz — `fuzz/fuzz_targets/copy_stream.rs`):
//! `"SHC1"`, `u32` header length, the header (JSON [`CopyHeader`]), then records of `u32`
//! key length (1..`END`), `u32` value length, key, value — an export's records
//! ([`crate::PartitionExport`]); then `u32` `END`, `u64` records, `u64` bytes. Integers are
//! little-endian. A stream without its end (the source died, the link broke) or whose end
//! does not match what came is refused whole by [`FrameDecoder::finish`].

use std::collections::VecDeque;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::ExportHeader;

/// Largest header (collections and their histories).
pub const COPY_HEADER_MAX_BYTES: usize = 4 * 1024 * 1024;
/// Largest record: a key and a document with its metadata.
pub const COPY_RECORD_MAX_BYTES: usize = 2 * crate::DOC_MAX_BYTES;

const MAGIC: &[u8; 4] = b"SHC1";
/// The key length that marks the end of the records.
const END: u32 = u32::MAX;

/// The first frame of a copy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyHeader {
    pub export: ExportHeader,
    /// About how many bytes of records follow (for progress).
    pub bytes_estimate: u64,
    /// A copy by files: the files and memtable items the records carry (`crate::files`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files: Option<crate::FileManifest>,
}

/// Why a copy stream cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FrameError {
    #[error("not a partition copy (bad magic)")]
    Magic,
    #[error("header of {0} bytes is over the limit")]
    HeaderTooLarge(usize),
    #[error("malformed header: {0}")]
    Header(String),
    #[error("a record of {0} bytes is over the limit")]
    RecordTooLarge(u64),
    #[error("a record with an empty key")]
    EmptyKey,
    #[error("the copy says it carried {said} records and {said_bytes} bytes; {got} and {got_bytes} arrived")]
    Count { said: u64, said_bytes: u64, got: u64, got_bytes: u64 },
    #[error("bytes after the end of the copy")]
    Trailing,
    #[error("the copy ended before its end marker")]
    Truncated,
}

/// One unit of a copy stream.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame {
    Header(CopyHeader),
    Record(Bytes, Bytes),
    End,
}

/// Writes a copy stream: the header, records, the end.
#[derive(Default)]
pub struct FrameEncoder {
    records: u64,
    bytes: u64,
}

impl FrameEncoder {
    pub fn header(out: &mut BytesMut, header: &CopyHeader) {
        let json = serde_json::to_vec(header).unwrap_or_default();
        out.put_slice(MAGIC);
        out.put_u32_le(json.len() as u32);
        out.put_slice(&json);
    }

    pub fn record(&mut self, out: &mut BytesMut, key: &[u8], value: &[u8]) {
        self.record_pieces(out, &[key], &[value]);
    }

    /// A record whose key and value are each given in pieces, written one after another
    /// into the frame (no record assembled first).
    pub fn record_pieces(&mut self, out: &mut BytesMut, key: &[&[u8]], value: &[&[u8]]) {
        let key_len: usize = key.iter().map(|k| k.len()).sum();
        let value_len: usize = value.iter().map(|v| v.len()).sum();
        debug_assert!(key_len > 0 && key_len < END as usize);
        out.reserve(8 + key_len + value_len);
        out.put_u32_le(key_len as u32);
        out.put_u32_le(value_len as u32);
        for piece in key.iter().chain(value) {
            out.put_slice(piece);
        }
        self.records += 1;
        self.bytes += (key_len + value_len) as u64;
    }

    /// A record's frame without its value: the value follows as its own bytes, so a large
    /// one (a file's chunk) goes out without being copied into the frame's buffer.
    pub fn record_head(&mut self, out: &mut BytesMut, key: &[u8], value_len: usize) {
        debug_assert!(!key.is_empty() && key.len() < END as usize);
        out.put_u32_le(key.len() as u32);
        out.put_u32_le(value_len as u32);
        out.put_slice(key);
        self.records += 1;
        self.bytes += (key.len() + value_len) as u64;
    }

    pub fn end(&self, out: &mut BytesMut) {
        out.put_u32_le(END);
        out.put_u64_le(self.records);
        out.put_u64_le(self.bytes);
    }
}

/// Reads a copy stream pushed in chunks of any size.
///
/// The chunks are kept as they came ([`FrameDecoder::push_bytes`]), and a record that lies
/// within one chunk is a slice of it, not a copy: a copy's files arrive as 256 KiB records
/// in 1 MiB reads, and copying each into one growing buffer was 6.5 % of the receiving
/// node's CPU during a swap (perf, bench/results/2026-11-29-issue14-receive-path.md). Only a
/// record that spans two chunks is gathered into bytes of its own.
#[derive(Default)]
pub struct FrameDecoder {
    /// The bytes not decoded yet, in order; none of them empty.
    chunks: VecDeque<Bytes>,
    /// Their length, summed.
    len: usize,
    started: bool,
    ended: bool,
    records: u64,
    bytes: u64,
    /// Copies follow one another (see [`FrameDecoder::chained`]).
    chained: bool,
}

impl FrameDecoder {
    /// A decoder of copies sent one after another in one stream (a group of index
    /// partitions from one source): each copy's end is answered as [`Frame::End`] whatever
    /// follows it, and [`FrameDecoder::next_copy`] then reads the next copy's header. Each
    /// copy is checked against its own end marker; [`FrameDecoder::finish`] after the last.
    pub fn chained() -> FrameDecoder {
        FrameDecoder { chained: true, ..FrameDecoder::default() }
    }

    /// After a chained copy's end: the next frame is the next copy's header.
    pub fn next_copy(&mut self) -> Result<(), FrameError> {
        if !self.chained || !self.ended {
            return Err(FrameError::Truncated);
        }
        (self.started, self.ended, self.records, self.bytes) = (false, false, 0, 0);
        Ok(())
    }

    /// Adds a chunk, copied.
    pub fn push(&mut self, chunk: &[u8]) {
        self.push_bytes(Bytes::copy_from_slice(chunk));
    }

    /// Adds a chunk as it is: the records decoded from it share its memory.
    pub fn push_bytes(&mut self, chunk: Bytes) {
        if !chunk.is_empty() {
            self.len += chunk.len();
            self.chunks.push_back(chunk);
        }
    }

    /// The first `N` bytes not decoded yet, if that many came.
    fn peek<const N: usize>(&self) -> Option<[u8; N]> {
        if self.len < N {
            return None;
        }
        let mut out = [0u8; N];
        let mut at = 0;
        for chunk in &self.chunks {
            let n = chunk.len().min(N - at);
            out[at..at + n].copy_from_slice(&chunk[..n]);
            at += n;
            if at == N {
                break;
            }
        }
        Some(out)
    }

    /// The next `n` bytes (no more than it holds): a slice of the first chunk where it
    /// holds them all, else gathered from the chunks they span.
    fn take(&mut self, n: usize) -> Bytes {
        debug_assert!(n <= self.len);
        self.len -= n;
        if let Some(front) = self.chunks.front_mut() {
            if front.len() > n {
                return front.split_to(n);
            }
            if front.len() == n {
                return self.chunks.pop_front().unwrap_or_default();
            }
        }
        let mut out = BytesMut::with_capacity(n);
        while out.len() < n {
            let Some(front) = self.chunks.front_mut() else { break };
            let want = n - out.len();
            if front.len() > want {
                out.extend_from_slice(&front.split_to(want));
            } else {
                out.extend_from_slice(front);
                self.chunks.pop_front();
            }
        }
        out.freeze()
    }

    /// Drops the next `n` bytes (no more than it holds).
    fn skip(&mut self, mut n: usize) {
        debug_assert!(n <= self.len);
        self.len -= n;
        while n > 0 {
            let Some(front) = self.chunks.front_mut() else { break };
            if front.len() > n {
                front.advance(n);
                return;
            }
            n -= front.len();
            self.chunks.pop_front();
        }
    }

    /// The next whole frame, or `None` until more bytes come.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        if self.ended {
            return if self.len == 0 { Ok(None) } else { Err(FrameError::Trailing) };
        }
        if !self.started {
            if let Some(magic) = self.peek::<4>() {
                if &magic != MAGIC {
                    return Err(FrameError::Magic);
                }
            }
            let Some(head) = self.peek::<8>() else { return Ok(None) };
            let len = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
            if len > COPY_HEADER_MAX_BYTES {
                return Err(FrameError::HeaderTooLarge(len));
            }
            if self.len < 8 + len {
                return Ok(None);
            }
            self.skip(8);
            let json = self.take(len);
            let header: CopyHeader = serde_json::from_slice(&json).map_err(|e| FrameError::Header(e.to_string()))?;
            self.started = true;
            return Ok(Some(Frame::Header(header)));
        }
        let Some(head) = self.peek::<4>() else { return Ok(None) };
        let key_len = u32::from_le_bytes(head);
        if key_len == END {
            let Some(end) = self.peek::<20>() else { return Ok(None) };
            self.skip(20);
            let said = u64::from_le_bytes([end[4], end[5], end[6], end[7], end[8], end[9], end[10], end[11]]);
            let said_bytes = u64::from_le_bytes([end[12], end[13], end[14], end[15], end[16], end[17], end[18], end[19]]);
            if said != self.records || said_bytes != self.bytes {
                return Err(FrameError::Count { said, said_bytes, got: self.records, got_bytes: self.bytes });
            }
            self.ended = true;
            return if self.len == 0 || self.chained { Ok(Some(Frame::End)) } else { Err(FrameError::Trailing) };
        }
        if key_len == 0 {
            return Err(FrameError::EmptyKey);
        }
        let Some(head) = self.peek::<8>() else { return Ok(None) };
        let value_len = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        let size = u64::from(key_len) + u64::from(value_len);
        if size > COPY_RECORD_MAX_BYTES as u64 {
            return Err(FrameError::RecordTooLarge(size));
        }
        let (key_len, value_len) = (key_len as usize, value_len as usize);
        if self.len < 8 + key_len + value_len {
            return Ok(None);
        }
        self.skip(8);
        let key = self.take(key_len);
        let value = self.take(value_len);
        self.records += 1;
        self.bytes += size;
        Ok(Some(Frame::Record(key, value)))
    }

    /// At the end of the input: whether the copy was whole.
    pub fn finish(&self) -> Result<(), FrameError> {
        if self.ended && self.len == 0 {
            Ok(())
        } else if self.ended {
            Err(FrameError::Trailing)
        } else {
            Err(FrameError::Truncated)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> CopyHeader {
        CopyHeader { export: ExportHeader { partition: 3, collections: Vec::new() }, bytes_estimate: 10, files: None }
    }

    fn stream(records: &[(&[u8], &[u8])]) -> Vec<u8> {
        let mut out = BytesMut::new();
        FrameEncoder::header(&mut out, &header());
        let mut e = FrameEncoder::default();
        for (k, v) in records {
            e.record(&mut out, k, v);
        }
        e.end(&mut out);
        out.to_vec()
    }

    fn decode_in_chunks(bytes: &[u8], chunk: usize) -> Result<Vec<Frame>, FrameError> {
        let mut d = FrameDecoder::default();
        let mut frames = Vec::new();
        for piece in bytes.chunks(chunk.max(1)) {
            d.push(piece);
            while let Some(f) = d.next_frame()? {
                frames.push(f);
            }
        }
        d.finish()?;
        Ok(frames)
    }

    #[test]
    fn a_copy_reads_back_whatever_the_chunking() {
        let bytes = stream(&[(b"a", b"1"), (b"bb", b""), (b"c", &[7u8; 300])]);
        for chunk in [1, 2, 3, 7, 64, bytes.len()] {
            let frames = decode_in_chunks(&bytes, chunk).unwrap();
            assert_eq!(frames.len(), 5, "chunk {chunk}");
            assert_eq!(frames[0], Frame::Header(header()));
            assert_eq!(frames[2], Frame::Record(Bytes::from_static(b"bb"), Bytes::new()));
            assert_eq!(frames[4], Frame::End);
        }
    }

    /// A record sent as its head and then its value, uncopied, is the same stream.
    #[test]
    fn a_record_head_then_its_value_is_the_same_record() {
        let records: [(&[u8], &[u8]); 3] = [(b"a", b"1"), (b"big", &[9u8; 5000]), (b"c", b"")];
        let mut out = BytesMut::new();
        FrameEncoder::header(&mut out, &header());
        let mut e = FrameEncoder::default();
        for (k, v) in records {
            e.record_head(&mut out, k, v.len());
            out.put_slice(v);
        }
        e.end(&mut out);
        assert_eq!(out.to_vec(), stream(&records));
    }

    /// A record inside one pushed chunk is a slice of it; one across two chunks is whole.
    #[test]
    fn records_within_a_chunk_share_its_memory() {
        let bytes = Bytes::from(stream(&[(b"a", &[1u8; 1000]), (b"b", &[2u8; 1000])]));
        let cut = bytes.len() - 900;
        let mut d = FrameDecoder::default();
        d.push_bytes(bytes.slice(..cut));
        d.push_bytes(bytes.slice(cut..));
        assert!(matches!(d.next_frame(), Ok(Some(Frame::Header(_)))));
        let inside = |v: &Bytes| bytes.as_ptr_range().contains(&v.as_ptr());
        match d.next_frame() {
            Ok(Some(Frame::Record(k, v))) => {
                assert_eq!((&k[..], &v[..]), (&b"a"[..], &[1u8; 1000][..]));
                assert!(inside(&v), "the first record lies in the first chunk: not copied");
            }
            other => panic!("{other:?}"),
        }
        match d.next_frame() {
            Ok(Some(Frame::Record(k, v))) => {
                assert_eq!((&k[..], &v[..]), (&b"b"[..], &[2u8; 1000][..]));
                assert!(!inside(&v), "the second spans both chunks: gathered");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(d.next_frame(), Ok(Some(Frame::End)));
        assert_eq!(d.finish(), Ok(()));
    }

    #[test]
    fn a_cut_or_altered_copy_is_refused() {
        let bytes = stream(&[(b"a", b"1"), (b"b", b"2")]);
        for cut in 0..bytes.len() {
            assert!(decode_in_chunks(&bytes[..cut], 5).is_err(), "a copy cut at {cut} of {} was accepted", bytes.len());
        }
        let mut extra = bytes.clone();
        extra.push(0);
        assert_eq!(decode_in_chunks(&extra, 4).unwrap_err(), FrameError::Trailing);
        let mut magic = bytes.clone();
        magic[0] = b'X';
        assert_eq!(decode_in_chunks(&magic, 4).unwrap_err(), FrameError::Magic);
        // The end marker's count must match: a record dropped in the middle is found.
        let short = stream(&[(b"a", b"1")]);
        let mut lying = short[..short.len() - 16].to_vec();
        lying.extend_from_slice(&2u64.to_le_bytes());
        lying.extend_from_slice(&2u64.to_le_bytes());
        assert!(matches!(decode_in_chunks(&lying, 4).unwrap_err(), FrameError::Count { .. }));
    }

    /// Copies chained in one stream read back each whole, whatever the chunking (a chunk
    /// holding one copy's end and the next's start); a cut after any copy but the last, or
    /// one altered copy, is refused; an unchained decoder refuses what follows an end.
    #[test]
    fn chained_copies_read_back_one_after_another_and_each_is_checked() {
        let copies: Vec<Vec<(&[u8], &[u8])>> = vec![vec![(b"a", b"1"), (b"b", b"22")], vec![], vec![(b"c", b"333")]];
        let whole: Vec<u8> = copies.iter().flat_map(|c| stream(c)).collect();
        let read = |bytes: &[u8], step: usize| -> Result<Vec<Vec<(Bytes, Bytes)>>, FrameError> {
            let mut d = FrameDecoder::chained();
            for chunk in bytes.chunks(step) {
                d.push(chunk);
            }
            let mut got = Vec::new();
            for i in 0..copies.len() {
                if i > 0 {
                    d.next_copy()?;
                }
                match d.next_frame()? {
                    Some(Frame::Header(_)) => {}
                    None => return Err(FrameError::Truncated),
                    Some(other) => panic!("{other:?} where a header was due"),
                }
                let mut records = Vec::new();
                loop {
                    match d.next_frame()? {
                        Some(Frame::Record(k, v)) => records.push((k, v)),
                        Some(Frame::End) => break,
                        Some(Frame::Header(_)) => panic!("a header within a copy"),
                        None => return Err(FrameError::Truncated),
                    }
                }
                got.push(records);
            }
            d.finish()?;
            Ok(got)
        };
        for step in [1, 3, 7, whole.len()] {
            let got = read(&whole, step).unwrap();
            let want: Vec<Vec<(Bytes, Bytes)>> =
                copies.iter().map(|c| c.iter().map(|(k, v)| (Bytes::copy_from_slice(k), Bytes::copy_from_slice(v))).collect()).collect();
            assert_eq!(got, want, "chunks of {step}");
        }
        let first = stream(&copies[0]).len();
        assert_eq!(read(&whole[..first], 5), Err(FrameError::Truncated));
        let mut altered = whole.clone();
        altered[first + 12] ^= 0xff; // the second copy's header length
        assert!(read(&altered, 5).is_err());
        let mut plain = FrameDecoder::default();
        plain.push(&whole);
        assert!(matches!(plain.next_frame(), Ok(Some(Frame::Header(_)))));
        while let Ok(Some(Frame::Record(..))) = plain.next_frame() {}
        assert!(plain.next_copy().is_err());
    }

    #[test]
    fn oversized_lengths_are_refused_before_buffering() {
        let mut out = BytesMut::new();
        out.put_slice(MAGIC);
        out.put_u32_le(u32::MAX - 1);
        let mut d = FrameDecoder::default();
        d.push(&out);
        assert!(matches!(d.next_frame(), Err(FrameError::HeaderTooLarge(_))));
        let mut out = BytesMut::new();
        FrameEncoder::header(&mut out, &header());
        out.put_u32_le(1);
        out.put_u32_le(u32::MAX - 1);
        let mut d = FrameDecoder::default();
        d.push(&out);
        assert!(matches!(d.next_frame(), Ok(Some(Frame::Header(_)))));
        assert!(matches!(d.next_frame(), Err(FrameError::RecordTooLarge(_))));
        let mut out = BytesMut::new();
        FrameEncoder::header(&mut out, &header());
        out.put_u32_le(0);
        out.put_u32_le(1);
        let mut d = FrameDecoder::default();
        d.push(&out);
        assert!(matches!(d.next_frame(), Ok(Some(Frame::Header(_)))));
        assert_eq!(d.next_frame(), Err(FrameError::EmptyKey));
    }
}
