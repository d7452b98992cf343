//! `GET .../changes`: the change stream as NDJSON, in `normal`, `longpoll` and
//! `continuous` feeds, resumable from an opaque token.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Deserialize;
use shoal_storage::changes::FeedPosition;
use shoal_storage::{Change, Collection, ReadLimit};
use tokio::sync::mpsc;

use crate::docs::collection;
use crate::error::ApiError;
use crate::extract;
use crate::routing::{FORWARDED_HEADER, FORWARD_TIMEOUT};
use crate::AppState;

/// Changes read per step.
const CHANGES_BATCH_MAX: usize = 1000;
/// Keys and documents in one `normal` or `longpoll` answer (or one `continuous` batch),
/// about: a longer history is read on from the answer's `last` token.
pub const CHANGES_ANSWER_MAX_BYTES: usize = 16 * 1024 * 1024;
/// Default and largest `limit`.
const CHANGES_LIMIT_DEFAULT: usize = 10_000;
const CHANGES_LIMIT_MAX: usize = 1_000_000;
/// Default and longest `timeout` (milliseconds) of `longpoll` and `continuous` feeds.
const FEED_TIMEOUT_DEFAULT_MS: u64 = 60_000;
const FEED_TIMEOUT_MAX_MS: u64 = 3_600_000;

#[derive(Debug, Default, Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum Feed {
    #[default]
    Normal,
    Longpoll,
    Continuous,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Params {
    since: Option<String>,
    #[serde(default)]
    feed: Feed,
    limit: Option<usize>,
    #[serde(default)]
    include_docs: bool,
    timeout: Option<u64>,
    /// Between members only: the partitions the node asked serves from this one, by the map
    /// version in the forwarded header (comma-separated).
    partitions: Option<String>,
}

pub async fn changes(State(state): State<AppState>, uri: Uri, RawQuery(q): RawQuery, headers: HeaderMap) -> Result<Response, ApiError> {
    let params: Params = extract::query(q.as_deref())?;
    let coll = collection(&state, &uri)?;
    let limit = params.limit.unwrap_or(if params.feed == Feed::Continuous { usize::MAX } else { CHANGES_LIMIT_DEFAULT });
    if limit == 0 || (params.feed != Feed::Continuous && limit > CHANGES_LIMIT_MAX) {
        return Err(ApiError::bad_request(format!("limit is 1 to {CHANGES_LIMIT_MAX}")));
    }
    let timeout_ms = params.timeout.unwrap_or(FEED_TIMEOUT_DEFAULT_MS);
    if timeout_ms > FEED_TIMEOUT_MAX_MS {
        return Err(ApiError::bad_request(format!("timeout is at most {FEED_TIMEOUT_MAX_MS} ms")));
    }
    let since = params.since.as_deref().filter(|s| !s.is_empty() && *s != "0");
    // In a cluster a feed covers every partition wherever its active copy is: the node
    // asked splits the partitions by the map it pins, and merges its own and the other
    // members' feeds, each member serving the partitions it was given under that map (each
    // partition once: a member whose own map differs refuses).
    let node = &state.cluster;
    crate::routing::require_serving(&state).await?;
    let timeout = Duration::from_millis(timeout_ms);
    let forwarded = headers.contains_key(FORWARDED_HEADER);
    if params.partitions.is_some() && !forwarded {
        return Err(ApiError::bad_request("`partitions` is for calls between members"));
    }
    if !forwarded {
        let pinned = node.state();
        let owners = node.active_owners_in(&pinned).map_err(crate::routing::no_active)?;
        if owners.iter().any(Option::is_some) {
            let base = match since {
                None => FeedPosition::start(coll.partition_count()),
                Some(token) => FeedPosition::from_token(token, coll.partition_count())?,
            };
            let spec = Spec { feed: params.feed, limit, timeout, include_docs: params.include_docs };
            let path = uri.path_and_query().map_or_else(|| uri.path().to_string(), |pq| pq.as_str().to_string());
            return span(&state, coll, since, base, owners, spec, &path, pinned.map_version(), headers.get(crate::auth::USER_HEADER));
        }
    }
    let only = match params.partitions.as_deref() {
        Some(list) if forwarded => Some(given_partitions(&state, &headers, list, coll.partition_count()).await?),
        _ => node.actives_here(),
    };
    let spec = Spec { feed: params.feed, limit, timeout, include_docs: params.include_docs };
    let rx = local_feed(&state, coll, since, only, spec)?;
    let stream = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (Ok::<_, std::convert::Infallible>(b), rx)) });
    Ok((StatusCode::OK, [(header::CONTENT_TYPE, "application/x-ndjson")], Body::from_stream(stream)).into_response())
}

