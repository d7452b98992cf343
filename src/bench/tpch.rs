//! TPC-H's eight tables as NDJSON files of `{"key", "value"}` lines (what `shoal load`
//! and the `_bulk` loaders take), one document per row, for the differential test of
//! SQL answers against DuckDB (`bench/tpch_diff.py`, queries in `bench/tpch/`).
//!
//! The rows come from the `tpchgen` crate, the DataFusion community's pure-Rust port of
//! `dbgen` (same rows, same order), so a scale factor here is TPC-H's. The documents keep
//! TPC-H's column names as fields. Decimal columns (TPC-H's `decimal(15,2)`) are JSON
//! numbers written from their integer hundredths as decimal text ("901.00", "0.07"), never
//! through `f64` formatting, so every reader parses the nearest double to the exact value;
//! dates are "YYYY-MM-DD" strings. A document's key is its table's primary key, the
//! columns of a composite key joined with `-` (lineitem `"1-3"`).

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use tpchgen::generators::{
    CustomerGenerator, LineItemGenerator, NationGenerator, OrderGenerator, PartGenerator, PartSuppGenerator, RegionGenerator,
    SupplierGenerator,
};

use crate::cli::CliError;

/// `tpchgen` splits a table into parts for parallel generation; we write each table whole,
/// as part 1 of 1 (parts are 1-based).
const WHOLE_TABLE: (i32, i32) = (1, 1);

/// Output buffer per file: large enough that the lineitem file is written in few syscalls.
const WRITE_BUFFER_BYTES: usize = 1 << 20;

#[derive(Args)]
pub struct GenArgs {
    /// TPC-H scale factor (1: 6 million lineitems, 1.5 million orders).
    #[arg(long, default_value_t = 0.01)]
    sf: f64,
    /// Directory for `region.ndjson` … `lineitem.ndjson` (lines of `{"key", "value"}`).
    #[arg(long)]
    out: PathBuf,
}

/// The eight TPC-H tables, in the order they are written (small ones first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Table {
    Region,
    Nation,
    Part,
    Supplier,
    PartSupp,
    Customer,
    Orders,
    LineItem,
}

pub const TABLES: [Table; 8] =
    [Table::Region, Table::Nation, Table::Part, Table::Supplier, Table::PartSupp, Table::Customer, Table::Orders, Table::LineItem];

impl Table {
    /// The table's (and collection's, and file's) name, as the queries spell it.
    pub fn name(self) -> &'static str {
        match self {
            Table::Region => "region",
            Table::Nation => "nation",
            Table::Part => "part",
            Table::Supplier => "supplier",
            Table::PartSupp => "partsupp",
            Table::Customer => "customer",
            Table::Orders => "orders",
            Table::LineItem => "lineitem",
        }
    }
}

/// One field's value in a document.
enum Cell {
    Int(i64),
    /// A `decimal(15,2)` as its integer hundredths.
    Decimal(i64),
    Text(String),
}

/// The exact decimal text of `hundredths / 100` ("-0.01", "901.00"), by integer arithmetic.
pub fn decimal_text(hundredths: i64) -> String {
    let sign = if hundredths < 0 { "-" } else { "" };
    let abs = hundredths.unsigned_abs();
    format!("{sign}{}.{:02}", abs / 100, abs % 100)
}

/// Writes one `{"key": ..., "value": {...}}` line. The line is assembled by hand rather than
/// through `serde_json::Value`, whose numbers are `f64` and would lose the decimal text.
fn write_row(out: &mut impl Write, key: &str, fields: &[(&str, Cell)]) -> std::io::Result<()> {
    out.write_all(b"{\"key\":")?;
    serde_json::to_writer(&mut *out, key)?;
    out.write_all(b",\"value\":{")?;
    for (i, (name, cell)) in fields.iter().enumerate() {
        if i > 0 {
            out.write_all(b",")?;
        }
        serde_json::to_writer(&mut *out, name)?;
        out.write_all(b":")?;
        match cell {
            Cell::Int(v) => write!(out, "{v}")?,
            Cell::Decimal(h) => out.write_all(decimal_text(*h).as_bytes())?,
            Cell::Text(s) => serde_json::to_writer(&mut *out, s)?,
        }
    }
    out.write_all(b"}}\n")
}

