//! A Y4M stream from untrusted bytes: the header, then up to four frames.
#![no_main]

use isp_v4l2::{FrameSource, Pacing, Y4mSource};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(mut source) = Y4mSource::new(std::io::Cursor::new(data.to_vec()), Pacing::AsFastAsPossible)
    else {
        return;
    };
    for _ in 0..4 {
        match source.next_frame() {
            Ok(Some(_)) => {}
            _ => break,
        }
    }
});
