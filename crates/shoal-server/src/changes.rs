//! `GET .../changes`: the change stream as NDJSON, in `normal`, `longpoll` and
//! `continuous` feeds, resumable from an opaque token.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{RawQuery, State};
use axum::http::{header, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Deserialize;
use shoal_storage::changes::FeedPosition;
use shoal_storage::{Change, Collection, ReadLimit};
use tokio::sync::mpsc;

use crate::docs::collection;
use crate::error::ApiError;
use crate::extract;
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
}

pub async fn changes(State(state): State<AppState>, uri: Uri, RawQuery(q): RawQuery) -> Result<Response, ApiError> {
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
    let (pos, rollbacks) = coll.feed_position(since)?;

    let (tx, rx) = mpsc::channel::<Bytes>(4);
    let mut first = Vec::new();
    for r in rollbacks {
        first.extend_from_slice(serde_json::json!({"rollback": {"partition": r.partition, "seqno": r.seqno}}).to_string().as_bytes());
        first.push(b'\n');
    }
    let feed = FeedTask {
        coll,
        pos,
        include_docs: params.include_docs,
        limit,
        feed: params.feed,
        timeout: Duration::from_millis(timeout_ms),
        tx,
        shutdown: state.shutdown.clone(),
    };
    tokio::spawn(feed.run(first));
    let stream = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (Ok::<_, std::convert::Infallible>(b), rx)) });
    Ok((StatusCode::OK, [(header::CONTENT_TYPE, "application/x-ndjson")], Body::from_stream(stream)).into_response())
}

struct FeedTask {
    coll: Arc<Collection>,
    pos: FeedPosition,
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
            // The read may touch the disk: off the I/O threads.
            let (changes, pos) = tokio::task::spawn_blocking(move || coll.read_feed(&mut pos, limit, include_docs).map(|c| (c, pos)))
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
