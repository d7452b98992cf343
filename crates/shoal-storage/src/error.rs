//! One error enum per operation family; the server maps each variant to an API error code.

use thiserror::Error;

/// Opening or closing a store.
#[derive(Debug, Error)]
pub enum OpenError {
    #[error("data path {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("storage engine: {0}")]
    Engine(#[from] fjall::Error),
    #[error("{0}")]
    Config(String),
    #[error("corrupt metadata: {0}")]
    Corrupt(String),
}

/// Creating, listing and dropping collections.
#[derive(Debug, Error)]
pub enum CollectionError {
    #[error("collection {0:?} already exists")]
    Exists(String),
    #[error("collection {0:?} does not exist")]
    NotFound(String),
    #[error("invalid collection name: {0}")]
    InvalidName(String),
    /// A caller-given id that is in use or was used (ids are never reused).
    #[error("collection id {id} is taken: ids from {next} on are free")]
    IdTaken { id: u32, next: u32 },
    /// The store takes no writes now (a full disk, a failed fsync).
    #[error(transparent)]
    Unwritable(#[from] WriteError),
    #[error("storage engine: {0}")]
    Engine(#[from] fjall::Error),
    #[error("corrupt metadata: {0}")]
    Corrupt(String),
}

/// Reading and writing catalog entries: records other crates keep durable in the store's
/// metadata (index definitions, say), opaque to the store.
#[derive(Debug, Error)]
pub enum CatalogError {
    #[error("invalid catalog key: {0}")]
    InvalidKey(&'static str),
    #[error("storage engine: {0}")]
    Engine(#[from] fjall::Error),
    #[error(transparent)]
    Refused(#[from] WriteError),
    #[error("corrupt catalog entry: {0}")]
    Corrupt(String),
}

/// Reading documents.
#[derive(Debug, Error)]
pub enum ReadError {
    #[error("document not found")]
    NotFound,
    #[error("document is locked")]
    Locked,
    #[error("{0}")]
    InvalidKey(&'static str),
    #[error("lock time must be 1 to {max} seconds", max = crate::LOCK_MAX_SECS)]
    InvalidLockTime,
    #[error("no partition {0}: partitions are numbered from 0 below the store's count")]
    NoSuchPartition(crate::PartitionId),
    #[error("collection was dropped")]
    CollectionDropped,
    #[error("the partition is busy: its sequencer was held for longer than the wait limit")]
    Busy,
    #[error(transparent)]
    NotMyPartition(NotMine),
    #[error("storage engine: {0}")]
    Engine(#[from] fjall::Error),
    #[error("corrupt document record")]
    Corrupt,
}

/// A request for a partition this node does not hold in the state the request needs (a
/// write or read to a copy that is not active, a replicated change to one that is):
/// Couchbase's NOT_MY_VBUCKET. The caller refreshes its map if it is older than `map_version`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[error("partition {partition} is {state} on this node, not {wanted} (partition map version {map_version})")]
pub struct NotMine {
    pub partition: crate::PartitionId,
    pub state: crate::PartitionState,
    pub wanted: &'static str,
    pub map_version: u64,
}

/// Partition-level operations: export, ingest, drop, state changes.
#[derive(Debug, Error)]
pub enum PartitionError {
    #[error("no partition {0}")]
    NoSuchPartition(crate::PartitionId),
    #[error(transparent)]
    NotMine(NotMine),
    #[error("partition {0} holds data: a copy is ingested only into an empty partition")]
    NotEmpty(crate::PartitionId),
    #[error("collection id {0} of the copy does not exist on this node")]
    UnknownCollection(u32),
    #[error("the copy is malformed: {0}")]
    Malformed(String),
    #[error("the partition is busy: its sequencer was held for longer than the wait limit")]
    Busy,
    /// A restored change whose seqno another key holds here: it is not of this copy's history.
    #[error("seqno {seqno} belongs to another key here: the change is not of this copy's history")]
    NotInHistory { seqno: crate::SeqNo },
    /// The copy holds changes the history it was to take does not: it must roll back first.
    #[error("the copy's history diverged from the one offered: roll back to seqno {rollback_to} first")]
    Diverged { rollback_to: crate::SeqNo },
    #[error(transparent)]
    Refused(#[from] WriteError),
    #[error("storage engine: {0}")]
    Engine(#[from] fjall::Error),
}

impl From<ReadError> for PartitionError {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::Busy => PartitionError::Busy,
            ReadError::NotMyPartition(n) => PartitionError::NotMine(n),
            ReadError::Engine(e) => PartitionError::Engine(e),
            other => PartitionError::Malformed(other.to_string()),
        }
    }
}

impl ReadError {
    /// Whether the stored data failed a check (a checksum, a header): the data is damaged,
    /// not absent.
    pub fn is_corruption(&self) -> bool {
        match self {
            ReadError::Corrupt => true,
            ReadError::Engine(e) => is_corruption(e),
            _ => false,
        }
    }
}

/// Whether an engine error means stored bytes failed a check.
pub fn is_corruption(e: &fjall::Error) -> bool {
    use fjall::Error as F;
    use fjall::LsmError as L;
    match e {
        F::Decompress(_) | F::InvalidTrailer | F::InvalidTag(_) | F::InvalidVersion(_) | F::Unrecoverable | F::JournalRecovery(_) => true,
        F::Storage(inner) => matches!(
            inner,
            L::ChecksumMismatch { .. }
                | L::Decompress(_)
                | L::InvalidVersion(_)
                | L::Unrecoverable
                | L::InvalidTag(_)
                | L::InvalidTrailer
                | L::InvalidHeader(_)
                | L::Utf8(_)
        ),
        F::Io(io) => io.kind() == std::io::ErrorKind::InvalidData,
        _ => false,
    }
}

/// Mutating documents.
#[derive(Debug, Error)]
pub enum WriteError {
    #[error("document not found")]
    NotFound,
    #[error("document already exists")]
    Exists,
    #[error("CAS mismatch: the document changed since it was read")]
    CasMismatch,
    #[error("document is locked")]
    Locked,
    #[error("document is not locked")]
    NotLocked,
    #[error("{0}")]
    InvalidKey(&'static str),
    #[error("document is larger than {max} bytes", max = crate::DOC_MAX_BYTES)]
    TooLarge,
    #[error("an upsert, insert or replace needs a value")]
    MissingValue,
    #[error("collection was dropped")]
    CollectionDropped,
    #[error("the write was applied but could not be made durable")]
    NotDurable,
    #[error("the disk is full: writes are refused until space is freed")]
    DiskFull,
    #[error("the node is read-only after a storage failure ({0}); restart it once the cause is fixed")]
    ReadOnly(String),
    #[error("the node is restarting to recover from a full disk; try again in a few seconds")]
    Restarting,
    #[error("the partition is busy: its sequencer was held for longer than the wait limit")]
    Busy,
    #[error("the write could not be committed: {0}")]
    CommitFailed(String),
    #[error(transparent)]
    NotMyPartition(NotMine),
    #[error("no partition {0}: partitions are numbered from 0 below the store's count")]
    NoSuchPartition(crate::PartitionId),
    #[error("a replicated change must follow seqno {high}, and has {seqno}")]
    OutOfOrder { seqno: crate::SeqNo, high: crate::SeqNo },
    #[error("storage engine: {0}")]
    Engine(#[from] fjall::Error),
    #[error("corrupt document record")]
    Corrupt,
}

impl WriteError {
    /// The same refusal for another request of a batch (engine errors become their text).
    pub fn duplicate(&self) -> WriteError {
        match self {
            WriteError::DiskFull => WriteError::DiskFull,
            WriteError::ReadOnly(r) => WriteError::ReadOnly(r.clone()),
            WriteError::Busy => WriteError::Busy,
            WriteError::Restarting => WriteError::Restarting,
            WriteError::CollectionDropped => WriteError::CollectionDropped,
            WriteError::NotMyPartition(n) => WriteError::NotMyPartition(*n),
            other => WriteError::CommitFailed(other.to_string()),
        }
    }
}

impl From<ReadError> for WriteError {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::NotFound => WriteError::NotFound,
            ReadError::Locked => WriteError::Locked,
            ReadError::InvalidKey(r) => WriteError::InvalidKey(r),
            ReadError::NoSuchPartition(p) => WriteError::NoSuchPartition(p),
            ReadError::CollectionDropped => WriteError::CollectionDropped,
            ReadError::Busy => WriteError::Busy,
            ReadError::NotMyPartition(n) => WriteError::NotMyPartition(n),
            ReadError::Engine(e) => WriteError::Engine(e),
            ReadError::Corrupt | ReadError::InvalidLockTime => WriteError::Corrupt,
        }
    }
}

/// Reading the change stream.
#[derive(Debug, Error)]
pub enum ChangesError {
    #[error("invalid change stream token: {0}")]
    InvalidToken(&'static str),
    #[error("collection was dropped")]
    CollectionDropped,
    #[error("the partition is busy: its sequencer was held for longer than the wait limit")]
    Busy,
    #[error(transparent)]
    NotMyPartition(NotMine),
    #[error("storage engine: {0}")]
    Engine(#[from] fjall::Error),
    #[error("corrupt change record")]
    Corrupt,
}
