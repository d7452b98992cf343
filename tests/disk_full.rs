//! A data path on a small `tmpfs` that fills up: writes answer `507 insufficient_storage`,
//! reads keep working, `/v1/health` says why, nothing acknowledged is lost, and the node
//! writes again by itself once space is freed — no restart, no stuck request.

mod common;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::Path;
use std::time::Duration;

use common::{eventually, free_bytes, Node, Tmpfs};
use serde_json::Value;

const TMPFS_BYTES: u64 = 96 * 1024 * 1024;
const RESERVE_MB: &str = "8";

/// Fills the file system of `dir` with `filler` until `leave` bytes are free (0: to the
/// last byte, writing until the kernel says no more).
fn fill(dir: &Path, filler: &str, leave: u64) {
    let mut f = std::fs::File::create(dir.join(filler)).unwrap();
    let chunk = vec![7u8; 64 * 1024];
    loop {
        let free = free_bytes(dir);
        if free <= leave {
            break;
        }
        let n = chunk.len().min((free - leave) as usize);
        if f.write_all(&chunk[..n]).is_err() {
            break; // ENOSPC: full to the last byte
        }
    }
    let _ = f.sync_all();
}

async fn health(c: &reqwest::Client, node: &Node) -> (u16, Value) {
    let r = c.get(node.u("/v1/health")).send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

/// Writes 4 KiB documents until the node refuses one; returns what was acknowledged.
async fn write_until_refused(c: &reqwest::Client, node: &Node, from: usize, acked: &mut BTreeMap<String, usize>) -> Value {
    let body = format!("{{\"pad\":\"{}\"}}", "x".repeat(4000));
    for i in from.. {
        let key = format!("k{i:06}");
        let r = c.put(node.u(&format!("/v1/collections/d/docs/{key}?durability=persist"))).body(body.clone()).send().await.unwrap();
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap();
        match status {
            200 => {
                acked.insert(key, i);
            }
            507 => return v,
            other => panic!("write {i}: unexpected {other} {v}"),
        }
        assert!(i < from + 100_000, "the disk never filled");
    }
    unreachable!()
}

#[tokio::test]
async fn a_full_disk_refuses_writes_and_recovers_by_itself() {
    let fs = Tmpfs::mount(TMPFS_BYTES);
    let data = fs.dir.join("data");
    let mut node = Node::start_in(data.clone(), &["--partitions", "8", "--disk-reserve-mb", RESERVE_MB, "--analytics-partitions", "0"]);
    let c = node.client();
    assert_eq!(c.put(node.u("/v1/collections/d")).send().await.unwrap().status(), 201);
    // Leave room for a few MiB of documents above the reserve.
    fill(&fs.dir, "filler", 24 * 1024 * 1024);

    let mut acked = BTreeMap::new();
    let refused = write_until_refused(&c, &node, 0, &mut acked).await;
    assert_eq!(refused["error"], "insufficient_storage", "{refused}");
    assert!(!acked.is_empty());
    // Every kind of write is refused; reads and the other endpoints keep working.
    let r = c.delete(node.u("/v1/collections/d/docs/k000000")).send().await.unwrap();
    assert_eq!(r.status(), 507);
    let bulk = c.post(node.u("/v1/collections/d/_bulk")).body("{\"op\":\"upsert\",\"key\":\"b\",\"value\":1}\n").send().await.unwrap();
    let line: Value = serde_json::from_str(bulk.text().await.unwrap().trim()).unwrap();
    assert_eq!(line["error"], "insufficient_storage");
    for key in acked.keys() {
        let r = c.get(node.u(&format!("/v1/collections/d/docs/{key}"))).send().await.unwrap();
        assert_eq!(r.status(), 200, "{key} unreadable on a full disk");
    }
    let (code, h) = health(&c, &node).await;
    assert_eq!(code, 503, "{h}");
    assert_eq!(h["storage"]["state"], "disk_full");
    assert_eq!(h["storage"]["writable"], false);

    // Space comes back: the node writes again without a restart.
    std::fs::remove_file(fs.dir.join("filler")).unwrap();
    eventually(30, "writes resume after space is freed", || async {
        c.put(node.u("/v1/collections/d/docs/after")).body("1").send().await.unwrap().status() == 200
    })
    .await;
    let (code, h) = health(&c, &node).await;
    assert_eq!((code, &h["storage"]["state"]), (200, &Value::from("ok")), "{h}");

    // Filled again, this time by someone else to the very last byte while the node is
    // idle: the watchdog notices and writes are refused before the engine runs out of
    // room; freeing the space ends it again.
    fill(&fs.dir, "filler2", 0);
    eventually(10, "the watchdog sees the full disk", || async { health(&c, &node).await.0 == 503 }).await;
    let r = c.put(node.u("/v1/collections/d/docs/late")).body("1").send().await.unwrap();
    assert_eq!(r.status(), 507);
    std::fs::remove_file(fs.dir.join("filler2")).unwrap();
    eventually(30, "writes resume after the second fill", || async {
        c.put(node.u("/v1/collections/d/docs/late")).body("2").send().await.unwrap().status() == 200
    })
    .await;

    // Nothing acknowledged was lost, across a clean restart too.
    assert!(node.stop(), "clean shutdown after a full disk");
    node.restart();
    let c = node.client();
    for key in acked.keys().chain(["after".to_string(), "late".to_string()].iter()) {
        let r = c.get(node.u(&format!("/v1/collections/d/docs/{key}"))).send().await.unwrap();
        assert_eq!(r.status(), 200, "acknowledged {key} lost");
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
}

/// The disk fills to the last byte while writers are busy, so the engine itself meets
/// `ENOSPC` before the watchdog looks (and poisons itself): writes are refused (never
/// acknowledged and lost), and once space is freed the node restarts itself to reopen the
/// engine and takes writes again, on the same port, with everything acknowledged.
#[tokio::test]
async fn a_disk_filled_under_load_recovers_by_itself() {
    let fs = Tmpfs::mount(TMPFS_BYTES);
    let data = fs.dir.join("data");
    let node = Node::start_in(data.clone(), &["--partitions", "8", "--disk-reserve-mb", RESERVE_MB, "--analytics-partitions", "0"]);
    let c = node.client();
    assert_eq!(c.put(node.u("/v1/collections/d")).send().await.unwrap().status(), 201);
    let acked = std::sync::Arc::new(std::sync::Mutex::new(BTreeMap::new()));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..4 {
        let (c, url, acked, stop) = (c.clone(), node.url.clone(), acked.clone(), stop.clone());
        writers.push(tokio::spawn(async move {
            let body = format!("{{\"pad\":\"{}\"}}", "y".repeat(2000));
            let mut refused = 0;
            for i in 0.. {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                let key = format!("w{w}-{i}");
                // During the restart the connection drops or is refused: not acknowledged.
                let Ok(r) = c.put(format!("{url}/v1/collections/d/docs/{key}")).body(body.clone()).send().await else {
                    refused += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                match r.status().as_u16() {
                    200 => {
                        acked.lock().unwrap().insert(key, i);
                    }
                    503 | 507 => refused += 1,
                    other => panic!("unexpected {other}: {}", r.text().await.unwrap()),
                }
            }
            refused
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let dir = fs.dir.clone();
    tokio::task::spawn_blocking(move || fill(&dir, "filler", 0)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (code, h) = health(&c, &node).await;
    assert_eq!(code, 503, "{h}");
    std::fs::remove_file(fs.dir.join("filler")).unwrap();
    eventually(60, "writes resume after the fill under load", || async {
        c.put(node.u("/v1/collections/d/docs/after")).body("1").send().await.map(|r| r.status() == 200).unwrap_or(false)
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut refused = 0;
    for w in writers {
        refused += w.await.unwrap();
    }
    assert!(refused > 0, "the writers met the full disk");
    let acked = acked.lock().unwrap().clone();
    for key in acked.keys() {
        let r = c.get(node.u(&format!("/v1/collections/d/docs/{key}"))).send().await.unwrap();
        assert_eq!(r.status(), 200, "acknowledged {key} lost");
    }
}
