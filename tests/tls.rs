//! TLS (issue 43): a node started with `--tls-cert/--tls-key/--tls-ca` speaks TLS only,
//! members call each other over TLS with certificates the CA signed, certificates reload on
//! SIGHUP; clients that trust another CA, expired certificates and plain HTTP are refused
//! clearly, and hostile handshakes cost the node nothing.

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::cluster::{get_json, node_id, rebalance, start_cluster, wait_for};
use common::Node;
use serde_json::{json, Value};

fn client_with(config: rustls::ClientConfig) -> reqwest::Client {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(reqwest::header::AUTHORIZATION, common::admin_auth().parse().unwrap());
    reqwest::Client::builder().default_headers(headers).tls_backend_preconfigured(config).timeout(Duration::from_secs(30)).build().unwrap()
}

/// A CA of its own and a node certificate it signed, in a fresh directory.
fn other_ca() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(common::binary())
        .args(["cert", "--dir"])
        .arg(dir.path())
        .args(["--host", "127.0.0.1"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ca = dir.path().join("ca.pem");
    (dir, ca)
}

#[tokio::test]
async fn a_tls_node_speaks_http1_and_h2_and_tells_plain_http_to_use_https() {
    let node = Node::start(&common::tls_flags());
    assert!(node.url.starts_with("https://"), "{}", node.url);
    let http = node.client();
    assert_eq!(http.put(node.u("/v1/collections/c")).send().await.unwrap().status().as_u16(), 201);
    let r = http.put(node.u("/v1/collections/c/docs/k")).body(r#"{"a":1}"#).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    // Both protocols by ALPN.
    for (alpn, version) in [(b"http/1.1".to_vec(), reqwest::Version::HTTP_11), (b"h2".to_vec(), reqwest::Version::HTTP_2)] {
        let mut config = common::tls_client_config(&common::test_tls().ca, None);
        config.alpn_protocols = vec![alpn];
        let r = client_with(config).get(node.u("/v1/collections/c/docs/k")).send().await.unwrap();
        assert_eq!(r.version(), version);
        assert_eq!(r.status().as_u16(), 200);
        assert_eq!(r.json::<Value>().await.unwrap(), json!({"a": 1}));
    }
    // Plain HTTP to the TLS port: a plain 400 that says what to do.
    let mut tcp = std::net::TcpStream::connect(node.addr()).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    tcp.write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut answer = String::new();
    let _ = tcp.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("speaks TLS only"), "{answer}");
    // A handshake of garbage (100 KB after a handshake byte), and a client that connects and
    // never finishes its handshake: closed, and the node serves on.
    let mut tcp = std::net::TcpStream::connect(node.addr()).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut garbage = vec![0x16u8, 0x03, 0x01, 0xff, 0xff];
    garbage.extend(std::iter::repeat_n(0x41u8, 100 * 1024));
    let _ = tcp.write_all(&garbage);
    let mut rest = Vec::new();
    let _ = tcp.read_to_end(&mut rest);
    let mut silent = std::net::TcpStream::connect(node.addr()).unwrap();
    silent.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    silent.write_all(&[0x16]).unwrap();
    let mut buf = [0u8; 64];
    // Closed by the node (0 bytes) or reset: never left open past the handshake timeout.
    match silent.read(&mut buf) {
        Ok(n) => assert_eq!(n, 0, "the node answered a handshake that never came"),
        Err(e) => assert!(e.kind() != std::io::ErrorKind::WouldBlock && e.kind() != std::io::ErrorKind::TimedOut, "still open: {e}"),
    }
    assert_eq!(http.get(node.u("/v1/collections/c/docs/k")).send().await.unwrap().status().as_u16(), 200);
    // The CLI, with the CA (`SHOAL_TLS_CA` set by the test helper).
    let (ok, out, err) = node.cli(&["doc", "get", "c", "k"]);
    assert!(ok, "{out}{err}");
    assert!(out.contains("\"a\""), "{out}");
    let failures = common::metric(&http, &node, "shoal_tls_handshake_failures_total").await.unwrap_or(0.0);
    assert!(failures >= 2.0, "handshake failures counted: {failures}");
}

#[tokio::test]
async fn clients_that_trust_another_ca_or_meet_an_expired_certificate_are_refused() {
    let node = Node::start(&common::tls_flags());
    // A client trusting another CA.
    let (_other, other_ca) = other_ca();
    let e = client_with(common::tls_client_config(&other_ca, None)).get(node.u("/v1/health")).send().await.unwrap_err();
    let why = shoal_client::error_chain(&e);
    assert!(why.contains("UnknownIssuer") || why.contains("unknown issuer"), "{why}");
    // The CLI without the CA says why.
    let out = std::process::Command::new(common::binary())
        .args(["--url", &node.url, "collection", "list"])
        .env("SHOAL_USER", "admin")
        .env("SHOAL_PASSWORD", common::ADMIN_PASSWORD)
        .env_remove("SHOAL_TLS_CA")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("certificate"), "{err}");

    // A node whose certificate (signed by the test CA) expired.
    let tls = common::test_tls();
    let dir = tempfile::tempdir().unwrap();
    let issuer = rcgen::Issuer::from_ca_cert_pem(
        &std::fs::read_to_string(&tls.ca).unwrap(),
        rcgen::KeyPair::from_pem(&std::fs::read_to_string(tls.dir.join("ca-key.pem")).unwrap()).unwrap(),
    )
    .unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
    params.not_before = rcgen::date_time_ymd(2020, 1, 1);
    params.not_after = rcgen::date_time_ymd(2021, 1, 1);
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth, rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let cert = params.signed_by(&key, &issuer).unwrap();
    let (cert_path, key_path) = (dir.path().join("expired.pem"), dir.path().join("expired-key.pem"));
    std::fs::write(&cert_path, cert.pem()).unwrap();
    std::fs::write(&key_path, key.serialize_pem()).unwrap();
    let ca = tls.ca.display().to_string();
    let expired = Node::start(&["--tls-cert", cert_path.to_str().unwrap(), "--tls-key", key_path.to_str().unwrap(), "--tls-ca", &ca]);
    let e = expired.client().get(expired.u("/v1/health")).send().await.unwrap_err();
    let why = shoal_client::error_chain(&e);
    assert!(why.to_lowercase().contains("expired"), "{why}");
    // The node itself is fine: the valid node still answers.
    assert_eq!(node.client().get(node.u("/v1/health")).send().await.unwrap().status().as_u16(), 200);
}

