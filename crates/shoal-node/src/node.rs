//! `ClusterNode`: this node as a cluster member. It founds a cluster (`shoal serve` alone)
//! or joins one (`--join`), proposes metadata changes to the leader, and applies every
//! committed change to its engine in one reconcile loop: collections with the ids the log
//! gave them, the partition map as partition states, and the replication streams those
//! states need.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use shoal_cluster::{NodeId, PartitionMap};
use shoal_engine::Engine;
use shoal_meta::{MemberState, MetaCommand, MetaNode, MetaReject, MetaResponse, MetaState, ProposeError};
use shoal_storage::{PartitionState, StreamPosition};
use tokio::sync::watch;

use crate::acks::{Acks, Need, Part};
use crate::identity::{self, Identity};
use crate::peers::{MetaPeers, Op, PeerError, Peers};
use crate::wire::{self, JoinAnswer, JoinRequest, ProposeAnswer};
use crate::ClusterError;
use shoal_cluster::{majority, Copies};

/// How long a proposal looks for a leader before it gives up.
pub const PROPOSE_TIMEOUT: Duration = Duration::from_secs(10);
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
/// A majority write or read waits this long for the replicas by default; then it answers
/// `timeout`, ambiguous (the write may yet be on a majority).
pub const DURABLE_TIMEOUT: Duration = Duration::from_secs(5);
/// A replica that acknowledged nothing for this long is not counted as able to take part
/// in a majority: a write that needs it answers `durability_impossible` at once.
pub const HEALTHY_ACK_WINDOW: Duration = Duration::from_secs(3);
/// A replica not heard from at all since the map last changed (its first pull of the new
/// map is on its way) gets this long to be heard before a majority call counts it out:
/// right after a rebalance or failover, a majority write waits for it rather than being
/// refused. A replica heard from and then silent is counted out at once.
pub const UNHEARD_REPLICA_GRACE: Duration = Duration::from_secs(5);
/// How long a request that reaches a node still entering its cluster (founding, joining
/// or rejoining after a restart) waits for it to serve before it is refused.
pub const STARTUP_WAIT: Duration = Duration::from_secs(10);
/// The longest map delay fault injection takes (`ClusterNode::delay_maps`).
pub const MAP_DELAY_MAX: Duration = Duration::from_secs(30);
/// Copies a map moved away are retired at once (dead, never served, in one durable write)
/// and their data discarded this long after: on the sources of a bench add, the discards (a
/// keyspace deleted and another created, 5–15 ms apiece, 115–167 ms per source) ran just
/// as the new map took effect everywhere, and majority writes — to every partition, moved
/// or not — waited up to 79–124 ms then; discarded a second later, 6.5 and 6.7 ms at most,
/// and 2.8 ms while the discard ran (bench/results/2026-11-28-issue14-discard-after-hand-over.md).
pub const DISCARD_AFTER: Duration = Duration::from_secs(1);
/// The reconcile loop tries again after a failure this often.
const RECONCILE_RETRY: Duration = Duration::from_secs(1);
/// Time between looks when a caller waits for this node to apply something.
const APPLY_POLL: Duration = Duration::from_millis(10);

/// How this node takes part in a cluster.
#[derive(Clone, Debug, Default)]
pub struct ClusterConfig {
    /// The address other members and smart clients reach this node at (`host:port`).
    pub advertise: String,
    /// A member to ask for admission (`--join`); `None` founds a cluster on first start.
    pub join: Option<String>,
    /// The cluster secret (`--cluster-secret`); else the one stored beside the data.
    pub secret: Option<String>,
    /// Build every new copy here from the change stream, never from files (`serve
    /// --copy-by-stream`, hidden): for the benchmark's stream figure and for tests.
    pub copy_by_stream: bool,
    /// Ask for a new copy's snapshot as records, not as the keyspace's files (`serve
    /// --copy-by-records`, hidden): for the benchmark's comparison.
    pub copy_by_records: bool,
    /// Copies here move as fast as they can, without the elastic budget that yields to
    /// requests (`serve --copy-unpaced`, hidden): for the benchmark's comparison.
    pub copy_unpaced: bool,
}

/// Where a request for a key goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// This node holds the active copy.
    Local,
    /// Another node does, at this address.
    Forward { node: u64, address: String },
    /// No node serves the partition now (its active was failed over and no replica could
    /// take it, or a failover is in progress).
    Unavailable { partition: u16, map_version: u64 },
}

/// How durable a write must be before it is acknowledged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durable {
    /// In memory on a majority of the partition's copies.
    Majority,
    /// Fsynced on a majority of the partition's copies.
    PersistMajority,
}

/// Why a majority wait failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MajorityError {
    /// Too few copies are healthy to make a majority: nothing was waited for.
    Impossible { healthy: usize, needed: usize },
    /// The copies did not answer in time: the write may or may not reach a majority.
    Timeout,
    /// This node stopped being the partition's active while waiting.
    NotActive,
}

