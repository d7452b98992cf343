//! Load generators and experiments, all under `shoal bench`, kept apart from the server's
//! wiring: `kv` (seed 001's baseline: blocking gets of one small document from many
//! connections) and `load` (bulk load through `_bulk`) here; seed 002's `index`, seed 004's
//! `analytics` (with the TPC-DS and TPC-H generators `tpcds`, `tpch`), the partition
//! `copy`, and the charts they draw, in the submodules.
//!
//! The kv generator drives raw hyper HTTP/1.1 connections, one per worker, so that the
//! client's own cost stays small next to the server's on a shared machine.

pub mod analytics;
pub mod chart;
pub mod cluster;
pub mod copy;
pub mod index;
pub mod index_parts;
pub mod index_rebalance;
pub mod rebalance;
pub mod tpcds;
pub mod tpch;

use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::{Args, Subcommand};
use futures::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use shoal_client::{Client, PutOptions};

use crate::cli::CliError;

#[derive(Subcommand)]
pub enum BenchCmd {
    /// Many connections doing blocking gets and upserts of one small document.
    Kv(KvArgs),
    /// Bulk-load generated documents through `_bulk`.
    Load(LoadArgs),
    /// Seed 001's experiment: multi-path lookups in one document from many connections.
    Subdoc(SubdocArgs),
    /// Seed 002's experiment: index builds and per-user reads across partition counts
    /// (starts its own nodes).
    Index(crate::bench::index::IndexArgs),
    /// Issue 41's index partitions on one node: write throughput with five indexes of 1 and
    /// of N parts against none, and eq and range scans over them (starts its own nodes).
    IndexParts(crate::bench::index_parts::IndexPartsArgs),
    /// Seed 000 re-run (issue 41): a scale-out with many indexes on index nodes, their
    /// partitions moved as files against rebuilt from the streams and against no index; and
    /// eq scan latency by index nodes and data partitions (starts its own nodes).
    IndexRebalance(crate::bench::index_rebalance::IndexRebalanceArgs),
    /// Seed 004's experiment: TPC-DS query 3 over loaded JSON documents (starts its own node).
    Analytics(crate::bench::analytics::AnalyticsArgs),
    /// Issue 5's point query: `/v1/query` through an index, 50 rows, one at a time.
    QueryPoint(crate::bench::analytics::PointArgs),
    /// Write seed 004's TPC-DS-shaped tables as NDJSON files.
    TpcdsGen(crate::bench::analytics::GenArgs),
    /// Write TPC-H's eight tables as NDJSON files (`bench/tpch_diff.sh` tests SQL answers on them).
    TpchGen(crate::bench::tpch::GenArgs),
    /// Issue 12's partition copy: export → ingest of every partition, in process (no node).
    Copy(crate::bench::copy::CopyArgs),
    /// Issue 13's cluster figures: gets and upserts (none, persist, majority) through a smart
    /// client, 1 node against N nodes with a replica (starts its own nodes).
    Cluster(crate::bench::cluster::ClusterArgs),
    /// Seed 003's experiment (issue 14): a swap rebalance under foreground load, by files and
    /// by the change stream, beside the engine's copy ceiling and `dd` (starts its own nodes).
    Rebalance(crate::bench::rebalance::RebalanceArgs),
}

#[derive(Args)]
pub struct SubdocArgs {
    /// `subdoc` (multi-path lookup) or `regular` (whole-document get).
    #[arg(long, default_value = "subdoc")]
    mode: String,
    #[arg(long, default_value_t = 200)]
    parallel: usize,
    #[arg(long, default_value_t = 50)]
    repeat: usize,
    /// Sub-keys in the document: 5 gives ~195 bytes, 10,000 gives ~310 KB.
    #[arg(long, default_value_t = 10_000)]
    keys: usize,
    /// Paths per lookup.
    #[arg(long, default_value_t = 10)]
    search_keys: usize,
    /// Where the paths are: easy (start), medium (middle), hard (end).
    #[arg(long, default_value = "hard")]
    difficulty: String,
    /// Look up a document that does not exist.
    #[arg(long)]
    search_non_existent: bool,
    #[arg(long, default_value = "bench")]
    collection: String,
    #[arg(long)]
    json: bool,
    /// Reproduce seed 001's scenarios A (document size) and B (paths per lookup) as a table
    /// and PNG charts in `--out-dir`, with `--repeat` requests per connection per point.
    #[arg(long)]
    sweep: bool,
    /// Seed 001's noisy neighbour: p99 of `--neighbours` connections doing small gets, alone
    /// and while `--parallel` connections flood lookups of the large document.
    #[arg(long)]
    noisy_neighbour: bool,
    /// Connections doing small gets in `--noisy-neighbour`.
    #[arg(long, default_value_t = 20)]
    neighbours: usize,
    /// `nice` of the flood's client threads in `--noisy-neighbour` (0..=19). The load
    /// generators share the server's cores; a flood client at the neighbours' priority
    /// measures the client's own queueing as much as the server's.
    #[arg(long, default_value_t = 19)]
    flood_nice: i32,
    /// Internal: run only the flood of `--noisy-neighbour` (the lookups of the large document,
    /// which must exist) until stdin closes, say `flood warm` once every connection is busy,
    /// then print its report as JSON. `--noisy-neighbour` starts this as its own process.
    #[arg(long, hide = true)]
    flood_child: bool,
    /// Where `--sweep` writes its table and charts.
    #[arg(long, default_value = "bench/results")]
    out_dir: std::path::PathBuf,
}

