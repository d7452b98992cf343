//! Seed 004's experiment: TPC-DS-shaped data for query 3 loaded through `_bulk`, then
//! query 3 exactly as the seed prints it, timed over several runs.
//!
//! Today the query runs on `/v1/query` (documents read in key order and converted per
//! query); the columnar analytics shadow and its partition sweep are still to come, and so
//! is the DuckDB comparison (`shoal bench tpcds-gen` writes the same rows as NDJSON files
//! for it).

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use serde_json::{json, Value};
use shoal_client::Client;

use crate::bench::{bulk_upsert, write_result, BulkPlan};
use crate::bench_index::Node;
use crate::cli::CliError;
use crate::tpcds;

#[derive(Args)]
pub struct AnalyticsArgs {
    /// TPC-DS scale factor (1: 73,049 dates, 18,000 items, 2.88 million sales).
    #[arg(long, default_value_t = 1.0)]
    sf: f64,
    /// Timed runs of query 3; the median is reported.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Partitions of the node the bench starts.
    #[arg(long, default_value_t = 128)]
    partitions: u16,
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
type RowFn = dyn Fn(u64) -> (String, Value);

/// Writes the three tables as NDJSON files.
pub fn generate(args: GenArgs) -> Result<(), CliError> {
    std::fs::create_dir_all(&args.out)?;
    let items = tpcds::item_rows(args.sf);
    let sales = move |i| tpcds::sales_row(i, items);
    let tables: [(&str, u64, &RowFn); 3] = [
        ("date_dim", tpcds::DATE_ROWS, &tpcds::date_row),
        ("item", items, &tpcds::item_row),
        ("store_sales", tpcds::sales_rows(args.sf), &sales),
    ];
    for (name, rows, row) in tables {
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

pub async fn run(args: AnalyticsArgs) -> Result<(), CliError> {
    let node = Node::start(args.partitions, None)?;
    let client = Client::new(&node.url)?;
    let items = tpcds::item_rows(args.sf);
    let sales = tpcds::sales_rows(args.sf);
    let plan = BulkPlan { batch: 2000, concurrency: 4, persist: false };
    let start = Instant::now();
    let mut loaded = 0;
    for name in ["date_dim", "item", "store_sales"] {
        client.create_collection(name, None).await?;
        let (sent, failed) = match name {
            "date_dim" => {
                bulk_upsert(&client, name, tpcds::DATE_ROWS as usize, &plan, "date_dim_", |i| tpcds::date_row(i as u64).1.to_string())
                    .await?
            }
            "item" => bulk_upsert(&client, name, items as usize, &plan, "item_", |i| tpcds::item_row(i as u64).1.to_string()).await?,
            _ => {
                bulk_upsert(&client, name, sales as usize, &plan, "store_sales_", |i| tpcds::sales_row(i as u64, items).1.to_string())
                    .await?
            }
        };
        if failed > 0 {
            return Err(CliError::Usage(format!("loading {name}: {failed} errors")));
        }
        loaded += sent;
    }
    let load_secs = start.elapsed().as_secs_f64();
    println!("loaded {loaded} documents in {load_secs:.1}s ({:.0} docs/s)", loaded as f64 / load_secs);
    let mut times = Vec::new();
    let mut answer = Value::Null;
    for run in 0..args.runs.max(1) {
        let t = Instant::now();
        answer = client.query(&json!({"sql": tpcds::QUERY_3, "timeout_ms": 3_600_000})).await?;
        let secs = t.elapsed().as_secs_f64();
        println!("query 3 on /v1/query, run {}: {secs:.2}s", run + 1);
        times.push(secs);
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let all: Vec<String> = times.iter().map(|t| format!("{t:.2}")).collect();
    let mut report = format!(
        "| path | scale factor | documents | load (s) | load docs/s | query 3 median (s) | runs (s) |\n|---|---|---|---|---|---|---|\n| `/v1/query` | {} | {loaded} | {load_secs:.1} | {:.0} | {median:.2} | {} |\n\nquery 3's answer ({} rows):\n\n",
        args.sf,
        loaded as f64 / load_secs,
        all.join(", "),
        answer["rows"].as_array().map_or(0, Vec::len),
    );
    report.push_str("| d_year | brand_id | brand | sum_agg |\n|---|---|---|---|\n");
    for row in answer["rows"].as_array().into_iter().flatten() {
        let cells: Vec<String> = row.as_array().into_iter().flatten().map(|v| v.to_string()).collect();
        report.push_str(&format!("| {} |\n", cells.join(" | ")));
    }
    print!("\n{report}");
    write_result(&args.out_dir, "analytics-seed004.md", &report)?;
    drop(node);
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
    let node = Node::start(128, None)?;
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
    crate::bench_index::wait_ready(&client, "events").await?;
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
