//! Text generation, perplexity and throughput measurement over a [`Decoder`]: the library side of
//! `pipeline generate`, `pipeline perplexity` and `pipeline bench`, so tests and other programs
//! drive exactly what the binary does.
//!
//! `perplexity` follows llama.cpp's `llama-perplexity` so the numbers compare: the text is
//! tokenized whole, split into non-overlapping `ctx`-token chunks (a trailing partial chunk is
//! dropped), each chunk is evaluated from an empty cache (with BOS as its first token when the
//! model adds one), and only the second half of each chunk is scored: the logits at positions
//! `ctx/2 .. ctx-1` predict tokens `ctx/2 + 1 .. ctx`.

use std::path::Path;
use std::time::{Duration, Instant};

use npu_hal::sampling::{Sampler, SamplingError, SamplingParams};
use npu_hal::{CpuConfig, CpuNpu};

use crate::decoder::{DecodeError, Decoder, DecoderOptions, Splice};
use crate::model::tokenizer::Tokenizer;
use crate::speculative::{Draft, DraftControl, DraftStats, Drafter, Verdict};

/// Which npu-hal device the decoder runs on (`--device`, `device =` in a chain TOML).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The CPU reference NPU.
    Cpu,
    /// The GPU backend on the best Vulkan adapter (lavapipe counts where it is the only one).
    Gpu,
    /// A `/dev/accel` NPU (no driver has an execution backend yet: it is refused by name).
    Accel,
    /// A hardware Vulkan adapter when there is one, else the CPU NPU.
    Auto,
}

impl std::str::FromStr for DeviceChoice {
    type Err = DecodeError;

    fn from_str(name: &str) -> Result<DeviceChoice, DecodeError> {
        Ok(match name {
            "cpu" => DeviceChoice::Cpu,
            "gpu" => DeviceChoice::Gpu,
            "accel" => DeviceChoice::Accel,
            "auto" => DeviceChoice::Auto,
            other => {
                return Err(DecodeError::BadInput(format!(
                    "device {other:?}: use cpu, gpu, accel or auto"
                )));
            }
        })
    }
}

/// Opens the device `choice` names, with `threads` workers for the CPU NPU (0 = every core).
/// Returns the device and, for `auto`, a sentence saying what it picked and why.
pub fn open_device(
    choice: DeviceChoice,
    threads: usize,
) -> Result<(Box<dyn npu_hal::Device>, Option<String>), DecodeError> {
    use npu_hal::{AdapterChoice, Backend, VulkanBackend, VulkanConfig};
    let cpu = || -> Result<Box<dyn npu_hal::Device>, DecodeError> {
        Ok(Box::new(CpuNpu::new(CpuConfig {
            threads,
            ..CpuConfig::default()
        })?))
    };
    let gpu = |adapter| VulkanBackend {
        config: VulkanConfig {
            adapter,
            ..VulkanConfig::default()
        },
    };
    Ok(match choice {
        DeviceChoice::Cpu => (cpu()?, None),
        DeviceChoice::Gpu => (gpu(AdapterChoice::Best).open()?, None),
        DeviceChoice::Accel => (npu_hal::AccelBackend.open()?, None),
        DeviceChoice::Auto => match gpu(AdapterChoice::Hardware).open() {
            Ok(d) => {
                let why = format!("auto picked {} (a hardware Vulkan adapter)", d.info().name);
                (d, Some(why))
            }
            Err(e) => (
                cpu()?,
                Some(format!("auto picked the CPU NPU: no hardware GPU ({e})")),
            ),
        },
    })
}

/// Opens a model file or directory on the CPU NPU with `threads` workers (0 = every core).
pub fn open_decoder(
    model: &Path,
    options: DecoderOptions,
    threads: usize,
) -> Result<(Decoder, Option<Tokenizer>), DecodeError> {
    let device = CpuNpu::new(CpuConfig {
        threads,
        ..CpuConfig::default()
    })?;
    open_decoder_on(model, options, Box::new(device))
}

/// Opens a model file or directory on `device` (any npu-hal backend's device).
pub fn open_decoder_on(
    model: &Path,
    options: DecoderOptions,
    device: Box<dyn npu_hal::Device>,
) -> Result<(Decoder, Option<Tokenizer>), DecodeError> {
    let crate::model::LoadedModel {
        config,
        tensors: source,
        tokenizer,
    } = crate::model::open_model(model)?;
    let decoder = Decoder::new(config, &*source, device, options)?;
    Ok((decoder, tokenizer))
}

