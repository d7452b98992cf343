//! Health, leases and failover.
//!
//! **Leases.** A node serves its active copies only while it holds a lease, one of:
//! - *leading*: it is the metadata leader, openraft saw a quorum acknowledge it within
//!   `LEASE`, and a quorum of voters answered pings it sent within `LEASE` as *their*
//!   leader's. The pings' quorum holds even when openraft's metrics are stale (a paused
//!   process reads the last report on resuming); openraft's holds off a leader whose pings
//!   are answered but whose log is not.
//! - *granted*: the leader it follows, while leading, granted it a lease in a ping. The
//!   lease runs `LEASE` from the ping's send time, which the ping carries as wall-clock
//!   time: members' clocks must agree within `MAX_CLOCK_OFFSET` (as CockroachDB's must
//!   agree within its max offset), and a ping that seems to come from the future extends
//!   nothing. So a ping delivered late — queued at a paused process, or answered into a
//!   one-way partition — cannot extend a lease past what the leader accounts for. A ping
//!   from anyone but the leader the member follows extends nothing, nor does one from a
//!   leader whose map is newer than the member's (it would serve by a map that may have
//!   moved its partitions); and a granted lease is void once the member follows another
//!   leader, or none (a candidate).
//! - no failover can happen without it (the other voters are fewer than a quorum: a one-
//!   or two-node cluster).
//!
//! A member that answers a ping as its leader's *vouches* for that leader, through the
//! metadata log's `VoteGate`: it votes for no candidate until `LEASE` after it last
//! vouched, and vouches for no one but its candidate until `LEASE` after a vote (a leader
//! that voted for another leads no more either). A leader pings only once an entry of its
//! own term is committed, so every leader that ever held or granted a lease is in the log,
//! and a new leader knows the last one before it (its *predecessor*,
//! `MetaNode::predecessor`). The predecessor's lease rested on a quorum of voters; this
//! leader's election quorum meets it, and every voter in it but this node voted at least
//! `LEASE` after it last vouched. So the predecessor's lease was over by this leader's
//! start, or by `LEASE` after this node last vouched, whichever is later (*the
//! predecessor's end*).
//!
//! A failover waits out the node's lease before it promotes anything, so no two copies
//! ever serve one partition. The leader marks the node `failed` first (no ping grants it
//! anything after that), then waits until the latest of:
//! - `LEASE + MAX_CLOCK_OFFSET` after the last grant it sent the node (it grants only to
//!   members that answered within `PING_TIMEOUT`, so a dead one stops being granted soon);
//! - for the predecessor itself, the predecessor's end (its leases granted by leaders
//!   before it were void once it stood for election);
//! - for any other member, what the predecessor may have granted it: `LEASE +
//!   MAX_CLOCK_OFFSET` after the predecessor's end.
//!
//! **Failover** (the metadata leader, by hand or after `auto_failover_timeout_s` of missed
//! pings), in two committed steps:
//! 1. the node is marked `failed`: every member that applies it stops following it (the
//!    fence; `replica::replicate_from` checks under `apply_lock`);
//! 2. the leader waits out the node's lease, asks the replicas of its active partitions how
//!    far they are (each answers only once fenced), and — for each partition whose fenced
//!    replicas are enough to intersect every majority of its copies — commits a map that
//!    promotes the most advanced of them (`shoal_cluster::failover`). A majority write is on
//!    a majority of copies, so on at least one fenced replica, and the most advanced holds
//!    everything any holds: no acknowledged majority write is lost. A partition without such
//!    replicas stays with the failed node, unavailable, and says so.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use shoal_cluster::failover::CollectionEnds;
use shoal_cluster::HistoryEnd;
use shoal_cluster::{NodeId, PartitionId};
use shoal_meta::{MemberState, MetaCommand, MetaNode, VoteGate};

use crate::node::ClusterNode;
use crate::peers::Op;
use crate::wire::{self, CatchUpRequest, FenceAnswer, FenceRequest, PartKind, PingAnswer, PullAnswer, PullPart, PullRequest};
use crate::ClusterError;

/// How long a lease lasts after the send time of the ping that granted it (or of the pings
/// a quorum answered).
pub const LEASE: Duration = Duration::from_millis(1_500);
// The vote gate holds votes for `LEASE`; after a restart openraft's own start-up lease
// (`ELECTION_TIMEOUT_MAX_MS`) stands in for the gate's lost state, so it must be as long.
const _: () = assert!(LEASE.as_millis() <= shoal_meta::node::ELECTION_TIMEOUT_MAX_MS as u128);
/// Members' wall clocks agree within this (a ping's send time is read on the member's
/// clock).
pub const MAX_CLOCK_OFFSET: Duration = Duration::from_millis(250);
/// A skewed clock is reported at most this often.
const CLOCK_WARN_EVERY: Duration = Duration::from_secs(10);
/// The leader pings every member this often.
pub const PING_INTERVAL: Duration = Duration::from_millis(250);
/// A ping with no answer in this long counts as missed.
pub const PING_TIMEOUT: Duration = Duration::from_millis(1_000);
/// How long a new leader gives its predecessor to answer before judging it by its silence
/// before the election (two ping rounds: one that is alive answers within them).
pub const PREDECESSOR_GRACE: Duration = Duration::from_millis(500);
/// How long the leader waits for a replica's fence report.
pub const FENCE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the leader waits for a promoted replica to catch up from the other fenced ones
/// (`serve_catch_up`); past it the partition stays with the failed node this time.
pub const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(60);

