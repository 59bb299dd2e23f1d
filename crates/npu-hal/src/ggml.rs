//! Matrices kept in llama.cpp/ggml's own block formats (Q4_0, Q4_1, Q8_0), exactly as a GGUF
//! file stores them, and the matrix-vector/matrix product of ggml's x86 CPU backend over them.
//! This backs the decoder's `exact` weight policy for quantized files: no requantization, no
//! dequantization, and the same numerics as llama.cpp, so a model reproduces its logits.
//!
//! # Numerics (what "the same as ggml" means here)
//! - Activations are quantized per 32-element block the way ggml's AVX2 `quantize_row_q8_0` /
//!   `quantize_row_q8_1` do (`ggml-cpu/arch/x86/quants.c`): `amax = max |x|`, `d = amax / 127`,
//!   `id = 127 / amax` (0 for an all-zero block), `q = round_ties_even(x * id)` (a multiply by
//!   `id`, not a divide by `d`), `d` stored as f16 (round to nearest even). Q8_1 also stores
//!   `s = f16(d * sum(q))` with the unrounded f32 `d`.
//! - Weight types meet activation types as ggml pairs them: Q4_0 and Q8_0 with Q8_0, Q4_1 with
//!   Q8_1 (see [`BlockType::activation`]).
//! - The dot product mirrors ggml's AVX2 `ggml_vec_dot_*` operation for operation, not just in
//!   formula: per block, the integer products are summed in eight i32 lanes of four adjacent
//!   elements each (what `maddubs`+`madd` or `vpdpbusd` leave), each lane is converted to f32 and
//!   fused-multiply-added into its own f32 accumulator with the scale `f32(d_w) * f32(d_x)`
//!   (rounded once, as a separate multiply); at the end the eight lanes are added in
//!   `hsum_float_8`'s order. Q4_1 adds `summs`, accumulated per block as `fma(m_w, s_x, summs)`
//!   (ggml's `summs += m*s`, contracted to an FMA by the compilers ggml is built with; the
//!   llama-cpp-python build's `ggml_vec_dot_q4_1_q8_1` disassembles to `vfmadd231ss`). The
//!   integer sums are exact, so every path here (portable, AVX2, AVX-512 VNNI) returns the same
//!   bits, and those are ggml's bits for its AVX2 and AVX-VNNI builds.
//! - [`BlockMatrix::dequantize_row`] is ggml's `dequantize_row_*` (in ggml-base, built without
//!   FMA): Q4_1 is `d * q + m` with two roundings.
//!
//! Checked bit for bit (dequantization, activation blocks and dot products, every path)
//! against llama-cpp-python 0.3.36's `libggml-cpu` called through ctypes, on SmolLM2-135M's
//! `blk.0.ffn_up`/`ffn_down` (Q4_1) and `token_embd` (Q8_0) and on a gguf-quantized Q4_0 matrix;
//! that check needs Python and the model, so it is not among the tests here.
//!
//! Not mirrored: llama.cpp's other routes to the same product (llamafile's tinyBLAS for Q8_0 and
//! Q4_0 batches, the repacked Q4_0 layouts) may group the sums differently; they agree with this
//! to float rounding, not necessarily to the bit.
//!
//! # Performance
//! - Up to eight tokens share each decode of a weight block ([`BlockMatrix::gemm_rows`]), each
//!   with its own accumulator register; Q4_1's `s` terms are laid out with the tokens across the
//!   lanes so one FMA per block serves all of them.
//! - One token (GEMV) runs two rows at a time instead, so that two FMA chains are in flight.
//! - Scales are widened by broadcasting the f16 and converting a whole register: converting a
//!   lone f16 made LLVM load it with `vpinsrw` into whichever register it took as the undefined
//!   rest of the vector, sometimes an accumulator, a false dependency that cost up to 3x.
//! - The portable kernel is plain Rust with `mul_add` (one instruction on aarch64; a libm call on
//!   x86-64 without FMA, where it is only the fallback).
//!
//! # Invariants
//! - A [`BlockMatrix`] holds exactly `rows * cols / 32` blocks of its type, `cols % 32 == 0`;
//!   [`BlockMatrix::new`] checks both with checked arithmetic, since the bytes come from a file.
//!   Any bit pattern is a valid block (non-finite scales just give non-finite results).
//! - Activation codes are in `-127..=127` (quantization never produces -128); the AVX2 sign trick
//!   relies on it to keep `maddubs`'s i16 pair sums from saturating, for any weight byte.
//!
//! # Unsafe
//! Only for x86: unaligned SIMD loads and stores on arrays of exactly the accessed size, and the
//! calls of the `#[target_feature]` builds right after run-time detection of their features.

use std::ops::Range;

use half::f16;

use crate::Error;

/// Elements per block in every format here (ggml's `QK4_0 = QK4_1 = QK8_0 = QK8_1 = 32`).
pub const BLOCK: usize = 32;

/// Bytes of a Q4_0 block: f16 `d`, 16 bytes of nibbles.
const Q4_0_BYTES: usize = 18;
/// Bytes of a Q4_1 block: f16 `d`, f16 `m`, 16 bytes of nibbles.
const Q4_1_BYTES: usize = 20;
/// Bytes of a Q8_0 block: f16 `d`, 32 signed bytes.
const Q8_0_BYTES: usize = 34;

// The layouts of ggml-common.h's block_q4_0, block_q4_1 and block_q8_0, all without padding.
const _: () = assert!(Q4_0_BYTES == 2 + BLOCK / 2);
const _: () = assert!(Q4_1_BYTES == 2 + 2 + BLOCK / 2);
const _: () = assert!(Q8_0_BYTES == 2 + BLOCK);

/// Tokens that share one decode of a weight block (the kernels keep one accumulator register
/// per token, and eight fit beside the block and constants in sixteen AVX2 registers).
const GROUP: usize = 8;

/// A ggml weight block format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum BlockType {
    /// `GGML_TYPE_Q4_0`: value `d * (nibble - 8)`.
    Q4_0,
    /// `GGML_TYPE_Q4_1`: value `d * nibble + m`.
    Q4_1,
    /// `GGML_TYPE_Q8_0`: value `d * q`, `q` a signed byte.
    Q8_0,
}

/// The activation formats ggml quantizes an f32 vector to before a quantized dot product.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ActivationType {
    /// `GGML_TYPE_Q8_0`: f16 `d`, 32 signed bytes.
    #[default]
    Q8_0,
    /// `GGML_TYPE_Q8_1`: Q8_0 plus f16 `s = d * sum(q)`.
    Q8_1,
}

