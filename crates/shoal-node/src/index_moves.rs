//! Index partitions moved by a rebalance (issue 41; seed 000): the leader places every
//! index's partitions on the index nodes that stay ([`shoal_cluster::index_placement`]),
//! and each copy to build is adopted by its new node as the files of a live copy — a
//! snapshot of the part's keyspace, with the positions it is consistent at, caught up from
//! the change streams — or, when no copy is alive, rebuilt from the streams. Once every new
//! copy holds what the actives held when it was asked, the new placement is committed at
//! once; scans follow it, and nodes drop the copies it no longer names after a short drain
//! (scans routed by the old placement finish first). Until then scans read the old copies:
//! nothing is served half-built.
//!
//! - [`move_indexes`]: the leader's side, one stage of the rebalance.
//! - `Op::IndexPrepare` ([`serve_prepare`]): before the adoptions, each new node makes the
//!   keyspaces of all the copies it is to build as one group (one fsynced record of them
//!   all, where each adoption would write its own behind the others').
//! - `Op::IndexAdopt` ([`serve_adopt`]): the new copy's node builds it and waits until it
//!   caught up.
//! - `Op::IndexExport` ([`serve_index_export`]): a holder sends the part's files in the
//!   copy stream's framing (`shoal_storage::copy_stream`), as a partition's copy is sent.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use shoal_cluster::index_placement::{index_moves, index_sources, place_indexes, IndexPart, IndexPlacement, IndexSpec};
use shoal_cluster::NodeId;
use shoal_meta::{IndexPlacementChange, MemberState, MetaCommand, MetaState};
use shoal_storage::copy_stream::{CopyHeader, FrameDecoder};
use shoal_storage::{ExportHeader, PartitionError};
use tokio::sync::mpsc;
use tracing::Instrument;

use crate::copy::{background, next_chunk, read_header, send_export, CopyMethod, Outgoing, Records, COPY_IDLE_TIMEOUT};
use crate::node::ClusterNode;
use crate::peers::Op;
use crate::rebalance::{MoveKind, MoveState, MoveStatus};
use crate::ClusterError;

/// How long a new index copy may take to be built and catch up (the adopt call's bound).
pub const INDEX_ADOPT_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a node asked to build a copy waits for the index's definition to be applied
/// here (a node that joined lately).
const INDEX_DEFINITION_WAIT: Duration = Duration::from_secs(30);
/// How long a node asked to make the keyspaces of the copies it is to build may take (the
/// prepare call's bound): the metadata log applied as far as the rebalance's start, then
/// one group of keyspaces.
const INDEX_PREPARE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a node keeps an index copy the placement no longer names before dropping it:
/// scans routed by the placement before finish on it.
pub const INDEX_DRAIN_WAIT: Duration = Duration::from_secs(2);

/// Counter of index partitions a node found placed on it and missing outside a rebalance,
/// and rebuilt from the change streams (a lost build; never a rebalance's move).
pub const PLACED_MISSING_REBUILDS_METRIC: &str = "shoal_index_partitions_rebuilt_total";

/// A holder's export of one index partition.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct IndexExportRequest {
    pub collection: String,
    pub index: String,
    pub part: u16,
}

/// The leader asks a node to build a copy of an index partition.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AdoptRequest {
    pub collection: String,
    pub index: String,
    pub part: u16,
    /// A live copy's node address: the files come from there. `None`: rebuilt from the
    /// change streams.
    pub source: Option<String>,
    /// How far the leader had applied the metadata log when it asked (the rebalance's start
    /// included): the node applies that far before it takes the copy, so that every state
    /// it reconciles its copies with afterwards keeps the copy until the rebalance ends. A
    /// node lagging in the log would otherwise reconcile an older state after it adopted
    /// (the end of the rebalance before, say) and drop the copy after its drain: found by
    /// `shoal_cluster::index_sim` (`adopt_after_begin`).
    #[serde(default)]
    pub applied: u64,
}

/// The leader asks a node to make, as one group, the keyspaces of the copies of `collection`'s
/// index partitions it is about to build (`Op::IndexPrepare`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PrepareRequest {
    pub collection: String,
    /// (index name, partition) of each copy.
    pub parts: Vec<(String, u16)>,
    /// As [`AdoptRequest::applied`]: the node applies the log that far first, so that it
    /// knows the indexes.
    pub applied: u64,
}

/// What a node answers `Op::IndexPrepare`: how many keyspaces it made or found.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PrepareAnswer {
    pub keyspaces: usize,
}

