//! Secondary indexes for Shoal, maintained from the collections' change streams.
//!
//! An index is split into a fixed number of partitions by a hash of its leading key's value
//! ([`partition`]), whatever the data partition count: an `eq` on the leading key is one
//! range read of one part, and any other scan merges one ordered read of each part. Each
//! part is one fjall keyspace holding its entries, `composite key ++ document key` (see
//! [`keycode`]); its back entries, mapping each document key to the composite keys it
//! contributed to the part, so that an update or a delete removes exactly the old entries;
//! and how far it has applied each data partition's change stream — a unit that can be
//! copied as files and dropped whole. Building and maintenance run on one
//! worker pool sized to the cores; each round hands every partition with news to the pool,
//! and all indexes of a collection are fed from one read of each change.
//!
//! This crate knows nothing of HTTP.

pub mod def;
pub mod filter;
pub mod keycode;
mod manager;
pub mod partition;

pub use def::IndexDef;
pub use filter::FilterError;
pub use manager::{
    ChangeFetcher, Consistency, FetchFuture, IndexCursor, IndexManager, IndexState, IndexStatus, KeepRow, PartImports, ScanBounds,
    ScanRequest, ScanRow, INDEX_MEMTABLES_MAX_BYTES,
};

/// Most rows one scan returns.
pub const SCAN_ROWS_MAX: usize = 100_000;
/// Longest a `request_plus` scan may wait for an index to catch up.
pub const SCAN_TIMEOUT_MAX: std::time::Duration = std::time::Duration::from_secs(300);
/// How much lower than the request threads the index workers run (Linux `nice` units, as
/// the server's CPU pool): when writes and index maintenance both want the cores, the
/// kernel runs the writes first and the indexes catch up in the gaps — a nice-10 thread
/// still gets about a tenth of a contended core, so an index under a write load that keeps
/// every core busy trails but never stops. On a default 3-node cluster sharing 2 cores,
/// writes with 5 indexes went from 0.58–0.69× of none at nice 0 to 0.84–0.92×, every index
/// caught up as early (`bench/results/2026-12-05-issue41-index-workers-below-writes.md`).
pub const INDEX_WORKER_NICE: i32 = 10;
/// Most changes read from one partition per batch.
pub const BATCH_CHANGES: usize = 1024;
/// How far (in seqnos of one data partition) a part's stored cursor may lag its applied
/// position while the part's entries do not change: a part that gains no entry from a
/// batch stores its cursor only every this many changes, so a round of a few changes does
/// not rewrite every part's cursors (a restart or an adopted copy re-applies at most this
/// many changes per partition, each a no-op for the part).
pub const CURSOR_STORE_LAG: u64 = 4096;
/// Documents a build reads per write batch when it scans a collection in key order.
pub const SCAN_BATCH_DOCS: usize = 8 * 1024;
/// Documents a build scans per maintainer round before other work gets a turn.
pub const SCAN_ROUND_DOCS: usize = 64 * 1024;
/// Changes aimed for in one write batch of a group of partitions.
pub const GROUP_CHANGES: usize = 8 * 1024;
/// Fewest changes read from one partition per batch.
pub const PART_BATCH_MIN: usize = 16;
/// Changes one partition may apply per round before the others get a turn.
pub const ROUND_CHANGES_MAX: usize = 32 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error("no index {0}")]
    NotFound(String),
    #[error("index {0} exists")]
    Exists(String),
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Filter(#[from] FilterError),
    #[error("index {name} is {state} ({progress:.0}% built)", progress = progress * 100.0)]
    NotReady { name: String, state: &'static str, progress: f64 },
    #[error("the index did not catch up within the timeout")]
    Timeout,
    /// What an index fed from other nodes needs from them is out of reach now (a partition's
    /// active did not answer): try again.
    #[error("{0}")]
    Unavailable(String),
    /// A partition that came to serve here (moved in, promoted, rolled back) is not yet
    /// whole in the index: reading it would miss rows.
    #[error("index {name} is still catching up on partition {partition}, which came to this node lately; try again")]
    CatchingUp { name: String, partition: shoal_storage::PartitionId },
    #[error("index storage: {0}")]
    Engine(#[from] fjall::Error),
    #[error("index storage is corrupt: {0}")]
    Corrupt(String),
    /// The index's storage failed a check (a checksum, an undecodable entry): it is being
    /// rebuilt from the documents, and answers again once built.
    #[error("index {name} is being rebuilt: its storage was found damaged")]
    Rebuilding { name: String },
    #[error("index definitions: {0}")]
    Catalog(#[from] shoal_storage::CatalogError),
    #[error("index database at {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("change stream: {0}")]
    Changes(#[from] shoal_storage::ChangesError),
    #[error("reading documents: {0}")]
    Read(#[from] shoal_storage::ReadError),
    /// A copy of an index partition as files failed (malformed, short, a checksum).
    #[error("index partition copy: {0}")]
    Copy(#[from] shoal_storage::PartitionError),
}

impl From<keycode::CorruptKey> for IndexError {
    fn from(_: keycode::CorruptKey) -> Self {
        IndexError::Corrupt("undecodable entry".into())
    }
}
