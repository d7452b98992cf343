//! API errors: the one place where storage and index errors become API.md codes and HTTP statuses.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use shoal_index::IndexError;
use shoal_meta::MetaReject;
use shoal_node::ClusterError;
use shoal_storage::{CatalogError, ChangesError, CollectionError, ReadError, WriteError};

/// An error as clients see it: `{"error": CODE, "reason": "..."}` with an HTTP status.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub reason: String,
    /// Further members of the error object (`index` and `status` of a `path_failure`).
    pub details: Vec<(&'static str, serde_json::Value)>,
    /// The request body was left unread: the connection closes after this answer.
    pub close_connection: bool,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, reason: impl Into<String>) -> Self {
        ApiError { status, code, reason: reason.into(), details: Vec::new(), close_connection: false }
    }
    pub fn bad_request(reason: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", reason)
    }
    pub fn invalid_key(reason: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_key", reason)
    }
    pub fn invalid_json(reason: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_json", reason)
    }
    pub fn too_large(reason: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "too_large", reason)
    }
    /// A request body that did not arrive in time: the rest of it is not read.
    pub fn body_timeout(reason: impl Into<String>) -> Self {
        ApiError { close_connection: true, ..Self::new(StatusCode::REQUEST_TIMEOUT, "timeout", reason) }
    }
    /// A request body over its limit: the rest of it is not read.
    pub fn body_too_large(reason: impl Into<String>) -> Self {
        ApiError { close_connection: true, ..Self::too_large(reason) }
    }

    pub fn collection_not_found(name: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, "collection_not_found", format!("collection {name:?} does not exist"))
    }
    pub fn internal(reason: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", reason)
    }
    /// Stored data failed a check (a checksum, a header): damaged, not absent.
    pub fn corrupt(reason: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "corrupt", reason)
    }
    /// The node cannot do this now (busy, read-only, a storage fault); retrying later or
    /// elsewhere may work.
    /// A partition this node does not hold as the request needs (Couchbase's
    /// NOT_MY_VBUCKET): the client refreshes its partition map if older than `map_version`.
    pub fn not_my_partition(n: &shoal_storage::NotMine, reason: impl Into<String>) -> Self {
        let mut e = ApiError::new(StatusCode::MISDIRECTED_REQUEST, "not_my_partition", reason);
        e.details.push(("partition", serde_json::Value::from(n.partition)));
        e.details.push(("map_version", serde_json::Value::from(n.map_version)));
        e
    }

    pub fn unavailable(reason: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", reason)
    }
    pub fn insufficient_storage(reason: impl Into<String>) -> Self {
        Self::new(StatusCode::INSUFFICIENT_STORAGE, "insufficient_storage", reason)
    }
    /// An error of the storage engine: corruption, or a fault of the disk under it.
    fn engine(e: &fjall::Error, reason: String) -> Self {
        if shoal_storage::is_corruption(e) {
            ApiError::corrupt(reason)
        } else {
            ApiError::unavailable(reason)
        }
    }

    /// The error another member answered (`{"error", "reason", ...}` with `status`), to be
    /// passed on to the client as if this node had met it.
    pub fn from_answer(status: StatusCode, body: &[u8]) -> Self {
        let parsed: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
        let code = parsed["error"].as_str().and_then(|c| KNOWN_CODES.iter().find(|k| **k == c).copied()).unwrap_or("unavailable");
        let reason = parsed["reason"].as_str().map_or_else(|| format!("another member answered {status}"), str::to_string);
        let mut e = ApiError::new(status, code, reason);
        if let Some(obj) = parsed.as_object() {
            for (k, v) in obj {
                if let Some(name) = KNOWN_DETAILS.iter().find(|d| **d == k.as_str()) {
                    e.details.push((name, v.clone()));
                }
            }
        }
        e
    }

    /// The error as a JSON object, for answers that carry errors inline (`_get`, `_bulk`).
    /// Files of the node's data paths are not named in it (see [`hide_paths_under`]).
    pub fn to_json(&self) -> serde_json::Value {
        let mut out = serde_json::json!({"error": self.code, "reason": public_reason(&self.reason)});
        for (k, v) in &self.details {
            out[*k] = v.clone();
        }
        out
    }
}

