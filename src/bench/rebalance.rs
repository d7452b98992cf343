//! `shoal bench rebalance`: seed 003's experiment (issue 14). A cluster of N real nodes on
//! loopback (one replica) is loaded with 1 KB documents; a foreground load of gets and
//! upserts runs at a fixed rate throughout; then one node is replaced (a swap rebalance: a
//! new node joins, the rebalance ejects an old one). Reported, in one run: MB/s into the
//! receiving node (mean, and over time), total time, moves against the copies the leaving
//! node held, foreground p50/p99 before and during, CPU seconds per node; the same swap with
//! every copy built from the change stream (`serve --copy-by-stream`) for the ratio; the
//! storage engine's own copy ceiling (`shoal bench copy`, in process); and `dd`. With
//! `--scenarios`, also the two halves of a swap on fresh clusters: adding one node (copies
//! only onto it) and removing one (copies only off it), each by files.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use shoal_client::Client;

use crate::bench::chart::{line_chart, Series};
use crate::bench::index::Node;
use crate::cli::CliError;

#[derive(Args)]
pub struct RebalanceArgs {
    /// Nodes before the swap.
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// Megabytes of documents per node (each document is stored on two nodes).
    #[arg(long, default_value_t = 2000)]
    mb_per_node: usize,
    #[arg(long, default_value_t = 1000)]
    doc_bytes: usize,
    #[arg(long, default_value_t = 64)]
    partitions: u16,
    /// Foreground operations per second (half gets, half upserts), sent whatever the
    /// latency (an open loop).
    #[arg(long, default_value_t = 400)]
    rate: u64,
    /// Seconds of foreground load measured before the rebalance.
    #[arg(long, default_value_t = 10)]
    before_secs: u64,
    /// The cluster's `rebalance_mb_per_s` during the rebalance (0: no limit).
    #[arg(long)]
    mb_per_s: Option<u32>,
    /// The cluster's `rebalance_moves_per_node` during the rebalance (default: the setting's).
    #[arg(long)]
    moves_per_node: Option<u32>,
    /// Which methods the swap runs: `files` (the keyspace's files, adopted whole),
    /// `files-unpaced` (the same without the elastic budget that yields to requests),
    /// `records` (the snapshot's records, ingested as new tables), `stream` (the change
    /// stream) and `stream-unpaced` (the change stream without the elastic budget: with
    /// `files-unpaced`, the two methods' own speeds), in any combination.
    #[arg(long, value_delimiter = ',', default_value = "files,records,stream")]
    methods: Vec<String>,
    /// Which rebalances to run, each on a fresh cluster: `swap` (add one node and eject
    /// one, in one rebalance; by every method), `add` (add one), `remove` (eject one); the
    /// last two by files.
    #[arg(long, value_delimiter = ',', default_value = "swap")]
    scenarios: Vec<String>,
    /// Skip the in-process copy ceiling and `dd`.
    #[arg(long)]
    no_ceiling: bool,
    /// The foreground load routes each request to its key's active copy, as a smart client
    /// does (`x-shoal-route: direct`; on `421` it fetches the map and sends again), instead
    /// of through the nodes that stay (which forward).
    #[arg(long)]
    direct: bool,
    /// The foreground upserts' `durability` (`none`, `persist`, `majority`,
    /// `persist_majority`); the server's default if not given. With `majority`, an upsert
    /// waits for its partition's replica, so the load sees how long a hand-over leaves
    /// replicas without their new active.
    #[arg(long, value_parser = ["none", "persist", "majority", "persist_majority"])]
    durability: Option<String>,
    /// Where the chart goes (PNG); none if not given.
    #[arg(long)]
    chart: Option<PathBuf>,
    /// Writes every foreground request (scenario, seconds from the rebalance's start,
    /// latency ms, success, operation, partition) to this CSV file, to see how the slow
    /// ones spread over time and partitions.
    #[arg(long)]
    requests_csv: Option<PathBuf>,
}