/// The partitions a member's feed serves for the node asked (`list`, by the map version of
/// the forwarded header): each must be active here under that very map, else the feed is
/// refused (a partition moved in between would be served twice or not at all).
async fn given_partitions(state: &AppState, headers: &HeaderMap, list: &str, count: u16) -> Result<Vec<bool>, ApiError> {
    let node = &state.cluster;
    let routed_by = crate::routing::forwarded_by_map(headers);
    if let Some(v) = routed_by.filter(|v| *v > node.state().map_version()) {
        node.wait_map_after(v - 1, crate::routing::FORWARDED_MAP_WAIT).await;
    }
    let pinned = node.state();
    let moved =
        || ApiError::unavailable("the partition map changed while the feed started (partitions moved); read it again from the last token");
    if routed_by.is_some_and(|v| v != pinned.map_version()) {
        return Err(moved());
    }
    let here = node.actives_here_in(&pinned);
    let mut only = vec![false; usize::from(count)];
    for p in list.split(',').filter(|p| !p.is_empty()) {
        let p: u16 = p.parse().map_err(|_| ApiError::bad_request(format!("`partitions`: {p} is not a partition")))?;
        let slot = only.get_mut(usize::from(p)).ok_or_else(|| ApiError::bad_request(format!("`partitions`: no partition {p}")))?;
        if here.as_ref().is_some_and(|h| !h.get(usize::from(p)).copied().unwrap_or(false)) {
            return Err(moved());
        }
        *slot = true;
    }
    Ok(only)
}

/// What a feed was asked for.
#[derive(Clone, Copy)]
struct Spec {
    feed: Feed,
    limit: usize,
    timeout: Duration,
    include_docs: bool,
}

/// This node's feed of `coll` from `since` (of the partitions `only` marks, if given), as
/// NDJSON chunks of whole lines.
fn local_feed(
    state: &AppState,
    coll: Arc<Collection>,
    since: Option<&str>,
    only: Option<Vec<bool>>,
    spec: Spec,
) -> Result<mpsc::Receiver<Bytes>, ApiError> {
    let (pos, rollbacks) = coll.feed_position(since)?;
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    let mut first = Vec::new();
    for r in rollbacks {
        if only.as_ref().is_some_and(|only| !only.get(usize::from(r.partition)).copied().unwrap_or(false)) {
            continue;
        }
        first.extend_from_slice(serde_json::json!({"rollback": {"partition": r.partition, "seqno": r.seqno}}).to_string().as_bytes());
        first.push(b'\n');
    }
    let feed = FeedTask {
        coll,
        pos,
        only,
        include_docs: spec.include_docs,
        limit: spec.limit,
        feed: spec.feed,
        timeout: spec.timeout,
        tx,
        shutdown: state.shutdown.clone(),
    };
    tokio::spawn(feed.run(first));
    Ok(rx)
}

struct FeedTask {
    coll: Arc<Collection>,
    pos: FeedPosition,
    /// The partitions this feed covers (all when `None`).
    only: Option<Vec<bool>>,
    include_docs: bool,
    limit: usize,
    feed: Feed,
    timeout: Duration,
    tx: mpsc::Sender<Bytes>,
    shutdown: tokio::sync::watch::Receiver<bool>,
}

impl FeedTask {
    async fn run(mut self, first: Vec<u8>) {
        if let Err(reason) = self.stream(first).await {
            let line = serde_json::json!({"error": "unavailable", "reason": reason});
            let _ = self.tx.send(Bytes::from(format!("{line}\n"))).await;
        }
    }

