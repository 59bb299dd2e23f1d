//! The GPU backend (feature `vulkan`): the decoder's op programs on any Vulkan 1.2 device with
//! timeline semaphores and subgroup shuffles in compute shaders, through ash, with kernels
//! written in WGSL and compiled by naga.
//!
//! # How a program runs
//! - **Record once, replay per step.** The first submission of a program builds one descriptor
//!   set per dispatch and a step buffer; each batch shape (tokens and selected rows, rounded up
//!   to a power of two) records one command buffer. Later submissions write the step values
//!   (token ids, first position, KV slots, the block table) into the step buffer and resubmit
//!   the recorded command buffer: no per-op encoding on the CPU.
//! - **Barriers from the program.** Each dispatch lists what it reads and writes; a barrier goes
//!   in only where a dispatch touches what an earlier one since the last barrier wrote (or
//!   writes what it read), so independent ops (Q, K and V; gate and up) run together.
//! - **Fused where the data flow allows** ([`fuse`]): an RMSNorm or SwiGLU whose only readers
//!   are linear layers becomes their input stage, a residual add the output stage of the linear
//!   layer before it, and RoPE folds into the KV write and the attention (which reads the
//!   batch's own K and V from the tensors and so runs beside the KV write; the row kernel of
//!   long batches, used where the tiled one is not, reads them back from the pages after it).
//!   On a discrete GPU a decode step costs its chain of dependent dispatches, so each fold is a
//!   level saved.
//! - **Weights stay in their format**: MX (decoded in the kernels by mx-quant's WGSL library),
//!   ggml Q4_0/Q4_1/Q8_0 (split into a quant plane and a scale plane, the bits unchanged), and
//!   dense matrices as f16 or bf16 when every value is exactly one, f32 otherwise.
//! - **Prefill on tensor cores** where the device has cooperative matrices
//!   ([`VulkanConfig::tensor_cores`]): long batches' GEMMs decode their weights and run their
//!   input stage in f32, then stage both as f16 for 16x16x16 cooperative-matrix products with
//!   f32 sums. f32 weights, and devices without them, take the SIMT GEMM (f32 throughout).
//! - **KV pages live in device memory**, laid out as kv-paged lays them out; the host's
//!   [`KvCache`](kv_paged::KvCache) keeps the block tables, which each step copies into the
//!   step buffer. (The host cache's own pages are not used on this device.)
//! - **Timelines.** Every submission signals the device's private completion timeline; a
//!   submission's `wait` and `signal` on a Vulkan timeline of the same device happen in the
//!   queue, with no host wake; any other timeline is waited on (or signalled) from the host,
//!   and counted in [`DeviceStats::host_waits`]. [`Device::timeline`] hands out a timeline of
//!   this device, so a decoder's chained submissions never wake the CPU between them.
//! - **Logits come back** in a [`Device::create_readback_tensor`]: in host memory the GPU
//!   writes (counted by uvm-alloc's copy ledger, stage `gpu-readback`: the one per-token
//!   transfer), or device memory on unified memory. [`Device::view_tensor`] shows them to the
//!   sampler where they are, with no copy on the host; [`Device::read_tensor`] copies them out.
//!   Other tensors are copied out through a staging buffer. A readback tensor has room past
//!   its values for the output head's maxima: the GEMVs that write it with at least 32 rows a
//!   workgroup (and are its last writer in the run) also write each workgroup's largest
//!   output and its index, so [`Device::row_argmax`] reads those pairs rather than the row.
//!   Which runs left maxima is tracked per tensor at submission (for a held run, at its
//!   release), and a host write clears it.
//!
//! A device that lacks something a program needs is refused with [`Error::Unsupported`]; nothing
//! falls back to the CPU.

mod gpu;
mod shaders;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ash::vk;
use kv_paged::{KvCache, KvLayout};
use sync_timeline::Timeline;
use sync_timeline::vulkan::VulkanTimeline;

use self::gpu::{Context, GpuBuffer, Instance, Memory, PUSH_BYTES, vk_err};
use self::shaders::{Kernel, KvFormat, LinearInput, Pipelines, WeightFormat};
use crate::device::{
    Backend, Batch, Device, DeviceInfo, DeviceKind, DeviceStats, Op, Probe, Rows, Submission,
    TensorId, Weight, WeightId, check_op, check_rows, scan_row_argmax, view_copied,
};
use crate::{EmbeddingData, Error, Held};
use uvm_alloc::UnifiedBuffer;

/// Which Vulkan adapter [`VulkanBackend`] opens.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum AdapterChoice {
    /// The most capable one: a discrete GPU, else integrated, virtual, then a CPU implementation
    /// (lavapipe).
    #[default]
    Best,
    /// Only a hardware adapter (not a CPU implementation).
    Hardware,
    /// The first adapter whose name contains this text.
    Named(String),
}

/// How to open a [`VulkanNpu`].
#[derive(Clone, Debug)]
pub struct VulkanConfig {
    pub adapter: AdapterChoice,
    /// How long a host wait (on a foreign timeline, or for results) may take before failing.
    /// It catches a hang, never a slow submission. `None` (the default, unless
    /// `NPU_HAL_WAIT_TIMEOUT_S` is set): 30 s on a GPU, 600 s on a CPU implementation
    /// (lavapipe), where one 512-token prefill of SmolLM2-135M on 2 cores has taken over 30 s.
    /// The VM lab, whose emulated CPUs run lavapipe slower still, sets 1800.
    pub wait_timeout: Option<Duration>,
    /// Time every dispatch (a timestamp after each, which serialises them): what
    /// [`Device::profile`] reports. Default: on when `NPU_HAL_PROFILE` is set.
    pub profile: bool,
    /// Time each submission on the GPU ([`DeviceStats::device_time`]) where the queue has
    /// timestamps. Default: on, unless `NPU_HAL_TIMESTAMPS=0`. On a CPU implementation
    /// (lavapipe) reading them waits for the device to go idle, which a held submission keeps
    /// it from, so there [`Device::submit_held`] needs them off.
    pub timestamps: bool,
    /// Invocations per output row in the decode GEMV: 8, 16, 32, 64, 128 or 256 (a workgroup
    /// holds 256 / `gemv_lanes` rows). More lanes per row leave each invocation fewer dependent
    /// loads, which is what a decode step at SmolLM2's widths waits on. `None` (the default,
    /// unless `NPU_HAL_GEMV_LANES` is set): 64 on a GPU, 32 on a CPU implementation (lavapipe),
    /// the fastest of each measured (README, "Decoder on the GPU").
    pub gemv_lanes: Option<u32>,
    /// [`VulkanConfig::gemv_lanes`] for rows of more than 1024 columns (the MLP's
    /// down projection at SmolLM2's widths, 1536), which give each lane that many more loads.
    /// `None` (the default, unless `NPU_HAL_GEMV_WIDE_LANES` is set): 256 on a GPU, the
    /// fastest of 64, 128 and 256 on the H200 (README, "Decoder on the GPU"); as `gemv_lanes`
    /// on a CPU implementation.
    pub gemv_wide_lanes: Option<u32>,
    /// [`VulkanConfig::gemv_lanes`] for matrices of more than 8192 rows (an output head over
    /// a vocabulary), which fill the GPU with workgroups however few lanes a row takes: fewer
    /// lanes mean a shorter reduction per row and more rows per workgroup, whose results are stored
    /// as one run of neighbouring values (across the bus, where the head's output is in host
    /// memory). `None` (the default, unless `NPU_HAL_GEMV_TALL_LANES` is set): 16 on a GPU,
    /// where 8 and 16 were the fastest of 8, 16, 32 and 64 on the H200 (README, "Decoder on
    /// the GPU"); as `gemv_lanes` on a CPU implementation.
    pub gemv_tall_lanes: Option<u32>,
    /// Neighbouring rows each lane group of a tall matrix's one-token GEMV takes: 1, 2, 4 or 8.
    /// A lane then reads its share of x once for that many rows, and has that many rows' weight
    /// loads in flight. `None` (the default, unless `NPU_HAL_GEMV_TALL_ROWS` is set): 4 on a
    /// GPU, where the head's dispatch took 27.5 us at 4 rows, 28.7 at 2 and 33.7 at 1 on the
    /// H200 (README, "Decoder on the GPU"); 1 on a CPU implementation.
    pub gemv_tall_rows: Option<u32>,
    /// Workgroups a prefill GEMM aims for. A layer with fewer 64 x 64 tiles than this cuts its
    /// columns into up to 8 ranges of at least 256 (split-K), one workgroup each per tile, and
    /// a second pass adds the ranges' sums in order (`shaders/split_reduce.wgsl`): at
    /// SmolLM2's widths a 512-token prefill has 72 tiles in the output and down projections,
    /// too few to fill a large GPU, with up to 48 column steps each. 0 never splits. `None`
    /// (the default, unless `NPU_HAL_GEMM_SPLIT_GROUPS` is set): 528 on a GPU, the fastest of
    /// 132, 264, 528 and 1056 on the H200; 0 on a CPU implementation, which runs a few
    /// workgroups at a time anyway (README, "Decoder on the GPU").
    pub gemm_split_groups: Option<u32>,
    /// Prefill GEMMs on tensor cores (`shaders/linear_gemm_coop.wgsl`: cooperative matrices,
    /// weights and activations rounded to f16 as they are staged, f32 sums), for every weight
    /// format but f32, whose policies promise f32 arithmetic. It needs VK_KHR_cooperative_matrix
    /// with a 16x16x16 f16 -> f32 subgroup shape, f16 shaders, the Vulkan memory model,
    /// 32-lane subgroups and about 25 KB of workgroup memory. `None` (the default, unless
    /// `NPU_HAL_TENSOR_CORES` is 0 or 1): where
    /// the device has all of that; `Some(true)` on a device without them fails to open, naming
    /// what is missing.
    pub tensor_cores: Option<bool>,
    /// Long batches' attention tiled as flash attention (`shaders/attention_tiled.wgsl`: a
    /// workgroup per 32 rows and head reads each key once) rather than a workgroup per row and
    /// head. `None` (the default, unless `NPU_HAL_TILED_ATTENTION` is 0 or 1): on a GPU, not
    /// on a CPU implementation (lavapipe), the faster on each (README, "Decoder on the GPU").
    pub tiled_attention: Option<bool>,
    /// Workgroups each (row, head) of a decode step's attention is cut over, 1 to 64: every
    /// one scores a contiguous range of the keys and the last to finish merges their partial
    /// results (flash-decoding; `shaders/attention.wgsl`). One workgroup per head leaves a
    /// large GPU mostly idle and each of its invocations a long serial chain of key loads.
    /// `None` (the default, unless `NPU_HAL_ATTENTION_SPLITS` is set): 16 on a GPU, 1 on a CPU
    /// implementation (lavapipe), which runs workgroups a few at a time anyway. Attention that
    /// keeps statistics for KV pruning is never split.
    pub attention_splits: Option<u32>,
    /// Workgroups each (32-row block, head) of a long batch's tiled attention is cut over, 1
    /// to 16: each takes a contiguous range of the key blocks the rows see and the last to
    /// finish merges their partial results (`shaders/attention_tiled.wgsl`), so the row blocks
    /// that see every key of a long prompt are not the critical path alone. Only in programs
    /// whose decode attention is split ([`VulkanConfig::attention_splits`] > 1), which hold
    /// the buffers. `None` (the default, unless `NPU_HAL_TILED_SPLITS` is set): 4 on a GPU, 1
    /// on a CPU implementation.
    pub tiled_attention_splits: Option<u32>,
    /// How the host waits for results. `None` (the default, unless `NPU_HAL_HOST_WAIT` is
    /// `block`, `spin` or `nap`): [`HostWait::Nap`] on a GPU, which on the H200 decoded at
    /// 840-845 tokens/s against 773-810 blocking and 851-870 spinning, with a blocking wait's
    /// CPU time (README, "Decoder on the GPU"); [`HostWait::Block`] on a CPU implementation,
    /// whose runs take the cores the host would poll on.
    pub host_wait: Option<HostWait>,
}

/// How the host waits for the GPU to reach a timeline value (its results, or the step buffer's
/// last use).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostWait {
    /// In the driver (`vkWaitSemaphores`): the thread sleeps until the GPU's completion wakes
    /// it, and a CPU core is free meanwhile, at the cost of the wake-up.
    Block,
    /// Polls the timeline's value, one core busy for the whole wait: no wake-up latency. On the
    /// H200 a decode step of a SmolLM2-135M-shaped model took 1124-1157 us against 1197-1224 us
    /// blocking (README, "Decoder on the GPU"); worth it where a core is to spare and latency
    /// is what counts.
    Spin,
    /// Sleeps through the part of the run that earlier runs of the same recorded command buffer
    /// say is left, less 100 us, then polls: about the spinning wait's latency, with the
    /// core free for most of the run. A run that ends before the thread wakes shortens the
    /// estimate, one that is polled for lengthens it; the first run of a command buffer is
    /// polled for throughout.
    Nap,
}

/// How early [`HostWait::Nap`] wakes before the estimated end of a run: enough for a sleep's
/// overshoot (Linux's default timer slack is 50 us) and the run-to-run spread of a decode step.
const NAP_MARGIN: Duration = Duration::from_micros(100);

/// Environment variable `name` parsed as a `T`; `None` when unset or unparsable.
fn env_parse<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok()?.parse().ok()
}

impl Default for VulkanConfig {
    fn default() -> Self {
        VulkanConfig {
            adapter: AdapterChoice::Best,
            wait_timeout: env_parse("NPU_HAL_WAIT_TIMEOUT_S").map(Duration::from_secs),
            profile: std::env::var_os("NPU_HAL_PROFILE").is_some(),
            timestamps: std::env::var("NPU_HAL_TIMESTAMPS").as_deref() != Ok("0"),
            gemv_lanes: env_parse("NPU_HAL_GEMV_LANES"),
            gemv_wide_lanes: env_parse("NPU_HAL_GEMV_WIDE_LANES"),
            gemv_tall_lanes: env_parse("NPU_HAL_GEMV_TALL_LANES"),
            gemv_tall_rows: env_parse("NPU_HAL_GEMV_TALL_ROWS"),
            gemm_split_groups: env_parse("NPU_HAL_GEMM_SPLIT_GROUPS"),
            tensor_cores: match std::env::var("NPU_HAL_TENSOR_CORES").as_deref() {
                Ok("0") => Some(false),
                Ok("1") => Some(true),
                _ => None,
            },
            tiled_attention: match std::env::var("NPU_HAL_TILED_ATTENTION").as_deref() {
                Ok("0") => Some(false),
                Ok("1") => Some(true),
                _ => None,
            },
            attention_splits: env_parse("NPU_HAL_ATTENTION_SPLITS"),
            tiled_attention_splits: env_parse("NPU_HAL_TILED_SPLITS"),
            host_wait: match std::env::var("NPU_HAL_HOST_WAIT").as_deref() {
                Ok("block") => Some(HostWait::Block),
                Ok("spin") => Some(HostWait::Spin),
                Ok("nap") => Some(HostWait::Nap),
                _ => None,
            },
        }
    }
}

/// The Vulkan backend as discovery sees it.
#[derive(Clone, Debug, Default)]
pub struct VulkanBackend {
    pub config: VulkanConfig,
}

impl VulkanBackend {
    /// Opens the adapter the configuration names.
    pub fn open_npu(&self) -> Result<VulkanNpu, Error> {
        VulkanNpu::new(self.config.clone())
    }
}

impl Backend for VulkanBackend {
    fn name(&self) -> &'static str {
        "gpu"
    }

    fn probe(&self) -> Vec<Probe> {
        let listed = Instance::shared().and_then(|i| i.adapters());
        match listed {
            Err(e) => vec![Probe {
                backend: "gpu",
                name: "Vulkan".into(),
                usable: Err(e.to_string()),
            }],
            Ok(adapters) if adapters.is_empty() => vec![Probe {
                backend: "gpu",
                name: "Vulkan".into(),
                usable: Err("the Vulkan loader lists no adapter".into()),
            }],
            Ok(adapters) => adapters
                .into_iter()
                .map(|(_, a)| Probe {
                    backend: "gpu",
                    name: format!(
                        "{} ({}, Vulkan {}.{})",
                        a.name,
                        a.kind_name(),
                        vk::api_version_major(a.api),
                        vk::api_version_minor(a.api)
                    ),
                    usable: a.unusable.clone().map_or(Ok(()), Err),
                })
                .collect(),
        }
    }

    fn open(&self) -> Result<Box<dyn Device>, Error> {
        Ok(Box::new(self.open_npu()?))
    }
}

/// A weight on the GPU.
#[derive(Debug)]
enum GpuWeight {
    Matrix {
        format: WeightFormat,
        rows: usize,
        cols: usize,
        codes: GpuBuffer,
        scales: GpuBuffer,
        bytes: usize,
        /// Block-rotated rows (an MX matrix from `mx_quant::hadamard`): the linear layer reads
        /// a rotated copy of its input (`Kernel::Rotate`).
        rotated: bool,
    },
    Vector {
        data: GpuBuffer,
        len: usize,
    },
}

#[derive(Debug)]
struct GpuTensor {
    width: usize,
    max_rows: usize,
    buffer: GpuBuffer,
    /// Where the output head's per-workgroup maxima go, in f32s from the buffer's start (past
    /// the values): readback tensors only ([`Device::create_readback_tensor`]).
    maxima_at: Option<usize>,
    /// Whether the last run that wrote this tensor left maxima for its rows, and their layout.
    maxima: Option<Maxima>,
}

/// The maxima a run of the output head's argmax GEMV left in a readback tensor
/// (`shaders/linear_gemv_argmax.wgsl`): `per_row` (value, index) pairs for each of its first
/// `rows` rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Maxima {
    per_row: usize,
    rows: usize,
}

/// A readback tensor's room for maxima: a pair per 32 outputs (the fewest rows an argmax GEMV
/// workgroup covers, `Kernel::gemv_argmax_fits`).
fn maxima_room(width: usize, max_rows: usize) -> Option<usize> {
    width.div_ceil(32).checked_mul(2)?.checked_mul(max_rows)
}

/// The largest of a row's maxima (`shaders/linear_gemv_argmax.wgsl`'s (value, index) pairs,
/// index -1 for none), in `kernels::argmax`'s order: the larger value, then the smaller index.
/// `Ok(None)`: no pair holds a value (every output NaN); `Err`: a pair that no run of that
/// kernel writes (an index out of `0..width` or not whole, a NaN value), so the caller scans
/// the row instead.
fn best_of_maxima(pairs: &[f32], width: usize) -> Result<Option<(usize, f32)>, ()> {
    let mut best: Option<(usize, f32)> = None;
    for pair in pairs.chunks_exact(2) {
        let (v, i) = (pair[0], pair[1]);
        if i == -1.0 {
            continue;
        }
        if v.is_nan() || !(0.0..width as f32).contains(&i) || i.fract() != 0.0 {
            return Err(());
        }
        let i = i as usize;
        match best {
            Some((bi, bv)) if bv > v || (bv == v && bi < i) => {}
            _ => best = Some((i, v)),
        }
    }
    Ok(best)
}

/// What a recorded run leaves in the readback tensor a linear dispatch writes: maxima with
/// `per_row` pairs a row, or none (`per_row` `None`, a GEMM's shape); over the selected rows or
/// the batch's.
#[derive(Clone, Copy, Debug)]
struct MaximaWrite {
    tensor: u32,
    per_row: Option<u32>,
    selected: bool,
}

/// What identifies a host KV cache whose pages this device mirrors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct KvKey {
    /// The host cache's page buffer (stable while the cache lives).
    buffer: usize,
    layout: KvLayout,
    blocks: usize,
}

impl KvKey {
    fn of(kv: &KvCache) -> KvKey {
        KvKey {
            buffer: kv.buffer().as_ptr() as usize,
            layout: *kv.layout(),
            blocks: kv.manager().total_blocks(),
        }
    }
}

