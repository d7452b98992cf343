//! Collection ids given by the caller (a cluster's metadata log assigns them): kept across
//! restarts, never reused, and the store's own counter moves past them.

use shoal_storage::{CollectionError, Store, StoreConfig};

fn open(dir: &std::path::Path) -> std::sync::Arc<Store> {
    let config = StoreConfig { data_paths: vec![dir.to_path_buf()], partitions: Some(2), ..StoreConfig::default() };
    Store::open(config).unwrap()
}

#[test]
fn given_ids_are_kept_and_never_reused() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    assert_eq!(store.create_collection("local", 0).unwrap().id(), 1);
    assert_eq!(store.create_collection_as("given", 0, Some(42)).unwrap().id(), 42);
    // The counter moved past the given id.
    assert_eq!(store.create_collection("after", 0).unwrap().id(), 43);
    // In use, below the counter (retired or live), or the reserved last value: refused.
    for id in [42, 43, 7, u32::MAX] {
        match store.create_collection_as(&format!("x{id}"), 0, Some(id)) {
            Err(CollectionError::IdTaken { id: got, next: 44 }) => assert_eq!(got, id),
            other => panic!("id {id}: {:?}", other.map(|c| c.id())),
        }
    }
    // A dropped collection's id stays retired.
    store.drop_collection("given").unwrap();
    assert!(matches!(store.create_collection_as("given", 0, Some(42)), Err(CollectionError::IdTaken { .. })));
    assert_eq!(store.create_collection_as("given", 0, Some(100)).unwrap().id(), 100);
    drop(store);

    let store = open(dir.path());
    assert_eq!(store.collection("given").map(|c| c.id()), Some(100), "a given id survives a restart");
    assert_eq!(store.collection("local").map(|c| c.id()), Some(1));
    assert_eq!(store.create_collection("later", 0).unwrap().id(), 101);
}
