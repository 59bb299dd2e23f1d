//! The device abstraction: weights, activation tensors in unified buffers, the op set, and
//! submissions that wait on and signal timeline values.
//!
//! A model is compiled once into a list of [`Op`]s over [`TensorId`]s and [`WeightId`]s (a
//! "graph" in the loose sense: a straight-line program). Each [`Submission`] runs that program
//! over one [`Batch`] of tokens: the batch supplies what changes from step to step (token ids,
//! positions, KV slots), the program stays the same. That is the shape NPU runtimes want (record
//! once, replay per step), and it keeps the per-token cost on the CPU backend to the ops
//! themselves.
//!
//! Tensors are `[rows, width]` f32 matrices, one row per token of the batch, each in its own
//! [`uvm_alloc::UnifiedBuffer`], so another engine can import them without a copy.
//!
//! [`Device`] is object-safe: the pipeline holds `Box<dyn Device>` and picks the backend at run
//! time; [`Backend`] is the discovery side of the family.

use std::ops::Range;

use kv_paged::{KvCache, SeqId, Slot};
use mx_quant::gemv::MxMatrix;
use sync_timeline::Timeline;

use crate::Error;
use crate::kernels::{DenseMatrix, RopeStyle};

/// A weight loaded into a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WeightId(pub(crate) u32);

/// An activation tensor created on a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TensorId(pub(crate) u32);

/// Weight data as handed to [`Device::load_weight`].
#[derive(Clone, Debug)]
pub enum Weight {
    /// A matrix in mx-quant's tiled MX layout (linear layers, embedding tables).
    Mx(MxMatrix),
    /// A dense f32 matrix.
    Dense(DenseMatrix),
    /// A matrix in ggml's own block format (Q4_0, Q4_1, Q8_0) as a GGUF file stores it, with
    /// ggml's integer dot products (the exact policy's storage for such files).
    Block(crate::ggml::BlockMatrix),
    /// A vector (norm gains).
    Vector(Vec<f32>),
}

impl Weight {
    /// `(rows, cols)`; a vector is `(1, len)`.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            Weight::Mx(m) => m.shape(),
            Weight::Dense(d) => d.shape(),
            Weight::Block(b) => b.shape(),
            Weight::Vector(v) => (1, v.len()),
        }
    }

    /// Bytes held (and streamed by a full GEMV).
    pub fn bytes(&self) -> usize {
        match self {
            Weight::Mx(m) => m.stream_bytes(),
            Weight::Dense(d) => d.bytes(),
            Weight::Block(b) => b.bytes(),
            Weight::Vector(v) => v.len() * 4,
        }
    }
}

/// Which rows of its input a row-wise op reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rows {
    /// Every row of the batch (`0..tokens`), written to the same rows of the output.
    All,
    /// The batch's [`Batch::select`] rows, written to output rows `0..select.len()`: the output
    /// projection of a prompt only needs the logits of the rows that are scored or sampled.
    Selected,
}

/// One operation of a transformer decoder. Row-wise ops process the batch's rows `0..n`
/// (`n = Batch::tokens.len()`); outputs never alias inputs except where an op says it works in
/// place.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// `out[i] = table[tokens[i]]`, except the rows of [`Batch::embeddings`], which are taken
    /// from there (an image encoder's output spliced into the token stream).
    Embed { table: WeightId, out: TensorId },
    /// `out[i] = rms_norm(x[i]) * weight`.
    RmsNorm {
        x: TensorId,
        weight: WeightId,
        eps: f32,
        out: TensorId,
    },
    /// `out[i] = W x[i]` (see [`Rows`]).
    Linear {
        weight: WeightId,
        x: TensorId,
        out: TensorId,
        rows: Rows,
    },
    /// Rotary position embedding, in place: row `i` is at position `first_pos + i`.
    Rope {
        x: TensorId,
        head_dim: usize,
        theta: f32,
        style: RopeStyle,
    },
    /// `out = silu(gate) * up`.
    SwiGlu {
        gate: TensorId,
        up: TensorId,
        out: TensorId,
        numerics: crate::kernels::Numerics,
    },
    /// `acc += x`, in place.
    Add { acc: TensorId, x: TensorId },
    /// Writes row `i` of `k` and `v` into the KV cache at `slots[i]` for `layer`, then causal
    /// grouped-query attention of `q` over the sequence into `out`.
    Attention {
        layer: usize,
        q: TensorId,
        k: TensorId,
        v: TensorId,
        out: TensorId,
        q_heads: usize,
        numerics: crate::kernels::Numerics,
    },
}

