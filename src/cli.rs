//! The client commands: collections, documents, changes and bulk load, over HTTP.

use std::io::{BufRead, Read};
use std::time::Instant;

use clap::{Args, Subcommand};
use futures::StreamExt;
use shoal_client::{ChangesOptions, Client, ClientError, PutMode, PutOptions};
use thiserror::Error;

use crate::Output;

#[derive(Debug, Error)]
pub enum CliError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error(transparent)]
    Server(#[from] shoal_server::ServerError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Usage(String),
    /// A benchmark that runs the engine in process failed.
    #[error("{0}")]
    Bench(String),
}

/// Where the CLI finds a local node's admin password when given no credentials (the
/// README's first command keeps its data in `./shoal-data`).
pub const LOCAL_ADMIN_PASSWORD_FILE: &str = "shoal-data/admin-password";

/// `url` with the credentials the CLI calls as: `user`/`password` when given (`--user`,
/// `SHOAL_USER`...), else `admin` with the password in [`LOCAL_ADMIN_PASSWORD_FILE`] when
/// that file is readable; `url` unchanged when it carries credentials already or none are
/// found (the server then answers `401`).
pub fn with_credentials(url: &str, user: Option<&str>, password: Option<&str>) -> Result<String, CliError> {
    let Some((scheme, rest)) = url.split_once("://") else { return Ok(url.to_string()) };
    if rest.split('/').next().is_some_and(|authority| authority.contains('@')) {
        return Ok(url.to_string());
    }
    let (user, password) = match (user, password) {
        (Some(u), Some(p)) => (u.to_string(), p.to_string()),
        (Some(_), None) | (None, Some(_)) => {
            return Err(CliError::Usage("give both --user and --password (or SHOAL_USER and SHOAL_PASSWORD)".into()))
        }
        (None, None) => match std::fs::read_to_string(LOCAL_ADMIN_PASSWORD_FILE) {
            Ok(p) => ("admin".to_string(), p.trim().to_string()),
            Err(_) => return Ok(url.to_string()),
        },
    };
    let enc = |s: &str| percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string();
    Ok(format!("{scheme}://{}:{}@{rest}", enc(&user), enc(&password)))
}

#[derive(Subcommand)]
pub enum CollectionCmd {
    /// Create a collection.
    Create {
        name: String,
        /// Longest expiry of any document, in seconds.
        #[arg(long)]
        max_ttl: Option<u32>,
    },
    /// List collections with their sizes.
    List,
    /// Drop a collection with its documents.
    Drop { name: String },
}

#[derive(Args)]
pub struct WriteArgs {
    collection: String,
    key: String,
    /// The document; `-` or nothing reads it from standard input.
    value: Option<String>,
    /// Expiry in seconds (up to 30 days relative, else a Unix time).
    #[arg(long)]
    expiry: Option<u64>,
    /// Only if the document still has this CAS.
    #[arg(long)]
    cas: Option<String>,
    /// Answer only once the write is fsynced.
    #[arg(long)]
    persist: bool,
}

#[derive(Subcommand)]
pub enum DocCmd {
    /// Print a document.
    Get {
        collection: String,
        key: String,
        /// Get and lock for this many seconds.
        #[arg(long)]
        lock: Option<u32>,
        /// Get and set the expiry to this many seconds.
        #[arg(long)]
        touch: Option<u64>,
    },
    /// Upsert a document.
    Put(WriteArgs),
    /// Insert a document that must not exist.
    Insert(WriteArgs),
    /// Replace a document that must exist.
    Replace(WriteArgs),
    /// Remove a document.
    Rm {
        collection: String,
        key: String,
        #[arg(long)]
        cas: Option<String>,
        #[arg(long)]
        persist: bool,
    },
    /// Change a document's expiry.
    Touch {
        collection: String,
        key: String,
        #[arg(long)]
        expiry: u64,
    },
    /// Release a lock taken by `doc get --lock`.
    Unlock { collection: String, key: String, cas: String },
}

