//! Assembling a [`Chain`] from a description: command-line flags, a TOML file, or both (flags
//! win). Each stage's backend is chosen here: the ISP and the encoder on the GPU (the first
//! Vulkan adapter) or the CPU, the decoder on an npu-hal device.
//!
//! A TOML file uses the same names as the flags, with `_` for `-`:
//!
//! ```toml
//! source = "pattern:1920x1080@60"
//! model = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
//! prompt = "Describe the scene."
//! isp = "gpu"          # gpu | cpu | auto
//! encoder = "gpu"      # gpu | cpu | auto
//! device = "cpu"       # the decoder's npu-hal device: cpu | gpu | accel | auto
//! every = 30
//! max_tokens = 32
//! tiles = 4            # SmolVLM's image splitting: up to 4 x 4 tiles and the global view
//! [synthetic]          # the tower used when no `vlm` checkpoint is given
//! image_size = 224
//! layers = 4
//! ```

use std::path::{Path, PathBuf};

use isp_v4l2::isp::{Layout, Matrix, Preprocess, Range, Resize};
use isp_v4l2::{FrameSource, Pacing};
use npu_hal::sampling::SamplingParams;
use serde::Deserialize;

use super::{
    Chain, CpuEncoder, CpuIsp, EncoderStage, GpuContext, GpuEncoder, GpuIsp, ImageShape, IspStage,
    NpuDecoder, PromptLayout, RunOptions, StageError,
};
use crate::decoder::{DecoderOptions, WeightPolicy};
use crate::vision::{VisionConfig, VisionEncoder};

/// Where a stage runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// The GPU when a Vulkan adapter opens, else the CPU (said on stderr).
    #[default]
    Auto,
    Gpu,
    Cpu,
}

impl std::str::FromStr for Placement {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Placement::Auto),
            "gpu" => Ok(Placement::Gpu),
            "cpu" => Ok(Placement::Cpu),
            other => Err(format!("{other:?}: use gpu, cpu or auto")),
        }
    }
}

/// How a full ring treats the source.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backpressure {
    /// Drop for cameras and real-time patterns, block for files and unpaced patterns.
    #[default]
    Auto,
    /// Latest frame wins.
    Drop,
    /// The source waits.
    Block,
}

impl std::str::FromStr for Backpressure {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Backpressure::Auto),
            "drop" => Ok(Backpressure::Drop),
            "block" => Ok(Backpressure::Block),
            other => Err(format!("{other:?}: use drop, block or auto")),
        }
    }
}

/// The documented synthetic vision tower: SigLIP-shaped, seeded random weights. It exercises
/// every kernel and buffer of the real chain; its embeddings mean nothing, so neither does
/// the text the decoder writes about them.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SyntheticTower {
    pub image_size: usize,
    pub patch_size: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub scale_factor: usize,
    pub seed: u64,
}

impl Default for SyntheticTower {
    fn default() -> Self {
        // SigLIP's layout at a size a CPU-class GPU (lavapipe) encodes in tens of milliseconds:
        // 14x14 patches, 49 image tokens after the pixel shuffle.
        SyntheticTower {
            image_size: 224,
            patch_size: 16,
            hidden: 192,
            intermediate: 768,
            layers: 4,
            heads: 3,
            scale_factor: 2,
            seed: 0x0051_611e,
        }
    }
}

