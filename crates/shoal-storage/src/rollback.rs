//! Rolling a partition copy back after a failover, in the manner of Couchbase DCP.
//!
//! When an active copy fails, a replica that followed it further than the new active did
//! holds changes the new history does not have. [`rollback_seqno`] finds where the two
//! histories part (from the failover logs), [`Store::rollback_partition`] removes every
//! change above that point, [`crate::Collection::restore`] puts back the new active's
//! versions of the keys the rollback removed, and [`Store::adopt_history`] makes the
//! copy's history the new active's before it follows it with [`crate::Collection::apply`].
//!
//! The by-sequence index keeps only each key's latest change, so a key changed above the
//! rollback point loses its older version too: that is why a rollback reports the keys it
//! removed, and why a restore is needed. Couchbase's couchstore rewinds to an older file
//! header instead, where the older versions still are; fjall keeps no older versions.

use bytes::Bytes;

use crate::collection::Collection;
use crate::error::{NotMine, PartitionError};
use crate::partition::FailoverEntry;
use crate::store::Store;
use crate::unit::PartitionState;
use crate::{PartitionId, SeqNo};

/// Where a copy must roll back to before it follows another: `None` when its history and
/// `theirs` agree on everything it holds (up to `my_high`), else the seqno up to which
/// they agree (below `my_high`; 0 when they share no history).
///
/// `mine` and `theirs` are failover logs, oldest entry first: entry `(uuid, seqno)` means
/// history `uuid` went on from `seqno` (exclusive). The newest entry both logs hold (same
/// UUID and start) is the last epoch they share; each side's history stays on it until its
/// next entry (or forever, for the newest). So they agree up to the smaller of the two next
/// entries' seqnos — Couchbase's rule: the rollback seqno is `min(my high seqno, the seqno
/// where the other history branched)`.
///
/// `my_high` should be a consistent point of the copy: one that has applied a backfill only
/// part-way holds no state the source ever had, and passes the start of that snapshot.
pub fn rollback_seqno(mine: &[FailoverEntry], theirs: &[FailoverEntry], my_high: SeqNo) -> Option<SeqNo> {
    debug_assert!(mine.windows(2).all(|w| w[0].seqno <= w[1].seqno), "a failover log rises");
    debug_assert!(theirs.windows(2).all(|w| w[0].seqno <= w[1].seqno), "a failover log rises");
    let common = mine.iter().enumerate().rev().find_map(|(i, e)| theirs.iter().position(|t| t == e).map(|j| (i, j)));
    let agreed = match common {
        Some((i, j)) => {
            let my_end = mine.get(i + 1).map_or(SeqNo::MAX, |e| e.seqno);
            let their_end = theirs.get(j + 1).map_or(SeqNo::MAX, |e| e.seqno);
            my_end.min(their_end)
        }
        // No shared history: nothing the copy holds can be trusted.
        None => 0,
    };
    (agreed < my_high).then_some(agreed)
}

/// Whether `history` can be a copy's failover log: not empty, its seqnos rising.
pub fn is_history(history: &[FailoverEntry]) -> bool {
    !history.is_empty() && history.windows(2).all(|w| w[0].seqno <= w[1].seqno)
}

/// What [`Store::rollback_partition`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RollbackReport {
    /// The copy's high seqno now: the point asked for, or 0 when that was below the purge
    /// seqno (tombstones purged above it would leave keys unaccounted for).
    pub seqno: SeqNo,
    /// Keys whose latest change was above [`RollbackReport::seqno`], removed whole (documents
    /// and tombstones): any older version they had is gone too. The caller fetches each
    /// one's current version from the copy it will follow and [`Collection::restore`]s it.
    pub removed: Vec<Bytes>,
}

