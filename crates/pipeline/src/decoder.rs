//! The LLaMA-family decoder over npu-hal: grouped-query attention, RoPE, RMSNorm, SwiGLU, tied or
//! untied output, weights converted per tensor class by a [`WeightPolicy`] at load time.
//!
//! The model is compiled once into two npu-hal programs: the body (embedding, the blocks, the
//! final norm) over every token of a batch, and the head (the output projection) over the rows
//! whose logits are wanted, in slices of at most [`DecoderOptions::max_logit_rows`] so a 512-token
//! prompt never holds 512 x vocab logits at once. A batch whose wanted rows fit in one slice (a
//! decode step, a prompt's last chunk) runs the two as one program, one submission: a device
//! pays its submission and wake-up once per token, and the GPU folds the final norm into the
//! head. Each submission waits on and signals the decoder's timeline, which is how other stages
//! hand work to it.
//!
//! Invariants: the KV cache holds the tokens of the current sequence (`self.len` positions), less
//! the whole pages a KV budget dropped ([`Decoder::set_pruning`]); every token it holds has its
//! K/V written in every layer. A failed step drops the sequence and its pages leave the prefix
//! cache.

use std::ops::Range;
use std::sync::Arc;

use kv_paged::{KvCache, KvLayout, PageDtype};
use mx_quant::{ElemFormat, QuantOptions, ScaleRule};
use npu_hal::{
    ActivationRounding, Batch, DenseMatrix, Device, GgmlBuild, Numerics, Op, Rows, Submission,
    TensorId, Weight, WeightId,
};
use sync_timeline::{CpuTimeline, Timeline};

use crate::model::{LoadError, ModelConfig, TensorSource};

/// Why the decoder failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("device: {0}")]
    Device(#[from] npu_hal::Error),
    #[error("KV cache: {0}")]
    Kv(#[from] kv_paged::Error),
    #[error("MX conversion of {tensor}: {source}")]
    Quantize {
        tensor: String,
        source: mx_quant::Error,
    },
    #[error(
        "the sequence would reach {wanted} tokens, past the context of {ctx}; start a new sequence or raise --ctx"
    )]
    ContextFull { wanted: usize, ctx: usize },
    #[error(
        "unknown weight policy {0:?}: use exact, exact:avx2, exact:avx512, exact-f32, default, fastest, fp4, smallest, int8, or a list like attn=fp6,mlp=fp4,embd=int8"
    )]
    UnknownPolicy(String),
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    BadToken { id: u32, vocab: usize },
    #[error("sampling: {0}")]
    Sampling(String),
    #[error("{0}")]
    BadInput(String),
}

/// Where a weight tensor sits in the model, which decides how hard it may be quantized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorClass {
    /// The token embedding (also the output projection when tied).
    Embedding,
    /// An untied output projection.
    Output,
    /// Q, K, V and O projections.
    Attention,
    /// Gate and up projections.
    MlpIn,
    /// The down projection.
    MlpDown,
}

/// Each block's matrices (`blk.N.<role>`) and their classes, in load order.
const LAYER_MATRICES: [(&str, TensorClass); 7] = [
    ("attn_q", TensorClass::Attention),
    ("attn_k", TensorClass::Attention),
    ("attn_v", TensorClass::Attention),
    ("attn_output", TensorClass::Attention),
    ("ffn_gate", TensorClass::MlpIn),
    ("ffn_up", TensorClass::MlpIn),
    ("ffn_down", TensorClass::MlpDown),
];

impl TensorClass {
    /// The class of a matrix the decoder loads, by its canonical name (`token_embd`, `output`,
    /// `blk.3.attn_v`, ...); `None` for any other tensor (norm gains, unknown names).
    pub fn of(name: &str) -> Option<TensorClass> {
        match name {
            "token_embd" => Some(TensorClass::Embedding),
            "output" => Some(TensorClass::Output),
            _ => {
                let role = name.strip_prefix("blk.")?.split_once('.')?.1;
                LAYER_MATRICES
                    .iter()
                    .find(|(r, _)| *r == role)
                    .map(|&(_, class)| class)
            }
        }
    }
}

/// How one class of tensors is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    /// The source values, dequantized to f32, never requantized.
    Exact,
    /// Converted to an MX format at load time.
    Mx(ElemFormat),
}

impl std::fmt::Display for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Storage::Exact => f.write_str("f32"),
            Storage::Mx(e) => write!(f, "mx{e}"),
        }
    }
}

/// Storage per tensor class; named policies are the measured trade-offs (README, "Decoder").
#[derive(Clone, Debug, PartialEq)]
pub struct WeightPolicy {
    pub name: String,
    pub embedding: Storage,
    pub output: Storage,
    pub attention: Storage,
    pub mlp_in: Storage,
    pub mlp_down: Storage,
    /// Scale selection for MX conversion (MSE search by default: it never does worse than the
    /// OCP rule on a block and costs only load time).
    pub scale: ScaleRule,
    /// Exact matrices round their activations as llama.cpp does for the source format (8-bit
    /// blocks for block-quantized weights, f16 for f16...), so `exact` reproduces llama.cpp's
    /// numbers; `false` keeps activations in f32 (`exact-f32`).
    pub source_activations: bool,
    /// Standard f32 arithmetic, or one ggml build's (`npu_hal::Numerics::Ggml`: its SiLU `expf`,
    /// f16 flash attention and fused RoPE) for `exact`, which with ggml's block weights makes the
    /// logits bit-identical to that llama.cpp build's on the CPU NPU.
    pub numerics: Numerics,
}

impl WeightPolicy {
    /// Looks up a named policy or parses `class=format,...` (classes `embd`, `output`, `attn`,
    /// `mlp` (= `mlp_in` and `mlp_down`), `mlp_in`, `mlp_down`, `all`; formats `f32`/`exact` or an
    /// mx-quant format name such as `fp4`, `fp6`, `fp8_e4m3`, `int8`). `exact` reproduces the
    /// llama.cpp build `GGML_NATIVE` makes on this CPU; `exact:avx2` and `exact:avx512` name the
    /// build, so logits made by llama.cpp on another machine can be reproduced on this one.
    pub fn parse(name: &str) -> Result<WeightPolicy, DecodeError> {
        use ElemFormat::*;
        let uniform = |name: &str, s: Storage| WeightPolicy {
            name: name.to_string(),
            embedding: s,
            output: s,
            attention: s,
            mlp_in: s,
            mlp_down: s,
            scale: ScaleRule::MseSearch,
            source_activations: true,
            numerics: Numerics::Standard,
        };
        Ok(match name {
            "exact" => WeightPolicy {
                numerics: Numerics::Ggml(GgmlBuild::native()),
                ..uniform("exact", Storage::Exact)
            },
            built if built.starts_with("exact:") => {
                let build = GgmlBuild::parse(&built["exact:".len()..])
                    .ok_or_else(|| DecodeError::UnknownPolicy(built.into()))?;
                WeightPolicy {
                    numerics: Numerics::Ggml(build),
                    ..uniform(built, Storage::Exact)
                }
            }
            "exact-f32" => WeightPolicy {
                source_activations: false,
                ..uniform("exact-f32", Storage::Exact)
            },
            "int8" => uniform("int8", Storage::Mx(Int8)),
            "default" => WeightPolicy {
                embedding: Storage::Mx(Int8),
                output: Storage::Mx(Int8),
                attention: Storage::Mx(Fp6E2M3),
                mlp_in: Storage::Mx(Fp6E2M3),
                mlp_down: Storage::Mx(Fp6E2M3),
                ..uniform("default", Storage::Exact)
            },
            "fastest" => WeightPolicy {
                embedding: Storage::Mx(Int8),
                output: Storage::Mx(Int8),
                attention: Storage::Mx(Fp6E2M3),
                mlp_in: Storage::Mx(Fp4E2M1),
                mlp_down: Storage::Mx(Fp4E2M1),
                ..uniform("fastest", Storage::Exact)
            },
            "fp4" => WeightPolicy {
                embedding: Storage::Mx(Int8),
                output: Storage::Mx(Int8),
                attention: Storage::Mx(Fp4E2M1),
                mlp_in: Storage::Mx(Fp4E2M1),
                mlp_down: Storage::Mx(Fp4E2M1),
                ..uniform("fp4", Storage::Exact)
            },
            "smallest" => WeightPolicy {
                embedding: Storage::Mx(Fp6E2M3),
                output: Storage::Mx(Fp6E2M3),
                attention: Storage::Mx(Fp4E2M1),
                mlp_in: Storage::Mx(Fp4E2M1),
                mlp_down: Storage::Mx(Fp4E2M1),
                ..uniform("smallest", Storage::Exact)
            },
            spec if spec.contains('=') => {
                let mut p = uniform(spec, Storage::Exact);
                for item in spec.split(',') {
                    let (class, fmt) = item
                        .split_once('=')
                        .ok_or_else(|| DecodeError::UnknownPolicy(spec.into()))?;
                    let storage = match fmt.trim() {
                        "f32" | "exact" => Storage::Exact,
                        f => Storage::Mx(
                            ElemFormat::from_name(f)
                                .ok_or_else(|| DecodeError::UnknownPolicy(spec.into()))?,
                        ),
                    };
                    match class.trim() {
                        "embd" | "embedding" => p.embedding = storage,
                        "output" => p.output = storage,
                        "attn" | "attention" => p.attention = storage,
                        "mlp" => (p.mlp_in, p.mlp_down) = (storage, storage),
                        "mlp_in" => p.mlp_in = storage,
                        "mlp_down" => p.mlp_down = storage,
                        "all" => {
                            p = WeightPolicy {
                                name: p.name,
                                ..uniform("", storage)
                            }
                        }
                        _ => return Err(DecodeError::UnknownPolicy(spec.into())),
                    }
                }
                p
            }
            other => return Err(DecodeError::UnknownPolicy(other.into())),
        })
    }

