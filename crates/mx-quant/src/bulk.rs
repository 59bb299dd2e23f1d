//! Quantize and dequantize whole slices in the linear layout, with the best kernels this CPU has.
//!
//! Slices must hold whole blocks: a length that is not a multiple of 32 is
//! [`Error::NotBlockMultiple`], never a silent truncation. To quantize a ragged tensor, pad it with
//! [`pad_to_block`] (zeros do not change a block's scale). Results agree bit for bit with
//! [`crate::reference`] whichever [`Isa`] runs; [`ScaleRule::MseSearch`] always runs the scalar
//! reference (it is a load-time tool, three trial quantizations per block).

use crate::Error;
use crate::format::{BLOCK, ElemFormat, QuantOptions, ScaleRule};
use crate::isa::Isa;
use crate::layout::{check_block_multiple, check_len, pack_block, packed_len, unpack_block};
use crate::reference;

/// Quantizes `input` into `scales` (one per block) and `packed` (linear layout), with the
/// detected [`Isa`].
///
/// # Errors
/// [`Error::NotBlockMultiple`] when `input.len() % 32 != 0`; [`Error::LengthMismatch`] when
/// `scales` or `packed` is not exactly the size the input needs.
pub fn quantize(
    format: ElemFormat,
    options: QuantOptions,
    input: &[f32],
    scales: &mut [u8],
    packed: &mut [u8],
) -> Result<(), Error> {
    quantize_with_isa(Isa::detect(), format, options, input, scales, packed)
}

/// [`quantize`] on an explicit instruction set (which must be available).
pub fn quantize_with_isa(
    isa: Isa,
    format: ElemFormat,
    options: QuantOptions,
    input: &[f32],
    scales: &mut [u8],
    packed: &mut [u8],
) -> Result<(), Error> {
    check_block_multiple(input.len())?;
    let blocks = input.len() / BLOCK;
    check_len("scales", blocks, scales.len())?;
    check_len(
        "packed codes",
        packed_len(format, input.len()),
        packed.len(),
    )?;
    let kernels = Kernels::new(isa)?;
    let packed_block = packed_len(format, BLOCK);
    for ((chunk, scale), out) in input
        .chunks_exact(BLOCK)
        .zip(scales.iter_mut())
        .zip(packed.chunks_exact_mut(packed_block))
    {
        let block: &[f32; BLOCK] = chunk.try_into().expect("chunks_exact yields whole blocks");
        let (s, codes) = kernels.quantize_block(format, options, block);
        *scale = s;
        pack_block(format, &codes, out);
    }
    Ok(())
}

/// Dequantizes `scales` and `packed` (linear layout) into `out`, with the detected [`Isa`].
///
/// # Errors
/// [`Error::NotBlockMultiple`] when `out.len() % 32 != 0`; [`Error::LengthMismatch`] when
/// `scales` or `packed` does not match `out`.
pub fn dequantize(
    format: ElemFormat,
    scales: &[u8],
    packed: &[u8],
    out: &mut [f32],
) -> Result<(), Error> {
    dequantize_with_isa(Isa::detect(), format, scales, packed, out)
}

/// [`dequantize`] on an explicit instruction set (which must be available).
pub fn dequantize_with_isa(
    isa: Isa,
    format: ElemFormat,
    scales: &[u8],
    packed: &[u8],
    out: &mut [f32],
) -> Result<(), Error> {
    check_block_multiple(out.len())?;
    check_len("scales", out.len() / BLOCK, scales.len())?;
    check_len("packed codes", packed_len(format, out.len()), packed.len())?;
    let kernels = Kernels::new(isa)?;
    let packed_block = packed_len(format, BLOCK);
    for ((chunk, &scale), bytes) in out
        .chunks_exact_mut(BLOCK)
        .zip(scales)
        .zip(packed.chunks_exact(packed_block))
    {
        let block: &mut [f32; BLOCK] = chunk.try_into().expect("chunks_exact yields whole blocks");
        let codes = unpack_block(format, bytes);
        kernels.dequantize_block(format, scale, &codes, block);
    }
    Ok(())
}

/// [`dequantize`] into IEEE half precision (round to nearest even from the exact f32 values).
pub fn dequantize_f16(
    format: ElemFormat,
    scales: &[u8],
    packed: &[u8],
    out: &mut [half::f16],
) -> Result<(), Error> {
    dequantize_converted(format, scales, packed, out, |src, dst: &mut [half::f16]| {
        use half::slice::HalfFloatSliceExt;
        dst.convert_from_f32_slice(src)
    })
}

/// [`dequantize`] into bfloat16 (round to nearest even from the exact f32 values).
pub fn dequantize_bf16(
    format: ElemFormat,
    scales: &[u8],
    packed: &[u8],
    out: &mut [half::bf16],
) -> Result<(), Error> {
    dequantize_converted(
        format,
        scales,
        packed,
        out,
        |src, dst: &mut [half::bf16]| {
            use half::slice::HalfFloatSliceExt;
            dst.convert_from_f32_slice(src)
        },
    )
}

/// Dequantizes block by block through an L1-resident f32 block, converting each into `out`.
fn dequantize_converted<T>(
    format: ElemFormat,
    scales: &[u8],
    packed: &[u8],
    out: &mut [T],
    convert: impl Fn(&[f32], &mut [T]),
) -> Result<(), Error> {
    check_block_multiple(out.len())?;
    check_len("scales", out.len() / BLOCK, scales.len())?;
    check_len("packed codes", packed_len(format, out.len()), packed.len())?;
    let kernels = Kernels::new(Isa::detect())?;
    let packed_block = packed_len(format, BLOCK);
    let mut block = [0f32; BLOCK];
    for ((chunk, &scale), bytes) in out
        .chunks_exact_mut(BLOCK)
        .zip(scales)
        .zip(packed.chunks_exact(packed_block))
    {
        kernels.dequantize_block(format, scale, &unpack_block(format, bytes), &mut block);
        convert(&block, chunk);
    }
    Ok(())
}

