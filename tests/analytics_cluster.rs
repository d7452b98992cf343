//! Analytics across a cluster (issue 42): a statement asked of any member runs on every
//! member holding partitions active, each scanning its own shadow, and answers what the
//! row engine (checked against DuckDB by `bench/tpch_diff.sh`) answers, or `503` with a
//! reason — never a partial answer.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::cluster::{member_states, rebalance, wait_for, SECRET};
use common::Node;
use serde_json::{json, Value};

/// Analytics on (two analytics partitions), few partitions so that rebalances are quick.
const ARGS: [&str; 6] = ["--cluster-secret", SECRET, "--partitions", "16", "--analytics-partitions", "2"];

fn http() -> reqwest::Client {
    common::client_builder().timeout(Duration::from_secs(120)).build().unwrap()
}

/// `n` nodes, the first founding the cluster, rebalanced over all of them.
async fn cluster(http: &reqwest::Client, n: usize) -> Vec<Node> {
    let mut first = Node::start(&ARGS);
    first.pin_port();
    let join = first.addr();
    let mut nodes = vec![first];
    for _ in 1..n {
        let mut node = Node::start(&[&ARGS[..], &["--join", &join][..]].concat());
        node.pin_port();
        nodes.push(node);
    }
    wait_for(http, &nodes[0].u("/v1/cluster"), "every member", |v| member_states(v).len() == n).await;
    rebalance(http, &nodes[0], &[]).await;
    nodes
}

async fn statement(http: &reqwest::Client, node: &Node, endpoint: &str, sql: &str) -> (u16, Value) {
    let r = http
        .post(node.u(&format!("/v1/{endpoint}")))
        .json(&json!({"sql": sql, "consistency": "request_plus"}))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{endpoint}: {e}"));
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Three members (see [`cluster`]) holding collection `c` of `docs` documents
/// `{"g": i % 10, "n": i}`, written at `durability`.
async fn loaded_cluster(http: &reqwest::Client, docs: usize, durability: &str) -> Vec<Node> {
    let nodes = cluster(http, 3).await;
    assert_eq!(http.put(nodes[0].u("/v1/collections/c")).send().await.unwrap().status(), 201);
    for chunk in (0..docs).collect::<Vec<_>>().chunks(2_000) {
        let lines = chunk.iter().map(|i| json!({"op": "upsert", "key": format!("k{i:05}"), "value": {"g": i % 10, "n": i}}));
        bulk(http, &nodes[0], lines, Some(durability)).await;
    }
    nodes
}

/// Writes `lines` (`_bulk` operations) to collection `c` through `node` in one request, at
/// `durability` (`None`: the default); every line must succeed.
async fn bulk(http: &reqwest::Client, node: &Node, lines: impl IntoIterator<Item = Value>, durability: Option<&str>) {
    let body: String = lines.into_iter().map(|l| l.to_string() + "\n").collect();
    let path = match durability {
        Some(d) => format!("/v1/collections/c/_bulk?durability={d}"),
        None => "/v1/collections/c/_bulk".to_string(),
    };
    let r = http.post(node.u(&path)).body(body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(!r.text().await.unwrap().contains("\"error\""), "every line written");
}

/// Rows equal, numbers within a relative 1e-9 (the engines add floats in different orders).
fn same_rows(a: &Value, b: &Value) -> bool {
    let (Some(a), Some(b)) = (a.as_array(), b.as_array()) else { return false };
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            let (Some(x), Some(y)) = (x.as_array(), y.as_array()) else { return false };
            x.len() == y.len()
                && x.iter().zip(y).all(|(u, v)| match (u.as_f64(), v.as_f64()) {
                    (Some(u), Some(v)) => (u - v).abs() <= 1e-9 * u.abs().max(v.abs()).max(1.0),
                    _ => u == v,
                })
        })
}

