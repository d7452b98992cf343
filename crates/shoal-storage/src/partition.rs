//! One virtual partition of one collection: its sequencer, reads, writes and the in-memory
//! tail of its change stream.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::watch;

use crate::changes::Change;
use crate::clock::CasClock;
use crate::codec::{self, DocMeta};
use crate::error::{NotMine, PartitionError, ReadError, WriteError};
use crate::health::StorageHealth;
use crate::syncer::{PersistedSeqno, Syncer};
use crate::unit::{Ownership, PartitionState};
use crate::{Cas, PartitionId, SeqNo};
use crate::{DOC_MAX_BYTES, KEY_MAX_BYTES, LOCK_MAX_SECS, SEQUENCER_WAIT_MAX};

/// CAS reported for a document locked by someone else (Couchbase reports all ones too).
pub const LOCKED_CAS: Cas = u64::MAX;

/// A stored document as a reader sees it.
#[derive(Clone, Debug)]
pub struct Document {
    pub cas: Cas,
    pub seqno: SeqNo,
    /// Absolute Unix seconds; 0 = never.
    pub expiry: u32,
    pub value: Bytes,
}

/// What a write does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteOp {
    Upsert,
    Insert,
    Replace,
    Remove,
    /// Change the expiry only.
    Touch,
}

/// One mutation of one document.
#[derive(Clone, Debug)]
pub struct WriteRequest {
    pub key: Bytes,
    pub op: WriteOp,
    /// The new body, for upsert, insert and replace.
    pub value: Option<Bytes>,
    /// Apply only if the document's current CAS (or its lock's CAS) is this.
    pub cas: Option<Cas>,
    /// Absolute Unix seconds, 0 = never; see [`crate::absolute_expiry`].
    pub expiry: u32,
}

/// What a successful mutation answers: enough for a client to wait for it in the change
/// stream or an index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MutationOutcome {
    pub cas: Cas,
    pub partition: PartitionId,
    pub seqno: SeqNo,
    pub uuid: u64,
}

/// An epoch of a partition's history: `uuid` was current from `seqno` (exclusive) on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FailoverEntry {
    pub uuid: u64,
    pub seqno: SeqNo,
    /// The partition map version under which the copy that began this entry became active
    /// (0 before any map, and in records written before epochs were kept). One copy is
    /// active per partition per map version, so copies' histories order by where they end —
    /// (the last entry's epoch, the high seqno) — as Raft orders logs by last term, then
    /// index; a promotion must compare them so, never by seqno alone
    /// (`shoal_cluster::failover::HistoryEnd`). An entry begun for another reason (an
    /// unclean restart, a replica's rollback) keeps the epoch of the entry before it.
    #[serde(default)]
    pub epoch: u64,
}

/// Where a copy's history ends: the epoch of its last failover entry and its high seqno.
pub fn history_end(failover: &[FailoverEntry], high: SeqNo) -> (u64, SeqNo) {
    (failover.last().map_or(0, |e| e.epoch), high)
}

struct DocLock {
    cas: Cas,
    until: Instant,
}

/// Everything that changes under the partition's sequencer lock.
struct Sequencer {
    high: SeqNo,
    /// Every change after `tail_from` up to `high`, newest last. Seqnos rise; on the
    /// active they are contiguous, a replica's may skip (a backfill has each key's latest
    /// change only).
    tail: VecDeque<Change>,
    tail_from: SeqNo,
    tail_bytes: usize,
    tail_limit: TailLimit,
    locks: HashMap<Bytes, DocLock>,
}

pub(crate) struct PartitionParts {
    pub id: PartitionId,
    /// The collection's id: the first bytes of each of its keys in the partition's keyspace.
    pub coll: u32,
    pub db: fjall::Database,
    /// The partition's keyspace, shared by every collection (see `codec`).
    pub ks: fjall::Keyspace,
    pub syncer: Arc<Syncer>,
    pub clock: Arc<CasClock>,
    pub health: Arc<StorageHealth>,
    pub failover: Vec<FailoverEntry>,
    pub purge_seqno: SeqNo,
    pub collection_changed: Arc<watch::Sender<u64>>,
    pub dropped: Arc<AtomicBool>,
    /// The partition's state on this node, shared by every collection's copy of it.
    pub owner: Arc<Ownership>,
    /// The high seqno when it is known (an ingested copy: its export's position), else
    /// the newest by-sequence entry's.
    pub high: Option<SeqNo>,
    /// A durable lower bound of the high seqno from the partition's record (see
    /// `PartitionRecord::high`); 0 when none.
    pub high_floor: SeqNo,
    /// Live documents found at open (see [`count_live`]).
    pub live: LiveCount,
    pub tail_limit: TailLimit,
}

/// How much of its recent history a partition keeps in memory.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TailLimit {
    pub items: usize,
    pub bytes: usize,
}

impl TailLimit {
    /// One partition's share of the collection's budget.
    pub fn share(partitions: u16) -> TailLimit {
        let n = usize::from(partitions.max(1));
        let clamp = |total: usize, range: &std::ops::RangeInclusive<usize>| (total / n).clamp(*range.start(), *range.end());
        TailLimit {
            items: clamp(crate::CHANGE_TAIL_COLLECTION_ITEMS, &crate::CHANGE_TAIL_PARTITION_ITEMS),
            bytes: clamp(crate::CHANGE_TAIL_COLLECTION_BYTES, &crate::CHANGE_TAIL_PARTITION_BYTES),
        }
    }
}

/// Live documents and their body bytes in one partition.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LiveCount {
    pub count: i64,
    pub bytes: i64,
}

/// Damaged records [`count_live`] steps over before it stops counting: a bound on the work
/// (and the log) when a whole file is damaged.
const COUNT_DAMAGED_MAX: usize = 1024;

/// Counts the live documents of collection `coll` in one partition's keyspace.
///
/// A record that fails a check (a damaged table block or blob) is left out and the node
/// still opens: the other documents must stay readable, and reading a damaged one answers
/// `corrupt`. The engine's iterator ends at a damaged table block, so the counts are then
/// short by what follows it; they are statistics (the document gauges), not state.
pub(crate) fn count_live(ks: &fjall::Keyspace, coll: u32) -> Result<LiveCount, fjall::Error> {
    let mut out = LiveCount::default();
    let mut damaged = 0usize;
    for guard in ks.range(codec::tag_range(coll, codec::TAG_DOC)) {
        let v = match guard.value() {
            Ok(v) => v,
            Err(e) if crate::is_corruption(&e) => {
                damaged += 1;
                tracing::error!(error = %e, "a stored document failed a check while counting documents at open");
                if damaged >= COUNT_DAMAGED_MAX {
                    break;
                }
                continue;
            }
            Err(e) => return Err(e),
        };
        if let Some((meta, body)) = codec::decode_doc_value(&v) {
            if !meta.deleted {
                out.count += 1;
                out.bytes += body.len() as i64;
            }
        }
    }
    Ok(out)
}

