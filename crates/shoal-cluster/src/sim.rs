//! A deterministic simulation of one partition's replication, failover and rebalance
//! protocol, to check its safety under a seeded scheduler: no I/O, no threads, no clock —
//! every run is a function of its seed and can be replayed.
//!
//! What is modelled (the runtime's protocol, `failover.rs` and `rebalance.rs` deciding):
//! - `copies` nodes (2..=4) hold the partition: one active, the rest replicas. Replicas pull
//!   the active's change stream; each pull carries the replica's history (the handshake
//!   that finds where it parts from the active's — DCP's failover-log rollback) and the
//!   highest read round it has seen from that active, and so acknowledges the prefix it
//!   shares with the active. A replica pulls from, and accepts changes from, only the
//!   active of the latest map it applied, and only while that node is not `Failed` to it.
//!   A copy that becomes active starts a new history, named by the map version it became
//!   active at; a replica takes the history of the active whose changes it accepts.
//! - Clients write unique values and read at `majority` on whichever node they think is
//!   active (some node's view of the map, or any node). The active refuses a write,
//!   unwritten, when too few replicas were heard from lately to make a majority
//!   (production's `majority_possible`); it acknowledges one once a majority of its copies
//!   hold it. A read returns the value at the high seqno of its start once (a) that seqno
//!   is on a majority and (b) a majority (the active included) acknowledged a round at
//!   least as new as the read (ReadIndex).
//! - Derived state (index entries, shadow rows): every node applies its own log to a
//!   derived view at its own pace, trailing the log; where the log was rolled back under
//!   it, the view first rolls back to where they part (production's `rollback_point`). A
//!   copy's *serve floor* is its log's length when it became active or restarted
//!   (production's `Partition::serve_floor`). Clients read the derived state of the node
//!   they think is active: `request_plus` reads wait until the view reaches the active's
//!   high at the read's start, and answer the view's value once its position is on a
//!   majority and a majority confirmed a round as new as the read (a majority read's
//!   confirmation; [`Protocol::confirmed_derived_reads`]); `not_bounded` reads answer the
//!   view as it is. Both are answered only
//!   from a *whole* view: on the log's history and at or past the serve floor
//!   (production's `Collection::behind_serve_floor`, which `IndexManager::whole` and
//!   `Shadow::wait_whole` wait on).
//! - The metadata leader is an oracle: its log is a list of committed events that every
//!   node applies in order at its own pace (the delayed map and fence notifications). At
//!   random times it fails the current active over: step 1 commits "F is Failed"; replicas
//!   that applied it stop following F and report their [`HistoryEnd`]; step 2 commits the
//!   map from [`failover_fenced`] with the replica [`choose_promotion`] picks, once
//!   [`Quorum::fenced`] holds — the functions the failover in production calls. It does
//!   not start a failover whose fence quorum no built replica set could reach.
//! - At other random times it rebalances through the stage machine of
//!   [`crate::rebalance`], as production's `shoal-node/src/rebalance.rs` does. It commits
//!   the plan (the map it starts from, a target), then [`build_map`]. Then, turn after
//!   turn, it asks every holder for its progress — its map version, its copy's length and
//!   history (none while being built), the replicas it hears as active, whether its
//!   derived state is behind — and, once all answered or the calls timed out, builds a
//!   [`Look`] from the answers as production's `run` does (answers under an older map say
//!   nothing of copies) and carries out [`next_step`]. A [`Step::HandOver`] asks the
//!   partition's active, under the map and plan it names, to freeze (refuse writes) and
//!   answer once every copy of the target has acknowledged everything it holds in a round
//!   after the freeze (production's `serve_handover`) — whether the role moves or only
//!   replicas change — and commits [`wave_map`] on the answer if the map did not change
//!   meanwhile. [`Step::Revert`] and [`Step::OutOfTime`] commit [`revert_map`] and end
//!   the plan, [`Step::Finish`] ends it; so does a map changed under it (a failover) or a
//!   node of its target failed, with [`revert_map`]. A freeze thaws when its node applies
//!   a later map or the plan's end. Targets: a new node in the slot a failover left vacant;
//!   a new node in a replica's place, the active staying; a new node taking the active role, the old active leaving or staying as a replica in
//!   place of another; an existing replica taking the active role. The leader changes now
//!   and then, losing what it heard, its outstanding hand-over and the time of its last
//!   wave; the next one resumes from the committed map and plan. An operator may ask for a
//!   stop. A failover and a hand-over exclude each other (production's failover lock).
//! - While a partition's copies are neither the plan's starting ones nor its target (the
//!   build map, or a failover's map made from it), a majority — for a write, a read's
//!   confirmation, a write's admission — is one of the map's copies and of the starting
//!   copies, and a promotion needs a fence quorum of each ([`Quorum`], the rule production
//!   runs; [`Protocol::joint_majorities`]). The target copies are not a set of their own —
//!   a copy still being built would hold up every write — but each wave's hand-over waits
//!   until the whole target holds what the active has ([`Protocol::handover_waits_for_whole_target`]).
//!   Majorities and fence quorums count the configured copies, or the map's when a build
//!   map holds more (production's `copies_counted`).
//! - The network delays, reorders, drops and duplicates every message. Nodes crash and
//!   restart; a failover may hit an active that is perfectly alive (false suspicion); in
//!   half the runs one node applies metadata far behind the others; writers pause now and
//!   then, so a deposed active may have nothing unreplicated and answer reads.
//! - [`Protocol::SAFE`] runs every rule; the other [`Protocol`]s each drop one, to show
//!   what it prevents.
//!
//! What is simplified:
//! - A node's change log, applied metadata position, derived view and a hand-over's
//!   freeze are durable: a crash keeps every change the node holds (as if each were
//!   fsynced before it is acknowledged or sent), and loses only volatile state —
//!   acknowledgements counted as active, pending client operations (their writes become
//!   unknown outcomes), read rounds seen. (Production keeps the freeze in memory and, after
//!   a restart, freezes again the copies it stored as replicas that the map still names
//!   active under a plan; [`Protocol::freeze_survives_crash`] shows what that prevents.)
//! - One partition, so a wave is the whole rebalance; with three replicas a rebalance only
//!   promotes a replica or fills a vacant slot (kept to at most [`crate::REPLICAS_MAX`]
//!   replicas in the build map, though production's maps take up to
//!   [`crate::MAP_REPLICAS_MAX`]).
//!   Nodes never come back once failed over or moved off the map; new copies are new nodes.
//! - A freeze has no time limit, and the leader commits a hand-over whenever its answer
//!   comes. (Production's freeze ends by a newer map or the plan's end too, never by the
//!   clock; past `FREEZE_MAX` the frozen node commits that newer map itself, which fences a
//!   late wave out — a path without a clock the simulation does not take.) Hand-over calls carry a name, as a connection does: a late answer to
//!   an earlier call is not taken for a later one's.
//! - Read rounds are the simulation's step number, standing in for any counter that rises
//!   across restarts (a hybrid clock); a step stands for a second of the stage machine's
//!   durations.
//!
//! What is checked at the end of a run: every acknowledged write is in the final active's
//! history at the seqno and epoch it was acknowledged at; no refused write is; one node
//! acknowledges writes per epoch and no two acknowledged writes share a seqno; no derived
//! read is *short*: one answered by a copy that became active at map version `E` holds
//! every write acknowledged, before the read began, at an epoch before `E`; and the
//! register history — majority reads and `request_plus` derived reads — is linearizable
//! with the final history as the order of writes (a read observes it at the end): a full
//! check for a single register with unique values once the order of writes is fixed, not
//! the weaker "reads are not stale".
//!
//! Why the short-read check raises no false alarm under [`Protocol::SAFE`]: such a write
//! was sequenced by an earlier active and acknowledged by a majority. A failover promotes
//! a copy only once a fence quorum meets every majority of the old active, and picks the
//! furthest history; a hand-over commits the new map only once the old active, refusing
//! writes, has seen the new active acknowledge all it holds. So the write is in the log of
//! the copy that became active at `E`, at its seqno, when it became active — below its
//! serve floor — and the deposed active cannot acknowledge it later (that would be a lost
//! write, checked above). A whole view is a prefix of that log at least as long as the
//! floor, so it holds the write. A `not_bounded` read may answer a change no majority holds
//! yet, one a later failover drops, so it is left out of the linearizability check; a
//! `request_plus` read waits for a majority and answers at or past the high of its start:
//! a majority read answered at a later point of its interval.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::failover::{choose_promotion, failover_fenced, CollectionEnds, HistoryEnd, Quorum};
use crate::map::{Copies, NodeId, PartitionId, PartitionMap};
use crate::rebalance::{build_map, new_copies, next_step, revert_map, wave_map, Look, Step};

