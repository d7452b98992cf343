//! Indexes fed from partitions another node holds (the index service): an index node's
//! manager follows a data node's change streams through a fetcher — here reading the other
//! store directly, in the cluster over the network — and answers scans exactly as an index
//! beside the documents would, at `request_plus`; after a restart it goes on from its
//! positions without reading anything again.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use shoal_index::{ChangeFetcher, Consistency, FetchFuture, IndexDef, IndexError, IndexManager, IndexState, ScanBounds, ScanRequest};
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
            mgr.create_as(&here, def.clone(), None, Some(every_part(&def))).await.unwrap();
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

/// A data node's store with [`fill`]'s documents, and two index nodes' stores with the
/// collection and no documents.
struct Nodes {
    _dirs: [tempfile::TempDir; 3],
    data: Arc<Store>,
    docs: Arc<Collection>,
    x: Arc<Store>,
    y: Arc<Store>,
    here_x: Arc<Collection>,
    here_y: Arc<Collection>,
}

fn two_index_nodes() -> Nodes {
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let data = open_store(dirs[0].path());
    let docs = data.create_collection("c", 0).unwrap();
    fill(&docs);
    let (x, y) = (open_store(dirs[1].path()), open_store(dirs[2].path()));
    let (here_x, here_y) = (x.create_collection("c", 0).unwrap(), y.create_collection("c", 0).unwrap());
    Nodes { _dirs: dirs, data, docs, x, y, here_x, here_y }
}

/// A fetcher over the data node's store.
fn fetcher(data: &Arc<Store>) -> Arc<StoreFetcher> {
    Arc::new(StoreFetcher { data: Arc::clone(data), handed: AtomicU64::new(0), skew: AtomicU64::new(0) })
}

/// An `eq` scan of `a` at `request_plus`.
fn eq(a: i64) -> ScanRequest {
    eq_request(json!(a))
}

/// The index the move tests move: 5 parts; `p` holds the entries of `a = 3`, `q` those of
/// `a = 1`.
fn moved_index() -> (IndexDef, u16, u16) {
    let def = IndexDef { partitions: Some(5), ..common::def("by_a", "a", false) };
    let part_of = |a: i64| shoal_index::partition::part_of_value(Some(&json!(a)), 5);
    let (p, q) = (part_of(3), part_of(1));
    assert_ne!(p, q, "the tests move two different parts");
    (def, p, q)
}

/// Index node x (`mx`) holds every part of `def`, built; node y opens its manager fed by
/// `fy` and holds none yet. Answers y's manager.
async fn all_on_x_none_on_y(
    mx: &Arc<IndexManager>,
    here_x: &Arc<Collection>,
    (y, fy, here_y): (&Arc<Store>, &Arc<StoreFetcher>, &Arc<Collection>),
    def: IndexDef,
) -> Arc<IndexManager> {
    mx.create_as(here_x, def.clone(), None, Some(every_part(&def))).await.unwrap();
    let my = IndexManager::open_fed(Arc::clone(y), WORKERS, Arc::clone(fy) as Arc<dyn ChangeFetcher>).unwrap();
    my.create_as(here_y, def, None, Some(Vec::new())).await.unwrap();
    assert_eq!(ids(mx.scan(here_x, "by_a", eq(3)).await.unwrap()), expected_a3());
    my
}

/// The document keys of scan rows, in order.
fn ids(rows: Vec<shoal_index::ScanRow>) -> Vec<String> {
    rows.into_iter().map(|r| r.id).collect()
}

/// A deferred placed index built through a node that holds none of its parts is ready
/// there (it has nothing to follow), not `building` for ever: the cluster test of
/// `_build` on later members (`tests/cluster_exact.rs`) waited on such a node in vain.
#[test]
fn a_build_on_a_node_holding_no_part_of_the_index_leaves_it_ready_there() {
    let Nodes { _dirs, data, x, here_x, .. } = two_index_nodes();
    let fx = fetcher(&data);
    fed_life(&x, &fx, |mx| async move {
        let def = IndexDef { defer_build: true, ..moved_index().0 };
        let created = mx.create_as(&here_x, def, None, Some(Vec::new())).await.unwrap();
        assert_eq!(created.state, IndexState::Deferred);
        let built = mx.build_many(&here_x, &["by_a".to_string()]).await.unwrap();
        assert_eq!(built.iter().map(|s| s.state).collect::<Vec<_>>(), vec![IndexState::Ready]);
        assert_eq!(mx.list(&here_x).iter().map(|s| s.state).collect::<Vec<_>>(), vec![IndexState::Ready]);
    });
}

