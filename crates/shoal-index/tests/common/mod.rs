//! What the index tests share: a store with documents, and lives of the index manager.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{json, Value};
use shoal_index::{Consistency, IndexDef, IndexManager, ScanBounds, ScanRequest};
use shoal_storage::{Collection, Store, StoreConfig, WriteOp, WriteRequest};

pub const WORKERS: usize = 2;
/// Generous: the tests run beside others on a loaded machine.
pub const WAIT: Duration = Duration::from_secs(60);
pub const DOCS: usize = 60;

pub fn open_store(dir: &Path) -> Arc<Store> {
    Store::open(StoreConfig { data_paths: vec![dir.join("data")], partitions: Some(4), ..StoreConfig::default() }).unwrap()
}

/// A fresh store (in the returned directory) with collection `c` holding [`fill`]'s documents.
pub fn filled_store() -> (tempfile::TempDir, Arc<Store>, Arc<Collection>) {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path());
    let coll = store.create_collection("c", 0).unwrap();
    fill(&coll);
    (dir, store, coll)
}

pub fn index_dir(dir: &Path) -> PathBuf {
    dir.join("data").join("index")
}

pub fn put(coll: &Collection, key: &str, doc: Value) {
    let value = Some(Bytes::from(doc.to_string()));
    let _ =
        coll.write(WriteRequest { key: Bytes::copy_from_slice(key.as_bytes()), op: WriteOp::Upsert, value, cas: None, expiry: 0 }).unwrap();
}

pub fn fill(coll: &Collection) {
    for i in 0..DOCS {
        put(coll, &format!("d{i:03}"), json!({"a": i % 5, "b": format!("x{i}")}));
    }
}

pub fn def(name: &str, key: &str, defer_build: bool) -> IndexDef {
    IndexDef { name: name.into(), keys: vec![key.into()], filter: None, defer_build, partitions: None, replicas: 0 }
}

/// The ids of `a = 3`, as the index must answer.
pub fn expected_a3() -> Vec<String> {
    (0..DOCS).filter(|i| i % 5 == 3).map(|i| format!("d{i:03}")).collect()
}

pub async fn scan_ids(mgr: &IndexManager, coll: &Collection, name: &str, eq: Value) -> Vec<String> {
    mgr.scan(coll, name, eq_request(eq)).await.unwrap().into_iter().map(|r| r.id).collect()
}

/// An `eq` scan of `value` at `request_plus`, up to 1,000 rows.
pub fn eq_request(value: Value) -> ScanRequest {
    ScanRequest {
        bounds: ScanBounds::Eq(vec![value]),
        limit: 1000,
        descending: false,
        consistency: Consistency::RequestPlus,
        timeout: WAIT,
        keep: None,
        parts: None,
    }
}

/// The definitions in the catalog, as (index name, id).
pub fn catalog(store: &Store) -> Vec<(String, u64)> {
    store
        .catalog_prefix("index/")
        .unwrap()
        .into_iter()
        .map(|(_, v)| {
            let r: Value = serde_json::from_slice(&v).unwrap();
            (r["def"]["name"].as_str().unwrap().to_string(), r["id"].as_u64().unwrap())
        })
        .collect()
}

/// Runs one life of the index manager on a runtime of its own, then waits until the
/// manager (and so its database) is gone, so that the next life can open it again.
pub fn life<F, Fut, T>(store: &Arc<Store>, f: F) -> T
where
    F: FnOnce(Arc<IndexManager>) -> Fut,
    Fut: std::future::Future<Output = T>,
{
    life_of(store, |s| IndexManager::open(s, WORKERS).unwrap(), f)
}

/// [`life`] of a manager opened by `open` (on the life's runtime).
pub fn life_of<O, F, Fut, T>(store: &Arc<Store>, open: O, f: F) -> T
where
    O: FnOnce(Arc<Store>) -> Arc<IndexManager>,
    F: FnOnce(Arc<IndexManager>) -> Fut,
    Fut: std::future::Future<Output = T>,
{
    life_ending(store, open, f, true)
}

/// [`life`] that ends as a crash right after the index journal's last sync would: without
/// the manager's `close`, so nothing is flushed or stored at the end.
pub fn life_without_close<F, Fut, T>(store: &Arc<Store>, f: F) -> T
where
    F: FnOnce(Arc<IndexManager>) -> Fut,
    Fut: std::future::Future<Output = T>,
{
    life_ending(store, |s| IndexManager::open(s, WORKERS).unwrap(), f, false)
}

fn life_ending<O, F, Fut, T>(store: &Arc<Store>, open: O, f: F, close: bool) -> T
where
    O: FnOnce(Arc<Store>) -> Arc<IndexManager>,
    F: FnOnce(Arc<IndexManager>) -> Fut,
    Fut: std::future::Future<Output = T>,
{
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (out, weak): (T, Weak<IndexManager>) = rt.block_on(async {
        let mgr = open(Arc::clone(store));
        let weak = Arc::downgrade(&mgr);
        let out = f(Arc::clone(&mgr)).await;
        mgr.stop().await;
        if close {
            mgr.close().unwrap();
        } else {
            mgr.sync_journal().unwrap();
        }
        (out, weak)
    });
    drop(rt);
    let deadline = Instant::now() + WAIT;
    while weak.upgrade().is_some() {
        assert!(Instant::now() < deadline, "the index manager outlived its runtime");
        std::thread::sleep(Duration::from_millis(10));
    }
    out
}

/// Every id of index `name`, in index order, read with `request_plus`.
pub async fn scan_all_ids(mgr: &IndexManager, coll: &Collection, name: &str) -> Vec<String> {
    let req = ScanRequest {
        bounds: ScanBounds::All,
        limit: 100_000,
        descending: false,
        consistency: Consistency::RequestPlus,
        timeout: WAIT,
        keep: None,
        parts: None,
    };
    mgr.scan(coll, name, req).await.unwrap().into_iter().map(|r| r.id).collect()
}

/// fjall's keyspace directories (`keyspaces/<number>`, numbered in creation order) whose
/// table files contain `needle`.
pub fn keyspaces_containing(db: &Path, needle: &[u8]) -> Vec<(u64, PathBuf)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(db.join("keyspaces")).unwrap() {
        let dir = entry.unwrap().path();
        let Some(n) = dir.file_name().and_then(|n| n.to_str()).and_then(|n| n.parse().ok()) else { continue };
        if tables_containing(&dir, needle).next().is_some() {
            out.push((n, dir));
        }
    }
    out.sort();
    out
}

/// The table files of keyspace directory `dir` that contain `needle`. A file a compaction
/// removes between the listing and the read is passed over (a CI flake: `NotFound`).
pub fn tables_containing<'a>(dir: &Path, needle: &'a [u8]) -> impl Iterator<Item = PathBuf> + 'a {
    std::fs::read_dir(dir.join("tables"))
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(move |f| std::fs::read(f).is_ok_and(|bytes| bytes.windows(needle.len()).any(|w| w == needle)))
}