    /// How `class` is stored.
    pub fn storage(&self, class: TensorClass) -> Storage {
        match class {
            TensorClass::Embedding => self.embedding,
            TensorClass::Output => self.output,
            TensorClass::Attention => self.attention,
            TensorClass::MlpIn => self.mlp_in,
            TensorClass::MlpDown => self.mlp_down,
        }
    }
}

/// How to build a [`Decoder`].
#[derive(Clone, Debug)]
pub struct DecoderOptions {
    pub policy: WeightPolicy,
    /// Context length (tokens the KV cache holds).
    pub ctx: usize,
    /// Most tokens one body submission processes (longer inputs are split).
    pub max_batch: usize,
    /// Most logit rows one head submission produces.
    pub max_logit_rows: usize,
    /// KV page storage.
    pub kv_dtype: PageDtype,
    /// Where converted MX weights are cached (read if present and current, written otherwise).
    pub cache: Option<CacheSpec>,
}

/// A converted-weight cache file and the key it must carry (see [`crate::mxcache`]).
#[derive(Clone, Debug)]
pub struct CacheSpec {
    pub path: std::path::PathBuf,
    pub key: crate::mxcache::CacheKey,
}

impl Default for DecoderOptions {
    fn default() -> Self {
        DecoderOptions {
            policy: WeightPolicy::parse("default").expect("the default policy parses"),
            ctx: 2048,
            max_batch: 512,
            max_logit_rows: 16,
            kv_dtype: PageDtype::F16,
            cache: None,
        }
    }
}

/// Load-time facts for reports.
#[derive(Clone, Debug, Default)]
pub struct LoadReport {
    /// Weight bytes on the device.
    pub weight_bytes: usize,
    /// Parameters (elements) of the matrices.
    pub parameters: usize,
    /// Mean bits per weight over the matrices as stored.
    pub bits_per_weight: f64,
    /// Bytes one decoded token streams (every matrix once, the embedding row aside).
    pub stream_bytes_per_token: usize,
    /// Matrices kept exact because their width is not a multiple of 32.
    pub kept_exact: Vec<String>,
    /// Matrices read from the converted-weight cache instead of converted.
    pub from_cache: usize,
    /// The cache written by this load, if any.
    pub cache_written: Option<std::path::PathBuf>,
    /// Why the cache could not be read or written, if it could not (loading went on without it).
    pub cache_problem: Option<String>,
    /// Set when the policy asks for ggml's numerics on a device that does not run them (only
    /// the CPU NPU does): the device keeps the GGUF's blocks and its activation rounding but
    /// computes the rest its own way, so the logits are close to llama.cpp's, not identical.
    pub numerics_note: Option<String>,
}

/// One decode step's logits, as [`Decoder::decode_ahead`] shows them to its `pick`.
#[derive(Clone, Copy)]
pub struct Logits<'a> {
    values: &'a [f32],
    /// The row of the device tensor they were read from, for [`Logits::argmax`].
    on_device: Option<(&'a dyn Device, TensorId, usize)>,
}

impl<'a> Logits<'a> {
    /// Logits with no device tensor behind them: [`Logits::argmax`] scans them.
    pub fn scanned(values: &'a [f32]) -> Logits<'a> {
        Logits {
            values,
            on_device: None,
        }
    }

    /// One value per vocabulary entry.
    pub fn values(&self) -> &'a [f32] {
        self.values
    }

    /// [`npu_hal::kernels::argmax`] of the values (the first on ties, NaN never): what greedy
    /// decoding picks. Where the device kept maxima as it wrote them
    /// ([`npu_hal::Device::row_argmax`]: the GPU's output head) the host reads those rather
    /// than the vocabulary; a device that cannot answer leaves it to a scan of the values,
    /// which are those same values.
    pub fn argmax(&self) -> Option<(usize, f32)> {
        if let Some((device, tensor, row)) = self.on_device
            && let Ok(best) = device.row_argmax(tensor, row)
        {
            return best;
        }
        npu_hal::kernels::argmax(self.values)
    }
}

impl std::fmt::Debug for Logits<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Logits")
            .field("len", &self.values.len())
            .field("on_device", &self.on_device.is_some())
            .finish()
    }
}

/// A loaded model on a device, with its KV cache and one sequence.
#[derive(Debug)]
pub struct Decoder {
    config: ModelConfig,
    device: Box<dyn Device>,
    kv: KvCache,
    body: Vec<Op>,
    head: Vec<Op>,
    /// The body then the head: one submission for a batch whose wanted rows fit one slice.
    body_and_head: Vec<Op>,
    /// What the head reads (the final norm's output), and what it writes.
    head_input: TensorId,
    logits: TensorId,
    options: DecoderOptions,
    report: LoadReport,
    seq: kv_paged::SeqId,
    len: usize,
    /// The device's own timeline where it has one (a GPU's, signalled in its queue), else a
    /// CPU timeline: each submission waits for the previous one's value and signals the next.
    timeline: Arc<dyn Timeline>,
    tick: u64,
    /// Host copy of the head's logits where the device cannot show them in place
    /// ([`npu_hal::Device::view_tensor`]), reused across calls (an error path may drop it; the
    /// next call reallocates).
    logits_scratch: Vec<f32>,
    /// The name of every matrix, by its id on the device.
    matrix_names: std::collections::HashMap<WeightId, String>,
    /// Start fresh sequences from the KV prefix cache ([`Decoder::set_prefix_reuse`]).
    prefix_reuse: bool,
    /// Tokens the current sequence took from the prefix cache.
    prefix_reused: usize,
    /// The KV budget and its policy ([`Decoder::set_pruning`]).
    pruning: Option<Pruning>,
    /// Attention mass per cached token, for the policies that rank pages by it.
    attention: kv_paged::prune::AttentionTracker,
    /// KV pages pruning has dropped since the decoder was made.
    pages_pruned: u64,
    /// Tokens [`Decoder::pin_prefix`] holds in the cache (whole pages; 0: no pin).
    pinned: usize,
}

/// The sequence id that holds a pinned prefix's pages (the decoder's own count from 0 never
/// reaches it).
const PIN_SEQ: kv_paged::SeqId = kv_paged::SeqId::MAX;

/// Which pages a KV budget drops (`--prune`). Every policy keeps the first page (the attention
/// sinks) and the page being filled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrunePolicy {
    /// StreamingLLM: the sinks and the most recent pages.
    Sinks,
    /// H2O at page granularity: the sinks, a recent window of a quarter of the budget, and the
    /// pages that received the most attention so far.
    HeavyHitters,
    /// The sinks, the recent window, and the pages with the most attention in the layers whose
    /// attention is most focused (low entropy).
    Entropy,
}

impl std::str::FromStr for PrunePolicy {
    type Err = DecodeError;

    fn from_str(s: &str) -> Result<PrunePolicy, DecodeError> {
        Ok(match s {
            "sinks" => PrunePolicy::Sinks,
            "h2o" => PrunePolicy::HeavyHitters,
            "entropy" => PrunePolicy::Entropy,
            other => {
                return Err(DecodeError::BadInput(format!(
                    "prune policy {other:?}: use sinks, h2o or entropy"
                )));
            }
        })
    }
}

