//! `/metrics` after every route of `ops::ROUTES` has been called once: each request is
//! counted under its own operation (only a request to an unknown path is `other`), and the
//! text passes Prometheus' own linter — `promtool check metrics` is client_golang's
//! promlint, run here by the small Go program in `tests/promlint`.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{eventually, Node};
use reqwest::Method;

/// `(method, route, operation)` of every entry of `ops::ROUTES` (read from its source, so
/// that a new route fails this test until it is exercised below).
fn routes() -> Vec<(String, String, String)> {
    common::route_table().into_iter().map(|(m, r, op, _)| (m, r, op)).collect()
}

/// A request and the operation it should be counted as.
struct Call {
    op: &'static str,
    method: Method,
    path: String,
    body: String,
}

/// One request per operation, in an order where each finds what it needs.
/// The cluster secret of the test's node.
const METRICS_SECRET: &str = "metrics-test-secret";

fn requests() -> Vec<Call> {
    let big = serde_json::json!({"n": 1, "tags": ["a"], "pad": "x".repeat(20 * 1024)}).to_string();
    let d = "/v1/collections/c/docs/k";
    let json = |v: serde_json::Value| v.to_string();
    let calls: Vec<(&str, Method, String, String)> = vec![
        ("health", Method::GET, "/v1/health".into(), String::new()),
        ("node", Method::GET, "/v1/node".into(), String::new()),
        ("collection_create", Method::PUT, "/v1/collections/c".into(), String::new()),
        ("collection_list", Method::GET, "/v1/collections".into(), String::new()),
        // 20 KiB: large enough for the parsed-tree cache, so its counter appears too.
        ("doc_put", Method::PUT, d.into(), big),
        ("doc_get", Method::GET, d.into(), String::new()),
        ("subdoc_lookup", Method::POST, format!("{d}/lookup"), json(serde_json::json!({"specs": [{"op": "get", "path": "n"}]}))),
        (
            "subdoc_mutate",
            Method::POST,
            format!("{d}/mutate"),
            json(serde_json::json!({"specs": [{"op": "upsert", "path": "m", "value": 2}]})),
        ),
        ("doc_touch", Method::POST, format!("{d}/touch?expiry=3600"), String::new()),
        // `doc_unlock` takes the CAS of this locking get (filled in below).
        ("doc_get", Method::GET, format!("{d}?lock=10"), String::new()),
        ("doc_unlock", Method::POST, format!("{d}/unlock"), String::new()),
        ("multi_get", Method::POST, "/v1/collections/c/_get".into(), json(serde_json::json!({"keys": ["k", "b1"]}))),
        (
            "bulk",
            Method::POST,
            "/v1/collections/c/_bulk".into(),
            "{\"op\":\"upsert\",\"key\":\"b1\",\"value\":{\"n\":2}}\n{\"op\":\"upsert\",\"key\":\"b2\",\"value\":{\"n\":3}}\n".into(),
        ),
        ("changes", Method::GET, "/v1/collections/c/changes".into(), String::new()),
        ("index_create", Method::POST, "/v1/collections/c/indexes".into(), json(serde_json::json!({"name": "by_n", "keys": ["n"]}))),
        (
            "index_create",
            Method::POST,
            "/v1/collections/c/indexes".into(),
            json(serde_json::json!({"name": "later_a", "keys": ["m"], "defer_build": true})),
        ),
        (
            "index_create",
            Method::POST,
            "/v1/collections/c/indexes".into(),
            json(serde_json::json!({"name": "later_b", "keys": ["tags[*]"], "defer_build": true})),
        ),
        ("index_list", Method::GET, "/v1/collections/c/indexes".into(), String::new()),
        ("index_build", Method::POST, "/v1/collections/c/indexes/later_a/build".into(), String::new()),
        ("index_build_many", Method::POST, "/v1/collections/c/indexes/_build".into(), json(serde_json::json!({"names": ["later_b"]}))),
        (
            "index_scan",
            Method::POST,
            "/v1/collections/c/indexes/by_n/scan".into(),
            json(serde_json::json!({"eq": [2], "consistency": "request_plus"})),
        ),
        ("query", Method::POST, "/v1/query".into(), json(serde_json::json!({"sql": "SELECT count(*) AS n FROM c"}))),
        ("analytics", Method::POST, "/v1/analytics".into(), json(serde_json::json!({"sql": "SELECT count(*) AS n FROM c"}))),
        ("index_drop", Method::DELETE, "/v1/collections/c/indexes/later_a".into(), String::new()),
        ("doc_remove", Method::DELETE, "/v1/collections/c/docs/b2".into(), String::new()),
        ("collection_create", Method::PUT, "/v1/collections/gone".into(), String::new()),
        ("collection_drop", Method::DELETE, "/v1/collections/gone".into(), String::new()),
        ("metrics", Method::GET, "/metrics".into(), String::new()),
        // A call between members (with the secret below) and the cluster API of a one-node
        // cluster; failing over or recovering its only node is refused, and counted all the same.
        ("internal", Method::POST, "/v1/_internal/identify".into(), String::new()),
        ("cluster_info", Method::GET, "/v1/cluster".into(), String::new()),
        ("cluster_map", Method::GET, "/v1/cluster/map".into(), String::new()),
        ("cluster_settings", Method::PUT, "/v1/cluster/settings".into(), json(serde_json::json!({"replicas": 1}))),
        ("cluster_rebalance", Method::POST, "/v1/cluster/rebalance".into(), String::new()),
        ("cluster_rebalance_status", Method::GET, "/v1/cluster/rebalance".into(), String::new()),
        ("cluster_rebalance_stop", Method::DELETE, "/v1/cluster/rebalance".into(), String::new()),
        ("cluster_failover", Method::POST, "/v1/cluster/failover".into(), json(serde_json::json!({"node": 1}))),
        ("cluster_recover", Method::POST, "/v1/cluster/recover".into(), json(serde_json::json!({"node": 1}))),
        // Adding a node that is not there is refused, and counted all the same.
        ("cluster_add_node", Method::POST, "/v1/cluster/nodes".into(), json(serde_json::json!({"address": "127.0.0.1:1"}))),
        ("whoami", Method::GET, "/v1/whoami".into(), String::new()),
        (
            "user_put",
            Method::PUT,
            "/v1/users/reader".into(),
            json(serde_json::json!({"password": "reader-password", "roles": ["data_reader[c]"]})),
        ),
        ("user_list", Method::GET, "/v1/users".into(), String::new()),
        ("user_delete", Method::DELETE, "/v1/users/reader".into(), String::new()),
        // An empty key is refused (`invalid_key`), and counted.
        ("doc_get_empty_key", Method::GET, "/v1/collections/c/docs/".into(), String::new()),
        ("doc_put_empty_key", Method::PUT, "/v1/collections/c/docs/".into(), "{}".into()),
        ("doc_remove_empty_key", Method::DELETE, "/v1/collections/c/docs/".into(), String::new()),
    ];
    calls.into_iter().map(|(op, method, path, body)| Call { op, method, path, body }).collect()
}

