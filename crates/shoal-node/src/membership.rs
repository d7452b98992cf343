//! Membership: this node's identity in its cluster, and how members come and go —
//! founding a cluster, joining one (`--join`, or an invitation from `shoal cluster add`),
//! admitting a joining node on the metadata leader, and the metadata log's voters
//! ([`voters_after_admission`], [`voters_after_ejection`]: pure).
//!
//! State owned here, [`Membership`]: the identity file beside the data, the cluster secret,
//! the address to join, and whether this node has entered its cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use shoal_cluster::NodeId;
use shoal_meta::{MemberState, MetaCommand, MetaReject, MetaResponse, Services};
use tokio::sync::watch;

use crate::identity::{self, Identity};
use crate::node::{ClusterConfig, ClusterNode};
use crate::peers::{Op, PeerError};
use crate::wire::{JoinAnswer, JoinRequest};
use crate::ClusterError;

/// How long a joining node keeps asking (the member it names may still be starting).
pub const JOIN_TIMEOUT: Duration = Duration::from_secs(60);
/// How long `shoal cluster add` waits for the invited node to restart and be admitted.
pub const INVITE_WAIT: Duration = Duration::from_secs(60);
/// How long the invited node has to answer the invitation itself.
const INVITE_CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the invited node waits for the cluster it is invited to to confirm the
/// invitation's secret (within `INVITE_CALL_TIMEOUT`).
const INVITE_CHECK_TIMEOUT: Duration = Duration::from_secs(5);
/// Voting members of the metadata log; members beyond it are learners (they receive the
/// log but do not vote), so elections stay quick in a large cluster.
pub const META_VOTERS_MAX: usize = 5;
/// Time between a joining node's requests while the member it names cannot admit it yet.
const JOIN_RETRY: Duration = Duration::from_millis(500);

/// This node's place in its cluster; see the module documentation.
pub(crate) struct Membership {
    dir: PathBuf,
    identity: Mutex<Identity>,
    join: Option<String>,
    secret: String,
    /// The secret came from `--cluster-secret` (every start passes it again), not from the
    /// file beside the data.
    secret_given: bool,
    /// Set once the node founded, joined or rejoined its cluster.
    ready: watch::Sender<bool>,
    /// One admission at a time (Raft takes one membership change at a time).
    admit_lock: tokio::sync::Mutex<()>,
    /// Why the node could not take part in its cluster (a refused join): the server stops.
    fatal: watch::Sender<Option<String>>,
    /// Set once this node accepted an invitation to join another cluster.
    rejoin: watch::Sender<bool>,
    /// What this node runs (`--services`): told to the cluster when it joins.
    services: Services,
}

/// What opening the membership found: the node's id, whether it has never been in a
/// cluster and is to join one (it must hold nothing until the map gives it copies).
pub(crate) struct Opened {
    pub(crate) membership: Membership,
    pub(crate) node_id: u64,
    pub(crate) joining_new: bool,
}

impl Membership {
    /// Reads (or creates) the identity beside the data in `dir`, taking a pending
    /// invitation into account: a node invited while it held nothing leaves the one-node
    /// cluster it founded for the one that invited it. `has_collections` says whether the
    /// store holds any.
    pub(crate) fn open(dir: PathBuf, config: &ClusterConfig, has_collections: bool) -> Result<Opened, ClusterError> {
        let (mut join, mut secret) = (config.join.clone(), config.secret.clone());
        if let Some(invitation) = identity::join_request(&dir)? {
            if !has_collections {
                // The identity first, so a crash before the log is gone still joins.
                let mut identity = Identity::load_or_create(&dir)?;
                identity.cluster_id = None;
                identity.store(&dir)?;
                let meta_dir = dir.join("meta");
                if let Err(e) = std::fs::remove_dir_all(&meta_dir) {
                    if e.kind() != std::io::ErrorKind::NotFound {
                        return Err(ClusterError::Meta(format!("cannot remove {}: {e}", meta_dir.display())));
                    }
                }
                tracing::info!(join = %invitation.join, "joining the cluster that invited this node");
                join = Some(invitation.join);
                secret = Some(invitation.secret);
            } else {
                tracing::warn!("an invitation to join a cluster is dropped: collections were created here meanwhile");
                identity::clear_join_request(&dir);
            }
        }
        let identity = Identity::load_or_create(&dir)?;
        let founding = identity.cluster_id.is_none() && join.is_none();
        let joining_new = identity.cluster_id.is_none() && join.is_some();
        let secret_given = secret.is_some();
        let secret = identity::secret(&dir, secret.as_deref(), founding)?;
        let node_id = identity.node_id;
        let membership = Membership {
            dir,
            identity: Mutex::new(identity),
            join,
            secret,
            secret_given,
            ready: watch::channel(false).0,
            admit_lock: tokio::sync::Mutex::new(()),
            fatal: watch::channel(None).0,
            rejoin: watch::channel(false).0,
            services: config.services,
        };
        Ok(Opened { membership, node_id, joining_new })
    }

