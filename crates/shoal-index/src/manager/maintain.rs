//! Maintenance: one task per collection running rounds on the worker pool — a build's
//! key-order read of the documents, and the change streams applied to the indexes.

use super::fed::fed_round;
use super::{
    back_key, catch_up, cursor_key, encode_cursor, encode_list, encode_parts, entries_by_part, entry_key, scan_key, Index, IndexManager,
    PartEntries, ScanState, FLUSH_WAIT_MAX, FLUSH_WAIT_POLL, IDLE_POLL, REBUILDS_METRIC,
};
use crate::{IndexError, BATCH_CHANGES, GROUP_CHANGES, PART_BATCH_MIN, SCAN_BATCH_DOCS, SCAN_ROUND_DOCS};
use parking_lot::Mutex;
use rayon::prelude::*;
use serde_json::Value;
use shoal_storage::{Collection, PartitionId, StreamPosition};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::Notify;

/// What wakes a collection's maintainer.
pub(super) struct Signals {
    /// A new index, a build, a scan waiting (`CollEntry::wake`).
    pub wake: Arc<Notify>,
    /// Parts adopted from files (`CollEntry::adopted`).
    pub adopted: Arc<Notify>,
}

/// One collection's maintainer: rounds on the worker pool while there is news, then waits
/// for a change, a wake-up (new index, build, scan) or the idle poll.
pub(super) async fn maintain(
    mgr: Arc<IndexManager>,
    coll: Arc<Collection>,
    signals: Signals,
    round: Arc<Mutex<()>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let Signals { wake, adopted } = signals;
    let mut changed = coll.changed();
    let _running = mgr.health.running();
    loop {
        if *stop.borrow_and_update() {
            return;
        }
        if let Err(e) = mgr.bound_memtables(super::INDEX_MEMTABLES_MAX_BYTES) {
            tracing::warn!(error = %e, "flushing the index memtables over their budget");
        }
        mgr.release_flushed_memtables();
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
            // Placed indexes follow the actives wherever they are, through the fetcher —
            // unless every partition is active here, when they follow this node's own
            // streams as the others do.
            // While the fetcher cannot tell (not connected yet), placed indexes wait.
            let here = mgr.fetcher.as_ref().map(|f| (f, f.all_here(&coll)));
            let fetcher = match here {
                Some((f, Some(false))) => Some(Arc::clone(f)),
                _ => None,
            };
            let waiting = matches!(here, Some((_, None)));
            let (fed, local): (Vec<Arc<Index>>, Vec<Arc<Index>>) =
                active.into_iter().filter(|i| !(waiting && i.placed())).partition(|i| fetcher.is_some() && i.placed());
            let mut results = Vec::with_capacity(2);
            if !local.is_empty() {
                let (tx, rx) = tokio::sync::oneshot::channel();
                let (c, r) = (Arc::clone(&coll), Arc::clone(&round));
                let m = Arc::clone(&mgr);
                mgr.pool.spawn(move || {
                    let _round = r.lock();
                    let _ = tx.send(run_round(&m, &c, &local));
                });
                results.push(rx.await);
            }
            let fetched = fetcher.filter(|_| !fed.is_empty());
            if let Some(fetcher) = &fetched {
                // The round fetches (waiting for news) before it applies.
                tokio::select! {
                    r = fed_round(&mgr, fetcher, &coll, fed, Arc::clone(&round), &adopted) => results.push(Ok(r)),
                    _ = stop.changed() => continue,
                }
            }
            let mut retry = false;
            for result in results {
                match result {
                    Ok(Ok(p)) => {
                        mgr.health.round_succeeded();
                        progressed |= p;
                    }
                    Ok(Err(
                        IndexError::Changes(shoal_storage::ChangesError::CollectionDropped)
                        | IndexError::Read(shoal_storage::ReadError::CollectionDropped),
                    )) => retry = true,
                    // An index met damage and was set aside (reported where it was met); the
                    // others go on at once.
                    Ok(Err(IndexError::Rebuilding { .. })) => retry = true,
                    Ok(Err(e)) => {
                        tracing::warn!(collection = %coll.name(), error = %e, "index maintenance failed; retrying");
                        mgr.health.round_failed(&format!("collection {}: {e}", coll.name()));
                        tokio::time::sleep(IDLE_POLL).await;
                    }
                    Err(_) => return,
                }
            }
            if retry || fetched.is_some() {
                // The fetch waited for news already.
                continue;
            }
        }
        if !progressed {
            tokio::select! {
                _ = changed.changed() => {}
                _ = wake.notified() => {}
                _ = tokio::time::sleep(IDLE_POLL) => {}
                _ = stop.changed() => {}
            }
        }
    }
}

