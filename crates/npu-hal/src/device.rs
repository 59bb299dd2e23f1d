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
        /// How the rotation rounds (see [`crate::kernels::rope`]).
        numerics: crate::kernels::Numerics,
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
/// encoder's output enters the decoder. `data` holds `rows.len()` rows of the embedding table's
/// width.
#[derive(Clone, Debug)]
pub struct Embeddings<'a> {
    /// Batch rows (indices into [`Batch::tokens`]) that take their embedding from `data`.
    pub rows: Range<usize>,
    pub data: EmbeddingData<'a>,
}

/// Where spliced embedding rows are.
#[derive(Clone, Copy, Debug)]
pub enum EmbeddingData<'a> {
    /// Host memory, readable now.
    Host(&'a [f32]),
    /// `len` f32 values from byte `offset` of a unified buffer another engine writes (an image
    /// encoder's output), valid once the submission's [`Submission::wait`] is reached. A device
    /// that can import the buffer reads the rows in place, after waiting in its queue where the
    /// wait is a timeline it can import; the CPU NPU reads them through a CPU read guard after
    /// its host wait. The device only reads the buffer: a CPU writer that races the read gives
    /// wrong rows, never undefined behaviour.
    Unified {
        buffer: &'a std::sync::Arc<uvm_alloc::UnifiedBuffer>,
        offset: usize,
        len: usize,
    },
}

impl<'a> EmbeddingData<'a> {
    /// Values (not rows, not bytes).
    pub fn len(&self) -> usize {
        match self {
            EmbeddingData::Host(d) => d.len(),
            EmbeddingData::Unified { len, .. } => *len,
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values `range` of these (`None` when the range is out of bounds).
    pub fn slice(&self, range: Range<usize>) -> Option<EmbeddingData<'a>> {
        if range.start > range.end || range.end > self.len() {
            return None;
        }
        Some(match *self {
            EmbeddingData::Host(d) => EmbeddingData::Host(&d[range]),
            EmbeddingData::Unified { buffer, offset, .. } => EmbeddingData::Unified {
                buffer,
                offset: offset + range.start * 4,
                len: range.len(),
            },
        })
    }

    /// The byte range a unified source covers in its buffer, checked against the buffer's size
    /// (`Ok(None)` for host data).
    pub fn unified_bytes(&self) -> Result<Option<Range<usize>>, Error> {
        let EmbeddingData::Unified {
            buffer,
            offset,
            len,
        } = *self
        else {
            return Ok(None);
        };
        let end = len
            .checked_mul(4)
            .and_then(|b| b.checked_add(offset))
            .filter(|&end| end <= buffer.len() && offset % 4 == 0);
        match end {
            Some(end) => Ok(Some(offset..end)),
            None => Err(Error::BadOp {
                op: 0,
                what: format!(
                    "embed: {len} f32 values at byte {offset} do not fit a {}-byte unified \
                     buffer at 4-byte alignment",
                    buffer.len()
                ),
            }),
        }
    }
}

/// One submission: a program, its batch, the KV cache it uses, and the timeline values it waits
/// for before starting and signals when done.
#[derive(Debug)]
pub struct Submission<'a> {
    pub ops: &'a [Op],
    pub batch: Batch<'a>,
    pub kv: Option<&'a mut KvCache>,
    /// When given, every attention op adds the probabilities it computed to this tracker
    /// (per layer, per cached token), for pruning policies that rank pages by attention (H2O,
    /// attention entropy). A device that cannot report them refuses the submission.
    pub attention: Option<&'a mut kv_paged::prune::AttentionTracker>,
    pub wait: Option<(&'a dyn Timeline, u64)>,
    pub signal: Option<(&'a dyn Timeline, u64)>,
    /// The tensors whose contents anything after this submission reads (a later submission,
    /// [`Device::read_tensor`]); `None`: every tensor. A device may leave the others
    /// unwritten: the GPU folds an op into the ops that read its result (an RMSNorm into the
    /// linear layers after it) only where that result is not needed afterwards. The KV cache
    /// is always kept.
    pub live: Option<&'a [TensorId]>,
}

/// A submission [`Device::submit_held`] queued, which runs once [`Device::release`] (or
/// [`Device::discard`]) lets it.
#[derive(Debug)]
#[must_use = "a held submission stops its device's queue until it is released or discarded"]
pub struct Held(
    #[cfg_attr(
        not(feature = "vulkan"),
        expect(dead_code, reason = "only the Vulkan backend holds submissions")
    )]
    pub(crate) u64,
);

