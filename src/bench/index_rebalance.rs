//! `shoal bench index-rebalance`: seed 000 re-run (issue 41). A cluster of data nodes
//! (`--services data,query`) and index nodes (`--services index,query`) — or, with
//! `--default-services`, of nodes running all three — real processes on loopback, holds many indexes
//! over a loaded collection; `eq` scans (each checked against the answer computed from the
//! loaded documents) and upserts that leave every index entry as it is run at a fixed rate;
//! then a data node and an index node (or one node of all three) join in one rebalance (a scale-out). Reported, in one
//! run: the rebalance's time, index moves, their method (files, or rebuilt from the change
//! streams), bytes, scan p50/p95/p99 before and during, wrong answers; the same scale-out
//! with every index copy rebuilt from the streams (`--copy-by-stream` on the index nodes),
//! and with no index, for the ratios. Then seed 002 at cluster scale: `eq` scan latency
//! with 1 and 4 index nodes, and with 16, 64 and 256 data partitions on 3 (the shapes compared
//! run at once, their scans interleaved in turns).
//!
//! Every node shares this machine's cores and disk: the figures compare runs of one bench,
//! not clusters of separate machines.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use shoal_client::Client;

use crate::bench::chart::{line_chart, Series};
use crate::bench::index::Node;
use crate::bench::rebalance::{node_id, rebalance, wait_members};
use crate::cli::CliError;

#[derive(Args)]
pub struct IndexRebalanceArgs {
    /// Data nodes before the scale-out (one more joins).
    #[arg(long, default_value_t = 2)]
    data_nodes: usize,
    /// Index nodes before the scale-out (one more joins).
    #[arg(long, default_value_t = 3)]
    index_nodes: usize,
    #[arg(long, default_value_t = 100)]
    indexes: usize,
    /// Partitions of each index.
    #[arg(long, default_value_t = 8)]
    index_partitions: u16,
    #[arg(long, default_value_t = 20_000)]
    docs: usize,
    /// Data partitions.
    #[arg(long, default_value_t = 64)]
    partitions: u16,
    /// Foreground operations per second (half `eq` scans, half upserts), sent whatever the
    /// latency (an open loop).
    #[arg(long, default_value_t = 100)]
    rate: u64,
    /// Seconds of foreground load measured before the rebalance.
    #[arg(long, default_value_t = 5)]
    before_secs: u64,
    /// Which scale-outs run, each on a fresh cluster: `files` (index copies adopted as
    /// files), `stream` (rebuilt from the change streams), `none` (no index).
    #[arg(long, value_delimiter = ',', default_value = "files,stream,none")]
    methods: Vec<String>,
    /// `eq` scans per cluster shape in the latency part (0: skip it).
    #[arg(long, default_value_t = 1000)]
    eq_scans: usize,
    /// Skip the write throughput part (0 against 5 indexes).
    #[arg(long)]
    no_writes: bool,
    /// `_bulk` calls of 2,000 documents in flight at once while loading (the write
    /// throughput part's load): 1 measures one client's latency, more the cluster's
    /// throughput.
    #[arg(long, default_value_t = 1)]
    writers: usize,
    /// Every node runs the default services (data, index and query), as a cluster started
    /// without `--services` does: `--data-nodes` such nodes and no index-only node, and the
    /// scale-out adds one more. Without it, data nodes run `data,query` and index nodes
    /// `index,query`.
    #[arg(long)]
    default_services: bool,
    /// Where the chart of scan latency over the rebalance goes (PNG).
    #[arg(long)]
    chart: Option<PathBuf>,
    /// The scale-outs' indexes are created once the documents are loaded (each built over
    /// them), where by default they are created first and the load indexed as it comes.
    #[arg(long)]
    indexes_after_load: bool,
}

