//! The moves between two maps: which copies must be built (and where from), which dropped,
//! and which replicas become active without copying anything.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::map::{NodeId, PartitionId, PartitionMap};

/// The role a copy has in the new map.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Active,
    Replica,
}

/// A copy to build on `to`, taking `role` once it has caught up. `from` is the node whose
/// copy of the partition this one replaces (dropped once the new copy serves), or `None`
/// when the partition simply gains a copy. The data comes from the partition's active copy
/// in the old map, whoever `from` is; where that node is down (a failed node's partition
/// without a replica), the move waits for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Move {
    pub partition: PartitionId,
    pub from: Option<NodeId>,
    pub to: NodeId,
    pub role: Role,
}

/// A copy that already exists becomes active: an ownership switch, no data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Promotion {
    pub partition: PartitionId,
    pub from: NodeId,
    pub to: NodeId,
}

/// A copy dropped without a replacement (fewer replicas than before).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DropCopy {
    pub partition: PartitionId,
    pub node: NodeId,
}

/// Everything that turns one map into the next, in partition order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RebalancePlan {
    pub moves: Vec<Move>,
    pub promotions: Vec<Promotion>,
    pub drops: Vec<DropCopy>,
}

impl RebalancePlan {
    /// Bytes the moves copy, given each partition's size.
    pub fn bytes(&self, partition_bytes: impl Fn(PartitionId) -> u64) -> u64 {
        self.moves.iter().map(|m| partition_bytes(m.partition)).sum()
    }

    /// Whether the maps differ in nothing but their version.
    pub fn is_empty(&self) -> bool {
        self.moves.is_empty() && self.promotions.is_empty() && self.drops.is_empty()
    }
}

/// Why two maps cannot be compared.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PlanError {
    #[error("the maps have {old} and {new} partitions; the partition count never changes")]
    PartitionCount { old: usize, new: usize },
}

/// The moves from `old` to `new`: per partition, one build for every node that gains a
/// copy, paired with a node that loses one where there is one (the new active's build
/// first, the old active's copy first), and a promotion where the new active already held
/// a copy. Nothing else: a copy on a node that keeps it never moves, so the plan is the
/// minimum for these two maps and restoring replicas after a failover builds only the
/// missing copies.
pub fn plan_moves(old: &PartitionMap, new: &PartitionMap) -> Result<RebalancePlan, PlanError> {
    if old.partitions.len() != new.partitions.len() {
        return Err(PlanError::PartitionCount { old: old.partitions.len(), new: new.partitions.len() });
    }
    let mut plan = RebalancePlan::default();
    for ((partition, before), (_, after)) in old.iter().zip(new.iter()) {
        let mut gone = before.nodes().filter(|n| !after.holds(*n));
        for to in after.nodes().filter(|n| !before.holds(*n)) {
            let role = if to == after.active { Role::Active } else { Role::Replica };
            plan.moves.push(Move { partition, from: gone.next(), to, role });
        }
        plan.drops.extend(gone.map(|node| DropCopy { partition, node }));
        if after.active != before.active && before.holds(after.active) {
            plan.promotions.push(Promotion { partition, from: before.active, to: after.active });
        }
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::map::Copies;

    fn map(rows: &[(u64, &[u64])]) -> PartitionMap {
        PartitionMap {
            version: 1,
            partitions: rows.iter().map(|(a, r)| Copies { active: NodeId(*a), replicas: r.iter().map(|n| NodeId(*n)).collect() }).collect(),
        }
    }

    fn mv(partition: PartitionId, from: Option<u64>, to: u64, role: Role) -> Move {
        Move { partition, from: from.map(NodeId), to: NodeId(to), role }
    }

    #[test]
    fn plan_table() {
        struct Case {
            name: &'static str,
            old: PartitionMap,
            new: PartitionMap,
            moves: Vec<Move>,
            promotions: Vec<(PartitionId, u64, u64)>,
            drops: Vec<(PartitionId, u64)>,
        }
        let cases = [
            Case { name: "unchanged", old: map(&[(1, &[2])]), new: map(&[(1, &[2])]), moves: vec![], promotions: vec![], drops: vec![] },
            Case {
                name: "replica order only",
                old: map(&[(1, &[2, 3])]),
                new: map(&[(1, &[3, 2])]),
                moves: vec![],
                promotions: vec![],
                drops: vec![],
            },
            Case {
                name: "swap: replica moves from leaving 3 to new 4",
                old: map(&[(1, &[3])]),
                new: map(&[(1, &[4])]),
                moves: vec![mv(0, Some(3), 4, Role::Replica)],
                promotions: vec![],
                drops: vec![],
            },
            Case {
                name: "active moves: built on 4, then switched",
                old: map(&[(3, &[1])]),
                new: map(&[(4, &[1])]),
                moves: vec![mv(0, Some(3), 4, Role::Active)],
                promotions: vec![],
                drops: vec![],
            },
            Case {
                name: "promotion without data",
                old: map(&[(1, &[2])]),
                new: map(&[(2, &[1])]),
                moves: vec![],
                promotions: vec![(0, 1, 2)],
                drops: vec![],
            },
            Case {
                name: "after failover: only the missing replica is built",
                old: map(&[(2, &[])]),
                new: map(&[(2, &[3])]),
                moves: vec![mv(0, None, 3, Role::Replica)],
                promotions: vec![],
                drops: vec![],
            },
            Case {
                name: "fewer replicas: a drop",
                old: map(&[(1, &[2, 3])]),
                new: map(&[(1, &[2])]),
                moves: vec![],
                promotions: vec![],
                drops: vec![(0, 3)],
            },
            Case {
                name: "promotion and a new replica where the old active leaves",
                old: map(&[(1, &[2])]),
                new: map(&[(2, &[3])]),
                moves: vec![mv(0, Some(1), 3, Role::Replica)],
                promotions: vec![(0, 1, 2)],
                drops: vec![],
            },
        ];
        for case in cases {
            let plan = plan_moves(&case.old, &case.new).unwrap();
            assert_eq!(plan.moves, case.moves, "{}", case.name);
            let promotions: Vec<Promotion> =
                case.promotions.iter().map(|(p, f, t)| Promotion { partition: *p, from: NodeId(*f), to: NodeId(*t) }).collect();
            assert_eq!(plan.promotions, promotions, "{}", case.name);
            let drops: Vec<DropCopy> = case.drops.iter().map(|(p, n)| DropCopy { partition: *p, node: NodeId(*n) }).collect();
            assert_eq!(plan.drops, drops, "{}", case.name);
        }
        assert_eq!(plan_moves(&map(&[(1, &[])]), &map(&[(1, &[]), (1, &[])])), Err(PlanError::PartitionCount { old: 1, new: 2 }));
    }
}
