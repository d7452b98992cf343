//! A partition copied as its files (`Store::export_partition_files` →
//! `Store::import_partition_files`): the copy equals the source at the export — tables on
//! several levels, blob files, memtable items and tombstones alike, whichever of the two
//! databases' seqno counters runs ahead — then follows it, keeps it across a restart, and
//! lets its own later writes win; a damaged, cut or reordered stream is refused whole.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use shoal_storage::{
    Change, Collection, ExportHeader, FileManifest, FilePiece, PartitionError, PartitionState, ReadError, Store, StoreConfig,
    StreamPosition, WriteError, WriteOp, WriteRequest,
};

const PARTITIONS: u16 = 4;
/// Documents this large or larger go to blob files: the test writes both kinds.
const BLOB_THRESHOLD: u32 = 512;

fn open(dir: &std::path::Path) -> Arc<Store> {
    Store::open(StoreConfig {
        data_paths: vec![dir.to_path_buf()],
        partitions: Some(PARTITIONS),
        blob_threshold_bytes: BLOB_THRESHOLD,
        ..StoreConfig::default()
    })
    .unwrap()
}

fn keys_in(p: u16, prefix: &str, n: usize) -> Vec<String> {
    (0..).map(|i| format!("{prefix}{i}")).filter(|k| shoal_storage::partition_of(k.as_bytes(), PARTITIONS) == p).take(n).collect()
}

fn upsert(c: &Collection, key: &str, round: usize, big: bool) {
    let pad = if big { "x".repeat(2 * BLOB_THRESHOLD as usize) } else { String::new() };
    let body = format!("{{\"k\":\"{key}\",\"round\":{round},\"pad\":\"{pad}\"}}");
    let req = WriteRequest { key: Bytes::from(key.to_string()), op: WriteOp::Upsert, value: Some(Bytes::from(body)), cas: None, expiry: 0 };
    let _ = c.write(req).unwrap();
}

fn remove(c: &Collection, key: &str) {
    let req = WriteRequest { key: Bytes::from(key.to_string()), op: WriteOp::Remove, value: None, cas: None, expiry: 0 };
    match c.write(req) {
        Ok(_) | Err(WriteError::NotFound) => {}
        Err(e) => panic!("remove {key}: {e}"),
    }
}

fn changes_after(coll: &Collection, p: u16, from: StreamPosition) -> Vec<Change> {
    let (mut sub, rollback) = coll.subscribe(p, from).unwrap();
    assert_eq!(rollback, None);
    let mut out = Vec::new();
    loop {
        let batch = sub.try_next(500, true).unwrap();
        if batch.is_empty() {
            return out;
        }
        out.extend(batch);
    }
}

fn state_of(coll: &Collection, p: u16) -> BTreeMap<Bytes, Change> {
    changes_after(coll, p, StreamPosition::default()).into_iter().map(|c| (c.key.clone(), c)).collect()
}

/// Every document `keys` name, as point reads answer them (value, CAS, seqno) or absent.
fn reads(c: &Collection, keys: &[String]) -> Vec<Option<(Bytes, u64, u64)>> {
    keys.iter()
        .map(|k| match c.get(k) {
            Ok(d) => Some((d.value, d.cas, d.seqno)),
            Err(ReadError::NotFound) => None,
            Err(e) => panic!("get {k}: {e}"),
        })
        .collect()
}

fn catch_up(from: &Collection, to: &Collection, p: u16, pos: StreamPosition) {
    for chunk in changes_after(from, p, pos).chunks(101) {
        let _ = to.apply(p, chunk).unwrap();
    }
}

fn receiver(src: &Store, dir: &std::path::Path, busy: bool) -> Arc<Store> {
    let dst = open(dir);
    for name in ["a", "b"] {
        let id = src.collection(name).unwrap().id();
        let c = dst.create_collection_as(name, 0, Some(id)).unwrap();
        if busy {
            // Many writes elsewhere: this database's seqno counter runs far ahead of the
            // source's.
            for key in keys_in(0, "busy", 20_000) {
                upsert(&c, &key, 0, false);
            }
        }
    }
    dst
}

const P: u16 = 1;

