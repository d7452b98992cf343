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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use shoal_storage::{Change, Collection, PartitionId, SeqNo, Store, StreamPosition};
use tokio::sync::{watch, Notify};

use crate::def::{Compiled, IndexDef};
use crate::{
    keycode, IndexError, BATCH_CHANGES, GROUP_CHANGES, PART_BATCH_MIN, ROUND_CHANGES_MAX, SCAN_BATCH_DOCS, SCAN_ROUND_DOCS, SCAN_ROWS_MAX,
};

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
const CLOSE_FLUSH_POLL: Duration = Duration::from_millis(10);
/// Memtable of each index keyspace (forward and back), as the storage crate's indexes.
const INDEX_MEMTABLE_MAX_BYTES: u64 = 16 * 1024 * 1024;
/// Block cache of the index database.
const INDEX_CACHE_BYTES: u64 = 64 * 1024 * 1024;
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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Consistency {
    NotBounded,
    RequestPlus,
}

#[derive(Clone, Debug)]
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
}

impl Record {
    fn catalog_key(&self) -> String {
        catalog_key(self.collection_id, &self.def.name)
    }

    fn encode(&self) -> Result<Vec<u8>, IndexError> {
        serde_json::to_vec(self).map_err(|e| IndexError::Invalid(format!("index definition: {e}")))
    }
}

fn catalog_key(collection_id: u32, name: &str) -> String {
    format!("{CATALOG_PREFIX}{collection_id:08x}/{name}")
}

struct Index {
    id: u32,
    collection_id: u32,
    collection: String,
    def: IndexDef,
    compiled: Compiled,
    fwd: fjall::Keyspace,
    back: fjall::Keyspace,
    deferred: AtomicBool,
    /// Dropped, or replaced by its rebuild: no longer in its collection's set.
    dropped: AtomicBool,
    /// A read of its storage failed a check: it is being replaced by a rebuild (see
    /// [`IndexManager::damaged`]) and is neither maintained nor read meanwhile.
    corrupt: AtomicBool,
    /// Per partition: how far the index has applied the change stream.
    cursors: Mutex<Vec<StreamPosition>>,
    /// Per partition: entries contributed by the partition's documents.
    items: Vec<AtomicI64>,
    /// High seqnos when the build started; `None` once the index is ready.
    target: Mutex<Option<Vec<SeqNo>>>,
    /// Bumped whenever cursors move (request_plus waits on it).
    progress: watch::Sender<u64>,
    /// While a build reads the documents in key order (see [`scan_round`]).
    scan: Mutex<Option<ScanState>>,
}

