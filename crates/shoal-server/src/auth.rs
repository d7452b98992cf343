//! Who calls, and whether they may (`API.md`, Security).
//!
//! Every route has a [`Rule`] in [`crate::ops::ROUTES`] — the router is built through
//! [`rule_of`], so a route without one cannot be served. A call proves who it is by HTTP Basic credentials,
//! checked against the user's argon2id hash in the metadata log; a member passing a client's
//! request on to another member proves it with the user's name signed by the cluster secret
//! ([`USER_HEADER`]), never with the client's password. `/v1/health` needs nothing; calls
//! between members (`/v1/_internal`, the analytics workers) need the cluster secret
//! (`transport`).
//!
//! A password check costs argon2id's tens of milliseconds, so a header already verified is
//! remembered, keyed by a keyed 128-bit hash of it (never the password), for as long as its user's
//! hash is the one it was verified against: a new password or a deleted user ends it at
//! once, and role changes apply to the next call. Failures are counted per source address
//! and per user name ([`Failures`]); past [`FAILURES_FREE`] in a row, each further attempt
//! waits out a growing pause or is answered `429` with `Retry-After`.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;
use axum::extract::Request;
use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use blake2::digest::{KeyInit, Mac};
use parking_lot::Mutex;
use shoal_meta::{allows, MetaState, Needs, Role};

use crate::error::ApiError;
use crate::AppState;

/// Set by a member on a client's request it passes on: `<user> <expiry unix s> <signature>`,
/// the signature keyed by the cluster secret. A client cannot make one.
pub const USER_HEADER: &str = "x-shoal-user";
/// [`USER_HEADER`] as a header name: a name given as `&str` is parsed on every use.
static USER_HEADER_NAME: HeaderName = HeaderName::from_static(USER_HEADER);
/// [`crate::routing::FORWARDED_HEADER`] as a header name.
static FORWARDED_HEADER_NAME: HeaderName = HeaderName::from_static(crate::routing::FORWARDED_HEADER);
/// How long a signed user is good for (members' clocks agree far better than this).
pub const SIGNED_USER_VALID: Duration = Duration::from_secs(60);
/// Longest `Authorization` header read; a longer one is refused as malformed.
pub const AUTHORIZATION_MAX_BYTES: usize = 1024;
/// A password's length in bytes.
pub const PASSWORD_MIN_BYTES: usize = 8;
pub const PASSWORD_MAX_BYTES: usize = 256;
/// Verified credentials remembered (each a keyed hash, a name and the hash it matched).
pub const CREDENTIALS_CACHED: usize = 10_000;
/// Failed attempts in a row, per source address and per user name, before attempts slow down.
pub const FAILURES_FREE: u32 = 5;
/// The longest pause a source or a user is made to wait between failed attempts.
pub const FAILURE_PAUSE_MAX: Duration = Duration::from_secs(60);
/// A source or user with no failure for this long starts afresh.
pub const FAILURE_MEMORY: Duration = Duration::from_secs(15 * 60);
/// Sources and user names whose failures are remembered; when full, the oldest go.
pub const FAILURES_TRACKED: usize = 10_000;
/// Length of a generated password (letters and digits: about 143 bits).
pub const GENERATED_PASSWORD_CHARS: usize = 24;

/// What a route asks of its caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// Anyone (`/v1/health`).
    Open,
    /// Members only, by the cluster secret (checked by `transport`).
    Members,
    /// Any known user (the route's handler may ask more: SQL checks the collections a
    /// statement reads, user management who is changed).
    User,
    /// Metrics and the node's and cluster's state.
    Monitor,
    /// Cluster operations and DDL.
    ClusterAdmin,
    /// Reading the documents of the collection in the path.
    Read,
    /// Changing the documents of the collection in the path.
    Write,
    /// Reading a document, which writes when it locks or touches it (`?lock=`, `?touch=`).
    ReadOrLock,
}

/// The rule of a route; `None` for one not in [`crate::ops::ROUTES`].
pub fn rule_of(method: &str, path: &str) -> Option<Rule> {
    crate::ops::route_of(method, Some(path)).map(|(_, _, _, r)| *r)
}

/// The rule of a request: its endpoint's (`entry`, when [`crate::ops::ROUTES`] lists it); a
/// HEAD asks what the GET of its route asks (the GET route answers it); anything else —
/// no route, or a method the route does not take — needs a known user, who then learns that.
pub fn rule_for(entry: Option<&crate::ops::Route>, method: &axum::http::Method, matched: Option<&str>) -> Rule {
    match (entry, matched) {
        (Some((_, _, _, rule)), _) => *rule,
        (None, Some(path)) if method == axum::http::Method::HEAD => rule_of("GET", path).unwrap_or(Rule::User),
        _ => Rule::User,
    }
}