/// Whether `path` (query string aside) is an instance of the route pattern `route`.
fn matches_route(route: &str, path: &str) -> bool {
    let path = path.split('?').next().unwrap_or(path);
    let (r, p): (Vec<&str>, Vec<&str>) = (route.split('/').collect(), path.split('/').collect());
    r.len() == p.len() && r.iter().zip(&p).all(|(r, p)| (r.starts_with('{') && !p.is_empty()) || r == p)
}

/// Builds the linter once per test run.
fn promlint() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| common::go_build("promlint", "promlint")).clone()
}

fn lint(text: &str) -> (bool, String) {
    let mut child =
        Command::new(promlint()).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("run promlint");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(text.as_bytes()).expect("write metrics to promlint");
    drop(stdin);
    let out = child.wait_with_output().expect("promlint output");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// Every sample line's series (`name{labels}`) and value.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').unwrap_or_else(|| panic!("malformed sample {l:?}"));
            (series.to_string(), value.parse().unwrap_or_else(|_| panic!("malformed value in {l:?}")))
        })
        .collect()
}

fn label<'a>(series: &'a str, name: &str) -> Option<&'a str> {
    let rest = &series[series.find(&format!("{name}=\""))? + name.len() + 2..];
    rest.split('"').next()
}

#[tokio::test]
async fn every_route_is_counted_under_its_name_and_metrics_pass_promlint() {
    let cap = 8;
    let node = Node::start(&["--max-connections", &cap.to_string(), "--cluster-secret", METRICS_SECRET]);
    let client = node.client();
    let routes = routes();

    // Each route of the table has a request here, and each request is an instance of its route.
    let requests = requests();
    for (method, route, op) in &routes {
        let mine: Vec<_> = requests.iter().filter(|r| r.op == op).collect();
        assert!(!mine.is_empty(), "no request exercises {method} {route} ({op}); add one to requests()");
        for r in mine {
            assert!(r.method.as_str() == method && matches_route(route, &r.path), "{op}: {} {} is not {method} {route}", r.method, r.path);
        }
    }

    let mut cas = String::new();
    for Call { op, method, path, body } in requests {
        let mut req = client.request(method.clone(), node.u(&path)).body(body);
        if op == "doc_unlock" {
            req = req.header("if-match", cas.clone());
        }
        if op == "internal" {
            req = req.header("x-shoal-cluster-secret", METRICS_SECRET);
        }
        let r = req.send().await.unwrap_or_else(|e| panic!("{op}: {e}"));
        let status = r.status();
        if let Some(tag) = r.headers().get("etag") {
            cas = tag.to_str().expect("etag").to_string();
        }
        let text = r.text().await.unwrap_or_default();
        // A one-node cluster's rebalance has nothing to move and may end before its stop
        // arrives: the stop then answers that none is under way (still counted).
        let already_done = op == "cluster_rebalance_stop" && status == 409 && text.contains("no rebalance is under way");
        let refused_by_design = (matches!(op, "cluster_failover" | "cluster_recover" | "cluster_add_node") && !status.is_success())
            || (op.ends_with("_empty_key") && status == 400)
            || already_done;
        assert!(status.is_success() || refused_by_design, "{op}: {method} {path} answered {status}: {text}");
    }
    // One deliberately unknown path: the only request counted as `other`.
    let r = client.get(node.u("/v1/no-such-endpoint")).send().await.expect("unknown path");
    assert_eq!(r.status(), 404);

    // One connection over the cap, so the refusal counter has a sample too.
    let addr: std::net::SocketAddr = node.url.trim_start_matches("http://").parse().expect("address");
    let held: Vec<_> = (0..cap).map(|_| std::net::TcpStream::connect(addr).expect("connect")).collect();
    let mut refused = String::new();
    let mut over = std::net::TcpStream::connect(addr).expect("connect over the cap");
    over.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    over.read_to_string(&mut refused).expect("read the refusal");
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    drop(held);
    drop(client);
    let client = common::client_builder().timeout(Duration::from_secs(10)).build().expect("client");
    eventually(20, "the node serves again", || async { client.get(node.u("/v1/health")).send().await.is_ok_and(|r| r.status() == 200) })
        .await;

    let text = client.get(node.u("/metrics")).send().await.expect("GET /metrics").text().await.expect("metrics text");
    let samples = samples(&text);

    let counted: BTreeSet<&str> =
        samples.keys().filter(|s| s.starts_with("shoal_requests_total{")).filter_map(|s| label(s, "op")).collect();
    for (method, route, op) in &routes {
        assert!(counted.contains(op.as_str()), "{method} {route} was not counted as {op}; counted: {counted:?}");
    }
    let other: Vec<(&String, &f64)> = samples.iter().filter(|(s, _)| label(s, "op") == Some("other")).collect();
    let other_requests: Vec<_> = other.iter().filter(|(s, _)| s.starts_with("shoal_requests_total{")).collect();
    assert_eq!(other_requests.len(), 1, "op=\"other\" series: {other:?}");
    assert_eq!(label(other_requests[0].0, "status"), Some("4xx"), "{other:?}");
    assert_eq!(*other_requests[0].1, 1.0, "only the unknown path is other: {other:?}");
    assert_eq!(samples.get("shoal_request_duration_seconds_count{op=\"other\"}"), Some(&1.0), "{other:?}");
    for family in [
        "shoal_connections_refused_total",
        "shoal_subdoc_parsed_cache_total",
        "shoal_connections",
        "shoal_documents",
        "shoal_index_memtable_bytes",
        "shoal_index_memtables_held_bytes",
    ] {
        assert!(samples.keys().any(|s| s == family || s.starts_with(&format!("{family}{{"))), "{family} missing from /metrics");
    }
    assert!(samples["shoal_connections_refused_total"] >= 1.0);

    let (clean, problems) = lint(&text);
    assert!(clean, "promlint found problems in /metrics:\n{problems}\n--- metrics ---\n{text}");
}

#[test]
fn promlint_reports_problems() {
    // The linter itself works: a counter without `_total` and a metric without help fail.
    let (clean, problems) = lint("# TYPE shoal_bad counter\nshoal_bad 1\n");
    assert!(!clean, "promlint passed a bad counter");
    assert!(problems.contains("shoal_bad"), "{problems}");
    let (clean, problems) = lint("# HELP shoal_good_total Things.\n# TYPE shoal_good_total counter\nshoal_good_total 1\n");
    assert!(clean, "{problems}");
}
