//! Seed 004's experiment: TPC-DS-shaped data for query 3 loaded through `_bulk`, then
//! query 3 exactly as the seed prints it, timed over several runs.
//!
//! Query 3 runs on `/v1/analytics` (the columnar shadows) on one fresh node per analytics
//! partition count, and, in the same run, in DuckDB on the same rows (native tables and
//! the JSON files read directly; `bench/duckdb_q3.py`).

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use serde_json::{json, Value};
use shoal_client::Client;

use crate::bench::index::Node;
use crate::bench::tpcds;
use crate::bench::{bulk_upsert, write_result, BulkPlan};
use crate::cli::CliError;

#[derive(Args)]
pub struct AnalyticsArgs {
    /// TPC-DS scale factor (1: 73,049 dates, 18,000 items, 2.88 million sales).
    #[arg(long, default_value_t = 1.0)]
    sf: f64,
    /// Timed runs of query 3 per configuration; the median is reported.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Partitions of the nodes the bench starts.
    #[arg(long, default_value_t = 128)]
    partitions: u16,
    /// Analytics partition counts to measure, one fresh node each; the node's default is
    /// measured too unless it is one of them.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    analytics_partitions: Vec<usize>,
    /// Runs of query 3 on `/v1/query` (documents, no shadow) on the first node; 0 skips.
    #[arg(long, default_value_t = 1)]
    operational_runs: usize,
    /// Seconds of the shadow-lag test at `--lag-rate` upserts/s into store_sales (0: skip),
    /// on the node with the default analytics partitions.
    #[arg(long, default_value_t = 20)]
    lag_secs: u64,
    #[arg(long, default_value_t = 5000)]
    lag_rate: u64,
    /// Skip the DuckDB baseline (`bench/duckdb_q3.py`, needs `pip install duckdb`).
    #[arg(long)]
    no_duckdb: bool,
    /// Cluster sizes to measure instead (seed 004 on a cluster): one fresh cluster of each
    /// size, every node on this machine, query 3 and the scan query through the first node,
    /// with each node's scanned bytes and CPU seconds.
    #[arg(long, value_delimiter = ',')]
    nodes: Vec<usize>,
    /// With `--nodes`: arguments given to every node's `serve` besides the bench's own
    /// (e.g. `--node-arg=--analytics-partitions=1`, each node told it has one core's share).
    #[arg(long = "node-arg", allow_hyphen_values = true)]
    node_args: Vec<String>,
    /// Measure a scale-out instead (issue 42, item 2): one node loaded, a second joins and
    /// the rebalance copies it every partition by files with the partitions' analytics
    /// rows; then the same with the rows rebuilt from the documents (`serve
    /// --analytics-by-stream`) for the ratio.
    #[arg(long)]
    scale_out: bool,
    /// Where the table and query 3's answer go (nothing is written when empty).
    #[arg(long, default_value = "bench/results")]
    out_dir: PathBuf,
}

#[derive(Args)]
pub struct GenArgs {
    #[arg(long, default_value_t = 1.0)]
    sf: f64,
    /// Directory for `date_dim.ndjson`, `item.ndjson`, `store_sales.ndjson` (lines of
    /// `{"key", "value"}`, as `shoal load` takes).
    #[arg(long)]
    out: PathBuf,
}

/// Row `i` of a table as (key, document).
type RowFn = dyn Fn(u64) -> (String, Value) + Send + Sync;

