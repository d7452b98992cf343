//! Indexes fed from partitions another node holds (the index service): an index node's
//! manager follows a data node's change streams through a fetcher — here reading the other
//! store directly, in the cluster over the network — and answers scans exactly as an index
//! beside the documents would, at `request_plus`; after a restart it goes on from its
//! positions without reading anything again.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use shoal_index::{ChangeFetcher, Consistency, FetchFuture, IndexDef, IndexError, IndexManager, ScanBounds, ScanRequest};
use shoal_storage::{Collection, Fetched, FetchedPart, PartitionId, Store, StreamPosition};

/// A data node, as an index node's fetcher sees it: its store, read directly.
struct StoreFetcher {
    data: Arc<Store>,
    /// Changes handed out, over every fetch.
    handed: AtomicU64,
    /// Added to partition 0's history uuid in `highs`: the active answering from another
    /// history than the one the index followed (as after a failover, before the next fetch
    /// rolls the index back).
    skew: AtomicU64,
}

impl StoreFetcher {
    fn source(&self, coll: &Collection) -> Result<Arc<Collection>, IndexError> {
        self.data.collection(coll.name()).ok_or_else(|| IndexError::Invalid(format!("no collection {} at the data node", coll.name())))
    }
}

impl ChangeFetcher for StoreFetcher {
    fn fetch<'a>(&'a self, coll: &'a Collection, asks: Vec<(PartitionId, StreamPosition)>, wait: Duration) -> FetchFuture<'a, Fetched> {
        Box::pin(async move {
            let source = self.source(coll)?;
            let deadline = Instant::now() + wait;
            let mut changed = source.changed();
            loop {
                changed.borrow_and_update();
                let mut fetched = Fetched::new(source.partition_count());
                let mut any = false;
                for &(p, from) in &asks {
                    let (mut reader, rollback) = source.subscribe(p, from)?;
                    let high = source.position(p).unwrap_or_default();
                    let part = match rollback.filter(|&r| r < from.seqno) {
                        Some(shared) => FetchedPart { from, rollback: Some(shared), end: from, high, ..FetchedPart::default() },
                        None => {
                            let changes = reader.try_next(512, true)?;
                            let end = reader.position();
                            FetchedPart { from, rollback: None, changes, end, snapshot_end: reader.snapshot_end(), high }
                        }
                    };
                    any |= !part.changes.is_empty() || part.end != from || part.rollback.is_some();
                    self.handed.fetch_add(part.changes.len() as u64, Ordering::Relaxed);
                    fetched.insert(p, part);
                }
                if any || Instant::now() >= deadline {
                    return Ok(fetched);
                }
                let _ = tokio::time::timeout_at(deadline.into(), changed.changed()).await;
            }
        })
    }

    fn highs<'a>(&'a self, coll: &'a Collection) -> FetchFuture<'a, Vec<StreamPosition>> {
        Box::pin(async move {
            let source = self.source(coll)?;
            let mut at: Vec<StreamPosition> = (0..source.partition_count()).map(|p| source.position(p).unwrap_or_default()).collect();
            at[0].uuid = at[0].uuid.wrapping_add(self.skew.load(Ordering::Relaxed));
            Ok(at)
        })
    }
}

/// One life of an index node's manager fed from `fetcher`.
fn fed_life<F, Fut, T>(store: &Arc<Store>, fetcher: &Arc<StoreFetcher>, f: F) -> T
where
    F: FnOnce(Arc<IndexManager>) -> Fut,
    Fut: std::future::Future<Output = T>,
{
    let fetcher = Arc::clone(fetcher) as Arc<dyn ChangeFetcher>;
    life_of(store, move |s| IndexManager::open_fed(s, WORKERS, fetcher).unwrap(), f)
}

#[test]
fn an_index_node_follows_partitions_it_does_not_hold() {
    let (data_dir, index_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let data = open_store(data_dir.path());
    let docs = data.create_collection("c", 0).unwrap();
    fill(&docs);
    // The index node has the collection (every member has every collection) and none of
    // its documents.
    let node = open_store(index_dir.path());
    let here = node.create_collection("c", 0).unwrap();
    assert_eq!(here.info().docs, 0);
    let fetcher = Arc::new(StoreFetcher { data: Arc::clone(&data), handed: AtomicU64::new(0), skew: AtomicU64::new(0) });
    let def = IndexDef { partitions: Some(4), ..common::def("by_a", "a", false) };
    fed_life(&node, &fetcher, |mgr| {
        let (here, docs) = (Arc::clone(&here), Arc::clone(&docs));
        async move {
            mgr.create(&here, def).await.unwrap();
            assert_eq!(scan_ids(&mgr, &here, "by_a", json!(3)).await, expected_a3(), "built from the data node's streams");
            // Updates move entries, deletes remove them; request_plus sees each at once.
            put(&docs, "d003", json!({"a": 4, "b": "moved"}));
            put(&docs, "d100", json!({"a": 3, "b": "new"}));
            let mut want: Vec<String> = expected_a3().into_iter().filter(|k| k != "d003").collect();
            want.push("d100".into());
            assert_eq!(scan_ids(&mgr, &here, "by_a", json!(3)).await, want);
            let removed = shoal_storage::WriteRequest {
                key: bytes::Bytes::from_static(b"d008"),
                op: shoal_storage::WriteOp::Remove,
                value: None,
                cas: None,
                expiry: 0,
            };
            let _ = docs.write(removed).unwrap();
            want.retain(|k| k != "d008");
            assert_eq!(scan_ids(&mgr, &here, "by_a", json!(3)).await, want);
            let status = mgr.list(&here).remove(0);
            assert_eq!(status.items, DOCS as u64, "60 documents, one removed, one added");
            assert_eq!(status.state, shoal_index::IndexState::Ready);
        }
    });
    assert_eq!(here.info().docs, 0, "the index node holds no document");
    let handed = fetcher.handed.load(Ordering::Relaxed);
    assert_eq!(handed, DOCS as u64 + 3, "every change fetched once");
    // A restart goes on from the positions stored with the entries: nothing is read again.
    fed_life(&node, &fetcher, |mgr| {
        let (here, fetcher) = (Arc::clone(&here), Arc::clone(&fetcher));
        async move {
            let mut want: Vec<String> = expected_a3().into_iter().filter(|k| k != "d003" && k != "d008").collect();
            want.push("d100".into());
            assert_eq!(scan_ids(&mgr, &here, "by_a", json!(3)).await, want);
            // An active on another history than the index followed: request_plus waits (here
            // until its timeout) rather than answer from entries that history may not have.
            fetcher.skew.store(1, Ordering::Relaxed);
            let req = ScanRequest {
                bounds: ScanBounds::All,
                limit: 1000,
                descending: false,
                consistency: Consistency::RequestPlus,
                timeout: Duration::from_millis(300),
                keep: None,
                parts: None,
            };
            assert!(matches!(mgr.scan(&here, "by_a", req.clone()).await, Err(IndexError::Timeout)), "a seqno alone is not enough");
            fetcher.skew.store(0, Ordering::Relaxed);
            assert_eq!(mgr.scan(&here, "by_a", req).await.unwrap().len(), DOCS);
        }
    });
    assert_eq!(fetcher.handed.load(Ordering::Relaxed), handed, "nothing fetched again after the restart");
}
