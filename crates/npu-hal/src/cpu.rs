//! The CPU reference NPU: runs [`Op`] programs on a persistent [`WorkerPool`] with mx-quant's
//! runtime-dispatched SIMD kernels (AVX-512, AVX2, NEON, scalar).
//!
//! Parallel ops (linear layers, decode attention) split their output rows or heads into one
//! contiguous share per pool part; every part writes only its own slices, handed to it through a
//! per-part lock that is never contended. Element-wise ops run on the submitting thread: on one
//! token they take less time than waking a worker would.

use std::ops::Range;
use std::sync::Mutex;
use std::time::Duration;

use mx_quant::Isa;
use mx_quant::gemv::Q8Activations;
use uvm_alloc::{Access, Allocator, AllocatorDesc, UnifiedBuffer};

use crate::Error;
use crate::device::{
    Backend, Batch, Device, DeviceInfo, DeviceKind, EmbeddingData, Embeddings, Op, Probe, Rows,
    Submission, TensorId, Weight, WeightId, check_op, check_rows,
};
use crate::kernels;
use crate::pool::{WorkerPool, share};

/// How to build a [`CpuNpu`].
#[derive(Clone, Debug)]
pub struct CpuConfig {
    /// Pool parts (0 = one per core).
    pub threads: usize,
    /// Where activation tensors are allocated (the default picks the best unified backend).
    pub allocator: AllocatorDesc,
    /// How long a submission waits for its `wait` value before failing.
    pub wait_timeout: Duration,
    /// Instruction set of the MX kernels (`None` = the best this CPU has, or `MX_QUANT_ISA`).
    pub isa: Option<Isa>,
}

impl Default for CpuConfig {
    fn default() -> Self {
        CpuConfig {
            threads: 0,
            allocator: AllocatorDesc::default(),
            wait_timeout: Duration::from_secs(30),
            isa: None,
        }
    }
}

#[derive(Debug)]
struct CpuTensor {
    width: usize,
    max_rows: usize,
    buffer: UnifiedBuffer,
}

/// Activation buffers reused across ops.
#[derive(Debug, Default)]
struct Scratch {
    /// Per-row int8 activations for MX linear layers.
    q8: Vec<Q8Activations>,
    /// Rounded activations for dense linear layers.
    rounded: Vec<f32>,
    /// Block-rotated activations for rotated MX matrices.
    rotated: Vec<f32>,
    /// The tensor and rows `rotated` holds the rotation of, while they are unchanged: linear
    /// layers reading one input (Q, K and V) rotate it once. Cleared by every op but a linear
    /// layer that leaves the tensor alone, and at each submission ([`Scratch::forget_before`]).
    rotated_from: Option<(TensorId, Range<usize>)>,
    /// The tensor and rows `q8` holds the quantization of (of their rotation, when the flag is
    /// set), kept and cleared as `rotated_from`: Q, K and V (gate and up) quantize their input
    /// once.
    q8_from: Option<(TensorId, Range<usize>, bool)>,
    /// Per-row 8-bit activations for ggml block weights.
    blocks: Vec<crate::ggml::QuantizedActivations>,
}

impl Scratch {
    /// Forgets the inputs derived from a tensor `op` may write: all of them, unless it is a
    /// linear layer writing another tensor. `None`: at a submission's start.
    fn forget_before(&mut self, op: Option<&Op>) {
        let keeps = |from: Option<TensorId>| match op {
            Some(Op::Linear { out, .. }) => from.is_none_or(|t| t != *out),
            _ => false,
        };
        if !keeps(self.rotated_from.as_ref().map(|f| f.0)) {
            self.rotated_from = None;
        }
        if !keeps(self.q8_from.as_ref().map(|f| f.0)) {
            self.q8_from = None;
        }
    }
}

/// The CPU reference NPU.
#[derive(Debug)]
pub struct CpuNpu {
    pool: WorkerPool,
    isa: Isa,
    allocator: Allocator,
    wait_timeout: Duration,
    weights: Vec<Weight>,
    tensors: Vec<CpuTensor>,
    scratch: Scratch,
    /// RoPE inverse frequencies per `(head_dim, theta bits)`.
    rope_freqs: Vec<((usize, u32), kernels::RopeFreqs)>,
}