/// How a copy was built.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AdoptAnswer {
    pub method: CopyMethod,
    /// Bytes of the copy adopted: its files and memtable items (0 for a rebuild).
    pub bytes: u64,
    /// The copy was here already (a resumed rebalance).
    pub held_already: bool,
}

/// A holder's side of `Op::IndexExport`: the part's files, as the chunks of a copy stream
/// whose header carries their manifest (its partition field is the index partition; the
/// positions are in the files).
pub(crate) fn serve_index_export(
    node: &Arc<ClusterNode>,
    body: &[u8],
) -> Result<mpsc::Receiver<Result<Outgoing, ClusterError>>, ClusterError> {
    let req: IndexExportRequest = serde_json::from_slice(body).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
    let coll = node
        .engine
        .store()
        .collection(&req.collection)
        .ok_or_else(|| ClusterError::Refused(format!("no collection {}", req.collection)))?;
    let (tx, rx) = mpsc::channel(8);
    let node = Arc::clone(node);
    background("shoal-index-export", move || {
        let files = match node.engine.indexes().export_part(&coll, &req.index, req.part) {
            Ok(files) => files,
            Err(e) => {
                let _ = tx.blocking_send(Err(ClusterError::Index(e)));
                return;
            }
        };
        let manifest = files.manifest().clone();
        let header = CopyHeader {
            export: ExportHeader { partition: req.part, collections: Vec::new() },
            bytes_estimate: manifest.file_bytes(),
            files: Some(manifest),
        };
        let mut files = files;
        let pieces = std::iter::from_fn(move || files.next_piece());
        send_export(&node, &tx, &header, Box::new(pieces));
    })?;
    Ok(rx)
}

/// A new copies' node's side of `Op::IndexPrepare`: applies the log as far as the leader
/// had, then makes the copies' keyspaces as one group
/// ([`shoal_index::IndexManager::prepare_parts`]; parts it cannot make are left to their
/// adoption, which says why).
pub(crate) async fn serve_prepare(node: &Arc<ClusterNode>, req: PrepareRequest) -> Result<PrepareAnswer, ClusterError> {
    node.wait_applied(|s| s.applied.0 >= req.applied).await?;
    // The state applied is not yet the engine in step with it: a node that joined lately
    // makes the indexes' definitions as it reconciles. Parts of indexes still unknown here
    // at the bound are left to their adoptions (which wait for their definitions).
    node.wait_reconciled(req.applied, INDEX_DEFINITION_WAIT).await;
    let Some(coll) = node.engine.store().collection(&req.collection) else {
        return Err(ClusterError::Refused(format!("no collection {}", req.collection)));
    };
    let indexes = Arc::clone(node.engine.indexes());
    let keyspaces = crate::node::blocking(move || indexes.prepare_parts(&coll, &req.parts)).await??;
    Ok(PrepareAnswer { keyspaces })
}

/// The new copy's side of `Op::IndexAdopt`: builds the copy (from the source's files, or
/// from the streams), then waits until it holds what the actives hold now.
pub(crate) async fn serve_adopt(node: &Arc<ClusterNode>, req: AdoptRequest) -> Result<AdoptAnswer, ClusterError> {
    let indexes = Arc::clone(node.engine.indexes());
    node.wait_applied(|s| s.applied.0 >= req.applied).await.map_err(|e| match e {
        ClusterError::NoLeader(wait) => {
            ClusterError::Refused(format!("this node did not apply the metadata log as far as the rebalance's start within {wait:?}"))
        }
        other => other,
    })?;
    // A node that joined lately may not have applied the collection's and the index's
    // definitions yet: they are in the log the leader placed the index by, so they come.
    let (coll, held) = definition_within(INDEX_DEFINITION_WAIT, || {
        let Some(coll) = node.engine.store().collection(&req.collection) else { return Known::Nothing };
        match held_here(&indexes, &coll, &req.index, req.part) {
            Some(held) => Known::Index(coll, held),
            None => Known::Collection(coll),
        }
    })
    .await
    .map_err(|()| ClusterError::Refused(format!("no collection {}", req.collection)))?;
    // The files come a few copies at a time (more towards a node that holds no index
    // partition yet); catching up from the streams, after, is not counted: a copy waits
    // for its collection's next rounds, which every copy waiting here shares.
    let asked = Instant::now();
    let transfer = match held {
        Some(false) => Some(transfer_slot(node).await?),
        _ => None,
    };
    let answer = match held {
        None => return Err(ClusterError::Index(shoal_index::IndexError::NotFound(req.index.clone()))),
        Some(true) => AdoptAnswer { method: CopyMethod::Files, bytes: 0, held_already: true },
        // `--copy-by-stream` builds every copy here from the streams (the comparison).
        Some(false) => match req.source.as_ref().filter(|_| !node.copies.stream_only()) {
            Some(source) => match adopt_files(node, source, &req).await {
                Ok(bytes) => AdoptAnswer { method: CopyMethod::Files, bytes, held_already: false },
                Err(e) => {
                    // The files did not come (the source died, a checksum failed): the copy is
                    // built from the streams instead, as a partition's copy falls back.
                    tracing::warn!(index = %req.index, part = req.part, error = %e, "index partition copy by files failed; rebuilding it");
                    rebuild(node, &req).await?;
                    AdoptAnswer { method: CopyMethod::Stream, bytes: 0, held_already: false }
                }
            },
            None => {
                rebuild(node, &req).await?;
                AdoptAnswer { method: CopyMethod::Stream, bytes: 0, held_already: false }
            }
        },
    };
    drop(transfer);
    let delay = node.faults.adopt_delay();
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let copied = Instant::now();
    // Caught up with the actives' positions now.
    let parts = [req.part];
    caught_up_within(INDEX_ADOPT_TIMEOUT, |left| {
        let (indexes, coll, req, parts) = (&indexes, &coll, &req, &parts);
        async move {
            let waited = indexes.wait_parts(coll, &req.index, parts, left).await;
            adopt_wait_outcome(waited, || held_here(indexes, coll, &req.index, req.part), &req.index, req.part)
        }
    })
    .instrument(tracing::debug_span!("index_adopt", index = %req.index, part = req.part))
    .await?;
    tracing::debug!(
        index = %req.index,
        part = req.part,
        copy_ms = copied.duration_since(asked).as_millis() as u64,
        catch_up_ms = copied.elapsed().as_millis() as u64,
        bytes = answer.bytes,
        "index partition adopted"
    );
    Ok(answer)
}

