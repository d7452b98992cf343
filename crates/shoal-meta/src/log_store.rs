//! The Raft log and vote on disk, in the metadata directory only (never the document
//! store's fjall files).
//!
//! Written by hand, small on purpose. The maintained choices did not fit: openraft's own
//! rocksdb store needs a C++ build (clang), the sled store rides on sled 0.34 (a beta no
//! longer developed) and openraft's deprecated combined storage API, and `raft-log` changes
//! its API with every minor release and brings its own flush thread and chunk format — all
//! for a log that holds a few hundred small entries between snapshots.
//!
//! Layout: `log` is an append-only file of framed records (`files.rs`), one per `append` call,
//! each a JSON array of entries, fsynced before the append is acknowledged; `vote`,
//! `committed` and `purged` are single-record files replaced atomically. Truncation and
//! purging rewrite `log` (it is short: the state machine snapshots every
//! `SNAPSHOT_LOGS_SINCE_LAST` entries and the log is purged behind the snapshot). All entries
//! are also held in memory, which bounds the reads Raft makes to a copy.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::ops::{Bound, RangeBounds};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{AnyError, Entry, LogId, OptionalSend, RaftLogReader, StorageError, StorageIOError, Vote};
use parking_lot::{Mutex, RwLock};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::files::{frame, io_err, read_file, replace_file, scan_records, sync_dir, StoreError, RECORD_MAX_BYTES};
use crate::TypeConfig;

type NodeId = u64;
type MetaEntry = Entry<TypeConfig>;

const LOG_FILE: &str = "log";
const VOTE_FILE: &str = "vote";
const COMMITTED_FILE: &str = "committed";
const PURGED_FILE: &str = "purged";

/// What readers see: the entries and the small state beside them.
#[derive(Default)]
struct LogMem {
    entries: BTreeMap<u64, MetaEntry>,
    vote: Option<Vote<NodeId>>,
    committed: Option<LogId<NodeId>>,
    purged: Option<LogId<NodeId>>,
}

/// The writer's side: the open log file. Held across an fsync; readers never wait on it.
struct LogFiles {
    dir: PathBuf,
    log: File,
    /// Set when a write failed: the file may end in a partial record, and after a failed
    /// fsync the kernel may have dropped pages without saying so again, so nothing more is
    /// written until the store is reopened (and the torn tail cut off).
    poisoned: bool,
}

/// The Raft log store. Cheap to clone: clones share the files and the entries.
#[derive(Clone)]
pub struct MetaLogStore {
    mem: Arc<RwLock<LogMem>>,
    files: Arc<Mutex<LogFiles>>,
}

fn to_json<T: Serialize>(value: &T, path: &Path) -> Result<Vec<u8>, StoreError> {
    let bytes =
        serde_json::to_vec(value).map_err(|e| StoreError::Corrupt { path: path.to_path_buf(), why: format!("cannot encode: {e}") })?;
    if bytes.len() > RECORD_MAX_BYTES {
        return Err(StoreError::Corrupt { path: path.to_path_buf(), why: format!("a record of {} bytes is over the limit", bytes.len()) });
    }
    Ok(bytes)
}

fn from_json<T: DeserializeOwned>(bytes: &[u8], path: &Path) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt { path: path.to_path_buf(), why: format!("cannot decode: {e}") })
}

/// Reads a single-record file written by `write_small`.
fn read_small<T: DeserializeOwned>(path: &Path) -> Result<Option<T>, StoreError> {
    match read_file(path)? {
        None => Ok(None),
        Some(records) => match records.as_slice() {
            [one] => Ok(Some(from_json(one, path)?)),
            _ => Err(StoreError::Corrupt { path: path.to_path_buf(), why: format!("{} records, expected 1", records.len()) }),
        },
    }
}

fn write_small<T: Serialize>(path: &Path, value: &T) -> Result<(), StoreError> {
    let bytes = to_json(value, path)?;
    replace_file(path, &[&bytes])
}

