//! The messages members send each other (besides Raft's own). Control messages are JSON;
//! replication batches are postcard (documents travel as raw bytes).

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use shoal_cluster::NodeId;
use shoal_meta::{MetaReject, MetaResponse};
use shoal_storage::{Change, FailoverEntry};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct JoinRequest {
    pub node: NodeId,
    pub address: String,
    /// What the joining node runs (`--services`); all of them when a node does not say.
    #[serde(default)]
    pub services: shoal_meta::Services,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct JoinAnswer {
    pub cluster_id: String,
}

/// The leader's answer to a forwarded proposal.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum ProposeAnswer {
    Applied(MetaResponse),
    Rejected(MetaReject),
    NotLeader { address: Option<String> },
    Unavailable(String),
}

/// A replica's pull: it acknowledges what it holds of every part and asks for what follows.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PullRequest {
    /// The pulling replica's node id.
    pub from: NodeId,
    /// The map version the replica pulls under.
    pub map_version: u64,
    /// The confirmation round of the active's last answer, echoed: a pull that echoes round
    /// `r` was sent after the active started round `r` (see `acks`).
    pub round: u64,
    /// How long the active may hold the request when it has nothing to send.
    pub wait_ms: u32,
    pub parts: Vec<PullPart>,
    /// A promotion's catch-up from another fenced replica (`failover::serve_catch_up`): the
    /// node that failed; the answering node serves its replica copies of the partitions
    /// that node was active for, and nothing counts as an acknowledgement.
    pub catch_up_for: Option<NodeId>,
}

/// One collection's copy of one partition, as the replica holds it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PullPart {
    pub collection: u32,
    pub partition: u16,
    /// Everything up to `seqno` on history `uuid` is applied.
    pub seqno: u64,
    pub uuid: u64,
    /// Everything up to this seqno is fsynced.
    pub persisted: u64,
    /// Whether the copy holds a state the partition really had (not the middle of a
    /// backfill): only then does it count towards a majority.
    pub consistent: bool,
    /// Only the part's position and backlog, no changes: an empty copy asks so first, to
    /// choose between a copy by files and the stream before anything is read for it (its
    /// first batch, read and sent at the requests' priority and then dropped for a copy by
    /// files, was most of the foreground's slow requests at a rebalance's start).
    #[serde(default)]
    pub peek: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PullAnswer {
    /// The active's confirmation round now (the replica echoes it in its next pull).
    pub round: u64,
    pub parts: Vec<PartAnswer>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PartAnswer {
    pub collection: u32,
    pub partition: u16,
    pub kind: PartKind,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum PartKind {
    /// Changes after the replica's position. `history` is the active's failover log when the
    /// replica's position is not on its current history (the replica adopts it first).
    /// `high` is the active's high seqno when it read them (how far a backfill has to go).
    Changes { history: Option<Vec<FailoverEntry>>, changes: Vec<WireChange>, snapshot_end: u64, high: u64 },
    /// The replica holds changes the active's history does not: roll back to `to`, adopt
    /// `history`, then pull again.
    Rollback { to: u64, history: Vec<FailoverEntry> },
    /// Not served here: the active does not hold the partition active, or does not see the
    /// replica in its map. The replica waits for the map to settle.
    Refused { why: String },
}

/// A change as it travels between copies.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireChange {
    pub seqno: u64,
    pub key: Bytes,
    pub cas: u64,
    pub deleted: bool,
    pub expiry: u32,
    pub value: Option<Bytes>,
}

impl WireChange {
    pub fn from_change(c: Change) -> WireChange {
        WireChange { seqno: c.seqno, key: c.key, cas: c.cas, deleted: c.deleted, expiry: c.expiry, value: c.value }
    }

    pub fn into_change(self, partition: u16) -> Change {
        Change { partition, seqno: self.seqno, key: self.key, cas: self.cas, deleted: self.deleted, expiry: self.expiry, value: self.value }
    }
}

/// The metadata leader, having committed that `failed` is failed, asks a member how far its
/// copies of the partitions `failed` was active for are.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FenceRequest {
    pub failed: NodeId,
}

/// Where a copy's history ends in one collection: `(collection id, epoch, seqno)`. Copies
/// compare by epoch, then seqno (`shoal_cluster::HistoryEnd`).
pub type CollectionEnd = (u32, u64, u64);

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FenceAnswer {
    /// Per partition this member holds a replica of: where its history ends in each
    /// collection.
    pub partitions: Vec<(u16, Vec<CollectionEnd>)>,
}

/// The metadata leader asks the replica it promotes for `partition` to apply, before it
/// serves, what other fenced replicas hold beyond it (`shoal_cluster::choose_promotion`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CatchUpRequest {
    pub failed: NodeId,
    pub partition: u16,
    /// `(collection, node, address, epoch, seqno)`: where to catch each collection up
    /// from, and where that node reported its history ends (what the copy must reach).
    pub sources: Vec<(u32, NodeId, String, u64, u64)>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PingAnswer {
    pub node: NodeId,
    pub map_version: u64,
    /// The ping came from the leader the member follows and extended its lease.
    #[serde(default)]
    pub leased: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VersionsRequest {
    pub collection: u32,
    pub partition: u16,
    pub keys: Vec<Bytes>,
}

/// The active's current version of each key it has (keys it has no record of are left out).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VersionsAnswer {
    pub changes: Vec<WireChange>,
}

/// SQL on another member asks for documents of the partitions active here: a page of a
/// scan in key order (`keys` empty), or the documents of `keys`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DocsRequest {
    pub collection: String,
    /// The map version the query started under: a member on another refuses (the
    /// partitions may have moved, and rows would be missed or read twice).
    pub map_version: u64,
    pub after: Option<Bytes>,
    pub max: u32,
    pub keys: Vec<Bytes>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DocsAnswer {
    /// Live documents (key, JSON body), in key order for a scan.
    pub docs: Vec<(Bytes, Bytes)>,
    /// How many of the asked `keys` were looked at (an answer stops at its byte budget;
    /// the rest are asked again).
    pub keys_done: u32,
}

pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // These plain structs always encode.
    postcard::to_stdvec(value).unwrap_or_default()
}

pub fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, String> {
    postcard::from_bytes(bytes).map_err(|e| e.to_string())
}
