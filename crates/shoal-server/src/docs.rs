//! Documents: get (with lock or touch), upsert / insert / replace, remove, touch, unlock,
//! multi-get and NDJSON bulk.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{RawQuery, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Deserialize;
use shoal_storage::{Collection, MutationOutcome, WriteOp, WriteRequest, DOC_MAX_BYTES};

use crate::error::ApiError;
use crate::extract::{self, Consistency, Durability, Precondition};
use crate::{spread, AppState};

/// Most keys in one `_get`.
pub const MULTI_GET_KEYS_MAX: usize = 10_000;
/// Largest `_get` request body.
pub const MULTI_GET_BODY_MAX_BYTES: usize = 4 * 1024 * 1024;
/// Largest answer that carries documents (`_get`, lookups, index scans with documents):
/// beyond it the request fails with `too_large` rather than hold an unbounded answer.
pub const DOCS_ANSWER_MAX_BYTES: usize = 64 * 1024 * 1024;
/// Largest `_bulk` request body; clients send larger loads in several requests.
pub const BULK_BODY_MAX_BYTES: usize = 256 * 1024 * 1024;

pub fn collection(state: &AppState, uri: &Uri) -> Result<Arc<Collection>, ApiError> {
    let name = extract::collection_name(uri)?;
    state.engine.store().collection(&name).ok_or_else(|| ApiError::collection_not_found(&name))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct GetParams {
    lock: Option<u32>,
    touch: Option<i64>,
    #[serde(default)]
    consistency: Consistency,
}

pub async fn get(State(state): State<AppState>, uri: Uri, RawQuery(q): RawQuery) -> Result<Response, ApiError> {
    let params: GetParams = extract::query(q.as_deref())?;
    let coll = collection(&state, &uri)?;
    let key = extract::doc_key(&uri)?;
    let doc = match (params.lock, params.touch) {
        (Some(_), Some(_)) => return Err(ApiError::bad_request("lock and touch cannot be combined")),
        (Some(secs), None) => {
            let (c, k) = (Arc::clone(&coll), key.clone());
            blocking(move || c.get_and_lock(&k, secs)).await??
        }
        (None, Some(secs)) => {
            let req = WriteRequest {
                key: Bytes::from(key.clone()),
                op: WriteOp::Touch,
                value: None,
                cas: None,
                expiry: extract::expiry(Some(secs), coll.now_secs())?,
            };
            // Get-and-touch answers like a get: it does not wait for an fsync.
            let c = Arc::clone(&coll);
            let (_, _not_awaited) = blocking(move || c.write(req)).await??;
            coll.get(&key)?
        }
        (None, None) => match coll.get(&key) {
            Ok(doc) => doc,
            Err(e) => {
                let e = ApiError::from(e);
                if params.consistency == Consistency::Majority && e.code == "doc_not_found" {
                    confirm(&state, &coll, key.as_bytes()).await?;
                }
                return Err(e);
            }
        },
    };
    if params.consistency == Consistency::Majority {
        confirm(&state, &coll, key.as_bytes()).await?;
    }
    let mut response = Response::new(Body::from(doc.value));
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(header::ETAG, etag(doc.cas));
    if doc.expiry != 0 {
        headers.insert("x-shoal-expiry", HeaderValue::from(doc.expiry));
    }
    Ok(response)
}

fn etag(cas: u64) -> HeaderValue {
    // Digits and quotes are always a valid header value.
    HeaderValue::from_str(&format!("\"{cas}\"")).unwrap_or(HeaderValue::from_static("\"0\""))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PutParams {
    expiry: Option<i64>,
    #[serde(default)]
    durability: Durability,
}

pub async fn put(
    State(state): State<AppState>,
    uri: Uri,
    RawQuery(q): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let params: PutParams = extract::query(q.as_deref())?;
    let coll = collection(&state, &uri)?;
    let key = extract::doc_key(&uri)?;
    let precondition = extract::precondition(&headers)?;
    let expiry = extract::expiry(params.expiry, coll.now_secs())?;
    let value = extract::body(&state, body, DOC_MAX_BYTES).await?;
    shoal_json::validate(&value).map_err(|e| ApiError::invalid_json(e.to_string()))?;
    let (op, cas) = match precondition {
        Precondition::None => (WriteOp::Upsert, None),
        Precondition::MustNotExist => (WriteOp::Insert, None),
        Precondition::MustExist => (WriteOp::Replace, None),
        Precondition::Cas(cas) => (WriteOp::Replace, Some(cas)),
    };
    let req = WriteRequest { key: Bytes::from(key), op, value: Some(value), cas, expiry };
    let outcome = write_durably(&state, &coll, req, params.durability).await?;
    let status = if op == WriteOp::Insert { StatusCode::CREATED } else { StatusCode::OK };
    Ok(mutation_response(status, &outcome))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RemoveParams {
    #[serde(default)]
    durability: Durability,
}

pub async fn remove(State(state): State<AppState>, uri: Uri, RawQuery(q): RawQuery, headers: HeaderMap) -> Result<Response, ApiError> {
    let params: RemoveParams = extract::query(q.as_deref())?;
    let coll = collection(&state, &uri)?;
    let key = extract::doc_key(&uri)?;
    let cas = match extract::precondition(&headers)? {
        Precondition::None | Precondition::MustExist => None,
        Precondition::Cas(cas) => Some(cas),
        Precondition::MustNotExist => return Err(ApiError::bad_request("If-None-Match makes no sense on a remove")),
    };
    let req = WriteRequest { key: Bytes::from(key), op: WriteOp::Remove, value: None, cas, expiry: 0 };
    let outcome = write_durably(&state, &coll, req, params.durability).await?;
    Ok(mutation_response(StatusCode::OK, &outcome))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TouchParams {
    expiry: Option<i64>,
    #[serde(default)]
    durability: Durability,
}

pub async fn touch(State(state): State<AppState>, uri: Uri, RawQuery(q): RawQuery, headers: HeaderMap) -> Result<Response, ApiError> {
    let params: TouchParams = extract::query(q.as_deref())?;
    let coll = collection(&state, &uri)?;
    let key = extract::doc_key(&uri)?;
    let Some(secs) = params.expiry else {
        return Err(ApiError::bad_request("touch needs ?expiry=S (0 removes the expiry)"));
    };
    let cas = match extract::precondition(&headers)? {
        Precondition::Cas(cas) => Some(cas),
        _ => None,
    };
    let req =
        WriteRequest { key: Bytes::from(key), op: WriteOp::Touch, value: None, cas, expiry: extract::expiry(Some(secs), coll.now_secs())? };
    let outcome = write_durably(&state, &coll, req, params.durability).await?;
    Ok(mutation_response(StatusCode::OK, &outcome))
}

pub async fn unlock(State(state): State<AppState>, uri: Uri, RawQuery(q): RawQuery, headers: HeaderMap) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let coll = collection(&state, &uri)?;
    let key = extract::doc_key(&uri)?;
    let Precondition::Cas(cas) = extract::precondition(&headers)? else {
        return Err(ApiError::bad_request("unlock needs If-Match: \"<cas>\" from the locking get"));
    };
    blocking(move || coll.unlock(&key, cas)).await??;
    Ok(json_response(StatusCode::OK, b"{}".to_vec()))
}

/// Writes on the I/O thread, as reads do, then waits for the fsync if `persist` was asked
/// for. A single-document write is a sequencer lock, a point read and a journal append
/// (no fsync): a few microseconds, less than handing it to the blocking pool and back
/// (two thread wake-ups, and up to a write slot's worth of threads contending for the
/// sequencer and journal locks on two cores — measured in bench/results: issue 12 write
/// path). Large `_bulk` bodies still go to the blocking pool.
pub(crate) async fn write_durably(
    state: &AppState,
    coll: &Arc<Collection>,
    req: WriteRequest,
    durability: Durability,
) -> Result<MutationOutcome, ApiError> {
    let level = durability.majority();
    let partition = shoal_storage::partition_of(&req.key, coll.partition_count());
    if level.is_some() {
        // Refused before anything is written: `durability_impossible` means "not done".
        state.cluster.majority_possible(coll.id(), partition).await.map_err(majority_error)?;
    }
    let (outcome, wait) = match coll.write(req) {
        Ok(written) => written,
        Err(e) => {
            let e = ApiError::from(e);
            if level.is_some() && is_observation(&e) {
                state.cluster.confirm(coll, partition).await.map_err(majority_error)?;
            }
            return Err(e);
        }
    };
    if durability.fsync_here() {
        wait.wait().await?;
    }
    if let Some(level) = level {
        // Written here: from now on a failure is ambiguous.
        state
            .cluster
            .await_majority(coll.id(), outcome.partition, outcome.seqno, outcome.uuid, level)
            .await
            .map_err(|e| unconfirmed_write(&e))?;
    }
    Ok(outcome)
}

/// Whether a write's error observed the document (a failed condition): at a majority level
/// that observation must be of a version a majority holds, seen by a node still active.
fn is_observation(e: &ApiError) -> bool {
    matches!(e.code, "cas_mismatch" | "doc_not_found" | "doc_exists" | "locked")
}

/// How a write made here but not confirmed by a majority answers: its outcome is unknown.
fn unconfirmed_write(e: &shoal_node::MajorityError) -> ApiError {
    let mut err = ApiError::new(
        StatusCode::REQUEST_TIMEOUT,
        "timeout",
        format!("the write is on this node but not yet confirmed on a majority: {e:?}"),
    );
    err.details.push(("ambiguous", serde_json::Value::Bool(true)));
    err
}

/// A majority read's or failed condition's confirmation (see `ClusterNode::confirm`).
async fn confirm(state: &AppState, coll: &Arc<Collection>, key: &[u8]) -> Result<(), ApiError> {
    let partition = shoal_storage::partition_of(key, coll.partition_count());
    state.cluster.confirm(coll, partition).await.map_err(majority_error)
}

/// How a majority wait that did not happen answers (nothing was written).
fn majority_error(e: shoal_node::MajorityError) -> ApiError {
    use shoal_node::MajorityError as M;
    match e {
        M::Impossible { healthy, needed } => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "durability_impossible",
            format!("{healthy} of the partition's copies are healthy; a majority needs {needed}"),
        ),
        M::Timeout => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "a majority of the partition's copies did not confirm in time")
        }
        M::NotActive => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "this node stopped being the partition's active copy")
        }
    }
}

