//! The store: data paths, collections, recovery after a crash, and background work
//! (expiry pager, tombstone purger).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::clock::{CasClock, IdSource, RandomIds, SystemClock, TimeSource};
use crate::codec;
use crate::collection::{Collection, CollectionInfo};
use crate::error::{CatalogError, CollectionError, OpenError, WriteError};
use crate::health::{StorageHealth, StorageState};
use crate::partition::{count_live, Expired, FailoverEntry, LiveCount, Partition, PartitionParts, TailLimit};
use crate::syncer::Syncer;
use crate::unit::{Ownership, PartitionState};
use crate::{PartitionId, SeqNo, PARTITIONS_DEFAULT, PARTITIONS_MAX};

const PATH_FILE: &str = "shoal-path.json";
const CLEAN_SHUTDOWN_FILE: &str = "clean-shutdown";
/// How long a clean close waits for the memtables to be written as tables before it leaves
/// them to the journal (the next start then replays it).
const CLOSE_FLUSH_WAIT: std::time::Duration = std::time::Duration::from_secs(60);
const DB_DIR: &str = "db";
const META_KEYSPACE: &str = "meta";
/// Layout version of a data path: 3 keeps each partition in a keyspace of its own, shared
/// by the collections (2 had three keyspaces per collection, keyed by key alone; 1 led with
/// the partition).
const PATH_FORMAT: u32 = 3;
/// Tombstones purged per partition per purger round.
const PURGE_BATCH_MAX: usize = 10_000;
/// Expired documents deleted per collection per pager round, so a round stays short.
const EXPIRY_PAGER_BATCH_MAX: usize = 10_000;
/// How often the expiry pager runs.
const EXPIRY_PAGER_INTERVAL: Duration = Duration::from_secs(1);
/// Memtables of all the partitions of one data path together, before they are flushed:
/// each partition's memtable is its share of this, within the bounds below.
const PATH_MEMTABLES_BYTES: u64 = 256 * 1024 * 1024;
const PARTITION_MEMTABLE_MIN_BYTES: u64 = 2 * 1024 * 1024;
const PARTITION_MEMTABLE_MAX_BYTES: u64 = 16 * 1024 * 1024;
/// Default [`StoreConfig::blob_threshold_bytes`]. fjall's default is 1 KiB; at that size a
/// copy of 1 KB documents reads one blob per record and LZ4-compresses every one again on
/// ingest (`shoal bench copy`: 93 MB/s on one thread against 466 MB/s of `dd`), while
/// inline records are copied as whole blocks. Large documents still go to blobs, where
/// compaction does not rewrite them.
pub const BLOB_THRESHOLD_DEFAULT_BYTES: u32 = 16 * 1024;
/// How a partition's table data blocks are compressed: LZ4 at every level. fjall's default
/// leaves levels 0 and 1 as written, and with a keyspace per partition nearly all of a
/// partition's bytes sit there (a partition's few memtable flushes, 16–35 MB in the
/// benchmarks). The tables are what a copy by files ships byte for byte, so compressed
/// blocks are fewer bytes on the wire and on the receiver's disk for the same documents. A
/// block is decompressed once, into the block cache.
fn partition_block_compression() -> fjall::config::CompressionPolicy {
    fjall::config::CompressionPolicy::all(fjall::CompressionType::Lz4)
}
/// Keys of dropped collections deleted per fjall batch by the reclaimer.
const RECLAIM_BATCH_MAX: usize = 10_000;
/// Meta records of dropped collections whose keys are still being reclaimed.
const GONE_PREFIX: &str = "gone/";
/// Longest collection name, in characters.
pub const COLLECTION_NAME_MAX_CHARS: usize = 251;
/// Where catalog entries live in the meta keyspace: a prefix of their own, so that no
/// catalog key can collide with the store's own records (`coll/`, `part/`, ...).
const CATALOG_PREFIX: &str = "cat/";
/// Longest catalog key, in bytes.
pub const CATALOG_KEY_MAX_BYTES: usize = 1024;

#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// Partitions are spread over these, partition `p` on path `p mod n`.
    pub data_paths: Vec<PathBuf>,
    /// `None`: what the data directory was created with, or the default for a new one.
    pub partitions: Option<u16>,
    /// Block cache, split evenly over the data paths.
    pub cache_bytes: u64,
    /// Tombstones older than this are purged.
    pub purge_horizon: Duration,
    /// How often the purger looks for old tombstones.
    pub purge_interval: Duration,
    /// Free space kept on every data path: writes are refused below it.
    pub disk_reserve_bytes: u64,
    /// Document records this large or larger live in blob files beside the tables (fjall's
    /// key-value separation); smaller ones inline in the tables' blocks. Fixed for a
    /// partition when its keyspace is created.
    pub blob_threshold_bytes: u32,
    /// Wall-clock time (CAS values, expiry, tombstone age): the system's, or a test's.
    pub time: Arc<dyn TimeSource>,
    /// New history UUIDs: random, or a test's seeded sequence.
    pub ids: Arc<dyn IdSource>,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            data_paths: vec![PathBuf::from("shoal-data")],
            partitions: None,
            cache_bytes: 256 * 1024 * 1024,
            purge_horizon: Duration::from_secs(24 * 3600),
            purge_interval: Duration::from_secs(60),
            disk_reserve_bytes: crate::DISK_RESERVE_DEFAULT_BYTES,
            blob_threshold_bytes: BLOB_THRESHOLD_DEFAULT_BYTES,
            time: Arc::new(SystemClock),
            ids: Arc::new(RandomIds),
        }
    }
}

/// What every data path records about the node it belongs to.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
struct PathRecord {
    format: u32,
    partitions: u16,
    path_index: usize,
    path_count: usize,
}

