//! The reference binary `pipeline`:
//! - `run`: the whole chain (source -> ISP -> encoder -> decoder), overlapped, with a report,
//!   `--stats-json` and a `--trace`;
//! - `isp`: the ISP on one frame of any source, written as 8-bit RGB (what the model sees);
//! - `generate`: stream a completion from a GGUF or safetensors LLaMA-family model;
//! - `perplexity`: llama.cpp's perplexity method over a text file;
//! - `bench`: llama-bench's pp/tg tests, JSON out;
//! - `quantize`: a GGUF model converted once into a GGUF file of MX matrices (calibrated GPTQ,
//!   optional block rotations), which the other commands load as stored;
//! - `encode`: the SigLIP tower and SmolVLM connector alone (GPU or CPU), .npy out;
//! - `devices`: the execution devices this machine has, including accel nodes without a backend.
//!
//! `run`, `isp` and `encode` need the `vision` feature (default); without it the binary is the
//! decoder alone and builds no wgpu.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

#[cfg(feature = "vision")]
use clap::ValueEnum;
use clap::{Parser, Subcommand};
#[cfg(feature = "vision")]
use isp_v4l2::isp::{Layout, Matrix, Preprocess, Range, preprocess};
#[cfg(feature = "vision")]
use isp_v4l2::{Pacing, SourceOptions, open_source};

#[derive(Parser, Debug)]
#[command(
    name = "pipeline",
    about = "Zero-copy camera -> ISP -> ViT -> decoder runtime (reference binary)"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[cfg(feature = "vision")]
#[derive(Clone, Copy, Debug, ValueEnum)]
enum MatrixArg {
    Bt601,
    Bt709,
}

#[cfg(feature = "vision")]
#[derive(Clone, Copy, Debug, ValueEnum)]
enum RangeArg {
    Limited,
    Full,
}

#[cfg(feature = "vision")]
#[derive(Clone, Copy, Debug, ValueEnum)]
enum StageArg {
    Vision,
    Connector,
}

#[cfg(feature = "vision")]
#[derive(Clone, Copy, Debug, ValueEnum)]
enum BackendArg {
    Gpu,
    Cpu,
}

