//! The node's indexes: definitions, maintainers (one per collection with indexes, running
//! rounds on the shared worker pool), and scans.
//!
//! Everything in the index database can be rebuilt from the documents, so damage to it is
//! contained rather than fatal. Definitions live in the store's catalog (the index database
//! keeps only entries, back entries, cursors and build positions). A database that cannot
//! be opened or read at start is moved aside to `index.quarantined-<unix seconds>` and every
//! index is built again in a fresh one; an index whose storage fails a check at run time (a
//! scan or a maintainer round meets a checksum error) is replaced by a new index of the same
//! definition, built like a new one, while the others go on.

mod catalog;
mod ddl;
mod fed;
mod layout;
mod maintain;
mod moves;
mod read;
mod stream;

use catalog::*;
use ddl::is_damage;
pub use fed::{ChangeFetcher, FetchFuture};
use layout::*;
use maintain::*;
pub use moves::PartImports;
pub use read::IndexCursor;
use stream::*;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use shoal_storage::{Collection, PartitionId, SeqNo, Store, StreamPosition};
use tokio::sync::{watch, Notify};

use crate::def::{Compiled, IndexDef};
use crate::IndexError;

const INDEX_DIR: &str = "index";
/// A damaged index database is moved aside to `index` + this + its Unix time in seconds.
const QUARANTINE_SUFFIX: &str = ".quarantined-";
const META_KEYSPACE: &str = "meta";
const NEXT_ID_KEY: &[u8] = b"next_index_id";
/// Definitions in the index database's meta keyspace, as nodes before the catalog kept
/// them; copied to the catalog at open (see [`open_database`]).
const LEGACY_DEF_PREFIX: &[u8] = b"def/";
/// Catalog keys (in the store) of the definitions: `index/{collection id:08x}/{name}`.
const CATALOG_PREFIX: &str = "index/";
/// Counts indexes rebuilt because their storage was found damaged.
const REBUILDS_METRIC: &str = "shoal_index_rebuilds_total";
/// How long a rebuild that failed (the store refusing writes, say) waits to try again.
const REBUILD_RETRY: Duration = Duration::from_secs(5);
/// How long a clean stop waits for the index keyspaces to be flushed into tables.
const CLOSE_FLUSH_WAIT: Duration = Duration::from_secs(30);
/// Memtable of each index partition's keyspace, as the storage crate's indexes.
const INDEX_MEMTABLE_MAX_BYTES: u64 = 16 * 1024 * 1024;
/// Most bytes the index database's active memtables hold together before the largest are
/// flushed ([`IndexManager::bound_memtables`]). One part's memtable flushes by itself only
/// at [`INDEX_MEMTABLE_MAX_BYTES`], and the engine bounds its journal only when some
/// memtable flushes: a node holding hundreds of small parts otherwise keeps every entry in
/// memory and in the journal (measured: 600 MB of memtables and 1.4 GB of journal for
/// 100,000 documents in 100 indexes of 8 parts).
pub const INDEX_MEMTABLES_MAX_BYTES: u64 = 128 * 1024 * 1024;
/// Most bytes of index memtables (active, and sealed ones not flushed yet) a node holds
/// before index writes wait for the flushes ([`IndexManager::wait_for_flushes`]). Building
/// many indexes writes entries faster than hundreds of small memtables flush: without the
/// wait, 200,000 documents into 100 indexes of 8 parts left 4.7 GB unflushed and the node
/// at 9.2 GB resident, growing with the documents
/// (`bench/results/2026-12-05-issue41-index-writes-wait-for-flushes.md`).
pub const INDEX_WRITE_BUFFER_MAX_BYTES: u64 = 512 * 1024 * 1024;
/// Longest one write batch waits for the flushes: a flush that cannot catch up (a disk
/// failing slowly) must not stop indexing for good; it goes on, and says so.
const FLUSH_WAIT_MAX: Duration = Duration::from_secs(60);
/// How often a write batch waiting for the flushes looks again.
const FLUSH_WAIT_POLL: Duration = Duration::from_millis(5);
/// Block cache of the index database.
const INDEX_CACHE_BYTES: u64 = 64 * 1024 * 1024;
/// Parts from which an index keeps where each document's entries are (see
/// [`Index::locates`]).
const LOCATE_PARTS_MIN: u16 = 3;
/// How long an idle maintainer sleeps before looking again without being woken.
const IDLE_POLL: Duration = Duration::from_secs(1);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexState {
    Deferred,
    Building,
    Ready,
}

