//! The cluster's replicated metadata log: members, collections, index definitions, the
//! partition map and settings, kept by one Raft group (`openraft` 0.9) whose entries are
//! `MetaCommand`s applied by the pure `MetaState::apply`.
//!
//! Never touches the document store (fjall, `shoal-storage`) and never knows HTTP: the log
//! lives in its own files under the directory it is given, and Raft messages leave through
//! the `MetaTransport` trait, which the server carries over its one port.

pub mod state;

pub use state::{
    CollectionDef, CollectionId, IndexDef, IndexId, Member, MemberState, MetaCommand, MetaReject, MetaResponse, MetaState, Settings,
    SettingsPatch,
};
