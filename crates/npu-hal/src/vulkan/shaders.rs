//! The decoder's kernels: WGSL modules assembled per variant (weight format, KV dtype, tokens
//! per GEMV), compiled to SPIR-V with naga (the compiler wgpu uses, so no shader toolchain is
//! needed at build or run time), and turned into compute pipelines on first use.
//!
//! Every kernel reads the step buffer at binding 0 and takes its per-op constants as push
//! constants ([`PUSH_BYTES`](super::gpu::PUSH_BYTES) at most). Storage accesses are bounds-
//! checked by naga's `Restrict` policy, so a kernel cannot reach outside the buffers bound to it
//! whatever the step values say.

use std::collections::HashMap;

use ash::vk;
use mx_quant::ElemFormat;

use super::gpu::{Context, PUSH_BYTES, vk_err};
use crate::Error;

const COMMON: &str = include_str!("shaders/common.wgsl");
/// Invocations per output row the GEMV kernel can take ([`crate::VulkanConfig::gemv_lanes`]).
pub(crate) const GEMV_LANES: [u32; 6] = [8, 16, 32, 64, 128, 256];
/// The rows per lane group a one-token GEMV takes ([`Kernel::Gemv`]'s `rows`).
pub(crate) const GEMV_ROWS: [u32; 4] = [1, 2, 4, 8];
const WEIGHTS: &str = include_str!("shaders/weights.wgsl");
const RMS_NORM: &str = include_str!("shaders/rms_norm.wgsl");
const LINEAR_IO: &str = include_str!("shaders/linear_io.wgsl");
const GEMV: &str = include_str!("shaders/linear_gemv.wgsl");
const GEMV_ARGMAX: &str = include_str!("shaders/linear_gemv_argmax.wgsl");
/// The GEMV module's `gemv_argmax` where it writes no maxima.
const NO_GEMV_ARGMAX: &str = "const NO_ROW: u32 = 0xffffffffu;\n\
     fn gemv_argmax(lid: u32, sg_size: u32, wg: u32, groups: u32, t0: u32, nt: u32, v: f32, \
     i: u32) {}\n";
const GEMM: &str = include_str!("shaders/linear_gemm.wgsl");
const GEMM_COOP: &str = include_str!("shaders/linear_gemm_coop.wgsl");
const GEMM_STAGE: &str = include_str!("shaders/linear_gemm_stage.wgsl");
const SPLIT_REDUCE: &str = include_str!("shaders/split_reduce.wgsl");
const EMBED: &str = include_str!("shaders/embed.wgsl");
const ELEMENTWISE: &str = include_str!("shaders/elementwise.wgsl");
const ROPE: &str = include_str!("shaders/rope.wgsl");
const ROPE_ANGLE: &str = include_str!("shaders/rope_angle.wgsl");
const KV_COMMON: &str = include_str!("shaders/kv_common.wgsl");
const KV_WRITE: &str = include_str!("shaders/kv_write.wgsl");
const KV_READ: &str = include_str!("shaders/kv_read.wgsl");
const ATTENTION: &str = include_str!("shaders/attention.wgsl");
const ATTENTION_TILED: &str = include_str!("shaders/attention_tiled.wgsl");
const ATTENTION_STATS: &str = include_str!("shaders/attention_stats.wgsl");
/// The attention module's `record_stats` when it keeps no statistics.
const NO_ATTENTION_STATS: &str = "fn record_stats(row: u32, keys: u32, mx: f32, total: f32, \
     lid: u32, first: u32, cached: u32, kvh: u32, kvw: u32) {}\n";
const ROTATE: &str = include_str!("shaders/rotate.wgsl");

/// How a weight matrix is stored on the GPU (see `shaders/weights.wgsl`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum WeightFormat {
    Mx(ElemFormat),
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Q4_1,
}

impl WeightFormat {
    fn code(self) -> u32 {
        match self {
            WeightFormat::Mx(_) => 0,
            WeightFormat::F32 => 1,
            WeightFormat::F16 => 2,
            WeightFormat::Bf16 => 3,
            WeightFormat::Q8_0 => 4,
            WeightFormat::Q4_0 => 5,
            WeightFormat::Q4_1 => 6,
        }
    }
}

