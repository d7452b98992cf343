//! `ClusterNode`: this node as a cluster member — its parts, its life cycle (open, start,
//! shutdown), proposals to the metadata leader and the DDL that waits for them, and the
//! dispatch of calls from other members to the module that answers each. The parts live
//! beside it: [`crate::membership`] (founding, joining, admission), [`crate::apply`] (the
//! reconcile loop applying the metadata), [`crate::routing`] (where requests go, serving),
//! [`crate::majority`] (majority waits), [`crate::faults`] (fault injection).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use shoal_cluster::NodeId;
use shoal_engine::Engine;
use shoal_meta::{MetaCommand, MetaNode, MetaResponse, MetaState, ProposeError};
use shoal_storage::PartitionState;
use tokio::sync::watch;

use crate::acks::Acks;
use crate::apply::Applier;
use crate::faults::Faults;
use crate::membership::{Membership, Opened};
use crate::peers::{MetaPeers, Op, Peers};
use crate::routing::CopyStates;
use crate::wire::{self, JoinAnswer, JoinRequest, ProposeAnswer};
use crate::ClusterError;

/// How long a proposal looks for a leader before it gives up.
pub const PROPOSE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a request that reaches a node still entering its cluster (founding, joining
/// or rejoining after a restart) waits for it to serve before it is refused.
pub const STARTUP_WAIT: Duration = Duration::from_secs(10);
/// Time between looks when a caller waits for this node to apply something.
const APPLY_POLL: Duration = Duration::from_millis(10);
/// Longest a DDL change (a collection or an index created, built or dropped; a user made,
/// changed or deleted) waits, once
/// this node has applied it, for the other members' engines to have applied it too, so
/// that a request to any member right after the answer finds what it made. A member that
/// does not confirm within it (stopped, cut off, slow) is logged and not waited for.
pub const DDL_SPREAD_WAIT: Duration = Duration::from_secs(5);

/// `applied`: wait until the engine is in step with the metadata log up to `index`.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AppliedRequest {
    pub index: u64,
}

/// How far a member's engine is in step with the metadata log.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct AppliedAnswer {
    pub applied: u64,
}

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
    /// A copy by files here leaves the partition's analytics rows to be built from the
    /// change stream, as before they moved with the copy (`serve --analytics-by-stream`,
    /// hidden): for the benchmark's comparison.
    pub analytics_by_stream: bool,
    /// The services this node runs (`--services`), told to the cluster when it joins.
    pub services: shoal_meta::Services,
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

/// One member of the cluster; see the module documentation. Its parts own narrow state:
/// [`Membership`](crate::membership) (identity, joining, admission), [`CopyStates`]
/// (which map the copies follow, hand-over freezes: routing reads them), the
/// [`Applier`](crate::apply) (the reconcile loop's one-at-a-time map application and
/// replication streams), [`Acks`] (what the active knows of its replicas: majority waits),
/// the failover [`Monitor`](crate::failover::Monitor) and [`Lease`](crate::failover::Lease),
/// the [`Rebalancer`](crate::rebalance::Rebalancer), the file [`Copies`](crate::copy::Copies)
/// being built, and [`Faults`] injected by tests.
pub struct ClusterNode {
    pub(crate) engine: Arc<Engine>,
    pub(crate) id: NodeId,
    pub(crate) advertise: String,
    pub(crate) meta: MetaNode,
    pub(crate) peers: Arc<dyn Peers>,
    pub(crate) membership: Membership,
    pub(crate) copy_states: CopyStates,
    pub(crate) applier: Applier,
    pub(crate) acks: Acks,
    /// Held while a replication batch is applied, and by a fence report: once a member has
    /// reported its progress to the leader, no batch from the fenced node lands after it.
    pub(crate) apply_lock: tokio::sync::Mutex<()>,
    /// Until when this node may serve its active partitions (see `failover::Lease`).
    pub(crate) lease: crate::failover::Lease,
    /// Whether this node has served since it started: until then a request that finds it
    /// not serving waits for it (`serving_soon`), after that it is answered at once.
    pub(crate) served: std::sync::atomic::AtomicBool,
    pub(crate) stop: watch::Sender<bool>,
    /// The leader's view of members' health (auto-failover), and serialises failovers.
    pub(crate) monitor: crate::failover::Monitor,
    pub(crate) rebalancer: crate::rebalance::Rebalancer,
    /// Copies of partitions being built here from files (`copy`).
    pub(crate) copies: crate::copy::Copies,
    pub(crate) faults: Faults,
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
        let has_collections = !engine.store().list_collections().is_empty();
        let Opened { membership, node_id, joining_new } = Membership::open(dir.clone(), &config, has_collections)?;
        let peers = peers(membership.secret())?;
        if joining_new {
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
        let meta = MetaNode::open(&meta_dir, node_id, Arc::new(MetaPeers(Arc::clone(&peers))), crate::failover::LEASE)
            .await
            .map_err(|e| ClusterError::Meta(e.to_string()))?;
        Ok(Arc::new(ClusterNode {
            engine,
            id: NodeId(node_id),
            advertise: config.advertise,
            meta,
            peers,
            membership,
            copy_states: CopyStates::default(),
            applier: Applier::default(),
            acks: Acks::default(),
            apply_lock: tokio::sync::Mutex::new(()),
            lease: crate::failover::Lease::default(),
            served: std::sync::atomic::AtomicBool::new(false),
            stop: watch::channel(false).0,
            monitor: crate::failover::Monitor::default(),
            rebalancer: crate::rebalance::Rebalancer::default(),
            copies: crate::copy::Copies::new(config.copy_by_stream, config.copy_by_records, config.copy_unpaced)
                .with_analytics_by_stream(config.analytics_by_stream),
            faults: Faults::default(),
        }))
    }

