//! Opening the index database: definitions from the store's catalog, a damaged database
//! moved aside (quarantine), orphans removed, every index loaded with its cursors.

use super::{
    cursor_partition, cursor_prefix, decode_cursor, is_damage, legacy_def_key, located_keyspace_name, parse_legacy_keyspace_name,
    parse_located_keyspace_name, parse_part_keyspace_name, part_keyspace_name, scan_key, Index, Part, Parts, Record, ScanState,
    CATALOG_PREFIX, INDEX_CACHE_BYTES, INDEX_DIR, INDEX_MEMTABLE_MAX_BYTES, LEGACY_CURSOR_PREFIX, LEGACY_DEF_PREFIX, META_KEYSPACE,
    NEXT_ID_KEY, QUARANTINE_SUFFIX,
};
use crate::IndexError;
use parking_lot::Mutex;
use shoal_storage::{Collection, SeqNo, Store, StreamPosition};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use tokio::sync::watch;

/// What [`open_database`] found: the database and the indexes to attach.
pub(super) struct Opened {
    pub(super) db: fjall::Database,
    pub(super) meta: fjall::Keyspace,
    pub(super) indexes: Vec<(Arc<Collection>, Arc<Index>)>,
    pub(super) next_id: u32,
    /// Indexes whose storage failed a check while loading, replaced by new ones to build.
    pub(super) rebuilt: Vec<String>,
}

/// Whether an error opening or reading the index database at start means its files are
/// damaged, so that moving them aside and rebuilding is the cure. Besides failed checks,
/// that is any engine error but those of the environment (see [`environmental`]): a missing
/// or truncated file of the database's own is damage too.
pub(super) fn damaged_at_open(e: &IndexError) -> bool {
    match e {
        IndexError::Corrupt(_) => true,
        IndexError::Engine(f) => !environmental(f),
        _ => false,
    }
}