/// What an adopted copy's wait to catch up answers, given whether the copy is still
/// `held` here (asked only when the wait ended `Unavailable`): a copy dropped here while it
/// caught up (a stopped rebalance's copies are) failed its adoption, `NotFound`, and is not
/// asked about again (`caught_up_within` retries `Unavailable`); any other answer is the
/// wait's.
fn adopt_wait_outcome(
    waited: Result<(), shoal_index::IndexError>,
    held: impl FnOnce() -> Option<bool>,
    index: &str,
    part: u16,
) -> Result<(), shoal_index::IndexError> {
    match waited {
        Err(shoal_index::IndexError::Unavailable(_)) if held() != Some(true) => {
            Err(shoal_index::IndexError::NotFound(format!("{index} partition {part} (dropped here while it caught up)")))
        }
        other => other,
    }
}

/// Whether this node holds part `part` of index `name` of `coll`; `None` when it does not
/// know the index.
fn held_here(indexes: &shoal_index::IndexManager, coll: &shoal_storage::Collection, name: &str, part: u16) -> Option<bool> {
    indexes.list(coll).into_iter().find(|s| s.def.name == name).map(|s| s.part_items.iter().any(|(no, _)| *no == part))
}

/// What a node asked to adopt a copy knows of its index: nothing, its collection, or the
/// index too (and whether it holds the copy already).
enum Known<C> {
    Nothing,
    Collection(C),
    Index(C, bool),
}

/// How often a node asked to adopt a copy looks again for the index's definition.
const DEFINITION_POLL: Duration = Duration::from_millis(50);

/// Waits, within `wait`, until `look` finds the index: its collection and whether the copy
/// is held here already. At the bound: the collection alone (`None`: the index is not
/// known here; the caller refuses) or `Err` (not even the collection).
async fn definition_within<C>(wait: Duration, look: impl Fn() -> Known<C>) -> Result<(C, Option<bool>), ()> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let over = tokio::time::Instant::now() >= deadline;
        match look() {
            Known::Index(coll, held) => return Ok((coll, Some(held))),
            Known::Collection(coll) if over => return Ok((coll, None)),
            Known::Nothing if over => return Err(()),
            _ => tokio::time::sleep(DEFINITION_POLL).await,
        }
    }
}

/// How soon an adopted copy asks again how far the actives are, when they could not all say.
const INDEX_ADOPT_RETRY: Duration = Duration::from_millis(200);

