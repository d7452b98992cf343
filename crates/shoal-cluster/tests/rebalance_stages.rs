//! The rebalance's stage machine (`shoal_cluster::rebalance`) under a seeded model of what
//! the metadata leader sees: copies that catch up and fall behind as writes go on, derived
//! state (index entries, shadow rows) that lags, progress answers lost, leader changes (the
//! next leader starts from the log: the committed map and the plan), and stops. Checked at
//! every map it commits: a partition is handed over only to copies that are caught up, heard
//! by their active and whose derived state is ready — so a read of the new active is whole —
//! and a finished rebalance is at its target, a stopped one keeps exactly what moved. A
//! leader that ignores derived readiness is caught.

use std::collections::BTreeSet;
use std::time::Duration;

use shoal_cluster::rebalance::{build_map, new_copies, next_step, revert_map, wave_map, Look, Step};
use shoal_cluster::sim::SplitMix64;
use shoal_cluster::{place, Node, NodeId, PartitionId, PartitionMap};

const PARTITIONS: u16 = 12;
const WAVE_INTERVAL: Duration = Duration::from_secs(15);
/// Model seconds before the catch-up runs out of time.
const OUT_OF_TIME_AFTER: u64 = 400;
const SEEDS: u64 = 3_000;

/// How a run ended.
#[derive(Debug, PartialEq, Eq)]
enum End {
    Finished,
    Reverted,
    OutOfTime,
}

/// One seeded rebalance: 3 nodes to 4, 4 to 3, or a swap, with one replica. With
/// `trust_derived`, the leader believes every partition's derived state ready (the broken
/// variant). Answers how it ended, or the first broken rule.
fn run(seed: u64, trust_derived: bool) -> Result<End, String> {
    let mut rng = SplitMix64(seed);
    let nodes = |ids: &[u64]| ids.iter().map(|&id| Node { id: NodeId(id), weight: 1 }).collect::<Vec<_>>();
    let (before, after): (Vec<Node>, Vec<Node>) = match rng.next_u64() % 3 {
        0 => (nodes(&[1, 2, 3]), nodes(&[1, 2, 3, 4])),
        1 => (nodes(&[1, 2, 3, 4]), nodes(&[1, 2, 3])),
        _ => (nodes(&[1, 2, 3]), nodes(&[1, 2, 4])),
    };
    let mut from = place(PARTITIONS, &before, 1, None).map_err(|e| e.to_string())?;
    from.version = 1;
    let target = place(PARTITIONS, &after, 1, Some(&from)).map_err(|e| e.to_string())?;
    let copies = new_copies(&from, &target).map_err(|e| e.to_string())?;
    let mut map = build_map(&from, &target);
    // The truth, which the leader sees only through progress answers.
    let mut caught: BTreeSet<(PartitionId, NodeId)> = BTreeSet::new();
    let mut heard: BTreeSet<(PartitionId, NodeId)> = BTreeSet::new();
    let mut derived: BTreeSet<PartitionId> = BTreeSet::new();
    let (mut since_wave, mut elapsed) = (0u64, 0u64);
    let mut stop_asked = false;
    // Per run: how often a caught-up copy falls behind again (a busy partition), and whether
    // an operator may stop the rebalance.
    let fall_behind = [2, 5, 60][(seed % 3) as usize];
    let stop_percent = if seed.is_multiple_of(4) { 1 } else { 0 };
    loop {
        // The world moves on: copies catch up or fall behind (writes go on), actives start
        // to hear them, derived state catches up or lags.
        for c in &copies {
            if rng.percent(20) {
                caught.insert(*c);
            } else if rng.percent(fall_behind) {
                caught.remove(c);
            }
            if caught.contains(c) && rng.percent(30) {
                heard.insert(*c);
            }
        }
        for p in 0..PARTITIONS {
            if rng.percent(15) {
                derived.insert(p);
            } else if rng.percent(5) {
                derived.remove(&p);
            }
        }
        if rng.percent(stop_percent) {
            stop_asked = true;
        }
        // A leader change: the next leader starts from the log (the map, the plan); only
        // its wave clock starts afresh.
        if rng.percent(3) {
            since_wave = 0;
        }
        elapsed += 1;
        since_wave += 1;
        // What the leader sees: answers lost drop what a node would have said.
        let lost: BTreeSet<NodeId> = (1..=4).map(NodeId).filter(|_| rng.percent(10)).collect();
        let seen = |set: &BTreeSet<(PartitionId, NodeId)>| set.iter().filter(|(_, n)| !lost.contains(n)).copied().collect::<BTreeSet<_>>();
        let (seen_caught, seen_heard) = (seen(&caught), seen(&heard));
        let seen_derived: BTreeSet<PartitionId> = if trust_derived {
            (0..PARTITIONS).collect()
        } else {
            derived.iter().filter(|p| !lost.contains(&target.partitions[usize::from(**p)].active)).copied().collect()
        };
        let look = Look {
            stop_asked,
            map: &map,
            target: &target,
            new_copies: &copies,
            caught_up: &seen_caught,
            heard: &seen_heard,
            derived_ready: &seen_derived,
            since_wave: Duration::from_secs(since_wave),
            out_of_time: elapsed >= OUT_OF_TIME_AFTER,
        };
        match next_step(&look, WAVE_INTERVAL) {
            Step::Wait => {}
            Step::HandOver(ready) => {
                for &p in &ready {
                    for c in copies.iter().filter(|(q, _)| *q == p) {
                        if !caught.contains(c) || !heard.contains(c) {
                            return Err(format!("seed {seed}: partition {p} handed over before its copy on {} caught up", c.1));
                        }
                    }
                    if !derived.contains(&p) {
                        return Err(format!("seed {seed}: partition {p} handed over before its index entries caught up"));
                    }
                }
                map = wave_map(&map, &target, &ready, map.version + 1);
                since_wave = 0;
            }
            Step::Finish => {
                return if map.partitions == target.partitions {
                    Ok(End::Finished)
                } else {
                    Err(format!("seed {seed}: finished off target"))
                };
            }
            end @ (Step::Revert | Step::OutOfTime { .. }) => {
                let back = revert_map(&map, &from, &target).unwrap_or_else(|| map.clone());
                check_reverted(&back, &map, &from, &target).map_err(|e| format!("seed {seed}: {e}"))?;
                return Ok(if end == Step::Revert { End::Reverted } else { End::OutOfTime });
            }
        }
    }
}

