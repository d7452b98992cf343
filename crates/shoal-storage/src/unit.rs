//! A partition as a unit on disk: its state on this node, and the operations that copy,
//! move and drop it whole — [`Store::export_partition`], [`Store::ingest_partition`],
//! [`Store::drop_partition`].
//!
//! A partition is one fjall keyspace shared by every collection (`codec`), so an export is
//! one snapshot read in key order, an ingest writes sorted table files straight into an
//! empty keyspace (fjall's ingestion: no journal, no memtable, fsynced at the end), and a
//! drop deletes the keyspace (no tombstone per key). After an ingest the copy catches up
//! from the source's change stream through [`crate::Collection::apply`].

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use fjall::Readable as _;
use serde::{Deserialize, Serialize};

use crate::codec;
use crate::collection::Collection;
use crate::error::{NotMine, PartitionError};
use crate::partition::{FailoverEntry, LiveCount, Partition};
use crate::store::Store;
use crate::{PartitionId, SeqNo};

/// What this node does with a partition (Couchbase's vBucket states).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PartitionState {
    /// Serves reads and writes; its sequencer assigns seqnos and CAS.
    Active,
    /// Follows the active's change stream (`apply`); serves no client reads or writes.
    Replica,
    /// Being built (ingest, then catch-up) before it becomes active or a replica.
    Pending,
    /// Held no more (or never): everything is refused.
    Dead,
}

impl PartitionState {
    const ALL: [PartitionState; 4] = [PartitionState::Active, PartitionState::Replica, PartitionState::Pending, PartitionState::Dead];

    fn code(self) -> u8 {
        self as u8
    }

    fn from_code(code: u8) -> PartitionState {
        PartitionState::ALL.get(usize::from(code)).copied().unwrap_or(PartitionState::Dead)
    }
}

impl std::fmt::Display for PartitionState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PartitionState::Active => "active",
            PartitionState::Replica => "replica",
            PartitionState::Pending => "pending",
            PartitionState::Dead => "dead",
        })
    }
}

/// A partition's state, shared by every collection's copy of it, and the partition map
/// version this node knows (shared by all partitions), for `not_my_partition` answers.
pub(crate) struct Ownership {
    state: AtomicU8,
    map_version: Arc<AtomicU64>,
}

impl Ownership {
    pub(crate) fn new(state: PartitionState, map_version: Arc<AtomicU64>) -> Ownership {
        Ownership { state: AtomicU8::new(state.code()), map_version }
    }

    pub(crate) fn state(&self) -> PartitionState {
        PartitionState::from_code(self.state.load(Ordering::Acquire))
    }

    pub(crate) fn set(&self, state: PartitionState) {
        self.state.store(state.code(), Ordering::Release);
    }

    pub(crate) fn map_version(&self) -> u64 {
        self.map_version.load(Ordering::Acquire)
    }
}

/// What an export is consistent at, per collection: the first thing of a copy's stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportHeader {
    pub partition: PartitionId,
    /// In collection id order.
    pub collections: Vec<ExportedCollection>,
}

/// One collection's part of a partition's export.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportedCollection {
    pub id: u32,
    /// The high seqno the snapshot holds exactly: a copy catches up from here.
    pub seqno: SeqNo,
    /// The history: a copy continues it, so readers' positions stay valid.
    pub failover: Vec<FailoverEntry>,
    pub purge_seqno: SeqNo,
}

impl ExportedCollection {
    /// The change-stream position the export is consistent at.
    pub fn position(&self) -> crate::StreamPosition {
        crate::StreamPosition { seqno: self.seqno, uuid: self.failover.last().map_or(0, |e| e.uuid) }
    }
}

/// A consistent snapshot of everything a partition holds, as the raw records of its
/// keyspace in key order (see `codec`); [`PartitionExport::header`] says where it stands.
/// Holds an engine snapshot until dropped.
pub struct PartitionExport {
    header: ExportHeader,
    snapshot: fjall::Snapshot,
    ks: fjall::Keyspace,
    /// Collections still to read, in id order (so the records come in key order).
    todo: VecDeque<u32>,
    iter: Option<fjall::Iter>,
    estimated_bytes: u64,
}

/// Bytes an export carries per live document besides its body: its key (twice), the
/// by-sequence record and the document's metadata — for progress estimates only.
const EXPORT_BYTES_PER_DOC_ESTIMATE: u64 = 64;

impl PartitionExport {
    pub fn header(&self) -> &ExportHeader {
        &self.header
    }

