//! The cluster's metadata and the commands that change it. `MetaState::apply` is pure and
//! deterministic: every member applies the same committed commands in the same order and
//! reaches the same state, ids included (they are assigned here, never by a proposer).

use std::collections::BTreeMap;

use crate::users::User;
use serde::{Deserialize, Serialize};
use shoal_cluster::{NodeId, PartitionMap, REPLICAS_MAX};
use thiserror::Error;

/// A name (collection, index) longer than this is refused by the log. The server checks the
/// finer rules (characters, storage's 251-character limit) before it proposes; the log only
/// keeps a bad proposal from bloating every member's state.
pub const NAME_MAX_BYTES: usize = 1_024;
/// A member's address (`host:port`) longer than this is refused.
pub const ADDRESS_MAX_BYTES: usize = 256;
/// An index definition's JSON text longer than this is refused.
pub const INDEX_DEFINITION_MAX_BYTES: usize = 64 * 1024;
/// At most this many collections in a cluster (ids are `u32`; the bound keeps the state small).
pub const COLLECTIONS_MAX: usize = 10_000;
/// At most this many indexes per collection.
pub const INDEXES_PER_COLLECTION_MAX: usize = 256;

/// `auto_failover_timeout_s` bounds (API.md: 2..3600) and default (issue 13: 5 s).
pub const AUTO_FAILOVER_TIMEOUT_MIN_S: u32 = 2;
pub const AUTO_FAILOVER_TIMEOUT_MAX_S: u32 = 3_600;
pub const AUTO_FAILOVER_TIMEOUT_DEFAULT_S: u32 = 5;
/// How many nodes may be failed over automatically before an operator steps in.
pub const AUTO_FAILOVER_MAX_COUNT_DEFAULT: u32 = shoal_cluster::failover::AUTO_FAILOVER_MAX_COUNT_DEFAULT as u32;
pub const AUTO_FAILOVER_MAX_COUNT_MAX: u32 = 16;
/// Replica copies per partition by default (issue 13).
pub const REPLICAS_DEFAULT: u8 = 1;
/// Rebalance budget defaults and bounds. 0: no fixed limit (the copies' elastic budget,
/// which yields to the foreground, still paces them: `shoal_node::elastic`).
pub const REBALANCE_MB_PER_S_DEFAULT: u32 = 0;
pub const REBALANCE_MB_PER_S_MAX: u32 = 100_000;
pub const REBALANCE_MOVES_PER_NODE_DEFAULT: u32 = 4;
pub const REBALANCE_MOVES_PER_NODE_MAX: u32 = 64;

/// A collection's id, as the storage engine keys it.
pub type CollectionId = u32;
/// An index's id, as the index manager keys it.
pub type IndexId = u32;

/// Where a member is in its life (API.md's states, plus `ejected`: removed by a rebalance and
/// never to hold data again under this id).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemberState {
    /// Joined, holds nothing until a rebalance brings it in.
    Added,
    /// Holds partitions.
    Active,
    /// Being rebalanced out.
    Leaving,
    /// Failed over: its copies were promoted elsewhere; `recover` makes it `added` again.
    Failed,
    /// Rebalanced out.
    Ejected,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub address: String,
    pub state: MemberState,
    /// What the member runs, as it said when it joined (`--services`); members from before
    /// services existed run all of them.
    #[serde(default)]
    pub services: Services,
}

impl Member {
    /// A member at `address` in `state` running every service.
    pub fn new(address: impl Into<String>, state: MemberState) -> Member {
        Member { address: address.into(), state, services: Services::ALL }
    }
}

/// The services a node runs (`serve --services data,index,query`, Couchbase's
/// multi-dimensional scaling): placement gives data partitions only to `data` nodes, and
/// index partitions only to `index` nodes; `query` nodes plan and coordinate SQL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Services {
    pub data: bool,
    pub index: bool,
    pub query: bool,
}

impl Default for Services {
    fn default() -> Self {
        Services::ALL
    }
}

/// Why a `--services` list is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ServicesError {
    #[error("no service named {0:?}; the services are data, index and query")]
    Unknown(String),
    #[error("a node runs at least one service (data, index, query)")]
    Empty,
}

impl Services {
    /// Every service: a node's default.
    pub const ALL: Services = Services { data: true, index: true, query: true };

    /// Parses a comma-separated list of `data`, `index` and `query` (spaces around names
    /// and repeats allowed, case-insensitive).
    pub fn parse(list: &str) -> Result<Services, ServicesError> {
        let mut services = Services { data: false, index: false, query: false };
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            match name.to_ascii_lowercase().as_str() {
                "data" => services.data = true,
                "index" => services.index = true,
                "query" => services.query = true,
                _ => return Err(ServicesError::Unknown(name.chars().take(SERVICE_NAME_SHOWN_MAX).collect())),
            }
        }
        if services == (Services { data: false, index: false, query: false }) {
            return Err(ServicesError::Empty);
        }
        Ok(services)
    }

    /// The names of the services run, in a fixed order.
    pub fn names(&self) -> Vec<&'static str> {
        [("data", self.data), ("index", self.index), ("query", self.query)].into_iter().filter(|(_, on)| *on).map(|(n, _)| n).collect()
    }
}

/// Most characters of an unknown service name an error repeats.
const SERVICE_NAME_SHOWN_MAX: usize = 64;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CollectionDef {
    pub id: CollectionId,
    /// Maximum document TTL in seconds, 0 for none (as `shoal-storage`).
    pub max_ttl: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexDef {
    pub collection: String,
    pub name: String,
    pub id: IndexId,
    /// The definition as the API received it; `shoal-index` parses it.
    pub definition: serde_json::Value,
    /// A deferred index (`defer_build`) that `BuildIndexes` started: every member builds it,
    /// members that create it later too.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub built: bool,
    /// Per index partition, the index nodes holding its copies (the first is the oldest),
    /// placed by [`shoal_cluster::index_placement::place_indexes`] when the index is created.
    /// Empty when the cluster had no node running the index service without data then: each
    /// data node indexes the partitions it holds (the interim design, ARCHITECTURE.md).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub placement: Vec<Vec<NodeId>>,
}

impl IndexDef {
    /// Whether the index is placed on index nodes (see [`IndexDef::placement`]).
    pub fn is_placed(&self) -> bool {
        !self.placement.is_empty()
    }

    /// The index partitions `node` holds a copy of.
    pub fn parts_on(&self, node: NodeId) -> Vec<u16> {
        (0..self.placement.len()).filter(|&p| self.placement[p].contains(&node)).filter_map(|p| u16::try_from(p).ok()).collect()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Settings {
    pub auto_failover_timeout_s: u32,
    pub auto_failover_max_count: u32,
    pub replicas: u8,
    pub rebalance_mb_per_s: u32,
    pub rebalance_moves_per_node: u32,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            auto_failover_timeout_s: AUTO_FAILOVER_TIMEOUT_DEFAULT_S,
            auto_failover_max_count: AUTO_FAILOVER_MAX_COUNT_DEFAULT,
            replicas: REPLICAS_DEFAULT,
            rebalance_mb_per_s: REBALANCE_MB_PER_S_DEFAULT,
            rebalance_moves_per_node: REBALANCE_MOVES_PER_NODE_DEFAULT,
        }
    }
}

/// A change to some settings; `None` leaves a setting as it is.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SettingsPatch {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_failover_timeout_s: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_failover_max_count: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u8>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebalance_mb_per_s: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebalance_moves_per_node: Option<u32>,
}

/// The cluster's metadata as every member holds it after applying the log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaState {
    /// Set once, by the first member (`InitCluster`); a data directory from another cluster
    /// is refused by comparing it.
    #[serde(default)]
    pub cluster_id: String,
    pub members: BTreeMap<NodeId, Member>,
    pub collections: BTreeMap<String, CollectionDef>,
    /// Index definitions by collection name, then index name.
    pub indexes: BTreeMap<String, BTreeMap<String, IndexDef>>,
    /// The partition map; `None` until the first one is committed (version 1).
    pub map: Option<PartitionMap>,
    pub settings: Settings,
    pub next_collection_id: CollectionId,
    pub next_index_id: IndexId,
    /// The rebalance under way, so that a new metadata leader finishes it (or a stop
    /// reverts it) where the old one left off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebalance: Option<RebalancePlan>,
    /// Who may call the cluster, by name (`users`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub users: BTreeMap<String, User>,
    /// The index of the last log entry this state includes, as the state machine published
    /// it (0 in a state built otherwise). Not part of the state's value: never stored,
    /// and equal in every state.
    #[serde(skip)]
    pub applied: Applied,
}

