//! The index service's feed: an index node follows every data partition's change stream at
//! its active copy, wherever that lives (issue 41).
//!
//! [`FeedLink`] is the index node's `shoal_index::ChangeFetcher`: it groups the asked
//! positions by the partitions' actives in the current map and asks each active once
//! ([`Op::Feed`]); an active answers what follows each position from its copy
//! ([`serve_feed`], the same reads as a replica's pull, without acknowledgements), or where
//! history is shared when the position is off its history (a failover), or refuses a
//! partition it does not serve active — the index then asks again by the next map.
//! `request_plus` asks every active for its positions ([`Op::Highs`], [`serve_highs`]), all
//! by one map; a partition frozen for a hand-over is not answered (its new active may take
//! writes before this member has the next map). After a hand-over the new active's history
//! goes on from the old one's at the same seqno under a new uuid, so a scan that finds its
//! index at the seqnos it asked for but on another history asks again
//! (`shoal_index`'s `ready`).
//!
//! An index node is a node running the `index` service. The partitions active on it are
//! read here, without the network; a node that holds every active (a cluster of one) feeds
//! its placed indexes from its own streams as unplaced ones are ([`FeedLink::all_here`]),
//! key-order build included.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use shoal_cluster::NodeId;
use shoal_index::{ChangeFetcher, FetchFuture, IndexError};
use shoal_storage::{Collection, Fetched, FetchedPart, PartitionId, StreamPosition};

use crate::node::{blocking, ClusterNode};
use crate::peers::Op;
use crate::wire::{self, WireChange};
use crate::ClusterError;

/// Changes one answer carries per partition, at most.
const FEED_BATCH_CHANGES: usize = 1024;
/// Longest an active holds a feed call that finds nothing new.
const FEED_WAIT_MAX: Duration = Duration::from_secs(2);
/// How long a feed or highs call may take beyond its wait.
const FEED_TIMEOUT: Duration = Duration::from_secs(10);

