//! A rebalance as a stage machine: what the metadata leader does next, decided from what it
//! sees at one look. The node only carries the steps out (peer calls, proposals, waits);
//! the decisions — which copies a rebalance builds, which partitions a wave hands over and
//! when, when it is done, stopped or out of time — are these pure functions, which the
//! tables below and the seeded model run in `tests/rebalance_stages.rs` drive.
//!
//! The stages: **build** (every new copy joins its partition as a replica, [`build_map`]),
//! **waves** (a partition whose new copies have all caught up with its active, are heard by
//! it, and whose derived state — index entries, shadow rows — on its new active is caught up
//! too is handed over: [`next_step`] answers [`Step::HandOver`] and [`wave_map`] is the map
//! committed after it), **finish** (every partition at its target copies, every new copy
//! caught up: eject, then settle). A stop asked in the log reverts what has not moved
//! ([`revert_map`]); running out of time fails the rebalance, which reverts too.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::map::{NodeId, PartitionId, PartitionMap};
use crate::plan::{plan_moves, PlanError};

/// The map a rebalance builds its copies under: the current map with every copy the target
/// adds joined as a replica (a resumed plan finds them there already). Its version is one
/// higher when it differs from `current`, else `current`'s.
pub fn build_map(current: &PartitionMap, target: &PartitionMap) -> PartitionMap {
    let mut build = current.clone();
    for (copies, want) in build.partitions.iter_mut().zip(&target.partitions) {
        for n in want.nodes() {
            if !copies.holds(n) {
                copies.replicas.push(n);
            }
        }
    }
    if build.partitions != current.partitions {
        build.version = current.version + 1;
    }
    debug_assert!(build.check().is_ok());
    build
}

/// The copies a rebalance from `from` to `target` builds, `(partition, node)`, in partition
/// order: the moves of [`plan_moves`], every node holding a partition in `target` that did
/// not in `from`.
pub fn new_copies(from: &PartitionMap, target: &PartitionMap) -> Result<Vec<(PartitionId, NodeId)>, PlanError> {
    Ok(plan_moves(from, target)?.moves.into_iter().map(|m| (m.partition, m.to)).collect())
}

/// What the leader knows at one look.
#[derive(Clone, Debug)]
pub struct Look<'a> {
    /// The log asks the rebalance to stop.
    pub stop_asked: bool,
    /// The map this rebalance committed last (the metadata's map; anything else is a
    /// failover under the plan, which the node refuses before it asks).
    pub map: &'a PartitionMap,
    pub target: &'a PartitionMap,
    /// [`new_copies`] of the plan.
    pub new_copies: &'a [(PartitionId, NodeId)],
    /// New copies caught up with their partition's active now, on its history.
    pub caught_up: &'a BTreeSet<(PartitionId, NodeId)>,
    /// New copies their partition's active hears (replicates to) on its current history.
    pub heard: &'a BTreeSet<(PartitionId, NodeId)>,
    /// Partitions whose derived state on their target active (index entries, analytics
    /// rows) is caught up with the copy there: handed over before, reads of the new active
    /// would wait for them (or, without serve floors, answer short).
    pub derived_ready: &'a BTreeSet<PartitionId>,
    /// Time since the last wave (or since the copies were built).
    pub since_wave: Duration,
    /// The catch-up's time is up.
    pub out_of_time: bool,
}

/// What the leader does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Stop asked: partitions at their target copies stay moved, the others get back the
    /// copies they had ([`revert_map`]).
    Revert,
    /// Hand these partitions over and commit [`wave_map`] for them.
    HandOver(Vec<PartitionId>),
    /// Look again later.
    Wait,
    /// Every partition is at its target copies and every new copy caught up: eject the
    /// leaving nodes, then settle.
    Finish,
    /// Out of time with `behind` new copies not caught up: the rebalance fails (and reverts).
    OutOfTime { behind: usize },
}

