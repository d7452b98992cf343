//! Scans of indexes placed on index nodes (issue 41; Couchbase GSI's scatter to index
//! partitions): a scan goes to one copy of each index partition it needs — an `eq` on the
//! leading key to one partition, anything else to each of the index's partitions once —
//! never to every member, so its cost depends on the index's partitions, not on the data
//! partitions or the nodes. The copy is this node's when it holds one, otherwise one on a
//! live index node, the copies taking turns; a copy that fails the scan (down, cut off, not
//! caught up) is replaced by another once. Each holder answers from its parts alone
//! (`Op::IndexScan`, [`serve_part_scan`]), waiting for `request_plus` until its parts reach
//! the actives' positions at its start (after this scan's). The answers are merged in index
//! order. A part with no live copy refuses the scan: never a short answer.
//!
//! Used by the server's scan endpoint and by SQL ([`crate::sql`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use shoal_cluster::NodeId;
use shoal_index::{Consistency, ScanBounds, ScanRequest, ScanRow};
use shoal_meta::{IndexDef, MemberState, MetaState};

use crate::peers::Op;
use crate::{ClusterError, ClusterNode};

/// How many times a scan asks another copy for the parts of one that failed it.
pub const ROUTED_SCAN_RETRIES: usize = 1;
/// A holder's part of a scan has its own timeout, plus this for the call.
const PART_SCAN_SLACK: Duration = Duration::from_secs(5);

/// Spreads scans over the copies of each index partition.
static SCAN_TURN: AtomicUsize = AtomicUsize::new(0);

/// What a routed scan reads.
#[derive(Clone, Debug)]
pub struct RoutedScan {
    pub bounds: ScanBounds,
    pub limit: usize,
    pub descending: bool,
    pub consistency: Consistency,
    pub timeout: Duration,
}

/// A holder's part of a routed scan: its parts of one index.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PartScanRequest {
    pub collection: String,
    pub index: String,
    /// The index the placement was read for (one dropped and made again is another).
    pub index_id: u32,
    pub parts: Vec<u16>,
    pub bounds: ScanBounds,
    pub limit: usize,
    pub descending: bool,
    pub request_plus: bool,
    pub timeout_ms: u64,
}

/// A holder's rows, in index order: (key, document key).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PartScanAnswer {
    pub rows: Vec<(Vec<Value>, String)>,
}

/// The definition of index `name` of `collection` in `state` when it is placed on index
/// nodes.
pub fn placed_index<'a>(state: &'a MetaState, collection: &str, name: &str) -> Option<&'a IndexDef> {
    state.indexes.get(collection).and_then(|by_name| by_name.get(name)).filter(|d| d.is_placed())
}

/// For each index partition in `parts`, the copy that reads it: `me`'s when it holds one,
/// else one on a live index node not `excluded` (active, or leaving: it holds its copies
/// until the rebalance has built them elsewhere), the copies taking turns by `turn`. Grouped
/// by node; `Err` names a part with no such copy.
pub fn pick_copies(
    state: &MetaState,
    def: &IndexDef,
    parts: &[u16],
    me: NodeId,
    excluded: &BTreeSet<NodeId>,
    turn: usize,
) -> Result<BTreeMap<NodeId, Vec<u16>>, u16> {
    let live = |id: &NodeId| {
        !excluded.contains(id) && state.members.get(id).is_some_and(|m| matches!(m.state, MemberState::Active | MemberState::Leaving))
    };
    let mut groups: BTreeMap<NodeId, Vec<u16>> = BTreeMap::new();
    for &p in parts {
        let copies = def.placement.get(usize::from(p)).map(Vec::as_slice).unwrap_or_default();
        let pick = if copies.contains(&me) && live(&me) {
            me
        } else {
            let up: Vec<&NodeId> = copies.iter().filter(|id| live(id)).collect();
            *up.get(turn % up.len().max(1)).copied().ok_or(p)?
        };
        groups.entry(pick).or_default().push(p);
    }
    Ok(groups)
}

/// Rows of several holders, each in index order, merged in index order (descending if
/// asked), the first `limit`.
pub fn merge_rows(answers: Vec<Vec<ScanRow>>, descending: bool, limit: usize) -> Vec<ScanRow> {
    let mut rows: Vec<(Vec<u8>, ScanRow)> =
        answers.into_iter().flatten().map(|row| (shoal_index::keycode::row_order(&row.key, &row.id), row)).collect();
    rows.sort_by(|a, b| if descending { b.0.cmp(&a.0) } else { a.0.cmp(&b.0) });
    rows.truncate(limit);
    rows.into_iter().map(|(_, row)| row).collect()
}

