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

    /// Every format on 4096x4096, and FP4 and INT8 on every shape.
    fn quant_cases() -> Vec<(ElemFormat, (usize, usize))> {
        let mut cases: Vec<_> = [
            ElemFormat::Fp4E2M1,
            ElemFormat::Fp6E2M3,
            ElemFormat::Fp8E4M3,
            ElemFormat::Int8,
        ]
        .into_iter()
        .map(|f| (f, (4096, 4096)))
        .collect();
        for format in [ElemFormat::Fp4E2M1, ElemFormat::Int8] {
            for shape in SHAPES {
                if shape != (4096, 4096) {
                    cases.push((format, shape));
                }
            }
        }
        cases
    }

    pub(crate) fn quantize(c: &mut Criterion) {
        let mut group = c.benchmark_group("mx_quantize");
        group
            .sample_size(10)
            .measurement_time(Duration::from_secs(2));
        for (format, (cols, rows)) in quant_cases() {
            let input = data(rows * cols);
            let mut scales = vec![0u8; input.len() / 32];
            let mut packed = vec![0u8; packed_len(format, input.len())];
            group.throughput(Throughput::Bytes((input.len() * 4) as u64));
            group.bench_function(
                BenchmarkId::new(format.name(), format!("{cols}x{rows}")),
                |b| {
                    b.iter(|| {
                        bulk::quantize(
                            format,
                            QuantOptions::default(),
                            black_box(&input),
                            &mut scales,
                            &mut packed,
                        )
                    })
                },
            );
        }
        group.finish();
        let mut group = c.benchmark_group("mx_dequantize");
        group
            .sample_size(10)
            .measurement_time(Duration::from_secs(2));
        for (format, (cols, rows)) in quant_cases() {
            let input = data(rows * cols);
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
            group.throughput(Throughput::Bytes((input.len() * 4) as u64));
            group.bench_function(
                BenchmarkId::new(format.name(), format!("{cols}x{rows}")),
                |b| {
                    b.iter(|| {
                        bulk::dequantize(format, black_box(&scales), black_box(&packed), &mut out)
                    })
                },
            );
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

    /// What block rotations add to a linear layer's input on the CPU NPU: the activations'
    /// int8 quantization alone (what every MX GEMV pays) against the 32-point Walsh-Hadamard
    /// transform and then the quantization, at SmolLM2-135M's two input widths. The GEMV it
    /// precedes is `mx_gemv`'s `576x1536` and `1536x576`.
    pub(crate) fn rotation(c: &mut Criterion) {
        let mut group = c.benchmark_group("mx_rotation");
        group
            .sample_size(20)
            .measurement_time(Duration::from_secs(1))
            .warm_up_time(Duration::from_millis(300));
        for cols in [576usize, 1536] {
            let x = data(cols);
            group.throughput(Throughput::Elements(cols as u64));
            group.bench_function(BenchmarkId::new("q8", cols), |b| {
                let mut q = Q8Activations::default();
                b.iter(|| q.requantize(black_box(&x)).unwrap())
            });
            group.bench_function(BenchmarkId::new("rotate+q8", cols), |b| {
                let (mut q, mut r) = (Q8Activations::default(), x.clone());
                b.iter(|| {
                    r.copy_from_slice(black_box(&x));
                    mx_quant::hadamard::rotate_activations(&mut r).unwrap();
                    q.requantize(&r).unwrap()
                })
            });
        }
        group.finish();
    }

    /// `pipeline quantize`'s calibration sums `X^T X` per linear input
    /// (`mx_quant::gptq::accumulate_hessian_threads`), most of a calibration batch's time. At
    /// SmolLM2-135M's two input widths, a 512-token batch on 2 threads, against the peer it
    /// replaced in the same run: each element a dot product over 8 transposed tokens with a
    /// horizontal sum. Throughput is multiply-adds of the lower triangle.
    pub(crate) fn hessian(c: &mut Criterion) {
        let mut group = c.benchmark_group("gptq_hessian");
        group
            .sample_size(10)
            .measurement_time(Duration::from_secs(2))
            .warm_up_time(Duration::from_millis(300));
        let tokens = 512;
        for n in [576usize, 1536] {
            let x = data(n * tokens);
            group.throughput(Throughput::Elements((n * (n + 1) / 2 * tokens) as u64));
            group.bench_function(BenchmarkId::new("rows", n), |b| {
                let mut h = vec![0f64; n * n];
                b.iter(|| mx_quant::gptq::accumulate_hessian_threads(&mut h, n, black_box(&x), 2))
            });
            group.bench_function(BenchmarkId::new("transposed-dot (peer)", n), |b| {
                let mut h = vec![0f64; n * n];
                b.iter(|| transposed_dot_hessian(&mut h, n, black_box(&x)))
            });
        }
        group.finish();
    }

    /// The Hessian sum before 2026-12-02, on 2 threads, kept as `hessian`'s peer: eight tokens
    /// transposed, each element their dot product.
    fn transposed_dot_hessian(hessian: &mut [f64], n: usize, x: &[f32]) {
        const T: usize = 8;
        let mut xt = vec![0f64; n * T];
        let half = (n as f64 / std::f64::consts::SQRT_2) as usize;
        for chunk in x.chunks(n * T) {
            let t = chunk.len() / n;
            xt.fill(0.0);
            for (k, row) in chunk.chunks_exact(n).enumerate().take(t) {
                for (i, &v) in row.iter().enumerate() {
                    xt[i * T + k] = f64::from(v);
                }
            }
            let xt = &xt;
            let band = |rows: std::ops::Range<usize>, h: &mut [f64]| {
                for i in rows.clone() {
                    let xi = &xt[i * T..i * T + T];
                    let at = (i - rows.start) * n;
                    for (j, h) in h[at..at + i + 1].iter_mut().enumerate() {
                        let xj = &xt[j * T..j * T + T];
                        *h += (0..T).map(|k| xi[k] * xj[k]).sum::<f64>();
                    }
                }
            };
            let (low, high) = hessian.split_at_mut(half * n);
            std::thread::scope(|scope| {
                scope.spawn(|| band(0..half, low));
                band(half..n, high);
            });
        }
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
        // (int8 activations?, weight format, shapes)
        type Case<'a> = (bool, ElemFormat, &'a [(usize, usize)]);
        let cases: &[Case<'_>] = &[
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

mod sync {
    //! sync-timeline: cross-thread handoff latency (one signal on one thread releasing a wait on
    //! another) for the CPU timeline hot (spinning) and parked, a Mutex+Condvar baseline and a
    //! Vulkan timeline semaphore; and a device-side wait released by a host signal. Criterion
    //! times ping-pong round trips (two handoffs each); a table of per-handoff median and p99
    //! from 20k round trips is printed first.

    use std::sync::{Arc, Condvar, Mutex};
    use std::time::{Duration, Instant};

    use benches::median_p99;
    use criterion::Criterion;
    use sync_timeline::vulkan::{VulkanTimeline, submit_wait_signal};
    use sync_timeline::{CpuTimeline, SpinPolicy, Timeline};

    const LONG: Duration = Duration::from_secs(10);

    /// A Mutex+Condvar "timeline", the baseline a timeline replaces.
    #[derive(Debug, Default)]
    struct CondvarTimeline {
        value: Mutex<u64>,
        changed: Condvar,
    }

    impl Timeline for CondvarTimeline {
        fn value(&self) -> Result<u64, sync_timeline::Error> {
            Ok(*self.value.lock().unwrap())
        }
        fn signal(&self, value: u64) -> Result<(), sync_timeline::Error> {
            *self.value.lock().unwrap() = value;
            self.changed.notify_all();
            Ok(())
        }
        fn wait(&self, value: u64, timeout: Duration) -> Result<(), sync_timeline::Error> {
            let guard = self.value.lock().unwrap();
            let (_g, _) = self
                .changed
                .wait_timeout_while(guard, timeout, |v| *v < value)
                .unwrap();
            Ok(())
        }
    }

    fn vulkan_device() -> Option<(wgpu::Device, wgpu::Queue)> {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends: wgpu::Backends::VULKAN,
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        });
        let adapter = pollster::block_on(instance.request_adapter(&Default::default())).ok()?;
        pollster::block_on(adapter.request_device(&Default::default())).ok()
    }

    /// `rounds` ping-pong round trips between this thread and a partner; returns each round
    /// trip's duration. Timelines start at `base` (so they can be reused).
    fn ping_pong(
        ping: Arc<dyn Timeline>,
        pong: Arc<dyn Timeline>,
        base: u64,
        rounds: u64,
    ) -> Vec<Duration> {
        let (p2, q2) = (Arc::clone(&ping), Arc::clone(&pong));
        let partner = std::thread::spawn(move || {
            for i in base + 1..=base + rounds {
                p2.wait(i, LONG).unwrap();
                q2.signal(i).unwrap();
            }
        });
        let mut out = Vec::with_capacity(rounds as usize);
        for i in base + 1..=base + rounds {
            let t = Instant::now();
            ping.signal(i).unwrap();
            pong.wait(i, LONG).unwrap();
            out.push(t.elapsed());
        }
        partner.join().unwrap();
        out
    }

    /// A handoff mechanism: its name and the two timelines a ping-pong runs over.
    type Mechanism = (&'static str, Arc<dyn Timeline>, Arc<dyn Timeline>);

    fn mechanisms(vk: Option<&wgpu::Device>) -> Vec<Mechanism> {
        let mut m: Vec<Mechanism> = vec![
            (
                "cpu-timeline-spin",
                Arc::new(CpuTimeline::new(0)),
                Arc::new(CpuTimeline::new(0)),
            ),
            (
                "cpu-timeline-parked",
                Arc::new(CpuTimeline::with_spin(0, SpinPolicy::Never)),
                Arc::new(CpuTimeline::with_spin(0, SpinPolicy::Never)),
            ),
            (
                "mutex-condvar",
                Arc::new(CondvarTimeline::default()),
                Arc::new(CondvarTimeline::default()),
            ),
        ];
        if let Some(d) = vk {
            m.push((
                "vulkan-timeline-host",
                Arc::new(VulkanTimeline::from_wgpu(d, 0).unwrap()),
                Arc::new(VulkanTimeline::from_wgpu(d, 0).unwrap()),
            ));
        }
        m
    }

    pub(crate) fn handoff(c: &mut Criterion) {
        let gpu = vulkan_device();
        if gpu.is_none() {
            eprintln!("sync benches: no Vulkan adapter, the Vulkan rows are left out");
        }
        eprintln!("\nhandoff latency, one way (half a round trip), 20000 round trips each:");
        eprintln!("{:24} {:>10} {:>10}", "mechanism", "median", "p99");
        for (name, ping, pong) in mechanisms(gpu.as_ref().map(|g| &g.0)) {
            let mut rt = ping_pong(ping, pong, 0, 20_000);
            let (median, p99) = median_p99(&mut rt);
            eprintln!("{name:24} {:>10.2?} {:>10.2?}", median / 2, p99 / 2);
        }
        if let Some((device, queue)) = &gpu {
            let mut lat = device_wait_latency(device, queue, 2000);
            let (median, p99) = median_p99(&mut lat);
            eprintln!(
                "{:24} {:>10.2?} {:>10.2?}",
                "vulkan-device-wait", median, p99
            );
        }
        let mut group = c.benchmark_group("sync_handoff_round_trip");
        group
            .sample_size(20)
            .measurement_time(Duration::from_secs(2));
        for (name, ping, pong) in mechanisms(gpu.as_ref().map(|g| &g.0)) {
            let mut base = 0;
            group.bench_function(name, |b| {
                b.iter_custom(|iters| {
                    let total = ping_pong(Arc::clone(&ping), Arc::clone(&pong), base, iters)
                        .into_iter()
                        .sum();
                    base += iters;
                    total
                })
            });
        }
        group.finish();
    }

    /// Time from a host signal to the completion of a device-side batch that waited on it and
    /// signalled a second timeline, as seen by a host wait on that second timeline.
    fn device_wait_latency(
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        rounds: u64,
    ) -> Vec<Duration> {
        let host = VulkanTimeline::from_wgpu(device, 0).unwrap();
        let gpu = VulkanTimeline::from_wgpu(device, 0).unwrap();
        // SAFETY: the bench is the only user of the queue while it submits.
        let raw = unsafe { queue.as_hal::<wgpu::hal::api::Vulkan>() }
            .expect("vulkan queue")
            .as_raw();
        (1..=rounds)
            .map(|v| {
                // SAFETY: exclusive queue use (above); values increase.
                unsafe { submit_wait_signal(raw, &[(&host, v)], &[(&gpu, v)]) }.unwrap();
                let t = Instant::now();
                host.signal(v).unwrap();
                gpu.wait(v, LONG).unwrap();
                t.elapsed()
            })
            .collect()
    }
}

mod uvm {
    //! uvm-alloc: the cost of making a buffer (allocate, map, drop) per backend available here,
    //! and of a scoped CPU access (begin + end; a dma-buf adds two DMA_BUF_IOCTL_SYNC calls).

    use std::hint::black_box;

    use criterion::Criterion;
    use uvm_alloc::{Access, UnifiedBuffer};

    pub(crate) fn bench(c: &mut Criterion) {
        let mut group = c.benchmark_group("uvm_alloc");
        group.sample_size(20);
        group.bench_function("memfd/1MiB", |b| {
            b.iter(|| UnifiedBuffer::memfd(black_box(1 << 20)).unwrap())
        });
        group.bench_function("host/1MiB", |b| {
            b.iter(|| UnifiedBuffer::host(black_box(1 << 20)).unwrap())
        });
        let buffer = UnifiedBuffer::memfd(1 << 20).unwrap();
        group.bench_function("cpu_access/memfd", |b| {
            b.iter(|| {
                let guard = buffer.cpu_access(0..4096, Access::ReadWrite).unwrap();
                black_box(guard.bytes().len())
            })
        });
        group.finish();
    }
}

mod kv {
    //! kv-paged: allocate/free of one block; a fork plus its copy-on-write append; decode
    //! attention at SmolLM2-135M's shape (9 query heads, 3 KV heads, head_dim 64) over 512, 2048
    //! and 8192 tokens, paged in every dtype beside the contiguous f32 baseline, one thread; and
    //! the prefix-cache hit speedup of a 512-token prompt (K/V writes plus prefill attention).

    use std::hint::black_box;
    use std::time::Duration;

    use criterion::{BenchmarkId, Criterion};
    use kv_paged::attention::{contiguous_decode, decode, prefill};
    use kv_paged::{BlockManager, KvCache, KvLayout, PageDtype};

    const Q_HEADS: usize = 9;
    const KV_HEADS: usize = 3;
    const HD: usize = 64;

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 2654435761 + seed) >> 5) % 2000) as f32 / 1000.0 - 1.0)
            .collect()
    }

    fn filled_cache(dtype: PageDtype, len: usize) -> (KvCache, Vec<f32>, Vec<f32>) {
        let layout = KvLayout {
            layers: 1,
            kv_heads: KV_HEADS,
            head_dim: HD,
            block_tokens: 16,
            dtype,
        };
        let mut cache = KvCache::new(layout, len / 16 + 1, None).unwrap();
        let slots = cache
            .add_sequence(1, &(0..len as u32).collect::<Vec<_>>())
            .unwrap()
            .slots;
        let (k, v) = (
            values(len * KV_HEADS * HD, 1),
            values(len * KV_HEADS * HD, 2),
        );
        for (t, slot) in slots.iter().enumerate() {
            let r = t * KV_HEADS * HD..(t + 1) * KV_HEADS * HD;
            cache.write(0, *slot, &k[r.clone()], &v[r]).unwrap();
        }
        (cache, k, v)
    }

    pub(crate) fn bench(c: &mut Criterion) {
        let mut group = c.benchmark_group("kv_paged");
        let mut m = BlockManager::new(4096, 16).unwrap();
        let tokens: Vec<u32> = (0..16).collect();
        group.bench_function("allocate_free_block", |b| {
            b.iter(|| {
                m.add_sequence(1, black_box(&tokens)).unwrap();
                m.free_sequence(1).unwrap();
            })
        });
        let mut m = BlockManager::new(4096, 16).unwrap();
        m.add_sequence(1, &(0..40).collect::<Vec<u32>>()).unwrap();
        group.bench_function("fork_cow_append_free", |b| {
            b.iter(|| {
                m.fork(1, 2).unwrap();
                black_box(m.append(2, &[7]).unwrap());
                m.free_sequence(2).unwrap();
            })
        });
        group.finish();

        let mut group = c.benchmark_group("kv_decode");
        group
            .sample_size(20)
            .measurement_time(Duration::from_secs(2));
        let q = values(Q_HEADS * HD, 3);
        let mut out = vec![0f32; Q_HEADS * HD];
        for len in [512, 2048, 8192] {
            let (_, k, v) = filled_cache(PageDtype::F32, len);
            group.bench_function(BenchmarkId::new("contiguous-f32", len), |b| {
                b.iter(|| {
                    contiguous_decode(&k, &v, len, KV_HEADS, HD, Q_HEADS, black_box(&q), &mut out)
                })
            });
            for dtype in PageDtype::ALL {
                let (cache, _, _) = filled_cache(dtype, len);
                group.bench_function(BenchmarkId::new(format!("paged-{dtype:?}"), len), |b| {
                    b.iter(|| {
                        decode(&cache, 1, 0, Q_HEADS, black_box(&q), &mut out, 1, None).unwrap()
                    })
                });
            }
        }
        group.finish();

        let mut group = c.benchmark_group("kv_prefix_cache");
        group
            .sample_size(10)
            .measurement_time(Duration::from_secs(3));
        let len = 512;
        let prompt: Vec<u32> = (0..len as u32).collect();
        let kv = values(len * KV_HEADS * HD, 4);
        let q = values(len * Q_HEADS * HD, 5);
        let mut out = vec![0f32; q.len()];
        let layout = KvLayout {
            layers: 1,
            kv_heads: KV_HEADS,
            head_dim: HD,
            block_tokens: 16,
            dtype: PageDtype::F16,
        };
        // One prompt's work: write the K/V of every token the cache did not already hold, then
        // attend for those positions.
        let mut run = |cache: &mut KvCache, seq: u64| {
            let slots = cache.add_sequence(seq, &prompt).unwrap().slots;
            let first = len - slots.len();
            for (i, slot) in slots.iter().enumerate() {
                let r = (first + i) * KV_HEADS * HD..(first + i + 1) * KV_HEADS * HD;
                cache.write(0, *slot, &kv[r.clone()], &kv[r]).unwrap();
            }
            let qs = first * Q_HEADS * HD;
            prefill(cache, seq, 0, Q_HEADS, first, &q[qs..], &mut out[qs..]).unwrap();
        };
        let mut cache = KvCache::new(layout, 2 * len / 16 + 2, None).unwrap();
        group.bench_function("miss/512", |b| {
            b.iter(|| {
                run(&mut cache, 1);
                // Evict the cached prefix so the next iteration misses again.
                cache.free_sequence(1).unwrap();
                cache
                    .add_sequence(9, &(100_000..100_000 + 2 * len as u32).collect::<Vec<_>>())
                    .unwrap();
                cache.free_sequence(9).unwrap();
            })
        });
        let mut cache = KvCache::new(layout, 2 * len / 16 + 2, None).unwrap();
        run(&mut cache, 1);
        cache.free_sequence(1).unwrap();
        group.bench_function("hit/512", |b| {
            b.iter(|| {
                run(&mut cache, 2);
                cache.free_sequence(2).unwrap();
            })
        });
        group.finish();
    }
}