impl CpuNpu {
    /// Starts the worker pool and the allocator.
    pub fn new(config: CpuConfig) -> Result<CpuNpu, Error> {
        let isa = config.isa.unwrap_or_else(Isa::detect);
        Ok(CpuNpu {
            pool: WorkerPool::new(config.threads).map_err(Error::Threads)?,
            isa,
            allocator: Allocator::new(config.allocator)?,
            wait_timeout: config.wait_timeout,
            weights: Vec::new(),
            tensors: Vec::new(),
            scratch: Scratch::default(),
            rope_freqs: Vec::new(),
        })
    }

    /// The pool's parts.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// The unified buffer behind a tensor (for engines that import it).
    pub fn tensor_buffer(&self, tensor: TensorId) -> Option<&UnifiedBuffer> {
        self.tensors.get(tensor.0 as usize).map(|t| &t.buffer)
    }

    fn tensor(&self, id: TensorId, op: usize) -> Result<&CpuTensor, Error> {
        self.tensors.get(id.0 as usize).ok_or_else(|| Error::BadOp {
            op,
            what: format!("tensor {} does not exist on this device", id.0),
        })
    }

    fn run(
        &mut self,
        i: usize,
        op: &Op,
        b: &Batch<'_>,
        kv: Option<&mut kv_paged::KvCache>,
        attention: Option<&mut kv_paged::prune::AttentionTracker>,
    ) -> Result<(), Error> {
        let n = b.tokens.len();
        match *op {
            Op::Embed { table, out } => {
                let w = &self.weights[table.0 as usize];
                let o = &self.tensors[out.0 as usize];
                let mut g = o.buffer.cpu_access(0..n * o.width * 4, Access::Write)?;
                let dst = g.typed_mut::<f32>()?;
                let (rows, _) = w.shape();
                let spliced = b.embeddings.as_ref();
                // A unified source is read in place, under a read guard: the submission's wait
                // (done before any op runs) is what made its writer finish.
                let unified = match spliced.map(|e| (e, e.data.unified_bytes())) {
                    Some((e, Ok(Some(bytes)))) => {
                        let EmbeddingData::Unified { buffer, .. } = e.data else {
                            unreachable!("unified_bytes is Some only for unified data")
                        };
                        Some(buffer.cpu_access(bytes, Access::Read)?)
                    }
                    Some((_, Err(e))) => return Err(e),
                    _ => None,
                };
                let spliced_values: &[f32] = match (spliced, &unified) {
                    (_, Some(g)) => g.typed::<f32>()?,
                    (
                        Some(Embeddings {
                            data: EmbeddingData::Host(d),
                            ..
                        }),
                        None,
                    ) => d,
                    _ => &[],
                };
                for (r, (t, row)) in b
                    .tokens
                    .iter()
                    .zip(dst.chunks_exact_mut(o.width))
                    .enumerate()
                {
                    if let Some(e) = spliced.filter(|e| e.rows.contains(&r)) {
                        let at = (r - e.rows.start) * o.width;
                        // `check` proved `data` holds `rows.len() * width` values.
                        row.copy_from_slice(&spliced_values[at..at + o.width]);
                        continue;
                    }
                    let t = *t as usize;
                    if t >= rows {
                        return Err(Error::BadOp {
                            op: i,
                            what: format!(
                                "embed: token id {t} is outside the vocabulary of {rows}"
                            ),
                        });
                    }
                    match w {
                        Weight::Mx(m) => {
                            m.dequantize_row(t, row)?;
                            if m.block_rotation() {
                                mx_quant::hadamard::unrotate_weights(row)?;
                            }
                        }
                        Weight::Dense(d) => row.copy_from_slice(d.row(t)),
                        Weight::Block(m) => m.dequantize_row(t, row),
                        Weight::Vector(v) => row.copy_from_slice(v),
                    }
                }
            }
            Op::RmsNorm {
                x,
                weight,
                eps,
                out,
            } => {
                let Weight::Vector(gain) = &self.weights[weight.0 as usize] else {
                    return Err(Error::BadOp {
                        op: i,
                        what: "rms_norm: the gain must be a vector weight".into(),
                    });
                };
                let (xt, o) = (&self.tensors[x.0 as usize], &self.tensors[out.0 as usize]);
                let w = xt.width;
                let gx = xt.buffer.cpu_access(0..n * w * 4, Access::Read)?;
                if x == out {
                    drop(gx);
                    let mut go = o.buffer.cpu_access(0..n * w * 4, Access::Write)?;
                    let mut tmp = vec![0f32; w];
                    for row in go.typed_mut::<f32>()?.chunks_exact_mut(w) {
                        kernels::rms_norm(row, gain, eps, &mut tmp);
                        row.copy_from_slice(&tmp);
                    }
                } else {
                    let mut go = o.buffer.cpu_access(0..n * w * 4, Access::Write)?;
                    for (src, dst) in gx
                        .typed::<f32>()?
                        .chunks_exact(w)
                        .zip(go.typed_mut::<f32>()?.chunks_exact_mut(w))
                    {
                        kernels::rms_norm(src, gain, eps, dst);
                    }
                }
            }
            Op::Linear {
                weight,
                x,
                out,
                rows,
            } => {
                let (in_rows, out_rows) = match rows {
                    Rows::All => (0..n, n),
                    Rows::Selected => (b.select.clone(), b.select.len()),
                };
                let CpuNpu {
                    pool,
                    isa,
                    weights,
                    tensors,
                    scratch,
                    ..
                } = self;
                let w = &weights[weight.0 as usize];
                let (xt, o) = (&tensors[x.0 as usize], &tensors[out.0 as usize]);
                let gx = xt.buffer.cpu_access(
                    in_rows.start * xt.width * 4..in_rows.end * xt.width * 4,
                    Access::Read,
                )?;
                let mut go = o
                    .buffer
                    .cpu_access(0..out_rows * o.width * 4, Access::Write)?;
                linear(
                    pool,
                    *isa,
                    w,
                    (x, in_rows),
                    gx.typed::<f32>()?,
                    go.typed_mut::<f32>()?,
                    out_rows,
                    scratch,
                )?;
            }
            Op::Rope {
                x,
                head_dim,
                theta,
                style,
                numerics,
            } => {
                let key = (head_dim, theta.to_bits());
                let freqs = match self.rope_freqs.iter().position(|(k, _)| *k == key) {
                    Some(p) => p,
                    None => {
                        self.rope_freqs
                            .push((key, kernels::rope_freqs(head_dim, theta)));
                        self.rope_freqs.len() - 1
                    }
                };
                let inv = &self.rope_freqs[freqs].1;
                let t = &self.tensors[x.0 as usize];
                let mut g = t.buffer.cpu_access(0..n * t.width * 4, Access::Write)?;
                for (r, row) in g.typed_mut::<f32>()?.chunks_exact_mut(t.width).enumerate() {
                    kernels::rope(row, head_dim, b.first_pos + r, inv, style, numerics);
                }
            }
            Op::SwiGlu {
                gate,
                up,
                out,
                numerics,
            } => {
                let ts = &self.tensors;
                let width = ts[gate.0 as usize].width;
                let len = n * width * 4;
                let gg = ts[gate.0 as usize]
                    .buffer
                    .cpu_access(0..len, Access::Read)?;
                let gu = ts[up.0 as usize].buffer.cpu_access(0..len, Access::Read)?;
                let mut go = ts[out.0 as usize]
                    .buffer
                    .cpu_access(0..len, Access::Write)?;
                // Row by row (the ggml numerics split each row into whole vectors and a tail), a
                // prefill's rows in parallel: one contiguous share per part, the same bits.
                let (g, u) = (gg.typed::<f32>()?, gu.typed::<f32>()?);
                let out = &mut go.typed_mut::<f32>()?[..n * width];
                let rows_of = |first: usize, out: &mut [f32]| {
                    for (i, o) in out.chunks_exact_mut(width).enumerate() {
                        let at = (first + i) * width..(first + i + 1) * width;
                        kernels::swiglu(&g[at.clone()], &u[at], o, numerics);
                    }
                };
                if n == 1 {
                    rows_of(0, out);
                } else {
                    let parts = self.pool.threads();
                    let mut shares: Vec<Mutex<(usize, &mut [f32])>> = Vec::with_capacity(parts);
                    let mut rest = out;
                    for p in 0..parts {
                        let rows = share(p, parts, n, 1);
                        let (mine, tail) = rest.split_at_mut(rows.len() * width);
                        shares.push(Mutex::new((rows.start, mine)));
                        rest = tail;
                    }
                    self.pool.run(&|p| {
                        let mut guard = shares[p].lock().unwrap_or_else(|e| e.into_inner());
                        let (first, out) = &mut *guard;
                        rows_of(*first, out);
                    });
                }
            }
            Op::Add { acc, x } => {
                let ts = &self.tensors;
                let len = n * ts[acc.0 as usize].width * 4;
                let gx = ts[x.0 as usize].buffer.cpu_access(0..len, Access::Read)?;
                let mut ga = ts[acc.0 as usize]
                    .buffer
                    .cpu_access(0..len, Access::Write)?;
                kernels::add_in_place(ga.typed_mut::<f32>()?, gx.typed::<f32>()?);
            }
            Op::Attention {
                layer,
                q,
                k,
                v,
                out,
                q_heads,
                numerics,
            } => {
                let Some(kv) = kv else {
                    return Err(Error::BadOp {
                        op: i,
                        what: "attention needs a KV cache".into(),
                    });
                };
                let ts = &self.tensors;
                let (qt, kt, vt, o) = (
                    &ts[q.0 as usize],
                    &ts[k.0 as usize],
                    &ts[v.0 as usize],
                    &ts[out.0 as usize],
                );
                {
                    let gk = kt.buffer.cpu_access(0..n * kt.width * 4, Access::Read)?;
                    let gv = vt.buffer.cpu_access(0..n * vt.width * 4, Access::Read)?;
                    for ((slot, kr), vr) in b
                        .slots
                        .iter()
                        .zip(gk.typed::<f32>()?.chunks_exact(kt.width))
                        .zip(gv.typed::<f32>()?.chunks_exact(vt.width))
                    {
                        kv.write(layer, *slot, kr, vr)?;
                    }
                }
                let gq = qt.buffer.cpu_access(0..n * qt.width * 4, Access::Read)?;
                let mut go = o.buffer.cpu_access(0..n * o.width * 4, Access::Write)?;
                let (qs, outs) = (gq.typed::<f32>()?, go.typed_mut::<f32>()?);
                let kv: &kv_paged::KvCache = kv;
                crate::attention::attend(
                    &self.pool, kv, b.seq, layer, q_heads, qs, outs, numerics, attention,
                )?;
            }
        }
        Ok(())
    }
}

