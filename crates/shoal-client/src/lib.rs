//! Rust client for Shoal's HTTP API (shared/API.md): pooled keep-alive connections over
//! HTTP/1.1, or HTTP/2 without TLS (h2c) where many requests share one connection.
//!
//! Used by the `shoal` CLI and its load generators. Knows HTTP, not the terminal.

use std::time::Duration;

use bytes::Bytes;
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use serde::Deserialize;
use thiserror::Error;

/// Characters left as they are in a path segment: RFC 3986 unreserved.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'.').remove(b'~');
/// Default time a request may take before the client gives up.
pub const REQUEST_TIMEOUT_DEFAULT: Duration = Duration::from_secs(120);
/// `add_node` waits for the node to restart and be admitted (the server waits up to 60 s).
pub const ADD_NODE_TIMEOUT: Duration = Duration::from_secs(90);

#[derive(Debug, Error)]
pub enum ClientError {
    /// The server answered with an API error.
    #[error("{code}: {reason} (HTTP {status})")]
    Api { status: u16, code: String, reason: String },
    /// The request did not get an answer; the message names each cause (a refused
    /// connection, a certificate the CA did not sign...).
    #[error("request failed: {}", error_chain(.0))]
    Http(#[from] reqwest::Error),
    /// The TLS configuration (`tls_ca`) could not be used.
    #[error("TLS: {0}")]
    Tls(String),
    #[error("unexpected answer: {0}")]
    Decode(String),
    #[error("invalid base URL {0:?}")]
    Url(String),
}

/// An error with its causes, outermost first (reqwest's own message hides them: a TLS
/// error reads "error sending request").
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}

impl ClientError {
    /// The API error code, if the server gave one.
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Api { code, .. } => Some(code),
            _ => None,
        }
    }
}

/// How a client connects.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Speak HTTP/2 over cleartext from the first byte (h2c prior knowledge).
    pub http2: bool,
    pub timeout: Duration,
    /// Idle connections kept per host.
    pub pool_max_idle: usize,
    /// The CA certificates (PEM file) an `https://` server is verified by; `None` trusts
    /// the system's roots. The default is `SHOAL_TLS_CA`, as curl reads `CURL_CA_BUNDLE`.
    pub tls_ca: Option<std::path::PathBuf>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            http2: false,
            timeout: REQUEST_TIMEOUT_DEFAULT,
            pool_max_idle: 256,
            tls_ca: std::env::var_os("SHOAL_TLS_CA").filter(|v| !v.is_empty()).map(std::path::PathBuf::from),
        }
    }
}

/// Makes `ring` the process's TLS provider, if none is: reqwest (built without one, so
/// that nothing needs a C toolchain) builds a TLS configuration for every client from it,
/// `https` or not. Idempotent.
pub fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The TLS client configuration of an `https://` server verified by the CA in `ca` (PEM),
/// or by the system's roots.
fn tls_config(ca: Option<&std::path::Path>, http2: bool) -> Result<rustls::ClientConfig, ClientError> {
    use rustls::pki_types::pem::PemObject;
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ClientError::Tls(e.to_string()))?;
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(ca) => {
            let certs = rustls::pki_types::CertificateDer::pem_file_iter(ca)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| ClientError::Tls(format!("{}: {e}", ca.display())))?;
            if roots.add_parsable_certificates(certs).0 == 0 {
                return Err(ClientError::Tls(format!("{}: no CA certificate in it (PEM)", ca.display())));
            }
        }
        // The system's roots, where the platform keeps them.
        None => {
            for path in SYSTEM_CA_FILES {
                if let Ok(certs) = rustls::pki_types::CertificateDer::pem_file_iter(path) {
                    roots.add_parsable_certificates(certs.filter_map(Result::ok));
                }
            }
        }
    }
    let mut config = builder.with_root_certificates(roots).with_no_client_auth();
    config.alpn_protocols = vec![if http2 { b"h2".to_vec() } else { b"http/1.1".to_vec() }];
    Ok(config)
}

