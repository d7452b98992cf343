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

use crate::bench::{bulk_upsert, BulkPlan};
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
    if !args.out_dir.as_os_str().is_empty() {
        std::fs::create_dir_all(&args.out_dir)?;
        let file = args.out_dir.join("analytics-seed004.md");
        std::fs::write(&file, &report)?;
        println!("wrote {}", file.display());
    }
    drop(node);
    Ok(())
}