/// The partitions that may be handed over now: not yet at their target copies, every new
/// copy of theirs caught up and heard by the active, their derived state ready.
pub fn ready(look: &Look<'_>) -> Vec<PartitionId> {
    look.map
        .iter()
        .zip(&look.target.partitions)
        .filter(|((p, cur), want)| {
            *cur != *want
                && look.derived_ready.contains(p)
                && look.new_copies.iter().filter(|(q, _)| q == p).all(|c| look.caught_up.contains(c) && look.heard.contains(c))
        })
        .map(|((p, _), _)| p)
        .collect()
}

/// The next step, waves grouped: partitions ready to move wait for the others until every
/// partition is ready or `wave_interval` passed since the last wave, so that a rebalance
/// makes few map changes (each one a hand-over freeze) rather than one per partition.
pub fn next_step(look: &Look<'_>, wave_interval: Duration) -> Step {
    if look.stop_asked {
        return Step::Revert;
    }
    let at_target = look.map.partitions.iter().zip(&look.target.partitions).filter(|(cur, want)| cur == want).count();
    let caught_up = look.new_copies.iter().filter(|c| look.caught_up.contains(c)).count();
    if at_target == look.target.partitions.len() && caught_up == look.new_copies.len() {
        return Step::Finish;
    }
    let ready = ready(look);
    let all_ready = ready.len() + at_target == look.target.partitions.len();
    if !ready.is_empty() && (all_ready || look.since_wave >= wave_interval) {
        return Step::HandOver(ready);
    }
    if look.out_of_time {
        return Step::OutOfTime { behind: look.new_copies.len() - caught_up };
    }
    Step::Wait
}

/// The map committed after a wave hands `ready` over: those partitions at their target
/// copies, the version `version`.
pub fn wave_map(map: &PartitionMap, target: &PartitionMap, ready: &[PartitionId], version: u64) -> PartitionMap {
    let mut next = map.clone();
    for &p in ready {
        next.partitions[usize::from(p)] = target.partitions[usize::from(p)].clone();
    }
    next.version = version;
    debug_assert!(next.check().is_ok());
    next
}

/// The map after a stop or a failure: each partition at its target copies stays; every
/// other keeps only the copies it had when the rebalance started (`from`), the new ones
/// dropped. `None` when that is `current` already; else the version is one higher.
pub fn revert_map(current: &PartitionMap, from: &PartitionMap, target: &PartitionMap) -> Option<PartitionMap> {
    let mut back = current.clone();
    for ((copies, before), want) in back.partitions.iter_mut().zip(&from.partitions).zip(&target.partitions) {
        if copies != want {
            copies.replicas.retain(|r| before.holds(*r));
        }
    }
    if back.partitions == current.partitions {
        return None;
    }
    back.version = current.version + 1;
    debug_assert!(back.check().is_ok());
    Some(back)
}

/// How one of a rebalance's two side-by-side stages (the data partitions' waves, the index
/// partitions' moves) has ended, or not yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StageEnd {
    Running,
    /// Every partition of the stage is at its target copies.
    Moved,
    /// The data stage stopped as asked (what had not moved reverted).
    Stopped,
    Failed,
}

/// What the leader does with its two stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stages {
    /// Wait for the data stage; an index stage that ends meanwhile is kept for after it.
    WaitData,
    /// The data stage moved everything: wait for the index stage.
    WaitIndex,
    /// The data stage stopped or failed: the rebalance ends as it did, the index stage is
    /// dropped (its new copies, never named in the placement, are dropped by their nodes).
    EndAsData,
    /// A stop asked once the data stage moved everything: the rebalance ends stopped, the
    /// data moves done stay, the index stage is dropped as above (the placement stays).
    EndStopped,
    /// The data stage moved everything and the index stage failed: the rebalance fails
    /// with the index stage's error (the placement stays).
    FailAsIndex,
    /// Both moved everything: on to the finish (eject, settle).
    Finish,
}

