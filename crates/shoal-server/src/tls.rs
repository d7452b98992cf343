//! TLS: the node's certificate for its clients, and the members' certificates for each
//! other (rustls with the `ring` provider: no C toolchain).
//!
//! A node started with `--tls-cert`, `--tls-key` and `--tls-ca` speaks only TLS on its port
//! (HTTP/1.1 and h2 by ALPN). Members talk to each other over TLS only, and verify each
//! other by the CA: the caller checks the member's certificate as any client would, and
//! presents its own certificate, which the member checks before it takes a call between
//! members (`MemberCert`); the cluster secret is still asked for on top.
//!
//! Files are read at the start and again on `SIGHUP` ([`Tls::reload`]): a new server
//! configuration is swapped in for new connections (open ones keep theirs), and the
//! members' client side reads the current certificate and CA through [`Current`] on each
//! new connection. A reload that fails (a file missing, a key that does not match) keeps
//! what was loaded, and says why.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::ResolvesClientCert;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;
use rustls::{client::WebPkiServerVerifier, ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};

/// How long a client has to finish its TLS handshake after connecting.
pub const TLS_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// The largest certificate, key or CA file read (a CA bundle of a few hundred roots fits).
pub const TLS_FILE_MAX_BYTES: u64 = 1 << 20;

/// The first byte of every TLS connection (a handshake record).
pub(crate) const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// The files a node's TLS is read from.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// The node's certificate chain (PEM), leaf first.
    pub cert: PathBuf,
    /// The certificate's private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The CA certificates (PEM) members verify each other by.
    pub ca: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {why}")]
    File { path: PathBuf, why: String },
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// What was read from the files.
#[derive(Debug)]
struct Loaded {
    key: Arc<CertifiedKey>,
    server_verifier: Arc<WebPkiServerVerifier>,
}

/// The node's TLS: the server configuration for new connections, and the client
/// configurations members call each other with.
pub struct Tls {
    files: TlsFiles,
    provider: Arc<CryptoProvider>,
    current: Arc<ArcSwap<Loaded>>,
    server: ArcSwap<ServerConfig>,
    /// For calls between members over HTTP/1.1 (reqwest) and h2 (the analytics workers).
    peer_http1: Arc<ClientConfig>,
    peer_h2: Arc<ClientConfig>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").field("files", &self.files).finish()
    }
}

impl Tls {
    /// Reads the files; an error names the file and what is wrong with it.
    pub fn load(files: TlsFiles) -> Result<Arc<Tls>, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let (loaded, server) = read(&files, &provider)?;
        let current = Arc::new(ArcSwap::from_pointee(loaded));
        let peer = |alpn: &[u8]| -> Result<Arc<ClientConfig>, TlsError> {
            let mut config = ClientConfig::builder_with_provider(Arc::clone(&provider))
                .with_safe_default_protocol_versions()
                .map_err(config_error)?
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(Current(Arc::clone(&current))))
                .with_client_cert_resolver(Arc::new(Current(Arc::clone(&current))));
            config.alpn_protocols = vec![alpn.to_vec()];
            Ok(Arc::new(config))
        };
        let (peer_http1, peer_h2) = (peer(b"http/1.1")?, peer(b"h2")?);
        Ok(Arc::new(Tls { files, provider, current, server: ArcSwap::from_pointee(server), peer_http1, peer_h2 }))
    }

    /// Reads the files again (on `SIGHUP`); on an error what was loaded stays.
    pub fn reload(&self) -> Result<(), TlsError> {
        let (loaded, server) = read(&self.files, &self.provider)?;
        self.current.store(Arc::new(loaded));
        self.server.store(Arc::new(server));
        Ok(())
    }

    /// The configuration a new connection is served with.
    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.server.load_full()
    }

    /// The client configuration of calls to other members over HTTP/1.1.
    pub fn peer_http1(&self) -> Arc<ClientConfig> {
        Arc::clone(&self.peer_http1)
    }

    /// The client configuration of calls to other members over h2 (gRPC).
    pub fn peer_h2(&self) -> Arc<ClientConfig> {
        Arc::clone(&self.peer_h2)
    }
}

fn config_error(e: impl std::fmt::Display) -> TlsError {
    TlsError::Config(e.to_string())
}

fn read_file(path: &Path) -> Result<Vec<u8>, TlsError> {
    let fail = |why: String| TlsError::File { path: path.to_path_buf(), why };
    let len = std::fs::metadata(path).map_err(|e| fail(e.to_string()))?.len();
    if len > TLS_FILE_MAX_BYTES {
        return Err(fail(format!("{len} bytes; the most read is {TLS_FILE_MAX_BYTES}")));
    }
    std::fs::read(path).map_err(|e| fail(e.to_string()))
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read_file(path)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::File { path: path.to_path_buf(), why: format!("not PEM certificates: {e}") })?;
    if certs.is_empty() {
        return Err(TlsError::File { path: path.to_path_buf(), why: "no certificate in it (PEM, `BEGIN CERTIFICATE`)".into() });
    }
    Ok(certs)
}

fn read(files: &TlsFiles, provider: &Arc<CryptoProvider>) -> Result<(Loaded, ServerConfig), TlsError> {
    let chain = certificates(&files.cert)?;
    let key_bytes = read_file(&files.key)?;
    let key = PrivateKeyDer::from_pem_slice(&key_bytes)
        .map_err(|e| TlsError::File { path: files.key.clone(), why: format!("no private key in it (PEM): {e}") })?;
    let key = CertifiedKey::from_der(chain, key, provider)
        .map_err(|e| TlsError::File { path: files.key.clone(), why: format!("not the key of {}: {e}", files.cert.display()) })?;
    let mut roots = RootCertStore::empty();
    for ca in certificates(&files.ca)? {
        roots.add(ca).map_err(|e| TlsError::File { path: files.ca.clone(), why: format!("not a CA certificate: {e}") })?;
    }
    let roots = Arc::new(roots);
    let server_verifier =
        WebPkiServerVerifier::builder_with_provider(Arc::clone(&roots), Arc::clone(provider)).build().map_err(config_error)?;
    // Clients need no certificate; a member's is checked (and marks its calls).
    let client_verifier =
        WebPkiClientVerifier::builder_with_provider(roots, Arc::clone(provider)).allow_unauthenticated().build().map_err(config_error)?;
    let key = Arc::new(key);
    let mut server = ServerConfig::builder_with_provider(Arc::clone(provider))
        .with_safe_default_protocol_versions()
        .map_err(config_error)?
        .with_client_cert_verifier(client_verifier)
        .with_cert_resolver(Arc::new(Single(Arc::clone(&key))));
    server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok((Loaded { key, server_verifier }, server))
}

/// The server's one certificate.
#[derive(Debug)]
struct Single(Arc<CertifiedKey>);

impl rustls::server::ResolvesServerCert for Single {
    fn resolve(&self, _client_hello: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.0))
    }
}

/// The members' client side, reading what is loaded now.
#[derive(Debug)]
struct Current(Arc<ArcSwap<Loaded>>);

impl ServerCertVerifier for Current {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.0.load().server_verifier.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.load().server_verifier.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.load().server_verifier.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.load().server_verifier.supported_verify_schemes()
    }
}

impl ResolvesClientCert for Current {
    fn resolve(&self, _root_hint_subjects: &[&[u8]], _sigschemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.0.load().key))
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// A call arrived over TLS with a client certificate the CA signed: from a member.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MemberCert;