/// See [`ClusterNode::stats`].
#[derive(Clone, Debug)]
pub struct ClusterStats {
    pub partitions: Vec<(&'static str, usize)>,
    pub replicas: Vec<ReplicaLag>,
    pub map_version: u64,
    /// Copies moved away and retired (never served again) whose data is not yet
    /// discarded: nonzero for about `DISCARD_AFTER` after a hand-over, and until the next
    /// start after a crash.
    pub retired: usize,
}

/// How far one replica is behind this node's active copies.
#[derive(Clone, Debug)]
pub struct ReplicaLag {
    pub replica: u64,
    /// Changes not yet acknowledged, summed over partitions and collections.
    pub seqnos: u64,
    /// Since when the most lagging copy has not acknowledged (0 when caught up).
    pub seconds: f64,
}

/// One member of the cluster; see the module documentation.
pub struct ClusterNode {
    pub(crate) engine: Arc<Engine>,
    pub(crate) id: u64,
    dir: PathBuf,
    identity: Mutex<Identity>,
    pub(crate) advertise: String,
    join: Option<String>,
    secret: String,
    /// The secret came from `--cluster-secret` (every start passes it again), not from the
    /// file beside the data.
    secret_given: bool,
    pub(crate) meta: MetaNode,
    pub(crate) peers: Arc<dyn Peers>,
    pub(crate) acks: Acks,
    /// Held while a replication batch is applied, and by a fence report: once a member has
    /// reported its progress to the leader, no batch from the fenced node lands after it.
    pub(crate) apply_lock: tokio::sync::Mutex<()>,
    /// Running replication streams, by the node they pull from.
    replicators: Mutex<HashMap<u64, watch::Sender<bool>>>,
    /// Partitions this node holds active but was asked to hand over (a rebalance): writes
    /// stop until the new map is in.
    pub(crate) frozen: Mutex<HashMap<u16, Instant>>,
    /// Held while the map is applied (`apply_current_map`): one application at a time.
    applying: tokio::sync::Mutex<()>,
    /// The map version this node's copies follow (their states set by `apply_map`): a
    /// moment behind the metadata it has applied, and what a request routed here waits for.
    store_map: tokio::sync::watch::Sender<u64>,
    /// Until when this node may serve its active partitions (see `failover::Lease`).
    pub(crate) lease: crate::failover::Lease,
    /// Set once the node founded, joined or rejoined its cluster.
    ready: watch::Sender<bool>,
    /// Whether this node has served since it started: until then a request that finds it
    /// not serving waits for it (`serving_soon`), after that it is answered at once.
    served: std::sync::atomic::AtomicBool,
    /// One admission at a time (Raft takes one membership change at a time).
    admit_lock: tokio::sync::Mutex<()>,
    /// Why the node could not take part in its cluster (a refused join): the server stops.
    fatal: watch::Sender<Option<String>>,
    /// Set once this node accepted an invitation to join another cluster.
    rejoin: watch::Sender<bool>,
    pub(crate) stop: watch::Sender<bool>,
    /// The leader's view of members' health (auto-failover), and serialises failovers.
    pub(crate) monitor: crate::failover::Monitor,
    pub(crate) rebalancer: crate::rebalance::Rebalancer,
    /// Copies of partitions being built here from files (`copy`).
    pub(crate) copies: crate::copy::Copies,
    /// Fault injection only: collections (by id) whose replicated changes this node leaves
    /// unapplied, as a replica lagging in one collection would.
    held: Mutex<std::collections::HashSet<u32>>,
    /// Fault injection: how long each map waits before the partition states follow it.
    map_delay: Mutex<Duration>,
}

impl ClusterNode {
    /// Opens the metadata log of the node whose engine is `engine`. A node that has never
    /// been in a cluster and is to join one holds nothing until the map gives it copies: its
    /// partitions are set dead here, before it serves anything.
    /// `peers` makes the transport to other members from the cluster secret.
    pub async fn open(
        engine: Arc<Engine>,
        config: ClusterConfig,
        peers: impl FnOnce(&str) -> Result<Arc<dyn Peers>, ClusterError>,
    ) -> Result<Arc<ClusterNode>, ClusterError> {
        let dir = engine.store().data_paths()[0].clone();
        let mut config = config;
        if let Some(invitation) = identity::join_request(&dir)? {
            if engine.store().list_collections().is_empty() {
                // Leaves the one-node cluster it founded (it held nothing) for the one that
                // invited it: the identity first, so a crash before the log is gone still joins.
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
                config.join = Some(invitation.join);
                config.secret = Some(invitation.secret);
            } else {
                tracing::warn!("an invitation to join a cluster is dropped: collections were created here meanwhile");
                identity::clear_join_request(&dir);
            }
        }
        let identity = Identity::load_or_create(&dir)?;
        let founding = identity.cluster_id.is_none() && config.join.is_none();
        let secret_given = config.secret.is_some();
        let secret = identity::secret(&dir, config.secret.as_deref(), founding)?;
        let peers = peers(&secret)?;
        if identity.cluster_id.is_none() && config.join.is_some() {
            let store = Arc::clone(engine.store());
            blocking(move || {
                for p in 0..store.partitions() {
                    store.set_partition_state(p, PartitionState::Dead).map_err(|e| ClusterError::Storage(e.to_string()))?;
                }
                Ok::<_, ClusterError>(())
            })
            .await??;
        }
        let meta_dir = dir.join("meta");
        std::fs::create_dir_all(&meta_dir).map_err(|e| ClusterError::Meta(format!("cannot create {}: {e}", meta_dir.display())))?;
        let meta = MetaNode::open(&meta_dir, identity.node_id, Arc::new(MetaPeers(Arc::clone(&peers))), crate::failover::LEASE)
            .await
            .map_err(|e| ClusterError::Meta(e.to_string()))?;
        Ok(Arc::new(ClusterNode {
            engine,
            id: identity.node_id,
            dir,
            identity: Mutex::new(identity),
            advertise: config.advertise,
            join: config.join,
            secret,
            secret_given,
            meta,
            peers,
            acks: Acks::default(),
            apply_lock: tokio::sync::Mutex::new(()),
            replicators: Mutex::new(HashMap::new()),
            frozen: Mutex::new(HashMap::new()),
            applying: tokio::sync::Mutex::new(()),
            store_map: tokio::sync::watch::Sender::new(0),
            rebalancer: crate::rebalance::Rebalancer::default(),
            copies: crate::copy::Copies::new(config.copy_by_stream, config.copy_by_records, config.copy_unpaced),
            lease: crate::failover::Lease::default(),
            ready: watch::channel(false).0,
            served: std::sync::atomic::AtomicBool::new(false),
            fatal: watch::channel(None).0,
            rejoin: watch::channel(false).0,
            admit_lock: tokio::sync::Mutex::new(()),
            stop: watch::channel(false).0,
            monitor: crate::failover::Monitor::default(),
            held: Mutex::new(std::collections::HashSet::new()),
            map_delay: Mutex::new(Duration::ZERO),
        }))
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn secret(&self) -> &str {
        &self.secret
    }

    pub fn address(&self) -> &str {
        &self.advertise
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// The metadata this node has applied.
    pub fn state(&self) -> Arc<MetaState> {
        self.meta.state()
    }

    /// The metadata leader this node knows of, with its address.
    pub fn leader(&self) -> Option<(u64, String)> {
        let id = self.meta.leader()?;
        let metrics = self.meta.metrics();
        let m = metrics.borrow();
        let address = m.membership_config.membership().get_node(&id).map(|n| n.addr.clone())?;
        Some((id, address))
    }

    pub fn is_leader(&self) -> bool {
        self.meta.leader() == Some(self.id)
    }

    /// Whether the node has founded, joined or rejoined its cluster.
    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// Founds, joins or rejoins the cluster, then keeps the engine in step with the
    /// metadata until `shutdown`. Runs in the background; the server serves meanwhile (it
    /// must: a leader admitting this node sends it the log).
    pub fn start(self: &Arc<Self>) {
        let node = Arc::clone(self);
        tokio::spawn(async move {
            let mut stop = node.stop.subscribe();
            let started = tokio::select! {
                r = node.enter() => r,
                _ = stop.wait_for(|s| *s) => return,
            };
            if let Err(e) = started {
                tracing::error!(error = %e, "cannot take part in the cluster");
                node.fatal.send_replace(Some(e.to_string()));
                return;
            }
            node.ready.send_replace(true);
            tracing::info!(node = node.id, address = %node.advertise, "in the cluster");
            tokio::spawn(crate::failover::run_monitor(Arc::clone(&node)));
            // Copies retired before a restart and not discarded yet.
            node.discard_later();
            node.reconcile_loop().await;
        });
    }

    /// Becomes `Some(reason)` when the node cannot take part in its cluster (a join was
    /// refused): the server stops with that reason.
    pub fn fatal(&self) -> watch::Receiver<Option<String>> {
        self.fatal.subscribe()
    }

    /// Becomes `true` once this node accepted an invitation to join another cluster: the
    /// server restarts it, and the restart joins (see [`ClusterNode::open`]).
    pub fn rejoin(&self) -> watch::Receiver<bool> {
        self.rejoin.subscribe()
    }

    /// `shoal cluster add`: asks the lone node at `address`, which holds no collections, to
    /// join this cluster; it restarts and joins as `added`, as `--join` would. Answers its
    /// node id once this node sees it as a member.
    pub async fn invite(&self, address: &str) -> Result<u64, ClusterError> {
        if !self.is_ready() {
            return Err(ClusterError::Refused("this member is still starting".into()));
        }
        if let Some((id, _)) = self.state().members.iter().find(|(_, m)| m.address == address) {
            return Err(ClusterError::Refused(format!("node {} at {address} is already a member", id.0)));
        }
        let invitation = identity::Invitation { join: self.advertise.clone(), secret: self.secret.clone() };
        let body = serde_json::to_vec(&invitation).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
        let bytes = match self.peers.call(address, Op::Invite, body, INVITE_CALL_TIMEOUT).await {
            Ok(bytes) => bytes,
            Err(PeerError::Refused { message, .. }) => {
                return Err(ClusterError::Refused(format!("the node at {address} refused: {message}")))
            }
            Err(e) => return Err(ClusterError::Peer(e)),
        };
        let answer: JoinRequest = serde_json::from_slice(&bytes).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
        let mut rx = self.meta.watch();
        let joined = async move { rx.wait_for(|s| s.members.contains_key(&NodeId(answer.node))).await.is_ok() };
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
    async fn accept_invitation(&self, body: &[u8]) -> Result<JoinRequest, ClusterError> {
        let invitation: identity::Invitation = serde_json::from_slice(body).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
        if !self.is_ready() {
            return Err(ClusterError::Refused("this node is still starting".into()));
        }
        let state = self.state();
        if state.members.keys().any(|id| id.0 != self.id) {
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
        if self.secret_given && invitation.secret != self.secret {
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
        identity::store_join_request(&self.dir, &invitation)?;
        tracing::info!(join = %invitation.join, "invited into a cluster; restarting to join it");
        self.rejoin.send_replace(true);
        Ok(JoinRequest { node: self.id, address: self.advertise.clone() })
    }

    /// Stops the background work (replication, the monitor) and the metadata log.
    pub async fn shutdown(&self) {
        self.stop.send_replace(true);
        for (_, stop) in self.replicators.lock().drain() {
            stop.send_replace(true);
        }
        if let Err(e) = self.meta.shutdown().await {
            tracing::warn!(error = %e, "stopping the metadata log");
        }
    }

    async fn enter(&self) -> Result<(), ClusterError> {
        let known = self.identity.lock().cluster_id.clone();
        if let Some(cluster) = known {
            // A copy of a member's data directory started elsewhere would claim that
            // member's id: refused (the member is known by its address). A lone member
            // may move: nothing else knows its address.
            let state = self.state();
            if let Some(me) = state.members.get(&NodeId(self.id)) {
                if state.members.len() > 1 && me.address != self.advertise {
                    return Err(ClusterError::Refused(format!(
                        "this data directory is node {}'s, which the cluster knows at {}, not at {}: a copied data directory \
                         cannot join as a second node; start on an empty --data-path to join as a new node, or at {} to come \
                         back as node {}",
                        self.id, me.address, self.advertise, me.address, self.id
                    )));
                }
            }
            if let Some(join) = &self.join {
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
        match self.join.clone() {
            Some(address) => self.join_cluster(&address).await,
            None => self.found().await,
        }
    }

    /// Founds a one-node cluster: this node votes alone, is `active`, holds every partition
    /// active, and brings its existing collections in under their ids.
    async fn found(&self) -> Result<(), ClusterError> {
        match self.meta.initialize(BTreeMap::from([(self.id, self.advertise.clone())])).await {
            Ok(()) | Err(shoal_meta::InitializeError::AlreadyInitialized) => {}
            Err(e) => return Err(ClusterError::Meta(e.to_string())),
        }
        let cluster_id = format!("{:016x}", rand::random::<u64>());
        ignore_repeat(self.propose(MetaCommand::InitCluster { cluster_id }).await)?;
        ignore_repeat(self.propose(MetaCommand::AddMember { node: NodeId(self.id), address: self.advertise.clone() }).await)?;
        self.propose(MetaCommand::SetMemberState { node: NodeId(self.id), state: MemberState::Active }).await?;
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
            let nodes = [shoal_cluster::Node { id: NodeId(self.id), weight: 1 }];
            let mut map = shoal_cluster::place(store.partitions(), &nodes, state.settings.replicas, None)
                .map_err(|e| ClusterError::Refused(format!("cannot place partitions: {e}")))?;
            map.version = 1;
            ignore_repeat(self.propose(MetaCommand::SetMap { map }).await)?;
        }
        let cluster_id = self.state().cluster_id.clone();
        self.remember_cluster(cluster_id)
    }

    async fn join_cluster(&self, address: &str) -> Result<(), ClusterError> {
        let request = serde_json::to_vec(&JoinRequest { node: self.id, address: self.advertise.clone() })
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
                    identity::clear_join_request(&self.dir);
                    return Err(ClusterError::Peer(e));
                }
                Err(e) if Instant::now() >= deadline => return Err(ClusterError::Peer(e)),
                Err(e) => {
                    tracing::info!(error = %e, "waiting for {address} to admit this node");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }

    fn remember_cluster(&self, cluster_id: String) -> Result<(), ClusterError> {
        let mut identity = self.identity.lock();
        identity.cluster_id = Some(cluster_id);
        identity.store(&self.dir)?;
        identity::clear_join_request(&self.dir);
        Ok(())
    }

    /// Commits `cmd` through the metadata leader (forwarding it there) and answers the
    /// leader's result. This node may apply it a moment later; see [`ClusterNode::wait_applied`].
    pub async fn propose(&self, cmd: MetaCommand) -> Result<MetaResponse, ClusterError> {
        let deadline = Instant::now() + PROPOSE_TIMEOUT;
        loop {
            let address = match self.meta.propose(cmd.clone()).await {
                Ok(r) => return Ok(r),
                Err(ProposeError::Rejected(r)) => return Err(ClusterError::Rejected(r)),
                Err(ProposeError::NotLeader { address, .. }) => address,
                Err(ProposeError::Unavailable(why)) => {
                    tracing::debug!(why, "metadata log unavailable; retrying");
                    None
                }
            };
            if let Some(address) = address.filter(|a| *a != self.advertise) {
                let body = serde_json::to_vec(&cmd).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
                match self.peers.call(&address, Op::Propose, body, PROPOSE_TIMEOUT).await {
                    Ok(bytes) => match serde_json::from_slice::<ProposeAnswer>(&bytes) {
                        Ok(ProposeAnswer::Applied(r)) => return Ok(r),
                        Ok(ProposeAnswer::Rejected(r)) => return Err(ClusterError::Rejected(r)),
                        Ok(_) => {}
                        Err(e) => return Err(ClusterError::BadMessage(e.to_string())),
                    },
                    Err(e) => tracing::debug!(error = %e, "forwarding a proposal"),
                }
            }
            if Instant::now() >= deadline {
                return Err(ClusterError::NoLeader(PROPOSE_TIMEOUT));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until this node's applied metadata satisfies `done` (bounded by `PROPOSE_TIMEOUT`).
    pub async fn wait_applied(&self, done: impl Fn(&MetaState) -> bool) -> Result<(), ClusterError> {
        let mut rx = self.meta.watch();
        let wait = async move { rx.wait_for(|s| done(s)).await.map(|_| ()) };
        match tokio::time::timeout(PROPOSE_TIMEOUT, wait).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(_)) => Err(ClusterError::ShuttingDown),
            Err(_) => Err(ClusterError::NoLeader(PROPOSE_TIMEOUT)),
        }
    }

    /// Creates a collection cluster-wide and waits until this node has it.
    pub async fn create_collection(&self, name: &str, max_ttl: u32) -> Result<(), ClusterError> {
        let r = self.propose(MetaCommand::CreateCollection { name: name.into(), max_ttl, id: None }).await?;
        let MetaResponse::CollectionCreated { id } = r else { return Err(ClusterError::Meta(format!("unexpected answer {r:?}"))) };
        self.wait_local(|| self.engine.store().collection(name).is_some_and(|c| c.id() == id)).await
    }

    /// Drops a collection cluster-wide and waits until this node has dropped it.
    pub async fn drop_collection(&self, name: &str) -> Result<(), ClusterError> {
        self.propose(MetaCommand::DropCollection { name: name.into() }).await?;
        self.wait_local(|| self.engine.store().collection(name).is_none()).await
    }

    /// Defines an index cluster-wide (the log gives its id) and waits until this node has it;
    /// answers its status here.
    pub async fn create_index(
        &self,
        coll: &Arc<shoal_storage::Collection>,
        name: &str,
        definition: serde_json::Value,
    ) -> Result<shoal_index::IndexStatus, ClusterError> {
        let cmd = MetaCommand::CreateIndex { collection: coll.name().to_string(), name: name.to_string(), definition };
        self.propose(cmd).await?;
        let indexes = self.engine.indexes();
        self.wait_local(|| indexes.list(coll).iter().any(|s| s.def.name == name)).await?;
        indexes.list(coll).into_iter().find(|s| s.def.name == name).ok_or_else(|| ClusterError::Refused("the index went away".into()))
    }

    /// Starts building deferred indexes cluster-wide (every member, and every member that
    /// creates them later) and waits until this node has started; answers their status here.
    pub async fn build_indexes(
        &self,
        coll: &Arc<shoal_storage::Collection>,
        names: &[String],
    ) -> Result<Vec<shoal_index::IndexStatus>, ClusterError> {
        if names.is_empty() {
            return Err(ClusterError::Index(shoal_index::IndexError::Invalid("no index names given".into())));
        }
        self.propose(MetaCommand::BuildIndexes { collection: coll.name().to_string(), names: names.to_vec() }).await?;
        let indexes = self.engine.indexes();
        let started = |list: &[shoal_index::IndexStatus]| {
            names.iter().all(|n| list.iter().any(|s| &s.def.name == n && s.state != shoal_index::IndexState::Deferred))
        };
        self.wait_local(|| started(&indexes.list(coll))).await?;
        let list = indexes.list(coll);
        names
            .iter()
            .map(|n| list.iter().find(|s| &s.def.name == n).cloned().ok_or_else(|| ClusterError::Refused(format!("index {n} went away"))))
            .collect()
    }

    /// Drops an index cluster-wide and waits until this node has dropped it.
    pub async fn drop_index(&self, coll: &Arc<shoal_storage::Collection>, name: &str) -> Result<(), ClusterError> {
        self.propose(MetaCommand::DropIndex { collection: coll.name().to_string(), name: name.to_string() }).await?;
        let indexes = self.engine.indexes();
        self.wait_local(|| !indexes.list(coll).iter().any(|s| s.def.name == name)).await
    }

    async fn wait_local(&self, done: impl Fn() -> bool) -> Result<(), ClusterError> {
        let deadline = Instant::now() + PROPOSE_TIMEOUT;
        while !done() {
            if Instant::now() >= deadline {
                return Err(ClusterError::Timeout("the change is committed but this node has not applied it yet; try again".into()));
            }
            tokio::time::sleep(APPLY_POLL).await;
        }
        Ok(())
    }

    /// Answers a call from another member (the server checked the cluster secret).
    pub async fn handle(self: &Arc<Self>, op: Op, body: &[u8]) -> Result<Vec<u8>, ClusterError> {
        match op {
            Op::Raft(kind) => self.meta.handle_rpc(kind, body).await.map_err(|e| ClusterError::BadMessage(e.to_string())),
            Op::Invite => {
                let answer = self.accept_invitation(body).await?;
                serde_json::to_vec(&answer).map_err(|e| ClusterError::BadMessage(e.to_string()))
            }
            Op::Join => {
                let req: JoinRequest = serde_json::from_slice(body).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
                let answer = self.admit(req).await?;
                serde_json::to_vec(&answer).map_err(|e| ClusterError::BadMessage(e.to_string()))
            }
            Op::Propose => {
                let cmd: MetaCommand = serde_json::from_slice(body).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
                let answer = match self.meta.propose(cmd).await {
                    Ok(r) => ProposeAnswer::Applied(r),
                    Err(ProposeError::Rejected(r)) => ProposeAnswer::Rejected(r),
                    Err(ProposeError::NotLeader { address, .. }) => ProposeAnswer::NotLeader { address },
                    Err(ProposeError::Unavailable(why)) => ProposeAnswer::Unavailable(why),
                };
                serde_json::to_vec(&answer).map_err(|e| ClusterError::BadMessage(e.to_string()))
            }
            Op::Pull => {
                let req = wire::decode(body).map_err(ClusterError::BadMessage)?;
                let answer = crate::replica::serve_pull(self, req).await?;
                Ok(wire::encode(&answer))
            }
            Op::Versions => {
                let req = wire::decode(body).map_err(ClusterError::BadMessage)?;
                let answer = crate::replica::serve_versions(self, req).await?;
                Ok(wire::encode(&answer))
            }
            Op::Fence => {
                let req = serde_json::from_slice(body).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
                let answer = crate::failover::serve_fence(self, req).await?;
                serde_json::to_vec(&answer).map_err(|e| ClusterError::BadMessage(e.to_string()))
            }
            Op::CatchUp => {
                let req = serde_json::from_slice(body).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
                crate::failover::serve_catch_up(self, req).await?;
                Ok(b"{}".to_vec())
            }
            Op::Identify => {
                let answer = JoinAnswer { cluster_id: self.state().cluster_id.clone() };
                serde_json::to_vec(&answer).map_err(|e| ClusterError::BadMessage(e.to_string()))
            }
            Op::Progress => {
                let answer = crate::rebalance::serve_progress(self);
                serde_json::to_vec(&answer).map_err(|e| ClusterError::BadMessage(e.to_string()))
            }
            Op::Handover => {
                let req = serde_json::from_slice(body).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
                crate::rebalance::serve_handover(self, req).await?;
                Ok(b"{}".to_vec())
            }
            Op::Ping => {
                let answer = crate::failover::serve_ping(self, body)?;
                serde_json::to_vec(&answer).map_err(|e| ClusterError::BadMessage(e.to_string()))
            }
            Op::Docs => {
                let req = wire::decode(body).map_err(ClusterError::BadMessage)?;
                let answer = crate::sql::serve_docs(self, req).await?;
                Ok(wire::encode(&answer))
            }
            Op::Export => Err(ClusterError::BadMessage("an export answers as a stream (`export_stream`)".into())),
        }
    }

    /// The streamed calls: an export of a partition (`copy::serve_export`), as chunks.
    pub fn export_stream(
        self: &Arc<Self>,
        body: &[u8],
    ) -> Result<tokio::sync::mpsc::Receiver<Result<crate::copy::Outgoing, ClusterError>>, ClusterError> {
        crate::copy::serve_export(self, body)
    }

    /// Admits a joining node: on the leader, adds it to the metadata (state `added`), as a
    /// learner of the log, and as a voter while there are fewer than `META_VOTERS_MAX`.
    /// Another member forwards the request to the leader.
    async fn admit(&self, req: JoinRequest) -> Result<JoinAnswer, ClusterError> {
        if !self.is_ready() {
            return Err(ClusterError::Refused("this member is still starting".into()));
        }
        if !self.is_leader() {
            let (_, address) = self.leader().ok_or(ClusterError::NoLeader(Duration::ZERO))?;
            let body = serde_json::to_vec(&req).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
            let bytes = self.peers.call(&address, Op::Join, body, JOIN_TIMEOUT).await?;
            return serde_json::from_slice(&bytes).map_err(|e| ClusterError::BadMessage(e.to_string()));
        }
        let _one = self.admit_lock.lock().await;
        let state = self.state();
        match state.members.get(&NodeId(req.node)) {
            Some(m) if m.address == req.address => tracing::info!(node = req.node, "joining again; resuming its admission"),
            Some(m) => {
                return Err(ClusterError::Refused(format!(
                    "node id {} is already a member at {}: the joining node's data directory is that member's — a copied data \
                     directory cannot join as a second node; start on an empty --data-path to join as a new node",
                    req.node, m.address
                )))
            }
            None => {
                self.propose(MetaCommand::AddMember { node: NodeId(req.node), address: req.address.clone() }).await?;
            }
        }
        self.meta.add_learner(req.node, req.address.clone()).await.map_err(|e| ClusterError::Meta(e.to_string()))?;
        let voters: BTreeSet<u64> = {
            let metrics = self.meta.metrics();
            let m = metrics.borrow();
            m.membership_config.membership().voter_ids().collect()
        };
        if voters.len() < META_VOTERS_MAX && !voters.contains(&req.node) {
            let mut next = voters;
            next.insert(req.node);
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
    pub(crate) async fn retire_voters(&self, ejected: &[u64]) -> Result<(), ClusterError> {
        let (voters, learners): (BTreeSet<u64>, BTreeSet<u64>) = {
            let metrics = self.meta.metrics();
            let m = metrics.borrow();
            let membership = m.membership_config.membership();
            (membership.voter_ids().collect(), membership.learner_ids().collect())
        };
        if !voters.iter().any(|v| ejected.contains(v)) {
            return Ok(());
        }
        let state = self.state();
        let active = |id: &u64| state.members.get(&NodeId(*id)).is_some_and(|m| m.state == MemberState::Active) && !ejected.contains(id);
        let mut next: BTreeSet<u64> = voters.iter().copied().filter(|v| !ejected.contains(v)).collect();
        for learner in learners.iter().filter(|l| active(l)) {
            if next.len() >= META_VOTERS_MAX {
                break;
            }
            next.insert(*learner);
        }
        if next.is_empty() {
            return Ok(());
        }
        tracing::info!(?voters, ?next, "ejected members leave the metadata log's voters");
        self.meta.change_membership(next).await.map_err(|e| ClusterError::Meta(e.to_string()))
    }

    /// Where a request for `key` goes.
    pub fn route(&self, key: &[u8]) -> Route {
        let state = self.state();
        let Some(map) = &state.map else { return Route::Local };
        let p = shoal_storage::partition_of(key, map.partition_count());
        self.route_partition(&state, map, p)
    }

    /// Which partitions this node holds active, by number; `None` when it holds them all
    /// (no map yet, or a one-node cluster).
    pub fn actives_here(&self) -> Option<Vec<bool>> {
        self.actives_here_in(&self.state())
    }

    /// [`ClusterNode::actives_here`] by `state`'s map (one look at the metadata for a read
    /// pinned to one map version).
    pub fn actives_here_in(&self, state: &MetaState) -> Option<Vec<bool>> {
        let map = state.map.as_ref()?;
        let here: Vec<bool> = (0..map.partition_count()).map(|p| matches!(self.route_partition(state, map, p), Route::Local)).collect();
        if here.iter().all(|h| *h) {
            return None;
        }
        Some(here)
    }

    /// Who holds each partition's active copy, for a request over every partition (an
    /// index scan, a change feed): `None` this node, `Some(address)` another member.
    /// `Err(partition)` names a partition with no active copy now (the answer would miss
    /// it). Without a map, every partition is here.
    pub fn active_owners(&self) -> Result<Vec<Option<String>>, u16> {
        self.active_owners_in(&self.state())
    }

    /// [`ClusterNode::active_owners`] by `state`'s map.
    pub fn active_owners_in(&self, state: &MetaState) -> Result<Vec<Option<String>>, u16> {
        let Some(map) = &state.map else { return Ok(Vec::new()) };
        (0..map.partition_count())
            .map(|p| match self.route_partition(state, map, p) {
                Route::Local => Ok(None),
                Route::Forward { address, .. } => Ok(Some(address)),
                Route::Unavailable { partition, .. } => Err(partition),
            })
            .collect()
    }

    fn route_partition(&self, state: &MetaState, map: &PartitionMap, p: u16) -> Route {
        let Some(copies) = map.partitions.get(usize::from(p)) else { return Route::Local };
        let unavailable = Route::Unavailable { partition: p, map_version: map.version };
        let active = copies.active.0;
        match state.members.get(&copies.active) {
            Some(m) if m.state == MemberState::Failed => unavailable,
            _ if active == self.id => Route::Local,
            Some(m) => Route::Forward { node: active, address: m.address.clone() },
            None => unavailable,
        }
    }

    /// Whether this node may serve its active copies now: it holds a lease (it heard from
    /// the metadata leader recently, or is the leader with a quorum). A node cut off from the
    /// leader stops serving before any failover can promote another copy.
    pub fn serving(&self) -> bool {
        if !self.is_ready() {
            return false;
        }
        let serving = self.lease.valid(&self.meta);
        if serving && !self.served.load(std::sync::atomic::Ordering::Relaxed) {
            self.served.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        serving
    }

    /// Whether this node has served since it started.
    pub fn has_served(&self) -> bool {
        self.served.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// [`serving`](Self::serving), but a node that has not served since it started
    /// (still entering its cluster, or in and waiting for its first lease) is given up to
    /// [`STARTUP_WAIT`] to get there first: a request that arrives a moment after a restart
    /// is served, not refused. A node that served and lost its lease is answered at once.
    pub async fn serving_soon(&self) -> bool {
        if self.serving() {
            return true;
        }
        if self.served.load(std::sync::atomic::Ordering::Relaxed) {
            return false;
        }
        let deadline = tokio::time::Instant::now() + STARTUP_WAIT;
        let mut ready = self.ready.subscribe();
        if tokio::time::timeout_at(deadline, ready.wait_for(|r| *r)).await.is_err() {
            return false;
        }
        // Ready; a rejoining member of a larger cluster also needs its first lease.
        while !self.serving() {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }

    /// The replicas of partition `p` in the current map, and how many replica
    /// acknowledgements a majority needs (see [`copies_counted`]).
    fn replicas_of(&self, p: u16) -> (Vec<u64>, usize) {
        let state = self.state();
        let Some(copies) = state.map.as_ref().and_then(|m| m.partitions.get(usize::from(p))) else { return (Vec::new(), 0) };
        let wanted = majority(copies_counted(&state, copies)) - 1;
        (copies.replicas.iter().map(|n| n.0).collect(), wanted)
    }

    /// Whether enough of partition `p`'s copies are healthy for a majority write of
    /// `collection` now (checked before writing, so a refusal means nothing was written).
    pub async fn majority_possible(&self, collection: u32, p: u16) -> Result<(), MajorityError> {
        let (replicas, wanted) = self.replicas_of(p);
        self.enough_healthy(collection, p, &replicas, wanted).await
    }

    /// Waits until `wanted` of `replicas` are healthy, giving replicas not yet heard from
    /// since the last map change up to [`UNHEARD_REPLICA_GRACE`]; refuses at once when even
    /// those could not make up the count.
    async fn enough_healthy(&self, collection: u32, p: u16, replicas: &[u64], wanted: usize) -> Result<(), MajorityError> {
        let deadline = tokio::time::Instant::now() + UNHEARD_REPLICA_GRACE;
        let mut changes = self.acks.changes();
        loop {
            changes.borrow_and_update();
            let health = self.acks.health(collection, p, replicas, HEALTHY_ACK_WINDOW);
            if health.healthy >= wanted {
                return Ok(());
            }
            if health.healthy + health.unheard < wanted
                || tokio::time::timeout_at(deadline, changes.changed()).await.map_or(true, |r| r.is_err())
            {
                return Err(MajorityError::Impossible { healthy: health.healthy + 1, needed: wanted + 1 });
            }
        }
    }

    /// Waits until the change `seqno` of `collection`'s partition `p` (on history `uuid`) is
    /// held (`Majority`) or fsynced (`PersistMajority`) by a majority of the partition's
    /// copies, this one counting for itself (for `PersistMajority` the caller has fsynced it
    /// here first).
    pub async fn await_majority(&self, collection: u32, p: u16, seqno: u64, uuid: u64, level: Durable) -> Result<(), MajorityError> {
        let (replicas, wanted) = self.replicas_of(p);
        if wanted == 0 {
            return Ok(());
        }
        let need = match level {
            Durable::Majority => Need::Received(seqno),
            Durable::PersistMajority => Need::Persisted(seqno),
        };
        if self.acks.wait(Part { collection, partition: p, uuid }, &replicas, wanted, need, Instant::now() + DURABLE_TIMEOUT).await {
            Ok(())
        } else {
            Err(MajorityError::Timeout)
        }
    }

    /// Confirms that what this node answers for `collection`'s partition `p` now is what a
    /// majority holds and that it is still the active (ReadIndex): everything up to the
    /// partition's high seqno is on a majority, and a majority acknowledged in a round that
    /// began after the caller read. A majority read calls it after reading; a majority write
    /// whose condition failed calls it before saying so.
    pub async fn confirm(&self, collection: &shoal_storage::Collection, p: u16) -> Result<(), MajorityError> {
        let (replicas, wanted) = self.replicas_of(p);
        if wanted == 0 {
            return Ok(());
        }
        let Some(StreamPosition { seqno, uuid }) = collection.position(p) else {
            return Err(MajorityError::NotActive);
        };
        self.enough_healthy(collection.id(), p, &replicas, wanted).await?;
        let round = self.acks.start_round();
        let need = Need::Confirmed { seqno, round };
        if !self
            .acks
            .wait(Part { collection: collection.id(), partition: p, uuid }, &replicas, wanted, need, Instant::now() + DURABLE_TIMEOUT)
            .await
        {
            return Err(MajorityError::Timeout);
        }
        // Still the active of the same history: nothing was promoted meanwhile.
        match collection.position(p) {
            Some(pos) if pos.uuid == uuid && self.serving() => Ok(()),
            _ => Err(MajorityError::NotActive),
        }
    }

    async fn reconcile_loop(self: &Arc<Self>) {
        let mut rx = self.meta.watch();
        let mut stop = self.stop.subscribe();
        loop {
            let state = Arc::clone(&rx.borrow_and_update());
            let failed = match self.reconcile(&state).await {
                Ok(()) => false,
                Err(e) => {
                    tracing::warn!(error = %e, "applying the cluster metadata; will try again");
                    true
                }
            };
            tokio::select! {
                r = rx.changed() => if r.is_err() { return },
                _ = stop.wait_for(|s| *s) => return,
                _ = tokio::time::sleep(RECONCILE_RETRY), if failed || !self.frozen.lock().is_empty() => {}
            }
        }
    }

    /// Applies the metadata to this node: collections, then the map.
    async fn reconcile(self: &Arc<Self>, state: &MetaState) -> Result<(), ClusterError> {
        if state.cluster_id.is_empty() {
            return Ok(());
        }
        let store = Arc::clone(self.engine.store());
        for (name, def) in &state.collections {
            match store.collection(name) {
                Some(c) if c.id() == def.id => {}
                Some(c) => {
                    tracing::warn!(collection = %name, local = c.id(), cluster = def.id, "a local collection has another id than the cluster's; replacing it");
                    self.engine.drop_collection(name).await?;
                    self.engine.create_collection(name, def.max_ttl, Some(def.id)).await?;
                }
                None => {
                    self.engine.create_collection(name, def.max_ttl, Some(def.id)).await?;
                }
            }
        }
        for info in store.list_collections() {
            if !state.collections.contains_key(&info.name) {
                self.engine.drop_collection(&info.name).await?;
            }
        }
        // Index definitions: by name (an index brought in by the node that founded the
        // cluster keeps its local id there).
        let indexes = self.engine.indexes();
        for (name, def) in &state.collections {
            let Some(coll) = store.collection(name).filter(|c| c.id() == def.id) else { continue };
            let wanted = state.indexes.get(name);
            let local = indexes.list(&coll);
            if let Some(wanted) = wanted {
                // Deferred here, built by the cluster: one build for all of them, from one read.
                let to_build: Vec<String> = local
                    .iter()
                    .filter(|s| s.state == shoal_index::IndexState::Deferred && wanted.get(&s.def.name).is_some_and(|w| w.built))
                    .map(|s| s.def.name.clone())
                    .collect();
                if !to_build.is_empty() {
                    match indexes.build_many(&coll, &to_build).await {
                        Ok(_) | Err(shoal_index::IndexError::NotFound(_)) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                for (index_name, index) in wanted {
                    if local.iter().any(|s| &s.def.name == index_name) {
                        continue;
                    }
                    let parsed: shoal_index::IndexDef = match serde_json::from_value(index.definition.clone()) {
                        Ok(d) => d,
                        Err(e) => {
                            tracing::warn!(collection = %name, index = %index_name, error = %e, "an index definition in the log does not parse here");
                            continue;
                        }
                    };
                    // Built by the cluster already: this member builds it as it creates it.
                    let parsed = shoal_index::IndexDef { defer_build: parsed.defer_build && !index.built, ..parsed };
                    // The log's id where it is free here; a node that took local ids past it
                    // (an index rebuilt after damage takes a fresh one) keeps a local id.
                    let created = match indexes.create_as(&coll, parsed.clone(), Some(index.id)).await {
                        Err(shoal_index::IndexError::Invalid(why)) if why.contains("is taken") => {
                            indexes.create_as(&coll, parsed, None).await
                        }
                        other => other,
                    };
                    match created {
                        Ok(_) | Err(shoal_index::IndexError::Exists(_)) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
            }
            for status in local {
                if !wanted.is_some_and(|w| w.contains_key(&status.def.name)) {
                    match indexes.drop_index(&coll, &status.def.name).await {
                        Ok(()) | Err(shoal_index::IndexError::NotFound(_)) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
        self.apply_current_map().await
    }

    /// Applies the current map: partition states and replication follow it (and the
    /// freezes). One application at a time, each from the state and freezes as they are
    /// once it runs: the reconcile loop, a hand-over and a finished copy all apply it, and
    /// one working from an older look, landing after a newer one, undid it — a freeze
    /// thawed under its hand-over, or a new active set back to a replica.
    pub(crate) async fn apply_current_map(self: &Arc<Self>) -> Result<(), ClusterError> {
        let _one = self.applying.lock().await;
        let state = self.state();
        match &state.map {
            Some(map) => self.apply_map(&state, map).await,
            None => Ok(()),
        }
    }

    /// Waits until this node knows a partition map newer than `version`, at most `max`;
    /// answers whether it does (a request that found its partition's owner moving waits for
    /// the map that says where it went).
    pub async fn wait_map_after(&self, version: u64, max: Duration) -> bool {
        let mut applied = self.meta.watch();
        let deadline = tokio::time::Instant::now() + max;
        loop {
            if applied.borrow_and_update().map_version() > version {
                return true;
            }
            match tokio::time::timeout_at(deadline, applied.changed()).await {
                Ok(Ok(())) => continue,
                _ => return self.state().map_version() > version,
            }
        }
    }

    /// Waits until this node's copy of the partition of `key`, which map `version` makes
    /// active here, is active, at most `max`: until the copies follow that map (or a newer
    /// one), unless the copy is active already. A request the map routes here is run once
    /// it is (a copy the map just made active here would otherwise refuse it as a
    /// replica's). A copy already active does not wait for the rest of a map to be applied
    /// (a rebalance's maps set many other partitions' states, with fsyncs and keyspace
    /// drops: every request routed here waited for them).
    pub async fn wait_copies_follow(&self, key: &[u8], version: u64, max: Duration) -> bool {
        if *self.store_map.borrow() >= version {
            return true;
        }
        let store = self.engine.store();
        if store.partition_state(shoal_storage::partition_of(key, store.partitions())).is_ok_and(|s| s == PartitionState::Active) {
            return true;
        }
        self.wait_store_follows(version, max).await
    }

    /// The map version this node's partition states follow (every copy it retired or gave a
    /// role by then has its state).
    pub(crate) fn applied_map_version(&self) -> u64 {
        *self.store_map.borrow()
    }

    /// Waits until this node's partition states follow map `version` (or a newer one), at
    /// most `max`; answers whether they do.
    pub(crate) async fn wait_store_follows(&self, version: u64, max: Duration) -> bool {
        let mut follows = self.store_map.subscribe();
        let followed = matches!(tokio::time::timeout(max, follows.wait_for(|v| *v >= version)).await, Ok(Ok(_)));
        followed
    }

    /// Whether the partition of `key` is frozen here for a hand-over (its new active takes
    /// it when the next map commits).
    pub fn handing_over(&self, key: &[u8]) -> bool {
        let partitions = self.engine.store().partitions();
        self.is_frozen(shoal_storage::partition_of(key, partitions))
    }

    /// Fault injection (`serve --fault-injection`): leaves the replicated changes of the
    /// named collections unapplied (and unacknowledged) until called again without them.
    /// Unknown names are errors.
    pub fn hold_collections(&self, names: &[String]) -> Result<(), ClusterError> {
        let state = self.state();
        let ids = names
            .iter()
            .map(|n| state.collections.get(n).map(|d| d.id).ok_or_else(|| ClusterError::Refused(format!("no collection {n}"))))
            .collect::<Result<std::collections::HashSet<u32>, ClusterError>>()?;
        *self.held.lock() = ids;
        Ok(())
    }

    /// Fault injection (`serve --fault-injection`): every map waits `delay` (at most
    /// [`MAP_DELAY_MAX`]) before the partition states here follow it, while the metadata
    /// (what the pulls and the router read) has it already — as a slow fsync would.
    pub fn delay_maps(&self, delay: Duration) {
        debug_assert!(delay <= MAP_DELAY_MAX, "the caller checks the bound");
        *self.map_delay.lock() = delay.min(MAP_DELAY_MAX);
    }

    /// Whether replicated changes of collection `id` are held back (fault injection).
    pub(crate) fn is_held(&self, id: u32) -> bool {
        self.held.lock().contains(&id)
    }

    /// Whether partition `p` is frozen for a hand-over here.
    pub(crate) fn is_frozen(&self, p: u16) -> bool {
        self.frozen.lock().get(&p).is_some_and(|until| *until > Instant::now())
    }

    /// Whether this node's copy of `p` is the one its replicas follow: the active, or the
    /// active frozen for a hand-over (a replica in storage already, and still the newest).
    pub(crate) fn copy_serves(&self, p: u16) -> bool {
        self.engine
            .store()
            .partition_state(p)
            .is_ok_and(|s| s == PartitionState::Active || (s == PartitionState::Replica && self.is_frozen(p)))
    }

    /// What the node's metrics show of the cluster: partitions by state, each replica's lag
    /// behind this node's active copies, the map version.
    pub fn stats(&self) -> ClusterStats {
        let store = self.engine.store();
        let mut partitions: BTreeMap<&'static str, usize> = BTreeMap::new();
        for name in ["active", "replica", "pending", "dead"] {
            partitions.insert(name, 0);
        }
        for p in 0..store.partitions() {
            if let Ok(s) = store.partition_state(p) {
                let name = match s {
                    PartitionState::Active => "active",
                    PartitionState::Replica => "replica",
                    PartitionState::Pending => "pending",
                    PartitionState::Dead => "dead",
                };
                *partitions.entry(name).or_default() += 1;
            }
        }
        let state = self.state();
        let mut lag: BTreeMap<u64, ReplicaLag> = BTreeMap::new();
        if let Some(map) = &state.map {
            for coll in self.cluster_collections() {
                let positions = coll.positions();
                for (p, copies) in map.iter() {
                    if copies.active.0 != self.id {
                        continue;
                    }
                    let Some(pos) = positions.get(usize::from(p)) else { continue };
                    for r in &copies.replicas {
                        let entry = lag.entry(r.0).or_insert(ReplicaLag { replica: r.0, seqnos: 0, seconds: 0.0 });
                        match self.acks.get(coll.id(), p, r.0) {
                            Some(ack) if ack.uuid == pos.uuid && ack.received >= pos.seqno => {}
                            Some(ack) => {
                                entry.seqnos += pos.seqno.saturating_sub(if ack.uuid == pos.uuid { ack.received } else { 0 });
                                entry.seconds = entry.seconds.max(ack.at.elapsed().as_secs_f64());
                            }
                            None => entry.seqnos += pos.seqno,
                        }
                    }
                }
            }
        }
        ClusterStats {
            partitions: partitions.into_iter().collect(),
            replicas: lag.into_values().collect(),
            map_version: state.map_version(),
            retired: store.retired_partitions().map_or(0, |r| r.len()),
        }
    }

    /// Members' health as the metadata leader sees it; `None` on other members.
    pub fn member_health(&self) -> Option<HashMap<u64, bool>> {
        let state = self.state();
        self.monitor.health(self.id, state.members.keys().map(|id| id.0))
    }

    /// The rebalance this node (as leader) runs or ran last.
    pub fn rebalance_status(&self) -> crate::rebalance::RebalanceStatus {
        self.rebalancer.status()
    }

    /// Sets every partition's state from the map and starts or stops replication streams.
    async fn apply_map(self: &Arc<Self>, state: &MetaState, map: &PartitionMap) -> Result<(), ClusterError> {
        let me = NodeId(self.id);
        let failed = state.members.get(&me).is_none_or(|m| m.state == MemberState::Failed);
        let frozen: HashSet<u16> = {
            let mut frozen = self.frozen.lock();
            let now = Instant::now();
            // A freeze ends when the map moves the role away, when it times out, or when no
            // rebalance is under way any more (the one that asked for it stopped, failed or
            // was reverted by a new leader: nothing will move the role now, and writes must
            // not wait out `FREEZE_MAX`).
            let planned = state.rebalance.is_some();
            frozen.retain(|p, until| planned && *until > now && map.partitions.get(usize::from(*p)).is_some_and(|c| c.active == me));
            frozen.keys().copied().collect()
        };
        let desired: Vec<(u16, PartitionState)> = map
            .iter()
            .map(|(p, copies)| {
                let s = if failed {
                    PartitionState::Dead
                } else if copies.active == me {
                    if frozen.contains(&p) {
                        PartitionState::Replica
                    } else {
                        PartitionState::Active
                    }
                } else if copies.replicas.contains(&me) {
                    // A copy being built from files stays pending until its ingest ends.
                    if self.copies.is_building(p) {
                        PartitionState::Pending
                    } else {
                        PartitionState::Replica
                    }
                } else {
                    PartitionState::Dead
                };
                (p, s)
            })
            .collect();
        self.copies.retain_replicas(|p| {
            desired.get(usize::from(p)).is_some_and(|(_, s)| matches!(s, PartitionState::Replica | PartitionState::Pending))
        });
        let delay = *self.map_delay.lock();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let store = Arc::clone(self.engine.store());
        let version = map.version;
        let (states, drops) = blocking(move || {
            let storage = |e: shoal_storage::PartitionError| ClusterError::Storage(e.to_string());
            // A retired copy this map gives a role here again is discarded first
            // (`set_partition_states` does it): it comes back empty, as a dropped copy always did.
            let (mut drops, mut states) = (Vec::new(), Vec::new());
            for (p, s) in desired {
                let now = store.partition_state(p).map_err(storage)?;
                if now == s {
                    continue;
                }
                if s == PartitionState::Dead && !failed && now != PartitionState::Dead {
                    // The map moved this copy elsewhere (a rebalance handed it over, or
                    // fewer replicas are wanted): it is retired now, its data discarded
                    // whole, in O(1), `DISCARD_AFTER`. A failed node keeps its copies:
                    // recovery rolls them back and catches them up.
                    drops.push(p);
                } else {
                    states.push((p, s));
                }
            }
            // Every new state in one durable batch: requests routed here wait for it.
            store.set_partition_states_for_map(&states, version).map_err(storage)?;
            store.retire_partitions(&drops).map_err(storage)?;
            store.set_map_version(version);
            Ok::<_, ClusterError>((states.len(), drops.len()))
        })
        .await??;
        // The copies this map keeps here follow it: requests routed here go on now, and the
        // replicas here follow their (new) actives.
        self.store_map.send_if_modified(|v| {
            let newer = version > *v;
            *v = (*v).max(version);
            newer
        });
        self.follow_actives(state, map, failed);
        let changed = states + drops;
        if drops > 0 {
            self.discard_later();
        }
        if changed > 0 {
            tracing::info!(map_version = version, changed, "partition states follow the map");
        }
        Ok(())
    }

    /// Discards the data of the copies retired here, `DISCARD_AFTER` from now: each between
    /// two applications of the map (so that none gives it a role meanwhile), one at a time
    /// (so that a map waits for one discard at most, not for all of them).
    fn discard_later(self: &Arc<Self>) {
        let node = Arc::clone(self);
        tokio::spawn(async move {
            tokio::time::sleep(DISCARD_AFTER).await;
            let store = Arc::clone(node.engine.store());
            let listed = Arc::clone(&store);
            let retired = match blocking(move || listed.retired_partitions()).await {
                Ok(Ok(retired)) => retired,
                Ok(Err(e)) => return tracing::warn!(error = %e, "listing retired copies"),
                Err(e) => return tracing::warn!(error = %e, "listing retired copies"),
            };
            for p in retired {
                let _one = node.applying.lock().await;
                let store = Arc::clone(&store);
                match blocking(move || store.discard_retired(&[p])).await {
                    Ok(Ok(())) => {}
                    // Its record stays: the next discard or restart tries again.
                    Ok(Err(e)) => tracing::warn!(partition = p, error = %e, "discarding a retired copy"),
                    Err(e) => tracing::warn!(partition = p, error = %e, "discarding a retired copy"),
                }
            }
        });
    }

    /// Replication: one stream per node this one holds replicas of in `map` (none on a
    /// failed node); streams from other nodes stop.
    fn follow_actives(self: &Arc<Self>, state: &MetaState, map: &PartitionMap, failed: bool) {
        let me = NodeId(self.id);
        let sources: HashSet<u64> = if failed {
            HashSet::new()
        } else {
            map.partitions
                .iter()
                .filter(|c| c.replicas.contains(&me))
                .map(|c| c.active.0)
                .filter(|a| state.members.get(&NodeId(*a)).is_some_and(|m| m.state != MemberState::Failed))
                .collect()
        };
        let mut running = self.replicators.lock();
        running.retain(|source, stop| {
            let keep = sources.contains(source) && !*stop.borrow();
            if !keep {
                stop.send_replace(true);
            }
            keep
        });
        for source in sources {
            if let std::collections::hash_map::Entry::Vacant(slot) = running.entry(source) {
                let (tx, rx) = watch::channel(false);
                slot.insert(tx);
                tokio::spawn(crate::replica::replicate_from(Arc::clone(self), source, rx));
            }
        }
    }
}

/// How many copies a partition's majorities and fence quorums are counted over: the
/// configured count (replicas + 1, at most the data nodes the cluster has, failed ones
/// included), or the copies in the map when a rebalance holds more. Not the map's copies
/// alone: a failover takes the failed copy out of the map, and a write a majority
/// acknowledged with it is then on fewer than a majority of the rest — the next failover
/// could promote a copy without it (`shoal_cluster::promotion_ready`; the seeded simulation
/// in `shoal_cluster::sim` finds that loss). The failed copy's slot stays counted, never
/// acknowledging, until a rebalance fills it; so after one failover with one replica,
/// majority writes answer `durability_impossible` until then.
pub fn copies_counted(state: &MetaState, copies: &Copies) -> usize {
    let data_nodes =
        state.members.values().filter(|m| matches!(m.state, MemberState::Active | MemberState::Leaving | MemberState::Failed)).count();
    let configured = (usize::from(state.settings.replicas) + 1).min(data_nodes.max(1));
    configured.max(copies.nodes().count())
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

/// Runs storage work off the async threads.
pub(crate) async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, ClusterError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ClusterError::Storage(format!("storage task failed: {e}")))
}
