//! Pre-vote (the Raft thesis, §9.6): a member that stopped hearing from its leader asks the
//! voters whether they would vote before it starts an election, and starts one only if a
//! majority would. openraft 0.9 has no pre-vote, so its own election timer is off
//! (`Config::enable_elect`) and [`drive`] decides when to campaign
//! (`Raft::trigger().elect()`).
//!
//! Why: a member paused (`SIGSTOP`, a long GC-like stall) or cut off for longer than the
//! election timeout comes back with its timer run out. Without pre-vote it raised its term at
//! once: the leader, hearing the higher term in an append-entries answer, stepped down, and
//! the cluster had no metadata leader for seconds (members answered `503 "lost contact with
//! the metadata leader"` meanwhile), or the returning member took the lead. With pre-vote it
//! hears that the others still have a leader, raises nothing, and follows again at the
//! leader's next heartbeat.
//!
//! A voter grants a pre-vote when it has not heard from a leader for the lease
//! ([`grants_pre_vote`]): a follower by the last append-entries or snapshot it accepted, a
//! leader by its quorum's last acknowledgement; and when the candidate's log reaches as far
//! as its own (by index: openraft keeps the last entry's term to itself, and the real vote
//! checks both — this only keeps a lagging member from raising the term for an election it
//! cannot win, as openraft's timer held such a member back). The decisions are pure and table-tested; the
//! timer and the messages are [`drive`]'s.

use std::sync::Arc;
use std::time::{Duration, Instant};

use openraft::{Raft, ServerState};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::network::{MetaTransport, RpcKind};
use crate::node::{ELECTION_TIMEOUT_MAX_MS, ELECTION_TIMEOUT_MIN_MS};
use crate::TypeConfig;

/// How often the driver looks at the time since this member last heard from a leader.
pub const PRE_VOTE_TICK: Duration = Duration::from_millis(50);
/// How long a pre-vote request may take; past it the voter counts as refusing.
pub const PRE_VOTE_TIMEOUT: Duration = Duration::from_millis(500);
/// A voter that heard from a leader within this long refuses pre-votes (openraft's own
/// leader lease: it refuses real votes as long).
pub const LEADER_LEASE: Duration = Duration::from_millis(ELECTION_TIMEOUT_MAX_MS);

/// A candidate asks whether the voters would vote for it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PreVoteRequest {
    pub candidate: u64,
    /// The index of the candidate's last log entry.
    pub last_log_index: Option<u64>,
}

/// A voter's answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PreVoteResponse {
    pub granted: bool,
}

/// When this member last heard from a leader (or granted a vote, or campaigned: each resets
/// the election timer, as in Raft).
#[derive(Debug)]
pub struct Heard {
    at: Mutex<Instant>,
}

impl Heard {
    /// A member just started hears from no one yet, and waits a whole timeout before it
    /// campaigns (openraft refuses votes as long after a start).
    pub fn new() -> Self {
        Heard { at: Mutex::new(Instant::now()) }
    }

    pub fn touch(&self) {
        *self.at.lock() = Instant::now();
    }

    pub fn since(&self) -> Duration {
        self.at.lock().elapsed()
    }
}

impl Default for Heard {
    fn default() -> Self {
        Heard::new()
    }
}

/// Whether a voter grants a pre-vote: a leader that its quorum acknowledged within the lease
/// refuses (`since_quorum_ack`; `None`: no acknowledgement yet, as just after its election
/// by a quorum, refuses too), anyone else that heard from a leader within the lease refuses.
/// A candidate whose log ends before this member's (`candidate_log` < `my_log`) is refused
/// either way. Pure.
///
/// A voter that follows no leader (its vote is not committed: it is a candidate itself, or
/// voted for one that has not won) has no leader to keep, and grants at once: else two
/// followers that both campaigned after their leader died would refuse each other until the
/// lease was over, and their split vote would last that long.
pub fn grants_pre_vote(
    leading: bool,
    since_quorum_ack: Option<Duration>,
    follows_leader: bool,
    since_heard: Duration,
    candidate_log: Option<u64>,
    my_log: Option<u64>,
) -> bool {
    if candidate_log < my_log {
        return false;
    }
    if leading {
        return since_quorum_ack.is_some_and(|d| d >= LEADER_LEASE);
    }
    !follows_leader || since_heard >= LEADER_LEASE
}

