//! Property test: random node sets, weights and add/remove sequences. After every step the
//! map is well formed, balanced by weight within ±1, the same whatever the order of the
//! nodes, unchanged when placed again, and stable: copies move only onto an added node or
//! off a removed one, never between nodes that stay.

use proptest::prelude::*;
use shoal_cluster::{place, plan_moves, Node, NodeId, PartitionMap};

#[derive(Clone, Debug)]
enum Step {
    Add { id: u64, weight: u32 },
    Remove { pick: usize },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (1u64..40, 1u32..=4).prop_map(|(id, weight)| Step::Add { id, weight }),
        any::<usize>().prop_map(|pick| Step::Remove { pick }),
    ]
}

/// Reference shares: `total × w / Σw`, shares above `cap` fixed at `cap` and the rest spread
/// again; the range a node's count must fall in.
fn share_ranges(total: u64, cap: u64, weights: &[u32]) -> Vec<(u64, u64)> {
    let mut capped = vec![false; weights.len()];
    loop {
        let free_weight: u64 = weights.iter().zip(&capped).filter(|(_, c)| !**c).map(|(w, _)| u64::from(*w)).sum();
        let free_total = total - cap * capped.iter().filter(|c| **c).count() as u64;
        let newly: Vec<usize> =
            (0..weights.len()).filter(|i| !capped[*i] && free_total * u64::from(weights[*i]) > cap * free_weight).collect();
        if newly.is_empty() {
            return weights
                .iter()
                .zip(&capped)
                .map(|(w, c)| {
                    if *c {
                        (cap, cap)
                    } else {
                        ((free_total * u64::from(*w)) / free_weight, (free_total * u64::from(*w)).div_ceil(free_weight))
                    }
                })
                .collect();
        }
        for i in newly {
            capped[i] = true;
        }
    }
}

/// Whether some node's share of copies is more than one per partition, or exactly one (`copies × w ≥ Σw`).
fn capped(nodes: &[Node], copies: usize) -> bool {
    let total: u64 = nodes.iter().map(|n| u64::from(n.weight)).sum();
    nodes.iter().any(|n| copies as u64 * u64::from(n.weight) >= total)
}