impl ClusterNode {
    /// Scans index `def` of `coll` where its partitions are placed (see the module doc),
    /// by the placement in `state` (the metadata the scan pins).
    pub async fn routed_scan(
        self: &Arc<Self>,
        state: &MetaState,
        coll: &Arc<shoal_storage::Collection>,
        def: &IndexDef,
        scan: RoutedScan,
    ) -> Result<Vec<ScanRow>, ClusterError> {
        let count = u16::try_from(def.placement.len()).map_err(|_| ClusterError::BadMessage("an index with too many partitions".into()))?;
        let turn = SCAN_TURN.fetch_add(1, Ordering::Relaxed);
        let mut pending = shoal_index::partition::parts_of_scan(&scan.bounds, count);
        let mut excluded: BTreeSet<NodeId> = BTreeSet::new();
        let mut answers: Vec<Vec<ScanRow>> = Vec::new();
        for attempt in 0..=ROUTED_SCAN_RETRIES {
            let mut groups = pick_copies(state, def, &pending, self.id, &excluded, turn).map_err(|p| {
                ClusterError::Timeout(format!(
                    "index {}: partition {p} has no copy on a live index node; retry after a recovery or a rebalance",
                    def.name
                ))
            })?;
            pending.clear();
            let local = groups.remove(&self.id);
            let remote: Vec<(NodeId, Vec<u16>)> = groups.into_iter().collect();
            let calls = remote.iter().map(|(id, parts)| self.part_scan(state, coll, def, *id, parts.clone(), &scan));
            let local_scan = async {
                let Some(parts) = local else { return Ok(None) };
                let req = ScanRequest {
                    bounds: scan.bounds.clone(),
                    limit: scan.limit,
                    descending: scan.descending,
                    consistency: scan.consistency,
                    timeout: scan.timeout,
                    keep: None,
                    parts: Some(parts),
                };
                self.engine.indexes().scan(coll, &def.name, req).await.map(Some)
            };
            let (answered, local_rows) = tokio::join!(futures::future::join_all(calls), local_scan);
            answers.extend(local_rows?);
            let mut failed: Option<ClusterError> = None;
            for ((id, parts), answer) in remote.into_iter().zip(answered) {
                match answer {
                    Ok(rows) => answers.push(rows),
                    // A scan writes nothing: asking another copy is safe.
                    Err(e) if attempt < ROUTED_SCAN_RETRIES => {
                        tracing::debug!(node = id.0, error = %e, "an index copy failed a scan; asking another");
                        excluded.insert(id);
                        pending.extend(parts);
                    }
                    Err(e) => failed = Some(e),
                }
            }
            if let Some(e) = failed {
                return Err(e);
            }
            if pending.is_empty() {
                break;
            }
        }
        Ok(merge_rows(answers, scan.descending, scan.limit))
    }

    /// Asks `holder` for its `parts` of the scan.
    async fn part_scan(
        &self,
        state: &MetaState,
        coll: &shoal_storage::Collection,
        def: &IndexDef,
        holder: NodeId,
        parts: Vec<u16>,
        scan: &RoutedScan,
    ) -> Result<Vec<ScanRow>, ClusterError> {
        let address = state.members.get(&holder).map(|m| m.address.clone()).ok_or(ClusterError::NodeNotFound(holder))?;
        let req = PartScanRequest {
            collection: coll.name().to_string(),
            index: def.name.clone(),
            index_id: def.id,
            parts,
            bounds: scan.bounds.clone(),
            limit: scan.limit,
            descending: scan.descending,
            request_plus: scan.consistency == Consistency::RequestPlus,
            timeout_ms: u64::try_from(scan.timeout.as_millis()).unwrap_or(u64::MAX),
        };
        let body = serde_json::to_vec(&req).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
        let bytes = self.peers.call(&address, Op::IndexScan, body, scan.timeout + PART_SCAN_SLACK).await?;
        let answer: PartScanAnswer = serde_json::from_slice(&bytes).map_err(|e| ClusterError::BadMessage(e.to_string()))?;
        Ok(answer.rows.into_iter().map(|(key, id)| ScanRow { key, id }).collect())
    }
}

