//! A member's request for another's rows of a small table (`shadow-rows`) arrives from the
//! network: decoding it — the message, its columns, its filters as DataFusion's protobuf —
//! never panics, and what decodes is either refused as the caller's error or accepted.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match shoal_query::gather::parse(data) {
        Ok(_) | Err(shoal_query::QueryError::Invalid(_)) => {}
        Err(e) => panic!("a malformed request is the caller's error, not {e:?}"),
    }
});
