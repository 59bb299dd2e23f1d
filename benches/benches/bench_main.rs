//! One criterion entry point for every suite in the workspace; one module per operation.
//!
//! Run with `cargo bench -p benches` (all) or `cargo bench -p benches -- bandwidth` (one group).
//! Memory-bound suites report `Throughput::Bytes`, so their GB/s sit beside the `bandwidth`
//! group's ceiling from the same run.

use criterion::{criterion_group, criterion_main};

mod bandwidth {
    //! The ceiling: STREAM-like read bandwidth on one thread and on every core.

    use std::hint::black_box;

    use benches::{STREAM_BYTES, read_sum, read_sum_parallel};
    use criterion::{Criterion, Throughput};

    pub(crate) fn bench(c: &mut Criterion) {
        let words = vec![1u64; STREAM_BYTES / 8];
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut group = c.benchmark_group("bandwidth");
        group.throughput(Throughput::Bytes(STREAM_BYTES as u64));
        group.sample_size(20);
        group.bench_function("read/1-thread", |b| b.iter(|| read_sum(black_box(&words))));
        if cores > 1 {
            group.bench_function(format!("read/{cores}-threads"), |b| {
                b.iter(|| read_sum_parallel(black_box(&words), cores))
            });
        }
        group.finish();
    }
}

mod mx {
    //! mx-quant: bulk quantize/dequantize and the two GEMV paths on SmolLM2-135M's and
    //! Llama-sized shapes. Shapes are named as GGUF lists them, `in x out` (`ne0 x ne1`): the
    //! matrix has `out` rows of `in` columns. Every GEMV cycles through copies of its matrix
    //! totalling at least 3x the 32 MiB L3, so weights stream from DRAM as in a decoder whose
    //! model exceeds the cache; compare with the `bandwidth` group of the same run.

    use std::hint::black_box;
    use std::time::{Duration, Instant};

    use criterion::{BenchmarkId, Criterion, Throughput};
    use mx_quant::gemv::{MxMatrix, Q8Activations};
    use mx_quant::layout::packed_len;
    use mx_quant::{ElemFormat, Isa, QuantOptions, bulk};

    /// (in, out) as GGUF names them.
    const SHAPES: [(usize, usize); 5] = [
        (576, 1536),
        (1536, 576),
        (576, 49152),
        (4096, 4096),
        (4096, 14336),
    ];
    /// Bytes the rotating copies of a GEMV matrix span, at least: 3x a 32 MiB L3.
    const ROTATION_BYTES: usize = 96 << 20;

