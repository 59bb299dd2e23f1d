//! Times the vision encoder (SigLIP tower + SmolVLM connector) with random weights at a real
//! size, on the first Vulkan adapter (WGSL) or the CPU, and prints one JSON line: median and
//! minimum milliseconds per image over the timed runs, TFLOP/s at the median, and the device.
//!
//! `cargo run --release -p pipeline --example vit_bench -- [b16-512|synthetic|tiny] [gpu|cpu] [ITERS]
//! [small|blocked|register|register-f16|coop] [per-query|tiled] [profile]` (the GEMM and attention kernels;
//! `profile` adds each kernel's share of one image from GPU timestamps, where the device has
//! `TIMESTAMP_QUERY_INSIDE_PASSES`; `VIT_COOP_TILE=ROWSxCOLS/TMxTN[/pN][/pairs]` forces one tensor-core GEMM
//! blocking (`pipeline::vision_gpu::CoopTile`); `split:N` splits the residual tensor-core GEMMs over k in N
//! (`GpuVisionOptions::coop_split_k`);
//! an extra `mx:FORMAT` argument (`mx:fp8_e4m3`, `mx:int8`, ...) stores the GEMM weights in MX;
//! `batch:N` encodes N images per submission (`GpuVisionEncoder::with_batch`), and the JSON's
//! `median_ms` is then per batch, `ms_per_image` per image; with `coop`, the attention is the
//! fragment kernel where `vision_gpu::fragment_attention_support` holds, and `wgsl-attention`
//! keeps the WGSL one)
//!
//! `b16-512` is SmolVLM-256M's tower: SigLIP-B/16 at 512x512 (1024 patches, hidden 768, 12
//! layers, 12 heads, MLP 3072), connector to 576. Each GPU iteration records one command encoder
//! and waits for it, so a figure includes submission and the wait.

use std::time::Instant;

