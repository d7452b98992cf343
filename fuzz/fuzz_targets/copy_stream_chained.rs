//! A group of index partitions' copies arrives from another node as copies chained in one
//! stream (`FrameDecoder::chained`): decoding it in any chunking never panics, never yields
//! a record over the limit, never reads a second copy before its first has ended, and a
//! group it accepts whole re-encodes, copy by copy, to the same records.
#![no_main]
use libfuzzer_sys::fuzz_target;
use shoal_storage::copy_stream::{Frame, FrameDecoder, COPY_RECORD_MAX_BYTES};

mod common;

fuzz_target!(|data: &[u8]| {
    let Some((&chunk, data)) = data.split_first() else { return };
    let mut decoder = FrameDecoder::chained();
    // Each copy's frames, in order.
    let mut copies: Vec<Vec<Frame>> = vec![Vec::new()];
    let step = usize::from(chunk).max(1);
    for at in (0..data.len()).step_by(step) {
        decoder.push(&data[at..(at + step).min(data.len())]);
        loop {
            match decoder.next_frame() {
                Ok(Some(Frame::End)) => {
                    if let Some(copy) = copies.last_mut() {
                        copy.push(Frame::End);
                    }
                    // The next copy, if any bytes follow; the decoder must say a copy ended.
                    assert!(decoder.next_copy().is_ok(), "an end without its copy's end");
                    copies.push(Vec::new());
                }
                Ok(Some(frame)) => {
                    if let Frame::Record(k, v) = &frame {
                        assert!(k.len() + v.len() <= COPY_RECORD_MAX_BYTES);
                    }
                    if let Some(copy) = copies.last_mut() {
                        copy.push(frame);
                    }
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
    // Whole only if it stopped right after a copy's end (the last, empty, group opened).
    if copies.last().is_some_and(|c| !c.is_empty()) {
        return;
    }
    copies.pop();
    for frames in copies {
        assert!(matches!(frames.first(), Some(Frame::Header(_))), "a copy begins with its header");
        assert!(matches!(frames.last(), Some(Frame::End)), "a copy ends with its end");
        common::assert_re_encodes(&frames);
    }
});