impl BlockType {
    /// Bytes of one block of 32 elements.
    pub const fn block_bytes(self) -> usize {
        match self {
            BlockType::Q4_0 => Q4_0_BYTES,
            BlockType::Q4_1 => Q4_1_BYTES,
            BlockType::Q8_0 => Q8_0_BYTES,
        }
    }

    /// The activation type ggml's `vec_dot_type` pairs with this weight type.
    pub const fn activation(self) -> ActivationType {
        match self {
            BlockType::Q4_0 | BlockType::Q8_0 => ActivationType::Q8_0,
            BlockType::Q4_1 => ActivationType::Q8_1,
        }
    }

    /// The `ggml_type` number that GGUF tensor infos carry.
    pub const fn ggml_type(self) -> u32 {
        match self {
            BlockType::Q4_0 => 2,
            BlockType::Q4_1 => 3,
            BlockType::Q8_0 => 8,
        }
    }

    /// The block type of a `ggml_type` number, if it is one of those supported here.
    pub const fn from_ggml_type(ty: u32) -> Option<BlockType> {
        match ty {
            2 => Some(BlockType::Q4_0),
            3 => Some(BlockType::Q4_1),
            8 => Some(BlockType::Q8_0),
            _ => None,
        }
    }
}

/// Const-generic tags of the block types (stable Rust has no enum const parameters).
const Q4_0: u8 = BlockType::Q4_0 as u8;
const Q4_1: u8 = BlockType::Q4_1 as u8;
const Q8_0: u8 = BlockType::Q8_0 as u8;

/// [`BlockType::block_bytes`] of a tag, folded to a constant in each monomorphised kernel.
const fn tag_bytes(tag: u8) -> usize {
    match tag {
        Q4_0 => Q4_0_BYTES,
        Q4_1 => Q4_1_BYTES,
        _ => Q8_0_BYTES,
    }
}

/// Exact f16 to f32 conversion (every f16 is an f32). The 15 magnitude bits move to where f32
/// keeps them and a multiply by 2^112 rebiases the exponent, which also normalises subnormals;
/// infinities and NaNs keep an all-ones exponent.
#[inline(always)]
fn f16_to_f32(h: u16) -> f32 {
    let h = u32::from(h);
    let sign = (h & 0x8000) << 16;
    let mag = h & 0x7fff;
    let v = if mag >= 0x7c00 {
        0x7f80_0000 | ((mag & 0x3ff) << 13)
    } else {
        // 0x7780_0000 is 2^112.
        (f32::from_bits(mag << 13) * f32::from_bits(0x7780_0000)).to_bits()
    };
    f32::from_bits(sign | v)
}

/// The little-endian f16 at `b[0..2]`, widened.
#[inline(always)]
fn f16_at(b: &[u8]) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[0], b[1]]))
}

/// A weight matrix of `rows x cols` elements in ggml blocks, row-major, each row `cols / 32`
/// consecutive blocks: a GGUF tensor's data as stored (GGUF's `ne[0]` is `cols`).
#[derive(Clone, Debug)]
pub struct BlockMatrix {
    ty: BlockType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl BlockMatrix {
    /// Wraps `data`, the blocks of a `rows x cols` matrix of type `ty`.
    ///
    /// # Errors
    /// [`Error::BadOp`] (with `op: usize::MAX`, as no op is involved) when `cols` is not a
    /// multiple of 32 or `data` is not exactly the matrix's size; [`Error::Limit`] when that size
    /// overflows `usize`.
    pub fn new(
        ty: BlockType,
        rows: usize,
        cols: usize,
        data: Vec<u8>,
    ) -> Result<BlockMatrix, Error> {
        if !cols.is_multiple_of(BLOCK) {
            return Err(Error::BadOp {
                op: usize::MAX,
                what: format!("{ty:?} matrix has {cols} columns, not a multiple of {BLOCK}"),
            });
        }
        let bytes = (cols / BLOCK)
            .checked_mul(ty.block_bytes())
            .and_then(|row| row.checked_mul(rows))
            .ok_or(Error::Limit {
                what: "bytes in a ggml block matrix",
            })?;
        if data.len() != bytes {
            return Err(Error::BadOp {
                op: usize::MAX,
                what: format!(
                    "{ty:?} matrix {rows}x{cols} needs {bytes} bytes, got {}",
                    data.len()
                ),
            });
        }
        Ok(BlockMatrix {
            ty,
            rows,
            cols,
            data,
        })
    }

    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Bytes of block data (what a GEMV streams).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// The blocks as ggml stores them, row after row.
    pub fn raw(&self) -> &[u8] {
        &self.data
    }

    /// The block format.
    pub fn block_type(&self) -> BlockType {
        self.ty
    }

    /// Bytes of one row.
    fn row_bytes(&self) -> usize {
        self.cols / BLOCK * self.ty.block_bytes()
    }

    /// The blocks of row `r`.
    fn row(&self, r: usize) -> &[u8] {
        let n = self.row_bytes();
        &self.data[r * n..(r + 1) * n]
    }

    /// Writes row `row` as f32 to `out`, exactly as ggml's `dequantize_row_q4_0/q4_1/q8_0` do
    /// (what `GGML_OP_GET_ROWS` uses for an embedding lookup).
    ///
    /// # Panics
    /// If `row >= rows` or `out.len() != cols`.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(row < self.rows, "row {row} of {} rows", self.rows);
        assert_eq!(out.len(), self.cols, "output length");
        let bs = self.ty.block_bytes();
        for (blk, out) in self
            .row(row)
            .chunks_exact(bs)
            .zip(out.chunks_exact_mut(BLOCK))
        {
            let d = f16_at(blk);
            match self.ty {
                BlockType::Q4_0 => {
                    for (j, &b) in blk[2..].iter().enumerate() {
                        out[j] = (i32::from(b & 0xf) - 8) as f32 * d;
                        out[j + BLOCK / 2] = (i32::from(b >> 4) - 8) as f32 * d;
                    }
                }
                BlockType::Q4_1 => {
                    let m = f16_at(&blk[2..]);
                    for (j, &b) in blk[4..].iter().enumerate() {
                        out[j] = f32::from(b & 0xf) * d + m;
                        out[j + BLOCK / 2] = f32::from(b >> 4) * d + m;
                    }
                }
                BlockType::Q8_0 => {
                    for (o, &b) in out.iter_mut().zip(&blk[2..]) {
                        *o = f32::from(b as i8) * d;
                    }
                }
            }
        }
    }

