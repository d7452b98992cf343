//! Collections: create, list, drop.

use std::sync::Arc;

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
    let store = state.store.clone();
    let shadows = Arc::clone(&state.shadows);
    let created = tokio::task::spawn_blocking(move || {
        let coll = store.create_collection(&name, spec.max_ttl)?;
        if shadows.partitions() > 0 {
            // A new collection's shadow is empty: attaching it cannot fail but on I/O.
            if let Err(e) = shadows.attach(Arc::clone(&coll)) {
                tracing::warn!(collection = %coll.name(), error = %e, "starting the analytics shadow");
            }
        }
        Ok::<_, shoal_storage::CollectionError>(coll.info())
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
    let out = serde_json::json!({"name": created.name, "max_ttl": created.max_ttl});
    Ok(json_response(StatusCode::CREATED, out.to_string().into_bytes()))
}

pub async fn list(State(state): State<AppState>, RawQuery(q): RawQuery) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let list: Vec<_> = state
        .store
        .list_collections()
        .into_iter()
        .map(|c| serde_json::json!({"name": c.name, "docs": c.docs, "bytes": c.bytes, "max_ttl": c.max_ttl}))
        .collect();
    Ok(json_response(StatusCode::OK, serde_json::Value::Array(list).to_string().into_bytes()))
}

pub async fn drop(State(state): State<AppState>, uri: Uri, RawQuery(q): RawQuery) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let name = extract::collection_name(&uri)?;
    let id = state.store.collection(&name).map(|c| c.id());
    let store = state.store.clone();
    tokio::task::spawn_blocking(move || store.drop_collection(&name)).await.map_err(|e| ApiError::internal(e.to_string()))??;
    if let Some(id) = id {
        state.indexes.drop_collection(id).await?;
    }
    Ok(json_response(StatusCode::OK, b"{}".to_vec()))
}
