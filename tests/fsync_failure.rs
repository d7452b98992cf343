//! A disk that fails under the real binary (its data on `shoal-faultfs`): after a failed
//! fsync, or a write the disk refused with `EIO`, the node acknowledges no write any more —
//! not even `durability=none` ones, not even once the disk works again — until it is
//! restarted; reads keep working, `/v1/health` and `/metrics` say why, and nothing that was
//! acknowledged before is lost across a crash and a power cut.

mod common;

use std::collections::BTreeMap;

use common::faults::{health, metric, FaultDisk};
use common::Node;
use serde_json::Value;

async fn put(c: &reqwest::Client, node: &Node, key: &str, body: &str, durability: &str) -> (u16, Value) {
    let r = c.put(node.u(&format!("/v1/collections/d/docs/{key}?durability={durability}"))).body(body.to_string()).send().await.unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    common::assert_no_private_paths(&text);
    (status, serde_json::from_str(&text).unwrap())
}

/// Writes `count` documents with `persist`, all acknowledged: key -> body.
async fn write_acked(c: &reqwest::Client, node: &Node, prefix: &str, count: usize) -> BTreeMap<String, String> {
    let mut acked = BTreeMap::new();
    for i in 0..count {
        let (key, body) = (format!("{prefix}{i}"), format!("{{\"i\":{i}}}"));
        let (code, v) = put(c, node, &key, &body, "persist").await;
        assert_eq!(code, 200, "{key}: {v}");
        acked.insert(key, body);
    }
    acked
}

async fn assert_readable(c: &reqwest::Client, node: &Node, acked: &BTreeMap<String, String>, when: &str) {
    for (key, body) in acked {
        let r = c.get(node.u(&format!("/v1/collections/d/docs/{key}"))).send().await.unwrap();
        assert_eq!(r.status(), 200, "{when}: acknowledged {key} unreadable");
        let got: Value = r.json().await.unwrap();
        assert_eq!(got, serde_json::from_str::<Value>(body).unwrap(), "{when}: {key}");
    }
}

