//! The indexes of a collection as a consumer of its change streams (see
//! [`shoal_storage::consumer`]): positions are the indexes' cursors, and a batch of a group of
//! partitions is committed with the cursors in one fjall batch.

use shoal_storage::{follow, ChangeConsumer, FollowLimits, PartitionBatch};

use super::{
    back_key, back_prefix, cursor_key, decode_list, decode_parts, encode_cursor, encode_list, encode_parts, entry_key, part_batch, Index,
    IndexManager, Part, Parts,
};
use crate::{IndexError, CURSOR_STORE_LAG, ROUND_CHANGES_MAX};
use rayon::prelude::*;
use serde_json::Value;
use shoal_storage::{Change, Collection, PartitionId, SeqNo, StreamPosition};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Maps of one batch keyed by document keys, hashed several times per change per index:
/// foldhash (hashbrown's default) instead of SipHash, which had about 5 % of the index
/// workers' samples. Keys come from clients, so its seed is random per process.
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
type FastSet<K> = HashSet<K, foldhash::fast::RandomState>;

/// Brings the indexes up to date on `group` (bounded per partition), reading its
/// partitions in lock step (see [`part_batch`]); true if anything moved.
pub(super) fn catch_up(mgr: &IndexManager, coll: &Collection, active: &[Arc<Index>], group: &[PartitionId]) -> Result<bool, IndexError> {
    let limits = FollowLimits {
        batch_changes: part_batch(group.len()),
        partition_changes_max: ROUND_CHANGES_MAX,
        total_changes_max: usize::MAX,
        include_docs: true,
    };
    let mut feed = IndexFeed { mgr, active, partitions: coll.partition_count() };
    Ok(follow(coll, group, limits, &mut feed)? > 0)
}

/// The indexes of one collection, fed a group of its partitions.
pub(super) struct IndexFeed<'a> {
    pub(super) mgr: &'a IndexManager,
    pub(super) active: &'a [Arc<Index>],
    pub(super) partitions: u16,
}

impl ChangeConsumer for IndexFeed<'_> {
    type Error = IndexError;

    /// The slowest index's cursor: [`apply`] skips, for each index, the changes its own
    /// cursor already covers.
    fn position(&self, p: PartitionId) -> StreamPosition {
        lowest(self.active, p)
    }

    /// History diverged (unclean restart) or tombstones were purged past us: this
    /// partition's part of every index is rebuilt from the start.
    fn rollback(&mut self, p: PartitionId, _shared: SeqNo) -> Result<(), IndexError> {
        for index in self.active {
            reset_partition(self.mgr, index, p, self.partitions)?;
        }
        Ok(())
    }

    fn apply(&mut self, batch: &[PartitionBatch]) -> Result<(), IndexError> {
        self.mgr.wait_for_flushes();
        apply(self.mgr, self.active, batch)
    }
}

/// The lowest position of `indexes` in partition `p`: where following it goes on from.
pub(super) fn lowest(indexes: &[Arc<Index>], p: PartitionId) -> StreamPosition {
    indexes
        .iter()
        .map(|i| (i.cursor(p), i.history(p)))
        .min_by_key(|(c, seen)| (c.seqno, c.uuid == *seen))
        .map(|(c, _)| c)
        .unwrap_or_default()
}

/// What one part of an index stages for one data partition of a batch.
pub(super) struct Staged {
    part: usize,
    pi: usize,
    pos: StreamPosition,
    items: i64,
    /// The cursor went into the batch.
    stored: bool,
}

/// Per change, per index: the entries, each with its part (see [`entries_by_part`]).
pub(super) type PartEntries = Vec<Vec<Vec<(u16, Vec<u8>)>>>;

/// The entries `doc` contributes to `index`, each with its part, sorted by part and then
/// entry (so each part's are sorted too).
pub(super) fn entries_by_part(index: &Index, doc: &Value) -> Vec<(u16, Vec<u8>)> {
    let n = index.def.part_count();
    let mut out: Vec<(u16, Vec<u8>)> = index
        .compiled
        .entries(doc)
        .into_iter()
        // An entry just encoded always decodes; part 0 would only misplace it.
        .map(|e| (crate::partition::part_of_entry(&e, n).unwrap_or(0), e))
        .collect();
    out.sort_unstable();
    out
}

