//! One way to follow change streams, for everything derived from them (indexes, the
//! analytics shadow, inferred schemas).
//!
//! A [`ChangeConsumer`] keeps, per partition, the position up to which it has applied the
//! stream, stored with the data those changes made. [`follow`] reads each partition from
//! that position, sends the consumer back to the start of a partition whose history
//! diverged from it, reads in batches bounded by [`FollowLimits`], and hands each batch to
//! the consumer together with the position it ends at; the consumer commits its data and
//! that position in one write, so a position never runs ahead of the data it covers.
//!
//! Where the changes come from is a [`ChangeSource`]: the local [`Collection`], or
//! [`Fetched`], changes fetched beforehand from partitions on other nodes (an index
//! partition follows every data partition wherever its active lives).

use crate::changes::{Change, PartitionSubscription, StreamPosition};
use crate::collection::Collection;
use crate::error::ChangesError;
use crate::{PartitionId, SeqNo};

/// The change streams of one collection's partitions.
pub trait ChangeSource {
    type Reader: ChangeReader;

    fn partition_count(&self) -> u16;

    /// Every partition's position now: its high seqno on its current history. A consumer
    /// whose position equals it has nothing to read.
    fn positions(&self) -> Vec<StreamPosition>;

    /// A reader of `partition` after `from`. When the partition's history diverged from
    /// `from` (or tombstones were purged past it), also where history is shared up to: the
    /// reader then starts there, and a consumer must discard what it applied after it.
    fn subscribe(&self, partition: PartitionId, from: StreamPosition) -> Result<(Self::Reader, Option<SeqNo>), ChangesError>;
}

/// A reader of one partition's change stream (see [`PartitionSubscription`]).
pub trait ChangeReader {
    /// Up to `max` changes after the position, without waiting; empty when caught up.
    fn try_next(&mut self, max: usize, include_docs: bool) -> Result<Vec<Change>, ChangesError>;

    /// The position after the last change handed out.
    fn position(&self) -> StreamPosition;

    /// The snapshot marker: everything handed out makes a consistent state of the partition
    /// only once the position has reached it.
    fn snapshot_end(&self) -> SeqNo;
}

impl ChangeSource for Collection {
    type Reader = PartitionSubscription;

    fn partition_count(&self) -> u16 {
        Collection::partition_count(self)
    }

    fn positions(&self) -> Vec<StreamPosition> {
        Collection::positions(self)
    }

    fn subscribe(&self, partition: PartitionId, from: StreamPosition) -> Result<(PartitionSubscription, Option<SeqNo>), ChangesError> {
        Collection::subscribe(self, partition, from)
    }
}

impl ChangeReader for PartitionSubscription {
    fn try_next(&mut self, max: usize, include_docs: bool) -> Result<Vec<Change>, ChangesError> {
        PartitionSubscription::try_next(self, max, include_docs)
    }

    fn position(&self) -> StreamPosition {
        PartitionSubscription::position(self)
    }

    fn snapshot_end(&self) -> SeqNo {
        PartitionSubscription::snapshot_end(self)
    }
}

/// Changes of some partitions fetched from elsewhere — the partitions' active copies on
/// other nodes, for an index partition that follows every data partition wherever it lives
/// — as a [`ChangeSource`], so that [`follow`] and its consumer treat them like local
/// changes. The fetching (async, over the network) happens before; [`follow`] then runs on
/// what was fetched, without waiting.
///
/// A partition answers what was fetched for it only to a consumer still at the position it
/// was fetched from; a consumer elsewhere (it rolled back, or another round moved it) reads
/// nothing this time and is fetched for again. A fetch that found the consumer's position
/// off the partition's history carries where history is shared up to, and the consumer
/// rolls back as it would for a local partition.
#[derive(Clone, Debug, Default)]
pub struct Fetched {
    partition_count: u16,
    parts: std::collections::HashMap<PartitionId, FetchedPart>,
}

