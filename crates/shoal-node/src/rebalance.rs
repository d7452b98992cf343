//! Rebalance: bring `added` nodes in, move ejected nodes' copies off, restore replica
//! counts. New copies are built from the active's files where a partition is large enough
//! (`copy`), from its change stream otherwise.
//!
//! The metadata leader computes the target map (`shoal_cluster::place`, stable against the
//! current one, so only the copies that must move do) and goes there in steps:
//! 1. **build**: a map whose copies are the current ones plus every new copy as a replica;
//!    new replicas are built (from files or the change stream) and then follow their active;
//! 2. **catch up and hand over, in waves**: once every new copy of a partition is close to
//!    its active, the partition is ready; the ready partitions are handed over together when
//!    all are ready, or `WAVE_INTERVAL` after the previous wave: each partition's active is
//!    asked, under the map it has, to freeze the partitions of the wave (it refuses writes,
//!    so nothing is acknowledged that the target lacks) and to answer once every copy of
//!    their target holds everything it has — whether the role moves or only replicas
//!    change; then the map moving those partitions to their target copies is committed as
//!    the very next version, each new active starts a new history on top, and copies no
//!    longer in the map stop. A freeze thaws when a newer map is applied, or when the plan
//!    leaves the log (stopped, failed, or reverted by the next leader); past `FREEZE_MAX`
//!    the active commits a newer map itself, which fences the wave out (its `SetMap` is
//!    refused), so the partition's old copies stay and nothing is lost. Until the wave,
//!    majorities count the plan's starting copies too (`shoal_cluster::Quorum`);
//! 3. **settle**: wait until every replica follows its active.
//!
//! A stop or a failure keeps the partitions already moved (their moves are done) and undoes
//! the others; a new leader resumes the plan from the log (moved partitions are at their
//! target and count as done).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use shoal_cluster::rebalance as stages;
use shoal_cluster::{NodeId, PartitionId, PartitionMap};
use shoal_meta::{MemberState, MetaCommand, MetaReject, RebalancePlan};

use crate::acks::{Need, Part};
use crate::copy::{CopyMethod, CopyState, Shipped};
use crate::node::ClusterNode;
use crate::peers::{Op, PeerError};
use crate::ClusterError;

/// Partitions ready to move wait for the others, but at most this long after the previous
/// wave (or the start): each wave's map change costs foreground requests a pause (clients
/// follow the new map, old copies are dropped), so a short rebalance moves everything in one
/// wave, and a long one keeps what it finished every `WAVE_INTERVAL` (a stop or failure
/// undoes only what is not moved yet).
pub const WAVE_INTERVAL: Duration = Duration::from_secs(15);
/// A new copy counts as caught up (ready for the hand-over) this close to its active, in
/// changes summed over collections; the hand-over waits for the rest with writes frozen.
pub const CATCH_UP_SLACK: u64 = 1_000;
/// Longest a rebalance waits for its new copies to catch up.
pub const CATCH_UP_MAX: Duration = Duration::from_secs(3_600);
/// Longest a finished rebalance waits for every replica to follow its active (until then
/// majority writes to a partition may be refused); past it the rebalance still succeeds
/// and says so in the log.
pub const SETTLE_MAX: Duration = Duration::from_secs(30);
/// Longest an active waits, frozen for a hand-over, for the wave's map; then it fences the
/// wave out by committing the map one version on, and thaws once that is applied
/// (`apply::fence_late_wave`).
pub const FREEZE_MAX: Duration = Duration::from_secs(30);
/// A hand-over whose sources all answered only after this is not committed: past
/// `FREEZE_MAX` a source fences the wave out, and the wave's `SetMap` would be refused.
/// Half of `FREEZE_MAX` leaves the other half for the map's commit and for the sources to
/// apply it.
pub const HANDOVER_COMMIT_WITHIN: Duration = Duration::from_secs(FREEZE_MAX.as_secs() / 2);
/// Longest an active asked to hand over waits to apply the rebalance's plan from the log.
const PLAN_WAIT: Duration = Duration::from_secs(5);
/// Times a revert reads the map again when another map committed before its own.
const REVERT_ATTEMPTS: usize = 5;
/// How often the leader looks at the copies' progress.
const PROGRESS_POLL: Duration = Duration::from_millis(200);
/// A progress or hand-over call's timeout.
const CALL_TIMEOUT: Duration = Duration::from_secs(40);

/// A rebalance's state, as `GET /v1/cluster/rebalance` names it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RebalanceState {
    /// None ran on this node since it started.
    #[default]
    None,
    Running,
    Done,
    /// Stopped on request: the moves done stay, the others were undone.
    Stopped,
    /// This node is no longer the metadata leader; the new one goes on with it.
    Moved,
    Failed,
}

/// A move's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MoveState {
    /// Planned; its copy not started.
    Waiting,
    /// The build map is committed; the copies start.
    Building,
    /// A copy by files waiting for a turn on its receiver.
    Queued,
    /// Data arriving (files, or the change stream's backfill).
    Copying,
    #[serde(rename = "catching up")]
    CatchingUp,
    /// Within `CATCH_UP_SLACK` of its active.
    #[serde(rename = "caught up")]
    CaughtUp,
    /// Caught up, while its derived state on the new active (index entries, analytics rows)
    /// is still being built: the hand-over waits for it.
    Indexing,
    /// Every partition moved; replicas settling.
    Settling,
    Done,
    Stopped,
}

impl MoveState {
    fn as_str(self) -> &'static str {
        match self {
            MoveState::Waiting => "waiting",
            MoveState::Building => "building",
            MoveState::Queued => "queued",
            MoveState::Copying => "copying",
            MoveState::CatchingUp => "catching up",
            MoveState::CaughtUp => "caught up",
            MoveState::Indexing => "indexing",
            MoveState::Settling => "settling",
            MoveState::Done => "done",
            MoveState::Stopped => "stopped",
        }
    }
}

/// What `GET /v1/cluster/rebalance` shows.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RebalanceStatus {
    pub state: RebalanceState,
    pub moves_total: usize,
    pub moves_done: usize,
    /// The rebalance's size and progress in one kind of byte, its source partitions' live
    /// document bytes ([`progress_bytes`]): each move counts what the plan gave it, and as
    /// done the share of its copy that arrived (a copy by files carries compressed tables, a
    /// copy from the change stream keys and values: counted against their own totals, they
    /// are not added to document bytes). With the rate since the rebalance started.
    #[serde(default)]
    pub bytes_total: u64,
    /// What the plan gave the moves before any started: their source partitions' live
    /// document bytes.
    #[serde(default)]
    pub bytes_planned: u64,
    #[serde(default)]
    pub bytes_done: u64,
    #[serde(default)]
    pub bytes_per_s: f64,
    /// Seconds left at that rate (`None` before anything arrived).
    #[serde(default)]
    pub eta_s: Option<f64>,
    pub message: String,
    /// Seconds since this node began driving the rebalance, to its end once it ended.
    #[serde(default)]
    pub elapsed_s: f64,
    /// Seconds the index stage took on this node (it runs beside the data partitions'
    /// stages): from its plan to the new index placement committed, every index copy built
    /// and caught up. `None` until it ended, and in a cluster with no index to place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_stage_s: Option<f64>,
    /// When this node began driving it (for `elapsed_s`).
    #[serde(skip)]
    began: Option<Instant>,
    pub moves: Vec<MoveStatus>,
}

