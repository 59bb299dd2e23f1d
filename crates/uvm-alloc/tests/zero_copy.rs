//! The zero-copy proof on a real Vulkan driver (lavapipe in CI: one memory type, host-visible
//! and device-local, a unified-memory GPU in software): the CPU writes a unified buffer, a WGSL
//! shader reads and rewrites those very pages through wgpu, and the CPU reads the result from
//! the original mapping. No copy command is recorded and the copy ledger stays at zero.
//!
//! Without a Vulkan adapter the test fails when `CI=true` and otherwise prints a visible skip.
#![cfg(feature = "wgpu")]

use std::io::Write;
use std::sync::Arc;

use ash::vk;
use uvm_alloc::vulkan::{
    ImportPath, host_read_barrier, import_opaque_fd, import_wgpu_buffer, open_wgpu_device,
};
use uvm_alloc::{Access, Allocator, AllocatorDesc, CopyLedger};

const SHADER: &str = r#"
@group(0) @binding(0) var<storage, read_write> data: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = id.x;
    if (i < arrayLength(&data)) {
        data[i] = data[i] * 2u + 1u;
    }
}
"#;

fn adapter() -> Option<wgpu::Adapter> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::VULKAN,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let adapter = pollster::block_on(instance.request_adapter(&Default::default())).ok();
    if adapter.is_none() {
        let msg = "no Vulkan adapter; install mesa-vulkan-drivers libvulkan1 (lavapipe)";
        let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
        assert!(!ci, "{msg}: CI must run the zero-copy path for real");
        let _ = writeln!(std::io::stderr(), "\nSKIPPED (no Vulkan): {msg}\n");
    }
    adapter
}

/// Runs the in-place `data[i] = 2 * data[i] + 1` shader over `n` u32 of `buffer`, then the
/// host-read barrier, and waits.
fn double_plus_one(device: &wgpu::Device, queue: &wgpu::Queue, buffer: &wgpu::Buffer, n: usize) {
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("double plus one"),
        source: wgpu::ShaderSource::Wgsl(SHADER.into()),
    });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: None,
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    });
    let bind = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer,
                offset: 0,
                size: wgpu::BufferSize::new((n * 4) as u64),
            }),
        }],
    });
    let mut encoder = device.create_command_encoder(&Default::default());
    {
        let mut pass = encoder.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind, &[]);
        pass.dispatch_workgroups((n as u32).div_ceil(64), 1, 1);
    }
    // The barrier that makes the shader's writes visible to the host, recorded for real.
    let barrier = host_read_barrier(device).unwrap();
    queue.submit([encoder.finish(), barrier]);
    device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
}

#[test]
fn shader_writes_the_pages_the_cpu_mapped() {
    let Some(adapter) = adapter() else { return };
    let (device, queue, caps) = open_wgpu_device(&adapter, &Default::default()).unwrap();
    let _ = writeln!(
        std::io::stderr(),
        "adapter {:?}, import caps {caps:?}",
        adapter.get_info().name
    );

    // The best backend this device imports in place: a DMA-BUF heap where the driver imports
    // dma-bufs, host memory (imported by address) where it does not.
    let allocator = Allocator::new(AllocatorDesc {
        backends: caps.importable_backends(),
        ..AllocatorDesc::default()
    })
    .unwrap();
    let n = 16 * 1024usize;
    let buffer = allocator.allocate(n * 4).unwrap();
    let _ = writeln!(std::io::stderr(), "allocated from {:?}", buffer.backend());
    let original_ptr = buffer.as_ptr();
    {
        let mut w = buffer.cpu_access(0..n * 4, Access::Write).unwrap();
        for (i, v) in w.typed_mut::<u32>().unwrap().iter_mut().enumerate() {
            *v = i as u32;
        }
    }
    let buffer = Arc::new(buffer);
    // SAFETY: the write guard above is dropped, and the CPU reads again only after the
    // device poll waits for the shader.
    let imported = unsafe {
        import_wgpu_buffer(
            &device,
            &caps,
            Arc::clone(&buffer),
            wgpu::BufferUsages::STORAGE,
            Some("unified"),
        )
    }
    .unwrap();
    let expected_path = if buffer.is_dma_buf() {
        ImportPath::DmaBuf
    } else {
        ImportPath::HostPointer
    };
    assert_eq!(imported.path, expected_path);
    let _ = writeln!(
        std::io::stderr(),
        "import path {:?}, host coherent {}",
        imported.path,
        imported.host_coherent
    );

    double_plus_one(&device, &queue, &imported.buffer, n);

    // The CPU reads the result where it wrote the input: the original mapping.
    assert_eq!(buffer.as_ptr(), original_ptr);
    let r = buffer.cpu_access(0..n * 4, Access::Read).unwrap();
    for (i, &v) in r.typed::<u32>().unwrap().iter().enumerate() {
        assert_eq!(v, 2 * i as u32 + 1, "element {i}");
    }
    drop(r);
    assert_eq!(
        CopyLedger::global().report().total_bytes(),
        0,
        "bytes copied: must be 0"
    );
    let _ = writeln!(std::io::stderr(), "bytes copied: 0");

    // Dropping the wgpu buffer releases the import; the unified buffer is ours alone again.
    drop(imported);
    device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
    assert_eq!(Arc::strong_count(&buffer), 1);
}

