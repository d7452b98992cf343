//! SQL across the members (the interim design of ARCHITECTURE.md): the member a statement
//! reaches runs it whole, reading the partitions active on it itself and paging the others'
//! documents from the members holding them active ([`shoal_query::spread`]). Both sides of
//! that paging are here: [`ClusterNode::spread`] for the asking member, [`serve_docs`] for
//! the asked one. A member asked under another map version refuses, so a query that ran
//! across a hand-over fails (and is run again) instead of missing or doubling rows.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use shoal_query::distributed::{ClusterAnalytics, ShadowMembers};
use shoal_query::spread::{PlacedIndexes, RemoteDocs, RemoteError, Spread};

use crate::peers::Op;
use crate::wire::{self, DocsAnswer, DocsRequest};
use crate::{ClusterError, ClusterNode};

/// Most bytes of documents in one answer (at least one document always goes, however big).
pub const DOCS_ANSWER_MAX_BYTES: usize = 16 * 1024 * 1024;
/// Most documents one answer holds.
pub const DOCS_ANSWER_MAX_DOCS: u32 = 8192;
/// Longest an asked member waits for the map version the query pinned, when the asking
/// member applied it first.
const SAME_MAP_WAIT: Duration = Duration::from_secs(1);
/// A call for documents has this long.
const DOCS_CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// A member's preparation of a distributed analytics statement has the statement's own
/// wait and this much more.
const FIELDS_CALL_SLACK: Duration = Duration::from_secs(5);
/// How often a running distributed statement's coordinator looks whether one of its
/// members was failed over ([`ShadowMembers::member_gone`]).
const MEMBER_CHECK_INTERVAL: Duration = Duration::from_millis(250);

/// A coordinator of a distributed statement asks a member for its shadows' fields, once
/// they can be read (`shoal_query::distributed`): every table of the statement in one call.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ShadowFieldsRequest {
    /// One to `shoal_query::distributed::FIELDS_TABLES_MAX` collections, answered in order.
    pub collections: Vec<String>,
    pub map_version: u64,
    pub request_plus: bool,
    pub timeout_ms: u64,
    /// Only if the shadow holds every write made so far (`/v1/query` reads it so).
    #[serde(default)]
    pub current: bool,
}

impl ClusterNode {
    /// The members an analytics statement run here by `state`'s map (the version it pins)
    /// runs on: those holding some partition active, this node among them when it does.
    /// `None` when every partition is active here (the statement reads this node alone).
    pub fn analytics_members(self: &Arc<Self>, state: &shoal_meta::MetaState) -> Result<Option<Arc<ClusterAnalytics>>, u16> {
        let owners = self.active_owners_in(state)?;
        if owners.iter().all(Option::is_none) {
            return Ok(None);
        }
        let mut members: Vec<String> = owners.into_iter().map(|o| o.unwrap_or_else(|| self.address().to_string())).collect();
        members.sort_unstable();
        members.dedup();
        let remote = Members { node: Arc::clone(self), map_version: state.map_version() };
        Ok(Some(Arc::new(ClusterAnalytics { map_version: state.map_version(), members, remote: Arc::new(remote) })))
    }

    /// Per partition, whether it is active here under map `map_version`: what a worker's
    /// task of a distributed statement reads. Refused when this node serves nothing or its
    /// map is another one.
    pub fn actives_at(&self, map_version: u64) -> Result<Vec<bool>, String> {
        if !self.serving() {
            return Err("this member lost contact with the metadata leader; it serves nothing now".into());
        }
        let state = self.state();
        let version = state.map_version();
        if version != map_version {
            return Err(format!(
                "the partition map changed during the query (version {version} here, {map_version} when it started); run it again"
            ));
        }
        let partitions = usize::from(self.engine.store().partitions());
        Ok(self.actives_here_in(&state).unwrap_or_else(|| vec![true; partitions]))
    }
}

impl ClusterNode {
    /// Where a SQL statement run here reads each partition by `state`'s map (the version the
    /// statement pins): `None` when every partition is active here (or there is no map), so
    /// the statement reads this node alone.
    pub fn spread(self: &Arc<Self>, state: &shoal_meta::MetaState) -> Result<Option<Arc<Spread>>, u16> {
        let owners = self.active_owners_in(state)?;
        if owners.iter().all(Option::is_none) {
            return Ok(None);
        }
        let remote = Members { node: Arc::clone(self), map_version: state.map_version() };
        Ok(Some(Arc::new(Spread { owners, remote: Arc::new(remote) })))
    }
}

