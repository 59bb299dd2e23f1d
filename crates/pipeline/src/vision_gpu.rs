//! The SigLIP tower and SmolVLM connector on a GPU through wgpu (WGSL kernels in
//! `shaders/vit.wgsl`): one command encoder per image, no CPU round trip between layers.
//!
//! The weights are uploaded once; every dispatch's bind group and parameters are built at load
//! time, so [`GpuVisionEncoder::record`] only records dispatches. The image comes in as a
//! storage buffer (the ISP's output, imported from its unified buffer as-is where memory is
//! unified) and the connector's output goes to another storage buffer the caller provides.
//!
//! Two kernel families share the recording:
//! - **f32** (`shaders/vit.wgsl`, any Vulkan device): tiled GEMMs with fused bias / GELU /
//!   residual epilogues, a row-per-workgroup LayerNorm, and FlashAttention-style tiled
//!   attention (16 queries per workgroup, online softmax).
//! - **tensor cores** (`shaders/vit_coop.wgsl`, [`GemmKernel::Coop`], devices with cooperative
//!   matrices): f16 weights and activations, f32 accumulation and residual stream. Q, K and V
//!   are one fused GEMM, every GEMM input is written in f16 by the kernel before it (LayerNorm,
//!   attention, the GELU epilogue), so a layer is 7 dispatches. GEMMs stage 64-row blocks
//!   through workgroup memory, double-buffered; attention splits each head's keys over 4
//!   subgroups and merges their softmaxes. That module is compiled without runtime bounds
//!   checks; every dispatch's sizes are checked against its buffers here instead.

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
    #[error("invalid encoder options: {0}")]
    Invalid(String),
    /// A buffer handed to `record` is smaller than the encode reads or writes.
    #[error("the encoder's {what} buffer holds {bytes} bytes, the encode needs {needed}")]
    BufferTooSmall {
        what: &'static str,
        bytes: u64,
        needed: u64,
    },
}

struct Dispatch {
    pipeline: usize,
    bind: wgpu::BindGroup,
    groups: (u32, u32, u32),
}

/// The tower and connector on one wgpu device.
pub struct GpuVisionEncoder {
    config: VisionConfig,
    /// Images per encode ([`GpuVisionEncoder::with_batch`]).
    batch: usize,
    /// Indexed like KERNEL_NAMES; `None` for modules this encoder did not build.
    pipelines: Vec<Option<wgpu::ComputePipeline>>,
    options: GpuVisionOptions,
    /// The tensor-core GEMM's blockings (`Coop` only).
    coop_gemms: CoopGemms,
    /// Dispatches that do not depend on the input and output buffers.
    body: Vec<Dispatch>,
    /// Buffers the input-dependent dispatches bind.
    patches: wgpu::Buffer,
    vision_out: wgpu::Buffer,
    shuffled: wgpu::Buffer,
    projection: Projection,
    im2col_params: wgpu::Buffer,
    projection_params: wgpu::Buffer,
    /// The pixel shuffle of each image of the batch.
    shuffle_binds: Vec<wgpu::BindGroup>,
    /// Bound in the bias slot of GEMMs without a bias; their flag leaves it unread.
    no_bias: wgpu::Buffer,
}

/// The tensor-core GEMM pipelines an encoder built: `GEMM_COOP` with `base` blocks and, unless a
/// blocking was forced, `GEMM_COOP_WIDE` with `wide` blocks for the GEMMs that have enough of
/// them ([`CoopTile::for_shape`]).
#[derive(Clone, Copy, Debug)]
struct CoopGemms {
    base: CoopTile,
    wide: Option<CoopTile>,
}

impl CoopGemms {
    /// The pipeline and blocking of an m x n GEMM.
    fn pick(self, m: usize, n: usize) -> (usize, CoopTile) {
        match self.wide {
            Some(wide) if CoopTile::for_shape(m, n) == wide => (GEMM_COOP_WIDE, wide),
            _ => (GEMM_COOP, self.base),
        }
    }

    /// The workgroup counts of an m x n GEMM with blocking `tile`.
    fn groups(tile: CoopTile, m: usize, n: usize) -> (u32, u32, u32) {
        (
            n.div_ceil(tile.cols as usize) as u32,
            m.div_ceil(tile.rows as usize) as u32,
            1,
        )
    }
}

/// The connector's projection weight, and how it runs.
enum Projection {
    /// An f32 GEMM: the one the options chose, or `linear_reg_mx` over MX weights.
    F32(GpuWeight),
    /// On tensor cores: the weight, the f16 input scratch and the conversion's length.
    Coop {
        w: GpuWeight,
        x16: wgpu::Buffer,
        len: wgpu::Buffer,
    },
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
// The register GEMM (gemm_reg.wgsl) with f32 weights.
const LINEAR_REG: usize = 8;
// Present only when the device runs the cooperative-matrix module (`GemmKernel::Coop`).
const TO_F16: usize = 9;
const GEMM_COOP: usize = 10;
const ATTENTION_COOP: usize = 11;
const LAYER_NORM_F16: usize = 12;
// The register GEMM with MX weights: present only with `mx_weights`.
const LINEAR_REG_MX: usize = 13;
// The register GEMM with f16 weights: present only with `GemmKernel::RegisterF16`.
const LINEAR_REG_F16: usize = 14;
// The tensor-core GEMM with `CoopTile::WIDE` blocks, for GEMMs with enough of them to fill the
// GPU: present with `Coop` unless `coop_tile` forces one blocking for all.
const GEMM_COOP_WIDE: usize = 15;
// The tensor-core attention with its softmax in the accumulator fragments (GLSL,
// shaders/glsl/attention_fragments.comp): present with `CoopAttention::Fragments(_)`.
const ATTENTION_FRAGMENTS: usize = 16;
// The LayerNorm that first adds a k-split residual GEMM's planes into x: present with `Coop`.
const LAYER_NORM_ADD_F16: usize = 17;

/// The most slices [`GpuVisionOptions::coop_split_k`] may ask for.
pub const MAX_SPLIT_K: usize = 16;

/// `gemm_coop` flags (vit_coop.wgsl).
const GEMM_BIAS: u32 = 1;
const GEMM_GELU: u32 = 2;
const GEMM_RESIDUAL: u32 = 4;
const GEMM_F16_OUT: u32 = 8;

/// Entry point of each pipeline index, for profiles.
const KERNEL_NAMES: [&str; 18] = [
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
    "gemm_coop",
    "attention_coop",
    "layer_norm_f16",
    "linear_reg_mx",
    "linear_reg_f16",
    "gemm_coop_wide",
    "attention_fragments",
    "layer_norm_add_f16",
];

/// The register GEMM, one module per weight format ([`register_gemm_source`]).
const REG_SHADER: &str = include_str!("shaders/gemm_reg.wgsl");

/// What a marked `// <w-source>` ... `// </w-source>` block of a GEMM shader is replaced with
/// for MX weights: the codes at binding 1, the scales at 5 (mx-quant's `mx_codes`/`mx_scales`).
const MX_BINDINGS: &str = "@group(0) @binding(1) var<storage, read> mx_codes: array<u32>;\n\
                           @group(0) @binding(5) var<storage, read> mx_scales: array<u32>;\n";

/// `source` with its `// <w-source>` block (the weight binding and how the kernel reads it)
/// replaced by `block`.
fn swap_weight_source(source: &str, block: &str) -> String {
    let start = source
        .find("// <w-source>")
        .expect("a marked weight source");
    let end = source
        .find("// </w-source>")
        .expect("a marked weight source");
    format!("{}{block}{}", &source[..start], &source[end..])
}

/// mx-quant's WGSL decoding for `format`, to append to a module that reads MX weights.
fn mx_decoding(format: mx_quant::ElemFormat) -> String {
    format!(
        "{}{}",
        mx_quant::wgsl::decode_constants(format),
        mx_quant::wgsl::DECODE_SOURCE
    )
}

/// The register GEMM's module for one weight format, with its entry point: `linear_reg` (f32
/// weights), `linear_reg_f16` or `linear_reg_mx`.
fn register_gemm_source(weights: RegisterWeights) -> (String, &'static str) {
    let entry = |name: &str| format!("fn {name}(");
    match weights {
        RegisterWeights::F32 => (REG_SHADER.to_string(), "linear_reg"),
        RegisterWeights::F16 => {
            let block = "@group(0) @binding(1) var<storage, read> rg_w4: array<vec4<f16>>;\n\
                         fn w_vec4(at: u32) -> vec4<f32> {\n    \
                         return vec4<f32>(rg_w4[at / 4u]);\n}\n";
            let source = format!("enable f16;\n{}", swap_weight_source(REG_SHADER, block));
            let name = "linear_reg_f16";
            (source.replace(&entry("linear_reg"), &entry(name)), name)
        }
        RegisterWeights::Mx(format) => {
            let block = format!(
                "{MX_BINDINGS}fn w_vec4(at: u32) -> vec4<f32> {{\n    return mx_vec4(at);\n}}\n"
            );
            let source = swap_weight_source(REG_SHADER, &block) + &mx_decoding(format);
            let name = "linear_reg_mx";
            (source.replace(&entry("linear_reg"), &entry(name)), name)
        }
    }
}

/// The weight formats of the register GEMM.
#[derive(Clone, Copy)]
enum RegisterWeights {
    F32,
    F16,
    Mx(mx_quant::ElemFormat),
}

/// A GEMM weight on the device: plain (f32 for the f32 kernels, f16 for the tensor-core ones)
/// or MX codes and scales in mx-quant's linear layout, decoded inside the kernel.
enum GpuWeight {
    Plain(wgpu::Buffer),
    Mx {
        codes: wgpu::Buffer,
        scales: wgpu::Buffer,
    },
}

impl GpuWeight {
    /// The f32-activation GEMM that reads this weight with inner size `k`, and its output tile:
    /// `linear_reg_mx` for MX weights, else the kernel `gemm` picks.
    fn f32_pipeline(&self, gemm: GemmKernel, k: usize) -> (usize, u32) {
        match self {
            GpuWeight::Plain(_) => gemm.pipeline_for(k),
            GpuWeight::Mx { .. } => (LINEAR_REG_MX, 32),
        }
    }

    /// The weight's buffers in binding order: the weight (or codes) at 1, scales at 5.
    fn bind<'a>(
        &'a self,
        x: &'a wgpu::Buffer,
        b: &'a wgpu::Buffer,
        y: &'a wgpu::Buffer,
        params: &'a wgpu::Buffer,
    ) -> Vec<&'a wgpu::Buffer> {
        match self {
            GpuWeight::Plain(w) => vec![x, w, b, y, params],
            GpuWeight::Mx { codes, scales } => vec![x, codes, b, y, params, scales],
        }
    }
}

/// The tensor-core kernels (vit_coop.wgsl).
const COOP_SHADER: &str = include_str!("shaders/vit_coop.wgsl");

/// Which GEMM kernel the linear layers use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GemmKernel {
    /// 16x16 tile per workgroup, one output per thread.
    #[default]
    Small,
    /// 64x64 tile per workgroup, a 4x4 register block per thread. Measured 2.7x slower than
    /// `Small` on an H200 through Vulkan (its per-thread block spills); kept for the README's
    /// comparison of the f32 kernels.
    Blocked,
    /// 32x32 tile per workgroup of 8x8, a 4x4 register block per thread read straight from
    /// the buffers as vec4s: no workgroup memory, no barriers (k must be a multiple of 4, else
    /// `Small` runs). The fastest on lavapipe, where a barrier costs a context switch.
    Register,
    /// `Register` with f16 weights (half the weight memory and traffic), f32 activations and
    /// accumulation: for devices with `SHADER_F16` but no cooperative matrices.
    RegisterF16,
    /// Cooperative matrices (tensor cores) for the whole tower: f16 weights and activations,
    /// f32 accumulation, 16x16x16 tiles; attention on tensor cores too. Needs a device opened
    /// with [`coop_features`] and a tower [`coop_fits`]; other towers run `Small`.
    Coop,
}