    fn data(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i.wrapping_mul(2_654_435_761) >> 7) % 2000) as f32 / 1000.0 - 1.0)
            .collect()
    }

    pub(crate) fn quantize(c: &mut Criterion) {
        let (cols, rows) = (4096, 4096);
        let input = data(rows * cols);
        let mut group = c.benchmark_group("mx_quantize");
        group
            .sample_size(10)
            .measurement_time(Duration::from_secs(3));
        group.throughput(Throughput::Bytes((input.len() * 4) as u64));
        for format in [
            ElemFormat::Fp4E2M1,
            ElemFormat::Fp6E2M3,
            ElemFormat::Fp8E4M3,
            ElemFormat::Int8,
        ] {
            let mut scales = vec![0u8; input.len() / 32];
            let mut packed = vec![0u8; packed_len(format, input.len())];
            group.bench_function(BenchmarkId::new(format.name(), "4096x4096"), |b| {
                b.iter(|| {
                    bulk::quantize(
                        format,
                        QuantOptions::default(),
                        black_box(&input),
                        &mut scales,
                        &mut packed,
                    )
                })
            });
        }
        group.finish();
        let mut group = c.benchmark_group("mx_dequantize");
        group
            .sample_size(10)
            .measurement_time(Duration::from_secs(3));
        group.throughput(Throughput::Bytes((input.len() * 4) as u64));
        for format in [
            ElemFormat::Fp4E2M1,
            ElemFormat::Fp6E2M3,
            ElemFormat::Fp8E4M3,
            ElemFormat::Int8,
        ] {
            let mut scales = vec![0u8; input.len() / 32];
            let mut packed = vec![0u8; packed_len(format, input.len())];
            bulk::quantize(
                format,
                QuantOptions::default(),
                &input,
                &mut scales,
                &mut packed,
            )
            .unwrap();
            let mut out = vec![0f32; input.len()];
            group.bench_function(BenchmarkId::new(format.name(), "4096x4096"), |b| {
                b.iter(|| {
                    bulk::dequantize(format, black_box(&scales), black_box(&packed), &mut out)
                })
            });
        }
        group.finish();
    }

    /// Runs `iters` GEMVs over the rotating copies on `threads` threads, each thread owning a
    /// contiguous share of row tiles of every matrix (the split a persistent pool makes), and
    /// returns the wall time. Threads start once per sample, so the figure is the kernels'
    /// streaming rate, without per-call synchronisation.
    fn gemv_time(
        mats: &[MxMatrix],
        x: &Q8Activations,
        xf: &[f32],
        q8: bool,
        threads: usize,
        iters: u64,
    ) -> Duration {
        let isa = Isa::detect();
        let (rows, _) = mats[0].shape();
        let tiles = mats[0].tiles();
        let per = tiles.div_ceil(threads);
        let start = Instant::now();
        std::thread::scope(|s| {
            for t in 0..threads {
                s.spawn(move || {
                    let span = (t * per).min(tiles)..((t + 1) * per).min(tiles);
                    let mut y = vec![0f32; rows];
                    let out = mats[0].rows_of(&span);
                    for i in 0..iters as usize {
                        let m = &mats[i % mats.len()];
                        let y = &mut y[out.clone()];
                        if q8 {
                            m.gemm_q8(isa, &[x], &mut [y], span.clone()).unwrap();
                        } else {
                            m.gemm_f32(isa, &[xf], &mut [y], span.clone()).unwrap();
                        }
                    }
                    black_box(&y);
                });
            }
        });
        start.elapsed()
    }

    pub(crate) fn gemv(c: &mut Criterion) {
        let mut group = c.benchmark_group("mx_gemv");
        group
            .sample_size(10)
            .measurement_time(Duration::from_secs(2))
            .warm_up_time(Duration::from_millis(500));
        let cores = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(2);
        let cases: &[(bool, ElemFormat, &[(usize, usize)])] = &[
            (true, ElemFormat::Fp4E2M1, &SHAPES),
            (true, ElemFormat::Fp6E2M3, &SHAPES),
            (true, ElemFormat::Int8, &SHAPES),
            (false, ElemFormat::Fp4E2M1, &[(576, 1536), (4096, 4096)]),
            (false, ElemFormat::Fp8E4M3, &[(576, 1536), (4096, 4096)]),
        ];
        for &(q8, format, shapes) in cases {
            for &(cols, rows) in shapes {
                let m = MxMatrix::quantize(
                    format,
                    QuantOptions::default(),
                    rows,
                    cols,
                    &data(rows * cols),
                )
                .unwrap();
                let copies = ROTATION_BYTES.div_ceil(m.stream_bytes()).max(1);
                let mats = vec![m; copies];
                let xf = data(cols);
                let x = Q8Activations::quantize(&xf).unwrap();
                group.throughput(Throughput::Bytes(mats[0].stream_bytes() as u64));
                for threads in 1..=cores {
                    let path = if q8 { "q8" } else { "f32" };
                    let id = BenchmarkId::new(
                        format!("{path}/{}/{threads}t", format.name()),
                        format!("{cols}x{rows}"),
                    );
                    group.bench_function(id, |b| {
                        b.iter_custom(|iters| gemv_time(&mats, &x, &xf, q8, threads, iters))
                    });
                }
            }
        }
        group.finish();
    }
}

criterion_group!(benches, bandwidth::bench, mx::quantize, mx::gemv);
criterion_main!(benches);