    /// The cluster secret.
    pub(crate) fn secret(&self) -> &str {
        &self.secret
    }

    /// The node has entered its cluster.
    pub(crate) fn set_ready(&self) {
        self.ready.send_replace(true);
    }

    /// The node cannot take part in its cluster, for `reason`.
    pub(crate) fn set_fatal(&self, reason: String) {
        self.fatal.send_replace(Some(reason));
    }

    /// Waits until the node has entered its cluster, at most until `deadline`; answers
    /// whether it has.
    pub(crate) async fn wait_ready(&self, deadline: tokio::time::Instant) -> bool {
        let mut ready = self.ready.subscribe();
        let entered = tokio::time::timeout_at(deadline, ready.wait_for(|r| *r)).await.is_ok();
        entered
    }
}

/// The metadata log's voters once node `joining` is admitted: it votes while there are
/// fewer than [`META_VOTERS_MAX`] voters; `None` when that changes nothing.
pub(crate) fn voters_after_admission(voters: &BTreeSet<u64>, joining: u64) -> Option<BTreeSet<u64>> {
    if voters.len() >= META_VOTERS_MAX || voters.contains(&joining) {
        return None;
    }
    let mut next = voters.clone();
    next.insert(joining);
    Some(next)
}

/// The metadata log's voters once the `ejected` members leave: they stop voting, and
/// learners that are active members (`active`) take their places, up to
/// [`META_VOTERS_MAX`]. `None` when no ejected member votes, or when no voter would be left.
pub(crate) fn voters_after_ejection(
    voters: &BTreeSet<u64>,
    learners: &BTreeSet<u64>,
    ejected: &[u64],
    active: impl Fn(u64) -> bool,
) -> Option<BTreeSet<u64>> {
    if !voters.iter().any(|v| ejected.contains(v)) {
        return None;
    }
    let mut next: BTreeSet<u64> = voters.iter().copied().filter(|v| !ejected.contains(v)).collect();
    for learner in learners.iter().copied().filter(|l| active(*l) && !ejected.contains(l)) {
        if next.len() >= META_VOTERS_MAX {
            break;
        }
        next.insert(learner);
    }
    if next.is_empty() {
        return None;
    }
    Some(next)
}

impl ClusterNode {
    /// Whether the node has founded, joined or rejoined its cluster.
    pub fn is_ready(&self) -> bool {
        *self.membership.ready.borrow()
    }

    /// Becomes `Some(reason)` when the node cannot take part in its cluster (a join was
    /// refused): the server stops with that reason.
    pub fn fatal(&self) -> watch::Receiver<Option<String>> {
        self.membership.fatal.subscribe()
    }

    /// Becomes `true` once this node accepted an invitation to join another cluster: the
    /// server restarts it, and the restart joins (see [`ClusterNode::open`]).
    pub fn rejoin(&self) -> watch::Receiver<bool> {
        self.membership.rejoin.subscribe()
    }

