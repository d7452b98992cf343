//! `sum` of floating-point values whose answer does not depend on the order of the rows.
//!
//! A float sum added up in row order depends on that order, and a parallel or distributed
//! plan adds partial sums in whatever order they arrive: the same `sum(x)` computed twice
//! in one statement (TPC-H query 15 compares a group's revenue with the largest revenue,
//! each summed separately) could differ in the last bit, and an equality between them drop
//! the row. Here a float `sum` keeps the exact sum of its inputs as a list of
//! non-overlapping partials (Shewchuk's algorithm, as Python's `math.fsum`) and rounds it
//! once at the end, correctly: the answer is a function of the values alone. Every other
//! input type, and `sum(DISTINCT ...)`, is DataFusion's own `sum`.
//!
//! Written by hand because DataFusion has no order-independent float sum.

use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, Float64Array, ListArray};
use datafusion::arrow::buffer::OffsetBuffer;
use datafusion::arrow::datatypes::{DataType, Field, FieldRef, Float64Type};
use datafusion::common::{DataFusionError, Result, ScalarValue};
use datafusion::execution::SessionStateBuilder;
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::{Accumulator, AggregateUDF, AggregateUDFImpl, GroupsAccumulator, ReversedUDAF, Signature};

/// The exact sum of some floats: non-overlapping partials, smallest magnitude first, whose
/// sum is exactly the sum of the finite values added; infinities and NaNs apart.
#[derive(Debug, Default, Clone)]
pub(crate) struct Partials {
    partials: Vec<f64>,
    /// The sum of the non-finite values (0 if none).
    special: f64,
    /// A partial overflowed: the answer is the plain float sum `naive` instead.
    overflowed: bool,
    naive: f64,
    any: bool,
}

impl Partials {
    pub(crate) fn add(&mut self, x: f64) {
        self.any = true;
        self.naive += x;
        if !x.is_finite() {
            self.special += x;
            return;
        }
        if self.overflowed {
            return;
        }
        let mut x = x;
        let mut i = 0;
        for j in 0..self.partials.len() {
            let mut y = self.partials[j];
            if x.abs() < y.abs() {
                std::mem::swap(&mut x, &mut y);
            }
            let hi = x + y;
            let lo = y - (hi - x);
            if lo != 0.0 {
                self.partials[i] = lo;
                i += 1;
            }
            x = hi;
        }
        if !x.is_finite() {
            self.overflowed = true;
            return;
        }
        self.partials.truncate(i);
        self.partials.push(x);
    }

    fn merge(&mut self, other: &Partials) {
        for p in &other.partials {
            self.add(*p);
        }
        self.any |= other.any;
        self.special += other.special;
        self.naive += other.naive - other.partials.iter().sum::<f64>();
        self.overflowed |= other.overflowed;
    }

    /// The sum, correctly rounded (`None` if nothing was added).
    pub(crate) fn value(&self) -> Option<f64> {
        if !self.any {
            return None;
        }
        if self.special != 0.0 || self.special.is_nan() {
            return Some(self.special);
        }
        if self.overflowed {
            return Some(self.naive);
        }
        let p = &self.partials;
        let mut n = p.len();
        if n == 0 {
            return Some(0.0);
        }
        n -= 1;
        let mut hi = p[n];
        let mut lo = 0.0;
        while n > 0 {
            let x = hi;
            let y = p[n - 1];
            n -= 1;
            hi = x + y;
            let yr = hi - x;
            lo = y - yr;
            if lo != 0.0 {
                break;
            }
        }
        // Round half to even across the partials below, as `math.fsum` does.
        if n > 0 && ((lo < 0.0 && p[n - 1] < 0.0) || (lo > 0.0 && p[n - 1] > 0.0)) {
            let y = lo * 2.0;
            let x = hi + y;
            let yr = x - hi;
            if y == yr {
                hi = x;
            }
        }
        Some(hi)
    }
}

/// DataFusion's `sum`, with floats summed exactly.
#[derive(Debug, PartialEq, Eq, Hash)]
struct ExactSum {
    inner: Arc<AggregateUDF>,
}

fn is_float(t: &DataType) -> bool {
    matches!(t, DataType::Float64 | DataType::Float32 | DataType::Float16)
}

impl AggregateUDFImpl for ExactSum {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn aliases(&self) -> &[String] {
        self.inner.aliases()
    }

    fn signature(&self) -> &Signature {
        self.inner.signature()
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        self.inner.inner().coerce_types(arg_types)
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        self.inner.return_type(arg_types)
    }

    fn accumulator(&self, args: AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        if is_float(args.return_field.data_type()) && !args.is_distinct {
            return Ok(Box::new(ExactAccumulator::default()));
        }
        self.inner.inner().accumulator(args)
    }

    fn state_fields(&self, args: StateFieldsArgs) -> Result<Vec<FieldRef>> {
        if is_float(args.return_field.data_type()) && !args.is_distinct {
            return Ok(state_fields(args.name));
        }
        self.inner.inner().state_fields(args)
    }

    fn groups_accumulator_supported(&self, args: AccumulatorArgs) -> bool {
        (args.is_distinct || !is_float(args.return_field.data_type())) && self.inner.inner().groups_accumulator_supported(args)
    }

    fn create_groups_accumulator(&self, args: AccumulatorArgs) -> Result<Box<dyn GroupsAccumulator>> {
        self.inner.inner().create_groups_accumulator(args)
    }

    fn create_sliding_accumulator(&self, args: AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        self.inner.inner().create_sliding_accumulator(args)
    }

    fn reverse_expr(&self) -> ReversedUDAF {
        ReversedUDAF::Identical
    }