fn check(map: &PartitionMap, nodes: &[Node], partitions: u16, replicas: u8) -> Result<(), TestCaseError> {
    prop_assert_eq!(map.check(), Ok(()));
    prop_assert_eq!(map.partitions.len(), usize::from(partitions));
    let copies = (usize::from(replicas) + 1).min(nodes.len());
    for c in &map.partitions {
        prop_assert_eq!(c.replicas.len() + 1, copies);
        for n in c.nodes() {
            prop_assert!(nodes.iter().any(|m| m.id == n), "{} is not a member", n);
        }
    }
    let weights: Vec<u32> = nodes.iter().map(|n| n.weight).collect();
    let p = u64::from(partitions);
    let copy_ranges = share_ranges(p * copies as u64, p, &weights);
    let active_ranges = share_ranges(p, p, &weights);
    for (i, node) in nodes.iter().enumerate() {
        let (active, replica) = map.load(node.id);
        let total = (active + replica) as u64;
        prop_assert!(
            copy_ranges[i].0 <= total && total <= copy_ranges[i].1,
            "{} holds {} copies, range {:?}",
            node.id,
            total,
            copy_ranges[i]
        );
        let active = active as u64;
        prop_assert!(
            active_ranges[i].0 <= active && active <= active_ranges[i].1,
            "{} holds {} actives, range {:?}",
            node.id,
            active,
            active_ranges[i]
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn placement_invariants(
        partitions in prop_oneof![Just(1u16), Just(7), Just(64), Just(128), Just(256)],
        replicas in 0u8..=3,
        start in prop::collection::btree_map(1u64..40, 1u32..=4, 1..6),
        steps in prop::collection::vec(step(), 1..8),
        uniform in any::<bool>(),
    ) {
        // Half the cases with equal weights, where stability is strict.
        let weight_of = |w: u32| if uniform { 1 } else { w };
        let mut nodes: Vec<Node> = start.into_iter().map(|(id, weight)| Node { id: NodeId(id), weight: weight_of(weight) }).collect();
        let mut map = place(partitions, &nodes, replicas, None).unwrap();
        check(&map, &nodes, partitions, replicas)?;
        for step in steps {
            let before = nodes.clone();
            let (added, removed) = match step {
                Step::Add { id, weight } => {
                    if nodes.iter().any(|n| n.id.0 == id) { continue; }
                    nodes.push(Node { id: NodeId(id), weight: weight_of(weight) });
                    (Some(NodeId(id)), None)
                }
                Step::Remove { pick } => {
                    if nodes.len() == 1 { continue; }
                    let gone = nodes.remove(pick % nodes.len());
                    (None, Some(gone.id))
                }
            };
            let next = place(partitions, &nodes, replicas, Some(&map)).unwrap();
            check(&next, &nodes, partitions, replicas)?;

            // Deterministic whatever the order of the nodes; placing again changes nothing.
            let mut reversed = nodes.clone();
            reversed.reverse();
            prop_assert_eq!(&place(partitions, &reversed, replicas, Some(&map)).unwrap(), &next);
            prop_assert_eq!(&place(partitions, &nodes, replicas, Some(&next)).unwrap(), &next);

            // Stable: nothing moves between nodes that stay, and a removal builds exactly what
            // the node held — with equal weights. With unequal weights the distinct-node rule
            // can force it: a heavy node that already holds most partitions can take only the
            // few it lacks, so a lighter staying node passes it one (and a node whose share
            // reaches one copy per partition must take every partition, from wherever).
            let plan = plan_moves(&map, &next).unwrap();
            let copies_before = (usize::from(replicas) + 1).min(before.len());
            let copies_after = (usize::from(replicas) + 1).min(nodes.len());
            let equal = nodes.iter().chain(&before).all(|n| n.weight == before[0].weight);
            if !equal || capped(&before, copies_before) || capped(&nodes, copies_after) {
                map = next;
                continue;
            }
            // With equal weights a removal can still force moves between stayers: the
            // leaving node's partitions may all be held already by the nodes that have room
            // (found by the random test: 7 partitions, 3 copies, 8 → 7 nodes). The lower
            // bound is what no assignment of its copies to stayers with room can place.
            let slack = removed.map_or(0, |r| forced_between_stayers(&map, &nodes, copies_after, r));
            let between_stayers = plan.moves.iter().filter(|m| !(m.from.is_none() || m.from == removed || Some(m.to) == added)).count();
            prop_assert!(between_stayers <= slack, "{} moves between staying nodes: {:?}", between_stayers, plan.moves);
            if let Some(added) = added {
                if copies_before == copies_after {
                    let onto_others = plan.moves.iter().filter(|m| m.to != added).count();
                    prop_assert!(onto_others <= slack, "an add moves only onto the new node: {:?}", plan.moves);
                }
            }
            let stayer_drops = plan.drops.iter().filter(|d| Some(d.node) != removed).count();
            prop_assert!(stayer_drops == 0 || copies_after < copies_before, "a staying node dropped a copy: {:?}", plan.drops);
            if let Some(removed) = removed {
                if copies_before == copies_after {
                    let held = map.partitions.iter().filter(|c| c.holds(removed)).count();
                    prop_assert!(held <= plan.moves.len() && plan.moves.len() <= held + slack, "a removal of {} copies built {} (forced extra {})", held, plan.moves.len(), slack);
                }
            }
            prop_assert_eq!(next.version, map.version + u64::from(next.partitions != map.partitions));
            map = next;
        }
    }
}

/// How many moves between stayers a removal may need (equal weights): the copies of
/// `removed` that cannot go straight to a staying node (see [`unmatched`]), plus what
/// stayers below their floor (`⌊total / n⌋`) cannot get from it because they already hold
/// its partitions — they must be fed by other stayers (found by the random test: 7
/// partitions, 3 copies, 5 → 4 nodes, a stayer at 4 of a floor of 5 holding all four of the
/// leaving node's partitions).
fn forced_between_stayers(before: &PartitionMap, stayers: &[Node], copies: usize, removed: NodeId) -> usize {
    let lo = before.partitions.len() * copies / stayers.len();
    let parts: Vec<&shoal_cluster::Copies> = before.partitions.iter().filter(|c| c.holds(removed)).collect();
    let starved: usize = stayers
        .iter()
        .map(|n| {
            let (a, r) = before.load(n.id);
            let can_take = parts.iter().filter(|c| !c.holds(n.id)).count();
            lo.saturating_sub(a + r + can_take)
        })
        .sum();
    unmatched(before, stayers, copies, removed) + starved
}

/// How many of `removed`'s copies cannot go straight to a staying node: its partitions less
/// a maximum matching of them to stayers that lack the partition, each stayer taking at most
/// its room (`⌈total / n⌉` less what it holds; equal weights). Kuhn's augmenting paths.
fn unmatched(before: &PartitionMap, stayers: &[Node], copies: usize, removed: NodeId) -> usize {
    let total = before.partitions.len() * copies;
    let hi = total.div_ceil(stayers.len());
    let mut slots: Vec<NodeId> = Vec::new();
    for n in stayers {
        let (a, r) = before.load(n.id);
        slots.extend(std::iter::repeat_n(n.id, hi.saturating_sub(a + r)));
    }
    let parts: Vec<usize> = (0..before.partitions.len()).filter(|p| before.partitions[*p].holds(removed)).collect();
    let fits = |p: usize, slot: usize| !before.partitions[p].holds(slots[slot]);
    let mut owner: Vec<Option<usize>> = vec![None; slots.len()];
    fn try_place(p: usize, seen: &mut [bool], owner: &mut [Option<usize>], fits: &dyn Fn(usize, usize) -> bool) -> bool {
        for slot in 0..owner.len() {
            if seen[slot] || !fits(p, slot) {
                continue;
            }
            seen[slot] = true;
            if owner[slot].is_none_or(|q| try_place(q, seen, owner, fits)) {
                owner[slot] = Some(p);
                return true;
            }
        }
        false
    }
    let matched = parts.iter().filter(|p| try_place(**p, &mut vec![false; slots.len()], &mut owner, &fits)).count();
    parts.len() - matched
}

/// The case the random test found: a removal whose copies the stayers with room already hold.
#[test]
fn a_removal_may_force_a_move_between_stayers_but_no_more() {
    let n = |ids: &[u64]| ids.iter().map(|i| Node { id: NodeId(*i), weight: 1 }).collect::<Vec<_>>();
    let mut map = place(7, &n(&[12, 13, 27, 30]), 2, None).unwrap();
    for set in [
        &[13u64, 27, 30][..],
        &[13, 27, 30, 11],
        &[13, 27, 30, 11, 26],
        &[13, 27, 30, 11, 26, 34],
        &[13, 27, 30, 11, 26, 34, 4],
        &[13, 27, 30, 11, 26, 34, 4, 29],
    ] {
        map = place(7, &n(set), 2, Some(&map)).unwrap();
    }
    let stayers = n(&[13, 27, 30, 11, 26, 34, 29]);
    let next = place(7, &stayers, 2, Some(&map)).unwrap();
    let plan = plan_moves(&map, &next).unwrap();
    let forced = unmatched(&map, &stayers, 3, NodeId(4));
    assert_eq!(forced, 1, "node 4 holds p2 and p3; of the stayers with room, 11 holds both and 29 takes one");
    let between = plan.moves.iter().filter(|m| m.from != Some(NodeId(4))).count();
    assert_eq!(between, forced, "{:?}", plan.moves);
    assert_eq!(plan.moves.len(), 2 + forced);
}

/// The second case the random test found: a stayer below its floor already holds every
/// partition of the leaving node, so another stayer must pass it one.
#[test]
fn a_removal_may_force_a_move_into_a_stayer_below_its_floor() {
    let n = |ids: &[u64]| ids.iter().map(|i| Node { id: NodeId(*i), weight: 1 }).collect::<Vec<_>>();
    let mut map = place(7, &n(&[1]), 2, None).unwrap();
    for set in [&[1u64, 2][..], &[1, 2, 3], &[1, 2, 3, 39], &[1, 2, 3, 39, 17]] {
        map = place(7, &n(set), 2, Some(&map)).unwrap();
    }
    let stayers = n(&[1, 3, 39, 17]);
    let next = place(7, &stayers, 2, Some(&map)).unwrap();
    let plan = plan_moves(&map, &next).unwrap();
    assert_eq!(unmatched(&map, &stayers, 3, NodeId(2)), 0, "every copy of node 2 has a stayer with room that lacks it");
    let forced = forced_between_stayers(&map, &stayers, 3, NodeId(2));
    assert_eq!(forced, 1, "node 3 holds 4 copies, all of node 2's partitions among them, and its floor is 5");
    let between = plan.moves.iter().filter(|m| m.from != Some(NodeId(2))).count();
    assert_eq!(between, forced, "{:?}", plan.moves);
    assert_eq!(plan.moves.len(), 4 + forced);
}