impl Index {
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
        let cursors = self.cursors.lock();
        let total: u64 = target.iter().sum();
        if total == 0 {
            return 1.0;
        }
        let done: u64 = target.iter().zip(cursors.iter()).map(|(t, c)| c.seqno.min(*t)).sum();
        done as f64 / total as f64
    }

    fn caught_up(&self, highs: &[SeqNo]) -> bool {
        self.cursors.lock().iter().zip(highs).all(|(c, h)| c.seqno >= *h)
    }

    fn status(&self) -> IndexStatus {
        let items = self.items.iter().map(|i| i.load(Ordering::Relaxed)).sum::<i64>().max(0) as u64;
        IndexStatus { def: self.def.clone(), state: self.state(), progress: self.progress_fraction(), items }
    }

    /// The definition as the catalog holds it now.
    fn record(&self) -> Record {
        Record {
            id: self.id,
            collection_id: self.collection_id,
            collection: self.collection.clone(),
            def: IndexDef { defer_build: self.deferred.load(Ordering::Acquire), ..self.def.clone() },
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

/// The indexes of one collection and its maintainer's controls.
struct CollEntry {
    indexes: Vec<Arc<Index>>,
    wake: Arc<Notify>,
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
}

fn legacy_def_key(id: u32) -> Vec<u8> {
    format!("def/{id:08x}").into_bytes()
}

fn cursor_key(id: u32, p: PartitionId) -> Vec<u8> {
    format!("cur/{id:08x}/{p:04x}").into_bytes()
}

fn scan_key(id: u32) -> Vec<u8> {
    format!("scan/{id:08x}").into_bytes()
}

/// A build's read of the documents in key order: the change-stream positions taken before
/// it began (where the index goes on from once it is done), and how far it got.
#[derive(Clone, Debug)]
struct ScanState {
    start: Vec<StreamPosition>,
    after: Option<bytes::Bytes>,
    scanned: u64,
    total: u64,
}

#[derive(Serialize, Deserialize)]
struct ScanRecord {
    start: Vec<(SeqNo, u64)>,
    after: Option<Vec<u8>>,
    scanned: u64,
    total: u64,
}

impl ScanState {
    fn encode(&self) -> Vec<u8> {
        let record = ScanRecord {
            start: self.start.iter().map(|p| (p.seqno, p.uuid)).collect(),
            after: self.after.as_ref().map(|a| a.to_vec()),
            scanned: self.scanned,
            total: self.total,
        };
        // Serialising this plain record cannot fail.
        serde_json::to_vec(&record).unwrap_or_default()
    }

    fn decode(v: &[u8], partitions: usize) -> Result<ScanState, IndexError> {
        let r: ScanRecord = serde_json::from_slice(v).map_err(|e| IndexError::Corrupt(format!("build scan record: {e}")))?;
        if r.start.len() != partitions {
            return Err(IndexError::Corrupt("build scan record: partition count".into()));
        }
        Ok(ScanState {
            start: r.start.into_iter().map(|(seqno, uuid)| StreamPosition { seqno, uuid }).collect(),
            after: r.after.map(bytes::Bytes::from),
            scanned: r.scanned,
            total: r.total,
        })
    }
}

fn encode_cursor(pos: StreamPosition, items: i64) -> [u8; 24] {
    let mut out = [0u8; 24];
    out[..8].copy_from_slice(&pos.seqno.to_be_bytes());
    out[8..16].copy_from_slice(&pos.uuid.to_be_bytes());
    out[16..].copy_from_slice(&items.to_be_bytes());
    out
}

fn decode_cursor(v: &[u8]) -> Option<(StreamPosition, i64)> {
    let seqno = u64::from_be_bytes(v.get(..8)?.try_into().ok()?);
    let uuid = u64::from_be_bytes(v.get(8..16)?.try_into().ok()?);
    let items = i64::from_be_bytes(v.get(16..24)?.try_into().ok()?);
    Some((StreamPosition { seqno, uuid }, items))
}

/// The back-index value: the composite keys a document contributed, each length-prefixed.
fn encode_list(entries: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(entries.iter().map(|e| e.len() + 2).sum());
    for e in entries {
        out.extend_from_slice(&(e.len() as u16).to_be_bytes());
        out.extend_from_slice(e);
    }
    out
}

fn decode_list(mut v: &[u8]) -> Result<Vec<Vec<u8>>, IndexError> {
    let mut out = Vec::new();
    while !v.is_empty() {
        let len =
            v.get(..2).map(|b| usize::from(u16::from_be_bytes([b[0], b[1]]))).ok_or_else(|| IndexError::Corrupt("back entry".into()))?;
        let e = v.get(2..2 + len).ok_or_else(|| IndexError::Corrupt("back entry".into()))?;
        out.push(e.to_vec());
        v = &v[2 + len..];
    }
    Ok(out)
}

fn entry_key(prefix: &[u8], doc_key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(prefix.len() + doc_key.len());
    k.extend_from_slice(prefix);
    k.extend_from_slice(doc_key);
    k
}

/// What [`open_database`] found: the database and the indexes to attach.
struct Opened {
    db: fjall::Database,
    meta: fjall::Keyspace,
    indexes: Vec<(Arc<Collection>, Arc<Index>)>,
    next_id: u32,
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
        let path = store.data_paths().first().cloned().ok_or_else(|| IndexError::Invalid("no data path".into()))?.join(INDEX_DIR);
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|e| IndexError::Invalid(format!("the index manager needs a tokio runtime: {e}")))?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(workers.max(1))
            .thread_name(|i| format!("shoal-index-{i}"))
            .build()
            .map_err(|e| IndexError::Invalid(format!("index worker pool: {e}")))?;
        let health = shoal_storage::TaskHealth::default();
        let (opened, rebuilds) = match open_database(&store, &path) {
            Ok(opened) => (opened, 0),
            Err(e) if damaged_at_open(&e) => {
                let moved = quarantine(&path)?;
                tracing::warn!(
                    reason = %e,
                    moved_to = %moved.display(),
                    "the index database is damaged: moved it aside; every index is rebuilt from the documents"
                );
                let opened = open_database(&store, &path)?;
                let n = opened.indexes.len();
                health.round_failed(&format!(
                    "the index database was damaged ({e}); moved to {} and rebuilding {n} indexes",
                    moved.display()
                ));
                (opened, n as u64)
            }
            Err(e) => return Err(e),
        };
        let Opened { db, meta, indexes, next_id } = opened;
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
        });
        for (coll, index) in indexes {
            mgr.attach(&coll, index);
        }
        Ok(mgr)
    }

    /// Flushes the index database to disk. At a clean stop the keyspaces' memtables are
    /// written into tables first: the next start then has no journal to replay, and every
    /// entry sits in checksummed table files.
    pub fn close(&self) -> Result<(), IndexError> {
        let mut keyspaces = vec![self.meta.clone()];
        for entry in self.colls.lock().values() {
            for index in entry.indexes.iter().filter(|i| !i.dropped.load(Ordering::Acquire)) {
                keyspaces.push(index.fwd.clone());
                keyspaces.push(index.back.clone());
            }
        }
        for ks in &keyspaces {
            ks.rotate_memtable()?;
        }
        let deadline = std::time::Instant::now() + CLOSE_FLUSH_WAIT;
        while keyspaces.iter().any(|ks| ks.sealed_memtable_count() > 0) {
            if std::time::Instant::now() >= deadline {
                // The journal below still holds everything; the next start replays it.
                tracing::warn!("the index keyspaces were not flushed in time; the next start replays the journal");
                break;
            }
            std::thread::sleep(CLOSE_FLUSH_POLL);
        }
        self.db.persist(fjall::PersistMode::SyncAll)?;
        Ok(())
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
                let wake = Arc::new(Notify::new());
                let round = Arc::new(Mutex::new(()));
                colls.insert(coll.id(), CollEntry { indexes: vec![index], wake: Arc::clone(&wake), round: Arc::clone(&round) });
                tokio::spawn(maintain(Arc::clone(self), Arc::clone(coll), wake, round));
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

    /// The next index id, recorded in the index database (the catalog and the keyspace
    /// names keep it above every id in use even if this write is lost).
    /// With `given`, that id instead (a cluster's metadata log assigns ids): it must be at
    /// least the next free one, which then moves past it — ids are never reused. A rebuild
    /// takes a fresh id from this counter too; a cluster must keep such local ids apart
    /// from the ones it assigns (issue 13).
    fn allocate_id(&self, given: Option<u32>) -> Result<u32, IndexError> {
        let mut next = self.next_id.lock();
        let id = match given {
            None => *next,
            Some(id) if id >= *next => id,
            Some(id) => return Err(IndexError::Invalid(format!("index id {id} is taken: ids from {} on are free", *next))),
        };
        let after = id.checked_add(1).ok_or_else(|| IndexError::Invalid("index ids are exhausted".into()))?;
        self.meta.insert(NEXT_ID_KEY, after.to_be_bytes())?;
        *next = after;
        Ok(id)
    }

    pub async fn create(self: &Arc<Self>, coll: &Arc<Collection>, def: IndexDef) -> Result<IndexStatus, IndexError> {
        self.create_as(coll, def, None).await
    }

    /// [`IndexManager::create`] with the index id given by the caller (see `allocate_id`).
    pub async fn create_as(self: &Arc<Self>, coll: &Arc<Collection>, def: IndexDef, id: Option<u32>) -> Result<IndexStatus, IndexError> {
        def.compile()?;
        let _ddl = self.ddl.lock().await;
        if self.find(coll, &def.name).is_ok() {
            return Err(IndexError::Exists(def.name));
        }
        let id = self.allocate_id(id)?;
        let record = Record { id, collection_id: coll.id(), collection: coll.name().to_string(), def };
        // Durable in the store's catalog before the answer: the index database holds only
        // what can be rebuilt from the definition and the documents.
        self.store.put_catalog(&record.catalog_key(), &record.encode()?)?;
        let index = load(&self.db, &self.meta, &record, coll)?;
        let status = index.status();
        self.attach(coll, index);
        Ok(status)
    }

    pub fn list(&self, coll: &Collection) -> Vec<IndexStatus> {
        let colls = self.colls.lock();
        let mut out: Vec<IndexStatus> = colls.get(&coll.id()).map(|e| e.indexes.iter().map(|i| i.status()).collect()).unwrap_or_default();
        out.sort_by(|a, b| a.def.name.cmp(&b.def.name));
        out
    }

    /// Starts building a deferred index (a no-op for one already building or ready).
    pub async fn build(&self, coll: &Collection, name: &str) -> Result<IndexStatus, IndexError> {
        Ok(self.build_many(coll, &[name.to_string()]).await?.remove(0))
    }

    /// Starts building several deferred indexes together: the maintainer's next round
    /// finds them all at the same position and feeds them from one read of the documents.
    pub async fn build_many(&self, coll: &Collection, names: &[String]) -> Result<Vec<IndexStatus>, IndexError> {
        let _ddl = self.ddl.lock().await;
        let indexes = names.iter().map(|n| self.find(coll, n)).collect::<Result<Vec<_>, _>>()?;
        if indexes.is_empty() {
            return Err(IndexError::Invalid("no index names given".into()));
        }
        for index in &indexes {
            self.persist_built(index)?;
        }
        {
            // Flipped under the lock that `active()` takes: the maintainer's next round
            // sees all of them or none.
            let colls = self.colls.lock();
            let highs = coll.high_seqnos();
            for index in &indexes {
                if index.deferred.load(Ordering::Acquire) {
                    *index.target.lock() = Some(highs.clone());
                    index.deferred.store(false, Ordering::Release);
                }
            }
            if let Some(e) = colls.get(&coll.id()) {
                e.wake.notify_one();
            }
        }
        Ok(indexes.iter().map(|i| i.status()).collect())
    }

    /// Records that a deferred index is to be built (so a restart keeps building it).
    fn persist_built(&self, index: &Index) -> Result<(), IndexError> {
        if index.deferred.load(Ordering::Acquire) {
            let mut record = index.record();
            record.def.defer_build = false;
            self.store.put_catalog(&record.catalog_key(), &record.encode()?)?;
        }
        Ok(())
    }

    pub async fn drop_index(&self, coll: &Collection, name: &str) -> Result<(), IndexError> {
        let _ddl = self.ddl.lock().await;
        let (index, round) = {
            let mut colls = self.colls.lock();
            let entry = colls.get_mut(&coll.id()).ok_or_else(|| IndexError::NotFound(name.to_string()))?;
            let pos = entry.indexes.iter().position(|i| i.def.name == name).ok_or_else(|| IndexError::NotFound(name.to_string()))?;
            let index = entry.indexes.remove(pos);
            index.dropped.store(true, Ordering::Release);
            index.bump();
            entry.wake.notify_one();
            (index, Arc::clone(&entry.round))
        };
        self.forget(index, round, Forget::WithDefinition).await
    }

    /// Drops every index of a dropped collection.
    pub async fn drop_collection(&self, collection_id: u32) -> Result<(), IndexError> {
        let _ddl = self.ddl.lock().await;
        let Some(entry) = self.colls.lock().remove(&collection_id) else {
            return Ok(());
        };
        entry.wake.notify_one();
        for index in entry.indexes {
            index.dropped.store(true, Ordering::Release);
            index.bump();
            self.forget(index, Arc::clone(&entry.round), Forget::WithDefinition).await?;
        }
        Ok(())
    }

    /// Deletes a dropped (or replaced) index's storage once no maintainer round uses it.
    async fn forget(&self, index: Arc<Index>, round: Arc<Mutex<()>>, what: Forget) -> Result<(), IndexError> {
        let (id, key) = (index.id, index.catalog_key());
        let (store, db, meta) = (Arc::clone(&self.store), self.db.clone(), self.meta.clone());
        let (fwd, back) = (index.fwd.clone(), index.back.clone());
        drop(index);
        tokio::task::spawn_blocking(move || {
            if what == Forget::WithDefinition {
                // The definition goes first: a crash after it leaves only storage, which the
                // next open removes, never an index that comes back.
                store.delete_catalog(&key)?;
            }
            let _round = round.lock();
            delete_index_storage(&db, &meta, id, Some((fwd, back)))
        })
        .await
        .map_err(|e| IndexError::Invalid(format!("drop task: {e}")))?
    }

    /// Notes that a read of `index`'s storage failed a check, and starts replacing it by a
    /// rebuild (see [`IndexManager::rebuild`]); only the first report of an index acts. The
    /// index is set aside at once: maintainer rounds skip it and scans answer
    /// [`IndexError::Rebuilding`] until its replacement is in place.
    fn damaged(&self, index: &Arc<Index>, error: &IndexError) {
        if index.corrupt.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::error!(
            index = %index.def.name,
            collection = %index.collection,
            %error,
            "index storage failed a check: rebuilding the index from the documents"
        );
        self.health.round_failed(&format!(
            "index {} of collection {}: its storage failed a check ({error}); rebuilding it",
            index.def.name, index.collection
        ));
        let total = self.rebuilds.fetch_add(1, Ordering::Relaxed) + 1;
        metrics::counter!(REBUILDS_METRIC).absolute(total);
        index.bump();
        let Some(mgr) = self.me.upgrade() else { return };
        self.runtime.spawn(mgr.rebuild(Arc::clone(index)));
    }

    /// Passes on the result of a read of `index`'s own storage; damage found there starts
    /// the index's rebuild, and the reader gets [`IndexError::Rebuilding`].
    fn checked<T>(&self, index: &Arc<Index>, result: Result<T, IndexError>) -> Result<T, IndexError> {
        match result {
            Err(e) if is_damage(&e) => {
                self.damaged(index, &e);
                Err(IndexError::Rebuilding { name: index.def.name.clone() })
            }
            other => other,
        }
    }

    /// Replaces the damaged index `old`, retrying until it is done or the index is gone.
    async fn rebuild(self: Arc<Self>, old: Arc<Index>) {
        while let Err(e) = self.replace(&old).await {
            tracing::error!(index = %old.def.name, collection = %old.collection, error = %e, "rebuilding a damaged index failed; retrying");
            self.health.round_failed(&format!("rebuilding index {} of collection {}: {e}", old.def.name, old.collection));
            tokio::time::sleep(REBUILD_RETRY).await;
        }
    }

    /// Puts a new index of `old`'s definition in its place, built from the documents like
    /// a new index: it gets a new id, so new keyspaces (nothing of the damaged files is read
    /// again) and no cursors; the catalog names the new id before the swap, so a restart
    /// builds the new one too; then the damaged index's storage is deleted.
    async fn replace(&self, old: &Arc<Index>) -> Result<(), IndexError> {
        let _ddl = self.ddl.lock().await;
        let coll = self.store.collection(&old.collection).filter(|c| c.id() == old.collection_id);
        let round = coll.as_ref().and_then(|c| {
            let colls = self.colls.lock();
            colls.get(&c.id()).filter(|e| e.indexes.iter().any(|i| Arc::ptr_eq(i, old))).map(|e| Arc::clone(&e.round))
        });
        let (Some(coll), Some(round)) = (coll, round) else {
            // Dropped meanwhile (alone or with its collection): nothing to rebuild.
            return Ok(());
        };
        let record = Record { id: self.allocate_id(None)?, ..old.record() };
        self.store.put_catalog(&record.catalog_key(), &record.encode()?)?;
        let new = load(&self.db, &self.meta, &record, &coll)?;
        {
            let mut colls = self.colls.lock();
            if let Some(entry) = colls.get_mut(&coll.id()) {
                if let Some(slot) = entry.indexes.iter_mut().find(|i| Arc::ptr_eq(i, old)) {
                    *slot = new;
                }
                entry.wake.notify_one();
            }
            old.dropped.store(true, Ordering::Release);
        }
        old.bump();
        tracing::info!(index = %old.def.name, collection = %old.collection, id = record.id, "damaged index replaced; building it from the documents");
        self.forget(Arc::clone(old), round, Forget::StorageOnly).await
    }

    /// Rows of `name` within the request's bounds, in index order.
    pub async fn scan(&self, coll: &Collection, name: &str, req: ScanRequest) -> Result<Vec<ScanRow>, IndexError> {
        if req.limit > SCAN_ROWS_MAX {
            return Err(IndexError::Invalid(format!("limit is at most {SCAN_ROWS_MAX}")));
        }
        let n = self.find(coll, name)?.compiled.key_count();
        let (lo, hi) = byte_bounds(&req.bounds, n)?;
        let index = self.ready(coll, name, req.consistency, req.timeout).await?;
        let (limit, descending) = (req.limit, req.descending);
        let fwd = index.fwd.clone();
        let rows = tokio::task::spawn_blocking(move || read_range(&fwd, lo, hi, limit, descending, n))
            .await
            .map_err(|e| IndexError::Invalid(format!("scan task: {e}")))?;
        self.checked(&index, rows)
    }

    /// A consistent read of every row of `name` within `bounds`, in pages (SQL reads an
    /// index this way: however many rows match, none is left out and none repeats, since
    /// every page reads the same snapshot).
    pub async fn cursor(
        &self,
        coll: &Collection,
        name: &str,
        bounds: &ScanBounds,
        consistency: Consistency,
        timeout: Duration,
    ) -> Result<IndexCursor, IndexError> {
        let n = self.find(coll, name)?.compiled.key_count();
        let (lo, hi) = byte_bounds(bounds, n)?;
        let index = self.ready(coll, name, consistency, timeout).await?;
        let empty = matches!((&lo, &hi), (Bound::Included(l) | Bound::Excluded(l), Bound::Included(h) | Bound::Excluded(h)) if l > h);
        Ok(IndexCursor { snapshot: self.db.snapshot(), fwd: index.fwd.clone(), next: lo, hi, n, done: empty, index, mgr: self.me.clone() })
    }

    /// Waits until index `name` may be read at `consistency`: ready, and for `request_plus`
    /// holding every change made before this call. Returns the index to read: a damaged
    /// index is replaced by its rebuild, which `request_plus` waits for.
    async fn ready(&self, coll: &Collection, name: &str, consistency: Consistency, timeout: Duration) -> Result<Arc<Index>, IndexError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let highs = coll.high_seqnos();
        if consistency == Consistency::RequestPlus {
            if let Some(e) = self.colls.lock().get(&coll.id()) {
                e.wake.notify_one();
            }
        }
        loop {
            let index = self.find(coll, name)?;
            let not_ready =
                |state: &'static str| IndexError::NotReady { name: name.to_string(), state, progress: index.progress_fraction() };
            match (index.state(), consistency) {
                (IndexState::Deferred, _) => return Err(not_ready("deferred")),
                (_, Consistency::NotBounded) if index.corrupt.load(Ordering::Acquire) => {
                    return Err(IndexError::Rebuilding { name: name.to_string() })
                }
                (IndexState::Building, Consistency::NotBounded) => return Err(not_ready("building")),
                (IndexState::Ready, Consistency::NotBounded) => return Ok(index),
                (_, Consistency::RequestPlus) => {
                    // Subscribed before looking, so no change between the look and the wait
                    // is missed.
                    let mut progress = index.progress.subscribe();
                    loop {
                        if index.dropped.load(Ordering::Acquire) {
                            // Dropped (the next look answers `NotFound`) or replaced by its
                            // rebuild (the next look finds the new index).
                            break;
                        }
                        if index.caught_up(&highs) && index.state() == IndexState::Ready {
                            return Ok(index);
                        }
                        match tokio::time::timeout_at(deadline, progress.changed()).await {
                            Err(_) => return Err(IndexError::Timeout),
                            Ok(Err(_)) => return Err(IndexError::NotFound(name.to_string())),
                            Ok(Ok(())) => {}
                        }
                    }
                }
            }
        }
    }

    /// The collection's indexes that are maintained: not deferred, not set aside as damaged
    /// (`None` once the collection has no entry).
    fn active(&self, collection_id: u32) -> Option<Vec<Arc<Index>>> {
        self.colls.lock().get(&collection_id).map(|e| {
            e.indexes.iter().filter(|i| !i.deferred.load(Ordering::Acquire) && !i.corrupt.load(Ordering::Acquire)).cloned().collect()
        })
    }
}