    pub fn id(&self) -> NodeId {
        self.id
    }

    pub fn secret(&self) -> &str {
        self.membership.secret()
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
        self.meta.leader() == Some(self.id.0)
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
                node.membership.set_fatal(e.to_string());
                return;
            }
            node.membership.set_ready();
            tracing::info!(node = node.id.0, address = %node.advertise, "in the cluster");
            tokio::spawn(crate::failover::run_monitor(Arc::clone(&node)));
            // Copies retired before a restart and not discarded yet, and freezes it thawed.
            node.discard_later();
            node.restore_freezes();
            node.reconcile_loop().await;
        });
    }

    /// Stops the background work (replication, the monitor) and the metadata log.
    pub async fn shutdown(&self) {
        self.stop.send_replace(true);
        self.applier.stop_replication();
        if let Err(e) = self.meta.shutdown().await {
            tracing::warn!(error = %e, "stopping the metadata log");
        }
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
        self.wait_applied_everywhere(|| self.engine.store().collection(name).is_some_and(|c| c.id() == id)).await
    }

    /// Drops a collection cluster-wide and waits until this node has dropped it.
    pub async fn drop_collection(&self, name: &str) -> Result<(), ClusterError> {
        self.propose(MetaCommand::DropCollection { name: name.into() }).await?;
        self.wait_applied_everywhere(|| self.engine.store().collection(name).is_none()).await
    }

    /// Defines an index cluster-wide (the log gives its id) and waits until this node has it;
    /// answers its status here.
    pub async fn create_index(
        &self,
        coll: &Arc<shoal_storage::Collection>,
        name: &str,
        definition: serde_json::Value,
    ) -> Result<shoal_index::IndexStatus, ClusterError> {
        // Each index partition's copies go on distinct index nodes: more replicas than the
        // other index nodes could never be placed.
        let replicas = definition.get("replicas").and_then(serde_json::Value::as_u64).unwrap_or(0);
        let state = self.state();
        // Placed on the active members running the index service when there are any.
        let index_nodes = match state.index_service_nodes().len() {
            0 => index_nodes(&state),
            placing => placing,
        };
        if replicas >= index_nodes as u64 {
            return Err(ClusterError::Index(shoal_index::IndexError::Invalid(format!(
                "an index has fewer replicas than the cluster has index nodes ({index_nodes}); start more nodes with the index service"
            ))));
        }
        let cmd = MetaCommand::CreateIndex { collection: coll.name().to_string(), name: name.to_string(), definition };
        self.propose(cmd).await?;
        let indexes = self.engine.indexes();
        self.wait_applied_everywhere(|| indexes.list(coll).iter().any(|s| s.def.name == name)).await?;
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
        self.wait_applied_everywhere(|| started(&indexes.list(coll))).await?;
        let list = indexes.list(coll);
        names
            .iter()
            .map(|n| list.iter().find(|s| &s.def.name == n).cloned().ok_or_else(|| ClusterError::Refused(format!("index {n} went away"))))
            .collect()
    }

    /// Creates or replaces a user cluster-wide (the hash is already made) and waits until
    /// the members have it.
    pub async fn put_user(&self, name: &str, user: shoal_meta::User) -> Result<(), ClusterError> {
        let want = user.hash.clone();
        self.propose(MetaCommand::PutUser { name: name.to_string(), user }).await?;
        self.wait_applied_everywhere(|| self.state().users.get(name).is_some_and(|u| u.hash == want)).await
    }

    /// Deletes a user cluster-wide and waits until the members have dropped it.
    pub async fn delete_user(&self, name: &str) -> Result<(), ClusterError> {
        self.propose(MetaCommand::DeleteUser { name: name.to_string() }).await?;
        self.wait_applied_everywhere(|| !self.state().users.contains_key(name)).await
    }

    /// The first start's admin: committed only while the cluster has no user.
    pub async fn create_first_admin(&self, user: shoal_meta::User) -> Result<(), ClusterError> {
        self.propose(MetaCommand::CreateFirstAdmin { user }).await?;
        self.wait_applied_everywhere(|| !self.state().users.is_empty()).await
    }

    /// Drops an index cluster-wide and waits until this node has dropped it.
    pub async fn drop_index(&self, coll: &Arc<shoal_storage::Collection>, name: &str) -> Result<(), ClusterError> {
        self.propose(MetaCommand::DropIndex { collection: coll.name().to_string(), name: name.to_string() }).await?;
        let indexes = self.engine.indexes();
        self.wait_applied_everywhere(|| !indexes.list(coll).iter().any(|s| s.def.name == name)).await
    }

    /// Waits until this node has applied a DDL change (`done`), then until the other
    /// members have (bounded by [`DDL_SPREAD_WAIT`]).
    async fn wait_applied_everywhere(&self, done: impl Fn() -> bool) -> Result<(), ClusterError> {
        let deadline = Instant::now() + PROPOSE_TIMEOUT;
        while !done() {
            if Instant::now() >= deadline {
                return Err(ClusterError::Timeout("the change is committed but this node has not applied it yet; try again".into()));
            }
            tokio::time::sleep(APPLY_POLL).await;
        }
        self.wait_members_applied().await;
        Ok(())
    }

    /// Waits until every other member that is not failed has its engine in step with this
    /// node's applied metadata (which includes the change just made), for at most
    /// [`DDL_SPREAD_WAIT`]; members that do not confirm in time are logged and not waited for.
    async fn wait_members_applied(&self) {
        let state = self.state();
        let index = state.applied.0;
        let body = serde_json::to_vec(&AppliedRequest { index }).unwrap_or_default();
        let calls = state.members.iter().filter(|(id, m)| **id != self.id && m.state != shoal_meta::MemberState::Failed).map(|(id, m)| {
            let body = body.clone();
            async move {
                let answer = self.peers.call(&m.address, Op::Applied, body, DDL_SPREAD_WAIT).await;
                let reached = match answer {
                    Ok(bytes) => serde_json::from_slice::<AppliedAnswer>(&bytes).is_ok_and(|a| a.applied >= index),
                    Err(e) => {
                        tracing::debug!(member = id.0, error = %e, "asking a member whether it applied a change");
                        false
                    }
                };
                if !reached {
                    tracing::warn!(member = id.0, index, "a member did not confirm a metadata change in time; not waiting for it");
                }
            }
        });
        futures::future::join_all(calls).await;
    }

    /// Answers once this node's engine is in step with the metadata log up to the asked
    /// index, or after [`DDL_SPREAD_WAIT`], with how far it is.
    pub(crate) async fn serve_applied(&self, req: AppliedRequest) -> AppliedAnswer {
        AppliedAnswer { applied: self.wait_reconciled(req.index, DDL_SPREAD_WAIT).await }
    }

    /// Waits up to `bound` until the engine is in step with the metadata log as far as
    /// entry `index` (the applier reconciled it: collections and indexes made or dropped);
    /// answers how far it is, which is short of `index` when the bound ran out.
    pub(crate) async fn wait_reconciled(&self, index: u64, bound: Duration) -> u64 {
        let mut rx = self.applier.reconciled();
        let _ = tokio::time::timeout(bound, rx.wait_for(|r| *r >= index)).await;
        let reconciled = *rx.borrow();
        reconciled
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
            Op::Feed => {
                let req = wire::decode(body).map_err(ClusterError::BadMessage)?;
                let answer = crate::feed::serve_feed(self, req).await?;
                Ok(wire::encode(&answer))
            }
            Op::Highs => {
                let req = serde_json::from_slice(body).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
                let answer = crate::feed::serve_highs(self, req)?;
                serde_json::to_vec(&answer).map_err(|e| ClusterError::BadMessage(e.to_string()))
            }
            Op::IndexScan => {
                let req = serde_json::from_slice(body).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
                let answer = crate::index_scan::serve_part_scan(self, req).await?;
                serde_json::to_vec(&answer).map_err(|e| ClusterError::BadMessage(e.to_string()))
            }
            Op::ShadowFields => {
                let req = serde_json::from_slice(body).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
                crate::sql::serve_shadow_fields(self, req).await
            }
            Op::ShadowRows => crate::sql::serve_shadow_rows(self, body).await,
            Op::IndexAdopt => {
                let req = serde_json::from_slice(body).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
                let answer = crate::index_moves::serve_adopt(self, req).await?;
                serde_json::to_vec(&answer).map_err(|e| ClusterError::BadMessage(e.to_string()))
            }
            Op::IndexPrepare => {
                let req = serde_json::from_slice(body).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
                let answer = crate::index_moves::serve_prepare(self, req).await?;
                serde_json::to_vec(&answer).map_err(|e| ClusterError::BadMessage(e.to_string()))
            }
            Op::Applied => {
                let req = serde_json::from_slice(body).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
                let answer = self.serve_applied(req).await;
                serde_json::to_vec(&answer).map_err(|e| ClusterError::BadMessage(e.to_string()))
            }
            Op::Export | Op::IndexExport | Op::ShadowExport => {
                Err(ClusterError::BadMessage("an export answers as a stream (`export_stream`)".into()))
            }
        }
    }

    /// The streamed calls: an export of a partition (`copy::serve_export`) or of an index
    /// partition (`index_moves::serve_index_export`), as chunks.
    pub fn export_stream(
        self: &Arc<Self>,
        op: Op,
        body: &[u8],
    ) -> Result<tokio::sync::mpsc::Receiver<Result<crate::copy::Outgoing, ClusterError>>, ClusterError> {
        match op {
            Op::IndexExport => crate::index_moves::serve_index_export(self, body),
            Op::ShadowExport => crate::shadow_move::serve_shadow_export(self, body),
            _ => crate::copy::serve_export(self, body),
        }
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
                    if copies.active != self.id {
                        continue;
                    }
                    let Some(pos) = positions.get(usize::from(p)) else { continue };
                    for r in &copies.replicas {
                        let entry = lag.entry(r.0).or_insert(ReplicaLag { replica: r.0, seqnos: 0, seconds: 0.0 });
                        match self.acks.get(coll.id(), p, *r) {
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
        self.monitor.health(self.id.0, state.members.keys().map(|id| id.0))
    }

    /// The rebalance this node (as leader) runs or ran last.
    pub fn rebalance_status(&self) -> crate::rebalance::RebalanceStatus {
        self.rebalancer.status()
    }
}

/// Runs storage work off the async threads.
pub(crate) async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, ClusterError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ClusterError::Storage(format!("storage task failed: {e}")))
}

