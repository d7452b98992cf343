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
use shoal_storage::copy_stream::CopyHeader;
use shoal_storage::{ExportHeader, PartitionError};
use tokio::sync::mpsc;
use tracing::Instrument;

use crate::copy::{background, next_chunk, send_export, ChainedCopies, CopyMethod, Outgoing, COPY_IDLE_TIMEOUT};
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

/// Most index partitions one adoption (and the export it asks for) carries: a group moves
/// from one source to one new node by one stream, one import batch and one durable catalog
/// write, where each partition would take its own.
pub const INDEX_MOVE_GROUP_PARTS: usize = 16;

/// A holder's export of a group of index partitions of one collection.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct IndexExportRequest {
    pub collection: String,
    /// (index name, partition) of each copy, in the order they are sent.
    pub parts: Vec<(String, u16)>,
}

/// The leader asks a node to build copies of a group of index partitions of one
/// collection, all from one source.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AdoptRequest {
    pub collection: String,
    /// (index name, partition) of each copy.
    pub parts: Vec<(String, u16)>,
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

/// A group's parts, checked: at least one, at most [`INDEX_MOVE_GROUP_PARTS`], each once.
fn checked_group(parts: &[(String, u16)]) -> Result<(), ClusterError> {
    if parts.is_empty() || parts.len() > INDEX_MOVE_GROUP_PARTS {
        return Err(ClusterError::BadMessage(format!(
            "a group of index partitions holds 1 to {INDEX_MOVE_GROUP_PARTS}, not {}",
            parts.len()
        )));
    }
    let distinct: BTreeSet<&(String, u16)> = parts.iter().collect();
    if distinct.len() != parts.len() {
        return Err(ClusterError::BadMessage("an index partition listed twice in one group".into()));
    }
    Ok(())
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

/// A holder's side of `Op::IndexExport`: each part's files, at one snapshot, as copy
/// streams one after another in the order asked (each header carries its files' manifest;
/// its partition field is the index partition; the positions are in the files).
pub(crate) fn serve_index_export(
    node: &Arc<ClusterNode>,
    body: &[u8],
) -> Result<mpsc::Receiver<Result<Outgoing, ClusterError>>, ClusterError> {
    let req: IndexExportRequest = serde_json::from_slice(body).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
    checked_group(&req.parts)?;
    let coll = node
        .engine
        .store()
        .collection(&req.collection)
        .ok_or_else(|| ClusterError::Refused(format!("no collection {}", req.collection)))?;
    let (tx, rx) = mpsc::channel(8);
    let node = Arc::clone(node);
    background("shoal-index-export", move || {
        let exports = match node.engine.indexes().export_parts(&coll, &req.parts) {
            Ok(exports) => exports,
            Err(e) => {
                let _ = tx.blocking_send(Err(ClusterError::Index(e)));
                return;
            }
        };
        for ((_, no), mut files) in req.parts.iter().zip(exports) {
            let manifest = files.manifest().clone();
            let header = CopyHeader {
                export: ExportHeader { partition: *no, collections: Vec::new() },
                bytes_estimate: manifest.file_bytes(),
                files: Some(manifest),
            };
            let pieces = std::iter::from_fn(move || files.next_piece());
            if !send_export(&node, &tx, &header, Box::new(pieces)) {
                return; // the receiver went away, or the export failed (it was told)
            }
        }
    })?;
    Ok(rx)
}

/// A new copies' node's side of `Op::IndexPrepare`: applies the log as far as the leader
/// had, then makes the copies' keyspaces as one group
/// ([`shoal_index::IndexManager::prepare_parts`]; parts it cannot make are left to their
/// adoption, which says why).
pub(crate) async fn serve_prepare(node: &Arc<ClusterNode>, req: PrepareRequest) -> Result<PrepareAnswer, ClusterError> {
    let asked = Instant::now();
    node.wait_applied(|s| s.applied.0 >= req.applied).await?;
    // The state applied is not yet the engine in step with it: a node that joined lately
    // makes the indexes' definitions as it reconciles. Parts of indexes still unknown here
    // at the bound are left to their adoptions (which wait for their definitions).
    node.wait_reconciled(req.applied, INDEX_DEFINITION_WAIT).await;
    let Some(coll) = node.engine.store().collection(&req.collection) else {
        return Err(ClusterError::Refused(format!("no collection {}", req.collection)));
    };
    let indexes = Arc::clone(node.engine.indexes());
    let applied = asked.elapsed();
    let keyspaces = crate::node::blocking(move || indexes.prepare_parts(&coll, &req.parts)).await??;
    tracing::debug!(
        keyspaces,
        applied_ms = applied.as_millis() as u64,
        ms = asked.elapsed().as_millis() as u64,
        "index copies' keyspaces made ahead"
    );
    Ok(PrepareAnswer { keyspaces })
}

/// The new copies' side of `Op::IndexAdopt`: builds the group's copies (from the source's
/// files as one group, or from the streams), then waits until they hold what the actives
/// hold now. Answers each part's adoption, in the order asked.
pub(crate) async fn serve_adopt(node: &Arc<ClusterNode>, req: AdoptRequest) -> Result<Vec<AdoptAnswer>, ClusterError> {
    checked_group(&req.parts)?;
    let indexes = Arc::clone(node.engine.indexes());
    node.wait_applied(|s| s.applied.0 >= req.applied).await.map_err(|e| match e {
        ClusterError::NoLeader(wait) => {
            ClusterError::Refused(format!("this node did not apply the metadata log as far as the rebalance's start within {wait:?}"))
        }
        other => other,
    })?;
    // A node that joined lately may not have applied the collection's and the indexes'
    // definitions yet: they are in the log the leader placed the indexes by, so they come.
    let mut coll = None;
    let mut answers: Vec<Option<AdoptAnswer>> = Vec::with_capacity(req.parts.len());
    for (name, part) in &req.parts {
        let (c, held) = definition_within(INDEX_DEFINITION_WAIT, || {
            let Some(coll) = node.engine.store().collection(&req.collection) else { return Known::Nothing };
            match held_all(&indexes, &coll, name, &[*part]) {
                Some(held) => Known::Index(coll, held),
                None => Known::Collection(coll),
            }
        })
        .await
        .map_err(|()| ClusterError::Refused(format!("no collection {}", req.collection)))?;
        match held {
            None => return Err(ClusterError::Index(shoal_index::IndexError::NotFound(name.clone()))),
            Some(true) => answers.push(Some(AdoptAnswer { method: CopyMethod::Files, bytes: 0, held_already: true })),
            Some(false) => answers.push(None),
        }
        coll = Some(c);
    }
    let Some(coll) = coll else { return Err(ClusterError::BadMessage("an adoption of no index partition".into())) };
    let missing: Vec<(String, u16)> = req.parts.iter().zip(&answers).filter(|(_, a)| a.is_none()).map(|(p, _)| p.clone()).collect();
    // The files come a few groups at a time (more towards a node that holds no index
    // partition yet); catching up from the streams, after, is not counted: a copy waits
    // for its collection's next rounds, which every copy waiting here shares.
    let asked = Instant::now();
    if !missing.is_empty() {
        let transfer = transfer_slot(node).await?;
        let built = build_copies(node, &req, &missing).await?;
        drop(transfer);
        let mut built = built.into_iter();
        for answer in answers.iter_mut().filter(|a| a.is_none()) {
            *answer = built.next();
        }
    }
    let delay = node.faults.adopt_delay();
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let copied = Instant::now();
    // Caught up with the actives' positions now: each index's parts of the group together.
    let mut by_index: BTreeMap<&str, Vec<u16>> = BTreeMap::new();
    for (name, part) in &req.parts {
        by_index.entry(name.as_str()).or_default().push(*part);
    }
    let waits = by_index.into_iter().map(|(name, parts)| {
        let (indexes, coll) = (&indexes, &coll);
        async move {
            caught_up_within(INDEX_ADOPT_TIMEOUT, |left| {
                let parts = &parts;
                async move {
                    let waited = indexes.wait_parts(coll, name, parts, left).await;
                    adopt_wait_outcome(waited, || held_all(indexes, coll, name, parts), name, parts)
                }
            })
            .instrument(tracing::debug_span!("index_adopt", index = %name, parts = ?parts))
            .await
        }
    });
    futures::future::try_join_all(waits).await?;
    tracing::debug!(
        parts = req.parts.len(),
        copy_ms = copied.duration_since(asked).as_millis() as u64,
        catch_up_ms = copied.elapsed().as_millis() as u64,
        "index partitions adopted"
    );
    answers.into_iter().map(|a| a.ok_or_else(|| ClusterError::Storage("an index partition's adoption left no answer".into()))).collect()
}

/// Builds the copies of `missing` (parts of `req`'s group not held here): from the
/// source's files as one group; when that fails (the source died, a checksum failed), each
/// on its own by files, and failing that from the streams, as a partition's copy falls
/// back. `--copy-by-stream` builds every copy from the streams (the comparison). Answers
/// each part's adoption, in order.
async fn build_copies(node: &Arc<ClusterNode>, req: &AdoptRequest, missing: &[(String, u16)]) -> Result<Vec<AdoptAnswer>, ClusterError> {
    let files = |bytes| AdoptAnswer { method: CopyMethod::Files, bytes, held_already: false };
    let stream = AdoptAnswer { method: CopyMethod::Stream, bytes: 0, held_already: false };
    let Some(source) = req.source.as_ref().filter(|_| !node.copies.stream_only()) else {
        let mut answers = Vec::with_capacity(missing.len());
        for (name, part) in missing {
            rebuild(node, &req.collection, name, *part).await?;
            answers.push(stream.clone());
        }
        return Ok(answers);
    };
    let group_error = match adopt_files(node, source, &req.collection, missing).await {
        Ok(bytes) => return Ok(bytes.into_iter().map(files).collect()),
        Err(e) => e,
    };
    tracing::warn!(parts = missing.len(), error = %group_error, "index partitions' copy by files as a group failed; copying each on its own");
    let mut answers = Vec::with_capacity(missing.len());
    for one in missing {
        let (name, part) = one;
        let coll = node.engine.store().collection(&req.collection);
        if coll.is_some_and(|c| held_all(node.engine.indexes(), &c, name, &[*part]) == Some(true)) {
            answers.push(files(0)); // the group's import held it before it failed
            continue;
        }
        let single = match retry_each_by_files(&group_error, missing.len()) {
            false => None,
            true => Some(adopt_files(node, source, &req.collection, std::slice::from_ref(one)).await),
        };
        match single {
            Some(Ok(bytes)) => answers.push(files(bytes.first().copied().unwrap_or(0))),
            failed => {
                let why = match failed {
                    Some(Err(e)) => e.to_string(),
                    _ => group_error.to_string(),
                };
                tracing::warn!(index = %name, part, error = %why, "index partition copy by files failed; rebuilding it");
                rebuild(node, &req.collection, name, *part).await?;
                answers.push(stream.clone());
            }
        }
    }
    Ok(answers)
}

/// Whether the parts of a group whose copy by files failed with `error` are each tried again
/// by files before a rebuild: only when the source answered (a part it refused to send, a
/// copy that did not check out), and the group was more than one. A source out of reach or
/// silent would make each part wait for it again, one after another.
fn retry_each_by_files(error: &ClusterError, parts: usize) -> bool {
    parts > 1 && !matches!(error, ClusterError::Peer(crate::peers::PeerError::Unreachable { .. }) | ClusterError::Timeout(_))
}

/// What an adopted group's wait to catch up answers, given whether its copies are all still
/// `held` here (asked only when the wait ended `Unavailable`): a copy dropped here while it
/// caught up (a stopped rebalance's copies are) failed its adoption, `NotFound`, and is not
/// asked about again (`caught_up_within` retries `Unavailable`); any other answer is the
/// wait's.
fn adopt_wait_outcome(
    waited: Result<(), shoal_index::IndexError>,
    held: impl FnOnce() -> Option<bool>,
    index: &str,
    parts: &[u16],
) -> Result<(), shoal_index::IndexError> {
    match waited {
        Err(shoal_index::IndexError::Unavailable(_)) if held() != Some(true) => {
            Err(shoal_index::IndexError::NotFound(format!("{index} partitions {parts:?} (dropped here while they caught up)")))
        }
        other => other,
    }
}

/// Whether this node holds every one of parts `parts` of index `name` of `coll`; `None` when
/// it does not know the index.
fn held_all(indexes: &shoal_index::IndexManager, coll: &shoal_storage::Collection, name: &str, parts: &[u16]) -> Option<bool> {
    indexes
        .list(coll)
        .into_iter()
        .find(|s| s.def.name == name)
        .map(|s| parts.iter().all(|no| s.part_items.iter().any(|(held, _)| held == no)))
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

async fn rebuild(node: &Arc<ClusterNode>, collection: &str, name: &str, part: u16) -> Result<(), ClusterError> {
    let coll = node.engine.store().collection(collection).ok_or_else(|| ClusterError::Refused(format!("no collection {collection}")))?;
    let (indexes, name) = (Arc::clone(node.engine.indexes()), name.to_string());
    crate::node::blocking(move || indexes.add_part(&coll, &name, part)).await??;
    Ok(())
}

/// Streams the files of parts `parts` of `collection`'s indexes from `source` into this
/// node's index database, as one group ([`shoal_index::PartImports`]): held here all, or
/// none. Answers each part's bytes, in order.
async fn adopt_files(node: &Arc<ClusterNode>, source: &str, collection: &str, parts: &[(String, u16)]) -> Result<Vec<u64>, ClusterError> {
    let coll = node.engine.store().collection(collection).ok_or_else(|| ClusterError::Refused(format!("no collection {collection}")))?;
    let ask = IndexExportRequest { collection: collection.to_string(), parts: parts.to_vec() };
    let body = serde_json::to_vec(&ask).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
    let mut stream = node.peers.stream(source, Op::IndexExport, body, COPY_IDLE_TIMEOUT).await?;
    let (tx, rx) = mpsc::channel::<Result<bytes::Bytes, PartitionError>>(8);
    let (indexes, parts) = (Arc::clone(node.engine.indexes()), parts.to_vec());
    let import = background("shoal-index-import", move || import_group(&indexes, &coll, &parts, ChainedCopies::new(rx)))?;
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
        // The import must not finish on a part of the copies.
        let _ = tx.send(Err(PartitionError::Malformed(e.to_string()))).await;
    }
    drop(tx);
    let imported = import.await.map_err(|_| ClusterError::Storage("the index import thread died".into()))?;
    pumped?;
    imported
}

/// The import side of [`adopt_files`] (blocking): each copy of the stream into its part, in
/// the order asked, then the group committed once the stream ended whole.
fn import_group(
    indexes: &shoal_index::IndexManager,
    coll: &shoal_storage::Collection,
    parts: &[(String, u16)],
    mut copies: ChainedCopies,
) -> Result<Vec<u64>, ClusterError> {
    let mut group = indexes.import_parts(coll);
    let mut bytes = Vec::with_capacity(parts.len());
    for (name, no) in parts {
        let header = copies.header()?;
        let manifest = header.files.ok_or_else(|| ClusterError::BadMessage("an index copy without its files' manifest".into()))?;
        if header.export.partition != *no {
            return Err(ClusterError::BadMessage(format!("asked for index partition {no}, got {}", header.export.partition)));
        }
        bytes.push(group.add(name, *no, &manifest, copies.records())?.bytes);
    }
    copies.finish()?;
    group.commit()?;
    Ok(bytes)
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

/// One adoption: its new node, its source (`None`: rebuilt) and its copies' positions in
/// the rebalance's moves.
pub(crate) type MoveGroup = (NodeId, Option<NodeId>, Vec<usize>);

/// The copies of `moves` as adoptions: grouped by new node, source and collection (`coll`
/// names each part's), at most [`INDEX_MOVE_GROUP_PARTS`] copies a group, each copy's
/// position in `moves` once. Groups of one new node take turns between sources, so that
/// the first adoptions at once read from every source. Pure.
pub(crate) fn move_groups<'a>(moves: &[SourcedCopy], coll: impl Fn(&IndexPart) -> Option<&'a str>) -> Vec<MoveGroup> {
    // (new node, source, collection) → the copies' positions.
    type Key<'c> = (NodeId, Option<NodeId>, Option<&'c str>);
    let mut by_key: BTreeMap<Key, Vec<usize>> = BTreeMap::new();
    for (i, ((part, to), source)) in moves.iter().enumerate() {
        by_key.entry((*to, *source, coll(part))).or_default().push(i);
    }
    // Per new node, its sources' groups in turn.
    type Queue = std::collections::VecDeque<(Option<NodeId>, Vec<usize>)>;
    let mut by_node: BTreeMap<NodeId, Vec<Queue>> = BTreeMap::new();
    for ((to, source, _), members) in by_key {
        let chunks = members.chunks(INDEX_MOVE_GROUP_PARTS).map(|c| (source, c.to_vec())).collect();
        by_node.entry(to).or_default().push(chunks);
    }
    let mut groups = Vec::new();
    for (to, mut queues) in by_node {
        while queues.iter().any(|q| !q.is_empty()) {
            for q in &mut queues {
                if let Some((source, members)) = q.pop_front() {
                    groups.push((to, source, members));
                }
            }
        }
    }
    groups
}

