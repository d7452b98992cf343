//! SQL endpoints: `POST /v1/query` (operational: key lookups and index scans).

use std::time::Duration;

use axum::body::Body;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde::Deserialize;
use serde_json::{json, Value};
use shoal_index::Consistency;
use shoal_query::{QueryRequest, QUERY_TIMEOUT_DEFAULT, SQL_MAX_BYTES};

use crate::docs::json_response;
use crate::error::ApiError;
use crate::extract;
use crate::AppState;

/// Largest body: the statement plus its parameters.
const QUERY_BODY_MAX_BYTES: usize = SQL_MAX_BYTES + 1024 * 1024;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct QueryBody {
    sql: String,
    #[serde(default)]
    params: Vec<Value>,
    consistency: Option<String>,
    timeout_ms: Option<u64>,
}

pub async fn query(State(state): State<AppState>, RawQuery(q): RawQuery, body: Body) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let body = extract::body(body, QUERY_BODY_MAX_BYTES).await?;
    let req: QueryBody = extract::json_body(&body)?;
    let consistency = match req.consistency.as_deref() {
        None | Some("not_bounded") => Consistency::NotBounded,
        Some("request_plus") => Consistency::RequestPlus,
        Some(other) => return Err(ApiError::bad_request(format!("consistency is not_bounded or request_plus, not {other:?}"))),
    };
    let timeout = req.timeout_ms.map(Duration::from_millis).unwrap_or(QUERY_TIMEOUT_DEFAULT);
    let result = state.query.query(QueryRequest { sql: req.sql, params: req.params, consistency, timeout }).await?;
    let rows = result.rows.len();
    let answer = json!({
        "columns": result.columns,
        "rows": result.rows,
        "metrics": {"elapsed_ms": result.elapsed.as_secs_f64() * 1000.0, "rows": rows},
    });
    Ok(json_response(StatusCode::OK, answer.to_string().into_bytes()))
}