/// Waits, within `timeout`, until `wait` (given the time left) says a copy caught up with
/// the actives. While a partition is frozen for a hand-over (or its active is out of reach)
/// the actives cannot all say how far they are (`Unavailable`): asked again after
/// [`INDEX_ADOPT_RETRY`] while time is left; any other answer is the copy's. The adoption's
/// bound ([`INDEX_ADOPT_TIMEOUT`]) holds however often the actives cannot say.
async fn caught_up_within<F, Fut>(timeout: Duration, mut wait: F) -> Result<(), shoal_index::IndexError>
where
    F: FnMut(Duration) -> Fut,
    Fut: std::future::Future<Output = Result<(), shoal_index::IndexError>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match wait(left).await {
            Err(shoal_index::IndexError::Unavailable(why)) if tokio::time::Instant::now() + INDEX_ADOPT_RETRY < deadline => {
                tracing::debug!(%why, "an adopted index partition waits for the actives");
                tokio::time::sleep(INDEX_ADOPT_RETRY).await;
            }
            other => return other,
        }
    }
}

/// Permits of [`TRANSFERS`]: the whole of them is [`shoal_meta::state::REBALANCE_MOVES_PER_NODE_MAX`]
/// copies at once.
const TRANSFER_PERMITS: u32 = shoal_meta::state::REBALANCE_MOVES_PER_NODE_MAX;
/// The index partition copies whose files this node takes in at once.
static TRANSFERS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(TRANSFER_PERMITS as usize);

/// One copy's turn to take in its files: [`copy::copy_slots`](crate::copy::copy_slots)
/// copies at once by the cluster's `rebalance_moves_per_node` (more while this node holds
/// no index partition), each taking its share of [`TRANSFER_PERMITS`].
async fn transfer_slot(node: &ClusterNode) -> Result<tokio::sync::SemaphorePermit<'static>, ClusterError> {
    let state = node.state();
    let holds_none = state.indexes.values().flat_map(|b| b.values()).all(|d| d.parts_on(node.id).is_empty());
    let slots = crate::copy::copy_slots(state.settings.rebalance_moves_per_node, holds_none);
    TRANSFERS.acquire_many(transfer_share(slots)).await.map_err(|_| ClusterError::Refused("index copies stopped".into()))
}

/// The permits of [`TRANSFER_PERMITS`] one copy takes when `slots` copies may run at once:
/// at least one, so that no more than `slots` (and never more than the permits) run at once.
fn transfer_share(slots: usize) -> u32 {
    (TRANSFER_PERMITS / u32::try_from(slots).unwrap_or(u32::MAX).max(1)).max(1)
}

async fn rebuild(node: &Arc<ClusterNode>, req: &AdoptRequest) -> Result<(), ClusterError> {
    let coll = node
        .engine
        .store()
        .collection(&req.collection)
        .ok_or_else(|| ClusterError::Refused(format!("no collection {}", req.collection)))?;
    let (indexes, name, part) = (Arc::clone(node.engine.indexes()), req.index.clone(), req.part);
    crate::node::blocking(move || indexes.add_part(&coll, &name, part)).await??;
    Ok(())
}

/// Streams the part's files from `source` into this node's index database.
async fn adopt_files(node: &Arc<ClusterNode>, source: &str, req: &AdoptRequest) -> Result<u64, ClusterError> {
    let coll = node
        .engine
        .store()
        .collection(&req.collection)
        .ok_or_else(|| ClusterError::Refused(format!("no collection {}", req.collection)))?;
    let ask = IndexExportRequest { collection: req.collection.clone(), index: req.index.clone(), part: req.part };
    let body = serde_json::to_vec(&ask).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
    let mut stream = node.peers.stream(source, Op::IndexExport, body, COPY_IDLE_TIMEOUT).await?;
    let mut decoder = FrameDecoder::default();
    let header = read_header(&mut stream, &mut decoder, |_| {}).await?;
    let manifest = header.files.ok_or_else(|| ClusterError::BadMessage("an index copy without its files' manifest".into()))?;
    if header.export.partition != req.part {
        return Err(ClusterError::BadMessage(format!("asked for index partition {}, got {}", req.part, header.export.partition)));
    }
    let (tx, rx) = mpsc::channel::<Result<bytes::Bytes, PartitionError>>(8);
    let (indexes, name, part) = (Arc::clone(node.engine.indexes()), req.index.clone(), req.part);
    let import = background("shoal-index-import", move || indexes.import_part(&coll, &name, part, &manifest, Records::new(rx, decoder)))?;
    let pumped = async {
        while let Some(chunk) = next_chunk(&mut stream).await? {
            if tx.send(Ok(chunk)).await.is_err() {
                break; // the import stopped: its error says why
            }
        }
        Ok::<(), ClusterError>(())
    }
    .await;
    if let Err(e) = &pumped {
        // The import must not finish on a part of the copy.
        let _ = tx.send(Err(PartitionError::Malformed(e.to_string()))).await;
    }
    drop(tx);
    let imported = import.await.map_err(|_| ClusterError::Storage("the index import thread died".into()))?;
    pumped?;
    Ok(imported?.bytes)
}

