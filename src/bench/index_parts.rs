//! `shoal bench index-parts`: what splitting an index into partitions costs on one node
//! (issue 41). For each configuration — no index, then five indexes of 1 part each, then
//! five of `--index-partitions` parts each — a fresh node is started, the indexes are
//! created on the empty collection, and documents are loaded and indexed: write throughput
//! counts until a `request_plus` scan of every index answers. Then the same `eq` scans (one
//! part) and range scans (every part, merged) are timed on each configuration. The
//! baseline is in the same run: no index for writes, one part for scans.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use serde_json::json;
use shoal_client::Client;

use crate::bench::index::{record, Node};
use crate::cli::CliError;

#[derive(Args)]
pub struct IndexPartsArgs {
    /// Documents to load per configuration.
    #[arg(long, default_value_t = 200_000)]
    docs: usize,
    /// Documents per user (the leading key of the first index).
    #[arg(long, default_value_t = 200)]
    per_user: usize,
    /// Data partitions of the started nodes.
    #[arg(long, default_value_t = 128)]
    partitions: u16,
    /// Index partitions compared with one (every index of a configuration has as many).
    #[arg(long, value_delimiter = ',', default_value = "8")]
    index_partitions: Vec<u16>,
    /// Loads timed per configuration (a fresh node each); the median is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Scans timed per kind and configuration.
    #[arg(long, default_value_t = 2000)]
    scans: usize,
    /// Where the table goes (nothing is written when empty).
    #[arg(long, default_value = "bench/results")]
    out_dir: PathBuf,
}

/// The five indexes of a configuration: name and key.
const INDEXES: [(&str, &str); 5] =
    [("by_user", "user_id"), ("by_type", "type"), ("by_date", "reported_date"), ("by_form", "form"), ("by_patient", "fields.patient_id")];

struct Row {
    what: String,
    /// Seconds until loaded and indexed, per run.
    secs: Vec<f64>,
    /// Seconds until every write was acknowledged (indexes follow asynchronously), per run.
    acked: Vec<f64>,
    /// eq and range scan latencies (µs), when the configuration has indexes.
    eq_us: Vec<u32>,
    range_us: Vec<u32>,
}

pub async fn run(args: IndexPartsArgs) -> Result<(), CliError> {
    let mut configs: Vec<Option<u16>> = vec![None, Some(1)];
    configs.extend(args.index_partitions.iter().copied().filter(|&n| n != 1).map(Some));
    let mut rows = Vec::new();
    for config in configs {
        let what = match config {
            None => "no index".to_string(),
            Some(n) => format!("5 indexes × {n} part{}", if n == 1 { "" } else { "s" }),
        };
        let mut row = Row { what: what.clone(), secs: Vec::new(), acked: Vec::new(), eq_us: Vec::new(), range_us: Vec::new() };
        for run in 0..args.runs.max(1) {
            let extra = vec!["--analytics-partitions".to_string(), "0".to_string()];
            let node = Node::start_named(&format!("index-parts-{run}"), args.partitions, &extra)?;
            let client = Client::new(&node.url)?;
            client.create_collection("records", None).await?;
            if let Some(parts) = config {
                for (name, key) in INDEXES {
                    client.create_index("records", &json!({"name": name, "keys": [key], "partitions": parts})).await?;
                }
            }
            let start = Instant::now();
            let plan = crate::bench::BulkPlan { batch: 2000, concurrency: 4, persist: false };
            let per_user = args.per_user;
            let (_, failed) = crate::bench::bulk_upsert(&client, "records", args.docs, &plan, "rec-", |i| record(i, per_user)).await?;
            if failed > 0 {
                return Err(CliError::Usage(format!("bulk load reported {failed} errors")));
            }
            row.acked.push(start.elapsed().as_secs_f64());
            if config.is_some() {
                for (name, _) in INDEXES {
                    let ask = json!({"eq": ["none"], "limit": 1, "consistency": "request_plus"});
                    client.scan_index("records", name, &ask).await?;
                }
            }
            let secs = start.elapsed().as_secs_f64();
            println!("{what}, run {run}: {} docs loaded and indexed in {secs:.2}s ({:.0} docs/s)", args.docs, args.docs as f64 / secs);
            row.secs.push(secs);
            if config.is_some() && run == 0 {
                let users = (args.docs / args.per_user.max(1)).max(1);
                for i in 0..args.scans {
                    let user = format!("user-{:06}", (i * 7919) % users);
                    let t = Instant::now();
                    let answer = client.scan_index("records", "by_user", &json!({"eq": [user], "limit": 50})).await?;
                    row.eq_us.push(t.elapsed().as_micros().min(u128::from(u32::MAX)) as u32);
                    expect_rows(&answer, "eq")?;
                    let low = format!("user-{:06}", (i * 7919) % users);
                    let t = Instant::now();
                    let answer = client.scan_index("records", "by_user", &json!({"range": {"low": [low]}, "limit": 50})).await?;
                    row.range_us.push(t.elapsed().as_micros().min(u128::from(u32::MAX)) as u32);
                    expect_rows(&answer, "range")?;
                }
                row.eq_us.sort_unstable();
                row.range_us.sort_unstable();
            }
            drop(node);
        }
        rows.push(row);
    }
    report(&args, &rows)
}

