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
    // Monomorphise on format and batch size so the block loop has no branches and the
    // accumulators live in registers.
    macro_rules! batch {
        ($bits:literal) => {
            match xs.len() {
                1 => q8_tile_n::<$bits, 1>(map, codes, scales, xs, acc),
                2 => q8_tile_n::<$bits, 2>(map, codes, scales, xs, acc),
                3 => q8_tile_n::<$bits, 3>(map, codes, scales, xs, acc),
                4 => q8_tile_n::<$bits, 4>(map, codes, scales, xs, acc),
                5 => q8_tile_n::<$bits, 5>(map, codes, scales, xs, acc),
                6 => q8_tile_n::<$bits, 6>(map, codes, scales, xs, acc),
                7 => q8_tile_n::<$bits, 7>(map, codes, scales, xs, acc),
                _ => q8_tile_n::<$bits, 8>(map, codes, scales, xs, acc),
            }
        };
    }
    match format.bits() {
        4 => batch!(4),
        6 => batch!(6),
        _ => batch!(8),
    }
}

/// How far ahead of the current tile-block the kernels prefetch.
const PREFETCH_AHEAD: usize = 2048;

/// A prefetch hint for the line holding `p`, which may point anywhere (a hint never faults).
#[inline(always)]
fn prefetch(p: *const u8) {
    // SAFETY: PREFETCHT0 is a hint: it never faults and has no architectural effect, whatever
    // the address, so any pointer value is sound.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
}

