//! The vendored fjall's keyspace creation and deletion run outside the keyspace map's
//! write lock, serialized by a lock of their own (`vendor/fjall/SHOAL-PATCH.md`), so that
//! a partition drop does not stall the writes of every other partition. These tests check
//! that nothing that lock used to guarantee was lost: one keyspace per name however many
//! threads ask at once, and a database that reopens with exactly the keyspaces left and
//! the data written, after creations and deletions raced writes to other keyspaces.

use std::collections::BTreeSet;
use std::sync::Arc;

const THREADS: usize = 4;
const ROUNDS: usize = 20;
const WRITES: u32 = 2_000;

fn open(path: &std::path::Path) -> fjall::Database {
    fjall::Database::builder(path).open().unwrap()
}

#[test]
fn threads_that_create_one_name_at_once_all_get_the_same_keyspace() {
    let dir = tempfile::tempdir().unwrap();
    let db = Arc::new(open(dir.path()));
    for round in 0..ROUNDS {
        let name = format!("k{round}");
        let barrier = Arc::new(std::sync::Barrier::new(THREADS));
        let ids: Vec<u64> = (0..THREADS)
            .map(|_| {
                let (db, name, barrier) = (db.clone(), name.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    db.keyspace(&name, fjall::KeyspaceCreateOptions::default).unwrap().id()
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        assert!(ids.iter().all(|id| *id == ids[0]), "round {round}: one name, several keyspaces: {ids:?}");
    }
    assert_eq!(db.keyspace_count(), ROUNDS);
}

#[test]
fn keyspaces_created_and_deleted_while_another_is_written_reopen_as_left() {
    let dir = tempfile::tempdir().unwrap();
    let kept: BTreeSet<String>;
    {
        let db = Arc::new(open(dir.path()));
        let busy = db.keyspace("busy", fjall::KeyspaceCreateOptions::default).unwrap();
        let writer = {
            let (db, busy) = (db.clone(), busy.clone());
            std::thread::spawn(move || {
                for i in 0..WRITES {
                    let mut batch = db.batch();
                    batch.insert(&busy, i.to_be_bytes(), i.to_le_bytes());
                    batch.commit().unwrap();
                }
            })
        };
        let mut left = BTreeSet::new();
        for round in 0..ROUNDS {
            let name = format!("part{round}");
            let ks = db.keyspace(&name, fjall::KeyspaceCreateOptions::default).unwrap();
            ks.insert(b"k", name.as_bytes()).unwrap();
            if round % 3 == 0 {
                db.delete_keyspace(ks).unwrap();
                assert!(!db.keyspace_exists(&name));
            } else {
                left.insert(name);
            }
        }
        writer.join().unwrap();
        db.persist(fjall::PersistMode::SyncAll).unwrap();
        kept = left;
    }
    let db = open(dir.path());
    let names: BTreeSet<String> = db.list_keyspace_names().iter().map(|n| n.to_string()).filter(|n| n.starts_with("part")).collect();
    assert_eq!(names, kept);
    for name in &kept {
        let ks = db.keyspace(name, fjall::KeyspaceCreateOptions::default).unwrap();
        assert_eq!(ks.get(b"k").unwrap().as_deref(), Some(name.as_bytes()));
    }
    let busy = db.keyspace("busy", fjall::KeyspaceCreateOptions::default).unwrap();
    assert_eq!(busy.len().unwrap(), WRITES as usize);
}

/// Keyspaces created at once by several threads are recorded together (one creator writes
/// every waiting one's name in one ingestion): each creator gets its own keyspace, and a
/// reopened database has every one of them, with what was written to it.
#[test]
fn keyspaces_created_at_once_are_recorded_together_and_all_reopen() {
    const EACH: usize = 25;
    let dir = tempfile::tempdir().unwrap();
    {
        let db = Arc::new(open(dir.path()));
        let barrier = Arc::new(std::sync::Barrier::new(THREADS));
        let ids: Vec<u64> = (0..THREADS)
            .map(|t| {
                let (db, barrier) = (db.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    (0..EACH)
                        .map(|i| {
                            let ks = db.keyspace(&format!("t{t}-{i}"), fjall::KeyspaceCreateOptions::default).unwrap();
                            ks.insert("who", format!("t{t}-{i}")).unwrap();
                            ks.id()
                        })
                        .collect::<Vec<u64>>()
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        assert_eq!(ids.iter().collect::<BTreeSet<_>>().len(), THREADS * EACH, "two names got one keyspace id");
        db.persist(fjall::PersistMode::SyncAll).unwrap();
    }
    let db = open(dir.path());
    assert_eq!(db.keyspace_count(), THREADS * EACH);
    for t in 0..THREADS {
        for i in 0..EACH {
            let name = format!("t{t}-{i}");
            let ks = db.keyspace(&name, fjall::KeyspaceCreateOptions::default).unwrap();
            assert_eq!(ks.get("who").unwrap().as_deref(), Some(name.as_bytes()), "{name}");
        }
    }
}
