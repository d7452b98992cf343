//! A deterministic simulation of one partition's replication and failover protocol, to
//! check its safety under a seeded scheduler: no I/O, no threads, no clock — every run is
//! a function of its seed and can be replayed.
//!
//! What is modelled (the runtime's protocol, `failover.rs` deciding):
//! - `copies` nodes (2..=4) hold the partition: one active, the rest replicas. Replicas pull
//!   the active's change stream; each pull carries the replica's history (the handshake
//!   that finds where it parts from the active's — DCP's failover-log rollback) and the
//!   highest read round it has seen from that active, and so acknowledges the prefix it
//!   shares with the active. A replica pulls from, and accepts changes from, only the
//!   active of the latest map it applied, and only while that node is not `Failed` to it.
//! - Clients write unique values and read at `majority` on whichever node they think is
//!   active (some node's view of the map, or any node). A write is acknowledged once a
//!   majority of the active's copies hold it; a read returns the value at the high seqno
//!   of its start once (a) that seqno is on a majority and (b) a majority (the active
//!   included) acknowledged a round at least as new as the read (ReadIndex).
//! - The metadata leader is an oracle: its log is a list of committed events that every
//!   node applies in order at its own pace (the delayed map and fence notifications). At
//!   random times it fails the current active over: step 1 commits "F is Failed"; replicas
//!   that applied it stop following F and report their [`HistoryEnd`]; step 2 commits the
//!   map from [`failover_fenced`] with the replica [`choose_promotion`] picks, once
//!   [`promotion_ready`] holds — the functions the failover in production calls.
//! - The network delays, reorders, drops and duplicates every message. Nodes crash and
//!   restart; a failover may hit an active that is perfectly alive (false suspicion); in
//!   half the runs one node applies metadata far behind the others; writers pause now and
//!   then, so a deposed active may have nothing unreplicated and answer reads.
//! - Majorities and fence quorums count the configured copies ([`Protocol::SAFE`]); the
//!   other [`Protocol`]s each drop a rule, to show what it prevents.
//!
//! What is simplified:
//! - A node's change log and applied metadata position are durable: a crash keeps every
//!   change the node holds (as if each were fsynced before it is acknowledged or sent),
//!   and loses only volatile state — acknowledgements counted as active, pending client
//!   operations (their writes become unknown outcomes), read rounds seen.
//! - One partition; the map changes by failing the active over and by a rebalance that
//!   fills the slot a failover left vacant with a new, empty copy; a failed node never
//!   comes back (it would rejoin as a new copy through a rebalance, as those do).
//! - Read rounds are the simulation's step number, standing in for any counter that rises
//!   across restarts (a hybrid clock).
//!
//! What is checked at the end of a run: every acknowledged write is in
//! the final active's history at the seqno and epoch it was acknowledged at; no rejected
//! write is; one node acknowledges writes per epoch and no two acknowledged writes share a
//! seqno; and the register history is linearizable with the final history as the order of
//! writes (a read observes it at the end) — a full check for a single register with unique
//! values once the order of writes is fixed, not the weaker "reads are not stale".

use std::collections::{BTreeMap, BTreeSet};

use crate::failover::{choose_promotion, failover_fenced, majority, promotion_ready, CollectionEnds, HistoryEnd};
use crate::map::{Copies, NodeId, PartitionMap};

/// Fewest copies simulated: one active and one replica.
pub const COPIES_MIN: usize = 2;
/// Most copies simulated: one active and `REPLICAS_MAX` replicas.
pub const COPIES_MAX: usize = 1 + crate::REPLICAS_MAX as usize;
/// Steps after which a client stops waiting for its operation (a write's outcome is then
/// unknown).
pub const CLIENT_TIMEOUT_STEPS: u64 = 100;
/// Most changes one pull response carries, so catching up takes several round trips.
pub const PULL_BATCH_MAX_ENTRIES: usize = 3;
/// Chance in a hundred that the network drops a message, and that it duplicates one.
pub const NETWORK_DROP_PERCENT: u64 = 5;
pub const NETWORK_DUPLICATE_PERCENT: u64 = 5;
/// Chance in a hundred per step that writers pause, and that paused writers resume.
pub const WRITERS_PAUSE_PERCENT: u64 = 1;
pub const WRITERS_RESUME_PERCENT: u64 = 4;
/// Chance in a hundred that a lagging node applies the next metadata event when it could.
pub const LAGGING_APPLY_PERCENT: u64 = 10;

