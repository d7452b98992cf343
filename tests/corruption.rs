//! Corruption is detected and contained (issue 11, item 4): bits flipped on disk while the
//! node is down. An index is derived state, so damage to it is repaired by rebuilding it
//! from the documents while the node serves; damage to a document is reported as `corrupt`
//! when that document is read or written, never as "not found", and never papered over.

mod common;

use std::path::{Path, PathBuf};

use common::{eventually, Node};
use reqwest::StatusCode;
use serde_json::{json, Value};

/// Documents of the index tests.
const DOCS: usize = 600;
/// Distinct colours: each colour's documents, in key order, are one `eq` scan.
const COLOURS: usize = 37;
/// What marks the colour strings, so that the index's files can be told by their content.
const COLOUR_MARK: &[u8] = b"COLOR-";
/// Seconds a rebuilt index gets to answer again (generous: debug builds on a busy machine).
const REBUILD_SECS: u64 = 90;

/// Small documents of the document test (stored inline in the table's data blocks).
const SMALL_DOCS: usize = 400;
/// Large documents, stored in blob files (key-value separation): together more than the
/// documents' memtable (16 MiB), so that it is flushed into a table and blob files.
const BIG_DOCS: usize = 20;
const BIG_DOC_BYTES: usize = 1024 * 1024;

async fn send(c: &reqwest::Client, method: reqwest::Method, url: String, body: Option<String>) -> (StatusCode, Value) {
    let mut req = c.request(method, url);
    if let Some(b) = body {
        req = req.body(b);
    }
    let r = req.send().await.unwrap();
    let status = r.status();
    let text = r.text().await.unwrap();
    common::assert_no_private_paths(&text);
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

async fn post(c: &reqwest::Client, url: String, body: Value) -> (StatusCode, Value) {
    send(c, reqwest::Method::POST, url, Some(body.to_string())).await
}

fn colour(i: usize) -> String {
    format!("COLOR-{:03}", i % COLOURS)
}

fn doc(i: usize) -> Value {
    json!({"color": colour(i), "n": i, "note": format!("document {i}")})
}

/// Every document in `by_color` order: by colour, then by key.
fn by_color_order() -> Vec<(String, String)> {
    let mut rows: Vec<(String, String)> = (0..DOCS).map(|i| (colour(i), format!("d{i:04}"))).collect();
    rows.sort();
    rows
}

/// A collection `c` with [`DOCS`] documents and two indexes, both answering.
async fn load(node: &Node, c: &reqwest::Client) {
    let (s, _) = send(c, reqwest::Method::PUT, node.u("/v1/collections/c"), None).await;
    assert!(s.is_success());
    let puts = (0..DOCS).map(|i| {
        let c = c.clone();
        let url = node.u(&format!("/v1/collections/c/docs/d{i:04}"));
        async move { send(&c, reqwest::Method::PUT, url, Some(doc(i).to_string())).await.0 }
    });
    for status in futures::future::join_all(puts).await {
        assert!(status.is_success(), "{status}");
    }
    // by_color in one partition, so that one keyspace holds all its entries (the damage test
    // flips a bit among them); by_n in the default partitions.
    for (name, key, partitions) in [("by_color", "color", Some(1)), ("by_n", "n", None)] {
        let mut def = json!({"name": name, "keys": [key]});
        if let Some(n) = partitions {
            def["partitions"] = json!(n);
        }
        let (s, r) = post(c, node.u("/v1/collections/c/indexes"), def).await;
        assert_eq!(s, StatusCode::CREATED, "{r}");
    }
    check_by_color(node, c).await;
    check_by_n(node, c).await;
}

/// Scans `index` with `request_plus`: (status, rows as (key, id)).
async fn scan(node: &Node, c: &reqwest::Client, index: &str) -> (StatusCode, Value, Vec<(Value, String)>) {
    let url = node.u(&format!("/v1/collections/c/indexes/{index}/scan"));
    let (s, r) = post(c, url, json!({"consistency": "request_plus", "timeout_ms": 60_000})).await;
    let rows = match r["rows"].as_array() {
        Some(rows) => rows.iter().map(|row| (row["key"][0].clone(), row["id"].as_str().unwrap_or_default().to_string())).collect(),
        None => Vec::new(),
    };
    (s, r, rows)
}

async fn by_color_answers(node: &Node, c: &reqwest::Client) -> bool {
    let (s, _, rows) = scan(node, c, "by_color").await;
    let expected: Vec<(Value, String)> = by_color_order().into_iter().map(|(k, id)| (json!(k), id)).collect();
    s == StatusCode::OK && rows == expected
}

async fn check_by_color(node: &Node, c: &reqwest::Client) {
    let (s, r, _) = scan(node, c, "by_color").await;
    assert_eq!(s, StatusCode::OK, "{r}");
    assert!(by_color_answers(node, c).await, "by_color rows differ: {r}");
}

async fn check_by_n(node: &Node, c: &reqwest::Client) {
    let (s, r, rows) = scan(node, c, "by_n").await;
    assert_eq!(s, StatusCode::OK, "{r}");
    let expected: Vec<(Value, String)> = (0..DOCS).map(|i| (json!(i), format!("d{i:04}"))).collect();
    assert!(rows == expected, "by_n rows differ: {r}");
}

/// Every document reads back as written.
async fn check_docs(node: &Node, c: &reqwest::Client) {
    for i in 0..DOCS {
        let (s, body) = send(c, reqwest::Method::GET, node.u(&format!("/v1/collections/c/docs/d{i:04}")), None).await;
        assert_eq!((s, body), (StatusCode::OK, doc(i)));
    }
}

async fn health(node: &Node, c: &reqwest::Client) -> Value {
    send(c, reqwest::Method::GET, node.u("/v1/health"), None).await.1
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return out };
    for e in entries {
        let path = e.unwrap().path();
        if path.is_dir() {
            out.extend(files_under(&path));
        } else {
            out.push(path);
        }
    }
    out.sort();
    out
}

