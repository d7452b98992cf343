//! A collection: named documents spread over the store's virtual partitions.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use bytes::Bytes;
use tokio::sync::watch;

use crate::changes::{Change, FeedPosition, PartitionSubscription, Rollback, StreamPosition};
use crate::codec;
use crate::error::{ChangesError, ReadError, WriteError};
use crate::partition::{Document, MutationOutcome, Partition, ReadLimit, WriteOp, WriteRequest};
use crate::syncer::Syncer;
use crate::{partition_of, Cas, PartitionId, SeqNo};

/// Size of a collection, for listings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CollectionInfo {
    pub name: String,
    pub docs: u64,
    pub bytes: u64,
    pub max_ttl: u32,
}

pub struct Collection {
    pub(crate) name: String,
    pub(crate) id: u32,
    pub(crate) max_ttl: u32,
    /// One copy per partition, replaced whole when the partition is dropped or ingested.
    pub(crate) partitions: Vec<ArcSwap<Partition>>,
    pub(crate) changed: Arc<watch::Sender<u64>>,
    pub(crate) dropped: Arc<AtomicBool>,
    /// The store's clock: time for expiry decisions.
    pub(crate) clock: Arc<crate::clock::CasClock>,
}

/// Durability still to wait for after a write: one fsync ticket per data path touched.
#[must_use = "a persist write is durable only once this is awaited"]
#[derive(Default)]
pub struct DurableWait {
    waits: Vec<(Arc<Syncer>, u64)>,
}

impl std::fmt::Debug for DurableWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DurableWait").field("tickets", &self.waits.iter().map(|(_, t)| *t).collect::<Vec<_>>()).finish()
    }
}

impl DurableWait {
    fn add(&mut self, syncer: &Arc<Syncer>, ticket: u64) {
        if ticket == 0 {
            return;
        }
        match self.waits.iter_mut().find(|(s, _)| Arc::ptr_eq(s, syncer)) {
            Some((_, t)) => *t = (*t).max(ticket),
            None => self.waits.push((Arc::clone(syncer), ticket)),
        }
    }

    /// Resolves once every write behind this receipt is fsynced.
    pub async fn wait(self) -> Result<(), WriteError> {
        for (syncer, ticket) in self.waits {
            syncer.wait_durable(ticket).await?;
        }
        Ok(())
    }
}

impl Collection {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Unique for the store's lifetime: a collection dropped and created again gets a new id.
    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn partition_count(&self) -> u16 {
        self.partitions.len() as u16
    }

    /// Unix seconds by the store's clock (what expiry is decided by).
    pub fn now_secs(&self) -> u64 {
        self.clock.unix_secs()
    }

    pub fn info(&self) -> CollectionInfo {
        let (docs, bytes) = self
            .partitions
            .iter()
            .map(|slot| slot.load())
            .fold((0i64, 0i64), |(d, b), p| (d + p.docs_count.load(Ordering::Relaxed), b + p.docs_bytes.load(Ordering::Relaxed)));
        CollectionInfo { name: self.name.clone(), docs: docs.max(0) as u64, bytes: bytes.max(0) as u64, max_ttl: self.max_ttl }
    }

    /// Bytes of the live documents in partition `partition` (0 for one that does not exist).
    pub fn partition_bytes(&self, partition: PartitionId) -> u64 {
        self.partitions.get(usize::from(partition)).map_or(0, |slot| slot.load().docs_bytes.load(Ordering::Relaxed).max(0) as u64)
    }

    /// The high seqno of every partition, in partition order.
    /// Partition `partition`'s high seqno (0 for a partition that does not exist).
    pub fn high_seqno(&self, partition: PartitionId) -> SeqNo {
        self.partitions.get(usize::from(partition)).map_or(0, |p| p.load().high_seqno())
    }

    pub fn high_seqnos(&self) -> Vec<SeqNo> {
        self.partitions.iter().map(|p| p.load().high_seqno()).collect()
    }