/// An engine error caused by the environment rather than the database's files:
/// permissions, a full or read-only disk, memory, another process holding the database.
/// Moving the files aside would not help, and a fresh database would fail the same way.
pub(super) fn environmental(e: &fjall::Error) -> bool {
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
pub(super) fn quarantine(path: &Path) -> Result<PathBuf, IndexError> {
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
pub(super) fn open_fjall(path: &Path) -> Result<fjall::Database, IndexError> {
    std::panic::catch_unwind(|| {
        fjall::Database::builder(path)
            .cache_size(INDEX_CACHE_BYTES)
            // Flushes and compactions of the index keyspaces run below the request threads,
            // as the index workers do: a bulk load's flushes otherwise took the cores from
            // scans for seconds (`bench/results/2026-12-05-issue41-index-memtables-bounded.md`).
            .worker_thread_start(|| shoal_storage::threads::lower_this_thread(crate::INDEX_WORKER_NICE))
            .open()
    })
    .map_err(|_| IndexError::Corrupt("the storage engine failed a check opening the index database".into()))?
    .map_err(IndexError::from)
}

/// Reads the definitions in the store's catalog. One that does not decode is left out and
/// logged (its index cannot be served; its storage is removed as an orphan).
pub(super) fn read_catalog(store: &Store) -> Result<BTreeMap<String, Record>, IndexError> {
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
/// `target` gives a new or loaded index's build target (see [`load`]).
pub(super) fn open_database(store: &Store, path: &Path, target: &dyn Fn(&Collection, bool) -> Vec<SeqNo>) -> Result<Opened, IndexError> {
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
    let mut live = HashMap::new();
    let mut found = Vec::new();
    for r in records.values() {
        match store.collection(&r.collection).filter(|c| c.id() == r.collection_id) {
            Some(coll) => {
                found.push((coll, r));
                live.insert(r.id, r.held_parts());
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
    let mut next_id = next_id.max(stored_next).max(live.keys().max().map_or(1, |m| m + 1));
    debug_assert!(live.keys().all(|&id| id < next_id));
    // Loaded once orphans are gone: an index of the layout before partitions starts again.
    // An index whose cursors fail a check is replaced by a new index of its definition,
    // built like a new one, while the others load as they are.
    let mut indexes = Vec::new();
    let mut rebuilt = Vec::new();
    for (coll, r) in found {
        let index = match load(&db, &meta, r, &coll, target(&coll, r.held.is_some())) {
            Ok(index) => index,
            Err(e) if is_damage(&e) => {
                let record = Record { id: next_id, unlocated: Vec::new(), ..r.clone() };
                next_id = next_id.checked_add(1).ok_or_else(|| IndexError::Invalid("index ids are exhausted".into()))?;
                meta.insert(NEXT_ID_KEY, next_id.to_be_bytes())?;
                store.put_catalog(&record.catalog_key(), &record.encode()?)?;
                delete_index_storage(&db, &meta, r.id, r.def.part_count(), None)?;
                tracing::error!(index = %r.def.name, collection = %r.collection, error = %e, "index storage failed a check at start: rebuilding the index from the documents");
                rebuilt.push(format!("index {} of collection {} ({e})", r.def.name, r.collection));
                load(&db, &meta, &record, &coll, target(&coll, record.held.is_some()))?
            }
            Err(e) => return Err(e),
        };
        indexes.push((Arc::clone(&coll), index));
    }
    Ok(Opened { db, meta, indexes, next_id, rebuilt })
}

/// Removes the keyspaces, cursors and build positions of ids no live definition has
/// (dropped or replaced indexes whose storage a crash left behind), parts beyond a live
/// index's part count, and the storage of the layout before index partitions (one entry
/// and one back keyspace per index, cursors under `meta`): an index found in that layout
/// loses its build position too, so it is built again, in parts. `live` maps each live
/// index id to its part count. Returns an id above every id the database has seen.
pub(super) fn remove_orphans(
    db: &fjall::Database,
    meta: &fjall::Keyspace,
    live: &HashMap<u32, Vec<u16>>,
    batch: &mut fjall::OwnedWriteBatch,
) -> Result<u32, IndexError> {
    let mut next = 1u32;
    let mut legacy = HashSet::new();
    for name in db.list_keyspace_names() {
        let (id, orphan) = if let Some((id, part)) = parse_part_keyspace_name(&name) {
            (id, live.get(&id).is_none_or(|held| !held.contains(&part)))
        } else if let Some(id) = parse_located_keyspace_name(&name) {
            (id, !live.contains_key(&id))
        } else if let Some(id) = parse_legacy_keyspace_name(&name) {
            legacy.insert(id);
            (id, true)
        } else {
            continue;
        };
        next = next.max(id.saturating_add(1));
        if orphan {
            tracing::info!(keyspace = %&*name, "removing index storage no index uses");
            let ks = db.keyspace(&name, fjall::KeyspaceCreateOptions::default)?;
            db.delete_keyspace(ks)?;
        }
    }
    for guard in meta.prefix(LEGACY_CURSOR_PREFIX) {
        batch.remove(meta, guard.key()?);
    }
    let prefix = b"scan/";
    for guard in meta.prefix(prefix) {
        let k = guard.key()?;
        let id = std::str::from_utf8(&k[prefix.len()..]).ok().and_then(|rest| u32::from_str_radix(rest.get(..8)?, 16).ok());
        if id.is_some_and(|id| !live.contains_key(&id) || legacy.contains(&id)) {
            batch.remove(meta, k);
        }
    }
    Ok(next)
}

/// Opens (creating if new) the keyspace of index `id` locating documents' entries.
pub(super) fn open_located(db: &fjall::Database, id: u32) -> Result<fjall::Keyspace, IndexError> {
    open_index_keyspace(db, &located_keyspace_name(id))
}

/// Opens (creating if new) keyspace `name` of the index database.
pub(super) fn open_index_keyspace(db: &fjall::Database, name: &str) -> Result<fjall::Keyspace, IndexError> {
    Ok(db.keyspace(name, index_keyspace_options)?)
}

/// Opens keyspaces `names` of the index database, creating those that are new as one group
/// (one fsynced record of them all; `fjall::Database::keyspaces`).
pub(super) fn open_index_keyspaces(db: &fjall::Database, names: &[&str]) -> Result<Vec<fjall::Keyspace>, IndexError> {
    Ok(db.keyspaces(names, index_keyspace_options)?)
}

fn index_keyspace_options() -> fjall::KeyspaceCreateOptions {
    fjall::KeyspaceCreateOptions::default().max_memtable_size(INDEX_MEMTABLE_MAX_BYTES)
}

/// Opens (creating if new) the keyspaces of parts `parts` of index `id`.
pub(super) fn open_parts(
    db: &fjall::Database,
    id: u32,
    parts: impl Iterator<Item = u16>,
) -> Result<Vec<(u16, fjall::Keyspace)>, IndexError> {
    parts.map(|no| Ok((no, open_index_keyspace(db, &part_keyspace_name(id, no))?))).collect()
}

/// The index of definition `r`, with its cursors and build position as persisted (none
/// for a new index, which its maintainer then builds from the documents).
/// `target` is the high seqnos the index must reach to be ready again (empty: the highs of
/// its first fetch, for an index fed from elsewhere).
pub(super) fn load(
    db: &fjall::Database,
    meta: &fjall::Keyspace,
    r: &Record,
    coll: &Collection,
    target: Vec<SeqNo>,
) -> Result<Arc<Index>, IndexError> {
    let compiled = r.def.compile()?;
    let n = usize::from(coll.partition_count());
    let mut parts = Vec::new();
    for (no, ks) in open_parts(db, r.id, r.held_parts().into_iter())? {
        parts.push(Arc::new(load_part(no, ks, n)?));
    }
    let scan = match meta.get(scan_key(r.id))? {
        Some(v) => Some(ScanState::decode(&v, n)?),
        None => None,
    };
    let parts_empty = parts.is_empty();
    Ok(Arc::new(Index {
        id: r.id,
        collection_id: r.collection_id,
        collection: r.collection.clone(),
        def: r.def.clone(),
        compiled,
        parts: parking_lot::RwLock::new(Parts::new(parts)),
        held: Mutex::new(r.held.as_ref().map(|_| r.held_parts())),
        located: open_located(db, r.id)?,
        unlocated: Mutex::new(r.unlocated.iter().copied().filter(|no| r.held_parts().contains(no)).collect()),
        deferred: AtomicBool::new(r.def.defer_build),
        dropped: AtomicBool::new(false),
        corrupt: AtomicBool::new(false),
        // Holding no part here, it has nothing to build.
        target: Mutex::new((!parts_empty).then_some(target)),
        histories: Mutex::new(vec![0; usize::from(coll.partition_count())]),
        progress: watch::channel(0).0,
        scan: Mutex::new(scan),
    }))
}

/// Part `no` in keyspace `ks`, with its cursors and entry counts as its keyspace holds them
/// (of `n` data partitions).
pub(super) fn load_part(no: u16, ks: fjall::Keyspace, n: usize) -> Result<Part, IndexError> {
    let mut cursors = vec![StreamPosition::default(); n];
    let items: Vec<AtomicI64> = (0..n).map(|_| AtomicI64::new(0)).collect();
    for guard in ks.prefix(cursor_prefix()) {
        let (k, v) = guard.into_inner()?;
        let p = cursor_partition(&k).map(usize::from);
        if let (Some(p), Some((pos, count))) = (p, decode_cursor(&v)) {
            if p < n {
                cursors[p] = pos;
                items[p].store(count, Ordering::Relaxed);
            }
        }
    }
    Ok(Part { no, ks, stored: Mutex::new(cursors.clone()), cursors: Mutex::new(cursors), items, serving: AtomicBool::new(true) })
}

/// Deletes index `id`'s build position and the keyspaces of its parts (`open`, or every
/// part below `part_count` opened here).
pub(super) fn delete_index_storage(
    db: &fjall::Database,
    meta: &fjall::Keyspace,
    id: u32,
    part_count: u16,
    open: Option<(Vec<fjall::Keyspace>, fjall::Keyspace)>,
) -> Result<(), IndexError> {
    let mut batch = db.batch();
    batch.remove(meta, legacy_def_key(id));
    batch.remove(meta, scan_key(id));
    batch.commit()?;
    let (parts, located) = match open {
        Some(ks) => ks,
        None => (open_parts(db, id, 0..part_count)?.into_iter().map(|(_, ks)| ks).collect(), open_located(db, id)?),
    };
    for ks in parts {
        db.delete_keyspace(ks)?;
    }
    db.delete_keyspace(located)?;
    db.persist(fjall::PersistMode::SyncAll)?;
    Ok(())
}