/// A KV budget and the policy that keeps the cache within it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pruning {
    /// The most tokens the sequence's KV cache holds.
    pub budget: usize,
    pub policy: PrunePolicy,
}

impl Pruning {
    /// Tokens per forward while pruning: an eighth of the budget in whole pages, so the cache
    /// stays between seven eighths of the budget and the budget.
    fn step(&self, block_tokens: usize) -> usize {
        (self.budget / 8 / block_tokens).max(1) * block_tokens
    }
}

/// How long a spliced forward waits on the host for the decoder's own previous submission
/// (reached already in every path that reads logits back) before it calls the device lost.
const SUBMIT_ORDER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Input embeddings that replace a run of a sequence's rows (an image encoder's output, read in
/// place from its unified buffer): rows `start..start + data.len() / hidden`, or, for an image
/// in pieces with text between them, the rows its [`Splice::runs`] name.
#[derive(Clone, Copy, Debug)]
pub struct Splice<'a> {
    /// The image's first row: rows `key_from..start` are the same image's but come with no
    /// data, so they must be in the prefix cache (an unchanged frame whose pages were pinned,
    /// [`Decoder::pin_prefix`]); the forward fails by name when they are not.
    pub key_from: usize,
    pub start: usize,
    pub data: npu_hal::EmbeddingData<'a>,
    /// Names the embeddings for the prefix cache: the same key means the same rows, so a later
    /// sequence may reuse their K/V (an unchanged frame); a fresh key for each new image.
    pub key: u64,
    /// When `data` is complete, if it is not yet (a unified buffer another engine is still
    /// writing): the first submission that reads the rows waits for this value instead of the
    /// decoder's own previous one, in the device's queue where the device can
    /// ([`npu_hal::Device::waits_in_queue`]). `None`: complete already.
    pub ready: Option<(&'a dyn Timeline, u64)>,
    /// Where `data`'s rows go when the image comes in pieces (SmolVLM's tiles, each after its
    /// own `<row_r_col_c>` tokens): each run takes the next `rows` rows of `data`, in order, at
    /// sequence rows `start + at ..`; the rows between runs are the tokens' own embeddings.
    /// Empty: one run, all of `data` from `start`. The whole of `key_from..` the last run's end
    /// is one image to the prefix cache, text between the runs included.
    pub runs: &'a [SpliceRun],
}

/// One piece of a spliced image ([`Splice::runs`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpliceRun {
    /// The piece's first row, counted from [`Splice::start`].
    pub at: usize,
    pub rows: usize,
}

impl<'a> Splice<'a> {
    /// Host rows, complete now.
    pub fn host(start: usize, data: &'a [f32], key: u64) -> Splice<'a> {
        Splice {
            key_from: start,
            start,
            data: npu_hal::EmbeddingData::Host(data),
            key,
            ready: None,
            runs: &[],
        }
    }
}

impl Splice<'_> {
    /// Each run as (its first sequence row, its first row of `data`, rows), in order.
    fn placed_runs(&self, hidden: usize) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let whole = self.runs.is_empty().then_some(SpliceRun {
            at: 0,
            rows: self.data.len() / hidden,
        });
        let runs = self.runs.iter().copied().chain(whole);
        runs.scan(0, move |data_row, r| {
            let placed = (self.start + r.at, *data_row, r.rows);
            *data_row += r.rows;
            Some(placed)
        })
    }

    /// One past the last row the splice covers.
    fn end(&self, hidden: usize) -> usize {
        self.placed_runs(hidden)
            .last()
            .map_or(self.start, |(at, _, rows)| at + rows)
    }

    /// Why the splice does not fit `tokens` sequence rows of `hidden` values, if it does not:
    /// whole rows, runs in order without overlap that take exactly the data's rows, inside
    /// the sequence.
    fn misfit(&self, tokens: usize, hidden: usize) -> Option<String> {
        let rows = self.data.len() / hidden;
        if self.key_from > self.start || !self.data.len().is_multiple_of(hidden) {
            return Some(format!(
                "{} spliced embedding values at token {} (image from token {}) are not whole \
                 rows of {hidden}",
                self.data.len(),
                self.start,
                self.key_from,
            ));
        }
        if !self.runs.is_empty() {
            let mut next = 0usize;
            let mut taken = 0usize;
            for r in self.runs {
                if r.at < next || r.rows == 0 {
                    return Some(format!(
                        "splice runs {:?} are not in order, apart and non-empty",
                        self.runs
                    ));
                }
                next = r.at.saturating_add(r.rows);
                taken = taken.saturating_add(r.rows);
            }
            if taken != rows {
                return Some(format!(
                    "splice runs take {taken} rows but the data holds {rows}"
                ));
            }
        }
        let end = self
            .runs
            .last()
            .map_or(Some(rows), |r| r.at.checked_add(r.rows))
            .and_then(|n| n.checked_add(self.start));
        end.is_none_or(|end| end > tokens).then(|| {
            format!(
                "{rows} spliced rows from token {} (runs {:?}) do not fit the {tokens} tokens",
                self.start, self.runs
            )
        })
    }

    /// The id the KV prefix cache hashes for spliced row `row`: outside any vocabulary (the
    /// top bit set) and derived from the key, so rows of different images never match.
    fn cache_id(&self, row: usize) -> u32 {
        let mut h = std::hash::DefaultHasher::new();
        std::hash::Hash::hash(&(self.key, row), &mut h);
        0x8000_0000 | (std::hash::Hasher::finish(&h) as u32)
    }
}