    /// About how many bytes of records the export carries (live documents' bodies plus a
    /// per-document allowance; deleted documents' records are not counted): for progress.
    pub fn estimated_bytes(&self) -> u64 {
        self.estimated_bytes
    }
}

impl Iterator for PartitionExport {
    type Item = Result<(Bytes, Bytes), PartitionError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(iter) = &mut self.iter {
                match iter.next() {
                    Some(guard) => {
                        return Some(guard.into_inner().map(|(k, v)| (Bytes::from(k), Bytes::from(v))).map_err(PartitionError::from))
                    }
                    None => self.iter = None,
                }
            }
            let id = self.todo.pop_front()?;
            self.iter = Some(self.snapshot.range(&self.ks, codec::collection_range(id)));
        }
    }
}

/// A partition's engine snapshot, its keyspace, where it stands per collection and each
/// collection's live documents at it ([`Store::snapshot_partition`]).
pub(crate) struct PartitionSnapshot {
    pub snapshot: fjall::Snapshot,
    pub ks: fjall::Keyspace,
    pub header: ExportHeader,
    pub live: Vec<(u32, LiveCount)>,
}

/// What an ingest holds once its checks passed ([`Store::check_ingest`]): the partition's
/// operation lock, the collections by id and the partition's keyspace.
pub(crate) type IngestStart<'a> = (parking_lot::MutexGuard<'a, ()>, BTreeMap<u32, Arc<Collection>>, fjall::Keyspace);

/// What an ingest loaded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IngestStats {
    /// Records (documents, by-sequence and expiry entries).
    pub records: u64,
    /// Bytes of keys and values.
    pub bytes: u64,
}

impl Store {
    /// The state of partition `p` on this node.
    pub fn partition_state(&self, p: PartitionId) -> Result<PartitionState, PartitionError> {
        Ok(self.unit(p)?.owner.state())
    }

    /// Sets partition `p`'s state on this node, durably. A copy that becomes active starts
    /// a new history (a new UUID from its high seqno, as Couchbase's promoted replicas do), so
    /// that readers — and a former active that comes back — can tell where histories part.
    pub fn set_partition_state(&self, p: PartitionId, state: PartitionState) -> Result<(), PartitionError> {
        self.set_partition_states(&[(p, state)])
    }

    /// Sets the states of several partitions at once, durably: one batch and one fsync per
    /// database for all of them, where one at a time would cost three fsyncs each (a map
    /// that moves many partitions to a node would keep its requests waiting for them all).
    /// Partitions that become active start new histories, as in
    /// [`set_partition_state`](Self::set_partition_state).
    pub fn set_partition_states(&self, changes: &[(PartitionId, PartitionState)]) -> Result<(), PartitionError> {
        self.set_partition_states_for_map(changes, self.map_version.load(Ordering::Acquire))
    }