/// Where Linux distributions keep their CA bundle.
const SYSTEM_CA_FILES: &[&str] = &["/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem"];

/// A document as read.
#[derive(Clone, Debug)]
pub struct Doc {
    pub cas: String,
    pub value: Bytes,
}

/// What every mutation answers.
#[derive(Clone, Debug, Deserialize, serde::Serialize, PartialEq, Eq)]
pub struct Mutation {
    pub cas: String,
    pub token: MutationToken,
}

#[derive(Clone, Debug, Deserialize, serde::Serialize, PartialEq, Eq)]
pub struct MutationToken {
    pub partition: u16,
    pub seqno: u64,
    pub uuid: String,
}

#[derive(Clone, Debug, Deserialize, serde::Serialize, PartialEq, Eq)]
pub struct CollectionInfo {
    pub name: String,
    pub docs: u64,
    pub bytes: u64,
    #[serde(default)]
    pub max_ttl: u32,
}

/// How a put treats an existing document.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PutMode {
    #[default]
    Upsert,
    Insert,
    Replace,
}

#[derive(Clone, Debug, Default)]
pub struct PutOptions {
    pub mode: PutMode,
    /// Replace only at this CAS.
    pub cas: Option<String>,
    pub expiry: Option<u64>,
    pub persist: bool,
}

/// Options of a change feed request.
#[derive(Clone, Debug, Default)]
pub struct ChangesOptions {
    pub since: Option<String>,
    /// `normal`, `longpoll` or `continuous`.
    pub feed: Option<String>,
    pub limit: Option<usize>,
    pub include_docs: bool,
    pub timeout_ms: Option<u64>,
}

#[derive(Clone, Debug)]
pub struct Client {
    http: reqwest::Client,
    base: String,
}

impl Client {
    pub fn new(url: &str) -> Result<Client, ClientError> {
        Client::with_options(url, ClientOptions::default())
    }

    pub fn with_options(url: &str, options: ClientOptions) -> Result<Client, ClientError> {
        let base = url.trim_end_matches('/').to_string();
        install_crypto();
        let https = base.starts_with("https://");
        if !base.starts_with("http://") && !https {
            return Err(ClientError::Url(url.to_string()));
        }
        let mut builder =
            reqwest::Client::builder().timeout(options.timeout).pool_max_idle_per_host(options.pool_max_idle).tcp_nodelay(true).no_proxy();
        if https {
            builder = builder.tls_backend_preconfigured(tls_config(options.tls_ca.as_deref(), options.http2)?);
        }
        if options.http2 {
            builder = builder.http2_prior_knowledge();
        } else {
            builder = builder.http1_only();
        }
        Ok(Client { http: builder.build()?, base })
    }

    pub fn base_url(&self) -> &str {
        &self.base
    }

    fn collection_url(&self, collection: &str) -> String {
        format!("{}/v1/collections/{}", self.base, seg(collection))
    }

    fn doc_url(&self, collection: &str, key: &str) -> String {
        format!("{}/docs/{}", self.collection_url(collection), seg(key))
    }

    pub async fn health(&self) -> Result<serde_json::Value, ClientError> {
        json(self.http.get(format!("{}/v1/health", self.base)).send().await?).await
    }

    pub async fn node(&self) -> Result<serde_json::Value, ClientError> {
        json(self.http.get(format!("{}/v1/node", self.base)).send().await?).await
    }

    pub async fn create_collection(&self, name: &str, max_ttl: Option<u32>) -> Result<(), ClientError> {
        let mut req = self.http.put(self.collection_url(name));
        if let Some(ttl) = max_ttl {
            req = req.json(&serde_json::json!({ "max_ttl": ttl }));
        }
        ok(req.send().await?).await.map(|_| ())
    }

    pub async fn list_collections(&self) -> Result<Vec<CollectionInfo>, ClientError> {
        json(self.http.get(format!("{}/v1/collections", self.base)).send().await?).await
    }

