//! The moves placement makes when nodes are added, removed or swapped, at 2–16 nodes, 128
//! and 1024 partitions, 0–2 replicas (issue 13, item 2; issue 14, item 2). Each row is
//! printed (`cargo test -p shoal-cluster --test placement_moves -- --nocapture`) and checked:
//! balance within ±1, moves only onto added nodes / off removed ones, and no more copies
//! built than the minimum plus a small slack.

use shoal_cluster::{place, plan_moves, Node, NodeId, PartitionMap, RebalancePlan};

fn nodes(ids: &[u64]) -> Vec<Node> {
    ids.iter().map(|id| Node { id: NodeId(*id), weight: 1 }).collect()
}

/// Every node within one of its share of copies and of actives (equal weights).
fn assert_balanced(map: &PartitionMap, members: &[Node], replicas: u8, what: &str) {
    let partitions = map.partitions.len();
    let copies = (usize::from(replicas) + 1).min(members.len());
    let n = members.len();
    for node in members {
        let (active, replica) = map.load(node.id);
        let total = active + replica;
        let (lo, hi) = ((partitions * copies) / n, (partitions * copies).div_ceil(n));
        assert!((lo..=hi).contains(&total), "{what}: {} holds {total} copies, share {lo}..={hi}", node.id);
        let (lo, hi) = (partitions / n, partitions.div_ceil(n));
        assert!((lo..=hi).contains(&active), "{what}: {} holds {active} actives, share {lo}..={hi}", node.id);
    }
    for copies_of in &map.partitions {
        assert_eq!(copies_of.replicas.len() + 1, copies, "{what}: every partition has its copies");
    }
}

fn copies_on(map: &PartitionMap, node: NodeId) -> usize {
    let (a, r) = map.load(node);
    a + r
}

#[test]
fn add_remove_swap_table() {
    println!(
        "{:>5} {:>5} {:>3} | {:>11} {:>5} {:>5} | {:>11} {:>5} | {:>11} {:>5}",
        "nodes", "parts", "rep", "add builds", "min", "promo", "rm builds", "min", "swap builds", "min"
    );
    for partitions in [1024u16, 128] {
        for n in [2u64, 3, 4, 8, 16] {
            for replicas in 0..=2u8 {
                let ids: Vec<u64> = (1..=n).collect();
                let all = nodes(&ids);
                let before_add = nodes(&ids[..ids.len() - 1]);
                let what = format!("n={n} P={partitions} R={replicas}");

                // Add the n-th node to n-1.
                let base = place(partitions, &before_add, replicas, None).unwrap();
                assert_balanced(&base, &before_add, replicas, &what);
                let added = place(partitions, &all, replicas, Some(&base)).unwrap();
                assert_balanced(&added, &all, replicas, &what);
                let new_node = NodeId(n);
                let add = plan_moves(&base, &added).unwrap();
                assert!(add.moves.iter().all(|m| m.to == new_node), "{what}: add moves only onto the new node: {add:?}");
                // The minimum: the new node must reach the floor of its share.
                let copies_after = usize::from(partitions) * (usize::from(replicas) + 1).min(n as usize);
                let add_min = copies_after / n as usize;
                assert_eq!(copies_on(&added, new_node), add.moves.len());
                assert!(add.moves.len() <= add_min + 1, "{what}: add built {} copies, minimum {add_min}", add.moves.len());
                assert!(add.drops.iter().all(|d| d.node != new_node));

                // Remove node 1 of n.
                let rest = nodes(&ids[1..]);
                let removed = NodeId(1);
                let after_remove = place(partitions, &rest, replicas, Some(&added)).unwrap();
                assert_balanced(&after_remove, &rest, replicas, &what);
                let remove = plan_moves(&added, &after_remove).unwrap();
                assert_no_stayer_moves(&remove, &[removed], &what);
                let remove_min = remove_minimum(&added, &rest, replicas, removed);
                assert_eq!(
                    remove.moves.len(),
                    remove_min,
                    "{what}: remove builds exactly what the leaving node held (or fewer replicas allow)"
                );

                // Swap node 1 for node 100.
                let mut swapped_ids = ids[1..].to_vec();
                swapped_ids.push(100);
                let swapped = nodes(&swapped_ids);
                let after_swap = place(partitions, &swapped, replicas, Some(&added)).unwrap();
                assert_balanced(&after_swap, &swapped, replicas, &what);
                let swap = plan_moves(&added, &after_swap).unwrap();
                assert!(
                    swap.moves.iter().all(|m| m.from == Some(removed) && m.to == NodeId(100)),
                    "{what}: swap moves only from the removed node to the added one: {:?}",
                    swap.moves.iter().filter(|m| m.from != Some(removed) || m.to != NodeId(100)).collect::<Vec<_>>()
                );
                let swap_min = copies_on(&added, removed);
                assert_eq!(swap.moves.len(), swap_min, "{what}");
                assert!(swap.drops.is_empty());

                // Placing again changes nothing.
                assert_eq!(place(partitions, &swapped, replicas, Some(&after_swap)).unwrap(), after_swap);

                println!(
                    "{n:>5} {partitions:>5} {replicas:>3} | {:>11} {add_min:>5} {:>5} | {:>11} {remove_min:>5} | {:>11} {swap_min:>5}",
                    add.moves.len(),
                    add.promotions.len(),
                    remove.moves.len(),
                    swap.moves.len()
                );
            }
        }
    }
}

/// Every build replaces a copy of a leaving node, or adds a copy nobody had.
fn assert_no_stayer_moves(plan: &RebalancePlan, leaving: &[NodeId], what: &str) {
    for m in &plan.moves {
        assert!(m.from.is_none_or(|f| leaving.contains(&f)), "{what}: a move between staying nodes: {m:?}");
        assert!(!leaving.contains(&m.to), "{what}: a move onto a leaving node: {m:?}");
    }
    for d in &plan.drops {
        assert!(leaving.contains(&d.node), "{what}: a staying node dropped a copy: {d:?}");
    }
}

/// The copies that must be built when `removed` leaves: one per partition it held, unless
/// the remaining nodes are too few for the copies it had.
fn remove_minimum(before: &PartitionMap, rest: &[Node], replicas: u8, removed: NodeId) -> usize {
    let copies = (usize::from(replicas) + 1).min(rest.len());
    before.partitions.iter().filter(|c| c.holds(removed)).filter(|c| c.nodes().filter(|n| *n != removed).count() < copies).count()
}
