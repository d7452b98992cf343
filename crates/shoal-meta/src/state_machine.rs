//! The Raft state machine: `MetaState` in memory, made durable by snapshots.
//!
//! Only the snapshot is on disk (`snapshot`, replaced atomically: a record with the snapshot's
//! meta and one with `MetaState` as JSON). After a restart the state is the snapshot's, and
//! Raft re-applies the committed entries after it from the log, which is never purged past
//! the last snapshot. Every applied change is published on a `watch` channel.

use std::fs;
use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{
    AnyError, BasicNode, Entry, EntryPayload, LogId, OptionalSend, RaftSnapshotBuilder, SnapshotMeta, StorageError, StorageIOError,
    StoredMembership,
};
use parking_lot::Mutex;
use tokio::sync::watch;

use crate::files::{io_err, read_file, replace_file, StoreError};
use crate::state::{Applied, MetaResponse, MetaState};
use crate::{MetaOutcome, TypeConfig};

type NodeId = u64;

const SNAPSHOT_FILE: &str = "snapshot";

struct SmData {
    last_applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, BasicNode>,
    state: MetaState,
}

/// The leaders of the last two terms that committed an entry this member has applied, as
/// `(term, node)`: a leader whose term has an applied entry is the last one that could
/// have acted as leader (granted leases) before the current one. `previous` is unknown
/// (`None`) after a snapshot, which carries only its last entry's leader.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TermLeaders {
    pub last: Option<(u64, u64)>,
    pub previous: Option<(u64, u64)>,
}

impl TermLeaders {
    fn from_last(log_id: Option<LogId<NodeId>>) -> TermLeaders {
        TermLeaders { last: log_id.and_then(Self::leader), previous: None }
    }

    /// The leader that wrote `log_id`; none for the log's initial entry (term 0, written by
    /// `initialize`, not by a leader).
    fn leader(log_id: LogId<NodeId>) -> Option<(u64, u64)> {
        (log_id.leader_id.term > 0).then_some((log_id.leader_id.term, log_id.leader_id.node_id))
    }

    fn applied(&mut self, log_id: LogId<NodeId>) {
        let Some(leader) = Self::leader(log_id) else { return };
        if self.last != Some(leader) {
            debug_assert!(self.last.is_none_or(|(term, _)| term < leader.0), "terms rise along the log");
            self.previous = self.last;
            self.last = Some(leader);
        }
    }
}

struct StoredSnapshot {
    meta: SnapshotMeta<NodeId, BasicNode>,
    /// `MetaState` as JSON, exactly the bytes a follower receives.
    data: Vec<u8>,
}

struct SmShared {
    dir: PathBuf,
    data: Mutex<SmData>,
    /// The latest snapshot, built here or installed from the leader.
    snapshot: Mutex<Option<Arc<StoredSnapshot>>>,
    /// Serialises snapshot file writes (a build runs beside `apply` and `install_snapshot`).
    snapshot_io: Mutex<()>,
    /// Makes snapshot ids unique within this process; the log id makes them unique across.
    snapshot_seq: AtomicU64,
    published: watch::Sender<Arc<MetaState>>,
    leaders: watch::Sender<TermLeaders>,
}

/// The state machine. Cheap to clone: clones share the state (a clone is the snapshot builder).
#[derive(Clone)]
pub struct MetaStateMachine {
    shared: Arc<SmShared>,
}

fn read_snapshot_file(path: &Path) -> Result<Option<StoredSnapshot>, StoreError> {
    let Some(records) = read_file(path)? else { return Ok(None) };
    let corrupt = |why: String| StoreError::Corrupt { path: path.to_path_buf(), why };
    let [meta, data] = records.as_slice() else { return Err(corrupt(format!("{} records, expected 2", records.len()))) };
    let meta = serde_json::from_slice(meta).map_err(|e| corrupt(format!("snapshot meta: {e}")))?;
    Ok(Some(StoredSnapshot { meta, data: data.clone() }))
}

fn write_snapshot_file(path: &Path, snapshot: &StoredSnapshot) -> Result<(), StoreError> {
    let meta = serde_json::to_vec(&snapshot.meta)
        .map_err(|e| StoreError::Corrupt { path: path.to_path_buf(), why: format!("cannot encode: {e}") })?;
    replace_file(path, &[&meta, &snapshot.data])
}

/// `MetaState` from a snapshot's bytes, checked before it replaces anything.
fn decode_state(data: &[u8]) -> Result<MetaState, String> {
    let state: MetaState = serde_json::from_slice(data).map_err(|e| format!("snapshot data: {e}"))?;
    state.check()?;
    Ok(state)
}

impl MetaStateMachine {
    /// Opens the state machine in `dir`, from its snapshot if there is one.
    pub fn open(dir: &Path) -> Result<MetaStateMachine, StoreError> {
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let path = dir.join(SNAPSHOT_FILE);
        let stored = read_snapshot_file(&path)?;
        let data = match &stored {
            None => SmData { last_applied: None, membership: StoredMembership::default(), state: MetaState::default() },
            Some(s) => SmData {
                last_applied: s.meta.last_log_id,
                membership: s.meta.last_membership.clone(),
                state: decode_state(&s.data).map_err(|why| StoreError::Corrupt { path: path.clone(), why })?,
            },
        };
        let (published, _) = watch::channel(Arc::new(data.state.clone()));
        let (leaders, _) = watch::channel(TermLeaders::from_last(data.last_applied));
        Ok(MetaStateMachine {
            shared: Arc::new(SmShared {
                dir: dir.to_path_buf(),
                data: Mutex::new(data),
                snapshot: Mutex::new(stored.map(Arc::new)),
                snapshot_io: Mutex::new(()),
                snapshot_seq: AtomicU64::new(0),
                published,
                leaders,
            }),
        })
    }