impl IndexState {
    pub fn as_str(self) -> &'static str {
        match self {
            IndexState::Deferred => "deferred",
            IndexState::Building => "building",
            IndexState::Ready => "ready",
        }
    }
}

/// What `GET .../indexes` shows of one index.
#[derive(Clone, Debug)]
pub struct IndexStatus {
    pub def: IndexDef,
    pub state: IndexState,
    pub progress: f64,
    pub items: u64,
    /// Entries per index partition held here: (part, entries).
    pub part_items: Vec<(u16, u64)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Consistency {
    NotBounded,
    RequestPlus,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum ScanBounds {
    All,
    /// A prefix of the keys, each equal.
    Eq(Vec<Value>),
    /// Bounds compare on their own length (a prefix of the keys); `None` is open.
    Range {
        low: Option<Vec<Value>>,
        high: Option<Vec<Value>>,
        inclusive_low: bool,
        inclusive_high: bool,
    },
}

#[derive(Clone, Debug)]
pub struct ScanRequest {
    pub bounds: ScanBounds,
    pub limit: usize,
    pub descending: bool,
    pub consistency: Consistency,
    /// How long `request_plus` may wait for the index to catch up.
    pub timeout: Duration,
    /// Only rows whose document key passes (a cluster member answers for the partitions
    /// it holds active, not the replicas it also indexes); rows left out do not count
    /// towards `limit`.
    pub keep: Option<KeepRow>,
    /// Only these index partitions (a scan routed by the index service reads the parts
    /// each node holds); `None` reads every part the bounds need. A part the bounds need
    /// that this node does not hold refuses the scan.
    pub parts: Option<Vec<u16>>,
}

/// A test of a row's document key (see [`ScanRequest::keep`]).
#[derive(Clone)]
pub struct KeepRow(pub std::sync::Arc<dyn Fn(&str) -> bool + Send + Sync>);

impl std::fmt::Debug for KeepRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeepRow")
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct ScanRow {
    pub key: Vec<Value>,
    pub id: String,
}

/// A definition as stored in the store's catalog (and, before the catalog, in the index
/// database's meta keyspace: the same JSON). `id` names the index's keyspaces and cursors
/// in the index database; a rebuild gives the definition a new one.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Record {
    id: u32,
    collection_id: u32,
    collection: String,
    def: IndexDef,
    /// The index partitions this node holds, when not every one (the index service places
    /// them on index nodes: `shoal_meta::IndexDef::placement`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    held: Option<Vec<u16>>,
    /// Held parts adopted from another node whose documents the `located` records may not
    /// name: every change looks in them (see [`Index::unlocated`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    unlocated: Vec<u16>,
}

impl Record {
    /// The index partitions held here, in part order.
    fn held_parts(&self) -> Vec<u16> {
        held_parts(self.held.as_deref(), self.def.part_count())
    }

    fn catalog_key(&self) -> String {
        catalog_key(self.collection_id, &self.def.name)
    }

    fn encode(&self) -> Result<Vec<u8>, IndexError> {
        serde_json::to_vec(self).map_err(|e| IndexError::Invalid(format!("index definition: {e}")))
    }
}

/// Parts `held` of an index of `part_count` parts (every one for `None`), in part order,
/// each once; parts beyond the count are left out.
fn held_parts(held: Option<&[u16]>, part_count: u16) -> Vec<u16> {
    match held {
        None => (0..part_count).collect(),
        Some(held) => {
            let mut out: Vec<u16> = held.iter().copied().filter(|&no| no < part_count).collect();
            out.sort_unstable();
            out.dedup();
            out
        }
    }
}

fn catalog_key(collection_id: u32, name: &str) -> String {
    format!("{CATALOG_PREFIX}{collection_id:08x}/{name}")
}

/// One partition of an index on this node (see [`layout`]): its own keyspace, with the
/// positions up to which it has applied each data partition's change stream.
struct Part {
    /// Which part of the index (`0..partitions`).
    no: u16,
    ks: fjall::Keyspace,
    /// Per data partition: how far this part has applied the change stream.
    cursors: Mutex<Vec<StreamPosition>>,
    /// Per data partition: the cursor stored in the part's keyspace (at or behind
    /// `cursors`). Changes between the two added or removed no entry of this part, so its
    /// entries are those of the stored cursor too: re-applied after a restart or from an
    /// exported copy they change nothing, and a rollback to a point at or past the stored
    /// cursor lost nothing this part holds (see `stream::apply`).
    stored: Mutex<Vec<StreamPosition>>,
    /// Per data partition: this part's entries from the partition's documents.
    items: Vec<AtomicI64>,
    /// `false` while a part added empty is rebuilt from the streams (see
    /// [`IndexManager::add_part`]): no scan reads it until it has reached the highs of a
    /// fetch. A part loaded or adopted holds a state the index really had, and serves.
    serving: AtomicBool,
}

impl Part {
    fn items(&self) -> i64 {
        self.items.iter().map(|i| i.load(Ordering::Relaxed)).sum()
    }

