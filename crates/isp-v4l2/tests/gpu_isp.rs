//! The WGSL ISP pass on a real Vulkan driver (lavapipe in CI) against the CPU reference, for
//! every input layout, both resizes, both layouts and a crop. The frame is the unified buffer
//! the source wrote, imported into wgpu as-is, and the shader writes the output tensor into
//! another unified buffer the CPU then reads in place: no copy on either side.
//!
//! Without a Vulkan adapter the test fails when `CI=true` and otherwise prints a visible skip.

use std::io::Write;
use std::sync::Arc;

use isp_v4l2::gpu::{Elem, GpuIsp};
use isp_v4l2::isp::{Crop, Layout, Matrix, Preprocess, Range, Resize, preprocess};
use isp_v4l2::{FrameDesc, PixelFormat};
use uvm_alloc::vulkan::{ImportCache, open_wgpu_device};
use uvm_alloc::{Access, Allocator, AllocatorDesc};

/// One 8-bit step after normalisation is 1 / (255 * std) ~ 0.017; float contraction and
/// summation-order differences between the CPU and the shader are ~1e-5. f16 output may also
/// differ by one f16 step of the value (rounding).
const TOLERANCE: f32 = 1e-3;

/// One f16 step relative to the value (10 mantissa bits; an upper bound on the step).
const F16_STEP: f32 = 1.0 / 1024.0;

fn adapter() -> Option<wgpu::Adapter> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::VULKAN,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let adapter = pollster::block_on(instance.request_adapter(&Default::default())).ok();
    if adapter.is_none() {
        let msg = "no Vulkan adapter; install mesa-vulkan-drivers libvulkan1 (lavapipe)";
        let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
        assert!(!ci, "{msg}: CI must run the GPU ISP for real");
        let _ = writeln!(std::io::stderr(), "\nSKIPPED (no Vulkan): {msg}\n");
    }
    adapter
}

#[test]
fn the_wgsl_pass_matches_the_cpu_reference_on_every_layout() {
    let Some(adapter) = adapter() else { return };
    let (device, queue, caps) = open_wgpu_device(&adapter, &Default::default()).unwrap();
    let imports = ImportCache::new(&device, caps, 64);
    // Memory this device imports in place.
    let allocator = Allocator::new(AllocatorDesc {
        backends: caps.importable_backends(),
        ..AllocatorDesc::default()
    })
    .unwrap();
    let mut state = 0x1234_5678u32;
    let mut checked = 0;
    for format in [
        PixelFormat::Nv12,
        PixelFormat::I420,
        PixelFormat::Yuyv,
        PixelFormat::Yuv422p,
        PixelFormat::Yuv444p,
        PixelFormat::Rgb24,
    ] {
        let desc = FrameDesc::new(64, 48, format).unwrap();
        let frame = allocator.allocate(desc.byte_len()).unwrap();
        {
            let mut w = frame.cpu_access(0..frame.len(), Access::Write).unwrap();
            for b in w.bytes_mut().unwrap() {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                *b = (state >> 24) as u8;
            }
        }
        let frame = Arc::new(frame);
        // SAFETY: the frame's write guard is dropped above; the device only reads it, and the
        // CPU reads it below only between passes, each waited for.
        let frame_gpu = unsafe { imports.get(&frame) }.unwrap();
        for (resize, layout, crop, (w, h), matrix, range) in [
            (
                Resize::Bilinear,
                Layout::Chw,
                None,
                (24, 20),
                Matrix::Bt601,
                Range::Limited,
            ),
            (
                Resize::Bilinear,
                Layout::Hwc,
                None,
                (100, 70),
                Matrix::Bt709,
                Range::Full,
            ),
            (
                Resize::Area,
                Layout::Hwc,
                Some(Crop {
                    x: 4,
                    y: 2,
                    width: 50,
                    height: 40,
                }),
                (16, 12),
                Matrix::Bt709,
                Range::Limited,
            ),
            (
                Resize::Area,
                Layout::Chw,
                None,
                (7, 5),
                Matrix::Bt601,
                Range::Full,
            ),
        ] {
            let p = Preprocess {
                matrix,
                range,
                crop,
                width: w,
                height: h,
                resize,
                mean: [0.485, 0.456, 0.406],
                std: [0.229, 0.224, 0.225],
                layout,
            };
            let mut want = vec![0f32; 3 * w * h];
            let mut want16 = vec![half::f16::ZERO; 3 * w * h];
            {
                let r = frame.cpu_access(0..desc.byte_len(), Access::Read).unwrap();
                preprocess(&desc, r.bytes(), &p, &mut want).unwrap();
                preprocess(&desc, r.bytes(), &p, &mut want16).unwrap();
            }
            for elem in [Elem::F32, Elem::F16] {
                let mut isp = GpuIsp::new(&device, p, elem);
                let out = Arc::new(allocator.allocate(isp.output_bytes()).unwrap());
                // SAFETY: the output is read on the CPU only after the device poll that waits
                // for the pass.
                let out_gpu = unsafe { imports.get(&out) }.unwrap();
                match isp.submit(&queue, &desc, &frame_gpu, &out_gpu) {
                    Ok(_) => {}
                    Err(e) => {
                        // f16 packs pixel pairs: an odd width is refused, clearly.
                        assert!(elem == Elem::F16 && w % 2 == 1, "{e}");
                        assert!(e.to_string().contains("even width"), "{e}");
                        continue;
                    }
                }
                device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
                let r = out.cpu_access(0..isp.output_bytes(), Access::Read).unwrap();
                let worst = match elem {
                    Elem::F32 => {
                        let got = r.typed::<f32>().unwrap();
                        got.iter()
                            .zip(&want)
                            .map(|(a, b)| (a - b).abs())
                            .fold(0f32, f32::max)
                    }
                    Elem::F16 => {
                        let got = r.typed::<u16>().unwrap();
                        // Beyond one f16 step of the value: the shader's `pack2x16float` may
                        // round differently from `half` (nearest even).
                        got.iter()
                            .zip(&want16)
                            .map(|(a, b)| {
                                let (a, b) = (half::f16::from_bits(*a).to_f32(), b.to_f32());
                                (a - b).abs() - b.abs() * F16_STEP
                            })
                            .fold(0f32, f32::max)
                    }
                };
                assert!(
                    worst < TOLERANCE,
                    "{format:?} {resize:?} {layout:?} {crop:?} {w}x{h} {elem:?}: max difference {worst}"
                );
                checked += 1;
            }
        }
    }
    // 24 f32 combinations and the 18 of them with an even width in f16.
    assert_eq!(checked, 42);
}

