//! The cluster's replicated metadata log: members, collections, index definitions, the
//! partition map and settings, kept by one Raft group (`openraft` 0.9) whose entries are
//! `MetaCommand`s applied by the pure `MetaState::apply`.
//!
//! Never touches the document store (fjall, `shoal-storage`) and never knows HTTP: the log
//! lives in its own files under the directory it is given, and Raft messages leave through
//! the `MetaTransport` trait, which the server carries over its one port.

pub mod files;
pub mod log_store;
pub mod network;
pub mod node;
pub mod pre_vote;
pub mod state;
pub mod state_machine;
pub mod users;
pub mod vote_gate;

pub use files::StoreError;
pub use log_store::MetaLogStore;
pub use network::{InProcessRouter, MetaNetwork, MetaTransport, RpcHandleError, RpcKind, TransportError};
pub use node::{InitializeError, MembershipError, MetaNode, OpenError, ProposeError};
pub use state::{
    Applied, CollectionDef, CollectionId, IndexDef, IndexId, IndexPlacementChange, Member, MemberState, MetaCommand, MetaReject,
    MetaResponse, MetaState, RebalancePlan, Services, ServicesError, Settings, SettingsPatch,
};
pub use state_machine::{MetaStateMachine, TermLeaders};
pub use users::{allows, Needs, Role, Scope, User};
pub use vote_gate::VoteGate;

/// What applying one log entry answers: the command's response, or why every member
/// refused it.
pub type MetaOutcome = Result<MetaResponse, MetaReject>;

use std::io::Cursor;

openraft::declare_raft_types!(
    /// The metadata log's types: commands in, outcomes out, members addressed by `BasicNode`
    /// (`host:port`) under their `u64` ids (`shoal_cluster::NodeId`'s number).
    pub TypeConfig:
        D = MetaCommand,
        R = MetaOutcome,
        NodeId = u64,
        Node = openraft::BasicNode,
);

/// Opens a member's log store and state machine in `dir` (the metadata directory, which
/// holds nothing else).
pub fn open_storage(dir: &std::path::Path) -> Result<(MetaLogStore, MetaStateMachine), StoreError> {
    Ok((MetaLogStore::open(dir)?, MetaStateMachine::open(dir)?))
}
