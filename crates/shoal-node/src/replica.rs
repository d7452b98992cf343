//! Replication: a replica pulls the active copy's change stream, one stream per node it
//! follows carrying every partition and collection it holds replicas of from that node, and
//! applies the changes with their seqno, CAS, expiry and deleted flag
//! (`Collection::apply`). Each pull acknowledges what the replica holds and has fsynced;
//! the active records that (`acks`) and holds a pull with nothing to send for up to
//! `PULL_WAIT` (a long poll), so a change reaches the replica one round trip after commit.
//!
//! A new replica starts from seqno 0: its first pulls are a backfill from the active's disk
//! (each key's latest change, consistent only at its end — the snapshot marker), then it
//! follows live. A replica whose history parted from the active's (it followed a copy that
//! was failed over) rolls back to where they part, fetches the active's versions of the keys
//! the rollback removed, and goes on.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shoal_cluster::NodeId;
use shoal_meta::{MemberState, MetaState};
use shoal_storage::{Change, Collection, PartitionError, PartitionState, StreamPosition};
use tokio::sync::watch;

use crate::node::{blocking, ClusterNode};
use crate::peers::Op;
use crate::wire::{self, PartAnswer, PartKind, PullAnswer, PullPart, PullRequest, VersionsAnswer, VersionsRequest, WireChange};
use crate::ClusterError;

/// Longest the active holds a pull that has nothing to send.
pub const PULL_WAIT: Duration = Duration::from_millis(500);
/// A pull gets no answer in this long: the replica tries again (the link or the active is
/// down).
pub const PULL_TIMEOUT: Duration = Duration::from_secs(5);
/// Changes of one part in one answer.
pub const PULL_BATCH_CHANGES: usize = 512;
/// Wait before pulling again after a failed pull.
const PULL_RETRY: Duration = Duration::from_millis(200);
/// A new copy built from the change stream this close (in changes) to its active's high
/// seqno is no longer paced: a rebalance may hand its partition over now (it is within
/// `rebalance::CATCH_UP_SLACK`), and the active's writes wait, frozen, for the last
/// changes (a paced tail held a freeze of 22 partitions for 868 ms in a stream swap).
pub const UNPACED_WITHIN: u64 = 2 * crate::rebalance::CATCH_UP_SLACK;
/// Keys asked for in one versions call (a rollback's repairs).
pub const VERSIONS_KEYS_MAX: usize = 1_000;