/// An index node asks an active for what follows its positions.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FeedRequest {
    pub collection: u32,
    pub wait_ms: u32,
    /// (partition, seqno, history uuid) the index has applied.
    pub parts: Vec<(u16, u64, u64)>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FeedAnswer {
    pub parts: Vec<(u16, FeedKind)>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum FeedKind {
    /// The changes after the position; `end` is where the stream stands after them and
    /// `high` the active's position now (seqno, uuid).
    Changes { changes: Vec<WireChange>, end: (u64, u64), snapshot_end: u64, high: (u64, u64) },
    /// The position is off the active's history, which it shares up to `shared`.
    Rollback { shared: u64, high: (u64, u64) },
    /// Not served here (not the active of the partition now).
    Refused { why: String },
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HighsRequest {
    pub collection: u32,
    /// The map the index node asks by: a member on another map refuses (a partition
    /// handed over meanwhile would answer the old active's high).
    pub map_version: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HighsAnswer {
    /// (partition, seqno, uuid) of every partition this member serves active.
    pub partitions: Vec<(u16, u64, u64)>,
}

fn pos((seqno, uuid): (u64, u64)) -> StreamPosition {
    StreamPosition { seqno, uuid }
}

fn pair(p: StreamPosition) -> (u64, u64) {
    (p.seqno, p.uuid)
}

/// The active's side of a feed call: what follows each asked position, holding the call up
/// to its wait while there is nothing.
pub(crate) async fn serve_feed(node: &Arc<ClusterNode>, req: FeedRequest) -> Result<FeedAnswer, ClusterError> {
    let coll = node.collection_by_id(req.collection).ok_or_else(|| ClusterError::Refused(format!("no collection {}", req.collection)))?;
    let deadline = Instant::now() + Duration::from_millis(u64::from(req.wait_ms)).min(FEED_WAIT_MAX);
    let mut changed = coll.changed();
    loop {
        changed.borrow_and_update();
        let served: Vec<bool> = req.parts.iter().map(|&(p, _, _)| node.copy_serves(p)).collect();
        let (c, parts) = (Arc::clone(&coll), req.parts.clone());
        let answer = blocking(move || read_feed(&c, &parts, &served)).await?;
        let news = answer
            .parts
            .iter()
            .any(|(_, k)| !matches!(k, FeedKind::Changes { changes, end, high, .. } if changes.is_empty() && end == high));
        if news || Instant::now() >= deadline {
            return Ok(answer);
        }
        let _ = tokio::time::timeout_at(deadline.into(), changed.changed()).await;
    }
}

fn read_feed(coll: &Collection, parts: &[(u16, u64, u64)], served: &[bool]) -> FeedAnswer {
    let parts = parts
        .iter()
        .zip(served)
        .map(|(&(p, seqno, uuid), &serves)| {
            if !serves {
                return (p, FeedKind::Refused { why: format!("partition {p} is not active here") });
            }
            let from = StreamPosition { seqno, uuid };
            let high = pair(coll.position(p).unwrap_or_default());
            let kind = match coll.subscribe(p, from) {
                Err(e) => FeedKind::Refused { why: e.to_string() },
                Ok((_, Some(shared))) if shared < seqno => FeedKind::Rollback { shared, high },
                Ok((mut reader, _)) => match reader.try_next(FEED_BATCH_CHANGES, true) {
                    Ok(changes) => FeedKind::Changes {
                        changes: changes.into_iter().map(WireChange::from_change).collect(),
                        end: pair(reader.position()),
                        snapshot_end: reader.snapshot_end(),
                        high,
                    },
                    Err(e) => FeedKind::Refused { why: e.to_string() },
                },
            };
            (p, kind)
        })
        .collect();
    FeedAnswer { parts }
}

/// The positions of the partitions this member serves active.
pub(crate) fn serve_highs(node: &Arc<ClusterNode>, req: HighsRequest) -> Result<HighsAnswer, ClusterError> {
    let here = node.state().map_version();
    if here != req.map_version {
        return Err(ClusterError::Refused(format!("asked by map version {}; this member is at {here}", req.map_version)));
    }
    let coll = node.collection_by_id(req.collection).ok_or_else(|| ClusterError::Refused(format!("no collection {}", req.collection)))?;
    // A partition frozen for a hand-over is left out: its new active may take writes as
    // soon as it has the next map, before this member has it, so the high here may be short.
    let partitions = (0..coll.partition_count())
        .filter(|&p| node.copy_serves(p) && !node.frozen(p))
        .filter_map(|p| coll.position(p).map(|at| (p, at.seqno, at.uuid)))
        .collect();
    Ok(HighsAnswer { partitions })
}

/// An index node's [`ChangeFetcher`], bound to its cluster node once that is open (the
/// index manager opens first, with the engine).
#[derive(Default)]
pub struct FeedLink {
    node: OnceLock<Weak<ClusterNode>>,
}

impl FeedLink {
    pub fn new() -> Arc<FeedLink> {
        Arc::new(FeedLink::default())
    }

    /// Binds the link to `node`; later calls change nothing.
    pub fn attach(&self, node: &Arc<ClusterNode>) {
        let _ = self.node.set(Arc::downgrade(node));
    }

    fn node(&self) -> Result<Arc<ClusterNode>, IndexError> {
        self.node
            .get()
            .and_then(Weak::upgrade)
            .ok_or_else(|| IndexError::Unavailable("this index node has not joined its cluster yet".into()))
    }

    /// Each partition's active and its address in map `state`, routed as a key request
    /// is ([`route_partition`](crate::routing::route_partition)): a partition whose active
    /// failed is asked of nobody until the map names a new one.
    fn actives(
        me: NodeId,
        state: &shoal_meta::MetaState,
        partitions: u16,
    ) -> Result<BTreeMap<NodeId, (String, Vec<PartitionId>)>, IndexError> {
        use crate::routing::{route_partition, Route};
        let map = state.map.as_ref().ok_or_else(|| IndexError::Unavailable("no partition map yet".into()))?;
        let mut out: BTreeMap<NodeId, (String, Vec<PartitionId>)> = BTreeMap::new();
        for p in 0..partitions.min(map.partition_count()) {
            let (node, address) = match route_partition(me, state, map, p) {
                Route::Local => (me, String::new()),
                Route::Forward { node, address } => (node, address),
                Route::Unavailable { .. } => continue,
            };
            out.entry(node).or_insert_with(|| (address, Vec::new())).1.push(p);
        }
        Ok(out)
    }
}

impl ChangeFetcher for FeedLink {
    fn fetch<'a>(&'a self, coll: &'a Collection, asks: Vec<(PartitionId, StreamPosition)>, wait: Duration) -> FetchFuture<'a, Fetched> {
        Box::pin(async move {
            let node = self.node()?;
            let from: BTreeMap<PartitionId, StreamPosition> = asks.iter().copied().collect();
            let actives = FeedLink::actives(node.id, &node.state(), coll.partition_count())?;
            let call = |to: NodeId, address: &str, partitions: &[PartitionId], wait: Duration| {
                let parts: Vec<(u16, u64, u64)> = partitions.iter().filter_map(|p| from.get(p).map(|at| (*p, at.seqno, at.uuid))).collect();
                let req = FeedRequest { collection: coll.id(), wait_ms: u32::try_from(wait.as_millis()).unwrap_or(u32::MAX), parts };
                let (node, address) = (Arc::clone(&node), address.to_string());
                async move { (to, feed_call(&node, to, &address, req, wait).await) }
            };
            // Every active at once, each holding its call up to `wait` while it has nothing
            // new: a round takes what came meanwhile from all of them, so that its fixed
            // cost (every index, every partition) is paid once per batch of changes.
            let calls = actives.iter().map(|(to, (address, partitions))| call(*to, address, partitions, wait));
            let answers: BTreeMap<NodeId, FeedAnswer> =
                futures::future::join_all(calls).await.into_iter().filter_map(|(to, a)| a.map(|a| (to, a))).collect();
            let mut fetched = Fetched::new(coll.partition_count());
            for answer in answers.into_values() {
                for (p, kind) in answer.parts {
                    let Some(&at) = from.get(&p) else { continue };
                    let part = match kind {
                        FeedKind::Changes { changes, end, snapshot_end, high } => FetchedPart {
                            from: at,
                            rollback: None,
                            changes: changes.into_iter().map(|c| c.into_change(p)).collect(),
                            end: pos(end),
                            snapshot_end,
                            high: pos(high),
                        },
                        FeedKind::Rollback { shared, high } => {
                            FetchedPart { from: at, rollback: Some(shared), end: at, high: pos(high), ..FetchedPart::default() }
                        }
                        // Asked again next round, of the active the map names then.
                        FeedKind::Refused { why } => {
                            tracing::debug!(partition = p, %why, "index feed: refused");
                            continue;
                        }
                    };
                    if part.changes.iter().any(|c| c.seqno <= at.seqno || c.seqno > part.end.seqno) {
                        continue;
                    }
                    fetched.insert(p, part);
                }
            }
            Ok(fetched)
        })
    }

    fn highs<'a>(&'a self, coll: &'a Collection) -> FetchFuture<'a, Vec<StreamPosition>> {
        Box::pin(async move {
            let node = self.node()?;
            // One map, end to end: every active answers by it or refuses, and the answers
            // count only if this node is still on it once they are in.
            let pinned = node.state();
            let map_version = pinned.map_version();
            let actives = FeedLink::actives(node.id, &pinned, coll.partition_count())?;
            let mut at: Vec<Option<StreamPosition>> = vec![None; usize::from(coll.partition_count())];
            let calls = actives.into_iter().map(|(to, (address, partitions))| {
                let node = Arc::clone(&node);
                let req = HighsRequest { collection: coll.id(), map_version };
                async move {
                    // This node's own partitions are read here.
                    if to == node.id {
                        return serve_highs(&node, req).ok().map(|answer| (partitions, answer));
                    }
                    let body = serde_json::to_vec(&req).ok()?;
                    let bytes = node.peers.call(&address, Op::Highs, body, FEED_TIMEOUT).await.ok()?;
                    let answer: HighsAnswer = serde_json::from_slice(&bytes).ok()?;
                    Some((partitions, answer))
                }
            });
            for (partitions, answer) in futures::future::join_all(calls).await.into_iter().flatten() {
                for (p, seqno, uuid) in answer.partitions {
                    // Only what the map asked of this member: a partition it still serves
                    // while the map moved on is asked of its new active.
                    if partitions.contains(&p) {
                        if let Some(slot) = at.get_mut(usize::from(p)) {
                            *slot = Some(StreamPosition { seqno, uuid });
                        }
                    }
                }
            }
            if node.state().map_version() != map_version {
                return Err(IndexError::Unavailable(
                    "the partition map changed while asking the actives how far they are; try again".into(),
                ));
            }
            at.into_iter()
                .enumerate()
                .map(|(p, a)| {
                    a.ok_or_else(|| IndexError::Unavailable(format!("partition {p}'s active did not say how far it is; try again")))
                })
                .collect()
        })
    }

    /// Every collection has the map's partitions, so `_coll` does not change the answer.
    fn all_here(&self, _coll: &Collection) -> Option<bool> {
        let node = self.node().ok()?;
        let state = node.state();
        // No map yet: this node cannot tell (without one, `actives_here_in` says all here).
        state.map.as_ref()?;
        Some(crate::routing::actives_here_in(node.id, &state).is_none())
    }
}

/// One feed call to the active `to`: this node's own partitions are read here, others' over
/// the network. `None` when it did not answer (its partitions are asked again next round).
async fn feed_call(node: &Arc<ClusterNode>, to: NodeId, address: &str, req: FeedRequest, wait: Duration) -> Option<FeedAnswer> {
    let answer = if to == node.id {
        serve_feed(node, req).await
    } else {
        match node.peers.call(address, Op::Feed, wire::encode(&req), FEED_TIMEOUT + wait).await {
            Ok(bytes) => wire::decode::<FeedAnswer>(&bytes).map_err(ClusterError::Refused),
            Err(e) => Err(ClusterError::from(e)),
        }
    };
    answer.map_err(|e| tracing::debug!(%address, error = %e, "index feed: an active did not answer")).ok()
}