mod isp {
    //! isp-v4l2: the fused pass from a 1920x1080 NV12 frame to a normalised f32 tensor of
    //! 512x512 (SmolVLM's input) and 224x224, one thread (swscale's bilinear, separable; no explicit SIMD yet).

    use std::hint::black_box;
    use std::time::Duration;

    use criterion::{BenchmarkId, Criterion, Throughput};
    use isp_v4l2::isp::{Preprocess, preprocess};
    use isp_v4l2::{FrameSource, Pacing, PatternSource, PixelFormat};
    use uvm_alloc::Access;

    pub(crate) fn bench(c: &mut Criterion) {
        let mut src = PatternSource::new(
            1920,
            1080,
            PixelFormat::Nv12,
            60.0,
            Pacing::AsFastAsPossible,
            None,
        )
        .unwrap();
        let frame = src.next_frame().unwrap().unwrap();
        let guard = frame
            .buffer
            .cpu_access(0..frame.desc.byte_len(), Access::Read)
            .unwrap();
        let mut group = c.benchmark_group("isp_fused");
        group
            .sample_size(10)
            .measurement_time(Duration::from_secs(3));
        group.throughput(Throughput::Elements(1));
        for size in [512usize, 224] {
            let p = Preprocess {
                width: size,
                height: size,
                ..Default::default()
            };
            let mut out = vec![0f32; 3 * size * size];
            group.bench_function(BenchmarkId::new("nv12-1080p-to-f32", size), |b| {
                b.iter(|| preprocess(&frame.desc, black_box(guard.bytes()), &p, &mut out).unwrap())
            });
        }
        group.finish();
        drop(guard);
        gpu(c, &frame);
    }