/// Who a request runs for (in its extensions once authenticated).
#[derive(Clone, Debug)]
pub struct Principal {
    pub name: String,
    pub roles: Vec<Role>,
}

impl Principal {
    pub fn may(&self, needs: &Needs) -> bool {
        allows(&self.roles, needs)
    }

    /// `403 forbidden` unless the roles grant `needs`.
    pub fn check(&self, needs: &Needs) -> Result<(), ApiError> {
        if self.may(needs) {
            return Ok(());
        }
        Err(forbidden(&self.name, needs))
    }
}

fn forbidden(user: &str, needs: &Needs) -> ApiError {
    let what = match needs {
        Needs::User => "this".to_string(),
        Needs::Monitor => "monitoring (metrics_reader, cluster_admin or admin)".to_string(),
        Needs::ClusterAdmin => "cluster administration (cluster_admin or admin)".to_string(),
        Needs::Read(c) => format!("reading collection {c:?} (data_reader[{c}] or data_writer[{c}])"),
        Needs::Write(c) => format!("writing collection {c:?} (data_writer[{c}])"),
        Needs::Catalog => "reading the catalog, information_schema (data_reader[*], data_writer[*], cluster_admin or admin)".to_string(),
    };
    ApiError::new(StatusCode::FORBIDDEN, "forbidden", format!("user {user:?} has no role allowing {what}"))
}

/// `401 unauthorized`, asking for Basic credentials.
pub fn unauthorized(reason: impl Into<String>) -> Response {
    let mut r = ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", reason).into_response();
    r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Basic realm=\"shoal\", charset=\"UTF-8\""));
    r
}

/// A verified header's user hash (as verified) and principal, in the credential cache.
type Verified = (String, Arc<Principal>);

/// Longest user name an audit line carries (a failed login's name is the client's to choose).
pub const AUDIT_NAME_MAX_CHARS: usize = 128;

/// The node's authentication state: the credential cache, the failure counts, the audit trail.
pub struct Auth {
    /// The SipHash key (random per process) of the 128-bit hashes of `Authorization`
    /// headers the cache is looked up by: a header is never kept, and one that is not
    /// verified cannot be made to match one that was without the key.
    key: (u64, u64),
    /// Keyed hash of a verified header → the hash it was verified against and its
    /// principal (reused while the user's hash and roles are unchanged).
    verified: quick_cache::sync::Cache<u128, Arc<Verified>>,
    failures: Failures,
    /// A hash to check passwords of unknown users against, so that they take as long.
    decoy: String,
    pub(crate) audit: crate::audit::Audit,
    /// Each user's signed [`USER_HEADER`] and its expiry, made again once half its time is
    /// gone: a signature per request cost a small get several per cent.
    signed: Mutex<HashMap<String, (u64, HeaderValue)>>,
}

impl Auth {
    /// The state of a node whose audit trail is kept in `dir`.
    pub fn new(dir: &std::path::Path) -> Auth {
        let decoy = hash_password(&generate_password()).unwrap_or_default();
        Auth {
            key: rand::random(),
            verified: quick_cache::sync::Cache::new(CREDENTIALS_CACHED),
            failures: Failures::default(),
            decoy,
            audit: crate::audit::Audit::new(dir),
            signed: Mutex::new(HashMap::new()),
        }
    }

    /// `user` signed with `secret`, from the cache while more than half its time is left.
    fn signed_user(&self, secret: &str, user: &str) -> HeaderValue {
        let now = unix_now();
        let fresh = SIGNED_USER_VALID.as_secs() / 2;
        let mut signed = self.signed.lock();
        if let Some((expiry, value)) = signed.get(user) {
            if *expiry >= now + fresh {
                return value.clone();
            }
        }
        if signed.len() >= CREDENTIALS_CACHED {
            signed.clear();
        }
        let expiry = now + SIGNED_USER_VALID.as_secs();
        let value = signed_user_until(secret, user, expiry);
        signed.insert(user.to_string(), (expiry, value.clone()));
        value
    }
}

/// An argon2id hash of `password` (PHC string, random salt, the crate's default costs:
/// 19 MiB, 2 passes — OWASP's recommendation).
pub fn hash_password(password: &str) -> Result<String, ApiError> {
    let salt = SaltString::generate(&mut argon2::password_hash::rand_core::OsRng);
    Argon2::default()
        .hash_password(password.as_bytes(), &salt)
        .map(|h| h.to_string())
        .map_err(|e| ApiError::internal(format!("hashing a password: {e}")))
}

