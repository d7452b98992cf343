//! Majority waits: a majority write waits until enough of its partition's copies hold it,
//! a majority read confirms that this node is still the active (ReadIndex), and a write
//! that cannot reach a majority is refused before anything is written. The acknowledgements
//! they wait on are [`crate::acks`]'; how many a majority needs is [`replicas_needed`]
//! (pure, from the metadata: [`shoal_cluster::copies_counted`] and
//! [`shoal_cluster::majority`], the rules the simulation checks).

use std::time::{Duration, Instant};

use shoal_cluster::{configured_copies, Copies, NodeId, Quorum};
use shoal_meta::{MemberState, MetaState};
use shoal_storage::StreamPosition;

use crate::acks::{Need, Part};
use crate::node::ClusterNode;

/// A majority write or read waits this long for the replicas by default; then it answers
/// `timeout`, ambiguous (the write may yet be on a majority).
pub const DURABLE_TIMEOUT: Duration = Duration::from_secs(5);
/// A replica that acknowledged nothing for this long is not counted as able to take part
/// in a majority: a write that needs it answers `durability_impossible` at once.
pub const HEALTHY_ACK_WINDOW: Duration = Duration::from_secs(3);
/// A replica not heard from at all since the map last changed (its first pull of the new
/// map is on its way) gets this long to be heard before a majority call counts it out:
/// right after a rebalance or failover, a majority write waits for it rather than being
/// refused. A replica heard from and then silent is counted out at once.
pub const UNHEARD_REPLICA_GRACE: Duration = Duration::from_secs(5);

/// How durable a write must be before it is acknowledged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durable {
    /// In memory on a majority of the partition's copies.
    Majority,
    /// Fsynced on a majority of the partition's copies.
    PersistMajority,
}

/// Why a majority wait failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MajorityError {
    /// Too few copies are healthy to make a majority: nothing was waited for.
    Impossible { healthy: usize, needed: usize },
    /// The copies did not answer in time: the write may or may not reach a majority.
    Timeout,
    /// This node stopped being the partition's active while waiting.
    NotActive,
}

/// [`shoal_cluster::copies_counted`] for `copies` with `state`'s replicas setting and data
/// nodes (active, leaving or failed members).
pub fn copies_counted(state: &MetaState, copies: &Copies) -> usize {
    shoal_cluster::copies_counted(state.settings.replicas, data_nodes(state), copies)
}

/// The quorum of partition `p` by `state`: [`Quorum::of`] its copies in the map, with the
/// rebalance plan's starting and target copies while one runs. `None` without a map or
/// such a partition.
pub fn quorum_of(state: &MetaState, p: u16) -> Option<Quorum> {
    let copies = state.map.as_ref()?.partitions.get(usize::from(p))?;
    let plan = state
        .rebalance
        .as_ref()
        .and_then(|plan| Some((plan.from.partitions.get(usize::from(p))?, plan.target.partitions.get(usize::from(p))?)));
    Some(Quorum::of(copies, copies_counted(state, copies), plan, configured_copies(state.settings.replicas, data_nodes(state))))
}

/// Members that hold data or did: running the data service, and active, leaving or failed.
fn data_nodes(state: &MetaState) -> usize {
    state
        .members
        .values()
        .filter(|m| m.services.data && matches!(m.state, MemberState::Active | MemberState::Leaving | MemberState::Failed))
        .count()
}

impl ClusterNode {
    /// Partition `p`'s quorum now, `None` when this node alone makes it (no replicas wanted).
    fn quorum_here(&self, p: u16) -> Option<Quorum> {
        quorum_of(&self.state(), p).filter(|q| !q.met(&|n| n == self.id))
    }

    /// Whether enough of partition `p`'s copies are healthy for a majority write of
    /// `collection` now (checked before writing, so a refusal means nothing was written).
    pub async fn majority_possible(&self, collection: u32, p: u16) -> Result<(), MajorityError> {
        match self.quorum_here(p) {
            Some(quorum) => self.enough_healthy(collection, p, &quorum).await,
            None => Ok(()),
        }
    }

    /// Waits until the healthy copies make `quorum` with this one, giving replicas not yet
    /// heard from since the last map change up to [`UNHEARD_REPLICA_GRACE`]; refuses at
    /// once when even those could not make it.
    async fn enough_healthy(&self, collection: u32, p: u16, quorum: &Quorum) -> Result<(), MajorityError> {
        let deadline = tokio::time::Instant::now() + UNHEARD_REPLICA_GRACE;
        let others = quorum.others(self.id);
        // Not heard from since the map changed, and never to be: a failed member, or one the
        // map no longer holds a copy on (a rebalance's starting copy a failover took out).
        let state = self.state();
        let can_answer = |n: &NodeId| {
            state.members.get(n).is_some_and(|m| m.state != MemberState::Failed)
                && state.map.as_ref().and_then(|m| m.partitions.get(usize::from(p))).is_some_and(|c| c.holds(*n))
        };
        let mut changes = self.acks.changes();
        loop {
            changes.borrow_and_update();
            let (healthy, mut unheard) = self.acks.heard(collection, p, &others, HEALTHY_ACK_WINDOW);
            unheard.retain(|n| can_answer(n));
            let Some((held, needed)) = quorum.unmet(&|n| n == self.id || healthy.contains(&n)) else { return Ok(()) };
            if !quorum.met(&|n| n == self.id || healthy.contains(&n) || unheard.contains(&n))
                || tokio::time::timeout_at(deadline, changes.changed()).await.map_or(true, |r| r.is_err())
            {
                return Err(MajorityError::Impossible { healthy: held, needed });
            }
        }
    }

