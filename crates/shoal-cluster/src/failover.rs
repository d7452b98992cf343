//! Failover: which replica takes over each partition a failed node was active for, and
//! whether the metadata leader may fail a node over by itself.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::map::{Copies, NodeId, PartitionId, PartitionMap, SeqNo};

/// Nodes failed over automatically before an operator must step in (issue 13: one at a
/// time unless the settings allow more).
pub const AUTO_FAILOVER_MAX_COUNT_DEFAULT: usize = 1;

/// A replica promoted to active, with the seqno it had acknowledged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Promoted {
    pub partition: PartitionId,
    pub to: NodeId,
    pub seqno: SeqNo,
}

/// The outcome of failing a node over.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailoverPlan {
    pub failed: NodeId,
    /// The map without the failed node's copies, version one higher.
    pub map: PartitionMap,
    /// For every partition the failed node was active for and a replica could take.
    pub promotions: Vec<Promoted>,
    /// Partitions the failed node was active for with no usable replica. The map still names
    /// the failed node as their active — it holds their only copy — and they stay
    /// unavailable until it is recovered; nothing is lost by waiting.
    pub unavailable: Vec<PartitionId>,
    /// Partitions whose replica on the failed node left the map (a rebalance restores them).
    pub replicas_dropped: Vec<PartitionId>,
}

/// Fails `failed` over: for each partition it was active for, the replica with the highest
/// acknowledged seqno becomes active (ties go to the replica listed first, the map's
/// preference); its replica copies leave the map; the version rises by one.
///
/// `replica_progress(partition, node)` is the seqno that replica has acknowledged to the
/// active, or `None` when the copy cannot be promoted (still being built, or its node is
/// down too). With replication of every `majority` write to a majority of copies, the most
/// advanced replica holds every write acknowledged at `majority`.
///
/// Seqnos alone order copies only when they are on one history — acknowledged to the
/// current active. A copy's *reported* high seqno may end in changes of an older active
/// that the current one never had (a replica that was not fenced at the previous failover
/// and has not rolled back yet); compare those with [`failover_fenced`] and [`HistoryEnd`].
pub fn failover(map: &PartitionMap, failed: NodeId, replica_progress: &dyn Fn(PartitionId, NodeId) -> Option<SeqNo>) -> FailoverPlan {
    failover_fenced(map, failed, &|p, n| replica_progress(p, n).map(|seqno| HistoryEnd { epoch: 0, seqno }))
}

/// Where a copy's history ends: the epoch of its last change and its seqno.
///
/// The epoch is the map version under which the active that sequenced the change was
/// active (a failover log entry's map version). One node is active per partition per map
/// version, so `(epoch, seqno)` names one change; and a copy whose last change is of a
/// later epoch holds everything the active of that epoch held when it was promoted, which
/// includes every write acknowledged before. So copies compare by epoch first, then seqno
/// — Raft's "last term, then last index" — never by seqno alone: a copy left behind on an
/// older active's history can have the higher seqno while lacking acknowledged writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct HistoryEnd {
    pub epoch: u64,
    pub seqno: SeqNo,
}

