//! Secondary indexes over HTTP: definitions, maintenance from the change stream, scans,
//! request_plus, restarts, bad input and the CLI.

mod common;

use std::time::{Duration, Instant};

use common::Node;
use reqwest::StatusCode;
use serde_json::{json, Value};

async fn send(c: &reqwest::Client, method: reqwest::Method, url: String, body: Option<Value>) -> (StatusCode, Value) {
    let mut req = c.request(method, url);
    if let Some(b) = body {
        req = req.body(b.to_string());
    }
    let r = req.send().await.unwrap();
    (r.status(), r.json().await.unwrap_or(Value::Null))
}

async fn post(c: &reqwest::Client, url: String, body: Value) -> (StatusCode, Value) {
    send(c, reqwest::Method::POST, url, Some(body)).await
}

async fn put_doc(node: &Node, c: &reqwest::Client, coll: &str, key: &str, doc: Value) {
    let r = c.put(node.u(&format!("/v1/collections/{coll}/docs/{key}"))).body(doc.to_string()).send().await.unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
}

/// Scans with request_plus and returns (key, id) pairs.
async fn scan(node: &Node, c: &reqwest::Client, coll: &str, index: &str, mut req: Value) -> Vec<(Value, String)> {
    req["consistency"] = json!("request_plus");
    let (s, r) = post(c, node.u(&format!("/v1/collections/{coll}/indexes/{index}/scan")), req).await;
    assert_eq!(s, StatusCode::OK, "{r}");
    r["rows"].as_array().unwrap().iter().map(|row| (row["key"].clone(), row["id"].as_str().unwrap().to_string())).collect()
}

fn ids(rows: &[(Value, String)]) -> Vec<&str> {
    rows.iter().map(|(_, id)| id.as_str()).collect()
}