fn find_all(haystack: &[u8], needle: &[u8]) -> Vec<usize> {
    haystack.windows(needle.len()).enumerate().filter(|(_, w)| *w == needle).map(|(i, _)| i).collect()
}

/// The files under `dir` whose bytes contain `needle`.
fn files_containing(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    files_under(dir).into_iter().filter(|f| !find_all(&std::fs::read(f).unwrap(), needle).is_empty()).collect()
}

/// Flips the lowest bit of the byte at `at` of `file`.
fn flip_bit(file: &Path, at: usize) {
    let mut bytes = std::fs::read(file).unwrap();
    bytes[at] ^= 0x01;
    std::fs::write(file, bytes).unwrap();
}

/// fjall keeps each keyspace in `keyspaces/<number>/` (tables in `tables/`, blob files in
/// `blobs/`), numbered in creation order.
fn keyspace_dirs(db: &Path) -> Vec<(u64, PathBuf)> {
    let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(db.join("keyspaces"))
        .unwrap()
        .filter_map(|e| {
            let path = e.unwrap().path();
            let n = path.file_name()?.to_str()?.parse().ok()?;
            Some((n, path))
        })
        .collect();
    out.sort();
    out
}

fn quarantined(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("index.quarantined-")))
        .collect();
    out.sort();
    out
}

#[tokio::test]
async fn a_flipped_bit_in_one_index_rebuilds_that_index_alone() {
    let mut node = Node::start(&["--partitions", "8"]);
    let c = node.client();
    load(&node, &c).await;
    // A clean stop flushes the index keyspaces into table files.
    assert!(node.stop(), "the node stops cleanly");

    // The colour strings are in the one partition of `by_color` only: its keyspace holds its
    // entries first (they sort before back entries and cursors), then its back entries.
    let index_db = node.dir.join("index");
    let marked: Vec<(u64, PathBuf)> =
        keyspace_dirs(&index_db).into_iter().filter(|(_, d)| !files_containing(&d.join("tables"), COLOUR_MARK).is_empty()).collect();
    assert_eq!(marked.len(), 1, "the keyspace of by_color: {marked:?}");
    let tables = files_containing(&marked[0].1.join("tables"), COLOUR_MARK);
    assert_eq!(tables.len(), 1, "one table after one flush: {tables:?}");
    // Keys share their prefix with the previous key except at a block's restart points, so
    // the full colour string appears at those; back entries hold it in every value, later in
    // the file. The second hit is among the entries (which a scan reads), inside a data
    // block, well before the index block at the end of the file.
    let bytes = std::fs::read(&tables[0]).unwrap();
    let hits = find_all(&bytes, COLOUR_MARK);
    assert!(hits.len() >= 8, "restart points in the data blocks: {hits:?}");
    let at = hits[1] + COLOUR_MARK.len();
    assert!(at < bytes.len() * 3 / 4, "{at} of {}", bytes.len());
    flip_bit(&tables[0], at);

    node.restart();
    // The documents and the other index are untouched.
    check_docs(&node, &c).await;
    check_by_n(&node, &c).await;
    // The scan that meets the damage is told the index is being rebuilt ...
    let (s, r) = post(&c, node.u("/v1/collections/c/indexes/by_color/scan"), json!({})).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{r}");
    assert_eq!(r["error"], "unavailable", "{r}");
    assert!(r["reason"].as_str().unwrap().contains("rebuilt"), "{r}");
    // ... and the index answers the right rows again once rebuilt, changes included.
    eventually(REBUILD_SECS, "by_color rebuilt", || by_color_answers(&node, &c)).await;
    check_by_n(&node, &c).await;
    let (s, _) =
        send(&c, reqwest::Method::PUT, node.u("/v1/collections/c/docs/d0000"), Some(json!({"color": "COLOR-zzz", "n": -1}).to_string()))
            .await;
    assert!(s.is_success());
    let (s, r, rows) = scan(&node, &c, "by_color").await;
    assert_eq!(s, StatusCode::OK, "{r}");
    assert_eq!(rows.last(), Some(&(json!("COLOR-zzz"), "d0000".to_string())));
    let (_, _, rows) = scan(&node, &c, "by_n").await;
    assert_eq!(rows.first(), Some(&(json!(-1), "d0000".to_string())));

    // Counted and reported; only the index was rebuilt, the database stayed.
    eventually(30, "one rebuild in /metrics", || async { common::metric(&c, &node, "shoal_index_rebuilds_total").await == Some(1.0) })
        .await;
    let h = health(&node, &c).await;
    assert!(h["indexes"]["errors"].as_u64().unwrap() >= 1, "{h}");
    assert!(h["indexes"]["last_error"].as_str().unwrap().contains("by_color"), "{h}");
    assert!(quarantined(&node.dir).is_empty());
    assert!(node.stop());
}