impl Store {
    /// Rolls `collection`'s copy of partition `p` back to `to`: every change above it goes
    /// (documents, by-sequence and expiry entries of the keys whose latest change is above
    /// it), the high seqno becomes `to`, the history keeps its entries up to `to` and starts
    /// a new one there (so readers of this copy positioned above `to` are told to roll back
    /// — the old history's later positions name changes the copy no longer holds). Only a
    /// replica or pending copy rolls back; an active one is refused (`NotMine`). Nothing to
    /// do when `to` is at or above the high seqno (a repeated call).
    ///
    /// The copy is replaced whole (as a promotion replaces it): its subscriptions and
    /// persisted watches close, and its successor starts with an empty in-memory tail at `to`.
    ///
    /// Crash safety: when the partition's keyspace is in the first data path's database,
    /// which holds the metadata, the removals (up to [`crate::partition::ROLLBACK_BATCH_MAX`]
    /// entries; more go first in earlier batches, newest first) and the new history commit in
    /// one batch, fsynced: a crash leaves the old state or the rolled-back one. Otherwise, or
    /// when earlier batches were needed, a crash in between leaves the removals of a higher
    /// point with the old history; the restart after a crash is unclean, so that copy gets a
    /// new history entry at what it holds, and [`rollback_seqno`] against the new active
    /// sends it back to `to` again (or lower). Either way nothing above `to` survives as
    /// part of a history that claims it.
    pub fn rollback_partition(&self, collection: &Collection, p: PartitionId, to: SeqNo) -> Result<RollbackReport, PartitionError> {
        let unit = self.unit(p)?;
        let _op = unit.op.lock();
        let _ddl = self.ddl.lock();
        if collection.is_dropped() {
            return Err(PartitionError::Refused(crate::WriteError::CollectionDropped));
        }
        let part = collection.partition_arc(p);
        let key = crate::store::partition_key(collection.id, p);
        let meta_shared = self.meta_shares_database(p);
        let record_of = |failover: &[FailoverEntry], purge_seqno: SeqNo| {
            // The high seqno goes with it: no by-sequence entry may hold `to` any more.
            let high = failover.last().map(|e| e.seqno);
            crate::store::json_bytes(&crate::store::PartitionRecord { failover: failover.to_vec(), purge_seqno, live: None, high })
        };
        let rolled = part.roll_back(to, self.clock().history_uuid(), |batch, failover, purge_seqno| {
            if meta_shared {
                batch.insert(&self.meta, key.clone(), record_of(failover, purge_seqno));
            }
        })?;
        let Some(rolled) = rolled else {
            return Ok(RollbackReport { seqno: part.high_seqno(), removed: Vec::new() });
        };
        if !meta_shared {
            // After the removals are durable: see the crash notes above.
            let mut batch = self.paths[0].db.batch();
            batch.insert(&self.meta, key, record_of(&rolled.failover, rolled.purge_seqno));
            batch.commit()?;
            self.paths[0].db.persist(fjall::PersistMode::SyncAll)?;
        }
        let new = self.new_partition(collection, p, rolled.failover, rolled.purge_seqno, rolled.live, Some(rolled.to))?;
        collection.replace_partition(p, new)?;
        Ok(RollbackReport { seqno: rolled.to, removed: rolled.removed })
    }

    /// Makes `history` (the failover log of the copy this one is to follow, oldest first)
    /// the history of `collection`'s copy of partition `p`, as a DCP consumer takes its
    /// producer's log: the copy's position is then on the other's history, and a later
    /// failover compares the right logs. Refused with [`PartitionError::Diverged`] when the
    /// copy holds changes `history` does not (roll back first), and for an active copy.
    /// The copy is replaced whole, as by a rollback.
    pub fn adopt_history(&self, collection: &Collection, p: PartitionId, history: &[FailoverEntry]) -> Result<(), PartitionError> {
        let unit = self.unit(p)?;
        let _op = unit.op.lock();
        let _ddl = self.ddl.lock();
        if collection.is_dropped() {
            return Err(PartitionError::Refused(crate::WriteError::CollectionDropped));
        }
        if !is_history(history) {
            return Err(PartitionError::Malformed("a history is a non-empty list of rising entries".into()));
        }
        let state = unit.owner.state();
        if !matches!(state, PartitionState::Replica | PartitionState::Pending) {
            return Err(PartitionError::NotMine(NotMine {
                partition: p,
                state,
                wanted: "replica or pending",
                map_version: self.map_version.load(std::sync::atomic::Ordering::Acquire),
            }));
        }
        let part = collection.partition_arc(p);
        // Held throughout: no apply moves the copy between the check and its successor.
        let (high, held) = part.hold()?;
        if let Some(to) = rollback_seqno(part.failover_log(), history, high) {
            return Err(PartitionError::Diverged { rollback_to: to });
        }
        if part.failover_log() == history {
            return Ok(());
        }
        let purge_seqno = part.purge_seqno.load(std::sync::atomic::Ordering::Acquire);
        let rec = crate::store::PartitionRecord { failover: history.to_vec(), purge_seqno, live: None, high: Some(high) };
        self.health.check_writable()?;
        // The partition's journal first, so that the successor's persisted seqno (its high)
        // is true; then the record.
        unit.db.persist(fjall::PersistMode::SyncAll)?;
        let mut batch = self.paths[0].db.batch();
        batch.insert(&self.meta, crate::store::partition_key(collection.id, p), crate::store::json_bytes(&rec));
        batch.commit()?;
        self.paths[0].db.persist(fjall::PersistMode::SyncAll)?;
        let live = crate::partition::LiveCount {
            count: part.docs_count.load(std::sync::atomic::Ordering::Relaxed),
            bytes: part.docs_bytes.load(std::sync::atomic::Ordering::Relaxed),
        };
        let new = self.new_partition(collection, p, history.to_vec(), purge_seqno, live, Some(high))?;
        part.retire_held();
        drop(held);
        collection.replace_partition(p, new)?;
        Ok(())
    }

