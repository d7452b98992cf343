//! How a member reaches the others: the `Peers` trait (one call = one request to a member's
//! address and its answer, as bytes), which the server implements over its one HTTP port
//! with the cluster secret. Everything the cluster sends between members goes through it,
//! so a test can cut or slow one link by wrapping it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use shoal_meta::{MetaTransport, RpcKind, TransportError};
use thiserror::Error;

/// What a call asks of the member it reaches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// A Raft message of the metadata log.
    Raft(RpcKind),
    /// A node asks to join (any member forwards it to the metadata leader).
    Join,
    /// A metadata command for the leader to commit.
    Propose,
    /// A replica pulls changes from the active copy and acknowledges what it holds.
    Pull,
    /// The metadata leader asks a member how far its copies are, once it has fenced a node.
    Fence,
    /// The metadata leader checks that a member is up.
    Ping,
    /// The current versions of some keys (a replica repairing after a rollback).
    Versions,
    /// How far this member's copies are (a rebalance waits for new copies to catch up).
    Progress,
    /// An active gives up partitions to new actives (a rebalance's hand-over).
    Handover,
    /// Which cluster a member belongs to (a restarted node checks the one it is told to join).
    Identify,
    /// A replica asks the active for a partition's export (a copy by files; streamed).
    Export,
    /// Documents of the partitions active on a member, for SQL run on another (`sql`).
    Docs,
    CatchUp,
    /// A member asks a lone, empty node to join its cluster (`shoal cluster add`). The one
    /// call a node takes without its own secret: it does not know the cluster's yet.
    Invite,
    /// An index node asks an active what follows its positions (`feed`).
    Feed,
    /// An index node asks a member how far its active partitions are (`feed`).
    Highs,
    /// A node asks a holder of an index partition for its files (`index_moves`; streamed).
    IndexExport,
    /// The metadata leader asks a node to build a copy of an index partition (`index_moves`).
    IndexAdopt,
    /// The metadata leader asks a node to make the keyspaces of the index partitions it is
    /// about to adopt, as one group (`index_moves`).
    IndexPrepare,
    /// A node asks a holder of index partitions for its part of a scan (`index_scan`).
    IndexScan,
    /// A coordinator of an analytics statement asks a member for its shadow's fields (`sql`).
    ShadowFields,
    /// A coordinator of an analytics statement asks a member for its rows of a small table
    /// (`sql`, `shoal_query::gather`).
    ShadowRows,
    /// A replica being built by files asks the active for the partition's analytics rows
    /// (`shadow_move`; streamed).
    ShadowExport,
    /// The author of a DDL change waits until a member's engine is in step with the log up
    /// to an index (`ClusterNode::serve_applied`).
    Applied,
}

impl Op {
    /// Whether the op answers as a stream of chunks (an export), not one body.
    pub fn is_streamed(self) -> bool {
        matches!(self, Op::Export | Op::IndexExport | Op::ShadowExport)
    }

    /// The op's name on the wire (one path segment).
    pub fn name(self) -> &'static str {
        match self {
            Op::Raft(RpcKind::AppendEntries) => "raft-append",
            Op::Raft(RpcKind::Vote) => "raft-vote",
            Op::Raft(RpcKind::InstallSnapshot) => "raft-snapshot",
            Op::Raft(RpcKind::PreVote) => "raft-pre-vote",
            Op::Join => "join",
            Op::Propose => "propose",
            Op::Pull => "pull",
            Op::Fence => "fence",
            Op::Ping => "ping",
            Op::Versions => "versions",
            Op::Progress => "progress",
            Op::Handover => "handover",
            Op::Identify => "identify",
            Op::Export => "export",
            Op::Docs => "docs",
            Op::CatchUp => "catch-up",
            Op::Invite => "invite",
            Op::Feed => "feed",
            Op::Highs => "highs",
            Op::IndexExport => "index-export",
            Op::IndexAdopt => "index-adopt",
            Op::IndexPrepare => "index-prepare",
            Op::IndexScan => "index-scan",
            Op::ShadowFields => "shadow-fields",
            Op::ShadowRows => "shadow-rows",
            Op::ShadowExport => "shadow-export",
            Op::Applied => "applied",
        }
    }

    pub fn from_name(name: &str) -> Option<Op> {
        Some(match name {
            "raft-append" => Op::Raft(RpcKind::AppendEntries),
            "raft-vote" => Op::Raft(RpcKind::Vote),
            "raft-snapshot" => Op::Raft(RpcKind::InstallSnapshot),
            "raft-pre-vote" => Op::Raft(RpcKind::PreVote),
            "join" => Op::Join,
            "propose" => Op::Propose,
            "pull" => Op::Pull,
            "fence" => Op::Fence,
            "ping" => Op::Ping,
            "versions" => Op::Versions,
            "progress" => Op::Progress,
            "handover" => Op::Handover,
            "identify" => Op::Identify,
            "export" => Op::Export,
            "docs" => Op::Docs,
            "feed" => Op::Feed,
            "highs" => Op::Highs,
            "index-export" => Op::IndexExport,
            "index-adopt" => Op::IndexAdopt,
            "index-prepare" => Op::IndexPrepare,
            "index-scan" => Op::IndexScan,
            "shadow-fields" => Op::ShadowFields,
            "shadow-rows" => Op::ShadowRows,
            "shadow-export" => Op::ShadowExport,
            "applied" => Op::Applied,
            "catch-up" => Op::CatchUp,
            "invite" => Op::Invite,
            _ => return None,
        })
    }
}