    /// The WGSL pass on the machine's Vulkan adapter (lavapipe here: the GPU emulated on the
    /// CPU's cores), the frame's unified buffer imported as-is, one submit and wait per frame.
    fn gpu(c: &mut Criterion, frame: &isp_v4l2::Frame) {
        use isp_v4l2::gpu::{Elem, GpuIsp};
        use uvm_alloc::vulkan::{ImportCache, open_wgpu_device};
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends: wgpu::Backends::VULKAN,
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        });
        let Ok(adapter) = pollster::block_on(instance.request_adapter(&Default::default())) else {
            eprintln!("isp_gpu: SKIPPED, no Vulkan adapter");
            return;
        };
        let (device, queue, caps) = open_wgpu_device(&adapter, &Default::default()).unwrap();
        let imports = ImportCache::new(&device, caps, 8);
        // SAFETY: the pattern source wrote the frame under a guard it dropped; the device only
        // reads it, and nothing on the CPU touches it again.
        let frame_gpu = unsafe { imports.get(&frame.buffer) }.unwrap();
        let allocator = uvm_alloc::Allocator::new(uvm_alloc::AllocatorDesc {
            backends: caps.importable_backends(),
            ..Default::default()
        })
        .unwrap();
        let mut group = c.benchmark_group(format!("isp_gpu ({})", adapter.get_info().name));
        group
            .sample_size(10)
            .measurement_time(Duration::from_secs(3));
        group.throughput(Throughput::Elements(1));
        for size in [512usize, 224] {
            let p = Preprocess {
                width: size,
                height: size,
                ..Default::default()
            };
            let mut isp = GpuIsp::new(&device, p, Elem::F32);
            let out = std::sync::Arc::new(allocator.allocate(isp.output_bytes()).unwrap());
            // SAFETY: the output is never read on the CPU (the bench times the pass only).
            let out_gpu = unsafe { imports.get(&out) }.unwrap();
            group.bench_function(BenchmarkId::new("nv12-1080p-to-f32", size), |b| {
                b.iter(|| {
                    isp.submit(&queue, &frame.desc, &frame_gpu, &out_gpu)
                        .unwrap();
                    device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
                })
            });
        }
        group.finish();
    }
}

