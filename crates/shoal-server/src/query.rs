//! SQL endpoints: `POST /v1/query` (operational: key lookups and index scans) and
//! `POST /v1/analytics` (the columnar shadows, one stream per analytics partition), answering
//! JSON or, with `Accept: application/x-ndjson`, one line per row.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde::Deserialize;
use serde_json::{json, Value};
use shoal_query::{Path, QueryRequest, RowFormat, QUERY_TIMEOUT_DEFAULT, SQL_MAX_BYTES};

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

pub async fn query(
    State(state): State<AppState>,
    RawQuery(q): RawQuery,
    headers: HeaderMap,
    extensions: axum::http::Extensions,
    body: Body,
) -> Result<Response, ApiError> {
    run(state, q, headers, &extensions, body, Path::Operational).await
}

pub async fn analytics(
    State(state): State<AppState>,
    RawQuery(q): RawQuery,
    headers: HeaderMap,
    extensions: axum::http::Extensions,
    body: Body,
) -> Result<Response, ApiError> {
    run(state, q, headers, &extensions, body, Path::Analytics).await
}

/// Refuses a statement that reads a collection its caller may not read (`403`). The
/// catalog (`information_schema`) names every collection and its fields: it needs reading
/// every collection, or cluster administration.
fn check_reads(caller: &crate::auth::Principal, sql: &str) -> Result<(), ApiError> {
    use shoal_meta::Needs;
    for read in shoal_query::reads(sql)? {
        match read {
            shoal_query::Reads::Collection(c) => caller.check(&Needs::Read(c))?,
            shoal_query::Reads::Catalog => caller.check(&Needs::Catalog)?,
        }
    }
    Ok(())
}

async fn run(
    state: AppState,
    q: Option<String>,
    headers: HeaderMap,
    extensions: &axum::http::Extensions,
    body: Body,
    path: Path,
) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let caller = crate::auth::principal(extensions)?;
    let body = extract::body(&state, body, QUERY_BODY_MAX_BYTES).await?;
    let req: QueryBody = extract::json_body(&body)?;
    check_reads(&caller, &req.sql)?;
    let consistency = extract::consistency(req.consistency.as_deref())?;
    // In a cluster a statement reads each partition's active copy, never a replica (a
    // replica the rebalance is still filling would answer short). On a node holding every
    // partition active it runs here alone. Otherwise `/v1/query` runs here, paging the
    // documents active elsewhere from their members (`shoal_node::sql`), and
    // `/v1/analytics` runs distributed: each member scans its shadow's active partitions
    // (`"engine": "columnar across members"`), or, for a plan that cannot be placed so, on
    // the rows across the members (slower, same rows). Either way the statement pins the
    // map version it started under: a partition that moves while it runs could be read
    // twice or not at all, so the answer is then refused (see below).
    let node = &state.cluster;
    crate::routing::require_serving(&state).await?;
    let pinned = node.state();
    let map_version = pinned.map_version();
    let local = node.actives_here_in(&pinned).is_none();
    let timeout = req.timeout_ms.map(Duration::from_millis).unwrap_or(QUERY_TIMEOUT_DEFAULT);
    let placed = node.placed_indexes(&pinned);
    let ndjson = headers.get(axum::http::header::ACCEPT).and_then(|v| v.to_str().ok()).is_some_and(|a| a.contains("application/x-ndjson"));
    let format = if ndjson { RowFormat::Ndjson } else { RowFormat::JsonArrays };
    let mut req = QueryRequest { sql: req.sql, params: req.params, consistency, timeout, spread: None, placed, cluster: None };
    let (engine, answer) = match (path, local) {
        (Path::Operational, true) => {
            // Full scans read the columnar shadow when it answers the same rows.
            let answer = state.engine.query().query(req, format).await?;
            let engine = match (answer.row_scans, answer.columnar_scans) {
                (_, 0) => "rows",
                (0, _) => "columnar",
                _ => "rows and columnar",
            };
            (engine, answer)
        }
        (Path::Analytics, true) => ("columnar", state.engine.query().analytics(req, format).await?),
        // Full scans read the members' shadows when they hold every write; key and index
        // reads page the documents from the members.
        (Path::Operational, false) => {
            req.spread = node.spread(&pinned).map_err(crate::routing::no_active)?;
            req.cluster = node.analytics_members(&pinned).map_err(crate::routing::no_active)?;
            let answer = match state.engine.query().query(req.clone(), format).await {
                Err(shoal_query::QueryError::NotPlaced(why)) => {
                    tracing::debug!(%why, "statement not placed on the members' shadows; run on the rows");
                    req.cluster = None;
                    state.engine.query().query(req, format).await?
                }
                other => other?,
            };
            let engine = match (answer.row_scans, answer.columnar_scans) {
                (_, 0) => "rows across members",
                (0, _) => "columnar across members",
                _ => "rows and columnar across members",
            };
            (engine, answer)
        }
        // Over the members' shadows, each member scanning its own active partitions
        // (`shoal_query::distributed`); a plan that cannot be placed so runs on the rows.
        (Path::Analytics, false) => {
            req.cluster = node.analytics_members(&pinned).map_err(crate::routing::no_active)?;
            match state.engine.query().analytics(req.clone(), format).await {
                Err(shoal_query::QueryError::NotPlaced(why)) => {
                    tracing::debug!(%why, "analytics statement not placed on the members; run on the rows");
                    req.cluster = None;
                    req.spread = node.spread(&pinned).map_err(crate::routing::no_active)?;
                    ("rows across members", state.engine.query().query(req, format).await?)
                }
                other => ("columnar across members", other?),
            }
        }
    };
    // The members refuse a page under another map; this node's own part is checked here: a
    // partition that moved while the statement ran may be missing or read twice.
    if node.state().map_version() != map_version {
        return Err(ApiError::unavailable("the partition map changed while the statement ran (partitions moved); run it again"));
    }
    let elapsed_ms = answer.elapsed.as_secs_f64() * 1000.0;
    let columns = json!(answer.columns).to_string();
    let metrics = json!({"elapsed_ms": elapsed_ms, "rows": answer.rows, "engine": engine}).to_string();
    let mut out = Vec::with_capacity(answer.body.len() + columns.len() + metrics.len() + 64);
    if ndjson {
        // One line of column names, one line per row, one line of metrics.
        out.extend_from_slice(format!("{{\"columns\":{columns}}}\n").as_bytes());
        out.extend_from_slice(&answer.body);
        out.extend_from_slice(format!("{{\"metrics\":{metrics}}}\n").as_bytes());
        return Response::builder()
            .status(StatusCode::OK)
            .header(axum::http::header::CONTENT_TYPE, "application/x-ndjson")
            .body(Body::from(out))
            .map_err(|e| ApiError::internal(e.to_string()));
    }
    out.extend_from_slice(format!("{{\"columns\":{columns},\"rows\":[").as_bytes());
    out.extend_from_slice(&answer.body);
    out.extend_from_slice(format!("],\"metrics\":{metrics}}}").as_bytes());
    Ok(json_response(StatusCode::OK, out))
}