/// What [`IndexManager::forget`] deletes besides the storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Forget {
    /// Dropped: the definition goes too.
    WithDefinition,
    /// Replaced by a rebuild: the catalog already names the new index.
    StorageOnly,
}

/// Whether an error reading an index's own storage means its stored bytes are damaged (a
/// checksum, an entry that does not decode), so that rebuilding the index is the cure.
fn is_damage(e: &IndexError) -> bool {
    match e {
        IndexError::Engine(f) => shoal_storage::is_corruption(f),
        IndexError::Corrupt(_) => true,
        _ => false,
    }
}

/// Whether an error opening or reading the index database at start means its files are
/// damaged, so that moving them aside and rebuilding is the cure. Besides failed checks,
/// that is any engine error but those of the environment (see [`environmental`]): a missing
/// or truncated file of the database's own is damage too.
fn damaged_at_open(e: &IndexError) -> bool {
    match e {
        IndexError::Corrupt(_) => true,
        IndexError::Engine(f) => !environmental(f),
        _ => false,
    }
}

/// An engine error caused by the environment rather than the database's files:
/// permissions, a full or read-only disk, memory, another process holding the database.
/// Moving the files aside would not help, and a fresh database would fail the same way.
fn environmental(e: &fjall::Error) -> bool {
    use std::io::ErrorKind as K;
    let io = match e {
        fjall::Error::Io(io) | fjall::Error::Storage(fjall::LsmError::Io(io)) => io,
        fjall::Error::Locked | fjall::Error::Poisoned => return true,
        _ => return false,
    };
    matches!(
        io.kind(),
        K::PermissionDenied
            | K::StorageFull
            | K::ReadOnlyFilesystem
            | K::QuotaExceeded
            | K::OutOfMemory
            | K::Interrupted
            | K::WouldBlock
            | K::ResourceBusy
            | K::TimedOut
    )
}