/// Everything that describes a chain. Every field has a default but `source` and `model`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ChainSpec {
    /// `camera:/dev/videoN[:WxH[@FPS]]`, `file:clip.y4m`, `file:image.png`, `pattern:WxH@FPS`.
    pub source: Option<String>,
    /// The decoder: a .gguf file, or a directory with config.json and *.safetensors (a SmolVLM
    /// checkpoint opens as its text model).
    pub model: Option<PathBuf>,
    /// A SmolVLM checkpoint directory or a llama.cpp mmproj GGUF whose vision tower and
    /// connector encode the frames; without it the synthetic tower runs.
    pub vlm: Option<PathBuf>,
    pub prompt: Option<String>,
    /// Wrap the prompt in the model's chat template (default true).
    pub chat: Option<bool>,
    pub isp: Placement,
    pub encoder: Placement,
    /// The decoder's npu-hal backend: `cpu` (the reference NPU, default) or `accel` (a
    /// `/dev/accel` device, once its driver has an execution backend).
    pub device: Option<String>,
    pub every: Option<u64>,
    pub max_frames: Option<u64>,
    pub max_tokens: Option<usize>,
    pub depth: Option<usize>,
    /// Capture buffers for a camera source (2 to 32). By default, enough that a live chain
    /// drops frames rather than starving the driver: every ring slot of the frames ring, the
    /// frame waiting beside it, the one the ISP is reading, and one for the driver to fill.
    pub buffers: Option<u32>,
    pub backpressure: Backpressure,
    /// Deliver file and pattern frames at their rate instead of as fast as possible.
    pub realtime: Option<bool>,
    /// Submit a frame's GPU work before its capture lands where the source can announce it
    /// (`--ahead`; off by default).
    pub ahead: Option<bool>,
    pub matrix: Option<String>,
    pub range: Option<String>,
    pub policy: Option<String>,
    pub threads: Option<usize>,
    pub ctx: Option<usize>,
    pub kv: Option<String>,
    pub cache_dir: Option<PathBuf>,
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub seed: Option<u64>,
    /// Constrain replies to a regular expression.
    pub regex: Option<String>,
    /// Constrain replies to a JSON schema (a file).
    pub json_schema: Option<PathBuf>,
    /// Constrain replies to a Lark grammar (a file, llguidance's dialect).
    pub grammar: Option<PathBuf>,
    /// Draft tokens for speculative decoding: `ngram` (the reply so far and the previous
    /// replies) or a smaller model with the same tokenizer.
    pub draft: Option<String>,
    /// The most tokens a step drafts (1 to 15, default 8).
    pub draft_tokens: Option<usize>,
    /// Skip encoding a frame whose ISP output moved by at most this relative RMS difference
    /// from the last encoded frame's (e.g. 0.02), describing it from that image's pinned K/V;
    /// off when unset.
    pub skip_similar: Option<f32>,
    /// Describe every frame in one running conversation (each frame a new turn after the
    /// earlier replies), kept within `kv_budget` when one is set.
    pub keep_context: Option<bool>,
    /// Keep each reply's KV cache within this many tokens (`prune` picks which pages go).
    pub kv_budget: Option<usize>,
    /// `sinks` (default), `h2o` or `entropy`.
    pub prune: Option<String>,
    /// Hold the encoder while the decoder prefills (`--prefill-first`; see
    /// [`RunOptions::prefill_first`]).
    pub prefill_first: Option<bool>,
    pub synthetic: SyntheticTower,
    /// Run the tower at another square input size than its native one (a multiple of the patch
    /// size); the position grid follows SmolVLM's own bucketing.
    pub image_size: Option<usize>,
    /// Split each frame as SmolVLM's processor does, at a longest edge of this many tower
    /// inputs (SmolVLM-256M's processor: 4, 2048 pixels for its 512 tower): up to `tiles x
    /// tiles` tiles and the global view, encoded in one submission. 1 to [`MAX_TILES`]; unset,
    /// one image per frame.
    pub tiles: Option<usize>,
}

/// The most tiles per side `tiles` takes (SmolVLM's vocabulary names tiles up to
/// `<row_6_col_6>`; a tokenizer without a grid's names is refused when the prompt is laid out).
pub const MAX_TILES: usize = 8;

impl ChainSpec {
    /// Reads a TOML chain description.
    pub fn from_toml_file(path: &Path) -> Result<ChainSpec, StageError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()).into())
    }

    /// `self` with every field `other` sets taken from `other`.
    pub fn overlay(mut self, other: ChainSpec) -> ChainSpec {
        macro_rules! take {
            ($($f:ident),*) => { $( if other.$f.is_some() { self.$f = other.$f; } )* };
        }
        take!(
            source,
            model,
            vlm,
            device,
            prompt,
            chat,
            every,
            max_frames,
            max_tokens,
            depth,
            buffers,
            realtime,
            ahead,
            matrix,
            range,
            policy,
            threads,
            ctx,
            kv,
            cache_dir,
            temperature,
            top_k,
            top_p,
            repeat_penalty,
            seed,
            regex,
            json_schema,
            grammar,
            draft,
            draft_tokens,
            skip_similar,
            keep_context,
            kv_budget,
            prune,
            prefill_first,
            image_size,
            tiles
        );
        if other.isp != Placement::Auto {
            self.isp = other.isp;
        }
        if other.encoder != Placement::Auto {
            self.encoder = other.encoder;
        }
        if other.backpressure != Backpressure::Auto {
            self.backpressure = other.backpressure;
        }
        if other.synthetic != SyntheticTower::default() {
            self.synthetic = other.synthetic;
        }
        self
    }
}

