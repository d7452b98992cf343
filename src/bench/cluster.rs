//! Issue 13's cluster figures: gets and upserts (`none`, `persist`, `majority`) of random
//! keys through a smart client — it fetches the partition map and sends each request to the
//! node holding the key's active copy — against a 1-node cluster and an N-node cluster with
//! one replica, started by the bench in the same run on this machine.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Args;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use shoal_client::Client;

use crate::bench::index::Node;
use crate::cli::CliError;

#[derive(Args)]
pub struct ClusterArgs {
    /// Nodes of the larger cluster (the smaller has one).
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// Concurrent workers, each with one connection to every node.
    #[arg(long, default_value_t = 64)]
    parallel: usize,
    /// Seconds each operation runs.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Distinct keys (loaded first, 180-byte documents).
    #[arg(long, default_value_t = 20_000)]
    keys: usize,
    #[arg(long, default_value_t = 64)]
    partitions: u16,
}

/// Documents per `_bulk` of the load.
const LOAD_SLICE: usize = 5_000;
/// The secret of the bench's own clusters.
const SECRET: &str = "bench-cluster-secret";
/// The document every upsert writes (about 180 bytes, as issue 12's write path bench).
const DOC: &str = r#"{"name":"a bench document","tags":["one","two","three"],"count":12345,"nested":{"a":1,"b":"two","c":[1,2,3]},"text":"padding padding padding padding padding padding"}"#;

pub async fn run(args: ClusterArgs) -> Result<(), CliError> {
    println!(
        "bench cluster: {} workers, {} s per operation, {} keys, {} partitions; every node on this machine's {} cores",
        args.parallel,
        args.seconds,
        args.keys,
        args.partitions,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
    );
    let ops = ["get", "upsert none", "upsert persist", "upsert majority"];
    let mut results: Vec<(usize, &str, Report)> = Vec::new();
    for size in [1, args.nodes] {
        let nodes = start(size, args.partitions)?;
        let client = Client::new(&nodes[0].url)?;
        load(&client, &nodes, &args).await?;
        let router = Router::fetch(&client).await?;
        for op in ops {
            let report = drive(&router, op, &args).await?;
            println!(
                "{size} node(s)  {op:<16} {:>9.0} ops/s  p50 {:>7.2} ms  p99 {:>7.2} ms  errors {}",
                report.rate, report.p50_ms, report.p99_ms, report.errors
            );
            results.push((size, op, report));
        }
        drop(nodes);
    }
    println!("\n| operation | 1 node ops/s | {n} nodes ops/s | ratio | 1 node p50/p99 ms | {n} nodes p50/p99 ms |", n = args.nodes);
    println!("|---|---|---|---|---|---|");
    for op in ops {
        let one = results.iter().find(|(s, o, _)| *s == 1 && *o == op).map(|r| &r.2);
        let many = results.iter().find(|(s, o, _)| *s == args.nodes && *o == op).map(|r| &r.2);
        if let (Some(a), Some(b)) = (one, many) {
            println!(
                "| {op} | {:.0} | {:.0} | {:.2} | {:.2} / {:.2} | {:.2} / {:.2} |",
                a.rate,
                b.rate,
                b.rate / a.rate.max(1.0),
                a.p50_ms,
                a.p99_ms,
                b.p50_ms,
                b.p99_ms
            );
        }
    }
    Ok(())
}

/// Starts a cluster of `size` nodes and rebalances it.
fn start(size: usize, partitions: u16) -> Result<Vec<Node>, CliError> {
    let base = vec!["--cluster-secret".to_string(), SECRET.to_string(), "--analytics-partitions".into(), "0".into()];
    let first = Node::start_named(&format!("cluster{size}-0"), partitions, &base)?;
    let join = crate::bench::host_port(&first.url);
    let mut nodes = vec![first];
    for i in 1..size {
        let mut extra = base.clone();
        extra.extend(["--join".to_string(), join.clone()]);
        nodes.push(Node::start_named(&format!("cluster{size}-{i}"), partitions, &extra)?);
    }
    Ok(nodes)
}

