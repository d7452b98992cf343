//! Index placement: which index nodes hold the copies of each index partition — the units of
//! the index service (an index split by hash of its leading key's value into `partitions`,
//! each with `replicas` more copies; Couchbase GSI's partitioned indexes and their replicas).
//! A pure function of the indexes, the index nodes with their weights, and the previous
//! placement, as [`crate::place`] is for data partitions.
//!
//! 1. **Keep what stays.** Every copy stays on its node while the node stays an index node
//!    (a copy is an index partition's files: moving one costs a copy, rebuilding one costs
//!    a scan of every data partition). Copies beyond the count wanted go, the last first.
//! 2. **Fill.** A unit gets `min(replicas + 1, index nodes)` copies on distinct nodes; a
//!    missing copy goes to the node furthest below its share that lacks the unit, ties by a
//!    rendezvous score of the unit and the node (so the choice does not depend on the order
//!    of `nodes` or of the specs).
//! 3. **Balance across all indexes.** Each node's share of all copies is
//!    `total × weight / Σ weight` (capped at one copy per unit, the excess spread by weight,
//!    as for data partitions); a node above its share rounded up gives copies to one below
//!    its share rounded down, then while any node is above its share rounded up, to nodes
//!    below it — each move a unit the receiver lacks. Moves go from the most loaded node to
//!    the least, so adding a node moves copies only onto it, and removing one moves its
//!    copies to the stayers — only necessary moves (seed 000: the moves that were not
//!    needed). Where the distinct-node rule leaves no stayer with room that lacks a unit,
//!    one copy passes between stayers for it, never more than one per copy the removed node
//!    held (`tests/index_placement_invariants.rs`). The copy a move takes is one of the
//!    index the giver holds most of and the receiver least (then by the rendezvous score),
//!    so each index's partitions spread over the nodes too.
//!
//! Scan load is spread by the same balance: every copy of a unit serves scans (the scan
//! picks one by health and load), so copies per node is what each node scans and stores;
//! and since each index is spread as well, so are one index's scans (a scale-out to four
//! nodes gives the new node about a quarter of every index, not all of some and none of
//! others).
//! Units weigh the same; index partitions of one index are about the same size (a hash of
//! the leading key), and indexes differ in size, which a later version may weigh.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::map::NodeId;
use crate::placement::{sorted_members, targets, BadNode, Node};
use crate::{NODES_MAX, NODE_WEIGHT_MAX, REPLICAS_MAX};

/// Most partitions one index is split into (API.md: 1–256).
pub const INDEX_PARTITIONS_MAX: u16 = 256;
/// Partitions an index is split into when its definition does not say.
pub const INDEX_PARTITIONS_DEFAULT: u16 = 8;

/// Seed of the rendezvous hash that breaks ties between equally loaded nodes.
const INDEX_RENDEZVOUS_SEED: u64 = 0x1D3E_7A11_0C5E_5EED;

/// One partition of one index: what an index node holds, copies as files, and drops whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct IndexPart {
    /// The index's id in the metadata log (unique across collections).
    pub index: u64,
    pub partition: u16,
}

/// What an index asks of placement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexSpec {
    pub index: u64,
    /// 1..=[`INDEX_PARTITIONS_MAX`], fixed at creation.
    pub partitions: u16,
    /// 0..=[`REPLICAS_MAX`] copies beyond the first.
    pub replicas: u8,
}

/// Where every index partition's copies are, on distinct nodes, in the order they were
/// placed (the first is the oldest).
pub type IndexPlacement = BTreeMap<IndexPart, Vec<NodeId>>;

/// Why an index placement cannot be computed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum IndexPlaceError {
    #[error("index {index} asks for {partitions} partitions; an index has 1 to {INDEX_PARTITIONS_MAX}")]
    Partitions { index: u64, partitions: u16 },
    #[error("index {index} asks for {replicas} replicas; at most {REPLICAS_MAX}")]
    Replicas { index: u64, replicas: u8 },
    #[error("index {0} is listed twice")]
    DuplicateIndex(u64),
    #[error("no node runs the index service")]
    NoIndexNodes,
    #[error("a placement takes at most {NODES_MAX} nodes, not {0}")]
    NodeCount(usize),
    #[error("node {node} has weight {weight}; weights are 1 to {NODE_WEIGHT_MAX}")]
    Weight { node: NodeId, weight: u32 },
    #[error("node {0} is listed twice")]
    DuplicateNode(NodeId),
}