#[derive(Debug, Serialize, Deserialize)]
struct CollectionRecord {
    id: u32,
    max_ttl: u32,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct PartitionRecord {
    pub failover: Vec<FailoverEntry>,
    pub purge_seqno: SeqNo,
    /// Live documents and their bytes, written by a clean close: the next start (if clean)
    /// takes them instead of reading every document. Ignored after a crash.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live: Option<[i64; 2]>,
    /// A durable lower bound of the high seqno, kept because no by-sequence entry may hold
    /// it: a rollback's point (the changes above it are gone, and the key changed at it may
    /// have changed again above), an ingest's position. The high seqno at open is at least this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub high: Option<SeqNo>,
}

/// A partition's state on this node, kept across restarts.
#[derive(Debug, Serialize, Deserialize)]
struct StateRecord {
    state: PartitionState,
}

pub(crate) struct DataPath {
    pub db: fjall::Database,
    syncer: Arc<Syncer>,
}

/// One partition on this node: its keyspace (see `codec`) in the database of data path
/// `p mod n` — replaced when the partition is dropped — and its state.
pub(crate) struct PartitionUnit {
    pub db: fjall::Database,
    pub ks: RwLock<fjall::Keyspace>,
    syncer: Arc<Syncer>,
    pub owner: Arc<Ownership>,
    /// Held by the partition-level operations (state change, ingest, drop), one at a time.
    pub op: Mutex<()>,
}

/// The name of partition `p`'s keyspace.
fn partition_keyspace_name(p: PartitionId) -> String {
    format!("p{p:04}")
}

pub struct Store {
    config: StoreConfig,
    partitions: u16,
    pub(crate) paths: Vec<DataPath>,
    pub(crate) units: Vec<PartitionUnit>,
    /// Memtable size of every partition's keyspace (fixed when a keyspace is created).
    memtable_bytes: u64,
    pub(crate) meta: fjall::Keyspace,
    clock: Arc<CasClock>,
    pub(crate) health: Arc<StorageHealth>,
    collections: RwLock<BTreeMap<String, Arc<Collection>>>,
    /// The partition map version this node knows, carried by `not_my_partition` refusals.
    pub(crate) map_version: Arc<AtomicU64>,
    /// Serialises collection creation and drop, and partition-level operations.
    pub(crate) ddl: Mutex<()>,
    recovered_unclean: bool,
    stop: Arc<AtomicBool>,
    background: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> OpenError + '_ {
    move |source| OpenError::Io { path: path.display().to_string(), source }
}

impl Store {
    /// Opens (or creates) the store and starts its background work.
    pub fn open(config: StoreConfig) -> Result<Arc<Store>, OpenError> {
        if config.data_paths.is_empty() {
            return Err(OpenError::Config("at least one data path is needed".into()));
        }
        let (partitions, existed) = check_paths(&config)?;
        let first = &config.data_paths[0];
        let clean_marker = first.join(CLEAN_SHUTDOWN_FILE);
        let recovered_unclean = existed && !clean_marker.exists();
        let cache_per_path = (config.cache_bytes / config.data_paths.len() as u64).max(1024 * 1024);
        let health = Arc::new(StorageHealth::default());
        health.set_disks(config.data_paths.clone(), config.disk_reserve_bytes);
        let mut paths = Vec::new();
        for path in &config.data_paths {
            let db = fjall::Database::builder(path.join(DB_DIR)).cache_size(cache_per_path).open()?;
            let syncer = Syncer::start(db.clone(), Arc::clone(&health)).map_err(io_err(path))?;
            paths.push(DataPath { db, syncer });
        }
        let meta = paths[0].db.keyspace(META_KEYSPACE, fjall::KeyspaceCreateOptions::default)?;
        let per_path = u64::from(partitions).div_ceil(paths.len() as u64).max(1);
        let memtable_bytes = (PATH_MEMTABLES_BYTES / per_path).clamp(PARTITION_MEMTABLE_MIN_BYTES, PARTITION_MEMTABLE_MAX_BYTES);
        let map_version = Arc::new(AtomicU64::new(0));
        let mut units = Vec::with_capacity(usize::from(partitions));
        for p in 0..partitions {
            let path = &paths[usize::from(p) % paths.len()];
            let ks = create_partition_keyspace(&path.db, p, memtable_bytes, config.blob_threshold_bytes)?;
            // A node's partitions are active until it is told otherwise (one node is a whole cluster).
            let state = match meta.get(state_key(p))? {
                Some(v) => {
                    serde_json::from_slice::<StateRecord>(&v).map_err(|e| OpenError::Corrupt(format!("state of partition {p}: {e}")))?.state
                }
                None => PartitionState::Active,
            };
            let owner = Arc::new(Ownership::new(state, Arc::clone(&map_version)));
            units.push(PartitionUnit {
                db: path.db.clone(),
                ks: RwLock::new(ks),
                syncer: Arc::clone(&path.syncer),
                owner,
                op: Mutex::new(()),
            });
        }
        let store = Store {
            config: config.clone(),
            partitions,
            paths,
            units,
            memtable_bytes,
            map_version,
            meta,
            clock: Arc::new(CasClock::new(Arc::clone(&config.time), Arc::clone(&config.ids))),
            health,
            collections: RwLock::new(BTreeMap::new()),
            ddl: Mutex::new(()),
            recovered_unclean,
            stop: Arc::new(AtomicBool::new(false)),
            background: Mutex::new(Vec::new()),
        };
        if recovered_unclean {
            tracing::warn!("the last shutdown was not clean: partitions get new history UUIDs");
        }
        store.load_collections()?;
        // From here on a crash is unclean again.
        if clean_marker.exists() {
            std::fs::remove_file(&clean_marker).map_err(io_err(first))?;
            sync_dir(first).map_err(io_err(first))?;
        }
        let store = Arc::new(store);
        store.watch_disks();
        let handles = {
            let (weak, stop) = (Arc::downgrade(&store), Arc::clone(&store.stop));
            let background = std::thread::Builder::new()
                .name("shoal-background".into())
                .spawn(move || background_loop(weak, stop))
                .map_err(io_err(first))?;
            let (weak, stop) = (Arc::downgrade(&store), Arc::clone(&store.stop));
            let watchdog = std::thread::Builder::new()
                .name("shoal-disk-watch".into())
                .spawn(move || disk_watch_loop(weak, stop))
                .map_err(io_err(first))?;
            vec![background, watchdog]
        };
        *store.background.lock() = handles;
        Ok(store)
    }

    /// Whether the store can take writes now, and why not.
    /// The store's clock (the configured time source): expiry is decided by it.
    pub fn now_secs(&self) -> u64 {
        self.clock.unix_secs()
    }

    pub(crate) fn clock(&self) -> &CasClock {
        &self.clock
    }

    pub fn health(&self) -> StorageState {
        self.health.state()
    }

    /// Whether the engine must be reopened, by restarting the process, to take writes again
    /// (it was poisoned by a full disk and the space is back; see [`crate::health`]).
    pub fn restart_needed(&self) -> bool {
        self.health.restart_needed()
    }

    /// Reads every data path's free space once and updates the disk-full state.
    pub fn watch_disks(&self) {
        self.health.watch_disks();
    }

    pub fn partitions(&self) -> u16 {
        self.partitions
    }

    pub fn data_paths(&self) -> &[PathBuf] {
        &self.config.data_paths
    }

