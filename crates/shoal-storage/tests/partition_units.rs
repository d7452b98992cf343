//! A partition as a unit: export → ingest (as records or as files) → catch-up against the source (the copy equals
//! the source at the export's position, then follows it while the source keeps writing),
//! replicated changes keep their seqno and CAS, states refuse what they must, and survive
//! a restart.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use proptest::prelude::*;
use shoal_storage::{
    rollback_seqno, Change, Collection, ExportHeader, PartitionError, PartitionState, ReadError, Store, StoreConfig, StreamPosition,
    WriteError, WriteOp, WriteRequest,
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

/// An upsert of `key` with the value `1`.
fn put(key: &str) -> WriteRequest {
    WriteRequest { key: Bytes::from(key.to_string()), op: WriteOp::Upsert, value: Some(Bytes::from_static(b"1")), cas: None, expiry: 0 }
}

/// The first `n` keys `{prefix}0`, `{prefix}1`, … that fall in partition `p`.
fn keys_in(p: u16, prefix: &str, n: usize) -> Vec<String> {
    (0..).map(|i| format!("{prefix}{i}")).filter(|k| shoal_storage::partition_of(k.as_bytes(), PARTITIONS) == p).take(n).collect()
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..60, any::<u16>(), any::<bool>()).prop_map(|(key, value, expires)| Op::Upsert { key, value, expires }),
        1 => (0u8..60).prop_map(|key| Op::Remove { key }),
    ]
}