const SECRET: &str = "bench-index-rebalance-secret";
/// Distinct values of each indexed field.
const VALUES: u64 = 50;
/// Indexed fields of each document.
const FIELDS: u64 = 10;
/// Documents per `_bulk` while loading.
const LOAD_SLICE: usize = 2_000;
/// Times a refused load slice is sent again.
const LOAD_TRIES: usize = 20;
/// Longest the bench waits for the indexes to be built.
const WAIT_MAX: Duration = Duration::from_secs(3_600);

/// Field `k` of document `i`: spread over [`VALUES`], differently per field.
fn field(i: usize, k: u64) -> u64 {
    (i as u64).wrapping_mul(2 * k + 1).wrapping_add(k * 7) % VALUES
}

fn document(i: usize, pad: usize) -> Value {
    let mut doc = serde_json::Map::new();
    for k in 0..FIELDS {
        doc.insert(format!("f{k}"), json!(field(i, k)));
    }
    doc.insert("pad".into(), json!("x".repeat(pad)));
    Value::Object(doc)
}

/// Index `n`: its name and leading field (a second key keeps the indexes distinct).
fn index_def(n: usize, partitions: u16) -> Value {
    let k = n as u64 % FIELDS;
    json!({"name": format!("i{n:03}"), "keys": [format!("f{k}"), format!("f{}", (k + 1 + n as u64 / FIELDS) % FIELDS)], "partitions": partitions})
}

/// Per field and value, how many of the `docs` documents have it: the answer of an `eq` scan.
fn expected(docs: usize) -> Vec<Vec<usize>> {
    let mut counts = vec![vec![0usize; VALUES as usize]; FIELDS as usize];
    for i in 0..docs {
        for k in 0..FIELDS {
            counts[k as usize][field(i, k) as usize] += 1;
        }
    }
    counts
}

/// What the load saw, shared with its tasks.
type Log = Arc<Mutex<Vec<Scan>>>;

/// One foreground scan or write as the load saw it.
struct Scan {
    at: f64,
    ms: f64,
    ok: bool,
    exact: bool,
}

struct Outcome {
    method: String,
    secs: f64,
    /// The leader's measure of the index stage alone (it runs beside the data moves).
    index_secs: Option<f64>,
    index_moves: usize,
    by_files: usize,
    rebuilt: usize,
    index_bytes: u64,
    data_moves: usize,
    before: Percentiles,
    during: Percentiles,
    refused: usize,
    wrong: usize,
    /// (seconds since the rebalance started, p99 ms) per second.
    p99_series: Vec<(f64, f64)>,
}

#[derive(Clone, Copy, Default)]
struct Percentiles {
    p50: f64,
    p95: f64,
    p99: f64,
    n: usize,
}

fn percentiles(mut ms: Vec<f64>) -> Percentiles {
    if ms.is_empty() {
        return Percentiles::default();
    }
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() as f64 * q) as usize).min(ms.len() - 1)];
    Percentiles { p50: at(0.50), p95: at(0.95), p99: at(0.99), n: ms.len() }
}

/// Index-only nodes before the scale-out: none with `--default-services`.
fn index_nodes(args: &IndexRebalanceArgs) -> usize {
    if args.default_services {
        0
    } else {
        args.index_nodes
    }
}