/// Where drafts come from (`--draft`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DraftSource {
    /// Prompt lookup ([`crate::speculative::NgramDrafter`]).
    Ngram,
    /// A smaller model with the same vocabulary ([`crate::speculative::ModelDrafter`]).
    Model(std::path::PathBuf),
}

impl std::str::FromStr for DraftSource {
    type Err = DecodeError;

    fn from_str(s: &str) -> Result<DraftSource, DecodeError> {
        match s {
            "ngram" => Ok(DraftSource::Ngram),
            "" => Err(DecodeError::BadInput(
                "--draft needs ngram or a model path".into(),
            )),
            path => Ok(DraftSource::Model(path.into())),
        }
    }
}

/// Opens the drafter `source` names (`--draft`: `ngram`, or a draft model's path opened on a
/// fresh `device` of the given kind with `threads` workers) for `target`. Returns it and, for a
/// model, a line saying what was loaded.
pub fn open_drafter(
    source: &str,
    target: &Decoder,
    target_tokenizer: Option<&Tokenizer>,
    device: DeviceChoice,
    threads: usize,
    sampling: &SamplingParams,
) -> Result<(Box<dyn Drafter + Send>, Option<String>), DecodeError> {
    Ok(match source.parse::<DraftSource>()? {
        DraftSource::Ngram => (Box::new(crate::speculative::NgramDrafter::default()), None),
        DraftSource::Model(path) => {
            let (device, _) = open_device(device, threads)?;
            let drafter = open_draft_model(&path, target, target_tokenizer, device, sampling)?;
            let note = format!(
                "draft model {}: {:.1} MiB of weights, {:.2} of the target's bytes per token",
                path.display(),
                drafter.decoder().report().weight_bytes as f64 / (1 << 20) as f64,
                drafter.cost_per_token()
            );
            (Box::new(drafter), Some(note))
        }
    })
}

/// Opens a draft model for `target` on `device`: the same context, KV dtype and batch limits,
/// the policy its file records (else `default`). Refuses a model whose vocabulary differs from
/// the target's: by size, and token by token where both have tokenizers.
pub fn open_draft_model(
    path: &Path,
    target: &Decoder,
    target_tokenizer: Option<&Tokenizer>,
    device: Box<dyn npu_hal::Device>,
    sampling: &SamplingParams,
) -> Result<crate::speculative::ModelDrafter, DecodeError> {
    let policy_name = recorded_policy(path)?.unwrap_or_else(|| "default".into());
    let t = target.options();
    let options = DecoderOptions {
        policy: crate::decoder::WeightPolicy::parse(&policy_name)?,
        ctx: t.ctx,
        max_batch: t.max_batch,
        max_logit_rows: 1,
        kv_dtype: t.kv_dtype,
        cache: None,
    };
    let (draft, tokenizer) = open_decoder_on(path, options, device)?;
    let (dv, tv) = (draft.config().vocab_size, target.config().vocab_size);
    if dv != tv {
        return Err(DecodeError::BadInput(format!(
            "draft model {} has a vocabulary of {dv} tokens, the target {tv}: a draft must share the target's tokenizer",
            path.display()
        )));
    }
    if let (Some(a), Some(b)) = (target_tokenizer, tokenizer.as_ref())
        && let Some(id) = (0..tv as u32).find(|&id| a.token_bytes(id) != b.token_bytes(id))
    {
        return Err(DecodeError::BadInput(format!(
            "draft model {}: token {id} is {:?} there and {:?} in the target: a draft must share the target's tokenizer",
            path.display(),
            b.token_to_piece(id),
            a.token_to_piece(id)
        )));
    }
    // Decode is bandwidth-bound: a drafted token costs about the draft's share of the bytes
    // streamed per step.
    let cost = draft.report().stream_bytes_per_token as f64
        / target.report().stream_bytes_per_token.max(1) as f64;
    crate::speculative::ModelDrafter::new(draft, sampling, cost)
}