/// The source's partition `P`: a major compaction's last level, an L0 table above it, and
/// a memtable above that; small and blob-sized documents; updates and deletes in each.
fn load(src: &Store) -> Vec<String> {
    let (a, b) = (src.collection("a").unwrap(), src.collection("b").unwrap());
    let keys = keys_in(P, "k", 3_000);
    for (i, key) in keys.iter().enumerate() {
        upsert(&a, key, 1, i % 7 == 0);
        if i % 3 == 0 {
            upsert(&b, key, 1, i % 5 == 0);
        }
    }
    src.compact_partition(P).unwrap();
    for (i, key) in keys.iter().enumerate().step_by(4) {
        if i % 8 == 0 {
            remove(&a, key);
        } else {
            upsert(&a, key, 2, i % 3 == 0);
        }
    }
    let _ = src.partition_files_flushed(P).unwrap();
    for (i, key) in keys.iter().enumerate().step_by(5) {
        if i % 10 == 0 {
            remove(&a, key);
            remove(&b, key);
        } else {
            upsert(&a, key, 3, i % 4 == 0);
        }
    }
    keys
}

#[test]
fn a_copy_by_files_equals_its_source_then_follows_it_and_its_own_writes_win() {
    // The memtable's items travel as such; flushed before the export, inside a file.
    for (busy, flush) in [(false, false), (true, false), (false, true), (true, true)] {
        let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let src = open(d1.path());
        let (a, b) = (src.create_collection("a", 0).unwrap(), src.create_collection("b", 0).unwrap());
        let keys = load(&src);
        let dst = receiver(&src, d2.path(), busy);
        dst.drop_partition(P).unwrap();
        dst.set_partition_state(P, PartitionState::Pending).unwrap();
        // Documents of the receiver's other partitions.
        let elsewhere = dst.collection("a").unwrap().info().docs;

        if flush {
            let _ = src.partition_files_flushed(P).unwrap();
        }
        let export = src.export_partition_files(P).unwrap();
        let header: ExportHeader = export.header().clone();
        let manifest: FileManifest = export.manifest().clone();
        // The test covers what it says: tables on two levels, blob files, memtable items.
        let levels_used = manifest.levels.iter().filter(|l| !l.is_empty()).count();
        assert!(levels_used >= 2, "tables on {levels_used} levels: {manifest:?}");
        assert!(!manifest.blob_files.is_empty(), "no blob files");
        if flush {
            assert_eq!(manifest.items, 0, "the flush put the memtable's items in a file");
        } else {
            assert!(manifest.items > 0, "no memtable items");
        }
        let at_export = (state_of(&a, P), state_of(&b, P), reads(&a, &keys), reads(&b, &keys));

        // The source goes on writing, flushing and compacting; the export's files stay.
        for key in keys.iter().step_by(3) {
            upsert(&a, key, 4, false);
        }
        src.compact_partition(P).unwrap();

        let stats = dst.import_partition_files(&header, &manifest, export).unwrap();
        assert!(stats.bytes >= manifest.file_bytes());
        dst.set_partition_state(P, PartitionState::Replica).unwrap();
        let (da, db) = (dst.collection("a").unwrap(), dst.collection("b").unwrap());
        assert_eq!(state_of(&da, P), at_export.0, "busy={busy} flush={flush}");
        assert_eq!(state_of(&db, P), at_export.1, "busy={busy} flush={flush}");
        assert_eq!(da.info().docs - elsewhere, at_export.0.values().filter(|c| !c.deleted).count() as u64, "live counts travel");
        for (c, dc, exported) in [(&a, &da, &header.collections[0]), (&b, &db, &header.collections[1])] {
            assert_eq!(dc.high_seqnos()[usize::from(P)], exported.seqno);
            assert_eq!(dc.partition_uuids()[usize::from(P)], c.partition_uuids()[usize::from(P)]);
        }

        // Catch up from the export's positions.
        catch_up(&a, &da, P, header.collections[0].position());
        catch_up(&b, &db, P, header.collections[1].position());
        assert_eq!(state_of(&da, P), state_of(&a, P));

        // A restart keeps the adopted files and the catch-up.
        drop((da, db));
        drop(dst);
        let dst = open(d2.path());
        let (da, db) = (dst.collection("a").unwrap(), dst.collection("b").unwrap());
        assert_eq!(state_of(&da, P), state_of(&a, P), "busy={busy} flush={flush}: after a restart");
        assert_eq!(state_of(&db, P), state_of(&b, P));

        // Promoted, the copy serves point reads as the source does, and its own writes win
        // over the adopted versions, also after another restart.
        dst.set_partition_state(P, PartitionState::Active).unwrap();
        assert_eq!(reads(&da, &keys), reads(&a, &keys));
        for key in keys.iter().step_by(2) {
            upsert(&da, key, 9, false);
        }
        for key in keys.iter().skip(1).step_by(6) {
            remove(&da, key);
        }
        let mine = reads(&da, &keys);
        for (i, got) in mine.iter().enumerate() {
            if i % 2 == 0 {
                let (body, _, _) = got.as_ref().unwrap_or_else(|| panic!("{}: written here, not found", keys[i]));
                assert!(std::str::from_utf8(body).unwrap().contains("\"round\":9"), "{}: an adopted version won", keys[i]);
            } else if i % 6 == 1 {
                assert_eq!(got, &None, "{}: deleted here, still found", keys[i]);
            }
        }
        drop((da, db));
        drop(dst);
        let dst = open(d2.path());
        assert_eq!(reads(&dst.collection("a").unwrap(), &keys), mine, "busy={busy} flush={flush}: after the second restart");
    }
}