/// The log index a published [`MetaState`] includes. Two states are equal whatever their
/// indexes: members publish the same state after different entries (a snapshot ends on a
/// blank one), and the index only says how far a member's view is.
#[derive(Clone, Copy, Debug, Default)]
pub struct Applied(pub u64);

impl PartialEq for Applied {
    fn eq(&self, _: &Applied) -> bool {
        true
    }
}

impl Eq for Applied {}

/// A rebalance as the log keeps it: where the map goes, and what to go back to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RebalancePlan {
    /// The map before the rebalance (a stop goes back to its copies).
    pub from: PartitionMap,
    /// The map it ends with (its version is set when it is committed).
    pub target: PartitionMap,
    /// Nodes it moves everything off.
    pub eject: Vec<NodeId>,
    /// Nodes that were `added` when it started (a stop makes them `added` again).
    pub added: Vec<NodeId>,
    /// `DELETE /v1/cluster/rebalance` asked it to stop.
    pub stop: bool,
}

impl Default for MetaState {
    fn default() -> Self {
        MetaState {
            cluster_id: String::new(),
            members: BTreeMap::new(),
            collections: BTreeMap::new(),
            indexes: BTreeMap::new(),
            map: None,
            settings: Settings::default(),
            // Collection id 0 is never handed out, so "no id" is never confused with one.
            next_collection_id: 1,
            next_index_id: 1,
            rebalance: None,
            users: BTreeMap::new(),
            applied: Applied(0),
        }
    }
}

/// A change to the metadata, proposed to the leader and applied by every member.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum MetaCommand {
    /// Names the cluster; the first command of its log, refused once it has a name.
    InitCluster {
        cluster_id: String,
    },
    AddMember {
        node: NodeId,
        address: String,
        #[serde(default)]
        services: Services,
    },
    SetMemberState {
        node: NodeId,
        state: MemberState,
    },
    /// Forgets a member; refused while the map places a copy on it.
    RemoveMember {
        node: NodeId,
    },
    CreateCollection {
        name: String,
        max_ttl: u32,
        /// The id to use: a node that becomes a cluster brings its collections in under the
        /// ids its data is stored under. `None` takes the next free id.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<CollectionId>,
    },
    /// Drops the collection and its index definitions.
    DropCollection {
        name: String,
    },
    CreateIndex {
        collection: String,
        name: String,
        definition: serde_json::Value,
    },
    DropIndex {
        collection: String,
        name: String,
    },
    /// Starts building deferred indexes on every member (Couchbase's `BUILD INDEX`); refused
    /// whole when one of the names is not an index of the collection.
    BuildIndexes {
        collection: String,
        names: Vec<String>,
    },
    /// Compare-and-set: `map.version` must be the current version + 1 (0 before any map).
    SetMap {
        map: PartitionMap,
    },
    UpdateSettings {
        patch: SettingsPatch,
    },
    /// Records a rebalance's plan; refused while another is under way.
    BeginRebalance {
        plan: RebalancePlan,
    },
    /// Asks the rebalance under way to stop.
    StopRebalance,
    /// The rebalance finished, stopped or failed: forgets its plan.
    EndRebalance,
    /// Where indexes' partitions are now (a rebalance moved copies: the new ones hold them
    /// already). All or nothing; refused when an index is not the one placed (dropped, or
    /// dropped and created again under its name).
    SetIndexPlacements {
        placements: Vec<IndexPlacementChange>,
    },
    /// Creates or replaces a user (the server hashed the password and checked that the
    /// caller may). Refused when it would leave no admin, or a role names no collection.
    PutUser {
        name: String,
        user: User,
    },
    /// Refused when it would leave no admin.
    DeleteUser {
        name: String,
    },
    /// The first start's admin: applied only while the cluster has no user at all.
    CreateFirstAdmin {
        user: User,
    },
}

/// One index's new placement (see [`IndexDef::placement`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexPlacementChange {
    pub collection: String,
    pub name: String,
    pub id: IndexId,
    pub placement: Vec<Vec<NodeId>>,
    /// The placement the change was planned over: refused if the index's placement is no
    /// longer that one (a failover took a failed node's copies out of it since a rebalance
    /// planned its moves, and the new placement would name them again). `None`: not checked
    /// (entries written before this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<Vec<Vec<NodeId>>>,
}

/// What an applied command answers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MetaResponse {
    /// Applied; nothing to report (also the answer to Raft's own blank and membership entries).
    Done,
    CollectionCreated {
        id: CollectionId,
    },
    IndexCreated {
        id: IndexId,
    },
    MapSet {
        version: u64,
    },
}

/// Why a committed command changed nothing. The command is still in the log: every member
/// refuses it the same way.
#[derive(Clone, Debug, PartialEq, Eq, Error, Serialize, Deserialize)]
#[serde(tag = "reject", rename_all = "snake_case")]
pub enum MetaReject {
    #[error("node {node} is already a member")]
    MemberExists { node: NodeId },
    #[error("address {address} is already used by node {node}")]
    AddressInUse { address: String, node: NodeId },
    #[error("node {node} is not a member")]
    NoSuchMember { node: NodeId },
    #[error("node {node} still holds copies in the partition map")]
    MemberHoldsCopies { node: NodeId },
    #[error("collection {name} exists")]
    CollectionExists { name: String },
    #[error("no collection {name}")]
    NoSuchCollection { name: String },
    #[error("index {name} exists on collection {collection}")]
    IndexExists { collection: String, name: String },
    #[error("no index {name} on collection {collection}")]
    NoSuchIndex { collection: String, name: String },
    #[error("index {name} on collection {collection} was placed anew since this placement was planned (a failover)")]
    IndexPlacementChanged { collection: String, name: String },
    #[error("map version {got} is not the next one ({expected})")]
    MapVersion { expected: u64, got: u64 },
    #[error("the map is not well formed: {why}")]
    InvalidMap { why: String },
    #[error("the map places a copy on node {node}, which is not an active or added member (a failed one may only stay active)")]
    MapNodeNotMember { node: NodeId },
    #[error("the map has {got} partitions; the cluster has {expected}")]
    PartitionCountChanged { expected: u16, got: u16 },
    #[error("{what} is out of range: {why}")]
    OutOfRange { what: String, why: String },
    #[error("limit reached: {what}")]
    LimitReached { what: String },
    #[error("the cluster is named {cluster_id} already")]
    ClusterNamed { cluster_id: String },
    #[error("collection id {id} is in use")]
    CollectionIdInUse { id: CollectionId },
    #[error("a rebalance is under way")]
    RebalanceRunning,
    #[error("no rebalance is under way")]
    NoRebalance,
    #[error("no user {name}")]
    NoSuchUser { name: String },
    #[error("the cluster must keep at least one user with the admin role")]
    LastAdmin,
    #[error("the cluster has users already")]
    UsersExist,
    #[error("the user is not valid: {why}")]
    InvalidUser { why: String },
}

/// What an index definition asks of placement: `partitions` (default
/// [`INDEX_PARTITIONS_DEFAULT`](shoal_cluster::index_placement::INDEX_PARTITIONS_DEFAULT))
/// and `replicas` (default 0). The API checked the definition (`shoal-index` parses it); a
/// command built another way is refused here, never stored half-placed.
/// [`index_spec`] of an index in the log.
pub fn index_spec_of(def: &IndexDef) -> Result<shoal_cluster::index_placement::IndexSpec, MetaReject> {
    index_spec(u64::from(def.id), &def.definition)
}

