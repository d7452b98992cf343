//! One table schema from batches typed separately, and each batch's columns adapted to it.
//!
//! Every segment of the analytics shadow is typed from its own rows (see `shadow`), so one
//! field may be an integer in one segment and a float in another, or a struct with more
//! members. The table takes, per field, the kind most values have (as `schema` does for
//! documents); structs merge their members and lists their items. Adapting a column keeps
//! its values where the kinds agree (integers widen to floats), and turns values of another
//! kind into NULL — the same rule as for documents.

use std::collections::HashMap;
use std::sync::Arc;

use datafusion::arrow::array::{
    new_null_array, Array, ArrayRef, AsArray, ListArray, RecordBatch, RecordBatchOptions, StringArray, StructArray,
};
use datafusion::arrow::datatypes::{DataType, Field, Fields, SchemaRef};
use datafusion::arrow::error::ArrowError;
use serde_json::Value;

use crate::convert::to_json;
use crate::schema::{is_mixed, MIXED_METADATA};

/// The kinds a column can have, in the order ties are broken.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Kind {
    Number,
    Str,
    Bool,
    Struct,
    List,
    Mixed,
}

fn kind(f: &Field) -> Option<Kind> {
    Some(match f.data_type() {
        DataType::Null => return None,
        DataType::Int64 | DataType::Float64 => Kind::Number,
        DataType::Utf8 if is_mixed(f) => Kind::Mixed,
        DataType::Utf8 => Kind::Str,
        DataType::Boolean => Kind::Bool,
        DataType::Struct(_) => Kind::Struct,
        DataType::List(_) => Kind::List,
        _ => Kind::Mixed,
    })
}

/// Merges fields (each weighted by how many values it holds) by name, in first-seen order.
pub fn merge_fields(fields: &[(Field, u64)]) -> Vec<Field> {
    let mut order: Vec<&str> = Vec::new();
    let mut by_name: HashMap<&str, Vec<(&Field, u64)>> = HashMap::new();
    for (f, w) in fields {
        by_name
            .entry(f.name().as_str())
            .or_insert_with(|| {
                order.push(f.name().as_str());
                Vec::new()
            })
            .push((f, *w));
    }
    order.into_iter().map(|name| merge_one(name, by_name.get(name).map_or(&[][..], Vec::as_slice))).collect()
}

fn merge_one(name: &str, cands: &[(&Field, u64)]) -> Field {
    let nullable = cands.iter().any(|(f, _)| f.is_nullable());
    let mut weights: Vec<(Kind, u64)> = Vec::new();
    for (f, w) in cands {
        let Some(k) = kind(f) else { continue };
        match weights.iter_mut().find(|(have, _)| *have == k) {
            Some((_, total)) => *total = total.saturating_add(*w),
            None => weights.push((k, *w)),
        }
    }
    // The heaviest kind; ties go to the earlier kind.
    let Some(top) = weights.iter().max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0))).map(|(k, _)| *k) else {
        return Field::new(name, DataType::Null, true);
    };
    let of_kind: Vec<(&Field, u64)> = cands.iter().filter(|(f, _)| kind(f) == Some(top)).copied().collect();
    let data_type = match top {
        Kind::Number if of_kind.iter().any(|(f, _)| f.data_type() == &DataType::Float64) => DataType::Float64,
        Kind::Number => DataType::Int64,
        Kind::Str => DataType::Utf8,
        Kind::Bool => DataType::Boolean,
        Kind::Struct => {
            let children: Vec<(Field, u64)> = of_kind
                .iter()
                .flat_map(|(f, w)| match f.data_type() {
                    DataType::Struct(fs) => fs.iter().map(|c| (c.as_ref().clone(), *w)).collect(),
                    _ => Vec::new(),
                })
                .collect();
            DataType::Struct(Fields::from(merge_fields(&children)))
        }
        Kind::List => {
            let items: Vec<(&Field, u64)> = of_kind
                .iter()
                .filter_map(|(f, w)| match f.data_type() {
                    DataType::List(item) => Some((item.as_ref(), *w)),
                    _ => None,
                })
                .collect();
            DataType::List(Arc::new(merge_one("item", &items)))
        }
        Kind::Mixed => {
            return Field::new(name, DataType::Utf8, true).with_metadata(HashMap::from([(MIXED_METADATA.to_string(), "true".to_string())]))
        }
    };
    Field::new(name, data_type, nullable)
}