/// The weight policy `model` was quantized with, when `pipeline quantize` made it (a GGUF file
/// recording [`crate::model::gguf::POLICY_KEY`]); `None` for any other model.
///
/// # Errors
/// A GGUF file that cannot be read, or whose recorded policy is not a string.
pub fn recorded_policy(model: &Path) -> Result<Option<String>, DecodeError> {
    if !model.is_file() {
        return Ok(None);
    }
    let file = match crate::model::gguf::GgufFile::open(model) {
        Ok(f) => f,
        // Not GGUF: the model loader says what it is.
        Err(crate::model::LoadError::NotAModel { .. }) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    Ok(file.recorded_policy()?.map(str::to_owned))
}

/// KV page storage by name: `f32`, `f16`, `bf16`, `mxfp8` or `mxfp4`.
pub fn parse_kv_dtype(name: &str) -> Result<kv_paged::PageDtype, DecodeError> {
    use kv_paged::PageDtype::*;
    Ok(match name {
        "f32" => F32,
        "f16" => F16,
        "bf16" => Bf16,
        "mxfp8" => Mxfp8,
        "mxfp4" => Mxfp4,
        other => {
            return Err(DecodeError::BadInput(format!(
                "KV storage {other:?}: use f32, f16, bf16, mxfp8 or mxfp4"
            )));
        }
    })
}

/// Where converted weights are cached unless the user says otherwise: beside the model.
pub fn default_cache_dir(model: &Path) -> std::path::PathBuf {
    match model.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    }
}

/// The converted-weight cache for `model` under `policy`, kept in `dir` (see
/// [`crate::mxcache`]); `None` when the model file cannot be stat'ed.
pub fn cache_spec(
    model: &Path,
    dir: &Path,
    policy: &crate::decoder::WeightPolicy,
) -> Option<crate::decoder::CacheSpec> {
    let key = crate::mxcache::CacheKey::new(model, &format!("{policy:?}")).ok()?;
    Some(crate::decoder::CacheSpec {
        path: crate::mxcache::cache_path(dir, model, &policy.name),
        key,
    })
}

/// Timings of one generation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated: usize,
    /// Time to process the prompt and produce the first token.
    pub time_to_first_token: Duration,
    /// Time of the remaining tokens.
    pub decode_time: Duration,
    /// Speculative decoding's counters (steps are counted without it too).
    pub draft: DraftStats,
    /// Prompt tokens whose K/V came from the prefix cache ([`Decoder::set_prefix_reuse`]).
    pub prefix_cached_tokens: usize,
    /// KV pages the decoder's budget dropped ([`Decoder::set_pruning`]).
    pub kv_pages_pruned: u64,
}

impl GenerationStats {
    /// Prompt tokens per second.
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.time_to_first_token.as_secs_f64().max(1e-12)
    }

    /// Generated tokens per second after the first.
    pub fn decode_tokens_per_s(&self) -> f64 {
        self.generated.saturating_sub(1) as f64 / self.decode_time.as_secs_f64().max(1e-12)
    }
}

/// Generates up to `max_tokens` tokens after `prompt` (which starts a fresh sequence), calling
/// `on_token` with each; stops early at a token in `stop` (not passed on) or when `on_token`
/// returns `false`.
pub fn generate(
    decoder: &mut Decoder,
    prompt: &[u32],
    max_tokens: usize,
    sampling: SamplingParams,
    stop: &[u32],
    on_token: impl FnMut(u32) -> bool,
) -> Result<GenerationStats, DecodeError> {
    generate_constrained(decoder, prompt, max_tokens, sampling, stop, None, on_token)
}

/// [`generate`] with every token restricted by `grammar` (when given): disallowed tokens are
/// masked before sampling, and generation ends when the grammar can take no more text.
pub fn generate_constrained(
    decoder: &mut Decoder,
    prompt: &[u32],
    max_tokens: usize,
    sampling: SamplingParams,
    stop: &[u32],
    grammar: Option<&crate::grammar::Grammar>,
    on_token: impl FnMut(u32) -> bool,
) -> Result<GenerationStats, DecodeError> {
    generate_speculative(
        decoder, prompt, max_tokens, sampling, stop, grammar, None, on_token,
    )
}

/// A drafter and its controller, for [`generate_speculative`].
#[derive(Debug)]
pub struct Speculation<'a> {
    pub drafter: &'a mut dyn Drafter,
    pub control: DraftControl,
}