/// An index's placement as the pure functions of `shoal_cluster::index_placement` take it:
/// each of its partitions with its copies.
pub fn placement_units(def: &IndexDef) -> impl Iterator<Item = (shoal_cluster::index_placement::IndexPart, Vec<NodeId>)> + '_ {
    def.placement.iter().enumerate().map(move |(p, copies)| {
        let unit = shoal_cluster::index_placement::IndexPart { index: u64::from(def.id), partition: u16::try_from(p).unwrap_or(u16::MAX) };
        (unit, copies.clone())
    })
}

fn index_spec(index: u64, definition: &serde_json::Value) -> Result<shoal_cluster::index_placement::IndexSpec, MetaReject> {
    use shoal_cluster::index_placement::INDEX_PARTITIONS_DEFAULT;
    let field = |name: &str, default: u64| -> Result<u64, MetaReject> {
        match definition.get(name) {
            None | Some(serde_json::Value::Null) => Ok(default),
            Some(v) => {
                v.as_u64().ok_or_else(|| MetaReject::OutOfRange { what: format!("index {name}"), why: format!("{v} is not a count") })
            }
        }
    };
    Ok(shoal_cluster::index_placement::IndexSpec {
        index,
        partitions: u16::try_from(field("partitions", INDEX_PARTITIONS_DEFAULT.into())?).unwrap_or(u16::MAX),
        replicas: u8::try_from(field("replicas", 0)?).unwrap_or(u8::MAX),
    })
}

fn check_name(what: &str, name: &str) -> Result<(), MetaReject> {
    if name.is_empty() || name.len() > NAME_MAX_BYTES {
        return Err(MetaReject::OutOfRange { what: what.into(), why: format!("a name has 1 to {NAME_MAX_BYTES} bytes") });
    }
    Ok(())
}

fn check_range(what: &str, value: u64, min: u64, max: u64) -> Result<(), MetaReject> {
    if value < min || value > max {
        return Err(MetaReject::OutOfRange { what: what.into(), why: format!("{value} is not in {min}..={max}") });
    }
    Ok(())
}

impl MetaState {
    /// The current map version, 0 before the first map.
    pub fn map_version(&self) -> u64 {
        self.map.as_ref().map_or(0, |m| m.version)
    }

    /// Applies one committed command. Pure: the same state and command give the same answer
    /// on every member. A refused command leaves the state exactly as it was.
    pub fn apply(&mut self, cmd: MetaCommand) -> Result<MetaResponse, MetaReject> {
        let answer = match cmd {
            MetaCommand::InitCluster { cluster_id } => {
                if !self.cluster_id.is_empty() {
                    return Err(MetaReject::ClusterNamed { cluster_id: self.cluster_id.clone() });
                }
                check_name("cluster id", &cluster_id)?;
                self.cluster_id = cluster_id;
                Ok(MetaResponse::Done)
            }
            MetaCommand::AddMember { node, address, services } => self.add_member(node, address, services),
            MetaCommand::SetMemberState { node, state } => {
                let member = self.members.get_mut(&node).ok_or(MetaReject::NoSuchMember { node })?;
                let was = std::mem::replace(&mut member.state, state);
                if state == MemberState::Failed && was != MemberState::Failed {
                    self.repair_index_placements();
                }
                Ok(MetaResponse::Done)
            }
            MetaCommand::RemoveMember { node } => {
                if !self.members.contains_key(&node) {
                    return Err(MetaReject::NoSuchMember { node });
                }
                if self.map.as_ref().is_some_and(|m| m.partitions.iter().any(|c| c.holds(node))) {
                    return Err(MetaReject::MemberHoldsCopies { node });
                }
                self.members.remove(&node);
                Ok(MetaResponse::Done)
            }
            MetaCommand::CreateCollection { name, max_ttl, id } => self.create_collection(name, max_ttl, id),
            MetaCommand::SetIndexPlacements { placements } => self.set_index_placements(placements),
            MetaCommand::DropCollection { name } => {
                if self.collections.remove(&name).is_none() {
                    return Err(MetaReject::NoSuchCollection { name });
                }
                self.indexes.remove(&name);
                // A collection made again under this name is another one: no role carries over.
                for user in self.users.values_mut() {
                    user.roles.retain(|r| r.collection() != Some(name.as_str()));
                }
                Ok(MetaResponse::Done)
            }
            MetaCommand::CreateIndex { collection, name, definition } => self.create_index(collection, name, definition),
            MetaCommand::DropIndex { collection, name } => {
                let removed = self.indexes.get_mut(&collection).and_then(|by_name| by_name.remove(&name));
                if removed.is_none() {
                    return Err(MetaReject::NoSuchIndex { collection, name });
                }
                if self.indexes.get(&collection).is_some_and(BTreeMap::is_empty) {
                    self.indexes.remove(&collection);
                }
                Ok(MetaResponse::Done)
            }
            MetaCommand::BuildIndexes { collection, names } => {
                let Some(by_name) = self.indexes.get_mut(&collection) else {
                    return Err(MetaReject::NoSuchIndex { collection, name: names.into_iter().next().unwrap_or_default() });
                };
                if let Some(missing) = names.iter().find(|n| !by_name.contains_key(*n)) {
                    return Err(MetaReject::NoSuchIndex { collection, name: missing.clone() });
                }
                for name in &names {
                    if let Some(def) = by_name.get_mut(name) {
                        def.built = true;
                    }
                }
                Ok(MetaResponse::Done)
            }
            MetaCommand::SetMap { map } => self.set_map(map),
            MetaCommand::UpdateSettings { patch } => self.update_settings(patch),
            MetaCommand::PutUser { name, user } => self.put_user(name, user),
            MetaCommand::DeleteUser { name } => {
                let user = self.users.get(&name).ok_or_else(|| MetaReject::NoSuchUser { name: name.clone() })?;
                if user.is_admin() && self.users.values().filter(|u| u.is_admin()).count() == 1 {
                    return Err(MetaReject::LastAdmin);
                }
                self.users.remove(&name);
                Ok(MetaResponse::Done)
            }
            MetaCommand::CreateFirstAdmin { user } => {
                if !self.users.is_empty() {
                    return Err(MetaReject::UsersExist);
                }
                if !user.is_admin() {
                    return Err(MetaReject::InvalidUser { why: "the first user is an admin".into() });
                }
                self.put_user(crate::users::ADMIN_USER.to_string(), user)
            }
            MetaCommand::BeginRebalance { plan } => {
                if self.rebalance.is_some() {
                    return Err(MetaReject::RebalanceRunning);
                }
                plan.target.check().map_err(|e| MetaReject::InvalidMap { why: e.to_string() })?;
                self.rebalance = Some(plan);
                Ok(MetaResponse::Done)
            }
            MetaCommand::StopRebalance => {
                let plan = self.rebalance.as_mut().ok_or(MetaReject::NoRebalance)?;
                plan.stop = true;
                Ok(MetaResponse::Done)
            }
            MetaCommand::EndRebalance => {
                self.rebalance = None;
                Ok(MetaResponse::Done)
            }
        };
        debug_assert!(self.check().is_ok(), "apply broke an invariant: {:?}", self.check());
        answer
    }

    fn add_member(&mut self, node: NodeId, address: String, services: Services) -> Result<MetaResponse, MetaReject> {
        if address.is_empty() || address.len() > ADDRESS_MAX_BYTES {
            return Err(MetaReject::OutOfRange { what: "address".into(), why: format!("an address has 1 to {ADDRESS_MAX_BYTES} bytes") });
        }
        if self.members.contains_key(&node) {
            return Err(MetaReject::MemberExists { node });
        }
        if let Some((other, _)) = self.members.iter().find(|(_, m)| m.address == address && m.state != MemberState::Ejected) {
            return Err(MetaReject::AddressInUse { address, node: *other });
        }
        if self.members.len() >= shoal_cluster::NODES_MAX {
            return Err(MetaReject::LimitReached { what: format!("at most {} members", shoal_cluster::NODES_MAX) });
        }
        self.members.insert(node, Member { address, state: MemberState::Added, services });
        Ok(MetaResponse::Done)
    }