fn open_append(path: &Path) -> Result<File, StoreError> {
    OpenOptions::new().create(true).append(true).open(path).map_err(io_err(path))
}

impl MetaLogStore {
    /// Opens (or creates) the log in `dir`. A torn last record — an append that never
    /// finished, so was never acknowledged — is cut off; damage before a valid record is
    /// refused as `Corrupt`.
    pub fn open(dir: &Path) -> Result<MetaLogStore, StoreError> {
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let mut mem = LogMem {
            vote: read_small(&dir.join(VOTE_FILE))?,
            committed: read_small(&dir.join(COMMITTED_FILE))?,
            purged: read_small(&dir.join(PURGED_FILE))?,
            ..LogMem::default()
        };
        let log_path = dir.join(LOG_FILE);
        let bytes = match fs::read(&log_path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(StoreError::Io { path: log_path, source: e }),
        };
        let scanned = scan_records(&bytes, &log_path)?;
        for record in &scanned.records {
            let batch: Vec<MetaEntry> = from_json(record, &log_path)?;
            for entry in batch {
                mem.entries.insert(entry.log_id.index, entry);
            }
        }
        if scanned.valid_end < bytes.len() {
            tracing::warn!(path = %log_path.display(), torn_bytes = bytes.len() - scanned.valid_end, "metadata log: cutting off a torn last record");
            let file = OpenOptions::new().write(true).open(&log_path).map_err(io_err(&log_path))?;
            file.set_len(scanned.valid_end as u64).map_err(io_err(&log_path))?;
            file.sync_all().map_err(io_err(&log_path))?;
        }
        // A purge writes `purged` before it rewrites the log; a crash between the two leaves
        // entries the purge meant to drop.
        if let Some(purged) = mem.purged {
            mem.entries = mem.entries.split_off(&(purged.index + 1));
        }
        check_consecutive(&mem, &log_path)?;
        let log = open_append(&log_path)?;
        sync_dir(dir)?;
        Ok(MetaLogStore {
            mem: Arc::new(RwLock::new(mem)),
            files: Arc::new(Mutex::new(LogFiles { dir: dir.to_path_buf(), log, poisoned: false })),
        })
    }

    /// Runs file I/O on the blocking pool, so an fsync never holds up the runtime's threads.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut LogFiles, &RwLock<LogMem>) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (files, mem) = (Arc::clone(&self.files), Arc::clone(&self.mem));
        tokio::task::spawn_blocking(move || {
            let mut files = files.lock();
            if files.poisoned {
                return Err(StoreError::Poisoned);
            }
            let result = f(&mut files, &mem);
            if result.is_err() {
                files.poisoned = true;
            }
            result
        })
        .await
        .map_err(|e| StoreError::Task(e.to_string()))?
    }
}

/// Entries are consecutive and follow the purged id: Raft's logs never have holes.
fn check_consecutive(mem: &LogMem, path: &Path) -> Result<(), StoreError> {
    let mut expected = mem.purged.map(|p| p.index + 1);
    for (&index, entry) in &mem.entries {
        if entry.log_id.index != index || expected.is_some_and(|e| e != index) {
            return Err(StoreError::Corrupt { path: path.to_path_buf(), why: format!("log entry {index} does not follow {expected:?}") });
        }
        expected = Some(index + 1);
    }
    Ok(())
}

/// Rewrites the log file with `entries`, atomically, and reopens it for appends.
fn rewrite_log(files: &mut LogFiles, entries: &BTreeMap<u64, MetaEntry>) -> Result<(), StoreError> {
    let path = files.dir.join(LOG_FILE);
    let batch: Vec<&MetaEntry> = entries.values().collect();
    let records: Vec<Vec<u8>> = if batch.is_empty() { Vec::new() } else { vec![to_json(&batch, &path)?] };
    let refs: Vec<&[u8]> = records.iter().map(Vec::as_slice).collect();
    replace_file(&path, &refs)?;
    files.log = open_append(&path)?;
    Ok(())
}

