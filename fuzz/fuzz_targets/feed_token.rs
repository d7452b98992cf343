//! Change-feed tokens from clients are untrusted: parsing never panics, and what parses
//! round-trips.
#![no_main]
use libfuzzer_sys::fuzz_target;
use shoal_storage::changes::FeedPosition;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    for partitions in [1u16, 128, 4096] {
        if let Ok(pos) = FeedPosition::from_token(text, partitions) {
            assert_eq!(FeedPosition::from_token(&pos.to_token(), partitions).ok(), Some(pos));
        }
    }
});