/// Waits for every member, creates the collection, rebalances and loads every key.
async fn load(client: &Client, nodes: &[Node], args: &ClusterArgs) -> Result<(), CliError> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let info = client.cluster().await?;
        if info["nodes"].as_array().is_some_and(|n| n.len() == nodes.len()) {
            break;
        }
        if Instant::now() > deadline {
            return Err(CliError::Usage(format!("the cluster did not form: {info}")));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    client.create_collection("bench", None).await?;
    if nodes.len() > 1 {
        client.rebalance(&[]).await?;
        loop {
            let status = client.rebalance_status().await?;
            if status["state"] != "running" {
                if status["state"] != "done" {
                    return Err(CliError::Usage(format!("rebalance: {status}")));
                }
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let doc: Value = serde_json::from_str(DOC).unwrap_or_default();
    // `_bulk` spans the members: one load through the first node, in slices.
    for first in (0..args.keys).step_by(LOAD_SLICE) {
        let mut body = String::with_capacity(LOAD_SLICE * (DOC.len() + 40));
        for k in first..(first + LOAD_SLICE).min(args.keys) {
            body.push_str(&json!({"op": "upsert", "key": format!("key{k}"), "value": doc}).to_string());
            body.push('\n');
        }
        let answer = client.bulk("bench", body, false).await?;
        if let Some(line) = String::from_utf8_lossy(&answer).lines().find(|l| l.contains("\"error\"")) {
            return Err(CliError::Usage(format!("loading: {line}")));
        }
    }
    Ok(())
}

/// The smart client's view: the map, and each partition's active node's address.
struct Router {
    partitions: u16,
    active: Vec<String>,
}

impl Router {
    async fn fetch(client: &Client) -> Result<Router, CliError> {
        let map = client.cluster_map().await?;
        let nodes = &map["nodes"];
        let active: Vec<String> = map["partitions"]
            .as_array()
            .map(|ps| ps.iter().map(|p| nodes[p["active"].to_string()]["address"].as_str().unwrap_or("").to_string()).collect())
            .unwrap_or_default();
        let partitions = u16::try_from(active.len()).map_err(|_| CliError::Usage("too many partitions".into()))?;
        Ok(Router { partitions, active })
    }
}

struct Report {
    rate: f64,
    p50_ms: f64,
    p99_ms: f64,
    errors: u64,
}

/// Runs `op` from `parallel` workers for the set time; each worker keeps one connection to
/// every node and sends each request straight to the key's active node.
async fn drive(router: &Router, op: &str, args: &ClusterArgs) -> Result<Report, CliError> {
    let (method, query) = match op {
        "get" => (hyper::Method::GET, ""),
        "upsert none" => (hyper::Method::PUT, ""),
        "upsert persist" => (hyper::Method::PUT, "?durability=persist"),
        _ => (hyper::Method::PUT, "?durability=majority"),
    };
    let mut addresses: Vec<String> = router.active.clone();
    addresses.sort();
    addresses.dedup();
    let began = Instant::now();
    let until = began + Duration::from_secs(args.seconds);
    let mut tasks = Vec::new();
    for w in 0..args.parallel {
        let mut senders = HashMap::new();
        for a in &addresses {
            let tcp = tokio::net::TcpStream::connect(a.as_str()).await?;
            tcp.set_nodelay(true)?;
            let (sender, conn) = hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(tcp))
                .await
                .map_err(|e| CliError::Usage(format!("handshake: {e}")))?;
            tokio::spawn(conn);
            senders.insert(a.clone(), sender);
        }
        let route: Vec<String> = router.active.clone();
        let (partitions, keys, method) = (router.partitions, args.keys, method.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(w as u64);
            let (mut lat, mut ok, mut err) = (Vec::new(), 0u64, 0u64);
            while Instant::now() < until {
                let key = format!("key{}", rng.random_range(0..keys));
                let address = &route[usize::from(shoal_storage::partition_of(key.as_bytes(), partitions))];
                let Some(sender) = senders.get_mut(address) else { break };
                let body = if method == hyper::Method::GET { Bytes::new() } else { Bytes::from_static(DOC.as_bytes()) };
                let Ok(req) = hyper::Request::builder()
                    .method(method.clone())
                    .uri(format!("/v1/collections/bench/docs/{key}{query}"))
                    .header("host", address.as_str())
                    .header("x-shoal-route", "direct")
                    .body(Full::new(body))
                else {
                    err += 1;
                    continue;
                };
                let t = Instant::now();
                match sender.send_request(req).await {
                    Ok(resp) => {
                        let success = resp.status().is_success();
                        if success && resp.into_body().collect().await.is_ok() {
                            ok += 1;
                        } else {
                            err += 1;
                        }
                    }
                    Err(_) => {
                        err += 1;
                        break;
                    }
                }
                lat.push(t.elapsed().as_micros() as u64);
            }
            (lat, ok, err)
        }));
    }
    let (mut lat, mut ok, mut err) = (Vec::new(), 0u64, 0u64);
    for t in tasks {
        let (l, o, e) = t.await.map_err(|e| CliError::Usage(format!("worker: {e}")))?;
        lat.extend(l);
        ok += o;
        err += e;
    }
    let secs = began.elapsed().as_secs_f64().max(1e-9);
    lat.sort_unstable();
    let pct = |q: f64| lat.get(((lat.len() as f64 * q) as usize).min(lat.len().saturating_sub(1))).copied().unwrap_or(0) as f64 / 1000.0;
    Ok(Report { rate: ok as f64 / secs, p50_ms: pct(0.50), p99_ms: pct(0.99), errors: err })
}