/// Which protocol the simulated nodes and leader run: [`Protocol::SAFE`], or it with one or
/// more rules taken away, to show the checker catches what each rule prevents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Protocol {
    /// The leader promotes only once [`promotion_ready`] holds; without it, as soon as any
    /// replica reports.
    pub fence_quorum: bool,
    /// A read waits for a majority to confirm a round at least as new as the read.
    pub confirmed_reads: bool,
    /// The leader orders reports by [`HistoryEnd`] (epoch, then seqno); without it, by
    /// seqno alone.
    pub promote_by_history_end: bool,
    /// Majorities and fence quorums count the configured copies (replicas + 1), a failed
    /// node's slot staying vacant; without it, the copies in the current map, which shrink
    /// by one at every failover.
    pub majority_of_configured_copies: bool,
}

impl Protocol {
    /// Every rule.
    pub const SAFE: Protocol =
        Protocol { fence_quorum: true, confirmed_reads: true, promote_by_history_end: true, majority_of_configured_copies: true };
    /// The protocol as first specified: majorities of the current map's copies and
    /// promotion by seqno.
    pub const AS_SPECIFIED: Protocol = Protocol { promote_by_history_end: false, majority_of_configured_copies: false, ..Protocol::SAFE };
}

/// One run's shape.
#[derive(Clone, Copy, Debug)]
pub struct SimConfig {
    pub copies: usize,
    pub steps: u64,
    pub protocol: Protocol,
}

/// A broken invariant, with enough to replay it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub seed: u64,
    pub invariant: &'static str,
    pub detail: String,
}

/// What a run did, to tell a run that checked something from one that idled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunStats {
    pub writes_acknowledged: usize,
    pub reads_completed: usize,
    pub promotions: usize,
}

/// SplitMix64: small, fast, and enough to scatter a scheduler's choices (the seeded models
/// of `tests/` use it too).
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (the modulo bias is irrelevant at these sizes).
    pub fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0);
        self.next_u64() % n
    }

    pub fn percent(&mut self, p: u64) -> bool {
        self.below(100) < p
    }
}

/// One change: the epoch (map version) of the active that sequenced it, and the value it
/// wrote. Values are unique, so an entry names itself; its seqno is its position + 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    epoch: u64,
    value: u64,
}

/// A committed metadata event.
#[derive(Clone, Debug)]
enum MetaEvent {
    Failed(NodeId),
    Map(PartitionMap),
}

#[derive(Clone, Debug)]
enum Msg {
    /// Replica to active: "send me what follows my history"; acknowledges the shared prefix
    /// and the read round echoed.
    Pull { from: NodeId, to: NodeId, log: Vec<Entry>, echo_round: u64 },
    /// Active to replica: the changes after `prev` (which must match the replica's).
    /// `high`: the active's log length when it answered (a new copy is built once it holds
    /// that much).
    Changes { from: NodeId, to: NodeId, prev: usize, prev_entry: Option<Entry>, entries: Vec<Entry>, round: u64, high: usize },
    /// Replica to leader, after applying "`failed` is Failed".
    Report { from: NodeId, failed: NodeId, end: HistoryEnd },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Pending,
    Ok,
    /// Definitely not applied (the node refused it).
    Refused,
    /// The client gave up or the node lost it: applied or not.
    Unknown,
}

#[derive(Clone, Debug)]
struct ClientOp {
    kind: OpKind,
    invoke: u64,
    complete: Option<u64>,
    outcome: Outcome,
}

#[derive(Clone, Copy, Debug)]
enum OpKind {
    Write { value: u64, acked_at: Option<(NodeId, u64, usize)> },
    Read { result: Option<u64> },
}

struct PendingRead {
    op: usize,
    high: usize,
    round: u64,
}

