//! Three metadata members in one process over the in-process router: a leader is elected, a
//! command commits and is applied everywhere, the leader is stopped and another takes over,
//! and a restarted member (same directory) catches up. Waits have generous deadlines; no
//! test asserts how long anything took.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use shoal_meta::{InProcessRouter, MetaCommand, MetaNode, MetaReject, MetaResponse, MetaState, ProposeError};
use tempfile::TempDir;

/// How long a test waits for something Raft will do eventually (an election, replication).
const WAIT_DEADLINE: Duration = Duration::from_secs(60);
const POLL_INTERVAL: Duration = Duration::from_millis(20);

fn address(id: u64) -> String {
    format!("member-{id}:7000")
}

async fn start(router: &Arc<InProcessRouter>, dirs: &BTreeMap<u64, TempDir>, id: u64) -> MetaNode {
    let node = MetaNode::open(dirs[&id].path(), id, Arc::clone(router), std::time::Duration::from_millis(1_500)).await.unwrap();
    router.serve(&address(id), &node);
    node
}

async fn wait_for<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = tokio::time::Instant::now() + WAIT_DEADLINE;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(tokio::time::Instant::now() < deadline, "gave up waiting for {what}");
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// Members 1 to 3, each in a directory of its own, started and initialized as one group.
async fn three_started() -> (Arc<InProcessRouter>, BTreeMap<u64, TempDir>, BTreeMap<u64, MetaNode>) {
    let router = InProcessRouter::new();
    let dirs: BTreeMap<u64, TempDir> = (1..=3).map(|id| (id, TempDir::new().unwrap())).collect();
    let mut nodes = BTreeMap::new();
    for id in 1..=3 {
        nodes.insert(id, start(&router, &dirs, id).await);
    }
    nodes[&1].initialize((1..=3).map(|id| (id, address(id))).collect()).await.unwrap();
    (router, dirs, nodes)
}

/// The leader all `nodes` agree on.
async fn agreed_leader(nodes: &BTreeMap<u64, MetaNode>) -> u64 {
    wait_for("an agreed leader", || {
        let leaders: Vec<Option<u64>> = nodes.values().map(MetaNode::leader).collect();
        let first = leaders[0]?;
        (nodes.contains_key(&first) && leaders.iter().all(|l| *l == Some(first))).then_some(first)
    })
    .await
}

async fn wait_applied(node: &MetaNode, what: &str, check: impl Fn(&MetaState) -> bool) {
    let mut watch = node.watch();
    let found = tokio::time::timeout(WAIT_DEADLINE, watch.wait_for(|state| check(state))).await;
    assert!(matches!(found, Ok(Ok(_))), "member {} never applied {what}", node.id());
}

