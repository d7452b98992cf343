//! Applying the metadata: one reconcile loop brings this node's engine in step with every
//! committed change — collections with the ids the log gave them, index definitions, then
//! the partition map as partition states ([`desired_states`], pure) and the replication
//! streams those states need ([`replication_sources`], pure). Copies the map moved away are
//! retired at once and their data discarded [`DISCARD_AFTER`] later.
//!
//! State owned here, [`Applier`]: one application of the map at a time, and the running
//! replication streams.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use shoal_cluster::{NodeId, PartitionMap};
use shoal_meta::{MemberState, MetaState};
use shoal_storage::PartitionState;
use tokio::sync::watch;

use crate::node::{blocking, ClusterNode};
use crate::ClusterError;

/// Copies a map moved away are retired at once (dead, never served, in one durable write)
/// and their data discarded this long after: on the sources of a bench add, the discards (a
/// keyspace deleted and another created, 5–15 ms apiece, 115–167 ms per source) ran just
/// as the new map took effect everywhere, and majority writes — to every partition, moved
/// or not — waited up to 79–124 ms then; discarded a second later, 6.5 and 6.7 ms at most,
/// and 2.8 ms while the discard ran (bench/results/2026-11-28-issue14-discard-after-hand-over.md).
pub const DISCARD_AFTER: Duration = Duration::from_secs(1);
/// The reconcile loop tries again after a failure this often (and looks again while a
/// partition is frozen, so that an expired freeze thaws).
const RECONCILE_RETRY: Duration = Duration::from_secs(1);

/// See the module documentation.
#[derive(Default)]
pub(crate) struct Applier {
    /// Held while the map is applied (`apply_current_map`), and by each discard: one at a time.
    applying: tokio::sync::Mutex<()>,
    /// Running replication streams, by the node they pull from.
    replicators: Mutex<HashMap<NodeId, watch::Sender<bool>>>,
    /// A fence of a late wave is being proposed (`fence_late_wave`).
    fencing: std::sync::atomic::AtomicBool,
    /// Index partitions held here that the placement no longer names, waiting out
    /// `INDEX_DRAIN_WAIT` before they are dropped: (collection, index, part).
    draining: Mutex<std::collections::BTreeSet<(String, String, u16)>>,
    /// The index of the last metadata log entry this node's engine is in step with (a
    /// reconcile of a state that includes it succeeded): what a DDL's author waits for on
    /// every member (`ClusterNode::serve_applied`).
    reconciled: watch::Sender<u64>,
}

impl Applier {
    /// How far this node's engine is in step with the metadata log, now and as it goes on.
    pub(crate) fn reconciled(&self) -> watch::Receiver<u64> {
        self.reconciled.subscribe()
    }

    /// Stops every replication stream.
    pub(crate) fn stop_replication(&self) {
        for (_, stop) in self.replicators.lock().drain() {
            stop.send_replace(true);
        }
    }
}

/// The state each partition's copy on node `me` takes under `map`: dead on a failed node
/// and where the map gives it no copy; the active's copy active, unless frozen for a
/// hand-over (`frozen`), then a replica; a replica's copy a replica, or pending while it is
/// being built from files (`building`).
pub(crate) fn desired_states(
    map: &PartitionMap,
    me: NodeId,
    failed: bool,
    frozen: &HashSet<u16>,
    building: impl Fn(u16) -> bool,
) -> Vec<(u16, PartitionState)> {
    map.iter()
        .map(|(p, copies)| {
            let s = if failed {
                PartitionState::Dead
            } else if copies.active == me {
                if frozen.contains(&p) {
                    PartitionState::Replica
                } else {
                    PartitionState::Active
                }
            } else if copies.replicas.contains(&me) {
                if building(p) {
                    PartitionState::Pending
                } else {
                    PartitionState::Replica
                }
            } else {
                PartitionState::Dead
            };
            (p, s)
        })
        .collect()
}

