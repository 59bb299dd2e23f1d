//! The stage traits the chain holds as trait objects, and their CPU and GPU implementations.
//!
//! Every stage reads its input where the previous engine wrote it and writes its output into
//! a unified buffer the chain's ring owns: the ISP writes the encoder's input tensor, the
//! encoder (tower and connector, recorded into one command buffer on the GPU) writes the image
//! embeddings, and the decoder reads those in place as the input rows of the image tokens.
//! Only the CPU encoder copies (its result out of a heap vector), and it says so in the ledger.

use std::sync::Arc;
use std::time::{Duration, Instant};

use isp_v4l2::Frame;
use isp_v4l2::FrameDesc;
use isp_v4l2::gpu::GpuParams;
use isp_v4l2::isp::Preprocess;
use npu_hal::sampling::{Sampler, SamplingParams};
use uvm_alloc::vulkan::{ImportCaps, ImportedBuffer, host_read_barrier, import_wgpu_buffer};
use uvm_alloc::{Access, CopyLedger, UnifiedBuffer};

use crate::decoder::Decoder;
use crate::model::tokenizer::Tokenizer;
use crate::vision::VisionEncoder;
use crate::vision_gpu::GpuVisionEncoder;

/// A stage's failure, with enough words to act on.
pub type StageError = Box<dyn std::error::Error + Send + Sync>;

/// The ISP: a camera frame in, the encoder's input tensor (`3 x S x S` f32, CHW, normalised)
/// out, in one fused pass.
pub trait IspStage: Send {
    /// `isp-gpu`, `isp-cpu`, ...
    fn name(&self) -> &'static str;
    /// Bytes of the tensor it writes.
    fn output_bytes(&self) -> usize;
    /// Writes `frame`'s model input into `out`; returns when `out` is complete.
    fn process(&mut self, frame: &Frame, out: &Arc<UnifiedBuffer>) -> Result<(), StageError>;
    /// The buffer backends it reads and writes in place, best first; `None` for any (a CPU
    /// stage maps them all). The chain allocates its rings from these.
    fn buffer_backends(&self) -> Option<Vec<uvm_alloc::BackendKind>> {
        None
    }
}

/// The vision encoder: the ISP's tensor in, `image_tokens x text_hidden` f32 embeddings out
/// (the SigLIP tower and the connector).
pub trait EncoderStage: Send {
    /// `encoder-gpu`, `encoder-cpu`, ...
    fn name(&self) -> &'static str;
    /// The tower's and connector's shape.
    fn config(&self) -> &crate::vision::VisionConfig;
    /// Rows of embeddings per image.
    fn image_tokens(&self) -> usize {
        self.config().image_tokens()
    }
    /// Width of each row (the text model's hidden size).
    fn text_hidden(&self) -> usize {
        self.config().text_hidden
    }
    /// The buffer backends it reads and writes in place, best first; `None` for any (a CPU
    /// stage maps them all). The chain allocates its rings from these.
    fn buffer_backends(&self) -> Option<Vec<uvm_alloc::BackendKind>> {
        None
    }
    /// Side of the square input image.
    fn image_size(&self) -> usize {
        self.config().image_size
    }
    /// Encodes `pixels` into `out`; returns when `out` is complete and visible to the CPU.
    fn encode(
        &mut self,
        pixels: &Arc<UnifiedBuffer>,
        out: &Arc<UnifiedBuffer>,
    ) -> Result<(), StageError>;
    /// Starts encoding `pixels` into `out` and says when `out` will be complete and visible to
    /// the CPU; `pixels` must stay as they are until then. The chain calls this. The default
    /// runs [`EncoderStage::encode`] and is complete on return; the GPU encoder returns a
    /// value of a timeline that its queue signals when the work is done.
    fn submit(
        &mut self,
        pixels: &Arc<UnifiedBuffer>,
        out: &Arc<UnifiedBuffer>,
    ) -> Result<Completion, StageError> {
        self.encode(pixels, out).map(|()| Completion::Done)
    }
}

/// When an encoder's output is complete: the sync-timeline value its consumer waits on.
#[derive(Clone, Debug)]
pub enum Completion {
    /// Complete already (the work ran on the calling thread).
    Done,
    /// Complete once `timeline` reaches `value`: a Vulkan timeline semaphore that the GPU queue
    /// itself signals when the submission that wrote the output has finished.
    Gpu {
        timeline: Arc<sync_timeline::vulkan::VulkanTimeline>,
        value: u64,
    },
}

