//! The partition map: for every virtual partition, the node holding its active copy and the
//! nodes holding its replicas, with the version the metadata log stores it under.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::{MAP_REPLICAS_MAX, PARTITIONS_MAX};

/// A virtual partition's number, `0..partitions` (as in `shoal-storage`).
pub type PartitionId = u16;

/// A sequence number in a partition's change stream (as in `shoal-storage`).
pub type SeqNo = u64;

/// A cluster member's id, given once when it joins and never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeId(pub u64);

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "n{}", self.0)
    }
}

/// Where one partition's copies live: one active copy (serves reads and writes, sequences
/// changes) and replicas that follow its change stream, all on distinct nodes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Copies {
    pub active: NodeId,
    pub replicas: Vec<NodeId>,
}

impl Copies {
    /// Every node with a copy, the active first.
    pub fn nodes(&self) -> impl Iterator<Item = NodeId> + '_ {
        std::iter::once(self.active).chain(self.replicas.iter().copied())
    }

    /// Whether `node` holds a copy (active or replica).
    pub fn holds(&self, node: NodeId) -> bool {
        self.active == node || self.replicas.contains(&node)
    }
}

/// The partition map: `partitions[p]` says where partition `p` lives. `version` rises with
/// every change, so a node or client can tell a stale map (`not_my_partition` carries it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionMap {
    pub version: u64,
    pub partitions: Vec<Copies>,
}

/// Why a map is not well formed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum MapError {
    #[error("a map needs 1 to {PARTITIONS_MAX} partitions, not {0}")]
    PartitionCount(usize),
    #[error("partition {partition} has {replicas} replicas; at most {MAP_REPLICAS_MAX} (a rebalance's copies included)")]
    TooManyReplicas { partition: PartitionId, replicas: usize },
    #[error("partition {partition} has two copies on node {node}")]
    DuplicateNode { partition: PartitionId, node: NodeId },
}

impl PartitionMap {
    /// The number of partitions.
    pub fn partition_count(&self) -> u16 {
        // `check` bounds the count by `PARTITIONS_MAX`; a map built elsewhere is checked first.
        u16::try_from(self.partitions.len()).unwrap_or(u16::MAX)
    }

    /// Every partition with its copies.
    pub fn iter(&self) -> impl Iterator<Item = (PartitionId, &Copies)> {
        (0..=PartitionId::MAX).zip(self.partitions.iter())
    }

    /// Checks the map's shape: 1..=`PARTITIONS_MAX` partitions, at most `MAP_REPLICAS_MAX`
    /// replicas each (a rebalance's build map holds more than `REPLICAS_MAX`), and every copy of a partition on a distinct node. A map read from the
    /// log or the network is checked before it is used.
    pub fn check(&self) -> Result<(), MapError> {
        let count = self.partitions.len();
        if count == 0 || count > usize::from(PARTITIONS_MAX) {
            return Err(MapError::PartitionCount(count));
        }
        for (partition, copies) in self.iter() {
            if copies.replicas.len() > MAP_REPLICAS_MAX {
                return Err(MapError::TooManyReplicas { partition, replicas: copies.replicas.len() });
            }
            let nodes: Vec<NodeId> = copies.nodes().collect();
            for (i, node) in nodes.iter().enumerate() {
                if nodes[..i].contains(node) {
                    return Err(MapError::DuplicateNode { partition, node: *node });
                }
            }
        }
        Ok(())
    }

    /// How many active and replica copies `node` holds.
    pub fn load(&self, node: NodeId) -> (usize, usize) {
        let active = self.partitions.iter().filter(|c| c.active == node).count();
        let replica = self.partitions.iter().filter(|c| c.replicas.contains(&node)).count();
        (active, replica)
    }

    /// Every node named in the map, in id order.
    pub fn nodes(&self) -> Vec<NodeId> {
        let mut nodes: Vec<NodeId> = self.partitions.iter().flat_map(Copies::nodes).collect();
        nodes.sort_unstable();
        nodes.dedup();
        nodes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(rows: &[(u64, &[u64])]) -> PartitionMap {
        PartitionMap {
            version: 7,
            partitions: rows.iter().map(|(a, r)| Copies { active: NodeId(*a), replicas: r.iter().map(|n| NodeId(*n)).collect() }).collect(),
        }
    }

    #[test]
    fn check_table() {
        let cases: &[(PartitionMap, Result<(), MapError>)] = &[
            (map(&[(1, &[2]), (2, &[1])]), Ok(())),
            (map(&[]), Err(MapError::PartitionCount(0))),
            (map(&[(1, &[2]), (2, &[2])]), Err(MapError::DuplicateNode { partition: 1, node: NodeId(2) })),
            (map(&[(1, &[3, 3])]), Err(MapError::DuplicateNode { partition: 0, node: NodeId(3) })),
            (map(&[(1, &[2, 3, 4, 5])]), Ok(())),
            (map(&[(1, &[2, 3, 4, 5, 6, 7, 8, 9])]), Err(MapError::TooManyReplicas { partition: 0, replicas: 8 })),
        ];
        for (m, want) in cases {
            assert_eq!(&m.check(), want, "{m:?}");
        }
    }

    #[test]
    fn serde_shape_is_api_md() {
        let m = map(&[(1, &[2])]);
        let json = serde_json::to_string(&m).unwrap();
        assert_eq!(json, r#"{"version":7,"partitions":[{"active":1,"replicas":[2]}]}"#);
        assert_eq!(serde_json::from_str::<PartitionMap>(&json).unwrap(), m);
        assert_eq!(m.load(NodeId(1)), (1, 0));
        assert_eq!(m.nodes(), vec![NodeId(1), NodeId(2)]);
    }
}