/// Members that run the index service and are in the cluster (active or added).
pub(crate) fn index_nodes(state: &MetaState) -> usize {
    state
        .members
        .values()
        .filter(|m| m.services.index && matches!(m.state, shoal_meta::MemberState::Active | shoal_meta::MemberState::Added))
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_cluster::NodeId;
    use shoal_meta::{Member, MemberState, Services};

    #[test]
    fn the_index_bounds_the_api_checks_are_the_ones_placement_takes() {
        use shoal_cluster::index_placement as placement;
        assert_eq!(shoal_index::def::INDEX_PARTITIONS_MAX, placement::INDEX_PARTITIONS_MAX);
        assert_eq!(shoal_index::def::INDEX_PARTITIONS_DEFAULT, placement::INDEX_PARTITIONS_DEFAULT);
        assert_eq!(shoal_index::def::INDEX_REPLICAS_MAX, shoal_cluster::REPLICAS_MAX);
    }

    #[test]
    fn index_nodes_are_members_in_the_cluster_that_run_the_index_service() {
        let mut state = MetaState::default();
        let data_only = Services { data: true, index: false, query: false };
        let members = [
            (1, MemberState::Active, Services::ALL),
            (2, MemberState::Added, Services::ALL),
            (3, MemberState::Active, data_only),
            (4, MemberState::Failed, Services::ALL),
            (5, MemberState::Ejected, Services::ALL),
        ];
        for (id, s, services) in members {
            state.members.insert(NodeId(id), Member { address: format!("n{id}"), state: s, services });
        }
        assert_eq!(index_nodes(&state), 2);
    }
}
