//! WGSL for GPUs: the dequant-GEMV shader, the decoding functions for kernels of your own, and
//! the host-side pieces to feed them.
//!
//! This module holds text and byte layouts only (no GPU API), so the crate stays free of
//! hardware dependencies; whoever owns a `wgpu::Device` builds the pipeline with
//! [`GEMV_SOURCE`], the entry point [`GEMV_ENTRY`] and [`override_constants`], and binds:
//! 0 the codes in the linear layout as `array<u32>` ([`words`]), 1 the scales row-major as
//! `array<u32>` ([`words`] again), 2 `x: array<f32>`, 3 `y: array<f32>` (read-write), 4 a uniform
//! `{ rows: u32, cols: u32 }`. Dispatch [`dispatch_size`] workgroups.
//!
//! To dequantize inside a kernel of your own (a GEMM reading MX weights, say), append
//! [`DECODE_SOURCE`] to your module, declare the format with [`decode_constants`] (or as
//! pipeline overrides named as in [`override_constants`]), and declare two storage bindings
//! `mx_codes: array<u32>` and `mx_scales: array<u32>` ([`code_words`] of the packed codes,
//! [`words`] of the scales). It provides `mx_decode`, `mx_code_at`, `mx_scale_at`, and for four
//! consecutive elements `mx_load4` (the loads) with `mx_unpack4` (the decoding), or both at once
//! as `mx_vec4`.
//!
//! Limits: `rows * cols * bits` must fit in 32 bits (checked by [`check_shape`]); an E8M0 scale of
//! 0 (2^-127) is an f32 subnormal, which GPUs may flush to zero.

use crate::Error;
use crate::format::{BLOCK, ElemFormat};

/// The dequant-GEMV shader (its kernel, then [`DECODE_SOURCE`]).
pub const GEMV_SOURCE: &str = concat!(
    include_str!("shaders/gemv.wgsl"),
    "\n",
    include_str!("shaders/mx_decode.wgsl")
);

/// The decoding functions alone, for kernels of your own (see the module notes).
pub const DECODE_SOURCE: &str = include_str!("shaders/mx_decode.wgsl");
/// Its entry point.
pub const GEMV_ENTRY: &str = "gemv";
/// Invocations per workgroup (one workgroup per row).
pub const GEMV_WORKGROUP: u32 = 64;

/// The kind code [`DECODE_SOURCE`] switches on.
fn kind(format: ElemFormat) -> u32 {
    match format {
        ElemFormat::Fp8E4M3 => 1,
        ElemFormat::Fp8E5M2 => 2,
        ElemFormat::Int8 => 3,
        _ => 0,
    }
}

/// The pipeline-overridable constants that select `format` in [`GEMV_SOURCE`].
pub fn override_constants(format: ElemFormat) -> [(&'static str, f64); 4] {
    [
        ("MX_ELEM_BITS", f64::from(format.bits())),
        ("MX_MANT_BITS", f64::from(format.mant_bits())),
        ("MX_EXP_BIAS", f64::from(format.exp_bias())),
        ("MX_KIND", f64::from(kind(format))),
    ]
}

/// `format` as WGSL constant declarations, for modules that include [`DECODE_SOURCE`] and fix
/// their format in the source rather than with pipeline overrides.
pub fn decode_constants(format: ElemFormat) -> String {
    format!(
        "const MX_ELEM_BITS: u32 = {}u;\nconst MX_MANT_BITS: u32 = {}u;\n\
         const MX_EXP_BIAS: i32 = {};\nconst MX_KIND: u32 = {}u;\n",
        format.bits(),
        format.mant_bits(),
        format.exp_bias(),
        kind(format)
    )
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

/// Codes as [`words`] plus one spare zero word: the layout `mx_load4` and `mx_vec4` of
/// [`DECODE_SOURCE`] read (they fetch the word after an element's whether or not it is needed).
pub fn code_words(bytes: &[u8]) -> Vec<u32> {
    let mut w = words(bytes);
    w.push(0);
    w
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
