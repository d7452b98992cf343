//! Rebalances through the stage machine (`shoal_cluster::rebalance`) under the seeded
//! simulation's faults (`shoal_cluster::sim`): message loss, crashes, lagging members,
//! leader changes, stops and failovers mid-rebalance. The safe protocol keeps every
//! acknowledged write, its majority and `request_plus` derived reads linearizable, and no
//! derived read short of a write acknowledged before it; and each rule the hand-over
//! depends on, taken away, is caught: a hand-over before the index catch-up with reads
//! below the serve floor (the bug of issue 40), `request_plus` derived reads without a
//! majority's confirmation, a hand-over to a copy not caught up, majorities of the build
//! map alone (production's count), a hand-over without its freeze, a freeze thawed by a
//! crash.

use shoal_cluster::sim::{run, Protocol, RunStats, SimConfig, COPIES_MAX, COPIES_MIN};

/// Steps per run: room for a few rebalances, failovers and leader changes.
const STEPS: u64 = 1_000;
/// Seeds per copy count for the safe protocol.
const SEEDS_PER_COPIES: u64 = 1_500;
/// Seeds per copy count for the protocol without the hand-over's wait for derived state.
const FLOOR_ONLY_SEEDS_PER_COPIES: u64 = 500;
/// Seeds searched per copy count for a counterexample to a broken protocol before the
/// checker is deemed toothless.
const BROKEN_SEEDS_MAX: u64 = 4_000;

fn sum_over_seeds(protocol: Protocol, seeds: u64) -> RunStats {
    let mut total = RunStats::default();
    for copies in COPIES_MIN..=COPIES_MAX {
        let config = SimConfig { copies, steps: STEPS, protocol };
        for seed in 0..seeds {
            match run(seed, &config) {
                Ok(stats) => total += stats,
                Err(v) => panic!("copies {copies}: {v:?}"),
            }
        }
    }
    total
}

#[test]
fn rebalances_through_the_stage_machine_keep_acknowledged_writes_and_exact_reads() {
    let total = sum_over_seeds(Protocol::SAFE, SEEDS_PER_COPIES);
    println!("{total:?}");
    // The runs did something worth checking: hand-overs of the active role, rebalances
    // finished and reverted, leader changes, failovers, and reads of every kind.
    assert!(total.handovers > 300, "{total:?}");
    assert!(total.rebalances_finished > 500, "{total:?}");
    assert!(total.rebalances_reverted > 500, "{total:?}");
    assert!(total.leader_changes > 2_000, "{total:?}");
    assert!(total.promotions > 1_000, "{total:?}");
    assert!(total.writes_acknowledged > 5_000, "{total:?}");
    assert!(total.reads_completed > 5_000, "{total:?}");
    assert!(total.derived_reads_request_plus > 1_000, "{total:?}");
    assert!(total.derived_reads_not_bounded > 10_000, "{total:?}");
}

/// Serve floors alone keep derived reads whole: a leader that hands over before the new
/// active's derived state caught up makes its reads wait, not answer short (the wait for
/// derived readiness only shortens that wait).
#[test]
fn serve_floors_alone_keep_derived_reads_whole() {
    let total = sum_over_seeds(Protocol { handover_waits_for_derived: false, ..Protocol::SAFE }, FLOOR_ONLY_SEEDS_PER_COPIES);
    assert!(total.handovers > 100 && total.derived_reads_not_bounded > 3_000, "{total:?}");
}

/// The first `(copies, seed, invariant)` on which `protocol` breaks an invariant, copy counts
/// in the order given, up to `BROKEN_SEEDS_MAX` seeds each.
fn first_violation(protocol: Protocol, copies: &[usize]) -> Option<(usize, u64, &'static str)> {
    copies.iter().find_map(|&copies| {
        let config = SimConfig { copies, steps: STEPS, protocol };
        (0..BROKEN_SEEDS_MAX).find_map(|seed| run(seed, &config).err().map(|v| (copies, v.seed, v.invariant)))
    })
}