/// [`failover`] with copies compared by where their history ends: for each partition
/// `failed` was active for, the fenced replica with the greatest [`HistoryEnd`] becomes
/// active (ties to the replica listed first).
///
/// `reported(partition, node)` is the history end a surviving replica reported after it
/// applied the fence ("`failed` is Failed"), or `None` when it has not (it may still be
/// following `failed`). Call it only when [`promotion_ready`] holds for every partition
/// `failed` was active for; a partition whose fence quorum is not reached must wait.
pub fn failover_fenced(map: &PartitionMap, failed: NodeId, reported: &dyn Fn(PartitionId, NodeId) -> Option<HistoryEnd>) -> FailoverPlan {
    debug_assert_eq!(map.check(), Ok(()));
    let mut next = map.clone();
    next.version = map.version + 1;
    let mut plan = FailoverPlan {
        failed,
        map: PartitionMap { version: 0, partitions: Vec::new() },
        promotions: Vec::new(),
        unavailable: Vec::new(),
        replicas_dropped: Vec::new(),
    };
    for (partition, copies) in next.partitions.iter_mut().enumerate() {
        let partition = partition as PartitionId;
        if let Some(i) = copies.replicas.iter().position(|n| *n == failed) {
            copies.replicas.remove(i);
            plan.replicas_dropped.push(partition);
        }
        if copies.active != failed {
            continue;
        }
        let mut best: Option<(usize, HistoryEnd)> = None;
        for (i, replica) in copies.replicas.iter().enumerate() {
            if let Some(end) = reported(partition, *replica) {
                // Strictly greater: an equal end later in the list does not win.
                if best.is_none_or(|(_, b)| end > b) {
                    best = Some((i, end));
                }
            }
        }
        match best {
            Some((i, end)) => {
                let to = copies.replicas.remove(i);
                copies.active = to;
                plan.promotions.push(Promoted { partition, to, seqno: end.seqno });
            }
            None => plan.unavailable.push(partition),
        }
    }
    debug_assert_eq!(next.check(), Ok(()));
    debug_assert!(next.partitions.iter().all(|c| !c.replicas.contains(&failed)));
    plan.map = next;
    plan
}

/// Where one fenced replica of a partition stands: its seqno in each collection (each
/// collection of a partition has a sequence of its own).
pub type CollectionSeqnos = std::collections::BTreeMap<u32, SeqNo>;

/// The replica a failover promotes for one partition, and where it must first catch up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromotionChoice {
    pub to: NodeId,
    /// `(collection, source)`: a collection in which another fenced replica is further on,
    /// and the first such replica holding the furthest seqno. The promoted copy applies the
    /// changes it lacks from there before it serves.
    pub catch_up: Vec<(u32, NodeId)>,
}

/// Whom to promote among a partition's fenced replicas, `reports` in the map's order.
///
/// Within one collection the fenced replicas hold prefixes of the failed active's history,
/// so the furthest holds everything the others do. Across collections no replica need be
/// furthest in all: each pulls every collection, and two pulls read them at different
/// moments, so one replica can be ahead in one collection and behind in another — each
/// holding `majority` writes the other lacks. So the replica furthest in total is chosen
/// (the least to copy; ties go to the first listed) and catches up, collection by
/// collection, from a replica that is furthest there. `None` when there is no report.
pub fn choose_promotion(reports: &[(NodeId, CollectionSeqnos)]) -> Option<PromotionChoice> {
    let total = |r: &CollectionSeqnos| r.values().map(|s| u128::from(*s)).sum::<u128>();
    let mut best: Option<&(NodeId, CollectionSeqnos)> = None;
    for report in reports {
        // Strictly greater: an equal total later in the list does not win.
        if best.is_none_or(|b| total(&report.1) > total(&b.1)) {
            best = Some(report);
        }
    }
    let (to, mine) = best?;
    let mut catch_up = Vec::new();
    let collections: std::collections::BTreeSet<u32> = reports.iter().flat_map(|(_, r)| r.keys().copied()).collect();
    for c in collections {
        let here = mine.get(&c).copied().unwrap_or(0);
        let furthest =
            reports.iter().filter_map(|(n, r)| r.get(&c).map(|s| (*n, *s))).fold(None, |acc: Option<(NodeId, SeqNo)>, (n, s)| {
                if acc.is_none_or(|(_, a)| s > a) {
                    Some((n, s))
                } else {
                    acc
                }
            });
        if let Some((source, seqno)) = furthest {
            if seqno > here {
                catch_up.push((c, source));
            }
        }
    }
    debug_assert!(catch_up.iter().all(|(_, source)| source != to));
    Some(PromotionChoice { to: *to, catch_up })
}

/// Copies that must hold a write before it is acknowledged at `majority`: ⌊n/2⌋ + 1 of the
/// `n_copies`, the active counting itself. `n_copies` is the configured count (replicas + 1),
/// a failed-over node's slot counting as a copy that never acknowledges
/// ([`promotion_ready`] says why).
pub fn majority(n_copies: usize) -> usize {
    n_copies / 2 + 1
}

