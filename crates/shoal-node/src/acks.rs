//! What the active copy knows of its replicas: per collection and partition, each replica's
//! last acknowledgement (received and persisted seqno, on which history, in which
//! confirmation round). Majority writes and majority reads wait here.
//!
//! A *round* is how a read learns that it still talks to the active: the read starts a new
//! round and wakes every held pull; each replica echoes the round of the answer it got in its
//! next pull. A pull that echoes round `r` was sent after round `r` began, by a replica that
//! still followed this node then — so no other copy had been promoted when the read began
//! (a replica stops following a node before any copy of it is promoted; see `failover`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use shoal_cluster::{NodeId, Quorum};
use tokio::sync::watch;

use crate::wire::PullPart;

/// One replica's last acknowledgement of one collection's copy of one partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyAck {
    pub received: u64,
    pub persisted: u64,
    pub uuid: u64,
    pub consistent: bool,
    pub round: u64,
    pub at: Instant,
}

/// What a wait needs of a replica's acknowledgement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// Holds `seqno` (in memory).
    Received(u64),
    /// Has fsynced `seqno`.
    Persisted(u64),
    /// Holds `seqno` and acknowledged in round `round` or later.
    Confirmed { seqno: u64, round: u64 },
}

impl Need {
    fn met_by(self, ack: &CopyAck, uuid: u64) -> bool {
        if ack.uuid != uuid || !ack.consistent {
            return false;
        }
        match self {
            Need::Received(s) => ack.received >= s,
            Need::Persisted(s) => ack.persisted >= s,
            Need::Confirmed { seqno, round } => ack.received >= seqno && ack.round >= round,
        }
    }
}

/// One collection's copy of one partition on one history: what acknowledgements are of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Part {
    pub collection: u32,
    pub partition: u16,
    pub uuid: u64,
}

/// What [`Acks::health`] found of a partition's replicas.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Health {
    pub healthy: usize,
    /// Of the healthy: those whose copy is consistent (past its first snapshot's end).
    pub consistent: usize,
    pub unheard: usize,
}

#[derive(Default)]
pub struct Acks {
    by_part: Mutex<HashMap<(u32, u16), HashMap<NodeId, CopyAck>>>,
    round: AtomicU64,
    /// Moves on every acknowledgement: waiters look again.
    changed: watch::Sender<u64>,
    /// Moves when a round starts: held pulls answer at once.
    poke: watch::Sender<u64>,
}