    fn default_value(&self, data_type: &DataType) -> Result<ScalarValue> {
        self.inner.inner().default_value(data_type)
    }
}

fn state_fields(name: &str) -> Vec<FieldRef> {
    let item = Arc::new(Field::new_list_field(DataType::Float64, false));
    vec![
        Arc::new(Field::new(format!("{name}[partials]"), DataType::List(item), true)),
        Arc::new(Field::new(format!("{name}[special]"), DataType::Float64, true)),
        Arc::new(Field::new(format!("{name}[naive]"), DataType::Float64, true)),
    ]
}

#[derive(Debug, Default)]
struct ExactAccumulator {
    sum: Partials,
}

impl Accumulator for ExactAccumulator {
    fn update_batch(&mut self, values: &[ArrayRef]) -> Result<()> {
        let Some(v) = values.first() else { return Ok(()) };
        let v = datafusion::arrow::compute::cast(v, &DataType::Float64)?;
        let v = v.as_primitive::<Float64Type>();
        for x in v.iter().flatten() {
            self.sum.add(x);
        }
        Ok(())
    }

    fn merge_batch(&mut self, states: &[ArrayRef]) -> Result<()> {
        let [partials, special, naive] = states else {
            return Err(DataFusionError::Internal(format!("an exact sum's state has 3 fields, not {}", states.len())));
        };
        let partials = partials.as_list::<i32>();
        let special = special.as_primitive::<Float64Type>();
        let naive = naive.as_primitive::<Float64Type>();
        for row in 0..partials.len() {
            // A NULL state is a sum of nothing.
            if partials.is_null(row) {
                continue;
            }
            let list = partials.value(row);
            let list = list.as_primitive::<Float64Type>();
            let other = Partials {
                partials: list.values().to_vec(),
                special: if special.is_null(row) { 0.0 } else { special.value(row) },
                overflowed: naive.is_valid(row) && !special.is_valid(row),
                naive: if naive.is_null(row) { 0.0 } else { naive.value(row) },
                any: true,
            };
            self.sum.merge(&other);
        }
        Ok(())
    }

    fn state(&mut self) -> Result<Vec<ScalarValue>> {
        if !self.sum.any {
            let list = ListArray::new_null(Arc::new(Field::new_list_field(DataType::Float64, false)), 1);
            return Ok(vec![ScalarValue::List(Arc::new(list)), ScalarValue::Float64(None), ScalarValue::Float64(None)]);
        }
        let values = Float64Array::from(self.sum.partials.clone());
        let list = ListArray::new(
            Arc::new(Field::new_list_field(DataType::Float64, false)),
            OffsetBuffer::from_lengths([values.len()]),
            Arc::new(values),
            None,
        );
        // An overflowed sum says so by a NULL `special` beside a valid `naive`.
        let special = if self.sum.overflowed { None } else { Some(self.sum.special) };
        Ok(vec![ScalarValue::List(Arc::new(list)), ScalarValue::Float64(special), ScalarValue::Float64(Some(self.sum.naive))])
    }

    fn evaluate(&mut self) -> Result<ScalarValue> {
        Ok(ScalarValue::Float64(self.sum.value()))
    }

    fn size(&self) -> usize {
        std::mem::size_of_val(self) + self.sum.partials.capacity() * 8
    }
}

/// Replaces `sum` in the session `builder` makes with one that sums floats exactly.
pub(crate) fn wrap(builder: &mut SessionStateBuilder) {
    let Some(functions) = builder.aggregate_functions() else { return };
    for f in functions.iter_mut() {
        if f.name() == "sum" {
            *f = Arc::new(AggregateUDF::new_from_impl(ExactSum { inner: Arc::clone(f) }));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sum_of(values: &[f64]) -> Option<f64> {
        let mut p = Partials::default();
        for v in values {
            p.add(*v);
        }
        p.value()
    }

    #[test]
    fn exact_sums_round_once() {
        assert_eq!(sum_of(&[]), None);
        assert_eq!(sum_of(&[0.1; 10]), Some(1.0), "ten tenths are one, not 0.9999999999999999");
        assert_eq!(sum_of(&[1e100, 1.0, -1e100]), Some(1.0));
        assert!(sum_of(&[1.0, f64::NAN]).unwrap().is_nan());
        assert_eq!(sum_of(&[1.0, f64::INFINITY]), Some(f64::INFINITY));
        assert_eq!(sum_of(&[f64::MAX, f64::MAX]), Some(f64::INFINITY), "an overflow is the plain sum's");
    }

    proptest! {
        /// The same values in any order, split into any partial sums merged in any order,
        /// give the same sum.
        #[test]
        fn float_sums_do_not_depend_on_order_or_split(
            values in prop::collection::vec(prop_oneof![-1e6f64..1e6, -1e-6f64..1e-6, (-1e15f64..1e15)], 0..60),
            seed in any::<u64>(),
            cut in 0usize..60,
        ) {
            let want = sum_of(&values);
            let mut shuffled = values.clone();
            // A cheap deterministic shuffle.
            let mut s = seed | 1;
            for i in (1..shuffled.len()).rev() {
                s ^= s << 13; s ^= s >> 7; s ^= s << 17;
                shuffled.swap(i, (s % (i as u64 + 1)) as usize);
            }
            let cut = cut.min(shuffled.len());
            let (a, b) = shuffled.split_at(cut);
            let mut left = Partials::default();
            a.iter().for_each(|v| left.add(*v));
            let mut right = Partials::default();
            b.iter().for_each(|v| right.add(*v));
            right.merge(&left);
            prop_assert_eq!(right.value().map(f64::to_bits), want.map(f64::to_bits));
        }
    }
}