impl IndexManager {
    /// Bytes the index database's memtables hold (active and sealed, not yet flushed).
    pub fn memtable_bytes(&self) -> u64 {
        self.db.write_buffer_size()
    }

    /// Keeps the index partitions' active memtables within `budget` bytes together: past
    /// it, the largest are sealed and handed to the engine's flush workers, largest first,
    /// until those left hold at most half the budget (so that flushes come in batches, not
    /// one per round). A part's memtable otherwise flushes only at its own limit, which
    /// hundreds of small parts never reach, and the engine bounds its journal only as
    /// memtables flush. Cheap below the budget (one counter read). Answers how many
    /// memtables it sealed.
    pub fn bound_memtables(&self, budget: u64) -> Result<usize, IndexError> {
        if self.db.write_buffer_size() <= budget {
            return Ok(0);
        }
        let mut held: Vec<(u64, fjall::Keyspace)> =
            self.index_keyspaces().into_iter().map(|ks| (ks.active_memtable_size(), ks)).filter(|(size, _)| *size > 0).collect();
        let mut left: u64 = held.iter().map(|(size, _)| size).sum();
        // Sealed memtables still being flushed count in the database's figure, not here.
        if left <= budget {
            return Ok(0);
        }
        held.sort_by_key(|(size, _)| std::cmp::Reverse(*size));
        let mut sealed = 0;
        for (size, ks) in held {
            if left <= budget / 2 {
                break;
            }
            if ks.rotate_memtable()? {
                sealed += 1;
            }
            left = left.saturating_sub(size);
        }
        tracing::debug!(sealed, budget, "index memtables over their budget handed to the flush workers");
        Ok(sealed)
    }

    /// Waits, up to [`FLUSH_WAIT_MAX`], until the index memtables not flushed yet hold at
    /// most [`INDEX_WRITE_BUFFER_MAX_BYTES`], sealing the largest active ones first (only
    /// sealed memtables flush). Called by the maintainers before each write batch (a build's
    /// and a round's of changes), on the worker pool: indexing then goes as fast as its
    /// entries reach the tables, and a node's memory stays bounded however many indexes
    /// build at once. Cheap below the bound (one counter read).
    pub(super) fn wait_for_flushes(&self) {
        let max = self.write_buffer_max.load(Ordering::Relaxed);
        if self.db.write_buffer_size() <= max {
            return;
        }
        let started = std::time::Instant::now();
        if let Err(e) = self.bound_memtables(max.min(super::INDEX_MEMTABLES_MAX_BYTES)) {
            tracing::warn!(error = %e, "sealing index memtables to flush them");
        }
        // A node stopping does not wait: its close flushes everything anyway.
        while self.db.write_buffer_size() > max && !*self.stop.borrow() {
            if started.elapsed() >= FLUSH_WAIT_MAX {
                tracing::warn!(
                    unflushed = self.db.write_buffer_size(),
                    max,
                    "index memtables did not flush within {FLUSH_WAIT_MAX:?}; indexing goes on past the bound"
                );
                break;
            }
            std::thread::sleep(FLUSH_WAIT_POLL);
        }
        tracing::debug!(waited_ms = started.elapsed().as_millis() as u64, "index writes waited for the flushes");
    }

    /// Sets the bound of [`Self::wait_for_flushes`] (for tests; the node keeps
    /// [`INDEX_WRITE_BUFFER_MAX_BYTES`]).
    #[doc(hidden)]
    pub fn set_write_buffer_max(&self, bytes: u64) {
        self.write_buffer_max.store(bytes, Ordering::Relaxed);
    }

    /// Lets go of the memtables the index database flushed and still holds in its older
    /// tree versions (see the vendored `fjall::Database::release_versions`): without it a
    /// part flushed once and then quiet kept its flushed memtable in memory, and a bulk
    /// load of 100 indexes left a node 1.3 GB of them. Cheap when there is nothing to let
    /// go (a lock and a length per part). Answers how many versions were dropped.
    pub fn release_flushed_memtables(&self) -> usize {
        self.db.release_versions()
    }

    /// Bytes of memtables the index keyspaces' trees hold in any of their versions: the
    /// active and sealed ones ([`Self::memtable_bytes`]) and flushed ones an older version
    /// still holds until [`Self::release_flushed_memtables`].
    pub fn memtables_held_bytes(&self) -> u64 {
        use fjall::AbstractTree;
        self.index_keyspaces().iter().map(|ks| ks.tree.get_version_history_lock().memtable_size_sum()).sum()
    }