/// [`generate_constrained`] with speculative decoding when `speculation` is given (see
/// [`crate::speculative`]): each step feeds the last token and the drafts in one batch, keeps
/// the drafts the target agrees with, and truncates the rest from the KV cache. Greedy output
/// is token for token that of plain decoding; sampled output has the same distribution.
#[allow(clippy::too_many_arguments)]
pub fn generate_speculative(
    decoder: &mut Decoder,
    prompt: &[u32],
    max_tokens: usize,
    sampling: SamplingParams,
    stop: &[u32],
    grammar: Option<&crate::grammar::Grammar>,
    speculation: Option<Speculation<'_>>,
    on_token: impl FnMut(u32) -> bool,
) -> Result<GenerationStats, DecodeError> {
    generate_from(
        decoder,
        Prompt::text(prompt),
        max_tokens,
        sampling,
        stop,
        grammar,
        speculation,
        on_token,
    )
}

/// What a generation starts from.
#[derive(Clone, Copy, Debug)]
pub struct Prompt<'a> {
    pub tokens: &'a [u32],
    /// Input embeddings replacing some of the rows (an image's).
    pub splice: Option<Splice<'a>>,
    /// The tokens the repetition penalty and the drafter start from, when not `tokens` (a
    /// prompt with an image gives its text tokens).
    pub history: Option<&'a [u32]>,
    /// Pin the K/V prefilled so far (whole pages) once the prompt is in ([`Decoder::pin_prefix`]),
    /// so a later generation from the same prompt finds every page of it in the cache.
    pub pin: bool,
    /// Append to the decoder's current sequence (a running conversation) instead of starting
    /// a fresh one.
    pub continues: bool,
}

impl<'a> Prompt<'a> {
    /// A prompt of text tokens only.
    pub fn text(tokens: &'a [u32]) -> Prompt<'a> {
        Prompt {
            tokens,
            splice: None,
            history: None,
            pin: false,
            continues: false,
        }
    }
}

/// What a reply does with each token sampled, in either of [`generate_from`]'s loops: the
/// first token's time, the stop tokens, the grammar, the history and the caller's callback.
struct Reply<'a, F> {
    stop: &'a [u32],
    grammar: Option<&'a crate::grammar::Grammar>,
    state: Option<crate::grammar::GrammarState>,
    history: Vec<u32>,
    stats: GenerationStats,
    start: Instant,
    first: Option<Instant>,
    max_tokens: usize,
    on_token: F,
}

/// What a reply does after a token ([`Reply::emit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Emitted {
    /// A stop token: not part of the reply, which ends.
    Stop,
    /// The reply's last token (the callback said so, the grammar is exhausted, or the length).
    Last,
    /// A token of the reply, which goes on.
    More,
}

fn grammar_error(e: crate::grammar::GrammarError) -> DecodeError {
    DecodeError::Sampling(e.to_string())
}

fn sampling_error(e: SamplingError) -> DecodeError {
    DecodeError::Sampling(e.to_string())
}

impl<F: FnMut(u32) -> bool> Reply<'_, F> {
    /// Masks `logits` to what the grammar allows next.
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), DecodeError> {
        if let (Some(g), Some(s)) = (self.grammar, self.state.as_mut()) {
            g.mask(s, logits).map_err(grammar_error)?;
        }
        Ok(())
    }

    /// Takes `token` into the reply.
    fn emit(&mut self, token: u32) -> Result<Emitted, DecodeError> {
        if self.first.is_none() {
            self.stats.time_to_first_token = self.start.elapsed();
            self.first = Some(Instant::now());
        }
        if self.stop.contains(&token) {
            return Ok(Emitted::Stop);
        }
        if let (Some(g), Some(s)) = (self.grammar, self.state.as_mut()) {
            g.advance(s, token).map_err(grammar_error)?;
        }
        self.stats.generated += 1;
        self.history.push(token);
        let exhausted = self
            .grammar
            .zip(self.state.as_ref())
            .is_some_and(|(g, s)| g.is_exhausted(s));
        if !(self.on_token)(token) || exhausted || self.stats.generated == self.max_tokens {
            return Ok(Emitted::Last);
        }
        Ok(Emitted::More)
    }
}