/// TPC-H at a tiny scale factor on three processes: the distributed statements, through
/// either endpoint, answer what the row engine of a lone node holding the same documents
/// answers, each run on the members' shadows.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tpch_on_three_members_answers_what_the_rows_answer() {
    let http = http();
    let data = tempfile::tempdir().unwrap();
    let status = std::process::Command::new(common::binary())
        .args(["bench", "tpch-gen", "--sf", "0.008", "--out"])
        .arg(data.path())
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "tpch-gen");
    let nodes = cluster(&http, 3).await;
    // The model: one node without shadows, reading its documents.
    let lone = Node::start(&["--partitions", "16", "--analytics-partitions", "0"]);
    for table in ["region", "nation", "supplier", "customer", "part", "partsupp", "orders", "lineitem"] {
        // `{"key", "value"}` lines as `_bulk` upserts.
        let text = std::fs::read_to_string(data.path().join(format!("{table}.ndjson"))).unwrap();
        let body: String = text.lines().map(|l| l.replacen('{', r#"{"op":"upsert","#, 1) + "\n").collect();
        for (create, write) in [(&nodes[0], &nodes[1]), (&lone, &lone)] {
            let r = http.put(create.u(&format!("/v1/collections/{table}"))).send().await.unwrap();
            assert_eq!(r.status(), 201, "{table}");
            let r = http
                .post(write.u(&format!("/v1/collections/{table}/_bulk")))
                .header("content-type", "application/x-ndjson")
                .body(body.clone())
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "{table}");
            assert!(!r.text().await.unwrap().contains("\"error\""), "{table}: every line written");
        }
    }
    let queries = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/tpch");
    for q in [1, 3, 5, 6, 10, 12, 13, 14, 15, 16, 18] {
        let sql = std::fs::read_to_string(queries.join(format!("q{q:02}.sql"))).unwrap();
        let (s, rows) = statement(&http, &nodes[0], "query", &sql).await;
        assert_eq!(s, 200, "q{q} /v1/query: {rows}");
        // Through a different member each time.
        let asked = &nodes[q % 3];
        let (s, columnar) = statement(&http, asked, "analytics", &sql).await;
        assert_eq!(s, 200, "q{q} /v1/analytics: {columnar}");
        assert_eq!(columnar["metrics"]["engine"], "columnar across members", "q{q}");
        assert!(same_rows(&rows["rows"], &columnar["rows"]), "q{q}: /v1/analytics {} against /v1/query {}", columnar["rows"], rows["rows"]);
    }
    // q1's final aggregation, by its few groups (two flags by two statuses, as the
    // shadows' column statistics estimate them), runs in one task over the members'
    // partial aggregates gathered, not hash-shuffled between the members (its answer is
    // compared above).
    let sql = std::fs::read_to_string(queries.join("q01.sql")).unwrap();
    let (s, explained) = statement(&http, &nodes[0], "analytics", &format!("EXPLAIN {sql}")).await;
    assert_eq!(s, 200, "{explained}");
    let plan: String = explained["rows"].as_array().unwrap().iter().filter_map(|r| r[1].as_str()).collect();
    assert!(plan.contains("AggregateExec: mode=Final,"), "{plan}");
    assert!(!plan.contains("FinalPartitioned"), "{plan}");
}

/// Groups of the model: `g = i % 10`, `n = i` for `i < docs`.
fn groups(docs: usize) -> Value {
    let m = docs / 10;
    json!((0..10).map(|g| json!([g, m, 10 * (m * (m - 1) / 2) + g * m])).collect::<Vec<_>>())
}

