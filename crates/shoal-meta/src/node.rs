//! `MetaNode`: one member of the metadata Raft group, as the engine and server see it —
//! propose a command, read or watch the applied state, change membership, answer messages
//! from other members.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use openraft::error::{ClientWriteError, RaftError};
use openraft::raft::{VoteRequest, VoteResponse};
use openraft::{BasicNode, Config, Raft, RaftMetrics, SnapshotPolicy};
use thiserror::Error;
use tokio::sync::watch;

use crate::network::{decode, handle_rpc, MetaNetwork, MetaTransport, RpcHandleError, RpcKind};
use crate::pre_vote::Heard;
use crate::state::{MetaCommand, MetaReject, MetaResponse, MetaState};
use crate::state_machine::TermLeaders;
use crate::vote_gate::VoteGate;
use crate::{open_storage, StoreError, TypeConfig};

/// A leader sends a heartbeat this often. Metadata changes are rare; the heartbeat is what
/// keeps followers from electing, so it is well below the election timeout.
pub const HEARTBEAT_INTERVAL_MS: u64 = 250;
/// A follower that hears nothing for openraft's leader lease (`ELECTION_TIMEOUT_MAX_MS`)
/// plus a random time in this range starts an election: 2.25–3 s of silence. Long enough
/// for a shared 2-core machine under load not to elect on a scheduling hiccup (heartbeats
/// go every 250 ms), short enough that a lost metadata leader is replaced and failed over
/// within the lowest auto-failover timeout (2 s) plus 2 s.
pub const ELECTION_TIMEOUT_MIN_MS: u64 = 750;
pub const ELECTION_TIMEOUT_MAX_MS: u64 = 1_500;
/// How long a vote request may take Raft to decide; past it the candidate hears a refusal.
pub const VOTE_HANDLE_TIMEOUT: Duration = Duration::from_secs(2);
/// A snapshot is built after this many entries since the last one; the log behind it is purged.
pub const SNAPSHOT_LOGS_SINCE_LAST: u64 = 1_000;
/// Entries kept behind a snapshot, so a briefly lagging member catches up from the log rather
/// than from a whole snapshot.
pub const LOGS_KEPT_AFTER_SNAPSHOT: u64 = 200;
/// Snapshot chunk size on the wire (a whole `MetaState` is usually one chunk).
pub const SNAPSHOT_CHUNK_MAX_BYTES: u64 = 1024 * 1024;
/// How long a member waits for one snapshot chunk to be installed.
pub const INSTALL_SNAPSHOT_TIMEOUT_MS: u64 = 10_000;
/// Entries sent in one append-entries message.
pub const APPEND_ENTRIES_MAX: u64 = 300;

/// Why a member could not start.
#[derive(Debug, Error)]
pub enum OpenError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("invalid Raft configuration: {0}")]
    Config(String),
    #[error("Raft failed to start: {0}")]
    Raft(String),
}

/// Why a proposal was not applied.
#[derive(Debug, Error)]
pub enum ProposeError {
    /// Committed and applied, but every member refused it the same way.
    #[error(transparent)]
    Rejected(MetaReject),
    /// This member is not the leader; `leader` (with its address) is, if known. The caller
    /// forwards the command there.
    #[error("not the metadata leader; the leader is {leader:?} at {address:?}")]
    NotLeader { leader: Option<u64>, address: Option<String> },
    /// Raft stopped or failed (shut down, storage error).
    #[error("the metadata log is unavailable: {0}")]
    Unavailable(String),
}

/// Why a membership change failed.
#[derive(Debug, Error)]
pub enum MembershipError {
    #[error("not the metadata leader; the leader is {leader:?} at {address:?}")]
    NotLeader { leader: Option<u64>, address: Option<String> },
    #[error("membership change refused: {0}")]
    Refused(String),
    #[error("the metadata log is unavailable: {0}")]
    Unavailable(String),
}

/// Why `initialize` failed.
#[derive(Debug, Error)]
pub enum InitializeError {
    /// The member already has a log (it was initialized, or joined a cluster).
    #[error("already initialized")]
    AlreadyInitialized,
    #[error("cannot initialize: {0}")]
    Failed(String),
}

fn write_error<F>(
    e: RaftError<u64, ClientWriteError<u64, BasicNode>>,
    unavailable: impl FnOnce(String) -> F,
    not_leader: impl FnOnce(Option<u64>, Option<String>) -> F,
    refused: impl FnOnce(String) -> F,
) -> F {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => not_leader(f.leader_id, f.leader_node.map(|n| n.addr)),
        RaftError::APIError(ClientWriteError::ChangeMembershipError(c)) => refused(c.to_string()),
        RaftError::Fatal(fatal) => unavailable(fatal.to_string()),
    }
}

