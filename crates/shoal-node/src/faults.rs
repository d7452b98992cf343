//! Fault injection (`serve --fault-injection`, for tests): a replica that leaves one
//! collection's replicated changes unapplied, maps whose partition states follow late, as a
//! slow fsync would, and index copies adopted here that answer late, as a slow disk would
//! make them. Nothing here runs unless a test asks for it.

use std::collections::HashSet;
use std::time::Duration;

use parking_lot::Mutex;

use crate::node::ClusterNode;
use crate::ClusterError;

/// The longest map or adoption delay fault injection takes (`ClusterNode::delay_maps`,
/// `ClusterNode::delay_index_adoptions`).
pub const MAP_DELAY_MAX: Duration = Duration::from_secs(30);

/// The faults asked for; none by default.
#[derive(Default)]
pub(crate) struct Faults {
    /// Collections (by id) whose replicated changes this node leaves unapplied, as a replica
    /// lagging in one collection would.
    held: Mutex<HashSet<u32>>,
    /// How long each map waits before the partition states follow it.
    map_delay: Mutex<Duration>,
    /// How long an index copy adopted here waits, once built, before it answers the leader
    /// (a rebalance holds its copies unnamed in the placement that long).
    adopt_delay: Mutex<Duration>,
}

impl Faults {
    /// Whether replicated changes of collection `id` are held back.
    pub(crate) fn is_held(&self, id: u32) -> bool {
        self.held.lock().contains(&id)
    }

    /// How long a map waits before the partition states follow it.
    pub(crate) fn map_delay(&self) -> Duration {
        *self.map_delay.lock()
    }

    /// How long an index copy adopted here waits before it answers.
    pub(crate) fn adopt_delay(&self) -> Duration {
        *self.adopt_delay.lock()
    }
}

impl ClusterNode {
    /// Leaves the replicated changes of the named collections unapplied (and
    /// unacknowledged) until called again without them. Unknown names are errors.
    pub fn hold_collections(&self, names: &[String]) -> Result<(), ClusterError> {
        let state = self.state();
        let ids = names
            .iter()
            .map(|n| state.collections.get(n).map(|d| d.id).ok_or_else(|| ClusterError::Refused(format!("no collection {n}"))))
            .collect::<Result<HashSet<u32>, ClusterError>>()?;
        *self.faults.held.lock() = ids;
        Ok(())
    }

    /// Every map waits `delay` (at most [`MAP_DELAY_MAX`]) before the partition states here
    /// follow it, while the metadata (what the pulls and the router read) has it already.
    pub fn delay_maps(&self, delay: Duration) {
        debug_assert!(delay <= MAP_DELAY_MAX, "the caller checks the bound");
        *self.faults.map_delay.lock() = delay.min(MAP_DELAY_MAX);
    }

    /// Every index copy adopted here waits `delay` (at most [`MAP_DELAY_MAX`]) once built
    /// before it answers the rebalance that asked for it.
    pub fn delay_index_adoptions(&self, delay: Duration) {
        debug_assert!(delay <= MAP_DELAY_MAX, "the caller checks the bound");
        *self.faults.adopt_delay.lock() = delay.min(MAP_DELAY_MAX);
    }
}