// `run`'s flags make its variant large; the enum is built once per process.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Cmd {
    /// The whole chain: source -> ISP -> vision encoder -> decoder, overlapped; for each
    /// sampled frame, stream a reply prefixed with the frame number.
    #[cfg(feature = "vision")]
    Run(RunArgs),
    /// Run the ISP on one frame and write what the model sees (8-bit RGB, .png or raw .rgb).
    #[cfg(feature = "vision")]
    Isp {
        /// pattern:WxH@FPS[:nv12|i420|yuyv], file:clip.y4m, file:image.png or file:folder
        #[arg(long)]
        source: String,
        /// Which frame (0-based).
        #[arg(long, default_value_t = 0)]
        frame: u64,
        /// Output size, WIDTHxHEIGHT.
        #[arg(long, default_value = "512x512")]
        size: String,
        #[arg(long, value_enum, default_value = "bt601")]
        matrix: MatrixArg,
        #[arg(long, value_enum, default_value = "limited")]
        range: RangeArg,
        /// Output file: .png, or .rgb for raw interleaved bytes.
        #[arg(long)]
        out: PathBuf,
    },
    /// Generate text from a prompt, streaming tokens to stdout.
    Generate {
        #[command(flatten)]
        model: ModelArgs,
        /// The prompt text (tokenized with the model's tokenizer).
        #[arg(
            long,
            conflicts_with = "prompt_ids",
            required_unless_present = "prompt_ids"
        )]
        prompt: Option<String>,
        /// The prompt as token ids, e.g. 1,2,3 (for scripted checks).
        #[arg(long)]
        prompt_ids: Option<String>,
        /// Wrap the prompt in the model's chat template as a user message.
        #[arg(long)]
        chat: bool,
        /// Print token ids (one line, comma-separated) instead of text.
        #[arg(long)]
        print_ids: bool,
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        /// Sampling temperature; 0 means greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        #[arg(long, default_value_t = 40)]
        top_k: usize,
        #[arg(long, default_value_t = 0.95)]
        top_p: f32,
        #[arg(long, default_value_t = 1.0)]
        repeat_penalty: f32,
        #[arg(long, default_value_t = 0x5eed)]
        seed: u64,
        /// Constrain the completion to this regular expression.
        #[arg(long, conflicts_with_all = ["json_schema", "grammar"])]
        regex: Option<String>,
        /// Constrain the completion to this JSON schema (a file).
        #[arg(long, conflicts_with = "grammar")]
        json_schema: Option<PathBuf>,
        /// Constrain the completion to this Lark grammar (a .lark file, llguidance's dialect).
        #[arg(long)]
        grammar: Option<PathBuf>,
        #[command(flatten)]
        draft: DraftArgs,
    },
    /// Perplexity of a text file, by llama.cpp's method (comparable with llama-perplexity).
    Perplexity {
        #[command(flatten)]
        model: ModelArgs,
        /// The text file.
        #[arg(long)]
        file: PathBuf,
    },
    /// Convert a GGUF model into a GGUF file of MX matrices, rounded by GPTQ against
    /// calibration text (or to nearest), optionally block-rotated; `--model` loads the result
    /// under the policy it records.
    Quantize(QuantizeArgs),
    /// llama-bench's pp/tg tests; prints JSON.
    Bench {
        #[command(flatten)]
        model: ModelArgs,
        /// Prompt tokens of the pp test (0 skips it).
        #[arg(long, default_value_t = 512)]
        n_prompt: usize,
        /// Generated tokens of the tg test (0 skips it).
        #[arg(long, default_value_t = 128)]
        n_gen: usize,
        /// Repetitions after one warm-up run.
        #[arg(long, default_value_t = 5)]
        reps: usize,
        /// Tokens already in the context when each test starts, prefilled untimed (llama-bench's
        /// `-d`): decode speed at a long context.
        #[arg(long, default_value_t = 0)]
        depth: usize,
    },
    /// Run the vision encoder alone and write its output as .npy (image embeddings).
    #[cfg(feature = "vision")]
    Encode {
        /// A SmolVLM checkpoint directory (config.json + *.safetensors) or a llama.cpp mmproj
        /// GGUF file.
        #[arg(long)]
        vlm: PathBuf,
        /// Image files (PNG/JPEG), resized and normalised by the ISP. Several are encoded as
        /// one batch, in one GPU submission, and the output gains a leading batch axis.
        #[arg(long, num_args = 1.., conflicts_with = "pixels", required_unless_present = "pixels")]
        image: Vec<PathBuf>,
        /// Pixel values already normalised, f32 .npy of 3 x S x S (or 1 x 3 x S x S); several
        /// as for --image.
        #[arg(long, num_args = 1..)]
        pixels: Vec<PathBuf>,
        /// Which output: the vision tower's last hidden state, or the connector's.
        #[arg(long, value_enum, default_value = "connector")]
        stage: StageArg,
        /// Where the encoder runs.
        #[arg(long, value_enum, default_value = "gpu")]
        backend: BackendArg,
        /// Convert the GEMM weights to this MX format at load (fp8_e4m3, fp8_e5m2, fp6_e3m2,
        /// fp6_e2m3, fp4_e2m1, int8): the GPU kernels decode them as they read them; the CPU
        /// backend computes with the same values rounded through MX.
        #[arg(long, value_parser = parse_mx_format)]
        mx_weights: Option<mx_quant::ElemFormat>,
        /// Output .npy file (f32).
        #[arg(long)]
        out: PathBuf,
    },
    /// List the execution devices: the CPU NPU, Vulkan adapters, accel nodes (with their
    /// drivers), and why a device cannot run ops when it cannot.
    Devices {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// `pipeline run`'s flags; each overrides the same key of `--config`.
#[cfg(feature = "vision")]
#[derive(clap::Args, Debug)]
struct RunArgs {
    /// A TOML chain description (keys as these flags, `_` for `-`; see pipeline::chain::builder).
    #[arg(long)]
    config: Option<PathBuf>,
    /// camera:/dev/videoN[:WxH[@FPS]], file:clip.y4m, file:image.png, pattern:WxH@FPS
    #[arg(long)]
    source: Option<String>,
    /// The decoder: a .gguf file or a checkpoint directory.
    #[arg(long)]
    model: Option<PathBuf>,
    /// A SmolVLM checkpoint for the vision tower (without it a synthetic tower runs).
    #[arg(long)]
    vlm: Option<PathBuf>,
    #[arg(long)]
    prompt: Option<String>,
    /// Use the prompt as is, without the model's chat template.
    #[arg(long)]
    no_chat: bool,
    /// Describe every N-th frame.
    #[arg(long)]
    every: Option<u64>,
    /// Stop after N frames from the source.
    #[arg(long)]
    max_frames: Option<u64>,
    /// Most tokens per reply.
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Write the run's statistics as JSON.
    #[arg(long)]
    stats_json: Option<PathBuf>,
    /// Write a Chrome/Perfetto trace of every stage span and timeline signal.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Where the ISP runs: gpu, cpu or auto.
    #[arg(long)]
    isp: Option<String>,
    /// Where the vision encoder runs: gpu, cpu or auto.
    #[arg(long)]
    encoder: Option<String>,
    /// The decoder's device: cpu (the reference NPU), gpu (Vulkan), accel (a /dev/accel NPU)
    /// or auto (a hardware GPU if there is one, else the CPU).
    #[arg(long)]
    device: Option<String>,
    /// drop (latest frame wins), block, or auto (drop for cameras and --realtime patterns).
    #[arg(long)]
    backpressure: Option<String>,
    /// Deliver file and pattern frames at their rate.
    #[arg(long)]
    realtime: bool,
    /// Queue each frame's GPU work before the frame is captured, waiting on the GPU for the
    /// source's signal, where the source can announce its next frame (patterns).
    #[arg(long)]
    ahead: bool,
    /// Slots per ring between stages (one more when live), and the most frames whose GPU work
    /// may be in flight at once.
    #[arg(long)]
    depth: Option<usize>,
    /// Capture buffers for a camera source (2 to 32; default: enough for the rings' depth,
    /// the frames the stages hold, and one for the driver).
    #[arg(long)]
    buffers: Option<u32>,
    /// The vision tower's input size (square), if not its native one.
    #[arg(long)]
    image_size: Option<usize>,
    /// Split each frame as SmolVLM's processor does, at a longest edge of N tower inputs
    /// (SmolVLM-256M's: 4): up to N x N tiles and the global view, encoded in one submission.
    #[arg(long, value_name = "N")]
    tiles: Option<usize>,
    #[arg(long)]
    policy: Option<String>,
    #[arg(long)]
    threads: Option<usize>,
    #[arg(long)]
    ctx: Option<usize>,
    #[arg(long)]
    kv: Option<String>,
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    #[arg(long)]
    temperature: Option<f32>,
    #[arg(long)]
    seed: Option<u64>,
    /// Constrain every reply to this regular expression.
    #[arg(long)]
    regex: Option<String>,
    /// Constrain every reply to this JSON schema (a file).
    #[arg(long)]
    json_schema: Option<PathBuf>,
    /// Constrain every reply to this Lark grammar (a .lark file, llguidance's dialect).
    #[arg(long)]
    grammar: Option<PathBuf>,
    /// Draft tokens for speculative decoding: `ngram` (prompt lookup in the reply so far and
    /// the previous replies) or a smaller model with the same tokenizer.
    #[arg(long)]
    draft: Option<String>,
    /// The most tokens a step drafts (1 to 15; default 8).
    #[arg(long)]
    draft_tokens: Option<usize>,
    /// Skip encoding a frame whose ISP output moved by at most THRESHOLD (relative RMS over
    /// every 64th value) from the last encoded frame's, e.g. 0.02: the decoder describes it
    /// from that image's K/V, pinned in the KV cache, without prefilling the image again.
    #[arg(long, value_name = "THRESHOLD")]
    skip_similar: Option<f32>,
    /// Describe every frame in one running conversation: each frame is a new turn after the
    /// earlier replies, and with --kv-budget the KV cache stays within the budget however
    /// long the stream runs.
    #[arg(long)]
    keep_context: bool,
    /// Keep each reply's KV cache within this many tokens by dropping whole pages.
    #[arg(long, value_name = "TOKENS")]
    kv_budget: Option<usize>,
    /// Which pages a KV budget drops: sinks, h2o or entropy (default sinks).
    #[arg(long, requires = "kv_budget")]
    prune: Option<String>,
    /// Hold the encoder while the decoder prefills, so a reply's prefill has the cores the
    /// two share (a CPU encoder, or a GPU one on a software driver): shorter time to first
    /// token, the next image encoded during the decode instead.
    #[arg(long)]
    prefill_first: bool,
}

#[cfg(feature = "vision")]
impl RunArgs {
    fn spec(&self) -> Result<pipeline::chain::builder::ChainSpec, Box<dyn std::error::Error>> {
        use pipeline::chain::builder::ChainSpec;
        let base = match &self.config {
            Some(path) => ChainSpec::from_toml_file(path).map_err(|e| e.to_string())?,
            None => ChainSpec::default(),
        };
        let flags = ChainSpec {
            source: self.source.clone(),
            model: self.model.clone(),
            vlm: self.vlm.clone(),
            device: self.device.clone(),
            prompt: self.prompt.clone(),
            chat: self.no_chat.then_some(false),
            isp: self
                .isp
                .as_deref()
                .map(str::parse)
                .transpose()?
                .unwrap_or_default(),
            encoder: self
                .encoder
                .as_deref()
                .map(str::parse)
                .transpose()?
                .unwrap_or_default(),
            every: self.every,
            max_frames: self.max_frames,
            max_tokens: self.max_tokens,
            depth: self.depth,
            buffers: self.buffers,
            image_size: self.image_size,
            tiles: self.tiles,
            backpressure: self
                .backpressure
                .as_deref()
                .map(str::parse)
                .transpose()?
                .unwrap_or_default(),
            realtime: self.realtime.then_some(true),
            ahead: self.ahead.then_some(true),
            policy: self.policy.clone(),
            threads: self.threads,
            ctx: self.ctx,
            kv: self.kv.clone(),
            cache_dir: self.cache_dir.clone(),
            temperature: self.temperature,
            seed: self.seed,
            regex: self.regex.clone(),
            json_schema: self.json_schema.clone(),
            grammar: self.grammar.clone(),
            draft: self.draft.clone(),
            draft_tokens: self.draft_tokens,
            skip_similar: self.skip_similar,
            keep_context: self.keep_context.then_some(true),
            kv_budget: self.kv_budget,
            prune: self.prune.clone(),
            prefill_first: self.prefill_first.then_some(true),
            ..ChainSpec::default()
        };
        Ok(base.overlay(flags))
    }
}

/// `pipeline run`: builds the chain, streams replies, prints the report and writes the
/// statistics and trace files even when a stage failed or the user pressed Ctrl-C.
#[cfg(feature = "vision")]
fn run_chain(args: &RunArgs) -> Result<(), Box<dyn std::error::Error>> {
    use pipeline::chain::{Event, percentile};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let spec = args.spec()?;
    let built =
        pipeline::chain::builder::build(&spec, args.trace.is_some()).map_err(|e| e.to_string())?;
    for note in &built.notes {
        eprintln!("{note}");
    }
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = Arc::clone(&stop);
        // A second Ctrl-C while the chain drains ends the process at once.
        ctrlc::set_handler(move || {
            if stop.swap(true, Ordering::SeqCst) {
                std::process::exit(130);
            }
        })?;
    }
    let mut stdout = std::io::stdout().lock();
    let mut write_error: Option<std::io::Error> = None;
    let report = pipeline::chain::run(built.chain, &built.options, Arc::clone(&stop), |event| {
        let r = match event {
            Event::FrameStart { frame } => write!(stdout, "[frame {frame}] "),
            Event::Text { text, .. } => write!(stdout, "{text}").and_then(|()| stdout.flush()),
            Event::FrameDone { .. } => writeln!(stdout),
        };
        if let Err(e) = r {
            write_error.get_or_insert(e);
            stop.store(true, Ordering::SeqCst);
        }
    })
    .map_err(|e| e.to_string())?;
    drop(stdout);
    if let Some(path) = &args.trace {
        pipeline::chain::trace::write(path, &report.traces)
            .map_err(|e| format!("writing the trace {}: {e}", path.display()))?;
        eprintln!("trace: {} (open in ui.perfetto.dev)", path.display());
    }
    let json = report.to_json();
    if let Some(path) = &args.stats_json {
        std::fs::write(path, serde_json::to_string_pretty(&json)? + "\n")
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    let lat = |v: &[f64]| format!("{:8.1} {:8.1}", percentile(v, 50.0), percentile(v, 99.0));
    eprintln!(
        "frames: {} in, {} skipped (--every), {} dropped ({} more lost at capture), {} \
         preprocessed, {} encoded, {} decoded in {:.2} s ({:.2} frames/s)",
        report.frames_in,
        report.frames_skipped,
        report.frames_dropped,
        report.frames_dropped_at_capture,
        report.frames_preprocessed,
        report.frames_encoded,
        report.frames_decoded,
        report.wall.as_secs_f64(),
        report.frames_per_s()
    );
    eprintln!("stage latency (ms)       p50      p99");
    for (name, v) in [
        (&report.stage_names[0], &report.latency.isp),
        (&report.stage_names[1], &report.latency.encoder),
        (&report.stage_names[2], &report.latency.decoder),
        (&"capture->reply".to_string(), &report.latency.end_to_end),
        (&"staleness".to_string(), &report.staleness_ms),
    ] {
        eprintln!("  {name:<20} {}", lat(v));
    }
    let gpu_stages = report.stage_names[..2]
        .iter()
        .any(|name| name.ends_with("-gpu"));
    if gpu_stages {
        eprintln!(
            "GPU: at most {} frames in flight, {} submitted ahead of their capture",
            report.gpu_in_flight_max, report.frames_submitted_ahead,
        );
    }
    eprintln!(
        "host waits per frame: isp {:.2}, encoder {:.2}, decoder {:.2}",
        report.host_waits_per_frame(0),
        report.host_waits_per_frame(1),
        report.host_waits_per_frame(2)
    );
    eprintln!(
        "tokens: {} at {:.1} tok/s; time to first token p50 {:.1} ms; KV use {:.1}%; \
         bytes copied per frame {:.0}; peak RSS {:.1} MiB",
        report.tokens,
        report.tokens_per_s(),
        percentile(&report.ttft_ms, 50.0),
        report.kv_utilisation * 100.0,
        report.bytes_copied_per_frame(),
        pipeline::chain::peak_rss_bytes().unwrap_or(0) as f64 / (1 << 20) as f64
    );
    for (stage, bytes) in &report.bytes_copied_by_stage {
        eprintln!(
            "  copied by {stage}: {bytes} bytes ({:.0} per frame)",
            *bytes as f64 / report.frames_decoded.max(1) as f64
        );
    }
    if let Some(e) = write_error {
        return Err(format!("writing to stdout: {e}").into());
    }
    if let Some(f) = &report.failure {
        return Err(f.to_string().into());
    }
    if report.interrupted {
        eprintln!("interrupted");
    }
    Ok(())
}

/// The model flags every decoder subcommand shares.
#[derive(clap::Args, Debug)]
struct ModelArgs {
    /// A .gguf file, or a directory with config.json and *.safetensors.
    #[arg(long)]
    model: PathBuf,
    /// Weight policy: exact (llama.cpp's arithmetic as built for this CPU; exact:avx2 or
    /// exact:avx512 names the build), default, fastest, fp4, smallest, int8, or e.g.
    /// attn=fp6,mlp=fp4,embd=int8 [default: the policy a `pipeline quantize` file was made
    /// with, else `default`].
    #[arg(long)]
    policy: Option<String>,
    /// Worker threads (0 = every core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// The decoder's device: cpu (the reference NPU), gpu (Vulkan), accel (a /dev/accel NPU)
    /// or auto (a hardware GPU if there is one, else the CPU).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Context length: the KV cache's size, and perplexity's chunk length.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// KV page storage: f32, f16, bf16, mxfp8, mxfp4.
    #[arg(long, default_value = "f16")]
    kv: String,
    /// Where converted MX weights are saved so the next load maps them instead of converting
    /// (default: beside the model file).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Neither read nor write the converted-weight cache.
    #[arg(long)]
    no_cache: bool,
    /// Keep the KV cache within this many tokens by dropping whole pages (`--prune` picks
    /// which); at least 64, at most --ctx.
    #[arg(long, value_name = "TOKENS")]
    kv_budget: Option<usize>,
    /// Which pages a KV budget drops: sinks (StreamingLLM: the first page and the most recent
    /// ones), h2o (the pages with the most attention so far) or entropy (the most attention in
    /// the most focused layers). Needs --kv-budget.
    #[arg(long, default_value = "sinks", requires = "kv_budget")]
    prune: String,
}

impl ModelArgs {
    /// The policy asked for, else the one the file records, else `default`.
    fn policy_name(&self) -> Result<String, Box<dyn std::error::Error>> {
        Ok(match &self.policy {
            Some(p) => p.clone(),
            None => {
                pipeline::llm::recorded_policy(&self.model)?.unwrap_or_else(|| "default".into())
            }
        })
    }

    fn open(
        &self,
        max_logit_rows: usize,
    ) -> Result<
        (
            pipeline::decoder::Decoder,
            Option<pipeline::model::tokenizer::Tokenizer>,
        ),
        Box<dyn std::error::Error>,
    > {
        let kv_dtype = pipeline::llm::parse_kv_dtype(&self.kv)?;
        let policy_name = self.policy_name()?;
        let policy = pipeline::decoder::WeightPolicy::parse(&policy_name)?;
        let cache = if self.no_cache {
            None
        } else {
            let dir = self
                .cache_dir
                .clone()
                .unwrap_or_else(|| pipeline::llm::default_cache_dir(&self.model));
            pipeline::llm::cache_spec(&self.model, &dir, &policy)
        };
        let options = pipeline::decoder::DecoderOptions {
            policy,
            ctx: self.ctx,
            max_batch: 512.min(self.ctx.max(1)),
            max_logit_rows,
            kv_dtype,
            cache,
        };
        let t = std::time::Instant::now();
        let (device, picked) = pipeline::llm::open_device(self.device.parse()?, self.threads)?;
        if let Some(why) = picked {
            eprintln!("{why}");
        }
        let (mut decoder, tokenizer) =
            pipeline::llm::open_decoder_on(&self.model, options, device)?;
        if let Some(budget) = self.kv_budget {
            decoder.set_pruning(Some(pipeline::decoder::Pruning {
                budget,
                policy: self.prune.parse()?,
            }))?;
        }
        let r = decoder.report();
        if let Some(p) = &r.cache_written {
            eprintln!(
                "saved the converted weights to {} (the next load maps them)",
                p.display()
            );
        }
        if r.from_cache > 0 {
            eprintln!("{} converted matrices read from the cache", r.from_cache);
        }
        if let Some(why) = &r.cache_problem {
            eprintln!("warning: converted-weight cache not used: {why}");
        }
        if let Some(note) = &r.numerics_note {
            eprintln!("note: {note}");
        }
        eprintln!(
            "loaded {} in {:.2} s: policy {}, {:.2} bits/weight, {:.1} MiB of weights, on {} ({} threads, {})",
            self.model.display(),
            t.elapsed().as_secs_f64(),
            policy_name,
            r.bits_per_weight,
            r.weight_bytes as f64 / (1 << 20) as f64,
            decoder.device().info().name,
            decoder.device().info().parallelism,
            decoder.device().info().isa,
        );
        Ok((decoder, tokenizer))
    }
}

/// Speculative decoding's flags (`generate`, `run`).
#[derive(clap::Args, Debug, Clone)]
struct DraftArgs {
    /// Draft tokens for one-batch verification: `ngram` (prompt lookup in the context) or a
    /// smaller model with the same tokenizer (a .gguf file or checkpoint directory). Greedy
    /// output is unchanged; sampled output keeps its distribution.
    #[arg(long)]
    draft: Option<String>,
    /// The most tokens a step drafts (1 to 15); fewer, or none, while acceptance is low.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=15))]
    draft_tokens: u16,
}

impl DraftArgs {
    /// The drafter these flags ask for, opened for `target` (a draft model on the target's
    /// kind of device, with `threads` workers).
    fn open(
        &self,
        target: &pipeline::decoder::Decoder,
        tokenizer: Option<&pipeline::model::tokenizer::Tokenizer>,
        model: &ModelArgs,
        sampling: &npu_hal::sampling::SamplingParams,
    ) -> Result<Option<Box<dyn pipeline::speculative::Drafter + Send>>, Box<dyn std::error::Error>>
    {
        let Some(source) = &self.draft else {
            return Ok(None);
        };
        let (drafter, note) = pipeline::llm::open_drafter(
            source,
            target,
            tokenizer,
            model.device.parse()?,
            model.threads,
            sampling,
        )?;
        if let Some(note) = note {
            eprintln!("{note}");
        }
        Ok(Some(drafter))
    }
}

/// `pipeline quantize`'s flags.
#[derive(clap::Args, Debug)]
struct QuantizeArgs {
    /// The source model (.gguf).
    #[arg(long)]
    model: PathBuf,
    /// The weight policy to quantize to (which classes become which MX format).
    #[arg(long, default_value = "fp4")]
    policy: String,
    /// Calibration text files (UTF-8). Never an evaluation text: the license texts
    /// perplexity is measured on are refused.
    #[arg(long, num_args = 1..)]
    calib: Vec<PathBuf>,
    /// The output file (.gguf).
    #[arg(long)]
    out: PathBuf,
    /// gptq (error-compensating, needs --calib) or rtn (round to nearest).
    #[arg(long, default_value = "gptq")]
    method: String,
    /// Block-rotate the attention and MLP matrices (32-point Walsh-Hadamard; the kernels
    /// rotate activations to match, on the CPU NPU and the GPU backend).
    #[arg(long)]
    rotate: bool,
    /// GPTQ's damping, as a fraction of the Hessian's mean diagonal.
    #[arg(long, default_value_t = 0.01)]
    damp: f64,
    /// Round columns in order of decreasing input energy (scales fixed beforehand).
    #[arg(long)]
    act_order: bool,
    /// After GPTQ, up to N passes of coordinate descent on GPTQ's loss, scales fixed: each
    /// column takes the code best for the row as the other columns stand (0: GPTQ alone).
    #[arg(long, default_value_t = 8)]
    refine: u32,
    /// Block scale rule: mse (the best of three exponents by the block's squared error),
    /// ocp (the spec's floor rule), or loss (GPTQ: the best of the three by GPTQ's loss,
    /// the error feedback inside the block included; rounding to nearest takes mse).
    #[arg(long, default_value = "mse")]
    scale: String,
    /// Save the calibration statistics here, or load them if this file holds the ones of
    /// the same model, text and settings, so a second quantization skips calibrating.
    #[arg(long)]
    hessians: Option<PathBuf>,
    /// Most calibration tokens used.
    #[arg(long, default_value_t = 16384)]
    calib_tokens: usize,
    /// Tokens per calibration sequence.
    #[arg(long, default_value_t = 512)]
    calib_ctx: usize,
    /// Worker threads (0 = every core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

fn quantize(a: QuantizeArgs) -> Result<(), Box<dyn std::error::Error>> {
    use pipeline::quantize::{self, Method, QuantizeOptions};
    let t0 = std::time::Instant::now();
    let mut policy = pipeline::decoder::WeightPolicy::parse(&a.policy)?;
    policy.scale = match a.scale.as_str() {
        "mse" | "loss" => mx_quant::ScaleRule::MseSearch,
        "ocp" => mx_quant::ScaleRule::Floor,
        other => return Err(format!("--scale {other:?}: use mse, ocp or loss").into()),
    };
    let method = match a.method.as_str() {
        "rtn" => Method::RoundToNearest,
        "gptq" => Method::Gptq(mx_quant::gptq::GptqOptions {
            scale: policy.scale,
            damp: a.damp,
            scale_by_loss: a.scale == "loss",
            refine_passes: a.refine,
            order: if a.act_order {
                mx_quant::gptq::ColumnOrder::ActOrder
            } else {
                mx_quant::gptq::ColumnOrder::Natural
            },
            ..Default::default()
        }),
        other => return Err(format!("--method {other:?}: use gptq or rtn").into()),
    };
    if a.out.exists() && std::fs::canonicalize(&a.out)? == std::fs::canonicalize(&a.model)? {
        return Err("--out is the source model; write the quantized model to a new file".into());
    }
    let source = pipeline::model::gguf::GgufFile::open(&a.model)?;
    let options = QuantizeOptions {
        policy,
        method,
        rotate: a.rotate,
        threads: a.threads,
    };
    let (calibration, described) = match method {
        Method::RoundToNearest => (None, "none (round-to-nearest)".to_string()),
        Method::Gptq(_) => {
            if a.calib.is_empty() {
                return Err("GPTQ needs calibration text: give --calib FILE...".into());
            }
            for path in &a.calib {
                quantize::check_not_evaluation_text(path)?;
            }
            let files: Vec<String> = a.calib.iter().map(|p| p.display().to_string()).collect();
            let key = format!(
                "model {} ({} bytes); text {}; at most {} tokens in batches of {}",
                std::fs::canonicalize(&a.model)?.display(),
                std::fs::metadata(&a.model)?.len(),
                files.join(", "),
                a.calib_tokens,
                a.calib_ctx
            );
            let saved = match &a.hessians {
                Some(path) if path.exists() => {
                    let saved = quantize::Calibration::load(path, &key)?;
                    if saved.is_none() {
                        eprintln!(
                            "{} holds the statistics of another model, text or settings; \
                             calibrating again (it will be overwritten)",
                            path.display()
                        );
                    }
                    saved
                }
                _ => None,
            };
            let cal = match saved {
                Some(cal) => {
                    eprintln!(
                        "calibration statistics of {} tokens read from {}",
                        cal.tokens,
                        a.hessians.as_ref().expect("loaded from it").display()
                    );
                    cal
                }
                None => {
                    let (mut decoder, tokenizer) =
                        quantize::calibration_decoder(&a.model, a.calib_ctx, a.threads)?;
                    let tokenizer = tokenizer.ok_or("calibration needs the model's tokenizer")?;
                    let batches = quantize::calibration_batches(
                        &a.calib,
                        &tokenizer,
                        a.calib_ctx,
                        a.calib_tokens,
                    )?;
                    let total: usize = batches.iter().map(Vec::len).sum();
                    eprintln!(
                        "calibrating on {total} tokens ({} batches of up to {}) from {} files",
                        batches.len(),
                        a.calib_ctx,
                        a.calib.len()
                    );
                    let t = std::time::Instant::now();
                    let cal =
                        quantize::calibrate(&mut decoder, &batches, a.threads, |done, all| {
                            if done % 8 == 0 || done == all {
                                eprintln!(
                                    "  batch {done}/{all} ({:.0} s)",
                                    t.elapsed().as_secs_f64()
                                );
                            }
                        })?;
                    if let Some(path) = &a.hessians {
                        cal.save(path, &key).map_err(|e| {
                            format!("saving the calibration to {}: {e}", path.display())
                        })?;
                        eprintln!("calibration statistics saved to {}", path.display());
                    }
                    cal
                }
            };
            let described = format!(
                "{} tokens in {} batches of up to {} from {}",
                cal.tokens,
                cal.batches,
                a.calib_ctx,
                files.join(", ")
            );
            (Some(cal), described)
        }
    };
    let t = std::time::Instant::now();
    let report = quantize::quantize(
        &source,
        calibration.as_ref(),
        &options,
        &a.out,
        &described,
        |done, all| {
            if done % 50 == 0 || done == all {
                eprintln!("  tensor {done}/{all} ({:.0} s)", t.elapsed().as_secs_f64());
            }
        },
    )?;
    eprintln!(
        "wrote {} ({:.1} MiB): {} matrices converted ({} by GPTQ, {} rotated), {} tensors carried \
         over, {:.2} bits/weight, policy {}, in {:.1} s",
        a.out.display(),
        report.file_bytes as f64 / (1 << 20) as f64,
        report.converted,
        report.by_gptq,
        report.rotated,
        report.carried,
        report.bits_per_weight,
        a.policy,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    match cli.command {
        #[cfg(feature = "vision")]
        Cmd::Run(args) => run_chain(&args),
        #[cfg(feature = "vision")]
        Cmd::Isp {
            source,
            frame,
            size,
            matrix,
            range,
            out,
        } => {
            let (w, h) = size
                .split_once('x')
                .and_then(|(w, h)| Some((w.parse::<usize>().ok()?, h.parse::<usize>().ok()?)))
                .filter(|&(w, h)| w > 0 && h > 0)
                .ok_or_else(|| format!("--size {size}: expected WIDTHxHEIGHT"))?;
            let options = SourceOptions {
                pacing: Pacing::AsFastAsPossible,
                ..SourceOptions::default()
            };
            let mut src = open_source(&source, &options)?;
            let mut picked = None;
            for _ in 0..=frame {
                picked = src.next_frame()?;
                if picked.is_none() {
                    return Err(format!("{source} ends before frame {frame}").into());
                }
            }
            let f = picked.expect("loop ran at least once");
            let access = f
                .buffer
                .cpu_access(0..f.desc.byte_len(), uvm_alloc::Access::Read)?;
            // What the model sees, before normalisation: RGB scaled to 0..1, back to 8 bits.
            let p = Preprocess {
                matrix: match matrix {
                    MatrixArg::Bt601 => Matrix::Bt601,
                    MatrixArg::Bt709 => Matrix::Bt709,
                },
                range: match range {
                    RangeArg::Limited => Range::Limited,
                    RangeArg::Full => Range::Full,
                },
                width: w,
                height: h,
                mean: [0.0; 3],
                std: [1.0; 3],
                layout: Layout::Hwc,
                ..Default::default()
            };
            let mut values = vec![0f32; 3 * w * h];
            preprocess(&f.desc, access.bytes(), &p, &mut values)?;
            let bytes: Vec<u8> = values
                .iter()
                .map(|v| (v * 255.0).round().clamp(0.0, 255.0) as u8)
                .collect();
            match out.extension().and_then(|e| e.to_str()) {
                Some("png") => image::RgbImage::from_raw(w as u32, h as u32, bytes)
                    .ok_or("image size mismatch")?
                    .save(&out)?,
                Some("rgb") => std::fs::write(&out, bytes)?,
                _ => return Err(format!("--out {}: use .png or .rgb", out.display()).into()),
            }
            eprintln!(
                "wrote {} ({w}x{h}) from frame {} of {source} ({:?} {}x{})",
                out.display(),
                f.sequence,
                f.desc.format,
                f.desc.width,
                f.desc.height
            );
            Ok(())
        }
        Cmd::Generate {
            model,
            prompt,
            prompt_ids,
            chat,
            print_ids,
            max_tokens,
            temperature,
            top_k,
            top_p,
            repeat_penalty,
            seed,
            regex,
            json_schema,
            grammar,
            draft,
        } => {
            let verify_rows = if draft.draft.is_some() {
                usize::from(draft.draft_tokens) + 1
            } else {
                1
            };
            let (mut decoder, tokenizer) = model.open(verify_rows)?;
            let grammar = match (
                &tokenizer,
                regex.is_some() || json_schema.is_some() || grammar.is_some(),
            ) {
                (_, false) => None,
                (None, true) => {
                    return Err("a grammar needs the model's tokenizer (its token bytes)".into());
                }
                (Some(tok), true) => pipeline::grammar::from_request(
                    regex.as_deref(),
                    json_schema.as_deref(),
                    grammar.as_deref(),
                    tok,
                )
                .map_err(|e| e.to_string())?,
            };
            let ids = match (&prompt_ids, &prompt) {
                (Some(ids), _) => pipeline::llm::parse_ids(ids)?,
                (None, Some(text)) => {
                    let tok = tokenizer.as_ref().ok_or(
                        "this model has no tokenizer: pass --prompt-ids, or add tokenizer.json",
                    )?;
                    let text = if chat {
                        tok.apply_chat_template(&[("user", text.as_str())], true)?
                    } else {
                        text.clone()
                    };
                    tok.encode(&text, decoder.config().add_bos)?
                }
                (None, None) => return Err("pass --prompt or --prompt-ids".into()),
            };
            let stop: Vec<u32> = tokenizer
                .as_ref()
                .map(|t| t.stop_ids().to_vec())
                .unwrap_or_default();
            let sampling = npu_hal::sampling::SamplingParams {
                temperature,
                top_k,
                top_p,
                repetition_penalty: repeat_penalty,
                seed,
                ..Default::default()
            };
            let mut drafter = draft.open(&decoder, tokenizer.as_ref(), &model, &sampling)?;
            let speculation = drafter
                .as_deref_mut()
                .map(|drafter| pipeline::llm::Speculation {
                    drafter,
                    control: pipeline::speculative::DraftControl::new(
                        usize::from(draft.draft_tokens),
                        pipeline::speculative::CPU_ROW_COST,
                    ),
                });
            let mut stdout = std::io::stdout().lock();
            let mut stream = tokenizer.as_ref().map(|t| t.stream_decoder());
            let mut generated = Vec::new();
            let mut write_error = None;
            let stats = pipeline::llm::generate_speculative(
                &mut decoder,
                &ids,
                max_tokens,
                sampling,
                &stop,
                grammar.as_ref(),
                speculation,
                |id| {
                    generated.push(id);
                    if print_ids {
                        return true;
                    }
                    let piece = match stream.as_mut() {
                        Some(s) => s.push(id).unwrap_or_else(|e| format!("[{id}: {e}]")),
                        None => format!("[{id}]"),
                    };
                    if let Err(e) = stdout
                        .write_all(piece.as_bytes())
                        .and_then(|()| stdout.flush())
                    {
                        write_error = Some(e);
                        return false;
                    }
                    true
                },
            )?;
            if let Some(e) = write_error {
                return Err(format!("writing to stdout: {e}").into());
            }
            if print_ids {
                let line: Vec<String> = generated.iter().map(u32::to_string).collect();
                writeln!(stdout, "{}", line.join(","))?;
            } else {
                if let Some(rest) = stream.as_mut().map(|s| s.finish().unwrap_or_default()) {
                    write!(stdout, "{rest}")?;
                }
                writeln!(stdout)?;
            }
            eprintln!(
                "prompt {} tokens in {:.1} ms ({:.1} tok/s); generated {} tokens at {:.1} tok/s",
                stats.prompt_tokens,
                stats.time_to_first_token.as_secs_f64() * 1e3,
                stats.prefill_tokens_per_s(),
                stats.generated,
                stats.decode_tokens_per_s()
            );
            if stats.kv_pages_pruned > 0 {
                eprintln!("kv_pages_pruned {}", stats.kv_pages_pruned);
            }
            if drafter.is_some() {
                let d = &stats.draft;
                eprintln!(
                    "draft_acceptance {:.3} ({} of {} drafted), draft_tokens_per_step {:.2}, {:.2} tokens per decoder pass",
                    d.acceptance(),
                    d.accepted,
                    d.drafted,
                    d.drafted_per_step(),
                    stats.generated.saturating_sub(1) as f64 / d.steps.max(1) as f64
                );
            }
            Ok(())
        }
        Cmd::Perplexity { model, file } => {
            let (mut decoder, tokenizer) = model.open(32)?;
            let tok = tokenizer.ok_or("perplexity needs the model's tokenizer")?;
            let text = std::fs::read_to_string(&file)
                .map_err(|e| format!("reading {}: {e}", file.display()))?;
            let tokens = tok.encode(&text, decoder.config().add_bos)?;
            let bos = decoder
                .config()
                .add_bos
                .then_some(decoder.config().bos_token_id)
                .flatten();
            eprintln!(
                "{} tokens, {} chunks of {}",
                tokens.len(),
                tokens.len() / model.ctx,
                model.ctx
            );
            let r = pipeline::llm::perplexity(&mut decoder, &tokens, model.ctx, bos, |c, p| {
                eprint!("[{}]{p:.4} ", c + 1);
            })?;
            eprintln!();
            println!(
                "{}",
                serde_json::json!({
                    "model": model.model.display().to_string(),
                    "policy": model.policy_name()?,
                    "file": file.display().to_string(),
                    "ctx": model.ctx,
                    "ppl": r.ppl,
                    "ppl_error": r.ppl_error,
                    "chunks": r.chunks,
                    "scored_tokens": r.scored_tokens,
                    "tokens_in_text": r.tokens_in_text,
                    "seconds": r.seconds,
                    "kv_budget": model.kv_budget,
                    "prune": model.kv_budget.map(|_| model.prune.clone()),
                    "kv_pages_pruned": decoder.pages_pruned(),
                })
            );
            Ok(())
        }
        Cmd::Quantize(args) => quantize(args),
        Cmd::Bench {
            model,
            n_prompt,
            n_gen,
            reps,
            depth,
        } => {
            let (mut decoder, _) = model.open(1)?;
            let results = pipeline::llm::bench(&mut decoder, n_prompt, n_gen, reps, depth)?;
            let r = decoder.report().clone();
            let info = decoder.device().info();
            println!(
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({
                    "model": model.model.display().to_string(),
                    "policy": model.policy_name()?,
                    "bits_per_weight": r.bits_per_weight,
                    "weight_bytes": r.weight_bytes,
                    "stream_bytes_per_token": r.stream_bytes_per_token,
                    "device": info.name,
                    "isa": info.isa,
                    "threads": info.parallelism,
                    "kv": model.kv,
                    "results": results,
                    // Per-kernel GPU time over the whole bench (NPU_HAL_PROFILE=1).
                    "kernels": decoder.device().profile().iter().map(|k| serde_json::json!({
                        "kernel": k.kernel,
                        "dispatches": k.dispatches,
                        "total_ms": k.time.as_secs_f64() * 1e3,
                        "us_per_dispatch": k.time.as_secs_f64() * 1e6 / k.dispatches.max(1) as f64,
                    })).collect::<Vec<_>>(),
                }))?
            );
            Ok(())
        }
        #[cfg(feature = "vision")]
        Cmd::Encode {
            vlm,
            image,
            pixels,
            stage,
            backend,
            mx_weights,
            out,
        } => {
            let cpu = pipeline::vision::VisionEncoder::open_path(&vlm)?;
            let s = cpu.config().image_size;
            // An image file, resized and normalised by the ISP.
            let read_image = |path: &PathBuf| -> Result<Vec<f32>, Box<dyn std::error::Error>> {
                let options = SourceOptions {
                    pacing: Pacing::AsFastAsPossible,
                    ..SourceOptions::default()
                };
                let mut src = open_source(&format!("file:{}", path.display()), &options)?;
                let f = src.next_frame()?.ok_or("the image has no frame")?;
                let access = f
                    .buffer
                    .cpu_access(0..f.desc.byte_len(), uvm_alloc::Access::Read)?;
                // SigLIP's normalisation: mean 0.5, std 0.5 (values in -1..1), CHW.
                let p = Preprocess {
                    width: s,
                    height: s,
                    ..Default::default()
                };
                let mut values = vec![0f32; 3 * s * s];
                preprocess(&f.desc, access.bytes(), &p, &mut values)?;
                Ok(values)
            };
            let images: Vec<Vec<f32>> = if pixels.is_empty() {
                image.iter().map(read_image).collect::<Result<_, _>>()?
            } else {
                pixels
                    .iter()
                    .map(|p| pipeline::vision::read_pixels_npy(p, s))
                    .collect::<Result<_, _>>()?
            };
            if images.is_empty() {
                return Err("pass --image or --pixels".into());
            }
            let batch = images.len();
            let t = std::time::Instant::now();
            let (result, mut shape) = match backend {
                BackendArg::Cpu => {
                    let cpu = match mx_weights {
                        Some(format) => cpu.with_mx_weights(format)?,
                        None => cpu,
                    };
                    let c = cpu.config();
                    let mut result = Vec::new();
                    for values in &images {
                        let v = cpu.vision(values)?;
                        result.extend(match stage {
                            StageArg::Vision => v,
                            StageArg::Connector => cpu.connect(&v),
                        });
                    }
                    let shape = match stage {
                        StageArg::Vision => {
                            vec![c.patches_per_side().pow(2) as u64, c.hidden as u64]
                        }
                        StageArg::Connector => vec![c.image_tokens() as u64, c.text_hidden as u64],
                    };
                    (result, shape)
                }
                BackendArg::Gpu => {
                    let all: Vec<f32> = images.concat();
                    encode_on_gpu(&cpu, &all, batch, stage, mx_weights)?
                }
            };
            if batch > 1 {
                shape.insert(0, batch as u64);
            }
            let elapsed = t.elapsed();
            let file = std::fs::File::create(&out)
                .map_err(|e| format!("creating {}: {e}", out.display()))?;
            use npyz::WriterBuilder;
            let mut w = npyz::WriteOptions::new()
                .default_dtype()
                .shape(&shape)
                .writer(std::io::BufWriter::new(file))
                .begin_nd()?;
            w.extend(result.iter().copied())?;
            w.finish()?;
            eprintln!(
                "wrote {} ({shape:?} f32, {stage:?} on {backend:?}) in {:.1} ms",
                out.display(),
                elapsed.as_secs_f64() * 1e3
            );
            Ok(())
        }
        Cmd::Devices { json } => {
            use npu_hal::Backend;
            let probes: Vec<npu_hal::Probe> = [
                &npu_hal::CpuBackend::default() as &dyn Backend,
                &npu_hal::VulkanBackend::default(),
                &npu_hal::AccelBackend,
            ]
            .iter()
            .flat_map(|b| b.probe())
            .collect();
            if json {
                let list: Vec<_> = probes
                    .iter()
                    .map(|p| {
                        serde_json::json!({
                            "backend": p.backend,
                            "name": p.name,
                            "usable": p.usable.is_ok(),
                            "why_not": p.usable.as_ref().err(),
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                for p in &probes {
                    match &p.usable {
                        Ok(()) => println!("[{}] {}: ready", p.backend, p.name),
                        Err(why) => println!("[{}] {}: not usable: {why}", p.backend, p.name),
                    }
                }
                if !probes.iter().any(|p| p.backend == "accel") {
                    println!("[accel] no /dev/accel/accel* nodes on this machine");
                }
            }
            Ok(())
        }
    }
}

/// An MX element format by name, for `--mx-weights`.
#[cfg(feature = "vision")]
fn parse_mx_format(name: &str) -> Result<mx_quant::ElemFormat, String> {
    mx_quant::ElemFormat::from_name(name).ok_or_else(|| {
        format!(
            "unknown MX format {name}: fp8_e4m3, fp8_e5m2, fp6_e3m2, fp6_e2m3, fp4_e2m1 or int8"
        )
    })
}

/// Runs the WGSL encoder on the first Vulkan adapter over `batch` images (one after another
/// in `values`) in one submission; the images go up in a unified buffer imported as-is and the
/// result is read where the GPU wrote it. The shape returned is one image's.
#[cfg(feature = "vision")]
fn encode_on_gpu(
    cpu: &pipeline::vision::VisionEncoder,
    values: &[f32],
    batch: usize,
    stage: StageArg,
    mx_weights: Option<mx_quant::ElemFormat>,
) -> Result<(Vec<f32>, Vec<u64>), Box<dyn std::error::Error>> {
    use std::sync::Arc;
    use uvm_alloc::vulkan::{host_read_barrier, import_wgpu_buffer};
    // The same device, features and kernel choice the chain's GPU stages use.
    let context = pipeline::chain::GpuContext::open().map_err(|e| e.to_string())?;
    let (device, queue, caps) = (&context.device, &context.queue, &context.caps);
    let options = pipeline::vision_gpu::GpuVisionOptions {
        mx_weights,
        ..context.vision_options
    };
    let gpu = pipeline::vision_gpu::GpuVisionEncoder::with_batch(device, cpu, options, batch)?;
    // Memory this device imports in place.
    let allocator = uvm_alloc::Allocator::new(uvm_alloc::AllocatorDesc {
        backends: caps.importable_backends(),
        ..Default::default()
    })?;
    let input = allocator.allocate(values.len() * 4)?;
    input
        .cpu_access(0..values.len() * 4, uvm_alloc::Access::Write)?
        .typed_mut::<f32>()?
        .copy_from_slice(values);
    let output = Arc::new(allocator.allocate(gpu.output_bytes() as usize)?);
    let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC;
    // SAFETY: the input's write guard is dropped above; the device only reads it.
    let input_gpu = unsafe { import_wgpu_buffer(device, caps, Arc::new(input), usage, None) }?;
    // SAFETY: the output is read on the CPU only after the device poll below waits for the
    // submission.
    let output_gpu = unsafe { import_wgpu_buffer(device, caps, Arc::clone(&output), usage, None) }?;
    let mut encoder = device.create_command_encoder(&Default::default());
    gpu.record(device, &mut encoder, &input_gpu.buffer, &output_gpu.buffer)?;
    let c = gpu.config().clone();
    let vision_elems = batch * c.patches_per_side().pow(2) * c.hidden;
    // The vision stage's output stays in device memory; copying it out is the one transfer this
    // debugging path makes, and it is counted.
    let staging = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("vision readback"),
        size: (vision_elems * 4) as u64,
        usage: wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::MAP_READ,
        mapped_at_creation: false,
    });
    if matches!(stage, StageArg::Vision) {
        encoder.copy_buffer_to_buffer(
            gpu.vision_output(),
            0,
            &staging,
            0,
            (vision_elems * 4) as u64,
        );
        uvm_alloc::CopyLedger::global()
            .stage("vision-readback")
            .record(vision_elems * 4);
    }
    queue.submit([encoder.finish(), host_read_barrier(device)?]);
    device.poll(wgpu::PollType::wait_indefinitely())?;
    Ok(match stage {
        StageArg::Connector => {
            let g = output.cpu_access(0..gpu.output_bytes() as usize, uvm_alloc::Access::Read)?;
            (
                g.typed::<f32>()?.to_vec(),
                vec![c.image_tokens() as u64, c.text_hidden as u64],
            )
        }
        StageArg::Vision => {
            let slice = staging.slice(..);
            slice.map_async(wgpu::MapMode::Read, |_| {});
            device.poll(wgpu::PollType::wait_indefinitely())?;
            let data = slice
                .get_mapped_range()
                .map_err(|e| format!("reading the vision output back: {e:?}"))?;
            (
                bytemuck::cast_slice::<u8, f32>(&data).to_vec(),
                vec![c.patches_per_side().pow(2) as u64, c.hidden as u64],
            )
        }
    })
}
