//! The fused ISP pass as a WGSL compute shader ([`ISP_WGSL`]) and the uniform block that drives
//! it ([`GpuParams`]), writing f32 or packed f16 ([`Elem`]). A caller with any WebGPU device
//! binds the frame's unified buffer (imported as-is, e.g. through uvm-alloc's wgpu import) at
//! binding 0, the output tensor at binding 1 and the parameters at binding 2, and dispatches
//! [`GpuParams::workgroups`]. With feature `wgpu`, `GpuIsp` does that on a wgpu device, its
//! pipeline, uniform and bind groups made once; without it the crate has no GPU dependency. The
//! shader is the CPU reference in [`crate::isp`], operation for operation; `tests/gpu_isp.rs`
//! holds it to that reference on a real Vulkan driver (lavapipe in CI).

use crate::Error;
use crate::format::{FrameDesc, PixelFormat};
use crate::isp::{Axis, Coefficients, Layout, Preprocess, Resize, chroma_crop};

/// The WGSL source; entry point `main`, workgroup 8x8.
pub const ISP_WGSL: &str = include_str!("shaders/isp.wgsl");

/// The shader's workgroup size (x, y).
pub const WORKGROUP: (u32, u32) = (8, 8);

/// The element type the shader writes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Elem {
    /// 32-bit floats, one per value.
    #[default]
    F32,
    /// IEEE half floats, packed two per 32-bit word with `pack2x16float` (no `SHADER_F16`
    /// feature needed): each invocation writes two horizontally adjacent pixels, so the output
    /// width must be even.
    F16,
}

impl Elem {
    /// Bytes per value.
    pub fn size(self) -> u64 {
        match self {
            Elem::F32 => 4,
            Elem::F16 => 2,
        }
    }
}

/// The shader's `Params` uniform, byte for byte (std140-compatible: 16-byte multiple, vec4s at
/// 16-byte offsets).
///
/// The four resize axes are, in order, luma x, luma y, chroma x and chroma y (chroma at the
/// chroma plane's own resolution; equal to luma for 4:4:4 and RGB24). Per axis, `inc` is
/// swscale's 16.16 step, `taps` its window size and `mode` its construction (0 windowed, 1
/// linear, 2 unscaled), the numbers the CPU reference builds its tap lists from.
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
    /// 1 when the output is f16 ([`Elem::F16`]).
    pub out_f16: u32,
    /// The crop in the chroma plane's samples ([`crate::isp`]'s chroma rectangle).
    pub chr_x: u32,
    pub chr_y: u32,
    pub chr_w: u32,
    pub chr_h: u32,
    pub inc: [i32; 4],
    pub taps: [i32; 4],
    pub mode: [u32; 4],
    pub scale: [f32; 4],
    pub bias: [f32; 4],
}

const _: () = assert!(size_of::<GpuParams>() == 192);
const _: () = assert!(size_of::<GpuParams>().is_multiple_of(16));
const _: () = assert!(std::mem::offset_of!(GpuParams, out_f16) == 92);
const _: () = assert!(std::mem::offset_of!(GpuParams, chr_x) == 96);
const _: () = assert!(std::mem::offset_of!(GpuParams, inc) == 112);
const _: () = assert!(std::mem::offset_of!(GpuParams, taps) == 128);
const _: () = assert!(std::mem::offset_of!(GpuParams, mode) == 144);
const _: () = assert!(std::mem::offset_of!(GpuParams, scale) == 160);
const _: () = assert!(std::mem::offset_of!(GpuParams, bias) == 176);

impl GpuParams {
    /// The parameters of `p` over frames shaped `desc` with f32 output; see
    /// [`GpuParams::with_elem`].
    pub fn new(desc: &FrameDesc, p: &Preprocess) -> Result<GpuParams, Error> {
        GpuParams::with_elem(desc, p, Elem::F32)
    }

