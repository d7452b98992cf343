//! `scan_docs` reads live documents in key order over every data path, in pages that
//! resume after the last key, and counts survive a reopen across paths.

use bytes::Bytes;
use shoal_storage::{Store, StoreConfig, WriteOp, WriteRequest};

fn req(key: &str, op: WriteOp, expiry: u32) -> WriteRequest {
    let value = (op != WriteOp::Remove).then(|| Bytes::from(format!("{{\"k\":\"{key}\"}}")));
    WriteRequest { key: Bytes::copy_from_slice(key.as_bytes()), op, value, cas: None, expiry }
}

#[test]
fn pages_in_key_order_over_all_paths() {
    let dir = tempfile::tempdir().unwrap();
    let paths = vec![dir.path().join("a"), dir.path().join("b"), dir.path().join("c")];
    let config = StoreConfig { data_paths: paths, partitions: Some(7), ..StoreConfig::default() };
    let store = Store::open(config.clone()).unwrap();
    let coll = store.create_collection("c", 0).unwrap();
    let now = shoal_storage::unix_now_secs() as u32;
    let mut expected = Vec::new();
    for i in 0..500 {
        let key = format!("k{i:04}");
        let _ = coll.write(req(&key, WriteOp::Upsert, 0)).unwrap();
        match i % 10 {
            3 => drop(coll.write(req(&key, WriteOp::Remove, 0)).unwrap()),
            7 => drop(coll.write(req(&key, WriteOp::Upsert, now - 1)).unwrap()),
            _ => expected.push(key),
        }
    }
    let mut seen = Vec::new();
    let mut after: Option<Bytes> = None;
    loop {
        let page = coll.scan_docs(after.as_deref(), 37).unwrap();
        assert!(page.len() <= 37);
        let Some(last) = page.last() else { break };
        after = Some(last.0.clone());
        for (k, v) in page {
            let k = String::from_utf8(k.to_vec()).unwrap();
            assert_eq!(v, Bytes::from(format!("{{\"k\":\"{k}\"}}")));
            seen.push(k);
        }
    }
    assert_eq!(seen, expected, "every live document once, in key order; tombstones and expired ones skipped");
    // Key ranges split the same documents without gaps or overlaps.
    use std::ops::Bound;
    let cuts = ["k0100", "k0250", "k0251", "k0499"];
    let mut split = Vec::new();
    let mut low: Bound<&[u8]> = Bound::Unbounded;
    for end in cuts.iter().map(|c| Some(c.as_bytes())).chain([None]) {
        for (k, _) in coll.scan_docs_range(low, end, 10_000).unwrap() {
            split.push(String::from_utf8(k.to_vec()).unwrap());
        }
        low = end.map_or(Bound::Unbounded, Bound::Included);
    }
    assert_eq!(split, expected);
    assert!(coll.scan_docs_range(Bound::Included(b"k2"), Some(b"k1"), 10).unwrap().is_empty());
    // Over some partitions only (a cluster member's active ones): those keys, in order.
    let keep = |p: u16| p % 3 == 1;
    let mut some = Vec::new();
    let mut low: Bound<Bytes> = Bound::Unbounded;
    loop {
        let page = coll.scan_docs_range_in(low.as_ref().map(|b| b.as_ref()), None, 11, &keep).unwrap();
        let Some(last) = page.last() else { break };
        low = Bound::Excluded(last.0.clone());
        some.extend(page.into_iter().map(|(k, _)| String::from_utf8(k.to_vec()).unwrap()));
    }
    let want: Vec<String> = expected.iter().filter(|k| keep(shoal_storage::partition_of(k.as_bytes(), 7))).cloned().collect();
    assert!(!want.is_empty() && want.len() < expected.len());
    assert_eq!(some, want);

    drop(coll);
    store.close().unwrap();
    drop(store);
    let store = Store::open(config).unwrap();
    let info = store.collection("c").unwrap().info();
    // Expired documents count until the pager removes them.
    assert_eq!(info.docs, 450);
}