pub async fn run(args: IndexRebalanceArgs) -> Result<(), CliError> {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let shape = match args.default_services {
        true => format!("{} nodes running data, index and query, then one more", args.data_nodes),
        false => format!("{} data + {} index nodes, then one more of each", args.data_nodes, args.index_nodes),
    };
    println!(
        "bench index-rebalance: {shape}; {} indexes of {} partitions over {} documents ({}), \
         {} data partitions; foreground {} ops/s; every node on this machine's {cores} cores and one disk",
        args.indexes,
        args.index_partitions,
        args.docs,
        if args.indexes_after_load { "indexes created after the load" } else { "indexes created before the load" },
        args.partitions,
        args.rate
    );
    let mut outcomes = Vec::new();
    for method in &args.methods {
        if !["files", "stream", "none"].contains(&method.as_str()) {
            return Err(CliError::Bench(format!("unknown method {method:?}: files, stream or none")));
        }
        outcomes.push(scale_out(&args, method).await?);
    }
    println!("\n| scale-out | rebalance s | index stage s | index moves | by files | rebuilt | index MB moved | data moves | scan p50 / p95 / p99 ms before | scan p50 / p95 / p99 ms during | scans refused (503) | wrong answers |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for o in &outcomes {
        println!(
            "| {} | {:.2} | {} | {} | {} | {} | {:.1} | {} | {:.1} / {:.1} / {:.1} ({}) | {:.1} / {:.1} / {:.1} ({}) | {} | {} |",
            o.method,
            o.secs,
            o.index_secs.map_or("-".to_string(), |s| format!("{s:.2}")),
            o.index_moves,
            o.by_files,
            o.rebuilt,
            o.index_bytes as f64 / 1e6,
            o.data_moves,
            o.before.p50,
            o.before.p95,
            o.before.p99,
            o.before.n,
            o.during.p50,
            o.during.p95,
            o.during.p99,
            o.during.n,
            o.refused,
            o.wrong
        );
    }
    let by = |m: &str| outcomes.iter().find(|o| o.method == m);
    if let (Some(f), Some(s)) = (by("files"), by("stream")) {
        if let (Some(fi), Some(si)) = (f.index_secs, s.index_secs) {
            println!(
                "index stage by files / rebuilt from the streams: {:.1}× faster ({fi:.2} s against {si:.2} s; each beside the same data moves)",
                si / fi.max(1e-9)
            );
        }
        println!(
            "whole rebalance with index moves by files / rebuilt from the streams: {:.1}× faster ({:.2} s against {:.2} s)",
            s.secs / f.secs.max(1e-9),
            f.secs,
            s.secs
        );
    }
    if let (Some(f), Some(n)) = (by("files"), by("none")) {
        println!(
            "scale-out with {} indexes / with none: {:.2}× ({:.2} s against {:.2} s)",
            args.indexes,
            f.secs / n.secs.max(1e-9),
            f.secs,
            n.secs
        );
    }
    for o in &outcomes {
        if o.before.n > 0 && o.during.n > 0 {
            println!(
                "{}: scan p95 during / before {:.2}×, p99 {:.2}×",
                o.method,
                o.during.p95 / o.before.p95.max(1e-9),
                o.during.p99 / o.before.p99.max(1e-9)
            );
        }
    }
    if let Some(path) = &args.chart {
        let series: Vec<Series> = outcomes
            .iter()
            .filter(|o| o.method != "none")
            .map(|o| Series { name: format!("{}: scan p99 ms per second", o.method), points: o.p99_series.clone() })
            .collect();
        match line_chart(
            path,
            "index scans during a scale-out: p99 per second",
            "seconds since the rebalance started",
            "p99 ms",
            &series,
            false,
        ) {
            Ok(()) => println!("chart: {}", path.display()),
            Err(e) => println!("no chart: {e}"),
        }
    }
    if args.eq_scans > 0 {
        eq_latency(&args).await?;
    }
    if !args.no_writes {
        write_ratio(&args).await?;
    }
    Ok(())
}

/// `serve` flags of a data node: the default services with `--default-services`, else
/// `data,query` (the index on the index nodes alone).
fn data_services(default_services: bool) -> Vec<String> {
    if default_services {
        Vec::new()
    } else {
        vec!["--services".to_string(), "data,query".to_string()]
    }
}