const SECRET: &str = "bench-rebalance-secret";
/// The method name of a copy by files without the elastic budget.
const UNPACED: &str = "files-unpaced";
/// The method name of a copy by the change stream without the elastic budget.
const STREAM_UNPACED: &str = "stream-unpaced";
/// Every method `--methods` takes.
const METHODS: [&str; 5] = ["files", UNPACED, "records", "stream", STREAM_UNPACED];
/// Documents per `_bulk` while loading.
const LOAD_SLICE: usize = 2_000;
/// Foreground failures printed (the rest are counted).
const FAILURES_SHOWN: u64 = 5;
/// Foreground requests slower than this are printed as they end (when, how long, where),
/// to line them up with the nodes' logs (`SHOAL_BENCH_NODE_LOG=info`).
const SLOW_SHOWN_MS: f64 = 100.0;
/// How often the rebalance's progress is sampled.
const SAMPLE: Duration = Duration::from_millis(500);
/// Longest the bench waits for a rebalance.
const REBALANCE_MAX: Duration = Duration::from_secs(3_600);

pub(crate) struct Sample {
    t: f64,
    bytes_done: u64,
}

/// What one rebalance does to the cluster.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scenario {
    /// A new node joins and node 0 is ejected in the same rebalance.
    Swap,
    /// A new node joins.
    Add,
    /// Node 0 is ejected.
    Remove,
}

impl Scenario {
    fn parse(name: &str) -> Result<Scenario, CliError> {
        match name {
            "swap" => Ok(Scenario::Swap),
            "add" => Ok(Scenario::Add),
            "remove" => Ok(Scenario::Remove),
            other => Err(CliError::Bench(format!("unknown scenario {other:?}: swap, add or remove"))),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Scenario::Swap => "swap",
            Scenario::Add => "add",
            Scenario::Remove => "remove",
        }
    }

    fn joins(self) -> bool {
        self != Scenario::Remove
    }

    fn ejects(self) -> bool {
        self != Scenario::Add
    }
}

struct Outcome {
    scenario: Scenario,
    method: String,
    secs: f64,
    /// From the rebalance's start to the first progress sample with every byte.
    polled_copy_secs: f64,
    /// From the first copy's start to the last copy's end, by the receivers' clocks (all
    /// on this machine); the polled figure when a move lacks them.
    copy_secs: f64,
    bytes: u64,
    /// What the plan gave the moves before they started (their sources' live documents).
    bytes_planned: u64,
    moves: usize,
    /// Copies that had to move (the least a rebalance can do).
    needed: usize,
    before: (f64, f64, usize),
    during: (f64, f64, usize),
    errors: u64,
    cpu: Vec<(String, f64)>,
    /// Per node, its CPU seconds by thread name.
    cpu_threads: Vec<(String, Vec<(String, f64)>)>,
    samples: Vec<Sample>,
    p99_series: Vec<(f64, f64)>,
    rebalance_start: f64,
}