/// What kind of engine a device is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// The CPU reference NPU.
    Cpu,
    /// A device that accepts nothing (see [`crate::EmptyDevice`]).
    Empty,
    /// A Linux accel device.
    Accel,
    /// A GPU through Vulkan (the `vulkan` feature's [`crate::VulkanNpu`]).
    Gpu,
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
    /// Creates a tensor the host reads after most submissions (the logits): a device with
    /// memory of its own places it where the host reads it without another copy. The default
    /// is [`Device::create_tensor`].
    fn create_readback_tensor(&mut self, width: usize, max_rows: usize) -> Result<TensorId, Error> {
        self.create_tensor(width, max_rows)
    }
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
    /// Shows rows `rows` of `tensor` (`rows.len() * width` values) to `view` once the writes
    /// submitted before are done: where they lie when the host can read the tensor's memory in
    /// place (the CPU NPU's tensors, a GPU's readback tensors), else copied into `scratch` by
    /// [`Device::read_tensor`] first (the default). What a decode loop samples from, so the
    /// logits are not copied on their way to the sampler.
    fn view_tensor(
        &self,
        tensor: TensorId,
        rows: Range<usize>,
        scratch: &mut Vec<f32>,
        view: &mut dyn FnMut(&[f32]),
    ) -> Result<(), Error> {
        let (width, max_rows) = self.tensor_shape(tensor).ok_or(Error::BadOp {
            op: 0,
            what: format!(
                "view_tensor: tensor {} does not exist on this device",
                tensor.0
            ),
        })?;
        // Checked before the scratch grows, so a bad range allocates nothing.
        let values = rows.len().saturating_mul(width);
        check_rows("view_tensor", width, max_rows, &rows, values)?;
        view_copied(self, tensor, rows, scratch, view)
    }
    /// The index and value of the largest element of row `row` of `tensor` once the writes
    /// submitted before are done: [`crate::kernels::argmax`] of the row (the first on ties, NaN
    /// never; `None` when every element is NaN). What greedy decoding takes from the logits. A
    /// device may answer from maxima it computed while it wrote the row (the Vulkan backend's
    /// output head does, so the host reads a few kilobytes rather than the vocabulary); the
    /// default views the row ([`Device::view_tensor`]) and scans it.
    fn row_argmax(&self, tensor: TensorId, row: usize) -> Result<Option<(usize, f32)>, Error> {
        scan_row_argmax(self, tensor, row)
    }
    /// Whether [`Device::submit_held`] works here: a queue that waits, without the host, for
    /// a value the host signals later. The default is `false`.
    fn holds(&self) -> bool {
        false
    }
    /// Queues `submission` before its batch is known, so a decode loop submits step k + 1
    /// while step k runs and, once its token is sampled, pays only [`Device::release`]. The
    /// batch given here fixes the shape (its token count and selected rows; no spliced
    /// embeddings, no attention statistics, a signal on this device's own timeline); its token
    /// ids and slots are placeholders that `release` replaces. Until the held submission is
    /// released or discarded the device takes no other work, and its waits cover the
    /// submissions before the held one only. The default refuses ([`Error::Unsupported`]).
    fn submit_held(&mut self, submission: Submission<'_>) -> Result<Held, Error> {
        let _ = submission;
        Err(Error::Unsupported {
            what: "held submissions",
            why: format!("{} runs each submission as it is made", self.info().name),
        })
    }
    /// Gives the held submission its batch (the shape it was queued with; `kv` holds the
    /// batch's slots already) and lets it run. Where the batch is refused the submission still
    /// runs, as [`Device::discard`] runs it, so the queue never stays stopped.
    fn release(&mut self, held: Held, batch: Batch<'_>, kv: Option<&KvCache>) -> Result<(), Error> {
        let _ = (held, batch, kv);
        Err(Error::Unsupported {
            what: "held submissions",
            why: format!("{} has none", self.info().name),
        })
    }
    /// Lets the held submission run over the batch its program ran last, for a caller that has
    /// no next batch (the reply ended): it repeats that run, which writes the same values where
    /// that run wrote them (the same token at the same position and slot).
    fn discard(&mut self, held: Held) -> Result<(), Error> {
        let _ = held;
        Err(Error::Unsupported {
            what: "held submissions",
            why: format!("{} has none", self.info().name),
        })
    }
    /// Writes rows `rows` of `tensor` from `data`.
    fn write_tensor(
        &mut self,
        tensor: TensorId,
        rows: Range<usize>,
        data: &[f32],
    ) -> Result<(), Error>;
    /// A timeline this device signals itself, in hardware where it can: a caller that chains
    /// its submissions on it (each waiting for the value the previous one signals) needs no
    /// host wake between them. `None` when the device has no timeline of its own, in which case
    /// callers bring one (a [`sync_timeline::CpuTimeline`], say).
    fn timeline(&self) -> Option<std::sync::Arc<dyn Timeline>> {
        None
    }
    /// Whether a submission whose [`Submission::wait`] is on `timeline` waits in the device's
    /// own queue, with no host thread blocked (the GPU backend, for a Vulkan timeline of the
    /// same GPU that it can import). `false`: the device waits on the host.
    fn waits_in_queue(&self, timeline: &dyn Timeline) -> bool {
        let _ = timeline;
        false
    }
    /// Time per kernel since the device was opened, longest first, where the device profiles its
    /// dispatches (the GPU backend with [`crate::VulkanConfig::profile`]); empty otherwise.
    fn profile(&self) -> Vec<KernelTime> {
        Vec::new()
    }
    /// Counters since the device was opened (zero where a device keeps none).
    fn stats(&self) -> DeviceStats {
        DeviceStats::default()
    }
}

