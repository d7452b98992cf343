//! An index's `where` comes from clients: parsing never panics, and what parses evaluates
//! without panicking on a few documents.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(filter) = shoal_index::filter::Filter::parse(text) {
        for doc in [serde_json::json!({}), serde_json::json!({"a": 1, "b": "x", "c": [1, {"d": null}]}), serde_json::json!(null)] {
            let _ = filter.matches(&doc);
        }
    }
});