    /// Sends lines until the feed is done; `Err` carries a reason for a last error line.
    ///
    /// A `normal` or `longpoll` answer names each key once, at its latest change in the
    /// answer (as CouchDB's `_changes` does): the answer is gathered first, at most `limit`
    /// changes and [`CHANGES_ANSWER_MAX_BYTES`] of keys and documents; a longer history is
    /// read on from the `last` token. A `continuous` feed streams as changes come, each key
    /// once per batch.
    async fn stream(&mut self, mut pending: Vec<u8>) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let mut changed = self.coll.changed();
        let mut answer = Answer::default();
        loop {
            // Mark before reading: a change committed after this is seen by `changed()`.
            changed.borrow_and_update();
            let limit = match self.feed {
                Feed::Continuous => ReadLimit { items: CHANGES_BATCH_MAX.min(self.limit - answer.sent), bytes: CHANGES_ANSWER_MAX_BYTES },
                Feed::Normal | Feed::Longpoll => ReadLimit {
                    items: CHANGES_BATCH_MAX.min(self.limit - answer.gathered()),
                    bytes: CHANGES_ANSWER_MAX_BYTES.saturating_sub(answer.bytes),
                },
            };
            let coll = Arc::clone(&self.coll);
            let mut pos = self.pos.clone();
            let include_docs = self.include_docs;
            let only = self.only.clone();
            // The read may touch the disk: off the I/O threads.
            let (changes, pos) =
                tokio::task::spawn_blocking(move || coll.read_feed(&mut pos, limit, include_docs, only.as_deref()).map(|c| (c, pos)))
                    .await
                    .map_err(|e| e.to_string())?
                    .map_err(|e| e.to_string())?;
            self.pos = pos;
            let caught_up = changes.len() < limit.items && changes_bytes(&changes) < limit.bytes;
            match self.feed {
                Feed::Continuous => {
                    answer.sent += changes.len();
                    for change in dedupe(changes) {
                        write_change(&mut pending, &change);
                    }
                    if answer.sent >= self.limit {
                        write_last(&mut pending, &self.pos);
                        let _ = self.tx.send(Bytes::from(pending)).await;
                        return Ok(());
                    }
                    if !pending.is_empty() && caught_up {
                        write_last(&mut pending, &self.pos);
                    }
                    if !pending.is_empty() && self.tx.send(Bytes::from(std::mem::take(&mut pending))).await.is_err() {
                        return Ok(()); // the client went away
                    }
                }
                Feed::Normal | Feed::Longpoll => {
                    answer.gather(changes);
                    let full = answer.gathered() >= self.limit || answer.bytes >= CHANGES_ANSWER_MAX_BYTES;
                    let done = full || (caught_up && (self.feed == Feed::Normal || answer.gathered() > 0));
                    if done {
                        for change in answer.changes.iter().flatten() {
                            write_change(&mut pending, change);
                        }
                        write_last(&mut pending, &self.pos);
                        let _ = self.tx.send(Bytes::from(pending)).await;
                        return Ok(());
                    }
                }
            }
            if caught_up {
                tokio::select! {
                    r = changed.changed() => if r.is_err() { return Err("the collection was dropped".into()) },
                    _ = tokio::time::sleep_until(deadline) => {
                        write_last(&mut pending, &self.pos);
                        let _ = self.tx.send(Bytes::from(pending)).await;
                        return Ok(());
                    }
                    _ = self.shutdown.changed() => {
                        write_last(&mut pending, &self.pos);
                        let _ = self.tx.send(Bytes::from(pending)).await;
                        return Ok(());
                    }
                    _ = self.tx.closed() => return Ok(()),
                }
                if self.coll.is_dropped() {
                    return Err("the collection was dropped".into());
                }
            }
        }
    }
}

/// A `normal` or `longpoll` answer being gathered: each key once, at its latest change.
#[derive(Default)]
struct Answer {
    /// In order of each key's latest change; an earlier change of a key becomes `None`.
    changes: Vec<Option<Change>>,
    at: HashMap<Bytes, usize>,
    bytes: usize,
    /// Changes sent so far (continuous feeds).
    sent: usize,
}

impl Answer {
    fn gathered(&self) -> usize {
        self.at.len()
    }

