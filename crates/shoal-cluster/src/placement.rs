//! Placement: which nodes hold each partition's copies, as a pure function of the members,
//! their weights, the replica count and the previous map.
//!
//! 1. **Rendezvous order.** Each node scores each partition with weighted rendezvous hashing
//!    (highest random weight: `weight / -ln(u)`, `u` from XXH3 of the partition and node id),
//!    so a partition's preferred nodes hardly change when others come and go. Without a
//!    previous map, a partition starts on its best-scoring `copies` nodes.
//! 2. **Keep what stays.** With a previous map, every copy stays where it is while its node
//!    stays; copies on nodes that leave, and copies the map lacks (more replicas, or more
//!    nodes than before allow more), are what must be placed.
//! 3. **Balance.** Each node's share of all copies (and, separately, of active copies) is
//!    `total × weight / Σ weight` — capped at one copy per partition, the excess spread
//!    over the others by weight — and every node ends within its share rounded down and up
//!    (so within ±1). Copies move one at a time along the cheapest path in a graph of nodes
//!    (an edge `x → y` moves a partition `x` holds and `y` lacks), from nodes above their
//!    share — the leaving nodes first, then the most loaded — to nodes below it, new nodes
//!    first. A move that undoes an existing copy costs far more than a hop, so moves go
//!    straight from a leaving or overloaded node to a new one whenever the distinct-node rule
//!    allows, and never between nodes that stay unless nothing else can balance.
//! 4. **Roles.** The previous active stays active; otherwise an existing replica (already
//!    built and following) is preferred, then the best-scoring node. Actives are balanced
//!    the same way, by swapping roles inside a partition: a promotion moves no data.
//!
//! Copies of a partition are on distinct nodes, so a partition has
//! `min(replicas + 1, nodes)` copies: with fewer nodes than `replicas + 1`, as many replicas
//! as the nodes allow, and the missing ones come when nodes join.
//!
//! Stability is the best the distinct-node rule allows (the table in
//! `tests/placement_moves.rs` and the property test). Adds never move between staying
//! nodes. A removal does only when the leaving node's copies cannot all go straight to
//! stayers with room — e.g. 3 copies of 7 partitions on 8 nodes, where the two stayers
//! below their share already hold both partitions of the leaving node: one copy must pass
//! through a third node (the test checks the count against a maximum matching). With
//! unequal weights the same rule forces a few more: a heavy node that already holds most
//! partitions can only take the ones it lacks, and a node whose share reaches one copy per
//! partition must take every partition.
//!
//! Deterministic: the same inputs give the same map, whatever the order of `nodes`. Scores
//! use `f64::ln`, whose last bit may differ between platforms; the map is computed once, by
//! the metadata leader, and stored in the log, so members never recompute it.

use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::map::{Copies, MapError, NodeId, PartitionId, PartitionMap};
use crate::{NODES_MAX, NODE_WEIGHT_MAX, PARTITIONS_MAX, REPLICAS_MAX};

/// A member that may hold copies, with its relative capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Node {
    pub id: NodeId,
    /// 1..=`NODE_WEIGHT_MAX`; a node of weight 2 gets twice the copies of one of weight 1.
    pub weight: u32,
}

/// Why a placement cannot be computed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PlaceError {
    #[error("partitions must be 1 to {PARTITIONS_MAX}, not {0}")]
    PartitionCount(u16),
    #[error("replicas must be 0 to {REPLICAS_MAX}, not {0}")]
    Replicas(u8),
    #[error("a placement needs 1 to {NODES_MAX} nodes, not {0}")]
    NodeCount(usize),
    #[error("node {node} has weight {weight}; weights are 1 to {NODE_WEIGHT_MAX}")]
    Weight { node: NodeId, weight: u32 },
    #[error("node {0} is listed twice")]
    DuplicateNode(NodeId),
    #[error("the previous map has {previous} partitions, not {partitions}; the partition count never changes")]
    PartitionCountChanged { previous: usize, partitions: u16 },
    #[error("the previous map is not well formed: {0}")]
    PreviousMap(#[from] MapError),
}

