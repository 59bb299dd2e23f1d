//! GEMV/GEMM over the tiled layout: against an f64 reference, across instruction sets (bitwise),
//! across thread splits and batch sizes (bitwise), and through the GGUF `block_mxfp4` loader.

use mx_quant::gemv::{MxMatrix, Q8Activations, TILE_ROWS, gemv_parallel_f32, gemv_parallel_q8};
use mx_quant::layout::{BlockMxfp4, packed_len};
use mx_quant::{BLOCK, ElemFormat, Isa, QuantOptions, bulk};

/// f32 accumulation over `k` terms: each partial sum is rounded once per add, so the error is
/// bounded by about `k * 2^-24` times the sum of |terms| (Higham, recursive summation). Kernels
/// sum in a different order than the reference, so that is the tolerance.
fn accumulation_bound(k: usize, abs_sum: f64) -> f64 {
    (k as f64 + 2.0) * f64::from(f32::EPSILON) * abs_sum
}

fn test_matrix(rows: usize, cols: usize, seed: u32) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| {
            let t =
                (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) as f32 / u32::MAX as f32;
            (t - 0.5) * (1.0 + (i % 7) as f32)
        })
        .collect()
}

fn dequantized_rows(m: &MxMatrix) -> Vec<Vec<f32>> {
    let (rows, cols) = m.shape();
    (0..rows)
        .map(|r| {
            let mut row = vec![0f32; cols];
            m.dequantize_row(r, &mut row).unwrap();
            row
        })
        .collect()
}

const SHAPES: [(usize, usize); 3] = [(37, 96), (16, 32), (70, 320)];

#[test]
fn tiled_layout_round_trips_every_format() {
    for format in ElemFormat::ALL {
        for (rows, cols) in SHAPES {
            let data = test_matrix(rows, cols, 1);
            let mut scales = vec![0u8; rows * cols / BLOCK];
            let mut packed = vec![0u8; packed_len(format, rows * cols)];
            bulk::quantize(
                format,
                QuantOptions::default(),
                &data,
                &mut scales,
                &mut packed,
            )
            .unwrap();
            let mut want = vec![0f32; rows * cols];
            bulk::dequantize(format, &scales, &packed, &mut want).unwrap();
            let m = MxMatrix::from_linear(format, rows, cols, &scales, &packed).unwrap();
            for (r, row) in dequantized_rows(&m).iter().enumerate() {
                let w = &want[r * cols..(r + 1) * cols];
                assert!(
                    row.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{format} row {r}"
                );
            }
        }
    }
}

#[test]
fn f32_path_matches_f64_reference_and_is_bitwise_equal_across_isas() {
    for format in ElemFormat::ALL {
        for (rows, cols) in SHAPES {
            let m = MxMatrix::quantize(
                format,
                QuantOptions::default(),
                rows,
                cols,
                &test_matrix(rows, cols, 2),
            )
            .unwrap();
            let x = test_matrix(1, cols, 3);
            let mut scalar_y = vec![0f32; rows];
            m.gemm_f32(Isa::Scalar, &[&x], &mut [&mut scalar_y], 0..m.tiles())
                .unwrap();
            for isa in Isa::available() {
                let mut y = vec![0f32; rows];
                m.gemm_f32(isa, &[&x], &mut [&mut y], 0..m.tiles()).unwrap();
                assert!(
                    y.iter()
                        .zip(&scalar_y)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{format} {rows}x{cols}: {} differs from scalar",
                    isa.name()
                );
            }
            for (r, w) in dequantized_rows(&m).iter().enumerate() {
                let exact: f64 = w
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum();
                let abs: f64 = w
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs())
                    .sum();
                let err = (f64::from(scalar_y[r]) - exact).abs();
                assert!(
                    err <= accumulation_bound(cols, abs),
                    "{format} {rows}x{cols} row {r}: {} vs {exact}",
                    scalar_y[r]
                );
            }
        }
    }
}

#[test]
fn q8_path_matches_reference_and_is_bitwise_equal_across_isas() {
    for format in [ElemFormat::Fp4E2M1, ElemFormat::Fp6E2M3, ElemFormat::Int8] {
        for (rows, cols) in SHAPES {
            let m = MxMatrix::quantize(
                format,
                QuantOptions::default(),
                rows,
                cols,
                &test_matrix(rows, cols, 4),
            )
            .unwrap();
            assert!(m.supports_q8());
            let x = test_matrix(1, cols, 5);
            let xq = Q8Activations::quantize(&x).unwrap();
            let x_seen = xq.dequantize();
            let mut reference_y = None;
            for isa in Isa::available() {
                let mut y = vec![0f32; rows];
                m.gemm_q8(isa, &[&xq], &mut [&mut y], 0..m.tiles()).unwrap();
                match &reference_y {
                    None => reference_y = Some(y.clone()),
                    Some(r) => assert!(
                        r.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{format} {rows}x{cols}: {} differs from scalar",
                        isa.name()
                    ),
                }
                // The kernel computes W * (d * q) exactly in integers per block; only the f32
                // accumulation across blocks rounds.
                for (r, w) in dequantized_rows(&m).iter().enumerate() {
                    let exact: f64 = w
                        .iter()
                        .zip(&x_seen)
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum();
                    let abs: f64 = w
                        .iter()
                        .zip(&x_seen)
                        .map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs())
                        .sum();
                    let err = (f64::from(y[r]) - exact).abs();
                    assert!(
                        err <= accumulation_bound(cols / BLOCK * 2, abs) + abs * 1e-6,
                        "{format} {} row {r}: {} vs {exact}",
                        isa.name(),
                        y[r]
                    );
                }
            }
        }
    }
}