impl Completion {
    /// Returns once the output is complete, or an error after `timeout`.
    pub fn wait(&self, timeout: Duration) -> Result<(), StageError> {
        use sync_timeline::Timeline;
        match self {
            Completion::Done => Ok(()),
            Completion::Gpu { timeline, value } => timeline
                .wait(*value, timeout)
                .map_err(|e| format!("waiting for the GPU encoder's value {value}: {e}").into()),
        }
    }
}

/// What one generation produced and how fast.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Generation {
    pub prompt_tokens: usize,
    pub tokens: usize,
    pub time_to_first_token: Duration,
    pub decode_time: Duration,
}

/// The decoder: image embeddings in, text out, streamed piece by piece.
pub trait DecoderStage: Send {
    /// `decoder-cpu`, `decoder-gpu`, ...
    fn name(&self) -> &'static str;
    /// Generates a reply for the image whose embeddings are `image`, calling `on_text` with
    /// each decoded piece; stops early when `on_text` returns `false`.
    fn describe(
        &mut self,
        image: &[f32],
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<Generation, StageError>;
    /// Fraction of the KV cache's pages in use now.
    fn kv_utilisation(&self) -> f64;
}

/// One Vulkan device shared by the GPU stages.
#[derive(Clone, Debug)]
pub struct GpuContext {
    pub device: wgpu::Device,
    /// The device's queue. While a chain runs, its stages submit through `GpuContext` (which
    /// keeps the encoder's staged completion signal with the encoder's own submission); a
    /// direct `submit` from another thread at that time could carry that signal instead.
    pub queue: wgpu::Queue,
    pub caps: ImportCaps,
    pub adapter: String,
    /// The encoder kernels measured fastest on this adapter.
    pub vision_options: crate::vision_gpu::GpuVisionOptions,
    /// Signalled by the queue at the end of each [`GpuContext::submit_signalled`] batch.
    completion: Arc<sync_timeline::vulkan::VulkanTimeline>,
    /// The last value a submission will signal on `completion`. Held across staging the
    /// signal and submitting, by every submitter of this queue: a signal staged on wgpu's
    /// queue goes with the next submission, whoever makes it.
    submissions: Arc<std::sync::Mutex<u64>>,
}

impl GpuContext {
    /// Opens the first Vulkan adapter with uvm-alloc's external-memory extensions.
    pub fn open() -> Result<GpuContext, StageError> {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends: wgpu::Backends::VULKAN,
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        });
        let adapter =
            pollster::block_on(instance.request_adapter(&Default::default())).map_err(|e| {
                format!(
                    "no Vulkan adapter ({e}): install a Vulkan driver (mesa-vulkan-drivers gives \
                     lavapipe) or run the ISP and encoder on the CPU (--isp cpu --encoder cpu)"
                )
            })?;
        let info = adapter.get_info();
        let (desc, vision_options) = crate::vision_gpu::device_descriptor(&adapter);
        let (device, queue, caps) = uvm_alloc::vulkan::open_wgpu_device(&adapter, &desc)?;
        let completion = sync_timeline::vulkan::VulkanTimeline::from_wgpu(&device, 0)
            .map_err(|e| format!("creating the encoder's completion timeline: {e}"))?;
        Ok(GpuContext {
            device,
            queue,
            caps,
            vision_options,
            adapter: info.name,
            completion: Arc::new(completion),
            submissions: Arc::new(std::sync::Mutex::new(0)),
        })
    }

    /// Submits `commands` plus the barrier that makes shader writes visible to the host, and
    /// waits for that submission to complete.
    fn submit_and_wait(&self, commands: wgpu::CommandBuffer) -> Result<(), StageError> {
        let barrier = host_read_barrier(&self.device)?;
        let index = {
            let _staged = self
                .submissions
                .lock()
                .map_err(|_| "a GPU submitter panicked")?;
            self.queue.submit([commands, barrier])
        };
        self.device.poll(wgpu::PollType::Wait {
            submission_index: Some(index),
            timeout: Some(Duration::from_secs(60)),
        })?;
        Ok(())
    }

    /// Submits `commands` plus the host-visibility barrier with a signal of the next value of
    /// the completion timeline on the GPU queue, and returns at once: the value is reached when
    /// the queue has finished the submission.
    fn submit_signalled(&self, commands: wgpu::CommandBuffer) -> Result<Completion, StageError> {
        let barrier = host_read_barrier(&self.device)?;
        let value = {
            let mut last = self
                .submissions
                .lock()
                .map_err(|_| "a GPU submitter panicked")?;
            let value = *last + 1;
            // Registered first, so the semaphore is not destroyed before the queue signals it.
            self.completion.expect_device_signal(value);
            // SAFETY: the hal queue is only used to stage a semaphore signal for wgpu's next
            // submission (nothing is destroyed, nothing is submitted behind wgpu's back); the
            // semaphore lives in `self.completion`, whose drop waits for the value registered
            // above. Every submitter of this queue holds `submissions` from staging to
            // submitting, so the signal goes with this submission.
            let hal = unsafe { self.queue.as_hal::<wgpu::hal::api::Vulkan>() }
                .ok_or("the GPU stages run on wgpu's Vulkan backend only")?;
            hal.add_signal_semaphore(self.completion.semaphore(), Some(value));
            drop(hal);
            self.queue.submit([commands, barrier]);
            *last = value;
            value
        };
        // Non-blocking: lets wgpu retire finished submissions.
        self.device.poll(wgpu::PollType::Poll)?;
        Ok(Completion::Gpu {
            timeline: Arc::clone(&self.completion),
            value,
        })
    }
}