/// What a move carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MoveKind {
    /// A copy of a data partition.
    Partition,
    /// A copy of an index partition (`index_moves`): `id` is its number, `index` names it.
    Index,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MoveStatus {
    pub kind: MoveKind,
    pub id: PartitionId,
    /// The index (`collection.name`) of an index partition's move.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<String>,
    pub from: Option<NodeId>,
    pub to: NodeId,
    /// `files` (a copy of the partition's tables) or `stream` (a backfill from the
    /// change stream: small partitions, copies that hold data, and the fallback).
    pub method: CopyMethod,
    /// A `files` copy's snapshot: shipped as the keyspace's `files` (adopted whole) or as
    /// `records` (the fallback).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shipped: Option<Shipped>,
    pub state: MoveState,
    #[serde(default)]
    pub bytes_total: u64,
    #[serde(default)]
    pub bytes_done: u64,
    /// The source partition's live document bytes when the plan started: what the move is
    /// planned to carry, known before any copy starts (records add keys and metadata).
    #[serde(default)]
    pub bytes_planned: u64,
    /// When the receiver started building the copy and when it was whole (milliseconds
    /// since the Unix epoch, the receiver's clock): the rate into the receivers is the
    /// bytes over the span of these.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy_started_unix_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy_finished_unix_ms: Option<u64>,
    /// Analytics rows the receiver took with a `files` copy, cut from the source's shadow
    /// (never rebuilt from the documents).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub analytics_rows: Option<u64>,
}

#[derive(Default)]
pub struct Rebalancer {
    status: Mutex<RebalanceStatus>,
}

impl Rebalancer {
    /// Adds moves the rebalance found later (its index stage's).
    pub(crate) fn add_moves(&self, moves: &[MoveStatus]) {
        let mut status = self.status.lock();
        status.moves.extend_from_slice(moves);
        status.moves_total += moves.len();
    }

    /// Replaces the moves of the same kind, index, partition and target by `moves` (an
    /// index move's outcome: its method and bytes).
    pub(crate) fn update_moves(&self, moves: &[MoveStatus]) {
        let mut status = self.status.lock();
        for m in moves {
            if let Some(old) = status.moves.iter_mut().find(|o| o.kind == m.kind && o.index == m.index && o.id == m.id && o.to == m.to) {
                *old = m.clone();
            }
        }
        status.moves_done = status.moves.iter().filter(|m| m.state == MoveState::Done).count();
    }

    /// The index stage ended, its copies built and its placement committed, `secs` after it
    /// began.
    pub(crate) fn index_stage_ended(&self, secs: f64) {
        self.status.lock().index_stage_s = Some(secs);
    }

    pub fn status(&self) -> RebalanceStatus {
        let mut status = self.status.lock().clone();
        if let (RebalanceState::Running, Some(began)) = (status.state, status.began) {
            status.elapsed_s = began.elapsed().as_secs_f64();
        }
        status
    }
}

#[derive(Serialize, Deserialize)]
pub(crate) struct HandoverRequest {
    /// The map the leader hands over from: the source answers only under the same one.
    pub map_version: u64,
    /// Partition → the copies of its target besides the source: each must hold everything
    /// the source has before it answers.
    pub partitions: Vec<(PartitionId, Vec<NodeId>)>,
}

#[derive(Serialize, Deserialize, Default)]
pub(crate) struct ProgressAnswer {
    /// Per partition this node holds a copy of: its seqnos summed over collections.
    pub partitions: Vec<(PartitionId, u64)>,
    /// Partitions this node is active for whose replicas have not all acknowledged it
    /// recently (majority writes to them may be refused as impossible).
    #[serde(default)]
    pub unsettled: Vec<PartitionId>,
    /// Partitions this node is active for with a replica that follows it but has not
    /// reached the end of its first snapshot yet (it misses documents: losing the active
    /// now would lose them).
    #[serde(default)]
    pub building: Vec<PartitionId>,
    /// Copies being built (or built) here from files, and how far they are.
    #[serde(default)]
    pub copies: Vec<(PartitionId, crate::copy::CopyProgress)>,
    /// Per partition: the history each collection's copy is on (collection id, history
    /// uuid). A copy on another history than its active's (a returning node's, before its
    /// rollback) is not caught up, whatever its seqnos.
    #[serde(default)]
    pub histories: Vec<(PartitionId, Vec<(u32, u64)>)>,
    /// Per partition this node is active for: the bytes of its live documents (what a
    /// rebalance plans to move for a copy of it).
    #[serde(default)]
    pub sizes: Vec<(PartitionId, u64)>,
    /// Per partition this node is active for: the replicas it hears on its current history
    /// (every collection's copy acknowledged on it, past its first snapshot). A hand-over
    /// waits for those acknowledgements; see [`heard_by_active`].
    #[serde(default)]
    pub heard: Vec<(PartitionId, Vec<NodeId>)>,
    /// The map version this node's partition states followed when it read its positions
    /// (see [`under_map`]).
    #[serde(default)]
    pub map_version: u64,
    /// Copies here whose index entries or analytics rows lag the copy by more than
    /// `CATCH_UP_SLACK`: the rebalance hands no partition to them yet.
    #[serde(default)]
    pub derived_behind: Vec<PartitionId>,
}

/// `answer` as it counts against map `version`: a node that had not applied that map yet
/// when it answered says nothing of its copies under it. Its positions may be of a copy
/// the map retired and that it discards when it applies a later map giving it back — a
/// copy caught up by them is empty once it gets its role (a CI run handed a partition
/// over to such a copy: `a_rebalance_stops_on_request_and_outlives_its_leader`).
fn under_map(mut answer: ProgressAnswer, version: u64) -> ProgressAnswer {
    if answer.map_version < version {
        answer.partitions.clear();
        answer.histories.clear();
        answer.heard.clear();
    }
    answer
}

/// Starts a rebalance (leader only); answers how many copies it builds. Its plan goes into
/// the metadata log first, so that a new leader finishes it if this one dies.
pub async fn start(node: &Arc<ClusterNode>, eject: Vec<NodeId>) -> Result<usize, ClusterError> {
    if !node.is_leader() {
        return Err(ClusterError::NotLeader { address: node.leader().map(|(_, a)| a) });
    }
    let state = node.state();
    if state.rebalance.is_some() || node.rebalancer.status.lock().state == RebalanceState::Running {
        return Err(ClusterError::RebalanceRunning);
    }
    for id in &eject {
        if !state.members.contains_key(id) {
            return Err(ClusterError::NodeNotFound(*id));
        }
    }
    let (current, target) = target_map(node, &eject)?;
    let added: Vec<NodeId> =
        state.members.iter().filter(|(id, m)| m.state == MemberState::Added && !eject.contains(id)).map(|(id, _)| *id).collect();
    let plan = RebalancePlan { from: current, target, eject, added, stop: false };
    let moves = moves(&plan.from, &plan.target).len();
    match node.propose(MetaCommand::BeginRebalance { plan }).await {
        Err(ClusterError::Rejected(MetaReject::RebalanceRunning)) => return Err(ClusterError::RebalanceRunning),
        other => other?,
    };
    drive(node);
    Ok(moves)
}

/// Asks the rebalance under way to stop (leader only): the data partitions not moved yet
/// give up their new copies and go back to the copies they started from (the moved ones
/// stay); index copies still being adopted are given up (the placement stays as it was).
pub async fn stop(node: &Arc<ClusterNode>) -> Result<(), ClusterError> {
    match node.propose(MetaCommand::StopRebalance).await {
        Err(ClusterError::Rejected(MetaReject::NoRebalance)) => Err(ClusterError::Refused("no rebalance is under way".into())),
        other => other.map(|_| ()),
    }
}

