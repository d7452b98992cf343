//! Secondary index endpoints: define, list, build, drop, scan.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::Response;
use bytes::Bytes;
use serde::Deserialize;
use serde_json::Value;
use shoal_index::{IndexDef, IndexStatus, KeepRow, ScanBounds, ScanRequest, ScanRow, SCAN_ROWS_MAX, SCAN_TIMEOUT_MAX};
use shoal_storage::{Collection, ReadError};

use crate::docs::{check_answer_size, collection, json_response};
use crate::error::ApiError;
use crate::extract;
use crate::routing::FORWARDED_HEADER;
use crate::{spread, AppState};

/// Largest body of an index call.
const INDEX_BODY_MAX_BYTES: usize = 64 * 1024;
/// How long a `request_plus` scan waits by default (at most `shoal_index::SCAN_TIMEOUT_MAX`).
const SCAN_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);

fn status_json(s: &IndexStatus) -> Value {
    serde_json::json!({
        "name": s.def.name,
        "keys": s.def.keys,
        "where": s.def.filter,
        "state": s.state.as_str(),
        "progress": s.progress,
        "items": s.items,
        "partitions": s.def.part_count(),
        "partitions_here": s.part_items.iter().map(|(no, _)| *no).collect::<Vec<u16>>(),
    })
}

/// Index definitions go through the cluster's log; its refusals keep the index API's codes.
fn index_error(e: shoal_node::ClusterError) -> ApiError {
    use shoal_meta::MetaReject as R;
    match e {
        shoal_node::ClusterError::Rejected(R::IndexExists { name, .. }) => ApiError::from(shoal_index::IndexError::Exists(name)),
        shoal_node::ClusterError::Rejected(R::NoSuchIndex { name, .. }) => ApiError::from(shoal_index::IndexError::NotFound(name)),
        shoal_node::ClusterError::Index(e) => ApiError::from(e),
        other => crate::error::cluster_error(other),
    }
}

fn index_name(uri: &Uri) -> Result<String, ApiError> {
    extract::path_segment(uri, 4, "index name")
}

pub async fn create(State(state): State<AppState>, uri: Uri, RawQuery(q): RawQuery, body: Body) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let coll = collection(&state, &uri)?;
    let body = extract::body(&state, body, INDEX_BODY_MAX_BYTES).await?;
    let def: IndexDef = extract::json_body(&body)?;
    // Checked here, before it goes to the cluster's log: a definition every member would
    // refuse is never committed.
    def.compile()?;
    let definition: Value = extract::json_body(&body)?;
    let status = state.cluster.create_index(&coll, &def.name, definition).await.map_err(index_error)?;
    Ok(json_response(StatusCode::CREATED, status_json(&status).to_string().into_bytes()))
}

pub async fn list(State(state): State<AppState>, uri: Uri, RawQuery(q): RawQuery) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let coll = collection(&state, &uri)?;
    let meta = state.cluster.state();
    let placed = meta.indexes.get(coll.name());
    let list: Vec<Value> = state
        .engine
        .indexes()
        .list(&coll)
        .iter()
        .map(|s| {
            let mut v = status_json(s);
            // Where the index service placed each partition's copies (node ids).
            if let Some(def) = placed.and_then(|p| p.get(&s.def.name)).filter(|d| d.is_placed()) {
                v["placement"] =
                    serde_json::json!(def.placement.iter().map(|c| c.iter().map(|n| n.0).collect::<Vec<u64>>()).collect::<Vec<_>>());
            }
            v
        })
        .collect();
    Ok(json_response(StatusCode::OK, Value::Array(list).to_string().into_bytes()))
}

pub async fn build(State(state): State<AppState>, uri: Uri, RawQuery(q): RawQuery) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let coll = collection(&state, &uri)?;
    let mut list = state.cluster.build_indexes(&coll, &[index_name(&uri)?]).await.map_err(index_error)?;
    let status = list.pop().ok_or_else(|| ApiError::internal("a build answered no status"))?;
    Ok(json_response(StatusCode::OK, status_json(&status).to_string().into_bytes()))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BuildManyBody {
    names: Vec<String>,
}

