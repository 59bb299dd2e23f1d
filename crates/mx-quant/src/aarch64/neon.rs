//! NEON block quantize/dequantize and the int8-activation tile kernel, bit-exact with the
//! scalar reference and [`crate::gemv::q8_tile_scalar`] (the same algorithm as `x86/avx2.rs`,
//! four lanes at a time).
//!
//! The integer dot product uses signed weights (`v * 2^k`, at most 127 in magnitude) with
//! `smull`/`smull2` and pairwise adds (`2 * 127 * 127 < 2^15`, so the 16-bit pair sums never
//! overflow), which gives exactly the integer the offset form of the other kernels computes.
//! (`sdot` would do it in one instruction, but its intrinsic is not yet stable Rust.)

use core::arch::aarch64::*;

use crate::format::{BLOCK, ElemFormat, Rounding, SCALE_BIAS, SCALE_NAN, ScaleRule};
use crate::gemv::{IntMap, Q8Activations, TILE_ROWS};
use crate::reference::{self, pow2_f32};

#[target_feature(enable = "neon")]
pub(crate) fn quantize_block(
    format: ElemFormat,
    rounding: Rounding,
    rule: ScaleRule,
    block: &[f32; BLOCK],
) -> (u8, [u8; BLOCK]) {
    let x: [float32x4_t; 8] = bytemuck::cast(*block);
    let mut amax = vdupq_n_f32(0.0);
    let mut non_finite = vdupq_n_u32(0);
    for v in x {
        let a = vabsq_f32(v);
        // Inf and NaN have all exponent bits set: their magnitude bits exceed f32::MAX's.
        non_finite = vorrq_u32(
            non_finite,
            vcgtq_u32(vreinterpretq_u32_f32(a), vdupq_n_u32(0x7F7F_FFFF)),
        );
        amax = vmaxq_f32(amax, a);
    }
    if vmaxvq_u32(non_finite) != 0 {
        return (SCALE_NAN, [0; BLOCK]);
    }
    let exponent = reference::shared_exponent(format, rule, vmaxvq_f32(amax));
    let inv = vdupq_n_f32(pow2_f32(-exponent));
    let mut codes = [0u8; BLOCK];
    for (chunk, v) in codes.chunks_exact_mut(4).zip(x) {
        let c: [u32; 4] = bytemuck::cast(encode(format, rounding, vmulq_f32(v, inv)));
        for (o, c) in chunk.iter_mut().zip(c) {
            *o = c as u8;
        }
    }
    ((exponent + SCALE_BIAS) as u8, codes)
}

#[target_feature(enable = "neon")]
fn encode(format: ElemFormat, rounding: Rounding, scaled: float32x4_t) -> uint32x4_t {
    let sign = vandq_u32(vreinterpretq_u32_f32(scaled), vdupq_n_u32(0x8000_0000));
    let a = vminq_f32(vabsq_f32(scaled), vdupq_n_f32(format.max_normal()));
    let round = |t: float32x4_t| match rounding {
        Rounding::NearestEven => vrndnq_f32(t),
        // Ties away from zero for t >= 0 is exactly `vrndaq`.
        Rounding::NearestAway => vrndaq_f32(t),
    };
    if format == ElemFormat::Int8 {
        let k = vminq_f32(round(vmulq_f32(a, vdupq_n_f32(64.0))), vdupq_n_f32(127.0));
        let k = vcvtq_s32_f32(k);
        let negative = vceqq_u32(sign, vdupq_n_u32(0x8000_0000));
        let k = vbslq_s32(negative, vnegq_s32(k), k);
        return vandq_u32(vreinterpretq_u32_s32(k), vdupq_n_u32(0xFF));
    }
    let mb = format.mant_bits() as i32;
    let emin = format.emin();
    let bias = format.exp_bias();
    let e = vsubq_s32(
        vreinterpretq_s32_u32(vshrq_n_u32::<23>(vreinterpretq_u32_f32(a))),
        vdupq_n_s32(127),
    );
    let e = vmaxq_s32(e, vdupq_n_s32(emin));
    let down = vshlq_n_s32::<23>(vsubq_s32(vdupq_n_s32(127 + mb), e));
    let up = vshlq_n_s32::<23>(vaddq_s32(e, vdupq_n_s32(127 - mb)));
    let t = round(vmulq_f32(a, vreinterpretq_f32_s32(down)));
    let r = vmulq_f32(t, vreinterpretq_f32_s32(up));
    let rbits = vreinterpretq_u32_f32(r);
    // Variable right shifts are left shifts by a negative count on NEON.
    let normal = vsubq_u32(
        vshlq_u32(rbits, vdupq_n_s32(-(23 - mb))),
        vdupq_n_u32(((127 - bias) << mb) as u32),
    );
    let subnormal = vcvtnq_u32_f32(vmulq_f32(r, vdupq_n_f32(pow2_f32(mb - emin))));
    let is_normal = vcgeq_f32(r, vdupq_n_f32(pow2_f32(emin)));
    let magnitude = vbslq_u32(is_normal, normal, subnormal);
    let sign = vshlq_u32(sign, vdupq_n_s32(-(32 - format.bits() as i32)));
    vorrq_u32(magnitude, sign)
}