    /// Whether partition `p`'s keyspace is in the database that holds the metadata (data path 0).
    fn meta_shares_database(&self, p: PartitionId) -> bool {
        usize::from(p) % self.paths.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(entries: &[(u64, SeqNo)]) -> Vec<FailoverEntry> {
        entries.iter().map(|&(uuid, seqno)| FailoverEntry { uuid, seqno, epoch: 0 }).collect()
    }

    #[test]
    fn the_rollback_point_is_where_the_histories_part() {
        // (what, mine, theirs, my high, expected)
        #[allow(clippy::type_complexity)]
        let cases: &[(&str, &[(u64, SeqNo)], &[(u64, SeqNo)], SeqNo, Option<SeqNo>)] = &[
            ("same history, behind", &[(1, 0)], &[(1, 0)], 10, None),
            ("they were promoted after my high", &[(1, 0)], &[(1, 0), (2, 20)], 10, None),
            ("they were promoted at my high", &[(1, 0)], &[(1, 0), (2, 10)], 10, None),
            ("they were promoted below my high", &[(1, 0)], &[(1, 0), (2, 7)], 10, Some(7)),
            ("I was promoted, then they were", &[(1, 0), (3, 5)], &[(1, 0), (2, 7)], 10, Some(5)),
            ("both branched at the same point, I am there", &[(1, 0), (3, 7)], &[(1, 0), (2, 7)], 7, None),
            ("both branched at the same point, I went on", &[(1, 0), (3, 7)], &[(1, 0), (2, 7)], 9, Some(7)),
            ("a later shared epoch counts", &[(1, 0), (2, 20)], &[(1, 0), (2, 20), (4, 35)], 40, Some(35)),
            ("a later shared epoch, still behind", &[(1, 0), (2, 20)], &[(1, 0), (2, 20), (4, 35)], 30, None),
            ("deeper: they branched off an older shared epoch", &[(1, 0), (2, 20), (5, 50)], &[(1, 0), (2, 20), (4, 35)], 60, Some(35)),
            ("my unclean restart branched me", &[(1, 0), (6, 12)], &[(1, 0)], 15, Some(12)),
            ("no shared history", &[(1, 0)], &[(2, 0)], 10, Some(0)),
            ("no shared history, nothing held", &[(1, 0)], &[(2, 0)], 0, None),
            ("an empty log shares nothing", &[(1, 0)], &[], 3, Some(0)),
            ("same uuid, another start: not the same epoch", &[(1, 0), (2, 9)], &[(1, 0), (2, 8)], 10, Some(8)),
            ("identical logs", &[(1, 0), (2, 9)], &[(1, 0), (2, 9)], 100, None),
        ];
        for (what, mine, theirs, high, want) in cases {
            assert_eq!(rollback_seqno(&log(mine), &log(theirs), *high), *want, "{what}");
        }
    }
}
