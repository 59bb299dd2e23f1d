//! Every SIMD level against the scalar reference on many random blocks: raw random f32 bit
//! patterns (NaN, Inf, subnormals included), and value distributions at many magnitudes, in
//! every format and mode. Agreement must be exact: scale bytes, codes and decoded bits.

use mx_quant::layout::packed_len;
use mx_quant::{BLOCK, ElemFormat, Isa, QuantOptions, Rounding, ScaleRule, bulk, reference};

/// xorshift64*: deterministic, dependency-free test randomness.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

fn random_blocks(count: usize) -> Vec<f32> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut out = Vec::with_capacity(count * BLOCK);
    for b in 0..count {
        let magnitude = 2f32.powi((rng.next_u64() % 200) as i32 - 100);
        for _ in 0..BLOCK {
            let v = match b % 4 {
                // Raw bit patterns: every exponent, NaN and Inf included (rarely: ~1/256).
                0 => f32::from_bits(rng.next_u64() as u32),
                // Uniform in [-m, m].
                1 => (rng.unit() * 2.0 - 1.0) * magnitude,
                // Heavy-tailed: a ratio of uniforms.
                2 => (rng.unit() - 0.5) / (rng.unit() + 1e-3) * magnitude,
                // Mostly tiny with an outlier now and then.
                _ => {
                    if rng.next_u64().is_multiple_of(32) {
                        magnitude * 1000.0
                    } else {
                        (rng.unit() - 0.5) * magnitude
                    }
                }
            };
            out.push(v);
        }
    }
    out
}

#[test]
fn simd_levels_agree_with_reference_exactly() {
    let input = random_blocks(4096);
    let modes = [
        QuantOptions::default(),
        QuantOptions {
            rounding: Rounding::NearestAway,
            ..Default::default()
        },
        QuantOptions {
            scale: ScaleRule::Rceil,
            ..Default::default()
        },
    ];
    for format in ElemFormat::ALL {
        for options in modes {
            let blocks = input.len() / BLOCK;
            let mut want_scales = vec![0u8; blocks];
            let mut want_packed = vec![0u8; packed_len(format, input.len())];
            bulk::quantize_with_isa(
                Isa::Scalar,
                format,
                options,
                &input,
                &mut want_scales,
                &mut want_packed,
            )
            .unwrap();
            let mut want_out = vec![0f32; input.len()];
            bulk::dequantize_with_isa(
                Isa::Scalar,
                format,
                &want_scales,
                &want_packed,
                &mut want_out,
            )
            .unwrap();
            for isa in Isa::available() {
                let mut scales = vec![0u8; blocks];
                let mut packed = vec![0u8; want_packed.len()];
                bulk::quantize_with_isa(isa, format, options, &input, &mut scales, &mut packed)
                    .unwrap();
                for b in 0..blocks {
                    let pb = packed_len(format, BLOCK);
                    assert_eq!(
                        (scales[b], &packed[b * pb..(b + 1) * pb]),
                        (want_scales[b], &want_packed[b * pb..(b + 1) * pb]),
                        "{} {format} {options:?} block {b}: {:?}",
                        isa.name(),
                        &input[b * BLOCK..(b + 1) * BLOCK]
                    );
                }
                let mut out = vec![0f32; input.len()];
                bulk::dequantize_with_isa(isa, format, &scales, &packed, &mut out).unwrap();
                for (i, (g, w)) in out.iter().zip(&want_out).enumerate() {
                    assert!(
                        g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                        "{} {format} dequantize element {i}: {g:e} vs {w:e}",
                        isa.name()
                    );
                }
            }
        }
    }
}

#[test]
fn every_scale_byte_and_code_decodes_like_the_reference() {
    // Dequantization of bytes no quantizer produces (scale 254, E4M3 NaN codes, E5M2 Inf codes)
    // must still agree, since files are untrusted.
    for format in ElemFormat::ALL {
        for scale in 0..=255u8 {
            for first in (0..format.code_count()).step_by(BLOCK) {
                let codes: [u8; BLOCK] =
                    std::array::from_fn(|i| ((first + i) % format.code_count()) as u8);
                let want = reference::dequantize_block(format, scale, &codes);
                let mut packed = vec![0u8; packed_len(format, BLOCK)];
                mx_quant::layout::pack_codes(format, &codes, &mut packed).unwrap();
                for isa in Isa::available() {
                    let mut got = [0f32; BLOCK];
                    bulk::dequantize_with_isa(isa, format, &[scale], &packed, &mut got).unwrap();
                    for (g, w) in got.iter().zip(&want) {
                        assert!(
                            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                            "{} {format} scale {scale}: {g:e} vs {w:e}",
                            isa.name()
                        );
                    }
                }
            }
        }
    }
}
