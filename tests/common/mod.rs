//! Starts the real `shoal` binary on a loopback port with a real data directory.
#![allow(dead_code)]

pub mod cluster;
pub mod faults;
pub mod history;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The internal calls between members that read their bodies as client requests do (size
/// cap, read timeout): the index service's, the analytics preparation's, the shadow's
/// copies, a DDL's wait. Every such call belongs here, so the oversized and trickled-body
/// tests try each of them.
pub const INTERNAL_BODY_CALLS: [&str; 10] = [
    "feed",
    "highs",
    "index-export",
    "index-adopt",
    "index-prepare",
    "index-scan",
    "shadow-fields",
    "shadow-rows",
    "shadow-export",
    "applied",
];

/// The password every test node gives its first admin (`SHOAL_ADMIN_PASSWORD`).
pub const ADMIN_PASSWORD: &str = "test-admin-password";

/// The `Authorization` header of the test nodes' admin.
pub fn admin_auth() -> String {
    basic_auth("admin", ADMIN_PASSWORD)
}

/// A Basic `Authorization` header for `user` and `password`.
pub fn basic_auth(user: &str, password: &str) -> String {
    use base64::Engine as _;
    format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}")))
}

/// A client builder whose requests carry the admin's credentials (and that trusts the
/// test CA, for nodes started with [`tls_flags`]).
pub fn client_builder() -> reqwest::ClientBuilder {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(reqwest::header::AUTHORIZATION, admin_auth().parse().expect("header"));
    plain_client_builder().default_headers(headers)
}

/// A client builder without credentials that trusts the test CA.
pub fn plain_client_builder() -> reqwest::ClientBuilder {
    reqwest::Client::builder().tls_backend_preconfigured(tls_client_config(&test_tls().ca, None))
}

/// Like [`client_builder`], presenting the test nodes' certificate: a member's client (to
/// make calls between members by hand, over TLS).
pub fn member_client_builder() -> reqwest::ClientBuilder {
    let tls = test_tls();
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(reqwest::header::AUTHORIZATION, admin_auth().parse().expect("header"));
    reqwest::Client::builder().default_headers(headers).tls_backend_preconfigured(tls_client_config(&tls.ca, Some((&tls.cert, &tls.key))))
}

/// A TLS client configuration trusting the CA certificates in `ca`, presenting
/// `identity` (certificate, key) if given.
pub fn tls_client_config(ca: &std::path::Path, identity: Option<(&std::path::Path, &std::path::Path)>) -> rustls::ClientConfig {
    use rustls::pki_types::pem::PemObject;
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca).expect("CA file") {
        roots.add(cert.expect("CA certificate")).expect("CA");
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider).with_safe_default_protocol_versions().expect("TLS versions");
    let builder = builder.with_root_certificates(roots);
    let mut config = match identity {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = rustls::pki_types::CertificateDer::pem_file_iter(cert).expect("cert").map(|c| c.expect("cert")).collect();
            builder.with_client_auth_cert(chain, rustls::pki_types::PrivateKeyDer::from_pem_file(key).expect("key")).expect("identity")
        }
    };
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    config
}

/// The test CA and one node certificate for `127.0.0.1` and `localhost` (every test node
/// listens on loopback), made once per test process by `shoal cert`.
pub struct TestTls {
    pub dir: PathBuf,
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

pub fn test_tls() -> &'static TestTls {
    static TLS: std::sync::OnceLock<TestTls> = std::sync::OnceLock::new();
    TLS.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir").keep();
        let out = Command::new(binary())
            .args(["cert", "--dir"])
            .arg(&dir)
            .args(["--host", "127.0.0.1", "--host", "localhost"])
            .output()
            .expect("run shoal cert");
        assert!(out.status.success(), "shoal cert: {}", String::from_utf8_lossy(&out.stderr));
        TestTls { ca: dir.join("ca.pem"), cert: dir.join("node.pem"), key: dir.join("node-key.pem"), dir }
    })
}

/// The `serve` flags of a TLS node with the test CA's certificate.
pub fn tls_flags() -> Vec<&'static str> {
    static FLAGS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let flags = FLAGS.get_or_init(|| {
        let t = test_tls();
        ["--tls-cert", &t.cert.display().to_string(), "--tls-key", &t.key.display().to_string(), "--tls-ca", &t.ca.display().to_string()]
            .iter()
            .map(|s| s.to_string())
            .collect()
    });
    flags.iter().map(String::as_str).collect()
}

/// A client whose requests carry the admin's credentials.
pub fn client() -> reqwest::Client {
    client_builder().build().expect("client")
}