    fn create_collection(&mut self, name: String, max_ttl: u32, id: Option<CollectionId>) -> Result<MetaResponse, MetaReject> {
        check_name("collection name", &name)?;
        if self.collections.contains_key(&name) {
            return Err(MetaReject::CollectionExists { name });
        }
        if self.collections.len() >= COLLECTIONS_MAX {
            return Err(MetaReject::LimitReached { what: format!("at most {COLLECTIONS_MAX} collections") });
        }
        let id = match id {
            Some(0) => return Err(MetaReject::OutOfRange { what: "collection id".into(), why: "ids start at 1".into() }),
            Some(id) if self.collections.values().any(|c| c.id == id) => return Err(MetaReject::CollectionIdInUse { id }),
            Some(id) => id,
            None => self.next_collection_id,
        };
        let next = id.checked_add(1).ok_or_else(|| MetaReject::LimitReached { what: "collection ids".into() })?;
        self.next_collection_id = self.next_collection_id.max(next);
        self.collections.insert(name, CollectionDef { id, max_ttl });
        Ok(MetaResponse::CollectionCreated { id })
    }

    fn create_index(&mut self, collection: String, name: String, definition: serde_json::Value) -> Result<MetaResponse, MetaReject> {
        check_name("index name", &name)?;
        if !self.collections.contains_key(&collection) {
            return Err(MetaReject::NoSuchCollection { name: collection });
        }
        // The definition came through JSON, so serialising it again cannot fail; a failure
        // would be refused rather than stored.
        let size = serde_json::to_vec(&definition).map(|v| v.len()).unwrap_or(usize::MAX);
        if size > INDEX_DEFINITION_MAX_BYTES {
            return Err(MetaReject::OutOfRange {
                what: "index definition".into(),
                why: format!("at most {INDEX_DEFINITION_MAX_BYTES} bytes"),
            });
        }
        let existing = self.indexes.get(&collection);
        if existing.is_some_and(|by_name| by_name.contains_key(&name)) {
            return Err(MetaReject::IndexExists { collection, name });
        }
        if existing.is_some_and(|by_name| by_name.len() >= INDEXES_PER_COLLECTION_MAX) {
            return Err(MetaReject::LimitReached { what: format!("at most {INDEXES_PER_COLLECTION_MAX} indexes per collection") });
        }
        let id = self.next_index_id;
        let next = id.checked_add(1).ok_or_else(|| MetaReject::LimitReached { what: "index ids".into() })?;
        let placement = self.place_new_index(id, &definition)?;
        self.next_index_id = next;
        let def = IndexDef { collection: collection.clone(), name: name.clone(), id, definition, built: false, placement };
        self.indexes.entry(collection).or_default().insert(name, def);
        Ok(MetaResponse::IndexCreated { id })
    }

    /// Members that hold placed index partitions: active and running the index service
    /// (with data or without).
    pub fn index_service_nodes(&self) -> Vec<NodeId> {
        self.members.iter().filter(|(_, m)| m.state == MemberState::Active && m.services.index).map(|(id, _)| *id).collect()
    }

    /// Whether member `node` holds copies a failover would move: data partitions (it runs
    /// the data service) or index partitions placed on it.
    pub fn holds_copies(&self, node: NodeId) -> bool {
        let data = self.members.get(&node).is_some_and(|m| m.services.data);
        data || self.indexes.values().flat_map(|by_name| by_name.values()).any(|d| d.placement.iter().any(|c| c.contains(&node)))
    }

    /// After a member failed over: its index copies are taken out of every placement; an
    /// index partition left without a copy is placed on the least loaded index node left,
    /// which rebuilds it from the streams (`shoal_cluster::index_placement::repair_indexes`).
    /// Nothing moves while no index node is left (its scans are refused until one is).
    fn repair_index_placements(&mut self) {
        use shoal_cluster::index_placement::{repair_indexes, IndexPlacement};
        let nodes = self.index_service_nodes();
        if nodes.is_empty() {
            return;
        }
        let mut previous = IndexPlacement::new();
        for def in self.indexes.values().flat_map(|by_name| by_name.values()).filter(|d| d.is_placed()) {
            previous.extend(placement_units(def));
        }
        let repaired = repair_indexes(&previous, &nodes);
        for def in self.indexes.values_mut().flat_map(|by_name| by_name.values_mut()).filter(|d| d.is_placed()) {
            let placement = placement_units(def).map(|(unit, copies)| repaired.get(&unit).cloned().unwrap_or(copies)).collect();
            def.placement = placement;
        }
    }

    /// Where a new index's partitions go: placed among every placed index's copies, so that
    /// the index nodes stay balanced (the indexes already placed keep their copies; they
    /// move in a rebalance). Empty when no node runs the index service alone.
    fn place_new_index(&self, id: IndexId, definition: &serde_json::Value) -> Result<Vec<Vec<NodeId>>, MetaReject> {
        use shoal_cluster::index_placement::{place_indexes, IndexPart, IndexPlacement};
        let nodes: Vec<shoal_cluster::Node> =
            self.index_service_nodes().into_iter().map(|id| shoal_cluster::Node { id, weight: 1 }).collect();
        if nodes.is_empty() {
            return Ok(Vec::new());
        }
        let mut specs = vec![index_spec(u64::from(id), definition)?];
        let mut previous = IndexPlacement::new();
        for def in self.indexes.values().flat_map(|by_name| by_name.values()).filter(|d| d.is_placed()) {
            specs.push(index_spec(u64::from(def.id), &def.definition)?);
            previous.extend(placement_units(def));
        }
        let bad = |e: shoal_cluster::index_placement::IndexPlaceError| MetaReject::OutOfRange {
            what: "index placement".into(),
            why: e.to_string(),
        };
        let placed = place_indexes(&specs, &nodes, &previous).map_err(bad)?;
        Ok(placed
            .range(IndexPart { index: u64::from(id), partition: 0 }..=IndexPart { index: u64::from(id), partition: u16::MAX })
            .map(|(_, c)| c.clone())
            .collect())
    }

    fn set_index_placements(&mut self, placements: Vec<IndexPlacementChange>) -> Result<MetaResponse, MetaReject> {
        // Check all before changing any.
        for change in &placements {
            let def = self
                .indexes
                .get(&change.collection)
                .and_then(|by_name| by_name.get(&change.name))
                .filter(|d| d.id == change.id)
                .ok_or_else(|| MetaReject::NoSuchIndex { collection: change.collection.clone(), name: change.name.clone() })?;
            if change.from.as_ref().is_some_and(|from| *from != def.placement) {
                return Err(MetaReject::IndexPlacementChanged { collection: change.collection.clone(), name: change.name.clone() });
            }
            let spec = index_spec(u64::from(def.id), &def.definition)?;
            let bad = |why: String| MetaReject::OutOfRange { what: format!("placement of index {}", change.name), why };
            if change.placement.len() != usize::from(spec.partitions) {
                return Err(bad(format!("{} partitions placed of {}", change.placement.len(), spec.partitions)));
            }
            for copies in &change.placement {
                if copies.is_empty() || (1..copies.len()).any(|i| copies[..i].contains(&copies[i])) {
                    return Err(bad("a partition without copies or with two on one node".into()));
                }
                if let Some(node) = copies.iter().find(|n| !self.members.get(n).is_some_and(|m| m.services.index)) {
                    return Err(bad(format!("node {node} is not a member running the index service")));
                }
                // A copy on a failed member is gone (a rebalance's adoption on a node that
                // failed over before the placement was committed).
                if let Some(node) = copies.iter().find(|n| self.members.get(n).is_some_and(|m| m.state == MemberState::Failed)) {
                    return Err(bad(format!("node {node} has failed over")));
                }
            }
        }
        for change in placements {
            if let Some(def) = self.indexes.get_mut(&change.collection).and_then(|by_name| by_name.get_mut(&change.name)) {
                def.placement = change.placement;
            }
        }
        Ok(MetaResponse::Done)
    }