/// Whether partition `p`'s freeze on node `me`, made under map `frozen_under`, still holds
/// under `state`'s `map`: until a newer map (the wave's, or one that fenced the wave out —
/// the map version a wave must follow, `SetMap` refusing any other), until the role moves
/// away, or until no rebalance is under way (the one that asked for it stopped, failed or was
/// reverted: its end is in the log after any wave it committed). Never by a clock alone: a
/// wave proposed before the freeze's end may commit after it, and the writes a thawed copy
/// took meanwhile would stay on a copy that is no longer active (`fence_late_wave`).
pub(crate) fn freeze_holds(state: &MetaState, map: &PartitionMap, me: NodeId, p: u16, frozen_under: u64) -> bool {
    state.rebalance.is_some() && map.version <= frozen_under && map.partitions.get(usize::from(p)).is_some_and(|c| c.active == me)
}

/// The nodes whose change streams node `me`'s replicas pull under `map`: the actives of the
/// partitions it holds replicas of, unless that active is failed — and none on a failed node.
pub(crate) fn replication_sources(state: &MetaState, map: &PartitionMap, me: NodeId, failed: bool) -> HashSet<NodeId> {
    if failed {
        return HashSet::new();
    }
    map.partitions
        .iter()
        .filter(|c| c.replicas.contains(&me))
        .map(|c| c.active)
        .filter(|a| state.members.get(a).is_some_and(|m| m.state != MemberState::Failed))
        .collect()
}

impl ClusterNode {
    pub(crate) async fn reconcile_loop(self: &Arc<Self>) {
        let mut rx = self.meta.watch();
        let mut stop = self.stop.subscribe();
        loop {
            let state = Arc::clone(&rx.borrow_and_update());
            let index = state.applied.0;
            let failed = match self.reconcile(&state).await {
                Ok(()) => {
                    self.applier.reconciled.send_if_modified(|r| {
                        let newer = index > *r;
                        *r = (*r).max(index);
                        newer
                    });
                    false
                }
                Err(e) => {
                    tracing::warn!(error = %e, "applying the cluster metadata; will try again");
                    true
                }
            };
            self.fence_late_wave(&state);
            tokio::select! {
                r = rx.changed() => if r.is_err() { return },
                _ = stop.wait_for(|s| *s) => return,
                _ = tokio::time::sleep(RECONCILE_RETRY), if failed || self.copy_states.any_frozen() => {}
            }
        }
    }