/// Runs storage work that may block off the I/O threads.
pub(crate) async fn blocking<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work).await.map_err(|e| ApiError::internal(format!("storage task failed: {e}")))
}

pub(crate) fn mutation_json(outcome: &MutationOutcome) -> serde_json::Value {
    serde_json::json!({
        "cas": outcome.cas.to_string(),
        "token": {"partition": outcome.partition, "seqno": outcome.seqno, "uuid": format!("{:016x}", outcome.uuid)},
    })
}

fn mutation_response(status: StatusCode, outcome: &MutationOutcome) -> Response {
    let mut response = json_response(status, serde_json::to_vec(&mutation_json(outcome)).unwrap_or_default());
    response.headers_mut().insert(header::ETAG, etag(outcome.cas));
    response
}

pub fn json_response(status: StatusCode, body: Vec<u8>) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MultiGet {
    keys: Vec<serde_json::Value>,
}

/// Another member's answer to the part of a `_get` it holds.
#[derive(Deserialize)]
struct MultiGetAnswer {
    docs: Vec<Box<serde_json::value::RawValue>>,
}

pub async fn multi_get(
    State(state): State<AppState>,
    uri: Uri,
    RawQuery(q): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let coll = collection(&state, &uri)?;
    let body = extract::body(&state, body, MULTI_GET_BODY_MAX_BYTES).await?;
    let request: MultiGet = extract::json_body(&body)?;
    if request.keys.len() > MULTI_GET_KEYS_MAX {
        return Err(ApiError::too_large(format!("at most {MULTI_GET_KEYS_MAX} keys per _get")));
    }
    // In a cluster each key is read where its partition's active copy is: this node, or
    // the others in one `_get` each, at the same time. A key refused as misrouted (its
    // partition changed hands between the routing and the read) was read nowhere: it is
    // asked again where a newer map says, as a single-key request is (`cluster::route`).
    let n = request.keys.len();
    let entries = get_many(&state, &coll, request.keys, &headers, uri.path()).await?;
    let mut out = Vec::with_capacity(entries.iter().map(Vec::len).sum::<usize>() + n + 16);
    out.extend_from_slice(b"{\"docs\":[");
    for (i, entry) in entries.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(entry);
    }
    out.extend_from_slice(b"]}");
    check_answer_size(out.len(), "ask for fewer keys per _get")?;
    Ok(json_response(StatusCode::OK, out))
}