/// A random password of [`GENERATED_PASSWORD_CHARS`] letters and digits.
pub fn generate_password() -> String {
    use rand::distr::{Alphanumeric, SampleString};
    Alphanumeric.sample_string(&mut rand::rng(), GENERATED_PASSWORD_CHARS)
}

/// Checks a password's length: [`PASSWORD_MIN_BYTES`] to [`PASSWORD_MAX_BYTES`].
pub fn check_password(password: &str) -> Result<(), ApiError> {
    if password.len() < PASSWORD_MIN_BYTES || password.len() > PASSWORD_MAX_BYTES {
        return Err(ApiError::bad_request(format!("a password has {PASSWORD_MIN_BYTES} to {PASSWORD_MAX_BYTES} bytes")));
    }
    Ok(())
}

fn verify_password(password: &str, hash: &str) -> bool {
    PasswordHash::new(hash).is_ok_and(|parsed| Argon2::default().verify_password(password.as_bytes(), &parsed).is_ok())
}

/// SipHash-1-3 of `bytes` under `key`, 128 bits (one pass; two 64-bit SipHash-2-4 passes
/// under two keys cost a small get 1.3 % of its instructions).
fn keyed_hash(key: (u64, u64), bytes: &[u8]) -> u128 {
    use siphasher::sip128::Hasher128;
    use std::hash::Hasher;
    let mut h = siphasher::sip128::SipHasher13::new_with_keys(key.0, key.1);
    h.write(bytes);
    h.finish128().as_u128()
}

type Signer = blake2::Blake2bMac<blake2::digest::consts::U32>;

/// A member's signature of `user` until `expiry`, keyed by the cluster secret.
fn signature(secret: &str, user: &str, expiry: u64) -> String {
    // The secret (8-256 bytes) is hashed to the 32-byte key.
    let key = <blake2::Blake2b<blake2::digest::consts::U32> as blake2::Digest>::digest(secret.as_bytes());
    let mut mac = <Signer as KeyInit>::new_from_slice(&key).expect("32 bytes is a valid key length");
    mac.update(user.as_bytes());
    mac.update(&[0]);
    mac.update(&expiry.to_be_bytes());
    let bytes = mac.finalize().into_bytes();
    let mut hex = String::with_capacity(bytes.len() * 2);
    for b in bytes.iter() {
        hex.push(char::from(b"0123456789abcdef"[usize::from(b >> 4)]));
        hex.push(char::from(b"0123456789abcdef"[usize::from(b & 15)]));
    }
    hex
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The [`USER_HEADER`] a member sends with a request it passes on for `user`.
pub fn signed_user(secret: &str, user: &str) -> HeaderValue {
    signed_user_until(secret, user, unix_now() + SIGNED_USER_VALID.as_secs())
}

fn signed_user_until(secret: &str, user: &str, expiry: u64) -> HeaderValue {
    let value = format!("{user} {expiry} {}", signature(secret, user, expiry));
    HeaderValue::from_str(&value).unwrap_or_else(|_| HeaderValue::from_static("-"))
}

/// The user a [`USER_HEADER`] names, if a member signed it and it has not expired.
fn verify_signed(secret: &str, value: &HeaderValue) -> Option<String> {
    let value = value.to_str().ok()?;
    let mut parts = value.split(' ');
    let (user, expiry, sig) = (parts.next()?, parts.next()?.parse::<u64>().ok()?, parts.next()?);
    let now = unix_now();
    if parts.next().is_some() || expiry < now || expiry > now + 2 * SIGNED_USER_VALID.as_secs() {
        return None;
    }
    let want = signature(secret, user, expiry);
    crate::transport::constant_time_eq(want.as_bytes(), sig.as_bytes()).then(|| user.to_string())
}

/// The user and password of a Basic `Authorization` header.
fn basic(value: &HeaderValue) -> Result<(String, String), &'static str> {
    if value.len() > AUTHORIZATION_MAX_BYTES {
        return Err("the Authorization header is too long");
    }
    let text = value.to_str().map_err(|_| "the Authorization header is not text")?;
    let (scheme, encoded) = text.trim().split_once(' ').ok_or("the Authorization header is not `Basic <base64 of user:password>`")?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return Err("only Basic credentials are taken");
    }
    let decoded =
        base64::engine::general_purpose::STANDARD.decode(encoded.trim()).map_err(|_| "the Basic credentials are not valid base64")?;
    let decoded = String::from_utf8(decoded).map_err(|_| "the Basic credentials are not UTF-8")?;
    let (user, password) = decoded.split_once(':').ok_or("the Basic credentials have no `:` between user and password")?;
    Ok((user.to_string(), password.to_string()))
}