    /// [`Store::set_partition_states`] as map version `map_version` places the copies: a
    /// copy made active begins a history entry of that epoch (see [`FailoverEntry::epoch`]).
    pub fn set_partition_states_for_map(&self, changes: &[(PartitionId, PartitionState)], map_version: u64) -> Result<(), PartitionError> {
        if changes.is_empty() {
            return Ok(());
        }
        let mut changes = changes.to_vec();
        changes.sort_unstable_by_key(|(p, _)| *p);
        changes.dedup_by_key(|(p, _)| *p);
        let units = changes.iter().map(|(p, _)| self.unit(*p)).collect::<Result<Vec<_>, _>>()?;
        // Partition order, then the store's: the order every partition operation takes.
        let _ops: Vec<_> = units.iter().map(|u| u.op.lock()).collect();
        let _ddl = self.ddl.lock();
        // A retired copy given a role again is discarded first, whoever retired it and
        // whenever: its data is of a copy taken out of service, and its partition objects
        // are closed (a copy retired after the caller last looked, then given a state
        // without its discard, refused every change as dead for good: a long fault run's
        // rebalance never ended).
        let started = std::time::Instant::now();
        let mut discarded = Vec::new();
        for ((p, state), unit) in changes.iter().zip(&units) {
            if *state != PartitionState::Dead && self.discard_locked(*p, unit)? {
                discarded.push(*p);
            }
        }
        if !discarded.is_empty() {
            tracing::info!(partitions = ?discarded, ms = started.elapsed().as_secs_f64() * 1e3, "retired copies discarded as they take a role again");
        }
        let befores: Vec<PartitionState> = units.iter().map(|u| u.owner.state()).collect();
        let collections = self.collections_by_id();
        let mut batch = self.paths[0].db.batch();
        let mut renewed = Vec::new();
        for ((p, state), before) in changes.iter().zip(&befores) {
            if *state == PartitionState::Active && *before != PartitionState::Active {
                // A new history entry at its high seqno for every collection's copy.
                for collection in &collections {
                    let part = collection.partition_arc(*p);
                    let mut failover = part.failover_log().to_vec();
                    let epoch = map_version.max(self.map_version.load(Ordering::Acquire));
                    debug_assert!(failover.last().is_none_or(|e| e.epoch <= epoch), "epochs never go back along a history");
                    failover.push(FailoverEntry { uuid: self.clock().history_uuid(), seqno: part.high_seqno(), epoch });
                    let purge_seqno = part.purge_seqno.load(Ordering::Acquire);
                    let rec =
                        crate::store::PartitionRecord { failover: failover.clone(), purge_seqno, live: None, high: part.high_floor() };
                    batch.insert(&self.meta, crate::store::partition_key(collection.id, *p), crate::store::json_bytes(&rec));
                    renewed.push((*p, Arc::clone(collection), part, failover, purge_seqno));
                }
            }
            self.stage_state(&mut batch, *p, *state);
        }
        self.health.check_writable()?;
        // The partitions' journals first: a successor starts with its high seqno as its
        // persisted seqno, which must be true (its data path may not be the metadata's).
        for ((p, state), before) in changes.iter().zip(&befores) {
            if *state == PartitionState::Active && *before != PartitionState::Active {
                self.unit(*p)?.db.persist(fjall::PersistMode::SyncAll)?;
            }
        }
        batch.commit()?;
        self.paths[0].db.persist(fjall::PersistMode::SyncAll)?;
        for (p, collection, part, failover, purge_seqno) in renewed {
            let live = LiveCount { count: part.docs_count.load(Ordering::Relaxed), bytes: part.docs_bytes.load(Ordering::Relaxed) };
            let new = self.new_partition(&collection, p, failover, purge_seqno, live, Some(part.high_seqno()))?;
            collection.replace_partition(p, new)?;
        }
        for (((p, state), before), unit) in changes.iter().zip(&befores).zip(&units) {
            unit.owner.set(*state);
            tracing::info!(partition = p, from = %before, to = %state, "partition state");
        }
        // A writer checks that its partition is active and commits under the partition's
        // sequencer, so one that passed the check just before the change may still be about
        // to commit. Waiting for each sequencer once lets it land: when this returns, every
        // write this copy took as active is in its high seqno (a hand-over reads it next and
        // waits for the new active to hold it; a write landing after that read would be
        // acknowledged here and then lost).
        for ((p, state), before) in changes.iter().zip(&befores) {
            if *before == PartitionState::Active && *state != PartitionState::Active {
                for collection in &collections {
                    drop(collection.partition_arc(*p).hold()?);
                }
            }
        }
        Ok(())
    }

    /// Sets the partition map version that `not_my_partition` refusals carry.
    pub fn set_map_version(&self, version: u64) {
        self.map_version.fetch_max(version, Ordering::AcqRel);
    }

    /// Starts an export of partition `p`: a consistent snapshot of every collection's part
    /// of it, at the positions in its header. The partition must be active or a replica.
    pub fn export_partition(&self, p: PartitionId) -> Result<PartitionExport, PartitionError> {
        let snap = self.snapshot_partition(p)?;
        let estimated_bytes = snap
            .live
            .iter()
            .map(|(_, live)| {
                let count = u64::try_from(live.count).unwrap_or(0);
                let bytes = u64::try_from(live.bytes).unwrap_or(0);
                bytes + count * EXPORT_BYTES_PER_DOC_ESTIMATE
            })
            .sum();
        let todo = snap.header.collections.iter().map(|c| c.id).collect();
        Ok(PartitionExport { header: snap.header, snapshot: snap.snapshot, ks: snap.ks, todo, iter: None, estimated_bytes })
    }

