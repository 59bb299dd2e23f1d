//! The SigLIP tower and SmolVLM connector on a GPU through wgpu (WGSL kernels in
//! `shaders/vit.wgsl`): one command encoder per image, no CPU round trip between layers.
//!
//! The weights are uploaded once; every dispatch's bind group and parameters are built at load
//! time, so [`GpuVisionEncoder::record`] only records dispatches. The image comes in as a
//! storage buffer (the ISP's output, imported from its unified buffer as-is where memory is
//! unified) and the connector's output goes to another storage buffer the caller provides.
//!
//! This is the f32 path: a 64x64-tiled GEMM with 4x4 register blocks and fused bias / GELU /
//! residual epilogues, a row-per-workgroup LayerNorm, and FlashAttention-style tiled attention
//! (16 queries per workgroup, keys streamed 16 at a time, online softmax; heads up to 64 wide,
//! wider heads take a one-query-per-invocation kernel). f16, MX weights and the
//! cooperative-matrix path come with issue #8's performance work.

use wgpu::util::DeviceExt;

use crate::vision::{VisionConfig, VisionEncoder};

const SHADER: &str = include_str!("shaders/vit.wgsl");

/// Why the GPU encoder could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuVisionError {
    #[error("the GPU encoder supports head_dim <= 128, this tower has {0}")]
    HeadDim(usize),
    #[error("{what} is {bytes} bytes, past the device's storage-binding limit of {limit}")]
    TooLarge {
        what: &'static str,
        bytes: u64,
        limit: u64,
    },
    #[error("{0}")]
    Unsupported(&'static str),
}

/// A weight matrix on the device: f32, and f16 when the coop GEMM runs.
type Weight = (wgpu::Buffer, Option<wgpu::Buffer>);

struct Dispatch {
    pipeline: usize,
    bind: wgpu::BindGroup,
    groups: (u32, u32, u32),
}

/// The tower and connector on one wgpu device.
pub struct GpuVisionEncoder {
    config: VisionConfig,
    pipelines: Vec<wgpu::ComputePipeline>,
    options: GpuVisionOptions,
    /// Dispatches that do not depend on the input and output buffers.
    body: Vec<Dispatch>,
    /// Buffers the input-dependent dispatches bind.
    patches: wgpu::Buffer,
    vision_out: wgpu::Buffer,
    shuffled: wgpu::Buffer,
    projection: wgpu::Buffer,
    im2col_params: wgpu::Buffer,
    projection_params: wgpu::Buffer,
    shuffle_bind: wgpu::BindGroup,
    /// Bound in the bias slot of GEMMs without a bias; their flag leaves it unread.
    no_bias: wgpu::Buffer,
    /// The connector's projection on tensor cores, when the coop path runs and its sizes fit.
    coop_projection: Option<CoopProjection>,
}

/// What the connector's projection needs on the coop path: its f16 weight, the f16 input
/// scratch and the conversion's length.
struct CoopProjection {
    w16: wgpu::Buffer,
    x16: wgpu::Buffer,
    len: wgpu::Buffer,
}

impl std::fmt::Debug for GpuVisionEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuVisionEncoder")
            .field("config", &self.config)
            .field("dispatches", &(self.body.len() + 3))
            .finish_non_exhaustive()
    }
}

const LINEAR: usize = 0;
const LAYER_NORM: usize = 1;
const ATTENTION: usize = 2;
const IM2COL: usize = 3;
const ADD: usize = 4;
const SHUFFLE: usize = 5;
const ATTENTION_TILED: usize = 6;
const LINEAR_SMALL: usize = 7;
const LINEAR_REG: usize = 8;
// Present only when the device runs the cooperative-matrix module (`GemmKernel::Coop`).
const TO_F16: usize = 9;
const LINEAR_COOP: usize = 10;
/// A `linear` flag on the Rust side only: the input is the previous GEMM's, so its f16 copy
/// (coop path) is already in place.
const SAME_INPUT: u32 = 1 << 8;
const ATTENTION_COOP: usize = 11;

