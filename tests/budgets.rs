//! Answers that carry documents are bounded: a small request naming a large document many
//! times gets `too_large` (or, for change feeds, a continuation), never an answer the node
//! must build in memory without limit. Also the small things the review found: one line per
//! key in a `feed=normal` answer, and a parsed-tree cache that cannot answer from a dropped
//! collection.

mod common;

use std::collections::BTreeSet;

use common::{ndjson, Node};
use reqwest::StatusCode;
use serde_json::{json, Value};

/// Stays in step with `shoal_server::changes::CHANGES_ANSWER_MAX_BYTES`.
const CHANGES_ANSWER_MAX_BYTES: usize = 16 << 20;
/// Stays in step with the largest document the node takes (20 MiB bodies).
const DOC_MAX_BYTES: usize = 20 << 20;

async fn post(c: &reqwest::Client, url: String, body: String) -> (StatusCode, Value) {
    let r = c.post(url).body(body).send().await.unwrap();
    (r.status(), r.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn answers_that_carry_documents_are_bounded() {
    let node = Node::start(&["--partitions", "4"]);
    let c = node.client();
    c.put(node.u("/v1/collections/b")).send().await.unwrap();
    // Six documents of 15 MiB: 90 MiB in all, more than any single answer may carry.
    let pad = "x".repeat(15 << 20);
    for i in 0..6 {
        let doc = json!({"city": "Oslo", "n": i, "pad": pad}).to_string();
        let r = c.put(node.u(&format!("/v1/collections/b/docs/d{i}"))).body(doc).send().await.unwrap();
        assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    }

    // `_get` with 1,000 copies of one key: 15 GB if built.
    let keys: Vec<&str> = vec!["d0"; 1_000];
    let (s, r) = post(&c, node.u("/v1/collections/b/_get"), json!({ "keys": keys }).to_string()).await;
    assert_eq!((s, r["error"].as_str()), (StatusCode::PAYLOAD_TOO_LARGE, Some("too_large")), "{r}");

    // A lookup with 128 whole-document gets: 1.9 GB if built.
    let specs: Vec<Value> = (0..128).map(|_| json!({"op": "get", "path": ""})).collect();
    let (s, r) = post(&c, node.u("/v1/collections/b/docs/d0/lookup"), json!({ "specs": specs }).to_string()).await;
    assert_eq!((s, r["error"].as_str()), (StatusCode::PAYLOAD_TOO_LARGE, Some("too_large")), "{r}");

    // An index scan with include_docs over all six.
    let (s, r) = post(&c, node.u("/v1/collections/b/indexes"), json!({"name": "city", "keys": ["city"]}).to_string()).await;
    assert_eq!(s, StatusCode::CREATED, "{r}");
    let scan = json!({"eq": ["Oslo"], "include_docs": true, "consistency": "request_plus"}).to_string();
    let (s, r) = post(&c, node.u("/v1/collections/b/indexes/city/scan"), scan).await;
    assert_eq!((s, r["error"].as_str()), (StatusCode::PAYLOAD_TOO_LARGE, Some("too_large")), "{r}");
    // Without documents the same scan is fine.
    let scan = json!({"eq": ["Oslo"], "consistency": "request_plus"}).to_string();
    let (s, r) = post(&c, node.u("/v1/collections/b/indexes/city/scan"), scan).await;
    assert_eq!(s, StatusCode::OK, "{r}");
    assert_eq!(r["rows"].as_array().map(Vec::len), Some(6));

    // A change feed with documents stops each answer near its byte budget and continues.
    let mut since = String::new();
    let mut seen = BTreeSet::new();
    let mut answers = 0;
    loop {
        let url = format!("/v1/collections/b/changes?include_docs=true{since}");
        let body = c.get(node.u(&url)).send().await.unwrap().text().await.unwrap();
        assert!(body.len() <= CHANGES_ANSWER_MAX_BYTES + DOC_MAX_BYTES, "an answer of {} bytes", body.len());
        let lines = ndjson(&body);
        let changes: Vec<&Value> = lines.iter().filter(|l| l.get("key").is_some()).collect();
        for ch in &changes {
            assert_eq!(ch["doc"]["pad"].as_str().map(str::len), Some(15 << 20), "a change carries its document");
            assert!(seen.insert(ch["key"].as_str().unwrap().to_string()), "{} twice", ch["key"]);
        }
        since = format!("&since={}", lines.last().and_then(|l| l["last"].as_str()).expect("a last line"));
        answers += 1;
        if changes.is_empty() {
            break;
        }
    }
    assert_eq!(seen.len(), 6);
    assert!(answers >= 4, "90 MiB of documents came in {answers} answers: the byte budget was not applied");

    // Nothing was lost or damaged along the way.
    for i in 0..6 {
        let r = c.get(node.u(&format!("/v1/collections/b/docs/d{i}"))).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let doc: Value = r.json().await.unwrap();
        assert_eq!(doc["n"], i);
    }
}

#[tokio::test]
async fn a_normal_feed_names_each_key_once() {
    let node = Node::start(&["--partitions", "4"]);
    let c = node.client();
    c.put(node.u("/v1/collections/f")).send().await.unwrap();
    let mut bulk = String::new();
    for i in 0..2_000 {
        bulk.push_str(&format!("{{\"op\":\"upsert\",\"key\":\"k{i}\",\"value\":{{\"v\":0}}}}\n"));
    }
    let r = c.post(node.u("/v1/collections/f/_bulk")).body(bulk).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK, "{}", r.text().await.unwrap());
    // Some keys change several times, one is deleted: the in-memory tail holds all of it.
    for round in 1..=3 {
        for i in 0..50 {
            c.put(node.u(&format!("/v1/collections/f/docs/k{i}"))).body(format!("{{\"v\":{round}}}")).send().await.unwrap();
        }
    }
    c.delete(node.u("/v1/collections/f/docs/k7")).send().await.unwrap();

    let lines = ndjson(&c.get(node.u("/v1/collections/f/changes?include_docs=true")).send().await.unwrap().text().await.unwrap());
    let changes: Vec<&Value> = lines.iter().filter(|l| l.get("key").is_some()).collect();
    let keys: BTreeSet<&str> = changes.iter().map(|ch| ch["key"].as_str().unwrap()).collect();
    assert_eq!(changes.len(), keys.len(), "a key appeared more than once in one answer");
    assert_eq!(keys.len(), 2_000);
    // Each key's line is its latest change.
    for ch in &changes {
        match ch["key"].as_str().unwrap() {
            "k7" => assert_eq!(ch["deleted"], true),
            "k3" => assert_eq!(ch["doc"]["v"], 3),
            "k1999" => assert_eq!(ch["doc"]["v"], 0),
            _ => {}
        }
    }
}

#[tokio::test]
async fn a_recreated_collection_never_answers_from_the_dropped_ones_cache() {
    let node = Node::start(&["--partitions", "1"]);
    let c = node.client();
    // Large enough for the parsed-tree cache; one write each, so both collections' partition
    // reaches the same seqno and only the collection's identity tells them apart.
    let doc = |v: &str| {
        let data: serde_json::Map<String, Value> = (0..200).map(|i| (format!("f{i:03}"), json!(v))).collect();
        Value::Object(data).to_string()
    };
    let lookup = json!({"specs": [{"op": "get", "path": "f199"}]}).to_string();
    c.put(node.u("/v1/collections/r")).send().await.unwrap();
    c.put(node.u("/v1/collections/r/docs/d")).body(doc("old")).send().await.unwrap();
    for _ in 0..2 {
        let (s, r) = post(&c, node.u("/v1/collections/r/docs/d/lookup"), lookup.clone()).await;
        assert_eq!(s, StatusCode::OK, "{r}");
        assert_eq!(r["results"][0]["value"], "old");
    }
    assert!(c.delete(node.u("/v1/collections/r")).send().await.unwrap().status().is_success());
    c.put(node.u("/v1/collections/r")).send().await.unwrap();
    c.put(node.u("/v1/collections/r/docs/d")).body(doc("new")).send().await.unwrap();
    let (s, r) = post(&c, node.u("/v1/collections/r/docs/d/lookup"), lookup).await;
    assert_eq!(s, StatusCode::OK, "{r}");
    assert_eq!(r["results"][0]["value"], "new");
}
