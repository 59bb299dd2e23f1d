//! WGSL for GPUs: the dequant-GEMV shader and the host-side pieces to feed it.
//!
//! This module holds text and byte layouts only (no GPU API), so the crate stays free of
//! hardware dependencies; whoever owns a `wgpu::Device` builds the pipeline with
//! [`GEMV_SOURCE`], the entry point [`GEMV_ENTRY`] and [`override_constants`], and binds:
//! 0 the codes in the linear layout as `array<u32>` ([`words`]), 1 the scales row-major as
//! `array<u32>` ([`words`] again), 2 `x: array<f32>`, 3 `y: array<f32>` (read-write), 4 a uniform
//! `{ rows: u32, cols: u32 }`. Dispatch [`dispatch_size`] workgroups.
//!
//! Limits: `rows * cols * bits` must fit in 32 bits (checked by [`check_shape`]); an E8M0 scale of
//! 0 (2^-127) is an f32 subnormal, which GPUs may flush to zero.

use crate::Error;
use crate::format::{BLOCK, ElemFormat};

/// The dequant-GEMV shader.
pub const GEMV_SOURCE: &str = include_str!("shaders/gemv.wgsl");
/// Its entry point.
pub const GEMV_ENTRY: &str = "gemv";
/// Invocations per workgroup (one workgroup per row).
pub const GEMV_WORKGROUP: u32 = 64;

/// The pipeline-overridable constants that select `format` in [`GEMV_SOURCE`].
pub fn override_constants(format: ElemFormat) -> [(&'static str, f64); 4] {
    let kind = match format {
        ElemFormat::Fp8E4M3 => 1.0,
        ElemFormat::Fp8E5M2 => 2.0,
        ElemFormat::Int8 => 3.0,
        _ => 0.0,
    };
    [
        ("ELEM_BITS", f64::from(format.bits())),
        ("MANT_BITS", f64::from(format.mant_bits())),
        ("EXP_BIAS", f64::from(format.exp_bias())),
        ("KIND", kind),
    ]
}

/// Bytes as little-endian `u32` words, zero-padded to a whole word (for storage buffers).
pub fn words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(w)
        })
        .collect()
}

/// Checks that a `rows x cols` matrix of `format` is addressable by the shader.
pub fn check_shape(format: ElemFormat, rows: usize, cols: usize) -> Result<(), Error> {
    if !cols.is_multiple_of(BLOCK) {
        return Err(Error::NotBlockMultiple { len: cols });
    }
    let bits = rows
        .checked_mul(cols)
        .and_then(|n| n.checked_mul(format.bits() as usize))
        .ok_or(Error::TooLarge)?;
    if bits > u32::MAX as usize || rows > 65535 * 65535 {
        return Err(Error::TooLarge);
    }
    Ok(())
}

/// Workgroups to dispatch for `rows` rows: `(x, y, 1)` with rows past 65535 in `y`.
pub fn dispatch_size(rows: u32) -> (u32, u32, u32) {
    (rows.min(65535), rows.div_ceil(65535), 1)
}