/// After a revert: every partition that reached its target copies keeps them; every other
/// has exactly the copies it started with.
fn check_reverted(back: &PartitionMap, at: &PartitionMap, from: &PartitionMap, target: &PartitionMap) -> Result<(), String> {
    back.check().map_err(|e| e.to_string())?;
    for (p, copies) in back.iter() {
        let (moved, was) = (at.partitions[usize::from(p)] == target.partitions[usize::from(p)], &from.partitions[usize::from(p)]);
        if moved && copies != &target.partitions[usize::from(p)] {
            return Err(format!("partition {p} had moved, and the revert took it back"));
        }
        if !moved && copies != was {
            return Err(format!("partition {p} reverted to {copies:?}, not to {was:?}"));
        }
    }
    Ok(())
}

#[test]
fn rebalances_hand_over_only_whole_copies_and_end_at_their_target_or_where_they_started() {
    let mut ends = std::collections::BTreeMap::new();
    for seed in 0..SEEDS {
        let end = run(seed, false).unwrap_or_else(|e| panic!("{e}"));
        *ends.entry(format!("{end:?}")).or_insert(0usize) += 1;
    }
    // Every way of ending was exercised.
    for end in ["Finished", "Reverted", "OutOfTime"] {
        assert!(ends.get(end).is_some_and(|n| *n > 0), "{ends:?}");
    }
}

#[test]
fn a_leader_that_hands_over_before_the_index_catch_up_is_caught() {
    let found = (0..SEEDS).find_map(|seed| run(seed, true).err());
    assert!(found.as_ref().is_some_and(|e| e.contains("before its index entries caught up")), "{found:?}");
}