/// Pulls from `source` until `stop`, the source is failed, or this node follows it no more.
pub(crate) async fn replicate_from(node: Arc<ClusterNode>, source: NodeId, mut stop: watch::Receiver<bool>) {
    tracing::info!(source = source.0, "replicating");
    let mut round = 0u64;
    // Where each part's last answer said its snapshot ends: the part is consistent once its
    // position reaches it. Unknown (the first pull) counts as not consistent.
    let mut snapshot_end: HashMap<(u32, u16), u64> = HashMap::new();
    // New copies built from the change stream (`"stream"`): what they take moves under the
    // node's copy budget, as file copies do.
    let mut pacing = StreamPacing::default();
    let mut copying = None;
    // A collection created, or a copy given to this node, shows in `parts_from` once the
    // engine is in step with the metadata that made it: the stream asks for it then, not a
    // `PULL_WAIT` later (the first writes to a new collection would wait that long to be
    // replicated, and a failover meanwhile lose them at `durability=none`).
    let mut reconciled = node.applier.reconciled();
    'pulls: loop {
        if *stop.borrow() {
            break;
        }
        let state = node.state();
        let Some(address) = following(&node, &state, source) else { break };
        let mut parts = parts_from(&node, &state, source, &snapshot_end);
        pacing.follow_only(&parts);
        // What the stream follows now, asked for or sitting out its pacing.
        let following_now: Vec<(u32, u16)> = parts.iter().map(|p| (p.collection, p.partition)).collect();
        let deferred = pacing.defer(&mut parts, Instant::now());
        // Held from one pull to the next while copies are built (the probe measures then).
        copying = pacing.is_building().then(|| copying.take().unwrap_or_else(|| node.copies.elastic.copying()));
        if parts.is_empty() && !deferred.is_zero() {
            tokio::select! {
                _ = tokio::time::sleep(deferred) => continue,
                _ = stop.changed() => continue,
            }
        }
        if parts.is_empty() {
            // Nothing to follow yet (no collections): look again later.
            tokio::select! {
                _ = tokio::time::sleep(PULL_WAIT) => continue,
                _ = next_reconcile(&mut reconciled) => continue,
                _ = stop.changed() => continue,
            }
        }
        let first = parts.iter().any(|p| !snapshot_end.contains_key(&(p.collection, p.partition)));
        // Parts still backfilling, and where each stood: what arrives for them is a copy's
        // progress (`Copies::add_stream_bytes`).
        let backfilling: HashMap<(u32, u16), u64> = parts
            .iter()
            .filter(|p| !p.consistent || pacing.tracks((p.collection, p.partition)))
            .map(|p| ((p.collection, p.partition), p.seqno))
            .collect();
        let asked: Vec<(u16, u64)> = parts.iter().map(|p| (p.partition, p.seqno)).collect();
        let map_version = state.map.as_ref().map_or(0, |m| m.version);
        let wait = if first {
            Duration::ZERO
        } else if deferred.is_zero() {
            PULL_WAIT
        } else {
            deferred.min(PULL_WAIT)
        };
        let wait_ms = u32::try_from(wait.as_millis()).unwrap_or(u32::MAX);
        let request = PullRequest { from: node.id, map_version, round, wait_ms, parts, catch_up_for: None };
        let call = node.peers.call(&address, Op::Pull, wire::encode(&request), PULL_TIMEOUT);
        tokio::pin!(call);
        let answer = loop {
            tokio::select! {
                a = &mut call => break a,
                _ = stop.changed() => continue 'pulls,
                _ = next_reconcile(&mut reconciled) => {
                    // The pull in flight is dropped (nothing of it applied; the next one asks
                    // from the same positions) when there is more to follow than when it asked.
                    let now = parts_from(&node, &node.state(), source, &snapshot_end);
                    if asks_for_more(&following_now, &now) {
                        continue 'pulls;
                    }
                }
            }
        };
        let answer: PullAnswer = match answer.map_err(ClusterError::from).and_then(|b| wire::decode(&b).map_err(ClusterError::BadMessage)) {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!(source = source.0, error = %e, "pull failed");
                tokio::time::sleep(PULL_RETRY).await;
                continue;
            }
        };
        let _applying = node.apply_lock.lock().await;
        // The fence: once this node has applied that `source` failed (and reported its
        // progress under this lock), nothing more from it lands.
        if following(&node, &node.state(), source).is_none() {
            break;
        }
        round = answer.round;
        // Empty copies with a large backfill are built from files instead (`copy`).
        let backlog: Vec<(u16, u64)> = answer
            .parts
            .iter()
            .filter_map(|part| match &part.kind {
                PartKind::Changes { high, .. } => Some((part.partition, *high)),
                _ => None,
            })
            .collect();
        let by_files = crate::copy::choose(&node.copies, &asked, &backlog);
        crate::copy::enqueue(&node, source, &address, &by_files);
        let mut streamed = 0u64;
        for part in answer.parts {
            // Fault injection: a held collection's changes wait (a part with none goes on,
            // so the copy still reaches its snapshot's end where there is nothing to hold).
            let held =
                node.faults.is_held(part.collection) && matches!(&part.kind, PartKind::Changes { changes, .. } if !changes.is_empty());
            if by_files.contains(&part.partition) || held {
                continue;
            }
            let key = (part.collection, part.partition);
            let (bytes, last, high) = match &part.kind {
                PartKind::Changes { changes, high, .. } => (
                    changes.iter().map(|c| c.key.len() + c.value.as_ref().map_or(0, |v| v.len())).sum::<usize>() as u64,
                    changes.last().map(|c| c.seqno),
                    *high,
                ),
                _ => (0, None, 0),
            };
            match apply_part(&node, &address, part).await {
                Ok(Some(end)) => {
                    if let Some(&from) = backfilling.get(&key) {
                        let at = last.unwrap_or(from).max(from);
                        let done = backfilled(at, end, high);
                        node.copies.add_stream_bytes(key.1, bytes, done);
                        let near = at.saturating_add(UNPACED_WITHIN) >= high;
                        if pacing.took(key, from, done, near) {
                            streamed += bytes;
                        }
                    }
                    snapshot_end.insert(key, end);
                }
                Ok(None) => {}
                Err(e) => {
                    // A pull answered for a copy the map has just moved away or made active
                    // here is discarded; that is a rebalance's or failover's ordinary race.
                    if matches!(e, ClusterError::NotMine(_)) {
                        tracing::debug!(source = source.0, collection = key.0, partition = key.1, error = %e, "replicated changes for a copy no longer followed here");
                    } else {
                        tracing::warn!(source = source.0, collection = key.0, partition = key.1, error = %e, "applying replicated changes");
                    }
                    snapshot_end.remove(&key);
                }
            }
        }
        let mb_per_s = node.state().settings.rebalance_mb_per_s;
        pacing.paced(Instant::now(), node.copies.pace_stream(usize::try_from(streamed).unwrap_or(usize::MAX), mb_per_s));
    }
    tracing::info!(source = source.0, "replication stopped");
}