/// The batch's fields, each weighted by its number of non-null values (what
/// [`merge_fields`] takes).
pub fn weighted_fields(batch: &RecordBatch) -> Vec<(Field, u64)> {
    let schema = batch.schema();
    schema.fields().iter().zip(batch.columns()).map(|(f, c)| (f.as_ref().clone(), values_held(c.as_ref()))).collect()
}

/// The non-null values of `column`: a field's weight, and its statistics' value count.
pub fn values_held(column: &dyn Array) -> u64 {
    (column.len() - column.logical_null_count()) as u64
}

/// Fields with their weights, equal fields summed into one entry, in first-seen order:
/// [`merge_fields`] adds the weights of equal fields, so it answers the same for both. A
/// shadow's segments mostly share their fields, and summed, a table of 90 segments of 23
/// fields has 23 entries rather than 2,070 — what a member sends for each table a
/// statement opens, and what the coordinator decodes and merges.
#[derive(Default)]
pub struct FieldWeights {
    order: Vec<(Field, u64)>,
    at: HashMap<Field, usize>,
}

impl FieldWeights {
    pub fn add(&mut self, field: &Field, weight: u64) {
        match self.at.get(field) {
            Some(&i) => self.order[i].1 = self.order[i].1.saturating_add(weight),
            None => {
                self.at.insert(field.clone(), self.order.len());
                self.order.push((field.clone(), weight));
            }
        }
        debug_assert_eq!(self.at.len(), self.order.len());
    }

    /// Adds [`weighted_fields`] of `batch`, without copying the fields already held.
    pub fn add_batch(&mut self, batch: &RecordBatch) {
        let schema = batch.schema();
        for (f, c) in schema.fields().iter().zip(batch.columns()) {
            self.add(f, values_held(c.as_ref()));
        }
    }

    pub fn into_vec(self) -> Vec<(Field, u64)> {
        self.order
    }
}

/// `array` as a column of `target`'s type: values of another kind are NULL.
pub fn adapt(array: &ArrayRef, target: &Field) -> Result<ArrayRef, ArrowError> {
    let t = target.data_type();
    if array.data_type() == t {
        return Ok(Arc::clone(array));
    }
    let len = array.len();
    Ok(match (array.data_type(), t) {
        (DataType::Int64, DataType::Float64) => datafusion::arrow::compute::cast(array, t)?,
        (DataType::Struct(_), DataType::Struct(fields)) => {
            let s = array.as_struct();
            let children = fields
                .iter()
                .map(|f| match s.column_by_name(f.name()) {
                    Some(c) => adapt(c, f),
                    None => Ok(new_null_array(f.data_type(), len)),
                })
                .collect::<Result<Vec<_>, _>>()?;
            Arc::new(StructArray::try_new(fields.clone(), children, s.nulls().cloned())?)
        }
        (DataType::List(_), DataType::List(item)) => {
            let l = array.as_list::<i32>();
            Arc::new(ListArray::try_new(Arc::clone(item), l.offsets().clone(), adapt(l.values(), item)?, l.nulls().cloned())?)
        }
        (_, DataType::Utf8) if is_mixed(target) => {
            // A column of JSON text: strings as they are, other values as JSON.
            let mut out = Vec::with_capacity(len);
            for r in 0..len {
                out.push(match to_json(array.as_ref(), r)? {
                    Value::Null => None,
                    Value::String(s) => Some(s),
                    v => Some(v.to_string()),
                });
            }
            Arc::new(StringArray::from(out))
        }
        _ => new_null_array(t, len),
    })
}