/// `input` padded with zeros to a whole number of blocks.
pub fn pad_to_block(input: &[f32]) -> Vec<f32> {
    let mut v = input.to_vec();
    v.resize(input.len().next_multiple_of(BLOCK), 0.0);
    v
}

/// The kernels of one instruction set, chosen once per call.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Kernels {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2(crate::x86::Avx2),
    #[cfg(target_arch = "x86_64")]
    Avx512(crate::x86::Avx512),
    #[cfg(target_arch = "aarch64")]
    Neon(crate::aarch64::Neon),
}

impl Kernels {
    /// The kernels for `isa`, or an error when this CPU lacks it.
    pub(crate) fn new(isa: Isa) -> Result<Kernels, Error> {
        let unavailable = Error::IsaUnavailable { isa };
        match isa {
            Isa::Scalar => Ok(Kernels::Scalar),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => crate::x86::Avx2::new()
                .map(Kernels::Avx2)
                .ok_or(unavailable),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => crate::x86::Avx512::new()
                .map(Kernels::Avx512)
                .ok_or(unavailable),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => crate::aarch64::Neon::new()
                .map(Kernels::Neon)
                .ok_or(unavailable),
            #[allow(unreachable_patterns)]
            _ => Err(unavailable),
        }
    }

    pub(crate) fn quantize_block(
        self,
        format: ElemFormat,
        options: QuantOptions,
        block: &[f32; BLOCK],
    ) -> (u8, [u8; BLOCK]) {
        match (self, options.scale) {
            (Kernels::Scalar, _) | (_, ScaleRule::MseSearch) => {
                reference::quantize_block_with(format, options, block)
            }
            // AVX-512 adds the integer GEMV; block quantization is AVX2 code on both levels.
            #[cfg(target_arch = "x86_64")]
            (Kernels::Avx2(k) | Kernels::Avx512(crate::x86::Avx512 { avx2: k }), rule) => {
                k.quantize_block(format, options.rounding, rule, block)
            }
            #[cfg(target_arch = "aarch64")]
            (Kernels::Neon(k), rule) => k.quantize_block(format, options.rounding, rule, block),
        }
    }

    pub(crate) fn dequantize_block(
        self,
        format: ElemFormat,
        scale: u8,
        codes: &[u8; BLOCK],
        out: &mut [f32; BLOCK],
    ) {
        match self {
            Kernels::Scalar => *out = reference::dequantize_block(format, scale, codes),
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx2(k) | Kernels::Avx512(crate::x86::Avx512 { avx2: k }) => {
                k.dequantize_block(format, scale, codes, out)
            }
            #[cfg(target_arch = "aarch64")]
            Kernels::Neon(k) => k.dequantize_block(format, scale, codes, out),
        }
    }

    /// How many batch columns one [`Kernels::q8_tile`] call takes: its weights are decoded once
    /// per tile-block for all of them. AVX2 decodes through a chain of shuffles and blends, so
    /// 32 columns pay better than 8 (`pipeline bench --n-prompt 74` of SmolLM2-135M on 2 AVX2
    /// cores: 477 / 512 tokens/s at 8, 545 / 597 at 32, 2026-12-03, README); AVX-512 keeps its
    /// 8 sums in registers.
    pub(crate) fn q8_columns(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx2(_) => crate::gemv::Q8_MAX_COLUMNS,
            _ => crate::gemv::MAX_BATCH,
        }
    }

    /// One row tile of the int8-activation GEMM (see [`crate::gemv`]).
    pub(crate) fn q8_tile(
        self,
        m: &crate::gemv::MxMatrix,
        map: &crate::gemv::IntMap,
        tile: usize,
        xs: &[&crate::gemv::Q8Activations],
        acc: &mut [[f32; crate::gemv::TILE_ROWS]],
    ) {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx512(k) => {
                let (codes, scales) = m.tile(tile);
                k.q8_tile(m.format(), map, codes, scales, xs, acc)
            }
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx2(k) => {
                let (codes, scales) = m.tile(tile);
                k.q8_tile(m.format(), map, codes, scales, xs, acc)
            }
            #[cfg(target_arch = "aarch64")]
            Kernels::Neon(k) => {
                let (codes, scales) = m.tile(tile);
                k.q8_tile(m.format(), map, codes, scales, xs, acc)
            }
            Kernels::Scalar => crate::gemv::q8_tile_scalar(m, map, tile, xs, acc),
        }
    }

    /// One row tile of the f32-activation GEMM (see [`crate::gemv`]).
    pub(crate) fn f32_tile(
        self,
        m: &crate::gemv::MxMatrix,
        tile: usize,
        xs: &[&[f32]],
        acc: &mut [[f32; crate::gemv::TILE_ROWS]],
    ) {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx512(k) => {
                let (codes, scales) = m.tile(tile);
                k.f32_tile(m.format(), codes, scales, xs, acc)
            }
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx2(k) => {
                let (codes, scales) = m.tile(tile);
                k.f32_tile(m.format(), codes, scales, xs, acc)
            }
            // NEON has no f32 tile kernel yet: the portable one (auto-vectorised) runs.
            #[allow(unreachable_patterns)]
            _ => crate::gemv::f32_tile_scalar(m, tile, xs, acc),
        }
    }
}
