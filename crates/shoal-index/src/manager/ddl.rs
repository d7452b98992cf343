//! Creating, building, dropping and rebuilding indexes (each serialised by the `ddl` lock),
//! and setting aside an index whose storage fails a check.

use super::{delete_index_storage, load, Index, IndexManager, IndexStatus, Record, NEXT_ID_KEY, REBUILDS_METRIC, REBUILD_RETRY};
use crate::def::IndexDef;
use crate::IndexError;
use parking_lot::Mutex;
use shoal_storage::Collection;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl IndexManager {
    /// The next index id, recorded in the index database (the catalog and the keyspace
    /// names keep it above every id in use even if this write is lost).
    /// With `given`, that id instead (a cluster's metadata log assigns ids): it must be at
    /// least the next free one, which then moves past it — ids are never reused. A rebuild
    /// takes a fresh id from this counter too; a cluster must keep such local ids apart
    /// from the ones it assigns (issue 13).
    pub(super) fn allocate_id(&self, given: Option<u32>) -> Result<u32, IndexError> {
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
        self.create_as(coll, def, None, None).await
    }

    /// [`IndexManager::create`] with the index id given by the caller (see `allocate_id`),
    /// holding only index partitions `held` (every one for `None`): the index service places
    /// an index's partitions on index nodes.
    pub async fn create_as(
        self: &Arc<Self>,
        coll: &Arc<Collection>,
        def: IndexDef,
        id: Option<u32>,
        held: Option<Vec<u16>>,
    ) -> Result<IndexStatus, IndexError> {
        def.compile()?;
        let _ddl = self.ddl.lock().await;
        if self.find(coll, &def.name).is_ok() {
            return Err(IndexError::Exists(def.name));
        }
        let id = self.allocate_id(id)?;
        let record = Record { id, collection_id: coll.id(), collection: coll.name().to_string(), def, held, unlocated: Vec::new() };
        // Durable in the store's catalog before the answer: the index database holds only
        // what can be rebuilt from the definition and the documents.
        self.store.put_catalog(&record.catalog_key(), &record.encode()?)?;
        let index = load(&self.db, &self.meta, &record, coll, self.build_target(coll, record.held.is_some()))?;
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

    /// Where the collection's ready indexes stand in each partition's change stream: the
    /// lowest cursor seqno over them (`None` when it has no ready index). A rebalance hands a
    /// partition over only once this reaches the new active's copy. Indexes fed from the
    /// actives wherever they are (placed by the index service) do not depend on which copy
    /// is active, and hold back no hand-over.
    pub fn lowest_positions(&self, coll: &Collection) -> Option<Vec<shoal_storage::SeqNo>> {
        let colls = self.colls.lock();
        let ready: Vec<&Arc<Index>> = colls
            .get(&coll.id())?
            .indexes
            .iter()
            .filter(|i| {
                !i.dropped.load(std::sync::atomic::Ordering::Acquire)
                    && i.state() == super::IndexState::Ready
                    && !i.parts().is_empty()
                    && self.fed_by(i).is_none()
            })
            .collect();
        if ready.is_empty() {
            return None;
        }
        let lowest = (0..coll.partition_count()).map(|p| ready.iter().map(|i| i.cursor(p).seqno).min().unwrap_or_default()).collect();
        Some(lowest)
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
            for index in &indexes {
                if index.deferred.load(Ordering::Acquire) {
                    // An index holding no part here (placed on other index nodes) has
                    // nothing to build here and no round that would end a build (`active`
                    // leaves it out): it is ready here, as it opens (`catalog`).
                    if !index.parts().is_empty() {
                        *index.target.lock() = Some(self.build_target(coll, index.placed()));
                    }
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
    pub(super) fn persist_built(&self, index: &Index) -> Result<(), IndexError> {
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
    pub(super) async fn forget(&self, index: Arc<Index>, round: Arc<Mutex<()>>, what: Forget) -> Result<(), IndexError> {
        let (id, key, part_count) = (index.id, index.catalog_key(), index.def.part_count());
        let (store, db, meta) = (Arc::clone(&self.store), self.db.clone(), self.meta.clone());
        let parts: Vec<fjall::Keyspace> = index.parts().iter().map(|p| p.ks.clone()).collect();
        let located = index.located.clone();
        drop(index);
        tokio::task::spawn_blocking(move || {
            if what == Forget::WithDefinition {
                // The definition goes first: a crash after it leaves only storage, which the
                // next open removes, never an index that comes back.
                store.delete_catalog(&key)?;
            }
            let _round = round.lock();
            delete_index_storage(&db, &meta, id, part_count, Some((parts, located)))
        })
        .await
        .map_err(|e| IndexError::Invalid(format!("drop task: {e}")))?
    }

    /// Notes that a read of `index`'s storage failed a check, and starts replacing it by a
    /// rebuild (see [`IndexManager::rebuild`]); only the first report of an index acts. The
    /// index is set aside at once: maintainer rounds skip it and scans answer
    /// [`IndexError::Rebuilding`] until its replacement is in place.
    pub(super) fn damaged(&self, index: &Arc<Index>, error: &IndexError) {
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
    pub(super) fn checked<T>(&self, index: &Arc<Index>, result: Result<T, IndexError>) -> Result<T, IndexError> {
        match result {
            Err(e) if is_damage(&e) => {
                self.damaged(index, &e);
                Err(IndexError::Rebuilding { name: index.def.name.clone() })
            }
            other => other,
        }
    }

    /// Replaces the damaged index `old`, retrying until it is done or the index is gone.
    pub(super) async fn rebuild(self: Arc<Self>, old: Arc<Index>) {
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
    pub(super) async fn replace(&self, old: &Arc<Index>) -> Result<(), IndexError> {
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
        let record = Record { id: self.allocate_id(None)?, unlocated: Vec::new(), ..old.record() };
        self.store.put_catalog(&record.catalog_key(), &record.encode()?)?;
        let new = load(&self.db, &self.meta, &record, &coll, self.build_target(&coll, record.held.is_some()))?;
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
}

/// What [`IndexManager::forget`] deletes besides the storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Forget {
    /// Dropped: the definition goes too.
    WithDefinition,
    /// Replaced by a rebuild: the catalog already names the new index.
    StorageOnly,
}

/// Whether an error reading an index's own storage means its stored bytes are damaged (a
/// checksum, an entry that does not decode), so that rebuilding the index is the cure.
pub(super) fn is_damage(e: &IndexError) -> bool {
    match e {
        IndexError::Engine(f) => shoal_storage::is_corruption(f),
        IndexError::Corrupt(_) => true,
        _ => false,
    }
}
