//! Sub-document lookups and mutations over HTTP.
//!
//! A request's document is parsed once and every spec answered from that tree; the
//! parsed tree of a large document is kept in [`ParsedDocs`] (keyed by its CAS, so a
//! change makes the entry stale) so that hot large documents are not parsed per request.
//! Parsing and answering a large document runs on a CPU pool, never on the threads that
//! do network I/O for every connection.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{RawQuery, State};
use axum::http::{StatusCode, Uri};
use axum::response::Response;
use bytes::Bytes;
use serde::Deserialize;
use serde_json::Value;
use shoal_json::subdoc::{self, LookupSpec, MutateSpec, SUBDOC_SPECS_MAX};
use shoal_storage::{Cas, Collection, Document, ReadError, SeqNo, WriteError, WriteOp, WriteRequest, DOC_MAX_BYTES};

use crate::docs::{check_answer_size, collection, json_response, mutation_json, write_durably};
use crate::error::ApiError;
use crate::extract::{self, Durability};
use crate::AppState;

/// Largest body of a lookup or mutate request.
const SUBDOC_BODY_MAX_BYTES: usize = 21 * 1024 * 1024;
/// Documents at least this large have their parsed trees cached (misses parse on the CPU
/// pool). Measured: a 3 KB document parsed per request halves lookup throughput.
const PARSED_CACHE_MIN_DOC_BYTES: usize = 1024;
/// Memory the parsed-tree cache may use (estimated as 8× the document's bytes).
const PARSED_CACHE_MAX_BYTES: u64 = 256 * 1024 * 1024;
const PARSED_BYTES_PER_DOC_BYTE: u64 = 8;
/// Times a mutate retries when the document changed between its read and its write.
const MUTATE_RETRIES_MAX: usize = 32;

/// Collection id (never reused: a dropped and re-created collection has a new one) and key.
type CacheKey = (u32, String);

#[derive(Clone)]
struct Weigh;

/// A parsed tree and what it was parsed from.
#[derive(Clone)]
struct Parsed {
    cas: Cas,
    expiry: u32,
    /// The partition's high seqno read before the document was.
    watermark: SeqNo,
    tree: Arc<Value>,
    weight: u64,
}

impl quick_cache::Weighter<CacheKey, Parsed> for Weigh {
    fn weight(&self, _: &CacheKey, v: &Parsed) -> u64 {
        v.weight.max(1)
    }
}

/// Parsed trees of recently used large documents.
pub struct ParsedDocs {
    cache: quick_cache::sync::Cache<CacheKey, Parsed, Weigh>,
}

impl Default for ParsedDocs {
    fn default() -> Self {
        let estimated_items = (PARSED_CACHE_MAX_BYTES / (PARSED_CACHE_MIN_DOC_BYTES as u64 * PARSED_BYTES_PER_DOC_BYTE)) as usize;
        ParsedDocs { cache: quick_cache::sync::Cache::with_weighter(estimated_items.max(16), PARSED_CACHE_MAX_BYTES, Weigh) }
    }
}

impl ParsedDocs {
    /// The cached tree and CAS of `key` if nothing in its partition changed since it was
    /// parsed: then the document need not even be read.
    fn get_unchanged(&self, coll: &Collection, key: &str) -> Option<(Cas, Arc<Value>)> {
        let hit = self.cache.get(&(coll.id(), key.to_string()))?;
        let (watermark, locks) = coll.change_watermark(key);
        let live = hit.expiry == 0 || u64::from(hit.expiry) > coll.now_secs();
        (watermark == hit.watermark && !locks && live).then_some((hit.cas, hit.tree))
    }
}

fn parse_doc(bytes: &[u8]) -> Result<Value, ApiError> {
    // Stored documents were validated on the way in; a failure here is a stored non-JSON body.
    serde_json::from_slice(bytes).map_err(|e| path_failure(0, subdoc::Status::DocNotJson, &e.to_string()))
}

