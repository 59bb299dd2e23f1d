//! Fused dequant GEMV and small-batch GEMM over MX weights, on a tiled layout repacked at load.
//!
//! # The tiled layout ([`MxMatrix`])
//! Rows are grouped in tiles of [`TILE_ROWS`] (16: one AVX-512 register of f32 or i32 lanes, one
//! lane per row). For each tile and each 32-column block, a *tile-block* holds the 16 rows' codes
//! so that one 64-byte load feeds one `vpdpbusd`: byte `4 * r + i` of a 64-byte group is element
//! `4 * g + i` of row `r`. Per format:
//! - 8-bit codes: 8 groups of 64 B (512 B);
//! - 4-bit codes: 4 groups of 64 B, group `2p` in the low nibbles and `2p + 1` in the high (256 B);
//! - 6-bit codes: the low 4 bits as in the 4-bit layout (256 B), then the top 2 bits of groups
//!   `4q..4q + 4` packed at bit positions 0, 2, 4, 6 of a 64-byte plane (2 planes, 128 B).
//!
//! Tile-blocks are 128-byte aligned (a multiple of 128 B each, from a 128-byte aligned base) and
//! stored in the order the kernel reads them, so the weights stream sequentially. The 16 scale
//! bytes of a tile-block sit in a parallel array. Rows past the matrix's end are zero padding.
//!
//! # Two paths
//! - [`MxMatrix::gemm_q8`]: activations quantized per 32-block to int8 with an f32 scale
//!   ([`Q8Activations`]); each weight code maps through a small table to an unsigned byte
//!   `u = v * 2^k + offset`, so `vpdpbusd` computes `sum(u * q)` and the offset is removed with the
//!   activation block's precomputed `sum(q)`. Formats whose values are small integers after
//!   scaling: FP4 E2M1 (`2v + 12`), FP6 E2M3 (`8v + 60`), INT8 (`64v + 128`). This is the fast path.
//! - [`MxMatrix::gemm_f32`]: f32 activations, every format: each tile-block is decoded to f32 in
//!   L1 and multiplied in f32. The precise path.
//!
//! Both take a range of row tiles, so a caller's thread pool splits rows however it likes;
//! [`gemv_parallel_q8`] does it with scoped threads.

use crate::Error;
use crate::format::{BLOCK, ElemFormat, QuantOptions, SCALE_BIAS, SCALE_NAN};
use crate::isa::Isa;
use crate::layout::{check_block_multiple, check_len, packed_len, unpack_block};
use crate::reference;

/// Rows per tile: one lane per row in a 512-bit register.
pub const TILE_ROWS: usize = 16;

/// One 128-byte cache line (two 64-byte lines on x86, one on Apple silicon and some Arm cores).
#[repr(C, align(128))]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
struct Line([u8; 128]);

const _: () = assert!(size_of::<Line>() == 128 && align_of::<Line>() == 128);

/// How a format's codes enter the integer dot product: `u = value * 2^shift + offset`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct IntMap {
    /// `u8` for every code (16, 64 or 256 entries; INT8 uses `code ^ 0x80`).
    pub(crate) table: [u8; 64],
    /// `table` as a 64-entry byte-permute table indexed by a code's low six bits: for 4-bit
    /// codes entry `i` is `table[i & 15]`, so a nibble needs no masking before the lookup.
    pub(crate) permute_table: [u8; 64],
    pub(crate) offset: i32,
    /// `2^-shift`: what one unit of `u` is worth.
    pub(crate) unit: f32,
}

impl IntMap {
    /// The map for `format`, if its scaled values are small integers.
    pub(crate) fn new(format: ElemFormat) -> Option<IntMap> {
        let (shift, offset) = match format {
            ElemFormat::Fp4E2M1 => (1, 12),
            ElemFormat::Fp6E2M3 => (3, 60),
            ElemFormat::Int8 => (6, 128),
            _ => return None,
        };
        let mut table = [0u8; 64];
        if format != ElemFormat::Int8 {
            for (code, t) in table.iter_mut().enumerate().take(format.code_count()) {
                let v = reference::decode_elem(format, code as u8) * (1 << shift) as f32;
                *t = (v as i32 + offset) as u8;
            }
        }
        let permute_table = if format.bits() == 4 {
            std::array::from_fn(|i| table[i & 15])
        } else {
            table
        };
        Some(IntMap {
            table,
            permute_table,
            offset,
            unit: 1.0 / (1 << shift) as f32,
        })
    }