/// Entry point of each pipeline index, for profiles.
const KERNEL_NAMES: [&str; 12] = [
    "linear",
    "layer_norm",
    "attention",
    "im2col",
    "add",
    "pixel_shuffle",
    "attention_tiled",
    "linear_small",
    "linear_reg",
    "to_f16",
    "linear_coop",
    "attention_coop",
];

/// The tensor-core kernels (vit_coop.wgsl).
const COOP_SHADER: &str = include_str!("shaders/vit_coop.wgsl");

/// Which GEMM kernel the linear layers use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GemmKernel {
    /// 16x16 tile per workgroup, one output per thread.
    #[default]
    Small,
    /// 64x64 tile per workgroup, a 4x4 register block per thread. Measured 2.7x slower than
    /// `Small` on an H200 through Vulkan (its per-thread block spills); kept as the starting
    /// point of the register-blocked kernel issue #8's performance work needs.
    Blocked,
    /// 32x32 tile per workgroup of 8x8, a 4x4 register block per thread read straight from
    /// the buffers as vec4s: no workgroup memory, no barriers (k must be a multiple of 4, else
    /// `Small` runs). The fastest on lavapipe, where a barrier costs a context switch.
    Register,
    /// Cooperative matrices (tensor cores): f16 inputs, f32 accumulation, 16x16x16 tiles, a
    /// 32x32 block per subgroup. Needs a device opened with [`coop_features`]; GEMMs whose
    /// sizes are not multiples of 32 (m, n) and 16 (k) run `Small`. Attention then also runs
    /// on tensor cores (FlashAttention-style, `attention_coop`) when the patch count is a
    /// multiple of 64 and head_dim a multiple of 16 up to 64.
    Coop,
}

/// The device features the cooperative-matrix GEMM needs, if `adapter` offers them (and a
/// 16x16x16 f16 x f16 -> f32 configuration): request them when opening the device, with
/// experimental features enabled.
pub fn coop_features(adapter: &wgpu::Adapter) -> Option<wgpu::Features> {
    let wanted = wgpu::Features::SHADER_F16 | wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
    let shape = adapter.cooperative_matrix_properties().iter().any(|p| {
        (p.m_size, p.n_size, p.k_size) == (16, 16, 16)
            && p.ab_type == wgpu::CooperativeScalarType::F16
            && p.cr_type == wgpu::CooperativeScalarType::F32
    });
    (adapter.features().contains(wanted) && shape).then_some(wanted)
}

impl GemmKernel {
    /// The pipeline and output tile for a GEMM with inner dimension `k`.
    fn pipeline_for(self, k: usize) -> (usize, u32) {
        match self {
            GemmKernel::Small => (LINEAR_SMALL, 16),
            GemmKernel::Blocked => (LINEAR, 64),
            GemmKernel::Register if k.is_multiple_of(4) => (LINEAR_REG, 32),
            GemmKernel::Register | GemmKernel::Coop => (LINEAR_SMALL, 16),
        }
    }
}

/// Which attention kernel the tower uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionKernel {
    /// One invocation per query and head, keys streamed from memory.
    PerQuery,
    /// 16 queries per workgroup, key/value tiles in workgroup memory (head_dim <= 64; wider
    /// heads fall back to `PerQuery`). Twice as fast on an H200 (README).
    #[default]
    Tiled,
}

/// Kernel choices (the measured defaults are the fastest on the GPUs tried; see the README).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuVisionOptions {
    pub gemm: GemmKernel,
    pub attention: AttentionKernel,
}

/// The device descriptor for the vision encoder on `adapter`: the adapter's own limits, plus
/// the cooperative-matrix features ([`coop_features`]) when it offers them; and the kernels
/// measured fastest there ([`GpuVisionOptions::for_adapter`], `Coop` GEMMs with the features).
pub fn device_descriptor(
    adapter: &wgpu::Adapter,
) -> (wgpu::DeviceDescriptor<'static>, GpuVisionOptions) {
    let mut options = GpuVisionOptions::for_adapter(&adapter.get_info());
    let mut desc = wgpu::DeviceDescriptor {
        label: Some("vision encoder"),
        required_limits: adapter.limits(),
        ..Default::default()
    };
    if let Some(features) = coop_features(adapter) {
        desc.required_features |= features;
        // SAFETY: the token only acknowledges that wgpu's experimental features may have bugs.
        // The one experimental feature requested, cooperative matrices, is used by one kernel
        // (vit_coop.wgsl), which tests hold to the CPU reference on the devices that offer it.
        desc.experimental_features = unsafe { wgpu::ExperimentalFeatures::enabled() };
        options.gemm = GemmKernel::Coop;
    }
    (desc, options)
}

