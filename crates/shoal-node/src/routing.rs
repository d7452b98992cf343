//! Request routing: where a request for a key or a partition goes by one map
//! ([`route_partition`], pure), whether this node serves now (its lease), and the waits a
//! request routed here makes for this node's copies to follow the map that routed it.
//!
//! State owned here, [`CopyStates`]: the map version this node's partition states follow
//! (set by the metadata applier once a map's states are durable) and the partitions frozen
//! for a hand-over (set by the rebalance's executor).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use shoal_cluster::{NodeId, PartitionMap};
use shoal_meta::{MemberState, MetaState};
use shoal_storage::PartitionState;
use tokio::sync::watch;

use crate::node::{ClusterNode, STARTUP_WAIT};

/// Where a request for a key goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// This node holds the active copy.
    Local,
    /// Another node does, at this address.
    Forward { node: NodeId, address: String },
    /// No node serves the partition now (its active was failed over and no replica could
    /// take it, or a failover is in progress).
    Unavailable { partition: u16, map_version: u64 },
}

/// Where a request for partition `p` goes by `map`, as node `me` sees it with the members
/// of `state`: to nobody while its active is failed or unknown.
pub fn route_partition(me: NodeId, state: &MetaState, map: &PartitionMap, p: u16) -> Route {
    let Some(copies) = map.partitions.get(usize::from(p)) else { return Route::Local };
    let unavailable = Route::Unavailable { partition: p, map_version: map.version };
    match state.members.get(&copies.active) {
        Some(m) if m.state == MemberState::Failed => unavailable,
        _ if copies.active == me => Route::Local,
        Some(m) => Route::Forward { node: copies.active, address: m.address.clone() },
        None => unavailable,
    }
}

/// Which partitions `me` holds active by `state`'s map; `None` when it holds them all (no
/// map yet, or a one-node cluster).
pub fn actives_here_in(me: NodeId, state: &MetaState) -> Option<Vec<bool>> {
    let map = state.map.as_ref()?;
    let here: Vec<bool> = (0..map.partition_count()).map(|p| route_partition(me, state, map, p) == Route::Local).collect();
    if here.iter().all(|h| *h) {
        return None;
    }
    Some(here)
}

/// Who holds each partition's active copy by `state`'s map, for a request over every
/// partition (an index scan, a change feed): `None` node `me`, `Some(address)` another
/// member. `Err(partition)` names a partition with no active copy now (the answer would miss
/// it). Without a map, every partition is here (an empty list).
pub fn active_owners_in(me: NodeId, state: &MetaState) -> Result<Vec<Option<String>>, u16> {
    let Some(map) = &state.map else { return Ok(Vec::new()) };
    (0..map.partition_count())
        .map(|p| match route_partition(me, state, map, p) {
            Route::Local => Ok(None),
            Route::Forward { address, .. } => Ok(Some(address)),
            Route::Unavailable { partition, .. } => Err(partition),
        })
        .collect()
}

/// This node's copies as requests see them: which map their states follow, and which are
/// frozen for a hand-over.
pub(crate) struct CopyStates {
    /// The map version this node's copies follow (their states set by the metadata
    /// applier): a moment behind the metadata it has applied, and what a request routed
    /// here waits for.
    follows: watch::Sender<u64>,
    /// Partitions this node holds active but was asked to hand over (a rebalance): writes
    /// stop until a map newer than the one they were frozen under is in.
    frozen: Mutex<HashMap<u16, Freeze>>,
}

/// One partition's freeze for a hand-over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Freeze {
    /// The map version it was frozen under: a newer map ends it (the wave's, or the one
    /// that fences the wave out when the freeze outlasts `FREEZE_MAX`).
    pub(crate) map_version: u64,
    /// When the node stops waiting for the wave and fences it out (`apply::fence_late_wave`).
    pub(crate) until: Instant,
}

impl Default for CopyStates {
    fn default() -> Self {
        CopyStates { follows: watch::Sender::new(0), frozen: Mutex::new(HashMap::new()) }
    }
}

impl CopyStates {
    /// The map version the copies follow.
    pub(crate) fn map_version(&self) -> u64 {
        *self.follows.borrow()
    }

    /// The copies follow map `version` now (never goes back).
    pub(crate) fn set_map_version(&self, version: u64) {
        self.follows.send_if_modified(|v| {
            let newer = version > *v;
            *v = (*v).max(version);
            newer
        });
    }

    /// Waits until the copies follow map `version` (or a newer one), at most `max`;
    /// answers whether they do.
    pub(crate) async fn wait_follows(&self, version: u64, max: Duration) -> bool {
        let mut follows = self.follows.subscribe();
        let followed = matches!(tokio::time::timeout(max, follows.wait_for(|v| *v >= version)).await, Ok(Ok(_)));
        followed
    }

