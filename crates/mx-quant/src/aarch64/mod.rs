//! aarch64 kernels: NEON (baseline on every aarch64 Linux target) for block quantize/dequantize
//! and the int8-activation GEMV tile.
//!
//! NEON is part of the aarch64 baseline, but the kernels are still `#[target_feature]`
//! functions so one code shape serves every ISA; the [`Neon`] token is created after run-time
//! detection, and its methods are the one place those functions are called.

pub(crate) mod neon;

use crate::format::{BLOCK, ElemFormat, Rounding, ScaleRule};
use crate::gemv::{IntMap, Q8Activations, TILE_ROWS};

/// Proof that this CPU has NEON (Advanced SIMD).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Neon(());

impl Neon {
    /// The token, if the CPU has NEON.
    pub(crate) fn new() -> Option<Neon> {
        crate::Isa::Neon.is_available().then_some(Neon(()))
    }

    pub(crate) fn quantize_block(
        self,
        format: ElemFormat,
        rounding: Rounding,
        rule: ScaleRule,
        block: &[f32; BLOCK],
    ) -> (u8, [u8; BLOCK]) {
        // SAFETY: a `Neon` token exists only when NEON was detected.
        unsafe { neon::quantize_block(format, rounding, rule, block) }
    }

    pub(crate) fn dequantize_block(
        self,
        format: ElemFormat,
        scale: u8,
        codes: &[u8; BLOCK],
        out: &mut [f32; BLOCK],
    ) {
        // SAFETY: a `Neon` token exists only when NEON was detected.
        unsafe { neon::dequantize_block(format, scale, codes, out) }
    }

    pub(crate) fn q8_tile(
        self,
        format: ElemFormat,
        map: &IntMap,
        codes: &[u8],
        scales: &[u8],
        xs: &[&Q8Activations],
        acc: &mut [[f32; TILE_ROWS]],
    ) {
        // SAFETY: a `Neon` token exists only when NEON was detected.
        unsafe { neon::q8_tile(format, map, codes, scales, xs, acc) }
    }
}
