//! A `.npy` of the vision tower's input from untrusted bytes (a 16x16 tower).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = pipeline::npy::parse_pixels_npy(data, 16);
});