/// `POST .../indexes/_build {"names": [...]}`: builds several deferred indexes from one read.
pub async fn build_many(State(state): State<AppState>, uri: Uri, RawQuery(q): RawQuery, body: Body) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let coll = collection(&state, &uri)?;
    let body = extract::body(&state, body, INDEX_BODY_MAX_BYTES).await?;
    let req: BuildManyBody = extract::json_body(&body)?;
    let list: Vec<Value> = state.cluster.build_indexes(&coll, &req.names).await.map_err(index_error)?.iter().map(status_json).collect();
    Ok(json_response(StatusCode::OK, Value::Array(list).to_string().into_bytes()))
}

pub async fn drop(State(state): State<AppState>, uri: Uri, RawQuery(q): RawQuery) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let coll = collection(&state, &uri)?;
    state.cluster.drop_index(&coll, &index_name(&uri)?).await.map_err(index_error)?;
    Ok(json_response(StatusCode::OK, b"{}".to_vec()))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RangeBody {
    low: Option<Vec<Value>>,
    high: Option<Vec<Value>>,
    #[serde(default = "yes")]
    inclusive_low: bool,
    #[serde(default = "yes")]
    inclusive_high: bool,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScanBody {
    eq: Option<Vec<Value>>,
    range: Option<RangeBody>,
    limit: Option<usize>,
    #[serde(default)]
    descending: bool,
    #[serde(default)]
    include_docs: bool,
    consistency: Option<String>,
    timeout_ms: Option<u64>,
}

pub async fn scan(
    State(state): State<AppState>,
    uri: Uri,
    RawQuery(q): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let coll = collection(&state, &uri)?;
    let name = index_name(&uri)?;
    let body = extract::body(&state, body, INDEX_BODY_MAX_BYTES).await?;
    let req: ScanBody = if body.iter().all(u8::is_ascii_whitespace) { ScanBody::default() } else { extract::json_body(&body)? };
    let bounds = match (req.eq, req.range) {
        (Some(_), Some(_)) => return Err(ApiError::bad_request("give `eq` or `range`, not both")),
        (Some(eq), None) => ScanBounds::Eq(eq),
        (None, Some(r)) => ScanBounds::Range { low: r.low, high: r.high, inclusive_low: r.inclusive_low, inclusive_high: r.inclusive_high },
        (None, None) => ScanBounds::All,
    };
    let consistency = extract::consistency(req.consistency.as_deref())?;
    let timeout = req.timeout_ms.map(Duration::from_millis).unwrap_or(SCAN_TIMEOUT_DEFAULT);
    if timeout > SCAN_TIMEOUT_MAX {
        return Err(ApiError::bad_request(format!("timeout_ms is at most {}", SCAN_TIMEOUT_MAX.as_millis())));
    }
    let limit = req.limit.unwrap_or(SCAN_ROWS_MAX);
    let forwarded = headers.contains_key(FORWARDED_HEADER);
    // An index placed on index nodes is read there, from any member (`shoal_node::index_scan`).
    let pinned = state.cluster.state();
    if let Some(def) = shoal_node::index_scan::placed_index(&pinned, coll.name(), &name) {
        crate::routing::require_serving(&state).await?;
        let scan = shoal_node::index_scan::RoutedScan { bounds, limit, descending: req.descending, consistency, timeout };
        let rows = state.cluster.routed_scan(&pinned, &coll, def, scan).await.map_err(crate::error::cluster_error)?;
        if req.include_docs {
            return with_docs(&state, &coll, &rows, &headers).await.map(|body| json_response(StatusCode::OK, body));
        }
        let written = Arc::clone(&coll);
        let body = tokio::task::spawn_blocking(move || write_rows(&written, &rows, false))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))??;
        return Ok(json_response(StatusCode::OK, body));
    }
    // In a cluster (the interim design of ARCHITECTURE.md) every member indexes the
    // partitions it holds and answers for those it holds active; the node asked merges
    // the members' answers in index order. The scan pins one map version, end to end: the
    // node asked splits the partitions by it, sends it with each call, and every member
    // answers by that map or refuses, and so does the node asked once the answers are in
    // (a partition that moved meanwhile would be counted twice or not at all).
    let node = &state.cluster;
    crate::routing::require_serving(&state).await?;
    if let Some(routed_by) = crate::routing::forwarded_by_map(&headers).filter(|v| *v > node.state().map_version()) {
        node.wait_map_after(routed_by - 1, crate::routing::FORWARDED_MAP_WAIT).await;
    }
    let pinned = node.state();
    let map_version = pinned.map_version();
    if forwarded && crate::routing::forwarded_by_map(&headers).is_some_and(|v| v != map_version) {
        return Err(map_moved());
    }
    let others = if forwarded { Vec::new() } else { spread::other_actives_in(&state, &pinned)? };
    let keep = node.actives_here_in(&pinned).map(|here| {
        KeepRow(Arc::new(move |id: &str| {
            let p = shoal_storage::partition_of(id.as_bytes(), u16::try_from(here.len()).unwrap_or(u16::MAX));
            here.get(usize::from(p)).copied().unwrap_or(false)
        }))
    });
    let descending = req.descending;
    let scan = ScanRequest { bounds, limit, descending, consistency, timeout, keep, parts: None };
    let include_docs = req.include_docs;
    let local = async {
        let rows = state.engine.indexes().scan(&coll, &name, scan).await?;
        // Documents are read off the I/O threads: a scan may return up to SCAN_ROWS_MAX.
        let coll = Arc::clone(&coll);
        tokio::task::spawn_blocking(move || write_rows(&coll, &rows, include_docs)).await.map_err(|e| ApiError::internal(e.to_string()))?
    };
    if others.is_empty() {
        let local = local.await?;
        if node.state().map_version() != map_version {
            return Err(map_moved());
        }
        return Ok(json_response(StatusCode::OK, local));
    }
    let calls = others.into_iter().map(|address| (address, body.to_vec())).collect();
    let (remote, local) = tokio::join!(spread::call_all(&state, uri.path(), map_version, &headers, calls), local);
    let mut answers = vec![Bytes::from(local?)];
    for answer in remote {
        // A scan writes nothing: a member that did not answer makes it unavailable, never
        // ambiguous (`408` with `ambiguous` is for writes that may have happened).
        answers.push(answer.map_err(|failed| match failed.error.status {
            StatusCode::REQUEST_TIMEOUT => ApiError::unavailable(failed.error.reason),
            _ => failed.error,
        })?);
    }
    if node.state().map_version() != map_version {
        return Err(map_moved());
    }
    Ok(json_response(StatusCode::OK, merge_rows(&answers, descending, limit)?))
}

