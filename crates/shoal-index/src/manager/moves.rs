//! Index partitions moved between nodes (issue 41; Couchbase 7.6's file-based rebalance):
//! a part is one keyspace holding its entries, its back entries and its cursors, so a
//! snapshot of its files is consistent with the positions it is at. The source exports
//! parts a group at a time ([`IndexManager::export_parts`]); the receiver adopts the files
//! whole ([`IndexManager::import_parts`]) — nothing is decoded, re-encoded or rebuilt — and its
//! maintainer goes on following the change streams from those positions, so the part
//! catches up on what happened since the snapshot. A scan of the part waits for that
//! (`request_plus`) or the cluster routes none to it until it has ([`IndexManager::wait_parts`]).
//!
//! The receiver's `located` records (which parts a document's entries may be in, node-local)
//! do not learn an adopted part at once: until they do, the maintainer looks for every
//! changed document's old entries in it, as it looks in every part of an index with few
//! parts ([`Index::unlocated`]), and a document's record names the part once the document
//! changes. Once an index has [`LOCATE_PARTS_MIN`] such parts here, looking in each costs
//! more than reading the record, and the records learn them all from their back entries
//! (one local read of each part). A scale-out's new node, which adopts a few parts of each
//! index, so adopts them without writing a record per document.
//! [`IndexManager::add_part`] is the other way, the one moves took before: an empty part
//! rebuilt from every data partition's change stream (the benchmark's comparison).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use shoal_storage::{Collection, FileManifest, KeyspaceFiles, PartitionError};

use super::{
    back_prefix, cursor_key, decode_parts, encode_cursor, encode_parts, load_part, open_index_keyspace, open_index_keyspaces,
    part_keyspace_name, Consistency, Index, IndexManager, Part, Parts, LOCATE_PARTS_MIN,
};
use crate::IndexError;

impl IndexManager {
    /// The lock `coll`'s maintainer holds for a round (none while it has no index): a part
    /// exported, adopted or dropped under it is not in the middle of one.
    fn round_of(&self, coll: &Collection) -> Option<Arc<parking_lot::Mutex<()>>> {
        self.colls.lock().get(&coll.id()).map(|e| Arc::clone(&e.round))
    }

    /// Starts an export of parts `parts` (index name, part number) of `coll` as their
    /// keyspaces' files, all at one snapshot (a group of copies from this node to one
    /// other: their cursors stored by one batch, under one round lock). Refused while an
    /// index is not ready (a building index's parts have no positions to go on from), when
    /// a part is not held here or is still rebuilt from the streams.
    pub fn export_parts(&self, coll: &Collection, parts: &[(String, u16)]) -> Result<Vec<KeyspaceFiles>, IndexError> {
        let mut held = Vec::with_capacity(parts.len());
        for (name, no) in parts {
            let index = self.find(coll, name)?;
            if index.state() != super::IndexState::Ready || index.corrupt.load(std::sync::atomic::Ordering::Acquire) {
                return Err(IndexError::NotReady {
                    name: name.to_string(),
                    state: index.state().as_str(),
                    progress: index.progress_fraction(),
                });
            }
            let part = index
                .parts()
                .part(*no)
                .cloned()
                .ok_or_else(|| IndexError::Unavailable(format!("index {name}: partition {no} is not held here")))?;
            // A part still rebuilt from the streams is not a state the index had.
            index.serving(&[*no])?;
            held.push(part);
        }
        // The copies go on from the cursors in their files: stored as far as each part has
        // applied (no round between), so the receiver does not re-apply what it holds.
        let round = self.round_of(coll);
        let _round = round.as_ref().map(|r| r.lock());
        self.store_cursors(held.iter().map(|p| p.as_ref()))?;
        let snapshot = self.db.snapshot();
        Ok(held.iter().map(|part| KeyspaceFiles::export(&part.ks, &snapshot, Vec::new())).collect::<Result<_, _>>()?)
    }

