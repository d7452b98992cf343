//! A deterministic simulation of a rebalance's index stage, to check that index scans stay
//! exact while index partitions move: no I/O, no threads, no clock — every run is a
//! function of its seed and can be replayed.
//!
//! What is modelled (`shoal-node`'s `index_moves.rs`, `apply.rs` and `rebalance.rs`, and
//! `shoal-index`'s reads, deciding with the functions they call):
//! - [`DATA_LOGS`] data partitions, each a log of writes; every write is an entry of one of
//!   the index's partitions (the hash of its leading key). A copy of an index partition
//!   holds the entries of a prefix of each log ([`Copy::at`]): it follows every log, one
//!   entry at a time, at its own pace (the index service following the actives' streams).
//! - 3 or 4 index nodes, and one index of 2 to 4 partitions and 0 or 1 replica, placed by
//!   [`place_indexes`]. The metadata leader is an oracle: its log is a list of committed
//!   events (a placement, a rebalance's start and end, other state changes such as a data
//!   wave's map) that every node applies in order at its own pace. A node applying a state
//!   reconciles its copies with [`copies_to_reconcile`]: a copy not named drains, and once
//!   its drain is over is dropped if [`drops_after_drain`] says so then; a copy named and
//!   missing is rebuilt from the logs (counted: a rebalance must never cause one).
//! - Rebalances: a node joins or leaves (never above 4 members; below 3 only after a
//!   failover), the leader plans the target with [`place_indexes`], the copies to build with
//!   [`index_moves`] and their sources with [`index_sources`], commits the start, and asks
//!   each new copy's node to adopt it — once the node applied the log as far as the leader
//!   had when it asked: a snapshot of the source's copy (its entries and positions), then
//!   caught up with the logs' ends at the time of the ask; a copy dropped meanwhile fails
//!   the adoption. Once every adoption ended the index stage commits its target (checked:
//!   over the placement its plan started from, naming no failed node). The data stage runs
//!   beside it (a countdown; it may stop when asked, or fail), and the leader ends the
//!   rebalance as [`stages_next`] says. An operator asks for stops now and then.
//! - Failovers: a member dies (its copies are gone; it may come back later, empty, as a new
//!   node) and the leader commits the placement [`repair_indexes`] makes without it; a
//!   rebalance under way sees its data stage fail and the adoptions to or from the node fail.
//! - Scans at `request_plus`: a client asks some node, which routes each index partition
//!   to one of its copies by the placement it has applied (pinned for the scan; possibly
//!   stale); the logs' ends at the start are what every partition must reach. A copy's node
//!   answers once the copy reached them, refuses (`Unavailable`, retryable) once it does
//!   not hold the copy — checked each time it looks, as `IndexManager::ready` does — and
//!   gives up after a timeout. An answer must hold, from every partition, every entry
//!   written before the scan began.
//! - Checked besides: no committed placement names a failed node; no copy is rebuilt and
//!   no adoption fails by a drop before the run's first failover; at the end, every state
//!   applied and every drain over, each node holds exactly the copies placed on it.
//! - [`IndexProtocol::SAFE`] runs every rule; the other protocols each drop one, to show
//!   what it prevents: the read's check that the copy is still held (a scan waiting on a
//!   copy dropped meanwhile answered without its entries, found in `4ac584b`); the rule
//!   that keeps copies not named while a rebalance runs (a state change during the index
//!   stage dropped copies being adopted, which were then rebuilt; `6929352`); and two this
//!   simulation found: the adoption's wait for the log, and the commit's checks.
//!
//! - Leader changes: the new leader takes up the rebalance; its index stage, unless it
//!   committed already, plans again over the placement and asks every adoption again (a
//!   copy held already is not copied again).
//!
//! What is simplified: no lost or reordered message and no recovery of a failed node within
//! a rebalance (the data stage's and the metadata's own simulations, [`crate::sim`], cover
//! the protocol's messages); an old leader's adoptions still under way when a new one takes
//! over are not modelled (they end when their node answers, as the new ones do); an index's definition is on every
//! node from the start; a scan's partition requests are answered one at a time, at random.

use std::collections::{BTreeMap, BTreeSet};