/// A node's prepare call, awaited by each of its adopt calls (and run once).
type Prepared = futures::future::Shared<futures::future::BoxFuture<'static, ()>>;

/// Asks each node that is to build copies to make their keyspaces first, as one group per
/// collection (`Op::IndexPrepare`): one call per node, which that node's adopt calls await
/// (a node slow to answer holds up only its own). Its own work only: a node that could not
/// (unreachable, an old version) makes each keyspace as it adopts the copy, so a failure
/// here is logged and the adoptions go on.
fn prepare_receivers(
    node: &Arc<ClusterNode>,
    state: &MetaState,
    moves: &[SourcedCopy],
    names: &BTreeMap<u64, (String, String)>,
) -> BTreeMap<NodeId, Prepared> {
    use futures::FutureExt;
    // Per node, per collection: (index name, partition) of each copy.
    type Asks<'a> = BTreeMap<NodeId, BTreeMap<&'a str, Vec<(String, u16)>>>;
    let mut asks: Asks = BTreeMap::new();
    for ((part, to), _) in moves {
        if let Some((collection, index)) = names.get(&part.index) {
            asks.entry(*to).or_default().entry(collection.as_str()).or_default().push((index.clone(), part.partition));
        }
    }
    let mut prepared = BTreeMap::new();
    for (to, by_collection) in asks {
        let Some(address) = state.members.get(&to).map(|m| m.address.clone()) else { continue };
        let reqs: Vec<PrepareRequest> = by_collection
            .into_iter()
            .map(|(collection, parts)| PrepareRequest { collection: collection.to_string(), parts, applied: state.applied.0 })
            .collect();
        let node = Arc::clone(node);
        let call = async move {
            for req in reqs {
                let asked = async {
                    let body = serde_json::to_vec(&req).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
                    node.peers.call(&address, Op::IndexPrepare, body, INDEX_PREPARE_TIMEOUT).await?;
                    Ok::<(), ClusterError>(())
                };
                if let Err(e) = asked.await {
                    tracing::warn!(node = to.0, error = %e, "a node could not make its index copies' keyspaces ahead; it makes each as it adopts it");
                }
            }
        };
        prepared.insert(to, call.boxed().shared());
    }
    prepared
}

/// The index nodes a rebalance ejecting `eject` leaves: active members running the index
/// service.
fn staying_index_nodes(state: &MetaState, eject: &[NodeId]) -> Vec<NodeId> {
    state.index_service_nodes().into_iter().filter(|n| !eject.contains(n)).collect()
}

/// A copy to build, with the node its files come from (`None`: rebuilt from the streams).
pub(crate) type SourcedCopy = ((IndexPart, NodeId), Option<NodeId>);

/// What a rebalance does to the indexes: every index's placement after it (on the index
/// nodes that stay), and the copies to build, each with where it comes from. Indexes not
/// placed yet (made before any index node) are placed and built. Pure.
/// `down` are members the leader sees down: no copy is taken from them.
pub(crate) fn plan_index_moves(
    state: &MetaState,
    eject: &[NodeId],
    down: &BTreeSet<NodeId>,
) -> Result<(IndexPlacement, Vec<SourcedCopy>), ClusterError> {
    let nodes: Vec<shoal_cluster::Node> =
        staying_index_nodes(state, eject).into_iter().map(|id| shoal_cluster::Node { id, weight: 1 }).collect();
    let defs: Vec<&shoal_meta::IndexDef> = state.indexes.values().flat_map(|by_name| by_name.values()).collect();
    if nodes.is_empty() {
        return match defs.iter().any(|d| d.is_placed()) {
            true => Err(ClusterError::Refused("no node running the index service would be left to hold the indexes".into())),
            false => Ok((IndexPlacement::new(), Vec::new())),
        };
    }
    let mut specs = Vec::with_capacity(defs.len());
    let mut previous = IndexPlacement::new();
    for def in &defs {
        let spec = shoal_meta::state::index_spec_of(def).map_err(ClusterError::Rejected)?;
        specs.push(IndexSpec { index: u64::from(def.id), ..spec });
        previous.extend(shoal_meta::state::placement_units(def));
    }
    let target = place_indexes(&specs, &nodes, &previous).map_err(|e| ClusterError::Refused(format!("cannot place the indexes: {e}")))?;
    let (build, _) = index_moves(&previous, &target);
    let alive: BTreeSet<NodeId> = state
        .members
        .iter()
        .filter(|(id, m)| matches!(m.state, MemberState::Active | MemberState::Leaving) && !down.contains(id))
        .map(|(id, _)| *id)
        .collect();
    Ok((target, index_sources(&previous, &build, &alive)))
}