pub struct Node {
    child: Option<Child>,
    pub url: String,
    pub dir: PathBuf,
    args: Vec<String>,
    /// `--listen`: a free port at first; `pin_port` keeps the port for restarts (a
    /// cluster member's address must not change).
    listen: String,
    _tmp: Option<tempfile::TempDir>,
}

impl Node {
    /// A fresh node with its own data directory.
    pub fn start(extra: &[&str]) -> Node {
        let tmp = tempfile::tempdir().expect("tempdir");
        Node::launch(tmp.path().join("data"), extra, Some(tmp))
    }

    /// A node whose data directory is `dir` (on a file system the test prepared).
    pub fn start_in(dir: PathBuf, extra: &[&str]) -> Node {
        Node::launch(dir, extra, None)
    }

    fn launch(dir: PathBuf, extra: &[&str], tmp: Option<tempfile::TempDir>) -> Node {
        let mut node = Node {
            child: None,
            url: String::new(),
            dir,
            args: extra.iter().map(|s| s.to_string()).collect(),
            listen: "127.0.0.1:0".into(),
            _tmp: tmp,
        };
        node.spawn();
        node
    }

    /// Restarts keep this node's port (cluster members are known by their address).
    pub fn pin_port(&mut self) {
        self.listen = self.addr();
    }

    /// `host:port` of the node.
    pub fn addr(&self) -> String {
        self.url.trim_start_matches("https://").trim_start_matches("http://").to_string()
    }

    fn spawn(&mut self) {
        let mut child = Command::new(binary())
            .arg("serve")
            .arg("--listen")
            .arg(&self.listen)
            .arg("--data-path")
            .arg(&self.dir)
            .arg("--cache-mb")
            .arg("32")
            .args(&self.args)
            // `SHOAL_TEST_NODE_LOG` (a `SHOAL_LOG` filter) asks the nodes for more than
            // warnings, each line prefixed with the node's process id (to read a long
            // fault run's log).
            .env("SHOAL_LOG", std::env::var("SHOAL_TEST_NODE_LOG").unwrap_or_else(|_| "warn".into()))
            .env("SHOAL_ADMIN_PASSWORD", ADMIN_PASSWORD)
            .stdout(Stdio::piped())
            .stderr(if std::env::var_os("SHOAL_TEST_NODE_LOG").is_some() { Stdio::piped() } else { Stdio::inherit() })
            .spawn()
            .expect("spawn shoal");
        if let Some(stderr) = child.stderr.take() {
            let pid = child.id();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    eprintln!("[{pid}] {line}");
                }
            });
        }
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let first = lines.next().expect("server printed nothing").expect("read stdout");
        let url = first.strip_prefix("shoal listening on ").unwrap_or_else(|| panic!("unexpected first line {first:?}")).to_string();
        // Keep draining stdout so the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        if std::env::var_os("SHOAL_TEST_NODE_LOG").is_some() {
            eprintln!("[{}] listens at {url}", child.id());
        }
        self.url = url;
        self.child = Some(child);
    }

    /// Sends `signal` (SIGSTOP, SIGCONT, ...) to the node's process.
    pub fn signal(&self, signal: i32) {
        if let Some(child) = &self.child {
            unsafe {
                libc::kill(child.id() as i32, signal);
            }
        }
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// `kill -9`: no chance to flush anything.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM and wait: a clean shutdown. Returns whether the process exited successfully.
    pub fn stop(&mut self) -> bool {
        let Some(mut child) = self.child.take() else { return false };
        unsafe {
            libc::kill(child.id() as i32, libc::SIGTERM);
        }
        child.wait().map(|s| s.success()).unwrap_or(false)
    }

    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "stop or kill the node first");
        self.spawn();
    }

    /// Restarts on the same data with other `serve` flags.
    pub fn restart_with(&mut self, extra: &[&str]) {
        self.args = extra.iter().map(|s| s.to_string()).collect();
        self.restart();
    }

    /// Runs the CLI against this node; returns (success, stdout, stderr).
    pub fn cli(&self, args: &[&str]) -> (bool, String, String) {
        cli(&self.url, args, None)
    }

    pub fn client(&self) -> reqwest::Client {
        client_builder().timeout(Duration::from_secs(60)).build().expect("client")
    }

    pub fn u(&self, path: &str) -> String {
        format!("{}{}", self.url, path)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The `shoal` binary the tests start: this build's, or `SHOAL_TEST_BIN` (to run a test
/// against another build, say to check that a new test fails on an older one).
pub fn binary() -> PathBuf {
    std::env::var_os("SHOAL_TEST_BIN").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_shoal")))
}

pub fn cli(url: &str, args: &[&str], stdin: Option<&str>) -> (bool, String, String) {
    let mut cmd = Command::new(binary());
    cmd.arg("--url").arg(url).args(args).env("SHOAL_LOG", "warn").env("SHOAL_USER", "admin").env("SHOAL_PASSWORD", ADMIN_PASSWORD);
    if url.starts_with("https://") {
        cmd.env("SHOAL_TLS_CA", &test_tls().ca);
    }
    cmd.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() }).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn cli");
    if let Some(input) = stdin {
        use std::io::Write;
        child.stdin.take().expect("stdin").write_all(input.as_bytes()).expect("write stdin");
    }
    let out = child.wait_with_output().expect("cli output");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Parses an NDJSON body into values.
