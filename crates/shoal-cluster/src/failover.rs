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

/// Where a copy's history ends: the epoch of its last change and its seqno.
///
/// The epoch is the map version under which the active that sequenced the change was
/// active (a failover log entry's map version). One node is active per partition per map
/// version, so `(epoch, seqno)` names one change; and a copy whose last change is of a
/// later epoch holds everything the active of that epoch held when it was promoted, which
/// includes every write acknowledged before. So copies compare by epoch first, then seqno
/// — Raft's "last term, then last index" — never by seqno alone: a copy left behind on an
/// older active's history can have the higher seqno while lacking acknowledged writes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct HistoryEnd {
    pub epoch: u64,
    pub seqno: SeqNo,
}

/// Fails `failed` over: for each partition it was active for, the fenced replica with the
/// greatest [`HistoryEnd`] becomes active (ties to the replica listed first); its replica
/// copies leave the map; the version rises by one. Production reports only the replica
/// [`choose_promotion`] picked (and caught up) for each partition.
///
/// `reported(partition, node)` is the history end a surviving replica reported after it
/// applied the fence ("`failed` is Failed"), or `None` when it has not (it may still be
/// following `failed`). Call it only when [`Quorum::fenced`] holds for every partition
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

/// Where one fenced replica of a partition stands: where its history ends in each
/// collection (each collection of a partition has a sequence of its own).
pub type CollectionEnds = std::collections::BTreeMap<u32, HistoryEnd>;

/// The replica a failover promotes for one partition, and where it must first catch up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromotionChoice {
    pub to: NodeId,
    /// `(collection, source)`: a collection in which another fenced replica's history ends
    /// further on, and the first such replica ending furthest. The promoted copy takes the
    /// changes it lacks from there before it serves (rolling back first where its own
    /// history parted from the source's).
    pub catch_up: Vec<(u32, NodeId)>,
}

/// Whom to promote among a partition's fenced replicas, `reports` in the map's order.
///
/// Copies compare by where their history ends, [`HistoryEnd`] — epoch, then seqno — never
/// by seqno alone: a replica left behind on an older active's history (down, or not fenced,
/// at the previous failover) may hold the highest seqno while lacking writes the next
/// active had acknowledged. Within one collection the copy ending furthest holds every
/// acknowledged write the others hold. Across collections no replica need be furthest in
/// all: each pulls every collection, and two pulls read them at different moments, so one
/// replica can be ahead in one collection and behind in another — each holding `majority`
/// writes the other lacks. So the replica furthest in the most collections is chosen (then
/// the furthest in total seqnos, the least to copy; then the first listed) and catches up,
/// collection by collection, from a replica that is furthest there. `None` when there is
/// no report.
///
/// The failover in production calls this, and so does the simulation (`sim.rs`), which
/// checks with it that no acknowledged write is lost.
pub fn choose_promotion(reports: &[(NodeId, CollectionEnds)]) -> Option<PromotionChoice> {
    let collections: std::collections::BTreeSet<u32> = reports.iter().flat_map(|(_, r)| r.keys().copied()).collect();
    // The furthest end of each collection and its first holder.
    let mut furthest: std::collections::BTreeMap<u32, (NodeId, HistoryEnd)> = std::collections::BTreeMap::new();
    for (node, ends) in reports {
        for (c, end) in ends {
            // Strictly greater: an equal end later in the list does not win.
            if furthest.get(c).is_none_or(|(_, f)| end > f) {
                furthest.insert(*c, (*node, *end));
            }
        }
    }
    let score = |ends: &CollectionEnds| {
        let at_furthest = collections.iter().filter(|c| ends.get(c).is_some_and(|e| furthest.get(c).is_some_and(|(_, f)| e == f))).count();
        let total = ends.values().map(|e| u128::from(e.seqno)).sum::<u128>();
        (at_furthest, total)
    };
    let mut best: Option<&(NodeId, CollectionEnds)> = None;
    for report in reports {
        // Strictly greater: an equal score later in the list does not win.
        if best.is_none_or(|b| score(&report.1) > score(&b.1)) {
            best = Some(report);
        }
    }
    let (to, mine) = best?;
    let catch_up: Vec<(u32, NodeId)> =
        furthest.iter().filter(|(c, (_, end))| mine.get(c).is_none_or(|m| m < end)).map(|(c, (source, _))| (*c, *source)).collect();
    debug_assert!(catch_up.iter().all(|(_, source)| source != to));
    Some(PromotionChoice { to: *to, catch_up })
}

/// Copies that must hold a write before it is acknowledged at `majority`: ⌊n/2⌋ + 1 of the
/// `n_copies`, the active counting itself. `n_copies` is the configured count (replicas + 1),
/// a failed-over node's slot counting as a copy that never acknowledges
/// ([`Quorum::fenced`] says why).
pub fn majority(n_copies: usize) -> usize {
    n_copies / 2 + 1
}

