//! Reads of an index: bounded scans, paged consistent cursors for SQL, and waiting until
//! an index may be read at a consistency.

use super::{entry_of, fwd_range, Consistency, Index, IndexManager, IndexState, KeepRow, ScanBounds, ScanRequest, ScanRow};
use crate::partition::parts_of_scan;
use crate::{keycode, IndexError, SCAN_ROWS_MAX};

/// How often a fed `request_plus` that has the actives' seqnos on another history asks
/// them again (see [`IndexManager::ready`]).
const FEED_RECHECK: Duration = Duration::from_millis(200);
use serde_json::Value;
use shoal_storage::Collection;
use std::collections::{BinaryHeap, VecDeque};
use std::ops::Bound;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

impl IndexManager {
    /// Rows of `name` within the request's bounds, in index order.
    pub async fn scan(&self, coll: &Collection, name: &str, req: ScanRequest) -> Result<Vec<ScanRow>, IndexError> {
        if req.limit > SCAN_ROWS_MAX {
            return Err(IndexError::Invalid(format!("limit is at most {SCAN_ROWS_MAX}")));
        }
        let found = self.find(coll, name)?;
        let n = found.compiled.key_count();
        let (lo, hi) = byte_bounds(&req.bounds, n)?;
        let mut read = parts_of_scan(&req.bounds, found.def.part_count());
        if let Some(only) = &req.parts {
            read.retain(|no| only.contains(no));
        }
        found.holds(&read)?;
        drop(found);
        let index = self.ready(coll, name, req.consistency, req.timeout, &read).await?;
        let (limit, descending, keep) = (req.limit, req.descending, req.keep);
        let parts = part_keyspaces(&index, &read)?;
        let rows = tokio::task::spawn_blocking(move || read_range(&parts, lo, hi, limit, descending, n, keep.as_ref()))
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
        let found = self.find(coll, name)?;
        let n = found.compiled.key_count();
        let (lo, hi) = byte_bounds(bounds, n)?;
        let read = parts_of_scan(bounds, found.def.part_count());
        found.holds(&read)?;
        drop(found);
        let index = self.ready(coll, name, consistency, timeout, &read).await?;
        let empty = matches!((&lo, &hi), (Bound::Included(l) | Bound::Excluded(l), Bound::Included(h) | Bound::Excluded(h)) if l > h);
        let parts = part_keyspaces(&index, &read)?
            .into_iter()
            .map(|ks| PartCursor { ks, next: lo.clone(), buffered: VecDeque::new(), done: empty })
            .collect();
        Ok(IndexCursor { snapshot: self.db.snapshot(), parts, hi, n, index, mgr: self.me.clone() })
    }

    /// Waits until index `name` may be read at `consistency`: ready, and for `request_plus`
    /// holding every change made before this call in the parts `read` (a scan waits for the
    /// parts it reads only). Returns the index to read: a damaged index is replaced by its
    /// rebuild, which `request_plus` waits for.
    pub(super) async fn ready(
        &self,
        coll: &Collection,
        name: &str,
        consistency: Consistency,
        timeout: Duration,
        read: &[u16],
    ) -> Result<Arc<Index>, IndexError> {
        let deadline = tokio::time::Instant::now() + timeout;
        // Fed from elsewhere, `request_plus` waits for the actives' positions, history
        // included; on its own partitions, for their high seqnos (rolled back with them).
        let fed = self.fed_by(&*self.find(coll, name)?).cloned();
        let (mut highs, mut at) = match (consistency, &fed) {
            (Consistency::RequestPlus, Some(fetcher)) => {
                let at = fetcher.highs(coll).await?;
                (at.iter().map(|p| p.seqno).collect(), Some(at))
            }
            _ => (coll.held_high_seqnos(), None),
        };
        let mut asked = tokio::time::Instant::now();
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
                (IndexState::Ready, Consistency::NotBounded) => {
                    index.serving(read)?;
                    return self.whole(coll, name, index, read, deadline).await;
                }
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
                        // A part dropped here while this waits (the placement moved it) will
                        // not catch up here: said now, not at the timeout (a drop bumps the
                        // progress this waits on).
                        index.holds(read)?;
                        let reached = at.as_ref().is_none_or(|at| index.reaches_parts(at, read));
                        let caught_up = index.caught_up_parts(&highs, read);
                        if caught_up && reached && index.state() == IndexState::Ready {
                            return self.whole(coll, name, index, read, deadline).await;
                        }
                        // Fed: at the seqnos but on another history than the actives said at
                        // the start. A hand-over since (the new active's history goes on from
                        // the old one's at the same seqno) or a failover (the index is rolled
                        // back by its next fetch) — asking the actives again tells which; what
                        // they answer later includes everything they held at the start.
                        let again = asked + FEED_RECHECK;
                        if let (Some(fetcher), true, false) = (&fed, caught_up, reached) {
                            if tokio::time::Instant::now() >= again {
                                let fresh = fetcher.highs(coll).await?;
                                highs = fresh.iter().map(|p| p.seqno).collect();
                                at = Some(fresh);
                                asked = tokio::time::Instant::now();
                                continue;
                            }
                        }
                        let wake = if fed.is_some() && caught_up && !reached { deadline.min(again) } else { deadline };
                        match tokio::time::timeout_at(wake, progress.changed()).await {
                            Err(_) if wake < deadline => {}
                            Err(_) => return Err(IndexError::Timeout),
                            Ok(Err(_)) => return Err(IndexError::NotFound(name.to_string())),
                            Ok(Ok(())) => {}
                        }
                    }
                }
            }
        }
    }
}

