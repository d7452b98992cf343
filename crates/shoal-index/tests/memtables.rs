//! The index database's memtables stay within a budget (`INDEX_MEMTABLES_MAX_BYTES`): a
//! node holding many small index partitions would otherwise keep every entry in memory and
//! in the journal, since no single part reaches its own flush limit.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use shoal_index::INDEX_MEMTABLES_MAX_BYTES;

#[test]
fn index_memtables_past_their_budget_are_flushed_and_the_indexes_answer_the_same() {
    let (_dir, store, coll) = filled_store();
    let coll2 = std::sync::Arc::clone(&coll);
    life(&store, move |mgr| async move {
        let coll = coll2;
        let mut parted = def("by_a", "a", false);
        parted.partitions = Some(8);
        mgr.create(&coll, parted).await.unwrap();
        mgr.create(&coll, def("by_a_too", "a", false)).await.unwrap();
        assert_eq!(scan_ids(&mgr, &coll, "by_a", json!(3)).await, expected_a3());
        assert_eq!(scan_ids(&mgr, &coll, "by_a_too", json!(3)).await, expected_a3());
        let held = mgr.memtable_bytes();
        assert!(held > 0, "the built indexes' entries are in memtables");
        // Within the budget nothing is flushed.
        assert_eq!(mgr.bound_memtables(held * 2).unwrap(), 0);
        assert_eq!(mgr.bound_memtables(INDEX_MEMTABLES_MAX_BYTES).unwrap(), 0, "a few hundred entries are far below the node's budget");
        // Past it, the largest memtables are sealed until those left hold half of it
        // (here: every part's, the budget being 1 byte) and the flush workers write them.
        let sealed = mgr.bound_memtables(1).unwrap();
        assert!(sealed >= 2, "{sealed} memtables sealed: at least one per index");
        let deadline = Instant::now() + Duration::from_secs(30);
        while mgr.memtable_bytes() >= held && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(mgr.memtable_bytes() < held, "the sealed memtables were flushed: {} bytes left of {held}", mgr.memtable_bytes());
        // The flushed entries answer as before.
        assert_eq!(scan_ids(&mgr, &coll, "by_a", json!(3)).await, expected_a3());
        assert_eq!(scan_ids(&mgr, &coll, "by_a_too", json!(3)).await, expected_a3());
        // Writes after the flush land on top of it.
        put(&coll, "d003", json!({"a": 4, "b": "x3"}));
        let mut want = expected_a3();
        want.retain(|id| id != "d003");
        assert_eq!(scan_ids(&mgr, &coll, "by_a", json!(3)).await, want);
        // The flushed memtables are let go of too (each maintainer round releases the old
        // versions that held them), not only counted out of the write buffer.
        let deadline = Instant::now() + Duration::from_secs(30);
        while mgr.memtables_held_bytes() >= held && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(mgr.memtables_held_bytes() < held, "flushed memtables still held: {} bytes of {held}", mgr.memtables_held_bytes());
    });
}

/// Past the node's bound of unflushed index memtables (`INDEX_WRITE_BUFFER_MAX_BYTES`),
/// each index write batch first waits for the flushes: a build of 100 indexes otherwise
/// wrote entries faster than their memtables flushed (4.7 GB unflushed and 9.2 GB resident
/// after 200,000 documents). With the bound at 0 the next round's batch waits until the
/// build's entries are in tables.
#[test]
fn index_writes_past_the_write_buffer_bound_wait_for_the_flushes() {
    let (_dir, store, coll) = filled_store();
    let coll2 = std::sync::Arc::clone(&coll);
    life(&store, move |mgr| async move {
        let coll = coll2;
        mgr.create(&coll, def("by_a", "a", false)).await.unwrap();
        assert_eq!(scan_ids(&mgr, &coll, "by_a", json!(3)).await, expected_a3());
        let built = mgr.memtable_bytes();
        assert!(built > 0, "the build's entries are in memtables (far below the flush budget)");
        mgr.set_write_buffer_max(0);
        put(&coll, "n000", json!({"a": 3}));
        let mut want = expected_a3();
        want.push("n000".into());
        let mut got = scan_ids(&mgr, &coll, "by_a", json!(3)).await;
        got.sort();
        want.sort();
        assert_eq!(got, want);
        // The round that indexed `n000` waited until the build's entries were flushed: only
        // its own are left in memory.
        assert!(mgr.memtable_bytes() < built, "{} bytes unflushed; the build alone left {built}", mgr.memtable_bytes());
    });
}