/// This node's lease; see the module documentation.
#[derive(Default)]
pub struct Lease {
    /// Until when the pings of the leader this member follows keep it serving, and which
    /// leader granted it: it is void once this member follows another (or none).
    until: Mutex<Option<(u64, Instant)>>,
    /// As leader: until when the pings a quorum of voters answered as their leader's keep
    /// it serving (`LEASE` after the quorum's oldest send time).
    quorum_until: Mutex<Option<Instant>>,
    /// The last ping from the leader this member followed: who, and when it arrived.
    last_leader_ping: Mutex<Option<(u64, Instant)>>,
    /// When a skewed clock was last reported.
    clock_warned: Mutex<Option<Instant>>,
}

/// Now, in milliseconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Lease {
    /// A ping from `leader`, the leader this member follows, arrived.
    fn heard(&self, leader: u64) {
        *self.last_leader_ping.lock() = Some((leader, Instant::now()));
    }

    /// Extends the lease to `LEASE` after `sent_unix_ms` (the grant's send time on
    /// `leader`'s clock), read on this member's clock; see the module documentation.
    fn grant(&self, leader: u64, sent_unix_ms: u64) {
        let age_ms = i128::from(unix_ms()) - i128::from(sent_unix_ms);
        if age_ms < -(MAX_CLOCK_OFFSET.as_millis() as i128) {
            let mut warned = self.clock_warned.lock();
            if warned.is_none_or(|w| w.elapsed() >= CLOCK_WARN_EVERY) {
                *warned = Some(Instant::now());
                tracing::warn!(
                    ahead_ms = -age_ms,
                    max_offset_ms = MAX_CLOCK_OFFSET.as_millis() as u64,
                    "the leader's clock is ahead of this node's by more than the allowed offset; this node takes no lease and serves nothing until the clocks agree"
                );
            }
            return;
        }
        let age = Duration::from_millis(u64::try_from(age_ms.max(0)).unwrap_or(u64::MAX));
        let Some(left) = LEASE.checked_sub(age) else { return };
        let next = Instant::now() + left;
        let mut until = self.until.lock();
        match *until {
            Some((granter, u)) if granter == leader && u >= next => {}
            _ => *until = Some((leader, next)),
        }
    }

    fn revoke(&self) {
        *self.until.lock() = None;
    }

    /// When the last ping from `leader`, as the leader this member followed, arrived.
    fn last_ping_from(&self, leader: u64) -> Option<Instant> {
        self.last_leader_ping.lock().filter(|(l, _)| *l == leader).map(|(_, at)| at)
    }

    /// Whether this node leads with a lease of its own (see the module documentation).
    fn leading(&self, meta: &MetaNode) -> bool {
        leader_with_quorum(meta)
            && !meta.vote_gate().voted_for_another(meta.id())
            && self.quorum_until.lock().is_some_and(|u| Instant::now() < u)
    }

    pub(crate) fn valid(&self, meta: &MetaNode) -> bool {
        irreplaceable(meta)
            || self.leading(meta)
            || self.until.lock().is_some_and(|(granter, u)| Instant::now() < u && meta.leader() == Some(granter))
    }
}

/// Whether no failover can happen without this member: the other voters of the metadata
/// log are fewer than a quorum (a one- or two-node cluster), so nothing can be promoted in
/// its place and it may serve without a lease.
fn irreplaceable(meta: &MetaNode) -> bool {
    let metrics = meta.metrics();
    let m = metrics.borrow();
    let voters: Vec<u64> = m.membership_config.membership().voter_ids().collect();
    let others = voters.iter().filter(|v| **v != m.id).count();
    voters.contains(&m.id) && others < shoal_cluster::majority(voters.len())
}

/// Whether this member is the metadata leader and, as openraft last reported, a quorum
/// acknowledged it within `LEASE`. The report can be stale (a paused process reads the
/// last one on resuming), so a lease also needs the pings' quorum (`Lease::quorum_until`).
fn leader_with_quorum(meta: &MetaNode) -> bool {
    let metrics = meta.metrics();
    let m = metrics.borrow();
    m.current_leader == Some(m.id) && m.millis_since_quorum_ack.is_some_and(|ms| u128::from(ms) < LEASE.as_millis())
}

/// What a leader's look finds of its link to its members ([`Monitor::cut_off`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CutOff {
    /// Some member answered within `PING_TIMEOUT`: judge each by its own silence.
    No,
    /// None did: judge no one (their silence is this leader's own).
    Yes,
    /// None did until now, and one has since: judge every member afresh, from now.
    Back,
}

/// The leader's view of the members' health.
#[derive(Default)]
pub struct Monitor {
    /// When each member last answered a ping from this node as leader.
    last_ok: Mutex<HashMap<u64, Instant>>,
    /// Since when this node is leader with its term committed (health is judged only from
    /// then).
    leader_since: Mutex<Option<Instant>>,
    /// The leader before this one (`MetaNode::predecessor`), when known.
    predecessor: Mutex<Option<u64>>,
    /// This leadership's health judgement started at its election (not after a pause).
    just_elected: Mutex<bool>,
    /// When each voter last answered, as its leader's, a ping sent at that time.
    leased_sent: Mutex<HashMap<u64, Instant>>,
    /// When this leader last sent each member a ping that granted a lease. Its lock is held
    /// from a ping's look at the member's state to the record, so a failover that takes it
    /// after committing `failed` sees every grant (no later ping grants anything).
    granted: Mutex<HashMap<u64, Instant>>,
    /// One failover (or rebalance step) at a time.
    pub(crate) lock: tokio::sync::Mutex<()>,
    /// When this leader's loop last looked at its members: a look long after the previous
    /// one means this node was paused or starved, and what it saw before says nothing.
    last_look: Mutex<Option<Instant>>,
    /// At the last look, no member had answered for longer than `PING_TIMEOUT`: this
    /// leader was cut off from all of them ([`Monitor::cut_off`]).
    cut_off: Mutex<bool>,
    /// An automatic failover is running (on a task of its own).
    failing: std::sync::atomic::AtomicBool,
    /// Members with a ping in flight.
    pinging: Mutex<HashSet<u64>>,
    /// Members recovered from `failed` under this leader, and when: each is judged from
    /// then, not from its last ping before it failed.
    watched_since: Mutex<HashMap<u64, Instant>>,
    /// When this leader first saw each member (one that joins later is judged from then).
    first_seen: Mutex<HashMap<u64, Instant>>,
    /// Members whose outage was already reported.
    warned: Mutex<HashSet<u64>>,
}