/// Starts `data` data nodes and `index` index nodes (the first data node founds the
/// cluster), and rebalances them in. With `default_services`, the data nodes run every
/// service.
async fn start_cluster(
    label: &str,
    (data, default_services): (usize, bool),
    index: usize,
    partitions: u16,
    index_extra: &[String],
) -> Result<(Vec<Node>, Vec<Node>, String), CliError> {
    let base = vec!["--cluster-secret".to_string(), SECRET.to_string(), "--analytics-partitions".into(), "0".into()];
    let mut data_base = base.clone();
    data_base.extend(data_services(default_services));
    if default_services {
        data_base.extend(index_extra.iter().cloned());
    }
    let first = Node::start_named(&format!("ixr-{label}-d0"), partitions, &data_base)?;
    let join = crate::bench::host_port(&first.url);
    let mut joining = data_base.clone();
    joining.extend(["--join".to_string(), join.clone()]);
    let mut data_nodes = vec![first];
    for i in 1..data {
        data_nodes.push(Node::start_named(&format!("ixr-{label}-d{i}"), partitions, &joining)?);
    }
    let mut index_args = base.clone();
    index_args.extend(["--join".to_string(), join.clone(), "--services".to_string(), "index,query".to_string()]);
    index_args.extend(index_extra.iter().cloned());
    let mut index_nodes = Vec::new();
    for i in 0..index {
        index_nodes.push(Node::start_named(&format!("ixr-{label}-i{i}"), partitions, &index_args)?);
    }
    let client = Client::new(&data_nodes[0].url)?;
    wait_members(&client, data + index).await?;
    rebalance(&client, &[], None).await?;
    Ok((data_nodes, index_nodes, join))
}

