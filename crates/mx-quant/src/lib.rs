//! OCP Microscaling (MX) v1.0: blocks of 32 elements sharing one E8M0 power-of-two scale, with
//! FP8 (E5M2, E4M3), FP6 (E3M2, E2M3), FP4 (E2M1) and INT8 elements.
//!
//! # What is here
//! - [`ElemFormat`] and the quantization modes ([`QuantOptions`]: the spec's FLOOR scale with
//!   ties-to-even by default; RCEIL, MSE-searched scales and ties-away as options).
//! - [`reference`](mod@reference): the scalar definition of every bit, checked against vectors made with
//!   ml_dtypes (`fixtures/mx-conformance`).
//! - [`bulk`]: quantize/dequantize over slices with run-time ISA dispatch ([`Isa`]), bit-exact
//!   with the reference.
//! - [`layout`]: the linear packed layout and llama.cpp's `block_mxfp4` (GGUF interop).
//! - [`gptq`]: error-compensating quantization (GPTQ with MX block scales, then
//!   coordinate-descent refinement), given a layer's input Hessian; [`hadamard`]: 32-point block rotations of weights and activations.
//!
//! # Design
//! - The reference is the spec; SIMD variants live in their own modules (`x86/`), are chosen at
//!   run time, and are tested against the reference on every code path.
//! - Bad input has defined results: NaN/Inf make a NaN block (scale 0xFF), lengths that are not
//!   whole blocks are an [`Error`], never truncated.
//! - No hardware dependencies: pure computation, usable anywhere.
//!
//! # Unsafe
//! Only in `x86/mod.rs` and `aarch64/mod.rs`: calling a `#[target_feature]` kernel is unsafe, and it happens only in
//! methods of a token type that run-time detection alone can create. Loads and stores inside the
//! kernels go through `bytemuck` casts, so the kernels themselves hold no unsafe code.
//!
//! # Example
//! ```
//! use mx_quant::{ElemFormat, QuantOptions, bulk, layout::packed_len};
//!
//! let weights: Vec<f32> = (0..64).map(|i| (i as f32 * 0.1).sin()).collect();
//! let format = ElemFormat::Fp4E2M1;
//! let mut scales = vec![0u8; weights.len() / 32];
//! let mut packed = vec![0u8; packed_len(format, weights.len())];
//! bulk::quantize(format, QuantOptions::default(), &weights, &mut scales, &mut packed)?;
//!
//! let mut restored = vec![0f32; weights.len()];
//! bulk::dequantize(format, &scales, &packed, &mut restored)?;
//! let max_err = weights.iter().zip(&restored).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
//! assert!(max_err <= 0.25, "FP4 keeps about one significant bit per element: {max_err}");
//! # Ok::<(), mx_quant::Error>(())
//! ```

#![deny(unsafe_code)]

pub mod bulk;
mod format;
pub mod gemv;
pub mod gptq;
pub mod hadamard;
mod isa;
pub mod layout;
pub mod quality;
pub mod reference;
pub mod wgsl;
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod x86;

#[cfg(target_arch = "aarch64")]
#[allow(unsafe_code)]
mod aarch64;

/// The README's example, compiled and run as a doctest so it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExample;

/// Deterministic numbers in `[-1, 1)` for the unit tests (a 64-bit LCG, Knuth's constants).
#[cfg(test)]
pub(crate) fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

pub use format::{BLOCK, ElemFormat, QuantOptions, Rounding, SCALE_BIAS, SCALE_NAN, ScaleRule};
pub use isa::Isa;

/// Why an MX operation refused its arguments.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A slice length is not a whole number of 32-element blocks.
    #[error(
        "length {len} is not a multiple of the 32-element MX block; pad with zeros \
         (`bulk::pad_to_block`) or pass whole blocks"
    )]
    NotBlockMultiple { len: usize },
    /// An output or companion slice has the wrong length for its input.
    #[error("{what} has length {got}, expected {expected}")]
    LengthMismatch {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    /// A size computation overflowed `usize`.
    #[error("tensor size overflows usize; the shape is corrupt or far too large")]
    TooLarge,
    /// A row index or tile range reaches past the matrix.
    #[error("row {row} is out of range for a matrix of {rows} rows")]
    RowOutOfRange { row: usize, rows: usize },
    /// The operation does not exist for this element format.
    #[error(
        "element format {format} is not supported by this kernel (int8 dot products take fp4_e2m1, fp6_e2m3 and int8; use the f32 path)"
    )]
    UnsupportedFormat { format: ElemFormat },
    /// A kernel was asked for an instruction set this CPU lacks.
    #[error("instruction set {} is not available on this CPU; use `Isa::detect()`", isa.name())]
    IsaUnavailable { isa: Isa },
    /// A Hessian given to [`gptq`] cannot be factored.
    #[error("the calibration Hessian cannot be used: {reason}")]
    BadHessian { reason: &'static str },
    /// Weights given to [`gptq`] hold NaN or infinite values.
    #[error("the weights hold NaN or infinite values; check the model file")]
    BadWeights,
}