impl ClusterNode {
    /// How a SQL statement run here reads indexes placed on index nodes, by `state` (the
    /// metadata it pins): `None` when no index is placed. An index whose every partition is
    /// here, on a node holding every active, is read as a local index.
    pub fn placed_indexes(self: &Arc<Self>, state: &Arc<shoal_meta::MetaState>) -> Option<Arc<dyn PlacedIndexes>> {
        let any = state.indexes.values().flat_map(|by_name| by_name.values()).any(|d| d.is_placed());
        any.then(|| Arc::new(PlacedReader { node: Arc::clone(self), state: Arc::clone(state) }) as Arc<dyn PlacedIndexes>)
    }
}

/// Reads placed indexes for SQL: a routed scan ([`crate::index_scan`]) by the pinned state.
struct PlacedReader {
    node: Arc<ClusterNode>,
    state: Arc<shoal_meta::MetaState>,
}

impl std::fmt::Debug for PlacedReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PlacedReader")
    }
}

#[async_trait]
impl PlacedIndexes for PlacedReader {
    async fn keys(
        &self,
        collection: &str,
        index: &str,
        bounds: &shoal_index::ScanBounds,
        consistency: shoal_index::Consistency,
        timeout: Duration,
        limit: usize,
    ) -> Result<Option<Vec<String>>, RemoteError> {
        let Some(def) = crate::index_scan::placed_index(&self.state, collection, index) else { return Ok(None) };
        // Every partition of the index and every active here (a cluster of one): the
        // statement reads this node's index as it reads its documents, as one stream.
        let all_parts = def.parts_on(self.node.id).len() == def.placement.len();
        let all_actives = crate::routing::actives_here_in(self.node.id, &self.state).is_none();
        if all_parts && all_actives {
            return Ok(None);
        }
        let coll = self.node.engine.store().collection(collection).ok_or_else(|| RemoteError(format!("no collection {collection}")))?;
        let scan = crate::index_scan::RoutedScan { bounds: bounds.clone(), limit, descending: false, consistency, timeout };
        let rows = self.node.routed_scan(&self.state, &coll, def, scan).await.map_err(|e| RemoteError(format!("index {index}: {e}")))?;
        Ok(Some(rows.into_iter().map(|r| r.id).collect()))
    }
}

/// The asking side: calls to the members under one map version.
struct Members {
    node: Arc<ClusterNode>,
    map_version: u64,
}

impl Members {
    async fn ask(&self, member: &str, req: DocsRequest) -> Result<DocsAnswer, RemoteError> {
        let answer = self.node.peers.call(member, Op::Docs, wire::encode(&req), DOCS_CALL_TIMEOUT).await;
        let bytes = answer.map_err(|e| RemoteError(format!("a member's part of the query: {e}")))?;
        wire::decode(&bytes).map_err(|e| RemoteError(format!("member at {member} answered documents with {e}")))
    }
}

#[async_trait]
impl RemoteDocs for Members {
    async fn scan(&self, member: &str, collection: &str, after: Option<Bytes>, max: usize) -> Result<Vec<(Bytes, Bytes)>, RemoteError> {
        let max = u32::try_from(max).unwrap_or(u32::MAX).min(DOCS_ANSWER_MAX_DOCS);
        let req = DocsRequest { collection: collection.to_string(), map_version: self.map_version, after, max, keys: Vec::new() };
        Ok(self.ask(member, req).await?.docs)
    }

    async fn get(&self, member: &str, collection: &str, mut keys: Vec<Bytes>) -> Result<Vec<(Bytes, Bytes)>, RemoteError> {
        let mut out = Vec::new();
        while !keys.is_empty() {
            let req = DocsRequest {
                collection: collection.to_string(),
                map_version: self.map_version,
                after: None,
                max: DOCS_ANSWER_MAX_DOCS,
                keys: keys.clone(),
            };
            let answer = self.ask(member, req).await?;
            let done = usize::try_from(answer.keys_done).unwrap_or(usize::MAX).min(keys.len());
            if done == 0 {
                return Err(RemoteError(format!("member at {member} answered none of the keys asked")));
            }
            out.extend(answer.docs);
            keys.drain(..done);
        }
        Ok(out)
    }
}