    /// The parameters of `p` over frames shaped `desc`, writing `elem`, validated as
    /// [`crate::isp::preprocess`] validates them (crop inside the frame, non-zero output) and
    /// for the shader: sizes that fit its u32 byte addressing and its i32 filter positions, and
    /// an even output width for f16.
    pub fn with_elem(desc: &FrameDesc, p: &Preprocess, elem: Elem) -> Result<GpuParams, Error> {
        let crop = p.checked_crop(desc)?;
        if elem == Elem::F16 && !p.width.is_multiple_of(2) {
            return Err(Error::BadFrame {
                what: format!(
                    "f16 output packs two pixels per 32-bit word and needs an even width, got {}",
                    p.width
                ),
            });
        }
        let u = |v: usize, what: &str| {
            u32::try_from(v).map_err(|_| Error::BadFrame {
                what: format!("{what} {v} does not fit the GPU pass's 32-bit addressing"),
            })
        };
        u(desc.byte_len(), "frame bytes")?;
        u(3 * p.width * p.height * 4, "output bytes")?;
        let planes = desc.planes();
        let plane = |i: usize| planes.get(i).copied();
        let c = Coefficients::new(p.matrix, p.range);
        let cc = chroma_crop(desc.format, crop);
        let axes = [
            Axis::new(p.resize, crop.width, p.width),
            Axis::new(p.resize, crop.height, p.height),
            Axis::new(p.resize, cc.width, p.width),
            Axis::new(p.resize, cc.height, p.height),
        ];
        // The shader places windows with i32 arithmetic on `(2 * out + 1) * inc` and the first
        // tap times 2^17.
        let mut inc = [0i32; 4];
        let mut taps = [0i32; 4];
        for (i, (a, dst)) in axes
            .iter()
            .zip([p.width, p.height, p.width, p.height])
            .enumerate()
        {
            let reach = (2 * dst as i64 + 1) * a.inc + 0x20000;
            let src = [crop.width, crop.height, cc.width, cc.height][i] as i64;
            if reach > i64::from(i32::MAX) || (src + 1) * 0x20000 > i64::from(i32::MAX) {
                return Err(Error::BadFrame {
                    what: format!(
                        "resize {src} -> {dst} does not fit the GPU pass's 32-bit filter positions \
                         (at most 16383 source samples per axis)"
                    ),
                });
            }
            inc[i] = a.inc as i32;
            taps[i] = a.size as i32;
        }
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
            out_f16: u32::from(elem == Elem::F16),
            chr_x: u(cc.x, "crop")?,
            chr_y: u(cc.y, "crop")?,
            chr_w: u(cc.width, "crop")?,
            chr_h: u(cc.height, "crop")?,
            inc,
            taps,
            mode: axes.map(|a| a.mode as u32),
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

    /// Workgroups to dispatch: `(ceil(out_w / 8), ceil(out_h / 8), 1)`, or
    /// `(ceil(out_w / 16), ...)` for f16, where each invocation writes two pixels.
    pub fn workgroups(&self) -> (u32, u32, u32) {
        let per_invocation = if self.out_f16 != 0 { 2 } else { 1 };
        (
            (self.out_w / per_invocation).div_ceil(WORKGROUP.0),
            self.out_h.div_ceil(WORKGROUP.1),
            1,
        )
    }

    /// The element type written.
    pub fn elem(&self) -> Elem {
        if self.out_f16 != 0 {
            Elem::F16
        } else {
            Elem::F32
        }
    }

    /// Bytes of the output tensor (`3 * out_w * out_h` values of [`GpuParams::elem`]).
    pub fn output_bytes(&self) -> u64 {
        3 * u64::from(self.out_w) * u64::from(self.out_h) * self.elem().size()
    }
}

/// The pass on a wgpu device (feature `wgpu`): its pipeline, its uniform block and its bind
/// groups, made once and reused, so recording a frame costs one dispatch.
///
/// Buffers come in as `wgpu::Buffer`s: the caller imports the frame's unified buffer and the
/// output tensor (through one [`uvm_alloc::vulkan::ImportCache`] per device, so a pooled
/// buffer is imported once and every stage on the device sees the same import). The chain, the
/// benches and the tests all run the pass through this type.
#[cfg(feature = "wgpu")]
pub struct GpuIsp {
    device: wgpu::Device,
    pipeline: wgpu::ComputePipeline,
    params: Preprocess,
    elem: Elem,
    /// The uniform block for the frame shape it was made for.
    uniform: Option<(FrameDesc, GpuParams, wgpu::Buffer)>,
    /// Bind groups by (frame, output) buffer and output offset, newest last; cleared when the
    /// uniform changes.
    binds: std::collections::VecDeque<(wgpu::Buffer, wgpu::Buffer, u64, wgpu::BindGroup)>,
}

/// Bind groups a [`GpuIsp`] keeps: enough for every pairing of a frame pool with a ring.
#[cfg(feature = "wgpu")]
const BIND_GROUPS_KEPT: usize = 64;

#[cfg(feature = "wgpu")]
impl std::fmt::Debug for GpuIsp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuIsp")
            .field("params", &self.params)
            .field("elem", &self.elem)
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "wgpu")]
impl GpuIsp {
    /// The pass for `params`, writing `elem`, compiled on `device`.
    pub fn new(device: &wgpu::Device, params: Preprocess, elem: Elem) -> GpuIsp {
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("isp"),
            source: wgpu::ShaderSource::Wgsl(ISP_WGSL.into()),
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("isp"),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
        GpuIsp {
            device: device.clone(),
            pipeline,
            params,
            elem,
            uniform: None,
            binds: std::collections::VecDeque::new(),
        }
    }

    /// The same pass with other parameters (another crop of the frame, say, one per tile of
    /// [`crate::isp::TileGrid`]), sharing this one's compiled pipeline.
    pub fn with_params(&self, params: Preprocess) -> GpuIsp {
        GpuIsp {
            device: self.device.clone(),
            pipeline: self.pipeline.clone(),
            params,
            elem: self.elem,
            uniform: None,
            binds: std::collections::VecDeque::new(),
        }
    }