/// A `_get` entry as this module reads it.
#[derive(Deserialize)]
struct GotDoc<'a> {
    #[serde(borrow)]
    value: Option<&'a serde_json::value::RawValue>,
    error: Option<String>,
    reason: Option<String>,
}

/// The scan answer of `rows` with each row's document, read from the partitions' actives
/// (`null` for one removed since the scan).
async fn with_docs(state: &AppState, coll: &Arc<Collection>, rows: &[ScanRow], headers: &HeaderMap) -> Result<Vec<u8>, ApiError> {
    let keys: Vec<Value> = rows.iter().map(|r| Value::String(r.id.clone())).collect();
    let path = format!("/v1/collections/{}/_get", coll.name());
    // The user the scan runs for reads the documents (the members check it again).
    let mut asked = HeaderMap::new();
    if let Some(user) = headers.get(crate::auth::USER_HEADER) {
        asked.insert(crate::auth::USER_HEADER, user.clone());
    }
    let entries = crate::docs::get_many(state, coll, keys, &asked, &path).await?;
    let mut out = Vec::with_capacity(64 + rows.len() * 48 + entries.iter().map(Vec::len).sum::<usize>());
    out.extend_from_slice(b"{\"rows\":[");
    for (i, (row, entry)) in rows.iter().zip(&entries).enumerate() {
        if i > 0 {
            out.push(b',');
        }
        let got: GotDoc = serde_json::from_slice(entry).map_err(|e| ApiError::unavailable(format!("a document read answered {e}")))?;
        out.extend_from_slice(b"{\"key\":");
        serde_json::to_writer(&mut out, &row.key).map_err(|e| ApiError::internal(e.to_string()))?;
        out.extend_from_slice(b",\"id\":");
        serde_json::to_writer(&mut out, &row.id).map_err(|e| ApiError::internal(e.to_string()))?;
        out.extend_from_slice(b",\"doc\":");
        match (got.value, got.error.as_deref()) {
            (Some(v), _) => out.extend_from_slice(v.get().as_bytes()),
            (None, Some("doc_not_found")) => out.extend_from_slice(b"null"),
            (None, _) => {
                return Err(ApiError::unavailable(format!(
                    "reading the scan's documents: {}",
                    got.reason.or(got.error).unwrap_or_else(|| "no answer".into())
                )))
            }
        }
        out.push(b'}');
        check_answer_size(out.len(), "use a smaller limit or a narrower range")?;
    }
    out.extend_from_slice(b"]}");
    Ok(out)
}

