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

#[test]
fn half_precision_outputs_round_the_f32_values() {
    let input = random_blocks(64);
    for format in ElemFormat::ALL {
        let mut scales = vec![0u8; input.len() / BLOCK];
        let mut packed = vec![0u8; packed_len(format, input.len())];
        bulk::quantize(
            format,
            QuantOptions::default(),
            &input,
            &mut scales,
            &mut packed,
        )
        .unwrap();
        let mut f32s = vec![0f32; input.len()];
        bulk::dequantize(format, &scales, &packed, &mut f32s).unwrap();
        let mut f16s = vec![half::f16::ZERO; input.len()];
        bulk::dequantize_f16(format, &scales, &packed, &mut f16s).unwrap();
        let mut bf16s = vec![half::bf16::ZERO; input.len()];
        bulk::dequantize_bf16(format, &scales, &packed, &mut bf16s).unwrap();
        for ((v, h), b) in f32s.iter().zip(&f16s).zip(&bf16s) {
            let (wh, wb) = (half::f16::from_f32(*v), half::bf16::from_f32(*v));
            assert!(
                h.to_bits() == wh.to_bits() || (h.is_nan() && wh.is_nan()),
                "{format} f16 of {v}"
            );
            assert!(
                b.to_bits() == wb.to_bits() || (b.is_nan() && wb.is_nan()),
                "{format} bf16 of {v}"
            );
        }
    }
}

#[test]
fn unaligned_slices_work() {
    // Slices that start one element into a buffer: no alignment is assumed anywhere.
    let backing = random_blocks(9);
    let input = &backing[1..1 + 8 * BLOCK];
    for format in ElemFormat::ALL {
        let mut scales = [0u8; 9];
        let mut packed = vec![0u8; packed_len(format, 8 * BLOCK) + 1];
        bulk::quantize(
            format,
            QuantOptions::default(),
            input,
            &mut scales[1..],
            &mut packed[1..],
        )
        .unwrap();
        let mut out = vec![0f32; 8 * BLOCK + 1];
        bulk::dequantize(format, &scales[1..], &packed[1..], &mut out[1..]).unwrap();
        for (b, chunk) in input.chunks_exact(BLOCK).enumerate() {
            let (s, c) = reference::quantize_block(format, chunk.try_into().unwrap());
            assert_eq!(s, scales[1 + b], "{format} block {b}");
            let d = reference::dequantize_block(format, s, &c);
            for (g, w) in out[1 + b * BLOCK..1 + (b + 1) * BLOCK].iter().zip(&d) {
                assert!(g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()));
            }
        }
    }
}