/// Seed of the rendezvous hash. Changing it reshuffles every cluster's placement.
const RENDEZVOUS_SEED: u64 = 0x5140_A1C1 ^ 0x9E37_79B9_7F4A_7C15;

/// Cost of one hop on a balancing path that gives up a copy kept from the previous map (or,
/// for actives, a kept active). A plain hop costs 1, so a path never trades a kept copy
/// for fewer hops.
const KEPT_COPY_COST: u64 = 1 << 20;

/// Computes the partition map for `nodes` (see the module docs). `previous`, when given,
/// must have `partitions` partitions; its version + 1 is the new version if anything
/// changed, else its own (placing twice is a no-op). Without one, the version is 1.
pub fn place(partitions: u16, nodes: &[Node], replicas: u8, previous: Option<&PartitionMap>) -> Result<PartitionMap, PlaceError> {
    if partitions == 0 || partitions > PARTITIONS_MAX {
        return Err(PlaceError::PartitionCount(partitions));
    }
    if replicas > REPLICAS_MAX {
        return Err(PlaceError::Replicas(replicas));
    }
    if nodes.is_empty() || nodes.len() > NODES_MAX {
        return Err(PlaceError::NodeCount(nodes.len()));
    }
    let members = sorted_members(nodes).map_err(|bad| match bad {
        BadNode::Weight { node, weight } => PlaceError::Weight { node, weight },
        BadNode::Twice(node) => PlaceError::DuplicateNode(node),
    })?;
    if let Some(previous) = previous {
        previous.check()?;
        if previous.partitions.len() != usize::from(partitions) {
            return Err(PlaceError::PartitionCountChanged { previous: previous.partitions.len(), partitions });
        }
    }

    let mut grid = Grid::new(usize::from(partitions), &members, replicas, previous);
    grid.balance(Level::Copies);
    grid.assign_actives(previous);
    grid.balance(Level::Actives);
    let placed = grid.to_map();
    let version = match previous {
        None => 1,
        Some(previous) if previous.partitions == placed => previous.version,
        Some(previous) => previous.version + 1,
    };
    let map = PartitionMap { version, partitions: placed };
    debug_assert_eq!(map.check(), Ok(()));
    Ok(map)
}

/// Why a list of nodes cannot be placed on, whatever is placed.
pub(crate) enum BadNode {
    Weight { node: NodeId, weight: u32 },
    Twice(NodeId),
}

/// `nodes` in id order, every weight 1..=`NODE_WEIGHT_MAX` and no node twice: the nodes
/// data placement and index placement both take.
pub(crate) fn sorted_members(nodes: &[Node]) -> Result<Vec<Node>, BadNode> {
    let mut members = nodes.to_vec();
    members.sort_unstable_by_key(|n| n.id);
    for (i, node) in members.iter().enumerate() {
        if node.weight == 0 || node.weight > NODE_WEIGHT_MAX {
            return Err(BadNode::Weight { node: node.id, weight: node.weight });
        }
        if i > 0 && members[i - 1].id == node.id {
            return Err(BadNode::Twice(node.id));
        }
    }
    Ok(members)
}

