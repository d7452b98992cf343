//! What the copy stream's fuzz targets share: a module of each, not a target (`fuzz/run.sh`
//! builds only the files directly in `fuzz_targets/`).
use bytes::BytesMut;
use shoal_storage::copy_stream::{Frame, FrameDecoder, FrameEncoder, COPY_RECORD_MAX_BYTES};

/// Checks that `frames`, one copy as a decoder accepted it whole, hold no record over the
/// limit and re-encode to the same frames. JSON headers may be re-spelled (whitespace, key
/// order); the records never are.
pub fn assert_re_encodes(frames: &[Frame]) {
    let mut out = BytesMut::new();
    let mut encoder = FrameEncoder::default();
    for frame in frames {
        match frame {
            Frame::Header(h) => FrameEncoder::header(&mut out, h),
            Frame::Record(k, v) => {
                assert!(k.len() + v.len() <= COPY_RECORD_MAX_BYTES);
                encoder.record(&mut out, k, v);
            }
            Frame::End => encoder.end(&mut out),
        }
    }
    let mut again = FrameDecoder::default();
    again.push(&out);
    let mut frames_again = Vec::new();
    while let Ok(Some(f)) = again.next_frame() {
        frames_again.push(f);
    }
    assert_eq!(frames, frames_again.as_slice());
}