/// Imports of the ring's unified buffers, made once per buffer and kept.
#[derive(Debug, Default)]
struct Imports {
    imported: Vec<(*const UnifiedBuffer, ImportedBuffer)>,
}

// SAFETY: the raw pointer is only compared, never dereferenced; it identifies an
// `Arc<UnifiedBuffer>` that the ring keeps alive as long as the stage, and the
// `ImportedBuffer` itself holds a clone of that Arc.
unsafe impl Send for Imports {}

impl Imports {
    fn get(
        &mut self,
        gpu: &GpuContext,
        buffer: &Arc<UnifiedBuffer>,
    ) -> Result<&wgpu::Buffer, StageError> {
        let key = Arc::as_ptr(buffer);
        let at = match self.imported.iter().position(|(k, _)| *k == key) {
            Some(at) => at,
            None => {
                // SAFETY: a ring slot belongs to one stage at a time (the ring's invariant), and a
                // GPU stage hands a slot on only once its device work on it is complete (the ISP
                // waits for its submission; the encoder's output is read after its completion
                // value, and its input released only after it), so no CPU guard of the slot is
                // alive while the device uses it.
                let imported = unsafe {
                    import_wgpu_buffer(
                        &gpu.device,
                        &gpu.caps,
                        Arc::clone(buffer),
                        wgpu::BufferUsages::STORAGE,
                        Some("ring slot"),
                    )
                }?;
                self.imported.push((key, imported));
                self.imported.len() - 1
            }
        };
        Ok(&self.imported[at].1.buffer)
    }
}

/// The fused ISP on the CPU ([`isp_v4l2::isp::preprocess`]), writing the tensor in place.
#[derive(Debug)]
pub struct CpuIsp {
    params: Preprocess,
}

impl CpuIsp {
    pub fn new(params: Preprocess) -> CpuIsp {
        CpuIsp { params }
    }
}

impl IspStage for CpuIsp {
    fn name(&self) -> &'static str {
        "isp-cpu"
    }

    fn output_bytes(&self) -> usize {
        3 * self.params.width * self.params.height * 4
    }

    fn process(&mut self, frame: &Frame, out: &Arc<UnifiedBuffer>) -> Result<(), StageError> {
        let len = frame.desc.byte_len();
        let input = frame.buffer.cpu_access(0..len, Access::Read)?;
        let mut output = out.cpu_access(0..self.output_bytes(), Access::Write)?;
        isp_v4l2::isp::preprocess(
            &frame.desc,
            input.bytes(),
            &self.params,
            output.typed_mut::<f32>()?,
        )?;
        Ok(())
    }
}

/// The fused ISP as isp-v4l2's WGSL pass: the frame's buffer and the output tensor are both
/// imported into Vulkan as they are.
pub struct GpuIsp {
    gpu: GpuContext,
    params: Preprocess,
    pipeline: wgpu::ComputePipeline,
    /// The uniform block for the frame shape it was made for.
    uniform: Option<(FrameDesc, GpuParams, wgpu::Buffer)>,
    outputs: Imports,
}

