//! The fused ISP pass as a WGSL compute shader ([`ISP_WGSL`]) and the uniform block that drives
//! it ([`GpuParams`]). The crate stays free of any GPU dependency: a caller with a wgpu (or any
//! WebGPU) device binds the frame's unified buffer (imported as-is, e.g. through uvm-alloc's
//! wgpu import) at binding 0, the output tensor at binding 1 and the parameters at binding 2,
//! and dispatches [`GpuParams::workgroups`]. The shader is the CPU reference in [`crate::isp`],
//! operation for operation; `tests/gpu_isp.rs` holds it to that reference on a real Vulkan
//! driver (lavapipe in CI).

use crate::Error;
use crate::format::{FrameDesc, PixelFormat};
use crate::isp::{Coefficients, Layout, Preprocess, Resize};

/// The WGSL source; entry point `main`, workgroup 8x8.
pub const ISP_WGSL: &str = include_str!("shaders/isp.wgsl");

/// The shader's workgroup size (x, y).
pub const WORKGROUP: (u32, u32) = (8, 8);

/// The shader's `Params` uniform, byte for byte (std140-compatible: 16-byte multiple, vec4s at
/// 16-byte offsets).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct GpuParams {
    pub format: u32,
    pub src_w: u32,
    pub src_h: u32,
    pub luma_stride: u32,
    pub c0: u32,
    pub c1: u32,
    pub c_stride: u32,
    pub is_rgb: u32,
    pub crop_x: u32,
    pub crop_y: u32,
    pub crop_w: u32,
    pub crop_h: u32,
    pub out_w: u32,
    pub out_h: u32,
    pub resize: u32,
    pub layout: u32,
    pub y_offset: f32,
    pub y_scale: f32,
    pub c_scale: f32,
    pub r_cr: f32,
    pub g_cb: f32,
    pub g_cr: f32,
    pub b_cb: f32,
    pub sx: f32,
    pub sy: f32,
    pub pad: [u32; 3],
    pub scale: [f32; 4],
    pub bias: [f32; 4],
}

const _: () = assert!(size_of::<GpuParams>() == 144);
const _: () = assert!(std::mem::offset_of!(GpuParams, scale) == 112);
const _: () = assert!(std::mem::offset_of!(GpuParams, bias) == 128);

impl GpuParams {
    /// The parameters of `p` over frames shaped `desc`, validated as [`crate::isp::preprocess`]
    /// validates them (crop inside the frame, non-zero output, sizes that fit the shader's u32
    /// byte addressing).
    pub fn new(desc: &FrameDesc, p: &Preprocess) -> Result<GpuParams, Error> {
        let crop = p.checked_crop(desc)?;
        let u = |v: usize, what: &str| {
            u32::try_from(v).map_err(|_| Error::BadFrame {
                what: format!("{what} {v} does not fit the GPU pass's 32-bit addressing"),
            })
        };
        u(desc.byte_len(), "frame bytes")?;
        u(3 * p.width * p.height, "output values")?;
        let planes = desc.planes();
        let plane = |i: usize| planes.get(i).copied();
        let c = Coefficients::new(p.matrix, p.range);
        Ok(GpuParams {
            format: match desc.format {
                PixelFormat::Nv12 => 0,
                PixelFormat::I420 => 1,
                PixelFormat::Yuyv => 2,
                PixelFormat::Yuv422p => 3,
                PixelFormat::Yuv444p => 4,
                PixelFormat::Rgb24 => 5,
            },
            src_w: u(desc.width, "width")?,
            src_h: u(desc.height, "height")?,
            luma_stride: u(planes[0].stride, "stride")?,
            c0: u(plane(1).map_or(0, |p| p.offset), "plane offset")?,
            c1: u(plane(2).map_or(0, |p| p.offset), "plane offset")?,
            c_stride: u(plane(1).map_or(0, |p| p.stride), "stride")?,
            is_rgb: u32::from(desc.format == PixelFormat::Rgb24),
            crop_x: u(crop.x, "crop")?,
            crop_y: u(crop.y, "crop")?,
            crop_w: u(crop.width, "crop")?,
            crop_h: u(crop.height, "crop")?,
            out_w: u(p.width, "output width")?,
            out_h: u(p.height, "output height")?,
            resize: match p.resize {
                Resize::Bilinear => 0,
                Resize::Area => 1,
            },
            layout: match p.layout {
                Layout::Chw => 0,
                Layout::Hwc => 1,
            },
            y_offset: c.y_offset,
            y_scale: c.y_scale,
            c_scale: c.c_scale,
            r_cr: c.r_cr,
            g_cb: c.g_cb,
            g_cr: c.g_cr,
            b_cb: c.b_cb,
            sx: crop.width as f32 / p.width as f32,
            sy: crop.height as f32 / p.height as f32,
            pad: [0; 3],
            scale: [
                1.0 / (255.0 * p.std[0]),
                1.0 / (255.0 * p.std[1]),
                1.0 / (255.0 * p.std[2]),
                0.0,
            ],
            bias: [
                -p.mean[0] / p.std[0],
                -p.mean[1] / p.std[1],
                -p.mean[2] / p.std[2],
                0.0,
            ],
        })
    }

    /// Workgroups to dispatch: `(ceil(out_w / 8), ceil(out_h / 8), 1)`.
    pub fn workgroups(&self) -> (u32, u32, u32) {
        (
            self.out_w.div_ceil(WORKGROUP.0),
            self.out_h.div_ceil(WORKGROUP.1),
            1,
        )
    }

    /// Bytes of the f32 output tensor.
    pub fn output_bytes(&self) -> u64 {
        3 * u64::from(self.out_w) * u64::from(self.out_h) * 4
    }
}
