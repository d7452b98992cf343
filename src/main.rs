//! `shoal`: the server and the command-line tool. Only this crate knows the terminal.

mod bench;
mod cert;
mod cli;
mod sql;

/// mimalloc rather than glibc's malloc: under the write path's many small, short-lived
/// allocations across threads, glibc's arenas spent ~8 % of a profile in malloc/free
/// and consolidation (bench/results, issue 12 write path). Built with `no_thp`: mimalloc
/// otherwise marks its arenas for transparent huge pages, and every page it purges and
/// touches again is a fresh 2 MiB page the kernel zeroes — 60–80 % of the CPU while
/// indexes were fed (bench/results/2026-12-02-mimalloc-no-thp.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(name = "shoal", version, about = "Shoal: an elastic, distributed JSON document database")]
struct Args {
    /// Server to talk to (all commands but `serve`).
    #[arg(long, global = true, env = "SHOAL_URL", default_value = "http://127.0.0.1:7070")]
    url: String,
    /// User to call the server as (default: `admin`, with the password of a local node's
    /// `shoal-data/admin-password`).
    #[arg(long, global = true, env = "SHOAL_USER")]
    user: Option<String>,
    /// That user's password.
    #[arg(long, global = true, env = "SHOAL_PASSWORD", hide_env_values = true)]
    password: Option<String>,
    /// The cluster's CA certificates (PEM): what `https://` servers are verified by, and
    /// for `serve`, what members verify each other by (with `--tls-cert`/`--tls-key`).
    #[arg(long, global = true, env = "SHOAL_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// How to print answers.
    #[arg(long, global = true, value_enum, default_value_t = Output::Table)]
    output: Output,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Json,
    Table,
    /// Comma-separated values (`shoal sql`); other commands print tables.
    Csv,
}

