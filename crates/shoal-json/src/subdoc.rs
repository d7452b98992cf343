//! Sub-document lookups and mutations on a parsed document.
//!
//! A request's document is parsed once (or taken parsed from a cache) and every spec is
//! answered from that one tree: the cost of a path does not depend on where in the
//! document it points. Mutations apply to a copy, all or none.

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::path::{self, Path, Segment};
use crate::DOC_DEPTH_MAX;

/// Most specs in one lookup or mutate request (Couchbase stops at 16).
pub const SUBDOC_SPECS_MAX: usize = 128;

/// Per-spec outcome, as API.md names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    PathNotFound,
    PathMismatch,
    PathInvalid,
    PathExists,
    ValueCantInsert,
    DocNotJson,
    NumOutOfRange,
    DeltaInvalid,
    DocTooDeep,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::PathNotFound => "path_not_found",
            Status::PathMismatch => "path_mismatch",
            Status::PathInvalid => "path_invalid",
            Status::PathExists => "path_exists",
            Status::ValueCantInsert => "value_cant_insert",
            Status::DocNotJson => "doc_not_json",
            Status::NumOutOfRange => "num_out_of_range",
            Status::DeltaInvalid => "delta_invalid",
            Status::DocTooDeep => "doc_too_deep",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LookupOp {
    Get,
    Exists,
    Count,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LookupSpec {
    pub op: LookupOp,
    pub path: String,
}

/// What a lookup spec found, borrowed from the document.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Found<'a> {
    Value(&'a Value),
    Count(usize),
    Exists,
}

/// Answers every spec from one parsed document, without copying what it finds.
pub fn lookup<'a>(doc: &'a Value, specs: &[LookupSpec]) -> Vec<Result<Found<'a>, Status>> {
    specs.iter().map(|spec| lookup_one(doc, spec)).collect()
}

fn lookup_one<'a>(doc: &'a Value, spec: &LookupSpec) -> Result<Found<'a>, Status> {
    let path = path::parse(&spec.path).map_err(|_| Status::PathInvalid)?;
    let found = navigate(doc, path.segments())?;
    match spec.op {
        LookupOp::Get => Ok(Found::Value(found)),
        LookupOp::Exists => Ok(Found::Exists),
        LookupOp::Count => match found {
            Value::Array(a) => Ok(Found::Count(a.len())),
            Value::Object(o) => Ok(Found::Count(o.len())),
            _ => Err(Status::PathMismatch),
        },
    }
}

fn resolve_index(len: usize, index: i64) -> Option<usize> {
    if index < 0 {
        len.checked_sub(index.unsigned_abs() as usize)
    } else {
        let i = index as usize;
        (i < len).then_some(i)
    }
}

/// Follows `segs` from `doc`.
pub fn navigate<'a>(doc: &'a Value, segs: &[Segment]) -> Result<&'a Value, Status> {
    let mut at = doc;
    for seg in segs {
        at = match (seg, at) {
            (Segment::Key(k), Value::Object(o)) => o.get(k).ok_or(Status::PathNotFound)?,
            (Segment::Index(i), Value::Array(a)) => resolve_index(a.len(), *i).and_then(|i| a.get(i)).ok_or(Status::PathNotFound)?,
            _ => return Err(Status::PathMismatch),
        };
    }
    Ok(at)
}

