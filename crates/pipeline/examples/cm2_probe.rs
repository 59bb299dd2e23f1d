//! Issue 21's probe of NVIDIA's cooperative matrices 2 (`pipeline::cm2`): what the first
//! Vulkan adapter offers of `VK_NV_cooperative_matrix2`, then `Y = X W^T` at the vision
//! encoder's GEMM shapes (SigLIP-B/16 at 512: 1024 rows per image; QKV, O, fc1, fc2) with each
//! kernel the device runs, checked against an f64 reference on sampled outputs and timed.
//! One JSON line per (kernel, shape) on stdout, the support report first.
//!
//! `cargo run --release -p pipeline --example cm2_probe -- [BATCHES] [REPS]`
//!
//! BATCHES is a comma list of images per GEMM (default `1,8`), REPS the dispatches per timed
//! submission (default 20; the median of 5 submissions is reported). The plain kernel (one
//! output per invocation) runs only at shapes under 2^26 multiply-adds unless `PLAIN_ALL=1`:
//! on a CPU-hosted driver the encoder's shapes take minutes. The WGSL tensor-core GEMM's
//! figures for the same shapes come from `vit_bench -- b16-512 gpu 30 coop tiled batch:N
//! profile` in the same device call (README, "Vision encoder").

use pipeline::cm2::{GemmDevice, Kernel, sampled_error};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let batches: Vec<u32> = args
        .get(1)
        .map_or("1,8", String::as_str)
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let reps: u32 = args.get(2).map_or(Ok(20), |s| s.parse())?;
    let plain_all = std::env::var("PLAIN_ALL").is_ok_and(|v| v == "1");
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::VULKAN,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
        power_preference: wgpu::PowerPreference::HighPerformance,
        ..Default::default()
    }))?;
    let info = adapter.get_info();
    let gpu = GemmDevice::open(&adapter)?;
    println!(
        "{}",
        serde_json::json!({
            "device": info.name,
            "driver": info.driver_info,
            "support": gpu.support,
            "runs_cm2": gpu.support.runs_cm2(),
            "kernels": gpu.kernels(),
        })
    );
    // SigLIP-B/16 at 512: (N, K) of the fused QKV, O, fc1 and fc2 projections.
    let layers = [
        ("qkv", 2304, 768),
        ("o", 768, 768),
        ("fc1", 3072, 768),
        ("fc2", 768, 3072),
    ];
    let mut state = 0x2545_f491u32;
    let mut random = |len: usize| -> Vec<u16> {
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                half::f16::from_f32((state >> 8) as f32 / (1u32 << 24) as f32 - 0.5).to_bits()
            })
            .collect()
    };
    let mut shapes = vec![("small", 128u32, 256u32, 192u32)];
    for &b in &batches {
        for (name, n, k) in layers {
            shapes.push((name, 1024 * b, n, k));
        }
    }
    for (name, m, n, k) in shapes {
        let x = random((m * k) as usize);
        let w = random((n * k) as usize);
        for kernel in gpu.kernels() {
            let macs = u64::from(m) * u64::from(n) * u64::from(k);
            if kernel == Kernel::Plain && macs >= 1 << 26 && !plain_all {
                continue;
            }
            if let Kernel::Cm2(b) = kernel
                && gpu.support.admits(b) == Some(false)
            {
                println!(
                    "{}",
                    serde_json::json!({"layer": name, "m": m, "n": n, "k": k, "kernel": kernel,
                        "skipped": "the driver's flexible dimensions do not admit this blocking"})
                );
                continue;
            }
            let line = match gpu.run(kernel, &x, &w, (m, n, k), reps, 5) {
                Ok(run) => {
                    let s = run.per_dispatch.as_secs_f64();
                    let err =
                        sampled_error(&x, &w, &run.y, (m as usize, n as usize, k as usize), 4096);
                    serde_json::json!({"layer": name, "m": m, "n": n, "k": k, "kernel": kernel,
                        "us": s * 1e6, "tflops": 2.0 * macs as f64 / s / 1e12,
                        "max_rel_error": err})
                }
                Err(e) => serde_json::json!({"layer": name, "m": m, "n": n, "k": k,
                    "kernel": kernel, "error": e.to_string()}),
            };
            println!("{line}");
        }
    }
    Ok(())
}