/// Fewest copies simulated: one active and one replica.
pub const COPIES_MIN: usize = 2;
/// Most copies simulated: one active and `REPLICAS_MAX` replicas.
pub const COPIES_MAX: usize = 1 + crate::REPLICAS_MAX as usize;
/// Steps after which a client stops waiting for its operation (a write's outcome is then
/// unknown).
pub const CLIENT_TIMEOUT_STEPS: u64 = 100;
/// Most changes one pull response carries, so catching up takes several round trips.
pub const PULL_BATCH_MAX_ENTRIES: usize = 3;
/// Most changes one pull response carries to a copy still being built (production copies
/// a partition by files or a backfill of its change stream, in bulk).
pub const BUILD_BATCH_MAX_ENTRIES: usize = 30;
/// Chance in a hundred that the network drops a message, and that it duplicates one.
pub const NETWORK_DROP_PERCENT: u64 = 5;
pub const NETWORK_DUPLICATE_PERCENT: u64 = 5;
/// Chance in a hundred per step that writers pause, and that paused writers resume.
pub const WRITERS_PAUSE_PERCENT: u64 = 1;
pub const WRITERS_RESUME_PERCENT: u64 = 4;
/// An active counts a replica as healthy for a majority write this long after its last pull
/// (production's `HEALTHY_ACK_WINDOW`), and one not heard from since its term began as
/// possibly healthy this long (`UNHEARD_REPLICA_GRACE`).
pub const HEALTHY_ACK_WINDOW_STEPS: u64 = 100;
pub const UNHEARD_REPLICA_GRACE_STEPS: u64 = 50;
/// Chance in a hundred that a lagging node applies the next metadata event when it could.
pub const LAGGING_APPLY_PERCENT: u64 = 10;
/// Most changes a node's derived state applies in one step of its maintainer.
pub const DERIVED_BATCH_MAX_ENTRIES: u64 = 6;
/// A new copy counts as caught up this close to its active, in changes, and derived state
/// as ready this close to its copy (production's `CATCH_UP_SLACK`, for the simulation's
/// short logs).
pub const CATCH_UP_SLACK_ENTRIES: usize = 2;
/// Steps after the previous wave before ready partitions move without the others
/// (production's `WAVE_INTERVAL`; with one partition, never waited on).
pub const WAVE_INTERVAL_STEPS: u64 = 15;
/// Steps a leader's run of a rebalance waits for its copies before it is out of time
/// (production's `CATCH_UP_MAX`, counted afresh by each leader as there).
pub const REBALANCE_CATCH_UP_MAX_STEPS: u64 = 500;
/// Steps the leader waits for the answers to a progress round before it looks without the
/// missing ones (production's `CALL_TIMEOUT`).
pub const PROGRESS_CALL_TIMEOUT_STEPS: u64 = 40;
/// Steps the leader waits for a hand-over's source to answer before the rebalance fails
/// (production's `CALL_TIMEOUT`).
pub const HANDOVER_CALL_TIMEOUT_STEPS: u64 = 200;

/// Which protocol the simulated nodes and leader run: [`Protocol::SAFE`], or it with one or
/// more rules taken away, to show the checker catches what each rule prevents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Protocol {
    /// The leader promotes only once [`Quorum::fenced`] holds (a fence quorum of every set
    /// of the partition's quorum); without it, as soon as any replica reports.
    pub fence_quorum: bool,
    /// A read waits for a majority to confirm a round at least as new as the read.
    pub confirmed_reads: bool,
    /// The leader orders reports by [`HistoryEnd`] (epoch, then seqno); without it, by
    /// seqno alone.
    pub promote_by_history_end: bool,
    /// Majorities and fence quorums count the configured copies (replicas + 1), a failed
    /// node's slot staying vacant, or the map's copies when a build map holds more; without
    /// it, the copies in the current map, which shrink by one at every failover.
    pub majority_of_configured_copies: bool,
    /// The rebalance hands a partition over only once its derived state on the new active
    /// is caught up ([`Look::derived_ready`]); without it, the leader takes every
    /// partition's as ready.
    pub handover_waits_for_derived: bool,
    /// An active answers derived reads only from a whole view: on its log's history and at
    /// or past its serve floor; without it, from the view as it is (production before
    /// issue 40: one ready flag per index, none per partition).
    pub derived_reads_from_serve_floor: bool,
    /// A `request_plus` derived read answers only once its position is on a majority and a
    /// majority confirmed its round, as a majority read; without it, once its view reaches
    /// the high of its start (production's index scans and analytics, which pin the map
    /// version the node applied but ask no replica).
    pub confirmed_derived_reads: bool,
    /// The rebalance hands a partition over only once its new copies are caught up with,
    /// and heard by, its active, and the old active answers the hand-over only once the new
    /// active has acknowledged everything it holds; without it, neither waits.
    pub handover_waits_for_copies: bool,
    /// The old active refuses writes from the hand-over until it applies the next map;
    /// without it, it goes on taking them.
    pub handover_freezes: bool,
    /// A freeze survives a crash of its node; without it, a restart thaws it (as
    /// production's freeze, kept in memory, would).
    pub freeze_survives_crash: bool,
    /// While a partition's copies are neither those a rebalance started from nor its
    /// target (the build map, or a failover's map made from it), a majority — and a fence
    /// quorum — is one of the map's copies and of the starting copies ([`Quorum::of`]);
    /// without it, of the map's copies alone, as production counted them before: a write
    /// the old active acknowledged with a new copy is then on one copy of the two a failover
    /// leaves with one replica, and the next failover may promote the other.
    pub joint_majorities: bool,
    /// The hand-over of a wave freezes the partition's active and waits until every copy of
    /// the target holds what it has, whether the active role moves or only replicas change;
    /// without it, only until the new active does, and a wave that keeps the active commits
    /// at once (production before: a new replica up to `CATCH_UP_SLACK` behind the one the
    /// wave drops).
    pub handover_waits_for_whole_target: bool,
}