/// The error codes of API.md, so that one passed on from another member keeps its code.
const KNOWN_CODES: &[&str] = &[
    "bad_request",
    "cas_mismatch",
    "collection_exists",
    "collection_not_found",
    "corrupt",
    "doc_exists",
    "doc_not_found",
    "durability_impossible",
    "forbidden",
    "index_exists",
    "index_not_found",
    "insufficient_storage",
    "internal",
    "invalid_json",
    "invalid_key",
    "locked",
    "node_not_found",
    "not_my_partition",
    "path_failure",
    "query_error",
    "rebalance_running",
    "timeout",
    "too_large",
    "too_many_requests",
    "unauthorized",
    "unavailable",
    "user_not_found",
];
/// Members of an error object passed on with it.
const KNOWN_DETAILS: &[&str] = &["ambiguous", "partition", "map_version", "node", "index", "status"];

/// The roots whose files error answers never name: the node's data paths (and so the spill
/// folder, the index databases and the analytics shadow under them). Storage, index and
/// shadow errors carry their file for the log; the answer says only that a file of the node
/// failed. Kept process-wide because errors are built far from the server's state.
static PRIVATE_ROOTS: std::sync::RwLock<Vec<String>> = std::sync::RwLock::new(Vec::new());

/// What an answer says in place of a file of a data path.
const HIDDEN_PATH: &str = "<a file of the node's data path>";

/// Registers `root` so that error answers never name it or a file under it.
pub fn hide_paths_under(root: &std::path::Path) {
    let mut forms = vec![root.to_string_lossy().into_owned()];
    if let Ok(canonical) = root.canonicalize() {
        forms.push(canonical.to_string_lossy().into_owned());
    }
    let mut roots = PRIVATE_ROOTS.write().unwrap_or_else(std::sync::PoisonError::into_inner);
    for form in forms {
        let form = form.trim_end_matches('/');
        // "/" or "." would hide every path. A relative root ("shoal-data") is only matched
        // with its slash, so that a word of an answer that is no path is left alone.
        if matches!(form, "" | "." | "..") {
            continue;
        }
        let form = if form.starts_with('/') { form.to_string() } else { format!("{form}/") };
        if !roots.contains(&form) {
            roots.push(form);
        }
    }
    // Longest first, so that a root inside another is replaced whole.
    roots.sort_by_key(|r| std::cmp::Reverse(r.len()));
}

/// `reason` with every path under a registered root replaced by [`HIDDEN_PATH`]: the root and
/// the rest of its path, up to a space, quote, colon, comma or bracket.
pub(crate) fn public_reason(reason: &str) -> std::borrow::Cow<'_, str> {
    let roots = PRIVATE_ROOTS.read().unwrap_or_else(std::sync::PoisonError::into_inner);
    if !roots.iter().any(|r| reason.contains(r.as_str())) {
        return std::borrow::Cow::Borrowed(reason);
    }
    let mut out = reason.to_string();
    for root in roots.iter() {
        while let Some(at) = out.find(root.as_str()) {
            let rest = &out[at + root.len()..];
            let end = rest.find(|c: char| c.is_whitespace() || matches!(c, '"' | '\'' | ':' | ',' | ')' | ']' | '}')).unwrap_or(rest.len());
            out.replace_range(at..at + root.len() + end, HIDDEN_PATH);
        }
    }
    std::borrow::Cow::Owned(out)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        // Answers that say "not now" (503, 504) are the server working as designed; only the
        // others are faults worth an error line.
        match self.status {
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT => {
                tracing::warn!(code = self.code, reason = %self.reason, "request refused")
            }
            // The watchdog logs the disk filling up once; each refused write is no news.
            StatusCode::INSUFFICIENT_STORAGE => tracing::debug!(code = self.code, reason = %self.reason, "request refused"),
            s if s.is_server_error() => tracing::error!(code = self.code, reason = %self.reason, "request failed"),
            _ => {}
        }
        let body = serde_json::to_vec(&self.to_json()).unwrap_or_default();
        let mut response = (self.status, [(axum::http::header::CONTENT_TYPE, "application/json")], body).into_response();
        if self.close_connection {
            // The rest of the body was not read, so the server closes the connection after
            // this answer; saying so keeps clients from sending their next request on it.
            response.headers_mut().insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
        }
        response
    }
}