#[derive(Subcommand)]
pub enum SubdocCmd {
    /// Values at paths (`""` is the whole document).
    Get { collection: String, key: String, paths: Vec<String> },
    /// Whether paths exist.
    Exists { collection: String, key: String, paths: Vec<String> },
    /// Number of elements or members at paths.
    Count { collection: String, key: String, paths: Vec<String> },
    /// Apply mutation specs atomically, e.g. `--spec '{"op":"upsert","path":"a.b","value":1}'`.
    Mutate {
        collection: String,
        key: String,
        #[arg(long = "spec", required = true)]
        specs: Vec<String>,
        /// replace (the document must exist), upsert or insert.
        #[arg(long, default_value = "replace")]
        store: String,
        #[arg(long)]
        cas: Option<String>,
        #[arg(long)]
        expiry: Option<u64>,
        #[arg(long)]
        persist: bool,
    },
}

#[derive(Subcommand)]
pub enum IndexCmd {
    /// Define an index, e.g. `shoal index create orders by_user user_id created_at --where "type = 'order'"`.
    /// A key `tags[*]` indexes each element of an array. Shows a progress bar until built.
    Create {
        collection: String,
        name: String,
        #[arg(required = true)]
        keys: Vec<String>,
        /// A SQL boolean expression over the document.
        #[arg(long = "where")]
        filter: Option<String>,
        /// Define only; build later with `shoal index build`.
        #[arg(long)]
        defer_build: bool,
        /// Return at once instead of waiting for the build.
        #[arg(long)]
        no_wait: bool,
    },
    /// Indexes of a collection with state, progress and items.
    List { collection: String },
    /// Build a deferred index (with a progress bar).
    Build {
        collection: String,
        name: String,
        #[arg(long)]
        no_wait: bool,
    },
    /// Drop an index.
    Drop { collection: String, name: String },
    /// Scan: `--eq` values or `--low`/`--high` bounds, each a JSON value (repeat for composite keys).
    Scan {
        collection: String,
        name: String,
        #[arg(long)]
        eq: Vec<String>,
        #[arg(long)]
        low: Vec<String>,
        #[arg(long)]
        high: Vec<String>,
        /// Leave out rows equal to `--low`.
        #[arg(long)]
        exclusive_low: bool,
        /// Leave out rows equal to `--high`.
        #[arg(long)]
        exclusive_high: bool,
        #[arg(long)]
        limit: Option<usize>,
        #[arg(long)]
        descending: bool,
        #[arg(long)]
        include_docs: bool,
        /// Wait until the index has every change made before the scan.
        #[arg(long)]
        request_plus: bool,
    },
}

fn json_values(flag: &str, values: &[String]) -> Result<Vec<serde_json::Value>, CliError> {
    values
        .iter()
        .map(|v| serde_json::from_str(v).map_err(|e| CliError::Usage(format!("--{flag} {v}: not JSON ({e}); quote strings: '\"abc\"'"))))
        .collect()
}