    fn gather(&mut self, changes: Vec<Change>) {
        for change in changes {
            let size = change.key.len() + change.value.as_ref().map_or(0, |v| v.len());
            if let Some(old) = self.at.insert(change.key.clone(), self.changes.len()) {
                if let Some(prev) = self.changes[old].take() {
                    self.bytes -= prev.key.len() + prev.value.as_ref().map_or(0, |v| v.len());
                }
            }
            self.bytes += size;
            self.changes.push(Some(change));
        }
    }
}

/// The latest change of each key of one batch, in seqno order.
fn dedupe(changes: Vec<Change>) -> Vec<Change> {
    let mut latest: HashMap<Bytes, u64> = HashMap::with_capacity(changes.len());
    for c in &changes {
        latest.insert(c.key.clone(), c.seqno);
    }
    if latest.len() == changes.len() {
        return changes;
    }
    changes.into_iter().filter(|c| latest.get(&c.key) == Some(&c.seqno)).collect()
}

fn changes_bytes(changes: &[Change]) -> usize {
    changes.iter().map(|c| c.key.len() + c.value.as_ref().map_or(0, |v| v.len())).sum()
}

fn write_change(out: &mut Vec<u8>, change: &Change) {
    out.extend_from_slice(b"{\"key\":");
    let key = String::from_utf8_lossy(&change.key);
    let _ = serde_json::to_writer(&mut *out, &key);
    out.extend_from_slice(
        format!(",\"partition\":{},\"seqno\":{},\"cas\":\"{}\",\"deleted\":{}", change.partition, change.seqno, change.cas, change.deleted)
            .as_bytes(),
    );
    if let Some(doc) = &change.value {
        out.extend_from_slice(b",\"doc\":");
        out.extend_from_slice(doc);
    }
    out.extend_from_slice(b"}\n");
}

fn write_last(out: &mut Vec<u8>, pos: &FeedPosition) {
    out.extend_from_slice(format!("{{\"last\":\"{}\"}}\n", pos.to_token()).as_bytes());
}

// ---------------------------------------------------------------------------------------
// Feeds spanning the members of a cluster.
//
// The node asked runs one feed per member holding active copies (its own in process, the
// others' over HTTP, marked forwarded so that each serves only its actives) with the same
// `since`, and merges their lines. Its `last` tokens combine, partition by partition, the
// position of the member serving it; where `limit` cuts a member's lines short, a
// partition's position is the last change of it sent (lines of one partition come in
// seqno order, each key at its latest change, so resuming there loses nothing).

/// One member's feed as the merge sees it.
struct Source {
    /// The partitions it serves.
    served: Vec<bool>,
    /// Bytes of a line not yet complete.
    partial: Vec<u8>,
    /// Its latest position (from its `last` lines).
    token: Option<FeedPosition>,
    /// Its change lines kept for a `normal`/`longpoll` answer, with their partition and seqno.
    changes: Vec<(Bytes, u16, u64)>,
    /// Its other lines (rollbacks, errors) kept for such an answer.
    others: Vec<Bytes>,
    ended: bool,
}

/// What the merge needs of a line.
#[derive(Deserialize)]
struct LineHead {
    partition: Option<u16>,
    seqno: Option<u64>,
    last: Option<String>,
}

