//! SQL over collections through `POST /v1/query`: types inferred from the documents, joins,
//! aggregates, windows, subqueries, parameters, index and key pushdown shown by EXPLAIN,
//! request_plus, and bad input.

mod common;

use common::cluster::SECRET;
use common::Node;
use reqwest::StatusCode;
use serde_json::{json, Value};

async fn sql_with(node: &Node, c: &reqwest::Client, body: Value) -> (StatusCode, Value) {
    sql_at(node, c, "/v1/query", body).await
}

async fn sql_at(node: &Node, c: &reqwest::Client, path: &str, body: Value) -> (StatusCode, Value) {
    let r = c.post(node.u(path)).body(body.to_string()).send().await.unwrap();
    (r.status(), r.json().await.unwrap_or(Value::Null))
}

/// Runs a statement that must succeed; returns its rows.
async fn rows(node: &Node, c: &reqwest::Client, sql: &str, params: Value) -> Vec<Value> {
    let (s, r) = sql_with(node, c, json!({"sql": sql, "params": params, "consistency": "request_plus"})).await;
    assert_eq!(s, StatusCode::OK, "{sql}: {r}");
    assert_eq!(r["metrics"]["rows"], json!(r["rows"].as_array().unwrap().len()));
    r["rows"].as_array().unwrap().clone()
}

async fn put(node: &Node, c: &reqwest::Client, coll: &str, key: &str, doc: Value) {
    let r = c.put(node.u(&format!("/v1/collections/{coll}/docs/{key}"))).body(doc.to_string()).send().await.unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
}

async fn people(node: &Node, c: &reqwest::Client) {
    c.put(node.u("/v1/collections/people")).send().await.unwrap();
    c.put(node.u("/v1/collections/orders")).send().await.unwrap();
    let people = [
        (
            "p1",
            json!({"name": "Ann", "age": 31, "city": "Oslo", "address": {"zip": "0150", "geo": {"lat": 59.9}}, "tags": ["a", "b"], "firstName": "A"}),
        ),
        ("p2", json!({"name": "Bo", "age": 45, "city": "Bergen", "address": {"zip": "5003"}, "tags": ["c"], "firstName": "B"})),
        ("p3", json!({"name": "Cy", "age": 27, "city": "Oslo", "tags": [], "firstName": "C"})),
        ("p4", json!({"name": "Di", "age": "unknown", "city": "Tromsø"})),
    ];
    for (k, d) in people {
        put(node, c, "people", k, d).await;
    }
    for (i, (person, total)) in [("p1", 10.5), ("p1", 4.5), ("p2", 7.0), ("p9", 1.0)].into_iter().enumerate() {
        put(node, c, "orders", &format!("o{i}"), json!({"person": person, "total": total})).await;
    }
}

