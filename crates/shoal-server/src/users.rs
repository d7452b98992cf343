//! Users: create or replace, list, delete, who am I (`API.md`, Security). Passwords are
//! hashed here (argon2id) before anything goes to the log; the log never holds one.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, RawQuery, State};
use axum::http::{Extensions, StatusCode};
use axum::response::Response;
use serde::Deserialize;
use shoal_meta::{Role, User};

use crate::auth::{self, Principal};
use crate::docs::json_response;
use crate::error::ApiError;
use crate::extract;
use crate::AppState;

/// Largest body of a user call.
const USER_BODY_MAX_BYTES: usize = 64 * 1024;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PutBody {
    password: String,
    #[serde(default)]
    roles: Vec<String>,
}

fn roles_json(roles: &[Role]) -> serde_json::Value {
    serde_json::Value::Array(roles.iter().map(|r| serde_json::Value::String(r.to_string())).collect())
}

/// `PUT /v1/users/{name}`: creates or replaces a user.
pub async fn put(
    State(state): State<AppState>,
    Path(name): Path<String>,
    RawQuery(q): RawQuery,
    extensions: Extensions,
    body: Body,
) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let caller = auth::principal(&extensions)?;
    shoal_meta::users::check_user_name(&name).map_err(ApiError::bad_request)?;
    let body = extract::body(&state, body, USER_BODY_MAX_BYTES).await?;
    let spec: PutBody = extract::json_body(&body)?;
    auth::check_password(&spec.password)?;
    if spec.roles.len() > shoal_meta::users::ROLES_PER_USER_MAX {
        return Err(ApiError::bad_request(format!("at most {} roles", shoal_meta::users::ROLES_PER_USER_MAX)));
    }
    let roles =
        spec.roles.iter().map(|r| r.parse::<Role>()).collect::<Result<Vec<_>, _>>().map_err(|e| ApiError::bad_request(e.to_string()))?;
    let meta = state.cluster.state();
    if let Some(missing) = roles.iter().filter_map(Role::collection).find(|c| !meta.collections.contains_key(*c)) {
        return Err(ApiError::bad_request(format!("role names collection {missing:?}, which does not exist")));
    }
    let target_is_admin = meta.users.get(&name).is_some_and(User::is_admin);
    let grants_admin = roles.contains(&Role::Admin);
    if !auth::may_manage(&caller, target_is_admin, grants_admin) {
        return Err(ApiError::new(StatusCode::FORBIDDEN, "forbidden", "only an admin may change an admin or make one"));
    }
    let password = spec.password;
    let hash = state.cpu.run(move || auth::hash_password(&password)).await??;
    let created = !meta.users.contains_key(&name);
    state.cluster.put_user(&name, User { hash, roles: roles.clone() }).await.map_err(user_error)?;
    tracing::info!(user = %name, by = %caller.name, created, "user changed");
    let out = serde_json::json!({"name": name, "roles": roles_json(&roles)});
    Ok(json_response(StatusCode::OK, out.to_string().into_bytes()))
}

/// `GET /v1/users`: every user with their roles (never a hash).
pub async fn list(State(state): State<AppState>, RawQuery(q): RawQuery) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let meta = state.cluster.state();
    let list: Vec<_> = meta.users.iter().map(|(name, u)| serde_json::json!({"name": name, "roles": roles_json(&u.roles)})).collect();
    Ok(json_response(StatusCode::OK, serde_json::Value::Array(list).to_string().into_bytes()))
}

/// `DELETE /v1/users/{name}`.
pub async fn delete(
    State(state): State<AppState>,
    Path(name): Path<String>,
    RawQuery(q): RawQuery,
    extensions: Extensions,
) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let caller = auth::principal(&extensions)?;
    let meta = state.cluster.state();
    let Some(user) = meta.users.get(&name) else {
        return Err(user_not_found(&name));
    };
    if !auth::may_manage(&caller, user.is_admin(), false) {
        return Err(ApiError::new(StatusCode::FORBIDDEN, "forbidden", "only an admin may delete an admin"));
    }
    state.cluster.delete_user(&name).await.map_err(user_error)?;
    tracing::info!(user = %name, by = %caller.name, "user deleted");
    Ok(json_response(StatusCode::OK, b"{}".to_vec()))
}

/// `GET /v1/whoami`.
pub async fn whoami(RawQuery(q): RawQuery, extensions: Extensions) -> Result<Response, ApiError> {
    extract::no_params(q.as_deref())?;
    let caller: Arc<Principal> = auth::principal(&extensions)?;
    let out = serde_json::json!({"name": caller.name, "roles": roles_json(&caller.roles)});
    Ok(json_response(StatusCode::OK, out.to_string().into_bytes()))
}

fn user_not_found(name: &str) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "user_not_found", format!("no user {name:?}"))
}

fn user_error(e: shoal_node::ClusterError) -> ApiError {
    use shoal_meta::MetaReject as R;
    match e {
        shoal_node::ClusterError::Rejected(R::NoSuchUser { name }) => user_not_found(&name),
        shoal_node::ClusterError::Rejected(
            r @ (R::LastAdmin | R::InvalidUser { .. } | R::NoSuchCollection { .. } | R::LimitReached { .. }),
        ) => ApiError::bad_request(r.to_string()),
        other => crate::error::cluster_error(other),
    }
}