impl std::fmt::Debug for GpuIsp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuIsp")
            .field("adapter", &self.gpu.adapter)
            .field("params", &self.params)
            .finish_non_exhaustive()
    }
}

impl GpuIsp {
    pub fn new(gpu: GpuContext, params: Preprocess) -> GpuIsp {
        let module = gpu
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some("isp"),
                source: wgpu::ShaderSource::Wgsl(isp_v4l2::gpu::ISP_WGSL.into()),
            });
        let pipeline = gpu
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some("isp"),
                layout: None,
                module: &module,
                entry_point: Some("main"),
                compilation_options: Default::default(),
                cache: None,
            });
        GpuIsp {
            gpu,
            params,
            pipeline,
            uniform: None,
            outputs: Imports::default(),
        }
    }
}

impl IspStage for GpuIsp {
    fn name(&self) -> &'static str {
        "isp-gpu"
    }

    fn buffer_backends(&self) -> Option<Vec<uvm_alloc::BackendKind>> {
        Some(self.gpu.caps.importable_backends())
    }

    fn output_bytes(&self) -> usize {
        3 * self.params.width * self.params.height * 4
    }

    fn process(&mut self, frame: &Frame, out: &Arc<UnifiedBuffer>) -> Result<(), StageError> {
        use wgpu::util::DeviceExt;
        if self.uniform.as_ref().is_none_or(|(d, ..)| *d != frame.desc) {
            let p = GpuParams::new(&frame.desc, &self.params)?;
            let buffer = self
                .gpu
                .device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("isp params"),
                    contents: bytemuck::bytes_of(&p),
                    usage: wgpu::BufferUsages::UNIFORM,
                });
            self.uniform = Some((frame.desc, p, buffer));
        }
        let Some((_, params, uniform)) = &self.uniform else {
            unreachable!("set above")
        };
        // The frame is a new buffer each time (the source's, or the driver's), imported as-is.
        // SAFETY: a source writes a frame (under its own guard, dropped) before delivering it,
        // and nobody takes a CPU guard of a delivered frame while the ISP holds it; `process`
        // waits for the device before it returns and lets the frame go.
        let input = unsafe {
            import_wgpu_buffer(
                &self.gpu.device,
                &self.gpu.caps,
                Arc::clone(&frame.buffer),
                wgpu::BufferUsages::STORAGE,
                Some("frame"),
            )
        }?;
        let output = self.outputs.get(&self.gpu, out)?;
        let bind = self
            .gpu
            .device
            .create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("isp"),
                layout: &self.pipeline.get_bind_group_layout(0),
                entries: &[
                    wgpu::BindGroupEntry {
                        binding: 0,
                        resource: input.buffer.as_entire_binding(),
                    },
                    wgpu::BindGroupEntry {
                        binding: 1,
                        resource: output.as_entire_binding(),
                    },
                    wgpu::BindGroupEntry {
                        binding: 2,
                        resource: uniform.as_entire_binding(),
                    },
                ],
            });
        let mut encoder = self.gpu.device.create_command_encoder(&Default::default());
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("isp"),
                timestamp_writes: None,
            });
            pass.set_pipeline(&self.pipeline);
            pass.set_bind_group(0, &bind, &[]);
            let (x, y, z) = params.workgroups();
            pass.dispatch_workgroups(x, y, z);
        }
        self.gpu.submit_and_wait(encoder.finish())
    }
}

/// The SigLIP tower and connector on the CPU ([`VisionEncoder`]).
#[derive(Debug)]
pub struct CpuEncoder {
    encoder: VisionEncoder,
}

impl CpuEncoder {
    pub fn new(encoder: VisionEncoder) -> CpuEncoder {
        CpuEncoder { encoder }
    }
}

impl EncoderStage for CpuEncoder {
    fn name(&self) -> &'static str {
        "encoder-cpu"
    }

    fn config(&self) -> &crate::vision::VisionConfig {
        self.encoder.config()
    }

    fn encode(
        &mut self,
        pixels: &Arc<UnifiedBuffer>,
        out: &Arc<UnifiedBuffer>,
    ) -> Result<(), StageError> {
        let s = self.image_size();
        let input = pixels.cpu_access(0..3 * s * s * 4, Access::Read)?;
        let result = self.encoder.encode(input.typed::<f32>()?)?;
        let mut output = out.cpu_access(0..result.len() * 4, Access::Write)?;
        // The CPU encoder builds its result in a heap vector: moving it into the ring's buffer
        // is a real copy, and the ledger says so.
        CopyLedger::global()
            .stage("encoder-cpu-output")
            .copy(output.typed_mut::<f32>()?, &result)?;
        Ok(())
    }
}