/// What a linear kernel reads as its input (see `shaders/linear_io.wgsl`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum LinearInput {
    /// The x tensor.
    Plain,
    /// `rms_norm(x) * gain`: the RMSNorm before it, folded in.
    Norm,
    /// `silu(x) * up`: the SwiGLU before it, folded in.
    SwiGlu,
}

impl LinearInput {
    fn code(self) -> u32 {
        match self {
            LinearInput::Plain => 0,
            LinearInput::Norm => 1,
            LinearInput::SwiGlu => 2,
        }
    }
}

/// How KV pages are stored (kv-paged's dtypes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum KvFormat {
    F32,
    F16,
    Bf16,
    Mx(ElemFormat),
}

impl KvFormat {
    pub(crate) fn of(dtype: kv_paged::PageDtype) -> KvFormat {
        use kv_paged::PageDtype as D;
        match dtype {
            D::F32 => KvFormat::F32,
            D::F16 => KvFormat::F16,
            D::Bf16 => KvFormat::Bf16,
            D::Mxfp8 => KvFormat::Mx(ElemFormat::Fp8E4M3),
            D::Mxfp4 => KvFormat::Mx(ElemFormat::Fp4E2M1),
        }
    }

    fn code(self) -> u32 {
        match self {
            KvFormat::F32 => 0,
            KvFormat::F16 => 1,
            KvFormat::Bf16 => 2,
            KvFormat::Mx(_) => 3,
        }
    }
}

/// One compiled kernel variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Kernel {
    RmsNorm,
    /// A GEMV over up to `tokens` tokens per workgroup row: `lanes` invocations per lane
    /// group, each group taking `rows` neighbouring output rows (256 / `lanes` * `rows` rows per
    /// workgroup; `rows` is above 1 for one-token GEMVs only). `argmax` also writes each
    /// workgroup's largest output per token (`shaders/linear_gemv_argmax.wgsl`), for shapes
    /// [`Kernel::gemv_argmax_fits`] admits.
    Gemv {
        format: WeightFormat,
        tokens: u32,
        lanes: u32,
        rows: u32,
        input: LinearInput,
        accumulate: bool,
        argmax: bool,
    },
    /// A GEMM tiled 64 rows x 64 tokens (`shaders/linear_gemm.wgsl`, or on tensor cores
    /// `shaders/linear_gemm_coop.wgsl`); `split_k` stores each column range's raw sums for
    /// [`Kernel::SplitReduce`] instead of the output.
    Gemm {
        format: WeightFormat,
        input: LinearInput,
        accumulate: bool,
        split_k: bool,
        tensor_cores: bool,
    },
    /// The sum of a split-K GEMM's partial sums, stored or added (`accumulate`) to the output
    /// (`shaders/split_reduce.wgsl`).
    SplitReduce {
        accumulate: bool,
    },
    Embed {
        format: WeightFormat,
    },
    /// A block-rotated copy of a linear layer's input (`shaders/rotate.wgsl`), with the
    /// layer's input stage applied first.
    Rotate {
        input: LinearInput,
    },
    Add,
    SwiGlu,
    Rope,
    /// The KV write, with the rotary embedding of K folded in (`rope`: 0 none, 1 interleaved
    /// pairs, 2 half-split pairs).
    KvWrite {
        kv: KvFormat,
        rope: u32,
    },
    /// Attention for one head size, `workgroup` invocations per (row, head); `rope` is the
    /// pairing (0 none, 1 interleaved, 2 half-split) of the rotary embeddings folded in, of q
    /// (`rope_q`) and of this batch's keys (`rope_k`); `in_batch` reads this batch's keys and
    /// values from the k and v tensors rather than from the pages; `stats` also adds every
    /// key's probability to the attention statistics buffer (binding 8,
    /// `shaders/attention_stats.wgsl`); `splits` > 1 cuts each (row, head)'s keys over that
    /// many workgroups, merged by the last to finish through bindings 9 (partial results) and
    /// 10 (counters), for batches of at most [`SPLIT_ROWS`] rows and without statistics.
    Attention {
        kv: KvFormat,
        head_dim: u32,
        workgroup: u32,
        rope: u32,
        rope_q: bool,
        rope_k: bool,
        in_batch: bool,
        stats: bool,
        splits: u32,
    },
    /// Attention for long batches, tiled (`shaders/attention_tiled.wgsl`): a workgroup per
    /// [`TILED_ATTENTION_ROWS`] rows, head and range of keys (up to `splits` ranges, merged by
    /// the last to finish through bindings 9 and 10); `rope`, `rope_q`, `rope_k` and
    /// `in_batch` as for [`Kernel::Attention`]. No statistics.
    AttentionTiled {
        kv: KvFormat,
        head_dim: u32,
        rope: u32,
        rope_q: bool,
        rope_k: bool,
        in_batch: bool,
        splits: u32,
    },
}