pub struct Partition {
    pub(crate) id: PartitionId,
    pub(crate) coll: u32,
    pub(crate) db: fjall::Database,
    pub(crate) ks: fjall::Keyspace,
    pub(crate) syncer: Arc<Syncer>,
    clock: Arc<CasClock>,
    health: Arc<StorageHealth>,
    failover: Vec<FailoverEntry>,
    /// See [`PartitionParts::high_floor`]; written back with every record of the partition.
    high_floor: SeqNo,
    /// The high seqno this copy opened at: a start, an ingest, a promotion, a rollback — every
    /// way a copy comes to serve here makes a new object. State derived from the copy
    /// (index entries, shadow rows) serves it only once caught up this far
    /// ([`crate::Collection::behind_serve_floor`]): before, a partition moved here was read
    /// from an index still rebuilding it, and scans came back short with 200.
    serve_floor: SeqNo,
    state: Mutex<Sequencer>,
    high_tx: watch::Sender<SeqNo>,
    /// Every change of this copy up to it is fsynced (see `syncer`).
    persisted: Arc<PersistedSeqno>,
    collection_changed: Arc<watch::Sender<u64>>,
    dropped: Arc<AtomicBool>,
    owner: Arc<Ownership>,
    /// Set when this object is replaced (the partition was dropped or ingested): holders
    /// of the old one are refused and must look the partition up again.
    closed: AtomicBool,
    /// Locks currently held; lets reads skip the sequencer lock when there are none.
    locked_docs: AtomicUsize,
    pub(crate) purge_seqno: AtomicU64,
    /// No document of this copy expires before this time (unix seconds; a lower bound):
    /// the expiry pager reads the partition's expiry keys only once it has passed, not
    /// every second. 0 on a new object (a start, an ingest, a promotion: what its keys
    /// hold is unknown), lowered by every write with an expiry, and set again by the
    /// pager's read ([`Partition::expiry_scan`]).
    next_expiry: AtomicU64,
    pub(crate) docs_count: AtomicI64,
    pub(crate) docs_bytes: AtomicI64,
}

/// What [`Partition::expire`] did with a due expiry key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Expired {
    /// The document was deleted (a deletion in the change stream).
    Deleted,
    /// The document changed since (its expiry key was stale, and is gone).
    Changed,
    /// Not the active copy: a replica's documents go when the active's deletions arrive.
    NotHere,
}

/// The current record of a key, as the sequencer sees it before a write.
struct Current {
    meta: DocMeta,
    body: Bytes,
}

impl Partition {
    pub(crate) fn open(parts: PartitionParts) -> Result<Partition, fjall::Error> {
        let (high, max_cas) = match parts.ks.range(codec::seq_key(parts.coll, 0)..=codec::seq_key(parts.coll, SeqNo::MAX)).next_back() {
            Some(guard) => {
                let (k, v) = guard.into_inner()?;
                let seqno = codec::decode_seq_key(&k).unwrap_or(0);
                let cas = codec::decode_seq_value(&v).map(|(c, _, _)| c).unwrap_or(0);
                (seqno, cas)
            }
            None => (0, 0),
        };
        parts.clock.observe(max_cas);
        debug_assert!(parts.high.is_none_or(|h| h >= high), "an ingested copy's position is behind its own entries");
        let high = parts.high.unwrap_or(high).max(parts.purge_seqno).max(parts.high_floor);
        let high_floor = parts.high_floor.min(high);
        Ok(Partition {
            id: parts.id,
            coll: parts.coll,
            db: parts.db,
            ks: parts.ks,
            syncer: parts.syncer,
            clock: parts.clock,
            health: parts.health,
            failover: parts.failover,
            high_floor,
            serve_floor: high,
            state: Mutex::new(Sequencer {
                high,
                tail: VecDeque::new(),
                tail_from: high,
                tail_bytes: 0,
                tail_limit: parts.tail_limit,
                locks: HashMap::new(),
            }),
            high_tx: watch::channel(high).0,
            // A copy is opened over what is on disk: a start (after a crash the store
            // fsyncs what it recovered), an ingest (fsynced table files), a promotion or a
            // rollback (both fsync the partition's journal before the new copy is made).
            persisted: PersistedSeqno::new(high),
            collection_changed: parts.collection_changed,
            dropped: parts.dropped,
            owner: parts.owner,
            closed: AtomicBool::new(false),
            locked_docs: AtomicUsize::new(0),
            purge_seqno: AtomicU64::new(parts.purge_seqno),
            next_expiry: AtomicU64::new(0),
            docs_count: AtomicI64::new(parts.live.count),
            docs_bytes: AtomicI64::new(parts.live.bytes),
        })
    }

    pub fn id(&self) -> PartitionId {
        self.id
    }

    /// The partition's current history UUID.
    pub fn uuid(&self) -> u64 {
        self.failover.last().map(|e| e.uuid).unwrap_or(0)
    }

    /// Starts a new history epoch (after an unclean shutdown, or for a new partition).
    pub(crate) fn push_failover(&mut self, entry: FailoverEntry) {
        self.failover.push(entry);
    }

    /// The durable lower bound of the high seqno a record of this copy carries.
    pub(crate) fn high_floor(&self) -> Option<SeqNo> {
        (self.high_floor > 0).then_some(self.high_floor)
    }

    pub fn failover_log(&self) -> &[FailoverEntry] {
        &self.failover
    }

    pub fn high_seqno(&self) -> SeqNo {
        *self.high_tx.borrow()
    }

    /// The high seqno this copy opened at (see the field).
    pub fn serve_floor(&self) -> SeqNo {
        self.serve_floor
    }

    /// Whether this is the current copy and active here (it serves clients' reads).
    pub fn is_active(&self) -> bool {
        self.check_active().is_ok()
    }

    /// Whether this is the current copy and this node holds it, active or replica (its
    /// change stream can be read).
    pub fn is_held(&self) -> bool {
        self.check_state(&[PartitionState::Active, PartitionState::Replica], "active or replica").is_ok()
    }

    pub(crate) fn has_locks(&self) -> bool {
        self.locked_docs.load(Ordering::Acquire) > 0
    }

    pub(crate) fn high_watch(&self) -> watch::Receiver<SeqNo> {
        self.high_tx.subscribe()
    }

    pub(crate) fn is_dropped(&self) -> bool {
        self.dropped.load(Ordering::Acquire)
    }