    /// `shoal cluster add`: asks the lone node at `address`, which holds no collections, to
    /// join this cluster; it restarts and joins as `added`, as `--join` would. `admin` is the
    /// `Authorization` value of an administrator of that node, which its server checks.
    /// Answers its node id once this node sees it as a member.
    pub async fn invite(&self, address: &str, admin: Option<String>) -> Result<NodeId, ClusterError> {
        if !self.is_ready() {
            return Err(ClusterError::Refused("this member is still starting".into()));
        }
        if let Some((id, _)) = self.state().members.iter().find(|(_, m)| m.address == address) {
            return Err(ClusterError::Refused(format!("node {} at {address} is already a member", id.0)));
        }
        let call = identity::InviteCall { join: self.advertise.clone(), secret: self.membership.secret.clone(), admin };
        let body = serde_json::to_vec(&call).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
        let bytes = match self.peers.call(address, Op::Invite, body, INVITE_CALL_TIMEOUT).await {
            Ok(bytes) => bytes,
            Err(PeerError::Refused { message, .. }) => {
                return Err(ClusterError::Refused(format!("the node at {address} refused: {message}")))
            }
            Err(e) => return Err(ClusterError::Peer(e)),
        };
        let answer: JoinRequest = serde_json::from_slice(&bytes).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
        let mut rx = self.meta.watch();
        let joined = async move { rx.wait_for(|s| s.members.contains_key(&answer.node)).await.is_ok() };
        match tokio::time::timeout(INVITE_WAIT, joined).await {
            Ok(true) => Ok(answer.node),
            Ok(false) => Err(ClusterError::ShuttingDown),
            Err(_) => Err(ClusterError::Refused(format!(
                "node {} at {address} accepted but was not admitted within {} s; see its log",
                answer.node,
                INVITE_WAIT.as_secs()
            ))),
        }
    }

    /// The invited side of [`ClusterNode::invite`]: only a lone node with no collections
    /// accepts (nothing it holds could be lost); it keeps the invitation and asks to be
    /// restarted.
    pub(crate) async fn accept_invitation(&self, body: &[u8]) -> Result<JoinRequest, ClusterError> {
        // Its administrator's credentials were checked by the server, and are dropped here.
        let call: identity::InviteCall = serde_json::from_slice(body).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
        let invitation = identity::Invitation { join: call.join, secret: call.secret };
        if !self.is_ready() {
            return Err(ClusterError::Refused("this node is still starting".into()));
        }
        let state = self.state();
        if state.members.keys().any(|id| *id != self.id) {
            return Err(ClusterError::Refused(format!(
                "this node is a member of a cluster of {} nodes; only a lone node can be added",
                state.members.len()
            )));
        }
        if !state.collections.is_empty() || !self.engine.store().list_collections().is_empty() {
            return Err(ClusterError::Refused(
                "this node holds collections; only a node without any can be added (start one on an empty --data-path)".into(),
            ));
        }
        if invitation.join == self.advertise {
            return Err(ClusterError::Refused("a node cannot add itself".into()));
        }
        if self.membership.secret_given && invitation.secret != self.membership.secret {
            // Every later start would pass its own secret again, and the cluster refuses it.
            return Err(ClusterError::Refused(
                "this node was started with --cluster-secret of another cluster; start it without one to be added".into(),
            ));
        }
        // The invitation comes without this node's secret: it is acted on only once the
        // cluster it names answers to the secret it carries, so a forged one changes nothing.
        let check = self.peers.call_with_secret(&invitation.secret, &invitation.join, Op::Identify, Vec::new(), INVITE_CHECK_TIMEOUT);
        if let Err(e) = check.await {
            return Err(ClusterError::Refused(format!("the invitation does not check out with the cluster it names: {e}")));
        }
        identity::store_join_request(&self.membership.dir, &invitation)?;
        tracing::info!(join = %invitation.join, "invited into a cluster; restarting to join it");
        self.membership.rejoin.send_replace(true);
        Ok(JoinRequest { node: self.id, address: self.advertise.clone(), services: self.membership.services })
    }