/// Applies one batch of changes of several partitions to every active index, in one atomic
/// write together with the new cursors of every part.
///
/// A change can move a document's entries between parts (its leading value changed), so
/// its old entries are looked for in every part it may have them in: the parts its
/// `located` record names (one read), not all of them — unless the index has so few parts
/// that looking in each costs less (see [`Index::locates`]). A `located` record names only
/// parts held here; a part adopted as files is looked in for every document until the
/// records name it ([`Index::unlocated`], see [`IndexManager::import_part`]), and a
/// record is rewritten whenever its document changes. So on an index node of a cluster, which follows every
/// document but holds a few of the parts, a document whose entries all lie elsewhere costs
/// one read and no write; and a held part the record does not name is not read.
pub(super) fn apply(mgr: &IndexManager, active: &[Arc<Index>], parts: &[PartitionBatch]) -> Result<(), IndexError> {
    // Parse each document once, for all indexes (in parallel within the batch).
    let all: Vec<&Change> = parts.iter().flat_map(|b| &b.changes).collect();
    let computed: PartEntries = all
        .par_iter()
        .with_min_len(64)
        .map(|c| {
            let doc: Option<Value> = if c.deleted { None } else { c.value.as_ref().and_then(|v| serde_json::from_slice(v).ok()) };
            active.iter().map(|i| doc.as_ref().map(|d| entries_by_part(i, d)).unwrap_or_default()).collect()
        })
        .collect();
    let mut batch = mgr.db.batch();
    let mut staged: Vec<(&Arc<Index>, Parts, Vec<Staged>)> = Vec::with_capacity(active.len());
    for (k, index) in active.iter().enumerate() {
        if index.dropped.load(Ordering::Acquire) {
            continue;
        }
        let held = index.parts();
        let unlocated = index.unlocated.lock().clone();
        let slots = held.len();
        if slots == 0 {
            // No part of this index here: nothing to write, no cursor to move.
            continue;
        }
        // Per part (by slot): entry operations, and each document's entries after the batch.
        let mut fwd: Vec<Vec<(Vec<u8>, bool)>> = vec![Vec::new(); slots];
        let mut back: Vec<FastMap<&[u8], Vec<Vec<u8>>>> = vec![FastMap::default(); slots];
        // Per document: the held parts that may hold its entries after the batch, and before it.
        let mut located: FastMap<&[u8], Vec<u16>> = FastMap::default();
        let mut located_before: FastMap<&[u8], Vec<u16>> = FastMap::default();
        // Per part (by slot): the documents whose entries there changed.
        let mut changed: Vec<FastSet<&[u8]>> = vec![FastSet::default(); slots];
        // Per (slot, data partition) whose entries changed: entries added.
        let mut delta: FastMap<(usize, usize), i64> = FastMap::default();
        let cursors: Vec<Vec<StreamPosition>> = held.iter().map(|p| p.cursors.lock().clone()).collect();
        let mut offset = 0;
        for batch_part in parts {
            let pi = usize::from(batch_part.partition);
            let computed = &computed[offset..offset + batch_part.changes.len()];
            offset += batch_part.changes.len();
            for (c, per_index) in batch_part.changes.iter().zip(computed) {
                let key: &[u8] = c.key.as_ref();
                let new_all = &per_index[k];
                let was: Vec<u16> = match located.get(key) {
                    Some(v) => v.clone(),
                    None if index.locates() => {
                        let mut was = mgr.checked(index, read_located(index, key))?;
                        located_before.insert(key, was.clone());
                        // Parts adopted as files are looked in whatever the record says.
                        for &no in &unlocated {
                            if !was.contains(&no) {
                                was.push(no);
                            }
                        }
                        was
                    }
                    // Few parts: each is looked in.
                    None => held.iter().map(|p| p.no).collect(),
                };
                let mut candidates: Vec<u16> = was.iter().copied().chain(new_all.iter().map(|(no, _)| *no)).collect();
                candidates.sort_unstable();
                candidates.dedup();
                let mut now = Vec::with_capacity(candidates.len());
                for no in candidates {
                    let Some(slot) = held.slot(no) else {
                        // Not held here: nothing to do in it, and not recorded (a record
                        // naming it, from before it was dropped here, loses it now).
                        continue;
                    };
                    let new: Vec<Vec<u8>> = new_all.iter().filter(|(n, _)| *n == no).map(|(_, e)| e.clone()).collect();
                    if c.seqno <= cursors[slot][pi].seqno {
                        // This part is past the change already: it keeps what it has.
                        if was.contains(&no) || !new.is_empty() {
                            now.push(no);
                        }
                        continue;
                    }
                    let part = &held[slot];
                    let old: Vec<Vec<u8>> = match back[slot].get(key) {
                        Some(v) => v.clone(),
                        // The record names every held part with entries of the document.
                        None if index.locates() && !was.contains(&no) => Vec::new(),
                        None => mgr.checked(index, read_back(part, key))?,
                    };
                    if old != new {
                        changed[slot].insert(key);
                        let d = delta.entry((slot, pi)).or_default();
                        for o in old.iter().filter(|o| new.binary_search(o).is_err()) {
                            fwd[slot].push((entry_key(o, key), false));
                            *d -= 1;
                        }
                        for e in new.iter().filter(|e| old.binary_search(e).is_err()) {
                            fwd[slot].push((entry_key(e, key), true));
                            *d += 1;
                        }
                    }
                    if !new.is_empty() {
                        now.push(no);
                    }
                    back[slot].insert(key, new);
                }
                located.insert(key, now);
            }
        }
        // Every write of one batch shares one sequence number, so a key must appear in it
        // once: the document's last state. In key order: sorted inserts walk the memtable's
        // skiplist along the path of the previous one, which keeps its nodes in cache.
        let mut docs: Vec<(&[u8], Vec<u16>)> = located.into_iter().collect();
        docs.sort_unstable_by(|a, b| a.0.cmp(b.0));
        for (key, nos) in docs.into_iter().filter(|_| index.locates()) {
            // Unchanged (a write that changed no indexed field): not written again.
            if located_before.get(key) == Some(&nos) {
                continue;
            }
            if nos.is_empty() {
                batch.remove(&index.located, key);
            } else {
                batch.insert(&index.located, key, encode_parts(&nos));
            }
        }
        let mut per_part = Vec::with_capacity(parts.len() * slots);
        for (slot, part) in held.iter().enumerate() {
            let mut entries: Vec<(&[u8], Vec<Vec<u8>>)> =
                std::mem::take(&mut back[slot]).into_iter().filter(|(key, _)| changed[slot].contains(key)).collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            for (key, list) in entries {
                if list.is_empty() {
                    batch.remove(&part.ks, back_key(key));
                } else {
                    batch.insert(&part.ks, back_key(key), encode_list(&list));
                }
            }
            // The sort is stable and only the last operation on an entry is written: an entry
            // added by one change and removed by a later one appears once.
            let mut ops = std::mem::take(&mut fwd[slot]);
            ops.sort_by(|a, b| a.0.cmp(&b.0));
            let mut ops = ops.into_iter().peekable();
            while let Some((key, insert)) = ops.next() {
                if ops.peek().is_some_and(|(next, _)| *next == key) {
                    continue;
                }
                if insert {
                    batch.insert(&part.ks, key, []);
                } else {
                    batch.remove(&part.ks, key);
                }
            }
            let stored = part.stored.lock().clone();
            for batch_part in parts {
                let pi = usize::from(batch_part.partition);
                let items = part.items[pi].load(Ordering::Relaxed) + delta.get(&(slot, pi)).copied().unwrap_or(0);
                debug_assert!(
                    batch_part.changes.iter().all(|c| c.seqno <= batch_part.position.seqno),
                    "a cursor never runs ahead of its entries"
                );
                // The cursor goes in the batch that holds the entries of every change it
                // covers. A part none of whose entries changed keeps the cursor it stored
                // (its entries are those of that cursor too) until it lags by
                // CURSOR_STORE_LAG, or the history changed.
                let (pos, at) = (batch_part.position, stored.get(pi).copied().unwrap_or_default());
                let store = delta.contains_key(&(slot, pi))
                    || pos.uuid != at.uuid
                    || pos.seqno < at.seqno
                    || pos.seqno - at.seqno >= CURSOR_STORE_LAG;
                if store {
                    batch.insert(&part.ks, cursor_key(batch_part.partition), encode_cursor(pos, items));
                }
                per_part.push(Staged { part: slot, pi, pos, items, stored: store });
            }
        }
        staged.push((index, held.clone(), per_part));
    }
    batch.commit()?;
    for (index, held, per_part) in staged {
        for st in per_part {
            let part = &held[st.part];
            part.cursors.lock()[st.pi] = st.pos;
            if st.stored {
                part.stored.lock()[st.pi] = st.pos;
            }
            part.items[st.pi].store(st.items, Ordering::Relaxed);
        }
        index.progress.send_modify(|v| *v += 1);
    }
    Ok(())
}