    /// Whether the part has applied every data partition up to `highs`.
    fn caught_up(&self, highs: &[SeqNo]) -> bool {
        self.cursors.lock().iter().zip(highs).all(|(c, h)| c.seqno >= *h)
    }
}

struct Index {
    id: u32,
    collection_id: u32,
    collection: String,
    def: IndexDef,
    compiled: Compiled,
    /// The index's partitions held here, in part order: every one, or those the index
    /// service placed here ([`Record::held`]). Replaced whole when a part is adopted or
    /// dropped; a reader works on the set it took ([`Index::parts`]).
    parts: parking_lot::RwLock<Parts>,
    /// Whether this node holds a subset of the parts (a scan that needs one it lacks is
    /// refused, never answered short), and which.
    held: Mutex<Option<Vec<u16>>>,
    /// Per document: the parts that may hold its entries (see [`layout`]).
    located: fjall::Keyspace,
    /// Held parts adopted as files whose documents the `located` records may not name
    /// (see [`IndexManager::import_part`]): a change looks for a document's old entries in
    /// each of them too, as in every part of an index with few parts. Changed with `parts`,
    /// under its lock.
    unlocated: Mutex<Vec<u16>>,
    deferred: AtomicBool,
    /// Dropped, or replaced by its rebuild: no longer in its collection's set.
    dropped: AtomicBool,
    /// A read of its storage failed a check: it is being replaced by a rebuild (see
    /// [`IndexManager::damaged`]) and is neither maintained nor read meanwhile.
    corrupt: AtomicBool,
    /// High seqnos when the build started; `None` once the index is ready.
    target: Mutex<Option<Vec<SeqNo>>>,
    /// Per data partition: the history (uuid) its stream was last seen on — the active's,
    /// by the last fetch, or this node's copy's. Parts adopted at different times may hold
    /// the same seqno on two histories (one from before a hand-over); the stream is then
    /// followed from the other one, so that it moves every part onto this history (or
    /// rolls them back), never leaving one on a history the active no longer names.
    histories: Mutex<Vec<u64>>,
    /// Bumped whenever cursors move (request_plus waits on it).
    progress: watch::Sender<u64>,
    /// While a build reads the documents in key order (see [`scan_round`]).
    scan: Mutex<Option<ScanState>>,
}

/// The parts of an index held here at one moment, in part order.
#[derive(Clone, Default)]
struct Parts(Arc<[Arc<Part>]>);

impl std::ops::Deref for Parts {
    type Target = [Arc<Part>];

    fn deref(&self) -> &[Arc<Part>] {
        &self.0
    }
}

impl Parts {
    fn new(mut parts: Vec<Arc<Part>>) -> Parts {
        parts.sort_by_key(|p| p.no);
        Parts(parts.into())
    }

    /// Where part `no` is (held in part order), if held.
    fn slot(&self, no: u16) -> Option<usize> {
        debug_assert!(self.0.windows(2).all(|w| w[0].no < w[1].no), "parts are held in part order");
        self.0.binary_search_by_key(&no, |p| p.no).ok()
    }

    fn part(&self, no: u16) -> Option<&Arc<Part>> {
        self.slot(no).map(|slot| &self.0[slot])
    }
}

impl Index {
    /// The parts held here now.
    fn parts(&self) -> Parts {
        self.parts.read().clone()
    }

    /// Whether the index service placed this index (this node holds the parts placement
    /// names here, fed from the partitions' actives wherever they are), rather than every
    /// part of the partitions this node holds.
    fn placed(&self) -> bool {
        self.held.lock().is_some()
    }