struct Node {
    id: NodeId,
    up: bool,
    log: Vec<Entry>,
    applied: usize,
    map: PartitionMap,
    failed: BTreeSet<NodeId>,
    // Volatile, as active.
    matched: BTreeMap<NodeId, usize>,
    confirmed: BTreeMap<NodeId, u64>,
    writes: Vec<(usize, usize)>,
    reads: Vec<PendingRead>,
    // Volatile, as replica.
    seen_round: BTreeMap<NodeId, u64>,
    /// A copy a rebalance added is built once it caught up with its active; before, it is
    /// never fenced nor promoted (production's `without_building`).
    built: bool,
}

impl Node {
    fn copies(&self) -> &Copies {
        &self.map.partitions[0]
    }

    fn is_active(&self) -> bool {
        self.copies().active == self.id && !self.failed.contains(&self.id)
    }

    /// The node this one follows as a replica, if any.
    fn leader_to_follow(&self) -> Option<NodeId> {
        let copies = self.copies();
        (copies.replicas.contains(&self.id) && !self.failed.contains(&copies.active)).then_some(copies.active)
    }

    fn history_end(&self) -> HistoryEnd {
        HistoryEnd { epoch: self.log.last().map_or(0, |e| e.epoch), seqno: self.log.len() as u64 }
    }
}

struct Sim {
    seed: u64,
    config: SimConfig,
    rng: SplitMix64,
    tick: u64,
    nodes: Vec<Node>,
    meta: Vec<MetaEvent>,
    failing: Option<NodeId>,
    reports: BTreeMap<NodeId, HistoryEnd>,
    network: Vec<Msg>,
    ops: Vec<ClientOp>,
    next_value: u64,
    stats: RunStats,
    /// A node that applies metadata slowly this run (a lagging or partitioned member), if
    /// any: the stale views that failover must be safe against.
    lagging: Option<usize>,
    /// Writers pause now and then, so an active's changes can all reach its replicas
    /// before a failover cuts them off (else every read of a deposed active would wait on
    /// its unreplicated tail forever, and stale reads would go untested).
    writers_paused: bool,
    /// Every event, when a run is replayed to explain a violation.
    trace: Option<Vec<String>>,
}

/// Runs one seeded simulation and checks its history.
pub fn run(seed: u64, config: &SimConfig) -> Result<RunStats, Violation> {
    simulate(seed, config, false).0
}

/// Replays a run with every event written down, to explain a violation.
pub fn replay(seed: u64, config: &SimConfig) -> (Result<RunStats, Violation>, Vec<String>) {
    let (result, trace) = simulate(seed, config, true);
    (result, trace.unwrap_or_default())
}

fn simulate(seed: u64, config: &SimConfig, traced: bool) -> (Result<RunStats, Violation>, Option<Vec<String>>) {
    assert!((COPIES_MIN..=COPIES_MAX).contains(&config.copies), "copies must be {COPIES_MIN}..={COPIES_MAX}");
    let map = PartitionMap {
        version: 1,
        partitions: vec![Copies { active: NodeId(1), replicas: (2..=config.copies as u64).map(NodeId).collect() }],
    };
    let nodes = (1..=config.copies as u64)
        .map(|i| Node {
            id: NodeId(i),
            up: true,
            log: Vec::new(),
            applied: 1,
            map: map.clone(),
            failed: BTreeSet::new(),
            matched: BTreeMap::new(),
            confirmed: BTreeMap::new(),
            writes: Vec::new(),
            reads: Vec::new(),
            seen_round: BTreeMap::new(),
            built: true,
        })
        .collect();
    let mut sim = Sim {
        seed,
        config: *config,
        rng: SplitMix64(seed),
        tick: 0,
        nodes,
        meta: vec![MetaEvent::Map(map)],
        failing: None,
        reports: BTreeMap::new(),
        network: Vec::new(),
        ops: Vec::new(),
        next_value: 1,
        stats: RunStats::default(),
        trace: traced.then(Vec::new),
        lagging: None,
        writers_paused: false,
    };
    if sim.rng.percent(50) {
        sim.lagging = Some(sim.random_node());
    }
    for _ in 0..config.steps {
        sim.tick += 1;
        sim.step();
        sim.time_out_clients();
    }
    let result = sim.check().map(|()| sim.stats);
    (result, sim.trace)
}

