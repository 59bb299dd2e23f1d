//! OCP Microscaling (MX) v1.0: blocks of 32 elements sharing one E8M0 power-of-two scale, with
//! FP8 (E5M2, E4M3), FP6 (E3M2, E2M3), FP4 (E2M1) and INT8 elements.
//!
//! Its formats, layouts and kernels arrive with issue #3; this crate exports nothing yet.
//!
//! # Design
//! - A scalar reference (`reference`) defines every bit; SIMD kernels (AVX-512, AVX2, NEON) are
//!   chosen at run time and tested to agree with it exactly.
//! - Packed layouts: a linear layout, llama.cpp's `block_mxfp4` for GGUF interop, and
//!   cache-line-aligned tiles that the GEMV kernels stream at memory bandwidth.
//! - No hardware dependencies: this crate is pure computation and usable anywhere.

#![forbid(unsafe_code)]
