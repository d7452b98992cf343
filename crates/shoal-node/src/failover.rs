//! Health, leases and failover.
//!
//! **Leases.** A node serves its active copies only while it holds a lease: it is the
//! metadata leader and a quorum acknowledged it within `LEASE`, or the leader — while it
//! had such a quorum — pinged it within `LEASE`, or no failover can happen without it (the
//! other voters are fewer than a quorum: a one- or two-node cluster). A node cut off from the leader stops
//! serving reads and writes within `LEASE` (plus, when the leader itself is cut off, the
//! `LEASE` that leader still believed in); a failover waits that out before it promotes
//! anything, so no two copies ever serve one partition.
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
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use shoal_cluster::{NodeId, PartitionId};
use shoal_meta::{MemberState, MetaCommand, MetaNode};

use crate::node::ClusterNode;
use crate::peers::Op;
use crate::wire::{FenceAnswer, FenceRequest, PingAnswer};
use crate::ClusterError;

/// How long a lease lasts after the leader's last ping (or the leader's last quorum).
pub const LEASE: Duration = Duration::from_millis(1_500);
/// The leader pings every member this often.
pub const PING_INTERVAL: Duration = Duration::from_millis(250);
/// A ping with no answer in this long counts as missed.
pub const PING_TIMEOUT: Duration = Duration::from_millis(1_000);
/// How long the leader waits for a replica's fence report.
pub const FENCE_TIMEOUT: Duration = Duration::from_secs(5);

/// This node's lease; see the module documentation.
#[derive(Default)]
pub struct Lease {
    until: Mutex<Option<Instant>>,
}

impl Lease {
    fn extend(&self) {
        let mut until = self.until.lock();
        let next = Instant::now() + LEASE;
        if until.is_none_or(|u| u < next) {
            *until = Some(next);
        }
    }

    fn revoke(&self) {
        *self.until.lock() = None;
    }