/// Runs the ops whose key is in partition `p` only.
fn run_in(coll: &Collection, ops: &[Op], p: u16) {
    let key = |op: &Op| match op {
        Op::Upsert { key, .. } | Op::Remove { key } => format!("k{key}"),
    };
    let mine: Vec<Op> = ops.iter().filter(|op| shoal_storage::partition_of(key(op).as_bytes(), PARTITIONS) == p).cloned().collect();
    run(coll, &mine);
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

/// Makes `dst`'s copy of partition `p` a replica of `src`'s, from an export: both
/// collections, on the source's history, at the export's positions.
fn replicate(src: &Store, dst: &Store, p: u16) -> ExportHeader {
    dst.drop_partition(p).unwrap();
    dst.set_partition_state(p, PartitionState::Pending).unwrap();
    let export = src.export_partition(p).unwrap();
    let header = export.header().clone();
    dst.ingest_partition(&header, export).unwrap();
    dst.set_partition_state(p, PartitionState::Replica).unwrap();
    header
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    /// A failover: source A writes, replica R follows it to its high seqno h, replica S only
    /// to s < h; S becomes active (a new history), A writes more and is lost (R follows that
    /// too). R computes its rollback point from the failover logs, rolls back, restores the
    /// keys it removed from S's current versions, takes S's history and follows S while S
    /// writes. At the end R holds exactly what S holds: per key (live or deleted, as S's
    /// stream shows it) the same seqno, CAS, expiry and document, and the same high seqno.
    #[test]
    fn a_replica_of_a_source_that_rolls_back_ends_equal_to_the_new_active(
        before in prop::collection::vec(op(), 0..120),
        followed in prop::collection::vec(op(), 1..200),
        s_share in 0.0f64..1.0,
        lost in prop::collection::vec(op(), 0..120),
        new_writes in prop::collection::vec(op(), 0..200),
        p in 0u16..PARTITIONS,
    ) {
        let (da, dr, ds) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let a_store = open(da.path());
        let a = a_store.create_collection("a", 0).unwrap();
        let _ = a_store.create_collection("b", 0).unwrap();
        let (r_store, s_store) = (copy_store(&a_store, dr.path()), copy_store(&a_store, ds.path()));
        run(&a, &before);
        let header = replicate(&a_store, &r_store, p);
        let _ = replicate(&a_store, &s_store, p);
        let (r, s) = (r_store.collection("a").unwrap(), s_store.collection("a").unwrap());
        let start = header.collections[0].position();

        // A writes; R follows all of it, S a prefix of it.
        run(&a, &followed);
        let from_a = changes_after(&a, p, start);
        for chunk in from_a.chunks(37) {
            let _ = r.apply(p, chunk).unwrap();
        }
        let s_len = ((from_a.len() as f64) * s_share) as usize;
        for chunk in from_a[..s_len].chunks(37) {
            let _ = s.apply(p, chunk).unwrap();
        }
        let s_high = s.high_seqnos()[usize::from(p)];
        prop_assert_eq!(s_high, from_a[..s_len].last().map_or(start.seqno, |c| c.seqno));

        // S is promoted; A writes on and fails, and R took that too.
        s_store.set_partition_state(p, PartitionState::Active).unwrap();
        let r_pos = StreamPosition { seqno: r.high_seqnos()[usize::from(p)], uuid: start.uuid };
        run(&a, &lost);
        let more = changes_after(&a, p, r_pos);
        for chunk in more.chunks(37) {
            let _ = r.apply(p, chunk).unwrap();
        }
        drop(a);
        drop(a_store);
        // (Only partition p: the stores' other partitions are not replicas of each other.)
        run_in(&s, &new_writes[..new_writes.len() / 3], p);

        // R's rollback decision from the two failover logs.
        let r_high = r.high_seqnos()[usize::from(p)];
        let decision = rollback_seqno(&r.failover_log(p), &s.failover_log(p), r_high);
        prop_assert_eq!(decision, (s_high < r_high).then_some(s_high));
        if let Some(to) = decision {
            let report = r_store.rollback_partition(&r, p, to).unwrap();
            prop_assert_eq!(report.seqno, to);
            prop_assert_eq!(r.high_seqnos()[usize::from(p)], to);
            prop_assert!(state_of(&r, p).values().all(|c| c.seqno <= to), "nothing above the rollback point is left");
            // A repeated rollback does nothing.
            prop_assert_eq!(r_store.rollback_partition(&r, p, to).unwrap().removed.len(), 0);
            // The removed keys, from S as it is now (live or deleted).
            let s_now = state_of(&s, p);
            let fetched: Vec<Change> = report.removed.iter().filter_map(|k| s_now.get(k).cloned()).collect();
            let written = r.restore(p, &fetched).unwrap();
            prop_assert!(written <= fetched.len());
            prop_assert_eq!(r.restore(p, &fetched).unwrap(), 0, "a repeated restore writes nothing");
            prop_assert_eq!(r.high_seqnos()[usize::from(p)], to, "a restore does not move the high seqno");
        }
        prop_assert_eq!(rollback_seqno(&r.failover_log(p), &s.failover_log(p), r.high_seqnos()[usize::from(p)]), None);
        r_store.adopt_history(&r, p, &s.failover_log(p)).unwrap();
        prop_assert_eq!(r.failover_log(p), s.failover_log(p));

        // R follows S while S writes.
        let mut pos = StreamPosition { seqno: r.high_seqnos()[usize::from(p)], uuid: s.partition_uuids()[usize::from(p)] };
        pos = catch_up(&s, &r, p, pos);
        run_in(&s, &new_writes[new_writes.len() / 3..], p);
        let _ = catch_up(&s, &r, p, pos);
        prop_assert_eq!(r.high_seqnos()[usize::from(p)], s.high_seqnos()[usize::from(p)]);
        prop_assert_eq!(state_of(&r, p), state_of(&s, p));
        prop_assert_eq!(r.info().docs, s.info().docs, "the document counts follow the rollback and the restore");
    }

    #[test]
    fn a_copy_equals_its_source_at_the_export_then_follows_it(
        before in prop::collection::vec(op(), 0..250),
        during in prop::collection::vec(op(), 0..250),
        after in prop::collection::vec(op(), 0..250),
        p in 0u16..PARTITIONS,
        files in any::<bool>(),
    ) {
        let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let src = open(d1.path());
        let (a, b) = (src.create_collection("a", 0).unwrap(), src.create_collection("b", 0).unwrap());
        let dst = copy_store(&src, d2.path());
        run(&a, &before);
        run(&b, &before[before.len() / 2..]);

        dst.drop_partition(p).unwrap();
        dst.set_partition_state(p, PartitionState::Pending).unwrap();
        // Records, or the keyspace's files (`crate::files`): either copy must do.
        let (header, export) = if files {
            // With the memtable flushed first (its items inside a file) or not.
            if before.len() % 2 == 0 {
                let _ = src.partition_files_flushed(p).unwrap();
            }
            let export = src.export_partition_files(p).unwrap();
            (export.header().clone(), Err(export))
        } else {
            let export = src.export_partition(p).unwrap();
            (export.header().clone(), Ok(export))
        };
        let at_export = [state_of(&a, p), state_of(&b, p)];
        // The source goes on writing; the export is a snapshot and does not see it.
        run(&a, &during);
        run(&b, &during[..during.len() / 3]);
        match export {
            Ok(records) => {
                let stats = dst.ingest_partition(&header, records).unwrap();
                prop_assert!(stats.records >= at_export.iter().map(|m| m.len() as u64).sum::<u64>());
            }
            Err(files) => {
                let manifest = files.manifest().clone();
                let _ = dst.import_partition_files(&header, &manifest, files).unwrap();
            }
        }

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

/// Several partitions change state in one durable batch: those that become active each
/// start a new history at their high seqno, the others only change state, and all of it
/// survives a restart.
#[test]
fn many_partitions_change_state_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<String> = (0..PARTITIONS).map(|p| keys_in(p, "k", 1).remove(0)).collect();
    let (uuids, logs) = {
        let store = open(dir.path());
        let c = store.create_collection("c", 0).unwrap();
        for key in &keys {
            let _ = c.write(put(key)).unwrap();
        }
        for p in 0..4u16 {
            store.set_partition_state(p, PartitionState::Replica).unwrap();
        }
        let before: Vec<u64> = c.positions().iter().map(|pos| pos.uuid).collect();
        let logs_before: Vec<usize> = (0..4u16).map(|p| c.failover_log(p).len()).collect();
        // 0 and 2 become active, 1 stays a replica, 3 is dead; listed out of order, 2 twice.
        let changes = [
            (2, PartitionState::Active),
            (0, PartitionState::Active),
            (1, PartitionState::Replica),
            (3, PartitionState::Dead),
            (2, PartitionState::Active),
        ];
        store.set_partition_states(&changes).unwrap();
        let after: Vec<u64> = c.positions().iter().map(|pos| pos.uuid).collect();
        for p in [0usize, 2] {
            assert_ne!(after[p], before[p], "partition {p} became active: a new history");
            assert_eq!(c.failover_log(p as u16).len(), logs_before[p] + 1);
            assert_eq!(c.failover_log(p as u16).last().unwrap().seqno, c.high_seqnos()[p]);
        }
        assert_eq!(after[1], before[1], "a replica that stays one keeps its history");
        assert!(c.get(&keys[0]).is_ok() && c.get(&keys[2]).is_ok() && c.get(&keys[1]).is_err());
        store.close().unwrap();
        (after, (0..4u16).map(|p| c.failover_log(p)).collect::<Vec<_>>())
    };
    let store = open(dir.path());
    let c = store.collection("c").unwrap();
    let want = [PartitionState::Active, PartitionState::Replica, PartitionState::Active, PartitionState::Dead];
    for (p, state) in want.iter().enumerate() {
        assert_eq!(store.partition_state(p as u16).unwrap(), *state, "partition {p} after a restart");
    }
    for p in [0usize, 1, 2] {
        assert_eq!(c.positions()[p].uuid, uuids[p], "partition {p}'s history after a restart");
        assert_eq!(c.failover_log(p as u16), logs[p]);
    }
}

/// A copy that stops being active has every write it acknowledged as active in the high
/// seqno read right after the change: a hand-over reads that position and waits for the new
/// active to hold it, so a write that passed the active check before the change but
/// committed after that read would be acknowledged and then lost. Writers race the change
/// on four threads, many times over.
#[test]
fn a_copy_leaving_active_holds_every_write_it_acknowledged_when_the_change_returns() {
    const ROUNDS: usize = 200;
    const WRITERS: usize = 4;
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let c = store.create_collection("c", 0).unwrap();
    let p = 1u16;
    let keys = Arc::new(keys_in(p, "w", 64));
    for round in 0..ROUNDS {
        store.set_partition_state(p, PartitionState::Active).unwrap();
        let start = c.high_seqnos()[usize::from(p)];
        let go = Arc::new(std::sync::Barrier::new(WRITERS + 1));
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let (c, keys, go) = (Arc::clone(&c), Arc::clone(&keys), Arc::clone(&go));
                std::thread::spawn(move || {
                    go.wait();
                    let mut acked = Vec::new();
                    for i in 0.. {
                        match c.write(put(&keys[(w * 16 + i) % keys.len()])) {
                            Ok((outcome, _)) => acked.push(outcome.seqno),
                            Err(WriteError::NotMyPartition(_)) => return acked,
                            Err(e) => panic!("round {round}: {e}"),
                        }
                    }
                    acked
                })
            })
            .collect();
        go.wait();
        // Let the writers get going (a few writes each), then change the state under them.
        while c.high_seqnos()[usize::from(p)] < start + 8 {
            std::thread::yield_now();
        }
        store.set_partition_states(&[(p, PartitionState::Replica)]).unwrap();
        let high = c.positions()[usize::from(p)].seqno;
        for w in writers {
            for seqno in w.join().unwrap() {
                assert!(
                    seqno <= high,
                    "round {round}: a write acknowledged at seqno {seqno} past the position {high} read after the change"
                );
            }
        }
    }
}

