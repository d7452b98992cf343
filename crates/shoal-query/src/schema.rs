//! Arrow schemas inferred from JSON documents.
//!
//! A collection's columns are the top-level fields of its documents; objects become
//! structs and arrays lists, recursively. Types are inferred from a sample and widened as
//! new documents arrive: each field takes the kind of value it holds most often (numbers
//! are integers until a float is seen); a value of another kind is NULL in its row. Values
//! nested deeper than [`INFER_DEPTH_MAX`] are JSON text. The key column [`KEY_COLUMN`]
//! comes first.

use std::collections::HashMap;
use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, Field, Fields, Schema, SchemaRef};
use serde_json::Value;

/// The document key, first column of every collection table.
pub const KEY_COLUMN: &str = "meta_id";
/// Field metadata marking a column of JSON text (strings as they are).
pub const MIXED_METADATA: &str = "shoal.mixed";
/// Deepest nesting turned into struct and list columns; deeper values are JSON text.
pub const INFER_DEPTH_MAX: usize = 16;
/// Most fields inferred per object level; later ones are left out (documented).
pub const FIELDS_MAX: usize = 1024;

/// What has been seen of one field: how many values of each kind. The column takes the
/// most frequent kind (numbers: integers unless a float was seen); values of other kinds
/// are NULL in their rows.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Ty {
    pub(crate) bools: u64,
    pub(crate) ints: u64,
    pub(crate) floats: u64,
    pub(crate) strs: u64,
    objs: u64,
    lists: u64,
    /// Objects or arrays nested deeper than [`INFER_DEPTH_MAX`]: kept as JSON text.
    deep: u64,
    obj: Obj,
    item: Option<Box<Ty>>,
}

/// Fields of an object in first-seen order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Obj {
    fields: Vec<(String, Ty)>,
    at: HashMap<String, usize>,
}

impl Obj {
    /// Whether no field was seen yet.
    pub fn is_empty(&self) -> bool {
        self.fields.is_empty()
    }

    /// Widens this object type with the members of `value`.
    pub fn observe(&mut self, value: &serde_json::Map<String, Value>, depth: usize) {
        for (name, v) in value {
            let i = match self.at.get(name) {
                Some(&i) => i,
                None if self.fields.len() < FIELDS_MAX => {
                    self.at.insert(name.clone(), self.fields.len());
                    self.fields.push((name.clone(), Ty::default()));
                    self.fields.len() - 1
                }
                None => continue,
            };
            self.fields[i].1.observe(v, depth + 1);
        }
    }

    fn arrow_fields(&self) -> Vec<Field> {
        self.fields.iter().map(|(name, ty)| ty.field(name)).collect()
    }

    /// The table schema: the key column, then the document's top-level fields (a document
    /// field named like the key column is left out).
    pub fn table_schema(&self) -> SchemaRef {
        let mut fields = vec![Field::new(KEY_COLUMN, DataType::Utf8, false)];
        fields.extend(self.fields.iter().filter(|(n, _)| n != KEY_COLUMN).map(|(name, ty)| ty.field(name)));
        Arc::new(Schema::new(fields))
    }
}

impl Ty {
    pub(crate) fn observe(&mut self, v: &Value, depth: usize) {
        match v {
            Value::Null => {}
            Value::Bool(_) => self.bools += 1,
            Value::Number(n) if n.is_i64() => self.ints += 1,
            Value::Number(_) => self.floats += 1,
            Value::String(_) => self.strs += 1,
            _ if depth >= INFER_DEPTH_MAX => self.deep += 1,
            Value::Array(items) => {
                self.lists += 1;
                let item = self.item.get_or_insert_with(Box::default);
                for i in items {
                    item.observe(i, depth + 1);
                }
            }
            Value::Object(map) => {
                self.objs += 1;
                self.obj.observe(map, depth);
            }
        }
    }

    pub(crate) fn field(&self, name: &str) -> Field {
        let numbers = self.ints + self.floats;
        let kinds = [numbers, self.strs, self.bools, self.objs, self.lists, self.deep];
        let top = kinds.iter().copied().max().unwrap_or(0);
        // Ties go to the earlier kind in this order.
        let data_type = if top == 0 {
            DataType::Null
        } else if numbers == top {
            if self.floats > 0 {
                DataType::Float64
            } else {
                DataType::Int64
            }
        } else if self.strs == top {
            DataType::Utf8
        } else if self.bools == top {
            DataType::Boolean
        } else if self.objs == top && !self.obj.fields.is_empty() {
            DataType::Struct(Fields::from(self.obj.arrow_fields()))
        } else if self.lists == top && self.objs != top {
            let item = self.item.as_deref().cloned().unwrap_or_default();
            DataType::List(Arc::new(item.field("item")))
        } else {
            return Field::new(name, DataType::Utf8, true).with_metadata(HashMap::from([(MIXED_METADATA.to_string(), "true".to_string())]));
        };
        Field::new(name, data_type, true)
    }
}

/// Whether values of `field` are stored as JSON text.
pub fn is_mixed(field: &Field) -> bool {
    field.metadata().contains_key(MIXED_METADATA)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn infer(docs: &[Value]) -> SchemaRef {
        let mut obj = Obj::default();
        for d in docs {
            obj.observe(d.as_object().unwrap(), 0);
        }
        obj.table_schema()
    }

    #[test]
    fn types_widen_and_the_most_frequent_kind_wins() {
        let s = infer(&[
            json!({"a": 1, "b": "x", "c": null, "d": {"e": 1}, "f": [1, 2], "g": true}),
            json!({"a": 1.5, "b": 2, "c": "now", "d": {"h": "y"}, "f": [2.5], "meta_id": 3}),
        ]);
        let names: Vec<&str> = s.fields().iter().map(|f| f.name().as_str()).collect();
        assert_eq!(names, ["meta_id", "a", "b", "c", "d", "f", "g"]);
        assert_eq!(s.field(0).data_type(), &DataType::Utf8);
        assert_eq!(s.field(1).data_type(), &DataType::Float64);
        assert_eq!(s.field(2).data_type(), &DataType::Int64, "one string, one number: a tie goes to numbers");
        assert_eq!(s.field(3).data_type(), &DataType::Utf8);
        assert!(!is_mixed(s.field(3)), "null then strings: strings");
        let DataType::Struct(d) = s.field(4).data_type() else { panic!("struct") };
        assert_eq!(d.iter().map(|f| f.name().as_str()).collect::<Vec<_>>(), ["e", "h"]);
        let DataType::List(item) = s.field(5).data_type() else { panic!("list") };
        assert_eq!(item.data_type(), &DataType::Float64);
        let s = infer(&[json!({"x": "a"}), json!({"x": 1}), json!({"x": "b"}), json!({"x": null})]);
        assert_eq!(s.field(1).data_type(), &DataType::Utf8, "two strings beat one number");
    }

    #[test]
    fn deep_values_stop_at_the_depth_limit() {
        let mut v = json!(1);
        for _ in 0..40 {
            v = json!({ "x": v });
        }
        let s = infer(&[v]);
        let mut t = s.field(1).clone();
        let mut levels = 0;
        while let DataType::Struct(f) = t.data_type() {
            t = f[0].as_ref().clone();
            levels += 1;
        }
        assert!(levels < INFER_DEPTH_MAX, "{levels}");
        assert!(is_mixed(&t));
    }
}