#[tokio::test]
async fn an_index_database_that_cannot_open_is_moved_aside_and_rebuilt() {
    let mut node = Node::start(&["--partitions", "8"]);
    let c = node.client();
    load(&node, &c).await;
    assert!(node.stop(), "the node stops cleanly");
    // fjall's format marker: a database whose marker does not parse is not opened at all.
    let garbage = b"\xde\xad\xbe\xef garbage";
    std::fs::write(node.dir.join("index").join("version"), garbage).unwrap();

    node.restart();
    check_docs(&node, &c).await;
    eventually(REBUILD_SECS, "by_color rebuilt", || by_color_answers(&node, &c)).await;
    check_by_n(&node, &c).await;
    let moved = quarantined(&node.dir);
    assert_eq!(moved.len(), 1, "{moved:?}");
    let suffix = moved[0].file_name().unwrap().to_str().unwrap().trim_start_matches("index.quarantined-").to_string();
    assert!(suffix.parse::<u64>().is_ok(), "unix seconds: {suffix}");
    assert_eq!(std::fs::read(moved[0].join("version")).unwrap(), garbage, "kept as it was found");
    eventually(30, "two rebuilds in /metrics", || async { common::metric(&c, &node, "shoal_index_rebuilds_total").await == Some(2.0) })
        .await;
    let h = health(&node, &c).await;
    assert!(h["indexes"]["errors"].as_u64().unwrap() >= 1, "{h}");

    // The new database is a normal one: it survives a restart without another rebuild.
    assert!(node.stop());
    node.restart();
    check_by_color(&node, &c).await;
    check_by_n(&node, &c).await;
    assert_eq!(quarantined(&node.dir).len(), 1);
    assert!(node.stop());
}

/// A large document that lz4 cannot shrink (pseudo-random hex), starting with its tag: the
/// tag opens the blob's compressed bytes verbatim, as a literal.
fn big_doc(i: usize) -> String {
    let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ i as u64;
    let mut pad = String::with_capacity(BIG_DOC_BYTES);
    while pad.len() < BIG_DOC_BYTES {
        // xorshift64: deterministic, and without runs lz4 could match.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        pad.push_str(&format!("{state:016x}"));
    }
    format!(r#"{{"tag":"BIGDOC-{i:02}","pad":"{pad}"}}"#)
}

/// The small document whose bytes the test damages, and a mark only it carries. Partition
/// tables are LZ4-compressed, so a table holds a document's text verbatim only where LZ4
/// found nothing to match: the tags all share `SMALLDOC-0`, but the mark's letters appear
/// nowhere else (nor twice in it), so it stays one literal run, findable in the file.
const MARKED_DOC: usize = 200;
const SMALL_MARK: &str = "qwxzjkybpfhm";

fn small_doc(i: usize) -> Value {
    let mut doc = json!({"tag": format!("SMALLDOC-{i:04}"), "v": i});
    if i == MARKED_DOC {
        doc["mark"] = json!(SMALL_MARK);
    }
    doc
}

async fn get(node: &Node, c: &reqwest::Client, key: &str) -> (StatusCode, Value) {
    send(c, reqwest::Method::GET, node.u(&format!("/v1/collections/c/docs/{key}")), None).await
}

async fn put(node: &Node, c: &reqwest::Client, key: &str, body: String) -> (StatusCode, Value) {
    send(c, reqwest::Method::PUT, node.u(&format!("/v1/collections/c/docs/{key}")), Some(body)).await
}

fn assert_corrupt((s, r): (StatusCode, Value), what: &str) {
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR, "{what}: {r}");
    assert_eq!(r["error"], "corrupt", "{what}: {r}");
}

