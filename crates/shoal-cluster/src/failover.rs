//! Failover: which replica takes over each partition a failed node was active for, and
//! whether the metadata leader may fail a node over by itself.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::map::{NodeId, PartitionId, PartitionMap, SeqNo};

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
pub fn failover(map: &PartitionMap, failed: NodeId, replica_progress: &dyn Fn(PartitionId, NodeId) -> Option<SeqNo>) -> FailoverPlan {
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
        let mut best: Option<(usize, SeqNo)> = None;
        for (i, replica) in copies.replicas.iter().enumerate() {
            if let Some(seqno) = replica_progress(partition, *replica) {
                // Strictly greater: an equal seqno later in the list does not win.
                if best.is_none_or(|(_, s)| seqno > s) {
                    best = Some((i, seqno));
                }
            }
        }
        match best {
            Some((i, seqno)) => {
                let to = copies.replicas.remove(i);
                copies.active = to;
                plan.promotions.push(Promoted { partition, to, seqno });
            }
            None => plan.unavailable.push(partition),
        }
    }
    debug_assert_eq!(next.check(), Ok(()));
    debug_assert!(next.partitions.iter().all(|c| !c.replicas.contains(&failed)));
    plan.map = next;
    plan
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