#[tokio::test]
async fn sql_reads_documents_as_tables() {
    let node = Node::start(&["--partitions", "8"]);
    let c = node.client();
    people(&node, &c).await;
    // Ages: p4's "unknown" does not fit the integer column, so it is NULL, not an error.
    assert_eq!(
        rows(&node, &c, "SELECT meta_id, name, age FROM people ORDER BY meta_id", json!([])).await,
        [json!(["p1", "Ann", 31]), json!(["p2", "Bo", 45]), json!(["p3", "Cy", 27]), json!(["p4", "Di", null])]
    );
    // Nested fields, array elements (1-based), case-sensitive names without quotes.
    assert_eq!(
        rows(&node, &c, "SELECT address.zip, address['geo']['lat'], tags[1], firstName FROM people WHERE meta_id = 'p1'", json!([])).await,
        [json!(["0150", 59.9, "a", "A"])]
    );
    assert_eq!(
        rows(&node, &c, "SELECT city, count(*) AS n, min(age) FROM people GROUP BY city ORDER BY n DESC, city", json!([])).await,
        [json!(["Oslo", 2, 27]), json!(["Bergen", 1, 45]), json!(["Tromsø", 1, null])]
    );
    assert_eq!(
        rows(
            &node,
            &c,
            "SELECT p.name, sum(o.total) AS spent FROM orders o JOIN people p ON o.person = p.meta_id GROUP BY p.name ORDER BY spent DESC",
            json!([])
        )
        .await,
        [json!(["Ann", 15.0]), json!(["Bo", 7.0])]
    );
    assert_eq!(
        rows(&node, &c, "SELECT name, row_number() OVER (ORDER BY age DESC) FROM people WHERE age IS NOT NULL ORDER BY 2", json!([])).await,
        [json!(["Bo", 1]), json!(["Ann", 2]), json!(["Cy", 3])]
    );
    assert_eq!(
        rows(&node, &c, "SELECT name FROM people WHERE age > (SELECT avg(age) FROM people) ORDER BY name", json!([])).await,
        [json!(["Bo"])]
    );
    // Parameters are bound, never spliced: a quote in a parameter is just a character.
    assert_eq!(rows(&node, &c, "SELECT name FROM people WHERE age > $1 AND city = $2", json!([30, "Oslo"])).await, [json!(["Ann"])]);
    assert!(rows(&node, &c, "SELECT name FROM people WHERE name = $1", json!(["x' OR '1'='1"])).await.is_empty());
    // NDJSON: columns, then one line per row, then metrics.
    let r = c
        .post(node.u("/v1/query"))
        .header("accept", "application/x-ndjson")
        .body(json!({"sql": "SELECT meta_id, age FROM people WHERE age > 30 ORDER BY meta_id"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["content-type"], "application/x-ndjson");
    let lines: Vec<Value> = r.text().await.unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines[..3], [json!({"columns": ["meta_id", "age"]}), json!(["p1", 31]), json!(["p2", 45])]);
    assert_eq!(lines[3]["metrics"]["rows"], 2);
    // New fields widen the schema as documents arrive.
    put(&node, &c, "people", "p5", json!({"name": "Ed", "age": 50.5, "nickname": "E"})).await;
    assert_eq!(
        rows(&node, &c, "SELECT nickname, age FROM people WHERE meta_id IN ('p5', 'p1') ORDER BY meta_id", json!([])).await,
        [json!([null, 31.0]), json!(["E", 50.5])]
    );
}

#[tokio::test]
async fn filters_use_key_lookups_and_indexes() {
    // No shadows: full scans read the documents (the columnar choice has its own test).
    let node = Node::start(&["--partitions", "8", "--analytics-partitions", "0"]);
    let c = node.client();
    people(&node, &c).await;
    for (name, keys) in [("by_city", json!(["city", "age"])), ("by_age", json!(["age"]))] {
        let r =
            c.post(node.u("/v1/collections/people/indexes")).body(json!({"name": name, "keys": keys}).to_string()).send().await.unwrap();
        assert!(r.status().is_success());
    }
    let plan = |rows: Vec<Value>| rows.iter().map(|r| r.to_string()).collect::<Vec<_>>().join("\n");
    let explain = plan(rows(&node, &c, "EXPLAIN SELECT name FROM people WHERE city = 'Oslo'", json!([])).await);
    assert!(explain.contains("index=by_city eq [\\\"Oslo\\\"]"), "{explain}");
    let explain = plan(rows(&node, &c, "EXPLAIN SELECT name FROM people WHERE city = 'Oslo' AND age >= 30", json!([])).await);
    assert!(explain.contains("index=by_city range [[\\\"Oslo\\\",30] .. [\\\"Oslo\\\"]]"), "{explain}");
    let explain = plan(rows(&node, &c, "EXPLAIN SELECT name FROM people WHERE age BETWEEN 20 AND 40", json!([])).await);
    assert!(explain.contains("index=by_age range [[20] .. [40]]"), "{explain}");
    let explain = plan(rows(&node, &c, "EXPLAIN SELECT name FROM people WHERE meta_id = 'p2'", json!([])).await);
    assert!(explain.contains("keys=1"), "{explain}");
    let explain = plan(rows(&node, &c, "EXPLAIN SELECT name FROM people WHERE name = 'Ann'", json!([])).await);
    assert!(explain.contains("full scan, key ranges="), "a full read is split over the cores: {explain}");
    // The answers through the index are the answers.
    assert_eq!(
        rows(&node, &c, "SELECT name FROM people WHERE city = 'Oslo' ORDER BY name", json!([])).await,
        [json!(["Ann"]), json!(["Cy"])]
    );
    assert_eq!(rows(&node, &c, "SELECT name FROM people WHERE city = 'Oslo' AND age >= 30", json!([])).await, [json!(["Ann"])]);
    assert_eq!(
        rows(&node, &c, "SELECT name FROM people WHERE age BETWEEN 20 AND 40 ORDER BY name", json!([])).await,
        [json!(["Ann"]), json!(["Cy"])]
    );
    assert_eq!(rows(&node, &c, "SELECT name FROM people WHERE meta_id = 'p2'", json!([])).await, [json!(["Bo"])]);
    assert!(rows(&node, &c, "SELECT name FROM people WHERE meta_id = 'nope'", json!([])).await.is_empty());
    // request_plus: a write acknowledged before the query is in its answer.
    for i in 0..20 {
        put(&node, &c, "people", &format!("n{i}"), json!({"name": format!("N{i}"), "city": "Narvik", "age": i})).await;
        let got = rows(&node, &c, "SELECT count(*) FROM people WHERE city = 'Narvik'", json!([])).await;
        assert_eq!(got, [json!([i + 1])]);
    }
}

#[tokio::test]
async fn bad_sql_input_gets_clear_errors_and_the_server_keeps_serving() {
    let node = Node::start(&["--partitions", "4"]);
    let c = node.client();
    people(&node, &c).await;
    let code = |r: &Value| r["error"].as_str().unwrap_or_default().to_string();
    let cases: Vec<(Value, StatusCode, &str, &str)> = vec![
        (json!({"sql": "SELEC name FROM people"}), StatusCode::BAD_REQUEST, "query_error", "Line: 1"),
        (json!({"sql": "SELECT name FROM"}), StatusCode::BAD_REQUEST, "query_error", ""),
        (json!({"sql": "SELECT nope FROM people"}), StatusCode::BAD_REQUEST, "query_error", "nope"),
        (json!({"sql": "SELECT * FROM missing"}), StatusCode::BAD_REQUEST, "query_error", "missing"),
        (json!({"sql": "CREATE TABLE t (a INT)"}), StatusCode::BAD_REQUEST, "query_error", ""),
        (json!({"sql": "CREATE EXTERNAL TABLE t STORED AS CSV LOCATION '/etc/passwd'"}), StatusCode::BAD_REQUEST, "query_error", ""),
        (json!({"sql": "INSERT INTO people VALUES ('x')"}), StatusCode::BAD_REQUEST, "query_error", ""),
        (json!({"sql": "SET datafusion.execution.batch_size = 1"}), StatusCode::BAD_REQUEST, "query_error", ""),
        (json!({"sql": "SELECT 1/0"}), StatusCode::BAD_REQUEST, "query_error", ""),
        (json!({"sql": "SELECT $1"}), StatusCode::BAD_REQUEST, "query_error", ""),
        (json!({"sql": "SELECT $1", "params": [{"a": 1}]}), StatusCode::BAD_REQUEST, "bad_request", "parameters"),
        (json!({"sql": "SELECT 1", "consistency": "sometimes"}), StatusCode::BAD_REQUEST, "bad_request", ""),
        (json!({"sql": "SELECT 1", "timeout_ms": 999_999_999u64}), StatusCode::BAD_REQUEST, "bad_request", "timeout"),
        (json!({"sql": "SELECT 1", "extra": 1}), StatusCode::BAD_REQUEST, "bad_request", ""),
        (json!({"query": "SELECT 1"}), StatusCode::BAD_REQUEST, "bad_request", ""),
        (json!({"sql": format!("SELECT '{}'", "x".repeat(70_000))}), StatusCode::BAD_REQUEST, "bad_request", "longer"),
        (json!({"sql": format!("SELECT {}1{}", "(".repeat(5000), ")".repeat(5000))}), StatusCode::BAD_REQUEST, "query_error", ""),
        (
            json!({"sql": "SELECT count(*) FROM generate_series(1, 100000000000)", "timeout_ms": 300}),
            StatusCode::GATEWAY_TIMEOUT,
            "timeout",
            "",
        ),
        (json!({"sql": "SELECT * FROM generate_series(1, 200000)"}), StatusCode::PAYLOAD_TOO_LARGE, "too_large", "LIMIT"),
        // Functions that choose their output size are bounded before they allocate.
        (json!({"sql": "SELECT repeat('x', 2000000000)"}), StatusCode::BAD_REQUEST, "query_error", "at most"),
        (json!({"sql": "SELECT array_repeat('abc', 1000000000)"}), StatusCode::BAD_REQUEST, "query_error", "at most"),
        // A statement that would need gigabytes stops at the query's memory cap.
        (
            json!({"sql": "SELECT array_agg(repeat('x', 1000)) FROM generate_series(1, 2000000)"}),
            StatusCode::BAD_REQUEST,
            "query_error",
            "memory",
        ),
    ];
    // Both SQL endpoints take the same requests and refuse the same input.
    for path in ["/v1/query", "/v1/analytics"] {
        for (body, status, expected, fragment) in &cases {
            let (s, r) = sql_at(&node, &c, path, body.clone()).await;
            let shown = body.to_string().chars().take(120).collect::<String>();
            assert_eq!((s, code(&r).as_str()), (*status, *expected), "{path} {shown}: {r}");
            assert!(r["reason"].as_str().unwrap_or_default().contains(fragment), "{path} {shown}: {r}");
        }
        for raw in ["not json", "", "[1]", "{\"sql\": 5}"] {
            let r = c.post(node.u(path)).body(raw).send().await.unwrap();
            assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{path} {raw}");
        }
        // The unread rest of an oversized body means the connection cannot be reused: the
        // answer says so, and the next request on the same client still works.
        let r = c.post(node.u(path)).body(vec![b'x'; 3 * 1024 * 1024]).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE, "{path}");
        assert_eq!(r.headers().get("connection").and_then(|v| v.to_str().ok()), Some("close"), "{path}");
    }
    // Nothing was lost and the server still answers.
    assert_eq!(rows(&node, &c, "SELECT count(*) FROM people", json!([])).await, [json!([4])]);
}