/// One kernel's share of a device's time ([`Device::profile`]).
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTime {
    /// The kernel and its variant.
    pub kernel: String,
    pub dispatches: u64,
    pub time: std::time::Duration,
}

/// Where a device's time went, since it was opened: what `pipeline bench` splits a token into.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DeviceStats {
    pub submissions: u64,
    /// Times a call blocked its thread on device work or on a timeline another engine signals.
    pub host_waits: u64,
    /// Waits on another engine's timeline made in the device's queue, with no host wake (a
    /// GPU encoder's completion imported into the GPU decoder's device).
    pub queue_waits: u64,
    /// Host time inside [`Device::submit`]: checks, step values, queue submission.
    pub submit_time: std::time::Duration,
    /// Host time inside [`Device::read_tensor`] once results were ready: the copy out.
    pub readback_time: std::time::Duration,
    /// Execution time of the submissions on the device (GPU timestamps), where it has a clock.
    pub device_time: Option<std::time::Duration>,
    /// [`Device::row_argmax`] calls answered from maxima the device kept as it wrote the row
    /// (the others scanned the row).
    pub argmax_from_maxima: u64,
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

/// Checks `rows` of a `[max_rows, width]` tensor against `values` host values, for
/// [`Device::read_tensor`] (`call` names it in the error) and [`Device::write_tensor`].
/// [`Device::view_tensor`] by copy: `rows` of `tensor` (checked by the caller) read into
/// `scratch`, then shown.
pub(crate) fn view_copied<D: Device + ?Sized>(
    device: &D,
    tensor: TensorId,
    rows: Range<usize>,
    scratch: &mut Vec<f32>,
    view: &mut dyn FnMut(&[f32]),
) -> Result<(), Error> {
    let width = device.tensor_shape(tensor).map_or(0, |(w, _)| w);
    scratch.resize(rows.len() * width, 0.0);
    device.read_tensor(tensor, rows, scratch)?;
    view(scratch);
    Ok(())
}

