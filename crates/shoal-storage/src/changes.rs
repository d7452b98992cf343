//! The change stream: every partition's changes in seqno order, readable from any point.
//!
//! Readers start from a [`StreamPosition`]: backfill comes from the by-sequence index on disk
//! (which keeps the latest change of each key), then live changes from the partition's
//! in-memory tail. Both are read under the partition's sequencer lock together with the
//! high seqno, so the hand-over has no gap and no duplicate.

use std::sync::Arc;

use base64::Engine as _;
use bytes::Bytes;
use tokio::sync::watch;

use crate::error::{ChangesError, ReadError};
use crate::partition::{Partition, ReadLimit};
use crate::{Cas, PartitionId, SeqNo};

/// One change of one document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    pub partition: PartitionId,
    pub seqno: SeqNo,
    pub key: Bytes,
    pub cas: Cas,
    pub deleted: bool,
    /// Absolute Unix seconds; 0 = never.
    pub expiry: u32,
    /// The document as of this change; `None` for deletions, or when not asked for.
    pub value: Option<Bytes>,
}

/// Where a reader stands in one partition's history: after `seqno`, on history `uuid`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamPosition {
    pub seqno: SeqNo,
    pub uuid: u64,
}

impl StreamPosition {
    /// Whether a reader at this position has everything of a partition now at `now`: at or
    /// past its high seqno, on its history (a position past the high of a copy rolled back
    /// below it, or on another history, has not: `follow` finds where the two part).
    pub fn reaches(self, now: StreamPosition) -> bool {
        self.seqno >= now.seqno && (self.seqno == 0 || self.uuid == now.uuid)
    }
}

/// A reader of one partition's change stream; see the module documentation.
pub struct PartitionSubscription {
    partition: Arc<Partition>,
    since: SeqNo,
    /// The end of the snapshot the last read came from (see [`PartitionSubscription::consistent`]).
    snapshot_end: SeqNo,
    high: watch::Receiver<SeqNo>,
}

impl PartitionSubscription {
    pub(crate) fn new(partition: Arc<Partition>, since: SeqNo) -> Self {
        let high = partition.high_watch();
        PartitionSubscription { partition, since, snapshot_end: since, high }
    }

    pub fn partition(&self) -> PartitionId {
        self.partition.id()
    }

    /// The position after the last change handed out.
    pub fn position(&self) -> StreamPosition {
        StreamPosition { seqno: self.since, uuid: self.partition.uuid() }
    }

    /// Up to `max` changes (and about [`crate::CHANGES_READ_MAX_BYTES`]) after the position,
    /// without waiting; empty when caught up.
    pub fn try_next(&mut self, max: usize, include_docs: bool) -> Result<Vec<Change>, ChangesError> {
        let (changes, next, end) = self.partition.read_changes(self.since, ReadLimit::items(max), include_docs).map_err(changes_error)?;
        debug_assert!(next <= end, "a read never runs past its snapshot");
        self.since = next;
        self.snapshot_end = self.snapshot_end.max(end);
        Ok(changes)
    }

    /// The snapshot marker of what was read last: a reader that has applied every change
    /// handed out holds a consistent state of the partition (as of seqno `snapshot_end`)
    /// only when its position has reached it. A backfill from disk carries only each key's
    /// latest change, so its middle is not a state the partition ever had.
    pub fn snapshot_end(&self) -> SeqNo {
        self.snapshot_end
    }

    /// Whether everything handed out so far makes a consistent state (see
    /// [`PartitionSubscription::snapshot_end`]): a replica acknowledges or promotes only then.
    pub fn consistent(&self) -> bool {
        self.since >= self.snapshot_end
    }

    /// Up to `max` changes after the position, waiting until there is at least one.
    pub async fn next(&mut self, max: usize, include_docs: bool) -> Result<Vec<Change>, ChangesError> {
        loop {
            let changes = self.try_next(max, include_docs)?;
            if !changes.is_empty() {
                return Ok(changes);
            }
            let since = self.since;
            if self.high.wait_for(|h| *h > since).await.is_err() {
                return Err(ChangesError::CollectionDropped);
            }
        }
    }
}

/// How a change-stream read's storage error reaches stream readers.
pub(crate) fn changes_error(e: ReadError) -> ChangesError {
    match e {
        ReadError::CollectionDropped => ChangesError::CollectionDropped,
        ReadError::Busy => ChangesError::Busy,
        ReadError::NotMyPartition(n) => ChangesError::NotMyPartition(n),
        ReadError::Engine(e) => ChangesError::Engine(e),
        _ => ChangesError::Corrupt,
    }
}