    /// Whether this start followed a crash (history UUIDs were renewed).
    pub fn recovered_unclean(&self) -> bool {
        self.recovered_unclean
    }

    /// fsyncs done so far over all data paths.
    pub fn fsync_count(&self) -> u64 {
        self.paths.iter().map(|p| p.syncer.fsyncs.load(Ordering::Relaxed)).sum()
    }

    /// Bytes the storage engine holds on disk.
    pub fn disk_bytes(&self) -> u64 {
        self.paths.iter().map(|p| p.db.disk_space().unwrap_or(0)).sum()
    }

    /// The storage engine's background work under way or waiting: memtable flushes queued
    /// and compactions running, over every data path.
    pub fn background_work(&self) -> usize {
        self.paths.iter().map(|p| p.db.outstanding_flushes() + p.db.active_compactions()).sum()
    }

    pub fn collection(&self, name: &str) -> Option<Arc<Collection>> {
        self.collections.read().get(name).cloned()
    }

    pub fn list_collections(&self) -> Vec<CollectionInfo> {
        self.collections.read().values().map(|c| c.info()).collect()
    }

    /// Creates a collection with the next id of this store's own counter.
    pub fn create_collection(&self, name: &str, max_ttl: u32) -> Result<Arc<Collection>, CollectionError> {
        self.create_collection_as(name, max_ttl, None)
    }

    /// Creates a collection; `id`, when given, is its id instead of the next of this store's
    /// counter (a cluster's metadata log assigns ids so that every node agrees on them).
    /// Ids are never reused — caches and derived state are keyed by them — so a given id
    /// must be at least the counter, which then moves past it.
    pub fn create_collection_as(&self, name: &str, max_ttl: u32, id: Option<u32>) -> Result<Arc<Collection>, CollectionError> {
        validate_collection_name(name)?;
        let _ddl = self.ddl.lock();
        if self.collections.read().contains_key(name) {
            return Err(CollectionError::Exists(name.to_string()));
        }
        self.health.check_writable()?;
        let next = match self.meta.get("next_collection_id")? {
            Some(v) => v
                .get(..4)
                .and_then(|b| b.try_into().ok())
                .map(u32::from_be_bytes)
                .ok_or_else(|| CollectionError::Corrupt("next_collection_id".into()))?,
            None => 1,
        };
        let id = match id {
            None => next,
            Some(given) if given >= next && given < u32::MAX => given,
            Some(given) => return Err(CollectionError::IdTaken { id: given, next }),
        };
        debug_assert!(self.collections.read().values().all(|c| c.id != id), "a live collection has id {id}");
        let record = CollectionRecord { id, max_ttl };
        let collection = self.open_collection(name, &record, true)?;
        let mut batch = self.paths[0].db.batch();
        batch.insert(&self.meta, "next_collection_id", (id + 1).to_be_bytes().to_vec());
        batch.insert(&self.meta, collection_key(name), json_bytes(&record));
        for slot in &collection.partitions {
            let p = slot.load();
            let rec = PartitionRecord { failover: p.failover_log().to_vec(), purge_seqno: 0, live: None, high: None };
            batch.insert(&self.meta, partition_key(id, p.id()), json_bytes(&rec));
        }
        batch.commit()?;
        self.paths[0].db.persist(fjall::PersistMode::SyncAll)?;
        self.collections.write().insert(name.to_string(), Arc::clone(&collection));
        tracing::info!(collection = name, id, "collection created");
        Ok(collection)
    }

    /// Drops a collection: its records go first, durably; only then does it vanish from
    /// the running node (so a drop that cannot be made durable changes nothing).
    pub fn drop_collection(&self, name: &str) -> Result<(), CollectionError> {
        let _ddl = self.ddl.lock();
        let collection = self.collections.read().get(name).cloned().ok_or_else(|| CollectionError::NotFound(name.to_string()))?;
        self.health.check_writable()?;
        let mut batch = self.paths[0].db.batch();
        batch.remove(&self.meta, collection_key(name));
        for p in 0..self.partitions {
            batch.remove(&self.meta, partition_key(collection.id, p));
        }
        // Its keys go in the background (`run_reclaimer`): they share the partitions'
        // keyspaces with the other collections, and its id is never used again.
        batch.insert(&self.meta, gone_key(collection.id), Vec::new());
        batch.commit()?;
        self.paths[0].db.persist(fjall::PersistMode::SyncAll)?;
        self.collections.write().remove(name);
        collection.dropped.store(true, Ordering::Release);
        collection.changed.send_modify(|n| *n = n.wrapping_add(1));
        tracing::info!(collection = name, "collection dropped");
        Ok(())
    }

    /// Deletes the keys of dropped collections, a batch at a time, and forgets a collection
    /// once none is left. Returns how many keys were deleted. A crash part-way leaves the
    /// record, and the next round goes on.
    pub fn run_reclaimer(&self) -> usize {
        let mut gone = Vec::new();
        for guard in self.meta.prefix(GONE_PREFIX) {
            match guard.key() {
                Ok(k) => match std::str::from_utf8(&k[GONE_PREFIX.len()..]).ok().and_then(|h| u32::from_str_radix(h, 16).ok()) {
                    Some(id) => gone.push(id),
                    None => tracing::warn!(key = %String::from_utf8_lossy(&k), "a malformed record of a dropped collection"),
                },
                Err(err) => {
                    tracing::warn!(%err, "reclaimer");
                    return 0;
                }
            }
        }
        let mut deleted = 0;
        for id in gone {
            match self.reclaim_collection(id) {
                Ok(n) => deleted += n,
                Err(err) => tracing::warn!(%err, collection = id, "reclaimer"),
            }
        }
        deleted
    }

    fn reclaim_collection(&self, id: u32) -> Result<usize, WriteError> {
        let mut deleted = 0;
        for unit in &self.units {
            let ks = unit.ks.read().clone();
            loop {
                self.health.check_writable()?;
                let mut batch = unit.db.batch();
                let mut n = 0;
                for guard in ks.range(codec::collection_range(id)).take(RECLAIM_BATCH_MAX) {
                    batch.remove(&ks, guard.key()?);
                    n += 1;
                }
                if n == 0 {
                    break;
                }
                batch.commit()?;
                deleted += n;
            }
        }
        let mut batch = self.paths[0].db.batch();
        batch.remove(&self.meta, gone_key(id));
        batch.commit()?;
        if deleted > 0 {
            tracing::info!(collection = id, keys = deleted, "a dropped collection's keys are deleted");
        }
        Ok(deleted)
    }