    /// A consistent snapshot of partition `p`, which must be active or a replica: every
    /// collection's sequencer is held while the engine snapshot is taken and the positions
    /// and live counts are read, so no commit lands between them.
    pub(crate) fn snapshot_partition(&self, p: PartitionId) -> Result<PartitionSnapshot, PartitionError> {
        let unit = self.unit(p)?;
        let state = unit.owner.state();
        if !matches!(state, PartitionState::Active | PartitionState::Replica) {
            return Err(PartitionError::NotMine(NotMine {
                partition: p,
                state,
                wanted: "active or replica",
                map_version: self.map_version.load(Ordering::Acquire),
            }));
        }
        let collections = self.collections_by_id();
        let parts: Vec<Arc<Partition>> = collections.iter().map(|c| c.partition_arc(p)).collect();
        let mut held = Vec::with_capacity(parts.len());
        for part in &parts {
            held.push(part.hold()?);
        }
        let ks = unit.ks.read().clone();
        let snapshot = unit.db.snapshot();
        let header = ExportHeader {
            partition: p,
            collections: parts
                .iter()
                .zip(&held)
                .map(|(part, (high, _))| ExportedCollection {
                    id: part.coll,
                    seqno: *high,
                    failover: part.failover_log().to_vec(),
                    purge_seqno: part.purge_seqno.load(Ordering::Acquire),
                })
                .collect(),
        };
        let live = parts
            .iter()
            .map(|part| {
                (part.coll, LiveCount { count: part.docs_count.load(Ordering::Relaxed), bytes: part.docs_bytes.load(Ordering::Relaxed) })
            })
            .collect();
        drop(held);
        Ok(PartitionSnapshot { snapshot, ks, header, live })
    }

    /// Loads an export of partition `p` from another node (or this one) into this node's
    /// copy, which must be `pending` and empty (a new node's, or one just dropped). The
    /// records go straight into table files (no journal, no write path), fsynced before
    /// this returns; then every collection's copy continues the source's history from the
    /// header's positions, and catches up with [`crate::Collection::apply`].
    ///
    /// `records` must come in strictly ascending key order and belong to the header's
    /// collections, which must exist here with the same ids; anything else is refused with
    /// nothing loaded.
    pub fn ingest_partition<I>(&self, header: &ExportHeader, records: I) -> Result<IngestStats, PartitionError>
    where
        I: IntoIterator<Item = Result<(Bytes, Bytes), PartitionError>>,
    {
        let p = header.partition;
        let (_op, by_id, ks) = self.check_ingest(header)?;
        let mut live: BTreeMap<u32, LiveCount> = BTreeMap::new();
        let mut stats = IngestStats::default();
        let mut ingestion = ks.start_ingestion()?;
        let mut prev: Option<Bytes> = None;
        for record in records {
            let (k, v) = record?;
            // fjall panics on keys out of order: refuse them here instead.
            if prev.as_ref().is_some_and(|prev| k <= *prev) {
                return Err(PartitionError::Malformed("records out of key order".into()));
            }
            let coll = check_record(header, &k, &v)?;
            if let Some((meta, body)) = (k.get(4) == Some(&codec::TAG_DOC)).then(|| codec::decode_doc_value(&v)).flatten() {
                if !meta.deleted {
                    let slot = live.entry(coll).or_default();
                    slot.count += 1;
                    slot.bytes += body.len() as i64;
                }
            }
            stats.records += 1;
            stats.bytes += (k.len() + v.len()) as u64;
            ingestion.write(k.clone(), v)?;
            prev = Some(k);
        }
        ingestion.finish()?;
        self.finish_ingest(header, &by_id, &live)?;
        tracing::info!(partition = p, records = stats.records, bytes = stats.bytes, "partition ingested");
        Ok(stats)
    }