use crate::index_placement::{
    copies_to_reconcile, drops_after_drain, index_moves, index_sources, place_indexes, repair_indexes, IndexPart, IndexPlacement, IndexSpec,
};
use crate::map::NodeId;
use crate::placement::Node;
use crate::rebalance::{stages_next, StageEnd, Stages};
use crate::sim::SplitMix64;

/// Data partitions (logs) every index partition follows.
pub const DATA_LOGS: usize = 2;
/// Steps a copy no longer named waits before it is dropped (production's `INDEX_DRAIN_WAIT`).
const DRAIN_STEPS: u64 = 30;
/// Steps a scan waits for its copies before it gives up (its timeout).
const SCAN_TIMEOUT_STEPS: u64 = 400;
/// The index's id.
const INDEX: u64 = 7;
/// Node ids 1..=NODES_MAX may exist; 3 or 4 are index nodes at any time.
const NODES_MAX: u64 = 5;

/// Which rules a run follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexProtocol {
    /// A scan waiting on a copy checks, each time it looks, that its node still holds it,
    /// and refuses once it does not (`IndexManager::ready`, `part_keyspaces`). Without it a
    /// copy dropped meanwhile counts as caught up and is read as empty.
    pub wait_checks_held: bool,
    /// A node keeps the copies the placement does not name while a rebalance runs
    /// ([`copies_to_reconcile`]'s `rebalancing`): one may be a copy being adopted.
    pub keep_unnamed_while_rebalancing: bool,
    /// A node asked to adopt a copy first applies the metadata log as far as the leader had
    /// when it asked (the rebalance's start included), so that every state it reconciles
    /// its copies with afterwards keeps the copy until the rebalance ends. Without it a node
    /// lagging in the log reconciles an older state after it adopted (the end of the
    /// rebalance before, say), drains the copy and drops it: the adoption fails, or the
    /// copy is rebuilt once named.
    pub adopt_after_begin: bool,
    /// The index stage's commit of its target is refused when the placement is no longer
    /// the one its plan started from (`SetIndexPlacements`' `from`: a failover meanwhile
    /// took the failed node's copies out of it, and the target, planned before, names them
    /// again) or when it names a failed node (one that adopted its copies, then failed over
    /// before the commit: the placement it started from did not name it).
    pub commit_checked: bool,
}

impl IndexProtocol {
    pub const SAFE: IndexProtocol =
        IndexProtocol { wait_checks_held: true, keep_unnamed_while_rebalancing: true, adopt_after_begin: true, commit_checked: true };
}

#[derive(Clone, Copy, Debug)]
pub struct IndexSimConfig {
    pub steps: u64,
    pub protocol: IndexProtocol,
    /// Prints what each step did (to replay a seed).
    pub trace: bool,
}

/// What a run did, to show the checks had something to check.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexRunStats {
    pub writes: u64,
    pub scans_answered: u64,
    /// Scans refused (`Unavailable`: a copy not held where the scan's placement said).
    pub scans_refused: u64,
    /// Scans given up at their timeout.
    pub scans_timed_out: u64,
    pub rebalances_done: u64,
    pub rebalances_stopped: u64,
    pub rebalances_failed: u64,
    /// Copies adopted from a live copy's snapshot.
    pub adopted: u64,
    /// Adoptions that failed (their copy dropped while it caught up).
    pub adoptions_failed: u64,
    /// Copies dropped after their drain.
    pub dropped: u64,
    /// Copies a node found placed on it and missing, and rebuilt from the logs, before any
    /// failover in the run (a rebalance's doing: never, safely).
    pub rebuilt: u64,
    pub failovers: u64,
    /// Leader changes while an index stage ran (it planned again and asked again).
    pub leader_changes: u64,
    /// Copies rebuilt once a failover happened (a failover's repair places a copy of a
    /// partition left with none, rebuilt from the logs: there are no files left).
    pub rebuilt_after_failover: u64,
}