#[target_feature(enable = "neon")]
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
    let mut result = [vdupq_n_f32(0.0); 8];
    for (r, c) in result.iter_mut().zip(codes.chunks_exact(4)) {
        let c: uint32x4_t = bytemuck::cast([
            u32::from(c[0]),
            u32::from(c[1]),
            u32::from(c[2]),
            u32::from(c[3]),
        ]);
        *r = if format == ElemFormat::Int8 {
            let k = vshrq_n_s32::<24>(vshlq_n_s32::<24>(vreinterpretq_s32_u32(c)));
            vmulq_f32(vcvtq_f32_s32(k), vdupq_n_f32(pow2_f32(x - 6)))
        } else {
            vmulq_f32(decode(format, c), vdupq_n_f32(pow2_f32(x)))
        };
    }
    *out = bytemuck::cast(result);
}

#[target_feature(enable = "neon")]
fn decode(format: ElemFormat, c: uint32x4_t) -> float32x4_t {
    let bits = format.bits() as i32;
    let mb = format.mant_bits() as i32;
    let sign_bit = u32::from(format.sign_bit());
    let sign = vshlq_u32(vandq_u32(c, vdupq_n_u32(sign_bit)), vdupq_n_s32(32 - bits));
    let mag = vandq_u32(c, vdupq_n_u32(sign_bit - 1));
    let exp = vshlq_u32(mag, vdupq_n_s32(-mb));
    let mant = vandq_u32(mag, vdupq_n_u32((1 << mb) - 1));
    let normal = vaddq_u32(
        vshlq_u32(mag, vdupq_n_s32(23 - mb)),
        vdupq_n_u32(((127 - format.exp_bias()) as u32) << 23),
    );
    let subnormal = vreinterpretq_u32_f32(vmulq_f32(
        vcvtq_f32_u32(mant),
        vdupq_n_f32(pow2_f32(format.emin() - mb)),
    ));
    let is_sub = vceqq_u32(exp, vdupq_n_u32(0));
    let mut value = vbslq_u32(is_sub, subnormal, normal);
    match format {
        ElemFormat::Fp8E4M3 => {
            let nan = vceqq_u32(mag, vdupq_n_u32(0x7F));
            value = vbslq_u32(nan, vdupq_n_u32(0x7FC0_0000), value);
        }
        ElemFormat::Fp8E5M2 => {
            let special = vceqq_u32(exp, vdupq_n_u32(31));
            let inf_nan = vorrq_u32(vdupq_n_u32(0x7F80_0000), vshlq_n_u32::<21>(mant));
            value = vbslq_u32(special, inf_nan, value);
        }
        _ => {}
    }
    vreinterpretq_f32_u32(vorrq_u32(value, sign))
}

