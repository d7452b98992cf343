//! `shoal bench copy`: issue 12's partition copy. A store is loaded with JSON-like
//! documents, then every partition is exported and ingested into an empty store, on 1, 2, …
//! threads (each thread copies whole partitions), in process: the storage engine's own copy
//! ceiling, which a rebalance's network and coordination then cost a share of. A plain
//! export (read only) is timed too, to show what the copy spends on writing; and the same
//! partitions copied as their files (exported at a snapshot, written, hashed, fsynced and
//! adopted whole by the empty copy: what a rebalance ships by default), once as the load
//! left the source (its memtables' items travel too, and become a table on the receiver, as
//! in a rebalance) and then, on each thread count, after the memtables are flushed.
//! `bench/partition_copy.sh` runs it beside `dd` on the same disk.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use clap::Args;
use shoal_storage::{PartitionState, Store, StoreConfig, WriteOp, WriteRequest};

use crate::cli::CliError;

#[derive(Args)]
pub struct CopyArgs {
    /// A fresh directory is made under this one for the stores, and removed at the end.
    #[arg(long, default_value = ".")]
    dir: PathBuf,
    /// Documents to load.
    #[arg(long, default_value_t = 1_500_000)]
    docs: usize,
    /// Bytes of each document (JSON text).
    #[arg(long, default_value_t = 1000)]
    doc_bytes: usize,
    #[arg(long, default_value_t = 16)]
    partitions: u16,
    /// Thread counts to copy with; each copies every partition once into a fresh store.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    threads: Vec<usize>,
    /// Records this large or larger go to blob files (default: the store's).
    #[arg(long)]
    blob_threshold: Option<u32>,
}

impl CopyArgs {
    /// The ceiling `shoal bench rebalance` prints: `docs` documents, on 1 and as many
    /// threads as cores, and as many as copies a node builds at once by default
    /// (`rebalance_moves_per_node`): a copy that writes its files directly waits on the
    /// disk, so copies at once can beat one per core, and a ceiling must not be lower than
    /// what the cluster does with the same engine.
    pub(crate) fn ceiling(dir: PathBuf, docs: usize, doc_bytes: usize, partitions: u16) -> CopyArgs {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let moves = usize::try_from(shoal_meta::state::REBALANCE_MOVES_PER_NODE_DEFAULT).unwrap_or(1);
        let mut threads = vec![1, cores, moves];
        threads.sort_unstable();
        threads.dedup();
        CopyArgs { dir, docs, doc_bytes, partitions, threads, blob_threshold: None }
    }
}

/// Longest the bench waits for the engine's background work after the load.
const SETTLE_MAX: std::time::Duration = std::time::Duration::from_secs(300);
/// How often it looks.
const SETTLE_POLL: std::time::Duration = std::time::Duration::from_millis(100);
/// Documents per `write_many` call while loading.
const LOAD_BATCH: usize = 2_000;

const WORDS: [&str; 32] = [
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima", "mike", "november",
    "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey", "xray", "yankee", "zulu", "red", "green",
    "blue", "amber", "violet", "indigo",
];