/// Decimal literals are exact, as in PostgreSQL and DuckDB: TPC-H query 6's
/// `BETWEEN 0.06 - 0.01 AND 0.06 + 0.01` keeps the rows at 0.07, and decimal answers come
/// back with their own digits.
#[tokio::test]
async fn decimal_literals_are_exact() {
    let node = Node::start(&["--partitions", "4"]);
    let c = node.client();
    c.put(node.u("/v1/collections/li")).send().await.unwrap();
    for (i, d) in [0.04, 0.05, 0.06, 0.07, 0.08].iter().enumerate() {
        c.put(node.u(&format!("/v1/collections/li/docs/{i}")))
            .body(json!({"discount": d, "price": 100.25}).to_string())
            .send()
            .await
            .unwrap();
    }
    for path in ["/v1/query", "/v1/analytics"] {
        let sql = "SELECT count(*) FROM li WHERE discount BETWEEN 0.06 - 0.01 AND 0.06 + 0.01";
        let (s, r) = sql_at(&node, &c, path, json!({"sql": sql, "consistency": "request_plus"})).await;
        assert_eq!(s, StatusCode::OK, "{r}");
        assert_eq!(r["rows"], json!([[3]]), "{path}: 0.05, 0.06 and 0.07 qualify");
        let (_, r) = sql_at(&node, &c, path, json!({"sql": "SELECT 0.06 + 0.01 AS d, 1.10 * 3 AS m, CAST(2 AS DECIMAL(10,3)) AS z"})).await;
        assert_eq!(r["rows"], json!([[0.07, 3.3, 2.0]]), "{path}: {r}");
        let (_, r) = sql_at(&node, &c, path, json!({"sql": "SELECT 0.1 + 0.2 = 0.3"})).await;
        assert_eq!(r["rows"], json!([[true]]), "{path}");
    }
}