    /// Stores `value` under `key` in the catalog, durably (committed and fsynced before it
    /// returns, as collection records are). The catalog holds records that other crates keep
    /// beside the collections (index definitions, say); the store never parses them.
    /// Refused while the store takes no writes (a full disk, a failed fsync).
    pub fn put_catalog(&self, key: &str, value: &[u8]) -> Result<(), CatalogError> {
        let key = catalog_key(key)?;
        self.health.check_writable()?;
        let mut batch = self.paths[0].db.batch();
        batch.insert(&self.meta, key, value);
        batch.commit()?;
        self.paths[0].db.persist(fjall::PersistMode::SyncAll)?;
        Ok(())
    }

    /// [`Store::put_catalog`] for several keys: one batch, one fsync.
    pub fn put_catalog_many(&self, entries: &[(String, Vec<u8>)]) -> Result<(), CatalogError> {
        self.health.check_writable()?;
        let mut batch = self.paths[0].db.batch();
        for (key, value) in entries {
            batch.insert(&self.meta, catalog_key(key)?, value.as_slice());
        }
        batch.commit()?;
        self.paths[0].db.persist(fjall::PersistMode::SyncAll)?;
        Ok(())
    }

    /// Removes `key` from the catalog, durably; removing an absent key is no error. Not
    /// refused on a full disk: removing entries is how space and state are given back.
    pub fn delete_catalog(&self, key: &str) -> Result<(), CatalogError> {
        let key = catalog_key(key)?;
        let mut batch = self.paths[0].db.batch();
        batch.remove(&self.meta, key);
        batch.commit()?;
        self.paths[0].db.persist(fjall::PersistMode::SyncAll)?;
        Ok(())
    }

