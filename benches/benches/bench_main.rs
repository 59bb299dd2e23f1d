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

criterion_group!(benches, bandwidth::bench);
criterion_main!(benches);