    fn unsigned(&self, format: ElemFormat, code: u8) -> u8 {
        if format == ElemFormat::Int8 {
            code ^ 0x80
        } else {
            self.table[usize::from(code)]
        }
    }
}

/// Bytes of one tile-block of codes.
const fn tile_block_bytes(format: ElemFormat) -> usize {
    TILE_ROWS * packed_len(format, BLOCK)
}

/// A weight matrix (`rows x cols`, row-major semantics) in the tiled MX layout.
#[derive(Clone, Debug)]
pub struct MxMatrix {
    format: ElemFormat,
    rows: usize,
    cols: usize,
    /// `[tile][block][row in tile]` E8M0 scales.
    scales: Vec<u8>,
    /// `[tile][block]` tile-blocks, each [`tile_block_bytes`] long.
    lines: Vec<Line>,
    /// Whether the stored rows are block-rotated ([`crate::hadamard::rotate_weights`]), so the
    /// activations they meet must be rotated too ([`crate::hadamard::rotate_activations`]).
    block_rotation: bool,
}

impl MxMatrix {
    /// Quantizes a row-major `rows x cols` f32 matrix (`cols` a multiple of 32).
    pub fn quantize(
        format: ElemFormat,
        options: QuantOptions,
        rows: usize,
        cols: usize,
        data: &[f32],
    ) -> Result<MxMatrix, Error> {
        check_block_multiple(cols)?;
        check_len(
            "matrix data",
            rows.checked_mul(cols).ok_or(Error::TooLarge)?,
            data.len(),
        )?;
        let blocks = rows * cols / BLOCK;
        let mut scales = vec![0u8; blocks];
        let mut packed = vec![0u8; packed_len(format, rows * cols)];
        crate::bulk::quantize(format, options, data, &mut scales, &mut packed)?;
        MxMatrix::from_linear(format, rows, cols, &scales, &packed)
    }

    /// Repacks a matrix stored in the linear layout: `scales` row-major `[row][block]`, `packed`
    /// the rows' codes back to back.
    pub fn from_linear(
        format: ElemFormat,
        rows: usize,
        cols: usize,
        scales: &[u8],
        packed: &[u8],
    ) -> Result<MxMatrix, Error> {
        check_block_multiple(cols)?;
        let elements = rows.checked_mul(cols).ok_or(Error::TooLarge)?;
        let blocks_per_row = cols / BLOCK;
        check_len("scales", elements / BLOCK, scales.len())?;
        check_len("packed codes", packed_len(format, elements), packed.len())?;
        let row_bytes = packed_len(format, cols);
        let block_bytes = packed_len(format, BLOCK);
        let mut m = MxMatrix::zeroed(format, rows, cols)?;
        for row in 0..rows {
            for b in 0..blocks_per_row {
                let start = row * row_bytes + b * block_bytes;
                let codes = unpack_block(format, &packed[start..start + block_bytes]);
                m.set_block(row, b, scales[row * blocks_per_row + b], &codes);
            }
        }
        Ok(m)
    }

    /// Builds a matrix from GGUF `block_mxfp4` rows (`rows * cols / 32` blocks, row-major).
    pub fn from_gguf_mxfp4(
        rows: usize,
        cols: usize,
        blocks: &[crate::layout::BlockMxfp4],
    ) -> Result<MxMatrix, Error> {
        check_block_multiple(cols)?;
        let elements = rows.checked_mul(cols).ok_or(Error::TooLarge)?;
        check_len("block_mxfp4 blocks", elements / BLOCK, blocks.len())?;
        let mut m = MxMatrix::zeroed(ElemFormat::Fp4E2M1, rows, cols)?;
        let per_row = cols / BLOCK;
        for (i, block) in blocks.iter().enumerate() {
            m.set_block(i / per_row, i % per_row, block.e, &block.codes());
        }
        Ok(m)
    }

    /// The tiled storage as bytes, `(scales, codes)`: what [`MxMatrix::from_tiled_parts`] takes
    /// back, so a converted model can be saved and reloaded without converting again.
    pub fn tiled_parts(&self) -> (&[u8], &[u8]) {
        (&self.scales, self.codes_bytes())
    }

    /// The byte lengths [`MxMatrix::tiled_parts`] has for this shape, `(scales, codes)`.
    pub fn tiled_lengths(
        format: ElemFormat,
        rows: usize,
        cols: usize,
    ) -> Result<(usize, usize), Error> {
        check_block_multiple(cols)?;
        let tiles = rows.div_ceil(TILE_ROWS);
        let tile_blocks = tiles.checked_mul(cols / BLOCK).ok_or(Error::TooLarge)?;
        let codes = tile_blocks
            .checked_mul(tile_block_bytes(format))
            .ok_or(Error::TooLarge)?;
        Ok((tile_blocks * TILE_ROWS, codes))
    }