impl std::ops::AddAssign for IndexRunStats {
    fn add_assign(&mut self, o: IndexRunStats) {
        self.writes += o.writes;
        self.scans_answered += o.scans_answered;
        self.scans_refused += o.scans_refused;
        self.scans_timed_out += o.scans_timed_out;
        self.rebalances_done += o.rebalances_done;
        self.rebalances_stopped += o.rebalances_stopped;
        self.rebalances_failed += o.rebalances_failed;
        self.adopted += o.adopted;
        self.adoptions_failed += o.adoptions_failed;
        self.dropped += o.dropped;
        self.rebuilt += o.rebuilt;
        self.failovers += o.failovers;
        self.leader_changes += o.leader_changes;
        self.rebuilt_after_failover += o.rebuilt_after_failover;
    }
}

/// A broken rule, with where it showed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IndexViolation {
    /// A scan answered without entries of `part` written before it began.
    ShortScan { seed: u64, step: u64, part: u16, node: NodeId, answered_at: [usize; DATA_LOGS], started_at: [usize; DATA_LOGS] },
    /// The leader committed a placement naming a node that is not a member (failed over).
    PlacedOnFailed { seed: u64, step: u64, node: NodeId },
    /// At the end, with every state applied and every drain over, a node does not hold
    /// exactly the copies the placement names on it.
    NotAsPlaced { seed: u64, node: NodeId, placed: Vec<u16>, held: Vec<u16> },
}

/// A copy of an index partition on a node.
#[derive(Clone, Debug)]
struct Copy {
    /// How far into each log it holds the entries.
    at: [usize; DATA_LOGS],
}

/// What the metadata leader commits.
#[derive(Clone, Debug)]
enum Event {
    Placement(IndexPlacement),
    RebalanceBegin,
    RebalanceEnd,
    /// Any other state change (a data wave's map, a DDL): nodes reconcile their copies.
    Other,
}

/// A node's view and holdings.
#[derive(Debug, Default)]
struct NodeState {
    /// Events of the leader's log applied.
    applied: usize,
    placement: IndexPlacement,
    rebalancing: bool,
    held: BTreeMap<u16, Copy>,
    /// Copies draining: (partition, step their drain ends).
    draining: Vec<(u16, u64)>,
    member: bool,
}

impl NodeState {
    fn placed_here(&self, id: NodeId) -> Vec<u16> {
        self.placement.iter().filter(|(_, c)| c.contains(&id)).map(|(p, _)| p.partition).collect()
    }
}

/// An adoption asked of a node.
#[derive(Clone, Debug)]
struct Adoption {
    part: u16,
    to: NodeId,
    source: Option<NodeId>,
    /// How far the leader's log was when it asked.
    asked_at: usize,
    /// The logs' ends when the copy was taken: caught up once it holds them.
    until: Option<[usize; DATA_LOGS]>,
    end: Option<bool>,
}

#[derive(Debug)]
struct Rebalance {
    /// The placement the plan started from.
    from: IndexPlacement,
    target: IndexPlacement,
    /// The index nodes the target was planned on.
    members: Vec<NodeId>,
    /// How the index stage ended (it commits its target at its end, beside the data stage).
    index: Option<StageEnd>,
    adoptions: Vec<Adoption>,
    data: StageEnd,
    /// Steps until the data stage has moved everything.
    data_left: u64,
    stop_asked: bool,
    /// The node leaving, a member until the rebalance is done.
    leaving: Option<NodeId>,
}

/// One partition's request of a scan.
#[derive(Clone, Debug)]
struct PartRead {
    part: u16,
    node: NodeId,
    answer: Option<[usize; DATA_LOGS]>,
}

#[derive(Debug)]
struct Scan {
    started: u64,
    highs: [usize; DATA_LOGS],
    reads: Vec<PartRead>,
}

struct World {
    seed: u64,
    protocol: IndexProtocol,
    rng: SplitMix64,
    step: u64,
    /// Each log's entries: the index partition each write's entry is in.
    logs: [Vec<u16>; DATA_LOGS],
    partitions: u16,
    spec: IndexSpec,
    events: Vec<Event>,
    /// The leader's committed placement.
    placement: IndexPlacement,
    nodes: BTreeMap<NodeId, NodeState>,
    rebalance: Option<Rebalance>,
    scans: Vec<Scan>,
    stats: IndexRunStats,
    trace: bool,
}