/// What changes between submissions of the same program.
#[derive(Clone, Debug)]
pub struct Batch<'a> {
    /// The batch's tokens (one row each).
    pub tokens: &'a [u32],
    /// Position of the first token in its sequence.
    pub first_pos: usize,
    /// The sequence whose KV cache attention reads and writes.
    pub seq: SeqId,
    /// Where each token's K and V go (from [`KvCache::append`]); one per token.
    pub slots: &'a [Slot],
    /// The rows [`Rows::Selected`] ops read.
    pub select: Range<usize>,
    /// Rows whose input embedding another engine produced, read in place by [`Op::Embed`].
    pub embeddings: Option<Embeddings<'a>>,
}

/// Input embeddings for a run of batch rows, supplied instead of table lookups: how an image
/// encoder's output (a unified buffer the GPU wrote) enters the decoder without a copy of its
/// own. `data` holds `rows.len()` rows of the embedding table's width.
#[derive(Clone, Debug)]
pub struct Embeddings<'a> {
    /// Batch rows (indices into [`Batch::tokens`]) that take their embedding from `data`.
    pub rows: Range<usize>,
    pub data: &'a [f32],
}

/// One submission: a program, its batch, the KV cache it uses, and the timeline values it waits
/// for before starting and signals when done.
#[derive(Debug)]
pub struct Submission<'a> {
    pub ops: &'a [Op],
    pub batch: Batch<'a>,
    pub kv: Option<&'a mut KvCache>,
    pub wait: Option<(&'a dyn Timeline, u64)>,
    pub signal: Option<(&'a dyn Timeline, u64)>,
}

/// What kind of engine a device is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// The CPU reference NPU.
    Cpu,
    /// A device that accepts nothing (see [`crate::EmptyDevice`]).
    Empty,
    /// A Linux accel device.
    Accel,
}

/// A device's description.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub kind: DeviceKind,
    pub name: String,
    /// Worker threads (CPU) or engines.
    pub parallelism: usize,
    /// The SIMD level or instruction set the kernels use.
    pub isa: String,
}

/// A device that runs [`Op`] programs. Object-safe.
pub trait Device: Send + std::fmt::Debug {
    /// What the device is.
    fn info(&self) -> DeviceInfo;
    /// Loads a weight; the device owns it from now on.
    fn load_weight(&mut self, weight: Weight) -> Result<WeightId, Error>;
    /// `(rows, cols)` of a loaded weight.
    fn weight_shape(&self, weight: WeightId) -> Option<(usize, usize)>;
    /// Bytes of every loaded weight.
    fn weight_bytes(&self) -> usize;
    /// Creates a `[max_rows, width]` f32 activation tensor.
    fn create_tensor(&mut self, width: usize, max_rows: usize) -> Result<TensorId, Error>;
    /// `(width, max_rows)` of a tensor.
    fn tensor_shape(&self, tensor: TensorId) -> Option<(usize, usize)>;
    /// Waits for `submission.wait`, runs its ops over its batch, then signals `submission.signal`.
    /// On error the signal is not sent, so a waiter sees a timeout rather than bad data.
    fn submit(&mut self, submission: Submission<'_>) -> Result<(), Error>;
    /// Copies rows `rows` of `tensor` into `out` (`rows.len() * width` values).
    fn read_tensor(
        &self,
        tensor: TensorId,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), Error>;
    /// Writes rows `rows` of `tensor` from `data`.
    fn write_tensor(
        &mut self,
        tensor: TensorId,
        rows: Range<usize>,
        data: &[f32],
    ) -> Result<(), Error>;
}

/// The discovery side of the trait family: what devices a backend can open on this machine.
pub trait Backend: std::fmt::Debug {
    /// The backend's name (`cpu`, `accel`, ...).
    fn name(&self) -> &'static str;
    /// One line per device this backend sees, each saying whether it can execute.
    fn probe(&self) -> Vec<Probe>;
    /// Opens the default device of this backend.
    fn open(&self) -> Result<Box<dyn Device>, Error>;
}

/// A device as discovery reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Probe {
    pub backend: &'static str,
    pub name: String,
    /// `Ok(())` when ops can run on it, or why not.
    pub usable: Result<(), String>,
}