    /// The preprocessing it runs.
    pub fn params(&self) -> &Preprocess {
        &self.params
    }

    /// Bytes of the tensor it writes (`3 x height x width` of its element type).
    pub fn output_bytes(&self) -> usize {
        3 * self.params.width * self.params.height * self.elem.size() as usize
    }

    /// Records the pass over a frame shaped `desc` in `input`, writing `output`, into
    /// `encoder`. The caller submits it (with [`uvm_alloc::vulkan::host_read_barrier`] when
    /// the CPU reads the output).
    ///
    /// # Errors
    /// [`Error::BadFrame`] when `desc` and the parameters do not fit the pass, or a buffer is
    /// smaller than the frame or the tensor.
    pub fn record(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        desc: &FrameDesc,
        input: &wgpu::Buffer,
        output: &wgpu::Buffer,
    ) -> Result<(), Error> {
        self.record_at(encoder, desc, input, output, 0)
    }

    /// [`GpuIsp::record`], writing the tensor at byte `offset` of `output` (one image of a
    /// batch the encoder takes at once, say).
    ///
    /// # Errors
    /// As [`GpuIsp::record`], and [`Error::BadFrame`] when `offset` is not a multiple of the
    /// device's storage-buffer offset alignment or the tensor does not fit after it.
    pub fn record_at(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        desc: &FrameDesc,
        input: &wgpu::Buffer,
        output: &wgpu::Buffer,
        offset: u64,
    ) -> Result<(), Error> {
        use wgpu::util::DeviceExt;
        let short = |what: &str, have: u64, need: u64| Error::BadFrame {
            what: format!("the {what} buffer holds {have} bytes; the pass needs {need}"),
        };
        if input.size() < desc.byte_len() as u64 {
            return Err(short("frame", input.size(), desc.byte_len() as u64));
        }
        let bytes = self.output_bytes() as u64;
        let need = offset.saturating_add(bytes);
        if output.size() < need {
            return Err(short("output", output.size(), need));
        }
        let align = u64::from(self.device.limits().min_storage_buffer_offset_alignment);
        if !offset.is_multiple_of(align) {
            return Err(Error::BadFrame {
                what: format!(
                    "output offset {offset} is not a multiple of the device's storage-buffer \
                     offset alignment ({align} bytes)"
                ),
            });
        }
        if self.uniform.as_ref().is_none_or(|(d, ..)| d != desc) {
            let p = GpuParams::with_elem(desc, &self.params, self.elem)?;
            let buffer = self
                .device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("isp params"),
                    contents: bytemuck::bytes_of(&p),
                    usage: wgpu::BufferUsages::UNIFORM,
                });
            self.uniform = Some((*desc, p, buffer));
            self.binds.clear();
        }
        let Some((_, params, uniform)) = &self.uniform else {
            unreachable!("set above")
        };
        let at = match self
            .binds
            .iter()
            .position(|(i, o, at, _)| i == input && o == output && *at == offset)
        {
            Some(at) => at,
            None => {
                let bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some("isp"),
                    layout: &self.pipeline.get_bind_group_layout(0),
                    entries: &[
                        wgpu::BindGroupEntry {
                            binding: 0,
                            resource: input.as_entire_binding(),
                        },
                        wgpu::BindGroupEntry {
                            binding: 1,
                            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                                buffer: output,
                                offset,
                                size: std::num::NonZeroU64::new(bytes),
                            }),
                        },
                        wgpu::BindGroupEntry {
                            binding: 2,
                            resource: uniform.as_entire_binding(),
                        },
                    ],
                });
                if self.binds.len() == BIND_GROUPS_KEPT {
                    self.binds.pop_front();
                }
                self.binds
                    .push_back((input.clone(), output.clone(), offset, bind));
                self.binds.len() - 1
            }
        };
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("isp"),
            timestamp_writes: None,
        });
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.binds[at].3, &[]);
        let (x, y, z) = params.workgroups();
        pass.dispatch_workgroups(x, y, z);
        Ok(())
    }

    /// Records the pass and submits it on `queue` with the barrier that makes its writes
    /// visible to host reads; returns the submission, which the caller waits for (a device
    /// poll or a timeline value) before the CPU reads `output`.
    pub fn submit(
        &mut self,
        queue: &wgpu::Queue,
        desc: &FrameDesc,
        input: &wgpu::Buffer,
        output: &wgpu::Buffer,
    ) -> Result<wgpu::SubmissionIndex, Error> {
        let mut encoder = self.device.create_command_encoder(&Default::default());
        self.record(&mut encoder, desc, input, output)?;
        let barrier = uvm_alloc::vulkan::host_read_barrier(&self.device).map_err(Error::Memory)?;
        Ok(queue.submit([encoder.finish(), barrier]))
    }
}