    /// A matrix of zero codes and scales in the tiled layout, to be filled through
    /// [`MxMatrix::tiled_parts_mut`] (e.g. read straight from a saved file, with no staging copy).
    pub fn zeros(format: ElemFormat, rows: usize, cols: usize) -> Result<MxMatrix, Error> {
        check_block_multiple(cols)?;
        MxMatrix::zeroed(format, rows, cols)
    }

    /// The tiled storage as mutable bytes, `(scales, codes)`: any byte is a valid scale or
    /// code, so whatever is written there is a well-formed matrix.
    pub fn tiled_parts_mut(&mut self) -> (&mut [u8], &mut [u8]) {
        (&mut self.scales, bytemuck::cast_slice_mut(&mut self.lines))
    }

    /// Rebuilds a matrix from [`MxMatrix::tiled_parts`]; the lengths are checked against the
    /// shape (the bytes may come from an untrusted file: any byte is a valid code or scale).
    pub fn from_tiled_parts(
        format: ElemFormat,
        rows: usize,
        cols: usize,
        scales: &[u8],
        codes: &[u8],
    ) -> Result<MxMatrix, Error> {
        let (scale_len, code_len) = MxMatrix::tiled_lengths(format, rows, cols)?;
        check_len("tiled scales", scale_len, scales.len())?;
        check_len("tiled codes", code_len, codes.len())?;
        let mut m = MxMatrix::zeroed(format, rows, cols)?;
        m.scales.copy_from_slice(scales);
        bytemuck::cast_slice_mut::<Line, u8>(&mut m.lines).copy_from_slice(codes);
        Ok(m)
    }

    /// The matrix in the linear layout, `(scales, packed)`: scales row-major `[row][block]`, the
    /// rows' codes back to back as one little-endian bit stream (what [`MxMatrix::from_linear`]
    /// takes, and what the WGSL decoder of [`crate::wgsl`] reads).
    pub fn to_linear(&self) -> (Vec<u8>, Vec<u8>) {
        let per_row = self.blocks_per_row();
        let block_bytes = crate::layout::packed_len(self.format, BLOCK);
        let mut scales = Vec::with_capacity(self.rows * per_row);
        let mut packed = vec![0u8; self.rows * per_row * block_bytes];
        for (i, out) in packed.chunks_exact_mut(block_bytes).enumerate() {
            let (scale, codes) = self.get_block(i / per_row, i % per_row);
            scales.push(scale);
            crate::layout::pack_codes(self.format, &codes, out)
                .expect("one whole block into its own packed length");
        }
        (scales, packed)
    }

    /// The matrix as GGUF `block_mxfp4` rows (for saving); only for FP4 E2M1 weights.
    pub fn to_gguf_mxfp4(&self) -> Result<Vec<crate::layout::BlockMxfp4>, Error> {
        if self.format != ElemFormat::Fp4E2M1 {
            return Err(Error::UnsupportedFormat {
                format: self.format,
            });
        }
        let mut out = Vec::with_capacity(self.rows * self.blocks_per_row());
        for row in 0..self.rows {
            for b in 0..self.blocks_per_row() {
                let (scale, codes) = self.get_block(row, b);
                out.push(crate::layout::BlockMxfp4::from_codes(scale, &codes));
            }
        }
        Ok(out)
    }

    fn zeroed(format: ElemFormat, rows: usize, cols: usize) -> Result<MxMatrix, Error> {
        let tiles = rows.div_ceil(TILE_ROWS);
        let tile_blocks = tiles.checked_mul(cols / BLOCK).ok_or(Error::TooLarge)?;
        let bytes = tile_blocks
            .checked_mul(tile_block_bytes(format))
            .ok_or(Error::TooLarge)?;
        Ok(MxMatrix {
            format,
            rows,
            cols,
            scales: vec![0; tile_blocks * TILE_ROWS],
            lines: vec![Line([0; 128]); bytes / 128],
            block_rotation: false,
        })
    }

    fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK
    }

    fn tile_block_index(&self, row: usize, block: usize) -> usize {
        (row / TILE_ROWS) * self.blocks_per_row() + block
    }

    fn codes_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.lines)
    }

    /// Writes one row-block (scale and 32 codes) into its tile-block.
    fn set_block(&mut self, row: usize, block: usize, scale: u8, codes: &[u8; BLOCK]) {
        let tb = self.tile_block_index(row, block);
        let r = row % TILE_ROWS;
        self.scales[tb * TILE_ROWS + r] = scale;
        let format = self.format;
        let size = tile_block_bytes(format);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.lines);
        let tile = &mut bytes[tb * size..(tb + 1) * size];
        for (k, &code) in codes.iter().enumerate() {
            let (g, i) = (k / 4, k % 4);
            let lane = 4 * r + i;
            match format.bits() {
                8 => tile[64 * g + lane] = code,
                4 => tile[64 * (g / 2) + lane] |= (code & 0x0F) << (4 * (g % 2)),
                _ => {
                    tile[64 * (g / 2) + lane] |= (code & 0x0F) << (4 * (g % 2));
                    tile[256 + 64 * (g / 4) + lane] |= ((code >> 4) & 0x03) << (2 * (g % 4));
                }
            }
        }
    }

    /// One row-block back: its scale and 32 codes.
    fn get_block(&self, row: usize, block: usize) -> (u8, [u8; BLOCK]) {
        let tb = self.tile_block_index(row, block);
        let r = row % TILE_ROWS;
        let size = tile_block_bytes(self.format);
        let tile = &self.codes_bytes()[tb * size..(tb + 1) * size];
        let codes = std::array::from_fn(|k| {
            let (g, i) = (k / 4, k % 4);
            let lane = 4 * r + i;
            match self.format.bits() {
                8 => tile[64 * g + lane],
                4 => (tile[64 * (g / 2) + lane] >> (4 * (g % 2))) & 0x0F,
                _ => {
                    let lo = (tile[64 * (g / 2) + lane] >> (4 * (g % 2))) & 0x0F;
                    let hi = (tile[256 + 64 * (g / 4) + lane] >> (2 * (g % 4))) & 0x03;
                    lo | hi << 4
                }
            }
        });
        (self.scales[tb * TILE_ROWS + r], codes)
    }

    /// Marks the stored rows as block-rotated (or not): the weights are `H w / 32` per block,
    /// and whoever multiplies by this matrix must pass activations through
    /// [`crate::hadamard::rotate_activations`] first. [`MxMatrix::gemm_q8`] and
    /// [`MxMatrix::gemm_f32`] take activations as they are; the flag tells the caller.
    pub fn with_block_rotation(mut self, rotated: bool) -> MxMatrix {
        self.block_rotation = rotated;
        self
    }

    /// Whether the rows are block-rotated (see [`MxMatrix::with_block_rotation`]).
    pub fn block_rotation(&self) -> bool {
        self.block_rotation
    }

    /// The element format.
    pub fn format(&self) -> ElemFormat {
        self.format
    }

    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Bytes a GEMV streams: codes and scales, padding rows included.
    pub fn stream_bytes(&self) -> usize {
        self.lines.len() * 128 + self.scales.len()
    }

    /// Number of row tiles (the unit [`MxMatrix::gemm_q8`] and [`MxMatrix::gemm_f32`] split on).
    pub fn tiles(&self) -> usize {
        self.rows.div_ceil(TILE_ROWS)
    }

    /// Row `row` dequantized into `out` (`cols` long).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) -> Result<(), Error> {
        if row >= self.rows {
            return Err(Error::RowOutOfRange {
                row,
                rows: self.rows,
            });
        }
        check_len("row output", self.cols, out.len())?;
        for (b, chunk) in out.chunks_exact_mut(BLOCK).enumerate() {
            let (scale, codes) = self.get_block(row, b);
            chunk.copy_from_slice(&reference::dequantize_block(self.format, scale, &codes));
        }
        Ok(())
    }

    /// Whether [`MxMatrix::gemm_q8`] supports this matrix's format.
    pub fn supports_q8(&self) -> bool {
        IntMap::new(self.format).is_some()
    }

    /// `y[b][row] = sum_k W[row][k] * x[b][k]` for the rows of `tiles`, with int8 activations.
    /// `ys[b]` receives batch column `b`'s rows of those tiles: rows `16 * tiles.start` up to
    /// `min(16 * tiles.end, rows)`, so disjoint tile ranges write disjoint slices and a thread
    /// pool can split one output vector with `chunks_mut`. `isa` must be available.
    pub fn gemm_q8(
        &self,
        isa: Isa,
        xs: &[&Q8Activations],
        ys: &mut [&mut [f32]],
        tiles: std::ops::Range<usize>,
    ) -> Result<(), Error> {
        let map = IntMap::new(self.format).ok_or(Error::UnsupportedFormat {
            format: self.format,
        })?;
        self.check_gemm(xs.iter().map(|x| x.len()), ys, &tiles)?;
        let kernel = crate::bulk::Kernels::new(isa)?;
        let columns = kernel.q8_columns();
        for tile in tiles.clone() {
            let mut acc = [[0f32; TILE_ROWS]; Q8_MAX_COLUMNS];
            for (chunk_x, chunk_acc) in xs.chunks(columns).zip(ys.chunks_mut(columns)) {
                let acc = &mut acc[..chunk_x.len()];
                kernel.q8_tile(self, &map, tile, chunk_x, acc);
                let (start, end) = self.tile_rows(tile, &tiles);
                for (y, a) in chunk_acc.iter_mut().zip(acc.iter()) {
                    y[start..end].copy_from_slice(&a[..end - start]);
                }
            }
        }
        Ok(())
    }

    /// `y[b][row] = sum_k W[row][k] * x[b][k]` for the rows of `tiles`, f32 activations; `ys` as
    /// in [`MxMatrix::gemm_q8`]. Every format; `isa` must be available.
    pub fn gemm_f32(
        &self,
        isa: Isa,
        xs: &[&[f32]],
        ys: &mut [&mut [f32]],
        tiles: std::ops::Range<usize>,
    ) -> Result<(), Error> {
        self.check_gemm(xs.iter().map(|x| x.len()), ys, &tiles)?;
        let kernel = crate::bulk::Kernels::new(isa)?;
        for tile in tiles.clone() {
            let mut acc = [[0f32; TILE_ROWS]; MAX_BATCH];
            for (chunk_x, chunk_y) in xs.chunks(MAX_BATCH).zip(ys.chunks_mut(MAX_BATCH)) {
                let acc = &mut acc[..chunk_x.len()];
                kernel.f32_tile(self, tile, chunk_x, acc);
                let (start, end) = self.tile_rows(tile, &tiles);
                for (y, a) in chunk_y.iter_mut().zip(acc.iter()) {
                    y[start..end].copy_from_slice(&a[..end - start]);
                }
            }
        }
        Ok(())
    }

    fn check_gemm(
        &self,
        x_lens: impl Iterator<Item = usize>,
        ys: &[&mut [f32]],
        tiles: &std::ops::Range<usize>,
    ) -> Result<(), Error> {
        let mut batch = 0;
        for len in x_lens {
            check_len("activation vector", self.cols, len)?;
            batch += 1;
        }
        check_len("output vectors", batch, ys.len())?;
        if tiles.start > tiles.end || tiles.end > self.tiles() {
            return Err(Error::RowOutOfRange {
                row: tiles.end * TILE_ROWS,
                rows: self.rows,
            });
        }
        let rows = self.rows_of(tiles);
        for y in ys {
            check_len("output rows", rows.len(), y.len())?;
        }
        Ok(())
    }

    /// The matrix rows that row tiles `tiles` cover.
    pub fn rows_of(&self, tiles: &std::ops::Range<usize>) -> std::ops::Range<usize> {
        (tiles.start * TILE_ROWS).min(self.rows)..(tiles.end * TILE_ROWS).min(self.rows)
    }

    /// Where `tile`'s rows land in an output slice that starts at `tiles.start`.
    fn tile_rows(&self, tile: usize, tiles: &std::ops::Range<usize>) -> (usize, usize) {
        let first = tiles.start * TILE_ROWS;
        let start = tile * TILE_ROWS;
        let end = (start + TILE_ROWS).min(self.rows);
        (start - first, end - first)
    }

    /// All tile-blocks of row tile `tile` (back to back) and their scales (16 per block).
    pub(crate) fn tile(&self, tile: usize) -> (&[u8], &[u8]) {
        let n = self.blocks_per_row();
        let size = tile_block_bytes(self.format);
        (
            &self.codes_bytes()[tile * n * size..(tile + 1) * n * size],
            &self.scales[tile * n * TILE_ROWS..(tile + 1) * n * TILE_ROWS],
        )
    }

    /// The tile-block of codes `(tile, block)` as bytes, and its 16 scales.
    pub(crate) fn tile_block(&self, tile: usize, block: usize) -> (&[u8], &[u8]) {
        let tb = tile * self.blocks_per_row() + block;
        let size = tile_block_bytes(self.format);
        (
            &self.codes_bytes()[tb * size..(tb + 1) * size],
            &self.scales[tb * TILE_ROWS..(tb + 1) * TILE_ROWS],
        )
    }

    pub(crate) fn blocks(&self) -> usize {
        self.blocks_per_row()
    }
}

