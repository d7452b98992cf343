//! Faults during the index service's moves (issue 41): real processes, kill -9 of a move's
//! target and of its source mid-rebalance, scans checked against a model throughout. In a
//! file of its own so that its clusters do not share the machine with `tests/cluster.rs`'s.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::cluster::{get_json, index_cluster, index_node_args, joined, member_states, node_id, rebalance, wait_for, IndexCluster};
use serde_json::{json, Value};

/// A whole scan of index `by_v` of `c` through `node` at `request_plus`: its status, its
/// rows as (key, id) when it answered them, and its body.
async fn whole_scan(http: &reqwest::Client, node: &common::Node) -> (u16, Option<Vec<(i64, String)>>, Value) {
    let url = node.u("/v1/collections/c/indexes/by_v/scan");
    let r = http.post(url).json(&json!({"consistency": "request_plus", "timeout_ms": 30_000})).send().await.unwrap();
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap_or(Value::Null);
    let rows: Option<Vec<(i64, String)>> = v["rows"]
        .as_array()
        .map(|rows| rows.iter().map(|r| (r["key"][0].as_i64().unwrap(), r["id"].as_str().unwrap().to_string())).collect());
    (status, rows, v)
}

/// Sets `node`'s injected faults (`POST /v1/_internal/faults`); answers the status.
async fn set_faults(http: &reqwest::Client, node: &common::Node, faults: Value) -> u16 {
    let r = http
        .post(node.u("/v1/_internal/faults"))
        .header("x-shoal-cluster-secret", common::cluster::SECRET)
        .json(&faults)
        .send()
        .await
        .unwrap();
    r.status().as_u16()
}