/// A member killed with `kill -9` while statements run through another, a group-by and a
/// join whose small build side is gathered while it is planned, in turn: each statement
/// answers the model's groups or `503`; none answers short, fails otherwise or hangs. A
/// statement whose answer would be huge is refused with a clear error, not gathered on the
/// coordinator.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_killed_mid_statement_ends_it_with_503_never_a_partial_answer() {
    const DOCS: usize = 6_000;
    let http = http();
    let mut nodes = loaded_cluster(&http, DOCS, "none").await;
    let want = groups(DOCS);
    let sql = "SELECT g, count(*), sum(n) FROM c GROUP BY g ORDER BY g";
    let (s, v) = statement(&http, &nodes[0], "analytics", sql).await;
    assert_eq!((s, &v["rows"]), (200, &want), "{v}");
    assert_eq!(v["metrics"]["engine"], "columnar across members");
    // Tasks send their metrics back only for `EXPLAIN ANALYZE`, which shows those of the
    // stages run on the members: the partial aggregate of every member's rows.
    let (s, v) = statement(&http, &nodes[0], "analytics", &format!("EXPLAIN ANALYZE {sql}")).await;
    assert_eq!(s, 200, "{v}");
    let plan = v["rows"][0][1].as_str().unwrap_or_default();
    let partial = plan.lines().find(|l| l.contains("AggregateExec: mode=Partial")).unwrap_or_default();
    let rows: usize = partial.split("output_rows=").nth(1).and_then(|r| r.split(',').next()).and_then(|n| n.parse().ok()).unwrap_or(0);
    // Every member's task sees the 10 groups in each of its partitions.
    assert!(rows >= 30 && rows.is_multiple_of(10), "the members' partial groups counted ({rows}): {plan}");

    // Bounded: every pair of rows would be 36 million rows on the coordinator.
    let (s, v) = statement(&http, &nodes[1], "analytics", "SELECT a.n, b.n FROM c a, c b").await;
    assert_eq!(s, 413, "{v}");
    assert!(v["reason"].as_str().unwrap_or("").contains("LIMIT"), "{v}");

    // The join's build side is gathered from the members while it is planned.
    let (join, want_join) = (GATHERED_JOIN, groups(100));
    let (s, v) = statement(&http, &nodes[0], "analytics", &format!("EXPLAIN ANALYZE {join}")).await;
    assert_eq!(s, 200, "{v}");
    let plan = v["rows"][0][1].as_str().unwrap_or_default();
    assert!(plan.contains("GatheredExec: table=c, rows=100"), "{plan}");

    let stop = Arc::new(AtomicBool::new(false));
    let seen: Arc<Mutex<Vec<(u16, Value)>>> = Arc::default();
    let asked = nodes[0].u("/v1/analytics");
    let runner = {
        let (stop, seen, http) = (Arc::clone(&stop), Arc::clone(&seen), http.clone());
        tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let asked_sql = if i % 2 == 0 { sql } else { join };
                let r = http.post(&asked).json(&json!({"sql": asked_sql, "consistency": "request_plus"})).send().await.unwrap();
                let status = r.status().as_u16();
                let v: Value = r.json().await.unwrap_or(Value::Null);
                seen.lock().unwrap().push((status, v));
                i += 1;
            }
        })
    };
    // Some statements answered before the kill.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while seen.lock().unwrap().len() < 3 {
        assert!(std::time::Instant::now() < deadline, "no statement answered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = seen.lock().unwrap().len();
    nodes[2].kill9();
    // Statements after the kill (before any failover): they need the dead member's rows.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while seen.lock().unwrap().len() < before + 5 {
        assert!(std::time::Instant::now() < deadline, "statements hang after a member died");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    tokio::time::timeout(Duration::from_secs(130), runner).await.expect("the last statement ends").unwrap();
    let seen = seen.lock().unwrap().clone();
    let mut refused = [0, 0];
    for (i, (status, v)) in seen.iter().enumerate() {
        let want = if i % 2 == 0 { &want } else { &want_join };
        match status {
            200 => assert_eq!(&v["rows"], want, "statement {i}: a 200 answers every group whole: {v}"),
            503 => {
                refused[i % 2] += 1;
                assert_eq!(v["error"], "unavailable", "{v}");
            }
            other => panic!("statement {i}: {other} {v}"),
        }
    }
    assert!(refused[0] >= 1 && refused[1] >= 1, "statements needing a dead member's rows are refused, joins too ({refused:?}): {seen:?}");
}

/// A join whose build side (100 rows of `c`) is gathered from the members while it is
/// planned; over `groups`' documents it answers `groups(100)`.
const GATHERED_JOIN: &str = "SELECT a.g, count(*), sum(b.n) FROM c a JOIN c b ON a.n = b.n WHERE a.n < 100 GROUP BY a.g ORDER BY a.g";