#[tokio::test]
async fn scans_follow_every_change() {
    let node = Node::start(&["--partitions", "8"]);
    let c = node.client();
    c.put(node.u("/v1/collections/o")).send().await.unwrap();
    for i in 0..40 {
        let doc = json!({"user": format!("u{}", i % 4), "date": i, "type": if i % 2 == 0 { "order" } else { "visit" }, "tags": ["all", format!("t{}", i % 3)]});
        put_doc(&node, &c, "o", &format!("d{i:02}"), doc).await;
    }
    let (s, r) = post(&c, node.u("/v1/collections/o/indexes"), json!({"name": "by_user", "keys": ["user", "date"]})).await;
    assert_eq!(s, StatusCode::CREATED, "{r}");
    assert_eq!(r["keys"], json!(["user", "date"]));
    let (s, _) =
        post(&c, node.u("/v1/collections/o/indexes"), json!({"name": "tags", "keys": ["tags[*]"], "where": "type = 'order'"})).await;
    assert_eq!(s, StatusCode::CREATED);

    // eq on a prefix, in key order with ties by document key.
    let rows = scan(&node, &c, "o", "by_user", json!({"eq": ["u1"]})).await;
    assert_eq!(ids(&rows), ["d01", "d05", "d09", "d13", "d17", "d21", "d25", "d29", "d33", "d37"]);
    assert_eq!(rows[0].0, json!(["u1", 1]));
    // Full key, range bounds inclusive/exclusive, open ends, descending, limit.
    assert_eq!(ids(&scan(&node, &c, "o", "by_user", json!({"eq": ["u1", 5]})).await), ["d05"]);
    let r = json!({"range": {"low": ["u1", 5], "high": ["u1", 13], "inclusive_low": false, "inclusive_high": true}});
    assert_eq!(ids(&scan(&node, &c, "o", "by_user", r).await), ["d09", "d13"]);
    let r = json!({"range": {"low": ["u3"]}, "descending": true, "limit": 3});
    assert_eq!(ids(&scan(&node, &c, "o", "by_user", r).await), ["d39", "d35", "d31"]);
    let r = json!({"range": {"high": ["u0", 4], "inclusive_high": false}});
    assert_eq!(ids(&scan(&node, &c, "o", "by_user", r).await), ["d00"]);
    // The array index with its where: only orders, one entry per distinct tag.
    let all = scan(&node, &c, "o", "tags", json!({"eq": ["all"]})).await;
    assert_eq!(all.len(), 20);
    assert_eq!(scan(&node, &c, "o", "tags", json!({})).await.len(), 40);

    // Updates move entries, deletes and expiry remove them; the items count follows.
    put_doc(&node, &c, "o", "d01", json!({"user": "u9", "date": 0, "type": "visit"})).await;
    c.delete(node.u("/v1/collections/o/docs/d05")).send().await.unwrap();
    c.put(node.u("/v1/collections/o/docs/d09?expiry=1")).body(json!({"user": "u1", "date": 9}).to_string()).send().await.unwrap();
    let rows = scan(&node, &c, "o", "by_user", json!({"eq": ["u1"], "limit": 2})).await;
    assert_eq!(ids(&rows), ["d09", "d13"]);
    assert_eq!(ids(&scan(&node, &c, "o", "by_user", json!({"eq": ["u9"]})).await), ["d01"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let rows = scan(&node, &c, "o", "by_user", json!({"eq": ["u1"], "limit": 1})).await;
        if ids(&rows) == ["d13"] {
            break;
        }
        assert!(Instant::now() < deadline, "expired document still indexed: {rows:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (_, list) = send(&c, reqwest::Method::GET, node.u("/v1/collections/o/indexes"), None).await;
    let by_user = list.as_array().unwrap().iter().find(|i| i["name"] == "by_user").unwrap().clone();
    assert_eq!(by_user["items"], json!(38), "{list}");
    assert_eq!(by_user["state"], json!("ready"));
    assert_eq!(by_user["progress"], json!(1.0));

    // include_docs gives each row its document.
    let (s, r) = post(&c, node.u("/v1/collections/o/indexes/by_user/scan"), json!({"eq": ["u9"], "include_docs": true})).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(r["rows"][0]["doc"], json!({"user": "u9", "date": 0, "type": "visit"}));
}

#[tokio::test]
async fn keys_of_every_json_type_sort_in_the_documented_order() {
    let node = Node::start(&["--partitions", "4"]);
    let c = node.client();
    c.put(node.u("/v1/collections/t")).send().await.unwrap();
    let values =
        [json!(null), json!(false), json!(true), json!(-5), json!(2.5), json!(10), json!(""), json!("a"), json!([1]), json!({"a": 1})];
    for (i, v) in values.iter().enumerate().rev() {
        put_doc(&node, &c, "t", &format!("k{i}"), json!({ "v": v })).await;
    }
    put_doc(&node, &c, "t", "missing", json!({"w": 1})).await;
    post(&c, node.u("/v1/collections/t/indexes"), json!({"name": "v", "keys": ["v"]})).await;
    let rows = scan(&node, &c, "t", "v", json!({})).await;
    let keys: Vec<Value> = rows.iter().map(|(k, _)| k[0].clone()).collect();
    assert_eq!(keys, values.to_vec(), "a document without the leading key is not indexed");
    let numbers = scan(&node, &c, "t", "v", json!({"range": {"low": [0], "high": [100]}})).await;
    assert_eq!(ids(&numbers), ["k4", "k5"]);
}

#[tokio::test]
async fn request_plus_returns_every_acknowledged_write() {
    let node = Node::start(&["--partitions", "16"]);
    let c = node.client();
    c.put(node.u("/v1/collections/w")).send().await.unwrap();
    post(&c, node.u("/v1/collections/w/indexes"), json!({"name": "n", "keys": ["n"]})).await;
    // Background writers keep the index busy while the probe writes and scans.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..4 {
        let (c, url, stop) = (c.clone(), node.u("/v1/collections/w/docs/"), stop.clone());
        writers.push(tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = c.put(format!("{url}bg{w}-{}", i % 500)).body(json!({"n": -(i as i64)}).to_string()).send().await;
                i += 1;
            }
        }));
    }
    for i in 0..150 {
        put_doc(&node, &c, "w", &format!("probe{i}"), json!({"n": 1_000_000 + i})).await;
        let rows = scan(&node, &c, "w", "n", json!({"eq": [1_000_000 + i]})).await;
        assert_eq!(ids(&rows), [format!("probe{i}")], "write {i} acknowledged before the scan");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
}