#[tokio::test]
async fn cli_runs_statements() {
    let node = Node::start(&["--partitions", "4"]);
    let c = node.client();
    people(&node, &c).await;
    let (ok, out, err) = node.cli(&["sql", "-e", "SELECT name, age FROM people WHERE city = 'Oslo' ORDER BY name"]);
    assert!(ok, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[..3], ["name  age", "Ann   31", "Cy    27"], "{out}");
    assert!(lines[3].starts_with("(2 rows"), "{out}");
    let (ok, out, err) = node.cli(&[
        "--output",
        "csv",
        "sql",
        "-e",
        "SELECT name, $1 AS note FROM people WHERE meta_id = 'p1'",
        "--params",
        "[\"a,\\\"b\\\"\"]",
    ]);
    assert!(ok, "{err}");
    assert_eq!(out, "name,note\nAnn,\"a,\"\"b\"\"\"\n");
    let (ok, out, err) = common::cli(&node.url, &["--output", "json", "sql"], Some("SELECT 1 AS one;\nSELECT ';' AS two;"));
    assert!(ok, "{err}");
    let answers: Vec<Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(answers.iter().map(|a| a["rows"].clone()).collect::<Vec<_>>(), [json!([[1]]), json!([[";"]])]);
    let (ok, _, err) = node.cli(&["sql", "-e", "SELEC 1"]);
    assert!(!ok && err.contains("query_error"), "{err}");
}