/// Runs the plan in the log on this node (the leader), unless it runs here already: after
/// `start`, and when a node becomes leader and finds a plan its predecessor left.
pub(crate) fn drive(node: &Arc<ClusterNode>) {
    let state = node.state();
    let Some(plan) = state.rebalance.clone() else { return };
    {
        let mut status = node.rebalancer.status.lock();
        if status.state == RebalanceState::Running {
            return;
        }
        let moves = moves(&plan.from, &plan.target);
        *status = RebalanceStatus {
            state: RebalanceState::Running,
            moves_total: moves.len(),
            moves,
            began: Some(Instant::now()),
            ..RebalanceStatus::default()
        };
    }
    let n = Arc::clone(node);
    tokio::spawn(async move {
        let mut outcome = run(&n, &plan).await;
        let mut reverted = true;
        // Not the leader any more: the plan stays in the log for the next one.
        let handed_on = matches!(&outcome, Err(ClusterError::NotLeader { .. } | ClusterError::NoLeader(_))) || !n.is_leader();
        let finished = n.state().map.as_ref().is_some_and(|m| m.partitions == plan.target.partitions);
        if let (Err(e), false, false) = (&outcome, handed_on, finished) {
            // It cannot go on (a copy's node died, a catch-up ran out of time): the map goes
            // back to the copies it started from, and a new rebalance starts from there.
            tracing::warn!(error = %e, "rebalance failed; going back to the map before it");
            if let Err(revert_error) = revert(&n, &plan).await {
                outcome = Err(ClusterError::Refused(format!("{e}; and going back failed: {revert_error}")));
                reverted = false;
            }
        }
        // A plan whose revert failed stays in the log: its end would drop the starting
        // copies' majorities while the map still holds the build copies. The next leader
        // (or the next start of this one's rebalance) takes it up.
        if !handed_on && reverted {
            if let Err(e) = n.propose(MetaCommand::EndRebalance).await {
                tracing::warn!(error = %e, "forgetting the rebalance plan");
            }
        }
        let mut status = n.rebalancer.status.lock();
        status.elapsed_s = status.began.map_or(0.0, |b| b.elapsed().as_secs_f64());
        match outcome {
            Ok(Finish::Done) => {
                status.state = RebalanceState::Done;
                status.moves_done = status.moves_total;
                for m in &mut status.moves {
                    m.state = MoveState::Done;
                }
                tracing::info!(moves = status.moves_total, "rebalance done");
            }
            Ok(Finish::Stopped) => {
                status.state = RebalanceState::Stopped;
                for m in status.moves.iter_mut().filter(|m| m.state != MoveState::Done) {
                    m.state = MoveState::Stopped;
                }
                tracing::info!(moves_done = status.moves_done, "rebalance stopped; moves done stay, the others are undone");
            }
            Err(e) if handed_on => {
                status.state = RebalanceState::Moved;
                status.message = format!("this node is no longer the metadata leader; the new one goes on with the rebalance ({e})");
                tracing::info!(error = %e, "rebalance handed on to the new leader");
            }
            Err(e) => {
                status.state = RebalanceState::Failed;
                status.message = e.to_string();
                tracing::warn!(error = %e, "rebalance failed");
            }
        }
    });
}

/// How a rebalance ended.
enum Finish {
    Done,
    Stopped,
}

/// The current map and where a rebalance ejecting `eject` goes.
fn target_map(node: &ClusterNode, eject: &[NodeId]) -> Result<(PartitionMap, PartitionMap), ClusterError> {
    let state = node.state();
    let current = state.map.clone().ok_or_else(|| ClusterError::Refused("no partition map yet".into()))?;
    let nodes: Vec<shoal_cluster::Node> = state
        .members
        .iter()
        .filter(|(id, m)| matches!(m.state, MemberState::Active | MemberState::Added) && m.services.data && !eject.contains(id))
        .map(|(id, _)| shoal_cluster::Node { id: *id, weight: 1 })
        .collect();
    if nodes.is_empty() {
        return Err(ClusterError::Refused("no node running the data service would be left to hold the data".into()));
    }
    let mut target = shoal_cluster::place(current.partition_count(), &nodes, state.settings.replicas, Some(&current))
        .map_err(|e| ClusterError::Refused(format!("cannot place partitions: {e}")))?;
    // A partition whose only copy is on a failed node stays there (nothing else has it).
    for (p, copies) in current.iter() {
        if state.members.get(&copies.active).is_some_and(|m| m.state == MemberState::Failed) {
            target.partitions[usize::from(p)] = copies.clone();
        }
    }
    Ok((current, target))
}

/// The copies a rebalance builds (`from` is the active they stream from), as the status
/// shows them.
fn moves(current: &PartitionMap, target: &PartitionMap) -> Vec<MoveStatus> {
    stages::new_copies(current, target)
        .unwrap_or_default()
        .into_iter()
        .map(|(p, n)| MoveStatus {
            kind: MoveKind::Partition,
            id: p,
            index: None,
            from: Some(current.partitions[usize::from(p)].active),
            to: n,
            method: CopyMethod::Stream,
            shipped: None,
            state: MoveState::Waiting,
            bytes_total: 0,
            bytes_done: 0,
            bytes_planned: 0,
            copy_started_unix_ms: None,
            copy_finished_unix_ms: None,
            analytics_rows: None,
        })
        .collect()
}