/// Failed attempts per source address and per user name.
#[derive(Default)]
pub(crate) struct Failures {
    by: Mutex<HashMap<FailureKey, Failing>>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum FailureKey {
    Source(IpAddr),
    User(String),
}

#[derive(Clone, Copy, Debug)]
struct Failing {
    count: u32,
    last: Instant,
}

/// The pause after `count` failures in a row: none for the first [`FAILURES_FREE`], then
/// doubling from one second up to [`FAILURE_PAUSE_MAX`].
pub fn failure_pause(count: u32) -> Duration {
    if count < FAILURES_FREE {
        return Duration::ZERO;
    }
    let doublings = (count - FAILURES_FREE).min(16);
    Duration::from_secs(1u64 << doublings).min(FAILURE_PAUSE_MAX)
}

impl Failures {
    /// How long the caller must still wait before another attempt, if at all.
    fn wait(&self, keys: &[FailureKey], now: Instant) -> Option<Duration> {
        let by = self.by.lock();
        keys.iter()
            .filter_map(|k| by.get(k))
            .filter_map(|f| (f.last + failure_pause(f.count)).checked_duration_since(now))
            .filter(|d| !d.is_zero())
            .max()
    }

    fn failed(&self, keys: &[FailureKey], now: Instant) {
        let mut by = self.by.lock();
        if by.len() + keys.len() > FAILURES_TRACKED {
            by.retain(|_, f| now.duration_since(f.last) < FAILURE_MEMORY);
            if by.len() + keys.len() > FAILURES_TRACKED {
                // Still full: forget the oldest half.
                let mut lasts: Vec<Instant> = by.values().map(|f| f.last).collect();
                lasts.sort();
                let cut = lasts[lasts.len() / 2];
                by.retain(|_, f| f.last > cut);
            }
        }
        for k in keys {
            let f = by.entry(k.clone()).or_insert(Failing { count: 0, last: now });
            if now.duration_since(f.last) >= FAILURE_MEMORY {
                f.count = 0;
            }
            f.count = f.count.saturating_add(1);
            f.last = now;
        }
    }

    fn succeeded(&self, keys: &[FailureKey]) {
        let mut by = self.by.lock();
        for k in keys {
            by.remove(k);
        }
    }
}

fn too_many(wait: Duration) -> Response {
    let secs = wait.as_secs_f64().ceil().max(1.0) as u64;
    let mut r = ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        "too_many_requests",
        format!("too many failed logins from this address or for this user; try again in {secs} s"),
    )
    .into_response();
    if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
        r.headers_mut().insert(header::RETRY_AFTER, v);
    }
    r
}

/// What the rule of a route needs of this request (`None`: no user needed).
fn needs(rule: Rule, req: &Request) -> Result<Option<Needs>, ApiError> {
    let collection = || crate::extract::collection_name(req.uri());
    Ok(Some(match rule {
        Rule::Open | Rule::Members => return Ok(None),
        Rule::User => Needs::User,
        Rule::Monitor => Needs::Monitor,
        Rule::ClusterAdmin => Needs::ClusterAdmin,
        Rule::Read => Needs::Read(collection()?),
        Rule::Write => Needs::Write(collection()?),
        Rule::ReadOrLock => {
            let locks = req.uri().query().is_some_and(|q| {
                serde_urlencoded::from_str::<Vec<(String, String)>>(q)
                    .is_ok_and(|pairs| pairs.iter().any(|(k, _)| k == "lock" || k == "touch"))
            });
            if locks {
                Needs::Write(collection()?)
            } else {
                Needs::Read(collection()?)
            }
        }
    }))
}