/// The device features the tensor-core kernels need, if `adapter` offers them: f16 shaders,
/// subgroups of exactly 32 invocations (the kernels give each subgroup a fixed share of a
/// workgroup) and cooperative matrices with a 16x16x16 f16 x f16 -> f32 configuration.
/// Request them when opening the device, with experimental features enabled.
pub fn coop_features(adapter: &wgpu::Adapter) -> Option<wgpu::Features> {
    let wanted = COOP_FEATURES;
    let shape = adapter.cooperative_matrix_properties().iter().any(|p| {
        (p.m_size, p.n_size, p.k_size) == (16, 16, 16)
            && p.ab_type == wgpu::CooperativeScalarType::F16
            && p.cr_type == wgpu::CooperativeScalarType::F32
    });
    let info = adapter.get_info();
    let subgroups_of_32 = info.subgroup_min_size == 32 && info.subgroup_max_size == 32;
    (adapter.features().contains(wanted) && shape && subgroups_of_32).then_some(wanted)
}

/// Workgroup memory the tensor-core attention declares: its staged K and V (2 x 64 x 18
/// vec4<f16>) and 4 subgroups' scores (f32) and probabilities (f16), 16 rows of 72 each.
/// Devices that offer less run the f32 kernels. (The GEMM's needs are checked per blocking,
/// `CoopTile::workgroup_bytes`.)
const COOP_WORKGROUP_BYTES: u32 = 2 * 64 * 18 * 8 + 4 * 16 * 72 * 4 + 4 * 16 * 72 * 2;

/// Workgroup memory `attention_fragments.comp` declares: two buffers each of a 64-key block of
/// K and of V (64 x 18 f16 vectors), and 4 subgroups' probabilities (16 rows of 72 f16).
const FRAGMENT_WORKGROUP_BYTES: u32 = 2 * 2 * 64 * 18 * 8 + 4 * 16 * 72 * 2;

/// The fragment attention's module and the probe of the accumulator layout it assumes: SPIR-V
/// built from the GLSL beside them by `shaders/glsl/build.sh` (naga's WGSL cannot reach a
/// cooperative matrix's elements), which records the sources' hashes in `SOURCES.sha256`.
const ATTENTION_FRAGMENTS_SPV: &[u8] = include_bytes!("shaders/glsl/attention_fragments.spv");
const FRAGMENT_PROBE_SPV: &[u8] = include_bytes!("shaders/glsl/fragment_probe.spv");

/// What [`fragment_attention_support`] returns where the device's accumulators are laid out as
/// the fragment attention assumes: the only way to ask for [`CoopAttention::Fragments`], so the
/// kernel is never chosen on a device that was not probed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FragmentLayout(());

/// Which tensor-core attention kernel a `Coop` tower runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CoopAttention {
    /// `attention_coop` (vit_coop.wgsl): scores, probabilities and each key block's P V pass
    /// through workgroup memory, where pairs of lanes run the softmax.
    #[default]
    Wgsl,
    /// `attention_fragments` (GLSL through SPIR-V passthrough): the softmax and the output stay
    /// in the accumulators' registers, each invocation working on its own elements; only P
    /// goes through workgroup memory. Heads of 64 dimensions, on a device where
    /// [`fragment_attention_support`] holds (it needs `PASSTHROUGH_SHADERS`, which
    /// [`device_descriptor`] requests where offered); elsewhere `Wgsl` runs.
    Fragments(FragmentLayout),
}

/// Whether `device` runs [`CoopAttention::Fragments`]: it was opened with the tensor-core
/// features ([`coop_features`]) and SPIR-V passthrough, has the workgroup memory, and its
/// 16x16 f32 accumulator is laid out as the kernel assumes (8 elements per invocation in 2
/// rows, the 4 invocations of each aligned group holding the same 2 rows), which a probe
/// dispatch on `queue` shows (it waits for the device).
///
/// # Errors
/// What is missing, or how the layout differs.
pub fn fragment_attention_support(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
) -> Result<FragmentLayout, String> {
    fragment_attention_fits(device)?;
    let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
        label: Some("fragment probe"),
        entries: &[storage_entry(0, false)],
    });
    let pipeline = passthrough_pipeline(device, &layout, "fragment probe", FRAGMENT_PROBE_SPV, 32);
    let bytes = 257 * 4;
    let out = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("fragment probe"),
        size: bytes,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let read = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("fragment probe readback"),
        size: bytes,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let bind = bind_buffers(device, &pipeline, &[&out]);
    let mut encoder = device.create_command_encoder(&Default::default());
    {
        let mut pass = encoder.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    }
    encoder.copy_buffer_to_buffer(&out, 0, &read, 0, bytes);
    queue.submit([encoder.finish()]);
    let (tx, rx) = std::sync::mpsc::channel();
    read.slice(..)
        .map_async(wgpu::MapMode::Read, move |r| drop(tx.send(r)));
    device
        .poll(wgpu::PollType::wait_indefinitely())
        .map_err(|e| format!("waiting for the layout probe: {e}"))?;
    rx.recv()
        .map_err(|_| "the layout probe's readback was dropped".to_string())?
        .map_err(|e| format!("reading the layout probe back: {e}"))?;
    let values: Vec<f32> = {
        let view = read
            .slice(..)
            .get_mapped_range()
            .map_err(|e| format!("reading the layout probe back: {e}"))?;
        bytemuck::cast_slice(&view).to_vec()
    };
    read.unmap();
    check_fragment_layout(&values).map(|()| FragmentLayout(()))
}

/// Whether `device` was opened with what the fragment attention needs (the tensor-core
/// features and SPIR-V passthrough) and offers its workgroup memory and size.
fn fragment_attention_fits(device: &wgpu::Device) -> Result<(), String> {
    let needed = COOP_FEATURES | wgpu::Features::PASSTHROUGH_SHADERS;
    if !device.features().contains(needed) {
        return Err(format!(
            "the device was opened without {:?}",
            needed - device.features()
        ));
    }
    let limits = device.limits();
    if limits.max_compute_workgroup_storage_size < FRAGMENT_WORKGROUP_BYTES
        || limits.max_compute_invocations_per_workgroup < 128
    {
        return Err(format!(
            "the kernel needs {FRAGMENT_WORKGROUP_BYTES} bytes of workgroup memory and 128 \
             invocations per workgroup; the device offers {} and {}",
            limits.max_compute_workgroup_storage_size, limits.max_compute_invocations_per_workgroup
        ));
    }
    Ok(())
}

/// Checks the probe's output (`fragment_probe.comp`: position p of the row-major 16x16 matrix
/// holds lane * 64 + element, and value 256 the element count) against what
/// `attention_fragments.comp` assumes.
fn check_fragment_layout(values: &[f32]) -> Result<(), String> {
    if values.len() != 257 || values[256] != 8.0 {
        return Err(format!(
            "an accumulator holds {} elements per invocation; the kernel is written for 8",
            values.get(256).copied().unwrap_or(f32::NAN)
        ));
    }
    // rows[lane]: a bit per row its elements lie in.
    let mut rows = [0u16; 32];
    let mut seen = [0u8; 32];
    for (position, &code) in values[..256].iter().enumerate() {
        let valid = code >= 0.0 && code.fract() == 0.0 && code < 32.0 * 64.0;
        let (lane, element) = ((code as usize) / 64, (code as usize) % 64);
        if !valid || element >= 8 || seen[lane] & (1 << element) != 0 {
            return Err(format!(
                "position {position} of the probe holds {code}, not a new element of a lane"
            ));
        }
        seen[lane] |= 1 << element;
        rows[lane] |= 1 << (position / 16);
    }
    for group in rows.chunks_exact(4) {
        if group[0].count_ones() != 2 || group.iter().any(|&r| r != group[0]) {
            return Err(format!(
                "the rows each lane of a group of 4 holds differ or are not two: {group:04x?}"
            ));
        }
    }
    Ok(())
}

/// A compute pipeline layout entry for a storage buffer at `binding`.
fn storage_entry(binding: u32, read_only: bool) -> wgpu::BindGroupLayoutEntry {
    wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Storage { read_only },
            has_dynamic_offset: false,
            min_binding_size: None,
        },
        count: None,
    }
}

/// One of this crate's SPIR-V modules (entry point `main`, `threads` invocations in x) as a
/// compute pipeline with bind group 0 `layout`.
fn passthrough_pipeline(
    device: &wgpu::Device,
    layout: &wgpu::BindGroupLayout,
    name: &str,
    spirv: &[u8],
    threads: u32,
) -> wgpu::ComputePipeline {
    let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
        label: Some(name),
        bind_group_layouts: &[Some(layout)],
        immediate_size: 0,
    });
    let entry = [wgpu::PassthroughShaderEntryPoint {
        name: "main".into(),
        workgroup_size: (threads, 1, 1),
    }];
    // SAFETY: the module is one of this crate's, built by shaders/glsl/build.sh, which runs
    // spirv-val on it, from the GLSL whose hash `glsl_spirv_is_built_from_its_sources` checks.
    // Its bindings are `layout`'s, and each dispatch of it is built from sizes checked against
    // the contract its source states (`fragment_attention_support`'s probe: one subgroup, 257
    // floats; the attention: see `with_batch`).
    let module = unsafe {
        device.create_shader_module_passthrough(wgpu::ShaderModuleDescriptorPassthrough {
            label: Some(name),
            entry_points: entry[..].into(),
            spirv: Some(wgpu::util::make_spirv_raw(spirv)),
            ..Default::default()
        })
    };
    device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(name),
        layout: Some(&pipeline_layout),
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    })
}

/// `attention_fragments` with attention_coop's bindings: the QKV buffer (f16) at 0 and again
/// at 3, the output at 1, the parameters at 2.
fn fragment_attention_pipeline(device: &wgpu::Device) -> wgpu::ComputePipeline {
    let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
        label: Some("attention_fragments"),
        entries: &[
            storage_entry(0, true),
            storage_entry(1, false),
            wgpu::BindGroupLayoutEntry {
                binding: 2,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Uniform,
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            },
            storage_entry(3, true),
        ],
    });
    passthrough_pipeline(
        device,
        &layout,
        "attention_fragments",
        ATTENTION_FRAGMENTS_SPV,
        128,
    )
}

/// What [`coop_features`] asks for.
const COOP_FEATURES: wgpu::Features = wgpu::Features::SHADER_F16
    .union(wgpu::Features::SUBGROUP)
    .union(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX);

/// The tensor-core GEMM's blocking (`gemm_coop`, vit_coop.wgsl): a workgroup computes a
/// `rows x cols` block of y, split among subgroups that each hold `tiles_m x tiles_n`
/// accumulator tiles of 16x16. Bigger subgroup blocks load fewer tiles from workgroup memory
/// per product (TM + TN loads for TM x TN products); bigger workgroup blocks read less from
/// memory per product but leave fewer workgroups to fill the GPU. Which is faster is measured,
/// not derived: on the H200, 4x4 and 2x4 subgroup blocks were slower than 2x2 in 64x64 blocks at
/// every batch (README, "Vision encoder").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CoopTile {
    pub rows: u32,
    pub cols: u32,
    pub tiles_m: u32,
    pub tiles_n: u32,
    /// K steps whose loads are in flight while a step multiplies: 1, 2, 4 or 8.
    pub prefetch: u32,
    /// Loads of two k steps at once (`/pairs`; an even `prefetch`): each warp-wide load then
    /// covers whole 128-byte rows of x or w (64 f16s, two steps of 32) instead of halves, and
    /// each invocation stages every other step, twice as much.
    pub paired_loads: bool,
}

impl CoopTile {
    /// 64x64 blocks of 4 subgroups with 2x2 tiles each, four k steps in flight: the default
    /// for GEMMs too small to fill the GPU with [`CoopTile::WIDE`] blocks.
    pub const SMALL: CoopTile = CoopTile {
        rows: 64,
        cols: 64,
        tiles_m: 2,
        tiles_n: 2,
        prefetch: 4,
        paired_loads: false,
    };