/// The three tables of query 3 at scale factor `sf`: name, rows, and row `i` as (key,
/// document); a key is `{name}_{i:08}`.
fn tables(sf: f64) -> [(&'static str, u64, Box<RowFn>); 3] {
    let items = tpcds::item_rows(sf);
    [
        ("date_dim", tpcds::DATE_ROWS, Box::new(tpcds::date_row)),
        ("item", items, Box::new(tpcds::item_row)),
        ("store_sales", tpcds::sales_rows(sf), Box::new(move |i| tpcds::sales_row(i, items))),
    ]
}

/// Writes the three tables as NDJSON files.
pub fn generate(args: GenArgs) -> Result<(), CliError> {
    std::fs::create_dir_all(&args.out)?;
    for (name, rows, row) in tables(args.sf) {
        let mut out = std::io::BufWriter::new(std::fs::File::create(args.out.join(format!("{name}.ndjson")))?);
        for i in 0..rows {
            let (key, value) = row(i);
            writeln!(out, "{}", json!({"key": key, "value": value}))?;
        }
        out.flush()?;
        println!("{name}: {rows} rows");
    }
    Ok(())
}

/// One configuration's figures.
struct Measured {
    label: String,
    /// Shadow lag under writes: (p50, p99, max) ms and the achieved rate.
    lag: Option<(f64, f64, f64, f64)>,
    analytics_partitions: u64,
    docs: u64,
    load_secs: f64,
    times: Vec<f64>,
    /// The all-scan query's times.
    scan: Vec<f64>,
    answer: Value,
}

fn median(times: &[f64]) -> f64 {
    let mut t = times.to_vec();
    t.sort_by(f64::total_cmp);
    t.get(t.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Loads the three tables (one collection each, as the query names them) and waits until
/// the shadows hold every document: the load figure counts documents and shadow together.
async fn load(client: &Client, sf: f64) -> Result<(u64, f64), CliError> {
    let plan = BulkPlan { batch: 2000, concurrency: 4, persist: false };
    let start = Instant::now();
    let mut loaded = 0;
    for (name, rows, row) in tables(sf) {
        client.create_collection(name, None).await?;
        let (sent, failed) = bulk_upsert(client, name, rows as usize, &plan, &format!("{name}_"), |i| row(i as u64).1.to_string()).await?;
        if failed > 0 {
            return Err(CliError::Usage(format!("loading {name}: {failed} errors")));
        }
        loaded += sent;
    }
    let docs_secs = start.elapsed().as_secs_f64();
    let mut in_shadow = 0;
    for name in ["date_dim", "item", "store_sales"] {
        let sql = format!("SELECT count(*) FROM {name}");
        let answer = client.analytics(&json!({"sql": sql, "consistency": "request_plus", "timeout_ms": 3_600_000})).await?;
        in_shadow += answer["rows"][0][0].as_u64().unwrap_or(0);
    }
    let secs = start.elapsed().as_secs_f64();
    if in_shadow != loaded {
        return Err(CliError::Usage(format!("{loaded} documents loaded, {in_shadow} in the shadows")));
    }
    println!("loaded {loaded} documents in {docs_secs:.1}s; shadows complete at {secs:.1}s ({:.0} docs/s)", loaded as f64 / secs);
    Ok((loaded, secs))
}

/// A query that is all scan: every sales row read and aggregated (where the partition
/// count shows most plainly).
const SCAN_QUERY: &str =
    "SELECT ss_store_sk, count(*), sum(ss_ext_sales_price), avg(ss_quantity) FROM store_sales GROUP BY ss_store_sk ORDER BY ss_store_sk";

async fn timed_runs(client: &Client, analytics: bool, sql: &str, runs: usize, label: &str) -> Result<(Vec<f64>, Value), CliError> {
    let mut times = Vec::new();
    let mut answer = Value::Null;
    let request = json!({"sql": sql, "timeout_ms": 3_600_000});
    for run in 0..runs {
        let t = Instant::now();
        answer = if analytics { client.analytics(&request).await? } else { client.query(&request).await? };
        let secs = t.elapsed().as_secs_f64();
        println!("{label}, run {}: {:.1} ms", run + 1, secs * 1000.0);
        times.push(secs);
    }
    Ok((times, answer))
}

/// One fresh node (with `--analytics-partitions n`, or the node's default): load, then
/// query 3 on the shadow.
async fn measure(
    args: &AnalyticsArgs,
    n: Option<usize>,
    skip: &[u64],
    operational: &mut Option<Vec<f64>>,
) -> Result<Option<Measured>, CliError> {
    let extra: Vec<String> = n.map(|n| vec!["--analytics-partitions".to_string(), n.to_string()]).unwrap_or_default();
    let node = Node::start(args.partitions, &extra)?;
    let client = Client::new(&node.url)?;
    let info = client.node().await?;
    let aps = info["analytics_partitions"].as_u64().unwrap_or(0);
    if n.is_none() && skip.contains(&aps) {
        println!("the default is {aps} analytics partitions: measured above");
        return Ok(None);
    }
    let (docs, load_secs) = load(&client, args.sf).await?;
    let waited = node.wait_idle(std::time::Duration::from_secs(120));
    println!("node idle after {waited:.0}s");
    let label = format!("query 3, {aps} analytics partition(s)");
    timed_runs(&client, true, tpcds::QUERY_3, 1, &format!("{label}, warm-up")).await?;
    let (times, answer) = timed_runs(&client, true, tpcds::QUERY_3, args.runs.max(1), &label).await?;
    let (scan, _) = timed_runs(&client, true, SCAN_QUERY, args.runs.max(1), &format!("scan query, {aps} analytics partition(s)")).await?;
    if operational.is_none() && args.operational_runs > 0 {
        *operational = Some(timed_runs(&client, false, tpcds::QUERY_3, args.operational_runs, "query 3 on /v1/query").await?.0);
    }
    let label = if n.is_none() { format!("{aps} (default)") } else { aps.to_string() };
    let lag = shadow_lag(args, &client).await?;
    Ok(Some(Measured { label, lag, analytics_partitions: aps, docs, load_secs, times, scan, answer }))
}

/// Shadow lag: writers upsert sales rows at `--lag-rate`, a probe writes a new row and polls
/// `/v1/analytics` (not `request_plus`) until the row is there.
async fn shadow_lag(args: &AnalyticsArgs, client: &Client) -> Result<Option<(f64, f64, f64, f64)>, CliError> {
    if args.lag_secs == 0 {
        return Ok(None);
    }
    let items = tpcds::item_rows(args.sf);
    let sales = tpcds::sales_rows(args.sf).max(1);
    let probe_client = client.clone();
    let lag = crate::bench::index::write_lag(
        client,
        "store_sales",
        crate::bench::index::LagRun { secs: args.lag_secs, rate: args.lag_rate },
        move |w, i| {
            let n = (w * 1_000_003 + i * 7919) % sales;
            (format!("store_sales_{n:08}"), tpcds::sales_row(n, items).1.to_string())
        },
        // Each probe is a new row whose key is the marker: a count by key shows it.
        |marker| (format!("lag-{marker}"), json!({"table_name": "store_sales", "ss_quantity": 1}).to_string()),
        move |marker| {
            let client = probe_client.clone();
            async move {
                let sql = "SELECT count(*) FROM store_sales WHERE meta_id = $1";
                let answer = client.analytics(&json!({"sql": sql, "params": [format!("lag-{marker}")]})).await?;
                Ok(answer["rows"][0][0].as_u64() == Some(1))
            }
        },
        "analytics shadow",
    )
    .await?;
    Ok(Some(lag))
}

/// DuckDB on the same rows (`bench/duckdb_q3.py`), or why it did not run.
fn duckdb(args: &AnalyticsArgs, threads: usize) -> Result<Value, CliError> {
    let dir = std::env::temp_dir().join(format!("shoal-bench-tpcds-{}", std::process::id()));
    generate(GenArgs { sf: args.sf, out: dir.clone() })?;
    let query = dir.join("q3.sql");
    std::fs::write(&query, tpcds::QUERY_3)?;
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/duckdb_q3.py");
    let out = std::process::Command::new("python3")
        .arg(&script)
        .args(["--dir"])
        .arg(&dir)
        .arg("--query")
        .arg(&query)
        .args(["--threads", &threads.to_string(), "--runs", &args.runs.max(1).to_string(), "--json-runs", "3"])
        .output();
    let _ = std::fs::remove_dir_all(&dir);
    let out = match out {
        Ok(o) => o,
        Err(e) => return Ok(json!({"error": format!("python3: {e}")})),
    };
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(serde_json::from_str(text.trim()).unwrap_or_else(|_| json!({"error": format!("{text} {}", String::from_utf8_lossy(&out.stderr))})))
}

pub async fn run(args: AnalyticsArgs) -> Result<(), CliError> {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
    if args.scale_out {
        return scale_out(&args).await;
    }
    if !args.nodes.is_empty() {
        return on_clusters(&args, cores).await;
    }
    let mut measured = Vec::new();
    let mut operational = None;
    for &n in &args.analytics_partitions {
        measured.extend(measure(&args, Some(n), &[], &mut operational).await?);
    }
    let seen: Vec<u64> = measured.iter().map(|m| m.analytics_partitions).collect();
    measured.extend(measure(&args, None, &seen, &mut operational).await?);
    let duck = if args.no_duckdb { json!({"error": "skipped (--no-duckdb)"}) } else { duckdb(&args, cores)? };

    let mut report = format!(
        "Query 3 at scale factor {} on `/v1/analytics` (one collection per table, {} partitions, {cores} cores; \
         median of {} runs after one warm-up, once the node is idle after the load). Load = `_bulk` of every document until the shadows hold them all.\n\n\
         | analytics partitions | documents | load + shadow (s) | docs/s | query 3 median (ms) | scan query median (ms) | shadow lag p50 / p99 / max (ms) | query 3 runs (ms) |\n|---|---|---|---|---|---|---|---|\n",
        args.sf,
        args.partitions,
        args.runs.max(1)
    );
    for m in &measured {
        let runs: Vec<String> = m.times.iter().map(|t| format!("{:.1}", t * 1000.0)).collect();
        let lag = m.lag.map_or("-".to_string(), |(p50, p99, max, rate)| format!("{p50:.1} / {p99:.1} / {max:.1} at {rate:.0} writes/s"));
        report.push_str(&format!(
            "| {} | {} | {:.1} | {:.0} | {:.1} | {:.1} | {lag} | {} |\n",
            m.label,
            m.docs,
            m.load_secs,
            m.docs as f64 / m.load_secs,
            median(&m.times) * 1000.0,
            median(&m.scan) * 1000.0,
            runs.join(", ")
        ));
    }
    let one = measured.iter().find(|m| m.analytics_partitions == 1).map(|m| median(&m.times));
    let two = measured.iter().find(|m| m.analytics_partitions == 2).map(|m| median(&m.times));
    if let (Some(one), Some(two)) = (one, two) {
        report.push_str(&format!("\n2 analytics partitions vs 1: query 3 {:.2}× faster", one / two));
        let scan = |n: u64| measured.iter().find(|m| m.analytics_partitions == n).map(|m| median(&m.scan));
        if let (Some(s1), Some(s2)) = (scan(1), scan(2)) {
            report.push_str(&format!(", the scan query {:.2}× faster", s1 / s2));
        }
        report.push_str(" (`SCAN_QUERY` in `src/bench_analytics.rs`).\n");
    }
    if let Some(op) = &operational {
        report.push_str(&format!(
            "\n`/v1/query` (documents read and converted per query, no shadow): {:.0} ms median.\n",
            median(op) * 1000.0
        ));
    }
    let best = measured.iter().map(|m| median(&m.times)).fold(f64::INFINITY, f64::min);
    match (duck["native_s"].as_array(), duck["json_s"].as_array()) {
        (Some(native), Some(on_json)) => {
            let native: Vec<f64> = native.iter().filter_map(Value::as_f64).collect();
            let on_json: Vec<f64> = on_json.iter().filter_map(Value::as_f64).collect();
            let (n, j) = (median(&native), median(&on_json));
            report.push_str(&format!(
                "\nDuckDB {} (same rows from `shoal bench tpcds-gen`, {} threads, same run): native tables {:.1} ms median, \
                 JSON files read directly {:.0} ms median; its answer has {} rows (same both ways: {}).\n\n\
                 | comparison | ratio | target |\n|---|---|---|\n\
                 | Shoal's best / DuckDB native | {:.2}× | ≤ 2× |\n| DuckDB on JSON / Shoal's best | {:.1}× | ≥ 10× |\n",
                duck["version"].as_str().unwrap_or("?"),
                duck["threads"],
                n * 1000.0,
                j * 1000.0,
                duck["rows"],
                duck["same_rows_both_ways"],
                best / n,
                j / best,
            ));
        }
        _ => report.push_str(&format!("\nDuckDB not run: {}\n", duck["error"].as_str().unwrap_or("?"))),
    }
    let answer = measured.last().map(|m| m.answer.clone()).unwrap_or(Value::Null);
    report.push_str(&format!(
        "\nquery 3's answer ({} rows):\n\n| d_year | brand_id | brand | sum_agg |\n|---|---|---|---|\n",
        answer["rows"].as_array().map_or(0, Vec::len)
    ));
    for row in answer["rows"].as_array().into_iter().flatten() {
        let cells: Vec<String> = row.as_array().into_iter().flatten().map(|v| v.to_string()).collect();
        report.push_str(&format!("| {} |\n", cells.join(" | ")));
    }
    print!("\n{report}");
    write_result(&args.out_dir, "analytics-seed004.md", &report)?;
    Ok(())
}

/// What one cluster size did.
struct OnCluster {
    nodes: usize,
    load_secs: f64,
    q3: Vec<f64>,
    scan: Vec<f64>,
    /// Per node, the bytes its scans produced and its CPU seconds, during query 3's runs
    /// and during the scan query's.
    q3_nodes: Vec<(u64, f64)>,
    scan_nodes: Vec<(u64, f64)>,
    engine: String,
    answer: Value,
}

/// The node's `shoal_analytics_scanned_bytes_total`.
async fn scanned_bytes(http: &reqwest::Client, node: &Node) -> Result<u64, CliError> {
    let metrics = |e: reqwest::Error| CliError::Bench(format!("{}/metrics: {e}", node.url));
    let text = http.get(format!("{}/metrics", node.url)).send().await.map_err(metrics)?.text().await.map_err(metrics)?;
    Ok(text
        .lines()
        .find(|l| l.starts_with("shoal_analytics_scanned_bytes_total"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as u64))
}

/// Rows equal, numbers within a relative 1e-9 (engines add floats in different orders).
fn same_rows(a: &Value, b: &Value) -> bool {
    let (Some(a), Some(b)) = (a.as_array(), b.as_array()) else { return false };
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            let (Some(x), Some(y)) = (x.as_array(), y.as_array()) else { return false };
            x.len() == y.len()
                && x.iter().zip(y).all(|(u, v)| match (u.as_f64(), v.as_f64()) {
                    (Some(u), Some(v)) => (u - v).abs() <= 1e-9 * u.abs().max(v.abs()).max(1.0),
                    _ => u == v,
                })
        })
}

/// One scale-out measured: how the new node's analytics rows came, and what it took.
struct ScaleOut {
    method: &'static str,
    load_secs: f64,
    rebalance_secs: f64,
    ready_secs: f64,
    adopted: f64,
    applied: f64,
    new_cpu: f64,
    old_cpu: f64,
    same: bool,
}

/// Issue 42, item 2 measured: a loaded node, a second joins, the rebalance gives it every
/// partition (half active, half replica) by files. `files`: each partition's analytics rows
/// come with its copy; `stream`: the new node builds them from the copies' documents (as
/// before). Timed from the rebalance's start to its end (a move is handed over only once the
/// new copy's derived state caught up) and to query 3 answered by the new node.
async fn scale_out(args: &AnalyticsArgs) -> Result<(), CliError> {
    let http = crate::bench::http_builder().build().unwrap_or_default();
    let mut measured = Vec::new();
    for method in ["files", "stream"] {
        println!("\n--- scale-out, analytics rows by {method}");
        let base = vec!["--cluster-secret".to_string(), "bench-analytics".to_string()];
        let first = Node::start_named(&format!("analytics-out-{method}-0"), args.partitions, &base)?;
        let client = Client::new(&first.url)?;
        let (_, load_secs) = load(&client, args.sf).await?;
        first.wait_idle(std::time::Duration::from_secs(120));
        let (_, want) = timed_runs(&client, true, tpcds::QUERY_3, 1, "query 3 on the loaded node").await?;
        let mut joining = base.clone();
        joining.extend(["--join".to_string(), crate::bench::host_port(&first.url)]);
        if method == "stream" {
            joining.push("--analytics-by-stream".to_string());
        }
        let second = Node::start_named(&format!("analytics-out-{method}-1"), args.partitions, &joining)?;
        crate::bench::rebalance::wait_members(&client, 2).await?;
        let ticks = (first.cpu_ticks().unwrap_or(0), second.cpu_ticks().unwrap_or(0));
        let start = Instant::now();
        crate::bench::rebalance::rebalance(&client, &[], None).await?;
        let rebalance_secs = start.elapsed().as_secs_f64();
        let on_new = Client::new(&second.url)?;
        let request = json!({"sql": tpcds::QUERY_3, "consistency": "request_plus", "timeout_ms": 600_000});
        let deadline = Instant::now() + std::time::Duration::from_secs(600);
        let answer = loop {
            match on_new.analytics(&request).await {
                Ok(a) if same_rows(&a["rows"], &want["rows"]) => break a,
                Ok(a) if Instant::now() > deadline => break a,
                Err(e) if Instant::now() > deadline => return Err(e.into()),
                _ => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
            }
        };
        let ready_secs = start.elapsed().as_secs_f64();
        let cpu = |n: &Node, t: u64| n.cpu_ticks().unwrap_or(0).saturating_sub(t) as f64 / 100.0;
        let (old_cpu, new_cpu) = (cpu(&first, ticks.0), cpu(&second, ticks.1));
        let adopted = second.metric(&http, "shoal_analytics_rows_adopted_total").await?;
        let applied = second.metric(&http, "shoal_analytics_changes_applied_total").await?;
        let same = same_rows(&answer["rows"], &want["rows"]);
        println!(
            "{method}: rebalance {rebalance_secs:.1}s, query 3 on the new node at {ready_secs:.1}s, {adopted} rows adopted, \
             {applied} changes applied, CPU new {new_cpu:.1}s old {old_cpu:.1}s"
        );
        measured.push(ScaleOut { method, load_secs, rebalance_secs, ready_secs, adopted, applied, new_cpu, old_cpu, same });
    }
    let mut report = format!(
        "Issue 42, item 2: a scale-out from 1 to 2 nodes with seed 004's data (TPC-DS scale factor {}, {} partitions, one \
         replica: the new node takes every partition, half as active, half as replica, each copied by files). `files`: each \
         partition's analytics rows move with its copy, cut from the source's segments; `stream`: the new node builds them \
         from the copied documents (`serve --analytics-by-stream`, as before this change). **Both nodes run on this \
         machine's cores.** Rebalance: from its start to its end (a move hands over only once the new copy's derived state \
         caught up). Query 3 on the new node: from the rebalance's start until the new node answers it (`request_plus`) \
         as the loaded node did. CPU: each process's user + system seconds over that span.\n\n\
         | analytics rows by | load + shadow (s) | rebalance (s) | query 3 on the new node after (s) | rows adopted | changes applied by the new node's shadow | CPU s, new node | CPU s, first node | answer = before |\n\
         |---|---|---|---|---|---|---|---|---|\n",
        args.sf, args.partitions
    );
    for m in &measured {
        report.push_str(&format!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.0} | {:.0} | {:.1} | {:.1} | {} |\n",
            m.method,
            m.load_secs,
            m.rebalance_secs,
            m.ready_secs,
            m.adopted,
            m.applied,
            m.new_cpu,
            m.old_cpu,
            if m.same { "yes" } else { "NO" }
        ));
    }
    if let [files, stream] = &measured[..] {
        report.push_str(&format!(
            "\nBy files against by stream, same run: rebalance {:.2}×, until query 3 on the new node {:.2}×, the new node's CPU {:.2}×.\n",
            files.rebalance_secs / stream.rebalance_secs,
            files.ready_secs / stream.ready_secs,
            files.new_cpu / stream.new_cpu.max(1e-9)
        ));
    }
    print!("\n{report}");
    write_result(&args.out_dir, "analytics-scale-out.md", &report)?;
    Ok(())
}