#[derive(Debug)]
struct KvMirror {
    key: KvKey,
    block_bytes: usize,
    pages: GpuBuffer,
}

/// A resource a dispatch reads or writes, for barrier placement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Resource {
    Tensor(u32),
    Kv,
}

/// How a dispatch's grid follows the batch shape.
#[derive(Clone, Copy, Debug)]
enum Grid {
    /// One workgroup per row.
    PerRow,
    /// `(ceil(width / per), rows)`.
    Elements { width: u32, per: u32 },
    /// A linear layer of `rows` outputs over the batch (or selected) rows.
    Linear {
        format: WeightFormat,
        rows: u32,
        selected: bool,
        input: LinearInput,
        accumulate: bool,
        /// Invocations per row of the GEMV variants.
        lanes: u32,
        /// Rows per lane group of the one-token GEMV (the others take one).
        group_rows: u32,
        /// Whether the GEMM variant runs on tensor cores (`Kernel::Gemm`'s `tensor_cores`).
        tensor_cores: bool,
        /// Whether the output has room for maxima (a readback tensor, written, not added
        /// to): the GEMV variants that can write them then do.
        argmax: bool,
    },
    /// One workgroup per row a linear layer reads: the batch's, or the selected ones.
    LinearRows { selected: bool },
    /// `(rows, heads, depth)`.
    Heads { heads: u32, depth: u32 },
    /// Attention, `(rows, heads, 1)`: the dispatch's own kernel for short batches; for longer
    /// ones `tiled` (a workgroup per [`shaders::TILED_ATTENTION_ROWS`] rows and head) where the
    /// variant allows it, else `paged`. Both read every key from the pages, after the KV write.
    Attention {
        heads: u32,
        paged: Kernel,
        tiled: Option<Kernel>,
    },
}

/// [`VulkanConfig::gemv_lanes`]'s defaults: on a GPU, and on a CPU implementation of Vulkan.
const GPU_GEMV_LANES: u32 = 64;
const CPU_GEMV_LANES: u32 = 32;
/// [`VulkanConfig::gemv_wide_lanes`]'s and [`VulkanConfig::gemv_tall_lanes`]'s defaults on
/// a GPU (on a CPU implementation: as `gemv_lanes`).
const GPU_GEMV_WIDE_LANES: u32 = 256;
const GPU_GEMV_TALL_LANES: u32 = 16;
/// [`VulkanConfig::gemv_tall_rows`]'s default on a GPU.
const GPU_GEMV_TALL_ROWS: u32 = 4;

/// Rows wider than this take [`VulkanConfig::gemv_wide_lanes`].
const WIDE_GEMV_COLS: u32 = 1024;
/// Matrices of more rows than this take [`VulkanConfig::gemv_tall_lanes`].
const TALL_GEMV_ROWS: u32 = 8192;

/// [`VulkanConfig::gemm_split_groups`]'s default on a GPU; the most column ranges a split-K
/// GEMM takes, and the fewest columns each.
const GPU_GEMM_SPLIT_GROUPS: u32 = 528;
const MAX_SPLIT_K: u32 = 8;
const MIN_SPLIT_COLS: u32 = 256;
/// The prefill GEMM's tile, rows x tokens (`shaders/linear_gemm.wgsl`).
const GEMM_TILE: u32 = 64;

/// [`VulkanConfig::attention_splits`]'s defaults: on a GPU, and on a CPU implementation of
/// Vulkan; and the most it takes.
const GPU_ATTENTION_SPLITS: u32 = 16;
const CPU_ATTENTION_SPLITS: u32 = 1;
const MAX_ATTENTION_SPLITS: u32 = 64;
/// [`VulkanConfig::tiled_attention_splits`]'s default on a GPU, and the most it takes.
const GPU_TILED_ATTENTION_SPLITS: u32 = 4;
const MAX_TILED_ATTENTION_SPLITS: u32 = 16;

/// [`VulkanConfig::wait_timeout`]'s defaults: on a GPU, and on a CPU implementation of Vulkan.
const GPU_WAIT_TIMEOUT: Duration = Duration::from_secs(30);
const CPU_WAIT_TIMEOUT: Duration = Duration::from_secs(600);

/// Batches longer than this take the prefill variants (GEMM, paged attention).
const SHORT_BATCH: u32 = 8;

#[derive(Debug)]
struct Dispatch {
    /// The kernel, except for linear layers, whose kernel the shape picks.
    kernel: Kernel,
    grid: Grid,
    set: vk::DescriptorSet,
    push: [u8; PUSH_BYTES as usize],
    reads: Vec<Resource>,
    writes: Vec<Resource>,
    /// A linear layer's split-K form, for shapes whose GEMM takes it.
    split_k: Option<SplitK>,
}

/// How a linear layer's GEMM runs split over column ranges ([`VulkanConfig::gemm_split_groups`]):
/// the GEMM into `scratch` (set `gemm`), then the sum into the layer's output (set `reduce`).
#[derive(Clone, Copy, Debug)]
struct SplitK {
    gemm: vk::DescriptorSet,
    reduce: vk::DescriptorSet,
    scratch: TensorId,
    /// The most ranges the scratch holds.
    max_splits: u32,
    rows: u32,
    cols: u32,
    accumulate: bool,
}

/// Column ranges for a GEMM of `cols` columns whose grid has `tiles` workgroups, aiming at
/// `target` workgroups in all, at most `max` (1: no split).
fn split_ranges(tiles: u32, target: u32, max: u32, cols: u32) -> u32 {
    target
        .div_ceil(tiles.max(1))
        .min(max)
        .min(cols / MIN_SPLIT_COLS)
        .max(1)
}

/// Step-buffer layout: header words, then token ids, KV slots and the block table.
const STEP_HEADER: usize = 16;

/// A recorded program.
#[derive(Debug)]
struct Program {
    ops: Vec<Op>,
    /// [`Submission::live`]: the tensors read after a run (`None`: all), which decides what
    /// can fold away.
    live: Option<Vec<TensorId>>,
    kv: Option<KvKey>,
    step: GpuBuffer,
    /// Rows the step buffer has room for, and block-table entries.
    rows: usize,
    blocks: usize,
    /// Spliced embedding rows (the Embed op's `Batch::embeddings`), host-written.
    splice: Option<(GpuBuffer, usize)>,
    /// The embedding dispatch (its index and the buffers it binds), which binds an imported
    /// buffer instead of `splice` when the rows are read in place.
    embed: Option<(usize, Kernel, [vk::Buffer; 5])>,
    /// Descriptor sets of the embedding dispatch over each imported buffer (by import id),
    /// from `splice_pool` (made on first use).
    splice_sets: Vec<(u32, vk::DescriptorSet)>,
    splice_pool: vk::DescriptorPool,
    /// The attention statistics its attention dispatches add to (`Submission::attention`):
    /// `[layer][mass | last][keys]` f32, zeroed at the start of every run, and the keys'
    /// stride. A program built without them has none.
    stats: Option<(GpuBuffer, usize)>,
    /// The split attention's partial results and its counters (zeroed at the start of every
    /// run), where its attention is split ([`VulkanNpu::split_buffers`]).
    splits: Option<(GpuBuffer, GpuBuffer)>,
    pool: vk::DescriptorPool,
    dispatches: Vec<Dispatch>,
    /// Command buffers by (tokens, selected rows, splice source), the first two rounded up to
    /// a power of two; the source is 0 for the upload buffer, else an import id.
    recorded: HashMap<RecordKey, Recorded>,
    /// The completion value of its last submission: the step buffer is rewritten only after it.
    last: u64,
    /// The batch shape its ops were last checked against ([`ValidShape`]), so a run of decode
    /// steps checks them once rather than every step.
    checked: Option<ValidShape>,
}

/// A submission queued behind the gate ([`Device::submit_held`]).
#[derive(Debug)]
struct HeldRun {
    /// Its completion value.
    value: u64,
    /// The gate value it waits for.
    gate: u64,
    program: usize,
    /// The shape its recorded command buffer was chosen for.
    tokens: usize,
    select: Range<usize>,
    /// Its recorded command buffer's key, for the maxima it leaves once it is released or
    /// discarded.
    shape: RecordKey,
}

fn held_pending() -> Error {
    Error::BadOp {
        op: 0,
        what: "a held submission waits for its release (Device::release or Device::discard) \
               before this device takes other work"
            .into(),
    }
}

/// What a program's op checks (`check_op`, `VulkanNpu::check_gpu`) depend on besides the ops
/// and the shapes of their weights and tensors, which never change once made: a batch with no
/// spliced embeddings (whose buffers differ from batch to batch) of `tokens` rows with `slots`
/// KV slots, selecting `select`, over a cache of layout `kv`.
#[derive(Clone, Debug, PartialEq)]
struct ValidShape {
    tokens: usize,
    slots: usize,
    select: Range<usize>,
    kv: Option<KvLayout>,
}

type RecordKey = (usize, usize, u32);

/// A unified buffer imported into the device so the embedding kernel reads it in place.
#[derive(Debug)]
struct SpliceImport {
    /// Never reused, so a recording keyed by it cannot outlive it unnoticed.
    id: u32,
    /// The `Arc<UnifiedBuffer>` it came from (kept alive by `raw`, so the address is not
    /// reused while the import exists).
    key: usize,
    raw: uvm_alloc::vulkan::RawImport,
}

/// Imports held at once: a chain cycles through its ring's few slots (depth + 1).
const MAX_SPLICE_IMPORTS: usize = 16;
/// Other devices' timelines held at once.
const MAX_FOREIGN_TIMELINES: usize = 8;

#[derive(Debug)]
struct Recorded {
    commands: vk::CommandBuffer,
    /// Timestamps when the queue supports them: start and end, and one after each dispatch
    /// when profiling (then `kernels` names the dispatches).
    timestamps: Option<vk::QueryPool>,
    kernels: Arc<Vec<Kernel>>,
    /// The maxima each run leaves in the readback tensors it writes.
    maxima: Vec<MaximaWrite>,
}

/// The queue and the completion timeline's last submitted value (one lock, so values are
/// submitted in order).
#[derive(Debug)]
struct Queue {
    raw: vk::Queue,
    last: u64,
    /// The command buffer behind `last` and when it was submitted ([`HostWait::Nap`]).
    last_run: Option<(vk::CommandBuffer, Instant)>,
}

/// One-shot transfers (uploads, readbacks), from `&self` as well as `&mut self`.
#[derive(Debug)]
struct Transfer {
    pool: vk::CommandPool,
    commands: vk::CommandBuffer,
    readback: Option<GpuBuffer>,
}

/// A submission whose timestamps are not read yet.
#[derive(Debug)]
struct Pending {
    pool: vk::QueryPool,
    value: u64,
    /// The dispatches it profiles (empty: start and end only).
    kernels: Arc<Vec<Kernel>>,
}

/// [`DeviceStats`] as they accumulate (nanoseconds).
#[derive(Debug, Default)]
struct Counters {
    submissions: AtomicU64,
    host_waits: AtomicU64,
    queue_waits: AtomicU64,
    submit_ns: AtomicU64,
    readback_ns: AtomicU64,
    device_ns: AtomicU64,
    argmax_from_maxima: AtomicU64,
}

fn add_ns(counter: &AtomicU64, since: std::time::Instant) {
    let ns = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
    counter.fetch_add(ns, Ordering::Relaxed);
}

/// The GPU NPU: an npu-hal [`Device`] on a Vulkan adapter.
pub struct VulkanNpu {
    // Drop order: `Drop::drop` waits for the queue and destroys every object below; the
    // timelines and then the context (which they keep alive) go after.
    pipelines: Pipelines,
    weights: Vec<GpuWeight>,
    tensors: Vec<GpuTensor>,
    rope_tables: Vec<((usize, u32), GpuBuffer, f32)>,
    /// Rotated copies of linear inputs (`Kernel::Rotate`), one per (width, rows) shape.
    rotation_scratch: HashMap<(usize, usize), TensorId>,
    kv: Option<KvMirror>,
    programs: Vec<Program>,
    /// The step values being written, kept so a step allocates nothing.
    step_words: Vec<u32>,
    program_pool: vk::CommandPool,
    transfer: Mutex<Transfer>,
    queue: Mutex<Queue>,
    timestamps: bool,
    /// Timestamp pools of submissions not yet read, with their completion values.
    pending_times: Mutex<Vec<Pending>>,
    /// Per-dispatch timestamps ([`VulkanConfig::profile`]).
    profile: bool,
    /// [`VulkanConfig::gemv_lanes`], [`VulkanConfig::gemv_wide_lanes`] and
    /// [`VulkanConfig::gemv_tall_lanes`].
    gemv_lanes: u32,
    gemv_wide_lanes: u32,
    gemv_tall_lanes: u32,
    /// [`VulkanConfig::gemv_tall_rows`].
    gemv_tall_rows: u32,
    /// [`VulkanConfig::gemm_split_groups`].
    gemm_split_groups: u32,
    /// [`VulkanConfig::tensor_cores`], resolved against the device.
    tensor_cores: bool,
    /// Split-K partial sums, by (rows, max rows, slot): shared by the linear layers of that
    /// shape and slot, whose dispatches the hazard tracking orders. Linear layers in a row
    /// (Q, K and V; gate and up), which run side by side, take slots 0, 1, ... so that none
    /// waits for another's scratch.
    split_scratch: HashMap<(usize, usize, usize), TensorId>,
    /// [`VulkanConfig::tiled_attention`].
    tiled_attention: bool,
    /// [`VulkanConfig::attention_splits`].
    attention_splits: u32,
    /// [`VulkanConfig::tiled_attention_splits`].
    tiled_attention_splits: u32,
    kernel_times: Mutex<HashMap<Kernel, (u64, f64)>>,
    counters: Counters,
    wait_timeout: Duration,
    /// [`VulkanConfig::host_wait`].
    host_wait: HostWait,
    /// [`HostWait::Nap`]'s estimate of each command buffer's run, submission to completion.
    run_estimates: Mutex<HashMap<vk::CommandBuffer, Duration>>,
    readback_ledger: Arc<uvm_alloc::StageCopies>,
    /// Unified buffers read in place by the embedding kernel, oldest first.
    splice_imports: Vec<SpliceImport>,
    next_import: u32,
    /// Other devices' timelines imported to be waited on in the queue (by their
    /// [`VulkanTimeline::id`]), oldest first.
    foreign_timelines: Vec<(u64, VulkanTimeline)>,
    /// Private: every submission signals it, in order.
    completion: VulkanTimeline,
    /// Private, host-signalled: a held submission waits for its next value.
    gate: VulkanTimeline,
    /// The submission queued behind the gate, if any ([`Device::submit_held`]).
    held: Option<HeldRun>,
    /// Handed out by [`Device::timeline`]; moved only by submissions that signal it.
    public: Arc<VulkanTimeline>,
    ctx: Arc<Context>,
}

impl std::fmt::Debug for VulkanNpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VulkanNpu")
            .field("adapter", &self.ctx.adapter.name)
            .field("weights", &self.weights.len())
            .field("tensors", &self.tensors.len())
            .field("programs", &self.programs.len())
            .finish_non_exhaustive()
    }
}