impl Monitor {
    /// Which members answered a ping within `2 × PING_TIMEOUT` (this node counts as healthy);
    /// `None` when this node is not the leader (only the leader pings).
    pub(crate) fn health(&self, me: u64, members: impl Iterator<Item = u64>) -> Option<HashMap<u64, bool>> {
        self.leader_since.lock().as_ref()?;
        let last_ok = self.last_ok.lock();
        Some(members.map(|m| (m, m == me || last_ok.get(&m).is_some_and(|t| t.elapsed() <= PING_TIMEOUT * 2))).collect())
    }

    /// How long `node` has been silent as far as this leader can tell: since its last
    /// answer, or since this leader started (or recovered it). The predecessor — the old
    /// leader, when it failed — is silent since the last ping this node had from it (or an
    /// election timeout before this leader started, when none), so it is not given the
    /// whole auto-failover timeout again; but it too gets `PREDECESSOR_GRACE` to answer this
    /// leader (a short pause is not a failure).
    fn silent_for(&self, node: u64, lease: &Lease) -> Option<Duration> {
        let start = (*self.leader_since.lock())?;
        let mut since = self.first_seen.lock().get(&node).map_or(start, |f| (*f).max(start));
        if *self.predecessor.lock() == Some(node) && *self.just_elected.lock() {
            if start.elapsed() < PREDECESSOR_GRACE {
                return Some(Duration::ZERO);
            }
            let elected_after = start.checked_sub(Duration::from_millis(shoal_meta::node::ELECTION_TIMEOUT_MIN_MS)).unwrap_or(start);
            since = lease.last_ping_from(node).unwrap_or(elected_after).min(start);
        }
        let since = self.watched_since.lock().get(&node).map_or(since, |w| (*w).max(since));
        let last = self.last_ok.lock().get(&node).copied().map_or(since, |t| t.max(since));
        Some(last.elapsed())
    }

    /// How long `node` may still hold a lease, once it is committed `failed`; see the module
    /// documentation.
    fn lease_wait(&self, node: u64, gate: &VoteGate) -> Duration {
        let now = Instant::now();
        // The previous leader's own lease ended by this leader's start, or `LEASE` after
        // this node last vouched for it, whichever is later (see the module documentation).
        let start = self.leader_since.lock().unwrap_or(now);
        let previous_led_until = gate.last_vouched().map_or(start, |v| (v + LEASE).max(start));
        let from_previous =
            if *self.predecessor.lock() == Some(node) { previous_led_until } else { previous_led_until + LEASE + MAX_CLOCK_OFFSET };
        let from_mine = self.granted.lock().get(&node).map(|sent| *sent + LEASE + MAX_CLOCK_OFFSET);
        from_mine.map_or(from_previous, |m| m.max(from_previous)).saturating_duration_since(now)
    }

    /// Whether this leader is cut off from its members, or was until now: a leader that
    /// hears from none of them for longer than `PING_TIMEOUT` cannot tell their silence from
    /// its own, as after a pause. Judging them by it failed over a healthy member 0.7 s after
    /// a 1.15 s partition of the leader alone had healed (the pings' answers had not come
    /// back yet; the Raft heartbeats had, so it led with a quorum again). `watched`: members
    /// this leader pings; none, and it is never cut off. Called once per look.
    fn cut_off(&self, watched: usize, now: Instant) -> CutOff {
        let Some(start) = *self.leader_since.lock() else { return CutOff::No };
        let heard = self.last_ok.lock().values().copied().max().map_or(start, |t| t.max(start));
        let cut = watched > 0 && now.saturating_duration_since(heard) > PING_TIMEOUT;
        let was = std::mem::replace(&mut *self.cut_off.lock(), cut);
        match (was, cut) {
            (_, true) => CutOff::Yes,
            (true, false) => CutOff::Back,
            (false, false) => CutOff::No,
        }
    }

    /// Starts a leadership: what the previous one saw says nothing now.
    /// `elected`: a new leadership, whose predecessor is judged by its silence before the
    /// election; otherwise this leader starts over after a pause or starvation, and judges
    /// every member, its predecessor too, from now. The grants it sent are never forgotten:
    /// they are what a failover must wait out (entries older than a lease wait nothing).
    fn lead(&self, predecessor: Option<u64>, lease: &Lease, elected: bool) {
        *self.leader_since.lock() = Some(Instant::now());
        *self.predecessor.lock() = predecessor;
        *self.just_elected.lock() = elected;
        *self.cut_off.lock() = false;
        self.last_ok.lock().clear();
        self.leased_sent.lock().clear();
        self.watched_since.lock().clear();
        self.first_seen.lock().clear();
        *lease.quorum_until.lock() = None;
    }

    /// Leadership lost: nothing this node saw as leader says anything now (its grants stay,
    /// see `lead`).
    fn step_down(&self) {
        *self.leader_since.lock() = None;
        *self.last_look.lock() = None;
        *self.predecessor.lock() = None;
    }