/// Creates the collection and `indexes` indexes, loads the documents (the indexes created
/// before the load, or after it with `indexes_after_load`), and waits until every
/// index answers at `request_plus` for all its partitions (the foreground's scans are
/// `not_bounded`, exact only once each partition has every document). Answers the seconds
/// until every write was acknowledged, and until every index had them.
async fn prepare(
    client: &Client,
    url: &str,
    (indexes, index_partitions): (usize, u16),
    docs: usize,
    writers: usize,
    indexes_after_load: bool,
) -> Result<(f64, f64), CliError> {
    use futures::{StreamExt, TryStreamExt};
    client.create_collection("bench", None).await?;
    let create_indexes = || async {
        for n in 0..indexes {
            client.create_index("bench", &index_def(n, index_partitions)).await?;
        }
        Ok::<(), CliError>(())
    };
    if !indexes_after_load {
        create_indexes().await?;
    }
    let loaded = Instant::now();
    // `writers` slices in flight at once, each a `_bulk` of LOAD_SLICE documents.
    let slice = |first: usize| async move {
        let mut body = String::new();
        for i in first..(first + LOAD_SLICE).min(docs) {
            body.push_str(&json!({"op": "upsert", "key": format!("doc-{i:08}"), "value": document(i, 100)}).to_string());
            body.push('\n');
        }
        // A slice refused as unavailable (a node catching up with the metadata leader on
        // this busy machine) is sent again, as a client would; upserts may be repeated.
        let mut tries = 0;
        loop {
            let answer = client.bulk("bench", body.clone(), false).await?;
            let text = String::from_utf8_lossy(&answer);
            match text.lines().find(|l| l.contains("\"error\"")) {
                None => return Ok::<(), CliError>(()),
                Some(line) if line.contains("\"unavailable\"") && tries < LOAD_TRIES => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Some(line) => return Err(CliError::Bench(format!("loading: {line}"))),
            }
        }
    };
    futures::stream::iter((0..docs).step_by(LOAD_SLICE)).map(slice).buffer_unordered(writers.max(1)).try_collect::<Vec<()>>().await?;
    let acked = loaded.elapsed().as_secs_f64();
    if indexes_after_load {
        create_indexes().await?;
    }
    let http = crate::bench::http_builder().timeout(WAIT_MAX).no_proxy().build().map_err(|e| CliError::Bench(e.to_string()))?;
    for n in 0..indexes {
        let name = format!("i{n:03}");
        let deadline = Instant::now() + WAIT_MAX;
        loop {
            let r = http
                .post(format!("{url}/v1/collections/bench/indexes/{name}/scan"))
                .json(&json!({"consistency": "request_plus", "timeout_ms": 300_000, "limit": 1}))
                .send()
                .await
                .map_err(|e| CliError::Bench(e.to_string()))?;
            if r.status().is_success() {
                break;
            }
            if Instant::now() > deadline {
                return Err(CliError::Bench(format!("index {name} never became ready: {}", r.text().await.unwrap_or_default())));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    let indexed = loaded.elapsed().as_secs_f64();
    println!("loaded {docs} documents in {acked:.1} s; every one in {indexes} indexes after {indexed:.1} s");
    Ok((acked, indexed))
}

/// Writes with indexes on index nodes against none, on fresh clusters of the bench's
/// shape: the seconds until `docs` documents are acknowledged, and until indexed.
async fn write_ratio(args: &IndexRebalanceArgs) -> Result<(), CliError> {
    println!(
        "\n--- writes: {} documents with 0 and with 5 indexes placed on the index nodes, {} _bulk calls in flight",
        args.docs, args.writers
    );
    let mut rows = Vec::new();
    for indexes in [0usize, 5] {
        let (data_nodes, idx, _) =
            start_cluster(&format!("writes-{indexes}"), (args.data_nodes, args.default_services), index_nodes(args), args.partitions, &[])
                .await?;
        let client = Client::new(&data_nodes[0].url)?;
        let (acked, indexed) =
            prepare(&client, &data_nodes[0].url, (indexes, args.index_partitions), args.docs, args.writers, false).await?;
        rows.push((indexes, acked, indexed));
        drop((data_nodes, idx));
    }
    println!("\n| indexes | writes acknowledged s | × none | indexed s |");
    println!("|---|---|---|---|");
    let none = rows.first().map_or(1.0, |r| r.1);
    for (n, acked, indexed) in &rows {
        println!("| {n} | {acked:.2} | {:.2} | {indexed:.2} |", none / acked.max(1e-9));
    }
    Ok(())
}

/// One scale-out on a fresh cluster: prepare, measure, add a data node and an index node.
async fn scale_out(args: &IndexRebalanceArgs, method: &str) -> Result<Outcome, CliError> {
    println!("\n--- scale-out, index copies by {method}");
    let extra: Vec<String> = if method == "stream" { vec!["--copy-by-stream".into()] } else { Vec::new() };
    let (data_nodes, index_nodes, join) =
        start_cluster(method, (args.data_nodes, args.default_services), self::index_nodes(args), args.partitions, &extra).await?;
    let client = Client::new(&data_nodes[0].url)?;
    let indexes = if method == "none" { 0 } else { args.indexes };
    prepare(&client, &data_nodes[0].url, (indexes, args.index_partitions), args.docs, args.writers, args.indexes_after_load).await?;
    let expected = Arc::new(expected(args.docs));
    let targets: Vec<String> = data_nodes.iter().chain(&index_nodes).map(|n| n.url.clone()).collect();
    let log: Arc<Mutex<Vec<Scan>>> = Arc::default();
    let writes: Arc<Mutex<Vec<Scan>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let began = Instant::now();
    let logs = (Arc::clone(&log), Arc::clone(&writes));
    let fg = tokio::spawn(foreground(targets, args.docs, indexes, args.rate, Arc::clone(&expected), logs, began, Arc::clone(&stop)));
    tokio::time::sleep(Duration::from_secs(args.before_secs)).await;
    let base = vec!["--cluster-secret".to_string(), SECRET.to_string(), "--analytics-partitions".into(), "0".into(), "--join".into(), join];
    let mut data_args = base.clone();
    data_args.extend(data_services(args.default_services));
    let mut index_args = base.clone();
    index_args.extend(["--services".to_string(), "index,query".to_string()]);
    if args.default_services {
        data_args.extend(extra);
    } else {
        index_args.extend(extra);
    }
    let newcomers = tokio::task::block_in_place(|| -> Result<Vec<Node>, CliError> {
        let mut started = vec![Node::start_named(&format!("ixr-{method}-dnew"), args.partitions, &data_args)?];
        if !args.default_services {
            started.push(Node::start_named(&format!("ixr-{method}-inew"), args.partitions, &index_args)?);
        }
        Ok(started)
    })?;
    wait_members(&client, data_nodes.len() + index_nodes.len() + newcomers.len()).await?;
    let start = began.elapsed().as_secs_f64();
    println!("the rebalance starts at {start:.2} s");
    let status = rebalance(&client, &[], None).await?;
    let end = began.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    fg.await.map_err(|e| CliError::Bench(e.to_string()))?;
    let moves = status["moves"].as_array().cloned().unwrap_or_default();
    let index_moves: Vec<&Value> = moves.iter().filter(|m| m["kind"] == "index").collect();
    let log: Vec<Scan> = std::mem::take(&mut *log.lock().map_err(|_| CliError::Bench("the load's log".into()))?);
    let ms_in = |from: f64, to: f64| log.iter().filter(|s| s.ok && s.at >= from && s.at < to).map(|s| s.ms).collect::<Vec<f64>>();
    let mut p99_series = Vec::new();
    let mut t = start.floor();
    while t < end + 2.0 {
        let p = percentiles(ms_in(t, t + 1.0));
        if p.n > 0 {
            p99_series.push((t - start, p.p99));
        }
        t += 1.0;
    }
    // The leader's own measure of the rebalance; the bench polls its status every
    // `SAMPLE` (500 ms), so `end - start` is that coarse.
    let secs = status["elapsed_s"].as_f64().filter(|s| *s > 0.0).unwrap_or(end - start);
    let info = client.cluster().await?;
    // The node that joined to hold index partitions: the index node, or the one newcomer.
    let new_index = newcomers.last().and_then(|n| node_id(&info, &n.url)).unwrap_or(0);
    println!(
        "{method}: rebalance {secs:.2} s, {} index moves onto node {new_index}, {} data moves",
        index_moves.len(),
        moves.len() - index_moves.len()
    );
    let writes: Vec<Scan> = std::mem::take(&mut *writes.lock().map_err(|_| CliError::Bench("the load's log".into()))?);
    let during: Vec<&Scan> = writes.iter().filter(|w| w.at >= start && w.at < end + 2.0).collect();
    println!(
        "{method}: foreground writes from the rebalance's start to 2 s after it: {}, refused {}, slowest {:.0} ms",
        during.len(),
        during.iter().filter(|w| !w.ok).count(),
        during.iter().map(|w| w.ms).fold(0.0, f64::max)
    );
    // Copies rebuilt from the streams besides the moves: ones a node found placed on it and
    // missing (a copy dropped by mistake and built again shows only there).
    let http =
        crate::bench::http_builder().timeout(Duration::from_secs(30)).no_proxy().build().map_err(|e| CliError::Bench(e.to_string()))?;
    let mut rebuilt_placed = 0.0;
    for node in data_nodes.iter().chain(index_nodes.iter()).chain(newcomers.iter()) {
        rebuilt_placed += node.metric(&http, "shoal_index_partitions_rebuilt_total").await?;
    }
    if rebuilt_placed > 0.0 {
        println!("{method}: index partitions found placed and missing, rebuilt from the streams: {rebuilt_placed}");
    }
    drop(newcomers);
    Ok(Outcome {
        method: method.to_string(),
        secs,
        index_secs: status["index_stage_s"].as_f64(),
        index_moves: index_moves.len(),
        by_files: index_moves.iter().filter(|m| m["method"] == "files").count(),
        rebuilt: index_moves.iter().filter(|m| m["method"] == "stream").count() + rebuilt_placed as usize,
        index_bytes: index_moves.iter().map(|m| m["bytes_done"].as_u64().unwrap_or(0)).sum(),
        data_moves: moves.len() - index_moves.len(),
        before: percentiles(ms_in(0.0, start)),
        during: percentiles(ms_in(start, end)),
        refused: log.iter().filter(|s| !s.ok).count(),
        wrong: log.iter().filter(|s| s.ok && !s.exact).count(),
        p99_series,
    })
}

/// Sends `rate` operations per second until `stop`: half `eq` scans of a random index and
/// value at a random node (checked against `expected`), half upserts of a random document
/// that change no indexed field. With no index, only the upserts.
#[allow(clippy::too_many_arguments)]
async fn foreground(
    targets: Vec<String>,
    docs: usize,
    indexes: usize,
    rate: u64,
    expected: Arc<Vec<Vec<usize>>>,
    (log, writes): (Log, Log),
    began: Instant,
    stop: Arc<std::sync::atomic::AtomicBool>,
) {
    let http = crate::bench::http_builder().timeout(Duration::from_secs(30)).no_proxy().build().unwrap_or_default();
    let mut rng = rand::rngs::StdRng::seed_from_u64(41);
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(1) as f64));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut inflight = Vec::new();
    let mut i = 0usize;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        ticker.tick().await;
        let target = targets[rng.random_range(0..targets.len())].clone();
        let http = http.clone();
        if indexes > 0 && i.is_multiple_of(2) {
            let n = rng.random_range(0..indexes);
            let value = rng.random_range(0..VALUES);
            let want = expected[n % FIELDS as usize][value as usize];
            let (log, expected_rows) = (Arc::clone(&log), want);
            inflight.push(tokio::spawn(async move {
                let at = began.elapsed().as_secs_f64();
                let sent = Instant::now();
                let r = http
                    .post(format!("{target}/v1/collections/bench/indexes/i{n:03}/scan"))
                    .json(&json!({"eq": [value], "limit": 100_000}))
                    .send()
                    .await;
                let (ok, exact) = match r {
                    Ok(r) if r.status().is_success() => {
                        let v: Value = r.json().await.unwrap_or(Value::Null);
                        let got = v["rows"].as_array().map_or(0, Vec::len);
                        if got != expected_rows {
                            println!("WRONG ANSWER at {at:.2} s: i{n:03} eq {value} from {target}: {got} rows, {expected_rows} expected");
                        }
                        (true, got == expected_rows)
                    }
                    _ => (false, false),
                };
                let ms = sent.elapsed().as_secs_f64() * 1000.0;
                if let Ok(mut log) = log.lock() {
                    log.push(Scan { at, ms, ok, exact });
                }
            }));
        } else {
            let d = rng.random_range(0..docs.max(1));
            let writes = Arc::clone(&writes);
            inflight.push(tokio::spawn(async move {
                let (at, sent) = (began.elapsed().as_secs_f64(), Instant::now());
                let r = http.put(format!("{target}/v1/collections/bench/docs/doc-{d:08}")).json(&document(d, 100)).send().await;
                let ok = r.is_ok_and(|r| r.status().is_success());
                if let Ok(mut writes) = writes.lock() {
                    writes.push(Scan { at, ms: sent.elapsed().as_secs_f64() * 1000.0, ok, exact: ok });
                }
            }));
        }
        i += 1;
        inflight.retain(|t: &tokio::task::JoinHandle<()>| !t.is_finished());
    }
    for t in inflight {
        let _ = t.await;
    }
}

