//! Shoal's cluster decisions as pure functions: where partitions live, which copies a
//! rebalance builds and drops, and whom a failover promotes.
//!
//! Nothing here does I/O: no network, no disk, no clock, no async runtime, no storage. The
//! metadata leader calls these functions, stores their answers in the metadata log, and
//! the executors (replication, moves) act on them. Being deterministic, every decision can
//! be replayed from its inputs and tested by tables and property tests without sockets or
//! sleeps (STYLE.md, "etcd raft").
//!
//! - [`map`]: the partition map ([`PartitionMap`], [`Copies`], [`NodeId`]) and its checks.
//! - [`placement`]: [`place`], weighted rendezvous order plus balancing, stable against a
//!   previous map.
//! - [`index_placement`]: [`index_placement::place_indexes`], the index service's units
//!   (index partitions and their replicas) on the index nodes, balanced across all indexes
//!   and stable against the previous placement; [`index_placement::index_moves`].
//! - [`plan`]: [`plan_moves`], the minimal copies to build and drop between two maps, and
//!   the promotions that need no data.
//! - [`failover`]: whom a failover promotes — [`failover::choose_promotion`] (the fenced
//!   replica whose history ends furthest, by [`HistoryEnd`]: epoch, then seqno) and
//!   [`failover_fenced`] (the map after it) — once [`Quorum::fenced`] holds
//!   ([`fence_quorum`]); and [`auto_failover_allowed`], the monitor's rule.
//! - [`rebalance`]: the rebalance as a stage machine: [`rebalance::next_step`] decides, from
//!   one look at the copies' progress, whether to wait, hand a wave of partitions over,
//!   finish, revert or give up; the node carries the steps out.
//! - [`sim`]: a seeded, deterministic simulation of one partition's replication, failover
//!   and rebalance protocol — rebalances run through [`rebalance::next_step`] on what the
//!   leader learns over a lossy network, with crashes, false suspicions and leader changes
//!   — with a checker for lost acknowledged writes, linearizability (majority and
//!   `request_plus` derived reads) and derived reads short of their serve floor;
//!   `tests/failover_sim.rs` and `tests/rebalance_sim.rs` drive it.

pub mod failover;
pub mod index_placement;
pub mod index_sim;
pub mod map;
pub mod placement;
pub mod plan;
pub mod rebalance;
pub mod sim;

pub use failover::{
    auto_failover_allowed, configured_copies, copies_counted, failover_fenced, fence_quorum, majority, AutoFailoverRefused, FailoverPlan,
    HistoryEnd, Promoted, Quorum,
};
pub use map::{Copies, MapError, NodeId, PartitionId, PartitionMap, SeqNo};
pub use placement::{place, Node, PlaceError};
pub use plan::{plan_moves, DropCopy, Move, PlanError, Promotion, RebalancePlan, Role};

/// Most virtual partitions a map may have (the storage layer's `PARTITIONS_MAX`, Couchbase's
/// vBucket count).
pub const PARTITIONS_MAX: u16 = 1024;

/// Most replica copies per partition (API.md: `replicas` is 0..3).
pub const REPLICAS_MAX: u8 = 3;

/// Most replicas a partition has in a map: a rebalance's build map holds the copies it
/// starts from and every new one besides, up to twice `REPLICAS_MAX + 1` copies (with
/// `replicas: 3`, a swap's build map held five copies and was refused as a map).
pub const MAP_REPLICAS_MAX: usize = 2 * (REPLICAS_MAX as usize + 1) - 1;

/// Most nodes a placement considers. Balancing runs shortest-path searches over the nodes,
/// quadratic in their number; Shoal targets clusters of tens of nodes.
pub const NODES_MAX: usize = 256;

/// Largest node weight. Weights are relative (a node of weight 2 holds twice the partitions
/// of a node of weight 1); the bound keeps the share arithmetic exact in `f64`.
pub const NODE_WEIGHT_MAX: u32 = 1_000;