/// A partition whose history diverged from a reader's position: the reader must discard
/// what it has after `seqno`, and reads on from there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rollback {
    pub partition: PartitionId,
    pub seqno: SeqNo,
}

const TOKEN_VERSION: u8 = 1;
/// Longest token accepted, in characters (4096 partitions fit well inside).
pub const TOKEN_MAX_CHARS: usize = 128 * 1024;

/// A position in every partition of a collection; travels as an opaque string token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FeedPosition {
    pub partitions: Vec<StreamPosition>,
}

impl FeedPosition {
    pub fn start(partitions: u16) -> Self {
        FeedPosition { partitions: vec![StreamPosition::default(); usize::from(partitions)] }
    }

    /// URL-safe base64 of: version, then for each partition that has moved, its index,
    /// seqno (LEB128) and uuid.
    pub fn to_token(&self) -> String {
        let mut raw = vec![TOKEN_VERSION];
        put_varint(&mut raw, self.partitions.len() as u64);
        for (p, pos) in self.partitions.iter().enumerate() {
            if pos.seqno == 0 {
                continue;
            }
            put_varint(&mut raw, p as u64);
            put_varint(&mut raw, pos.seqno);
            raw.extend_from_slice(&pos.uuid.to_be_bytes());
        }
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw)
    }

    pub fn from_token(token: &str, partitions: u16) -> Result<Self, ChangesError> {
        if token.len() > TOKEN_MAX_CHARS {
            return Err(ChangesError::InvalidToken("too long"));
        }
        let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(token)
            .map_err(|_| ChangesError::InvalidToken("not a token this server issued"))?;
        let mut rest = raw.as_slice();
        let bad = ChangesError::InvalidToken;
        match rest.split_first() {
            Some((&TOKEN_VERSION, tail)) => rest = tail,
            _ => return Err(bad("unknown token version")),
        }
        let count = get_varint(&mut rest).ok_or(bad("truncated token"))?;
        if count != u64::from(partitions) {
            return Err(bad("token is for a different partition count"));
        }
        let mut pos = FeedPosition::start(partitions);
        while !rest.is_empty() {
            let p = get_varint(&mut rest).ok_or(bad("truncated token"))?;
            let seqno = get_varint(&mut rest).ok_or(bad("truncated token"))?;
            let uuid_bytes: [u8; 8] = rest.get(..8).and_then(|b| b.try_into().ok()).ok_or(bad("truncated token"))?;
            rest = &rest[8..];
            let slot = usize::try_from(p).ok().and_then(|p| pos.partitions.get_mut(p)).ok_or(bad("partition out of range"))?;
            // A position at 0 names no history, so its uuid means nothing.
            *slot = if seqno == 0 { StreamPosition::default() } else { StreamPosition { seqno, uuid: u64::from_be_bytes(uuid_bytes) } };
        }
        Ok(pos)
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn get_varint(input: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = input.split_first()?;
        *input = rest;
        v |= u64::from(b & 0x7f).checked_shl(shift)?;
        if b & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_position_reaches_a_partition_at_its_high_on_its_history() {
        let at = |seqno, uuid| StreamPosition { seqno, uuid };
        // (reader, partition now, reaches)
        let table = [
            (at(10, 1), at(10, 1), true),
            (at(12, 1), at(10, 1), true),
            (at(9, 1), at(10, 1), false),
            (at(12, 1), at(10, 2), false), // past the high of a copy rolled back, another history
            (at(0, 0), at(0, 7), true),    // nothing read, nothing there
            (at(0, 0), at(3, 7), false),
        ];
        for (reader, now, want) in table {
            assert_eq!(reader.reaches(now), want, "{reader:?} against {now:?}");
        }
    }

    #[test]
    fn token_round_trips() {
        let mut pos = FeedPosition::start(128);
        pos.partitions[3] = StreamPosition { seqno: 300, uuid: 0xdead_beef };
        pos.partitions[127] = StreamPosition { seqno: u64::MAX, uuid: 1 };
        let back = FeedPosition::from_token(&pos.to_token(), 128).unwrap();
        assert_eq!(back, pos);
    }

    #[test]
    fn bad_tokens_are_refused() {
        let good = FeedPosition::start(16).to_token();
        assert!(FeedPosition::from_token(&good, 128).is_err());
        for bad in ["", "!!!", "AAAA", &"A".repeat(TOKEN_MAX_CHARS + 1)] {
            assert!(FeedPosition::from_token(bad, 16).is_err(), "{bad:?}");
        }
        let mut raw = vec![TOKEN_VERSION, 16, 200, 1];
        raw.extend_from_slice(&[0; 8]);
        let out_of_range = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw);
        assert!(FeedPosition::from_token(&out_of_range, 16).is_err());
    }
}