/// The records of a good export, and its header and manifest.
fn good_copy(src: &Store) -> (ExportHeader, FileManifest, Vec<(Bytes, Bytes)>) {
    let export = src.export_partition_files(P).unwrap();
    let (header, manifest) = (export.header().clone(), export.manifest().clone());
    (header, manifest, export.map(Result::unwrap).collect())
}

#[test]
fn an_exports_pieces_cover_each_file_in_order_in_bounded_chunks_and_read_as_its_records() {
    let d = tempfile::tempdir().unwrap();
    let src = open(d.path());
    let _ = (src.create_collection("a", 0).unwrap(), src.create_collection("b", 0).unwrap());
    let _ = load(&src);
    let (_, manifest, records) = good_copy(&src);
    let mut export = src.export_partition_files(P).unwrap();
    // Per file index: the bytes its chunks covered so far.
    let mut covered: BTreeMap<Bytes, u64> = BTreeMap::new();
    let mut read = Vec::new();
    let (mut items, mut chunks) = (0, 0);
    while let Some(piece) = export.next_piece() {
        match piece.unwrap() {
            FilePiece::Record(k, v) => {
                let item = k[0] == shoal_storage::files::TAG_ITEM;
                assert!(!item || chunks == 0, "an item after a file's chunk");
                items += usize::from(item);
                read.push((k, v));
            }
            item @ FilePiece::Item(_) => {
                assert!(chunks == 0, "an item after a file's chunk");
                items += 1;
                read.push(item.into_record().unwrap());
            }
            FilePiece::Chunk { key, file, offset, len } => {
                chunks += 1;
                assert!(len > 0 && len <= shoal_storage::files::FILE_CHUNK_BYTES, "a chunk of {len} bytes");
                let at = covered.entry(key.clone()).or_default();
                assert_eq!(offset, *at, "a chunk of file {key:?} out of order");
                *at += len as u64;
                let bytes = shoal_storage::files::read_chunk(&file, offset, len).unwrap();
                read.push((key, bytes));
            }
        }
    }
    assert_eq!(items as u64, manifest.items);
    let sizes: Vec<u64> = manifest.files().map(|(f, _)| f.size).filter(|s| *s > 0).collect();
    assert!(chunks >= sizes.len() && !sizes.is_empty());
    assert_eq!(covered.values().copied().collect::<Vec<_>>(), sizes, "each file's chunks cover it whole, in manifest order");
    assert!(read == records, "the pieces, read, are the export's records");
}