impl From<ReadError> for ApiError {
    fn from(e: ReadError) -> Self {
        let reason = e.to_string();
        match e {
            ReadError::NotFound => ApiError::new(StatusCode::NOT_FOUND, "doc_not_found", reason),
            ReadError::Locked => ApiError::new(StatusCode::LOCKED, "locked", reason),
            ReadError::InvalidKey(_) => ApiError::invalid_key(reason),
            ReadError::InvalidLockTime | ReadError::NoSuchPartition(_) => ApiError::bad_request(reason),
            ReadError::CollectionDropped => ApiError::new(StatusCode::NOT_FOUND, "collection_not_found", reason),
            ReadError::Busy => ApiError::unavailable(reason),
            ReadError::NotMyPartition(ref n) => ApiError::not_my_partition(n, reason),
            ReadError::Corrupt => ApiError::corrupt(reason),
            ReadError::Engine(ref inner) => ApiError::engine(inner, reason),
        }
    }
}

impl From<WriteError> for ApiError {
    fn from(e: WriteError) -> Self {
        ApiError::from(&e)
    }
}

impl From<&WriteError> for ApiError {
    fn from(e: &WriteError) -> Self {
        let reason = e.to_string();
        match e {
            WriteError::NotFound => ApiError::new(StatusCode::NOT_FOUND, "doc_not_found", reason),
            WriteError::Exists => ApiError::new(StatusCode::CONFLICT, "doc_exists", reason),
            WriteError::CasMismatch => ApiError::new(StatusCode::CONFLICT, "cas_mismatch", reason),
            WriteError::Locked => ApiError::new(StatusCode::LOCKED, "locked", reason),
            WriteError::NotLocked => ApiError::bad_request(reason),
            WriteError::InvalidKey(_) => ApiError::invalid_key(reason),
            WriteError::TooLarge => ApiError::too_large(reason),
            WriteError::MissingValue => ApiError::bad_request(reason),
            WriteError::CollectionDropped => ApiError::new(StatusCode::NOT_FOUND, "collection_not_found", reason),
            WriteError::NotDurable | WriteError::CommitFailed(_) | WriteError::ReadOnly(_) | WriteError::Busy | WriteError::Restarting => {
                ApiError::unavailable(reason)
            }
            WriteError::DiskFull => ApiError::insufficient_storage(reason),
            WriteError::NotMyPartition(n) => ApiError::not_my_partition(n, reason),
            // Only replication applies changes made elsewhere; a client cannot send one.
            WriteError::OutOfOrder { .. } | WriteError::NoSuchPartition(_) => ApiError::bad_request(reason),
            WriteError::Corrupt => ApiError::corrupt(reason),
            WriteError::Engine(inner) => ApiError::engine(inner, reason),
        }
    }
}

impl From<CollectionError> for ApiError {
    fn from(e: CollectionError) -> Self {
        let reason = e.to_string();
        match e {
            CollectionError::Exists(_) => ApiError::new(StatusCode::CONFLICT, "collection_exists", reason),
            CollectionError::NotFound(_) => ApiError::new(StatusCode::NOT_FOUND, "collection_not_found", reason),
            CollectionError::InvalidName(_) => ApiError::bad_request(reason),
            CollectionError::IdTaken { .. } => ApiError::new(StatusCode::CONFLICT, "collection_exists", reason),
            CollectionError::Unwritable(ref w) => ApiError::from(w),
            CollectionError::Corrupt(_) => ApiError::corrupt(reason),
            CollectionError::Engine(ref inner) => ApiError::engine(inner, reason),
        }
    }
}