/// Whether `grants` of `voters` (the asking member's own included) is a majority. Pure.
pub fn majority(grants: usize, voters: usize) -> bool {
    grants * 2 > voters
}

/// How long a voter of a group of `voters` waits in silence before it asks to campaign:
/// the lease plus a random part of the election timeout (`jitter` in 0..1), so that the
/// voters do not all ask at once — as openraft's own timer waited. The only voter campaigns
/// at once. Pure.
///
/// A member that follows no leader (after a campaign that did not win, or a vote for one)
/// waits the timeout alone, as openraft's timer did for a vote not committed.
pub fn campaign_after(voters: usize, jitter: f64, follows_leader: bool) -> Duration {
    if voters <= 1 {
        return Duration::ZERO;
    }
    let span = (ELECTION_TIMEOUT_MAX_MS - ELECTION_TIMEOUT_MIN_MS) as f64;
    let timeout = Duration::from_millis(ELECTION_TIMEOUT_MIN_MS + (span * jitter.clamp(0.0, 1.0)) as u64);
    if follows_leader {
        LEADER_LEASE + timeout
    } else {
        timeout
    }
}

/// A number in 0..1 that differs between members and between calls.
fn jitter(id: u64) -> f64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&id.to_le_bytes());
    bytes[8..].copy_from_slice(&nanos.to_le_bytes());
    (xxhash_rust::xxh3::xxh3_64(&bytes) >> 11) as f64 / (1u64 << 53) as f64
}

/// One pre-vote round of member `id`: asks every other voter at once and returns the grants
/// (its own included). A voter that does not answer within [`PRE_VOTE_TIMEOUT`], or answers
/// with an error, counts as refusing. The round ends once a majority granted (or can no
/// longer): a voter that does not answer (a stopped leader) would otherwise hold it up to
/// `PRE_VOTE_TIMEOUT`, and the other followers' timers meanwhile run out too.
async fn pre_vote_round<T: MetaTransport>(transport: &Arc<T>, id: u64, voters: &[(u64, String)], body: Vec<u8>) -> usize {
    let mut asks = tokio::task::JoinSet::new();
    for (v, address) in voters.iter().filter(|(v, _)| *v != id).cloned() {
        let (transport, body) = (Arc::clone(transport), body.clone());
        asks.spawn(async move {
            let sent = tokio::time::timeout(PRE_VOTE_TIMEOUT, transport.send(v, &address, RpcKind::PreVote, body)).await;
            matches!(sent, Ok(Ok(b)) if serde_json::from_slice::<PreVoteResponse>(&b).is_ok_and(|r| r.granted))
        });
    }
    let in_group = usize::from(voters.iter().any(|(v, _)| *v == id));
    let (mut grants, mut left) = (in_group, asks.len());
    while !majority(grants, voters.len()) && majority(grants + left, voters.len()) {
        match asks.join_next().await {
            Some(answer) => {
                left -= 1;
                grants += usize::from(answer.unwrap_or(false));
            }
            None => break,
        }
    }
    grants
}

/// This member's answer to a pre-vote request, from its Raft's view now.
pub(crate) fn answer(raft: &Raft<TypeConfig>, heard: &Heard, req: &PreVoteRequest) -> PreVoteResponse {
    let (leading, since_ack, follows, my_log) = {
        let m = raft.metrics();
        let m = m.borrow();
        (m.state == ServerState::Leader, m.millis_since_quorum_ack.map(Duration::from_millis), m.vote.is_committed(), m.last_log_index)
    };
    PreVoteResponse { granted: grants_pre_vote(leading, since_ack, follows, heard.since(), req.last_log_index, my_log) }
}