impl Protocol {
    /// Every rule.
    pub const SAFE: Protocol = Protocol {
        fence_quorum: true,
        confirmed_reads: true,
        promote_by_history_end: true,
        majority_of_configured_copies: true,
        handover_waits_for_derived: true,
        derived_reads_from_serve_floor: true,
        confirmed_derived_reads: true,
        handover_waits_for_copies: true,
        handover_freezes: true,
        freeze_survives_crash: true,
        joint_majorities: true,
        handover_waits_for_whole_target: true,
    };
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
    /// Rebalance plans committed.
    pub rebalances_started: usize,
    /// Rebalances that reached [`Step::Finish`].
    pub rebalances_finished: usize,
    /// Rebalances stopped, out of time or failed: reverted.
    pub rebalances_reverted: usize,
    /// Waves that moved the active role to another copy.
    pub handovers: usize,
    /// Times the metadata leader changed.
    pub leader_changes: usize,
    /// `request_plus` derived reads answered.
    pub derived_reads_request_plus: usize,
    /// `not_bounded` derived reads answered.
    pub derived_reads_not_bounded: usize,
}

impl std::ops::AddAssign for RunStats {
    fn add_assign(&mut self, o: RunStats) {
        self.writes_acknowledged += o.writes_acknowledged;
        self.reads_completed += o.reads_completed;
        self.promotions += o.promotions;
        self.rebalances_started += o.rebalances_started;
        self.rebalances_finished += o.rebalances_finished;
        self.rebalances_reverted += o.rebalances_reverted;
        self.handovers += o.handovers;
        self.leader_changes += o.leader_changes;
        self.derived_reads_request_plus += o.derived_reads_request_plus;
        self.derived_reads_not_bounded += o.derived_reads_not_bounded;
    }
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
    /// A rebalance's plan: the map it started from and where it goes.
    Plan {
        from: PartitionMap,
        target: PartitionMap,
    },
    /// An operator asks the rebalance under way to stop.
    Stop,
    /// The plan leaves the log (finished, stopped or failed).
    PlanEnd,
}

/// What a node answers the leader's progress request (production's `ProgressAnswer`).
#[derive(Clone, Debug)]
struct Progress {
    map_version: u64,
    /// The copy's length and history; `None` when it holds no copy in its map or the copy
    /// is still being built (production's `without_building`).
    position: Option<(usize, u64)>,
    /// The replicas it hears (they pulled on its current history), if active.
    heard: Vec<NodeId>,
    /// Its derived state is off the copy's history or more than the slack behind it.
    derived_behind: bool,
}

#[derive(Clone, Debug)]
enum Msg {
    /// Replica to active: "send me what follows my history"; acknowledges the shared prefix
    /// and the read round echoed.
    Pull {
        from: NodeId,
        to: NodeId,
        log: Vec<Entry>,
        echo_round: u64,
    },
    /// Active to replica: the changes after `prev` (which must match the replica's).
    /// `high`: the active's log length when it answered (a new copy is built once it holds
    /// that much); `history`: the active's.
    Changes {
        from: NodeId,
        to: NodeId,
        prev: usize,
        prev_entry: Option<Entry>,
        entries: Vec<Entry>,
        round: u64,
        high: usize,
        history: u64,
    },
    /// Replica to leader, after applying "`failed` is Failed".
    Report {
        from: NodeId,
        failed: NodeId,
        end: HistoryEnd,
    },
    /// Leader (of `term`) to node: "how far are your copy and its derived state?"
    ProgressAsk {
        term: u64,
        round: u64,
        to: NodeId,
    },
    ProgressAnswer {
        term: u64,
        round: u64,
        from: NodeId,
        progress: Progress,
    },
    /// Leader to the active of a partition the plan at `plan` in the log hands over (its
    /// role moves, or only its replicas change), under the map of `map_version`: freeze,
    /// and answer once every copy of the target (`holders`) holds everything you have.
    /// `call` names the request, as a connection does in production (an answer to an
    /// earlier request, delayed, is not taken for this one's).
    Handover {
        call: u64,
        plan: usize,
        to: NodeId,
        holders: Vec<NodeId>,
        map_version: u64,
    },
    HandedOver {
        call: u64,
        from: NodeId,
    },
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
    Write {
        value: u64,
        acked_at: Option<(NodeId, u64, usize)>,
    },
    Read {
        result: Option<u64>,
    },
    /// A read of the active's derived state; `at`: the view's position it answered at and
    /// the answering copy's history (the map version it became active at).
    DerivedRead {
        request_plus: bool,
        result: Option<u64>,
        at: Option<(usize, u64)>,
    },
}

struct PendingRead {
    op: usize,
    high: usize,
    round: u64,
}

struct PendingDerivedRead {
    op: usize,
    request_plus: bool,
    high: usize,
    round: u64,
}

/// An active's side of a hand-over.
#[derive(Clone, Debug)]
struct Freeze {
    /// The copies of the target that must hold everything before it answers.
    holders: Vec<NodeId>,
    /// The step it began: only an acknowledgement of a round after it counts.
    round: u64,
    /// The request to answer.
    call: u64,
    answered: bool,
}

/// A plan as a node applied it: its place in the log, the copies it started from and its
/// target.
#[derive(Clone, Debug)]
struct AppliedPlan {
    id: usize,
    from: Copies,
    target: Copies,
}

/// The plan in the leader's log.
struct PlanInLog {
    id: usize,
    from: PartitionMap,
    target: PartitionMap,
    stop_asked: bool,
}

struct Node {
    id: NodeId,
    up: bool,
    log: Vec<Entry>,
    applied: usize,
    map: PartitionMap,
    failed: BTreeSet<NodeId>,
    /// The history the copy is on: the map version its active became active at.
    history: u64,
    /// The log's length when the copy became active or restarted.
    serve_floor: usize,
    /// The derived view: a prefix of the log once caught up, behind it or on a history the
    /// log parted from otherwise.
    derived: Vec<Entry>,
    /// The plan in the metadata this node applied, if any.
    plan: Option<AppliedPlan>,
    frozen: Option<Freeze>,
    // Volatile, as active.
    /// The step this term as active began (the last change of map, or restart).
    active_since: u64,
    /// The step each replica pulled last.
    heard_at: BTreeMap<NodeId, u64>,
    matched: BTreeMap<NodeId, usize>,
    confirmed: BTreeMap<NodeId, u64>,
    writes: Vec<(usize, usize)>,
    reads: Vec<PendingRead>,
    derived_reads: Vec<PendingDerivedRead>,
    // Volatile, as replica.
    seen_round: BTreeMap<NodeId, u64>,
    /// A copy a rebalance added is built once it caught up with its active; before, it is
    /// never fenced nor promoted, and reports no position (production's `without_building`).
    built: bool,
}