fn navigate_mut<'a>(doc: &'a mut Value, segs: &[Segment], create: bool) -> Result<&'a mut Value, Status> {
    let mut at = doc;
    for seg in segs {
        at = match (seg, at) {
            (Segment::Key(k), Value::Object(o)) => {
                if create && !o.contains_key(k) {
                    o.insert(k.clone(), Value::Object(Map::new()));
                }
                o.get_mut(k).ok_or(Status::PathNotFound)?
            }
            (Segment::Index(i), Value::Array(a)) => {
                let len = a.len();
                resolve_index(len, *i).and_then(move |i| a.get_mut(i)).ok_or(Status::PathNotFound)?
            }
            _ => return Err(Status::PathMismatch),
        };
    }
    Ok(at)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MutateOp {
    Insert,
    Upsert,
    Replace,
    Remove,
    ArrayAppend,
    ArrayPrepend,
    ArrayInsert,
    ArrayAddUnique,
    Increment,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MutateSpec {
    pub op: MutateOp,
    pub path: String,
    #[serde(default)]
    pub value: Option<Value>,
    #[serde(default)]
    pub values: Option<Vec<Value>>,
    #[serde(default)]
    pub delta: Option<Value>,
    #[serde(default)]
    pub create_path: bool,
}

/// Applies every spec to `doc` in order, atomically: on the first failure `doc` is left
/// as it was and the failing spec's index and status are returned. On success, the
/// per-spec results (`Some(value)` for `increment`).
pub fn mutate(doc: &mut Value, specs: &[MutateSpec]) -> Result<Vec<Option<Value>>, (usize, Status)> {
    let mut work = doc.clone();
    let mut results = Vec::with_capacity(specs.len());
    for (i, spec) in specs.iter().enumerate() {
        results.push(mutate_one(&mut work, spec).map_err(|s| (i, s))?);
    }
    if depth(&work) > DOC_DEPTH_MAX {
        return Err((specs.len().saturating_sub(1), Status::DocTooDeep));
    }
    *doc = work;
    Ok(results)
}

fn depth(v: &Value) -> usize {
    match v {
        Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
        Value::Object(o) => 1 + o.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

fn is_primitive(v: &Value) -> bool {
    !matches!(v, Value::Array(_) | Value::Object(_))
}

fn mutate_one(doc: &mut Value, spec: &MutateSpec) -> Result<Option<Value>, Status> {
    let path = path::parse(&spec.path).map_err(|_| Status::PathInvalid)?;
    let value = || spec.value.clone().ok_or(Status::ValueCantInsert);
    let values = || spec.values.clone().or_else(|| spec.value.clone().map(|v| vec![v])).ok_or(Status::ValueCantInsert);
    match spec.op {
        MutateOp::Insert | MutateOp::Upsert => {
            let Some((parent, Segment::Key(key))) = path.split_last() else { return Err(Status::PathInvalid) };
            let v = value()?;
            let Value::Object(obj) = navigate_mut(doc, parent, spec.create_path)? else { return Err(Status::PathMismatch) };
            if spec.op == MutateOp::Insert && obj.contains_key(key) {
                return Err(Status::PathExists);
            }
            obj.insert(key.clone(), v);
            Ok(None)
        }
        MutateOp::Replace => {
            let v = value()?;
            if path.is_root() {
                *doc = v;
                return Ok(None);
            }
            *navigate_mut(doc, path.segments(), false)? = v;
            Ok(None)
        }
        MutateOp::Remove => {
            let Some((parent, last)) = path.split_last() else { return Err(Status::PathInvalid) };
            match (navigate_mut(doc, parent, false)?, last) {
                (Value::Object(o), Segment::Key(k)) => o.shift_remove(k).map(|_| None).ok_or(Status::PathNotFound),
                (Value::Array(a), Segment::Index(i)) => {
                    let i = resolve_index(a.len(), *i).ok_or(Status::PathNotFound)?;
                    a.remove(i);
                    Ok(None)
                }
                _ => Err(Status::PathMismatch),
            }
        }
        MutateOp::ArrayAppend | MutateOp::ArrayPrepend => {
            let vs = values()?;
            let target = array_target(doc, &path, spec.create_path)?;
            if spec.op == MutateOp::ArrayAppend {
                target.extend(vs);
            } else {
                target.splice(0..0, vs);
            }
            Ok(None)
        }
        MutateOp::ArrayInsert => {
            let vs = values()?;
            let Some((parent, Segment::Index(i))) = path.split_last() else { return Err(Status::PathInvalid) };
            let Value::Array(a) = navigate_mut(doc, parent, false)? else { return Err(Status::PathMismatch) };
            let at = if *i < 0 { return Err(Status::PathInvalid) } else { *i as usize };
            if at > a.len() {
                return Err(Status::PathNotFound);
            }
            a.splice(at..at, vs);
            Ok(None)
        }
        MutateOp::ArrayAddUnique => {
            let v = value()?;
            if !is_primitive(&v) {
                return Err(Status::ValueCantInsert);
            }
            let target = array_target(doc, &path, spec.create_path)?;
            if !target.iter().all(is_primitive) {
                return Err(Status::PathMismatch);
            }
            if target.contains(&v) {
                return Err(Status::PathExists);
            }
            target.push(v);
            Ok(None)
        }
        MutateOp::Increment => {
            let delta = match &spec.delta {
                Some(Value::Number(n)) => n.as_i64().filter(|d| *d != 0).ok_or(Status::DeltaInvalid)?,
                _ => return Err(Status::DeltaInvalid),
            };
            let Some((parent, last)) = path.split_last() else { return Err(Status::PathInvalid) };
            let container = navigate_mut(doc, parent, spec.create_path)?;
            let slot = match (container, last) {
                (Value::Object(o), Segment::Key(k)) => o.entry(k.clone()).or_insert(Value::from(0)),
                (Value::Array(a), Segment::Index(i)) => {
                    let i = resolve_index(a.len(), *i).ok_or(Status::PathNotFound)?;
                    &mut a[i]
                }
                _ => return Err(Status::PathMismatch),
            };
            let current = match slot {
                Value::Number(n) => n.as_i64().ok_or(Status::NumOutOfRange)?,
                _ => return Err(Status::PathMismatch),
            };
            let next = current.checked_add(delta).ok_or(Status::NumOutOfRange)?;
            *slot = Value::from(next);
            Ok(Some(Value::from(next)))
        }
    }
}

/// The array at `path`, created empty (with its parents, if asked) when missing.
fn array_target<'a>(doc: &'a mut Value, path: &Path, create: bool) -> Result<&'a mut Vec<Value>, Status> {
    let exists = navigate(doc, path.segments()).is_ok();
    if !exists {
        let Some((parent, Segment::Key(key))) = path.split_last() else { return Err(Status::PathNotFound) };
        let Value::Object(obj) = navigate_mut(doc, parent, create)? else { return Err(Status::PathMismatch) };
        if !create {
            return Err(Status::PathNotFound);
        }
        obj.insert(key.clone(), Value::Array(Vec::new()));
    }
    match navigate_mut(doc, path.segments(), false)? {
        Value::Array(a) => Ok(a),
        _ => Err(Status::PathMismatch),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(op: MutateOp, path: &str, value: Option<Value>) -> MutateSpec {
        MutateSpec { op, path: path.into(), value, values: None, delta: None, create_path: false }
    }

    #[test]
    fn lookups_answer_each_spec() {
        let doc = json!({"a": {"b": [1, 2, {"c": "x"}]}, "tags": ["t"], "n": 5});
        let specs: Vec<LookupSpec> = serde_json::from_value(json!([
            {"op": "get", "path": "a.b[-1].c"}, {"op": "exists", "path": "a.z"}, {"op": "count", "path": "a.b"},
            {"op": "get", "path": ""}, {"op": "count", "path": "n"}, {"op": "get", "path": "a..b"}, {"op": "get", "path": "n.x"},
        ]))
        .unwrap();
        let r = lookup(&doc, &specs);
        assert_eq!(r[0], Ok(Found::Value(&json!("x"))));
        assert_eq!(r[1], Err(Status::PathNotFound));
        assert_eq!(r[2], Ok(Found::Count(3)));
        assert_eq!(r[3], Ok(Found::Value(&doc)));
        assert_eq!(r[4], Err(Status::PathMismatch));
        assert_eq!(r[5], Err(Status::PathInvalid));
        assert_eq!(r[6], Err(Status::PathMismatch));
    }

    #[test]
    fn mutations_are_all_or_nothing() {
        let mut doc = json!({"a": 1, "arr": [1, 2]});
        let before = doc.clone();
        let specs = vec![spec(MutateOp::Upsert, "b", Some(json!(2))), spec(MutateOp::Insert, "a", Some(json!(3)))];
        assert_eq!(mutate(&mut doc, &specs), Err((1, Status::PathExists)));
        assert_eq!(doc, before);
        let mut inc = spec(MutateOp::Increment, "n", None);
        inc.delta = Some(json!(-5));
        let specs = vec![
            spec(MutateOp::Upsert, "b", Some(json!(2))),
            MutateSpec { create_path: true, ..spec(MutateOp::Upsert, "x.y.z", Some(json!(true))) },
            MutateSpec { values: Some(vec![json!(3), json!(4)]), ..spec(MutateOp::ArrayAppend, "arr", None) },
            MutateSpec { values: Some(vec![json!(0)]), ..spec(MutateOp::ArrayPrepend, "arr", None) },
            MutateSpec { values: Some(vec![json!(9)]), ..spec(MutateOp::ArrayInsert, "arr[2]", None) },
            spec(MutateOp::ArrayAddUnique, "arr", Some(json!("u"))),
            spec(MutateOp::Remove, "a", None),
            inc,
        ];
        let r = mutate(&mut doc, &specs).unwrap();
        assert_eq!(r[7], Some(json!(-5)));
        assert_eq!(doc, json!({"arr": [0, 1, 9, 2, 3, 4, "u"], "b": 2, "x": {"y": {"z": true}}, "n": -5}));
        let keys: Vec<_> = doc.as_object().unwrap().keys().cloned().collect();
        assert_eq!(keys, ["arr", "b", "x", "n"], "member order is kept");
    }

    #[test]
    fn increment_limits() {
        let mut doc = json!({"n": i64::MAX, "f": 1.5});
        let inc = |path: &str, delta: Value| MutateSpec { delta: Some(delta), ..spec(MutateOp::Increment, path, None) };
        assert_eq!(mutate(&mut doc, &[inc("n", json!(1))]), Err((0, Status::NumOutOfRange)));
        assert_eq!(mutate(&mut doc, &[inc("n", json!(0))]), Err((0, Status::DeltaInvalid)));
        assert_eq!(mutate(&mut doc, &[inc("n", json!(1.5))]), Err((0, Status::DeltaInvalid)));
        assert_eq!(mutate(&mut doc, &[inc("f", json!(1))]), Err((0, Status::NumOutOfRange)));
        assert_eq!(mutate(&mut doc, &[inc("n", json!(-1))]), Ok(vec![Some(json!(i64::MAX - 1))]));
    }
}
