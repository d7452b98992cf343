//! `kill -9` under concurrent `persist` writes: every acknowledged write survives with its
//! value, and the change stream after restart has no gap and no duplicate.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{ndjson, Node};
use rand::Rng;
use serde_json::Value;

/// key -> (value counter, seqno, partition) of the last acknowledged write
type Acked = HashMap<String, (u64, u64, u64)>;

#[tokio::test]
async fn acknowledged_persist_writes_survive_kill_9() {
    let mut node = Node::start(&["--partitions", "16"]);
    let c = node.client();
    c.put(node.u("/v1/collections/d")).send().await.unwrap();
    // key -> (value, seqno, partition) of the last acknowledged write
    let acked: Arc<Mutex<Acked>> = Arc::default();
    let mut writers = Vec::new();
    for w in 0..8u64 {
        let (c, url, acked) = (c.clone(), node.url.clone(), Arc::clone(&acked));
        writers.push(tokio::spawn(async move {
            for i in 0u64.. {
                let key = format!("w{w}-k{}", i % 50);
                let url = format!("{url}/v1/collections/d/docs/{key}?durability=persist");
                let Ok(r) = c.put(url).body(format!("{{\"w\":{w},\"i\":{i}}}")).send().await else { return };
                if !r.status().is_success() {
                    return;
                }
                let Ok(m) = r.json::<Value>().await else { return };
                let seqno = m["token"]["seqno"].as_u64().unwrap();
                let p = m["token"]["partition"].as_u64().unwrap();
                acked.lock().unwrap().insert(key, (i, seqno, p));
            }
        }));
    }
    let wait = rand::rng().random_range(300..1200);
    tokio::time::sleep(Duration::from_millis(wait)).await;
    node.kill9();
    for w in writers {
        let _ = w.await;
    }
    let acked = acked.lock().unwrap().clone();
    assert!(acked.len() > 20, "writers made progress before the kill ({} keys)", acked.len());

    node.restart();
    let c = node.client();
    let n: Value = c.get(node.u("/v1/node")).send().await.unwrap().json().await.unwrap();
    assert_eq!(n["recovered_unclean"], true);
    for (key, (i, _, _)) in &acked {
        let r = c.get(node.u(&format!("/v1/collections/d/docs/{key}"))).send().await.unwrap();
        assert!(r.status().is_success(), "acknowledged key {key} lost");
        let v: Value = r.json().await.unwrap();
        // A later, unacknowledged write may have landed too: never an older one.
        assert!(v["i"].as_u64().unwrap() >= *i, "{key}: stored {v}, acknowledged i={i}");
    }

    // The change stream from the start: strictly increasing seqnos per partition, every
    // acknowledged key present at or after its acknowledged seqno.
    let body = c.get(node.u("/v1/collections/d/changes?limit=1000000")).send().await.unwrap().text().await.unwrap();
    let lines = ndjson(&body);
    let mut last_seqno: HashMap<u64, u64> = HashMap::new();
    let mut seen: HashMap<String, u64> = HashMap::new();
    for l in &lines {
        if l.get("last").is_some() {
            continue;
        }
        let (p, s) = (l["partition"].as_u64().unwrap(), l["seqno"].as_u64().unwrap());
        let prev = last_seqno.insert(p, s).unwrap_or(0);
        assert!(s > prev, "partition {p}: seqno {s} after {prev}: duplicate or disorder");
        assert!(seen.insert(l["key"].as_str().unwrap().to_string(), s).is_none(), "key twice in a deduplicated backfill");
    }
    for (key, (_, seqno, _)) in &acked {
        let s = seen.get(key).unwrap_or_else(|| panic!("{key} missing from the change stream"));
        assert!(s >= seqno, "{key}: stream has seqno {s}, acknowledged {seqno}");
    }

    // New writes continue each partition's sequence after the recovered high seqno.
    let r: Value = c.put(node.u("/v1/collections/d/docs/after")).body("1").send().await.unwrap().json().await.unwrap();
    let p = r["token"]["partition"].as_u64().unwrap();
    assert!(r["token"]["seqno"].as_u64().unwrap() > *last_seqno.get(&p).unwrap_or(&0));
}