/// Moves the index database at `path` aside to `index.quarantined-<unix seconds>` (with a
/// counter if that exists), for inspection; the directory rename is made durable before a
/// fresh database is created in its place.
fn quarantine(path: &Path) -> Result<PathBuf, IndexError> {
    let io = |source: std::io::Error| IndexError::Io { path: path.display().to_string(), source };
    let secs = shoal_storage::unix_now_secs();
    let mut target = path.with_file_name(format!("{INDEX_DIR}{QUARANTINE_SUFFIX}{secs}"));
    let mut n = 1u32;
    while target.exists() {
        target = path.with_file_name(format!("{INDEX_DIR}{QUARANTINE_SUFFIX}{secs}-{n}"));
        n += 1;
    }
    std::fs::rename(path, &target).map_err(io)?;
    if let Some(parent) = path.parent() {
        std::fs::File::open(parent).and_then(|d| d.sync_all()).map_err(io)?;
    }
    Ok(target)
}

/// Opens the fjall database at `path`. The engine asserts some invariants of its files with
/// panics (a configuration entry that must exist, say); a damaged file must not take the
/// node down, so a panic while opening counts as damage.
fn open_fjall(path: &Path) -> Result<fjall::Database, IndexError> {
    std::panic::catch_unwind(|| fjall::Database::builder(path).cache_size(INDEX_CACHE_BYTES).open())
        .map_err(|_| IndexError::Corrupt("the storage engine failed a check opening the index database".into()))?
        .map_err(IndexError::from)
}

/// Reads the definitions in the store's catalog. One that does not decode is left out and
/// logged (its index cannot be served; its storage is removed as an orphan).
fn read_catalog(store: &Store) -> Result<BTreeMap<String, Record>, IndexError> {
    let mut out = BTreeMap::new();
    for (key, value) in store.catalog_prefix(CATALOG_PREFIX)? {
        match serde_json::from_slice::<Record>(&value) {
            Ok(r) if r.catalog_key() == key => {
                out.insert(key, r);
            }
            Ok(r) => tracing::error!(key, index = %r.def.name, "an index definition is stored under another name's key; ignored"),
            Err(e) => tracing::error!(key, error = %e, "an index definition in the catalog does not decode; ignored"),
        }
    }
    Ok(out)
}