    /// Every catalog entry whose key starts with `prefix` (empty: all), in key order.
    pub fn catalog_prefix(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, CatalogError> {
        let mut out = Vec::new();
        for guard in self.meta.prefix(format!("{CATALOG_PREFIX}{prefix}")) {
            let (k, v) = guard.into_inner()?;
            let key = k
                .strip_prefix(CATALOG_PREFIX.as_bytes())
                .and_then(|k| std::str::from_utf8(k).ok())
                .ok_or_else(|| CatalogError::Corrupt(format!("key {:?}", String::from_utf8_lossy(&k))))?;
            out.push((key.to_string(), v.to_vec()));
        }
        Ok(out)
    }

    /// Flushes everything to disk and marks the shutdown clean. Call once, at the end.
    pub fn close(&self) -> Result<(), OpenError> {
        self.stop_background();
        // The document counts, so that a clean start reads no document.
        let mut batch = self.paths[0].db.batch();
        for collection in self.collections_by_id() {
            for slot in &collection.partitions {
                let p = slot.load();
                let live = [p.docs_count.load(Ordering::Relaxed), p.docs_bytes.load(Ordering::Relaxed)];
                let rec = PartitionRecord {
                    failover: p.failover_log().to_vec(),
                    purge_seqno: p.purge_seqno.load(Ordering::Acquire),
                    live: Some(live),
                    high: p.high_floor(),
                };
                batch.insert(&self.meta, partition_key(collection.id, p.id()), json_bytes(&rec));
            }
        }
        batch.commit()?;
        for (path, root) in self.paths.iter().zip(&self.config.data_paths) {
            // Every memtable written as tables and the journal sealed: a clean start replays
            // nothing (a node stopped right after a load of 1M documents replayed its journal
            // for seconds).
            if !path.db.flush_and_seal_journal(CLOSE_FLUSH_WAIT)? {
                tracing::warn!(path = %root.display(), "the memtables were not flushed in time; the next start replays the journal");
            }
            path.db.persist(fjall::PersistMode::SyncAll)?;
        }
        let first = &self.config.data_paths[0];
        let marker = first.join(CLEAN_SHUTDOWN_FILE);
        let mut file = std::fs::File::create(&marker).map_err(io_err(first))?;
        file.write_all(b"clean\n").map_err(io_err(first))?;
        file.sync_all().map_err(io_err(first))?;
        sync_dir(first).map_err(io_err(first))?;
        tracing::info!("store closed cleanly");
        Ok(())
    }

    fn stop_background(&self) {
        self.stop.store(true, Ordering::SeqCst);
        for handle in std::mem::take(&mut *self.background.lock()) {
            handle.thread().unpark();
            let _ = handle.join();
        }
    }

    fn load_collections(&self) -> Result<(), OpenError> {
        let mut records = Vec::new();
        for guard in self.meta.prefix("coll/") {
            let (k, v) = guard.into_inner()?;
            let name = std::str::from_utf8(&k[5..]).map_err(|_| OpenError::Corrupt("collection name".into()))?.to_string();
            let record: CollectionRecord = serde_json::from_slice(&v).map_err(|e| OpenError::Corrupt(format!("collection {name}: {e}")))?;
            records.push((name, record));
        }
        for (name, record) in records {
            let collection =
                self.open_collection(&name, &record, false).map_err(|e| OpenError::Corrupt(format!("collection {name}: {e}")))?;
            self.collections.write().insert(name, collection);
        }
        Ok(())
    }

    fn open_collection(&self, name: &str, record: &CollectionRecord, new: bool) -> Result<Arc<Collection>, CollectionError> {
        let changed = Arc::new(watch::channel(0u64).0);
        let dropped = Arc::new(AtomicBool::new(false));
        let mut partitions = Vec::with_capacity(usize::from(self.partitions));
        let mut renewed = Vec::new();
        for p in 0..self.partitions {
            let unit = &self.units[usize::from(p)];
            let (mut failover, purge_seqno, counted, floor) = if new {
                (Vec::new(), 0, Some([0, 0]), None)
            } else {
                match self.meta.get(partition_key(record.id, p))? {
                    Some(v) => {
                        let rec: PartitionRecord =
                            serde_json::from_slice(&v).map_err(|e| CollectionError::Corrupt(format!("partition {p}: {e}")))?;
                        (rec.failover, rec.purge_seqno, rec.live.filter(|_| !self.recovered_unclean), rec.high)
                    }
                    None => (Vec::new(), 0, None, None),
                }
            };
            let live = match counted {
                Some([count, bytes]) => LiveCount { count, bytes },
                None => count_live(&unit.ks.read(), record.id)?,
            };
            let needs_new_uuid = failover.is_empty() || self.recovered_unclean;
            let mut parts = self.partition_parts(record.id, &changed, &dropped, p, failover.clone(), purge_seqno, live, None);
            parts.high_floor = floor.unwrap_or(0);
            let mut partition = Partition::open(parts)?;
            if needs_new_uuid {
                // The same tenure goes on: the epoch of the entry before.
                let epoch = failover.last().map_or(0, |e| e.epoch);
                let entry = FailoverEntry { uuid: self.clock.history_uuid(), seqno: partition.high_seqno(), epoch };
                partition.push_failover(entry);
                failover.push(entry);
                renewed.push((p, PartitionRecord { failover, purge_seqno, live: None, high: partition.high_floor() }));
            }
            partitions.push(arc_swap::ArcSwap::from_pointee(partition));
        }
        if !new && !renewed.is_empty() {
            let mut batch = self.paths[0].db.batch();
            for (p, rec) in &renewed {
                batch.insert(&self.meta, partition_key(record.id, *p), json_bytes(rec));
            }
            batch.commit()?;
            self.paths[0].db.persist(fjall::PersistMode::SyncAll)?;
        }
        Ok(Arc::new(Collection {
            name: name.to_string(),
            id: record.id,
            max_ttl: record.max_ttl,
            partitions,
            changed,
            dropped,
            clock: Arc::clone(&self.clock),
        }))
    }

    #[allow(clippy::too_many_arguments)]
    fn partition_parts(
        &self,
        coll: u32,
        changed: &Arc<watch::Sender<u64>>,
        dropped: &Arc<AtomicBool>,
        p: PartitionId,
        failover: Vec<FailoverEntry>,
        purge_seqno: SeqNo,
        live: LiveCount,
        high: Option<SeqNo>,
    ) -> PartitionParts {
        let unit = &self.units[usize::from(p)];
        PartitionParts {
            id: p,
            coll,
            db: unit.db.clone(),
            ks: unit.ks.read().clone(),
            syncer: Arc::clone(&unit.syncer),
            clock: Arc::clone(&self.clock),
            health: Arc::clone(&self.health),
            failover,
            purge_seqno,
            collection_changed: Arc::clone(changed),
            dropped: Arc::clone(dropped),
            owner: Arc::clone(&unit.owner),
            high,
            // A copy made with a known high seqno (ingest, promotion, rollback, new history)
            // is made once that is durable.
            high_floor: high.unwrap_or(0),
            live,
            tail_limit: TailLimit::share(self.partitions),
        }
    }

    /// A new copy of `collection`'s part of partition `p`, over the partition's current keyspace.
    pub(crate) fn new_partition(
        &self,
        collection: &Collection,
        p: PartitionId,
        failover: Vec<FailoverEntry>,
        purge_seqno: SeqNo,
        live: LiveCount,
        high: Option<SeqNo>,
    ) -> Result<Arc<Partition>, fjall::Error> {
        let parts = self.partition_parts(collection.id, &collection.changed, &collection.dropped, p, failover, purge_seqno, live, high);
        Ok(Arc::new(Partition::open(parts)?))
    }

    /// Partition `p`'s folder on disk, its memtable flushed first so that every record it
    /// holds is in a table file (`shoal bench copy` times copying these files whole).
    pub fn partition_files_flushed(&self, p: PartitionId) -> Result<PathBuf, crate::PartitionError> {
        let ks = self.unit(p)?.ks.read().clone();
        ks.rotate_memtable_and_wait()?;
        Ok(ks.path().to_path_buf())
    }

    /// Compacts partition `p`'s keyspace whole (every table into its last level), so that
    /// benches and tests can hold a partition whose files span levels.
    pub fn compact_partition(&self, p: PartitionId) -> Result<(), crate::PartitionError> {
        let ks = self.unit(p)?.ks.read().clone();
        ks.rotate_memtable_and_wait()?;
        ks.major_compact()?;
        Ok(())
    }

    pub(crate) fn unit(&self, p: PartitionId) -> Result<&PartitionUnit, crate::PartitionError> {
        self.units.get(usize::from(p)).ok_or(crate::PartitionError::NoSuchPartition(p))
    }

    /// The live collections, in id order.
    /// Whether a dropped collection's keys may still lie in the partitions' keyspaces
    /// (the reclaimer has not finished with it).
    pub(crate) fn reclaim_pending(&self) -> bool {
        self.meta.prefix(GONE_PREFIX).next().is_some()
    }

    pub(crate) fn collections_by_id(&self) -> Vec<Arc<Collection>> {
        let mut out: Vec<Arc<Collection>> = self.collections.read().values().cloned().collect();
        out.sort_by_key(|c| c.id);
        out
    }

    pub(crate) fn create_partition_keyspace(&self, db: &fjall::Database, p: PartitionId) -> Result<fjall::Keyspace, fjall::Error> {
        create_partition_keyspace(db, p, self.memtable_bytes, self.config.blob_threshold_bytes)
    }

    /// Adds partition `p`'s state record to `batch` (of the metadata's database).
    pub(crate) fn stage_state(&self, batch: &mut fjall::OwnedWriteBatch, p: PartitionId, state: PartitionState) {
        batch.insert(&self.meta, state_key(p), json_bytes(&StateRecord { state }));
    }

    /// Deletes documents whose expiry has passed (each becomes a deletion in the change
    /// stream). Returns how many were deleted.
    pub fn run_expiry_pager(&self) -> usize {
        let now = self.clock.unix_secs();
        let collections: Vec<_> = self.collections.read().values().cloned().collect();
        let mut expired = 0;
        for collection in collections {
            for slot in &collection.partitions {
                let partition = slot.load();
                // Most partitions have nothing due: their keys are not read (a range over
                // every table of 128 partitions a second kept idle nodes busy).
                if !partition.expiry_due(now) {
                    continue;
                }
                if let Err(err) = partition.expiry_scan() {
                    tracing::warn!(%err, "expiry pager");
                    continue;
                }
                // The earliest expiry left for later; 0 reads the partition again next round.
                let mut next = u64::MAX;
                let mut due = Vec::new();
                for guard in partition.ks.range(codec::tag_range(collection.id, codec::TAG_EXP)) {
                    let Ok(k) = guard.key() else {
                        next = 0;
                        break;
                    };
                    match codec::decode_exp_key(&k) {
                        Some((expiry, _)) if u64::from(expiry) > now => {
                            next = u64::from(expiry);
                            break;
                        }
                        Some((expiry, key)) => due.push((expiry, bytes::Bytes::copy_from_slice(key))),
                        None => continue,
                    }
                    if due.len() >= EXPIRY_PAGER_BATCH_MAX {
                        next = 0;
                        break;
                    }
                }
                for (expiry, key) in due {
                    match partition.expire(&key, expiry, now) {
                        Ok(Expired::Deleted) => expired += 1,
                        Ok(Expired::Changed) => {}
                        // Left to the active's deletions, and read again every round until
                        // then (as every partition was before), so that a copy made active
                        // meanwhile expires them.
                        Ok(Expired::NotHere) => next = 0,
                        Err(err) => {
                            next = 0;
                            tracing::warn!(%err, "expiry pager");
                        }
                    }
                }
                partition.expiry_scanned(next);
            }
        }
        expired
    }

    /// Purges tombstones older than the purge horizon. Returns how many were purged.
    pub fn run_purger(&self) -> usize {
        let horizon_nanos = u64::try_from(self.config.purge_horizon.as_nanos()).unwrap_or(u64::MAX);
        let cutoff = self.clock.now_nanos().saturating_sub(horizon_nanos);
        let collections: Vec<_> = self.collections.read().values().cloned().collect();
        let mut total = 0;
        for collection in collections {
            match self.purge_collection(&collection, cutoff) {
                Ok(n) => total += n,
                Err(err) => tracing::warn!(%err, collection = %collection.name, "purger"),
            }
        }
        total
    }

    /// One purge round of a collection. The raised purge seqnos are made durable (one fsync)
    /// before any tombstone goes: a reader resuming from before a purged deletion must be
    /// told to roll back even after a crash, or it would silently miss the deletion.
    fn purge_collection(&self, collection: &Collection, cutoff: crate::Cas) -> Result<usize, WriteError> {
        let mut plans = Vec::new();
        let mut batch = self.paths[0].db.batch();
        for slot in &collection.partitions {
            let partition = slot.load_full();
            let victims = partition.purge_candidates(cutoff, PURGE_BATCH_MAX)?;
            let Some(max) = victims.iter().map(|(seqno, _)| *seqno).max() else { continue };
            let purge_seqno = max.max(partition.purge_seqno.load(Ordering::Acquire));
            let rec =
                PartitionRecord { failover: partition.failover_log().to_vec(), purge_seqno, live: None, high: partition.high_floor() };
            batch.insert(&self.meta, partition_key(collection.id, partition.id()), json_bytes(&rec));
            plans.push((partition, purge_seqno, victims));
        }
        if plans.is_empty() {
            return Ok(0);
        }
        self.health.check_writable()?;
        batch.commit()?;
        self.paths[0].db.persist(fjall::PersistMode::SyncAll)?;
        let mut purged = 0;
        for (partition, purge_seqno, victims) in plans {
            let partition = &partition;
            partition.raise_purge_seqno(purge_seqno);
            purged += partition.purge(&victims)?;
        }
        Ok(purged)
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        self.stop_background();
        for path in &self.paths {
            path.syncer.shutdown();
        }
    }
}

fn background_loop(store: std::sync::Weak<Store>, stop: Arc<AtomicBool>) {
    let mut since_purge = Duration::ZERO;
    while !stop.load(Ordering::SeqCst) {
        std::thread::park_timeout(EXPIRY_PAGER_INTERVAL);
        let Some(store) = store.upgrade() else { return };
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let n = store.run_expiry_pager();
        if n > 0 {
            tracing::debug!(expired = n, "expiry pager");
        }
        store.run_reclaimer();
        since_purge += EXPIRY_PAGER_INTERVAL;
        if since_purge >= store.config.purge_interval {
            since_purge = Duration::ZERO;
            let n = store.run_purger();
            if n > 0 {
                tracing::debug!(purged = n, "tombstone purger");
            }
        }
    }
}

fn disk_watch_loop(store: std::sync::Weak<Store>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::SeqCst) {
        std::thread::park_timeout(crate::DISK_WATCH_INTERVAL);
        let Some(store) = store.upgrade() else { return };
        if stop.load(Ordering::SeqCst) {
            return;
        }
        store.watch_disks();
    }
}

/// Checks (or writes, for a new node) every data path's record. Returns the partition
/// count and whether the node existed before.
fn check_paths(config: &StoreConfig) -> Result<(u16, bool), OpenError> {
    let mut found: Option<PathRecord> = None;
    let mut missing = Vec::new();
    for (i, path) in config.data_paths.iter().enumerate() {
        std::fs::create_dir_all(path).map_err(io_err(path))?;
        let file = path.join(PATH_FILE);
        if !file.exists() {
            missing.push(i);
            continue;
        }
        let text = std::fs::read(&file).map_err(io_err(path))?;
        let rec: PathRecord = serde_json::from_slice(&text).map_err(|e| OpenError::Corrupt(format!("{}: {e}", file.display())))?;
        if rec.format != PATH_FORMAT {
            return Err(OpenError::Config(format!(
                "{} holds data of layout version {}; this build reads version {PATH_FORMAT} only (use a new data path)",
                path.display(),
                rec.format
            )));
        }
        if rec.path_index != i || rec.path_count != config.data_paths.len() {
            return Err(OpenError::Config(format!(
                "{} is data path {} of {} of an existing node; give the same --data-path list in the same order",
                path.display(),
                rec.path_index + 1,
                rec.path_count
            )));
        }
        if let Some(prev) = &found {
            if prev.partitions != rec.partitions {
                return Err(OpenError::Corrupt("data paths disagree on the partition count".into()));
            }
        }
        found = Some(rec);
    }
    let partitions = match (&found, config.partitions) {
        (Some(rec), Some(asked)) if asked != rec.partitions => {
            return Err(OpenError::Config(format!(
                "the data directory was created with {} partitions; --partitions {asked} cannot change that (omit the flag, or use a new data path)",
                rec.partitions
            )))
        }
        (Some(rec), _) => rec.partitions,
        (None, asked) => asked.unwrap_or(PARTITIONS_DEFAULT),
    };
    if partitions == 0 || partitions > PARTITIONS_MAX {
        return Err(OpenError::Config(format!("partitions must be 1 to {PARTITIONS_MAX}")));
    }
    if found.is_some() && !missing.is_empty() {
        return Err(OpenError::Config(
            "some data paths belong to an existing node and some are empty; give the node's original --data-path list".into(),
        ));
    }
    for i in missing {
        let path = &config.data_paths[i];
        let rec = PathRecord { format: PATH_FORMAT, partitions, path_index: i, path_count: config.data_paths.len() };
        write_atomically(path, PATH_FILE, &json_bytes(&rec)).map_err(io_err(path))?;
    }
    Ok((partitions, found.is_some()))
}

/// Checks a collection name against the rules (API.md): what is refused here is never stored.
pub fn validate_collection_name(name: &str) -> Result<(), CollectionError> {
    let bad = |why: &str| Err(CollectionError::InvalidName(why.to_string()));
    if name.is_empty() || name.chars().count() > COLLECTION_NAME_MAX_CHARS {
        return bad("a name has 1 to 251 characters");
    }
    if name.starts_with(['_', '%']) {
        return bad("a name may not start with _ or %");
    }
    if !name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '%')) {
        return bad("a name has only the characters A-Z a-z 0-9 _ - %");
    }
    Ok(())
}