    pub(crate) fn valid(&self, meta: &MetaNode) -> bool {
        if leader_with_quorum(meta) || irreplaceable(meta) {
            return true;
        }
        self.until.lock().is_some_and(|u| Instant::now() < u)
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

/// Whether this member is the metadata leader and a quorum acknowledged it within `LEASE`.
fn leader_with_quorum(meta: &MetaNode) -> bool {
    let metrics = meta.metrics();
    let m = metrics.borrow();
    m.current_leader == Some(m.id) && m.millis_since_quorum_ack.is_some_and(|ms| u128::from(ms) < LEASE.as_millis())
}

/// The leader's view of the members' health.
#[derive(Default)]
pub struct Monitor {
    /// When each member last answered a ping from this node as leader.
    last_ok: Mutex<HashMap<u64, Instant>>,
    /// Since when this node is leader (health is judged only from then).
    leader_since: Mutex<Option<Instant>>,
    /// One failover (or rebalance step) at a time.
    pub(crate) lock: tokio::sync::Mutex<()>,
    /// Nodes failed over automatically since an operator last recovered one.
    auto_count: AtomicUsize,
    /// An automatic failover is running (on a task of its own).
    failing: std::sync::atomic::AtomicBool,
    /// Members with a ping in flight.
    pinging: Mutex<HashSet<u64>>,
    /// Since when this leader watches each member (a member recovered from `failed` is
    /// judged from then, not from its last ping before it failed).
    watched_since: Mutex<HashMap<u64, Instant>>,
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

    /// How long `node` has been silent as far as this leader can tell. A new leader counts
    /// from an election timeout before it took over: it was elected because a majority had
    /// not heard from the old leader for that long, so a failed old leader is not given the
    /// whole auto-failover timeout again.
    fn silent_for(&self, node: u64) -> Option<Duration> {
        let since = (*self.leader_since.lock())?;
        let since = since.checked_sub(Duration::from_millis(shoal_meta::node::ELECTION_TIMEOUT_MIN_MS)).unwrap_or(since);
        let since = self.watched_since.lock().get(&node).map_or(since, |w| (*w).max(since));
        let last = self.last_ok.lock().get(&node).copied().map_or(since, |t| t.max(since));
        Some(last.elapsed())
    }

    /// Whether `node` may still hold a lease: the last ping this leader sent it, or (if the
    /// leader is new) the previous leader's, may have extended it for up to `LEASE` — plus
    /// the `LEASE` a leader cut off from its quorum goes on believing in.
    fn lease_wait(&self, node: u64) -> Duration {
        let bound = LEASE * 2 + PING_INTERVAL;
        let since = self.leader_since.lock().map_or(Duration::ZERO, |t| t.elapsed());
        let silent = self.last_ok.lock().get(&node).map_or(since, |t| t.elapsed().min(since));
        bound.saturating_sub(silent)
    }
}

#[derive(Serialize, Deserialize)]
struct PingRequest {
    leader: u64,
}

/// A member's side of the leader's ping: the lease is extended (the leader pings only while
/// a quorum acknowledges it), unless this member is failed.
pub(crate) fn serve_ping(node: &ClusterNode, body: &[u8]) -> Result<PingAnswer, ClusterError> {
    let _req: PingRequest = serde_json::from_slice(body).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
    let state = node.state();
    match state.members.get(&NodeId(node.id)) {
        Some(m) if m.state == MemberState::Failed => node.lease.revoke(),
        _ => node.lease.extend(),
    }
    Ok(PingAnswer { node: node.id, map_version: state.map_version() })
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
        if !node.is_leader() {
            *node.monitor.leader_since.lock() = None;
            continue;
        }
        if node.monitor.leader_since.lock().is_none() {
            *node.monitor.leader_since.lock() = Some(Instant::now());
            node.monitor.last_ok.lock().clear();
        }
        if !leader_with_quorum(&node.meta) {
            continue;
        }
        let state = node.state();
        if state.rebalance.is_some() {
            // A rebalance in the log that no one here runs: a previous leader's.
            crate::rebalance::drive(&node);
        }
        {
            let mut watched = node.monitor.watched_since.lock();
            for (id, member) in &state.members {
                if matches!(member.state, MemberState::Failed | MemberState::Ejected) {
                    watched.remove(&id.0);
                } else {
                    watched.entry(id.0).or_insert_with(Instant::now);
                }
            }
        }
        for (id, member) in &state.members {
            if id.0 == node.id || matches!(member.state, MemberState::Failed | MemberState::Ejected) {
                continue;
            }
            if !node.monitor.pinging.lock().insert(id.0) {
                continue;
            }
            let (n, id, address) = (Arc::clone(&node), id.0, member.address.clone());
            tokio::spawn(async move {
                let body = serde_json::to_vec(&PingRequest { leader: n.id }).unwrap_or_default();
                if n.peers.call(&address, Op::Ping, body, PING_TIMEOUT).await.is_ok() {
                    n.monitor.last_ok.lock().insert(id, Instant::now());
                }
                n.monitor.pinging.lock().remove(&id);
            });
        }
        let timeout = Duration::from_secs(u64::from(state.settings.auto_failover_timeout_s));
        let max_count = state.settings.auto_failover_max_count as usize;
        for (id, member) in &state.members {
            if id.0 == node.id || member.state != MemberState::Active {
                continue;
            }
            if node.monitor.silent_for(id.0).is_none_or(|s| s < timeout) {
                node.monitor.warned.lock().remove(&id.0);
                continue;
            }
            // Said once per outage, not at every look.
            let first_look = node.monitor.warned.lock().insert(id.0);
            if node.monitor.auto_count.load(Ordering::Acquire) >= max_count {
                if first_look {
                    tracing::warn!(node = id.0, max_count, "node is down; automatic failovers used up, an operator must fail it over");
                }
                continue;
            }
            let uncovered: Vec<PartitionId> = state
                .map
                .as_ref()
                .map(|m| m.iter().filter(|(_, c)| c.active == *id && c.replicas.is_empty()).map(|(p, _)| p).collect())
                .unwrap_or_default();
            if !uncovered.is_empty() {
                if first_look {
                    tracing::warn!(
                        node = id.0,
                        partitions = uncovered.len(),
                        "node is down; not failed over automatically: it holds the only copy of some partitions"
                    );
                }
                continue;
            }
            // One automatic failover at a time, on a task of its own: the pings go on while
            // it waits (for a rebalance step, a lease, the fences), or every member's lease
            // would lapse meanwhile.
            if node.monitor.failing.swap(true, Ordering::AcqRel) {
                continue;
            }
            tracing::warn!(node = id.0, silent_s = timeout.as_secs(), "node is down; failing it over");
            // Counted before it starts: a recovery that comes while it runs resets the count
            // after it, not before.
            node.monitor.auto_count.fetch_add(1, Ordering::AcqRel);
            let (n, target) = (Arc::clone(&node), id.0);
            tokio::spawn(async move {
                match failover(&n, target).await {
                    Ok(report) => {
                        metrics::counter!("shoal_failovers_total", "kind" => "auto").increment(1);
                        tracing::warn!(
                            node = target,
                            promoted = report.promoted,
                            unavailable = report.unavailable.len(),
                            map_version = report.map_version,
                            "automatic failover done"
                        );
                    }
                    Err(e) => {
                        // Not counted: the next look tries again.
                        n.monitor.auto_count.fetch_sub(1, Ordering::AcqRel);
                        tracing::warn!(node = target, error = %e, "automatic failover failed; will try again");
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
    pub node: u64,
    pub promoted: usize,
    /// Partitions left with the failed node: no fenced replica could take them.
    pub unavailable: Vec<PartitionId>,
    pub map_version: u64,
}

/// Fails `target` over (metadata leader only); see the module documentation.
pub async fn failover(node: &Arc<ClusterNode>, target: u64) -> Result<FailoverReport, ClusterError> {
    if !node.is_leader() {
        return Err(ClusterError::NotLeader { address: node.leader().map(|(_, a)| a) });
    }
    let _one = node.monitor.lock.lock().await;
    let state = node.state();
    let member = state.members.get(&NodeId(target)).ok_or(ClusterError::NodeNotFound(target))?;
    if target == node.id {
        return Err(ClusterError::Refused(
            "this node is the metadata leader and cannot fail itself over; stop it, and another member takes over and fails it over".into(),
        ));
    }
    let map = state.map.clone().ok_or_else(|| ClusterError::Refused("no partition map yet".into()))?;
    if member.state != MemberState::Failed {
        let others = state.members.iter().filter(|(id, m)| id.0 != target && m.state == MemberState::Active).count();
        if others == 0 {
            return Err(ClusterError::Refused(format!("node {target} is the last active node; failing it over would leave no copy")));
        }
        node.propose(MetaCommand::SetMemberState { node: NodeId(target), state: MemberState::Failed }).await?;
    }
    tokio::time::sleep(node.monitor.lease_wait(target)).await;
    // Step 2: the fence reports.
    let holders: HashSet<NodeId> =
        map.partitions.iter().filter(|c| c.active.0 == target).flat_map(|c| c.replicas.iter().copied()).filter(|r| r.0 != target).collect();
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
    let mut progress: HashMap<(PartitionId, NodeId), u64> = HashMap::new();
    let mut fenced: HashSet<NodeId> = HashSet::new();
    for (holder, answer) in futures::future::join_all(calls).await {
        match answer
            .map_err(ClusterError::from)
            .and_then(|b| serde_json::from_slice::<FenceAnswer>(&b).map_err(|e| ClusterError::BadMessage(e.to_string())))
        {
            Ok(a) => {
                fenced.insert(holder);
                for (p, s) in a.partitions {
                    progress.insert((p, holder), s);
                }
            }
            Err(e) => tracing::warn!(holder = holder.0, error = %e, "no fence report; its copies cannot be promoted"),
        }
    }
    let current = node.state();
    let base = current.map.clone().unwrap_or(map);
    let plan = shoal_cluster::failover(&base, NodeId(target), &|p, r| {
        let copies = base.partitions.get(usize::from(p))?;
        let n = crate::node::copies_counted(&current, copies);
        if !shoal_cluster::promotion_ready(copies, n, NodeId(target), &|n| fenced.contains(&n)) {
            return None;
        }
        progress.get(&(p, r)).copied()
    });
    let version = plan.map.version;
    node.propose(MetaCommand::SetMap { map: plan.map }).await?;
    metrics::counter!("shoal_failovers_total", "kind" => "any").increment(1);
    Ok(FailoverReport { node: target, promoted: plan.promotions.len(), unavailable: plan.unavailable, map_version: version })
}

/// A member's side of a fence: once it has applied that `failed` is failed, and holding
/// `apply_lock` (so no batch from `failed` lands after), reports how far its copies of the
/// partitions `failed` was active for are.
pub(crate) async fn serve_fence(node: &Arc<ClusterNode>, req: FenceRequest) -> Result<FenceAnswer, ClusterError> {
    let failed = NodeId(req.failed);
    node.wait_applied(|s| s.members.get(&failed).is_some_and(|m| m.state == MemberState::Failed)).await?;
    let _fenced = node.apply_lock.lock().await;
    let state = node.state();
    let me = NodeId(node.id);
    let Some(map) = &state.map else { return Ok(FenceAnswer { partitions: Vec::new() }) };
    let partitions: Vec<PartitionId> = map.iter().filter(|(_, c)| c.active == failed && c.replicas.contains(&me)).map(|(p, _)| p).collect();
    let sums = node.seqno_sums();
    let partitions = partitions.into_iter().map(|p| (p, sums.get(&p).copied().unwrap_or(0))).collect();
    Ok(FenceAnswer { partitions })
}

/// Brings a failed-over node back as `added` (leader only; it also resets the count of
/// automatic failovers, as an operator's recovery does in Couchbase). The partitions it kept (no replica
/// could take them) serve again; its other data is rolled back to the actives' histories
/// when a rebalance gives it copies.
pub async fn recover(node: &Arc<ClusterNode>, target: u64) -> Result<u64, ClusterError> {
    if !node.is_leader() {
        return Err(ClusterError::NotLeader { address: node.leader().map(|(_, a)| a) });
    }
    // After a failover in progress, never in its middle.
    let _one = node.monitor.lock.lock().await;
    let state = node.state();
    let member = state.members.get(&NodeId(target)).ok_or(ClusterError::NodeNotFound(target))?;
    if member.state != MemberState::Failed {
        return Err(ClusterError::Refused(format!("node {target} is not failed over (it is {:?})", member.state).to_lowercase()));
    }
    let holds_active = state.map.as_ref().is_some_and(|m| m.partitions.iter().any(|c| c.active.0 == target));
    let next = if holds_active { MemberState::Active } else { MemberState::Added };
    node.propose(MetaCommand::SetMemberState { node: NodeId(target), state: next }).await?;
    node.monitor.auto_count.store(0, Ordering::Release);
    // Judged from now on: its pings before it failed say nothing.
    node.monitor.watched_since.lock().insert(target, Instant::now());
    node.monitor.last_ok.lock().remove(&target);
    Ok(target)
}