    /// Waits until the change `seqno` of `collection`'s partition `p` (on history `uuid`) is
    /// held (`Majority`) or fsynced (`PersistMajority`) by a majority of the partition's
    /// copies — of each of its [`Quorum`]'s sets — this one counting for itself (for
    /// `PersistMajority` the caller has fsynced it here first).
    pub async fn await_majority(&self, collection: u32, p: u16, seqno: u64, uuid: u64, level: Durable) -> Result<(), MajorityError> {
        let Some(quorum) = self.quorum_here(p) else { return Ok(()) };
        let need = match level {
            Durable::Majority => Need::Received(seqno),
            Durable::PersistMajority => Need::Persisted(seqno),
        };
        let part = Part { collection, partition: p, uuid };
        if self.acks.wait_quorum(part, &quorum, self.id, need, Instant::now() + DURABLE_TIMEOUT).await {
            Ok(())
        } else {
            Err(MajorityError::Timeout)
        }
    }

    /// Confirms that what this node answers for `collection`'s partition `p` now is what a
    /// majority holds and that it is still the active (ReadIndex): everything up to the
    /// partition's high seqno is on a majority, and a majority acknowledged in a round that
    /// began after the caller read. A majority read calls it after reading; a majority write
    /// whose condition failed calls it before saying so.
    pub async fn confirm(&self, collection: &shoal_storage::Collection, p: u16) -> Result<(), MajorityError> {
        let Some(quorum) = self.quorum_here(p) else { return Ok(()) };
        let Some(StreamPosition { seqno, uuid }) = collection.position(p) else {
            return Err(MajorityError::NotActive);
        };
        self.enough_healthy(collection.id(), p, &quorum).await?;
        let round = self.acks.start_round();
        let need = Need::Confirmed { seqno, round };
        let part = Part { collection: collection.id(), partition: p, uuid };
        if !self.acks.wait_quorum(part, &quorum, self.id, need, Instant::now() + DURABLE_TIMEOUT).await {
            return Err(MajorityError::Timeout);
        }
        // Still the active of the same history: nothing was promoted meanwhile.
        match collection.position(p) {
            Some(pos) if pos.uuid == uuid && self.serving() => Ok(()),
            _ => Err(MajorityError::NotActive),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_cluster::{NodeId, PartitionMap};
    use shoal_meta::Member;

    #[test]
    fn a_majority_counts_the_failed_copy_slot_until_a_rebalance_fills_it_and_both_sets_of_a_rebalance() {
        let mut state = MetaState::default();
        state.settings.replicas = 1;
        for (id, s) in [(1, MemberState::Active), (2, MemberState::Failed), (3, MemberState::Active)] {
            state.members.insert(NodeId(id), Member::new(format!("n{id}"), s));
        }
        let copies = |replicas: &[u64]| Copies { active: NodeId(1), replicas: replicas.iter().map(|r| NodeId(*r)).collect() };
        state.map = Some(PartitionMap { version: 3, partitions: vec![copies(&[2]), copies(&[])] });
        let holding = |ids: &'static [u64]| move |n: NodeId| ids.contains(&n.0);
        let q = |state: &MetaState, p: u16| quorum_of(state, p).expect("a quorum");
        assert!(!q(&state, 0).met(&holding(&[1])), "both copies: the replica must acknowledge");
        assert!(q(&state, 0).met(&holding(&[1, 2])));
        assert!(!q(&state, 1).met(&holding(&[1])), "failed over: an acknowledgement no replica can give");
        assert_eq!(quorum_of(&state, 2), None, "no such partition");
        state.settings.replicas = 0;
        assert!(q(&state, 1).met(&holding(&[1])), "no replicas wanted");
        // A rebalance from {1; 2} to {1; 3}, at its build copies {1; 2, 3}: both sets.
        state.settings.replicas = 1;
        let from = PartitionMap { version: 3, partitions: vec![copies(&[2]), copies(&[])] };
        let target = PartitionMap { version: 0, partitions: vec![copies(&[3]), copies(&[3])] };
        state.rebalance = Some(shoal_meta::RebalancePlan { from, target, eject: Vec::new(), added: vec![NodeId(3)], stop: false });
        state.map = Some(PartitionMap { version: 4, partitions: vec![copies(&[2, 3]), copies(&[3])] });
        assert!(!q(&state, 0).met(&holding(&[1, 3])), "a majority of the build copies, not of the starting ones");
        assert!(q(&state, 0).met(&holding(&[1, 2, 3])));
    }
}
