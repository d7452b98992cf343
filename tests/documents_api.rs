//! The collections and documents API of API.md, end to end against the real binary.

mod common;

use common::{ndjson, Node};
use reqwest::StatusCode;
use serde_json::{json, Value};

async fn put(c: &reqwest::Client, url: String, body: &str) -> (StatusCode, Value) {
    let r = c.put(url).body(body.to_string()).send().await.unwrap();
    let s = r.status();
    (s, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn collections_and_documents_round_trip() {
    let node = Node::start(&[]);
    let c = node.client();
    assert_eq!(c.put(node.u("/v1/collections/users")).send().await.unwrap().status(), StatusCode::CREATED);
    let r = c.put(node.u("/v1/collections/users")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CONFLICT);
    assert_eq!(r.json::<Value>().await.unwrap()["error"], "collection_exists");

    // Upsert, get with ETag, replace at CAS, stale CAS refused.
    let (s, m) = put(&c, node.u("/v1/collections/users/docs/alice"), r#"{"name":"Alice"}"#).await;
    assert_eq!(s, StatusCode::OK);
    let cas1 = m["cas"].as_str().unwrap().to_string();
    assert!(m["token"]["seqno"].as_u64().unwrap() >= 1);
    let r = c.get(node.u("/v1/collections/users/docs/alice")).send().await.unwrap();
    assert_eq!(r.headers()["etag"].to_str().unwrap(), format!("\"{cas1}\""));
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"name":"Alice"}));
    let r = c
        .put(node.u("/v1/collections/users/docs/alice"))
        .header("if-match", format!("\"{cas1}\""))
        .body(r#"{"v":2}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = c
        .put(node.u("/v1/collections/users/docs/alice"))
        .header("if-match", format!("\"{cas1}\""))
        .body(r#"{"v":3}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CONFLICT);
    assert_eq!(r.json::<Value>().await.unwrap()["error"], "cas_mismatch");

    // Insert and replace semantics.
    let r = c.put(node.u("/v1/collections/users/docs/alice")).header("if-none-match", "*").body("{}").send().await.unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["error"], "doc_exists");
    let r = c.put(node.u("/v1/collections/users/docs/bob")).header("if-match", "*").body("{}").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let r = c.put(node.u("/v1/collections/users/docs/bob")).header("if-none-match", "*").body("{\"b\":1}").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);

    // Remove, then it is gone.
    let r = c.delete(node.u("/v1/collections/users/docs/bob")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = c.get(node.u("/v1/collections/users/docs/bob")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    assert_eq!(r.json::<Value>().await.unwrap()["error"], "doc_not_found");

    // Multi-get.
    let r: Value =
        c.post(node.u("/v1/collections/users/_get")).body(r#"{"keys":["alice","bob"]}"#).send().await.unwrap().json().await.unwrap();
    assert_eq!(r["docs"][0]["value"], json!({"v":2}));
    assert_eq!(r["docs"][1]["error"], "doc_not_found");

    // Listing counts live documents; dropping removes everything.
    let list: Value = c.get(node.u("/v1/collections")).send().await.unwrap().json().await.unwrap();
    assert_eq!(list[0]["name"], "users");
    assert_eq!(list[0]["docs"], 1);
    assert_eq!(c.delete(node.u("/v1/collections/users")).send().await.unwrap().status(), StatusCode::OK);
    let r = c.get(node.u("/v1/collections/users/docs/alice")).send().await.unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["error"], "collection_not_found");
    c.put(node.u("/v1/collections/users")).send().await.unwrap();
    let r = c.get(node.u("/v1/collections/users/docs/alice")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND, "a re-created collection starts empty");
}

#[tokio::test]
async fn lock_unlock_touch() {
    let node = Node::start(&[]);
    let c = node.client();
    c.put(node.u("/v1/collections/c")).send().await.unwrap();
    put(&c, node.u("/v1/collections/c/docs/k"), "1").await;
    let r = c.get(node.u("/v1/collections/c/docs/k?lock=10")).send().await.unwrap();
    let lock_cas = r.headers()["etag"].to_str().unwrap().to_string();
    // Locked: a second lock and a plain write fail; a plain get shows the locked CAS.
    let r = c.get(node.u("/v1/collections/c/docs/k?lock=10")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::LOCKED);
    assert_eq!(r.json::<Value>().await.unwrap()["error"], "locked");
    let (s, body) = put(&c, node.u("/v1/collections/c/docs/k"), "2").await;
    assert_eq!((s, body["error"].as_str()), (StatusCode::LOCKED, Some("locked")));
    let r = c.get(node.u("/v1/collections/c/docs/k")).send().await.unwrap();
    assert_eq!(r.headers()["etag"], "\"18446744073709551615\"");
    // Wrong CAS does not unlock; the right one does.
    let r = c.post(node.u("/v1/collections/c/docs/k/unlock")).header("if-match", "\"12345\"").send().await.unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["error"], "cas_mismatch");
    let r = c.post(node.u("/v1/collections/c/docs/k/unlock")).header("if-match", &lock_cas).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let (s, _) = put(&c, node.u("/v1/collections/c/docs/k"), "3").await;
    assert_eq!(s, StatusCode::OK);
    // Mutating with the lock's CAS releases the lock.
    let r = c.get(node.u("/v1/collections/c/docs/k?lock=10")).send().await.unwrap();
    let lock_cas = r.headers()["etag"].to_str().unwrap().to_string();
    let r = c.put(node.u("/v1/collections/c/docs/k")).header("if-match", &lock_cas).body("4").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(put(&c, node.u("/v1/collections/c/docs/k"), "5").await.0, StatusCode::OK);

    // Touch and get-and-touch set an expiry; a document that expired is never returned.
    // (Expiry has one-second resolution: `expiry=1` can end a moment after it is set.)
    let r = c.post(node.u("/v1/collections/c/docs/k/touch?expiry=30")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = c.get(node.u("/v1/collections/c/docs/k?touch=100")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert!(r.headers().contains_key("x-shoal-expiry"));
    put(&c, node.u("/v1/collections/c/docs/short?expiry=1"), "\"bye\"").await;
    tokio::time::sleep(std::time::Duration::from_millis(2200)).await;
    let r = c.get(node.u("/v1/collections/c/docs/short")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let r = c.get(node.u("/v1/collections/c/docs/k")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK, "touched to 100 s, still there");
    // The expiry pager turned the expired document into a deletion in the change stream.
    let mut deleted = false;
    for _ in 0..50 {
        let body = c.get(node.u("/v1/collections/c/changes")).send().await.unwrap().text().await.unwrap();
        deleted = ndjson(&body).iter().any(|l| l["key"] == "short" && l["deleted"] == true);
        if deleted {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(deleted, "expired document shows as deleted in the change stream");
}

#[tokio::test]
async fn bulk_load_answers_line_by_line() {
    let node = Node::start(&[]);
    let c = node.client();
    c.put(node.u("/v1/collections/b")).send().await.unwrap();
    let body = "{\"op\":\"upsert\",\"key\":\"a\",\"value\":{\"x\":1}}\n\
                this is not json\n\
                {\"op\":\"insert\",\"key\":\"a\",\"value\":2}\n\
                {\"op\":\"upsert\",\"key\":\"b\",\"value\":[1,2],\"expiry\":100}\n\
                {\"op\":\"replace\",\"key\":\"a\",\"value\":3}\n\
                {\"op\":\"remove\",\"key\":\"b\"}\n\
                {\"op\":\"upsert\",\"key\":\"\",\"value\":1}\n\
                {\"op\":\"frobnicate\",\"key\":\"c\"}\n";
    let r = c.post(node.u("/v1/collections/b/_bulk?durability=persist")).body(body).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let lines = ndjson(&r.text().await.unwrap());
    assert_eq!(lines.len(), 8);
    assert!(lines[0]["cas"].is_string());
    assert_eq!(lines[1]["error"], "invalid_json");
    assert_eq!(lines[2]["error"], "doc_exists");
    assert!(lines[3]["cas"].is_string());
    assert!(lines[4]["cas"].is_string());
    assert!(lines[5]["cas"].is_string());
    assert_eq!(lines[6]["error"], "invalid_key");
    assert_eq!(lines[7]["error"], "invalid_json");
    let r: Value = c.get(node.u("/v1/collections/b/docs/a")).send().await.unwrap().json().await.unwrap();
    assert_eq!(r, json!(3));
    assert_eq!(c.get(node.u("/v1/collections/b/docs/b")).send().await.unwrap().status(), StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn operations_endpoints() {
    let node = Node::start(&["--partitions", "16"]);
    let c = node.client();
    let h: Value = c.get(node.u("/v1/health")).send().await.unwrap().json().await.unwrap();
    assert_eq!(h["status"], "ok");
    let n: Value = c.get(node.u("/v1/node")).send().await.unwrap().json().await.unwrap();
    assert_eq!(n["partitions"], 16);
    assert!(n["version"].is_string());
    c.put(node.u("/v1/collections/m")).send().await.unwrap();
    put(&c, node.u("/v1/collections/m/docs/x"), "{}").await;
    c.get(node.u("/v1/collections/m/docs/x")).send().await.unwrap();
    let text = c.get(node.u("/metrics")).send().await.unwrap().text().await.unwrap();
    for needle in [
        "shoal_requests_total",
        "shoal_request_duration_seconds_bucket",
        "op=\"doc_get\"",
        "shoal_documents{collection=\"m\"} 1",
        "shoal_changes{collection=\"m\"} 1",
    ] {
        assert!(text.contains(needle), "metrics lack {needle}:\n{text}");
    }
}

#[tokio::test]
async fn partition_count_is_fixed_and_shutdown_is_clean() {
    let mut node = Node::start(&["--partitions", "8"]);
    assert!(node.stop(), "SIGTERM exits cleanly");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["serve", "--listen", "127.0.0.1:0", "--partitions", "16", "--data-path"])
        .arg(&node.dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("created with 8 partitions"));
    // A data path of another layout version is refused, not misread.
    let record_file = node.dir.join("shoal-path.json");
    let record = std::fs::read_to_string(&record_file).unwrap();
    let mut older: Value = serde_json::from_str(&record).unwrap();
    older["format"] = json!(1);
    std::fs::write(&record_file, older.to_string()).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["serve", "--listen", "127.0.0.1:0", "--data-path"])
        .arg(&node.dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("layout version 1"), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::write(&record_file, record).unwrap();
    node.restart();
    let n: Value = node.client().get(node.u("/v1/node")).send().await.unwrap().json().await.unwrap();
    assert_eq!(n["partitions"], 8);
    assert_eq!(n["recovered_unclean"], false);
}

#[tokio::test]
async fn data_spreads_over_several_paths() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let mut node = Node::start(&["--data-path", a.to_str().unwrap(), "--data-path", b.to_str().unwrap()]);
    let c = node.client();
    c.put(node.u("/v1/collections/s")).send().await.unwrap();
    for i in 0..50 {
        put(&c, node.u(&format!("/v1/collections/s/docs/k{i}?durability=persist")), "{\"v\":1}").await;
    }
    assert!(a.join("shoal-path.json").exists() && b.join("shoal-path.json").exists());
    assert!(node.stop());
    node.restart();
    let list: Value = node.client().get(node.u("/v1/collections")).send().await.unwrap().json().await.unwrap();
    assert_eq!(list[0]["docs"], 50);
}

#[test]
fn cli_speaks_to_the_server() {
    let node = Node::start(&[]);
    let (ok, out, _) = node.cli(&["collection", "create", "people"]);
    assert!(ok, "{out}");
    let (ok, _, _) = node.cli(&["doc", "put", "people", "p1", r#"{"name":"Ann"}"#]);
    assert!(ok);
    let (ok, out, _) = node.cli(&["--output", "json", "doc", "get", "people", "p1"]);
    assert!(ok);
    assert_eq!(serde_json::from_str::<Value>(out.trim()).unwrap(), json!({"name":"Ann"}));
    let (ok, _, err) = node.cli(&["doc", "insert", "people", "p1", "{}"]);
    assert!(!ok);
    assert!(err.contains("doc_exists"), "{err}");
    let (ok, out, _) = node.cli(&["collection", "list"]);
    assert!(ok && out.contains("people"), "{out}");
    let (ok, out, _) = common::cli(&node.url, &["--output", "json", "doc", "replace", "people", "p1"], Some(r#"{"name":"Bo"}"#));
    assert!(ok, "{out}");
    let (ok, _, _) = node.cli(&["doc", "touch", "people", "p1", "--expiry", "500"]);
    assert!(ok);
    let (ok, out, _) = node.cli(&["--output", "json", "changes", "people", "--include-docs"]);
    assert!(ok && out.contains("\"Bo\"") && out.contains("\"last\""), "{out}");
    let (ok, _, _) = node.cli(&["doc", "rm", "people", "p1"]);
    assert!(ok);
    let (ok, _, err) = node.cli(&["doc", "get", "people", "p1"]);
    assert!(!ok && err.contains("doc_not_found"), "{err}");

    let file = node.dir.parent().unwrap().join("load.ndjson");
    let lines: String = (0..1234).map(|i| format!("{{\"key\":\"l{i}\",\"value\":{{\"n\":{i}}}}}\n")).collect();
    std::fs::write(&file, lines + "not json\n").unwrap();
    let (ok, out, err) = node.cli(&["load", "people", file.to_str().unwrap(), "--batch", "100"]);
    assert!(!ok, "a broken line makes the load fail: {out}");
    assert!(out.contains("loaded 1234 documents (1 failed)"), "{out} {err}");
    let (ok, _, err) = node.cli(&["collection", "drop", "nope"]);
    assert!(!ok && err.contains("collection_not_found"), "{err}");
}

#[tokio::test]
async fn h2c_multiplexes_requests_on_one_connection() {
    let node = Node::start(&[]);
    let h2 = common::client_builder().http2_prior_knowledge().build().unwrap();
    let r = h2.put(node.u("/v1/collections/h")).send().await.unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    assert_eq!(r.status(), StatusCode::CREATED);
    let puts = (0..64).map(|i| {
        let (h2, url) = (h2.clone(), node.u(&format!("/v1/collections/h/docs/k{i}")));
        async move { h2.put(url).body(format!("{{\"i\":{i}}}")).send().await.unwrap().status() }
    });
    let statuses = futures::future::join_all(puts).await;
    assert!(statuses.iter().all(|s| *s == StatusCode::OK));
    let v: Value = h2.get(node.u("/v1/collections/h/docs/k63")).send().await.unwrap().json().await.unwrap();
    assert_eq!(v, json!({"i": 63}));
}
