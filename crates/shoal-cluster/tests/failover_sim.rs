//! The replication and failover protocol under a seeded simulation (`shoal_cluster::sim`):
//! thousands of schedules with a lossy network, crashes, lagging members and false
//! suspicions keep every acknowledged write and stay linearizable; and the protocol without
//! its fence quorum, with majorities of the shrinking map (as first specified), or with
//! unconfirmed reads is caught, so the checker is shown to bite.

use shoal_cluster::sim::{run, Protocol, RunStats, SimConfig, COPIES_MAX, COPIES_MIN};

/// Seeds per copy count for the safe protocol.
const SEEDS_PER_COPIES: u64 = 700;
/// Steps per run: enough for a few failovers and their catch-up.
const STEPS: u64 = 400;
/// Seeds searched for a counterexample to a broken protocol before the checker is deemed
/// toothless.
const BROKEN_SEEDS_MAX: u64 = 2_000;

#[test]
fn fenced_failover_keeps_acknowledged_writes_and_linearizability() {
    let mut total = RunStats::default();
    for copies in COPIES_MIN..=COPIES_MAX {
        let config = SimConfig { copies, steps: STEPS, protocol: Protocol::SAFE };
        for seed in 0..SEEDS_PER_COPIES {
            match run(seed, &config) {
                Ok(stats) => {
                    total.writes_acknowledged += stats.writes_acknowledged;
                    total.reads_completed += stats.reads_completed;
                    total.promotions += stats.promotions;
                }
                Err(v) => panic!("copies {copies}: {v:?}"),
            }
        }
    }
    // The runs did something worth checking.
    assert!(total.writes_acknowledged > 5_000, "{total:?}");
    assert!(total.reads_completed > 5_000, "{total:?}");
    assert!(total.promotions > 1_000, "{total:?}");
}

/// The first seed below `BROKEN_SEEDS_MAX` on which `protocol` with `copies` breaks an
/// invariant, and which.
fn first_violation(copies: usize, protocol: Protocol) -> Option<(u64, &'static str)> {
    let config = SimConfig { copies, steps: STEPS, protocol };
    (0..BROKEN_SEEDS_MAX).find_map(|seed| run(seed, &config).err().map(|v| (v.seed, v.invariant)))
}

#[test]
fn broken_protocols_are_caught() {
    let cases = [
        ("promotion on the first report", Protocol { fence_quorum: false, ..Protocol::SAFE }, 3),
        ("promotion on the first report", Protocol { fence_quorum: false, ..Protocol::SAFE }, 4),
        ("majorities of the shrinking map", Protocol { majority_of_configured_copies: false, ..Protocol::SAFE }, 3),
        ("as first specified", Protocol::AS_SPECIFIED, 3),
        ("reads without the confirmation round", Protocol { confirmed_reads: false, ..Protocol::SAFE }, 3),
    ];
    for (name, protocol, copies) in cases {
        let found = first_violation(copies, protocol);
        assert!(found.is_some(), "{name}, {copies} copies: {found:?}");
    }
}

/// Steps of the runs below: long enough for a failover, a rebalance that fills the vacant
/// slot, and a second failover.
const LONG_STEPS: u64 = 1_000;
/// Seeds searched with [`LONG_STEPS`]. The counterexample below is rare — a replica
/// left on an older history through a failover, a refill and a second failover: a few per
/// 10,000 seeds (seed 3002 since rebalances run through the stage machine; 2165 before).
const LONG_SEEDS: u64 = 3_500;

/// Promotion by seqno alone (`choose_promotion` fed every copy at epoch 0) loses acknowledged
/// writes once a rebalance has filled the slot a failover left vacant: the active then
/// gathers majorities without a replica that was down at the failover, still on the older
/// active's history with a higher seqno, and the next failover promotes that copy. (Without
/// the refill, the vacant slot made every majority wait for it, and the seqno rule could not
/// be told from the epoch rule.) The rule that runs, epoch then seqno, keeps them all.
#[test]
fn promotion_by_seqno_alone_loses_acknowledged_writes_and_by_history_end_does_not() {
    let seqno_only = SimConfig { copies: 4, steps: LONG_STEPS, protocol: Protocol { promote_by_history_end: false, ..Protocol::SAFE } };
    let found = (0..LONG_SEEDS).find_map(|seed| run(seed, &seqno_only).err());
    assert!(found.as_ref().is_some_and(|v| v.invariant == "acknowledged write lost"), "{found:?}");
    let safe = SimConfig { copies: 4, steps: LONG_STEPS, protocol: Protocol::SAFE };
    for seed in 0..LONG_SEEDS {
        if let Err(v) = run(seed, &safe) {
            panic!("{v:?}");
        }
    }
}