    /// 128x128 blocks of 8 subgroups with 4x2 tiles each, four k steps in flight: the default
    /// where a GEMM has at least [`CoopTile::WIDE_MIN_BLOCKS`] of them.
    pub const WIDE: CoopTile = CoopTile {
        rows: 128,
        cols: 128,
        tiles_m: 4,
        tiles_n: 2,
        prefetch: 4,
        paired_loads: false,
    };

    /// Fewer [`CoopTile::WIDE`] blocks than this leave too much of an H200 or H100 (132 SMs)
    /// idle, and [`CoopTile::SMALL`] is faster: at batch 1 of SigLIP-B/16-512 (1024 rows) the
    /// QKV projection has 144 and fc1 192, and all-SMALL GEMMs were faster than WIDE ones there
    /// in six of six paired runs over the two cards (README, "Vision encoder").
    pub const WIDE_MIN_BLOCKS: usize = 256;

    /// The default blocking for an m x n GEMM.
    pub fn for_shape(m: usize, n: usize) -> CoopTile {
        let wide = CoopTile::WIDE;
        if m.div_ceil(wide.rows as usize) * n.div_ceil(wide.cols as usize) >= Self::WIDE_MIN_BLOCKS
        {
            wide
        } else {
            CoopTile::SMALL
        }
    }

    /// `ROWSxCOLS/TMxTN[/pN][/pairs]`, e.g. `128x128/4x2`, `128x128/4x2/p2` or
    /// `64x64/2x2/p4/pairs`.
    pub fn parse(text: &str) -> Result<CoopTile, String> {
        let pair = |part: &str| -> Option<(u32, u32)> {
            let (a, b) = part.split_once('x')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        };
        let mut parts = text.split('/').peekable();
        let block = parts.next().and_then(pair);
        let tiles = parts.next().and_then(pair);
        let prefetch = match parts.next_if(|p| p.starts_with('p') && *p != "pairs") {
            None => Some(1),
            Some(p) => p[1..].parse().ok(),
        };
        let paired_loads = parts.next_if(|p| *p == "pairs").is_some();
        let (Some((rows, cols)), Some((tiles_m, tiles_n)), Some(prefetch), None) =
            (block, tiles, prefetch, parts.next())
        else {
            return Err(format!(
                "tensor-core GEMM tile {text:?}: expected ROWSxCOLS/TMxTN[/pN][/pairs]"
            ));
        };
        let tile = CoopTile {
            rows,
            cols,
            tiles_m,
            tiles_n,
            prefetch,
            paired_loads,
        };
        tile.check()
            .map_err(|why| format!("tensor-core GEMM tile {text:?}: {why}"))?;
        Ok(tile)
    }

    fn subgroups(self) -> u32 {
        (self.rows / (16 * self.tiles_m)) * (self.cols / (16 * self.tiles_n))
    }

    /// Invocations per workgroup (32 per subgroup).
    fn threads(self) -> u32 {
        self.subgroups() * 32
    }

    /// Whether the kernel can be built with this blocking: whole subgroup blocks, 1 to 8
    /// subgroups, and each block's 32-wide k slice split evenly among the invocations.
    fn check(self) -> Result<(), String> {
        let CoopTile {
            rows,
            cols,
            tiles_m,
            tiles_n,
            prefetch,
            paired_loads,
        } = self;
        if ![1, 2, 4, 8].contains(&prefetch) {
            return Err(format!(
                "1, 2, 4 or 8 k steps can be in flight, not {prefetch}"
            ));
        }
        if paired_loads && prefetch == 1 {
            return Err("paired loads need 2, 4 or 8 k steps in flight".into());
        }
        let whole = (1..=8).contains(&tiles_m)
            && (1..=8).contains(&tiles_n)
            && rows.is_multiple_of(16 * tiles_m)
            && cols.is_multiple_of(16 * tiles_n);
        let threads = if whole { self.threads() } else { 0 };
        if !whole
            || !(1..=8).contains(&self.subgroups())
            || !(rows * 8).is_multiple_of(threads)
            || !(cols * 8).is_multiple_of(threads)
        {
            return Err(format!(
                "a {rows}x{cols} block must split into 1 to 8 subgroups of {tiles_m}x{tiles_n} \
                 16x16 tiles (1 to 8 each way) whose invocations share each 32-wide k slice \
                 evenly"
            ));
        }
        Ok(())
    }

    /// Workgroup memory `gemm_coop` declares with this blocking: two staged x and w tiles of
    /// rows (cols) x 40 f16s (BK = 32 plus 8 of padding: LDT = 10 vec4s), and a 16x16 f32
    /// scratch per subgroup.
    fn workgroup_bytes(self) -> u32 {
        2 * (self.rows + self.cols) * 10 * 8 + self.subgroups() * 1024
    }