/// The rebalance's index stage (leader; it runs beside the data partitions' stages): builds
/// every new copy (as many at once per node as its copy slots, more towards a node that held
/// none), then commits the placement. Answers the moves as the rebalance's status shows them.
pub(crate) async fn move_indexes(node: &Arc<ClusterNode>, eject: &[NodeId]) -> Result<Vec<MoveStatus>, ClusterError> {
    let state = node.state();
    // The adopt calls carry `state.applied`: their nodes apply as far, the start included.
    debug_assert!(state.rebalance.is_some(), "the index stage runs within a rebalance whose start is applied");
    let down: BTreeSet<NodeId> =
        node.member_health().unwrap_or_default().into_iter().filter(|(_, up)| !up).map(|(id, _)| NodeId(id)).collect();
    let (target, moves) = plan_index_moves(&state, eject, &down)?;
    if target.is_empty() {
        return Ok(Vec::new());
    }
    let names: BTreeMap<u64, (String, String)> = state
        .indexes
        .values()
        .flat_map(|by_name| by_name.values())
        .map(|d| (u64::from(d.id), (d.collection.clone(), d.name.clone())))
        .collect();
    let address = |n: &NodeId| state.members.get(n).map(|m| m.address.clone());
    // The receivers take in the files a few at a time (`transfer_slot`); the calls wait for
    // their copies to catch up together, up to the most moves one node may run.
    let slots: BTreeMap<NodeId, Arc<tokio::sync::Semaphore>> =
        moves.iter().map(|((_, to), _)| (*to, Arc::new(tokio::sync::Semaphore::new(TRANSFER_PERMITS as usize)))).collect();
    let prepared = prepare_receivers(node, &state, &moves, &names);
    let started = Instant::now();
    let mut statuses: Vec<MoveStatus> = Vec::with_capacity(moves.len());
    let mut calls = Vec::with_capacity(moves.len());
    for ((part, to), source) in &moves {
        let (collection, index) = names.get(&part.index).cloned().ok_or_else(|| ClusterError::Refused("an index went away".into()))?;
        let to_address = address(to).ok_or(ClusterError::NodeNotFound(*to))?;
        let req = AdoptRequest {
            collection,
            index: index.clone(),
            part: part.partition,
            source: source.as_ref().and_then(address),
            applied: state.applied.0,
        };
        statuses.push(MoveStatus {
            kind: MoveKind::Index,
            id: part.partition,
            index: Some(format!("{}.{}", req.collection, index)),
            from: *source,
            to: *to,
            method: if source.is_some() { CopyMethod::Files } else { CopyMethod::Stream },
            shipped: None,
            state: MoveState::Building,
            bytes_total: 0,
            bytes_done: 0,
            bytes_planned: 0,
            copy_started_unix_ms: None,
            copy_finished_unix_ms: None,
            analytics_rows: None,
        });
        let slot = Arc::clone(&slots[to]);
        let prepare = prepared.get(to).cloned();
        let node = Arc::clone(node);
        calls.push(async move {
            if let Some(prepare) = prepare {
                prepare.await;
            }
            let _slot = slot.acquire_owned().await.map_err(|_| ClusterError::Refused("index moves stopped".into()))?;
            let body = serde_json::to_vec(&req).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
            let answer = node.peers.call(&to_address, Op::IndexAdopt, body, INDEX_ADOPT_TIMEOUT).await?;
            serde_json::from_slice::<AdoptAnswer>(&answer).map_err(|e| ClusterError::BadMessage(e.to_string()))
        });
    }
    node.rebalancer.add_moves(&statuses);
    let answers = futures::future::join_all(calls).await;
    let mut rebuilt = 0usize;
    for (status, answer) in statuses.iter_mut().zip(answers) {
        let answer = answer?;
        status.method = answer.method;
        status.bytes_total = answer.bytes;
        status.bytes_done = answer.bytes;
        status.state = MoveState::Done;
        rebuilt += usize::from(answer.method == CopyMethod::Stream);
    }
    node.rebalancer.update_moves(&statuses);
    // Every new copy holds what the actives held when it was asked: the placement moves.
    let mut changes = Vec::new();
    for def in state.indexes.values().flat_map(|by_name| by_name.values()) {
        let placement: Vec<Vec<NodeId>> = target
            .range(IndexPart { index: u64::from(def.id), partition: 0 }..=IndexPart { index: u64::from(def.id), partition: u16::MAX })
            .map(|(_, c)| c.clone())
            .collect();
        if placement != def.placement {
            // Over the placement the plan started from: a failover since took a failed
            // node's copies out of it, which this target (planned before) would name again;
            // then the stage fails and a new rebalance plans from the repaired placement.
            changes.push(IndexPlacementChange {
                collection: def.collection.clone(),
                name: def.name.clone(),
                id: def.id,
                placement,
                from: Some(def.placement.clone()),
            });
        }
    }
    if !changes.is_empty() {
        node.propose(MetaCommand::SetIndexPlacements { placements: changes }).await?;
    }
    tracing::info!(moves = statuses.len(), rebuilt, secs = started.elapsed().as_secs_f64(), "index partitions placed");
    Ok(statuses)
}

