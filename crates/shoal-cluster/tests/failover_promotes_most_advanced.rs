//! Failover decisions as tables: who is promoted, what stays unavailable, when the metadata
//! leader may fail a node over by itself, and that restoring replicas afterwards builds only
//! the missing copies.

use shoal_cluster::failover::AUTO_FAILOVER_MAX_COUNT_DEFAULT;
use shoal_cluster::failover::{choose_promotion, CollectionEnds, PromotionChoice};
use shoal_cluster::{
    auto_failover_allowed, failover_fenced, place, plan_moves, AutoFailoverRefused, Copies, HistoryEnd, Node, NodeId, PartitionMap,
    Promoted,
};

fn map(rows: &[(u64, &[u64])]) -> PartitionMap {
    PartitionMap {
        version: 5,
        partitions: rows.iter().map(|(a, r)| Copies { active: NodeId(*a), replicas: r.iter().map(|n| NodeId(*n)).collect() }).collect(),
    }
}

/// [`failover_fenced`] with every copy on one history (epoch 0): ordered by seqno.
fn failover(map: &PartitionMap, failed: NodeId, progress: &dyn Fn(u16, NodeId) -> Option<u64>) -> shoal_cluster::FailoverPlan {
    failover_fenced(map, failed, &|p, n| progress(p, n).map(|seqno| HistoryEnd { epoch: 0, seqno }))
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
    let m = map(&[(1, &[2]), (2, &[1]), (1, &[3]), (3, &[])]);
    let max = 2;
    // (name, failed node, members failed over now, answer)
    type Case = (&'static str, u64, usize, Result<(), AutoFailoverRefused>);
    let cases: &[Case] = &[
        ("every partition it is active for has a replica", 1, 0, Ok(())),
        ("below the count", 2, 1, Ok(())),
        ("the count reached", 1, 2, Err(AutoFailoverRefused::CountReached { failed_now: 2, max_count: max })),
        ("the only copy of a partition", 3, 0, Err(AutoFailoverRefused::OnlyCopy { partitions: vec![3] })),
        ("active for nothing", 4, 0, Ok(())),
    ];
    for (name, failed, failed_now, want) in cases {
        assert_eq!(&auto_failover_allowed(&m, NodeId(*failed), *failed_now, max), want, "{name}");
    }
    assert_eq!(
        auto_failover_allowed(&m, NodeId(1), 0, AUTO_FAILOVER_MAX_COUNT_DEFAULT),
        Ok(()),
        "the default allows one node failed over automatically"
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

#[test]
fn fence_quorum_meets_every_majority() {
    // (copies, majority, fence quorum): fenced + majority > copies, and no smaller fence does.
    for (copies, majority, fence) in [(1, 1, 1), (2, 2, 1), (3, 2, 2), (4, 3, 2)] {
        assert_eq!(shoal_cluster::majority(copies), majority, "copies {copies}");
        assert_eq!(shoal_cluster::fence_quorum(copies), fence, "copies {copies}");
        assert!(fence + majority > copies && fence - 1 + majority <= copies, "copies {copies}");
    }
}

#[test]
fn promotion_needs_a_fence_quorum_of_the_configured_copies() {
    let copies = |active: u64, replicas: &[u64]| Copies { active: NodeId(active), replicas: replicas.iter().map(|n| NodeId(*n)).collect() };
    // (name, copies, configured copies, failed, fenced replicas, ready)
    type Case = (&'static str, Copies, usize, u64, &'static [u64], bool);
    let cases: [Case; 9] = [
        ("2 copies: the one replica fenced", copies(1, &[2]), 2, 1, &[2], true),
        ("2 copies: not fenced yet", copies(1, &[2]), 2, 1, &[], false),
        ("3 copies: both replicas fenced", copies(1, &[2, 3]), 3, 1, &[2, 3], true),
        ("3 copies: one fenced is not enough (the other may still ack the old active)", copies(1, &[2, 3]), 3, 1, &[3], false),
        ("4 copies: two of three fenced", copies(1, &[2, 3, 4]), 4, 1, &[2, 4], true),
        ("4 copies: one of three fenced", copies(1, &[2, 3, 4]), 4, 1, &[4], false),
        ("3 configured, 2 left after a failover: the vacant slot never counts", copies(3, &[2]), 3, 3, &[2], false),
        ("4 configured, 3 left after a failover: two fenced", copies(2, &[3, 4]), 4, 2, &[3, 4], true),
        ("no replica: stays unavailable", copies(1, &[]), 1, 1, &[], false),
    ];
    for (name, copies, configured, failed, fenced, ready) in cases {
        let fenced_fn = |n: NodeId| fenced.contains(&n.0);
        let quorum = shoal_cluster::Quorum::of(&copies, configured, None, configured);
        assert_eq!(quorum.fenced(NodeId(failed), &fenced_fn), ready, "{name}");
    }
}

#[test]
fn failover_fenced_orders_by_epoch_then_seqno() {
    // Replica 3 was left unfenced at the previous failover: its seqno is the highest, but
    // on the old active's history (epoch 1). Replica 2 followed the active of epoch 2.
    let before = map(&[(1, &[2, 3])]);
    let reported = |_, n: NodeId| match n.0 {
        2 => Some(HistoryEnd { epoch: 2, seqno: 6 }),
        3 => Some(HistoryEnd { epoch: 1, seqno: 9 }),
        _ => None,
    };
    let plan = failover_fenced(&before, NodeId(1), &reported);
    assert_eq!(plan.promotions, vec![Promoted { partition: 0, to: NodeId(2), seqno: 6 }]);
    // Seqnos alone would pick replica 3 and lose epoch 2's acknowledged writes.
    let by_seqno = failover(&before, NodeId(1), &|p, n| reported(p, n).map(|e| e.seqno));
    assert_eq!(by_seqno.promotions, vec![Promoted { partition: 0, to: NodeId(3), seqno: 9 }]);
}

#[test]
fn promotion_choice_table() {
    /// Reports of `(node, [(collection, seqno)])`, every copy on epoch 0.
    fn reports(rows: &[(u64, &[(u32, u64)])]) -> Vec<(NodeId, CollectionEnds)> {
        rows.iter().map(|(n, r)| (NodeId(*n), r.iter().map(|(c, s)| (*c, HistoryEnd { epoch: 0, seqno: *s })).collect())).collect()
    }
    /// `(collection, epoch, seqno)`.
    type End = (u32, u64, u64);
    /// Reports of `(node, [(collection, epoch, seqno)])`.
    fn ends(rows: &[(u64, &[End])]) -> Vec<(NodeId, CollectionEnds)> {
        rows.iter().map(|(n, r)| (NodeId(*n), r.iter().map(|(c, e, s)| (*c, HistoryEnd { epoch: *e, seqno: *s })).collect())).collect()
    }
    /// A case: its name, the fenced replicas' reports, and whom to promote with which
    /// `(collection, source)` catch-ups.
    type Case = (&'static str, Vec<(NodeId, CollectionEnds)>, Option<(u64, &'static [(u32, u64)])>);
    let cases: [Case; 10] = [
        ("no report: nothing to promote", reports(&[]), None),
        ("one replica, nothing to copy", reports(&[(2, &[(1, 10), (2, 4)])]), Some((2, &[]))),
        ("one furthest in every collection: no catch-up", reports(&[(2, &[(1, 10), (2, 4)]), (3, &[(1, 9), (2, 4)])]), Some((2, &[]))),
        ("equal: the first listed", reports(&[(3, &[(1, 5)]), (2, &[(1, 5)])]), Some((3, &[]))),
        (
            "ahead in one collection, behind in the other: the furthest in total catches up the other",
            reports(&[(2, &[(1, 10), (2, 3)]), (3, &[(1, 7), (2, 9)])]),
            Some((3, &[(1, 2)])),
        ),
        (
            "a collection the chosen copy has not seen at all",
            reports(&[(2, &[(1, 10)]), (3, &[(1, 10), (7, 1)]), (4, &[(1, 2), (7, 3)])]),
            Some((3, &[(7, 4)])),
        ),
        (
            "three replicas, each furthest somewhere: two sources",
            reports(&[(2, &[(1, 5), (2, 1), (3, 1)]), (3, &[(1, 1), (2, 6), (3, 1)]), (4, &[(1, 1), (2, 1), (3, 7)])]),
            Some((4, &[(1, 2), (2, 3)])),
        ),
        // A replica left on an older active's history (down at the last failover) holds the
        // highest seqnos, but lacks what the newer active had acknowledged.
        ("a higher seqno of an older epoch loses", ends(&[(3, &[(1, 1, 90)]), (2, &[(1, 2, 60)])]), Some((2, &[]))),
        ("stale in every collection: never chosen", ends(&[(3, &[(1, 1, 90), (2, 1, 80)]), (2, &[(1, 2, 6), (2, 2, 4)])]), Some((2, &[]))),
        (
            "newer in one collection, stale in the other: catches up there, rolling back",
            ends(&[(2, &[(1, 2, 6), (2, 1, 9)]), (3, &[(1, 1, 9), (2, 2, 4)])]),
            Some((2, &[(2, 3)])),
        ),
    ];
    for (name, reports, want) in cases {
        let got = choose_promotion(&reports);
        let want = want
            .map(|(to, catch_up)| PromotionChoice { to: NodeId(to), catch_up: catch_up.iter().map(|(c, n)| (*c, NodeId(*n))).collect() });
        assert_eq!(got, want, "{name}");
        // Whatever is chosen ends, after its catch-up, at the furthest end of every collection.
        if let Some(choice) = got {
            let mine = &reports.iter().find(|(n, _)| *n == choice.to).unwrap().1;
            for (_, r) in &reports {
                for (c, end) in r {
                    let after = choice
                        .catch_up
                        .iter()
                        .find(|(cc, _)| cc == c)
                        .map(|(_, src)| reports.iter().find(|(n, _)| n == src).unwrap().1[c])
                        .or_else(|| mine.get(c).copied());
                    assert!(after.is_some_and(|a| a >= *end), "{name}: collection {c} ends at {after:?}, a replica held {end:?}");
                }
            }
        }
    }
}
