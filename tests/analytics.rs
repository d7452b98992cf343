//! Seed 004's query 3 over TPC-DS-shaped documents, checked against an independent
//! computation from the generated files — with one collection per table, and with all
//! tables in one collection told apart by `table_name`, as in the seed.

mod common;

use std::collections::HashMap;

use common::Node;
use serde_json::{json, Value};

fn read_rows(path: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str::<Value>(l).unwrap()["value"].clone()).collect()
}

/// Query 3 computed here from the rows: (year, brand_id, brand, sum), in the query's order.
fn expected_q3(dates: &[Value], items: &[Value], sales: &[Value], manufact: i64) -> Vec<(i64, i64, String, f64)> {
    let date: HashMap<i64, (i64, i64)> =
        dates.iter().map(|d| (d["d_date_sk"].as_i64().unwrap(), (d["d_year"].as_i64().unwrap(), d["d_moy"].as_i64().unwrap()))).collect();
    let item: HashMap<i64, &Value> = items.iter().map(|i| (i["i_item_sk"].as_i64().unwrap(), i)).collect();
    let mut groups: HashMap<(i64, String, i64), f64> = HashMap::new();
    for s in sales {
        let (Some(d), Some(i)) = (s["ss_sold_date_sk"].as_i64(), s["ss_item_sk"].as_i64()) else { continue };
        let (Some(&(year, moy)), Some(it)) = (date.get(&d), item.get(&i)) else { continue };
        if moy != 11 || it["i_manufact_id"].as_i64() != Some(manufact) {
            continue;
        }
        let key = (year, it["i_brand"].as_str().unwrap().to_string(), it["i_brand_id"].as_i64().unwrap());
        *groups.entry(key).or_default() += s["ss_ext_sales_price"].as_f64().unwrap();
    }
    let mut rows: Vec<(i64, i64, String, f64)> = groups.into_iter().map(|((y, b, id), sum)| (y, id, b, sum)).collect();
    rows.sort_by(|a, b| a.0.cmp(&b.0).then(b.3.total_cmp(&a.3)).then(a.1.cmp(&b.1)));
    rows.truncate(100);
    rows
}

fn check(answer: &Value, expected: &[(i64, i64, String, f64)]) {
    let rows = answer["rows"].as_array().unwrap();
    assert_eq!(rows.len(), expected.len(), "{answer}");
    for (got, want) in rows.iter().zip(expected) {
        assert_eq!(got[0].as_i64(), Some(want.0), "{got}");
        assert_eq!(got[1].as_i64(), Some(want.1), "{got}");
        assert_eq!(got[2].as_str(), Some(want.2.as_str()), "{got}");
        let sum = got[3].as_f64().unwrap();
        assert!((sum - want.3).abs() <= 1e-6 * want.3.abs().max(1.0), "{got} vs {}", want.3);
    }
}

#[tokio::test]
async fn query_3_matches_an_independent_computation() {
    let node = Node::start(&["--partitions", "8"]);
    let dir = node.dir.parent().unwrap().join("tpcds");
    let (ok, out, err) = node.cli(&["bench", "tpcds-gen", "--sf", "0.005", "--out", dir.to_str().unwrap()]);
    assert!(ok, "{out} {err}");
    let tables = ["date_dim", "item", "store_sales"];
    for t in tables {
        let (ok, _, err) = node.cli(&["collection", "create", t]);
        assert!(ok, "{err}");
        let (ok, out, err) = node.cli(&["load", t, dir.join(format!("{t}.ndjson")).to_str().unwrap()]);
        assert!(ok, "{out} {err}");
    }
    let (dates, items, sales) =
        (read_rows(&dir.join("date_dim.ndjson")), read_rows(&dir.join("item.ndjson")), read_rows(&dir.join("store_sales.ndjson")));
    // The manufacturer with the most items, so the answer is not empty at this scale.
    let mut counts: HashMap<i64, usize> = HashMap::new();
    for i in &items {
        *counts.entry(i["i_manufact_id"].as_i64().unwrap()).or_default() += 1;
    }
    let manufact = counts.iter().max_by_key(|(m, n)| (**n, -**m)).map(|(m, _)| *m).unwrap();
    let expected = expected_q3(&dates, &items, &sales, manufact);
    assert!(!expected.is_empty(), "the data set has sales of manufacturer {manufact} in November");
    let q3 = shoal_q3().replace("i_manufact_id = 128", &format!("i_manufact_id = {manufact}"));
    let c = node.client();
    let ask = |sql: String| {
        let c = c.clone();
        let url = node.u("/v1/query");
        async move {
            let r = c.post(url).body(json!({"sql": sql}).to_string()).send().await.unwrap();
            assert!(r.status().is_success(), "{}", r.text().await.unwrap());
            r.json::<Value>().await.unwrap()
        }
    };
    check(&ask(q3.clone()).await, &expected);

    // All tables in one collection, told apart by table_name (the seed's datasets).
    let c2 = node.client();
    c2.put(node.u("/v1/collections/tpcds")).send().await.unwrap();
    for t in tables {
        let (ok, out, err) = node.cli(&["load", "tpcds", dir.join(format!("{t}.ndjson")).to_str().unwrap()]);
        assert!(ok, "{out} {err}");
    }
    let one = q3
        .replace("FROM date_dim dt,", "FROM (SELECT * FROM tpcds WHERE table_name = 'date_dim') dt,")
        .replace("store_sales ss,", "(SELECT * FROM tpcds WHERE table_name = 'store_sales') ss,")
        .replace("     item\n", "     (SELECT * FROM tpcds WHERE table_name = 'item') item\n");
    assert_ne!(one, q3);
    check(&ask(one).await, &expected);
}

/// Query 3 exactly as seed 004 prints it; `shoal bench analytics` runs the same file.
fn shoal_q3() -> String {
    include_str!("../bench/tpcds_q3.sql").trim().to_string()
}