    /// `ys[t][r - rows.start] = W[r] . x_t` for `r` in `rows`, over the first
    /// `min(xs.len(), ys.len())` tokens `x_t = xs[t]`; each `ys[t]` holds at least `rows.len()`
    /// values (the calling convention of [`crate::DenseMatrix::gemm_rows`], so a pool splits
    /// rows the same way). Up to eight tokens share each decode of a weight block.
    ///
    /// # Panics
    /// If `rows` reaches past the matrix, an `xs[t]` is not `cols` long or lacks what the weight
    /// type needs (Q4_1 needs [`ActivationType::Q8_1`]; Q8_1 also serves Q4_0 and Q8_0), or a
    /// `ys[t]` is shorter than `rows`.
    pub fn gemm_rows(
        &self,
        xs: &[QuantizedActivations],
        rows: Range<usize>,
        ys: &mut [&mut [f32]],
    ) {
        self.gemm_rows_on(Path::detect(), xs, rows, ys);
    }

    /// [`Self::gemm_rows`] on a chosen kernel path.
    fn gemm_rows_on(
        &self,
        path: Path,
        xs: &[QuantizedActivations],
        rows: Range<usize>,
        ys: &mut [&mut [f32]],
    ) {
        assert!(
            rows.start <= rows.end && rows.end <= self.rows,
            "rows {rows:?} of {}",
            self.rows
        );
        let tokens = xs.len().min(ys.len());
        for (t, (x, y)) in xs.iter().zip(ys.iter()).enumerate().take(tokens) {
            assert_eq!(x.len(), self.cols, "token {t}: activation length");
            assert!(
                self.ty.activation() == ActivationType::Q8_0 || x.kind == ActivationType::Q8_1,
                "token {t}: {:?} weights need {:?} activations, got {:?}",
                self.ty,
                self.ty.activation(),
                x.kind
            );
            assert!(y.len() >= rows.len(), "token {t}: output shorter than rows");
        }
        let mut t0 = 0;
        while t0 < tokens {
            // 8, 4, 2 or 1 tokens, so four instances per format cover every count.
            let n = 1 << (tokens - t0).min(GROUP).ilog2();
            let (xs, ys) = (&xs[t0..t0 + n], &mut ys[t0..t0 + n]);
            match path {
                Path::Portable => group_portable(self, xs, rows.clone(), ys),
                #[cfg(target_arch = "x86_64")]
                Path::Avx2 => x86::group_avx2(self, xs, rows.clone(), ys),
                #[cfg(target_arch = "x86_64")]
                Path::Vnni => x86::group_vnni(self, xs, rows.clone(), ys),
            }
            t0 += n;
        }
    }
}

/// One token's vector quantized to ggml's Q8_0 or Q8_1 blocks, ready for
/// [`BlockMatrix::gemm_rows`]. Reuse one per token: [`Self::quantize`] keeps the buffers.
#[derive(Clone, Debug, Default)]
pub struct QuantizedActivations {
    kind: ActivationType,
    /// The codes, one array per block.
    qs: Vec<[i8; BLOCK]>,
    /// Per block, the f16 scale `d`, widened (exactly) to f32.
    d: Vec<f32>,
    /// Per block, the f16 `s = d * sum(q)`, widened; empty for Q8_0.
    s: Vec<f32>,
}

impl QuantizedActivations {
    /// Quantizes `x` to the activation type that `weights` meets (Q8_1 for Q4_1, Q8_0
    /// otherwise), bit for bit as ggml's AVX2 `quantize_row_q8_0` / `quantize_row_q8_1`.
    ///
    /// # Panics
    /// If `x.len()` is not a multiple of 32 (ggml asserts the same).
    pub fn quantize(&mut self, weights: BlockType, x: &[f32]) {
        assert!(
            x.len().is_multiple_of(BLOCK),
            "activation length {} is not a multiple of {BLOCK}",
            x.len()
        );
        self.kind = weights.activation();
        let nb = x.len() / BLOCK;
        self.qs.clear();
        self.qs.resize(nb, [0; BLOCK]);
        self.d.clear();
        self.d.resize(nb, 0.0);
        self.s.clear();
        if self.kind == ActivationType::Q8_1 {
            self.s.resize(nb, 0.0);
        }
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected just above, the only requirement of this build.
            unsafe { x86::quantize_avx2(self, x) };
            return;
        }
        quantize_portable(self, x);
    }

    /// Elements (a multiple of 32).
    pub fn len(&self) -> usize {
        self.qs.len() * BLOCK
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.qs.is_empty()
    }

    /// The activation format held.
    pub fn activation_type(&self) -> ActivationType {
        self.kind
    }
}

/// The quantization body, inlined into each target-feature build (sized buffers in `a`).
#[inline(always)]
fn quantize_portable(a: &mut QuantizedActivations, x: &[f32]) {
    let with_sum = a.kind == ActivationType::Q8_1;
    for (b, (blk, qs)) in x.chunks_exact(BLOCK).zip(a.qs.iter_mut()).enumerate() {
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in qs.iter_mut().zip(blk) {
            // |v * id| <= 127 (plus an ulp), so the saturating cast never clips.
            *q = (v * id).round_ties_even() as i8;
            sum += i32::from(*q);
        }
        a.d[b] = f16::from_f32(d).to_f32();
        if with_sum {
            a.s[b] = f16::from_f32(d * sum as f32).to_f32();
        }
    }
}

/// Rows the SIMD GEMV (one token) keeps in flight.
const GEMV_ROWS: usize = 2;

/// The kernel families; each gives the same bits (see the module notes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// Plain Rust, for every target.
    Portable,
    /// AVX2 + FMA + F16C intrinsics (`maddubs` + `madd`, as ggml's AVX2 build).
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// The AVX2 kernel with `vpdpbusd` (AVX-512 VNNI + VL) for the integer sums.
    #[cfg(target_arch = "x86_64")]
    Vnni,
}

impl Path {
    /// The fastest path this CPU runs.
    fn detect() -> Path {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") && has!("f16c") {
                if has!("avx512vnni") && has!("avx512vl") {
                    return Path::Vnni;
                }
                return Path::Avx2;
            }
        }
        Path::Portable
    }

    /// Whether this CPU runs the path.
    #[cfg(test)]
    fn available(self) -> bool {
        match self {
            Path::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 => Path::detect() != Path::Portable,
            #[cfg(target_arch = "x86_64")]
            Path::Vnni => Path::detect() == Path::Vnni,
        }
    }
}