impl VulkanNpu {
    /// Opens the adapter `config` chooses.
    pub fn new(config: VulkanConfig) -> Result<VulkanNpu, Error> {
        for (lanes, var) in [
            (config.gemv_lanes, "NPU_HAL_GEMV_LANES"),
            (config.gemv_wide_lanes, "NPU_HAL_GEMV_WIDE_LANES"),
            (config.gemv_tall_lanes, "NPU_HAL_GEMV_TALL_LANES"),
        ] {
            if let Some(lanes) = lanes.filter(|l| !shaders::GEMV_LANES.contains(l)) {
                return Err(Error::Unsupported {
                    what: "this GEMV lane count",
                    why: format!(
                        "{lanes} invocations per row ({var}?); the kernel takes one of {:?}",
                        shaders::GEMV_LANES
                    ),
                });
            }
        }
        if let Some(rows) = config
            .gemv_tall_rows
            .filter(|r| !shaders::GEMV_ROWS.contains(r))
        {
            return Err(Error::Unsupported {
                what: "this number of GEMV rows per lane group",
                why: format!(
                    "{rows} rows (NPU_HAL_GEMV_TALL_ROWS?); the kernel takes one of {:?}",
                    shaders::GEMV_ROWS
                ),
            });
        }
        let instance = Instance::shared()?;
        let mut adapters = instance.adapters()?;
        adapters.sort_by_key(|(_, a)| (a.rank(), a.index));
        let listed: Vec<String> = adapters.iter().map(|(_, a)| a.name.clone()).collect();
        let chosen = adapters.into_iter().find(|(_, a)| {
            a.unusable.is_none()
                && match &config.adapter {
                    AdapterChoice::Best => true,
                    AdapterChoice::Hardware => !a.is_cpu(),
                    AdapterChoice::Named(n) => a.name.contains(n.as_str()),
                }
        });
        let Some((pd, adapter)) = chosen else {
            return Err(Error::Unsupported {
                what: "the Vulkan backend",
                why: format!(
                    "no usable adapter matches {:?} (listed: {})",
                    config.adapter,
                    if listed.is_empty() {
                        "none".to_string()
                    } else {
                        listed.join(", ")
                    }
                ),
            });
        };
        let ctx = Arc::new(Context::open(instance, pd, adapter)?);
        let tensor_cores = match (config.tensor_cores, &ctx.tensor_core_gap) {
            (Some(false), _) => false,
            (None, gap) => gap.is_none(),
            (Some(true), None) => true,
            (Some(true), Some(gap)) => {
                return Err(Error::Unsupported {
                    what: "tensor-core GEMMs (VulkanConfig::tensor_cores)",
                    why: format!("{}: {gap}", ctx.adapter.name),
                });
            }
        };
        let owner: Arc<dyn std::any::Any + Send + Sync> = ctx.clone();
        // SAFETY: the device was created with timeline semaphores and `owner` keeps it alive;
        // every submission that signals either timeline registers the value first (`submit_raw`),
        // and `Drop` waits for the queue to be idle before the timelines go.
        let completion = unsafe { VulkanTimeline::new(ctx.device.clone(), owner.clone(), 0) }?;
        // SAFETY: as above; only the host signals it.
        let gate = unsafe { VulkanTimeline::new(ctx.device.clone(), owner.clone(), 0) }?;
        // Exportable where the driver allows, so another device (a second engine on this GPU)
        // can wait on the decoder's values in its own queue.
        let public = Arc::new(if ctx.imports_timelines {
            // SAFETY: as above; the device has VK_KHR_external_semaphore_fd enabled
            // (`imports_timelines`) and was created from this physical device and instance.
            unsafe {
                VulkanTimeline::new_exportable(
                    &ctx.instance.instance,
                    ctx.physical,
                    ctx.device.clone(),
                    owner,
                    0,
                )
            }?
        } else {
            // SAFETY: as above.
            unsafe { VulkanTimeline::new(ctx.device.clone(), owner, 0) }?
        });
        let pool_info = vk::CommandPoolCreateInfo::default()
            .queue_family_index(ctx.queue_family)
            .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER);
        // SAFETY: a valid create info on a live device.
        let program_pool = unsafe { ctx.device.create_command_pool(&pool_info, None) }
            .map_err(vk_err("vkCreateCommandPool"))?;
        // SAFETY: as above.
        let transfer_pool = unsafe { ctx.device.create_command_pool(&pool_info, None) }
            .map_err(vk_err("vkCreateCommandPool"))?;
        let alloc = vk::CommandBufferAllocateInfo::default()
            .command_pool(transfer_pool)
            .level(vk::CommandBufferLevel::PRIMARY)
            .command_buffer_count(1);
        // SAFETY: a pool of this device.
        let commands = unsafe { ctx.device.allocate_command_buffers(&alloc) }
            .map_err(vk_err("vkAllocateCommandBuffers"))?[0];
        // SAFETY: a physical device of the context's instance.
        let families = unsafe {
            ctx.instance
                .instance
                .get_physical_device_queue_family_properties(ctx.physical)
        };
        let timestamps =
            config.timestamps && families[ctx.queue_family as usize].timestamp_valid_bits > 0;
        let gemv_lanes = config.gemv_lanes.unwrap_or(if ctx.adapter.is_cpu() {
            CPU_GEMV_LANES
        } else {
            GPU_GEMV_LANES
        });
        Ok(VulkanNpu {
            pipelines: Pipelines::default(),
            weights: Vec::new(),
            tensors: Vec::new(),
            rope_tables: Vec::new(),
            rotation_scratch: HashMap::new(),
            kv: None,
            programs: Vec::new(),
            step_words: Vec::new(),
            program_pool,
            transfer: Mutex::new(Transfer {
                pool: transfer_pool,
                commands,
                readback: None,
            }),
            queue: Mutex::new(Queue {
                raw: ctx.queue(),
                last: 0,
                last_run: None,
            }),
            run_estimates: Mutex::new(HashMap::new()),
            timestamps,
            pending_times: Mutex::new(Vec::new()),
            profile: config.profile,
            tiled_attention: config.tiled_attention.unwrap_or(!ctx.adapter.is_cpu()),
            gemm_split_groups: config.gemm_split_groups.unwrap_or(if ctx.adapter.is_cpu() {
                0
            } else {
                GPU_GEMM_SPLIT_GROUPS
            }),
            split_scratch: HashMap::new(),
            tensor_cores,
            attention_splits: config
                .attention_splits
                .unwrap_or(if ctx.adapter.is_cpu() {
                    CPU_ATTENTION_SPLITS
                } else {
                    GPU_ATTENTION_SPLITS
                })
                .clamp(1, MAX_ATTENTION_SPLITS),
            tiled_attention_splits: config
                .tiled_attention_splits
                .unwrap_or(if ctx.adapter.is_cpu() {
                    1
                } else {
                    GPU_TILED_ATTENTION_SPLITS
                })
                .clamp(1, MAX_TILED_ATTENTION_SPLITS),
            gemv_lanes,
            gemv_wide_lanes: config.gemv_wide_lanes.unwrap_or(if ctx.adapter.is_cpu() {
                gemv_lanes
            } else {
                GPU_GEMV_WIDE_LANES
            }),
            gemv_tall_lanes: config.gemv_tall_lanes.unwrap_or(if ctx.adapter.is_cpu() {
                gemv_lanes
            } else {
                GPU_GEMV_TALL_LANES
            }),
            gemv_tall_rows: config.gemv_tall_rows.unwrap_or(if ctx.adapter.is_cpu() {
                1
            } else {
                GPU_GEMV_TALL_ROWS
            }),
            kernel_times: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            wait_timeout: config.wait_timeout.unwrap_or(if ctx.adapter.is_cpu() {
                CPU_WAIT_TIMEOUT
            } else {
                GPU_WAIT_TIMEOUT
            }),
            host_wait: config.host_wait.unwrap_or(if ctx.adapter.is_cpu() {
                HostWait::Block
            } else {
                HostWait::Nap
            }),
            readback_ledger: uvm_alloc::CopyLedger::global().stage("gpu-readback"),
            splice_imports: Vec::new(),
            next_import: 0,
            foreign_timelines: Vec::new(),
            completion,
            gate,
            held: None,
            public,
            ctx,
        })
    }

    /// The adapter's name.
    pub fn adapter(&self) -> &str {
        &self.ctx.adapter.name
    }

    /// Whether the host reads this device's tensors in place (unified memory).
    pub fn unified_memory(&self) -> bool {
        self.ctx.unified
    }

    /// Adds the GPU time of every completed submission whose timestamps are not read yet.
    fn collect_times(&self) -> Result<(), Error> {
        let done = self.completion.value()?;
        let mut pending = self.pending_times.lock().unwrap_or_else(|p| p.into_inner());
        let mut kernel_times = self.kernel_times.lock().unwrap_or_else(|p| p.into_inner());
        let period = f64::from(self.ctx.timestamp_period_ns);
        let mut total = 0f64;
        pending.retain(|p| {
            if p.value > done {
                return true;
            }
            let mut stamps = vec![0u64; p.kernels.len() + 2];
            // SAFETY: a live pool with this many queries, whose submission has completed (its
            // value is reached) and is not resubmitted before this read (a program waits for its
            // last value, and collects, before it runs again); 64-bit results.
            let read = unsafe {
                self.ctx.device.get_query_pool_results(
                    p.pool,
                    0,
                    &mut stamps,
                    vk::QueryResultFlags::TYPE_64,
                )
            };
            if read.is_ok() {
                let last = stamps[stamps.len() - 1];
                total += last.saturating_sub(stamps[0]) as f64 * period;
                for (k, pair) in p.kernels.iter().zip(stamps.windows(2)) {
                    let e = kernel_times.entry(*k).or_insert((0, 0.0));
                    e.0 += 1;
                    e.1 += pair[1].saturating_sub(pair[0]) as f64 * period;
                }
            }
            false
        });
        self.counters
            .device_ns
            .fetch_add(total as u64, Ordering::Relaxed);
        Ok(())
    }

    fn lock_queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Submits `commands` after `waits` (same-device semaphores), signalling the completion
    /// timeline's next value and `signals`; returns that value.
    fn submit_raw(
        &self,
        commands: vk::CommandBuffer,
        waits: &[(&VulkanTimeline, u64)],
        signals: &[(&VulkanTimeline, u64)],
    ) -> Result<u64, Error> {
        // Work queued behind a held run would wait for its release, and so would whoever
        // waits for that work.
        if self.held.is_some() {
            return Err(held_pending());
        }
        let mut q = self.lock_queue();
        let value = q.last + 1;
        let mut sig_sems = vec![self.completion.semaphore()];
        let mut sig_vals = vec![value];
        for (t, v) in signals {
            sig_sems.push(t.semaphore());
            sig_vals.push(*v);
        }
        let wait_sems: Vec<vk::Semaphore> = waits.iter().map(|(t, _)| t.semaphore()).collect();
        let wait_vals: Vec<u64> = waits.iter().map(|(_, v)| *v).collect();
        let stages = vec![vk::PipelineStageFlags::COMPUTE_SHADER; waits.len()];
        let mut timeline_info = vk::TimelineSemaphoreSubmitInfo::default()
            .wait_semaphore_values(&wait_vals)
            .signal_semaphore_values(&sig_vals);
        let buffers = [commands];
        let submit = vk::SubmitInfo::default()
            .wait_semaphores(&wait_sems)
            .wait_dst_stage_mask(&stages)
            .command_buffers(&buffers)
            .signal_semaphores(&sig_sems)
            .push_next(&mut timeline_info);
        self.completion.expect_device_signal(value);
        for (t, v) in signals {
            t.expect_device_signal(*v);
        }
        // SAFETY: the queue is used under its mutex only; the command buffer is fully recorded
        // and either not pending elsewhere (the transfer buffer is used under its own mutex and
        // waited for) or a program's, recorded for simultaneous use (a held run is queued while
        // the run before is pending; their step values never overlap: the host writes a held
        // run's after the run before is done); every semaphore is a
        // live timeline of this device, registered above; the completion value increases.
        unsafe {
            self.ctx
                .device
                .queue_submit(q.raw, &[submit], vk::Fence::null())
        }
        .map_err(vk_err("vkQueueSubmit"))?;
        q.last = value;
        q.last_run = Some((commands, Instant::now()));
        Ok(value)
    }

    /// Blocks until the completion timeline reaches `value` (counted as a host wait).
    fn wait_done(&self, value: u64) -> Result<(), Error> {
        if self.completion.value()? >= value {
            return Ok(());
        }
        // The held run, and anything behind it, waits for the host: waiting for it here
        // would never end.
        if self.held.as_ref().is_some_and(|h| value >= h.value) {
            return Err(held_pending());
        }
        self.counters.host_waits.fetch_add(1, Ordering::Relaxed);
        match self.host_wait {
            HostWait::Block => self.completion.wait(value, self.wait_timeout)?,
            HostWait::Spin => self.spin_until(value, Instant::now())?,
            HostWait::Nap => self.nap_until(value)?,
        }
        Ok(())
    }

    /// Polls the completion timeline until it reaches `value`, for at most the wait timeout
    /// from `start`.
    fn spin_until(&self, value: u64, start: Instant) -> Result<(), Error> {
        while self.completion.value()? < value {
            if start.elapsed() > self.wait_timeout {
                return Err(Error::Timeline(sync_timeline::Error::Timeout {
                    wanted: value,
                    reached: self.completion.value()?,
                    timeout: self.wait_timeout,
                }));
            }
            std::hint::spin_loop();
        }
        Ok(())
    }

    /// [`HostWait::Nap`]: sleeps until shortly before the run behind `value` is estimated to
    /// end, then polls; updates the estimate.
    fn nap_until(&self, value: u64) -> Result<(), Error> {
        let start = Instant::now();
        let run = {
            let q = self.lock_queue();
            q.last_run.filter(|_| q.last == value)
        };
        let Some((commands, submitted)) = run else {
            // Not the latest submission: no estimate applies.
            return self.spin_until(value, start);
        };
        let lock = || self.run_estimates.lock().unwrap_or_else(|p| p.into_inner());
        let estimate = lock().get(&commands).copied().unwrap_or(Duration::ZERO);
        let wake = submitted + estimate.saturating_sub(NAP_MARGIN);
        if let Some(nap) = wake.checked_duration_since(Instant::now()) {
            std::thread::sleep(nap.min(self.wait_timeout));
        }
        let next = if self.completion.value()? >= value {
            // Woke after the end: the run took less than the estimate, by an unknown amount.
            estimate * 7 / 8
        } else {
            self.spin_until(value, start)?;
            // Polled to the end: this run's length is known (to the poll's resolution).
            (estimate * 3 + submitted.elapsed()) / 4
        };
        lock().insert(commands, next);
        Ok(())
    }

    /// Blocks until everything submitted so far has completed.
    fn wait_all(&self) -> Result<(), Error> {
        let last = self.lock_queue().last;
        // Everything before a held run (which waits for its release).
        let last = self.held.as_ref().map_or(last, |h| h.value - 1);
        self.wait_done(last)
    }

    /// Runs `record` into the one-shot transfer command buffer, submits it and waits.
    fn one_shot(
        &self,
        transfer: &mut Transfer,
        record: impl FnOnce(&ash::Device, vk::CommandBuffer),
    ) -> Result<(), Error> {
        let d = &self.ctx.device;
        let cb = transfer.commands;
        let begin = vk::CommandBufferBeginInfo::default()
            .flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
        // SAFETY: the transfer buffer is not pending (every one-shot waits for completion
        // before returning, under the transfer mutex the caller holds).
        unsafe { d.begin_command_buffer(cb, &begin) }.map_err(vk_err("vkBeginCommandBuffer"))?;
        full_barrier(d, cb);
        record(d, cb);
        full_barrier(d, cb);
        // SAFETY: recording on this thread, begun above.
        unsafe { d.end_command_buffer(cb) }.map_err(vk_err("vkEndCommandBuffer"))?;
        let value = self.submit_raw(cb, &[], &[])?;
        self.wait_done(value)
    }

    /// A device-memory buffer holding `bytes` (written in place on unified memory, through a
    /// staging buffer otherwise).
    fn upload(&self, bytes: &[u8]) -> Result<GpuBuffer, Error> {
        let mut buffer = self.ctx.buffer(bytes.len() as u64, Memory::Device)?;
        if buffer.is_mapped() {
            if let Err(e) = buffer.write(0, bytes) {
                self.ctx.destroy(buffer);
                return Err(e);
            }
            return Ok(buffer);
        }
        let result = self.stage_into(&buffer, 0, bytes);
        match result {
            Ok(()) => Ok(buffer),
            Err(e) => {
                self.ctx.destroy(buffer);
                Err(e)
            }
        }
    }

    /// Copies `bytes` into `dst` at `offset` through a staging buffer.
    fn stage_into(&self, dst: &GpuBuffer, offset: u64, bytes: &[u8]) -> Result<(), Error> {
        let mut staging = self.ctx.buffer(bytes.len() as u64, Memory::Upload)?;
        let mut transfer = self.transfer.lock().unwrap_or_else(|p| p.into_inner());
        let result = staging.write(0, bytes).and_then(|()| {
            let region = [vk::BufferCopy::default()
                .dst_offset(offset)
                .size(bytes.len() as u64)];
            self.one_shot(&mut transfer, |d, cb| {
                // SAFETY: both buffers are live, the region lies inside both.
                unsafe { d.cmd_copy_buffer(cb, staging.raw, dst.raw, &region) }
            })
        });
        drop(transfer);
        self.ctx.destroy(staging);
        result
    }

    fn weight(&self, id: WeightId, op: usize) -> Result<&GpuWeight, Error> {
        self.weights.get(id.0 as usize).ok_or_else(|| Error::BadOp {
            op,
            what: format!("weight {} does not exist on this device", id.0),
        })
    }

    fn tensor(&self, id: TensorId, op: usize) -> Result<&GpuTensor, Error> {
        self.tensors.get(id.0 as usize).ok_or_else(|| Error::BadOp {
            op,
            what: format!("tensor {} does not exist on this device", id.0),
        })
    }

    fn weight_shape_of(&self, id: WeightId) -> Option<(usize, usize)> {
        self.weights.get(id.0 as usize).map(|w| match w {
            GpuWeight::Matrix { rows, cols, .. } => (*rows, *cols),
            GpuWeight::Vector { len, .. } => (1, *len),
        })
    }

    /// The device's mirror of `kv`'s pages, made (and older programs dropped) when it is new.
    fn mirror(&mut self, kv: &KvCache) -> Result<KvKey, Error> {
        let key = KvKey::of(kv);
        if self.kv.as_ref().is_some_and(|m| m.key == key) {
            return Ok(key);
        }
        self.wait_all()?;
        // Every submission is complete: read their times before their pools go.
        self.collect_times()?;
        let stale: Vec<Program> = {
            let (keep, stale) = std::mem::take(&mut self.programs)
                .into_iter()
                .partition(|p| p.kv.is_none());
            self.programs = keep;
            stale
        };
        for p in stale {
            self.destroy_program(p);
        }
        if let Some(old) = self.kv.take() {
            self.ctx.destroy(old.pages);
        }
        let block_bytes = key.layout.block_bytes()?;
        let bytes = block_bytes
            .checked_mul(key.blocks)
            .and_then(|b| b.checked_add(16))
            .ok_or(Error::Limit {
                what: "bytes of KV pages",
            })?;
        if bytes as u64 > u64::from(self.ctx.max_storage_range) {
            return Err(Error::Unsupported {
                what: "a KV cache this large",
                why: format!(
                    "{bytes} bytes of pages, past the adapter's {} byte storage-buffer range",
                    self.ctx.max_storage_range
                ),
            });
        }
        let pages = self.ctx.buffer(bytes as u64, Memory::Device)?;
        let mut transfer = self.transfer.lock().unwrap_or_else(|p| p.into_inner());
        let cleared = self.one_shot(&mut transfer, |d, cb| {
            // SAFETY: a live buffer, filled whole.
            unsafe { d.cmd_fill_buffer(cb, pages.raw, 0, vk::WHOLE_SIZE, 0) }
        });
        drop(transfer);
        if let Err(e) = cleared {
            self.ctx.destroy(pages);
            return Err(e);
        }
        self.kv = Some(KvMirror {
            key,
            block_bytes,
            pages,
        });
        Ok(key)
    }

    fn rope_table(&mut self, head_dim: usize, theta: f32) -> Result<usize, Error> {
        let key = (head_dim, theta.to_bits());
        if let Some(i) = self.rope_tables.iter().position(|(k, _, _)| *k == key) {
            return Ok(i);
        }
        let freqs = crate::kernels::rope_freqs(head_dim, theta);
        let buffer = self.upload(bytemuck::cast_slice(&freqs.inv_freq))?;
        self.rope_tables.push((key, buffer, freqs.theta_scale));
        Ok(self.rope_tables.len() - 1)
    }

    /// Checks what the GPU needs beyond the generic op checks, before anything is built.
    fn check_gpu(&self, i: usize, op: &Op) -> Result<(), Error> {
        let refuse = |why: String| {
            Err(Error::Unsupported {
                what: "an op of this program",
                why,
            })
        };
        match *op {
            Op::Embed { table, out } => {
                match self.weight(table, i)? {
                    GpuWeight::Matrix { rotated: false, .. } => {}
                    GpuWeight::Matrix { rotated: true, .. } => {
                        return refuse(format!(
                            "op {i}: embedding from a block-rotated table (rotate only the \
                             layers' matrices)"
                        ));
                    }
                    GpuWeight::Vector { .. } => {
                        return refuse(format!("op {i}: embedding from a vector weight"));
                    }
                }
                if !self.tensor(out, i)?.width.is_multiple_of(4) {
                    return refuse(format!("op {i}: embedding width not a multiple of 4"));
                }
            }
            Op::RmsNorm { x, weight, out, .. } => {
                if x == out {
                    return refuse(format!("op {i}: RMSNorm in place"));
                }
                if !matches!(self.weight(weight, i)?, GpuWeight::Vector { .. }) {
                    return refuse(format!("op {i}: RMSNorm with a matrix gain"));
                }
            }
            Op::Linear { weight, .. } => match self.weight(weight, i)? {
                GpuWeight::Matrix { cols, .. } if cols.is_multiple_of(4) => {}
                GpuWeight::Matrix { cols, .. } => {
                    return refuse(format!(
                        "op {i}: linear over {cols} columns (a multiple of 4 is needed)"
                    ));
                }
                GpuWeight::Vector { .. } => {
                    return refuse(format!("op {i}: linear with a vector weight"));
                }
            },
            Op::Attention { .. } => {
                let Some(m) = &self.kv else {
                    return refuse(format!("op {i}: attention with no KV cache"));
                };
                let l = m.key.layout;
                if l.head_dim > 256 || !l.head_dim.is_multiple_of(2) {
                    return refuse(format!(
                        "op {i}: head_dim {} (even, at most 256)",
                        l.head_dim
                    ));
                }
            }
            Op::Rope { .. } | Op::SwiGlu { .. } | Op::Add { .. } => {}
        }
        Ok(())
    }

    fn find_program(
        &self,
        ops: &[Op],
        kv: Option<KvKey>,
        stats: bool,
        live: Option<&[TensorId]>,
    ) -> Option<usize> {
        self.programs.iter().position(|p| {
            p.kv == kv && p.stats.is_some() == stats && p.live.as_deref() == live && p.ops == ops
        })
    }

    /// Builds a program: its step buffer, descriptor sets and dispatch list.
    fn build_program(
        &mut self,
        ops: &[Op],
        kv: Option<KvKey>,
        stats: bool,
        live: Option<&[TensorId]>,
    ) -> Result<Program, Error> {
        // Room for every row any tensor of the program holds.
        let mut rows = 1;
        let mut splice_width = None;
        for op in ops {
            for t in op_tensors(op) {
                rows = rows.max(self.tensor(t, 0)?.max_rows);
            }
            if let Op::Embed { out, .. } = op {
                splice_width = Some(self.tensor(*out, 0)?.width);
            }
        }
        if rows > self.ctx.max_workgroups[0] as usize {
            return Err(Error::Unsupported {
                what: "a batch this large",
                why: format!(
                    "{rows} rows, past the adapter's {} workgroups per dimension",
                    self.ctx.max_workgroups[0]
                ),
            });
        }
        let blocks = kv.map_or(0, |k| k.blocks);
        let step_words = STEP_HEADER + 2 * rows + blocks;
        let step = self.ctx.buffer(4 * step_words as u64, Memory::Upload)?;
        let mut program = Program {
            ops: ops.to_vec(),
            live: live.map(<[TensorId]>::to_vec),
            kv,
            step,
            rows,
            blocks,
            splice: None,
            embed: None,
            splice_sets: Vec::new(),
            splice_pool: vk::DescriptorPool::null(),
            stats: None,
            splits: None,
            pool: vk::DescriptorPool::null(),
            dispatches: Vec::new(),
            recorded: HashMap::new(),
            last: 0,
            checked: None,
        };
        match self.fill_program(&mut program, splice_width, stats) {
            Ok(()) => Ok(program),
            Err(e) => {
                self.destroy_program(program);
                Err(e)
            }
        }
    }

    fn fill_program(
        &mut self,
        p: &mut Program,
        splice_width: Option<usize>,
        stats: bool,
    ) -> Result<(), Error> {
        if let Some(width) = splice_width {
            let bytes = (p.rows * width * 4) as u64;
            p.splice = Some((self.ctx.buffer(bytes, Memory::Upload)?, width));
        }
        if stats {
            let Some(k) = p.kv else {
                return Err(Error::BadOp {
                    op: 0,
                    what: "attention statistics for a program with no attention".into(),
                });
            };
            let keys = k.blocks * k.layout.block_tokens;
            let bytes = k
                .layout
                .layers
                .checked_mul(2 * keys * 4)
                .filter(|&b| b as u64 <= u64::from(self.ctx.max_storage_range))
                .ok_or(Error::Limit {
                    what: "attention statistics (layers x 2 x cached tokens x 4 bytes)",
                })?;
            p.stats = Some((self.ctx.buffer(bytes as u64, Memory::Readback)?, keys));
        }
        p.splits = self.split_buffers(p, stats)?;
        // Four descriptor sets at most per op (a linear layer's rotation, its own, and its
        // split-K pair), eleven bindings at most per set (the attention's).
        let sets = 4 * p.ops.len() as u32;
        let sizes = [vk::DescriptorPoolSize::default()
            .ty(vk::DescriptorType::STORAGE_BUFFER)
            .descriptor_count(sets * 11)];
        let info = vk::DescriptorPoolCreateInfo::default()
            .max_sets(sets.max(1))
            .pool_sizes(&sizes);
        // SAFETY: a valid create info on a live device.
        p.pool = unsafe { self.ctx.device.create_descriptor_pool(&info, None) }
            .map_err(vk_err("vkCreateDescriptorPool"))?;
        let ops = p.ops.clone();
        let plan = fuse(&ops, p.live.as_deref());
        // The rotated input the last rotated linear layer read: (its source, input stage,
        // the rotated copy), reused by the next one that reads the same while nothing wrote
        // the sources in between (Q, K and V share one).
        let mut rotated: Option<(TensorId, FusedInput, TensorId)> = None;
        for (op, planned) in ops.iter().zip(&plan) {
            if let Some((x, input, _)) = rotated {
                let sources = [vec![x], fused_sources(input)].concat();
                if sources.iter().any(|&t| writes(op, t)) {
                    rotated = None;
                }
            }
            match planned {
                Planned::Folded => {}
                Planned::Linear { input, accumulate } if self.rotated_weight(op) => {
                    let Op::Linear { x, .. } = *op else {
                        unreachable!("linear plans are for linear ops")
                    };
                    let copy = match rotated {
                        Some((rx, rinput, copy)) if rx == x && rinput == *input => copy,
                        _ => {
                            let copy = self.add_rotation(p, op, *input)?;
                            rotated = Some((x, *input, copy));
                            copy
                        }
                    };
                    let Op::Linear {
                        weight, out, rows, ..
                    } = *op
                    else {
                        unreachable!("checked above")
                    };
                    let reading_copy = Op::Linear {
                        weight,
                        x: copy,
                        out,
                        rows,
                    };
                    self.add_linear(p, &reading_copy, FusedInput::Plain, *accumulate)?
                }
                Planned::Linear { input, accumulate } => {
                    self.add_linear(p, op, *input, *accumulate)?
                }
                Planned::Attention { rope_q, rope_k } => {
                    let (q, k) = (
                        rope_q.map(|r| ops[r].clone()),
                        rope_k.map(|r| ops[r].clone()),
                    );
                    self.add_attention(p, op, q.as_ref(), k.as_ref())?
                }
                Planned::Alone => self.add_dispatches(p, op)?,
            }
        }
        Ok(())
    }

    /// Whether `op` is a linear layer over a block-rotated matrix.
    fn rotated_weight(&self, op: &Op) -> bool {
        matches!(*op, Op::Linear { weight, .. }
            if matches!(self.weights.get(weight.0 as usize),
                Some(GpuWeight::Matrix { rotated: true, .. })))
    }

    /// A dispatch writing the block-rotated input of linear `op` (its input stage applied
    /// first) into a scratch tensor of the input's shape, which it returns.
    fn add_rotation(
        &mut self,
        p: &mut Program,
        op: &Op,
        input: FusedInput,
    ) -> Result<TensorId, Error> {
        let Op::Linear {
            weight, x, rows, ..
        } = *op
        else {
            unreachable!("rotations are planned for linear ops only");
        };
        let Some(&GpuWeight::Matrix { cols, .. }) = self.weights.get(weight.0 as usize) else {
            unreachable!("check_gpu refused vector weights");
        };
        // The rotation kernel stages a row in workgroup memory (`shaders/rotate.wgsl`).
        const MAX_ROTATED_COLS: usize = 3072;
        if !cols.is_multiple_of(32) || cols > MAX_ROTATED_COLS {
            return Err(Error::Unsupported {
                what: "a block-rotated matrix",
                why: format!(
                    "{cols} columns: the GPU rotates inputs of whole 32-element blocks, at most \
                     {MAX_ROTATED_COLS} wide"
                ),
            });
        }
        let source = match input {
            FusedInput::Plain => x,
            FusedInput::Norm { x, .. } => x,
            FusedInput::SwiGlu { gate, .. } => gate,
        };
        let max_rows = self.tensors[source.0 as usize].max_rows;
        let copy = match self.rotation_scratch.get(&(cols, max_rows)) {
            Some(&t) => t,
            None => {
                let t = self.create_tensor(cols, max_rows)?;
                self.rotation_scratch.insert((cols, max_rows), t);
                t
            }
        };
        let tensor = |id: TensorId| self.tensors[id.0 as usize].buffer.raw;
        let step = p.step.raw;
        let (kind, x_buf, aux, eps, reads) = match input {
            FusedInput::Plain => (LinearInput::Plain, tensor(x), step, 0.0, vec![x]),
            FusedInput::Norm { x, gain, eps } => {
                let GpuWeight::Vector { data, .. } = &self.weights[gain.0 as usize] else {
                    unreachable!("check_gpu refused matrix gains");
                };
                (LinearInput::Norm, tensor(x), data.raw, eps, vec![x])
            }
            FusedInput::SwiGlu { gate, up } => (
                LinearInput::SwiGlu,
                tensor(gate),
                tensor(up),
                0.0,
                vec![gate, up],
            ),
        };
        let selected = rows == Rows::Selected;
        let push = push_words(&[0, cols as u32, u32::from(selected), eps.to_bits()]);
        let bufs = [step, step, step, x_buf, tensor(copy), aux];
        self.push_dispatch(
            p,
            Kernel::Rotate { input: kind },
            Grid::LinearRows { selected },
            push,
            &bufs,
            reads.into_iter().map(|t| Resource::Tensor(t.0)).collect(),
            vec![Resource::Tensor(copy.0)],
        )?;
        Ok(copy)
    }

    /// Whether a prefill GEMM over weights in `format` runs on tensor cores
    /// ([`VulkanConfig::tensor_cores`]; never for f32 weights).
    fn gemm_on_tensor_cores(&self, format: WeightFormat) -> bool {
        self.tensor_cores && format != WeightFormat::F32
    }

    /// A linear op's dispatch, with the row-wise ops `fuse` folded into it.
    fn add_linear(
        &mut self,
        p: &mut Program,
        op: &Op,
        input: FusedInput,
        accumulate: Option<TensorId>,
    ) -> Result<(), Error> {
        let Op::Linear {
            weight,
            x,
            out,
            rows,
        } = *op
        else {
            unreachable!("fuse plans linear dispatches for linear ops only");
        };
        let GpuWeight::Matrix {
            format,
            rows: r,
            cols,
            codes,
            scales,
            ..
        } = &self.weights[weight.0 as usize]
        else {
            unreachable!("check_gpu refused vector weights");
        };
        let tensor = |id: TensorId| self.tensors[id.0 as usize].buffer.raw;
        let selected = rows == Rows::Selected;
        let (format, r, cols) = (*format, *r as u32, *cols as u32);
        let (codes, scales) = (codes.raw, scales.raw);
        let step = p.step.raw;
        let y = accumulate.unwrap_or(out);
        let mut reads = vec![Resource::Tensor(x.0)];
        let (kind, x_buf, aux, eps) = match input {
            FusedInput::Plain => (LinearInput::Plain, tensor(x), step, 0.0),
            FusedInput::Norm {
                x: norm_x,
                gain,
                eps,
            } => {
                let GpuWeight::Vector { data, .. } = &self.weights[gain.0 as usize] else {
                    unreachable!("check_gpu refused matrix gains");
                };
                reads = vec![Resource::Tensor(norm_x.0)];
                (LinearInput::Norm, tensor(norm_x), data.raw, eps)
            }
            FusedInput::SwiGlu { gate, up } => {
                reads = vec![Resource::Tensor(gate.0), Resource::Tensor(up.0)];
                (LinearInput::SwiGlu, tensor(gate), tensor(up), 0.0)
            }
        };
        if accumulate.is_some() {
            reads.push(Resource::Tensor(y.0));
        }
        let maxima_at = match self.tensors[y.0 as usize].maxima_at {
            Some(at) if accumulate.is_none() => {
                Some(u32::try_from(at).map_err(|_| Error::Limit {
                    what: "readback tensor size",
                })?)
            }
            _ => None,
        };
        let push = push_words(&[
            r,
            cols,
            u32::from(selected),
            eps.to_bits(),
            maxima_at.unwrap_or(0),
        ]);
        let bufs = [step, codes, scales, x_buf, tensor(y), aux];
        // Every linear kernel has one binding layout: the set serves whichever the shape picks.
        let tensor_cores = self.gemm_on_tensor_cores(format);
        let kernel = Kernel::Gemm {
            format,
            input: kind,
            accumulate: accumulate.is_some(),
            split_k: false,
            tensor_cores,
        };
        self.push_dispatch(
            p,
            kernel,
            Grid::Linear {
                format,
                rows: r,
                selected,
                input: kind,
                accumulate: accumulate.is_some(),
                lanes: if cols > WIDE_GEMV_COLS {
                    self.gemv_wide_lanes
                } else if r > TALL_GEMV_ROWS {
                    self.gemv_tall_lanes
                } else {
                    self.gemv_lanes
                },
                group_rows: if cols <= WIDE_GEMV_COLS && r > TALL_GEMV_ROWS {
                    self.gemv_tall_rows
                } else {
                    1
                },
                tensor_cores,
                argmax: maxima_at.is_some(),
            },
            push,
            &bufs,
            reads,
            vec![Resource::Tensor(y.0)],
        )?;
        // The split-K form, where a one-token-tile GEMM (the fewest tiles) would split.
        let y_rows = self.tensors[y.0 as usize].max_rows;
        let max_splits = split_ranges(
            r.div_ceil(GEMM_TILE),
            self.gemm_split_groups,
            MAX_SPLIT_K,
            cols,
        );
        if max_splits > 1 {
            let scratch_rows = max_splits as usize * y_rows;
            // This layer's place among the split linear layers of its scratch shape in the run
            // of linear layers just before it (the dispatch pushed above is its own).
            let slot = p.dispatches[..p.dispatches.len() - 1]
                .iter()
                .rev()
                .take_while(|d| matches!(d.kernel, Kernel::Gemm { .. }))
                .filter_map(|d| d.split_k)
                .filter(|s| {
                    s.rows == r && self.tensors[s.scratch.0 as usize].max_rows == scratch_rows
                })
                .count();
            let key = (r as usize, scratch_rows, slot);
            let scratch = match self.split_scratch.get(&key) {
                Some(&t) => t,
                None => {
                    let t = self.create_tensor(key.0, key.1)?;
                    self.split_scratch.insert(key, t);
                    t
                }
            };
            let scratch_buf = self.tensors[scratch.0 as usize].buffer.raw;
            let gemm_bufs = [step, codes, scales, x_buf, scratch_buf, aux];
            let gemm = self.descriptor_set(
                p.pool,
                Kernel::Gemm {
                    format,
                    input: kind,
                    accumulate: false,
                    split_k: true,
                    tensor_cores,
                },
                &gemm_bufs,
            )?;
            let reduce = self.descriptor_set(
                p.pool,
                Kernel::SplitReduce {
                    accumulate: accumulate.is_some(),
                },
                &[step, scratch_buf, self.tensors[y.0 as usize].buffer.raw],
            )?;
            p.dispatches.last_mut().expect("pushed above").split_k = Some(SplitK {
                gemm,
                reduce,
                scratch,
                max_splits,
                rows: r,
                cols,
                accumulate: accumulate.is_some(),
            });
        }
        Ok(())
    }

    fn add_dispatches(&mut self, p: &mut Program, op: &Op) -> Result<(), Error> {
        let step = p.step.raw;
        let t = |s: &Self, id: TensorId| s.tensors[id.0 as usize].buffer.raw;
        let tw = |s: &Self, id: TensorId| s.tensors[id.0 as usize].width as u32;
        match *op {
            Op::Embed { table, out } => {
                let GpuWeight::Matrix {
                    format,
                    rows,
                    codes,
                    scales,
                    ..
                } = &self.weights[table.0 as usize]
                else {
                    unreachable!("check_gpu refused vector tables");
                };
                let splice = p.splice.as_ref().map(|(b, _)| b.raw).unwrap_or(step);
                let kernel = Kernel::Embed { format: *format };
                let push = push_words(&[tw(self, out), *rows as u32]);
                let bufs = [step, codes.raw, scales.raw, splice, t(self, out)];
                p.embed = Some((p.dispatches.len(), kernel, bufs));
                self.push_dispatch(
                    p,
                    kernel,
                    Grid::PerRow,
                    push,
                    &bufs,
                    vec![],
                    vec![Resource::Tensor(out.0)],
                )?;
            }
            Op::RmsNorm {
                x,
                weight,
                eps,
                out,
            } => {
                let GpuWeight::Vector { data, .. } = &self.weights[weight.0 as usize] else {
                    unreachable!("check_gpu refused matrix gains");
                };
                let kernel = Kernel::RmsNorm;
                let push = push_words(&[tw(self, x), eps.to_bits()]);
                let bufs = [step, t(self, x), data.raw, t(self, out)];
                self.push_dispatch(
                    p,
                    kernel,
                    Grid::PerRow,
                    push,
                    &bufs,
                    vec![Resource::Tensor(x.0)],
                    vec![Resource::Tensor(out.0)],
                )?;
            }
            Op::Linear { .. } => self.add_linear(p, op, FusedInput::Plain, None)?,
            Op::Rope {
                x,
                head_dim,
                theta,
                style,
                ..
            } => {
                let table = self.rope_table(head_dim, theta)?;
                let (_, freqs, theta_scale) = &self.rope_tables[table];
                let kernel = Kernel::Rope;
                let interleaved = u32::from(style == crate::RopeStyle::Interleaved);
                let push = push_words(&[
                    tw(self, x),
                    head_dim as u32,
                    interleaved,
                    theta_scale.to_bits(),
                ]);
                let bufs = [step, t(self, x), freqs.raw];
                self.push_dispatch(
                    p,
                    kernel,
                    Grid::Elements {
                        width: tw(self, x) / 2,
                        per: 64,
                    },
                    push,
                    &bufs,
                    vec![Resource::Tensor(x.0)],
                    vec![Resource::Tensor(x.0)],
                )?;
            }
            Op::SwiGlu { gate, up, out, .. } => {
                let kernel = Kernel::SwiGlu;
                let push = push_words(&[tw(self, out)]);
                let bufs = [step, t(self, out), t(self, gate), t(self, up)];
                self.push_dispatch(
                    p,
                    kernel,
                    Grid::Elements {
                        width: tw(self, out),
                        per: 256,
                    },
                    push,
                    &bufs,
                    vec![Resource::Tensor(gate.0), Resource::Tensor(up.0)],
                    vec![Resource::Tensor(out.0)],
                )?;
            }
            Op::Add { acc, x } => {
                let kernel = Kernel::Add;
                let push = push_words(&[tw(self, acc)]);
                let bufs = [step, t(self, acc), t(self, x), t(self, x)];
                self.push_dispatch(
                    p,
                    kernel,
                    Grid::Elements {
                        width: tw(self, acc),
                        per: 256,
                    },
                    push,
                    &bufs,
                    vec![Resource::Tensor(acc.0), Resource::Tensor(x.0)],
                    vec![Resource::Tensor(acc.0)],
                )?;
            }
            Op::Attention { .. } => self.add_attention(p, op, None, None)?,
        }
        Ok(())
    }

    /// An attention op's two dispatches, the KV write and the attention, with the Rope ops on
    /// Q and K that `fuse` folded into them (`rope_q`, `rope_k`): the KV write rotates K as it
    /// stores it, the attention rotates Q as it loads it and, unless pages are MX, reads this
    /// batch's keys and values from the k and v tensors (rotated and rounded as the pages hold
    /// them), so it runs beside the KV write instead of after it.
    fn add_attention(
        &mut self,
        p: &mut Program,
        op: &Op,
        rope_q: Option<&Op>,
        rope_k: Option<&Op>,
    ) -> Result<(), Error> {
        let Op::Attention {
            layer,
            q,
            k,
            v,
            out,
            q_heads,
            ..
        } = *op
        else {
            unreachable!("attention dispatches are planned for attention ops only");
        };
        let step = p.step.raw;
        let t = |s: &Self, id: TensorId| s.tensors[id.0 as usize].buffer.raw;
        let l = self
            .kv
            .as_ref()
            .expect("check_gpu refused attention without a cache")
            .key
            .layout;
        let rope_of = |r: Option<&Op>| match r {
            Some(&Op::Rope {
                head_dim,
                theta,
                style,
                ..
            }) if head_dim == l.head_dim => Some((theta.to_bits(), style)),
            _ => None,
        };
        // A rotary embedding that cannot fold (another head size, or Q and K rotated
        // differently) runs on its own, where the program had it.
        let k_rope = rope_of(rope_k);
        let q_rope = rope_of(rope_q).filter(|r| k_rope.is_none_or(|k| k == *r));
        if let (Some(r), None) = (rope_k, k_rope) {
            self.add_dispatches(p, r)?;
        }
        if let (Some(r), None) = (rope_q, q_rope) {
            self.add_dispatches(p, r)?;
        }
        let (rope, freqs, theta_scale) = match k_rope.or(q_rope) {
            Some((theta, style)) => {
                let table = self.rope_table(l.head_dim, f32::from_bits(theta))?;
                let (_, freqs, theta_scale) = &self.rope_tables[table];
                let code = match style {
                    crate::RopeStyle::Interleaved => 1,
                    crate::RopeStyle::HalfSplit => 2,
                };
                (code, freqs.raw, *theta_scale)
            }
            None => (0, step, 0.0),
        };
        let m = self.kv.as_ref().expect("checked above");
        let kvf = KvFormat::of(l.dtype);
        let scale = kv_paged::attention::default_scale(l.head_dim);
        let push = push_words(&[
            layer as u32,
            l.kv_heads as u32,
            l.head_dim as u32,
            l.block_tokens as u32,
            m.block_bytes as u32,
            q_heads as u32,
            scale.to_bits(),
            theta_scale.to_bits(),
        ]);
        let pages = m.pages.raw;
        let kernel = Kernel::KvWrite {
            kv: kvf,
            rope: if k_rope.is_some() { rope } else { 0 },
        };
        let bufs = [step, t(self, k), t(self, v), pages, freqs];
        self.push_dispatch(
            p,
            kernel,
            Grid::Heads {
                heads: l.kv_heads as u32,
                depth: 2,
            },
            push,
            &bufs,
            vec![Resource::Tensor(k.0), Resource::Tensor(v.0)],
            vec![Resource::Kv],
        )?;
        // The widest workgroup whose scratch fits in shared memory.
        let hd = l.head_dim as u32;
        let shared = |wg: u32| shaders::AttentionLanes::shared_bytes(wg, hd);
        let workgroup = [64, 32, 16]
            .into_iter()
            .find(|&wg| shared(wg) <= self.ctx.max_shared_bytes)
            .ok_or_else(|| Error::Unsupported {
                what: "attention at this head size",
                why: format!(
                    "head_dim {hd} needs {} bytes of workgroup memory, the adapter has {}",
                    shared(16),
                    self.ctx.max_shared_bytes
                ),
            })?;
        // MX pages are read back from the pages (this kernel does not round to MX blocks).
        let in_batch = !matches!(kvf, KvFormat::Mx(_));
        let stats = p.stats.as_ref().map(|(b, _)| b.raw);
        // A program has split buffers only where its attention is split (never where it keeps
        // statistics, which need every key's probability in one workgroup).
        let (splits, partials, counters) = match &p.splits {
            Some((partials, counters)) => (self.attention_splits, partials.raw, counters.raw),
            None => (1, step, step),
        };
        let kernel = Kernel::Attention {
            kv: kvf,
            head_dim: hd,
            workgroup,
            rope,
            rope_q: q_rope.is_some(),
            rope_k: k_rope.is_some(),
            in_batch,
            stats: stats.is_some(),
            splits,
        };
        let bufs = [
            step,
            t(self, q),
            pages,
            t(self, out),
            pages,
            t(self, k),
            t(self, v),
            freqs,
            stats.unwrap_or(step),
            partials,
            counters,
        ];
        // Earlier positions' pages come from earlier submissions (ordered by the barrier that
        // opens every command buffer); this batch's come from k and v when `in_batch`.
        let reads = if in_batch {
            vec![
                Resource::Tensor(q.0),
                Resource::Tensor(k.0),
                Resource::Tensor(v.0),
            ]
        } else {
            vec![Resource::Tensor(q.0), Resource::Kv]
        };
        // The row kernel reads a long batch's keys back from the pages instead, after the KV
        // write (one barrier): rotating and rounding every key for every row costs more there
        // than the barrier does. The tiled kernel rotates each key once per workgroup, so it
        // reads them from the tensors as a short batch does, beside the KV write.
        let paged = Kernel::Attention {
            kv: kvf,
            head_dim: hd,
            workgroup,
            rope,
            rope_q: q_rope.is_some(),
            rope_k: false,
            in_batch: false,
            stats: stats.is_some(),
            splits: 1,
        };
        // The tiled kernel keeps no statistics, and needs its tiles to fit.
        let tiled = shaders::tiled_attention_shared_bytes(hd)
            .filter(|&bytes| {
                self.tiled_attention && stats.is_none() && bytes <= self.ctx.max_shared_bytes
            })
            .map(|_| Kernel::AttentionTiled {
                kv: kvf,
                head_dim: hd,
                rope,
                rope_q: q_rope.is_some(),
                rope_k: in_batch && k_rope.is_some(),
                in_batch,
                // The ranges' partials and counters are the split decode attention's buffers.
                splits: if p.splits.is_some() {
                    self.tiled_attention_splits
                } else {
                    1
                },
            });
        let grid = Grid::Attention {
            heads: q_heads as u32,
            paged,
            tiled,
        };
        let writes = vec![Resource::Tensor(out.0)];
        self.push_dispatch(p, kernel, grid, push, &bufs, reads, writes)?;
        Ok(())
    }

    /// Program `p`'s split-attention buffers, when its attention is split: room for
    /// [`shaders::SPLIT_ROWS`] rows of the widest attention op's query heads, `splits` partial
    /// results of head_dim + 2 values each, and a counter per layer, row and head; or, where
    /// more, the tiled attention's: every row's partials for each of its key ranges, and a
    /// counter per layer, row block and head.
    fn split_buffers(
        &self,
        p: &Program,
        stats: bool,
    ) -> Result<Option<(GpuBuffer, GpuBuffer)>, Error> {
        let q_heads = p
            .ops
            .iter()
            .filter_map(|op| match op {
                Op::Attention { q_heads, .. } => Some(*q_heads),
                _ => None,
            })
            .max();
        let (Some(q_heads), Some(k), false, true) =
            (q_heads, p.kv, stats, self.attention_splits > 1)
        else {
            return Ok(None);
        };
        // The decode attention's (rows, splits) and the split tiled attention's, which share
        // them.
        let (rows, splits) = (shaders::SPLIT_ROWS as usize, self.attention_splits as usize);
        let tiled_splits = self.tiled_attention_splits as usize;
        let tiled_rows = match self.tiled_attention && tiled_splits > 1 {
            true => p.rows,
            false => 0,
        };
        let tiled_blocks = tiled_rows.div_ceil(shaders::TILED_ATTENTION_ROWS as usize);
        let limit = u64::from(self.ctx.max_storage_range);
        let partial_bytes = (rows * splits)
            .max(tiled_rows * tiled_splits)
            .checked_mul(q_heads * (k.layout.head_dim + 2) * 4)
            .filter(|&b| b as u64 <= limit)
            .ok_or(Error::Limit {
                what: "split attention's partial results (rows x heads x splits x head size)",
            })?;
        let counter_bytes = (k.layout.layers * rows.max(tiled_blocks))
            .checked_mul(q_heads * 4)
            .filter(|&b| b as u64 <= limit)
            .ok_or(Error::Limit {
                what: "split attention's counters (layers x rows x heads)",
            })?;
        let partials = self.ctx.buffer(partial_bytes as u64, Memory::Device)?;
        match self.ctx.buffer(counter_bytes as u64, Memory::Device) {
            Ok(counters) => Ok(Some((partials, counters))),
            Err(e) => {
                self.ctx.destroy(partials);
                Err(e)
            }
        }
    }

    /// Adds one dispatch of `kernel` to `p`, with a descriptor set binding `buffers` in order.
    #[allow(clippy::too_many_arguments)]
    fn push_dispatch(
        &mut self,
        p: &mut Program,
        kernel: Kernel,
        grid: Grid,
        push: [u8; PUSH_BYTES as usize],
        buffers: &[vk::Buffer],
        reads: Vec<Resource>,
        writes: Vec<Resource>,
    ) -> Result<(), Error> {
        let set = self.descriptor_set(p.pool, kernel, buffers)?;
        p.dispatches.push(Dispatch {
            kernel,
            grid,
            set,
            push,
            reads,
            writes,
            split_k: None,
        });
        Ok(())
    }

    fn descriptor_set(
        &mut self,
        pool: vk::DescriptorPool,
        kernel: Kernel,
        buffers: &[vk::Buffer],
    ) -> Result<vk::DescriptorSet, Error> {
        // Only the layout: the pipeline itself is built when a recording first uses it.
        let (set_layout, _) = self.pipelines.layouts(&self.ctx, kernel.bindings())?;
        let layouts = [set_layout];
        let alloc = vk::DescriptorSetAllocateInfo::default()
            .descriptor_pool(pool)
            .set_layouts(&layouts);
        // SAFETY: the pool (a program's: sized for two sets per op; or its splice pool, sized
        // for every import) and layout are live objects of this device.
        let set = unsafe { self.ctx.device.allocate_descriptor_sets(&alloc) }
            .map_err(vk_err("vkAllocateDescriptorSets"))?[0];
        let infos: Vec<[vk::DescriptorBufferInfo; 1]> = buffers
            .iter()
            .map(|&b| {
                [vk::DescriptorBufferInfo::default()
                    .buffer(b)
                    .offset(0)
                    .range(vk::WHOLE_SIZE)]
            })
            .collect();
        let writes: Vec<vk::WriteDescriptorSet<'_>> = infos
            .iter()
            .enumerate()
            .map(|(i, info)| {
                vk::WriteDescriptorSet::default()
                    .dst_set(set)
                    .dst_binding(i as u32)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .buffer_info(info)
            })
            .collect();
        // SAFETY: the set was just allocated with a layout of `buffers.len()` storage-buffer
        // bindings (`Kernel::bindings`), and every buffer is live.
        unsafe { self.ctx.device.update_descriptor_sets(&writes, &[]) };
        Ok(set)
    }

    /// Records program `pi` for `shape` = (token bucket, selected-row bucket).
    fn record(&mut self, pi: usize, shape: RecordKey) -> Result<Recorded, Error> {
        let alloc = vk::CommandBufferAllocateInfo::default()
            .command_pool(self.program_pool)
            .level(vk::CommandBufferLevel::PRIMARY)
            .command_buffer_count(1);
        // SAFETY: the program pool is only used under `&mut self`.
        let cb = unsafe { self.ctx.device.allocate_command_buffers(&alloc) }
            .map_err(vk_err("vkAllocateCommandBuffers"))?[0];
        let kernels: Vec<Kernel> = if self.profile && self.timestamps {
            self.programs[pi]
                .dispatches
                .iter()
                .map(|x| shape_of(x.kernel, x.grid, shape.0, shape.1).0)
                .collect()
        } else {
            Vec::new()
        };
        let timestamps = if self.timestamps {
            let info = vk::QueryPoolCreateInfo::default()
                .query_type(vk::QueryType::TIMESTAMP)
                .query_count(kernels.len() as u32 + 2);
            // SAFETY: a valid create info on a live device.
            Some(
                unsafe { self.ctx.device.create_query_pool(&info, None) }
                    .map_err(vk_err("vkCreateQueryPool"))?,
            )
        } else {
            None
        };
        let dispatches = &self.programs[pi].dispatches;
        let maxima = dispatches
            .iter()
            .enumerate()
            .filter_map(|(i, x)| {
                let Grid::Linear {
                    argmax: true,
                    selected,
                    ..
                } = x.grid
                else {
                    return None;
                };
                let Some(&Resource::Tensor(tensor)) = x.writes.first() else {
                    return None;
                };
                // Maxima describe the tensor only if no later dispatch of the run writes it.
                let last_writer = !dispatches[i + 1..]
                    .iter()
                    .any(|d| d.writes.contains(&Resource::Tensor(tensor)));
                let per_row = match shape_of(x.kernel, x.grid, shape.0, shape.1) {
                    (Kernel::Gemv { argmax: true, .. }, groups) if last_writer => Some(groups[0]),
                    _ => None,
                };
                Some(MaximaWrite {
                    tensor,
                    per_row,
                    selected,
                })
            })
            .collect();
        let recorded = Recorded {
            commands: cb,
            timestamps,
            kernels: Arc::new(kernels),
            maxima,
        };
        match self.record_into(pi, shape, &recorded) {
            Ok(()) => Ok(recorded),
            Err(e) => {
                self.destroy_recorded(recorded);
                Err(e)
            }
        }
    }

    fn record_into(
        &mut self,
        pi: usize,
        (tokens, selected, splice): RecordKey,
        r: &Recorded,
    ) -> Result<(), Error> {
        // The embedding dispatch binds the imported buffer its rows are read from.
        let splice_set = match (splice, self.programs[pi].embed) {
            (0, _) | (_, None) => None,
            (id, Some((at, ..))) => {
                let set = self.programs[pi]
                    .splice_sets
                    .iter()
                    .find(|(i, _)| *i == id)
                    .map(|&(_, set)| set)
                    .expect("splice_import made the set before recording");
                Some((at, set))
            }
        };
        let d = self.ctx.device.clone();
        let cb = r.commands;
        // Simultaneous use: a held run of this command buffer is queued while its previous run
        // is still pending (`Device::submit_held`).
        let begin = vk::CommandBufferBeginInfo::default()
            .flags(vk::CommandBufferUsageFlags::SIMULTANEOUS_USE);
        // SAFETY: a fresh command buffer of the program pool.
        unsafe { d.begin_command_buffer(cb, &begin) }.map_err(vk_err("vkBeginCommandBuffer"))?;
        let queries = r.kernels.len() as u32 + 2;
        if let Some(pool) = r.timestamps {
            // SAFETY: recording; the pool has `queries` queries.
            unsafe {
                d.cmd_reset_query_pool(cb, pool, 0, queries);
            }
            // SAFETY: as above.
            unsafe { d.cmd_write_timestamp(cb, vk::PipelineStageFlags::TOP_OF_PIPE, pool, 0) };
        }
        if let Some((stats, _)) = &self.programs[pi].stats {
            // Every run adds its own statistics to zeros (ordered before the dispatches by the
            // barrier below).
            // SAFETY: recording; a transfer-destination buffer of this device, whole size.
            unsafe { d.cmd_fill_buffer(cb, stats.raw, 0, vk::WHOLE_SIZE, 0) };
        }
        if let Some((_, counters)) = &self.programs[pi].splits {
            // Every run's split attention counts from zero (ordered as above).
            // SAFETY: as above.
            unsafe { d.cmd_fill_buffer(cb, counters.raw, 0, vk::WHOLE_SIZE, 0) };
        }
        // Earlier submissions and host writes of the step buffer come before everything here.
        full_barrier(&d, cb);
        let count = self.programs[pi].dispatches.len();
        let profiling = !r.kernels.is_empty();
        let mut emit = Emit {
            d: &d,
            cb,
            written: Vec::new(),
            read: Vec::new(),
            bound: vk::Pipeline::null(),
            pending: Vec::new(),
        };
        for i in 0..count {
            let (kernel, grid, set, push, reads, writes, split_k) = {
                let x = &self.programs[pi].dispatches[i];
                (
                    x.kernel,
                    x.grid,
                    splice_set
                        .filter(|&(at, _)| at == i)
                        .map_or(x.set, |(_, set)| set),
                    x.push,
                    x.reads.clone(),
                    x.writes.clone(),
                    x.split_k,
                )
            };
            let (kernel, groups) = shape_of(kernel, grid, tokens, selected);
            let mut reads = reads;
            // The long-batch attention kernels read this batch's keys back from the pages.
            if matches!(
                kernel,
                Kernel::Attention {
                    in_batch: false,
                    ..
                } | Kernel::AttentionTiled {
                    in_batch: false,
                    ..
                }
            ) && !reads.contains(&Resource::Kv)
            {
                reads.push(Resource::Kv);
            }
            // Split-K sums wait until a dispatch other than a split GEMM that needs nothing of
            // theirs, so the GEMMs of a run of linear layers share one level and their sums the
            // next (each dispatch is timed alone when profiling).
            // A GEMM with too few tiles to fill the GPU runs split over column ranges, then
            // the sum of the ranges (VulkanConfig::gemm_split_groups).
            let split = match (kernel, split_k) {
                (
                    Kernel::Gemm {
                        format,
                        input,
                        tensor_cores,
                        ..
                    },
                    Some(sk),
                ) => {
                    let tiles = groups[0] * groups[1];
                    let n = split_ranges(tiles, self.gemm_split_groups, sk.max_splits, sk.cols);
                    (n > 1).then_some((
                        Kernel::Gemm {
                            format,
                            input,
                            accumulate: false,
                            split_k: true,
                            tensor_cores,
                        },
                        sk,
                        n,
                    ))
                }
                _ => None,
            };
            if let Some((split_gemm, sk, n)) = split {
                let gemm = self.pipelines.get(&self.ctx, split_gemm)?;
                let scratch = vec![Resource::Tensor(sk.scratch.0)];
                // Every Emit call below is sound because `cb` is begun above; pipelines come
                // from `self.pipelines` and sets from the program's pool, made with the kernel's
                // layout (the split-K sets in `add_linear`); grids were checked when the program
                // was built; reads and writes are the dispatch's own, the scratch included.
                if profiling || emit.conflicts_with_pending(&reads, &scratch) {
                    // SAFETY: see above.
                    unsafe { emit.flush() };
                }
                let split_groups = [groups[0], groups[1], n];
                // SAFETY: as above.
                unsafe { emit.dispatch(gemm, sk.gemm, &push, split_groups, &reads, &scratch) };
                let reduce = self.pipelines.get(
                    &self.ctx,
                    Kernel::SplitReduce {
                        accumulate: sk.accumulate,
                    },
                )?;
                let Grid::Linear { selected: sel, .. } = grid else {
                    unreachable!("only linear dispatches have a split-K form");
                };
                let m = if sel { selected } else { tokens } as u32;
                let mut reduce_reads = scratch;
                if sk.accumulate {
                    reduce_reads.extend(&writes);
                }
                emit.pending.push(PendingSum {
                    pipeline: reduce,
                    set: sk.reduce,
                    push: push_words(&[sk.rows, n, u32::from(sel)]),
                    groups: [sk.rows.div_ceil(256), m, 1],
                    reads: reduce_reads,
                    writes,
                });
                if profiling {
                    // SAFETY: as above.
                    unsafe { emit.flush() };
                }
            } else {
                // SAFETY: as above.
                unsafe { emit.flush() };
                let pipeline = self.pipelines.get(&self.ctx, kernel)?;
                // SAFETY: as above.
                unsafe { emit.dispatch(pipeline, set, &push, groups, &reads, &writes) };
            }
            if let (Some(pool), false) = (r.timestamps, r.kernels.is_empty()) {
                // SAFETY: recording; query i + 1 of a pool of one per dispatch plus two.
                unsafe {
                    d.cmd_write_timestamp(
                        cb,
                        vk::PipelineStageFlags::BOTTOM_OF_PIPE,
                        pool,
                        i as u32 + 1,
                    )
                };
            }
        }
        // SAFETY: as for the Emit calls in the loop.
        unsafe { emit.flush() };
        // Results are visible to whatever follows: copies, the host, the next submission.
        full_barrier(&d, cb);
        if let Some(pool) = r.timestamps {
            // SAFETY: recording; the pool's last query.
            unsafe {
                d.cmd_write_timestamp(
                    cb,
                    vk::PipelineStageFlags::BOTTOM_OF_PIPE,
                    pool,
                    queries - 1,
                )
            };
        }
        // SAFETY: recording, begun above.
        unsafe { d.end_command_buffer(cb) }.map_err(vk_err("vkEndCommandBuffer"))
    }

    fn destroy_recorded(&self, r: Recorded) {
        self.run_estimates
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&r.commands);
        // SAFETY: the buffer is from the program pool and not pending (callers wait first).
        unsafe {
            self.ctx
                .device
                .free_command_buffers(self.program_pool, &[r.commands])
        };
        if let Some(pool) = r.timestamps {
            // SAFETY: as above.
            unsafe { self.ctx.device.destroy_query_pool(pool, None) };
        }
    }

    fn destroy_program(&self, p: Program) {
        for (_, r) in p.recorded {
            self.destroy_recorded(r);
        }
        for pool in [p.pool, p.splice_pool] {
            if pool != vk::DescriptorPool::null() {
                // SAFETY: no pending submission uses the program (callers wait first).
                unsafe { self.ctx.device.destroy_descriptor_pool(pool, None) };
            }
        }
        self.ctx.destroy(p.step);
        if let Some((b, _)) = p.splice {
            self.ctx.destroy(b);
        }
        if let Some((b, _)) = p.stats {
            self.ctx.destroy(b);
        }
        if let Some((partials, counters)) = p.splits {
            self.ctx.destroy(partials);
            self.ctx.destroy(counters);
        }
    }

    /// Writes the step values of `batch` (and its spliced rows) into program `pi`'s buffers.
    /// `splice_at` is where a unified source's rows start in its import, in f32 values.
    fn write_step(
        &mut self,
        pi: usize,
        b: &Batch<'_>,
        kv: Option<&KvCache>,
        splice_at: u32,
    ) -> Result<(), Error> {
        let VulkanNpu {
            programs,
            step_words: words,
            ..
        } = self;
        let p = &mut programs[pi];
        let n = b.tokens.len();
        if n > p.rows {
            return Err(Error::BadOp {
                op: 0,
                what: format!(
                    "a batch of {n} tokens in a program whose tensors hold {}",
                    p.rows
                ),
            });
        }
        let (mut splice_start, mut splice_end) = (0u32, 0u32);
        if let Some(e) = &b.embeddings {
            let Some((buffer, width)) = p.splice.as_mut() else {
                return Err(Error::BadOp {
                    op: 0,
                    what: "spliced embeddings for a program with no embedding op".into(),
                });
            };
            debug_assert_eq!(e.data.len(), e.rows.len() * *width);
            // `check_op` proved the rows lie in the batch and the data fits them. Unified
            // rows are read in place, through the import `splice_import` made.
            if let EmbeddingData::Host(data) = e.data {
                buffer.write(0, bytemuck::cast_slice(data))?;
                // A CPU copy into the upload buffer: counted, so the ledger stays honest.
                uvm_alloc::CopyLedger::global()
                    .stage("gpu-splice-upload")
                    .record(std::mem::size_of_val(data));
            }
            (splice_start, splice_end) = (e.rows.start as u32, e.rows.end as u32);
        }
        words.clear();
        words.resize(STEP_HEADER, 0);
        let tokens_at = STEP_HEADER;
        let slots_at = tokens_at + p.rows;
        let table_at = slots_at + p.rows;
        words[0] = n as u32;
        words[1] = u32::try_from(b.first_pos).map_err(|_| Error::Limit { what: "positions" })?;
        words[2] = b.select.start as u32;
        words[3] = b.select.len() as u32;
        words[4] = splice_start;
        words[5] = splice_end;
        words[6] = tokens_at as u32;
        words[7] = slots_at as u32;
        words[8] = table_at as u32;
        words[9] = splice_at;
        words[10] = words[1];
        words[11] = p.stats.as_ref().map_or(0, |&(_, keys)| keys as u32);
        words.extend_from_slice(b.tokens);
        words.resize(slots_at, 0);
        // Only a program with attention reads slots and the block table.
        if let Some(kv) = kv.filter(|_| p.kv.is_some()) {
            // The cache holds this batch already (appended by the caller); pruning may have
            // dropped pages before it, so the batch's cache index can be below its position.
            let held = kv.manager().len(b.seq)?;
            words[10] = held
                .checked_sub(n)
                .and_then(|c| u32::try_from(c).ok())
                .ok_or_else(|| Error::BadOp {
                    op: 0,
                    what: format!("a {n}-token batch in a sequence that holds {held} tokens"),
                })?;
            let bt = kv.layout().block_tokens;
            for s in b.slots {
                words.push(s.block * bt as u32 + s.offset);
            }
            words.resize(table_at, 0);
            let table = kv.manager().block_table(b.seq)?;
            if table.len() > p.blocks {
                return Err(Error::BadOp {
                    op: 0,
                    what: format!(
                        "a block table of {} blocks for a cache of {}",
                        table.len(),
                        p.blocks
                    ),
                });
            }
            words.extend_from_slice(table);
        }
        p.step.write(0, bytemuck::cast_slice(words))
    }
}