pub fn ndjson(body: &str) -> Vec<serde_json::Value> {
    body.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad line {l:?}: {e}")))
        .collect()
}

/// A `tmpfs` of a given size mounted on a fresh directory (the tests run as root, as CI
/// does); unmounted on drop.
pub struct Tmpfs {
    pub dir: PathBuf,
    _parent: tempfile::TempDir,
}

impl Tmpfs {
    pub fn mount(size_bytes: u64) -> Tmpfs {
        let parent = tempfile::tempdir().expect("tempdir");
        let dir = parent.path().join("mnt");
        std::fs::create_dir(&dir).expect("mount point");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size_bytes}"), "tmpfs"])
            .arg(&dir)
            .output()
            .expect("run mount");
        assert!(out.status.success(), "mounting a tmpfs needs root: {}", String::from_utf8_lossy(&out.stderr));
        Tmpfs { dir, _parent: parent }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

/// Free bytes of the file system holding `path`.
pub fn free_bytes(path: &std::path::Path) -> u64 {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).expect("path");
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0, "statvfs");
    st.f_bavail as u64 * st.f_frsize as u64
}

/// Polls `f` every 50 ms until it holds or `secs` pass; panics with `what` on timeout.
pub async fn eventually<F, Fut>(secs: u64, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    while !f().await {
        assert!(std::time::Instant::now() < deadline, "not within {secs} s: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Fails if an answer names a file of a test node's data directory (they all live in
/// tempfile's `.tmp*` folders under the system temp dir): error reasons must not.
pub fn assert_no_private_paths(answer: &str) {
    let private = format!("{}/.tmp", std::env::temp_dir().display());
    assert!(!answer.contains(&private), "an answer names an internal file: {answer}");
}

/// Builds the Go program in `tests/<dir>` to `<target tmp>/<name>` (the toolchain on the
/// machine, the versions its go.sum pins, no git stamp). Go's build cache makes later
/// builds quick; modules are downloaded on the first build only.
pub fn go_build(dir: &str, name: &str) -> PathBuf {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests").join(dir);
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let build = Command::new("go")
        .args(["build", "-o"])
        .arg(&out)
        .arg(".")
        .current_dir(&src)
        .env("GOTOOLCHAIN", "local")
        .env("GOFLAGS", "-mod=readonly -buildvcs=false")
        .output()
        .expect("run `go build` (Go must be installed)");
    assert!(build.status.success(), "building tests/{dir} failed:\n{}", String::from_utf8_lossy(&build.stderr));
    out
}

/// The value of one series (`name` or `name{labels}`, as printed) in the node's `/metrics`;
/// `None` when the node does not print it.
pub async fn metric(http: &reqwest::Client, node: &Node, series: &str) -> Option<f64> {
    let text = http.get(node.u("/metrics")).send().await.expect("GET /metrics").text().await.expect("metrics text");
    text.lines().find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
}

/// The server's route table (`ops::ROUTES`), read from its source so that a route added
/// there is tried by the tests that go through every route: `(method, route, operation,
/// rule)` of each.
pub fn route_table() -> Vec<(String, String, String, String)> {
    const OPS_SOURCE: &str = include_str!("../../crates/shoal-server/src/ops.rs");
    let start = OPS_SOURCE.find("pub const ROUTES").expect("ROUTES in ops.rs");
    let table = &OPS_SOURCE[start..];
    let table = &table[table.find("= &[").expect("ROUTES table") + 4..table.find("];").expect("end of ROUTES")];
    let routes: Vec<_> = table
        .lines()
        .filter(|l| l.trim_start().starts_with("(\""))
        .map(|l| {
            let parts: Vec<&str> = l.split('"').collect();
            assert!(parts.len() >= 7 && l.contains("Rule::"), "unexpected ROUTES line {l:?}");
            let rule = l.rsplit("Rule::").next().expect("a rule").trim_end_matches([')', ',', ' ']).to_string();
            (parts[1].to_string(), parts[3].to_string(), parts[5].to_string(), rule)
        })
        .collect();
    assert!(routes.len() >= 30, "parsed only {} routes from ops.rs", routes.len());
    routes
}