/// Issue 41: an index partition moves between index nodes as its files. The receiver adopts
/// the source's snapshot whole and follows the change streams from the positions it
/// carries: it reads only the changes made since the snapshot, never the documents again,
/// and answers exactly. A part added empty instead is rebuilt from every change (the way
/// moves went before); a dropped part is refused, never read short.
#[test]
fn an_index_partition_moves_as_files_and_goes_on_from_the_positions_they_carry() {
    let Nodes { _dirs, data, docs, x, y, here_x, here_y } = two_index_nodes();
    let (fx, fy) = (fetcher(&data), fetcher(&data));
    let (def, p, q) = moved_index();
    fed_life(&x, &fx, |mx| {
        let (here_x, here_y, docs, y, fy) = (Arc::clone(&here_x), Arc::clone(&here_y), Arc::clone(&docs), Arc::clone(&y), Arc::clone(&fy));
        async move {
            let my = all_on_x_none_on_y(&mx, &here_x, (&y, &fy, &here_y), def).await;
            // The export is a snapshot; the changes after it reach the receiver by the stream.
            let files = mx.export_part(&here_x, "by_a", p).unwrap();
            let manifest = files.manifest().clone();
            assert!(manifest.file_bytes() + manifest.items > 0, "the part's entries travel: {manifest:?}");
            put(&docs, "d003", json!({"a": 4, "b": "moved out"}));
            put(&docs, "d100", json!({"a": 3, "b": "moved in"}));
            let (my2, here_y2) = (Arc::clone(&my), Arc::clone(&here_y));
            tokio::task::spawn_blocking(move || my2.import_part(&here_y2, "by_a", p, &manifest, files)).await.unwrap().unwrap();
            let mut want: Vec<String> = expected_a3().into_iter().filter(|k| k != "d003").collect();
            want.push("d100".into());
            assert_eq!(ids(my.scan(&here_y, "by_a", eq(3)).await.unwrap()), want, "adopted, then caught up");
            assert_eq!(fy.handed.load(Ordering::Relaxed), 2, "the receiver read the two changes since the snapshot, nothing else");
            // d003 left part p for the part of 4: the receiver looks in the adopted part for
            // a changed document's old entries (its located records do not name p yet), so
            // its old entry went.
            let refused = my.scan(&here_y, "by_a", eq(1)).await;
            assert!(matches!(refused, Err(IndexError::Unavailable(_))), "part q is not held yet: {refused:?}");
            // The other way: an empty part rebuilt from every change.
            let (my2, here_y2) = (Arc::clone(&my), Arc::clone(&here_y));
            tokio::task::spawn_blocking(move || my2.add_part(&here_y2, "by_a", q)).await.unwrap().unwrap();
            let want_1: Vec<String> = (0..DOCS).filter(|i| i % 5 == 1).map(|i| format!("d{i:03}")).collect();
            assert_eq!(ids(my.scan(&here_y, "by_a", eq(1)).await.unwrap()), want_1, "rebuilt from the streams");
            assert!(fy.handed.load(Ordering::Relaxed) >= DOCS as u64, "a rebuild reads every change again");
            my.wait_parts(&here_y, "by_a", &[p, q], WAIT).await.unwrap();
            // Dropped: refused, and the part's entries no longer count.
            my.drop_part(&here_y, "by_a", p).await.unwrap();
            let refused = my.scan(&here_y, "by_a", eq(3)).await;
            assert!(matches!(refused, Err(IndexError::Unavailable(_))), "{refused:?}");
            let status = my.list(&here_y).remove(0);
            assert_eq!(status.part_items.iter().map(|(no, _)| *no).collect::<Vec<_>>(), vec![q]);
            assert_eq!(status.items, want_1.len() as u64);
            my.stop().await;
            my.close().unwrap();
        }
    });
    // The parts held are kept across a restart.
    fed_life(&y, &fy, |my| {
        let here_y = Arc::clone(&here_y);
        async move {
            let status = my.list(&here_y).remove(0);
            assert_eq!(status.part_items.iter().map(|(no, _)| *no).collect::<Vec<_>>(), vec![q]);
        }
    });
}