impl IndexManager {
    /// Waits (until `deadline`) until `index` holds every partition active here whole: at or
    /// past the high seqno its copy opened at, on its history (see
    /// [`Collection::behind_serve_floor`]). A partition that moved here is followed from its
    /// change stream, at any consistency: a ready index is not yet whole for it.
    async fn whole(
        &self,
        coll: &Collection,
        name: &str,
        index: Arc<Index>,
        read: &[u16],
        deadline: tokio::time::Instant,
    ) -> Result<Arc<Index>, IndexError> {
        if self.fed_by(&index).is_some() {
            // Fed from the actives wherever they are: no partition comes to this node.
            return Ok(index);
        }
        let mut progress = index.progress.subscribe();
        let mut woken = false;
        loop {
            let cursors = index.cursors_of(read);
            let behind = coll.behind_serve_floor(|p| cursors.get(usize::from(p)).copied().unwrap_or_default());
            let Some(partition) = behind else { return Ok(index) };
            if index.dropped.load(Ordering::Acquire) {
                return Err(IndexError::NotFound(name.to_string()));
            }
            if !woken {
                woken = true;
                if let Some(e) = self.colls.lock().get(&coll.id()) {
                    e.wake.notify_one();
                }
            }
            match tokio::time::timeout_at(deadline, progress.changed()).await {
                Err(_) => return Err(IndexError::CatchingUp { name: name.to_string(), partition }),
                Ok(Err(_)) => return Err(IndexError::NotFound(name.to_string())),
                Ok(Ok(())) => {}
            }
        }
    }
}

/// The byte range of `bounds` over entries of an index with `n` keys.
/// A range of encoded entries: (start, end).
pub(super) type ByteRange = (Bound<Vec<u8>>, Bound<Vec<u8>>);

