//! SQL on a cluster member that holds only some partitions active (the interim design of
//! ARCHITECTURE.md, until indexes and shadows are placed as a service): the node runs the
//! whole statement, reads the partitions active here itself, and pages the documents of
//! the others from the members holding them active. Filters, joins and aggregates all run
//! here, so every statement means what it means on one node. What this crate knows of the
//! members is only [`RemoteDocs`]: the transport is the node crate's.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use shoal_storage::{partition_of, PartitionId};

/// Documents asked of a member per call while scanning it.
pub const REMOTE_PAGE_DOCS: usize = crate::SCAN_BATCH_ROWS;

/// Why a member could not give its part (the query fails as `unavailable`: try again).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct RemoteError(pub String);

/// Indexes placed on index nodes (issue 41): read where their partitions are, not from
/// this node's index database; the node crate routes the scan.
#[async_trait]
pub trait PlacedIndexes: Send + Sync + std::fmt::Debug {
    /// The document keys of index `index` of `collection` within `bounds`, at most `limit`,
    /// read where the index's partitions are placed; `None` when the index is not placed
    /// (this node's index database holds it).
    async fn keys(
        &self,
        collection: &str,
        index: &str,
        bounds: &shoal_index::ScanBounds,
        consistency: shoal_index::Consistency,
        timeout: std::time::Duration,
        limit: usize,
    ) -> Result<Option<Vec<String>>, RemoteError>;
}

/// The members' side of a spread query.
#[async_trait]
pub trait RemoteDocs: Send + Sync {
    /// Up to `max` live documents of `collection` that `member` holds active, in key order,
    /// after `after` (from the first when `None`); none at the end (a page may hold fewer
    /// than `max` before it, when the member's answer reached its byte budget).
    async fn scan(&self, member: &str, collection: &str, after: Option<Bytes>, max: usize) -> Result<Vec<(Bytes, Bytes)>, RemoteError>;
    /// The live documents among `keys` (all held active by `member`).
    async fn get(&self, member: &str, collection: &str, keys: Vec<Bytes>) -> Result<Vec<(Bytes, Bytes)>, RemoteError>;
}

/// Where each partition is read for one query.
pub struct Spread {
    /// Per partition: `None` when it is active here, or the member holding it active.
    pub owners: Vec<Option<String>>,
    pub remote: Arc<dyn RemoteDocs>,
}

impl std::fmt::Debug for Spread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spread").field("owners", &self.owners).finish_non_exhaustive()
    }
}

impl Spread {
    /// The members other than this node that hold some partition active, each once.
    pub fn members(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for m in self.owners.iter().flatten() {
            if !out.contains(m) {
                out.push(m.clone());
            }
        }
        out
    }

    /// Whether partition `p` is read here.
    pub fn here(&self, p: PartitionId) -> bool {
        self.owners.get(usize::from(p)).is_some_and(Option::is_none)
    }

    /// The member holding `key`'s partition active, or `None` for this node.
    pub fn owner_of(&self, key: &[u8]) -> Option<&str> {
        let count = u16::try_from(self.owners.len()).unwrap_or(u16::MAX);
        self.owners.get(usize::from(partition_of(key, count))).and_then(|o| o.as_deref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Nobody;

    #[async_trait]
    impl RemoteDocs for Nobody {
        async fn scan(&self, _: &str, _: &str, _: Option<Bytes>, _: usize) -> Result<Vec<(Bytes, Bytes)>, RemoteError> {
            Ok(Vec::new())
        }
        async fn get(&self, _: &str, _: &str, _: Vec<Bytes>) -> Result<Vec<(Bytes, Bytes)>, RemoteError> {
            Ok(Vec::new())
        }
    }

    #[test]
    fn owners_place_keys_and_list_members_once() {
        let a = Some("a:1".to_string());
        let b = Some("b:1".to_string());
        let spread = Spread { owners: vec![None, a.clone(), b.clone(), a.clone()], remote: Arc::new(Nobody) };
        assert_eq!(spread.members(), vec!["a:1".to_string(), "b:1".to_string()]);
        assert!(spread.here(0));
        assert!(!spread.here(1));
        assert!(!spread.here(9), "a partition past the map is not here");
        for i in 0..200 {
            let key = format!("k{i}");
            let p = partition_of(key.as_bytes(), 4);
            assert_eq!(spread.owner_of(key.as_bytes()), spread.owners[usize::from(p)].as_deref());
        }
    }
}