pub async fn run(args: RebalanceArgs) -> Result<(), CliError> {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let docs = args.mb_per_node * args.nodes * 1_000_000 / args.doc_bytes.max(1) / 2;
    println!(
        "bench rebalance: {} nodes + 1 (swap), {} partitions, 1 replica, {} documents of {} bytes ({} MB per node), \
         foreground {} ops/s; every node on this machine's {cores} cores and one disk",
        args.nodes, args.partitions, docs, args.doc_bytes, args.mb_per_node, args.rate
    );
    if let Some(m) = args.methods.iter().find(|m| !METHODS.contains(&m.as_str())) {
        return Err(CliError::Bench(format!("unknown method {m:?}: one of {}", METHODS.join(", "))));
    }
    let mut outcomes = Vec::new();
    for scenario in &args.scenarios {
        let scenario = Scenario::parse(scenario)?;
        let methods: Vec<&str> = if scenario == Scenario::Swap { args.methods.iter().map(String::as_str).collect() } else { vec!["files"] };
        for method in methods {
            outcomes.push(swap(&args, docs, method, scenario).await?);
        }
    }
    println!("\n| rebalance | method | rebalance s | copy s (polled) | copy s (first start to last end) | MB planned (live documents) | MB moved | MB/s into the receivers | document MB/s (planned / copy s) | moves / copies that had to move | fg p50 / p99 ms before | fg p50 / p99 ms during | fg errors |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for o in &outcomes {
        println!(
            "| {} | {} | {:.1} | {:.1} | {:.2} | {:.0} | {:.0} | {:.0} | {:.0} | {} / {} | {:.2} / {:.2} ({} ops) | {:.2} / {:.2} ({} ops) | {} |",
            o.scenario.name(),
            o.method,
            o.secs,
            o.polled_copy_secs,
            o.copy_secs,
            o.bytes_planned as f64 / 1e6,
            o.bytes as f64 / 1e6,
            o.bytes as f64 / 1e6 / o.copy_secs.max(1e-9),
            o.bytes_planned as f64 / 1e6 / o.copy_secs.max(1e-9),
            o.moves,
            o.needed,
            o.before.0,
            o.before.1,
            o.before.2,
            o.during.0,
            o.during.1,
            o.during.2,
            o.errors
        );
    }
    for o in &outcomes {
        let cpu: Vec<String> = o.cpu.iter().map(|(n, s)| format!("{n} {s:.1}")).collect();
        println!("CPU seconds during the {} {} rebalance: {}", o.scenario.name(), o.method, cpu.join(", "));
        for (node, threads) in &o.cpu_threads {
            let threads: Vec<String> = threads.iter().map(|(n, s)| format!("{n} {s:.2}")).collect();
            println!("  {node} by thread: {}", threads.join(", "));
        }
    }
    let swap_by = |method: &str| outcomes.iter().find(|o| o.scenario == Scenario::Swap && o.method == method);
    // The swaps move the same partitions: their rates compare as times. The records run's
    // bytes are the unit of the engine's copy ceiling below (records MB/s).
    let records_bytes = swap_by("records").map(|r| r.bytes);
    for o in &outcomes {
        println!(
            "{} {}: foreground p99 during / before {:.1}× ({:.2} / {:.2} ms)",
            o.scenario.name(),
            o.method,
            o.during.1 / o.before.1.max(1e-9),
            o.during.1,
            o.before.1
        );
    }
    for (a, b) in [
        ("files", "stream"),
        ("files", "records"),
        ("records", "stream"),
        (UNPACED, "files"),
        (UNPACED, "stream"),
        (UNPACED, STREAM_UNPACED),
    ] {
        if let (Some(x), Some(y)) = (swap_by(a), swap_by(b)) {
            println!(
                "swap {a} / {b}: {:.1}× faster (copy s {:.2} against {:.2})",
                y.copy_secs / x.copy_secs.max(1e-9),
                x.copy_secs,
                y.copy_secs
            );
        }
    }
    if let (Some(f), Some(rb)) = (swap_by("files"), records_bytes) {
        println!(
            "swap files in records MB/s (the records run's {:.0} MB over the files run's copy s): {:.0}",
            rb as f64 / 1e6,
            rb as f64 / 1e6 / f.copy_secs.max(1e-9)
        );
    }
    if let Some(path) = &args.chart {
        let mut series = Vec::new();
        for o in &outcomes {
            let rate: Vec<(f64, f64)> = o
                .samples
                .windows(2)
                // The progress's bytes can fall back (a failed copy's, or the last status's
                // count at the end): no negative rate, and no wrapped one (a remove's chart
                // once showed 1e12 MB/s).
                .map(|w| {
                    (w[1].t - o.rebalance_start, w[1].bytes_done.saturating_sub(w[0].bytes_done) as f64 / 1e6 / (w[1].t - w[0].t).max(1e-9))
                })
                .collect();
            let label = format!("{} {}", o.scenario.name(), o.method);
            series.push(Series { name: format!("{label}: MB/s into the receivers"), points: rate });
            let p99: Vec<(f64, f64)> = o.p99_series.iter().map(|(t, v)| (t - o.rebalance_start, *v * 10.0)).collect();
            series.push(Series { name: format!("{label}: foreground p99 ms × 10"), points: p99 });
        }
        match line_chart(
            path,
            "rebalance: copy rate and foreground p99",
            "seconds since the rebalance started",
            "MB/s  |  p99 ms × 10",
            &series,
            false,
        ) {
            Ok(()) => println!("chart: {}", path.display()),
            Err(e) => println!("no chart: {e}"),
        }
    }
    if !args.no_ceiling {
        let (nodes, doc_bytes, partitions) = (args.nodes, args.doc_bytes, args.partitions);
        tokio::task::spawn_blocking(move || ceiling(nodes, doc_bytes, partitions, docs))
            .await
            .map_err(|e| CliError::Bench(e.to_string()))??;
    }
    Ok(())
}