    /// The code for the three markers of `gemm_coop`: the accumulators, one k step's products
    /// and the epilogue, written out for TM x TN tiles.
    fn gemm_code(self) -> [(&'static str, String); 3] {
        let (tm, tn) = (self.tiles_m, self.tiles_n);
        let mut accumulators = String::new();
        let mut products = String::new();
        let mut epilogue = String::new();
        for i in 0..tm {
            products += &format!(
                "let a{i} = coopLoadT<coop_mat16x16<f16, A>>(&ta[abase + {}u * LDT + kk], LDT);\n            ",
                16 * i
            );
        }
        for j in 0..tn {
            products += &format!(
                "let b{j} = coopLoad<coop_mat16x16<f16, B>>(&tb[bbase + {}u * LDT + kk], LDT);\n            ",
                16 * j
            );
        }
        for i in 0..tm {
            for j in 0..tn {
                accumulators += &format!("var c{i}_{j} = coop_mat16x16<f32, C>();\n    ");
                products +=
                    &format!("c{i}_{j} = coopMultiplyAdd(a{i}, b{j}, c{i}_{j});\n            ");
                epilogue += &format!(
                    "finish_tile(c{i}_{j}, sg, lane, r0 + {}u, c0 + {}u);\n    ",
                    16 * i,
                    16 * j
                );
            }
        }
        // Each invocation's share of one k step's x and w tiles, in named registers
        // `{set}_a{i}` and `{set}_b{i}` (not arrays, which a driver may leave in memory).
        // A k step is BK = 32 columns, ROW_VECS = 8 vectors per row.
        let threads = self.threads();
        let (a_per, b_per) = (self.rows * 8 / threads, self.cols * 8 / threads);
        let declare = |set: &str| {
            let mut code = String::new();
            for i in 0..a_per {
                code += &format!("var {set}_a{i}: vec4<f16>;\n    ");
            }
            for i in 0..b_per {
                code += &format!("var {set}_b{i}: WRaw;\n    ");
            }
            code
        };
        let fetch = |set: &str, t: &str| {
            let mut code = String::new();
            for i in 0..a_per {
                code += &format!(
                    "{set}_a{i} = fetch_x(tid + {i}u * GEMM_THREADS, row0, {t});\n        "
                );
            }
            for i in 0..b_per {
                code += &format!(
                    "{set}_b{i} = fetch_w(tid + {i}u * GEMM_THREADS, col0, {t});\n        "
                );
            }
            code
        };
        let stage = |set: &str, buf: &str| {
            let mut code = String::new();
            for i in 0..a_per {
                code += &format!(
                    "ta[{buf} * A_TILE + ((tid + {i}u * GEMM_THREADS) / ROW_VECS) * LDT + \
                     (tid + {i}u * GEMM_THREADS) % ROW_VECS] = {set}_a{i};\n        "
                );
            }
            for i in 0..b_per {
                code += &format!(
                    "tb[{buf} * B_TILE + ((tid + {i}u * GEMM_THREADS) / ROW_VECS) * LDT + \
                     (tid + {i}u * GEMM_THREADS) % ROW_VECS] = w_decode({set}_b{i});\n        "
                );
            }
            code
        };
        // One k step: stage the registers `set` into buffer `buf`, refill them with the step
        // `ahead` of this one, multiply the staged tiles. Steps at or past k fetch zeros
        // (`fetch_x`, `fetch_w`), so the refill needs no branch.
        let step = |set: &str, buf: &str, ahead: u32| {
            let refill = fetch(set, &format!("(step + {ahead}u) * BK"));
            format!(
                "{}workgroupBarrier();\n        {refill}\
                 {{\n        let abase = {buf} * A_TILE + sr * 16u * TM * LDT;\n        \
                 let bbase = {buf} * B_TILE + sc * 16u * TN * LDT;\n        \
                 for (var kk = 0u; kk < ROW_VECS; kk += 4u) {{\n            {products}\n        }}\n        }}\n        ",
                stage(set, buf)
            )
        };
        // Paired loads: pair u of an unrolled iteration is steps 2u and 2u + 1. Invocation tid
        // loads vector pcol of the rows prow, prow + GEMM_THREADS / 16, ... of step 2u + par's
        // slice (par = (tid % 16) / 8), so the 16 invocations tid % 16 read one row's 64
        // values of the pair; it stages them at that step only, and refills after the pair's
        // second step, when both halves are staged.
        let paired = |u: u32| {
            let decl = (0..2 * a_per)
                .map(|i| format!("var q{u}_a{i}: vec4<f16>;\n    "))
                .chain((0..2 * b_per).map(|i| format!("var q{u}_b{i}: WRaw;\n    ")))
                .collect::<String>();
            let load = move |at: &str| {
                (0..2 * a_per)
                    .map(|i| {
                        format!(
                            "q{u}_a{i} = fetch_x((prow + {i}u * (GEMM_THREADS / 16u)) * ROW_VECS + pcol, row0, {at} + par * BK);\n        "
                        )
                    })
                    .chain((0..2 * b_per).map(|i| {
                        format!(
                            "q{u}_b{i} = fetch_w((prow + {i}u * (GEMM_THREADS / 16u)) * ROW_VECS + pcol, col0, {at} + par * BK);\n        "
                        )
                    }))
                    .collect::<String>()
            };
            let stage = move |buf: u32| {
                (0..2 * a_per)
                    .map(|i| {
                        format!(
                            "ta[{buf}u * A_TILE + (prow + {i}u * (GEMM_THREADS / 16u)) * LDT + pcol] = q{u}_a{i};\n            "
                        )
                    })
                    .chain((0..2 * b_per).map(|i| {
                        format!(
                            "tb[{buf}u * B_TILE + (prow + {i}u * (GEMM_THREADS / 16u)) * LDT + pcol] = w_decode(q{u}_b{i});\n            "
                        )
                    }))
                    .collect::<String>()
            };
            (decl, load, stage)
        };
        let k_loop = if self.paired_loads {
            let n = self.prefetch;
            let mut code = "let par = (tid % 16u) / 8u;\n    let pcol = tid % 8u;\n    let prow = tid / 16u;\n    ".to_string();
            for u in 0..n / 2 {
                let (decl, load, _) = paired(u);
                code += &decl;
                code += &load(&format!("{}u * BK", 2 * u));
            }
            code += &format!("for (var step = 0u; step < steps; step += {n}u) {{\n        ");
            for j in 0..n {
                let u = j / 2;
                let (_, load, stage) = paired(u);
                let refill = if j % 2 == 1 {
                    load(&format!("(step + {}u) * BK", j - 1 + n))
                } else {
                    String::new()
                };
                code += &format!(
                    "if (par == {}u) {{\n            {}}}\n        workgroupBarrier();\n        {refill}\
                     {{\n        let abase = {buf}u * A_TILE + sr * 16u * TM * LDT;\n        \
                     let bbase = {buf}u * B_TILE + sc * 16u * TN * LDT;\n        \
                     for (var kk = 0u; kk < ROW_VECS; kk += 4u) {{\n            {products}\n        }}\n        }}\n        ",
                    j % 2,
                    stage(j % 2),
                    buf = j % 2,
                );
            }
            code + "}\n"
        } else if self.prefetch == 1 {
            // One step in flight: buffers alternate by step.
            format!(
                "{}{}for (var step = 0u; step < steps; step++) {{\n        \
                 let buf = step % 2u;\n        {}}}\n",
                declare("next"),
                fetch("next", "0u"),
                step("next", "buf", 1)
            )
        } else {
            // N steps in flight (N = 2, 4 or 8): step s's loads in register set s % N, staged into
            // buffer s % 2 (the loop is unrolled N times, so both are fixed in the code). A step
            // count that is not a multiple of N ends with zero steps rather than a branch around
            // cooperative operations (which must stay in uniform control flow).
            let n = self.prefetch;
            let mut code = String::new();
            for j in 0..n {
                code += &declare(&format!("s{j}"));
                code += &fetch(&format!("s{j}"), &format!("{j}u * BK"));
            }
            code += &format!("for (var step = 0u; step < steps; step += {n}u) {{\n        ");
            for j in 0..n {
                code += &step(&format!("s{j}"), &format!("{}u", j % 2), j + n);
            }
            code + "}\n"
        };
        [
            ("// <accumulators>", accumulators),
            ("// <k-loop>", k_loop),
            ("// <epilogue>", epilogue),
        ]
    }
}

/// The code for attention_coop's markers, written out with named registers (not arrays, which
/// a driver may leave in memory): each invocation's share of a 64-key block of K and V
/// (`rk{i}`, `rv{i}`: 64 x 16 vectors over QSUB x 32 invocations), and its two output columns
/// of the subgroup's 16 query rows (`o{row}`).
fn attention_code(query_subgroups: usize) -> [(&'static str, String); 6] {
    let kv_per_thread = 64 * 16 / (query_subgroups * 32);
    let mut registers = String::new();
    let mut stage = String::new();
    let mut refill = String::new();
    for i in 0..kv_per_thread {
        registers += &format!(
            "var rk{i} = fetch_kv(1u, tid + {i}u * ATT_THREADS, 0u, col);\n    \
             var rv{i} = fetch_kv(2u, tid + {i}u * ATT_THREADS, 0u, col);\n    "
        );
        stage += &format!(
            "kv_k[((tid + {i}u * ATT_THREADS) / 16u) * LDK + (tid + {i}u * ATT_THREADS) % 16u] = rk{i};\n        \
             kv_v[((tid + {i}u * ATT_THREADS) / 16u) * LDK + (tid + {i}u * ATT_THREADS) % 16u] = rv{i};\n        "
        );
        refill += &format!(
            "rk{i} = fetch_kv(1u, tid + {i}u * ATT_THREADS, j0 + 64u, col);\n            \
             rv{i} = fetch_kv(2u, tid + {i}u * ATT_THREADS, j0 + 64u, col);\n            "
        );
    }
    let mut o_registers = String::new();
    let mut update = String::new();
    let mut write = String::new();
    for row in 0..16 {
        o_registers += &format!("var o{row} = vec2<f32>(0.0);\n    ");
        // The shuffles stay outside the branch: every lane takes part in them.
        update += &format!(
            "{{\n        let a = subgroupShuffle(alpha, {}u);\n        \
             if (2u * lane < hd) {{\n            \
             let at = ws + {row}u * LDS + 2u * lane;\n            \
             o{row} = o{row} * a + vec2<f32>(s_ws[at], s_ws[at + 1u]);\n        \
             }}\n        }}\n        ",
            2 * row
        );
        write += &format!(
            "{{\n    let l = subgroupShuffle(l_run, {}u);\n    \
             if (2u * lane < hd) {{\n        \
             att_out[((q0 + {row}u) * h + col + 2u * lane) / 2u] = pack2x16float(o{row} / l);\n    \
             }}\n    }}\n    ",
            2 * row
        );
    }
    [
        ("// <kv-registers>", registers),
        ("// <kv-stage>", stage),
        ("// <kv-refill>", refill),
        ("// <o-registers>", o_registers),
        ("// <o-update>", update),
        ("// <o-write>", write),
    ]
}

/// The code for the markers of layer_norm_f16 and layer_norm_add_f16, written out with named
/// registers: lane l's vectors l, l + 32, ... of a row of `width` values (`vecs` = width / 128
/// rounded up of them).
fn layer_norm_code(width: usize) -> [(&'static str, String); 7] {
    let vecs = width.div_ceil(128).max(1);
    let mut load = String::new();
    let mut load_add = String::new();
    let mut square = String::new();
    let mut store = String::new();
    for j in 0..vecs {
        load += &format!(
            "var x{j} = vec4<f32>(0.0);\n    \
             if (lane + {o}u < w4) {{ x{j} = ln_x[base + lane + {o}u]; }}\n    \
             s += x{j}.x + x{j}.y + x{j}.z + x{j}.w;\n    ",
            o = 32 * j
        );
        // The residual's row plus the bias plus the split GEMM's planes, in plane order.
        load_add += &format!(
            "var x{j} = vec4<f32>(0.0);\n    \
             if (lane + {o}u < w4) {{\n        \
             var v = lna_x[base + lane + {o}u] + lna_bias[lane + {o}u];\n        \
             for (var p = 0u; p < ln_p.w; p++) {{ v += lna_parts[p * plane4 + base + lane + {o}u]; }}\n        \
             lna_x[base + lane + {o}u] = v;\n        \
             x{j} = v;\n    \
             }}\n    \
             s += x{j}.x + x{j}.y + x{j}.z + x{j}.w;\n    ",
            o = 32 * j
        );
        square += &format!(
            "if (lane + {o}u < w4) {{ let d = x{j} - mean; q += dot(d, d); }}\n    ",
            o = 32 * j
        );
        store += &format!(
            "if (lane + {o}u < w4) {{\n        \
             let y = (x{j} - mean) * inv * ln_w[lane + {o}u] + ln_b[lane + {o}u];\n        \
             ln_y[base + lane + {o}u] = vec2<u32>(pack2x16float(y.xy), pack2x16float(y.zw));\n    \
             }}\n    ",
            o = 32 * j
        );
    }
    [
        (
            "const LN_VECS: u32 = 6u;",
            format!("const LN_VECS: u32 = {vecs}u;"),
        ),
        ("// <ln-load>", load),
        ("// <ln-square>", square.clone()),
        ("// <ln-store>", store.clone()),
        ("// <lna-load>", load_add),
        ("// <lna-square>", square),
        ("// <lna-store>", store),
    ]
}

/// The tensor-core module with its tile constants set (the GEMM's blocking, subgroups of 16
/// queries per attention workgroup) and, with MX weights, the GEMM's weight source swapped for
/// MX codes and scales decoded by mx-quant's WGSL functions.
fn coop_source(
    tile: CoopTile,
    query_subgroups: usize,
    width: usize,
    mx: Option<mx_quant::ElemFormat>,
) -> String {
    let constants = [
        (
            "const BM: u32 = 64u;",
            format!("const BM: u32 = {}u;", tile.rows),
        ),
        (
            "const BN: u32 = 64u;",
            format!("const BN: u32 = {}u;", tile.cols),
        ),
        (
            "const TM: u32 = 2u;",
            format!("const TM: u32 = {}u;", tile.tiles_m),
        ),
        (
            "const TN: u32 = 2u;",
            format!("const TN: u32 = {}u;", tile.tiles_n),
        ),
        (
            "const SGN: u32 = 2u;",
            format!("const SGN: u32 = {}u;", tile.cols / (16 * tile.tiles_n)),
        ),
        (
            "const QSUB: u32 = 4u;",
            format!("const QSUB: u32 = {query_subgroups}u;"),
        ),
    ];
    let mut source = COOP_SHADER.to_string();
    for (marker, code) in constants
        .into_iter()
        .chain(tile.gemm_code())
        .chain(attention_code(query_subgroups))
        .chain(layer_norm_code(width))
    {
        assert!(source.contains(marker), "vit_coop.wgsl lacks {marker}");
        source = source.replace(marker, &code);
    }
    if let Some(format) = mx {
        let block = format!(
            "{MX_BINDINGS}alias WRaw = vec4<u32>;\n\
             fn w_load(at: u32) -> WRaw {{\n    return mx_load4(at);\n}}\n\
             fn w_decode(raw: WRaw) -> vec4<f16> {{\n    return vec4<f16>(mx_unpack4(raw));\n}}\n"
        );
        source = swap_weight_source(&source, &block) + &mx_decoding(format);
    }
    source
}

/// Whether the tensor-core kernels take this tower, and if not, why: the patch count a
/// multiple of 64 (attention's key blocks), head_dim a multiple of 16 up to 64, and every
/// GEMM's output width a multiple of 8 and inner size of 4 (vector loads). SigLIP-B/16 at 512
/// (SmolVLM-256M/500M) fits; SigLIP-so400m/14 (729 patches) runs the f32 kernels.
pub fn coop_fits(c: &VisionConfig) -> Result<(), String> {
    let side = c.patches_per_side();
    let n = side * side;
    let hd = c.hidden / c.heads.max(1);
    let pp = 3 * c.patch_size * c.patch_size;
    let checks = [
        (
            n > 0 && n.is_multiple_of(64),
            format!("{n} patches (need a multiple of 64)"),
        ),
        (
            c.hidden.is_multiple_of(8),
            format!("hidden {} (need a multiple of 8)", c.hidden),
        ),
        (
            c.intermediate.is_multiple_of(8),
            format!("intermediate {} (need a multiple of 8)", c.intermediate),
        ),
        (
            pp.is_multiple_of(4),
            format!("{pp} values per patch (need a multiple of 4)"),
        ),
        (
            hd.is_multiple_of(16) && hd <= 64,
            format!("head_dim {hd} (need a multiple of 16, at most 64)"),
        ),
    ];
    match checks.into_iter().find(|(ok, _)| !ok) {
        None => Ok(()),
        Some((_, why)) => Err(why),
    }
}

impl GemmKernel {
    /// The pipeline and output tile for a GEMM with inner dimension `k`.
    fn pipeline_for(self, k: usize) -> (usize, u32) {
        match self {
            GemmKernel::Small => (LINEAR_SMALL, 16),
            GemmKernel::Blocked => (LINEAR, 64),
            GemmKernel::Register if k.is_multiple_of(4) => (LINEAR_REG, 32),
            GemmKernel::RegisterF16 if k.is_multiple_of(4) => (LINEAR_REG_F16, 32),
            GemmKernel::Register | GemmKernel::RegisterF16 | GemmKernel::Coop => (LINEAR_SMALL, 16),
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
    /// The tensor-core GEMM's blocking for every GEMM; `None` (the default) picks per GEMM
    /// shape between [`CoopTile::SMALL`] and [`CoopTile::WIDE`] ([`CoopTile::for_shape`]).
    pub coop_tile: Option<CoopTile>,
    /// GEMM weights in this MX format, decoded inside the kernels: the f32 path's GEMMs over
    /// whole MX blocks (k a multiple of 32) run `linear_reg_mx`, and the tensor-core GEMM
    /// decodes its weight tiles as it stages them (then every GEMM's k must be a multiple of
    /// 32). Weights are quantized at load with mx-quant's default options, exactly as
    /// [`VisionEncoder::with_mx_weights`] rounds them for the CPU.
    pub mx_weights: Option<mx_quant::ElemFormat>,
    /// The tensor-core attention kernel (with `Coop` GEMMs). `Fragments` is taken only where
    /// the device and the tower allow it, else `Wgsl` runs; [`GpuVisionEncoder::options`] says
    /// which was built.
    pub coop_attention: CoopAttention,
    /// The residual tensor-core GEMMs (each layer's attention output and fc2 projections but
    /// the last fc2) split over k into this many slices (at most [`MAX_SPLIT_K`]; fewer where
    /// k is short), whose products the LayerNorm that follows adds into the residual stream.
    /// `None` or `Some(1)`: not split. Without tensor cores it is ignored, and
    /// [`GpuVisionEncoder::options`] says `None`.
    pub coop_split_k: Option<u32>,
}

/// The device descriptor for the vision encoder on `adapter`: the adapter's own limits, f16
/// shaders and the cooperative-matrix features ([`coop_features`]) when it offers them; and
/// the kernels measured fastest there ([`GpuVisionOptions::for_adapter`], with `Coop` GEMMs
/// given the features).
pub fn device_descriptor(
    adapter: &wgpu::Adapter,
) -> (wgpu::DeviceDescriptor<'static>, GpuVisionOptions) {
    let mut options = GpuVisionOptions::for_adapter(&adapter.get_info());
    let mut desc = wgpu::DeviceDescriptor {
        label: Some("vision encoder"),
        required_limits: adapter.limits(),
        ..Default::default()
    };
    // f16 shaders where offered, so that callers can pick the f16-weight GEMM. It is not the
    // default on CPU-hosted drivers: on lavapipe it measured no faster than the f32 register
    // GEMM (`vit_bench -- synthetic gpu 5 register|register-f16 per-query`, 4 alternating
    // runs: 132-176 against 129-132 ms per image).
    desc.required_features |= adapter.features() & wgpu::Features::SHADER_F16;
    if let Some(features) = coop_features(adapter) {
        desc.required_features |= features;
        // SPIR-V passthrough where offered, for the fragment attention (`CoopAttention`).
        desc.required_features |= adapter.features() & wgpu::Features::PASSTHROUGH_SHADERS;
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
    /// barrier-free register GEMM and per-query attention (235 ms against 899 ms for the GPU
    /// defaults on the synthetic tower in one sitting, `vit_bench -- synthetic gpu 5 KERNELS`;
    /// CHANGELOG); on a GPU, the defaults (measured on an H200).
    pub fn for_adapter(info: &wgpu::AdapterInfo) -> GpuVisionOptions {
        if info.device_type == wgpu::DeviceType::Cpu {
            GpuVisionOptions {
                gemm: GemmKernel::Register,
                attention: AttentionKernel::PerQuery,
                coop_tile: None,
                mx_weights: None,
                coop_attention: CoopAttention::Wgsl,
                coop_split_k: None,
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
    let slices: Vec<Slice<'_>> = buffers.iter().map(|b| whole(b)).collect();
    bind_slices(device, pipeline, &slices)
}

/// One image's share of a batch buffer: `(buffer, image, bytes per image)`.
type Slice<'a> = (&'a wgpu::Buffer, usize, u64);

/// A bind group of `pipeline`'s group 0 with each slice (a buffer's image share, or all of
/// it) at bindings 0, 1, 2, ...
fn bind_slices(
    device: &wgpu::Device,
    pipeline: &wgpu::ComputePipeline,
    slices: &[Slice<'_>],
) -> wgpu::BindGroup {
    let entries: Vec<wgpu::BindGroupEntry<'_>> = slices
        .iter()
        .enumerate()
        .map(|(i, &(b, image, stride))| wgpu::BindGroupEntry {
            binding: i as u32,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: b,
                offset: image as u64 * stride,
                size: std::num::NonZeroU64::new(stride),
            }),
        })
        .collect();
    device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &entries,
    })
}

/// Image `image`'s share of a batch buffer holding `elems` values of `bytes` bytes per image.
fn share_of(buffer: &wgpu::Buffer, image: usize, elems: usize, bytes: usize) -> Slice<'_> {
    (buffer, image, (elems * bytes) as u64)
}

/// All of `buffer`, as a [`Slice`].
fn whole(buffer: &wgpu::Buffer) -> Slice<'_> {
    (buffer, 0, buffer.size())
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

    /// [`GpuVisionEncoder::new`] with explicit kernel choices. `Coop` on a tower that
    /// [`coop_fits`] rejects, or on a device with less than 43 KB of workgroup memory, runs the
    /// f32 kernels (`Small` GEMMs); [`GpuVisionEncoder::options`] says what was built.
    pub fn with_options(
        device: &wgpu::Device,
        cpu: &VisionEncoder,
        options: GpuVisionOptions,
    ) -> Result<GpuVisionEncoder, GpuVisionError> {
        GpuVisionEncoder::with_batch(device, cpu, options, 1)
    }

    /// [`GpuVisionEncoder::with_options`] for `batch` images per encode (SmolVLM's tiles of
    /// one frame, or several frames), recorded as one submission: every GEMM and LayerNorm
    /// takes the batch's rows at once, while the patch extraction, the attention and the
    /// pixel shuffle run once per image on its share of the buffers. Inputs and outputs hold
    /// the images one after another. With `batch > 1` each image's share of every buffer must
    /// start at the device's storage-offset alignment (true of the SigLIP shapes), else it is
    /// refused by name.
    ///
    /// # Errors
    /// As [`GpuVisionEncoder::with_options`]; [`GpuVisionError::Invalid`] for a batch of 0, or
    /// shares that are not aligned.
    pub fn with_batch(
        device: &wgpu::Device,
        cpu: &VisionEncoder,
        mut options: GpuVisionOptions,
        batch: usize,
    ) -> Result<GpuVisionEncoder, GpuVisionError> {
        let c = cpu.config.clone();
        if batch == 0 {
            return Err(GpuVisionError::Invalid("a batch of 0 images".into()));
        }
        let h = c.hidden;
        let hd = h / c.heads;
        if hd > 128 {
            return Err(GpuVisionError::HeadDim(hd));
        }
        let limit = device.limits().max_storage_buffer_binding_size;
        let side = c.patches_per_side();
        let n = side * side;
        let pp = 3 * c.patch_size * c.patch_size;
        let check = |what: &'static str, elems: usize| {
            let bytes = (elems as u64 * 4).saturating_mul(batch as u64);
            if bytes > limit {
                Err(GpuVisionError::TooLarge { what, bytes, limit })
            } else {
                Ok(())
            }
        };
        check(
            "an activation buffer",
            n * c.intermediate.max(pp).max(3 * h),
        )?;
        check("the connector input", n * h)?;
        // The rows every GEMM and LayerNorm takes: the batch's patches.
        let m = batch * n;
        let f2 = c.scale_factor * c.scale_factor;
        let tokens = c.image_tokens();
        if batch > 1 {
            let align = u64::from(device.limits().min_storage_buffer_offset_alignment);
            let s = c.image_size;
            for (what, bytes) in [
                ("an image", 3 * s * s * 4),
                ("an image's patches", n * pp * 4),
                ("an image's activations", n * h * 4),
                ("an image's f16 activations", n * h * 2),
                ("an image's f16 QKV", n * 3 * h * 2),
                ("an image's shuffled features", tokens * h * f2 * 4),
            ] {
                if !(bytes as u64).is_multiple_of(align) {
                    return Err(GpuVisionError::Invalid(format!(
                        "a batch of {batch}: {what} takes {bytes} bytes, not a multiple of the \
                         device's {align}-byte storage-offset alignment; encode these images \
                         one at a time"
                    )));
                }
            }
        }
        if options.gemm == GemmKernel::Coop {
            if !device.features().contains(COOP_FEATURES) {
                return Err(GpuVisionError::Unsupported(
                    "the tensor-core kernels need a device opened with SHADER_F16, SUBGROUP and \
                     EXPERIMENTAL_COOPERATIVE_MATRIX (see vision_gpu::coop_features)",
                ));
            }
            let workgroup_bytes = device.limits().max_compute_workgroup_storage_size;
            if coop_fits(&c).is_err() || workgroup_bytes < COOP_WORKGROUP_BYTES {
                options.gemm = GemmKernel::Small;
                options.attention = AttentionKernel::Tiled;
            }
        }
        let coop = options.gemm == GemmKernel::Coop;
        // Split-k residual GEMMs (tensor cores only): at most MAX_SPLIT_K planes of m x h f32.
        let split = if coop {
            options.coop_split_k.map_or(1, |s| s.max(1) as usize)
        } else {
            1
        };
        if split > MAX_SPLIT_K {
            return Err(GpuVisionError::Invalid(format!(
                "the residual GEMMs split over k in {split}: at most {MAX_SPLIT_K} slices"
            )));
        }
        if split > 1 {
            check("the split-k planes", split * n * h)?;
        } else {
            options.coop_split_k = None;
        }
        // The blockings to build: a forced one, or SMALL plus WIDE where the device has the
        // workgroup memory for WIDE.
        let limits = device.limits();
        let fits = |tile: &CoopTile| {
            tile.workgroup_bytes() <= limits.max_compute_workgroup_storage_size
                && tile.threads() <= limits.max_compute_invocations_per_workgroup
                && tile.threads() <= limits.max_compute_workgroup_size_x
        };
        let coop_gemms = match options.coop_tile {
            Some(tile) => CoopGemms {
                base: tile,
                wide: None,
            },
            None => CoopGemms {
                base: CoopTile::SMALL,
                wide: Some(CoopTile::WIDE).filter(fits),
            },
        };
        let tile = coop_gemms.base;
        tile.check().map_err(|why| {
            GpuVisionError::Invalid(format!("the tensor-core GEMM tile {tile:?}: {why}"))
        })?;
        if coop && !fits(&tile) {
            return Err(GpuVisionError::Invalid(format!(
                "the tensor-core GEMM tile {tile:?} needs {} bytes of workgroup memory and {} \
                 invocations per workgroup; the device offers {} and {}",
                tile.workgroup_bytes(),
                tile.threads(),
                limits.max_compute_workgroup_storage_size,
                limits
                    .max_compute_invocations_per_workgroup
                    .min(limits.max_compute_workgroup_size_x),
            )));
        }
        if !coop {
            options.coop_tile = None;
        }
        // The fragment attention's contract (attention_fragments.comp): heads of 64, the patch
        // count a multiple of 64 (coop_fits), and a device with passthrough and the workgroup
        // memory. The accumulator layout it assumes is what asking for `Fragments` takes a
        // `FragmentLayout` for: `fragment_attention_support`'s probe has shown it.
        let fragments = coop
            && matches!(options.coop_attention, CoopAttention::Fragments(_))
            && hd == 64
            && fragment_attention_fits(device).is_ok();
        if !fragments {
            options.coop_attention = CoopAttention::Wgsl;
        }
        // Attention workgroups take 64 queries (4 subgroups of 16) sharing each staged K and V
        // block. With 2 subgroups attention took 4.5 against 3.3 ms per SigLIP-B/16-512 image
        // on an H200 (`vit_bench -- b16-512 gpu 30 coop tiled profile`, before the softmax's
        // bank-conflict fix).
        let query_subgroups = 4;
        let mx = options.mx_weights;
        if let Some(format) = mx
            && coop
        {
            let inner = [pp, h, c.intermediate, h * c.scale_factor * c.scale_factor];
            if let Some(k) = inner.iter().find(|k| !k.is_multiple_of(32)) {
                return Err(GpuVisionError::Invalid(format!(
                    "{format:?} weights on the tensor-core path need every GEMM's inner size \
                     to be a multiple of 32 (whole MX blocks); this tower has {k}"
                )));
            }
        }
        // Pipeline index = position in KERNEL_NAMES: the f32 module's entry points, the
        // register GEMM's modules (one per weight format in use), the tensor-core module's
        // (coop only).
        let mut pipelines: Vec<Option<wgpu::ComputePipeline>> = vec![None; KERNEL_NAMES.len()];
        let mut compile =
            |module: &wgpu::ShaderModule, first: usize, count: usize, zero_workgroup: bool| {
                for (index, entry) in KERNEL_NAMES.iter().enumerate().skip(first).take(count) {
                    let pipeline =
                        device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                            label: Some(entry),
                            layout: None,
                            module,
                            entry_point: Some(entry),
                            compilation_options: wgpu::PipelineCompilationOptions {
                                zero_initialize_workgroup_memory: zero_workgroup,
                                ..Default::default()
                            },
                            cache: None,
                        });
                    pipelines[index] = Some(pipeline);
                }
            };
        let f32_module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("vit"),
            source: wgpu::ShaderSource::Wgsl(SHADER.into()),
        });
        compile(&f32_module, 0, LINEAR_REG, true);
        if options.gemm == GemmKernel::RegisterF16
            && !device.features().contains(wgpu::Features::SHADER_F16)
        {
            return Err(GpuVisionError::Unsupported(
                "the f16-weight GEMM needs a device opened with SHADER_F16",
            ));
        }
        let register_gemms = [
            Some((RegisterWeights::F32, LINEAR_REG)),
            (options.gemm == GemmKernel::RegisterF16)
                .then_some((RegisterWeights::F16, LINEAR_REG_F16)),
            mx.map(|format| (RegisterWeights::Mx(format), LINEAR_REG_MX)),
        ];
        for (weights, index) in register_gemms.into_iter().flatten() {
            let (source, entry) = register_gemm_source(weights);
            debug_assert_eq!(entry, KERNEL_NAMES[index]);
            let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(entry),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            });
            compile(&module, index, 1, true);
        }
        if coop {
            // Both tensor-core modules are built without runtime checks. Why that is sound:
            // `create_shader_module_trusted` drops the bounds checks (and loop bounding) naga
            // would add; an out-of-bounds access would then be undefined behaviour on the
            // device. Every dispatch of these modules is
            // built below from the tower's validated sizes, for buffers allocated from the same
            // sizes (times the batch; a per-image dispatch is bound to exactly its image's
            // share), and each meets its kernel's stated contract (vit_coop.wgsl): `gemm_coop`
            // (and `gemm_coop_wide`, the same kernel with other tile constants) clamps its tile
            // loads to rows < m and n and columns < k, and runs only when coop_fits holds (n a
            // multiple of 8, k of 4; with MX weights, codes for n x k elements plus the spare
            // word `mx_load4` reads, scales for them, and k a multiple of 32, checked above);
            // A split-k dispatch (`gemm_split`) has z k_chunk < k for every z (its slice count is
            // k / k_chunk rounded up) and writes plane z < split of a buffer of split * m * h
            // values (checked against the binding limit above; its n is h).
            // `attention_coop` reads rows < n of an n x 3h buffer and runs only when n is a
            // multiple of 64 (= 16 * QSUB); `layer_norm_f16` and `layer_norm_add_f16` (their
            // registers written out for this tower's width h, a multiple of 8 by coop_fits,
            // and run only at that width; the latter reads the planes a split-k dispatch wrote,
            // ln_p.w of them, and h bias values) and `to_f16` guard their indices against the
            // lengths they are given. Workgroup memory is not zeroed: each kernel writes what it
            // reads first.
            let trusted = |label: &str, source: String| {
                // SAFETY: only the two coop_source modules below go through here, and their
                // kernels meet the contracts listed above.
                unsafe {
                    device.create_shader_module_trusted(
                        wgpu::ShaderModuleDescriptor {
                            label: Some(label),
                            source: wgpu::ShaderSource::Wgsl(source.into()),
                        },
                        wgpu::ShaderRuntimeChecks::unchecked(),
                    )
                }
            };
            let module = trusted("vit coop", coop_source(tile, query_subgroups, h, mx));
            compile(&module, TO_F16, LINEAR_REG_MX - TO_F16, false);
            compile(&module, LAYER_NORM_ADD_F16, 1, false);
            if let Some(wide) = coop_gemms.wide {
                let source = coop_source(wide, query_subgroups, h, mx)
                    .replace("fn gemm_coop(", "fn gemm_coop_wide(");
                let module = trusted("vit coop wide GEMM", source);
                compile(&module, GEMM_COOP_WIDE, 1, false);
            }
        }
        if fragments {
            pipelines[ATTENTION_FRAGMENTS] = Some(fragment_attention_pipeline(device));
        }
        let pipelines = pipelines;
        let upload = |label: &str, data: &[f32]| {
            device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents: bytemuck::cast_slice(data),
                usage: wgpu::BufferUsages::STORAGE,
            })
        };
        let upload_f16 = |label: &str, data: &[f32]| {
            let bits: Vec<u16> = data
                .iter()
                .map(|&v| half::f16::from_f32(v).to_bits())
                .collect();
            device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents: bytemuck::cast_slice(&bits),
                usage: wgpu::BufferUsages::STORAGE,
            })
        };
        // COPY_SRC so a caller can read any stage back (`pipeline encode --stage vision`).
        let scratch_bytes = |label: &str, bytes: usize| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: (bytes.max(4) as u64).next_multiple_of(4),
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            })
        };
        let scratch = |label: &str, elems: usize| scratch_bytes(label, elems * 4);
        let scratch_f16 = |label: &str, elems: usize| scratch_bytes(label, elems * 2);
        let uniform = |data: &[u32]| {
            device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: None,
                contents: bytemuck::cast_slice(data),
                usage: wgpu::BufferUsages::UNIFORM,
            })
        };
        let bind = |pipeline: usize, buffers: &[&wgpu::Buffer]| {
            let built = pipelines[pipeline].as_ref().expect("the module was built");
            bind_buffers(device, built, buffers)
        };
        // A GEMM weight (rows x cols, row-major) as the kernel that reads it wants it: MX when
        // asked for and the rows are whole blocks; else f16 for the tensor-core GEMM
        // (`tensor_cores`) and for the f16-weight GEMM (as `pipeline_for` picks it), f32 for
        // the other f32 GEMMs.
        let weight = |label: &str,
                      data: &[f32],
                      cols: usize,
                      tensor_cores: bool|
         -> Result<GpuWeight, GpuVisionError> {
            match mx {
                Some(format) if cols.is_multiple_of(32) => {
                    let mx_error = |e: mx_quant::Error| {
                        GpuVisionError::Invalid(format!("{label} as {format:?}: {e}"))
                    };
                    let (scales, packed) =
                        crate::vision::quantize_mx(format, data).map_err(mx_error)?;
                    let words = |what: &str, words: Vec<u32>| {
                        device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                            label: Some(&format!("{label} {what}")),
                            contents: bytemuck::cast_slice(&words),
                            usage: wgpu::BufferUsages::STORAGE,
                        })
                    };
                    Ok(GpuWeight::Mx {
                        codes: words("codes", mx_quant::wgsl::code_words(&packed)),
                        scales: words("scales", mx_quant::wgsl::words(&scales)),
                    })
                }
                _ if tensor_cores => Ok(GpuWeight::Plain(upload_f16(label, data))),
                // The f16-weight GEMM takes the matrices it can (k a multiple of 4, as
                // `pipeline_for` decides); the others stay f32 for `Small`.
                _ if options.gemm == GemmKernel::RegisterF16 && cols.is_multiple_of(4) => {
                    Ok(GpuWeight::Plain(upload_f16(label, data)))
                }
                _ => Ok(GpuWeight::Plain(upload(label, data))),
            }
        };
        let no_bias = upload("no bias", &[0.0]);
        let patches = scratch("patches", m * pp);
        let x = scratch("x", m * h);
        let vision_out = scratch("vision out", m * h);
        let shuffled = scratch("shuffled", batch * tokens * h * f2);
        let bind_image = |pipeline: usize, slices: &[Slice<'_>]| {
            let built = pipelines[pipeline].as_ref().expect("the module was built");
            bind_slices(device, built, slices)
        };
        let mut body = Vec::new();
        let eps = c.layer_norm_eps.to_bits();
        // A LayerNorm of x's rows into `dst`, f32 or (coop) f16.
        let norm = |body: &mut Vec<Dispatch>,
                    src: &wgpu::Buffer,
                    (w, b): (&wgpu::Buffer, &wgpu::Buffer),
                    dst: &wgpu::Buffer,
                    f16_out: bool| {
            let params = uniform(&[m as u32, h as u32, eps, 0]);
            let (pipeline, groups) = if f16_out {
                (LAYER_NORM_F16, m.div_ceil(4) as u32)
            } else {
                (LAYER_NORM, m as u32)
            };
            body.push(Dispatch {
                pipeline,
                bind: bind(pipeline, &[src, w, b, dst, &params]),
                groups: (groups, 1, 1),
            });
        };
        // A tensor-core GEMM: x (m x k f16) times w16 (n x k f16) into y (f32 or f16 pairs).
        let gemm = |body: &mut Vec<Dispatch>,
                    x16: &wgpu::Buffer,
                    w: &GpuWeight,
                    b: Option<&wgpu::Buffer>,
                    y: &wgpu::Buffer,
                    (m, nn, kk): (usize, usize, usize),
                    flags: u32| {
            debug_assert!(
                nn.is_multiple_of(8) && kk.is_multiple_of(4),
                "gemm_coop contract"
            );
            let flags = flags | if b.is_some() { GEMM_BIAS } else { 0 };
            let params = uniform(&[m as u32, nn as u32, kk as u32, flags, kk as u32, 0, 0, 0]);
            let (pipeline, tile) = coop_gemms.pick(m, nn);
            body.push(Dispatch {
                pipeline,
                bind: bind(pipeline, &w.bind(x16, b.unwrap_or(&no_bias), y, &params)),
                groups: CoopGemms::groups(tile, m, nn),
            });
        };
        // A residual tensor-core GEMM split over k into `splits` slices: plane z of `parts`
        // gets slice z's product (no bias; `norm_add` adds the planes and the bias into x).
        let gemm_split = |body: &mut Vec<Dispatch>,
                          x16: &wgpu::Buffer,
                          w: &GpuWeight,
                          parts: &wgpu::Buffer,
                          (m, nn, kk): (usize, usize, usize),
                          splits: usize|
         -> usize {
            // Slices of whole BK = 32 steps, none of them empty (the kernel's contract): at
            // most `splits`, fewer where k is short.
            let chunk = kk.div_ceil(splits).next_multiple_of(32);
            let splits = kk.div_ceil(chunk);
            let params = uniform(&[m as u32, nn as u32, kk as u32, 0, chunk as u32, 0, 0, 0]);
            let (pipeline, tile) = coop_gemms.pick(m, nn);
            let (gx, gy, _) = CoopGemms::groups(tile, m, nn);
            body.push(Dispatch {
                pipeline,
                bind: bind(pipeline, &w.bind(x16, &no_bias, parts, &params)),
                groups: (gx, gy, splits as u32),
            });
            splits
        };
        // x += b + the planes of `parts`, then the LayerNorm of x into `dst` (f16).
        let norm_add = |body: &mut Vec<Dispatch>,
                        (parts, splits, bias): (&wgpu::Buffer, usize, &wgpu::Buffer),
                        (w, b): (&wgpu::Buffer, &wgpu::Buffer),
                        dst: &wgpu::Buffer| {
            let params = uniform(&[m as u32, h as u32, eps, splits as u32]);
            body.push(Dispatch {
                pipeline: LAYER_NORM_ADD_F16,
                bind: bind(LAYER_NORM_ADD_F16, &[&x, w, b, dst, &params, parts, bias]),
                groups: (m.div_ceil(4) as u32, 1, 1),
            });
        };
        // An f32 GEMM with the kernel `options` chose.
        let linear = |body: &mut Vec<Dispatch>,
                      x: &wgpu::Buffer,
                      w: &GpuWeight,
                      b: Option<&wgpu::Buffer>,
                      y: &wgpu::Buffer,
                      (m, nn, kk): (usize, usize, usize),
                      flags: u32| {
            let flags = flags | u32::from(b.is_some());
            let params = uniform(&[m as u32, nn as u32, kk as u32, flags]);
            let (pipeline, tile) = w.f32_pipeline(options.gemm, kk);
            body.push(Dispatch {
                pipeline,
                bind: bind(pipeline, &w.bind(x, b.unwrap_or(&no_bias), y, &params)),
                groups: ((nn as u32).div_ceil(tile), (m as u32).div_ceil(tile), 1),
            });
        };
        let positions = upload("positions", &cpu.positions);
        let add_params = uniform(&[(n * h) as u32, 0, 0, 0]);
        let add_positions: Vec<Dispatch> = (0..batch)
            .map(|i| Dispatch {
                pipeline: ADD,
                bind: bind_image(
                    ADD,
                    &[
                        whole(&positions),
                        share_of(&x, i, n * h, 4),
                        whole(&add_params),
                    ],
                ),
                groups: groups_1d((n * h) as u32),
            })
            .collect();
        let b_patch = upload("patch b", &cpu.patch.1);
        // The f16 input of the GEMMs that read f32 (the patch embedding and the connector).
        let gemm_in16 =
            coop.then(|| scratch_f16("gemm input f16", batch * (n * pp).max(tokens * h * f2)));
        if let Some(x16) = &gemm_in16 {
            let len = uniform(&[(m * pp) as u32, 0, 0, 0]);
            body.push(Dispatch {
                pipeline: TO_F16,
                bind: bind(TO_F16, &[&patches, x16, &len]),
                groups: groups_1d((m * pp) as u32),
            });
            let w = weight("patch w", cpu.patch.0.data(), pp, true)?;
            gemm(&mut body, x16, &w, Some(&b_patch), &x, (m, h, pp), 0);
            body.extend(add_positions);
            // Per layer: LN -> QKV (f16) -> attention (f16) -> O (+x) -> LN -> fc1+GELU (f16)
            // -> fc2 (+x). The attention output reuses the LN output's buffer, which the QKV
            // GEMM has consumed by then.
            let xn16 = scratch_f16("x normed f16", m * h);
            let qkv16 = scratch_f16("qkv f16", m * 3 * h);
            let mid16 = scratch_f16("mlp f16", m * c.intermediate);
            let attn_params = uniform(&[
                n as u32,
                c.heads as u32,
                hd as u32,
                h as u32,
                (std::f32::consts::LOG2_E / (hd as f32).sqrt()).to_bits(),
                0,
                0,
                0,
            ]);
            // Split-k residual GEMMs write their planes here; the LayerNorm after each adds
            // them and the GEMM's bias into x. `pending`: an fc2's planes (the buffer, how many)
            // and bias, for the next layer's first LayerNorm.
            let parts = (split > 1).then(|| scratch("split-k planes", split * m * h));
            let mut pending: Option<(&wgpu::Buffer, usize, wgpu::Buffer)> = None;
            let layers = cpu.layers.len();
            for (i, l) in cpu.layers.iter().enumerate() {
                let up = |name: &str, d: &[f32]| upload(&format!("layer {i} {name}"), d);
                let w = |name: &str, d: &[f32], cols: usize| {
                    weight(&format!("layer {i} {name}"), d, cols, true)
                };
                let (ln1w, ln1b) = (up("ln1 w", &l.ln1.0), up("ln1 b", &l.ln1.1));
                let (ln2w, ln2b) = (up("ln2 w", &l.ln2.0), up("ln2 b", &l.ln2.1));
                // Q, K and V as one n x 3h GEMM: their weights stacked by rows.
                let qkv_w: Vec<f32> = [&l.q.0, &l.k.0, &l.v.0]
                    .iter()
                    .flat_map(|m| m.data().iter().copied())
                    .collect();
                let qkv_b: Vec<f32> = [&l.q.1, &l.k.1, &l.v.1]
                    .iter()
                    .flat_map(|b| b.iter().copied())
                    .collect();
                let (qkv_w, qkv_b) = (w("qkv w", &qkv_w, h)?, up("qkv b", &qkv_b));
                let (ow, ob) = (w("o w", l.o.0.data(), h)?, up("o b", &l.o.1));
                let (f1w, f1b) = (w("fc1 w", l.fc1.0.data(), h)?, up("fc1 b", &l.fc1.1));
                let inter = c.intermediate;
                let (f2w, f2b) = (w("fc2 w", l.fc2.0.data(), inter)?, up("fc2 b", &l.fc2.1));
                match pending.take() {
                    Some((parts, planes, bias)) => {
                        norm_add(&mut body, (parts, planes, &bias), (&ln1w, &ln1b), &xn16);
                    }
                    None => norm(&mut body, &x, (&ln1w, &ln1b), &xn16, true),
                }
                let qkv_shape = (m, 3 * h, h);
                gemm(
                    &mut body,
                    &xn16,
                    &qkv_w,
                    Some(&qkv_b),
                    &qkv16,
                    qkv_shape,
                    GEMM_F16_OUT,
                );
                let attention = if fragments {
                    ATTENTION_FRAGMENTS
                } else {
                    ATTENTION_COOP
                };
                for i in 0..batch {
                    let qkv = share_of(&qkv16, i, n * 3 * h, 2);
                    body.push(Dispatch {
                        pipeline: attention,
                        bind: bind_image(
                            attention,
                            &[qkv, share_of(&xn16, i, n * h, 2), whole(&attn_params), qkv],
                        ),
                        groups: ((n / (16 * query_subgroups)) as u32, c.heads as u32, 1),
                    });
                }
                if let Some(parts) = &parts {
                    let planes = gemm_split(&mut body, &xn16, &ow, parts, (m, h, h), split);
                    norm_add(&mut body, (parts, planes, &ob), (&ln2w, &ln2b), &xn16);
                } else {
                    gemm(
                        &mut body,
                        &xn16,
                        &ow,
                        Some(&ob),
                        &x,
                        (m, h, h),
                        GEMM_RESIDUAL,
                    );
                    norm(&mut body, &x, (&ln2w, &ln2b), &xn16, true);
                }
                let fc1_shape = (m, c.intermediate, h);
                gemm(
                    &mut body,
                    &xn16,
                    &f1w,
                    Some(&f1b),
                    &mid16,
                    fc1_shape,
                    GEMM_GELU | GEMM_F16_OUT,
                );
                let fc2_shape = (m, h, c.intermediate);
                // The last fc2 adds into x itself: the post-LayerNorm (f32) adds no planes.
                match &parts {
                    Some(parts) if i + 1 < layers => {
                        let planes = gemm_split(&mut body, &mid16, &f2w, parts, fc2_shape, split);
                        pending = Some((parts, planes, f2b));
                    }
                    _ => gemm(
                        &mut body,
                        &mid16,
                        &f2w,
                        Some(&f2b),
                        &x,
                        fc2_shape,
                        GEMM_RESIDUAL,
                    ),
                }
            }
        } else {
            let w_patch = weight("patch w", cpu.patch.0.data(), pp, false)?;
            linear(
                &mut body,
                &patches,
                &w_patch,
                Some(&b_patch),
                &x,
                (m, h, pp),
                0,
            );
            body.extend(add_positions);
            let xn = scratch("x normed", m * h);
            let (q, k, v, a) = (
                scratch("q", m * h),
                scratch("k", m * h),
                scratch("v", m * h),
                scratch("attention", m * h),
            );
            let mid = scratch("mlp", m * c.intermediate);
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
            for (i, l) in cpu.layers.iter().enumerate() {
                let up = |name: &str, d: &[f32]| upload(&format!("layer {i} {name}"), d);
                let (ln1w, ln1b) = (up("ln1 w", &l.ln1.0), up("ln1 b", &l.ln1.1));
                let (ln2w, ln2b) = (up("ln2 w", &l.ln2.0), up("ln2 b", &l.ln2.1));
                let lin = |name: &str, (w, b): &(npu_hal::DenseMatrix, Vec<f32>)| {
                    let label = format!("layer {i} {name} w");
                    Ok::<_, GpuVisionError>((
                        weight(&label, w.data(), w.shape().1, false)?,
                        up(&format!("{name} b"), b),
                    ))
                };
                let (qw, qb) = lin("q", &l.q)?;
                let (kw, kb) = lin("k", &l.k)?;
                let (vw, vb) = lin("v", &l.v)?;
                let (ow, ob) = lin("o", &l.o)?;
                let (f1w, f1b) = lin("fc1", &l.fc1)?;
                let (f2w, f2b) = lin("fc2", &l.fc2)?;
                norm(&mut body, &x, (&ln1w, &ln1b), &xn, false);
                linear(&mut body, &xn, &qw, Some(&qb), &q, (m, h, h), 0);
                linear(&mut body, &xn, &kw, Some(&kb), &k, (m, h, h), 0);
                linear(&mut body, &xn, &vw, Some(&vb), &v, (m, h, h), 0);
                // The tiled kernel keeps 16 x head_dim of Q, K and V in workgroup memory: up to 64.
                let (pipeline, per_group) =
                    if hd <= 64 && options.attention == AttentionKernel::Tiled {
                        (ATTENTION_TILED, 16)
                    } else {
                        (ATTENTION, 64)
                    };
                for i in 0..batch {
                    let share = |b| share_of(b, i, n * h, 4);
                    body.push(Dispatch {
                        pipeline,
                        bind: bind_image(
                            pipeline,
                            &[
                                share(&q),
                                share(&k),
                                share(&v),
                                share(&a),
                                whole(&attn_params),
                            ],
                        ),
                        groups: ((n as u32).div_ceil(per_group), c.heads as u32, 1),
                    });
                }
                linear(&mut body, &a, &ow, Some(&ob), &x, (m, h, h), 4);
                norm(&mut body, &x, (&ln2w, &ln2b), &xn, false);
                let fc1_shape = (m, c.intermediate, h);
                linear(&mut body, &xn, &f1w, Some(&f1b), &mid, fc1_shape, 2);
                let fc2_shape = (m, h, c.intermediate);
                linear(&mut body, &mid, &f2w, Some(&f2b), &x, fc2_shape, 4);
            }
        }
        let (pw, pb) = (
            upload("post ln w", &cpu.post_ln.0),
            upload("post ln b", &cpu.post_ln.1),
        );
        norm(&mut body, &x, (&pw, &pb), &vision_out, false);
        let shuffle_params = uniform(&[side as u32, h as u32, c.scale_factor as u32, 0]);
        let shuffle_binds = (0..batch)
            .map(|i| {
                bind_image(
                    SHUFFLE,
                    &[
                        share_of(&vision_out, i, n * h, 4),
                        share_of(&shuffled, i, tokens * h * f2, 4),
                        whole(&shuffle_params),
                    ],
                )
            })
            .collect();
        // The connector's projection: on tensor cores when its sizes fit the GEMM's contract.
        let projection_fits = c.text_hidden.is_multiple_of(8) && (h * f2).is_multiple_of(4);
        let projection = match gemm_in16.filter(|_| projection_fits) {
            Some(x16) => Projection::Coop {
                w: weight("projection", cpu.projection.data(), h * f2, true)?,
                x16,
                len: uniform(&[(batch * tokens * h * f2) as u32, 0, 0, 0]),
            },
            None => Projection::F32(weight("projection", cpu.projection.data(), h * f2, false)?),
        };
        // Also `gemm_coop`'s (which reads k_chunk = k after the flags).
        let projection_params = uniform(&[
            (batch * tokens) as u32,
            c.text_hidden as u32,
            (h * f2) as u32,
            0,
            (h * f2) as u32,
            0,
            0,
            0,
        ]);
        let im2col_params = uniform(&[side as u32, c.patch_size as u32, c.image_size as u32, 0]);
        Ok(GpuVisionEncoder {
            config: c,
            batch,
            pipelines,
            options,
            coop_gemms,
            body,
            patches,
            vision_out,
            shuffled,
            projection,
            im2col_params,
            projection_params,
            shuffle_binds,
            no_bias,
        })
    }

    /// Pipeline `index` (KERNEL_NAMES); every index a dispatch uses was built by `with_options`.
    fn pipeline(&self, index: usize) -> &wgpu::ComputePipeline {
        self.pipelines[index]
            .as_ref()
            .expect("dispatches only use pipelines with_options built")
    }

    /// The kernels this encoder runs (after any fallback `with_options` made).
    pub fn options(&self) -> GpuVisionOptions {
        self.options
    }

    /// The shape.
    pub fn config(&self) -> &VisionConfig {
        &self.config
    }

    /// Images per encode ([`GpuVisionEncoder::with_batch`]; 1 otherwise).
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Bytes the output buffer needs: `image_tokens x text_hidden` f32 per image of the batch.
    pub fn output_bytes(&self) -> u64 {
        (self.batch * self.config.image_tokens() * self.config.text_hidden * 4) as u64
    }

    /// The tower's last hidden state buffer (`patches x hidden` f32 per image of the batch),
    /// valid after a recorded encode has run; for callers (and tests) that want the vision
    /// features themselves.
    pub fn vision_output(&self) -> &wgpu::Buffer {
        &self.vision_out
    }

    /// Records one encode of the batch into `encoder`: `pixels` holds `3 x image_size x
    /// image_size` f32 per image (CHW, normalised, as the ISP writes it), `out` receives the
    /// connector's output, image after image.
    ///
    /// # Errors
    /// [`GpuVisionError::BufferTooSmall`] when `pixels` or `out` is smaller than the encode reads or writes
    /// ([`GpuVisionEncoder::input_bytes`], [`GpuVisionEncoder::output_bytes`]): the tensor-core
    /// module runs without bounds checks, so a short buffer is refused before it is bound.
    pub fn record(
        &self,
        device: &wgpu::Device,
        encoder: &mut wgpu::CommandEncoder,
        pixels: &wgpu::Buffer,
        out: &wgpu::Buffer,
    ) -> Result<(), GpuVisionError> {
        self.record_profiled(device, encoder, pixels, out, None)
    }

    /// Bytes of the input tensor an encode reads (`3 x image_size x image_size` f32 per image).
    pub fn input_bytes(&self) -> u64 {
        let s = self.config.image_size as u64;
        3 * s * s * 4 * self.batch as u64
    }

    /// Refuses buffers smaller than the encode reads or writes.
    fn check_io(&self, pixels: &wgpu::Buffer, out: &wgpu::Buffer) -> Result<(), GpuVisionError> {
        for (what, buffer, needed) in [
            ("input", pixels, self.input_bytes()),
            ("output", out, self.output_bytes()),
        ] {
            if buffer.size() < needed {
                return Err(GpuVisionError::BufferTooSmall {
                    what,
                    bytes: buffer.size(),
                    needed,
                });
            }
        }
        Ok(())
    }

    /// The kernel each dispatch of [`GpuVisionEncoder::record`] runs, in order.
    pub fn dispatch_kernels(&self) -> Vec<&'static str> {
        let c = &self.config;
        let k = c.hidden * c.scale_factor * c.scale_factor;
        let projection = match &self.projection {
            Projection::Coop { .. } => vec![
                TO_F16,
                self.coop_gemms
                    .pick(self.batch * c.image_tokens(), c.text_hidden)
                    .0,
            ],
            Projection::F32(w) => vec![w.f32_pipeline(self.options.gemm, k).0],
        };
        std::iter::repeat_n(IM2COL, self.batch)
            .chain(self.body.iter().map(|d| d.pipeline))
            .chain(std::iter::repeat_n(SHUFFLE, self.batch))
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
    ) -> Result<(), GpuVisionError> {
        self.check_io(pixels, out)?;
        let c = &self.config;
        let side = c.patches_per_side();
        let n = side * side;
        let pp = 3 * c.patch_size * c.patch_size;
        let bind = |pipeline: usize, buffers: &[&wgpu::Buffer]| {
            bind_buffers(device, self.pipeline(pipeline), buffers)
        };
        let s = c.image_size;
        let im2col: Vec<wgpu::BindGroup> = (0..self.batch)
            .map(|i| {
                let slices = [
                    share_of(pixels, i, 3 * s * s, 4),
                    share_of(&self.patches, i, n * pp, 4),
                    whole(&self.im2col_params),
                ];
                bind_slices(device, self.pipeline(IM2COL), &slices)
            })
            .collect();
        let batch_tokens = self.batch * c.image_tokens();
        let f2 = c.scale_factor * c.scale_factor;
        // The connector's projection: on tensor cores (convert, then multiply) or in f32.
        let width = c.text_hidden;
        let project: Vec<(usize, wgpu::BindGroup, (u32, u32, u32))> = match &self.projection {
            Projection::Coop { w, x16, len } => {
                let (pipeline, tile) = self.coop_gemms.pick(batch_tokens, width);
                let gemm_bind = bind(
                    pipeline,
                    &w.bind(x16, &self.no_bias, out, &self.projection_params),
                );
                vec![
                    (
                        TO_F16,
                        bind(TO_F16, &[&self.shuffled, x16, len]),
                        groups_1d((batch_tokens * c.hidden * f2) as u32),
                    ),
                    (
                        pipeline,
                        gemm_bind,
                        CoopGemms::groups(tile, batch_tokens, width),
                    ),
                ]
            }
            Projection::F32(w) => {
                let (pipeline, tile) = w.f32_pipeline(self.options.gemm, c.hidden * f2);
                let buffers = w.bind(&self.shuffled, &self.no_bias, out, &self.projection_params);
                vec![(
                    pipeline,
                    bind(pipeline, &buffers),
                    (
                        (width as u32).div_ceil(tile),
                        (batch_tokens as u32).div_ceil(tile),
                        1,
                    ),
                )]
            }
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
            pass.set_pipeline(self.pipeline(pipeline));
            pass.set_bind_group(0, bind, &[]);
            pass.dispatch_workgroups(x, y, z);
            if let Some(q) = timestamps {
                written += 1;
                pass.write_timestamp(q, written);
            }
        };
        for bind in &im2col {
            run(IM2COL, bind, groups_1d((n * pp) as u32));
        }
        for d in &self.body {
            run(d.pipeline, &d.bind, d.groups);
        }
        for bind in &self.shuffle_binds {
            run(
                SHUFFLE,
                bind,
                groups_1d((c.image_tokens() * c.hidden * f2) as u32),
            );
        }
        for (pipeline, bind, groups) in &project {
            run(*pipeline, bind, *groups);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{CoopTile, check_fragment_layout, coop_source};

    /// Each committed SPIR-V module was built from the GLSL as it stands: `build.sh` recorded
    /// each source's SHA-256, and editing a source without rebuilding fails here.
    #[test]
    fn glsl_spirv_is_built_from_its_sources() {
        use sha2::Digest;
        let sources = [
            (
                "attention_fragments.comp",
                include_str!("shaders/glsl/attention_fragments.comp"),
            ),
            (
                "fragment_probe.comp",
                include_str!("shaders/glsl/fragment_probe.comp"),
            ),
        ];
        let record = include_str!("shaders/glsl/SOURCES.sha256");
        let mut checked = 0;
        for line in record.lines() {
            let mut parts = line.split_whitespace();
            let (Some(hash), Some(name), Some(source)) = (parts.next(), parts.next(), parts.next())
            else {
                panic!("SOURCES.sha256 line {line:?}");
            };
            let text = sources
                .iter()
                .find(|(s, _)| *s == source)
                .map(|(_, t)| t)
                .unwrap_or_else(|| panic!("{name} names an unknown source {source}"));
            let got: String = sha2::Sha256::digest(text.as_bytes())
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            assert_eq!(
                got, hash,
                "{source} changed since {name}.spv was built: run build.sh"
            );
            checked += 1;
        }
        assert_eq!(checked, sources.len());
        for spirv in [super::ATTENTION_FRAGMENTS_SPV, super::FRAGMENT_PROBE_SPV] {
            assert_eq!(spirv[..4], 0x0723_0203u32.to_le_bytes());
        }
    }

    /// The fragment probe's output for a layout, as `fragment_probe.comp` writes it: position
    /// (row, col) holds lane * 64 + element.
    fn probe_output(place: impl Fn(usize, usize) -> (usize, usize)) -> Vec<f32> {
        let mut values = vec![f32::NAN; 257];
        for lane in 0..32 {
            for element in 0..8 {
                let (row, col) = place(lane, element);
                values[row * 16 + col] = (lane * 64 + element) as f32;
            }
        }
        values[256] = 8.0;
        values
    }

    /// NVIDIA's mma.m16n8k16 accumulator, two 8-column halves: lane l holds rows l / 4 and
    /// l / 4 + 8, columns 2 (l % 4) + {0, 1} of each half.
    fn nvidia(lane: usize, element: usize) -> (usize, usize) {
        let row = lane / 4 + 8 * ((element / 2) % 2);
        let col = 2 * (lane % 4) + element % 2 + 8 * (element / 4);
        (row, col)
    }

    #[test]
    fn the_fragment_layout_check_takes_nvidias_and_refuses_others() {
        check_fragment_layout(&probe_output(nvidia)).unwrap();
        // Each lane's 8 elements in one row: lanes 2r and 2r + 1 share row r, which the
        // kernel's shuffles over groups of 4 would mix with row r + 1.
        let rowwise = probe_output(|lane, element| (lane / 2, 8 * (lane % 2) + element));
        assert!(check_fragment_layout(&rowwise).is_err());
        // Column-major: a lane's elements spread over 8 rows.
        let transposed = probe_output(|lane, element| {
            let (row, col) = nvidia(lane, element);
            (col, row)
        });
        assert!(check_fragment_layout(&transposed).is_err());
        // Another element count, and a position written twice.
        let mut count = probe_output(nvidia);
        count[256] = 4.0;
        assert!(check_fragment_layout(&count).is_err());
        let mut twice = probe_output(nvidia);
        twice[1] = twice[0];
        assert!(check_fragment_layout(&twice).is_err());
        assert!(check_fragment_layout(&[0.0; 12]).is_err());
    }

    /// The generated tensor-core module parses and validates for every blocking the README
    /// measures, with f16 and MX weights: CI's lavapipe has no cooperative matrices, so this is
    /// where a bad substitution shows before an H200 run.
    #[test]
    fn every_coop_tile_builds_a_valid_module() {
        for tile in [
            "64x64/2x2",
            "64x64/2x2/p2",
            "64x64/2x2/p4",
            "128x64/2x2",
            "128x128/4x4",
            "128x128/4x2/p4",
            "64x64/2x2/p8",
            "64x64/2x2/p2/pairs",
            "64x64/2x2/p4/pairs",
            "128x128/4x2/p4/pairs",
        ] {
            let tile = CoopTile::parse(tile).unwrap();
            for mx in [None, Some(mx_quant::ElemFormat::Fp4E2M1)] {
                let source = coop_source(tile, 4, 768, mx);
                let last = format!(
                    "c{0}_{1} = coopMultiplyAdd(a{0}, b{1}",
                    tile.tiles_m - 1,
                    tile.tiles_n - 1
                );
                assert!(
                    source.contains(&last),
                    "{tile:?}: the products are not written out"
                );
                let module = naga::front::wgsl::parse_str(&source)
                    .unwrap_or_else(|e| panic!("{tile:?}: {}", e.emit_to_string(&source)));
                naga::valid::Validator::new(
                    naga::valid::ValidationFlags::all(),
                    naga::valid::Capabilities::all(),
                )
                .validate(&module)
                .unwrap_or_else(|e| panic!("{tile:?} {mx:?}: {e:?}"));
            }
        }
    }

    #[test]
    fn coop_tiles_that_cannot_be_built_are_refused_by_name() {
        for bad in [
            "64x64",
            "64x64/3x2",
            "48x64/2x2",
            "256x256/2x2",
            "64x64/0x1",
            "axb/2x2",
            "64x64/2x2/p3",
            "64x64/2x2/px",
            "64x64/2x2/pairs",
            "64x64/2x2/pairs/p4",
        ] {
            let err = CoopTile::parse(bad).unwrap_err();
            assert!(err.contains(bad), "{err}");
        }
    }
}