mod grammar {
    //! Grammar-constrained sampling: one mask step (every token of the vocabulary checked, the
    //! disallowed logits set to -inf) at points of a JSON document, one thread, and compiling
    //! the JSON schema, for pipeline's engine (llguidance) and, in the same run, the previous
    //! engine it replaced (a byte DFA over a token trie, `benches::dfa_grammar`), the peer. The
    //! vocabulary is SmolLM2's 49,152 tokens when the GGUF is at `$SMOLLM2_GGUF` or
    //! `models/SmolLM2-135M-Instruct.Q4_1.gguf`, else a synthetic one of the same size (ids say
    //! which).
    //!
    //! Target: a mask step well under 1 ms on one core, a small share of a 135M model's decode
    //! step (3.7 ms on this machine). Figures and the command are in the README.

    use std::hint::black_box;
    use std::path::PathBuf;
    use std::time::Duration;

    use criterion::{BenchmarkId, Criterion, Throughput};

    const VOCAB: usize = 49_152;

    /// SmolLM2's token bytes and stop ids if its GGUF is here, else a synthetic vocabulary of
    /// the same size.
    fn tokens() -> (&'static str, Vec<Option<Vec<u8>>>, Vec<u32>) {
        let path = std::env::var_os("SMOLLM2_GGUF").map_or_else(
            || {
                PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                    .join("../models/SmolLM2-135M-Instruct.Q4_1.gguf")
            },
            PathBuf::from,
        );
        if path.is_file() {
            let file = pipeline::model::gguf::GgufFile::open(&path).unwrap();
            let tokenizer = pipeline::model::tokenizer::Tokenizer::from_gguf(&file).unwrap();
            let tokens = (0..tokenizer.vocab_size() as u32)
                .map(|id| tokenizer.token_bytes(id))
                .collect();
            return ("smollm2", tokens, tokenizer.stop_ids().to_vec());
        }
        eprintln!("grammar benches: no SmolLM2 GGUF, using a synthetic vocabulary");
        ("synthetic", synthetic_tokens(), vec![0])
    }

