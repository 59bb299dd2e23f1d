//! x86-64 kernels: AVX2 for quantize/dequantize, AVX-512 VNNI for the integer GEMV.
//!
//! Every kernel is a `#[target_feature]` function, unsafe to call where the feature may be
//! missing. The tokens here ([`Avx2`]) can only be made after run-time detection confirmed the
//! features, and their methods are the one place those calls happen: holding a token is the proof
//! that makes each call sound.

pub(crate) mod avx2;
pub(crate) mod avx512;

use crate::format::{BLOCK, ElemFormat, Rounding, ScaleRule};
use crate::gemv::{IntMap, Q8Activations, TILE_ROWS};

/// Proof that this CPU has AVX2, FMA and F16C.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx2(());

impl Avx2 {
    /// The token, if the CPU has the features.
    pub(crate) fn new() -> Option<Avx2> {
        crate::Isa::Avx2.is_available().then_some(Avx2(()))
    }

    pub(crate) fn quantize_block(
        self,
        format: ElemFormat,
        rounding: Rounding,
        rule: ScaleRule,
        block: &[f32; BLOCK],
    ) -> (u8, [u8; BLOCK]) {
        // SAFETY: an `Avx2` token exists only when AVX2, FMA and F16C were detected.
        unsafe { avx2::quantize_block(format, rounding, rule, block) }
    }

    pub(crate) fn dequantize_block(
        self,
        format: ElemFormat,
        scale: u8,
        codes: &[u8; BLOCK],
        out: &mut [f32; BLOCK],
    ) {
        // SAFETY: an `Avx2` token exists only when AVX2, FMA and F16C were detected.
        unsafe { avx2::dequantize_block(format, scale, codes, out) }
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
        // SAFETY: an `Avx2` token exists only when AVX2, FMA and F16C were detected.
        unsafe { avx2::q8_tile(format, map, codes, scales, xs, acc) }
    }

    pub(crate) fn f32_tile(
        self,
        format: ElemFormat,
        codes: &[u8],
        scales: &[u8],
        xs: &[&[f32]],
        acc: &mut [[f32; TILE_ROWS]],
    ) {
        // SAFETY: an `Avx2` token exists only when AVX2, FMA and F16C were detected.
        unsafe { avx2::f32_tile(format, codes, scales, xs, acc) }
    }
}

/// Proof that this CPU has AVX-512 F/BW/VL/VNNI/VBMI on top of AVX2.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx512 {
    pub(crate) avx2: Avx2,
}

impl Avx512 {
    /// The token, if the CPU has the features.
    pub(crate) fn new() -> Option<Avx512> {
        let avx2 = Avx2::new()?;
        crate::Isa::Avx512.is_available().then_some(Avx512 { avx2 })
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
        // SAFETY: an `Avx512` token exists only when every feature of `avx512::q8_tile` was
        // detected (`Isa::Avx512` checks AVX-512 F/BW/VL/VNNI/VBMI and AVX2/FMA).
        unsafe { avx512::q8_tile(format, map, codes, scales, xs, acc) }
    }

    pub(crate) fn f32_tile(
        self,
        format: ElemFormat,
        codes: &[u8],
        scales: &[u8],
        xs: &[&[f32]],
        acc: &mut [[f32; TILE_ROWS]],
    ) {
        // SAFETY: as for `q8_tile`: the token proves every feature `avx512::f32_tile` uses.
        unsafe { avx512::f32_tile(format, codes, scales, xs, acc) }
    }
}