/// Workgroup memory the tensor-core GEMM declares (`shaders/linear_gemm_coop.wgsl`): two
/// buffers each of the W and x tiles (64 rows of 10 vectors of four f16s), the four subgroups'
/// 16x16 f32 scratch, the token count (a vec4), and linear_gemm_stage.wgsl's RMSNorm sums
/// (128 f32s) and 64 inverse norms.
pub(crate) const TENSOR_CORE_GEMM_SHARED_BYTES: u32 =
    2 * 2 * 64 * 10 * 8 + 4 * 256 * 4 + 16 + 128 * 4 + 64 * 4;

/// How [`Kernel::Attention`]'s `workgroup` invocations share the products with V
/// (`shaders/attention.wgsl`): groups of `lanes_per_group` lanes, each lane owning
/// `pairs_per_lane` pairs of output elements, and `groups` such groups taking every
/// `groups`-th key of a block (invocations past the last whole group idle there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AttentionLanes {
    pub lanes_per_group: u32,
    pub groups: u32,
    pub pairs_per_lane: u32,
}

impl AttentionLanes {
    pub(crate) fn new(workgroup: u32, head_dim: u32) -> AttentionLanes {
        let pairs = (head_dim / 2).max(1);
        let lanes_per_group = workgroup.min(pairs);
        AttentionLanes {
            lanes_per_group,
            groups: workgroup / lanes_per_group,
            pairs_per_lane: pairs.div_ceil(lanes_per_group),
        }
    }

    /// Workgroup memory [`Kernel::Attention`] declares: the query, 8 staged keys, the
    /// block's probabilities and two reductions' partial results (`workgroup` each), each
    /// group's output and the merge flag.
    pub(crate) fn shared_bytes(workgroup: u32, head_dim: u32) -> u32 {
        let groups = AttentionLanes::new(workgroup, head_dim).groups;
        4 * (head_dim + 8 * head_dim + 3 * workgroup + groups * head_dim + 1)
    }
}

/// Batch rows a split [`Kernel::Attention`] takes at most (the short-batch bound), which sizes
/// its counters: one per layer, row and query head.
pub(crate) const SPLIT_ROWS: u32 = 8;

/// Batch rows per workgroup of [`Kernel::AttentionTiled`] (its BQ).
pub(crate) const TILED_ATTENTION_ROWS: u32 = 32;

/// Workgroup memory [`Kernel::AttentionTiled`] takes at `head_dim` (its query, key and value
/// tiles, probabilities and partial sums), or `None` when it cannot take that head size (not
/// a multiple of its 8 invocations per row).
pub(crate) fn tiled_attention_shared_bytes(head_dim: u32) -> Option<u32> {
    let (rows, keys, lanes) = (TILED_ATTENTION_ROWS, 32, 8);
    head_dim
        .is_multiple_of(lanes)
        .then(|| 4 * ((rows + 2 * keys) * (head_dim + 1) + rows * (keys + 1) + 2 * rows * lanes))
}

