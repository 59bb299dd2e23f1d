//! Saved calibration statistics (`pipeline quantize --hessians`) from untrusted bytes, under the
//! key the seeds carry and under another. Any outcome but a panic, an abort or a hang is fine.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pipeline::quantize::Calibration;

fuzz_target!(|data: &[u8]| {
    for key in ["fuzz", "other"] {
        if let Ok(Some(cal)) = Calibration::from_bytes("fuzz.bin", data, key) {
            let _ = cal.hessian("blk.0.attn_q");
        }
    }
});
