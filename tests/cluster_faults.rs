//! The cluster under faults, checked by Porcupine (github.com/anishathalye/porcupine):
//! concurrent clients do `majority` writes, compare-and-swaps, deletes and `majority` reads on
//! a few hot keys through every node, while nodes are killed with `kill -9` and restarted,
//! paused with SIGSTOP and resumed, or cut off from the others by a network partition (the
//! transport's switchable fault layer, `serve --fault-injection`) and healed — each fault
//! followed by automatic failover when the node stays away, recovery and a rebalance. Every history must be linearizable, so no
//! acknowledged majority write is lost and no read sees a deposed copy. Every node runs the
//! index service, and an index with a replica is placed on them through all of it (fed from
//! the actives, repaired by the failovers, moved by the rebalances); at the end a
//! `request_plus` scan through every node must answer what majority reads of the documents do.
//!
//! A second test runs the same clients through moves by files (a rebalance that grows the
//! cluster, then one that sheds a node), so the copies' snapshot, catch-up and hand-over
//! are checked by Porcupine too.
//!
//! The faults' cluster runs as a deployment would (issue 43): users on, and TLS between
//! clients and members and among members (`SHOAL_FAULT_TLS=0` runs it in plain HTTP).
//!
//! `cargo test` runs the short version (3 nodes, a few faults). The long run is
//! `scripts/cluster-faults.sh` (README), which sets `SHOAL_FAULT_NODES`, `SHOAL_FAULT_ROUNDS`
//! and `SHOAL_FAULT_REPORT` for this same test.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::cluster::{get_json, member_states, node_id, rebalance, start_cluster, wait_for};
use common::history::{check, run_client, History, Target, Workload};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

const CLIENTS: usize = 6;
const KEYS: usize = 6;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    Kill,
    /// Paused shorter than the failover timeout: it must come back on its own.
    ShortPause,
    /// Paused longer: it is failed over while paused, and must not serve when resumed.
    LongPause,
    /// Cut off from every other member (both ways) shorter than the failover timeout.
    ShortPartition,
    /// Cut off until it is failed over; it keeps running and must not serve meanwhile.
    LongPartition,
}