/// Opens the index database, copies definitions it holds from before the catalog into the
/// catalog, removes storage no definition owns, and loads every index. Any error here
/// reading the database is for [`damaged_at_open`] to judge.
fn open_database(store: &Store, path: &Path) -> Result<Opened, IndexError> {
    let db = open_fjall(path)?;
    let meta = db.keyspace(META_KEYSPACE, fjall::KeyspaceCreateOptions::default)?;
    let mut records = read_catalog(store)?;
    let mut legacy_ids = Vec::new();
    let mut migrated = true;
    for guard in meta.prefix(LEGACY_DEF_PREFIX) {
        let (_, v) = guard.into_inner()?;
        let r: Record = serde_json::from_slice(&v).map_err(|e| IndexError::Corrupt(format!("index definition: {e}")))?;
        legacy_ids.push(r.id);
        let key = r.catalog_key();
        if records.contains_key(&key) {
            // Copied by an earlier start that stopped before removing the old copy.
            continue;
        }
        match r.encode().and_then(|json| Ok(store.put_catalog(&key, &json)?)) {
            Ok(()) => tracing::info!(index = %r.def.name, collection = %r.collection, "index definition moved to the catalog"),
            Err(e) => {
                // Served from the old copy this time; the next start tries again.
                tracing::warn!(index = %r.def.name, error = %e, "could not copy an index definition to the catalog");
                migrated = false;
            }
        }
        records.insert(key, r);
    }
    let mut indexes = Vec::new();
    let mut live = HashSet::new();
    for r in records.values() {
        match store.collection(&r.collection).filter(|c| c.id() == r.collection_id) {
            Some(coll) => {
                indexes.push((Arc::clone(&coll), load(&db, &meta, r, &coll)?));
                live.insert(r.id);
            }
            None => {
                // Its storage goes as an orphan below; the definition now, or at a later start.
                tracing::info!(index = %r.def.name, collection = %r.collection, "collection gone; dropping its index");
                if let Err(e) = store.delete_catalog(&r.catalog_key()) {
                    tracing::warn!(index = %r.def.name, error = %e, "could not remove the definition of an index whose collection is gone");
                }
            }
        }
    }
    let mut batch = db.batch();
    if migrated {
        for id in legacy_ids {
            batch.remove(&meta, legacy_def_key(id));
        }
    }
    let next_id = remove_orphans(&db, &meta, &live, &mut batch)?;
    batch.commit()?;
    db.persist(fjall::PersistMode::SyncAll)?;
    let stored_next = match meta.get(NEXT_ID_KEY)? {
        Some(v) => u32::from_be_bytes(v.as_ref().try_into().map_err(|_| IndexError::Corrupt("next index id".into()))?),
        None => 1,
    };
    let next_id = next_id.max(stored_next).max(live.iter().max().map_or(1, |m| m + 1));
    debug_assert!(live.iter().all(|&id| id < next_id));
    Ok(Opened { db, meta, indexes, next_id })
}

/// Removes the keyspaces, cursors and build positions of ids no live definition has
/// (dropped or replaced indexes whose storage a crash left behind). Returns an id above
/// every id the database has seen.
fn remove_orphans(
    db: &fjall::Database,
    meta: &fjall::Keyspace,
    live: &HashSet<u32>,
    batch: &mut fjall::OwnedWriteBatch,
) -> Result<u32, IndexError> {
    let mut next = 1u32;
    for name in db.list_keyspace_names() {
        let Some(id) = name.strip_prefix(['x', 'b']).and_then(|n| n.parse::<u32>().ok()) else { continue };
        next = next.max(id.saturating_add(1));
        if !live.contains(&id) {
            tracing::info!(keyspace = %&*name, "removing the storage of an index that no longer exists");
            let ks = db.keyspace(&name, fjall::KeyspaceCreateOptions::default)?;
            db.delete_keyspace(ks)?;
        }
    }
    for prefix in [&b"cur/"[..], b"scan/"] {
        for guard in meta.prefix(prefix) {
            let k = guard.key()?;
            let id = std::str::from_utf8(&k[prefix.len()..]).ok().and_then(|rest| u32::from_str_radix(rest.get(..8)?, 16).ok());
            if id.is_some_and(|id| !live.contains(&id)) {
                batch.remove(meta, k);
            }
        }
    }
    Ok(next)
}

fn open_keyspaces(db: &fjall::Database, id: u32) -> Result<(fjall::Keyspace, fjall::Keyspace), IndexError> {
    let opts = || fjall::KeyspaceCreateOptions::default().max_memtable_size(INDEX_MEMTABLE_MAX_BYTES);
    Ok((db.keyspace(&format!("x{id}"), opts)?, db.keyspace(&format!("b{id}"), opts)?))
}

/// The index of definition `r`, with its cursors and build position as persisted (none
/// for a new index, which its maintainer then builds from the documents).
fn load(db: &fjall::Database, meta: &fjall::Keyspace, r: &Record, coll: &Collection) -> Result<Arc<Index>, IndexError> {
    let compiled = r.def.compile()?;
    let (fwd, back) = open_keyspaces(db, r.id)?;
    let n = usize::from(coll.partition_count());
    let mut cursors = vec![StreamPosition::default(); n];
    let items: Vec<AtomicI64> = (0..n).map(|_| AtomicI64::new(0)).collect();
    for guard in meta.prefix(format!("cur/{:08x}/", r.id).as_bytes()) {
        let (k, v) = guard.into_inner()?;
        let p = std::str::from_utf8(&k[k.len().saturating_sub(4)..]).ok().and_then(|h| usize::from_str_radix(h, 16).ok());
        if let (Some(p), Some((pos, count))) = (p, decode_cursor(&v)) {
            if p < n {
                cursors[p] = pos;
                items[p].store(count, Ordering::Relaxed);
            }
        }
    }
    let scan = match meta.get(scan_key(r.id))? {
        Some(v) => Some(ScanState::decode(&v, n)?),
        None => None,
    };
    Ok(Arc::new(Index {
        id: r.id,
        collection_id: r.collection_id,
        collection: r.collection.clone(),
        def: r.def.clone(),
        compiled,
        fwd,
        back,
        deferred: AtomicBool::new(r.def.defer_build),
        dropped: AtomicBool::new(false),
        corrupt: AtomicBool::new(false),
        cursors: Mutex::new(cursors),
        items,
        target: Mutex::new(Some(coll.high_seqnos())),
        progress: watch::channel(0).0,
        scan: Mutex::new(scan),
    }))
}

fn delete_index_storage(
    db: &fjall::Database,
    meta: &fjall::Keyspace,
    id: u32,
    open: Option<(fjall::Keyspace, fjall::Keyspace)>,
) -> Result<(), IndexError> {
    let mut batch = db.batch();
    batch.remove(meta, legacy_def_key(id));
    batch.remove(meta, scan_key(id));
    for guard in meta.prefix(format!("cur/{id:08x}/").as_bytes()) {
        let k = guard.key()?;
        batch.remove(meta, k);
    }
    batch.commit()?;
    let (fwd, back) = match open {
        Some(ks) => ks,
        None => open_keyspaces(db, id)?,
    };
    db.delete_keyspace(fwd)?;
    db.delete_keyspace(back)?;
    db.persist(fjall::PersistMode::SyncAll)?;
    Ok(())
}

/// The byte range of `bounds` over entries of an index with `n` keys.
/// A range of encoded entries: (start, end).
type ByteRange = (Bound<Vec<u8>>, Bound<Vec<u8>>);