impl Decoder {
    /// Loads every weight of `config` from `source` into `device` under `options.policy`, and
    /// compiles the programs.
    pub fn new(
        config: ModelConfig,
        source: &dyn TensorSource,
        mut device: Box<dyn Device>,
        options: DecoderOptions,
    ) -> Result<Decoder, DecodeError> {
        config.validate()?;
        crate::model::check_llama_tensors(&config, source)?;
        let mut loading = Loading {
            source,
            policy: options.policy.clone(),
            report: LoadReport::default(),
            bits: 0.0,
            cache: None,
            writer: None,
            names: Default::default(),
        };
        // The matrices in load order (the cache is written in this order).
        let mut order = vec![("token_embd".to_string(), TensorClass::Embedding)];
        if !config.tied_embeddings {
            order.push(("output".into(), TensorClass::Output));
        }
        for i in 0..config.layers {
            for (s, class) in LAYER_MATRICES {
                order.push((format!("blk.{i}.{s}"), class));
            }
        }
        let plan: Vec<_> = order
            .iter()
            .filter_map(|(name, class)| loading.planned(name, *class))
            .collect();
        if let Some(spec) = options.cache.as_ref().filter(|_| !plan.is_empty()) {
            match crate::mxcache::MxCache::open(&spec.path, &spec.key) {
                Ok(Some(cache)) => loading.cache = Some(cache),
                Ok(None) => {
                    match crate::mxcache::CacheWriter::create(&spec.path, &spec.key, plan) {
                        Ok(w) => loading.writer = Some(w),
                        Err(e) => loading.report.cache_problem = Some(e.to_string()),
                    }
                }
                Err(e) => loading.report.cache_problem = Some(e.to_string()),
            }
        }
        let embd = loading.matrix(&mut *device, "token_embd", TensorClass::Embedding)?;
        let embd_bytes = loading.report.stream_bytes_per_token;
        let output = if config.tied_embeddings {
            embd
        } else {
            loading.matrix(&mut *device, "output", TensorClass::Output)?
        };
        struct Layer {
            attn_norm: WeightId,
            q: WeightId,
            k: WeightId,
            v: WeightId,
            o: WeightId,
            ffn_norm: WeightId,
            gate: WeightId,
            up: WeightId,
            down: WeightId,
        }
        let mut layers = Vec::with_capacity(config.layers);
        for i in 0..config.layers {
            let b = |s: &str| format!("blk.{i}.{s}");
            layers.push(Layer {
                attn_norm: device.load_weight(vector(source, &b("attn_norm"))?)?,
                q: loading.matrix(&mut *device, &b("attn_q"), TensorClass::Attention)?,
                k: loading.matrix(&mut *device, &b("attn_k"), TensorClass::Attention)?,
                v: loading.matrix(&mut *device, &b("attn_v"), TensorClass::Attention)?,
                o: loading.matrix(&mut *device, &b("attn_output"), TensorClass::Attention)?,
                ffn_norm: device.load_weight(vector(source, &b("ffn_norm"))?)?,
                gate: loading.matrix(&mut *device, &b("ffn_gate"), TensorClass::MlpIn)?,
                up: loading.matrix(&mut *device, &b("ffn_up"), TensorClass::MlpIn)?,
                down: loading.matrix(&mut *device, &b("ffn_down"), TensorClass::MlpDown)?,
            });
        }
        let output_norm = device.load_weight(vector(source, "output_norm")?)?;
        if let Some(writer) = loading.writer.take() {
            match writer.finish() {
                Ok(path) => loading.report.cache_written = Some(path),
                Err(e) => loading.report.cache_problem = Some(e.to_string()),
            }
        }
        let mut report = loading.report;
        report.bits_per_weight = loading.bits / report.parameters.max(1) as f64;
        // An untied embedding is only read a row at a time: it does not stream per token.
        if !config.tied_embeddings {
            report.stream_bytes_per_token -= embd_bytes;
        }
        report.weight_bytes = device.weight_bytes();
        let info = device.info();
        if matches!(options.policy.numerics, Numerics::Ggml(_))
            && info.kind != npu_hal::DeviceKind::Cpu
        {
            report.numerics_note = Some(format!(
                "{} runs the {} policy's blocks and activation rounding but not ggml's CPU \
                 numerics (f16 flash attention, vectorised expf, fused RoPE): its logits are \
                 close to llama.cpp's, not bit-identical (the CPU NPU's are)",
                info.name, options.policy.name
            ));
        }

        let c = &config;
        let policy = &options.policy;
        let n = options.max_batch.max(1);
        let qw = c.heads * c.head_dim;
        let kvw = c.kv_heads * c.head_dim;
        let mut t = |w: usize, rows: usize| device.create_tensor(w, rows);
        let x = t(c.hidden, n)?;
        let xn = t(c.hidden, n)?;
        let q = t(qw, n)?;
        let k = t(kvw, n)?;
        let v = t(kvw, n)?;
        let attn = t(qw, n)?;
        let o = t(c.hidden, n)?;
        let gate = t(c.intermediate, n)?;
        let up = t(c.intermediate, n)?;
        let act = t(c.intermediate, n)?;
        let logits = device.create_readback_tensor(c.vocab_size, options.max_logit_rows.max(1))?;
        let rope = |x| Op::Rope {
            x,
            head_dim: c.head_dim,
            theta: c.rope_theta,
            style: match c.rope_style {
                crate::model::RopeStyle::Interleaved => npu_hal::RopeStyle::Interleaved,
                crate::model::RopeStyle::HalfSplit => npu_hal::RopeStyle::HalfSplit,
            },
            numerics: policy.numerics,
        };
        let mut body = vec![Op::Embed {
            table: embd,
            out: x,
        }];
        let linear = |weight, x, out| Op::Linear {
            weight,
            x,
            out,
            rows: Rows::All,
        };
        for (i, l) in layers.iter().enumerate() {
            body.extend([
                Op::RmsNorm {
                    x,
                    weight: l.attn_norm,
                    eps: c.rms_eps,
                    out: xn,
                },
                linear(l.q, xn, q),
                linear(l.k, xn, k),
                linear(l.v, xn, v),
                rope(q),
                rope(k),
                Op::Attention {
                    layer: i,
                    q,
                    k,
                    v,
                    out: attn,
                    q_heads: c.heads,
                    numerics: policy.numerics,
                },
                linear(l.o, attn, o),
                Op::Add { acc: x, x: o },
                Op::RmsNorm {
                    x,
                    weight: l.ffn_norm,
                    eps: c.rms_eps,
                    out: xn,
                },
                linear(l.gate, xn, gate),
                linear(l.up, xn, up),
                Op::SwiGlu {
                    gate,
                    up,
                    out: act,
                    numerics: policy.numerics,
                },
                linear(l.down, act, o),
                Op::Add { acc: x, x: o },
            ]);
        }
        body.push(Op::RmsNorm {
            x,
            weight: output_norm,
            eps: c.rms_eps,
            out: xn,
        });
        let head = vec![Op::Linear {
            weight: output,
            x: xn,
            out: logits,
            rows: Rows::Selected,
        }];
        let block_tokens = 16;
        let kv = KvCache::new(
            KvLayout {
                layers: c.layers,
                kv_heads: c.kv_heads,
                head_dim: c.head_dim,
                block_tokens,
                dtype: options.kv_dtype,
            },
            options.ctx.div_ceil(block_tokens).max(1),
            None,
        )?;
        let timeline = device
            .timeline()
            .unwrap_or_else(|| Arc::new(CpuTimeline::new(0)));
        let tick = timeline.value().map_err(npu_hal::Error::from)?;
        let layers = config.layers;
        let mut d = Decoder {
            config,
            device,
            kv,
            body_and_head: [body.as_slice(), head.as_slice()].concat(),
            head_input: xn,
            body,
            head,
            logits,
            options,
            report,
            seq: 0,
            pinned: 0,
            len: 0,
            timeline,
            tick,
            logits_scratch: Vec::new(),
            matrix_names: std::mem::take(&mut loading.names),
            prefix_reuse: false,
            prefix_reused: 0,
            pruning: None,
            attention: kv_paged::prune::AttentionTracker::new(layers),
            pages_pruned: 0,
        };
        d.kv.add_sequence(d.seq, &[])?;
        Ok(d)
    }

    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Load-time facts.
    pub fn report(&self) -> &LoadReport {
        &self.report
    }

    /// The options it was built with.
    pub fn options(&self) -> &DecoderOptions {
        &self.options
    }

    /// The device it runs on.
    pub fn device(&self) -> &dyn Device {
        &*self.device
    }

    /// The KV cache (for accounting).
    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    /// Tokens in the current sequence.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the current sequence is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The timeline every submission signals (one value per submission).
    pub fn timeline(&self) -> Arc<dyn Timeline> {
        Arc::clone(&self.timeline)
    }

    /// Rolls the sequence back to its first `len` tokens, the rollback of rejected speculative
    /// drafts: the KV cache's block table is cut (kv-paged's `truncate`), and nothing is copied
    /// or recomputed. The next forward continues from position `len`.
    ///
    /// # Errors
    /// `len` past the sequence, or a KV cache error.
    pub fn truncate(&mut self, len: usize) -> Result<(), DecodeError> {
        // Positions and cache entries differ by the pages pruning dropped; the tail is the
        // same tokens in both.
        let cached = self.kv.manager().len(self.seq)?;
        let Some(kept) = (len <= self.len)
            .then(|| cached.checked_sub(self.len - len))
            .flatten()
        else {
            return Err(DecodeError::BadInput(format!(
                "cannot truncate a sequence of {} tokens ({cached} cached) to {len}",
                self.len
            )));
        };
        self.kv.truncate(self.seq, kept)?;
        self.attention.truncate(kept);
        self.len = len;
        Ok(())
    }

    /// Keeps the KV cache within `pruning.budget` tokens by dropping whole pages as its policy
    /// chooses (no copy), or lifts the budget with `None`. A forward then runs in steps of an
    /// eighth of the budget and prunes before each step that would pass it; RoPE positions go
    /// on counting, so the model sees the kept tokens where they were.
    ///
    /// # Errors
    /// A budget under 4 pages (64 tokens) or over the context. A device that cannot report
    /// attention refuses the policies that rank pages by it (`h2o`, `entropy`) at the first
    /// submission; the CPU NPU and the GPU backend report it.
    pub fn set_pruning(&mut self, pruning: Option<Pruning>) -> Result<(), DecodeError> {
        let bt = self.kv.layout().block_tokens;
        if let Some(p) = pruning
            && (p.budget < 4 * bt || p.budget > self.options.ctx)
        {
            return Err(DecodeError::BadInput(format!(
                "a KV budget of {} tokens: use {} to the context of {}",
                p.budget,
                4 * bt,
                self.options.ctx
            )));
        }
        self.pruning = pruning;
        Ok(())
    }

    /// KV pages pruning has dropped since the decoder was made.
    pub fn pages_pruned(&self) -> u64 {
        self.pages_pruned
    }