impl Kernel {
    /// Whether a GEMV of `tokens` tokens per workgroup, `lanes` invocations per lane group and
    /// `rows` rows per group writes its maxima (`shaders/linear_gemv_argmax.wgsl`'s contract:
    /// each invocation stores one output at most) where it can: where a workgroup covers at
    /// least 32 rows. With fewer the host's pass over the pairs costs more than a vectorized
    /// scan of the row: on lavapipe at 8 rows a workgroup (its default lanes), SmolLM2-135M's
    /// pick took 50-60 us per token from 6,144 pairs against 15-23 us scanning 49,152 logits
    /// (the bench's `sampling_us`, `NPU_HAL_TIMESTAMPS=0 pipeline bench --model M --device gpu
    /// --n-prompt 0 --n-gen 16 --reps 2`, two alternating rounds, 2026-12-07). The GPU's
    /// output head takes 64 (16 lanes, 4 rows a group): 768 pairs per token.
    pub(crate) fn gemv_argmax_fits(tokens: u32, lanes: u32, rows: u32) -> bool {
        let per_workgroup = 256 / lanes * rows;
        per_workgroup >= 32 && per_workgroup * tokens <= 256
    }

    /// Storage buffers the kernel binds (0 is always the step buffer).
    pub(crate) fn bindings(self) -> u32 {
        match self {
            Kernel::Rope | Kernel::SplitReduce { .. } => 3,
            Kernel::RmsNorm | Kernel::Add | Kernel::SwiGlu => 4,
            Kernel::Embed { .. } | Kernel::KvWrite { .. } => 5,
            // The attention variants of one dispatch share its descriptor set: binding 8 is
            // the statistics, 9 and 10 the split partials and counters, placeholders where a
            // variant has none.
            Kernel::Attention { .. } | Kernel::AttentionTiled { .. } => 11,
            Kernel::Gemv { .. } | Kernel::Gemm { .. } | Kernel::Rotate { .. } => 6,
        }
    }