impl Node {
    fn new(id: NodeId, map: PartitionMap, applied: usize, failed: BTreeSet<NodeId>, built: bool) -> Node {
        Node {
            id,
            up: true,
            log: Vec::new(),
            applied,
            history: map.version,
            map,
            failed,
            serve_floor: 0,
            derived: Vec::new(),
            plan: None,
            frozen: None,
            active_since: 0,
            heard_at: BTreeMap::new(),
            matched: BTreeMap::new(),
            confirmed: BTreeMap::new(),
            writes: Vec::new(),
            reads: Vec::new(),
            derived_reads: Vec::new(),
            seen_round: BTreeMap::new(),
            built,
        }
    }

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

    /// The derived view is a prefix of the log.
    fn derived_on_history(&self) -> bool {
        self.log.get(..self.derived.len()).is_some_and(|l| l == self.derived.as_slice())
    }
}

/// A majority as an active counts it: production's [`Quorum`] (the map's copies, and in a
/// joint configuration both the plan's sets), this copy counting for itself.
struct ActiveQuorum {
    id: NodeId,
    quorum: Quorum,
}

impl ActiveQuorum {
    /// Whether the replicas for which `holds` is true make a majority with this copy.
    fn met(&self, holds: &dyn Fn(NodeId) -> bool) -> bool {
        self.quorum.met(&|n| n == self.id || holds(n))
    }
}

/// The leader's run of the rebalance in the log: volatile, lost at a leader change.
struct RebalanceRun {
    /// The map this run committed last (or found).
    map: PartitionMap,
    new_copies: Vec<(PartitionId, NodeId)>,
    started: u64,
    last_wave: u64,
    /// The progress round asked last, when, and the answers to it.
    round: u64,
    round_sent: u64,
    answers: BTreeMap<NodeId, Progress>,
    handover: Option<PendingHandover>,
}