/// Runs one seeded simulation; answers its stats, or the first broken rule.
pub fn run_index(seed: u64, config: &IndexSimConfig) -> Result<IndexRunStats, IndexViolation> {
    let mut rng = SplitMix64(seed ^ 0x1D5E_7A11);
    let partitions = 2 + rng.below(3) as u16;
    let replicas = rng.below(2) as u8;
    let first = 3 + rng.below(2);
    let spec = IndexSpec { index: INDEX, partitions, replicas };
    let members: Vec<NodeId> = (1..=first).map(NodeId).collect();
    let placement = place_indexes(&[spec], &as_nodes(&members), &IndexPlacement::new()).unwrap_or_default();
    let mut nodes = BTreeMap::new();
    for id in 1..=NODES_MAX {
        let id = NodeId(id);
        let mut n = NodeState { member: members.contains(&id), placement: placement.clone(), applied: 1, ..NodeState::default() };
        for p in n.placed_here(id) {
            n.held.insert(p, Copy { at: [0; DATA_LOGS] });
        }
        nodes.insert(id, n);
    }
    let mut w = World {
        seed,
        protocol: config.protocol,
        rng,
        step: 0,
        logs: Default::default(),
        partitions,
        spec,
        events: vec![Event::Placement(placement.clone())],
        placement,
        nodes,
        rebalance: None,
        scans: Vec::new(),
        stats: IndexRunStats::default(),
        trace: config.trace,
    };
    while w.step < config.steps {
        w.step += 1;
        w.turn()?;
    }
    w.quiesce()?;
    Ok(w.stats)
}

fn as_nodes(ids: &[NodeId]) -> Vec<Node> {
    ids.iter().map(|id| Node { id: *id, weight: 1 }).collect()
}

impl World {
    fn note(&self, what: std::fmt::Arguments<'_>) {
        if self.trace {
            println!("{:>5} {what}", self.step);
        }
    }

    fn members(&self) -> Vec<NodeId> {
        self.nodes.iter().filter(|(_, n)| n.member).map(|(id, _)| *id).collect()
    }

    fn pick<T: Clone>(&mut self, items: &[T]) -> Option<T> {
        (!items.is_empty()).then(|| items[self.rng.below(items.len() as u64) as usize].clone())
    }

    fn turn(&mut self) -> Result<(), IndexViolation> {
        match self.rng.below(100) {
            0..=19 => self.write(),
            20..=44 => self.follow(),
            45..=59 => self.apply_one(),
            60..=64 => self.drains(),
            65..=79 => self.adopt_one(),
            80..=85 => self.lead()?,
            86..=89 => self.start_scan(),
            _ => self.scan_one()?,
        }
        Ok(())
    }

    fn write(&mut self) {
        let log = self.rng.below(DATA_LOGS as u64) as usize;
        let part = self.rng.below(u64::from(self.partitions)) as u16;
        self.logs[log].push(part);
        self.stats.writes += 1;
    }

    /// A copy somewhere applies the next entry of one log.
    fn follow(&mut self) {
        let copies: Vec<(NodeId, u16)> = self.nodes.iter().flat_map(|(id, n)| n.held.keys().map(move |p| (*id, *p))).collect();
        let Some((id, p)) = self.pick(&copies) else { return };
        let log = self.rng.below(DATA_LOGS as u64) as usize;
        let end = self.logs[log].len();
        if let Some(c) = self.nodes.get_mut(&id).and_then(|n| n.held.get_mut(&p)) {
            // Part of what is left, at times all of it.
            let gap = end.saturating_sub(c.at[log]) as u64;
            c.at[log] = (c.at[log] + 1 + self.rng.below(gap.max(1)) as usize).min(end);
        }
    }

    /// A node applies the next event of the leader's log.
    fn apply_one(&mut self) {
        let ids: Vec<NodeId> = self.nodes.iter().filter(|(_, n)| n.applied < self.events.len()).map(|(id, _)| *id).collect();
        if let Some(id) = self.pick(&ids) {
            self.apply_next(id);
        }
    }