#[test]
fn states_refuse_what_they_must_and_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    // One key per partition.
    let keys: Vec<String> = (0..PARTITIONS).map(|p| keys_in(p, "k", 1).remove(0)).collect();
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
        let keys: Vec<String> = keys_in(0, "k", 20);
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
        let key = keys_in(0, "n", 1).remove(0);
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

/// `count` replicated upserts to keys of partition 0 (`n{i % keys}`), seqnos 1..=count.
fn replicated(count: u64, keys: u64) -> Vec<Change> {
    let key_names: Vec<String> = keys_in(0, "n", keys as usize);
    (1..=count)
        .map(|seqno| Change {
            partition: 0,
            seqno,
            key: Bytes::from(key_names[(seqno % keys) as usize].clone()),
            cas: 1000 + seqno,
            deleted: seqno % 7 == 0,
            expiry: if seqno % 3 == 0 && seqno % 7 != 0 { u32::MAX - 1 } else { 0 },
            value: (seqno % 7 != 0).then(|| Bytes::from(format!("{seqno}"))),
        })
        .collect()
}

#[test]
fn an_active_copy_refuses_a_rollback_and_a_rolled_back_replica_keeps_it_across_restarts() {
    for crash in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        // 30 keys over 40 changes: keys whose latest change is above 25 go whole.
        let all = replicated(40, 30);
        let latest: BTreeMap<Bytes, Change> = all.iter().map(|c| (c.key.clone(), c.clone())).collect();
        let expected: BTreeMap<Bytes, Change> = latest.iter().filter(|(_, c)| c.seqno <= 25).map(|(k, c)| (k.clone(), c.clone())).collect();
        let removed: Vec<Bytes> = latest.iter().filter(|(_, c)| c.seqno > 25).map(|(k, _)| k.clone()).collect();
        assert!(expected.len() > 5 && removed.len() > 5);
        {
            let store = open(dir.path());
            let c = store.create_collection("c", 0).unwrap();
            let Err(PartitionError::NotMine(n)) = store.rollback_partition(&c, 0, 0) else { panic!("an active copy rolled back") };
            assert_eq!(n.state, PartitionState::Active);
            store.set_partition_state(0, PartitionState::Replica).unwrap();
            let _ = c.apply(0, &all).unwrap();
            let uuid = c.partition_uuids()[0];
            // A replica lists the keys a rollback removes before it rolls back (to fetch
            // their current versions first): the same keys.
            let mut listed = c.keys_above(0, 25).unwrap();
            listed.sort();
            assert_eq!(listed, removed, "keys_above lists what the rollback removes");
            let report = store.rollback_partition(&c, 0, 25).unwrap();
            assert_eq!(report.seqno, 25);
            let mut got = report.removed.clone();
            got.sort();
            assert_eq!(got, removed, "the keys whose latest change was above 25");
            assert!(c.keys_above(0, 25).unwrap().is_empty(), "nothing above 25 after the rollback");
            let log = c.failover_log(0);
            assert_eq!(log.len(), 2);
            assert_eq!((log[0].uuid, log[1].seqno), (uuid, 25), "the history goes on from 25 under a new uuid");
            // A reader that had read past 25 on the old history is sent back to 25.
            let (_, rollback) = c.subscribe(0, StreamPosition { seqno: 40, uuid }).unwrap();
            assert_eq!(rollback, Some(25));
            // Changes above 25 may come again (from the new active).
            let _ = c.apply(0, &[Change { seqno: 26, ..all[0].clone() }]).unwrap();
            let _ = store.rollback_partition(&c, 0, 25).unwrap();
            if !crash {
                store.close().unwrap();
            }
        }
        let store = open(dir.path());
        let c = store.collection("c").unwrap();
        assert_eq!(c.high_seqnos()[0], 25, "crash {crash}");
        assert_eq!(state_of(&c, 0), expected, "crash {crash}");
        let live = expected.values().filter(|c| !c.deleted).count() as u64;
        assert_eq!(c.info().docs, live, "crash {crash}");
        assert_eq!(c.failover_log(0)[1].seqno, 25);
        // Promoted, it serves the rolled-back documents, and the removed keys are absent.
        store.set_partition_state(0, PartitionState::Active).unwrap();
        for change in expected.values() {
            let key = std::str::from_utf8(&change.key).unwrap();
            match c.get(key) {
                Ok(doc) => assert_eq!(
                    (doc.seqno, doc.cas, doc.expiry, Some(doc.value)),
                    (change.seqno, change.cas, change.expiry, change.value.clone())
                ),
                Err(ReadError::NotFound) => assert!(change.deleted),
                Err(e) => panic!("{key}: {e}"),
            }
        }
        for key in &removed {
            assert!(matches!(c.get(std::str::from_utf8(key).unwrap()), Err(ReadError::NotFound)));
        }
    }
}