    fn state(&self) -> IndexState {
        if self.deferred.load(Ordering::Acquire) {
            IndexState::Deferred
        } else if self.corrupt.load(Ordering::Acquire) || self.target.lock().is_some() {
            IndexState::Building
        } else {
            IndexState::Ready
        }
    }

    fn progress_fraction(&self) -> f64 {
        if self.corrupt.load(Ordering::Acquire) {
            return 0.0;
        }
        if let Some(scan) = self.scan.lock().as_ref() {
            // The catch-up after the scan is short; the scan is the build.
            return (scan.scanned as f64 / scan.total.max(1) as f64).min(0.99);
        }
        let Some(target) = self.target.lock().clone() else {
            return if self.deferred.load(Ordering::Acquire) { 0.0 } else { 1.0 };
        };
        let total: u64 = target.iter().sum();
        if total == 0 {
            return 1.0;
        }
        let done: u64 = target.iter().enumerate().map(|(p, t)| self.cursor(p as PartitionId).seqno.min(*t)).sum();
        done as f64 / total as f64
    }

    /// Where following partition `p` goes on from for this index: the lowest of its parts'
    /// cursors, one on another history than the one last seen first (see `histories`).
    fn cursor(&self, p: PartitionId) -> StreamPosition {
        let pi = usize::from(p);
        let seen = self.history(p);
        self.parts()
            .iter()
            .map(|part| part.cursors.lock().get(pi).copied().unwrap_or_default())
            .min_by_key(|c| (c.seqno, c.uuid == seen))
            .unwrap_or_default()
    }

    /// Marks parts rebuilt from the streams (see `add_part`) serving once they have applied
    /// every data partition up to `highs`.
    fn serve_caught_up(&self, highs: &[SeqNo]) {
        let caught_up: Vec<Arc<Part>> =
            self.parts().iter().filter(|p| !p.serving.load(Ordering::Acquire) && p.caught_up(highs)).cloned().collect();
        for part in &caught_up {
            part.serving.store(true, Ordering::Release);
        }
        if !caught_up.is_empty() {
            self.bump();
            tracing::info!(index = %self.def.name, parts = caught_up.len(), "index partitions rebuilt");
        }
    }

    /// The history partition `p`'s stream was last seen on (0: not seen yet).
    fn history(&self, p: PartitionId) -> u64 {
        self.histories.lock().get(usize::from(p)).copied().unwrap_or(0)
    }

    /// Records the histories partitions' streams were seen on: `(partition, uuid)`.
    fn seen(&self, seen: impl Iterator<Item = (PartitionId, u64)>) {
        let mut histories = self.histories.lock();
        for (p, uuid) in seen {
            if let Some(h) = histories.get_mut(usize::from(p)) {
                *h = uuid;
            }
        }
    }

    fn caught_up(&self, highs: &[SeqNo]) -> bool {
        self.parts().iter().all(|part| part.caught_up(highs))
    }

    /// Whether parts `read` have applied every data partition up to `highs`.
    fn caught_up_parts(&self, highs: &[SeqNo], read: &[u16]) -> bool {
        let parts = self.parts();
        read.iter().filter_map(|&no| parts.part(no)).all(|part| part.caught_up(highs))
    }

    /// Whether parts `read` have everything of every data partition at `at` (its seqno, on
    /// its history: see [`StreamPosition::reaches`]).
    fn reaches_parts(&self, at: &[StreamPosition], read: &[u16]) -> bool {
        let parts = self.parts();
        read.iter().filter_map(|&no| parts.part(no)).all(|part| part.cursors.lock().iter().zip(at).all(|(c, a)| c.reaches(*a)))
    }

    /// Per data partition, how far every one of parts `read` has applied its stream (the
    /// part furthest behind), each part's cursors read once.
    fn cursors_of(&self, read: &[u16]) -> Vec<StreamPosition> {
        let mut out: Option<Vec<StreamPosition>> = None;
        let parts = self.parts();
        for part in read.iter().filter_map(|&no| parts.part(no)) {
            let cursors = part.cursors.lock();
            match &mut out {
                None => out = Some(cursors.clone()),
                Some(low) => {
                    for (l, c) in low.iter_mut().zip(cursors.iter()) {
                        if c.seqno < l.seqno {
                            *l = *c;
                        }
                    }
                }
            }
        }
        out.unwrap_or_default()
    }