    /// Refuses unless this copy is current and its state is one of `wanted`.
    fn check_state(&self, wanted: &[PartitionState], name: &'static str) -> Result<(), NotMine> {
        let state = self.owner.state();
        if self.closed.load(Ordering::Acquire) || !wanted.contains(&state) {
            let state = if self.closed.load(Ordering::Acquire) { PartitionState::Dead } else { state };
            return Err(NotMine { partition: self.id, state, wanted: name, map_version: self.owner.map_version() });
        }
        Ok(())
    }

    /// Reads and writes from clients go to the active copy only.
    fn check_active(&self) -> Result<(), NotMine> {
        self.check_state(&[PartitionState::Active], "active")
    }

    /// Closes this copy (it is being replaced): waits for the sequencer, so no writer is
    /// inside afterwards, and refuses everyone from then on.
    pub(crate) fn close(&self) -> Result<(), ReadError> {
        let _state = self.lock_sequencer()?;
        self.mark_closed();
        Ok(())
    }

    /// Closes this copy while the caller holds its sequencer (from [`Partition::hold`]),
    /// so that no commit lands between the caller's last look and the successor.
    pub(crate) fn retire_held(&self) {
        debug_assert!(self.state.is_locked(), "retired without the sequencer");
        self.mark_closed();
    }

    /// Refuses everyone from now on and wakes the waiters; call with the sequencer held.
    fn mark_closed(&self) {
        self.closed.store(true, Ordering::Release);
        self.persisted.close();
        self.high_tx.send_modify(|_| {});
    }

    /// A receiver of this copy's persisted seqno (every change up to it is fsynced). It
    /// closes when the copy is replaced: a seqno names a change only within one copy's
    /// history, so a waiter looks the partition up again.
    pub(crate) fn persisted_watch(&self) -> Result<watch::Receiver<SeqNo>, ReadError> {
        match self.persisted.subscribe() {
            Some(rx) if !self.closed.load(Ordering::Acquire) => Ok(rx),
            _ => Err(ReadError::NotMyPartition(NotMine {
                partition: self.id,
                state: PartitionState::Dead,
                wanted: "a current copy",
                map_version: self.owner.map_version(),
            })),
        }
    }

    /// The high seqno with the sequencer held until the returned guard drops: a position
    /// that no commit can pass meanwhile (an export takes its snapshot inside).
    pub(crate) fn hold(&self) -> Result<(SeqNo, impl Drop + '_), ReadError> {
        let state = self.lock_sequencer()?;
        Ok((state.high, state))
    }