    /// [`IndexManager::export_parts`] of one part.
    pub fn export_part(&self, coll: &Collection, name: &str, no: u16) -> Result<KeyspaceFiles, IndexError> {
        let mut exports = self.export_parts(coll, &[(name.to_string(), no)])?;
        exports.pop().ok_or_else(|| IndexError::Invalid("an export of one part answered none".into()))
    }

    /// [`IndexManager::import_parts`] of one part: adopted whole, or not at all. Blocking.
    pub fn import_part<I>(
        &self,
        coll: &Collection,
        name: &str,
        no: u16,
        manifest: &FileManifest,
        records: I,
    ) -> Result<shoal_storage::IngestStats, IndexError>
    where
        I: IntoIterator<Item = Result<(Bytes, Bytes), PartitionError>>,
    {
        let mut group = self.import_parts(coll);
        let stats = group.add(name, no, manifest, records)?;
        group.commit()?;
        Ok(stats)
    }

    /// Starts adopting a group of parts of `coll` from another node's exports (as
    /// [`IndexManager::export_parts`] sends them): each is received by [`PartImports::add`]
    /// — its files become the part's keyspace whole, nothing decoded or rebuilt — and
    /// [`PartImports::commit`] makes them the parts this node holds. Blocking: call off the
    /// async threads.
    pub fn import_parts<'a>(&'a self, coll: &'a Collection) -> PartImports<'a> {
        PartImports { manager: self, coll, keyspaces: shoal_storage::KeyspaceImports::new(&self.db), received: Vec::new() }
    }

    /// Makes, as one group, the keyspaces of the parts `parts` (index name, part number) of
    /// `coll` that this node is about to adopt: their records in the index database's
    /// catalog of keyspaces take one fsynced write for them all, where each adoption would
    /// write its own behind the others' (a scale-out's new node adopts hundreds at once).
    /// [`IndexManager::import_part`] then finds its keyspace made and empty. Parts of an
    /// index not known here, out of its range or held already are left out (their
    /// adoption says why). A keyspace made here and never adopted stays empty, and the
    /// next open removes it as storage no index uses. Blocking. Answers how many keyspaces
    /// it made or found.
    pub fn prepare_parts(&self, coll: &Collection, parts: &[(String, u16)]) -> Result<usize, IndexError> {
        let names: Vec<String> = parts
            .iter()
            .filter_map(|(name, no)| self.writable_part(coll, name, *no).ok().map(|index| part_keyspace_name(index.id, *no)))
            .collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        Ok(open_index_keyspaces(&self.db, &names)?.len())
    }

    /// Adds part `no` of index `name` empty: its maintainer builds it from every data
    /// partition's change stream (a move that rebuilds, as before files). Blocking.
    pub fn add_part(&self, coll: &Collection, name: &str, no: u16) -> Result<(), IndexError> {
        let index = self.writable_part(coll, name, no)?;
        let ks = self.empty_part_keyspace(&index, no)?;
        let part = load_part(no, ks, usize::from(coll.partition_count()))?;
        part.serving.store(false, std::sync::atomic::Ordering::Release);
        // Empty: its documents' records name it as its entries are written.
        self.hold(coll, vec![(index, part)], false)
    }