    /// Whether the index keeps, per document, the parts that may hold its entries: with
    /// fewer than [`LOCATE_PARTS_MIN`] parts, looking in each part costs no more than
    /// reading where to look.
    fn locates(&self) -> bool {
        self.def.part_count() >= LOCATE_PARTS_MIN
    }

    /// Refuses a read of parts this node does not hold: the index service placed them on
    /// other nodes, and reading only the others would answer short.
    fn holds(&self, read: &[u16]) -> Result<(), IndexError> {
        let parts = self.parts();
        match read.iter().find(|&&no| parts.slot(no).is_none()) {
            Some(&no) => Err(self.not_held(no)),
            None => Ok(()),
        }
    }

    /// What a read of part `no`, not held here, answers.
    fn not_held(&self, no: u16) -> IndexError {
        IndexError::Unavailable(format!("index {}: partition {no} is held by other index nodes, not this one", self.def.name))
    }

    /// Refuses a read of parts still rebuilt from the streams (see [`Part::serving`]),
    /// unless it waits for them to catch up (`request_plus`).
    fn serving(&self, read: &[u16]) -> Result<(), IndexError> {
        let parts = self.parts();
        match read.iter().filter_map(|&no| parts.part(no)).find(|p| !p.serving.load(Ordering::Acquire)) {
            None => Ok(()),
            Some(part) => {
                Err(IndexError::NotReady { name: format!("{} partition {}", self.def.name, part.no), state: "building", progress: 0.0 })
            }
        }
    }

    fn status(&self) -> IndexStatus {
        let part_items: Vec<(u16, u64)> = self.parts().iter().map(|p| (p.no, p.items().max(0) as u64)).collect();
        let items = part_items.iter().map(|(_, n)| n).sum();
        IndexStatus { def: self.def.clone(), state: self.state(), progress: self.progress_fraction(), items, part_items }
    }

    /// The definition as the catalog holds it now.
    fn record(&self) -> Record {
        Record {
            id: self.id,
            collection_id: self.collection_id,
            collection: self.collection.clone(),
            def: IndexDef { defer_build: self.deferred.load(Ordering::Acquire), ..self.def.clone() },
            held: self.held.lock().clone(),
            unlocated: self.unlocated.lock().clone(),
        }
    }

    fn catalog_key(&self) -> String {
        catalog_key(self.collection_id, &self.def.name)
    }

    /// Wakes everyone waiting on the index (`request_plus` scans look again).
    fn bump(&self) {
        self.progress.send_modify(|v| *v += 1);
    }
}

/// The high seqnos a new (or newly started) index must reach to be ready: this node's
/// partitions' now, or, for indexes fed from elsewhere, the highs of the first fetch (empty
/// until then).
/// An empty target is set by the first round that runs: the highs of a fed round's first
/// whole fetch, or this node's highs for a round on its own partitions (a placed index whose
/// partitions are all active here).
fn build_target(fed: bool, coll: &Collection) -> Vec<SeqNo> {
    if fed {
        Vec::new()
    } else {
        coll.held_high_seqnos()
    }
}

/// The indexes of one collection and its maintainer's controls.
struct CollEntry {
    indexes: Vec<Arc<Index>>,
    wake: Arc<Notify>,
    /// Told when parts adopted from another node's files join: a fed round waiting on the
    /// actives for news stops waiting, and the next round fetches what the new parts lack
    /// (their adoption waits for that).
    adopted: Arc<Notify>,
    /// Held by a maintainer round; taken by drops before deleting keyspaces.
    round: Arc<Mutex<()>>,
}

pub struct IndexManager {
    store: Arc<Store>,
    /// How the maintainers are doing, for `/v1/health`; damaged index storage is reported
    /// here too.
    pub health: shoal_storage::TaskHealth,
    db: fjall::Database,
    meta: fjall::Keyspace,
    pool: Arc<rayon::ThreadPool>,
    colls: Mutex<HashMap<u32, CollEntry>>,
    /// Serialises create/drop/build/rebuild (each is rare and touches meta and keyspaces).
    ddl: tokio::sync::Mutex<()>,
    /// The next index id (never below any id in the catalog or the index database).
    next_id: Mutex<u32>,
    /// Indexes rebuilt because their storage was found damaged, since the node started.
    rebuilds: AtomicU64,
    /// Where rebuilds run: damage is met on pool threads, outside the runtime.
    runtime: tokio::runtime::Handle,
    /// This manager, for the rebuilds it starts from `&self`.
    me: Weak<IndexManager>,
    /// Becomes `true` when the maintainers must end (see [`IndexManager::stop`]).
    stop: tokio::sync::watch::Sender<bool>,
    /// The maintainer tasks, awaited by [`IndexManager::stop`].
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// Where the indexes take their changes from when not from this node's partitions (see
    /// [`fed`]).
    fetcher: Option<Arc<dyn ChangeFetcher>>,
    /// [`INDEX_WRITE_BUFFER_MAX_BYTES`] unless a test set another.
    write_buffer_max: AtomicU64,
}

impl IndexManager {
    /// Opens (or creates) the index database under the store's first data path, loads the
    /// definitions from the store's catalog and resumes their maintainers. Call from within
    /// a tokio runtime.
    ///
    /// A database that cannot be opened or read because its files are damaged is moved
    /// aside (see [`quarantine`]) and a fresh one is built from the definitions: the node
    /// starts and serves documents while the indexes build.
    pub fn open(store: Arc<Store>, workers: usize) -> Result<Arc<IndexManager>, IndexError> {
        IndexManager::open_with(store, workers, None)
    }

