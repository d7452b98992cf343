//! Sub-document lookups and mutations over HTTP, including their bad input.

mod common;

use common::{ndjson, Node};
use reqwest::StatusCode;
use serde_json::{json, Value};

async fn post(c: &reqwest::Client, url: String, body: Value) -> (StatusCode, Value) {
    let r = c.post(url).body(body.to_string()).send().await.unwrap();
    (r.status(), r.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn lookups_and_mutations() {
    let node = Node::start(&[]);
    let c = node.client();
    c.put(node.u("/v1/collections/s")).send().await.unwrap();
    let doc = json!({"name": "x", "data": {"items": [{"price": 1.5}, {"price": 9.5}]}, "tags": ["a"], "n": 5});
    c.put(node.u("/v1/collections/s/docs/d")).body(doc.to_string()).send().await.unwrap();
    let lookup = node.u("/v1/collections/s/docs/d/lookup");
    let (s, r) = post(
        &c,
        lookup.clone(),
        json!({"specs": [
        {"op": "get", "path": "data.items[-1].price"}, {"op": "exists", "path": "a.b"},
        {"op": "count", "path": "tags"}, {"op": "get", "path": ""}, {"op": "get", "path": "a..b"}]}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{r}");
    assert_eq!(r["results"][0], json!({"status": "ok", "value": 9.5}));
    assert_eq!(r["results"][1], json!({"status": "path_not_found"}));
    assert_eq!(r["results"][2], json!({"status": "ok", "value": 1}));
    assert_eq!(r["results"][3]["value"], doc);
    assert_eq!(r["results"][4], json!({"status": "path_invalid"}));

    // 64 specs in one request.
    let specs: Vec<Value> = (0..64).map(|_| json!({"op": "get", "path": "n"})).collect();
    let (s, r) = post(&c, lookup.clone(), json!({ "specs": specs })).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(r["results"].as_array().unwrap().len(), 64);

    let head = ndjson(&c.get(node.u("/v1/collections/s/changes")).send().await.unwrap().text().await.unwrap());
    let token = head.last().unwrap()["last"].as_str().unwrap().to_string();
    let mutate = node.u("/v1/collections/s/docs/d/mutate");
    let (s, r) = post(
        &c,
        mutate.clone(),
        json!({"specs": [
        {"op": "upsert", "path": "a.b", "value": 1, "create_path": true},
        {"op": "array_append", "path": "tags", "values": ["x", "y"]},
        {"op": "array_add_unique", "path": "tags", "value": "w"},
        {"op": "increment", "path": "n", "delta": -7}], "durability": "persist"}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{r}");
    assert_eq!(r["results"][3], json!({"status": "ok", "value": -2}));
    let stored: Value = c.get(node.u("/v1/collections/s/docs/d")).send().await.unwrap().json().await.unwrap();
    assert_eq!(stored["a"], json!({"b": 1}));
    assert_eq!(stored["tags"], json!(["a", "x", "y", "w"]));
    assert_eq!(stored["n"], -2);
    // One change in the stream for the whole mutate.
    let lines = ndjson(&c.get(node.u(&format!("/v1/collections/s/changes?since={token}"))).send().await.unwrap().text().await.unwrap());
    assert_eq!(lines.iter().filter(|l| l.get("key").is_some()).count(), 1);

    // A failing spec fails the whole request and changes nothing.
    let (s, r) = post(
        &c,
        mutate.clone(),
        json!({"specs": [
        {"op": "upsert", "path": "z", "value": 1}, {"op": "insert", "path": "n", "value": 0}]}),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!((r["error"].as_str(), r["index"].as_u64(), r["status"].as_str()), (Some("path_failure"), Some(1), Some("path_exists")));
    let after: Value = c.get(node.u("/v1/collections/s/docs/d")).send().await.unwrap().json().await.unwrap();
    assert_eq!(after, stored);

    // Store semantics and CAS.
    let (s, r) = post(&c, node.u("/v1/collections/s/docs/new/mutate"), json!({"specs": [{"op": "upsert", "path": "a", "value": 1}]})).await;
    assert_eq!((s, r["error"].as_str()), (StatusCode::NOT_FOUND, Some("doc_not_found")));
    let (s, _) = post(
        &c,
        node.u("/v1/collections/s/docs/new/mutate"),
        json!({"store": "insert", "specs": [{"op": "upsert", "path": "a", "value": 1}]}),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let (s, r) = post(
        &c,
        node.u("/v1/collections/s/docs/new/mutate"),
        json!({"store": "insert", "specs": [{"op": "upsert", "path": "a", "value": 1}]}),
    )
    .await;
    assert_eq!((s, r["error"].as_str()), (StatusCode::CONFLICT, Some("doc_exists")));
    let (s, r) = post(&c, mutate.clone(), json!({"cas": "1", "specs": [{"op": "upsert", "path": "a", "value": 1}]})).await;
    assert_eq!((s, r["error"].as_str()), (StatusCode::CONFLICT, Some("cas_mismatch")));
}

#[tokio::test]
async fn a_large_document_is_answered_from_its_cached_tree() {
    let node = Node::start(&[]);
    let c = node.client();
    c.put(node.u("/v1/collections/s")).send().await.unwrap();
    let data: serde_json::Map<String, Value> = (0..10_000).map(|i| (format!("subkey-{i:06}"), json!(format!("value-{i:06}")))).collect();
    let doc = json!({"key": "big", "data": data});
    c.put(node.u("/v1/collections/s/docs/big")).body(doc.to_string()).send().await.unwrap();
    let specs: Vec<Value> = (9990..10_000).map(|i| json!({"op": "get", "path": format!("data.subkey-{i:06}")})).collect();
    for _ in 0..3 {
        let (s, r) = post(&c, node.u("/v1/collections/s/docs/big/lookup"), json!({ "specs": specs })).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(r["results"][9]["value"], "value-009999");
    }
    let metrics = c.get(node.u("/metrics")).send().await.unwrap().text().await.unwrap();
    // Parsed once; the next two were answered from the cached tree without reading the document.
    assert!(metrics.contains("shoal_subdoc_parsed_cache_total{result=\"miss\"} 1"), "{metrics}");
    assert!(metrics.contains("shoal_subdoc_parsed_cache_total{result=\"unchanged\"} 2"), "{metrics}");
    // A mutation changes the CAS: the next lookup sees the new value, not the cached tree.
    let (s, _) = post(
        &c,
        node.u("/v1/collections/s/docs/big/mutate"),
        json!({"specs": [{"op": "replace", "path": "data.subkey-009999", "value": "new"}]}),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let (_, r) = post(&c, node.u("/v1/collections/s/docs/big/lookup"), json!({ "specs": specs })).await;
    assert_eq!(r["results"][9]["value"], "new");
}

#[tokio::test]
async fn bad_subdoc_requests() {
    let node = Node::start(&[]);
    let c = node.client();
    c.put(node.u("/v1/collections/s")).send().await.unwrap();
    c.put(node.u("/v1/collections/s/docs/d")).body("{\"a\":1}").send().await.unwrap();
    let lookup = node.u("/v1/collections/s/docs/d/lookup");
    let mutate = node.u("/v1/collections/s/docs/d/mutate");
    let too_many: Vec<Value> = (0..129).map(|_| json!({"op": "get", "path": "a"})).collect();
    let cases: Vec<(String, String, u16, &str)> = vec![
        (lookup.clone(), "not json".into(), 400, "invalid_json"),
        (lookup.clone(), "{\"specs\": []}".into(), 400, "bad_request"),
        (lookup.clone(), "{\"specs\": [{\"op\": \"frob\", \"path\": \"a\"}]}".into(), 400, "bad_request"),
        (lookup.clone(), json!({ "specs": too_many }).to_string(), 413, "too_large"),
        (node.u("/v1/collections/s/docs/none/lookup"), "{\"specs\": [{\"op\": \"get\", \"path\": \"a\"}]}".into(), 404, "doc_not_found"),
        (
            node.u("/v1/collections/nope/docs/d/lookup"),
            "{\"specs\": [{\"op\": \"get\", \"path\": \"a\"}]}".into(),
            404,
            "collection_not_found",
        ),
        (mutate.clone(), "{\"specs\": [{\"op\": \"upsert\", \"path\": \"a[\", \"value\": 1}]}".into(), 400, "path_failure"),
        (lookup.clone(), format!("{{\"specs\": [{{\"op\": \"get\", \"path\": \"{}\"}}]}}", "a".repeat(22 << 20)), 413, "too_large"),
        (
            mutate.clone(),
            format!("{{\"specs\": [{{\"op\": \"upsert\", \"path\": \"b\", \"value\": \"{}\"}}]}}", "v".repeat(21 << 20)),
            413,
            "too_large",
        ),
        (lookup.clone(), format!("{{\"specs\": [{{\"op\": \"get\", \"path\": \"{}\"}}]}}", "a".repeat(1025)), 200, ""),
        (mutate.clone(), "{\"specs\": [{\"op\": \"upsert\", \"path\": \"b\"}]}".into(), 400, "path_failure"),
        (mutate.clone(), "{\"specs\": [{\"op\": \"increment\", \"path\": \"a\", \"delta\": \"x\"}]}".into(), 400, "path_failure"),
        (mutate.clone(), "{\"specs\": [{\"op\": \"upsert\", \"path\": \"b\", \"value\": 1}], \"cas\": \"abc\"}".into(), 400, "bad_request"),
        (mutate.clone(), "{\"specs\": [{\"op\": \"upsert\", \"path\": \"b\", \"value\": 1}], \"expiry\": -1}".into(), 400, "bad_request"),
        (
            mutate.clone(),
            "{\"specs\": [{\"op\": \"upsert\", \"path\": \"b\", \"value\": 1}], \"store\": \"maybe\"}".into(),
            400,
            "bad_request",
        ),
        (format!("{mutate}?x=1"), "{\"specs\": [{\"op\": \"upsert\", \"path\": \"b\", \"value\": 1}]}".into(), 400, "bad_request"),
    ];
    for (url, body, status, code) in cases {
        let r = c.post(&url).header("connection", "close").body(body.clone()).send().await.unwrap();
        let got_status = r.status().as_u16();
        let v: Value = r.json().await.unwrap_or(Value::Null);
        let shown = &body[..body.len().min(200)];
        if code.is_empty() {
            assert_eq!((got_status, v["results"][0]["status"].as_str()), (status, Some("path_invalid")), "{shown}: {v}");
        } else {
            assert_eq!((got_status, v["error"].as_str()), (status, Some(code)), "{url} {shown}: {v}");
        }
    }
    let stored: Value = c.get(node.u("/v1/collections/s/docs/d")).send().await.unwrap().json().await.unwrap();
    assert_eq!(stored, json!({"a": 1}));
}

#[test]
fn subdoc_cli() {
    let node = Node::start(&[]);
    assert!(node.cli(&["collection", "create", "s"]).0);
    assert!(node.cli(&["doc", "put", "s", "d", r#"{"a":{"b":[1,2,3]}}"#]).0);
    let (ok, out, err) = node.cli(&["--output", "json", "subdoc", "get", "s", "d", "a.b[-1]", "nope"]);
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["results"][0]["value"], 3);
    assert_eq!(v["results"][1]["status"], "path_not_found");
    let (ok, out, _) = node.cli(&["subdoc", "count", "s", "d", "a.b"]);
    assert!(ok && out.contains("a.b") && out.contains('3'), "{out}");
    let (ok, _, err) = node.cli(&[
        "subdoc",
        "mutate",
        "s",
        "d",
        "--spec",
        r#"{"op":"increment","path":"n","delta":2}"#,
        "--spec",
        r#"{"op":"array_append","path":"a.b","values":[4]}"#,
    ]);
    assert!(ok, "{err}");
    let (ok, out, _) = node.cli(&["--output", "json", "doc", "get", "s", "d"]);
    assert!(ok);
    assert_eq!(serde_json::from_str::<Value>(out.trim()).unwrap(), json!({"a":{"b":[1,2,3,4]},"n":2}));
    let (ok, _, err) = node.cli(&["subdoc", "mutate", "s", "d", "--spec", r#"{"op":"insert","path":"n","value":1}"#]);
    assert!(!ok && err.contains("path_failure"), "{err}");
}