    /// Records that `voter` answered a ping sent at `sent` as its leader's, and moves this
    /// leader's lease to `LEASE` after the oldest send time a quorum of voters answered.
    fn leased(&self, voter: u64, sent: Instant, me: u64, voters: &[u64], lease: &Lease) {
        let mut leased = self.leased_sent.lock();
        let e = leased.entry(voter).or_insert(sent);
        *e = (*e).max(sent);
        let others = shoal_cluster::majority(voters.len()).saturating_sub(usize::from(voters.contains(&me)));
        let mut times: Vec<Instant> = voters.iter().filter(|v| **v != me).filter_map(|v| leased.get(v).copied()).collect();
        times.sort_unstable_by(|a, b| b.cmp(a));
        let quorum_sent = if others == 0 { Some(sent) } else { times.get(others - 1).copied() };
        if let Some(at) = quorum_sent {
            let mut until = lease.quorum_until.lock();
            *until = Some(until.map_or(at + LEASE, |u| u.max(at + LEASE)));
        }
    }
}

#[derive(Serialize, Deserialize)]
struct PingRequest {
    leader: NodeId,
    /// When the leader sent it, in milliseconds since the Unix epoch on its clock.
    #[serde(default)]
    sent_unix_ms: u64,
    /// The ping grants a lease (the leader leads with a lease of its own, and this member
    /// answered recently).
    #[serde(default)]
    grant: bool,
    /// The map version the leader had applied when it sent the ping. A member behind it
    /// takes no lease from it: it would serve by a map that may have moved its partitions
    /// (a node back from a failover or a partition learns the log and the leader's pings
    /// on separate paths).
    #[serde(default)]
    map_version: u64,
}

/// A member's side of the leader's ping: when it comes from the leader this member follows,
/// the answer says so (it counts towards that leader's own lease), and a grant extends this
/// member's lease — unless this member is failed, which revokes it.
pub(crate) fn serve_ping(node: &ClusterNode, body: &[u8]) -> Result<PingAnswer, ClusterError> {
    let req: PingRequest = serde_json::from_slice(body).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
    let state = node.state();
    let failed = state.members.get(&node.id).is_some_and(|m| m.state == MemberState::Failed);
    // Vouching goes through the vote gate (see the module documentation); it refuses while
    // this member votes, or has just voted, for another.
    let following = !failed && req.leader != node.id && node.meta.leader() == Some(req.leader.0);
    if following {
        // Heard, whether or not it may vouch: a member that wins an election later judges
        // this leader's silence from here.
        node.lease.heard(req.leader.0);
    }
    let follows = following && node.meta.vote_gate().vouch(req.leader.0);
    if failed {
        node.lease.revoke();
    } else if follows && req.grant && state.map_version() >= req.map_version {
        node.lease.grant(req.leader.0, req.sent_unix_ms);
    }
    Ok(PingAnswer { node: node.id, map_version: state.map_version(), leased: follows })
}

/// The leader's loop: pings members, and fails over one that stayed silent longer than the
/// auto-failover timeout, when that loses nothing.
pub(crate) async fn run_monitor(node: Arc<ClusterNode>) {
    let mut stop = node.stop.subscribe();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(PING_INTERVAL) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        // Leads, and an entry of its own term is committed (see the module documentation).
        let Some(predecessor) = node.meta.predecessor() else {
            node.monitor.step_down();
            continue;
        };
        let gap = node.monitor.last_look.lock().replace(Instant::now()).map(|t| t.elapsed());
        if node.monitor.leader_since.lock().is_none() {
            tracing::info!(predecessor, "leading; judging members' health from now");
            node.monitor.lead(predecessor, &node.lease, true);
        } else if let Some(gap) = gap.filter(|g| *g > PING_TIMEOUT) {
            // Paused or starved: the members' silence is this node's own, and its lease
            // needs a fresh quorum of answers.
            tracing::warn!(gap_ms = gap.as_millis() as u64, "this leader did not run for a while; judging members' health afresh");
            node.monitor.lead(predecessor, &node.lease, false);
        }
        if !leader_with_quorum(&node.meta) {
            continue;
        }
        let state = node.state();
        if state.rebalance.is_some() {
            // A rebalance in the log that no one here runs: a previous leader's.
            crate::rebalance::drive(&node);
        }
        // Members failed or ejected are watched no more; the others from when first seen.
        let watched =
            |id: &u64| state.members.get(&NodeId(*id)).is_some_and(|m| !matches!(m.state, MemberState::Failed | MemberState::Ejected));
        node.monitor.watched_since.lock().retain(|id, _| watched(id));
        {
            let now = Instant::now();
            let mut seen = node.monitor.first_seen.lock();
            seen.retain(|id, _| watched(id));
            for id in state.members.keys().map(|id| id.0).filter(watched) {
                seen.entry(id).or_insert(now);
            }
        }
        let voters: Arc<Vec<u64>> = Arc::new(node.meta.metrics().borrow().membership_config.membership().voter_ids().collect());
        for (id, member) in &state.members {
            if *id == node.id || matches!(member.state, MemberState::Failed | MemberState::Ejected) {
                continue;
            }
            if !node.monitor.pinging.lock().insert(id.0) {
                continue;
            }
            let (n, id, address, voters) = (Arc::clone(&node), id.0, member.address.clone(), Arc::clone(&voters));
            tokio::spawn(async move {
                let (body, sent) = {
                    let mut granted = n.monitor.granted.lock();
                    let failed =
                        n.state().members.get(&NodeId(id)).is_none_or(|m| matches!(m.state, MemberState::Failed | MemberState::Ejected));
                    let answered = n.monitor.last_ok.lock().get(&id).is_some_and(|t| t.elapsed() <= PING_TIMEOUT);
                    let grant = !failed && answered && n.lease.leading(&n.meta);
                    let sent = Instant::now();
                    if grant {
                        granted.insert(id, sent);
                    }
                    let ping = PingRequest { leader: n.id, sent_unix_ms: unix_ms(), grant, map_version: n.state().map_version() };
                    (serde_json::to_vec(&ping).unwrap_or_default(), sent)
                };
                if let Ok(answer) = n.peers.call(&address, Op::Ping, body, PING_TIMEOUT).await {
                    n.monitor.last_ok.lock().insert(id, Instant::now());
                    if serde_json::from_slice::<PingAnswer>(&answer).is_ok_and(|a| a.leased) && voters.contains(&id) {
                        n.monitor.leased(id, sent, n.id.0, &voters, &n.lease);
                    }
                }
                n.monitor.pinging.lock().remove(&id);
            });
        }
        let watched_now = state.members.keys().filter(|id| **id != node.id && watched(&id.0)).count();
        match node.monitor.cut_off(watched_now, Instant::now()) {
            CutOff::No => {}
            CutOff::Yes => continue,
            CutOff::Back => {
                tracing::warn!("this leader heard from no member for a while; judging members' health afresh");
                node.monitor.lead(predecessor, &node.lease, false);
                continue;
            }
        }
        let timeout = Duration::from_secs(u64::from(state.settings.auto_failover_timeout_s));
        let max_count = state.settings.auto_failover_max_count as usize;
        for (id, member) in &state.members {
            // A node holding no copy (no data service, no index partition placed on it):
            // failing it over would move nothing and use up `auto_failover_max_count`. An
            // index node's failover gives its index partitions to their replicas, or places
            // them again.
            if *id == node.id || member.state != MemberState::Active || !state.holds_copies(*id) {
                continue;
            }
            if node.monitor.silent_for(id.0, &node.lease).is_none_or(|s| s < timeout) {
                node.monitor.warned.lock().remove(&id.0);
                continue;
            }
            // Said once per outage, not at every look.
            let first_look = node.monitor.warned.lock().insert(id.0);
            // Counted in the log's state, so every leader counts the same: members failed
            // over (automatically or by hand) and not yet recovered by an operator.
            let failed_now = state.members.values().filter(|m| m.state == MemberState::Failed).count();
            let Some(map) = state.map.as_ref() else { continue };
            match shoal_cluster::auto_failover_allowed(map, *id, failed_now, max_count) {
                Ok(()) => {}
                Err(refused) => {
                    if first_look {
                        tracing::warn!(node = id.0, %refused, "node is down; not failed over automatically: an operator must fail it over");
                    }
                    continue;
                }
            }
            // One automatic failover at a time, on a task of its own: the pings go on while
            // it waits (for a rebalance step, a lease, the fences), or every member's lease
            // would lapse meanwhile.
            if node.monitor.failing.swap(true, Ordering::AcqRel) {
                continue;
            }
            tracing::warn!(node = id.0, silent_s = timeout.as_secs(), "node is down; failing it over");
            let (n, target) = (Arc::clone(&node), *id);
            tokio::spawn(async move {
                match failover(&n, target).await {
                    Ok(report) => {
                        metrics::counter!("shoal_failovers_total", "kind" => "auto").increment(1);
                        tracing::warn!(
                            node = target.0,
                            promoted = report.promoted,
                            unavailable = report.unavailable.len(),
                            map_version = report.map_version,
                            "automatic failover done"
                        );
                    }
                    Err(e) => {
                        tracing::warn!(node = target.0, error = %e, "automatic failover failed; will try again");
                    }
                }
                n.monitor.failing.store(false, Ordering::Release);
            });
        }
    }
}