#[derive(Args)]
pub struct KvArgs {
    /// Concurrent connections, each doing one request at a time.
    #[arg(long, default_value_t = 200)]
    parallel: usize,
    /// Requests per connection.
    #[arg(long, default_value_t = 1000)]
    repeat: usize,
    /// get, upsert, or both (one after the other).
    #[arg(long, default_value = "both")]
    op: String,
    /// Sub-keys in the document (5 gives seed 001's 195-byte document).
    #[arg(long, default_value_t = 5)]
    keys: usize,
    /// Ask for a key that does not exist (seed 001's `--search-non-existent`).
    #[arg(long)]
    search_non_existent: bool,
    #[arg(long, default_value = "bench")]
    collection: String,
    /// Print one JSON object per run instead of the report line.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct LoadArgs {
    #[arg(long, default_value_t = 1_000_000)]
    docs: usize,
    /// Lines per `_bulk` request.
    #[arg(long, default_value_t = 5000)]
    batch: usize,
    /// Requests in flight.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    #[arg(long, default_value = "load")]
    collection: String,
    #[arg(long)]
    persist: bool,
}

pub async fn run(url: &str, cmd: BenchCmd) -> Result<(), CliError> {
    match cmd {
        BenchCmd::Kv(args) => kv(url, args).await,
        BenchCmd::Load(args) => load(url, args).await,
        BenchCmd::Subdoc(args) => subdoc(url, args).await,
        BenchCmd::Index(args) => crate::bench::index::run(args).await,
        BenchCmd::IndexParts(args) => crate::bench::index_parts::run(args).await,
        BenchCmd::IndexRebalance(args) => crate::bench::index_rebalance::run(args).await,
        BenchCmd::Analytics(args) => crate::bench::analytics::run(args).await,
        BenchCmd::TpcdsGen(args) => crate::bench::analytics::generate(args),
        BenchCmd::TpchGen(args) => crate::bench::tpch::generate(args),
        BenchCmd::QueryPoint(args) => crate::bench::analytics::point(args).await,
        BenchCmd::Copy(args) => {
            tokio::task::spawn_blocking(move || crate::bench::copy::run(args)).await.map_err(|e| CliError::Bench(e.to_string()))?
        }
        BenchCmd::Cluster(args) => crate::bench::cluster::run(args).await,
        BenchCmd::Rebalance(args) => crate::bench::rebalance::run(args).await,
    }
}

/// Seed 001's sample document: `{"key": ..., "data": {"subkey-000000": "value-000000", ...}}`.
pub fn seed_document(key: &str, subkeys: usize) -> String {
    let mut data = serde_json::Map::new();
    for i in 0..subkeys {
        data.insert(format!("subkey-{i:06}"), serde_json::Value::String(format!("value-{i:06}")));
    }
    serde_json::json!({"key": key, "data": data}).to_string()
}

async fn ensure_collection(client: &Client, name: &str) -> Result<(), CliError> {
    match client.create_collection(name, None).await {
        Ok(()) => Ok(()),
        Err(e) if e.code() == Some("collection_exists") => Ok(()),
        Err(e) => Err(e.into()),
    }
}

struct RunReport {
    successes: u64,
    errors: u64,
    duration: Duration,
    latencies_us: Vec<u32>,
}

