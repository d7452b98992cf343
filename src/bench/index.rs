//! `shoal bench index`: seed 002's experiment. For each partition count a fresh node is
//! started, 800,000 user records are loaded, two indexes are built together, then 50 and
//! 100 concurrent "users" read all their documents through the user index.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use serde_json::json;
use shoal_client::Client;

use crate::cli::CliError;

#[derive(Args)]
pub struct IndexArgs {
    /// Documents to load (seed 002: 800,000).
    #[arg(long, default_value_t = 800_000)]
    docs: usize,
    /// Documents per user (seed 002: 2,200).
    #[arg(long, default_value_t = 2200)]
    per_user: usize,
    /// Partition counts, one fresh node each.
    #[arg(long, value_delimiter = ',', default_value = "16,64,256")]
    partitions: Vec<u16>,
    /// Concurrent users in the replication test.
    #[arg(long, value_delimiter = ',', default_value = "50,100")]
    users: Vec<usize>,
    /// Index workers of the started nodes (default: one per core).
    #[arg(long)]
    index_workers: Option<usize>,
    /// Seconds of the index-lag test at `--lag-rate` upserts/s (0: skip), on the last node.
    #[arg(long, default_value_t = 10)]
    lag_secs: u64,
    #[arg(long, default_value_t = 5000)]
    lag_rate: u64,
    /// Builds timed per partition count (the indexes are dropped and built again); the
    /// median is reported.
    #[arg(long, default_value_t = 3)]
    build_runs: usize,
    /// Where the table and chart go (nothing is written when empty).
    #[arg(long, default_value = "bench/results")]
    out_dir: PathBuf,
}

/// Runs of each replication test; the median is reported.
const READ_RUNS: usize = 5;

const TYPES: [&str; 5] = ["data_record", "contact", "task", "report", "person"];

/// A record of seed 002's shape: ~300 bytes, belonging to a user.
pub(crate) fn record(i: usize, per_user: usize) -> String {
    let user = i / per_user.max(1);
    let ty = TYPES[(i * 7 + user) % TYPES.len()];
    let day = i % per_user.max(1);
    json!({
        "user_id": format!("user-{user:06}"),
        "type": ty,
        "reported_date": format!("2026-{:02}-{:02}T{:02}:{:02}:00Z", 1 + day / 200 % 12, 1 + day % 28, day % 24, i % 60),
        "form": format!("form-{}", i % 17),
        "fields": {"patient_id": format!("p-{}", i % 9973), "visited": i.is_multiple_of(3), "score": i % 101, "note": "routine follow-up visit recorded"},
        "contact": {"_id": format!("c-{}", user), "parent": {"_id": format!("hc-{}", user % 50)}},
    })
    .to_string()
}

pub(crate) struct Node {
    child: Child,
    dir: PathBuf,
    pub(crate) url: String,
}

impl Node {
    /// Waits (at most `max`) until the node has used under 5 % of one core for a second —
    /// background work after a load (storage compaction, shadow checkpoints) is done —
    /// and answers the seconds waited. Linux only; elsewhere it does not wait.
    pub(crate) fn wait_idle(&self, max: std::time::Duration) -> f64 {
        let ticks = || self.cpu_ticks();
        let start = std::time::Instant::now();
        while start.elapsed() < max {
            let Some(before) = ticks() else { break };
            std::thread::sleep(std::time::Duration::from_secs(1));
            let Some(after) = ticks() else { break };
            if after.saturating_sub(before) < 5 {
                break;
            }
        }
        start.elapsed().as_secs_f64()
    }