/// The pause before each timed statement of [`interleaved_runs`].
const STATEMENT_GAP: std::time::Duration = std::time::Duration::from_millis(50);

/// A cluster of the bench, loaded and idle.
struct Loaded {
    size: usize,
    nodes: Vec<Node>,
    client: Client,
    load_secs: f64,
}

/// Starts a cluster of `size` nodes, rebalances it and loads seed 004's tables.
async fn loaded_cluster(args: &AnalyticsArgs, size: usize) -> Result<Loaded, CliError> {
    println!("\n--- {size} node(s)");
    let mut base = vec!["--cluster-secret".to_string(), "bench-analytics".to_string()];
    base.extend(args.node_args.iter().cloned());
    let first = Node::start_named(&format!("analytics-{size}-0"), args.partitions, &base)?;
    let mut joining = base.clone();
    joining.extend(["--join".to_string(), crate::bench::host_port(&first.url)]);
    let mut nodes = vec![first];
    for i in 1..size {
        nodes.push(Node::start_named(&format!("analytics-{size}-{i}"), args.partitions, &joining)?);
    }
    let client = Client::new(&nodes[0].url)?;
    if size > 1 {
        crate::bench::rebalance::wait_members(&client, size).await?;
        crate::bench::rebalance::rebalance(&client, &[], None).await?;
    }
    let (_, load_secs) = load(&client, args.sf).await?;
    Ok(Loaded { size, nodes, client, load_secs })
}