/// SmolVLM's tiles of a frame ([`isp_v4l2::isp::TileGrid`]), each written by its own pass at its
/// image's offset of one output buffer in one command buffer, are each the CPU reference of
/// their crop; a misaligned offset is refused by name.
#[test]
fn tiles_written_at_their_offsets_match_the_cpu_reference() {
    use isp_v4l2::isp::TileGrid;
    let Some(adapter) = adapter() else { return };
    let (device, queue, caps) = open_wgpu_device(&adapter, &Default::default()).unwrap();
    let imports = ImportCache::new(&device, caps, 64);
    let allocator = Allocator::new(AllocatorDesc {
        backends: caps.importable_backends(),
        ..AllocatorDesc::default()
    })
    .unwrap();
    let desc = FrameDesc::new(96, 54, PixelFormat::Nv12).unwrap();
    let frame = allocator.allocate(desc.byte_len()).unwrap();
    {
        let mut w = frame.cpu_access(0..frame.len(), Access::Write).unwrap();
        for (i, b) in w.bytes_mut().unwrap().iter_mut().enumerate() {
            *b = (i * 7 % 251) as u8;
        }
    }
    let frame = Arc::new(frame);
    // SAFETY: written above (guard dropped); the device only reads it.
    let frame_gpu = unsafe { imports.get(&frame) }.unwrap();
    // 96x54 at longest edge 4 x 32: 4 columns, 3 rows, then the global view.
    let grid = TileGrid::idefics3(desc.width, desc.height, 128, 32).unwrap();
    assert_eq!(grid, TileGrid { rows: 3, cols: 4 });
    let whole = Crop {
        x: 0,
        y: 0,
        width: desc.width,
        height: desc.height,
    };
    let base = Preprocess {
        width: 32,
        height: 32,
        resize: Resize::Bilinear,
        ..Preprocess::default()
    };
    let first = GpuIsp::new(&device, base, Elem::F32);
    let mut passes: Vec<GpuIsp> = grid
        .crops(whole)
        .into_iter()
        .map(|c| {
            first.with_params(Preprocess {
                crop: Some(c),
                ..base
            })
        })
        .collect();
    let image = first.output_bytes() as u64;
    let out = Arc::new(allocator.allocate(image as usize * grid.images()).unwrap());
    // SAFETY: read on the CPU only after the device poll that waits for the passes.
    let out_gpu = unsafe { imports.get(&out) }.unwrap();
    let mut encoder = device.create_command_encoder(&Default::default());
    for (i, pass) in passes.iter_mut().enumerate() {
        pass.record_at(&mut encoder, &desc, &frame_gpu, &out_gpu, i as u64 * image)
            .unwrap();
    }
    let err = passes[0]
        .record_at(&mut encoder, &desc, &frame_gpu, &out_gpu, 4)
        .unwrap_err();
    assert!(err.to_string().contains("alignment"), "{err}");
    let past = passes[0]
        .record_at(
            &mut encoder,
            &desc,
            &frame_gpu,
            &out_gpu,
            image * grid.images() as u64,
        )
        .unwrap_err();
    assert!(past.to_string().contains("output buffer"), "{past}");
    queue.submit([
        encoder.finish(),
        uvm_alloc::vulkan::host_read_barrier(&device).unwrap(),
    ]);
    device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
    let r = out.cpu_access(0..out.len(), Access::Read).unwrap();
    let got = r.typed::<f32>().unwrap();
    let f = frame.cpu_access(0..desc.byte_len(), Access::Read).unwrap();
    let per = image as usize / 4;
    for (i, pass) in passes.iter().enumerate() {
        let mut want = vec![0f32; per];
        preprocess(&desc, f.bytes(), pass.params(), &mut want).unwrap();
        let worst = got[i * per..(i + 1) * per]
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < TOLERANCE, "image {i}: max difference {worst}");
    }
}