/// A member stopped (`SIGSTOP`: its kernel still accepts connections, the process answers
/// nothing, as behind a partition) while statements run through another: a statement
/// waiting on it ends with `503` once the member is failed over, not at its own (long)
/// timeout (one whose own timeout comes first ends with `504` then); later ones answer every
/// group or refuse clearly (`503`, `504` at their `timeout_ms`), never a partial answer or a hang; once the member resumes, statements
/// answer whole again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_stopped_mid_statement_ends_it_with_503_never_a_partial_answer() {
    const DOCS: usize = 2_000;
    let http = http();
    // On both copies before it is acknowledged: the stopped member's partitions fail over to
    // their replicas, and a write acknowledged by its active alone may be lost then (README,
    // failure model), which would change the answer, not break it.
    let nodes = loaded_cluster(&http, DOCS, "majority").await;
    let want = groups(DOCS);
    let sql = "SELECT g, count(*), sum(n) FROM c GROUP BY g ORDER BY g";
    let (s, v) = statement(&http, &nodes[0], "analytics", sql).await;
    assert_eq!((s, &v["rows"]), (200, &want), "{v}");
    assert_eq!(v["metrics"]["engine"], "columnar across members");

    let want_join = groups(100);
    let ask = |timeout_ms: u64, sql: &str| {
        let asked =
            http.post(nodes[0].u("/v1/analytics")).json(&json!({"sql": sql, "consistency": "request_plus", "timeout_ms": timeout_ms}));
        async move {
            // Far past the statement's timeout: a statement still open then hangs.
            let r = tokio::time::timeout(Duration::from_millis(timeout_ms) + Duration::from_secs(60), asked.send())
                .await
                .expect("a statement ends by its timeout")
                .unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    nodes[2].signal(libc::SIGSTOP);
    // A statement whose timeout comes before the failover: the stopped member never answers
    // its preparation or its tasks, and the statement ends at its own timeout.
    let (status, v) = ask(1_000, sql).await;
    assert_eq!((status, v["error"].as_str()), (504, Some("timeout")), "{v}");
    // Its tasks never answer; the member is failed over after `auto_failover_timeout_s` (5 s),
    // and that ends the statement, well before its 10 minutes.
    let (status, v) = ask(600_000, sql).await;
    assert_eq!((status, v["error"].as_str()), (503, Some("unavailable")), "{v}");
    assert!(v["reason"].as_str().unwrap_or("").contains("failed over"), "{v}");
    for i in 0..4 {
        // A group-by, then a join whose build side is gathered while it is planned.
        let (status, v) = if i % 2 == 0 { ask(3_000, sql).await } else { ask(3_000, GATHERED_JOIN).await };
        let want = if i % 2 == 0 { &want } else { &want_join };
        match status {
            200 => assert_eq!(&v["rows"], want, "statement {i}: a 200 answers every group whole: {v}"),
            503 | 504 => {
                assert!(["unavailable", "timeout"].contains(&v["error"].as_str().unwrap_or("")), "{v}");
                assert!(!v["reason"].as_str().unwrap_or("").is_empty(), "a refusal says why: {v}");
            }
            other => panic!("statement {i}: {other} {v}"),
        }
    }
    nodes[2].signal(libc::SIGCONT);
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        let (status, v) = ask(3_000, sql).await;
        if status == 200 {
            assert_eq!(v["rows"], want, "{v}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "statements answer again once the member resumes: {status} {v}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (status, v) = ask(3_000, GATHERED_JOIN).await;
    assert_eq!((status, &v["rows"]), (200, &want_join), "{v}");
}

/// `[g, count, sum(n)]` per group of `docs` (key → (g, n)), as the group-by answers.
fn model_groups(docs: &std::collections::BTreeMap<String, (i64, i64)>) -> Value {
    let mut by: std::collections::BTreeMap<i64, (i64, i64)> = std::collections::BTreeMap::new();
    for (g, n) in docs.values() {
        let e = by.entry(*g).or_default();
        e.0 += 1;
        e.1 += n;
    }
    json!(by.into_iter().map(|(g, (c, s))| json!([g, c, s])).collect::<Vec<_>>())
}

/// A rebalance copies partitions by files, and each partition's analytics rows go with
/// its copy: the new member's shadow takes them from the source's segments (each move
/// reports them as `analytics_rows`) instead of reading the documents again, then follows
/// what is written after. Analytics answers exactly (or `503`) while the partitions move,
/// and on every member after.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rebalance_moves_each_partitions_analytics_rows_with_its_files() {
    // Four partitions of 3,000 documents: each is copied by files.
    const DOCS: i64 = 12_000;
    const FEW: [&str; 6] = ["--cluster-secret", SECRET, "--partitions", "4", "--analytics-partitions", "2"];
    let http = http();
    let mut first = Node::start(&FEW);
    first.pin_port();
    assert_eq!(http.put(first.u("/v1/collections/c")).send().await.unwrap().status(), 201);
    let mut docs = std::collections::BTreeMap::new();
    for chunk in (0..DOCS).collect::<Vec<_>>().chunks(3_000) {
        let lines = chunk.iter().map(|i| {
            let table = format!("t{}", i % 3);
            json!({"op": "upsert", "key": format!("k{i:05}"), "value": {"g": i % 10, "n": i, "table_name": table}})
        });
        bulk(&http, &first, lines, None).await;
        docs.extend(chunk.iter().map(|i| (format!("k{i:05}"), (i % 10, *i))));
    }
    let sql = "SELECT g, count(*), sum(n) FROM c GROUP BY g ORDER BY g";
    let want = model_groups(&docs);
    let (s, v) = statement(&http, &first, "analytics", sql).await;
    assert_eq!((s, &v["rows"]), (200, &want), "{v}");
    // A join whose small build side is broadcast: on two members, gathered from them while
    // the statement is planned (`shoal_query::gather`).
    let join = GATHERED_JOIN;
    let want_join = model_groups(&docs.iter().filter(|(_, (_, n))| *n < 100).map(|(k, v)| (k.clone(), *v)).collect());
    let (s, v) = statement(&http, &first, "analytics", join).await;
    assert_eq!((s, &v["rows"]), (200, &want_join), "{v}");

    let mut second = Node::start(&[&FEW[..], &["--join", &first.addr()][..]].concat());
    second.pin_port();
    wait_for(&http, &first.u("/v1/cluster"), "two members", |v| member_states(v).len() == 2).await;
    // Statements through both members while the partitions move.
    let stop = Arc::new(AtomicBool::new(false));
    let seen: Arc<Mutex<Vec<(u16, Value)>>> = Arc::default();
    let runner = {
        let (stop, seen, http) = (Arc::clone(&stop), Arc::clone(&seen), http.clone());
        let urls = [first.u("/v1/analytics"), second.u("/v1/analytics")];
        tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let asked = if i % 4 < 2 { sql } else { join };
                let r = http.post(&urls[i % 2]).json(&json!({"sql": asked, "consistency": "request_plus"})).send().await.unwrap();
                let status = r.status().as_u16();
                let v: Value = r.json().await.unwrap_or(Value::Null);
                seen.lock().unwrap().push((status, v));
                i += 1;
            }
        })
    };
    let r = http.post(first.u("/v1/cluster/rebalance")).json(&json!({"eject": []})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 202);
    let status = wait_for(&http, &first.u("/v1/cluster/rebalance"), "rebalance done", |v| v["state"] != "running").await;
    assert_eq!(status["state"], "done", "{status}");
    stop.store(true, Ordering::Relaxed);
    runner.await.unwrap();
    for (i, (status, v)) in seen.lock().unwrap().iter().enumerate() {
        let want = if i % 4 < 2 { &want } else { &want_join };
        match status {
            200 => assert_eq!(&v["rows"], want, "statement {i} during the rebalance: {v}"),
            503 => assert_eq!(v["error"], "unavailable", "{v}"),
            other => panic!("statement {i} during the rebalance: {other} {v}"),
        }
    }

    // Every partition came to the new member by files, with its analytics rows.
    let moves: Vec<&Value> = status["moves"].as_array().unwrap().iter().filter(|m| m["kind"] == "partition").collect();
    assert!(!moves.is_empty(), "{status}");
    for m in &moves {
        assert_eq!(m["method"], "files", "{m}");
        let p = m["id"].as_u64().unwrap() as u16;
        let held = docs.keys().filter(|k| shoal_storage::partition_of(k.as_bytes(), 4) == p).count() as u64;
        assert_eq!(m["analytics_rows"].as_u64(), Some(held), "partition {p}'s rows moved with it: {m}");
    }
    let adopted = common::metric(&http, &second, "shoal_analytics_rows_adopted_total").await.unwrap_or(0.0);
    let applied = common::metric(&http, &second, "shoal_analytics_changes_applied_total").await.unwrap_or(0.0);
    eprintln!("{} moves, {adopted} rows adopted, {applied} changes applied, {} statements during", moves.len(), seen.lock().unwrap().len());
    assert!(adopted >= 3_000.0, "the new member adopted rows: {adopted}");
    assert!(
        applied < adopted / 10.0,
        "the new member's shadow did not read the moved documents again: {applied} changes applied, {adopted} rows adopted"
    );

    // The join's build side is gathered, not broadcast through a stage of its own, through
    // either endpoint.
    // (`/v1/query` reads the shadows once they hold every write, waiting at most
    // `COLUMNAR_WAIT` for them, and the documents otherwise: asked again until it does.)
    for endpoint in ["analytics", "query"] {
        let plan = Mutex::new(String::new());
        common::eventually(30, &format!("{endpoint} gathers the join's build side"), || async {
            let (s, v) = statement(&http, &first, endpoint, &format!("EXPLAIN ANALYZE {join}")).await;
            assert_eq!(s, 200, "{v}");
            let text = v["rows"][0][1].as_str().unwrap_or_default().to_string();
            let gathered = text.contains("GatheredExec");
            *plan.lock().unwrap() = text;
            gathered
        })
        .await;
        let plan = plan.into_inner().unwrap();
        assert!(plan.contains("GatheredExec: table=c, rows=100") && !plan.contains("NetworkBroadcastExec"), "{endpoint}: {plan}");
    }

    // What is written after lands on the moved rows, wherever they are read.
    let mut lines = Vec::new();
    for i in (0..DOCS).step_by(7) {
        let key = format!("k{i:05}");
        if i % 2 == 0 {
            lines.push(json!({"op": "upsert", "key": key, "value": {"g": 3, "n": -i, "table_name": "t9"}}));
            docs.insert(key, (3, -i));
        } else {
            lines.push(json!({"op": "remove", "key": key}));
            docs.remove(&key);
        }
    }
    bulk(&http, &second, lines, None).await;
    let want = model_groups(&docs);
    let want_join = model_groups(&docs.iter().filter(|(_, (_, n))| *n < 100).map(|(k, v)| (k.clone(), *v)).collect());
    for node in [&first, &second] {
        for endpoint in ["analytics", "query"] {
            let (s, v) = statement(&http, node, endpoint, sql).await;
            assert_eq!((s, &v["rows"]), (200, &want), "{endpoint} on {}: {v}", node.url);
            let (s, v) = statement(&http, node, endpoint, join).await;
            assert_eq!((s, &v["rows"]), (200, &want_join), "{endpoint} on {}: {v}", node.url);
        }
    }
}