async fn run(node: &Arc<ClusterNode>, plan: &RebalancePlan) -> Result<Finish, ClusterError> {
    // The map changes below hold the failover lock; the long waits between them do not, so
    // that a node dying mid-rebalance is failed over at once (and the plan then fails).
    let one = node.monitor.lock.lock().await;
    let eject: Vec<NodeId> = plan.eject.clone();
    let state = node.state();
    for id in &plan.added {
        if state.members.get(id).is_some_and(|m| m.state == MemberState::Added) {
            node.propose(MetaCommand::SetMemberState { node: *id, state: MemberState::Active }).await?;
        }
    }
    for id in &plan.eject {
        if state.members.get(id).is_some_and(|m| m.state == MemberState::Active) {
            node.propose(MetaCommand::SetMemberState { node: *id, state: MemberState::Leaving }).await?;
        }
    }
    let current = node.state().map.clone().ok_or_else(|| ClusterError::Refused("no partition map".into()))?;
    let target = &plan.target;
    plan_bytes(node, &current).await;
    // 1. Build: every new copy joins as a replica (a resumed plan finds them there).
    let build = stages::build_map(&current, target);
    let mut map = current.clone();
    // A target node failed since the plan was made (on starved machines, between the plan
    // and here): say so, rather than have the log refuse a map naming it.
    still_on(&node.state(), &current, target)?;
    if build.partitions != current.partitions {
        node.propose(MetaCommand::SetMap { map: build.clone() }).await?;
        map = build;
    }
    drop(one);
    set_moves(node, MoveState::Building);
    // 2. Catch up.
    let new_copies = stages::new_copies(&plan.from, target).map_err(|e| ClusterError::Refused(e.to_string()))?;
    // The index partitions, beside the data partitions' stages (an index partition is fed
    // by every data partition's active, wherever it is, and needs no data copy to move):
    // placed on the index nodes that stay, each new copy adopted as the files of a live
    // one, then the placement switched at once.
    let index_stage = crate::index_moves::move_indexes(node, &eject);
    let data_stage = move_partitions(node, plan, map, &new_copies);
    // How the two end it is `stages::stages_next`'s: the data stage decides first.
    tokio::pin!(index_stage, data_stage);
    let (mut data_ended, mut index_ended) = (None, None);
    let index_moves = loop {
        let data = match &data_ended {
            None => stages::StageEnd::Running,
            Some(Ok(None)) => stages::StageEnd::Moved,
            Some(Ok(Some(_))) => stages::StageEnd::Stopped,
            Some(Err(_)) => stages::StageEnd::Failed,
        };
        let index = match &index_ended {
            None => stages::StageEnd::Running,
            Some(Ok(_)) => stages::StageEnd::Moved,
            Some(Err(_)) => stages::StageEnd::Failed,
        };
        let stop_asked = node.state().rebalance.as_ref().is_some_and(|p| p.stop);
        match (stages::stages_next(data, index, stop_asked), data_ended.take(), index_ended.take()) {
            (stages::Stages::WaitData, d, i) => {
                (data_ended, index_ended) = (d, i);
                tokio::select! {
                    ended = &mut data_stage => data_ended = Some(ended),
                    ended = &mut index_stage, if index_ended.is_none() => index_ended = Some(ended),
                }
            }
            (stages::Stages::WaitIndex, d, _) => {
                data_ended = d;
                // Until the index stage ends or a stop is asked (looked at again above).
                tokio::select! {
                    ended = &mut index_stage => index_ended = Some(ended),
                    () = tokio::time::sleep(PROGRESS_POLL) => {}
                }
            }
            (stages::Stages::EndStopped, _, _) => {
                // Every data move is done and stays; the index stage's copies, never named
                // in the placement, are dropped by their nodes once the plan ends.
                revert(node, plan).await?;
                return Ok(Finish::Stopped);
            }
            (stages::Stages::EndAsData, Some(Ok(Some(finish))), _) => return Ok(finish),
            (stages::Stages::EndAsData, Some(Err(e)), _) | (stages::Stages::FailAsIndex, _, Some(Err(e))) => return Err(e),
            (stages::Stages::Finish, _, Some(Ok(moves))) => break moves,
            // Not reached: `stages_next` answers each only from the ends matched above.
            (next, _, _) => return Err(ClusterError::Refused(format!("rebalance stages: {next:?} out of turn"))),
        }
    };
    if !index_moves.is_empty() {
        tracing::info!(moves = index_moves.len(), "index partitions moved");
    }
    let one = node.monitor.lock.lock().await;
    tracing::info!("every partition is at its target copies");
    for id in &eject {
        node.propose(MetaCommand::SetMemberState { node: *id, state: MemberState::Ejected }).await?;
    }
    node.retire_voters(&eject).await?;
    drop(one);
    // 4. Settle: done when every replica follows its active and holds a whole snapshot of
    // it, so that majority writes work on every partition the moment the rebalance says it
    // is done, and losing an old copy then loses nothing. Replicas still reading their
    // first snapshot are waited for as copies are (`CATCH_UP_MAX`); ones not heard from,
    // `SETTLE_MAX`.
    set_moves(node, MoveState::Settling);
    let started = Instant::now();
    loop {
        let map = node.state().map.clone().unwrap_or_else(|| target.clone());
        let (unsettled, building) = unsettled_of(node, &map).await;
        if unsettled + building == 0 {
            break;
        }
        let waited = started.elapsed();
        if (unsettled > 0 && waited >= SETTLE_MAX) || waited >= CATCH_UP_MAX {
            tracing::warn!(unsettled, building, "rebalance done, but some replicas do not follow their actives yet");
            break;
        }
        tokio::time::sleep(PROGRESS_POLL).await;
    }
    Ok(Finish::Done)
}

/// Stages 2 and 3 of a rebalance for the data partitions, partition by partition: once every
/// new copy of a partition has caught up, its active role is handed over (with every other
/// partition ready at that look) and a map moves those partitions to their target copies. A
/// stop or a failure afterwards keeps the partitions already moved and undoes only the
/// others. `map` is the build map. Answers `None` once every partition is at its target
/// copies, the finish otherwise (a stop reverted).
async fn move_partitions(
    node: &Arc<ClusterNode>,
    plan: &RebalancePlan,
    mut map: PartitionMap,
    new_copies: &[(PartitionId, NodeId)],
) -> Result<Option<Finish>, ClusterError> {
    let target = &plan.target;
    let deadline = Instant::now() + CATCH_UP_MAX;
    let started = Instant::now();
    let mut waves = 0usize;
    let mut last_wave = Instant::now();
    loop {
        let state = node.state();
        let stop_asked = state.rebalance.as_ref().is_some_and(|p| p.stop);
        if !stop_asked {
            still_on(&state, &map, target)?;
        }
        // A stop asks nobody: the next step is the revert.
        let answers = if stop_asked { HashMap::new() } else { progress_answers(node, &map).await };
        let progress = progress_of(&answers);
        show_copies(node, &answers, started);
        let caught_up: BTreeSet<(PartitionId, NodeId)> = new_copies
            .iter()
            .filter(|(p, n)| {
                // Against the partition's active now (a moved partition's is its new copy).
                // An active that did not answer says nothing: its copy is not caught up
                // (before, a dead source counted as 0 and every copy of it as caught up).
                let active = map.partitions[usize::from(*p)].active;
                match (progress.get(&(*p, *n)), progress.get(&(*p, active))) {
                    (Some((have, on)), Some((want, active_on))) => on == active_on && have + CATCH_UP_SLACK >= *want,
                    _ => false,
                }
            })
            .copied()
            .collect();
        let heard: BTreeSet<(PartitionId, NodeId)> =
            new_copies.iter().filter(|(p, n)| heard_by_active(&answers, &map, *p, *n)).copied().collect();
        let derived_ready = derived_ready(&answers, target);
        let look = stages::Look {
            stop_asked,
            map: &map,
            target,
            new_copies,
            caught_up: &caught_up,
            heard: &heard,
            derived_ready: &derived_ready,
            since_wave: last_wave.elapsed(),
            out_of_time: Instant::now() >= deadline,
        };
        let step = stages::next_step(&look, WAVE_INTERVAL);
        {
            let mut status = node.rebalancer.status.lock();
            for m in status.moves.iter_mut().filter(|m| m.kind == MoveKind::Partition) {
                let at_target = map.partitions.get(usize::from(m.id)) == target.partitions.get(usize::from(m.id));
                let copy = (m.id, m.to);
                let next = if at_target && caught_up.contains(&copy) {
                    MoveState::Done
                } else if caught_up.contains(&copy) && !derived_ready.contains(&m.id) {
                    // The copy holds the data; its index entries and analytics rows on the
                    // new active are still being built from its change stream.
                    MoveState::Indexing
                } else if caught_up.contains(&copy) {
                    MoveState::CaughtUp
                } else {
                    continue;
                };
                if m.state != next {
                    m.state = next;
                    let next = next.as_str();
                    tracing::info!(
                        partition = m.id,
                        from = ?m.from,
                        to = m.to.0,
                        method = ?m.method,
                        shipped = ?m.shipped,
                        bytes = m.bytes_done,
                        secs = started.elapsed().as_secs_f64(),
                        "move {next}"
                    );
                }
            }
            status.moves_done = status.moves.iter().filter(|m| m.state == MoveState::Done).count();
        }
        match step {
            stages::Step::Finish => break,
            stages::Step::Revert => return revert(node, plan).await.map(|()| Some(Finish::Stopped)),
            stages::Step::OutOfTime { behind } => {
                return Err(ClusterError::Timeout(format!("{behind} new copies did not catch up in {CATCH_UP_MAX:?}")));
            }
            stages::Step::Wait => tokio::time::sleep(PROGRESS_POLL).await,
            stages::Step::HandOver(ready) => {
                map = hand_over(node, &map, target, &ready).await?;
                waves += 1;
                last_wave = Instant::now();
            }
        }
    }
    tracing::info!(waves, "every data partition is at its target copies");
    Ok(None)
}