    /// Two specials, the 256 bytes, then words of 2..=12 letters, digits and punctuation, about
    /// half with a leading space, as in a byte-level BPE vocabulary.
    fn synthetic_tokens() -> Vec<Option<Vec<u8>>> {
        const CHARS: &[u8] = b"etaoinshrdlucmfwypvbgkjqxzETAOINSHRDLU0123456789.,:;\"'-_(){}[]";
        let mut tokens: Vec<Option<Vec<u8>>> = vec![None, None];
        tokens.extend((0..=255u8).map(|b| Some(vec![b])));
        let mut seen = std::collections::HashSet::new();
        let mut rng = 0x2545_F491_4F6C_DD1Du64;
        while tokens.len() < VOCAB {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let len = 2 + (rng % 11) as usize;
            let mut word = Vec::with_capacity(len + 1);
            if rng >> 60 < 8 {
                word.push(b' ');
            }
            for k in 0..len {
                word.push(CHARS[((rng >> (4 * k + 8)) as usize * 31 + k) % CHARS.len()]);
            }
            if seen.insert(word.clone()) {
                tokens.push(Some(word));
            }
        }
        tokens
    }

    /// The points of the document the mask is measured at: the text generated so far.
    const POINTS: [(&str, &str); 3] = [
        ("json-start", ""),
        ("json-after-key", "{\"name\""),
        ("json-in-string", "{\"name\": \"Ada Lov"),
    ];