/// A holder's side of `Op::IndexScan`: its parts of the scan, read here alone. Refused when
/// the index is not the one placed (dropped, or made again under its name) or a part is
/// not held here (the placement moved: the asking node asks another copy).
pub(crate) async fn serve_part_scan(node: &ClusterNode, req: PartScanRequest) -> Result<PartScanAnswer, ClusterError> {
    let state = node.state();
    if placed_index(&state, &req.collection, &req.index).is_none_or(|d| d.id != req.index_id) {
        return Err(ClusterError::Index(shoal_index::IndexError::NotFound(req.index)));
    }
    let coll = node
        .engine
        .store()
        .collection(&req.collection)
        .ok_or_else(|| ClusterError::Refused(format!("no collection {}", req.collection)))?;
    let timeout = Duration::from_millis(req.timeout_ms).min(shoal_index::SCAN_TIMEOUT_MAX);
    let scan = ScanRequest {
        bounds: req.bounds,
        limit: req.limit.min(shoal_index::SCAN_ROWS_MAX),
        descending: req.descending,
        consistency: if req.request_plus { Consistency::RequestPlus } else { Consistency::NotBounded },
        timeout,
        keep: None,
        parts: Some(req.parts),
    };
    let rows = node.engine.indexes().scan(&coll, &req.index, scan).await?;
    Ok(PartScanAnswer { rows: rows.into_iter().map(|r| (r.key, r.id)).collect() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_meta::{Member, Services};

    #[test]
    fn each_part_is_read_from_this_node_or_a_live_copy_taking_turns() {
        let mut state = MetaState::default();
        let index_only = Services { data: false, index: true, query: false };
        for (id, member_state) in [(1, MemberState::Active), (2, MemberState::Active), (3, MemberState::Failed)] {
            state.members.insert(NodeId(id), Member { address: format!("n{id}"), state: member_state, services: index_only });
        }
        let def = IndexDef {
            collection: "c".into(),
            name: "i".into(),
            id: 1,
            definition: serde_json::json!({"keys": ["a"]}),
            built: false,
            placement: vec![vec![NodeId(1), NodeId(2)], vec![NodeId(2), NodeId(1)], vec![NodeId(3)], vec![NodeId(3), NodeId(2)]],
        };
        let none = BTreeSet::new();
        let groups = |parts: &[u16], me: u64, excluded: &BTreeSet<NodeId>, turn: usize| {
            pick_copies(&state, &def, parts, NodeId(me), excluded, turn).map(|g| g.into_iter().map(|(n, p)| (n.0, p)).collect::<Vec<_>>())
        };
        // (what, parts, me, excluded, turn, answer)
        type Case<'a> = (&'a str, &'a [u16], u64, BTreeSet<NodeId>, usize, Result<Vec<(u64, Vec<u16>)>, u16>);
        let cases: [Case; 6] = [
            ("this node's copies first", &[0, 1], 1, none.clone(), 0, Ok(vec![(1, vec![0, 1])])),
            ("a node holding none: the copies take turns", &[0, 1], 9, none.clone(), 0, Ok(vec![(1, vec![0]), (2, vec![1])])),
            ("the next turn", &[0, 1], 9, none.clone(), 1, Ok(vec![(1, vec![1]), (2, vec![0])])),
            ("a failed copy is never read", &[3], 9, none.clone(), 0, Ok(vec![(2, vec![3])])),
            ("no live copy: refused, naming the part", &[0, 2], 9, none.clone(), 0, Err(2)),
            ("a copy that failed the scan is passed over", &[0], 1, BTreeSet::from([NodeId(1)]), 0, Ok(vec![(2, vec![0])])),
        ];
        for (what, parts, me, excluded, turn, want) in cases {
            assert_eq!(groups(parts, me, &excluded, turn), want, "{what}");
        }
    }

    #[test]
    fn merged_rows_follow_the_index_order_and_the_limit() {
        let row = |k: i64, id: &str| ScanRow { key: vec![Value::from(k)], id: id.into() };
        let answers = vec![vec![row(1, "b"), row(3, "a")], vec![row(1, "a"), row(2, "z")]];
        let ids = |rows: Vec<ScanRow>| rows.into_iter().map(|r| r.id).collect::<Vec<_>>();
        assert_eq!(ids(merge_rows(answers.clone(), false, 10)), ["a", "b", "z", "a"]);
        assert_eq!(ids(merge_rows(answers, true, 2)), ["a", "z"]);
    }
}