    pub async fn drop_collection(&self, name: &str) -> Result<(), ClientError> {
        ok(self.http.delete(self.collection_url(name)).send().await?).await.map(|_| ())
    }

    /// Get; with `lock` seconds a get-and-lock, with `touch` seconds a get-and-touch.
    pub async fn get(&self, collection: &str, key: &str, lock: Option<u32>, touch: Option<u64>) -> Result<Doc, ClientError> {
        let mut req = self.http.get(self.doc_url(collection, key));
        if let Some(s) = lock {
            req = req.query(&[("lock", s.to_string())]);
        }
        if let Some(s) = touch {
            req = req.query(&[("touch", s.to_string())]);
        }
        let resp = ok(req.send().await?).await?;
        let cas = resp.headers().get("etag").and_then(|v| v.to_str().ok()).map(|s| s.trim_matches('"').to_string()).unwrap_or_default();
        Ok(Doc { cas, value: resp.bytes().await? })
    }

    pub async fn put(&self, collection: &str, key: &str, value: impl Into<Bytes>, options: &PutOptions) -> Result<Mutation, ClientError> {
        let mut req = self.http.put(self.doc_url(collection, key)).header("content-type", "application/json").body(value.into());
        req = match (&options.mode, &options.cas) {
            (_, Some(cas)) => req.header("if-match", format!("\"{cas}\"")),
            (PutMode::Insert, None) => req.header("if-none-match", "*"),
            (PutMode::Replace, None) => req.header("if-match", "*"),
            (PutMode::Upsert, None) => req,
        };
        if let Some(e) = options.expiry {
            req = req.query(&[("expiry", e.to_string())]);
        }
        if options.persist {
            req = req.query(&[("durability", "persist")]);
        }
        json(req.send().await?).await
    }

    pub async fn remove(&self, collection: &str, key: &str, cas: Option<&str>, persist: bool) -> Result<Mutation, ClientError> {
        let mut req = self.http.delete(self.doc_url(collection, key));
        if let Some(cas) = cas {
            req = req.header("if-match", format!("\"{cas}\""));
        }
        if persist {
            req = req.query(&[("durability", "persist")]);
        }
        json(req.send().await?).await
    }

    pub async fn touch(&self, collection: &str, key: &str, expiry: u64) -> Result<Mutation, ClientError> {
        let req = self.http.post(format!("{}/touch", self.doc_url(collection, key))).query(&[("expiry", expiry.to_string())]);
        json(req.send().await?).await
    }

    pub async fn unlock(&self, collection: &str, key: &str, cas: &str) -> Result<(), ClientError> {
        let req = self.http.post(format!("{}/unlock", self.doc_url(collection, key))).header("if-match", format!("\"{cas}\""));
        ok(req.send().await?).await.map(|_| ())
    }

    pub async fn multi_get(&self, collection: &str, keys: &[String]) -> Result<serde_json::Value, ClientError> {
        let req = self.http.post(format!("{}/_get", self.collection_url(collection))).json(&serde_json::json!({ "keys": keys }));
        json(req.send().await?).await
    }

    /// Sub-document lookup: `specs` as API.md gives them; answers `{"cas", "results"}`.
    pub async fn lookup(&self, collection: &str, key: &str, specs: &serde_json::Value) -> Result<serde_json::Value, ClientError> {
        let req = self.http.post(format!("{}/lookup", self.doc_url(collection, key))).json(&serde_json::json!({ "specs": specs }));
        json(req.send().await?).await
    }

    /// Sub-document mutate: `body` is the whole request object (`specs`, `store`, `cas`, ...).
    pub async fn mutate(&self, collection: &str, key: &str, body: &serde_json::Value) -> Result<serde_json::Value, ClientError> {
        let req = self.http.post(format!("{}/mutate", self.doc_url(collection, key))).json(body);
        json(req.send().await?).await
    }

    fn index_url(&self, collection: &str, name: &str) -> String {
        format!("{}/indexes/{}", self.collection_url(collection), seg(name))
    }

