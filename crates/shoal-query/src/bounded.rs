//! SQL functions whose output size is chosen by an argument (`repeat('x', 1e9)`,
//! `lpad`, `array_repeat`, `range`, …) allocate outside DataFusion's memory pool, so one
//! statement could take all of the node's memory before any limit looked. Each of them is
//! wrapped: before it runs, the wrapper works out how many bytes it would produce from its
//! arguments and refuses a value larger than [`VALUE_MAX_BYTES`] or a batch larger than
//! [`BATCH_MAX_BYTES`] with a query error. Everything else about the function (signature,
//! coercion, return type, simplification) is the original's.
//!
//! Written by hand because DataFusion has no size limit on these functions.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray};
use datafusion::arrow::datatypes::{DataType, FieldRef, Int64Type};
use datafusion::common::{DataFusionError, Result, ScalarValue};
use datafusion::execution::SessionStateBuilder;
use datafusion::logical_expr::{ColumnarValue, Documentation, ReturnFieldArgs, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature};

/// Largest value one call may produce (a string or a list).
pub const VALUE_MAX_BYTES: u64 = 64 * 1024 * 1024;
/// Largest output of one call over a batch of rows.
pub const BATCH_MAX_BYTES: u64 = 256 * 1024 * 1024;
/// Bytes counted per list element whose size is not known from the arguments.
const LIST_ELEMENT_BYTES: u64 = 16;

/// How a function's output size follows from its arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Growth {
    /// `repeat(s, n)`: len(s) × n.
    Repeat,
    /// `lpad(s, n [, fill])`, `rpad`: n characters (up to 4 bytes each).
    Pad,
    /// `array_repeat(x, n)`: n elements of x's size.
    ArrayRepeat,
    /// `array_resize(a, n [, x])`: n elements.
    Resize,
    /// `range(start, stop [, step])`, `generate_series`: (stop − start) / step elements.
    Range,
}

/// The functions wrapped, by name.
const WRAPPED: &[(&str, Growth)] = &[
    ("repeat", Growth::Repeat),
    ("lpad", Growth::Pad),
    ("rpad", Growth::Pad),
    ("array_repeat", Growth::ArrayRepeat),
    ("array_resize", Growth::Resize),
    ("range", Growth::Range),
    ("generate_series", Growth::Range),
];

/// Replaces the size-choosing functions of the session `builder` makes with bounded ones
/// (in place: building a session once costs less than registering into it after).
pub fn wrap(builder: &mut SessionStateBuilder) {
    let Some(functions) = builder.scalar_functions() else { return };
    for f in functions.iter_mut() {
        let named = |n: &&(&str, Growth)| f.name() == n.0 || f.aliases().iter().any(|a| a == n.0);
        if let Some((_, growth)) = WRAPPED.iter().find(named) {
            *f = Arc::new(ScalarUDF::new_from_impl(Bounded { inner: Arc::clone(f.inner()), growth: *growth }));
        }
    }
}

#[derive(Debug)]
struct Bounded {
    inner: Arc<dyn ScalarUDFImpl>,
    growth: Growth,
}

impl PartialEq for Bounded {
    fn eq(&self, other: &Self) -> bool {
        self.growth == other.growth && self.inner.name() == other.inner.name()
    }
}

impl Eq for Bounded {}

impl Hash for Bounded {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.inner.name().hash(state);
        self.growth.hash(state);
    }
}

impl ScalarUDFImpl for Bounded {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn aliases(&self) -> &[String] {
        self.inner.aliases()
    }
    fn signature(&self) -> &Signature {
        self.inner.signature()
    }
    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        self.inner.return_type(arg_types)
    }
    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        self.inner.return_field_from_args(args)
    }
    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        self.inner.coerce_types(arg_types)
    }
    fn documentation(&self) -> Option<&Documentation> {
        self.inner.documentation()
    }
    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        check(self.name(), self.growth, &args.args, args.number_rows)?;
        self.inner.invoke_with_args(args)
    }
}

/// Refuses a call that would produce too much.
fn check(name: &str, growth: Growth, args: &[ColumnarValue], rows: usize) -> Result<()> {
    let rows_seen = if args.iter().all(|a| matches!(a, ColumnarValue::Scalar(_))) { 1 } else { rows };
    let mut total: u64 = 0;
    for row in 0..rows_seen {
        let bytes = match growth {
            Growth::Repeat => count(args.get(1), row).saturating_mul(byte_len(args.first(), row)),
            Growth::Pad => count(args.get(1), row).saturating_mul(4),
            Growth::ArrayRepeat => count(args.get(1), row).saturating_mul(byte_len(args.first(), row).max(LIST_ELEMENT_BYTES)),
            Growth::Resize => count(args.get(1), row).saturating_mul(LIST_ELEMENT_BYTES),
            Growth::Range => range_len(args, row).saturating_mul(LIST_ELEMENT_BYTES),
        };
        if bytes > VALUE_MAX_BYTES {
            return Err(too_much(name, bytes, "a value", VALUE_MAX_BYTES));
        }
        total = total.saturating_add(bytes);
        if total > BATCH_MAX_BYTES {
            return Err(too_much(name, total, "one batch of rows", BATCH_MAX_BYTES));
        }
    }
    Ok(())
}