/// Hands over the active roles of the `ready` partitions that change active, then commits
/// a map moving those partitions to their target copies (under the failover lock, unless a
/// failover came first: it changed the map under the plan, which fails and goes back).
/// Answers the committed map.
async fn hand_over(
    node: &Arc<ClusterNode>,
    map: &PartitionMap,
    target: &PartitionMap,
    ready: &[PartitionId],
) -> Result<PartitionMap, ClusterError> {
    let _one = node.monitor.lock.lock().await;
    let state = node.state();
    still_on(&state, map, target)?;
    // The same copies, at the version the log has now: a map that changed no copy (a source
    // fencing out a late wave, a failover of a node holding none) moved the version on, and
    // a hand-over under the old one would be refused by every source.
    let fresh = state.map.clone().unwrap_or_else(|| map.clone());
    let map = &fresh;
    // How long the hand-over freezes partitions (their writes wait): logged, since that is
    // where a rebalance's foreground latency peaks.
    let handover_started = Instant::now();
    // Every partition of the wave, whether its active role moves or only its replicas
    // change: the active freezes it until the whole target holds what it has. (A wave that
    // kept the active used to commit at once, and a new replica up to `CATCH_UP_SLACK`
    // behind the one it replaced could then be promoted without writes a majority had:
    // `shoal_cluster::sim`, `handover_waits_for_whole_target`.)
    let mut handovers: BTreeMap<NodeId, Vec<(PartitionId, Vec<NodeId>)>> = BTreeMap::new();
    for &p in ready {
        let (cur, want) = (&map.partitions[usize::from(p)], &target.partitions[usize::from(p)]);
        let holders: Vec<NodeId> = want.nodes().filter(|n| *n != cur.active).collect();
        handovers.entry(cur.active).or_default().push((p, holders));
    }
    // Every source at once: their freezes overlap instead of adding up, and each runs from
    // about the same start, which the check below bounds.
    let mut calls = Vec::with_capacity(handovers.len());
    for (from, partitions) in &handovers {
        let address = state.members.get(from).map(|m| m.address.clone()).ok_or(ClusterError::NodeNotFound(*from))?;
        let body = serde_json::to_vec(&HandoverRequest { map_version: map.version, partitions: partitions.clone() }).unwrap_or_default();
        calls.push(async move {
            // A call whose connection failed (a pooled connection closed under it, a reset)
            // is sent once more while the wave may still commit: a source's side of a
            // hand-over can run twice (it freezes again and waits for the same positions).
            // A CI run failed a whole rebalance on one "error sending request".
            match node.peers.call(&address, Op::Handover, body.clone(), CALL_TIMEOUT).await {
                Err(PeerError::Unreachable { why, .. }) if handover_started.elapsed() < HANDOVER_COMMIT_WITHIN => {
                    tracing::info!(%address, %why, "a hand-over call failed; sending it once more");
                    node.peers.call(&address, Op::Handover, body, CALL_TIMEOUT).await
                }
                answer => answer,
            }
        });
    }
    let too_late = |what: String| {
        ClusterError::Refused(format!("{what}, too close to their freezes' end ({FREEZE_MAX:?}) to move the partitions now"))
    };
    for answer in futures::future::join_all(calls).await {
        if let Err(e) = answer {
            // A call that failed past the bound (timed out behind map applications queued on
            // a slow source) is a late answer too: the wave is not committed either way.
            let after = handover_started.elapsed();
            return Err(if after > HANDOVER_COMMIT_WITHIN {
                too_late(format!("a hand-over's source did not answer ({e}) after {after:?}"))
            } else {
                e.into()
            });
        }
    }
    let answered = handover_started.elapsed();
    if answered > HANDOVER_COMMIT_WITHIN {
        return Err(too_late(format!("the hand-over's sources answered after {answered:?}")));
    }
    // The next version of the map the sources froze under, and no other: `SetMap` refuses
    // it if any map came between (a source fencing a late wave out, `apply::fence_late_wave`).
    let next = stages::wave_map(map, target, ready, map.version + 1);
    let handed_over_ms = handover_started.elapsed().as_millis();
    node.propose(MetaCommand::SetMap { map: next.clone() }).await?;
    tracing::info!(
        partitions = ready.len(),
        sources = handovers.len(),
        handed_over_ms,
        map_ms = handover_started.elapsed().as_millis(),
        "hand-over done; the map moves these partitions to their target copies"
    );
    Ok(next)
}

/// Whether the plan can go on: every node of its target is a member that has not failed,
/// and the map is still `map`, the last this rebalance committed.
fn still_on(state: &shoal_meta::MetaState, map: &PartitionMap, target: &PartitionMap) -> Result<(), ClusterError> {
    if let Some(failed) = target.nodes().into_iter().find(|n| state.members.get(n).is_none_or(|m| m.state == MemberState::Failed)) {
        return Err(ClusterError::Refused(format!("node {failed} failed during the rebalance; start it again")));
    }
    if state.map.as_ref().is_none_or(|m| m.partitions != map.partitions) {
        return Err(map_changed());
    }
    Ok(())
}

/// Only a failover changes the map while a rebalance runs (its leader holds the lock for
/// its own changes): a copy's source or target is gone, and the plan cannot go on.
fn map_changed() -> ClusterError {
    ClusterError::Refused("the map changed under the rebalance (a failover); start it again".into())
}

/// A stop (or a failure): each partition already moved to its target copies stays moved;
/// every other keeps only the copies it had when the rebalance started (the new ones are
/// dropped where they were built). Ejected nodes become active again; added nodes that hold
/// no copy go back to `added`.
async fn revert(node: &Arc<ClusterNode>, plan: &RebalancePlan) -> Result<(), ClusterError> {
    let _one = node.monitor.lock.lock().await;
    // Always a new version, even when no copy goes: a wave proposed before (by this leader,
    // or one deposed and still running) can then never commit after the plan's end, when the
    // sources have thawed. A map committed meanwhile (a source fencing a late wave out)
    // makes the proposal stale: read the map again and go back from it.
    let mut attempts = 0;
    let holders = loop {
        let current = node.state().map.clone().ok_or_else(|| ClusterError::Refused("no partition map".into()))?;
        let back = stages::revert_map(&current, &plan.from, &plan.target)
            .unwrap_or_else(|| PartitionMap { version: current.version + 1, ..current.clone() });
        let holders = back.nodes();
        match node.propose(MetaCommand::SetMap { map: back }).await {
            Ok(_) => break holders,
            Err(ClusterError::Rejected(MetaReject::MapVersion { .. })) if attempts < REVERT_ATTEMPTS => {
                attempts += 1;
                let seen = node.state().map_version();
                node.wait_map_after(seen, PLAN_WAIT).await;
            }
            Err(e) => return Err(e),
        }
    };
    let state = node.state();
    for id in &plan.eject {
        if state.members.get(id).is_some_and(|m| m.state == MemberState::Leaving) {
            node.propose(MetaCommand::SetMemberState { node: *id, state: MemberState::Active }).await?;
        }
    }
    for id in plan.added.iter().filter(|id| !holders.contains(id)) {
        if state.members.get(id).is_some_and(|m| m.state == MemberState::Active) {
            node.propose(MetaCommand::SetMemberState { node: *id, state: MemberState::Added }).await?;
        }
    }
    Ok(())
}

/// How many partitions' replicas do not all follow their actives yet (a node that does
/// not answer counts for one), and how many follow but are still reading a first snapshot.
async fn unsettled_of(node: &Arc<ClusterNode>, map: &PartitionMap) -> (usize, usize) {
    let (mut unsettled, mut building) = (0, 0);
    for answer in progress_answers(node, map).await.into_values() {
        match answer {
            Some(a) => {
                unsettled += a.unsettled.len();
                building += a.building.len();
            }
            None => unsettled += 1,
        }
    }
    (unsettled, building)
}