    /// Defines an index: `def` is `{"name", "keys", "where"?, "defer_build"?}`; answers its status.
    pub async fn create_index(&self, collection: &str, def: &serde_json::Value) -> Result<serde_json::Value, ClientError> {
        let req = self.http.post(format!("{}/indexes", self.collection_url(collection))).json(def);
        json(req.send().await?).await
    }

    /// Every index of the collection with state, progress and item count.
    pub async fn list_indexes(&self, collection: &str) -> Result<Vec<serde_json::Value>, ClientError> {
        json(self.http.get(format!("{}/indexes", self.collection_url(collection))).send().await?).await
    }

    pub async fn build_index(&self, collection: &str, name: &str) -> Result<serde_json::Value, ClientError> {
        json(self.http.post(format!("{}/build", self.index_url(collection, name))).send().await?).await
    }

    /// Builds several deferred indexes together (one read of the documents).
    pub async fn build_indexes(&self, collection: &str, names: &[&str]) -> Result<serde_json::Value, ClientError> {
        let req =
            self.http.post(format!("{}/indexes/_build", self.collection_url(collection))).json(&serde_json::json!({ "names": names }));
        json(req.send().await?).await
    }

    pub async fn drop_index(&self, collection: &str, name: &str) -> Result<(), ClientError> {
        ok(self.http.delete(self.index_url(collection, name)).send().await?).await.map(|_| ())
    }

    /// Scans an index: `request` is the scan object of API.md; answers `{"rows": [...]}`.
    pub async fn scan_index(&self, collection: &str, name: &str, request: &serde_json::Value) -> Result<serde_json::Value, ClientError> {
        json(self.http.post(format!("{}/scan", self.index_url(collection, name))).json(request).send().await?).await
    }

    /// Runs one SQL statement: `request` is `{"sql", "params"?, "consistency"?, "timeout_ms"?}`;
    /// answers `{"columns", "rows", "metrics"}`.
    pub async fn query(&self, request: &serde_json::Value) -> Result<serde_json::Value, ClientError> {
        json(self.http.post(format!("{}/v1/query", self.base)).json(request).send().await?).await
    }

    /// `POST /v1/analytics`: the same request, over the columnar shadows.
    pub async fn analytics(&self, request: &serde_json::Value) -> Result<serde_json::Value, ClientError> {
        json(self.http.post(format!("{}/v1/analytics", self.base)).json(request).send().await?).await
    }

    /// Sends NDJSON operation lines; answers the NDJSON result lines, one per operation.
    pub async fn bulk(&self, collection: &str, ndjson: impl Into<Bytes>, persist: bool) -> Result<Bytes, ClientError> {
        let mut req = self
            .http
            .post(format!("{}/_bulk", self.collection_url(collection)))
            .header("content-type", "application/x-ndjson")
            .body(ndjson.into());
        if persist {
            req = req.query(&[("durability", "persist")]);
        }
        Ok(ok(req.send().await?).await?.bytes().await?)
    }

    /// Opens a change feed; the response body streams NDJSON lines.
    pub async fn changes(&self, collection: &str, options: &ChangesOptions) -> Result<reqwest::Response, ClientError> {
        let mut query: Vec<(&str, String)> = Vec::new();
        if let Some(s) = &options.since {
            query.push(("since", s.clone()));
        }
        if let Some(f) = &options.feed {
            query.push(("feed", f.clone()));
        }
        if let Some(l) = options.limit {
            query.push(("limit", l.to_string()));
        }
        if options.include_docs {
            query.push(("include_docs", "true".into()));
        }
        if let Some(t) = options.timeout_ms {
            query.push(("timeout", t.to_string()));
        }
        let req = self.http.get(format!("{}/changes", self.collection_url(collection))).query(&query);
        ok(req.send().await?).await
    }
}

/// The cluster calls (API.md, Cluster).
impl Client {
    fn cluster_url(&self, tail: &str) -> String {
        format!("{}/v1/cluster{tail}", self.base)
    }