impl From<ChangesError> for ApiError {
    fn from(e: ChangesError) -> Self {
        let reason = e.to_string();
        match e {
            ChangesError::InvalidToken(_) => ApiError::bad_request(reason),
            ChangesError::CollectionDropped => ApiError::new(StatusCode::NOT_FOUND, "collection_not_found", reason),
            ChangesError::Busy => ApiError::unavailable(reason),
            ChangesError::NotMyPartition(ref n) => ApiError::not_my_partition(n, reason),
            ChangesError::Corrupt => ApiError::corrupt(reason),
            ChangesError::Engine(ref inner) => ApiError::engine(inner, reason),
        }
    }
}

impl From<CatalogError> for ApiError {
    fn from(e: CatalogError) -> Self {
        let reason = e.to_string();
        match e {
            CatalogError::Refused(ref inner) => ApiError::from(inner),
            CatalogError::Engine(ref inner) => ApiError::engine(inner, reason),
            CatalogError::Corrupt(_) => ApiError::corrupt(reason),
            CatalogError::InvalidKey(_) => ApiError::internal(reason),
        }
    }
}

impl From<shoal_query::QueryError> for ApiError {
    fn from(e: shoal_query::QueryError) -> Self {
        use shoal_query::QueryError;
        let reason = e.to_string();
        match e {
            QueryError::Sql(_) | QueryError::UnknownField(_) | QueryError::Memory(_) => {
                ApiError::new(StatusCode::BAD_REQUEST, "query_error", reason)
            }
            QueryError::Invalid(_) => ApiError::bad_request(reason),
            QueryError::TooLarge(_) => ApiError::too_large(reason),
            QueryError::Timeout(_) => ApiError::new(StatusCode::GATEWAY_TIMEOUT, "timeout", reason),
            QueryError::Unavailable(_) | QueryError::NotPlaced(_) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", reason),
            QueryError::Storage(_) => ApiError::unavailable(reason),
            QueryError::Internal(_) => ApiError::internal(reason),
        }
    }
}

impl From<IndexError> for ApiError {
    fn from(e: IndexError) -> Self {
        let reason = e.to_string();
        match e {
            IndexError::NotFound(_) => ApiError::new(StatusCode::NOT_FOUND, "index_not_found", reason),
            IndexError::Exists(_) => ApiError::new(StatusCode::CONFLICT, "index_exists", reason),
            IndexError::Invalid(_) => ApiError::bad_request(reason),
            IndexError::Filter(_) => ApiError::new(StatusCode::BAD_REQUEST, "query_error", reason),
            IndexError::NotReady { .. } => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", reason),
            IndexError::Timeout => ApiError::new(StatusCode::GATEWAY_TIMEOUT, "timeout", reason),
            IndexError::Unavailable(_) => ApiError::unavailable(reason),
            IndexError::CatchingUp { .. } => ApiError::unavailable(reason),
            IndexError::Changes(inner) => ApiError::from(inner),
            IndexError::Read(inner) => ApiError::from(inner),
            IndexError::Corrupt(_) => ApiError::corrupt(reason),
            IndexError::Engine(ref inner) => ApiError::engine(inner, reason),
            // Damage in an index is contained: it is rebuilt from the documents, so the
            // answer is "not now" rather than "corrupt".
            IndexError::Rebuilding { .. } => ApiError::unavailable(reason),
            IndexError::Catalog(inner) => ApiError::from(inner),
            IndexError::Io { .. } => ApiError::unavailable(reason),
            // A copy between members that failed is retried or rebuilt; never a client's error.
            IndexError::Copy(_) => ApiError::unavailable(reason),
        }
    }
}