/// A flushed memtable is let go of: the engine kept it in the tree version made when it was
/// sealed until a later flush or rotation of the database, so parts flushed once and then
/// quiet held their entries in memory for good (1.3 GB on a node after a bulk load of 100
/// indexes). Here the engine's own GC is shown to leave it, and the vendored
/// `Database::release_versions` to drop it.
#[test]
fn a_flushed_memtable_held_by_an_old_version_is_released() {
    use fjall::AbstractTree;
    let dir = tempfile::tempdir().unwrap();
    let db = fjall::Database::builder(dir.path()).open().unwrap();
    let ks = db.keyspace("part", fjall::KeyspaceCreateOptions::default).unwrap();
    for i in 0..1000u32 {
        ks.insert(i.to_be_bytes(), [7u8; 64]).unwrap();
    }
    let held = |ks: &fjall::Keyspace| ks.tree.get_version_history_lock().memtable_size_sum();
    let written = held(&ks);
    ks.rotate_memtable_and_wait().unwrap();
    // The flush worker takes the memtable out of the write buffer's count just after it
    // leaves the sealed list that `rotate_memtable_and_wait` waits on (CI once saw it
    // between the two).
    let flushed_by = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while db.write_buffer_size() > 0 && std::time::Instant::now() < flushed_by {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(db.write_buffer_size(), 0, "the memtable was flushed");
    assert!(held(&ks) >= written, "flushed, yet still held by the version made at its seal: {} of {written}", held(&ks));
    // A later write moves the snapshot watermark past the flush's version.
    ks.insert(b"later", b"x").unwrap();
    let active = ks.active_memtable_size();
    assert!(db.release_versions() > 0, "old versions dropped");
    assert_eq!(held(&ks), active, "only the active memtable is held now");
    // Nothing more to drop; reads answer the same.
    assert_eq!(db.release_versions(), 0);
    assert_eq!(ks.get(5u32.to_be_bytes()).unwrap().as_deref(), Some(&[7u8; 64][..]));
    assert_eq!(ks.get(b"later").unwrap().as_deref(), Some(&b"x"[..]));
}

/// The engine's worker channel (1,000 messages) fills with compaction requests after a
/// bulk load, and a memtable rotation then drops its `Flush` message (it must not block:
/// see `vendor/fjall/SHOAL-PATCH.md`). The sealed memtable stayed queued until some later
/// rotation sent one (151–288 MB of index memtables left unflushed on an idle node). The
/// vendored worker runs a waiting flush at the next compaction message it takes.
#[test]
fn a_flush_whose_message_the_full_worker_channel_dropped_still_runs() {
    use fjall::AbstractTree;
    /// More keyspaces than the channel holds messages.
    const KEYSPACES: usize = 1100;
    let dir = tempfile::tempdir().unwrap();
    // One worker, held at its start until released: nothing leaves the channel meanwhile.
    let (release, held) = std::sync::mpsc::channel::<()>();
    let held = std::sync::Mutex::new(held);
    let db = fjall::Database::builder(dir.path())
        .worker_threads_unchecked(1)
        .worker_thread_start(move || {
            let _ = held.lock().map(|h| h.recv());
        })
        .open()
        .unwrap();
    let names: Vec<String> = (0..KEYSPACES).map(|i| format!("k{i:04}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let made = db.keyspaces(&names, fjall::KeyspaceCreateOptions::default).unwrap();
    // Each ingest asks for its keyspace's compaction, until the channel is full.
    let mut full = false;
    for ks in &made {
        let before = db.queued_worker_messages();
        let mut ingest = ks.start_ingestion().unwrap();
        ingest.write(b"a".as_slice(), b"a".as_slice()).unwrap();
        ingest.finish().unwrap();
        if db.queued_worker_messages() == before {
            full = true;
            break;
        }
    }
    assert!(full, "the channel holds fewer than {KEYSPACES} messages");
    let late = db.keyspace("late", fjall::KeyspaceCreateOptions::default).unwrap();
    late.insert(b"b", b"b").unwrap();
    let queued = db.queued_worker_messages();
    assert!(late.rotate_memtable().unwrap());
    assert_eq!(db.queued_worker_messages(), queued, "the rotation's flush message was dropped");
    release.send(()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while late.tree.table_count() == 0 || late.tree.sealed_memtable_count() > 0 {
        assert!(Instant::now() < deadline, "the sealed memtable was never flushed");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(db.write_buffer_size(), 0);
    assert_eq!(late.get(b"b").unwrap().as_deref(), Some(&b"b"[..]));
}
