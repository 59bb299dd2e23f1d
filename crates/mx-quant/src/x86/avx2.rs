//! AVX2 block quantize and dequantize, bit-exact with [`crate::reference`].
//!
//! The element rounding is done the way the reference defines it, eight lanes at a time: each
//! scaled magnitude `a` is multiplied by `2^(mb - e)` (its binade's quantum, exact), rounded to an
//! integer with `vroundps` (ties to even) or truncation plus a comparison of the exact fraction
//! with 1/2 (ties away), and scaled back. Codes are then read off the rounded value's f32 bits: for a
//! normal the exponent and top mantissa bits are contiguous, so one shift and one re-bias give
//! the element code; a subnormal's code is its count of quanta.
//!
//! Loads and stores go through `bytemuck` casts of arrays, so the only unsafe code is the call
//! into a `#[target_feature]` function, made by the dispatcher after detecting the feature.

use core::arch::x86_64::*;

use crate::format::{BLOCK, ElemFormat, Rounding, SCALE_BIAS, SCALE_NAN, ScaleRule};
use crate::reference::{self, pow2_f32};

/// Quantizes one block; `rule` is [`ScaleRule::Floor`] or [`ScaleRule::Rceil`].
#[target_feature(enable = "avx2,fma")]
pub(crate) fn quantize_block(
    format: ElemFormat,
    rounding: Rounding,
    rule: ScaleRule,
    block: &[f32; BLOCK],
) -> (u8, [u8; BLOCK]) {
    let x: [__m256; 4] = bytemuck::cast(*block);
    let abs_mask = _mm256_set1_epi32(0x7FFF_FFFF);
    let mut amax = _mm256_setzero_ps();
    let mut non_finite = _mm256_setzero_si256();
    for v in x {
        let bits = _mm256_and_si256(_mm256_castps_si256(v), abs_mask);
        non_finite = _mm256_or_si256(
            non_finite,
            _mm256_cmpgt_epi32(bits, _mm256_set1_epi32(0x7F7F_FFFF)),
        );
        amax = _mm256_max_ps(amax, _mm256_castsi256_ps(bits));
    }
    if _mm256_movemask_epi8(non_finite) != 0 {
        return (SCALE_NAN, [0; BLOCK]);
    }
    let amax = hmax(amax);
    let exponent = reference::shared_exponent(format, rule, amax);
    let inv_scale = _mm256_set1_ps(pow2_f32(-exponent));
    let mut codes = [_mm256_setzero_si256(); 4];
    for (c, v) in codes.iter_mut().zip(x) {
        *c = encode(format, rounding, _mm256_mul_ps(v, inv_scale));
    }
    let words_ab = _mm256_packus_epi32(codes[0], codes[1]);
    let words_cd = _mm256_packus_epi32(codes[2], codes[3]);
    let bytes = _mm256_packus_epi16(words_ab, words_cd);
    // packus works within 128-bit lanes: undo the interleave of 4-byte groups.
    let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    ((exponent + SCALE_BIAS) as u8, bytemuck::cast(bytes))
}

