//! A partition as a unit: export → ingest → catch-up against the source (the copy equals
//! the source at the export's position, then follows it while the source keeps writing),
//! replicated changes keep their seqno and CAS, states refuse what they must, and survive
//! a restart.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use proptest::prelude::*;
use shoal_storage::{
    Change, Collection, ExportHeader, PartitionError, PartitionState, ReadError, Store, StoreConfig, StreamPosition, WriteError, WriteOp,
    WriteRequest,
};

const PARTITIONS: u16 = 4;

fn open(dir: &std::path::Path) -> Arc<Store> {
    Store::open(StoreConfig { data_paths: vec![dir.to_path_buf()], partitions: Some(PARTITIONS), ..StoreConfig::default() }).unwrap()
}

#[derive(Clone, Debug)]
enum Op {
    Upsert { key: u8, value: u16, expires: bool },
    Remove { key: u8 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..60, any::<u16>(), any::<bool>()).prop_map(|(key, value, expires)| Op::Upsert { key, value, expires }),
        1 => (0u8..60).prop_map(|key| Op::Remove { key }),
    ]
}

fn run(coll: &Collection, ops: &[Op]) {
    for op in ops {
        let req = match op {
            Op::Upsert { key, value, expires } => WriteRequest {
                key: Bytes::from(format!("k{key}")),
                op: WriteOp::Upsert,
                value: Some(Bytes::from(format!("{{\"v\":{value}}}"))),
                cas: None,
                expiry: if *expires { u32::MAX - 1 } else { 0 },
            },
            Op::Remove { key } => {
                WriteRequest { key: Bytes::from(format!("k{key}")), op: WriteOp::Remove, value: None, cas: None, expiry: 0 }
            }
        };
        match coll.write(req) {
            Ok(_) | Err(WriteError::NotFound) => {}
            Err(e) => panic!("write: {e}"),
        }
    }
}

/// Every change of partition `p` after `from`, with documents.
fn changes_after(coll: &Collection, p: u16, from: StreamPosition) -> Vec<Change> {
    let (mut sub, rollback) = coll.subscribe(p, from).unwrap();
    assert_eq!(rollback, None, "the copy's position is on the source's history");
    let mut out = Vec::new();
    loop {
        let batch = sub.try_next(100, true).unwrap();
        if batch.is_empty() {
            return out;
        }
        out.extend(batch);
    }
}

/// What a partition holds, from its whole change stream: key → its latest change. (A
/// stream read from memory has every change, one from disk the latest of each key.)
fn state_of(coll: &Collection, p: u16) -> BTreeMap<Bytes, Change> {
    changes_after(coll, p, StreamPosition::default()).into_iter().map(|c| (c.key.clone(), c)).collect()
}

/// Catches `to`'s copy of `p` up from `from`'s change stream, starting at `pos`.
fn catch_up(from: &Collection, to: &Collection, p: u16, pos: StreamPosition) -> StreamPosition {
    let changes = changes_after(from, p, pos);
    if let Some(last) = changes.last() {
        for chunk in changes.chunks(37) {
            let _ = to.apply(p, chunk).unwrap();
        }
        return StreamPosition { seqno: last.seqno, uuid: pos.uuid };
    }
    pos
}