    fn set_map(&mut self, map: PartitionMap) -> Result<MetaResponse, MetaReject> {
        let expected = self.map_version() + 1;
        if map.version != expected {
            return Err(MetaReject::MapVersion { expected, got: map.version });
        }
        map.check().map_err(|e| MetaReject::InvalidMap { why: e.to_string() })?;
        if let Some(old) = &self.map {
            if old.partition_count() != map.partition_count() {
                return Err(MetaReject::PartitionCountChanged { expected: old.partition_count(), got: map.partition_count() });
            }
        }
        for copies in &map.partitions {
            for node in copies.nodes() {
                // A failed member stays named as the active of partitions no replica could
                // take (failover leaves them with their only copy until the node is
                // recovered); it is never given a replica.
                let failed_ok = node == copies.active;
                let usable = self.members.get(&node).is_some_and(|m| match m.state {
                    MemberState::Active | MemberState::Added | MemberState::Leaving => true,
                    MemberState::Failed => failed_ok,
                    MemberState::Ejected => false,
                });
                if !usable {
                    return Err(MetaReject::MapNodeNotMember { node });
                }
            }
        }
        let version = map.version;
        self.map = Some(map);
        Ok(MetaResponse::MapSet { version })
    }

    fn put_user(&mut self, name: String, user: User) -> Result<MetaResponse, MetaReject> {
        use crate::users::{check_user_name, HASH_MAX_BYTES, ROLES_PER_USER_MAX, USERS_MAX};
        check_user_name(&name).map_err(|why| MetaReject::InvalidUser { why })?;
        if user.hash.is_empty() || user.hash.len() > HASH_MAX_BYTES {
            return Err(MetaReject::InvalidUser { why: format!("a password hash has 1 to {HASH_MAX_BYTES} bytes") });
        }
        if user.roles.len() > ROLES_PER_USER_MAX {
            return Err(MetaReject::InvalidUser { why: format!("at most {ROLES_PER_USER_MAX} roles") });
        }
        if let Some(missing) = user.roles.iter().filter_map(|r| r.collection()).find(|c| !self.collections.contains_key(*c)) {
            return Err(MetaReject::NoSuchCollection { name: missing.to_string() });
        }
        let was_admin = self.users.get(&name).is_some_and(User::is_admin);
        if was_admin && !user.is_admin() && self.users.values().filter(|u| u.is_admin()).count() == 1 {
            return Err(MetaReject::LastAdmin);
        }
        if !self.users.contains_key(&name) && self.users.len() >= USERS_MAX {
            return Err(MetaReject::LimitReached { what: format!("at most {USERS_MAX} users") });
        }
        let mut user = user;
        user.roles.sort();
        user.roles.dedup();
        self.users.insert(name, user);
        Ok(MetaResponse::Done)
    }

    fn update_settings(&mut self, patch: SettingsPatch) -> Result<MetaResponse, MetaReject> {
        // Check every field before changing any, so a refused patch changes nothing.
        if let Some(v) = patch.auto_failover_timeout_s {
            check_range("auto_failover_timeout_s", v.into(), AUTO_FAILOVER_TIMEOUT_MIN_S.into(), AUTO_FAILOVER_TIMEOUT_MAX_S.into())?;
        }
        if let Some(v) = patch.auto_failover_max_count {
            check_range("auto_failover_max_count", v.into(), 0, AUTO_FAILOVER_MAX_COUNT_MAX.into())?;
        }
        if let Some(v) = patch.replicas {
            check_range("replicas", v.into(), 0, REPLICAS_MAX.into())?;
        }
        if let Some(v) = patch.rebalance_mb_per_s {
            check_range("rebalance_mb_per_s", v.into(), 0, REBALANCE_MB_PER_S_MAX.into())?;
        }
        if let Some(v) = patch.rebalance_moves_per_node {
            check_range("rebalance_moves_per_node", v.into(), 1, REBALANCE_MOVES_PER_NODE_MAX.into())?;
        }
        let s = &mut self.settings;
        s.auto_failover_timeout_s = patch.auto_failover_timeout_s.unwrap_or(s.auto_failover_timeout_s);
        s.auto_failover_max_count = patch.auto_failover_max_count.unwrap_or(s.auto_failover_max_count);
        s.replicas = patch.replicas.unwrap_or(s.replicas);
        s.rebalance_mb_per_s = patch.rebalance_mb_per_s.unwrap_or(s.rebalance_mb_per_s);
        s.rebalance_moves_per_node = patch.rebalance_moves_per_node.unwrap_or(s.rebalance_moves_per_node);
        Ok(MetaResponse::Done)
    }