    /// [`Collection::high_seqnos`] of the partitions this node holds (active or replica), 0
    /// for the others: what state derived from this node's copies (indexes, shadows) can
    /// reach, and so what a `request_plus` read or a build waits for.
    pub fn held_high_seqnos(&self) -> Vec<SeqNo> {
        self.partitions
            .iter()
            .map(|p| {
                let p = p.load();
                if p.is_held() {
                    p.high_seqno()
                } else {
                    0
                }
            })
            .collect()
    }

    /// The first partition active here whose derived state, at `position(p)`, is not yet
    /// complete enough to serve: behind the copy's serve floor (the high seqno it opened at,
    /// see [`Partition::serve_floor`]) or on a history the copy diverged from. Indexes and
    /// shadows check it before they answer for the partitions this node serves, so that a
    /// partition that arrived by a move, a promotion or a rollback is never read half-built.
    pub fn behind_serve_floor(&self, position: impl Fn(PartitionId) -> StreamPosition) -> Option<PartitionId> {
        self.partitions.iter().find_map(|slot| {
            let p = slot.load();
            if !p.is_active() {
                return None;
            }
            let at = position(p.id());
            let resume = rollback_point(&p, at).unwrap_or(at.seqno);
            (resume < at.seqno || at.seqno < p.serve_floor()).then_some(p.id())
        })
    }

    /// Per partition: whether this node holds a copy of it now, active or replica. State
    /// derived from a partition that is not held here (it moved away, or is being copied in
    /// anew) is dropped by its keeper.
    pub fn held_here(&self) -> Vec<bool> {
        self.partitions.iter().map(|p| p.load().is_held()).collect()
    }

    /// Per partition: whether this node holds its active copy now.
    pub fn active_here(&self) -> Vec<bool> {
        self.partitions.iter().map(|p| p.load().is_active()).collect()
    }

    pub fn partition_uuids(&self) -> Vec<u64> {
        self.partitions.iter().map(|p| p.load().uuid()).collect()
    }

    /// Partition `partition`'s change-stream position now (see [`Collection::positions`]);
    /// `None` for a partition the collection does not have. One partition's, without the
    /// others': a replica's pull reads it for each part it serves.
    pub fn position(&self, partition: PartitionId) -> Option<StreamPosition> {
        self.partitions.get(usize::from(partition)).map(|p| {
            let p = p.load();
            StreamPosition { seqno: p.high_seqno(), uuid: p.uuid() }
        })
    }

    /// Where partition `partition`'s copy here ends: the epoch of its last failover entry
    /// and its high seqno (see [`crate::FailoverEntry::epoch`]); copies compare by it.
    pub fn history_end(&self, partition: PartitionId) -> Option<(u64, SeqNo)> {
        self.partitions.get(usize::from(partition)).map(|p| {
            let p = p.load();
            crate::partition::history_end(p.failover_log(), p.high_seqno())
        })
    }

    /// Every partition's change-stream position now (high seqno and history UUID): where
    /// a reader that has seen everything up to this moment goes on from.
    pub fn positions(&self) -> Vec<StreamPosition> {
        self.partitions
            .iter()
            .map(|p| {
                let p = p.load();
                StreamPosition { seqno: p.high_seqno(), uuid: p.uuid() }
            })
            .collect()
    }

    /// Live documents in key order after `after` (from the start when `None`), at most
    /// `max`, merged over all partitions: `(key, body)`.
    ///
    /// Each call reads the store as it is now; a caller that needs every change since some
    /// point combines this with the change streams from positions taken before the first
    /// call (the index build does). Each partition is read in key order and the reads are
    /// merged, so the order is the same whatever the partition count.
    pub fn scan_docs(&self, after: Option<&[u8]>, max: usize) -> Result<Vec<(Bytes, Bytes)>, ReadError> {
        let low = match after {
            Some(k) => std::ops::Bound::Excluded(k),
            None => std::ops::Bound::Unbounded,
        };
        self.scan_docs_range(low, None, max)
    }