/// The `_get` entries of `keys`, in their order: `{"key", "cas", "value"}` or `{"key",
/// "error", "reason"}`, each read where its partition's active copy is. `path` is the
/// `_get` endpoint of `coll` (where other members are asked).
pub(crate) async fn get_many(
    state: &AppState,
    coll: &Arc<Collection>,
    keys: Vec<serde_json::Value>,
    headers: &HeaderMap,
    path: &str,
) -> Result<Vec<Vec<u8>>, ApiError> {
    let n = keys.len();
    let keys = Arc::new(keys);
    let relayed = headers.contains_key(crate::routing::FORWARDED_HEADER);
    let mut entries: Vec<Vec<u8>> = vec![Vec::new(); n];
    let mut pending: Vec<usize> = (0..n).collect();
    let reroute = crate::routing::Reroute::start();
    loop {
        let routed_at = state.cluster.state().map_version();
        let answered = get_round(state, coll, &keys, &pending, headers, path).await?;
        let mut misrouted = Vec::new();
        for (&i, entry) in pending.iter().zip(answered) {
            if !relayed && is_misrouted(&entry) {
                misrouted.push(i);
            }
            entries[i] = entry;
        }
        if misrouted.is_empty() {
            break;
        }
        if !reroute.again(&state.cluster, routed_at).await {
            // Never `not_my_partition` to a client that does not route itself.
            for i in misrouted {
                entries[i].clear();
                push_error(&mut entries[i], &keys[i], &crate::routing::unsettled());
            }
            break;
        }
        pending = misrouted;
    }
    Ok(entries)
}

