//! `VoteGate`: a member votes for no candidate while it still vouches for a leader.
//!
//! Above the log, the cluster gives leases: a leader serves while a quorum of voters
//! answered its pings *as their leader's* within the lease (shoal-node's `failover`). A
//! member that answers so vouches for that leader. The gate makes vouching and voting
//! exclusive in time: a member grants no vote until `hold` after it last vouched, and
//! vouches for no one but the candidate it voted for until `hold` after the vote. With
//! `hold` at least the lease, a new leader's election quorum — which meets every quorum the
//! old leader's lease rested on — is proof that the old leader's lease is over by the time
//! of the election, except as this member itself vouched (it votes for itself without the
//! gate). So a new leader need not wait a whole lease out for its predecessor.
//!
//! openraft has a lease of its own (a follower refuses votes for `election_timeout_max`
//! after the leader's last heartbeat); the gate adds the same rule for the pings, which
//! travel apart from the log's messages. The gate's state is not kept across a restart:
//! that is safe because openraft, on start, refuses votes for `election_timeout_max` (it
//! sets its vote's time to the start), so the hold must not exceed that (shoal-node checks
//! it at compile time).

use std::time::{Duration, Instant};

use parking_lot::Mutex;

#[derive(Debug, Default)]
struct GateState {
    /// When this member last vouched for a leader.
    vouched: Option<Instant>,
    /// A vote request is being handled.
    voting: bool,
    /// The last candidate this member granted a vote to, and when.
    voted: Option<(u64, Instant)>,
}

/// See the module documentation.
#[derive(Debug)]
pub struct VoteGate {
    hold: Duration,
    state: Mutex<GateState>,
}

/// A vote the gate let through; its end is recorded by `granted` or by drop.
pub struct VoteTicket<'a> {
    gate: &'a VoteGate,
}

impl VoteTicket<'_> {
    /// The vote was granted to `candidate`.
    pub fn granted(&self, candidate: u64) {
        self.gate.state.lock().voted = Some((candidate, Instant::now()));
    }
}

impl Drop for VoteTicket<'_> {
    fn drop(&mut self) {
        self.gate.state.lock().voting = false;
    }
}

impl VoteGate {
    pub fn new(hold: Duration) -> Self {
        VoteGate { hold, state: Mutex::new(GateState::default()) }
    }

    /// Asks to vouch for `leader` now: refused while a vote is being handled, or within
    /// `hold` of a vote granted to anyone else.
    pub fn vouch(&self, leader: u64) -> bool {
        let mut s = self.state.lock();
        if s.voting || s.voted.is_some_and(|(c, at)| c != leader && at.elapsed() < self.hold) {
            return false;
        }
        s.vouched = Some(Instant::now());
        true
    }

    /// When this member last vouched for a leader.
    pub fn last_vouched(&self) -> Option<Instant> {
        self.state.lock().vouched
    }

    /// Whether this member granted a vote to someone other than `me` within `hold`.
    pub fn voted_for_another(&self, me: u64) -> bool {
        self.state.lock().voted.is_some_and(|(c, at)| c != me && at.elapsed() < self.hold)
    }

    /// Lets a vote request through, unless this member vouched within `hold` or another
    /// request is being handled.
    pub fn admit_vote(&self) -> Option<VoteTicket<'_>> {
        let mut s = self.state.lock();
        if s.voting || s.vouched.is_some_and(|v| v.elapsed() < self.hold) {
            return None;
        }
        s.voting = true;
        Some(VoteTicket { gate: self })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOLD: Duration = Duration::from_millis(200);

    #[test]
    fn a_member_that_vouched_votes_only_after_the_hold() {
        let gate = VoteGate::new(HOLD);
        assert!(gate.admit_vote().is_some(), "a member that never vouched votes");
        assert!(gate.vouch(1));
        assert!(gate.admit_vote().is_none(), "just vouched");
        std::thread::sleep(HOLD + Duration::from_millis(20));
        assert!(gate.admit_vote().is_some(), "the hold is over");
    }

    #[test]
    fn a_member_that_voted_vouches_only_for_its_candidate_until_the_hold_is_over() {
        let gate = VoteGate::new(HOLD);
        let ticket = gate.admit_vote().expect("admitted");
        assert!(!gate.vouch(1), "no vouching while a vote is handled");
        assert!(gate.admit_vote().is_none(), "one vote at a time");
        ticket.granted(2);
        drop(ticket);
        assert!(!gate.vouch(1), "voted for another");
        assert!(gate.voted_for_another(1));
        assert!(!gate.voted_for_another(2));
        assert!(gate.vouch(2), "the candidate it voted for");
        std::thread::sleep(HOLD + Duration::from_millis(20));
        assert!(gate.vouch(1));
        assert!(!gate.voted_for_another(1));
    }

    #[test]
    fn a_refused_vote_leaves_vouching_open() {
        let gate = VoteGate::new(HOLD);
        drop(gate.admit_vote().expect("admitted"));
        assert!(gate.vouch(1));
        assert!(gate.last_vouched().is_some());
    }
}