/// Sets the state of every data partition's move (index moves have their own stage).
fn set_moves(node: &ClusterNode, state: MoveState) {
    for m in node.rebalancer.status.lock().moves.iter_mut().filter(|m| m.kind == MoveKind::Partition) {
        m.state = state;
    }
}

/// Every copy's progress, from the answers of the nodes that hold them (missing when a
/// node did not answer).
/// A copy's progress: its seqnos summed over collections, and the history each collection's
/// copy is on (collection id, history uuid).
type CopyProgressAt<'a> = (u64, &'a [(u32, u64)]);

/// Per (partition, holder): its copy's progress.
fn progress_of(answers: &HashMap<NodeId, Option<ProgressAnswer>>) -> HashMap<(PartitionId, NodeId), CopyProgressAt<'_>> {
    let mut out = HashMap::new();
    for (holder, answer) in answers {
        let Some(answer) = answer else { continue };
        let histories: HashMap<PartitionId, &[(u32, u64)]> = answer.histories.iter().map(|(p, h)| (*p, h.as_slice())).collect();
        for (p, s) in &answer.partitions {
            out.insert((*p, *holder), (*s, histories.get(p).copied().unwrap_or_default()));
        }
    }
    out
}

/// Whether partition `p`'s active (in `map`) hears new copy `n` on its current history, by
/// its progress answer (a copy that is the active hears itself). A copy by files is caught up
/// by its own position as soon as it is adopted, before its first pull tells its active so;
/// handed over then, the active froze the partition until that pull came (82 ms in a bench
/// add, every request to the partition waiting as long:
/// bench/results/2026-11-28-issue14-empty-node-and-like-for-like-ceiling.md). An active that
/// did not answer hears nobody.
fn heard_by_active(answers: &HashMap<NodeId, Option<ProgressAnswer>>, map: &PartitionMap, p: PartitionId, n: NodeId) -> bool {
    let Some(active) = map.partitions.get(usize::from(p)).map(|c| c.active) else { return false };
    active == n
        || answers
            .get(&active)
            .and_then(Option::as_ref)
            .is_some_and(|a| a.heard.iter().any(|(q, replicas)| *q == p && replicas.contains(&n)))
}

/// The partitions whose target active reported its copy's derived state (index entries,
/// analytics rows) caught up: it answered, under the map, with a position for the copy, and
/// did not list it as behind. A node that did not answer says nothing is ready.
fn derived_ready(answers: &HashMap<NodeId, Option<ProgressAnswer>>, target: &PartitionMap) -> BTreeSet<PartitionId> {
    target
        .iter()
        .filter(|(p, copies)| {
            answers
                .get(&copies.active)
                .and_then(Option::as_ref)
                .is_some_and(|a| a.partitions.iter().any(|(q, _)| q == p) && !a.derived_behind.contains(p))
        })
        .map(|(p, _)| p)
        .collect()
}

/// Puts the receivers' file copies into the status: each move's method and bytes, and the
/// totals, rate and time left.
fn show_copies(node: &ClusterNode, answers: &HashMap<NodeId, Option<ProgressAnswer>>, started: Instant) {
    let mut status = node.rebalancer.status.lock();
    let partition_moves = status.moves.iter_mut().filter(|m| m.kind == MoveKind::Partition);
    for m in partition_moves.filter(|m| !matches!(m.state, MoveState::CaughtUp | MoveState::Indexing)) {
        let copy = answers.get(&m.to).and_then(|a| a.as_ref()).and_then(|a| a.copies.iter().find(|(p, _)| *p == m.id));
        let Some((_, copy)) = copy else { continue };
        m.method = copy.method;
        m.shipped = copy.shipped;
        m.bytes_total = copy.bytes_total.max(copy.bytes_done);
        m.bytes_done = copy.bytes_done;
        m.copy_started_unix_ms = copy.started_unix_ms;
        m.copy_finished_unix_ms = copy.finished_unix_ms;
        m.analytics_rows = copy.analytics_rows;
        m.state = match copy.state {
            CopyState::Copying | CopyState::Streaming => MoveState::Copying,
            CopyState::Queued => MoveState::Queued,
            CopyState::Done | CopyState::Failed => MoveState::CatchingUp,
        };
    }
    let (total, done) = progress_bytes(&status.moves);
    let secs = started.elapsed().as_secs_f64();
    status.bytes_total = total;
    status.bytes_done = done;
    status.bytes_per_s = if secs > 0.0 { done as f64 / secs } else { 0.0 };
    status.eta_s = (status.bytes_per_s > 0.0).then(|| total.saturating_sub(done) as f64 / status.bytes_per_s);
}

/// A rebalance's `(total, done)` in its moves' planned bytes (their source partitions' live
/// document bytes; a move the plan gave nothing counts what its copy carries): a move whose
/// copy is whole counts all of its plan; a copy by files under way the share of its own total
/// (compressed tables) that arrived; a copy from the change stream what arrived (keys and
/// values), at most its plan. One kind of byte, so that a bar and an ETA end at 100 %: a
/// finished rebalance reported 116 MB done of 922 MB when file bytes were added to document
/// bytes. Index moves carry index files, another kind of byte: they are counted by
/// `moves_done`, and each shows its own bytes.
pub(crate) fn progress_bytes(moves: &[MoveStatus]) -> (u64, u64) {
    moves.iter().filter(|m| m.kind == MoveKind::Partition).fold((0u64, 0u64), |(t, d), m| {
        let total = if m.bytes_planned > 0 { m.bytes_planned } else { m.bytes_total.max(m.bytes_done) };
        let whole = m.copy_finished_unix_ms.is_some()
            || matches!(m.state, MoveState::CaughtUp | MoveState::Indexing | MoveState::Settling | MoveState::Done);
        let done = if whole {
            total
        } else {
            match m.method {
                CopyMethod::Files if m.bytes_total > 0 => (total as f64 * (m.bytes_done as f64 / m.bytes_total as f64).min(1.0)) as u64,
                CopyMethod::Files => 0,
                CopyMethod::Stream => m.bytes_done.min(total),
            }
        };
        (t + total, d + done)
    })
}

/// Puts into the status what each move is planned to carry: its source partition's live
/// document bytes, as the actives report them (0 where one did not answer).
async fn plan_bytes(node: &Arc<ClusterNode>, map: &PartitionMap) {
    let answers = progress_answers(node, map).await;
    let sizes: HashMap<(PartitionId, NodeId), u64> = answers
        .iter()
        .filter_map(|(holder, answer)| answer.as_ref().map(|a| (holder, a)))
        .flat_map(|(holder, a)| a.sizes.iter().map(move |(p, bytes)| ((*p, *holder), *bytes)))
        .collect();
    let mut status = node.rebalancer.status.lock();
    for m in &mut status.moves {
        m.bytes_planned = m.from.and_then(|from| sizes.get(&(m.id, from)).copied()).unwrap_or(0);
    }
    status.bytes_planned = status.moves.iter().map(|m| m.bytes_planned).sum();
    tracing::info!(moves = status.moves.len(), mb_planned = status.bytes_planned as f64 / 1e6, "rebalance planned");
}

/// The progress answer of each node holding a copy in `map` (`None` when it did not answer).
async fn progress_answers(node: &Arc<ClusterNode>, map: &PartitionMap) -> HashMap<NodeId, Option<ProgressAnswer>> {
    let state = node.state();
    let holders: HashSet<NodeId> = map.nodes().into_iter().collect();
    let mut calls = Vec::new();
    for holder in holders {
        let Some(m) = state.members.get(&holder) else { continue };
        let call = node.peers.call(&m.address, Op::Progress, Vec::new(), CALL_TIMEOUT);
        calls.push(async move { (holder, call.await) });
    }
    futures::future::join_all(calls)
        .await
        .into_iter()
        .map(|(holder, answer)| {
            let answer = answer.ok().and_then(|b| serde_json::from_slice::<ProgressAnswer>(&b).ok());
            (holder, answer.map(|a| under_map(a, map.version)))
        })
        .collect()
}

