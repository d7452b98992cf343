//! A deterministic generator of TPC-DS-shaped rows for the three tables of query 3
//! (`date_dim`, `item`, `store_sales`), one JSON document per row with a `table_name`
//! field, as in seed 004. Not the official `dsdgen`: the shapes, key ranges and sizes
//! follow the specification at scale factor 1 (73,049 dates, 18,000 items with
//! `i_manufact_id` uniform in 1..=1000, about 2.88 million sales); the values come from
//! a seeded generator, so every run produces the same rows.

use serde_json::{json, Value};

/// Rows of `date_dim` (fixed: 1900-01-02 to 2100-01-01).
pub const DATE_ROWS: u64 = 73_049;
/// First `d_date_sk` (1900-01-02).
pub const DATE_SK_FIRST: i64 = 2_415_022;
/// Items at scale factor 1.
pub const ITEM_ROWS_SF1: f64 = 18_000.0;
/// Store sales rows at scale factor 1.
pub const SALES_ROWS_SF1: f64 = 2_880_404.0;
/// Sales fall on dates 1998-01-02 ..= 2003-01-02, as in TPC-DS.
const SALES_DATE_SK: (i64, i64) = (2_450_816, 2_452_642);

/// SplitMix64: small, fast, and stable across versions (a seeded `rand` generator is not
/// guaranteed to be), which is what a reproducible data set needs.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: i64, hi: i64) -> i64 {
        lo + (self.next() % (hi - lo + 1) as u64) as i64
    }
}

/// Year, month, day of a day count from 1970-01-01 (Howard Hinnant's `civil_from_days`).
pub(crate) fn civil(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

const DAY_NAMES: [&str; 7] = ["Thursday", "Friday", "Saturday", "Sunday", "Monday", "Tuesday", "Wednesday"];
const CATEGORIES: [&str; 10] = ["Books", "Children", "Electronics", "Home", "Jewelry", "Men", "Music", "Shoes", "Sports", "Women"];

/// Row `i` of `date_dim`.
pub fn date_row(i: u64) -> (String, Value) {
    let sk = DATE_SK_FIRST + i as i64;
    // 1900-01-02 is day -25566 from 1970-01-01.
    let days = -25_566 + i as i64;
    let (y, m, d) = civil(days);
    let key = format!("date_dim_{i:08}");
    let doc = json!({
        "table_name": "date_dim",
        "d_date_sk": sk,
        "d_date_id": format!("AAAAAAAA{sk:08X}"),
        "d_date": format!("{y:04}-{m:02}-{d:02}"),
        "d_year": y,
        "d_moy": m,
        "d_dom": d,
        "d_qoy": (m - 1) / 3 + 1,
        "d_dow": days.rem_euclid(7),
        "d_day_name": DAY_NAMES[days.rem_euclid(7) as usize],
    });
    (key, doc)
}

pub fn item_rows(sf: f64) -> u64 {
    ((ITEM_ROWS_SF1 * sf).round() as u64).max(1)
}

pub fn sales_rows(sf: f64) -> u64 {
    ((SALES_ROWS_SF1 * sf).round() as u64).max(1)
}

/// Row `i` (0-based) of `item`.
pub fn item_row(i: u64) -> (String, Value) {
    let mut r = Rng::new(0x17E4 ^ i.wrapping_mul(0x9E37_79B9));
    let sk = i as i64 + 1;
    let manufact = r.range(1, 1000);
    let brand_id = 1_001_001 + r.range(0, 9) * 1_000_000 + r.range(0, 15) * 1000 + r.range(1, 16);
    let doc = json!({
        "table_name": "item",
        "i_item_sk": sk,
        "i_item_id": format!("AAAAAAAA{sk:08X}"),
        "i_brand_id": brand_id,
        "i_brand": format!("brand #{brand_id}"),
        "i_manufact_id": manufact,
        "i_manufact": format!("manufact #{manufact}"),
        "i_category": CATEGORIES[r.range(0, 9) as usize],
        "i_current_price": r.range(9, 9999) as f64 / 100.0,
    });
    (format!("item_{i:08}"), doc)
}

/// Row `i` (0-based) of `store_sales` for a data set with `items` items.
pub fn sales_row(i: u64, items: u64) -> (String, Value) {
    let mut r = Rng::new(0x5A1E ^ i.wrapping_mul(0xD1B5_4A32_D192_ED03));
    // About 4.5 % of TPC-DS store sales have no date.
    let date: Value = if r.range(0, 999) < 45 { Value::Null } else { r.range(SALES_DATE_SK.0, SALES_DATE_SK.1).into() };
    let quantity = r.range(1, 100);
    let cents = r.range(1, 20_000);
    let doc = json!({
        "table_name": "store_sales",
        "ss_sold_date_sk": date,
        "ss_item_sk": r.range(1, items.max(1) as i64),
        "ss_customer_sk": r.range(1, 100_000),
        "ss_store_sk": r.range(1, 12),
        "ss_ticket_number": i / 12 + 1,
        "ss_quantity": quantity,
        "ss_sales_price": cents as f64 / 100.0,
        "ss_ext_sales_price": (quantity * cents) as f64 / 100.0,
    });
    (format!("store_sales_{i:08}"), doc)
}

/// Query 3 as seed 004 prints it (N1QL for Analytics and DataFusion agree on this text).
pub const QUERY_3: &str = include_str!("../../bench/tpcds_q3.sql");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_the_calendar() {
        assert_eq!(date_row(0).1["d_date"], "1900-01-02");
        assert_eq!(date_row(0).1["d_day_name"], "Tuesday");
        assert_eq!(date_row(DATE_ROWS - 1).1["d_date"], "2100-01-01");
        let sales_start = (SALES_DATE_SK.0 - DATE_SK_FIRST) as u64;
        assert_eq!(date_row(sales_start).1["d_date"], "1998-01-02");
        assert_eq!(date_row(sales_start).1["d_year"], 1998);
    }

    #[test]
    fn rows_are_deterministic_and_in_range() {
        assert_eq!(item_row(5), item_row(5));
        assert_eq!(sales_row(77, 18_000), sales_row(77, 18_000));
        let ids: Vec<i64> = (0..18_000).map(|i| item_row(i).1["i_manufact_id"].as_i64().unwrap()).collect();
        assert!(ids.iter().all(|m| (1..=1000).contains(m)));
        assert!(ids.iter().filter(|&&m| m == 128).count() > 5, "manufacturer 128 has items at SF 1");
        assert_eq!(sales_rows(1.0), 2_880_404);
    }
}