    /// Drops part `no` of index `name` held here (its copy moved to another node): once no
    /// maintainer round uses it, its keyspace is deleted. A scan that took the part set
    /// before still reads its snapshot.
    pub async fn drop_part(&self, coll: &Collection, name: &str, no: u16) -> Result<(), IndexError> {
        let _ddl = self.ddl.lock().await;
        let index = self.find(coll, name)?;
        let Some(part) = index.parts().part(no).cloned() else { return Ok(()) };
        let round = self.round_of(coll);
        let (store, db) = (Arc::clone(&self.store), self.db.clone());
        tokio::task::spawn_blocking(move || {
            let _round = round.as_ref().map(|r| r.lock());
            // The set is read and replaced under its lock: parts adopted and dropped at once
            // (a rebalance adopts several parts of an index together) all stay counted.
            let mut set = index.parts.write();
            let remaining: Vec<Arc<Part>> = set.iter().filter(|p| p.no != no).cloned().collect();
            let held: Vec<u16> = remaining.iter().map(|p| p.no).collect();
            *index.held.lock() = Some(held);
            index.unlocated.lock().retain(|&u| u != no);
            let record = index.record();
            // The definition first: a crash after it leaves only storage, which the next
            // open removes as an orphan.
            store.put_catalog(&record.catalog_key(), &record.encode()?)?;
            *set = Parts::new(remaining);
            drop(set);
            let ks = part.ks.clone();
            drop(part);
            db.delete_keyspace(ks)?;
            index.bump();
            Ok::<(), IndexError>(())
        })
        .await
        .map_err(|e| IndexError::Invalid(format!("drop task: {e}")))??;
        tracing::info!(index = %name, part = no, "index partition dropped here");
        Ok(())
    }