/// Places every partition of every index in `specs` on the index `nodes` (see the module
/// docs), starting from `previous`; units of indexes not in `specs` (dropped) are left out.
pub fn place_indexes(specs: &[IndexSpec], nodes: &[Node], previous: &IndexPlacement) -> Result<IndexPlacement, IndexPlaceError> {
    if nodes.is_empty() {
        return Err(IndexPlaceError::NoIndexNodes);
    }
    if nodes.len() > NODES_MAX {
        return Err(IndexPlaceError::NodeCount(nodes.len()));
    }
    let members = sorted_members(nodes).map_err(|bad| match bad {
        BadNode::Weight { node, weight } => IndexPlaceError::Weight { node, weight },
        BadNode::Twice(node) => IndexPlaceError::DuplicateNode(node),
    })?;
    let mut seen = BTreeSet::new();
    for spec in specs {
        if spec.partitions == 0 || spec.partitions > INDEX_PARTITIONS_MAX {
            return Err(IndexPlaceError::Partitions { index: spec.index, partitions: spec.partitions });
        }
        if spec.replicas > REPLICAS_MAX {
            return Err(IndexPlaceError::Replicas { index: spec.index, replicas: spec.replicas });
        }
        if !seen.insert(spec.index) {
            return Err(IndexPlaceError::DuplicateIndex(spec.index));
        }
    }
    let slot: BTreeMap<NodeId, usize> = members.iter().enumerate().map(|(i, n)| (n.id, i)).collect();

    // 1. Keep what stays.
    let mut placed: IndexPlacement = BTreeMap::new();
    let mut wanted: BTreeMap<IndexPart, usize> = BTreeMap::new();
    for spec in specs {
        let copies = (usize::from(spec.replicas) + 1).min(members.len());
        for partition in 0..spec.partitions {
            let part = IndexPart { index: spec.index, partition };
            let mut kept: Vec<NodeId> = Vec::with_capacity(copies);
            for n in previous.get(&part).into_iter().flatten() {
                if slot.contains_key(n) && !kept.contains(n) && kept.len() < copies {
                    kept.push(*n);
                }
            }
            placed.insert(part, kept);
            wanted.insert(part, copies);
        }
    }
    let total: usize = wanted.values().sum();
    let weights: Vec<u32> = members.iter().map(|n| n.weight).collect();
    let target = targets(total as u64, placed.len() as u64, &weights);
    let mut load = vec![0usize; members.len()];
    // Copies of each index on each node (by slot): what spreads one index over the nodes.
    let mut of_index: BTreeMap<(u64, usize), usize> = BTreeMap::new();
    for (part, copies) in &placed {
        for n in copies {
            load[slot[n]] += 1;
            *of_index.entry((part.index, slot[n])).or_default() += 1;
        }
    }

    // 2. Fill: each missing copy to the node furthest below its share that lacks the unit.
    for (part, copies) in placed.iter_mut() {
        while copies.len() < wanted[part] {
            let best = (0..members.len()).filter(|&i| !copies.contains(&members[i].id)).max_by(|&a, &b| {
                let room = |i: usize| target[i].share - load[i] as f64;
                room(a).total_cmp(&room(b)).then_with(|| score(part, members[a].id).cmp(&score(part, members[b].id)))
            });
            let Some(i) = best else { break };
            debug_assert!(!copies.contains(&members[i].id));
            copies.push(members[i].id);
            load[i] += 1;
            *of_index.entry((part.index, i)).or_default() += 1;
        }
    }

    // 3. Balance: a node above its range gives to the least filled node below its range (or,
    // failing that, below its share rounded up); a node below its range takes from the most
    // filled node that stays within its own. Each move narrows the distance to the shares,
    // so this ends; the bound only guards against a bug.
    for _ in 0..=total {
        let fill = |load: &[usize], i: usize| load[i] as f64 - target[i].share;
        let by_fill = |load: &[usize], a: usize, b: usize| fill(load, a).total_cmp(&fill(load, b)).then(b.cmp(&a));
        let mut pairs: Vec<(usize, usize)> = Vec::new();
        if let Some(from) = (0..members.len()).filter(|&i| load[i] > target[i].hi).max_by(|&a, &b| by_fill(&load, a, b)) {
            let mut to: Vec<usize> = (0..members.len()).filter(|&i| load[i] < target[i].lo).collect();
            if to.is_empty() {
                to = (0..members.len()).filter(|&i| load[i] < target[i].hi).collect();
            }
            to.sort_by(|&a, &b| by_fill(&load, a, b));
            pairs.extend(to.into_iter().map(|t| (from, t)));
        } else if let Some(to) = (0..members.len()).filter(|&i| load[i] < target[i].lo).min_by(|&a, &b| by_fill(&load, a, b)) {
            let mut from: Vec<usize> = (0..members.len()).filter(|&i| load[i] > target[i].lo).collect();
            from.sort_by(|&a, &b| by_fill(&load, b, a));
            pairs.extend(from.into_iter().map(|f| (f, to)));
        }
        // The first pair with a unit to move: among those the giver holds and the receiver
        // lacks, one of the index the giver holds most of against the receiver, then the
        // unit the receiver prefers most.
        let found = pairs.into_iter().find_map(|(from, to)| {
            let (from_id, to_id) = (members[from].id, members[to].id);
            let count = |index: u64, i: usize| of_index.get(&(index, i)).copied().unwrap_or(0) as i64;
            placed
                .iter()
                .filter(|(_, copies)| copies.contains(&from_id) && !copies.contains(&to_id))
                .max_by_key(|(part, _)| (count(part.index, from) - count(part.index, to), score(part, to_id)))
                .map(|(part, _)| (from, to, *part))
        });
        let Some((from, to, unit)) = found else { break };
        let (from_id, to_id) = (members[from].id, members[to].id);
        if let Some(c) = placed.get_mut(&unit).and_then(|copies| copies.iter_mut().find(|c| **c == from_id)) {
            *c = to_id;
        }
        load[from] -= 1;
        load[to] += 1;
        if let Some(n) = of_index.get_mut(&(unit.index, from)) {
            *n -= 1;
        }
        *of_index.entry((unit.index, to)).or_default() += 1;
    }
    debug_assert!(placed.iter().all(|(part, copies)| copies.len() == wanted[part]));
    debug_assert!(placed.values().all(|copies| copies.iter().collect::<BTreeSet<_>>().len() == copies.len()));
    Ok(placed)
}