/// Batch columns an f32 kernel call carries at once (weights are decoded once per tile-block and
/// reused for each column), and the AVX-512 q8 kernel too, whose sums live in registers.
pub const MAX_BATCH: usize = 8;

/// The most batch columns a q8 kernel call carries (see `Kernels::q8_columns`).
pub(crate) const Q8_MAX_COLUMNS: usize = 32;

/// Activations quantized for [`MxMatrix::gemm_q8`]: per 32-block an int8 vector `q`, its scale
/// `d = amax / 127` (so `x ~= d * q`) and `sum(q)`.
#[derive(Clone, Debug, Default)]
pub struct Q8Activations {
    pub(crate) q: Vec<i8>,
    pub(crate) d: Vec<f32>,
    pub(crate) sums: Vec<i32>,
}

impl Q8Activations {
    /// Quantizes `x` (length a multiple of 32). Non-finite inputs make their block's scale NaN,
    /// so the affected outputs are NaN rather than silently wrong.
    pub fn quantize(x: &[f32]) -> Result<Q8Activations, Error> {
        let mut a = Q8Activations::default();
        a.requantize(x)?;
        Ok(a)
    }

    /// Re-quantizes into the existing buffers (no allocation once sized).
    pub fn requantize(&mut self, x: &[f32]) -> Result<(), Error> {
        check_block_multiple(x.len())?;
        self.q.resize(x.len(), 0);
        self.d.resize(x.len() / BLOCK, 0.0);
        self.sums.resize(x.len() / BLOCK, 0);
        for ((xb, qb), (d, sum)) in x
            .chunks_exact(BLOCK)
            .zip(self.q.chunks_exact_mut(BLOCK))
            .zip(self.d.iter_mut().zip(self.sums.iter_mut()))
        {
            let xb: &[f32; BLOCK] = xb.try_into().expect("chunks of BLOCK");
            let qb: &mut [i8; BLOCK] = qb.try_into().expect("chunks of BLOCK");
            (*d, *sum) = quantize_block_q8(xb, qb);
        }
        Ok(())
    }

