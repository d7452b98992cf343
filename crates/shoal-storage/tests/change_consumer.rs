//! `follow` over a real collection: a consumer that stores its positions with its data ends
//! with every document's latest state, whatever the batch limits, and a second call reads
//! only what came since.

use std::collections::{BTreeMap, HashMap};

use bytes::Bytes;
use shoal_storage::{
    follow, ChangeConsumer, ChangesError, FollowLimits, PartitionBatch, PartitionId, SeqNo, Store, StoreConfig, StreamPosition, WriteOp,
    WriteRequest,
};

fn upsert(key: &str, n: u32) -> WriteRequest {
    WriteRequest {
        key: Bytes::copy_from_slice(key.as_bytes()),
        op: WriteOp::Upsert,
        value: Some(Bytes::from(format!("{n}"))),
        cas: None,
        expiry: 0,
    }
}

fn remove(key: &str) -> WriteRequest {
    WriteRequest { key: Bytes::copy_from_slice(key.as_bytes()), op: WriteOp::Remove, value: None, cas: None, expiry: 0 }
}

/// Documents by key, and positions by partition, changed together.
#[derive(Default)]
struct Mirror {
    docs: BTreeMap<String, Bytes>,
    positions: HashMap<PartitionId, StreamPosition>,
    handed: usize,
}

impl ChangeConsumer for Mirror {
    type Error = ChangesError;

    fn position(&self, p: PartitionId) -> StreamPosition {
        self.positions.get(&p).copied().unwrap_or_default()
    }

    fn rollback(&mut self, _: PartitionId, _: SeqNo) -> Result<(), ChangesError> {
        panic!("a clean store never rolls back");
    }

    fn apply(&mut self, batch: &[PartitionBatch]) -> Result<(), ChangesError> {
        for part in batch {
            for c in &part.changes {
                let key = String::from_utf8(c.key.to_vec()).unwrap();
                match (&c.value, c.deleted) {
                    (Some(v), false) => drop(self.docs.insert(key, v.clone())),
                    _ => drop(self.docs.remove(&key)),
                }
            }
            self.handed += part.changes.len();
            self.positions.insert(part.partition, part.position);
        }
        Ok(())
    }
}

#[test]
fn a_consumer_ends_with_every_documents_latest_state() {
    let dir = tempfile::tempdir().unwrap();
    let store =
        Store::open(StoreConfig { data_paths: vec![dir.path().to_path_buf()], partitions: Some(8), ..StoreConfig::default() }).unwrap();
    let coll = store.create_collection("c", 0).unwrap();
    let mut expected = BTreeMap::new();
    let partitions: Vec<PartitionId> = (0..coll.partition_count()).collect();
    let mut mirror = Mirror::default();
    for (round, limits) in [(1usize, 3usize), (3, 1000), (2, 7)].into_iter().enumerate() {
        let (batch, per_partition) = limits;
        for i in 0..300u32 {
            let key = format!("k{}", (i * 7 + round as u32) % 120);
            if i % 11 == 0 {
                coll.write(remove(&key)).ok();
                expected.remove(&key);
            } else {
                let _ = coll.write(upsert(&key, i)).unwrap();
                expected.insert(key, Bytes::from(format!("{i}")));
            }
        }
        let limits =
            FollowLimits { batch_changes: batch, partition_changes_max: per_partition, total_changes_max: usize::MAX, include_docs: true };
        // Bounded calls, as a maintainer's rounds, until caught up.
        while follow(&*coll, &partitions, limits, &mut mirror).unwrap() > 0 {}
        assert_eq!(mirror.docs, expected, "round {round}");
        let positions = coll.positions();
        for p in &partitions {
            assert_eq!(mirror.position(*p), positions[usize::from(*p)]);
        }
        // Nothing new: nothing handed over.
        let handed = mirror.handed;
        assert_eq!(follow(&*coll, &partitions, limits, &mut mirror).unwrap(), 0);
        assert_eq!(mirror.handed, handed);
    }
}