/// A node's rendezvous score for a unit: the highest is preferred among equals.
fn score(part: &IndexPart, node: NodeId) -> u64 {
    let mut key = [0u8; 18];
    key[..8].copy_from_slice(&part.index.to_le_bytes());
    key[8..10].copy_from_slice(&part.partition.to_le_bytes());
    key[10..].copy_from_slice(&node.0.to_le_bytes());
    xxh3_64_with_seed(&key, INDEX_RENDEZVOUS_SEED)
}

/// One copy of one index partition on one node.
pub type IndexCopy = (IndexPart, NodeId);

/// The copies to build and drop to go from `from` to `to`: the copies `to` has and `from`
/// lacks (to build, as files from a live copy), and the reverse (to drop once the new ones
/// serve).
pub fn index_moves(from: &IndexPlacement, to: &IndexPlacement) -> (Vec<IndexCopy>, Vec<IndexCopy>) {
    let holds = |p: &IndexPlacement, part: &IndexPart, n: &NodeId| p.get(part).is_some_and(|c| c.contains(n));
    let build = to.iter().flat_map(|(part, copies)| copies.iter().filter(|n| !holds(from, part, n)).map(|n| (*part, *n))).collect();
    let drop = from.iter().flat_map(|(part, copies)| copies.iter().filter(|n| !holds(to, part, n)).map(|n| (*part, *n))).collect();
    (build, drop)
}