#[derive(Subcommand)]
enum Command {
    /// Start a node: alone it founds a one-node cluster; `--join` adds it to a cluster.
    Serve(ServeArgs),
    /// Create, list and drop collections.
    #[command(subcommand)]
    Collection(cli::CollectionCmd),
    /// Read and write documents.
    #[command(subcommand)]
    Doc(cli::DocCmd),
    /// Sub-document lookups and mutations.
    #[command(subcommand)]
    Subdoc(cli::SubdocCmd),
    /// Secondary indexes: create, list, build, drop, scan.
    #[command(subcommand)]
    Index(cli::IndexCmd),
    /// SQL: one statement with `-e`, statements from stdin, or an interactive shell.
    Sql(sql::SqlArgs),
    /// Read a collection's change stream.
    Changes(cli::ChangesArgs),
    /// Bulk-load an NDJSON file of documents.
    Load(cli::LoadArgs),
    /// Load generators and the seed experiments.
    #[command(subcommand)]
    Bench(bench::BenchCmd),
    /// The cluster: status, map, settings, failover, recover, rebalance.
    #[command(subcommand)]
    Cluster(cli::ClusterCmd),
    /// Make a CA and node certificates for TLS (`serve --tls-cert ... --tls-key ... --tls-ca ...`).
    Cert(cert::CertArgs),
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: String,
    /// Data directory; repeat to spread partitions over several disks.
    #[arg(long = "data-path", default_value = "shoal-data")]
    data_paths: Vec<PathBuf>,
    /// Virtual partitions, fixed when the data directory is created (default 128).
    #[arg(long)]
    partitions: Option<u16>,
    /// Block cache in MiB.
    #[arg(long, default_value_t = 256)]
    cache_mb: u64,
    /// Tombstones older than this many seconds are purged.
    #[arg(long, default_value_t = 24 * 3600)]
    purge_horizon_secs: u64,
    /// Free space (MiB) kept on every data path: below it writes answer
    /// `insufficient_storage` until space is freed.
    #[arg(long, default_value_t = shoal_storage::DISK_RESERVE_DEFAULT_BYTES / (1024 * 1024))]
    disk_reserve_mb: u64,
    /// Worker threads for requests (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Index build and maintenance workers (default: one per core).
    #[arg(long)]
    index_workers: Option<usize>,
    /// Analytics partitions per collection (default: min(cores, analytics memory GiB, 16);
    /// 0 turns the analytics shadows off).
    #[arg(long)]
    analytics_partitions: Option<usize>,
    /// Memory for analytics in MiB (default: a quarter of the machine's).
    #[arg(long)]
    analytics_memory_mb: Option<u64>,
    /// Most client connections open at once; one more gets `503` and is closed.
    #[arg(long, default_value_t = shoal_server::CONNECTIONS_MAX)]
    max_connections: usize,
    /// Seconds a client has to send a request's headers (idle keep-alive included).
    #[arg(long, default_value_t = shoal_server::HEADER_READ_TIMEOUT.as_secs())]
    header_read_timeout_secs: u64,
    /// Seconds a connection may sit with no request in flight and no bytes moving.
    #[arg(long, default_value_t = shoal_server::IDLE_TIMEOUT.as_secs())]
    idle_timeout_secs: u64,
    /// Seconds a request body has to start arriving; each 500 bytes received add one.
    #[arg(long, default_value_t = shoal_server::BODY_READ_TIMEOUT.as_secs())]
    body_read_timeout_secs: u64,
    /// A member of the cluster to join (`host:port`). Ignored once the node is a member:
    /// a restarted member rejoins by itself.
    #[arg(long)]
    join: Option<String>,
    /// The cluster secret members authenticate each other with (8 to 256 printable
    /// characters). A founding node makes one and keeps it in `cluster-secret` beside its
    /// data; a joining node must be given it.
    #[arg(long, env = "SHOAL_CLUSTER_SECRET")]
    cluster_secret: Option<String>,
    /// A file holding the password the cluster's first start gives the user `admin`
    /// (else `SHOAL_ADMIN_PASSWORD`, else a generated one, printed once and kept in
    /// `<first data path>/admin-password`).
    #[arg(long)]
    admin_password_file: Option<PathBuf>,
    /// The node's certificate chain (PEM): the port then speaks TLS only (HTTP/1.1 and h2),
    /// and members call each other over TLS, verified by `--tls-ca`. Read again on SIGHUP.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Lets `POST /v1/_internal/faults` (with the cluster secret) cut this node off from
    /// other members: for fault tests only.
    #[arg(long, hide = true)]
    fault_injection: bool,
    /// Builds new copies of partitions on this node from the change stream only, never from
    /// files: for the rebalance benchmark's comparison.
    #[arg(long, hide = true)]
    copy_by_stream: bool,
    /// Builds new copies of partitions on this node from the source's records, not its
    /// files: for the rebalance benchmark's comparison.
    #[arg(long, hide = true)]
    copy_by_records: bool,
    /// Copies partitions to and from this node as fast as they can, without the elastic
    /// budget that yields to requests: for the rebalance benchmark's comparison.
    #[arg(long, hide = true)]
    copy_unpaced: bool,
    /// Builds the analytics rows of partitions copied here by files from the change stream,
    /// not from the source's shadow: for the analytics benchmark's comparison.
    #[arg(long, hide = true)]
    analytics_by_stream: bool,
    /// The address other members and clients reach this node at (default: the listen
    /// address; set it when listening on 0.0.0.0).
    #[arg(long)]
    advertise: Option<String>,
    /// The services this node runs, told to the cluster when it joins: `data` (holds
    /// partitions), `index` (holds index partitions), `query` (plans SQL). A cluster's first
    /// node runs `data`.
    #[arg(long, default_value = "data,index,query", value_parser = parse_services)]
    services: shoal_meta::Services,
}

/// `--services`: a comma-separated list of data, index and query.
fn parse_services(list: &str) -> Result<shoal_meta::Services, String> {
    shoal_meta::Services::parse(list).map_err(|e| e.to_string())
}

/// The log filter: `SHOAL_LOG` (default `info`), with the libraries' own chatter kept down
/// unless it names them. openraft logs every unreachable member at ERROR, several times a
/// second while one is down, and the storage engine (fjall, lsm-tree) logs every flush and
/// ingestion at INFO (a first start printed 128 `Finished ingestion writer` lines); Shoal logs
/// what matters of both itself. `SHOAL_LOG=info,openraft=info` brings one back.
fn log_directives(user: Option<String>) -> String {
    let mut directives = user.unwrap_or_else(|| "info".into());
    for (target, level) in [("openraft", "off"), ("fjall", "warn"), ("lsm_tree", "warn")] {
        if !directives.contains(target) {
            directives.push_str(&format!(",{target}={level}"));
        }
    }
    directives
}