/// One member of the metadata Raft group.
pub struct MetaNode {
    id: u64,
    raft: Raft<TypeConfig>,
    applied: watch::Receiver<Arc<MetaState>>,
    leaders: watch::Receiver<TermLeaders>,
    responder: Responder,
}

/// A member's end of the messages from the others (`MetaNode::handle_rpc`), cheap to clone
/// into the tasks that answer them.
#[derive(Clone)]
pub struct Responder {
    raft: Raft<TypeConfig>,
    gate: Arc<VoteGate>,
    heard: Arc<Heard>,
}

impl Responder {
    /// Answers one message. A vote request passes the `VoteGate` first; one it holds back is
    /// refused as openraft refuses one within its own leader lease (this member's vote, not
    /// granted, no log id). A vote granted resets this member's election timer, as in Raft.
    pub async fn handle(&self, kind: RpcKind, body: &[u8]) -> Result<Vec<u8>, RpcHandleError> {
        if kind != RpcKind::Vote {
            return handle_rpc(&self.raft, &self.heard, kind, body).await;
        }
        let req: VoteRequest<u64> = decode(kind, body)?;
        let candidate = req.vote.leader_id().voted_for();
        let refusal = || VoteResponse::new(self.raft.metrics().borrow().vote, None, false);
        let Some(ticket) = self.gate.admit_vote() else {
            let refused: Result<VoteResponse<u64>, RaftError<u64>> = Ok(refusal());
            return serde_json::to_vec(&refused).map_err(|e| RpcHandleError::Encode(e.to_string()));
        };
        let answer = match tokio::time::timeout(VOTE_HANDLE_TIMEOUT, self.raft.vote(req)).await {
            Ok(answer) => answer,
            Err(_) => {
                // Raft may still grant it: counted as granted, so this member vouches for no
                // one else for the hold; the candidate hears a refusal.
                ticket.granted(candidate.unwrap_or(u64::MAX));
                Ok(refusal())
            }
        };
        if let (Ok(resp), Some(candidate)) = (&answer, candidate) {
            if resp.vote_granted {
                ticket.granted(candidate);
                self.heard.touch();
            }
        }
        serde_json::to_vec(&answer).map_err(|e| RpcHandleError::Encode(e.to_string()))
    }
}