#[test]
fn a_restore_writes_below_the_high_seqno_and_readers_from_before_it_see_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let c = store.create_collection("c", 0).unwrap();
    store.set_partition_state(0, PartitionState::Replica).unwrap();
    let all = replicated(30, 30);
    let _ = c.apply(0, &all[..20]).unwrap();
    let report = store.rollback_partition(&c, 0, 10).unwrap();
    assert_eq!(report.removed.len(), 10);
    // The new active's versions: key of seqno 15 came back at seqno 8 (it had an older
    // version there on the shared history); one at 12 is above the high seqno and skipped.
    let restored = Change { seqno: 8, cas: 555, ..all[14].clone() };
    let above = Change { seqno: 12, ..all[15].clone() };
    let taken = Change { seqno: 9, ..all[16].clone() };
    assert!(matches!(c.restore(0, &[taken]), Err(PartitionError::NotInHistory { seqno: 9 })), "seqno 9 is another key's here");
    // (Seqno 8 was another key's too in this made-up history: free it first.)
    let _ = store.rollback_partition(&c, 0, 7).unwrap();
    let _ = c.apply(0, &all[8..10]).unwrap();
    assert_eq!(c.restore(0, &[restored.clone(), above]).unwrap(), 1);
    assert_eq!(c.high_seqnos()[0], 10);
    let state = state_of(&c, 0);
    assert_eq!(state.get(&restored.key), Some(&restored));
    let (mut sub, _) = c.subscribe(0, StreamPosition { seqno: 7, uuid: c.partition_uuids()[0] }).unwrap();
    assert!(sub.try_next(100, true).unwrap().contains(&restored), "a reader from before it sees it");
    store.set_partition_state(0, PartitionState::Active).unwrap();
    assert!(matches!(c.restore(0, &[restored]), Err(PartitionError::NotMine(_))), "an active copy takes no restore");
}