/// One round of a `_get`: reads the keys at positions `at` where the map says (here, or
/// one call per other member) and answers their entries in `at`'s order.
async fn get_round(
    state: &AppState,
    coll: &Arc<Collection>,
    keys: &Arc<Vec<serde_json::Value>>,
    at: &[usize],
    headers: &HeaderMap,
    path: &str,
) -> Result<Vec<Vec<u8>>, ApiError> {
    let places = spread::place(state, headers, at.iter().map(|&i| keys[i].as_str())).await;
    let groups = spread::remote_groups(&places);
    let group_keys: Vec<Vec<serde_json::Value>> = groups.values().map(|g| g.iter().map(|&j| keys[at[j]].clone()).collect()).collect();
    let calls = groups
        .keys()
        .zip(&group_keys)
        .map(|(address, keys)| (address.clone(), serde_json::json!({ "keys": keys }).to_string().into_bytes()))
        .collect();
    // Local documents are read off the I/O threads.
    let (coll, keys, at_local) = (Arc::clone(coll), Arc::clone(keys), at.to_vec());
    let local = tokio::task::spawn_blocking(move || {
        let mut entries: Vec<Vec<u8>> = vec![Vec::new(); at_local.len()];
        let mut bytes = 0;
        for ((&i, place), entry) in at_local.iter().zip(places).zip(entries.iter_mut()) {
            let key = &keys[i];
            match (key, place) {
                (_, spread::Place::Remote(_)) => continue,
                (serde_json::Value::String(_), spread::Place::Refused(e)) => push_error(entry, key, &e),
                (serde_json::Value::String(k), spread::Place::Local) => match coll.get(k) {
                    Ok(doc) => {
                        entry.extend_from_slice(b"{\"key\":");
                        serde_json::to_writer(&mut *entry, k).map_err(|e| ApiError::internal(e.to_string()))?;
                        entry.extend_from_slice(format!(",\"cas\":\"{}\",\"value\":", doc.cas).as_bytes());
                        entry.extend_from_slice(&doc.value);
                        entry.push(b'}');
                    }
                    Err(e) => push_error(entry, key, &ApiError::from(e)),
                },
                (key, _) => push_error(entry, key, &ApiError::invalid_key("a key is a string")),
            }
            bytes += entry.len();
            check_answer_size(bytes, "ask for fewer keys per _get")?;
        }
        Ok::<_, ApiError>(entries)
    });
    let (remote, local) = tokio::join!(spread::call_all(state, path, state.cluster.state().map_version(), headers, calls), local);
    let mut entries = local.map_err(|e| ApiError::internal(format!("multi-get task: {e}")))??;
    for ((group, keys), answer) in groups.values().zip(&group_keys).zip(remote) {
        let docs = answer.and_then(|bytes| {
            let docs: MultiGetAnswer = serde_json::from_slice(&bytes)
                .map_err(|e| spread::CallError { error: ApiError::unavailable(format!("a member answered a _get with {e}")) })?;
            if docs.docs.len() != group.len() {
                return Err(spread::CallError { error: ApiError::unavailable("a member answered a _get with too few documents") });
            }
            Ok(docs.docs)
        });
        match docs {
            Ok(docs) => {
                for (&j, doc) in group.iter().zip(docs) {
                    entries[j] = doc.get().as_bytes().to_vec();
                }
            }
            Err(failed) => {
                for (&j, key) in group.iter().zip(keys) {
                    push_error(&mut entries[j], key, &failed.error);
                }
            }
        }
    }
    Ok(entries)
}