/// A node's copies' progress: per partition, seqnos summed over collections.
pub(crate) fn serve_progress(node: &ClusterNode) -> ProgressAnswer {
    let state = node.state();
    // The map the partition states follow, before the positions: they are of that map or a
    // later one.
    let map_version = node.copy_states.map_version();
    // The copies first, the positions after: a copy still being built (its ingest may have
    // set the export's positions already, before the copy's progress says `done` with its
    // bytes) reports no position, so the rebalance never takes it for caught up while the
    // partition is pending here. Read in the other order, a copy finishing in between
    // would show caught up with the progress of a copy under way (CI saw a move `done`
    // with 0 bytes carried).
    let copies = node.copies.progress();
    let mut positions = node.collection_positions();
    // Every partition this node holds a copy of has a position, even with no collection
    // (all at 0, on no history): a rebalance of a cluster without collections is caught
    // up at once (before, it waited for a collection to be created).
    for (p, _) in state.map.iter().flat_map(|m| m.iter()).filter(|(_, c)| c.holds(node.id)) {
        positions.entry(p).or_default();
    }
    let positions = crate::copy::without_building(&copies, positions);
    let sums: Vec<(PartitionId, u64)> = positions.iter().map(|(p, v)| (*p, v.iter().map(|(_, pos)| pos.seqno).sum())).collect();
    let histories = positions.iter().map(|(p, v)| (*p, v.iter().map(|(id, pos)| (*id, pos.uuid)).collect())).collect();
    // The partitions this node is the active of, with their copies.
    let mine: Vec<(PartitionId, &shoal_cluster::Copies)> =
        state.map.as_ref().map(|m| m.iter().filter(|(_, c)| c.active == node.id).collect()).unwrap_or_default();
    let (mut unsettled, mut building) = (Vec::new(), Vec::new());
    for &(p, copies) in mine.iter().filter(|(_, c)| !c.replicas.is_empty()) {
        let replicas = &copies.replicas;
        let health: Vec<_> =
            state.collections.values().map(|def| node.acks.health(def.id, p, replicas, crate::majority::HEALTHY_ACK_WINDOW)).collect();
        if health.iter().any(|h| h.healthy < replicas.len()) {
            unsettled.push(p);
        } else if health.iter().any(|h| h.consistent < replicas.len()) {
            building.push(p);
        }
    }
    let store = node.engine.store();
    let collections: Vec<_> = store.list_collections().iter().filter_map(|c| store.collection(&c.name)).collect();
    let sizes = mine.iter().map(|&(p, _)| (p, collections.iter().map(|c| c.partition_bytes(p)).sum())).collect();
    // The collections of the metadata, as the hand-over's freeze waits for them.
    let meta_collections = node.cluster_collections();
    let heard = mine
        .iter()
        .map(|&(p, copies)| {
            let heard = copies
                .replicas
                .iter()
                .copied()
                .filter(|r| {
                    meta_collections.iter().all(|c| {
                        let uuid = c.position(p).map(|pos| pos.uuid);
                        node.acks.get(c.id(), p, *r).is_some_and(|ack| ack.consistent && Some(ack.uuid) == uuid)
                    })
                })
                .collect();
            (p, heard)
        })
        .collect();
    // The copies here whose derived state (index entries, analytics rows) lags the copy by
    // more than the catch-up slack in some collection: not to be handed the active role yet.
    // Each collection's derived positions read once, not once per partition.
    let derived: Vec<(&Arc<shoal_storage::Collection>, Vec<u64>)> =
        meta_collections.iter().filter_map(|c| node.engine.derived_positions(c).map(|d| (c, d))).collect();
    let derived_behind = positions
        .iter()
        .map(|(p, _)| *p)
        .filter(|&p| {
            derived.iter().any(|(c, d)| {
                let high = c.position(p).map_or(0, |pos| pos.seqno);
                d.get(usize::from(p)).copied().unwrap_or(0) + CATCH_UP_SLACK < high
            })
        })
        .collect();
    ProgressAnswer { partitions: sums, unsettled, building, copies, histories, sizes, heard, map_version, derived_behind }
}

/// A hand-over that waits this long for one new active logs what it waited for.
const SLOW_HANDOVER_WAIT: Duration = Duration::from_millis(50);

/// The partition a hand-over waited longest for: the new active's acknowledgement when the
/// wait began and when it ended, against the position it had to reach.
struct SlowWait {
    waited: Duration,
    partition: u16,
    to: NodeId,
    seqno: u64,
    uuid: u64,
    before: Option<crate::acks::CopyAck>,
    after: Option<crate::acks::CopyAck>,
}

