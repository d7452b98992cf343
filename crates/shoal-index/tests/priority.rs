//! Index maintenance runs below the threads that serve requests (`INDEX_WORKER_NICE`): when
//! writes and the indexes both want the cores, the kernel runs the writes first.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use shoal_index::INDEX_WORKER_NICE;

/// The name and nice value of the thread whose `/proc` folder is `dir` (`stat`, field 19).
fn thread_nice(dir: &str) -> Option<(String, i32)> {
    let name = std::fs::read_to_string(format!("{dir}/comm")).ok()?;
    let stat = std::fs::read_to_string(format!("{dir}/stat")).ok()?;
    // The command name (field 2) may hold spaces; the fields after it are space-separated.
    let (_, rest) = stat.rsplit_once(')')?;
    Some((name.trim().to_string(), rest.split_whitespace().nth(16)?.parse().ok()?))
}

/// This process's threads whose name `named` accepts, with their nice values.
fn threads(named: impl Fn(&str) -> bool) -> Vec<(String, i32)> {
    let tasks = std::fs::read_dir("/proc/self/task").map(|d| d.flatten().collect::<Vec<_>>()).unwrap_or_default();
    tasks.iter().filter_map(|t| thread_nice(&t.path().to_string_lossy())).filter(|(name, _)| named(name)).collect()
}

/// This test thread's nice value and the one index background threads must run at; and the
/// threads `named` accepts once an index was built and `settled` says they are as expected
/// (or after 10 s, for the test to say what it found).
fn threads_after_a_build(
    named: impl Fn(&str) -> bool + Send + 'static,
    settled: impl Fn(&[(String, i32)], i32) -> bool + Send + 'static,
) -> (i32, i32, Vec<(String, i32)>) {
    let (_dir, store, coll) = filled_store();
    let own = thread_nice("/proc/thread-self").map(|(_, n)| n).expect("this thread's nice value");
    let want = (own + INDEX_WORKER_NICE).min(19);
    let seen = life(&store, |mgr| {
        let coll = Arc::clone(&coll);
        async move {
            mgr.create(&coll, def("by_a", "a", false)).await.unwrap();
            // The threads built the index; each lowered itself as it started.
            assert_eq!(scan_ids(&mgr, &coll, "by_a", json!(3)).await, expected_a3());
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let found = threads(&named);
                if settled(&found, want) || Instant::now() > deadline {
                    return found;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    });
    (own, want, seen)
}

#[cfg(target_os = "linux")]
#[test]
fn index_workers_run_below_the_threads_that_serve_requests() {
    let (own, want, seen) = threads_after_a_build(
        |name| name.starts_with("shoal-index-"),
        |found, want| !found.is_empty() && found.iter().all(|(_, n)| *n == want),
    );
    assert!(!seen.is_empty(), "no index worker thread found");
    for (name, nice) in &seen {
        assert_eq!(*nice, want, "{name} runs at nice {nice}; the test's threads at {own}");
    }
}

/// The index database's own background threads (fjall's flush and compaction workers) run
/// below the request threads too: a bulk load's flushes of the index memtables otherwise
/// took the cores from scans. The data store's workers keep the process's priority.
#[cfg(target_os = "linux")]
#[test]
fn index_flushes_and_compactions_run_below_the_threads_that_serve_requests() {
    let (own, want, seen) = threads_after_a_build(|name| name == "fjall:worker", |found, want| found.iter().any(|(_, n)| *n == want));
    let nices: Vec<i32> = seen.iter().map(|(_, n)| *n).collect();
    assert!(nices.contains(&want), "no engine worker at nice {want}: {nices:?}");
    assert!(nices.contains(&own), "the data store's engine workers keep nice {own}: {nices:?}");
}