    /// The WGSL module of this variant.
    pub(crate) fn source(self) -> String {
        let mut s = String::new();
        // Enable directives come before any declaration.
        if let Kernel::Gemm {
            tensor_cores: true, ..
        } = self
        {
            s.push_str("enable f16;\nenable wgpu_cooperative_matrix;\n");
        }
        s.push_str(COMMON);
        let weights = |s: &mut String, format: WeightFormat| {
            s.push_str(&format!("const W_FORMAT: u32 = {}u;\n", format.code()));
            // The MX decoder is part of every weight module (its branch is dead for the others,
            // which still need its constants declared).
            let mx = match format {
                WeightFormat::Mx(f) => f,
                _ => ElemFormat::Fp8E4M3,
            };
            s.push_str(&mx_quant::wgsl::decode_constants(mx));
            s.push_str(WEIGHTS);
            s.push_str(mx_quant::wgsl::DECODE_SOURCE);
        };
        match self {
            Kernel::RmsNorm => s.push_str(RMS_NORM),
            Kernel::Gemv {
                format,
                tokens,
                lanes,
                rows,
                input,
                accumulate,
                argmax,
            } => {
                s.push_str(&format!(
                    "const NT: u32 = {tokens}u;\nconst LANES: u32 = {lanes}u;\nconst RPL: u32 = {rows}u;\n"
                ));
                linear_io(&mut s, input, accumulate);
                weights(&mut s, format);
                s.push_str(GEMV);
                s.push_str(if argmax { GEMV_ARGMAX } else { NO_GEMV_ARGMAX });
            }
            Kernel::Gemm {
                format,
                input,
                accumulate,
                split_k,
                tensor_cores,
            } => {
                s.push_str(&format!("const SPLIT_K: u32 = {}u;\n", u32::from(split_k)));
                linear_io(&mut s, input, accumulate);
                weights(&mut s, format);
                s.push_str(GEMM_STAGE);
                s.push_str(if tensor_cores { GEMM_COOP } else { GEMM });
            }
            Kernel::SplitReduce { accumulate } => {
                s.push_str(&format!(
                    "const OUT_ACC: u32 = {}u;\n",
                    u32::from(accumulate)
                ));
                s.push_str(SPLIT_REDUCE);
            }
            Kernel::Embed { format } => {
                weights(&mut s, format);
                s.push_str(EMBED);
            }
            Kernel::Rotate { input } => {
                linear_io(&mut s, input, false);
                s.push_str(ROTATE);
            }
            Kernel::Add => {
                s.push_str("const OP: u32 = 0u;\n");
                s.push_str(ELEMENTWISE);
            }
            Kernel::SwiGlu => {
                s.push_str("const OP: u32 = 1u;\n");
                s.push_str(ELEMENTWISE);
            }
            Kernel::Rope => {
                s.push_str(ROPE_ANGLE);
                s.push_str(ROPE);
            }
            Kernel::KvWrite { kv, rope } => {
                s.push_str(&format!("const ROPE: u32 = {rope}u;\n"));
                s.push_str("@group(0) @binding(4) var<storage, read> inv_freq: array<f32>;\n");
                kv_constants(&mut s, kv);
                s.push_str(ROPE_ANGLE);
                s.push_str(KV_COMMON);
                if let KvFormat::Mx(_) = kv {
                    s.push_str(
                        "@group(0) @binding(3) var<storage, read_write> kv: array<atomic<u32>>;\n\
                         fn kv_store(i: u32, w: u32) { atomicStore(&kv[i], w); }\n\
                         fn kv_set_byte(i: u32, shift: u32, b: u32) {\n\
                             atomicAnd(&kv[i], ~(0xFFu << shift));\n\
                             atomicOr(&kv[i], b << shift);\n\
                         }\n",
                    );
                } else {
                    s.push_str(
                        "@group(0) @binding(3) var<storage, read_write> kv: array<u32>;\n\
                         fn kv_store(i: u32, w: u32) { kv[i] = w; }\n\
                         fn kv_set_byte(i: u32, shift: u32, b: u32) {}\n",
                    );
                }
                s.push_str(KV_WRITE);
            }
            Kernel::Attention {
                kv,
                head_dim,
                workgroup,
                rope,
                rope_q,
                rope_k,
                in_batch,
                stats,
                splits,
            } => {
                let v = AttentionLanes::new(workgroup, head_dim);
                s.push_str(&format!(
                    "const WG: u32 = {workgroup}u;\nconst SPLITS: u32 = {splits}u;\n\
                     const LPG: u32 = {}u;\nconst KG: u32 = {}u;\nconst PPL: u32 = {}u;\n\
                     const SPLIT_ROWS: u32 = {SPLIT_ROWS}u;\n\
                     @group(0) @binding(9) var<storage, read_write> partials: array<f32>;\n\
                     @group(0) @binding(10) var<storage, read_write> split_counters: \
                     array<atomic<u32>>;\n",
                    v.lanes_per_group, v.groups, v.pairs_per_lane
                ));
                attention(&mut s, kv, head_dim, rope, rope_q, rope_k, in_batch);
                s.push_str(ATTENTION);
                s.push_str(if stats {
                    ATTENTION_STATS
                } else {
                    NO_ATTENTION_STATS
                });
            }
            Kernel::AttentionTiled {
                kv,
                head_dim,
                rope,
                rope_q,
                rope_k,
                in_batch,
                splits,
            } => {
                s.push_str(&format!("const SPLITS: u32 = {splits}u;\n"));
                attention(&mut s, kv, head_dim, rope, rope_q, rope_k, in_batch);
                s.push_str(ATTENTION_TILED);
            }
        }
        s
    }
}

/// What both attention modules start with (see [`Kernel::Attention`]): their constants, the
/// rotary angles and the page reads.
fn attention(
    s: &mut String,
    kv: KvFormat,
    head_dim: u32,
    rope: u32,
    rope_q: bool,
    rope_k: bool,
    in_batch: bool,
) {
    s.push_str(&format!(
        "const HD: u32 = {head_dim}u;\n\
                     const ROPE: u32 = {rope}u;\nconst ROPE_Q: u32 = {}u;\n\
                     const ROPE_K: u32 = {}u;\nconst INBATCH: u32 = {}u;\n\
                     @group(0) @binding(7) var<storage, read> inv_freq: array<f32>;\n",
        u32::from(rope_q),
        u32::from(rope_k),
        u32::from(in_batch)
    ));
    kv_constants(s, kv);
    s.push_str(ROPE_ANGLE);
    s.push_str(KV_COMMON);
    if let KvFormat::Mx(_) = kv {
        s.push_str(
                        "@group(0) @binding(2) var<storage, read> mx_codes: array<u32>;\n\
                         @group(0) @binding(4) var<storage, read> mx_scales: array<u32>;\n\
                         fn kv_word(i: u32) -> u32 { return mx_codes[i]; }\n\
                         fn kv_mx_elem(page: u32, token: u32, d: u32) -> f32 {\n\
                             let pl = pc.head_dim * MX_ELEM_BITS / 8u;\n\
                             let code = mx_code_at((page + token * pl) * 8u + d * MX_ELEM_BITS);\n\
                             let s = mx_scale_at(page + pc.block_tokens * pl + token * (pc.head_dim / 32u) + d / 32u);\n\
                             return mx_decode(code) * s;\n\
                         }\n",
                    );
        s.push_str(mx_quant::wgsl::DECODE_SOURCE);
    } else {
        s.push_str(
            "@group(0) @binding(2) var<storage, read> kv: array<u32>;\n\
                         fn kv_word(i: u32) -> u32 { return kv[i]; }\n\
                         fn kv_mx_elem(page: u32, token: u32, d: u32) -> f32 { return 0.0; }\n",
        );
    }
    s.push_str(KV_READ);
}