/// A query whose client goes away is cancelled at once, not run to its timeout.
#[tokio::test]
async fn a_query_is_cancelled_when_its_client_disconnects() {
    use tokio::io::AsyncWriteExt;
    let node = Node::start(&["--partitions", "4"]);
    let c = node.client();
    let running = |text: &str, path: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(&format!("shoal_queries_running{{path=\"{path}\"}}")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    for path in ["query", "analytics"] {
        let body = json!({"sql": "SELECT count(*) FROM generate_series(1, 100000000000)", "timeout_ms": 120_000}).to_string();
        let addr = node.url.trim_start_matches("http://").to_string();
        let mut tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let head =
            format!("POST /v1/{path} HTTP/1.1\r\nhost: x\r\nAuthorization: Basic YWRtaW46dGVzdC1hZG1pbi1wYXNzd29yZA==\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n", body.len());
        tcp.write_all(head.as_bytes()).await.unwrap();
        tcp.write_all(body.as_bytes()).await.unwrap();
        // The statement starts running...
        common::eventually(10, "the query starts", || async {
            running(&c.get(node.u("/metrics")).send().await.unwrap().text().await.unwrap(), path) >= 1.0
        })
        .await;
        // ...and keeps running while its client waits (it would run for its whole timeout)...
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        assert!(running(&c.get(node.u("/metrics")).send().await.unwrap().text().await.unwrap(), path) >= 1.0, "{path} still runs");
        // ...until the client goes away: then the node stops working for it.
        drop(tcp);
        common::eventually(10, "the abandoned query is cancelled", || async {
            running(&c.get(node.u("/metrics")).send().await.unwrap().text().await.unwrap(), path) == 0.0
        })
        .await;
    }
}

/// A statement pushed to an index reads every matching entry, however many: more rows
/// match than one index scan may return (`SCAN_ROWS_MAX`), and the count is still exact.
#[tokio::test]
async fn an_index_read_never_stops_short() {
    const MATCHING: usize = 100_000 + 20_000;
    let node = Node::start(&["--partitions", "8", "--analytics-partitions", "0"]);
    let c = node.client();
    c.put(node.u("/v1/collections/c")).send().await.unwrap();
    let r =
        c.post(node.u("/v1/collections/c/indexes")).body(json!({"name": "by_city", "keys": ["city"]}).to_string()).send().await.unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    let total = MATCHING + 5_000;
    for chunk in (0..total).collect::<Vec<_>>().chunks(40_000) {
        let mut body = String::new();
        for i in chunk {
            let city = if *i < MATCHING { "Oslo" } else { "Bergen" };
            body.push_str(&json!({"op": "upsert", "key": format!("k{i:07}"), "value": {"city": city, "n": i}}).to_string());
            body.push('\n');
        }
        let r = c.post(node.u("/v1/collections/c/_bulk")).body(body).send().await.unwrap();
        assert!(r.status().is_success());
        let text = r.text().await.unwrap();
        assert!(!text.contains("\"error\""), "{}", &text[..text.len().min(300)]);
    }
    let sql = "SELECT count(*), min(n), max(n) FROM c WHERE city = 'Oslo'";
    let (_, plan) = sql_at(&node, &c, "/v1/query", json!({"sql": format!("EXPLAIN {sql}")})).await;
    assert!(plan.to_string().contains("index=by_city"), "the statement reads the index: {plan}");
    assert_eq!(rows(&node, &c, sql, json!([])).await, [json!([MATCHING, 0, MATCHING - 1])]);
}

/// A full scan reads the columnar shadow only when it answers the rows the documents hold:
/// at `not_bounded` every acknowledged write is still seen (the shadow is read only once it
/// holds them all, the documents otherwise), `EXPLAIN` says which was read and why, and a
/// node without shadows reads the documents.
#[tokio::test]
async fn a_full_scan_reads_the_shadow_only_when_it_answers_the_same_rows() {
    let node = Node::start(&["--partitions", "8", "--analytics-partitions", "2"]);
    let c = node.client();
    c.put(node.u("/v1/collections/c")).send().await.unwrap();
    let mut sum = 0;
    let mut engines = std::collections::BTreeSet::new();
    for i in 0..60 {
        put(&node, &c, "c", &format!("k{i}"), json!({"x": i})).await;
        sum += i;
        let (s, v) = sql_with(&node, &c, json!({"sql": "SELECT count(*), sum(x) FROM c", "consistency": "not_bounded"})).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["rows"], json!([[i + 1, sum]]), "every acknowledged write, whichever is read");
        engines.insert(v["metrics"]["engine"].as_str().unwrap().to_string());
    }
    eprintln!("engines seen: {engines:?}");
    // Once the shadow holds every write (an analytics statement waits for it), a full
    // scan reads it.
    let (s, v) = sql_at(&node, &c, "/v1/analytics", json!({"sql": "SELECT count(*) FROM c", "consistency": "request_plus"})).await;
    assert_eq!((s, &v["rows"]), (StatusCode::OK, &json!([[60]])), "{v}");
    let (s, v) = sql_with(&node, &c, json!({"sql": "SELECT count(*), sum(x) FROM c", "consistency": "request_plus"})).await;
    assert_eq!((s, &v["rows"], &v["metrics"]["engine"]), (StatusCode::OK, &json!([[60, sum]]), &json!("columnar")), "{v}");
    let plan = rows(&node, &c, "EXPLAIN SELECT sum(x) FROM c", json!([])).await;
    assert!(json!(plan).to_string().contains("columnar: the shadow holds every write made before the statement"), "{plan:?}");
    // Key lookups still read the documents.
    let (s, v) = sql_with(&node, &c, json!({"sql": "SELECT x FROM c WHERE meta_id = 'k7'"})).await;
    assert_eq!((s, &v["rows"], &v["metrics"]["engine"]), (StatusCode::OK, &json!([[7]]), &json!("rows")), "{v}");

    let off = Node::start(&["--partitions", "8", "--analytics-partitions", "0"]);
    c.put(off.u("/v1/collections/c")).send().await.unwrap();
    put(&off, &c, "c", "k", json!({"x": 1})).await;
    let (s, v) = sql_with(&off, &c, json!({"sql": "SELECT sum(x) FROM c"})).await;
    assert_eq!((s, &v["rows"], &v["metrics"]["engine"]), (StatusCode::OK, &json!([[1]]), &json!("rows")), "{v}");
    let plan = rows(&off, &c, "EXPLAIN SELECT sum(x) FROM c", json!([])).await;
    assert!(json!(plan).to_string().contains("rows: analytics is off on this node"), "{plan:?}");
}