    /// The sequencer, waited for at most [`SEQUENCER_WAIT_MAX`]: a request never waits
    /// forever behind a writer stuck in the engine (a write stall on a failing disk).
    fn lock_sequencer(&self) -> Result<parking_lot::MutexGuard<'_, Sequencer>, ReadError> {
        self.state.try_lock_for(SEQUENCER_WAIT_MAX).ok_or(ReadError::Busy)
    }

    /// Where a reader holding `(uuid, seqno)` must roll back to, if this partition's history
    /// diverged from the reader's since that point. `None` when the reader is on our history.
    pub fn rollback_point(&self, uuid: u64, seqno: SeqNo) -> Option<SeqNo> {
        if uuid == self.uuid() {
            return None;
        }
        let known = self.failover.iter().position(|e| e.uuid == uuid);
        match known.and_then(|i| self.failover.get(i + 1)) {
            // History is shared up to where the next epoch began.
            Some(next) => Some(seqno.min(next.seqno)),
            None => Some(0),
        }
    }

    /// The stored record of `dk`. A record that does not decode is an error, never
    /// "absent": treating it as absent would let a write overwrite it and hide the damage.
    fn read_current(&self, dk: &[u8]) -> Result<Option<Current>, ReadError> {
        let Some(raw) = self.ks.get(codec::doc_key(self.coll, dk))? else { return Ok(None) };
        let raw = Bytes::from(raw);
        match codec::decode_doc_value(&raw) {
            Some((meta, body)) => Ok(Some(Current { meta, body: raw.slice(body) })),
            None => {
                tracing::error!(partition = self.id, key = %String::from_utf8_lossy(dk), "corrupt document record");
                Err(ReadError::Corrupt)
            }
        }
    }

    /// Reads a live document. A document locked by someone else is returned with
    /// [`LOCKED_CAS`].
    pub fn get(&self, key: &[u8]) -> Result<Document, ReadError> {
        validate_key(key).map_err(ReadError::InvalidKey)?;
        if self.is_dropped() {
            return Err(ReadError::CollectionDropped);
        }
        self.check_active().map_err(ReadError::NotMyPartition)?;
        let now = self.clock.unix_secs();
        let current = self.read_current(key)?;
        let Some(current) = current.filter(|c| is_live(&c.meta, now)) else {
            return Err(ReadError::NotFound);
        };
        let mut cas = current.meta.cas;
        if self.locked_docs.load(Ordering::Acquire) > 0 {
            let state = self.lock_sequencer()?;
            if state.locks.get(key).is_some_and(|l| l.until > Instant::now()) {
                cas = LOCKED_CAS;
            }
        }
        Ok(Document { cas, seqno: current.meta.seqno, expiry: current.meta.expiry, value: current.body })
    }

    /// The live version of `key` on an active or replica copy, `None` when it has none
    /// (absent, deleted or expired). For a replica repairing after a rollback: it reads the
    /// copy it follows, which a hand-over may have turned into a (frozen) replica already,
    /// where [`Partition::get`] refuses. Errors are errors, never "absent".
    pub fn current_version(&self, key: &[u8]) -> Result<Option<Document>, ReadError> {
        validate_key(key).map_err(ReadError::InvalidKey)?;
        if self.is_dropped() {
            return Err(ReadError::CollectionDropped);
        }
        self.check_state(&[PartitionState::Active, PartitionState::Replica], "active or replica").map_err(ReadError::NotMyPartition)?;
        let now = self.clock.unix_secs();
        Ok(self.read_current(key)?.filter(|c| is_live(&c.meta, now)).map(|c| Document {
            cas: c.meta.cas,
            seqno: c.meta.seqno,
            expiry: c.meta.expiry,
            value: c.body,
        }))
    }

    /// Get-and-lock: the returned CAS unlocks the document, or mutates it (which unlocks).
    pub fn get_and_lock(&self, key: &[u8], lock_secs: u32) -> Result<Document, ReadError> {
        validate_key(key).map_err(ReadError::InvalidKey)?;
        if lock_secs == 0 || lock_secs > LOCK_MAX_SECS {
            return Err(ReadError::InvalidLockTime);
        }
        let mut state = self.lock_sequencer()?;
        if self.is_dropped() {
            return Err(ReadError::CollectionDropped);
        }
        self.check_active().map_err(ReadError::NotMyPartition)?;
        let now = self.clock.unix_secs();
        let current = self.read_current(key)?;
        let Some(current) = current.filter(|c| is_live(&c.meta, now)) else {
            return Err(ReadError::NotFound);
        };
        if state.locks.get(key).is_some_and(|l| l.until > Instant::now()) {
            return Err(ReadError::Locked);
        }
        let cas = self.clock.next();
        let lock = DocLock { cas, until: Instant::now() + Duration::from_secs(u64::from(lock_secs)) };
        if state.locks.insert(Bytes::copy_from_slice(key), lock).is_none() {
            self.locked_docs.fetch_add(1, Ordering::AcqRel);
        }
        Ok(Document { cas, seqno: current.meta.seqno, expiry: current.meta.expiry, value: current.body })
    }

    /// Releases a lock taken by [`Partition::get_and_lock`].
    pub fn unlock(&self, key: &[u8], cas: Cas) -> Result<(), WriteError> {
        validate_key(key).map_err(WriteError::InvalidKey)?;
        let mut state = self.lock_sequencer()?;
        self.check_active().map_err(WriteError::NotMyPartition)?;
        let now = self.clock.unix_secs();
        let current = self.read_current(key)?;
        if !current.is_some_and(|c| is_live(&c.meta, now)) {
            return Err(WriteError::NotFound);
        }
        match state.locks.get(key) {
            Some(l) if l.until > Instant::now() => {
                if l.cas != cas {
                    return Err(WriteError::CasMismatch);
                }
                state.locks.remove(key);
                self.locked_docs.fetch_sub(1, Ordering::AcqRel);
                Ok(())
            }
            _ => Err(WriteError::NotLocked),
        }
    }

    /// Applies one mutation; answers once it is in the journal buffer (readers see it).
    /// The returned ticket names the journal batch, for [`Partition::wait_durable`].
    pub fn write(&self, req: &WriteRequest) -> Result<(MutationOutcome, u64), WriteError> {
        self.health.check_writable()?;
        let mut state = self.lock_sequencer()?;
        let mut batch = self.db.batch();
        let mut changes = Vec::with_capacity(1);
        let outcome = self.plan(&mut state, &mut batch, &mut changes, req)?;
        let ticket = self.commit(&mut state, batch, changes)?;
        Ok((outcome, ticket))
    }

    /// Applies many mutations in order, committing them in as few journal batches as
    /// possible (group commit). A failing request fails alone.
    pub fn write_many(&self, reqs: &[&WriteRequest]) -> (Vec<Result<MutationOutcome, WriteError>>, u64) {
        let mut results = Vec::with_capacity(reqs.len());
        let refused = self.health.check_writable().and_then(|()| self.lock_sequencer().map_err(WriteError::from));
        let mut state = match refused {
            Ok(state) => state,
            Err(e) => return (reqs.iter().map(|_| Err(e.duplicate())).collect(), 0),
        };
        let mut batch = self.db.batch();
        let mut changes = Vec::new();
        let mut in_batch: HashSet<&[u8]> = HashSet::new();
        let mut ticket = 0;
        let mut pending_from = 0;
        for req in reqs {
            // A key already in the uncommitted batch must see that write: commit first.
            if !in_batch.insert(&req.key[..]) {
                match self.commit(&mut state, std::mem::replace(&mut batch, self.db.batch()), std::mem::take(&mut changes)) {
                    Ok(t) => ticket = ticket.max(t),
                    Err(e) => fail_pending(&mut results[pending_from..], &e),
                }
                pending_from = results.len();
                in_batch.clear();
                in_batch.insert(&req.key[..]);
            }
            results.push(self.plan(&mut state, &mut batch, &mut changes, req));
        }
        match self.commit(&mut state, batch, changes) {
            Ok(t) => ticket = ticket.max(t),
            Err(e) => fail_pending(&mut results[pending_from..], &e),
        }
        (results, ticket)
    }

    /// Checks one request against the current state and the uncommitted batch, and adds its
    /// effects to `batch` and `changes`. Assigns the seqno; `state.high` moves on commit.
    fn plan(
        &self,
        state: &mut Sequencer,
        batch: &mut fjall::OwnedWriteBatch,
        changes: &mut Vec<Change>,
        req: &WriteRequest,
    ) -> Result<MutationOutcome, WriteError> {
        validate_key(&req.key).map_err(WriteError::InvalidKey)?;
        if self.is_dropped() {
            return Err(WriteError::CollectionDropped);
        }
        self.check_active().map_err(WriteError::NotMyPartition)?;
        let value = match req.op {
            WriteOp::Upsert | WriteOp::Insert | WriteOp::Replace => {
                let v = req.value.as_ref().ok_or(WriteError::MissingValue)?;
                if v.len() > DOC_MAX_BYTES {
                    return Err(WriteError::TooLarge);
                }
                Some(v.clone())
            }
            WriteOp::Remove | WriteOp::Touch => None,
        };
        let now = self.clock.unix_secs();
        let dk = &req.key[..];
        let current = self.read_current(dk)?;
        let live = current.as_ref().filter(|c| is_live(&c.meta, now));

        let mut unlocks = false;
        if let Some(lock) = state.locks.get(&req.key[..]) {
            if lock.until > Instant::now() {
                if req.cas != Some(lock.cas) {
                    return Err(WriteError::Locked);
                }
                unlocks = true;
            } else {
                state.locks.remove(&req.key[..]);
                self.locked_docs.fetch_sub(1, Ordering::AcqRel);
            }
        }
        match (req.op, live) {
            (WriteOp::Insert, Some(_)) => return Err(WriteError::Exists),
            (WriteOp::Replace | WriteOp::Remove | WriteOp::Touch, None) => return Err(WriteError::NotFound),
            _ => {}
        }
        if let (Some(cas), false) = (req.cas, unlocks) {
            match live {
                None => return Err(WriteError::NotFound),
                Some(c) if c.meta.cas != cas => return Err(WriteError::CasMismatch),
                Some(_) => {}
            }
        }

        let seqno = state.high + changes.len() as u64 + 1;
        let cas = self.clock.next();
        let (body, expiry, deleted) = match req.op {
            WriteOp::Remove => (Bytes::new(), 0, true),
            WriteOp::Touch => (live.map(|c| c.body.clone()).unwrap_or_default(), req.expiry, false),
            _ => (value.unwrap_or_default(), req.expiry, false),
        };
        if unlocks {
            state.locks.remove(&req.key[..]);
            self.locked_docs.fetch_sub(1, Ordering::AcqRel);
        }
        self.stage(batch, &req.key, current.as_ref().map(|c| (&c.meta, c.body.len())), DocMeta { cas, seqno, expiry, deleted }, &body);
        // The tail gets a copy: the body may be a slice of a large request buffer (a `_bulk`
        // body) that the tail must not keep alive.
        let value = (!deleted).then(|| Bytes::copy_from_slice(&body));
        changes.push(Change { partition: self.id, seqno, key: req.key.clone(), cas, deleted, expiry, value });
        Ok(MutationOutcome { cas, partition: self.id, seqno, uuid: self.uuid() })
    }

    /// Adds the writes that replace `old` with `new` in all three keyspaces.
    fn stage(&self, batch: &mut fjall::OwnedWriteBatch, key: &[u8], old: Option<(&DocMeta, usize)>, new: DocMeta, body: &[u8]) {
        let c = self.coll;
        batch.insert(&self.ks, codec::doc_key(c, key), codec::doc_value(&new, body));
        batch.insert(&self.ks, codec::seq_key(c, new.seqno), codec::seq_value(new.cas, new.deleted, key));
        if new.expiry != 0 && !new.deleted {
            batch.insert(&self.ks, codec::exp_key(c, new.expiry, key), Vec::new());
            // Under the sequencer lock, as the commit that follows: see `expiry_scan`.
            self.next_expiry.fetch_min(u64::from(new.expiry), Ordering::AcqRel);
        }
        let (mut count_delta, mut bytes_delta) = (0i64, 0i64);
        if let Some((old, old_len)) = old {
            batch.remove(&self.ks, codec::seq_key(c, old.seqno));
            if old.expiry != 0 && !old.deleted && (old.expiry != new.expiry || new.deleted) {
                batch.remove(&self.ks, codec::exp_key(c, old.expiry, key));
            }
            if !old.deleted {
                count_delta -= 1;
                bytes_delta -= old_len as i64;
            }
        }
        if !new.deleted {
            count_delta += 1;
            bytes_delta += body.len() as i64;
        }
        // Counted before commit: a failed commit poisons the database anyway.
        self.docs_count.fetch_add(count_delta, Ordering::Relaxed);
        self.docs_bytes.fetch_add(bytes_delta, Ordering::Relaxed);
    }

    fn commit(&self, state: &mut Sequencer, batch: fjall::OwnedWriteBatch, changes: Vec<Change>) -> Result<u64, WriteError> {
        if changes.is_empty() {
            return Ok(0);
        }
        if let Err(e) = batch.commit() {
            self.health.engine_error(&e);
            return Err(if crate::health::is_out_of_space(&e) { WriteError::DiskFull } else { WriteError::from(e) });
        }
        let ticket = self.syncer.ticket();
        for change in changes {
            debug_assert!(change.seqno > state.high, "seqnos rise within a partition");
            state.high = change.seqno;
            push_tail(state, change);
        }
        let high = state.high;
        self.persisted.note(&self.syncer, ticket, high);
        self.high_tx.send_replace(high);
        self.collection_changed.send_modify(|n| *n = n.wrapping_add(1));
        // An fsync that failed while this batch was being committed: the batch is in, but it
        // is not acknowledged (see `health`).
        self.health.check_writable()?;
        Ok(ticket)
    }

    /// Applies changes made on another copy of this partition — the replica write path:
    /// each keeps its seqno, CAS, expiry and deleted flag. Seqnos must rise past the high
    /// seqno (gaps are fine: a backfill carries each key's latest change only). Only a
    /// replica or pending copy takes them. Returns the durability ticket.
    pub fn apply(&self, changes: &[Change]) -> Result<u64, WriteError> {
        self.health.check_writable()?;
        let mut state = self.lock_sequencer()?;
        if self.is_dropped() {
            return Err(WriteError::CollectionDropped);
        }
        self.check_state(&[PartitionState::Replica, PartitionState::Pending], "replica or pending").map_err(WriteError::NotMyPartition)?;
        let mut batch = self.db.batch();
        let mut staged: Vec<Change> = Vec::new();
        let mut in_batch: HashSet<&[u8]> = HashSet::new();
        let mut ticket = 0;
        let mut last = state.high;
        for c in changes {
            validate_key(&c.key).map_err(WriteError::InvalidKey)?;
            if c.seqno <= last {
                return Err(WriteError::OutOfOrder { seqno: c.seqno, high: last });
            }
            let body = match (&c.value, c.deleted) {
                (_, true) => Bytes::new(),
                (Some(v), false) if v.len() <= DOC_MAX_BYTES => v.clone(),
                (Some(_), false) => return Err(WriteError::TooLarge),
                (None, false) => return Err(WriteError::MissingValue),
            };
            // A key already in the uncommitted batch: commit first, so that its record is
            // read back below (a batch writes each key once).
            if !in_batch.insert(&c.key[..]) {
                let full = std::mem::replace(&mut batch, self.db.batch());
                ticket = ticket.max(self.commit(&mut state, full, std::mem::take(&mut staged))?);
                in_batch.clear();
                in_batch.insert(&c.key[..]);
            }
            let current = self.read_current(&c.key)?;
            let meta = DocMeta { cas: c.cas, seqno: c.seqno, expiry: if c.deleted { 0 } else { c.expiry }, deleted: c.deleted };
            self.stage(&mut batch, &c.key, current.as_ref().map(|x| (&x.meta, x.body.len())), meta, &body);
            self.clock.observe(c.cas);
            staged.push(Change { partition: self.id, value: (!c.deleted).then_some(body), expiry: meta.expiry, ..c.clone() });
            last = c.seqno;
        }
        ticket = ticket.max(self.commit(&mut state, batch, staged)?);
        Ok(ticket)
    }

    /// Removes every change above `to` from this copy, durably, and closes it: the caller
    /// puts the successor in its place (see `Store::rollback_partition`). `to` below the
    /// purge seqno becomes 0: tombstones purged above `to` would leave keys changed after it
    /// unaccounted for. `record` adds the copy's new partition record (history, purge seqno)
    /// to the last batch, when the caller's metadata shares this database. `None` when there
    /// is nothing above `to`; then the copy stays open and unchanged.
    ///
    /// The removals go top-down in batches of [`ROLLBACK_BATCH_MAX`], so every batch boundary
    /// is itself the state of a rollback to a lower point; a crash between two batches is an
    /// unclean start, which gives the copy a new history entry at whatever it holds, and
    /// rolling back again from there reaches `to`.
    /// The keys a rollback to `to` would remove (their latest change is above `to`; all of
    /// them when `to` is below the purge seqno, as [`Partition::roll_back`] does), so that a
    /// caller can fetch what replaces them before it rolls back.
    pub fn keys_above(&self, to: SeqNo) -> Result<Vec<Bytes>, ReadError> {
        Ok(self.latest_above(to, self.purge_seqno.load(Ordering::Acquire))?.1.into_iter().map(|(_, key)| key).collect())
    }

    /// The point a rollback to `to` goes to (0 below `purge_seqno`), and every by-sequence
    /// entry above it, newest first: each key's latest change is there (one entry per key),
    /// so these are exactly the keys whose latest change a rollback removes.
    fn latest_above(&self, to: SeqNo, purge_seqno: SeqNo) -> Result<(SeqNo, Vec<(SeqNo, Bytes)>), ReadError> {
        let to = if to < purge_seqno { 0 } else { to };
        let c = self.coll;
        let mut latest = Vec::new();
        for guard in self.ks.range(codec::seq_key(c, to + 1)..=codec::seq_key(c, SeqNo::MAX)).rev() {
            let (k, v) = guard.into_inner()?;
            let (Some(seqno), Some((_, _, key))) = (codec::decode_seq_key(&k), codec::decode_seq_value(&v)) else {
                return Err(ReadError::Corrupt);
            };
            latest.push((seqno, Bytes::copy_from_slice(key)));
        }
        Ok((to, latest))
    }

    pub(crate) fn roll_back(
        &self,
        to: SeqNo,
        fresh_uuid: u64,
        record: impl FnOnce(&mut fjall::OwnedWriteBatch, &[FailoverEntry], SeqNo),
    ) -> Result<Option<RolledBack>, PartitionError> {
        let state = self.lock_sequencer()?;
        if self.is_dropped() {
            return Err(PartitionError::Refused(WriteError::CollectionDropped));
        }
        // An active copy assigns the seqnos others follow: it never rolls back.
        self.check_state(&[PartitionState::Replica, PartitionState::Pending], "replica or pending").map_err(PartitionError::NotMine)?;
        if to >= state.high {
            return Ok(None);
        }
        self.health.check_writable()?;
        let purge_seqno = self.purge_seqno.load(Ordering::Acquire);
        let c = self.coll;
        let (to, victims) = self.latest_above(to, purge_seqno).map_err(|e| match e {
            ReadError::Corrupt => PartitionError::Refused(WriteError::Corrupt),
            e => PartitionError::from(e),
        })?;
        let failover: Vec<FailoverEntry> = self
            .failover
            .iter()
            .copied()
            .filter(|e| e.seqno <= to)
            .chain(std::iter::once(FailoverEntry { uuid: fresh_uuid, seqno: to, epoch: self.failover.last().map_or(0, |e| e.epoch) }))
            .collect();
        let purge_seqno = purge_seqno.min(to);
        let (mut count_delta, mut bytes_delta) = (0i64, 0i64);
        let batches = victims.len().div_ceil(ROLLBACK_BATCH_MAX).max(1);
        let mut record = Some(record);
        for (i, chunk) in victims.chunks(ROLLBACK_BATCH_MAX).map(Some).chain(std::iter::repeat(None)).take(batches).enumerate() {
            let mut batch = self.db.batch();
            for (seqno, key) in chunk.unwrap_or_default() {
                batch.remove(&self.ks, codec::seq_key(c, *seqno));
                let Some(current) = self.read_current(key)? else { continue };
                debug_assert_eq!(current.meta.seqno, *seqno, "a key's by-sequence entry is its latest change");
                if current.meta.seqno != *seqno {
                    // A stale entry (never written so): the record is not this change.
                    continue;
                }
                batch.remove(&self.ks, codec::doc_key(c, key));
                if current.meta.expiry != 0 && !current.meta.deleted {
                    batch.remove(&self.ks, codec::exp_key(c, current.meta.expiry, key));
                }
                if !current.meta.deleted {
                    count_delta -= 1;
                    bytes_delta -= current.body.len() as i64;
                }
            }
            if i + 1 == batches {
                if let Some(record) = record.take() {
                    record(&mut batch, &failover, purge_seqno);
                }
            }
            if let Err(e) = batch.commit() {
                self.health.engine_error(&e);
                return Err(e.into());
            }
        }
        if let Err(e) = self.db.persist(fjall::PersistMode::SyncAll) {
            // As a failed group-commit fsync: nothing is acknowledged from now on.
            self.health.fail(format!("fsync of the journal failed during a rollback: {e}"));
            return Err(e.into());
        }
        self.docs_count.fetch_add(count_delta, Ordering::Relaxed);
        self.docs_bytes.fetch_add(bytes_delta, Ordering::Relaxed);
        let live = LiveCount { count: self.docs_count.load(Ordering::Relaxed), bytes: self.docs_bytes.load(Ordering::Relaxed) };
        // Closed under the sequencer: no apply lands on this copy between the removals and
        // its successor (which starts at `to`, with an empty tail).
        self.mark_closed();
        drop(state);
        tracing::info!(partition = self.id, collection = c, to, removed = victims.len(), "partition copy rolled back");
        Ok(Some(RolledBack { to, removed: victims.into_iter().map(|(_, key)| key).collect(), failover, purge_seqno, live }))
    }

    /// Writes versions of keys from the copy this one follows, each at its own seqno at or
    /// below the high seqno, which does not move — the repair after a rollback, for the keys
    /// whose older version it removed (see `Collection::restore`). Returns how many were
    /// written: a change above the high seqno is left to the change stream (which brings it),
    /// one no newer than what the copy holds of its key is skipped.
    pub(crate) fn restore(&self, changes: &[Change]) -> Result<usize, PartitionError> {
        self.health.check_writable()?;
        let mut state = self.lock_sequencer()?;
        if self.is_dropped() {
            return Err(PartitionError::Refused(WriteError::CollectionDropped));
        }
        self.check_state(&[PartitionState::Replica, PartitionState::Pending], "replica or pending").map_err(PartitionError::NotMine)?;
        let c = self.coll;
        let mut restored = 0;
        let mut lowest = SeqNo::MAX;
        let mut batch = self.db.batch();
        let mut in_batch: HashSet<&[u8]> = HashSet::new();
        let mut seqnos: HashSet<SeqNo> = HashSet::new();
        for ch in changes {
            validate_key(&ch.key).map_err(|e| PartitionError::Refused(WriteError::InvalidKey(e)))?;
            let body = match (&ch.value, ch.deleted) {
                (_, true) => Bytes::new(),
                (Some(v), false) if v.len() <= DOC_MAX_BYTES => v.clone(),
                (Some(_), false) => return Err(PartitionError::Refused(WriteError::TooLarge)),
                (None, false) => return Err(PartitionError::Refused(WriteError::MissingValue)),
            };
            if ch.seqno == 0 || ch.seqno > state.high {
                continue;
            }
            if !in_batch.insert(&ch.key[..]) {
                return Err(PartitionError::Malformed(format!("key {:?} twice in one restore", String::from_utf8_lossy(&ch.key))));
            }
            let current = self.read_current(&ch.key)?;
            if current.as_ref().is_some_and(|x| x.meta.seqno >= ch.seqno) {
                continue;
            }
            // The seqno must be free: on the history this copy shares with the sender it
            // was this key's change, so another key holding it means another history.
            if !seqnos.insert(ch.seqno) || self.ks.get(codec::seq_key(c, ch.seqno))?.is_some() {
                return Err(PartitionError::NotInHistory { seqno: ch.seqno });
            }
            let meta = DocMeta { cas: ch.cas, seqno: ch.seqno, expiry: if ch.deleted { 0 } else { ch.expiry }, deleted: ch.deleted };
            self.stage(&mut batch, &ch.key, current.as_ref().map(|x| (&x.meta, x.body.len())), meta, &body);
            self.clock.observe(ch.cas);
            lowest = lowest.min(ch.seqno);
            restored += 1;
        }
        if restored == 0 {
            return Ok(0);
        }
        if let Err(e) = batch.commit() {
            self.health.engine_error(&e);
            return Err(e.into());
        }
        // The persisted seqno already covers these seqnos: the restore is fsynced before it
        // is answered, so the watch never claims more than is on disk.
        if let Err(e) = self.db.persist(fjall::PersistMode::SyncAll) {
            self.health.fail(format!("fsync of the journal failed during a restore: {e}"));
            return Err(e.into());
        }
        // The tail holds a contiguous run of the newest changes and a restored one is not
        // among them: readers from before it go to the by-sequence index, which has it.
        if lowest > state.tail_from {
            state.tail.clear();
            state.tail_bytes = 0;
            state.tail_from = state.high;
        }
        self.collection_changed.send_modify(|n| *n = n.wrapping_add(1));
        Ok(restored)
    }

    /// Whether a document of this copy may have expired by `now`: the expiry pager reads
    /// the partition's expiry keys only then.
    pub(crate) fn expiry_due(&self, now: u64) -> bool {
        self.next_expiry.load(Ordering::Acquire) <= now
    }

    /// Starts a read of the expiry keys by the pager, which ends with
    /// [`expiry_scanned`](Self::expiry_scanned). The bound is cleared under the sequencer
    /// lock, which every write holds from staging its expiry key to committing it: a write
    /// committed before this is in the pager's read, and one staged after it lowers the
    /// bound again itself.
    pub(crate) fn expiry_scan(&self) -> Result<(), WriteError> {
        let _state = self.lock_sequencer()?;
        self.next_expiry.store(u64::MAX, Ordering::Release);
        Ok(())
    }

    /// Ends the pager's read: the earliest expiry it left behind (`u64::MAX` for none, 0 to
    /// read again at the next round).
    pub(crate) fn expiry_scanned(&self, next: u64) {
        self.next_expiry.fetch_min(next, Ordering::AcqRel);
    }

    /// Deletes `key` if it is still the document that expired at `expiry`; called by the
    /// expiry pager. Stale index entries are removed either way.
    pub(crate) fn expire(&self, key: &[u8], expiry: u32, now: u64) -> Result<Expired, WriteError> {
        self.health.check_writable()?;
        let mut state = self.lock_sequencer()?;
        // A replica's documents expire when the active's deletions arrive.
        if self.is_dropped() || self.check_active().is_err() {
            return Ok(Expired::NotHere);
        }
        let current = self.read_current(key)?;
        let Some(current) = current.filter(|c| !c.meta.deleted && c.meta.expiry == expiry && u64::from(expiry) <= now) else {
            self.ks.remove(codec::exp_key(self.coll, expiry, key))?;
            return Ok(Expired::Changed);
        };
        if state.locks.remove(key).is_some() {
            self.locked_docs.fetch_sub(1, Ordering::AcqRel);
        }
        let seqno = state.high + 1;
        let cas = self.clock.next();
        let mut batch = self.db.batch();
        self.stage(&mut batch, key, Some((&current.meta, current.body.len())), DocMeta { cas, seqno, expiry: 0, deleted: true }, &[]);
        let key = Bytes::copy_from_slice(key);
        let change = Change { partition: self.id, seqno, key, cas, deleted: true, expiry: 0, value: None };
        self.commit(&mut state, batch, vec![change])?;
        Ok(Expired::Deleted)
    }

    /// Up to `max` tombstones whose deletion (their CAS, in nanoseconds) is older than
    /// `cutoff_cas`, oldest first: `(seqno, key)`. The caller makes the purge seqno durable
    /// past them before [`Partition::purge`] removes them.
    pub(crate) fn purge_candidates(&self, cutoff_cas: Cas, max: usize) -> Result<Vec<(SeqNo, Bytes)>, ReadError> {
        let c = self.coll;
        let mut victims = Vec::new();
        // CAS grows with seqno inside a partition, so the scan stops at the first young entry.
        for guard in self.ks.range(codec::seq_key(c, 0)..=codec::seq_key(c, SeqNo::MAX)) {
            let (k, v) = guard.into_inner()?;
            let (Some(seqno), Some((cas, deleted, key))) = (codec::decode_seq_key(&k), codec::decode_seq_value(&v)) else {
                return Err(ReadError::Corrupt);
            };
            if cas >= cutoff_cas || victims.len() >= max {
                break;
            }
            if deleted {
                victims.push((seqno, Bytes::copy_from_slice(key)));
            }
        }
        Ok(victims)
    }

    /// Raises the purge seqno: readers resuming from before it start again from 0.
    /// Call only once `seqno` is durable in the partition's record.
    pub(crate) fn raise_purge_seqno(&self, seqno: SeqNo) {
        self.purge_seqno.fetch_max(seqno, Ordering::AcqRel);
    }

    /// Removes the tombstones of `victims` that are still current. Every victim's seqno must
    /// be at or below the (durable) purge seqno. Returns how many were purged.
    pub(crate) fn purge(&self, victims: &[(SeqNo, Bytes)]) -> Result<usize, WriteError> {
        let c = self.coll;
        let mut purged = 0;
        for (seqno, key) in victims {
            debug_assert!(*seqno <= self.purge_seqno.load(Ordering::Acquire), "purge before the purge seqno is durable");
            self.health.check_writable()?;
            let _state = self.lock_sequencer()?;
            let still_tombstone = self.read_current(key)?.is_some_and(|c| c.meta.deleted && c.meta.seqno == *seqno);
            if still_tombstone {
                let mut batch = self.db.batch();
                batch.remove(&self.ks, codec::doc_key(c, key));
                batch.remove(&self.ks, codec::seq_key(c, *seqno));
                batch.commit()?;
                purged += 1;
            }
        }
        Ok(purged)
    }

    /// Changes after `since` within `limit`, in seqno order, the position to read on from,
    /// and the end of the snapshot they belong to (Couchbase's snapshot marker). Recent
    /// changes come from memory, every one of them: each prefix is consistent, so the end is
    /// the last change. Older ones come from the by-sequence index, which keeps only each
    /// key's latest change: a reader holds a consistent state only once it has read up to
    /// the end, the high seqno the index was read at.
    pub(crate) fn read_changes(
        &self,
        since: SeqNo,
        limit: ReadLimit,
        include_docs: bool,
    ) -> Result<(Vec<Change>, SeqNo, SeqNo), ReadError> {
        let state = self.lock_sequencer()?;
        if self.is_dropped() {
            return Err(ReadError::CollectionDropped);
        }
        self.check_state(&[PartitionState::Active, PartitionState::Replica], "active or replica").map_err(ReadError::NotMyPartition)?;
        if since >= state.high || limit.items == 0 {
            return Ok((Vec::new(), since, since));
        }
        let mut taken = Taken::default();
        if since >= state.tail_from {
            {
                let skip = state.tail.partition_point(|c| c.seqno <= since);
                let mut out = Vec::new();
                for c in state.tail.iter().skip(skip) {
                    let change = if include_docs { c.clone() } else { Change { value: None, ..c.clone() } };
                    if !taken.admit(&change, limit) {
                        break;
                    }
                    out.push(change);
                }
                let next = out.last().map(|c| c.seqno).unwrap_or(since);
                return Ok((out, next, next));
            }
        }
        // Snapshot and high seqno taken together under the lock: the snapshot holds exactly
        // the latest change of every key up to `high`.
        let snapshot = self.db.snapshot();
        let high = state.high;
        drop(state);
        use fjall::Readable;
        let p = self.id;
        let mut out = Vec::new();
        let c = self.coll;
        for guard in snapshot.range(&self.ks, codec::seq_key(c, since + 1)..=codec::seq_key(c, high)) {
            let (k, v) = guard.into_inner()?;
            let (Some(seqno), Some((cas, deleted, key))) = (codec::decode_seq_key(&k), codec::decode_seq_value(&v)) else {
                return Err(ReadError::Corrupt);
            };
            let mut change = Change { partition: p, seqno, key: Bytes::copy_from_slice(key), cas, deleted, expiry: 0, value: None };
            if !deleted {
                if let Some(raw) = snapshot.get(&self.ks, codec::doc_key(c, key))? {
                    let raw = Bytes::from(raw);
                    let (meta, body) = codec::decode_doc_value(&raw).ok_or(ReadError::Corrupt)?;
                    change.expiry = meta.expiry;
                    if include_docs {
                        change.value = Some(raw.slice(body));
                    }
                }
            }
            if !taken.admit(&change, limit) {
                let next = out.last().map(|c: &Change| c.seqno).unwrap_or(since);
                return Ok((out, next, high));
            }
            out.push(change);
        }
        Ok((out, high, high))
    }
}