    fn apply_next(&mut self, id: NodeId) {
        let step = self.step;
        let Some(n) = self.nodes.get_mut(&id) else { return };
        let Some(event) = self.events.get(n.applied).cloned() else { return };
        n.applied += 1;
        match &event {
            Event::Placement(p) => n.placement = p.clone(),
            Event::RebalanceBegin => n.rebalancing = true,
            Event::RebalanceEnd => n.rebalancing = false,
            Event::Other => {}
        }
        // Every applied state reconciles the node's copies (`apply.rs`'s `hold_placed`).
        let placed = n.placed_here(id);
        let held: Vec<u16> = n.held.keys().copied().collect();
        let rebalancing = n.rebalancing && self.protocol.keep_unnamed_while_rebalancing;
        let todo = copies_to_reconcile(&placed, &held, rebalancing);
        for p in &todo.drain {
            if !n.draining.iter().any(|(q, _)| q == p) {
                n.draining.push((*p, step + DRAIN_STEPS));
            }
        }
        for p in &todo.rebuild {
            n.held.insert(*p, Copy { at: [0; DATA_LOGS] });
        }
        self.count_rebuilt(todo.rebuild.len() as u64);
        if self.trace {
            let what = match &event {
                Event::Placement(p) => format!(
                    "placement {:?}",
                    p.iter().map(|(k, c)| (k.partition, c.iter().map(|n| n.0).collect::<Vec<_>>())).collect::<Vec<_>>()
                ),
                other => format!("{other:?}"),
            };
            self.note(format_args!("node {} applies {what}: drains {:?}, rebuilds {:?}", id.0, todo.drain, todo.rebuild));
        }
    }

    /// Drains that are over: each copy dropped if the state then says so.
    fn drains(&mut self) {
        let step = self.step;
        let mut notes = Vec::new();
        for (id, n) in self.nodes.iter_mut() {
            let placed = n.placed_here(*id);
            let rebalancing = n.rebalancing && self.protocol.keep_unnamed_while_rebalancing;
            let (due, left): (Vec<_>, Vec<_>) = n.draining.iter().partition(|(_, at)| *at <= step);
            n.draining = left;
            for (p, _) in due {
                if drops_after_drain(rebalancing, true, placed.contains(&p)) && n.held.remove(&p).is_some() {
                    self.stats.dropped += 1;
                    notes.push(format!("node {} drops {p}", id.0));
                }
            }
        }
        for n in notes {
            self.note(format_args!("{n}"));
        }
    }

    /// One adoption under way takes a step: its snapshot, or a look at whether it caught up.
    fn adopt_one(&mut self) {
        let Some(r) = self.rebalance.as_ref() else { return };
        let open: Vec<usize> = (0..r.adoptions.len()).filter(|i| r.adoptions[*i].end.is_none()).collect();
        let Some(i) = self.pick(&open) else { return };
        let Some(a) = self.rebalance.as_ref().map(|r| r.adoptions[i].clone()) else { return };
        let ends = self.ends();
        let outcome = match a.until {
            // Not applied the log as far as the leader had when it asked: the adoption waits.
            None if self.protocol.adopt_after_begin && self.nodes.get(&a.to).is_none_or(|n| n.applied < a.asked_at) => return,
            None => {
                let source = a.source.and_then(|s| self.nodes.get(&s)).and_then(|n| n.held.get(&a.part)).cloned();
                let Some(to) = self.nodes.get_mut(&a.to) else { return };
                // Held already (a resumed or repeated rebalance): nothing to copy.
                if let std::collections::btree_map::Entry::Vacant(held) = to.held.entry(a.part) {
                    match source {
                        Some(copy) => {
                            held.insert(copy);
                            self.stats.adopted += 1;
                        }
                        // The source no longer holds it: built from the logs instead.
                        None => {
                            held.insert(Copy { at: [0; DATA_LOGS] });
                            self.count_rebuilt(1);
                        }
                    }
                }
                if let Some(r) = self.rebalance.as_mut() {
                    r.adoptions[i].until = Some(ends);
                }
                self.note(format_args!("node {} adopts {} from {:?}", a.to.0, a.part, a.source.map(|n| n.0)));
                return;
            }
            Some(until) => match self.nodes.get(&a.to).and_then(|n| n.held.get(&a.part)) {
                // Dropped while it caught up: the adoption fails (`adopt_wait_outcome`).
                None => Some(false),
                Some(c) if (0..DATA_LOGS).all(|l| c.at[l] >= until[l]) => Some(true),
                Some(_) => None,
            },
        };
        if let Some(ok) = outcome {
            self.note(format_args!("node {}'s adoption of {} ends ok: {ok}", a.to.0, a.part));
        }
        if let (Some(ok), Some(r)) = (outcome, self.rebalance.as_mut()) {
            r.adoptions[i].end = Some(ok);
            if !ok {
                self.stats.adoptions_failed += 1;
            }
        }
    }