/// Codes (one per 32-bit lane) of eight scaled elements.
#[target_feature(enable = "avx2,fma")]
fn encode(format: ElemFormat, rounding: Rounding, scaled: __m256) -> __m256i {
    let sign = _mm256_and_si256(_mm256_castps_si256(scaled), _mm256_set1_epi32(i32::MIN));
    let a = _mm256_and_ps(scaled, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF)));
    let a = _mm256_min_ps(a, _mm256_set1_ps(format.max_normal()));
    let round = |t: __m256| match rounding {
        Rounding::NearestEven => {
            _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t)
        }
        Rounding::NearestAway => {
            // t >= 0: its integer part, plus one where the (exactly computed) fraction is >= 1/2.
            // `floor(t + 0.5)` would be wrong: the add rounds when t has bits below 2^-24.
            let whole = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(t);
            let half_up = _mm256_cmp_ps::<_CMP_GE_OQ>(_mm256_sub_ps(t, whole), _mm256_set1_ps(0.5));
            _mm256_add_ps(whole, _mm256_and_ps(half_up, _mm256_set1_ps(1.0)))
        }
    };
    if format == ElemFormat::Int8 {
        let k = round(_mm256_mul_ps(a, _mm256_set1_ps(64.0)));
        let k = _mm256_cvtps_epi32(_mm256_min_ps(k, _mm256_set1_ps(127.0)));
        // Negate where the input was negative (sign_epi32 keys on the sign of its second operand;
        // a zero k stays zero either way).
        let k = _mm256_sign_epi32(k, _mm256_or_si256(sign, _mm256_set1_epi32(1)));
        return _mm256_and_si256(k, _mm256_set1_epi32(0xFF));
    }
    let mb = format.mant_bits() as i32;
    let emin = format.emin();
    let bias = format.exp_bias();
    // e = max(floor(log2 a), emin); a == 0 reads as e = -127 and is lifted to emin.
    let e = _mm256_sub_epi32(
        _mm256_srli_epi32::<23>(_mm256_castps_si256(a)),
        _mm256_set1_epi32(127),
    );
    let e = _mm256_max_epi32(e, _mm256_set1_epi32(emin));
    let down = _mm256_slli_epi32::<23>(_mm256_sub_epi32(_mm256_set1_epi32(127 + mb), e));
    let up = _mm256_slli_epi32::<23>(_mm256_add_epi32(e, _mm256_set1_epi32(127 - mb)));
    let t = round(_mm256_mul_ps(a, _mm256_castsi256_ps(down)));
    let r = _mm256_mul_ps(t, _mm256_castsi256_ps(up));
    let rbits = _mm256_castps_si256(r);
    let normal = _mm256_sub_epi32(
        _mm256_srlv_epi32(rbits, _mm256_set1_epi32(23 - mb)),
        _mm256_set1_epi32((127 - bias) << mb),
    );
    let subnormal = _mm256_cvtps_epi32(_mm256_mul_ps(r, _mm256_set1_ps(pow2_f32(mb - emin))));
    let is_normal = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(
        r,
        _mm256_set1_ps(pow2_f32(emin)),
    ));
    let magnitude = _mm256_blendv_epi8(subnormal, normal, is_normal);
    let sign = _mm256_srlv_epi32(sign, _mm256_set1_epi32(32 - format.bits() as i32));
    _mm256_or_si256(magnitude, sign)
}

#[target_feature(enable = "avx2,fma")]
fn hmax(v: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_shuffle_ps::<0b01>(m, m));
    _mm_cvtss_f32(m)
}

/// Dequantizes one block of codes (one per byte) into `out`.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn dequantize_block(
    format: ElemFormat,
    scale: u8,
    codes: &[u8; BLOCK],
    out: &mut [f32; BLOCK],
) {
    if scale == SCALE_NAN {
        *out = [f32::NAN; BLOCK];
        return;
    }
    let x = i32::from(scale) - SCALE_BIAS;
    let halves: [__m128i; 2] = bytemuck::cast(*codes);
    let mut result = [_mm256_setzero_ps(); 4];
    for (i, r) in result.iter_mut().enumerate() {
        let half = halves[i / 2];
        let eight = if i % 2 == 0 {
            half
        } else {
            _mm_srli_si128::<8>(half)
        };
        *r = if format == ElemFormat::Int8 {
            let k = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight));
            _mm256_mul_ps(k, _mm256_set1_ps(pow2_f32(x - 6)))
        } else {
            _mm256_mul_ps(
                decode(format, _mm256_cvtepu8_epi32(eight)),
                _mm256_set1_ps(pow2_f32(x)),
            )
        };
    }
    *out = bytemuck::cast(result);
}

