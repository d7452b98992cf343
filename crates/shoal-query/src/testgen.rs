//! Generators of JSON values shared by the property tests.

use proptest::prelude::*;
use serde_json::Value;

/// Any JSON value, four levels deep: integers (also above `i64::MAX`), floats (also
/// integral ones, which print as `5.0`), strings with escapes, arrays and objects.
pub(crate) fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (-1e3f64..1e3).prop_map(|f| Value::from(f.round())),
        (-1e12f64..1e12).prop_map(|f| serde_json::Number::from_f64(f).map(Value::Number).unwrap_or(Value::Null)),
        "[a-z\"\\\\é]{0,6}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 32, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[abc]", inner, 0..4).prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}