impl Acks {
    /// Records a pull's acknowledgements from replica `from`.
    pub fn record(&self, from: NodeId, round: u64, parts: &[PullPart]) {
        let now = Instant::now();
        {
            let mut by_part = self.by_part.lock();
            for part in parts {
                let ack = CopyAck {
                    received: part.seqno,
                    persisted: part.persisted.min(part.seqno),
                    uuid: part.uuid,
                    consistent: part.consistent,
                    round,
                    at: now,
                };
                by_part.entry((part.collection, part.partition)).or_default().insert(from, ack);
            }
        }
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Forgets every acknowledgement (the node's copies changed hands).
    pub fn clear(&self) {
        self.by_part.lock().clear();
    }

    /// Starts a confirmation round and wakes held pulls; answers the round's number.
    pub fn start_round(&self) -> u64 {
        let r = self.round.fetch_add(1, Ordering::AcqRel) + 1;
        self.poke.send_modify(|n| *n = n.wrapping_add(1));
        r
    }

    pub fn round(&self) -> u64 {
        self.round.load(Ordering::Acquire)
    }

    pub fn poked(&self) -> watch::Receiver<u64> {
        self.poke.subscribe()
    }

    /// How many of `replicas` meet `need` for `part`.
    pub fn count(&self, part: Part, replicas: &[NodeId], need: Need) -> usize {
        let by_part = self.by_part.lock();
        let Some(acks) = by_part.get(&(part.collection, part.partition)) else { return 0 };
        replicas.iter().filter(|r| acks.get(r).is_some_and(|a| need.met_by(a, part.uuid))).count()
    }

    /// Of `replicas`: how many acknowledged anything within `window` (healthy followers),
    /// and how many were not heard from at all since the acknowledgements were last
    /// cleared (a map change) — those are neither healthy nor known to be down yet.
    pub fn health(&self, collection: u32, partition: u16, replicas: &[NodeId], window: Duration) -> Health {
        let by_part = self.by_part.lock();
        let acks = by_part.get(&(collection, partition));
        let mut health = Health::default();
        for r in replicas {
            match acks.and_then(|a| a.get(r)) {
                Some(a) if a.at.elapsed() <= window => {
                    health.healthy += 1;
                    health.consistent += usize::from(a.consistent);
                }
                Some(_) => {}
                None => health.unheard += 1,
            }
        }
        health
    }

    /// Of `nodes`: those that acknowledged anything within `window`, and those not heard
    /// from at all since the acknowledgements were last cleared (see [`Acks::health`]).
    pub fn heard(&self, collection: u32, partition: u16, nodes: &[NodeId], window: Duration) -> (Vec<NodeId>, Vec<NodeId>) {
        let by_part = self.by_part.lock();
        let acks = by_part.get(&(collection, partition));
        let (mut healthy, mut unheard) = (Vec::new(), Vec::new());
        for n in nodes {
            match acks.and_then(|a| a.get(n)) {
                Some(a) if a.at.elapsed() <= window => healthy.push(*n),
                Some(_) => {}
                None => unheard.push(*n),
            }
        }
        (healthy, unheard)
    }

    /// Whether the replicas meeting `need` for `part` make `quorum` with `me` (the active,
    /// which holds what it wrote).
    pub fn met(&self, part: Part, quorum: &Quorum, me: NodeId, need: Need) -> bool {
        let by_part = self.by_part.lock();
        let acks = by_part.get(&(part.collection, part.partition));
        quorum.met(&|n| n == me || acks.and_then(|a| a.get(&n)).is_some_and(|a| need.met_by(a, part.uuid)))
    }

    /// Waits until the replicas meeting `need` for `part` make `quorum` with `me`, or
    /// `deadline`; answers whether they did.
    pub async fn wait_quorum(&self, part: Part, quorum: &Quorum, me: NodeId, need: Need, deadline: Instant) -> bool {
        let mut changed = self.changed.subscribe();
        loop {
            changed.borrow_and_update();
            if self.met(part, quorum, me, need) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            if tokio::time::timeout(left, changed.changed()).await.is_err() {
                return self.met(part, quorum, me, need);
            }
        }
    }

    /// Moves on every acknowledgement.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// The last acknowledgement of `replica`.
    pub fn get(&self, collection: u32, partition: u16, replica: NodeId) -> Option<CopyAck> {
        self.by_part.lock().get(&(collection, partition)).and_then(|a| a.get(&replica).copied())
    }

    /// Waits until `wanted` of `replicas` meet `need` for `part`, or `deadline`; answers
    /// whether they did.
    pub async fn wait(&self, part: Part, replicas: &[NodeId], wanted: usize, need: Need, deadline: Instant) -> bool {
        let mut changed = self.changed.subscribe();
        loop {
            changed.borrow_and_update();
            if self.count(part, replicas, need) >= wanted {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            if tokio::time::timeout(left, changed.changed()).await.is_err() {
                return self.count(part, replicas, need) >= wanted;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(seqno: u64, persisted: u64, uuid: u64, consistent: bool) -> PullPart {
        PullPart { collection: 1, partition: 3, seqno, uuid, persisted, consistent, peek: false }
    }

    #[test]
    fn needs_are_met_only_on_the_same_history_and_a_consistent_copy() {
        let acks = Acks::default();
        acks.record(NodeId(7), 0, &[part(10, 4, 99, true)]);
        acks.record(NodeId(8), 2, &[part(12, 12, 98, true)]);
        acks.record(NodeId(9), 5, &[part(20, 20, 99, false)]);
        let r = [NodeId(7), NodeId(8), NodeId(9)];
        let table = [
            (Need::Received(10), 1),
            (Need::Received(11), 0),
            (Need::Persisted(4), 1),
            (Need::Persisted(5), 0),
            (Need::Confirmed { seqno: 1, round: 0 }, 1),
            (Need::Confirmed { seqno: 1, round: 1 }, 0),
        ];
        for (need, want) in table {
            assert_eq!(acks.count(Part { collection: 1, partition: 3, uuid: 99 }, &r, need), want, "{need:?}");
        }
        assert_eq!(acks.count(Part { collection: 1, partition: 4, uuid: 99 }, &r, Need::Received(0)), 0, "another partition");
    }

    #[tokio::test]
    async fn a_wait_ends_when_enough_replicas_acknowledge() {
        let acks = std::sync::Arc::new(Acks::default());
        let a = std::sync::Arc::clone(&acks);
        let waiter = tokio::spawn(async move {
            a.wait(
                Part { collection: 1, partition: 3, uuid: 5 },
                &[NodeId(7), NodeId(8)],
                1,
                Need::Received(3),
                Instant::now() + Duration::from_secs(30),
            )
            .await
        });
        tokio::task::yield_now().await;
        acks.record(NodeId(8), 0, &[part(3, 0, 5, true)]);
        assert!(waiter.await.unwrap());
        assert!(
            !acks.wait(Part { collection: 1, partition: 3, uuid: 5 }, &[NodeId(7), NodeId(8)], 2, Need::Received(3), Instant::now()).await,
            "a passed deadline answers at once"
        );
        let r = acks.start_round();
        assert_eq!(acks.round(), r);
    }

    #[test]
    fn health_tells_the_unheard_from_the_silent() {
        let acks = Acks::default();
        acks.record(NodeId(7), 0, &[part(1, 1, 5, true)]);
        acks.record(NodeId(9), 0, &[part(1, 1, 5, false)]);
        let h = acks.health(1, 3, &[NodeId(7), NodeId(8), NodeId(9)], Duration::from_secs(60));
        assert_eq!(h, Health { healthy: 2, consistent: 1, unheard: 1 }, "9 is still reading its first snapshot");
        std::thread::sleep(Duration::from_millis(5));
        let h = acks.health(1, 3, &[NodeId(7), NodeId(8)], Duration::from_millis(1));
        assert_eq!(h, Health { healthy: 0, consistent: 0, unheard: 1 }, "7 was heard from, too long ago: counted out");
        acks.clear();
        assert_eq!(
            acks.health(1, 3, &[NodeId(7), NodeId(8)], Duration::from_secs(60)),
            Health { healthy: 0, consistent: 0, unheard: 2 },
            "a map change"
        );
    }
}