/// Issue 41: the parts a rebalance moves from one node to another go as one group
/// (`export_parts` at one snapshot → `import_parts`, one commit): each answers exactly
/// once adopted, the changes since the snapshot caught up from the streams. A group cut
/// short — a part refused on the way — holds none of its parts.
#[test]
fn a_group_of_index_partitions_moves_as_one_and_is_held_whole_or_not_at_all() {
    let Nodes { _dirs, data, docs, x, y, here_x, here_y } = two_index_nodes();
    let (fx, fy) = (fetcher(&data), fetcher(&data));
    let (def, p, q) = moved_index();
    fed_life(&x, &fx, |mx| {
        let (here_x, here_y, docs, y, fy) = (Arc::clone(&here_x), Arc::clone(&here_y), Arc::clone(&docs), Arc::clone(&y), Arc::clone(&fy));
        async move {
            let my = all_on_x_none_on_y(&mx, &here_x, (&y, &fy, &here_y), def).await;
            let parts = vec![("by_a".to_string(), p), ("by_a".to_string(), q)];
            // A group whose second part is out of the index's range: nothing is held.
            let exports = mx.export_parts(&here_x, &parts).unwrap();
            let (my2, here) = (Arc::clone(&my), Arc::clone(&here_y));
            let cut = tokio::task::spawn_blocking(move || {
                let mut group = my2.import_parts(&here);
                let mut exports = exports.into_iter();
                let first = exports.next().unwrap();
                let manifest = first.manifest().clone();
                group.add("by_a", p, &manifest, first).unwrap();
                let second = exports.next().unwrap();
                let manifest = second.manifest().clone();
                group.add("by_a", 99, &manifest, second).map(|_| ())
            })
            .await
            .unwrap();
            assert!(matches!(cut, Err(IndexError::Invalid(_))), "{cut:?}");
            assert!(my.list(&here_y).remove(0).part_items.is_empty(), "a group not committed holds nothing");
            assert!(matches!(my.scan(&here_y, "by_a", eq(3)).await, Err(IndexError::Unavailable(_))));
            // The whole group, with changes made after its snapshot.
            let exports = mx.export_parts(&here_x, &parts).unwrap();
            put(&docs, "d100", json!({"a": 3, "b": "after the snapshot"}));
            put(&docs, "d101", json!({"a": 1, "b": "after the snapshot"}));
            let (my2, here) = (Arc::clone(&my), Arc::clone(&here_y));
            let held = tokio::task::spawn_blocking(move || {
                let mut group = my2.import_parts(&here);
                for ((name, no), files) in parts.iter().zip(exports) {
                    let manifest = files.manifest().clone();
                    group.add(name, *no, &manifest, files)?;
                }
                group.commit()
            })
            .await
            .unwrap()
            .unwrap();
            assert_eq!(held, 2);
            my.wait_parts(&here_y, "by_a", &[p, q], WAIT).await.unwrap();
            let mut want_3 = expected_a3();
            want_3.push("d100".into());
            let mut want_1: Vec<String> = (0..DOCS).filter(|i| i % 5 == 1).map(|i| format!("d{i:03}")).collect();
            want_1.push("d101".into());
            assert_eq!(ids(my.scan(&here_y, "by_a", eq(3)).await.unwrap()), want_3);
            assert_eq!(ids(my.scan(&here_y, "by_a", eq(1)).await.unwrap()), want_1);
            let status = my.list(&here_y).remove(0);
            assert_eq!(status.part_items.iter().map(|(no, _)| *no).collect::<Vec<_>>(), {
                let mut v = vec![p, q];
                v.sort_unstable();
                v
            });
            my.stop().await;
            my.close().unwrap();
        }
    });
}