fn create(name: &str) -> MetaCommand {
    MetaCommand::CreateCollection { name: name.into(), max_ttl: 0, id: None }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_elect_commit_fail_over_and_catch_up() {
    let (router, dirs, mut nodes) = three_started().await;
    // A second initialize anywhere is refused, not a second cluster.
    assert!(nodes[&1].initialize((1..=3).map(|id| (id, address(id))).collect()).await.is_err());

    let leader = agreed_leader(&nodes).await;
    let answer = nodes[&leader].propose(create("users")).await.unwrap();
    assert_eq!(answer, MetaResponse::CollectionCreated { id: 1 });
    // The first leader's term committed; no leader committed before it.
    assert_eq!(nodes[&leader].predecessor(), Some(None));
    assert!(nodes.iter().filter(|(id, _)| **id != leader).all(|(_, n)| n.predecessor().is_none()), "only the leader has a predecessor");
    for node in nodes.values() {
        wait_applied(node, "users", |s| s.collections.get("users").map(|c| c.id) == Some(1)).await;
    }
    // The log refuses the same way everywhere; a follower sends the caller to the leader.
    assert!(matches!(nodes[&leader].propose(create("users")).await, Err(ProposeError::Rejected(MetaReject::CollectionExists { .. }))));
    let follower = *nodes.keys().find(|&&id| id != leader).unwrap();
    match nodes[&follower].propose(create("orders")).await {
        Err(ProposeError::NotLeader { leader: Some(l), address: Some(a) }) => assert_eq!((l, a), (leader, address(leader))),
        other => panic!("a follower answered {other:?}"),
    }

    // Stop the leader: the other two elect a new one and commit.
    let old = nodes.remove(&leader).unwrap();
    router.unplug(&address(leader));
    old.shutdown().await.unwrap();
    drop(old);
    let new_leader = agreed_leader(&nodes).await;
    assert_ne!(new_leader, leader);
    let answer = nodes[&new_leader].propose(create("orders")).await.unwrap();
    assert_eq!(answer, MetaResponse::CollectionCreated { id: 2 }, "ids go on from the log, not from the leader");
    // The new leader knows whom it followed: the last leader that committed before it.
    assert_eq!(nodes[&new_leader].predecessor(), Some(Some(leader)));
    for node in nodes.values() {
        wait_applied(node, "orders", |s| s.collections.contains_key("orders")).await;
    }

    // The old leader restarts from its directory and catches up.
    let restarted = start(&router, &dirs, leader).await;
    wait_applied(&restarted, "users and orders", |s| s.collections.len() == 2 && s.next_collection_id == 3).await;
    nodes.insert(leader, restarted);
    let leader = agreed_leader(&nodes).await;
    nodes[&leader].propose(create("events")).await.unwrap();
    let states: Vec<MetaState> = {
        for node in nodes.values() {
            wait_applied(node, "events", |s| s.collections.contains_key("events")).await;
        }
        nodes.values().map(|n| (*n.state()).clone()).collect()
    };
    assert!(states.windows(2).all(|w| w[0] == w[1]), "members disagree: {states:?}");
    for node in nodes.values() {
        node.shutdown().await.unwrap();
    }
}

/// A member added after the log was purged behind a snapshot catches up from the snapshot
/// (sent over the transport), and a member restarted from a snapshot plus a log has the same
/// state as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_member_catches_up_from_a_snapshot() {
    let router = InProcessRouter::new();
    let dirs: BTreeMap<u64, TempDir> = (1..=2).map(|id| (id, TempDir::new().unwrap())).collect();
    let first = start(&router, &dirs, 1).await;
    first.initialize(BTreeMap::from([(1, address(1))])).await.unwrap();
    wait_for("member 1 to lead", || (first.leader() == Some(1)).then_some(())).await;
    for i in 0..5 {
        first.propose(create(&format!("c{i}"))).await.unwrap();
    }
    let applied = first.metrics().borrow().last_applied.unwrap().index;
    first.snapshot_now().await.unwrap();
    let metrics = first.metrics();
    wait_for("the snapshot", || metrics.borrow().snapshot.is_some_and(|s| s.index >= applied).then_some(())).await;
    first.purge_log(applied).await.unwrap();
    wait_for("the purge", || metrics.borrow().purged.is_some_and(|p| p.index >= applied).then_some(())).await;
    // One more entry after the snapshot, which a restart re-applies from the log.
    first.propose(create("after")).await.unwrap();

    let second = start(&router, &dirs, 2).await;
    first.add_learner(2, address(2)).await.unwrap();
    first.change_membership([1, 2].into()).await.unwrap();
    wait_applied(&second, "every collection", |s| s.collections.len() == 6).await;
    assert_eq!(*second.state(), *first.state());

    let before = (*first.state()).clone();
    router.unplug(&address(1));
    first.shutdown().await.unwrap();
    drop(first);
    let first = start(&router, &dirs, 1).await;
    wait_applied(&first, "its state again", |s| *s == before).await;
    first.shutdown().await.unwrap();
    second.shutdown().await.unwrap();
}

/// The term every member of `nodes` is at, once they agree on it.
fn terms(nodes: &BTreeMap<u64, MetaNode>) -> Vec<u64> {
    nodes.values().map(|n| n.metrics().borrow().current_term).collect()
}

/// A follower that heard nothing for longer than the election timeout (it was cut off, or
/// paused: `SIGSTOP`) comes back as a follower of the same leader, in the same term: it asks
/// the others first (pre-vote), and they still have a leader. Without pre-vote it raised its
/// term; the leader heard the higher term, stepped down, and the group had no leader for
/// seconds (or the returning member took the lead).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_back_from_a_silence_longer_than_the_election_timeout_disrupts_no_leader() {
    let (router, _dirs, nodes) = three_started().await;
    let leader = agreed_leader(&nodes).await;
    nodes[&leader].propose(create("users")).await.unwrap();
    for node in nodes.values() {
        wait_applied(node, "users", |s| s.collections.contains_key("users")).await;
    }
    let before = wait_for("one term everywhere", || {
        let t = terms(&nodes);
        t.windows(2).all(|w| w[0] == w[1]).then_some(t[0])
    })
    .await;
    let follower = *nodes.keys().find(|&&id| id != leader).unwrap();
    // Nothing reaches the follower for twice the longest election timeout (what it sends
    // still arrives: its pre-votes, and a vote request if it campaigned).
    router.isolate(&address(follower), true);
    tokio::time::sleep(Duration::from_millis(2 * (shoal_meta::node::ELECTION_TIMEOUT_MAX_MS * 2))).await;
    assert_eq!(nodes[&leader].leader(), Some(leader), "the leader kept the lead while the follower was away");
    router.isolate(&address(follower), false);
    // It follows the leader again...
    wait_for("the follower back under the same leader", || (nodes[&follower].leader() == Some(leader)).then_some(())).await;
    // ...and a while later nothing moved: same leader, same term, everywhere.
    tokio::time::sleep(Duration::from_millis(2 * shoal_meta::node::ELECTION_TIMEOUT_MAX_MS)).await;
    assert_eq!(agreed_leader(&nodes).await, leader);
    assert_eq!(terms(&nodes), vec![before; 3], "no member raised its term");
    nodes[&leader].propose(create("orders")).await.unwrap();
    for node in nodes.values() {
        node.shutdown().await.unwrap();
    }
}
