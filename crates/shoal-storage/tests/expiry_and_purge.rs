//! Expired documents become deletions; tombstones past the purge horizon are purged, and a
//! reader resuming from before the purge is sent back to the start.

use std::time::Duration;

use bytes::Bytes;
use shoal_storage::{Store, StoreConfig, StreamPosition, WriteOp, WriteRequest};

fn req(key: &str, op: WriteOp, expiry: u32) -> WriteRequest {
    let value = (op != WriteOp::Remove).then(|| Bytes::from_static(b"1"));
    WriteRequest { key: Bytes::copy_from_slice(key.as_bytes()), op, value, cas: None, expiry }
}

#[test]
fn expiry_pager_and_tombstone_purger() {
    let dir = tempfile::tempdir().unwrap();
    let config = StoreConfig {
        data_paths: vec![dir.path().to_path_buf()],
        partitions: Some(1),
        purge_horizon: Duration::ZERO,
        purge_interval: Duration::from_secs(3600),
        ..StoreConfig::default()
    };
    let store = Store::open(config.clone()).unwrap();
    let coll = store.create_collection("c", 0).unwrap();
    let now = shoal_storage::unix_now_secs() as u32;
    let _ = coll.write(req("old", WriteOp::Upsert, now - 1)).unwrap();
    let _ = coll.write(req("keep", WriteOp::Upsert, now + 3600)).unwrap();
    let _ = coll.write(req("gone", WriteOp::Upsert, 0)).unwrap();
    let _ = coll.write(req("gone", WriteOp::Remove, 0)).unwrap();
    assert!(coll.get("old").is_err(), "an expired document is never returned");
    assert_eq!(store.run_expiry_pager(), 1);
    assert_eq!(store.run_expiry_pager(), 0, "expired once");
    assert!(coll.get("keep").is_ok());
    let (mut first, _) = coll.subscribe(0, StreamPosition::default()).unwrap();
    let changes = first.try_next(100, false).unwrap();
    assert!(changes.iter().any(|c| &c.key[..] == b"old" && c.deleted));

    let uuid = coll.partition_uuids()[0];
    std::thread::sleep(Duration::from_millis(5));
    assert_eq!(store.run_purger(), 2, "both tombstones are past a zero horizon");
    let (mut sub, rollback) = coll.subscribe(0, StreamPosition { seqno: 1, uuid }).unwrap();
    assert_eq!(rollback, Some(0), "resuming before the purge seqno restarts from 0");
    // Replaying from the start gives the live set (the tail may still hold purged changes).
    let mut live = std::collections::BTreeMap::new();
    for c in sub.try_next(100, false).unwrap() {
        live.insert(c.key, !c.deleted);
    }
    let live: Vec<_> = live.into_iter().filter(|(_, l)| *l).map(|(k, _)| k).collect();
    assert_eq!(live, vec![Bytes::from_static(b"keep")]);
    store.close().unwrap();
    drop((coll, sub, first));
    drop(store);
    // The purge seqno survives a restart, and new seqnos continue above it.
    let store = Store::open(config).unwrap();
    let coll = store.collection("c").unwrap();
    let (outcome, _) = coll.write(req("new", WriteOp::Upsert, 0)).unwrap();
    assert_eq!(outcome.seqno, 6);
}