/// `q8[t]` = the int8 quantization of row `t` of `x` (rows of `cols` values), for `tokens`
/// rows; a prefill's rows in parallel, one contiguous share per part.
fn quantize_rows(
    pool: &WorkerPool,
    q8: &mut Vec<Q8Activations>,
    x: &[f32],
    cols: usize,
    tokens: usize,
) -> Result<(), Error> {
    if q8.len() < tokens {
        q8.resize_with(tokens, Q8Activations::default);
    }
    if tokens == 1 {
        q8[0].requantize(&x[..cols])?;
        return Ok(());
    }
    let parts = pool.threads();
    let mut shares: Vec<Mutex<(usize, &mut [Q8Activations])>> = Vec::new();
    let mut rest = &mut q8[..tokens];
    for p in 0..parts {
        let span = share(p, parts, tokens, 1);
        let (mine, tail) = rest.split_at_mut(span.len());
        shares.push(Mutex::new((span.start, mine)));
        rest = tail;
    }
    let failure: Mutex<Option<Error>> = Mutex::new(None);
    pool.run(&|p| {
        let mut guard = shares[p].lock().unwrap_or_else(|e| e.into_inner());
        let (first, acts) = &mut *guard;
        for (i, act) in acts.iter_mut().enumerate() {
            let t = *first + i;
            if let Err(e) = act.requantize(&x[t * cols..(t + 1) * cols]) {
                failure
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert(e.into());
                return;
            }
        }
    });
    match failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// `out[t] = W x[t]` for `tokens` rows, split over the pool by row tiles; `x_from` names the
/// tensor rows `x` holds, so their rotation and int8 quantization can be reused.
#[allow(clippy::too_many_arguments)]
fn linear(
    pool: &WorkerPool,
    isa: Isa,
    w: &Weight,
    x_from: (TensorId, Range<usize>),
    x: &[f32],
    out: &mut [f32],
    tokens: usize,
    scratch: &mut Scratch,
) -> Result<(), Error> {
    let Scratch {
        q8,
        rounded,
        rotated,
        rotated_from,
        q8_from,
        blocks,
    } = scratch;
    let (rows, cols) = w.shape();
    let parts = pool.threads();
    // One contiguous share of output rows per part, cut at 16-row tiles.
    let spans: Vec<Range<usize>> = (0..parts)
        .map(|p| share(p, parts, rows, mx_quant::gemv::TILE_ROWS))
        .collect();
    let mut per_part: Vec<Mutex<Vec<&mut [f32]>>> = (0..parts)
        .map(|_| Mutex::new(Vec::with_capacity(tokens)))
        .collect();
    for row in out.chunks_exact_mut(rows).take(tokens) {
        let mut rest = row;
        for (span, part) in spans.iter().zip(per_part.iter_mut()) {
            let (mine, tail) = rest.split_at_mut(span.len());
            part.get_mut().unwrap_or_else(|e| e.into_inner()).push(mine);
            rest = tail;
        }
    }
    let failure: Mutex<Option<Error>> = Mutex::new(None);
    let fail = |e: Error| {
        failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(e);
    };
    // A block-rotated matrix meets block-rotated activations (`mx_quant::hadamard`).
    let x = match w {
        Weight::Mx(m) if m.block_rotation() => {
            if rotated_from.as_ref() != Some(&x_from) {
                rotated.clear();
                rotated.extend_from_slice(&x[..tokens * cols]);
                *rotated_from = None;
                mx_quant::hadamard::rotate_activations(rotated)?;
                *rotated_from = Some(x_from.clone());
            }
            &rotated[..tokens * cols]
        }
        _ => x,
    };
    match w {
        Weight::Mx(m) if m.supports_q8() => {
            let key = (x_from.0, x_from.1.clone(), m.block_rotation());
            if q8_from.as_ref() != Some(&key) {
                *q8_from = None;
                quantize_rows(pool, q8, x, cols, tokens)?;
                *q8_from = Some(key);
            }
            let xs: Vec<&Q8Activations> = q8[..tokens].iter().collect();
            pool.run(&|p| {
                let span = &spans[p];
                if span.is_empty() {
                    return;
                }
                let tiles = span.start / mx_quant::gemv::TILE_ROWS
                    ..span.end.div_ceil(mx_quant::gemv::TILE_ROWS);
                let mut ys = per_part[p].lock().unwrap_or_else(|e| e.into_inner());
                if let Err(e) = m.gemm_q8(isa, &xs, &mut ys, tiles) {
                    fail(e.into());
                }
            });
        }
        Weight::Mx(m) => {
            let xs: Vec<&[f32]> = x.chunks_exact(cols).take(tokens).collect();
            pool.run(&|p| {
                let span = &spans[p];
                if span.is_empty() {
                    return;
                }
                let tiles = span.start / mx_quant::gemv::TILE_ROWS
                    ..span.end.div_ceil(mx_quant::gemv::TILE_ROWS);
                let mut ys = per_part[p].lock().unwrap_or_else(|e| e.into_inner());
                if let Err(e) = m.gemm_f32(isa, &xs, &mut ys, tiles) {
                    fail(e.into());
                }
            });
        }
        Weight::Dense(d) => {
            let x = match d.activation_rounding() {
                kernels::ActivationRounding::None => x,
                r => {
                    rounded.resize(tokens * cols, 0.0);
                    for (src, dst) in x.chunks_exact(cols).zip(rounded.chunks_exact_mut(cols)) {
                        r.apply(src, dst);
                    }
                    &rounded[..]
                }
            };
            pool.run(&|p| {
                let span = &spans[p];
                if span.is_empty() {
                    return;
                }
                let mut ys = per_part[p].lock().unwrap_or_else(|e| e.into_inner());
                d.gemm_rows(&x[..tokens * cols], span.clone(), &mut ys);
            });
        }
        Weight::Block(m) => {
            if blocks.len() < tokens {
                blocks.resize_with(tokens, Default::default);
            }
            for (t, act) in blocks.iter_mut().take(tokens).enumerate() {
                act.quantize(m.block_type(), &x[t * cols..(t + 1) * cols]);
            }
            let xs = &blocks[..tokens];
            pool.run(&|p| {
                let span = &spans[p];
                if span.is_empty() {
                    return;
                }
                let mut ys = per_part[p].lock().unwrap_or_else(|e| e.into_inner());
                m.gemm_rows(xs, span.clone(), &mut ys);
            });
        }
        Weight::Vector(_) => {
            return Err(Error::BadOp {
                op: usize::MAX,
                what: "linear: a vector weight is not a matrix".into(),
            });
        }
    }
    match failure.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

impl Device for CpuNpu {
    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            kind: DeviceKind::Cpu,
            name: "cpu reference NPU".into(),
            parallelism: self.pool.threads(),
            isa: format!("{:?}", self.isa),
        }
    }

    fn load_weight(&mut self, weight: Weight) -> Result<WeightId, Error> {
        let id = u32::try_from(self.weights.len()).map_err(|_| Error::Limit { what: "weights" })?;
        self.weights.push(weight);
        Ok(WeightId(id))
    }

    fn weight_shape(&self, weight: WeightId) -> Option<(usize, usize)> {
        self.weights.get(weight.0 as usize).map(Weight::shape)
    }

    fn weight_bytes(&self) -> usize {
        self.weights.iter().map(Weight::bytes).sum()
    }

    fn create_tensor(&mut self, width: usize, max_rows: usize) -> Result<TensorId, Error> {
        let bytes = width
            .checked_mul(max_rows)
            .and_then(|e| e.checked_mul(4))
            .filter(|&b| b > 0)
            .ok_or(Error::Limit {
                what: "tensor size (width * rows * 4 must be > 0 and fit usize)",
            })?;
        let id = u32::try_from(self.tensors.len()).map_err(|_| Error::Limit { what: "tensors" })?;
        let buffer = self.allocator.allocate(bytes)?;
        self.tensors.push(CpuTensor {
            width,
            max_rows,
            buffer,
        });
        Ok(TensorId(id))
    }

    fn tensor_shape(&self, tensor: TensorId) -> Option<(usize, usize)> {
        self.tensors
            .get(tensor.0 as usize)
            .map(|t| (t.width, t.max_rows))
    }

    fn submit(&mut self, s: Submission<'_>) -> Result<(), Error> {
        let Submission {
            ops,
            batch,
            mut kv,
            mut attention,
            wait,
            signal,
            // Every op's result is written here, needed or not.
            live: _,
        } = s;
        if batch.tokens.is_empty() {
            return Err(Error::BadOp {
                op: 0,
                what: "the batch has no tokens".into(),
            });
        }
        for (i, op) in ops.iter().enumerate() {
            let weight_shape = |w: WeightId| self.weight_shape(w);
            let tensor_shape = |t: TensorId| self.tensor_shape(t);
            check_op(
                i,
                op,
                &batch,
                kv.as_deref().map(kv_paged::KvCache::layout),
                &weight_shape,
                &tensor_shape,
            )?;
        }
        if let Some((timeline, value)) = wait {
            timeline.wait(value, self.wait_timeout)?;
        }
        self.scratch.forget_before(None);
        for (i, op) in ops.iter().enumerate() {
            self.scratch.forget_before(Some(op));
            self.run(i, op, &batch, kv.as_deref_mut(), attention.as_deref_mut())?;
        }
        if let Some((timeline, value)) = signal {
            timeline.signal(value)?;
        }
        Ok(())
    }

    fn read_tensor(
        &self,
        tensor: TensorId,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), Error> {
        let t = self.tensor(tensor, 0)?;
        check_rows("read_tensor", t.width, t.max_rows, &rows, out.len())?;
        let g = t.buffer.cpu_access(
            rows.start * t.width * 4..rows.end * t.width * 4,
            Access::Read,
        )?;
        out.copy_from_slice(g.typed::<f32>()?);
        Ok(())
    }

    /// In place: a tensor is host memory.
    fn view_tensor(
        &self,
        tensor: TensorId,
        rows: Range<usize>,
        _scratch: &mut Vec<f32>,
        view: &mut dyn FnMut(&[f32]),
    ) -> Result<(), Error> {
        let t = self.tensor(tensor, 0)?;
        let values = rows.len().saturating_mul(t.width);
        check_rows("view_tensor", t.width, t.max_rows, &rows, values)?;
        let g = t.buffer.cpu_access(
            rows.start * t.width * 4..rows.end * t.width * 4,
            Access::Read,
        )?;
        view(g.typed::<f32>()?);
        Ok(())
    }

    fn write_tensor(
        &mut self,
        tensor: TensorId,
        rows: Range<usize>,
        data: &[f32],
    ) -> Result<(), Error> {
        let t = self.tensor(tensor, 0)?;
        check_rows("write_tensor", t.width, t.max_rows, &rows, data.len())?;
        let mut g = t.buffer.cpu_access(
            rows.start * t.width * 4..rows.end * t.width * 4,
            Access::Write,
        )?;
        g.typed_mut::<f32>()?.copy_from_slice(data);
        Ok(())
    }
}

/// The CPU backend as seen by discovery.
#[derive(Clone, Debug, Default)]
pub struct CpuBackend {
    pub config: CpuConfig,
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn probe(&self) -> Vec<Probe> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        vec![Probe {
            backend: "cpu",
            name: format!(
                "cpu reference NPU ({cores} cores, {:?} kernels)",
                Isa::detect()
            ),
            usable: Ok(()),
        }]
    }

    fn open(&self) -> Result<Box<dyn Device>, Error> {
        Ok(Box::new(CpuNpu::new(self.config.clone())?))
    }
}