#[tokio::test]
async fn definitions_survive_restarts_and_deferred_builds() {
    let mut node = Node::start(&["--partitions", "8"]);
    let c = node.client();
    c.put(node.u("/v1/collections/r")).send().await.unwrap();
    for i in 0..300 {
        put_doc(&node, &c, "r", &format!("d{i}"), json!({"g": i % 10, "i": i})).await;
    }
    let (s, r) = post(&c, node.u("/v1/collections/r/indexes"), json!({"name": "later", "keys": ["g"], "defer_build": true})).await;
    assert_eq!((s, r["state"].clone()), (StatusCode::CREATED, json!("deferred")));
    let (s, r) = post(&c, node.u("/v1/collections/r/indexes/later/scan"), json!({})).await;
    assert_eq!((s, r["error"].clone()), (StatusCode::SERVICE_UNAVAILABLE, json!("unavailable")), "{r}");
    post(&c, node.u("/v1/collections/r/indexes"), json!({"name": "now", "keys": ["i"]})).await;
    assert_eq!(scan(&node, &c, "r", "now", json!({})).await.len(), 300);

    assert!(node.stop(), "clean shutdown");
    node.restart();
    let c = node.client();
    let (_, list) = send(&c, reqwest::Method::GET, node.u("/v1/collections/r/indexes"), None).await;
    let states: Vec<(Value, Value)> = list.as_array().unwrap().iter().map(|i| (i["name"].clone(), i["state"].clone())).collect();
    assert_eq!(states[0], (json!("later"), json!("deferred")));
    assert_eq!(scan(&node, &c, "r", "now", json!({})).await.len(), 300);
    let (s, r) = post(&c, node.u("/v1/collections/r/indexes/later/build"), json!({})).await;
    assert_eq!(s, StatusCode::OK, "{r}");
    assert_eq!(scan(&node, &c, "r", "later", json!({"eq": [3]})).await.len(), 30);

    // Unclean restart: the index resumes and still matches the documents.
    put_doc(&node, &c, "r", "d0", json!({"g": 99})).await;
    node.kill9();
    node.restart();
    let c = node.client();
    assert_eq!(ids(&scan(&node, &c, "r", "later", json!({"eq": [99]})).await), ["d0"]);
    assert_eq!(scan(&node, &c, "r", "now", json!({})).await.len(), 299);

    let (s, _) = send(&c, reqwest::Method::DELETE, node.u("/v1/collections/r/indexes/later"), None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, r) = post(&c, node.u("/v1/collections/r/indexes/later/scan"), json!({})).await;
    assert_eq!((s, r["error"].clone()), (StatusCode::NOT_FOUND, json!("index_not_found")));
    // Dropping the collection drops its indexes; a new collection of that name has none.
    send(&c, reqwest::Method::DELETE, node.u("/v1/collections/r"), None).await;
    c.put(node.u("/v1/collections/r")).send().await.unwrap();
    let (_, list) = send(&c, reqwest::Method::GET, node.u("/v1/collections/r/indexes"), None).await;
    assert_eq!(list, json!([]));
}