#[tokio::test]
async fn a_node_without_its_tls_files_or_with_a_key_that_is_not_its_certificates_does_not_start() {
    let tls = common::test_tls();
    let (_other, other_ca) = other_ca();
    let other_key = other_ca.with_file_name("node-key.pem");
    let ca = tls.ca.display().to_string();
    let cert = tls.cert.display().to_string();
    // A file past `TLS_FILE_MAX_BYTES` (1 MiB) is not read.
    let big = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(big.path(), vec![b'#'; (1 << 20) + 1]).unwrap();
    let big_ca = big.path().display().to_string();
    for (args, expect) in [
        (vec!["--tls-cert", &cert, "--tls-key", tls.key.to_str().unwrap(), "--tls-ca", &big_ca], "the most read is 1048576"),
        (vec!["--tls-cert", &cert, "--tls-key", "/nonexistent/key.pem", "--tls-ca", &ca], "/nonexistent/key.pem"),
        (vec!["--tls-cert", &cert, "--tls-key", other_key.to_str().unwrap(), "--tls-ca", &ca], "not the key of"),
        (vec!["--tls-cert", &cert, "--tls-key", tls.key.to_str().unwrap()], "--tls-ca"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = std::process::Command::new(common::binary())
            .args(["serve", "--listen", "127.0.0.1:0", "--data-path"])
            .arg(dir.path().join("data"))
            .args(&args)
            .env_remove("SHOAL_TLS_CA")
            .env("SHOAL_ADMIN_PASSWORD", common::ADMIN_PASSWORD)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} started");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expect), "{args:?}: {err}");
    }
}