/// Where each copy to build (`build`, from [`index_moves`]) is copied from: a copy of the
/// same index partition in `from` on a node in `alive` (up and holding its files), the
/// oldest first; `None` when no copy is alive, and the new copy is rebuilt from the change
/// streams (a lost partition without replicas).
pub fn index_sources(from: &IndexPlacement, build: &[IndexCopy], alive: &BTreeSet<NodeId>) -> Vec<(IndexCopy, Option<NodeId>)> {
    build
        .iter()
        .map(|&(part, to)| {
            let source = from.get(&part).and_then(|copies| copies.iter().find(|n| **n != to && alive.contains(n)).copied());
            ((part, to), source)
        })
        .collect()
}

/// After a failover: the placement on the index `nodes` left, with no copy moved. Copies
/// on nodes no longer listed go; a unit with a copy left keeps it (the replica is promoted:
/// it serves alone until a rebalance places the missing copies again from its files); a
/// unit left with none gets one on the listed node with the fewest copies (ties by the
/// rendezvous score), which rebuilds it from the change streams — there are no files left
/// to copy. Empty when `nodes` is. Pure.
pub fn repair_indexes(previous: &IndexPlacement, nodes: &[NodeId]) -> IndexPlacement {
    let mut load: BTreeMap<NodeId, usize> = nodes.iter().map(|n| (*n, 0)).collect();
    let mut out: IndexPlacement = previous
        .iter()
        .map(|(part, copies)| (*part, copies.iter().copied().filter(|n| load.contains_key(n)).collect::<Vec<NodeId>>()))
        .collect();
    if load.is_empty() {
        return IndexPlacement::new();
    }
    for n in out.values().flatten() {
        if let Some(l) = load.get_mut(n) {
            *l += 1;
        }
    }
    for (part, copies) in out.iter_mut().filter(|(_, c)| c.is_empty()) {
        let best = load.iter().min_by(|a, b| a.1.cmp(b.1).then_with(|| score(part, *b.0).cmp(&score(part, *a.0)))).map(|(n, _)| *n);
        if let Some(n) = best {
            copies.push(n);
            *load.entry(n).or_default() += 1;
        }
    }
    debug_assert!(out.values().all(|c| !c.is_empty()));
    out
}

/// What a node does with its copies of one index when its placement is applied there.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CopiesToReconcile {
    /// Copies held and not placed here: each is dropped after a drain, if the placement
    /// still does not name it then ([`drops_after_drain`]).
    pub drain: Vec<u16>,
    /// Copies placed here and missing (their build was lost): rebuilt from the streams.
    pub rebuild: Vec<u16>,
}

/// A node's copies of one index against its placement: `placed` the partitions the
/// placement names on this node, `held` the ones it holds, `rebalancing` whether a
/// rebalance runs. Outside a rebalance, copies not named drain and named ones missing are
/// rebuilt. During one, nothing: a rebalance adopts its new copies (as files, on their
/// nodes) before it names them in the placement, so a copy not named may be one being
/// adopted, and a named one missing is one it builds (dropping the first meant rebuilding
/// it from the streams once named). The state that ends the rebalance comes to every node
/// and reconciles them then. Pure.
pub fn copies_to_reconcile(placed: &[u16], held: &[u16], rebalancing: bool) -> CopiesToReconcile {
    if rebalancing {
        return CopiesToReconcile::default();
    }
    CopiesToReconcile {
        drain: held.iter().copied().filter(|p| !placed.contains(p)).collect(),
        rebuild: placed.iter().copied().filter(|p| !held.contains(p)).collect(),
    }
}