/// `t` as a Vulkan timeline of `device`, whose waits and signals can go in this device's queue.
fn same_device(t: &dyn Timeline, device: vk::Device) -> Option<&VulkanTimeline> {
    match t.backend() {
        sync_timeline::Backend::Vulkan(v) if v.device().handle() == device => Some(v),
        _ => None,
    }
}

/// Records dispatches into a program's command buffer, with a barrier before any that reads or
/// writes what an earlier one since the last barrier wrote, or writes what one read.
/// Split-K sums wait in `pending` until something needs them ([`Emit::flush`]).
struct Emit<'a> {
    d: &'a ash::Device,
    cb: vk::CommandBuffer,
    /// What the dispatches since the last barrier wrote and read.
    written: Vec<Resource>,
    read: Vec<Resource>,
    bound: vk::Pipeline,
    pending: Vec<PendingSum>,
}

/// A split-K sum not yet recorded ([`Emit::flush`]).
struct PendingSum {
    pipeline: shaders::Pipeline,
    set: vk::DescriptorSet,
    push: [u8; PUSH_BYTES as usize],
    groups: [u32; 3],
    reads: Vec<Resource>,
    writes: Vec<Resource>,
}

impl Emit<'_> {
    /// Records the pending dispatches, in order.
    ///
    /// # Safety
    /// As [`Emit::dispatch`], for each.
    unsafe fn flush(&mut self) {
        for p in std::mem::take(&mut self.pending) {
            // SAFETY: the caller's contract, for each pending dispatch.
            unsafe { self.dispatch(p.pipeline, p.set, &p.push, p.groups, &p.reads, &p.writes) };
        }
    }

    /// Whether a dispatch reading `reads` and writing `writes` touches what a pending sum
    /// writes, or writes what one reads.
    fn conflicts_with_pending(&self, reads: &[Resource], writes: &[Resource]) -> bool {
        self.pending.iter().any(|p| {
            reads.iter().chain(writes).any(|r| p.writes.contains(r))
                || writes.iter().any(|w| p.reads.contains(w))
        })
    }

    /// # Safety
    /// `cb` is begun; `pipeline`, its layout and `set` (allocated with that layout, every
    /// binding written) are live objects of the device; `groups` is within the adapter's
    /// limits; `reads` and `writes` name every resource the dispatch touches.
    unsafe fn dispatch(
        &mut self,
        pipeline: shaders::Pipeline,
        set: vk::DescriptorSet,
        push: &[u8; PUSH_BYTES as usize],
        groups: [u32; 3],
        reads: &[Resource],
        writes: &[Resource],
    ) {
        let (d, cb) = (self.d, self.cb);
        let hazard = reads.iter().chain(writes).any(|r| self.written.contains(r))
            || writes.iter().any(|w| self.read.contains(w));
        if hazard {
            compute_barrier(d, cb);
            self.written.clear();
            self.read.clear();
        }
        self.written.extend(writes);
        self.read.extend(reads);
        // Every layout takes PUSH_BYTES of push constants, so `push` fits; the rest is the
        // caller's contract.
        if pipeline.pipeline != self.bound {
            // SAFETY: see above.
            unsafe { d.cmd_bind_pipeline(cb, vk::PipelineBindPoint::COMPUTE, pipeline.pipeline) };
            self.bound = pipeline.pipeline;
        }
        // SAFETY: see above.
        unsafe {
            d.cmd_bind_descriptor_sets(
                cb,
                vk::PipelineBindPoint::COMPUTE,
                pipeline.layout,
                0,
                &[set],
                &[],
            )
        };
        // SAFETY: see above.
        unsafe {
            d.cmd_push_constants(cb, pipeline.layout, vk::ShaderStageFlags::COMPUTE, 0, push)
        };
        // SAFETY: see above.
        unsafe { d.cmd_dispatch(cb, groups[0], groups[1], groups[2]) };
    }
}