/// How many copies a partition's majorities and fence quorums are counted over: the
/// configured count (`replicas` + 1, at most the `data_nodes` the cluster has, failed ones
/// included), or the copies in the map when a rebalance holds more. Not the map's copies
/// alone: a failover takes the failed copy out of the map, and a write a majority
/// acknowledged with it is then on fewer than a majority of the rest — the next failover
/// could promote a copy without it ([`Quorum::fenced`]; the seeded simulation in
/// [`crate::sim`] finds that loss). The failed copy's slot stays counted, never
/// acknowledging, until a rebalance fills it; so after one failover with one replica,
/// majority writes answer `durability_impossible` until then.
pub fn copies_counted(replicas: u8, data_nodes: usize, copies: &Copies) -> usize {
    configured_copies(replicas, data_nodes).max(copies.nodes().count())
}

/// The copies counted for majorities of a set of `set_copies` copies: at least the
/// `configured` count (`replicas` + 1, at most the data nodes), a vacant slot counting as a
/// copy that never acknowledges (see [`copies_counted`]).
pub fn configured_copies(replicas: u8, data_nodes: usize) -> usize {
    (usize::from(replicas) + 1).min(data_nodes.max(1))
}

/// The copy sets in which a write, or a read's confirmation, must be on a majority before
/// it counts: the partition's copies in the map — and, while a rebalance holds the partition
/// at copies that are neither the plan's starting ones nor its target (its build map, or a
/// failover's map made from it), the starting copies too.
///
/// The map's copies alone are not enough: a build map of `{A; B, C}` (C new, B leaving)
/// makes A and C a majority of three without B; a failover of A promotes C, the rebalance
/// ends, and `{C; B}` counts two copies, a fence quorum of one: the next failover may
/// promote B, which never had the write. A majority of `{A, B}` as well puts it on B.
/// (`crate::sim` finds the loss without it, `Protocol::joint_majorities`.) The target
/// copies are not a set of their own: a new copy counts for nothing until it has caught up
/// (a copy still being built would block every write), and the hand-over of a wave freezes
/// the partition and waits until every copy of its target holds everything, so the target
/// holds every write acknowledged before it. A promotion likewise needs a fence quorum of
/// every set ([`Quorum::fenced`]): after a failover from the build map, `{B; C}` with C new
/// must not promote C alone, which may lack a write `{A, B}` acknowledged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quorum {
    /// Each set's nodes, and the copies its majorities and fence quorums are counted over.
    pub sets: Vec<(Vec<NodeId>, usize)>,
}

impl Quorum {
    /// The quorum of a partition with `copies` in the map (`counted` by [`copies_counted`]),
    /// under a rebalance from `plan.0` to `plan.1` when one runs, the starting set counted
    /// over at least `configured` copies ([`configured_copies`]).
    pub fn of(copies: &Copies, counted: usize, plan: Option<(&Copies, &Copies)>, configured: usize) -> Quorum {
        debug_assert!(counted >= copies.nodes().count());
        let mut sets = vec![(copies.nodes().collect::<Vec<_>>(), counted)];
        if let Some((from, _)) = plan.filter(|(from, target)| copies != *from && copies != *target) {
            let nodes: Vec<NodeId> = from.nodes().collect();
            let counted = configured.max(nodes.len());
            sets.push((nodes, counted));
        }
        Quorum { sets }
    }

    /// Whether the copies for which `holds` is true make a majority in every set.
    pub fn met(&self, holds: &dyn Fn(NodeId) -> bool) -> bool {
        self.unmet(holds).is_none()
    }

    /// The first set without a majority where `holds`: how many hold, and how many it needs.
    pub fn unmet(&self, holds: &dyn Fn(NodeId) -> bool) -> Option<(usize, usize)> {
        self.sets
            .iter()
            .map(|(nodes, counted)| (nodes.iter().filter(|n| holds(**n)).count(), majority(*counted)))
            .find(|(held, needed)| held < needed)
    }

    /// Whether a replica of a partition whose active `failed` may be promoted once the
    /// copies for which `fenced` holds are fenced (`failed` never is): [`fence_quorum`] of
    /// every set. Each majority the failed active may have gathered — in every set — then
    /// meets a fenced copy, and the most advanced fenced copy holds every acknowledged
    /// write. Below it the partition stays unavailable, which loses nothing.
    ///
    /// Each set counts its configured copies, not only those in the map
    /// ([`copies_counted`]): a failover takes the failed node's copy out of the map, and a
    /// write acknowledged by a majority that included it is then on one copy fewer — with 3
    /// copies, on 1 of the 2 left, not a majority of them. Counting the map's copies, the
    /// next failover would fence and promote the other one and lose that write. So the failed
    /// node's slot stays vacant (it never acknowledges, is never fenced) for majorities and
    /// fence quorums alike, until a rebalance fills it with a copy that has caught up.
    pub fn fenced(&self, failed: NodeId, fenced: &dyn Fn(NodeId) -> bool) -> bool {
        self.sets.iter().all(|(nodes, counted)| nodes.iter().filter(|n| **n != failed && fenced(**n)).count() >= fence_quorum(*counted))
    }