/// One cluster's runs of a statement: the times, the last answer, and each node's scanned
/// bytes and CPU seconds over them.
type ClusterRuns = (Vec<f64>, Value, Vec<(u64, f64)>);

/// `sql` `runs` times on each cluster, one statement on each in turn (so that the machine's
/// drift falls on every size alike); per cluster, the times, the last answer, and each
/// node's scanned bytes and CPU seconds over the runs.
async fn interleaved_runs(
    http: &reqwest::Client,
    clusters: &[Loaded],
    sql: &str,
    runs: usize,
    what: &str,
) -> Result<Vec<ClusterRuns>, CliError> {
    let mut before = Vec::new();
    for c in clusters {
        let mut of = Vec::new();
        for n in &c.nodes {
            of.push((scanned_bytes(http, n).await?, n.cpu_ticks().unwrap_or(0)));
        }
        before.push(of);
    }
    let mut out: Vec<ClusterRuns> = clusters.iter().map(|_| (Vec::new(), Value::Null, Vec::new())).collect();
    for run in 0..runs {
        for (c, o) in clusters.iter().zip(out.iter_mut()) {
            // What the statement before left running (its tasks' streams and state being
            // dropped on the members) ends before the next one, on whichever cluster.
            tokio::time::sleep(STATEMENT_GAP).await;
            let label = format!("{what}, {} node(s), run {}", c.size, run + 1);
            let (times, answer) = timed_runs(&c.client, true, sql, 1, &label).await?;
            o.0.extend(times);
            o.1 = answer;
        }
    }
    for ((c, of), o) in clusters.iter().zip(before).zip(out.iter_mut()) {
        for (n, (bytes, ticks)) in c.nodes.iter().zip(of) {
            let b = scanned_bytes(http, n).await?.saturating_sub(bytes);
            let t = n.cpu_ticks().unwrap_or(0).saturating_sub(ticks);
            o.2.push((b, t as f64 / 100.0));
        }
    }
    Ok(out)
}

