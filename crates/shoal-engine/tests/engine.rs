//! The engine below HTTP: collection side effects happen whoever creates the collection
//! (with an id given from outside, as the cluster's metadata log will), and a test drives
//! its clock.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde_json::json;
use shoal_engine::{Engine, EngineConfig};
use shoal_index::{Consistency, IndexDef, ScanBounds, ScanRequest};
use shoal_storage::{ManualClock, SeededIds, StoreConfig, WriteOp, WriteRequest};

/// How long a request-plus scan or a shadow may take to catch up before the test fails.
const WAIT: Duration = Duration::from_secs(60);
const START_SECS: u64 = 2_000_000_000;

fn config(dir: &std::path::Path, time: Arc<ManualClock>) -> EngineConfig {
    EngineConfig {
        store: StoreConfig {
            data_paths: vec![dir.to_path_buf()],
            partitions: Some(8),
            time,
            ids: SeededIds::new(3),
            ..StoreConfig::default()
        },
        index_workers: Some(2),
        analytics_partitions: Some(2),
        analytics_memory: Some(256 << 20),
        index_feed: None,
    }
}

fn upsert(key: &str, doc: serde_json::Value, expiry: u32) -> WriteRequest {
    WriteRequest {
        key: Bytes::copy_from_slice(key.as_bytes()),
        op: WriteOp::Upsert,
        value: Some(Bytes::from(doc.to_string())),
        cas: None,
        expiry,
    }
}

async fn scan(engine: &Engine, coll: &shoal_storage::Collection, eq: serde_json::Value) -> Vec<String> {
    let req = ScanRequest {
        bounds: ScanBounds::Eq(vec![eq]),
        limit: 100,
        descending: false,
        consistency: Consistency::RequestPlus,
        timeout: WAIT,
        keep: None,
        parts: None,
    };
    engine.indexes().scan(coll, "by_k", req).await.unwrap().into_iter().map(|r| r.id).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collection_with_a_given_id_gets_its_shadow_and_index_and_expires_by_the_engines_clock() {
    let dir = tempfile::tempdir().unwrap();
    let time = ManualClock::at(START_SECS);
    let engine = Engine::open(config(dir.path(), time.clone())).await.unwrap();
    let info = engine.create_collection("events", 0, Some(42)).await.unwrap();
    assert_eq!(info.name, "events");
    let coll = engine.store().collection("events").unwrap();
    assert_eq!(coll.id(), 42, "the id given from outside");
    assert!(engine.shadows().shadow(42).is_some(), "a created collection gets its analytics shadow");

    let short = shoal_storage::absolute_expiry(10, engine.store().now_secs()).unwrap();
    let _ = coll.write(upsert("a", json!({"k": 1}), short)).unwrap();
    let _ = coll.write(upsert("b", json!({"k": 1}), 0)).unwrap();
    let def = IndexDef { name: "by_k".into(), keys: vec!["k".into()], filter: None, defer_build: false, partitions: None, replicas: 0 };
    engine.indexes().create(&coll, def).await.unwrap();
    assert_eq!(scan(&engine, &coll, json!(1)).await, ["a", "b"]);
    let shadow = engine.shadows().shadow(42).unwrap();
    shadow.wait_applied(&coll.high_seqnos(), WAIT).await.unwrap();
    assert_eq!(shadow.rows(), 2);

    // Ten seconds on the engine's clock, not the wall's: "a" expires; the pager turns it
    // into a deletion, which the index and the shadow follow.
    time.advance(Duration::from_secs(11));
    assert!(coll.get("a").is_err());
    assert_eq!(engine.store().run_expiry_pager(), 1);
    assert_eq!(scan(&engine, &coll, json!(1)).await, ["b"]);
    shadow.wait_applied(&coll.high_seqnos(), WAIT).await.unwrap();
    assert_eq!(shadow.rows(), 1);
    engine.close().await.unwrap();
    drop((coll, shadow, engine));

    // Reopened in the same process: the id, the index and the shadow are all still there.
    let engine = Engine::open(config(dir.path(), time.clone())).await.unwrap();
    let coll = engine.store().collection("events").unwrap();
    assert_eq!(coll.id(), 42);
    assert_eq!(scan(&engine, &coll, json!(1)).await, ["b"]);
    engine.shadows().wait_loaded(WAIT).await.unwrap();
    assert!(engine.shadows().shadow(42).is_some());

    // A drop takes the indexes with it; the id cannot be taken twice while in use.
    assert!(engine.create_collection("other", 0, Some(42)).await.is_err(), "id 42 is taken");
    engine.drop_collection("events").await.unwrap();
    assert!(engine.store().collection("events").is_none());
    let again = engine.create_collection("events", 0, None).await.unwrap();
    assert_eq!(again.name, "events");
    let coll = engine.store().collection("events").unwrap();
    assert!(engine.indexes().list(&coll).is_empty(), "the dropped collection's index went with it");
    engine.close().await.unwrap();
}