/// Polls the index until it is ready, with a progress bar on the terminal.
async fn wait_built(client: &Client, collection: &str, name: &str) -> Result<serde_json::Value, CliError> {
    let bar = indicatif::ProgressBar::new(1000);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {percent:>3}% {msg} ({elapsed})")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    loop {
        let list = client.list_indexes(collection).await?;
        let status = list.into_iter().find(|i| i["name"] == name).ok_or_else(|| CliError::Usage(format!("index {name} disappeared")))?;
        bar.set_position((status["progress"].as_f64().unwrap_or(0.0) * 1000.0) as u64);
        bar.set_message(format!("{} items", status["items"]));
        if status["state"] == "ready" {
            bar.finish();
            return Ok(status);
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

fn print_indexes(output: Output, list: &[serde_json::Value]) {
    match output {
        Output::Json => println!("{}", serde_json::Value::Array(list.to_vec())),
        Output::Table | Output::Csv => print_table(
            &["name", "keys", "where", "state", "progress", "items"],
            list.iter()
                .map(|i| {
                    vec![
                        i["name"].as_str().unwrap_or("").to_string(),
                        i["keys"].to_string(),
                        i["where"].as_str().unwrap_or("").to_string(),
                        i["state"].as_str().unwrap_or("").to_string(),
                        format!("{:.0}%", i["progress"].as_f64().unwrap_or(0.0) * 100.0),
                        i["items"].to_string(),
                    ]
                })
                .collect(),
        ),
    }
}

pub async fn index(url: &str, output: Output, cmd: IndexCmd) -> Result<(), CliError> {
    let client = Client::new(url)?;
    match cmd {
        IndexCmd::Create { collection, name, keys, filter, defer_build, no_wait } => {
            let mut def = serde_json::json!({"name": name, "keys": keys, "defer_build": defer_build});
            if let Some(f) = filter {
                def["where"] = f.into();
            }
            let mut status = client.create_index(&collection, &def).await?;
            if !defer_build && !no_wait {
                status = wait_built(&client, &collection, &name).await?;
            }
            print_indexes(output, &[status]);
        }
        IndexCmd::List { collection } => print_indexes(output, &client.list_indexes(&collection).await?),
        IndexCmd::Build { collection, name, no_wait } => {
            let mut status = client.build_index(&collection, &name).await?;
            if !no_wait {
                status = wait_built(&client, &collection, &name).await?;
            }
            print_indexes(output, &[status]);
        }
        IndexCmd::Drop { collection, name } => client.drop_index(&collection, &name).await?,
        IndexCmd::Scan {
            collection,
            name,
            eq,
            low,
            high,
            exclusive_low,
            exclusive_high,
            limit,
            descending,
            include_docs,
            request_plus,
        } => {
            let mut req = serde_json::json!({"descending": descending, "include_docs": include_docs});
            if !eq.is_empty() {
                req["eq"] = json_values("eq", &eq)?.into();
            }
            if !low.is_empty() || !high.is_empty() {
                let mut range = serde_json::json!({"inclusive_low": !exclusive_low, "inclusive_high": !exclusive_high});
                if !low.is_empty() {
                    range["low"] = json_values("low", &low)?.into();
                }
                if !high.is_empty() {
                    range["high"] = json_values("high", &high)?.into();
                }
                req["range"] = range;
            }
            if let Some(l) = limit {
                req["limit"] = l.into();
            }
            if request_plus {
                req["consistency"] = "request_plus".into();
            }
            let answer = client.scan_index(&collection, &name, &req).await?;
            let rows = answer["rows"].as_array().cloned().unwrap_or_default();
            match output {
                Output::Json => println!("{answer}"),
                Output::Table | Output::Csv => {
                    let header: &[&str] = if include_docs { &["key", "id", "doc"] } else { &["key", "id"] };
                    let rows = rows
                        .iter()
                        .map(|r| {
                            let mut row = vec![r["key"].to_string(), r["id"].as_str().unwrap_or("").to_string()];
                            if include_docs {
                                row.push(r["doc"].to_string());
                            }
                            row
                        })
                        .collect();
                    print_table(header, rows);
                }
            }
        }
    }
    Ok(())
}

#[derive(Args)]
pub struct ChangesArgs {
    collection: String,
    /// Resume after this token (from a previous `last` line).
    #[arg(long)]
    since: Option<String>,
    /// normal, longpoll or continuous.
    #[arg(long, default_value = "normal")]
    feed: String,
    #[arg(long)]
    limit: Option<usize>,
    #[arg(long)]
    include_docs: bool,
    /// Milliseconds a longpoll or continuous feed stays open.
    #[arg(long)]
    timeout: Option<u64>,
}

#[derive(Args)]
pub struct LoadArgs {
    pub collection: String,
    /// NDJSON: lines of `{"op","key","value"...}` as `_bulk` takes, or `{"key","value"}`.
    pub file: std::path::PathBuf,
    /// Lines per `_bulk` request.
    #[arg(long, default_value_t = 5000)]
    pub batch: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    #[arg(long)]
    pub persist: bool,
}

pub async fn collection(url: &str, output: Output, cmd: CollectionCmd) -> Result<(), CliError> {
    let client = Client::new(url)?;
    match cmd {
        CollectionCmd::Create { name, max_ttl } => {
            client.create_collection(&name, max_ttl).await?;
            println!("created collection {name}");
        }
        CollectionCmd::List => {
            let list = client.list_collections().await?;
            match output {
                Output::Json => println!("{}", serde_json::to_string_pretty(&list).unwrap_or_default()),
                Output::Table | Output::Csv => {
                    let rows =
                        list.iter().map(|c| vec![c.name.clone(), c.docs.to_string(), c.bytes.to_string(), c.max_ttl.to_string()]).collect();
                    print_table(&["name", "docs", "bytes", "max_ttl"], rows);
                }
            }
        }
        CollectionCmd::Drop { name } => {
            client.drop_collection(&name).await?;
            println!("dropped collection {name}");
        }
    }
    Ok(())
}

pub async fn doc(url: &str, output: Output, cmd: DocCmd) -> Result<(), CliError> {
    let client = Client::new(url)?;
    let mutation = match cmd {
        DocCmd::Get { collection, key, lock, touch } => {
            let doc = client.get(&collection, &key, lock, touch).await?;
            let value = String::from_utf8_lossy(&doc.value);
            match output {
                Output::Json => println!("{value}"),
                Output::Table | Output::Csv => print_table(&["key", "cas", "value"], vec![vec![key, doc.cas, value.into_owned()]]),
            }
            return Ok(());
        }
        DocCmd::Put(w) => write(&client, w, PutMode::Upsert).await?,
        DocCmd::Insert(w) => write(&client, w, PutMode::Insert).await?,
        DocCmd::Replace(w) => write(&client, w, PutMode::Replace).await?,
        DocCmd::Rm { collection, key, cas, persist } => client.remove(&collection, &key, cas.as_deref(), persist).await?,
        DocCmd::Touch { collection, key, expiry } => client.touch(&collection, &key, expiry).await?,
        DocCmd::Unlock { collection, key, cas } => {
            client.unlock(&collection, &key, &cas).await?;
            println!("unlocked {key}");
            return Ok(());
        }
    };
    match output {
        Output::Json => println!("{}", serde_json::to_string(&mutation).unwrap_or_default()),
        Output::Table | Output::Csv => print_table(
            &["cas", "partition", "seqno", "uuid"],
            vec![vec![mutation.cas, mutation.token.partition.to_string(), mutation.token.seqno.to_string(), mutation.token.uuid]],
        ),
    }
    Ok(())
}

async fn write(client: &Client, w: WriteArgs, mode: PutMode) -> Result<shoal_client::Mutation, CliError> {
    let value = match w.value.as_deref() {
        None | Some("-") => {
            let mut buf = Vec::new();
            std::io::stdin().read_to_end(&mut buf)?;
            buf
        }
        Some(v) => v.as_bytes().to_vec(),
    };
    let options = PutOptions { mode, cas: w.cas, expiry: w.expiry, persist: w.persist };
    Ok(client.put(&w.collection, &w.key, value, &options).await?)
}

pub async fn subdoc(url: &str, output: Output, cmd: SubdocCmd) -> Result<(), CliError> {
    let client = Client::new(url)?;
    let (answer, paths) = match cmd {
        SubdocCmd::Get { collection, key, paths } => (lookup(&client, &collection, &key, "get", &paths).await?, paths),
        SubdocCmd::Exists { collection, key, paths } => (lookup(&client, &collection, &key, "exists", &paths).await?, paths),
        SubdocCmd::Count { collection, key, paths } => (lookup(&client, &collection, &key, "count", &paths).await?, paths),
        SubdocCmd::Mutate { collection, key, specs, store, cas, expiry, persist } => {
            let specs: Vec<serde_json::Value> = specs
                .iter()
                .map(|s| serde_json::from_str(s).map_err(|e| CliError::Usage(format!("--spec {s}: {e}"))))
                .collect::<Result<_, _>>()?;
            let paths = specs.iter().map(|s| s["path"].as_str().unwrap_or("").to_string()).collect();
            let mut body = serde_json::json!({"specs": specs, "store": store});
            if let Some(cas) = cas {
                body["cas"] = cas.into();
            }
            if let Some(e) = expiry {
                body["expiry"] = e.into();
            }
            if persist {
                body["durability"] = "persist".into();
            }
            (client.mutate(&collection, &key, &body).await?, paths)
        }
    };
    match output {
        Output::Json => println!("{answer}"),
        Output::Table | Output::Csv => {
            let results = answer["results"].as_array().cloned().unwrap_or_default();
            let rows = paths
                .into_iter()
                .zip(results)
                .map(|(p, r)| {
                    vec![p, r["status"].as_str().unwrap_or("").to_string(), r.get("value").map(|v| v.to_string()).unwrap_or_default()]
                })
                .collect();
            print_table(&["path", "status", "value"], rows);
            println!("cas: {}", answer["cas"].as_str().unwrap_or(""));
        }
    }
    Ok(())
}

async fn lookup(client: &Client, collection: &str, key: &str, op: &str, paths: &[String]) -> Result<serde_json::Value, CliError> {
    if paths.is_empty() {
        return Err(CliError::Usage("give at least one path (\"\" is the whole document)".into()));
    }
    let specs: Vec<serde_json::Value> = paths.iter().map(|p| serde_json::json!({"op": op, "path": p})).collect();
    Ok(client.lookup(collection, key, &serde_json::Value::Array(specs)).await?)
}

pub async fn changes(url: &str, output: Output, args: ChangesArgs) -> Result<(), CliError> {
    let client = Client::with_options(
        url,
        shoal_client::ClientOptions { timeout: std::time::Duration::from_secs(24 * 3600), ..Default::default() },
    )?;
    let options = ChangesOptions {
        since: args.since,
        feed: Some(args.feed),
        limit: args.limit,
        include_docs: args.include_docs,
        timeout_ms: args.timeout,
    };
    let resp = client.changes(&args.collection, &options).await?;
    let mut stream = resp.bytes_stream();
    let mut pending = Vec::new();
    if output != Output::Json {
        println!("{:<40} {:>9} {:>10} {:>7}  doc", "key", "partition", "seqno", "deleted");
    }
    while let Some(chunk) = stream.next().await {
        pending.extend_from_slice(&chunk.map_err(ClientError::from)?);
        while let Some(end) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            print_change_line(output, &line[..line.len() - 1]);
        }
    }
    Ok(())
}

fn print_change_line(output: Output, line: &[u8]) {
    if output == Output::Json {
        println!("{}", String::from_utf8_lossy(line));
        return;
    }
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(line) else { return };
    if let Some(last) = v.get("last") {
        println!("last: {}", last.as_str().unwrap_or(""));
    } else if let Some(r) = v.get("rollback") {
        println!("rollback: partition {} to seqno {}", r["partition"], r["seqno"]);
    } else {
        let doc = v.get("doc").map(|d| d.to_string()).unwrap_or_default();
        println!("{:<40} {:>9} {:>10} {:>7}  {}", v["key"].as_str().unwrap_or(""), v["partition"], v["seqno"], v["deleted"], doc);
    }
}

/// Turns a load-file line into a `_bulk` line: lines with an `op` pass as they are;
/// `{"key", "value"}` lines become upserts.
fn bulk_line(line: &str) -> String {
    if line.contains("\"op\"") {
        return line.to_string();
    }
    match serde_json::from_str::<serde_json::Value>(line) {
        Ok(serde_json::Value::Object(mut obj)) if obj.contains_key("key") => {
            obj.insert("op".into(), "upsert".into());
            serde_json::Value::Object(obj).to_string()
        }
        _ => line.to_string(),
    }
}

pub async fn load(url: &str, args: LoadArgs) -> Result<(), CliError> {
    if args.batch == 0 || args.concurrency == 0 {
        return Err(CliError::Usage("--batch and --concurrency must be at least 1".into()));
    }
    let client = Client::new(url)?;
    let file = std::fs::File::open(&args.file)?;
    let total_bytes = file.metadata()?.len();
    let bar = indicatif::ProgressBar::new(total_bytes);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {msg} ({eta})")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let reader = std::io::BufReader::new(file);
    let started = Instant::now();
    let mut batches = Vec::new();
    let mut chunk = String::new();
    let mut lines_in_chunk = 0;
    for line in reader.lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        chunk.push_str(&bulk_line(&line));
        chunk.push('\n');
        lines_in_chunk += 1;
        if lines_in_chunk == args.batch {
            batches.push(std::mem::take(&mut chunk));
            lines_in_chunk = 0;
        }
    }
    if !chunk.is_empty() {
        batches.push(chunk);
    }
    let (ok, failed) = send_bulk(&client, &args.collection, batches, args.concurrency, args.persist, Some(&bar)).await?;
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64();
    println!("loaded {ok} documents ({failed} failed) in {secs:.2} s: {:.0} docs/s", ok as f64 / secs.max(1e-9));
    if failed > 0 {
        return Err(CliError::Usage(format!("{failed} lines failed; see the server's reasons with --output json")));
    }
    Ok(())
}