    /// Drops pages until the cache holds at most `target` tokens, as the policy chooses among
    /// the full pages other than the first (sinks) and the recent window.
    fn prune_to(&mut self, pruning: Pruning, target: usize) -> Result<(), DecodeError> {
        use kv_paged::prune::{EntropyPages, HeavyHitters, PruneInput, PruningPolicy, SinkWindow};
        let bt = self.kv.layout().block_tokens;
        let len = self.kv.manager().len(self.seq)?;
        if len <= target {
            return Ok(());
        }
        let partial = len % bt;
        // Pages that fit besides the sink page and the partial page.
        let pages = target.saturating_sub(bt + partial) / bt;
        // The recent window: all of it for sinks, a quarter of the budget for the others.
        let recent_pages = match pruning.policy {
            PrunePolicy::Sinks => pages,
            _ => (pruning.budget / 4 / bt).min(pages),
        };
        let recent = recent_pages * bt + partial;
        let ranked = pages - recent_pages;
        let input = PruneInput {
            seq: self.seq,
            len,
            block_tokens: bt,
            attention: &self.attention,
        };
        let report = match pruning.policy {
            PrunePolicy::Sinks => SinkWindow {
                sink_tokens: bt,
                window_tokens: recent,
            }
            .select(&input),
            PrunePolicy::HeavyHitters => HeavyHitters {
                budget_pages: ranked,
                sink_tokens: bt,
                recent_tokens: recent,
            }
            .select(&input),
            PrunePolicy::Entropy => EntropyPages {
                entropy_threshold: 1.0,
                mass_threshold: 0.0,
                sink_tokens: bt,
                recent_tokens: recent,
                budget_pages: Some(ranked),
            }
            .select(&input),
        };
        let dropped = self.kv.apply_prune(&mut self.attention, &report)?;
        self.pages_pruned += dropped.len() as u64;
        Ok(())
    }

    /// Drops the current sequence and starts an empty one. Its full pages stay in the KV
    /// prefix cache, for [`Decoder::set_prefix_reuse`].
    pub fn reset(&mut self) -> Result<(), DecodeError> {
        self.kv.free_sequence(self.seq)?;
        self.start_empty()
    }

    /// Drops the current sequence, whose K/V may be incomplete, so the prefix cache forgets
    /// its pages, and starts an empty one.
    fn forget(&mut self) -> Result<(), DecodeError> {
        self.kv.forget_sequence(self.seq)?;
        self.start_empty()
    }

    fn start_empty(&mut self) -> Result<(), DecodeError> {
        self.seq += 1;
        self.kv.add_sequence(self.seq, &[])?;
        self.len = 0;
        self.prefix_reused = 0;
        self.attention = kv_paged::prune::AttentionTracker::new(self.config.layers);
        Ok(())
    }

    /// With `on`, a forward into an empty sequence first takes the longest run of its leading
    /// tokens whose K/V the KV prefix cache still holds (whole pages, from earlier sequences
    /// with the same tokens, or the same [`Splice::key`] for spliced rows) and computes only
    /// the rest: a prompt shared by every frame of a stream is prefilled once. On the CPU NPU
    /// the logits are bit-identical to a cold prefill's (each attention path computes a query
    /// with the same operations, whatever its batch); the GPU backend's prefill and decode
    /// kernels promise no such thing, so reuse there may move the last bits. Off by default.
    pub fn set_prefix_reuse(&mut self, on: bool) {
        self.prefix_reuse = on;
    }

    /// Tokens of the current sequence taken from the prefix cache, not computed.
    pub fn prefix_reused(&self) -> usize {
        self.prefix_reused
    }

    /// Keeps the first `len` tokens of the current sequence (rounded down to whole pages) in
    /// the KV cache until the next pin or [`Decoder::unpin`]: a fork of the sequence holds the
    /// pages, so no eviction or later pruning takes them, and a fresh sequence with the same
    /// leading tokens finds them ([`Decoder::set_prefix_reuse`]). Nothing is copied. Returns the
    /// tokens pinned: 0 when the sequence lost pages to pruning (its cache no longer lines up
    /// with its tokens) or `len` is under a page.
    pub fn pin_prefix(&mut self, len: usize) -> Result<usize, DecodeError> {
        self.unpin()?;
        let cached = self.kv.manager().len(self.seq)?;
        let bt = self.kv.layout().block_tokens;
        let keep = len.min(self.len) / bt * bt;
        if cached != self.len || keep == 0 {
            return Ok(0);
        }
        self.kv.fork(self.seq, PIN_SEQ)?;
        self.kv.truncate(PIN_SEQ, keep)?;
        self.pinned = keep;
        Ok(keep)
    }

    /// Releases what [`Decoder::pin_prefix`] holds (its pages stay in the prefix cache as any
    /// freed sequence's do, until evicted).
    pub fn unpin(&mut self) -> Result<(), DecodeError> {
        if self.pinned > 0 {
            self.kv.free_sequence(PIN_SEQ)?;
            self.pinned = 0;
        }
        Ok(())
    }

    /// Tokens the current sequence holds in the KV cache: its length less what pruning
    /// dropped.
    pub fn cached_len(&self) -> usize {
        self.kv.manager().len(self.seq).unwrap_or(0)
    }

    /// Tokens [`Decoder::pin_prefix`] holds now.
    pub fn pinned(&self) -> usize {
        self.pinned
    }

    /// Appends `tokens` to the sequence and calls `on_logits(i, logits)` for every `i` in
    /// `want` (indices into `tokens`), in order. On an error past the argument checks the
    /// sequence is dropped (its KV state would be partial), so the next call starts fresh.
    pub fn forward(
        &mut self,
        tokens: &[u32],
        want: Range<usize>,
        on_logits: impl FnMut(usize, &[f32]),
    ) -> Result<(), DecodeError> {
        self.forward_spliced(tokens, None, want, on_logits)
    }

    /// [`Decoder::forward`] with the input embeddings of the rows `splice` covers taken from
    /// it instead of the embedding table; the token ids at those positions are placeholders
    /// and only need to be inside the vocabulary.
    pub fn forward_spliced(
        &mut self,
        tokens: &[u32],
        splice: Option<Splice<'_>>,
        want: Range<usize>,
        on_logits: impl FnMut(usize, &[f32]),
    ) -> Result<(), DecodeError> {
        if let Some(why) = splice.and_then(|sp| sp.misfit(tokens.len(), self.config.hidden)) {
            return Err(DecodeError::BadInput(why));
        }
        let result = self.forward_inner(tokens, splice, want, on_logits);
        if let Err(DecodeError::Device(_) | DecodeError::Kv(_)) = &result {
            // Best effort: the original error is the one worth reporting.
            let _ = self.forget();
        }
        result
    }