    /// Like [`Collection::scan_docs`], over the keys from `low` up to `until` (exclusive), so
    /// that several readers can split one collection by key ranges.
    pub fn scan_docs_range(&self, low: std::ops::Bound<&[u8]>, until: Option<&[u8]>, max: usize) -> Result<Vec<(Bytes, Bytes)>, ReadError> {
        self.scan_docs_range_in(low, until, max, &|_| true)
    }

    /// Like [`Collection::scan_docs_range`], over the partitions `keep` picks only (in a
    /// cluster: the ones active on this node, the others' copies being another member's
    /// to answer for).
    pub fn scan_docs_range_in(
        &self,
        low: std::ops::Bound<&[u8]>,
        until: Option<&[u8]>,
        max: usize,
        keep: &dyn Fn(PartitionId) -> bool,
    ) -> Result<Vec<(Bytes, Bytes)>, ReadError> {
        use std::cmp::Reverse;
        use std::ops::Bound;
        if self.is_dropped() {
            return Err(ReadError::CollectionDropped);
        }
        if let (Bound::Included(l) | Bound::Excluded(l), Some(h)) = (low, until) {
            if l >= h {
                return Ok(Vec::new());
            }
        }
        let low: Bound<Vec<u8>> = match low {
            Bound::Included(k) => Bound::Included(codec::doc_key(self.id, k)),
            Bound::Excluded(k) => Bound::Excluded(codec::doc_key(self.id, k)),
            Bound::Unbounded => Bound::Included(codec::prefix(self.id, codec::TAG_DOC).to_vec()),
        };
        let high: Bound<Vec<u8>> = Bound::Excluded(match until {
            Some(k) => codec::doc_key(self.id, k),
            None => codec::tag_range(self.id, codec::TAG_DOC).end.to_vec(),
        });
        let now = self.clock.unix_secs();
        let mut iters: Vec<fjall::Iter> = (0..self.partition_count())
            .filter(|p| keep(*p))
            .map(|p| self.partitions[usize::from(p)].load().ks.range((low.clone(), high.clone())))
            .collect();
        // One head per partition, smallest key first: a k-way merge that reads each
        // partition only as far as the answer needs.
        let mut heads = std::collections::BinaryHeap::with_capacity(iters.len());
        for (i, it) in iters.iter_mut().enumerate() {
            if let Some(guard) = it.next() {
                let (k, v) = guard.into_inner()?;
                heads.push(Reverse((k, i, v)));
            }
        }
        let mut out: Vec<(Bytes, Bytes)> = Vec::with_capacity(max.min(64 * 1024));
        while out.len() < max {
            let Some(Reverse((k, i, v))) = heads.pop() else { break };
            if let Some(guard) = iters[i].next() {
                let (k, v) = guard.into_inner()?;
                heads.push(Reverse((k, i, v)));
            }
            let v = Bytes::from(v);
            let (Some(key), Some((meta, body))) = (codec::decode_doc_key(&k), codec::decode_doc_value(&v)) else {
                return Err(ReadError::Corrupt);
            };
            if meta.deleted || (meta.expiry != 0 && u64::from(meta.expiry) <= now) {
                continue;
            }
            out.push((Bytes::copy_from_slice(key), v.slice(body)));
        }
        Ok(out)
    }

    fn partition_for(&self, key: &[u8]) -> arc_swap::Guard<Arc<Partition>> {
        let p = partition_of(key, self.partition_count());
        self.partitions[usize::from(p)].load()
    }

    /// The current copy of partition `p` (`p` below the partition count).
    pub(crate) fn partition_arc(&self, p: PartitionId) -> Arc<Partition> {
        self.partitions[usize::from(p)].load_full()
    }