/// The int8-activation tile kernel (see the module notes for the signed-weight dot product).
#[target_feature(enable = "neon")]
pub(crate) fn q8_tile(
    format: ElemFormat,
    map: &IntMap,
    codes: &[u8],
    scales: &[u8],
    xs: &[&Q8Activations],
    acc: &mut [[f32; TILE_ROWS]],
) {
    let tb_bytes = TILE_ROWS * BLOCK * format.bits() as usize / 8;
    let blocks = scales.len() / TILE_ROWS;
    assert!(codes.len() == blocks * tb_bytes && xs.len() == acc.len());
    let cols = blocks * BLOCK;
    assert!(
        xs.iter()
            .all(|x| x.q.len() == cols && x.d.len() == blocks && x.sums.len() == blocks)
    );
    // Signed weight values: the unsigned table minus its offset (INT8 codes are already signed).
    let signed: [i8; 64] = std::array::from_fn(|i| (i32::from(map.table[i]) - map.offset) as i8);
    let t: [int8x16_t; 4] = bytemuck::cast(signed);
    let table = int8x16x4_t(t[0], t[1], t[2], t[3]);
    for a in acc.iter_mut() {
        *a = [0.0; TILE_ROWS];
    }
    for b in 0..blocks {
        let tile: &[[u8; 16]] = bytemuck::cast_slice(&codes[b * tb_bytes..(b + 1) * tb_bytes]);
        let load = |i: usize| -> uint8x16_t { bytemuck::cast(tile[i]) };
        // w[g][j]: rows 4j..4j+4, elements 4g..4g+4 of the block, as signed weights.
        let mut w = [[vdupq_n_s8(0); 4]; 8];
        for (g, wg) in w.iter_mut().enumerate() {
            for (j, wgj) in wg.iter_mut().enumerate() {
                *wgj = match format.bits() {
                    8 => vreinterpretq_s8_u8(load(4 * g + j)),
                    _ => {
                        let z = load(4 * (g / 2) + j);
                        let mut code = if g % 2 == 0 {
                            vandq_u8(z, vdupq_n_u8(0x0F))
                        } else {
                            vshrq_n_u8::<4>(z)
                        };
                        if format.bits() == 6 {
                            let h = load(16 + 4 * (g / 4) + j);
                            let top = vandq_u8(
                                vshlq_u8(h, vdupq_n_s8(-2 * (g % 4) as i8)),
                                vdupq_n_u8(0x03),
                            );
                            code = vorrq_u8(code, vshlq_n_u8::<4>(top));
                        }
                        vqtbl4q_s8(table, code)
                    }
                };
            }
        }
        let s: uint8x16_t = bytemuck::cast::<[u8; 16], _>(
            scales[b * TILE_ROWS..(b + 1) * TILE_ROWS]
                .try_into()
                .expect("16 scales"),
        );
        let s16 = [vmovl_u8(vget_low_u8(s)), vmovl_high_u8(s)];
        let s32 = [
            vmovl_u16(vget_low_u16(s16[0])),
            vmovl_high_u16(s16[0]),
            vmovl_u16(vget_low_u16(s16[1])),
            vmovl_high_u16(s16[1]),
        ];
        let scale_w = s32.map(|e| {
            let bits = vshlq_n_u32::<23>(e);
            let zero = vceqq_u32(e, vdupq_n_u32(0));
            vreinterpretq_f32_u32(vbslq_u32(zero, vdupq_n_u32(0x0040_0000), bits))
        });
        for (x, a) in xs.iter().zip(acc.iter_mut()) {
            let q: &[i32; 8] = bytemuck::cast_ref(
                <&[i8; BLOCK]>::try_from(&x.q[b * BLOCK..(b + 1) * BLOCK]).expect("32 activations"),
            );
            let f = vdupq_n_f32(x.d[b] * map.unit);
            let mut out: [float32x4_t; 4] = bytemuck::cast(*a);
            for j in 0..4 {
                let mut isum = vdupq_n_s32(0);
                for (g, wg) in w.iter().enumerate() {
                    let xq = vreinterpretq_s8_s32(vdupq_n_s32(q[g]));
                    let lo = vmull_s8(vget_low_s8(wg[j]), vget_low_s8(xq));
                    let hi = vmull_high_s8(wg[j], xq);
                    isum = vpadalq_s16(isum, vpaddq_s16(lo, hi));
                }
                let fw = vmulq_f32(scale_w[j], f);
                out[j] = vfmaq_f32(out[j], vcvtq_f32_s32(isum), fw);
            }
            *a = bytemuck::cast(out);
        }
    }
}