/// What a failover did.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FailoverReport {
    pub node: NodeId,
    pub promoted: usize,
    /// Partitions left with the failed node: no fenced replica could take them.
    pub unavailable: Vec<PartitionId>,
    pub map_version: u64,
}

/// Fails `target` over (metadata leader only); see the module documentation.
pub async fn failover(node: &Arc<ClusterNode>, target: NodeId) -> Result<FailoverReport, ClusterError> {
    if !node.is_leader() {
        return Err(ClusterError::NotLeader { address: node.leader().map(|(_, a)| a) });
    }
    let _one = node.monitor.lock.lock().await;
    let state = node.state();
    let member = state.members.get(&target).ok_or(ClusterError::NodeNotFound(target))?;
    if target == node.id {
        return Err(ClusterError::Refused(
            "this node is the metadata leader and cannot fail itself over; stop it, and another member takes over and fails it over".into(),
        ));
    }
    let map = state.map.clone().ok_or_else(|| ClusterError::Refused("no partition map yet".into()))?;
    if member.state != MemberState::Failed {
        let others = state.members.iter().filter(|(id, m)| **id != target && m.state == MemberState::Active && m.services.data).count();
        if others == 0 && member.services.data {
            return Err(ClusterError::Refused(format!("node {target} is the last active data node; failing it over would leave no copy")));
        }
        node.propose(MetaCommand::SetMemberState { node: target, state: MemberState::Failed }).await?;
    }
    tokio::time::sleep(node.monitor.lease_wait(target.0, node.meta.vote_gate())).await;
    // Step 2: the fence reports.
    let holders: HashSet<NodeId> =
        map.partitions.iter().filter(|c| c.active == target).flat_map(|c| c.replicas.iter().copied()).filter(|r| *r != target).collect();
    let mut calls = Vec::new();
    for holder in holders {
        let Some(m) = state.members.get(&holder) else { continue };
        if m.state == MemberState::Failed {
            continue;
        }
        let body = serde_json::to_vec(&FenceRequest { failed: target }).unwrap_or_default();
        let call = node.peers.call(&m.address, Op::Fence, body, FENCE_TIMEOUT);
        calls.push(async move { (holder, call.await) });
    }
    let mut progress: HashMap<(PartitionId, NodeId), CollectionEnds> = HashMap::new();
    let mut fenced: HashSet<NodeId> = HashSet::new();
    for (holder, answer) in futures::future::join_all(calls).await {
        match answer
            .map_err(ClusterError::from)
            .and_then(|b| serde_json::from_slice::<FenceAnswer>(&b).map_err(|e| ClusterError::BadMessage(e.to_string())))
        {
            Ok(a) => {
                fenced.insert(holder);
                for (p, ends) in a.partitions {
                    progress.insert((p, holder), ends.into_iter().map(|(c, epoch, seqno)| (c, HistoryEnd { epoch, seqno })).collect());
                }
            }
            Err(e) => tracing::warn!(holder = holder.0, error = %e, "no fence report; its copies cannot be promoted"),
        }
    }
    let current = node.state();
    let base = current.map.clone().unwrap_or(map);
    // Whom each ready partition promotes, caught up from the other fenced replicas first.
    let mut choices = Vec::new();
    for (p, copies) in base.iter().filter(|(_, c)| c.active == target) {
        // A fence quorum of every set the failed active counted majorities in (its copies,
        // and a rebalance's starting copies while one holds the partition between them).
        if !crate::majority::quorum_of(&current, p).is_some_and(|q| q.fenced(target, &|n| fenced.contains(&n))) {
            continue;
        }
        let reports: Vec<(NodeId, CollectionEnds)> =
            copies.replicas.iter().filter_map(|r| progress.get(&(p, *r)).map(|s| (*r, s.clone()))).collect();
        if let Some(choice) = shoal_cluster::failover::choose_promotion(&reports) {
            // Where the chosen copy ends once caught up: the furthest end of any collection.
            let end = reports.iter().flat_map(|(_, ends)| ends.values().copied()).max().unwrap_or_default();
            choices.push((p, choice, reports, end));
        }
    }
    let caught_up =
        futures::future::join_all(choices.iter().map(|(p, choice, reports, _)| catch_up(node, &current, target, *p, choice, reports)))
            .await;
    let chosen: HashMap<PartitionId, (NodeId, HistoryEnd)> = choices
        .iter()
        .zip(caught_up)
        .filter_map(|((p, choice, _, end), ok)| match ok {
            Ok(()) => Some((*p, (choice.to, *end))),
            Err(e) => {
                tracing::warn!(partition = p, to = choice.to.0, error = %e, "the replica to promote could not catch up from the others; the partition stays unavailable");
                None
            }
        })
        .collect();
    let plan = shoal_cluster::failover_fenced(&base, target, &|p, r| chosen.get(&p).filter(|(to, _)| *to == r).map(|(_, end)| *end));
    let version = plan.map.version;
    node.propose(MetaCommand::SetMap { map: plan.map }).await?;
    metrics::counter!("shoal_failovers_total", "kind" => "any").increment(1);
    Ok(FailoverReport { node: target, promoted: plan.promotions.len(), unavailable: plan.unavailable, map_version: version })
}