    /// Whether partition `p` is frozen for a hand-over now.
    pub(crate) fn is_frozen(&self, p: u16) -> bool {
        self.frozen.lock().contains_key(&p)
    }

    /// The map version partition `p` was frozen under, if it is frozen now.
    pub(crate) fn frozen_under(&self, p: u16) -> Option<u64> {
        self.frozen.lock().get(&p).map(|f| f.map_version)
    }

    /// Whether any partition is frozen (the metadata applier looks again until none is).
    pub(crate) fn any_frozen(&self) -> bool {
        !self.frozen.lock().is_empty()
    }

    /// Freezes `partitions` under map `map_version` until a newer map, fencing the wave out
    /// after `until`.
    pub(crate) fn freeze(&self, partitions: &[u16], map_version: u64, until: Instant) {
        let mut frozen = self.frozen.lock();
        for p in partitions {
            frozen.insert(*p, Freeze { map_version, until });
        }
    }

    /// The newest map version a freeze that outlasted its `until` was made under, if any:
    /// the map a fence must move past.
    pub(crate) fn overdue(&self, now: Instant) -> Option<u64> {
        self.frozen.lock().values().filter(|f| f.until <= now).map(|f| f.map_version).max()
    }

    /// Keeps the freezes `keep` allows, thaws the others, and answers the partitions still
    /// frozen.
    pub(crate) fn retain_frozen(&self, keep: impl Fn(u16, &Freeze) -> bool) -> HashSet<u16> {
        let mut frozen = self.frozen.lock();
        frozen.retain(|p, f| keep(*p, f));
        frozen.keys().copied().collect()
    }
}

impl ClusterNode {
    /// Where a request for `key` goes.
    pub fn route(&self, key: &[u8]) -> Route {
        self.route_versioned(key).0
    }

    /// [`route`](Self::route), with the map version it was routed by (both from one look at
    /// the metadata): what a request waits past, or names when forwarded, must be the map
    /// that routed it, not a newer one applied meanwhile.
    pub fn route_versioned(&self, key: &[u8]) -> (Route, u64) {
        let state = self.state();
        let version = state.map_version();
        let Some(map) = &state.map else { return (Route::Local, version) };
        let p = shoal_storage::partition_of(key, map.partition_count());
        (route_partition(self.id, &state, map, p), version)
    }

    /// Which partitions this node holds active, by number; `None` when it holds them all
    /// (no map yet, or a one-node cluster).
    pub fn actives_here(&self) -> Option<Vec<bool>> {
        self.actives_here_in(&self.state())
    }

    /// [`actives_here_in`] for this node (one look at the metadata for a read pinned to one
    /// map version).
    pub fn actives_here_in(&self, state: &MetaState) -> Option<Vec<bool>> {
        actives_here_in(self.id, state)
    }

    /// [`active_owners_in`] for this node, by the current map.
    pub fn active_owners(&self) -> Result<Vec<Option<String>>, u16> {
        self.active_owners_in(&self.state())
    }

    /// [`active_owners_in`] for this node, by `state`'s map.
    pub fn active_owners_in(&self, state: &MetaState) -> Result<Vec<Option<String>>, u16> {
        active_owners_in(self.id, state)
    }