    /// `GET /v1/cluster`: members, states, partitions, health, settings.
    pub async fn cluster(&self) -> Result<serde_json::Value, ClientError> {
        json(self.http.get(self.cluster_url("")).send().await?).await
    }

    /// `GET /v1/cluster/map`: the partition map smart clients route by.
    pub async fn cluster_map(&self) -> Result<serde_json::Value, ClientError> {
        json(self.http.get(self.cluster_url("/map")).send().await?).await
    }

    /// `PUT /v1/cluster/settings` with the settings to change.
    pub async fn cluster_settings(&self, patch: &serde_json::Value) -> Result<serde_json::Value, ClientError> {
        json(self.http.put(self.cluster_url("/settings")).json(patch).send().await?).await
    }

    /// `POST /v1/cluster/failover`: fails `node` over now.
    pub async fn failover(&self, node: u64) -> Result<serde_json::Value, ClientError> {
        json(self.http.post(self.cluster_url("/failover")).json(&serde_json::json!({"node": node})).send().await?).await
    }

    /// `POST /v1/cluster/nodes`: the lone, empty node at `address` joins as `added`.
    /// Answers once it is a member (it restarts to join: this call may take a while).
    pub async fn add_node(&self, address: &str) -> Result<serde_json::Value, ClientError> {
        let request = self.http.post(self.cluster_url("/nodes")).json(&serde_json::json!({"address": address}));
        json(request.timeout(ADD_NODE_TIMEOUT).send().await?).await
    }

    /// `POST /v1/cluster/recover`: a failed-over node that is back becomes `added`.
    pub async fn recover(&self, node: u64) -> Result<serde_json::Value, ClientError> {
        json(self.http.post(self.cluster_url("/recover")).json(&serde_json::json!({"node": node})).send().await?).await
    }

    /// `POST /v1/cluster/rebalance`: starts one, ejecting `eject`; answers `{"moves"}`.
    pub async fn rebalance(&self, eject: &[u64]) -> Result<serde_json::Value, ClientError> {
        json(self.http.post(self.cluster_url("/rebalance")).json(&serde_json::json!({"eject": eject})).send().await?).await
    }

    /// `GET /v1/cluster/rebalance`: the running or last rebalance.
    pub async fn rebalance_status(&self) -> Result<serde_json::Value, ClientError> {
        json(self.http.get(self.cluster_url("/rebalance")).send().await?).await
    }
}

fn seg(s: &str) -> String {
    utf8_percent_encode(s, SEGMENT).to_string()
}

/// Passes a success through; turns an error status into [`ClientError::Api`].
async fn ok(resp: reqwest::Response) -> Result<reqwest::Response, ClientError> {
    if resp.status().is_success() {
        return Ok(resp);
    }
    let status = resp.status().as_u16();
    let body = resp.bytes().await?;
    #[derive(Deserialize)]
    struct ErrorBody {
        error: String,
        reason: String,
    }
    match serde_json::from_slice::<ErrorBody>(&body) {
        Ok(e) => Err(ClientError::Api { status, code: e.error, reason: e.reason }),
        Err(_) => Err(ClientError::Api { status, code: "unknown".into(), reason: String::from_utf8_lossy(&body).into_owned() }),
    }
}

async fn json<T: serde::de::DeserializeOwned>(resp: reqwest::Response) -> Result<T, ClientError> {
    let body = ok(resp).await?.bytes().await?;
    serde_json::from_slice(&body).map_err(|e| ClientError::Decode(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_encoded_as_one_segment() {
        assert_eq!(seg("a/b c%"), "a%2Fb%20c%25");
        assert_eq!(seg("plain-key_1.x~"), "plain-key_1.x~");
    }

    #[test]
    fn only_http_urls() {
        assert!(Client::new("ftp://x").is_err());
        assert!(Client::new("http://127.0.0.1:7070/").is_ok());
    }
}