/// Every kind of write is refused with `503 unavailable`, and the node says it is read-only.
async fn assert_read_only(c: &reqwest::Client, node: &Node, cause: &str) {
    for durability in ["none", "persist"] {
        let (code, v) = put(c, node, "refused", "1", durability).await;
        assert_eq!((code, v["error"].as_str()), (503, Some("unavailable")), "{cause}: a {durability} write answered {v}");
    }
    let r = c.delete(node.u("/v1/collections/d/docs/a0")).send().await.unwrap();
    assert_eq!(r.status(), 503, "{cause}: a delete");
    let r = c
        .post(node.u("/v1/collections/d/docs/a1/mutate"))
        .body(r#"{"specs":[{"op":"upsert","path":"x","value":1}],"durability":"persist"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503, "{cause}: a sub-document mutation");
    let bulk = c.post(node.u("/v1/collections/d/_bulk")).body("{\"op\":\"upsert\",\"key\":\"b\",\"value\":1}\n").send().await.unwrap();
    let line: Value = serde_json::from_str(bulk.text().await.unwrap().trim()).unwrap();
    assert_eq!(line["error"], "unavailable", "{cause}: a _bulk line: {line}");

    let (code, h) = health(c, node).await;
    assert_eq!(code, 503, "{cause}: {h}");
    assert_eq!(h["status"], "unavailable", "{h}");
    assert_eq!(h["storage"]["state"], "failed", "{cause}: {h}");
    assert_eq!(h["storage"]["writable"], false, "{h}");
    assert!(h["storage"]["reason"].as_str().is_some_and(|r| !r.is_empty()), "{cause}: the health names a reason: {h}");
    assert_eq!(metric(c, node, "shoal_storage_writable").await, Some(0.0), "{cause}: the metric");
}

/// After a crash and a power cut the node starts writable, with everything acknowledged.
async fn restart_after_power_cut(disk: &FaultDisk, node: &mut Node, acked: &BTreeMap<String, String>) {
    node.kill9();
    disk.fs.fail_fsync(false);
    disk.fs.fail_writes(false);
    disk.fs.power_cut();
    node.restart();
    let c = node.client();
    assert_readable(&c, node, acked, "after the restart").await;
    let (code, h) = health(&c, node).await;
    assert_eq!((code, &h["storage"]["state"]), (200, &Value::from("ok")), "{h}");
    assert_eq!(metric(&c, node, "shoal_storage_writable").await, Some(1.0));
    let (code, v) = put(&c, node, "after-restart", "1", "persist").await;
    assert_eq!(code, 200, "a restarted node takes writes again: {v}");
}

#[tokio::test]
async fn a_failed_fsync_makes_the_node_read_only_until_restart() {
    let disk = FaultDisk::mount();
    let (mut node, c) = disk.start_node_with_collection("d").await;
    let acked = write_acked(&c, &node, "a", 20).await;
    let (code, _) = put(&c, &node, "loose", "1", "none").await;
    assert_eq!(code, 200);
    assert_eq!(health(&c, &node).await.0, 200);
    assert_eq!(metric(&c, &node, "shoal_storage_writable").await, Some(1.0));

    disk.fs.fail_fsync(true);
    // A persist write whose fsync failed is never acknowledged.
    let (code, v) = put(&c, &node, "p", "1", "persist").await;
    assert_eq!((code, v["error"].as_str()), (503, Some("unavailable")), "a persist write while fsyncs fail answered {v}");
    assert!(disk.fs.stats().failed_fsyncs > 0, "the fault was met");
    assert_read_only(&c, &node, "after a failed fsync").await;
    assert_readable(&c, &node, &acked, "read-only").await;

    // The disk works again: still read-only (pages the failed fsync dropped are never
    // reported again), until a restart.
    disk.fs.fail_fsync(false);
    assert_read_only(&c, &node, "after the fsync fault ended").await;
    restart_after_power_cut(&disk, &mut node, &acked).await;
}

#[tokio::test]
async fn a_failed_write_makes_the_node_read_only_until_restart() {
    let disk = FaultDisk::mount();
    let (mut node, c) = disk.start_node_with_collection("d").await;
    let acked = write_acked(&c, &node, "a", 20).await;

    disk.fs.fail_writes(true);
    // The journal write meets EIO: not acknowledged, at any durability.
    let (code, v) = put(&c, &node, "n", "1", "none").await;
    assert_eq!((code, v["error"].as_str()), (503, Some("unavailable")), "a none write while writes fail answered {v}");
    assert!(disk.fs.stats().failed_writes > 0, "the fault was met");
    assert_read_only(&c, &node, "after a failed write").await;
    assert_readable(&c, &node, &acked, "read-only").await;

    disk.fs.fail_writes(false);
    assert_read_only(&c, &node, "after the write fault ended").await;
    restart_after_power_cut(&disk, &mut node, &acked).await;
}

/// Collection and index definitions are writes too: on a read-only node they are refused
/// with `unavailable` and change nothing (a refused drop leaves the collection in place).
#[tokio::test]
async fn definitions_are_refused_on_a_read_only_node() {
    let disk = FaultDisk::mount();
    let (mut node, c) = disk.start_node_with_collection("d").await;
    let acked = write_acked(&c, &node, "a", 3).await;
    disk.fs.fail_fsync(true);
    let (code, _) = put(&c, &node, "p", "1", "persist").await;
    assert_eq!(code, 503);
    let code_of = |r: reqwest::Response| async move {
        let status = r.status().as_u16();
        (status, r.json::<Value>().await.unwrap_or(Value::Null)["error"].as_str().unwrap_or_default().to_string())
    };
    let unavailable = (503u16, "unavailable".to_string());
    assert_eq!(code_of(c.put(node.u("/v1/collections/e")).send().await.unwrap()).await, unavailable, "create");
    assert_eq!(code_of(c.delete(node.u("/v1/collections/d")).send().await.unwrap()).await, unavailable, "drop");
    let index = c.post(node.u("/v1/collections/d/indexes")).body(r#"{"name":"i","keys":["i"]}"#).send().await.unwrap();
    assert_eq!(code_of(index).await, unavailable, "index");
    assert_readable(&c, &node, &acked, "after refused definitions").await;
    let list: Value = c.get(node.u("/v1/collections")).send().await.unwrap().json().await.unwrap();
    assert_eq!(list.as_array().map(|l| l.len()), Some(1), "{list}");
    node.kill9();
    disk.fs.fail_fsync(false);
    disk.fs.power_cut();
    node.restart();
    let c = node.client();
    assert_readable(&c, &node, &acked, "after restart").await;
    let list: Value = c.get(node.u("/v1/collections")).send().await.unwrap().json().await.unwrap();
    assert_eq!(list.as_array().map(|l| l.len()), Some(1), "{list}");
}