    pub(crate) fn bench(c: &mut Criterion) {
        let (source, tokens, eos) = tokens();
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "age": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}
            },
            "required": ["name", "age"]
        });
        let llg_vocab = pipeline::grammar::TokenVocab::new(tokens.clone(), &eos);
        let dfa_vocab = benches::dfa_grammar::TokenVocab::new(tokens, &eos);
        let llg = pipeline::grammar::Grammar::json_schema(&schema, &llg_vocab).unwrap();
        let dfa = benches::dfa_grammar::Grammar::json_schema(&schema, &dfa_vocab).unwrap();
        let mut group = c.benchmark_group("grammar_mask");
        group
            .sample_size(50)
            .measurement_time(Duration::from_secs(2))
            .throughput(Throughput::Elements(llg_vocab.len() as u64));
        let mut logits = vec![0f32; llg_vocab.len()];
        for (point, text) in POINTS {
            // The text spelled with the vocabulary's tokens, as a model would have generated it.
            let mut state = llg.start();
            llg.advance_text(&mut state, text.as_bytes()).unwrap();
            let state = state;
            group.bench_function(
                BenchmarkId::new(format!("llguidance/{source}"), point),
                // A fresh copy of the state per step (made outside the timing): a parser may
                // keep the mask it computed for its state, and the bench must not time that.
                |b| {
                    b.iter_batched(
                        || state.clone(),
                        |mut s| llg.mask(black_box(&mut s), &mut logits).unwrap(),
                        criterion::BatchSize::SmallInput,
                    )
                },
            );
            let dfa_state = dfa
                .advance_bytes(dfa.start(), text.as_bytes())
                .unwrap()
                .unwrap();
            group.bench_function(BenchmarkId::new(format!("dfa-peer/{source}"), point), |b| {
                b.iter(|| dfa.mask(black_box(dfa_state), &mut logits).unwrap())
            });
        }
        group.finish();

        let mut group = c.benchmark_group("grammar_build");
        group.sample_size(10);
        group.bench_function(
            BenchmarkId::new(format!("llguidance/{source}"), "json-schema"),
            |b| {
                b.iter(|| {
                    pipeline::grammar::Grammar::json_schema(black_box(&schema), &llg_vocab).unwrap()
                })
            },
        );
        group.bench_function(
            BenchmarkId::new(format!("dfa-peer/{source}"), "json-schema"),
            |b| {
                b.iter(|| {
                    benches::dfa_grammar::Grammar::json_schema(black_box(&schema), &dfa_vocab)
                        .unwrap()
                })
            },
        );
        group.finish();
    }
}

