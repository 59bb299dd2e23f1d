//! Quick throughput probe of the MX GEMV paths on one shape (the criterion suite in `benches/`
//! is the measurement of record): `cargo run --release -p mx-quant --example gemv_probe -- 4096 14336 fp4_e2m1`.

use std::time::Instant;

use mx_quant::gemv::{MxMatrix, Q8Activations, gemv_parallel_q8};
use mx_quant::{ElemFormat, Isa, QuantOptions};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rows: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(4096);
    let cols: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(14336);
    let format = args
        .get(3)
        .and_then(|s| ElemFormat::from_name(s))
        .unwrap_or(ElemFormat::Fp4E2M1);
    let data: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let t = Instant::now();
    let m =
        MxMatrix::quantize(format, QuantOptions::default(), rows, cols, &data).expect("quantize");
    let q_secs = t.elapsed().as_secs_f64();
    println!(
        "{rows}x{cols} {format}: quantize+repack {:.1} ms ({:.2} GB/s of f32), stream {:.1} MiB, isa {}",
        q_secs * 1e3,
        (rows * cols * 4) as f64 / q_secs / 1e9,
        m.stream_bytes() as f64 / (1 << 20) as f64,
        Isa::detect().name()
    );
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.01).sin()).collect();
    let xq = Q8Activations::quantize(&x).expect("activations");
    let mut y = vec![0f32; rows];
    for threads in [1, 2] {
        let mut best = f64::MAX;
        for _ in 0..20 {
            let t = Instant::now();
            gemv_parallel_q8(&m, &xq, &mut y, threads).expect("gemv");
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "  q8 gemv {threads} thread(s): best {:.3} ms = {:.2} GB/s",
            best * 1e3,
            m.stream_bytes() as f64 / best / 1e9
        );
    }
    let t = Instant::now();
    m.gemm_f32(Isa::detect(), &[&x], &mut [&mut y], 0..m.tiles())
        .expect("gemv f32");
    let s = t.elapsed().as_secs_f64();
    println!(
        "  f32 gemv 1 thread: {:.3} ms = {:.2} GB/s",
        s * 1e3,
        m.stream_bytes() as f64 / s / 1e9
    );
}
