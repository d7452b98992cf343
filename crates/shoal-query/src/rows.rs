//! Documents straight into columns, for the analytics shadow's buffers.
//!
//! The shadow takes every document written, so its cost is paid on every write: parsing a
//! document into a `serde_json::Value` tree, keeping the tree, and looking each field up
//! again to build columns cost about as much as storing the document (measured: the load
//! of seed 004 fell from ~120k to ~77k docs/s). Here a document's top-level fields are
//! parsed once, scalars without allocation (names and strings borrowed from the bytes
//! where they have no escapes), and appended to one cell vector per field; only nested
//! objects and arrays become `Value`s. [`ColumnBuffer::batch`] gives exactly the batch
//! `convert::to_batch` gives for the same documents under the schema `schema::Obj`
//! infers from them (property test below).

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, BooleanArray, Float64Array, Int64Array, NullArray, RecordBatch, StringArray};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::arrow::error::ArrowError;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use crate::convert::build;
use crate::schema::{is_mixed, Ty, FIELDS_MAX, KEY_COLUMN};

/// A top-level value of a document.
#[derive(Clone, Debug, PartialEq)]
pub enum Scalar<'a> {
    Null,
    Bool(bool),
    Int(i64),
    /// An integer above `i64::MAX`: a float to the column types, its digits as text.
    Big(u64),
    Float(f64),
    Str(Cow<'a, str>),
    /// An object or an array.
    Nested(Value),
}

/// A document's top-level fields in document order (empty for a document that is not an
/// object, which has no columns).
#[derive(Debug, Default, PartialEq)]
pub struct ParsedDoc<'a> {
    pub fields: Vec<(Cow<'a, str>, Scalar<'a>)>,
    /// Length of the document's text.
    pub bytes: usize,
}

impl<'a> ParsedDoc<'a> {
    /// Parses a stored document; one that does not parse (validated on the way in, so
    /// never expected) has no fields.
    pub fn parse(bytes: &'a [u8]) -> ParsedDoc<'a> {
        let mut de = serde_json::Deserializer::from_slice(bytes);
        match de.deserialize_any(DocVisitor) {
            Ok(doc) if de.end().is_ok() => ParsedDoc { bytes: bytes.len(), ..doc },
            _ => ParsedDoc { fields: Vec::new(), bytes: bytes.len() },
        }
    }

    /// The string value of `name`, if it has one.
    pub fn str_field(&self, name: &str) -> Option<&str> {
        self.fields.iter().rev().find(|(n, _)| n == name).and_then(|(_, v)| match v {
            Scalar::Str(s) => Some(s.as_ref()),
            _ => None,
        })
    }
}

struct DocVisitor;

impl<'de> Visitor<'de> for DocVisitor {
    type Value = ParsedDoc<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON document")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ParsedDoc<'de>, A::Error> {
        let mut fields = Vec::with_capacity(map.size_hint().unwrap_or(16));
        while let Some(name) = map.next_key_seed(NameSeed)? {
            let value = map.next_value_seed(ScalarSeed)?;
            fields.push((name, value));
        }
        Ok(ParsedDoc { fields, bytes: 0 })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ParsedDoc<'de>, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(ParsedDoc::default())
    }

    fn visit_bool<E>(self, _: bool) -> Result<ParsedDoc<'de>, E> {
        Ok(ParsedDoc::default())
    }
    fn visit_i64<E>(self, _: i64) -> Result<ParsedDoc<'de>, E> {
        Ok(ParsedDoc::default())
    }
    fn visit_u64<E>(self, _: u64) -> Result<ParsedDoc<'de>, E> {
        Ok(ParsedDoc::default())
    }
    fn visit_f64<E>(self, _: f64) -> Result<ParsedDoc<'de>, E> {
        Ok(ParsedDoc::default())
    }
    fn visit_str<E>(self, _: &str) -> Result<ParsedDoc<'de>, E> {
        Ok(ParsedDoc::default())
    }
    fn visit_unit<E>(self) -> Result<ParsedDoc<'de>, E> {
        Ok(ParsedDoc::default())
    }
}

/// A field name, borrowed when it has no escapes.
struct NameSeed;

impl<'de> DeserializeSeed<'de> for NameSeed {
    type Value = Cow<'de, str>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Cow<'de, str>, D::Error> {
        d.deserialize_str(StrVisitor)
    }
}

struct StrVisitor;

impl<'de> Visitor<'de> for StrVisitor {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Cow<'de, str>, E> {
        Ok(Cow::Borrowed(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Cow<'de, str>, E> {
        Ok(Cow::Owned(v.to_string()))
    }
}

/// A top-level value: scalars as they are, objects and arrays as `Value`s.
struct ScalarSeed;

impl<'de> DeserializeSeed<'de> for ScalarSeed {
    type Value = Scalar<'de>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Scalar<'de>, D::Error> {
        d.deserialize_any(ScalarVisitor)
    }
}

struct ScalarVisitor;

impl<'de> Visitor<'de> for ScalarVisitor {
    type Value = Scalar<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_unit<E>(self) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Null)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Int(v))
    }
    /// As `serde_json::Value` does: an integer above `i64::MAX` is not an i64.
    fn visit_u64<E>(self, v: u64) -> Result<Scalar<'de>, E> {
        Ok(i64::try_from(v).map_or(Scalar::Big(v), Scalar::Int))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Float(v))
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Str(Cow::Borrowed(v)))
    }
    fn visit_str<E>(self, v: &str) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Str(Cow::Owned(v.to_string())))
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Scalar<'de>, A::Error> {
        serde::Deserialize::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(Scalar::Nested)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Scalar<'de>, A::Error> {
        serde::Deserialize::deserialize(serde::de::value::SeqAccessDeserializer::new(seq)).map(Scalar::Nested)
    }
}