fn linear_io(s: &mut String, input: LinearInput, accumulate: bool) {
    s.push_str(&format!(
        "const IN_MODE: u32 = {}u;\nconst OUT_ACC: u32 = {}u;\n",
        input.code(),
        u32::from(accumulate)
    ));
    s.push_str(LINEAR_IO);
}

/// `KV_DTYPE`, the MX decoding constants (a placeholder format for non-MX pages), and the
/// encoder's saturation bound and largest exponent.
fn kv_constants(s: &mut String, kv: KvFormat) {
    let mx = match kv {
        KvFormat::Mx(f) => f,
        _ => ElemFormat::Fp8E4M3,
    };
    s.push_str(&format!("const KV_DTYPE: u32 = {}u;\n", kv.code()));
    s.push_str(&mx_quant::wgsl::decode_constants(mx));
    let max = mx.max_normal();
    s.push_str(&format!(
        "const MX_MAXV: f32 = {max:?};\nconst MX_EMAX: i32 = {};\n",
        mx.emax()
    ));
}

/// WGSL to SPIR-V.
pub(crate) fn compile(source: &str) -> Result<Vec<u32>, Error> {
    use naga::back::spv;
    use naga::proc::{BoundsCheckPolicies, BoundsCheckPolicy};
    let module = naga::front::wgsl::parse_str(source).map_err(|e| Error::Shader {
        message: e.emit_to_string(source),
    })?;
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::IMMEDIATES
            | naga::valid::Capabilities::SHADER_FLOAT16_IN_FLOAT32
            | naga::valid::Capabilities::SUBGROUP
            // The tensor-core GEMM's, which only devices with them are given.
            | naga::valid::Capabilities::SHADER_FLOAT16
            | naga::valid::Capabilities::COOPERATIVE_MATRIX,
    )
    .validate(&module)
    .map_err(|e| Error::Shader {
        message: e.emit_to_string(source),
    })?;
    let options = spv::Options {
        lang_version: (1, 3),
        flags: spv::WriterFlags::empty(),
        bounds_check_policies: BoundsCheckPolicies {
            index: BoundsCheckPolicy::Restrict,
            buffer: BoundsCheckPolicy::Restrict,
            ..BoundsCheckPolicies::default()
        },
        force_loop_bounding: false,
        // Every kernel writes its workgroup memory before reading it; zeroing it first costs a
        // store per element, which llvmpipe turns into minutes of compilation.
        zero_initialize_workgroup_memory: spv::ZeroInitializeWorkgroupMemoryMode::None,
        // No kernel has f16 inputs or outputs (f16 stays in workgroup memory and registers),
        // so it needs no StorageInputOutput16.
        use_storage_input_output_16: false,
        ..spv::Options::default()
    };
    let pipeline = spv::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: "main".into(),
    };
    spv::write_vec(&module, &info, &options, Some(&pipeline)).map_err(|e| Error::Shader {
        message: e.to_string(),
    })
}

/// A compute pipeline and the layout it was made with.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pipeline {
    pub(crate) pipeline: vk::Pipeline,
    pub(crate) layout: vk::PipelineLayout,
}

/// Pipelines by variant, built on first use, and one set layout per binding count.
#[derive(Debug, Default)]
pub(crate) struct Pipelines {
    set_layouts: HashMap<u32, (vk::DescriptorSetLayout, vk::PipelineLayout)>,
    built: HashMap<Kernel, Pipeline>,
}