/// Whether a copy that began to drain is dropped once its drain is over, from the state
/// then: only if no rebalance runs (one begun meanwhile may be adopting it again) and the
/// index still exists as the one that began (`same_index`: same id), placed, and not here.
/// Pure.
pub fn drops_after_drain(rebalancing: bool, same_index: bool, placed_here: bool) -> bool {
    !rebalancing && same_index && !placed_here
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(ids: &[u64]) -> Vec<Node> {
        ids.iter().map(|id| Node { id: NodeId(*id), weight: 1 }).collect()
    }

    fn loads(p: &IndexPlacement) -> BTreeMap<NodeId, usize> {
        let mut out = BTreeMap::new();
        for n in p.values().flatten() {
            *out.entry(*n).or_default() += 1;
        }
        out
    }

    #[test]
    fn copies_not_placed_are_dropped_and_missing_ones_rebuilt_only_outside_a_rebalance() {
        type Parts<'a> = &'a [u16];
        let none: Parts = &[];
        // (placed here, held, rebalancing, drained, rebuilt)
        let table: [(Parts, Parts, bool, Parts, Parts); 8] = [
            (&[0, 1], &[0, 1], false, none, none),
            // A copy moved away: drained then dropped; one placed and lost: rebuilt.
            (&[0], &[0, 1], false, &[1], none),
            (&[0, 1], &[0], false, none, &[1]),
            (&[2], &[0, 1], false, &[0, 1], &[2]),
            (none, none, false, none, none),
            // During a rebalance: copies being adopted before the placement names them are
            // kept, and named ones it is building are not rebuilt from the streams.
            (&[0], &[0, 1], true, none, none),
            (&[0, 1], &[0], true, none, none),
            (&[2], &[0, 1], true, none, none),
        ];
        for (placed, held, rebalancing, drain, rebuild) in table {
            let got = copies_to_reconcile(placed, held, rebalancing);
            assert_eq!(got, CopiesToReconcile { drain: drain.to_vec(), rebuild: rebuild.to_vec() }, "{placed:?} {held:?} {rebalancing}");
        }
        // After the drain: (rebalancing, same index, placed here again, dropped)
        let after = [(false, true, false, true), (true, true, false, false), (false, false, false, false), (false, true, true, false)];
        for (rebalancing, same, placed_here, dropped) in after {
            assert_eq!(drops_after_drain(rebalancing, same, placed_here), dropped, "{rebalancing} {same} {placed_here}");
        }
    }

    #[test]
    fn bad_specs_and_nodes_are_refused() {
        let one = nodes(&[1]);
        let cases = [
            (
                vec![IndexSpec { index: 1, partitions: 0, replicas: 0 }],
                one.clone(),
                IndexPlaceError::Partitions { index: 1, partitions: 0 },
            ),
            (
                vec![IndexSpec { index: 1, partitions: 10_000, replicas: 0 }],
                one.clone(),
                IndexPlaceError::Partitions { index: 1, partitions: 10_000 },
            ),
            (vec![IndexSpec { index: 1, partitions: 8, replicas: 4 }], one.clone(), IndexPlaceError::Replicas { index: 1, replicas: 4 }),
            (
                vec![IndexSpec { index: 1, partitions: 8, replicas: 0 }, IndexSpec { index: 1, partitions: 8, replicas: 0 }],
                one.clone(),
                IndexPlaceError::DuplicateIndex(1),
            ),
            (vec![IndexSpec { index: 1, partitions: 8, replicas: 0 }], Vec::new(), IndexPlaceError::NoIndexNodes),
            (vec![IndexSpec { index: 1, partitions: 8, replicas: 0 }], nodes(&[1, 1]), IndexPlaceError::DuplicateNode(NodeId(1))),
        ];
        for (specs, nodes, want) in cases {
            assert_eq!(place_indexes(&specs, &nodes, &IndexPlacement::new()), Err(want));
        }
    }

    #[test]
    fn a_hundred_indexes_spread_evenly_with_replicas_on_distinct_nodes() {
        let specs: Vec<IndexSpec> = (0..100).map(|i| IndexSpec { index: i, partitions: 8, replicas: 1 }).collect();
        let p = place_indexes(&specs, &nodes(&[1, 2, 3]), &IndexPlacement::new()).expect("placed");
        assert_eq!(p.len(), 800);
        assert!(p.values().all(|c| c.len() == 2 && c[0] != c[1]));
        let l = loads(&p);
        assert!(l.values().all(|n| (533..=534).contains(n)), "{l:?}");
        // One index's partitions are spread too, not stacked on one node.
        let first: BTreeMap<NodeId, usize> = p.iter().filter(|(k, _)| k.index == 0).fold(BTreeMap::new(), |mut m, (_, c)| {
            *m.entry(c[0]).or_default() += 1;
            m
        });
        assert!(first.len() > 1, "{first:?}");
    }

    #[test]
    fn an_added_node_takes_copies_only_from_the_others_and_no_copy_moves_between_them() {
        let specs: Vec<IndexSpec> = (0..100).map(|i| IndexSpec { index: i, partitions: 8, replicas: 1 }).collect();
        let before = place_indexes(&specs, &nodes(&[1, 2, 3]), &IndexPlacement::new()).expect("placed");
        let after = place_indexes(&specs, &nodes(&[1, 2, 3, 4]), &before).expect("placed");
        let (build, drop) = index_moves(&before, &after);
        assert!(build.iter().all(|(_, n)| *n == NodeId(4)), "only the new node builds");
        assert_eq!(build.len(), 400, "its share of 1,600 copies");
        assert_eq!(drop.len(), build.len());
        assert!(loads(&after).values().all(|n| *n == 400));
        assert_eq!(place_indexes(&specs, &nodes(&[1, 2, 3, 4]), &after), Ok(after.clone()), "placing again moves nothing");
        // And back: only the removed node's copies move.
        let back = place_indexes(&specs, &nodes(&[1, 2, 3]), &after).expect("placed");
        let (build, drop) = index_moves(&after, &back);
        assert!(drop.iter().all(|(_, n)| *n == NodeId(4)));
        assert_eq!(build.len(), 400);
    }

    /// Copies of each index on `node`: (fewest, most) over the indexes of `specs`.
    fn spread(p: &IndexPlacement, specs: &[IndexSpec], node: NodeId) -> (usize, usize) {
        let counts: Vec<usize> = specs.iter().map(|s| p.iter().filter(|(k, c)| k.index == s.index && c.contains(&node)).count()).collect();
        (counts.iter().copied().min().unwrap_or(0), counts.iter().copied().max().unwrap_or(0))
    }

    /// Scan load of one index spreads over the nodes, and a scale-out's new node adopts about
    /// its share of every index (before, the balance took whichever copies the rendezvous
    /// score preferred: the fourth node of 100 indexes of 8 partitions held 0 of 7 indexes and
    /// 4 of 9, so those indexes' scans all went to three nodes, or half of them to one).
    #[test]
    fn a_scale_out_gives_the_new_node_its_share_of_every_index() {
        for (replicas, share) in [(0u8, 2usize), (1, 4)] {
            let specs: Vec<IndexSpec> = (0..100).map(|i| IndexSpec { index: i, partitions: 8, replicas }).collect();
            let before = place_indexes(&specs, &nodes(&[1, 2, 3]), &IndexPlacement::new()).expect("placed");
            let after = place_indexes(&specs, &nodes(&[1, 2, 3, 4]), &before).expect("placed");
            assert_eq!(spread(&after, &specs, NodeId(4)), (share, share), "replicas {replicas}");
            for n in 1..=3 {
                let (lo, hi) = spread(&after, &specs, NodeId(n));
                assert!(lo + 1 >= share && hi <= share + 1, "replicas {replicas}, node {n}: {lo}..={hi}");
            }
            let (build, _) = index_moves(&before, &after);
            assert!(build.iter().all(|(_, n)| *n == NodeId(4)), "still only the new node builds");
        }
    }

    #[test]
    fn replicas_beyond_the_index_nodes_wait_for_more_nodes_and_a_dropped_index_leaves() {
        let specs = [IndexSpec { index: 7, partitions: 4, replicas: 3 }];
        let p = place_indexes(&specs, &nodes(&[1, 2]), &IndexPlacement::new()).expect("placed");
        assert!(p.values().all(|c| c.len() == 2), "two nodes: two copies each");
        let more = place_indexes(&specs, &nodes(&[1, 2, 3, 4, 5]), &p).expect("placed");
        assert!(more.values().all(|c| c.len() == 4), "four copies once the nodes allow");
        // 16 copies on 5 nodes: 3 or 4 each. Nodes 1 and 2 keep 4 each, the 8 new copies
        // fill nodes 3-5 to 3, 3, 2, and one copy of 1 or 2 moves so that none holds fewer
        // than 3: the only copy built before that moves.
        let (_, dropped) = index_moves(&p, &more);
        assert_eq!(dropped.len(), 1, "{dropped:?}");
        assert!(place_indexes(&[], &nodes(&[1, 2]), &more).expect("placed").is_empty());
    }

    #[test]
    fn a_copy_comes_from_the_oldest_live_copy_or_is_rebuilt() {
        let part = |partition| IndexPart { index: 1, partition };
        let from: IndexPlacement =
            BTreeMap::from([(part(0), vec![NodeId(1), NodeId(2)]), (part(1), vec![NodeId(3)]), (part(2), vec![NodeId(2), NodeId(1)])]);
        let alive = BTreeSet::from([NodeId(2), NodeId(4)]);
        let build = [(part(0), NodeId(4)), (part(1), NodeId(4)), (part(2), NodeId(4)), (part(3), NodeId(4))];
        let want = vec![
            ((part(0), NodeId(4)), Some(NodeId(2))), // node 1 is down: the next copy
            ((part(1), NodeId(4)), None),            // its only copy is down: rebuilt
            ((part(2), NodeId(4)), Some(NodeId(2))), // the oldest live copy
            ((part(3), NodeId(4)), None),            // never placed: built
        ];
        assert_eq!(index_sources(&from, &build, &alive), want);
    }

    #[test]
    fn heavier_nodes_take_more_and_the_order_of_inputs_does_not_matter() {
        let specs: Vec<IndexSpec> = (0..10).map(|i| IndexSpec { index: i, partitions: 12, replicas: 0 }).collect();
        let mut ns = vec![Node { id: NodeId(1), weight: 1 }, Node { id: NodeId(2), weight: 3 }];
        let p = place_indexes(&specs, &ns, &IndexPlacement::new()).expect("placed");
        assert_eq!(loads(&p), BTreeMap::from([(NodeId(1), 30), (NodeId(2), 90)]));
        ns.reverse();
        let mut reversed = specs.clone();
        reversed.reverse();
        assert_eq!(place_indexes(&reversed, &ns, &IndexPlacement::new()), Ok(p));
    }

    #[test]
    fn a_failover_promotes_a_surviving_copy_and_places_a_lost_unit_on_the_least_loaded_node() {
        let part = |p: u16| IndexPart { index: 7, partition: p };
        let from: IndexPlacement = BTreeMap::from([
            (part(0), vec![NodeId(1), NodeId(2)]), // a replica survives: it alone serves
            (part(1), vec![NodeId(2)]),            // lost: rebuilt on the least loaded node
            (part(2), vec![NodeId(3), NodeId(1)]), // untouched
            (part(3), vec![NodeId(3)]),            // untouched
        ]);
        let got = repair_indexes(&from, &[NodeId(1), NodeId(3)]);
        assert_eq!(got[&part(0)], vec![NodeId(1)]);
        assert_eq!(got[&part(2)], vec![NodeId(3), NodeId(1)]);
        assert_eq!(got[&part(3)], vec![NodeId(3)]);
        // Node 1 holds 2 copies, node 3 holds 2: the tie goes by the rendezvous score.
        let tie = if score(&part(1), NodeId(1)) >= score(&part(1), NodeId(3)) { NodeId(1) } else { NodeId(3) };
        assert_eq!(got[&part(1)], vec![tie]);
        // Nothing that survives moves; several lost units spread over the least loaded.
        let many: IndexPlacement = (0..6).map(|p| (part(p), vec![NodeId(if p < 4 { 9 } else { 1 })])).collect();
        let spread = repair_indexes(&many, &[NodeId(1), NodeId(2)]);
        assert_eq!(spread[&part(4)], vec![NodeId(1)]);
        assert_eq!(spread[&part(5)], vec![NodeId(1)]);
        assert_eq!(loads(&spread), BTreeMap::from([(NodeId(1), 3), (NodeId(2), 3)]));
        assert!(repair_indexes(&from, &[]).is_empty(), "no index node left: nothing placed");
    }
}