/// The data and the index stage run side by side (an index partition is fed by every data
/// partition's active wherever it is, so its moves need no data move first). The data stage
/// decides first: it is never left in the middle of a hand-over, so an index stage that
/// fails waits for it to end, and a data stage that stops or fails ends the rebalance
/// whatever the index stage is doing. A stop (`stop_asked`) the data stage took care of
/// while it ran; once it has moved everything, a stop ends the index stage. Pure.
pub fn stages_next(data: StageEnd, index: StageEnd, stop_asked: bool) -> Stages {
    debug_assert!(index != StageEnd::Stopped, "the index stage stops only with the data stage");
    match (data, index) {
        (StageEnd::Running, _) => Stages::WaitData,
        (StageEnd::Stopped | StageEnd::Failed, _) => Stages::EndAsData,
        (StageEnd::Moved, StageEnd::Running) if stop_asked => Stages::EndStopped,
        (StageEnd::Moved, StageEnd::Running) => Stages::WaitIndex,
        (StageEnd::Moved, StageEnd::Failed) => Stages::FailAsIndex,
        (StageEnd::Moved, StageEnd::Moved | StageEnd::Stopped) => Stages::Finish,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::map::Copies;

    fn map(version: u64, rows: &[(u64, &[u64])]) -> PartitionMap {
        PartitionMap {
            version,
            partitions: rows.iter().map(|(a, r)| Copies { active: NodeId(*a), replicas: r.iter().map(|n| NodeId(*n)).collect() }).collect(),
        }
    }

    fn set<T: Ord + Copy>(items: &[T]) -> BTreeSet<T> {
        items.iter().copied().collect()
    }

    #[test]
    fn the_data_stage_decides_first_a_failed_index_stage_waits_for_it_and_a_stop_ends_it() {
        use StageEnd::*;
        // (data stage, index stage, stop asked, next)
        let table = [
            (Running, Running, false, Stages::WaitData),
            (Running, Moved, false, Stages::WaitData),
            (Running, Failed, false, Stages::WaitData),
            // A stop while the data stage runs is the data stage's to carry out (it reverts
            // what has not moved and ends stopped).
            (Running, Running, true, Stages::WaitData),
            (Moved, Running, false, Stages::WaitIndex),
            (Moved, Running, true, Stages::EndStopped),
            (Moved, Moved, false, Stages::Finish),
            // The index stage ended before the stop was seen: the rebalance is done.
            (Moved, Moved, true, Stages::Finish),
            (Moved, Failed, false, Stages::FailAsIndex),
            (Moved, Failed, true, Stages::FailAsIndex),
            (Stopped, Running, true, Stages::EndAsData),
            (Stopped, Moved, true, Stages::EndAsData),
            (Failed, Running, false, Stages::EndAsData),
            (Failed, Failed, false, Stages::EndAsData),
        ];
        for (data, index, stop, next) in table {
            assert_eq!(stages_next(data, index, stop), next, "{data:?} {index:?} {stop}");
        }
    }

    #[test]
    fn the_build_map_adds_every_new_copy_as_a_replica() {
        let from = map(4, &[(1, &[2]), (2, &[1])]);
        let target = map(0, &[(3, &[1]), (2, &[1])]);
        assert_eq!(build_map(&from, &target), map(5, &[(1, &[2, 3]), (2, &[1])]));
        assert_eq!(new_copies(&from, &target), Ok(vec![(0, NodeId(3))]));
        assert_eq!(build_map(&from, &from), from, "nothing to build: the same map, the same version");
        // Three replicas, a swap of two nodes: the build map holds all six copies.
        let from = map(4, &[(1, &[2, 3, 4])]);
        let target = map(0, &[(5, &[6, 3, 4])]);
        let built = build_map(&from, &target);
        assert_eq!(built.check(), Ok(()));
        assert_eq!(built.partitions[0].replicas.len(), 5);
    }

    fn look<'a>(
        map: &'a PartitionMap,
        target: &'a PartitionMap,
        new_copies: &'a [(PartitionId, NodeId)],
        caught_up: &'a BTreeSet<(PartitionId, NodeId)>,
        heard: &'a BTreeSet<(PartitionId, NodeId)>,
        derived_ready: &'a BTreeSet<PartitionId>,
    ) -> Look<'a> {
        Look { stop_asked: false, map, target, new_copies, caught_up, heard, derived_ready, since_wave: Duration::ZERO, out_of_time: false }
    }

    #[test]
    fn next_step_table() {
        let target = map(0, &[(3, &[1]), (2, &[3]), (1, &[2])]);
        let from = map(1, &[(1, &[2]), (2, &[1]), (1, &[2])]);
        let built = build_map(&from, &target);
        let copies = new_copies(&from, &target).unwrap();
        assert_eq!(copies, vec![(0, NodeId(3)), (1, NodeId(3))]);
        let all = set(&copies);
        let none: BTreeSet<(u16, NodeId)> = BTreeSet::new();
        let no_partition: BTreeSet<u16> = BTreeSet::new();
        let both = set(&[0u16, 1]);
        let wave = Duration::from_secs(15);
        let one = set(&[(0u16, NodeId(3))]);
        let only_0 = set(&[0u16]);
        let cases: Vec<(&str, Look<'_>, Step)> = vec![
            ("nothing caught up: wait", look(&built, &target, &copies, &none, &none, &both), Step::Wait),
            ("caught up but not heard: wait", look(&built, &target, &copies, &all, &none, &both), Step::Wait),
            ("caught up, heard, derived state behind: wait", look(&built, &target, &copies, &all, &all, &no_partition), Step::Wait),
            ("every partition ready: one wave", look(&built, &target, &copies, &all, &all, &both), Step::HandOver(vec![0, 1])),
            ("one of two ready: it waits for the other", look(&built, &target, &copies, &one, &one, &only_0), Step::Wait),
            (
                "one of two ready, the wave interval passed: it goes alone",
                Look { since_wave: wave, ..look(&built, &target, &copies, &one, &one, &only_0) },
                Step::HandOver(vec![0]),
            ),
            ("a stop comes first", Look { stop_asked: true, ..look(&built, &target, &copies, &all, &all, &both) }, Step::Revert),
            (
                "out of time",
                Look { out_of_time: true, ..look(&built, &target, &copies, &one, &one, &only_0) },
                Step::OutOfTime { behind: 1 },
            ),
            (
                "out of time, but a wave is due: the ready partitions move first",
                Look { out_of_time: true, since_wave: wave, ..look(&built, &target, &copies, &one, &one, &only_0) },
                Step::HandOver(vec![0]),
            ),
        ];
        for (name, look, want) in cases {
            assert_eq!(next_step(&look, wave), want, "{name}");
        }
        // After the wave, at the target: finish.
        let after = wave_map(&built, &target, &[0, 1], built.version + 1);
        assert_eq!(after.partitions, target.partitions);
        assert_eq!(next_step(&look(&after, &target, &copies, &all, &all, &both), wave), Step::Finish);
        // Moved, but a new copy fell behind its (new) active: not finished.
        assert_eq!(next_step(&look(&after, &target, &copies, &one, &one, &both), wave), Step::Wait);
    }

    #[test]
    fn a_revert_keeps_what_moved_and_drops_the_copies_not_yet_used() {
        let from = map(1, &[(1, &[2]), (2, &[1])]);
        let target = map(0, &[(3, &[1]), (3, &[2])]);
        let built = build_map(&from, &target);
        let moved = wave_map(&built, &target, &[0], built.version + 1);
        let back = revert_map(&moved, &from, &target).expect("partition 1's new copy goes");
        assert_eq!(back.partitions, map(0, &[(3, &[1]), (2, &[1])]).partitions);
        assert_eq!(back.version, moved.version + 1);
        assert_eq!(revert_map(&from, &from, &target), None, "nothing built: nothing to revert");
    }
}