/// Seed 004 on clusters of each size in `--nodes`: every cluster started and loaded first,
/// then the statements run on them in turn.
async fn on_clusters(args: &AnalyticsArgs, cores: usize) -> Result<(), CliError> {
    let http = crate::bench::http_builder().build().unwrap_or_default();
    let mut clusters = Vec::new();
    for &size in &args.nodes {
        clusters.push(loaded_cluster(args, size.max(1)).await?);
    }
    for c in &clusters {
        for n in &c.nodes {
            n.wait_idle(std::time::Duration::from_secs(120));
        }
        timed_runs(&c.client, true, tpcds::QUERY_3, 1, &format!("query 3, {} node(s), warm-up", c.size)).await?;
    }
    let runs = args.runs.max(1);
    let q3 = interleaved_runs(&http, &clusters, tpcds::QUERY_3, runs, "query 3").await?;
    let scan = interleaved_runs(&http, &clusters, SCAN_QUERY, runs, "scan query").await?;
    let mut measured = Vec::new();
    for ((c, (q3, answer, q3_nodes)), (scan, _, scan_nodes)) in clusters.iter().zip(q3).zip(scan) {
        let engine = answer["metrics"]["engine"].as_str().unwrap_or("?").to_string();
        measured.push(OnCluster { nodes: c.size, load_secs: c.load_secs, q3, scan, q3_nodes, scan_nodes, engine, answer });
    }
    drop(clusters);
    let duck = if args.no_duckdb { json!({"error": "skipped (--no-duckdb)"}) } else { duckdb(args, cores)? };
    let one = measured.first().map(|m| median(&m.q3));
    let mut report = format!(
        "Seed 004 on a cluster: TPC-DS query 3 and a scan query (`SCAN_QUERY`) at scale factor {} on `/v1/analytics`, \
         asked of the first node of fresh clusters of {:?} nodes ({} partitions; median of {} runs after one warm-up, once \
         the nodes are idle after the load; every cluster is loaded first, then each run asks every cluster in turn, so that \
         the machine's drift falls on every size alike). **Every node of every cluster runs on this machine's {cores} cores**, so wall \
         time cannot fall with more nodes here: the scale-out shows in the work per node (each node's share of the bytes \
         scanned and its CPU seconds). Bytes scanned: `shoal_analytics_scanned_bytes_total`, the column values each node's \
         shadow scans produced. CPU: each node process's user + system seconds over the runs.{}\n\n\
         | nodes | engine | load + shadow (s) | query 3 median (ms) | × 1 node | scan query median (ms) | query 3 bytes scanned per node (MB) | share of the total, max / (1/n) | query 3 CPU s per node | scan query CPU s per node | answer = 1 node's | answer = DuckDB's |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
        args.sf,
        args.nodes,
        args.partitions,
        args.runs.max(1),
        if args.node_args.is_empty() {
            String::new()
        } else {
            format!(" Every node was started with `{}` besides the bench's own arguments.", args.node_args.join(" "))
        }
    );
    for m in &measured {
        let total: u64 = m.q3_nodes.iter().map(|(b, _)| b).sum();
        let mb: Vec<String> = m.q3_nodes.iter().map(|(b, _)| format!("{:.1}", *b as f64 / 1e6)).collect();
        let share = m.q3_nodes.iter().map(|(b, _)| *b as f64 / total.max(1) as f64).fold(0.0, f64::max) * m.nodes as f64;
        let cpu = |v: &[(u64, f64)]| v.iter().map(|(_, c)| format!("{c:.2}")).collect::<Vec<_>>().join(" / ");
        let same_one = measured.first().is_some_and(|f| same_rows(&f.answer["rows"], &m.answer["rows"]));
        let same_duck = duck["answer"].is_array().then(|| same_rows(&duck["answer"], &m.answer["rows"]));
        report.push_str(&format!(
            "| {} | {} | {:.1} | {:.1} | {:.2}× | {:.1} | {} | {:.2} | {} | {} | {} | {} |\n",
            m.nodes,
            m.engine,
            m.load_secs,
            median(&m.q3) * 1000.0,
            one.map_or(f64::NAN, |o| median(&m.q3) / o),
            median(&m.scan) * 1000.0,
            mb.join(" / "),
            share,
            cpu(&m.q3_nodes),
            cpu(&m.scan_nodes),
            if same_one { "yes" } else { "NO" },
            same_duck.map_or("not run".to_string(), |s| if s { "yes".into() } else { "NO".into() }),
        ));
    }
    if let Some(native) = duck["native_s"].as_array() {
        let native: Vec<f64> = native.iter().filter_map(Value::as_f64).collect();
        report.push_str(&format!(
            "\nDuckDB {} in the same run, native tables, {} threads: query 3 {:.1} ms median.\n",
            duck["version"].as_str().unwrap_or("?"),
            duck["threads"],
            median(&native) * 1000.0
        ));
    } else {
        report.push_str(&format!("\nDuckDB not run: {}\n", duck["error"].as_str().unwrap_or("?")));
    }
    print!("\n{report}");
    write_result(&args.out_dir, "analytics-seed004-cluster.md", &report)?;
    Ok(())
}