/// The parsed tree of `doc`: from the cache, or parsed (on the CPU pool if large).
/// `watermark` is the partition's high seqno read before `doc` was.
async fn tree(state: &AppState, coll: &Collection, key: &str, doc: &Document, watermark: SeqNo) -> Result<Arc<Value>, ApiError> {
    if doc.value.len() < PARSED_CACHE_MIN_DOC_BYTES {
        return Ok(Arc::new(parse_doc(&doc.value)?));
    }
    let cache_key = (coll.id(), key.to_string());
    // Single flight: when many requests miss at once, one parses and the others wait for it.
    // A stale entry (older CAS) is removed first, so that a changed document is parsed
    // once too, not by every waiting request.
    let mut guard = None;
    for _ in 0..3 {
        match state.parsed.cache.get_value_or_guard_async(&cache_key).await {
            Ok(hit) if hit.cas == doc.cas => {
                metrics::counter!("shoal_subdoc_parsed_cache_total", "result" => "hit").increment(1);
                return Ok(hit.tree);
            }
            Ok(stale) => {
                state.parsed.cache.remove_if(&cache_key, |v| v.cas == stale.cas);
            }
            Err(g) => {
                guard = Some(g);
                break;
            }
        }
    }
    metrics::counter!("shoal_subdoc_parsed_cache_total", "result" => "miss").increment(1);
    let bytes = doc.value.clone();
    let tree = Arc::new(state.cpu.run(move || parse_doc(&bytes)).await??);
    let entry = Parsed {
        cas: doc.cas,
        expiry: doc.expiry,
        watermark,
        tree: Arc::clone(&tree),
        weight: doc.value.len() as u64 * PARSED_BYTES_PER_DOC_BYTE,
    };
    match guard {
        Some(guard) => {
            let _ = guard.insert(entry);
        }
        None => state.parsed.cache.insert(cache_key, entry),
    }
    Ok(tree)
}

fn path_failure(index: usize, status: subdoc::Status, reason: &str) -> ApiError {
    let mut e = ApiError::new(StatusCode::BAD_REQUEST, "path_failure", format!("spec {index}: {} {reason}", status.as_str()));
    e.details = vec![("index", Value::from(index)), ("status", Value::from(status.as_str()))];
    e
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LookupBody {
    specs: Vec<LookupSpec>,
}

fn check_specs<T>(specs: &[T]) -> Result<(), ApiError> {
    if specs.is_empty() {
        return Err(ApiError::bad_request("give at least one spec"));
    }
    if specs.len() > SUBDOC_SPECS_MAX {
        return Err(ApiError::too_large(format!("at most {SUBDOC_SPECS_MAX} specs per request")));
    }
    Ok(())
}

/// The collection, key and parsed body of a sub-document request.
async fn read_request<T: serde::de::DeserializeOwned>(
    state: &AppState,
    uri: &Uri,
    query: Option<&str>,
    body: Body,
) -> Result<(Arc<Collection>, String, T), ApiError> {
    extract::no_params(query)?;
    let coll = collection(state, uri)?;
    let key = extract::doc_key(uri)?;
    let body = extract::body(state, body, SUBDOC_BODY_MAX_BYTES).await?;
    Ok((coll, key, extract::json_body(&body)?))
}

pub async fn lookup(State(state): State<AppState>, uri: Uri, RawQuery(q): RawQuery, body: Body) -> Result<Response, ApiError> {
    let (coll, key, request): (_, _, LookupBody) = read_request(&state, &uri, q.as_deref(), body).await?;
    check_specs(&request.specs)?;
    let (cas, tree, large) = match state.parsed.get_unchanged(&coll, &key) {
        Some((cas, tree)) => {
            metrics::counter!("shoal_subdoc_parsed_cache_total", "result" => "unchanged").increment(1);
            // Only large documents are cached: their answers are built on the low-priority
            // pool too, so that a flood of them yields the cores to cheap requests.
            (cas, tree, true)
        }
        None => {
            let (watermark, _) = coll.change_watermark(&key);
            let doc = coll.get(&key)?;
            let tree = tree(&state, &coll, &key, &doc, watermark).await?;
            (doc.cas, tree, tree_is_large(&doc))
        }
    };
    // Written straight into the response bytes: found values are serialised from the tree,
    // never copied into intermediate values.
    let answer = move || {
        let mut out = Vec::with_capacity(64 + 48 * request.specs.len());
        out.extend_from_slice(format!("{{\"cas\":\"{cas}\",\"results\":[").as_bytes());
        for (i, result) in subdoc::lookup(&tree, &request.specs).into_iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            match result {
                Ok(subdoc::Found::Value(v)) => {
                    out.extend_from_slice(b"{\"status\":\"ok\",\"value\":");
                    // Serialising a tree that came from valid JSON cannot fail.
                    let _ = serde_json::to_writer(&mut out, v);
                    out.push(b'}');
                }
                Ok(subdoc::Found::Count(n)) => out.extend_from_slice(format!("{{\"status\":\"ok\",\"value\":{n}}}").as_bytes()),
                Ok(subdoc::Found::Exists) => out.extend_from_slice(b"{\"status\":\"ok\"}"),
                Err(s) => out.extend_from_slice(format!("{{\"status\":\"{}\"}}", s.as_str()).as_bytes()),
            }
            check_answer_size(out.len(), "ask for fewer or smaller paths")?;
        }
        out.extend_from_slice(b"]}");
        Ok::<_, ApiError>(out)
    };
    let out = if large { state.cpu.run(answer).await?? } else { answer()? };
    Ok(json_response(StatusCode::OK, out))
}