/// Calls `$tile::<N, TAG>` for the group's token count and the matrix's block type.
macro_rules! dispatch_group {
    ($tile:ident, $m:expr, $xs:expr, $rows:expr, $ys:expr) => {
        match ($m.ty, $xs.len()) {
            (BlockType::Q4_0, 1) => $tile::<1, Q4_0>($m, $xs, $rows, $ys),
            (BlockType::Q4_0, 2) => $tile::<2, Q4_0>($m, $xs, $rows, $ys),
            (BlockType::Q4_0, 4) => $tile::<4, Q4_0>($m, $xs, $rows, $ys),
            (BlockType::Q4_0, _) => $tile::<8, Q4_0>($m, $xs, $rows, $ys),
            (BlockType::Q4_1, 1) => $tile::<1, Q4_1>($m, $xs, $rows, $ys),
            (BlockType::Q4_1, 2) => $tile::<2, Q4_1>($m, $xs, $rows, $ys),
            (BlockType::Q4_1, 4) => $tile::<4, Q4_1>($m, $xs, $rows, $ys),
            (BlockType::Q4_1, _) => $tile::<8, Q4_1>($m, $xs, $rows, $ys),
            (BlockType::Q8_0, 1) => $tile::<1, Q8_0>($m, $xs, $rows, $ys),
            (BlockType::Q8_0, 2) => $tile::<2, Q8_0>($m, $xs, $rows, $ys),
            (BlockType::Q8_0, 4) => $tile::<4, Q8_0>($m, $xs, $rows, $ys),
            (BlockType::Q8_0, _) => $tile::<8, Q8_0>($m, $xs, $rows, $ys),
        }
    };
}

/// One group of 1, 2, 4 or 8 tokens over `rows`, portable kernel.
fn group_portable(
    m: &BlockMatrix,
    xs: &[QuantizedActivations],
    rows: Range<usize>,
    ys: &mut [&mut [f32]],
) {
    dispatch_group!(tile_portable, m, xs, rows, ys)
}

