//! Index definitions live in the store's catalog: they survive losing the index database,
//! definitions of nodes from before the catalog move into it, and a damaged index database
//! is moved aside and every index rebuilt.

mod common;

use std::sync::Arc;

use common::*;
use serde_json::json;
use shoal_index::IndexState;

#[test]
fn definitions_survive_losing_the_index_database() {
    let (dir, store, coll) = filled_store();
    life(&store, |mgr| {
        let coll = Arc::clone(&coll);
        async move {
            mgr.create(&coll, def("by_a", "a", false)).await.unwrap();
            mgr.create(&coll, def("later", "b", true)).await.unwrap();
            assert_eq!(scan_ids(&mgr, &coll, "by_a", json!(3)).await, expected_a3());
        }
    });
    let mut names: Vec<String> = catalog(&store).into_iter().map(|(n, _)| n).collect();
    names.sort();
    assert_eq!(names, ["by_a", "later"]);

    // The index database is derived state: without it, the catalog brings every index back.
    std::fs::remove_dir_all(index_dir(dir.path())).unwrap();
    life(&store, |mgr| {
        let coll = Arc::clone(&coll);
        async move {
            let list = mgr.list(&coll);
            assert_eq!(list.iter().map(|s| s.def.name.as_str()).collect::<Vec<_>>(), ["by_a", "later"]);
            assert_eq!(list[1].state, IndexState::Deferred, "a deferred index stays deferred");
            assert_eq!(scan_ids(&mgr, &coll, "by_a", json!(3)).await, expected_a3());
            mgr.build(&coll, "later").await.unwrap();
            assert_eq!(scan_ids(&mgr, &coll, "later", json!("x7")).await, ["d007"]);
            mgr.drop_index(&coll, "by_a").await.unwrap();
        }
    });
    assert_eq!(catalog(&store).into_iter().map(|(n, _)| n).collect::<Vec<_>>(), ["later"]);
    life(&store, |mgr| {
        let coll = Arc::clone(&coll);
        async move {
            let list = mgr.list(&coll);
            assert_eq!(list.len(), 1);
            assert_ne!(list[0].state, IndexState::Deferred, "building was asked for: it is remembered");
            assert_eq!(scan_ids(&mgr, &coll, "later", json!("x8")).await, ["d008"]);
        }
    });
}

#[test]
fn definitions_of_an_older_node_move_to_the_catalog() {
    let (dir, store, coll) = filled_store();
    // An index database as nodes before the catalog left it: the definition in its meta
    // keyspace (this JSON is that format), and the next id.
    {
        let db = fjall::Database::builder(index_dir(dir.path())).open().unwrap();
        let meta = db.keyspace("meta", fjall::KeyspaceCreateOptions::default).unwrap();
        let record = json!({"id": 7, "collection_id": coll.id(), "collection": "c", "def": {"name": "old", "keys": ["a"]}});
        meta.insert("def/00000007", record.to_string()).unwrap();
        meta.insert("next_index_id", 8u32.to_be_bytes()).unwrap();
        db.persist(fjall::PersistMode::SyncAll).unwrap();
    }
    assert!(catalog(&store).is_empty());
    life(&store, |mgr| {
        let coll = Arc::clone(&coll);
        async move {
            assert_eq!(scan_ids(&mgr, &coll, "old", json!(3)).await, expected_a3());
            mgr.create(&coll, def("new", "b", false)).await.unwrap();
        }
    });
    let mut entries = catalog(&store);
    entries.sort();
    assert_eq!(entries[1], ("old".to_string(), 7), "moved with its id");
    assert_eq!(entries[0].0, "new");
    assert!(entries[0].1 >= 8, "ids are not reused: {entries:?}");
    // The old copy is gone from the index database: the catalog is the one place.
    {
        let db = fjall::Database::builder(index_dir(dir.path())).open().unwrap();
        let meta = db.keyspace("meta", fjall::KeyspaceCreateOptions::default).unwrap();
        assert_eq!(meta.prefix("def/").count(), 0);
    }
    life(&store, |mgr| {
        let coll = Arc::clone(&coll);
        async move {
            assert_eq!(mgr.list(&coll).len(), 2);
            assert_eq!(scan_ids(&mgr, &coll, "old", json!(3)).await, expected_a3());
            assert_eq!(scan_ids(&mgr, &coll, "new", json!("x9")).await, ["d009"]);
        }
    });
}

#[test]
fn an_unreadable_index_database_is_moved_aside_and_rebuilt() {
    let (dir, store, coll) = filled_store();
    life(&store, |mgr| {
        let coll = Arc::clone(&coll);
        async move {
            mgr.create(&coll, def("by_a", "a", false)).await.unwrap();
            assert_eq!(scan_ids(&mgr, &coll, "by_a", json!(3)).await, expected_a3());
        }
    });
    std::fs::write(index_dir(dir.path()).join("version"), b"not a version").unwrap();
    life(&store, |mgr| {
        let coll = Arc::clone(&coll);
        async move {
            assert_eq!(mgr.rebuilds(), 1);
            let health = mgr.health.report();
            assert!(health.errors >= 1 && health.last_error.as_deref().is_some_and(|e| e.contains("damaged")), "{health:?}");
            put(&coll, "d100", json!({"a": 3}));
            let mut expected = expected_a3();
            expected.push("d100".into());
            assert_eq!(scan_ids(&mgr, &coll, "by_a", json!(3)).await, expected);
        }
    });
    let quarantined: Vec<String> = std::fs::read_dir(dir.path().join("data"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("index.quarantined-"))
        .collect();
    assert_eq!(quarantined.len(), 1, "{quarantined:?}");
    assert_eq!(std::fs::read(dir.path().join("data").join(&quarantined[0]).join("version")).unwrap(), b"not a version");
}

#[test]
fn index_ids_given_by_the_caller_are_kept_and_never_reused() {
    let (_dir, store, coll) = filled_store();
    life(&store, |mgr| {
        let coll = Arc::clone(&coll);
        async move {
            mgr.create_as(&coll, def("given", "a", true), Some(50), None).await.unwrap();
            mgr.create(&coll, def("local", "b", true)).await.unwrap();
            for id in [50, 51, 3] {
                let refused = mgr.create_as(&coll, def(&format!("x{id}"), "a", true), Some(id), None).await;
                assert!(matches!(refused, Err(shoal_index::IndexError::Invalid(_))), "id {id}: {refused:?}");
            }
        }
    });
    let mut ids = catalog(&store);
    ids.sort();
    assert_eq!(ids, [("given".to_string(), 50), ("local".to_string(), 51)]);
    life(&store, |mgr| {
        let coll = Arc::clone(&coll);
        async move {
            mgr.create(&coll, def("after_restart", "a", true)).await.unwrap();
        }
    });
    assert!(catalog(&store).contains(&("after_restart".to_string(), 52)), "{:?}", catalog(&store));
}