/// What was fetched of one partition.
#[derive(Clone, Debug, Default)]
pub struct FetchedPart {
    /// The consumer's position the fetch asked from.
    pub from: StreamPosition,
    /// Where history is shared up to, when `from` is not on the partition's history.
    pub rollback: Option<SeqNo>,
    /// The changes after `from`, in seqno order.
    pub changes: Vec<Change>,
    /// Where the stream stands after `changes`.
    pub end: StreamPosition,
    /// The snapshot marker of the read (see [`ChangeReader::snapshot_end`]).
    pub snapshot_end: SeqNo,
    /// The partition's high seqno on its history when the fetch was answered.
    pub high: StreamPosition,
}

impl Fetched {
    pub fn new(partition_count: u16) -> Fetched {
        Fetched { partition_count, parts: std::collections::HashMap::new() }
    }

    /// Records what was fetched of `partition`.
    pub fn insert(&mut self, partition: PartitionId, part: FetchedPart) {
        debug_assert!(partition < self.partition_count, "partition {partition} of {}", self.partition_count);
        debug_assert!(part.changes.iter().all(|c| c.partition == partition && c.seqno > part.from.seqno && c.seqno <= part.end.seqno));
        self.parts.insert(partition, part);
    }

    /// How many changes were fetched, over every partition.
    pub fn changes(&self) -> usize {
        self.parts.values().map(|p| p.changes.len()).sum()
    }

    /// The partitions fetched, in order.
    pub fn partitions(&self) -> Vec<PartitionId> {
        let mut out: Vec<PartitionId> = self.parts.keys().copied().collect();
        out.sort_unstable();
        out
    }
}

/// A reader of what was fetched of one partition.
pub struct FetchedReader {
    changes: std::vec::IntoIter<Change>,
    position: StreamPosition,
    end: StreamPosition,
    snapshot_end: SeqNo,
}

impl ChangeSource for Fetched {
    type Reader = FetchedReader;

    fn partition_count(&self) -> u16 {
        self.partition_count
    }

    /// The fetched partitions' high seqnos; a partition not fetched answers the default.
    fn positions(&self) -> Vec<StreamPosition> {
        (0..self.partition_count).map(|p| self.parts.get(&p).map(|f| f.high).unwrap_or_default()).collect()
    }

    fn subscribe(&self, partition: PartitionId, from: StreamPosition) -> Result<(FetchedReader, Option<SeqNo>), ChangesError> {
        let nothing = |at: StreamPosition| FetchedReader { changes: Vec::new().into_iter(), position: at, end: at, snapshot_end: 0 };
        match self.parts.get(&partition) {
            Some(part) if part.from == from => match part.rollback {
                Some(shared) => Ok((nothing(from), Some(shared))),
                None => Ok((
                    FetchedReader {
                        changes: part.changes.clone().into_iter(),
                        position: from,
                        end: part.end,
                        snapshot_end: part.snapshot_end,
                    },
                    None,
                )),
            },
            _ => Ok((nothing(from), None)),
        }
    }
}

impl ChangeReader for FetchedReader {
    fn try_next(&mut self, max: usize, _include_docs: bool) -> Result<Vec<Change>, ChangesError> {
        let out: Vec<Change> = self.changes.by_ref().take(max).collect();
        if self.changes.len() == 0 {
            // Everything handed out: the position is where the fetch ended (past changes the
            // active no longer holds, or onto its history when nothing changed).
            self.position = self.end;
        } else if let Some(last) = out.last() {
            self.position = StreamPosition { seqno: last.seqno, uuid: self.end.uuid };
        }
        Ok(out)
    }

    fn position(&self) -> StreamPosition {
        self.position
    }

    fn snapshot_end(&self) -> SeqNo {
        self.snapshot_end
    }
}

/// One partition's part of a batch.
#[derive(Clone, Debug)]
pub struct PartitionBatch {
    pub partition: PartitionId,
    /// The changes after the consumer's position, in seqno order (possibly none: a
    /// backfill's position can move past changes it no longer holds).
    pub changes: Vec<Change>,
    /// Where the stream stands after `changes`: the consumer stores it with their data.
    pub position: StreamPosition,
    /// Whether a consumer that has applied everything up to `position` holds a state the
    /// partition really had (see [`PartitionSubscription::consistent`]): a backfill from
    /// disk carries each key's latest change only, so its middle is not one.
    pub consistent: bool,
}