    /// The ids the KV manager records for `tokens` (its prefix cache hashes them): the tokens,
    /// with spliced rows named by their splice's key.
    /// Borrowed when nothing is spliced (every decode step).
    fn cache_ids<'t>(
        tokens: &'t [u32],
        splice: Option<Splice<'_>>,
        hidden: usize,
    ) -> std::borrow::Cow<'t, [u32]> {
        let Some(sp) = splice else {
            return std::borrow::Cow::Borrowed(tokens);
        };
        let mut ids = tokens.to_vec();
        let rows = sp.key_from..sp.end(hidden);
        for (r, id) in rows.clone().zip(&mut ids[rows]) {
            *id = sp.cache_id(r);
        }
        std::borrow::Cow::Owned(ids)
    }

    fn forward_inner(
        &mut self,
        tokens: &[u32],
        splice: Option<Splice<'_>>,
        want: Range<usize>,
        mut on_logits: impl FnMut(usize, &[f32]),
    ) -> Result<(), DecodeError> {
        let vocab = self.config.vocab_size;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(DecodeError::BadToken { id, vocab });
        }
        let ctx = self.options.ctx;
        if self.len + tokens.len() > ctx {
            return Err(DecodeError::ContextFull {
                wanted: self.len + tokens.len(),
                ctx,
            });
        }
        let want = want.start.min(tokens.len())..want.end.min(tokens.len());
        let hidden = self.config.hidden;
        let ids = Decoder::cache_ids(tokens, splice, hidden);
        // A fresh sequence may start from the prefix cache, short of the first wanted row
        // (whose logits must be computed).
        let mut done = 0;
        if self.prefix_reuse && self.len == 0 {
            let limit = if want.is_empty() {
                tokens.len()
            } else {
                want.start
            };
            self.kv.free_sequence(self.seq)?;
            self.seq += 1;
            done = self.kv.add_cached_prefix(self.seq, &ids[..limit])?;
            self.len = done;
            self.prefix_reused = done;
        }
        // Image rows that came without data must have come from the cache.
        if let Some(sp) = splice.filter(|sp| sp.key_from < sp.start && done < sp.start) {
            return Err(DecodeError::BadInput(format!(
                "image rows {}..{} have no embeddings and only {done} tokens were in the KV \
                 prefix cache (pin the image's pages with Decoder::pin_prefix, and turn \
                 prefix reuse on)",
                sp.key_from, sp.start
            )));
        }
        // The copy of the logits a device that cannot show them in place reads them into, kept
        // across calls (a decode step would otherwise allocate vocab-sized memory per token);
        // taken out so `self` stays borrowable, put back below.
        let mut logits = std::mem::take(&mut self.logits_scratch);
        let bt = self.kv.layout().block_tokens;
        let max_batch = match self.pruning {
            Some(p) => self.options.max_batch.max(1).min(p.step(bt)),
            None => self.options.max_batch.max(1),
        };
        let ranks_by_attention = self.pruning.is_some_and(|p| p.policy != PrunePolicy::Sinks);
        let mut ready = splice.and_then(|sp| sp.ready);
        while done < tokens.len() {
            let mut chunk_end = (done + max_batch).min(tokens.len());
            // A submission takes one run of spliced rows: a chunk that would reach into a
            // second run ends where that run starts.
            let mut runs_here = splice
                .iter()
                .flat_map(|sp| sp.placed_runs(hidden))
                .filter(|&(at, _, rows)| at + rows > done && at < chunk_end);
            let run = runs_here.next();
            if let Some((second, _, _)) = runs_here.next() {
                chunk_end = second;
            }
            let chunk = &tokens[done..chunk_end];
            if let Some(p) = self.pruning {
                let cached = self.kv.manager().len(self.seq)?;
                if cached + chunk.len() > p.budget {
                    self.prune_to(p, p.budget - chunk.len())?;
                }
            }
            let appended = self.kv.append(self.seq, &ids[done..chunk_end])?;
            // The spliced rows that fall into this chunk, in chunk coordinates.
            let embeddings = splice.zip(run).and_then(|(sp, (at, data_row, rows))| {
                let lo = at.max(done);
                let hi = (at + rows).min(chunk_end);
                let from = data_row + (lo - at);
                (lo < hi).then(|| npu_hal::Embeddings {
                    rows: lo - done..hi - done,
                    data: sp
                        .data
                        .slice(from * hidden..(from + hi - lo) * hidden)
                        .expect("forward_spliced checked the rows"),
                })
            });
            // The tick moves only when a submission is accepted, so a refused one never leaves
            // a value that nothing will signal.
            let timeline: &dyn Timeline = &*self.timeline;
            // The first submission that reads spliced rows still being written waits for their
            // writer instead. Its own previous value is reached already (every forward ends by
            // reading logits back), so that wait would be empty; it is checked on the host to
            // keep the order regardless.
            let wait = match ready.filter(|_| embeddings.is_some()) {
                Some(point) => {
                    timeline
                        .wait(self.tick, SUBMIT_ORDER_TIMEOUT)
                        .map_err(npu_hal::Error::from)?;
                    ready = None;
                    point
                }
                None => (timeline, self.tick),
            };
            // The wanted rows of this chunk, in chunk coordinates: with the body in one
            // submission when they fit one head slice, else a head-sized slice at a time after.
            let slice = self.options.max_logit_rows.max(1);
            let lo = want.start.max(done).min(chunk_end) - done;
            let hi = want.end.max(done).min(chunk_end) - done;
            let together = lo < hi && hi - lo <= slice;
            self.device.submit(Submission {
                ops: if together {
                    &self.body_and_head
                } else {
                    &self.body
                },
                batch: Batch {
                    tokens: chunk,
                    first_pos: self.len,
                    seq: self.seq,
                    slots: &appended.slots,
                    select: if together { lo..hi } else { 0..0 },
                    embeddings,
                },
                kv: Some(&mut self.kv),
                attention: ranks_by_attention.then_some(&mut self.attention),
                wait: Some(wait),
                signal: Some((timeline, self.tick + 1)),
                // Nothing but the logits (or the head's input) is read after it.
                live: Some(if together {
                    std::slice::from_ref(&self.logits)
                } else {
                    std::slice::from_ref(&self.head_input)
                }),
            })?;
            self.tick += 1;
            self.len += chunk.len();
            // Each head slice's logits; the first slice's are already computed when the body
            // ran with the head.
            let mut row = lo;
            while row < hi {
                let end = (row + slice).min(hi);
                if !(together && row == lo) {
                    self.device.submit(Submission {
                        ops: &self.head,
                        batch: Batch {
                            tokens: chunk,
                            first_pos: self.len - chunk.len(),
                            seq: self.seq,
                            slots: &appended.slots,
                            select: row..end,
                            embeddings: None,
                        },
                        kv: None,
                        attention: None,
                        wait: Some((timeline, self.tick)),
                        signal: Some((timeline, self.tick + 1)),
                        live: Some(std::slice::from_ref(&self.logits)),
                    })?;
                    self.tick += 1;
                }
                // In place where the device lets the host read them (the scratch is the copy
                // otherwise).
                let first = done + row;
                self.device
                    .view_tensor(self.logits, 0..end - row, &mut logits, &mut |all| {
                        for (j, l) in all.chunks_exact(vocab).enumerate() {
                            on_logits(first + j, l);
                        }
                    })?;
                row = end;
            }
            done = chunk_end;
        }
        self.logits_scratch = logits;
        Ok(())
    }

    /// Runs `tokens` through the model as one batch in a fresh sequence (at most
    /// [`DecoderOptions::max_batch`] of them) and shows every linear layer's input to `observe`:
    /// the names of the matrices that read it (`blk.0.attn_q`, ...; the output head is
    /// `token_embd` when tied, else `output`) and its `tokens.len() x width` rows. What
    /// calibration (`crate::quantize`) collects its statistics from. The program runs in
    /// segments, cut before each group of linear layers, so each input is read where it is.
    ///
    /// # Errors
    /// As [`Decoder::forward`], and [`DecodeError::BadInput`] for an empty or too long batch.
    pub fn observe_linear_inputs(
        &mut self,
        tokens: &[u32],
        mut observe: impl FnMut(&[&str], &[f32]),
    ) -> Result<(), DecodeError> {
        let max = self.options.max_batch.max(1);
        if tokens.is_empty() || tokens.len() > max {
            return Err(DecodeError::BadInput(format!(
                "a calibration batch takes 1 to {max} tokens, not {}",
                tokens.len()
            )));
        }
        let vocab = self.config.vocab_size;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(DecodeError::BadToken { id, vocab });
        }
        self.reset()?;
        let appended = self.kv.append(self.seq, tokens)?;
        // Cut points: the first of each run of linear layers that read the same tensor.
        let mut cuts = Vec::new();
        let mut previous = None;
        for (i, op) in self.body.iter().enumerate() {
            let reads = match op {
                Op::Linear { x, .. } => Some(*x),
                _ => None,
            };
            if reads.is_some() && reads != previous {
                cuts.push(i);
            }
            previous = reads;
        }
        let head_x = match self.head.first() {
            Some(Op::Linear { x, weight, .. }) => Some((*x, *weight)),
            _ => None,
        };
        let n = tokens.len();
        let mut rows = Vec::new();
        let mut start = 0;
        let result = (|| {
            for end in cuts.iter().copied().chain([self.body.len()]) {
                let timeline: &dyn Timeline = &*self.timeline;
                self.device.submit(Submission {
                    ops: &self.body[start..end],
                    batch: Batch {
                        tokens,
                        first_pos: 0,
                        seq: self.seq,
                        slots: &appended.slots,
                        select: 0..0,
                        embeddings: None,
                    },
                    kv: Some(&mut self.kv),
                    attention: None,
                    wait: Some((timeline, self.tick)),
                    signal: Some((timeline, self.tick + 1)),
                    // The segment's results are read back below, whichever they are.
                    live: None,
                })?;
                self.tick += 1;
                start = end;
                // The linear layers from this cut on that read one tensor, or the head's input
                // after the last segment.
                let (x, names): (TensorId, Vec<&str>) = if end < self.body.len() {
                    let Op::Linear { x, .. } = self.body[end] else {
                        unreachable!("cuts are at linear layers")
                    };
                    let names = self.body[end..]
                        .iter()
                        .map_while(|op| match op {
                            Op::Linear {
                                x: read, weight, ..
                            } if *read == x => Some(*weight),
                            _ => None,
                        })
                        .filter_map(|w| self.matrix_names.get(&w).map(String::as_str))
                        .collect();
                    (x, names)
                } else if let Some((x, w)) = head_x {
                    (
                        x,
                        self.matrix_names
                            .get(&w)
                            .map(String::as_str)
                            .into_iter()
                            .collect(),
                    )
                } else {
                    break;
                };
                let (width, _) = self.device.tensor_shape(x).ok_or_else(|| {
                    DecodeError::BadInput("a linear layer reads a tensor the device lacks".into())
                })?;
                rows.resize(n * width, 0.0);
                self.device.read_tensor(x, 0..n, &mut rows)?;
                observe(&names, &rows);
            }
            Ok(())
        })();
        self.len = n;
        if result.is_err() {
            let _ = self.reset();
        }
        result
    }

    /// Appends `tokens` and returns the logits of the last one.
    pub fn forward_last(&mut self, tokens: &[u32]) -> Result<Vec<f32>, DecodeError> {
        let mut out = Vec::new();
        self.forward_last_into(tokens, &mut out)?;
        Ok(out)
    }

    /// Decodes up to `steps` tokens from `first`, one at a time: `pick` sees each step's
    /// logits (in place where the device allows; [`Logits::argmax`] for greedy decoding) and
    /// returns the token to feed next, or `None` to stop. Returns the steps run (logits shown
    /// to `pick`).
    ///
    /// Where the device holds submissions ([`npu_hal::Device::submit_held`]; the GPU), each
    /// step is queued before the previous step's logits are read, and released with its token
    /// once `pick` returns it: the submission's host cost overlaps the device's run, and the
    /// device idles only for the host's wake, the pick and the release. Elsewhere, and with KV
    /// pruning, it is the plain loop over [`Decoder::forward`]. The logits are the same either
    /// way: a step queued when `pick` ends the reply is discarded, repeating the step before's
    /// writes with the same values.
    pub fn decode_ahead(
        &mut self,
        first: u32,
        steps: usize,
        mut pick: impl FnMut(&Logits<'_>) -> Option<u32>,
    ) -> Result<usize, DecodeError> {
        if steps == 0 {
            return Ok(0);
        }
        // The first step the plain way (it may start a fresh sequence from the prefix cache).
        let mut next = None;
        self.forward(&[first], 0..1, |_, l| next = pick(&Logits::scanned(l)))?;
        let ahead = self.device.holds() && self.pruning.is_none();
        let mut done = 1;
        while done < steps {
            let Some(token) = next else {
                return Ok(done);
            };
            if !ahead {
                self.forward(&[token], 0..1, |_, l| next = pick(&Logits::scanned(l)))?;
                done += 1;
                continue;
            }
            let result = self.run_ahead(token, steps - done, &mut pick);
            if let Err(DecodeError::Device(_) | DecodeError::Kv(_)) = &result {
                // Best effort: the original error is the one worth reporting.
                let _ = self.forget();
            }
            return result.map(|n| done + n);
        }
        Ok(done)
    }

    /// [`Decoder::decode_ahead`]'s queued loop from `token` (the next to feed): up to `steps`
    /// steps.
    fn run_ahead(
        &mut self,
        token: u32,
        steps: usize,
        pick: &mut impl FnMut(&Logits<'_>) -> Option<u32>,
    ) -> Result<usize, DecodeError> {
        let vocab = self.config.vocab_size;
        if token as usize >= vocab {
            return Err(DecodeError::BadToken { id: token, vocab });
        }
        if self.len >= self.options.ctx {
            return Err(DecodeError::ContextFull {
                wanted: self.len + 1,
                ctx: self.options.ctx,
            });
        }
        // The first queued step is released at once; each after it is queued before the
        // logits of the one before are read.
        let held = self.hold_step()?;
        self.release_step(held, token)?;
        let mut logits = std::mem::take(&mut self.logits_scratch);
        let mut done = 0;
        let result = loop {
            let queued = if done + 1 < steps && self.len < self.options.ctx {
                match self.hold_step() {
                    Ok(h) => Some(h),
                    Err(e) => break Err(e),
                }
            } else {
                None
            };
            let mut next = None;
            let (device, tensor): (&dyn Device, _) = (&*self.device, self.logits);
            let viewed = device.view_tensor(tensor, 0..1, &mut logits, &mut |l| {
                next = pick(&Logits {
                    values: l,
                    on_device: Some((device, tensor, 0)),
                });
            });
            done += 1;
            let Some(held) = queued else {
                break match (viewed, next) {
                    (Err(e), _) => Err(e.into()),
                    (Ok(()), Some(_)) if done < steps => Err(DecodeError::ContextFull {
                        wanted: self.len + 1,
                        ctx: self.options.ctx,
                    }),
                    (Ok(()), _) => Ok(done),
                };
            };
            match (viewed, next) {
                (Ok(()), Some(t)) if (t as usize) < vocab => {
                    if let Err(e) = self.release_step(held, t) {
                        break Err(e);
                    }
                }
                (viewed, next) => {
                    // No token to give it: it runs as the step before, then the loop ends.
                    let discarded = self.device.discard(held).map_err(DecodeError::from);
                    break match (viewed, next) {
                        (Err(e), _) => Err(e.into()),
                        (Ok(()), Some(id)) => Err(DecodeError::BadToken { id, vocab }),
                        (Ok(()), None) => discarded.map(|()| done),
                    };
                }
            }
        };
        self.logits_scratch = logits;
        result
    }

    /// Queues the next one-token step, its token and slot not known yet.
    fn hold_step(&mut self) -> Result<npu_hal::Held, DecodeError> {
        let timeline: &dyn Timeline = &*self.timeline;
        // Placeholders of the right shape: the release writes the real ones.
        let slots = [kv_paged::Slot {
            block: 0,
            offset: 0,
        }];
        let held = self.device.submit_held(Submission {
            ops: &self.body_and_head,
            batch: Batch {
                tokens: &[0],
                first_pos: self.len,
                seq: self.seq,
                slots: &slots,
                select: 0..1,
                embeddings: None,
            },
            kv: Some(&mut self.kv),
            attention: None,
            wait: Some((timeline, self.tick)),
            signal: Some((timeline, self.tick + 1)),
            live: Some(std::slice::from_ref(&self.logits)),
        })?;
        self.tick += 1;
        Ok(held)
    }

    /// Appends `token` and releases the held step with it (discarding it where the cache is
    /// out of blocks, so the queue moves).
    fn release_step(&mut self, held: npu_hal::Held, token: u32) -> Result<(), DecodeError> {
        let appended = match self.kv.append(self.seq, &[token]) {
            Ok(a) => a,
            Err(e) => {
                let _ = self.device.discard(held);
                return Err(e.into());
            }
        };
        self.device.release(
            held,
            Batch {
                tokens: &[token],
                first_pos: self.len,
                seq: self.seq,
                slots: &appended.slots,
                select: 0..1,
                embeddings: None,
            },
            Some(&self.kv),
        )?;
        self.len += 1;
        Ok(())
    }

    /// [`Decoder::forward_last`] into `out`, reusing its allocation: what a decode loop calls
    /// once per token.
    pub fn forward_last_into(
        &mut self,
        tokens: &[u32],
        out: &mut Vec<f32>,
    ) -> Result<(), DecodeError> {
        let n = tokens.len();
        self.forward(tokens, n.saturating_sub(1)..n, |_, l| {
            out.clear();
            out.extend_from_slice(l)
        })
    }
}

/// Load-time state: where weights come from, how they are stored, what was loaded.
struct Loading<'a> {
    source: &'a dyn TensorSource,
    policy: WeightPolicy,
    report: LoadReport,
    bits: f64,
    cache: Option<crate::mxcache::MxCache>,
    writer: Option<crate::mxcache::CacheWriter>,
    /// Each loaded matrix's name, for [`Decoder::observe_linear_inputs`].
    names: std::collections::HashMap<WeightId, String>,
}