use pipeline::vision::{VisionConfig, VisionEncoder};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let shape = args.get(1).map_or("b16-512", String::as_str);
    let backend = args.get(2).map_or("gpu", String::as_str);
    let iters: usize = args.get(3).map_or(Ok(20), |s| s.parse())?;
    // Kernel choice: small|blocked GEMM, per-query|tiled attention.
    let gemm = match args.get(4).map_or("small", String::as_str) {
        "blocked" => pipeline::vision_gpu::GemmKernel::Blocked,
        "register" => pipeline::vision_gpu::GemmKernel::Register,
        "register-f16" => pipeline::vision_gpu::GemmKernel::RegisterF16,
        "coop" => pipeline::vision_gpu::GemmKernel::Coop,
        _ => pipeline::vision_gpu::GemmKernel::Small,
    };
    let attention = match args.get(5).map_or("tiled", String::as_str) {
        "per-query" => pipeline::vision_gpu::AttentionKernel::PerQuery,
        _ => pipeline::vision_gpu::AttentionKernel::Tiled,
    };
    let coop_tile = match std::env::var("VIT_COOP_TILE") {
        Ok(text) => Some(pipeline::vision_gpu::CoopTile::parse(&text)?),
        Err(_) => None,
    };
    // `split:N`: the residual tensor-core GEMMs split over k into N slices.
    let coop_split_k = match args.iter().find_map(|a| a.strip_prefix("split:")) {
        Some(n) => Some(n.parse::<u32>().map_err(|e| format!("split:{n}: {e}"))?),
        None => None,
    };
    // `mx:FORMAT` anywhere after the shape: GEMM weights in that MX format, decoded in-kernel.
    let mx_weights = match args.iter().find_map(|a| a.strip_prefix("mx:")) {
        Some(name) => Some(
            mx_quant::ElemFormat::from_name(name)
                .ok_or_else(|| format!("unknown MX format {name}"))?,
        ),
        None => None,
    };
    // `wgsl-attention` keeps the WGSL tensor-core attention where the fragment one would run.
    let wgsl_attention = args.iter().any(|a| a == "wgsl-attention");
    let mut options = pipeline::vision_gpu::GpuVisionOptions {
        gemm,
        attention,
        coop_tile,
        mx_weights,
        coop_attention: pipeline::vision_gpu::CoopAttention::Wgsl,
        coop_split_k,
    };
    let config = match shape {
        "b16-512" => VisionConfig {
            image_size: 512,
            patch_size: 16,
            hidden: 768,
            intermediate: 3072,
            layers: 12,
            heads: 12,
            layer_norm_eps: 1e-6,
            scale_factor: 4,
            text_hidden: 576,
        },
        "tiny" => VisionConfig {
            image_size: 128,
            patch_size: 16,
            hidden: 192,
            intermediate: 768,
            layers: 4,
            heads: 3,
            layer_norm_eps: 1e-6,
            scale_factor: 2,
            text_hidden: 576,
        },
        // `pipeline run`'s default synthetic tower (chain::builder::SyntheticTower).
        "synthetic" => VisionConfig {
            image_size: 224,
            patch_size: 16,
            hidden: 192,
            intermediate: 768,
            layers: 4,
            heads: 3,
            layer_norm_eps: 1e-6,
            scale_factor: 2,
            text_hidden: 576,
        },
        other => {
            return Err(format!("unknown shape {other}: b16-512, synthetic or tiny").into());
        }
    };
    let cpu = VisionEncoder::random(config.clone(), 7)?;
    let s = config.image_size;
    let pixels: Vec<f32> = (0..3 * s * s)
        .map(|i| ((i % 255) as f32 / 127.5) - 1.0)
        .collect();
    let profile = args.iter().skip(6).any(|a| a == "profile");
    let batch: usize = match args.iter().find_map(|a| a.strip_prefix("batch:")) {
        Some(n) => n.parse()?,
        None => 1,
    };
    if batch > 1 && backend != "gpu" {
        return Err("batch:N is for the gpu backend".into());
    }
    let mut kernel_ms: Option<serde_json::Map<String, serde_json::Value>> = None;
    let mut times = Vec::with_capacity(iters);
    let device_name;
    let mut kernels_built = None;
    match backend {
        "cpu" => {
            device_name = "cpu".to_string();
            for _ in 0..iters.max(1) + 1 {
                let t = Instant::now();
                std::hint::black_box(cpu.encode(&pixels)?);
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        "gpu" => {
            use wgpu::util::DeviceExt;
            let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
                backends: wgpu::Backends::VULKAN,
                ..wgpu::InstanceDescriptor::new_without_display_handle()
            });
            let adapter = pollster::block_on(instance.request_adapter(&Default::default()))?;
            device_name = adapter.get_info().name;
            // The adapter's limits, and its cooperative-matrix features when it has them.
            let (mut desc, _) = pipeline::vision_gpu::device_descriptor(&adapter);
            let stamps =
                wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES;
            let profile = profile && adapter.features().contains(stamps);
            if profile {
                desc.required_features |= stamps;
            }
            let (device, queue) = pollster::block_on(adapter.request_device(&desc))?;
            if gemm == pipeline::vision_gpu::GemmKernel::Coop && !wgsl_attention {
                match pipeline::vision_gpu::fragment_attention_support(&device, &queue) {
                    Ok(layout) => {
                        options.coop_attention =
                            pipeline::vision_gpu::CoopAttention::Fragments(layout);
                    }
                    Err(why) => eprintln!("fragment attention not taken: {why}"),
                }
            }
            let gpu =
                pipeline::vision_gpu::GpuVisionEncoder::with_batch(&device, &cpu, options, batch)?;
            kernels_built = Some(format!("{:?}", gpu.options()));
            let images: Vec<f32> = pixels.repeat(batch);
            let input = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("pixels"),
                contents: bytemuck::cast_slice(&images),
                usage: wgpu::BufferUsages::STORAGE,
            });
            let output = device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("embeddings"),
                size: gpu.output_bytes(),
                usage: wgpu::BufferUsages::STORAGE,
                mapped_at_creation: false,
            });
            for _ in 0..iters.max(1) + 1 {
                let t = Instant::now();
                let mut encoder = device.create_command_encoder(&Default::default());
                gpu.record(&device, &mut encoder, &input, &output)?;
                queue.submit([encoder.finish()]);
                device.poll(wgpu::PollType::wait_indefinitely())?;
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
            if profile {
                kernel_ms = Some(profile_one(&device, &queue, &gpu, &input, &output)?);
            }
        }
        other => return Err(format!("unknown backend {other}: gpu or cpu").into()),
    }
    times.remove(0); // warm-up (pipeline compilation, first-touch)
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    println!(
        "{}",
        serde_json::json!({
            "shape": shape,
            "backend": backend,
            "kernels": kernels_built.unwrap_or_else(|| format!("{options:?}")),
            "device": device_name,
            "iters": times.len(),
            "batch": batch,
            "median_ms": median,
            "min_ms": times[0],
            "ms_per_image": median / batch as f64,
            "images_per_s": 1e3 * batch as f64 / median,
            "gflop_per_image": cpu.flops() / 1e9,
            "tflops_at_median": cpu.flops() * batch as f64 / (median * 1e-3) / 1e12,
            "kernel_ms": kernel_ms,
        })
    );
    Ok(())
}

