//! Reads of an index: bounded scans, paged consistent cursors for SQL, and waiting until
//! an index may be read at a consistency.

use super::{Consistency, Index, IndexManager, IndexState, KeepRow, ScanBounds, ScanRequest, ScanRow};
use crate::{keycode, IndexError, SCAN_ROWS_MAX};
use serde_json::Value;
use shoal_storage::Collection;
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
        let n = self.find(coll, name)?.compiled.key_count();
        let (lo, hi) = byte_bounds(&req.bounds, n)?;
        let index = self.ready(coll, name, req.consistency, req.timeout).await?;
        let (limit, descending, keep) = (req.limit, req.descending, req.keep);
        let fwd = index.fwd.clone();
        let rows = tokio::task::spawn_blocking(move || read_range(&fwd, lo, hi, limit, descending, n, keep.as_ref()))
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
    pub(super) async fn ready(
        &self,
        coll: &Collection,
        name: &str,
        consistency: Consistency,
        timeout: Duration,
    ) -> Result<Arc<Index>, IndexError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let highs = coll.held_high_seqnos();
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
                (IndexState::Ready, Consistency::NotBounded) => return self.whole(coll, name, index, deadline).await,
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
                            return self.whole(coll, name, index, deadline).await;
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
        deadline: tokio::time::Instant,
    ) -> Result<Arc<Index>, IndexError> {
        let mut progress = index.progress.subscribe();
        let mut woken = false;
        loop {
            let behind = coll.behind_serve_floor(|p| index.cursors.lock().get(usize::from(p)).copied().unwrap_or_default());
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

    pub(super) fn read_page(&mut self, max: usize) -> Result<Vec<ScanRow>, IndexError> {
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

pub(super) fn read_range(
    fwd: &fjall::Keyspace,
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
    let iter = fwd.range::<Vec<u8>, _>((lo, hi));
    let iter: Box<dyn Iterator<Item = fjall::Guard>> = if descending { Box::new(iter.rev()) } else { Box::new(iter) };
    let mut rows = Vec::new();
    for guard in iter {
        if rows.len() >= limit {
            break;
        }
        let k = guard.key()?;
        let (key, id) = keycode::decode_components(&k, n)?;
        let id = std::str::from_utf8(id).map_err(|_| IndexError::Corrupt("document key".into()))?;
        if keep.is_some_and(|keep| !(keep.0)(id)) {
            continue;
        }
        rows.push(ScanRow { key, id: id.to_string() });
    }
    Ok(rows)
}