/// A node's weighted rendezvous score for a partition; the highest score is preferred.
fn rendezvous_score(partition: usize, node: NodeId, weight: u32) -> f64 {
    let mut key = [0u8; 10];
    key[..2].copy_from_slice(&(partition as u16).to_le_bytes());
    key[2..].copy_from_slice(&node.0.to_le_bytes());
    let hash = xxh3_64_with_seed(&key, RENDEZVOUS_SEED);
    // u in (0, 1) from the top 53 bits; -ln(u) > 0.
    let unit = ((hash >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    f64::from(weight) / -unit.ln()
}

/// Every node's target range `[lo, hi]` for `total` items of which a node may hold at most
/// `cap` (one per partition), by weight: the share `total × w / Σw`, with shares above `cap`
/// fixed at `cap` and the rest spread again (water filling), rounded down and up. Exact
/// integer arithmetic, so the rounding never depends on floating point.
pub(crate) fn targets(total: u64, cap: u64, weights: &[u32]) -> Vec<Target> {
    debug_assert!(total <= cap * weights.len() as u64);
    let mut capped = vec![false; weights.len()];
    loop {
        let free_weight: u64 = weights.iter().zip(&capped).filter(|(_, c)| !**c).map(|(w, _)| u64::from(*w)).sum();
        let free_total = total - cap * capped.iter().filter(|c| **c).count() as u64;
        let mut changed = false;
        for (i, w) in weights.iter().enumerate() {
            if !capped[i] && free_total * u64::from(*w) > cap * free_weight {
                capped[i] = true;
                changed = true;
            }
        }
        if !changed {
            return weights
                .iter()
                .zip(&capped)
                .map(|(w, c)| {
                    if *c || free_weight == 0 {
                        let cap = usize::try_from(cap).unwrap_or(usize::MAX);
                        return Target { lo: cap, hi: cap, share: cap as f64 };
                    }
                    let numerator = free_total * u64::from(*w);
                    let lo = numerator / free_weight;
                    let hi = lo + u64::from(!numerator.is_multiple_of(free_weight));
                    Target { lo: lo as usize, hi: hi as usize, share: numerator as f64 / free_weight as f64 }
                })
                .collect();
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Target {
    pub(crate) lo: usize,
    pub(crate) hi: usize,
    pub(crate) share: f64,
}

const WORDS: usize = PARTITIONS_MAX as usize / 64;

/// A set of partitions.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
struct Bits([u64; WORDS]);

impl Bits {
    fn set(&mut self, p: usize) {
        self.0[p / 64] |= 1 << (p % 64);
    }
    fn clear(&mut self, p: usize) {
        self.0[p / 64] &= !(1 << (p % 64));
    }
    fn get(&self, p: usize) -> bool {
        self.0[p / 64] & (1 << (p % 64)) != 0
    }
    /// `self & !other`, and `self & !other & (!self_prev | other_prev)` (the cheap part).
    fn zip(a: &Bits, b: &Bits, f: impl Fn(u64, u64, usize) -> u64) -> Bits {
        let mut out = Bits::default();
        for w in 0..WORDS {
            out.0[w] = f(a.0[w], b.0[w], w);
        }
        out
    }
    fn is_empty(&self) -> bool {
        self.0.iter().all(|w| *w == 0)
    }
    fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.0.iter().enumerate().flat_map(|(w, word)| (0..64).filter(move |b| word & (1 << b) != 0).map(move |b| w * 64 + b))
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    /// In `nodes`; `new` when the previous map did not name it.
    Member { new: bool },
    /// In the previous map, not in `nodes`: everything it holds must go.
    Leaving,
    /// The copies no node holds yet (more replicas, more nodes than before allow more).
    Unplaced,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Level {
    Copies,
    Actives,
}

/// The placement being worked on: one row per slot (members in id order, then leaving
/// nodes, then the unplaced slot), as sets of partitions.
struct Grid {
    partitions: usize,
    members: usize,
    ids: Vec<NodeId>,
    kinds: Vec<Kind>,
    copies: Vec<Target>,
    actives: Vec<Target>,
    /// Partitions with a copy in the slot (for `Unplaced`: with at least one copy unplaced).
    held: Vec<Bits>,
    /// Partitions the slot's node held in the previous map.
    kept: Vec<Bits>,
    held_count: Vec<usize>,
    /// Per partition, copies still unplaced.
    unplaced: Vec<u8>,
    /// Per member: partitions it is active for; and was active for in the previous map.
    active: Vec<Bits>,
    was_active: Vec<Bits>,
    active_count: Vec<usize>,
    /// `score[p * members + m]`.
    score: Vec<f64>,
}

impl Grid {
    fn new(partitions: usize, members: &[Node], replicas: u8, previous: Option<&PartitionMap>) -> Grid {
        let copies_per_partition = (usize::from(replicas) + 1).min(members.len());
        let mut ids: Vec<NodeId> = members.iter().map(|n| n.id).collect();
        let mut kinds: Vec<Kind> = members.iter().map(|_| Kind::Member { new: true }).collect();
        if let Some(previous) = previous {
            let before = previous.nodes();
            for (slot, id) in ids.iter().enumerate() {
                kinds[slot] = Kind::Member { new: before.binary_search(id).is_err() };
            }
            let leaving: Vec<NodeId> = before.into_iter().filter(|n| members.binary_search_by_key(n, |m| m.id).is_err()).collect();
            kinds.extend(leaving.iter().map(|_| Kind::Leaving));
            ids.extend(leaving);
        }
        ids.push(NodeId(u64::MAX));
        kinds.push(Kind::Unplaced);

        let weights: Vec<u32> = members.iter().map(|n| n.weight).collect();
        let total = (partitions * copies_per_partition) as u64;
        let mut copies = targets(total, partitions as u64, &weights);
        let mut actives = targets(partitions as u64, partitions as u64, &weights);
        let nothing = Target { lo: 0, hi: 0, share: 0.0 };
        copies.resize(ids.len(), nothing);
        actives.resize(ids.len(), nothing);

        let m = members.len();
        let mut score = Vec::with_capacity(partitions * m);
        for p in 0..partitions {
            score.extend(members.iter().map(|n| rendezvous_score(p, n.id, n.weight)));
        }

        let slots = ids.len();
        let mut grid = Grid {
            partitions,
            members: m,
            ids,
            kinds,
            copies,
            actives,
            held: vec![Bits::default(); slots],
            kept: vec![Bits::default(); slots],
            held_count: vec![0; slots],
            unplaced: vec![0; partitions],
            active: vec![Bits::default(); m],
            was_active: vec![Bits::default(); m],
            active_count: vec![0; m],
            score,
        };
        match previous {
            None => grid.start_from_rendezvous(copies_per_partition),
            Some(previous) => grid.start_from(previous, copies_per_partition),
        }
        grid
    }

    fn slot_of(&self, id: NodeId) -> Option<usize> {
        let unplaced = self.ids.len() - 1;
        self.ids[..unplaced].iter().position(|n| *n == id)
    }

    fn unplaced_slot(&self) -> usize {
        self.ids.len() - 1
    }

    fn score(&self, p: usize, member: usize) -> f64 {
        self.score[p * self.members + member]
    }

    /// Members by descending score for `p`, ties by id.
    fn preference(&self, p: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.members).collect();
        order.sort_by(|a, b| self.score(p, *b).total_cmp(&self.score(p, *a)).then(a.cmp(b)));
        order
    }

    fn add_copy(&mut self, slot: usize, p: usize) {
        debug_assert!(!self.held[slot].get(p));
        self.held[slot].set(p);
        self.held_count[slot] += 1;
    }

    fn remove_copy(&mut self, slot: usize, p: usize) {
        if slot == self.unplaced_slot() {
            self.unplaced[p] -= 1;
            if self.unplaced[p] == 0 {
                self.held[slot].clear(p);
            }
        } else {
            debug_assert!(self.held[slot].get(p));
            self.held[slot].clear(p);
        }
        self.held_count[slot] -= 1;
    }

    fn start_from_rendezvous(&mut self, copies: usize) {
        for p in 0..self.partitions {
            for member in self.preference(p).into_iter().take(copies) {
                self.add_copy(member, p);
            }
        }
    }

    /// Keeps every previous copy on a node that stays; keeps copies on leaving nodes (to be
    /// moved) only as far as the partition lacks copies, the active's first; the rest of
    /// what is missing starts unplaced. Where a partition has more copies than wanted (fewer
    /// replicas), replicas are dropped from the most loaded nodes.
    fn start_from(&mut self, previous: &PartitionMap, copies: usize) {
        for (p, holders) in previous.partitions.iter().enumerate() {
            for node in holders.nodes() {
                if let Some(slot) = self.slot_of(node) {
                    self.kept[slot].set(p);
                    if slot < self.members {
                        self.add_copy(slot, p);
                    }
                }
            }
        }
        let unplaced = self.unplaced_slot();
        for (p, holders) in previous.partitions.iter().enumerate() {
            let mut staying: Vec<usize> = holders.nodes().filter_map(|n| self.slot_of(n)).filter(|s| *s < self.members).collect();
            while staying.len() > copies {
                // Never the active (first); the replica whose node is most above its share.
                let drop = (1..staying.len())
                    .max_by(|a, b| self.load_ratio(staying[*a]).total_cmp(&self.load_ratio(staying[*b])).then(b.cmp(a)))
                    .unwrap_or(staying.len() - 1);
                self.remove_copy(staying[drop], p);
                staying.remove(drop);
            }
            let mut missing = copies - staying.len();
            for node in holders.nodes() {
                let Some(slot) = self.slot_of(node) else { continue };
                if missing > 0 && slot >= self.members {
                    self.add_copy(slot, p);
                    missing -= 1;
                }
            }
            if missing > 0 {
                self.unplaced[p] = missing as u8;
                self.held[unplaced].set(p);
                self.held_count[unplaced] += missing;
            }
        }
    }

    /// How far above its share a slot is; leaving and unplaced slots are infinitely so.
    fn load_ratio(&self, slot: usize) -> f64 {
        match self.kinds[slot] {
            Kind::Member { .. } => self.held_count[slot] as f64 / self.copies[slot].share.max(f64::MIN_POSITIVE),
            Kind::Leaving | Kind::Unplaced => f64::INFINITY,
        }
    }

    fn count(&self, level: Level, slot: usize) -> usize {
        match level {
            Level::Copies => self.held_count[slot],
            Level::Actives => self.active_count[slot],
        }
    }

    fn target(&self, level: Level, slot: usize) -> Target {
        match level {
            Level::Copies => self.copies[slot],
            Level::Actives => self.actives[slot],
        }
    }

    fn slots(&self, level: Level) -> usize {
        match level {
            Level::Copies => self.ids.len(),
            Level::Actives => self.members,
        }
    }

    fn ratio(&self, level: Level, slot: usize) -> f64 {
        match self.kinds[slot] {
            Kind::Member { .. } => self.count(level, slot) as f64 / self.target(level, slot).share.max(f64::MIN_POSITIVE),
            Kind::Leaving | Kind::Unplaced => f64::INFINITY,
        }
    }

    /// The partitions an edge `x → y` may carry: all of them, and the cheap ones (those that
    /// do not give up a kept copy or a kept active).
    fn edge(&self, level: Level, x: usize, y: usize) -> (Bits, Bits) {
        match level {
            Level::Copies => {
                let (hx, hy, kx, ky) = (&self.held[x], &self.held[y], &self.kept[x], &self.kept[y]);
                let all = Bits::zip(hx, hy, |a, b, _| a & !b);
                let cheap = Bits::zip(&all, kx, |a, k, w| a & (!k | ky.0[w]));
                (all, cheap)
            }
            Level::Actives => {
                let (ax, hy, wx, wy) = (&self.active[x], &self.held[y], &self.was_active[x], &self.was_active[y]);
                let all = Bits::zip(ax, hy, |a, b, _| a & b);
                let cheap = Bits::zip(&all, wx, |a, k, w| a & (!k | wy.0[w]));
                (all, cheap)
            }
        }
    }

    fn edge_cost(&self, level: Level, x: usize, y: usize) -> Option<u64> {
        let (all, cheap) = self.edge(level, x, y);
        if !cheap.is_empty() {
            Some(1)
        } else if !all.is_empty() {
            Some(1 + KEPT_COPY_COST)
        } else {
            None
        }
    }

    /// Moves one copy (or active role) from `x` to `y`: a cheap one if there is one, and the
    /// one `y` scores best.
    fn shift(&mut self, level: Level, x: usize, y: usize) {
        let (all, cheap) = self.edge(level, x, y);
        let pool = if cheap.is_empty() { all } else { cheap };
        let best = pool.iter().max_by(|a, b| self.score(*a, y).total_cmp(&self.score(*b, y)).then(b.cmp(a)));
        let Some(p) = best else {
            debug_assert!(false, "shift along an edge with no partition");
            return;
        };
        match level {
            Level::Copies => {
                self.remove_copy(x, p);
                self.add_copy(y, p);
            }
            Level::Actives => {
                self.active[x].clear(p);
                self.active_count[x] -= 1;
                self.active[y].set(p);
                self.active_count[y] += 1;
            }
        }
    }

    /// Moves copies (or roles) until every member is within `[lo, hi]` and the leaving and
    /// unplaced slots are empty. Each round moves one unit along the cheapest path from a
    /// slot above its range to one below, so it ends within the total excess rounds.
    fn balance(&mut self, level: Level) {
        let slots = self.slots(level);
        let rounds_max = self.partitions * slots + 1;
        for _ in 0..rounds_max {
            let over: Vec<usize> = (0..slots).filter(|s| self.count(level, *s) > self.target(level, *s).hi).collect();
            let under = (0..slots).any(|s| self.count(level, s) < self.target(level, s).lo);
            let (sources, sinks): (Vec<usize>, Vec<bool>) = if !over.is_empty() {
                (over, (0..slots).map(|s| s < self.members && self.count(level, s) < self.target(level, s).hi).collect())
            } else if under {
                (
                    (0..slots).filter(|s| self.count(level, *s) > self.target(level, *s).lo).collect(),
                    (0..slots).map(|s| self.count(level, s) < self.target(level, s).lo).collect(),
                )
            } else {
                return;
            };
            if !self.augment(level, sources, &sinks) {
                break;
            }
        }
        if level == Level::Copies {
            self.place_leftovers();
        }
        debug_assert!(
            (0..slots).all(|s| (self.target(level, s).lo..=self.target(level, s).hi).contains(&self.count(level, s))),
            "{level:?} not balanced"
        );
    }

    /// Cheapest path from any source to a sink (multi-source Dijkstra over at most
    /// `NODES_MAX` slots, edges computed as needed); ties go to the most loaded source and
    /// to sinks below their floor, new nodes first. Returns false if no sink is reachable.
    fn augment(&mut self, level: Level, mut sources: Vec<usize>, sinks: &[bool]) -> bool {
        let slots = sinks.len();
        sources.sort_by(|a, b| self.ratio(level, *b).total_cmp(&self.ratio(level, *a)).then(a.cmp(b)));
        let mut rank = vec![usize::MAX; slots];
        let mut dist = vec![u64::MAX; slots];
        let mut from = vec![usize::MAX; slots];
        let mut done = vec![false; slots];
        for (i, s) in sources.iter().enumerate() {
            rank[*s] = i;
            dist[*s] = 0;
        }
        loop {
            let next = (0..slots).filter(|s| !done[*s] && dist[*s] != u64::MAX).min_by_key(|s| (dist[*s], rank[*s], *s));
            let Some(u) = next else { break };
            done[u] = true;
            for v in 0..self.members {
                if done[v] || v == u {
                    continue;
                }
                if let Some(cost) = self.edge_cost(level, u, v) {
                    if dist[u] + cost < dist[v] {
                        dist[v] = dist[u] + cost;
                        from[v] = u;
                    }
                }
            }
        }
        let sink_key = |s: usize| {
            let new = matches!(self.kinds[s], Kind::Member { new: true });
            (dist[s], self.count(level, s) >= self.target(level, s).lo, !new)
        };
        let best = (0..slots)
            .filter(|s| sinks[*s] && dist[*s] != u64::MAX && dist[*s] > 0)
            .min_by(|a, b| sink_key(*a).cmp(&sink_key(*b)).then(self.ratio(level, *a).total_cmp(&self.ratio(level, *b))).then(a.cmp(b)));
        let Some(sink) = best else { return false };
        let mut path = vec![sink];
        while dist[*path.last().unwrap_or(&sink)] != 0 {
            let prev = from[*path.last().unwrap_or(&sink)];
            path.push(prev);
        }
        path.reverse();
        for hop in path.windows(2) {
            self.shift(level, hop[0], hop[1]);
        }
        true
    }

    /// Copies left on leaving or unplaced slots when no balancing path exists (not expected;
    /// the distinct-node rule always leaves a member without the partition): each goes to the
    /// least loaded member without one, so the map stays complete.
    fn place_leftovers(&mut self) {
        for slot in self.members..self.ids.len() {
            let parts: Vec<usize> = self.held[slot].iter().collect();
            for p in parts {
                while self.held[slot].get(p) {
                    let target = (0..self.members)
                        .filter(|m| !self.held[*m].get(p))
                        .min_by(|a, b| self.load_ratio(*a).total_cmp(&self.load_ratio(*b)).then(a.cmp(b)));
                    let Some(target) = target else { break };
                    self.remove_copy(slot, p);
                    self.add_copy(target, p);
                }
            }
        }
    }

    /// The previous active keeps its role where it still holds a copy; otherwise a replica
    /// that existed before (built and following) takes it, else the best-scoring holder.
    fn assign_actives(&mut self, previous: Option<&PartitionMap>) {
        for p in 0..self.partitions {
            let before = previous.map(|m| &m.partitions[p]);
            if let Some(before) = before {
                if let Some(slot) = self.slot_of(before.active).filter(|s| *s < self.members) {
                    self.was_active[slot].set(p);
                }
            }
            let holders: Vec<usize> = (0..self.members).filter(|m| self.held[*m].get(p)).collect();
            let kept_active = before.and_then(|b| holders.iter().copied().find(|m| self.ids[*m] == b.active));
            let best = |among: &mut dyn Iterator<Item = usize>| {
                among.max_by(|a, b| self.score(p, *a).total_cmp(&self.score(p, *b)).then(b.cmp(a)))
            };
            let active = kept_active
                .or_else(|| best(&mut holders.iter().copied().filter(|m| self.kept[*m].get(p))))
                .or_else(|| best(&mut holders.iter().copied()));
            let Some(active) = active else {
                debug_assert!(false, "partition {p} has no copy");
                continue;
            };
            self.active[active].set(p);
            self.active_count[active] += 1;
        }
    }

    fn to_map(&self) -> Vec<Copies> {
        (0..self.partitions)
            .map(|p| {
                let active = (0..self.members).find(|m| self.active[*m].get(p)).unwrap_or(0);
                let mut replicas: Vec<usize> = (0..self.members).filter(|m| *m != active && self.held[*m].get(p)).collect();
                replicas.sort_by(|a, b| self.score(p, *b).total_cmp(&self.score(p, *a)).then(a.cmp(b)));
                Copies { active: self.ids[active], replicas: replicas.into_iter().map(|m| self.ids[m]).collect::<Vec<_>>() }
            })
            .collect()
    }
}

// `PartitionId` is what callers index by; the grid works in `usize`.
const _: () = assert!(PARTITIONS_MAX as usize <= PartitionId::MAX as usize + 1);
const _: () = assert!((PARTITIONS_MAX as usize).is_multiple_of(64));
