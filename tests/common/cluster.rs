//! A cluster of real nodes for tests: start, wait, rebalance.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::Node;

pub const SECRET: &str = "test-cluster-secret";
/// Partitions of a test cluster: few, so that rebalances and failovers are quick.
pub const PARTITIONS: &str = "16";
/// Liveness bound of every wait below (not a timing assertion: a failing wait means the
/// cluster never got there).
pub const WAIT_MAX: Duration = Duration::from_secs(90);

fn base_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["--cluster-secret", SECRET, "--partitions", PARTITIONS];
    // Analytics off (its shadows cost CPU) unless the test turns it on.
    if !extra.contains(&"--analytics-partitions") {
        args.extend_from_slice(&["--analytics-partitions", "0"]);
    }
    args.extend_from_slice(extra);
    args
}

/// Starts `n` nodes: the first founds the cluster, the others join it.
pub fn start_cluster(n: usize, extra: &[&str]) -> Vec<Node> {
    let mut first = Node::start(&base_args(extra));
    first.pin_port();
    let join = first.addr();
    let mut nodes = vec![first];
    for _ in 1..n {
        let mut args = base_args(extra);
        args.extend_from_slice(&["--join", &join]);
        let mut node = Node::start(&args);
        node.pin_port();
        nodes.push(node);
    }
    nodes
}

pub async fn get_json(http: &reqwest::Client, url: &str) -> (u16, Value) {
    let r = http.get(url).send().await.unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Waits until `done` holds for `GET url`, and answers the last body.
pub async fn wait_for(http: &reqwest::Client, url: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + WAIT_MAX;
    loop {
        if let Ok(r) = http.get(url).timeout(Duration::from_secs(5)).send().await {
            if let Ok(v) = r.json::<Value>().await {
                if done(&v) {
                    return v;
                }
                if Instant::now() > deadline {
                    panic!("{what}: never happened; last answer {v}");
                }
            }
        }
        assert!(Instant::now() < deadline, "{what}: never happened");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub fn member_states(cluster: &Value) -> Vec<String> {
    cluster["nodes"].as_array().map(|a| a.iter().map(|n| n["state"].as_str().unwrap_or("").to_string()).collect()).unwrap_or_default()
}

/// Starts a rebalance through `node` and waits until it is done.
/// The status's `elapsed_s` is the leader's measure of it: more than nothing, and within the
/// time from the ask to the answer that it was done.
pub async fn rebalance(http: &reqwest::Client, node: &Node, eject: &[u64]) {
    let asked = Instant::now();
    let r = http.post(node.u("/v1/cluster/rebalance")).json(&json!({"eject": eject})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 202, "rebalance: {}", r.text().await.unwrap_or_default());
    let status = wait_for(http, &node.u("/v1/cluster/rebalance"), "rebalance done", |v| v["state"] != "running").await;
    assert_eq!(status["state"], "done", "{status}");
    let elapsed = status["elapsed_s"].as_f64().unwrap_or(0.0);
    assert!(elapsed > 0.0 && elapsed <= asked.elapsed().as_secs_f64(), "elapsed_s {elapsed} against {:?}: {status}", asked.elapsed());
}

/// The node id of `node` as `GET /v1/cluster` lists it.
pub fn node_id(info: &Value, node: &Node) -> Option<u64> {
    info["nodes"].as_array()?.iter().find(|n| n["address"] == node.addr()).and_then(|n| n["id"].as_u64())
}

/// A rebalance after a fault; a node still catching up can make the first attempts fail
/// (a hand-over times out), and on two shared cores a member starved meanwhile may be
/// failed over, so failed members (but those in `dead`, known not to come back) are
/// recovered and the rebalance tried again until one completes. Answers the members it
/// recovered.
pub async fn rebalance_when_possible(http: &reqwest::Client, node: &Node, dead: &[u64]) -> Vec<u64> {
    let deadline = Instant::now() + WAIT_MAX;
    let mut recovered = Vec::new();
    loop {
        let (_, info) = get_json(http, &node.u("/v1/cluster")).await;
        let failed: Vec<u64> = info["nodes"]
            .as_array()
            .map(|a| a.iter().filter(|n| n["state"] == "failed").filter_map(|n| n["id"].as_u64()).collect())
            .unwrap_or_default();
        for id in failed.into_iter().filter(|id| !dead.contains(id)) {
            let r = http.post(node.u("/v1/cluster/recover")).json(&json!({ "node": id })).send().await.unwrap();
            if r.status().is_success() {
                recovered.push(id);
            }
        }
        let r = http.post(node.u("/v1/cluster/rebalance")).json(&json!({})).send().await.unwrap();
        if r.status().as_u16() == 202 {
            let status = wait_for(http, &node.u("/v1/cluster/rebalance"), "rebalance", |v| v["state"] != "running").await;
            if status["state"] == "done" {
                return recovered;
            }
        }
        assert!(Instant::now() < deadline, "no rebalance succeeded after a fault");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A node started with `args` that joins the cluster at `join`, on a port it keeps across
/// restarts.
pub fn joined(args: &[&str], join: &str) -> Node {
    let mut node = Node::start(&[args, &["--join", join][..]].concat());
    node.pin_port();
    node
}

/// `serve` flags of an index node (the index service without data) of a test cluster.
pub fn index_node_args() -> Vec<&'static str> {
    base_args(&["--services", "index,query"])
}

/// `serve` flags of a data node without the index service of a test cluster.
pub fn data_node_args() -> Vec<&'static str> {
    base_args(&["--services", "data,query"])
}

/// The index service's test shape: two data nodes and two index nodes, rebalanced in, with
/// collection `c`.
pub struct IndexCluster {
    pub first: Node,
    pub second: Node,
    pub a: Node,
    pub b: Node,
    /// Where more nodes join.
    pub join: String,
    pub http: reqwest::Client,
}

pub async fn index_cluster() -> IndexCluster {
    let mut first = Node::start(&data_node_args());
    first.pin_port();
    let join = first.addr();
    let second = joined(&data_node_args(), &join);
    let a = joined(&index_node_args(), &join);
    let b = joined(&index_node_args(), &join);
    let http = super::client_builder().timeout(Duration::from_secs(60)).build().unwrap();
    wait_for(&http, &first.u("/v1/cluster"), "four members", |v| member_states(v).len() == 4).await;
    rebalance(&http, &first, &[]).await;
    assert_eq!(http.put(first.u("/v1/collections/c")).send().await.unwrap().status(), 201);
    IndexCluster { first, second, a, b, join, http }
}