    pub(crate) async fn enter(&self) -> Result<(), ClusterError> {
        let known = self.membership.identity.lock().cluster_id.clone();
        if let Some(cluster) = known {
            // A copy of a member's data directory started elsewhere would claim that
            // member's id: refused (the member is known by its address). A lone member
            // may move: nothing else knows its address.
            let state = self.state();
            if let Some(me) = state.members.get(&self.id) {
                if state.members.len() > 1 && me.address != self.advertise {
                    return Err(ClusterError::Refused(format!(
                        "this data directory is node {}'s, which the cluster knows at {}, not at {}: a copied data directory \
                         cannot join as a second node; start on an empty --data-path to join as a new node, or at {} to come \
                         back as node {}",
                        self.id, me.address, self.advertise, me.address, self.id
                    )));
                }
            }
            if let Some(join) = &self.membership.join {
                // A data directory of another cluster must not be taken into this one.
                match self.peers.call(join, Op::Identify, Vec::new(), JOIN_TIMEOUT).await {
                    Ok(bytes) => {
                        let theirs: JoinAnswer = serde_json::from_slice(&bytes).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
                        if theirs.cluster_id != cluster {
                            return Err(ClusterError::Refused(format!(
                                "this data directory belongs to cluster {cluster}, and the member at {join} is in cluster {}: \
                                 start the node on an empty --data-path to join that cluster",
                                theirs.cluster_id
                            )));
                        }
                    }
                    Err(e) => tracing::info!(%join, error = %e, "cannot check the cluster to join; rejoining this node's own"),
                }
                tracing::info!(%join, cluster, "already a member; --join is ignored");
            }
            return Ok(());
        }
        match self.membership.join.clone() {
            Some(address) => self.join_cluster(&address).await,
            None => self.found().await,
        }
    }

    /// Founds a one-node cluster: this node votes alone, is `active`, holds every partition
    /// active, and brings its existing collections in under their ids.
    async fn found(&self) -> Result<(), ClusterError> {
        if !self.membership.services.data {
            return Err(ClusterError::Refused(
                "the first node of a cluster holds its data: start it with --services including data, and add index or query \
                 nodes to it with --join"
                    .into(),
            ));
        }
        match self.meta.initialize(BTreeMap::from([(self.id.0, self.advertise.clone())])).await {
            Ok(()) | Err(shoal_meta::InitializeError::AlreadyInitialized) => {}
            Err(e) => return Err(ClusterError::Meta(e.to_string())),
        }
        let cluster_id = format!("{:016x}", rand::random::<u64>());
        ignore_repeat(self.propose(MetaCommand::InitCluster { cluster_id }).await)?;
        ignore_repeat(
            self.propose(MetaCommand::AddMember { node: self.id, address: self.advertise.clone(), services: self.membership.services })
                .await,
        )?;
        self.propose(MetaCommand::SetMemberState { node: self.id, state: MemberState::Active }).await?;
        let store = self.engine.store();
        for info in store.list_collections() {
            if let Some(coll) = store.collection(&info.name) {
                let cmd = MetaCommand::CreateCollection { name: info.name.clone(), max_ttl: info.max_ttl, id: Some(coll.id()) };
                ignore_repeat(self.propose(cmd).await)?;
            }
        }
        for info in store.list_collections() {
            let Some(coll) = store.collection(&info.name) else { continue };
            for index in self.engine.indexes().list(&coll) {
                let definition = serde_json::to_value(&index.def).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
                let cmd = MetaCommand::CreateIndex { collection: info.name.clone(), name: index.def.name.clone(), definition };
                match self.propose(cmd).await {
                    Ok(_) | Err(ClusterError::Rejected(MetaReject::IndexExists { .. })) => {}
                    Err(e) => return Err(e),
                }
                if index.state != shoal_index::IndexState::Deferred {
                    let names = vec![index.def.name.clone()];
                    self.propose(MetaCommand::BuildIndexes { collection: info.name.clone(), names }).await?;
                }
            }
        }
        let state = self.state();
        if state.map.is_none() {
            let nodes = [shoal_cluster::Node { id: self.id, weight: 1 }];
            let mut map = shoal_cluster::place(store.partitions(), &nodes, state.settings.replicas, None)
                .map_err(|e| ClusterError::Refused(format!("cannot place partitions: {e}")))?;
            map.version = 1;
            ignore_repeat(self.propose(MetaCommand::SetMap { map }).await)?;
        }
        let cluster_id = self.state().cluster_id.clone();
        self.remember_cluster(cluster_id)
    }

