//! The analytics shadow's document parser never panics, and for any document Shoal would
//! store, the columns it builds equal those built from a parsed `serde_json::Value` under
//! the inferred schema (the operational path's conversion).
#![no_main]
use libfuzzer_sys::fuzz_target;
use shoal_query::convert::to_batch;
use shoal_query::rows::{ColumnBuffer, ParsedDoc};
use shoal_query::schema::Obj;

fuzz_target!(|data: &[u8]| {
    let doc = ParsedDoc::parse(data);
    if shoal_json::validate(data).is_err() {
        return;
    }
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else { return };
    let mut buf = ColumnBuffer::default();
    buf.push("k".to_string(), doc);
    let mut obj = Obj::default();
    if let serde_json::Value::Object(m) = &value {
        obj.observe(m, 0);
    }
    let want = to_batch(&obj.table_schema(), None, &[("k".to_string(), value)]).expect("to_batch");
    assert_eq!(buf.batch().expect("batch"), want);
});