/// [`generate_speculative`] from any [`Prompt`]: the loop every generation runs (`generate`,
/// `pipeline run`'s decoder stage).
#[allow(clippy::too_many_arguments)]
pub fn generate_from(
    decoder: &mut Decoder,
    prompt: Prompt<'_>,
    max_tokens: usize,
    sampling: SamplingParams,
    stop: &[u32],
    grammar: Option<&crate::grammar::Grammar>,
    mut speculation: Option<Speculation<'_>>,
    on_token: impl FnMut(u32) -> bool,
) -> Result<GenerationStats, DecodeError> {
    let mut sampler = Sampler::new(sampling).map_err(sampling_error)?;
    if !prompt.continues {
        decoder.reset()?;
    }
    if let Some(s) = speculation.as_mut() {
        s.drafter.reset()?;
    }
    let stats = GenerationStats {
        prompt_tokens: prompt.tokens.len(),
        ..GenerationStats::default()
    };
    if prompt.tokens.is_empty() || max_tokens == 0 {
        return Ok(stats);
    }
    let vocab = decoder.config().vocab_size;
    let pruned_before = decoder.pages_pruned();
    let mut reply = Reply {
        stop,
        grammar,
        state: grammar.map(|g| g.start()),
        history: prompt.history.unwrap_or(prompt.tokens).to_vec(),
        stats,
        start: Instant::now(),
        first: None,
        max_tokens,
        on_token,
    };
    // rows[i * vocab..] predicts the token after the pass's i-th fed token.
    let mut rows = Vec::new();
    let n = prompt.tokens.len();
    decoder.forward_spliced(prompt.tokens, prompt.splice, n - 1..n, |_, l| {
        rows.clear();
        rows.extend_from_slice(l)
    })?;
    reply.stats.prefix_cached_tokens = decoder.prefix_reused();
    if prompt.pin {
        decoder.pin_prefix(decoder.len())?;
    }
    if let Some(speculation) = speculation {
        speculate(decoder, &mut reply, &mut sampler, &mut rows, speculation)?;
    } else {
        // One token a step: each step is queued while the one before runs, where the device
        // holds submissions (`Decoder::decode_ahead`). `take` samples one row of logits, or
        // takes the token `picked` for it, and gives the token to feed next while the reply
        // goes on. Greedy decoding with nothing to change the logits first (no grammar, no
        // repetition penalty) picks `Logits::argmax`, which the GPU answers from its head's
        // maxima, so the row is neither copied nor scanned.
        let params = sampler.params();
        let plain_greedy =
            grammar.is_none() && params.temperature == 0.0 && params.repetition_penalty == 1.0;
        let mut take =
            |logits: &mut [f32], picked: Option<u32>| -> Result<Option<u32>, DecodeError> {
                let token = match picked {
                    Some(token) => token,
                    None => {
                        reply.mask(logits)?;
                        sampler
                            .sample(logits, &reply.history)
                            .map_err(sampling_error)?
                    }
                };
                Ok((reply.emit(token)? == Emitted::More).then_some(token))
            };
        if let Some(token) = take(&mut rows[..vocab], None)? {
            let mut failed = None;
            // `take` has one token out (the reply goes on only below `max_tokens`); each step
            // is a decoder pass after the prompt's.
            let steps = decoder.decode_ahead(token, max_tokens - 1, |l| {
                let taken = if plain_greedy {
                    match l.argmax() {
                        Some((i, _)) => take(&mut [], Some(i as u32)),
                        None => Err(sampling_error(SamplingError::NoCandidates)),
                    }
                } else {
                    rows.clear();
                    rows.extend_from_slice(l.values());
                    take(&mut rows, None)
                };
                taken.unwrap_or_else(|e| {
                    failed = Some(e);
                    None
                })
            })?;
            if let Some(e) = failed {
                return Err(e);
            }
            reply.stats.draft.steps = steps;
        }
    }
    let mut stats = reply.stats;
    stats.decode_time = reply.first.map_or(Duration::ZERO, |t| t.elapsed());
    stats.kv_pages_pruned = decoder.pages_pruned() - pruned_before;
    Ok(stats)
}