/// Writes every row of `table` at scale factor `sf` to `out`; returns the row count.
pub fn write_table(table: Table, sf: f64, out: &mut impl Write) -> std::io::Result<u64> {
    use Cell::{Decimal, Int, Text};
    let (part, parts) = WHOLE_TABLE;
    let mut rows = 0;
    let mut emit = |key: String, fields: &[(&str, Cell)]| {
        rows += 1;
        write_row(out, &key, fields)
    };
    match table {
        Table::Region => {
            for r in RegionGenerator::new(sf, part, parts).iter() {
                emit(
                    r.r_regionkey.to_string(),
                    &[("r_regionkey", Int(r.r_regionkey)), ("r_name", Text(r.r_name.into())), ("r_comment", Text(r.r_comment.into()))],
                )?;
            }
        }
        Table::Nation => {
            for n in NationGenerator::new(sf, part, parts).iter() {
                emit(
                    n.n_nationkey.to_string(),
                    &[
                        ("n_nationkey", Int(n.n_nationkey)),
                        ("n_name", Text(n.n_name.into())),
                        ("n_regionkey", Int(n.n_regionkey)),
                        ("n_comment", Text(n.n_comment.into())),
                    ],
                )?;
            }
        }
        Table::Part => {
            for p in PartGenerator::new(sf, part, parts).iter() {
                emit(
                    p.p_partkey.to_string(),
                    &[
                        ("p_partkey", Int(p.p_partkey)),
                        ("p_name", Text(p.p_name.to_string())),
                        ("p_mfgr", Text(p.p_mfgr.to_string())),
                        ("p_brand", Text(p.p_brand.to_string())),
                        ("p_type", Text(p.p_type.into())),
                        ("p_size", Int(p.p_size.into())),
                        ("p_container", Text(p.p_container.into())),
                        ("p_retailprice", Decimal(p.p_retailprice.into_inner())),
                        ("p_comment", Text(p.p_comment.into())),
                    ],
                )?;
            }
        }
        Table::Supplier => {
            for s in SupplierGenerator::new(sf, part, parts).iter() {
                emit(
                    s.s_suppkey.to_string(),
                    &[
                        ("s_suppkey", Int(s.s_suppkey)),
                        ("s_name", Text(s.s_name.to_string())),
                        ("s_address", Text(s.s_address.to_string())),
                        ("s_nationkey", Int(s.s_nationkey)),
                        ("s_phone", Text(s.s_phone.to_string())),
                        ("s_acctbal", Decimal(s.s_acctbal.into_inner())),
                        ("s_comment", Text(s.s_comment)),
                    ],
                )?;
            }
        }
        Table::PartSupp => {
            // dbgen picks a part's four suppliers as `(partkey + i * (S/4 + (partkey-1)/S)) % S`;
            // when S (the supplier count) is not a multiple of 4, as at SF 0.001, two of them
            // can coincide and the primary key repeats. A repeated key would silently collapse
            // into one document, so refuse. A part's rows are consecutive: only its own
            // suppliers need remembering.
            let mut current: (i64, Vec<i64>) = (0, Vec::new());
            for ps in PartSuppGenerator::new(sf, part, parts).iter() {
                if current.0 != ps.ps_partkey {
                    current = (ps.ps_partkey, Vec::new());
                }
                if current.1.contains(&ps.ps_suppkey) {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        format!(
                            "at scale factor {sf} dbgen's partsupp repeats the key ({}, {}): choose a scale factor whose \
                             supplier count (10,000 × SF) is a multiple of 4, such as 0.01",
                            ps.ps_partkey, ps.ps_suppkey
                        ),
                    ));
                }
                current.1.push(ps.ps_suppkey);
                emit(
                    format!("{}-{}", ps.ps_partkey, ps.ps_suppkey),
                    &[
                        ("ps_partkey", Int(ps.ps_partkey)),
                        ("ps_suppkey", Int(ps.ps_suppkey)),
                        ("ps_availqty", Int(ps.ps_availqty.into())),
                        ("ps_supplycost", Decimal(ps.ps_supplycost.into_inner())),
                        ("ps_comment", Text(ps.ps_comment.into())),
                    ],
                )?;
            }
        }
        Table::Customer => {
            for c in CustomerGenerator::new(sf, part, parts).iter() {
                emit(
                    c.c_custkey.to_string(),
                    &[
                        ("c_custkey", Int(c.c_custkey)),
                        ("c_name", Text(c.c_name.to_string())),
                        ("c_address", Text(c.c_address.to_string())),
                        ("c_nationkey", Int(c.c_nationkey)),
                        ("c_phone", Text(c.c_phone.to_string())),
                        ("c_acctbal", Decimal(c.c_acctbal.into_inner())),
                        ("c_mktsegment", Text(c.c_mktsegment.into())),
                        ("c_comment", Text(c.c_comment.into())),
                    ],
                )?;
            }
        }
        Table::Orders => {
            for o in OrderGenerator::new(sf, part, parts).iter() {
                emit(
                    o.o_orderkey.to_string(),
                    &[
                        ("o_orderkey", Int(o.o_orderkey)),
                        ("o_custkey", Int(o.o_custkey)),
                        ("o_orderstatus", Text(o.o_orderstatus.to_string())),
                        ("o_totalprice", Decimal(o.o_totalprice.into_inner())),
                        ("o_orderdate", Text(o.o_orderdate.to_string())),
                        ("o_orderpriority", Text(o.o_orderpriority.into())),
                        ("o_clerk", Text(o.o_clerk.to_string())),
                        ("o_shippriority", Int(o.o_shippriority.into())),
                        ("o_comment", Text(o.o_comment.into())),
                    ],
                )?;
            }
        }
        Table::LineItem => {
            for l in LineItemGenerator::new(sf, part, parts).iter() {
                emit(
                    format!("{}-{}", l.l_orderkey, l.l_linenumber),
                    &[
                        ("l_orderkey", Int(l.l_orderkey)),
                        ("l_partkey", Int(l.l_partkey)),
                        ("l_suppkey", Int(l.l_suppkey)),
                        ("l_linenumber", Int(l.l_linenumber.into())),
                        // dbgen prints quantities as whole numbers and `tpchgen` keeps them
                        // as integers: an integer column in both engines.
                        ("l_quantity", Int(l.l_quantity)),
                        ("l_extendedprice", Decimal(l.l_extendedprice.into_inner())),
                        ("l_discount", Decimal(l.l_discount.into_inner())),
                        ("l_tax", Decimal(l.l_tax.into_inner())),
                        ("l_returnflag", Text(l.l_returnflag.into())),
                        ("l_linestatus", Text(l.l_linestatus.into())),
                        ("l_shipdate", Text(l.l_shipdate.to_string())),
                        ("l_commitdate", Text(l.l_commitdate.to_string())),
                        ("l_receiptdate", Text(l.l_receiptdate.to_string())),
                        ("l_shipinstruct", Text(l.l_shipinstruct.into())),
                        ("l_shipmode", Text(l.l_shipmode.into())),
                        ("l_comment", Text(l.l_comment.into())),
                    ],
                )?;
            }
        }
    }
    Ok(rows)
}