    /// The applied state as of now, and every later change.
    pub fn subscribe(&self) -> watch::Receiver<Arc<MetaState>> {
        self.shared.published.subscribe()
    }

    /// The leaders of the last terms applied here, now and after every change.
    pub fn leaders(&self) -> watch::Receiver<TermLeaders> {
        self.shared.leaders.subscribe()
    }

    /// Writes `snapshot` to disk and makes it current, unless a newer one already is.
    async fn keep_snapshot(&self, snapshot: Arc<StoredSnapshot>) -> Result<(), StorageError<NodeId>> {
        let shared = Arc::clone(&self.shared);
        let signature = snapshot.meta.signature();
        tokio::task::spawn_blocking(move || {
            let _io = shared.snapshot_io.lock();
            let newer_kept = shared.snapshot.lock().as_ref().is_some_and(|cur| cur.meta.last_log_id > snapshot.meta.last_log_id);
            if newer_kept {
                return Ok(());
            }
            write_snapshot_file(&shared.dir.join(SNAPSHOT_FILE), &snapshot)?;
            *shared.snapshot.lock() = Some(snapshot);
            Ok(())
        })
        .await
        .map_err(|e| StoreError::Task(e.to_string()))
        .and_then(|r| r)
        .map_err(|e: StoreError| StorageIOError::write_snapshot(Some(signature), AnyError::new(&e)).into())
    }
}

impl RaftSnapshotBuilder<TypeConfig> for MetaStateMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError<NodeId>> {
        // One consistent cut of state, applied id and membership.
        let (state, last_applied, membership) = {
            let data = self.shared.data.lock();
            (data.state.clone(), data.last_applied, data.membership.clone())
        };
        let bytes = serde_json::to_vec(&state).map_err(|e| StorageIOError::read_state_machine(AnyError::new(&e)))?;
        let seq = self.shared.snapshot_seq.fetch_add(1, Ordering::Relaxed);
        let snapshot_id = match last_applied {
            Some(id) => format!("{}-{}-{seq}", id.leader_id, id.index),
            None => format!("--{seq}"),
        };
        let meta = SnapshotMeta { last_log_id: last_applied, last_membership: membership, snapshot_id };
        let stored = Arc::new(StoredSnapshot { meta: meta.clone(), data: bytes.clone() });
        self.keep_snapshot(stored).await?;
        Ok(Snapshot { meta, snapshot: Box::new(Cursor::new(bytes)) })
    }
}

impl RaftStateMachine<TypeConfig> for MetaStateMachine {
    type SnapshotBuilder = Self;

    async fn applied_state(&mut self) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, BasicNode>), StorageError<NodeId>> {
        let data = self.shared.data.lock();
        Ok((data.last_applied, data.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<MetaOutcome>, StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut data = self.shared.data.lock();
        let mut answers = Vec::new();
        let mut changed = false;
        for entry in entries {
            debug_assert!(data.last_applied < Some(entry.log_id), "entries are applied once, in order");
            data.last_applied = Some(entry.log_id);
            self.shared.leaders.send_if_modified(|l| {
                let before = *l;
                l.applied(entry.log_id);
                *l != before
            });
            match entry.payload {
                EntryPayload::Blank => answers.push(Ok(MetaResponse::Done)),
                EntryPayload::Normal(cmd) => {
                    let answer = data.state.apply(cmd);
                    changed |= answer.is_ok();
                    answers.push(answer);
                }
                EntryPayload::Membership(membership) => {
                    data.membership = StoredMembership::new(Some(entry.log_id), membership);
                    answers.push(Ok(MetaResponse::Done));
                }
            }
        }
        if changed {
            let mut published = data.state.clone();
            published.applied = Applied(data.last_applied.map_or(0, |l| l.index));
            self.shared.published.send_replace(Arc::new(published));
        }
        Ok(answers)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError<NodeId>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<NodeId>> {
        let bytes = snapshot.into_inner();
        let state = decode_state(&bytes).map_err(|why| StorageIOError::read_snapshot(Some(meta.signature()), AnyError::error(why)))?;
        // On disk first: once the state machine says it holds this snapshot, a restart must too.
        self.keep_snapshot(Arc::new(StoredSnapshot { meta: meta.clone(), data: bytes })).await?;
        let mut data = self.shared.data.lock();
        data.last_applied = meta.last_log_id;
        data.membership = meta.last_membership.clone();
        data.state = state;
        let mut published = data.state.clone();
        published.applied = Applied(meta.last_log_id.map_or(0, |l| l.index));
        self.shared.published.send_replace(Arc::new(published));
        self.shared.leaders.send_replace(TermLeaders::from_last(meta.last_log_id));
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError<NodeId>> {
        let current = self.shared.snapshot.lock().clone();
        Ok(current.map(|s| Snapshot { meta: s.meta.clone(), snapshot: Box::new(Cursor::new(s.data.clone())) }))
    }
}