fn collection_key(name: &str) -> Vec<u8> {
    format!("coll/{name}").into_bytes()
}

/// The meta key of catalog entry `key`.
fn catalog_key(key: &str) -> Result<Vec<u8>, CatalogError> {
    if key.is_empty() {
        return Err(CatalogError::InvalidKey("a catalog key is not empty"));
    }
    if key.len() > CATALOG_KEY_MAX_BYTES {
        return Err(CatalogError::InvalidKey("a catalog key is at most 1024 bytes"));
    }
    Ok(format!("{CATALOG_PREFIX}{key}").into_bytes())
}

fn state_key(p: PartitionId) -> Vec<u8> {
    format!("state/{p:04x}").into_bytes()
}

/// Marks partitions retired and not yet discarded ([`Store::retire_partitions`]).
pub(crate) const RETIRED_PREFIX: &str = "retired/";

pub(crate) fn retired_key(p: PartitionId) -> Vec<u8> {
    format!("{RETIRED_PREFIX}{p:04x}").into_bytes()
}

fn create_partition_keyspace(
    db: &fjall::Database,
    p: PartitionId,
    memtable_bytes: u64,
    blob_threshold: u32,
) -> Result<fjall::Keyspace, fjall::Error> {
    db.keyspace(&partition_keyspace_name(p), || {
        fjall::KeyspaceCreateOptions::default()
            .max_memtable_size(memtable_bytes)
            .data_block_compression_policy(partition_block_compression())
            .with_kv_separation(Some(fjall::KvSeparationOptions::default().separation_threshold(blob_threshold)))
    })
}