/// The WGSL encoder ([`GpuVisionEncoder`]): reads the ISP's tensor and writes the embeddings in
/// the ring's unified buffers, one command buffer per image.
pub struct GpuEncoder {
    gpu: GpuContext,
    encoder: GpuVisionEncoder,
    inputs: Imports,
    outputs: Imports,
}

impl std::fmt::Debug for GpuEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuEncoder")
            .field("adapter", &self.gpu.adapter)
            .field("encoder", &self.encoder)
            .finish_non_exhaustive()
    }
}

impl GpuEncoder {
    /// Uploads `cpu`'s weights to the GPU.
    pub fn new(gpu: GpuContext, cpu: &VisionEncoder) -> Result<GpuEncoder, StageError> {
        let encoder = GpuVisionEncoder::with_options(&gpu.device, cpu, gpu.vision_options)?;
        Ok(GpuEncoder {
            gpu,
            encoder,
            inputs: Imports::default(),
            outputs: Imports::default(),
        })
    }
}

impl EncoderStage for GpuEncoder {
    fn name(&self) -> &'static str {
        "encoder-gpu"
    }

    fn buffer_backends(&self) -> Option<Vec<uvm_alloc::BackendKind>> {
        Some(self.gpu.caps.importable_backends())
    }

    fn config(&self) -> &crate::vision::VisionConfig {
        self.encoder.config()
    }

    fn encode(
        &mut self,
        pixels: &Arc<UnifiedBuffer>,
        out: &Arc<UnifiedBuffer>,
    ) -> Result<(), StageError> {
        self.submit(pixels, out)?.wait(Duration::from_secs(60))
    }

    fn submit(
        &mut self,
        pixels: &Arc<UnifiedBuffer>,
        out: &Arc<UnifiedBuffer>,
    ) -> Result<Completion, StageError> {
        let input = self.inputs.get(&self.gpu, pixels)?.clone();
        let output = self.outputs.get(&self.gpu, out)?.clone();
        let mut encoder = self.gpu.device.create_command_encoder(&Default::default());
        self.encoder
            .record(&self.gpu.device, &mut encoder, &input, &output)
            .map_err(|e| e.to_string())?;
        self.gpu.submit_signalled(encoder.finish())
    }
}

/// Where the image goes in the prompt: `before`, then `image_rows` positions whose input rows
/// are the image embeddings, then `after`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptLayout {
    pub before: Vec<u32>,
    pub image_rows: usize,
    /// The token id at the image positions (the model's `<image>` token when it has one; any
    /// in-vocabulary id otherwise, since those rows' embeddings are replaced).
    pub placeholder: u32,
    pub after: Vec<u32>,
}

impl PromptLayout {
    /// Lays out `prompt` with an image of `image_rows` embeddings as SmolVLM's processor does
    /// for one global image (`<fake_token_around_image><global-img><image>*N
    /// <fake_token_around_image>` before the text) when the tokenizer has those tokens, or the
    /// image positions straight before the text otherwise. With `chat`, the user turn goes
    /// through the model's chat template.
    pub fn new(
        tokenizer: &Tokenizer,
        prompt: &str,
        image_rows: usize,
        chat: bool,
        add_bos: bool,
    ) -> Result<PromptLayout, StageError> {
        const MARK: &str = "\u{1}IMAGE\u{1}";
        let user = format!("{MARK}{prompt}");
        let text = match (chat, tokenizer.chat_template()) {
            (true, Some(_)) => tokenizer.apply_chat_template(&[("user", user.as_str())], true)?,
            _ => user,
        };
        let (a, b) = text
            .split_once(MARK)
            .ok_or("the chat template dropped the user's message")?;
        let mut before = tokenizer.encode(a, add_bos)?;
        let mut after = tokenizer.encode(b, false)?;
        let id = |t: &str| tokenizer.token_to_id(t);
        let placeholder = match (
            id("<fake_token_around_image>"),
            id("<global-img>"),
            id("<image>"),
        ) {
            (Some(fake), Some(global), Some(image)) => {
                before.extend([fake, global]);
                after.insert(0, fake);
                image
            }
            (_, _, Some(image)) => image,
            _ => tokenizer.bos_id().or(tokenizer.eos_id()).unwrap_or(0),
        };
        Ok(PromptLayout {
            before,
            image_rows,
            placeholder,
            after,
        })
    }