fn byte_bounds(bounds: &ScanBounds, n: usize) -> Result<ByteRange, IndexError> {
    let encode = |values: &[Value]| -> Result<Vec<u8>, IndexError> {
        if values.len() > n {
            return Err(IndexError::Invalid(format!("the index has {n} keys; got {} values", values.len())));
        }
        let mut out = Vec::new();
        for v in values {
            keycode::encode(Some(v), &mut out);
        }
        Ok(out)
    };
    let after = |mut b: Vec<u8>| {
        b.push(keycode::AFTER_PREFIX);
        b
    };
    Ok(match bounds {
        ScanBounds::All => (Bound::Unbounded, Bound::Unbounded),
        ScanBounds::Eq(values) => {
            let p = encode(values)?;
            (Bound::Included(p.clone()), Bound::Excluded(after(p)))
        }
        ScanBounds::Range { low, high, inclusive_low, inclusive_high } => {
            let lo = match low {
                None => Bound::Unbounded,
                Some(v) if *inclusive_low => Bound::Included(encode(v)?),
                Some(v) => Bound::Excluded(after(encode(v)?)),
            };
            let hi = match high {
                None => Bound::Unbounded,
                Some(v) if *inclusive_high => Bound::Excluded(after(encode(v)?)),
                Some(v) => Bound::Excluded(encode(v)?),
            };
            (lo, hi)
        }
    })
}

/// See [`IndexManager::cursor`].
pub struct IndexCursor {
    snapshot: fjall::Snapshot,
    fwd: fjall::Keyspace,
    /// Where the next page starts.
    next: Bound<Vec<u8>>,
    hi: Bound<Vec<u8>>,
    n: usize,
    done: bool,
    /// The index read, and its manager, told if the read meets damage.
    index: Arc<Index>,
    mgr: Weak<IndexManager>,
}

impl IndexCursor {
    /// The next at most `max` rows, in index order; empty once the range is read.
    /// Blocking: call it off the I/O threads. Damage met in the index starts its rebuild
    /// and answers [`IndexError::Rebuilding`].
    pub fn next_page(&mut self, max: usize) -> Result<Vec<ScanRow>, IndexError> {
        let page = self.read_page(max);
        match self.mgr.upgrade() {
            Some(mgr) => mgr.checked(&self.index, page),
            None => page,
        }
    }

    fn read_page(&mut self, max: usize) -> Result<Vec<ScanRow>, IndexError> {
        use fjall::Readable;
        if self.done || max == 0 {
            return Ok(Vec::new());
        }
        let mut rows = Vec::with_capacity(max.min(SCAN_ROWS_MAX));
        let mut last = None;
        for guard in self.snapshot.range(&self.fwd, (self.next.clone(), self.hi.clone())).take(max) {
            let k = guard.key()?;
            let (key, id) = keycode::decode_components(&k, self.n)?;
            let id = std::str::from_utf8(id).map_err(|_| IndexError::Corrupt("document key".into()))?.to_string();
            rows.push(ScanRow { key, id });
            last = Some(k);
        }
        match last {
            Some(k) if rows.len() == max => self.next = Bound::Excluded(k.to_vec()),
            _ => self.done = true,
        }
        Ok(rows)
    }
}

fn read_range(
    fwd: &fjall::Keyspace,
    lo: Bound<Vec<u8>>,
    hi: Bound<Vec<u8>>,
    limit: usize,
    descending: bool,
    n: usize,
) -> Result<Vec<ScanRow>, IndexError> {
    if let (Bound::Included(l) | Bound::Excluded(l), Bound::Included(h) | Bound::Excluded(h)) = (&lo, &hi) {
        if l > h {
            return Ok(Vec::new());
        }
    }
    let iter = fwd.range::<Vec<u8>, _>((lo, hi));
    let iter: Box<dyn Iterator<Item = fjall::Guard>> = if descending { Box::new(iter.rev()) } else { Box::new(iter) };
    let mut rows = Vec::new();
    for guard in iter.take(limit) {
        let k = guard.key()?;
        let (key, id) = keycode::decode_components(&k, n)?;
        let id = std::str::from_utf8(id).map_err(|_| IndexError::Corrupt("document key".into()))?.to_string();
        rows.push(ScanRow { key, id });
    }
    Ok(rows)
}

/// One collection's maintainer: rounds on the worker pool while there is news, then waits
/// for a change, a wake-up (new index, build, scan) or the idle poll.
async fn maintain(mgr: Arc<IndexManager>, coll: Arc<Collection>, wake: Arc<Notify>, round: Arc<Mutex<()>>) {
    let mut changed = coll.changed();
    let _running = mgr.health.running();
    loop {
        // Published from here too: rebuilds counted while the node opened came before the
        // metrics recorder was installed.
        metrics::counter!(REBUILDS_METRIC).absolute(mgr.rebuilds());
        if coll.is_dropped() {
            if let Err(e) = mgr.drop_collection(coll.id()).await {
                tracing::warn!(error = %e, "dropping the indexes of a dropped collection");
            }
            return;
        }
        let Some(active) = mgr.active(coll.id()) else {
            return;
        };
        changed.borrow_and_update();
        let mut progressed = false;
        if !active.is_empty() {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let (c, r) = (Arc::clone(&coll), Arc::clone(&round));
            let m = Arc::clone(&mgr);
            mgr.pool.spawn(move || {
                let _round = r.lock();
                let _ = tx.send(run_round(&m, &c, &active));
            });
            match rx.await {
                Ok(Ok(p)) => {
                    mgr.health.round_succeeded();
                    progressed = p;
                }
                Ok(Err(
                    IndexError::Changes(shoal_storage::ChangesError::CollectionDropped)
                    | IndexError::Read(shoal_storage::ReadError::CollectionDropped),
                )) => continue,
                // An index met damage and was set aside (reported where it was met); the
                // others go on at once.
                Ok(Err(IndexError::Rebuilding { .. })) => continue,
                Ok(Err(e)) => {
                    tracing::warn!(collection = %coll.name(), error = %e, "index maintenance failed; retrying");
                    mgr.health.round_failed(&format!("collection {}: {e}", coll.name()));
                    tokio::time::sleep(IDLE_POLL).await;
                }
                Err(_) => return,
            }
        }
        if !progressed {
            tokio::select! {
                _ = changed.changed() => {}
                _ = wake.notified() => {}
                _ = tokio::time::sleep(IDLE_POLL) => {}
            }
        }
    }
}

/// Brings every partition with news up to date (bounded per partition), in parallel on the
/// pool; then marks indexes that reached their build target ready. True if anything moved.
///
/// Partitions are handled in groups whose batches are applied together (see [`group_size`]).
fn run_round(mgr: &IndexManager, coll: &Collection, active: &[Arc<Index>]) -> Result<bool, IndexError> {
    let Plan { scanning, streaming } = plan_scan(mgr, coll, active)?;
    let highs = coll.high_seqnos();
    let behind: Vec<PartitionId> = (0..coll.partition_count())
        .filter(|&p| streaming.iter().any(|i| i.cursors.lock()[usize::from(p)].seqno < highs[usize::from(p)]))
        .collect();
    let size = group_size(behind.len(), mgr.pool.current_num_threads());
    let (scanned, streamed) = rayon::join(
        || if scanning.is_empty() { Ok(false) } else { scan_round(mgr, coll, &scanning) },
        || behind.par_chunks(size).map(|group| catch_up(mgr, coll, &streaming, group)).try_reduce(|| false, |a, b| Ok(a || b)),
    );
    let moved = scanned? | streamed?;
    for index in active {
        let done = index.scan.lock().is_none() && index.target.lock().as_ref().is_some_and(|t| index.caught_up(t));
        if done {
            *index.target.lock() = None;
            index.progress.send_modify(|v| *v += 1);
            tracing::info!(index = %index.def.name, "index ready");
        }
    }
    Ok(moved)
}