/// Cuts `node` off from the members at `addresses` (empty heals), through the transport's
/// fault layer.
async fn cut(http: &reqwest::Client, node: &common::Node, addresses: Vec<String>) {
    let r = http
        .post(node.u("/v1/_internal/faults"))
        .header("x-shoal-cluster-secret", common::cluster::SECRET)
        .json(&json!({ "cut": addresses }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "{}", r.text().await.unwrap_or_default());
}

/// A network partition between `victim` and the rest, both ways (`heal` undoes it).
async fn partition(http: &reqwest::Client, nodes: &[common::Node], victim: usize, heal: bool) {
    for (i, n) in nodes.iter().enumerate() {
        let addresses: Vec<String> = match (heal, i == victim) {
            (true, _) => Vec::new(),
            (false, true) => nodes.iter().enumerate().filter(|(j, _)| *j != victim).map(|(_, m)| m.addr()).collect(),
            (false, false) => vec![nodes[victim].addr()],
        };
        cut(http, n, addresses).await;
    }
}

/// Client `i`: majority operations on the hot keys through `target` and `others`, in
/// 2-second slices (each its own seed from `seed_base`) until `stop`, so that the load spans
/// every fault and move.
fn spawn_client(
    i: usize,
    target: Target,
    others: Vec<String>,
    seed_base: u64,
    history: Arc<History>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut slice = 0u64;
        while !stop.load(std::sync::atomic::Ordering::Acquire) {
            let w = Workload {
                collection: "lin",
                keys: KEYS,
                write_params: "?durability=majority",
                read_params: "?consistency=majority",
                others: &others,
                until: Instant::now() + Duration::from_secs(2),
            };
            run_client(Arc::clone(&target), &w, i, seed_base + i as u64 * 100 + slice, &history).await;
            slice += 1;
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cluster_under_kills_pauses_and_partitions_stays_linearizable_for_majority_operations() {
    let nodes_n = env_or("SHOAL_FAULT_NODES", 3);
    let rounds = env_or("SHOAL_FAULT_ROUNDS", 5);
    let seed = env_or("SHOAL_FAULT_SEED", 7) as u64;
    // Every how many faults the victim is the metadata leader (0: victims drawn at random);
    // the others are drawn at random.
    let leader_every = env_or("SHOAL_FAULT_LEADER_EVERY", 2);
    let mut args = vec!["--fault-injection"];
    if env_or("SHOAL_FAULT_TLS", 1) == 1 {
        args.extend(common::tls_flags());
    }
    let mut nodes = start_cluster(nodes_n, &args);
    // A member's certificate: the fault switches are calls between members.
    let http = common::member_client_builder().timeout(Duration::from_secs(30)).build().unwrap();
    wait_for(&http, &nodes[0].u("/v1/cluster"), "members", |v| member_states(v).len() == nodes_n).await;
    let failover_timeout_s = env_or("SHOAL_FAULT_TIMEOUT_S", 2);
    let r =
        http.put(nodes[0].u("/v1/cluster/settings")).json(&json!({"auto_failover_timeout_s": failover_timeout_s})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(http.put(nodes[0].u("/v1/collections/lin")).send().await.unwrap().status().as_u16(), 201);
    // Every node runs the index service (the default): the index is placed on them, fed
    // from the actives through every fault, repaired by the failovers and moved by the
    // rebalances; at the end it must answer exactly what the documents hold.
    rebalance(&http, &nodes[0], &[]).await;
    let r = http
        .post(nodes[0].u("/v1/collections/lin/indexes"))
        .json(&json!({"name": "by_v", "keys": ["v"], "replicas": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201, "{}", r.text().await.unwrap_or_default());

    let history = Arc::new(History::default());
    let urls: Vec<String> = nodes.iter().map(|n| n.url.clone()).collect();
    let target: Target = Arc::new(std::sync::RwLock::new(urls[0].clone()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = Vec::new();
    for i in 0..CLIENTS {
        clients.push(spawn_client(i, Arc::clone(&target), urls.clone(), seed * 1000, Arc::clone(&history), Arc::clone(&stop)));
    }

    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut failovers: Vec<(Duration, bool)> = Vec::new();
    let mut collateral: Vec<String> = Vec::new();
    let mut faults = Vec::new();
    tokio::time::sleep(Duration::from_secs(2)).await;
    for round in 0..rounds {
        let fault = match round % 5 {
            0 => Fault::Kill,
            1 => Fault::LongPartition,
            2 => Fault::ShortPause,
            3 => Fault::LongPause,
            _ => Fault::ShortPartition,
        };
        let mut victim = rng.random_range(0..nodes_n);
        let (_, mut info) = get_json(&http, &nodes[(victim + 1) % nodes_n].u("/v1/cluster")).await;
        if leader_every > 0 && round % leader_every == 0 {
            if let Some(i) =
                (0..nodes_n).find(|&i| node_id(&info, &nodes[i]).is_some() && node_id(&info, &nodes[i]) == info["leader"].as_u64())
            {
                victim = i;
                info = get_json(&http, &nodes[(victim + 1) % nodes_n].u("/v1/cluster")).await.1;
            }
        }
        let victim_id = node_id(&info, &nodes[victim]).expect("victim id");
        let watcher = (victim + 1) % nodes_n;
        let is_failed = |v: &Value| {
            v["nodes"].as_array().is_some_and(|a| a.iter().any(|n| n["id"].as_u64() == Some(victim_id) && n["state"] == "failed"))
        };
        let was_leader = info["leader"].as_u64() == Some(victim_id);
        // Failed over = its partitions served again: the map shows none active on it.
        let promoted = |v: &Value| v["partitions"].as_array().is_some_and(|ps| ps.iter().all(|p| p["active"].as_u64() != Some(victim_id)));
        let started = Instant::now();
        match fault {
            Fault::Kill => {
                nodes[victim].kill9();
                wait_for(&http, &nodes[watcher].u("/v1/cluster"), "failover after kill -9", is_failed).await;
                wait_for(&http, &nodes[watcher].u("/v1/cluster/map"), "promotion", promoted).await;
                failovers.push((started.elapsed(), was_leader));
                tokio::time::sleep(Duration::from_millis(rng.random_range(0..1500))).await;
                nodes[victim].restart();
            }
            Fault::ShortPause => {
                nodes[victim].signal(libc::SIGSTOP);
                tokio::time::sleep(Duration::from_millis(rng.random_range(300..1200))).await;
                nodes[victim].signal(libc::SIGCONT);
            }
            Fault::LongPause => {
                nodes[victim].signal(libc::SIGSTOP);
                wait_for(&http, &nodes[watcher].u("/v1/cluster"), "failover of a paused node", is_failed).await;
                wait_for(&http, &nodes[watcher].u("/v1/cluster/map"), "promotion", promoted).await;
                failovers.push((started.elapsed(), was_leader));
                tokio::time::sleep(Duration::from_millis(rng.random_range(0..1500))).await;
                nodes[victim].signal(libc::SIGCONT);
            }
            Fault::ShortPartition => {
                partition(&http, &nodes, victim, false).await;
                tokio::time::sleep(Duration::from_millis(rng.random_range(300..1200))).await;
                partition(&http, &nodes, victim, true).await;
            }
            Fault::LongPartition => {
                partition(&http, &nodes, victim, false).await;
                wait_for(&http, &nodes[watcher].u("/v1/cluster"), "failover of a cut-off node", is_failed).await;
                wait_for(&http, &nodes[watcher].u("/v1/cluster/map"), "promotion", promoted).await;
                failovers.push((started.elapsed(), was_leader));
                tokio::time::sleep(Duration::from_millis(rng.random_range(0..1500))).await;
                partition(&http, &nodes, victim, true).await;
            }
        }
        faults.push(format!("{fault:?} n{victim_id}"));
        // Bring the cluster back to full strength: recover a failed-over node, rebalance.
        // Every failed member, not only the victim: on two shared cores a member starved
        // during a fault may be failed over too (counted, and recovered like the victim).
        // Such a failover comes at most the auto-failover timeout after the silence that
        // caused it, so the look waits that out: one decided just after the look used up
        // the automatic failovers, and the next fault's victim was never failed over.
        tokio::time::sleep(Duration::from_secs(failover_timeout_s as u64 + 1)).await;
        let (_, info) = get_json(&http, &nodes[watcher].u("/v1/cluster")).await;
        let failed: Vec<u64> = info["nodes"]
            .as_array()
            .map(|a| a.iter().filter(|n| n["state"] == "failed").filter_map(|n| n["id"].as_u64()).collect())
            .unwrap_or_default();
        for id in failed {
            if id != victim_id {
                collateral.push(format!("n{id} during {fault:?} n{victim_id}"));
            }
            let deadline = Instant::now() + common::cluster::WAIT_MAX;
            loop {
                let r = http.post(nodes[watcher].u("/v1/cluster/recover")).json(&json!({ "node": id })).send().await.unwrap();
                if r.status().is_success() {
                    break;
                }
                assert!(Instant::now() < deadline, "recover never succeeded: {}", r.text().await.unwrap_or_default());
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        for id in common::cluster::rebalance_when_possible(&http, &nodes[watcher], &[]).await {
            collateral.push(format!("n{id} after {fault:?} n{victim_id}"));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, std::sync::atomic::Ordering::Release);
    for c in clients {
        c.await.unwrap();
    }

    let records = history.records();
    let acked = records.iter().filter(|r| r["kind"] != "get" && r["outcome"] == "ok").count();
    let reads = records.iter().filter(|r| r["kind"] == "get").count();
    assert!(acked > 50 && reads > 50, "too little happened to check: {acked} acknowledged writes, {reads} reads");
    let (ok, out) = check(&history.lines());
    // From the fault to the map promoting its partitions elsewhere, p50 and max; a killed
    // metadata leader adds an election first, so those are counted apart.
    let spread = |leader: Option<bool>| {
        let mut d: Vec<Duration> = failovers.iter().filter(|(_, l)| leader.is_none_or(|want| *l == want)).map(|(d, _)| *d).collect();
        d.sort();
        let p50 = d.get(d.len() / 2).copied().unwrap_or_default();
        format!("{} (p50 {:.2} s, max {:.2} s)", d.len(), p50.as_secs_f64(), d.last().copied().unwrap_or_default().as_secs_f64())
    };
    let summary = format!(
        "nodes {nodes_n}, faults {} ({}), operations {}, acknowledged writes {acked}, reads {reads}; failovers, fault to promotion: all {}, of members {}, of the metadata leader {} (auto-failover timeout {failover_timeout_s} s); members failed over besides the victims: {} ({}); linearizable: {ok}",
        faults.len(),
        faults.join(", "),
        records.len(),
        spread(None),
        spread(Some(false)),
        spread(Some(true)),
        collateral.len(),
        collateral.join(", "),
    );
    eprintln!("{summary}");
    if let Ok(path) = std::env::var("SHOAL_FAULT_REPORT") {
        std::fs::write(&path, format!("{summary}\n")).unwrap();
        std::fs::write(format!("{path}.history.ndjson"), history.lines()).unwrap();
    }
    assert!(ok, "Porcupine found the cluster's history not linearizable:\n{out}");
    index_answers_what_the_documents_hold(&http, &nodes).await;
}

/// After the faults: a `request_plus` scan of `by_v` through every node answers the hot
/// keys' documents as majority reads find them (a 503 while a part catches up is asked
/// again; a short or stale answer is a failure).
async fn index_answers_what_the_documents_hold(http: &reqwest::Client, nodes: &[common::Node]) {
    // One write just before the scans, which `request_plus` must see.
    let r =
        http.put(nodes[1].u("/v1/collections/lin/docs/last?durability=majority")).json(&json!({"v": "written last"})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200, "{}", r.text().await.unwrap_or_default());
    let mut want: Vec<(String, String)> = vec![("written last".into(), "last".into())];
    for k in 0..KEYS {
        let url = nodes[0].u(&format!("/v1/collections/lin/docs/k{k}?consistency=majority"));
        let (status, doc) = get_json(http, &url).await;
        match status {
            200 => want.push((doc["v"].as_str().expect("a string value").to_string(), format!("k{k}"))),
            404 => {}
            other => panic!("k{k}: {other} {doc}"),
        }
    }
    want.sort();
    for node in nodes {
        let deadline = Instant::now() + common::cluster::WAIT_MAX;
        loop {
            let r = http
                .post(node.u("/v1/collections/lin/indexes/by_v/scan"))
                .json(&json!({"consistency": "request_plus", "timeout_ms": 30_000}))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let v: Value = r.json().await.unwrap_or(Value::Null);
            if status == 200 {
                let rows: Vec<(String, String)> = v["rows"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|r| (r["key"][0].as_str().unwrap().to_string(), r["id"].as_str().unwrap().to_string()))
                    .collect();
                assert_eq!(rows, want, "by_v from {} after the faults", node.addr());
                break;
            }
            assert_eq!(status, 503, "by_v from {}: {v}", node.addr());
            assert!(Instant::now() < deadline, "by_v never answered from {}: {v}", node.addr());
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Moves by files under the same clients: one node, loaded so that every partition is
/// copied as its keyspace's files, grows to three and then sheds the first, while clients
/// do majority operations on the hot keys through every node. Every copy must ship files,
/// and the history must be linearizable: no acknowledged write lost across a copy's
/// snapshot, catch-up and hand-over, no read answered by a copy still being built.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn moves_by_files_stay_linearizable() {
    // 4 partitions, so that each holds more changes than a copy by files needs.
    let args = ["--cluster-secret", common::cluster::SECRET, "--analytics-partitions", "0", "--partitions", "4"];
    let mut first = common::Node::start(&args);
    first.pin_port();
    let http = common::client_builder().timeout(Duration::from_secs(60)).build().unwrap();
    assert_eq!(http.put(first.u("/v1/collections/lin")).send().await.unwrap().status().as_u16(), 201);
    const FILLER: usize = 12_000;
    let pad = "x".repeat(200);
    for chunk in (0..FILLER).collect::<Vec<_>>().chunks(2_000) {
        let body: String = chunk
            .iter()
            .map(|i| json!({"op": "upsert", "key": format!("f{i:05}"), "value": {"i": i, "pad": pad}}).to_string() + "\n")
            .collect();
        let r = http.post(first.u("/v1/collections/lin/_bulk")).body(body).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        assert!(!r.text().await.unwrap().contains("\"error\""), "a bulk line failed");
    }
    // Paced, so that the copies run while the clients do.
    let r = http.put(first.u("/v1/cluster/settings")).json(&json!({"rebalance_mb_per_s": 2})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200, "{}", r.text().await.unwrap_or_default());
    let join = first.addr();
    let mut nodes = vec![first];
    for _ in 0..2 {
        let mut node = common::Node::start(&[&args[..], &["--join", &join][..]].concat());
        node.pin_port();
        nodes.push(node);
    }
    wait_for(&http, &nodes[0].u("/v1/cluster"), "three members", |v| member_states(v).len() == 3).await;

    let history = Arc::new(History::default());
    let urls: Vec<String> = nodes.iter().map(|n| n.url.clone()).collect();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = Vec::new();
    for i in 0..CLIENTS {
        // The clients go through the nodes that stay (the first leaves in the second rebalance).
        let target: Target = Arc::new(std::sync::RwLock::new(urls[1 + i % 2].clone()));
        clients.push(spawn_client(i, target, urls[1..].to_vec(), 5_000, Arc::clone(&history), Arc::clone(&stop)));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Grow: copies to the new nodes. Then shed the first: copies to the others from what
    // it and they hold.
    let (_, info) = get_json(&http, &nodes[0].u("/v1/cluster")).await;
    let first_id = node_id(&info, &nodes[0]).unwrap();
    let mut shipped = Vec::new();
    for eject in [Vec::new(), vec![first_id]] {
        rebalance(&http, &nodes[1], &eject).await;
        let (_, status) = get_json(&http, &nodes[1].u("/v1/cluster/rebalance")).await;
        let moves = status["moves"].as_array().cloned().unwrap_or_default();
        assert!(!moves.is_empty(), "{status}");
        shipped.extend(moves.iter().map(|m| (m["method"].clone(), m["shipped"].clone())));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, std::sync::atomic::Ordering::Release);
    for c in clients {
        c.await.unwrap();
    }
    assert!(
        !shipped.is_empty() && shipped.iter().all(|(method, how)| method == "files" && how == "files"),
        "every copy by files: {shipped:?}"
    );
    let records = history.records();
    let acked = records.iter().filter(|r| r["kind"] != "get" && r["outcome"] == "ok").count();
    let reads = records.iter().filter(|r| r["kind"] == "get").count();
    assert!(acked > 50 && reads > 50, "too little happened to check: {acked} acknowledged writes, {reads} reads");
    let (ok, out) = check(&history.lines());
    eprintln!(
        "moves by files: {} copies, {} operations, {acked} acknowledged writes, {reads} reads; linearizable: {ok}",
        shipped.len(),
        records.len()
    );
    assert!(ok, "Porcupine found the history of moves by files not linearizable:\n{out}");
}