/// Something kept from change streams, with its position per partition.
pub trait ChangeConsumer {
    type Error: From<ChangesError>;

    /// How far the consumer has applied `partition`, as stored with its data.
    fn position(&self, partition: PartitionId) -> StreamPosition;

    /// `partition`'s history diverged from the consumer's position (an unclean restart, or
    /// tombstones purged past it); history is shared up to `shared`. The consumer forgets
    /// everything it holds from the partition and its position there goes back to the start:
    /// [`follow`] then reads the partition again from the beginning.
    fn rollback(&mut self, partition: PartitionId, shared: SeqNo) -> Result<(), Self::Error>;

    /// Applies a batch of one or more partitions, committing the data and every part's
    /// `position` in one write: afterwards [`ChangeConsumer::position`] answers each part's
    /// position, and a crash leaves either all of it or none.
    fn apply(&mut self, batch: &[PartitionBatch]) -> Result<(), Self::Error>;
}

/// How much one call of [`follow`] reads.
#[derive(Clone, Copy, Debug)]
pub struct FollowLimits {
    /// Changes read from one partition per batch.
    pub batch_changes: usize,
    /// Changes one partition may hand over per call before the others get a turn.
    pub partition_changes_max: usize,
    /// Changes all partitions of the call may hand over together.
    pub total_changes_max: usize,
    /// Whether changes carry their documents.
    pub include_docs: bool,
}

/// One partition being followed.
struct Followed<R> {
    partition: PartitionId,
    reader: R,
    /// The consumer's position, as last handed to it.
    at: StreamPosition,
    handed: usize,
    /// Caught up, or its share of the call used.
    done: bool,
    /// CAS of the last change handed over (CAS grows with seqno within a partition).
    last_cas: u64,
}

/// Brings `consumer` forward on `partitions` of `source`, within `limits`; answers how
/// many changes it handed over.
///
/// The partitions are read in lock step: each batch holds up to
/// [`FollowLimits::batch_changes`] changes of every partition not yet done, and is applied
/// as one. A partition is done when it is caught up or has handed over
/// [`FollowLimits::partition_changes_max`]; the call ends when every partition is done,
/// [`FollowLimits::total_changes_max`] changes are handed over, or a batch moved nothing.
/// The call is sequential: callers that want parallelism follow disjoint sets of partitions
/// on several threads, each with its own consumer.
pub fn follow<S, C>(source: &S, partitions: &[PartitionId], limits: FollowLimits, consumer: &mut C) -> Result<usize, C::Error>
where
    S: ChangeSource + ?Sized,
    C: ChangeConsumer,
{
    debug_assert!(limits.batch_changes > 0 && limits.partition_changes_max > 0, "a limit of 0 reads nothing");
    let mut streams = Vec::with_capacity(partitions.len());
    for &partition in partitions {
        let from = consumer.position(partition);
        let (mut reader, rollback) = source.subscribe(partition, from)?;
        let mut at = from;
        // A new history that began at or after our position (a restart after a crash that
        // lost nothing we saw) shares all we have: no rollback.
        if let Some(shared) = rollback.filter(|&r| r < from.seqno) {
            consumer.rollback(partition, shared)?;
            debug_assert_eq!(consumer.position(partition).seqno, 0, "a rollback takes the consumer back to the start");
            at = StreamPosition::default();
            reader = source.subscribe(partition, at)?.0;
        }
        streams.push(Followed { partition, reader, at, handed: 0, done: false, last_cas: 0 });
    }
    let mut total = 0usize;
    while total < limits.total_changes_max {
        let mut room = limits.total_changes_max - total;
        let mut batch = Vec::with_capacity(streams.len());
        for s in streams.iter_mut().filter(|s| !s.done) {
            let max = limits.batch_changes.min(limits.partition_changes_max - s.handed).min(room);
            if max == 0 {
                break;
            }
            let changes = s.reader.try_next(max, limits.include_docs)?;
            let position = s.reader.position();
            debug_assert!(changes.len() <= max);
            check_batch(s, &changes, position);
            s.handed += changes.len();
            room -= changes.len();
            s.done = changes.is_empty() || s.handed >= limits.partition_changes_max;
            if !changes.is_empty() || position != s.at {
                let consistent = position.seqno >= s.reader.snapshot_end();
                batch.push(PartitionBatch { partition: s.partition, changes, position, consistent });
            }
        }
        if batch.is_empty() {
            break;
        }
        let n: usize = batch.iter().map(|b| b.changes.len()).sum();
        consumer.apply(&batch)?;
        for part in &batch {
            // The consumer stores a position only with the data it covers: never past what
            // it was handed.
            debug_assert!(
                consumer.position(part.partition).seqno <= part.position.seqno,
                "partition {}: the consumer's position runs ahead of the changes handed to it",
                part.partition
            );
            if let Some(s) = streams.iter_mut().find(|s| s.partition == part.partition) {
                s.at = part.position;
            }
        }
        total += n;
        if n == 0 {
            break;
        }
    }
    Ok(total)
}