    /// Every node of every set but `me`: whose acknowledgements count.
    pub fn others(&self, me: NodeId) -> Vec<NodeId> {
        let mut out: Vec<NodeId> = self.sets.iter().flat_map(|(nodes, _)| nodes.iter().copied()).filter(|n| *n != me).collect();
        out.sort_unstable();
        out.dedup();
        out
    }
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

/// Why the metadata leader must not fail a node over by itself.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AutoFailoverRefused {
    #[error("{failed_now} nodes are failed over already; at most {max_count} without an operator")]
    CountReached { failed_now: usize, max_count: usize },
    #[error("it holds the only copy of partitions {partitions:?}: they wait for the node to return")]
    OnlyCopy { partitions: Vec<PartitionId> },
}

/// Whether the metadata leader may fail `failed` over by itself (the failover monitor in
/// production asks this, once `failed` was silent past the timeout): fewer than `max_count`
/// members are failed over now (`failed_now`: failed, automatically or by hand, and not yet
/// recovered by an operator — counted in the log's state, so every leader counts the same),
/// and every partition `failed` is active for has a replica in the map. A partition whose
/// only copy is on `failed` would be unavailable anyway, and waiting for the node loses
/// nothing; an operator may still fail it over by hand.
///
/// Whether a replica holds every acknowledged write is not asked here: the failover fences
/// the replicas and promotes one only where [`Quorum::fenced`] holds, the rest staying
/// unavailable until the node returns.
pub fn auto_failover_allowed(map: &PartitionMap, failed: NodeId, failed_now: usize, max_count: usize) -> Result<(), AutoFailoverRefused> {
    if failed_now >= max_count {
        return Err(AutoFailoverRefused::CountReached { failed_now, max_count });
    }
    let partitions: Vec<PartitionId> =
        map.iter().filter(|(_, copies)| copies.active == failed && copies.replicas.iter().all(|r| *r == failed)).map(|(p, _)| p).collect();
    if partitions.is_empty() {
        Ok(())
    } else {
        Err(AutoFailoverRefused::OnlyCopy { partitions })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn majorities_count_the_configured_copies_a_failed_slot_included() {
        let copies = |n: u64| Copies { active: NodeId(1), replicas: (2..=n).map(NodeId).collect() };
        // (replicas setting, data nodes, copies in the map, counted)
        let cases = [
            ("one replica, both copies in the map", 1, 2, copies(2), 2),
            ("one replica, its node failed over: the slot stays counted", 1, 2, copies(1), 2),
            ("two replicas on a 2-node cluster: at most the data nodes", 2, 2, copies(2), 2),
            ("a rebalance holds more copies than configured", 1, 3, copies(3), 3),
            ("no replicas", 0, 3, copies(1), 1),
            ("no data nodes known yet", 1, 0, copies(1), 1),
        ];
        for (name, replicas, data_nodes, map_copies, want) in cases {
            assert_eq!(copies_counted(replicas, data_nodes, &map_copies), want, "{name}");
        }
    }

    #[test]
    fn a_rebalance_between_its_sets_needs_a_majority_of_its_starting_copies_too() {
        let c = |active: u64, replicas: &[u64]| Copies { active: NodeId(active), replicas: replicas.iter().map(|r| NodeId(*r)).collect() };
        let holding = |ids: &'static [u64]| move |n: NodeId| ids.contains(&n.0);
        let (from, target, build) = (c(1, &[2]), c(1, &[3]), c(1, &[2, 3]));
        let q = Quorum::of(&build, 3, Some((&from, &target)), 2);
        assert_eq!(q.sets.len(), 2);
        assert!(!q.met(&holding(&[1, 3])), "A and C are a majority of the build map, not of {{A, B}}");
        assert!(q.met(&holding(&[1, 2])), "A and B: the new copy C, maybe still being built, is not needed");
        assert_eq!(q.unmet(&holding(&[1, 3])), Some((1, 2)));
        assert_eq!(q.others(NodeId(1)), vec![NodeId(2), NodeId(3)]);
        // A promotion after A fails: both B and C fenced for the build map (3 copies), and B
        // for {A, B}.
        assert!(!q.fenced(NodeId(1), &holding(&[3])));
        assert!(!q.fenced(NodeId(1), &holding(&[2])));
        assert!(q.fenced(NodeId(1), &holding(&[2, 3])));
        // At the plan's starting copies or at its target: the map's copies alone.
        assert_eq!(Quorum::of(&from, 2, Some((&from, &target)), 2).sets.len(), 1);
        assert_eq!(Quorum::of(&target, 2, Some((&from, &target)), 2).sets.len(), 1);
        assert_eq!(Quorum::of(&build, 3, None, 2).sets.len(), 1, "no rebalance");
        // A failover's map made from the build map (A failed): B and C hold no majority of
        // {A, B} without A, so writes wait until the rebalance, failed by the failover,
        // reverts and ends its plan.
        let after = c(2, &[3]);
        let q = Quorum::of(&after, 2, Some((&from, &target)), 2);
        assert!(!q.met(&holding(&[2, 3])));
        assert!(Quorum::of(&after, 2, None, 2).met(&holding(&[2, 3])), "once the plan ends");
        // And B failing next: C alone is no fence quorum of {A, B}, whose writes it may lack.
        assert!(!q.fenced(NodeId(2), &holding(&[3])));
    }
}