async fn kv(url: &str, args: KvArgs) -> Result<(), CliError> {
    let client = Client::new(url)?;
    ensure_collection(&client, &args.collection).await?;
    let key = "test-regular";
    let doc = seed_document(key, args.keys);
    client.put(&args.collection, key, doc.clone(), &PutOptions::default()).await?;
    let authority = url.trim_end_matches('/').to_string();
    let target_key = if args.search_non_existent { "not-exists" } else { key };
    let path = format!("/v1/collections/{}/docs/{}", args.collection, target_key);
    if !args.json {
        println!(
            "benchmark params: keys={}, not-existent={}, repeats={}, parallel={}",
            args.keys, args.search_non_existent, args.repeat, args.parallel
        );
        println!("Generated doc with subkeys: {}, byte size is: {}", args.keys, doc.len());
    }
    let ops: Vec<&str> = match args.op.as_str() {
        "both" => vec!["get", "upsert"],
        "get" => vec!["get"],
        "upsert" => vec!["upsert"],
        other => return Err(CliError::Usage(format!("--op is get, upsert or both, not {other}"))),
    };
    for op in ops {
        let method = if op == "get" { hyper::Method::GET } else { hyper::Method::PUT };
        let body = if op == "get" { Bytes::new() } else { Bytes::from(doc.clone()) };
        let report = drive(&authority, &path, method, body, args.parallel, args.repeat).await?;
        print_report(op, &report, args.json);
    }
    Ok(())
}

/// The password of the admin of the nodes a bench starts (`SHOAL_ADMIN_PASSWORD`).
pub(crate) const BENCH_ADMIN_PASSWORD: &str = "bench-admin-password";

/// `host:port` of `url` (its scheme, credentials and path dropped).
pub(crate) fn host_port(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    authority.rsplit_once('@').map_or(authority, |(_, hp)| hp).to_string()
}

/// The Basic `Authorization` header of the credentials in `url`, if it carries any.
pub(crate) fn basic_of(url: &str) -> Option<String> {
    use base64::Engine as _;
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    let (userinfo, _) = authority.rsplit_once('@')?;
    let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
    let decode = |s: &str| percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned();
    let pair = format!("{}:{}", decode(user), decode(password));
    Some(format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(pair)))
}

/// An HTTP client whose requests carry the bench nodes' admin credentials (for URLs built
/// from member addresses, which carry none).
pub(crate) fn http_builder() -> reqwest::ClientBuilder {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(Ok(v)) = basic_of(&format!("http://admin:{BENCH_ADMIN_PASSWORD}@x")).map(|a| reqwest::header::HeaderValue::from_str(&a)) {
        headers.insert(reqwest::header::AUTHORIZATION, v);
    }
    shoal_client::install_crypto();
    reqwest::Client::builder().default_headers(headers)
}

/// Runs `parallel` connections, each sending `repeat` requests one after the other.
/// `authority` is the node's URL (with its credentials, if any).
async fn drive(
    authority: &str,
    path: &str,
    method: hyper::Method,
    body: Bytes,
    parallel: usize,
    repeat: usize,
) -> Result<RunReport, CliError> {
    drive_until(authority, path, method, body, parallel, repeat, None).await
}

/// Lets another task stop a [`drive_until`] run and see how far it got.
#[derive(Default)]
struct RunControl {
    stop: std::sync::atomic::AtomicBool,
    requests: std::sync::atomic::AtomicU64,
}