#[allow(clippy::too_many_arguments)]
fn span(
    state: &AppState,
    coll: Arc<Collection>,
    since: Option<&str>,
    base: FeedPosition,
    owners: Vec<Option<String>>,
    spec: Spec,
    path: &str,
    map_version: u64,
    user: Option<&axum::http::HeaderValue>,
) -> Result<Response, ApiError> {
    let count = usize::from(coll.partition_count());
    if owners.len() != count {
        return Err(ApiError::unavailable("the partition map and the collection disagree on the partition count; try again"));
    }
    let (merged_tx, mut merged_rx) = mpsc::channel::<(usize, Option<Bytes>)>(16);
    let mut sources = Vec::new();
    let mut addresses: Vec<Option<String>> = Vec::new();
    for owner in &owners {
        if !addresses.contains(owner) {
            addresses.push(owner.clone());
        }
    }
    for (i, address) in addresses.iter().enumerate() {
        let served: Vec<bool> = owners.iter().map(|o| o == address).collect();
        let tx = merged_tx.clone();
        match address {
            None => {
                let mut rx = local_feed(state, Arc::clone(&coll), since, Some(served.clone()), spec)?;
                tokio::spawn(async move {
                    while let Some(chunk) = rx.recv().await {
                        if tx.send((i, Some(chunk))).await.is_err() {
                            return;
                        }
                    }
                    let _ = tx.send((i, None)).await;
                });
            }
            Some(address) if state.faults.is_cut(address) => {
                let line = format!("{}\n", crate::transport::Faults::cut_error(address).to_json());
                tokio::spawn(async move {
                    let _ = tx.send((i, Some(Bytes::from(line)))).await;
                    let _ = tx.send((i, None)).await;
                });
            }
            Some(address) => {
                // The member serves exactly the partitions given here, by this map.
                let given: Vec<String> = served.iter().enumerate().filter(|(_, s)| **s).map(|(p, _)| p.to_string()).collect();
                let sep = if path.contains('?') { '&' } else { '?' };
                let mut request = state
                    .forwarder
                    .get(state.member_url(address, &format!("{path}{sep}partitions={}", given.join(","))))
                    .timeout(spec.timeout + FORWARD_TIMEOUT)
                    .header(FORWARDED_HEADER, map_version.to_string());
                if let Some(user) = user {
                    request = request.header(crate::auth::USER_HEADER, user.as_bytes());
                }
                let address = address.clone();
                tokio::spawn(async move {
                    let failed = |reason: String| {
                        let line = serde_json::json!({"error": "unavailable", "reason": reason});
                        Bytes::from(format!("{line}\n"))
                    };
                    match request.send().await {
                        Ok(mut answer) if answer.status().is_success() => loop {
                            match answer.chunk().await {
                                Ok(Some(chunk)) => {
                                    if tx.send((i, Some(chunk))).await.is_err() {
                                        return;
                                    }
                                }
                                Ok(None) => break,
                                Err(e) => {
                                    let _ = tx.send((i, Some(failed(format!("member {address} stopped its feed: {e}"))))).await;
                                    break;
                                }
                            }
                        },
                        Ok(answer) => {
                            let status = answer.status();
                            let body = answer.bytes().await.unwrap_or_default();
                            let e = ApiError::from_answer(StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY), &body);
                            let _ = tx.send((i, Some(Bytes::from(format!("{}\n", e.to_json()))))).await;
                        }
                        Err(e) => {
                            let _ =
                                tx.send((i, Some(failed(format!("member {address} holding some partitions is unreachable: {e}"))))).await;
                        }
                    }
                    let _ = tx.send((i, None)).await;
                });
            }
        }
        sources.push(Source { served, partial: Vec::new(), token: None, changes: Vec::new(), others: Vec::new(), ended: false });
    }
    drop(merged_tx);
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    tokio::spawn(async move {
        let mut merge = Merge { pos: base.clone(), base, sources, spec, sent: 0, kept: HashMap::new(), tx };
        while let Some((i, chunk)) = merged_rx.recv().await {
            let go_on = match chunk {
                Some(chunk) => merge.take(i, &chunk).await,
                None => merge.end(i).await,
            };
            if !go_on {
                return; // dropping `merged_rx` stops the member feeds
            }
        }
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (Ok::<_, std::convert::Infallible>(b), rx)) });
    Ok((StatusCode::OK, [(header::CONTENT_TYPE, "application/x-ndjson")], Body::from_stream(stream)).into_response())
}

struct Merge {
    /// Where the feed started.
    base: FeedPosition,
    /// Where the merged feed is (continuous feeds).
    pos: FeedPosition,
    sources: Vec<Source>,
    spec: Spec,
    /// Change lines sent (continuous feeds).
    sent: usize,
    /// Continuous feeds: the last change sent of each partition since its member's last
    /// position report.
    kept: HashMap<u16, u64>,
    tx: mpsc::Sender<Bytes>,
}

