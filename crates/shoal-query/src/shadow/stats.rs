//! Column statistics of a shadow, for the planner's estimates: per top-level field, how
//! many values it holds, about how many distinct ones, and the least and greatest of a
//! numeric one.
//!
//! A segment's are worked out once, when first asked (a segment never changes but for rows
//! dying, which the estimates ignore), and a member's are merged from its segments'. The
//! distinct counts come from a HyperLogLog sketch per segment and column, merged across
//! segments: written here because DataFusion's (`datafusion_functions_aggregate::hyperloglog`)
//! keeps 16,384 registers, 16 KiB per sketch, which for every column of every 32,768-row
//! segment would hold about 5 % of the data's size again in memory; 1,024 registers keep
//! it near 0.3 % for an error of about 3 %, plenty for an estimate.

use std::collections::BTreeMap;

use datafusion::arrow::array::{Array, AsArray, RecordBatch};
use datafusion::arrow::datatypes::{DataType, Float64Type, Int64Type};
use serde::{Deserialize, Serialize};

/// Registers of a sketch: a power of two.
const SKETCH_BITS: u32 = 10;
const SKETCH_REGISTERS: usize = 1 << SKETCH_BITS;

/// A HyperLogLog sketch of 64-bit hashes (Flajolet et al., 2007).
#[derive(Clone, Debug, PartialEq)]
pub struct Sketch(Box<[u8; SKETCH_REGISTERS]>);

impl Default for Sketch {
    fn default() -> Self {
        Sketch(Box::new([0; SKETCH_REGISTERS]))
    }
}

impl Sketch {
    pub fn add(&mut self, hash: u64) {
        let register = (hash >> (64 - SKETCH_BITS)) as usize;
        // The rank of the first one bit after the register's bits (a guard bit bounds it).
        let rest = (hash << SKETCH_BITS) | (1 << (SKETCH_BITS - 1));
        let rank = rest.leading_zeros() as u8 + 1;
        let r = &mut self.0[register];
        *r = (*r).max(rank);
    }

    pub fn merge(&mut self, other: &Sketch) {
        for (a, b) in self.0.iter_mut().zip(other.0.iter()) {
            *a = (*a).max(*b);
        }
    }

    /// About how many distinct hashes were added.
    pub fn estimate(&self) -> u64 {
        let m = SKETCH_REGISTERS as f64;
        let alpha = 0.7213 / (1.0 + 1.079 / m);
        let sum: f64 = self.0.iter().map(|&r| 2f64.powi(-i32::from(r))).sum();
        let raw = alpha * m * m / sum;
        let zeros = self.0.iter().filter(|&&r| r == 0).count();
        // Few values: linear counting of the empty registers is the better estimate.
        let e = if raw <= 2.5 * m && zeros > 0 { m * (m / zeros as f64).ln() } else { raw };
        e.round() as u64
    }
}

/// One column's statistics over some rows.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ColumnStats {
    /// Non-null values.
    pub values: u64,
    /// The least and greatest value of a numeric column.
    pub min: Option<f64>,
    pub max: Option<f64>,
    pub sketch: Sketch,
}

impl ColumnStats {
    pub fn merge(&mut self, other: &ColumnStats) {
        self.values += other.values;
        self.min = min_of(self.min, other.min);
        self.max = max_of(self.max, other.max);
        self.sketch.merge(&other.sketch);
    }

    pub fn summary(&self) -> FieldSummary {
        FieldSummary { values: self.values, distinct: self.sketch.estimate().min(self.values), min: self.min, max: self.max }
    }
}