/// Why a call to another member failed.
#[derive(Clone, Debug, Error)]
pub enum PeerError {
    /// Nothing answered (refused, reset, no route, no answer in time).
    #[error("member at {address} is unreachable: {why}")]
    Unreachable { address: String, why: String },
    /// The member answered with an error (its code and message).
    #[error("member at {address} refused: {code}: {message}")]
    Refused { address: String, code: String, message: String },
}

pub type PeerFuture = Pin<Box<dyn Future<Output = Result<Vec<u8>, PeerError>> + Send>>;
/// An answer read as it arrives (a partition's copy).
pub type ChunkStream = Pin<Box<dyn futures::Stream<Item = Result<bytes::Bytes, PeerError>> + Send>>;
pub type PeerStreamFuture = Pin<Box<dyn Future<Output = Result<ChunkStream, PeerError>> + Send>>;

/// Sends one request to the member at `address` and returns its answer body.
pub trait Peers: Send + Sync + 'static {
    fn call(&self, address: &str, op: Op, body: Vec<u8>, timeout: Duration) -> PeerFuture;

    /// Like `call`, with `secret` in place of this node's own (an invited node checks the
    /// invitation's secret with the cluster before it acts on it).
    fn call_with_secret(&self, secret: &str, address: &str, op: Op, body: Vec<u8>, timeout: Duration) -> PeerFuture;

    /// Like `call`, but the answer comes as a stream of chunks; `timeout` bounds the wait
    /// for the answer to start (the caller bounds the gaps between chunks).
    fn stream(&self, address: &str, op: Op, body: Vec<u8>, timeout: Duration) -> PeerStreamFuture;
}

/// Raft's transport over `Peers`.
pub(crate) struct MetaPeers(pub Arc<dyn Peers>);

/// A Raft message has this long; openraft's own TTLs bound it further.
const RAFT_CALL_TIMEOUT: Duration = Duration::from_secs(10);

impl MetaTransport for MetaPeers {
    async fn send(&self, _target: u64, address: &str, kind: RpcKind, body: Vec<u8>) -> Result<Vec<u8>, TransportError> {
        self.0.call(address, Op::Raft(kind), body, RAFT_CALL_TIMEOUT).await.map_err(|e| match e {
            PeerError::Unreachable { address, why } => TransportError::Unreachable { address, why },
            PeerError::Refused { address, code, message } => TransportError::Failed { address, why: format!("{code}: {message}") },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_names_round_trip() {
        let ops = [
            Op::Raft(RpcKind::AppendEntries),
            Op::Raft(RpcKind::Vote),
            Op::Raft(RpcKind::InstallSnapshot),
            Op::Raft(RpcKind::PreVote),
            Op::Join,
            Op::Propose,
            Op::Pull,
            Op::Fence,
            Op::Ping,
            Op::Versions,
            Op::Progress,
            Op::Handover,
            Op::Identify,
            Op::Export,
            Op::Docs,
            Op::CatchUp,
            Op::Feed,
            Op::Highs,
            Op::IndexExport,
            Op::IndexAdopt,
            Op::IndexPrepare,
            Op::IndexScan,
            Op::ShadowFields,
            Op::ShadowRows,
            Op::ShadowExport,
        ];
        for op in ops {
            assert_eq!(Op::from_name(op.name()), Some(op));
        }
        assert_eq!(Op::from_name("nope"), None);
    }
}