/// Element values (unscaled) of eight FP codes, one per 32-bit lane.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn decode(format: ElemFormat, c: __m256i) -> __m256 {
    let bits = format.bits() as i32;
    let mb = format.mant_bits() as i32;
    let sign_bit = i32::from(format.sign_bit());
    let sign = _mm256_sllv_epi32(
        _mm256_and_si256(c, _mm256_set1_epi32(sign_bit)),
        _mm256_set1_epi32(32 - bits),
    );
    let mag = _mm256_and_si256(c, _mm256_set1_epi32(sign_bit - 1));
    let exp = _mm256_srlv_epi32(mag, _mm256_set1_epi32(mb));
    let mant = _mm256_and_si256(mag, _mm256_set1_epi32((1 << mb) - 1));
    let normal = _mm256_add_epi32(
        _mm256_sllv_epi32(mag, _mm256_set1_epi32(23 - mb)),
        _mm256_set1_epi32((127 - format.exp_bias()) << 23),
    );
    let subnormal = _mm256_castps_si256(_mm256_mul_ps(
        _mm256_cvtepi32_ps(mant),
        _mm256_set1_ps(pow2_f32(format.emin() - mb)),
    ));
    let is_sub = _mm256_cmpeq_epi32(exp, _mm256_setzero_si256());
    let mut value = _mm256_blendv_epi8(normal, subnormal, is_sub);
    match format {
        ElemFormat::Fp8E4M3 => {
            let nan = _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F));
            value = _mm256_blendv_epi8(value, _mm256_set1_epi32(0x7FC0_0000), nan);
        }
        ElemFormat::Fp8E5M2 => {
            let special = _mm256_cmpeq_epi32(exp, _mm256_set1_epi32(31));
            let inf_nan = _mm256_or_si256(
                _mm256_set1_epi32(0x7F80_0000),
                _mm256_slli_epi32::<21>(mant),
            );
            value = _mm256_blendv_epi8(value, inf_nan, special);
        }
        _ => {}
    }
    _mm256_castsi256_ps(_mm256_or_si256(value, sign))
}