    fn ends(&self) -> [usize; DATA_LOGS] {
        let mut ends = [0; DATA_LOGS];
        for (e, log) in ends.iter_mut().zip(&self.logs) {
            *e = log.len();
        }
        ends
    }

    /// The leader: starts a rebalance, or drives the one under way through `stages_next`,
    /// or commits some other state change, or asks for a stop.
    fn lead(&mut self) -> Result<(), IndexViolation> {
        if self.rng.percent(15) {
            self.note(format_args!("other state change"));
            self.events.push(Event::Other);
            return Ok(());
        }
        if self.rng.percent(2) {
            self.fail_one();
            return Ok(());
        }
        if self.rng.percent(3) {
            self.change_leader();
            return Ok(());
        }
        let Some(r) = self.rebalance.as_mut() else {
            self.start_rebalance();
            return Ok(());
        };
        if self.rng.percent(3) {
            r.stop_asked = true;
        }
        if r.data == StageEnd::Running {
            r.data_left = r.data_left.saturating_sub(1);
            if r.stop_asked {
                r.data = StageEnd::Stopped;
            } else if r.data_left == 0 {
                r.data = if self.rng.percent(5) { StageEnd::Failed } else { StageEnd::Moved };
            }
        }
        // The index stage, once every adoption ended: its target committed (production's
        // `move_indexes`), over the placement it started from.
        if r.index.is_none() && r.adoptions.iter().all(|a| a.end.is_some()) {
            if r.adoptions.iter().any(|a| a.end == Some(false)) {
                r.index = Some(StageEnd::Failed);
            } else if self.protocol.commit_checked
                && (self.placement != r.from || r.target.values().flatten().any(|n| !self.nodes.get(n).is_some_and(|n| n.member)))
            {
                r.index = Some(StageEnd::Failed);
                self.note(format_args!("the index stage's commit is refused: the placement changed or names a failed node"));
            } else {
                let target = r.target.clone();
                r.index = Some(StageEnd::Moved);
                if let Some(node) = target.values().flatten().find(|n| !self.nodes.get(n).is_some_and(|n| n.member)) {
                    return Err(IndexViolation::PlacedOnFailed { seed: self.seed, step: self.step, node: *node });
                }
                self.note(format_args!("the index stage commits its target"));
                self.placement = target.clone();
                self.events.push(Event::Placement(target));
            }
        }
        let Some(r) = self.rebalance.as_mut() else { return Ok(()) };
        match stages_next(r.data, r.index.unwrap_or(StageEnd::Running), r.stop_asked) {
            Stages::WaitData | Stages::WaitIndex => {}
            Stages::Finish => {
                if let Some(n) = r.leaving.and_then(|l| self.nodes.get_mut(&l)) {
                    n.member = false;
                }
                self.end_rebalance();
                self.stats.rebalances_done += 1;
            }
            Stages::EndStopped => {
                self.end_rebalance();
                self.stats.rebalances_stopped += 1;
            }
            Stages::EndAsData => {
                let stopped = r.data == StageEnd::Stopped;
                self.end_rebalance();
                if stopped {
                    self.stats.rebalances_stopped += 1;
                } else {
                    self.stats.rebalances_failed += 1;
                }
            }
            Stages::FailAsIndex => {
                self.end_rebalance();
                self.stats.rebalances_failed += 1;
            }
        }
        Ok(())
    }

    fn count_rebuilt(&mut self, copies: u64) {
        if self.stats.failovers == 0 {
            self.stats.rebuilt += copies;
        } else {
            self.stats.rebuilt_after_failover += copies;
        }
    }