#[async_trait]
impl ShadowMembers for Members {
    async fn fields(
        &self,
        member: &str,
        collections: &[String],
        consistency: shoal_index::Consistency,
        timeout: Duration,
        current: bool,
    ) -> Result<Vec<u8>, RemoteError> {
        let req = ShadowFieldsRequest {
            current,
            collections: collections.to_vec(),
            map_version: self.map_version,
            request_plus: consistency == shoal_index::Consistency::RequestPlus,
            timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
        };
        let body = serde_json::to_vec(&req).map_err(|e| RemoteError(e.to_string()))?;
        let answer = self.node.peers.call(member, Op::ShadowFields, body, timeout + FIELDS_CALL_SLACK).await;
        answer.map_err(|e| RemoteError(format!("a member's shadows of {}: {e}", collections.join(", "))))
    }

    async fn rows(&self, member: &str, request: Vec<u8>, timeout: Duration) -> Result<Vec<u8>, RemoteError> {
        let answer = self.node.peers.call(member, Op::ShadowRows, request, timeout + FIELDS_CALL_SLACK).await;
        answer.map_err(|e| RemoteError(format!("a member's rows of a small table: {e}")))
    }

    async fn member_gone(&self, members: &[String]) -> String {
        loop {
            let state = self.node.state();
            if state.map_version() != self.map_version {
                if let Some(gone) = gone_member(members, self.node.active_owners_in(&state), self.node.address()) {
                    return format!(
                        "member {gone} holds no partition active any more (failed over or ejected while the statement ran); run it again"
                    );
                }
            }
            tokio::time::sleep(MEMBER_CHECK_INTERVAL).await;
        }
    }
}

/// The first of `members` that holds no partition active by `owners` (each partition's
/// active, `None` for this node at `me`); none while a partition has no active at all
/// (its statement's tasks then fail on their own).
fn gone_member<'a>(members: &'a [String], owners: Result<Vec<Option<String>>, u16>, me: &str) -> Option<&'a String> {
    let owners = owners.ok()?;
    let now: std::collections::HashSet<&str> = owners.iter().map(|o| o.as_deref().unwrap_or(me)).collect();
    members.iter().find(|m| !now.contains(m.as_str()))
}

/// The asked side of [`ShadowFieldsRequest`]: this node's shadow fields, under the map the
/// statement pinned.
pub(crate) async fn serve_shadow_fields(node: &Arc<ClusterNode>, req: ShadowFieldsRequest) -> Result<Vec<u8>, ClusterError> {
    shoal_query::distributed::fields_tables_allowed(req.collections.len()).map_err(ClusterError::BadMessage)?;
    if req.map_version > node.state().map_version() {
        node.wait_map_after(req.map_version - 1, SAME_MAP_WAIT).await;
    }
    node.actives_at(req.map_version).map_err(ClusterError::Refused)?;
    let consistency = if req.request_plus { shoal_index::Consistency::RequestPlus } else { shoal_index::Consistency::NotBounded };
    let timeout = Duration::from_millis(req.timeout_ms).min(shoal_query::QUERY_TIMEOUT_MAX);
    node.engine.query().shadow_fields(&req.collections, consistency, timeout, req.current).await.map_err(|e| match e {
        shoal_query::QueryError::Timeout(_) => ClusterError::Timeout(e.to_string()),
        e => ClusterError::Refused(e.to_string()),
    })
}

/// The asked side of [`ShadowMembers::rows`]: this member's rows of a small table, under
/// the map the statement pinned (`shoal_query::gather`).
pub(crate) async fn serve_shadow_rows(node: &Arc<ClusterNode>, body: &[u8]) -> Result<Vec<u8>, ClusterError> {
    node.engine.query().shadow_rows(body).await.map_err(|e| match e {
        shoal_query::QueryError::Invalid(why) => ClusterError::BadMessage(why),
        shoal_query::QueryError::Timeout(_) => ClusterError::Timeout(e.to_string()),
        e => ClusterError::Refused(e.to_string()),
    })
}