impl Pipelines {
    pub(crate) fn get(&mut self, ctx: &Context, kernel: Kernel) -> Result<Pipeline, Error> {
        if let Some(p) = self.built.get(&kernel) {
            return Ok(*p);
        }
        let (_, layout) = self.layouts(ctx, kernel.bindings())?;
        let spirv = compile(&kernel.source())?;
        let info = vk::ShaderModuleCreateInfo::default().code(&spirv);
        // SAFETY: valid SPIR-V from naga's writer, on a live device.
        let module = unsafe { ctx.device.create_shader_module(&info, None) }
            .map_err(vk_err("vkCreateShaderModule"))?;
        let stage = vk::PipelineShaderStageCreateInfo::default()
            .stage(vk::ShaderStageFlags::COMPUTE)
            .module(module)
            .name(c"main");
        let create = [vk::ComputePipelineCreateInfo::default()
            .stage(stage)
            .layout(layout)];
        // SAFETY: the module and layout are live objects of this device; the module's bindings
        // and push constants fit the layout (the kernel's binding count, PUSH_BYTES).
        let made = unsafe {
            ctx.device
                .create_compute_pipelines(vk::PipelineCache::null(), &create, None)
        };
        // SAFETY: the module is not needed once the pipeline exists (or failed).
        unsafe { ctx.device.destroy_shader_module(module, None) };
        let pipeline = made.map_err(|(_, r)| vk_err("vkCreateComputePipelines")(r))?[0];
        let p = Pipeline { pipeline, layout };
        self.built.insert(kernel, p);
        Ok(p)
    }

    /// The descriptor-set and pipeline layouts of kernels with `bindings` storage buffers.
    pub(crate) fn layouts(
        &mut self,
        ctx: &Context,
        bindings: u32,
    ) -> Result<(vk::DescriptorSetLayout, vk::PipelineLayout), Error> {
        if let Some(l) = self.set_layouts.get(&bindings) {
            return Ok(*l);
        }
        let binds: Vec<vk::DescriptorSetLayoutBinding<'_>> = (0..bindings)
            .map(|b| {
                vk::DescriptorSetLayoutBinding::default()
                    .binding(b)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .descriptor_count(1)
                    .stage_flags(vk::ShaderStageFlags::COMPUTE)
            })
            .collect();
        let info = vk::DescriptorSetLayoutCreateInfo::default().bindings(&binds);
        // SAFETY: a valid create info on a live device.
        let set_layout = unsafe { ctx.device.create_descriptor_set_layout(&info, None) }
            .map_err(vk_err("vkCreateDescriptorSetLayout"))?;
        let sets = [set_layout];
        let push = [vk::PushConstantRange::default()
            .stage_flags(vk::ShaderStageFlags::COMPUTE)
            .size(PUSH_BYTES)];
        let info = vk::PipelineLayoutCreateInfo::default()
            .set_layouts(&sets)
            .push_constant_ranges(&push);
        // SAFETY: as above; the set layout was just created.
        let layout = unsafe { ctx.device.create_pipeline_layout(&info, None) }
            .map_err(vk_err("vkCreatePipelineLayout"))?;
        self.set_layouts.insert(bindings, (set_layout, layout));
        Ok((set_layout, layout))
    }

