//! One member of a Shoal cluster at run time: the metadata log (`shoal-meta`) applied to
//! this node's engine, replication between copies, majority durability, routing answers,
//! failover and rebalance — the executors of the decisions `shoal-cluster` makes.
//!
//! The node reaches storage only through its [`shoal_engine::Engine`], and other members
//! only through [`Peers`] (the server carries those calls over its one HTTP port with the
//! cluster secret). Decisions stay pure in `shoal-cluster`; this crate is the I/O around them.
//!
//! - [`identity`]: the node's id, its cluster's id and the cluster secret, beside the data.
//! - [`peers`]: the calls between members; [`wire`]: their messages.
//! - [`node`]: [`ClusterNode`] — its parts, life cycle, proposals and DDL, and the dispatch
//!   of member calls.
//! - [`membership`]: founding or joining a cluster, admission, the metadata log's voters.
//! - [`apply`]: the reconcile loop that applies the metadata (collections, indexes, the
//!   partition map as partition states and replication streams) to the engine.
//! - [`routing`]: where a request for a key or partition goes; serving; waits for the map.
//! - [`acks`]: what the active copy knows of its replicas; [`majority`]: majority waits.
//! - [`faults`]: fault injection for tests.
//! - [`replica`]: replicas pulling the active's change stream; the active serving pulls.
//! - [`failover`]: the leader's health checks, leases, fencing and promotion.
//! - [`elastic`]: the copies' budget, cut while requests wait for cores.
//! - [`rebalance`]: bringing nodes in and out by streaming copies, with a hand-over.
//! - [`sql`]: SQL run on one member reading the other members' partitions.

pub mod acks;
pub mod apply;
pub mod copy;
pub mod elastic;
pub mod failover;
pub mod faults;
pub mod feed;
pub mod identity;
pub mod index_moves;
pub mod index_scan;
pub mod majority;
pub mod membership;
pub mod node;
pub mod peers;
pub mod rebalance;
pub mod replica;
pub mod routing;
pub mod shadow_move;
pub mod sql;
pub mod wire;

pub use majority::{Durable, MajorityError};
pub use node::{ClusterConfig, ClusterNode};
pub use peers::{ChunkStream, Op, PeerError, PeerFuture, PeerStreamFuture, Peers};
pub use routing::Route;

use thiserror::Error;

/// Why a cluster operation failed.
#[derive(Debug, Error)]
pub enum ClusterError {
    #[error("cluster identity: {0}")]
    Identity(String),
    #[error("metadata log: {0}")]
    Meta(String),
    /// The metadata log refused the command (every member refuses it the same way).
    #[error(transparent)]
    Rejected(#[from] shoal_meta::MetaReject),
    /// No metadata leader could be reached in time (an election, or too few members up).
    #[error("no metadata leader answered within {0:?}; too few members may be up")]
    NoLeader(std::time::Duration),
    #[error(transparent)]
    Peer(#[from] PeerError),
    #[error(transparent)]
    Engine(#[from] shoal_engine::EngineError),
    #[error(transparent)]
    Index(#[from] shoal_index::IndexError),
    #[error("storage: {0}")]
    Storage(String),
    /// A copy this node no longer holds in the state the request needs (the map moved it).
    #[error(transparent)]
    NotMine(#[from] shoal_storage::NotMine),
    #[error("no member {}", .0 .0)]
    NodeNotFound(shoal_cluster::NodeId),
    /// A request the cluster cannot do in its current state (the reason says why).
    #[error("{0}")]
    Refused(String),
    /// Something this node waits for did not happen in time (the reason says what): try
    /// again, unlike a refusal.
    #[error("{0}")]
    Timeout(String),
    /// A malformed message from another member.
    #[error("bad message: {0}")]
    BadMessage(String),
    #[error("not the metadata leader")]
    NotLeader { address: Option<String> },
    #[error("a rebalance is running")]
    RebalanceRunning,
    /// The node is shutting down.
    #[error("the node is shutting down")]
    ShuttingDown,
}

impl From<shoal_storage::PartitionError> for ClusterError {
    /// A copy the map moved away keeps its type (`NotMine`, an ordinary race of a
    /// rebalance); any other storage failure is told as it is.
    fn from(e: shoal_storage::PartitionError) -> Self {
        match e {
            shoal_storage::PartitionError::NotMine(n) => ClusterError::NotMine(n),
            e => ClusterError::Storage(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ClusterError;
    use shoal_storage::{NotMine, PartitionError, PartitionState};

    #[test]
    fn a_copy_moved_away_keeps_its_type_and_other_storage_failures_are_told() {
        let moved = NotMine { partition: 56, state: PartitionState::Dead, wanted: "replica or pending", map_version: 5 };
        assert!(matches!(ClusterError::from(PartitionError::NotMine(moved)), ClusterError::NotMine(n) if n.partition == 56));
        let other = ClusterError::from(PartitionError::Malformed("a bad record".into()));
        assert!(matches!(&other, ClusterError::Storage(s) if s.contains("a bad record")), "{other}");
    }
}