fn main() -> ExitCode {
    shoal_client::install_crypto();
    let args = Args::parse();
    if let Some(ca) = &args.tls_ca {
        // The clients the commands make read it (`shoal_client::ClientOptions`); no other
        // thread runs yet.
        std::env::set_var("SHOAL_TLS_CA", ca);
    }
    let directives = log_directives(std::env::var("SHOAL_LOG").ok());
    let filter = tracing_subscriber::EnvFilter::try_new(&directives).unwrap_or_else(|_| log_directives(None).into());
    // Colours only on a terminal: logs sent to a file or a pipe stay plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).init();
    let threads = match &args.command {
        Command::Serve(s) => s.threads,
        _ => None,
    };
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    rt.enable_all();
    if let Some(n) = threads {
        rt.worker_threads(n.max(1));
    }
    let rt = match rt.build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(run(args));
    if let Some(addr) = RESTART_AT.get() {
        rt.shutdown_timeout(std::time::Duration::from_secs(5));
        return reexec(*addr);
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), cli::CliError> {
    let url = match &args.command {
        Command::Serve(_) | Command::Cert(_) => args.url.clone(),
        _ => cli::with_credentials(&args.url, args.user.as_deref(), args.password.as_deref())?,
    };
    let args = Args { url, ..args };
    match args.command {
        Command::Serve(s) => serve(s, args.tls_ca).await,
        Command::Cert(c) => cert::run(c),
        Command::Collection(c) => cli::collection(&args.url, args.output, c).await,
        Command::Doc(d) => cli::doc(&args.url, args.output, d).await,
        Command::Subdoc(c) => cli::subdoc(&args.url, args.output, c).await,
        Command::Index(c) => cli::index(&args.url, args.output, c).await,
        Command::Changes(c) => cli::changes(&args.url, args.output, c).await,
        Command::Sql(q) => sql::run(&args.url, args.output, q).await,
        Command::Load(l) => cli::load(&args.url, l).await,
        Command::Bench(b) => bench::run(&args.url, b).await,
        Command::Cluster(c) => cli::cluster(&args.url, args.output, c).await,
    }
}

async fn serve(args: ServeArgs, tls_ca: Option<PathBuf>) -> Result<(), cli::CliError> {
    let tls = match (args.tls_cert.clone(), args.tls_key.clone(), tls_ca) {
        (Some(cert), Some(key), Some(ca)) => Some(shoal_server::tls::TlsFiles { cert, key, ca }),
        (Some(_), _, None) => return Err(cli::CliError::Usage(
            "--tls-cert needs --tls-ca: the CA members verify each other by (the one that signed the certificates; `shoal cert` makes one)"
                .into(),
        )),
        _ => None,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let admin_password = match &args.admin_password_file {
        Some(f) => Some(
            std::fs::read_to_string(f).map_err(|e| cli::CliError::Usage(format!("cannot read {}: {e}", f.display())))?.trim().to_string(),
        ),
        None => std::env::var("SHOAL_ADMIN_PASSWORD").ok().filter(|p| !p.is_empty()),
    };
    if let Some(p) = &admin_password {
        shoal_server::auth::check_password(p).map_err(|e| cli::CliError::Usage(format!("the admin password: {}", e.reason)))?;
    }
    let config = shoal_server::ServerConfig {
        listen: args.listen,
        engine: shoal_engine::EngineConfig {
            store: shoal_storage::StoreConfig {
                data_paths: args.data_paths,
                partitions: args.partitions,
                cache_bytes: args.cache_mb.saturating_mul(1024 * 1024),
                purge_horizon: std::time::Duration::from_secs(args.purge_horizon_secs),
                disk_reserve_bytes: args.disk_reserve_mb.saturating_mul(1024 * 1024),
                ..shoal_storage::StoreConfig::default()
            },
            index_workers: args.index_workers,
            analytics_partitions: args.analytics_partitions,
            analytics_memory: args.analytics_memory_mb.map(|m| m.saturating_mul(1024 * 1024)),
            // Set by the server for a node that runs the index service and not data.
            index_feed: None,
        },
        connections: shoal_server::ConnectionLimits {
            max: args.max_connections.max(1),
            header_read_timeout: std::time::Duration::from_secs(args.header_read_timeout_secs.max(1)),
            idle_timeout: std::time::Duration::from_secs(args.idle_timeout_secs.max(1)),
            body_read_timeout: std::time::Duration::from_secs(args.body_read_timeout_secs.max(1)),
        },
        cluster: shoal_node::ClusterConfig {
            advertise: args.advertise.unwrap_or_default(),
            join: args.join,
            secret: args.cluster_secret,
            copy_by_stream: args.copy_by_stream,
            copy_by_records: args.copy_by_records,
            copy_unpaced: args.copy_unpaced,
            analytics_by_stream: args.analytics_by_stream,
            services: args.services,
        },
        fault_injection: args.fault_injection,
        admin_password,
        tls,
    };
    let signal = shutdown_signal()?;
    let server = shoal_server::Server::bind(config).await?;
    let addr = server.local_addr()?;
    println!("shoal listening on {scheme}://{addr}");
    let mut first_admin = server.first_admin();
    tokio::spawn(async move {
        if let Ok(made) = first_admin.wait_for(Option::is_some).await {
            if let Some(made) = made.as_ref() {
                eprintln!(
                    "shoal: created the user `admin` with password {} (shown once; kept in {}, readable by you only)",
                    made.password,
                    made.file.display()
                );
            }
        }
    });
    match server.run(signal).await? {
        shoal_server::RunOutcome::Stopped => println!("shoal stopped cleanly"),
        shoal_server::RunOutcome::Restart => {
            let _ = RESTART_AT.set(addr);
        }
    }
    Ok(())
}

/// Set when the server asks to be started again (its storage engine must be reopened, or
/// it is to join the cluster that invited it):
/// the address it listened on, which the new process binds again.
static RESTART_AT: std::sync::OnceLock<std::net::SocketAddr> = std::sync::OnceLock::new();

/// Replaces this process with a fresh `shoal` run with the same arguments, listening on
/// `addr` (the port a `--listen ...:0` picked stays the same for clients). File
/// descriptors are close-on-exec, so the engine's files and locks are released.
fn reexec(addr: std::net::SocketAddr) -> ExitCode {
    let mut args: Vec<std::ffi::OsString> = Vec::new();
    let mut skip = false;
    for arg in std::env::args_os().skip(1) {
        if std::mem::take(&mut skip) {
            continue;
        }
        if arg == "--listen" {
            skip = true;
            continue;
        }
        if arg.to_string_lossy().starts_with("--listen=") {
            continue;
        }
        args.push(arg);
    }
    args.push("--listen".into());
    args.push(addr.to_string().into());
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => {
            eprintln!("error: cannot find the shoal binary to restart: {e}");
            return ExitCode::FAILURE;
        }
    };
    eprintln!("shoal restarting");
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        let e = std::process::Command::new(exe).args(args).exec();
        eprintln!("error: restart failed: {e}");
    }
    #[cfg(not(unix))]
    let _ = (exe, args);
    ExitCode::FAILURE
}

/// Installs the SIGTERM / Ctrl-C handlers now (so a signal right after start-up is not
/// lost), and resolves when either arrives.
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>, std::io::Error> {
    #[cfg(unix)]
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    #[cfg(unix)]
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    Ok(async move {
        #[cfg(unix)]
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    })
}

#[cfg(test)]
mod tests {
    use super::log_directives;

    #[test]
    fn the_libraries_chatter_is_kept_down_unless_named() {
        assert_eq!(log_directives(None), "info,openraft=off,fjall=warn,lsm_tree=warn");
        assert_eq!(log_directives(Some("debug,fjall=info".into())), "debug,fjall=info,openraft=off,lsm_tree=warn");
        assert!(tracing_subscriber::EnvFilter::try_new(log_directives(Some("warn".into()))).is_ok());
    }
}