/// Has the replica `choice.to` of partition `p` apply what other fenced replicas hold beyond
/// it (nothing to do when it is furthest in every collection).
async fn catch_up(
    node: &Arc<ClusterNode>,
    state: &shoal_meta::MetaState,
    failed: NodeId,
    p: PartitionId,
    choice: &shoal_cluster::failover::PromotionChoice,
    reports: &[(NodeId, CollectionEnds)],
) -> Result<(), ClusterError> {
    if choice.catch_up.is_empty() {
        return Ok(());
    }
    let address_of = |n: NodeId| state.members.get(&n).map(|m| m.address.clone()).ok_or(ClusterError::NodeNotFound(n));
    let mut sources = Vec::new();
    for (collection, source) in &choice.catch_up {
        let until = reports.iter().find(|(n, _)| n == source).and_then(|(_, s)| s.get(collection)).copied().unwrap_or_default();
        sources.push((*collection, *source, address_of(*source)?, until.epoch, until.seqno));
    }
    tracing::info!(partition = p, to = choice.to.0, ?sources, "the replica to promote catches up from the other fenced replicas first");
    let req = CatchUpRequest { failed, partition: p, sources };
    let body = serde_json::to_vec(&req).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
    node.peers.call(&address_of(choice.to)?, Op::CatchUp, body, CATCH_UP_TIMEOUT).await?;
    Ok(())
}

/// A fenced replica's side of a promotion's catch-up: applies, collection by collection,
/// what another fenced replica holds beyond this copy, up to the seqno that replica
/// reported. Both hold prefixes of the failed active's history in each collection, so this
/// copy then holds everything either does.
pub(crate) async fn serve_catch_up(node: &Arc<ClusterNode>, req: CatchUpRequest) -> Result<(), ClusterError> {
    let failed = req.failed;
    if !node.state().members.contains_key(&failed) {
        return Err(ClusterError::NodeNotFound(failed));
    }
    node.wait_applied(|s| s.members.get(&failed).is_some_and(|m| m.state == MemberState::Failed)).await?;
    let _fenced = node.apply_lock.lock().await;
    let p = req.partition;
    for (collection, source, address, until_epoch, until_seqno) in req.sources {
        let coll = node.collection_by_id(collection).ok_or_else(|| ClusterError::Refused(format!("no collection {collection}")))?;
        let until = HistoryEnd { epoch: until_epoch, seqno: until_seqno };
        loop {
            let pos = coll.position(p).ok_or_else(|| ClusterError::Refused(format!("no partition {p}")))?;
            let (epoch, seqno) = coll.history_end(p).ok_or_else(|| ClusterError::Refused(format!("no partition {p}")))?;
            // By where the histories end, not by seqno: a copy of an older epoch with a
            // higher seqno rolls back (the source answers where they part) and catches up.
            if (HistoryEnd { epoch, seqno }) >= until {
                break;
            }
            let part = PullPart { collection, partition: p, seqno: pos.seqno, uuid: pos.uuid, persisted: 0, consistent: true, peek: false };
            let request = PullRequest {
                from: node.id,
                map_version: node.state().map_version(),
                round: 0,
                wait_ms: 0,
                parts: vec![part],
                catch_up_for: Some(req.failed),
            };
            let bytes = node.peers.call(&address, Op::Pull, wire::encode(&request), crate::replica::PULL_TIMEOUT).await?;
            let answer: PullAnswer = wire::decode(&bytes).map_err(ClusterError::BadMessage)?;
            let Some(part) = answer.parts.into_iter().next() else {
                return Err(ClusterError::BadMessage(format!("node {source} answered a catch-up pull with no part")));
            };
            match &part.kind {
                PartKind::Refused { why } => return Err(ClusterError::Refused(format!("node {source} refused a catch-up: {why}"))),
                PartKind::Changes { changes, .. } if changes.is_empty() => {
                    return Err(ClusterError::Refused(format!(
                        "node {source} has nothing after seqno {} of collection {collection}, partition {p}; it reported {until:?}",
                        pos.seqno
                    )))
                }
                _ => {}
            }
            crate::replica::apply_part(node, &address, part).await?;
        }
    }
    Ok(())
}