/// The rebalance's index stage (leader; it runs beside the data partitions' stages): builds
/// every new copy (as many at once per node as its copy slots, more towards a node that held
/// none), then commits the placement. Answers the moves as the rebalance's status shows them.
pub(crate) async fn move_indexes(node: &Arc<ClusterNode>, eject: &[NodeId]) -> Result<Vec<MoveStatus>, ClusterError> {
    let began = Instant::now();
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
    let mut statuses: Vec<MoveStatus> = Vec::with_capacity(moves.len());
    for ((part, to), source) in &moves {
        let (collection, index) = names.get(&part.index).cloned().ok_or_else(|| ClusterError::Refused("an index went away".into()))?;
        statuses.push(MoveStatus {
            kind: MoveKind::Index,
            id: part.partition,
            index: Some(format!("{collection}.{index}")),
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
    }
    // One adoption per group: the copies of one collection's indexes from one source to one
    // node, at most `INDEX_MOVE_GROUP_PARTS` of them.
    let groups = move_groups(&moves, |part| names.get(&part.index).map(|(c, _)| c.as_str()));
    let mut calls = Vec::with_capacity(groups.len());
    for (to, source, members) in &groups {
        let to_address = address(to).ok_or(ClusterError::NodeNotFound(*to))?;
        let mut collection = String::new();
        let mut parts = Vec::with_capacity(members.len());
        for &i in members {
            let ((part, _), _) = &moves[i];
            let (c, index) = names.get(&part.index).cloned().ok_or_else(|| ClusterError::Refused("an index went away".into()))?;
            collection = c;
            parts.push((index, part.partition));
        }
        let req = AdoptRequest { collection, parts, source: source.as_ref().and_then(address), applied: state.applied.0 };
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
            let answers: Vec<AdoptAnswer> = serde_json::from_slice(&answer).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
            if answers.len() != req.parts.len() {
                return Err(ClusterError::BadMessage(format!(
                    "{} answers to an adoption of {} index partitions",
                    answers.len(),
                    req.parts.len()
                )));
            }
            Ok(answers)
        });
    }
    node.rebalancer.add_moves(&statuses);
    let answers = futures::future::join_all(calls).await;
    let mut rebuilt = 0usize;
    for ((_, _, members), answers) in groups.iter().zip(answers) {
        for (&i, answer) in members.iter().zip(answers?) {
            let status = &mut statuses[i];
            status.method = answer.method;
            status.bytes_total = answer.bytes;
            status.bytes_done = answer.bytes;
            status.state = MoveState::Done;
            rebuilt += usize::from(answer.method == CopyMethod::Stream);
        }
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
    let secs = began.elapsed().as_secs_f64();
    node.rebalancer.index_stage_ended(secs);
    tracing::info!(moves = statuses.len(), rebuilt, secs, "index partitions placed");
    Ok(statuses)
}

#[cfg(test)]
mod tests {
    use super::{
        adopt_wait_outcome, caught_up_within, checked_group, definition_within, move_groups, retry_each_by_files, transfer_share, Known,
        SourcedCopy, INDEX_ADOPT_RETRY, INDEX_ADOPT_TIMEOUT, INDEX_DEFINITION_WAIT, INDEX_MOVE_GROUP_PARTS, TRANSFER_PERMITS,
    };
    use shoal_cluster::index_placement::IndexPart;
    use shoal_cluster::NodeId;
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
            let got = adopt_wait_outcome(waited, || held, "by_v", &[2, 5]);
            assert_eq!(kind(&got), want, "{before} with the copy held {held:?}");
        }
        // Through the retrying wait: one call, no retry, at once.
        let (start, calls) = (Instant::now(), Cell::new(0u32));
        let got = caught_up_within(INDEX_ADOPT_TIMEOUT, |_| {
            calls.set(calls.get() + 1);
            async { adopt_wait_outcome(unavailable(), || Some(false), "by_v", &[2]) }
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

    /// A rebalance's copies become adoptions: one per new node, source and collection, at
    /// most `INDEX_MOVE_GROUP_PARTS` copies each, every copy in exactly one; a node's groups
    /// take turns between its sources.
    #[test]
    fn copies_move_in_groups_by_node_source_and_collection() {
        let copy = |index: u64, partition: u16, to: u64, from: Option<u64>| -> SourcedCopy {
            ((IndexPart { index, partition }, NodeId(to)), from.map(NodeId))
        };
        // Index 9 is of another collection; index 7's copy is rebuilt (no source).
        let mut moves: Vec<SourcedCopy> = Vec::new();
        for i in 0..40u64 {
            moves.push(copy(i, (i % 8) as u16, 4, Some(1 + i % 2)));
        }
        moves.push(copy(100, 0, 4, Some(1)));
        moves.push(copy(7, 3, 4, None));
        moves.push(copy(5, 1, 3, Some(2)));
        let coll = |p: &IndexPart| Some(if p.index == 100 { "other" } else { "docs" });
        let groups = move_groups(&moves, coll);
        let mut seen: Vec<usize> = groups.iter().flat_map(|(_, _, m)| m.clone()).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..moves.len()).collect::<Vec<_>>(), "every copy once");
        for (to, source, members) in &groups {
            assert!(!members.is_empty() && members.len() <= INDEX_MOVE_GROUP_PARTS);
            for &i in members {
                let ((part, t), s) = &moves[i];
                assert_eq!((t, s), (to, source));
                assert_eq!(coll(part), coll(&moves[members[0]].0 .0));
            }
        }
        // Node 4: 20 copies from each of sources 1 and 2 (two groups each), then source 1's
        // other collection and the rebuilt one; node 3: one group.
        let shape: Vec<(u64, Option<u64>, usize)> = groups.iter().map(|(t, s, m)| (t.0, s.map(|n| n.0), m.len())).collect();
        assert_eq!(
            shape,
            vec![(3, Some(2), 1), (4, None, 1), (4, Some(1), 16), (4, Some(1), 1), (4, Some(2), 16), (4, Some(1), 4), (4, Some(2), 4)]
        );
        assert!(move_groups(&[], coll).is_empty());
    }

    /// A failed group's parts are tried again one by one by files only when its source
    /// answered: one out of reach or silent would hold each part up again in turn.
    #[test]
    fn a_failed_group_retries_each_part_by_files_only_when_its_source_answered() {
        use crate::ClusterError;
        let timeout = || ClusterError::Timeout("the copy's source sent nothing for 30s".into());
        use crate::peers::PeerError;
        let table: [(ClusterError, usize, bool); 7] = [
            (ClusterError::BadMessage("asked for index partition 3, got 4".into()), 16, true),
            (ClusterError::Storage("the memtable items do not match their checksum".into()), 2, true),
            (ClusterError::Index(IndexError::NotFound("by_v".into())), 16, true),
            (ClusterError::BadMessage("cut".into()), 1, false),
            (timeout(), 16, false),
            (ClusterError::Peer(PeerError::Unreachable { address: "127.0.0.1:7071".into(), why: "connection refused".into() }), 16, false),
            (
                ClusterError::Peer(PeerError::Refused {
                    address: "127.0.0.1:7071".into(),
                    code: "unavailable".into(),
                    message: "index by_v: partition 3 is not held here".into(),
                }),
                16,
                true,
            ),
        ];
        for (error, parts, want) in table {
            assert_eq!(retry_each_by_files(&error, parts), want, "{error} ({parts} parts)");
        }
    }

    /// A group names 1 to `INDEX_MOVE_GROUP_PARTS` parts, each once; anything else is
    /// refused as a bad message before any work.
    #[test]
    fn a_group_of_no_parts_too_many_or_one_twice_is_refused() {
        let parts = |n: usize| -> Vec<(String, u16)> { (0..n).map(|i| ("by_v".to_string(), i as u16)).collect() };
        assert!(checked_group(&parts(1)).is_ok());
        assert!(checked_group(&parts(INDEX_MOVE_GROUP_PARTS)).is_ok());
        assert!(checked_group(&parts(0)).is_err());
        assert!(checked_group(&parts(INDEX_MOVE_GROUP_PARTS + 1)).is_err());
        assert!(checked_group(&[("a".into(), 1), ("b".into(), 1)]).is_ok());
        assert!(checked_group(&[("a".into(), 1), ("a".into(), 1)]).is_err());
    }
}