/// At `request_plus` a full scan waits for the shadow at most `COLUMNAR_WAIT` (500 ms) and
/// then reads the documents: a shadow that lags (held by fault injection, as a slow disk
/// would make it) never makes `/v1/query` answer fewer rows nor fail, `EXPLAIN` says why
/// the documents were read, and `/v1/analytics` (which reads only the shadow) answers
/// `504` at the statement's timeout instead of a short count. Released, the shadow
/// catches up and is read again.
#[tokio::test]
async fn a_full_scan_reads_the_documents_when_the_shadow_lags_past_the_columnar_wait() {
    let node = Node::start(&["--partitions", "8", "--analytics-partitions", "2", "--cluster-secret", SECRET, "--fault-injection"]);
    let c = node.client();
    c.put(node.u("/v1/collections/c")).send().await.unwrap();
    let faults = |hold: Value| {
        let (c, url) = (c.clone(), node.u("/v1/_internal/faults"));
        async move {
            let r =
                c.post(url).header("x-shoal-cluster-secret", SECRET).json(&json!({"cut": [], "hold_shadows": hold})).send().await.unwrap();
            (r.status(), r.text().await.unwrap_or_default())
        }
    };
    let mut sum = 0;
    for i in 0..10 {
        put(&node, &c, "c", &format!("k{i}"), json!({"x": i})).await;
        sum += i;
    }
    let statement = json!({"sql": "SELECT count(*), sum(x) FROM c", "consistency": "request_plus"});
    let (s, v) = sql_with(&node, &c, statement.clone()).await;
    assert_eq!((s, &v["rows"], &v["metrics"]["engine"]), (StatusCode::OK, &json!([[10, sum]]), &json!("columnar")), "{v}");

    // An unknown collection is a clear error, and holds nothing.
    let (s, body) = faults(json!(["nope"])).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(faults(json!(["c"])).await.0, StatusCode::OK);
    for i in 10..15 {
        put(&node, &c, "c", &format!("k{i}"), json!({"x": i})).await;
        sum += i;
    }
    let (s, v) = sql_with(&node, &c, statement.clone()).await;
    assert_eq!((s, &v["rows"], &v["metrics"]["engine"]), (StatusCode::OK, &json!([[15, sum]]), &json!("rows")), "{v}");
    let (s, v) = sql_with(&node, &c, json!({"sql": "EXPLAIN SELECT sum(x) FROM c", "consistency": "request_plus"})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(v.to_string().contains("rows: the analytics shadow did not catch up within 500ms"), "{v}");
    let (s, v) =
        sql_at(&node, &c, "/v1/analytics", json!({"sql": "SELECT count(*) FROM c", "consistency": "request_plus", "timeout_ms": 1000}))
            .await;
    assert_eq!((s, v["error"].as_str()), (StatusCode::GATEWAY_TIMEOUT, Some("timeout")), "never a short count: {v}");

    assert_eq!(faults(json!([])).await.0, StatusCode::OK);
    let (s, v) = sql_at(&node, &c, "/v1/analytics", json!({"sql": "SELECT count(*) FROM c", "consistency": "request_plus"})).await;
    assert_eq!((s, &v["rows"]), (StatusCode::OK, &json!([[15]])), "{v}");
    let (s, v) = sql_with(&node, &c, statement).await;
    assert_eq!((s, &v["rows"], &v["metrics"]["engine"]), (StatusCode::OK, &json!([[15, sum]]), &json!("columnar")), "{v}");
}