/// Sends NDJSON batches with `concurrency` requests in flight; counts good and failed lines.
pub async fn send_bulk(
    client: &Client,
    collection: &str,
    batches: Vec<String>,
    concurrency: usize,
    persist: bool,
    bar: Option<&indicatif::ProgressBar>,
) -> Result<(u64, u64), CliError> {
    let mut results = futures::stream::iter(batches.into_iter().map(|b| {
        let client = client.clone();
        let collection = collection.to_string();
        async move {
            let len = b.len() as u64;
            let answer = client.bulk(&collection, b, persist).await?;
            Ok::<_, ClientError>((len, answer))
        }
    }))
    .buffer_unordered(concurrency);
    let (mut ok, mut failed) = (0u64, 0u64);
    let mut first_error = None;
    while let Some(result) = results.next().await {
        let (len, answer) = result?;
        for line in answer.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            if line.windows(8).any(|w| w == b"\"error\":") {
                failed += 1;
                if first_error.is_none() {
                    first_error = Some(String::from_utf8_lossy(line).into_owned());
                }
            } else {
                ok += 1;
            }
        }
        if let Some(bar) = bar {
            bar.inc(len);
            bar.set_message(format!("{ok} docs"));
        }
    }
    if let Some(e) = first_error {
        eprintln!("first failure: {e}");
    }
    Ok((ok, failed))
}