#[test]
fn memory_exported_as_an_opaque_fd_is_imported_in_place() {
    let Some(adapter) = adapter() else { return };
    let (device, queue, caps) = open_wgpu_device(&adapter, &Default::default()).unwrap();
    assert!(
        caps.opaque_fd,
        "lavapipe and every desktop driver export opaque fds"
    );
    // SAFETY: the raw handles are only used while `device` is alive, below.
    let (raw, instance, physical) = unsafe {
        let hal = device.as_hal::<wgpu::hal::api::Vulkan>().unwrap();
        (
            hal.raw_device().clone(),
            hal.shared_instance().raw_instance().clone(),
            hal.raw_physical_device(),
        )
    };
    let n = 4096usize;
    let size = (n * 4) as u64;
    // The exporter: memory allocated exportable, filled through its own Vulkan mapping.
    let handle = vk::ExternalMemoryHandleTypeFlags::OPAQUE_FD;
    let mut ext_info = vk::ExternalMemoryBufferCreateInfo::default().handle_types(handle);
    let info = vk::BufferCreateInfo::default()
        .size(size)
        .usage(vk::BufferUsageFlags::STORAGE_BUFFER)
        .push_next(&mut ext_info);
    // SAFETY: valid device and create info.
    let buffer = unsafe { raw.create_buffer(&info, None) }.unwrap();
    // SAFETY: a buffer of this device.
    let reqs = unsafe { raw.get_buffer_memory_requirements(buffer) };
    // SAFETY: a physical device of this instance.
    let props = unsafe { instance.get_physical_device_memory_properties(physical) };
    let type_index = (0..props.memory_type_count)
        .find(|&i| {
            reqs.memory_type_bits & (1 << i) != 0
                && props.memory_types[i as usize].property_flags.contains(
                    vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT,
                )
        })
        .expect("a host-visible coherent memory type");
    let mut export = vk::ExportMemoryAllocateInfo::default().handle_types(handle);
    let alloc = vk::MemoryAllocateInfo::default()
        .allocation_size(reqs.size)
        .memory_type_index(type_index)
        .push_next(&mut export);
    // SAFETY: valid allocate info with an export chain.
    let memory = unsafe { raw.allocate_memory(&alloc, None) }.unwrap();
    // SAFETY: the memory is host visible, unmapped, and the range is inside it.
    let mapped = unsafe { raw.map_memory(memory, 0, size, vk::MemoryMapFlags::empty()) }
        .unwrap()
        .cast::<u32>();
    // SAFETY: `mapped` points at `n` u32 of coherent host-visible memory mapped just above.
    let exporter_view = unsafe { std::slice::from_raw_parts_mut(mapped, n) };
    for (i, v) in exporter_view.iter_mut().enumerate() {
        *v = (i * 5) as u32;
    }
    let fd_ext = ash::khr::external_memory_fd::Device::new(&instance, &raw);
    // SAFETY: exportable memory of this device.
    let fd = unsafe {
        fd_ext.get_memory_fd(
            &vk::MemoryGetFdInfoKHR::default()
                .memory(memory)
                .handle_type(handle),
        )
    }
    .unwrap();
    // SAFETY: vkGetMemoryFdKHR returned a new fd that we own.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };

    let imported = import_opaque_fd(
        &device,
        &caps,
        fd,
        reqs.size,
        wgpu::BufferUsages::STORAGE,
        Some("opaque"),
    )
    .unwrap();
    assert_eq!(imported.path, ImportPath::OpaqueFd);
    double_plus_one(&device, &queue, &imported.buffer, n);
    // The exporter's own mapping sees the shader's writes: one allocation, two handles.
    for (i, &v) in exporter_view.iter().enumerate() {
        assert_eq!(v, 10 * i as u32 + 1, "element {i}");
    }
    drop(imported);
    device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
    // SAFETY: the device is idle; the exporter's objects are no longer used.
    unsafe {
        raw.unmap_memory(memory);
    }
    // SAFETY: as above.
    unsafe { raw.destroy_buffer(buffer, None) };
    // SAFETY: as above; the buffer bound to it is destroyed.
    unsafe { raw.free_memory(memory, None) };
}

/// An import cache imports a buffer once: the same buffer gives the same `wgpu::Buffer` every
/// time, another buffer another one, and past its capacity the oldest import goes.
#[test]
fn an_import_cache_imports_each_buffer_once() {
    use uvm_alloc::vulkan::ImportCache;
    let Some(adapter) = adapter() else { return };
    let (device, _queue, caps) = open_wgpu_device(&adapter, &Default::default()).unwrap();
    let allocator = Allocator::new(AllocatorDesc {
        backends: caps.importable_backends(),
        ..AllocatorDesc::default()
    })
    .unwrap();
    let cache = ImportCache::new(&device, caps, 2);
    let a = Arc::new(allocator.allocate(4096).unwrap());
    let b = Arc::new(allocator.allocate(4096).unwrap());
    let c = Arc::new(allocator.allocate(4096).unwrap());
    // No device work is ever submitted here, so nothing races the CPU on these buffers.
    let import = |buffer: &Arc<uvm_alloc::UnifiedBuffer>| {
        // SAFETY: no device work uses the import (see above).
        unsafe { cache.get(buffer) }.unwrap()
    };
    let (a1, a2, b1) = (import(&a), import(&a), import(&b));
    assert_eq!(a1, a2, "the same buffer is imported once");
    assert_ne!(a1, b1);
    assert_eq!(cache.len(), 2);
    // A third buffer evicts the oldest import; `a` is imported anew afterwards.
    let (_c1, a3) = (import(&c), import(&a));
    assert_eq!(cache.len(), 2);
    assert_ne!(a1, a3, "an evicted buffer is imported again");
}