impl GpuVisionOptions {
    /// The measured fastest kernels for an adapter: on a CPU-hosted driver (lavapipe), the
    /// barrier-free register GEMM and per-query attention (235 ms against 900 ms for the
    /// defaults on the synthetic tower, README); on a GPU, the defaults (measured on an H200).
    pub fn for_adapter(info: &wgpu::AdapterInfo) -> GpuVisionOptions {
        if info.device_type == wgpu::DeviceType::Cpu {
            GpuVisionOptions {
                gemm: GemmKernel::Register,
                attention: AttentionKernel::PerQuery,
            }
        } else {
            GpuVisionOptions::default()
        }
    }
}

/// A bind group of `pipeline`'s group 0 with `buffers` at bindings 0, 1, 2, ...
fn bind_buffers(
    device: &wgpu::Device,
    pipeline: &wgpu::ComputePipeline,
    buffers: &[&wgpu::Buffer],
) -> wgpu::BindGroup {
    let entries: Vec<wgpu::BindGroupEntry<'_>> = buffers
        .iter()
        .enumerate()
        .map(|(i, b)| wgpu::BindGroupEntry {
            binding: i as u32,
            resource: b.as_entire_binding(),
        })
        .collect();
    device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &entries,
    })
}

fn groups_1d(len: u32) -> (u32, u32, u32) {
    let g = len.div_ceil(64);
    if g <= 65535 {
        (g, 1, 1)
    } else {
        (65535, g.div_ceil(65535), 1)
    }
}

impl GpuVisionEncoder {
    /// Uploads `cpu`'s weights to `device` and prepares every dispatch.
    pub fn new(
        device: &wgpu::Device,
        cpu: &VisionEncoder,
    ) -> Result<GpuVisionEncoder, GpuVisionError> {
        GpuVisionEncoder::with_options(device, cpu, GpuVisionOptions::default())
    }