/// What a batch read from one partition must be: changes after the consumer's position in
/// rising seqno order with rising CAS, and a position that covers exactly them.
fn check_batch<R>(s: &mut Followed<R>, changes: &[Change], position: StreamPosition) {
    let mut prev = s.at.seqno;
    for c in changes {
        debug_assert_eq!(c.partition, s.partition);
        debug_assert!(c.seqno > prev, "partition {}: seqno {} after {prev}", s.partition, c.seqno);
        debug_assert!(c.cas > s.last_cas, "partition {}: CAS does not grow with seqno at {}", s.partition, c.seqno);
        prev = c.seqno;
        s.last_cas = c.cas;
    }
    debug_assert!(position.seqno >= prev, "partition {}: the position {} is behind its changes", s.partition, position.seqno);
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use bytes::Bytes;

    use super::*;

    /// A source kept in memory: per partition its history uuid and changes.
    #[derive(Default)]
    struct Memory {
        partitions: Vec<(u64, Vec<Change>)>,
    }

    struct MemoryReader {
        uuid: u64,
        changes: Vec<Change>,
        since: SeqNo,
        end: SeqNo,
    }

    impl Memory {
        fn new(partitions: u16) -> Memory {
            Memory { partitions: (0..partitions).map(|p| (u64::from(p) + 1, Vec::new())).collect() }
        }

        fn write(&mut self, p: PartitionId, key: &str) {
            let (_, changes) = &mut self.partitions[usize::from(p)];
            let seqno = changes.last().map_or(1, |c| c.seqno + 1);
            let cas = 1000 + seqno;
            let value = Some(Bytes::from(format!("{{\"k\":\"{key}\"}}")));
            changes.push(Change {
                partition: p,
                seqno,
                key: Bytes::copy_from_slice(key.as_bytes()),
                cas,
                deleted: false,
                expiry: 0,
                value,
            });
        }
    }

    impl ChangeSource for Memory {
        type Reader = MemoryReader;

        fn partition_count(&self) -> u16 {
            self.partitions.len() as u16
        }

        fn positions(&self) -> Vec<StreamPosition> {
            self.partitions.iter().map(|(uuid, c)| StreamPosition { seqno: c.last().map_or(0, |c| c.seqno), uuid: *uuid }).collect()
        }

        fn subscribe(&self, p: PartitionId, from: StreamPosition) -> Result<(MemoryReader, Option<SeqNo>), ChangesError> {
            let (uuid, changes) = &self.partitions[usize::from(p)];
            // Any other history shares nothing with this one.
            let rollback = (from.seqno > 0 && from.uuid != *uuid).then_some(0);
            let since = rollback.unwrap_or(from.seqno);
            let end = changes.last().map_or(0, |c| c.seqno);
            Ok((MemoryReader { uuid: *uuid, changes: changes.clone(), since, end }, rollback))
        }
    }

    impl ChangeReader for MemoryReader {
        fn try_next(&mut self, max: usize, _: bool) -> Result<Vec<Change>, ChangesError> {
            let out: Vec<Change> = self.changes.iter().filter(|c| c.seqno > self.since).take(max).cloned().collect();
            if let Some(last) = out.last() {
                self.since = last.seqno;
            }
            Ok(out)
        }

        fn position(&self) -> StreamPosition {
            StreamPosition { seqno: self.since, uuid: self.uuid }
        }

        fn snapshot_end(&self) -> SeqNo {
            self.end
        }
    }

    /// A consumer that keeps keys per partition and records what it was asked to do.
    #[derive(Default)]
    struct Keys {
        positions: BTreeMap<PartitionId, StreamPosition>,
        keys: BTreeMap<PartitionId, Vec<String>>,
        batches: Vec<Vec<(PartitionId, usize)>>,
        rollbacks: Vec<PartitionId>,
    }

    impl ChangeConsumer for Keys {
        type Error = ChangesError;

        fn position(&self, p: PartitionId) -> StreamPosition {
            self.positions.get(&p).copied().unwrap_or_default()
        }

        fn rollback(&mut self, p: PartitionId, _: SeqNo) -> Result<(), ChangesError> {
            self.rollbacks.push(p);
            self.keys.remove(&p);
            self.positions.remove(&p);
            Ok(())
        }

        fn apply(&mut self, batch: &[PartitionBatch]) -> Result<(), ChangesError> {
            for part in batch {
                let keys = self.keys.entry(part.partition).or_default();
                keys.extend(part.changes.iter().map(|c| String::from_utf8_lossy(&c.key).into_owned()));
                self.positions.insert(part.partition, part.position);
            }
            self.batches.push(batch.iter().map(|b| (b.partition, b.changes.len())).collect());
            Ok(())
        }
    }

    const ALL: FollowLimits =
        FollowLimits { batch_changes: 2, partition_changes_max: usize::MAX, total_changes_max: usize::MAX, include_docs: true };

    #[test]
    fn partitions_are_read_in_lock_step_and_positions_go_with_their_data() {
        let mut source = Memory::new(2);
        for i in 0..5 {
            source.write(0, &format!("a{i}"));
        }
        source.write(1, "b0");
        let mut keys = Keys::default();
        assert_eq!(follow(&source, &[0, 1], ALL, &mut keys).unwrap(), 6);
        assert_eq!(keys.batches, vec![vec![(0, 2), (1, 1)], vec![(0, 2)], vec![(0, 1)]]);
        assert_eq!(keys.keys[&0], ["a0", "a1", "a2", "a3", "a4"]);
        assert_eq!(keys.position(0), source.positions()[0]);
        assert_eq!(keys.position(1), source.positions()[1]);
        // Caught up: nothing is handed over again.
        assert_eq!(follow(&source, &[0, 1], ALL, &mut keys).unwrap(), 0);
        assert_eq!(keys.batches.len(), 3);
    }

    #[test]
    fn limits_bound_a_partition_and_the_call() {
        let mut source = Memory::new(2);
        for i in 0..10 {
            source.write(0, &format!("a{i}"));
            source.write(1, &format!("b{i}"));
        }
        let mut keys = Keys::default();
        let per_partition = FollowLimits { partition_changes_max: 3, ..ALL };
        assert_eq!(follow(&source, &[0, 1], per_partition, &mut keys).unwrap(), 6);
        assert_eq!(keys.position(0).seqno, 3);
        let total = FollowLimits { total_changes_max: 5, ..ALL };
        assert_eq!(follow(&source, &[0, 1], total, &mut keys).unwrap(), 5);
        assert_eq!(keys.position(0).seqno + keys.position(1).seqno, 11);
        assert_eq!(follow(&source, &[0, 1], ALL, &mut keys).unwrap(), 9);
        assert_eq!(keys.keys[&1].len(), 10);
    }

    #[test]
    fn a_diverged_history_sends_the_consumer_back_to_the_start() {
        let mut source = Memory::new(2);
        source.write(0, "a0");
        source.write(1, "b0");
        let mut keys = Keys::default();
        follow(&source, &[0, 1], ALL, &mut keys).unwrap();
        // Partition 0 starts a new history (an unclean restart) that lost "a0".
        source.partitions[0] = (99, Vec::new());
        source.write(0, "a1");
        source.write(0, "a2");
        assert_eq!(follow(&source, &[0, 1], ALL, &mut keys).unwrap(), 2);
        assert_eq!(keys.rollbacks, vec![0]);
        assert_eq!(keys.keys[&0], ["a1", "a2"]);
        assert_eq!(keys.position(0), StreamPosition { seqno: 2, uuid: 99 });
        assert_eq!(keys.keys[&1], ["b0"], "the other partition is untouched");
    }

    /// What an active would answer a fetch of partition `p` from `from`, read from `source`.
    fn fetch(source: &Memory, p: PartitionId, from: StreamPosition) -> FetchedPart {
        let (mut reader, rollback) = source.subscribe(p, from).unwrap();
        let high = source.positions()[usize::from(p)];
        if rollback.is_some_and(|r| r < from.seqno) {
            return FetchedPart { from, rollback, high, end: from, ..FetchedPart::default() };
        }
        let changes = reader.try_next(usize::MAX, true).unwrap();
        FetchedPart { from, rollback: None, changes, end: reader.position(), snapshot_end: reader.snapshot_end(), high }
    }

    #[test]
    fn changes_fetched_from_elsewhere_are_followed_like_local_ones() {
        let mut source = Memory::new(3);
        for i in 0..5 {
            source.write(0, &format!("a{i}"));
            source.write(2, &format!("c{i}"));
        }
        let (mut local, mut remote) = (Keys::default(), Keys::default());
        follow(&source, &[0, 1, 2], ALL, &mut local).unwrap();
        let round = |source: &Memory, remote: &mut Keys| {
            let mut fetched = Fetched::new(3);
            for p in 0..3 {
                fetched.insert(p, fetch(source, p, remote.position(p)));
            }
            follow(&fetched, &fetched.partitions(), ALL, remote).unwrap()
        };
        assert_eq!(round(&source, &mut remote), 10);
        assert_eq!(remote.keys, local.keys);
        assert_eq!((0..3).map(|p| remote.position(p)).collect::<Vec<_>>(), source.positions(), "positions reach the highs");
        // Caught up: a new round hands over nothing.
        assert_eq!(round(&source, &mut remote), 0);
        // A new history on partition 0 (a failover lost "a3" and "a4"): the fetch says where
        // history is shared; the consumer rolls back, then the next fetch reads it again.
        let kept: Vec<Change> = source.partitions[0].1[..3].to_vec();
        source.partitions[0] = (77, kept);
        source.write(0, "a9");
        assert_eq!(round(&source, &mut remote), 0, "the round that meets the rollback reads nothing");
        assert_eq!(remote.rollbacks, vec![0]);
        assert_eq!(remote.position(0), StreamPosition::default());
        assert_eq!(round(&source, &mut remote), 4);
        assert_eq!(remote.keys[&0], ["a0", "a1", "a2", "a9"]);
        assert_eq!(remote.position(0), StreamPosition { seqno: 4, uuid: 77 });
        assert_eq!(remote.keys[&2].len(), 5, "the other partitions are untouched");
    }

    #[test]
    fn a_fetch_from_a_stale_position_hands_over_nothing() {
        let mut source = Memory::new(1);
        source.write(0, "a0");
        source.write(0, "a1");
        let mut keys = Keys::default();
        let mut fetched = Fetched::new(1);
        fetched.insert(0, fetch(&source, 0, StreamPosition { seqno: 1, uuid: 1 }));
        // The consumer is at 0, not where the fetch asked from: nothing, and no position moves.
        assert_eq!(follow(&fetched, &[0], ALL, &mut keys).unwrap(), 0);
        assert_eq!(keys.position(0), StreamPosition::default());
        assert!(keys.batches.is_empty());
    }

    #[test]
    fn a_position_that_moves_without_changes_is_handed_over() {
        let source = Memory::new(1);
        let mut keys = Keys::default();
        // The consumer is at 0 on no history; the source's empty partition is at 0 on its own.
        follow(&source, &[0], ALL, &mut keys).unwrap();
        assert_eq!(keys.batches, vec![vec![(0, 0)]]);
        assert_eq!(keys.position(0), source.positions()[0]);
    }
}