#[test]
fn a_copy_by_files_refuses_a_bad_stream_and_adopts_nothing() {
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let src = open(d1.path());
    let _ = src.create_collection("a", 0).unwrap();
    let _ = src.create_collection("b", 0).unwrap();
    let keys = load(&src);
    let dst = receiver(&src, d2.path(), false);
    let (header, manifest, records) = good_copy(&src);
    let chunks: Vec<usize> = (0..records.len()).filter(|i| records[*i].0[0] == shoal_storage::files::TAG_CHUNK).collect();
    let items: Vec<usize> = (0..records.len()).filter(|i| records[*i].0[0] == shoal_storage::files::TAG_ITEM).collect();
    assert!(chunks.len() >= 3 && !items.is_empty());

    // Not pending: refused.
    let ok = |r: &[(Bytes, Bytes)]| r.iter().cloned().map(Ok).collect::<Vec<_>>();
    assert!(matches!(dst.import_partition_files(&header, &manifest, ok(&records)), Err(PartitionError::NotMine(_))));

    let mut flipped = records.clone();
    let c = chunks[chunks.len() / 2];
    let mut bytes = flipped[c].1.to_vec();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x55;
    flipped[c].1 = Bytes::from(bytes);
    let cut = records[..records.len() - 1].to_vec();
    let mut reordered = records.clone();
    reordered.swap(chunks[0], chunks[chunks.len() - 1]);
    let mut item_late = records.clone();
    let item = item_late.remove(items[0]);
    item_late.push(item);
    let mut unknown_tag = records.clone();
    unknown_tag[0].0 = Bytes::from_static(b"\x07what");
    let mut bad_item = records.clone();
    bad_item[items[0]].1 = Bytes::from_static(b"\x00");
    let mut bad_sum = manifest.clone();
    bad_sum.levels.iter_mut().flatten().flatten().take(1).for_each(|f| f.checksum = "zz".into());
    let mut twice = manifest.clone();
    if let Some(f) = twice.levels.iter().flatten().flatten().next().cloned() {
        twice.levels[0].push(vec![f]);
    }
    let mut too_many = manifest.clone();
    let one = too_many.levels.iter().flatten().flatten().next().cloned().unwrap();
    too_many.levels[0].push(
        (0..=shoal_storage::files::FILES_MAX as u64)
            .map(|id| shoal_storage::files::ShippedFile { id: id + 1_000_000, ..one.clone() })
            .collect(),
    );
    let mut fewer_items = manifest.clone();
    fewer_items.items += 1;
    let mut unknown_live = manifest.clone();
    unknown_live.live[0].collection = 77;
    // One item past the limit: refused on its length, before it is hashed or decoded (its
    // zeroed pages are never touched, so the test holds no such memory).
    let mut huge_item = records.clone();
    huge_item[items[0]].1 = Bytes::from(vec![0u8; shoal_storage::files::ITEMS_MAX_BYTES as usize + 1]);
    for (what, m, recs) in [
        ("a flipped byte", &manifest, ok(&flipped)),
        ("a cut stream", &manifest, ok(&cut)),
        ("files out of order", &manifest, ok(&reordered)),
        ("an item after the files", &manifest, ok(&item_late)),
        ("an unknown tag", &manifest, ok(&unknown_tag)),
        ("a malformed item", &manifest, ok(&bad_item)),
        ("a malformed checksum", &bad_sum, ok(&records)),
        ("a file listed twice", &twice, ok(&records)),
        ("an item missing", &fewer_items, ok(&records)),
        ("more files than FILES_MAX", &too_many, ok(&records)),
        ("a collection this node lacks", &unknown_live, ok(&records)),
        ("memtable items over ITEMS_MAX_BYTES", &manifest, ok(&huge_item)),
    ] {
        dst.drop_partition(P).unwrap();
        dst.set_partition_state(P, PartitionState::Pending).unwrap();
        let err = dst.import_partition_files(&header, m, recs).expect_err(what);
        assert!(matches!(err, PartitionError::Malformed(_) | PartitionError::UnknownCollection(_)), "{what}: {err}");
        assert!(!what.contains("ITEMS_MAX_BYTES") || err.to_string().contains("memtable items over"), "{what}: {err}");
        assert!(dst.collection("a").unwrap().get(&keys[1]).is_err(), "{what}: nothing adopted");
    }
    // After a drop, a good copy goes in; a second one finds the partition not empty.
    dst.drop_partition(P).unwrap();
    dst.set_partition_state(P, PartitionState::Pending).unwrap();
    let _ = dst.import_partition_files(&header, &manifest, ok(&records)).unwrap();
    assert!(matches!(dst.import_partition_files(&header, &manifest, ok(&records)), Err(PartitionError::NotEmpty(P))));
    dst.set_partition_state(P, PartitionState::Replica).unwrap();
    assert_eq!(state_of(&dst.collection("a").unwrap(), P), state_of(&src.collection("a").unwrap(), P));

    // While a dropped collection's keys may remain, the source exports records only.
    src.drop_collection("b").unwrap();
    assert!(src.export_partition_files(P).is_err());
    let _ = src.run_reclaimer();
    assert!(src.export_partition_files(P).is_ok());
}