    /// Length in elements.
    pub fn len(&self) -> usize {
        self.q.len()
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }

    /// The activations as the kernel sees them (`d * q`), for error analysis.
    pub fn dequantize(&self) -> Vec<f32> {
        self.q
            .iter()
            .enumerate()
            .map(|(i, &q)| self.d[i / BLOCK] * f32::from(q))
            .collect()
    }
}

/// The f32 value of an E8M0 scale byte as the q8 kernels compute it: `2^(e - 127)`, with 0xFF
/// as +Inf (a NaN block's codes are all zero, so its products become NaN).
pub(crate) fn e8m0_to_f32(e: u8) -> f32 {
    match e {
        0 => f32::from_bits(0x0040_0000),
        SCALE_NAN => f32::INFINITY,
        _ => f32::from_bits(u32::from(e) << 23),
    }
}

const _: () = assert!(
    SCALE_BIAS == 127,
    "e8m0_to_f32 places the byte directly in the f32 exponent"
);

/// The portable q8 tile kernel: the arithmetic every SIMD variant reproduces exactly (integer
/// dot products, then per block `acc = fma(isum, scale_w * d_x * unit, acc)`).
pub(crate) fn q8_tile_scalar(
    m: &MxMatrix,
    map: &IntMap,
    tile: usize,
    xs: &[&Q8Activations],
    acc: &mut [[f32; TILE_ROWS]],
) {
    for a in acc.iter_mut() {
        *a = [0.0; TILE_ROWS];
    }
    for b in 0..m.blocks() {
        let (_, scales) = m.tile_block(tile, b);
        let mut w = [[0u8; BLOCK]; TILE_ROWS];
        for (r, wr) in w.iter_mut().enumerate() {
            let row = tile * TILE_ROWS + r;
            if row < m.rows {
                let (_, codes) = m.get_block(row, b);
                for (u, c) in wr.iter_mut().zip(codes) {
                    *u = map.unsigned(m.format, c);
                }
            }
        }
        for (x, a) in xs.iter().zip(acc.iter_mut()) {
            let q = &x.q[b * BLOCK..(b + 1) * BLOCK];
            let dx = x.d[b] * map.unit;
            let correction = map.offset * x.sums[b];
            for ((wr, ar), &s) in w.iter().zip(a.iter_mut()).zip(scales) {
                let dot: i32 = wr
                    .iter()
                    .zip(q)
                    .map(|(&u, &q)| i32::from(u) * i32::from(q))
                    .sum();
                let isum = dot - correction;
                *ar = (isum as f32).mul_add(e8m0_to_f32(s) * dx, *ar);
            }
        }
    }
}