fn log_err(e: StoreError) -> StorageError<NodeId> {
    StorageIOError::write_logs(AnyError::new(&e)).into()
}

fn vote_err(e: StoreError) -> StorageError<NodeId> {
    StorageIOError::write_vote(AnyError::new(&e)).into()
}

impl RaftLogReader<TypeConfig> for MetaLogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<MetaEntry>, StorageError<NodeId>> {
        let (start, end) = (range.start_bound().cloned(), range.end_bound().cloned());
        // An empty or inverted range would make `BTreeMap::range` panic.
        let empty = match (start, end) {
            (Bound::Included(s), Bound::Excluded(e)) => s >= e,
            (Bound::Included(s), Bound::Included(e)) => s > e,
            (Bound::Excluded(s), Bound::Excluded(e)) => s >= e || s + 1 >= e,
            (Bound::Excluded(s), Bound::Included(e)) => s >= e,
            _ => false,
        };
        if empty {
            return Ok(Vec::new());
        }
        Ok(self.mem.read().entries.range((start, end)).map(|(_, e)| e.clone()).collect())
    }
}

impl RaftLogStorage<TypeConfig> for MetaLogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError<NodeId>> {
        let mem = self.mem.read();
        let last = mem.entries.values().next_back().map(|e| e.log_id).or(mem.purged);
        Ok(LogState { last_purged_log_id: mem.purged, last_log_id: last })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError<NodeId>> {
        let vote = *vote;
        self.blocking(move |files, mem| {
            write_small(&files.dir.join(VOTE_FILE), &vote)?;
            mem.write().vote = Some(vote);
            Ok(())
        })
        .await
        .map_err(vote_err)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError<NodeId>> {
        Ok(self.mem.read().vote)
    }

    async fn save_committed(&mut self, committed: Option<LogId<NodeId>>) -> Result<(), StorageError<NodeId>> {
        self.blocking(move |files, mem| {
            write_small(&files.dir.join(COMMITTED_FILE), &committed)?;
            mem.write().committed = committed;
            Ok(())
        })
        .await
        .map_err(log_err)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, StorageError<NodeId>> {
        Ok(self.mem.read().committed)
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<(), StorageError<NodeId>>
    where
        I: IntoIterator<Item = MetaEntry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let batch: Vec<MetaEntry> = entries.into_iter().collect();
        if batch.is_empty() {
            callback.log_io_completed(Ok(()));
            return Ok(());
        }
        let result = self
            .blocking(move |files, mem| {
                let path = files.dir.join(LOG_FILE);
                let record = frame(&to_json(&batch, &path)?);
                files.log.write_all(&record).map_err(io_err(&path))?;
                files.log.sync_data().map_err(io_err(&path))?;
                let mut mem = mem.write();
                for entry in batch {
                    debug_assert!(
                        mem.entries.keys().next_back().is_none_or(|&last| last + 1 == entry.log_id.index),
                        "appended entries must follow the last one"
                    );
                    mem.entries.insert(entry.log_id.index, entry);
                }
                Ok(())
            })
            .await;
        match result {
            Ok(()) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                callback.log_io_completed(Err(std::io::Error::other(e.to_string())));
                Err(log_err(e))
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        self.blocking(move |files, mem| {
            let mut kept = mem.read().entries.clone();
            kept.split_off(&log_id.index);
            rewrite_log(files, &kept)?;
            mem.write().entries = kept;
            Ok(())
        })
        .await
        .map_err(log_err)
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        self.blocking(move |files, mem| {
            debug_assert!(mem.read().purged.is_none_or(|p| p <= log_id), "purge never goes back");
            // `purged` first: a crash before the rewrite leaves entries that open drops.
            write_small(&files.dir.join(PURGED_FILE), &log_id)?;
            mem.write().purged = Some(log_id);
            let kept = mem.read().entries.clone().split_off(&(log_id.index + 1));
            rewrite_log(files, &kept)?;
            mem.write().entries = kept;
            Ok(())
        })
        .await
        .map_err(log_err)
    }
}