fn tree_is_large(doc: &Document) -> bool {
    doc.value.len() >= PARSED_CACHE_MIN_DOC_BYTES
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum Store {
    #[default]
    Replace,
    Upsert,
    Insert,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MutateBody {
    specs: Vec<MutateSpec>,
    #[serde(default)]
    store: Store,
    cas: Option<String>,
    expiry: Option<i64>,
    #[serde(default)]
    durability: Durability,
}

pub async fn mutate(State(state): State<AppState>, uri: Uri, RawQuery(q): RawQuery, body: Body) -> Result<Response, ApiError> {
    let (coll, key, request): (_, _, MutateBody) = read_request(&state, &uri, q.as_deref(), body).await?;
    check_specs(&request.specs)?;
    let want_cas = request.cas.as_deref().map(extract::parse_cas).transpose()?;
    let expiry = request.expiry.map(|e| extract::expiry(Some(e), coll.now_secs())).transpose()?;
    let specs = Arc::new(request.specs);
    for _ in 0..MUTATE_RETRIES_MAX {
        let (watermark, _) = coll.change_watermark(&key);
        let current = match coll.get(&key) {
            Ok(doc) => Some(doc),
            Err(ReadError::NotFound) => None,
            Err(e) => return Err(e.into()),
        };
        match (&current, request.store) {
            (None, Store::Replace) => return Err(ReadError::NotFound.into()),
            (Some(_), Store::Insert) => return Err(WriteError::Exists.into()),
            (None, _) if want_cas.is_some() => return Err(ReadError::NotFound.into()),
            _ => {}
        }
        let base = match &current {
            Some(doc) => tree(&state, &coll, &key, doc, watermark).await?,
            None => Arc::new(Value::Object(serde_json::Map::new())),
        };
        let specs2 = Arc::clone(&specs);
        let apply = move || -> Result<(Vec<Option<Value>>, Vec<u8>), ApiError> {
            let mut doc = Arc::unwrap_or_clone(base);
            let results = subdoc::mutate(&mut doc, &specs2).map_err(|(i, s)| path_failure(i, s, ""))?;
            let bytes = serde_json::to_vec(&doc).map_err(|e| ApiError::internal(e.to_string()))?;
            Ok((results, bytes))
        };
        let large = current.as_ref().is_some_and(tree_is_large);
        let (results, bytes) = if large { state.cpu.run(apply).await?? } else { apply()? };
        if bytes.len() > DOC_MAX_BYTES {
            return Err(ApiError::too_large("the mutated document would be larger than 20 MiB"));
        }
        let (op, cas) = match &current {
            Some(doc) => (WriteOp::Replace, Some(want_cas.unwrap_or(doc.cas))),
            None => (WriteOp::Insert, None),
        };
        let expiry = expiry.unwrap_or_else(|| current.as_ref().map_or(0, |d| d.expiry));
        let req = WriteRequest { key: Bytes::from(key.clone()), op, value: Some(Bytes::from(bytes)), cas, expiry };
        match write_durably(&state, &coll, req, request.durability).await {
            Ok(outcome) => {
                let results: Vec<Value> = results
                    .into_iter()
                    .map(|r| match r {
                        Some(v) => serde_json::json!({"status": "ok", "value": v}),
                        None => serde_json::json!({"status": "ok"}),
                    })
                    .collect();
                let mut out = mutation_json(&outcome);
                out["results"] = Value::Array(results);
                return Ok(json_response(StatusCode::OK, out.to_string().into_bytes()));
            }
            // Someone wrote in between: read again, unless the client pinned a CAS.
            Err(e) if want_cas.is_none() && matches!(e.code, "cas_mismatch" | "doc_exists") => continue,
            Err(e) => return Err(e),
        }
    }
    Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "the document kept changing; try again"))
}