impl Loading<'_> {
    /// The MX format and shape `name` gets under the policy, if it becomes an MX matrix.
    fn planned(&self, name: &str, class: TensorClass) -> Option<crate::mxcache::Planned> {
        let (rows, cols) = self.source.shape(name)?;
        match self.policy.storage(class) {
            // A matrix the file stores in this format already is taken as it is: no cache.
            Storage::Mx(format) if stored_format(self.source, name) == Some(format) => None,
            Storage::Mx(format) if cols.is_multiple_of(mx_quant::BLOCK) => {
                Some(crate::mxcache::Planned {
                    name: name.to_string(),
                    format,
                    rows,
                    cols,
                })
            }
            _ => None,
        }
    }

    fn convert(&mut self, name: &str, class: TensorClass) -> Result<Weight, DecodeError> {
        convert(
            self.source,
            name,
            self.policy.storage(class),
            &self.policy,
            &mut self.report,
        )
    }

    /// Converts matrix `name` as the policy says for `class` and loads it into `device`.
    fn matrix(
        &mut self,
        device: &mut dyn Device,
        name: &str,
        class: TensorClass,
    ) -> Result<WeightId, DecodeError> {
        let w = match (self.planned(name, class), &self.cache) {
            (Some(p), Some(cache)) => match cache.get(name, p.format, p.rows, p.cols) {
                Ok(Some(m)) => {
                    self.report.from_cache += 1;
                    Weight::Mx(m)
                }
                Ok(None) => self.convert(name, class)?,
                Err(e) => {
                    self.report.cache_problem = Some(e.to_string());
                    self.cache = None;
                    self.convert(name, class)?
                }
            },
            _ => self.convert(name, class)?,
        };
        if let (Some(writer), Weight::Mx(m)) = (&mut self.writer, &w)
            && let Err(e) = writer.write(name, m)
        {
            self.report.cache_problem = Some(e.to_string());
            self.writer = None;
        }
        let (r, c) = w.shape();
        self.report.parameters += r * c;
        self.report.stream_bytes_per_token += w.bytes();
        self.bits += w.bytes() as f64 * 8.0;
        let id = device.load_weight(w)?;
        self.names.insert(id, name.to_string());
        Ok(id)
    }
}

