//! JSON documents to Arrow record batches, and Arrow values back to JSON.
//!
//! Written by hand: `arrow-json`'s decoder fails a whole batch on a value of the wrong
//! type, and Shoal's rule is that such a value is NULL in that row, never a failed query.

use std::borrow::Cow;
use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, BooleanArray, Float64Array, Int64Array, ListArray, NullArray, RecordBatch, StringArray, StructArray,
};
use datafusion::arrow::buffer::{NullBuffer, OffsetBuffer};
use datafusion::arrow::datatypes::{DataType, Field, SchemaRef};
use datafusion::arrow::error::ArrowError;
use datafusion::arrow::util::display::{ArrayFormatter, FormatOptions};
use serde_json::Value;

use crate::schema::{is_mixed, KEY_COLUMN};

/// One batch of `schema`'s columns (or those in `projection`) from `(key, document)` rows.
pub fn to_batch(schema: &SchemaRef, projection: Option<&[usize]>, rows: &[(String, Value)]) -> Result<RecordBatch, ArrowError> {
    let indices: Vec<usize> = match projection {
        Some(p) => p.to_vec(),
        None => (0..schema.fields().len()).collect(),
    };
    let projected = Arc::new(schema.project(&indices)?);
    let mut columns: Vec<ArrayRef> = Vec::with_capacity(indices.len());
    for field in projected.fields() {
        if field.name() == KEY_COLUMN {
            columns.push(Arc::new(StringArray::from_iter_values(rows.iter().map(|(k, _)| k.as_str()))));
            continue;
        }
        let values: Vec<Option<&Value>> = rows.iter().map(|(_, doc)| doc.get(field.name())).collect();
        columns.push(build(field, &values)?);
    }
    let options = datafusion::arrow::array::RecordBatchOptions::new().with_row_count(Some(rows.len()));
    RecordBatch::try_new_with_options(projected, columns, &options)
}

/// The column of `field` from one value (or none) per row; a value of another type is null.
pub(crate) fn build(field: &Field, values: &[Option<&Value>]) -> Result<ArrayRef, ArrowError> {
    Ok(match field.data_type() {
        DataType::Null => Arc::new(NullArray::new(values.len())),
        DataType::Boolean => Arc::new(values.iter().map(|v| v.and_then(Value::as_bool)).collect::<BooleanArray>()),
        DataType::Int64 => Arc::new(values.iter().map(|v| v.and_then(Value::as_i64)).collect::<Int64Array>()),
        DataType::Float64 => Arc::new(values.iter().map(|v| v.and_then(Value::as_f64)).collect::<Float64Array>()),
        DataType::Utf8 if is_mixed(field) => Arc::new(
            values
                .iter()
                .map(|v| match v {
                    None | Some(Value::Null) => None,
                    Some(Value::String(s)) => Some(Cow::Borrowed(s.as_str())),
                    Some(other) => Some(Cow::Owned(other.to_string())),
                })
                .collect::<StringArray>(),
        ),
        DataType::Utf8 => Arc::new(values.iter().map(|v| v.and_then(Value::as_str)).collect::<StringArray>()),
        DataType::Struct(fields) => {
            let objects: Vec<Option<&serde_json::Map<String, Value>>> = values.iter().map(|v| v.and_then(Value::as_object)).collect();
            let mut children = Vec::with_capacity(fields.len());
            for f in fields {
                let child: Vec<Option<&Value>> = objects.iter().map(|o| o.and_then(|o| o.get(f.name()))).collect();
                children.push(build(f, &child)?);
            }
            let nulls = NullBuffer::from(objects.iter().map(Option::is_some).collect::<Vec<bool>>());
            Arc::new(StructArray::try_new(fields.clone(), children, Some(nulls))?)
        }
        DataType::List(item) => {
            let mut offsets = Vec::with_capacity(values.len() + 1);
            let mut flat: Vec<Option<&Value>> = Vec::new();
            let mut valid = Vec::with_capacity(values.len());
            offsets.push(0i32);
            for v in values {
                match v.and_then(Value::as_array) {
                    Some(items) => {
                        flat.extend(items.iter().map(Some));
                        valid.push(true);
                    }
                    None => valid.push(false),
                }
                let end = i32::try_from(flat.len()).map_err(|_| ArrowError::ComputeError("list too long".into()))?;
                offsets.push(end);
            }
            let child = build(item, &flat)?;
            Arc::new(ListArray::try_new(item.clone(), OffsetBuffer::new(offsets.into()), child, Some(NullBuffer::from(valid)))?)
        }
        other => return Err(ArrowError::NotYetImplemented(format!("column type {other}"))),
    })
}