    /// [`GpuVisionEncoder::new`] with explicit kernel choices.
    pub fn with_options(
        device: &wgpu::Device,
        cpu: &VisionEncoder,
        options: GpuVisionOptions,
    ) -> Result<GpuVisionEncoder, GpuVisionError> {
        let c = cpu.config.clone();
        let h = c.hidden;
        let hd = h / c.heads;
        if hd > 128 {
            return Err(GpuVisionError::HeadDim(hd));
        }
        let limit = device.limits().max_storage_buffer_binding_size;
        let side = c.patches_per_side();
        let n = side * side;
        let check = |what: &'static str, elems: usize| {
            let bytes = elems as u64 * 4;
            if bytes > limit {
                Err(GpuVisionError::TooLarge { what, bytes, limit })
            } else {
                Ok(())
            }
        };
        check(
            "an activation buffer",
            n * c.intermediate.max(3 * c.patch_size * c.patch_size),
        )?;
        check("the connector input", n * h)?;
        let coop = options.gemm == GemmKernel::Coop;
        if coop
            && !device.features().contains(
                wgpu::Features::SHADER_F16 | wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
            )
        {
            return Err(GpuVisionError::Unsupported(
                "the cooperative-matrix GEMM needs a device opened with SHADER_F16 and \
                 EXPERIMENTAL_COOPERATIVE_MATRIX (see vision_gpu::coop_features)",
            ));
        }
        // Pipeline index = position in KERNEL_NAMES: the f32 module's entry points first, then
        // (coop only) the tensor-core module's.
        let build = |label: &str, source: &str, entries: &[&str]| {
            let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(label),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            });
            entries
                .iter()
                .map(|entry| {
                    device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                        label: Some(entry),
                        layout: None,
                        module: &module,
                        entry_point: Some(entry),
                        compilation_options: Default::default(),
                        cache: None,
                    })
                })
                .collect::<Vec<_>>()
        };
        let mut pipelines = build("vit", SHADER, &KERNEL_NAMES[..TO_F16]);
        if coop {
            pipelines.extend(build("vit coop", COOP_SHADER, &KERNEL_NAMES[TO_F16..]));
        }
        let upload = |label: &str, data: &[f32]| {
            device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents: bytemuck::cast_slice(data),
                usage: wgpu::BufferUsages::STORAGE,
            })
        };
        // COPY_SRC so a caller can read any stage back (`pipeline encode --stage vision`).
        let scratch = |label: &str, elems: usize| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: (elems.max(1) * 4) as u64,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            })
        };
        let uniform = |data: &[u32]| {
            device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: None,
                contents: bytemuck::cast_slice(data),
                usage: wgpu::BufferUsages::UNIFORM,
            })
        };
        let bind = |pipeline: usize, buffers: &[&wgpu::Buffer]| {
            bind_buffers(device, &pipelines[pipeline], buffers)
        };
        let no_bias = upload("no bias", &[0.0]);
        let pp = 3 * c.patch_size * c.patch_size;
        let patches = scratch("patches", n * pp);
        let x = scratch("x", n * h);
        let xn = scratch("x normed", n * h);
        let (q, k, v, a) = (
            scratch("q", n * h),
            scratch("k", n * h),
            scratch("v", n * h),
            scratch("attention", n * h),
        );
        let mid = scratch("mlp", n * c.intermediate);
        let vision_out = scratch("vision out", n * h);
        let f2 = c.scale_factor * c.scale_factor;
        let tokens = c.image_tokens();
        let shuffled = scratch("shuffled", tokens * h * f2);
        let mut body = Vec::new();
        // The f16 copy of a GEMM's input (coop only): as large as the largest GEMM input.
        let x16 = coop.then(|| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("gemm input f16"),
                size: ((n * c.intermediate.max(pp).max(h)).max(1) * 2).next_multiple_of(4) as u64,
                usage: wgpu::BufferUsages::STORAGE,
                mapped_at_creation: false,
            })
        });
        // A weight matrix: f32 for the f32 kernels, plus f16 for the coop kernel.
        let weight = |label: &str, m: &npu_hal::DenseMatrix| -> Weight {
            let w16 = coop.then(|| {
                let bits: Vec<u16> = m
                    .data()
                    .iter()
                    .map(|&v| half::f16::from_f32(v).to_bits())
                    .collect();
                device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some(label),
                    contents: bytemuck::cast_slice(&bits),
                    usage: wgpu::BufferUsages::STORAGE,
                })
            });
            (upload(label, m.data()), w16)
        };
        // Patch projection and positions (the im2col that feeds it is recorded per image).
        let linear = |body: &mut Vec<Dispatch>,
                      x: &wgpu::Buffer,
                      (w, w16): &Weight,
                      b: Option<&wgpu::Buffer>,
                      y: &wgpu::Buffer,
                      (m, nn, kk): (usize, usize, usize),
                      flags: u32| {
            let reuse = flags & SAME_INPUT != 0;
            let flags = (flags & !SAME_INPUT) | u32::from(b.is_some());
            let params = uniform(&[m as u32, nn as u32, kk as u32, flags]);
            if let (Some(w16), Some(x16)) = (w16, &x16)
                && m.is_multiple_of(32)
                && nn.is_multiple_of(32)
                && kk.is_multiple_of(16)
            {
                if !reuse {
                    let len = uniform(&[(m * kk) as u32, 0, 0, 0]);
                    body.push(Dispatch {
                        pipeline: TO_F16,
                        bind: bind(TO_F16, &[x, x16, &len]),
                        groups: groups_1d((m * kk) as u32),
                    });
                }
                body.push(Dispatch {
                    pipeline: LINEAR_COOP,
                    bind: bind(LINEAR_COOP, &[x16, w16, b.unwrap_or(&no_bias), y, &params]),
                    groups: ((nn / 32) as u32, (m / 32) as u32, 1),
                });
                return;
            }
            let (pipeline, tile) = options.gemm.pipeline_for(kk);
            body.push(Dispatch {
                pipeline,
                bind: bind(pipeline, &[x, w, b.unwrap_or(&no_bias), y, &params]),
                groups: ((nn as u32).div_ceil(tile), (m as u32).div_ceil(tile), 1),
            });
        };
        let w_patch = weight("patch w", &cpu.patch.0);
        let b_patch = upload("patch b", &cpu.patch.1);
        linear(
            &mut body,
            &patches,
            &w_patch,
            Some(&b_patch),
            &x,
            (n, h, pp),
            0,
        );
        let positions = upload("positions", &cpu.positions);
        let add_params = uniform(&[(n * h) as u32, 0, 0, 0]);
        body.push(Dispatch {
            pipeline: ADD,
            bind: bind(ADD, &[&positions, &x, &add_params]),
            groups: groups_1d((n * h) as u32),
        });
        let eps = c.layer_norm_eps.to_bits();
        let norm = |body: &mut Vec<Dispatch>,
                    src: &wgpu::Buffer,
                    (w, b): (&wgpu::Buffer, &wgpu::Buffer),
                    dst: &wgpu::Buffer| {
            let params = uniform(&[n as u32, h as u32, eps, 0]);
            body.push(Dispatch {
                pipeline: LAYER_NORM,
                bind: bind(LAYER_NORM, &[src, w, b, dst, &params]),
                groups: (n as u32, 1, 1),
            });
        };
        let attn_params = uniform(&[
            n as u32,
            c.heads as u32,
            hd as u32,
            h as u32,
            (1.0 / (hd as f32).sqrt()).to_bits(),
            0,
            0,
            0,
        ]);
        // Tensor-core attention takes f16 copies of q, k and v.
        let coop_attention = coop && n.is_multiple_of(64) && hd.is_multiple_of(16) && hd <= 64;
        let qkv16 = coop_attention.then(|| {
            let half = |label: &str| {
                device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some(label),
                    size: ((n * h).max(2) * 2).next_multiple_of(4) as u64,
                    usage: wgpu::BufferUsages::STORAGE,
                    mapped_at_creation: false,
                })
            };
            (half("q f16"), half("k f16"), half("v f16"))
        });
        let half_len = uniform(&[(n * h) as u32, 0, 0, 0]);
        for (i, l) in cpu.layers.iter().enumerate() {
            let up = |name: &str, d: &[f32]| upload(&format!("layer {i} {name}"), d);
            let (ln1w, ln1b) = (up("ln1 w", &l.ln1.0), up("ln1 b", &l.ln1.1));
            let (ln2w, ln2b) = (up("ln2 w", &l.ln2.0), up("ln2 b", &l.ln2.1));
            let lin = |name: &str, (w, b): &(npu_hal::DenseMatrix, Vec<f32>)| {
                (weight(&format!("layer {i} {name}"), w), up(name, b))
            };
            let (qw, qb) = lin("q", &l.q);
            let (kw, kb) = lin("k", &l.k);
            let (vw, vb) = lin("v", &l.v);
            let (ow, ob) = lin("o", &l.o);
            let (f1w, f1b) = lin("fc1", &l.fc1);
            let (f2w, f2b) = lin("fc2", &l.fc2);
            norm(&mut body, &x, (&ln1w, &ln1b), &xn);
            linear(&mut body, &xn, &qw, Some(&qb), &q, (n, h, h), 0);
            // K and V read the same input as Q: its f16 copy is already made.
            linear(&mut body, &xn, &kw, Some(&kb), &k, (n, h, h), SAME_INPUT);
            linear(&mut body, &xn, &vw, Some(&vb), &v, (n, h, h), SAME_INPUT);
            if let Some((q16, k16, v16)) = &qkv16 {
                for (src, dst) in [(&q, q16), (&k, k16), (&v, v16)] {
                    body.push(Dispatch {
                        pipeline: TO_F16,
                        bind: bind(TO_F16, &[src, dst, &half_len]),
                        groups: groups_1d((n * h) as u32),
                    });
                }
                body.push(Dispatch {
                    pipeline: ATTENTION_COOP,
                    bind: bind(ATTENTION_COOP, &[q16, k16, v16, &a, &attn_params]),
                    groups: ((n / 16) as u32, c.heads as u32, 1),
                });
            } else {
                // The tiled kernel keeps 16 x head_dim of Q, K and V in workgroup memory: up to 64.
                body.push(if hd <= 64 && options.attention == AttentionKernel::Tiled {
                    Dispatch {
                        pipeline: ATTENTION_TILED,
                        bind: bind(ATTENTION_TILED, &[&q, &k, &v, &a, &attn_params]),
                        groups: ((n as u32).div_ceil(16), c.heads as u32, 1),
                    }
                } else {
                    Dispatch {
                        pipeline: ATTENTION,
                        bind: bind(ATTENTION, &[&q, &k, &v, &a, &attn_params]),
                        groups: ((n as u32).div_ceil(64), c.heads as u32, 1),
                    }
                });
            }
            linear(&mut body, &a, &ow, Some(&ob), &x, (n, h, h), 4);
            norm(&mut body, &x, (&ln2w, &ln2b), &xn);
            linear(
                &mut body,
                &xn,
                &f1w,
                Some(&f1b),
                &mid,
                (n, c.intermediate, h),
                2,
            );
            linear(
                &mut body,
                &mid,
                &f2w,
                Some(&f2b),
                &x,
                (n, h, c.intermediate),
                4,
            );
        }
        let (pw, pb) = (
            upload("post ln w", &cpu.post_ln.0),
            upload("post ln b", &cpu.post_ln.1),
        );
        norm(&mut body, &x, (&pw, &pb), &vision_out);
        let shuffle_params = uniform(&[side as u32, h as u32, c.scale_factor as u32, 0]);
        let shuffle_bind = bind(SHUFFLE, &[&vision_out, &shuffled, &shuffle_params]);
        let (projection, projection16) = weight("projection", &cpu.projection);
        let coop_projection = projection16.filter(|_| {
            tokens.is_multiple_of(32)
                && c.text_hidden.is_multiple_of(32)
                && (h * f2).is_multiple_of(16)
                && tokens * h * f2 <= n * c.intermediate.max(pp).max(h)
        });
        let shuffled_len = uniform(&[(tokens * h * f2) as u32, 0, 0, 0]);
        let projection_params = uniform(&[tokens as u32, c.text_hidden as u32, (h * f2) as u32, 0]);
        let im2col_params = uniform(&[side as u32, c.patch_size as u32, c.image_size as u32, 0]);
        Ok(GpuVisionEncoder {
            config: c,
            pipelines,
            options,
            body,
            patches,
            vision_out,
            shuffled,
            projection,
            coop_projection: coop_projection.zip(x16).map(|(w16, x16)| CoopProjection {
                w16,
                x16,
                len: shuffled_len,
            }),
            im2col_params,
            projection_params,
            shuffle_bind,
            no_bias,
        })
    }

    /// The shape.
    pub fn config(&self) -> &VisionConfig {
        &self.config
    }

    /// Bytes the output buffer needs: `image_tokens x text_hidden` f32.
    pub fn output_bytes(&self) -> u64 {
        (self.config.image_tokens() * self.config.text_hidden * 4) as u64
    }

    /// The tower's last hidden state buffer (`patches x hidden` f32), valid after a recorded
    /// encode has run; for callers (and tests) that want the vision features themselves.
    pub fn vision_output(&self) -> &wgpu::Buffer {
        &self.vision_out
    }

    /// Records one image's encode into `encoder`: `pixels` holds `3 x image_size x image_size`
    /// f32 (CHW, normalised, as the ISP writes it), `out` receives the connector's output.
    pub fn record(
        &self,
        device: &wgpu::Device,
        encoder: &mut wgpu::CommandEncoder,
        pixels: &wgpu::Buffer,
        out: &wgpu::Buffer,
    ) {
        self.record_profiled(device, encoder, pixels, out, None);
    }

    /// The kernel each dispatch of [`GpuVisionEncoder::record`] runs, in order.
    pub fn dispatch_kernels(&self) -> Vec<&'static str> {
        let c = &self.config;
        let (linear, _) = self
            .options
            .gemm
            .pipeline_for(c.hidden * c.scale_factor * c.scale_factor);
        let projection: &[usize] = if self.coop_projection.is_some() {
            &[TO_F16, LINEAR_COOP]
        } else {
            &[linear]
        };
        std::iter::once(IM2COL)
            .chain(self.body.iter().map(|d| d.pipeline))
            .chain(std::iter::once(SHUFFLE))
            .chain(projection.iter().copied())
            .map(|p| KERNEL_NAMES[p])
            .collect()
    }

    /// [`GpuVisionEncoder::record`], writing a timestamp into `timestamps` (a query set of at
    /// least `dispatch_kernels().len() + 1` entries, on a device with
    /// `TIMESTAMP_QUERY_INSIDE_PASSES`) before the first dispatch and after each one: dispatch
    /// `i` ran from timestamp `i` to `i + 1`.
    pub fn record_profiled(
        &self,
        device: &wgpu::Device,
        encoder: &mut wgpu::CommandEncoder,
        pixels: &wgpu::Buffer,
        out: &wgpu::Buffer,
        timestamps: Option<&wgpu::QuerySet>,
    ) {
        let c = &self.config;
        let side = c.patches_per_side();
        let n = side * side;
        let pp = 3 * c.patch_size * c.patch_size;
        let bind = |pipeline: usize, buffers: &[&wgpu::Buffer]| {
            bind_buffers(device, &self.pipelines[pipeline], buffers)
        };
        let im2col = bind(IM2COL, &[pixels, &self.patches, &self.im2col_params]);
        let f2 = c.scale_factor * c.scale_factor;
        let (linear, tile) = self.options.gemm.pipeline_for(c.hidden * f2);
        // The connector's projection: on tensor cores (convert, then multiply) or in f32.
        let project: Vec<(usize, wgpu::BindGroup, (u32, u32, u32))> = match &self.coop_projection {
            Some(cp) => vec![
                (
                    TO_F16,
                    bind(TO_F16, &[&self.shuffled, &cp.x16, &cp.len]),
                    groups_1d((c.image_tokens() * c.hidden * f2) as u32),
                ),
                (
                    LINEAR_COOP,
                    bind(
                        LINEAR_COOP,
                        &[
                            &cp.x16,
                            &cp.w16,
                            &self.no_bias,
                            out,
                            &self.projection_params,
                        ],
                    ),
                    (
                        (c.text_hidden / 32) as u32,
                        (c.image_tokens() / 32) as u32,
                        1,
                    ),
                ),
            ],
            None => vec![(
                linear,
                bind(
                    linear,
                    &[
                        &self.shuffled,
                        &self.projection,
                        &self.no_bias,
                        out,
                        &self.projection_params,
                    ],
                ),
                (
                    (c.text_hidden as u32).div_ceil(tile),
                    (c.image_tokens() as u32).div_ceil(tile),
                    1,
                ),
            )],
        };
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("vision encoder"),
            timestamp_writes: None,
        });
        if let Some(q) = timestamps {
            pass.write_timestamp(q, 0);
        }
        let mut written = 0;
        let mut run = |pipeline: usize, bind: &wgpu::BindGroup, (x, y, z): (u32, u32, u32)| {
            pass.set_pipeline(&self.pipelines[pipeline]);
            pass.set_bind_group(0, bind, &[]);
            pass.dispatch_workgroups(x, y, z);
            if let Some(q) = timestamps {
                written += 1;
                pass.write_timestamp(q, written);
            }
        };
        run(IM2COL, &im2col, groups_1d((n * pp) as u32));
        for d in &self.body {
            run(d.pipeline, &d.bind, d.groups);
        }
        run(
            SHUFFLE,
            &self.shuffle_bind,
            groups_1d((c.image_tokens() * c.hidden * f2) as u32),
        );
        for (pipeline, bind, groups) in &project {
            run(*pipeline, bind, *groups);
        }
    }
}