/// Whole scans through `node` until the rebalance ends, each exact (`want`) or `503`;
/// answers the rebalance's last status.
async fn scans_until_the_rebalance_ends(http: &reqwest::Client, node: &common::Node, want: &[(i64, String)], what: &str) -> Value {
    loop {
        let (_, status) = get_json(http, &node.u("/v1/cluster/rebalance")).await;
        let (code, rows, v) = whole_scan(http, node).await;
        match code {
            200 => assert_eq!(rows.as_deref(), Some(want), "a scan while the rebalance {what}"),
            503 => {}
            other => panic!("{other} {v}"),
        }
        if status["state"] != "running" {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The moves of `kind` (`partition` or `index`) in a rebalance's status.
fn moves_of(status: &Value, kind: &str) -> Vec<Value> {
    status["moves"].as_array().map(|m| m.iter().filter(|m| m["kind"] == kind).cloned().collect()).unwrap_or_default()
}

/// Whether the placement of the first index `GET .../indexes` lists names node `id`.
fn named(listed: &Value, id: u64) -> bool {
    listed[0]["placement"].as_array().is_some_and(|p| p.iter().filter_map(|c| c.as_array()).flatten().any(|n| *n == json!(id)))
}

/// The index service's test cluster with index `by_v` (8 partitions, a replica each) over
/// 120 documents of `c`, and the rows a whole scan must answer (checked once).
async fn indexed_cluster() -> (IndexCluster, Vec<(i64, String)>) {
    let cluster = index_cluster().await;
    let (http, first) = (&cluster.http, &cluster.first);
    let def = json!({"name": "by_v", "keys": ["v"], "partitions": 8, "replicas": 1});
    assert_eq!(http.post(first.u("/v1/collections/c/indexes")).json(&def).send().await.unwrap().status(), 201);
    let mut want: Vec<(i64, String)> = Vec::new();
    for i in 0..120i64 {
        let key = format!("k{i:03}");
        let r = http.put(first.u(&format!("/v1/collections/c/docs/{key}"))).json(&json!({"v": i % 5})).send().await.unwrap();
        assert_eq!(r.status(), 200);
        want.push((i % 5, key));
    }
    want.sort();
    let (status, rows, v) = whole_scan(http, first).await;
    assert_eq!((status, rows.as_ref()), (200, Some(&want)), "{v}");
    (cluster, want)
}

/// A fifth node running the index service, with fault injection, joined through `join`.
async fn fault_injected_joiner(http: &reqwest::Client, first: &common::Node, join: &str) -> common::Node {
    let mut args = index_node_args();
    args.push("--fault-injection");
    let joiner = joined(&args, join);
    wait_for(http, &first.u("/v1/cluster"), "the new member", |v| member_states(v).len() == 5).await;
    joiner
}

/// Issue 41: a kill -9 of an index move's target, then of a source, mid-rebalance. The
/// rebalance ends (done, or failed with the placement unchanged); scans stay exact or `503`
/// throughout; once the dead node is failed over and ejected, the next rebalance places its
/// copies on the live index nodes (from a live copy's files) and every scan is exact again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_index_move_whose_target_or_source_is_killed_leaves_the_scans_exact() {
    let IndexCluster { first, second: _second, mut a, b, join, http } = index_cluster().await;
    let def = json!({"name": "by_v", "keys": ["v"], "partitions": 8, "replicas": 1});
    assert_eq!(http.post(first.u("/v1/collections/c/indexes")).json(&def).send().await.unwrap().status(), 201);
    let mut model: BTreeMap<String, i64> = BTreeMap::new();
    for i in 0..150i64 {
        let key = format!("k{i:03}");
        let r = http.put(first.u(&format!("/v1/collections/c/docs/{key}"))).json(&json!({"v": i % 7})).send().await.unwrap();
        assert_eq!(r.status(), 200);
        model.insert(key, i % 7);
    }
    let mut want: Vec<(i64, String)> = model.iter().map(|(k, v)| (*v, k.clone())).collect();
    want.sort();
    let scan = || whole_scan(&http, &first);
    let exact_eventually = |what: &'static str| {
        let scan = &scan;
        let want = &want;
        async move {
            let deadline = Instant::now() + Duration::from_secs(90);
            loop {
                let (status, rows, v) = scan().await;
                match status {
                    200 => {
                        assert_eq!(rows.as_ref(), Some(want), "{what}");
                        return;
                    }
                    503 => assert!(Instant::now() < deadline, "{what}: never answered: {v}"),
                    other => panic!("{what}: {other} {v}"),
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    exact_eventually("before the moves").await;
    // Each phase: a node joins, a rebalance starts, one node dies at once; then the dead one
    // is failed over and ejected.
    for phase in ["target", "source"] {
        let mut joiner = joined(&index_node_args(), &join);
        let (_, info) = get_json(&http, &first.u("/v1/cluster")).await;
        let members = info["nodes"].as_array().unwrap().len();
        wait_for(&http, &first.u("/v1/cluster"), "the new member", |v| member_states(v).len() == members + 1).await;
        let started = http.post(first.u("/v1/cluster/rebalance")).json(&json!({})).send().await.unwrap();
        assert_eq!(started.status().as_u16(), 202, "{phase}");
        let (_, info) = get_json(&http, &first.u("/v1/cluster")).await;
        let victim = if phase == "target" { &mut joiner } else { &mut a };
        let victim_id = node_id(&info, victim).unwrap();
        victim.kill9();
        // Scans while the rebalance ends, whichever way.
        loop {
            let (status, rows, v) = scan().await;
            match status {
                200 => assert_eq!(rows.as_ref(), Some(&want), "{phase} killed: a scan while the rebalance ends"),
                503 => {}
                other => panic!("{phase}: {other} {v}"),
            }
            let (_, status) = get_json(&http, &first.u("/v1/cluster/rebalance")).await;
            if status["state"] != "running" {
                assert!(status["state"] == "done" || status["state"] == "failed", "{status}");
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        exact_eventually("after the rebalance with a dead node").await;
        let r = http.post(first.u("/v1/cluster/failover")).json(&json!({"node": victim_id})).send().await.unwrap();
        assert!(r.status().is_success() || r.status().as_u16() == 409, "failover: {}", r.text().await.unwrap_or_default());
        rebalance(&http, &first, &[victim_id]).await;
        exact_eventually("after the dead node is ejected").await;
        let (_, listed) = get_json(&http, &first.u("/v1/collections/c/indexes")).await;
        assert!(!named(&listed, victim_id), "{listed}");
        drop(joiner);
    }
    drop(b);
}

/// Issue 41: a rebalance adopts its new index copies (as files) before it names them in the
/// placement. State changes while it does — its own data waves' maps, a DDL — must not make
/// the new node drop those copies as "placed elsewhere" (and rebuild them from the streams
/// once named): every copy moves by files, none is rebuilt, and scans stay exact. The new
/// node holds each adopted copy unnamed for 4 s (fault injection), past the 2 s drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn copies_a_rebalance_adopts_are_kept_through_state_changes_until_it_names_them() {
    let (IndexCluster { first, second, a, b, join, http }, want) = indexed_cluster().await;
    let scan = || whole_scan(&http, &first);

    let joiner = fault_injected_joiner(&http, &first, &join).await;
    assert_eq!(set_faults(&http, &joiner, json!({"cut": [], "index_adopt_delay_ms": 4_000})).await, 200);
    let refused = set_faults(&http, &joiner, json!({"cut": [], "index_adopt_delay_ms": 3_600_000})).await;
    assert_eq!(refused, 400, "a delay past the bound is refused");
    // The refused call changed nothing: the 4 s delay holds.
    let started = http.post(first.u("/v1/cluster/rebalance")).json(&json!({})).send().await.unwrap();
    assert_eq!(started.status().as_u16(), 202);
    // State changes while the new node holds its adopted copies unnamed: one DDL a second.
    let mut ddl = 0;
    let status = loop {
        let (_, status) = get_json(&http, &first.u("/v1/cluster/rebalance")).await;
        if status["state"] != "running" {
            break status;
        }
        let r = http.put(first.u(&format!("/v1/collections/ddl{ddl}"))).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 201, "{}", r.text().await.unwrap_or_default());
        ddl += 1;
        let (status, rows, v) = scan().await;
        match status {
            200 => assert_eq!(rows.as_ref(), Some(&want), "a scan during the rebalance"),
            503 => {}
            other => panic!("{other} {v}"),
        }
        tokio::time::sleep(Duration::from_millis(1_000)).await;
    };
    assert_eq!(status["state"], "done", "{status}");
    assert!(ddl >= 3, "the DDLs ran while copies were held unnamed ({ddl})");
    let index_moves: Vec<&Value> = status["moves"].as_array().unwrap().iter().filter(|m| m["kind"] == "index").collect();
    assert!(!index_moves.is_empty(), "index copies moved to the new node: {status}");
    assert!(index_moves.iter().all(|m| m["method"] == "files"), "every index copy moved by files: {status}");
    // Past the drain of anything dropped by mistake, and the state that ended the rebalance
    // applied everywhere: nothing rebuilt from the streams.
    tokio::time::sleep(Duration::from_secs(3)).await;
    for node in [&first, &second, &a, &b, &joiner] {
        let rebuilt = common::metric(&http, node, "shoal_index_partitions_rebuilt_total").await.unwrap_or(0.0);
        assert_eq!(rebuilt, 0.0, "{}: index partitions rebuilt from the streams", node.addr());
    }
    let (status, rows, v) = scan().await;
    assert_eq!((status, rows.as_ref()), (200, Some(&want)), "{v}");
    let (_, listed) = get_json(&http, &first.u("/v1/collections/c/indexes")).await;
    let info = get_json(&http, &first.u("/v1/cluster")).await.1;
    let joiner_id = node_id(&info, &joiner).unwrap();
    assert!(named(&listed, joiner_id), "the new node holds copies: {listed}");
}

/// A stop asked while a rebalance's index stage runs, its data moves all done, stops it: the
/// rebalance ends `stopped` (not `done` after the index copies land), the data moves stay,
/// the index placement stays as it was, nothing is rebuilt, scans stay exact; the next
/// rebalance moves the index copies. The new node holds each adopted copy 4 s (fault
/// injection), so the stop lands while they are adopted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stop_during_the_index_stage_stops_the_rebalance_and_the_next_one_moves_the_copies() {
    let (IndexCluster { first, second, a, b, join, http }, want) = indexed_cluster().await;
    let scan = || whole_scan(&http, &first);
    let (_, listed) = get_json(&http, &first.u("/v1/collections/c/indexes")).await;
    let placement_before = listed[0]["placement"].clone();

    let joiner = fault_injected_joiner(&http, &first, &join).await;
    assert_eq!(set_faults(&http, &joiner, json!({"cut": [], "index_adopt_delay_ms": 4_000})).await, 200);
    let started = http.post(first.u("/v1/cluster/rebalance")).json(&json!({})).send().await.unwrap();
    assert_eq!(started.status().as_u16(), 202);
    // Until the data moves are done and the index copies are being adopted.
    let status = wait_for(&http, &first.u("/v1/cluster/rebalance"), "data moves done, index copies adopted", |s| {
        s["state"] != "running" || (moves_of(s, "partition").iter().all(|m| m["state"] == "done") && !moves_of(s, "index").is_empty())
    })
    .await;
    assert_eq!(status["state"], "running", "the index stage outlasts the data stage by the adoptions' 4 s: {status}");
    let r = http.delete(first.u("/v1/cluster/rebalance")).send().await.unwrap();
    assert!(r.status().is_success(), "stop: {}", r.text().await.unwrap_or_default());
    let status = scans_until_the_rebalance_ends(&http, &first, &want, "stops").await;
    assert_eq!(status["state"], "stopped", "{status}");
    assert!(moves_of(&status, "partition").iter().all(|m| m["state"] == "done"), "the data moves stay: {status}");
    let (_, listed) = get_json(&http, &first.u("/v1/collections/c/indexes")).await;
    assert_eq!(listed[0]["placement"], placement_before, "the index placement stays as it was");
    let (code, rows, v) = scan().await;
    assert_eq!((code, rows.as_ref()), (200, Some(&want)), "{v}");

    // The next rebalance moves the index copies.
    assert_eq!(set_faults(&http, &joiner, json!({"cut": []})).await, 200);
    rebalance(&http, &first, &[]).await;
    let info = get_json(&http, &first.u("/v1/cluster")).await.1;
    let joiner_id = node_id(&info, &joiner).unwrap();
    let (_, listed) = get_json(&http, &first.u("/v1/collections/c/indexes")).await;
    assert!(named(&listed, joiner_id), "the new node holds copies: {listed}");
    let (code, rows, v) = scan().await;
    assert_eq!((code, rows.as_ref()), (200, Some(&want)), "{v}");
    for node in [&first, &second, &a, &b, &joiner] {
        let rebuilt = common::metric(&http, node, "shoal_index_partitions_rebuilt_total").await.unwrap_or(0.0);
        assert_eq!(rebuilt, 0.0, "{}: index partitions rebuilt from the streams", node.addr());
    }
}

/// A failover while a rebalance's index stage runs takes the failed node's copies out of the
/// placement (its replicas serve). The stage's target was planned before: committed, it
/// would name the failed node's copies again, and their scans would go to a dead node. The
/// stage commits only over the placement it started from, so it fails instead: the
/// rebalance ends `failed`, the placement does not name the failed node, scans stay exact,
/// and the next rebalance (ejecting it) moves the copies. Found by `shoal_cluster::index_sim`.
/// The new node holds each adopted copy 12 s (fault injection), so the failover lands while
/// the stage runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failover_during_the_index_stage_fails_the_rebalance_rather_than_name_the_failed_node() {
    let (IndexCluster { first, second: _second, a: _a, mut b, join, http }, want) = indexed_cluster().await;
    let scan = || whole_scan(&http, &first);
    let joiner = fault_injected_joiner(&http, &first, &join).await;
    assert_eq!(set_faults(&http, &joiner, json!({"cut": [], "index_adopt_delay_ms": 12_000})).await, 200);
    let info = get_json(&http, &first.u("/v1/cluster")).await.1;
    let b_id = node_id(&info, &b).unwrap();
    let started = http.post(first.u("/v1/cluster/rebalance")).json(&json!({})).send().await.unwrap();
    assert_eq!(started.status().as_u16(), 202);
    wait_for(&http, &first.u("/v1/cluster/rebalance"), "index copies being adopted", |s| {
        s["state"] != "running" || !moves_of(s, "index").is_empty()
    })
    .await;
    b.kill9();
    let r = http.post(first.u("/v1/cluster/failover")).json(&json!({"node": b_id})).send().await.unwrap();
    assert!(r.status().is_success(), "failover: {}", r.text().await.unwrap_or_default());
    let (_, status) = get_json(&http, &first.u("/v1/cluster/rebalance")).await;
    assert_eq!(status["state"], "running", "the failover landed before the index stage's end: {status}");
    let (_, listed) = get_json(&http, &first.u("/v1/collections/c/indexes")).await;
    assert!(!named(&listed, b_id), "the failover took node {b_id}'s copies out: {listed}");
    let status = scans_until_the_rebalance_ends(&http, &first, &want, "ends").await;
    assert_eq!(status["state"], "failed", "{status}");
    assert!(status["message"].as_str().unwrap_or("").contains("placed anew"), "{status}");
    let (_, listed) = get_json(&http, &first.u("/v1/collections/c/indexes")).await;
    assert!(!named(&listed, b_id), "the failed node is not named again: {listed}");
    let (code, rows, v) = scan().await;
    assert_eq!((code, rows.as_ref()), (200, Some(&want)), "{v}");

    // The next rebalance, ejecting the failed node, moves the copies.
    assert_eq!(set_faults(&http, &joiner, json!({"cut": []})).await, 200);
    rebalance(&http, &first, &[b_id]).await;
    let info = get_json(&http, &first.u("/v1/cluster")).await.1;
    let (_, listed) = get_json(&http, &first.u("/v1/collections/c/indexes")).await;
    assert!(named(&listed, node_id(&info, &joiner).unwrap()), "the new node holds copies: {listed}");
    assert!(!named(&listed, b_id), "{listed}");
    let (code, rows, v) = scan().await;
    assert_eq!((code, rows.as_ref()), (200, Some(&want)), "{v}");
}
