//! A partition's copy arrives from another node: decoding it in any chunking never panics,
//! never yields a record over the limit, and a stream it accepts whole re-encodes to the
//! same bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use shoal_storage::copy_stream::FrameDecoder;

mod common;

fuzz_target!(|data: &[u8]| {
    let Some((&chunk, data)) = data.split_first() else { return };
    let mut decoder = FrameDecoder::default();
    let mut frames = Vec::new();
    // Both ways in: copied (`push`), and kept as it came (`push_bytes` of a slice of one
    // shared buffer, whose records are then slices of it too).
    let shared = bytes::Bytes::copy_from_slice(data);
    let step = usize::from(chunk).max(1);
    for (i, at) in (0..data.len()).step_by(step).enumerate() {
        let end = (at + step).min(data.len());
        if i % 2 == 0 {
            decoder.push(&data[at..end]);
        } else {
            decoder.push_bytes(shared.slice(at..end));
        }
        loop {
            match decoder.next_frame() {
                Ok(Some(frame)) => frames.push(frame),
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
    if decoder.finish().is_err() {
        return;
    }
    common::assert_re_encodes(&frames);
});