#[derive(Clone, Debug)]
struct PendingHandover {
    call: u64,
    source: NodeId,
    holders: Vec<NodeId>,
    ready: Vec<PartitionId>,
    map_version: u64,
    sent: u64,
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
    /// The metadata leader's term; answers to an earlier term's requests are ignored.
    term: u64,
    /// The last hand-over request's name.
    next_call: u64,
    rebalance: Option<RebalanceRun>,
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
    let nodes = (1..=config.copies as u64).map(|i| Node::new(NodeId(i), map.clone(), 1, BTreeSet::new(), true)).collect();
    let mut sim = Sim {
        seed,
        config: *config,
        rng: SplitMix64(seed),
        tick: 0,
        nodes,
        meta: vec![MetaEvent::Map(map)],
        failing: None,
        reports: BTreeMap::new(),
        term: 1,
        next_call: 0,
        rebalance: None,
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

    fn commit(&mut self, event: MetaEvent) {
        self.trace(|| format!("leader commits {event:?}"));
        self.meta.push(event);
    }

    fn step(&mut self) {
        let toggle = if self.writers_paused { WRITERS_RESUME_PERCENT } else { WRITERS_PAUSE_PERCENT };
        if self.rng.percent(toggle) {
            self.writers_paused = !self.writers_paused;
        }
        match self.rng.below(100) {
            0..33 => self.deliver(),
            33..47 => {
                let i = self.random_node();
                self.pull(i);
            }
            47..56 => {
                let i = self.random_node();
                self.apply_next_meta(i);
            }
            56..64 if !self.writers_paused => self.client_write(),
            56..69 => self.client_read(),
            69..73 => {
                let request_plus = self.rng.percent(50);
                self.client_derived_read(request_plus);
            }
            73..78 => self.maintain_derived(),
            78..81 => {
                let i = self.random_node();
                self.report(i);
            }
            81 if self.rng.percent(50) => self.start_failover(),
            81 => {}
            82 => self.start_rebalance(),
            83..89 => self.rebalance_tick(),
            89 => match self.rng.below(40) {
                0..12 => self.change_leader(),
                12 => self.ask_stop(),
                _ => {}
            },
            90..92 => {
                let i = self.random_node();
                self.crash(i);
            }
            92..98 => {
                let i = self.random_node();
                self.restart(i);
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
            Msg::Changes { from, to, prev, prev_entry, entries, round, high, history } => {
                self.on_changes(from, to, prev, prev_entry, &entries, round, history);
                let node = &mut self.nodes[(to.0 - 1) as usize];
                if node.leader_to_follow() == Some(from) && node.log.len() >= high && node.log.len() == prev + entries.len() {
                    node.built = true;
                }
            }
            Msg::Report { from, failed, end } => self.on_report(from, failed, end),
            Msg::ProgressAsk { term, round, to } => self.on_progress_ask(term, round, to),
            Msg::ProgressAnswer { term, round, from, progress } => {
                if let Some(run) = self.rebalance.as_mut().filter(|r| term == self.term && r.round == round) {
                    run.answers.insert(from, progress);
                }
            }
            Msg::Handover { call, plan, to, holders, map_version } => self.on_handover(call, plan, to, holders, map_version),
            Msg::HandedOver { call, from } => self.on_handed_over(call, from),
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
        let from_built = self.nodes[self.node_index(from)].built;
        let node = &mut self.nodes[i];
        if !node.up || !node.is_active() || !node.copies().replicas.contains(&from) {
            return;
        }
        let shared = node.log.iter().zip(log).take_while(|(a, b)| a == b).count();
        node.heard_at.insert(from, tick);
        let matched = node.matched.entry(from).or_insert(0);
        *matched = (*matched).max(shared);
        let confirmed = node.confirmed.entry(from).or_insert(0);
        *confirmed = (*confirmed).max(echo_round);
        let batch = if from_built { PULL_BATCH_MAX_ENTRIES } else { BUILD_BATCH_MAX_ENTRIES };
        let end = node.log.len().min(shared + batch);
        let msg = Msg::Changes {
            from: to,
            to: from,
            prev: shared,
            prev_entry: shared.checked_sub(1).map(|p| node.log[p]),
            entries: node.log[shared..end].to_vec(),
            round: tick,
            high: node.log.len(),
            history: node.history,
        };
        self.send(msg);
        self.complete_operations(i);
        self.answer_handover(i);
    }

    #[allow(clippy::too_many_arguments)]
    fn on_changes(
        &mut self,
        from: NodeId,
        to: NodeId,
        prev: usize,
        prev_entry: Option<Entry>,
        entries: &[Entry],
        round: u64,
        history: u64,
    ) {
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
        node.history = history;
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
        let role_event = matches!(event, MetaEvent::Failed(_) | MetaEvent::Map(_));
        let at = node.applied - 1;
        match event {
            MetaEvent::Failed(f) => {
                node.failed.insert(f);
            }
            MetaEvent::Map(map) => {
                node.map = map;
                node.frozen = None;
            }
            MetaEvent::Plan { from, target } => {
                node.plan = Some(AppliedPlan { id: at, from: from.partitions[0].clone(), target: target.partitions[0].clone() });
            }
            MetaEvent::Stop => {}
            MetaEvent::PlanEnd => {
                node.plan = None;
                node.frozen = None;
            }
        }
        if !was_active && node.is_active() {
            // A new history at the copy's high seqno, which derived state must reach
            // before it serves.
            node.history = node.map.version;
            node.serve_floor = node.log.len();
            node.built = true;
        }
        if role_event && (was_active || node.is_active()) {
            // A new term as active starts with nothing counted; a lost one ends its pending
            // operations (the client hears an error: a write's outcome is unknown).
            self.drop_active_state(i);
        }
        // A fenced replica reports at once (and again now and then, the network being lossy).
        self.report(i);
    }

    fn drop_active_state(&mut self, i: usize) {
        let tick = self.tick;
        let node = &mut self.nodes[i];
        node.active_since = tick;
        node.heard_at.clear();
        node.matched.clear();
        node.confirmed.clear();
        let writes = std::mem::take(&mut node.writes);
        let reads: Vec<usize> = std::mem::take(&mut node.reads).into_iter().map(|r| r.op).collect();
        let derived: Vec<usize> = std::mem::take(&mut node.derived_reads).into_iter().map(|r| r.op).collect();
        for op in writes.into_iter().map(|(op, _)| op).chain(reads).chain(derived) {
            if self.ops[op].outcome == Outcome::Pending {
                self.ops[op].outcome = Outcome::Unknown;
            }
        }
    }

    fn crash(&mut self, i: usize) {
        if !self.nodes[i].up {
            return;
        }
        self.drop_active_state(i);
        self.trace(|| format!("n{} crashes", i + 1));
        let thaws = !self.config.protocol.freeze_survives_crash;
        let node = &mut self.nodes[i];
        node.up = false;
        node.seen_round.clear();
        if thaws {
            node.frozen = None;
        }
    }

    fn restart(&mut self, i: usize) {
        let tick = self.tick;
        let node = &mut self.nodes[i];
        if node.up {
            return;
        }
        node.up = true;
        node.active_since = tick;
        // Every way a copy comes to serve opens it anew, at its high seqno.
        node.serve_floor = node.log.len();
        self.trace(|| format!("n{} restarts", i + 1));
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

    /// The partition's quorum by the leader's log: its map, and the plan while one runs.
    fn leader_quorum(&self) -> Quorum {
        let copies = self.leader_map().partitions[0].clone();
        let plan = self.plan().filter(|_| self.config.protocol.joint_majorities);
        let plan = plan.as_ref().map(|p| (&p.from.partitions[0], &p.target.partitions[0]));
        Quorum::of(&copies, self.copies_counted(&copies), plan, self.config.copies)
    }

    /// What a majority is for node `i` as active.
    fn quorum(&self, i: usize) -> ActiveQuorum {
        let node = &self.nodes[i];
        let copies = node.copies().clone();
        let plan = node.plan.as_ref().filter(|_| self.config.protocol.joint_majorities).map(|p| (&p.from, &p.target));
        ActiveQuorum { id: node.id, quorum: Quorum::of(&copies, self.copies_counted(&copies), plan, self.config.copies) }
    }

    /// The `n` of majorities and fence quorums for a partition with `copies`: production's
    /// [`crate::copies_counted`] (every node ever started is a data node: failed ones count
    /// there, and the simulation has at least `copies` of them).
    fn copies_counted(&self, copies: &Copies) -> usize {
        if self.config.protocol.majority_of_configured_copies {
            let replicas = u8::try_from(self.config.copies - 1).unwrap_or(crate::REPLICAS_MAX);
            crate::copies_counted(replicas, self.nodes.len(), copies)
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
                _ => None,
            })
            .expect("the log starts with a map")
    }

    /// The plan in the log, if any.
    fn plan(&self) -> Option<PlanInLog> {
        let mut plan = None;
        for (at, e) in self.meta.iter().enumerate() {
            match e {
                MetaEvent::Plan { .. } => plan = Some((at, false)),
                MetaEvent::Stop => {
                    if let Some(p) = &mut plan {
                        p.1 = true;
                    }
                }
                MetaEvent::PlanEnd => plan = None,
                MetaEvent::Failed(_) | MetaEvent::Map(_) => {}
            }
        }
        let (id, stop_asked) = plan?;
        let MetaEvent::Plan { from, target } = &self.meta[id] else { unreachable!("a plan's place holds a plan") };
        Some(PlanInLog { id, from: from.clone(), target: target.clone(), stop_asked })
    }

    fn failed_in_log(&self) -> BTreeSet<NodeId> {
        self.meta
            .iter()
            .filter_map(|e| match e {
                MetaEvent::Failed(f) => Some(*f),
                _ => None,
            })
            .collect()
    }

    fn start_failover(&mut self) {
        // A hand-over under way holds the failover lock.
        if self.rebalance.as_ref().is_some_and(|r| r.handover.is_some()) {
            return;
        }
        let copies = &self.leader_map().partitions[0];
        // A failover that could not reach its fence quorum (the slot of an earlier one still
        // vacant, a copy still being built, which never reports) would leave the partition
        // unavailable, possibly for the rest of the run: the oracle does not start one.
        let failed = copies.active;
        let built = |n: NodeId| copies.replicas.contains(&n) && self.nodes[self.node_index(n)].built;
        if self.failing.is_some() || !self.leader_quorum().fenced(failed, &built) {
            return;
        }
        self.failing = Some(failed);
        self.reports.clear();
        self.commit(MetaEvent::Failed(failed));
    }

    fn on_report(&mut self, from: NodeId, failed: NodeId, end: HistoryEnd) {
        if self.failing != Some(failed) || !self.leader_map().partitions[0].replicas.contains(&from) {
            return;
        }
        self.reports.insert(from, end);
        let map = self.leader_map().clone();
        let protocol = self.config.protocol;
        // Production's rule: `Quorum::fenced` of the partition's quorum as the leader's log
        // has it (with the plan's starting copies while a rebalance holds the partition
        // between its sets).
        let ready = !protocol.fence_quorum || self.leader_quorum().fenced(failed, &|n| self.reports.contains_key(&n));
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
        self.trace(|| format!("failover promotes by reports {reports:?}"));
        self.commit(MetaEvent::Map(plan.map));
        self.failing = None;
        self.reports.clear();
    }

    /// The leader starts a rebalance (production's `rebalance::start`): a new copy in the
    /// slot a failover left vacant (a new node id; a failed node never comes back), or, with
    /// every slot filled, a new node taking the active role (the old active leaving, or
    /// staying as a replica in place of another) or an existing replica taking it. The plan
    /// goes into the log first; the run starts at once.
    fn start_rebalance(&mut self) {
        if self.failing.is_some() || self.plan().is_some() {
            return;
        }
        let from = self.leader_map().clone();
        let copies = from.partitions[0].clone();
        let new = NodeId(self.nodes.len() as u64 + 1);
        let mut replicas = copies.replicas.clone();
        let target = if copies.nodes().count() < self.config.copies {
            replicas.push(new);
            Copies { active: copies.active, replicas }
        } else {
            // The build map holds the new copy besides the old ones.
            let room = replicas.len() < usize::from(crate::REPLICAS_MAX);
            match self.rng.below(4) {
                0 if room => Copies { active: new, replicas },
                3 if room && !replicas.is_empty() => {
                    // The active stays; a replica's slot goes to a new node.
                    replicas.remove(self.rng.below(replicas.len() as u64) as usize);
                    replicas.push(new);
                    Copies { active: copies.active, replicas }
                }
                1 if room && !replicas.is_empty() => {
                    replicas.remove(self.rng.below(replicas.len() as u64) as usize);
                    replicas.insert(0, copies.active);
                    Copies { active: new, replicas }
                }
                _ if !replicas.is_empty() => {
                    let to = replicas.remove(self.rng.below(replicas.len() as u64) as usize);
                    replicas.insert(0, copies.active);
                    Copies { active: to, replicas }
                }
                _ => return,
            }
        };
        let target = PartitionMap { version: 0, partitions: vec![target] };
        debug_assert!(target.check().is_ok());
        let id = self.meta.len();
        self.commit(MetaEvent::Plan { from: from.clone(), target: target.clone() });
        self.stats.rebalances_started += 1;
        if target.partitions[0].holds(new) {
            // The new member joins with the metadata as it is now.
            let failed = self.failed_in_log();
            let mut node = Node::new(new, from.clone(), self.meta.len(), failed, false);
            node.plan = Some(AppliedPlan { id, from: from.partitions[0].clone(), target: target.partitions[0].clone() });
            self.nodes.push(node);
        }
        self.rebalance = None;
        self.rebalance_tick();
    }

    /// One turn of the leader's rebalance loop (production's `rebalance::run`): resume the
    /// plan in the log, or chase an outstanding hand-over, or look at the last round of
    /// progress answers and carry out the stage machine's next step.
    fn rebalance_tick(&mut self) {
        let Some(PlanInLog { id: plan, from, target, stop_asked }) = self.plan() else {
            self.rebalance = None;
            return;
        };
        // A failover under way holds the lock.
        if self.failing.is_some() {
            return;
        }
        let failed = self.failed_in_log();
        let target_failed = target.nodes().iter().any(|n| failed.contains(n));
        let Some(run) = &self.rebalance else {
            if target_failed {
                self.end_rebalance("a node of its target failed");
                return;
            }
            // Build: every new copy joins as a replica (a resumed plan finds them there).
            let current = self.leader_map().clone();
            let build = build_map(&current, &target);
            if build.partitions != current.partitions {
                self.commit(MetaEvent::Map(build.clone()));
            }
            let new_copies = new_copies(&from, &target).expect("a plan's maps have one partition each");
            let tick = self.tick;
            self.rebalance = Some(RebalanceRun {
                map: build,
                new_copies,
                started: tick,
                last_wave: tick,
                round: 0,
                round_sent: tick,
                answers: BTreeMap::new(),
                handover: None,
            });
            self.poll_progress();
            return;
        };
        if let Some(h) = run.handover.clone() {
            if self.tick > h.sent + HANDOVER_CALL_TIMEOUT_STEPS {
                self.end_rebalance("the hand-over's source did not answer");
            } else {
                // A lost request or answer: ask again (the source answers again).
                self.send(Msg::Handover { call: h.call, plan, to: h.source, holders: h.holders.clone(), map_version: h.map_version });
            }
            return;
        }
        // Every holder's answer, or the calls' timeout (production's `join_all`).
        if run.answers.len() < run.map.nodes().len() && self.tick < run.round_sent + PROGRESS_CALL_TIMEOUT_STEPS {
            return;
        }
        if !stop_asked && (target_failed || self.leader_map() != &run.map) {
            self.end_rebalance("the map changed under it, or a node of its target failed");
            return;
        }
        let (step, seen) = self.next_step(run, &target, stop_asked);
        let (source, map_version) = (run.map.partitions[0].active, run.map.version);
        self.trace(|| format!("leader's rebalance step: {step:?} ({seen})"));
        match step {
            Step::Wait => {}
            Step::HandOver(ready) => {
                // Every wave, whether the role moves or only replicas change: the source
                // freezes until the whole target holds what it has.
                let new_active = target.partitions[0].active;
                let holders: Vec<NodeId> = if self.config.protocol.handover_waits_for_whole_target {
                    target.partitions[0].nodes().filter(|n| *n != source).collect()
                } else if new_active != source {
                    vec![new_active]
                } else {
                    self.commit_wave(&target, &ready);
                    self.poll_progress();
                    return;
                };
                self.next_call += 1;
                let h = PendingHandover { call: self.next_call, source, holders, ready, map_version, sent: self.tick };
                self.send(Msg::Handover { call: h.call, plan, to: h.source, holders: h.holders.clone(), map_version: h.map_version });
                if let Some(run) = &mut self.rebalance {
                    run.handover = Some(h);
                }
                return;
            }
            Step::Finish => {
                self.commit(MetaEvent::PlanEnd);
                self.rebalance = None;
                self.stats.rebalances_finished += 1;
                return;
            }
            Step::Revert | Step::OutOfTime { .. } => {
                self.end_rebalance("stopped or out of time");
                return;
            }
        }
        self.poll_progress();
    }

    /// The stage machine's next step at one look: what the leader learnt from the answers
    /// to its last progress round, as production's `run` reads them; and what it saw.
    fn next_step(&self, run: &RebalanceRun, target: &PartitionMap, stop_asked: bool) -> (Step, String) {
        let protocol = self.config.protocol;
        let mut caught_up = BTreeSet::new();
        let mut heard = BTreeSet::new();
        let mut derived_ready = BTreeSet::new();
        // A stop asks nobody.
        if !stop_asked {
            // An answer under an older map says nothing of copies (production's `under_map`).
            let answer = |n: NodeId| run.answers.get(&n).filter(|a| a.map_version >= run.map.version);
            let active = run.map.partitions[0].active;
            for &(p, n) in &run.new_copies {
                // Against the partition's active now, on its history.
                if let (Some((have, on)), Some((want, active_on))) =
                    (answer(n).and_then(|a| a.position), answer(active).and_then(|a| a.position))
                {
                    if on == active_on && have + CATCH_UP_SLACK_ENTRIES >= want {
                        caught_up.insert((p, n));
                    }
                }
                if n == active || answer(active).is_some_and(|a| a.heard.contains(&n)) {
                    heard.insert((p, n));
                }
            }
            if answer(target.partitions[0].active).is_some_and(|a| a.position.is_some() && !a.derived_behind) {
                derived_ready.insert(0);
            }
            if !protocol.handover_waits_for_copies {
                caught_up = run.new_copies.iter().copied().collect();
                heard = caught_up.clone();
            }
            if !protocol.handover_waits_for_derived {
                derived_ready.insert(0);
            }
        }
        let look = Look {
            stop_asked,
            map: &run.map,
            target,
            new_copies: &run.new_copies,
            caught_up: &caught_up,
            heard: &heard,
            derived_ready: &derived_ready,
            since_wave: Duration::from_secs(self.tick - run.last_wave),
            out_of_time: self.tick >= run.started + REBALANCE_CATCH_UP_MAX_STEPS,
        };
        let seen =
            format!("answers from {:?}: caught up {caught_up:?}, heard {heard:?}, derived ready {derived_ready:?}", run.answers.keys());
        (next_step(&look, Duration::from_secs(WAVE_INTERVAL_STEPS)), seen)
    }

    fn commit_wave(&mut self, target: &PartitionMap, ready: &[PartitionId]) {
        let version = self.leader_map().version + 1;
        let Some(run) = &mut self.rebalance else { return };
        let next = wave_map(&run.map, target, ready, version);
        run.map = next.clone();
        run.last_wave = self.tick;
        run.handover = None;
        self.commit(MetaEvent::Map(next));
    }

    /// A stop or a failure: each partition already at its target stays, the others go back
    /// to the copies they had ([`revert_map`]); the plan leaves the log.
    fn end_rebalance(&mut self, why: &str) {
        self.trace(|| format!("the rebalance ends: {why}"));
        self.rebalance = None;
        let Some(PlanInLog { from, target, .. }) = self.plan() else { return };
        let current = self.leader_map().clone();
        if let Some(back) = revert_map(&current, &from, &target) {
            self.commit(MetaEvent::Map(back));
        }
        self.commit(MetaEvent::PlanEnd);
        self.stats.rebalances_reverted += 1;
    }

    fn poll_progress(&mut self) {
        let term = self.term;
        let Some(run) = &mut self.rebalance else { return };
        run.round += 1;
        run.round_sent = self.tick;
        run.answers.clear();
        let round = run.round;
        for to in run.map.nodes() {
            self.send(Msg::ProgressAsk { term, round, to });
        }
    }

    fn on_progress_ask(&mut self, term: u64, round: u64, to: NodeId) {
        let node = &self.nodes[self.node_index(to)];
        if !node.up {
            return;
        }
        let position = (node.copies().holds(node.id) && node.built).then_some((node.log.len(), node.history));
        let heard = if node.is_active() { node.matched.keys().copied().collect() } else { Vec::new() };
        let derived_behind = !node.derived_on_history() || node.derived.len() + CATCH_UP_SLACK_ENTRIES < node.log.len();
        let progress = Progress { map_version: node.map.version, position, heard, derived_behind };
        self.send(Msg::ProgressAnswer { term, round, from: to, progress });
    }

    /// The old active's side of a hand-over (production's `serve_handover`): under the map
    /// the leader asks for, with the plan it asks for applied (a freeze thaws when the plan
    /// leaves the log), it freezes and answers once the new active holds everything it has.
    fn on_handover(&mut self, call: u64, plan: usize, to: NodeId, holders: Vec<NodeId>, map_version: u64) {
        let tick = self.tick;
        let i = self.node_index(to);
        let node = &mut self.nodes[i];
        if !node.up || !node.is_active() || node.map.version != map_version || node.plan.as_ref().is_none_or(|p| p.id != plan) {
            return;
        }
        // Frozen already (a request sent again, or by another leader): writes were refused
        // since then, so the freeze's first round still counts.
        let round = node.frozen.as_ref().map_or(tick, |f| f.round);
        node.frozen = Some(Freeze { holders, round, call, answered: false });
        self.answer_handover(i);
    }

    fn answer_handover(&mut self, i: usize) {
        let waits = self.config.protocol.handover_waits_for_copies;
        let node = &mut self.nodes[i];
        let active = node.is_active();
        let Some(f) = &mut node.frozen else { return };
        if f.answered || !active {
            return;
        }
        let (matched, confirmed, len) = (&node.matched, &node.confirmed, node.log.len());
        let holds_all =
            f.holders.iter().all(|h| matched.get(h).is_some_and(|m| *m >= len) && confirmed.get(h).is_some_and(|c| *c >= f.round));
        if waits && !holds_all {
            return;
        }
        f.answered = true;
        let msg = Msg::HandedOver { call: f.call, from: node.id };
        self.send(msg);
    }

    fn on_handed_over(&mut self, call: u64, from: NodeId) {
        let Some(run) = &self.rebalance else { return };
        let Some(h) = &run.handover else { return };
        if h.call != call || h.source != from || self.leader_map() != &run.map {
            return;
        }
        debug_assert!(self.failing.is_none(), "a hand-over and a failover exclude each other");
        let ready = h.ready.clone();
        let Some(PlanInLog { target, .. }) = self.plan() else { return };
        self.commit_wave(&target, &ready);
        self.stats.handovers += 1;
        self.poll_progress();
    }

    /// The metadata leader changes: the next one knows only the log.
    fn change_leader(&mut self) {
        self.term += 1;
        self.rebalance = None;
        self.stats.leader_changes += 1;
        self.trace(|| "the metadata leader changes".to_string());
    }

    fn ask_stop(&mut self) {
        if self.plan().is_some_and(|p| !p.stop_asked) {
            self.commit(MetaEvent::Stop);
        }
    }

    /// Every node's derived state applies a few more changes of its log, or first rolls
    /// back to where the log parted from it.
    fn maintain_derived(&mut self) {
        for i in 0..self.nodes.len() {
            let batch = self.rng.below(DERIVED_BATCH_MAX_ENTRIES + 1) as usize;
            let node = &mut self.nodes[i];
            if !node.up {
                continue;
            }
            let shared = node.derived.iter().zip(&node.log).take_while(|(a, b)| a == b).count();
            if shared < node.derived.len() {
                node.derived.truncate(shared);
            } else {
                let end = node.log.len().min(shared + batch);
                let more = node.log[shared..end].to_vec();
                node.derived.extend(more);
            }
            if node.is_active() && !node.derived_reads.is_empty() {
                self.complete_operations(i);
            }
        }
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
        let freezes = self.config.protocol.handover_freezes;
        let tick = self.tick;
        let quorum = self.quorum(i);
        let node = &mut self.nodes[i];
        // Production's `majority_possible`: refused, unwritten, unless enough replicas were
        // heard from lately — or not yet since this term began, within a grace — to make a
        // majority.
        let possible = quorum.met(&|r| match node.heard_at.get(&r) {
            Some(at) => at + HEALTHY_ACK_WINDOW_STEPS >= tick,
            None => tick < node.active_since + UNHEARD_REPLICA_GRACE_STEPS,
        });
        let accepted = node.up && node.is_active() && !(freezes && node.frozen.is_some()) && possible;
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

    fn client_derived_read(&mut self, request_plus: bool) {
        let i = self.client_target();
        let op = self.ops.len();
        let node = &mut self.nodes[i];
        let accepted = node.up && node.is_active();
        self.ops.push(ClientOp {
            kind: OpKind::DerivedRead { request_plus, result: None, at: None },
            invoke: self.tick,
            complete: None,
            outcome: if accepted { Outcome::Pending } else { Outcome::Refused },
        });
        self.trace(|| format!("client reads derived state (request_plus {request_plus}) op {op} at n{} (accepted {accepted})", i + 1));
        let node = &mut self.nodes[i];
        if accepted {
            node.derived_reads.push(PendingDerivedRead { op, request_plus, high: node.log.len(), round: self.tick });
            self.complete_operations(i);
        }
    }

    /// Acknowledges the writes now on a majority and answers the reads now confirmed.
    fn complete_operations(&mut self, i: usize) {
        let protocol = self.config.protocol;
        let unconfirmed_reads = !protocol.confirmed_reads;
        let confirmed_derived = protocol.confirmed_derived_reads;
        let tick = self.tick;
        let quorum = self.quorum(i);
        let node = &mut self.nodes[i];
        let id = node.id;
        let held = |seqno: usize| quorum.met(&|r| node.matched.get(&r).is_some_and(|m| *m >= seqno));
        let confirmed = |round: u64| quorum.met(&|r| node.confirmed.get(&r).is_some_and(|c| *c >= round));
        let (done, waiting): (Vec<_>, Vec<_>) = node.writes.iter().partition(|(_, seqno)| held(*seqno));
        let (answered, unanswered): (Vec<_>, Vec<_>) =
            std::mem::take(&mut node.reads).into_iter().partition(|r| held(r.high) && (unconfirmed_reads || confirmed(r.round)));
        // Derived reads: from a whole view only; `request_plus` ones once it reaches the
        // read's high and, like a majority read, once its position is on a majority and a
        // majority confirmed the read's round.
        let at = node.derived.len();
        let whole = !protocol.derived_reads_from_serve_floor
            || (node.log.get(..at).is_some_and(|l| l == node.derived.as_slice()) && at >= node.serve_floor);
        let (derived_answered, derived_waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut node.derived_reads).into_iter().partition(|r| {
            whole && (!r.request_plus || (at >= r.high && (!confirmed_derived || (held(at) && (unconfirmed_reads || confirmed(r.round))))))
        });
        node.writes = waiting;
        node.reads = unanswered;
        node.derived_reads = derived_waiting;
        let derived_answer = (node.derived.last().map(|e| e.value), (at, node.history));
        // A write is acknowledged at the epoch it was sequenced in (a map that only adds a
        // copy raises the version under the same active).
        let epochs: Vec<u64> = done.iter().map(|(_, seqno)| node.log[seqno - 1].epoch).collect();
        let result_at = |high: usize| high.checked_sub(1).map(|p| node.log[p].value);
        let answers: Vec<(usize, Option<u64>)> = answered.iter().map(|r| (r.op, result_at(r.high))).collect();
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
        for r in derived_answered {
            let op = &mut self.ops[r.op];
            if op.outcome == Outcome::Pending {
                op.outcome = Outcome::Ok;
                op.complete = Some(tick);
                op.kind = OpKind::DerivedRead { request_plus: r.request_plus, result: derived_answer.0, at: Some(derived_answer.1) };
                if r.request_plus {
                    self.stats.derived_reads_request_plus += 1;
                } else {
                    self.stats.derived_reads_not_bounded += 1;
                }
                if let Some(trace) = &mut self.trace {
                    trace.push(format!("{tick:>4} {id} answers derived read {op:?}"));
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
    // Every acknowledged write: (completed, epoch, seqno).
    let mut acknowledged: Vec<(u64, u64, usize)> = Vec::new();
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
                acknowledged.push((op.complete.expect("acknowledged writes have a completion"), epoch, seqno));
            }
            (Outcome::Refused, _) if position.contains_key(&value) => {
                return Err(("refused write applied", format!("write {value} was refused but is in the final history")));
            }
            _ => {}
        }
    }

    // (c) No short derived read: a copy that became active at map version `at_epoch`
    // answers with every write acknowledged, before the read began, at an earlier epoch.
    for op in ops {
        let OpKind::DerivedRead { request_plus, result, at: Some((at, at_epoch)) } = op.kind else { continue };
        if op.outcome != Outcome::Ok {
            continue;
        }
        let missed = acknowledged
            .iter()
            .filter(|(complete, epoch, seqno)| *complete < op.invoke && *epoch < at_epoch && *seqno > at)
            .max_by_key(|w| w.2);
        if let Some((complete, epoch, seqno)) = missed {
            return Err((
                "short derived read",
                format!(
                    "a derived read (request_plus {request_plus}, invoked {}, completed {:?}) of the copy active since epoch {at_epoch} \
                     answered {result:?} at position {at}, short of the write at seqno {seqno} acknowledged at epoch {epoch} at {complete}",
                    op.invoke, op.complete
                ),
            ));
        }
    }

    // (d) Linearizability, with the final history as the order of writes. Cluster k holds
    // the write at seqno k (cluster 0: the initial empty register) and the reads that
    // returned it; clusters are linearized in order, each write before its reads, every
    // operation at the earliest point its interval and the order allow. Greedy earliest
    // points are optimal for a fixed order, so a failure means no linearization exists.
    // Majority reads and `request_plus` derived reads are checked; `not_bounded` ones may
    // answer a change no majority holds yet.
    let mut clusters: Vec<(Option<&ClientOp>, Vec<&ClientOp>)> = (0..=history.len()).map(|_| (None, Vec::new())).collect();
    for op in ops {
        let result = match op.kind {
            OpKind::Write { value, .. } => {
                if let Some(p) = position.get(&value) {
                    clusters[p + 1].0 = Some(op);
                }
                continue;
            }
            OpKind::Read { result } | OpKind::DerivedRead { request_plus: true, result, .. } if op.outcome == Outcome::Ok => result,
            OpKind::Read { .. } | OpKind::DerivedRead { .. } => continue,
        };
        let k = match result {
            None => 0,
            Some(v) => match position.get(&v) {
                Some(p) => p + 1,
                None => return Err(("read of a value not in the final history", format!("a read at {} returned {v}: {op:?}", op.invoke))),
            },
        };
        clusters[k].1.push(op);
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
                        "read {:?} (invoked {}, completed {complete}) returned seqno {k}'s value, older than an operation invoked at {at}",
                        r.kind, r.invoke
                    ),
                ));
            }
            point = point.max(at);
        }
    }
    Ok(())
}
