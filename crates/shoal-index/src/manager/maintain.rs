//! Maintenance: one task per collection running rounds on the worker pool — a build's
//! key-order read of the documents, and the change streams applied to the indexes.

use super::*;

/// One collection's maintainer: rounds on the worker pool while there is news, then waits
/// for a change, a wake-up (new index, build, scan) or the idle poll.
pub(super) async fn maintain(mgr: Arc<IndexManager>, coll: Arc<Collection>, wake: Arc<Notify>, round: Arc<Mutex<()>>) {
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
pub(super) fn run_round(mgr: &IndexManager, coll: &Collection, active: &[Arc<Index>]) -> Result<bool, IndexError> {
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
pub(super) fn scan_round(mgr: &IndexManager, coll: &Collection, scanning: &[Arc<Index>]) -> Result<bool, IndexError> {
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
pub(super) fn group_size(behind: usize, workers: usize) -> usize {
    behind.div_ceil(workers.max(1)).max(1)
}

/// Changes read from each partition of a group per batch: about [`GROUP_CHANGES`] in all.
pub(super) fn part_batch(group: usize) -> usize {
    (GROUP_CHANGES / group.max(1)).clamp(PART_BATCH_MIN, BATCH_CHANGES)
}

/// One partition's part of a group's batch.
pub(super) struct PartBatch {
    p: PartitionId,
    changes: Vec<Change>,
    pos: StreamPosition,
}

pub(super) fn catch_up(mgr: &IndexManager, coll: &Collection, active: &[Arc<Index>], group: &[PartitionId]) -> Result<bool, IndexError> {
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
pub(super) struct Staged {
    pi: usize,
    pos: StreamPosition,
    items: i64,
}

/// Applies one batch of changes of several partitions to every active index, in one atomic
/// write together with the new cursors.
pub(super) fn apply(mgr: &IndexManager, active: &[Arc<Index>], parts: &[PartBatch]) -> Result<(), IndexError> {
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
pub(super) fn read_back(index: &Index, key: &[u8]) -> Result<Vec<Vec<u8>>, IndexError> {
    match index.back.get(key)? {
        Some(v) => decode_list(&v),
        None => Ok(Vec::new()),
    }
}

/// A document key and the composite keys it contributed.
pub(super) type BackEntry = (fjall::Slice, Vec<Vec<u8>>);

/// The back entries of the documents of partition `p`.
pub(super) fn back_entries_of(index: &Index, p: PartitionId, partitions: u16) -> Result<Vec<BackEntry>, IndexError> {
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
pub(super) fn reset_partition(mgr: &IndexManager, index: &Arc<Index>, p: PartitionId, partitions: u16) -> Result<(), IndexError> {
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