    /// What every ingest does first: it takes the partition's operation lock (one
    /// operation at a time per partition; other partitions' ingests run alongside) and
    /// checks that the copy is `pending` here, the store writable, the header's collections
    /// in order, known here and with a history, and the keyspace empty. Answers the lock,
    /// the collections by id and the keyspace.
    pub(crate) fn check_ingest(&self, header: &ExportHeader) -> Result<IngestStart<'_>, PartitionError> {
        let p = header.partition;
        let unit = self.unit(p)?;
        let op = unit.op.lock();
        let state = unit.owner.state();
        if state != PartitionState::Pending {
            return Err(PartitionError::NotMine(NotMine {
                partition: p,
                state,
                wanted: "pending",
                map_version: self.map_version.load(Ordering::Acquire),
            }));
        }
        self.health.check_writable()?;
        let by_id: BTreeMap<u32, Arc<Collection>> = self.collections_by_id().into_iter().map(|c| (c.id, c)).collect();
        if !header.collections.windows(2).all(|w| w[0].id < w[1].id) {
            return Err(PartitionError::Malformed("the header's collections are not in id order".into()));
        }
        for c in &header.collections {
            if !by_id.contains_key(&c.id) {
                return Err(PartitionError::UnknownCollection(c.id));
            }
            if c.failover.is_empty() {
                return Err(PartitionError::Malformed(format!("collection {} has no history", c.id)));
            }
        }
        let ks = unit.ks.read().clone();
        if ks.iter().next().is_some() {
            return Err(PartitionError::NotEmpty(p));
        }
        Ok((op, by_id, ks))
    }

    /// What every ingest does once its data is durable: every collection's copy continues
    /// the source's history from the header's positions, with `live` documents.
    pub(crate) fn finish_ingest(
        &self,
        header: &ExportHeader,
        by_id: &BTreeMap<u32, Arc<Collection>>,
        live: &BTreeMap<u32, LiveCount>,
    ) -> Result<(), PartitionError> {
        let p = header.partition;
        let mut batch = self.paths[0].db.batch();
        for c in &header.collections {
            let rec =
                crate::store::PartitionRecord { failover: c.failover.clone(), purge_seqno: c.purge_seqno, live: None, high: Some(c.seqno) };
            batch.insert(&self.meta, crate::store::partition_key(c.id, p), crate::store::json_bytes(&rec));
        }
        batch.commit()?;
        self.paths[0].db.persist(fjall::PersistMode::SyncAll)?;
        let _ddl = self.ddl.lock();
        for (id, collection) in by_id {
            let exported = header.collections.iter().find(|c| c.id == *id);
            let part = self.new_partition(
                collection,
                p,
                exported.map(|c| c.failover.clone()).unwrap_or_default(),
                exported.map_or(0, |c| c.purge_seqno),
                live.get(id).copied().unwrap_or_default(),
                exported.map(|c| c.seqno),
            )?;
            collection.replace_partition(p, part)?;
        }
        Ok(())
    }

    /// Drops this node's copy of partition `p` whole: every collection's part of it is
    /// refused from now on, the keyspace is deleted (its files go once the last reader
    /// lets go; no tombstone per key), and an empty one takes its place, `dead` until given
    /// a state.
    pub fn drop_partition(&self, p: PartitionId) -> Result<(), PartitionError> {
        self.drop_partitions(&[p])
    }

    /// Drops this node's copies of partitions `ps`, each as [`Store::drop_partition`] does:
    /// retired in one durable write, then discarded.
    pub fn drop_partitions(&self, ps: &[PartitionId]) -> Result<(), PartitionError> {
        self.retire_partitions(ps)?;
        self.discard_retired(ps)
    }

    /// Takes this node's copies of partitions `ps` out of service for good, in one durable
    /// write for all of them: each is `dead`, without its records, and marked retired. Every
    /// collection's part of it is refused from now on. Its data stays on disk, never served,
    /// until [`Store::discard_retired`] deletes it: a hand-over retires every partition a
    /// source handed over at once, and the deletions (a keyspace deleted and another created,
    /// 5–15 ms apiece) are better done once the new map has settled.
    pub fn retire_partitions(&self, ps: &[PartitionId]) -> Result<(), PartitionError> {
        let ps = sorted_once(ps);
        if ps.is_empty() {
            return Ok(());
        }
        let units = ps.iter().map(|p| self.unit(*p)).collect::<Result<Vec<_>, _>>()?;
        let collections = self.collections_by_id();
        // Partition order, then the store's: the order every partition operation takes.
        let _ops: Vec<_> = units.iter().map(|u| u.op.lock()).collect();
        let _ddl = self.ddl.lock();
        self.health.check_writable()?;
        // Durably first: a crash from here on finds each copy dead and retired (what is left
        // of its data is never served, and the restart discards it).
        let mut batch = self.paths[0].db.batch();
        for &p in &ps {
            self.stage_state(&mut batch, p, PartitionState::Dead);
            batch.insert(&self.meta, crate::store::retired_key(p), []);
            for collection in &collections {
                batch.remove(&self.meta, crate::store::partition_key(collection.id, p));
            }
        }
        batch.commit()?;
        self.paths[0].db.persist(fjall::PersistMode::SyncAll)?;
        for (&p, unit) in ps.iter().zip(&units) {
            unit.owner.set(PartitionState::Dead);
            for collection in &collections {
                collection.partition_arc(p).close()?;
            }
        }
        Ok(())
    }

    /// Deletes the data of those of `ps` that are retired and still dead, one partition at
    /// a time: the keyspace is deleted (its files go once the last reader lets go; no
    /// tombstone per key) and an empty one takes its place, `dead` until given a state.
    /// Others are left alone: a partition is only ever given a state again after its
    /// discard, so one that is not retired any more was discarded already.
    pub fn discard_retired(&self, ps: &[PartitionId]) -> Result<(), PartitionError> {
        let started = std::time::Instant::now();
        let mut discarded = Vec::new();
        for p in sorted_once(ps) {
            let unit = self.unit(p)?;
            let _op = unit.op.lock();
            let _ddl = self.ddl.lock();
            if self.discard_locked(p, unit)? {
                discarded.push(p);
            }
        }
        if !discarded.is_empty() {
            tracing::info!(partitions = ?discarded, ms = started.elapsed().as_secs_f64() * 1e3, "partitions discarded");
        }
        Ok(())
    }

    /// [`Store::discard_retired`] of one partition, its operation and DDL locks held:
    /// answers whether it was retired (and is discarded now).
    fn discard_locked(&self, p: PartitionId, unit: &crate::store::PartitionUnit) -> Result<bool, PartitionError> {
        if unit.owner.state() != PartitionState::Dead || self.meta.get(crate::store::retired_key(p))?.is_none() {
            return Ok(false);
        }
        {
            let mut ks = unit.ks.write();
            unit.db.delete_keyspace(ks.clone())?;
            *ks = self.create_partition_keyspace(&unit.db, p)?;
        }
        for collection in &self.collections_by_id() {
            let part = self.new_partition(collection, p, Vec::new(), 0, LiveCount::default(), None)?;
            collection.replace_partition(p, part)?;
        }
        // Not fsynced on its own: the state that gives the partition a role again is, and
        // the journal makes this earlier write durable with it.
        self.meta.remove(crate::store::retired_key(p))?;
        Ok(true)
    }

    /// The partitions retired and not yet discarded (a restart finds those a crash left).
    pub fn retired_partitions(&self) -> Result<Vec<PartitionId>, PartitionError> {
        let mut out = Vec::new();
        for guard in self.meta.prefix(crate::store::RETIRED_PREFIX) {
            let key = guard.key()?;
            let p = std::str::from_utf8(&key[crate::store::RETIRED_PREFIX.len()..]).ok().and_then(|h| u16::from_str_radix(h, 16).ok());
            match p {
                Some(p) if p < self.partitions() => out.push(p),
                _ => tracing::warn!(key = %String::from_utf8_lossy(&key), "ignoring a malformed retired-partition record"),
            }
        }
        Ok(out)
    }
}