    async fn join_cluster(&self, address: &str) -> Result<(), ClusterError> {
        let request =
            serde_json::to_vec(&JoinRequest { node: self.id, address: self.advertise.clone(), services: self.membership.services })
                .map_err(|e| ClusterError::BadMessage(e.to_string()))?;
        let deadline = Instant::now() + JOIN_TIMEOUT;
        loop {
            match self.peers.call(address, Op::Join, request.clone(), JOIN_TIMEOUT).await {
                Ok(bytes) => {
                    let answer: JoinAnswer = serde_json::from_slice(&bytes).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
                    tracing::info!(cluster = %answer.cluster_id, via = address, "joined");
                    return self.remember_cluster(answer.cluster_id);
                }
                Err(e @ PeerError::Refused { .. }) => {
                    // An invitation refused by the cluster is dropped: the next start founds
                    // a cluster of its own again.
                    identity::clear_join_request(&self.membership.dir);
                    return Err(ClusterError::Peer(e));
                }
                Err(e) if Instant::now() >= deadline => return Err(ClusterError::Peer(e)),
                Err(e) => {
                    tracing::info!(error = %e, "waiting for {address} to admit this node");
                    tokio::time::sleep(JOIN_RETRY).await;
                }
            }
        }
    }

    fn remember_cluster(&self, cluster_id: String) -> Result<(), ClusterError> {
        let mut identity = self.membership.identity.lock();
        identity.cluster_id = Some(cluster_id);
        identity.store(&self.membership.dir)?;
        identity::clear_join_request(&self.membership.dir);
        Ok(())
    }

    /// Admits a joining node: on the leader, adds it to the metadata (state `added`), as a
    /// learner of the log, and as a voter while there are fewer than `META_VOTERS_MAX`.
    /// Another member forwards the request to the leader.
    pub(crate) async fn admit(&self, req: JoinRequest) -> Result<JoinAnswer, ClusterError> {
        if !self.is_ready() {
            return Err(ClusterError::Refused("this member is still starting".into()));
        }
        if !self.is_leader() {
            let (_, address) = self.leader().ok_or(ClusterError::NoLeader(Duration::ZERO))?;
            let body = serde_json::to_vec(&req).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
            let bytes = self.peers.call(&address, Op::Join, body, JOIN_TIMEOUT).await?;
            return serde_json::from_slice(&bytes).map_err(|e| ClusterError::BadMessage(e.to_string()));
        }
        let _one = self.membership.admit_lock.lock().await;
        let state = self.state();
        match state.members.get(&req.node) {
            Some(m) if m.address == req.address => tracing::info!(node = req.node.0, "joining again; resuming its admission"),
            Some(m) => {
                return Err(ClusterError::Refused(format!(
                    "node id {} is already a member at {}: the joining node's data directory is that member's — a copied data \
                     directory cannot join as a second node; start on an empty --data-path to join as a new node",
                    req.node, m.address
                )))
            }
            None => {
                self.propose(MetaCommand::AddMember { node: req.node, address: req.address.clone(), services: req.services }).await?;
            }
        }
        self.meta.add_learner(req.node.0, req.address.clone()).await.map_err(|e| ClusterError::Meta(e.to_string()))?;
        let voters: BTreeSet<u64> = {
            let metrics = self.meta.metrics();
            let m = metrics.borrow();
            m.membership_config.membership().voter_ids().collect()
        };
        if let Some(next) = voters_after_admission(&voters, req.node.0) {
            self.meta.change_membership(next).await.map_err(|e| ClusterError::Meta(e.to_string()))?;
        }
        Ok(JoinAnswer { cluster_id: state.cluster_id.clone() })
    }