/// A node about to adopt several parts makes their keyspaces first, as one group
/// (`prepare_parts`; a scale-out's new node adopts hundreds): a part adopted afterwards
/// goes into its prepared keyspace and answers exactly; parts of an index not known here,
/// out of range or held already are left out; and a prepared keyspace never adopted is
/// empty storage no index uses, which the next open removes.
#[test]
fn keyspaces_made_ahead_take_their_adoptions_and_the_unadopted_go_at_the_next_open() {
    let Nodes { _dirs, data, x, y, here_x, here_y, .. } = two_index_nodes();
    let (fx, fy) = (fetcher(&data), fetcher(&data));
    let (def, p, q) = moved_index();
    let dir = _dirs[2].path().join("data").join("index").join("keyspaces");
    let index_keyspaces = || std::fs::read_dir(&dir).unwrap().count();
    let (y2, fy2, here_y2) = (Arc::clone(&y), Arc::clone(&fy), Arc::clone(&here_y));
    let before = fed_life(&x, &fx, |mx| async move {
        let my = all_on_x_none_on_y(&mx, &here_x, (&y2, &fy2, &here_y2), def).await;
        let before = index_keyspaces();
        let asked = vec![("by_a".to_string(), p), ("by_a".to_string(), q), ("nope".to_string(), 0), ("by_a".to_string(), 99)];
        let (my2, here) = (Arc::clone(&my), Arc::clone(&here_y2));
        let made = tokio::task::spawn_blocking(move || my2.prepare_parts(&here, &asked)).await.unwrap().unwrap();
        assert_eq!(made, 2, "the two parts of the known index in its range");
        assert_eq!(index_keyspaces(), before + 2);
        let files = mx.export_part(&here_x, "by_a", p).unwrap();
        let manifest = files.manifest().clone();
        let (my2, here) = (Arc::clone(&my), Arc::clone(&here_y2));
        tokio::task::spawn_blocking(move || my2.import_part(&here, "by_a", p, &manifest, files)).await.unwrap().unwrap();
        assert_eq!(index_keyspaces(), before + 2, "adopted into the keyspace made for it");
        assert_eq!(ids(my.scan(&here_y2, "by_a", eq(3)).await.unwrap()), expected_a3());
        // Held now: asked again, it is left out.
        let (my2, here) = (Arc::clone(&my), Arc::clone(&here_y2));
        let again = tokio::task::spawn_blocking(move || my2.prepare_parts(&here, &[("by_a".to_string(), p)])).await.unwrap().unwrap();
        assert_eq!(again, 0);
        my.stop().await;
        my.close().unwrap();
        before
    });
    fed_life(&y, &fy, |my| {
        let here_y = Arc::clone(&here_y);
        async move {
            let status = my.list(&here_y).remove(0);
            assert_eq!(status.part_items.iter().map(|(no, _)| *no).collect::<Vec<_>>(), vec![p]);
            assert_eq!(ids(my.scan(&here_y, "by_a", eq(3)).await.unwrap()), expected_a3());
        }
    });
    assert_eq!(index_keyspaces(), before + 1, "the keyspace made for part {q} and never adopted is gone");
}

/// A node holding one part of an index follows every document but records where entries
/// lie only for the parts it holds: a document whose entries move out of the part, in again
/// from a part held elsewhere, and out again leaves exactly the part's entries at each
/// step, and after a restart.
#[test]
fn entries_moving_between_a_part_held_here_and_parts_held_elsewhere_stay_exact() {
    let Nodes { _dirs, data, docs, x: _, y, here_x: _, here_y } = two_index_nodes();
    let fy = fetcher(&data);
    let (def, p, _) = moved_index();
    let want = |extra: &[&str], gone: &[&str]| {
        let mut w: Vec<String> = expected_a3().into_iter().filter(|k| !gone.contains(&k.as_str())).collect();
        w.extend(extra.iter().map(|k| k.to_string()));
        w.sort();
        w
    };
    fed_life(&y, &fy, |my| {
        let (here_y, docs) = (Arc::clone(&here_y), Arc::clone(&docs));
        async move {
            my.create_as(&here_y, def, None, Some(vec![p])).await.unwrap();
            assert_eq!(ids(my.scan(&here_y, "by_a", eq(3)).await.unwrap()), want(&[], &[]));
            // Out of part p into part q, which is not held here.
            put(&docs, "d003", json!({"a": 1, "b": "out"}));
            assert_eq!(ids(my.scan(&here_y, "by_a", eq(3)).await.unwrap()), want(&[], &["d003"]));
            // In from q, for a document that never had an entry here, and for one back.
            put(&docs, "d001", json!({"a": 3, "b": "in"}));
            put(&docs, "d003", json!({"a": 3, "b": "back"}));
            assert_eq!(ids(my.scan(&here_y, "by_a", eq(3)).await.unwrap()), want(&["d001"], &[]));
            // Out again, both in one round.
            put(&docs, "d001", json!({"a": 1, "b": "out again"}));
            put(&docs, "d003", json!({"a": 4, "b": "out again"}));
            assert_eq!(ids(my.scan(&here_y, "by_a", eq(3)).await.unwrap()), want(&[], &["d003"]));
            let refused = my.scan(&here_y, "by_a", eq(1)).await;
            assert!(matches!(refused, Err(IndexError::Unavailable(_))), "part q is held elsewhere: {refused:?}");
            // Part p holds the entries of every value hashed to it, `a = 3` among them.
            let in_p = |a: i64| shoal_index::partition::part_of_value(Some(&json!(a)), 5) == p;
            let held = (0..DOCS as i64).filter(|&i| in_p(if i == 3 { 4 } else { i % 5 })).count();
            assert_eq!(my.list(&here_y).remove(0).items, held as u64, "only part p's entries are counted here");
        }
    });
    fed_life(&y, &fy, |my| {
        let (here_y, docs) = (Arc::clone(&here_y), Arc::clone(&docs));
        async move {
            put(&docs, "d003", json!({"a": 3, "b": "after the restart"}));
            put(&docs, "d008", json!({"a": 1, "b": "after the restart"}));
            assert_eq!(ids(my.scan(&here_y, "by_a", eq(3)).await.unwrap()), want(&[], &["d008"]));
        }
    });
}