/// One encode (a batch) with a timestamp after every dispatch: milliseconds per kernel, summed over its
/// dispatches, plus `gaps` (time between dispatches: barriers and launch).
fn profile_one(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    gpu: &pipeline::vision_gpu::GpuVisionEncoder,
    input: &wgpu::Buffer,
    output: &wgpu::Buffer,
) -> Result<serde_json::Map<String, serde_json::Value>, Box<dyn std::error::Error>> {
    let kernels = gpu.dispatch_kernels();
    let count = kernels.len() as u32 + 1;
    let set = device.create_query_set(&wgpu::QuerySetDescriptor {
        label: Some("profile"),
        ty: wgpu::QueryType::Timestamp,
        count,
    });
    let bytes = u64::from(count) * 8;
    let resolve = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("timestamps"),
        size: bytes,
        usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let readback = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("timestamps readback"),
        size: bytes,
        usage: wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::MAP_READ,
        mapped_at_creation: false,
    });
    let mut encoder = device.create_command_encoder(&Default::default());
    gpu.record_profiled(device, &mut encoder, input, output, Some(&set))?;
    encoder.resolve_query_set(&set, 0..count, &resolve, 0);
    encoder.copy_buffer_to_buffer(&resolve, 0, &readback, 0, bytes);
    queue.submit([encoder.finish()]);
    readback.slice(..).map_async(wgpu::MapMode::Read, |_| {});
    device.poll(wgpu::PollType::wait_indefinitely())?;
    let data = readback
        .slice(..)
        .get_mapped_range()
        .map_err(|e| format!("reading timestamps: {e:?}"))?;
    let ticks: Vec<u64> = bytemuck::cast_slice::<u8, u64>(&data).to_vec();
    let period = f64::from(queue.get_timestamp_period());
    let mut totals = serde_json::Map::new();
    for (i, name) in kernels.iter().enumerate() {
        let ms = ticks[i + 1].saturating_sub(ticks[i]) as f64 * period / 1e6;
        let entry = totals.entry(name.to_string()).or_insert(0.0.into());
        *entry = (entry.as_f64().unwrap_or(0.0) + ms).into();
    }
    let total = ticks[kernels.len()].saturating_sub(ticks[0]) as f64 * period / 1e6;
    totals.insert("total".into(), total.into());
    // The first dispatches one by one (the input's, then the first layer's), in microseconds.
    let first: Vec<serde_json::Value> = kernels
        .iter()
        .enumerate()
        .take(12)
        .map(|(i, name)| {
            let us = ticks[i + 1].saturating_sub(ticks[i]) as f64 * period / 1e3;
            serde_json::json!([name, (us * 10.0).round() / 10.0])
        })
        .collect();
    totals.insert("first_dispatches_us".into(), first.into());
    Ok(totals)
}