/// The portable f32 tile kernel, the exact model of the SIMD variants: per block and row, the
/// dot product of the block's element values with `x` accumulated by FMA in element order, then
/// `acc = fma(dot, scale_w, acc)` (INT8's 1/64 folded into `scale_w`).
pub(crate) fn f32_tile_scalar(
    m: &MxMatrix,
    tile: usize,
    xs: &[&[f32]],
    acc: &mut [[f32; TILE_ROWS]],
) {
    let format = m.format;
    let values: Vec<f32> = (0..format.code_count())
        .map(|c| {
            if format == ElemFormat::Int8 {
                f32::from(c as u8 as i8)
            } else {
                reference::decode_elem(format, c as u8)
            }
        })
        .collect();
    let unit = if format == ElemFormat::Int8 {
        1.0 / 64.0
    } else {
        1.0
    };
    for a in acc.iter_mut() {
        *a = [0.0; TILE_ROWS];
    }
    for b in 0..m.blocks() {
        for r in 0..TILE_ROWS {
            let row = tile * TILE_ROWS + r;
            if row >= m.rows {
                break;
            }
            let (scale, codes) = m.get_block(row, b);
            let scale_w = e8m0_to_f32(scale) * unit;
            for (x, a) in xs.iter().zip(acc.iter_mut()) {
                let xb = &x[b * BLOCK..(b + 1) * BLOCK];
                let dot = codes
                    .iter()
                    .zip(xb)
                    .fold(0f32, |d, (&c, &xk)| values[usize::from(c)].mul_add(xk, d));
                a[r] = dot.mul_add(scale_w, a[r]);
            }
        }
    }
}

/// `y = W x` with int8 activations over all rows, splitting row tiles across `threads` scoped
/// threads (spawned per call: fine for large matrices; a decoder drives [`MxMatrix::gemm_q8`]
/// from its own persistent pool instead).
pub fn gemv_parallel_q8(
    m: &MxMatrix,
    x: &Q8Activations,
    y: &mut [f32],
    threads: usize,
) -> Result<(), Error> {
    let isa = Isa::detect();
    split_rows(m, y, threads, |rows, span| {
        m.gemm_q8(isa, &[x], &mut [rows], span)
    })
}

/// [`gemv_parallel_q8`] with f32 activations ([`MxMatrix::gemm_f32`]).
pub fn gemv_parallel_f32(
    m: &MxMatrix,
    x: &[f32],
    y: &mut [f32],
    threads: usize,
) -> Result<(), Error> {
    let isa = Isa::detect();
    split_rows(m, y, threads, |rows, span| {
        m.gemm_f32(isa, &[x], &mut [rows], span)
    })
}

/// Runs `gemv(rows, tiles)` over `threads` contiguous shares of `m`'s row tiles, each writing its
/// own slice of `y`.
fn split_rows(
    m: &MxMatrix,
    y: &mut [f32],
    threads: usize,
    gemv: impl Fn(&mut [f32], std::ops::Range<usize>) -> Result<(), Error> + Sync,
) -> Result<(), Error> {
    check_len("output vector", m.rows, y.len())?;
    let tiles = m.tiles();
    let threads = threads.clamp(1, tiles.max(1));
    if threads == 1 {
        return gemv(y, 0..tiles);
    }
    let per = tiles.div_ceil(threads);
    let gemv = &gemv;
    std::thread::scope(|s| {
        let handles: Vec<_> = y
            .chunks_mut(per * TILE_ROWS)
            .enumerate()
            .map(|(i, rows)| {
                let span = i * per..((i + 1) * per).min(tiles);
                s.spawn(move || gemv(rows, span))
            })
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().expect("gemv worker does not panic"))
    })
}

/// `x.round_ties_even()` for `|x| < 2^22`, without a libm call: adding and subtracting 1.5 * 2^23
/// leaves the value rounded to an integer by the FPU's default round-to-nearest-even mode.
/// (`round_ties_even` compiles to `rintf` on baseline x86-64, which lacks SSE4.1's `roundps`.)
#[inline(always)]
fn round_ties_even_small(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (x + MAGIC) - MAGIC
}