/// Waits for the engine's next step with the metadata (for ever if the node is going away).
async fn next_reconcile(reconciled: &mut watch::Receiver<u64>) {
    if reconciled.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Whether a stream that followed `asked` (collection, partition) when it pulled should now
/// follow a part it did not (a new collection, a copy given to this node). Pure.
fn asks_for_more(asked: &[(u32, u16)], now: &[PullPart]) -> bool {
    now.iter().any(|p| !asked.contains(&(p.collection, p.partition)))
}

/// Whether a copy backfilling from the change stream, now at seqno `at`, is built: it holds
/// a consistent state (past the snapshot's `end`) and is within a batch of the active's
/// `high`. Consistent alone is not enough: a read from the active's in-memory tail is
/// consistent at every batch, and a copy 6 MB short of its active showed as done after its
/// first 512 changes.
fn backfilled(at: u64, end: u64, high: u64) -> bool {
    at >= end && at.saturating_add(PULL_BATCH_CHANGES as u64) >= high
}

/// The copies one replication stream is building from the change stream, from their
/// first backfilled answer until [`backfilled`]; those that began at seqno 0 are new copies
/// (a move's), the others catch up from where they were (a restarted replica).
///
/// What new copies take moves at most the node's copy budget (`Copies::pace_stream`): after
/// an answer that brought them `n` bytes, they sit out the pulls until `n` bytes' time has
/// passed. The other parts of the stream (replicas that follow live, whose
/// acknowledgements majority writes wait on, and copies catching up) are never held.
#[derive(Debug, Default)]
struct StreamPacing {
    /// The parts being built, each as (collection, partition), and whether it is a new copy.
    building: HashMap<(u32, u16), bool>,
    /// Until when the new copies sit out.
    not_before: Option<Instant>,
}

impl StreamPacing {
    /// Takes the new copies out of `parts` while they sit out; answers how long they still
    /// do (zero: they are asked for).
    fn defer(&mut self, parts: &mut Vec<PullPart>, now: Instant) -> Duration {
        let left = self.not_before.map_or(Duration::ZERO, |t| t.saturating_duration_since(now));
        if !left.is_zero() {
            parts.retain(|p| self.building.get(&(p.collection, p.partition)) != Some(&true));
        }
        left
    }

    /// Forgets the copies this stream follows no more (the map moved them, a stop undid
    /// their move): else a new copy left here would keep the budget's probe measuring.
    fn follow_only(&mut self, parts: &[PullPart]) {
        self.building.retain(|key, _| parts.iter().any(|p| (p.collection, p.partition) == *key));
    }

    /// Whether a new copy is being built from the stream (the budget's probe measures then).
    fn is_building(&self) -> bool {
        self.building.values().any(|new| *new)
    }

    /// Whether `key` is being built (its bytes are a copy's progress until it is built).
    fn tracks(&self, key: (u32, u16)) -> bool {
        self.building.contains_key(&key)
    }

    /// A part backfilling from `from` took changes; `done` once [`backfilled`]; `near` once
    /// within [`UNPACED_WITHIN`] of its active. Answers whether what it took counts against
    /// the budget (a new copy's, until it is near).
    fn took(&mut self, key: (u32, u16), from: u64, done: bool, near: bool) -> bool {
        let new = self.building.entry(key).or_insert(from == 0);
        let paced = *new;
        if near {
            *new = false;
        }
        if done {
            self.building.remove(&key);
        }
        paced
    }

    /// The answer's new copies must wait `wait` before they take more.
    fn paced(&mut self, now: Instant, wait: Duration) {
        self.not_before = (!wait.is_zero()).then(|| now + wait);
    }
}

/// The address of `source` if this node should follow it now.
fn following(node: &ClusterNode, state: &MetaState, source: NodeId) -> Option<String> {
    let member = state.members.get(&source)?;
    if member.state == MemberState::Failed || *node.stop.borrow() {
        return None;
    }
    let me = node.id;
    let map = state.map.as_ref()?;
    map.partitions.iter().any(|c| c.active == source && c.replicas.contains(&me)).then(|| member.address.clone())
}

/// Every collection's copy of every partition this node follows `source` for.
fn parts_from(node: &ClusterNode, state: &MetaState, source: NodeId, snapshot_end: &HashMap<(u32, u16), u64>) -> Vec<PullPart> {
    let me = node.id;
    let Some(map) = &state.map else { return Vec::new() };
    let partitions: Vec<u16> = map
        .iter()
        .filter(|(p, c)| c.active == source && c.replicas.contains(&me) && !node.copies.is_building(*p))
        .map(|(p, _)| p)
        .collect();
    let store = node.engine.store();
    // Only copies whose state follows a map that makes them replicas: the metadata can be
    // ahead of the states (see `copy_has_position`).
    let partitions: Vec<u16> = partitions.into_iter().filter(|p| node.copy_has_position(*p)).collect();
    let mut parts = Vec::new();
    for (name, def) in &state.collections {
        let Some(coll) = store.collection(name).filter(|c| c.id() == def.id) else { continue };
        let positions = coll.positions();
        for &p in &partitions {
            let Some(pos) = positions.get(usize::from(p)) else { continue };
            let persisted = coll.persisted_watch(p).map(|w| *w.borrow()).unwrap_or(0);
            let end = snapshot_end.get(&(def.id, p));
            let consistent = end.is_some_and(|end| pos.seqno >= *end);
            let peek = end.is_none() && pos.seqno == 0 && node.copies.may_copy(p);
            parts.push(PullPart { collection: def.id, partition: p, seqno: pos.seqno, uuid: pos.uuid, persisted, consistent, peek });
        }
    }
    parts
}

/// Applies one part of an answer; answers the part's snapshot end when it carried changes.
pub(crate) async fn apply_part(node: &Arc<ClusterNode>, source_address: &str, part: PartAnswer) -> Result<Option<u64>, ClusterError> {
    let Some(coll) = node.collection_by_id(part.collection) else { return Ok(None) };
    let p = part.partition;
    match part.kind {
        PartKind::Refused { why } => {
            tracing::debug!(collection = part.collection, partition = p, why, "the active does not serve this copy yet");
            Ok(None)
        }
        PartKind::Rollback { to, history } => {
            // Checked before anything is removed: a copy is never rolled back towards a
            // history it could not then take.
            if !shoal_storage::is_history(&history) {
                return Err(ClusterError::BadMessage(format!("partition {p}: a rollback to {to} with a malformed history")));
            }
            roll_back(node, source_address, &coll, p, to).await?;
            adopt(node, source_address, &coll, p, history).await?;
            Ok(None)
        }
        PartKind::Changes { history, changes, snapshot_end, .. } => {
            if let Some(history) = history {
                adopt(node, source_address, &coll, p, history).await?;
            }
            if !changes.is_empty() {
                let c = Arc::clone(&coll);
                let wait = blocking(move || {
                    let changes: Vec<Change> = changes.into_iter().map(|w| w.into_change(p)).collect();
                    c.apply(p, &changes)
                })
                .await?
                .map_err(|e| match e {
                    shoal_storage::WriteError::NotMyPartition(n) => ClusterError::NotMine(n),
                    e => ClusterError::Storage(e.to_string()),
                })?;
                // The persisted seqno moves only when someone waits for an fsync; the next
                // pull reports it (persist_majority writes wait for that).
                tokio::spawn(async move {
                    if let Err(e) = wait.wait().await {
                        tracing::warn!(error = %e, "fsync of replicated changes");
                    }
                });
            }
            Ok(Some(snapshot_end))
        }
    }
}

/// Takes the active's history; when this copy holds changes that history does not have,
/// rolls back to where they part first.
async fn adopt(
    node: &Arc<ClusterNode>,
    source_address: &str,
    coll: &Arc<Collection>,
    p: u16,
    history: Vec<shoal_storage::FailoverEntry>,
) -> Result<(), ClusterError> {
    let store = Arc::clone(node.engine.store());
    let c = Arc::clone(coll);
    let h = history.clone();
    match blocking(move || store.adopt_history(&c, p, &h)).await? {
        Ok(()) => Ok(()),
        Err(PartitionError::Diverged { rollback_to }) => {
            roll_back(node, source_address, coll, p, rollback_to).await?;
            let store = Arc::clone(node.engine.store());
            let c = Arc::clone(coll);
            blocking(move || store.adopt_history(&c, p, &history)).await?.map_err(ClusterError::from)
        }
        Err(e) => Err(e.into()),
    }
}

/// Rolls this copy back to `to` and restores the keys that removed from the active's
/// current versions. Those are fetched *before* the rollback: a source that cannot answer
/// (it handed the partition over meanwhile, or is gone) leaves the copy as it was, to be
/// rolled back on a later pull; fetched after, the keys the rollback removed would be lost
/// (nothing lists them again).
async fn roll_back(node: &Arc<ClusterNode>, source_address: &str, coll: &Arc<Collection>, p: u16, to: u64) -> Result<(), ClusterError> {
    let c = Arc::clone(coll);
    let doomed = blocking(move || c.keys_above(p, to)).await?.map_err(|e| ClusterError::Storage(e.to_string()))?;
    let mut versions = fetch_versions(node, source_address, coll, p, &doomed).await?;
    let store = Arc::clone(node.engine.store());
    let c = Arc::clone(coll);
    let report = blocking(move || store.rollback_partition(&c, p, to)).await?.map_err(ClusterError::from)?;
    tracing::info!(collection = coll.name(), partition = p, to = report.seqno, removed = report.removed.len(), "rolled back");
    metrics::counter!("shoal_replica_rollbacks_total").increment(1);
    // Nothing writes this copy between the two looks (its changes come from this loop); a
    // key removed that was not listed is fetched now, as before.
    let listed: std::collections::HashSet<&[u8]> = doomed.iter().map(|k| &k[..]).collect();
    let unlisted: Vec<bytes::Bytes> = report.removed.iter().filter(|k| !listed.contains(&k[..])).cloned().collect();
    debug_assert!(unlisted.is_empty(), "a rollback removes only the keys listed before it");
    versions.extend(fetch_versions(node, source_address, coll, p, &unlisted).await?);
    let c = Arc::clone(coll);
    blocking(move || c.restore(p, &versions)).await?.map_err(ClusterError::from)?;
    Ok(())
}

/// The active's current versions of `keys` (absent ones left out), as changes of `p`.
async fn fetch_versions(
    node: &Arc<ClusterNode>,
    source_address: &str,
    coll: &Arc<Collection>,
    p: u16,
    keys: &[bytes::Bytes],
) -> Result<Vec<Change>, ClusterError> {
    let mut out = Vec::new();
    for keys in keys.chunks(VERSIONS_KEYS_MAX) {
        let req = VersionsRequest { collection: coll.id(), partition: p, keys: keys.to_vec() };
        let bytes = node.peers.call(source_address, Op::Versions, wire::encode(&req), PULL_TIMEOUT).await?;
        let answer: VersionsAnswer = wire::decode(&bytes).map_err(ClusterError::BadMessage)?;
        out.extend(answer.changes.into_iter().map(|w| w.into_change(p)));
    }
    Ok(out)
}

/// The active's side of a pull: records the acknowledgements, then answers what follows
/// each part's position, holding the request up to its wait when there is nothing.
pub(crate) async fn serve_pull(node: &Arc<ClusterNode>, req: PullRequest) -> Result<PullAnswer, ClusterError> {
    let state = node.state();
    let map = state.map.as_ref().ok_or_else(|| ClusterError::Refused("no partition map yet".into()))?;
    let from = req.from;
    let me = node.id;
    // A promotion's catch-up: `from` and this node are fenced replicas of partitions the
    // failed node was active for; this node's copies no longer change.
    let catch_up = req.catch_up_for.filter(|f| state.members.get(f).is_some_and(|m| m.state == MemberState::Failed));
    if req.catch_up_for.is_some() && catch_up.is_none() {
        return Err(ClusterError::Refused(format!(
            "node {} is not failed over here; no catch-up from its copies",
            req.catch_up_for.map_or(0, |n| n.0)
        )));
    }
    // This node's copy of a partition it serves as the active (`ClusterNode::copy_serves`).
    // Checked again before each read: a long-polled pull outlives maps, and a copy dropped
    // meanwhile would answer "roll back to 0" with no history.
    let copy_serves = |p: u16| node.copy_serves(p);
    // Only parts this node is active for and `from` is a replica of count as acknowledgements.
    let (mut served, refused): (Vec<PullPart>, Vec<PullPart>) = req.parts.into_iter().partition(|part| {
        let copies = map.partitions.get(usize::from(part.partition));
        let serves = match catch_up {
            None => copies.is_some_and(|c| c.active == me && c.replicas.contains(&from)) && copy_serves(part.partition),
            Some(failed) => copies.is_some_and(|c| c.active == failed && c.replicas.contains(&from) && c.replicas.contains(&me)),
        };
        serves && node.collection_by_id(part.collection).is_some()
    });
    if catch_up.is_none() {
        node.acks.record(req.from, req.round, &served);
    }
    let mut answer = PullAnswer {
        round: node.acks.round(),
        parts: refused
            .iter()
            .map(|part| {
                refusal(
                    part,
                    format!("not the active of partition {} for node {} at map version {}", part.partition, req.from, map.version),
                )
            })
            .collect(),
    };
    let deadline = Instant::now() + Duration::from_millis(u64::from(req.wait_ms)).min(PULL_WAIT);
    let mut poke = node.acks.poked();
    poke.borrow_and_update();
    // A round begun since the replica's last answer (a majority read's confirmation, a
    // hand-over) is answered at once, and so is one begun while this pull waits: the replica
    // then acknowledges the round, with every part it follows now, one round trip later
    // instead of after `PULL_WAIT`. (A hand-over froze its partitions for 474 ms waiting
    // out a held pull that a poke woke but did not answer.)
    let mut poked = req.round < node.acks.round();
    let colls: Vec<Arc<Collection>> = {
        let mut ids: Vec<u32> = served.iter().map(|p| p.collection).collect();
        ids.sort_unstable();
        ids.dedup();
        ids.into_iter().filter_map(|id| node.collection_by_id(id)).collect()
    };
    let mut changed: Vec<watch::Receiver<u64>> = colls.iter().map(|c| c.changed()).collect();
    loop {
        for rx in &mut changed {
            rx.borrow_and_update();
        }
        if catch_up.is_none() {
            // A copy that left this node's hands while the pull waited is refused: the
            // replica asks again, of the active the next map names.
            let (still, gone): (Vec<PullPart>, Vec<PullPart>) = served.into_iter().partition(|part| copy_serves(part.partition));
            served = still;
            answer.parts.extend(gone.iter().map(|part| refusal(part, format!("partition {} is no longer served here", part.partition))));
        }
        let n = Arc::clone(node);
        let parts = served.clone();
        let read = blocking(move || read_parts(&n, &parts)).await?;
        let any = read.iter().any(|p| !matches!(&p.kind, PartKind::Changes { history: None, changes, .. } if changes.is_empty()));
        if any || poked || Instant::now() >= deadline || !answer.parts.is_empty() {
            answer.round = node.acks.round();
            answer.parts.extend(read);
            return Ok(answer);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let any_change = async {
            if changed.is_empty() {
                std::future::pending::<()>().await;
            }
            let _ = futures::future::select_all(changed.iter_mut().map(|rx| Box::pin(rx.changed()))).await;
        };
        tokio::select! {
            _ = tokio::time::sleep(left) => {}
            _ = poke.changed() => poked = true,
            _ = any_change => {}
        }
    }
}

/// The answer to a part this node does not serve.
fn refusal(part: &PullPart, why: String) -> PartAnswer {
    PartAnswer { collection: part.collection, partition: part.partition, kind: PartKind::Refused { why } }
}

/// Reads what follows each part (blocking storage reads).
fn read_parts(node: &ClusterNode, parts: &[PullPart]) -> Vec<PartAnswer> {
    parts
        .iter()
        .map(|part| {
            let kind = match node.collection_by_id(part.collection) {
                None => PartKind::Refused { why: format!("no collection {}", part.collection) },
                Some(coll) => read_part(&coll, part),
            };
            PartAnswer { collection: part.collection, partition: part.partition, kind }
        })
        .collect()
}

fn read_part(coll: &Collection, part: &PullPart) -> PartKind {
    let p = part.partition;
    let from = StreamPosition { seqno: part.seqno, uuid: part.uuid };
    let refused = |e: &dyn std::fmt::Display| PartKind::Refused { why: e.to_string() };
    let (mut reader, rollback) = match coll.subscribe(p, from) {
        Ok(r) => r,
        Err(e) => return refused(&e),
    };
    let history = coll.failover_log(p);
    if history.is_empty() {
        // Only a copy dropped (or never built) here has no history: nothing to follow.
        return PartKind::Refused { why: format!("partition {p} has no copy here") };
    }
    if let Some(to) = rollback.filter(|&to| to < part.seqno) {
        return PartKind::Rollback { to, history };
    }
    let mine = coll.position(p).map_or(0, |pos| pos.uuid);
    let history = (part.uuid != mine).then_some(history);
    let changes = if part.peek { Ok(Vec::new()) } else { reader.try_next(PULL_BATCH_CHANGES, true) };
    match changes {
        Ok(changes) => PartKind::Changes {
            history,
            changes: changes.into_iter().map(WireChange::from_change).collect(),
            snapshot_end: reader.snapshot_end(),
            high: coll.high_seqno(p),
        },
        Err(e) => refused(&e),
    }
}

/// The active's current version of each key asked for (a replica repairing a rollback).
pub(crate) async fn serve_versions(node: &Arc<ClusterNode>, req: VersionsRequest) -> Result<VersionsAnswer, ClusterError> {
    if req.keys.len() > VERSIONS_KEYS_MAX {
        return Err(ClusterError::BadMessage(format!("at most {VERSIONS_KEYS_MAX} keys per versions call")));
    }
    let coll = node.collection_by_id(req.collection).ok_or_else(|| ClusterError::Refused(format!("no collection {}", req.collection)))?;
    // Only the copy the replica follows answers.
    let p = req.partition;
    if !node.copy_serves(p) {
        return Err(ClusterError::Refused(format!("partition {p} is not served here: not the copy to repair from")));
    }
    blocking(move || {
        let mut changes = Vec::with_capacity(req.keys.len());
        for key in req.keys {
            let Ok(k) = std::str::from_utf8(&key) else { continue };
            if shoal_storage::partition_of(&key, coll.partition_count()) != p {
                return Err(ClusterError::BadMessage(format!("a key of another partition than {p}")));
            }
            // A key the active no longer has (deleted, then purged or not) is left out: the
            // replica does not have it either after its rollback. Its tombstone is not
            // restored; a reader of the key sees the same "not found". A key that cannot be
            // read fails the call: left out, it would be lost.
            if let Some(doc) = coll.current_version(k).map_err(|e| ClusterError::Storage(e.to_string()))? {
                changes.push(WireChange {
                    seqno: doc.seqno,
                    key,
                    cas: doc.cas,
                    deleted: false,
                    expiry: doc.expiry,
                    value: Some(doc.value),
                });
            }
        }
        Ok(VersionsAnswer { changes })
    })
    .await?
}

impl ClusterNode {
    /// This node's collection with the cluster id `id`.
    pub(crate) fn collection_by_id(&self, id: u32) -> Option<Arc<Collection>> {
        let state = self.state();
        let name = state.collections.iter().find(|(_, d)| d.id == id).map(|(n, _)| n.clone())?;
        self.engine.store().collection(&name).filter(|c| c.id() == id)
    }

    /// This node's copies of the cluster's collections (name and id as the metadata has them).
    pub(crate) fn cluster_collections(&self) -> Vec<Arc<Collection>> {
        let state = self.state();
        let store = self.engine.store();
        state.collections.iter().filter_map(|(name, def)| store.collection(name).filter(|c| c.id() == def.id)).collect()
    }

    /// Where this node's copy of each partition ends, in each of the cluster's collections:
    /// partition → (collection id, epoch, seqno), for the copies that have a position
    /// (`copy_has_position`).
    pub(crate) fn collection_ends(&self) -> std::collections::BTreeMap<shoal_cluster::PartitionId, Vec<crate::wire::CollectionEnd>> {
        let live: Vec<bool> = (0..self.engine.store().partitions()).map(|p| self.copy_has_position(p)).collect();
        let mut out: std::collections::BTreeMap<shoal_cluster::PartitionId, Vec<crate::wire::CollectionEnd>> =
            std::collections::BTreeMap::new();
        for coll in self.cluster_collections() {
            for (p, live) in live.iter().enumerate() {
                let Ok(p) = shoal_cluster::PartitionId::try_from(p) else { continue };
                if let (true, Some((epoch, seqno))) = (*live, coll.history_end(p)) {
                    out.entry(p).or_default().push((coll.id(), epoch, seqno));
                }
            }
        }
        out
    }

    /// Whether this node's copy of `p` has a position to report or acknowledge: it is not
    /// dead. A retired copy keeps its old positions until its data is discarded, and must
    /// never count as holding them. Ask before reading the positions: a copy not dead then
    /// was discarded before it got its role.
    pub(crate) fn copy_has_position(&self, p: u16) -> bool {
        self.engine.store().partition_state(p).is_ok_and(|s| s != PartitionState::Dead)
    }

    /// Where this node's copy of each partition is, in each of the cluster's collections:
    /// partition → (collection id, position: seqno and history), for the copies that have
    /// one (`copy_has_position`).
    pub(crate) fn collection_positions(&self) -> std::collections::BTreeMap<shoal_cluster::PartitionId, Vec<(u32, StreamPosition)>> {
        let live: Vec<bool> = (0..self.engine.store().partitions()).map(|p| self.copy_has_position(p)).collect();
        let mut out: std::collections::BTreeMap<shoal_cluster::PartitionId, Vec<(u32, StreamPosition)>> = std::collections::BTreeMap::new();
        for coll in self.cluster_collections() {
            for (p, pos) in coll.positions().iter().enumerate() {
                if let (Ok(p), Some(true)) = (shoal_cluster::PartitionId::try_from(p), live.get(p)) {
                    out.entry(p).or_default().push((coll.id(), *pos));
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(collection: u32, partition: u16) -> PullPart {
        PullPart { collection, partition, seqno: 7, uuid: 1, persisted: 7, consistent: false, peek: false }
    }

    #[test]
    fn a_pull_in_flight_is_asked_again_only_for_a_part_it_does_not_follow() {
        let asked = [(1, 0), (1, 1), (2, 0)];
        // (what the stream should follow now, asks for more)
        let table: [(Vec<PullPart>, bool); 5] = [
            (vec![part(1, 0), part(1, 1), part(2, 0)], false),
            // A copy moved away: the pull in flight is answered or refused for it.
            (vec![part(1, 0)], false),
            (vec![], false),
            // A new collection's copy of a partition already followed for another.
            (vec![part(1, 0), part(1, 1), part(2, 0), part(3, 0)], true),
            // A copy of a new partition given to this node.
            (vec![part(1, 0), part(1, 1), part(1, 2), part(2, 0)], true),
        ];
        for (now, more) in table {
            assert_eq!(asks_for_more(&asked, &now), more, "{now:?}");
        }
    }

    #[test]
    fn a_stream_copy_is_built_once_consistent_and_within_a_batch_of_its_active() {
        let batch = PULL_BATCH_CHANGES as u64;
        // (where the copy is after the answer, snapshot end, active's high, built)
        let table = [
            (512, 512, 3_000, false),
            (512, 3_000, 3_000, false),
            (3_000, 3_000, 3_000, true),
            (2_600, 2_600, 2_600 + batch, true),
            (2_600, 2_600, 2_601 + batch, false),
            (2_500, 2_600, 2_600, false),
            (0, 0, 0, true),
        ];
        for (at, end, high, built) in table {
            assert_eq!(backfilled(at, end, high), built, "{at} {end} {high}");
        }
    }

    #[test]
    fn only_new_copies_sit_out_their_pacing_and_only_until_it_ends() {
        let now = Instant::now();
        let mut pacing = StreamPacing::default();
        // A new copy (from seqno 0) and a copy catching up from where it was (from 40).
        assert!(pacing.took((1, 3), 0, false, false), "a new copy's bytes are paced");
        assert!(!pacing.took((1, 4), 40, false, false), "a copy catching up is not");
        assert!(pacing.is_building());
        assert!(pacing.tracks((1, 3)) && pacing.tracks((1, 4)) && !pacing.tracks((2, 3)), "both are progress until built");
        assert!(pacing.took((1, 3), 512, false, false), "a new copy stays one past its first answer");
        pacing.paced(now, Duration::from_millis(10));
        // (when, parts sitting out, time left)
        type Row = (Duration, &'static [(u32, u16)], Duration);
        let table: &[Row] = &[
            (Duration::ZERO, &[(1, 3)], Duration::from_millis(10)),
            (Duration::from_millis(4), &[(1, 3)], Duration::from_millis(6)),
            (Duration::from_millis(10), &[], Duration::ZERO),
            (Duration::from_millis(50), &[], Duration::ZERO),
        ];
        for (at, out, left) in table {
            let mut parts = vec![part(1, 3), part(1, 4), part(2, 3)];
            assert_eq!(pacing.defer(&mut parts, now + *at), *left, "at {at:?}");
            let kept: Vec<(u32, u16)> = parts.iter().map(|p| (p.collection, p.partition)).collect();
            let expected: Vec<(u32, u16)> = [(1, 3), (1, 4), (2, 3)].into_iter().filter(|k| !out.contains(k)).collect();
            assert_eq!(kept, expected, "at {at:?}");
        }
        // Near its active, it is paced no more (the bytes that took it there still count),
        // but it is still being built.
        assert!(pacing.took((1, 3), 1_024, false, true), "the bytes that took it near count");
        assert!(!pacing.is_building() && pacing.tracks((1, 3)));
        pacing.paced(now, Duration::from_millis(10));
        let mut parts = vec![part(1, 3)];
        pacing.defer(&mut parts, now);
        assert_eq!(parts.len(), 1, "a copy near its active is not held");
        assert!(!pacing.took((1, 3), 1_536, true, true), "nor counted");
        assert!(!pacing.tracks((1, 3)));
        pacing.paced(now, Duration::from_millis(10));
        let mut parts = vec![part(1, 3)];
        pacing.defer(&mut parts, now);
        assert_eq!(parts.len(), 1);
        // No wait: nothing sits out.
        pacing.paced(now, Duration::ZERO);
        assert_eq!(pacing.defer(&mut parts, now), Duration::ZERO);
    }

    #[test]
    fn a_copy_the_stream_follows_no_more_is_forgotten() {
        let mut pacing = StreamPacing::default();
        pacing.took((1, 3), 0, false, false);
        pacing.took((1, 4), 0, false, false);
        pacing.follow_only(&[part(1, 4), part(2, 9)]);
        assert!(!pacing.tracks((1, 3)), "moved away: forgotten");
        assert!(pacing.tracks((1, 4)) && !pacing.tracks((2, 9)));
        pacing.follow_only(&[]);
        assert!(!pacing.is_building(), "the probe may rest");
    }
}