/// Row `row` of `array` as JSON: numbers, strings, booleans, lists and structs as such;
/// other Arrow types (dates, decimals, intervals) as their display text.
pub fn to_json(array: &dyn Array, row: usize) -> Result<Value, ArrowError> {
    use datafusion::arrow::array::AsArray;
    use datafusion::arrow::datatypes::*;
    // Logical nulls: a `Null`-typed column (a field only ever seen as null) has no null
    // buffer, so `is_null` alone would call its rows valid.
    if array.logical_nulls().is_some_and(|n| n.is_null(row)) {
        return Ok(Value::Null);
    }
    Ok(match array.data_type() {
        DataType::Boolean => Value::Bool(array.as_boolean().value(row)),
        DataType::Int8 => array.as_primitive::<Int8Type>().value(row).into(),
        DataType::Int16 => array.as_primitive::<Int16Type>().value(row).into(),
        DataType::Int32 => array.as_primitive::<Int32Type>().value(row).into(),
        DataType::Int64 => array.as_primitive::<Int64Type>().value(row).into(),
        DataType::UInt8 => array.as_primitive::<UInt8Type>().value(row).into(),
        DataType::UInt16 => array.as_primitive::<UInt16Type>().value(row).into(),
        DataType::UInt32 => array.as_primitive::<UInt32Type>().value(row).into(),
        DataType::UInt64 => array.as_primitive::<UInt64Type>().value(row).into(),
        DataType::Float32 => float(f64::from(array.as_primitive::<Float32Type>().value(row))),
        DataType::Float64 => float(array.as_primitive::<Float64Type>().value(row)),
        DataType::Utf8 => Value::String(array.as_string::<i32>().value(row).to_string()),
        DataType::LargeUtf8 => Value::String(array.as_string::<i64>().value(row).to_string()),
        DataType::Utf8View => Value::String(array.as_string_view().value(row).to_string()),
        DataType::List(_) => {
            let list = array.as_list::<i32>().value(row);
            Value::Array((0..list.len()).map(|i| to_json(list.as_ref(), i)).collect::<Result<_, _>>()?)
        }
        DataType::LargeList(_) => {
            let list = array.as_list::<i64>().value(row);
            Value::Array((0..list.len()).map(|i| to_json(list.as_ref(), i)).collect::<Result<_, _>>()?)
        }
        DataType::Struct(fields) => {
            let s = array.as_struct();
            let mut map = serde_json::Map::new();
            for (i, f) in fields.iter().enumerate() {
                map.insert(f.name().clone(), to_json(s.column(i).as_ref(), row)?);
            }
            Value::Object(map)
        }
        _ => {
            let formatter = ArrayFormatter::try_new(array, &FormatOptions::default())?;
            Value::String(formatter.value(row).to_string())
        }
    })
}