/// The join of [`GATHERED_JOIN`] by the model: `[a.g, count, sum(b.n)]` per group of the
/// documents with `n < 100`, each joined to those of the same `n`.
fn model_join(docs: &std::collections::BTreeMap<String, (i64, i64)>) -> Value {
    let mut by_n: std::collections::BTreeMap<i64, Vec<i64>> = std::collections::BTreeMap::new();
    for (g, n) in docs.values() {
        by_n.entry(*n).or_default().push(*g);
    }
    let mut by: std::collections::BTreeMap<i64, (i64, i64)> = std::collections::BTreeMap::new();
    for (n, gs) in by_n.range(..100) {
        for g in gs {
            let e = by.entry(*g).or_default();
            e.0 += gs.len() as i64;
            e.1 += n * gs.len() as i64;
        }
    }
    json!(by.into_iter().map(|(g, (c, s))| json!([g, c, s])).collect::<Vec<_>>())
}

/// A coordinator plans a statement on the tables the members last answered the same twice
/// while it asks them again (`shoal_query`'s `KnownTables`), and runs that plan only if
/// they answer the same. Writes between statements — rows moved between groups, rows and
/// a field added — are read by the very next statement at `request_plus`: a statement
/// naming the new field, planned first on the tables without it, is planned again on the
/// members' answers; a gathered join answers the model every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn statements_planned_on_tables_as_last_found_read_what_was_written_since() {
    const DOCS: i64 = 2_000;
    let http = http();
    let nodes = loaded_cluster(&http, DOCS as usize, "majority").await;
    let mut docs: std::collections::BTreeMap<String, (i64, i64)> = (0..DOCS).map(|i| (format!("k{i:05}"), (i % 10, i))).collect();
    let early = |outcome: &'static str| {
        let (http, node) = (&http, &nodes[0]);
        async move { common::metric(http, node, &format!("shoal_analytics_planned_early_total{{outcome=\"{outcome}\"}}")).await.unwrap_or(0.0) }
    };
    // Asked until a statement runs as planned early (the tables answered the same twice).
    let until_planned_early = |docs: std::collections::BTreeMap<String, (i64, i64)>| {
        let (http, node, early) = (&http, &nodes[0], &early);
        async move {
            let before = early("ran").await;
            common::eventually(60, "a statement planned on the tables as last found runs", || async {
                let (s, v) = statement(http, node, "analytics", GATHERED_JOIN).await;
                assert_eq!((s, &v["rows"]), (200, &model_join(&docs)), "{v}");
                early("ran").await > before
            })
            .await;
        }
    };
    until_planned_early(docs.clone()).await;
    // Rows of the gathered side move between groups (the table's rows and columns stay, and
    // so, mostly, do its statistics: a statement after such a write is planned early, its
    // gathers waiting for the members' answers, in some round at least).
    let ran_before = early("ran").await;
    for round in 0..4 {
        let moved: Vec<Value> = (0..DOCS)
            .map(|i| {
                let (key, n) = (format!("k{i:05}"), i);
                let g = (i + round + 1) % 10;
                docs.insert(key.clone(), (g, n));
                json!({"op": "upsert", "key": key, "value": {"g": g, "n": n}})
            })
            .collect();
        bulk(&http, &nodes[1], moved, Some("majority")).await;
        for node in &nodes {
            let (s, v) = statement(&http, node, "analytics", GATHERED_JOIN).await;
            assert_eq!((s, &v["rows"]), (200, &model_join(&docs)), "round {round} on {}: {v}", node.url);
        }
    }
    assert!(early("ran").await > ran_before, "a statement after a write ran as planned early");
    // Rows and a field added: the next statement names the field.
    until_planned_early(docs.clone()).await;
    let (ran, again) = (early("ran").await, early("planned_again").await);
    let added: Vec<Value> = (0..100)
        .map(|i| {
            let (key, n) = (format!("x{i:03}"), -i);
            docs.insert(key.clone(), (i % 10, n));
            json!({"op": "upsert", "key": key, "value": {"g": i % 10, "n": n, "extra": 2}})
        })
        .collect();
    bulk(&http, &nodes[1], added, Some("majority")).await;
    let (s, v) = statement(&http, &nodes[0], "analytics", "SELECT count(*), sum(extra) FROM c").await;
    assert_eq!((s, &v["rows"]), (200, &json!([[DOCS + 100, 200]])), "{v}");
    assert_eq!((early("ran").await, early("planned_again").await), (ran, again + 1.0), "planned early on the old tables, then again");
    let (s, v) = statement(&http, &nodes[0], "analytics", GATHERED_JOIN).await;
    assert_eq!((s, &v["rows"]), (200, &model_join(&docs)), "{v}");
}