/// The kernel and workgroup counts of a dispatch for batch shape (tokens, selected rows).
fn shape_of(kernel: Kernel, grid: Grid, tokens: usize, selected: usize) -> (Kernel, [u32; 3]) {
    let n = tokens as u32;
    match grid {
        Grid::PerRow => (kernel, [n, 1, 1]),
        Grid::LinearRows { selected: sel } => {
            (kernel, [if sel { selected as u32 } else { n }, 1, 1])
        }
        Grid::Elements { width, per } => (kernel, [width.div_ceil(per), n, 1]),
        Grid::Heads { heads, depth } => (kernel, [n, heads, depth]),
        Grid::Attention {
            heads,
            tiled: Some(tiled),
            ..
        } if n > SHORT_BATCH => {
            let splits = match tiled {
                Kernel::AttentionTiled { splits, .. } => splits,
                _ => 1,
            };
            let blocks = n.div_ceil(shaders::TILED_ATTENTION_ROWS);
            (tiled, [blocks, heads, splits])
        }
        Grid::Attention { heads, paged, .. } if n > SHORT_BATCH => (paged, [n, heads, 1]),
        Grid::Attention { heads, .. } => {
            let splits = match kernel {
                Kernel::Attention { splits, .. } => splits,
                _ => 1,
            };
            (kernel, [n, heads, splits])
        }
        Grid::Linear {
            format,
            rows,
            selected: sel,
            input,
            accumulate,
            lanes,
            group_rows,
            tensor_cores,
            argmax,
        } => {
            let m = if sel { selected as u32 } else { n };
            let gemv = |tokens, rows| Kernel::Gemv {
                format,
                tokens,
                lanes,
                rows,
                input,
                accumulate,
                argmax: argmax && Kernel::gemv_argmax_fits(tokens, lanes, rows),
            };
            // A workgroup's 256 / lanes lane groups take `rows` rows each.
            let groups = |per_group: u32| rows.div_ceil(256 / lanes * per_group);
            match m {
                0 | 1 => (gemv(1, group_rows), [groups(group_rows), 1, 1]),
                2..=SHORT_BATCH => (gemv(8, 1), [groups(1), 1, 1]),
                _ => (
                    Kernel::Gemm {
                        format,
                        input,
                        accumulate,
                        split_k: false,
                        tensor_cores,
                    },
                    [rows.div_ceil(GEMM_TILE), m.div_ceil(GEMM_TILE), 1],
                ),
            }
        }
    }
}