/// `batch` with `schema`'s columns (absent ones all NULL).
pub fn adapt_batch(batch: &RecordBatch, schema: &SchemaRef) -> Result<RecordBatch, ArrowError> {
    let columns = schema
        .fields()
        .iter()
        .map(|f| match batch.column_by_name(f.name()) {
            Some(c) => adapt(c, f),
            None => Ok(new_null_array(f.data_type(), batch.num_rows())),
        })
        .collect::<Result<Vec<_>, _>>()?;
    RecordBatch::try_new_with_options(Arc::clone(schema), columns, &RecordBatchOptions::new().with_row_count(Some(batch.num_rows())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::to_batch;
    use crate::schema::Obj;
    use serde_json::json;

    fn batch(docs: &[Value]) -> RecordBatch {
        let mut obj = Obj::default();
        for d in docs {
            obj.observe(d.as_object().unwrap(), 0);
        }
        let rows: Vec<(String, Value)> = docs.iter().enumerate().map(|(i, d)| (format!("k{i}"), d.clone())).collect();
        to_batch(&obj.table_schema(), None, &rows).unwrap()
    }

    /// A field of a few names and kinds, structs and lists one level deep.
    fn any_field() -> impl proptest::strategy::Strategy<Value = Field> {
        use proptest::prelude::*;
        let name = prop::sample::select(vec!["a", "b", "c"]);
        let leaf = prop::sample::select(vec![DataType::Null, DataType::Int64, DataType::Float64, DataType::Utf8, DataType::Boolean]);
        let leaf_field = (name.clone(), leaf.clone(), any::<bool>()).prop_map(|(n, t, null)| Field::new(n, t, null));
        let kind = prop_oneof![
            leaf.clone(),
            prop::collection::vec(leaf_field.clone(), 0..3).prop_map(|fs| {
                let mut seen = std::collections::HashSet::new();
                DataType::Struct(Fields::from(fs.into_iter().filter(|f| seen.insert(f.name().clone())).collect::<Vec<_>>()))
            }),
            leaf.prop_map(|t| DataType::List(Arc::new(Field::new("item", t, true)))),
        ];
        (name, kind, any::<bool>(), any::<bool>()).prop_map(|(n, t, null, mixed)| {
            let f = Field::new(n, t.clone(), null);
            if mixed && t == DataType::Utf8 {
                f.with_metadata(HashMap::from([(MIXED_METADATA.to_string(), "true".to_string())]))
            } else {
                f
            }
        })
    }

    proptest::proptest! {
        /// The fields a member sends summed ([`FieldWeights`]) merge into the table they
        /// merged into one entry per segment.
        #[test]
        fn fields_summed_merge_as_they_did_one_per_segment(fields in proptest::collection::vec((any_field(), 0u64..1_000), 0..40)) {
            let mut summed = FieldWeights::default();
            for (f, w) in &fields {
                summed.add(f, *w);
            }
            let summed = summed.into_vec();
            let distinct: std::collections::HashSet<&Field> = fields.iter().map(|(f, _)| f).collect();
            proptest::prop_assert_eq!(summed.len(), distinct.len());
            proptest::prop_assert_eq!(merge_fields(&summed), merge_fields(&fields));
        }
    }

    #[test]
    fn segments_typed_apart_merge_into_one_table() {
        let a = batch(&[json!({"n": 1, "s": {"x": 1}, "t": "a"}), json!({"n": 2, "s": {"x": 2}, "t": "b"})]);
        let b = batch(&[json!({"n": 1.5, "s": {"y": "z"}, "t": 7, "l": [1]})]);
        let mut all = weighted_fields(&a);
        all.extend(weighted_fields(&b));
        let schema = Arc::new(datafusion::arrow::datatypes::Schema::new(merge_fields(&all)));
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        assert_eq!(names, ["meta_id", "n", "s", "t", "l"]);
        assert_eq!(schema.field(1).data_type(), &DataType::Float64, "integers widen to floats");
        assert_eq!(schema.field(3).data_type(), &DataType::Utf8, "two strings outweigh one number");
        let DataType::Struct(members) = schema.field(2).data_type() else { panic!("struct") };
        assert_eq!(members.len(), 2, "struct members merge");
        let a2 = adapt_batch(&a, &schema).unwrap();
        let b2 = adapt_batch(&b, &schema).unwrap();
        let row = |b: &RecordBatch, r: usize| -> Vec<Value> { b.columns().iter().map(|c| to_json(c.as_ref(), r).unwrap()).collect() };
        assert_eq!(row(&a2, 0), vec![json!("k0"), json!(1.0), json!({"x": 1, "y": null}), json!("a"), Value::Null]);
        assert_eq!(
            row(&b2, 0),
            vec![json!("k0"), json!(1.5), json!({"x": null, "y": "z"}), Value::Null, json!([1])],
            "a number in a string column is NULL"
        );
    }

    #[test]
    fn a_mixed_column_takes_any_value_as_json_text() {
        let a = batch(&[json!({"m": {"deep": [1]}})]);
        let target = Field::new("m", DataType::Utf8, true).with_metadata(HashMap::from([(MIXED_METADATA.to_string(), "true".to_string())]));
        let col = adapt(a.column(1), &target).unwrap();
        assert_eq!(col.as_string::<i32>().value(0), r#"{"deep":[1]}"#);
    }
}