fn expect_rows(answer: &serde_json::Value, what: &str) -> Result<(), CliError> {
    match answer["rows"].as_array() {
        Some(rows) if !rows.is_empty() => Ok(()),
        _ => Err(CliError::Usage(format!("an {what} scan read no rows: {answer}"))),
    }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn report(args: &IndexPartsArgs, rows: &[Row]) -> Result<(), CliError> {
    let base = rows.first().map(|r| median(&r.secs)).unwrap_or(1.0);
    let base_acked = rows.first().map(|r| median(&r.acked)).unwrap_or(1.0);
    let one_part = rows.get(1);
    let mut table = String::from(
        "| configuration | writes acknowledged (s, median) | × no index | loaded and indexed (s, median) | docs/s | × no index | eq scan p50 / p99 (ms) | range scan p50 / p99 (ms) |\n|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let secs = median(&r.secs);
        let pct = |v: &[u32], p: f64| crate::bench::percentile(v, p);
        let scans = |v: &[u32]| if v.is_empty() { "–".to_string() } else { format!("{:.2} / {:.2}", pct(v, 0.5), pct(v, 0.99)) };
        let acked = median(&r.acked);
        table.push_str(&format!(
            "| {} | {acked:.2} | {:.2} | {secs:.2} | {:.0} | {:.2} | {} | {} |\n",
            r.what,
            base_acked / acked,
            args.docs as f64 / secs,
            base / secs,
            scans(&r.eq_us),
            scans(&r.range_us)
        ));
    }
    if let Some(one) = one_part {
        for r in rows.iter().skip(2) {
            let ratio = |a: &[u32], b: &[u32]| crate::bench::percentile(a, 0.5) / crate::bench::percentile(b, 0.5).max(1e-9);
            table.push_str(&format!(
                "\n{}: eq scan p50 {:.2}× one part's, range scan p50 {:.2}× one part's.\n",
                r.what,
                ratio(&r.eq_us, &one.eq_us),
                ratio(&r.range_us, &one.range_us)
            ));
        }
    }
    println!("{table}");
    if !args.out_dir.as_os_str().is_empty() {
        std::fs::create_dir_all(&args.out_dir)?;
        let path = args.out_dir.join("index-parts.md");
        let cmd = std::env::args().collect::<Vec<_>>().join(" ");
        let text = format!(
            "# Index partitions on one node (issue 41)\n\n`{cmd}` — {} documents, {} data partitions, median of {} loads per configuration on a fresh node; scans: {} each, 50 rows, on the first load. One node; the bench client shares the machine's cores.\n\n{table}",
            args.docs, args.partitions, args.runs, args.scans
        );
        std::fs::write(&path, text)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