/// The parts that may hold document `key`'s entries of `index` (a superset: every part its
/// entries were written to since, and no part they were all removed from).
pub(super) fn read_located(index: &Index, key: &[u8]) -> Result<Vec<u16>, IndexError> {
    match index.located.get(key)? {
        Some(v) => decode_parts(&v),
        None => Ok(Vec::new()),
    }
}

/// The composite keys document `key` contributed to `part`.
pub(super) fn read_back(part: &Part, key: &[u8]) -> Result<Vec<Vec<u8>>, IndexError> {
    match part.ks.get(back_key(key))? {
        Some(v) => decode_list(&v),
        None => Ok(Vec::new()),
    }
}

/// Removes every entry that came from partition `p` and puts its cursor back to the start.
pub(super) fn reset_partition(mgr: &IndexManager, index: &Arc<Index>, p: PartitionId, partitions: u16) -> Result<(), IndexError> {
    drop_partitions(mgr, index, &[p], partitions)?;
    tracing::warn!(index = %index.def.name, partition = p, "partition history changed; re-indexing it");
    Ok(())
}

/// Removes every entry that came from the partitions `ps` (one read of each part's back
/// entries) and puts their cursors back to the start, in one batch.
pub(super) fn drop_partitions(mgr: &IndexManager, index: &Arc<Index>, ps: &[PartitionId], partitions: u16) -> Result<(), IndexError> {
    let mut batch = mgr.db.batch();
    let held = index.parts();
    for part in held.iter() {
        for guard in part.ks.prefix(back_prefix()) {
            let (k, v) = guard.into_inner()?;
            let doc_key = &k[1..];
            if ps.contains(&shoal_storage::partition_of(doc_key, partitions)) {
                for e in mgr.checked(index, decode_list(&v))? {
                    batch.remove(&part.ks, entry_key(&e, doc_key));
                }
                batch.remove(&part.ks, k.clone());
            }
        }
        for &p in ps {
            batch.insert(&part.ks, cursor_key(p), encode_cursor(StreamPosition::default(), 0));
        }
    }
    for guard in index.located.iter() {
        let doc_key = guard.key()?;
        if ps.contains(&shoal_storage::partition_of(&doc_key, partitions)) {
            batch.remove(&index.located, doc_key);
        }
    }
    batch.commit()?;
    for part in held.iter() {
        for &p in ps {
            part.cursors.lock()[usize::from(p)] = StreamPosition::default();
            part.stored.lock()[usize::from(p)] = StreamPosition::default();
            part.items[usize::from(p)].store(0, Ordering::Relaxed);
        }
    }
    Ok(())
}