/// `hsum_float_8`'s order: `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`.
#[inline(always)]
fn hsum8(l: &[f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// A weight block decoded for the portable kernel: codes as they multiply (Q4_0 `-8..=7`, Q4_1
/// `0..=15`, Q8_0 the byte), scale and (Q4_1) offset.
#[inline(always)]
fn decode_portable<const TY: u8>(blk: &[u8]) -> ([i8; BLOCK], f32, f32) {
    let mut w = [0i8; BLOCK];
    let d = f16_at(blk);
    let mut m = 0.0;
    match TY {
        Q8_0 => {
            for (w, &b) in w.iter_mut().zip(&blk[2..2 + BLOCK]) {
                *w = b as i8;
            }
        }
        _ => {
            let (nibbles, off) = if TY == Q4_1 {
                m = f16_at(&blk[2..]);
                (&blk[4..4 + BLOCK / 2], 0)
            } else {
                (&blk[2..2 + BLOCK / 2], 8)
            };
            for (j, &b) in nibbles.iter().enumerate() {
                w[j] = (b & 0xf) as i8 - off;
                w[j + BLOCK / 2] = (b >> 4) as i8 - off;
            }
        }
    }
    (w, d, m)
}

/// The portable kernel: `N` tokens over `rows`, the ggml lane structure written out.
fn tile_portable<const N: usize, const TY: u8>(
    m: &BlockMatrix,
    xs: &[QuantizedActivations],
    rows: Range<usize>,
    ys: &mut [&mut [f32]],
) {
    let nb = m.cols / BLOCK;
    let qs: [&[[i8; BLOCK]]; N] = std::array::from_fn(|t| &xs[t].qs[..nb]);
    let ds: [&[f32]; N] = std::array::from_fn(|t| &xs[t].d[..nb]);
    let ss: [&[f32]; N] = std::array::from_fn(|t| if TY == Q4_1 { &xs[t].s[..nb] } else { &[] });
    for r in rows.clone() {
        let mut acc = [[0f32; 8]; N];
        let mut summs = [0f32; N];
        for (b, blk) in m.row(r).chunks_exact(tag_bytes(TY)).enumerate() {
            let (w, dw, mw) = decode_portable::<TY>(blk);
            for t in 0..N {
                let x = &qs[t][b];
                let d = dw * ds[t][b];
                for (k, acc) in acc[t].iter_mut().enumerate() {
                    let lane: i32 = (4 * k..4 * k + 4)
                        .map(|i| i32::from(w[i]) * i32::from(x[i]))
                        .sum();
                    *acc = d.mul_add(lane as f32, *acc);
                }
                if TY == Q4_1 {
                    summs[t] = mw.mul_add(ss[t][b], summs[t]);
                }
            }
        }
        for t in 0..N {
            let sum = hsum8(&acc[t]);
            ys[t][r - rows.start] = if TY == Q4_1 { sum + summs[t] } else { sum };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The AVX2 and AVX-512 VNNI kernels: ggml's AVX2 `vec_dot` loops, with up to eight tokens
    //! per decoded weight block.

    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{BLOCK, BlockMatrix, Q4_1, Q8_0, QuantizedActivations};

    /// AVX2 build of the activation quantizer (`vroundps` and vector casts instead of libm).
    #[target_feature(enable = "avx2")]
    pub(super) fn quantize_avx2(a: &mut QuantizedActivations, x: &[f32]) {
        super::quantize_portable(a, x);
    }

    /// The AVX2 group entry.
    pub(super) fn group_avx2(
        m: &BlockMatrix,
        xs: &[QuantizedActivations],
        rows: Range<usize>,
        ys: &mut [&mut [f32]],
    ) {
        assert!(super::Path::detect() != super::Path::Portable);
        // SAFETY: AVX2, FMA and F16C were detected just above (detection is cached, so this is
        // a load and a compare), the only requirement of the target-feature build.
        unsafe { avx2::group(m, xs, rows, ys) }
    }

    /// The AVX-512 VNNI group entry.
    pub(super) fn group_vnni(
        m: &BlockMatrix,
        xs: &[QuantizedActivations],
        rows: Range<usize>,
        ys: &mut [&mut [f32]],
    ) {
        assert!(super::Path::detect() == super::Path::Vnni);
        // SAFETY: AVX2, FMA, F16C, AVX-512 VNNI and VL were detected just above, the only
        // requirement of the target-feature build.
        unsafe { vnni::group(m, xs, rows, ys) }
    }

    /// 32 bytes from an array of 32.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn load32(p: &[u8; BLOCK]) -> __m256i {
        // SAFETY: `p` is 32 readable bytes, and `loadu` has no alignment requirement.
        unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
    }

    /// 32 signed bytes from an array of 32.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn load32i(p: &[i8; BLOCK]) -> __m256i {
        // SAFETY: `p` is 32 readable bytes, and `loadu` has no alignment requirement.
        unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
    }

    /// 16 bytes from an array of 16.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn load16(p: &[u8; BLOCK / 2]) -> __m128i {
        // SAFETY: `p` is 16 readable bytes, and `loadu` has no alignment requirement.
        unsafe { _mm_loadu_si128(p.as_ptr().cast()) }
    }

    /// 8 floats from an array of 8.
    #[target_feature(enable = "avx")]
    #[inline]
    fn load8f(p: &[f32; 8]) -> __m256 {
        // SAFETY: `p` is 8 readable f32s, and `loadu` has no alignment requirement.
        unsafe { _mm256_loadu_ps(p.as_ptr()) }
    }

    /// The 8 lanes as an array.
    #[target_feature(enable = "avx")]
    #[inline]
    fn store8f(v: __m256) -> [f32; 8] {
        let mut out = [0f32; 8];
        // SAFETY: `out` is 8 writable f32s, and `storeu` has no alignment requirement.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
        out
    }

    /// `hsum_float_8` of ggml, instruction for instruction.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn hsum_float_8(x: __m256) -> f32 {
        let mut r = _mm_add_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
        r = _mm_add_ps(r, _mm_movehl_ps(r, r));
        r = _mm_add_ss(r, _mm_movehdup_ps(r));
        _mm_cvtss_f32(r)
    }

    /// The codes of a weight block as the SIMD kernels use them: the unsigned bytes that enter
    /// `maddubs`/`vpdpbusd` (`|w|` for the signed types, the nibbles for Q4_1) and the signs to
    /// put on the activations (the signed codes themselves; unused for Q4_1).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn decode<const TY: u8>(blk: &[u8]) -> (__m256i, __m256i) {
        if TY == Q8_0 {
            let w = load32(blk[2..2 + BLOCK].try_into().expect("block size"));
            return (_mm256_abs_epi8(w), w);
        }
        let start = if TY == Q4_1 { 4 } else { 2 };
        let raw = load16(
            blk[start..start + BLOCK / 2]
                .try_into()
                .expect("block size"),
        );
        // bytes_from_nibbles_32: low nibbles are elements 0..16, high nibbles 16..32.
        let both = _mm256_set_m128i(_mm_srli_epi16::<4>(raw), raw);
        let q = _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
        if TY == Q4_1 {
            (q, q)
        } else {
            let w = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
            (_mm256_abs_epi8(w), w)
        }
    }

    /// The f16 at `blk[at..at + 2]`, widened (exactly, like ggml's table) into all eight lanes.
    ///
    /// Broadcast, and used as a whole vector, on purpose: converting a lone f16 makes LLVM load
    /// it with `vpinsrw` into whatever register it takes as the undefined rest of the vector,
    /// which can be an accumulator; that false dependency tripled the GEMV's time. A broadcast
    /// writes the whole register.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    fn half_splat(blk: &[u8], at: usize) -> __m256 {
        _mm256_cvtph_ps(_mm_set1_epi16(i16::from_le_bytes([blk[at], blk[at + 1]])))
    }

    /// Stamps out one ISA's kernel from the shared body; `$dot` sums `u8 x i8` products in
    /// groups of four into eight i32 lanes.
    macro_rules! kernel {
        ($module:ident, $features:literal, $dot:item) => {
            mod $module {
                use std::arch::x86_64::*;
                use std::ops::Range;

                use super::super::{
                    BLOCK, BlockMatrix, BlockType, Q4_0, Q4_1, Q8_0, QuantizedActivations,
                    tag_bytes,
                };
                use super::super::GEMV_ROWS;
                use super::{decode, half_splat, hsum_float_8, load8f, load32i, store8f};

                $dot

                /// One group of 1, 2, 4 or 8 tokens over `rows`.
                #[target_feature(enable = $features)]
                pub(super) fn group(
                    m: &BlockMatrix,
                    xs: &[QuantizedActivations],
                    rows: Range<usize>,
                    ys: &mut [&mut [f32]],
                ) {
                    if let ([x], [y]) = (xs, &mut *ys) {
                        match m.ty {
                            BlockType::Q4_0 => gemv::<Q4_0>(m, x, rows, y),
                            BlockType::Q4_1 => gemv::<Q4_1>(m, x, rows, y),
                            BlockType::Q8_0 => gemv::<Q8_0>(m, x, rows, y),
                        }
                        return;
                    }
                    dispatch_group!(tile, m, xs, rows, ys)
                }

                /// One token over `rows`, `GEMV_ROWS` rows at a time: a row's blocks form one
                /// chain of dependent FMAs (ggml's order), so only several rows in flight keep
                /// the FMA units busy.
                #[target_feature(enable = $features)]
                fn gemv<const TY: u8>(
                    m: &BlockMatrix,
                    x: &QuantizedActivations,
                    rows: Range<usize>,
                    y: &mut [f32],
                ) {
                    let mut r = rows.start;
                    while r + GEMV_ROWS <= rows.end {
                        let out = rows_dot::<GEMV_ROWS, TY>(
                            std::array::from_fn(|i| m.row(r + i)),
                            x,
                        );
                        y[r - rows.start..][..GEMV_ROWS].copy_from_slice(&out);
                        r += GEMV_ROWS;
                    }
                    for r in r..rows.end {
                        y[r - rows.start] = rows_dot::<1, TY>([m.row(r)], x)[0];
                    }
                }

                /// The dot products of `R` rows with one token.
                #[target_feature(enable = $features)]
                #[inline]
                fn rows_dot<const R: usize, const TY: u8>(
                    rows: [&[u8]; R],
                    x: &QuantizedActivations,
                ) -> [f32; R] {
                    let nb = x.qs.len();
                    let bs = tag_bytes(TY);
                    let (q, d) = (&x.qs[..nb], &x.d[..nb]);
                    let s = if TY == Q4_1 { &x.s[..nb] } else { &[][..] };
                    let rows: [&[u8]; R] = std::array::from_fn(|i| &rows[i][..nb * bs]);
                    let mut acc = [_mm256_setzero_ps(); R];
                    let mut summs = [_mm256_setzero_ps(); R];
                    for b in 0..nb {
                        let y = load32i(&q[b]);
                        let dx = _mm256_set1_ps(d[b]);
                        for i in 0..R {
                            let blk = &rows[i][b * bs..(b + 1) * bs];
                            let (u, sign) = decode::<TY>(blk);
                            let y = if TY == Q4_1 { y } else { _mm256_sign_epi8(y, sign) };
                            let p = _mm256_cvtepi32_ps(dot(u, y));
                            let dd = _mm256_mul_ps(half_splat(blk, 0), dx);
                            acc[i] = _mm256_fmadd_ps(dd, p, acc[i]);
                            if TY == Q4_1 {
                                let mw = half_splat(blk, 2);
                                summs[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(s[b]), summs[i]);
                            }
                        }
                    }
                    std::array::from_fn(|i| {
                        let sum = hsum_float_8(acc[i]);
                        if TY == Q4_1 { sum + _mm256_cvtss_f32(summs[i]) } else { sum }
                    })
                }

                /// `N` tokens over `rows` (see the module notes for the operation order).
                #[target_feature(enable = $features)]
                fn tile<const N: usize, const TY: u8>(
                    m: &BlockMatrix,
                    xs: &[QuantizedActivations],
                    rows: Range<usize>,
                    ys: &mut [&mut [f32]],
                ) {
                    let nb = m.cols / BLOCK;
                    let qs: [&[[i8; BLOCK]]; N] = std::array::from_fn(|t| &xs[t].qs[..nb]);
                    let ds: [&[f32]; N] = std::array::from_fn(|t| &xs[t].d[..nb]);
                    // Q4_1's s terms with the tokens across the lanes, so one FMA per block
                    // advances every token's `summs` (and eight of them need one register).
                    let st: Vec<[f32; 8]> = if TY == Q4_1 {
                        (0..nb)
                            .map(|b| std::array::from_fn(|t| if t < N { xs[t].s[b] } else { 0.0 }))
                            .collect()
                    } else {
                        Vec::new()
                    };
                    for r in rows.clone() {
                        let mut acc = [_mm256_setzero_ps(); N];
                        let mut summs = _mm256_setzero_ps();
                        for (b, blk) in m.row(r).chunks_exact(tag_bytes(TY)).enumerate() {
                            let dw = half_splat(blk, 0);
                            let mw = if TY == Q4_1 { half_splat(blk, 2) } else { dw };
                            let (u, sign) = decode::<TY>(blk);
                            for t in 0..N {
                                let y = load32i(&qs[t][b]);
                                // mul_sum_i8_pairs_float's sign trick for signed weights.
                                let y = if TY == Q4_1 { y } else { _mm256_sign_epi8(y, sign) };
                                let p = _mm256_cvtepi32_ps(dot(u, y));
                                // f32(d_w) * f32(d_x), rounded once, in every lane.
                                let d = _mm256_mul_ps(dw, _mm256_set1_ps(ds[t][b]));
                                acc[t] = _mm256_fmadd_ps(d, p, acc[t]);
                            }
                            if TY == Q4_1 {
                                // Lane t: fma(m_w, s_t, summs_t).
                                summs = _mm256_fmadd_ps(mw, load8f(&st[b]), summs);
                            }
                        }
                        let summs = store8f(summs);
                        for t in 0..N {
                            let sum = hsum_float_8(acc[t]);
                            ys[t][r - rows.start] = if TY == Q4_1 {
                                sum + summs[t]
                            } else {
                                sum
                            };
                        }
                    }
                }
            }
        };
    }

    kernel!(
        avx2,
        "avx2,fma,f16c",
        /// `madd(maddubs(u, y), 1)`: ggml's AVX2 `mul_sum_us8_pairs_float` integer part.
        #[target_feature(enable = "avx2")]
        #[inline]
        fn dot(u: __m256i, y: __m256i) -> __m256i {
            _mm256_madd_epi16(_mm256_maddubs_epi16(u, y), _mm256_set1_epi16(1))
        }
    );

    kernel!(
        vnni,
        "avx2,fma,f16c,avx512vnni,avx512vl",
        /// `vpdpbusd` from zero: the same eight lane sums in one instruction.
        #[target_feature(enable = "avx512vnni,avx512vl")]
        #[inline]
        fn dot(u: __m256i, y: __m256i) -> __m256i {
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, y)
        }
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Relative error allowed against the f64 reference, as a fraction of the sum of the
    /// magnitudes of the terms: the kernels round each block's scale product once, each lane's
    /// FMA once per block, and the eight-lane sum three times, so with at most a few dozen
    /// blocks per lane the bound is well under `64 * 2^-24` (about 4e-6).
    const F64_REL_TOL: f64 = 1e-5;

    /// SplitMix64: a seeded source for test data.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        /// Uniform in `[0, 1)`.
        fn unit(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32
        }
        /// Uniform in `[lo, hi)`.
        fn range(&mut self, lo: f32, hi: f32) -> f32 {
            lo + (hi - lo) * self.unit()
        }
    }

    /// Random blocks: scales of either sign in `[1e-4, 1e-2)` (and Q4_1 offsets in
    /// `(-0.05, 0.05)`), every code byte uniform (so Q8_0 meets -128 too).
    fn random_matrix(rng: &mut Rng, ty: BlockType, rows: usize, cols: usize) -> BlockMatrix {
        let blocks = rows * cols / BLOCK;
        let mut data = Vec::with_capacity(blocks * ty.block_bytes());
        for _ in 0..blocks {
            let sign = if rng.next() & 1 == 0 { 1.0 } else { -1.0 };
            let d = f16::from_f32(sign * rng.range(1e-4, 1e-2));
            data.extend_from_slice(&d.to_bits().to_le_bytes());
            if ty == BlockType::Q4_1 {
                let m = f16::from_f32(rng.range(-0.05, 0.05));
                data.extend_from_slice(&m.to_bits().to_le_bytes());
            }
            let codes = ty.block_bytes() - data.len() % ty.block_bytes();
            data.extend((0..codes).map(|_| rng.next() as u8));
        }
        BlockMatrix::new(ty, rows, cols, data).unwrap()
    }

    /// Random activations with varied block ranges, some all-zero and some single-spike blocks.
    fn random_vector(rng: &mut Rng, n: usize) -> Vec<f32> {
        let mut x = vec![0f32; n];
        for blk in x.chunks_exact_mut(BLOCK) {
            match rng.next() % 8 {
                0 => {}
                1 => blk[(rng.next() % BLOCK as u64) as usize] = rng.range(-3.0, 3.0),
                _ => {
                    let scale = rng.range(0.01, 10.0);
                    blk.iter_mut()
                        .for_each(|v| *v = scale * rng.range(-1.0, 1.0));
                }
            }
        }
        x
    }

    /// Scale, offset and codes of block `b` of row `r`, read independently of the kernels (with
    /// `half` for the f16s): element `j` of a 4-bit block is byte `j % 16`'s low nibble for
    /// `j < 16` and its high nibble otherwise.
    fn codes(m: &BlockMatrix, r: usize, b: usize) -> (f64, f64, [i32; BLOCK]) {
        let bs = m.ty.block_bytes();
        let blk = &m.data[(r * m.cols / BLOCK + b) * bs..][..bs];
        let half = |o: usize| f64::from(f16::from_bits(u16::from_le_bytes([blk[o], blk[o + 1]])));
        let mut q = [0i32; BLOCK];
        for (j, q) in q.iter_mut().enumerate() {
            *q = match m.ty {
                BlockType::Q4_0 => i32::from((blk[2 + j % 16] >> (4 * (j / 16))) & 0xf) - 8,
                BlockType::Q4_1 => i32::from((blk[4 + j % 16] >> (4 * (j / 16))) & 0xf),
                BlockType::Q8_0 => i32::from(blk[2 + j] as i8),
            };
        }
        let m_off = if m.ty == BlockType::Q4_1 {
            half(2)
        } else {
            0.0
        };
        (half(0), m_off, q)
    }

    #[test]
    fn f16_widening_is_exact_for_every_half() {
        for bits in 0..=u16::MAX {
            let want = f16::from_bits(bits).to_f32();
            let got = f16_to_f32(bits);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{bits:#06x}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn dequantize_row_matches_the_format_definitions() {
        let mut rng = Rng(1);
        for ty in [BlockType::Q4_0, BlockType::Q4_1, BlockType::Q8_0] {
            let (rows, cols) = (5, 96);
            let m = random_matrix(&mut rng, ty, rows, cols);
            let mut out = vec![0f32; cols];
            for r in 0..rows {
                m.dequantize_row(r, &mut out);
                for (j, &got) in out.iter().enumerate() {
                    let (d, off, q) = codes(&m, r, j / BLOCK);
                    let (d, off) = (d as f32, off as f32);
                    // ggml: `x * d` in f32, and for Q4_1 `x * d + m` with two roundings.
                    let want = match ty {
                        BlockType::Q4_1 => q[j % BLOCK] as f32 * d + off,
                        _ => q[j % BLOCK] as f32 * d,
                    };
                    assert_eq!(got.to_bits(), want.to_bits(), "{ty:?} row {r} col {j}");
                }
            }
        }
    }

    /// The activation rule written out per element: `(d as f16, q, s as f16)` of one block.
    fn quantize_reference(blk: &[f32]) -> (u16, [i8; BLOCK], u16) {
        let amax = blk.iter().map(|v| v.abs()).fold(0f32, f32::max);
        let d = amax / 127.0;
        let id = if amax == 0.0 { 0.0 } else { 127.0 / amax };
        let mut q = [0i8; BLOCK];
        for (q, v) in q.iter_mut().zip(blk) {
            let r = (v * id).round_ties_even();
            assert!((-127.0..=127.0).contains(&r));
            *q = r as i8;
        }
        let sum: i32 = q.iter().map(|&v| i32::from(v)).sum();
        let s = f16::from_f32(d * sum as f32).to_bits();
        (f16::from_f32(d).to_bits(), q, s)
    }

    fn check_quantized(a: &QuantizedActivations, x: &[f32], with_sum: bool) {
        assert_eq!(a.len(), x.len());
        for (b, blk) in x.chunks_exact(BLOCK).enumerate() {
            let (d, q, s) = quantize_reference(blk);
            assert_eq!(f16::from_f32(a.d[b]).to_bits(), d, "block {b} d");
            assert_eq!(a.d[b], f16::from_bits(d).to_f32(), "block {b} d widened");
            assert_eq!(a.qs[b], q, "block {b} codes");
            if with_sum {
                assert_eq!(
                    a.s[b].to_bits(),
                    f16::from_bits(s).to_f32().to_bits(),
                    "block {b} s"
                );
            } else {
                assert!(a.s.is_empty());
            }
        }
    }

    #[test]
    fn quantize_follows_ggml_rule_bit_for_bit() {
        let mut rng = Rng(2);
        let mut a = QuantizedActivations::default();
        for round in 0..50 {
            let x = random_vector(&mut rng, 32 * (1 + round % 7));
            a.quantize(BlockType::Q4_0, &x);
            assert_eq!(a.activation_type(), ActivationType::Q8_0);
            check_quantized(&a, &x, false);
            a.quantize(BlockType::Q4_1, &x);
            assert_eq!(a.activation_type(), ActivationType::Q8_1);
            check_quantized(&a, &x, true);
        }
    }

    #[test]
    fn quantize_rounds_ties_to_even_and_zero_blocks_to_zero() {
        // amax = 127 gives id = 1 exactly, so these are exact ties.
        let mut x = [0f32; 64];
        x[..8].copy_from_slice(&[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5]);
        // Second block all zero (with a negative zero).
        x[33] = -0.0;
        let mut a = QuantizedActivations::default();
        a.quantize(BlockType::Q4_1, &x);
        assert_eq!(&a.qs[0][..8], &[127, 0, 2, 2, 0, -2, -2, 4]);
        assert!(a.qs[0][8..].iter().all(|&q| q == 0));
        assert_eq!(a.d[0], 1.0);
        assert_eq!(a.s[0], 127.0 + 2.0 + 2.0 - 2.0 - 2.0 + 4.0);
        assert_eq!(a.qs[1], [0; BLOCK]);
        assert_eq!((a.d[1], a.s[1]), (0.0, 0.0));
        // id = 127 / 63.5 = 2: 0.25 -> 0.5 -> 0, 0.75 -> 1.5 -> 2, -1.25 -> -2.5 -> -2.
        let mut y = [0f32; 32];
        y[..4].copy_from_slice(&[63.5, 0.25, 0.75, -1.25]);
        a.quantize(BlockType::Q8_0, &y);
        assert_eq!(&a.qs[0][..4], &[127, 0, 2, -2]);
        assert_eq!(a.d[0], f16::from_f32(0.5).to_f32());
    }

    #[test]
    fn gemm_rows_matches_an_f64_reference() {
        let mut rng = Rng(3);
        for ty in [BlockType::Q4_0, BlockType::Q4_1, BlockType::Q8_0] {
            let (rows, cols, tokens) = (23, 320, 5);
            let m = random_matrix(&mut rng, ty, rows, cols);
            let xs: Vec<QuantizedActivations> = (0..tokens)
                .map(|_| {
                    let mut a = QuantizedActivations::default();
                    a.quantize(ty, &random_vector(&mut rng, cols));
                    a
                })
                .collect();
            let span = 4..rows;
            let mut out = vec![f32::NAN; tokens * span.len()];
            let mut ys: Vec<&mut [f32]> = out.chunks_mut(span.len()).collect();
            m.gemm_rows(&xs, span.clone(), &mut ys);
            for (t, x) in xs.iter().enumerate() {
                for r in span.clone() {
                    let (mut want, mut mag) = (0f64, 0f64);
                    for b in 0..cols / BLOCK {
                        let (dw, mw, qw) = codes(&m, r, b);
                        let dx = f64::from(x.d[b]);
                        for (j, &q) in qw.iter().enumerate() {
                            let term = dw * f64::from(q) * dx * f64::from(x.qs[b][j]);
                            want += term;
                            mag += term.abs();
                        }
                        if ty == BlockType::Q4_1 {
                            // ggml's Q8_1 term: m_w times the stored f16 s, not m_w * sum(dx * q).
                            want += mw * f64::from(x.s[b]);
                            mag += (mw * f64::from(x.s[b])).abs();
                        }
                    }
                    let got = f64::from(out[t * span.len() + r - span.start]);
                    assert!(
                        (got - want).abs() <= F64_REL_TOL * mag,
                        "{ty:?} token {t} row {r}: {got} vs {want} (magnitude {mag})"
                    );
                }
            }
        }
    }

    #[test]
    fn simd_paths_give_the_portable_bits() {
        let mut paths = vec![Path::Portable];
        #[cfg(target_arch = "x86_64")]
        paths.extend([Path::Avx2, Path::Vnni]);
        paths.retain(|p| p.available());
        eprintln!("checking {paths:?}");
        let mut rng = Rng(4);
        for ty in [BlockType::Q4_0, BlockType::Q4_1, BlockType::Q8_0] {
            for (rows, cols) in [(37, 96), (19, 512)] {
                let m = random_matrix(&mut rng, ty, rows, cols);
                for tokens in 1..=9 {
                    let xs: Vec<QuantizedActivations> = (0..tokens)
                        .map(|_| {
                            let mut a = QuantizedActivations::default();
                            a.quantize(BlockType::Q4_1, &random_vector(&mut rng, cols));
                            a
                        })
                        .collect();
                    // Odd and even row counts, so the GEMV's row pairs meet a tail.
                    let span = tokens % 3..rows;
                    let run = |path: Path| {
                        let mut out = vec![f32::NAN; tokens * span.len()];
                        let mut ys: Vec<&mut [f32]> = out.chunks_mut(span.len()).collect();
                        m.gemm_rows_on(path, &xs, span.clone(), &mut ys);
                        out
                    };
                    let want = run(Path::Portable);
                    assert!(want.iter().all(|v| v.is_finite()));
                    for &path in &paths[1..] {
                        let got = run(path);
                        let same = got
                            .iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{ty:?} {rows}x{cols} tokens {tokens} on {path:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn bad_shapes_and_lengths_are_errors() {
        let ok = BlockMatrix::new(BlockType::Q4_1, 3, 64, vec![0; 3 * 2 * 20]).unwrap();
        assert_eq!(
            (ok.shape(), ok.bytes(), ok.block_type()),
            ((3, 64), 120, BlockType::Q4_1)
        );
        for (ty, rows, cols, len) in [
            (BlockType::Q4_1, 3, 64, 119),
            (BlockType::Q4_1, 3, 64, 121),
            (BlockType::Q4_0, 2, 48, 2 * 18 * 2),
            (BlockType::Q8_0, 1, 32, 0),
        ] {
            assert!(matches!(
                BlockMatrix::new(ty, rows, cols, vec![0; len]),
                Err(Error::BadOp { .. })
            ));
        }
        assert!(matches!(
            BlockMatrix::new(BlockType::Q8_0, usize::MAX, 64, vec![]),
            Err(Error::Limit { .. })
        ));
        assert_eq!(BlockType::from_ggml_type(3), Some(BlockType::Q4_1));
        assert_eq!(BlockType::from_ggml_type(1), None);
    }

    #[test]
    #[should_panic(expected = "need Q8_1")]
    fn q4_1_refuses_q8_0_activations() {
        let m = BlockMatrix::new(BlockType::Q4_1, 1, 32, vec![0; 20]).unwrap();
        let mut a = QuantizedActivations::default();
        a.quantize(BlockType::Q8_0, &[1.0; 32]);
        m.gemm_rows(&[a], 0..1, &mut [&mut [0.0]]);
    }

    #[test]
    #[ignore = "timing, not a check: cargo test --release -p npu-hal ggml_speed -- --ignored --nocapture"]
    fn ggml_speed() {
        let mut rng = Rng(5);
        let mut paths = vec![Path::Portable];
        #[cfg(target_arch = "x86_64")]
        paths.extend([Path::Avx2, Path::Vnni]);
        paths.retain(|p| p.available());
        for ty in [BlockType::Q4_1, BlockType::Q4_0, BlockType::Q8_0] {
            for (rows, cols) in [(576, 1536), (1536, 576)] {
                let m = random_matrix(&mut rng, ty, rows, cols);
                for tokens in [1, 8, 64] {
                    let xs: Vec<QuantizedActivations> = (0..tokens)
                        .map(|_| {
                            let mut a = QuantizedActivations::default();
                            a.quantize(ty, &random_vector(&mut rng, cols));
                            a
                        })
                        .collect();
                    let mut out = vec![0f32; tokens * rows];
                    for &path in &paths {
                        let mut ys: Vec<&mut [f32]> = out.chunks_mut(rows).collect();
                        // Best of five batches: the machine may be shared.
                        let reps = (400 / tokens).max(2);
                        let s = (0..5)
                            .map(|_| {
                                let t0 = std::time::Instant::now();
                                for _ in 0..reps {
                                    m.gemm_rows_on(path, &xs, 0..rows, &mut ys);
                                }
                                t0.elapsed().as_secs_f64() / reps as f64
                            })
                            .fold(f64::INFINITY, f64::min);
                        let gmac = (rows * cols * tokens) as f64 / s / 1e9;
                        println!(
                            "{ty:?} {rows}x{cols} tokens {tokens:2} {path:?}: {:8.1} us, {gmac:6.1} GMAC/s",
                            s * 1e6
                        );
                    }
                }
            }
        }
        let x = random_vector(&mut rng, 1536);
        let mut a = QuantizedActivations::default();
        let t0 = std::time::Instant::now();
        for _ in 0..10000 {
            a.quantize(BlockType::Q4_1, std::hint::black_box(&x));
        }
        println!(
            "quantize 1536 -> Q8_1: {:.2} us",
            t0.elapsed().as_secs_f64() * 1e6 / 1e4
        );
    }
}
