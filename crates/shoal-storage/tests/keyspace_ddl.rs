//! The vendored fjall's keyspace creation and deletion run outside the keyspace map's
//! write lock, serialized by a lock of their own (`vendor/fjall/SHOAL-PATCH.md`), so that
//! a partition drop does not stall the writes of every other partition. These tests check
//! that nothing that lock used to guarantee was lost: one keyspace per name however many
//! threads ask at once, and a database that reopens with exactly the keyspaces left and
//! the data written, after creations and deletions raced writes to other keyspaces. And a
//! new keyspace persists no version until its first flush: what it holds until then is in
//! the journal, and a reopen, or a crash mid-flush, loses none of it.

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

/// Keyspaces opened as a group (`Database::keyspaces`, how a node makes the keyspaces of the
/// index partitions it is about to adopt) are recorded in the meta keyspace by one write:
/// one table there for fifty keyspaces. Names that exist already, a name listed twice and
/// names other threads create at the same moment each come back as one keyspace, in the
/// order asked, and everything reopens.
#[test]
fn keyspaces_opened_as_a_group_are_recorded_at_once_and_share_no_name() {
    const GROUP: usize = 50;
    let dir = tempfile::tempdir().unwrap();
    let meta_tables = |path: &std::path::Path| std::fs::read_dir(path.join("keyspaces").join("0").join("tables")).map_or(0, |d| d.count());
    {
        let db = Arc::new(open(dir.path()));
        let names: Vec<String> = (0..GROUP).map(|i| format!("g{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let before = meta_tables(dir.path());
        let group = db.keyspaces(&refs, fjall::KeyspaceCreateOptions::default).unwrap();
        assert_eq!(meta_tables(dir.path()), before + 1, "fifty keyspaces, one record");
        let got: Vec<String> = group.iter().map(|ks| ks.name().to_string()).collect();
        assert_eq!(got, names, "in the order asked");
        assert_eq!(group.iter().map(|ks| ks.id()).collect::<BTreeSet<_>>().len(), GROUP);

        // Raced: other threads create some of the same names one by one while a group asks
        // for them, an existing name and a name listed twice.
        let barrier = Arc::new(std::sync::Barrier::new(THREADS));
        let singles: Vec<std::thread::JoinHandle<Vec<(String, u64)>>> = (1..THREADS)
            .map(|t| {
                let (db, barrier) = (db.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    (0..GROUP)
                        .filter(|i| i % THREADS == t)
                        .map(|i| {
                            let name = format!("r{i}");
                            let id = db.keyspace(&name, fjall::KeyspaceCreateOptions::default).unwrap().id();
                            (name, id)
                        })
                        .collect()
                })
            })
            .collect();
        let mut asked: Vec<String> = (0..GROUP).map(|i| format!("r{i}")).collect();
        asked.extend(["g0".to_string(), "r0".to_string()]);
        let refs: Vec<&str> = asked.iter().map(String::as_str).collect();
        barrier.wait();
        let raced = db.keyspaces(&refs, fjall::KeyspaceCreateOptions::default).unwrap();
        let by_name: std::collections::BTreeMap<String, u64> = raced.iter().map(|ks| (ks.name().to_string(), ks.id())).collect();
        assert_eq!(raced.iter().map(|ks| ks.name().to_string()).collect::<Vec<_>>(), asked);
        assert_eq!(by_name["g0"], group[0].id(), "an existing name is opened, not made");
        assert_eq!(raced[GROUP + 1].id(), raced[0].id(), "a name listed twice is one keyspace");
        for single in singles {
            for (name, id) in single.join().unwrap() {
                assert_eq!(by_name[&name], id, "{name}: the group and a single creation got two keyspaces");
            }
        }
        for ks in group.iter().chain(&raced) {
            ks.insert("who", ks.name().to_string()).unwrap();
        }
        db.persist(fjall::PersistMode::SyncAll).unwrap();
    }
    let db = open(dir.path());
    assert_eq!(db.keyspace_count(), 2 * GROUP);
    for name in (0..GROUP).flat_map(|i| [format!("g{i}"), format!("r{i}")]) {
        let ks = db.keyspace(&name, fjall::KeyspaceCreateOptions::default).unwrap();
        assert_eq!(ks.get("who").unwrap().as_deref(), Some(name.as_bytes()), "{name}");
    }
}

/// A keyspace deleted before its first flush has no version file to remove first, and
/// its folder goes when its last handle does (it stayed until the next open found it
/// unreferenced; a node drops every small index partition it gives away this way).
#[test]
fn a_keyspace_deleted_before_its_first_flush_leaves_no_folder() {
    let dir = tempfile::tempdir().unwrap();
    let folders = || std::fs::read_dir(dir.path().join("keyspaces")).unwrap().count();
    let db = open(dir.path());
    let before = folders();
    let ks = db.keyspace("brief", fjall::KeyspaceCreateOptions::default).unwrap();
    ks.insert("k", "v").unwrap();
    assert_eq!(folders(), before + 1);
    db.delete_keyspace(ks).unwrap();
    assert_eq!(folders(), before, "the folder of a keyspace never flushed goes with its last handle");
    drop(db);
    let db = open(dir.path());
    assert!(!db.keyspace_exists("brief"));
    assert_eq!(folders(), before);
}

/// A new keyspace's tree persists no version until it has one to persist (a flush, an
/// ingest, an import; `vendor/fjall/SHOAL-PATCH.md`): its creation writes no version file
/// and no `current` marker, which were two new files and four fsyncs per keyspace. What
/// the journal holds for it reopens, before and after its first flush.
#[test]
fn a_new_keyspace_writes_no_version_until_its_first_flush_and_reopens_with_its_writes() {
    let dir = tempfile::tempdir().unwrap();
    let path;
    {
        let db = open(dir.path());
        let ks = db.keyspace("new", fjall::KeyspaceCreateOptions::default).unwrap();
        path = ks.path().to_path_buf();
        let files: Vec<String> = std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert_eq!(files, ["tables"], "a new tree's folder holds only its tables folder");
        for i in 0..100u32 {
            ks.insert(i.to_be_bytes(), i.to_le_bytes()).unwrap();
        }
        db.persist(fjall::PersistMode::SyncAll).unwrap();
    }
    // Dropped with no flush: the writes are only in the journal.
    {
        let db = open(dir.path());
        let ks = db.keyspace("new", fjall::KeyspaceCreateOptions::default).unwrap();
        assert_eq!(ks.path(), path);
        assert_eq!(ks.len().unwrap(), 100, "the journal's writes reopen into the keyspace that never persisted a version");
        ks.rotate_memtable_and_wait().unwrap();
        assert!(path.join("current").exists(), "the first flush persists the tree's version");
        ks.insert(1000u32.to_be_bytes(), b"after").unwrap();
        db.persist(fjall::PersistMode::SyncAll).unwrap();
    }
    let db = open(dir.path());
    let ks = db.keyspace("new", fjall::KeyspaceCreateOptions::default).unwrap();
    assert_eq!(ks.len().unwrap(), 101);
    assert_eq!(ks.get(1000u32.to_be_bytes()).unwrap().as_deref(), Some(&b"after"[..]));
}

/// A tree whose first version's persist was cut short (its table written, no `current`
/// marker yet: a crash mid-flush) reopens empty of that table: the journal, which the flush
/// had not yet released, replays the writes, and the stray file does not stop the tree
/// from writing its own first table.
#[test]
fn a_first_flush_cut_short_by_a_crash_leaves_nothing_that_stops_the_next() {
    let dir = tempfile::tempdir().unwrap();
    let path;
    {
        let db = open(dir.path());
        let ks = db.keyspace("cut", fjall::KeyspaceCreateOptions::default).unwrap();
        path = ks.path().to_path_buf();
        ks.insert(b"k", b"v").unwrap();
        db.persist(fjall::PersistMode::SyncAll).unwrap();
    }
    // What a flush that crashed before its version would leave: the tree's first table.
    std::fs::write(path.join("tables").join("0"), b"a table no version names").unwrap();
    std::fs::write(path.join("v1"), b"a version never made current").unwrap();
    {
        let db = open(dir.path());
        let ks = db.keyspace("cut", fjall::KeyspaceCreateOptions::default).unwrap();
        assert_eq!(ks.get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
        assert!(!path.join("v1").exists(), "what no version names is removed");
        ks.rotate_memtable_and_wait().unwrap();
        assert_eq!(ks.table_count(), 1, "the tree wrote its own first table");
    }
    let db = open(dir.path());
    let ks = db.keyspace("cut", fjall::KeyspaceCreateOptions::default).unwrap();
    assert_eq!(ks.get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
}
