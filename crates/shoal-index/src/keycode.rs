//! Index keys as bytes whose order is the order of their JSON values, so that one sorted
//! keyspace answers every scan with one range read.
//!
//! Order across types: MISSING < null < false < true < numbers < strings < arrays <
//! objects. Numbers compare as IEEE doubles (integers beyond 2^53 lose precision in the
//! order, not in the stored document); strings by Unicode code point (UTF-8 bytes);
//! arrays element by element, a shorter prefix first; objects by their members sorted by
//! name, compared as (name, value) pairs.
//!
//! Every encoded value is self-delimiting, so a composite key is the concatenation of its
//! components, and an entry is the composite key followed by the document key.

use serde_json::{Map, Number, Value};

const MISSING: u8 = 0x01;
const NULL: u8 = 0x02;
const FALSE: u8 = 0x03;
const TRUE: u8 = 0x04;
const NUMBER: u8 = 0x05;
const STRING: u8 = 0x06;
const ARRAY: u8 = 0x07;
const OBJECT: u8 = 0x08;
/// Ends strings (after `0x00` is escaped as `0x00 0xFF`), arrays and objects.
const END: u8 = 0x00;
/// Greater than every byte that can follow a complete key prefix: valid UTF-8 (document
/// keys) never contains 0xFF, and no type tag is 0xFF.
pub const AFTER_PREFIX: u8 = 0xFF;

/// Nesting deeper than this inside one key component is refused when decoding (encoding
/// follows the document, whose depth is already bounded by `shoal_json::DOC_DEPTH_MAX`).
const DECODE_DEPTH_MAX: usize = 256;

/// The byte order of a scan row, as the index keeps it: its key's components encoded in
/// turn (a missing component of an answer reads as null), then the document key. Answers
/// merged from several index partitions or members are sorted by it.
pub fn row_order(key: &[Value], id: &str) -> Vec<u8> {
    let mut sort = Vec::new();
    for v in key {
        encode(Some(v), &mut sort);
    }
    sort.extend_from_slice(id.as_bytes());
    sort
}

/// Appends the encoding of `v` (`None` = MISSING) to `out`.
pub fn encode(v: Option<&Value>, out: &mut Vec<u8>) {
    match v {
        None => out.push(MISSING),
        Some(v) => encode_value(v, out),
    }
}

fn encode_value(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Null => out.push(NULL),
        Value::Bool(false) => out.push(FALSE),
        Value::Bool(true) => out.push(TRUE),
        Value::Number(n) => {
            out.push(NUMBER);
            out.extend_from_slice(&f64_sortable(n.as_f64().unwrap_or(0.0)));
        }
        Value::String(s) => {
            out.push(STRING);
            encode_str(s, out);
        }
        Value::Array(items) => {
            out.push(ARRAY);
            for item in items {
                encode_value(item, out);
            }
            out.push(END);
        }
        Value::Object(map) => {
            out.push(OBJECT);
            let mut members: Vec<(&String, &Value)> = map.iter().collect();
            members.sort_by(|a, b| a.0.cmp(b.0));
            for (k, v) in members {
                // Tagged, so that a member named "" is not taken for the object's end.
                out.push(STRING);
                encode_str(k, out);
                encode_value(v, out);
            }
            out.push(END);
        }
    }
}

fn encode_str(s: &str, out: &mut Vec<u8>) {
    for &b in s.as_bytes() {
        out.push(b);
        if b == END {
            out.push(AFTER_PREFIX);
        }
    }
    out.extend_from_slice(&[END, END]);
}

/// Big-endian bits of `f` whose unsigned order is the numeric order (−0 is 0).
fn f64_sortable(f: f64) -> [u8; 8] {
    let f = if f == 0.0 { 0.0 } else { f };
    let bits = f.to_bits();
    let bits = if bits >> 63 == 1 { !bits } else { bits | (1 << 63) };
    bits.to_be_bytes()
}

fn f64_from_sortable(b: [u8; 8]) -> f64 {
    let bits = u64::from_be_bytes(b);
    let bits = if bits >> 63 == 1 { bits & !(1 << 63) } else { !bits };
    f64::from_bits(bits)
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("corrupt index key")]
pub struct CorruptKey;