/// The asked side: live documents of the partitions active here, a page of a scan in key
/// order or the asked keys', within [`DOCS_ANSWER_MAX_BYTES`].
pub(crate) async fn serve_docs(node: &Arc<ClusterNode>, req: DocsRequest) -> Result<DocsAnswer, ClusterError> {
    if !node.serving() {
        return Err(ClusterError::Refused("this member lost contact with the metadata leader; it serves nothing now".into()));
    }
    if req.map_version > node.state().map_version() {
        // The asking member applied the map first: members apply a commit within
        // milliseconds of each other.
        node.wait_map_after(req.map_version - 1, SAME_MAP_WAIT).await;
    }
    let state = node.state();
    let version = state.map_version();
    if version != req.map_version {
        return Err(ClusterError::Refused(format!(
            "the partition map changed during the query (version {version} here, {} when it started); run it again",
            req.map_version
        )));
    }
    let coll = node
        .engine
        .store()
        .collection(&req.collection)
        .ok_or_else(|| ClusterError::Refused(format!("no collection {} on this member", req.collection)))?;
    // `None`: every partition is active here.
    let here = node.actives_here_in(&state);
    let is_here = move |p: u16| here.as_ref().is_none_or(|h| h.get(usize::from(p)).copied().unwrap_or(false));
    let max = req.max.min(DOCS_ANSWER_MAX_DOCS) as usize;
    tokio::task::spawn_blocking(move || {
        let mut docs = Vec::new();
        let mut bytes = 0usize;
        if req.keys.is_empty() {
            let low = req.after.as_deref().map_or(std::ops::Bound::Unbounded, std::ops::Bound::Excluded);
            for (k, v) in coll.scan_docs_range_in(low, None, max.max(1), &is_here).map_err(|e| ClusterError::Storage(e.to_string()))? {
                if bytes >= DOCS_ANSWER_MAX_BYTES {
                    break;
                }
                bytes += k.len() + v.len();
                docs.push((k, v));
            }
            return Ok(DocsAnswer { docs, keys_done: 0 });
        }
        let partitions = coll.partition_count();
        let mut done = 0u32;
        for key in &req.keys {
            if bytes >= DOCS_ANSWER_MAX_BYTES || docs.len() >= max {
                break;
            }
            done += 1;
            if !is_here(shoal_storage::partition_of(key, partitions)) {
                return Err(ClusterError::Refused("a key asked is not in a partition active on this member; run the query again".into()));
            }
            let Ok(text) = std::str::from_utf8(key) else { continue };
            match coll.get(text) {
                Ok(doc) => {
                    bytes += key.len() + doc.value.len();
                    docs.push((key.clone(), doc.value));
                }
                Err(shoal_storage::ReadError::NotFound | shoal_storage::ReadError::InvalidKey(_)) => {}
                Err(e) => return Err(ClusterError::Storage(e.to_string())),
            }
        }
        Ok(DocsAnswer { docs, keys_done: done })
    })
    .await
    .map_err(|e| ClusterError::Storage(e.to_string()))?
}

#[cfg(test)]
mod tests {
    use super::gone_member;

    /// Each partition's active under the newest map (`None`: this node), or the partition
    /// with none.
    type Owners = Result<Vec<Option<String>>, u16>;

    #[test]
    fn a_statement_member_holding_no_active_partition_is_gone() {
        let members = vec!["a:1".to_string(), "b:1".to_string(), "c:1".to_string()];
        let some = |s: &str| Some(s.to_string());
        // (owners of each partition under the newest map, the member found gone)
        let cases: Vec<(Owners, Option<&str>)> = vec![
            // Every member still holds some active (this node, "a:1", as None).
            (Ok(vec![None, some("b:1"), some("c:1"), some("b:1")]), None),
            // "c:1" failed over: its partitions promoted on the others.
            (Ok(vec![None, some("b:1"), some("b:1"), None]), Some("c:1")),
            // This node lost its last active (ejected).
            (Ok(vec![some("b:1"), some("c:1")]), Some("a:1")),
            // A partition with no active at all: not judged here.
            (Err(3), None),
        ];
        for (owners, want) in cases {
            let got = gone_member(&members, owners.clone(), "a:1").map(String::as_str);
            assert_eq!(got, want, "owners {owners:?}");
        }
    }
}