fn min_of(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn max_of(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// Where a segment keeps its statistics once worked out.
pub type StatsCell = std::sync::Arc<std::sync::OnceLock<std::sync::Arc<TableStats>>>;

/// Statistics by top-level field name (a field of several types in one segment is not
/// there: JSON values of one name are of one type within a segment).
pub type TableStats = BTreeMap<String, ColumnStats>;

/// The statistics of `batch`'s top-level columns of numbers, strings and booleans.
pub fn batch_stats(batch: &RecordBatch) -> TableStats {
    let schema = batch.schema();
    let mut out = TableStats::new();
    let mut hashes = vec![0u64; batch.num_rows()];
    for (field, column) in schema.fields().iter().zip(batch.columns()) {
        let numeric = match field.data_type() {
            DataType::Int64 | DataType::Float64 => true,
            DataType::Utf8 | DataType::Boolean => false,
            _ => continue,
        };
        hashes.iter_mut().for_each(|h| *h = 0);
        if datafusion::common::hash_utils::create_hashes([column], &datafusion::common::hash_utils::HLL_RANDOM_STATE, &mut hashes).is_err()
        {
            continue;
        }
        let mut stats = ColumnStats { values: crate::merge::values_held(column.as_ref()), ..ColumnStats::default() };
        for (row, h) in hashes.iter().enumerate() {
            if column.is_valid(row) {
                stats.sketch.add(*h);
            }
        }
        if numeric {
            let (min, max) = match field.data_type() {
                DataType::Int64 => {
                    let a = column.as_primitive::<Int64Type>();
                    let f = |v: Option<i64>| v.map(|v| v as f64);
                    (f(datafusion::arrow::compute::min(a)), f(datafusion::arrow::compute::max(a)))
                }
                _ => {
                    let a = column.as_primitive::<Float64Type>();
                    (datafusion::arrow::compute::min(a), datafusion::arrow::compute::max(a))
                }
            };
            // NaN compares as neither least nor greatest: no bound then.
            stats.min = min.filter(|v| v.is_finite());
            stats.max = max.filter(|v| v.is_finite());
        }
        out.insert(field.name().clone(), stats);
    }
    out
}

/// Merges `from` into `into`, field by field.
pub fn merge_into(into: &mut TableStats, from: &TableStats) {
    for (name, stats) in from {
        match into.get_mut(name) {
            Some(s) => s.merge(stats),
            None => {
                into.insert(name.clone(), stats.clone());
            }
        }
    }
}

/// What a member tells the coordinator of one field: estimates.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FieldSummary {
    pub values: u64,
    pub distinct: u64,
    pub min: Option<f64>,
    pub max: Option<f64>,
}

/// Field summaries by name.
pub type TableSummary = BTreeMap<String, FieldSummary>;

pub fn summarize(stats: &TableStats) -> TableSummary {
    stats.iter().map(|(name, s)| (name.clone(), s.summary())).collect()
}

/// The members' summaries of one table as one. Their rows are disjoint; their values need
/// not be: a field whose values repeat within a member (fewer distinct than half its
/// values) is taken to repeat across members too (the largest member's count), one whose
/// values are about all distinct (keys) to be distinct across them (the sum).
pub fn union_members<'a>(members: impl IntoIterator<Item = &'a TableSummary>) -> TableSummary {
    let mut out: BTreeMap<String, (FieldSummary, bool)> = BTreeMap::new();
    for member in members {
        for (name, s) in member {
            let unique = s.distinct * 2 >= s.values;
            match out.get_mut(name) {
                Some((acc, all_unique)) => {
                    acc.values += s.values;
                    acc.distinct = if *all_unique && unique { acc.distinct + s.distinct } else { acc.distinct.max(s.distinct) };
                    *all_unique &= unique;
                    acc.min = min_of(acc.min, s.min);
                    acc.max = max_of(acc.max, s.max);
                }
                None => {
                    out.insert(name.clone(), (s.clone(), unique));
                }
            }
        }
    }
    out.into_iter().map(|(name, (s, _))| (name, s)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{Int64Array, StringArray};
    use std::sync::Arc;

    fn within(estimate: u64, truth: u64, tolerance: f64) -> bool {
        (estimate as f64 - truth as f64).abs() <= truth as f64 * tolerance
    }

    #[test]
    fn a_sketch_counts_distinct_values_within_a_few_percent() {
        for truth in [1u64, 10, 200, 5_000, 100_000, 1_000_000] {
            let batch =
                RecordBatch::try_from_iter([("v", Arc::new(Int64Array::from_iter_values((0..truth as i64).chain(0..truth as i64))) as _)])
                    .unwrap();
            let stats = batch_stats(&batch);
            let got = stats["v"].summary().distinct;
            assert!(within(got, truth, 0.08), "{truth} distinct values estimated {got}");
            assert_eq!(stats["v"].values, 2 * truth);
        }
    }

    #[test]
    fn merged_segments_count_shared_values_once_and_keep_the_bounds() {
        let a = RecordBatch::try_from_iter([("v", Arc::new(Int64Array::from_iter_values(0..3000)) as _)]).unwrap();
        let b = RecordBatch::try_from_iter([("v", Arc::new(Int64Array::from_iter_values(2000..5000)) as _)]).unwrap();
        let mut all = batch_stats(&a);
        merge_into(&mut all, &batch_stats(&b));
        let s = all["v"].summary();
        assert!(within(s.distinct, 5000, 0.08), "{s:?}");
        assert_eq!((s.values, s.min, s.max), (6000, Some(0.0), Some(4999.0)));
    }

    #[test]
    fn nulls_and_other_kinds_of_columns_are_not_counted() {
        let batch = RecordBatch::try_from_iter([
            ("s", Arc::new(StringArray::from(vec![Some("a"), None, Some("b"), Some("a")])) as _),
            ("n", Arc::new(Int64Array::from(vec![None, Some(-4), Some(9), None])) as _),
        ])
        .unwrap();
        let stats = summarize(&batch_stats(&batch));
        assert_eq!(stats["s"], FieldSummary { values: 3, distinct: 2, min: None, max: None });
        assert_eq!(stats["n"], FieldSummary { values: 2, distinct: 2, min: Some(-4.0), max: Some(9.0) });
    }

    #[test]
    fn members_sum_the_distinct_keys_and_share_the_repeated_values() {
        let member = |distinct_keys: u64, offset: f64| {
            TableSummary::from([
                (
                    "key".to_string(),
                    FieldSummary { values: distinct_keys, distinct: distinct_keys, min: Some(offset), max: Some(offset + 10.0) },
                ),
                ("year".to_string(), FieldSummary { values: distinct_keys, distinct: 200, min: None, max: None }),
            ])
        };
        let (a, b) = (member(10_000, 0.0), member(12_000, 5.0));
        let all = union_members([&a, &b]);
        assert_eq!(all["key"], FieldSummary { values: 22_000, distinct: 22_000, min: Some(0.0), max: Some(15.0) });
        assert_eq!(all["year"].distinct, 200);
    }
}