/// Writes the value at `row` as JSON text, for answers. Exact where [`to_json`] is not:
/// a decimal is written with its own digits (`0.07`, `11803420.2500`), never through a
/// float, so an exact SQL answer stays exact on the wire.
pub fn write_json(out: &mut Vec<u8>, array: &dyn Array, row: usize) -> Result<(), ArrowError> {
    use datafusion::arrow::array::AsArray;
    use datafusion::arrow::datatypes::*;
    use std::io::Write as _;
    if array.logical_nulls().is_some_and(|n| n.is_null(row)) {
        out.extend_from_slice(b"null");
        return Ok(());
    }
    let io = |e: std::io::Error| ArrowError::ExternalError(Box::new(e));
    match array.data_type() {
        DataType::Boolean => out.extend_from_slice(if array.as_boolean().value(row) { b"true" } else { b"false" }),
        DataType::Int8 => write!(out, "{}", array.as_primitive::<Int8Type>().value(row)).map_err(io)?,
        DataType::Int16 => write!(out, "{}", array.as_primitive::<Int16Type>().value(row)).map_err(io)?,
        DataType::Int32 => write!(out, "{}", array.as_primitive::<Int32Type>().value(row)).map_err(io)?,
        DataType::Int64 => write!(out, "{}", array.as_primitive::<Int64Type>().value(row)).map_err(io)?,
        DataType::UInt8 => write!(out, "{}", array.as_primitive::<UInt8Type>().value(row)).map_err(io)?,
        DataType::UInt16 => write!(out, "{}", array.as_primitive::<UInt16Type>().value(row)).map_err(io)?,
        DataType::UInt32 => write!(out, "{}", array.as_primitive::<UInt32Type>().value(row)).map_err(io)?,
        DataType::UInt64 => write!(out, "{}", array.as_primitive::<UInt64Type>().value(row)).map_err(io)?,
        DataType::Float32 | DataType::Float64 => {
            let f = match array.data_type() {
                DataType::Float32 => f64::from(array.as_primitive::<Float32Type>().value(row)),
                _ => array.as_primitive::<Float64Type>().value(row),
            };
            serde_json::to_writer(&mut *out, &float(f)).map_err(|e| ArrowError::ExternalError(Box::new(e)))?;
        }
        DataType::Decimal32(..) | DataType::Decimal64(..) | DataType::Decimal128(..) | DataType::Decimal256(..) => {
            let formatter = ArrayFormatter::try_new(array, &FormatOptions::default())?;
            let text = formatter.value(row).to_string();
            if is_json_number(&text) {
                out.extend_from_slice(text.as_bytes());
            } else {
                serde_json::to_writer(&mut *out, &text).map_err(|e| ArrowError::ExternalError(Box::new(e)))?;
            }
        }
        DataType::Utf8 => write_str(out, array.as_string::<i32>().value(row))?,
        DataType::LargeUtf8 => write_str(out, array.as_string::<i64>().value(row))?,
        DataType::Utf8View => write_str(out, array.as_string_view().value(row))?,
        DataType::List(_) | DataType::LargeList(_) => {
            let list = match array.data_type() {
                DataType::List(_) => array.as_list::<i32>().value(row),
                _ => array.as_list::<i64>().value(row),
            };
            out.push(b'[');
            for i in 0..list.len() {
                if i > 0 {
                    out.push(b',');
                }
                write_json(out, list.as_ref(), i)?;
            }
            out.push(b']');
        }
        DataType::Struct(fields) => {
            let s = array.as_struct();
            out.push(b'{');
            for (i, f) in fields.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_str(out, f.name())?;
                out.push(b':');
                write_json(out, s.column(i).as_ref(), row)?;
            }
            out.push(b'}');
        }
        _ => {
            let formatter = ArrayFormatter::try_new(array, &FormatOptions::default())?;
            write_str(out, &formatter.value(row).to_string())?;
        }
    }
    Ok(())
}

fn write_str(out: &mut Vec<u8>, s: &str) -> Result<(), ArrowError> {
    serde_json::to_writer(&mut *out, s).map_err(|e| ArrowError::ExternalError(Box::new(e)))
}

/// Whether `text` is a JSON number (what a decimal formats to: `-12.50`, `7`).
fn is_json_number(text: &str) -> bool {
    let digits = text.strip_prefix('-').unwrap_or(text);
    let (int, frac) = digits.split_once('.').unwrap_or((digits, "1"));
    !int.is_empty()
        && int.bytes().all(|b| b.is_ascii_digit())
        && (int == "0" || !int.starts_with('0'))
        && !frac.is_empty()
        && frac.bytes().all(|b| b.is_ascii_digit())
}