impl Sim {
    fn trace(&mut self, event: impl FnOnce() -> String) {
        let tick = self.tick;
        if let Some(trace) = &mut self.trace {
            trace.push(format!("{tick:>4} {}", event()));
        }
    }

    fn node_index(&self, id: NodeId) -> usize {
        (id.0 - 1) as usize
    }

    fn random_node(&mut self) -> usize {
        self.rng.below(self.nodes.len() as u64) as usize
    }

    fn send(&mut self, msg: Msg) {
        if self.rng.percent(NETWORK_DROP_PERCENT) {
            return;
        }
        if self.rng.percent(NETWORK_DUPLICATE_PERCENT) {
            self.network.push(msg.clone());
        }
        self.network.push(msg);
    }

    fn step(&mut self) {
        let toggle = if self.writers_paused { WRITERS_RESUME_PERCENT } else { WRITERS_PAUSE_PERCENT };
        if self.rng.percent(toggle) {
            self.writers_paused = !self.writers_paused;
        }
        match self.rng.below(100) {
            0..40 => self.deliver(),
            40..55 => {
                let i = self.random_node();
                self.pull(i);
            }
            55..65 => {
                let i = self.random_node();
                self.apply_next_meta(i);
            }
            65..75 if !self.writers_paused => self.client_write(),
            65..75 => self.client_read(),
            75..83 => self.client_read(),
            83..88 => {
                let i = self.random_node();
                self.report(i);
            }
            88 if self.rng.percent(50) => self.start_failover(),
            88 => self.refill(),
            89..91 => {
                let i = self.random_node();
                self.crash(i);
            }
            91..98 => {
                let i = self.random_node();
                if !self.nodes[i].up {
                    self.trace(|| format!("n{} restarts", i + 1));
                }
                self.nodes[i].up = true;
            }
            _ => {
                if !self.network.is_empty() {
                    let i = self.rng.below(self.network.len() as u64) as usize;
                    self.network.swap_remove(i);
                }
            }
        }
    }

    fn deliver(&mut self) {
        if self.network.is_empty() {
            return;
        }
        let i = self.rng.below(self.network.len() as u64) as usize;
        let msg = self.network.swap_remove(i);
        self.trace(|| format!("deliver {msg:?}"));
        match msg {
            Msg::Pull { from, to, log, echo_round } => self.on_pull(from, to, &log, echo_round),
            Msg::Changes { from, to, prev, prev_entry, entries, round, high } => {
                self.on_changes(from, to, prev, prev_entry, &entries, round);
                let node = &mut self.nodes[(to.0 - 1) as usize];
                if node.leader_to_follow() == Some(from) && node.log.len() >= high && node.log.len() == prev + entries.len() {
                    node.built = true;
                }
            }
            Msg::Report { from, failed, end } => self.on_report(from, failed, end),
        }
    }

    fn pull(&mut self, i: usize) {
        let node = &self.nodes[i];
        if !node.up {
            return;
        }
        let Some(to) = node.leader_to_follow() else { return };
        let msg = Msg::Pull { from: node.id, to, log: node.log.clone(), echo_round: node.seen_round.get(&to).copied().unwrap_or(0) };
        self.send(msg);
    }

    fn on_pull(&mut self, from: NodeId, to: NodeId, log: &[Entry], echo_round: u64) {
        let tick = self.tick;
        let i = self.node_index(to);
        let node = &mut self.nodes[i];
        if !node.up || !node.is_active() || !node.copies().replicas.contains(&from) {
            return;
        }
        let shared = node.log.iter().zip(log).take_while(|(a, b)| a == b).count();
        let matched = node.matched.entry(from).or_insert(0);
        *matched = (*matched).max(shared);
        let confirmed = node.confirmed.entry(from).or_insert(0);
        *confirmed = (*confirmed).max(echo_round);
        let end = node.log.len().min(shared + PULL_BATCH_MAX_ENTRIES);
        let msg = Msg::Changes {
            from: to,
            to: from,
            prev: shared,
            prev_entry: shared.checked_sub(1).map(|p| node.log[p]),
            entries: node.log[shared..end].to_vec(),
            round: tick,
            high: node.log.len(),
        };
        self.send(msg);
        self.complete_operations(i);
    }

