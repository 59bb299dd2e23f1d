//! Conformance: every vector made with ml_dtypes (`fixtures/mx-conformance/gen_vectors.py`)
//! reproduced bit for bit by the reference and by every available SIMD level.
//!
//! Each vector is one 32-element block, a format and a mode (`floor`, the OCP default;
//! `ties_away`; `rceil`), with the expected scale byte, element codes and decoded f32 bits.

use mx_quant::layout::packed_len;
use mx_quant::{BLOCK, ElemFormat, Isa, QuantOptions, Rounding, ScaleRule, bulk, reference};

struct Vector {
    format: ElemFormat,
    mode: String,
    case: String,
    input: [f32; BLOCK],
    scale: u8,
    codes: [u8; BLOCK],
    decoded: [u32; BLOCK],
}

fn load() -> Vec<Vector> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../fixtures/mx-conformance/vectors.jsonl"
    );
    let text = std::fs::read_to_string(path).expect("conformance vectors are committed");
    text.lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).expect("valid JSON line");
            let u32s = |key: &str| -> Vec<u32> {
                v[key]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .collect()
            };
            let input: Vec<f32> = u32s("input").into_iter().map(f32::from_bits).collect();
            let codes: Vec<u8> = u32s("codes").into_iter().map(|c| c as u8).collect();
            Vector {
                format: ElemFormat::from_name(v["format"].as_str().unwrap()).expect("known format"),
                mode: v["mode"].as_str().unwrap().to_owned(),
                case: v["case"].as_str().unwrap().to_owned(),
                input: input.try_into().unwrap(),
                scale: v["scale"].as_u64().unwrap() as u8,
                codes: codes.try_into().unwrap(),
                decoded: u32s("decoded").try_into().unwrap(),
            }
        })
        .collect()
}

fn options(mode: &str) -> QuantOptions {
    match mode {
        "floor" => QuantOptions::default(),
        "ties_away" => QuantOptions {
            rounding: Rounding::NearestAway,
            ..Default::default()
        },
        "rceil" => QuantOptions {
            scale: ScaleRule::Rceil,
            ..Default::default()
        },
        other => panic!("unknown mode {other}"),
    }
}

fn same_value(got: f32, want_bits: u32) -> bool {
    let want = f32::from_bits(want_bits);
    if want.is_nan() {
        got.is_nan()
    } else {
        got.to_bits() == want_bits
    }
}

#[test]
fn vectors_cover_every_format_mode_and_case() {
    let vectors = load();
    for format in ElemFormat::ALL {
        for mode in ["floor", "ties_away", "rceil"] {
            for case in [
                "normal",
                "heavy_tailed",
                "single_outlier",
                "all_zero",
                "exact_grid",
                "rounding_midpoint",
                "subnormal",
                "near_f32_max",
                "nan_inf",
                "saturate",
            ] {
                assert!(
                    vectors
                        .iter()
                        .any(|v| v.format == format && v.mode == mode && v.case == case),
                    "no vector for {format} {mode} {case}"
                );
            }
        }
    }
}

#[test]
fn reference_matches_ml_dtypes() {
    let mut failures = Vec::new();
    for (i, v) in load().iter().enumerate() {
        let (scale, codes) = reference::quantize_block_with(v.format, options(&v.mode), &v.input);
        if (scale, codes) != (v.scale, v.codes) {
            failures.push(format!(
                "vector {i} ({} {} {}): got scale {scale} codes {codes:02x?}, want scale {} codes {:02x?}",
                v.format, v.mode, v.case, v.scale, v.codes
            ));
            continue;
        }
        let decoded = reference::dequantize_block(v.format, v.scale, &v.codes);
        for (j, (&got, &want)) in decoded.iter().zip(&v.decoded).enumerate() {
            if !same_value(got, want) {
                failures.push(format!(
                    "vector {i} ({} {} {}) element {j}: decoded {got:e} ({:#010x}), want {:#010x}",
                    v.format,
                    v.mode,
                    v.case,
                    got.to_bits(),
                    want
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn every_isa_matches_ml_dtypes() {
    let vectors = load();
    for isa in Isa::available() {
        for (i, v) in vectors.iter().enumerate() {
            let mut scales = [0u8; 1];
            let mut packed = vec![0u8; packed_len(v.format, BLOCK)];
            bulk::quantize_with_isa(
                isa,
                v.format,
                options(&v.mode),
                &v.input,
                &mut scales,
                &mut packed,
            )
            .unwrap();
            let mut codes = [0u8; BLOCK];
            mx_quant::layout::unpack_codes(v.format, &packed, &mut codes).unwrap();
            assert_eq!(
                (scales[0], codes),
                (v.scale, v.codes),
                "{} vector {i} ({} {} {})",
                isa.name(),
                v.format,
                v.mode,
                v.case
            );
            let mut decoded = [0f32; BLOCK];
            bulk::dequantize_with_isa(isa, v.format, &scales, &packed, &mut decoded).unwrap();
            for (j, (&got, &want)) in decoded.iter().zip(&v.decoded).enumerate() {
                assert!(
                    same_value(got, want),
                    "{} vector {i} ({} {} {}) element {j}: {got:e} vs {want:#010x}",
                    isa.name(),
                    v.format,
                    v.mode,
                    v.case
                );
            }
        }
    }
}