/// The int8-activation tile kernel on AVX2, bit-exact with [`crate::gemv::q8_tile_scalar`]:
/// each 64-byte group is two registers of eight rows; `vpmaddubsw` + `vpmaddwd` stand in for
/// `vpdpbusd`. The products are small enough that the 16-bit pair sums never saturate: FP4's
/// unsigned codes are at most 24 and FP6's 120 (`2 * 120 * 127 < 2^15`); INT8 takes the sign
/// trick instead of an offset (`|w| * sign(q, w)`, `2 * 128 * 127 < 2^15`), which yields the same
/// integer dot product as the offset form.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn q8_tile(
    format: ElemFormat,
    map: &crate::gemv::IntMap,
    codes: &[u8],
    scales: &[u8],
    xs: &[&crate::gemv::Q8Activations],
    acc: &mut [[f32; crate::gemv::TILE_ROWS]],
) {
    use crate::gemv::TILE_ROWS;
    let tb_bytes = TILE_ROWS * BLOCK * format.bits() as usize / 8;
    let blocks = scales.len() / TILE_ROWS;
    assert!(codes.len() == blocks * tb_bytes && xs.len() == acc.len());
    let cols = blocks * BLOCK;
    assert!(
        xs.iter()
            .all(|x| x.q.len() == cols && x.d.len() == blocks && x.sums.len() == blocks)
    );
    let tables: [__m256i; 4] = std::array::from_fn(|t| {
        let sub: [u8; 16] = map.table[16 * t..16 * t + 16]
            .try_into()
            .expect("16 entries");
        bytemuck::cast([sub, sub])
    });
    let nibble = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let int8 = format == ElemFormat::Int8;
    for a in acc.iter_mut() {
        *a = [0.0; TILE_ROWS];
    }
    for b in 0..blocks {
        let tile: &[[__m256i; 2]] = bytemuck::cast_slice(&codes[b * tb_bytes..(b + 1) * tb_bytes]);
        // w[g][half]: 32 bytes = 8 rows x 4 elements of group g.
        let mut w = [[_mm256_setzero_si256(); 2]; 8];
        for h in 0..2 {
            match format.bits() {
                8 => {
                    for (g, wg) in w.iter_mut().enumerate() {
                        wg[h] = tile[g][h];
                    }
                }
                _ => {
                    for p in 0..4 {
                        let z = tile[p][h];
                        w[2 * p][h] = _mm256_and_si256(z, nibble);
                        w[2 * p + 1][h] = _mm256_and_si256(_mm256_srli_epi16::<4>(z), nibble);
                    }
                    if format.bits() == 6 {
                        for q in 0..2 {
                            let hp = tile[4 + q][h];
                            for j in 0..4 {
                                let g = 4 * q + j;
                                let top = _mm256_and_si256(
                                    _mm256_srlv_epi32(hp, _mm256_set1_epi32(2 * j as i32)),
                                    _mm256_set1_epi8(0x03),
                                );
                                w[g][h] = _mm256_or_si256(w[g][h], _mm256_slli_epi16::<4>(top));
                            }
                        }
                    }
                    for wg in &mut w {
                        wg[h] = lookup(&tables, format.bits(), wg[h]);
                    }
                }
            }
        }
        let s: [u8; 16] = scales[b * TILE_ROWS..(b + 1) * TILE_ROWS]
            .try_into()
            .expect("16 scales");
        let s: __m128i = bytemuck::cast(s);
        let scale_w = [
            scale_f32(_mm256_cvtepu8_epi32(s)),
            scale_f32(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(s))),
        ];
        for (x, a) in xs.iter().zip(acc.iter_mut()) {
            let q: &[i32; 8] = bytemuck::cast_ref(
                <&[i8; BLOCK]>::try_from(&x.q[b * BLOCK..(b + 1) * BLOCK]).expect("32 activations"),
            );
            let f = _mm256_set1_ps(x.d[b] * map.unit);
            let correction = if int8 { 0 } else { map.offset * x.sums[b] };
            let mut out: [__m256; 2] = bytemuck::cast(*a);
            for h in 0..2 {
                let mut isum = _mm256_setzero_si256();
                for (g, wg) in w.iter().enumerate() {
                    let xq = _mm256_set1_epi32(q[g]);
                    let pairs = if int8 {
                        _mm256_maddubs_epi16(_mm256_abs_epi8(wg[h]), _mm256_sign_epi8(xq, wg[h]))
                    } else {
                        _mm256_maddubs_epi16(wg[h], xq)
                    };
                    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(pairs, ones));
                }
                isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(correction));
                let fw = _mm256_mul_ps(scale_w[h], f);
                out[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), fw, out[h]);
            }
            *a = bytemuck::cast(out);
        }
    }
}

/// Unsigned bytes for 4- or 6-bit codes through 16-entry `vpshufb` tables (6-bit codes pick
/// among four tables by bits 4 and 5).
#[target_feature(enable = "avx2,fma")]
fn lookup(tables: &[__m256i; 4], bits: u32, code: __m256i) -> __m256i {
    if bits == 4 {
        return _mm256_shuffle_epi8(tables[0], code);
    }
    let idx = _mm256_and_si256(code, _mm256_set1_epi8(0x0F));
    let bit4 = _mm256_slli_epi16::<3>(code);
    let bit5 = _mm256_slli_epi16::<2>(code);
    let t01 = _mm256_blendv_epi8(
        _mm256_shuffle_epi8(tables[0], idx),
        _mm256_shuffle_epi8(tables[1], idx),
        bit4,
    );
    let t23 = _mm256_blendv_epi8(
        _mm256_shuffle_epi8(tables[2], idx),
        _mm256_shuffle_epi8(tables[3], idx),
        bit4,
    );
    _mm256_blendv_epi8(t01, t23, bit5)
}