/// In front of every route (see `crate::front_door`): authenticates the caller, checks the
/// route's `rule`, and hands the handler the [`Principal`] (signed for members it passes the
/// request on to). A `x-shoal-forwarded` header counts only on a request a member signed.
///
/// A key request (`keyed`) is not signed here: `routing` signs it only when it passes it on
/// ([`user_to_pass_on`]), which most key requests are not; a signature per request cost a
/// small get about 1 % of its instructions.
pub async fn authenticate(state: &AppState, rule: Rule, keyed: bool, mut req: Request, next: Next) -> Response {
    if matches!(rule, Rule::Open | Rule::Members) || is_worker_call(req.uri().path()) {
        return next.run(req).await;
    }
    let mut meta = state.cluster.state();
    if meta.users.is_empty() {
        // Just started: the cluster's first admin is made within moments of its founding,
        // and a joining node learns the users with the rest of the metadata.
        let _ = state.cluster.wait_applied(|s| !s.users.is_empty()).await;
        meta = state.cluster.state();
    }
    let from_member = req.headers().get(&USER_HEADER_NAME).cloned();
    let principal = if let Some(signed) = &from_member {
        // Over TLS, only a member's connection (its certificate checked) may pass a user on.
        if let Some(refused) = crate::transport::without_member_cert(state, req.extensions()) {
            return refused.into_response();
        }
        match verify_signed(state.cluster.secret(), signed).and_then(|name| principal_of(&meta, &name)) {
            Some(p) => p,
            None => return unauthorized("the request's signed user is not valid (expired, forged, or no longer a user)"),
        }
    } else {
        req.headers_mut().remove(&FORWARDED_HEADER_NAME);
        let credentials = req.headers().get(header::AUTHORIZATION).cloned();
        match login(state, &meta, credentials, source_of(&req)).await {
            Ok(p) => p,
            Err((response, event)) => {
                if let Some((event, user)) = event {
                    audit(state, event, Some(&user), &req, response.status());
                }
                return response;
            }
        }
    };
    match needs(rule, &req) {
        Ok(Some(needs)) => {
            if let Err(e) = principal.check(&needs) {
                audit(state, crate::audit::Event::Forbidden, Some(&principal.name), &req, e.status);
                return e.into_response();
            }
        }
        Ok(None) => {}
        Err(e) => return e.into_response(),
    }
    if !keyed {
        let signed = state.auth.signed_user(state.cluster.secret(), &principal.name);
        req.headers_mut().insert(USER_HEADER_NAME.clone(), signed);
    }
    // A change to users, collections, indexes or the cluster is recorded with its answer
    // (once, by the member the client called: not again where a member passed it on).
    let change = (rule == Rule::ClusterAdmin && req.method() != axum::http::Method::GET && from_member.is_none())
        .then(|| (req.method().to_string(), req.uri().path().to_string(), source_of(&req)));
    let name = change.as_ref().map(|_| principal.name.clone());
    req.extensions_mut().insert(principal);
    let response = next.run(req).await;
    if let (Some((method, path, source)), Some(name)) = (change, name) {
        state.auth.audit.record(&crate::audit::Record {
            event: crate::audit::Event::Change,
            user: Some(&name),
            source,
            method: &method,
            path: &path,
            status: response.status().as_u16(),
        });
    }
    response
}

fn source_of(req: &Request) -> IpAddr {
    source_of_parts(req.extensions())
}

/// The address a request came from (`0.0.0.0` if unknown).
pub(crate) fn source_of_parts(extensions: &axum::http::Extensions) -> IpAddr {
    extensions.get::<crate::conn::Peer>().map_or(IpAddr::from([0, 0, 0, 0]), |p| p.0)
}

/// An invitation to join another cluster comes without this node's secret: it is taken
/// only with the credentials of one of this node's administrators (`cluster_admin` or
/// `admin`), as Couchbase asks for the added node's. Those are checked as a login is
/// (cached, failures paused and audited); a malformed invitation is a `400`.
pub(crate) async fn check_invitation(state: &AppState, body: &[u8], source: IpAddr) -> Result<(), ApiError> {
    let call: shoal_node::identity::InviteCall =
        serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("invitation: {e}")))?;
    let missing = || {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "an invitation carries the credentials of an administrator of the node invited (`POST /v1/cluster/nodes` offers the caller's own, or `user` and `password`)",
        )
    };
    let credentials = call.admin.as_deref().and_then(|a| HeaderValue::from_str(a).ok()).ok_or_else(missing)?;
    let meta = state.cluster.state();
    let principal = match login(state, &meta, Some(credentials), source).await {
        Ok(p) => p,
        Err((response, event)) => {
            if let Some((event, user)) = event {
                state.auth.audit.record(&crate::audit::Record {
                    event,
                    user: Some(&user),
                    source,
                    method: "POST",
                    path: "/v1/_internal/invite",
                    status: response.status().as_u16(),
                });
            }
            return Err(match response.status() {
                StatusCode::TOO_MANY_REQUESTS => {
                    ApiError::new(StatusCode::TOO_MANY_REQUESTS, "too_many_requests", "too many failed invitations; try later")
                }
                StatusCode::SERVICE_UNAVAILABLE => ApiError::unavailable("this node knows no user yet; try again"),
                _ => ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "unauthorized",
                    "the invitation's credentials are not those of a user of the node invited",
                ),
            });
        }
    };
    principal.check(&Needs::ClusterAdmin)
}