impl MetaNode {
    /// Opens the member `id` with its log in `dir` (a directory of its own, never the
    /// document store's), talking to the others through `transport`. A member that has a log
    /// rejoins its cluster by itself; a new one waits for `initialize` or for a leader to add it.
    /// It votes for no candidate within `vote_hold` of vouching for a leader (`VoteGate`).
    pub async fn open<T: MetaTransport>(dir: &Path, id: u64, transport: Arc<T>, vote_hold: Duration) -> Result<MetaNode, OpenError> {
        let (log, sm) = open_storage(dir)?;
        let applied = sm.subscribe();
        let leaders = sm.leaders();
        let config = Config {
            cluster_name: "shoal-meta".into(),
            heartbeat_interval: HEARTBEAT_INTERVAL_MS,
            election_timeout_min: ELECTION_TIMEOUT_MIN_MS,
            election_timeout_max: ELECTION_TIMEOUT_MAX_MS,
            install_snapshot_timeout: INSTALL_SNAPSHOT_TIMEOUT_MS,
            snapshot_policy: SnapshotPolicy::LogsSinceLast(SNAPSHOT_LOGS_SINCE_LAST),
            max_in_snapshot_log_to_keep: LOGS_KEPT_AFTER_SNAPSHOT,
            snapshot_max_chunk_size: SNAPSHOT_CHUNK_MAX_BYTES,
            max_payload_entries: APPEND_ENTRIES_MAX,
            // Elections start after a pre-vote (`crate::pre_vote::drive`), not by openraft's timer.
            enable_elect: false,
            ..Config::default()
        };
        let config = Arc::new(config.validate().map_err(|e| OpenError::Config(e.to_string()))?);
        let raft =
            Raft::new(id, config, MetaNetwork::new(Arc::clone(&transport)), log, sm).await.map_err(|e| OpenError::Raft(e.to_string()))?;
        let heard = Arc::new(Heard::new());
        tokio::spawn(crate::pre_vote::drive(raft.clone(), id, transport, Arc::clone(&heard)));
        let responder = Responder { raft: raft.clone(), gate: Arc::new(VoteGate::new(vote_hold)), heard };
        Ok(MetaNode { id, raft, applied, leaders, responder })
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// Starts a new cluster whose voters are `members` (id → address). Done once, on one
    /// member, for a cluster's first start; a member with a log refuses.
    pub async fn initialize(&self, members: BTreeMap<u64, String>) -> Result<(), InitializeError> {
        let nodes: BTreeMap<u64, BasicNode> = members.into_iter().map(|(id, addr)| (id, BasicNode { addr })).collect();
        match self.raft.initialize(nodes).await {
            Ok(()) => Ok(()),
            Err(RaftError::APIError(openraft::error::InitializeError::NotAllowed(_))) => Err(InitializeError::AlreadyInitialized),
            Err(e) => Err(InitializeError::Failed(e.to_string())),
        }
    }

    /// Commits `cmd` through the log (on the leader) and returns its answer once this member
    /// has applied it.
    pub async fn propose(&self, cmd: MetaCommand) -> Result<MetaResponse, ProposeError> {
        match self.raft.client_write(cmd).await {
            Ok(written) => written.data.map_err(ProposeError::Rejected),
            Err(e) => Err(write_error(
                e,
                ProposeError::Unavailable,
                |leader, address| ProposeError::NotLeader { leader, address },
                ProposeError::Unavailable,
            )),
        }
    }

    /// The state this member has applied (a follower's may lag the leader's).
    pub fn state(&self) -> Arc<MetaState> {
        Arc::clone(&self.applied.borrow())
    }

    /// The applied state now and after every change, for the engine to react to.
    pub fn watch(&self) -> watch::Receiver<Arc<MetaState>> {
        self.applied.clone()
    }

    /// Raft's view: role, term, leader, membership, applied index.
    pub fn metrics(&self) -> watch::Receiver<RaftMetrics<u64, BasicNode>> {
        self.raft.metrics()
    }

    /// The leaders of the last two terms whose entries this member applied.
    pub fn term_leaders(&self) -> TermLeaders {
        *self.leaders.borrow()
    }

    /// When this member leads and an entry of its own term is applied here (its term's
    /// first, blank entry is committed), the leader of the term before that committed an
    /// entry: `Some(None)` when unknown. `None` while this member does not lead with its
    /// term committed.
    pub fn predecessor(&self) -> Option<Option<u64>> {
        let (term, leader) = {
            let m = self.raft.metrics();
            let m = m.borrow();
            (m.current_term, m.current_leader)
        };
        let l = self.term_leaders();
        (leader == Some(self.id) && l.last == Some((term, self.id))).then(|| l.previous.map(|(_, node)| node))
    }

    /// The leader this member knows of.
    pub fn leader(&self) -> Option<u64> {
        self.raft.metrics().borrow().current_leader
    }

    /// Adds `id` at `address` as a learner (it receives the log but does not vote) and waits
    /// until it has caught up. Leader only.
    pub async fn add_learner(&self, id: u64, address: String) -> Result<(), MembershipError> {
        self.raft.add_learner(id, BasicNode { addr: address }, true).await.map(|_| ()).map_err(|e| {
            write_error(
                e,
                MembershipError::Unavailable,
                |leader, address| MembershipError::NotLeader { leader, address },
                MembershipError::Refused,
            )
        })
    }

    /// Makes `voters` the voting members (each must be a member or learner already); members
    /// left out stay learners. Leader only.
    pub async fn change_membership(&self, voters: BTreeSet<u64>) -> Result<(), MembershipError> {
        self.raft.change_membership(voters, true).await.map(|_| ()).map_err(|e| {
            write_error(
                e,
                MembershipError::Unavailable,
                |leader, address| MembershipError::NotLeader { leader, address },
                MembershipError::Refused,
            )
        })
    }

    /// Answers a message from another member (the server's end of `MetaTransport`).
    pub async fn handle_rpc(&self, kind: RpcKind, body: &[u8]) -> Result<Vec<u8>, RpcHandleError> {
        self.responder.handle(kind, body).await
    }

    /// What answers the messages from the others, for a task of its own.
    pub fn responder(&self) -> Responder {
        self.responder.clone()
    }

    /// This member's vote gate: the cluster layer vouches through it.
    pub fn vote_gate(&self) -> &VoteGate {
        &self.responder.gate
    }

    /// Builds a snapshot now (Raft also builds one every `SNAPSHOT_LOGS_SINCE_LAST` entries).
    /// Returns at once; `metrics().snapshot` moves when it is done.
    pub async fn snapshot_now(&self) -> Result<(), String> {
        self.raft.trigger().snapshot().await.map_err(|e| e.to_string())
    }

    /// Purges the log up to `upto`, at most to the last snapshot (Raft also purges by itself
    /// behind each snapshot, keeping `LOGS_KEPT_AFTER_SNAPSHOT` entries). A member that lags
    /// behind the purged part catches up from the snapshot.
    pub async fn purge_log(&self, upto: u64) -> Result<(), String> {
        self.raft.trigger().purge_log(upto).await.map_err(|e| e.to_string())
    }

    /// Stops Raft; the log files are closed when its tasks end. What was acknowledged is on
    /// disk already, so a member that is never shut down (a crash) loses nothing either.
    pub async fn shutdown(&self) -> Result<(), String> {
        self.raft.shutdown().await.map_err(|e| e.to_string())
    }
}
