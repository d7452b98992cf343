//! Reads in a cluster answer exactly what one node holding the same documents would, or
//! `503` with a reason — on every member, at every moment, while nodes are added and
//! removed (issue 40). A reader compares every answer with the model of what was written.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::cluster::{get_json, member_states, node_id, rebalance, wait_for, SECRET};
use common::Node;
use serde_json::{json, Value};

/// `serve` flags of these tests' nodes: analytics on (two analytics partitions), few
/// partitions so that rebalances are quick.
const ARGS: [&str; 6] = ["--cluster-secret", SECRET, "--partitions", "16", "--analytics-partitions", "2"];

fn first_node() -> Node {
    let mut node = Node::start(&ARGS);
    node.pin_port();
    node
}

fn joined(join: &str) -> Node {
    let mut node = Node::start(&[&ARGS[..], &["--join", join][..]].concat());
    node.pin_port();
    node
}

fn http() -> reqwest::Client {
    common::client_builder().timeout(Duration::from_secs(60)).build().unwrap()
}

async fn post(http: &reqwest::Client, url: String, body: Value) -> (u16, Value) {
    let r = http.post(&url).json(&body).send().await.unwrap_or_else(|e| panic!("POST {url}: {e}"));
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// [`post`] for the readers: a request that gets no answer (its node was killed under it)
/// is status 0.
async fn try_post(http: &reqwest::Client, url: String, body: Value) -> (u16, Value) {
    match http.post(&url).json(&body).send().await {
        Ok(r) => {
            let status = r.status().as_u16();
            (status, r.json().await.unwrap_or(Value::Null))
        }
        Err(_) => (0, Value::Null),
    }
}

/// Writes `n` documents `k00000`... with `g = i % 10`, `n = i` and some padding, each
/// acknowledged at `durability`.
async fn load(http: &reqwest::Client, node: &Node, n: usize, durability: &str) {
    let pad = "p".repeat(400);
    for chunk in (0..n).collect::<Vec<_>>().chunks(1_000) {
        let body: String = chunk
            .iter()
            .map(|i| json!({"op": "upsert", "key": format!("k{i:05}"), "value": {"g": i % 10, "n": i, "pad": pad}}).to_string() + "\n")
            .collect();
        let r = http.post(node.u(&format!("/v1/collections/c/_bulk?durability={durability}"))).body(body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(!r.text().await.unwrap().contains("\"error\""), "a bulk line failed");
    }
}

/// What the members hold of everything derived from the documents, summed: index entries
/// (`items` of `by_g`) and analytics rows. The index is placed on the nodes (each of its
/// partitions once, no replica), so its entries sum to the documents; each member holds
/// the analytics rows of its active and replica copies, so with one replica they sum to
/// twice the documents — unless a moved partition's rows, or a moved index partition's
/// entries, stayed behind on its old node.
async fn derived_totals(http: &reqwest::Client, nodes: &[&Node]) -> (u64, u64) {
    let (mut items, mut rows) = (0, 0);
    for node in nodes {
        let (_, list) = get_json(http, &node.u("/v1/collections/c/indexes")).await;
        items += list.as_array().and_then(|l| l.iter().find(|i| i["name"] == "by_g")).and_then(|i| i["items"].as_u64()).unwrap_or(0);
        rows += common::metric(http, node, "shoal_analytics_rows{collection=\"c\"}").await.unwrap_or(0.0) as u64;
    }
    (items, rows)
}

/// Waits until the members' derived state sums to one index entry per document and two
/// analytics rows per document (see [`derived_totals`]).
async fn derived_settles(http: &reqwest::Client, nodes: &[&Node], docs: u64, when: &str) {
    let want = (docs, 2 * docs);
    let deadline = std::time::Instant::now() + common::cluster::WAIT_MAX;
    loop {
        let totals = derived_totals(http, nodes).await;
        if totals == want {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "{when}: index entries and analytics rows {totals:?}, want {want:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What the reader saw.
#[derive(Default)]
struct Tally {
    exact: AtomicUsize,
    refused: AtomicUsize,
    wrong: Mutex<Vec<String>>,
    /// The first refusals' reasons.
    reasons: Mutex<Vec<String>>,
}

impl Tally {
    fn judge(&self, what: &str, url: &str, status: u16, body: &Value, right: bool) {
        match status {
            200 if right => {
                self.exact.fetch_add(1, Ordering::Relaxed);
            }
            // 503, or no answer at all from a node killed under the request: never a
            // wrong answer.
            503 | 0 => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                let mut reasons = self.reasons.lock().unwrap();
                if reasons.len() < 20 {
                    reasons.push(format!("{what} through {url}: {status} {}", body["reason"]));
                }
            }
            _ => {
                // The answer in short: its rows' count, or its first bytes.
                let rows = body["rows"].as_array().map(Vec::len);
                let text: String = body.to_string().chars().take(300).collect();
                let answer = rows.map_or(text, |n| format!("{n} rows"));
                self.wrong.lock().unwrap().push(format!("{what} through {url}: {status}, {answer}"));
            }
        }
    }
}

/// Asks every read of the model once through `url`: SQL counts, a point read and an indexed
/// count, an index scan, an analytics count.
async fn read_once(http: &reqwest::Client, url: &str, docs: usize, tally: &Tally) {
    let sql = |path: &'static str, statement: &'static str| {
        let (http, url) = (http.clone(), format!("{url}{path}"));
        async move { try_post(&http, url, json!({ "sql": statement })).await }
    };
    let (s, v) = sql("/v1/query", "SELECT count(*) FROM c").await;
    tally.judge("SQL count", url, s, &v, v["rows"] == json!([[docs]]));
    let (s, v) = sql("/v1/query", "SELECT n FROM c WHERE meta_id = 'k00500'").await;
    tally.judge("SQL point read", url, s, &v, v["rows"] == json!([[500]]));
    let (s, v) = sql("/v1/query", "SELECT count(*) FROM c WHERE g = 7").await;
    tally.judge("SQL indexed count", url, s, &v, v["rows"] == json!([[docs / 10]]));
    let (s, v) = try_post(http, format!("{url}/v1/collections/c/indexes/by_g/scan"), json!({"eq": [3], "limit": docs})).await;
    tally.judge("index scan", url, s, &v, v["rows"].as_array().is_some_and(|r| r.len() == docs / 10));
    let (s, v) = sql("/v1/analytics", "SELECT count(*) FROM c").await;
    tally.judge("analytics count", url, s, &v, v["rows"] == json!([[docs]]));
    // Distributed over the members' shadows: each member's share once, whole.
    let m = docs / 10;
    let groups: Vec<Value> = (0..10).map(|g| json!([g, m, 10 * (m * (m - 1) / 2) + g * m])).collect();
    let (s, v) = sql("/v1/analytics", "SELECT g, count(*), sum(n) FROM c GROUP BY g ORDER BY g").await;
    tally.judge("analytics groups", url, s, &v, v["rows"] == json!(groups));
    // A change feed from the start names every document once (they were written once);
    // a member's refusal comes as an error line of the stream.
    let (s, lines) = match http.get(format!("{url}/v1/collections/c/changes?limit={}", docs * 2)).send().await {
        Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
        Err(_) => (0, String::new()),
    };
    let lines: Vec<Value> = lines.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let refusal = lines.iter().find(|l| l.get("error").is_some()).cloned();
    let keys: Vec<&str> = lines.iter().filter_map(|l| l["key"].as_str()).collect();
    let unique: std::collections::HashSet<&str> = keys.iter().copied().collect();
    let summary = json!({"changes": keys.len(), "keys": unique.len(), "reason": refusal.as_ref().map(|r| r["reason"].clone())});
    let status = if refusal.is_some() { 503 } else { s };
    tally.judge("change feed", url, status, &summary, keys.len() == docs && unique.len() == docs);
}

/// Stops the readers, prints their tally and checks it holds no wrong answer; answers the
/// exact reads.
async fn stop_readers(readers: Vec<tokio::task::JoinHandle<()>>, stop: &AtomicBool, tally: &Tally) -> usize {
    stop.store(true, Ordering::Relaxed);
    for reading in readers {
        reading.await.unwrap();
    }
    let wrong = tally.wrong.lock().unwrap().clone();
    let (exact, refused) = (tally.exact.load(Ordering::Relaxed), tally.refused.load(Ordering::Relaxed));
    eprintln!("reads: {exact} exact, {refused} refused, {} wrong; first refusals: {:#?}", wrong.len(), tally.reasons.lock().unwrap());
    assert!(
        wrong.is_empty(),
        "{} wrong answers (of {}), first: {:#?}",
        wrong.len(),
        exact + refused + wrong.len(),
        &wrong[..wrong.len().min(8)]
    );
    exact
}

/// Once all is still, every member answers every read, and exactly: a refusal (a lease
/// that lapsed on a starved machine, say) may be met on the way, never a wrong answer, and
/// not for good — a two-node cluster refused every SQL point read, for as long as it ran
/// (the statement ran over the node's replicas).
async fn answers_settle(http: &reqwest::Client, nodes: &[&Node], docs: usize, when: &str) {
    let deadline = std::time::Instant::now() + common::cluster::WAIT_MAX;
    for node in nodes {
        loop {
            let still = Tally::default();
            read_once(http, &node.url, docs, &still).await;
            let wrong = still.wrong.lock().unwrap().clone();
            assert!(wrong.is_empty(), "{when}: {wrong:#?}");
            let refused = still.reasons.lock().unwrap().clone();
            if refused.is_empty() {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{when}: still refused: {refused:#?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Reads through the members in `urls`, round and round, until `stop`.
fn reader(urls: Arc<Mutex<Vec<String>>>, docs: usize, stop: Arc<AtomicBool>, tally: Arc<Tally>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let http = http();
        let mut i = rand::random::<u32>() as usize;
        while !stop.load(Ordering::Relaxed) {
            let url = {
                let urls = urls.lock().unwrap();
                urls[i % urls.len()].clone()
            };
            i += 1;
            read_once(&http, &url, docs, &tally).await;
        }
    })
}

/// 1 → 2 → 3 nodes, a swap, then 3 → 2, under readers: every answer of every member is the
/// model's, or a refusal. Before, a count answered a third of the documents with 200 while a node was
/// added, index scans came back short, and a two-node cluster refused every SQL point read.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reads_stay_exact_on_every_member_while_nodes_are_added_and_removed() {
    const DOCS: usize = 4_000;
    const READERS: usize = 3;
    let http = http();
    let first = first_node();
    assert_eq!(http.put(first.u("/v1/collections/c")).send().await.unwrap().status(), 201);
    let (s, v) = post(&http, first.u("/v1/collections/c/indexes"), json!({"name": "by_g", "keys": ["g"]})).await;
    assert_eq!(s, 201, "{v}");
    load(&http, &first, DOCS, "persist").await;
    // Everything derived from the documents has caught up before the reader starts.
    let (s, v) =
        post(&http, first.u("/v1/collections/c/indexes/by_g/scan"), json!({"eq": [3], "limit": DOCS, "consistency": "request_plus"})).await;
    assert_eq!((s, v["rows"].as_array().map(Vec::len)), (200, Some(DOCS / 10)), "{v}");
    let (s, v) = post(&http, first.u("/v1/analytics"), json!({"sql": "SELECT count(*) FROM c", "consistency": "request_plus"})).await;
    assert_eq!((s, &v["rows"]), (200, &json!([[DOCS]])), "{v}");

    // Paced, so that the moves take a few seconds each and the readers meet them midway.
    let r = http
        .put(first.u("/v1/cluster/settings"))
        .json(&json!({"rebalance_mb_per_s": 1, "rebalance_moves_per_node": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());

    let urls = Arc::new(Mutex::new(vec![first.url.clone()]));
    let (stop, tally) = (Arc::new(AtomicBool::new(false)), Arc::new(Tally::default()));
    let readers: Vec<_> = (0..READERS).map(|_| reader(Arc::clone(&urls), DOCS, Arc::clone(&stop), Arc::clone(&tally))).collect();

    let join = first.addr();
    let second = joined(&join);
    wait_for(&http, &first.u("/v1/cluster"), "two members", |v| member_states(v).len() == 2).await;
    urls.lock().unwrap().push(second.url.clone());
    rebalance(&http, &first, &[]).await;
    let after_add = tally.exact.load(Ordering::Relaxed);

    let third = joined(&join);
    wait_for(&http, &first.u("/v1/cluster"), "three members", |v| member_states(v).len() == 3).await;
    urls.lock().unwrap().push(third.url.clone());
    rebalance(&http, &first, &[]).await;
    // Index entries and analytics rows left with their partitions: nothing leaked.
    derived_settles(&http, &[&first, &second, &third], DOCS as u64, "after 2 -> 3").await;

    // A swap: a fourth comes in as the second leaves (no more reads through a node once it
    // is being ejected).
    let fourth = joined(&join);
    wait_for(&http, &first.u("/v1/cluster"), "four members", |v| member_states(v).len() == 4).await;
    let (_, info) = get_json(&http, &first.u("/v1/cluster")).await;
    let (second_id, third_id) = (node_id(&info, &second).unwrap(), node_id(&info, &third).unwrap());
    {
        let mut urls = urls.lock().unwrap();
        urls.retain(|u| *u != second.url);
        urls.push(fourth.url.clone());
    }
    rebalance(&http, &first, &[second_id]).await;
    derived_settles(&http, &[&first, &second, &third, &fourth], DOCS as u64, "after the swap").await;
    // 3 -> 2: the third leaves.
    urls.lock().unwrap().retain(|u| *u != third.url);
    rebalance(&http, &first, &[third_id]).await;

    let exact = stop_readers(readers, &stop, &tally).await;
    // Once all is still, every member answers every read, and exactly.
    derived_settles(&http, &[&first, &second, &third, &fourth], DOCS as u64, "after 3 -> 2").await;
    answers_settle(&http, &[&first, &fourth], DOCS, "after the rebalances").await;
    assert!(after_add > 0, "the reader read while the first node was added");
    assert!(exact > after_add, "the reader read after the first rebalance too");
}

/// `POST .../indexes/_build` on one member builds the indexes on every member, and on
/// members that join later (Couchbase's `BUILD INDEX`); before, they stayed deferred on
/// every other node and every scan of them, on any node, answered 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_build_on_one_member_builds_the_indexes_on_every_member_and_on_later_ones() {
    const DOCS: usize = 500;
    let http = http();
    let first = first_node();
    let join = first.addr();
    let second = joined(&join);
    wait_for(&http, &first.u("/v1/cluster"), "two members", |v| member_states(v).len() == 2).await;
    assert_eq!(http.put(first.u("/v1/collections/c")).send().await.unwrap().status(), 201);
    rebalance(&http, &first, &[]).await;
    load(&http, &first, DOCS, "persist").await;
    for name in ["a", "b", "later"] {
        let (s, v) = post(&http, first.u("/v1/collections/c/indexes"), json!({"name": name, "keys": ["g"], "defer_build": true})).await;
        assert_eq!(s, 201, "{v}");
    }
    let (s, v) = post(&http, second.u("/v1/collections/c/indexes/_build"), json!({"names": ["a", "b"]})).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = post(&http, first.u("/v1/collections/c/indexes/_build"), json!({"names": ["a", "nope"]})).await;
    assert_eq!(s, 404, "a build naming an unknown index is refused whole: {v}");

    let third = joined(&join);
    wait_for(&http, &first.u("/v1/cluster"), "three members", |v| member_states(v).len() == 3).await;
    rebalance(&http, &first, &[]).await;
    for node in [&first, &second, &third] {
        let states = wait_for(&http, &node.u("/v1/collections/c/indexes"), "the built indexes ready", |v| {
            v.as_array().is_some_and(|l| l.iter().filter(|i| i["name"] != "later").all(|i| i["state"] == "ready"))
        })
        .await;
        let later = states.as_array().unwrap().iter().find(|i| i["name"] == "later").cloned().unwrap_or_default();
        assert_eq!(later["state"], "deferred", "an index nobody built stays deferred on {}: {states}", node.url);
        for name in ["a", "b"] {
            let (s, v) =
                post(&http, node.u(&format!("/v1/collections/c/indexes/{name}/scan")), json!({"eq": [3], "consistency": "request_plus"}))
                    .await;
            assert_eq!((s, v["rows"].as_array().map(Vec::len)), (200, Some(DOCS / 10)), "{name} through {}: {v}", node.url);
        }
    }
    // The single-index form goes through the cluster too.
    let (s, v) = post(&http, third.u("/v1/collections/c/indexes/later/build"), json!({})).await;
    assert_eq!(s, 200, "{v}");
    for node in [&first, &second, &third] {
        wait_for(&http, &node.u("/v1/collections/c/indexes"), "the late build everywhere", |v| {
            v.as_array().is_some_and(|l| l.iter().all(|i| i["state"] == "ready"))
        })
        .await;
    }
}

/// A member killed with `kill -9`, failed over, restarted, recovered and rebalanced back in,
/// under readers: every answer through the members is the model's, or a refusal. The
/// documents are acknowledged at `majority`, so a failover keeps every one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reads_stay_exact_through_a_failover_and_a_recovery() {
    const DOCS: usize = 3_000;
    const READERS: usize = 2;
    let http = http();
    let first = first_node();
    let join = first.addr();
    let mut nodes = vec![first, joined(&join), joined(&join)];
    wait_for(&http, &nodes[0].u("/v1/cluster"), "three members", |v| member_states(v).len() == 3).await;
    assert_eq!(http.put(nodes[0].u("/v1/collections/c")).send().await.unwrap().status(), 201);
    let (s, v) = post(&http, nodes[0].u("/v1/collections/c/indexes"), json!({"name": "by_g", "keys": ["g"]})).await;
    assert_eq!(s, 201, "{v}");
    rebalance(&http, &nodes[0], &[]).await;
    load(&http, &nodes[0], DOCS, "majority").await;
    for node in &nodes {
        let (s, v) =
            post(&http, node.u("/v1/collections/c/indexes/by_g/scan"), json!({"eq": [3], "limit": DOCS, "consistency": "request_plus"}))
                .await;
        assert_eq!((s, v["rows"].as_array().map(Vec::len)), (200, Some(DOCS / 10)), "{v}");
    }

    let urls = Arc::new(Mutex::new(nodes.iter().map(|n| n.url.clone()).collect::<Vec<_>>()));
    let (stop, tally) = (Arc::new(AtomicBool::new(false)), Arc::new(Tally::default()));
    let readers: Vec<_> = (0..READERS).map(|_| reader(Arc::clone(&urls), DOCS, Arc::clone(&stop), Arc::clone(&tally))).collect();

    // The readers read exactly before the fault.
    common::eventually(60, "a first exact read", || {
        let tally = Arc::clone(&tally);
        async move { tally.exact.load(Ordering::Relaxed) > 0 }
    })
    .await;
    // kill -9 a member that is not the metadata leader; it is failed over automatically.
    let (_, info) = get_json(&http, &nodes[0].u("/v1/cluster")).await;
    let leader = info["leader"].as_u64().unwrap();
    let victim = (0..3).find(|&i| node_id(&info, &nodes[i]) != Some(leader)).unwrap();
    let victim_id = node_id(&info, &nodes[victim]).unwrap();
    let survivor = (0..3).find(|&i| i != victim).unwrap();
    urls.lock().unwrap().retain(|u| *u != nodes[victim].url);
    nodes[victim].kill9();
    wait_for(&http, &nodes[survivor].u("/v1/cluster"), "automatic failover", |v| {
        v["nodes"].as_array().is_some_and(|a| a.iter().any(|n| n["id"].as_u64() == Some(victim_id) && n["state"] == "failed"))
    })
    .await;
    let after_failover = tally.exact.load(Ordering::Relaxed);
    // Back: restarted, recovered, rebalanced in.
    nodes[victim].restart();
    let r = http.post(nodes[survivor].u("/v1/cluster/recover")).json(&json!({"node": victim_id})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200, "{}", r.text().await.unwrap_or_default());
    common::cluster::rebalance_when_possible(&http, &nodes[survivor], &[]).await;
    urls.lock().unwrap().push(nodes[victim].url.clone());
    derived_settles(&http, &[&nodes[0], &nodes[1], &nodes[2]], DOCS as u64, "after the recovery").await;
    let exact = stop_readers(readers, &stop, &tally).await;
    answers_settle(&http, &[&nodes[0], &nodes[1], &nodes[2]], DOCS, "after the recovery").await;
    assert!(after_failover > 0 && exact > after_failover, "the readers read before and after the failover");
}