    /// Stores the cursors of `parts` that lag what they applied (see `Part::stored`), in one
    /// batch. Call with their collection's round held, or no maintainer running: a round
    /// between reading a cursor and storing it would be undone.
    pub(super) fn store_cursors<'a>(&self, parts: impl IntoIterator<Item = &'a Part>) -> Result<(), IndexError> {
        let mut batch = self.db.batch();
        let mut staged = Vec::new();
        for part in parts {
            let cursors = part.cursors.lock().clone();
            let stored = part.stored.lock().clone();
            for (pi, (at, was)) in cursors.iter().zip(&stored).enumerate() {
                if at != was {
                    let items = part.items[pi].load(std::sync::atomic::Ordering::Relaxed);
                    batch.insert(&part.ks, cursor_key(pi as shoal_storage::PartitionId), encode_cursor(*at, items));
                }
            }
            staged.push((part, cursors));
        }
        batch.commit()?;
        for (part, cursors) in staged {
            *part.stored.lock() = cursors;
        }
        Ok(())
    }

    /// Waits until parts `parts` of index `name` hold everything the partitions' actives
    /// held when this was called (as a `request_plus` scan of them would).
    pub async fn wait_parts(&self, coll: &Collection, name: &str, parts: &[u16], timeout: Duration) -> Result<(), IndexError> {
        let index = self.find(coll, name)?;
        index.holds(parts)?;
        // A deferred index holds nothing yet: its parts are built where they are once it is.
        if index.state() == super::IndexState::Deferred {
            return Ok(());
        }
        drop(index);
        self.ready(coll, name, Consistency::RequestPlus, timeout, parts).await.map(|_| ())
    }

    /// The index a part may be added to: maintained here, and the part is in range and not
    /// held yet.
    fn writable_part(&self, coll: &Collection, name: &str, no: u16) -> Result<Arc<Index>, IndexError> {
        let index = self.find(coll, name)?;
        if no >= index.def.part_count() {
            return Err(IndexError::Invalid(format!("index {name} has {} partitions; there is no partition {no}", index.def.part_count())));
        }
        if index.parts().part(no).is_some() {
            return Err(IndexError::Exists(format!("{name} partition {no}")));
        }
        Ok(index)
    }

    /// The keyspace of part `no` of `index`, empty (what a failed adoption left is dropped).
    fn empty_part_keyspace(&self, index: &Index, no: u16) -> Result<fjall::Keyspace, IndexError> {
        let name = part_keyspace_name(index.id, no);
        let ks = open_index_keyspace(&self.db, &name)?;
        if ks.is_empty()? {
            return Ok(ks);
        }
        self.db.delete_keyspace(ks)?;
        open_index_keyspace(&self.db, &name)
    }

    /// Once `index` holds [`LOCATE_PARTS_MIN`] parts adopted as files that the `located`
    /// records do not name yet, records them in the records of every document with entries
    /// in them, durably, then says so in the catalog. Call with the collection's round held.
    fn locate_adopted(&self, index: &Index) -> Result<(), IndexError> {
        let nos = index.unlocated.lock().clone();
        if nos.len() < usize::from(LOCATE_PARTS_MIN) {
            return Ok(());
        }
        let parts = index.parts();
        for no in &nos {
            if let Some(part) = parts.part(*no) {
                self.locate_part(index, part)?;
            }
        }
        // The records first: a catalog saying they are there while a crash lost them would
        // leave entries no change looks for.
        self.db.persist(fjall::PersistMode::SyncAll)?;
        let _set = index.parts.write();
        index.unlocated.lock().retain(|no| !nos.contains(no));
        let record = index.record();
        self.store.put_catalog(&record.catalog_key(), &record.encode()?)?;
        tracing::debug!(index = %index.def.name, parts = ?nos, "adopted index partitions located");
        Ok(())
    }

    /// Records part `part` in the `located` record of every document with entries in it.
    fn locate_part(&self, index: &Index, part: &Part) -> Result<(), IndexError> {
        let mut batch = self.db.batch();
        for guard in part.ks.prefix(back_prefix()) {
            let key = guard.key()?;
            let doc = &key[1..];
            let mut nos = match index.located.get(doc)? {
                Some(v) => decode_parts(&v)?,
                None => Vec::new(),
            };
            if !nos.contains(&part.no) {
                nos.push(part.no);
                nos.sort_unstable();
                batch.insert(&index.located, doc, encode_parts(&nos));
            }
        }
        batch.commit()?;
        Ok(())
    }

    /// Makes `parts` parts their indexes hold here: recorded in the catalog (one durable
    /// write for them all), then in the sets the maintainer and scans use. `adopted`: their
    /// documents' `located` records do not name them (see the module's doc).
    fn hold(&self, coll: &Collection, parts: Vec<(Arc<Index>, Part)>, adopted: bool) -> Result<(), IndexError> {
        // Per index, its new parts, in index order: its set is read and replaced under its
        // lock (see `drop_part`), each index's lock taken in that order.
        let mut by_index: std::collections::BTreeMap<u32, (Arc<Index>, Vec<Part>)> = std::collections::BTreeMap::new();
        for (index, part) in parts {
            by_index.entry(index.id).or_insert_with(|| (index, Vec::new())).1.push(part);
        }
        // Every set checked before any index changes: a part held already refuses them all.
        let groups: Vec<(Arc<Index>, Vec<Part>)> = by_index.into_values().collect();
        let indexes: Vec<Arc<Index>> = groups.iter().map(|(index, _)| Arc::clone(index)).collect();
        let mut sets = Vec::with_capacity(groups.len());
        for (index, (_, new)) in indexes.iter().zip(&groups) {
            let set = index.parts.write();
            if let Some(part) = new.iter().find(|p| set.part(p.no).is_some()) {
                return Err(IndexError::Exists(format!("{} partition {}", index.def.name, part.no)));
            }
            sets.push(set);
        }
        let mut records = Vec::with_capacity(groups.len());
        // What each index recorded before: put back if the catalog does not take the new.
        let mut before = Vec::with_capacity(groups.len());
        for ((index, new), set) in groups.iter().zip(&sets) {
            before.push((index.held.lock().clone(), index.unlocated.lock().clone()));
            let mut nos: Vec<u16> = set.iter().map(|p| p.no).chain(new.iter().map(|p| p.no)).collect();
            nos.sort_unstable();
            debug_assert!(nos.windows(2).all(|w| w[0] < w[1]), "a part is held once");
            *index.held.lock() = Some(nos);
            if adopted && index.locates() {
                index.unlocated.lock().extend(new.iter().map(|p| p.no));
            }
            let record = index.record();
            records.push(record.encode().map(|encoded| (record.catalog_key(), encoded)));
        }
        let written = records.into_iter().collect::<Result<Vec<_>, _>>().and_then(|r| Ok(self.store.put_catalog_many(&r)?));
        if let Err(e) = written {
            for (index, (held, unlocated)) in indexes.iter().zip(before) {
                *index.held.lock() = held;
                *index.unlocated.lock() = unlocated;
            }
            return Err(e);
        }
        for ((mut set, index), (_, new)) in sets.into_iter().zip(&indexes).zip(groups) {
            let parts: Vec<Arc<Part>> = set.iter().cloned().chain(new.into_iter().map(Arc::new)).collect();
            *set = Parts::new(parts);
            drop(set);
            index.bump();
        }
        if let Some(e) = self.colls.lock().get(&coll.id()) {
            e.wake.notify_one();
            if adopted {
                e.adopted.notify_one();
            }
        }
        Ok(())
    }
}

