//! The scalar reference: the definition of every bit this crate produces.
//!
//! Written for clarity, in `f64` where that makes a step exact, and tested against vectors made
//! with ml_dtypes (`fixtures/mx-conformance`). Every SIMD kernel is tested to agree with it
//! exactly. The algorithm, OCP MX v1.0 as torchao's FLOOR mode and ml_dtypes' casts implement it:
//!
//! 1. A block holding NaN or +-Inf gets scale [`SCALE_NAN`]; its codes are 0 and it decodes to NaN.
//! 2. Otherwise `X = floor(log2(amax)) - emax_elem`, clamped to the E8M0 range `-127..=127`; an
//!    all-zero block gets the smallest scale, `X = -127`.
//! 3. Each element `x / 2^X` (exact: a power-of-two scaling) is clamped to +-max normal and rounded
//!    to nearest, ties to even, with subnormals kept. Clamping first and rounding second give the
//!    same result as the other order because max normal is on the grid; overflow saturates and
//!    never becomes Inf or NaN. The sign of a zero result is kept (`-0` has its sign bit set),
//!    as in ml_dtypes; INT8 has no negative zero.

use crate::format::{BLOCK, ElemFormat, QuantOptions, Rounding, SCALE_BIAS, SCALE_NAN, ScaleRule};

/// Quantizes one block with the OCP MX v1.0 default mode: returns the E8M0 scale byte and each
/// element's code (raw bits in the low bits of a byte).
pub fn quantize_block(format: ElemFormat, block: &[f32; BLOCK]) -> (u8, [u8; BLOCK]) {
    quantize_block_with(format, QuantOptions::default(), block)
}

/// Quantizes one block with the scale rule and rounding of `options`.
pub fn quantize_block_with(
    format: ElemFormat,
    options: QuantOptions,
    block: &[f32; BLOCK],
) -> (u8, [u8; BLOCK]) {
    if block.iter().any(|x| !x.is_finite()) {
        return (SCALE_NAN, [0; BLOCK]);
    }
    let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
    let spec = shared_exponent(format, ScaleRule::Floor, amax);
    let exponent = match options.scale {
        ScaleRule::Floor | ScaleRule::Rceil => shared_exponent(format, options.scale, amax),
        ScaleRule::MseSearch => {
            // The spec's choice first, so a tie keeps it.
            let mut best = (block_sse(format, options.rounding, block, spec), spec);
            for candidate in [spec - 1, spec + 1] {
                let candidate = candidate.clamp(-SCALE_BIAS, SCALE_BIAS);
                let sse = block_sse(format, options.rounding, block, candidate);
                if sse < best.0 {
                    best = (sse, candidate);
                }
            }
            best.1
        }
    };
    let mut codes = [0u8; BLOCK];
    let inv_scale = pow2(-exponent);
    for (code, &x) in codes.iter_mut().zip(block) {
        *code = encode_elem(format, f64::from(x) * inv_scale, options.rounding);
    }
    ((exponent + SCALE_BIAS) as u8, codes)
}

/// Decodes one block: `decode_elem(code) * 2^(scale - 127)`, or all NaN for [`SCALE_NAN`].
pub fn dequantize_block(format: ElemFormat, scale: u8, codes: &[u8; BLOCK]) -> [f32; BLOCK] {
    let mut out = [f32::NAN; BLOCK];
    if scale == SCALE_NAN {
        return out;
    }
    let s = pow2(i32::from(scale) - SCALE_BIAS);
    for (o, &c) in out.iter_mut().zip(codes) {
        // Exact in f64; the one rounding is to f32 (which only matters for scale bytes no
        // quantizer produces, where the product overflows f32).
        *o = (f64::from(decode_elem(format, c)) * s) as f32;
    }
    out
}

/// The shared exponent `X` for a finite block whose largest magnitude is `amax`, clamped to
/// `-127..=127`. [`ScaleRule::MseSearch`] is answered with its starting point, the spec's `X`.
pub fn shared_exponent(format: ElemFormat, rule: ScaleRule, amax: f32) -> i32 {
    if amax == 0.0 {
        return -SCALE_BIAS;
    }
    let floor = floor_log2(amax) - format.emax();
    let x = match rule {
        ScaleRule::Floor | ScaleRule::MseSearch => floor,
        // The smallest X with max_normal * 2^X >= amax is `floor` or `floor + 1`: max_normal is
        // below 2^(emax + 1), so `floor - 1` can never reach amax.
        ScaleRule::Rceil => {
            if f64::from(format.max_normal()) * pow2(floor.max(-1000)) >= f64::from(amax) {
                floor
            } else {
                floor + 1
            }
        }
    };
    x.clamp(-SCALE_BIAS, SCALE_BIAS)
}