fn too_much(name: &str, bytes: u64, what: &str, max: u64) -> DataFusionError {
    DataFusionError::Execution(format!("{name} would produce about {bytes} bytes; {what} may have at most {max}"))
}

/// A non-negative integer argument at `row` (0 when null or absent).
fn count(arg: Option<&ColumnarValue>, row: usize) -> u64 {
    int_at(arg, row).map_or(0, |n| u64::try_from(n).unwrap_or(0))
}

fn int_at(arg: Option<&ColumnarValue>, row: usize) -> Option<i64> {
    match arg? {
        ColumnarValue::Scalar(s) => scalar_int(s),
        ColumnarValue::Array(a) => {
            if a.is_null(row) {
                return None;
            }
            match a.data_type() {
                DataType::Int64 => Some(a.as_primitive::<Int64Type>().value(row)),
                _ => ScalarValue::try_from_array(a.as_ref(), row).ok().as_ref().and_then(scalar_int),
            }
        }
    }
}

fn scalar_int(s: &ScalarValue) -> Option<i64> {
    match s {
        ScalarValue::Int64(v) => *v,
        other => other.cast_to(&DataType::Int64).ok().and_then(|c| if let ScalarValue::Int64(v) = c { v } else { None }),
    }
}

/// Bytes of a string argument at `row` (other types: their nominal width).
fn byte_len(arg: Option<&ColumnarValue>, row: usize) -> u64 {
    let len = match arg {
        None => 0,
        Some(ColumnarValue::Scalar(s)) => scalar_len(s),
        Some(ColumnarValue::Array(a)) => match a.data_type() {
            DataType::Utf8 => a.as_string::<i32>().value(row).len(),
            DataType::LargeUtf8 => a.as_string::<i64>().value(row).len(),
            DataType::Utf8View => a.as_string_view().value(row).len(),
            _ => ScalarValue::try_from_array(a.as_ref(), row).map(|s| scalar_len(&s)).unwrap_or(0),
        },
    };
    len as u64
}

fn scalar_len(s: &ScalarValue) -> usize {
    match s {
        ScalarValue::Utf8(Some(v)) | ScalarValue::LargeUtf8(Some(v)) | ScalarValue::Utf8View(Some(v)) => v.len(),
        other => other.size().saturating_sub(std::mem::size_of::<ScalarValue>()).max(8),
    }
}

/// Elements of `range(start, stop [, step])` (one argument: `range(stop)`).
fn range_len(args: &[ColumnarValue], row: usize) -> u64 {
    let (start, stop, step) = match args.len() {
        1 => (Some(0), int_at(args.first(), row), Some(1)),
        2 => (int_at(args.first(), row), int_at(args.get(1), row), Some(1)),
        _ => (int_at(args.first(), row), int_at(args.get(1), row), int_at(args.get(2), row)),
    };
    match (start, stop, step) {
        (Some(a), Some(b), Some(s)) if s != 0 => {
            let span = i128::from(b) - i128::from(a);
            let n = span / i128::from(s);
            u64::try_from(n.max(0)).unwrap_or(u64::MAX).saturating_add(1)
        }
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::prelude::SessionContext;

    async fn run(ctx: &SessionContext, sql: &str) -> Result<usize> {
        let batches = ctx.sql(sql).await?.collect().await?;
        Ok(batches.iter().map(|b| b.num_rows()).sum())
    }

    #[tokio::test]
    async fn size_choosing_functions_are_bounded_and_still_work() {
        let mut builder = SessionStateBuilder::new().with_default_features();
        wrap(&mut builder);
        let ctx = SessionContext::from(builder.build());
        for ok in [
            "SELECT repeat('ab', 3)",
            "SELECT lpad('x', 10, '-')",
            "SELECT rpad('x', 10)",
            "SELECT array_repeat(1, 5)",
            "SELECT range(1, 100, 7)",
            "SELECT generate_series(1, 10)",
            "SELECT array_resize(make_array(1, 2), 10, 0)",
            "SELECT repeat(s, n) FROM (VALUES ('a', 2), ('bb', 3)) AS t(s, n)",
        ] {
            let rows = run(&ctx, ok).await.unwrap_or_else(|e| panic!("{ok}: {e}"));
            assert!(rows >= 1, "{ok}");
        }
        let got = ctx.sql("SELECT repeat('ab', 3) = 'ababab' AND lpad('x', 3, '-') = '--x'").await.unwrap().collect().await.unwrap();
        assert!(got[0].column(0).as_boolean().value(0), "the wrapped functions answer as before");
        for bad in [
            "SELECT repeat('x', 1000000000)",
            "SELECT lpad('x', 2000000000)",
            "SELECT rpad('x', 2000000000, 'y')",
            "SELECT array_repeat('abc', 1000000000)",
            "SELECT range(0, 10000000000)",
            "SELECT generate_series(1, 9000000000)",
            "SELECT array_resize(make_array(1), 1000000000)",
            "SELECT repeat(s, n) FROM (VALUES ('abc', 100000000)) AS t(s, n)",
        ] {
            let e = run(&ctx, bad).await.expect_err(bad);
            assert!(e.to_string().contains("may have at most"), "{bad}: {e}");
        }
    }
}
