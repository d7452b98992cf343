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