    /// [`IndexManager::open`] for indexes fed by `fetcher` from the partitions' actives
    /// wherever they live, rather than from this node's partitions (see [`fed`]).
    pub fn open_fed(store: Arc<Store>, workers: usize, fetcher: Arc<dyn ChangeFetcher>) -> Result<Arc<IndexManager>, IndexError> {
        IndexManager::open_with(store, workers, Some(fetcher))
    }

    fn open_with(store: Arc<Store>, workers: usize, fetcher: Option<Arc<dyn ChangeFetcher>>) -> Result<Arc<IndexManager>, IndexError> {
        let path = store.data_paths().first().cloned().ok_or_else(|| IndexError::Invalid("no data path".into()))?.join(INDEX_DIR);
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|e| IndexError::Invalid(format!("the index manager needs a tokio runtime: {e}")))?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(workers.max(1))
            .thread_name(|i| format!("shoal-index-{i}"))
            .start_handler(|_| shoal_storage::threads::lower_this_thread(crate::INDEX_WORKER_NICE))
            .build()
            .map_err(|e| IndexError::Invalid(format!("index worker pool: {e}")))?;
        let health = shoal_storage::TaskHealth::default();
        let fed = fetcher.is_some();
        let target = |coll: &Collection, placed: bool| build_target(fed && placed, coll);
        let (opened, rebuilds) = match open_database(&store, &path, &target) {
            Ok(opened) => (opened, 0),
            Err(e) if damaged_at_open(&e) => {
                let moved = quarantine(&path)?;
                tracing::warn!(
                    reason = %e,
                    moved_to = %moved.display(),
                    "the index database is damaged: moved it aside; every index is rebuilt from the documents"
                );
                let opened = open_database(&store, &path, &target)?;
                let n = opened.indexes.len();
                health.round_failed(&format!(
                    "the index database was damaged ({e}); moved to {} and rebuilding {n} indexes",
                    moved.display()
                ));
                (opened, n as u64)
            }
            Err(e) => return Err(e),
        };
        let Opened { db, meta, indexes, next_id, rebuilt } = opened;
        for what in &rebuilt {
            health.round_failed(&format!("{what}: its storage failed a check at start; rebuilding it"));
        }
        let rebuilds = rebuilds + rebuilt.len() as u64;
        let mgr = Arc::new_cyclic(|me| IndexManager {
            store,
            health,
            db,
            meta,
            pool: Arc::new(pool),
            colls: Mutex::new(HashMap::new()),
            ddl: tokio::sync::Mutex::new(()),
            next_id: Mutex::new(next_id),
            rebuilds: AtomicU64::new(rebuilds),
            runtime,
            me: me.clone(),
            stop: tokio::sync::watch::Sender::new(false),
            tasks: Mutex::new(Vec::new()),
            fetcher,
            write_buffer_max: AtomicU64::new(INDEX_WRITE_BUFFER_MAX_BYTES),
        });
        for (coll, index) in indexes {
            mgr.attach(&coll, index);
        }
        Ok(mgr)
    }