/// Like [`drive`], but every connection also stops early once `control.stop` is set.
async fn drive_until(
    authority: &str,
    path: &str,
    method: hyper::Method,
    body: Bytes,
    parallel: usize,
    repeat: usize,
    control: Option<std::sync::Arc<RunControl>>,
) -> Result<RunReport, CliError> {
    let auth = basic_of(authority);
    let authority = host_port(authority);
    let authority = authority.as_str();
    let mut conns = Vec::with_capacity(parallel);
    for _ in 0..parallel {
        let tcp = tokio::net::TcpStream::connect(authority).await?;
        tcp.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(tcp))
            .await
            .map_err(|e| CliError::Usage(format!("handshake: {e}")))?;
        tokio::spawn(conn);
        conns.push(sender);
    }
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(parallel);
    for mut sender in conns {
        let (method, body, path, authority, auth) = (method.clone(), body.clone(), path.to_string(), authority.to_string(), auth.clone());
        let control = control.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(repeat.min(1 << 16));
            let (mut ok, mut err) = (0u64, 0u64);
            for _ in 0..repeat {
                if control.as_ref().is_some_and(|c| c.stop.load(std::sync::atomic::Ordering::Relaxed)) {
                    break;
                }
                let mut req = hyper::Request::builder()
                    .method(method.clone())
                    .uri(path.as_str())
                    .header("host", authority.as_str())
                    .header("content-type", "application/json");
                if let Some(a) = &auth {
                    req = req.header("authorization", a.as_str());
                }
                let req = req.body(Full::new(body.clone()));
                let Ok(req) = req else {
                    err += 1;
                    continue;
                };
                let t = Instant::now();
                match sender.send_request(req).await {
                    Ok(resp) => {
                        let success = resp.status().is_success();
                        let drained = resp.into_body().collect().await.is_ok();
                        if success && drained {
                            ok += 1
                        } else {
                            err += 1
                        }
                    }
                    Err(_) => {
                        err += 1;
                        break;
                    }
                }
                lat.push(t.elapsed().as_micros().min(u128::from(u32::MAX)) as u32);
                if let Some(c) = &control {
                    c.requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
            (ok, err, lat)
        }));
    }
    let mut report = RunReport {
        successes: 0,
        errors: 0,
        duration: Duration::ZERO,
        latencies_us: Vec::with_capacity(parallel.saturating_mul(repeat).min(1 << 24)),
    };
    for task in tasks {
        let (ok, err, lat) = task.await.map_err(|e| CliError::Usage(format!("worker failed: {e}")))?;
        report.successes += ok;
        report.errors += err;
        report.latencies_us.extend(lat);
    }
    report.duration = start.elapsed();
    report.latencies_us.sort_unstable();
    Ok(report)
}

/// The `p` quantile of sorted microsecond latencies, in milliseconds.
pub(crate) fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    f64::from(sorted[i.min(sorted.len() - 1)]) / 1000.0
}

fn print_report(op: &str, r: &RunReport, json: bool) {
    let secs = r.duration.as_secs_f64().max(1e-9);
    let total = (r.successes + r.errors) as f64;
    let (p50, p99, p999) = (percentile(&r.latencies_us, 0.50), percentile(&r.latencies_us, 0.99), percentile(&r.latencies_us, 0.999));
    if json {
        let out = serde_json::json!({
            "op": op, "successes": r.successes, "errors": r.errors, "duration_s": secs,
            "rps": total / secs, "success_rps": r.successes as f64 / secs,
            "p50_ms": p50, "p99_ms": p99, "p999_ms": p999,
        });
        println!("{out}");
    } else {
        println!(
            "{op} report: successes: {}, errors: {}, duration: {secs:.3}s, rps: {:.1}, success rps: {:.1}, p50: {p50:.3} ms, p99: {p99:.3} ms, p999: {p999:.3} ms",
            r.successes,
            r.errors,
            total / secs,
            r.successes as f64 / secs
        );
    }
}

/// A generated document of about 200 bytes.
/// Writes a bench's result table as `out_dir/name` (nothing when `out_dir` is empty).
pub(crate) fn write_result(out_dir: &std::path::Path, name: &str, text: &str) -> Result<(), CliError> {
    if out_dir.as_os_str().is_empty() {
        return Ok(());
    }
    std::fs::create_dir_all(out_dir)?;
    let file = out_dir.join(name);
    std::fs::write(&file, text)?;
    println!("wrote {}", file.display());
    Ok(())
}

/// How [`bulk_upsert`] sends: documents per `_bulk` request, requests in flight, durability.
pub(crate) struct BulkPlan {
    pub batch: usize,
    pub concurrency: usize,
    pub persist: bool,
}