    /// A member dies and is failed over: its copies are gone (it may come back later,
    /// empty, as a new node); the placement loses them ([`repair_indexes`]); a rebalance
    /// under way sees its data stage fail (the map changed under it) and the adoptions to
    /// or from the node fail.
    fn fail_one(&mut self) {
        let members = self.members();
        if members.len() < 3 {
            return;
        }
        let Some(dead) = self.pick(&members) else { return };
        if let Some(n) = self.nodes.get_mut(&dead) {
            n.held.clear();
            n.draining.clear();
            n.member = false;
        }
        self.stats.failovers += 1;
        let left: Vec<NodeId> = members.into_iter().filter(|m| *m != dead).collect();
        let repaired = repair_indexes(&self.placement, &left);
        self.note(format_args!("node {} fails over", dead.0));
        self.placement = repaired.clone();
        self.events.push(Event::Placement(repaired));
        if let Some(r) = self.rebalance.as_mut() {
            if r.data == StageEnd::Running {
                r.data = StageEnd::Failed;
            }
            for a in r.adoptions.iter_mut().filter(|a| a.end.is_none()) {
                if a.to == dead || (a.source == Some(dead) && a.until.is_none()) {
                    a.end = Some(false);
                }
            }
            if r.leaving == Some(dead) {
                r.leaving = None;
            }
        }
    }

    fn end_rebalance(&mut self) {
        self.note(format_args!("rebalance ends"));
        self.rebalance = None;
        self.events.push(Event::RebalanceEnd);
    }

    /// A node joins, or one leaves; the leader plans and starts the rebalance.
    fn start_rebalance(&mut self) {
        let mut members = self.members();
        let outside: Vec<NodeId> = self.nodes.iter().filter(|(_, n)| !n.member).map(|(id, _)| *id).collect();
        let joins = members.len() < 3 || (members.len() < 4 && self.rng.percent(50));
        let changed = if joins { self.pick(&outside) } else { self.pick(&members) };
        let Some(changed) = changed else { return };
        if joins {
            members.push(changed);
        } else {
            members.retain(|m| *m != changed);
        }
        members.sort();
        let Some((target, adoptions)) = self.plan_index_stage(&members, self.events.len() + 1) else { return };
        if let (true, Some(n)) = (joins, self.nodes.get_mut(&changed)) {
            n.member = true;
        }
        let data_left = 1 + self.rng.below(20);
        let leaving = (!joins).then_some(changed);
        let from = self.placement.clone();
        self.rebalance = Some(Rebalance {
            from,
            target,
            members,
            index: None,
            adoptions,
            data: StageEnd::Running,
            data_left,
            stop_asked: false,
            leaving,
        });
        self.events.push(Event::RebalanceBegin);
        self.note(format_args!("rebalance begins, {} {}", if joins { "joining" } else { "leaving" }, changed.0));
    }

    /// The index stage's plan over the placement now (production's `plan_index_moves`): the
    /// target on `members`, the copies to build and their sources among the live members;
    /// each adoption asked once the log is `asked_at` long.
    fn plan_index_stage(&self, members: &[NodeId], asked_at: usize) -> Option<(IndexPlacement, Vec<Adoption>)> {
        let target = place_indexes(&[self.spec], &as_nodes(members), &self.placement).ok()?;
        let (build, _) = index_moves(&self.placement, &target);
        let alive: BTreeSet<NodeId> = self.members().into_iter().collect();
        let adoptions = index_sources(&self.placement, &build, &alive)
            .into_iter()
            .map(|((part, to), source): ((IndexPart, NodeId), Option<NodeId>)| Adoption {
                part: part.partition,
                to,
                source,
                asked_at,
                until: None,
                end: None,
            })
            .collect();
        Some((target, adoptions))
    }

    /// The metadata leader changes: a rebalance under way is taken up by the new one, whose
    /// index stage (unless it committed already) plans again over the placement and asks
    /// every adoption again — a copy its node holds already is not copied again.
    fn change_leader(&mut self) {
        let Some(r) = self.rebalance.as_ref() else { return };
        if r.index.is_some() {
            return;
        }
        let members: Vec<NodeId> = r.members.iter().copied().filter(|m| self.nodes.get(m).is_some_and(|n| n.member)).collect();
        let planned = self.plan_index_stage(&members, self.events.len());
        let Some(r) = self.rebalance.as_mut() else { return };
        match planned {
            Some((target, adoptions)) => {
                r.from = self.placement.clone();
                r.target = target;
                r.adoptions = adoptions;
            }
            None => r.index = Some(StageEnd::Failed),
        }
        self.stats.leader_changes += 1;
        self.note(format_args!("the leader changes; the index stage plans again"));
    }

