//! The change stream hands over from disk backfill to the in-memory tail with no gap and
//! no duplicate, while writers run concurrently.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use proptest::prelude::*;
use shoal_storage::{Store, StoreConfig, StreamPosition, WriteOp, WriteRequest};

fn open(dir: &std::path::Path, partitions: u16) -> Arc<Store> {
    Store::open(StoreConfig { data_paths: vec![dir.to_path_buf()], partitions: Some(partitions), ..StoreConfig::default() }).unwrap()
}

fn upsert(key: String, value: String) -> WriteRequest {
    WriteRequest { key: Bytes::from(key), op: WriteOp::Upsert, value: Some(Bytes::from(value)), cas: None, expiry: 0 }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Writers race a subscriber that starts anywhere in the history; what it reads,
    /// applied in order, must equal the final state of the partition, and seqnos must
    /// strictly increase.
    #[test]
    fn subscription_sees_every_latest_change_once(
        prefill in 0usize..3000,
        live in 1usize..3000,
        keys in 1usize..400,
        start_at in 0u64..2000,
        batch in 1usize..700,
        deletes in 0usize..5,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path(), 1);
        let coll = store.create_collection("c", 0).unwrap();
        for i in 0..prefill {
            let _ = coll.write(upsert(format!("k{}", i % keys), format!("\"pre{i}\""))).unwrap();
        }
        let start = start_at.min(coll.high_seqnos()[0]);
        let (mut sub, rollback) = coll.subscribe(0, StreamPosition { seqno: start, uuid: coll.partition_uuids()[0] }).unwrap();
        prop_assert_eq!(rollback, None);

        let writer = {
            let coll = Arc::clone(&coll);
            std::thread::spawn(move || {
                for i in 0..live {
                    let key = format!("k{}", (i * 7) % keys);
                    if deletes > 0 && i % (deletes * 3 + 1) == 0 {
                        let _ = coll.write(WriteRequest { key: Bytes::from(key), op: WriteOp::Remove, value: None, cas: None, expiry: 0 });
                    } else {
                        let _ = coll.write(upsert(key, format!("\"live{i}\""))).unwrap();
                    }
                }
            })
        };
        let mut seen: BTreeMap<Bytes, Option<Bytes>> = BTreeMap::new();
        let mut last = start;
        let mut reads = 0usize;
        loop {
            let done = writer.is_finished();
            let changes = sub.try_next(batch, true).unwrap();
            for c in &changes {
                prop_assert!(c.seqno > last, "seqno {} after {}", c.seqno, last);
                last = c.seqno;
                seen.insert(c.key.clone(), c.value.clone());
            }
            reads += 1;
            if changes.is_empty() && done {
                break;
            }
            prop_assert!(reads < 1_000_000);
        }
        writer.join().unwrap();
        prop_assert_eq!(last, coll.high_seqnos()[0]);
        // Every key whose latest change is after `start` was seen, with its latest value.
        for k in 0..keys {
            let key = format!("k{k}");
            let stored = coll.get(&key).ok().map(|d| d.value);
            match seen.get(key.as_bytes()) {
                Some(v) => prop_assert_eq!(v, &stored, "key {}", key),
                None => {
                    // Unseen: its last change is at or before `start`, so it is untouched by `live` writes.
                    let doc = coll.get(&key);
                    if let Ok(doc) = doc {
                        prop_assert!(doc.seqno <= start, "key {} changed at {} but was never delivered", key, doc.seqno);
                    }
                }
            }
        }
    }
}

#[tokio::test]
async fn waiting_subscriber_wakes_on_a_write() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), 4);
    let coll = store.create_collection("c", 0).unwrap();
    let p = shoal_storage::partition_of(b"x", 4);
    let (mut sub, _) = coll.subscribe(p, StreamPosition::default()).unwrap();
    let reader = tokio::spawn(async move { sub.next(10, true).await.unwrap() });
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let (outcome, wait) = coll.write(upsert("x".into(), "1".into())).unwrap();
    wait.wait().await.unwrap();
    let got = reader.await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].seqno, outcome.seqno);
    assert_eq!(got[0].value.as_deref(), Some(&b"1"[..]));
}

#[test]
fn restart_keeps_history_and_unclean_restart_rolls_back() {
    let dir = tempfile::tempdir().unwrap();
    let uuid;
    {
        let store = open(dir.path(), 2);
        let coll = store.create_collection("c", 0).unwrap();
        for i in 0..100 {
            let _ = coll.write(upsert(format!("k{i}"), "1".into())).unwrap();
        }
        uuid = coll.partition_uuids();
        store.close().unwrap();
    }
    let highs;
    {
        let store = open(dir.path(), 2);
        assert!(!store.recovered_unclean());
        let coll = store.collection("c").unwrap();
        assert_eq!(coll.partition_uuids(), uuid, "a clean restart keeps the history");
        assert_eq!(coll.info().docs, 100);
        highs = coll.high_seqnos();
        assert_eq!(highs.iter().sum::<u64>(), 100);
        // No close(): as if killed.
    }
    let store = open(dir.path(), 2);
    assert!(store.recovered_unclean());
    let coll = store.collection("c").unwrap();
    assert_ne!(coll.partition_uuids(), uuid);
    assert_eq!(coll.info().docs, 100);
    let (_, rollback) = coll.subscribe(0, StreamPosition { seqno: highs[0] + 5, uuid: uuid[0] }).unwrap();
    assert_eq!(rollback, Some(highs[0]), "a reader ahead of the recovered history rolls back to it");
    let (_, rollback) = coll.subscribe(0, StreamPosition { seqno: 3, uuid: 12345 }).unwrap();
    assert_eq!(rollback, Some(0), "an unknown history rolls back to the start");
}

#[test]
fn partition_count_is_fixed_at_creation() {
    let dir = tempfile::tempdir().unwrap();
    open(dir.path(), 8).close().unwrap();
    let err = Store::open(StoreConfig { data_paths: vec![dir.path().to_path_buf()], partitions: Some(16), ..StoreConfig::default() })
        .err()
        .unwrap();
    assert!(err.to_string().contains("created with 8 partitions"), "{err}");
}