    fn on_changes(&mut self, from: NodeId, to: NodeId, prev: usize, prev_entry: Option<Entry>, entries: &[Entry], round: u64) {
        let i = self.node_index(to);
        let node = &mut self.nodes[i];
        if !node.up || node.leader_to_follow() != Some(from) {
            return;
        }
        if node.log.len() < prev || prev.checked_sub(1).map(|p| node.log[p]) != prev_entry {
            return;
        }
        for (k, entry) in entries.iter().enumerate() {
            let at = prev + k;
            match node.log.get(at) {
                Some(have) if have == entry => {}
                Some(_) => {
                    // Rollback: what follows the point where the histories part was never
                    // on a majority of this active's copies.
                    node.log.truncate(at);
                    node.log.push(*entry);
                }
                None => node.log.push(*entry),
            }
        }
        let seen = node.seen_round.entry(from).or_insert(0);
        *seen = (*seen).max(round);
    }

    fn apply_next_meta(&mut self, i: usize) {
        if self.lagging == Some(i) && !self.rng.percent(LAGGING_APPLY_PERCENT) {
            return;
        }
        let node = &self.nodes[i];
        if !node.up || node.applied >= self.meta.len() {
            return;
        }
        let was_active = node.is_active();
        let event = self.meta[node.applied].clone();
        let node = &mut self.nodes[i];
        node.applied += 1;
        let id = node.id;
        self.trace(|| format!("{id} applies {event:?}"));
        let node = &mut self.nodes[i];
        match event {
            MetaEvent::Failed(f) => {
                node.failed.insert(f);
            }
            MetaEvent::Map(map) => node.map = map,
        }
        if was_active || node.is_active() {
            // A new term as active starts with nothing counted; a lost one ends its pending
            // operations (the client hears an error: a write's outcome is unknown).
            self.drop_active_state(i);
        }
        // A fenced replica reports at once (and again now and then, the network being lossy).
        self.report(i);
    }

    fn drop_active_state(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        node.matched.clear();
        node.confirmed.clear();
        let writes = std::mem::take(&mut node.writes);
        let reads = std::mem::take(&mut node.reads);
        for (op, _) in writes {
            if self.ops[op].outcome == Outcome::Pending {
                self.ops[op].outcome = Outcome::Unknown;
            }
        }
        for read in reads {
            if self.ops[read.op].outcome == Outcome::Pending {
                self.ops[read.op].outcome = Outcome::Unknown;
            }
        }
    }

    fn crash(&mut self, i: usize) {
        if !self.nodes[i].up {
            return;
        }
        self.drop_active_state(i);
        self.trace(|| format!("n{} crashes", i + 1));
        let node = &mut self.nodes[i];
        node.up = false;
        node.seen_round.clear();
    }

    fn report(&mut self, i: usize) {
        let node = &self.nodes[i];
        let copies = node.copies();
        if !node.up || !node.built || !copies.replicas.contains(&node.id) || !node.failed.contains(&copies.active) {
            return;
        }
        let msg = Msg::Report { from: node.id, failed: copies.active, end: node.history_end() };
        self.send(msg);
    }

    /// The `n` of majorities and fence quorums for a partition with `copies`.
    fn copies_counted(&self, copies: &Copies) -> usize {
        if self.config.protocol.majority_of_configured_copies {
            self.config.copies
        } else {
            copies.nodes().count()
        }
    }

    fn leader_map(&self) -> &PartitionMap {
        self.meta
            .iter()
            .rev()
            .find_map(|e| match e {
                MetaEvent::Map(m) => Some(m),
                MetaEvent::Failed(_) => None,
            })
            .expect("the log starts with a map")
    }

    fn start_failover(&mut self) {
        let copies = &self.leader_map().partitions[0];
        if self.failing.is_some() || copies.replicas.is_empty() {
            return;
        }
        let failed = copies.active;
        self.failing = Some(failed);
        self.reports.clear();
        self.trace(|| format!("leader commits {failed} Failed"));
        self.meta.push(MetaEvent::Failed(failed));
    }