    /// The invariants `apply` keeps: ids below their next id and unique, index entries under
    /// their own collection, a map that is well formed.
    pub fn check(&self) -> Result<(), String> {
        let mut ids: Vec<CollectionId> = self.collections.values().map(|c| c.id).collect();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) || ids.last().is_some_and(|&id| id >= self.next_collection_id) {
            return Err("collection ids are not unique or not below next_collection_id".into());
        }
        for (collection, by_name) in &self.indexes {
            if !self.collections.contains_key(collection) {
                return Err(format!("indexes of a missing collection {collection}"));
            }
            for (name, def) in by_name {
                if &def.collection != collection || &def.name != name || def.id >= self.next_index_id {
                    return Err(format!("index {collection}.{name} is filed wrongly"));
                }
                if def.placement.iter().any(|copies| copies.is_empty() || (1..copies.len()).any(|i| copies[..i].contains(&copies[i]))) {
                    return Err(format!("index {collection}.{name} has a partition without copies or two copies on one node"));
                }
            }
        }
        if let Some(map) = &self.map {
            map.check().map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn services_parse_names_and_refuse_unknown_ones() {
        let only = |data, index, query| Services { data, index, query };
        let cases: [(&str, Result<Services, ServicesError>); 7] = [
            ("data,index,query", Ok(Services::ALL)),
            ("data", Ok(only(true, false, false))),
            (" Index , query,index", Ok(only(false, true, true))),
            ("", Err(ServicesError::Empty)),
            (",,", Err(ServicesError::Empty)),
            ("data,search", Err(ServicesError::Unknown("search".into()))),
            ("kv", Err(ServicesError::Unknown("kv".into()))),
        ];
        for (list, want) in cases {
            assert_eq!(Services::parse(list), want, "{list:?}");
        }
        assert_eq!(only(false, true, true).names(), vec!["index", "query"]);
        let old: Member = serde_json::from_str(r#"{"address":"a:1","state":"active"}"#).expect("a member from before services");
        assert_eq!(old.services, Services::ALL);
    }

    use super::*;
    use serde_json::json;
    use shoal_cluster::Copies;

    fn n(id: u64) -> NodeId {
        NodeId(id)
    }

    fn plan() -> RebalancePlan {
        RebalancePlan { from: map(1, &[(1, &[])]), target: map(0, &[(2, &[1])]), eject: vec![], added: vec![n(2)], stop: false }
    }

    fn map(version: u64, rows: &[(u64, &[u64])]) -> PartitionMap {
        PartitionMap {
            version,
            partitions: rows.iter().map(|(a, r)| Copies { active: n(*a), replicas: r.iter().map(|&x| n(x)).collect() }).collect(),
        }
    }

    fn add(node: u64, address: &str) -> MetaCommand {
        MetaCommand::AddMember { node: n(node), address: address.into(), services: Services::ALL }
    }

    fn create(name: &str) -> MetaCommand {
        MetaCommand::CreateCollection { name: name.into(), max_ttl: 0, id: None }
    }

    fn index(collection: &str, name: &str) -> MetaCommand {
        MetaCommand::CreateIndex { collection: collection.into(), name: name.into(), definition: json!({"keys": ["a"]}) }
    }

    fn build(collection: &str, names: &[&str]) -> MetaCommand {
        MetaCommand::BuildIndexes { collection: collection.into(), names: names.iter().map(|n| n.to_string()).collect() }
    }

    fn settings(patch: SettingsPatch) -> MetaCommand {
        MetaCommand::UpdateSettings { patch }
    }

    /// Each case: commands applied in order from an empty state, and the answer of each.
    #[test]
    fn apply_table() {
        use MetaReject as R;
        use MetaResponse as A;
        type Case = (&'static str, Vec<(MetaCommand, Result<MetaResponse, MetaReject>)>);
        let user = |roles: &[&str]| crate::users::User {
            hash: "$argon2id$v=19$m=19456,t=2,p=1$c2FsdA$aGFzaA".into(),
            roles: roles.iter().map(|r| r.parse().unwrap()).collect(),
        };
        let put = |name: &str, roles: &[&str]| MetaCommand::PutUser { name: name.into(), user: user(roles) };
        let delete = |name: &str| MetaCommand::DeleteUser { name: name.into() };
        let cases: Vec<Case> = vec![
            (
                "the first admin is made once, and the last admin stays",
                vec![
                    (
                        MetaCommand::CreateFirstAdmin { user: user(&["metrics_reader"]) },
                        Err(R::InvalidUser { why: "the first user is an admin".into() }),
                    ),
                    (MetaCommand::CreateFirstAdmin { user: user(&["admin"]) }, Ok(A::Done)),
                    (MetaCommand::CreateFirstAdmin { user: user(&["admin"]) }, Err(R::UsersExist)),
                    (delete("admin"), Err(R::LastAdmin)),
                    (put("admin", &["cluster_admin"]), Err(R::LastAdmin)),
                    (put("root", &["admin"]), Ok(A::Done)),
                    (put("admin", &["cluster_admin"]), Ok(A::Done)),
                    (delete("root"), Err(R::LastAdmin)),
                    (delete("admin"), Ok(A::Done)),
                    (delete("admin"), Err(R::NoSuchUser { name: "admin".into() })),
                ],
            ),
            (
                "a role names a collection that exists, and goes when it is dropped",
                vec![
                    (put("app", &["data_reader[c]"]), Err(R::NoSuchCollection { name: "c".into() })),
                    (create("c"), Ok(A::CollectionCreated { id: 1 })),
                    (put("app", &["data_reader[c]", "data_writer[*]", "data_reader[c]"]), Ok(A::Done)),
                    (MetaCommand::DropCollection { name: "c".into() }, Ok(A::Done)),
                    (create("c"), Ok(A::CollectionCreated { id: 2 })),
                    (
                        put("bad:name", &[]),
                        Err(R::InvalidUser { why: "a user name holds letters, digits and _ . - @ only, not ':'".into() }),
                    ),
                    (
                        MetaCommand::PutUser { name: "nohash".into(), user: crate::users::User { hash: String::new(), roles: vec![] } },
                        Err(R::InvalidUser { why: format!("a password hash has 1 to {} bytes", crate::users::HASH_MAX_BYTES) }),
                    ),
                ],
            ),
            (
                "collection ids come from the log, in order, never reused",
                vec![
                    (create("a"), Ok(A::CollectionCreated { id: 1 })),
                    (create("b"), Ok(A::CollectionCreated { id: 2 })),
                    (create("a"), Err(R::CollectionExists { name: "a".into() })),
                    (MetaCommand::DropCollection { name: "a".into() }, Ok(A::Done)),
                    (create("a"), Ok(A::CollectionCreated { id: 3 })),
                    (MetaCommand::DropCollection { name: "zz".into() }, Err(R::NoSuchCollection { name: "zz".into() })),
                    (
                        create(""),
                        Err(R::OutOfRange { what: "collection name".into(), why: format!("a name has 1 to {NAME_MAX_BYTES} bytes") }),
                    ),
                ],
            ),
            (
                "a collection brought in keeps its id; ids handed out later skip it",
                vec![
                    (MetaCommand::CreateCollection { name: "old".into(), max_ttl: 0, id: Some(5) }, Ok(A::CollectionCreated { id: 5 })),
                    (MetaCommand::CreateCollection { name: "x".into(), max_ttl: 0, id: Some(5) }, Err(R::CollectionIdInUse { id: 5 })),
                    (
                        MetaCommand::CreateCollection { name: "x".into(), max_ttl: 0, id: Some(0) },
                        Err(R::OutOfRange { what: "collection id".into(), why: "ids start at 1".into() }),
                    ),
                    (create("new"), Ok(A::CollectionCreated { id: 6 })),
                    (MetaCommand::CreateCollection { name: "older".into(), max_ttl: 0, id: Some(2) }, Ok(A::CollectionCreated { id: 2 })),
                    (create("newer"), Ok(A::CollectionCreated { id: 7 })),
                ],
            ),
            (
                "the cluster is named once",
                vec![
                    (MetaCommand::InitCluster { cluster_id: "c1".into() }, Ok(A::Done)),
                    (MetaCommand::InitCluster { cluster_id: "c2".into() }, Err(R::ClusterNamed { cluster_id: "c1".into() })),
                ],
            ),
            (
                "indexes need their collection and go with it",
                vec![
                    (index("c", "i"), Err(R::NoSuchCollection { name: "c".into() })),
                    (create("c"), Ok(A::CollectionCreated { id: 1 })),
                    (index("c", "i"), Ok(A::IndexCreated { id: 1 })),
                    (index("c", "i"), Err(R::IndexExists { collection: "c".into(), name: "i".into() })),
                    (index("c", "j"), Ok(A::IndexCreated { id: 2 })),
                    (MetaCommand::DropIndex { collection: "c".into(), name: "j".into() }, Ok(A::Done)),
                    (
                        MetaCommand::DropIndex { collection: "c".into(), name: "j".into() },
                        Err(R::NoSuchIndex { collection: "c".into(), name: "j".into() }),
                    ),
                    (MetaCommand::DropCollection { name: "c".into() }, Ok(A::Done)),
                    (create("c"), Ok(A::CollectionCreated { id: 2 })),
                    (
                        MetaCommand::DropIndex { collection: "c".into(), name: "i".into() },
                        Err(R::NoSuchIndex { collection: "c".into(), name: "i".into() }),
                    ),
                    (index("c", "i"), Ok(A::IndexCreated { id: 3 })),
                ],
            ),
            (
                "a build marks its indexes built, all of them or none",
                vec![
                    (create("c"), Ok(A::CollectionCreated { id: 1 })),
                    (index("c", "i"), Ok(A::IndexCreated { id: 1 })),
                    (index("c", "j"), Ok(A::IndexCreated { id: 2 })),
                    (build("c", &["i", "nope"]), Err(R::NoSuchIndex { collection: "c".into(), name: "nope".into() })),
                    (build("d", &["i"]), Err(R::NoSuchIndex { collection: "d".into(), name: "i".into() })),
                    (build("c", &["i", "j"]), Ok(A::Done)),
                    (build("c", &["i"]), Ok(A::Done)),
                ],
            ),
            (
                "members: join once, one address each, removed only when they hold nothing",
                vec![
                    (add(1, "h1:1"), Ok(A::Done)),
                    (add(1, "h1:1"), Err(R::MemberExists { node: n(1) })),
                    (add(2, "h1:1"), Err(R::AddressInUse { address: "h1:1".into(), node: n(1) })),
                    (add(2, "h2:1"), Ok(A::Done)),
                    (MetaCommand::SetMemberState { node: n(3), state: MemberState::Active }, Err(R::NoSuchMember { node: n(3) })),
                    (MetaCommand::SetMemberState { node: n(1), state: MemberState::Active }, Ok(A::Done)),
                    (MetaCommand::SetMap { map: map(1, &[(1, &[2]), (2, &[1])]) }, Ok(A::MapSet { version: 1 })),
                    (MetaCommand::RemoveMember { node: n(2) }, Err(R::MemberHoldsCopies { node: n(2) })),
                    (MetaCommand::SetMap { map: map(2, &[(1, &[]), (1, &[])]) }, Ok(A::MapSet { version: 2 })),
                    (MetaCommand::RemoveMember { node: n(2) }, Ok(A::Done)),
                    (MetaCommand::RemoveMember { node: n(2) }, Err(R::NoSuchMember { node: n(2) })),
                ],
            ),
            (
                "the map is compare-and-set on its version",
                vec![
                    (add(1, "h1:1"), Ok(A::Done)),
                    (add(2, "h2:1"), Ok(A::Done)),
                    (MetaCommand::SetMap { map: map(2, &[(1, &[2])]) }, Err(R::MapVersion { expected: 1, got: 2 })),
                    (MetaCommand::SetMap { map: map(0, &[(1, &[2])]) }, Err(R::MapVersion { expected: 1, got: 0 })),
                    (MetaCommand::SetMap { map: map(1, &[(1, &[2]), (2, &[1])]) }, Ok(A::MapSet { version: 1 })),
                    (MetaCommand::SetMap { map: map(1, &[(2, &[1]), (1, &[2])]) }, Err(R::MapVersion { expected: 2, got: 1 })),
                    (MetaCommand::SetMap { map: map(2, &[(2, &[1])]) }, Err(R::PartitionCountChanged { expected: 2, got: 1 })),
                    (
                        MetaCommand::SetMap { map: map(2, &[(1, &[1]), (2, &[])]) },
                        Err(R::InvalidMap { why: "partition 0 has two copies on node n1".into() }),
                    ),
                    (MetaCommand::SetMap { map: map(2, &[(1, &[3]), (2, &[])]) }, Err(R::MapNodeNotMember { node: n(3) })),
                    (MetaCommand::SetMemberState { node: n(2), state: MemberState::Failed }, Ok(A::Done)),
                    (MetaCommand::SetMap { map: map(2, &[(1, &[2]), (1, &[])]) }, Err(R::MapNodeNotMember { node: n(2) })),
                    (MetaCommand::SetMap { map: map(2, &[(1, &[]), (1, &[])]) }, Ok(A::MapSet { version: 2 })),
                    // The only copy of a partition stays with its failed node until it is recovered.
                    (MetaCommand::SetMap { map: map(3, &[(1, &[]), (2, &[])]) }, Ok(A::MapSet { version: 3 })),
                ],
            ),
            (
                "settings: ranges checked, a refused patch changes nothing",
                vec![
                    (
                        settings(SettingsPatch { replicas: Some(4), ..Default::default() }),
                        Err(R::OutOfRange { what: "replicas".into(), why: "4 is not in 0..=3".into() }),
                    ),
                    (
                        settings(SettingsPatch { auto_failover_timeout_s: Some(1), ..Default::default() }),
                        Err(R::OutOfRange { what: "auto_failover_timeout_s".into(), why: "1 is not in 2..=3600".into() }),
                    ),
                    (
                        settings(SettingsPatch { replicas: Some(2), rebalance_moves_per_node: Some(0), ..Default::default() }),
                        Err(R::OutOfRange { what: "rebalance_moves_per_node".into(), why: "0 is not in 1..=64".into() }),
                    ),
                    (settings(SettingsPatch { replicas: Some(2), auto_failover_timeout_s: Some(30), ..Default::default() }), Ok(A::Done)),
                ],
            ),
            (
                "one rebalance plan at a time; a stop needs one; its end forgets it",
                vec![
                    (MetaCommand::StopRebalance, Err(R::NoRebalance)),
                    (MetaCommand::BeginRebalance { plan: plan() }, Ok(A::Done)),
                    (MetaCommand::BeginRebalance { plan: plan() }, Err(R::RebalanceRunning)),
                    (MetaCommand::StopRebalance, Ok(A::Done)),
                    (MetaCommand::EndRebalance, Ok(A::Done)),
                    (MetaCommand::StopRebalance, Err(R::NoRebalance)),
                    (
                        MetaCommand::BeginRebalance { plan: RebalancePlan { target: map(0, &[(1, &[1])]), ..plan() } },
                        Err(R::InvalidMap { why: "partition 0 has two copies on node n1".into() }),
                    ),
                ],
            ),
        ];
        for (name, steps) in cases {
            let mut state = MetaState::default();
            for (i, (cmd, want)) in steps.into_iter().enumerate() {
                let before = state.clone();
                let got = state.apply(cmd.clone());
                assert_eq!(got, want, "{name}: step {i} {cmd:?}");
                if got.is_err() {
                    assert_eq!(state, before, "{name}: step {i} refused but changed the state");
                }
                state.check().unwrap();
            }
        }
    }

    #[test]
    fn a_dropped_collection_takes_its_roles_with_it() {
        let mut state = MetaState::default();
        state.apply(create("c")).unwrap();
        let roles = ["data_reader[c]", "data_writer[*]"].iter().map(|r| r.parse().unwrap()).collect();
        state.apply(MetaCommand::PutUser { name: "app".into(), user: crate::users::User { hash: "h".into(), roles } }).unwrap();
        state.apply(MetaCommand::DropCollection { name: "c".into() }).unwrap();
        state.apply(create("c")).unwrap();
        assert_eq!(state.users["app"].roles, vec![crate::users::Role::DataWriter(crate::users::Scope::All)]);
    }

    /// A user holds at most `ROLES_PER_USER_MAX` roles, and the log at most `USERS_MAX`
    /// users; at the cap a user can still be changed, and one deleted makes room.
    #[test]
    fn users_and_their_roles_stop_at_their_limits() {
        use crate::users::{Role, Scope, User, ROLES_PER_USER_MAX, USERS_MAX};
        let mut state = MetaState::default();
        for i in 0..=ROLES_PER_USER_MAX {
            state.apply(create(&format!("c{i}"))).unwrap();
        }
        let roles = |n: usize| (0..n).map(|i| Role::DataReader(Scope::Collection(format!("c{i}")))).collect::<Vec<_>>();
        let user = |roles: Vec<Role>| User { hash: "h".into(), roles };
        let put = |name: &str, roles: Vec<Role>| MetaCommand::PutUser { name: name.into(), user: user(roles) };
        assert_eq!(state.apply(put("many", roles(ROLES_PER_USER_MAX))), Ok(MetaResponse::Done));
        assert_eq!(state.users["many"].roles.len(), ROLES_PER_USER_MAX);
        assert_eq!(
            state.apply(put("many", roles(ROLES_PER_USER_MAX + 1))),
            Err(MetaReject::InvalidUser { why: format!("at most {ROLES_PER_USER_MAX} roles") })
        );
        for i in state.users.len()..USERS_MAX {
            assert_eq!(state.apply(put(&format!("u{i}"), vec![])), Ok(MetaResponse::Done));
        }
        assert_eq!(state.users.len(), USERS_MAX);
        assert_eq!(state.apply(put("one-more", vec![])), Err(MetaReject::LimitReached { what: format!("at most {USERS_MAX} users") }));
        assert_eq!(state.apply(put("many", roles(1))), Ok(MetaResponse::Done), "a user at the cap can still be changed");
        assert_eq!(state.apply(MetaCommand::DeleteUser { name: "many".into() }), Ok(MetaResponse::Done));
        assert_eq!(state.apply(put("one-more", vec![])), Ok(MetaResponse::Done), "a deleted user makes room");
        assert_eq!(state.users.len(), USERS_MAX);
    }

    /// Members that create a built index later build it too: the flag is in the state.
    #[test]
    fn a_new_index_is_placed_on_the_nodes_running_the_index_service() {
        let mut state = MetaState::default();
        let index_only = Services { data: false, index: true, query: false };
        let data_only = Services { data: true, index: false, query: true };
        for (id, services) in [(1, data_only), (2, data_only), (3, Services::ALL), (4, index_only)] {
            state.apply(MetaCommand::AddMember { node: n(id), address: format!("n{id}"), services }).expect("added");
            state.apply(MetaCommand::SetMemberState { node: n(id), state: MemberState::Active }).expect("active");
        }
        state.apply(create("c")).expect("created");
        let with = |definition| MetaCommand::CreateIndex { collection: "c".into(), name: "i".into(), definition };
        state.apply(with(json!({"keys": ["a"], "partitions": 6, "replicas": 1}))).expect("placed");
        let def = &state.indexes["c"]["i"];
        assert_eq!(def.placement.len(), 6, "one entry per index partition");
        for copies in &def.placement {
            let mut nodes = copies.clone();
            nodes.sort();
            assert_eq!(nodes, vec![n(3), n(4)], "two copies, on the index nodes only, on distinct nodes");
        }
        assert_eq!(def.parts_on(n(3)), (0..6).collect::<Vec<u16>>());
        assert!(def.parts_on(n(1)).is_empty());
        // A second index goes where the copies are fewest, one copy each on 2 nodes.
        let second =
            MetaCommand::CreateIndex { collection: "c".into(), name: "j".into(), definition: json!({"keys": ["b"], "partitions": 4}) };
        state.apply(second).expect("placed");
        let j = &state.indexes["c"]["j"];
        assert_eq!((j.parts_on(n(3)).len(), j.parts_on(n(4)).len()), (2, 2), "{:?}", j.placement);
        state.check().expect("invariants hold");
        // Bad counts are refused whole: nothing is stored, no id is taken.
        let next = state.next_index_id;
        for bad in [json!({"partitions": 0}), json!({"partitions": 10_000}), json!({"replicas": 9}), json!({"partitions": "8"})] {
            let cmd = MetaCommand::CreateIndex { collection: "c".into(), name: "k".into(), definition: bad.clone() };
            assert!(matches!(state.apply(cmd), Err(MetaReject::OutOfRange { .. })), "{bad}");
        }
        assert_eq!(state.next_index_id, next);
        assert!(!state.indexes["c"].contains_key("k"));
        // A rebalance's new placement: all or nothing, and only for the index it placed.
        let id = state.indexes["c"]["j"].id;
        let moved = vec![vec![n(4)], vec![n(4)], vec![n(3)], vec![n(3)]];
        let change =
            |placement: Vec<Vec<NodeId>>, id| IndexPlacementChange { collection: "c".into(), name: "j".into(), id, placement, from: None };
        let planned_over = state.indexes["c"]["j"].placement.clone();
        let over = |from: Vec<Vec<NodeId>>| IndexPlacementChange { from: Some(from), ..change(moved.clone(), id) };
        let refused = [
            (over(vec![vec![n(3)], vec![n(3)], vec![n(4)], vec![n(4)]]), "planned over another placement (a failover since)"),
            (change(vec![vec![n(4)]], id), "too few partitions"),
            (change(vec![vec![n(4)], vec![n(4), n(4)], vec![n(3)], vec![n(3)]], id), "two copies on one node"),
            (change(vec![vec![n(4)], vec![], vec![n(3)], vec![n(3)]], id), "a partition without copies"),
            (change(vec![vec![n(4)], vec![n(9)], vec![n(3)], vec![n(3)]], id), "not a member"),
            (change(vec![vec![n(4)], vec![n(1)], vec![n(3)], vec![n(3)]], id), "a node without the index service"),
            (change(moved.clone(), id + 100), "another index of that name"),
        ];
        for (bad, why) in refused {
            let before = state.clone();
            let cmd = MetaCommand::SetIndexPlacements { placements: vec![change(moved.clone(), id), bad] };
            assert!(state.apply(cmd).is_err(), "{why}");
            assert_eq!(state, before, "{why}: nothing changed");
        }
        // A copy on a member that failed over is gone: refused, even over the placement
        // the failover left.
        let mut failed = state.clone();
        failed.apply(MetaCommand::SetMemberState { node: n(4), state: MemberState::Failed }).expect("failed over");
        let repaired = failed.indexes["c"]["j"].placement.clone();
        assert!(!repaired.iter().flatten().any(|c| *c == n(4)), "the failover took node 4's copies out: {repaired:?}");
        let before = failed.clone();
        let named_again = MetaCommand::SetIndexPlacements { placements: vec![over(repaired)] };
        let refused = failed.apply(named_again);
        assert!(matches!(&refused, Err(MetaReject::OutOfRange { why, .. }) if why.contains("failed over")), "{refused:?}");
        assert_eq!(failed, before);
        state.apply(MetaCommand::SetIndexPlacements { placements: vec![over(planned_over)] }).expect("placed");
        assert_eq!(state.indexes["c"]["j"].placement, moved);
        state.apply(MetaCommand::SetIndexPlacements { placements: vec![change(moved.clone(), id)] }).expect("placed, not checked");
        state.check().expect("invariants hold");
        // What an automatic failover looks at: data nodes, and index nodes with copies.
        let mut query_only = state.clone();
        query_only
            .apply(MetaCommand::AddMember {
                node: n(5),
                address: "n5".into(),
                services: Services { data: false, index: false, query: true },
            })
            .expect("added");
        for (node, holds, why) in [
            (1, true, "a data node"),
            (3, true, "data and index"),
            (4, true, "an index node with partitions placed on it"),
            (5, false, "a query node"),
            (9, false, "not a member"),
        ] {
            assert_eq!(query_only.holds_copies(n(node)), holds, "{why}");
        }
        // A failover takes the failed node's copies out: a surviving copy serves alone, a
        // partition left with none goes to the index node left (rebuilt there).
        let mut failed = state.clone();
        failed.apply(MetaCommand::SetMemberState { node: n(4), state: MemberState::Failed }).expect("failed over");
        assert!(failed.indexes["c"]["i"].placement.iter().all(|c| c == &vec![n(3)]), "replicas promoted");
        assert!(failed.indexes["c"]["j"].placement.iter().all(|c| c == &vec![n(3)]), "lost partitions placed again");
        failed.check().expect("invariants hold");
        let mut none_left = failed.clone();
        none_left.apply(MetaCommand::SetMemberState { node: n(3), state: MemberState::Failed }).expect("failed over");
        assert_eq!(none_left.indexes, failed.indexes, "no index node left: the placement waits for one");
        // Without an active node running the index service, indexes are not placed (each
        // data node indexes its own partitions).
        let mut plain = MetaState::default();
        plain.apply(add(1, "a")).expect("added");
        plain.apply(create("c")).expect("created");
        plain.apply(index("c", "i")).expect("created");
        assert!(!plain.indexes["c"]["i"].is_placed());
    }

    #[test]
    fn a_build_marks_the_named_indexes_built_in_the_state() {
        let mut state = MetaState::default();
        for cmd in [create("c"), index("c", "i"), index("c", "j"), index("c", "k"), build("c", &["i", "k"])] {
            state.apply(cmd).unwrap();
        }
        let built: Vec<(&str, bool)> = state.indexes["c"].values().map(|d| (d.name.as_str(), d.built)).collect();
        assert_eq!(built, vec![("i", true), ("j", false), ("k", true)]);
        let json = serde_json::to_string(&state).unwrap();
        assert_eq!(serde_json::from_str::<MetaState>(&json).unwrap(), state, "the flag survives a snapshot");
    }

    #[test]
    fn settings_have_their_defaults_and_patches_apply() {
        let mut state = MetaState::default();
        assert_eq!(state.settings.auto_failover_timeout_s, 5);
        assert_eq!(state.settings.auto_failover_max_count, 1);
        assert_eq!(state.settings.replicas, 1);
        state.apply(settings(SettingsPatch { replicas: Some(2), auto_failover_timeout_s: Some(30), ..Default::default() })).unwrap();
        assert_eq!(state.settings.replicas, 2);
        assert_eq!(state.settings.auto_failover_timeout_s, 30);
        assert_eq!(state.settings.rebalance_mb_per_s, REBALANCE_MB_PER_S_DEFAULT);
    }

    /// Two members applying the same commands agree, and a state survives its JSON form
    /// (the snapshot) unchanged.
    #[test]
    fn apply_is_deterministic_and_round_trips_through_json() {
        let cmds = vec![
            add(7, "h7:1"),
            create("users"),
            create("users"),
            index("users", "by_age"),
            MetaCommand::SetMemberState { node: n(7), state: MemberState::Active },
            MetaCommand::SetMap { map: map(1, &[(7, &[]), (7, &[])]) },
            settings(SettingsPatch { replicas: Some(0), ..Default::default() }),
        ];
        let (mut a, mut b) = (MetaState::default(), MetaState::default());
        for cmd in &cmds {
            assert_eq!(a.apply(cmd.clone()), b.apply(cmd.clone()));
        }
        assert_eq!(a, b);
        let text = serde_json::to_vec(&a).unwrap();
        let back: MetaState = serde_json::from_slice(&text).unwrap();
        assert_eq!(back, a);
        // Commands travel as JSON in the log.
        for cmd in cmds {
            let text = serde_json::to_string(&cmd).unwrap();
            assert_eq!(serde_json::from_str::<MetaCommand>(&text).unwrap(), cmd);
        }
    }
}
