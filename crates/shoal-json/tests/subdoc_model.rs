//! Sub-document mutations against a simple reference model: the same edits done by hand
//! on a `serde_json::Value` through JSON pointers.

use proptest::prelude::*;
use serde_json::{json, Value};
use shoal_json::path::{self, Path, Segment};
use shoal_json::subdoc::{mutate, MutateOp, MutateSpec, Status};

#[derive(Clone, Debug)]
enum Edit {
    Upsert(String, String, i64),
    Insert(String, String, i64),
    Replace(String, String, i64),
    Remove(String, String),
    Increment(String, String, i64),
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![Just("a".to_string()), Just("b".to_string()), Just("c.d".to_string()), Just("e`f".to_string())]
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (name(), name(), -5i64..5).prop_map(|(a, b, v)| Edit::Upsert(a, b, v)),
        (name(), name(), -5i64..5).prop_map(|(a, b, v)| Edit::Insert(a, b, v)),
        (name(), name(), -5i64..5).prop_map(|(a, b, v)| Edit::Replace(a, b, v)),
        (name(), name()).prop_map(|(a, b)| Edit::Remove(a, b)),
        (name(), name(), prop_oneof![Just(i64::MAX), -3i64..3]).prop_map(|(a, b, d)| Edit::Increment(a, b, d)),
    ]
}

fn path_text(a: &str, b: &str) -> String {
    Path(vec![Segment::Key(a.into()), Segment::Key(b.into())]).to_string()
}

/// The model: plain map operations on the two-level object.
fn model(doc: &mut Value, e: &Edit) -> Result<Option<Value>, Status> {
    let (a, b) = match e {
        Edit::Upsert(a, b, _) | Edit::Insert(a, b, _) | Edit::Replace(a, b, _) | Edit::Remove(a, b) | Edit::Increment(a, b, _) => (a, b),
    };
    if matches!(e, Edit::Increment(_, _, 0)) {
        return Err(Status::DeltaInvalid);
    }
    let create = matches!(e, Edit::Upsert(..) | Edit::Insert(..) | Edit::Increment(..));
    let root = doc.as_object_mut().unwrap();
    if !root.contains_key(a) {
        if !create {
            return Err(Status::PathNotFound);
        }
        root.insert(a.clone(), json!({}));
    }
    let inner = root.get_mut(a).unwrap().as_object_mut().unwrap();
    match e {
        Edit::Upsert(_, _, v) => {
            inner.insert(b.clone(), json!(v));
            Ok(None)
        }
        Edit::Insert(_, _, v) => {
            if inner.contains_key(b) {
                return Err(Status::PathExists);
            }
            inner.insert(b.clone(), json!(v));
            Ok(None)
        }
        Edit::Replace(_, _, v) => match inner.get_mut(b) {
            Some(slot) => {
                *slot = json!(v);
                Ok(None)
            }
            None => Err(Status::PathNotFound),
        },
        Edit::Remove(..) => inner.shift_remove(b).map(|_| None).ok_or(Status::PathNotFound),
        Edit::Increment(_, _, d) => {
            if *d == 0 {
                return Err(Status::DeltaInvalid);
            }
            let cur = inner.get(b).and_then(Value::as_i64).unwrap_or(0);
            let next = cur.checked_add(*d).ok_or(Status::NumOutOfRange)?;
            inner.insert(b.clone(), json!(next));
            Ok(Some(json!(next)))
        }
    }
}

fn spec(e: &Edit) -> MutateSpec {
    let (op, a, b, value, delta) = match e {
        Edit::Upsert(a, b, v) => (MutateOp::Upsert, a, b, Some(json!(v)), None),
        Edit::Insert(a, b, v) => (MutateOp::Insert, a, b, Some(json!(v)), None),
        Edit::Replace(a, b, v) => (MutateOp::Replace, a, b, Some(json!(v)), None),
        Edit::Remove(a, b) => (MutateOp::Remove, a, b, None, None),
        Edit::Increment(a, b, d) => (MutateOp::Increment, a, b, None, Some(json!(d))),
    };
    let create_path = matches!(op, MutateOp::Upsert | MutateOp::Insert | MutateOp::Increment);
    MutateSpec { op, path: path_text(a, b), value, values: None, delta, create_path }
}

proptest! {
    #[test]
    fn single_specs_match_the_model(edits in proptest::collection::vec(edit(), 1..40)) {
        let mut ours = json!({});
        let mut reference = json!({});
        for e in &edits {
            let want = model(&mut reference, e);
            let got = mutate(&mut ours, &[spec(e)]).map(|mut r| r.remove(0)).map_err(|(_, s)| s);
            prop_assert_eq!(&got, &want, "edit {:?}", e);
            prop_assert_eq!(&ours, &reference);
        }
    }

    #[test]
    fn a_batch_applies_entirely_or_not_at_all(edits in proptest::collection::vec(edit(), 1..12)) {
        let start = json!({"a": {"b": 1}});
        let mut reference = start.clone();
        let mut failed = None;
        for (i, e) in edits.iter().enumerate() {
            if let Err(s) = model(&mut reference, e) {
                failed = Some((i, s));
                break;
            }
        }
        let mut ours = start.clone();
        let specs: Vec<_> = edits.iter().map(spec).collect();
        match (mutate(&mut ours, &specs), failed) {
            (Ok(_), None) => prop_assert_eq!(ours, reference),
            (Err(e), Some(f)) => {
                prop_assert_eq!(e, f);
                prop_assert_eq!(ours, start);
            }
            (got, want) => prop_assert!(false, "got {:?}, want failure {:?}", got, want),
        }
    }

    #[test]
    fn paths_print_and_parse_back(segs in proptest::collection::vec(prop_oneof![
        "[a-z`. \\[\\]]{1,6}".prop_map(Segment::Key),
        (0i64..100).prop_map(Segment::Index),
        Just(Segment::Index(-1)),
    ], 0..8)) {
        // A path may not start with a key after an index-only start; any sequence prints.
        let p = Path(segs);
        prop_assert_eq!(path::parse(&p.to_string()), Ok(p));
    }
}