pub(super) fn byte_bounds(bounds: &ScanBounds, n: usize) -> Result<ByteRange, IndexError> {
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

/// The keyspaces of the parts `read`, every one of them: a part dropped here since the read
/// looked (the placement moved it) is `Unavailable`, never left out of the answer.
fn part_keyspaces(index: &Index, read: &[u16]) -> Result<Vec<fjall::Keyspace>, IndexError> {
    let parts = index.parts();
    read.iter().map(|&no| parts.part(no).map(|p| p.ks.clone()).ok_or_else(|| index.not_held(no))).collect()
}

/// Rows a part's cursor reads ahead of the merge at a time, at least.
const CURSOR_READ_AHEAD_MIN: usize = 64;

/// See [`IndexManager::cursor`]: every part read reads in pages, and the pages are merged
/// in entry order.
pub struct IndexCursor {
    snapshot: fjall::Snapshot,
    parts: Vec<PartCursor>,
    hi: Bound<Vec<u8>>,
    n: usize,
    /// The index read, and its manager, told if the read meets damage.
    index: Arc<Index>,
    mgr: Weak<IndexManager>,
}

/// Where a cursor stands in one part.
struct PartCursor {
    ks: fjall::Keyspace,
    /// Where the next read of this part starts (entry bounds).
    next: Bound<Vec<u8>>,
    /// Read, not yet handed out: (entry, row).
    buffered: VecDeque<(Vec<u8>, ScanRow)>,
    /// Nothing more to read from the part.
    done: bool,
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

    pub(super) fn read_page(&mut self, max: usize) -> Result<Vec<ScanRow>, IndexError> {
        let ahead = (max / self.parts.len().max(1)).clamp(CURSOR_READ_AHEAD_MIN, max.max(CURSOR_READ_AHEAD_MIN));
        let mut rows = Vec::with_capacity(max.min(SCAN_ROWS_MAX));
        while rows.len() < max {
            for part in &mut self.parts {
                if part.buffered.is_empty() && !part.done {
                    part.fill(&self.snapshot, &self.hi, self.n, ahead)?;
                }
            }
            // The smallest head of the parts' buffers; entries are unique across parts.
            let Some(next) =
                self.parts.iter().enumerate().filter_map(|(i, p)| p.buffered.front().map(|(e, _)| (e, i))).min().map(|(_, i)| i)
            else {
                break;
            };
            if let Some((_, row)) = self.parts[next].buffered.pop_front() {
                rows.push(row);
            }
        }
        Ok(rows)
    }
}

impl PartCursor {
    /// Reads up to `max` more rows of the part from the snapshot.
    fn fill(&mut self, snapshot: &fjall::Snapshot, hi: &Bound<Vec<u8>>, n: usize, max: usize) -> Result<(), IndexError> {
        use fjall::Readable;
        let mut read = 0;
        for guard in snapshot.range(&self.ks, fwd_range(&self.next, hi)).take(max) {
            let k = guard.key()?;
            let entry = entry_of(&k).ok_or_else(|| IndexError::Corrupt("entry outside the entry range".into()))?;
            self.buffered.push_back((entry.to_vec(), decode_row(entry, n)?));
            self.next = Bound::Excluded(entry.to_vec());
            read += 1;
        }
        if read < max {
            self.done = true;
        }
        Ok(())
    }
}

/// The row of an entry (`composite key ++ document key`) of an index with `n` keys.
fn decode_row(entry: &[u8], n: usize) -> Result<ScanRow, IndexError> {
    let (key, id) = keycode::decode_components(entry, n)?;
    let id = std::str::from_utf8(id).map_err(|_| IndexError::Corrupt("document key".into()))?.to_string();
    Ok(ScanRow { key, id })
}

/// At most `limit` rows within the entry bounds `lo`..`hi` over the parts `parts`, in
/// entry order (reversed when `descending`), merged from one ordered read of each part.
pub(super) fn read_range(
    parts: &[fjall::Keyspace],
    lo: Bound<Vec<u8>>,
    hi: Bound<Vec<u8>>,
    limit: usize,
    descending: bool,
    n: usize,
    keep: Option<&KeepRow>,
) -> Result<Vec<ScanRow>, IndexError> {
    if let (Bound::Included(l) | Bound::Excluded(l), Bound::Included(h) | Bound::Excluded(h)) = (&lo, &hi) {
        if l > h {
            return Ok(Vec::new());
        }
    }
    let range = fwd_range(&lo, &hi);
    let mut iters: Vec<Box<dyn Iterator<Item = fjall::Guard>>> = parts
        .iter()
        .map(|ks| {
            let iter = ks.range::<Vec<u8>, _>(range.clone());
            let iter: Box<dyn Iterator<Item = fjall::Guard>> = if descending { Box::new(iter.rev()) } else { Box::new(iter) };
            iter
        })
        .collect();
    // The head of each part's read; the merge takes the smallest (largest when descending).
    let mut heads: BinaryHeap<Head> = BinaryHeap::with_capacity(iters.len());
    let next = |iter: &mut Box<dyn Iterator<Item = fjall::Guard>>, from: usize| -> Result<Option<Head>, IndexError> {
        match iter.next() {
            None => Ok(None),
            Some(guard) => {
                let k = guard.key()?;
                let entry = entry_of(&k).ok_or_else(|| IndexError::Corrupt("entry outside the entry range".into()))?.to_vec();
                Ok(Some(Head { entry, from, descending }))
            }
        }
    };
    for (i, iter) in iters.iter_mut().enumerate() {
        if let Some(head) = next(iter, i)? {
            heads.push(head);
        }
    }
    let mut rows = Vec::new();
    while rows.len() < limit {
        let Some(head) = heads.pop() else { break };
        if let Some(following) = next(&mut iters[head.from], head.from)? {
            heads.push(following);
        }
        let row = decode_row(&head.entry, n)?;
        if keep.is_some_and(|keep| !(keep.0)(&row.id)) {
            continue;
        }
        rows.push(row);
    }
    Ok(rows)
}

/// A part's next entry in a merge: ordered so that the max-heap pops the entry that comes
/// first in the scan's direction.
#[derive(PartialEq, Eq)]
struct Head {
    entry: Vec<u8>,
    from: usize,
    descending: bool,
}

impl Ord for Head {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        let by_entry = self.entry.cmp(&other.entry);
        if self.descending {
            by_entry
        } else {
            by_entry.reverse()
        }
    }
}

impl PartialOrd for Head {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