/// A member's side of a fence: once it has applied that `failed` is failed, and holding
/// `apply_lock` (so no batch from `failed` lands after), reports how far its copies of the
/// partitions `failed` was active for are.
pub(crate) async fn serve_fence(node: &Arc<ClusterNode>, req: FenceRequest) -> Result<FenceAnswer, ClusterError> {
    let failed = req.failed;
    node.wait_applied(|s| s.members.get(&failed).is_some_and(|m| m.state == MemberState::Failed)).await?;
    let _fenced = node.apply_lock.lock().await;
    let state = node.state();
    let me = node.id;
    let Some(map) = &state.map else { return Ok(FenceAnswer { partitions: Vec::new() }) };
    let partitions: Vec<PartitionId> = map.iter().filter(|(_, c)| c.active == failed && c.replicas.contains(&me)).map(|(p, _)| p).collect();
    let mut ends = node.collection_ends();
    // A copy still being built from files is not a replica yet (pending here, its data not
    // adopted): it is never offered for promotion, as the rebalance never counts it caught up.
    let ends = partitions.into_iter().map(|p| (p, ends.remove(&p).unwrap_or_default()));
    let partitions = crate::copy::without_building(&node.copies.progress(), ends);
    Ok(FenceAnswer { partitions })
}

/// Brings a failed-over node back as `added` (leader only; a failed member no longer counts
/// against `auto_failover_max_count`, as an operator's recovery resets Couchbase's count).
/// The partitions it kept (no replica could take them) serve again; its other data is rolled back to the actives' histories
/// when a rebalance gives it copies.
pub async fn recover(node: &Arc<ClusterNode>, target: NodeId) -> Result<NodeId, ClusterError> {
    if !node.is_leader() {
        return Err(ClusterError::NotLeader { address: node.leader().map(|(_, a)| a) });
    }
    // After a failover in progress, never in its middle.
    let _one = node.monitor.lock.lock().await;
    let state = node.state();
    let member = state.members.get(&target).ok_or(ClusterError::NodeNotFound(target))?;
    if member.state != MemberState::Failed {
        return Err(ClusterError::Refused(format!("node {target} is not failed over (it is {:?})", member.state).to_lowercase()));
    }
    let holds_active = state.map.as_ref().is_some_and(|m| m.partitions.iter().any(|c| c.active == target));
    let next = if holds_active { MemberState::Active } else { MemberState::Added };
    node.propose(MetaCommand::SetMemberState { node: target, state: next }).await?;
    // Judged from now on: its pings before it failed say nothing.
    node.monitor.watched_since.lock().insert(target.0, Instant::now());
    node.monitor.last_ok.lock().remove(&target.0);
    Ok(target)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn left(lease: &Lease) -> Option<Duration> {
        lease.until.lock().map(|(_, u)| u.saturating_duration_since(Instant::now()))
    }

    /// A grant runs `LEASE` from the ping's send time: a late ping gives less, one older
    /// than `LEASE` nothing, and one from beyond `MAX_CLOCK_OFFSET` in the future nothing.
    #[test]
    fn a_grant_runs_from_the_pings_send_time_within_the_clock_offset() {
        let fresh = Lease::default();
        fresh.grant(1, unix_ms());
        assert!(left(&fresh).is_some_and(|l| l > LEASE - Duration::from_millis(200) && l <= LEASE), "{:?}", left(&fresh));

        let late = Lease::default();
        late.grant(1, unix_ms() - 1_000);
        assert!(left(&late).is_some_and(|l| l <= LEASE - Duration::from_millis(1_000)), "a ping a second late: {:?}", left(&late));

        let stale = Lease::default();
        stale.grant(1, unix_ms() - LEASE.as_millis() as u64 - 1);
        assert_eq!(left(&stale), None, "a ping older than the lease extends nothing");

        let ahead = Lease::default();
        ahead.grant(1, unix_ms() + MAX_CLOCK_OFFSET.as_millis() as u64 + 1_000);
        assert_eq!(left(&ahead), None, "a ping from past the clock offset in the future extends nothing");

        let within = Lease::default();
        within.grant(1, unix_ms() + MAX_CLOCK_OFFSET.as_millis() as u64 / 2);
        assert!(left(&within).is_some_and(|l| l <= LEASE), "within the offset: at most LEASE from now: {:?}", left(&within));

        // A later grant never shortens the lease.
        fresh.grant(1, unix_ms() - 1_000);
        assert!(left(&fresh).is_some_and(|l| l > LEASE - Duration::from_millis(400)));
    }

    /// A grant from another leader replaces the lease (it is void once the member follows
    /// someone else, which `valid` checks against the log's leader).
    #[test]
    fn a_grant_belongs_to_its_leader() {
        let lease = Lease::default();
        lease.grant(1, unix_ms());
        lease.grant(2, unix_ms() - 1_000);
        assert_eq!(lease.until.lock().map(|(g, _)| g), Some(2));
        assert!(left(&lease).is_some_and(|l| l <= LEASE - Duration::from_millis(1_000)));
    }

    /// What a new leader waits before promoting in place of a failed member: for its
    /// predecessor nothing once it vouched for no one within `LEASE`; for another member the
    /// predecessor's last grants (`LEASE + MAX_CLOCK_OFFSET` after that); and always its own
    /// grants' `LEASE + MAX_CLOCK_OFFSET`.
    #[test]
    fn a_new_leader_waits_out_only_the_leases_that_may_still_run() {
        let slack = Duration::from_millis(100);
        let monitor = Monitor::default();
        let start = Instant::now() - Duration::from_secs(1);
        *monitor.leader_since.lock() = Some(start);
        *monitor.predecessor.lock() = Some(7);
        let gate = VoteGate::new(LEASE);
        assert_eq!(monitor.lease_wait(7, &gate), Duration::ZERO, "never vouched: the predecessor's lease ended by the election");
        let member = monitor.lease_wait(8, &gate);
        let expected = LEASE + MAX_CLOCK_OFFSET - Duration::from_secs(1);
        assert!(member > expected - slack && member <= expected, "the predecessor's grants: {member:?}");

        // This node vouched for its predecessor just now: it may lead for `LEASE` more.
        assert!(gate.vouch(7));
        let predecessor = monitor.lease_wait(7, &gate);
        assert!(predecessor > LEASE - slack && predecessor <= LEASE, "{predecessor:?}");
        let member = monitor.lease_wait(8, &gate);
        assert!(member > LEASE * 2 + MAX_CLOCK_OFFSET - slack && member <= LEASE * 2 + MAX_CLOCK_OFFSET, "{member:?}");

        // Its own grant to a member: `LEASE + MAX_CLOCK_OFFSET` from the grant.
        let fresh = Monitor::default();
        *fresh.leader_since.lock() = Some(Instant::now() - Duration::from_secs(10));
        fresh.granted.lock().insert(9, Instant::now());
        let own = fresh.lease_wait(9, &VoteGate::new(LEASE));
        assert!(own > LEASE + MAX_CLOCK_OFFSET - slack && own <= LEASE + MAX_CLOCK_OFFSET, "{own:?}");
    }

    /// A leader that heard from no member for longer than `PING_TIMEOUT` judges no one, and
    /// once one answers again, judges everyone afresh; a leader with no one to ping is never
    /// cut off.
    #[test]
    fn a_leader_cut_off_from_every_member_judges_no_one_and_then_everyone_afresh() {
        let ago = |ms: u64| Instant::now() - Duration::from_millis(ms);
        let (monitor, lease) = (Monitor::default(), Lease::default());
        assert_eq!(monitor.cut_off(3, Instant::now()), CutOff::No, "not leading: nothing to judge by");
        monitor.lead(None, &lease, true);
        assert_eq!(monitor.cut_off(3, Instant::now()), CutOff::No, "just elected: not cut off yet");
        *monitor.leader_since.lock() = Some(ago(10_000));
        // (answers: member → ms ago, members pinged, what the look finds)
        type Row = (&'static [(u64, u64)], usize, CutOff);
        let table: &[Row] = &[
            (&[(1, 100), (2, 5_000)], 2, CutOff::No),
            (&[(1, 1_500), (2, 5_000)], 2, CutOff::Yes),
            (&[(1, 3_000), (2, 5_000)], 2, CutOff::Yes),
            (&[(1, 3_000), (2, 50)], 2, CutOff::Back),
            (&[(1, 3_000), (2, 60)], 2, CutOff::No),
            (&[(1, 3_000), (2, 2_000)], 0, CutOff::No),
        ];
        for (i, (answers, watched, want)) in table.iter().enumerate() {
            monitor.last_ok.lock().clear();
            for (member, ms) in *answers {
                monitor.last_ok.lock().insert(*member, ago(*ms));
            }
            assert_eq!(monitor.cut_off(*watched, Instant::now()), *want, "row {i}: {answers:?}");
        }
        // Judging afresh forgets the cut.
        monitor.last_ok.lock().insert(1, ago(5_000));
        monitor.last_ok.lock().remove(&2);
        assert_eq!(monitor.cut_off(2, Instant::now()), CutOff::Yes);
        monitor.lead(None, &lease, false);
        assert_eq!(monitor.cut_off(2, Instant::now()), CutOff::No, "a new start is not a return");
    }

    /// After a pause (the gap path), a leader judges its predecessor from now, not by its
    /// silence before the election, and a failover still waits out the grants it sent
    /// before the pause.
    #[test]
    fn a_leader_that_starts_over_after_a_pause_keeps_its_grants_and_judges_its_predecessor_afresh() {
        let (monitor, lease, gate) = (Monitor::default(), Lease::default(), VoteGate::new(LEASE));
        *lease.last_leader_ping.lock() = Some((7, Instant::now() - Duration::from_secs(3_600)));
        monitor.lead(Some(7), &lease, true);
        *monitor.leader_since.lock() = Some(Instant::now() - PREDECESSOR_GRACE - Duration::from_millis(10));
        assert!(monitor.silent_for(7, &lease).is_some_and(|s| s >= Duration::from_secs(3_600)), "elected: silent since its last ping");
        monitor.granted.lock().insert(7, Instant::now());

        monitor.lead(Some(7), &lease, false);
        assert!(monitor.silent_for(7, &lease).is_some_and(|s| s < Duration::from_secs(1)), "after a pause: judged from now");
        let wait = monitor.lease_wait(7, &gate);
        assert!(wait > LEASE + MAX_CLOCK_OFFSET - Duration::from_millis(100), "its grant is waited out: {wait:?}");

        monitor.step_down();
        assert_eq!(*monitor.predecessor.lock(), None, "no predecessor outside a leadership");
        assert!(monitor.lease_wait(8, &gate) >= LEASE + MAX_CLOCK_OFFSET - Duration::from_millis(100), "no start: the longest wait");
    }
}