/// Index partitions adopted as one group from one source (see
/// [`IndexManager::import_parts`]): the copies that are all memtable items, as a small
/// part's is, land through the journal in one batch and one fsync
/// ([`shoal_storage::KeyspaceImports`]), and the catalog learns every part by one durable
/// write, where each part's adoption would make its own behind the others'. Parts received
/// and not committed are not held: their keyspaces are emptied when adopted again, or
/// removed by the next open as storage no index uses.
pub struct PartImports<'a> {
    manager: &'a IndexManager,
    coll: &'a Collection,
    keyspaces: shoal_storage::KeyspaceImports<'a>,
    received: Vec<(Arc<Index>, u16, fjall::Keyspace)>,
}

impl PartImports<'_> {
    /// Receives part `no` of index `name`: `manifest`, then its `records`. Refused when the
    /// part is held here already or was received in this group. Answers what arrived
    /// (records and bytes).
    pub fn add<I>(&mut self, name: &str, no: u16, manifest: &FileManifest, records: I) -> Result<shoal_storage::IngestStats, IndexError>
    where
        I: IntoIterator<Item = Result<(Bytes, Bytes), PartitionError>>,
    {
        let index = self.manager.writable_part(self.coll, name, no)?;
        if self.received.iter().any(|(i, n, _)| i.id == index.id && *n == no) {
            return Err(IndexError::Exists(format!("{name} partition {no} (twice in one group)")));
        }
        let ks = self.manager.empty_part_keyspace(&index, no)?;
        let stats = self.keyspaces.add(&ks, manifest, records)?;
        tracing::debug!(index = %name, part = no, files = manifest.files().count(), bytes = stats.bytes, "index partition received as files");
        self.received.push((index, no, ks));
        Ok(stats)
    }

    /// Makes every part received the parts this node holds, durably; their cursors are the
    /// positions the maintainer goes on from; the `located` records learn them later (see
    /// the module's doc). Answers how many.
    pub fn commit(self) -> Result<usize, IndexError> {
        let PartImports { manager, coll, keyspaces, received } = self;
        keyspaces.commit()?;
        let n = usize::from(coll.partition_count());
        let parts: Vec<(Arc<Index>, Part)> =
            received.into_iter().map(|(index, no, ks)| Ok((index, load_part(no, ks, n)?))).collect::<Result<_, IndexError>>()?;
        let count = parts.len();
        let indexes: Vec<Arc<Index>> = {
            let mut seen: Vec<Arc<Index>> = Vec::new();
            for (index, _) in &parts {
                if !seen.iter().any(|i| i.id == index.id) {
                    seen.push(Arc::clone(index));
                }
            }
            seen
        };
        // Under the collection's round lock: a round that read a document's `located`
        // record before `locate_adopted` wrote it would write it back without the parts (their
        // entries there would then never be removed), and two parts of one index adopted
        // at once would each write their own over the other's.
        let round = manager.round_of(coll);
        let located = round.as_ref().map(|r| r.lock());
        manager.hold(coll, parts, true)?;
        // The parts are adopted whatever happens here: until the records learn them,
        // changes look in them.
        for index in &indexes {
            if let Err(e) = manager.locate_adopted(index) {
                tracing::warn!(index = %index.def.name, error = %e, "the located records did not learn the adopted index partitions; changes go on looking in them");
            }
        }
        drop(located);
        tracing::info!(parts = count, indexes = indexes.len(), "index partitions adopted from files");
        Ok(count)
    }
}