/// [`generate_from`]'s loop with drafts: each pass feeds the last token and the drafts, and
/// row i of its logits checks draft i and gives the next token. `rows` holds the prompt's
/// last row.
fn speculate<F: FnMut(u32) -> bool>(
    decoder: &mut Decoder,
    reply: &mut Reply<'_, F>,
    sampler: &mut Sampler,
    rows: &mut Vec<f32>,
    mut speculation: Speculation<'_>,
) -> Result<(), DecodeError> {
    let vocab = decoder.config().vocab_size;
    let mut draft = Draft::default();
    let mut dist = Vec::new();
    // The pass's input: the last token, then the drafts.
    let mut feed = Vec::new();
    loop {
        // Walk the pass's rows: row i checks draft i (if any) and gives the next token.
        let mut accepted = 0;
        let mut pending = None;
        for i in 0..=draft.tokens.len() {
            let logits = &mut rows[i * vocab..(i + 1) * vocab];
            reply.mask(logits)?;
            let drafted = draft.tokens.get(i).copied();
            let token = match drafted {
                Some(d) => {
                    sampler
                        .distribution(logits, &reply.history, &mut dist)
                        .map_err(sampling_error)?;
                    let q = draft.dists.get(i).map(Vec::as_slice);
                    match crate::speculative::verify(sampler, &dist, d, q) {
                        Verdict::Accept => d,
                        Verdict::Replace(t) => t,
                    }
                }
                None => sampler
                    .sample(logits, &reply.history)
                    .map_err(sampling_error)?,
            };
            if reply.emit(token)? != Emitted::More {
                break;
            }
            if drafted == Some(token) {
                // Its K/V is in the cache already (it was fed as draft i).
                accepted += 1;
                continue;
            }
            pending = Some(token);
            break;
        }
        speculation.control.record(draft.tokens.len(), accepted);
        reply.stats.draft.accepted += accepted;
        // Roll back the drafts after the first rejected one, also when the reply ends here
        // (a stop token or the length inside the drafts): the sequence then holds exactly the
        // prompt and the reply fed so far, which a continuing conversation builds on.
        let rejected = draft.tokens.len() - accepted;
        if rejected > 0 {
            decoder.truncate(decoder.len() - rejected)?;
        }
        let Some(pending) = pending else {
            break;
        };
        draft.tokens.clear();
        draft.dists.clear();
        // A pass can emit k + 1 tokens and must fit in the context.
        let room = decoder.options().ctx.saturating_sub(decoder.len() + 1);
        let left = reply.max_tokens - reply.stats.generated - 1;
        let s = &mut speculation;
        let k = s
            .control
            .tokens(s.drafter.cost_per_token())
            .min(room)
            .min(left);
        if k > 0 {
            s.drafter.draft(&reply.history, k, &mut draft)?;
            draft.tokens.truncate(k);
            draft.dists.truncate(k);
        }
        reply.stats.draft.steps += 1;
        reply.stats.draft.drafted += draft.tokens.len();
        feed.clear();
        feed.push(pending);
        feed.extend_from_slice(&draft.tokens);
        rows.resize(feed.len() * vocab, 0.0);
        decoder.forward(&feed, 0..feed.len(), |i, l| {
            rows[i * vocab..(i + 1) * vocab].copy_from_slice(l)
        })?;
    }
    Ok(())
}

/// The outcome of [`perplexity`].
#[derive(Clone, Debug, PartialEq)]
pub struct Perplexity {
    pub ppl: f64,
    /// Standard error of the mean NLL, as llama.cpp reports it (`ppl * stderr(nll)`).
    pub ppl_error: f64,
    pub chunks: usize,
    pub scored_tokens: usize,
    pub tokens_in_text: usize,
    pub seconds: f64,
}