/// [`Device::row_argmax`] by a scan: the row viewed ([`Device::view_tensor`]) and
/// [`crate::kernels::argmax`] of it.
pub(crate) fn scan_row_argmax<D: Device + ?Sized>(
    device: &D,
    tensor: TensorId,
    row: usize,
) -> Result<Option<(usize, f32)>, Error> {
    let mut best = None;
    let mut scratch = Vec::new();
    device.view_tensor(tensor, row..row.saturating_add(1), &mut scratch, &mut |v| {
        best = crate::kernels::argmax(v);
    })?;
    Ok(best)
}

pub(crate) fn check_rows(
    call: &str,
    width: usize,
    max_rows: usize,
    rows: &Range<usize>,
    values: usize,
) -> Result<(), Error> {
    if rows.start > rows.end || rows.end > max_rows || values != rows.len() * width {
        return Err(Error::BadOp {
            op: 0,
            what: format!(
                "{call}: rows {rows:?} of {max_rows} / {values} host values for width {width}"
            ),
        });
    }
    Ok(())
}

/// A tensor's shape as the checks see it.
#[derive(Clone, Copy)]
struct TensorShape {
    width: usize,
    max_rows: usize,
}

/// Checks one op against the shapes of what it names and the batch, before anything runs.
pub(crate) fn check_op(
    i: usize,
    op: &Op,
    b: &Batch<'_>,
    kv: Option<&kv_paged::KvLayout>,
    weight_shape: &dyn Fn(WeightId) -> Option<(usize, usize)>,
    tensor_shape: &dyn Fn(TensorId) -> Option<(usize, usize)>,
) -> Result<(), Error> {
    let weight_of = |id: WeightId, op: usize| {
        weight_shape(id).ok_or_else(|| Error::BadOp {
            op,
            what: format!("weight {} does not exist on this device", id.0),
        })
    };
    let tensor = |id: TensorId, op: usize| {
        tensor_shape(id)
            .map(|(width, max_rows)| TensorShape { width, max_rows })
            .ok_or_else(|| Error::BadOp {
                op,
                what: format!("tensor {} does not exist on this device", id.0),
            })
    };
    let n = b.tokens.len();
    let bad = |what: String| Err(Error::BadOp { op: i, what });
    let rows_ok = |t: TensorShape, rows: usize| rows <= t.max_rows;
    match *op {
        Op::Embed { table, out } => {
            let (_, cols) = weight_of(table, i)?;
            let o = tensor(out, i)?;
            if cols != o.width || !rows_ok(o, n) {
                return bad(format!(
                    "embed: table width {cols} vs output width {} / {} rows for {n} tokens",
                    o.width, o.max_rows
                ));
            }
            if let Some(e) = &b.embeddings {
                let rows = e.rows.len();
                e.data.unified_bytes()?;
                if e.rows.start > e.rows.end
                    || e.rows.end > n
                    || rows.checked_mul(cols) != Some(e.data.len())
                {
                    return bad(format!(
                        "embed: spliced embeddings for rows {:?} of a {n}-token batch carry {} \
                         values, want {rows} x {cols}",
                        e.rows,
                        e.data.len()
                    ));
                }
            }
        }
        Op::RmsNorm { x, weight, out, .. } => {
            let (r, c) = weight_of(weight, i)?;
            let (x, o) = (tensor(x, i)?, tensor(out, i)?);
            if r != 1 || c != x.width || x.width != o.width || !rows_ok(x, n) || !rows_ok(o, n) {
                return bad(format!(
                    "rms_norm: gain ({r}x{c}), input width {}, output width {} must agree",
                    x.width, o.width
                ));
            }
        }
        Op::Linear {
            weight,
            x,
            out,
            rows,
        } => {
            let (r, c) = weight_of(weight, i)?;
            let (xt, o) = (tensor(x, i)?, tensor(out, i)?);
            if x == out || c != xt.width || r != o.width || !rows_ok(xt, n) {
                return bad(format!(
                    "linear: weight {r}x{c} needs input width {c} (got {}) and output width {r} (got {}), distinct tensors",
                    xt.width, o.width
                ));
            }
            let out_rows = match rows {
                Rows::All => n,
                Rows::Selected => {
                    if b.select.start > b.select.end || b.select.end > n {
                        return bad(format!(
                            "linear: select {:?} outside the batch of {n}",
                            b.select
                        ));
                    }
                    b.select.len()
                }
            };
            if !rows_ok(o, out_rows) {
                return bad(format!(
                    "linear: output holds {} rows, {out_rows} needed",
                    o.max_rows
                ));
            }
        }
        Op::Rope { x, head_dim, .. } => {
            let t = tensor(x, i)?;
            if head_dim == 0
                || !head_dim.is_multiple_of(2)
                || head_dim > crate::kernels::MAX_ROPE_HEAD_DIM
                || !t.width.is_multiple_of(head_dim)
                || !rows_ok(t, n)
            {
                return bad(format!(
                    "rope: head_dim {head_dim} must be even, <= {} and divide the width {}",
                    crate::kernels::MAX_ROPE_HEAD_DIM,
                    t.width
                ));
            }
        }
        Op::SwiGlu { gate, up, out, .. } => {
            let (g, u, o) = (tensor(gate, i)?, tensor(up, i)?, tensor(out, i)?);
            if out == gate
                || out == up
                || g.width != u.width
                || g.width != o.width
                || !rows_ok(g, n)
                || !rows_ok(u, n)
                || !rows_ok(o, n)
            {
                return bad(
                    "swiglu: gate, up and out must have one width and out be distinct".into(),
                );
            }
        }
        Op::Add { acc, x } => {
            let (a, xt) = (tensor(acc, i)?, tensor(x, i)?);
            if acc == x || a.width != xt.width || !rows_ok(a, n) || !rows_ok(xt, n) {
                return bad("add: acc and x must be distinct tensors of one width".into());
            }
        }
        Op::Attention {
            layer,
            q,
            k,
            v,
            out,
            q_heads,
            ..
        } => {
            let Some(kv) = kv else {
                return bad("attention needs a KV cache in the submission".into());
            };
            let l = kv;
            let (qt, kt, vt, o) = (tensor(q, i)?, tensor(k, i)?, tensor(v, i)?, tensor(out, i)?);
            let kvw = l.kv_heads * l.head_dim;
            if layer >= l.layers
                || q_heads == 0
                || !q_heads.is_multiple_of(l.kv_heads)
                || qt.width != q_heads * l.head_dim
                || kt.width != kvw
                || vt.width != kvw
                || o.width != qt.width
                || out == q
                || b.slots.len() != n
                || ![qt, kt, vt, o].into_iter().all(|t| rows_ok(t, n))
            {
                return bad(format!(
                    "attention: layer {layer} of {}, {q_heads} query heads over {} KV heads of {}, q/k/v/out widths {}/{}/{}/{}, {} slots for {n} tokens",
                    l.layers,
                    l.kv_heads,
                    l.head_dim,
                    qt.width,
                    kt.width,
                    vt.width,
                    o.width,
                    b.slots.len()
                ));
            }
        }
    }
    Ok(())
}