fn copy_store(src: &Store, dir: &std::path::Path) -> Arc<Store> {
    let dst = open(dir);
    for name in ["a", "b"] {
        let id = src.collection(name).unwrap().id();
        dst.create_collection_as(name, 0, Some(id)).unwrap();
    }
    dst
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn a_copy_equals_its_source_at_the_export_then_follows_it(
        before in prop::collection::vec(op(), 0..250),
        during in prop::collection::vec(op(), 0..250),
        after in prop::collection::vec(op(), 0..250),
        p in 0u16..PARTITIONS,
    ) {
        let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let src = open(d1.path());
        let (a, b) = (src.create_collection("a", 0).unwrap(), src.create_collection("b", 0).unwrap());
        let dst = copy_store(&src, d2.path());
        run(&a, &before);
        run(&b, &before[before.len() / 2..]);

        dst.drop_partition(p).unwrap();
        dst.set_partition_state(p, PartitionState::Pending).unwrap();
        let export = src.export_partition(p).unwrap();
        let header: ExportHeader = export.header().clone();
        let at_export = [state_of(&a, p), state_of(&b, p)];
        // The source goes on writing; the export is a snapshot and does not see it.
        run(&a, &during);
        run(&b, &during[..during.len() / 3]);
        let stats = dst.ingest_partition(&header, export).unwrap();
        prop_assert!(stats.records >= at_export.iter().map(|m| m.len() as u64).sum::<u64>());

        dst.set_partition_state(p, PartitionState::Replica).unwrap();
        let (da, db) = (dst.collection("a").unwrap(), dst.collection("b").unwrap());
        prop_assert_eq!(&state_of(&da, p), &at_export[0]);
        prop_assert_eq!(&state_of(&db, p), &at_export[1]);
        for (c, dc, exported) in [(&a, &da, &header.collections[0]), (&b, &db, &header.collections[1])] {
            prop_assert_eq!(dc.high_seqnos()[usize::from(p)], exported.seqno);
            prop_assert_eq!(dc.partition_uuids()[usize::from(p)], c.partition_uuids()[usize::from(p)], "the copy continues the source's history");
        }

        // Catch up, then keep following while the source writes.
        let mut pos = [header.collections[0].position(), header.collections[1].position()];
        for round in [&after[..after.len() / 2], &after[after.len() / 2..]] {
            pos[0] = catch_up(&a, &da, p, pos[0]);
            pos[1] = catch_up(&b, &db, p, pos[1]);
            prop_assert_eq!(state_of(&da, p), state_of(&a, p));
            prop_assert_eq!(state_of(&db, p), state_of(&b, p));
            prop_assert_eq!(da.high_seqnos()[usize::from(p)], a.high_seqnos()[usize::from(p)]);
            run(&a, round);
            run(&b, round);
        }
        pos[0] = catch_up(&a, &da, p, pos[0]);
        let _ = catch_up(&b, &db, p, pos[1]);

        // Promoted, the copy serves the same documents: bytes, CAS, seqno and expiry.
        dst.set_partition_state(p, PartitionState::Active).unwrap();
        for i in 0..60u8 {
            let key = format!("k{i}");
            if shoal_storage::partition_of(key.as_bytes(), PARTITIONS) != p {
                continue;
            }
            for (c, dc) in [(&a, &da), (&b, &db)] {
                match (c.get(&key), dc.get(&key)) {
                    (Ok(x), Ok(y)) => prop_assert_eq!((x.value, x.cas, x.seqno, x.expiry), (y.value, y.cas, y.seqno, y.expiry)),
                    (Err(ReadError::NotFound), Err(ReadError::NotFound)) => {}
                    (x, y) => prop_assert!(false, "{key}: source {x:?}, copy {y:?}"),
                }
            }
        }
        prop_assert_ne!(da.partition_uuids()[usize::from(p)], a.partition_uuids()[usize::from(p)], "a promoted copy starts a new history");
        // The other partitions of the copy were never touched.
        for q in (0..PARTITIONS).filter(|q| *q != p) {
            prop_assert_eq!(da.high_seqnos()[usize::from(q)], 0);
        }
    }
}

#[test]
fn states_refuse_what_they_must_and_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let put = |key: &str| WriteRequest {
        key: Bytes::from(key.to_string()),
        op: WriteOp::Upsert,
        value: Some(Bytes::from_static(b"1")),
        cas: None,
        expiry: 0,
    };
    // One key per partition.
    let keys: Vec<String> = (0..PARTITIONS)
        .map(|p| (0..).map(|i| format!("k{i}")).find(|k| shoal_storage::partition_of(k.as_bytes(), PARTITIONS) == p).unwrap())
        .collect();
    let states = [PartitionState::Active, PartitionState::Replica, PartitionState::Pending, PartitionState::Dead];
    {
        let store = open(dir.path());
        let c = store.create_collection("c", 0).unwrap();
        for key in &keys {
            let _ = c.write(put(key)).unwrap();
        }
        store.set_map_version(7);
        for (p, state) in states.iter().enumerate() {
            store.set_partition_state(p as u16, *state).unwrap();
        }
        let change = |seqno| Change {
            partition: 0,
            seqno,
            key: Bytes::from(keys[0].clone()),
            cas: 99,
            deleted: false,
            expiry: 0,
            value: Some(Bytes::from_static(b"2")),
        };
        for (p, state) in states.iter().enumerate() {
            let key = &keys[p];
            let (read, write) = (c.get(key), c.write(put(key)));
            let applied = c.apply(p as u16, &[Change { partition: p as u16, key: Bytes::from(key.clone()), ..change(100) }]);
            if *state == PartitionState::Active {
                assert!(read.is_ok() && write.is_ok(), "{state}");
                let Err(WriteError::NotMyPartition(n)) = applied else { panic!("an active copy takes no replicated change: {applied:?}") };
                assert_eq!((n.partition, n.state, n.map_version), (0, PartitionState::Active, 7));
            } else {
                let Err(ReadError::NotMyPartition(n)) = read else { panic!("{state}: a read answers {read:?}") };
                assert_eq!((n.partition, n.state, n.map_version), (p as u16, *state, 7));
                assert!(matches!(write, Err(WriteError::NotMyPartition(_))), "{state}: {write:?}");
                let stream = c.subscribe(p as u16, StreamPosition::default()).unwrap().0.try_next(10, false);
                assert_eq!(stream.is_ok(), *state == PartitionState::Replica, "{state}: the change stream {stream:?}");
                assert_eq!(
                    applied.is_ok(),
                    matches!(state, PartitionState::Replica | PartitionState::Pending),
                    "{state}: apply {applied:?}"
                );
            }
        }
        // A replicated change must move the seqno forward.
        let Err(WriteError::OutOfOrder { .. }) = c.apply(1, &[Change { partition: 1, key: Bytes::from(keys[1].clone()), ..change(3) }])
        else {
            panic!("a change behind the high seqno is refused")
        };
        store.close().unwrap();
    }
    let store = open(dir.path());
    let c = store.collection("c").unwrap();
    for (p, state) in states.iter().enumerate() {
        assert_eq!(store.partition_state(p as u16).unwrap(), *state);
    }
    assert_eq!(c.high_seqnos()[1], 100, "the replicated change survived with its seqno");
    store.set_partition_state(1, PartitionState::Active).unwrap();
    let doc = c.get(&keys[1]).unwrap();
    assert_eq!((doc.cas, doc.seqno, &doc.value[..]), (99, 100, &b"2"[..]));
}