/// `shoal bench tpch-gen`: writes `{table}.ndjson` for the eight tables into `--out`.
pub fn generate(args: GenArgs) -> Result<(), CliError> {
    if !(args.sf > 0.0 && args.sf.is_finite()) {
        return Err(CliError::Usage(format!("--sf must be a positive number, not {}", args.sf)));
    }
    std::fs::create_dir_all(&args.out)?;
    for table in TABLES {
        let path = args.out.join(format!("{}.ndjson", table.name()));
        let mut out = std::io::BufWriter::with_capacity(WRITE_BUFFER_BYTES, std::fs::File::create(&path)?);
        let rows = write_table(table, args.sf, &mut out)?;
        out.flush()?;
        println!("{}: {rows} rows", table.name());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use serde_json::Value;

    use super::*;

    /// A tenth of TPC-H's smallest official scale factor: every table non-empty, fast.
    const TINY_SF: f64 = 0.001;
    /// The smallest scale factor whose partsupp keys are unique (100 suppliers).
    const KEYED_SF: f64 = 0.01;

    fn lines(table: Table, sf: f64) -> Vec<Value> {
        let mut out = Vec::new();
        let rows = write_table(table, sf, &mut out).expect("writing to a Vec cannot fail");
        let docs: Vec<Value> =
            out.split(|b| *b == b'\n').filter(|l| !l.is_empty()).map(|l| serde_json::from_slice(l).expect("a JSON line")).collect();
        assert_eq!(docs.len() as u64, rows, "{table:?}: the count returned is the lines written");
        docs
    }

    #[test]
    fn decimals_are_exact_text() {
        for (hundredths, text) in [(0, "0.00"), (7, "0.07"), (30, "0.30"), (90_100, "901.00"), (-1, "-0.01"), (-99_999, "-999.99")] {
            assert_eq!(decimal_text(hundredths), text);
        }
        // The text parses to the double nearest the decimal: 0.30 is 0.3, never 0.30000000000000004.
        assert_eq!(decimal_text(30).parse::<f64>(), Ok(0.3));
        assert_eq!(decimal_text(i64::MIN), "-92233720368547758.08", "no overflow at the extreme");
    }

    #[test]
    fn repeated_partsupp_keys_are_refused() {
        let err = write_table(Table::PartSupp, TINY_SF, &mut std::io::sink()).expect_err("SF 0.001 has 10 suppliers");
        assert!(err.to_string().contains("multiple of 4"), "{err}");
        let mut out = Vec::new();
        assert_eq!(write_table(Table::PartSupp, KEYED_SF, &mut out).ok(), Some(8000), "SF 0.01: 100 suppliers, keys unique");
    }

    #[test]
    fn tables_have_tpch_row_counts_and_unique_keys() {
        // TPC-H's cardinalities at SF 0.001 (partsupp at 0.01; lineitem varies, 1..=7 lines
        // per order).
        let expected = [
            (Table::Region, Some(5)),
            (Table::Nation, Some(25)),
            (Table::Part, Some(200)),
            (Table::Supplier, Some(10)),
            (Table::PartSupp, Some(8000)),
            (Table::Customer, Some(150)),
            (Table::Orders, Some(1500)),
            (Table::LineItem, None),
        ];
        for (table, rows) in expected {
            let docs = lines(table, if table == Table::PartSupp { KEYED_SF } else { TINY_SF });
            if let Some(rows) = rows {
                assert_eq!(docs.len(), rows, "{table:?}");
            } else {
                assert!((1500..=1500 * 7).contains(&docs.len()), "lineitem: {}", docs.len());
            }
            let keys: HashSet<&str> = docs.iter().map(|d| d["key"].as_str().expect("a string key")).collect();
            assert_eq!(keys.len(), docs.len(), "{table:?}: keys are unique");
        }
    }

    #[test]
    fn documents_match_dbgen() {
        // dbgen's first lineitem at every scale factor (the `tpchgen` docs quote it):
        // 1|155190|7706|1|17|21168.23|0.04|0.02|N|O|1996-03-13|... at SF 1.
        let mut out = Vec::new();
        write_table(Table::LineItem, 1.0, &mut LimitedWriter { inner: &mut out, lines: 1 }).ok();
        let first = String::from_utf8(out).expect("UTF-8");
        assert!(first.starts_with(r#"{"key":"1-1","value":{"l_orderkey":1,"l_partkey":155190,"l_suppkey":7706,"l_linenumber":1,"l_quantity":17,"l_extendedprice":21168.23,"l_discount":0.04,"l_tax":0.02,"l_returnflag":"N","l_linestatus":"O","l_shipdate":"1996-03-13""#), "{first}");

        let orders = lines(Table::Orders, TINY_SF);
        let first = &orders[0]["value"];
        assert_eq!(orders[0]["key"], "1");
        assert!(first["o_orderdate"].as_str().is_some_and(|d| d.len() == 10 && d.as_bytes()[4] == b'-'), "{first}");
        let partsupp = lines(Table::PartSupp, KEYED_SF);
        let v = &partsupp[0]["value"];
        assert_eq!(partsupp[0]["key"], format!("{}-{}", v["ps_partkey"], v["ps_suppkey"]));
    }

    /// Stops the lineitem generator after `lines` lines: SF 1's first row without writing
    /// SF 1's six million.
    struct LimitedWriter<'a> {
        inner: &'a mut Vec<u8>,
        lines: usize,
    }

    impl Write for LimitedWriter<'_> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.lines == 0 {
                return Err(std::io::Error::other("enough lines"));
            }
            self.lines -= buf.iter().filter(|b| **b == b'\n').count();
            self.inner.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
}