mod vision {
    //! The vision encoder, one image per iteration, at the `tiny` shape (128x128, 4 layers,
    //! hidden 192): the CPU encoder (the peer every GPU figure is quoted against, measured in
    //! the same run) and the WGSL encoder on the first Vulkan adapter with each weight format:
    //! f32, f16 (where the adapter has f16 shaders) and MX (decoded inside the GEMM). On a GPU
    //! with cooperative matrices the tensor-core kernels run; elsewhere the register GEMM.
    use criterion::{BenchmarkId, Criterion, Throughput};
    use pipeline::vision::{VisionConfig, VisionEncoder};
    use pipeline::vision_gpu::{GemmKernel, GpuVisionEncoder, GpuVisionOptions};
    use std::hint::black_box;
    use wgpu::util::DeviceExt;

    fn tower() -> VisionEncoder {
        let config = VisionConfig {
            image_size: 128,
            patch_size: 16,
            hidden: 192,
            intermediate: 768,
            layers: 4,
            heads: 3,
            layer_norm_eps: 1e-6,
            scale_factor: 2,
            text_hidden: 576,
        };
        VisionEncoder::random(config, 7).expect("a valid shape")
    }

    pub(crate) fn bench(c: &mut Criterion) {
        let cpu = tower();
        let s = cpu.config().image_size;
        let pixels: Vec<f32> = (0..3 * s * s)
            .map(|i| (i % 255) as f32 / 127.5 - 1.0)
            .collect();
        let mut group = c.benchmark_group("vision_encoder");
        group.sample_size(10);
        group.throughput(Throughput::Elements(1));
        group.bench_function("cpu", |b| {
            b.iter(|| cpu.encode(black_box(&pixels)).unwrap())
        });
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends: wgpu::Backends::VULKAN,
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        });
        let Ok(adapter) = pollster::block_on(instance.request_adapter(&Default::default())) else {
            eprintln!("vision_encoder: no Vulkan adapter, GPU cases skipped");
            group.finish();
            return;
        };
        let (desc, defaults) = pipeline::vision_gpu::device_descriptor(&adapter);
        let (device, queue) =
            pollster::block_on(adapter.request_device(&desc)).expect("the adapter's own device");
        let input = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("pixels"),
            contents: bytemuck::cast_slice(&pixels),
            usage: wgpu::BufferUsages::STORAGE,
        });
        let mut cases = vec![("f32", defaults)];
        if desc.required_features.contains(wgpu::Features::SHADER_F16)
            && defaults.gemm != GemmKernel::Coop
        {
            let f16 = GpuVisionOptions {
                gemm: GemmKernel::RegisterF16,
                ..defaults
            };
            cases.push(("f16", f16));
        }
        for (name, format) in [
            ("mxint8", mx_quant::ElemFormat::Int8),
            ("mxfp4", mx_quant::ElemFormat::Fp4E2M1),
        ] {
            let mx = GpuVisionOptions {
                mx_weights: Some(format),
                ..defaults
            };
            cases.push((name, mx));
        }
        for (weights, options) in cases {
            let gpu = GpuVisionEncoder::with_options(&device, &cpu, options).expect("the tower");
            let output = device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("embeddings"),
                size: gpu.output_bytes(),
                usage: wgpu::BufferUsages::STORAGE,
                mapped_at_creation: false,
            });
            let id = BenchmarkId::new(format!("gpu/{:?}", gpu.options().gemm), weights);
            group.bench_function(id, |b| {
                b.iter(|| {
                    let mut encoder = device.create_command_encoder(&Default::default());
                    gpu.record(&device, &mut encoder, &input, &output)
                        .expect("buffers of the encoder's sizes");
                    queue.submit([encoder.finish()]);
                    device
                        .poll(wgpu::PollType::wait_indefinitely())
                        .expect("the device answers");
                })
            });
        }
        group.finish();
    }
}

mod speculative {
    //! Speculative decoding's two costs and its payoff, on SmolLM2-135M (default policy, the
    //! CPU NPU on every core) when its GGUF is at `$SMOLLM2_GGUF` or
    //! `models/SmolLM2-135M-Instruct.Q4_1.gguf`, else the tiny fixture (ids say which):
    //! - `decode_verify/rows`: one decoder pass over 1, 2, 4, 8 and 16 rows at a 256-token
    //!   context, rolled back after each (the rollback's cost included). Its slope over the
    //!   one-row pass is `speculative::CPU_ROW_COST`.
    //! - `speculative_generate`: 128 greedy tokens of fixtures/prompts/repeat-passage.txt,
    //!   plain and with `ngram` drafts (the copy-heavy target: 1.5x), and of the README's
    //!   story prompt (not below 0.97x).

    use std::path::PathBuf;
    use std::time::Duration;

    use criterion::{BenchmarkId, Criterion};
    use npu_hal::sampling::SamplingParams;
    use pipeline::decoder::{Decoder, DecoderOptions, WeightPolicy};
    use pipeline::speculative::{CPU_ROW_COST, DraftControl, NgramDrafter};