fn push_words(words: &[u32]) -> [u8; PUSH_BYTES as usize] {
    let mut out = [0u8; PUSH_BYTES as usize];
    for (chunk, w) in out.chunks_exact_mut(4).zip(words) {
        chunk.copy_from_slice(&w.to_le_bytes());
    }
    out
}

/// What a linear dispatch reads in place of its x (the op folded into it).
#[derive(Clone, Copy, Debug, PartialEq)]
enum FusedInput {
    Plain,
    /// `rms_norm(x) * gain`.
    Norm {
        x: TensorId,
        gain: WeightId,
        eps: f32,
    },
    /// `silu(gate) * up`.
    SwiGlu {
        gate: TensorId,
        up: TensorId,
    },
}

/// How an op of a program becomes dispatches.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Planned {
    /// Its own dispatch(es).
    Alone,
    /// Folded into a linear dispatch (an RMSNorm or SwiGLU before it, an add after it).
    Folded,
    /// A linear layer with what was folded into it; `accumulate` is the tensor it adds into.
    Linear {
        input: FusedInput,
        accumulate: Option<TensorId>,
    },
    /// Attention with the Rope ops on Q and K (their indices) folded in.
    Attention {
        rope_q: Option<usize>,
        rope_k: Option<usize>,
    },
}

/// The tensors a fused input stage reads.
fn fused_sources(input: FusedInput) -> Vec<TensorId> {
    match input {
        FusedInput::Plain => Vec::new(),
        FusedInput::Norm { x, .. } => vec![x],
        FusedInput::SwiGlu { gate, up } => vec![gate, up],
    }
}

fn reads(op: &Op, t: TensorId) -> bool {
    match *op {
        Op::Embed { .. } => false,
        Op::RmsNorm { x, .. } | Op::Linear { x, .. } | Op::Rope { x, .. } => x == t,
        Op::SwiGlu { gate, up, .. } => gate == t || up == t,
        Op::Add { acc, x } => acc == t || x == t,
        Op::Attention { q, k, v, .. } => q == t || k == t || v == t,
    }
}

fn writes(op: &Op, t: TensorId) -> bool {
    match *op {
        Op::Embed { out, .. }
        | Op::RmsNorm { out, .. }
        | Op::Linear { out, .. }
        | Op::SwiGlu { out, .. }
        | Op::Attention { out, .. } => out == t,
        Op::Rope { x, .. } => x == t,
        Op::Add { acc, .. } => acc == t,
    }
}

/// The linear ops that read `t` after op `at` while its value lives (until an op overwrites it
/// without reading it), provided every reader is a linear op and none of `inputs` (what `t` was
/// computed from) changes before the last of them; `None` if `t` has another kind of reader, has
/// no reader, or is never overwritten in the program while `live` says a later reader needs it.
fn linear_readers(
    ops: &[Op],
    at: usize,
    t: TensorId,
    inputs: &[TensorId],
    live: Option<&[TensorId]>,
) -> Option<Vec<usize>> {
    let mut readers = Vec::new();
    let mut inputs_changed = false;
    for (j, op) in ops.iter().enumerate().skip(at + 1) {
        if reads(op, t) {
            let linear = matches!(op, Op::Linear { x, out, .. } if *x == t && *out != t);
            if !linear || inputs_changed {
                return None;
            }
            readers.push(j);
        }
        if writes(op, t) {
            return (!readers.is_empty() && !reads(op, t)).then_some(readers);
        }
        if inputs.iter().any(|&i| writes(op, i)) {
            inputs_changed = true;
        }
    }
    // Not overwritten within the program: foldable only if nothing reads it afterwards.
    (!readers.is_empty() && !is_live(live, t)).then_some(readers)
}

/// Whether `t`'s contents are read after the program ([`Submission::live`]).
fn is_live(live: Option<&[TensorId]>, t: TensorId) -> bool {
    live.is_none_or(|l| l.contains(&t))
}

/// Whether `t` is dead once `ops` have run: the next op touching it overwrites it without
/// reading it, or none does and nothing after the program reads it.
fn dead_in(ops: &[Op], t: TensorId, live: Option<&[TensorId]>) -> bool {
    match ops.iter().find(|o| reads(o, t) || writes(o, t)) {
        Some(o) => !reads(o, t),
        None => !is_live(live, t),
    }
}

/// Plans which ops fold into the linear layers next to them: an RMSNorm or a SwiGLU whose only
/// readers are linear layers becomes their input stage, and an add of a linear layer's output
/// into a residual becomes its output stage. Each fold removes a dispatch and, in a decoder, a
/// barrier: the GPU's cost per token is mostly the chain of dependent dispatches.
fn fuse(ops: &[Op], live: Option<&[TensorId]>) -> Vec<Planned> {
    let mut plan = vec![Planned::Alone; ops.len()];
    let mut input = vec![FusedInput::Plain; ops.len()];
    for (i, op) in ops.iter().enumerate() {
        let (out, fused, sources) = match *op {
            Op::RmsNorm {
                x,
                weight,
                eps,
                out,
            } if x != out => (
                out,
                FusedInput::Norm {
                    x,
                    gain: weight,
                    eps,
                },
                vec![x],
            ),
            Op::SwiGlu { gate, up, out, .. } if out != gate && out != up => {
                (out, FusedInput::SwiGlu { gate, up }, vec![gate, up])
            }
            _ => continue,
        };
        if let Some(readers) = linear_readers(ops, i, out, &sources, live) {
            plan[i] = Planned::Folded;
            for r in readers {
                input[r] = fused;
            }
        }
    }
    for (i, op) in ops.iter().enumerate() {
        let Op::Linear { x, out, rows, .. } = *op else {
            continue;
        };
        let mut accumulate = None;
        // The next op touching `out` adds it into a residual that nothing touches in between,
        // and `out` is dead after that add (overwritten before anything reads it).
        if rows == Rows::All
            && let Some(j) =
                (i + 1..ops.len()).find(|&j| reads(&ops[j], out) || writes(&ops[j], out))
            && let Op::Add { acc, x: added } = ops[j]
            && added == out
            && acc != x
            && acc != out
            && !fused_sources(input[i]).contains(&acc)
            && !ops[i + 1..j]
                .iter()
                .any(|o| reads(o, acc) || writes(o, acc))
            && dead_in(&ops[j + 1..], out, live)
            && plan[j] == Planned::Alone
        {
            accumulate = Some(acc);
            plan[j] = Planned::Folded;
        }
        plan[i] = Planned::Linear {
            input: input[i],
            accumulate,
        };
    }
    for (a, op) in ops.iter().enumerate() {
        let Op::Attention { q, k, v, .. } = *op else {
            continue;
        };
        // The last op before the attention that touches `t`: a Rope on `t` alone, whose result
        // only this attention reads (`t` is overwritten before anything else reads it).
        let folded_rope = |t: TensorId, plan: &[Planned]| {
            let r = (0..a)
                .rev()
                .find(|&j| reads(&ops[j], t) || writes(&ops[j], t))?;
            let dead_after = dead_in(&ops[a + 1..], t, live);
            (matches!(ops[r], Op::Rope { x, .. } if x == t)
                && plan[r] == Planned::Alone
                && dead_after)
                .then_some(r)
        };
        if q == k || q == v || k == v {
            continue;
        }
        let rope_k = folded_rope(k, &plan);
        let rope_q = folded_rope(q, &plan);
        for r in rope_k.iter().chain(&rope_q) {
            plan[*r] = Planned::Folded;
        }
        plan[a] = Planned::Attention { rope_q, rope_k };
    }
    plan
}

/// Every tensor an op names.
fn op_tensors(op: &Op) -> Vec<TensorId> {
    match *op {
        Op::Embed { out, .. } => vec![out],
        Op::RmsNorm { x, out, .. } | Op::Linear { x, out, .. } => vec![x, out],
        Op::Rope { x, .. } => vec![x],
        Op::SwiGlu { gate, up, out, .. } => vec![gate, up, out],
        Op::Add { acc, x } => vec![acc, x],
        Op::Attention { q, k, v, out, .. } => vec![q, k, v, out],
    }
}

/// Orders everything before against everything after: shader, transfer and host accesses.
fn full_barrier(d: &ash::Device, cb: vk::CommandBuffer) {
    let all = vk::AccessFlags::SHADER_READ
        | vk::AccessFlags::SHADER_WRITE
        | vk::AccessFlags::TRANSFER_READ
        | vk::AccessFlags::TRANSFER_WRITE
        | vk::AccessFlags::HOST_READ
        | vk::AccessFlags::HOST_WRITE;
    let barrier = [vk::MemoryBarrier::default()
        .src_access_mask(all)
        .dst_access_mask(all)];
    // The host stage too: a held run's step values are written after its submission (before
    // the host signal it waits for), which only a barrier from the host stage makes visible.
    // SAFETY: recording into `cb`; a global memory barrier with valid stage and access masks.
    unsafe {
        d.cmd_pipeline_barrier(
            cb,
            vk::PipelineStageFlags::ALL_COMMANDS | vk::PipelineStageFlags::HOST,
            vk::PipelineStageFlags::ALL_COMMANDS,
            vk::DependencyFlags::empty(),
            &barrier,
            &[],
            &[],
        )
    };
}

/// Orders earlier compute writes before later compute reads and writes.
fn compute_barrier(d: &ash::Device, cb: vk::CommandBuffer) {
    let barrier = [vk::MemoryBarrier::default()
        .src_access_mask(vk::AccessFlags::SHADER_WRITE | vk::AccessFlags::SHADER_READ)
        .dst_access_mask(vk::AccessFlags::SHADER_READ | vk::AccessFlags::SHADER_WRITE)];
    // SAFETY: recording into `cb`; a global memory barrier between compute stages.
    unsafe {
        d.cmd_pipeline_barrier(
            cb,
            vk::PipelineStageFlags::COMPUTE_SHADER,
            vk::PipelineStageFlags::COMPUTE_SHADER,
            vk::DependencyFlags::empty(),
            &barrier,
            &[],
            &[],
        )
    };
}