#[test]
fn the_persisted_seqno_covers_persist_writes_at_once_and_none_writes_after_the_next_fsync() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let c = store.create_collection("c", 0).unwrap();
    let keys: Vec<String> = keys_in(0, "k", 3);
    let watch = c.persisted_watch(0).unwrap();
    rt.block_on(async {
        let (out, wait) = c.write(put(&keys[0])).unwrap();
        wait.wait().await.unwrap();
        assert!(out.seqno <= *watch.borrow(), "a persist write is in the persisted seqno when it is answered");
        // A none write: not claimed before an fsync covers it (none has run)...
        let (none, _) = c.write(put(&keys[1])).unwrap();
        assert!(*watch.borrow() < none.seqno);
        // ...and covered by the next one, here one a persist write of another partition asks for.
        let other = keys_in(1, "o", 1).remove(0);
        let (_, wait) = c.write(put(&other)).unwrap();
        wait.wait().await.unwrap();
        let mut w = watch.clone();
        tokio::time::timeout(std::time::Duration::from_secs(10), w.wait_for(|s| *s >= none.seqno)).await.unwrap().unwrap();
    });
    // Applied changes too, on a replica.
    store.set_partition_state(0, PartitionState::Replica).unwrap();
    let watch = c.persisted_watch(0).unwrap();
    let high = c.high_seqnos()[0];
    let change = Change {
        partition: 0,
        seqno: high + 5,
        key: Bytes::from(keys[2].clone()),
        cas: u64::MAX / 2,
        deleted: false,
        expiry: 0,
        value: Some(Bytes::from_static(b"2")),
    };
    let wait = c.apply(0, &[change]).unwrap();
    rt.block_on(wait.wait()).unwrap();
    assert_eq!(*watch.borrow(), high + 5);
    // A rollback replaces the copy: the old watch closes, a new one starts at the rollback point.
    let _ = store.rollback_partition(&c, 0, high).unwrap();
    assert!(watch.has_changed().is_err(), "the replaced copy's watch is closed");
    assert_eq!(*c.persisted_watch(0).unwrap().borrow(), high);
}