    fn on_report(&mut self, from: NodeId, failed: NodeId, end: HistoryEnd) {
        if self.failing != Some(failed) || !self.leader_map().partitions[0].replicas.contains(&from) {
            return;
        }
        self.reports.insert(from, end);
        let map = self.leader_map().clone();
        let protocol = self.config.protocol;
        let copies_counted = self.copies_counted(&map.partitions[0]);
        let ready =
            !protocol.fence_quorum || promotion_ready(&map.partitions[0], copies_counted, failed, &|n| self.reports.contains_key(&n));
        if !ready {
            return;
        }
        // The production rule: `choose_promotion` over the fenced replicas' reports (one
        // collection here), then `failover_fenced` with the chosen one.
        let seqno_only = !protocol.promote_by_history_end;
        let reports: Vec<(NodeId, CollectionEnds)> = map.partitions[0]
            .replicas
            .iter()
            .filter_map(|n| self.reports.get(n).map(|e| (*n, if seqno_only { HistoryEnd { epoch: 0, seqno: e.seqno } } else { *e })))
            .map(|(n, e)| (n, CollectionEnds::from([(0, e)])))
            .collect();
        let choice = choose_promotion(&reports);
        debug_assert!(choice.as_ref().is_none_or(|c| c.catch_up.is_empty()), "one collection: the chosen copy is furthest");
        let plan = failover_fenced(&map, failed, &|_, n| {
            choice.as_ref().filter(|c| c.to == n).and_then(|_| reports.iter().find(|(r, _)| *r == n)).map(|(_, e)| e[&0])
        });
        assert!(plan.unavailable.is_empty(), "a ready partition has a fenced replica to promote");
        self.stats.promotions += plan.promotions.len();
        let reports = self.reports.clone();
        self.trace(|| format!("leader commits {:?} (reports {reports:?})", plan.map));
        self.meta.push(MetaEvent::Map(plan.map));
        self.failing = None;
        self.reports.clear();
    }

    /// A rebalance fills the slot a failover left vacant with a new, empty copy (a new node
    /// id; a failed node never comes back). Its acknowledgements count once it holds what it
    /// acknowledges, so the active's majorities can again do without a replica that is
    /// down — one left on an older active's history, with a higher seqno, which only
    /// [`HistoryEnd`]'s epoch tells from the copies that hold acknowledged writes.
    fn refill(&mut self) {
        let map = self.leader_map().clone();
        if self.failing.is_some() || map.partitions[0].nodes().count() >= self.config.copies {
            return;
        }
        let id = NodeId(self.nodes.len() as u64 + 1);
        let mut next = map;
        next.version += 1;
        next.partitions[0].replicas.push(id);
        let failed: BTreeSet<NodeId> = self
            .meta
            .iter()
            .filter_map(|e| match e {
                MetaEvent::Failed(f) => Some(*f),
                MetaEvent::Map(_) => None,
            })
            .collect();
        self.trace(|| format!("leader commits {next:?} (a new copy {id} in the vacant slot)"));
        self.meta.push(MetaEvent::Map(next.clone()));
        self.nodes.push(Node {
            id,
            up: true,
            log: Vec::new(),
            applied: self.meta.len(),
            map: next,
            failed,
            matched: BTreeMap::new(),
            confirmed: BTreeMap::new(),
            writes: Vec::new(),
            reads: Vec::new(),
            seen_round: BTreeMap::new(),
            built: false,
        });
    }

    /// The node a client sends to: the active of the newest map (a client that just
    /// refreshed its view), of some node's view (views lag), or now and then any node.
    fn client_target(&mut self) -> usize {
        let roll = self.rng.below(100);
        let active = if roll < 60 {
            self.leader_map().partitions[0].active
        } else if roll < 85 {
            let i = self.random_node();
            self.nodes[i].copies().active
        } else {
            return self.random_node();
        };
        self.node_index(active)
    }