/// Decodes one component from the front of `bytes`: its value (`None` = MISSING) and the
/// rest of the bytes.
pub fn decode(bytes: &[u8]) -> Result<(Option<Value>, &[u8]), CorruptKey> {
    let (&tag, rest) = bytes.split_first().ok_or(CorruptKey)?;
    if tag == MISSING {
        return Ok((None, rest));
    }
    let (v, rest) = decode_value(bytes, 0)?;
    Ok((Some(v), rest))
}

fn decode_value(bytes: &[u8], depth: usize) -> Result<(Value, &[u8]), CorruptKey> {
    if depth > DECODE_DEPTH_MAX {
        return Err(CorruptKey);
    }
    let (&tag, rest) = bytes.split_first().ok_or(CorruptKey)?;
    Ok(match tag {
        NULL => (Value::Null, rest),
        FALSE => (Value::Bool(false), rest),
        TRUE => (Value::Bool(true), rest),
        NUMBER => {
            let raw: [u8; 8] = rest.get(..8).and_then(|b| b.try_into().ok()).ok_or(CorruptKey)?;
            (number(f64_from_sortable(raw)), &rest[8..])
        }
        STRING => {
            let (s, rest) = decode_str(rest)?;
            (Value::String(s), rest)
        }
        ARRAY => {
            let mut items = Vec::new();
            let mut rest = rest;
            loop {
                match rest.first() {
                    Some(&END) => break (Value::Array(items), &rest[1..]),
                    Some(_) => {
                        let (v, r) = decode_value(rest, depth + 1)?;
                        items.push(v);
                        rest = r;
                    }
                    None => return Err(CorruptKey),
                }
            }
        }
        OBJECT => {
            let mut map = Map::new();
            let mut rest = rest;
            loop {
                match rest.first() {
                    Some(&END) => break (Value::Object(map), &rest[1..]),
                    Some(&STRING) => {
                        let (k, r) = decode_str(&rest[1..])?;
                        let (v, r) = decode_value(r, depth + 1)?;
                        map.insert(k, v);
                        rest = r;
                    }
                    _ => return Err(CorruptKey),
                }
            }
        }
        _ => return Err(CorruptKey),
    })
}

