//! Index partitions moved between nodes (issue 41; Couchbase 7.6's file-based rebalance):
//! a part is one keyspace holding its entries, its back entries and its cursors, so a
//! snapshot of its files is consistent with the positions it is at. The source exports it
//! ([`IndexManager::export_part`]); the receiver adopts the files whole
//! ([`IndexManager::import_part`]) — nothing is decoded, re-encoded or rebuilt — and its
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

    /// Starts an export of part `no` of index `name` as its keyspace's files at a snapshot.
    /// Refused while the index is not ready (a building index's parts have no positions to
    /// go on from) or when the part is not held here.
    pub fn export_part(&self, coll: &Collection, name: &str, no: u16) -> Result<KeyspaceFiles, IndexError> {
        let index = self.find(coll, name)?;
        if index.state() != super::IndexState::Ready || index.corrupt.load(std::sync::atomic::Ordering::Acquire) {
            return Err(IndexError::NotReady {
                name: name.to_string(),
                state: index.state().as_str(),
                progress: index.progress_fraction(),
            });
        }
        let parts = index.parts();
        let part = parts.part(no).ok_or_else(|| IndexError::Unavailable(format!("index {name}: partition {no} is not held here")))?;
        // A part still rebuilt from the streams is not a state the index had.
        index.serving(&[no])?;
        // The copy goes on from the cursors in its files: stored as far as the part has
        // applied (no round between), so the receiver does not re-apply what it holds.
        let round = self.round_of(coll);
        let _round = round.as_ref().map(|r| r.lock());
        self.store_cursors([part.as_ref()])?;
        let snapshot = self.db.snapshot();
        Ok(KeyspaceFiles::export(&part.ks, &snapshot, Vec::new())?)
    }

    /// Adopts part `no` of index `name` from another node's export (`manifest`, then its
    /// `records`): its files become the part's keyspace whole (a copy that is all memtable
    /// items, as a small part's is, lands through the journal in one batch:
    /// `shoal_storage::import_small_keyspace`), its cursors are the positions the maintainer
    /// goes on from; the `located` records learn it later (see the module's doc). Refused
    /// when the part is held here already. Blocking: call off the async threads. Answers
    /// what arrived (records and bytes).
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
        let index = self.writable_part(coll, name, no)?;
        let ks = self.empty_part_keyspace(&index, no)?;
        let stats = shoal_storage::import_small_keyspace(&self.db, &ks, manifest, records)?;
        let part = load_part(no, ks, usize::from(coll.partition_count()))?;
        // Under the collection's round lock: a round that read a document's `located`
        // record before `locate_adopted` wrote it would write it back without the parts (their
        // entries there would then never be removed), and two parts of one index adopted
        // at once would each write their own over the other's.
        let round = self.round_of(coll);
        let located = round.as_ref().map(|r| r.lock());
        self.hold(coll, &index, part, true)?;
        // The part is adopted whatever happens here: until the records learn it, changes
        // look in it.
        if let Err(e) = self.locate_adopted(&index) {
            tracing::warn!(index = %name, error = %e, "the located records did not learn the adopted index partitions; changes go on looking in them");
        }
        drop(located);
        tracing::info!(index = %name, part = no, files = manifest.files().count(), bytes = stats.bytes, "index partition adopted from files");
        Ok(stats)
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
        self.hold(coll, &index, part, false)
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

    /// Makes `part` one of the parts `index` holds here: recorded in the catalog, then in
    /// the set the maintainer and scans use. `adopted`: its documents' `located` records
    /// do not name it (see the module's doc).
    fn hold(&self, coll: &Collection, index: &Arc<Index>, part: Part, adopted: bool) -> Result<(), IndexError> {
        // Read and replaced under the set's lock (see `drop_part`).
        let mut set = index.parts.write();
        if set.part(part.no).is_some() {
            return Err(IndexError::Exists(format!("{} partition {}", index.def.name, part.no)));
        }
        let no = part.no;
        let mut parts: Vec<Arc<Part>> = set.iter().cloned().collect();
        parts.push(Arc::new(part));
        let held: Vec<u16> = {
            let mut h: Vec<u16> = parts.iter().map(|p| p.no).collect();
            h.sort_unstable();
            h
        };
        *index.held.lock() = Some(held);
        if adopted && index.locates() {
            index.unlocated.lock().push(no);
        }
        let record = index.record();
        self.store.put_catalog(&record.catalog_key(), &record.encode()?)?;
        *set = Parts::new(parts);
        drop(set);
        index.bump();
        if let Some(e) = self.colls.lock().get(&coll.id()) {
            e.wake.notify_one();
        }
        Ok(())
    }
}
