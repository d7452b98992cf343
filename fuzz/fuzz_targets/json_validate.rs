//! The document validator never panics, and agrees with serde_json on UTF-8 input of
//! modest depth.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let ours = shoal_json::validate(data).is_ok();
    if ours {
        assert!(serde_json::from_slice::<serde_json::Value>(data).is_ok() || data.len() > 1 << 20);
    }
});
