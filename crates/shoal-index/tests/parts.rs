//! An index split into partitions answers as one sorted index would: every scan (an `eq`
//! that reads one part, or any other bound that reads all of them and merges), in both
//! directions and with limits, and the paged cursor SQL reads, against a model of the
//! documents — whether the index was built by reading the documents or followed their
//! changes, with updates moving entries between parts and deletes removing them.

mod common;

use std::cmp::Ordering;
use std::sync::Arc;

use common::*;
use proptest::prelude::*;
use serde_json::{json, Value};
use shoal_index::{keycode, Consistency, IndexDef, ScanBounds, ScanRequest};
use shoal_storage::WriteOp;

#[derive(Clone, Debug)]
enum Op {
    Put { key: u8, a: Option<Value>, b: i64 },
    Delete { key: u8 },
}

#[derive(Clone, Debug)]
struct Query {
    bounds: ScanBounds,
    descending: bool,
    limit: usize,
    page: usize,
}

fn leading() -> impl Strategy<Value = Value> {
    prop_oneof![(0i64..12).prop_map(|n| json!(n)), "[a-d]{1,2}".prop_map(Value::String), Just(Value::Null), Just(json!(2.0))]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..40, prop::option::weighted(0.9, leading()), -3i64..3).prop_map(|(key, a, b)| Op::Put { key, a, b }),
        1 => (0u8..40).prop_map(|key| Op::Delete { key }),
    ]
}

fn bounds() -> impl Strategy<Value = ScanBounds> {
    let bound = prop::option::of(prop_oneof![leading().prop_map(|a| vec![a]), (leading(), -3i64..3).prop_map(|(a, b)| vec![a, json!(b)])]);
    prop_oneof![
        Just(ScanBounds::All),
        leading().prop_map(|a| ScanBounds::Eq(vec![a])),
        (leading(), -3i64..3).prop_map(|(a, b)| ScanBounds::Eq(vec![a, json!(b)])),
        (bound.clone(), bound, any::<bool>(), any::<bool>()).prop_map(|(low, high, inclusive_low, inclusive_high)| ScanBounds::Range {
            low,
            high,
            inclusive_low,
            inclusive_high
        }),
    ]
}

fn query() -> impl Strategy<Value = Query> {
    (bounds(), any::<bool>(), prop_oneof![Just(100_000usize), 1usize..20], 1usize..50).prop_map(|(bounds, descending, limit, page)| Query {
        bounds,
        descending,
        limit,
        page,
    })
}

/// `key` against a bound of `bound.len()` components.
fn cmp_prefix(key: &[Value], bound: &[Value]) -> Ordering {
    key.iter().zip(bound).map(|(k, b)| keycode::compare(k, b)).find(|o| o.is_ne()).unwrap_or(Ordering::Equal)
}

fn in_bounds(key: &[Value], bounds: &ScanBounds) -> bool {
    match bounds {
        ScanBounds::All => true,
        ScanBounds::Eq(values) => cmp_prefix(key, values).is_eq(),
        ScanBounds::Range { low, high, inclusive_low, inclusive_high } => {
            let above = low.as_ref().is_none_or(|l| match cmp_prefix(key, l) {
                Ordering::Greater => true,
                Ordering::Equal => *inclusive_low,
                Ordering::Less => false,
            });
            let below = high.as_ref().is_none_or(|h| match cmp_prefix(key, h) {
                Ordering::Less => true,
                Ordering::Equal => *inclusive_high,
                Ordering::Greater => false,
            });
            above && below
        }
    }
}

/// Every row the index must hold, in index order: (entry bytes, key, document id).
fn model_rows(def: &IndexDef, docs: &std::collections::BTreeMap<String, Value>) -> Vec<(Vec<u8>, Vec<Value>, String)> {
    let compiled = def.compile().unwrap();
    let mut rows = Vec::new();
    for (id, doc) in docs {
        for entry in compiled.entries(doc) {
            let (key, _) = keycode::decode_components(&entry, 2).unwrap();
            let mut bytes = entry.clone();
            bytes.extend_from_slice(id.as_bytes());
            rows.push((bytes, key, id.clone()));
        }
    }
    rows.sort_by(|a, b| a.0.cmp(&b.0));
    rows
}

fn doc(a: &Option<Value>, b: i64) -> Value {
    match a {
        Some(a) => json!({"a": a, "b": b}),
        None => json!({"b": b}),
    }
}