/// Parts adopted on both sides of a hand-over: the first follows the streams onto the new
/// actives' histories (the same seqnos under new uuids) while the second arrives with the
/// old ones. The streams are then followed from the old positions, which moves every part
/// onto the new histories: a `request_plus` scan of both answers with no write needed to
/// get there. (Before, the part adopted later stayed on the old histories at the actives'
/// seqnos, and every `request_plus` of it waited out its timeout.)
#[test]
fn parts_adopted_across_a_hand_over_all_move_onto_the_new_histories() {
    let Nodes { _dirs, data, docs: _, x, y, here_x, here_y } = two_index_nodes();
    let (fx, fy) = (fetcher(&data), fetcher(&data));
    let (def, p, q) = moved_index();
    fed_life(&x, &fx, |mx| {
        let (here_x, here_y, data, y, fy) = (Arc::clone(&here_x), Arc::clone(&here_y), Arc::clone(&data), Arc::clone(&y), Arc::clone(&fy));
        async move {
            let my = all_on_x_none_on_y(&mx, &here_x, (&y, &fy, &here_y), def).await;
            // Both snapshots are taken before the hand-over.
            let files_p = mx.export_part(&here_x, "by_a", p).unwrap();
            let files_q = mx.export_part(&here_x, "by_a", q).unwrap();
            let adopt = |no: u16, files: shoal_storage::KeyspaceFiles| {
                let (my, here_y) = (Arc::clone(&my), Arc::clone(&here_y));
                async move {
                    let manifest = files.manifest().clone();
                    tokio::task::spawn_blocking(move || my.import_part(&here_y, "by_a", no, &manifest, files)).await.unwrap().unwrap();
                }
            };
            adopt(q, files_q).await;
            my.wait_parts(&here_y, "by_a", &[q], WAIT).await.unwrap();
            // A hand-over of every partition: each goes on at its seqno under a new history.
            let before: Vec<StreamPosition> = (0..data.partitions()).map(|n| data_position(&data, n)).collect();
            for n in 0..data.partitions() {
                data.set_partition_state(n, shoal_storage::PartitionState::Replica).unwrap();
                data.set_partition_state(n, shoal_storage::PartitionState::Active).unwrap();
            }
            let after: Vec<StreamPosition> = (0..data.partitions()).map(|n| data_position(&data, n)).collect();
            assert!(before.iter().zip(&after).all(|(b, a)| b.seqno == a.seqno && b.uuid != a.uuid), "new histories at the same seqnos");
            // The part held follows onto them; the part adopted now comes with the old ones.
            my.wait_parts(&here_y, "by_a", &[q], WAIT).await.unwrap();
            adopt(p, files_p).await;
            my.wait_parts(&here_y, "by_a", &[p, q], WAIT).await.unwrap();
            assert_eq!(ids(my.scan(&here_y, "by_a", eq(3)).await.unwrap()), expected_a3());
            let want_1: Vec<String> = (0..DOCS).filter(|i| i % 5 == 1).map(|i| format!("d{i:03}")).collect();
            assert_eq!(ids(my.scan(&here_y, "by_a", eq(1)).await.unwrap()), want_1);
            my.stop().await;
            my.close().unwrap();
        }
    });
}

/// Partition `n`'s position in the data node's collection `c`.
fn data_position(data: &Store, n: PartitionId) -> StreamPosition {
    data.collection("c").and_then(|c| c.position(n)).unwrap_or_default()
}

/// A fetcher whose answers wait at a gate while it is shut (those carrying changes), so
/// that a test can change the index between a round's fetch and its apply.
struct GatedFetcher {
    inner: Arc<StoreFetcher>,
    open: tokio::sync::watch::Sender<bool>,
    /// A fetch with changes is waiting at the gate.
    parked: std::sync::atomic::AtomicBool,
}

impl ChangeFetcher for GatedFetcher {
    fn fetch<'a>(&'a self, coll: &'a Collection, asks: Vec<(PartitionId, StreamPosition)>, wait: Duration) -> FetchFuture<'a, Fetched> {
        Box::pin(async move {
            let fetched = self.inner.fetch(coll, asks, wait).await?;
            let changes = fetched.changes() > 0;
            let mut open = self.open.subscribe();
            if changes && !*open.borrow() {
                self.parked.store(true, Ordering::SeqCst);
                let _ = open.wait_for(|o| *o).await;
            }
            Ok(fetched)
        })
    }