    /// A metric of the node (0 when it is not there yet).
    pub(crate) async fn metric(&self, http: &reqwest::Client, name: &str) -> Result<f64, CliError> {
        let metrics = |e: reqwest::Error| CliError::Bench(format!("{}/metrics: {e}", self.url));
        let text = http.get(format!("{}/metrics", self.url)).send().await.map_err(metrics)?.text().await.map_err(metrics)?;
        Ok(text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0))
    }

    /// CPU time the node has used (user + system), in clock ticks (100 per second on
    /// Linux); `None` where `/proc` does not have it.
    pub(crate) fn cpu_ticks(&self) -> Option<u64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).ok()?;
        // Fields after the command name (which may hold spaces): utime and stime are the
        // 12th and 13th.
        let rest = stat.rsplit_once(')')?.1;
        let f: Vec<&str> = rest.split_whitespace().collect();
        Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
    }

    /// CPU ticks of each of the node's live threads: thread id → (name, ticks). Threads
    /// that ended are missing; [`cpu_by_thread`] counts them from the process total.
    pub(crate) fn thread_ticks(&self) -> std::collections::HashMap<u64, (String, u64)> {
        let mut out = std::collections::HashMap::new();
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", self.child.id())) else { return out };
        for task in tasks.flatten() {
            let Some(tid) = task.file_name().to_str().and_then(|t| t.parse::<u64>().ok()) else { continue };
            let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else { continue };
            let (Some((head, rest)), Some(start)) = (stat.rsplit_once(')'), stat.find('(')) else { continue };
            let name = head[start + 1..].to_string();
            let f: Vec<&str> = rest.split_whitespace().collect();
            if let (Some(u), Some(s)) = (f.get(11).and_then(|v| v.parse::<u64>().ok()), f.get(12).and_then(|v| v.parse::<u64>().ok())) {
                out.insert(tid, (name, u + s));
            }
        }
        out
    }

    pub(crate) fn start(partitions: u16, extra: &[String]) -> Result<Node, CliError> {
        Node::start_named(&format!("index-{partitions}"), partitions, extra)
    }

    /// A node whose data directory is named after `name` (one per node of a bench).
    pub(crate) fn start_named(name: &str, partitions: u16, extra: &[String]) -> Result<Node, CliError> {
        use std::io::BufRead;
        let dir = std::env::temp_dir().join(format!("shoal-bench-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let exe = std::env::current_exe()?;
        let mut cmd = Command::new(exe);
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--partitions", &partitions.to_string(), "--data-path"]).arg(&dir);
        cmd.args(extra);
        // The nodes log warnings; `SHOAL_BENCH_NODE_LOG` (a `SHOAL_LOG` filter) asks for more.
        // Each line it logs goes out prefixed with the node's name, so that several nodes'
        // logs can be told apart.
        let log = std::env::var("SHOAL_BENCH_NODE_LOG").unwrap_or_else(|_| "warn".into());
        let mut child = cmd
            .env("SHOAL_LOG", log)
            .env("SHOAL_ADMIN_PASSWORD", crate::bench::BENCH_ADMIN_PASSWORD)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        if let Some(stderr) = child.stderr.take() {
            let name = name.to_string();
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                    eprintln!("[{name}] {line}");
                }
            });
        }
        let stdout = child.stdout.take().ok_or_else(|| CliError::Usage("no stdout from shoal serve".into()))?;
        let mut lines = std::io::BufReader::new(stdout).lines();
        let first = lines.next().transpose()?.unwrap_or_default();
        let address = first.strip_prefix("shoal listening on http://").ok_or_else(|| CliError::Usage(format!("server said {first:?}")))?;
        // Calls to the node carry its admin's credentials.
        let url = format!("http://admin:{}@{address}", crate::bench::BENCH_ADMIN_PASSWORD);
        std::thread::spawn(move || for _ in lines {});
        Ok(Node { child, dir, url })
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        #[cfg(unix)]
        // SAFETY: kill takes no pointers; the pid is our own child's.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The two indexes of the experiment, built together.
const INDEXES: [(&str, [&str; 2]); 2] = [("by_user", ["user_id", "reported_date"]), ("by_type", ["type", "reported_date"])];

/// Creates both indexes deferred, builds them together, and returns the seconds until both
/// are ready (checking that each holds every document).
async fn build(client: &Client, docs: usize) -> Result<f64, CliError> {
    for (name, keys) in INDEXES {
        client.create_index("records", &json!({"name": name, "keys": keys, "defer_build": true})).await?;
    }
    let start = Instant::now();
    client.build_indexes("records", &INDEXES.map(|(n, _)| n)).await?;
    let list = wait_ready(client, "records").await?;
    let secs = start.elapsed().as_secs_f64();
    let items: Vec<u64> = list.iter().map(|i| i["items"].as_u64().unwrap_or(0)).collect();
    if items.iter().any(|&n| n != docs as u64) {
        return Err(CliError::Usage(format!("index items {items:?}, expected {docs}")));
    }
    Ok(secs)
}