/// A weight in its GPU planes: `(format, codes, scales)` bytes.
fn planes(weight: &Weight) -> Option<(WeightFormat, Vec<u8>, Vec<u8>)> {
    match weight {
        Weight::Mx(m) => {
            let (scales, packed) = m.to_linear();
            let codes = mx_quant::wgsl::code_words(&packed);
            let scales = mx_quant::wgsl::words(&scales);
            Some((
                WeightFormat::Mx(m.format()),
                bytemuck::cast_slice(&codes).to_vec(),
                bytemuck::cast_slice(&scales).to_vec(),
            ))
        }
        Weight::Dense(d) => {
            let data = d.data();
            let f16_exact = data
                .iter()
                .all(|&v| half::f16::from_f32(v).to_f32().to_bits() == v.to_bits());
            let bf16_exact = data
                .iter()
                .all(|&v| half::bf16::from_f32(v).to_f32().to_bits() == v.to_bits());
            let (format, codes) = if f16_exact {
                let h: Vec<half::f16> = data.iter().map(|&v| half::f16::from_f32(v)).collect();
                (WeightFormat::F16, bytemuck::cast_slice(&h).to_vec())
            } else if bf16_exact {
                let h: Vec<half::bf16> = data.iter().map(|&v| half::bf16::from_f32(v)).collect();
                (WeightFormat::Bf16, bytemuck::cast_slice(&h).to_vec())
            } else {
                (WeightFormat::F32, bytemuck::cast_slice(data).to_vec())
            };
            Some((format, codes, vec![0; 4]))
        }
        Weight::Block(b) => {
            use crate::ggml::BlockType;
            let ty = b.block_type();
            let block = ty.block_bytes();
            let (format, header, quants) = match ty {
                BlockType::Q8_0 => (WeightFormat::Q8_0, 2, 32),
                BlockType::Q4_0 => (WeightFormat::Q4_0, 2, 16),
                BlockType::Q4_1 => (WeightFormat::Q4_1, 4, 16),
            };
            let mut codes = Vec::with_capacity(b.raw().len());
            let mut scales = Vec::new();
            for blk in b.raw().chunks_exact(block) {
                let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                scales.extend_from_slice(&d.to_le_bytes());
                if header == 4 {
                    let m = half::f16::from_le_bytes([blk[2], blk[3]]).to_f32();
                    scales.extend_from_slice(&m.to_le_bytes());
                }
                codes.extend_from_slice(&blk[header..header + quants]);
            }
            Some((format, codes, scales))
        }
        Weight::Vector(_) => None,
    }
}

impl Device for VulkanNpu {
    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            kind: DeviceKind::Gpu,
            name: format!(
                "{} ({}, Vulkan)",
                self.ctx.adapter.name,
                self.ctx.adapter.kind_name()
            ),
            parallelism: 1,
            isa: if self.tensor_cores {
                "SPIR-V (WGSL via naga; prefill GEMMs on cooperative matrices)"
            } else {
                "SPIR-V (WGSL via naga)"
            }
            .into(),
        }
    }

    fn load_weight(&mut self, weight: Weight) -> Result<WeightId, Error> {
        let id = u32::try_from(self.weights.len()).map_err(|_| Error::Limit { what: "weights" })?;
        let (rows, cols) = weight.shape();
        let bytes = weight.bytes();
        let gpu = match planes(&weight) {
            Some((format, codes, scales)) => {
                if let WeightFormat::Mx(f) = format {
                    mx_quant::wgsl::check_shape(f, rows, cols)?;
                }
                for plane in [&codes, &scales] {
                    if plane.len() as u64 > u64::from(self.ctx.max_storage_range) {
                        return Err(Error::Unsupported {
                            what: "a weight this large",
                            why: format!(
                                "{rows}x{cols} takes {} bytes, past the adapter's {} byte storage-buffer range",
                                plane.len(),
                                self.ctx.max_storage_range
                            ),
                        });
                    }
                }
                let codes = self.upload(&codes)?;
                let scales = match self.upload(&scales) {
                    Ok(s) => s,
                    Err(e) => {
                        self.ctx.destroy(codes);
                        return Err(e);
                    }
                };
                GpuWeight::Matrix {
                    format,
                    rows,
                    cols,
                    codes,
                    scales,
                    bytes,
                    rotated: matches!(&weight, Weight::Mx(m) if m.block_rotation()),
                }
            }
            None => {
                let Weight::Vector(v) = &weight else {
                    unreachable!("planes() covers every matrix")
                };
                GpuWeight::Vector {
                    data: self.upload(bytemuck::cast_slice(v))?,
                    len: v.len(),
                }
            }
        };
        self.weights.push(gpu);
        Ok(WeightId(id))
    }

    fn weight_shape(&self, weight: WeightId) -> Option<(usize, usize)> {
        self.weight_shape_of(weight)
    }

    fn weight_bytes(&self) -> usize {
        self.weights
            .iter()
            .map(|w| match w {
                GpuWeight::Matrix { bytes, .. } => *bytes,
                GpuWeight::Vector { len, .. } => len * 4,
            })
            .sum()
    }

    fn create_tensor(&mut self, width: usize, max_rows: usize) -> Result<TensorId, Error> {
        self.new_tensor(width, max_rows, 0, Memory::Device)
    }

    /// In host memory the GPU writes over the bus (device memory on a unified-memory device):
    /// the host reads the logits in place, with no copy submitted after the program.
    fn create_readback_tensor(&mut self, width: usize, max_rows: usize) -> Result<TensorId, Error> {
        let memory = if self.ctx.unified {
            Memory::Device
        } else {
            Memory::Readback
        };
        // Room for the output head's maxima (`Device::row_argmax`), where its rows fit an
        // f32's exact integers.
        let room = if width < 1 << 24 {
            maxima_room(width, max_rows).ok_or(Error::Limit {
                what: "readback tensor size",
            })?
        } else {
            0
        };
        self.new_tensor(width, max_rows, room, memory)
    }

    fn tensor_shape(&self, tensor: TensorId) -> Option<(usize, usize)> {
        self.tensors
            .get(tensor.0 as usize)
            .map(|t| (t.width, t.max_rows))
    }

    fn submit(&mut self, s: Submission<'_>) -> Result<(), Error> {
        let started = std::time::Instant::now();
        let result = self.submit_program(s, false);
        add_ns(&self.counters.submit_ns, started);
        result
    }

    /// On a GPU; on a CPU implementation only without timestamps (see
    /// [`VulkanConfig::timestamps`]).
    fn holds(&self) -> bool {
        !self.timestamps || !self.ctx.adapter.is_cpu()
    }

    /// Queued behind a private gate timeline the host signals on release; the step buffer
    /// is written then, once the run before (which reads it) is done.
    fn submit_held(&mut self, s: Submission<'_>) -> Result<Held, Error> {
        if !self.holds() {
            return Err(Error::Unsupported {
                what: "held submissions with timestamps on a CPU implementation",
                why: "reading the timestamps waits for the device to go idle, which a held \
                      submission keeps it from (turn VulkanConfig::timestamps off)"
                    .into(),
            });
        }
        let started = std::time::Instant::now();
        let result = self.submit_program(s, true);
        add_ns(&self.counters.submit_ns, started);
        result?;
        Ok(Held(self.held.as_ref().expect("held above").value))
    }

    fn release(&mut self, held: Held, batch: Batch<'_>, kv: Option<&KvCache>) -> Result<(), Error> {
        let started = std::time::Instant::now();
        let run = self.take_held(&held)?;
        let written = self.write_held(&run, &batch, kv);
        // Opened whatever the batch: a refused one runs as a discard does, so the queue moves.
        let opened = self.open_gate(&run);
        add_ns(&self.counters.submit_ns, started);
        written.and(opened)
    }

    fn discard(&mut self, held: Held) -> Result<(), Error> {
        let run = self.take_held(&held)?;
        self.open_gate(&run)
    }

    fn read_tensor(
        &self,
        tensor: TensorId,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), Error> {
        let t = self.tensor(tensor, 0)?;
        check_rows("read_tensor", t.width, t.max_rows, &rows, out.len())?;
        self.wait_all()?;
        self.collect_times()?;
        let started = std::time::Instant::now();
        let result = self.read_back(t, rows.start * t.width * 4, out);
        add_ns(&self.counters.readback_ns, started);
        result
    }
    /// In place when the tensor is mapped (a readback tensor, or any tensor on unified memory):
    /// the host reads the values where the GPU wrote them.
    fn view_tensor(
        &self,
        tensor: TensorId,
        rows: Range<usize>,
        scratch: &mut Vec<f32>,
        view: &mut dyn FnMut(&[f32]),
    ) -> Result<(), Error> {
        let t = self.tensor(tensor, 0)?;
        let values = rows.len().saturating_mul(t.width);
        check_rows("view_tensor", t.width, t.max_rows, &rows, values)?;
        if !t.buffer.is_mapped() {
            return view_copied(self, tensor, rows, scratch, view);
        }
        self.wait_all()?;
        self.collect_times()?;
        // Sound to borrow: every submission that writes a tensor goes through `&mut self`, so
        // none starts while `&self` is borrowed here, and the ones before have completed.
        let bytes = t.buffer.bytes(rows.start * t.width * 4, values * 4)?;
        // In host memory on a device with its own: the GPU's writes over the bus were the
        // transfer, the one the ledger counts per token.
        if !self.ctx.unified {
            self.readback_ledger.record(bytes.len());
        }
        let values: &[f32] = bytemuck::try_cast_slice(bytes).map_err(|e| Error::Unsupported {
            what: "reading a mapped tensor in place",
            why: format!("the mapping is not f32-aligned ({e})"),
        })?;
        view(values);
        Ok(())
    }

    /// From the maxima the output head's GEMV wrote beside the row, where the last run that
    /// wrote the tensor left them (decode steps whose GEMV covers 32 rows or more a workgroup:
    /// `Kernel::gemv_argmax_fits`): a few kilobytes read instead of the row. The pair it picks
    /// is checked against the row's value at that index; otherwise, and where no maxima were
    /// left, the row is scanned as the trait's default does.
    fn row_argmax(&self, tensor: TensorId, row: usize) -> Result<Option<(usize, f32)>, Error> {
        let t = self.tensor(tensor, 0)?;
        let rows = row..row.saturating_add(1);
        check_rows("row_argmax", t.width, t.max_rows, &rows, t.width)?;
        if let (Some(at), Some(m)) = (t.maxima_at, t.maxima)
            && row < m.rows
            && t.buffer.is_mapped()
        {
            self.wait_all()?;
            self.collect_times()?;
            let pairs = t
                .buffer
                .bytes((at + row * m.per_row * 2) * 4, m.per_row * 8)?;
            let pairs: &[f32] =
                bytemuck::try_cast_slice(pairs).map_err(|e| Error::Unsupported {
                    what: "reading a mapped tensor in place",
                    why: format!("the mapping is not f32-aligned ({e})"),
                })?;
            match best_of_maxima(pairs, t.width) {
                Ok(None) => {
                    self.counters
                        .argmax_from_maxima
                        .fetch_add(1, Ordering::Relaxed);
                    return Ok(None);
                }
                Ok(Some((i, v))) => {
                    // Sound to borrow, as in `view_tensor`: every run that writes the tensor
                    // has completed and none starts while `&self` is borrowed.
                    let at_row = t.buffer.bytes((row * t.width + i) * 4, 4)?;
                    let here = f32::from_le_bytes([at_row[0], at_row[1], at_row[2], at_row[3]]);
                    if here.to_bits() == v.to_bits() {
                        if !self.ctx.unified {
                            self.readback_ledger.record(pairs.len() * 4);
                        }
                        self.counters
                            .argmax_from_maxima
                            .fetch_add(1, Ordering::Relaxed);
                        return Ok(Some((i, v)));
                    }
                }
                Err(()) => {}
            }
        }
        scan_row_argmax(self, tensor, row)
    }

    fn write_tensor(
        &mut self,
        tensor: TensorId,
        rows: Range<usize>,
        data: &[f32],
    ) -> Result<(), Error> {
        let t = self.tensor(tensor, 0)?;
        check_rows("write_tensor", t.width, t.max_rows, &rows, data.len())?;
        self.wait_all()?;
        let (offset, mapped) = (rows.start * t.width * 4, t.buffer.is_mapped());
        // The host's values are not what any maxima kept beside them describe.
        self.tensors[tensor.0 as usize].maxima = None;
        let bytes: &[u8] = bytemuck::cast_slice(data);
        if mapped {
            return self.tensors[tensor.0 as usize].buffer.write(offset, bytes);
        }
        let raw = &self.tensors[tensor.0 as usize].buffer;
        self.stage_into(raw, offset as u64, bytes)
    }

    fn timeline(&self) -> Option<Arc<dyn Timeline>> {
        Some(self.public.clone())
    }

    fn waits_in_queue(&self, timeline: &dyn Timeline) -> bool {
        same_device(timeline, self.ctx.device.handle()).is_some() || self.can_import(timeline)
    }

    fn profile(&self) -> Vec<crate::KernelTime> {
        let times = self.kernel_times.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<crate::KernelTime> = times
            .iter()
            .map(|(k, &(count, ns))| crate::KernelTime {
                kernel: format!("{k:?}"),
                dispatches: count,
                time: Duration::from_nanos(ns as u64),
            })
            .collect();
        out.sort_by_key(|k| std::cmp::Reverse(k.time));
        out
    }

    fn stats(&self) -> DeviceStats {
        // Completed submissions' GPU time counts now, not at the next submission.
        let _ = self.collect_times();
        let c = &self.counters;
        let ns = |a: &AtomicU64| Duration::from_nanos(a.load(Ordering::Relaxed));
        DeviceStats {
            submissions: c.submissions.load(Ordering::Relaxed),
            host_waits: c.host_waits.load(Ordering::Relaxed),
            queue_waits: c.queue_waits.load(Ordering::Relaxed),
            submit_time: ns(&c.submit_ns),
            readback_time: ns(&c.readback_ns),
            device_time: self.timestamps.then(|| ns(&c.device_ns)),
            argmax_from_maxima: c.argmax_from_maxima.load(Ordering::Relaxed),
        }
    }
}

impl VulkanNpu {
    /// A tensor of `width * max_rows` f32s, and `room` more past them (a readback tensor's
    /// maxima, [`GpuTensor::maxima_at`]).
    fn new_tensor(
        &mut self,
        width: usize,
        max_rows: usize,
        room: usize,
        memory: Memory,
    ) -> Result<TensorId, Error> {
        let values = width.checked_mul(max_rows);
        let bytes = values
            .and_then(|e| e.checked_add(room))
            .and_then(|e| e.checked_mul(4))
            .filter(|&b| {
                values.is_some_and(|v| v > 0) && b as u64 <= u64::from(self.ctx.max_storage_range)
            })
            .ok_or(Error::Limit {
                what: "tensor size (width * rows * 4 must be > 0 and within the storage-buffer range)",
            })?;
        let id = u32::try_from(self.tensors.len()).map_err(|_| Error::Limit { what: "tensors" })?;
        let buffer = self.ctx.buffer(bytes as u64, memory)?;
        self.tensors.push(GpuTensor {
            width,
            max_rows,
            buffer,
            maxima_at: (room > 0).then_some(width * max_rows),
            maxima: None,
        });
        Ok(TensorId(id))
    }

    /// Copies `out.len()` values at byte `offset` of a tensor whose writes have completed.
    fn read_back(&self, t: &GpuTensor, offset: usize, out: &mut [f32]) -> Result<(), Error> {
        let len = out.len() * 4;
        if t.buffer.is_mapped() {
            t.buffer.read(offset, bytemuck::cast_slice_mut(out))?;
            // In host memory on a device with its own: the GPU's writes over the bus were the
            // transfer, the one the ledger counts per token.
            if !self.ctx.unified {
                self.readback_ledger.record(len);
            }
            return Ok(());
        }
        let mut transfer = self.transfer.lock().unwrap_or_else(|p| p.into_inner());
        if transfer
            .readback
            .as_ref()
            .is_none_or(|b| (b.size as usize) < len)
        {
            if let Some(old) = transfer.readback.take() {
                self.ctx.destroy(old);
            }
            transfer.readback = Some(
                self.ctx
                    .buffer(len.next_power_of_two() as u64, Memory::Readback)?,
            );
        }
        let dst = transfer
            .readback
            .as_ref()
            .map(|b| b.raw)
            .expect("allocated above");
        let region = [vk::BufferCopy::default()
            .src_offset(offset as u64)
            .size(len as u64)];
        let src = t.buffer.raw;
        self.one_shot(&mut transfer, |d, cb| {
            // SAFETY: both buffers are live; the region lies inside the tensor (checked by the
            // caller) and the readback buffer (sized above).
            unsafe { d.cmd_copy_buffer(cb, src, dst, &region) }
        })?;
        transfer
            .readback
            .as_ref()
            .expect("allocated above")
            .read(0, bytemuck::cast_slice_mut(out))?;
        self.readback_ledger.record(len);
        Ok(())
    }

    /// Refuses a token id outside an embedding op's vocabulary (spliced rows aside).
    fn check_tokens(&self, ops: &[Op], batch: &Batch<'_>) -> Result<(), Error> {
        for (i, op) in ops.iter().enumerate() {
            let Op::Embed { table, .. } = op else {
                continue;
            };
            let (vocab, _) = self.weight_shape_of(*table).unwrap_or((0, 0));
            let spliced = batch.embeddings.as_ref().map_or(0..0, |e| e.rows.clone());
            if let Some((r, t)) = batch
                .tokens
                .iter()
                .enumerate()
                .find(|(r, t)| !spliced.contains(r) && **t as usize >= vocab)
            {
                return Err(Error::BadOp {
                    op: i,
                    what: format!(
                        "embed: token id {t} (row {r}) is outside the vocabulary of {vocab}"
                    ),
                });
            }
        }
        Ok(())
    }

    /// [`Device::release`]'s checks and step write, short of opening the gate.
    fn write_held(
        &mut self,
        run: &HeldRun,
        batch: &Batch<'_>,
        kv: Option<&KvCache>,
    ) -> Result<(), Error> {
        if batch.tokens.len() != run.tokens
            || batch.select != run.select
            || batch.slots.len() != batch.tokens.len()
            || batch.embeddings.is_some()
        {
            return Err(Error::BadOp {
                op: 0,
                what: format!(
                    "a release of {} tokens selecting {:?} ({} slots{}) for a submission held \
                     with {} tokens selecting {:?}",
                    batch.tokens.len(),
                    batch.select,
                    batch.slots.len(),
                    if batch.embeddings.is_some() {
                        ", spliced rows"
                    } else {
                        ""
                    },
                    run.tokens,
                    run.select
                ),
            });
        }
        let p = &self.programs[run.program];
        if p.kv.is_some() && kv.map(KvKey::of) != p.kv {
            return Err(Error::BadOp {
                op: 0,
                what: "a release over another KV cache than the held submission's".into(),
            });
        }
        if let (Some(k), Some(_)) = (kv, p.kv) {
            let total = k.manager().total_blocks() as u32;
            if let Some(s) = batch.slots.iter().find(|s| s.block >= total) {
                return Err(Error::BadOp {
                    op: 0,
                    what: format!("slot block {} of a cache of {total} blocks", s.block),
                });
            }
        }
        self.check_tokens(&self.programs[run.program].ops, batch)?;
        // Every run before the held one, the program's previous among them, is done before its
        // step buffer is rewritten (the caller read its results already, so this costs nothing).
        self.wait_done(run.value - 1)?;
        self.collect_times()?;
        self.write_step(run.program, batch, kv, 0)
    }

    /// Opens the gate a held run waits on; the maxima it leaves are then the ones in force.
    fn open_gate(&mut self, run: &HeldRun) -> Result<(), Error> {
        self.leave_maxima(run.program, run.shape, run.tokens, run.select.len());
        self.gate.signal(run.gate).map_err(Error::from)
    }

    /// Records which readback tensors a run of program `pi`'s command buffer `shape`, over
    /// `tokens` tokens and `selected` selected rows, leaves maxima in.
    fn leave_maxima(&mut self, pi: usize, shape: RecordKey, tokens: usize, selected: usize) {
        let Some(recorded) = self.programs[pi].recorded.get(&shape) else {
            return;
        };
        for w in &recorded.maxima {
            let rows = if w.selected { selected } else { tokens };
            if let Some(t) = self.tensors.get_mut(w.tensor as usize) {
                t.maxima = w.per_row.map(|p| Maxima {
                    per_row: p as usize,
                    rows,
                });
            }
        }
    }

    /// The held run, checked against the handle.
    fn take_held(&mut self, held: &Held) -> Result<HeldRun, Error> {
        match self.held.take() {
            Some(run) if run.value == held.0 => Ok(run),
            other => {
                self.held = other;
                Err(Error::BadOp {
                    op: 0,
                    what: "a release or discard of a submission this device does not hold".into(),
                })
            }
        }
    }

