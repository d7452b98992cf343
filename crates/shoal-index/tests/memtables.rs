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
    });
}
