//! AVX-512 VNNI (+VBMI) tile kernel for the int8-activation GEMV/GEMM, bit-exact with
//! [`crate::gemv::q8_tile_scalar`].
//!
//! One register holds one lane per row of a 16-row tile. Per 32-column block the kernel turns
//! the tile-block's codes into unsigned bytes through the format's table (`vpshufb` for 16
//! entries, `vpermb` for 64, an xor for INT8), then eight `vpdpbusd` (weights unsigned,
//! activations signed, each activation dword broadcast) sum the block's 32 products per row.
//! The table offset is removed with the activation block's `sum(q)`, and the block's per-row
//! E8M0 scales, read straight into f32 exponents, scale the integer sums into the f32
//! accumulators with one FMA per batch column.

use core::arch::x86_64::*;

use crate::format::{BLOCK, ElemFormat};
use crate::gemv::{IntMap, MAX_BATCH, Q8Activations, TILE_ROWS};

/// Computes `acc[j][r]` for the tile whose tile-blocks are `codes` (all blocks back to back) and
/// whose scales are `scales` (16 per block), for each activation column `xs[j]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma")]
pub(crate) fn q8_tile(
    format: ElemFormat,
    map: &IntMap,
    codes: &[u8],
    scales: &[u8],
    xs: &[&Q8Activations],
    acc: &mut [[f32; TILE_ROWS]],
) {
    debug_assert!(xs.len() <= MAX_BATCH && xs.len() == acc.len());
    let tb_bytes = TILE_ROWS * BLOCK * format.bits() as usize / 8;
    let blocks = scales.len() / TILE_ROWS;
    debug_assert_eq!(codes.len(), blocks * tb_bytes);
    let table: __m512i = bytemuck::cast(map.table);
    let lut16 = _mm512_broadcast_i32x4(bytemuck::cast::<[u8; 16], __m128i>(
        map.table[..16].try_into().expect("16 bytes"),
    ));
    let nibble = _mm512_set1_epi8(0x0F);
    let mut sums = [_mm512_setzero_ps(); MAX_BATCH];
    for b in 0..blocks {
        let tile: &[[u8; 64]] = bytemuck::cast_slice(&codes[b * tb_bytes..(b + 1) * tb_bytes]);
        let load = |i: usize| -> __m512i { bytemuck::cast(tile[i]) };
        let mut w = [_mm512_setzero_si512(); 8];
        match format {
            ElemFormat::Int8 => {
                for (g, wg) in w.iter_mut().enumerate() {
                    *wg = _mm512_xor_si512(load(g), _mm512_set1_epi8(-128));
                }
            }
            ElemFormat::Fp4E2M1 => {
                for p in 0..4 {
                    let z = load(p);
                    let lo = _mm512_and_si512(z, nibble);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(z), nibble);
                    w[2 * p] = _mm512_shuffle_epi8(lut16, lo);
                    w[2 * p + 1] = _mm512_shuffle_epi8(lut16, hi);
                }
            }
            _ => {
                // FP6: low nibbles as in FP4, top two bits from the two high planes.
                for p in 0..4 {
                    let z = load(p);
                    w[2 * p] = _mm512_and_si512(z, nibble);
                    w[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16::<4>(z), nibble);
                }
                let three = _mm512_set1_epi8(0x03);
                for q in 0..2 {
                    let h = load(4 + q);
                    let parts = [
                        _mm512_and_si512(h, three),
                        _mm512_and_si512(_mm512_srli_epi16::<2>(h), three),
                        _mm512_and_si512(_mm512_srli_epi16::<4>(h), three),
                        _mm512_and_si512(_mm512_srli_epi16::<6>(h), three),
                    ];
                    for (j, part) in parts.into_iter().enumerate() {
                        let g = 4 * q + j;
                        let code = _mm512_or_si512(w[g], _mm512_slli_epi16::<4>(part));
                        w[g] = _mm512_permutexvar_epi8(code, table);
                    }
                }
            }
        }
        let s = _mm512_cvtepu8_epi32(bytemuck::cast::<[u8; 16], __m128i>(
            scales[b * TILE_ROWS..(b + 1) * TILE_ROWS]
                .try_into()
                .expect("16 scales"),
        ));
        let bits = _mm512_slli_epi32::<23>(s);
        // E8M0 0 is 2^-127, an f32 subnormal; 255 already reads as +Inf.
        let zero = _mm512_cmpeq_epi32_mask(s, _mm512_setzero_si512());
        let bits = _mm512_mask_mov_epi32(bits, zero, _mm512_set1_epi32(0x0040_0000));
        let scale_w = _mm512_castsi512_ps(bits);
        for (j, x) in xs.iter().enumerate() {
            let q: &[i32] = bytemuck::cast_slice(&x.q[b * BLOCK..(b + 1) * BLOCK]);
            let mut isum = _mm512_setzero_si512();
            for (g, &wg) in w.iter().enumerate() {
                isum = _mm512_dpbusd_epi32(isum, wg, _mm512_set1_epi32(q[g]));
            }
            isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(map.offset * x.sums[b]));
            let f = _mm512_mul_ps(scale_w, _mm512_set1_ps(x.d[b] * map.unit));
            sums[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), f, sums[j]);
        }
    }
    for (a, s) in acc.iter_mut().zip(sums) {
        *a = bytemuck::cast(s);
    }
}