    fn client_write(&mut self) {
        let value = self.next_value;
        self.next_value += 1;
        let i = self.client_target();
        let op = self.ops.len();
        let node = &mut self.nodes[i];
        let accepted = node.up && node.is_active();
        self.ops.push(ClientOp {
            kind: OpKind::Write { value, acked_at: None },
            invoke: self.tick,
            complete: None,
            outcome: if accepted { Outcome::Pending } else { Outcome::Refused },
        });
        self.trace(|| format!("client writes {value} to n{} (accepted {accepted})", i + 1));
        let node = &mut self.nodes[i];
        if accepted {
            let epoch = node.map.version;
            node.log.push(Entry { epoch, value });
            node.writes.push((op, node.log.len()));
            self.complete_operations(i);
        }
    }

    fn client_read(&mut self) {
        let i = self.client_target();
        let op = self.ops.len();
        let node = &mut self.nodes[i];
        let accepted = node.up && node.is_active();
        self.ops.push(ClientOp {
            kind: OpKind::Read { result: None },
            invoke: self.tick,
            complete: None,
            outcome: if accepted { Outcome::Pending } else { Outcome::Refused },
        });
        self.trace(|| format!("client reads op {op} at n{} (accepted {accepted})", i + 1));
        let node = &mut self.nodes[i];
        if accepted {
            node.reads.push(PendingRead { op, high: node.log.len(), round: self.tick });
            self.complete_operations(i);
        }
    }

    /// Acknowledges the writes now on a majority and answers the reads now confirmed.
    fn complete_operations(&mut self, i: usize) {
        let unconfirmed_reads = !self.config.protocol.confirmed_reads;
        let tick = self.tick;
        let copies = self.nodes[i].copies().clone();
        let needed = majority(self.copies_counted(&copies));
        let node = &mut self.nodes[i];
        let held = |seqno: usize| 1 + copies.replicas.iter().filter(|r| node.matched.get(r).is_some_and(|m| *m >= seqno)).count() >= needed;
        let confirmed =
            |round: u64| 1 + copies.replicas.iter().filter(|r| node.confirmed.get(r).is_some_and(|c| *c >= round)).count() >= needed;
        let (done, waiting): (Vec<_>, Vec<_>) = node.writes.iter().partition(|(_, seqno)| held(*seqno));
        let (answered, unanswered): (Vec<_>, Vec<_>) =
            std::mem::take(&mut node.reads).into_iter().partition(|r| held(r.high) && (unconfirmed_reads || confirmed(r.round)));
        node.writes = waiting;
        node.reads = unanswered;
        // A write is acknowledged at the epoch it was sequenced in (a map that only adds a
        // copy raises the version under the same active).
        let epochs: Vec<u64> = done.iter().map(|(_, seqno)| node.log[seqno - 1].epoch).collect();
        let result_at = |high: usize| high.checked_sub(1).map(|p| node.log[p].value);
        let answers: Vec<(usize, Option<u64>)> = answered.iter().map(|r| (r.op, result_at(r.high))).collect();
        let id = node.id;
        for ((op, seqno), epoch) in done.into_iter().zip(epochs) {
            let op = &mut self.ops[op];
            if op.outcome == Outcome::Pending {
                op.outcome = Outcome::Ok;
                op.complete = Some(tick);
                if let OpKind::Write { acked_at, .. } = &mut op.kind {
                    *acked_at = Some((id, epoch, seqno));
                }
                self.stats.writes_acknowledged += 1;
                if let Some(trace) = &mut self.trace {
                    trace.push(format!("{tick:>4} {id} acks {:?}", op.kind));
                }
            }
        }
        for (op, value) in answers {
            let op = &mut self.ops[op];
            if op.outcome == Outcome::Pending {
                op.outcome = Outcome::Ok;
                op.complete = Some(tick);
                op.kind = OpKind::Read { result: value };
                self.stats.reads_completed += 1;
                if let Some(trace) = &mut self.trace {
                    trace.push(format!("{tick:>4} {id} answers read {op:?}"));
                }
            }
        }
    }

    fn time_out_clients(&mut self) {
        let tick = self.tick;
        for op in &mut self.ops {
            if op.outcome == Outcome::Pending && op.invoke + CLIENT_TIMEOUT_STEPS < tick {
                op.outcome = Outcome::Unknown;
            }
        }
    }

