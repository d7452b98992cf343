//! Failover decisions as tables: who is promoted, what stays unavailable, when the metadata
//! leader may fail a node over by itself, and that restoring replicas afterwards builds only
//! the missing copies.

use shoal_cluster::failover::AUTO_FAILOVER_MAX_COUNT_DEFAULT;
use shoal_cluster::{
    auto_failover_allowed, failover, place, plan_moves, AutoFailoverRefused, Copies, Node, NodeId, PartitionMap, Promoted,
};

fn map(rows: &[(u64, &[u64])]) -> PartitionMap {
    PartitionMap {
        version: 5,
        partitions: rows.iter().map(|(a, r)| Copies { active: NodeId(*a), replicas: r.iter().map(|n| NodeId(*n)).collect() }).collect(),
    }
}

/// Progress by (partition, node); absent means the copy cannot be promoted.
fn progress(table: &'static [(u16, u64, u64)]) -> impl Fn(u16, NodeId) -> Option<u64> {
    move |p, n| table.iter().find(|(tp, tn, _)| *tp == p && NodeId(*tn) == n).map(|(_, _, s)| *s)
}

#[test]
fn failover_table() {
    struct Case {
        name: &'static str,
        before: PartitionMap,
        failed: u64,
        progress: &'static [(u16, u64, u64)],
        after: PartitionMap,
        promotions: &'static [(u16, u64, u64)],
        unavailable: &'static [u16],
        replicas_dropped: &'static [u16],
    }
    let cases = [
        Case {
            name: "one replica each: promoted, the failed node's replica dropped",
            before: map(&[(1, &[2]), (2, &[1]), (3, &[1])]),
            failed: 1,
            progress: &[(0, 2, 40)],
            after: map(&[(2, &[]), (2, &[]), (3, &[])]),
            promotions: &[(0, 2, 40)],
            unavailable: &[],
            replicas_dropped: &[1, 2],
        },
        Case {
            name: "the most advanced replica wins",
            before: map(&[(1, &[2, 3])]),
            failed: 1,
            progress: &[(0, 2, 10), (0, 3, 12)],
            after: map(&[(3, &[2])]),
            promotions: &[(0, 3, 12)],
            unavailable: &[],
            replicas_dropped: &[],
        },
        Case {
            name: "a tie goes to the replica listed first",
            before: map(&[(1, &[3, 2])]),
            failed: 1,
            progress: &[(0, 2, 12), (0, 3, 12)],
            after: map(&[(3, &[2])]),
            promotions: &[(0, 3, 12)],
            unavailable: &[],
            replicas_dropped: &[],
        },
        Case {
            name: "a replica that cannot be promoted is passed over",
            before: map(&[(1, &[2, 3])]),
            failed: 1,
            progress: &[(0, 3, 7)],
            after: map(&[(3, &[2])]),
            promotions: &[(0, 3, 7)],
            unavailable: &[],
            replicas_dropped: &[],
        },
        Case {
            name: "no usable replica: unavailable, the failed node stays named as the only copy",
            before: map(&[(1, &[2]), (1, &[]), (2, &[1])]),
            failed: 1,
            progress: &[],
            after: map(&[(1, &[2]), (1, &[]), (2, &[])]),
            promotions: &[],
            unavailable: &[0, 1],
            replicas_dropped: &[2],
        },
        Case {
            name: "a node with replicas only: nothing promoted",
            before: map(&[(2, &[1]), (3, &[1])]),
            failed: 1,
            progress: &[],
            after: map(&[(2, &[]), (3, &[])]),
            promotions: &[],
            unavailable: &[],
            replicas_dropped: &[0, 1],
        },
    ];
    for case in cases {
        let plan = failover(&case.before, NodeId(case.failed), &progress(case.progress));
        let mut after = case.after.clone();
        after.version = case.before.version + 1;
        assert_eq!(plan.map, after, "{}", case.name);
        let promotions: Vec<Promoted> =
            case.promotions.iter().map(|(p, to, s)| Promoted { partition: *p, to: NodeId(*to), seqno: *s }).collect();
        assert_eq!(plan.promotions, promotions, "{}", case.name);
        assert_eq!(plan.unavailable, case.unavailable, "{}", case.name);
        assert_eq!(plan.replicas_dropped, case.replicas_dropped, "{}", case.name);
        assert_eq!(plan.map.check(), Ok(()), "{}", case.name);
    }
}