#[cfg(test)]
mod tests {
    use super::{
        adopt_wait_outcome, caught_up_within, definition_within, transfer_share, Known, INDEX_ADOPT_RETRY, INDEX_ADOPT_TIMEOUT,
        INDEX_DEFINITION_WAIT, TRANSFER_PERMITS,
    };
    use shoal_index::IndexError;
    use std::cell::Cell;
    use std::time::Duration;
    use tokio::time::Instant;

    /// A node that joined lately is asked to adopt a copy before it applied the index's
    /// definition: it waits for it at most `INDEX_DEFINITION_WAIT`, then refuses (no
    /// collection) or answers that it does not know the index. Under tokio's paused clock.
    #[tokio::test(start_paused = true)]
    async fn a_copy_asked_before_its_definition_came_waits_for_it_within_the_definition_wait() {
        let start = Instant::now();
        // (seconds after which the collection, then the index, is known here; what comes back)
        type Found = Result<(u8, Option<bool>), ()>;
        let table: [(Option<u64>, Option<u64>, Found, Duration); 4] = [
            (Some(0), Some(0), Ok((1, Some(false))), Duration::ZERO),
            // The definitions come within the wait: adopted as soon as they are here.
            (Some(3), Some(12), Ok((1, Some(false))), Duration::from_secs(12)),
            // Never: at the bound, the collection alone, or nothing.
            (Some(1), None, Ok((1, None)), INDEX_DEFINITION_WAIT),
            (None, None, Err(()), INDEX_DEFINITION_WAIT),
        ];
        for (coll_at, index_at, want, took) in table {
            let start_row = Instant::now();
            let known = |at: Option<u64>| at.is_some_and(|s| start_row.elapsed() >= Duration::from_secs(s));
            let got = definition_within(INDEX_DEFINITION_WAIT, || match (known(coll_at), known(index_at)) {
                (true, true) => Known::Index(1u8, false),
                (true, false) => Known::Collection(1u8),
                _ => Known::Nothing,
            })
            .await;
            assert_eq!(got, want, "{coll_at:?} {index_at:?}");
            let elapsed = start_row.elapsed();
            assert!(elapsed >= took && elapsed < took + Duration::from_millis(100), "{coll_at:?} {index_at:?}: {elapsed:?}");
        }
        assert!(start.elapsed() >= INDEX_DEFINITION_WAIT * 2);
    }

    /// An adopted copy waits for the actives at most `INDEX_ADOPT_TIMEOUT` however often they
    /// cannot say how far they are, retrying every `INDEX_ADOPT_RETRY`; a wait that runs out
    /// on its own or fails otherwise ends it at once. Under tokio's paused clock: the 600 s
    /// bound is reached without waiting for it.
    #[tokio::test(start_paused = true)]
    async fn an_adopted_copy_waits_for_the_actives_within_the_adopt_timeout() {
        let unavailable = || IndexError::Unavailable("partition 3's active did not answer".into());
        // The actives never can say: asked again and again, then their answer at the bound.
        let (start, calls) = (Instant::now(), Cell::new(0u32));
        let got = caught_up_within(INDEX_ADOPT_TIMEOUT, |_| {
            calls.set(calls.get() + 1);
            async { Err(unavailable()) }
        })
        .await;
        let took = start.elapsed();
        assert!(matches!(got, Err(IndexError::Unavailable(_))), "{got:?}");
        assert!(took <= INDEX_ADOPT_TIMEOUT && took + INDEX_ADOPT_RETRY >= INDEX_ADOPT_TIMEOUT, "{took:?}");
        let rounds = (INDEX_ADOPT_TIMEOUT.as_millis() / INDEX_ADOPT_RETRY.as_millis()) as u32;
        assert!((rounds - 1..=rounds).contains(&calls.get()), "{} calls", calls.get());
        // A wait given the time left that runs it out: its timeout, once, at the bound.
        let (start, calls) = (Instant::now(), Cell::new(0u32));
        let got = caught_up_within(INDEX_ADOPT_TIMEOUT, |left| {
            calls.set(calls.get() + 1);
            async move {
                tokio::time::sleep(left).await;
                Err(IndexError::Timeout)
            }
        })
        .await;
        assert!(matches!(got, Err(IndexError::Timeout)), "{got:?}");
        assert_eq!((start.elapsed(), calls.get()), (INDEX_ADOPT_TIMEOUT, 1));
        // Unavailable twice, then caught up: two retries.
        let (start, calls) = (Instant::now(), Cell::new(0u32));
        let got = caught_up_within(INDEX_ADOPT_TIMEOUT, |_| {
            calls.set(calls.get() + 1);
            let n = calls.get();
            async move {
                if n < 3 {
                    Err(unavailable())
                } else {
                    Ok(())
                }
            }
        })
        .await;
        assert!(got.is_ok(), "{got:?}");
        assert_eq!(start.elapsed(), INDEX_ADOPT_RETRY * 2);
        // Any other error is the copy's, at once.
        let start = Instant::now();
        let got = caught_up_within(INDEX_ADOPT_TIMEOUT, |_| async { Err(IndexError::NotFound("by_v".into())) }).await;
        assert!(matches!(got, Err(IndexError::NotFound(_))), "{got:?}");
        assert_eq!(start.elapsed(), Duration::ZERO);
    }