/// A small table (within `GATHER_ROWS_MAX` rows) whose rows on a member would pass
/// `GATHER_BYTES_MAX` (8 MiB) is not gathered while the statement is planned: the member
/// says so, and the join's build side is broadcast through a stage of its own, answering
/// the same. The same rows read without the wide column are gathered, until the table
/// passes `GATHER_ROWS_MAX` rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_build_side_past_the_gather_limits_is_broadcast_through_a_stage() {
    // 50,000 rows of 400-byte strings over two members: about 9 MB of them on each.
    const DOCS: i64 = 50_000;
    let http = http();
    let nodes = cluster(&http, 2).await;
    assert_eq!(http.put(nodes[0].u("/v1/collections/c")).send().await.unwrap().status(), 201);
    for chunk in (0..DOCS).collect::<Vec<_>>().chunks(5_000) {
        let lines = chunk
            .iter()
            .map(|i| json!({"op": "upsert", "key": format!("k{i:05}"), "value": {"g": i % 10, "n": i, "s": format!("{i:0>400}")}}));
        bulk(&http, &nodes[0], lines, Some("none")).await;
    }
    // The documents with n < 45,000 by group: [g, count, sum(n)].
    let groups: Vec<(i64, i64, i64)> = (0..10)
        .map(|g| {
            let ns = (0..45_000i64).filter(|n| n % 10 == g);
            (g, ns.clone().count() as i64, ns.sum())
        })
        .collect();
    // The same table, rows and filter; only the columns read differ: with the strings, each
    // member's rows pass the limit.
    let wide =
        "SELECT a.g, count(*), sum(b.n), max(length(a.s)) FROM c a JOIN c b ON a.n = b.n WHERE a.n < 45000 GROUP BY a.g ORDER BY a.g";
    let narrow = "SELECT a.g, count(*), sum(b.n) FROM c a JOIN c b ON a.n = b.n WHERE a.n < 45000 GROUP BY a.g ORDER BY a.g";
    let want_wide = json!(groups.iter().map(|(g, c, s)| json!([g, c, s, 400])).collect::<Vec<_>>());
    let want_narrow = json!(groups.iter().map(|(g, c, s)| json!([g, c, s])).collect::<Vec<_>>());
    for (sql, want, gathered) in [(wide, want_wide, false), (narrow, want_narrow.clone(), true)] {
        let (s, v) = statement(&http, &nodes[0], "analytics", sql).await;
        assert_eq!((s, &v["rows"]), (200, &want), "{sql}: {v}");
        let (s, v) = statement(&http, &nodes[0], "analytics", &format!("EXPLAIN ANALYZE {sql}")).await;
        assert_eq!(s, 200, "{v}");
        let plan = v["rows"][0][1].as_str().unwrap_or_default();
        assert_eq!(plan.contains("GatheredExec: table=c, rows=45000"), gathered, "{sql}: {plan}");
        assert_eq!(plan.contains("NetworkBroadcastExec"), !gathered, "{sql}: {plan}");
    }
    // Past `GATHER_ROWS_MAX` (100,000) rows in the table, the narrow read is not gathered
    // either.
    for chunk in (DOCS..110_000).collect::<Vec<_>>().chunks(10_000) {
        let lines = chunk.iter().map(|i| json!({"op": "upsert", "key": format!("k{i:06}"), "value": {"g": i % 10, "n": i}}));
        bulk(&http, &nodes[0], lines, Some("none")).await;
    }
    let (s, v) = statement(&http, &nodes[0], "analytics", narrow).await;
    assert_eq!((s, &v["rows"]), (200, &want_narrow), "{narrow}: {v}");
    let (s, v) = statement(&http, &nodes[0], "analytics", &format!("EXPLAIN ANALYZE {narrow}")).await;
    assert_eq!(s, 200, "{v}");
    let plan = v["rows"][0][1].as_str().unwrap_or_default();
    assert!(!plan.contains("GatheredExec") && plan.contains("NetworkBroadcastExec"), "{narrow}: {plan}");
}