    /// Puts `new` in place of partition `p`'s copy, closing the old one first (its holders
    /// are refused from then on and look the partition up again).
    pub(crate) fn replace_partition(&self, p: PartitionId, new: Arc<Partition>) -> Result<(), ReadError> {
        debug_assert_eq!(new.id(), p);
        self.partitions[usize::from(p)].load().close()?;
        self.partitions[usize::from(p)].store(new);
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
        Ok(())
    }

    /// Applies changes made on another copy of partition `partition` (a replica's write
    /// path; see `Partition::apply`). Await the [`DurableWait`] for `persist` durability.
    pub fn apply(&self, partition: PartitionId, changes: &[Change]) -> Result<DurableWait, WriteError> {
        let p = self.partitions.get(usize::from(partition)).ok_or(WriteError::NoSuchPartition(partition))?.load();
        let ticket = p.apply(changes)?;
        let mut wait = DurableWait::default();
        wait.add(&p.syncer, ticket);
        Ok(wait)
    }

    /// Writes versions of keys taken from the copy this one follows — the repair after
    /// [`crate::Store::rollback_partition`]: for each key the rollback removed, the caller
    /// fetches the new active's current version (with its seqno, CAS, expiry and deleted
    /// flag) and passes it here. Only a replica or pending copy takes them. Returns how many
    /// were written.
    ///
    /// Unlike [`Collection::apply`], a restored change keeps a seqno at or below the high
    /// seqno, and the high seqno does not move:
    /// - a change above the high seqno is skipped: the change stream from the high seqno
    ///   brings it (with everything after it);
    /// - a change no newer than what the copy holds of its key is skipped (a repeated call);
    /// - a seqno another key holds here is refused ([`crate::PartitionError::NotInHistory`]).
    ///
    /// The by-sequence index keeps one entry per key: the restored change replaces the key's
    /// entry, at its own seqno. It is not in the in-memory tail (which holds only a run of the
    /// newest changes); if it lies inside the tail's range the tail is emptied, so readers
    /// from before it read the index and see it. Readers already past its seqno — and that
    /// includes readers that rolled back to the rollback point — do not get it from the
    /// stream: the keys of the rollback report are the changes they must take again. The
    /// restore is fsynced before it returns (the persisted seqno already covers its seqno).
    pub fn restore(&self, partition: PartitionId, changes: &[Change]) -> Result<usize, crate::PartitionError> {
        let p = self.partitions.get(usize::from(partition)).ok_or(crate::PartitionError::NoSuchPartition(partition))?.load();
        p.restore(changes)
    }

    /// A receiver of the persisted seqno of this node's copy of `partition`: every change of
    /// the copy at or below it is fsynced. It moves after the journal fsync that covers a
    /// write — a `persist` write's group commit, or for `none` writes and [`Collection::apply`]
    /// the next fsync of the data path that any awaited [`DurableWait`] asks for — and never
    /// goes back. It is what majority durability and replica acknowledgements wait on.
    ///
    /// The channel closes when the copy is replaced (rollback, drop, ingest, promotion, a new
    /// history) or fsyncs fail: a seqno names a change only within one copy's history, so a
    /// waiter whose channel closed looks again (and may find its change gone).
    pub fn persisted_watch(&self, partition: PartitionId) -> Result<watch::Receiver<SeqNo>, ReadError> {
        let p = self.partitions.get(usize::from(partition)).ok_or(ReadError::NoSuchPartition(partition))?.load();
        p.persisted_watch()
    }

    /// The failover log of this node's copy of `partition`, oldest entry first: what
    /// [`crate::rollback_seqno`] compares.
    pub fn failover_log(&self, partition: PartitionId) -> Vec<crate::FailoverEntry> {
        self.partitions.get(usize::from(partition)).map_or_else(Vec::new, |p| p.load().failover_log().to_vec())
    }

    pub fn get(&self, key: &str) -> Result<Document, ReadError> {
        self.partition_for(key.as_bytes()).get(key.as_bytes())
    }

