//! The metadata log after a crash: whatever an append acknowledged is there on reopen, a torn
//! last record is discarded, damage before a valid record is refused, and truncation and
//! purging survive a reopen.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::Path;

use openraft::storage::{RaftLogStorage, RaftLogStorageExt};
use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId, RaftLogReader, Vote};
use shoal_meta::{MetaCommand, MetaLogStore, StoreError, TypeConfig};
use tempfile::TempDir;

fn entry(index: u64) -> Entry<TypeConfig> {
    Entry {
        log_id: LogId::new(CommittedLeaderId::new(1, 0), index),
        payload: EntryPayload::Normal(MetaCommand::CreateCollection { name: format!("c{index}"), max_ttl: 0, id: None }),
    }
}

async fn indexes(store: &mut MetaLogStore) -> Vec<u64> {
    store.try_get_log_entries(0..).await.unwrap().iter().map(|e| e.log_id.index).collect()
}

async fn append(store: &mut MetaLogStore, range: std::ops::RangeInclusive<u64>) {
    store.blocking_append(range.map(entry).collect::<Vec<_>>()).await.unwrap();
}

fn log_len(dir: &Path) -> u64 {
    std::fs::metadata(dir.join("log")).unwrap().len()
}

#[tokio::test]
async fn acknowledged_entries_survive_a_drop_without_close() {
    let dir = TempDir::new().unwrap();
    let mut store = MetaLogStore::open(dir.path()).unwrap();
    append(&mut store, 1..=3).await;
    append(&mut store, 4..=4).await;
    store.save_vote(&Vote::new(2, 1)).await.unwrap();
    // No close exists to skip: every acknowledged write was already fsynced. Forget the store
    // so not even its destructors run.
    std::mem::forget(store);

    let mut store = MetaLogStore::open(dir.path()).unwrap();
    assert_eq!(indexes(&mut store).await, vec![1, 2, 3, 4]);
    assert_eq!(store.read_vote().await.unwrap(), Some(Vote::new(2, 1)));
    let state = store.get_log_state().await.unwrap();
    assert_eq!(state.last_log_id.map(|id| id.index), Some(4));
}

#[tokio::test]
async fn a_torn_last_record_is_discarded_on_open() {
    let dir = TempDir::new().unwrap();
    let mut store = MetaLogStore::open(dir.path()).unwrap();
    append(&mut store, 1..=2).await;
    let whole = log_len(dir.path());
    append(&mut store, 3..=5).await;
    let longer = log_len(dir.path());
    drop(store);

    // Every cut inside the last record (a write that never finished) loses that record only.
    for cut in [whole + 1, whole + 10, whole + 16, (whole + longer) / 2, longer - 1] {
        let copy = TempDir::new().unwrap();
        std::fs::copy(dir.path().join("log"), copy.path().join("log")).unwrap();
        OpenOptions::new().write(true).open(copy.path().join("log")).unwrap().set_len(cut).unwrap();
        let mut store = MetaLogStore::open(copy.path()).unwrap();
        assert_eq!(indexes(&mut store).await, vec![1, 2], "cut at {cut}");
        assert_eq!(log_len(copy.path()), whole, "the torn bytes are cut off");
        // The log goes on from there, and a reopen sees it all.
        append(&mut store, 3..=3).await;
        drop(store);
        let mut store = MetaLogStore::open(copy.path()).unwrap();
        assert_eq!(indexes(&mut store).await, vec![1, 2, 3]);
    }

    // Garbage after the last record (a torn header) is torn too.
    let mut file = OpenOptions::new().append(true).open(dir.path().join("log")).unwrap();
    file.write_all(b"SHM").unwrap();
    drop(file);
    let mut store = MetaLogStore::open(dir.path()).unwrap();
    assert_eq!(indexes(&mut store).await, vec![1, 2, 3, 4, 5]);
}

#[tokio::test]
async fn damage_before_a_valid_record_is_refused() {
    let dir = TempDir::new().unwrap();
    let mut store = MetaLogStore::open(dir.path()).unwrap();
    append(&mut store, 1..=1).await;
    append(&mut store, 2..=2).await;
    drop(store);
    let path = dir.path().join("log");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[20] ^= 0xff; // inside the first record's payload
    std::fs::write(&path, &bytes).unwrap();
    assert!(matches!(MetaLogStore::open(dir.path()), Err(StoreError::Corrupt { .. })));
}

#[tokio::test]
async fn truncate_and_purge_survive_a_reopen() {
    let dir = TempDir::new().unwrap();
    let mut store = MetaLogStore::open(dir.path()).unwrap();
    append(&mut store, 1..=10).await;
    store.truncate(LogId::new(CommittedLeaderId::new(1, 0), 8)).await.unwrap();
    store.purge(LogId::new(CommittedLeaderId::new(1, 0), 3)).await.unwrap();
    append(&mut store, 8..=9).await;
    drop(store);
    let mut store = MetaLogStore::open(dir.path()).unwrap();
    assert_eq!(indexes(&mut store).await, vec![4, 5, 6, 7, 8, 9]);
    let state = store.get_log_state().await.unwrap();
    assert_eq!(state.last_purged_log_id.map(|id| id.index), Some(3));
    assert_eq!(state.last_log_id.map(|id| id.index), Some(9));
}