/// CPU seconds (user + system) `pid` has used so far.
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces): utime and stime are the 12th
    // and 13th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest.split_whitespace().skip(11).take(2).filter_map(|v| v.parse().ok()).collect();
    f.iter().sum::<u64>() as f64 / 100.0
}

/// A client that goes away ends its distributed statement on every member: a statement
/// that would run for hours (a three-way cross join of 27 billion rows, counted) is left
/// by its client after two seconds; every member's tasks end and every process goes
/// idle, rather than working on for an answer no one will read.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_goes_away_ends_the_statement_on_every_member() {
    const DOCS: usize = 3_000;
    let http = http();
    let nodes = loaded_cluster(&http, DOCS, "none").await;
    let (s, v) = statement(&http, &nodes[0], "analytics", "SELECT count(*) FROM c").await;
    assert_eq!((s, &v["rows"]), (200, &json!([[DOCS]])), "{v}");
    assert_eq!(v["metrics"]["engine"], "columnar across members");

    let cpu_before: Vec<f64> = nodes.iter().map(|n| cpu_secs(n.pid())).collect();
    let impatient = common::client_builder().timeout(Duration::from_secs(2)).build().unwrap();
    let sql = "SELECT count(*) FROM c a, c b, c d WHERE a.n + b.n + d.n = -1";
    let r = impatient.post(nodes[0].u("/v1/analytics")).json(&json!({"sql": sql})).send().await;
    assert!(r.as_ref().is_err_and(|e| e.is_timeout()), "the statement runs longer than its client waits: {r:?}");
    let worked: f64 = nodes.iter().zip(&cpu_before).map(|(n, b)| cpu_secs(n.pid()) - b).sum();
    assert!(worked > 0.2, "the statement was running: {worked} CPU seconds");
    // Every process goes idle (under a tenth of a core over a second) and no member runs a
    // task of the statement. A task stops where it yields: a join's output spends the
    // task's budget per batch, so within 128 batches (seconds in a debug build).
    common::eventually(240, "every member idle after its client left", || async {
        let before: Vec<f64> = nodes.iter().map(|n| cpu_secs(n.pid())).collect();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let idle = nodes.iter().zip(&before).all(|(n, b)| cpu_secs(n.pid()) - b < 0.1);
        let mut tasks = 0.0;
        for n in &nodes {
            tasks += common::metric(&http, n, "shoal_analytics_tasks_running").await.unwrap_or(0.0);
        }
        idle && tasks == 0.0
    })
    .await;
    // And the members answer as before.
    let (s, v) = statement(&http, &nodes[1], "analytics", "SELECT count(*) FROM c").await;
    assert_eq!((s, &v["rows"]), (200, &json!([[DOCS]])), "{v}");
}