    /// The keys of `partition` a rollback to `to` would remove (see
    /// [`crate::partition::Partition::keys_above`]).
    pub fn keys_above(&self, partition: PartitionId, to: SeqNo) -> Result<Vec<Bytes>, ReadError> {
        self.partitions.get(usize::from(partition)).ok_or(ReadError::NoSuchPartition(partition))?.load().keys_above(to)
    }

    /// The live version of `key` on an active or replica copy (see
    /// [`crate::partition::Partition::current_version`]).
    pub fn current_version(&self, key: &str) -> Result<Option<Document>, ReadError> {
        self.partition_for(key.as_bytes()).current_version(key.as_bytes())
    }

    /// The high seqno of `key`'s partition, and whether that partition holds any lock.
    /// While the high seqno stays the same, no document of the partition changed: callers
    /// that cache something derived from a document can validate it without reading it.
    /// Read it *before* reading the document whose derivative is cached.
    pub fn change_watermark(&self, key: &str) -> (SeqNo, bool) {
        let p = self.partition_for(key.as_bytes());
        (p.high_seqno(), p.has_locks())
    }

    pub fn get_and_lock(&self, key: &str, lock_secs: u32) -> Result<Document, ReadError> {
        self.partition_for(key.as_bytes()).get_and_lock(key.as_bytes(), lock_secs)
    }

    pub fn unlock(&self, key: &str, cas: Cas) -> Result<(), WriteError> {
        self.partition_for(key.as_bytes()).unlock(key.as_bytes(), cas)
    }

    /// Caps an expiry at the collection's maximum TTL (Couchbase's rule: documents without
    /// an expiry get the maximum too).
    fn capped(&self, mut req: WriteRequest) -> WriteRequest {
        if self.max_ttl > 0 && matches!(req.op, WriteOp::Upsert | WriteOp::Insert | WriteOp::Replace | WriteOp::Touch) {
            let cap = crate::absolute_expiry(u64::from(self.max_ttl), self.clock.unix_secs()).unwrap_or(u32::MAX);
            if req.expiry == 0 || req.expiry > cap {
                req.expiry = cap;
            }
        }
        req
    }

    /// Applies one mutation. Readers see it on return; await the [`DurableWait`] for
    /// `persist` durability.
    pub fn write(&self, req: WriteRequest) -> Result<(MutationOutcome, DurableWait), WriteError> {
        let req = self.capped(req);
        let partition = self.partition_for(&req.key);
        let (outcome, ticket) = partition.write(&req)?;
        let mut wait = DurableWait::default();
        wait.add(&partition.syncer, ticket);
        Ok((outcome, wait))
    }

    /// Applies many mutations, grouped by partition into few journal batches. Results come
    /// back in request order; a failing request fails alone. May block on I/O for a while:
    /// call from a blocking context.
    pub fn write_many(&self, reqs: Vec<WriteRequest>) -> (Vec<Result<MutationOutcome, WriteError>>, DurableWait) {
        let reqs: Vec<WriteRequest> = reqs.into_iter().map(|r| self.capped(r)).collect();
        let mut by_partition: Vec<Vec<usize>> = vec![Vec::new(); self.partitions.len()];
        for (i, req) in reqs.iter().enumerate() {
            by_partition[usize::from(partition_of(&req.key, self.partition_count()))].push(i);
        }
        let mut results: Vec<Option<Result<MutationOutcome, WriteError>>> = (0..reqs.len()).map(|_| None).collect();
        let mut wait = DurableWait::default();
        for (p, indexes) in by_partition.iter().enumerate() {
            if indexes.is_empty() {
                continue;
            }
            let group: Vec<&WriteRequest> = indexes.iter().map(|&i| &reqs[i]).collect();
            let partition = self.partitions[p].load();
            let (outcomes, ticket) = partition.write_many(&group);
            wait.add(&partition.syncer, ticket);
            for (&i, outcome) in indexes.iter().zip(outcomes) {
                results[i] = Some(outcome);
            }
        }
        let results = results.into_iter().map(|r| r.unwrap_or(Err(WriteError::Corrupt))).collect();
        (results, wait)
    }