#[tokio::test]
async fn a_flipped_bit_in_a_document_answers_corrupt() {
    // One partition: every document in one keyspace, so one table and one blob file.
    let mut node = Node::start(&["--partitions", "1"]);
    let c = node.client();
    let (s, _) = send(&c, reqwest::Method::PUT, node.u("/v1/collections/c"), None).await;
    assert!(s.is_success());
    for i in 0..SMALL_DOCS {
        assert_eq!(put(&node, &c, &format!("s{i:04}"), small_doc(i).to_string()).await.0, StatusCode::OK);
    }
    for i in 0..BIG_DOCS {
        assert_eq!(put(&node, &c, &format!("b{i:02}"), big_doc(i)).await.0, StatusCode::OK);
    }
    // The big documents filled the memtable: it is flushed into a table (small documents
    // inline in its data blocks) and a blob file (the big ones).
    let db = node.dir.join("db");
    let (small_mark, big_mark) = (SMALL_MARK.as_bytes(), b"BIGDOC-03".as_slice());
    eventually(60, "the documents flushed into files", || {
        let db = db.clone();
        async move {
            keyspace_dirs(&db).iter().any(|(_, d)| {
                !files_containing(&d.join("tables"), small_mark).is_empty() && !files_containing(&d.join("blobs"), big_mark).is_empty()
            })
        }
    })
    .await;
    assert!(node.stop(), "the node stops cleanly");

    // One bit inside a small document (in a table's data block) and one inside a big one
    // (in a blob file); each is covered by a checksum.
    let (_, docs) = keyspace_dirs(&db)
        .into_iter()
        .find(|(_, d)| !files_containing(&d.join("tables"), small_mark).is_empty())
        .expect("the documents' keyspace");
    let tables = files_containing(&docs.join("tables"), small_mark);
    let blobs = files_containing(&docs.join("blobs"), big_mark);
    assert_eq!((tables.len(), blobs.len()), (1, 1), "{tables:?} {blobs:?}");
    let table = std::fs::read(&tables[0]).unwrap();
    let at = find_all(&table, small_mark);
    assert_eq!(at.len(), 1);
    flip_bit(&tables[0], at[0] + small_mark.len() - 1);
    let blob = std::fs::read(&blobs[0]).unwrap();
    let at = find_all(&blob, big_mark);
    assert_eq!(at.len(), 1);
    flip_bit(&blobs[0], at[0] + big_mark.len() - 1);

    node.restart();
    // Reading a damaged document says so: not 404, not a stale or a wrong body.
    let marked = format!("s{MARKED_DOC:04}");
    assert_corrupt(get(&node, &c, &marked).await, "get of the damaged small document");
    assert_corrupt(get(&node, &c, "b03").await, "get of the damaged big document");
    // Writing over it would hide the damage: the write reads the current record and fails
    // the same way (and so does a delete), and the record stays as it is.
    assert_corrupt(put(&node, &c, &marked, small_doc(0).to_string()).await, "upsert over the damaged small document");
    assert_corrupt(put(&node, &c, "b03", big_doc(0)).await, "upsert over the damaged big document");
    assert_corrupt(
        send(&c, reqwest::Method::DELETE, node.u(&format!("/v1/collections/c/docs/{marked}")), None).await,
        "delete of the damaged document",
    );
    assert_corrupt(get(&node, &c, &marked).await, "the damaged document after the refused writes");

    // Everything else keeps working: documents in other blocks and other blobs, writes.
    for i in [0, SMALL_DOCS - 1] {
        assert_eq!(get(&node, &c, &format!("s{i:04}")).await, (StatusCode::OK, small_doc(i)));
    }
    for i in [0, 2, 4, BIG_DOCS - 1] {
        let (s, body) = get(&node, &c, &format!("b{i:02}")).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(body, serde_json::from_str::<Value>(&big_doc(i)).unwrap());
    }
    assert_eq!(put(&node, &c, "s0000", json!({"new": true}).to_string()).await.0, StatusCode::OK);
    assert_eq!(get(&node, &c, "s0000").await, (StatusCode::OK, json!({"new": true})));
    assert_eq!(put(&node, &c, "fresh", json!({"new": 1}).to_string()).await.0, StatusCode::OK);
    assert_eq!(health(&node, &c).await["storage"]["writable"], true);
    assert!(node.stop());
}