#[test]
fn threads_and_batches_do_not_change_results() {
    let (rows, cols) = (200, 256);
    let m = MxMatrix::quantize(
        ElemFormat::Fp4E2M1,
        QuantOptions::default(),
        rows,
        cols,
        &test_matrix(rows, cols, 6),
    )
    .unwrap();
    let xs: Vec<Q8Activations> = (0..37)
        .map(|s| Q8Activations::quantize(&test_matrix(1, cols, 10 + s)).unwrap())
        .collect();
    let single: Vec<Vec<f32>> = xs
        .iter()
        .map(|x| {
            let mut y = vec![0f32; rows];
            m.gemm_q8(Isa::detect(), &[x], &mut [&mut y], 0..m.tiles())
                .unwrap();
            y
        })
        .collect();
    // A batch of 37 (more than one kernel call's worth on every ISA: 8 or 32 columns), split
    // into two tile ranges.
    let mut ys = vec![vec![0f32; rows]; xs.len()];
    let split = 5;
    for range in [0..split, split..m.tiles()] {
        let rows_of = m.rows_of(&range);
        let mut views: Vec<&mut [f32]> = ys.iter_mut().map(|y| &mut y[rows_of.clone()]).collect();
        let refs: Vec<&Q8Activations> = xs.iter().collect();
        m.gemm_q8(Isa::detect(), &refs, &mut views, range).unwrap();
    }
    assert_eq!(ys, single);
    let xf = test_matrix(1, cols, 10);
    let mut f32_single = vec![0f32; rows];
    m.gemm_f32(Isa::detect(), &[&xf], &mut [&mut f32_single], 0..m.tiles())
        .unwrap();
    for threads in [2, 3, 16] {
        let mut y = vec![0f32; rows];
        gemv_parallel_q8(&m, &xs[0], &mut y, threads).unwrap();
        assert_eq!(y, single[0], "{threads} threads");
        gemv_parallel_f32(&m, &xf, &mut y, threads).unwrap();
        assert_eq!(y, f32_single, "{threads} threads, f32 path");
    }
}

#[test]
fn gguf_mxfp4_blocks_load_like_the_linear_layout() {
    let (rows, cols) = (TILE_ROWS + 3, 64);
    let data = test_matrix(rows, cols, 7);
    let format = ElemFormat::Fp4E2M1;
    let mut scales = vec![0u8; rows * cols / BLOCK];
    let mut packed = vec![0u8; packed_len(format, rows * cols)];
    bulk::quantize(
        format,
        QuantOptions::default(),
        &data,
        &mut scales,
        &mut packed,
    )
    .unwrap();
    let blocks: Vec<BlockMxfp4> = data
        .chunks_exact(BLOCK)
        .map(|b| {
            let (s, c) = mx_quant::reference::quantize_block(format, b.try_into().unwrap());
            BlockMxfp4::from_codes(s, &c)
        })
        .collect();
    let a = MxMatrix::from_linear(format, rows, cols, &scales, &packed).unwrap();
    let b = MxMatrix::from_gguf_mxfp4(rows, cols, &blocks).unwrap();
    assert_eq!(dequantized_rows(&a), dequantized_rows(&b));
    // And back out, byte for byte: GGUF MXFP4 tensors load and save.
    assert_eq!(a.to_gguf_mxfp4().unwrap(), blocks);
}

#[test]
fn bad_shapes_and_formats_are_errors() {
    let m = MxMatrix::quantize(
        ElemFormat::Fp8E4M3,
        QuantOptions::default(),
        4,
        32,
        &[0.5; 128],
    )
    .unwrap();
    let x = Q8Activations::quantize(&[1.0; 32]).unwrap();
    let mut y = vec![0f32; 4];
    assert!(matches!(
        m.gemm_q8(Isa::Scalar, &[&x], &mut [&mut y], 0..1),
        Err(mx_quant::Error::UnsupportedFormat { .. })
    ));
    assert!(
        MxMatrix::quantize(
            ElemFormat::Fp4E2M1,
            QuantOptions::default(),
            4,
            30,
            &[0.0; 120]
        )
        .is_err()
    );
    assert!(
        MxMatrix::quantize(
            ElemFormat::Fp4E2M1,
            QuantOptions::default(),
            usize::MAX,
            32,
            &[]
        )
        .is_err()
    );
    let m = MxMatrix::quantize(
        ElemFormat::Fp4E2M1,
        QuantOptions::default(),
        4,
        32,
        &[0.5; 128],
    )
    .unwrap();
    let mut short = vec![0f32; 3];
    assert!(
        m.gemm_q8(Isa::Scalar, &[&x], &mut [&mut short], 0..1)
            .is_err()
    );
    assert!(m.gemm_q8(Isa::Scalar, &[&x], &mut [&mut y], 0..2).is_err());
    let mut row = vec![0f32; 32];
    assert!(m.dequantize_row(4, &mut row).is_err());
}