/// Whether a `_get` entry is a `not_my_partition` refusal (a cheap look for the code first;
/// a document that merely contains the words has a `value` and no `error`).
fn is_misrouted(entry: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct Entry<'a> {
        #[serde(borrow)]
        error: Option<&'a str>,
    }
    const CODE: &[u8] = b"\"not_my_partition\"";
    entry.windows(CODE.len()).any(|w| w == CODE)
        && serde_json::from_slice::<Entry>(entry).is_ok_and(|e| e.error == Some("not_my_partition"))
}

/// Refuses an answer that has grown past [`DOCS_ANSWER_MAX_BYTES`]; `hint` tells the client
/// how to ask for less.
pub(crate) fn check_answer_size(bytes: usize, hint: &str) -> Result<(), ApiError> {
    if bytes > DOCS_ANSWER_MAX_BYTES {
        return Err(ApiError::too_large(format!("the answer would be larger than {DOCS_ANSWER_MAX_BYTES} bytes; {hint}")));
    }
    Ok(())
}

fn push_error(out: &mut Vec<u8>, key: &serde_json::Value, err: &ApiError) {
    let line = serde_json::json!({"key": key, "error": err.code, "reason": err.reason});
    out.extend_from_slice(line.to_string().as_bytes());
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BulkLine<'a> {
    op: BulkOp,
    key: String,
    #[serde(borrow)]
    value: Option<&'a serde_json::value::RawValue>,
    cas: Option<CasField>,
    expiry: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
enum BulkOp {
    Upsert,
    Insert,
    Replace,
    Remove,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum CasField {
    Text(String),
    Number(u64),
}

pub async fn bulk(
    State(state): State<AppState>,
    uri: Uri,
    RawQuery(q): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let params: RemoveParams = extract::query(q.as_deref())?;
    let coll = collection(&state, &uri)?;
    let body = extract::body(&state, body, BULK_BODY_MAX_BYTES).await?;
    // Parse every line first; only the valid ones reach a store, in order.
    let mut lines: Vec<BulkSlot> = Vec::new();
    for line in body.split(|&b| b == b'\n') {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        lines.push(match parse_bulk_line(&body, line, coll.now_secs()) {
            Ok((key, req)) => BulkSlot { key: Some(key), line: body.slice_ref(line), parsed: Ok(req) },
            Err((key, e)) => BulkSlot { key, line: Bytes::new(), parsed: Err(e) },
        });
    }
    // In a cluster each line is written where its key's active copy is: here, or by the
    // member holding it in one `_bulk` of its lines (in their order), at the same time. A
    // line refused as misrouted was written nowhere: it is sent again where a newer map
    // says (unless a later line of the same key was written meanwhile — order is kept).
    let relayed = headers.contains_key(crate::routing::FORWARDED_HEADER);
    let path = uri.path_and_query().map_or_else(|| uri.path().to_string(), |pq| pq.as_str().to_string());
    let mut answers: Vec<serde_json::Value> = vec![serde_json::Value::Null; lines.len()];
    let mut pending: Vec<usize> = (0..lines.len()).collect();
    let reroute = crate::routing::Reroute::start();
    loop {
        let routed_at = state.cluster.state().map_version();
        let answered = bulk_round(&state, &coll, &lines, &pending, &headers, &path, params.durability).await?;
        let mut misrouted = Vec::new();
        let mut last_written: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
        for (&i, answer) in pending.iter().zip(answered) {
            if !relayed && answer.get("error").and_then(serde_json::Value::as_str) == Some("not_my_partition") {
                misrouted.push(i);
            } else if let Some(key) = lines[i].key.as_deref() {
                last_written.insert(key, i);
            }
            answers[i] = answer;
        }
        misrouted.retain(|&i| lines[i].key.as_deref().and_then(|k| last_written.get(k)).is_none_or(|&w| w < i));
        if misrouted.is_empty() {
            break;
        }
        if !reroute.again(&state.cluster, routed_at).await {
            break;
        }
        pending = misrouted;
    }
    if !relayed {
        // A line still refused as misrouted was applied nowhere (the wait is over, or a
        // later line of its key was written): never `not_my_partition` to a client.
        let e = crate::routing::unsettled();
        for answer in &mut answers {
            if answer.get("error").and_then(serde_json::Value::as_str) == Some("not_my_partition") {
                *answer = serde_json::json!({"error": e.code, "reason": e.reason});
            }
        }
    }
    let mut out = Vec::with_capacity(answers.len() * 96);
    for (mut line, slot) in answers.into_iter().zip(lines) {
        if let (Some(key), Some(obj)) = (slot.key, line.as_object_mut()) {
            obj.entry("key").or_insert(serde_json::Value::String(key));
        }
        out.extend_from_slice(line.to_string().as_bytes());
        out.push(b'\n');
    }
    Ok((StatusCode::OK, [(header::CONTENT_TYPE, "application/x-ndjson")], out).into_response())
}

/// One round of a `_bulk`: writes the lines at positions `at` where the map says (here, or
/// one call per other member) and answers each line's result in `at`'s order.
async fn bulk_round(
    state: &AppState,
    coll: &Arc<Collection>,
    lines: &[BulkSlot],
    at: &[usize],
    headers: &HeaderMap,
    path: &str,
    durability: Durability,
) -> Result<Vec<serde_json::Value>, ApiError> {
    let places = spread::place(state, headers, at.iter().map(|&i| lines[i].parsed.as_ref().ok().and(lines[i].key.as_deref()))).await;
    let groups = spread::remote_groups(&places);
    let calls = groups
        .iter()
        .map(|(address, group)| {
            let mut part = Vec::new();
            for &j in group {
                part.extend_from_slice(&lines[at[j]].line);
                part.push(b'\n');
            }
            (address.clone(), part)
        })
        .collect();
    let mut answers: Vec<Option<serde_json::Value>> = Vec::with_capacity(at.len());
    let mut local_at = Vec::new();
    for (j, (&i, place)) in at.iter().zip(places).enumerate() {
        answers.push(match (&lines[i].parsed, place) {
            (Err(e), _) => Some(e.to_json()),
            (Ok(_), spread::Place::Refused(e)) => Some(e.to_json()),
            (Ok(_), spread::Place::Remote(_)) => None,
            (Ok(_), spread::Place::Local) => {
                local_at.push(j);
                None
            }
        });
    }
    let partition_of = |j: usize| match &lines[at[j]].parsed {
        Ok(req) => shoal_storage::partition_of(&req.key, coll.partition_count()),
        Err(_) => 0,
    };
    // A majority level is refused per partition before anything of it is written.
    let level = durability.majority();
    if level.is_some() {
        let parts: std::collections::BTreeSet<u16> = local_at.iter().map(|&j| partition_of(j)).collect();
        let checks =
            futures::future::join_all(parts.into_iter().map(|p| async move { (p, state.cluster.majority_possible(coll.id(), p).await) }));
        let refused: std::collections::HashMap<u16, ApiError> =
            checks.await.into_iter().filter_map(|(p, r)| r.err().map(|e| (p, majority_error(e)))).collect();
        local_at.retain(|&j| match refused.get(&partition_of(j)) {
            Some(e) => {
                answers[j] = Some(e.to_json());
                false
            }
            None => true,
        });
    }
    let requests: Vec<WriteRequest> = local_at.iter().filter_map(|&j| lines[at[j]].parsed.as_ref().ok().cloned()).collect();
    let writer = Arc::clone(coll);
    let local = async move {
        let (outcomes, wait) = tokio::task::spawn_blocking(move || writer.write_many(requests))
            .await
            .map_err(|e| ApiError::internal(format!("bulk writer failed: {e}")))?;
        let durable = if durability.fsync_here() { wait.wait().await.map_err(ApiError::from) } else { Ok(()) };
        Ok::<_, ApiError>((outcomes, durable))
    };
    let (remote, local) = tokio::join!(spread::call_all(state, path, state.cluster.state().map_version(), headers, calls), local);
    let (outcomes, durable) = local?;
    let mut local_answers: Vec<Result<serde_json::Value, ApiError>> = outcomes
        .iter()
        .map(|outcome| match (outcome, &durable) {
            (Ok(outcome), Ok(())) => Ok(mutation_json(outcome)),
            (Ok(_), Err(e)) => Err(e.clone()),
            (Err(e), _) => Err(ApiError::from(e)),
        })
        .collect();
    if let (Some(level), Ok(())) = (level, &durable) {
        let parts: Vec<u16> = local_at.iter().map(|&j| partition_of(j)).collect();
        bulk_majority(state, coll, &parts, &outcomes, &mut local_answers, level).await;
    }
    for (j, answer) in local_at.into_iter().zip(local_answers) {
        answers[j] = Some(answer.unwrap_or_else(|e| e.to_json()));
    }
    for (group, answer) in groups.values().zip(remote) {
        let back = answer.map_err(|failed| failed.error).and_then(|bytes| {
            let back: Vec<serde_json::Value> =
                bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()).filter_map(|l| serde_json::from_slice(l).ok()).collect();
            if back.len() != group.len() {
                // It may have written them: say so.
                let mut e = ApiError::unavailable(format!("a member answered {} of {} _bulk lines", back.len(), group.len()));
                e.details.push(("ambiguous", serde_json::Value::Bool(true)));
                return Err(e);
            }
            Ok(back)
        });
        match back {
            Ok(back) => {
                for (&j, line) in group.iter().zip(back) {
                    answers[j] = Some(line);
                }
            }
            Err(e) => {
                for &j in group {
                    answers[j] = Some(e.to_json());
                }
            }
        }
    }
    Ok(answers.into_iter().map(Option::unwrap_or_default).collect())
}

/// A `_bulk`'s majority level for the lines written here, as `write_durably` does for one
/// document: per partition, one wait for the highest seqno written (a replica applies in
/// order), and one confirmation for the lines whose condition failed. A partition that
/// does not confirm turns its lines' answers into errors: ambiguous for the written ones.
async fn bulk_majority(
    state: &AppState,
    coll: &Arc<Collection>,
    parts: &[u16],
    outcomes: &[Result<MutationOutcome, shoal_storage::WriteError>],
    answers: &mut [Result<serde_json::Value, ApiError>],
    level: shoal_node::Durable,
) {
    let mut written: std::collections::BTreeMap<u16, (u64, u64)> = std::collections::BTreeMap::new();
    for o in outcomes.iter().flatten() {
        let e = written.entry(o.partition).or_insert((o.seqno, o.uuid));
        *e = (e.0.max(o.seqno), o.uuid);
    }
    let observed: std::collections::BTreeSet<u16> =
        parts.iter().zip(answers.iter()).filter(|(_, a)| a.as_ref().is_err_and(is_observation)).map(|(&p, _)| p).collect();
    let waits = futures::future::join_all(
        written.iter().map(|(&p, &(seqno, uuid))| async move { (p, state.cluster.await_majority(coll.id(), p, seqno, uuid, level).await) }),
    );
    let confirms = futures::future::join_all(observed.iter().map(|&p| async move { (p, state.cluster.confirm(coll, p).await) }));
    let (waits, confirms) = tokio::join!(waits, confirms);
    let unconfirmed: std::collections::HashMap<u16, shoal_node::MajorityError> =
        waits.into_iter().filter_map(|(p, r)| r.err().map(|e| (p, e))).collect();
    let unobserved: std::collections::HashMap<u16, ApiError> =
        confirms.into_iter().filter_map(|(p, r)| r.err().map(|e| (p, majority_error(e)))).collect();
    for (p, a) in parts.iter().zip(answers.iter_mut()) {
        let replaced = match a {
            Ok(_) => unconfirmed.get(p).map(unconfirmed_write),
            Err(e) if is_observation(e) => unobserved.get(p).cloned(),
            Err(_) => None,
        };
        if let Some(e) = replaced {
            *a = Err(e);
        }
    }
}

/// One line of a `_bulk`: its key (when it has one), its text (to pass on to another
/// member) and what parsing it gave.
struct BulkSlot {
    key: Option<String>,
    line: Bytes,
    parsed: Result<WriteRequest, ApiError>,
}

type BulkLineError = (Option<String>, ApiError);

fn parse_bulk_line(body: &Bytes, line: &[u8], now_secs: u64) -> Result<(String, WriteRequest), BulkLineError> {
    let parsed: BulkLine = serde_json::from_slice(line).map_err(|e| (None, ApiError::invalid_json(format!("bad NDJSON line: {e}"))))?;
    let key = parsed.key.clone();
    let fail = |e: ApiError| (Some(key.clone()), e);
    if key.is_empty() || key.len() > shoal_storage::KEY_MAX_BYTES {
        return Err(fail(ApiError::invalid_key("a key has 1 to 250 bytes")));
    }
    let op = match parsed.op {
        BulkOp::Upsert => WriteOp::Upsert,
        BulkOp::Insert => WriteOp::Insert,
        BulkOp::Replace => WriteOp::Replace,
        BulkOp::Remove => WriteOp::Remove,
    };
    let value = match (op, parsed.value) {
        (WriteOp::Remove, Some(_)) => return Err(fail(ApiError::bad_request("a remove takes no value"))),
        (WriteOp::Remove, None) => None,
        (_, None) => return Err(fail(ApiError::bad_request("this op needs a value"))),
        (_, Some(raw)) => {
            let text = raw.get().as_bytes();
            if text.len() > DOC_MAX_BYTES {
                return Err(fail(ApiError::too_large("document larger than 20 MiB")));
            }
            // The same rules as a single put (number range, depth), which RawValue skips.
            shoal_json::validate(text).map_err(|e| fail(ApiError::invalid_json(e.to_string())))?;
            // Zero-copy: the value is a slice of the request body.
            let start = text.as_ptr() as usize - body.as_ptr() as usize;
            Some(body.slice(start..start + text.len()))
        }
    };
    let cas = match parsed.cas {
        None => None,
        Some(CasField::Number(n)) if n > 0 => Some(n),
        Some(CasField::Number(_)) => return Err(fail(ApiError::bad_request("cas must be positive"))),
        Some(CasField::Text(t)) => Some(extract::parse_cas(&t).map_err(fail)?),
    };
    let expiry = extract::expiry(parsed.expiry, now_secs).map_err(fail)?;
    Ok((key.clone(), WriteRequest { key: Bytes::from(key), op, value, cas, expiry }))
}