#[test]
fn auto_failover_table() {
    let m = map(&[(1, &[2]), (2, &[1]), (1, &[3])]);
    let acked = |p: u16| [10, 99, 20][usize::from(p)];
    let max = AUTO_FAILOVER_MAX_COUNT_DEFAULT;
    // (name, replica progress, failed node, nodes failed over so far, answer)
    type Case = (&'static str, &'static [(u16, u64, u64)], u64, usize, Result<(), AutoFailoverRefused>);
    let cases: &[Case] = &[
        ("replicas hold every acknowledged write", &[(0, 2, 10), (2, 3, 25)], 1, 0, Ok(())),
        (
            "a replica behind the acknowledged seqno",
            &[(0, 2, 10), (2, 3, 19)],
            1,
            0,
            Err(AutoFailoverRefused::WouldLoseData { partitions: vec![2] }),
        ),
        ("a replica that cannot be promoted", &[(0, 2, 10)], 1, 0, Err(AutoFailoverRefused::WouldLoseData { partitions: vec![2] })),
        (
            "one node already failed over",
            &[(0, 2, 10), (2, 3, 25)],
            1,
            1,
            Err(AutoFailoverRefused::CountReached { failed_over: 1, max_count: max }),
        ),
        ("a replica exactly at the acknowledged seqno", &[(1, 1, 99)], 2, 0, Ok(())),
    ];
    for (name, table, failed, failed_over, want) in cases {
        let got = auto_failover_allowed(&m, NodeId(*failed), *failed_over, max, &progress(table), &acked);
        assert_eq!(&got, want, "{name}");
    }
    // The only copy: no replica at all.
    let lone = map(&[(1, &[])]);
    assert_eq!(
        auto_failover_allowed(&lone, NodeId(1), 0, max, &|_, _| None, &|_| 0),
        Err(AutoFailoverRefused::WouldLoseData { partitions: vec![0] })
    );
}

/// After a failover, the rebalance that restores replica counts builds exactly the copies
/// the failed node held and nothing else (issue 14, item 2).
#[test]
fn restoring_replicas_builds_only_missing_copies() {
    for (nodes, partitions, replicas) in [(3u64, 128u16, 1u8), (4, 1024, 1), (8, 1024, 2), (16, 128, 2)] {
        let all: Vec<Node> = (1..=nodes).map(|id| Node { id: NodeId(id), weight: 1 }).collect();
        let before = place(partitions, &all, replicas, None).unwrap();
        let failed = NodeId(2);
        let plan = failover(&before, failed, &|_, n| Some(n.0)); // every replica usable
        assert!(plan.unavailable.is_empty());
        let survivors: Vec<Node> = all.iter().copied().filter(|n| n.id != failed).collect();
        let restored = place(partitions, &survivors, replicas, Some(&plan.map)).unwrap();
        let moves = plan_moves(&plan.map, &restored).unwrap();
        let held = before.partitions.iter().filter(|c| c.holds(failed)).count();
        assert_eq!(moves.moves.len(), held, "nodes={nodes} partitions={partitions} replicas={replicas}");
        assert!(moves.moves.iter().all(|m| m.from.is_none()), "only new copies, nothing moved between survivors");
        assert!(moves.drops.is_empty());
        println!(
            "{nodes} nodes, {partitions} partitions, {replicas} replicas: failover promoted {}, restore builds {held}, promotions {}",
            plan.promotions.len(),
            moves.promotions.len()
        );
    }
}