    fn open() -> (
        &'static str,
        Decoder,
        Option<pipeline::model::tokenizer::Tokenizer>,
    ) {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let smollm2 = std::env::var_os("SMOLLM2_GGUF").map_or_else(
            || root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
            PathBuf::from,
        );
        let (name, path) = if smollm2.is_file() {
            ("smollm2", smollm2)
        } else {
            eprintln!("speculative benches: no SmolLM2 GGUF, using fixtures/tiny-llama");
            ("tiny", root.join("fixtures/tiny-llama/tiny.gguf"))
        };
        let options = DecoderOptions {
            policy: WeightPolicy::parse("default").unwrap(),
            ctx: 512,
            max_batch: 512,
            max_logit_rows: 16,
            kv_dtype: kv_paged::PageDtype::F16,
            cache: None,
        };
        let (d, tok) = pipeline::llm::open_decoder(&path, options, 0).unwrap();
        (name, d, tok)
    }

    pub(crate) fn bench(c: &mut Criterion) {
        let (model, mut d, tok) = open();
        let vocab = d.config().vocab_size as u32;
        let context: Vec<u32> = (0..256u32).map(|i| (i * 7919 + 13) % vocab).collect();
        let mut group = c.benchmark_group("decode_verify");
        group
            .sample_size(30)
            .measurement_time(Duration::from_secs(4));
        d.reset().unwrap();
        d.forward_last(&context).unwrap();
        for rows in [1usize, 2, 4, 8, 16] {
            let feed: Vec<u32> = (0..rows as u32).map(|i| (i * 31 + 5) % vocab).collect();
            group.bench_function(BenchmarkId::new(format!("{model}/rows"), rows), |b| {
                b.iter(|| {
                    d.forward(&feed, 0..rows, |_, l| {
                        std::hint::black_box(l[0]);
                    })
                    .unwrap();
                    d.truncate(context.len()).unwrap();
                })
            });
        }
        group.finish();
        let Some(tok) = tok else {
            return;
        };
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let passage =
            std::fs::read_to_string(root.join("fixtures/prompts/repeat-passage.txt")).unwrap();
        let bos = d.config().add_bos;
        let prompts = [
            (
                "repeat-passage",
                tok.encode(passage.trim_end(), bos).unwrap(),
            ),
            (
                "story",
                tok.encode("Once upon a time, there was a little robot who", bos)
                    .unwrap(),
            ),
        ];
        let mut group = c.benchmark_group("speculative_generate");
        group
            .sample_size(10)
            .measurement_time(Duration::from_secs(8));
        for (name, prompt) in &prompts {
            for drafting in [false, true] {
                let label = if drafting { "ngram" } else { "plain" };
                group.bench_function(BenchmarkId::new(format!("{model}/{name}"), label), |b| {
                    b.iter(|| {
                        let mut ngram = NgramDrafter::default();
                        let speculation = drafting.then(|| pipeline::llm::Speculation {
                            drafter: &mut ngram,
                            control: DraftControl::new(8, CPU_ROW_COST),
                        });
                        pipeline::llm::generate_speculative(
                            &mut d,
                            prompt,
                            128,
                            SamplingParams::default(),
                            &[],
                            None,
                            speculation,
                            |_| true,
                        )
                        .unwrap()
                    })
                });
            }
        }
        group.finish();
    }
}

mod sampling {
    //! Greedy sampling's argmax over SmolLM2's 49152 logits (what every decode step runs on the
    //! host), against the plain one-pass fold that defines it; compare its GB/s with the
    //! `bandwidth` group of the same run.

    use std::hint::black_box;

    use criterion::{Criterion, Throughput};

    /// The first index of the largest non-NaN value, one comparison per element.
    fn plain_argmax(x: &[f32]) -> Option<(usize, f32)> {
        x.iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan())
            .fold(None, |best, (i, &v)| match best {
                Some((_, b)) if b >= v => best,
                _ => Some((i, v)),
            })
    }

    pub(crate) fn bench(c: &mut Criterion) {
        let vocab = 49152;
        let logits: Vec<f32> = (0..vocab)
            .map(|i| ((i as u64 * 2_654_435_761) % 10_007) as f32 * 1e-3)
            .collect();
        assert_eq!(npu_hal::kernels::argmax(&logits), plain_argmax(&logits));
        let mut group = c.benchmark_group("sampling");
        group.throughput(Throughput::Bytes(4 * vocab as u64));
        group.bench_function("argmax/49152", |b| {
            b.iter(|| npu_hal::kernels::argmax(black_box(&logits)))
        });
        group.bench_function("plain-fold/49152", |b| {
            b.iter(|| plain_argmax(black_box(&logits)))
        });
        group.finish();
    }
}

criterion_group!(
    benches,
    bandwidth::bench,
    mx::quantize,
    mx::gemv,
    mx::rotation,
    mx::hessian,
    sync::handoff,
    uvm::bench,
    kv::bench,
    isp::bench,
    grammar::bench,
    speculative::bench,
    vision::bench,
    sampling::bench
);
criterion_main!(benches);