/// Scans per shape in one turn of the interleaved eq measurement.
const EQ_TURN_SCANS: usize = 50;

/// Seed 002 at cluster scale: `eq` scan latency (closed loop, through the first data node)
/// with 1 and 4 index nodes, and with 16, 64 and 256 data partitions on 3; the shapes
/// compared run at once, their scans interleaved.
async fn eq_latency(args: &IndexRebalanceArgs) -> Result<(), CliError> {
    println!(
        "\n--- eq scan latency by cluster shape ({} scans each, one index of {} partitions, {} documents)",
        args.eq_scans, args.index_partitions, args.docs
    );
    // The shapes compared run side by side, their scans interleaved in turns of
    // `EQ_TURN_SCANS` (the order rotating each turn), so that the machine's drift on these
    // shared cores weighs on each alike: index nodes (1 and 4), then data partitions (16,
    // 64 and 256 on 3 index nodes).
    let groups: [&[(usize, u16)]; 2] = [&[(1, 64), (4, 64)], &[(3, 16), (3, 64), (3, 256)]];
    let mut rows = Vec::new();
    for group in groups {
        let mut clusters = Vec::new();
        for &(index_nodes, partitions) in group {
            let label = format!("eq-{index_nodes}-{partitions}");
            let (data_nodes, idx, _) = start_cluster(&label, (1, false), index_nodes, partitions, &[]).await?;
            let client = Client::new(&data_nodes[0].url)?;
            prepare(&client, &data_nodes[0].url, (1, args.index_partitions), args.docs, args.writers, false).await?;
            clusters.push((index_nodes, partitions, data_nodes, idx, Vec::with_capacity(args.eq_scans), 0usize));
        }
        let http =
            crate::bench::http_builder().timeout(Duration::from_secs(30)).no_proxy().build().map_err(|e| CliError::Bench(e.to_string()))?;
        let expected = expected(args.docs);
        let turns = args.eq_scans.div_ceil(EQ_TURN_SCANS);
        for turn in 0..turns {
            let n = clusters.len();
            for k in 0..n {
                let (_, _, data_nodes, _, ms, wrong) = &mut clusters[(turn + k) % n];
                let from = turn * EQ_TURN_SCANS;
                for s in from..(from + EQ_TURN_SCANS).min(args.eq_scans) {
                    let value = s as u64 % VALUES;
                    let sent = Instant::now();
                    let v: Value = http
                        .post(format!("{}/v1/collections/bench/indexes/i000/scan", data_nodes[0].url))
                        .json(&json!({"eq": [value], "limit": 100_000}))
                        .send()
                        .await
                        .map_err(|e| CliError::Bench(e.to_string()))?
                        .json()
                        .await
                        .map_err(|e| CliError::Bench(e.to_string()))?;
                    ms.push(sent.elapsed().as_secs_f64() * 1000.0);
                    *wrong += usize::from(v["rows"].as_array().map_or(0, Vec::len) != expected[0][value as usize]);
                }
            }
        }
        for (index_nodes, partitions, data_nodes, idx, ms, wrong) in clusters {
            let p = percentiles(ms);
            println!("{index_nodes} index nodes, {partitions} data partitions: eq p50 {:.2} ms, p99 {:.2} ms, {wrong} wrong", p.p50, p.p99);
            rows.push((index_nodes, partitions, p, wrong));
            drop((data_nodes, idx));
        }
    }
    rows.sort_by_key(|r| (r.0, r.1));
    println!("\n| index nodes | data partitions | eq p50 ms | eq p99 ms | wrong |");
    println!("|---|---|---|---|---|");
    for (n, parts, p, wrong) in &rows {
        println!("| {n} | {parts} | {:.2} | {:.2} | {wrong} |", p.p50, p.p99);
    }
    let p50 = |n: usize, parts: u16| rows.iter().find(|r| r.0 == n && r.1 == parts).map(|r| r.2.p50);
    if let (Some(one), Some(four)) = (p50(1, 64), p50(4, 64)) {
        println!("eq p50 on 4 index nodes / on 1: {:.2}×", four / one.max(1e-9));
    }
    let spread: Vec<f64> = [16u16, 64, 256].iter().filter_map(|&parts| p50(3, parts)).collect();
    if let (Some(lo), Some(hi)) = (spread.iter().copied().reduce(f64::min), spread.iter().copied().reduce(f64::max)) {
        println!("eq p50 across 16/64/256 data partitions: highest / lowest {:.2}×", hi / lo.max(1e-9));
    }
    Ok(())
}