/// The value of one element code, before scaling. Codes no quantizer here produces still decode:
/// E4M3's `S.1111.111` is NaN, E5M2's top exponent is +-Inf or NaN, INT8's `-128` is `-2`.
pub fn decode_elem(format: ElemFormat, code: u8) -> f32 {
    let bits = format.bits();
    let code = code & (((1u16 << bits) - 1) as u8);
    if format == ElemFormat::Int8 {
        return f32::from(code as i8) / 64.0;
    }
    let mb = format.mant_bits();
    let eb = format.exp_bits();
    let negative = code & format.sign_bit() != 0;
    let exp_field = i32::from((code >> mb) & ((1 << eb) - 1) as u8);
    let mant = i32::from(code & ((1 << mb) - 1) as u8);
    let magnitude = match format {
        ElemFormat::Fp8E4M3 if exp_field == 15 && mant == 7 => f32::NAN,
        ElemFormat::Fp8E5M2 if exp_field == 31 => {
            if mant == 0 {
                f32::INFINITY
            } else {
                f32::NAN
            }
        }
        _ if exp_field == 0 => mant as f32 * pow2(format.emin() - mb as i32) as f32,
        _ => ((1 << mb) + mant) as f32 * pow2(exp_field - format.exp_bias() - mb as i32) as f32,
    };
    if negative { -magnitude } else { magnitude }
}

/// Encodes a scaled element `v` (finite): clamps to +-max normal, rounds to the element grid
/// with `rounding`, subnormals kept, and returns its code. The sign of a zero result is kept.
pub fn encode_elem(format: ElemFormat, v: f64, rounding: Rounding) -> u8 {
    debug_assert!(v.is_finite(), "encode_elem takes finite values");
    let negative = v.is_sign_negative();
    let a = v.abs().min(f64::from(format.max_normal()));
    let round = |t: f64| match rounding {
        Rounding::NearestEven => t.round_ties_even(),
        Rounding::NearestAway => t.round(),
    };
    if format == ElemFormat::Int8 {
        let k = round(a * 64.0).min(127.0) as i32;
        return (if negative { -k } else { k }) as i8 as u8;
    }
    let mb = format.mant_bits() as i32;
    let emin = format.emin();
    // The quantum of a's binade (the subnormal binade below 2^emin): rounding a / quantum to an
    // integer is rounding to the element's grid. The division is by a power of two, so exact.
    let e = if a == 0.0 {
        emin
    } else {
        floor_log2_f64(a).max(emin)
    };
    let r = (round(a / pow2(e - mb)) * pow2(e - mb)).min(f64::from(format.max_normal()));
    let magnitude_code = if r < pow2(emin) {
        // Subnormal (or zero): exponent field 0, mantissa counts quanta of 2^(emin - mb).
        (r / pow2(emin - mb)) as u8
    } else {
        let e = floor_log2_f64(r);
        let mant = (r / pow2(e - mb)) as i32 - (1 << mb);
        (((e + format.exp_bias()) << mb) | mant) as u8
    };
    if negative {
        magnitude_code | format.sign_bit()
    } else {
        magnitude_code
    }
}

/// `2^e` as an exact f64, for `e` in the normal f64 exponent range.
pub(crate) fn pow2(e: i32) -> f64 {
    debug_assert!((-1022..=1023).contains(&e));
    f64::from_bits(((1023 + e) as u64) << 52)
}

/// `2^e` as an f32 for `e` in `-149..=127`, subnormals included: the scale factors every SIMD
/// kernel multiplies by (exact, unlike `exp2`).
#[inline(always)]
pub(crate) fn pow2_f32(e: i32) -> f32 {
    debug_assert!((-149..=127).contains(&e));
    if e >= -126 {
        f32::from_bits(((e + 127) as u32) << 23)
    } else {
        f32::from_bits(1 << (e + 149))
    }
}

/// `floor(log2(x))` for a finite positive f32, subnormals included, from its bits.
pub(crate) fn floor_log2(x: f32) -> i32 {
    let bits = x.to_bits() & 0x7FFF_FFFF;
    let exp_field = (bits >> 23) as i32;
    if exp_field == 0 {
        // Subnormal: the value is mantissa * 2^-149, so its leading one sets the binade.
        31 - bits.leading_zeros() as i32 - 149
    } else {
        exp_field - 127
    }
}

/// `floor(log2(x))` for a finite positive normal f64.
fn floor_log2_f64(x: f64) -> i32 {
    ((x.to_bits() >> 52) & 0x7FF) as i32 - 1023
}