#[test]
fn an_ingest_refuses_a_bad_copy_and_loads_nothing() {
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let src = open(d1.path());
    let a = src.create_collection("a", 0).unwrap();
    let _ = src.create_collection("b", 0).unwrap();
    run(&a, &(0..40).map(|key| Op::Upsert { key, value: 1, expires: false }).collect::<Vec<_>>());
    let dst = copy_store(&src, d2.path());
    let export = || src.export_partition(0).unwrap();
    let header = export().header().clone();
    let records: Vec<(Bytes, Bytes)> = export().map(Result::unwrap).collect();
    assert!(records.len() > 4);

    // Not pending: refused.
    assert!(matches!(dst.ingest_partition(&header, export()), Err(PartitionError::NotMine(_))));
    dst.drop_partition(0).unwrap();
    dst.set_partition_state(0, PartitionState::Pending).unwrap();
    let ok = |r: &[(Bytes, Bytes)]| r.iter().cloned().map(Ok).collect::<Vec<_>>();
    let mut swapped = records.clone();
    swapped.swap(1, 2);
    let mut bad_value = records.clone();
    bad_value[0].1 = Bytes::from_static(b"garbage");
    let mut unknown = header.clone();
    unknown.collections[0].id = 77;
    let mut out_of_order = header.clone();
    out_of_order.collections.reverse();
    for (what, h, recs) in [
        ("records out of order", &header, ok(&swapped)),
        ("a record that does not decode", &header, ok(&bad_value)),
        ("a collection this node lacks", &unknown, ok(&records)),
        ("the header out of id order", &out_of_order, ok(&records)),
    ] {
        let err = dst.ingest_partition(h, recs).expect_err(what);
        assert!(matches!(err, PartitionError::Malformed(_) | PartitionError::UnknownCollection(_)), "{what}: {err}");
    }
    // A failed ingest left nothing: a good one goes in.
    let stats = dst.ingest_partition(&header, ok(&records)).unwrap();
    assert_eq!(stats.records, records.len() as u64);
    // Not empty any more: refused.
    assert!(matches!(dst.ingest_partition(&header, ok(&records)), Err(PartitionError::NotEmpty(0))));
    dst.set_partition_state(0, PartitionState::Replica).unwrap();
    let mine = dst.collection("a").unwrap();
    assert_eq!(state_of(&mine, 0), state_of(&a, 0));
}

#[test]
fn a_backfill_is_consistent_only_at_its_snapshot_end_and_the_live_tail_at_every_change() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = open(dir.path());
        let c = store.create_collection("c", 0).unwrap();
        // 200 changes to 20 keys of partition 0.
        let keys: Vec<String> =
            (0..).map(|i| format!("k{i}")).filter(|k| shoal_storage::partition_of(k.as_bytes(), PARTITIONS) == 0).take(20).collect();
        for i in 0..200 {
            let req = WriteRequest {
                key: Bytes::from(keys[i % 20].clone()),
                op: WriteOp::Upsert,
                value: Some(Bytes::from(format!("{i}"))),
                cas: None,
                expiry: 0,
            };
            let _ = c.write(req).unwrap();
        }
        store.close().unwrap();
    }
    // After a restart the tail is empty: a read from 0 is a backfill from disk.
    let store = open(dir.path());
    let c = store.collection("c").unwrap();
    let (mut sub, _) = c.subscribe(0, StreamPosition::default()).unwrap();
    let first = sub.try_next(5, false).unwrap();
    assert_eq!(first.len(), 5);
    assert_eq!(sub.snapshot_end(), 200);
    assert!(!sub.consistent(), "five of twenty keys' latest changes are not a state the partition had");
    while !sub.try_next(5, false).unwrap().is_empty() {}
    assert!(sub.consistent());
    assert_eq!(sub.position().seqno, 200);
    // Live changes come from memory, each one a consistent step.
    for i in 0..3 {
        let key = (0..).map(|j| format!("n{j}")).find(|k| shoal_storage::partition_of(k.as_bytes(), PARTITIONS) == 0).unwrap();
        let _ = c
            .write(WriteRequest {
                key: Bytes::from(key),
                op: WriteOp::Upsert,
                value: Some(Bytes::from(format!("{i}"))),
                cas: None,
                expiry: 0,
            })
            .unwrap();
        assert_eq!(sub.try_next(1, false).unwrap().len(), 1);
        assert!(sub.consistent());
        assert_eq!(sub.snapshot_end(), 201 + i);
    }
}