    fn highs<'a>(&'a self, coll: &'a Collection) -> FetchFuture<'a, Vec<StreamPosition>> {
        self.inner.highs(coll)
    }
}

/// A part adopted while a round has fetched changes from later positions than the part's
/// own: the round's fetch no longer answers the indexes' position (`Fetched` hands changes
/// only to a consumer still where they were fetched from), so nothing of it is applied and
/// the next round feeds every part from the adopted part's position — the adopted part
/// misses none of the changes between its snapshot and the round.
#[test]
fn a_part_adopted_while_a_round_is_in_flight_misses_no_change() {
    let Nodes { _dirs, data, docs, x, y, here_x, here_y } = two_index_nodes();
    let fx = fetcher(&data);
    let gated = Arc::new(GatedFetcher { inner: fetcher(&data), open: tokio::sync::watch::Sender::new(true), parked: false.into() });
    let def = IndexDef { partitions: Some(5), ..common::def("by_a", "a", false) };
    let part_of = |a: i64| shoal_index::partition::part_of_value(Some(&json!(a)), 5);
    let (p, q) = (part_of(3), part_of(1));
    // A second document in the partition of the one that moves into part p.
    let partition = shoal_storage::partition_of(b"d200", 4);
    let other = (0..).map(|n| format!("e{n}")).find(|k| shoal_storage::partition_of(k.as_bytes(), 4) == partition).unwrap();
    fed_life(&x, &fx, |mx| {
        let (here_x, here_y, docs, y, gated) =
            (Arc::clone(&here_x), Arc::clone(&here_y), Arc::clone(&docs), Arc::clone(&y), Arc::clone(&gated));
        async move {
            mx.create_as(&here_x, def.clone(), None, Some(every_part(&def))).await.unwrap();
            let my = IndexManager::open_fed(Arc::clone(&y), WORKERS, Arc::clone(&gated) as Arc<dyn ChangeFetcher>).unwrap();
            my.create_as(&here_y, def, None, Some(vec![q])).await.unwrap();
            assert_eq!(ids(mx.scan(&here_x, "by_a", eq(3)).await.unwrap()), expected_a3());
            // The export's snapshot; then a document moves into part p, and the receiver
            // (holding part q only) follows past it.
            let files = mx.export_part(&here_x, "by_a", p).unwrap();
            let manifest = files.manifest().clone();
            put(&docs, "d200", json!({"a": 3, "b": "into p"}));
            my.wait_parts(&here_y, "by_a", &[q], WAIT).await.unwrap();
            // The receiver's next round fetches a later change of that partition, and waits
            // at the gate while part p is adopted at the snapshot's positions.
            gated.open.send_replace(false);
            put(&docs, &other, json!({"a": 4, "b": "later"}));
            let deadline = std::time::Instant::now() + WAIT;
            while !gated.parked.load(Ordering::SeqCst) {
                assert!(std::time::Instant::now() < deadline, "the round never fetched the later change");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let (my2, here_y2) = (Arc::clone(&my), Arc::clone(&here_y));
            tokio::task::spawn_blocking(move || my2.import_part(&here_y2, "by_a", p, &manifest, files)).await.unwrap().unwrap();
            gated.open.send_replace(true);
            let mut want = expected_a3();
            want.push("d200".into());
            want.sort();
            let mut got = ids(my.scan(&here_y, "by_a", eq(3)).await.unwrap());
            got.sort();
            assert_eq!(got, want, "the adopted part has the change made between its snapshot and the round");
            // A part added empty is rebuilt from the streams: until it has caught up, a
            // not_bounded scan of it is refused (never a half-built answer), a request_plus
            // one waits for it.
            let r = part_of(2);
            gated.open.send_replace(false);
            gated.parked.store(false, Ordering::SeqCst);
            let (my2, here_y2) = (Arc::clone(&my), Arc::clone(&here_y));
            tokio::task::spawn_blocking(move || my2.add_part(&here_y2, "by_a", r)).await.unwrap().unwrap();
            let not_bounded = ScanRequest { consistency: Consistency::NotBounded, ..eq(2) };
            let refused = my.scan(&here_y, "by_a", not_bounded.clone()).await;
            assert!(matches!(refused, Err(IndexError::NotReady { .. })), "{refused:?}");
            gated.open.send_replace(true);
            let want_2: Vec<String> = (0..DOCS).filter(|i| i % 5 == 2).map(|i| format!("d{i:03}")).collect();
            assert_eq!(ids(my.scan(&here_y, "by_a", eq(2)).await.unwrap()), want_2);
            let deadline = std::time::Instant::now() + WAIT;
            loop {
                match my.scan(&here_y, "by_a", not_bounded.clone()).await {
                    Ok(rows) => break assert_eq!(ids(rows), want_2, "served once caught up"),
                    Err(IndexError::NotReady { .. }) if std::time::Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(20)).await
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            my.stop().await;
            my.close().unwrap();
        }
    });
}

/// Every part of an index: what a node holding all of a placed index's partitions holds (a
/// placed index is fed from the actives; one not placed follows this node's partitions).
fn every_part(def: &IndexDef) -> Vec<u16> {
    (0..def.part_count()).collect()
}

/// Parts adopted as files are not in the receiver's `located` records at once: every change
/// looks in them for the document's old entries until the records learn them (once an index
/// has `LOCATE_PARTS_MIN`, 3, such parts on the node). Documents moved out of, into and
/// between adopted parts, and documents never changed since their part came, leave exactly
/// the model's entries at each step: with one and two such parts, across a restart (the
/// catalog keeps which parts the records may not name), and after the third adoption had
/// the records learn them all.
#[test]
fn documents_of_parts_adopted_as_files_keep_exact_entries_before_and_after_the_records_learn_them() {
    let Nodes { _dirs, data, docs, x, y, here_x, here_y } = two_index_nodes();
    let (fx, fy) = (fetcher(&data), fetcher(&data));
    let (def, _, _) = moved_index();
    let part_of = |a: i64| shoal_index::partition::part_of_value(Some(&json!(a)), 5);
    // Values whose parts are adopted in this order, one new part each.
    let mut order: Vec<i64> = Vec::new();
    for a in [3, 1, 4, 0, 2] {
        if order.iter().all(|&b| part_of(b) != part_of(a)) {
            order.push(a);
        }
    }
    assert!(order.len() >= 3, "the test adopts three different parts: {order:?}");
    let model: BTreeMap<String, i64> = (0..DOCS).map(|i| (format!("d{i:03}"), (i % 5) as i64)).collect();
    let model = Arc::new(parking_lot::Mutex::new(model));
    // Writes a document and the model.
    let set = {
        let (docs, model) = (Arc::clone(&docs), Arc::clone(&model));
        move |key: &str, a: i64| {
            put(&docs, key, json!({"a": a, "b": "changed"}));
            model.lock().insert(key.to_string(), a);
        }
    };
    // Every value whose part y holds scans exactly the model's documents.
    let check = {
        let (model, here_y) = (Arc::clone(&model), Arc::clone(&here_y));
        move |my: Arc<IndexManager>, held: Vec<u16>, step: &'static str| {
            let (model, here_y) = (Arc::clone(&model), Arc::clone(&here_y));
            async move {
                for a in 0..5i64 {
                    if !held.contains(&part_of(a)) {
                        continue;
                    }
                    let want: Vec<String> = model.lock().iter().filter(|(_, v)| **v == a).map(|(k, _)| k.clone()).collect();
                    assert_eq!(ids(my.scan(&here_y, "by_a", eq(a)).await.unwrap()), want, "a = {a}, {step}");
                }
            }
        }
    };
    let adopt = |mx: Arc<IndexManager>, my: Arc<IndexManager>, no: u16| {
        let (here_x, here_y) = (Arc::clone(&here_x), Arc::clone(&here_y));
        async move {
            let files = mx.export_part(&here_x, "by_a", no).unwrap();
            let manifest = files.manifest().clone();
            tokio::task::spawn_blocking(move || my.import_part(&here_y, "by_a", no, &manifest, files)).await.unwrap().unwrap();
        }
    };
    let reopen = |my: Arc<IndexManager>| {
        let (y, fy) = (Arc::clone(&y), Arc::clone(&fy));
        async move {
            my.stop().await;
            my.close().unwrap();
            drop(my);
            IndexManager::open_fed(y, WORKERS, fy as Arc<dyn ChangeFetcher>).unwrap()
        }
    };
    let (here_x2, here_y2, y2, fy2) = (Arc::clone(&here_x), Arc::clone(&here_y), Arc::clone(&y), Arc::clone(&fy));
    fed_life(&x, &fx, |mx| async move {
        let my = all_on_x_none_on_y(&mx, &here_x2, (&y2, &fy2, &here_y2), def).await;
        let mut held = vec![part_of(order[0])];
        adopt(Arc::clone(&mx), Arc::clone(&my), held[0]).await;
        check(Arc::clone(&my), held.clone(), "one part adopted").await;
        set("d003", 4); // out of the adopted part (to one held elsewhere, or the same)
        set("d008", order[0]); // within it
        set("d000", order[0]); // into it
        check(Arc::clone(&my), held.clone(), "changes after one part adopted").await;
        held.push(part_of(order[1]));
        adopt(Arc::clone(&mx), Arc::clone(&my), held[1]).await;
        set("d013", order[1]); // between the two adopted parts, never changed before
        set(&format!("d{:03}", order[1] + 10), order[0]); // and back the other way
        check(Arc::clone(&my), held.clone(), "two parts adopted").await;
        // A restart keeps which parts the records may not name.
        let my = reopen(my).await;
        set("d018", order[1]); // never changed before
        set(&format!("d{:03}", order[1] + 20), 2); // out, never changed before
        check(Arc::clone(&my), held.clone(), "two parts adopted, restarted").await;
        // The third adopted part: the records learn all three.
        held.push(part_of(order[2]));
        adopt(Arc::clone(&mx), Arc::clone(&my), held[2]).await;
        check(Arc::clone(&my), held.clone(), "three parts adopted").await;
        set("d023", order[2]); // never changed before, first part to third
        set(&format!("d{:03}", order[2] + 30), order[1]); // third to second
        set(&format!("d{:03}", order[1] + 30), 2); // second out
        check(Arc::clone(&my), held.clone(), "three parts adopted, records learnt").await;
        let my = reopen(my).await;
        set("d028", order[1]);
        set(&format!("d{:03}", order[2] + 40), order[0]);
        check(Arc::clone(&my), held.clone(), "three parts adopted, restarted").await;
        my.stop().await;
        my.close().unwrap();
    });
}

/// A wait for a part that is dropped here while it waits (the placement moved the part
/// away, a stopped rebalance's copy is dropped) ends at once with `Unavailable`, not at its
/// timeout: the part will not catch up here, and the adoption or the scan waiting on it
/// hears so. Before, both went on as if it had caught up: the wait answered `Ok`, and the
/// scan answered without the part's rows.
#[test]
fn a_wait_for_a_part_dropped_meanwhile_ends_at_once() {
    let nodes = two_index_nodes();
    let fx = fetcher(&nodes.data);
    let def = IndexDef { partitions: Some(4), ..common::def("by_a", "a", false) };
    fed_life(&nodes.x, &fx, |mgr| {
        let (here, fx) = (Arc::clone(&nodes.here_x), Arc::clone(&fx));
        async move {
            mgr.create_as(&here, def.clone(), None, Some(every_part(&def))).await.unwrap();
            mgr.wait_parts(&here, "by_a", &[0, 1, 2, 3], Duration::from_secs(60)).await.unwrap();
            // The part holding the entries of `a = 3`, and one other.
            let part = shoal_index::partition::part_of_value(Some(&json!(3)), 4);
            let other = (part + 1) % 4;
            assert_eq!(ids(mgr.scan(&here, "by_a", eq(3)).await.unwrap()), expected_a3());
            // The actives now answer from another history than the index followed: a wait
            // at request_plus cannot be satisfied, and would last its whole timeout.
            fx.skew.store(1, Ordering::Relaxed);
            let waiting = {
                let (mgr, here) = (Arc::clone(&mgr), Arc::clone(&here));
                tokio::spawn(async move { mgr.wait_parts(&here, "by_a", &[part], Duration::from_secs(600)).await })
            };
            // And a scan at request_plus of a value whose entries are in that part.
            let scanning = {
                let (mgr, here) = (Arc::clone(&mgr), Arc::clone(&here));
                let req = ScanRequest { timeout: Duration::from_secs(600), ..eq(3) };
                tokio::spawn(async move { mgr.scan(&here, "by_a", req).await })
            };
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert!(!waiting.is_finished() && !scanning.is_finished(), "the wait and the scan wait");
            mgr.drop_part(&here, "by_a", part).await.unwrap();
            // A liveness bound, far under their own 600 s.
            let ended =
                tokio::time::timeout(Duration::from_secs(60), waiting).await.expect("the wait ends once its part is dropped").unwrap();
            assert!(matches!(ended, Err(IndexError::Unavailable(_))), "{ended:?}");
            let scanned = tokio::time::timeout(Duration::from_secs(60), scanning).await.expect("the scan ends too").unwrap();
            assert!(matches!(scanned, Err(IndexError::Unavailable(_))), "never a short answer: {scanned:?}");
            fx.skew.store(0, Ordering::Relaxed);
            // The parts still held answer as before.
            mgr.wait_parts(&here, "by_a", &[other], Duration::from_secs(60)).await.unwrap();
        }
    });
}