    /// Every keyspace index writes go to: each index partition's this node holds, each
    /// index's `located` records, and the index database's own (builds' positions).
    fn index_keyspaces(&self) -> Vec<fjall::Keyspace> {
        let colls = self.colls.lock();
        let indexes = colls.values().flat_map(|e| e.indexes.iter());
        let mut all: Vec<fjall::Keyspace> =
            indexes.flat_map(|i| i.parts().iter().map(|p| p.ks.clone()).chain([i.located.clone()]).collect::<Vec<_>>()).collect();
        all.push(self.meta.clone());
        all
    }
}

/// Brings every partition with news up to date (bounded per partition), in parallel on the
/// pool; then marks indexes that reached their build target ready. True if anything moved.
///
/// Partitions are handled in groups whose batches are applied together (see [`group_size`]).
pub(super) fn run_round(mgr: &IndexManager, coll: &Collection, active: &[Arc<Index>]) -> Result<bool, IndexError> {
    // A target left to the first round (see `build_target`): this node's highs.
    for index in active {
        let mut target = index.target.lock();
        if target.as_ref().is_some_and(Vec::is_empty) {
            *target = Some(coll.held_high_seqnos());
        }
    }
    let Plan { scanning, streaming } = plan_scan(mgr, coll, active)?;
    let now = coll.positions();
    let held = coll.held_here();
    for index in active {
        index.seen(now.iter().enumerate().filter(|(p, _)| held[*p]).map(|(p, at)| (p as PartitionId, at.uuid)));
    }
    // Partitions that left this node (or are being copied in anew): their entries go, in one
    // pass over each index, so that they neither leak nor count in `items`. Not from an
    // index fed from the actives wherever they are (it follows every partition).
    let node_local: Vec<&Arc<Index>> = streaming.iter().filter(|i| mgr.fed_by(i).is_none()).collect();
    let gone: Vec<PartitionId> = (0..coll.partition_count())
        .filter(|&p| {
            let pi = usize::from(p);
            !held[pi]
                && node_local
                    .iter()
                    .any(|i| i.parts().iter().any(|part| part.cursors.lock()[pi].seqno > 0 || part.items[pi].load(Ordering::Relaxed) != 0))
        })
        .collect();
    if !gone.is_empty() {
        for index in &node_local {
            super::stream::drop_partitions(mgr, index, &gone, coll.partition_count())?;
        }
        tracing::info!(collection = %coll.name(), partitions = ?gone, "index entries of partitions no longer on this node dropped");
    }
    // Behind: short of the high seqno, or on another history (a copy rolled back below the
    // cursor after a failover has a lower high; `follow` finds where the two part).
    let behind: Vec<PartitionId> = (0..coll.partition_count())
        .filter(|&p| held[usize::from(p)])
        .filter(|&p| {
            let at = now[usize::from(p)];
            streaming.iter().any(|i| i.parts().iter().any(|part| !part.cursors.lock()[usize::from(p)].reaches(at)))
        })
        .collect();
    let size = group_size(behind.len(), mgr.pool.current_num_threads());
    let (scanned, streamed) = rayon::join(
        || if scanning.is_empty() { Ok(false) } else { scan_round(mgr, coll, &scanning) },
        || behind.par_chunks(size).map(|group| catch_up(mgr, coll, &streaming, group)).try_reduce(|| false, |a, b| Ok(a || b)),
    );
    let moved = scanned? | streamed?;
    // Parts rebuilt from the streams (see `add_part`) serve once they reach the highs.
    let highs: Vec<_> = now.iter().map(|p| p.seqno).collect();
    for index in active {
        index.serve_caught_up(&highs);
    }
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
pub(super) struct Plan {
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
pub(super) fn plan_scan(mgr: &IndexManager, coll: &Collection, active: &[Arc<Index>]) -> Result<Plan, IndexError> {
    let live = || active.iter().filter(|i| !i.dropped.load(Ordering::Acquire));
    let mut scanning: Vec<Arc<Index>> = live().filter(|i| i.scan.lock().is_some()).cloned().collect();
    let unstarted = |i: &Index| {
        i.scan.lock().is_none()
            && i.target.lock().as_ref().is_some_and(|t| t.iter().any(|&h| h > 0))
            && i.parts().iter().all(|part| part.cursors.lock().iter().all(|c| c.seqno == 0) && part.items() == 0)
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
pub(super) fn scan_round(mgr: &IndexManager, coll: &Collection, scanning: &[Arc<Index>]) -> Result<bool, IndexError> {
    let partitions = coll.partition_count();
    let mut done = 0;
    while done < SCAN_ROUND_DOCS {
        let Some(state) = scanning.iter().find_map(|i| i.scan.lock().clone()) else {
            return Ok(done > 0);
        };
        mgr.wait_for_flushes();
        let docs = coll.scan_docs(state.after.as_deref(), SCAN_BATCH_DOCS)?;
        let mut batch = mgr.db.batch();
        let Some(last) = docs.last().map(|d| d.0.clone()) else {
            for index in scanning {
                for part in index.parts().iter() {
                    for (p, pos) in state.start.iter().enumerate() {
                        let items = part.items[p].load(Ordering::Relaxed);
                        batch.insert(&part.ks, cursor_key(p as PartitionId), encode_cursor(*pos, items));
                    }
                }
                batch.remove(&mgr.meta, scan_key(index.id));
            }
            batch.commit()?;
            for index in scanning {
                for part in index.parts().iter() {
                    part.cursors.lock().clone_from_slice(&state.start);
                    part.stored.lock().clone_from_slice(&state.start);
                }
                *index.scan.lock() = None;
                index.progress.send_modify(|v| *v += 1);
            }
            return Ok(true);
        };
        let computed: PartEntries = docs
            .par_iter()
            .with_min_len(64)
            .map(|(_, body)| {
                let doc: Option<Value> = serde_json::from_slice(body).ok();
                scanning.iter().map(|i| doc.as_ref().map(|d| entries_by_part(i, d)).unwrap_or_default()).collect()
            })
            .collect();
        let next = ScanState { after: Some(last), scanned: state.scanned + docs.len() as u64, ..state };
        let mut staged = Vec::with_capacity(scanning.len());
        for (k, index) in scanning.iter().enumerate() {
            // Per part (by slot): its entries, and per data partition the entries added.
            let held = index.parts();
            let mut fwd: Vec<Vec<Vec<u8>>> = vec![Vec::new(); held.len()];
            let mut delta: Vec<HashMap<PartitionId, i64>> = vec![HashMap::new(); held.len()];
            for ((key, _), per_index) in docs.iter().zip(&computed) {
                let entries = &per_index[k];
                let p = shoal_storage::partition_of(key, partitions);
                // Each key comes once and nothing was indexed for it before: no back read.
                let mut nos = Vec::new();
                for group in entries.chunk_by(|a, b| a.0 == b.0) {
                    let Some(slot) = held.slot(group[0].0) else { continue };
                    let list: Vec<Vec<u8>> = group.iter().map(|(_, e)| e.clone()).collect();
                    for e in &list {
                        fwd[slot].push(entry_key(e, key));
                    }
                    batch.insert(&held[slot].ks, back_key(key), encode_list(&list));
                    *delta[slot].entry(p).or_default() += list.len() as i64;
                    nos.push(group[0].0);
                }
                if !nos.is_empty() && index.locates() {
                    batch.insert(&index.located, key.as_ref(), encode_parts(&nos));
                }
            }
            let mut items = Vec::new();
            for (slot, part) in held.iter().enumerate() {
                let mut keys = std::mem::take(&mut fwd[slot]);
                keys.sort_unstable();
                for key in keys {
                    batch.insert(&part.ks, key, []);
                }
                for (&p, d) in &delta[slot] {
                    let n = part.items[usize::from(p)].load(Ordering::Relaxed) + d;
                    batch.insert(&part.ks, cursor_key(p), encode_cursor(StreamPosition::default(), n));
                    items.push((slot, usize::from(p), n));
                }
            }
            batch.insert(&mgr.meta, scan_key(index.id), next.encode());
            staged.push((held, items));
        }
        batch.commit()?;
        for (index, (held, items)) in scanning.iter().zip(staged) {
            for (slot, p, n) in items {
                held[slot].items[p].store(n, Ordering::Relaxed);
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
pub(super) fn group_size(behind: usize, workers: usize) -> usize {
    behind.div_ceil(workers.max(1)).max(1)
}

/// Changes read from each partition of a group per batch: about [`GROUP_CHANGES`] in all.
pub(super) fn part_batch(group: usize) -> usize {
    (GROUP_CHANGES / group.max(1)).clamp(PART_BATCH_MIN, BATCH_CHANGES)
}