    /// Takes ejected members out of the metadata log's voters (they stay learners), and
    /// makes voters of other active members that are learners, up to `META_VOTERS_MAX`
    /// (leader only). An ejected member is pinged no more, so it vouches for no lease: left a
    /// voter, the leader's lease quorum counted it, and once two of four voters were ejected
    /// no lease could be had and every member refused to serve (tests/cluster_exact.rs, 3 -> 2
    /// after a swap). Shut down, as ejected nodes are, it would have cost the log its quorum.
    pub(crate) async fn retire_voters(&self, ejected: &[NodeId]) -> Result<(), ClusterError> {
        let ejected: Vec<u64> = ejected.iter().map(|n| n.0).collect();
        let (voters, learners): (BTreeSet<u64>, BTreeSet<u64>) = {
            let metrics = self.meta.metrics();
            let m = metrics.borrow();
            let membership = m.membership_config.membership();
            (membership.voter_ids().collect(), membership.learner_ids().collect())
        };
        let state = self.state();
        let active = |id: u64| state.members.get(&NodeId(id)).is_some_and(|m| m.state == MemberState::Active);
        let Some(next) = voters_after_ejection(&voters, &learners, &ejected, active) else { return Ok(()) };
        tracing::info!(?voters, ?next, "ejected members leave the metadata log's voters");
        self.meta.change_membership(next).await.map_err(|e| ClusterError::Meta(e.to_string()))
    }
}

/// A command repeated after a restart (this node founded the cluster but crashed before it
/// recorded so) finds its effect there already.
fn ignore_repeat(r: Result<MetaResponse, ClusterError>) -> Result<(), ClusterError> {
    match r {
        Ok(_)
        | Err(ClusterError::Rejected(
            MetaReject::ClusterNamed { .. }
            | MetaReject::MemberExists { .. }
            | MetaReject::CollectionExists { .. }
            | MetaReject::MapVersion { .. },
        )) => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(items: &[u64]) -> BTreeSet<u64> {
        items.iter().copied().collect()
    }

    #[test]
    fn a_joining_node_votes_while_there_are_fewer_than_the_most_voters() {
        assert_eq!(voters_after_admission(&ids(&[1]), 2), Some(ids(&[1, 2])));
        assert_eq!(voters_after_admission(&ids(&[1, 2]), 2), None, "votes already");
        assert_eq!(voters_after_admission(&ids(&[1, 2, 3, 4, 5]), 6), None, "a learner beyond META_VOTERS_MAX");
    }

    #[test]
    fn ejected_voters_leave_and_active_learners_take_their_places() {
        let all_active = |_: u64| true;
        // (what, voters, learners, ejected, voters after)
        type Case<'a> = (&'a str, &'a [u64], &'a [u64], &'a [u64], Option<BTreeSet<u64>>);
        let cases: [Case<'_>; 5] = [
            ("no ejected voter: nothing changes", &[1, 2, 3], &[4], &[4], None),
            ("an ejected voter leaves", &[1, 2, 3], &[], &[3], Some(ids(&[1, 2]))),
            ("a learner takes its place", &[1, 2, 3, 4, 5], &[6], &[5], Some(ids(&[1, 2, 3, 4, 6]))),
            ("at most META_VOTERS_MAX", &[1, 2, 3, 4, 5], &[6, 7, 8], &[5], Some(ids(&[1, 2, 3, 4, 6]))),
            ("no voter would be left", &[1], &[], &[1], None),
        ];
        for (name, voters, learners, ejected, want) in cases {
            assert_eq!(voters_after_ejection(&ids(voters), &ids(learners), ejected, all_active), want, "{name}");
        }
        let only_7 = |id: u64| id == 7;
        assert_eq!(voters_after_ejection(&ids(&[1, 2]), &ids(&[6, 7]), &[2], only_7), Some(ids(&[1, 7])), "only active learners");
    }
}
