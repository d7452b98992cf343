//! Seed 004's query 3 over TPC-DS-shaped documents, checked against an independent
//! computation from the generated files — with one collection per table, and with all
//! tables in one collection told apart by `table_name`, as in the seed.

mod common;

use std::collections::HashMap;

use common::Node;
use serde_json::{json, Value};

fn read_rows(path: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str::<Value>(l).unwrap()["value"].clone()).collect()
}

/// Query 3 computed here from the rows: (year, brand_id, brand, sum), in the query's order.
fn expected_q3(dates: &[Value], items: &[Value], sales: &[Value], manufact: i64) -> Vec<(i64, i64, String, f64)> {
    let date: HashMap<i64, (i64, i64)> =
        dates.iter().map(|d| (d["d_date_sk"].as_i64().unwrap(), (d["d_year"].as_i64().unwrap(), d["d_moy"].as_i64().unwrap()))).collect();
    let item: HashMap<i64, &Value> = items.iter().map(|i| (i["i_item_sk"].as_i64().unwrap(), i)).collect();
    let mut groups: HashMap<(i64, String, i64), f64> = HashMap::new();
    for s in sales {
        let (Some(d), Some(i)) = (s["ss_sold_date_sk"].as_i64(), s["ss_item_sk"].as_i64()) else { continue };
        let (Some(&(year, moy)), Some(it)) = (date.get(&d), item.get(&i)) else { continue };
        if moy != 11 || it["i_manufact_id"].as_i64() != Some(manufact) {
            continue;
        }
        let key = (year, it["i_brand"].as_str().unwrap().to_string(), it["i_brand_id"].as_i64().unwrap());
        *groups.entry(key).or_default() += s["ss_ext_sales_price"].as_f64().unwrap();
    }
    let mut rows: Vec<(i64, i64, String, f64)> = groups.into_iter().map(|((y, b, id), sum)| (y, id, b, sum)).collect();
    rows.sort_by(|a, b| a.0.cmp(&b.0).then(b.3.total_cmp(&a.3)).then(a.1.cmp(&b.1)));
    rows.truncate(100);
    rows
}

fn check(answer: &Value, expected: &[(i64, i64, String, f64)]) {
    let rows = answer["rows"].as_array().unwrap();
    assert_eq!(rows.len(), expected.len(), "{answer}");
    for (got, want) in rows.iter().zip(expected) {
        assert_eq!(got[0].as_i64(), Some(want.0), "{got}");
        assert_eq!(got[1].as_i64(), Some(want.1), "{got}");
        assert_eq!(got[2].as_str(), Some(want.2.as_str()), "{got}");
        let sum = got[3].as_f64().unwrap();
        assert!((sum - want.3).abs() <= 1e-6 * want.3.abs().max(1.0), "{got} vs {}", want.3);
    }
}