/// What a rollback did to a copy; the caller makes its successor from it.
pub(crate) struct RolledBack {
    /// The new high seqno.
    pub to: SeqNo,
    /// Keys whose latest change was above `to` (removed, documents and tombstones alike).
    pub removed: Vec<Bytes>,
    /// The history: entries up to `to`, then a new one at `to`.
    pub failover: Vec<FailoverEntry>,
    pub purge_seqno: SeqNo,
    pub live: LiveCount,
}

/// By-sequence entries (with their documents and expiry entries) one rollback batch removes:
/// a bound on a batch's memory when a copy rolls back far.
pub(crate) const ROLLBACK_BATCH_MAX: usize = 10_000;

/// How much one read of a change stream may return: at most `items` changes and about
/// `bytes` of keys and documents (always at least one change, however large, so that a
/// reader makes progress).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadLimit {
    pub items: usize,
    pub bytes: usize,
}

impl ReadLimit {
    /// At most `items` changes and [`crate::CHANGES_READ_MAX_BYTES`].
    pub fn items(items: usize) -> ReadLimit {
        ReadLimit { items, bytes: crate::CHANGES_READ_MAX_BYTES }
    }
}

/// What a read has taken so far.
#[derive(Default)]
struct Taken {
    items: usize,
    bytes: usize,
}