/// Polls until every index of `collection` is ready; answers their listing.
pub(crate) async fn wait_ready(client: &Client, collection: &str) -> Result<Vec<serde_json::Value>, CliError> {
    loop {
        let list = client.list_indexes(collection).await?;
        if list.iter().all(|i| i["state"] == "ready") {
            return Ok(list);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

struct Row {
    partitions: u16,
    load_secs: f64,
    build_secs: f64,
    reads: Vec<(usize, f64)>,
}

pub async fn run(args: IndexArgs) -> Result<(), CliError> {
    let mut rows = Vec::new();
    let last = args.partitions.len().saturating_sub(1);
    let mut lag = None;
    for (n, &partitions) in args.partitions.iter().enumerate() {
        // Seed 002's experiment is about indexes: no analytics shadow competes for the cores.
        let mut extra = vec!["--analytics-partitions".to_string(), "0".to_string()];
        if let Some(w) = args.index_workers {
            extra.extend(["--index-workers".to_string(), w.to_string()]);
        }
        let node = Node::start(partitions, &extra)?;
        let client = Client::new(&node.url)?;
        client.create_collection("records", None).await?;
        let load_secs = load(&client, args.docs, args.per_user).await?;
        println!("partitions {partitions}: loaded {} docs in {load_secs:.2}s ({:.0} docs/s)", args.docs, args.docs as f64 / load_secs);
        let mut builds = Vec::new();
        for run in 0..args.build_runs.max(1) {
            if run > 0 {
                for name in INDEXES.map(|(n, _)| n) {
                    client.drop_index("records", name).await?;
                }
            }
            builds.push(build(&client, args.docs).await?);
        }
        builds.sort_by(f64::total_cmp);
        let build_secs = builds[builds.len() / 2];
        let all: Vec<String> = builds.iter().map(|r| format!("{r:.2}")).collect();
        println!(
            "partitions {partitions}: built 2 indexes together in {build_secs:.2}s ({:.0} docs/s per index; median of {})",
            args.docs as f64 / build_secs,
            all.join(", ")
        );
        let mut reads = Vec::new();
        for &users in &args.users {
            // The median of several runs: one run is half a second on a noisy machine.
            let mut runs = Vec::new();
            for _ in 0..READ_RUNS {
                runs.push(replicate(&client, users, args.docs.div_ceil(args.per_user.max(1)), args.per_user).await?);
            }
            runs.sort_by(f64::total_cmp);
            let secs = runs[runs.len() / 2];
            let all: Vec<String> = runs.iter().map(|r| format!("{r:.3}")).collect();
            println!("partitions {partitions}: {users} users read all their documents in {secs:.3}s (median of {})", all.join(", "));
            reads.push((users, secs));
        }
        rows.push(Row { partitions, load_secs, build_secs, reads });
        if n == last && args.lag_secs > 0 {
            lag = Some(index_lag(&client, args.lag_secs, args.lag_rate).await?);
        }
    }
    report(&args, &rows, lag)
}

async fn load(client: &Client, docs: usize, per_user: usize) -> Result<f64, CliError> {
    let start = Instant::now();
    let (_, failed) = {
        let plan = crate::bench::BulkPlan { batch: 2000, concurrency: 4, persist: false };
        crate::bench::bulk_upsert(client, "records", docs, &plan, "rec-", |i| record(i, per_user)).await?
    };
    if failed > 0 {
        return Err(CliError::Usage(format!("bulk load reported {failed} errors")));
    }
    Ok(start.elapsed().as_secs_f64())
}

/// Seed 002's replication test: `users` users at once, each reading all their documents
/// (with bodies) through the user index. Seconds until the last one finishes.
async fn replicate(client: &Client, users: usize, user_count: usize, per_user: usize) -> Result<f64, CliError> {
    let start = Instant::now();
    let tasks: Vec<_> = (0..users)
        .map(|u| {
            let client = client.clone();
            let user = format!("user-{:06}", (u * 7919) % user_count.max(1));
            tokio::spawn(async move {
                let answer =
                    client.scan_index("records", "by_user", &json!({"eq": [user], "include_docs": true, "limit": per_user.max(1)})).await?;
                let n = answer["rows"].as_array().map(Vec::len).unwrap_or(0);
                Ok::<_, CliError>(n)
            })
        })
        .collect();
    for t in tasks {
        let n = t.await.map_err(|e| CliError::Usage(format!("reader failed: {e}")))??;
        if n == 0 {
            return Err(CliError::Usage("a user read no documents".into()));
        }
    }
    Ok(start.elapsed().as_secs_f64())
}

/// Index lag under `rate` upserts/s: a probe writes a new key value and polls a
/// `not_bounded` scan until it shows; returns (p50, p99, max) in ms and the achieved rate.
async fn index_lag(client: &Client, secs: u64, rate: u64) -> Result<(f64, f64, f64, f64), CliError> {
    let probe_client = client.clone();
    write_lag(
        client,
        "records",
        LagRun { secs, rate },
        |w, i| (format!("rec-{:08}", (w * 100_003 + i * 7) % 800_000), record((w * 1000 + i) as usize, 2200)),
        |marker| ("lag-probe".to_string(), json!({"user_id": "lag-probe", "reported_date": marker, "type": "probe"}).to_string()),
        move |marker| {
            let client = probe_client.clone();
            async move {
                let answer = client.scan_index("records", "by_user", &json!({"eq": ["lag-probe", marker]})).await?;
                Ok(answer["rows"].as_array().is_some_and(|r| !r.is_empty()))
            }
        },
        "index",
    )
    .await
}

/// How long and how fast a lag run writes.
pub(crate) struct LagRun {
    pub secs: u64,
    pub rate: u64,
}

/// Lag of whatever follows the change stream, under `run.rate` upserts/s into `collection`
/// (`doc(writer, i)` gives each write's key and body): a probe writes a fresh marker
/// (`probe(marker)`) and polls `visible(marker)` until it shows, one probe at a time.
/// Returns (p50, p99, max) in ms and the achieved write rate.
pub(crate) async fn write_lag<D, P, V, F>(
    client: &Client,
    collection: &str,
    run: LagRun,
    doc: D,
    probe: P,
    visible: V,
    what: &str,
) -> Result<(f64, f64, f64, f64), CliError>
where
    D: Fn(u64, u64) -> (String, String) + Clone + Send + Sync + 'static,
    P: Fn(&str) -> (String, String),
    V: Fn(String) -> F,
    F: std::future::Future<Output = Result<bool, CliError>>,
{
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let written = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    const WRITERS: u64 = 32;
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (client, stop, written, doc, collection) = (client.clone(), stop.clone(), written.clone(), doc.clone(), collection.to_string());
        let period = Duration::from_secs_f64(WRITERS as f64 / run.rate.max(1) as f64);
        writers.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                tick.tick().await;
                let (key, body) = doc(w, i);
                if client.put(&collection, &key, body, &Default::default()).await.is_ok() {
                    written.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                i += 1;
            }
        }));
    }
    let start = Instant::now();
    let mut lags = Vec::new();
    let mut seq = 0u64;
    while start.elapsed() < Duration::from_secs(run.secs) {
        seq += 1;
        let marker = format!("probe-{seq:08}");
        let (key, body) = probe(&marker);
        client.put(collection, &key, body, &Default::default()).await?;
        let t = Instant::now();
        while !visible(marker.clone()).await? {
            if t.elapsed() > Duration::from_secs(10) {
                return Err(CliError::Usage(format!("a write did not reach the {what} within 10 s")));
            }
            tokio::time::sleep(Duration::from_micros(500)).await;
        }
        lags.push(t.elapsed().as_micros().min(u128::from(u32::MAX)) as u32);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in writers {
        let _ = w.await;
    }
    let achieved = written.load(std::sync::atomic::Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64();
    lags.sort_unstable();
    let pct = |p: f64| crate::bench::percentile(&lags, p);
    println!(
        "{what} lag under {achieved:.0} upserts/s: {} probes, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        lags.len(),
        pct(0.5),
        pct(0.99),
        pct(1.0)
    );
    Ok((pct(0.5), pct(0.99), pct(1.0), achieved))
}

fn report(args: &IndexArgs, rows: &[Row], lag: Option<(f64, f64, f64, f64)>) -> Result<(), CliError> {
    let mut table = String::new();
    let mut header = "| partitions | load (s) | build 2 indexes (s) | docs/s per index |".to_string();
    let mut rule = "|---|---|---|---|".to_string();
    for &u in &args.users {
        header.push_str(&format!(" read {u} users (s) |"));
        rule.push_str("---|");
    }
    table.push_str(&header);
    table.push('\n');
    table.push_str(&rule);
    table.push('\n');
    for r in rows {
        table.push_str(&format!(
            "| {} | {:.2} | {:.2} | {:.0} |",
            r.partitions,
            r.load_secs,
            r.build_secs,
            args.docs as f64 / r.build_secs
        ));
        for (_, s) in &r.reads {
            table.push_str(&format!(" {s:.3} |"));
        }
        table.push('\n');
    }
    let spread = |values: Vec<f64>| {
        let (lo, hi) = values.iter().fold((f64::MAX, 0f64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        if lo > 0.0 && lo < f64::MAX {
            (hi / lo - 1.0) * 100.0
        } else {
            0.0
        }
    };
    table.push_str(&format!("\nspread (max/min − 1): build {:.1} %", spread(rows.iter().map(|r| r.build_secs).collect())));
    for (i, u) in args.users.iter().enumerate() {
        table.push_str(&format!(", read {u} users {:.1} %", spread(rows.iter().filter_map(|r| r.reads.get(i).map(|x| x.1)).collect())));
    }
    table.push('\n');
    if let Some((p50, p99, max, rate)) = lag {
        table.push_str(&format!("index lag under {rate:.0} upserts/s: p50 {p50:.2} ms, p99 {p99:.2} ms, max {max:.2} ms\n"));
    }
    println!("\n{table}");
    if args.out_dir.as_os_str().is_empty() {
        return Ok(());
    }
    std::fs::create_dir_all(&args.out_dir)?;
    std::fs::write(args.out_dir.join("index-seed002.md"), &table)?;
    let mut series = vec![crate::bench::chart::Series {
        name: "build 2 indexes".into(),
        points: rows.iter().map(|r| (f64::from(r.partitions), r.build_secs)).collect(),
    }];
    for (i, u) in args.users.iter().enumerate() {
        series.push(crate::bench::chart::Series {
            name: format!("read, {u} users"),
            points: rows.iter().filter_map(|r| r.reads.get(i).map(|x| (f64::from(r.partitions), x.1))).collect(),
        });
    }
    let png = args.out_dir.join("index-seed002.png");
    match crate::bench::chart::line_chart(
        &png,
        "Seed 002 on Shoal: partitions vs build and read time",
        "partitions",
        "seconds",
        &series,
        true,
    ) {
        Ok(()) => println!("wrote {} and {}", args.out_dir.join("index-seed002.md").display(), png.display()),
        Err(e) => println!("chart not drawn: {e}"),
    }
    Ok(())
}

/// CPU seconds between two looks at a node, by thread name (Linux truncates names to 15
/// bytes), largest first; threads that ended in between (a copy's export and ingest threads
/// live for one copy) are summed as "ended threads" from the process total.
pub(crate) fn cpu_by_thread(
    before: &std::collections::HashMap<u64, (String, u64)>,
    after: &std::collections::HashMap<u64, (String, u64)>,
    total_ticks: u64,
) -> Vec<(String, f64)> {
    let mut by_name: std::collections::BTreeMap<String, u64> = std::collections::BTreeMap::new();
    let mut live = 0u64;
    for (tid, (name, ticks)) in after {
        let delta = ticks.saturating_sub(before.get(tid).map_or(0, |(_, t)| *t));
        live += delta;
        *by_name.entry(name.clone()).or_default() += delta;
    }
    let gone: u64 = before.iter().filter(|(tid, _)| !after.contains_key(tid)).map(|(_, (_, t))| *t).sum();
    let ended = (total_ticks + gone).saturating_sub(live);
    if ended > 0 {
        *by_name.entry("ended threads".into()).or_default() += ended;
    }
    let mut out: Vec<(String, f64)> = by_name.into_iter().filter(|(_, t)| *t > 0).map(|(n, t)| (n, t as f64 / 100.0)).collect();
    out.sort_by(|a, b| b.1.total_cmp(&a.1));
    out
}