/// `ps` in partition order, each once.
fn sorted_once(ps: &[PartitionId]) -> Vec<PartitionId> {
    let mut ps = ps.to_vec();
    ps.sort_unstable();
    ps.dedup();
    ps
}

/// Checks one record of a copy: its collection is in the header, its tag is known and its
/// key and value decode. Returns the collection id.
fn check_record(header: &ExportHeader, k: &[u8], v: &[u8]) -> Result<u32, PartitionError> {
    let bad = |why: &str| PartitionError::Malformed(format!("{why} (key {:?})", String::from_utf8_lossy(k)));
    let coll = k.get(..4).and_then(|b| b.try_into().ok()).map(u32::from_be_bytes).ok_or_else(|| bad("a key shorter than its prefix"))?;
    if header.collections.binary_search_by_key(&coll, |c| c.id).is_err() {
        return Err(bad("a record of a collection the header does not name"));
    }
    let ok = match k.get(4).copied() {
        Some(codec::TAG_DOC) => {
            codec::decode_doc_key(k).is_some_and(|key| crate::partition::validate_key(key).is_ok()) && codec::decode_doc_value(v).is_some()
        }
        Some(codec::TAG_SEQ) => codec::decode_seq_key(k).is_some() && codec::decode_seq_value(v).is_some(),
        Some(codec::TAG_EXP) => codec::decode_exp_key(k).is_some() && v.is_empty(),
        _ => false,
    };
    if !ok {
        return Err(bad("a record that does not decode"));
    }
    Ok(coll)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_round_trip_through_their_codes() {
        for state in PartitionState::ALL {
            assert_eq!(PartitionState::from_code(state.code()), state);
        }
        assert_eq!(PartitionState::from_code(200), PartitionState::Dead);
    }

    fn files_under(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                out.extend(files_under(&path));
            } else {
                out.push(path);
            }
        }
        out
    }

    #[test]
    fn a_dropped_partition_leaves_no_file_behind_and_the_others_keep_theirs() {
        use crate::{partition_of, StoreConfig, WriteOp, WriteRequest};
        let dir = tempfile::tempdir().unwrap();
        let store =
            Store::open(StoreConfig { data_paths: vec![dir.path().to_path_buf()], partitions: Some(2), ..StoreConfig::default() }).unwrap();
        let c = store.create_collection("c", 0).unwrap();
        for i in 0..400 {
            // Every fourth is large enough for a blob file.
            let body = if i % 4 == 0 { vec![b'x'; crate::BLOB_THRESHOLD_DEFAULT_BYTES as usize + 1] } else { b"{}".to_vec() };
            let req = WriteRequest {
                key: Bytes::from(format!("k{i}")),
                op: WriteOp::Upsert,
                value: Some(Bytes::from(body)),
                cas: None,
                expiry: 0,
            };
            let _ = c.write(req).unwrap();
        }
        let (old, other) = (store.units[0].ks.read().clone(), store.units[1].ks.read().clone());
        for ks in [&old, &other] {
            ks.rotate_memtable_and_wait().unwrap();
        }
        let (old_dir, other_dir) = (old.path().to_path_buf(), other.path().to_path_buf());
        assert!(files_under(&old_dir).iter().any(|f| f.to_string_lossy().contains("blobs")), "blob files before the drop");
        drop(old);

        let export = store.export_partition(0).unwrap();
        store.drop_partition(0).unwrap();
        // An export taken before keeps reading the old files.
        assert_eq!(
            export.filter(|r| r.as_ref().is_ok_and(|(k, _)| k.get(4) == Some(&codec::TAG_DOC))).count(),
            (0..400).filter(|i| partition_of(format!("k{i}").as_bytes(), 2) == 0).count()
        );
        // Its last reader gone, nothing of the old keyspace is left.
        assert!(!old_dir.exists(), "{:?}", files_under(&old_dir));
        // The other partition keeps its files (compaction may rewrite them) and documents.
        assert!(!files_under(&other_dir).is_empty());
        let docs_in = |p: u16| (0..400).filter(|i| partition_of(format!("k{i}").as_bytes(), 2) == p).count();
        assert_eq!(other.range(codec::tag_range(c.id(), codec::TAG_DOC)).count(), docs_in(1));
        assert!(matches!(c.get("k0"), Err(crate::ReadError::NotMyPartition(_))) || partition_of(b"k0", 2) == 1);
        let new_dir = store.units[0].ks.read().path().to_path_buf();
        assert_ne!(new_dir, old_dir);
        assert_eq!(store.units[0].ks.read().iter().count(), 0);
        // The partition comes back empty once given a state again.
        store.set_partition_state(0, PartitionState::Active).unwrap();
        let gone = (0..400).map(|i| format!("k{i}")).find(|k| partition_of(k.as_bytes(), 2) == 0).unwrap();
        assert!(matches!(c.get(&gone), Err(crate::ReadError::NotFound)));
        assert_eq!(c.high_seqnos()[0], 0);
    }

    /// Writes `{}` at `key`.
    fn upsert(c: &Collection, key: &str) {
        let req = crate::WriteRequest {
            key: Bytes::from(key.to_owned()),
            op: crate::WriteOp::Upsert,
            value: Some(Bytes::from_static(b"{}")),
            cas: None,
            expiry: 0,
        };
        let _ = c.write(req).unwrap();
    }

    #[test]
    fn partitions_dropped_together_are_each_dead_and_empty_after_a_restart_and_the_rest_keep_theirs() {
        use crate::{partition_of, StoreConfig};
        let dir = tempfile::tempdir().unwrap();
        let config = || StoreConfig { data_paths: vec![dir.path().to_path_buf()], partitions: Some(4), ..StoreConfig::default() };
        let keys: Vec<String> = (0..200).map(|i| format!("k{i}")).collect();
        let in_partition = |p: u16| keys.iter().filter(|k| partition_of(k.as_bytes(), 4) == p).count();
        {
            let store = Store::open(config()).unwrap();
            let c = store.create_collection("c", 0).unwrap();
            for k in &keys {
                upsert(&c, k);
            }
            // Out of order and repeated: each is dropped once.
            store.drop_partitions(&[2, 0, 2]).unwrap();
            store.drop_partitions(&[]).unwrap();
            for p in [0, 2] {
                assert_eq!(store.partition_state(p).unwrap(), PartitionState::Dead);
                assert_eq!(store.units[usize::from(p)].ks.read().iter().count(), 0, "partition {p} is empty");
            }
        }
        let store = Store::open(config()).unwrap();
        let c = store.collection("c").unwrap();
        for p in 0..4u16 {
            let dropped = p == 0 || p == 2;
            let state = store.partition_state(p).unwrap();
            assert_eq!(state == PartitionState::Dead, dropped, "partition {p} after the restart: {state:?}");
            let docs = store.units[usize::from(p)].ks.read().range(codec::tag_range(c.id(), codec::TAG_DOC)).count();
            assert_eq!(docs, if dropped { 0 } else { in_partition(p) }, "partition {p}'s documents");
            if dropped {
                assert_eq!(c.high_seqnos()[usize::from(p)], 0, "partition {p}'s records went with it");
            }
        }
    }

    #[test]
    fn a_retired_partition_is_never_served_its_data_outlives_a_restart_until_discarded_and_only_then() {
        use crate::{partition_of, ReadError, StoreConfig};
        let dir = tempfile::tempdir().unwrap();
        let config = || StoreConfig { data_paths: vec![dir.path().to_path_buf()], partitions: Some(2), ..StoreConfig::default() };
        let keys: Vec<String> = (0..100).map(|i| format!("k{i}")).collect();
        let key_in = |p: u16| keys.iter().find(|k| partition_of(k.as_bytes(), 2) == p).unwrap().clone();
        let docs = |store: &Store, p: u16, c: &Collection| {
            store.units[usize::from(p)].ks.read().range(codec::tag_range(c.id(), codec::TAG_DOC)).count()
        };
        {
            let store = Store::open(config()).unwrap();
            let c = store.create_collection("c", 0).unwrap();
            for k in &keys {
                upsert(&c, k);
            }
            store.retire_partitions(&[1]).unwrap();
            assert_eq!(store.partition_state(1).unwrap(), PartitionState::Dead);
            assert!(matches!(c.get(&key_in(1)), Err(ReadError::NotMyPartition(_))), "refused at once");
            assert!(docs(&store, 1, &c) > 0, "its data waits for the discard");
            assert_eq!(store.retired_partitions().unwrap(), vec![1]);
            // Not retired: a discard leaves it alone.
            store.discard_retired(&[0]).unwrap();
            assert!(c.get(&key_in(0)).is_ok());
        }
        // A crash before the discard: the restart finds the partition retired, still dead.
        let store = Store::open(config()).unwrap();
        let c = store.collection("c").unwrap();
        assert_eq!(store.partition_state(1).unwrap(), PartitionState::Dead);
        assert_eq!(store.retired_partitions().unwrap(), vec![1]);
        assert!(docs(&store, 1, &c) > 0);
        store.discard_retired(&[1]).unwrap();
        assert_eq!(docs(&store, 1, &c), 0);
        assert!(store.retired_partitions().unwrap().is_empty());
        // Given a role again, it starts empty; a second discard does not touch it.
        store.set_partition_state(1, PartitionState::Active).unwrap();
        upsert(&c, &key_in(1));
        store.discard_retired(&[1]).unwrap();
        assert_eq!(docs(&store, 1, &c), 1);
        assert!(c.get(&key_in(0)).is_ok(), "the other partition keeps its documents");
    }

    /// A retired partition given a state again without its discard (a map applied while a
    /// failed copy was being dropped) is discarded by that state change: it takes writes,
    /// empty, instead of refusing them as dead for good from its closed objects.
    #[test]
    fn a_retired_partition_given_a_role_is_discarded_first_and_takes_writes() {
        use crate::{partition_of, StoreConfig};
        let dir = tempfile::tempdir().unwrap();
        let store =
            Store::open(StoreConfig { data_paths: vec![dir.path().to_path_buf()], partitions: Some(2), ..StoreConfig::default() }).unwrap();
        let c = store.create_collection("c", 0).unwrap();
        let keys: Vec<String> = (0..100).map(|i| format!("k{i}")).filter(|k| partition_of(k.as_bytes(), 2) == 1).collect();
        for k in &keys {
            upsert(&c, k);
        }
        store.retire_partitions(&[1]).unwrap();
        for state in [PartitionState::Replica, PartitionState::Active] {
            store.set_partition_state(1, state).unwrap();
            assert!(store.retired_partitions().unwrap().is_empty(), "{state}: discarded");
            assert_eq!(c.positions()[1].seqno, 0, "{state}: it starts empty");
        }
        upsert(&c, &keys[0]);
        assert_eq!(c.positions()[1].seqno, 1, "it takes writes");
        assert!(c.get(&keys[1]).is_err(), "none of its old documents is served");
    }
}