/// One value of a column; strings live in the column's text.
#[derive(Clone, Debug)]
enum Cell {
    Null,
    Bool(bool),
    Int(i64),
    Big(u64),
    Float(f64),
    Str { start: u32, len: u32 },
    Nested(Box<Value>),
}

/// One top-level field's values, one cell per row of the buffer.
#[derive(Default)]
struct Col {
    name: String,
    cells: Vec<Cell>,
    text: String,
}

impl Col {
    fn str(&self, start: u32, len: u32) -> &str {
        self.text.get(start as usize..(start + len) as usize).unwrap_or_default()
    }

    fn cell(&mut self, v: Scalar<'_>) -> Cell {
        match v {
            Scalar::Null => Cell::Null,
            Scalar::Bool(b) => Cell::Bool(b),
            Scalar::Int(i) => Cell::Int(i),
            Scalar::Big(u) => Cell::Big(u),
            Scalar::Float(f) => Cell::Float(f),
            Scalar::Str(s) => {
                let start = self.text.len() as u32;
                self.text.push_str(&s);
                Cell::Str { start, len: s.len() as u32 }
            }
            Scalar::Nested(v) => Cell::Nested(Box::new(v)),
        }
    }

    /// The column's type, inferred as `schema::Obj` infers it from the same values.
    fn field(&self) -> Field {
        let mut ty = Ty::default();
        for c in &self.cells {
            match c {
                Cell::Null => {}
                Cell::Bool(_) => ty.bools += 1,
                Cell::Int(_) => ty.ints += 1,
                Cell::Float(_) | Cell::Big(_) => ty.floats += 1,
                Cell::Str { .. } => ty.strs += 1,
                Cell::Nested(v) => ty.observe(v, 1),
            }
        }
        ty.field(&self.name)
    }

    fn array(&self, field: &Field) -> Result<ArrayRef, ArrowError> {
        let cells = &self.cells;
        Ok(match field.data_type() {
            DataType::Null => Arc::new(NullArray::new(cells.len())),
            DataType::Boolean => {
                Arc::new(cells.iter().map(|c| if let Cell::Bool(b) = c { Some(*b) } else { None }).collect::<BooleanArray>())
            }
            DataType::Int64 => Arc::new(cells.iter().map(|c| if let Cell::Int(i) = c { Some(*i) } else { None }).collect::<Int64Array>()),
            DataType::Float64 => Arc::new(
                cells
                    .iter()
                    .map(|c| match c {
                        Cell::Int(i) => Some(*i as f64),
                        Cell::Big(u) => Some(*u as f64),
                        Cell::Float(f) => Some(*f),
                        _ => None,
                    })
                    .collect::<Float64Array>(),
            ),
            DataType::Utf8 if is_mixed(field) => Arc::new(
                cells
                    .iter()
                    .map(|c| match c {
                        Cell::Null => None,
                        Cell::Str { start, len } => Some(Cow::Borrowed(self.str(*start, *len))),
                        Cell::Bool(b) => Some(Cow::Owned(b.to_string())),
                        Cell::Int(i) => Some(Cow::Owned(i.to_string())),
                        Cell::Big(u) => Some(Cow::Owned(u.to_string())),
                        Cell::Float(f) => Some(Cow::Owned(Value::from(*f).to_string())),
                        Cell::Nested(v) => Some(Cow::Owned(v.to_string())),
                    })
                    .collect::<StringArray>(),
            ),
            DataType::Utf8 => Arc::new(
                cells
                    .iter()
                    .map(|c| if let Cell::Str { start, len } = c { Some(self.str(*start, *len)) } else { None })
                    .collect::<StringArray>(),
            ),
            _ => {
                let values: Vec<Option<&Value>> =
                    cells.iter().map(|c| if let Cell::Nested(v) = c { Some(v.as_ref()) } else { None }).collect();
                build(field, &values)?
            }
        })
    }
}

/// Rows of documents as columns of cells, typed when a batch is taken.
#[derive(Default)]
pub struct ColumnBuffer {
    keys: Vec<String>,
    cols: Vec<Col>,
    at: HashMap<String, usize>,
    /// Text of the documents pushed (removed ones included): bounds the batch's size.
    bytes: usize,
}

impl ColumnBuffer {
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    pub fn keys(&self) -> &[String] {
        &self.keys
    }