/// A JSON document of about `bytes` bytes: a few typed fields, then prose from a small
/// vocabulary (compressible about as much as real documents).
pub(crate) fn document(i: usize, bytes: usize) -> String {
    let mut x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut bio = String::new();
    let head =
        format!(r#"{{"id":{i},"user":"user-{:06}","score":{},"active":{},"bio":""#, next() % 100_000, next() % 1000, next() % 2 == 0);
    while head.len() + bio.len() + 2 < bytes {
        bio.push_str(WORDS[(next() % WORDS.len() as u64) as usize]);
        bio.push(' ');
    }
    bio.truncate(bytes.saturating_sub(head.len() + 2));
    format!("{head}{bio}\"}}")
}

fn open(dir: &Path, partitions: u16, blob_threshold: Option<u32>) -> Result<Arc<Store>, CliError> {
    let mut config = StoreConfig { data_paths: vec![dir.to_path_buf()], partitions: Some(partitions), ..StoreConfig::default() };
    if let Some(t) = blob_threshold {
        config.blob_threshold_bytes = t;
    }
    Store::open(config).map_err(|e| CliError::Bench(format!("open {}: {e}", dir.display())))
}

fn other(e: impl std::fmt::Display) -> CliError {
    CliError::Bench(e.to_string())
}

pub fn run(args: CopyArgs) -> Result<(), CliError> {
    let root = tempfile::Builder::new().prefix("shoal-bench-copy-").tempdir_in(&args.dir).map_err(other)?;
    let src = open(&root.path().join("src"), args.partitions, args.blob_threshold)?;
    let coll = src.create_collection("c", 0).map_err(other)?;
    let started = Instant::now();
    for start in (0..args.docs).step_by(LOAD_BATCH) {
        let reqs = (start..(start + LOAD_BATCH).min(args.docs))
            .map(|i| WriteRequest {
                key: Bytes::from(format!("doc-{i:09}")),
                op: WriteOp::Upsert,
                value: Some(Bytes::from(document(i, args.doc_bytes))),
                cas: None,
                expiry: 0,
            })
            .collect();
        let (results, _) = coll.write_many(reqs);
        if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
            return Err(other(format!("load: {e}")));
        }
    }
    println!(
        "loaded {} documents of {} bytes into {} partitions in {:.1} s",
        args.docs,
        args.doc_bytes,
        args.partitions,
        started.elapsed().as_secs_f64()
    );

    // The load leaves the engine flushing and compacting for a while; a copy timed during
    // that shares the cores with it (as a rebalance started right after a load would).
    // Timed from a settled store, as `shoal bench rebalance` starts its rebalances after
    // seconds of foreground load.
    let started = Instant::now();
    while src.background_work() > 0 && started.elapsed() < SETTLE_MAX {
        std::thread::sleep(SETTLE_POLL);
    }
    println!("the engine's flushes and compactions after the load settled in {:.1} s (untimed)", started.elapsed().as_secs_f64());

    // Read only: every partition exported, nothing written (the memtables as loaded).
    let started = Instant::now();
    let mut bytes = 0u64;
    for p in 0..args.partitions {
        for record in src.export_partition(p).map_err(other)? {
            let (k, v) = record.map_err(other)?;
            bytes += (k.len() + v.len()) as u64;
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!("| what | threads | MB | s | MB/s |");
    println!("|---|---|---|---|---|");
    println!("| export only (read) | 1 | {:.0} | {secs:.2} | {:.0} |", bytes as f64 / 1e6, bytes as f64 / 1e6 / secs);

    // The copy by files of the partitions as the load left them, on the most threads asked:
    // what a rebalance copies (a node's memtables hold the last few MB of each
    // partition, which travel as items and become a new table on the receiver).
    let threads = args.threads.iter().copied().max().unwrap_or(1);
    copy_files(&src, &root.path().join("files-as-loaded"), &args, coll.id(), threads, bytes, "memtables as loaded")?;

    // Then every partition's memtable flushed, untimed (its time is shown), so that each
    // method below copies tables only: the engine's ceiling without the memtables' items.
    let started = Instant::now();
    for p in 0..args.partitions {
        src.partition_files_flushed(p).map_err(other)?;
    }
    println!("| (the source's memtables flushed in {:.2} s, untimed) | | | | |", started.elapsed().as_secs_f64());

    for &threads in &args.threads {
        let dir = root.path().join(format!("dst-{threads}"));
        let dst = empty_copy(&dir, &args, coll.id())?;
        let started = Instant::now();
        let copied = per_partition(threads, args.partitions, |p| {
            let export = src.export_partition(p).map_err(other)?;
            let header = export.header().clone();
            Ok(dst.ingest_partition(&header, export).map_err(other)?.bytes)
        });
        let secs = started.elapsed().as_secs_f64();
        let bytes = copied?;
        println!("| export → ingest (fsynced) | {threads} | {:.0} | {secs:.2} | {:.0} |", bytes as f64 / 1e6, bytes as f64 / 1e6 / secs);
        check_and_remove(dst, &dir, &args, "the copy")?;
    }
    // The same partitions copied as their files (what a rebalance ships by default): each
    // keyspace's table and blob files at a snapshot, read, written into the empty copy,
    // hashed and fsynced, then adopted whole (`Store::import_partition_files`). The rate is
    // the records' bytes (the same documents as above) over the time; the files' own bytes
    // are printed beside.
    for &threads in &args.threads {
        copy_files(&src, &root.path().join(format!("files-{threads}")), &args, coll.id(), threads, bytes, "memtables flushed")?;
    }
    src.close().map_err(other)?;
    Ok(())
}

/// Copies every partition of `src` as its files into a fresh store at `dir` on `threads`
/// threads, prints the row (the rate in `records_bytes`, the documents' bytes, over the
/// time; the files' own bytes beside, and `what` of the source's state), checks the copy
/// holds every document, and removes it.
fn copy_files(src: &Store, dir: &Path, args: &CopyArgs, coll: u32, threads: usize, records_bytes: u64, what: &str) -> Result<(), CliError> {
    let dst = empty_copy(dir, args, coll)?;
    let started = Instant::now();
    let shipped = per_partition(threads, args.partitions, |p| {
        let export = src.export_partition_files(p).map_err(other)?;
        let (header, manifest) = (export.header().clone(), export.manifest().clone());
        dst.import_partition_files(&header, &manifest, export).map_err(other)?;
        Ok(manifest.file_bytes())
    });
    let secs = started.elapsed().as_secs_f64();
    let file_bytes = shipped?;
    println!(
        "| export files → import (adopted, fsynced; {:.0} MB of files; {what}) | {threads} | {:.0} | {secs:.2} | {:.0} |",
        file_bytes as f64 / 1e6,
        records_bytes as f64 / 1e6,
        records_bytes as f64 / 1e6 / secs
    );
    check_and_remove(dst, dir, args, "the copy by files")
}

/// A fresh store at `dir` with collection `c` (id `coll`) and every partition pending: what
/// a copy is ingested or imported into.
fn empty_copy(dir: &Path, args: &CopyArgs, coll: u32) -> Result<Arc<Store>, CliError> {
    let dst = open(dir, args.partitions, args.blob_threshold)?;
    dst.create_collection_as("c", 0, Some(coll)).map_err(other)?;
    for p in 0..args.partitions {
        dst.set_partition_state(p, PartitionState::Pending).map_err(other)?;
    }
    Ok(dst)
}

/// Checks that the copy `dst` (`what`, for the error) holds every document loaded, then
/// closes it and removes `dir`.
fn check_and_remove(dst: Arc<Store>, dir: &Path, args: &CopyArgs, what: &str) -> Result<(), CliError> {
    let docs = dst.collection("c").ok_or_else(|| other(format!("{what} lost its collection")))?.info().docs;
    if docs != args.docs as u64 {
        return Err(other(format!("{what} holds {docs} documents, not {}", args.docs)));
    }
    dst.close().map_err(other)?;
    drop(dst);
    std::fs::remove_dir_all(dir).map_err(other)?;
    Ok(())
}

/// Runs `copy` once for every partition on `threads` threads (each takes the next partition
/// left) and answers the bytes they report, summed.
fn per_partition(threads: usize, partitions: u16, copy: impl Fn(u16) -> Result<u64, CliError> + Sync) -> Result<u64, CliError> {
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads.max(1))
            .map(|_| {
                s.spawn(|| -> Result<u64, CliError> {
                    let mut bytes = 0;
                    while let Some(p) = u16::try_from(next.fetch_add(1, Ordering::Relaxed)).ok().filter(|p| *p < partitions) {
                        bytes += copy(p)?;
                    }
                    Ok(bytes)
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().map_err(|_| other("a copy thread panicked"))?).sum()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_are_json_of_the_asked_size() {
        for (i, bytes) in [(0, 200), (7, 1000), (123_456, 4096)] {
            let doc = document(i, bytes);
            let v: serde_json::Value = serde_json::from_str(&doc).unwrap();
            assert_eq!(v["id"], i);
            assert!(doc.len().abs_diff(bytes) <= 2, "{} vs {bytes}", doc.len());
        }
    }
}