fn run(parts: u16, index_first: bool, ops: Vec<Op>, queries: Vec<Query>) {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path());
    let coll = store.create_collection("c", 0).unwrap();
    let def = IndexDef {
        name: "by_ab".into(),
        keys: vec!["a".into(), "b".into()],
        filter: None,
        defer_build: false,
        partitions: Some(parts),
        replicas: 0,
    };
    life(&store, |mgr| {
        let coll = Arc::clone(&coll);
        async move {
            let mut docs = std::collections::BTreeMap::new();
            let apply = |ops: &[Op], docs: &mut std::collections::BTreeMap<String, Value>| {
                for op in ops {
                    match op {
                        Op::Put { key, a, b } => {
                            let id = format!("k{key:02}");
                            put(&coll, &id, doc(a, *b));
                            docs.insert(id, doc(a, *b));
                        }
                        Op::Delete { key } => {
                            let id = format!("k{key:02}");
                            if docs.remove(&id).is_some() {
                                let req = shoal_storage::WriteRequest {
                                    key: bytes::Bytes::from(id.into_bytes()),
                                    op: WriteOp::Remove,
                                    value: None,
                                    cas: None,
                                    expiry: 0,
                                };
                                let _ = coll.write(req).unwrap();
                            }
                        }
                    }
                }
            };
            let half = ops.len() / 2;
            // The index follows the changes, or is built by reading the documents first and
            // then follows the rest.
            if index_first {
                mgr.create(&coll, def.clone()).await.unwrap();
                apply(&ops[..half], &mut docs);
            } else {
                apply(&ops[..half], &mut docs);
                mgr.create(&coll, def.clone()).await.unwrap();
            }
            apply(&ops[half..], &mut docs);
            let rows = model_rows(&def, &docs);
            for q in &queries {
                let mut want: Vec<(Vec<Value>, String)> =
                    rows.iter().filter(|r| in_bounds(&r.1, &q.bounds)).map(|r| (r.1.clone(), r.2.clone())).collect();
                let all = want.clone();
                if q.descending {
                    want.reverse();
                }
                want.truncate(q.limit);
                let req = ScanRequest {
                    bounds: q.bounds.clone(),
                    limit: q.limit,
                    descending: q.descending,
                    consistency: Consistency::RequestPlus,
                    timeout: WAIT,
                    keep: None,
                    parts: None,
                };
                let got: Vec<(Vec<Value>, String)> =
                    mgr.scan(&coll, "by_ab", req).await.unwrap().into_iter().map(|r| (r.key, r.id)).collect();
                assert_eq!(got, want, "scan {q:?} over {parts} parts");
                let mut cursor = mgr.cursor(&coll, "by_ab", &q.bounds, Consistency::NotBounded, WAIT).await.unwrap();
                let mut paged = Vec::new();
                loop {
                    let page = cursor.next_page(q.page).unwrap();
                    assert!(page.len() <= q.page);
                    if page.is_empty() {
                        break;
                    }
                    paged.extend(page.into_iter().map(|r| (r.key, r.id)));
                }
                assert_eq!(paged, all, "cursor {q:?} in pages of {} over {parts} parts", q.page);
            }
            let status = mgr.list(&coll).remove(0);
            assert_eq!(status.items, rows.len() as u64, "entries counted over the parts");
        }
    });
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn scans_of_a_partitioned_index_answer_as_one_sorted_index(
        parts in prop_oneof![Just(1u16), Just(3), Just(8), Just(16)],
        index_first in any::<bool>(),
        ops in prop::collection::vec(op(), 0..120),
        queries in prop::collection::vec(query(), 1..8),
    ) {
        run(parts, index_first, ops, queries);
    }
}

#[test]
fn each_part_holds_the_entries_of_its_leading_values() {
    let (_dir, store, coll) = filled_store();
    let def = IndexDef { partitions: Some(5), ..common::def("by_a", "a", false) };
    life(&store, |mgr| {
        let coll = Arc::clone(&coll);
        async move {
            mgr.create(&coll, def).await.unwrap();
            assert_eq!(scan_ids(&mgr, &coll, "by_a", json!(3)).await, expected_a3());
            let mut want = vec![0u64; 5];
            for i in 0..DOCS {
                want[usize::from(shoal_index::partition::part_of_value(Some(&json!(i % 5)), 5))] += 1;
            }
            let got: Vec<u64> = mgr.list(&coll)[0].part_items.iter().map(|(_, n)| *n).collect();
            assert_eq!(got, want);
            assert!(got.iter().filter(|&&n| n > 0).count() > 1, "the values spread over parts: {got:?}");
        }
    });
}