/// The election timer of member `id`: until Raft stops, campaigns when it has heard from no
/// leader for [`campaign_after`] and a majority of the voters grants a pre-vote.
pub(crate) async fn drive<T: MetaTransport>(raft: Raft<TypeConfig>, id: u64, transport: Arc<T>, heard: Arc<Heard>) {
    // Drawn again after each attempt; the wait follows the voters as they change.
    let mut jitter_now = jitter(id);
    loop {
        tokio::time::sleep(PRE_VOTE_TICK).await;
        let (running, leading, voters, last_log_index, follows) = {
            let m = raft.metrics();
            let m = m.borrow();
            let membership = m.membership_config.membership();
            let voters: Vec<(u64, String)> =
                membership.voter_ids().map(|v| (v, membership.get_node(&v).map(|n| n.addr.clone()).unwrap_or_default())).collect();
            (m.running_state.is_ok(), m.state == ServerState::Leader, voters, m.last_log_index, m.vote.is_committed())
        };
        if !running {
            break;
        }
        let wait = campaign_after(voters.len(), jitter_now, follows);
        if leading || !voters.iter().any(|(v, _)| *v == id) {
            heard.touch();
            continue;
        }
        if heard.since() < wait {
            continue;
        }
        let body = match serde_json::to_vec(&PreVoteRequest { candidate: id, last_log_index }) {
            Ok(b) => b,
            Err(_) => continue,
        };
        let grants = pre_vote_round(&transport, id, &voters, body).await;
        // A new timeout either way: the next attempt waits a whole one.
        heard.touch();
        jitter_now = jitter(id);
        let won = majority(grants, voters.len());
        tracing::debug!(grants, voters = voters.len(), won, "pre-vote");
        if won && raft.trigger().elect().await.is_err() {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn a_voter_grants_a_pre_vote_only_once_its_leader_is_silent_for_the_lease() {
        let lease = LEADER_LEASE.as_millis() as u64;
        // (leading, since the quorum's last ack, since this member heard from a leader, grants;
        // the candidate's log as long as the voter's)
        let table = [
            // A follower that hears its leader's heartbeats: the candidate came back from a pause.
            (false, None, MS(100), false),
            (false, None, MS(lease - 1), false),
            (false, None, MS(lease), true),
            (false, None, MS(10_000), true),
            // A leader its quorum acknowledges keeps the lead.
            (true, Some(MS(50)), MS(0), false),
            (true, Some(MS(lease - 1)), MS(0), false),
            // A leader cut off from its quorum lets the others elect.
            (true, Some(MS(lease)), MS(0), true),
            // Just elected, by a quorum.
            (true, None, MS(0), false),
        ];
        for (leading, ack, heard, grants) in table {
            assert_eq!(grants_pre_vote(leading, ack, true, heard, Some(40), Some(40)), grants, "{leading} {ack:?} {heard:?}");
        }
    }

    #[test]
    fn a_voter_grants_no_pre_vote_to_a_candidate_whose_log_ends_before_its_own() {
        let silent = LEADER_LEASE * 2;
        // (the candidate's last log index, the voter's, grants)
        let table = [
            (Some(40), Some(40), true),
            (Some(41), Some(40), true),
            (Some(39), Some(40), false),
            (None, Some(1), false),
            (Some(1), None, true),
            (None, None, true),
        ];
        for (candidate, mine, grants) in table {
            assert_eq!(grants_pre_vote(false, None, true, silent, candidate, mine), grants, "{candidate:?} {mine:?}");
            assert_eq!(
                grants_pre_vote(true, Some(silent), true, silent, candidate, mine),
                grants,
                "a leader cut off: {candidate:?} {mine:?}"
            );
            assert_eq!(grants_pre_vote(false, None, false, Duration::ZERO, candidate, mine), grants, "a candidate: {candidate:?} {mine:?}");
        }
    }

    #[test]
    fn a_voter_that_follows_no_leader_grants_at_once() {
        // Two followers whose leader died both campaigned; neither won (a split vote).
        assert!(grants_pre_vote(false, None, false, Duration::ZERO, Some(40), Some(40)));
        assert!(!grants_pre_vote(false, None, true, Duration::ZERO, Some(40), Some(40)), "one that follows a leader it just heard refuses");
    }

    #[test]
    fn a_campaign_needs_a_strict_majority_of_the_voters() {
        // (grants, the asking member's own included; voters; campaigns)
        let table = [(1, 1, true), (1, 2, false), (2, 2, true), (1, 3, false), (2, 3, true), (2, 4, false), (3, 4, true), (3, 5, true)];
        for (grants, voters, campaigns) in table {
            assert_eq!(majority(grants, voters), campaigns, "{grants} of {voters}");
        }
    }

    #[test]
    fn a_voter_waits_the_lease_and_a_random_part_of_the_timeout_and_the_only_voter_none() {
        assert_eq!(campaign_after(1, 0.7, true), Duration::ZERO);
        assert_eq!(campaign_after(3, 0.0, true), LEADER_LEASE + MS(ELECTION_TIMEOUT_MIN_MS));
        assert_eq!(campaign_after(3, 1.0, true), LEADER_LEASE + MS(ELECTION_TIMEOUT_MAX_MS));
        assert_eq!(campaign_after(3, 7.0, true), campaign_after(3, 1.0, true), "clamped");
        // After a campaign that did not win: the timeout alone.
        assert_eq!(campaign_after(3, 0.0, false), MS(ELECTION_TIMEOUT_MIN_MS));
        assert_eq!(campaign_after(3, 1.0, false), MS(ELECTION_TIMEOUT_MAX_MS));
        let spread: std::collections::BTreeSet<u64> = (0..50).map(|i| campaign_after(3, jitter(i), true).as_millis() as u64).collect();
        assert!(spread.len() > 10, "members wait different times: {spread:?}");
        assert!(spread.iter().all(|ms| (lease_ms() + ELECTION_TIMEOUT_MIN_MS..=lease_ms() + ELECTION_TIMEOUT_MAX_MS).contains(ms)));
    }

    fn lease_ms() -> u64 {
        LEADER_LEASE.as_millis() as u64
    }

    /// How each voter of a pre-vote round answers.
    #[derive(Clone, Copy)]
    enum Voter {
        Grants,
        Refuses,
        /// An error from the transport (unreachable).
        Fails,
        /// Never answers: a stopped (`SIGSTOP`) leader.
        Silent,
    }

    struct Voters(Vec<Voter>);

    impl MetaTransport for Voters {
        async fn send(&self, target: u64, address: &str, kind: RpcKind, _body: Vec<u8>) -> Result<Vec<u8>, crate::network::TransportError> {
            assert_eq!(kind, RpcKind::PreVote);
            let answer = |granted| Ok(serde_json::to_vec(&PreVoteResponse { granted }).unwrap_or_default());
            match self.0[target as usize] {
                Voter::Grants => answer(true),
                Voter::Refuses => answer(false),
                Voter::Fails => Err(crate::network::TransportError::Unreachable { address: address.to_string(), why: "refused".into() }),
                Voter::Silent => std::future::pending().await,
            }
        }
    }

    /// Runs a round of member 0 among `others` (members 1..) under tokio's paused clock;
    /// returns the grants and how long the round took on that clock.
    async fn round(others: &[Voter]) -> (usize, Duration) {
        let mut all = vec![Voter::Grants];
        all.extend_from_slice(others);
        let voters: Vec<(u64, String)> = (0..all.len() as u64).map(|v| (v, format!("member-{v}"))).collect();
        let start = tokio::time::Instant::now();
        let grants = pre_vote_round(&Arc::new(Voters(all)), 0, &voters, b"{}".to_vec()).await;
        (grants, start.elapsed())
    }

    #[tokio::test(start_paused = true)]
    async fn a_voter_that_does_not_answer_counts_as_refusing_after_the_pre_vote_timeout() {
        use Voter::*;
        // (the other voters, grants, whether the round waits out PRE_VOTE_TIMEOUT)
        let table: [(&[Voter], usize, bool); 8] = [
            // A majority without the silent one: the round does not wait for it.
            (&[Grants, Silent], 2, false),
            (&[Grants, Grants, Silent, Silent], 3, false),
            // The silent voter could still make a majority: the round waits it out, and it
            // refuses.
            (&[Refuses, Silent], 1, true),
            (&[Grants, Refuses, Silent, Silent], 2, true),
            (&[Silent, Silent], 1, true),
            (&[Refuses, Refuses, Silent, Silent], 1, true),
            // No majority is possible any more: the round does not wait.
            (&[Refuses, Refuses, Refuses, Silent], 1, false),
            // An unreachable voter refuses at once.
            (&[Fails, Fails], 1, false),
        ];
        for (others, grants, waits) in table {
            let (got, took) = round(others).await;
            assert_eq!(got, grants, "{} voters", others.len() + 1);
            assert_eq!(took >= PRE_VOTE_TIMEOUT, waits, "{} voters: took {took:?}", others.len() + 1);
            assert!(took <= PRE_VOTE_TIMEOUT + MS(1), "never longer than the timeout: {took:?}");
        }
    }
}