/// Prints rows under a header, columns aligned.
pub fn print_table(header: &[&str], rows: Vec<Vec<String>>) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let parts: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        println!("{}", parts.join("  ").trim_end());
    };
    line(header.iter().map(|h| h.to_string()).collect());
    for row in rows {
        line(row);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_lines_become_upserts() {
        assert_eq!(bulk_line(r#"{"op":"remove","key":"a"}"#), r#"{"op":"remove","key":"a"}"#);
        let v: serde_json::Value = serde_json::from_str(&bulk_line(r#"{"key":"a","value":{"x":1}}"#)).unwrap();
        assert_eq!(v["op"], "upsert");
        assert_eq!(bulk_line("not json"), "not json");
    }

    #[test]
    fn the_rebalance_bar_shows_bytes_rate_and_time_left_for_copies_by_files() {
        let status = serde_json::json!({"moves": [{"state": "copying"}], "bytes_total": 0});
        assert_eq!(rebalance_message(&status), "copying");
        let status = serde_json::json!({
            "moves": [{"state": "copying"}], "bytes_total": 500_000_000u64, "bytes_done": 100_000_000u64,
            "bytes_per_s": 50_000_000.0, "eta_s": 8.0
        });
        assert_eq!(rebalance_message(&status), "copying: 100/500 MB from files, 50 MB/s, 8 s left");
    }
}

#[derive(Subcommand)]
pub enum ClusterCmd {
    /// Nodes, their states, partitions and health.
    Status,
    /// The partition map: each partition's active and replica nodes.
    Map,
    /// Change settings (`replicas`, `auto_failover_timeout_s`, ...).
    Settings {
        #[arg(long)]
        replicas: Option<u8>,
        #[arg(long)]
        auto_failover_timeout_s: Option<u32>,
        #[arg(long)]
        auto_failover_max_count: Option<u32>,
        /// Megabytes per second each node sends to partitions' new copies at most (0: no
        /// fixed limit; the elastic budget, which yields to requests, still applies).
        #[arg(long)]
        rebalance_mb_per_s: Option<u32>,
        /// Copies a node builds at once.
        #[arg(long)]
        rebalance_moves_per_node: Option<u32>,
    },
    /// Add the node at HOST:PORT (a lone node with no collections, started with a plain
    /// `shoal serve`): it restarts, joins as `added`, and a rebalance gives it partitions.
    Add { address: String },
    /// Fail a node over now: its replicas take over its partitions.
    Failover { node: u64 },
    /// Bring a failed-over node back (as `added`; a rebalance gives it copies).
    Recover { node: u64 },
    /// Rebalance: bring added nodes in, move ejected nodes out, restore replicas; waits
    /// with a progress bar until it is done.
    Rebalance {
        /// Nodes to move out of the cluster.
        #[arg(long)]
        eject: Vec<u64>,
    },
}

/// The progress bar's message: the moves' stage, and for copies by files the bytes, the
/// rate and the time left.
fn rebalance_message(status: &serde_json::Value) -> String {
    let stage = status["moves"].as_array().and_then(|m| m.first()).and_then(|m| m["state"].as_str()).unwrap_or("");
    let total = status["bytes_total"].as_u64().unwrap_or(0);
    if total == 0 {
        return stage.to_string();
    }
    let done = status["bytes_done"].as_u64().unwrap_or(0);
    let rate = status["bytes_per_s"].as_f64().unwrap_or(0.0);
    let eta = status["eta_s"].as_f64().map_or_else(|| "-".to_string(), |s| format!("{s:.0} s"));
    format!("{stage}: {:.0}/{:.0} MB from files, {:.0} MB/s, {eta} left", done as f64 / 1e6, total as f64 / 1e6, rate / 1e6)
}

/// How often `shoal cluster rebalance` looks at the progress.
const REBALANCE_POLL: std::time::Duration = std::time::Duration::from_millis(250);

pub async fn cluster(url: &str, output: Output, cmd: ClusterCmd) -> Result<(), CliError> {
    let client = Client::new(url)?;
    let answer = match cmd {
        ClusterCmd::Status => {
            let info = client.cluster().await?;
            if output == Output::Json {
                println!("{}", serde_json::to_string_pretty(&info).unwrap_or_default());
                return Ok(());
            }
            let leader = info["leader"].as_u64();
            println!(
                "cluster {}  map version {}  replicas {}",
                info["cluster_id"].as_str().unwrap_or("?"),
                info["map_version"],
                info["replicas"]
            );
            let rows = info["nodes"]
                .as_array()
                .map(|nodes| {
                    nodes
                        .iter()
                        .map(|n| {
                            let id = n["id"].as_u64().unwrap_or(0);
                            vec![
                                format!("n{id}{}", if Some(id) == leader { " (leader)" } else { "" }),
                                n["address"].as_str().unwrap_or("").to_string(),
                                n["state"].as_str().unwrap_or("").to_string(),
                                match n["healthy"].as_bool() {
                                    Some(true) => "yes".into(),
                                    Some(false) => "no".into(),
                                    None => "?".into(),
                                },
                                n["partitions"]["active"].to_string(),
                                n["partitions"]["replica"].to_string(),
                            ]
                        })
                        .collect()
                })
                .unwrap_or_default();
            print_table(&["node", "address", "state", "healthy", "active", "replica"], rows);
            return Ok(());
        }
        ClusterCmd::Map => {
            let map = client.cluster_map().await?;
            if output == Output::Json {
                println!("{}", serde_json::to_string_pretty(&map).unwrap_or_default());
                return Ok(());
            }
            println!("map version {}", map["version"]);
            let rows = map["partitions"]
                .as_array()
                .map(|ps| {
                    ps.iter()
                        .map(|p| {
                            let replicas: Vec<String> =
                                p["replicas"].as_array().map(|r| r.iter().map(|n| format!("n{n}")).collect()).unwrap_or_default();
                            vec![p["id"].to_string(), format!("n{}", p["active"]), replicas.join(" ")]
                        })
                        .collect()
                })
                .unwrap_or_default();
            print_table(&["partition", "active", "replicas"], rows);
            return Ok(());
        }
        ClusterCmd::Settings {
            replicas,
            auto_failover_timeout_s,
            auto_failover_max_count,
            rebalance_mb_per_s,
            rebalance_moves_per_node,
        } => {
            let mut patch = serde_json::Map::new();
            if let Some(v) = replicas {
                patch.insert("replicas".into(), v.into());
            }
            if let Some(v) = auto_failover_timeout_s {
                patch.insert("auto_failover_timeout_s".into(), v.into());
            }
            if let Some(v) = auto_failover_max_count {
                patch.insert("auto_failover_max_count".into(), v.into());
            }
            if let Some(v) = rebalance_mb_per_s {
                patch.insert("rebalance_mb_per_s".into(), v.into());
            }
            if let Some(v) = rebalance_moves_per_node {
                patch.insert("rebalance_moves_per_node".into(), v.into());
            }
            client.cluster_settings(&serde_json::Value::Object(patch)).await?
        }
        ClusterCmd::Add { address } => {
            let added = client.add_node(&address).await?;
            println!("node {} at {address} is added; `shoal cluster rebalance` gives it partitions", added["node"]);
            return Ok(());
        }
        ClusterCmd::Failover { node } => client.failover(node).await?,
        ClusterCmd::Recover { node } => client.recover(node).await?,
        ClusterCmd::Rebalance { eject } => {
            let started = client.rebalance(&eject).await?;
            let total = started["moves"].as_u64().unwrap_or(0);
            let bar = indicatif::ProgressBar::new(total);
            bar.set_style(
                indicatif::ProgressStyle::with_template("{spinner} rebalance [{bar:40}] {pos}/{len} copies {msg}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            let status = loop {
                let status = client.rebalance_status().await?;
                bar.set_position(status["moves_done"].as_u64().unwrap_or(0));
                bar.set_message(rebalance_message(&status));
                if status["state"] != "running" {
                    break status;
                }
                tokio::time::sleep(REBALANCE_POLL).await;
            };
            bar.finish_and_clear();
            if status["state"] != "done" {
                return Err(CliError::Usage(format!("rebalance {}: {}", status["state"], status["message"].as_str().unwrap_or(""))));
            }
            let took = status["elapsed_s"].as_f64().map_or_else(String::new, |s| format!(" in {s:.2} s"));
            let moves = status["moves_total"].as_u64().unwrap_or(total);
            println!("rebalance done: {moves} copies built{took}");
            return Ok(());
        }
    };
    println!("{}", serde_json::to_string_pretty(&answer).unwrap_or_default());
    Ok(())
}