/// One rebalance on a fresh cluster: load, measure, then replace node 0 by a new node built
/// by `method` (a swap), or only add the new node, or only eject node 0.
async fn swap(args: &RebalanceArgs, docs: usize, method: &str, scenario: Scenario) -> Result<Outcome, CliError> {
    let label = format!("{}-{method}", scenario.name());
    println!("\n--- {} by {method}", scenario.name());
    let mut base = vec!["--cluster-secret".to_string(), SECRET.to_string(), "--analytics-partitions".into(), "0".into()];
    if method == UNPACED || method == STREAM_UNPACED {
        // Every node: sources pace their exports as receivers pace their ingest.
        base.push("--copy-unpaced".into());
    }
    let first = Node::start_named(&format!("rebalance-{label}-0"), args.partitions, &base)?;
    let join = crate::bench::host_port(&first.url);
    let mut nodes = vec![first];
    let mut joining = base.clone();
    joining.extend(["--join".to_string(), join.clone()]);
    for i in 1..args.nodes {
        nodes.push(Node::start_named(&format!("rebalance-{label}-{i}"), args.partitions, &joining)?);
    }
    let client = Client::new(&nodes[0].url)?;
    wait_members(&client, nodes.len()).await?;
    client.create_collection("bench", None).await?;
    rebalance(&client, &[], None).await?;
    let loaded = Instant::now();
    load(&nodes, docs, args.doc_bytes).await?;
    println!("loaded {docs} documents in {:.1} s", loaded.elapsed().as_secs_f64());
    for n in &nodes {
        n.wait_idle(Duration::from_secs(120));
    }
    if let Some(moves) = args.moves_per_node {
        client.cluster_settings(&json!({"rebalance_moves_per_node": moves})).await?;
    }
    if let Some(mb) = args.mb_per_s {
        client.cluster_settings(&json!({"rebalance_mb_per_s": mb})).await?;
    }
    let info = client.cluster().await?;
    let leaving = node_id(&info, &nodes[0].url).ok_or_else(|| CliError::Bench(format!("no id for node 0: {info}")))?;
    let map = client.cluster_map().await?;
    let leaving_copies = copies_on(&map, leaving);

    // The foreground load goes to the nodes that stay (they forward where needed).
    let targets: Vec<String> = nodes[1..].iter().map(|n| n.url.clone()).collect();
    let log: Arc<Mutex<Vec<Request>>> = Arc::default();
    let began = Instant::now();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Each partition's active when the load starts: printed beside a slow request.
    let actives: Vec<u64> =
        map["partitions"].as_array().map(|ps| ps.iter().map(|p| p["active"].as_u64().unwrap_or(0)).collect()).unwrap_or_default();
    let direct = match args.direct {
        true => Some(Arc::new(std::sync::RwLock::new(routes(&info, &map)))),
        false => None,
    };
    let load = Foreground { targets, docs, rate: args.rate, actives, direct, durability: args.durability.clone() };
    let fg = tokio::spawn(foreground(load, Arc::clone(&log), began, Arc::clone(&stop)));
    tokio::time::sleep(Duration::from_secs(args.before_secs)).await;

    let mut extra = joining.clone();
    match method {
        "stream" | STREAM_UNPACED => extra.push("--copy-by-stream".into()),
        "records" => extra.push("--copy-by-records".into()),
        _ => {}
    }
    // Started off the runtime's worker (it blocks until the node listens): on it, the
    // foreground's requests in flight there would wait too, inside the window measured as
    // "before".
    let newcomer = match scenario.joins() {
        true => Some(tokio::task::block_in_place(|| Node::start_named(&format!("rebalance-{label}-new"), args.partitions, &extra))?),
        false => None,
    };
    wait_members(&client, nodes.len() + usize::from(newcomer.is_some())).await?;
    let cpu_before: Vec<Option<u64>> = nodes.iter().chain(newcomer.as_ref()).map(|n| n.cpu_ticks()).collect();
    let threads_before: Vec<_> = nodes.iter().chain(newcomer.as_ref()).map(|n| n.thread_ticks()).collect();
    let rebalance_start = began.elapsed().as_secs_f64();
    // To line the requests' times up with the nodes' logs.
    let unix = unix_now();
    println!("the {} rebalance starts at unix {unix:.3}", scenario.name());
    let mut samples = Vec::new();
    let eject = if scenario.ejects() { vec![leaving] } else { Vec::new() };
    let status = rebalance(&client, &eject, Some((&mut samples, began))).await?;
    let rebalance_end = began.elapsed().as_secs_f64();
    // The copies that had to move: the leaving node's (a swap, a removal), or the ones the
    // new node holds at the end (an addition).
    let needed = match (scenario, &newcomer) {
        (Scenario::Add, Some(n)) => {
            let info = client.cluster().await?;
            let id = node_id(&info, &n.url).ok_or_else(|| CliError::Bench(format!("no id for the new node: {info}")))?;
            copies_on(&client.cluster_map().await?, id)
        }
        _ => leaving_copies,
    };
    let mut cpu_threads = Vec::new();
    let cpu: Vec<(String, f64)> = nodes
        .iter()
        .chain(newcomer.as_ref())
        .zip(cpu_before)
        .zip(threads_before)
        .enumerate()
        .map(|(i, ((n, before), threads))| {
            let name = if i == nodes.len() {
                "new".to_string()
            } else if i == 0 && scenario.ejects() {
                "leaving".to_string()
            } else {
                format!("node{i}")
            };
            let ticks = n.cpu_ticks().zip(before).map_or(0, |(a, b)| a.saturating_sub(b));
            cpu_threads.push((name.clone(), super::index::cpu_by_thread(&threads, &n.thread_ticks(), ticks)));
            (name, ticks as f64 / 100.0)
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let errors = fg.await.map_err(|e| CliError::Bench(e.to_string()))?;

    let moves = status["moves"].as_array().map_or(0, Vec::len);
    let bytes = status["bytes_done"].as_u64().unwrap_or(0);
    let bytes_planned = status["bytes_planned"].as_u64().unwrap_or(0);
    // The copies are done when the progress stops growing (then hand-over and settling).
    let copy_end = samples.iter().find(|s| s.bytes_done >= bytes && bytes > 0).map_or(rebalance_end, |s| s.t);
    let polled_copy_secs =
        if method != "stream" && method != STREAM_UNPACED { copy_end - rebalance_start } else { rebalance_end - rebalance_start };
    let copy_secs = copy_span_secs(&status).unwrap_or(polled_copy_secs);
    let log = log.lock().map_err(|_| CliError::Bench("a foreground task panicked".into()))?;
    let window = |from: f64, to: f64| {
        let mut lat: Vec<f64> = log.iter().filter(|r| r.ok && r.at >= from && r.at < to).map(|r| r.ms).collect();
        lat.sort_by(f64::total_cmp);
        let pct = |q: f64| lat.get(((lat.len() as f64 * q) as usize).min(lat.len().saturating_sub(1))).copied().unwrap_or(0.0);
        (pct(0.5), pct(0.99), lat.len())
    };
    let before = window(0.0, rebalance_start);
    let during = window(rebalance_start, rebalance_end);
    let mut p99_series = Vec::new();
    let mut t = 0.0;
    while t < rebalance_end + 2.0 {
        let w = window(t, t + 1.0);
        if w.2 > 0 {
            p99_series.push((t + 0.5, w.1));
        }
        t += 1.0;
    }
    if let Some(path) = &args.requests_csv {
        write_requests(path, &label, rebalance_start, &log)?;
    }
    println!(
        "{} by {method}: rebalance {:.1} s, {} moves ({} copies had to move), {:.0} MB from files, foreground p99 {:.2} ms before, {:.2} ms during",
        scenario.name(),
        rebalance_end - rebalance_start,
        moves,
        needed,
        bytes as f64 / 1e6,
        before.1,
        during.1
    );
    drop(newcomer);
    drop(nodes);
    Ok(Outcome {
        scenario,
        method: method.to_string(),
        secs: rebalance_end - rebalance_start,
        polled_copy_secs,
        copy_secs,
        bytes,
        bytes_planned,
        moves,
        needed,
        before,
        during,
        errors,
        cpu,
        cpu_threads,
        samples,
        p99_series,
        rebalance_start,
    })
}

/// The span from the first copy's start to the last copy's end, as the receivers reported
/// them (`None` when a move lacks either).
fn copy_span_secs(status: &Value) -> Option<f64> {
    let moves = status["moves"].as_array()?;
    let mut span: Option<(u64, u64)> = None;
    for m in moves {
        let (start, end) = (m["copy_started_unix_ms"].as_u64()?, m["copy_finished_unix_ms"].as_u64()?);
        span = Some(span.map_or((start, end), |(s, e)| (s.min(start), e.max(end))));
    }
    span.map(|(s, e)| e.saturating_sub(s) as f64 / 1e3)
}

/// How many partition copies (active or replica) `node` holds in `map`.
fn copies_on(map: &Value, node: u64) -> usize {
    map["partitions"]
        .as_array()
        .map(|ps| ps.iter().filter(|p| p["active"] == node || p["replicas"].as_array().is_some_and(|r| r.contains(&json!(node)))).count())
        .unwrap_or(0)
}

pub(crate) fn node_id(info: &Value, url: &str) -> Option<u64> {
    let address = crate::bench::host_port(url);
    info["nodes"].as_array()?.iter().find(|n| n["address"] == address).and_then(|n| n["id"].as_u64())
}

pub(crate) async fn wait_members(client: &Client, n: usize) -> Result<(), CliError> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let info = client.cluster().await?;
        if info["nodes"].as_array().is_some_and(|a| a.len() == n) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(CliError::Bench(format!("the cluster did not reach {n} members: {info}")));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Runs a rebalance to its end, sampling its progress; answers the last status.
pub(crate) async fn rebalance(client: &Client, eject: &[u64], mut samples: Option<(&mut Vec<Sample>, Instant)>) -> Result<Value, CliError> {
    client.rebalance(eject).await?;
    let deadline = Instant::now() + REBALANCE_MAX;
    loop {
        let status = client.rebalance_status().await?;
        if let Some((samples, began)) = samples.as_mut() {
            samples.push(Sample { t: began.elapsed().as_secs_f64(), bytes_done: status["bytes_done"].as_u64().unwrap_or(0) });
        }
        if status["state"] != "running" {
            if status["state"] != "done" {
                return Err(CliError::Bench(format!("rebalance: {status}")));
            }
            return Ok(status);
        }
        if Instant::now() > deadline {
            return Err(CliError::Bench(format!("the rebalance did not end in {REBALANCE_MAX:?}: {status}")));
        }
        tokio::time::sleep(SAMPLE).await;
    }
}

/// Loads `docs` documents through every node, two slices in flight per node.
async fn load(nodes: &[Node], docs: usize, doc_bytes: usize) -> Result<(), CliError> {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for n in nodes.iter().flat_map(|n| [n, n]) {
        let client = Client::new(&n.url)?;
        let next = Arc::clone(&next);
        tasks.push(tokio::spawn(async move {
            loop {
                let first = next.fetch_add(LOAD_SLICE, std::sync::atomic::Ordering::Relaxed);
                if first >= docs {
                    return Ok::<(), CliError>(());
                }
                let mut body = String::with_capacity(LOAD_SLICE * (doc_bytes + 64));
                for i in first..(first + LOAD_SLICE).min(docs) {
                    body.push_str(r#"{"op":"upsert","key":"doc-"#);
                    body.push_str(&format!("{i:09}"));
                    body.push_str(r#"","value":"#);
                    body.push_str(&crate::bench::copy::document(i, doc_bytes));
                    body.push_str("}\n");
                }
                let answer = client.bulk("bench", body, false).await?;
                if let Some(line) = String::from_utf8_lossy(&answer).lines().find(|l| l.contains("\"error\"")) {
                    return Err(CliError::Bench(format!("loading: {line}")));
                }
            }
        }));
    }
    for t in tasks {
        t.await.map_err(|e| CliError::Bench(e.to_string()))??;
    }
    Ok(())
}

/// Sends `rate` requests per second (half gets, half upserts of random loaded keys) to the
/// targets in turn until `stop`, each in its own task; logs (seconds since `began`,
/// latency ms, success). Answers the number of failed requests.
/// The foreground load: where it goes, over which keys, how fast.
struct Foreground {
    /// The nodes that stay, taken in turn (unless `direct`).
    targets: Vec<String>,
    docs: usize,
    rate: u64,
    /// Each partition's active when the load starts (printed beside a slow request).
    actives: Vec<u64>,
    /// Each partition's active's base URL, for a smart client's load (`--direct`).
    direct: Option<Arc<std::sync::RwLock<Vec<String>>>>,
    /// The upserts' `durability` query parameter, if any.
    durability: Option<String>,
}

/// One foreground request as the load saw it.
struct Request {
    /// Seconds since the load began.
    at: f64,
    ms: f64,
    ok: bool,
    get: bool,
    partition: u16,
}

/// Appends the scenario's requests to `path` (a header first when the file is new).
fn write_requests(path: &std::path::Path, label: &str, rebalance_start: f64, log: &[Request]) -> Result<(), CliError> {
    use std::io::Write as _;
    let fresh = !path.exists();
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| CliError::Bench(format!("{}: {e}", path.display())))?;
    let mut out = std::io::BufWriter::new(file);
    let mut write = || -> std::io::Result<()> {
        if fresh {
            writeln!(out, "scenario,t_from_rebalance_s,ms,ok,op,partition")?;
        }
        for r in log {
            let op = if r.get { "get" } else { "upsert" };
            writeln!(out, "{label},{:.4},{:.3},{},{op},{}", r.at - rebalance_start, r.ms, r.ok, r.partition)?;
        }
        out.flush()
    };
    write().map_err(|e| CliError::Bench(format!("{}: {e}", path.display())))
}

async fn foreground(load: Foreground, log: Arc<Mutex<Vec<Request>>>, began: Instant, stop: Arc<std::sync::atomic::AtomicBool>) -> u64 {
    let Foreground { targets, docs, rate, actives, direct, durability } = load;
    let durable = durability.map(|d| format!("?durability={d}")).unwrap_or_default();
    let http = crate::bench::http_builder().timeout(Duration::from_secs(30)).no_proxy().build().unwrap_or_default();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let interval = Duration::from_secs_f64(1.0 / rate.max(1) as f64);
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let errors = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut inflight = Vec::new();
    let mut i = 0usize;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        ticker.tick().await;
        let key = format!("doc-{:09}", rng.random_range(0..docs.max(1)));
        let get = i.is_multiple_of(2);
        let query = if get { String::new() } else { durable.clone() };
        let url = format!("{}/v1/collections/bench/docs/{key}{query}", targets[i % targets.len()]);
        let p = shoal_storage::partition_of(key.as_bytes(), u16::try_from(actives.len()).unwrap_or(u16::MAX));
        let active = actives.get(usize::from(p)).copied().unwrap_or(0);
        i += 1;
        let (http, log, errors, direct, ask) = (http.clone(), Arc::clone(&log), Arc::clone(&errors), direct.clone(), targets[0].clone());
        inflight.push(tokio::spawn(async move {
            let sent = Instant::now();
            let at = began.elapsed().as_secs_f64();
            let send = |url: String| {
                let r = if get { http.get(url) } else { http.put(url).body(r#"{"fg":true,"n":1}"#) };
                r.header("x-shoal-route", "direct").send()
            };
            let r = match &direct {
                None => if get { http.get(&url).send().await } else { http.put(&url).body(r#"{"fg":true,"n":1}"#).send().await },
                // A smart client: straight to the active; on `421` the map moved, so fetch it
                // and send again (the time of every try counts).
                Some(routes) => {
                    let mut tries = 0;
                    loop {
                        let base = routes.read().ok().and_then(|r| r.get(usize::from(p)).cloned()).unwrap_or_default();
                        let r = send(format!("{base}/v1/collections/bench/docs/{key}{query}")).await;
                        tries += 1;
                        if tries >= DIRECT_TRIES || !r.as_ref().is_ok_and(|r| r.status() == reqwest::StatusCode::MISDIRECTED_REQUEST) {
                            break r;
                        }
                        if let Some(fresh) = fetch_routes(&http, &ask).await {
                            if let Ok(mut r) = routes.write() {
                                *r = fresh;
                            }
                        }
                    }
                }
            };
            let failure = match r {
                Ok(r) if r.status().is_success() => r.bytes().await.err().map(|e| e.to_string()),
                // A get of a key the load did not reach is no failure.
                Ok(r) if get && r.status() == reqwest::StatusCode::NOT_FOUND => None,
                Ok(r) => Some(format!("{} {}", r.status(), r.text().await.unwrap_or_default())),
                Err(e) => Some(e.to_string()),
            };
            let ok = failure.is_none();
            let ms = sent.elapsed().as_secs_f64() * 1000.0;
            if ms >= SLOW_SHOWN_MS {
                let unix = unix_now();
                println!(
                    "slow foreground request at {at:.2} s (ended at unix {unix:.3}): {ms:.0} ms, {} {} (partition {p}, active at the start: node {active})",
                    if get { "get" } else { "upsert" },
                    if direct.is_some() { "direct to its active" } else { url.as_str() }
                );
            }
            if let Some(failure) = failure {
                if errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < FAILURES_SHOWN {
                    println!("foreground failure at {at:.1} s: {}", failure.chars().take(300).collect::<String>());
                }
            }
            if let Ok(mut log) = log.lock() {
                log.push(Request { at, ms, ok, get, partition: p });
            }
        }));
        inflight.retain(|t| !t.is_finished());
    }
    for t in inflight {
        let _ = t.await;
    }
    errors.load(std::sync::atomic::Ordering::Relaxed)
}

/// Seconds since the Unix epoch (to line the bench's events up with the nodes' logs).
fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs_f64()
}

/// Tries of a direct foreground request (a newer map each time it is told `421`).
const DIRECT_TRIES: usize = 5;

/// Each partition's active as a base URL, from `GET /v1/cluster` and `GET /v1/cluster/map`.
fn routes(info: &Value, map: &Value) -> Vec<String> {
    let address = |id: u64| {
        info["nodes"].as_array().and_then(|ns| ns.iter().find(|n| n["id"] == id)).and_then(|n| n["address"].as_str()).unwrap_or("")
    };
    map["partitions"]
        .as_array()
        .map(|ps| ps.iter().map(|p| format!("http://{}", address(p["active"].as_u64().unwrap_or(0)))).collect())
        .unwrap_or_default()
}

/// The routes as the node at `base` knows them now.
async fn fetch_routes(http: &reqwest::Client, base: &str) -> Option<Vec<String>> {
    let info: Value = http.get(format!("{base}/v1/cluster")).send().await.ok()?.json().await.ok()?;
    let map: Value = http.get(format!("{base}/v1/cluster/map")).send().await.ok()?.json().await.ok()?;
    Some(routes(&info, &map))
}

/// The storage engine's own copy ceiling on this machine and `dd`, in the same run.
fn ceiling(nodes: usize, doc_bytes: usize, partitions: u16, docs: usize) -> Result<(), CliError> {
    // The leaving node's share of the data: what the swap had to move.
    let share = docs * 2 / nodes.max(1);
    println!("\n--- the engine's copy ceiling (in process, {share} documents: the leaving node's share)");
    let dir = std::env::temp_dir();
    crate::bench::copy::run(crate::bench::copy::CopyArgs::ceiling(dir.clone(), share, doc_bytes, partitions))?;
    let mb = share * (doc_bytes + 60) / 1_000_000;
    let out = std::process::Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}", dir.join("shoal-bench-dd.bin").display()))
        .args(["bs=1M", &format!("count={mb}"), "conv=fsync"])
        .output()?;
    let _ = std::fs::remove_file(dir.join("shoal-bench-dd.bin"));
    println!("dd (same disk, {mb} MB, fsync): {}", String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or(""));
    Ok(())
}