fn audit(state: &AppState, event: crate::audit::Event, user: Option<&str>, req: &Request, status: StatusCode) {
    state.auth.audit.record(&crate::audit::Record {
        event,
        user,
        source: source_of(req),
        method: req.method().as_str(),
        path: req.uri().path(),
        status: status.as_u16(),
    });
}

fn is_worker_call(path: &str) -> bool {
    path.starts_with(shoal_query::distributed::WORKER_PATH_PREFIX)
}

fn principal_of(meta: &MetaState, name: &str) -> Option<Arc<Principal>> {
    meta.users.get(name).map(|u| Arc::new(Principal { name: name.to_string(), roles: u.roles.clone() }))
}

/// A refused login: its answer, and the event to record (with the user name given).
type Refused = (Response, Option<(crate::audit::Event, String)>);

/// Checks a request's Basic credentials (from the cache when seen before).
async fn login(state: &AppState, meta: &MetaState, credentials: Option<HeaderValue>, source: IpAddr) -> Result<Arc<Principal>, Refused> {
    let auth = &state.auth;
    let Some(value) = credentials.as_ref() else {
        return Err((unauthorized("credentials are needed: HTTP Basic (`Authorization: Basic <base64 of user:password>`)"), None));
    };
    if meta.users.is_empty() {
        return Err((
            ApiError::unavailable("this node knows no user yet (it is still entering its cluster); try again").into_response(),
            None,
        ));
    }
    let cache_key = keyed_hash(auth.key, value.as_bytes());
    let still_valid = |hit: &Verified| -> Option<Arc<Principal>> {
        let (hash, principal) = (&hit.0, &hit.1);
        let user = meta.users.get(&principal.name).filter(|u| &u.hash == hash)?;
        if user.roles == principal.roles {
            return Some(Arc::clone(principal));
        }
        // Its roles changed: the next call finds the new ones.
        let principal = Arc::new(Principal { name: principal.name.clone(), roles: user.roles.clone() });
        auth.verified.insert(cache_key, Arc::new((hash.clone(), Arc::clone(&principal))));
        Some(principal)
    };
    // Many connections opening with the same new credentials at once verify them once:
    // the others wait for that check (a client's pool of 200 connections cost 200 argon2
    // checks, seconds of CPU, before). An entry no longer valid (a new password, a deleted
    // user) is checked again without the guard, and replaced when the check passes.
    let guard = match auth.verified.get_value_or_guard_async(&cache_key).await {
        Ok(hit) => match still_valid(&hit) {
            Some(p) => return Ok(p),
            None => {
                auth.verified.remove(&cache_key);
                None
            }
        },
        Err(guard) => Some(guard),
    };
    let (name, password) = basic(value).map_err(|why| (unauthorized(why), Some((crate::audit::Event::LoginFailed, String::new()))))?;
    let mut keys = vec![FailureKey::Source(source)];
    if meta.users.contains_key(&name) {
        keys.push(FailureKey::User(name.clone()));
    }
    if let Some(wait) = auth.failures.wait(&keys, Instant::now()) {
        return Err((too_many(wait), Some((crate::audit::Event::LoginPaused, name))));
    }
    let hash = meta.users.get(&name).map(|u| u.hash.clone());
    let check = hash.clone().unwrap_or_else(|| auth.decoy.clone());
    let ok = state.cpu.run(move || verify_password(&password, &check)).await.unwrap_or(false) && hash.is_some();
    if !ok {
        auth.failures.failed(&keys, Instant::now());
        metrics::counter!("shoal_login_failures_total").increment(1);
        tracing::info!(user = %name.chars().take(64).collect::<String>(), source = %source, "login failed");
        return Err((unauthorized("wrong user name or password"), Some((crate::audit::Event::LoginFailed, name))));
    }
    auth.failures.succeeded(&keys);
    let hash = hash.unwrap_or_default();
    let roles = meta.users.get(&name).map(|u| u.roles.clone()).unwrap_or_default();
    let principal = Arc::new(Principal { name, roles });
    let entry = Arc::new((hash, Arc::clone(&principal)));
    match guard {
        Some(guard) => {
            let _ = guard.insert(entry);
        }
        None => auth.verified.insert(cache_key, entry),
    }
    Ok(principal)
}

/// The signed user a request passes on to another member: the one it carries (signed by
/// the member that passed it here, or by [`authenticate`]), else its `principal` signed now.
pub(crate) fn user_to_pass_on(state: &AppState, headers: &axum::http::HeaderMap, principal: Option<&Principal>) -> Option<HeaderValue> {
    if let Some(signed) = headers.get(&USER_HEADER_NAME) {
        return Some(signed.clone());
    }
    Some(state.auth.signed_user(state.cluster.secret(), &principal?.name))
}

