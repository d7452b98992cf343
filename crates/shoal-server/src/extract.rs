//! Pulling typed, validated input out of requests, with API errors for anything malformed.
//! Handlers parse their own path, query, headers and body so that every rejection carries
//! an API.md error code (axum's own rejections would not).

use axum::body::Body;
use axum::http::{HeaderMap, Uri};
use serde::de::DeserializeOwned;
use shoal_storage::Cas;

use crate::error::ApiError;

/// The `index`-th segment of the request path (0 = `v1`), percent-decoded.
/// `what` names the segment in errors; keys get `invalid_key`, others `bad_request`.
pub fn path_segment(uri: &Uri, index: usize, what: &str) -> Result<String, ApiError> {
    let raw = uri.path().trim_start_matches('/').split('/').nth(index).unwrap_or("");
    if !raw.contains('%') {
        // Nothing to decode (the usual case; the decoder looks at each byte in turn).
        return Ok(raw.to_string());
    }
    percent_encoding::percent_decode_str(raw).decode_utf8().map(std::borrow::Cow::into_owned).map_err(|_| {
        let reason = format!("the {what} is not valid UTF-8");
        if what == "key" {
            ApiError::invalid_key(reason)
        } else {
            ApiError::bad_request(reason)
        }
    })
}

pub fn collection_name(uri: &Uri) -> Result<String, ApiError> {
    path_segment(uri, 2, "collection name")
}

pub fn doc_key(uri: &Uri) -> Result<String, ApiError> {
    let key = path_segment(uri, 4, "key")?;
    if key.is_empty() {
        return Err(ApiError::invalid_key("key is empty"));
    }
    if key.len() > shoal_storage::KEY_MAX_BYTES {
        return Err(ApiError::invalid_key(format!("key is {} bytes; at most {} are allowed", key.len(), shoal_storage::KEY_MAX_BYTES)));
    }
    Ok(key)
}

/// Parses the query string into `T`, whose fields are the parameters the endpoint knows;
/// `T` denies unknown fields, so an unknown parameter is a `bad_request`.
pub fn query<T: DeserializeOwned + Default>(raw: Option<&str>) -> Result<T, ApiError> {
    match raw {
        None | Some("") => serde_urlencoded::from_str("").map_err(|e| ApiError::bad_request(format!("query: {e}"))),
        Some(q) => serde_urlencoded::from_str(q).map_err(|e| ApiError::bad_request(format!("query parameters: {e}"))),
    }
}

/// For endpoints that take no query parameters: any parameter is a `bad_request`.
pub fn no_params(raw: Option<&str>) -> Result<(), ApiError> {
    #[derive(Debug, Default, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct NoParams {}
    query::<NoParams>(raw).map(|_| ())
}

/// The `consistency` of a scan or query: `not_bounded` (the default) or `request_plus`.
pub fn consistency(value: Option<&str>) -> Result<shoal_index::Consistency, ApiError> {
    match value {
        None | Some("not_bounded") => Ok(shoal_index::Consistency::NotBounded),
        Some("request_plus") => Ok(shoal_index::Consistency::RequestPlus),
        Some(other) => Err(ApiError::bad_request(format!("consistency is not_bounded or request_plus, not {other:?}"))),
    }
}

/// Bytes per second a request body must keep up, on average, once its first
/// [`crate::BodyTimeouts::base`] has passed: each such many bytes received extend the
/// deadline by a second (Apache's `mod_reqtimeout` rule, `body=20,MinRate=500`).
pub const BODY_MIN_BYTES_PER_SEC: usize = 500;

/// Reads the whole body, refusing more than `limit` bytes (declared or sent) with
/// `too_large` and a body that arrives too slowly (see [`BODY_MIN_BYTES_PER_SEC`]) with `timeout`.
pub async fn body(state: &crate::AppState, body: Body, limit: usize) -> Result<bytes::Bytes, ApiError> {
    // A body whose declared length is over the limit is refused before any of it is awaited
    // (as nginx does): waiting for its first bytes held the answer until the body timeout.
    let declared = http_body::Body::size_hint(&body).lower();
    if declared > limit as u64 {
        return Err(ApiError::body_too_large(format!("the body is larger than {limit} bytes ({declared} declared)")));
    }
    let mut stream = body.into_data_stream();
    let started = tokio::time::Instant::now();
    let mut deadline = started + state.body_timeout;
    let mut chunks: Vec<bytes::Bytes> = Vec::new();
    let mut len = 0usize;
    loop {
        // The deadline grows with the bytes received, but no wait for the next chunk is longer
        // than the first deadline: a fast start must not buy hours of silence (19 MiB at once
        // would otherwise hold the request, and its memory, for 11 hours).
        let wait_until = deadline.min(tokio::time::Instant::now() + state.body_timeout);
        let next = tokio::time::timeout_at(wait_until, futures::StreamExt::next(&mut stream)).await.map_err(|_| {
            ApiError::body_timeout(format!(
                "the request body did not arrive in time ({len} bytes in {} s; keep up at least {BODY_MIN_BYTES_PER_SEC} bytes/s and pause no longer than {} s)",
                started.elapsed().as_secs(),
                state.body_timeout.as_secs()
            ))
        })?;
        match next {
            None => break,
            Some(Ok(chunk)) => {
                len += chunk.len();
                if len > limit {
                    return Err(ApiError::body_too_large(format!("the body is larger than {limit} bytes")));
                }
                deadline += std::time::Duration::from_secs_f64(chunk.len() as f64 / BODY_MIN_BYTES_PER_SEC as f64);
                chunks.push(chunk);
            }
            Some(Err(e)) => return Err(ApiError::bad_request(format!("could not read the body: {e}"))),
        }
    }
    Ok(match chunks.len() {
        0 => bytes::Bytes::new(),
        1 => chunks.pop().unwrap_or_default(),
        _ => {
            let mut all = bytes::BytesMut::with_capacity(len);
            for c in chunks {
                all.extend_from_slice(&c);
            }
            all.freeze()
        }
    })
}