/// Squared error of quantizing `block` with shared exponent `x`.
fn block_sse(format: ElemFormat, rounding: Rounding, block: &[f32; BLOCK], x: i32) -> f64 {
    let inv = pow2(-x);
    let s = pow2(x);
    block
        .iter()
        .map(|&v| {
            let q = f64::from(decode_elem(
                format,
                encode_elem(format, f64::from(v) * inv, rounding),
            ));
            let err = f64::from(v) - q * s;
            err * err
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips_through_encode() {
        for format in ElemFormat::ALL {
            for code in 0..format.code_count() {
                let code = code as u8;
                let v = decode_elem(format, code);
                if !v.is_finite() {
                    continue;
                }
                let back = encode_elem(format, f64::from(v), Rounding::NearestEven);
                let same = back == code
                    || (v == 0.0 && decode_elem(format, back) == 0.0)
                    || (format == ElemFormat::Int8 && code == 0x80 && back == 0x81);
                assert!(
                    same,
                    "{format}: code {code:#04x} = {v} re-encodes as {back:#04x}"
                );
            }
        }
    }

    #[test]
    fn max_normals_and_saturation() {
        for format in ElemFormat::ALL {
            let max = format.max_normal();
            let code = encode_elem(format, f64::from(max) * 4.0, Rounding::NearestEven);
            assert_eq!(
                decode_elem(format, code),
                max,
                "{format} saturates to max normal"
            );
            let code = encode_elem(format, -f64::from(max) * 4.0, Rounding::NearestEven);
            assert_eq!(
                decode_elem(format, code),
                -max,
                "{format} saturates to -max normal"
            );
        }
        // In E4M3 the top mantissa pattern is NaN, so 480 saturates to 448.
        assert_eq!(
            encode_elem(ElemFormat::Fp8E4M3, 480.0, Rounding::NearestEven),
            0x7E
        );
        assert_eq!(
            encode_elem(ElemFormat::Fp8E4M3, 464.0, Rounding::NearestEven),
            0x7E
        );
    }

    #[test]
    fn ties_follow_the_rounding_mode() {
        // 2.5 lies between the E2M1 grid points 2 and 3: even is 2 (mantissa 0), away is 3.
        let even = encode_elem(ElemFormat::Fp4E2M1, 2.5, Rounding::NearestEven);
        let away = encode_elem(ElemFormat::Fp4E2M1, 2.5, Rounding::NearestAway);
        assert_eq!(decode_elem(ElemFormat::Fp4E2M1, even), 2.0);
        assert_eq!(decode_elem(ElemFormat::Fp4E2M1, away), 3.0);
        // 0.25 is half the smallest subnormal 0.5: even rounds to 0, keeping the sign.
        assert_eq!(
            encode_elem(ElemFormat::Fp4E2M1, -0.25, Rounding::NearestEven),
            0x08
        );
    }

    #[test]
    fn special_blocks() {
        let mut block = [1.0f32; BLOCK];
        block[7] = f32::NAN;
        let (scale, codes) = quantize_block(ElemFormat::Fp8E4M3, &block);
        assert_eq!((scale, codes), (SCALE_NAN, [0; BLOCK]));
        assert!(
            dequantize_block(ElemFormat::Fp8E4M3, scale, &codes)
                .iter()
                .all(|v| v.is_nan())
        );
        let (scale, codes) = quantize_block(ElemFormat::Fp4E2M1, &[0.0; BLOCK]);
        assert_eq!((scale, codes), (0, [0; BLOCK]));
        // An f32 subnormal amax clamps X at -127.
        assert_eq!(floor_log2(f32::from_bits(1)), -149);
        assert_eq!(
            shared_exponent(ElemFormat::Fp4E2M1, ScaleRule::Floor, 1e-40),
            -127
        );
        assert_eq!(
            shared_exponent(ElemFormat::Fp8E5M2, ScaleRule::Floor, f32::MAX),
            112
        );
    }

    #[test]
    fn rceil_never_saturates() {
        for format in ElemFormat::ALL {
            for amax in [1.0f32, 5.9, 6.1, 447.0, 449.0, 1.999, 3.0e10, 1e-30] {
                let x = shared_exponent(format, ScaleRule::Rceil, amax);
                assert!(f64::from(format.max_normal()) * pow2(x) >= f64::from(amax));
                assert!(f64::from(format.max_normal()) * pow2(x - 1) < f64::from(amax));
            }
        }
    }

    #[test]
    fn mse_search_is_never_worse_than_floor() {
        let mut block = [0f32; BLOCK];
        for (i, v) in block.iter_mut().enumerate() {
            *v = ((i as f32 * 0.37).sin() * 3.0).powi(3);
        }
        for format in ElemFormat::ALL {
            let err = |scale: ScaleRule| {
                let opts = QuantOptions {
                    scale,
                    ..Default::default()
                };
                let (s, c) = quantize_block_with(format, opts, &block);
                let d = dequantize_block(format, s, &c);
                block
                    .iter()
                    .zip(&d)
                    .map(|(a, b)| f64::from(a - b).powi(2))
                    .sum::<f64>()
            };
            assert!(
                err(ScaleRule::MseSearch) <= err(ScaleRule::Floor),
                "{format}"
            );
        }
    }
}