impl Merge {
    /// Takes a chunk of member `i`'s feed; `false` once the merged feed is done.
    async fn take(&mut self, i: usize, chunk: &[u8]) -> bool {
        let source = &mut self.sources[i];
        source.partial.extend_from_slice(chunk);
        let Some(end) = source.partial.iter().rposition(|b| *b == b'\n') else { return true };
        let complete: Vec<u8> = source.partial.drain(..=end).collect();
        let mut out = Vec::new();
        for line in complete.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            let head: LineHead = serde_json::from_slice(line).unwrap_or(LineHead { partition: None, seqno: None, last: None });
            let source = &mut self.sources[i];
            if let Some(token) = head.last {
                if let Ok(token) = FeedPosition::from_token(&token, self.base.partitions.len() as u16) {
                    source.token = Some(token);
                }
                if self.spec.feed == Feed::Continuous {
                    self.adopt(i);
                    write_last(&mut out, &self.pos);
                }
                continue;
            }
            let line = Bytes::copy_from_slice(line);
            match (self.spec.feed, head.partition.zip(head.seqno)) {
                (Feed::Continuous, Some((p, seqno))) => {
                    push_line(&mut out, &line);
                    self.kept.insert(p, seqno);
                    self.sent += 1;
                    if self.sent >= self.spec.limit {
                        for (p, seqno) in self.kept.drain() {
                            if let Some(slot) = self.pos.partitions.get_mut(usize::from(p)) {
                                slot.seqno = seqno;
                            }
                        }
                        write_last(&mut out, &self.pos);
                        let _ = self.tx.send(Bytes::from(out)).await;
                        return false;
                    }
                }
                (Feed::Continuous, None) => push_line(&mut out, &line),
                (_, Some((p, seqno))) => source.changes.push((line, p, seqno)),
                (_, None) => source.others.push(line),
            }
        }
        out.is_empty() || self.tx.send(Bytes::from(out)).await.is_ok()
    }

    /// The positions member `i` reported for the partitions it serves.
    fn adopt(&mut self, i: usize) {
        let source = &self.sources[i];
        let Some(token) = &source.token else { return };
        for (p, served) in source.served.iter().enumerate() {
            if *served {
                if let (Some(slot), Some(theirs)) = (self.pos.partitions.get_mut(p), token.partitions.get(p)) {
                    *slot = *theirs;
                }
                self.kept.remove(&(p as u16));
            }
        }
    }

    /// Member `i`'s feed ended; `false` once the merged feed is done.
    async fn end(&mut self, i: usize) -> bool {
        self.sources[i].ended = true;
        let all = self.sources.iter().all(|s| s.ended);
        let out = match self.spec.feed {
            Feed::Continuous if all => {
                let mut out = Vec::new();
                write_last(&mut out, &self.pos);
                out
            }
            Feed::Continuous => return true,
            Feed::Normal if !all => return true,
            // A long poll answers as soon as one member has changes.
            Feed::Longpoll if !all && self.sources[i].changes.is_empty() => return true,
            Feed::Normal | Feed::Longpoll => self.answer(),
        };
        let _ = self.tx.send(Bytes::from(out)).await;
        false
    }

    /// A `normal` or `longpoll` answer from the members whose feeds ended: their lines,
    /// at most `limit` changes, and the position they reach together.
    fn answer(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let mut pos = self.base.clone();
        let mut left = self.spec.limit;
        for source in self.sources.iter().filter(|s| s.ended) {
            for line in &source.others {
                push_line(&mut out, line);
            }
            let take = source.changes.len().min(left);
            left -= take;
            let token = source.token.as_ref();
            for (p, served) in source.served.iter().enumerate() {
                let (Some(slot), true) = (pos.partitions.get_mut(p), *served) else { continue };
                match token.and_then(|t| t.partitions.get(p)) {
                    Some(theirs) if take == source.changes.len() => *slot = *theirs,
                    theirs => {
                        // Cut short: up to the last change of this partition sent.
                        if let Some(seqno) = source.changes[..take].iter().filter(|c| usize::from(c.1) == p).map(|c| c.2).max() {
                            slot.seqno = seqno;
                            if let Some(theirs) = theirs {
                                slot.uuid = theirs.uuid;
                            }
                        }
                    }
                }
            }
            for (line, _, _) in &source.changes[..take] {
                push_line(&mut out, line);
            }
        }
        write_last(&mut out, &pos);
        out
    }
}

fn push_line(out: &mut Vec<u8>, line: &[u8]) {
    out.extend_from_slice(line);
    out.push(b'\n');
}