    /// Destroys every pipeline and layout. No command buffer using them may be pending.
    pub(crate) fn destroy(&mut self, ctx: &Context) {
        for (_, p) in self.built.drain() {
            // SAFETY: objects of this device that no pending work uses (the caller's contract).
            unsafe { ctx.device.destroy_pipeline(p.pipeline, None) };
        }
        for (_, (set, layout)) in self.set_layouts.drain() {
            // SAFETY: as above.
            unsafe { ctx.device.destroy_pipeline_layout(layout, None) };
            // SAFETY: as above.
            unsafe { ctx.device.destroy_descriptor_set_layout(set, None) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tensor-core GEMM's workgroup variables are each a whole number of 16-byte vectors
    /// (on the H200 a 4-byte one among them shifted the tiles its cooperative loads read), and
    /// add up to what the device check asks for.
    #[test]
    fn tensor_core_gemm_workgroup_memory_is_whole_vectors() {
        for input in [LinearInput::Plain, LinearInput::Norm, LinearInput::SwiGlu] {
            let kernel = Kernel::Gemm {
                format: WeightFormat::Mx(ElemFormat::Fp6E2M3),
                input,
                accumulate: false,
                split_k: false,
                tensor_cores: true,
            };
            let module = naga::front::wgsl::parse_str(&kernel.source()).expect("parses");
            let mut layouter = naga::proc::Layouter::default();
            layouter.update(module.to_ctx()).expect("layout");
            let mut total = 0;
            for (_, var) in module.global_variables.iter() {
                if var.space != naga::AddressSpace::WorkGroup {
                    continue;
                }
                let size = layouter[var.ty].size;
                assert_eq!(size % 16, 0, "{:?} is {size} bytes", var.name);
                total += size;
            }
            assert_eq!(total, TENSOR_CORE_GEMM_SHARED_BYTES, "{input:?}");
        }
    }

    /// Every variant the backend can ask for parses, validates and compiles.
    #[test]
    fn every_kernel_variant_compiles() {
        let mut kernels = vec![
            Kernel::RmsNorm,
            Kernel::Add,
            Kernel::SwiGlu,
            Kernel::Rope,
            Kernel::SplitReduce { accumulate: false },
            Kernel::SplitReduce { accumulate: true },
        ];
        let formats = ElemFormat::ALL.into_iter().map(WeightFormat::Mx).chain([
            WeightFormat::F32,
            WeightFormat::F16,
            WeightFormat::Bf16,
            WeightFormat::Q8_0,
            WeightFormat::Q4_0,
            WeightFormat::Q4_1,
        ]);
        for format in formats {
            kernels.push(Kernel::Embed { format });
            for input in [LinearInput::Plain, LinearInput::Norm, LinearInput::SwiGlu] {
                kernels.push(Kernel::Rotate { input });
                for accumulate in [false, true] {
                    for lanes in GEMV_LANES {
                        let shapes = GEMV_ROWS.map(|rows| (1, rows)).into_iter().chain([(8, 1)]);
                        for argmax in [false, true] {
                            kernels.extend(
                                shapes
                                    .clone()
                                    .filter(|&(tokens, rows)| {
                                        !argmax || Kernel::gemv_argmax_fits(tokens, lanes, rows)
                                    })
                                    .map(|(tokens, rows)| Kernel::Gemv {
                                        format,
                                        tokens,
                                        lanes,
                                        rows,
                                        input,
                                        accumulate,
                                        argmax,
                                    }),
                            );
                        }
                    }
                    for tensor_cores in [false, true] {
                        kernels.extend([false, true].map(|split_k| Kernel::Gemm {
                            format,
                            input,
                            accumulate,
                            split_k,
                            tensor_cores,
                        }));
                    }
                }
            }
        }
        for dtype in kv_paged::PageDtype::ALL {
            let kv = KvFormat::of(dtype);
            for rope in 0..3 {
                kernels.push(Kernel::KvWrite { kv, rope });
            }
            for (head_dim, workgroup) in [(32, 64), (64, 64), (64, 32), (128, 32), (256, 16)] {
                for (rope, rope_q, rope_k) in [(0, false, false), (1, true, true), (2, true, false)]
                {
                    for (in_batch, stats, splits) in [
                        (false, false, 1),
                        (true, false, 1),
                        (false, true, 1),
                        (true, true, 1),
                        (true, false, 16),
                        (false, false, 16),
                    ] {
                        kernels.push(Kernel::Attention {
                            kv,
                            head_dim,
                            workgroup,
                            rope,
                            rope_q,
                            rope_k,
                            in_batch,
                            stats,
                            splits,
                        });
                    }
                    for (in_batch, splits) in [(false, 1), (true, 1), (true, 4)] {
                        kernels.push(Kernel::AttentionTiled {
                            kv,
                            head_dim,
                            rope,
                            rope_q,
                            rope_k: rope_k && in_batch,
                            in_batch,
                            splits,
                        });
                    }
                }
            }
        }
        for k in kernels {
            if let Err(e) = compile(&k.source()) {
                panic!("{k:?}: {e}");
            }
        }
    }
}