/// An active's side of a hand-over: freezes the partitions (writes refused), waits until
/// every copy of each one's target holds everything this copy has, and answers. The freeze
/// ends with the next map (the wave's), or the plan's end; past `FREEZE_MAX` this node fences
/// the wave out with a map of its own (`apply::fence_late_wave`).
pub(crate) async fn serve_handover(node: &Arc<ClusterNode>, req: HandoverRequest) -> Result<(), ClusterError> {
    // A freeze lasts only while a rebalance is under way and the map is the one it was made
    // under (`apply::freeze_holds`): this node must have applied both first.
    let mut applied = node.meta.watch();
    let wanted = req.map_version;
    let planned = matches!(
        tokio::time::timeout(PLAN_WAIT, applied.wait_for(|s| s.rebalance.is_some() && s.map_version() >= wanted)).await,
        Ok(Ok(_))
    );
    if !planned {
        return Err(ClusterError::Refused(format!(
            "no rebalance under map version {wanted} on this node after {PLAN_WAIT:?}: nothing to hand over for"
        )));
    }
    let version = node.state().map_version();
    if version != wanted {
        return Err(ClusterError::Refused(format!("the map moved on to version {version} since the hand-over's {wanted}")));
    }
    let until = Instant::now() + FREEZE_MAX;
    let partitions: Vec<u16> = req.partitions.iter().map(|(p, _)| *p).collect();
    node.copy_states.freeze(&partitions, wanted, until);
    node.apply_current_map().await?;
    // Held pulls (up to `PULL_WAIT`) answer now (`serve_pull` answers a poke at once), so
    // each new active pulls again at once — with the partitions it began to follow since its
    // last pull — and acknowledges what it holds. Otherwise the freeze could wait out a held
    // pull: 474 ms in bench runs, with every request to the frozen partitions waiting as long.
    //
    // Only an acknowledgement of this round counts (sent after the new active heard of it):
    // one recorded before may be of a copy the new active has discarded since. A copy that
    // left a node and comes back within `DISCARD_AFTER` is discarded when the map gives it
    // back — after its last pulls had acknowledged the old data. A CI run handed a
    // partition over on such an acknowledgement to an empty copy, and the old active, now
    // its replica, rolled back to 0 (`a_rebalance_stops_on_request_and_outlives_its_leader`).
    let round = node.acks.start_round();
    let frozen_at = Instant::now();
    let collections = node.cluster_collections();
    // The partition the hand-over waited longest for, with the acknowledgement it had
    // from the new active when the wait began (logged when the freeze was long).
    let mut slowest: Option<SlowWait> = None;
    let waits: Vec<(u16, NodeId)> = req.partitions.iter().flat_map(|(p, holders)| holders.iter().map(|h| (*p, *h))).collect();
    for (p, to) in &waits {
        for coll in &collections {
            let Some(pos) = coll.position(*p) else { continue };
            let before = node.acks.get(coll.id(), *p, *to);
            let began = Instant::now();
            let reached = node
                .acks
                .wait(
                    Part { collection: coll.id(), partition: *p, uuid: pos.uuid },
                    &[*to],
                    1,
                    Need::Confirmed { seqno: pos.seqno, round },
                    until,
                )
                .await;
            let waited = began.elapsed();
            if slowest.as_ref().is_none_or(|s| waited > s.waited) {
                let after = node.acks.get(coll.id(), *p, *to);
                slowest = Some(SlowWait { waited, partition: *p, to: *to, seqno: pos.seqno, uuid: pos.uuid, before, after });
            }
            if !reached {
                // The freeze stays: it is overdue now, and this node fences the wave out
                // before it thaws (`apply::fence_late_wave`). Thawing here let an earlier
                // leader's hand-over of the same map, answered later by another call, commit
                // a wave over the writes taken since.
                return Err(ClusterError::Timeout(format!("node {to} did not catch up on partition {p} of {} in time", coll.name())));
            }
        }
    }
    tracing::info!(
        partitions = req.partitions.len(),
        freeze_ms = frozen_at.elapsed().as_millis(),
        "handing over: every copy of the target holds what this copy has"
    );
    if let Some(slow) = slowest.filter(|s| s.waited >= SLOW_HANDOVER_WAIT) {
        tracing::info!(
            waited_ms = slow.waited.as_millis(),
            partition = slow.partition,
            to = slow.to.0,
            seqno = slow.seqno,
            uuid = slow.uuid,
            before = ?slow.before,
            after = ?slow.after,
            "a hand-over waited long for one copy of its target"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::copy::CopyProgress;

    /// A new copy is heard by its partition's active only when the active's own answer
    /// lists it for that partition; a copy that is the active hears itself; an active that
    /// did not answer, or a partition not in the map, hears nobody.
    #[test]
    fn a_new_copy_is_handed_over_only_once_its_active_hears_it() {
        let map = PartitionMap {
            version: 3,
            partitions: vec![
                shoal_cluster::Copies { active: NodeId(1), replicas: vec![NodeId(2), NodeId(3)] },
                shoal_cluster::Copies { active: NodeId(4), replicas: vec![NodeId(3)] },
            ],
        };
        let answer = |heard: Vec<(PartitionId, Vec<NodeId>)>| Some(ProgressAnswer { heard, ..ProgressAnswer::default() });
        let mut answers = HashMap::new();
        answers.insert(NodeId(1), answer(vec![(0, vec![NodeId(2)])]));
        // Node 3 says it hears node 2 on partition 0, but it is not that partition's active.
        answers.insert(NodeId(3), answer(vec![(0, vec![NodeId(2), NodeId(3)])]));
        answers.insert(NodeId(4), None);
        for (p, n, heard) in [(0, 2, true), (0, 3, false), (0, 1, true), (1, 3, false), (1, 4, true), (2, 2, false)] {
            assert_eq!(heard_by_active(&answers, &map, p, NodeId(n)), heard, "partition {p}, copy on {n}");
        }
    }

    /// Positions count against a map only from a node whose partition states followed it
    /// when it read them; what else it says (its copies, its sizes) counts either way.
    #[test]
    fn positions_count_only_from_a_node_that_applied_the_map() {
        let answer = |map_version: u64| ProgressAnswer {
            partitions: vec![(2, 900)],
            histories: vec![(2, vec![(1, 77)])],
            heard: vec![(2, vec![NodeId(4)])],
            sizes: vec![(2, 1_000)],
            map_version,
            ..ProgressAnswer::default()
        };
        // (map version the node followed, the map's version, positions kept)
        for (followed, map, kept) in [(8, 9, false), (9, 9, true), (10, 9, true), (0, 1, false)] {
            let a = under_map(answer(followed), map);
            assert_eq!(!a.partitions.is_empty(), kept, "followed {followed}, map {map}");
            assert_eq!(!a.histories.is_empty(), kept, "followed {followed}, map {map}");
            assert_eq!(!a.heard.is_empty(), kept, "followed {followed}, map {map}");
            assert_eq!(a.sizes, vec![(2, 1_000)], "sizes count either way");
        }
    }

    #[test]
    fn progress_counts_one_kind_of_byte_and_ends_at_its_total() {
        let m = |method: CopyMethod, state: MoveState, planned: u64, total: u64, done: u64, finished: bool| MoveStatus {
            kind: MoveKind::Partition,
            index: None,
            id: 0,
            from: Some(NodeId(1)),
            to: NodeId(2),
            method,
            shipped: None,
            state,
            bytes_total: total,
            bytes_done: done,
            bytes_planned: planned,
            copy_started_unix_ms: None,
            copy_finished_unix_ms: finished.then_some(1),
            analytics_rows: None,
        };
        use CopyMethod::{Files, Stream};
        // (what, move, counted total, counted done)
        let cases = [
            ("files under way: the share of its compressed total", m(Files, MoveState::Copying, 1_000, 100, 25, false), 1_000, 250),
            ("files whole: all of its plan, whatever it carried", m(Files, MoveState::CatchingUp, 1_000, 130, 130, true), 1_000, 1_000),
            ("files queued", m(Files, MoveState::Queued, 1_000, 0, 0, false), 1_000, 0),
            ("stream under way: what arrived", m(Stream, MoveState::Copying, 1_000, 400, 400, false), 1_000, 400),
            ("stream carrying more than planned (writes since)", m(Stream, MoveState::Copying, 1_000, 1_500, 1_500, false), 1_000, 1_000),
            ("caught up", m(Stream, MoveState::CaughtUp, 1_000, 900, 900, false), 1_000, 1_000),
            ("no plan: what it carries", m(Stream, MoveState::Copying, 0, 300, 300, false), 300, 300),
        ];
        for (what, mv, total, done) in cases {
            assert_eq!(progress_bytes(&[mv]), (total, done), "{what}");
        }
        // A finished rebalance by files: 100 %, not compressed bytes over document bytes.
        let finished = [m(Files, MoveState::Done, 922, 116, 116, true)];
        let (total, done) = progress_bytes(&finished);
        assert_eq!(done, total);
        // Index moves' file bytes are not document bytes: left out of the totals.
        let index = MoveStatus { kind: MoveKind::Index, index: Some("c.i".into()), ..m(Files, MoveState::Done, 0, 500, 500, true) };
        assert_eq!(progress_bytes(&[finished[0].clone(), index]), (total, done));
    }

    #[test]
    fn a_copy_under_way_reports_no_position() {
        let copy = |state: CopyState| CopyProgress { method: CopyMethod::Files, state, ..CopyProgress::default() };
        // Partition → the state of the copy built here (None: no copy, an old replica).
        let table: [(Option<CopyState>, bool); 6] = [
            (None, true),
            (Some(CopyState::Queued), false),
            (Some(CopyState::Copying), false),
            (Some(CopyState::Done), true),
            (Some(CopyState::Failed), true),
            (Some(CopyState::Streaming), true),
        ];
        let copies: Vec<(PartitionId, CopyProgress)> =
            table.iter().enumerate().filter_map(|(p, (state, _))| state.map(|s| (p as PartitionId, copy(s)))).collect();
        let positions: BTreeMap<PartitionId, u64> = (0..table.len()).map(|p| (p as PartitionId, 100 + p as u64)).collect();
        let reported: BTreeMap<PartitionId, u64> = crate::copy::without_building(&copies, positions).into_iter().collect();
        for (p, (state, shown)) in table.iter().enumerate() {
            assert_eq!(reported.contains_key(&(p as PartitionId)), *shown, "partition {p}, copy {state:?}");
        }
    }
}