    /// Bytes of document text pushed since the buffer was empty.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Appends a row; answers its index.
    pub fn push(&mut self, key: String, doc: ParsedDoc<'_>) -> usize {
        let row = self.keys.len();
        self.keys.push(key);
        self.bytes += doc.bytes;
        for (i, (name, value)) in doc.fields.into_iter().enumerate() {
            if name == KEY_COLUMN {
                continue;
            }
            // Documents of one kind list their fields in the same order: guess first.
            let c = match self.cols.get(i) {
                Some(col) if col.name == name => i,
                _ => match self.at.get(name.as_ref()) {
                    Some(&c) => c,
                    None if self.cols.len() < FIELDS_MAX => {
                        self.at.insert(name.to_string(), self.cols.len());
                        self.cols.push(Col { name: name.into_owned(), cells: vec![Cell::Null; row], text: String::new() });
                        self.cols.len() - 1
                    }
                    None => continue,
                },
            };
            let col = &mut self.cols[c];
            let cell = col.cell(value);
            // A repeated name: the last value counts, as in a parsed object.
            if col.cells.len() > row {
                col.cells[row] = cell;
            } else {
                col.cells.push(cell);
            }
        }
        for col in &mut self.cols {
            if col.cells.len() <= row {
                col.cells.push(Cell::Null);
            }
        }
        row
    }

    /// Removes row `row`; the last row takes its place (its key is answered).
    pub fn swap_remove(&mut self, row: usize) -> Option<&str> {
        if row >= self.keys.len() {
            return None;
        }
        self.keys.swap_remove(row);
        for col in &mut self.cols {
            col.cells.swap_remove(row);
        }
        self.keys.get(row).map(String::as_str)
    }

    /// The rows as a batch: the key column, then one column per field, typed by the kind
    /// most of its values have (values of other kinds are NULL).
    pub fn batch(&self) -> Result<RecordBatch, ArrowError> {
        let mut fields = vec![Field::new(KEY_COLUMN, DataType::Utf8, false)];
        let mut columns: Vec<ArrayRef> = vec![Arc::new(StringArray::from_iter_values(self.keys.iter()))];
        for col in &self.cols {
            let field = col.field();
            columns.push(col.array(&field)?);
            fields.push(field);
        }
        RecordBatch::try_new(Arc::new(Schema::new(fields)), columns)
    }

    /// Each field with the number of rows: a schema estimate that needs no batch.
    pub fn weighted_fields(&self) -> Vec<(Field, u64)> {
        self.cols.iter().map(|c| (c.field(), self.keys.len() as u64)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::to_batch;
    use crate::schema::Obj;
    use crate::testgen::json_value;
    use proptest::prelude::*;
    use serde_json::json;

    fn doc() -> impl Strategy<Value = Value> {
        prop_oneof![
            8 => prop::collection::vec(("[abcd]|meta_id|x\\\\y", json_value()), 0..6).prop_map(|fields| Value::Object(fields.into_iter().collect())),
            1 => json_value(),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]
        /// The buffer's batch equals the batch `to_batch` builds from parsed `Value`s under
        /// the schema `Obj` infers — types, values, NULLs, column order.
        #[test]
        fn column_buffers_build_the_batches_values_build(docs in prop::collection::vec(doc(), 1..16)) {
            let texts: Vec<String> = docs.iter().map(Value::to_string).collect();
            let mut buf = ColumnBuffer::default();
            let mut obj = Obj::default();
            let mut rows = Vec::new();
            for (i, text) in texts.iter().enumerate() {
                buf.push(format!("k{i}"), ParsedDoc::parse(text.as_bytes()));
                let v: Value = serde_json::from_str(text).unwrap();
                if let Value::Object(m) = &v {
                    obj.observe(m, 0);
                }
                rows.push((format!("k{i}"), v));
            }
            let want = to_batch(&obj.table_schema(), None, &rows).unwrap();
            let got = buf.batch().unwrap();
            prop_assert_eq!(got.schema(), want.schema());
            prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn rows_are_removed_by_swapping_in_the_last() {
        let mut buf = ColumnBuffer::default();
        for (k, d) in [("a", json!({"n": 1})), ("b", json!({"n": 2, "s": "x"})), ("c", json!({"s": "y"}))] {
            let text = d.to_string();
            buf.push(k.to_string(), ParsedDoc::parse(text.as_bytes()));
        }
        assert_eq!(buf.swap_remove(0), Some("c"));
        assert_eq!(buf.swap_remove(1), None, "the last row: nothing moves");
        assert_eq!(buf.keys(), ["c"]);
        let b = buf.batch().unwrap();
        assert_eq!(b.num_rows(), 1);
        assert_eq!(crate::convert::to_json(b.column(2).as_ref(), 0).unwrap(), json!("y"));
        assert_eq!(buf.bytes(), 7 + 15 + 9, "bytes pushed are counted, removed ones too");
        assert_eq!(ParsedDoc::parse(b"[1, 2]").fields.len(), 0, "not an object: no fields");
        assert_eq!(ParsedDoc::parse(b"{\"a\": 1} x").fields.len(), 0, "trailing garbage: no fields");
    }
}
