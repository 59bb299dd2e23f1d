//! Proof that the test suite drives a real Vulkan driver: wgpu's Vulkan backend runs a compute
//! shader and its output is checked element by element.
//!
//! On CI the driver is lavapipe (Mesa's software Vulkan). Without any Vulkan adapter the test
//! fails when `CI=true` and otherwise prints a visible skip naming the packages to install; it
//! never passes without having run the shader.

use std::io::Write;

use wgpu::util::DeviceExt;

const SHADER: &str = r#"
@group(0) @binding(0) var<storage, read> input: array<u32>;
@group(0) @binding(1) var<storage, read_write> output: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = id.x;
    if (i < arrayLength(&input)) {
        output[i] = input[i] * input[i] + i;
    }
}
"#;

fn vulkan_adapter() -> Option<wgpu::Adapter> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::VULKAN,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
        power_preference: wgpu::PowerPreference::HighPerformance,
        ..Default::default()
    }))
    .ok()
}

#[test]
fn compute_shader_runs_on_vulkan() {
    let Some(adapter) = vulkan_adapter() else {
        let msg = "no Vulkan adapter found; install a Vulkan driver \
                   (Debian/Ubuntu: `apt-get install mesa-vulkan-drivers libvulkan1` for lavapipe)";
        let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
        assert!(!ci, "{msg}: CI must run the Vulkan path for real");
        // Straight to stderr, past the test harness's capture, so the skip is seen.
        let _ = writeln!(
            std::io::stderr(),
            "\nSKIPPED compute_shader_runs_on_vulkan: {msg}\n"
        );
        return;
    };
    let info = adapter.get_info();
    assert_eq!(info.backend, wgpu::Backend::Vulkan);
    let _ = writeln!(
        std::io::stderr(),
        "vulkan adapter: {} ({:?}, driver {} {})",
        info.name,
        info.device_type,
        info.driver,
        info.driver_info
    );

    let (device, queue) =
        pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor::default()))
            .expect("a Vulkan adapter that enumerates must open a device");

    const N: u32 = 1000; // not a multiple of the workgroup size: the bounds check is exercised
    let input: Vec<u32> = (0..N).map(|i| i * 7 + 3).collect();
    let bytes = u64::from(N) * 4;
    let input_buf = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some("input"),
        contents: bytemuck::cast_slice(&input),
        usage: wgpu::BufferUsages::STORAGE,
    });
    let output_buf = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("output"),
        size: bytes,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let readback = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("readback"),
        size: bytes,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("square_plus_index"),
        source: wgpu::ShaderSource::Wgsl(SHADER.into()),
    });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("square_plus_index"),
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    });
    let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry {
                binding: 0,
                resource: input_buf.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 1,
                resource: output_buf.as_entire_binding(),
            },
        ],
    });
    let mut encoder = device.create_command_encoder(&Default::default());
    {
        let mut pass = encoder.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind_group, &[]);
        pass.dispatch_workgroups(N.div_ceil(64), 1, 1);
    }
    // This test is about the driver running a shader; the readback copy is the test's own probe.
    encoder.copy_buffer_to_buffer(&output_buf, 0, &readback, 0, bytes);
    queue.submit([encoder.finish()]);

    readback
        .slice(..)
        .map_async(wgpu::MapMode::Read, |r| r.expect("map readback"));
    device
        .poll(wgpu::PollType::wait_indefinitely())
        .expect("device poll");
    let view = readback
        .slice(..)
        .get_mapped_range()
        .expect("readback is mapped");
    let out: Vec<u32> = bytemuck::cast_slice(&view).to_vec();
    for (i, (&got, &x)) in out.iter().zip(&input).enumerate() {
        let want = x.wrapping_mul(x).wrapping_add(i as u32);
        assert_eq!(
            got, want,
            "element {i}: shader wrote {got}, expected {want}"
        );
    }
}
