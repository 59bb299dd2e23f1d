//! The WGSL dequant-GEMV on a real Vulkan driver (lavapipe in CI), every format, against an f64
//! reference over the same dequantized weights.
//!
//! Without a Vulkan adapter the test fails when `CI=true` and otherwise prints a visible skip.

use std::io::Write;

use mx_quant::layout::packed_len;
use mx_quant::{BLOCK, ElemFormat, QuantOptions, bulk, wgsl};
use wgpu::util::DeviceExt;

fn device() -> Option<(wgpu::Device, wgpu::Queue)> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::VULKAN,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let adapter = pollster::block_on(instance.request_adapter(&Default::default())).ok()?;
    pollster::block_on(adapter.request_device(&Default::default())).ok()
}

fn gpu_gemv(
    (device, queue): &(wgpu::Device, wgpu::Queue),
    format: ElemFormat,
    rows: usize,
    cols: usize,
    scales: &[u8],
    packed: &[u8],
    x: &[f32],
) -> Vec<f32> {
    wgsl::check_shape(format, rows, cols).unwrap();
    let storage = |label, contents: &[u8]| {
        device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents,
            usage: wgpu::BufferUsages::STORAGE,
        })
    };
    let codes = storage("codes", bytemuck::cast_slice(&wgsl::words(packed)));
    let scale_buf = storage("scales", bytemuck::cast_slice(&wgsl::words(scales)));
    let x_buf = storage("x", bytemuck::cast_slice(x));
    let y_bytes = (rows * 4) as u64;
    let y_buf = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("y"),
        size: y_bytes,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let params = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some("params"),
        contents: bytemuck::cast_slice(&[rows as u32, cols as u32]),
        usage: wgpu::BufferUsages::UNIFORM,
    });
    let readback = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("readback"),
        size: y_bytes,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("mx gemv"),
        source: wgpu::ShaderSource::Wgsl(wgsl::GEMV_SOURCE.into()),
    });
    let constants = wgsl::override_constants(format);
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("mx gemv"),
        layout: None,
        module: &module,
        entry_point: Some(wgsl::GEMV_ENTRY),
        compilation_options: wgpu::PipelineCompilationOptions {
            constants: &constants,
            ..Default::default()
        },
        cache: None,
    });
    let bind = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry {
                binding: 0,
                resource: codes.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 1,
                resource: scale_buf.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 2,
                resource: x_buf.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 3,
                resource: y_buf.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 4,
                resource: params.as_entire_binding(),
            },
        ],
    });
    let mut encoder = device.create_command_encoder(&Default::default());
    {
        let mut pass = encoder.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind, &[]);
        let (gx, gy, gz) = wgsl::dispatch_size(rows as u32);
        pass.dispatch_workgroups(gx, gy, gz);
    }
    // The test's own readback: on lavapipe the zero-copy path is uvm-alloc's business.
    encoder.copy_buffer_to_buffer(&y_buf, 0, &readback, 0, y_bytes);
    queue.submit([encoder.finish()]);
    readback
        .slice(..)
        .map_async(wgpu::MapMode::Read, |r| r.expect("map readback"));
    device
        .poll(wgpu::PollType::wait_indefinitely())
        .expect("poll");
    let view = readback.slice(..).get_mapped_range().expect("mapped");
    bytemuck::cast_slice(&view).to_vec()
}

#[test]
fn wgsl_gemv_matches_reference_for_every_format() {
    let Some(gpu) = device() else {
        let msg = "no Vulkan adapter; install mesa-vulkan-drivers libvulkan1 (lavapipe)";
        let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
        assert!(!ci, "{msg}: CI must run the GPU path for real");
        let _ = writeln!(
            std::io::stderr(),
            "\nSKIPPED wgsl_gemv_matches_reference_for_every_format: {msg}\n"
        );
        return;
    };
    let (rows, cols) = (75, 160);
    let data: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
        .collect();
    let x: Vec<f32> = (0..cols)
        .map(|i| ((i * 13 % 29) as f32 - 14.0) / 9.0)
        .collect();
    for format in ElemFormat::ALL {
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
        let mut w = vec![0f32; rows * cols];
        bulk::dequantize(format, &scales, &packed, &mut w).unwrap();
        let y = gpu_gemv(&gpu, format, rows, cols, &scales, &packed, &x);
        for r in 0..rows {
            let row = &w[r * cols..(r + 1) * cols];
            let exact: f64 = row
                .iter()
                .zip(&x)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum();
            let abs: f64 = row
                .iter()
                .zip(&x)
                .map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs())
                .sum();
            // f32 accumulation over `cols` products, in whatever order the GPU sums them.
            let bound = (cols as f64 + 2.0) * f64::from(f32::EPSILON) * abs;
            assert!(
                (f64::from(y[r]) - exact).abs() <= bound,
                "{format} row {r}: gpu {} vs {exact}",
                y[r]
            );
        }
    }
}