    /// A freeze that outlasted `FREEZE_MAX` with no newer map: this node commits the same
    /// map one version on (in the background), so that no wave proposed under the map it
    /// froze under can commit any more (`SetMap` takes only the next version), and thaws
    /// once that map is applied (`freeze_holds`). If the wave committed first, the fence is
    /// refused as stale and the wave's map thaws it. Without a metadata leader the freeze
    /// stays: the node loses its lease then anyway.
    fn fence_late_wave(self: &Arc<Self>, state: &MetaState) {
        let Some(map) = &state.map else { return };
        let Some(frozen_under) = self.copy_states.overdue(Instant::now()) else { return };
        if map.version != frozen_under || self.applier.fencing.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return;
        }
        let fence = PartitionMap { version: map.version + 1, ..map.clone() };
        let node = Arc::clone(self);
        tokio::spawn(async move {
            tracing::warn!(
                map_version = fence.version,
                "a hand-over's wave did not come within its freeze; fencing it out with a newer map"
            );
            match node.propose(shoal_meta::MetaCommand::SetMap { map: fence }).await {
                Ok(_) | Err(ClusterError::Rejected(shoal_meta::MetaReject::MapVersion { .. })) => {}
                Err(e) => tracing::warn!(error = %e, "fencing a late wave out; will try again"),
            }
            node.applier.fencing.store(false, std::sync::atomic::Ordering::Release);
        });
    }

    /// After a restart, the freezes this node answered hand-overs under before it stopped:
    /// a copy the map still names active here, stored as a replica (a freeze's state, set
    /// durably), while a rebalance is under way. Kept in memory only, they were thawed by
    /// the restart, and a wave committed after would have lost the writes taken since; they
    /// are frozen again, overdue at once, so the wave is fenced out before they thaw.
    pub(crate) fn restore_freezes(&self) {
        let state = self.state();
        let (Some(map), true) = (&state.map, state.rebalance.is_some()) else { return };
        let store = self.engine.store();
        let frozen: Vec<u16> = map
            .iter()
            .filter(|(p, c)| c.active == self.id && store.partition_state(*p).is_ok_and(|s| s == PartitionState::Replica))
            .map(|(p, _)| p)
            .collect();
        if !frozen.is_empty() {
            tracing::info!(partitions = frozen.len(), map_version = map.version, "frozen for a hand-over before the restart: frozen again");
            self.copy_states.freeze(&frozen, map.version, Instant::now());
        }
    }

    /// Applies the metadata to this node: collections, then the map.
    async fn reconcile(self: &Arc<Self>, state: &MetaState) -> Result<(), ClusterError> {
        if state.cluster_id.is_empty() {
            return Ok(());
        }
        let store = Arc::clone(self.engine.store());
        for (name, def) in &state.collections {
            match store.collection(name) {
                Some(c) if c.id() == def.id => {}
                Some(c) => {
                    tracing::warn!(collection = %name, local = c.id(), cluster = def.id, "a local collection has another id than the cluster's; replacing it");
                    self.engine.drop_collection(name).await?;
                    self.engine.create_collection(name, def.max_ttl, Some(def.id)).await?;
                }
                None => {
                    self.engine.create_collection(name, def.max_ttl, Some(def.id)).await?;
                }
            }
        }
        for info in store.list_collections() {
            if !state.collections.contains_key(&info.name) {
                self.engine.drop_collection(&info.name).await?;
            }
        }
        // Index definitions: by name (an index brought in by the node that founded the
        // cluster keeps its local id there).
        let indexes = self.engine.indexes();
        for (name, def) in &state.collections {
            let Some(coll) = store.collection(name).filter(|c| c.id() == def.id) else { continue };
            let wanted = state.indexes.get(name);
            let local = indexes.list(&coll);
            if let Some(wanted) = wanted {
                // Deferred here, built by the cluster: one build for all of them, from one read.
                let to_build: Vec<String> = local
                    .iter()
                    .filter(|s| s.state == shoal_index::IndexState::Deferred && wanted.get(&s.def.name).is_some_and(|w| w.built))
                    .map(|s| s.def.name.clone())
                    .collect();
                if !to_build.is_empty() {
                    match indexes.build_many(&coll, &to_build).await {
                        Ok(_) | Err(shoal_index::IndexError::NotFound(_)) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                for (index_name, index) in wanted {
                    if local.iter().any(|s| &s.def.name == index_name) {
                        continue;
                    }
                    let parsed: shoal_index::IndexDef = match serde_json::from_value(index.definition.clone()) {
                        Ok(d) => d,
                        Err(e) => {
                            tracing::warn!(collection = %name, index = %index_name, error = %e, "an index definition in the log does not parse here");
                            continue;
                        }
                    };
                    // Built by the cluster already: this member builds it as it creates it.
                    let parsed = shoal_index::IndexDef { defer_build: parsed.defer_build && !index.built, ..parsed };
                    // The log's id where it is free here; a node that took local ids past it
                    // (an index rebuilt after damage takes a fresh one) keeps a local id.
                    // A placed index: the partitions placed here (none on a node without the index service).
                    let held = index.is_placed().then(|| index.parts_on(self.id));
                    let created = match indexes.create_as(&coll, parsed.clone(), Some(index.id), held.clone()).await {
                        Err(shoal_index::IndexError::Invalid(why)) if why.contains("is taken") => {
                            indexes.create_as(&coll, parsed, None, held).await
                        }
                        other => other,
                    };
                    match created {
                        Ok(_) | Err(shoal_index::IndexError::Exists(_)) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
            }
            for (index_name, index) in wanted.into_iter().flatten().filter(|(_, d)| d.is_placed()) {
                self.hold_placed(state, &coll, index_name, index).await?;
            }
            for status in local {
                if !wanted.is_some_and(|w| w.contains_key(&status.def.name)) {
                    match indexes.drop_index(&coll, &status.def.name).await {
                        Ok(()) | Err(shoal_index::IndexError::NotFound(_)) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
        self.apply_current_map().await
    }

    /// Makes the index partitions held here those the placement names here, outside a
    /// rebalance: a copy not named is dropped after `INDEX_DRAIN_WAIT` (scans routed by the
    /// placement before finish on it first); a copy named here that is missing (its build
    /// was lost) is rebuilt from the streams (counted in `PLACED_MISSING_REBUILDS_METRIC`).
    /// A rebalance builds its copies before it names them, so while one runs a copy not
    /// named may be one it is building: copies are dropped once it has ended (the state that
    /// ends it comes here too). The decisions are `shoal_cluster::index_placement`'s
    /// (`copies_to_reconcile`, `drops_after_drain`).
    async fn hold_placed(
        self: &Arc<Self>,
        state: &MetaState,
        coll: &Arc<shoal_storage::Collection>,
        name: &str,
        index: &shoal_meta::IndexDef,
    ) -> Result<(), ClusterError> {
        let indexes = Arc::clone(self.engine.indexes());
        let Some(status) = indexes.list(coll).into_iter().find(|s| s.def.name == name) else { return Ok(()) };
        let want = index.parts_on(self.id);
        let held: Vec<u16> = status.part_items.iter().map(|(no, _)| *no).collect();
        let reconcile = shoal_cluster::index_placement::copies_to_reconcile(&want, &held, state.rebalance.is_some());
        for no in reconcile.drain {
            let key = (coll.name().to_string(), name.to_string(), no);
            if !self.applier.draining.lock().insert(key.clone()) {
                continue;
            }
            let (node, coll, name, id) = (Arc::clone(self), Arc::clone(coll), name.to_string(), index.id);
            tokio::spawn(async move {
                tokio::time::sleep(crate::index_moves::INDEX_DRAIN_WAIT).await;
                let state = node.state();
                let def = state.indexes.get(coll.name()).and_then(|by_name| by_name.get(&name)).filter(|d| d.id == id && d.is_placed());
                let drops = shoal_cluster::index_placement::drops_after_drain(
                    state.rebalance.is_some(),
                    def.is_some(),
                    def.is_some_and(|d| d.parts_on(node.id).contains(&no)),
                );
                if drops {
                    if let Err(e) = node.engine.indexes().drop_part(&coll, &name, no).await {
                        tracing::warn!(index = %name, part = no, error = %e, "dropping an index partition placed elsewhere");
                    }
                }
                node.applier.draining.lock().remove(&key);
            });
        }
        for no in reconcile.rebuild {
            tracing::warn!(index = %name, part = no, "an index partition placed here is missing; rebuilding it from the streams");
            metrics::counter!(crate::index_moves::PLACED_MISSING_REBUILDS_METRIC).increment(1);
            let (indexes, coll, name) = (Arc::clone(&indexes), Arc::clone(coll), name.to_string());
            blocking(move || indexes.add_part(&coll, &name, no)).await??;
        }
        Ok(())
    }

    /// Applies the current map: partition states and replication follow it (and the
    /// freezes). One application at a time, each from the state and freezes as they are
    /// once it runs: the reconcile loop, a hand-over and a finished copy all apply it, and
    /// one working from an older look, landing after a newer one, undid it — a freeze
    /// thawed under its hand-over, or a new active set back to a replica.
    pub(crate) async fn apply_current_map(self: &Arc<Self>) -> Result<(), ClusterError> {
        let _one = self.applier.applying.lock().await;
        let state = self.state();
        match &state.map {
            Some(map) => self.apply_map(&state, map).await,
            None => Ok(()),
        }
    }

    /// Sets every partition's state from the map and starts or stops replication streams.
    async fn apply_map(self: &Arc<Self>, state: &MetaState, map: &PartitionMap) -> Result<(), ClusterError> {
        let me = self.id;
        let failed = state.members.get(&me).is_none_or(|m| m.state == MemberState::Failed);
        let frozen = self.copy_states.retain_frozen(|p, f| freeze_holds(state, map, me, p, f.map_version));
        let desired = desired_states(map, me, failed, &frozen, |p| self.copies.is_building(p));
        self.copies.retain_replicas(|p| {
            desired.get(usize::from(p)).is_some_and(|(_, s)| matches!(s, PartitionState::Replica | PartitionState::Pending))
        });
        let delay = self.faults.map_delay();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let store = Arc::clone(self.engine.store());
        let version = map.version;
        let (states, drops) = blocking(move || {
            let storage = |e: shoal_storage::PartitionError| ClusterError::Storage(e.to_string());
            // A retired copy this map gives a role here again is discarded first
            // (`set_partition_states` does it): it comes back empty, as a dropped copy always did.
            let (mut drops, mut states) = (Vec::new(), Vec::new());
            for (p, s) in desired {
                let now = store.partition_state(p).map_err(storage)?;
                if now == s {
                    continue;
                }
                if s == PartitionState::Dead && !failed && now != PartitionState::Dead {
                    // The map moved this copy elsewhere (a rebalance handed it over, or
                    // fewer replicas are wanted): it is retired now, its data discarded
                    // whole, in O(1), `DISCARD_AFTER`. A failed node keeps its copies:
                    // recovery rolls them back and catches them up.
                    drops.push(p);
                } else {
                    states.push((p, s));
                }
            }
            // Every new state in one durable batch: requests routed here wait for it.
            store.set_partition_states_for_map(&states, version).map_err(storage)?;
            store.retire_partitions(&drops).map_err(storage)?;
            store.set_map_version(version);
            Ok::<_, ClusterError>((states.len(), drops.len()))
        })
        .await??;
        // The copies this map keeps here follow it: requests routed here go on now, and the
        // replicas here follow their (new) actives.
        self.copy_states.set_map_version(version);
        self.follow_actives(state, map, failed);
        let changed = states + drops;
        if drops > 0 {
            self.discard_later();
        }
        if changed > 0 {
            tracing::info!(map_version = version, changed, "partition states follow the map");
        }
        Ok(())
    }

    /// Discards the data of the copies retired here, `DISCARD_AFTER` from now: each between
    /// two applications of the map (so that none gives it a role meanwhile), one at a time
    /// (so that a map waits for one discard at most, not for all of them).
    pub(crate) fn discard_later(self: &Arc<Self>) {
        let node = Arc::clone(self);
        tokio::spawn(async move {
            tokio::time::sleep(DISCARD_AFTER).await;
            let store = Arc::clone(node.engine.store());
            let listed = Arc::clone(&store);
            let retired = match blocking(move || listed.retired_partitions()).await {
                Ok(Ok(retired)) => retired,
                Ok(Err(e)) => return tracing::warn!(error = %e, "listing retired copies"),
                Err(e) => return tracing::warn!(error = %e, "listing retired copies"),
            };
            for p in retired {
                let _one = node.applier.applying.lock().await;
                let store = Arc::clone(&store);
                match blocking(move || store.discard_retired(&[p])).await {
                    Ok(Ok(())) => {}
                    // Its record stays: the next discard or restart tries again.
                    Ok(Err(e)) => tracing::warn!(partition = p, error = %e, "discarding a retired copy"),
                    Err(e) => tracing::warn!(partition = p, error = %e, "discarding a retired copy"),
                }
            }
        });
    }

    /// Replication: one stream per node this one holds replicas of in `map` (none on a
    /// failed node); streams from other nodes stop.
    fn follow_actives(self: &Arc<Self>, state: &MetaState, map: &PartitionMap, failed: bool) {
        let sources = replication_sources(state, map, self.id, failed);
        let mut running = self.applier.replicators.lock();
        running.retain(|source, stop| {
            let keep = sources.contains(source) && !*stop.borrow();
            if !keep {
                stop.send_replace(true);
            }
            keep
        });
        for source in sources {
            if let std::collections::hash_map::Entry::Vacant(slot) = running.entry(source) {
                let (tx, rx) = watch::channel(false);
                slot.insert(tx);
                tokio::spawn(crate::replica::replicate_from(Arc::clone(self), source, rx));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_cluster::Copies;
    use shoal_meta::Member;

    fn map(rows: &[(u64, &[u64])]) -> PartitionMap {
        PartitionMap {
            version: 2,
            partitions: rows.iter().map(|(a, r)| Copies { active: NodeId(*a), replicas: r.iter().map(|n| NodeId(*n)).collect() }).collect(),
        }
    }

    #[test]
    fn each_copy_takes_the_state_the_map_gives_its_node() {
        use PartitionState::{Active, Dead, Pending, Replica};
        let m = map(&[(1, &[2]), (2, &[1]), (2, &[3]), (1, &[3]), (2, &[1])]);
        let frozen: HashSet<u16> = [3].into_iter().collect();
        let building = |p: u16| p == 4;
        assert_eq!(
            desired_states(&m, NodeId(1), false, &frozen, building),
            vec![(0, Active), (1, Replica), (2, Dead), (3, Replica), (4, Pending)],
            "active, replica, no copy, frozen for a hand-over, being built"
        );
        assert!(desired_states(&m, NodeId(1), true, &frozen, building).iter().all(|(_, s)| *s == Dead), "a failed node serves nothing");
    }

    #[test]
    fn a_freeze_holds_until_a_newer_map_the_role_moving_or_the_plan_ending() {
        let mut state = MetaState::default();
        let m = map(&[(1, &[2]), (2, &[1])]);
        let plan = shoal_meta::RebalancePlan { from: m.clone(), target: m.clone(), eject: Vec::new(), added: Vec::new(), stop: false };
        state.rebalance = Some(plan);
        let cases = [
            ("the map it was frozen under", 2, 0, true),
            ("a newer map: the wave, or a fence of it", 1, 0, false),
            ("the role moved away", 2, 1, false),
        ];
        for (name, frozen_under, p, holds) in cases {
            assert_eq!(freeze_holds(&state, &m, NodeId(1), p, frozen_under), holds, "{name}");
        }
        state.rebalance = None;
        assert!(!freeze_holds(&state, &m, NodeId(1), 0, 2), "no plan: nothing will move the role");
    }

    #[test]
    fn replicas_follow_their_actives_unless_failed() {
        let mut state = MetaState::default();
        for (id, s) in [(1, MemberState::Active), (2, MemberState::Active), (3, MemberState::Failed)] {
            state.members.insert(NodeId(id), Member::new(format!("n{id}"), s));
        }
        let m = map(&[(2, &[1]), (3, &[1]), (1, &[2]), (2, &[1])]);
        assert_eq!(replication_sources(&state, &m, NodeId(1), false), [NodeId(2)].into_iter().collect());
        assert_eq!(replication_sources(&state, &m, NodeId(2), false), [NodeId(1)].into_iter().collect());
        assert!(replication_sources(&state, &m, NodeId(1), true).is_empty());
    }
}