    fn check(&self) -> Result<(), Violation> {
        let active = self.leader_map().partitions[0].active;
        let history: Vec<(u64, u64)> = self.nodes[self.node_index(active)].log.iter().map(|e| (e.epoch, e.value)).collect();
        check_history(&self.ops, &history).map_err(|(invariant, detail)| Violation { seed: self.seed, invariant, detail })
    }
}

/// Checks a run's client history against the final active's history (`(epoch, value)` per
/// seqno, in order). Returns the invariant broken and what broke it.
fn check_history(ops: &[ClientOp], history: &[(u64, u64)]) -> Result<(), (&'static str, String)> {
    let position: BTreeMap<u64, usize> = history.iter().enumerate().map(|(i, (_, v))| (*v, i)).collect();

    // (a) No lost acknowledged write, (b) no conflicting acknowledgements.
    let mut epoch_owner: BTreeMap<u64, NodeId> = BTreeMap::new();
    let mut seqno_owner: BTreeMap<usize, u64> = BTreeMap::new();
    for op in ops {
        let OpKind::Write { value, acked_at } = op.kind else { continue };
        match (op.outcome, acked_at) {
            (Outcome::Ok, Some((node, epoch, seqno))) => {
                if history.get(seqno - 1) != Some(&(epoch, value)) {
                    return Err((
                        "acknowledged write lost",
                        format!(
                            "write {value} acked by {node} at epoch {epoch} seqno {seqno}; final history there: {:?}",
                            history.get(seqno - 1)
                        ),
                    ));
                }
                if let Some(other) = epoch_owner.insert(epoch, node).filter(|o| *o != node) {
                    return Err(("two actives in one epoch", format!("{other} and {node} both acknowledged writes at epoch {epoch}")));
                }
                if let Some(other) = seqno_owner.insert(seqno, value) {
                    return Err(("conflicting acknowledgements", format!("writes {other} and {value} both acknowledged at seqno {seqno}")));
                }
            }
            (Outcome::Refused, _) if position.contains_key(&value) => {
                return Err(("refused write applied", format!("write {value} was refused but is in the final history")));
            }
            _ => {}
        }
    }

    // (c) Linearizability, with the final history as the order of writes. Cluster k holds
    // the write at seqno k (cluster 0: the initial empty register) and the reads that
    // returned it; clusters are linearized in order, each write before its reads, every
    // operation at the earliest point its interval and the order allow. Greedy earliest
    // points are optimal for a fixed order, so a failure means no linearization exists.
    let mut clusters: Vec<(Option<&ClientOp>, Vec<&ClientOp>)> = (0..=history.len()).map(|_| (None, Vec::new())).collect();
    for op in ops {
        match op.kind {
            OpKind::Write { value, .. } => {
                if let Some(p) = position.get(&value) {
                    clusters[p + 1].0 = Some(op);
                }
            }
            OpKind::Read { result } if op.outcome == Outcome::Ok => {
                let k = match result {
                    None => 0,
                    Some(v) => match position.get(&v) {
                        Some(p) => p + 1,
                        None => return Err(("read of a value not in the final history", format!("a read at {} returned {v}", op.invoke))),
                    },
                };
                clusters[k].1.push(op);
            }
            OpKind::Read { .. } => {}
        }
    }
    let mut point = 0u64;
    for (k, (write, reads)) in clusters.iter().enumerate() {
        if let Some(w) = write {
            point = point.max(w.invoke);
            if w.complete.is_some_and(|c| c < point) {
                return Err((
                    "not linearizable",
                    format!(
                        "write at seqno {k} (invoked {}, completed {:?}) must follow an operation invoked at {point}",
                        w.invoke, w.complete
                    ),
                ));
            }
        }
        let start = point;
        for r in reads {
            let at = start.max(r.invoke);
            let complete = r.complete.expect("completed reads have a completion");
            if complete < at {
                return Err((
                    "not linearizable",
                    format!(
                        "read (invoked {}, completed {complete}) returned seqno {k}'s value, older than an operation invoked at {at}",
                        r.invoke
                    ),
                ));
            }
            point = point.max(at);
        }
    }
    Ok(())
}