    /// The whole token sequence and where the image rows start.
    pub fn tokens(&self) -> (Vec<u32>, usize) {
        let mut t = self.before.clone();
        t.extend(std::iter::repeat_n(self.placeholder, self.image_rows));
        t.extend_from_slice(&self.after);
        (t, self.before.len())
    }
}

/// The decoder on an npu-hal device, sampling on the CPU.
pub struct NpuDecoder {
    decoder: Decoder,
    tokenizer: Tokenizer,
    layout: PromptLayout,
    sampling: SamplingParams,
    max_tokens: usize,
    grammar: Option<crate::grammar::Grammar>,
}

impl std::fmt::Debug for NpuDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NpuDecoder")
            .field("decoder", &self.decoder)
            .field("layout", &self.layout)
            .field("max_tokens", &self.max_tokens)
            .finish_non_exhaustive()
    }
}

impl NpuDecoder {
    /// A decoder stage answering `layout`'s prompt for each image, `max_tokens` at most,
    /// optionally constrained by `grammar`.
    pub fn new(
        decoder: Decoder,
        tokenizer: Tokenizer,
        layout: PromptLayout,
        sampling: SamplingParams,
        max_tokens: usize,
        grammar: Option<crate::grammar::Grammar>,
    ) -> NpuDecoder {
        NpuDecoder {
            decoder,
            tokenizer,
            layout,
            sampling,
            max_tokens,
            grammar,
        }
    }
}

impl DecoderStage for NpuDecoder {
    fn name(&self) -> &'static str {
        match self.decoder.device().info().kind {
            npu_hal::DeviceKind::Gpu => "decoder-gpu",
            npu_hal::DeviceKind::Accel => "decoder-accel",
            npu_hal::DeviceKind::Cpu | npu_hal::DeviceKind::Empty => "decoder-cpu",
        }
    }

    fn describe(
        &mut self,
        image: &[f32],
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<Generation, StageError> {
        let (tokens, first) = self.layout.tokens();
        let mut reply = Generation {
            prompt_tokens: tokens.len(),
            ..Generation::default()
        };
        if self.max_tokens == 0 {
            return Ok(reply);
        }
        let mut sampler = Sampler::new(self.sampling.clone())?;
        let start = Instant::now();
        self.decoder.reset()?;
        let n = tokens.len();
        let mut logits = Vec::new();
        self.decoder
            .forward_spliced(&tokens, Some((first, image)), n - 1..n, |_, l| {
                logits.clear();
                logits.extend_from_slice(l)
            })?;
        // The repetition penalty looks at text, not at the image placeholders.
        let mut history: Vec<u32> = self.layout.before.clone();
        history.extend_from_slice(&self.layout.after);
        let mut stream = self.tokenizer.stream_decoder();
        let mut state = self.grammar.as_ref().map(|g| g.start());
        let mut first_token = None;
        for i in 0..self.max_tokens {
            if let (Some(g), Some(s)) = (&self.grammar, state.as_mut()) {
                g.mask(s, &mut logits)?;
            }
            let next = sampler.sample(&mut logits, &history)?;
            if i == 0 {
                reply.time_to_first_token = start.elapsed();
                first_token = Some(Instant::now());
            }
            if self.tokenizer.is_end_of_generation(next) {
                break;
            }
            if let (Some(g), Some(s)) = (&self.grammar, state.as_mut()) {
                g.advance(s, next)?;
            }
            reply.tokens += 1;
            history.push(next);
            let piece = stream.push(next)?;
            if !on_text(&piece) {
                break;
            }
            let done = state
                .as_ref()
                .zip(self.grammar.as_ref())
                .is_some_and(|(s, g)| g.is_exhausted(s));
            if done || i + 1 == self.max_tokens {
                break;
            }
            self.decoder.forward_last_into(&[next], &mut logits)?;
        }
        let rest = stream.finish()?;
        if !rest.is_empty() {
            on_text(&rest);
        }
        reply.decode_time = first_token.map_or(Duration::ZERO, |t| t.elapsed());
        Ok(reply)
    }

    fn kv_utilisation(&self) -> f64 {
        let m = self.decoder.kv().manager();
        1.0 - m.available_blocks() as f64 / m.total_blocks().max(1) as f64
    }
}