    /// Runs a submission; `hold` queues it behind the gate instead ([`Device::submit_held`]):
    /// its step values are written, and the gate opened, by [`Device::release`].
    fn submit_program(&mut self, s: Submission<'_>, hold: bool) -> Result<(), Error> {
        if self.held.is_some() {
            return Err(held_pending());
        }
        let Submission {
            ops,
            batch,
            kv,
            attention,
            wait,
            signal,
            live,
        } = s;
        if batch.tokens.is_empty() {
            return Err(Error::BadOp {
                op: 0,
                what: "the batch has no tokens".into(),
            });
        }
        let device = self.ctx.device.handle();
        if hold
            && (batch.embeddings.is_some()
                || attention.is_some()
                || signal.is_some_and(|(t, _)| same_device(t, device).is_none()))
        {
            return Err(Error::Unsupported {
                what: "this held submission",
                why: "a held submission takes no spliced embeddings and no attention statistics, \
                      and signals a timeline of this device"
                    .into(),
            });
        }
        let kv: Option<&KvCache> = kv.map(|k| &*k);
        let has_attention = ops.iter().any(|o| matches!(o, Op::Attention { .. }));
        let kv_key = match kv {
            Some(k) if has_attention => Some(self.mirror(k)?),
            _ => None,
        };
        let stats = attention.is_some();
        let found = self.find_program(ops, kv_key, stats, live);
        let shape = batch.embeddings.is_none().then(|| ValidShape {
            tokens: batch.tokens.len(),
            slots: batch.slots.len(),
            select: batch.select.clone(),
            kv: kv.map(|k| *k.layout()),
        });
        let checked = shape.is_some()
            && found.is_some_and(|pi| self.programs[pi].checked.as_ref() == shape.as_ref());
        let weight_shape = |w: WeightId| self.weight_shape_of(w);
        let tensor_shape = |t: TensorId| self.tensor_shape(t);
        if !checked {
            for (i, op) in ops.iter().enumerate() {
                check_op(
                    i,
                    op,
                    &batch,
                    kv.map(KvCache::layout),
                    &weight_shape,
                    &tensor_shape,
                )?;
                self.check_gpu(i, op)?;
            }
        }
        // Token ids change every step: always checked.
        self.check_tokens(ops, &batch)?;
        let pi = match found {
            Some(i) => i,
            None => {
                let p = self.build_program(ops, kv_key, stats, live)?;
                self.programs.push(p);
                self.programs.len() - 1
            }
        };
        self.programs[pi].checked = shape;
        // The step buffer is rewritten only once the program's last run is done (and its
        // timestamps are read before it runs again); a held run's is, by `release`.
        if !hold {
            self.wait_done(self.programs[pi].last)?;
        }
        self.collect_times()?;
        // Rows another engine wrote into a unified buffer are read where they are.
        let (splice, splice_at) = match batch.embeddings.as_ref().map(|e| e.data) {
            Some(EmbeddingData::Unified { buffer, offset, .. }) => {
                let at = u32::try_from(offset / 4).map_err(|_| Error::Limit {
                    what: "unified embedding offsets",
                })?;
                (self.splice_import(pi, buffer)?, at)
            }
            _ => (0, 0),
        };
        if !hold {
            self.write_step(pi, &batch, kv, splice_at)?;
        }
        let shape = (
            batch.tokens.len().next_power_of_two(),
            batch.select.len().next_power_of_two(),
            splice,
        );
        if !self.programs[pi].recorded.contains_key(&shape) {
            let r = self.record(pi, shape)?;
            self.programs[pi].recorded.insert(shape, r);
        }
        // Vulkan timelines of this device, or of another device of this GPU that exports them,
        // are waited on in the queue; anything else from the host.
        let foreign = match wait {
            Some((t, _)) if same_device(t, device).is_none() => self.importable(t)?,
            _ => None,
        };
        let mut waits: Vec<(&VulkanTimeline, u64)> = Vec::new();
        if let Some((t, v)) = wait {
            match (same_device(t, device), foreign) {
                // A value this device's timeline has reached already is no wait at all: left
                // out of the submission, so the driver has one semaphore fewer to process.
                (Some(vt), _) => {
                    if vt.value()? < v {
                        waits.push((vt, v));
                    }
                }
                (None, Some(i)) => {
                    waits.push((&self.foreign_timelines[i].1, v));
                    self.counters.queue_waits.fetch_add(1, Ordering::Relaxed);
                }
                (None, None) => {
                    if t.value()? < v {
                        self.counters.host_waits.fetch_add(1, Ordering::Relaxed);
                    }
                    t.wait(v, self.wait_timeout)?;
                }
            }
        }
        let mut signals: Vec<(&VulkanTimeline, u64)> = Vec::new();
        let mut host_signal = None;
        if let Some((t, v)) = signal {
            match same_device(t, device) {
                Some(vt) => {
                    let current = vt.value()?;
                    if v <= current {
                        return Err(Error::Timeline(sync_timeline::Error::Backwards {
                            current,
                            requested: v,
                        }));
                    }
                    signals.push((vt, v))
                }
                None => host_signal = Some((t, v)),
            }
        }
        // A held run waits for the gate's next value, which only `release` / `discard` signal.
        let gate_value = if hold {
            let v = self.gate.value()? + 1;
            waits.push((&self.gate, v));
            v
        } else {
            0
        };
        let recorded = &self.programs[pi].recorded[&shape];
        let (commands, stamps) = (recorded.commands, recorded.timestamps);
        let kernels = recorded.kernels.clone();
        let value = self.submit_raw(commands, &waits, &signals)?;
        self.programs[pi].last = value;
        if hold {
            self.held = Some(HeldRun {
                value,
                gate: gate_value,
                program: pi,
                tokens: batch.tokens.len(),
                select: batch.select.clone(),
                shape,
            });
        } else {
            self.leave_maxima(pi, shape, batch.tokens.len(), batch.select.len());
        }
        self.counters.submissions.fetch_add(1, Ordering::Relaxed);
        if let Some(pool) = stamps {
            self.pending_times
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(Pending {
                    pool,
                    value,
                    kernels,
                });
        }
        if let Some(tracker) = attention {
            // The statistics are read once the run is done (a host wait), before any signal
            // says it is.
            self.wait_done(value)?;
            self.read_attention(pi, ops, &batch, kv, tracker)?;
        }
        if let Some((t, v)) = host_signal {
            self.wait_done(value)?;
            t.signal(v)?;
        }
        Ok(())
    }

    /// Adds program `pi`'s attention statistics from its last (completed) run to `tracker`,
    /// per attention op's layer, over the sequence's cached tokens.
    fn read_attention(
        &self,
        pi: usize,
        ops: &[Op],
        batch: &Batch<'_>,
        kv: Option<&KvCache>,
        tracker: &mut kv_paged::prune::AttentionTracker,
    ) -> Result<(), Error> {
        let (Some((stats, keys)), Some(kv)) = (&self.programs[pi].stats, kv) else {
            return Err(Error::BadOp {
                op: 0,
                what: "attention statistics asked of a program with no attention over a cache"
                    .into(),
            });
        };
        let len = kv.manager().len(batch.seq)?;
        if len > *keys {
            return Err(Error::Limit {
                what: "cached tokens past the attention statistics' room",
            });
        }
        let (mut mass, mut last) = (vec![0f32; len], vec![0f32; len]);
        for op in ops {
            let Op::Attention { layer, .. } = *op else {
                continue;
            };
            let at = layer * 2 * keys * 4;
            stats.read(at, bytemuck::cast_slice_mut(&mut mass))?;
            stats.read(at + keys * 4, bytemuck::cast_slice_mut(&mut last))?;
            tracker.accumulate(layer, batch.tokens.len(), &mass, &last)?;
        }
        Ok(())
    }
}

impl VulkanNpu {
    /// The import of `buffer` (made now if new) and its embedding descriptor set in program
    /// `pi` (made now if new); returns the import's id.
    fn splice_import(&mut self, pi: usize, buffer: &Arc<UnifiedBuffer>) -> Result<u32, Error> {
        let key = Arc::as_ptr(buffer) as usize;
        let id = match self.splice_imports.iter().find(|i| i.key == key) {
            Some(i) => i.id,
            None => {
                if self.splice_imports.len() == MAX_SPLICE_IMPORTS {
                    self.evict_splice_import()?;
                }
                let ctx = &self.ctx;
                // SAFETY: instance, physical device and device are the context's, live while
                // the import is (it is destroyed before the context, after the queue is idle);
                // the device only reads the memory (the embedding kernel), which races no
                // reference the CPU holds.
                let raw = unsafe {
                    uvm_alloc::vulkan::import_raw(
                        &ctx.instance.instance,
                        &ctx.device,
                        ctx.physical,
                        &ctx.imports,
                        Arc::clone(buffer),
                    )
                }
                .map_err(|e| Error::Unsupported {
                    what: "reading another engine's embeddings in place",
                    why: format!("{e} (on {})", ctx.adapter.name),
                })?;
                self.next_import += 1;
                let id = self.next_import;
                self.splice_imports.push(SpliceImport { id, key, raw });
                id
            }
        };
        if self.programs[pi].splice_sets.iter().any(|(i, _)| *i == id) {
            return Ok(id);
        }
        let Some((_, kernel, mut buffers)) = self.programs[pi].embed else {
            return Err(Error::BadOp {
                op: 0,
                what: "spliced embeddings for a program with no embedding op".into(),
            });
        };
        if self.programs[pi].splice_pool == vk::DescriptorPool::null() {
            let sets = MAX_SPLICE_IMPORTS as u32;
            let sizes = [vk::DescriptorPoolSize::default()
                .ty(vk::DescriptorType::STORAGE_BUFFER)
                .descriptor_count(sets * buffers.len() as u32)];
            let info = vk::DescriptorPoolCreateInfo::default()
                .flags(vk::DescriptorPoolCreateFlags::FREE_DESCRIPTOR_SET)
                .max_sets(sets)
                .pool_sizes(&sizes);
            // SAFETY: a valid create info on a live device.
            self.programs[pi].splice_pool =
                unsafe { self.ctx.device.create_descriptor_pool(&info, None) }
                    .map_err(vk_err("vkCreateDescriptorPool"))?;
        }
        buffers[3] = self
            .splice_imports
            .iter()
            .find(|i| i.id == id)
            .map(|i| i.raw.buffer)
            .expect("imported above");
        let set = self.descriptor_set(self.programs[pi].splice_pool, kernel, &buffers)?;
        self.programs[pi].splice_sets.push((id, set));
        Ok(id)
    }

    /// Drops the oldest splice import, with every recording and descriptor set that uses it,
    /// once the queue is idle.
    fn evict_splice_import(&mut self) -> Result<(), Error> {
        self.wait_all()?;
        let old = self.splice_imports.remove(0);
        let mut stale = Vec::new();
        for p in &mut self.programs {
            let keys: Vec<RecordKey> = p
                .recorded
                .keys()
                .filter(|k| k.2 == old.id)
                .copied()
                .collect();
            stale.extend(keys.into_iter().filter_map(|k| p.recorded.remove(&k)));
            if let Some(at) = p.splice_sets.iter().position(|(i, _)| *i == old.id) {
                let (_, set) = p.splice_sets.remove(at);
                // SAFETY: the set is from this pool (made with FREE_DESCRIPTOR_SET) and no
                // pending work uses it (the queue is idle).
                unsafe { self.ctx.device.free_descriptor_sets(p.splice_pool, &[set]) }
                    .map_err(vk_err("vkFreeDescriptorSets"))?;
            }
        }
        for r in stale {
            self.destroy_recorded(r);
        }
        // SAFETY: the import was made on this device and the queue is idle.
        unsafe { old.raw.destroy(&self.ctx.device) };
        Ok(())
    }

    /// Whether `t` is a Vulkan timeline of another device on this GPU and driver, exported
    /// as an opaque fd this device can import.
    fn can_import(&self, t: &dyn Timeline) -> bool {
        match t.backend() {
            sync_timeline::Backend::Vulkan(vt) => {
                self.ctx.imports_timelines && vt.export_target() == Some(self.ctx.export_target)
            }
            _ => false,
        }
    }

    /// Where `t` is a Vulkan timeline of another device on this GPU that exports its
    /// semaphore, its import into this device (made now if new) as an index into
    /// `foreign_timelines`; `None` when it must be waited on from the host.
    fn importable(&mut self, t: &dyn Timeline) -> Result<Option<usize>, Error> {
        let sync_timeline::Backend::Vulkan(vt) = t.backend() else {
            return Ok(None);
        };
        if !self.can_import(t) {
            return Ok(None);
        }
        if let Some(i) = self
            .foreign_timelines
            .iter()
            .position(|(id, _)| *id == vt.id())
        {
            return Ok(Some(i));
        }
        if self.foreign_timelines.len() == MAX_FOREIGN_TIMELINES {
            // Nothing pending may still wait on the one dropped.
            self.wait_all()?;
            self.foreign_timelines.remove(0);
        }
        let fd = vt.export_opaque_fd()?;
        let owner: Arc<dyn std::any::Any + Send + Sync> = self.ctx.clone();
        // SAFETY: the device has VK_KHR_external_semaphore_fd enabled (`imports_timelines`) and
        // the exporter's GPU and driver (checked above); `owner` keeps the device alive; the
        // import only ever waits in this device's queue, and `Drop` (and the eviction above)
        // wait for the queue to be idle before it goes.
        let imported = unsafe {
            VulkanTimeline::import_opaque_fd(
                &self.ctx.instance.instance,
                self.ctx.device.clone(),
                owner,
                fd,
            )
        }?;
        self.foreign_timelines.push((vt.id(), imported));
        Ok(Some(self.foreign_timelines.len() - 1))
    }
}

impl Drop for VulkanNpu {
    fn drop(&mut self) {
        // A held run stops the queue: let it run (as a discard) so the queue can drain.
        if let Some(run) = self.held.take() {
            let _ = self.open_gate(&run);
        }
        // Nothing may be destroyed under the queue: wait for it (a lost device leaks rather than
        // destroy objects the GPU may still use).
        let idle = self.wait_all().is_ok();
        if !idle {
            // The imported timelines too: a queue may still wait on them (the splice imports
            // leak by themselves when not destroyed).
            std::mem::forget(std::mem::take(&mut self.foreign_timelines));
            return;
        }
        for p in std::mem::take(&mut self.programs) {
            self.destroy_program(p);
        }
        for i in std::mem::take(&mut self.splice_imports) {
            // SAFETY: made on this device; the queue is idle.
            unsafe { i.raw.destroy(&self.ctx.device) };
        }
        self.pipelines.destroy(&self.ctx);
        for w in std::mem::take(&mut self.weights) {
            match w {
                GpuWeight::Matrix { codes, scales, .. } => {
                    self.ctx.destroy(codes);
                    self.ctx.destroy(scales);
                }
                GpuWeight::Vector { data, .. } => self.ctx.destroy(data),
            }
        }
        for t in std::mem::take(&mut self.tensors) {
            self.ctx.destroy(t.buffer);
        }
        for (_, b, _) in std::mem::take(&mut self.rope_tables) {
            self.ctx.destroy(b);
        }
        if let Some(m) = self.kv.take() {
            self.ctx.destroy(m.pages);
        }
        let transfer = self.transfer.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = transfer.readback.take() {
            self.ctx.destroy(b);
        }
        // SAFETY: the queue is idle (waited above); the pools' buffers are not pending.
        unsafe {
            self.ctx.device.destroy_command_pool(transfer.pool, None);
        }
        // SAFETY: as above.
        unsafe {
            self.ctx
                .device
                .destroy_command_pool(self.program_pool, None)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Numerics, RopeStyle};

    /// A decoder's two layers plan into five linear dispatches and one attention per layer:
    /// the norms, SwiGLUs, adds and RoPEs fold, except where a value outlives the program (the
    /// last layer's K, Q and down output, the final norm the head reads).
    #[test]
    fn a_decoder_program_folds_its_row_wise_ops() {
        let t = TensorId;
        let w = WeightId;
        let (x, xn, q, k, v, attn, o, gate, up, act) =
            (t(0), t(1), t(2), t(3), t(4), t(5), t(6), t(7), t(8), t(9));
        let linear = |weight, x, out| Op::Linear {
            weight: w(weight),
            x,
            out,
            rows: Rows::All,
        };
        let rope = |x| Op::Rope {
            x,
            head_dim: 64,
            theta: 1e4,
            style: RopeStyle::Interleaved,
            numerics: Numerics::Standard,
        };
        let mut ops = vec![Op::Embed {
            table: w(0),
            out: x,
        }];
        for layer in 0..2 {
            ops.extend([
                Op::RmsNorm {
                    x,
                    weight: w(1),
                    eps: 1e-5,
                    out: xn,
                },
                linear(2, xn, q),
                linear(3, xn, k),
                linear(4, xn, v),
                rope(q),
                rope(k),
                Op::Attention {
                    layer,
                    q,
                    k,
                    v,
                    out: attn,
                    q_heads: 4,
                    numerics: Numerics::Standard,
                },
                linear(5, attn, o),
                Op::Add { acc: x, x: o },
                Op::RmsNorm {
                    x,
                    weight: w(6),
                    eps: 1e-5,
                    out: xn,
                },
                linear(7, xn, gate),
                linear(8, xn, up),
                Op::SwiGlu {
                    gate,
                    up,
                    out: act,
                    numerics: Numerics::Standard,
                },
                linear(9, act, o),
                Op::Add { acc: x, x: o },
            ]);
        }
        ops.push(Op::RmsNorm {
            x,
            weight: w(10),
            eps: 1e-5,
            out: xn,
        });
        let plan = fuse(&ops, None);
        let folded = plan.iter().filter(|p| **p == Planned::Folded).count();
        // Layer 0: 2 norms, 2 ropes, 2 adds, 1 SwiGLU; layer 1: its norms, the add after O
        // (o is rewritten by down), nothing after down (o is never rewritten), RoPE on neither Q
        // nor K (never rewritten), no SwiGLU (act is never rewritten).
        assert_eq!(folded, 7 + 3, "{plan:?}");
        let norm = FusedInput::Norm {
            x,
            gain: w(1),
            eps: 1e-5,
        };
        assert_eq!(
            plan[2],
            Planned::Linear {
                input: norm,
                accumulate: None
            }
        );
        assert_eq!(
            plan[8],
            Planned::Linear {
                input: FusedInput::Plain,
                accumulate: Some(x)
            }
        );
        assert_eq!(
            plan[14],
            Planned::Linear {
                input: FusedInput::SwiGlu { gate, up },
                accumulate: Some(x)
            }
        );
        assert_eq!(
            plan[7],
            Planned::Attention {
                rope_q: Some(5),
                rope_k: Some(6)
            }
        );
        // The final norm's output is read by another submission: it runs on its own.
        assert_eq!(plan[ops.len() - 1], Planned::Alone);

        // Told that only the final norm's output is read afterwards, layer 1 folds as layer 0
        // does (7 each), while the final norm still runs.
        let plan = fuse(&ops, Some(&[xn]));
        let folded = plan.iter().filter(|p| **p == Planned::Folded).count();
        assert_eq!(folded, 7 + 7, "{plan:?}");
        assert_eq!(plan[ops.len() - 1], Planned::Alone);
        // With the head after it in the program and only the logits live, it folds too.
        let logits = t(10);
        ops.push(Op::Linear {
            weight: w(11),
            x: xn,
            out: logits,
            rows: Rows::Selected,
        });
        let plan = fuse(&ops, Some(&[logits]));
        assert_eq!(plan[ops.len() - 2], Planned::Folded, "{plan:?}");
        assert_eq!(
            plan[ops.len() - 1],
            Planned::Linear {
                input: FusedInput::Norm {
                    x,
                    gain: w(10),
                    eps: 1e-5
                },
                accumulate: None
            }
        );
    }
}