impl From<shoal_engine::EngineError> for ApiError {
    fn from(e: shoal_engine::EngineError) -> Self {
        use shoal_engine::EngineError;
        match e {
            EngineError::Collection(inner) => ApiError::from(inner),
            EngineError::Index(inner) => ApiError::from(inner),
            EngineError::Query(inner) => ApiError::from(inner),
            EngineError::Open(_) | EngineError::Shadow(_) => ApiError::unavailable(e.to_string()),
            // A panic in engine code: a bug, said as such.
            EngineError::Task(_) => ApiError::internal(e.to_string()),
        }
    }
}

/// Maps a cluster error to the API's codes.
pub fn cluster_error(e: ClusterError) -> ApiError {
    match e {
        ClusterError::NodeNotFound(n) => ApiError::new(StatusCode::NOT_FOUND, "node_not_found", format!("no member {}", n.0)),
        ClusterError::RebalanceRunning => ApiError::new(StatusCode::CONFLICT, "rebalance_running", "a rebalance is running"),
        ClusterError::Rejected(r) => match r {
            MetaReject::NoSuchMember { node } => ApiError::new(StatusCode::NOT_FOUND, "node_not_found", format!("no member {node}")),
            MetaReject::CollectionExists { name } => {
                ApiError::new(StatusCode::CONFLICT, "collection_exists", format!("collection {name} exists"))
            }
            MetaReject::NoSuchCollection { name } => ApiError::collection_not_found(&name),
            MetaReject::OutOfRange { .. } => ApiError::bad_request(r.to_string()),
            MetaReject::RebalanceRunning => ApiError::new(StatusCode::CONFLICT, "rebalance_running", "a rebalance is running"),
            other => ApiError::new(StatusCode::CONFLICT, "bad_request", other.to_string()),
        },
        ClusterError::Refused(why) => ApiError::new(StatusCode::CONFLICT, "bad_request", why),
        ClusterError::Timeout(why) => ApiError::unavailable(why),
        ClusterError::BadMessage(why) => ApiError::bad_request(why),
        ClusterError::NoLeader(_)
        | ClusterError::Peer(_)
        | ClusterError::NotLeader { .. }
        | ClusterError::NotMine(_)
        | ClusterError::ShuttingDown => ApiError::unavailable(e.to_string()),
        ClusterError::Index(e) => ApiError::from(e),
        ClusterError::Identity(_) | ClusterError::Meta(_) | ClusterError::Engine(_) | ClusterError::Storage(_) => {
            ApiError::unavailable(e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_never_name_a_file_of_a_data_path() {
        let dir = std::env::temp_dir().join("shoal-error-paths-test").join("data0");
        hide_paths_under(&dir);
        hide_paths_under(std::path::Path::new("rel-data"));
        let root = dir.to_string_lossy();
        let cases = [
            (
                format!("index database at {root}/index/7: Input/output error (os error 5)"),
                "index database at <a file of the node's data path>: Input/output error (os error 5)".to_string(),
            ),
            (
                format!("analytics shadow file \"{root}/shadow/c/3/seg-1.arrow\" is damaged"),
                format!("analytics shadow file \"{HIDDEN_PATH}\" is damaged"),
            ),
            (format!("two: {root} and {root}/tmp/x"), format!("two: {HIDDEN_PATH} and {HIDDEN_PATH}")),
            ("nothing private: /etc/hosts".to_string(), "nothing private: /etc/hosts".to_string()),
            ("relative: rel-data/index/3: gone".to_string(), format!("relative: {HIDDEN_PATH}: gone")),
            ("collection \"rel-data\" does not exist".to_string(), "collection \"rel-data\" does not exist".to_string()),
        ];
        for (reason, want) in cases {
            let e = ApiError::unavailable(reason.clone());
            assert_eq!(e.to_json()["reason"], want, "{reason}");
        }
    }
}
