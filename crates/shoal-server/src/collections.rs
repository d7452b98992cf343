//! Collections: create, list, drop.

use axum::body::Body;
use axum::extract::{RawQuery, State};
use axum::http::{StatusCode, Uri};
use axum::response::Response;
use serde::Deserialize;

use crate::docs::json_response;
use crate::error::ApiError;
use crate::extract;
use crate::AppState;

/// Largest body of a collection call.
const COLLECTION_BODY_MAX_BYTES: usize = 64 * 1024;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    #[serde(default)]
    max_ttl: u32,
}

pub async fn create(State(state): State<AppState>, uri: Uri, RawQuery(q): RawQuery, body: Body) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let name = extract::collection_name(&uri)?;
    let body = extract::body(&state, body, COLLECTION_BODY_MAX_BYTES).await?;
    let spec: CreateBody = if body.iter().all(u8::is_ascii_whitespace) { CreateBody::default() } else { extract::json_body(&body)? };
    // Checked before it goes to the cluster's log: a name every member would refuse is never
    // committed.
    shoal_storage::validate_collection_name(&name)?;
    state.cluster.create_collection(&name, spec.max_ttl).await.map_err(crate::error::cluster_error)?;
    let out = serde_json::json!({"name": name, "max_ttl": spec.max_ttl});
    Ok(json_response(StatusCode::CREATED, out.to_string().into_bytes()))
}

/// `GET /v1/collections`: the collections the caller may read (every one for cluster
/// administrators and monitors), as Couchbase lists only the buckets a user may see.
pub async fn list(State(state): State<AppState>, RawQuery(q): RawQuery, extensions: axum::http::Extensions) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let caller = crate::auth::principal(&extensions)?;
    let sees_all = caller.may(&shoal_meta::Needs::Monitor);
    let list: Vec<_> = state
        .engine
        .store()
        .list_collections()
        .into_iter()
        .filter(|c| sees_all || caller.may(&shoal_meta::Needs::Read(c.name.clone())))
        .map(|c| serde_json::json!({"name": c.name, "docs": c.docs, "bytes": c.bytes, "max_ttl": c.max_ttl}))
        .collect();
    Ok(json_response(StatusCode::OK, serde_json::Value::Array(list).to_string().into_bytes()))
}

pub async fn drop(State(state): State<AppState>, uri: Uri, RawQuery(q): RawQuery) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let name = extract::collection_name(&uri)?;
    if state.engine.store().collection(&name).is_none() && !state.cluster.state().collections.contains_key(&name) {
        return Err(ApiError::collection_not_found(&name));
    }
    state.cluster.drop_collection(&name).await.map_err(crate::error::cluster_error)?;
    Ok(json_response(StatusCode::OK, b"{}".to_vec()))
}