    /// A copy dropped here while it caught up (a stopped rebalance's) ends its adoption at
    /// once as not found, rather than being asked about every `INDEX_ADOPT_RETRY` until the
    /// adopt timeout; a copy still held whose actives cannot say waits on.
    #[tokio::test(start_paused = true)]
    async fn an_adopted_copy_dropped_while_it_catches_up_fails_its_adoption_at_once() {
        let unavailable = || Err(IndexError::Unavailable("index by_v: partition 2 is not held here".into()));
        // (what the wait answered, whether the copy is held here then, what the adoption sees)
        type Row = (Result<(), IndexError>, Option<bool>, &'static str);
        let table: [Row; 6] = [
            (Ok(()), Some(true), "ok"),
            (unavailable(), Some(true), "unavailable"),
            // Dropped here, or its whole index dropped.
            (unavailable(), Some(false), "not found"),
            (unavailable(), None, "not found"),
            (Err(IndexError::Timeout), Some(false), "timeout"),
            (Err(IndexError::NotFound("by_v".into())), Some(true), "not found"),
        ];
        let kind = |r: &Result<(), IndexError>| match r {
            Ok(()) => "ok",
            Err(IndexError::Unavailable(_)) => "unavailable",
            Err(IndexError::NotFound(_)) => "not found",
            Err(IndexError::Timeout) => "timeout",
            Err(_) => "other",
        };
        for (waited, held, want) in table {
            let before = kind(&waited);
            let got = adopt_wait_outcome(waited, || held, "by_v", 2);
            assert_eq!(kind(&got), want, "{before} with the copy held {held:?}");
        }
        // Through the retrying wait: one call, no retry, at once.
        let (start, calls) = (Instant::now(), Cell::new(0u32));
        let got = caught_up_within(INDEX_ADOPT_TIMEOUT, |_| {
            calls.set(calls.get() + 1);
            async { adopt_wait_outcome(unavailable(), || Some(false), "by_v", 2) }
        })
        .await;
        assert!(matches!(&got, Err(IndexError::NotFound(why)) if why.contains("dropped here")), "{got:?}");
        assert_eq!((start.elapsed(), calls.get()), (Duration::ZERO, 1));
    }

    /// Index copies taking in their files at once: as many as the copy slots say, each with
    /// an equal share of the permits, never more than the permits and never none.
    #[test]
    fn copies_at_once_follow_the_slots_within_the_transfer_permits() {
        let at_once = |slots: usize| TRANSFER_PERMITS / transfer_share(slots);
        for (slots, want) in [(0, 1), (1, 1), (2, 2), (8, 8), (TRANSFER_PERMITS as usize, TRANSFER_PERMITS), (10_000, TRANSFER_PERMITS)] {
            assert_eq!(at_once(slots), want, "{slots} slots");
            assert!(transfer_share(slots) >= 1 && transfer_share(slots) <= TRANSFER_PERMITS);
        }
        // The empty node's slots (the most a node may run) fit the permits whole.
        let most = crate::copy::copy_slots(shoal_meta::state::REBALANCE_MOVES_PER_NODE_MAX, true);
        assert_eq!(at_once(most), TRANSFER_PERMITS);
    }
}