#[tokio::test]
async fn query_3_matches_an_independent_computation() {
    let node = Node::start(&["--partitions", "8"]);
    let dir = node.dir.parent().unwrap().join("tpcds");
    let (ok, out, err) = node.cli(&["bench", "tpcds-gen", "--sf", "0.005", "--out", dir.to_str().unwrap()]);
    assert!(ok, "{out} {err}");
    let tables = ["date_dim", "item", "store_sales"];
    for t in tables {
        let (ok, _, err) = node.cli(&["collection", "create", t]);
        assert!(ok, "{err}");
        let (ok, out, err) = node.cli(&["load", t, dir.join(format!("{t}.ndjson")).to_str().unwrap()]);
        assert!(ok, "{out} {err}");
    }
    let (dates, items, sales) =
        (read_rows(&dir.join("date_dim.ndjson")), read_rows(&dir.join("item.ndjson")), read_rows(&dir.join("store_sales.ndjson")));
    // The manufacturer with the most items, so the answer is not empty at this scale.
    let mut counts: HashMap<i64, usize> = HashMap::new();
    for i in &items {
        *counts.entry(i["i_manufact_id"].as_i64().unwrap()).or_default() += 1;
    }
    let manufact = counts.iter().max_by_key(|(m, n)| (**n, -**m)).map(|(m, _)| *m).unwrap();
    let expected = expected_q3(&dates, &items, &sales, manufact);
    assert!(!expected.is_empty(), "the data set has sales of manufacturer {manufact} in November");
    let q3 = shoal_q3().replace("i_manufact_id = 128", &format!("i_manufact_id = {manufact}"));
    let c = node.client();
    let ask_at = |path: &str, sql: String| {
        let c = c.clone();
        let url = node.u(path);
        async move {
            let r = c.post(url).body(json!({"sql": sql, "consistency": "request_plus"}).to_string()).send().await.unwrap();
            assert!(r.status().is_success(), "{}", r.text().await.unwrap());
            r.json::<Value>().await.unwrap()
        }
    };
    let by_shadow = ask_at("/v1/analytics", q3.clone()).await;
    check(&by_shadow, &expected);
    assert_eq!(by_shadow["metrics"]["engine"], "columnar");
    // `/v1/query` reads the shadow too once it holds the statement's writes (it does now:
    // the analytics statement waited for them), and `EXPLAIN` says why; the documents are
    // read by `tests/query.rs`'s node without shadows and by the cluster tests.
    let ask = |sql: String| ask_at("/v1/query", sql);
    let by_query = ask(q3.clone()).await;
    check(&by_query, &expected);
    assert_eq!(by_query["metrics"]["engine"], "columnar");
    let explained = ask(format!("EXPLAIN {q3}")).await.to_string();
    assert!(explained.contains("ShadowScan: collection=store_sales") && explained.contains("columnar: the shadow holds"), "{explained}");
    // The joins' dynamic filters reach the shadow scan of store_sales and drop its rows there.
    let analyzed = ask_at("/v1/analytics", format!("EXPLAIN ANALYZE {q3}")).await.to_string();
    assert!(
        analyzed.contains("collection=store_sales") && analyzed.contains("dynamic filters=[") && analyzed.contains("IN (SET)"),
        "{analyzed}"
    );

    // All tables in one collection, told apart by table_name (the seed's datasets).
    let c2 = node.client();
    c2.put(node.u("/v1/collections/tpcds")).send().await.unwrap();
    for t in tables {
        let (ok, out, err) = node.cli(&["load", "tpcds", dir.join(format!("{t}.ndjson")).to_str().unwrap()]);
        assert!(ok, "{out} {err}");
    }
    let one = q3
        .replace("FROM date_dim dt,", "FROM (SELECT * FROM tpcds WHERE table_name = 'date_dim') dt,")
        .replace("store_sales ss,", "(SELECT * FROM tpcds WHERE table_name = 'store_sales') ss,")
        .replace("     item\n", "     (SELECT * FROM tpcds WHERE table_name = 'item') item\n");
    assert_ne!(one, q3);
    check(&ask(one.clone()).await, &expected);
    check(&ask_at("/v1/analytics", one.clone()).await, &expected);
    // On the shadow, each table_name filter reads only its own table's segments.
    let plan = ask_at("/v1/analytics", format!("EXPLAIN {one}")).await.to_string();
    for t in tables {
        assert!(plan.contains(&format!(r#"table_name=\"{t}\""#)), "{plan}");
    }
}

/// Query 3 exactly as seed 004 prints it; `shoal bench analytics` runs the same file.
fn shoal_q3() -> String {
    include_str!("../bench/tpcds_q3.sql").trim().to_string()
}

async fn post(c: &reqwest::Client, url: String, body: Value) -> (reqwest::StatusCode, Value) {
    let r = c.post(url).body(body.to_string()).send().await.unwrap();
    (r.status(), r.json().await.unwrap_or(Value::Null))
}

/// Rows of a statement that must succeed on `path` (`/v1/query` or `/v1/analytics`).
async fn sql(node: &Node, c: &reqwest::Client, path: &str, sql: &str) -> Vec<Value> {
    let (s, r) = post(c, node.u(path), json!({"sql": sql, "consistency": "request_plus", "timeout_ms": 60_000})).await;
    assert_eq!(s, reqwest::StatusCode::OK, "{path} {sql}: {r}");
    r["rows"].as_array().unwrap().clone()
}

/// `_bulk` lines, all of which must succeed.
async fn bulk(node: &Node, c: &reqwest::Client, coll: &str, lines: &[Value]) {
    for chunk in lines.chunks(1000) {
        let body: String = chunk.iter().map(|l| format!("{l}\n")).collect();
        let r = c.post(node.u(&format!("/v1/collections/{coll}/_bulk"))).body(body).send().await.unwrap();
        assert!(r.status().is_success());
        let text = r.text().await.unwrap();
        assert!(!text.contains("\"error\""), "{}", text.lines().find(|l| l.contains("error")).unwrap_or_default());
    }
}

const KINDS: [&str; 3] = ["a", "b", "c"];

fn event(i: usize) -> Value {
    let mut d = json!({
        "n": i,
        "kind": KINDS[i % 3],
        "price": i as f64 * 0.5,
        "tags": [format!("t{}", i % 7)],
        "nested": {"x": i % 10},
        "table_name": if i % 2 == 1 { "odd" } else { "even" },
    });
    if i % 100 == 7 {
        d["n"] = json!("not a number");
    }
    d
}

#[tokio::test]
async fn the_shadow_follows_every_change_and_answers_as_the_documents_do() {
    let node = Node::start(&["--partitions", "8", "--analytics-partitions", "2"]);
    let c = node.client();
    let info: Value = c.get(node.u("/v1/node")).send().await.unwrap().json().await.unwrap();
    assert_eq!(info["analytics_partitions"], json!(2));
    assert!(c.put(node.u("/v1/collections/ev")).send().await.unwrap().status().is_success());
    let mut lines: Vec<Value> = (0..3000).map(|i| json!({"op": "upsert", "key": format!("e{i:05}"), "value": event(i)})).collect();
    // Updates, deletes, and documents that expire.
    lines.extend((0..300).map(|i| json!({"op": "upsert", "key": format!("e{i:05}"), "value": event(i + 10_000)})));
    lines.extend((300..600).map(|i| json!({"op": "remove", "key": format!("e{i:05}")})));
    lines.extend((600..650).map(|i| json!({"op": "upsert", "key": format!("e{i:05}"), "value": event(i), "expiry": 1})));
    bulk(&node, &c, "ev", &lines).await;
    // The expiry pager runs every second; wait until the documents are gone.
    let gone = |rows: Vec<Value>| rows == [json!([2650])];
    // Reads hide an expired document at once; the shadow drops it when the pager deletes it.
    for path in ["/v1/query", "/v1/analytics"] {
        let mut tries = 0;
        while !gone(sql(&node, &c, path, "SELECT count(*) FROM ev").await) {
            tries += 1;
            assert!(tries < 100, "{path}: upserts, deletes and expiry not reflected");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
    // The same statements answer the same rows on both paths.
    for q in [
        "SELECT count(*), sum(n), sum(price), count(n), sum(nested.x) FROM ev",
        "SELECT kind, count(*), max(n), min(tags[1]) FROM ev GROUP BY kind ORDER BY kind",
        "SELECT meta_id, n, price FROM ev WHERE table_name = 'odd' ORDER BY meta_id LIMIT 20",
        "SELECT table_name, count(*) FROM ev WHERE n IS NULL GROUP BY table_name ORDER BY table_name",
        "SELECT e.kind, count(*) FROM ev e JOIN ev f ON e.n = f.n + 1 GROUP BY e.kind ORDER BY e.kind",
    ] {
        let (a, b) = (sql(&node, &c, "/v1/query", q).await, sql(&node, &c, "/v1/analytics", q).await);
        assert!(!a.is_empty());
        assert_eq!(a, b, "{q}");
    }
    let misfits = sql(&node, &c, "/v1/analytics", "SELECT count(*) FROM ev WHERE n IS NULL").await;
    assert_eq!(misfits, [json!([26])], "a string among numbers is NULL");
    // A table_name filter skips the other group's segments.
    let plan = sql(&node, &c, "/v1/analytics", "EXPLAIN SELECT count(*) FROM ev WHERE table_name = 'odd'").await;
    let plan = Value::Array(plan).to_string();
    assert!(plan.contains("analytics partitions=2") && plan.contains(r#"table_name=\"odd\""#), "{plan}");
    // Write, then read with request_plus: every acknowledged write is there.
    for i in 0..20 {
        let key = format!("probe{i}");
        let r = c.put(node.u(&format!("/v1/collections/ev/docs/{key}"))).body(json!({"n": i}).to_string()).send().await.unwrap();
        assert!(r.status().is_success());
        let got = sql(&node, &c, "/v1/analytics", &format!("SELECT n FROM ev WHERE meta_id = '{key}'")).await;
        assert_eq!(got, [json!([i])]);
    }
    let (ok, out, err) =
        node.cli(&["--output", "csv", "sql", "--analytics", "-e", "SELECT count(*) AS n FROM ev WHERE table_name = 'even'"]);
    assert!(ok, "{err}");
    assert_eq!(out, "n\n1325\n");
}

/// Segment files (name, size, modification time) under the node's shadow directory: a
/// listing during which no file went away (a running node replaces segments; a file listed
/// and gone before its metadata was read makes the listing start again).
fn segment_files(dir: &std::path::Path) -> Vec<(std::path::PathBuf, u64, std::time::SystemTime)> {
    'listing: for _ in 0..100 {
        let mut out = Vec::new();
        let mut stack = vec![dir.join("shadow")];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                let meta = match e.metadata() {
                    Ok(meta) => meta,
                    Err(err) if err.kind() == std::io::ErrorKind::NotFound => continue 'listing,
                    Err(err) => panic!("{}: {err}", e.path().display()),
                };
                if meta.is_dir() {
                    stack.push(e.path());
                } else if e.path().extension().is_some_and(|x| x == "arrow") {
                    out.push((e.path(), meta.len(), meta.modified().unwrap()));
                }
            }
        }
        out.sort();
        return out;
    }
    panic!("the shadow's files kept changing while they were listed")
}

/// Collection `ev` with events `e00000`… (`event(i)`), loaded through `_bulk`.
async fn load_events(node: &Node, c: &reqwest::Client, n: usize) {
    assert!(c.put(node.u("/v1/collections/ev")).send().await.unwrap().status().is_success());
    let lines: Vec<Value> = (0..n).map(|i| json!({"op": "upsert", "key": format!("e{i:05}"), "value": event(i)})).collect();
    bulk(node, c, "ev", &lines).await;
}

/// Shadows load in the background after a start (the node serves documents at once); a
/// stop that comes while they load must still end the process (it once waited forever for
/// a maintainer that missed the stop signal), and analytics answers wait for the load.
#[tokio::test]
async fn a_node_stopped_while_its_shadows_load_stops_cleanly() {
    let mut node = Node::start(&["--partitions", "8", "--analytics-partitions", "2"]);
    let c = node.client();
    load_events(&node, &c, 30_000).await;
    let q = "SELECT count(*) FROM ev";
    assert_eq!(sql(&node, &c, "/v1/analytics", q).await[0][0], json!(30_000));
    for _ in 0..3 {
        assert!(node.stop(), "clean stop");
        node.restart();
    }
    let c = node.client();
    assert_eq!(sql(&node, &c, "/v1/analytics", q).await[0][0], json!(30_000));
    assert!(node.stop(), "clean stop");
}

#[tokio::test]
async fn the_shadow_survives_restarts_without_a_rebuild() {
    let mut node = Node::start(&["--partitions", "8", "--analytics-partitions", "2"]);
    let c = node.client();
    load_events(&node, &c, 20_000).await;
    let q = "SELECT count(*), sum(price), count(DISTINCT kind) FROM ev";
    let before = sql(&node, &c, "/v1/analytics", q).await;
    assert_eq!(before[0][0], json!(20_000));
    assert!(node.stop(), "clean stop");
    let files = segment_files(&node.dir);
    assert!(!files.is_empty());
    node.restart();
    let c = node.client();
    // Not request_plus: what is answered at once comes from the files, unchanged.
    let (s, r) = post(&c, node.u("/v1/analytics"), json!({"sql": q})).await;
    assert_eq!(s, reqwest::StatusCode::OK, "{r}");
    assert_eq!(r["rows"].as_array().unwrap(), &before);
    assert_eq!(segment_files(&node.dir), files, "a clean restart rewrites no segment");

    // Changes, then kill -9: the shadow catches up from its last checkpoint.
    let mut lines: Vec<Value> = (0..1000).map(|i| json!({"op": "upsert", "key": format!("e{i:05}"), "value": {"price": 1.0}})).collect();
    lines.extend((1000..1500).map(|i| json!({"op": "remove", "key": format!("e{i:05}")})));
    bulk(&node, &c, "ev", &lines).await;
    node.kill9();
    node.restart();
    let c = node.client();
    let expected: f64 = 1000.0 + (1500..20_000).map(|i| i as f64 * 0.5).sum::<f64>();
    let after = sql(&node, &c, "/v1/analytics", "SELECT count(*), sum(price), count(kind) FROM ev").await;
    assert_eq!(after[0][0], json!(19_500));
    assert_eq!(after[0][1].as_f64(), Some(expected));
    assert_eq!(after[0][2], json!(18_500));

    // A bit flipped in a segment file: the damaged analytics partition is quarantined and
    // rebuilt from the change streams; the answers stay right.
    assert!(node.stop(), "clean stop");
    let (victim, len, _) = segment_files(&node.dir).into_iter().max_by_key(|f| f.1).unwrap();
    let mut bytes = std::fs::read(&victim).unwrap();
    bytes[len as usize / 2] ^= 0x04;
    std::fs::write(&victim, &bytes).unwrap();
    node.restart();
    let c = node.client();
    let again = sql(&node, &c, "/v1/analytics", "SELECT count(*), sum(price), count(kind) FROM ev").await;
    assert_eq!(again, after, "the same answers after the rebuild");
    let metrics = c.get(node.u("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.lines().any(|l| l.starts_with("shoal_analytics_rebuilds_total") && !l.ends_with(" 0")), "{metrics}");
    let quarantine = victim.parent().unwrap().parent().unwrap().join("quarantine");
    let kept: Vec<_> = std::fs::read_dir(&quarantine).unwrap().flatten().collect();
    assert_eq!(kept.len(), 1, "the damaged files are kept for inspection");
    // Dropping the collection removes its shadow.
    assert!(c.delete(node.u("/v1/collections/ev")).send().await.unwrap().status().is_success());
    let mut tries = 0;
    while !segment_files(&node.dir).is_empty() {
        tries += 1;
        assert!(tries < 100, "the dropped collection's shadow is still on disk");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn analytics_partitions_spread_over_the_data_paths() {
    let tmp = tempfile::tempdir().unwrap();
    let second = tmp.path().join("second");
    let node = Node::start(&["--partitions", "8", "--analytics-partitions", "4", "--data-path", second.to_str().unwrap()]);
    let c = node.client();
    assert!(c.put(node.u("/v1/collections/ev")).send().await.unwrap().status().is_success());
    let lines: Vec<Value> = (0..2000).map(|i| json!({"op": "upsert", "key": format!("e{i:05}"), "value": event(i)})).collect();
    bulk(&node, &c, "ev", &lines).await;
    assert_eq!(sql(&node, &c, "/v1/analytics", "SELECT count(*) FROM ev").await, [json!([2000])]);
    // Partitions 0 and 2 on the first path, 1 and 3 on the second, once checkpointed.
    let mut tries = 0;
    loop {
        let (a, b) = (segment_files(&node.dir), segment_files(&second));
        let parts = |files: &[(std::path::PathBuf, u64, std::time::SystemTime)]| {
            let mut p: Vec<String> =
                files.iter().filter_map(|f| f.0.parent()?.file_name().map(|n| n.to_string_lossy().into_owned())).collect();
            p.sort();
            p.dedup();
            p
        };
        if parts(&a) == ["0", "2"] && parts(&b) == ["1", "3"] {
            break;
        }
        tries += 1;
        assert!(tries < 100, "segments not spread: {a:?} {b:?}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let plan = Value::Array(sql(&node, &c, "/v1/analytics", "EXPLAIN SELECT count(*) FROM ev").await).to_string();
    assert!(plan.contains("analytics partitions=4"), "{plan}");
}

/// `--analytics-partitions 0` turns analytics off without deleting the shadows: started
/// with it on again, the node answers from the same files, rebuilding nothing.
#[tokio::test]
async fn turning_analytics_off_keeps_the_shadows() {
    let mut node = Node::start(&["--partitions", "4", "--analytics-partitions", "2"]);
    let c = node.client();
    assert!(c.put(node.u("/v1/collections/ev")).send().await.unwrap().status().is_success());
    let lines: Vec<Value> = (0..3000).map(|i| json!({"op": "upsert", "key": format!("e{i:05}"), "value": event(i)})).collect();
    bulk(&node, &c, "ev", &lines).await;
    assert_eq!(sql(&node, &c, "/v1/analytics", "SELECT count(*) FROM ev").await, [json!([3000])]);
    assert!(node.stop());
    let files = segment_files(&node.dir);
    assert!(!files.is_empty());
    node.restart_with(&["--analytics-partitions", "0"]);
    let c = node.client();
    let (s, _) = post(&c, node.u("/v1/analytics"), json!({"sql": "SELECT count(*) FROM ev"})).await;
    assert_eq!(s, reqwest::StatusCode::SERVICE_UNAVAILABLE);
    assert!(node.stop());
    assert_eq!(segment_files(&node.dir), files, "analytics off left the shadow files alone");
    node.restart_with(&["--analytics-partitions", "2"]);
    let c = node.client();
    let (s, r) = post(&c, node.u("/v1/analytics"), json!({"sql": "SELECT count(*) FROM ev"})).await;
    assert_eq!((s, &r["rows"]), (reqwest::StatusCode::OK, &json!([[3000]])), "answered from the kept files at once");
    assert_eq!(segment_files(&node.dir), files);
}

#[tokio::test]
async fn analytics_can_be_turned_off() {
    let node = Node::start(&["--partitions", "4", "--analytics-partitions", "0"]);
    let c = node.client();
    assert!(c.put(node.u("/v1/collections/ev")).send().await.unwrap().status().is_success());
    let (s, r) = post(&c, node.u("/v1/analytics"), json!({"sql": "SELECT count(*) FROM ev"})).await;
    assert_eq!((s, r["error"].as_str()), (reqwest::StatusCode::SERVICE_UNAVAILABLE, Some("unavailable")), "{r}");
    assert_eq!(sql(&node, &c, "/v1/query", "SELECT count(*) FROM ev").await, [json!([0])]);
    assert!(segment_files(&node.dir).is_empty());
}