/// E8M0 bytes (one per 32-bit lane) as f32 scales: 0 is 2^-127, 255 reads as +Inf.
#[target_feature(enable = "avx2,fma")]
fn scale_f32(e: __m256i) -> __m256 {
    let bits = _mm256_slli_epi32::<23>(e);
    let zero = _mm256_cmpeq_epi32(e, _mm256_setzero_si256());
    _mm256_castsi256_ps(_mm256_blendv_epi8(
        bits,
        _mm256_set1_epi32(0x0040_0000),
        zero,
    ))
}

/// The f32-activation tile kernel on AVX2, bit-exact with [`crate::gemv::f32_tile_scalar`].
#[target_feature(enable = "avx2,fma")]
pub(crate) fn f32_tile(
    format: ElemFormat,
    codes: &[u8],
    scales: &[u8],
    xs: &[&[f32]],
    acc: &mut [[f32; crate::gemv::TILE_ROWS]],
) {
    use crate::gemv::TILE_ROWS;
    let tb_bytes = TILE_ROWS * BLOCK * format.bits() as usize / 8;
    let blocks = scales.len() / TILE_ROWS;
    assert!(codes.len() == blocks * tb_bytes && xs.len() == acc.len());
    assert!(xs.iter().all(|x| x.len() == blocks * BLOCK));
    let unit = if format == ElemFormat::Int8 {
        1.0 / 64.0
    } else {
        1.0
    };
    for a in acc.iter_mut() {
        *a = [0.0; TILE_ROWS];
    }
    let byte = _mm256_set1_epi32(0xFF);
    for b in 0..blocks {
        let tile: &[[__m256i; 2]] = bytemuck::cast_slice(&codes[b * tb_bytes..(b + 1) * tb_bytes]);
        let s: [u8; 16] = scales[b * TILE_ROWS..(b + 1) * TILE_ROWS]
            .try_into()
            .expect("16 scales");
        let s: __m128i = bytemuck::cast(s);
        let scale_w = [
            scale_f32(_mm256_cvtepu8_epi32(s)),
            scale_f32(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(s))),
        ];
        for h in 0..2 {
            // Element values of this half tile: w[k] holds element k of eight rows.
            let mut w = [_mm256_setzero_ps(); BLOCK];
            for g in 0..8 {
                let raw = match format.bits() {
                    8 => tile[g][h],
                    _ => {
                        let z = tile[g / 2][h];
                        let n = if g % 2 == 0 {
                            z
                        } else {
                            _mm256_srli_epi16::<4>(z)
                        };
                        let mut c = _mm256_and_si256(n, _mm256_set1_epi8(0x0F));
                        if format.bits() == 6 {
                            let hp = tile[4 + g / 4][h];
                            let top = _mm256_and_si256(
                                _mm256_srlv_epi32(hp, _mm256_set1_epi32(2 * (g % 4) as i32)),
                                _mm256_set1_epi8(0x03),
                            );
                            c = _mm256_or_si256(c, _mm256_slli_epi16::<4>(top));
                        }
                        c
                    }
                };
                for i in 0..4 {
                    let c = _mm256_and_si256(
                        _mm256_srlv_epi32(raw, _mm256_set1_epi32(8 * i as i32)),
                        byte,
                    );
                    w[4 * g + i] = if format == ElemFormat::Int8 {
                        _mm256_cvtepi32_ps(_mm256_srai_epi32::<24>(_mm256_slli_epi32::<24>(c)))
                    } else {
                        decode(format, c)
                    };
                }
            }
            let sw = _mm256_mul_ps(scale_w[h], _mm256_set1_ps(unit));
            for (x, a) in xs.iter().zip(acc.iter_mut()) {
                let xb = &x[b * BLOCK..(b + 1) * BLOCK];
                let mut dot = _mm256_setzero_ps();
                for (wk, &xk) in w.iter().zip(xb) {
                    dot = _mm256_fmadd_ps(*wk, _mm256_set1_ps(xk), dot);
                }
                let mut out: [__m256; 2] = bytemuck::cast(*a);
                out[h] = _mm256_fmadd_ps(dot, sw, out[h]);
                *a = bytemuck::cast(out);
            }
        }
    }
}