    /// A client asks a node to scan the whole index at `request_plus`.
    fn start_scan(&mut self) {
        let members = self.members();
        let Some(router) = self.pick(&members) else { return };
        let Some(view) = self.nodes.get(&router).map(|n| n.placement.clone()) else { return };
        let mut reads = Vec::new();
        for (part, copies) in &view {
            let Some(node) = self.pick(copies) else { return };
            reads.push(PartRead { part: part.partition, node, answer: None });
        }
        let highs = self.ends();
        self.scans.push(Scan { started: self.step, highs, reads });
    }

    /// One partition request of one scan looks at its copy.
    fn scan_one(&mut self) -> Result<(), IndexViolation> {
        let Some(s) = (!self.scans.is_empty()).then(|| self.rng.below(self.scans.len() as u64) as usize) else { return Ok(()) };
        let open: Vec<usize> = (0..self.scans[s].reads.len()).filter(|i| self.scans[s].reads[*i].answer.is_none()).collect();
        let Some(i) = self.pick(&open) else { return Ok(()) };
        let (read, highs, started) = (self.scans[s].reads[i].clone(), self.scans[s].highs, self.scans[s].started);
        let copy = self.nodes.get(&read.node).and_then(|n| n.held.get(&read.part));
        let answer = match copy {
            // Not held (dropped meanwhile, or never here): refused, retryable.
            None if self.protocol.wait_checks_held => {
                self.refuse(s);
                return Ok(());
            }
            // Without the check: counted as caught up, read as nothing.
            None => Some([0; DATA_LOGS]),
            Some(c) if (0..DATA_LOGS).all(|l| c.at[l] >= highs[l]) => Some(c.at),
            Some(_) if self.step - started > SCAN_TIMEOUT_STEPS => {
                self.scans.swap_remove(s);
                self.stats.scans_timed_out += 1;
                return Ok(());
            }
            Some(_) => None,
        };
        let Some(at) = answer else { return Ok(()) };
        // Every entry of this partition written before the scan began must be in the answer.
        for l in 0..DATA_LOGS {
            let missing = self.logs[l][at[l].min(highs[l])..highs[l]].contains(&read.part);
            if missing {
                return Err(IndexViolation::ShortScan {
                    seed: self.seed,
                    step: self.step,
                    part: read.part,
                    node: read.node,
                    answered_at: at,
                    started_at: highs,
                });
            }
        }
        self.scans[s].reads[i].answer = Some(at);
        if self.scans[s].reads.iter().all(|r| r.answer.is_some()) {
            self.scans.swap_remove(s);
            self.stats.scans_answered += 1;
        }
        Ok(())
    }

    fn refuse(&mut self, s: usize) {
        self.scans.swap_remove(s);
        self.stats.scans_refused += 1;
    }

    /// No more rebalances or writes: the one under way ends, every node applies every
    /// state and every drain runs out; then each node holds exactly what it is placed.
    fn quiesce(&mut self) -> Result<(), IndexViolation> {
        for _ in 0..10_000 {
            if self.rebalance.is_none() {
                break;
            }
            self.step += 1;
            match self.rng.below(3) {
                0 => self.follow(),
                1 => self.adopt_one(),
                _ => self.lead()?,
            }
            // No new rebalance once the last one ended.
            if self.rebalance.is_none() {
                break;
            }
        }
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        for id in &ids {
            while self.nodes.get(id).is_some_and(|n| n.applied < self.events.len()) {
                self.apply_next(*id);
            }
        }
        self.step += DRAIN_STEPS + 1;
        self.drains();
        for (id, n) in &self.nodes {
            let placed: Vec<u16> = n.placed_here(*id);
            let held: Vec<u16> = n.held.keys().copied().collect();
            if placed != held {
                return Err(IndexViolation::NotAsPlaced { seed: self.seed, node: *id, placed, held });
            }
        }
        Ok(())
    }
}