/// The purge seqno is durable before any tombstone is purged: after a power cut that kept
/// the purge (a later `persist` write fsynced the data path holding the tombstones) a
/// reader from before the purged deletions is still sent back to the start. With two data
/// paths the purge seqno (on path 0) and the tombstones (here on path 1) live in different
/// journals, so only the order of the fsyncs protects the reader.
#[test]
fn the_purge_seqno_is_durable_before_tombstones_go() {
    use shoal_faultfs::{FaultFs, FaultFsOptions};
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultFs::mount(dir.path(), FaultFsOptions::default()).expect("mount the fault filesystem (needs root and /dev/fuse)");
    let paths = vec![fs.mountpoint().join("a"), fs.mountpoint().join("b")];
    let config = StoreConfig {
        data_paths: paths,
        partitions: Some(2),
        purge_horizon: Duration::ZERO,
        purge_interval: Duration::from_secs(3600),
        ..StoreConfig::default()
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let store = Store::open(config.clone()).unwrap();
    let coll = store.create_collection("c", 0).unwrap();
    // Keys of partition 1, which lives on the second data path.
    let keys: Vec<String> =
        (0..100).map(|i| format!("k{i}")).filter(|k| shoal_storage::partition_of(k.as_bytes(), 2) == 1).take(4).collect();
    for k in &keys {
        let _ = coll.write(req(k, WriteOp::Upsert, 0)).unwrap();
        let _ = coll.write(req(k, WriteOp::Remove, 0)).unwrap();
    }
    let (outcome, wait) = coll.write(req("anchor-1", WriteOp::Upsert, 0)).unwrap();
    rt.block_on(wait.wait()).unwrap();
    fs.sync_all();
    let (uuid, before) = (coll.partition_uuids()[1], 1);
    std::thread::sleep(Duration::from_millis(5));
    assert!(store.run_purger() >= keys.len(), "the tombstones are past a zero horizon");
    // A persist write on partition 1 makes its path's journal — with the purge — durable.
    let key = (0..1000).map(|i| format!("p{i}")).find(|k| shoal_storage::partition_of(k.as_bytes(), 2) == 1).unwrap();
    let (_, wait) = coll.write(req(&key, WriteOp::Upsert, 0)).unwrap();
    rt.block_on(wait.wait()).unwrap();
    // The machine dies.
    fs.fail_writes(true);
    fs.fail_fsync(true);
    let _ = store.close();
    drop(coll);
    drop(store);
    fs.power_cut();
    fs.fail_writes(false);
    fs.fail_fsync(false);
    let store = Store::open(config).unwrap();
    let coll = store.collection("c").unwrap();
    for k in &keys {
        assert!(coll.get(k).is_err(), "{k} stays deleted");
    }
    let (_, rollback) = coll.subscribe(1, StreamPosition { seqno: before, uuid }).unwrap();
    assert_eq!(rollback, Some(0), "a reader from before the purged deletions starts again from 0");
    assert!(outcome.seqno > 0);
}

/// Time is the store's time source: a test moves it and documents expire, tombstones age
/// and history UUIDs repeat per seed, with no sleep.
#[test]
fn a_manual_clock_expires_documents_and_ages_tombstones_without_waiting() {
    use shoal_storage::{ManualClock, SeededIds};
    let dir = tempfile::tempdir().unwrap();
    let start = 2_000_000_000;
    let time = ManualClock::at(start);
    let config = StoreConfig {
        data_paths: vec![dir.path().to_path_buf()],
        partitions: Some(2),
        purge_horizon: Duration::from_secs(3600),
        purge_interval: Duration::from_secs(3600),
        time: time.clone(),
        ids: SeededIds::new(11),
        ..StoreConfig::default()
    };
    let store = Store::open(config.clone()).unwrap();
    assert_eq!(store.now_secs(), start);
    let coll = store.create_collection("c", 0).unwrap();
    let expiry = shoal_storage::absolute_expiry(10, store.now_secs()).unwrap();
    let (written, _) = coll.write(req("short", WriteOp::Upsert, expiry)).unwrap();
    assert_eq!(written.cas, start * 1_000_000_000, "CAS is the store's clock in nanoseconds");
    let _ = coll.write(req("gone", WriteOp::Upsert, 0)).unwrap();
    let _ = coll.write(req("gone", WriteOp::Remove, 0)).unwrap();

    time.advance(Duration::from_secs(9));
    assert!(coll.get("short").is_ok(), "nine seconds in, a ten-second document lives");
    assert_eq!(store.run_expiry_pager(), 0);
    time.advance(Duration::from_secs(2));
    assert!(coll.get("short").is_err(), "eleven seconds in, it has expired");
    assert_eq!(store.run_expiry_pager(), 1);
    assert_eq!(store.run_purger(), 0, "tombstones younger than the horizon stay");
    time.advance(Duration::from_secs(3601));
    assert_eq!(store.run_purger(), 2, "past the horizon both tombstones (removal, expiry) go");

    // The same seed gives a second store the same history UUIDs.
    let other_dir = tempfile::tempdir().unwrap();
    let other = Store::open(StoreConfig { data_paths: vec![other_dir.path().to_path_buf()], ids: SeededIds::new(11), ..config }).unwrap();
    let twin = other.create_collection("c", 0).unwrap();
    assert_eq!(twin.partition_uuids(), coll.partition_uuids());
    other.close().unwrap();
    store.close().unwrap();
}

/// The pager reads a partition's expiry keys only once something in it may be due, and a
/// write racing its read is never left behind: documents written by four threads while the
/// pager runs in a fifth (some already due, some later) all expire exactly once.
#[test]
fn the_pager_skips_partitions_with_nothing_due_and_misses_no_racing_write() {
    use shoal_storage::ManualClock;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let start: u64 = 2_000_000_000;
    let time = ManualClock::at(start);
    let config = StoreConfig {
        data_paths: vec![dir.path().to_path_buf()],
        partitions: Some(8),
        purge_interval: Duration::from_secs(3600),
        time: time.clone(),
        ..StoreConfig::default()
    };
    let store = Arc::new(Store::open(config.clone()).unwrap());
    let coll = store.create_collection("c", 0).unwrap();
    // Nothing expires yet: every partition is read once (a new copy), then not again.
    let _ = coll.write(req("later", WriteOp::Upsert, (start + 50) as u32)).unwrap();
    assert_eq!(store.run_expiry_pager(), 0);
    assert_eq!(store.run_expiry_pager(), 0);

    const THREADS: usize = 4;
    const DOCS: usize = 300;
    let (stop, paged) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
    let pager = {
        let (store, stop, paged) = (Arc::clone(&store), Arc::clone(&stop), Arc::clone(&paged));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                paged.fetch_add(store.run_expiry_pager(), Ordering::AcqRel);
            }
        })
    };
    let writers: Vec<_> = (0..THREADS)
        .map(|t| {
            let coll = Arc::clone(&coll);
            std::thread::spawn(move || {
                for i in 0..DOCS {
                    // Every third is due at once; the rest expire 1–99 s from the start.
                    let expiry = if i % 3 == 0 { start - 1 } else { start + 1 + ((i * 7 + t) % 99) as u64 };
                    let _ = coll.write(req(&format!("t{t}-{i}"), WriteOp::Upsert, expiry as u32)).unwrap();
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Release);
    pager.join().unwrap();
    let due_at_once = THREADS * DOCS.div_ceil(3);
    let mut total = paged.load(Ordering::Acquire) + store.run_expiry_pager();
    assert_eq!(total, due_at_once, "every document already due expired once, none early");
    time.advance(Duration::from_secs(100));
    total += store.run_expiry_pager();
    assert_eq!(total, THREADS * DOCS + 1, "every document expired exactly once");
    assert_eq!(store.run_expiry_pager(), 0);

    // A restart makes new copies, whose keys are read again.
    let _ = coll.write(req("after", WriteOp::Upsert, (start + 200) as u32)).unwrap();
    store.close().unwrap();
    drop(coll);
    drop(Arc::try_unwrap(store).ok().expect("the only holder"));
    let store = Store::open(config).unwrap();
    time.advance(Duration::from_secs(101));
    assert_eq!(store.run_expiry_pager(), 1, "found by the new copy's first read");
}