/// One way to damage a copy by files in transit.
#[derive(Clone, Debug)]
enum Damage {
    /// Flip one byte of a record's key or value.
    Flip { record: usize, in_key: bool, at: usize, mask: u8 },
    /// Cut the stream after this many records.
    Cut(usize),
    /// Send a record twice.
    Repeat(usize),
    /// Drop a record.
    Drop(usize),
}

fn damage() -> impl proptest::strategy::Strategy<Value = Damage> {
    use proptest::prelude::*;
    prop_oneof![
        (any::<usize>(), any::<bool>(), any::<usize>(), 1u8..=255).prop_map(|(record, in_key, at, mask)| Damage::Flip {
            record,
            in_key,
            at,
            mask
        }),
        any::<usize>().prop_map(Damage::Cut),
        any::<usize>().prop_map(Damage::Repeat),
        any::<usize>().prop_map(Damage::Drop),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 24, ..proptest::prelude::ProptestConfig::default() })]

    /// Whatever a damaged copy by files carries, the receiver refuses it with a clear error
    /// (never a panic, never a copy that differs from the source), and a good copy goes in
    /// after the failed one is dropped.
    #[test]
    fn a_damaged_copy_by_files_is_refused_or_equal_to_its_source(hits in proptest::collection::vec(damage(), 1..4)) {
        let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let src = open(d1.path());
        let _ = src.create_collection("a", 0).unwrap();
        let _ = src.create_collection("b", 0).unwrap();
        let _ = load(&src);
        let dst = receiver(&src, d2.path(), false);
        let (header, manifest, good) = good_copy(&src);
        let mut records = good.clone();
        for hit in &hits {
            // A cut to nothing leaves nothing for a later hit to damage.
            let n = records.len();
            if n == 0 {
                break;
            }
            match *hit {
                Damage::Flip { record, in_key, at, mask } => {
                    let (k, v) = &mut records[record % n];
                    let target = if in_key { k } else { v };
                    if !target.is_empty() {
                        let mut bytes = target.to_vec();
                        let i = at % bytes.len();
                        bytes[i] ^= mask;
                        *target = Bytes::from(bytes);
                    }
                }
                Damage::Cut(at) => records.truncate(at % n),
                Damage::Repeat(at) => {
                    let r = records[at % n].clone();
                    records.insert(at % n, r);
                }
                Damage::Drop(at) => {
                    records.remove(at % n);
                }
            }
        }
        dst.drop_partition(P).unwrap();
        dst.set_partition_state(P, PartitionState::Pending).unwrap();
        match dst.import_partition_files(&header, &manifest, records.iter().cloned().map(Ok)) {
            Ok(_) => {
                // Only a change that altered nothing the copy keeps may pass (an item's
                // value type flipped to an equal one cannot happen; equal bytes can).
                dst.set_partition_state(P, PartitionState::Replica).unwrap();
                for name in ["a", "b"] {
                    proptest::prop_assert_eq!(
                        state_of(&dst.collection(name).unwrap(), P),
                        state_of(&src.collection(name).unwrap(), P)
                    );
                }
            }
            Err(e) => {
                proptest::prop_assert!(matches!(e, PartitionError::Malformed(_) | PartitionError::Engine(_)), "{e}");
                dst.drop_partition(P).unwrap();
                dst.set_partition_state(P, PartitionState::Pending).unwrap();
                let _ = dst.import_partition_files(&header, &manifest, good.iter().cloned().map(Ok)).unwrap();
                dst.set_partition_state(P, PartitionState::Replica).unwrap();
                proptest::prop_assert_eq!(state_of(&dst.collection("a").unwrap(), P), state_of(&src.collection("a").unwrap(), P));
            }
        }
    }
}