    /// Subscribes to one partition's changes after `from`. When the partition's history
    /// diverged from `from`, the subscription starts at the rollback point, which is returned.
    pub fn subscribe(&self, partition: PartitionId, from: StreamPosition) -> Result<(PartitionSubscription, Option<SeqNo>), ChangesError> {
        let p = self.partitions.get(usize::from(partition)).ok_or(ChangesError::InvalidToken("no such partition"))?.load_full();
        let rollback = rollback_point(&p, from);
        let since = rollback.unwrap_or(from.seqno);
        Ok((PartitionSubscription::new(p, since), rollback))
    }

    /// Parses a feed token (none = from the beginning) and applies rollbacks where a
    /// partition's history diverged from it.
    pub fn feed_position(&self, token: Option<&str>) -> Result<(FeedPosition, Vec<Rollback>), ChangesError> {
        let mut pos = match token {
            None => FeedPosition::start(self.partition_count()),
            Some(t) => FeedPosition::from_token(t, self.partition_count())?,
        };
        let mut rollbacks = Vec::new();
        for (partition, slot) in self.partitions.iter().zip(pos.partitions.iter_mut()) {
            let partition = partition.load();
            if let Some(seqno) = rollback_point(&partition, *slot) {
                rollbacks.push(Rollback { partition: partition.id(), seqno });
                slot.seqno = seqno;
            }
            slot.uuid = partition.uuid();
        }
        Ok((pos, rollbacks))
    }

    /// Changes after `pos` within `limit`, partition by partition, advancing `pos`; with
    /// `only`, of the partitions it marks (the others keep their position).
    pub fn read_feed(
        &self,
        pos: &mut FeedPosition,
        limit: ReadLimit,
        include_docs: bool,
        only: Option<&[bool]>,
    ) -> Result<Vec<Change>, ChangesError> {
        let mut out = Vec::new();
        let mut bytes = 0usize;
        for (i, (partition, slot)) in self.partitions.iter().zip(pos.partitions.iter_mut()).enumerate() {
            if out.len() >= limit.items || bytes >= limit.bytes {
                break;
            }
            if only.is_some_and(|only| !only.get(i).copied().unwrap_or(false)) {
                continue;
            }
            let partition = partition.load();
            let left = ReadLimit { items: limit.items - out.len(), bytes: limit.bytes - bytes };
            let (changes, next, _) = partition.read_changes(slot.seqno, left, include_docs).map_err(crate::changes::changes_error)?;
            slot.seqno = next;
            bytes += changes.iter().map(|c| c.key.len() + c.value.as_ref().map_or(0, |v| v.len())).sum::<usize>();
            out.extend(changes);
        }
        Ok(out)
    }

    /// Changes whenever any partition of the collection commits a change.
    pub fn changed(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    pub fn is_dropped(&self) -> bool {
        self.dropped.load(Ordering::Acquire)
    }
}

/// Where a reader at `from` must restart: on a diverged history (see
/// `Partition::rollback_point`), or before the purge horizon, where deletions it has not
/// seen may have been purged (then from 0, as Couchbase does). Both apply: a reader sent
/// back by a new history to a point before the purge seqno must start from 0 too.
fn rollback_point(p: &Partition, from: StreamPosition) -> Option<SeqNo> {
    if from.seqno == 0 {
        return None;
    }
    let diverged = p.rollback_point(from.uuid, from.seqno);
    let resume = diverged.unwrap_or(from.seqno);
    let purged = p.purge_seqno.load(Ordering::Acquire);
    if resume > 0 && resume < purged {
        return Some(0);
    }
    diverged
}
