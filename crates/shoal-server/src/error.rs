//! API errors: the one place where storage and index errors become API.md codes and HTTP statuses.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use shoal_index::IndexError;
use shoal_storage::{CatalogError, ChangesError, CollectionError, ReadError, WriteError};

/// An error as clients see it: `{"error": CODE, "reason": "..."}` with an HTTP status.
#[derive(Debug)]
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

    /// The error as a JSON object, for answers that carry errors inline (`_get`, `_bulk`).
    pub fn to_json(&self) -> serde_json::Value {
        let mut out = serde_json::json!({"error": self.code, "reason": self.reason});
        for (k, v) in &self.details {
            out[*k] = v.clone();
        }
        out
    }
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
            ReadError::InvalidLockTime => ApiError::bad_request(reason),
            ReadError::CollectionDropped => ApiError::new(StatusCode::NOT_FOUND, "collection_not_found", reason),
            ReadError::Busy => ApiError::unavailable(reason),
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
            QueryError::Unavailable(_) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", reason),
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
            IndexError::Changes(inner) => ApiError::from(inner),
            IndexError::Read(inner) => ApiError::from(inner),
            IndexError::Corrupt(_) => ApiError::corrupt(reason),
            IndexError::Engine(ref inner) => ApiError::engine(inner, reason),
            // Damage in an index is contained: it is rebuilt from the documents, so the
            // answer is "not now" rather than "corrupt".
            IndexError::Rebuilding { .. } => ApiError::unavailable(reason),
            IndexError::Catalog(inner) => ApiError::from(inner),
            IndexError::Io { .. } => ApiError::unavailable(reason),
        }
    }
}