/// What an `If-Match` / `If-None-Match` pair asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precondition {
    None,
    /// `If-None-Match: *`
    MustNotExist,
    /// `If-Match: *`
    MustExist,
    /// `If-Match: "<cas>"`
    Cas(Cas),
}

pub fn precondition(headers: &HeaderMap) -> Result<Precondition, ApiError> {
    let if_match = header_str(headers, "if-match")?;
    let if_none_match = header_str(headers, "if-none-match")?;
    match (if_match, if_none_match) {
        (Some(_), Some(_)) => Err(ApiError::bad_request("give If-Match or If-None-Match, not both")),
        (None, Some("*")) => Ok(Precondition::MustNotExist),
        (None, Some(other)) => Err(ApiError::bad_request(format!("If-None-Match supports only *, not {other:?}"))),
        (Some("*"), None) => Ok(Precondition::MustExist),
        (Some(tag), None) => Ok(Precondition::Cas(parse_etag(tag)?)),
        (None, None) => Ok(Precondition::None),
    }
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Result<Option<&'a str>, ApiError> {
    match headers.get(name) {
        None => Ok(None),
        Some(v) => v.to_str().map(|s| Some(s.trim())).map_err(|_| ApiError::bad_request(format!("the {name} header is not ASCII"))),
    }
}

/// `"<cas>"` (quotes optional, as some clients drop them) → CAS.
pub fn parse_etag(tag: &str) -> Result<Cas, ApiError> {
    let inner = tag.strip_prefix("W/").unwrap_or(tag);
    let inner = inner.strip_prefix('"').and_then(|t| t.strip_suffix('"')).unwrap_or(inner);
    parse_cas(inner).map_err(|_| ApiError::bad_request(format!("malformed If-Match {tag:?}: expected \"<cas>\" as given in ETag")))
}

pub fn parse_cas(text: &str) -> Result<Cas, ApiError> {
    match text.parse::<u64>() {
        Ok(0) | Err(_) => Err(ApiError::bad_request(format!("malformed CAS {text:?}: a positive 64-bit decimal number"))),
        Ok(cas) => Ok(cas),
    }
}

/// A query or body expiry in seconds → absolute Unix seconds (Couchbase's rule), relative
/// to `now_secs` (the store's clock).
pub fn expiry(secs: Option<i64>, now_secs: u64) -> Result<u32, ApiError> {
    let Some(secs) = secs else { return Ok(0) };
    let absurd = || {
        ApiError::bad_request(format!(
            "expiry {secs} is out of range: 0 (never), up to 2592000 seconds (relative), or a future Unix time before 2106"
        ))
    };
    let secs = u64::try_from(secs).map_err(|_| absurd())?;
    shoal_storage::absolute_expiry(secs, now_secs).ok_or_else(absurd)
}

/// `?durability=none|persist|majority|persist_majority`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Durability {
    #[default]
    None,
    Persist,
    /// In memory on a majority of the partition's copies.
    Majority,
    /// Fsynced on a majority of the partition's copies.
    PersistMajority,
}

impl Durability {
    /// The majority level this asks for, if any.
    pub fn majority(self) -> Option<shoal_node::Durable> {
        match self {
            Durability::Majority => Some(shoal_node::Durable::Majority),
            Durability::PersistMajority => Some(shoal_node::Durable::PersistMajority),
            Durability::None | Durability::Persist => None,
        }
    }

    /// Whether this node fsyncs the write before answering.
    pub fn fsync_here(self) -> bool {
        matches!(self, Durability::Persist | Durability::PersistMajority)
    }
}

/// `?consistency=local|majority` on reads: `majority` answers only what a majority of the
/// partition's copies hold, confirmed by them after the read (a linearizable read).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Consistency {
    #[default]
    Local,
    Majority,
}

/// Parses a JSON body into `T`, mapping errors to `invalid_json`.
/// One pass: serde_json's own errors tell malformed JSON (`invalid_json`) from JSON of the
/// wrong shape (`bad_request`).
pub fn json_body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid_json("empty body: expected a JSON object"));
    }
    serde_json::from_slice(bytes).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => ApiError::bad_request(format!("unexpected body: {e}")),
        _ => ApiError::invalid_json(e.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etags() {
        assert_eq!(parse_etag("\"42\"").unwrap(), 42);
        assert_eq!(parse_etag("42").unwrap(), 42);
        for bad in ["\"\"", "\"-1\"", "\"abc\"", "\"18446744073709551616\"", "\"0\""] {
            assert!(parse_etag(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn expiries() {
        let now = 1_700_000_000;
        assert_eq!(expiry(None, now).unwrap(), 0);
        assert!(expiry(Some(-1), now).is_err());
        assert!(expiry(Some(i64::MAX), now).is_err());
        assert_eq!(expiry(Some(10), now).unwrap(), 1_700_000_010);
    }

    #[test]
    fn segments_decode() {
        let uri: Uri = "/v1/collections/c/docs/a%20b".parse().unwrap();
        assert_eq!(doc_key(&uri).unwrap(), "a b");
        let uri: Uri = "/v1/collections/c/docs/%FF".parse().unwrap();
        assert_eq!(doc_key(&uri).unwrap_err().code, "invalid_key");
    }
}