    /// Flushes the index database to disk. At a clean stop the keyspaces' memtables are
    /// written into tables first: the next start then has no journal to replay, and every
    /// entry sits in checksummed table files.
    /// Ends the maintainers and waits for them (a round in flight finishes first), so that
    /// nothing holds the store once the manager is dropped: an engine can be closed and
    /// opened again in one process. Indexes are not maintained afterwards; call [`close`].
    ///
    /// [`close`]: IndexManager::close
    pub async fn stop(&self) {
        // `send_replace`: stored even when no maintainer is listening yet.
        self.stop.send_replace(true);
        let tasks = std::mem::take(&mut *self.tasks.lock());
        for t in tasks {
            let _ = t.await;
        }
    }

    /// Syncs the index database's journal, and nothing more: what a crash right after the
    /// journal's last sync leaves (cursors stored behind stay behind). For tests of restarts.
    pub fn sync_journal(&self) -> Result<(), IndexError> {
        self.db.persist(fjall::PersistMode::SyncAll)?;
        Ok(())
    }

    /// Flushes every keyspace of the index database and seals its journal, so that the next
    /// start replays none of it.
    pub fn close(&self) -> Result<(), IndexError> {
        // Every cursor as far as its part applied: the next start goes on from there.
        let indexes: Vec<Arc<Index>> = self.colls.lock().values().flat_map(|e| e.indexes.iter().cloned()).collect();
        for index in &indexes {
            let parts = index.parts();
            self.store_cursors(parts.iter().map(|p| p.as_ref()))?;
        }
        if !self.db.flush_and_seal_journal(CLOSE_FLUSH_WAIT)? {
            // The journal below still holds everything; the next start replays it.
            tracing::warn!("the index keyspaces were not flushed in time; the next start replays the journal");
        }
        self.db.persist(fjall::PersistMode::SyncAll)?;
        Ok(())
    }

    /// The fetcher `index` is fed by: placed indexes follow the partitions' actives
    /// wherever they are (see [`fed`]); others, this node's partitions.
    fn fed_by(&self, index: &Index) -> Option<&Arc<dyn ChangeFetcher>> {
        self.fetcher.as_ref().filter(|_| index.placed())
    }

    /// The high seqnos a new (or newly started) index must reach to be ready; `placed`:
    /// whether the index service placed it.
    fn build_target(&self, coll: &Collection, placed: bool) -> Vec<SeqNo> {
        build_target(self.fetcher.is_some() && placed, coll)
    }

    /// Indexes rebuilt because their storage was found damaged, since the node started.
    pub fn rebuilds(&self) -> u64 {
        self.rebuilds.load(Ordering::Relaxed)
    }

    /// Adds `index` to its collection's set, starting the collection's maintainer if needed.
    fn attach(self: &Arc<Self>, coll: &Arc<Collection>, index: Arc<Index>) {
        let mut colls = self.colls.lock();
        match colls.get_mut(&coll.id()) {
            Some(entry) => {
                entry.indexes.push(index);
                entry.wake.notify_one();
            }
            None => {
                let (wake, adopted) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
                let round = Arc::new(Mutex::new(()));
                colls.insert(
                    coll.id(),
                    CollEntry { indexes: vec![index], wake: Arc::clone(&wake), adopted: Arc::clone(&adopted), round: Arc::clone(&round) },
                );
                let signals = Signals { wake, adopted };
                let task = tokio::spawn(maintain(Arc::clone(self), Arc::clone(coll), signals, round, self.stop.subscribe()));
                let mut tasks = self.tasks.lock();
                tasks.retain(|t| !t.is_finished());
                tasks.push(task);
            }
        }
    }

    fn find(&self, coll: &Collection, name: &str) -> Result<Arc<Index>, IndexError> {
        self.colls
            .lock()
            .get(&coll.id())
            .and_then(|e| e.indexes.iter().find(|i| i.def.name == name).cloned())
            .ok_or_else(|| IndexError::NotFound(name.to_string()))
    }

    /// The collection's indexes that are maintained: not deferred, not set aside as damaged
    /// (`None` once the collection has no entry).
    fn active(&self, collection_id: u32) -> Option<Vec<Arc<Index>>> {
        // An index holding no part here (placed on other index nodes) has nothing to follow.
        self.colls.lock().get(&collection_id).map(|e| {
            e.indexes
                .iter()
                .filter(|i| !i.deferred.load(Ordering::Acquire) && !i.corrupt.load(Ordering::Acquire) && !i.parts().is_empty())
                .cloned()
                .collect()
        })
    }
}