/// One block of [`Q8Activations`]: `q = round_ties_even(clamp(x * 127 / amax, -127, 127))`,
/// returning `(amax / 127, sum(q))`, or `(NaN, 0)` with zero codes when a value is not finite.
/// Written so the compiler vectorizes it (a prefill quantizes every linear layer's input): the
/// largest magnitude as the largest of the values' bits with the sign cleared (for non-negative
/// floats the bits order as the values do, and an infinity or NaN has larger bits than any
/// finite value), and the rounding as the integer in the low bits of `x + 1.5 * 2^23`.
fn quantize_block_q8(xb: &[f32; BLOCK], qb: &mut [i8; BLOCK]) -> (f32, i32) {
    const MAGIC: f32 = 12_582_912.0;
    let amax_bits = xb
        .iter()
        .fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
    if amax_bits >= f32::INFINITY.to_bits() {
        qb.fill(0);
        return (f32::NAN, 0);
    }
    let amax = f32::from_bits(amax_bits);
    let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    if !inv.is_finite() {
        // A block of magnitudes under 127 / f32::MAX (about 4e-37): the scaled values are
        // infinite or NaN, which the definition clamps and rounds its own way.
        let mut sum = 0i32;
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = round_ties_even_small((v * inv).clamp(-127.0, 127.0)) as i8;
            sum += i32::from(*q);
        }
        return (amax / 127.0, sum);
    }
    let mut sum = 0i32;
    for (q, &v) in qb.iter_mut().zip(xb) {
        // |v * inv| <= 127 but for rounding, far inside the magic number's exact range.
        let r = ((v * inv + MAGIC).to_bits() as i32 - MAGIC.to_bits() as i32).clamp(-127, 127);
        *q = r as i8;
        sum += r;
    }
    (amax / 127.0, sum)
}

#[cfg(test)]
mod rounding_tests {
    /// The vectorizable block quantizer gives the scalar definition's codes, scale and sum.
    #[test]
    fn block_quantization_matches_its_definition() {
        let reference = |xb: &[f32; 32]| -> (f32, i32, [i8; 32]) {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            if !xb.iter().all(|v| v.is_finite()) {
                return (f32::NAN, 0, [0; 32]);
            }
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            let q: [i8; 32] = std::array::from_fn(|i| {
                super::round_ties_even_small((xb[i] * inv).clamp(-127.0, 127.0)) as i8
            });
            (amax / 127.0, q.iter().map(|&v| i32::from(v)).sum(), q)
        };
        let mut state = 0x9e37_79b9u32;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state
        };
        let specials = [
            0.0,
            -0.0,
            f32::MIN_POSITIVE,
            1e-40,
            -1e-40,
            f32::MAX,
            -f32::MAX,
            1.0,
            -1.0,
            0.5,
        ];
        for case in 0..20_000 {
            let mut xb: [f32; 32] = std::array::from_fn(|_| {
                let scale = 10f32.powi((next() % 13) as i32 - 6);
                (next() as f32 / u32::MAX as f32 * 2.0 - 1.0) * scale
            });
            match case % 7 {
                0 => xb[(next() % 32) as usize] = specials[(next() % 10) as usize],
                1 => xb = [0.0; 32],
                4 => {
                    // Magnitudes so small that 127 / amax is infinite.
                    xb = [0.0; 32];
                    xb[(next() % 32) as usize] = 1e-40;
                    xb[(next() % 32) as usize] = -3e-39;
                }
                2 => {
                    xb[(next() % 32) as usize] = [f32::NAN, f32::INFINITY, -f32::INFINITY][case % 3]
                }
                3 => {
                    // A value whose scaled magnitude lands on a rounding tie.
                    xb[0] = 127.0;
                    xb[1] = 0.5;
                    xb[2] = -2.5;
                }
                _ => {}
            }
            let mut q = [0i8; 32];
            let (d, sum) = super::quantize_block_q8(&xb, &mut q);
            let (want_d, want_sum, want_q) = reference(&xb);
            assert_eq!(d.to_bits(), want_d.to_bits(), "{xb:?}");
            assert_eq!((sum, q), (want_sum, want_q), "{xb:?}");
        }
    }

    #[test]
    fn magic_rounding_matches_round_ties_even() {
        let mut x = -130.0f32;
        while x < 130.0 {
            assert_eq!(super::round_ties_even_small(x), x.round_ties_even(), "{x}");
            x += 0.125 / 3.0;
        }
        for x in [0.5f32, 1.5, 2.5, -0.5, -1.5, 126.5, -126.5] {
            assert_eq!(super::round_ties_even_small(x), x.round_ties_even(), "{x}");
        }
    }
}