/// llama.cpp's perplexity over `tokens` (see the module docs). `bos` replaces each chunk's first
/// token when given (models that add BOS). `on_chunk(i, ppl_so_far)` reports progress.
pub fn perplexity(
    decoder: &mut Decoder,
    tokens: &[u32],
    ctx: usize,
    bos: Option<u32>,
    mut on_chunk: impl FnMut(usize, f64),
) -> Result<Perplexity, DecodeError> {
    if ctx < 4 {
        return Err(DecodeError::BadInput(format!(
            "perplexity needs --ctx of at least 4, got {ctx}"
        )));
    }
    let chunks = tokens.len() / ctx;
    if chunks == 0 {
        return Err(DecodeError::BadInput(format!(
            "the text has {} tokens, fewer than one chunk of {ctx}; use a longer text or a smaller --ctx",
            tokens.len()
        )));
    }
    let start = Instant::now();
    let first = ctx / 2;
    let (mut nll, mut nll2, mut count) = (0f64, 0f64, 0usize);
    let mut chunk_tokens = vec![0u32; ctx];
    for c in 0..chunks {
        chunk_tokens.copy_from_slice(&tokens[c * ctx..(c + 1) * ctx]);
        if let Some(b) = bos {
            chunk_tokens[0] = b;
        }
        decoder.reset()?;
        let targets = &tokens[c * ctx..(c + 1) * ctx];
        decoder.forward(&chunk_tokens, first..ctx - 1, |i, logits| {
            let target = targets[i + 1] as usize;
            let lp = f64::from(logits[target]) - npu_hal::kernels::log_sum_exp(logits);
            nll -= lp;
            nll2 += lp * lp;
            count += 1;
        })?;
        on_chunk(c, (nll / count as f64).exp());
    }
    let mean = nll / count as f64;
    let var = (nll2 / count as f64 - mean * mean).max(0.0);
    let ppl = mean.exp();
    Ok(Perplexity {
        ppl,
        ppl_error: ppl * (var / (count as f64 - 1.0).max(1.0)).sqrt(),
        chunks,
        scored_tokens: count,
        tokens_in_text: tokens.len(),
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// One llama-bench-style test result.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct BenchResult {
    /// `pp512`, `tg128`, ...
    pub test: String,
    pub n_prompt: usize,
    pub n_gen: usize,
    /// Tokens per second of each repetition.
    pub samples_ts: Vec<f64>,
    pub avg_ts: f64,
    pub stddev_ts: f64,
    pub median_ts: f64,
    /// Where a token's time went, over the timed repetitions (see [`TokenSplit`]).
    pub split: TokenSplit,
}

/// Mean microseconds per token (per prompt token for `pp`) in each part of a step, from the
/// device's counters ([`npu_hal::DeviceStats`]) and the bench's own clock.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct TokenSplit {
    /// Wall time.
    pub wall_us: f64,
    /// Execution on the device (GPU timestamps); `None` when the device has no clock.
    pub device_us: Option<f64>,
    /// Host time inside `submit`, and `submit_held` / `release` where decode steps are queued
    /// ahead (then mostly while the device runs the step before); on the CPU NPU this is the
    /// compute itself.
    pub submit_us: f64,
    /// Host time copying results out once they were ready (none where the device shows the
    /// logits in place: [`npu_hal::Device::view_tensor`]).
    pub readback_us: f64,
    /// Choosing the next token from the logits (argmax here), reading them where they are.
    pub sampling_us: f64,
    /// Times per token the host blocked on the device.
    pub host_waits: f64,
    /// Share of the tokens whose argmax came from maxima the device kept as it wrote the
    /// logits ([`npu_hal::Device::row_argmax`]) rather than from a scan of the vocabulary.
    pub argmax_from_maxima: f64,
}

/// The device counters' growth over the timed parts of a bench only (not its untimed
/// prefills of the `--depth` context).
#[derive(Clone, Copy, Debug, Default)]
struct Counted {
    device: Option<Duration>,
    submit: Duration,
    readback: Duration,
    host_waits: u64,
    argmax_from_maxima: u64,
}

impl Counted {
    /// Adds what the counters did between `a` and `b`.
    fn add(&mut self, a: npu_hal::DeviceStats, b: npu_hal::DeviceStats) {
        if let Some(d) = b.device_time.zip(a.device_time).map(|(b, a)| b - a) {
            self.device = Some(self.device.unwrap_or_default() + d);
        }
        self.submit += b.submit_time - a.submit_time;
        self.readback += b.readback_time - a.readback_time;
        self.host_waits += b.host_waits - a.host_waits;
        self.argmax_from_maxima += b.argmax_from_maxima - a.argmax_from_maxima;
    }
}

impl TokenSplit {
    fn of(c: Counted, wall: Duration, sampling: Duration, tokens: usize) -> TokenSplit {
        let per = |d: Duration| d.as_secs_f64() * 1e6 / tokens.max(1) as f64;
        TokenSplit {
            wall_us: per(wall),
            device_us: c.device.map(per),
            submit_us: per(c.submit),
            readback_us: per(c.readback),
            sampling_us: per(sampling),
            host_waits: c.host_waits as f64 / tokens.max(1) as f64,
            argmax_from_maxima: c.argmax_from_maxima as f64 / tokens.max(1) as f64,
        }
    }
}

/// llama-bench's tests: `pp{n_prompt}` processes an `n_prompt`-token prompt in batches;
/// `tg{n_gen}` generates `n_gen` tokens one at a time. Both start from a context of `depth`
/// tokens, prefilled untimed before each run (llama-bench's `-d`; the test is then named
/// `pp{n_prompt}@d{depth}`, `tg{n_gen}@d{depth}`), else from an empty one. Each runs once to
/// warm up, then `reps` times. Tokens are pseudo-random ids (the content does not change the
/// work).
pub fn bench(
    decoder: &mut Decoder,
    n_prompt: usize,
    n_gen: usize,
    reps: usize,
    depth: usize,
) -> Result<Vec<BenchResult>, DecodeError> {
    let vocab = decoder.config().vocab_size as u64;
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut token = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % vocab) as u32
    };
    let context: Vec<u32> = (0..depth).map(|_| token()).collect();
    let at_depth = |name: String| {
        if depth > 0 {
            format!("{name}@d{depth}")
        } else {
            name
        }
    };
    // A fresh sequence holding the `depth` context tokens.
    let start = |decoder: &mut Decoder| -> Result<(), DecodeError> {
        decoder.reset()?;
        if !context.is_empty() {
            decoder.forward_last(&context)?;
        }
        Ok(())
    };
    let mut results = Vec::new();
    if n_prompt > 0 {
        let prompt: Vec<u32> = (0..n_prompt).map(|_| token()).collect();
        let mut samples = Vec::new();
        let (mut wall, mut counted) = (Duration::ZERO, Counted::default());
        for rep in 0..=reps {
            start(decoder)?;
            let before = decoder.device().stats();
            let t = Instant::now();
            decoder.forward_last(&prompt)?;
            if rep > 0 {
                wall += t.elapsed();
                counted.add(before, decoder.device().stats());
                samples.push(n_prompt as f64 / t.elapsed().as_secs_f64());
            }
        }
        let split = TokenSplit::of(counted, wall, Duration::ZERO, n_prompt * reps);
        results.push(summarise(
            at_depth(format!("pp{n_prompt}")),
            n_prompt,
            0,
            samples,
            split,
        ));
    }
    if n_gen > 0 {
        let mut samples = Vec::new();
        let (mut wall, mut sampling) = (Duration::ZERO, Duration::ZERO);
        let mut counted = Counted::default();
        for rep in 0..=reps {
            start(decoder)?;
            let mut next = token();
            let before = decoder.device().stats();
            let mut picking = Duration::ZERO;
            let t = Instant::now();
            // Greedy, from the logits where the device left them, each step queued while the
            // one before runs where the device allows it.
            decoder.decode_ahead(next, n_gen, |logits| {
                let s = Instant::now();
                next = logits.argmax().map_or(0, |(i, _)| i as u32);
                picking += s.elapsed();
                Some(next)
            })?;
            if rep > 0 {
                wall += t.elapsed();
                sampling += picking;
                counted.add(before, decoder.device().stats());
                samples.push(n_gen as f64 / t.elapsed().as_secs_f64());
            }
        }
        let split = TokenSplit::of(counted, wall, sampling, n_gen * reps);
        results.push(summarise(
            at_depth(format!("tg{n_gen}")),
            0,
            n_gen,
            samples,
            split,
        ));
    }
    Ok(results)
}

fn summarise(
    test: String,
    n_prompt: usize,
    n_gen: usize,
    samples: Vec<f64>,
    split: TokenSplit,
) -> BenchResult {
    let n = samples.len().max(1) as f64;
    let avg = samples.iter().sum::<f64>() / n;
    let var = samples.iter().map(|s| (s - avg) * (s - avg)).sum::<f64>() / (n - 1.0).max(1.0);
    let mut sorted = samples.clone();
    sorted.sort_by(f64::total_cmp);
    let median = if sorted.is_empty() {
        0.0
    } else if sorted.len() % 2 == 1 {
        sorted[sorted.len() / 2]
    } else {
        (sorted[sorted.len() / 2 - 1] + sorted[sorted.len() / 2]) / 2.0
    };
    BenchResult {
        test,
        n_prompt,
        n_gen,
        samples_ts: samples,
        avg_ts: avg,
        stddev_ts: var.sqrt(),
        median_ts: median,
        split,
    }
}

/// Parses `--prompt-ids 1,2,3`.
pub fn parse_ids(s: &str) -> Result<Vec<u32>, DecodeError> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>().map_err(|_| {
                DecodeError::BadInput(format!("--prompt-ids: {t:?} is not a token id"))
            })
        })
        .collect()
}