/// Runs every case; each must be caught, as one of the invariants it names.
fn assert_caught(cases: &[(&str, Protocol, &[usize], &[&str])]) {
    for (name, protocol, copies, invariants) in cases {
        let found = first_violation(*protocol, copies);
        println!("{name}: {found:?}");
        assert!(found.is_some_and(|(_, _, invariant)| invariants.contains(&invariant)), "{name}: {found:?}");
    }
}

/// Lost or wrong answers: an acknowledged write missing from the final history, or a read
/// of a value that never made it there or out of order.
const LOST_WRITE: &[&str] = &["acknowledged write lost", "read of a value not in the final history", "not linearizable"];

#[test]
fn a_handover_before_the_index_catch_up_with_reads_below_the_serve_floor_answers_short() {
    assert_caught(&[
        (
            "a hand-over before the index catch-up, derived reads below the serve floor (before issue 40)",
            Protocol { handover_waits_for_derived: false, derived_reads_from_serve_floor: false, ..Protocol::SAFE },
            &[2, 3, 4],
            &["short derived read"],
        ),
        (
            "derived reads below the serve floor, the hand-over waiting for the index",
            Protocol { derived_reads_from_serve_floor: false, ..Protocol::SAFE },
            &[2, 3, 4],
            &["short derived read"],
        ),
    ]);
}

/// A `request_plus` read of derived state that waits only for its view to reach the high of
/// its start, with no majority behind its position and no confirmation round, answers
/// changes a failover then drops, and stale values from a deposed active.
#[test]
fn request_plus_derived_reads_without_a_majority_confirmation_are_not_exact() {
    assert_caught(&[(
        "request_plus derived reads, unconfirmed",
        Protocol { confirmed_derived_reads: false, ..Protocol::SAFE },
        &[3, 2, 4],
        &["read of a value not in the final history", "not linearizable"],
    )]);
}

#[test]
fn a_handover_to_a_copy_not_caught_up_loses_acknowledged_writes() {
    assert_caught(&[(
        "a hand-over before the new copy caught up and is heard",
        Protocol { handover_waits_for_copies: false, ..Protocol::SAFE },
        &[2, 3, 4],
        LOST_WRITE,
    )]);
}

/// A wave's hand-over that waits only for the new active (and none where the active stays)
/// leaves a new replica without the writes acknowledged just before the wave; a failover of
/// the new active then promotes it.
///
/// Rare: the write must land on the replica the wave drops just before the wave, and the
/// new active fail before the new replica pulls it — 13 runs in 20,000 with one replica,
/// the first at seed 4,018; none in 20,000 with two or three. So it searches further.
#[test]
fn a_handover_that_waits_for_the_new_active_alone_loses_acknowledged_writes() {
    let config = SimConfig { copies: 2, steps: STEPS, protocol: Protocol { handover_waits_for_whole_target: false, ..Protocol::SAFE } };
    let found = (0..WHOLE_TARGET_SEEDS_MAX).find_map(|seed| run(seed, &config).err());
    assert!(found.as_ref().is_some_and(|v| LOST_WRITE.contains(&v.invariant)), "{found:?}");
}

/// Seeds searched for the rare loss of a hand-over that waits for the new active alone.
const WHOLE_TARGET_SEEDS_MAX: u64 = 5_000;

#[test]
fn majorities_of_the_build_map_alone_lose_acknowledged_writes() {
    // With one replica a build map has three copies: the old active and the new copy make
    // a majority without the replica. A failover then leaves two copies, the write on one,
    // and the next failover may promote the other.
    assert_caught(&[("majorities of the map's copies alone", Protocol { joint_majorities: false, ..Protocol::SAFE }, &[2], LOST_WRITE)]);
}

#[test]
fn a_handover_without_its_freeze_loses_acknowledged_writes() {
    assert_caught(&[
        ("the old active takes writes during the hand-over", Protocol { handover_freezes: false, ..Protocol::SAFE }, &[4, 3], LOST_WRITE),
        ("a restart thaws the old active's freeze", Protocol { freeze_survives_crash: false, ..Protocol::SAFE }, &[3, 4], LOST_WRITE),
    ]);
}
