//! Sub-document paths from clients are untrusted: parsing never panics, and what parses
//! prints back to a path that parses to the same thing.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(path) = shoal_json::path::parse(text) {
        assert_eq!(shoal_json::path::parse(&path.to_string()), Ok(path));
    }
});