fn decode_str(bytes: &[u8]) -> Result<(String, &[u8]), CorruptKey> {
    let mut out = Vec::new();
    let mut i = 0;
    loop {
        match (bytes.get(i), bytes.get(i + 1)) {
            (Some(&END), Some(&END)) => break,
            (Some(&END), Some(&AFTER_PREFIX)) => {
                out.push(END);
                i += 2;
            }
            (Some(&END), _) | (None, _) => return Err(CorruptKey),
            (Some(&b), _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    let s = String::from_utf8(out).map_err(|_| CorruptKey)?;
    Ok((s, &bytes[i + 2..]))
}

/// A double as JSON: integral values within ±2^53 print as integers.
fn number(f: f64) -> Value {
    const EXACT: f64 = 9_007_199_254_740_992.0;
    if f.fract() == 0.0 && f.abs() <= EXACT {
        Value::Number(Number::from(f as i64))
    } else {
        Number::from_f64(f).map(Value::Number).unwrap_or(Value::Null)
    }
}

/// Decodes `n` components and returns them with what follows (the document key of an entry).
pub fn decode_components(mut bytes: &[u8], n: usize) -> Result<(Vec<Value>, &[u8]), CorruptKey> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let (v, rest) = decode(bytes)?;
        out.push(v.unwrap_or(Value::Null));
        bytes = rest;
    }
    Ok((out, bytes))
}

/// The defined order of two JSON values (the order of their encodings), for tests and
/// for evaluating comparisons the same way scans see them.
pub fn compare(a: &Value, b: &Value) -> std::cmp::Ordering {
    let (mut x, mut y) = (Vec::new(), Vec::new());
    encode_value(a, &mut x);
    encode_value(b, &mut y);
    x.cmp(&y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn enc(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        encode(Some(v), &mut out);
        out
    }

    #[test]
    fn type_order() {
        let ordered = [
            json!(null),
            json!(false),
            json!(true),
            json!(-1e300),
            json!(-2),
            json!(0),
            json!(0.5),
            json!(3),
            json!(1e300),
            json!(""),
            json!("\u{0}"),
            json!("a"),
            json!("a\u{0}"),
            json!("ab"),
            json!("b"),
            json!([]),
            json!([null]),
            json!([1]),
            json!([1, 2]),
            json!([2]),
            json!({}),
            json!({"a": 1}),
            json!({"a": 2}),
            json!({"b": 0}),
        ];
        let mut missing = Vec::new();
        encode(None, &mut missing);
        assert!(missing < enc(&ordered[0]));
        for w in ordered.windows(2) {
            assert!(enc(&w[0]) < enc(&w[1]), "{} < {}", w[0], w[1]);
        }
        assert_eq!(enc(&json!(-0.0)), enc(&json!(0)));
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            (-1_000_000i64..1_000_000).prop_map(|i| json!(i)),
            (-1e6f64..1e6).prop_map(|f| json!(f)),
            "[a-c\u{0}é]{0,4}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map("[a-c]{0,2}", inner, 0..4).prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// A reference order written directly from the rule in the module documentation.
    fn model_cmp(a: &Value, b: &Value) -> std::cmp::Ordering {
        fn rank(v: &Value) -> u8 {
            match v {
                Value::Null => 0,
                Value::Bool(false) => 1,
                Value::Bool(true) => 2,
                Value::Number(_) => 3,
                Value::String(_) => 4,
                Value::Array(_) => 5,
                Value::Object(_) => 6,
            }
        }
        match (a, b) {
            (Value::Number(x), Value::Number(y)) => x.as_f64().unwrap_or(0.0).total_cmp(&y.as_f64().unwrap_or(0.0)),
            (Value::String(x), Value::String(y)) => x.cmp(y),
            (Value::Array(x), Value::Array(y)) => {
                for (p, q) in x.iter().zip(y) {
                    let o = model_cmp(p, q);
                    if o.is_ne() {
                        return o;
                    }
                }
                x.len().cmp(&y.len())
            }
            (Value::Object(x), Value::Object(y)) => {
                let mut xs: Vec<_> = x.iter().collect();
                let mut ys: Vec<_> = y.iter().collect();
                xs.sort_by(|p, q| p.0.cmp(q.0));
                ys.sort_by(|p, q| p.0.cmp(q.0));
                for ((k1, v1), (k2, v2)) in xs.iter().zip(&ys) {
                    let o = k1.cmp(k2).then_with(|| model_cmp(v1, v2));
                    if o.is_ne() {
                        return o;
                    }
                }
                xs.len().cmp(&ys.len())
            }
            _ => rank(a).cmp(&rank(b)),
        }
    }

    fn normalized(v: &Value) -> Value {
        match v {
            Value::Number(n) => number(n.as_f64().unwrap_or(0.0)),
            Value::Array(a) => Value::Array(a.iter().map(normalized).collect()),
            Value::Object(m) => {
                let mut members: Vec<_> = m.iter().map(|(k, v)| (k.clone(), normalized(v))).collect();
                members.sort_by(|a, b| a.0.cmp(&b.0));
                Value::Object(members.into_iter().collect())
            }
            other => other.clone(),
        }
    }

    proptest! {
        #[test]
        fn byte_order_is_value_order(a in arb_json(), b in arb_json()) {
            let o = model_cmp(&a, &b);
            // -0 and 0 are one key; the model's total_cmp tells them apart.
            if o.is_ne() && !(a.is_number() && b.is_number() && a.as_f64() == b.as_f64()) {
                prop_assert_eq!(enc(&a).cmp(&enc(&b)), o);
            }
        }

        #[test]
        fn round_trip(a in arb_json(), tail in "[a-z]{0,5}") {
            let mut bytes = enc(&a);
            bytes.extend_from_slice(tail.as_bytes());
            let (v, rest) = decode(&bytes).unwrap();
            prop_assert_eq!(v.map(|v| normalized(&v)), Some(normalized(&a)));
            prop_assert_eq!(rest, tail.as_bytes());
        }

        #[test]
        fn decode_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode(&bytes);
        }
    }
}