#[tokio::test]
async fn bad_index_input() {
    let node = Node::start(&[]);
    let c = node.client();
    c.put(node.u("/v1/collections/b")).send().await.unwrap();
    put_doc(&node, &c, "b", "d", json!({"a": 1})).await;
    post(&c, node.u("/v1/collections/b/indexes"), json!({"name": "a", "keys": ["a", "b"]})).await;
    post(&c, node.u("/v1/collections/b/indexes"), json!({"name": "def", "keys": ["a"], "defer_build": true})).await;
    let create = "/v1/collections/b/indexes";
    let scan_a = "/v1/collections/b/indexes/a/scan";
    let build_many = "/v1/collections/b/indexes/_build";
    let cases: Vec<(&str, &str, String, StatusCode, &str)> = vec![
        ("POST", create, json!({"name": "x", "keys": ["a..b"]}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", create, json!({"name": "x", "keys": []}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", create, json!({"name": "x", "keys": ["a[*]", "b[*]"]}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", create, json!({"name": "_x", "keys": ["a"]}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", create, json!({"name": "x", "keys": ["a"], "where": "a = "}).to_string(), StatusCode::BAD_REQUEST, "query_error"),
        ("POST", create, json!({"name": "x", "keys": ["a"], "where": "f(a) = 1"}).to_string(), StatusCode::BAD_REQUEST, "query_error"),
        (
            "POST",
            create,
            json!({"name": "x", "keys": ["a"], "where": "(".repeat(10_000)}).to_string(),
            StatusCode::BAD_REQUEST,
            "query_error",
        ),
        ("POST", create, json!({"name": "a", "keys": ["a"]}).to_string(), StatusCode::CONFLICT, "index_exists"),
        ("POST", create, json!({"name": "x", "keys": ["a"], "extra": 1}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", create, json!({"name": "x", "keys": "a"}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", create, "{not json".to_string(), StatusCode::BAD_REQUEST, "invalid_json"),
        ("POST", create, "x".repeat(100_000), StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
        // The index service's fields (issue 41): partitions 1-256, replicas 0-3 and fewer than
        // the index nodes (this node is the only one).
        ("POST", create, json!({"name": "p0", "keys": ["a"], "partitions": 0}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", create, json!({"name": "p1", "keys": ["a"], "partitions": 10_000}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", create, json!({"name": "p2", "keys": ["a"], "partitions": -1}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", create, json!({"name": "r1", "keys": ["a"], "replicas": 1}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", create, json!({"name": "r4", "keys": ["a"], "replicas": 4}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", create, json!({"name": "r9", "keys": ["a"], "replicas": 300}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        (
            "POST",
            "/v1/collections/nope/indexes",
            json!({"name": "x", "keys": ["a"]}).to_string(),
            StatusCode::NOT_FOUND,
            "collection_not_found",
        ),
        ("GET", "/v1/collections/nope/indexes", String::new(), StatusCode::NOT_FOUND, "collection_not_found"),
        ("POST", scan_a, json!({"eq": 1}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", scan_a, json!({"eq": [1, 2, 3]}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", scan_a, json!({"range": {"low": "x"}}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", scan_a, json!({"range": {"low": [1]}, "eq": [1]}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", scan_a, json!({"limit": -1}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", scan_a, json!({"limit": 10_000_000}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", scan_a, json!({"consistency": "eventually"}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", scan_a, json!({"timeout_ms": 1u64 << 60}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", scan_a, "[]".to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", "/v1/collections/b/indexes/def/scan", "{}".to_string(), StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
        ("POST", "/v1/collections/b/indexes/none/scan", "{}".to_string(), StatusCode::NOT_FOUND, "index_not_found"),
        ("POST", "/v1/collections/b/indexes/none/build", String::new(), StatusCode::NOT_FOUND, "index_not_found"),
        ("DELETE", "/v1/collections/b/indexes/none", String::new(), StatusCode::NOT_FOUND, "index_not_found"),
        ("POST", "/v1/collections/b/indexes/a/scan?x=1", "{}".to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", scan_a, "x".repeat(100_000), StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
        ("POST", scan_a, "{\"eq\": [".to_string(), StatusCode::BAD_REQUEST, "invalid_json"),
        ("POST", build_many, "{not json".to_string(), StatusCode::BAD_REQUEST, "invalid_json"),
        ("POST", build_many, json!({"names": "def"}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", build_many, json!({"names": []}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", build_many, json!({"names": ["def"], "x": 1}).to_string(), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", build_many, json!({"names": ["def", "none"]}).to_string(), StatusCode::NOT_FOUND, "index_not_found"),
        ("POST", build_many, "x".repeat(100_000), StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
        ("POST", "/v1/collections/nope/indexes/_build", json!({"names": ["a"]}).to_string(), StatusCode::NOT_FOUND, "collection_not_found"),
    ];
    for (method, path, body, status, code) in cases {
        let m = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let r = c.request(m, node.u(path)).body(body.clone()).send().await.unwrap();
        let got_status = r.status();
        let v: Value = r.json().await.unwrap_or(Value::Null);
        assert_eq!((got_status, v["error"].as_str()), (status, Some(code)), "{method} {path} {:.80}: {v}", body);
    }
    // Nothing was lost: the index still answers and the document is intact; the deferred
    // index (untouched by the failed builds) builds.
    assert_eq!(ids(&scan(&node, &c, "b", "a", json!({"eq": [1]})).await), ["d"]);
    let (s, r) = post(&c, node.u(build_many), json!({"names": ["def", "a"]})).await;
    assert_eq!(s, StatusCode::OK, "{r}");
    assert_eq!(ids(&scan(&node, &c, "b", "def", json!({"eq": [1]})).await), ["d"]);
    let doc: Value = c.get(node.u("/v1/collections/b/docs/d")).send().await.unwrap().json().await.unwrap();
    assert_eq!(doc, json!({"a": 1}));
}

#[test]
fn cli_creates_builds_and_scans() {
    let node = Node::start(&[]);
    assert!(node.cli(&["collection", "create", "k"]).0);
    for i in 0..5 {
        let (ok, _, err) = node.cli(&["doc", "put", "k", &format!("d{i}"), &json!({"u": format!("u{}", i % 2), "n": i}).to_string()]);
        assert!(ok, "{err}");
    }
    let (ok, out, err) = node.cli(&["index", "create", "k", "by_u", "u", "n"]);
    assert!(ok, "{err}");
    assert!(out.contains("ready"), "{out}");
    let (ok, out, err) = node.cli(&["--output", "json", "index", "scan", "k", "by_u", "--eq", "\"u1\"", "--request-plus"]);
    assert!(ok, "{err}");
    let answer: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(answer["rows"], json!([{"key": ["u1", 1], "id": "d1"}, {"key": ["u1", 3], "id": "d3"}]));
    let (ok, out, _) = node.cli(&["index", "list", "k"]);
    assert!(ok && out.contains("by_u"), "{out}");
    let (ok, _, err) = node.cli(&["index", "scan", "k", "by_u", "--eq", "u1"]);
    assert!(!ok && err.contains("not JSON"), "{err}");
    assert!(node.cli(&["index", "drop", "k", "by_u"]).0);
}

#[tokio::test]
async fn a_build_racing_updates_ends_with_exactly_the_final_documents() {
    // Two data paths, and enough documents that the build's key-order read takes several
    // batches while the updates below arrive.
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let node =
        Node::start(&["--partitions", "4", "--index-workers", "2", "--data-path", a.to_str().unwrap(), "--data-path", b.to_str().unwrap()]);
    let c = node.client();
    c.put(node.u("/v1/collections/race")).send().await.unwrap();
    const N: i64 = 40_000;
    for chunk in (0..N).collect::<Vec<_>>().chunks(10_000) {
        let lines: String = chunk.iter().map(|i| format!("{{\"op\":\"upsert\",\"key\":\"d{i}\",\"value\":{{\"v\":{i}}}}}\n")).collect();
        let r = c.post(node.u("/v1/collections/race/_bulk")).body(lines).send().await.unwrap();
        assert!(r.status().is_success());
    }
    post(&c, node.u("/v1/collections/race/indexes"), json!({"name": "v", "keys": ["v"]})).await;
    // While the build runs: move some documents' keys, delete others, re-add a few.
    for i in (0..N).step_by(56) {
        put_doc(&node, &c, "race", &format!("d{i}"), json!({"v": 100_000 + i})).await;
    }
    for i in (0..N).step_by(88) {
        c.delete(node.u(&format!("/v1/collections/race/docs/d{i}"))).send().await.unwrap();
    }
    for i in (0..N).step_by(176) {
        put_doc(&node, &c, "race", &format!("d{i}"), json!({"v": -i})).await;
    }
    let mut expected: Vec<(i64, String)> = (0..N)
        .filter_map(|i| {
            let v = if i % 176 == 0 {
                -i
            } else if i % 88 == 0 {
                return None;
            } else if i % 56 == 0 {
                100_000 + i
            } else {
                i
            };
            Some((v, format!("d{i}")))
        })
        .collect();
    expected.sort();
    let rows = scan(&node, &c, "race", "v", json!({})).await;
    let got: Vec<(i64, String)> = rows.iter().map(|(k, id)| (k[0].as_i64().unwrap(), id.clone())).collect();
    let extra: Vec<_> = got.iter().filter(|g| !expected.contains(g)).collect();
    let missing: Vec<_> = expected.iter().filter(|g| !got.contains(g)).collect();
    assert!(extra.is_empty() && missing.is_empty(), "extra {extra:?} missing {missing:?}");
    assert_eq!(got.len(), expected.len());
    assert_eq!(got, expected);
    let (_, list) = send(&c, reqwest::Method::GET, node.u("/v1/collections/race/indexes"), None).await;
    assert_eq!(list[0]["items"], json!(expected.len()));
}

#[tokio::test]
async fn a_build_interrupted_by_a_restart_resumes_where_it_stopped() {
    const DOCS: usize = 100_000;
    let mut node = Node::start(&["--partitions", "16", "--index-workers", "1"]);
    let c = node.client();
    c.put(node.u("/v1/collections/big")).send().await.unwrap();
    for chunk in (0..DOCS).collect::<Vec<_>>().chunks(10_000) {
        let lines: String = chunk
            .iter()
            .map(|i| format!("{{\"op\":\"upsert\",\"key\":\"d{i:06}\",\"value\":{{\"v\":{i},\"pad\":\"{}\"}}}}\n", "x".repeat(64)))
            .collect();
        let r = c.post(node.u("/v1/collections/big/_bulk")).body(lines).send().await.unwrap();
        assert!(r.status().is_success());
    }
    // Stop the node part-way through the build. A build that this busy machine let finish
    // between two looks at its progress is dropped and made again under another name.
    let progress_of = |list: &Value| list[0]["progress"].as_f64().unwrap();
    let mut caught = None;
    for attempt in 0..3 {
        let name = format!("v{attempt}");
        post(&c, node.u("/v1/collections/big/indexes"), json!({"name": name, "keys": ["v"]})).await;
        let p = loop {
            let (_, list) = send(&c, reqwest::Method::GET, node.u("/v1/collections/big/indexes"), None).await;
            let p = progress_of(&list);
            if p > 0.1 {
                break p;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        if p < 1.0 {
            caught = Some((name, p));
            break;
        }
        let r = c.delete(node.u(&format!("/v1/collections/big/indexes/{name}"))).send().await.unwrap();
        assert!(r.status().is_success(), "{}", r.status());
    }
    let (name, before) = caught.expect("three builds finished before they could be interrupted; raise DOCS");
    let name = name.as_str();
    assert!(node.stop());
    node.restart();
    let c = node.client();
    let (_, list) = send(&c, reqwest::Method::GET, node.u("/v1/collections/big/indexes"), None).await;
    let after = progress_of(&list);
    eprintln!("build progress {before:.3} before the restart, {after:.3} after");
    assert!(after >= before, "progress went from {before} back to {after}: the build started over");
    // Again with kill -9, while documents change under the build.
    let mut killed_at = None;
    for i in 0..2_000 {
        let body = json!({"v": DOCS + i, "pad": "moved"}).to_string();
        let r = c.put(node.u(&format!("/v1/collections/big/docs/d{:06}", i * 37 % DOCS))).body(body).send().await.unwrap();
        assert!(r.status().is_success());
        if i % 50 == 0 {
            let (_, list) = send(&c, reqwest::Method::GET, node.u("/v1/collections/big/indexes"), None).await;
            let p = progress_of(&list);
            if p > after + 0.1 || list[0]["state"] == "ready" {
                killed_at = Some(p);
                break;
            }
        }
    }
    node.kill9();
    node.restart();
    let c = node.client();
    let (_, list) = send(&c, reqwest::Method::GET, node.u("/v1/collections/big/indexes"), None).await;
    let resumed = progress_of(&list);
    eprintln!("build progress {killed_at:?} at kill -9, {resumed:.3} after");
    if let Some(k) = killed_at.filter(|&k| k < 1.0) {
        assert!(resumed >= after, "progress went from {k} back to {resumed} after kill -9");
    }
    // Every document once, with its latest value: the moved ones (v >= DOCS) once each.
    let rows = scan(&node, &c, "big", name, json!({"range": {"low": [0]}, "limit": 100_000})).await;
    let mut ids: Vec<&str> = ids(&rows);
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), DOCS, "one entry per document");
    // Check every moved document and a sample of the others against the store.
    for (k, id) in rows.iter().enumerate().filter(|(i, (k, _))| i % 97 == 0 || k[0].as_u64() >= Some(DOCS as u64)).map(|(_, r)| r) {
        let doc: Value = c.get(node.u(&format!("/v1/collections/big/docs/{id}"))).send().await.unwrap().json().await.unwrap();
        assert_eq!(&doc["v"], &k[0], "entry of {id} holds its latest value");
    }
    let rows = scan(&node, &c, "big", name, json!({"range": {"low": [0]}, "limit": 100_000})).await;
    assert_eq!(rows.len(), DOCS);
    assert!(rows.windows(2).all(|w| w[0].0[0].as_i64() < w[1].0[0].as_i64()));
}