/// [`q8_tile`] for codes of `BITS` bits and a batch of exactly `N` columns.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma")]
fn q8_tile_n<const BITS: u32, const N: usize>(
    map: &IntMap,
    codes: &[u8],
    scales: &[u8],
    xs: &[&Q8Activations],
    acc: &mut [[f32; TILE_ROWS]],
) {
    let tb_bytes = TILE_ROWS * BLOCK * BITS as usize / 8;
    let blocks = scales.len() / TILE_ROWS;
    assert!(codes.len() == blocks * tb_bytes && xs.len() == N && acc.len() == N);
    let cols = blocks * BLOCK;
    let xs: [&Q8Activations; N] = std::array::from_fn(|j| xs[j]);
    assert!(
        xs.iter()
            .all(|x| x.q.len() == cols && x.d.len() == blocks && x.sums.len() == blocks)
    );
    // A 64-entry table whose entry i is the 16-entry table's entry i & 15: `vpermb` reads only
    // an index's low six bits, so a nibble needs no masking before the lookup.
    let table: __m512i = if BITS == 4 {
        bytemuck::cast::<[u8; 64], __m512i>(std::array::from_fn(|i| map.table[i & 15]))
    } else {
        bytemuck::cast(map.table)
    };
    let mut sums = [_mm512_setzero_ps(); N];
    for b in 0..blocks {
        // Ask for the data PREFETCH_AHEAD bytes on (often the next tile's, which is contiguous)
        // so a single thread keeps enough misses in flight to stream from DRAM.
        for line in 0..tb_bytes / 64 {
            prefetch(
                codes
                    .as_ptr()
                    .wrapping_add(b * tb_bytes + PREFETCH_AHEAD + 64 * line),
            );
        }
        let tile: &[[u8; 64]] = bytemuck::cast_slice(&codes[b * tb_bytes..(b + 1) * tb_bytes]);
        let load = |i: usize| -> __m512i { bytemuck::cast(tile[i]) };
        let mut w = [_mm512_setzero_si512(); 8];
        if BITS == 4 {
            for p in 0..4 {
                let z = load(p);
                w[2 * p] = _mm512_permutexvar_epi8(z, table);
                w[2 * p + 1] = _mm512_permutexvar_epi8(_mm512_srli_epi16::<4>(z), table);
            }
        } else if BITS == 6 {
            // Code bits 0-3 from the nibble planes, bits 4-5 from the high planes, merged with
            // one bit-select (`vpternlogd` 0xE4: (A & C) | (B & !C) with C = 0x0F); `vpermb`
            // ignores bits 6-7, so nothing else needs clearing.
            let low_bits = _mm512_set1_epi8(0x0F);
            let (h0, h1) = (load(4), load(5));
            let high = [
                _mm512_slli_epi16::<4>(h0),
                _mm512_slli_epi16::<2>(h0),
                h0,
                _mm512_srli_epi16::<2>(h0),
                _mm512_slli_epi16::<4>(h1),
                _mm512_slli_epi16::<2>(h1),
                h1,
                _mm512_srli_epi16::<2>(h1),
            ];
            for p in 0..4 {
                let z = load(p);
                let nibbles = [z, _mm512_srli_epi16::<4>(z)];
                for (k, n) in nibbles.into_iter().enumerate() {
                    let g = 2 * p + k;
                    let code = _mm512_ternarylogic_epi32::<0xE4>(n, high[g], low_bits);
                    w[g] = _mm512_permutexvar_epi8(code, table);
                }
            }
        } else {
            for (g, wg) in w.iter_mut().enumerate() {
                *wg = _mm512_xor_si512(load(g), _mm512_set1_epi8(-128));
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
        let scale_w = _mm512_castsi512_ps(_mm512_mask_mov_epi32(
            bits,
            zero,
            _mm512_set1_epi32(0x0040_0000),
        ));
        for j in 0..N {
            let x = xs[j];
            let q: &[i32; 8] = bytemuck::cast_ref(
                <&[i8; BLOCK]>::try_from(&x.q[b * BLOCK..(b + 1) * BLOCK]).expect("32 activations"),
            );
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

/// Codes of one 64-byte group: byte `4r + i` is element `4g + i` of row `r`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma")]
fn raw_groups(format: ElemFormat, tile: &[[u8; 64]]) -> [__m512i; 8] {
    let load = |i: usize| -> __m512i { bytemuck::cast(tile[i]) };
    let nibble = _mm512_set1_epi8(0x0F);
    let mut c = [_mm512_setzero_si512(); 8];
    match format.bits() {
        8 => {
            for (g, cg) in c.iter_mut().enumerate() {
                *cg = load(g);
            }
        }
        _ => {
            for p in 0..4 {
                let z = load(p);
                c[2 * p] = _mm512_and_si512(z, nibble);
                c[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16::<4>(z), nibble);
            }
            if format.bits() == 6 {
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
                        c[g] = _mm512_or_si512(c[g], _mm512_slli_epi16::<4>(part));
                    }
                }
            }
        }
    }
    c
}

/// Element values (unscaled) of sixteen codes, one per 32-bit lane.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma")]
fn decode16(format: ElemFormat, table: &[__m512; 4], codes: __m512i) -> __m512 {
    match format {
        ElemFormat::Int8 => {
            // Sign-extend the byte; the 1/64 is folded into the block scale by the caller.
            _mm512_cvtepi32_ps(_mm512_srai_epi32::<24>(_mm512_slli_epi32::<24>(codes)))
        }
        ElemFormat::Fp4E2M1 => _mm512_permutexvar_ps(codes, table[0]),
        ElemFormat::Fp6E2M3 | ElemFormat::Fp6E3M2 => {
            let low = _mm512_permutex2var_ps(table[0], codes, table[1]);
            let high = _mm512_permutex2var_ps(table[2], codes, table[3]);
            let upper_half = _mm512_test_epi32_mask(codes, _mm512_set1_epi32(32));
            _mm512_mask_blend_ps(upper_half, low, high)
        }
        ElemFormat::Fp8E4M3 | ElemFormat::Fp8E5M2 => {
            let lo: __m256i = _mm512_castsi512_si256(codes);
            let hi: __m256i = _mm512_extracti64x4_epi64::<1>(codes);
            let a = crate::x86::avx2::decode(format, lo);
            let b = crate::x86::avx2::decode(format, hi);
            let both = _mm512_insertf64x4::<1>(
                _mm512_castpd256_pd512(_mm256_castps_pd(a)),
                _mm256_castps_pd(b),
            );
            _mm512_castpd_ps(both)
        }
    }
}

/// The f32-activation tile kernel: `acc[j][r] = sum_k W[r][k] * x_j[k]` over the tile's
/// blocks. Each block's 16x32 products are summed with FMAs per element column, then scaled by
/// the rows' block scales into the accumulators.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma")]
pub(crate) fn f32_tile(
    format: ElemFormat,
    codes: &[u8],
    scales: &[u8],
    xs: &[&[f32]],
    acc: &mut [[f32; TILE_ROWS]],
) {
    debug_assert!(xs.len() <= MAX_BATCH && xs.len() == acc.len());
    let tb_bytes = TILE_ROWS * BLOCK * format.bits() as usize / 8;
    let blocks = scales.len() / TILE_ROWS;
    let mut values = [0f32; 64];
    for (code, v) in values
        .iter_mut()
        .enumerate()
        .take(format.code_count().min(64))
    {
        *v = crate::reference::decode_elem(format, code as u8);
    }
    let table: [__m512; 4] = bytemuck::cast(values);
    let unit = if format == ElemFormat::Int8 {
        1.0 / 64.0
    } else {
        1.0
    };
    let mut sums = [_mm512_setzero_ps(); MAX_BATCH];
    for b in 0..blocks {
        let tile: &[[u8; 64]] = bytemuck::cast_slice(&codes[b * tb_bytes..(b + 1) * tb_bytes]);
        let groups = raw_groups(format, tile);
        let mut w = [_mm512_setzero_ps(); BLOCK];
        for (g, &cg) in groups.iter().enumerate() {
            w[4 * g] = decode16(
                format,
                &table,
                _mm512_and_si512(cg, _mm512_set1_epi32(0xFF)),
            );
            w[4 * g + 1] = decode16(
                format,
                &table,
                _mm512_and_si512(_mm512_srli_epi32::<8>(cg), _mm512_set1_epi32(0xFF)),
            );
            w[4 * g + 2] = decode16(
                format,
                &table,
                _mm512_and_si512(_mm512_srli_epi32::<16>(cg), _mm512_set1_epi32(0xFF)),
            );
            w[4 * g + 3] = decode16(format, &table, _mm512_srli_epi32::<24>(cg));
        }
        let s = _mm512_cvtepu8_epi32(bytemuck::cast::<[u8; 16], __m128i>(
            scales[b * TILE_ROWS..(b + 1) * TILE_ROWS]
                .try_into()
                .expect("16 scales"),
        ));
        let bits = _mm512_slli_epi32::<23>(s);
        let zero = _mm512_cmpeq_epi32_mask(s, _mm512_setzero_si512());
        let bits = _mm512_mask_mov_epi32(bits, zero, _mm512_set1_epi32(0x0040_0000));
        let scale_w = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(unit));
        for (j, x) in xs.iter().enumerate() {
            let xb = &x[b * BLOCK..(b + 1) * BLOCK];
            let mut dot = _mm512_setzero_ps();
            for (wk, &xk) in w.iter().zip(xb) {
                dot = _mm512_fmadd_ps(*wk, _mm512_set1_ps(xk), dot);
            }
            sums[j] = _mm512_fmadd_ps(dot, scale_w, sums[j]);
        }
    }
    for (a, s) in acc.iter_mut().zip(sums) {
        *a = bytemuck::cast(s);
    }
}