fn gone_key(collection: u32) -> Vec<u8> {
    format!("{GONE_PREFIX}{collection:08x}").into_bytes()
}

pub(crate) fn partition_key(collection: u32, p: PartitionId) -> Vec<u8> {
    format!("part/{collection:08x}/{p:04x}").into_bytes()
}

pub(crate) fn json_bytes<T: Serialize>(value: &T) -> Vec<u8> {
    // Serialising these plain records cannot fail.
    serde_json::to_vec(value).unwrap_or_default()
}

/// Writes `dir/name` so that a crash leaves either the old file or the whole new one:
/// a temporary file, fsynced, renamed over the name, and the directory fsynced.
pub fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = dir.join(format!("{name}.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, dir.join(name))?;
    sync_dir(dir)
}

fn sync_dir(path: &Path) -> std::io::Result<()> {
    std::fs::File::open(path)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::partition::{WriteOp, WriteRequest};

    fn upsert(key: &str, value: &'static [u8]) -> WriteRequest {
        WriteRequest {
            key: bytes::Bytes::copy_from_slice(key.as_bytes()),
            op: WriteOp::Upsert,
            value: Some(bytes::Bytes::from_static(value)),
            cas: None,
            expiry: 0,
        }
    }

    fn config(dir: &Path) -> StoreConfig {
        StoreConfig { data_paths: vec![dir.join("a"), dir.join("b")], partitions: Some(4), ..StoreConfig::default() }
    }

    /// Every journal file (`*.jnl`) under `dir`.
    fn journals(dir: &Path) -> std::collections::BTreeSet<PathBuf> {
        let mut out = std::collections::BTreeSet::new();
        let mut todo = vec![dir.to_path_buf()];
        while let Some(d) = todo.pop() {
            for entry in std::fs::read_dir(&d).unwrap().flatten() {
                let path = entry.path();
                if path.is_dir() {
                    todo.push(path);
                } else if path.extension().is_some_and(|e| e == "jnl") {
                    out.insert(path);
                }
            }
        }
        out
    }

    /// A node stopped cleanly right after a load replayed its journal for seconds at the next
    /// start (issue 40: 3.1 s and 6.8 s after 1,000,000 documents). A clean close writes every
    /// memtable as tables and seals the journal: the journals that held the load are deleted
    /// (journal files are preallocated, so their names, not their sizes, tell).
    #[test]
    fn a_clean_close_leaves_no_journal_to_replay() {
        let dir = tempfile::tempdir().unwrap();
        let before;
        {
            let store = Store::open(config(dir.path())).unwrap();
            let c = store.create_collection("c", 0).unwrap();
            for i in 0..5_000 {
                let _ = c.write(upsert(&format!("k{i}"), br#"{"pad":"0123456789012345678901234567890123456789"}"#)).unwrap();
            }
            before = journals(dir.path());
            assert!(!before.is_empty(), "the load sits in journals before the close");
            store.close().unwrap();
        }
        let after = journals(dir.path());
        let kept: Vec<_> = before.intersection(&after).collect();
        assert!(kept.is_empty(), "a clean close left journals holding the load to replay: {kept:?}");
        let store = Store::open(config(dir.path())).unwrap();
        assert_eq!(store.collection("c").map(|c| c.info().docs), Some(5_000), "every document is in the tables");
    }

    #[test]
    fn catalog_round_trip_survives_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = Store::open(config(dir.path())).unwrap();
            store.create_collection("coll", 0).unwrap();
            store.put_catalog("index/1/b", b"second").unwrap();
            store.put_catalog("index/1/a", b"first").unwrap();
            store.put_catalog("other/x", &[0, 159, 146, 150]).unwrap();
            store.put_catalog("index/1/a", b"first, replaced").unwrap();
            store.put_catalog("index/2/gone", b"soon gone").unwrap();
            store.delete_catalog("index/2/gone").unwrap();
            store.delete_catalog("never/there").unwrap();
            // Not closed: every call was fsynced on its own, so a crash keeps them.
        }
        let store = Store::open(config(dir.path())).unwrap();
        let entries = store.catalog_prefix("index/").unwrap();
        assert_eq!(entries, vec![("index/1/a".to_string(), b"first, replaced".to_vec()), ("index/1/b".to_string(), b"second".to_vec())]);
        assert_eq!(store.catalog_prefix("other/").unwrap(), vec![("other/x".to_string(), vec![0, 159, 146, 150])]);
        assert_eq!(store.catalog_prefix("").unwrap().len(), 3);
        // The catalog and the collections do not see each other's records.
        assert_eq!(store.list_collections().len(), 1);
        assert!(store.catalog_prefix("").unwrap().iter().all(|(k, _)| !k.starts_with("coll")));
        store.close().unwrap();
    }

    #[test]
    fn catalog_keys_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(config(dir.path())).unwrap();
        assert!(matches!(store.put_catalog("", b"x"), Err(CatalogError::InvalidKey(_))));
        let long = "k".repeat(CATALOG_KEY_MAX_BYTES + 1);
        assert!(matches!(store.put_catalog(&long, b"x"), Err(CatalogError::InvalidKey(_))));
        assert!(matches!(store.delete_catalog(""), Err(CatalogError::InvalidKey(_))));
        store.put_catalog(&long[1..], b"x").unwrap();
    }

    #[test]
    fn catalog_writes_are_refused_while_the_store_is_read_only() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(config(dir.path())).unwrap();
        store.health.fail("test");
        assert!(matches!(store.put_catalog("k", b"v"), Err(CatalogError::Refused(WriteError::ReadOnly(_)))));
        assert!(store.catalog_prefix("").unwrap().is_empty());
    }

    #[test]
    fn a_dropped_collections_keys_are_reclaimed_and_the_others_kept() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(config(dir.path())).unwrap();
        let (gone, kept) = (store.create_collection("gone", 0).unwrap(), store.create_collection("kept", 0).unwrap());
        for i in 0..200 {
            for c in [&gone, &kept] {
                let req = upsert(&format!("k{i}"), b"{}");
                let _ = c.write(WriteRequest { expiry: if i % 2 == 0 { u32::MAX - 1 } else { 0 }, ..req }).unwrap();
            }
        }
        let count = |id: u32| store.units.iter().map(|u| u.ks.read().range(codec::collection_range(id)).count()).sum::<usize>();
        // A document, a by-sequence entry and (for half of them) an expiry entry each.
        assert_eq!(count(gone.id()), 500);
        store.drop_collection("gone").unwrap();
        assert_eq!(store.run_reclaimer(), 500);
        assert_eq!(count(gone.id()), 0);
        assert_eq!(count(kept.id()), 500);
        assert!(store.meta.prefix(GONE_PREFIX).next().is_none(), "the drop record goes once the keys are gone");
        assert_eq!(store.run_reclaimer(), 0);
        assert_eq!(kept.get("k7").unwrap().value, bytes::Bytes::from_static(b"{}"));
    }

    #[test]
    fn a_drop_record_left_by_a_crash_is_finished_after_the_restart() {
        let dir = tempfile::tempdir().unwrap();
        let id = {
            let store = Store::open(config(dir.path())).unwrap();
            let c = store.create_collection("c", 0).unwrap();
            for i in 0..50 {
                let _ = c.write(upsert(&format!("k{i}"), b"1")).unwrap();
            }
            store.drop_collection("c").unwrap();
            c.id()
            // Dropped without `close` and before any reclaimer round: a crash.
        };
        let store = Store::open(config(dir.path())).unwrap();
        assert!(store.collection("c").is_none());
        assert_eq!(store.run_reclaimer(), 100);
        assert_eq!(store.units.iter().map(|u| u.ks.read().range(codec::collection_range(id)).count()).sum::<usize>(), 0);
    }

    /// Stock fjall 3.1.13 never returns from `Database::open` with more than ~1,000
    /// keyspaces holding tables (vendor/fjall/SHOAL-PATCH.md); a store of `PARTITIONS_MAX`
    /// partitions on one data path has that many.
    #[test]
    fn a_store_of_the_most_partitions_with_tables_in_each_reopens() {
        let dir = tempfile::tempdir().unwrap();
        let config = StoreConfig { data_paths: vec![dir.path().join("a")], partitions: Some(PARTITIONS_MAX), ..StoreConfig::default() };
        let mut keys = vec![None; usize::from(PARTITIONS_MAX)];
        for i in 0.. {
            let key = format!("k{i}");
            let slot = &mut keys[usize::from(crate::partition_of(key.as_bytes(), PARTITIONS_MAX))];
            if slot.is_none() {
                *slot = Some(key);
                if keys.iter().all(Option::is_some) {
                    break;
                }
            }
        }
        {
            let store = Store::open(config.clone()).unwrap();
            let c = store.create_collection("c", 0).unwrap();
            // Three rounds of writes, each flushed: the first table of a keyspace lands in
            // its last level, the later ones stay in L0 (what a live node has).
            for _ in 0..3 {
                for key in keys.iter().flatten() {
                    let _ = c.write(upsert(key, b"{}")).unwrap();
                }
                for unit in &store.units {
                    unit.ks.read().rotate_memtable_and_wait().unwrap();
                }
            }
            assert!(store.units.iter().all(|u| u.ks.read().l0_table_count() > 0), "every partition holds L0 tables");
            store.close().unwrap();
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let reopen = config.clone();
        std::thread::spawn(move || {
            let _ = tx.send(Store::open(reopen).map(|s| s.collection("c").map(|c| c.info().docs)));
        });
        let docs = rx.recv_timeout(Duration::from_secs(300)).expect("the store reopens (no recovery hang)").unwrap();
        assert_eq!(docs, Some(u64::from(PARTITIONS_MAX)));
    }

    #[test]
    fn a_clean_restart_takes_the_document_counts_from_the_close_and_a_crash_recounts() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = Store::open(config(dir.path())).unwrap();
            let c = store.create_collection("c", 0).unwrap();
            for i in 0..100 {
                let _ = c.write(upsert(&format!("k{i}"), b"12345")).unwrap();
            }
            store.close().unwrap();
        }
        let counts = |store: &Store| {
            let c = store.collection("c").unwrap();
            (0..store.partitions())
                .map(|p| {
                    store.meta.get(partition_key(c.id(), p)).unwrap().map(|v| serde_json::from_slice::<PartitionRecord>(&v).unwrap().live)
                })
                .collect::<Vec<_>>()
        };
        {
            let store = Store::open(config(dir.path())).unwrap();
            let recorded: i64 = counts(&store).iter().map(|r| r.unwrap().unwrap()[0]).sum();
            assert_eq!(recorded, 100, "the close recorded every partition's count");
            let c = store.collection("c").unwrap();
            assert_eq!((c.info().docs, c.info().bytes), (100, 500));
            for i in 0..10 {
                let _ = c.write(upsert(&format!("k{i}"), b"1")).unwrap();
                let _ = c.write(upsert(&format!("new{i}"), b"1")).unwrap();
            }
            // A crash: the recorded counts are stale and must not be used.
        }
        let store = Store::open(config(dir.path())).unwrap();
        let c = store.collection("c").unwrap();
        assert_eq!((c.info().docs, c.info().bytes), (110, 90 * 5 + 20));
    }
}