/// A float as JSON; NaN and infinities (which JSON lacks) as null.
fn float(f: f64) -> Value {
    serde_json::Number::from_f64(f).map(Value::Number).unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::Obj;
    use serde_json::json;

    #[test]
    fn decimals_are_written_exactly() {
        use datafusion::arrow::array::Decimal128Array;
        let a = Decimal128Array::from(vec![Some(7), Some(-1_180_342_025_340), None, Some(0)]).with_precision_and_scale(38, 4).unwrap();
        let text = |row| {
            let mut out = Vec::new();
            write_json(&mut out, &a, row).unwrap();
            String::from_utf8(out).unwrap()
        };
        assert_eq!(text(0), "0.0007");
        assert_eq!(text(1), "-118034202.5340");
        assert_eq!(text(2), "null");
        assert_eq!(text(3), "0.0000");
        for t in ["0.0007", "-1.5", "12", "0"] {
            assert!(is_json_number(t), "{t}");
        }
        for t in ["", "-", "1.", ".5", "01", "1e5", "NaN"] {
            assert!(!is_json_number(t), "{t}");
        }
    }

    #[test]
    fn values_of_another_type_are_null_and_round_trip_otherwise() {
        let docs = [json!({"n": 1, "s": "a", "o": {"x": 1}, "l": [1, 2], "m": "t"}), json!({"n": 2.5, "m": 7, "l": [], "o": {"x": 2}})];
        let mut obj = Obj::default();
        for d in &docs {
            obj.observe(d.as_object().unwrap(), 0);
        }
        let schema = obj.table_schema();
        // A third document that fits nothing: every column is null, the batch still builds.
        let odd = json!({"n": "x", "s": 5, "o": [1], "l": {"a": 1}, "m": null});
        let rows: Vec<(String, Value)> = docs.iter().cloned().chain([odd]).enumerate().map(|(i, d)| (format!("k{i}"), d)).collect();
        let batch = to_batch(&schema, None, &rows).unwrap();
        assert_eq!(batch.num_rows(), 3);
        let col = |name: &str| batch.column(schema.index_of(name).unwrap()).clone();
        assert_eq!(to_json(col("meta_id").as_ref(), 2).unwrap(), json!("k2"));
        assert_eq!(to_json(col("n").as_ref(), 0).unwrap(), json!(1.0));
        assert_eq!(to_json(col("n").as_ref(), 1).unwrap(), json!(2.5));
        assert_eq!(to_json(col("m").as_ref(), 1).unwrap(), json!(7), "a tie goes to numbers");
        assert_eq!(to_json(col("m").as_ref(), 0).unwrap(), Value::Null, "the string does not fit");
        assert_eq!(to_json(col("o").as_ref(), 0).unwrap(), json!({"x": 1}));
        assert_eq!(to_json(col("l").as_ref(), 0).unwrap(), json!([1, 2]));
        for name in ["n", "s", "o", "l", "m"] {
            assert_eq!(to_json(col(name).as_ref(), 2).unwrap(), Value::Null, "{name}");
        }
        let projected = to_batch(&schema, Some(&[0, 2]), &rows).unwrap();
        assert_eq!(projected.num_columns(), 2);
    }

    use crate::testgen::json_value;
    use proptest::prelude::*;

    proptest! {
        /// Against a model of the rule: a value of the column's kind comes back as itself
        /// (integers as integers, numbers as floats in a float column), anything else is NULL;
        /// the batch always builds, one row per document.
        #[test]
        fn any_documents_convert_and_misfits_are_null(docs in prop::collection::vec(prop::collection::btree_map("[abcd]", json_value(), 0..5), 1..12)) {
            let docs: Vec<Value> = docs.into_iter().map(|m| Value::Object(m.into_iter().collect())).collect();
            let mut obj = Obj::default();
            for d in &docs {
                obj.observe(d.as_object().unwrap(), 0);
            }
            let schema = obj.table_schema();
            let rows: Vec<(String, Value)> = docs.iter().cloned().enumerate().map(|(i, d)| (format!("k{i}"), d)).collect();
            let batch = to_batch(&schema, None, &rows).unwrap();
            prop_assert_eq!(batch.num_rows(), docs.len());
            for (c, field) in schema.fields().iter().enumerate().skip(1) {
                for (r, doc) in docs.iter().enumerate() {
                    let got = to_json(batch.column(c).as_ref(), r).unwrap();
                    let v = doc.get(field.name()).unwrap_or(&Value::Null);
                    let expected = match field.data_type() {
                        DataType::Int64 => v.as_i64().map(Value::from).unwrap_or(Value::Null),
                        DataType::Float64 => v.as_f64().map(float).unwrap_or(Value::Null),
                        DataType::Boolean => v.as_bool().map(Value::Bool).unwrap_or(Value::Null),
                        DataType::Utf8 if is_mixed(field) => match v {
                            Value::Null => Value::Null,
                            Value::String(_) => v.clone(),
                            other => Value::String(other.to_string()),
                        },
                        DataType::Utf8 => v.as_str().map(|s| Value::String(s.to_string())).unwrap_or(Value::Null),
                        DataType::Struct(_) => {
                            prop_assert_eq!(got.is_null(), !v.is_object(), "{} {}", field.name(), v);
                            continue;
                        }
                        DataType::List(_) => {
                            prop_assert_eq!(got.is_null(), !v.is_array(), "{} {}", field.name(), v);
                            continue;
                        }
                        _ => Value::Null,
                    };
                    prop_assert_eq!(&got, &expected, "field {} row {}", field.name(), r);
                }
            }
        }
    }
}