#[derive(Args)]
pub struct PointArgs {
    /// Documents loaded; every `--per-group` consecutive ones share a `grp` value.
    #[arg(long, default_value_t = 200_000)]
    docs: usize,
    #[arg(long, default_value_t = 50)]
    per_group: usize,
    /// Timed queries (one at a time, after 100 untimed ones).
    #[arg(long, default_value_t = 2000)]
    queries: usize,
    /// Where the table goes (nothing is written when empty).
    #[arg(long, default_value = "bench/results")]
    out_dir: PathBuf,
}

/// Issue 5's operational target: `SELECT * FROM events WHERE grp = $1` through an index,
/// 50 rows per answer, one query at a time; the baseline in the same run is the index scan
/// endpoint returning the same 50 documents.
pub async fn point(args: PointArgs) -> Result<(), CliError> {
    let node = Node::start(128, &[])?;
    let client = Client::new(&node.url)?;
    client.create_collection("events", None).await?;
    let per = args.per_group.max(1);
    let plan = BulkPlan { batch: 2000, concurrency: 4, persist: false };
    bulk_upsert(&client, "events", args.docs, &plan, "ev-", |i| {
        let kind = ["click", "view", "buy"][i % 3];
        json!({"grp": i / per, "n": i, "kind": kind, "payload": "x".repeat(100)}).to_string()
    })
    .await?;
    client.create_index("events", &json!({"name": "by_grp", "keys": ["grp"]})).await?;
    crate::bench::index::wait_ready(&client, "events").await?;
    let groups = args.docs.div_ceil(per);
    let explain = client.query(&json!({"sql": "EXPLAIN SELECT * FROM events WHERE grp = $1", "params": [1]})).await?;
    let plan_text = explain["rows"].to_string();
    if !plan_text.contains("index=by_grp") {
        return Err(CliError::Usage(format!("the query does not use the index: {plan_text}")));
    }
    let mut sql_us = Vec::with_capacity(args.queries);
    let mut scan_us = Vec::with_capacity(args.queries);
    for q in 0..args.queries + 100 {
        let g = (q * 7919) % groups;
        let t = Instant::now();
        let answer = client.query(&json!({"sql": "SELECT * FROM events WHERE grp = $1", "params": [g]})).await?;
        let sql = t.elapsed();
        let t = Instant::now();
        let scan = client.scan_index("events", "by_grp", &json!({"eq": [g], "include_docs": true})).await?;
        let idx = t.elapsed();
        let (a, b) = (answer["rows"].as_array().map_or(0, Vec::len), scan["rows"].as_array().map_or(0, Vec::len));
        if a != b || a == 0 {
            return Err(CliError::Usage(format!("group {g}: {a} rows by SQL, {b} by the index scan")));
        }
        if q >= 100 {
            sql_us.push(sql.as_micros().min(u128::from(u32::MAX)) as u32);
            scan_us.push(idx.as_micros().min(u128::from(u32::MAX)) as u32);
        }
    }
    sql_us.sort_unstable();
    scan_us.sort_unstable();
    let p = |v: &[u32], q: f64| crate::bench::percentile(v, q);
    let report = format!(
        "| request ({per} rows, one at a time) | p50 (ms) | p99 (ms) |\n|---|---|---|\n| `/v1/query` `SELECT * FROM events WHERE grp = $1` (index by_grp) | {:.3} | {:.3} |\n| index scan endpoint, `include_docs` (baseline) | {:.3} | {:.3} |\n\n{} documents, {} timed queries; p50 ratio SQL / scan {:.2}\n",
        p(&sql_us, 0.5),
        p(&sql_us, 0.99),
        p(&scan_us, 0.5),
        p(&scan_us, 0.99),
        args.docs,
        args.queries,
        p(&sql_us, 0.5) / p(&scan_us, 0.5).max(1e-9),
    );
    print!("{report}");
    write_result(&args.out_dir, "query-point.md", &report)?;
    drop(node);
    Ok(())
}