/// A part none of whose entries a batch changes keeps the cursor it stored (up to
/// `CURSOR_STORE_LAG` changes behind what it applied). Ended without `close`, the next life
/// goes on from those cursors and re-applies what followed: it ends with the same entries
/// and the same counts per part, moved entries included.
#[test]
fn parts_going_on_from_cursors_they_stored_behind_end_with_the_same_entries() {
    let (_dir, store, coll) = filled_store();
    let def = IndexDef { partitions: Some(5), ..common::def("by_a", "a", false) };
    // A value whose entries go to another part than 3's: moving d003 there changes two parts.
    let part = |v: i64| shoal_index::partition::part_of_value(Some(&json!(v)), 5);
    let moved = (5..100).find(|&v| part(v) != part(3)).unwrap();
    let before = life_without_close(&store, |mgr| {
        let coll = Arc::clone(&coll);
        async move {
            mgr.create(&coll, def).await.unwrap();
            assert_eq!(scan_ids(&mgr, &coll, "by_a", json!(3)).await, expected_a3());
            // Writes that change no entry of any part, then one that moves an entry
            // between parts, then more that change none.
            for i in 0..200 {
                put(&coll, &format!("z{i:03}"), json!({"b": i}));
            }
            put(&coll, "d003", json!({"a": moved}));
            for i in 0..DOCS {
                put(&coll, &format!("d{i:03}"), json!({"a": if i == 3 { moved } else { (i % 5) as i64 }, "b": format!("again{i}")}));
            }
            assert_eq!(scan_ids(&mgr, &coll, "by_a", json!(moved)).await, ["d003"]);
            mgr.list(&coll)[0].part_items.clone()
        }
    });
    let mut want_a3 = expected_a3();
    want_a3.retain(|id| id != "d003");
    life(&store, |mgr| {
        let coll = Arc::clone(&coll);
        async move {
            assert_eq!(scan_ids(&mgr, &coll, "by_a", json!(moved)).await, ["d003"]);
            assert_eq!(scan_ids(&mgr, &coll, "by_a", json!(3)).await, want_a3);
            assert_eq!(mgr.list(&coll)[0].part_items, before, "the counts per part are those of the first life");
            let total: u64 = before.iter().map(|(_, n)| n).sum();
            assert_eq!(total, DOCS as u64);
        }
    });
}

#[test]
fn a_node_holding_some_parts_answers_for_them_and_refuses_a_scan_that_needs_the_others() {
    let (_dir, store, coll) = filled_store();
    let def = IndexDef { partitions: Some(5), ..common::def("by_a", "a", false) };
    let part_of = |a: usize| shoal_index::partition::part_of_value(Some(&json!(a)), 5);
    let held: Vec<u16> = vec![part_of(3), (part_of(3) + 2) % 5];
    let scan = |bounds: ScanBounds, parts: Option<Vec<u16>>| ScanRequest {
        bounds,
        limit: 1000,
        descending: false,
        consistency: shoal_index::Consistency::RequestPlus,
        timeout: common::WAIT,
        keep: None,
        parts,
    };
    let want_held: Vec<String> = (0..DOCS).filter(|i| held.contains(&part_of(i % 5))).map(|i| format!("d{i:03}")).collect();
    for life_no in 0..2 {
        let (coll, def, held, want_held) = (Arc::clone(&coll), def.clone(), held.clone(), want_held.clone());
        life(&store, move |mgr| async move {
            if life_no == 0 {
                mgr.create_as(&coll, def, None, Some(held.clone())).await.unwrap();
                let nothing = IndexDef { partitions: Some(5), ..common::def("elsewhere", "b", false) };
                mgr.create_as(&coll, nothing, None, Some(Vec::new())).await.unwrap();
            }
            // An eq reads one part: answered when held here, refused when not.
            assert_eq!(scan_ids(&mgr, &coll, "by_a", json!(3)).await, expected_a3());
            let other = (0..5).find(|a| !held.contains(&part_of(*a))).expect("a value in a part held elsewhere");
            let refused = mgr.scan(&coll, "by_a", scan(ScanBounds::Eq(vec![json!(other)]), None)).await;
            assert!(matches!(refused, Err(shoal_index::IndexError::Unavailable(_))), "{refused:?}");
            // A whole scan needs every part: refused, unless it asks for the held ones only.
            let refused = mgr.scan(&coll, "by_a", scan(ScanBounds::All, None)).await;
            assert!(matches!(refused, Err(shoal_index::IndexError::Unavailable(_))), "{refused:?}");
            let rows = mgr.scan(&coll, "by_a", scan(ScanBounds::All, Some(held.clone()))).await.unwrap();
            let mut ids: Vec<String> = rows.iter().map(|r| r.id.clone()).collect();
            let order = |r: &shoal_index::ScanRow| (r.key[0].as_u64(), r.id.clone());
            assert!(rows.windows(2).all(|w| order(&w[0]) <= order(&w[1])), "in index order");
            ids.sort();
            assert_eq!(ids, want_held);
            let status = mgr.list(&coll);
            let by_a = status.iter().find(|s| s.def.name == "by_a").unwrap();
            let mut sorted = held.clone();
            sorted.sort();
            assert_eq!(by_a.part_items.iter().map(|(no, _)| *no).collect::<Vec<_>>(), sorted, "only the held parts, after a restart too");
            assert_eq!(by_a.items, want_held.len() as u64);
            // An index holding no part here is ready with nothing, and holds back nothing.
            let elsewhere = status.iter().find(|s| s.def.name == "elsewhere").unwrap();
            assert_eq!((elsewhere.state, elsewhere.items), (shoal_index::IndexState::Ready, 0));
            let lowest = mgr.lowest_positions(&coll).unwrap();
            assert!(lowest.iter().all(|&s| s > 0), "the empty index does not hold positions back: {lowest:?}");
        });
    }
}