/// The MX format a `pipeline quantize` file stores `name` in, if it is one.
fn stored_format(source: &dyn TensorSource, name: &str) -> Option<ElemFormat> {
    match source.dtype(name)? {
        crate::model::SourceDtype::Mx(format) => Some(format),
        _ => None,
    }
}

/// Reads a 1-D tensor (a norm gain).
fn vector(source: &dyn TensorSource, name: &str) -> Result<Weight, DecodeError> {
    let (r, c) = source.shape(name).ok_or_else(|| LoadError::TensorMissing {
        tensor: name.to_string(),
    })?;
    let mut v = vec![0f32; r * c];
    source.read_rows(name, 0..r, &mut v)?;
    Ok(Weight::Vector(v))
}

/// Reads a matrix and stores it as `storage` says.
fn convert(
    source: &dyn TensorSource,
    name: &str,
    storage: Storage,
    policy: &WeightPolicy,
    report: &mut LoadReport,
) -> Result<Weight, DecodeError> {
    let (rows, cols) = source.shape(name).ok_or_else(|| LoadError::TensorMissing {
        tensor: name.to_string(),
    })?;
    let format = match storage {
        Storage::Mx(f) if cols.is_multiple_of(mx_quant::BLOCK) => f,
        Storage::Mx(_) => {
            report.kept_exact.push(name.to_string());
            return dense(source, name, rows, cols, policy);
        }
        Storage::Exact => return dense(source, name, rows, cols, policy),
    };
    if let Some(m) = stored_as(source, name, format) {
        return m.map(Weight::Mx);
    }
    let options = QuantOptions {
        scale: policy.scale,
        ..QuantOptions::default()
    };
    let quant_err = |source| DecodeError::Quantize {
        tensor: name.to_string(),
        source,
    };
    // Row chunks bound the f32 staging to CHUNK rows, whatever the matrix size.
    const CHUNK: usize = 256;
    let blocks_per_row = cols / mx_quant::BLOCK;
    let row_bytes = mx_quant::layout::packed_len(format, cols);
    let mut scales = vec![0u8; rows * blocks_per_row];
    let mut packed = vec![0u8; rows * row_bytes];
    let mut staging = vec![0f32; CHUNK.min(rows) * cols];
    for start in (0..rows).step_by(CHUNK) {
        let end = (start + CHUNK).min(rows);
        let buf = &mut staging[..(end - start) * cols];
        source.read_rows(name, start..end, buf)?;
        mx_quant::bulk::quantize(
            format,
            options,
            buf,
            &mut scales[start * blocks_per_row..end * blocks_per_row],
            &mut packed[start * row_bytes..end * row_bytes],
        )
        .map_err(quant_err)?;
    }
    let m = mx_quant::gemv::MxMatrix::from_linear(format, rows, cols, &scales, &packed)
        .map_err(quant_err)?;
    Ok(Weight::Mx(m))
}

/// The matrix as the file stores it, when the file holds it in `format` already (a
/// `pipeline quantize` file): its blocks, rotation included, are taken as they are, never
/// converted again.
fn stored_as(
    source: &dyn TensorSource,
    name: &str,
    format: ElemFormat,
) -> Option<Result<mx_quant::gemv::MxMatrix, DecodeError>> {
    if stored_format(source, name)? != format {
        return None;
    }
    let (_, bytes) = source.raw(name)?;
    let (rows, cols) = source.shape(name)?;
    let block = 1 + mx_quant::layout::packed_len(format, mx_quant::BLOCK);
    let blocks = bytes.len() / block;
    let mut scales = Vec::with_capacity(blocks);
    let mut packed = Vec::with_capacity(blocks * (block - 1));
    for b in bytes.chunks_exact(block) {
        scales.push(b[0]);
        packed.extend_from_slice(&b[1..]);
    }
    Some(
        mx_quant::gemv::MxMatrix::from_linear(format, rows, cols, &scales, &packed)
            .map(|m| m.with_block_rotation(source.block_rotation(name)))
            .map_err(|source| DecodeError::Quantize {
                tensor: name.to_string(),
                source,
            }),
    )
}

fn dense(
    source: &dyn TensorSource,
    name: &str,
    rows: usize,
    cols: usize,
    policy: &WeightPolicy,
) -> Result<Weight, DecodeError> {
    use crate::model::SourceDtype;
    // Block-quantized sources stay in their own blocks under the exact policy: the same values,
    // a quarter to a sixth of the bytes, and ggml's own dot products.
    if policy.source_activations
        && let Some((dtype, bytes)) = source.raw(name)
    {
        let ty = match dtype {
            SourceDtype::Q4_0 => Some(npu_hal::ggml::BlockType::Q4_0),
            SourceDtype::Q4_1 => Some(npu_hal::ggml::BlockType::Q4_1),
            SourceDtype::Q8_0 => Some(npu_hal::ggml::BlockType::Q8_0),
            _ => None,
        };
        if let Some(ty) = ty {
            let m = npu_hal::ggml::BlockMatrix::new(ty, rows, cols, bytes.to_vec())?;
            return Ok(Weight::Block(m));
        }
    }
    let mut data = vec![0f32; rows * cols];
    source.read_rows(name, 0..rows, &mut data)?;
    let rounding = match source.dtype(name) {
        _ if !policy.source_activations => ActivationRounding::None,
        Some(SourceDtype::F16) => ActivationRounding::F16,
        Some(SourceDtype::BF16) => ActivationRounding::Bf16,
        Some(
            SourceDtype::Q8_0
            | SourceDtype::Q4_0
            | SourceDtype::Q4_1
            | SourceDtype::Mxfp4
            | SourceDtype::Mx(_),
        ) => ActivationRounding::Q8Block,
        Some(SourceDtype::F32) | None => ActivationRounding::None,
    };
    Ok(Weight::Dense(
        DenseMatrix::new(rows, cols, data)
            .expect("the buffer was sized rows * cols")
            .with_activation_rounding(rounding),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matrices_are_classed_by_their_canonical_names() {
        assert_eq!(TensorClass::of("token_embd"), Some(TensorClass::Embedding));
        assert_eq!(TensorClass::of("output"), Some(TensorClass::Output));
        assert_eq!(
            TensorClass::of("blk.3.attn_v"),
            Some(TensorClass::Attention)
        );
        assert_eq!(TensorClass::of("blk.12.ffn_up"), Some(TensorClass::MlpIn));
        assert_eq!(
            TensorClass::of("blk.0.ffn_down"),
            Some(TensorClass::MlpDown)
        );
        assert_eq!(TensorClass::of("blk.0.attn_norm"), None);
        assert_eq!(TensorClass::of("output_norm"), None);
    }
}