/// An ingest is durable when it returns, though its version is made durable after the
/// journal lock is released (vendor/fjall/SHOAL-PATCH.md): a store dropped right after it,
/// without a clean close, reopens with the whole copy.
#[test]
fn an_ingested_copy_survives_a_crash_right_after_the_ingest() {
    let (src_dir, dst_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let src = open(src_dir.path());
    for name in ["a", "b"] {
        let c = src.create_collection(name, 0).unwrap();
        for key in keys_in(2, name, 3_000) {
            let _ = c.write(put(&key)).unwrap();
        }
    }
    let want: Vec<_> = ["a", "b"].iter().map(|n| state_of(&src.collection(n).unwrap(), 2)).collect();
    {
        let dst = copy_store(&src, dst_dir.path());
        replicate(&src, &dst, 2);
        drop(dst);
    }
    let dst = open(dst_dir.path());
    assert_eq!(dst.partition_state(2).unwrap(), PartitionState::Replica);
    for (name, want) in ["a", "b"].iter().zip(&want) {
        let got = state_of(&dst.collection(name).unwrap(), 2);
        assert_eq!(got.len(), 3_000, "{name}: every document of the copy is there after the crash");
        assert_eq!(&got, want, "{name}");
    }
}

/// A replica repairing after a rollback reads the current versions of the keys it lost
/// from the copy it follows, which a hand-over may have made a (frozen) replica already:
/// `current_version` reads active and replica copies, where `get` refuses a replica's,
/// says "none" for a deleted key, and refuses pending and dead copies rather than answer
/// "none" (an answer of "none" would make the repair drop the key).
#[test]
fn current_versions_are_read_from_active_and_replica_copies_only() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let c = store.create_collection("c", 0).unwrap();
    let keys = keys_in(1, "k", 2);
    for key in &keys {
        let _ = c.write(put(key)).unwrap();
    }
    let _ = c.write(WriteRequest { key: Bytes::from(keys[1].clone()), op: WriteOp::Remove, value: None, cas: None, expiry: 0 }).unwrap();
    for state in [PartitionState::Active, PartitionState::Replica] {
        store.set_partition_state(1, state).unwrap();
        let doc = c.current_version(&keys[0]).unwrap().unwrap_or_else(|| panic!("{state}: the live key"));
        assert_eq!(&doc.value[..], b"1", "{state}");
        assert!(c.current_version(&keys[1]).unwrap().is_none(), "{state}: a deleted key has no current version");
    }
    assert!(matches!(c.get(&keys[0]), Err(ReadError::NotMyPartition(_))), "a replica's copy refuses client reads");
    for state in [PartitionState::Pending, PartitionState::Dead] {
        store.set_partition_state(1, state).unwrap();
        assert!(matches!(c.current_version(&keys[0]), Err(ReadError::NotMyPartition(_))), "{state}");
    }
}