#[tokio::test]
async fn sighup_reads_the_certificate_again_and_a_broken_file_keeps_the_loaded_one() {
    let tls = common::test_tls();
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, ca) = (dir.path().join("node.pem"), dir.path().join("node-key.pem"), dir.path().join("ca.pem"));
    for (from, to) in [(&tls.cert, &cert), (&tls.key, &key), (&tls.ca, &ca)] {
        std::fs::copy(from, to).unwrap();
    }
    let node = Node::start(&["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap(), "--tls-ca", ca.to_str().unwrap()]);
    let (other, other_ca) = other_ca();
    let old = client_with(common::tls_client_config(&tls.ca, None));
    let new = client_with(common::tls_client_config(&other_ca, None));
    assert_eq!(old.get(node.u("/v1/health")).send().await.unwrap().status().as_u16(), 200);
    assert!(new.get(node.u("/v1/health")).send().await.is_err());
    for name in ["node.pem", "node-key.pem", "ca.pem"] {
        std::fs::copy(other.path().join(name), dir.path().join(name)).unwrap();
    }
    node.signal(libc::SIGHUP);
    // New connections get the new certificate (`new` opens one per try: the failed
    // handshake left no connection to reuse).
    common::eventually(30, "the new certificate is served", || {
        let new = new.clone();
        let url = node.u("/v1/health");
        async move { new.get(url).send().await.is_ok_and(|r| r.status().as_u16() == 200) }
    })
    .await;
    let fresh_old = client_with(common::tls_client_config(&tls.ca, None));
    assert!(fresh_old.get(node.u("/v1/health")).send().await.is_err(), "the old certificate is still served");
    // A broken file: the reload fails, what was loaded stays.
    std::fs::write(&cert, "not a certificate").unwrap();
    node.signal(libc::SIGHUP);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let fresh_new = client_with(common::tls_client_config(&other_ca, None));
    assert_eq!(fresh_new.get(node.u("/v1/health")).send().await.unwrap().status().as_u16(), 200);
    let reloads = common::metric(&fresh_new, &node, "shoal_tls_reloads_total{outcome=\"failed\"}").await;
    assert_eq!(reloads, Some(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn members_call_each_other_over_tls_with_certificates_the_ca_signed_and_answer_exactly() {
    let mut args = common::tls_flags();
    args.extend_from_slice(&["--analytics-partitions", "2"]);
    let mut nodes = start_cluster(3, &args);
    let http = common::client_builder().timeout(Duration::from_secs(60)).build().unwrap();
    wait_for(&http, &nodes[0].u("/v1/cluster"), "three members", |v| common::cluster::member_states(v).len() == 3).await;
    let r = http.put(nodes[0].u("/v1/cluster/settings")).json(&json!({"replicas": 1, "auto_failover_timeout_s": 2})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200, "{}", r.text().await.unwrap_or_default());
    assert_eq!(http.put(nodes[1].u("/v1/collections/c")).send().await.unwrap().status().as_u16(), 201);
    // Partitions copied between members (over TLS).
    rebalance(&http, &nodes[0], &[]).await;
    // Writes through every member (keys forwarded to their actives), the model beside.
    let mut model = std::collections::BTreeMap::new();
    for i in 0..60 {
        let node = &nodes[i % 3];
        let r = http
            .put(node.u(&format!("/v1/collections/c/docs/k{i}?durability=majority")))
            .json(&json!({"n": i, "g": i % 4}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200, "{}", r.text().await.unwrap_or_default());
        model.insert(format!("k{i}"), i);
    }
    let count_of = |g: usize| model.values().filter(|n| **n % 4 == g).count() as u64;
    for node in &nodes {
        for (k, n) in model.iter().step_by(7) {
            let (status, doc) = get_json(&http, &node.u(&format!("/v1/collections/c/docs/{k}"))).await;
            assert_eq!((status, doc["n"].as_u64()), (200, Some(*n as u64)), "{k} on {}", node.url);
        }
        // Analytics across members (the workers' gRPC over TLS).
        let r = http
            .post(node.u("/v1/analytics"))
            .json(&json!({"sql": "select g, count(*) as c from c group by g order by g", "consistency": "request_plus"}))
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let answer: Value = r.json().await.unwrap();
        assert_eq!(status, 200, "{answer}");
        let rows: Vec<(u64, u64)> =
            answer["rows"].as_array().unwrap().iter().map(|r| (r[0].as_u64().unwrap(), r[1].as_u64().unwrap())).collect();
        assert_eq!(rows, (0..4).map(|g| (g as u64, count_of(g))).collect::<Vec<_>>(), "{answer}");
    }
    // Calls between members need a member's certificate, even with the secret; a client's
    // signed user is not taken either.
    let member = common::member_client_builder().build().unwrap();
    // Past the certificate and the secret, the call is unknown (404).
    for (client, status, answer) in [(&http, 401, "certificate"), (&member, 404, "no internal call")] {
        let r = client
            .post(nodes[0].u("/v1/_internal/no-such-call"))
            .header("x-shoal-cluster-secret", common::cluster::SECRET)
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), status);
        let text = r.text().await.unwrap();
        assert!(text.contains(answer), "{text}");
    }
    let r = common::plain_client_builder()
        .build()
        .unwrap()
        .get(nodes[0].u("/v1/collections/c/docs/k1"))
        .header("x-shoal-user", "admin.0.0")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert!(r.text().await.unwrap().contains("certificate"));
    // kill -9 a member: failed over, and every answer on the others is still exact.
    let (_, info) = get_json(&http, &nodes[0].u("/v1/cluster")).await;
    let victim = node_id(&info, &nodes[2]).unwrap();
    nodes[2].kill9();
    wait_for(&http, &nodes[0].u("/v1/cluster"), "failover", |v| {
        v["nodes"]
            .as_array()
            .is_some_and(|a| a.iter().any(|n| n["id"].as_u64() == Some(victim) && n["state"] == "failed" && n["partitions"]["active"] == 0))
    })
    .await;
    // Exact, or 503 while a member learns the new map; never another answer.
    for node in &nodes[..2] {
        for (k, n) in &model {
            let url = node.u(&format!("/v1/collections/c/docs/{k}"));
            let deadline = std::time::Instant::now() + common::cluster::WAIT_MAX;
            loop {
                let (status, doc) = get_json(&http, &url).await;
                if status == 503 && std::time::Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                assert_eq!((status, doc["n"].as_u64()), (200, Some(*n as u64)), "{k} on {} after the failover", node.url);
                break;
            }
        }
    }
}