/// Surviving replicas that must be fenced (have applied "the active is Failed", stopped
/// acknowledging it, and reported their history end) before a partition's replica may be
/// promoted: `n - majority(n) + 1`, the smallest set that meets every majority of the
/// `n_copies`. Each majority the old active could still gather — for a write or for a
/// read's confirmation — then needs a fenced copy, which no longer answers it; and the
/// most advanced fenced copy holds every write that was acknowledged.
pub fn fence_quorum(n_copies: usize) -> usize {
    debug_assert!(n_copies >= 1);
    n_copies - majority(n_copies) + 1
}

/// Whether a partition whose active `failed` is fenced may be given a new active: the
/// replicas for which `fenced` holds are at least [`fence_quorum`] of `copies_configured`
/// (the partition's replicas setting + 1; the failed active is never fenced). Below it the
/// partition stays unavailable, which loses nothing. A partition `failed` is not active for
/// needs no fence and is always ready.
///
/// `copies_configured`, not the copies in the map: a failover takes the failed node's copy
/// out of the map, and a write acknowledged by a majority that included it is then on one
/// copy fewer — with 3 copies, on 1 of the 2 left, not a majority of them. Counting the map's
/// copies, the next failover would fence and promote the other one and lose that write. So
/// the failed node's slot stays vacant (it never acknowledges, is never fenced) for
/// majorities and fence quorums alike, until a rebalance fills it with a copy that has
/// caught up. For the same reason `copies` must be the largest copy set the old active may
/// still be counting acknowledgements from.
pub fn promotion_ready(copies: &Copies, copies_configured: usize, failed: NodeId, fenced: &dyn Fn(NodeId) -> bool) -> bool {
    debug_assert!(copies.nodes().count() <= copies_configured);
    if copies.active != failed {
        return true;
    }
    let fenced = copies.replicas.iter().filter(|r| **r != failed && fenced(**r)).count();
    fenced >= fence_quorum(copies_configured)
}

/// Why the metadata leader must not fail a node over by itself.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AutoFailoverRefused {
    #[error("{failed_over} nodes already failed over automatically; at most {max_count} without an operator")]
    CountReached { failed_over: usize, max_count: usize },
    #[error("no replica holds every acknowledged write of partitions {partitions:?}; they wait for the node to return")]
    WouldLoseData { partitions: Vec<PartitionId> },
}

/// Whether `failed` may be failed over automatically: fewer than `max_count` nodes failed
/// over automatically so far (`failed_over`, since an operator last reset the count), and
/// every partition it is active for has a replica that holds every acknowledged write —
/// `replica_progress` at least `acknowledged(partition)`, the highest seqno acknowledged to
/// a client at `majority`. Otherwise the partition's only up-to-date copy is on the failed
/// node; an operator may still fail it over by hand ([`failover`]).
pub fn auto_failover_allowed(
    map: &PartitionMap,
    failed: NodeId,
    failed_over: usize,
    max_count: usize,
    replica_progress: &dyn Fn(PartitionId, NodeId) -> Option<SeqNo>,
    acknowledged: &dyn Fn(PartitionId) -> SeqNo,
) -> Result<(), AutoFailoverRefused> {
    if failed_over >= max_count {
        return Err(AutoFailoverRefused::CountReached { failed_over, max_count });
    }
    let partitions: Vec<PartitionId> = map
        .iter()
        .filter(|(_, copies)| copies.active == failed)
        .filter(|(p, copies)| {
            !copies.replicas.iter().any(|r| *r != failed && replica_progress(*p, *r).is_some_and(|s| s >= acknowledged(*p)))
        })
        .map(|(p, _)| p)
        .collect();
    if partitions.is_empty() {
        Ok(())
    } else {
        Err(AutoFailoverRefused::WouldLoseData { partitions })
    }
}