    /// Whether this node may serve its active copies now: it holds a lease (it heard from
    /// the metadata leader recently, or is the leader with a quorum). A node cut off from the
    /// leader stops serving before any failover can promote another copy.
    pub fn serving(&self) -> bool {
        if !self.is_ready() {
            return false;
        }
        // Not before this node has applied the metadata once since it started (collections
        // and index definitions, then the map): a node that joined a moment ago would answer
        // "no such collection" for one the cluster has.
        if self.copy_states.map_version() == 0 && self.state().map.is_some() {
            return false;
        }
        let serving = self.lease.valid(&self.meta);
        if serving && !self.served.load(std::sync::atomic::Ordering::Relaxed) {
            self.served.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        serving
    }

    /// Whether this node has served since it started.
    pub fn has_served(&self) -> bool {
        self.served.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// [`serving`](Self::serving), but a node that has not served since it started
    /// (still entering its cluster, or in and waiting for its first lease) is given up to
    /// [`STARTUP_WAIT`] to get there first: a request that arrives a moment after a restart
    /// is served, not refused. A node that served and lost its lease is answered at once.
    pub async fn serving_soon(&self) -> bool {
        if self.serving() {
            return true;
        }
        if self.has_served() {
            return false;
        }
        let deadline = tokio::time::Instant::now() + STARTUP_WAIT;
        if !self.membership.wait_ready(deadline).await {
            return false;
        }
        // Ready; a rejoining member of a larger cluster also needs its first lease.
        while !self.serving() {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }

    /// Waits until this node knows a partition map newer than `version`, at most `max`;
    /// answers whether it does (a request that found its partition's owner moving waits for
    /// the map that says where it went).
    pub async fn wait_map_after(&self, version: u64, max: Duration) -> bool {
        let mut applied = self.meta.watch();
        let deadline = tokio::time::Instant::now() + max;
        loop {
            if applied.borrow_and_update().map_version() > version {
                return true;
            }
            match tokio::time::timeout_at(deadline, applied.changed()).await {
                Ok(Ok(())) => continue,
                _ => return self.state().map_version() > version,
            }
        }
    }

    /// Waits until this node's copy of the partition of `key`, which map `version` makes
    /// active here, is active, at most `max`: until the copies follow that map (or a newer
    /// one), unless the copy is active already. A request the map routes here is run once
    /// it is (a copy the map just made active here would otherwise refuse it as a
    /// replica's). A copy already active does not wait for the rest of a map to be applied
    /// (a rebalance's maps set many other partitions' states, with fsyncs and keyspace
    /// drops: every request routed here waited for them).
    pub async fn wait_copies_follow(&self, key: &[u8], version: u64, max: Duration) -> bool {
        if self.copy_states.map_version() >= version {
            return true;
        }
        let store = self.engine.store();
        if store.partition_state(shoal_storage::partition_of(key, store.partitions())).is_ok_and(|s| s == PartitionState::Active) {
            return true;
        }
        self.copy_states.wait_follows(version, max).await
    }

    /// The map version the partition of `key` was frozen under here for a hand-over, if it
    /// is frozen (its new active takes it when a newer map commits). The metadata applier
    /// lifts the freeze once it has applied that map: for a moment the newer map is in and
    /// the partition still frozen.
    pub fn handing_over(&self, key: &[u8]) -> Option<u64> {
        let partitions = self.engine.store().partitions();
        self.copy_states.frozen_under(shoal_storage::partition_of(key, partitions))
    }

    /// Whether partition `p` is frozen here for a hand-over.
    pub(crate) fn frozen(&self, p: u16) -> bool {
        self.copy_states.is_frozen(p)
    }

    /// Whether this node's copy of `p` is the one its replicas follow: the active, or the
    /// active frozen for a hand-over (a replica in storage already, and still the newest).
    pub(crate) fn copy_serves(&self, p: u16) -> bool {
        self.engine
            .store()
            .partition_state(p)
            .is_ok_and(|s| s == PartitionState::Active || (s == PartitionState::Replica && self.copy_states.is_frozen(p)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_cluster::Copies;
    use shoal_meta::Member;

    fn state(members: &[(u64, MemberState)], actives: &[u64]) -> MetaState {
        let mut state = MetaState::default();
        for (id, s) in members {
            state.members.insert(NodeId(*id), Member::new(format!("n{id}"), *s));
        }
        state.map = Some(PartitionMap {
            version: 7,
            partitions: actives.iter().map(|a| Copies { active: NodeId(*a), replicas: Vec::new() }).collect(),
        });
        state
    }

    #[test]
    fn a_partition_routes_to_its_active_unless_that_member_is_failed_or_unknown() {
        use MemberState::{Active, Failed};
        let s = state(&[(1, Active), (2, Active), (3, Failed)], &[1, 2, 3, 4]);
        let map = s.map.as_ref().expect("a map");
        let cases = [
            (1, 0, Route::Local),
            (1, 1, Route::Forward { node: NodeId(2), address: "n2".into() }),
            (1, 2, Route::Unavailable { partition: 2, map_version: 7 }),
            (1, 3, Route::Unavailable { partition: 3, map_version: 7 }),
            (3, 2, Route::Unavailable { partition: 2, map_version: 7 }),
            (1, 9, Route::Local),
        ];
        for (me, p, want) in cases {
            assert_eq!(route_partition(NodeId(me), &s, map, p), want, "node {me}, partition {p}");
        }
    }

    #[test]
    fn a_node_holding_every_active_says_so_and_owners_name_the_others() {
        use MemberState::{Active, Failed};
        let all_here = state(&[(1, Active)], &[1, 1]);
        assert_eq!(actives_here_in(NodeId(1), &all_here), None);
        let split = state(&[(1, Active), (2, Active)], &[1, 2]);
        assert_eq!(actives_here_in(NodeId(1), &split), Some(vec![true, false]));
        assert_eq!(active_owners_in(NodeId(1), &split), Ok(vec![None, Some("n2".into())]));
        let failed = state(&[(1, Active), (2, Failed)], &[1, 2]);
        assert_eq!(active_owners_in(NodeId(1), &failed), Err(1));
        assert_eq!(active_owners_in(NodeId(1), &MetaState::default()), Ok(Vec::new()));
    }
}