impl Taken {
    /// Counts `change` in if it fits (the first always does).
    fn admit(&mut self, change: &Change, limit: ReadLimit) -> bool {
        let size = change.key.len() + change.value.as_ref().map_or(0, |v| v.len());
        if self.items >= limit.items || (self.items > 0 && self.bytes + size > limit.bytes) {
            return false;
        }
        self.items += 1;
        self.bytes += size;
        true
    }
}

fn push_tail(state: &mut Sequencer, change: Change) {
    let size = change.value.as_ref().map_or(0, |v| v.len()) + change.key.len();
    let limit = state.tail_limit;
    if size > limit.bytes {
        // Too large to keep: the tail restarts after it, readers of it go to disk.
        state.tail.clear();
        state.tail_bytes = 0;
        state.tail_from = change.seqno;
        return;
    }
    state.tail_bytes += size;
    state.tail.push_back(change);
    while state.tail.len() > limit.items || state.tail_bytes > limit.bytes {
        match state.tail.pop_front() {
            Some(old) => {
                state.tail_bytes -= old.value.as_ref().map_or(0, |v| v.len()) + old.key.len();
                state.tail_from = old.seqno;
            }
            None => break,
        }
    }
}

fn fail_pending(results: &mut [Result<MutationOutcome, WriteError>], err: &WriteError) {
    for r in results.iter_mut().filter(|r| r.is_ok()) {
        *r = Err(err.duplicate());
    }
}

fn is_live(meta: &DocMeta, now_secs: u64) -> bool {
    !meta.deleted && (meta.expiry == 0 || u64::from(meta.expiry) > now_secs)
}

/// Keys are 1 to 250 bytes; UTF-8 is checked by the caller's type (`&str`) at the API edge.
pub fn validate_key(key: &[u8]) -> Result<(), &'static str> {
    if key.is_empty() {
        return Err("key is empty");
    }
    if key.len() > KEY_MAX_BYTES {
        return Err("key is longer than 250 bytes");
    }
    Ok(())
}