/// Upserts documents `0..docs` through `_bulk` as `{key_prefix}{i:08}` → `doc(i)`.
/// Returns (sent, failed).
pub(crate) async fn bulk_upsert(
    client: &Client,
    collection: &str,
    docs: usize,
    plan: &BulkPlan,
    key_prefix: &str,
    doc: impl Fn(usize) -> String,
) -> Result<(u64, u64), CliError> {
    let (doc, batch, persist) = (&doc, plan.batch, plan.persist);
    let mut stream = futures::stream::iter((0..docs.div_ceil(batch.max(1))).map(|b| {
        let client = client.clone();
        let (from, to) = (b * batch, ((b + 1) * batch).min(docs));
        async move {
            let mut chunk = String::with_capacity((to - from) * 400);
            for i in from..to {
                chunk.push_str(&format!(r#"{{"op":"upsert","key":"{key_prefix}{i:08}","value":{}}}"#, doc(i)));
                chunk.push('\n');
            }
            let answer = client.bulk(collection, chunk, persist).await?;
            let failed: Vec<&[u8]> = answer.split(|&b| b == b'\n').filter(|l| l.windows(8).any(|w| w == b"\"error\":")).collect();
            if let Some(first) = failed.first() {
                eprintln!("{collection}: {} lines failed, the first: {}", failed.len(), String::from_utf8_lossy(first));
            }
            Ok::<_, CliError>(((to - from) as u64, failed.len() as u64))
        }
    }))
    .buffer_unordered(plan.concurrency.max(1));
    let (mut sent, mut failed) = (0u64, 0u64);
    while let Some(r) = stream.next().await {
        let (n, f) = r?;
        sent += n;
        failed += f;
    }
    Ok((sent, failed))
}

fn load_document(i: usize) -> String {
    format!(
        r#"{{"id":{i},"name":"user-{i:08}","email":"user{i}@example.com","group":{},"active":{},"score":{}.5,"tags":["alpha","beta"],"note":"generated for the shoal load benchmark"}}"#,
        i % 100,
        i.is_multiple_of(2),
        i % 1000
    )
}

async fn load(url: &str, args: LoadArgs) -> Result<(), CliError> {
    if args.batch == 0 || args.concurrency == 0 {
        return Err(CliError::Usage("--batch and --concurrency must be at least 1".into()));
    }
    let client = Client::new(url)?;
    ensure_collection(&client, &args.collection).await?;
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let sampler = {
        let (client, peak) = (client.clone(), peak.clone());
        tokio::spawn(async move {
            loop {
                if let Ok(node) = client.node().await {
                    let rss = node["memory"]["rss_bytes"].as_u64().unwrap_or(0);
                    peak.fetch_max(rss, std::sync::atomic::Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let start = Instant::now();
    let (sent, failed) = {
        let plan = BulkPlan { batch: args.batch, concurrency: args.concurrency, persist: args.persist };
        bulk_upsert(&client, &args.collection, args.docs, &plan, "doc-", load_document).await?
    };
    let secs = start.elapsed().as_secs_f64();
    sampler.abort();
    let node = client.node().await?;
    let peak_hwm = node["memory"]["peak_rss_bytes"].as_u64().unwrap_or(0);
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!(
        "load report: docs: {sent}, failed: {failed}, duration: {secs:.2}s, docs/s: {:.0}, server peak RSS sampled: {:.1} MiB, server VmHWM: {:.1} MiB",
        sent as f64 / secs,
        mib(peak.load(std::sync::atomic::Ordering::Relaxed)),
        mib(peak_hwm)
    );
    Ok(())
}

/// The sub-keys a lookup asks for: the first ones (easy), the middle (medium) or the last,
/// newest first (hard), as seed 001's tool does.
pub fn search_paths(keys: usize, search: usize, difficulty: &str) -> Result<Vec<String>, CliError> {
    let search = search.min(keys);
    let indexes: Vec<usize> = match difficulty {
        "easy" => (0..search).collect(),
        "medium" => (keys / 2..keys / 2 + search).collect(),
        "hard" => (keys - search..keys).rev().collect(),
        other => return Err(CliError::Usage(format!("--difficulty is easy, medium or hard, not {other}"))),
    };
    Ok(indexes.into_iter().map(|i| format!("data.subkey-{i:06}")).collect())
}

async fn subdoc(url: &str, args: SubdocArgs) -> Result<(), CliError> {
    let client = Client::new(url)?;
    ensure_collection(&client, &args.collection).await?;
    if args.sweep {
        return sweep(&client, url, &args).await;
    }
    if args.flood_child {
        return flood_child(url, &args).await;
    }
    if args.noisy_neighbour {
        return noisy_neighbour(&client, url, &args).await;
    }
    let regular = match args.mode.as_str() {
        "regular" => true,
        "subdoc" => false,
        other => return Err(CliError::Usage(format!("--mode is subdoc or regular, not {other}"))),
    };
    let key = if regular { "test-regular" } else { "test-subdoc" };
    let doc = seed_document(key, args.keys);
    client.put(&args.collection, key, doc.clone(), &PutOptions::default()).await?;
    let target = if args.search_non_existent { "not-exists" } else { key };
    let paths = search_paths(args.keys, args.search_keys, &args.difficulty)?;
    let authority = url.trim_end_matches('/').to_string();
    let base = format!("/v1/collections/{}/docs/{target}", args.collection);
    if !args.json {
        println!(
            "benchmark params: keys={}, level={}, search-keys={}, repeats={}, parallel={}",
            args.keys, args.difficulty, args.search_keys, args.repeat, args.parallel
        );
        println!("Generated doc with subkeys: {}, byte size is: {}", args.keys, doc.len());
        if regular {
            println!("search for key: {target}");
        } else {
            println!("search for subkeys [level={}]: {paths:?}", args.difficulty);
        }
    }
    let report = if regular {
        drive(&authority, &base, hyper::Method::GET, Bytes::new(), args.parallel, args.repeat).await?
    } else {
        let specs: Vec<serde_json::Value> = paths.iter().map(|p| serde_json::json!({"op": "get", "path": p})).collect();
        let body = Bytes::from(serde_json::json!({ "specs": specs }).to_string());
        drive(&authority, &format!("{base}/lookup"), hyper::Method::POST, body, args.parallel, args.repeat).await?
    };
    print_report(if regular { "regular" } else { "subdoc" }, &report, args.json);
    Ok(())
}

/// Requests/s of one sweep point: a lookup of `search` paths at `difficulty` in a document
/// of `keys` sub-keys (or a whole-document get when `difficulty` is "regular").
async fn sweep_point(client: &Client, url: &str, args: &SubdocArgs, keys: usize, search: usize, difficulty: &str) -> Result<f64, CliError> {
    let key = format!("sweep-{keys}");
    if client.get(&args.collection, &key, None, None).await.is_err() {
        client.put(&args.collection, &key, seed_document(&key, keys), &PutOptions::default()).await?;
    }
    let authority = url.trim_end_matches('/').to_string();
    let base = format!("/v1/collections/{}/docs/{key}", args.collection);
    let report = if difficulty == "regular" {
        drive(&authority, &base, hyper::Method::GET, Bytes::new(), args.parallel, args.repeat).await?
    } else {
        let specs: Vec<serde_json::Value> =
            search_paths(keys, search, difficulty)?.iter().map(|p| serde_json::json!({"op": "get", "path": p})).collect();
        let body = Bytes::from(serde_json::json!({ "specs": specs }).to_string());
        drive(&authority, &format!("{base}/lookup"), hyper::Method::POST, body, args.parallel, args.repeat).await?
    };
    if report.errors > 0 {
        return Err(CliError::Usage(format!("{} errors at keys={keys} search={search} {difficulty}", report.errors)));
    }
    Ok(report.successes as f64 / report.duration.as_secs_f64().max(1e-9))
}

/// The flood's path and body: lookups of `--search-keys` paths at `--difficulty` in the large
/// neighbour document.
fn flood_request(args: &SubdocArgs) -> Result<(String, Bytes), CliError> {
    let large = format!("/v1/collections/{}/docs/neighbour-large/lookup", args.collection);
    let specs: Vec<serde_json::Value> =
        search_paths(args.keys, args.search_keys, &args.difficulty)?.iter().map(|p| serde_json::json!({"op": "get", "path": p})).collect();
    Ok((large, Bytes::from(serde_json::json!({ "specs": specs }).to_string())))
}

/// Small gets alone, then the same small gets while a lookup flood runs; prints both p99s
/// and their ratio (issue 3's target: at most 3×). The flood's client is a process of its
/// own (this binary with `--flood-child`) at `--flood-nice`, as a client on another machine
/// would be: its queueing is not the neighbours'.
async fn noisy_neighbour(client: &Client, url: &str, args: &SubdocArgs) -> Result<(), CliError> {
    use std::io::{BufRead, Read};
    let authority = url.trim_end_matches('/').to_string();
    client.put(&args.collection, "neighbour-small", seed_document("neighbour-small", 5), &PutOptions::default()).await?;
    client.put(&args.collection, "neighbour-large", seed_document("neighbour-large", args.keys), &PutOptions::default()).await?;
    let small = format!("/v1/collections/{}/docs/neighbour-small", args.collection);
    let (large, flood_body) = flood_request(args)?;
    // Warm the large document's parsed tree, then measure the neighbours alone.
    drive(&authority, &large, hyper::Method::POST, flood_body.clone(), 4, 10).await?;
    let alone = drive(&authority, &small, hyper::Method::GET, Bytes::new(), args.neighbours, args.repeat).await?;

    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args([
        "--url",
        url,
        "bench",
        "subdoc",
        "--flood-child",
        "--json",
        "--collection",
        &args.collection,
        "--difficulty",
        &args.difficulty,
    ])
    .args(["--keys", &args.keys.to_string(), "--search-keys", &args.search_keys.to_string(), "--parallel", &args.parallel.to_string()])
    .stdin(std::process::Stdio::piped())
    .stdout(std::process::Stdio::piped());
    let nice = args.flood_nice.clamp(0, 19);
    #[cfg(unix)]
    {
        // SAFETY: runs in the forked child before exec; setpriority is async-signal-safe and
        // takes no pointers. The nice value is inherited by every thread the child starts.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                libc::setpriority(libc::PRIO_PROCESS, 0, nice);
                Ok(())
            });
        }
    }
    let mut child = KillOnDrop(cmd.spawn()?);
    let (Some(stdin), Some(stdout)) = (child.0.stdin.take(), child.0.stdout.take()) else {
        return Err(CliError::Usage("the flood process has no pipes".into()));
    };
    // Measure only once every flood connection is busy (the child says so).
    let (mut stdout, line) = tokio::task::spawn_blocking(move || {
        let mut stdout = std::io::BufReader::new(stdout);
        let mut line = String::new();
        stdout.read_line(&mut line).map(|_| (stdout, line))
    })
    .await
    .map_err(|e| CliError::Usage(format!("flood reader: {e}")))??;
    if line.trim() != "flood warm" {
        return Err(CliError::Usage(format!("the flood process did not start: {line:?}")));
    }
    let crowded = drive(&authority, &small, hyper::Method::GET, Bytes::new(), args.neighbours, args.repeat).await?;
    drop(stdin);
    let rest = tokio::task::spawn_blocking(move || {
        let mut rest = String::new();
        stdout.read_to_string(&mut rest).map(|_| rest)
    })
    .await
    .map_err(|e| CliError::Usage(format!("flood reader: {e}")))??;
    child.0.wait()?;
    let flood: serde_json::Value =
        serde_json::from_str(rest.trim()).map_err(|e| CliError::Usage(format!("the flood process answered {rest:?}: {e}")))?;
    print_report("neighbours alone", &alone, args.json);
    print_report("neighbours during flood", &crowded, args.json);
    println!("{}", if args.json { flood.to_string() } else { format!("flood report (own process, nice {nice}): {flood}") });
    let (p_alone, p_crowded) = (percentile(&alone.latencies_us, 0.99), percentile(&crowded.latencies_us, 0.99));
    println!("noisy neighbour: p99 {p_alone:.3} ms alone, {p_crowded:.3} ms during the flood: {:.2}x", p_crowded / p_alone.max(1e-9));
    Ok(())
}

/// A child process that is killed if the bench stops early.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// The flood of [`noisy_neighbour`], in its own process: runs until stdin closes.
async fn flood_child(url: &str, args: &SubdocArgs) -> Result<(), CliError> {
    use std::sync::atomic::Ordering;
    let authority = url.trim_end_matches('/').to_string();
    let (large, body) = flood_request(args)?;
    let control = std::sync::Arc::new(RunControl::default());
    let flood = {
        let (authority, control) = (authority.clone(), control.clone());
        let parallel = args.parallel;
        tokio::spawn(async move { drive_until(&authority, &large, hyper::Method::POST, body, parallel, usize::MAX, Some(control)).await })
    };
    let warm = (args.parallel as u64).saturating_mul(10);
    while control.requests.load(Ordering::Relaxed) < warm && !flood.is_finished() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("flood warm");
    // The parent closes stdin when it has measured.
    let _ = tokio::task::spawn_blocking(|| std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new())).await;
    control.stop.store(true, Ordering::Relaxed);
    let report = flood.await.map_err(|e| CliError::Usage(format!("flood failed: {e}")))??;
    print_report("flood", &report, true);
    Ok(())
}

const SWEEP_SIZES: &[usize] = &[5, 100, 1000, 5000, 10_000];
const SWEEP_SEARCHED: &[usize] = &[1, 2, 4, 8, 16];
const SWEEP_LEVELS: &[&str] = &["easy", "medium", "hard"];

async fn sweep(client: &Client, url: &str, args: &SubdocArgs) -> Result<(), CliError> {
    let mut table = String::new();
    table.push_str(&format!("# seed 001 sweep: `shoal bench subdoc --sweep --parallel {} --repeat {}`\n\n", args.parallel, args.repeat));
    table.push_str(&format!("date: {}, machine: {} cores\n\n", date_utc(), std::thread::available_parallelism().map_or(0, |n| n.get())));
    // Scenario A: document size, 10 paths (or all of a smaller document).
    table.push_str("## Scenario A: document size (sub-keys), 10 paths per lookup, requests/s\n\n| sub-keys | bytes | regular | easy | medium | hard |\n|---|---|---|---|---|---|\n");
    let mut a_series: Vec<crate::bench::chart::Series> = ["regular", "easy", "medium", "hard"]
        .iter()
        .map(|n| crate::bench::chart::Series { name: n.to_string(), points: Vec::new() })
        .collect();
    for &keys in SWEEP_SIZES {
        let mut row = vec![keys.to_string(), seed_document("sweep", keys).len().to_string()];
        for (i, level) in ["regular", "easy", "medium", "hard"].iter().enumerate() {
            let rps = sweep_point(client, url, args, keys, 10, level).await?;
            a_series[i].points.push((keys as f64, rps));
            row.push(format!("{rps:.0}"));
            println!("A keys={keys} {level}: {rps:.0} req/s");
        }
        table.push_str(&format!("| {} |\n", row.join(" | ")));
    }
    // Scenario B: paths per lookup in the 10,000-key document.
    table.push_str(
        "\n## Scenario B: paths per lookup, 10,000 sub-keys (~310 KB), requests/s\n\n| paths | easy | medium | hard |\n|---|---|---|---|\n",
    );
    let mut b_series: Vec<crate::bench::chart::Series> =
        SWEEP_LEVELS.iter().map(|n| crate::bench::chart::Series { name: n.to_string(), points: Vec::new() }).collect();
    for &search in SWEEP_SEARCHED {
        let mut row = vec![search.to_string()];
        for (i, level) in SWEEP_LEVELS.iter().enumerate() {
            let rps = sweep_point(client, url, args, 10_000, search, level).await?;
            b_series[i].points.push((search as f64, rps));
            row.push(format!("{rps:.0}"));
            println!("B paths={search} {level}: {rps:.0} req/s");
        }
        table.push_str(&format!("| {} |\n", row.join(" | ")));
    }
    std::fs::create_dir_all(&args.out_dir)?;
    let a_png = args.out_dir.join("subdoc-sweep-a-size.png");
    let b_png = args.out_dir.join("subdoc-sweep-b-paths.png");
    for (path, title, x, series, log) in [
        (&a_png, "Shoal, seed 001 scenario A: document size vs requests/s (10 paths)", "sub-keys in the document (log)", &a_series, true),
        (&b_png, "Shoal, seed 001 scenario B: paths per lookup vs requests/s (310 KB doc)", "paths per lookup", &b_series, false),
    ] {
        match crate::bench::chart::line_chart(path, title, x, "requests/s", series, log) {
            Ok(()) => table
                .push_str(&format!("\n![{title}]({})\n", path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default())),
            Err(e) => eprintln!("chart {}: {e}", path.display()),
        }
    }
    let md = args.out_dir.join("subdoc-sweep.md");
    std::fs::write(&md, &table)?;
    println!("{table}");
    println!("wrote {}", md.display());
    Ok(())
}

fn date_utc() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (y, m, d) = crate::bench::tpcds::civil((secs / 86_400) as i64);
    format!("{y:04}-{m:02}-{d:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_document_sizes_match_the_seed() {
        // The seed's tool printed 310,043 bytes for this document (its JSON had a few more spaces).
        let len = seed_document("test-subdoc", 10_000).len();
        assert!((309_000..=311_000).contains(&len), "{len}");
        let doc: serde_json::Value = serde_json::from_str(&seed_document("k", 3)).unwrap();
        assert_eq!(doc["data"]["subkey-000002"], "value-000002");
    }

    #[test]
    fn search_paths_by_difficulty() {
        assert_eq!(search_paths(10_000, 2, "hard").unwrap(), ["data.subkey-009999", "data.subkey-009998"]);
        assert_eq!(search_paths(10_000, 2, "easy").unwrap(), ["data.subkey-000000", "data.subkey-000001"]);
        assert_eq!(search_paths(10, 2, "medium").unwrap(), ["data.subkey-000005", "data.subkey-000006"]);
        assert_eq!(search_paths(5, 10, "hard").unwrap().len(), 5);
        assert!(search_paths(5, 1, "impossible").is_err());
    }

    #[test]
    fn civil_date() {
        assert_eq!(date_utc().len(), 10);
    }
}