/// Indexes built by a scan, and indexes fed from the change streams.
struct Plan {
    scanning: Vec<Arc<Index>>,
    streaming: Vec<Arc<Index>>,
}

/// Splits the active indexes into those a key-order scan of the documents builds and those
/// fed from the change streams; starts a scan for indexes whose build has not begun.
///
/// A new build reads the documents once, in key order, for all indexes starting together
/// (one sequential read whatever the partition count), then follows the change streams from
/// positions taken before the read. Indexes whose build is asked for while a scan runs wait
/// for the next one.
fn plan_scan(mgr: &IndexManager, coll: &Collection, active: &[Arc<Index>]) -> Result<Plan, IndexError> {
    let live = || active.iter().filter(|i| !i.dropped.load(Ordering::Acquire));
    let mut scanning: Vec<Arc<Index>> = live().filter(|i| i.scan.lock().is_some()).cloned().collect();
    let unstarted = |i: &Index| {
        i.scan.lock().is_none()
            && i.target.lock().as_ref().is_some_and(|t| t.iter().any(|&h| h > 0))
            && i.cursors.lock().iter().all(|c| c.seqno == 0)
            && i.items.iter().all(|n| n.load(Ordering::Relaxed) == 0)
    };
    let waiting: Vec<Arc<Index>> = live().filter(|i| unstarted(i)).cloned().collect();
    if scanning.is_empty() && !waiting.is_empty() {
        let state = ScanState { start: coll.positions(), after: None, scanned: 0, total: coll.info().docs };
        let mut batch = mgr.db.batch();
        for index in &waiting {
            batch.insert(&mgr.meta, scan_key(index.id), state.encode());
        }
        batch.commit()?;
        for index in &waiting {
            *index.scan.lock() = Some(state.clone());
        }
        tracing::info!(indexes = waiting.len(), docs = state.total, "index build: reading the documents in key order");
        scanning = waiting.clone();
    }
    let streaming = active
        .iter()
        .filter(|i| !scanning.iter().any(|s| Arc::ptr_eq(s, i)) && !waiting.iter().any(|w| Arc::ptr_eq(w, i)))
        .cloned()
        .collect();
    Ok(Plan { scanning, streaming })
}

/// Reads the next documents in key order into every scanning index (up to
/// [`SCAN_ROUND_DOCS`] per round, so streamed indexes and drops get their turn), one write
/// batch per [`SCAN_BATCH_DOCS`] together with the scan's position. At the end, the indexes
/// take the scan's start positions as their cursors.
fn scan_round(mgr: &IndexManager, coll: &Collection, scanning: &[Arc<Index>]) -> Result<bool, IndexError> {
    let partitions = coll.partition_count();
    let mut done = 0;
    while done < SCAN_ROUND_DOCS {
        let Some(state) = scanning.iter().find_map(|i| i.scan.lock().clone()) else {
            return Ok(done > 0);
        };
        let docs = coll.scan_docs(state.after.as_deref(), SCAN_BATCH_DOCS)?;
        let mut batch = mgr.db.batch();
        let Some(last) = docs.last().map(|d| d.0.clone()) else {
            for index in scanning {
                for (p, pos) in state.start.iter().enumerate() {
                    let items = index.items[p].load(Ordering::Relaxed);
                    batch.insert(&mgr.meta, cursor_key(index.id, p as PartitionId), encode_cursor(*pos, items));
                }
                batch.remove(&mgr.meta, scan_key(index.id));
            }
            batch.commit()?;
            for index in scanning {
                index.cursors.lock().clone_from_slice(&state.start);
                *index.scan.lock() = None;
                index.progress.send_modify(|v| *v += 1);
            }
            return Ok(true);
        };
        let computed: Vec<Vec<Vec<Vec<u8>>>> = docs
            .par_iter()
            .with_min_len(64)
            .map(|(_, body)| {
                let doc: Option<Value> = serde_json::from_slice(body).ok();
                scanning.iter().map(|i| doc.as_ref().map(|d| i.compiled.entries(d)).unwrap_or_default()).collect()
            })
            .collect();
        let next = ScanState { after: Some(last), scanned: state.scanned + docs.len() as u64, ..state };
        let mut staged = Vec::with_capacity(scanning.len());
        for (k, index) in scanning.iter().enumerate() {
            let mut delta: HashMap<PartitionId, i64> = HashMap::new();
            let mut fwd = Vec::with_capacity(docs.len());
            for ((key, _), per_index) in docs.iter().zip(&computed) {
                let entries = &per_index[k];
                if entries.is_empty() {
                    continue;
                }
                // Each key comes once and nothing was indexed for it before: no back read.
                for e in entries {
                    fwd.push(entry_key(e, key));
                }
                batch.insert(&index.back, key.as_ref(), encode_list(entries));
                *delta.entry(shoal_storage::partition_of(key, partitions)).or_default() += entries.len() as i64;
            }
            fwd.sort_unstable();
            for key in fwd {
                batch.insert(&index.fwd, key, []);
            }
            let mut items = Vec::with_capacity(delta.len());
            for (p, d) in delta {
                let n = index.items[usize::from(p)].load(Ordering::Relaxed) + d;
                batch.insert(&mgr.meta, cursor_key(index.id, p), encode_cursor(StreamPosition::default(), n));
                items.push((usize::from(p), n));
            }
            batch.insert(&mgr.meta, scan_key(index.id), next.encode());
            staged.push(items);
        }
        batch.commit()?;
        for (index, items) in scanning.iter().zip(staged) {
            for (p, n) in items {
                index.items[p].store(n, Ordering::Relaxed);
            }
            *index.scan.lock() = Some(next.clone());
            index.progress.send_modify(|v| *v += 1);
        }
        done += docs.len();
    }
    Ok(true)
}

/// Partitions per group: the partitions behind, split evenly over the workers.
///
/// One partition's changes are spread over the whole key space (more thinly the more
/// partitions there are). Reading every partition of a group in lock step — a few changes
/// of each per batch, see [`part_batch`] — and writing them as one sorted batch keeps both
/// the document reads and the inserts into the index's memtable close together, so the cost
/// per change does not grow with the partition count.
fn group_size(behind: usize, workers: usize) -> usize {
    behind.div_ceil(workers.max(1)).max(1)
}

/// Changes read from each partition of a group per batch: about [`GROUP_CHANGES`] in all.
fn part_batch(group: usize) -> usize {
    (GROUP_CHANGES / group.max(1)).clamp(PART_BATCH_MIN, BATCH_CHANGES)
}

/// One partition's part of a group's batch.
struct PartBatch {
    p: PartitionId,
    changes: Vec<Change>,
    pos: StreamPosition,
}

