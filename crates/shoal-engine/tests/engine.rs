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

/// Key → value of field `v` of every live row of the shadow (what a scan reads).
fn shadow_rows(shadow: &shoal_query::shadow::Shadow) -> std::collections::BTreeMap<String, i64> {
    use datafusion::arrow::array::AsArray;
    let mut out = std::collections::BTreeMap::new();
    for part in shadow.snapshot(None).unwrap().into_iter().flatten() {
        let keys = part.batch.column(0).as_string::<i32>();
        let v = part.batch.column_by_name("v").unwrap();
        let v = datafusion::arrow::compute::cast(v, &datafusion::arrow::datatypes::DataType::Int64).unwrap();
        let v = v.as_primitive::<datafusion::arrow::datatypes::Int64Type>();
        for r in 0..part.batch.num_rows() {
            if part.live.as_ref().is_none_or(|l| l.value(r)) {
                assert!(out.insert(keys.value(r).to_string(), v.value(r)).is_none(), "a key is live once");
            }
        }
    }
    out
}

/// A partition's shadow rows taken out as batches and adopted back (what a move by files
/// does across nodes) are the same rows; later changes to them land, and they survive a
/// restart. Rows of another partition or without the key column are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitions_shadow_rows_adopted_from_an_export_answer_the_same_and_follow_later_changes() {
    let dir = tempfile::tempdir().unwrap();
    let time = ManualClock::at(START_SECS);
    let engine = Engine::open(config(dir.path(), time.clone())).await.unwrap();
    engine.create_collection("c", 0, Some(7)).await.unwrap();
    let coll = engine.store().collection("c").unwrap();
    let mut model = std::collections::BTreeMap::new();
    for i in 0..300i64 {
        let _ = coll.write(upsert(&format!("k{i}"), json!({"table_name": format!("t{}", i % 3), "v": i}), 0)).unwrap();
        model.insert(format!("k{i}"), i);
    }
    let shadow = engine.shadows().shadow(7).unwrap();
    shadow.wait_applied(&coll.high_seqnos(), WAIT).await.unwrap();
    assert_eq!(shadow_rows(&shadow), model);

    let p: shoal_storage::PartitionId = 3;
    let of_p = |k: &str| shoal_storage::partition_of(k.as_bytes(), coll.partition_count()) == p;
    let rows = shadow.export_partition(p).unwrap();
    assert_eq!(rows.rows(), model.keys().filter(|k| of_p(k)).count(), "the export holds exactly the partition's live rows");
    assert_eq!(rows.position.seqno, coll.high_seqnos()[usize::from(p)]);
    // Sent as bytes, as between nodes.
    let sent = shoal_query::shadow::PartitionRows {
        position: rows.position,
        batches: rows
            .batches
            .iter()
            .map(|(g, b)| (g.clone(), shoal_query::shadow::decode_batch(&shoal_query::shadow::encode_batch(b).unwrap()).unwrap()))
            .collect(),
    };
    // Hostile input: rows of another partition, or without their key first.
    let other = shadow.export_partition(p + 1).unwrap();
    assert!(shadow.adopt_partition(p, other).is_err(), "rows of partition {} refused as {p}'s", p + 1);
    let keyless = shoal_query::shadow::PartitionRows {
        position: rows.position,
        batches: rows.batches.iter().map(|(g, b)| (g.clone(), b.project(&[1]).unwrap())).collect(),
    };
    assert!(shadow.adopt_partition(p, keyless).is_err(), "rows without their key column refused");

    let guard = engine.shadows().incoming(p);
    assert_eq!(shadow.adopt_partition(p, sent).unwrap(), rows.rows());
    drop(guard);
    assert_eq!(shadow_rows(&shadow), model, "the adopted rows read as the rows they replaced");

    // Later changes to the adopted rows: updates and deletes land on them.
    for i in 0..300i64 {
        let key = format!("k{i}");
        if !of_p(&key) {
            continue;
        }
        if i % 2 == 0 {
            let _ = coll.write(upsert(&key, json!({"table_name": "t9", "v": -i}), 0)).unwrap();
            model.insert(key, -i);
        } else {
            let del = WriteRequest { key: Bytes::from(key.clone()), op: WriteOp::Remove, value: None, cas: None, expiry: 0 };
            let _ = coll.write(del).unwrap();
            model.remove(&key);
        }
    }
    shadow.wait_applied(&coll.high_seqnos(), WAIT).await.unwrap();
    assert_eq!(shadow_rows(&shadow), model, "changes after the adoption's position are applied to the adopted rows");
    engine.close().await.unwrap();
    drop((coll, shadow, engine));

    let engine = Engine::open(config(dir.path(), time)).await.unwrap();
    engine.shadows().wait_loaded(WAIT).await.unwrap();
    let shadow = engine.shadows().shadow(7).unwrap();
    assert_eq!(shadow_rows(&shadow), model, "adopted rows survive a restart");
    engine.close().await.unwrap();
}