/// The principal a handler runs for (set by [`authenticate`]).
pub fn principal(extensions: &axum::http::Extensions) -> Result<Arc<Principal>, ApiError> {
    extensions.get::<Arc<Principal>>().cloned().ok_or_else(|| ApiError::internal("a route ran without its caller authenticated"))
}

/// Whether `principal` may give or take `target`'s roles: an admin may do anything; a
/// cluster admin may not touch an admin, nor make one.
pub fn may_manage(principal: &Principal, target_is_admin: bool, grants_admin: bool) -> bool {
    principal.roles.contains(&Role::Admin) || (!target_is_admin && !grants_admin)
}

/// The file of a node's first data path holding the password the first start gave `admin`.
pub const ADMIN_PASSWORD_FILE: &str = "admin-password";
/// How often a node looks whether the cluster still needs its first admin.
const FIRST_ADMIN_POLL: Duration = Duration::from_millis(250);

/// The first start's admin, when its password was generated (to be told once).
#[derive(Clone, Debug)]
pub struct FirstAdmin {
    pub password: String,
    pub file: std::path::PathBuf,
}

/// Makes the cluster's first user, `admin`, if it has none: done by the metadata leader,
/// with `given` as its password or a generated one written first to
/// [`ADMIN_PASSWORD_FILE`] (mode 0600) and sent on `told`. Ends once the cluster has a user.
pub(crate) async fn ensure_first_admin(state: AppState, given: Option<String>, told: tokio::sync::watch::Sender<Option<FirstAdmin>>) {
    let mut shutdown = state.shutdown.clone();
    loop {
        let meta = state.cluster.state();
        if !meta.users.is_empty() {
            return;
        }
        if state.cluster.is_leader() && !meta.cluster_id.is_empty() {
            match first_admin(&state, given.clone()).await {
                Ok(Some(made)) => {
                    tracing::warn!(file = %made.file.display(), "created user admin with a generated password, kept in the file");
                    told.send_replace(Some(made));
                    return;
                }
                Ok(None) => return,
                Err(e) => tracing::warn!(error = %e.reason, "creating the first admin; will try again"),
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(FIRST_ADMIN_POLL) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
    }
}

async fn first_admin(state: &AppState, given: Option<String>) -> Result<Option<FirstAdmin>, ApiError> {
    let dir = state.engine.store().data_paths()[0].clone();
    let file = dir.join(ADMIN_PASSWORD_FILE);
    let (password, generated) = match given {
        Some(p) => (p, false),
        None => (generate_password(), true),
    };
    if generated {
        // Kept before it is committed: a crash in between must not leave an admin whose
        // password no one has.
        write_private(&dir, ADMIN_PASSWORD_FILE, password.as_bytes())
            .map_err(|e| ApiError::unavailable(format!("cannot write {}: {e}", file.display())))?;
    }
    let pw = password.clone();
    let hash = state.cpu.run(move || hash_password(&pw)).await??;
    match state.cluster.create_first_admin(shoal_meta::User { hash, roles: vec![Role::Admin] }).await {
        Ok(()) => Ok(generated.then_some(FirstAdmin { password, file })),
        Err(shoal_node::ClusterError::Rejected(shoal_meta::MetaReject::UsersExist)) => {
            if generated {
                let _ = std::fs::remove_file(&file);
            }
            Ok(None)
        }
        Err(e) => Err(crate::error::cluster_error(e)),
    }
}

/// Writes `name` in `dir` readable by this user only (mode 0600 from its creation), then
/// renames it into place.
fn write_private(dir: &std::path::Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut f = options.open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, dir.join(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_credentials_are_parsed_and_malformed_ones_refused() {
        let enc = |s: &str| HeaderValue::from_str(&format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(s))).unwrap();
        assert_eq!(basic(&enc("admin:pw:with:colons")).unwrap(), ("admin".into(), "pw:with:colons".into()));
        assert_eq!(basic(&HeaderValue::from_static("basic YTpi")).unwrap(), ("a".into(), "b".into()));
        for bad in [
            HeaderValue::from_static("Basic"),
            HeaderValue::from_static("Bearer abc"),
            HeaderValue::from_static("Basic !!!notbase64"),
            enc("no-colon"),
            HeaderValue::from_str(&format!("Basic {}", "A".repeat(AUTHORIZATION_MAX_BYTES))).unwrap(),
            HeaderValue::from_bytes(b"Basic \xff\xfe").unwrap(),
        ] {
            assert!(basic(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_signed_user_verifies_only_with_the_secret_and_in_time() {
        let v = signed_user("secret-one", "alice");
        assert_eq!(verify_signed("secret-one", &v).as_deref(), Some("alice"));
        assert_eq!(verify_signed("secret-two", &v), None);
        let text = v.to_str().unwrap();
        let forged = text.replacen("alice", "admin", 1);
        assert_eq!(verify_signed("secret-one", &HeaderValue::from_str(&forged).unwrap()), None);
        let expired = format!("alice 1 {}", signature("secret-one", "alice", 1));
        assert_eq!(verify_signed("secret-one", &HeaderValue::from_str(&expired).unwrap()), None);
        let far = unix_now() + 86_400;
        let too_long = format!("alice {far} {}", signature("secret-one", "alice", far));
        assert_eq!(verify_signed("secret-one", &HeaderValue::from_str(&too_long).unwrap()), None);
    }

    #[test]
    fn passwords_hash_and_verify() {
        let h = hash_password("correct horse").unwrap();
        assert!(h.starts_with("$argon2id$"), "{h}");
        assert!(verify_password("correct horse", &h));
        assert!(!verify_password("correct horsf", &h));
        assert!(!verify_password("x", "not a hash"));
        assert_ne!(hash_password("correct horse").unwrap(), h, "salted");
        assert_eq!(generate_password().len(), GENERATED_PASSWORD_CHARS);
    }

    #[test]
    fn failures_pause_a_source_then_forget_it() {
        assert_eq!(failure_pause(FAILURES_FREE - 1), Duration::ZERO);
        assert_eq!(failure_pause(FAILURES_FREE), Duration::from_secs(1));
        assert_eq!(failure_pause(FAILURES_FREE + 3), Duration::from_secs(8));
        assert_eq!(failure_pause(1000), FAILURE_PAUSE_MAX);
        let f = Failures::default();
        let t0 = Instant::now();
        let bad = [FailureKey::Source(IpAddr::from([10, 0, 0, 1]))];
        let other = [FailureKey::Source(IpAddr::from([10, 0, 0, 2]))];
        for _ in 0..FAILURES_FREE {
            assert_eq!(f.wait(&bad, t0), None);
            f.failed(&bad, t0);
        }
        assert_eq!(f.wait(&bad, t0), Some(Duration::from_secs(1)));
        assert_eq!(f.wait(&other, t0), None, "another source is not slowed");
        assert_eq!(f.wait(&bad, t0 + Duration::from_secs(2)), None, "after the pause");
        f.failed(&bad, t0 + FAILURE_MEMORY + Duration::from_secs(1));
        assert_eq!(f.wait(&bad, t0 + FAILURE_MEMORY + Duration::from_secs(1)), None, "old failures are forgotten");
        f.succeeded(&bad);
        assert_eq!(f.by.lock().len(), 0);
    }

    /// A flood of sources failing at once (faster than `FAILURE_MEMORY` forgets them)
    /// keeps at most `FAILURES_TRACKED` counts, and the newest failures are among them.
    #[test]
    fn failure_counts_stay_within_their_bound() {
        let f = Failures::default();
        let t0 = Instant::now();
        let source = |i: usize| FailureKey::Source(IpAddr::from((i as u32 + 1).to_be_bytes()));
        for i in 0..FAILURES_TRACKED * 2 + 10 {
            f.failed(&[source(i)], t0 + Duration::from_millis(i as u64));
            assert!(f.by.lock().len() <= FAILURES_TRACKED, "after {i} sources");
        }
        let newest = FAILURES_TRACKED * 2 + 9;
        assert_eq!(f.by.lock().get(&source(newest)).map(|x| x.count), Some(1));
    }

    /// The credential cache and the signed users kept per user name stay within
    /// `CREDENTIALS_CACHED`, however many distinct callers come.
    #[test]
    fn cached_credentials_and_signatures_stay_within_their_bound() {
        let dir = std::env::temp_dir().join(format!("shoal-auth-bound-{}", std::process::id()));
        let auth = Auth::new(&dir);
        for i in 0..CREDENTIALS_CACHED + 500 {
            let header = format!("Basic {i}");
            let principal = Arc::new(Principal { name: format!("u{i}"), roles: vec![] });
            auth.verified.insert(keyed_hash(auth.key, header.as_bytes()), Arc::new(("h".to_string(), principal)));
            let _ = auth.signed_user("secret", &format!("u{i}"));
            assert!(auth.signed.lock().len() <= CREDENTIALS_CACHED, "after {i} users");
        }
        assert!(auth.verified.len() <= CREDENTIALS_CACHED, "{} cached", auth.verified.len());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