fn catch_up(mgr: &IndexManager, coll: &Collection, active: &[Arc<Index>], group: &[PartitionId]) -> Result<bool, IndexError> {
    let mut subs = Vec::with_capacity(group.len());
    for &p in group {
        let pi = usize::from(p);
        let from = active.iter().map(|i| i.cursors.lock()[pi]).min_by_key(|c| c.seqno).unwrap_or_default();
        let (mut sub, rollback) = coll.subscribe(p, from)?;
        // A new history epoch that began at or after our position (a restart after a crash
        // that lost nothing we saw) needs no rollback.
        if rollback.is_some_and(|r| r < from.seqno) {
            // History diverged (unclean restart) or tombstones were purged past us: rebuild
            // this partition's part of every index from the start.
            for index in active {
                reset_partition(mgr, index, p, coll.partition_count())?;
            }
            sub = coll.subscribe(p, StreamPosition::default())?.0;
        }
        subs.push((p, sub, 0usize));
    }
    let mut applied = 0;
    let per_part = part_batch(subs.len());
    loop {
        let mut parts = Vec::with_capacity(subs.len());
        for (p, sub, done) in subs.iter_mut().filter(|(_, _, done)| *done < ROUND_CHANGES_MAX) {
            let pi = usize::from(*p);
            let changes = sub.try_next(per_part, true)?;
            let pos = sub.position();
            if changes.is_empty() {
                *done = ROUND_CHANGES_MAX;
            }
            *done += changes.len();
            if !changes.is_empty() || active.iter().any(|i| i.cursors.lock()[pi].seqno < pos.seqno) {
                parts.push(PartBatch { p: *p, changes, pos });
            }
        }
        if parts.is_empty() {
            break;
        }
        let n: usize = parts.iter().map(|b| b.changes.len()).sum();
        apply(mgr, active, &parts)?;
        applied += n;
        if n == 0 {
            break;
        }
    }
    Ok(applied > 0)
}

/// What one index stages for one partition of a batch.
struct Staged {
    pi: usize,
    pos: StreamPosition,
    items: i64,
}

/// Applies one batch of changes of several partitions to every active index, in one atomic
/// write together with the new cursors.
fn apply(mgr: &IndexManager, active: &[Arc<Index>], parts: &[PartBatch]) -> Result<(), IndexError> {
    // Parse each document once, for all indexes (in parallel within the batch).
    let all: Vec<&Change> = parts.iter().flat_map(|b| &b.changes).collect();
    let computed: Vec<Vec<Vec<Vec<u8>>>> = all
        .par_iter()
        .with_min_len(64)
        .map(|c| {
            let doc: Option<Value> = if c.deleted { None } else { c.value.as_ref().and_then(|v| serde_json::from_slice(v).ok()) };
            active.iter().map(|i| doc.as_ref().map(|d| i.compiled.entries(d)).unwrap_or_default()).collect()
        })
        .collect();
    let mut batch = mgr.db.batch();
    let mut staged: Vec<(&Arc<Index>, Vec<Staged>)> = Vec::with_capacity(active.len());
    for (k, index) in active.iter().enumerate() {
        if index.dropped.load(Ordering::Acquire) {
            continue;
        }
        let mut fwd: Vec<(Vec<u8>, bool)> = Vec::with_capacity(all.len());
        let mut per_part = Vec::with_capacity(parts.len());
        let mut offset = 0;
        for part in parts {
            let pi = usize::from(part.p);
            let computed = &computed[offset..offset + part.changes.len()];
            offset += part.changes.len();
            let cursor = index.cursors.lock()[pi].seqno;
            let mut delta = 0i64;
            let mut pending: HashMap<&[u8], &Vec<Vec<u8>>> = HashMap::new();
            for (c, per_index) in part.changes.iter().zip(computed) {
                if c.seqno <= cursor {
                    continue;
                }
                let new = &per_index[k];
                let old: Vec<Vec<u8>> = match pending.get(c.key.as_ref()) {
                    Some(v) => (*v).clone(),
                    None => mgr.checked(index, read_back(index, &c.key))?,
                };
                if &old == new {
                    continue;
                }
                for o in old.iter().filter(|o| new.binary_search(o).is_err()) {
                    fwd.push((entry_key(o, &c.key), false));
                    delta -= 1;
                }
                for e in new.iter().filter(|e| old.binary_search(e).is_err()) {
                    fwd.push((entry_key(e, &c.key), true));
                    delta += 1;
                }
                pending.insert(c.key.as_ref(), new);
            }
            // Every write of one batch shares one sequence number, so a key must appear in
            // it once: the document's last state.
            let mut back: Vec<(&[u8], &Vec<Vec<u8>>)> = pending.into_iter().collect();
            back.sort_unstable_by(|a, b| a.0.cmp(b.0));
            for (key, entries) in back {
                if entries.is_empty() {
                    batch.remove(&index.back, key);
                } else {
                    batch.insert(&index.back, key, encode_list(entries));
                }
            }
            let items = index.items[pi].load(Ordering::Relaxed) + delta;
            batch.insert(&mgr.meta, cursor_key(index.id, part.p), encode_cursor(part.pos, items));
            per_part.push(Staged { pi, pos: part.pos, items });
        }
        // In key order: sorted inserts walk the memtable's skiplist along the path of the
        // previous one, which keeps its nodes in cache. The sort is stable and only the last
        // operation on an entry is written: one batch's writes share a sequence number, so
        // an entry added by one change and removed by a later one must appear once.
        fwd.sort_by(|a, b| a.0.cmp(&b.0));
        let mut ops = fwd.into_iter().peekable();
        while let Some((key, insert)) = ops.next() {
            if ops.peek().is_some_and(|(next, _)| *next == key) {
                continue;
            }
            if insert {
                batch.insert(&index.fwd, key, []);
            } else {
                batch.remove(&index.fwd, key);
            }
        }
        staged.push((index, per_part));
    }
    batch.commit()?;
    for (index, per_part) in staged {
        for st in per_part {
            index.cursors.lock()[st.pi] = st.pos;
            index.items[st.pi].store(st.items, Ordering::Relaxed);
        }
        index.progress.send_modify(|v| *v += 1);
    }
    Ok(())
}

/// The composite keys document `key` contributed to `index`.
fn read_back(index: &Index, key: &[u8]) -> Result<Vec<Vec<u8>>, IndexError> {
    match index.back.get(key)? {
        Some(v) => decode_list(&v),
        None => Ok(Vec::new()),
    }
}

/// A document key and the composite keys it contributed.
type BackEntry = (fjall::Slice, Vec<Vec<u8>>);

/// The back entries of the documents of partition `p`.
fn back_entries_of(index: &Index, p: PartitionId, partitions: u16) -> Result<Vec<BackEntry>, IndexError> {
    let mut out = Vec::new();
    for guard in index.back.iter() {
        let (doc_key, v) = guard.into_inner()?;
        if shoal_storage::partition_of(&doc_key, partitions) == p {
            out.push((doc_key, decode_list(&v)?));
        }
    }
    Ok(out)
}

/// Removes every entry that came from partition `p` and puts its cursor back to the start.
fn reset_partition(mgr: &IndexManager, index: &Arc<Index>, p: PartitionId, partitions: u16) -> Result<(), IndexError> {
    let mut batch = mgr.db.batch();
    for (doc_key, entries) in mgr.checked(index, back_entries_of(index, p, partitions))? {
        for e in entries {
            batch.remove(&index.fwd, entry_key(&e, &doc_key));
        }
        batch.remove(&index.back, doc_key);
    }
    batch.insert(&mgr.meta, cursor_key(index.id, p), encode_cursor(StreamPosition::default(), 0));
    batch.commit()?;
    index.cursors.lock()[usize::from(p)] = StreamPosition::default();
    index.items[usize::from(p)].store(0, Ordering::Relaxed);
    tracing::warn!(index = %index.def.name, partition = p, "partition history changed; re-indexing it");
    Ok(())
}