/// A built chain, how to run it, and what the user should know about how it was built.
#[derive(Debug)]
pub struct Built {
    pub chain: Chain,
    pub options: RunOptions,
    /// Lines for stderr: backends chosen, fallbacks taken, the synthetic tower notice.
    pub notes: Vec<String>,
}

/// Opens every stage `spec` names.
pub fn build(spec: &ChainSpec, trace: bool) -> Result<Built, StageError> {
    let mut notes = Vec::new();
    let source_spec = spec
        .source
        .as_deref()
        .ok_or("no source: pass --source (camera:..., file:..., pattern:...)")?;
    let model = spec
        .model
        .as_deref()
        .or(spec.vlm.as_deref())
        .ok_or("no model: pass --model (a .gguf file or a checkpoint directory)")?;
    let realtime = spec.realtime.unwrap_or(false);
    let pacing = if realtime {
        Pacing::RealTime
    } else {
        Pacing::AsFastAsPossible
    };
    // The GPU first: what it can import decides where frames are allocated and where the ISP
    // runs.
    let wants_gpu = spec.isp != Placement::Cpu || spec.encoder != Placement::Cpu;
    let gpu = if wants_gpu {
        match GpuContext::open() {
            Ok(g) => Some(g),
            Err(e) if spec.isp != Placement::Gpu && spec.encoder != Placement::Gpu => {
                notes.push(format!("no GPU ({e}); the ISP and encoder run on the CPU"));
                None
            }
            Err(e) => return Err(e),
        }
    } else {
        None
    };
    let camera = source_spec.starts_with("camera:");
    // A camera's frames are the driver's dma-bufs: a GPU ISP must import dma-bufs to read them
    // in place. `auto` then runs the ISP on the CPU (it maps them); `gpu` is an error.
    let isp_on_gpu = match (&gpu, spec.isp) {
        (None, _) | (_, Placement::Cpu) => false,
        (Some(g), placement) if camera && !g.caps.dma_buf => {
            if placement == Placement::Gpu {
                return Err(format!(
                    "--isp gpu: {} cannot import dma-bufs (no VK_EXT_external_memory_dma_buf), \
                     so it cannot read the camera's buffers in place; use --isp cpu or auto",
                    g.adapter
                )
                .into());
            }
            notes.push(format!(
                "isp: on the CPU, because {} cannot import the camera's dma-bufs \
                 (no VK_EXT_external_memory_dma_buf)",
                g.adapter
            ));
            false
        }
        (Some(_), _) => true,
    };
    let depth = spec.depth.unwrap_or(2).max(1);
    // The frames ring's slots (one more than the depth when live), the frames whose GPU ISP
    // work is in flight (their leases hold the buffers, up to the depth), and one for the
    // driver to fill.
    let camera_buffers = spec
        .buffers
        .unwrap_or_else(|| u32::try_from(2 * depth + 2).unwrap_or(u32::MAX))
        .min(isp_v4l2::v4l2::MAX_BUFFERS);
    let source: Box<dyn FrameSource> = isp_v4l2::open_source(
        source_spec,
        &isp_v4l2::SourceOptions {
            pacing,
            camera_buffers: Some(camera_buffers),
            // Frames a GPU ISP reads come from memory it imports.
            frame_backends: gpu
                .as_ref()
                .filter(|_| isp_on_gpu)
                .map(|g| g.caps.importable_backends()),
        },
    )?;
    let live = match spec.backpressure {
        Backpressure::Drop => true,
        Backpressure::Block => false,
        Backpressure::Auto => {
            source_spec.starts_with("camera:") || (source_spec.starts_with("pattern:") && realtime)
        }
    };

    // The decoder first: the synthetic tower needs its hidden size.
    let kv_dtype = crate::llm::parse_kv_dtype(spec.kv.as_deref().unwrap_or("f16"))?;
    let recorded = crate::llm::recorded_policy(model)?;
    let policy = WeightPolicy::parse(
        spec.policy
            .as_deref()
            .or(recorded.as_deref())
            .unwrap_or("default"),
    )?;
    let ctx = spec.ctx.unwrap_or(1024);
    let draft_tokens = spec.draft_tokens.unwrap_or(8);
    if !(1..=crate::speculative::MAX_DRAFT_TOKENS).contains(&draft_tokens) {
        return Err(format!(
            "draft_tokens {draft_tokens}: use 1 to {}",
            crate::speculative::MAX_DRAFT_TOKENS
        )
        .into());
    }
    let cache_dir = spec
        .cache_dir
        .clone()
        .unwrap_or_else(|| crate::llm::default_cache_dir(model));
    let cache = crate::llm::cache_spec(model, &cache_dir, &policy);
    let options = DecoderOptions {
        policy,
        ctx,
        max_batch: 512.min(ctx.max(1)),
        // A speculative step reads the logits of every verified row.
        max_logit_rows: spec.draft.as_ref().map_or(1, |_| draft_tokens + 1),
        kv_dtype,
        cache,
    };
    let choice: crate::llm::DeviceChoice = spec.device.as_deref().unwrap_or("cpu").parse()?;
    let (device, picked) = crate::llm::open_device(choice, spec.threads.unwrap_or(0))?;
    notes.extend(picked);
    let (mut decoder, tokenizer) = crate::llm::open_decoder_on(model, options, device)?;
    if let Some(budget) = spec.kv_budget {
        decoder.set_pruning(Some(crate::decoder::Pruning {
            budget,
            policy: spec.prune.as_deref().unwrap_or("sinks").parse()?,
        }))?;
    } else if spec.prune.is_some() {
        return Err("prune needs kv_budget".into());
    }
    let tokenizer = tokenizer
        .ok_or("the model has no tokenizer (GGUF tokenizer.ggml.* or tokenizer.json needed)")?;
    let text_hidden = decoder.config().hidden;
    notes.push(format!(
        "decoder: {} on {} ({} threads, {}), policy {}",
        model.display(),
        decoder.device().info().name,
        decoder.device().info().parallelism,
        decoder.device().info().isa,
        decoder.options().policy.name
    ));
    notes.extend(decoder.report().numerics_note.clone());

    let vision = match &spec.vlm {
        Some(dir) => {
            let v = VisionEncoder::open_path(dir)?;
            if v.config().text_hidden != text_hidden {
                return Err(format!(
                    "the vision checkpoint projects to {} but the decoder's hidden size is \
                     {text_hidden}: pair a SmolVLM tower with its own text model",
                    v.config().text_hidden
                )
                .into());
            }
            notes.push(format!("vision: {} (SigLIP + connector)", dir.display()));
            v
        }
        None => {
            let s = &spec.synthetic;
            let config = VisionConfig {
                image_size: s.image_size,
                patch_size: s.patch_size,
                hidden: s.hidden,
                intermediate: s.intermediate,
                layers: s.layers,
                heads: s.heads,
                layer_norm_eps: 1e-6,
                scale_factor: s.scale_factor,
                text_hidden,
            };
            notes.push(format!(
                "vision: SYNTHETIC tower (seeded random SigLIP weights, {}x{} input, {} layers, \
                 {} image tokens): no trained SmolVLM tower is among the reachable sources, so \
                 the embeddings carry no meaning and the text below is not a description of the \
                 frame; pass --vlm DIR with a SmolVLM checkpoint for real captions",
                s.image_size,
                s.image_size,
                s.layers,
                config.image_tokens()
            ));
            VisionEncoder::random(config, s.seed)?
        }
    };

    let vision = match spec.image_size {
        Some(size) if size != vision.config().image_size => {
            notes.push(format!(
                "vision: input {size}x{size} instead of the native {n}x{n} (positions bucketed \
                 as SmolVLM does)",
                n = vision.config().image_size
            ));
            vision.resized(size, crate::vision::PositionResampling::Bucket)?
        }
        _ => vision,
    };
    let size = vision.config().image_size;
    let matrix = match spec.matrix.as_deref().unwrap_or("bt601") {
        "bt601" => Matrix::Bt601,
        "bt709" => Matrix::Bt709,
        other => return Err(format!("matrix {other}: use bt601 or bt709").into()),
    };
    let range = match spec.range.as_deref().unwrap_or("limited") {
        "limited" => Range::Limited,
        "full" => Range::Full,
        other => return Err(format!("range {other}: use limited or full").into()),
    };
    let desc = source.desc();
    let preprocess = Preprocess {
        matrix,
        range,
        crop: None,
        width: size,
        height: size,
        // Area averaging when shrinking (every source pixel counts, no aliasing).
        resize: if desc.width >= size && desc.height >= size {
            Resize::Area
        } else {
            Resize::Bilinear
        },
        // SmolVLM's processor: image_mean = image_std = 0.5.
        mean: [0.5; 3],
        std: [0.5; 3],
        layout: Layout::Chw,
    };

    // SmolVLM's image splitting: the tiles of the frame, then the whole frame.
    let grid = match spec.tiles {
        None => isp_v4l2::isp::TileGrid { rows: 0, cols: 0 },
        Some(t) if !(1..=MAX_TILES).contains(&t) => {
            return Err(format!("tiles {t}: use 1 to {MAX_TILES} tiles per side").into());
        }
        Some(_) if spec.skip_similar.is_some() => {
            return Err(
                "tiles and skip_similar do not combine: image reuse takes an image in one \
                 piece"
                    .into(),
            );
        }
        Some(t) => isp_v4l2::isp::TileGrid::idefics3(desc.width, desc.height, t * size, size)?,
    };
    let passes = super::tile_passes(preprocess, grid, &desc);
    let frame_size = (desc.width, desc.height);
    let images = passes.len();
    if spec.tiles.is_some() {
        notes.push(format!(
            "tiles: {} x {} of {size}x{size} and the global view, {images} images per frame in \
             one encode",
            grid.rows, grid.cols
        ));
    }
    let isp: Box<dyn IspStage> = match (&gpu, isp_on_gpu) {
        (Some(g), true) => Box::new(GpuIsp::with_images(g.clone(), passes, frame_size)),
        _ => Box::new(CpuIsp::with_images(passes, frame_size)),
    };
    let encoder: Box<dyn EncoderStage> = match (&gpu, spec.encoder) {
        (Some(g), Placement::Gpu | Placement::Auto) => {
            Box::new(GpuEncoder::with_images(g.clone(), &vision, images)?)
        }
        _ => Box::new(CpuEncoder::with_images(vision, images)),
    };
    let shape = ImageShape {
        grid,
        tokens: encoder.image_tokens(),
    };
    notes.push(format!(
        "source: {source_spec} ({}x{} {:?}); isp: {}; encoder: {}{}",
        desc.width,
        desc.height,
        desc.format,
        isp.name(),
        encoder.name(),
        gpu.as_ref()
            .map(|g| format!(" on {}", g.adapter))
            .unwrap_or_default()
    ));

    let layout = PromptLayout::new(
        &tokenizer,
        spec.prompt.as_deref().unwrap_or("Describe the scene."),
        shape,
        spec.chat.unwrap_or(true),
        decoder.config().add_bos,
    )?;
    let next_turn = match spec.keep_context {
        Some(true) if spec.skip_similar.is_some() => {
            return Err(
                "keep_context and skip_similar do not combine: an unchanged frame is \
                 described from its own image's K/V, which a running conversation has moved past"
                    .into(),
            );
        }
        Some(true) => Some(PromptLayout::next_turn(
            &tokenizer,
            spec.prompt.as_deref().unwrap_or("Describe the scene."),
            shape,
            spec.chat.unwrap_or(true),
        )?),
        _ => None,
    };
    let grammar = crate::grammar::from_request(
        spec.regex.as_deref(),
        spec.json_schema.as_deref(),
        spec.grammar.as_deref(),
        &tokenizer,
    )?;
    let sampling = SamplingParams {
        temperature: spec.temperature.unwrap_or(0.0),
        top_k: spec.top_k.unwrap_or(40),
        top_p: spec.top_p.unwrap_or(0.95),
        repetition_penalty: spec.repeat_penalty.unwrap_or(1.1),
        seed: spec.seed.unwrap_or(0x5eed),
        ..Default::default()
    };
    let drafter = match spec.draft.as_deref() {
        None => None,
        Some(source) => {
            let (drafter, note) = crate::llm::open_drafter(
                source,
                &decoder,
                Some(&tokenizer),
                choice,
                spec.threads.unwrap_or(0),
                &sampling,
            )?;
            notes.extend(note);
            Some(drafter)
        }
    };
    let mut decoder = NpuDecoder::new(
        decoder,
        tokenizer,
        layout,
        sampling,
        spec.max_tokens.unwrap_or(32),
        grammar,
    );
    if let Some(d) = drafter {
        decoder = decoder.with_drafter(d, draft_tokens);
    }
    if let Some(t) = spec.skip_similar {
        if !(t >= 0.0 && t.is_finite()) {
            return Err(format!("skip_similar {t}: use a finite threshold >= 0").into());
        }
        decoder = decoder.with_image_reuse();
    }
    if let Some(next) = next_turn {
        decoder = decoder.with_kept_context(next);
    }
    Ok(Built {
        chain: Chain {
            source,
            isp,
            encoder,
            decoder: Box::new(decoder),
        },
        options: RunOptions {
            every: spec.every.unwrap_or(1).max(1),
            max_frames: spec.max_frames,
            depth,
            live,
            trace,
            ahead: spec.ahead.unwrap_or(false),
            skip_similar: spec.skip_similar,
            prefill_first: spec.prefill_first.unwrap_or(false),
        },
        notes,
    })
}
