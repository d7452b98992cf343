//! Property test of the index service's placement: random indexes (partitions, replicas),
//! index nodes added and removed one at a time, equal weights. After every step each unit
//! has `min(replicas + 1, nodes)` copies on distinct index nodes, every node holds its share
//! of all copies rounded down or up, placing again moves nothing, and only necessary copies
//! move (while copies per unit do not change): an added node only receives, and a removed
//! node's copies go to the stayers, at most one more passing between stayers for each where
//! the distinct-node rule forces it.

use std::collections::BTreeMap;

use proptest::prelude::*;
use shoal_cluster::index_placement::{index_moves, place_indexes, IndexPlacement, IndexSpec};
use shoal_cluster::{Node, NodeId};

#[derive(Clone, Debug)]
enum Step {
    Add(u64),
    Remove(usize),
}

fn check(p: &IndexPlacement, specs: &[IndexSpec], nodes: &[Node]) -> Result<(), TestCaseError> {
    let units: usize = specs.iter().map(|s| usize::from(s.partitions)).sum();
    prop_assert_eq!(p.len(), units);
    let mut load: BTreeMap<NodeId, u64> = nodes.iter().map(|n| (n.id, 0)).collect();
    let mut total = 0u64;
    for spec in specs {
        let copies = (usize::from(spec.replicas) + 1).min(nodes.len());
        for partition in 0..spec.partitions {
            let on = p.iter().find(|(k, _)| k.index == spec.index && k.partition == partition).map(|(_, c)| c);
            let on = on.ok_or_else(|| TestCaseError::fail(format!("index {} partition {partition} unplaced", spec.index)))?;
            prop_assert_eq!(on.len(), copies);
            let mut distinct = on.clone();
            distinct.sort();
            distinct.dedup();
            prop_assert_eq!(distinct.len(), on.len(), "copies on distinct nodes");
            for n in on {
                *load.get_mut(n).ok_or_else(|| TestCaseError::fail(format!("{n} is not an index node")))? += 1;
                total += 1;
            }
        }
    }
    // Equal weights, at most one copy per unit per node: the share is total / nodes, unless
    // that exceeds the units (then every node holds every unit).
    let n = nodes.len() as u64;
    let (lo, hi) = (total / n, total.div_ceil(n));
    for (node, l) in &load {
        prop_assert!(lo <= *l && *l <= hi, "{} holds {} copies, range {}..={}", node, l, lo, hi);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn index_placement_invariants(
        shape in prop::collection::vec((1u16..=16, 0u8..=2), 1..12),
        start in prop::collection::btree_set(1u64..30, 1..5),
        steps in prop::collection::vec(prop_oneof![(1u64..30).prop_map(Step::Add), any::<usize>().prop_map(Step::Remove)], 1..6),
    ) {
        let specs: Vec<IndexSpec> =
            shape.iter().enumerate().map(|(i, (partitions, replicas))| IndexSpec { index: i as u64 + 1, partitions: *partitions, replicas: *replicas }).collect();
        let mut nodes: Vec<Node> = start.into_iter().map(|id| Node { id: NodeId(id), weight: 1 }).collect();
        let mut placement = place_indexes(&specs, &nodes, &IndexPlacement::new()).unwrap();
        check(&placement, &specs, &nodes)?;
        for step in steps {
            let before = nodes.clone();
            let (added, removed) = match step {
                Step::Add(id) => {
                    if nodes.iter().any(|n| n.id.0 == id) { continue; }
                    nodes.push(Node { id: NodeId(id), weight: 1 });
                    (Some(NodeId(id)), None)
                }
                Step::Remove(pick) => {
                    if nodes.len() == 1 { continue; }
                    let gone = nodes.remove(pick % nodes.len());
                    (None, Some(gone.id))
                }
            };
            let next = place_indexes(&specs, &nodes, &placement).unwrap();
            check(&next, &specs, &nodes)?;
            let mut reversed = nodes.clone();
            reversed.reverse();
            prop_assert_eq!(&place_indexes(&specs, &reversed, &placement).unwrap(), &next, "the order of the nodes does not matter");
            prop_assert_eq!(&place_indexes(&specs, &nodes, &next).unwrap(), &next, "placing again moves nothing");
            // Only necessary moves, while copies per unit stay the same (no replica count
            // newly allowed or cut by the node count).
            let same_copies = specs.iter().all(|s| (usize::from(s.replicas) + 1).min(before.len()) == (usize::from(s.replicas) + 1).min(nodes.len()));
            if same_copies {
                let (build, drop) = index_moves(&placement, &next);
                if let Some(added) = added {
                    prop_assert!(build.iter().all(|(_, n)| *n == added), "an add builds only on the added node: {:?}", build);
                }
                if let Some(removed) = removed {
                    // The removed node's copies go to the stayers; the distinct-node rule can
                    // force one to pass through a third node (a stayer with room already
                    // holds that unit), so a removal moves at most one more copy per copy
                    // the node held — never more.
                    let held = placement.values().flatten().filter(|n| **n == removed).count();
                    let passed_on = drop.iter().filter(|(_, n)| *n != removed).count();
                    prop_assert!(passed_on <= held, "{} copies moved between staying nodes for {} held: {:?}", passed_on, held, drop);
                    prop_assert_eq!(build.len(), held + passed_on);
                }
            }
            placement = next;
        }
    }
}