/// A scan that spans a change of the partition map: refused, never answered short.
fn map_moved() -> ApiError {
    ApiError::unavailable("the partition map changed while the scan ran (partitions moved); run it again")
}

/// The rows of a scan answer, each with what orders it.
#[derive(Deserialize)]
struct ScanAnswer<'a> {
    #[serde(borrow)]
    rows: Vec<&'a serde_json::value::RawValue>,
}

/// What orders a row: its index key, then its document key.
#[derive(Deserialize)]
struct RowOrder {
    key: Vec<Value>,
    id: String,
}

/// One answer from the members' answers, each in index order: their rows merged in that
/// order (descending if asked), the first `limit` of them.
fn merge_rows(answers: &[Bytes], descending: bool, limit: usize) -> Result<Vec<u8>, ApiError> {
    let mut rows: Vec<(Vec<u8>, &str)> = Vec::new();
    for answer in answers {
        let parsed: ScanAnswer =
            serde_json::from_slice(answer).map_err(|e| ApiError::unavailable(format!("a member answered a scan with {e}")))?;
        for raw in parsed.rows {
            let order: RowOrder =
                serde_json::from_str(raw.get()).map_err(|e| ApiError::unavailable(format!("a member answered a scan row with {e}")))?;
            rows.push((shoal_index::keycode::row_order(&order.key, &order.id), raw.get()));
        }
    }
    rows.sort_by(|a, b| if descending { b.0.cmp(&a.0) } else { a.0.cmp(&b.0) });
    rows.truncate(limit);
    let mut out = Vec::with_capacity(rows.iter().map(|r| r.1.len() + 1).sum::<usize>() + 16);
    out.extend_from_slice(b"{\"rows\":[");
    for (i, (_, raw)) in rows.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(raw.as_bytes());
    }
    out.extend_from_slice(b"]}");
    check_answer_size(out.len(), "use a smaller limit or a narrower range")?;
    Ok(out)
}

/// The scan answer, written straight into bytes; documents (validated JSON) are copied in
/// as stored, `null` for one removed since the scan.
fn write_rows(coll: &Collection, rows: &[ScanRow], include_docs: bool) -> Result<Vec<u8>, ApiError> {
    let mut out = Vec::with_capacity(64 + rows.len() * 48);
    out.extend_from_slice(b"{\"rows\":[");
    for (i, row) in rows.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(b"{\"key\":");
        serde_json::to_writer(&mut out, &row.key).map_err(|e| ApiError::internal(e.to_string()))?;
        out.extend_from_slice(b",\"id\":");
        serde_json::to_writer(&mut out, &row.id).map_err(|e| ApiError::internal(e.to_string()))?;
        if include_docs {
            out.extend_from_slice(b",\"doc\":");
            match coll.get(&row.id) {
                Ok(d) => out.extend_from_slice(&d.value),
                Err(ReadError::NotFound) => out.extend_from_slice(b"null"),
                Err(e) => return Err(e.into()),
            }
        }
        out.push(b'}');
        check_answer_size(out.len(), "use a smaller limit or a narrower range")?;
    }
    out.extend_from_slice(b"]}");
    Ok(out)
}
