//! The stage traits the chain holds as trait objects, and their CPU and GPU implementations.
//!
//! Every stage reads its input where the previous engine wrote it and writes its output into
//! a unified buffer the chain's ring owns: the ISP writes the encoder's input tensor, the
//! encoder (tower and connector, recorded into one command buffer on the GPU) writes the image
//! embeddings, and the decoder reads those in place as the input rows of the image tokens.
//! Only the CPU encoder copies (its result out of a heap vector), and it says so in the ledger.

use std::sync::Arc;
use std::time::{Duration, Instant};

use isp_v4l2::isp::Preprocess;
use isp_v4l2::{Frame, FrameDesc};
use npu_hal::sampling::SamplingParams;
use uvm_alloc::vulkan::{ImportCache, ImportCaps, host_read_barrier};
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
    /// Starts writing `frame`'s model input into `out` and says when `out` will be complete.
    /// The frame may be dropped on return: a stage whose device work still reads it registers
    /// that work on the frame's lease, so its source does not refill the buffer before.
    fn submit(&mut self, frame: &Frame, out: &Arc<UnifiedBuffer>)
    -> Result<Completion, StageError>;
    /// Writes `frame`'s model input into `out`; returns when `out` is complete.
    fn process(&mut self, frame: &Frame, out: &Arc<UnifiedBuffer>) -> Result<(), StageError> {
        self.submit(frame, out)?.wait(GPU_TIMEOUT).map(|_| ())
    }
    /// The buffer backends it reads and writes in place, best first; `None` for any (a CPU
    /// stage maps them all). The chain allocates its rings from these.
    fn buffer_backends(&self) -> Option<Vec<uvm_alloc::BackendKind>> {
        None
    }
    /// How many times its thread has blocked on GPU work so far.
    fn host_waits(&self) -> u64 {
        0
    }
    /// The GPU it submits to, if any (for the chain's in-flight count and trace).
    fn gpu(&self) -> Option<&GpuContext> {
        None
    }
    /// A timeline for the source to mirror its frames' readiness onto, which this ISP then
    /// waits on in its queue for a frame announced before it is written (ahead-of-time
    /// submission, [`isp_v4l2::FrameSource::announce_next`]); `None` if it cannot wait on the
    /// device. The chain offers it to the source and announces frames only if both agree.
    fn frames_ready_timeline(
        &mut self,
    ) -> Result<Option<Arc<dyn sync_timeline::Timeline>>, StageError> {
        Ok(None)
    }
    /// Frames whose work it submitted before the frame was written.
    fn frames_submitted_ahead(&self) -> u64 {
        0
    }
    /// Returns once a new frame's work would fit on its engine (see
    /// [`GpuContext::limit_frames_in_flight`]): the chain calls this before it takes the
    /// newest frame, so a frame never ages while the stage waits.
    fn wait_for_room(&self) -> Result<(), StageError> {
        match self.gpu() {
            Some(gpu) => gpu.wait_for_room(),
            None => Ok(()),
        }
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
    /// Embedding rows per image.
    fn image_tokens(&self) -> usize {
        self.config().image_tokens()
    }

    /// Images per frame (SmolVLM's tiles and global view, encoded together; 1 unless split):
    /// the input holds that many tensors and the output that many images' rows, back to back.
    fn images(&self) -> usize {
        1
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
    /// Starts encoding `pixels` (of the source's frame `frame`) into `out` once `pixels_ready`
    /// (the ISP's completion) and says when `out` will be complete and visible to the CPU;
    /// `pixels` must stay as they are until then. A GPU encoder on the ISP's queue orders
    /// itself after the ISP's work in the queue; any other encoder waits for `pixels_ready` on
    /// the host (and counts the wait).
    fn submit(
        &mut self,
        frame: u64,
        pixels: &Arc<UnifiedBuffer>,
        pixels_ready: &Completion,
        out: &Arc<UnifiedBuffer>,
    ) -> Result<Completion, StageError>;
    /// Encodes `pixels` into `out`; returns when `out` is complete and visible to the CPU.
    fn encode(
        &mut self,
        pixels: &Arc<UnifiedBuffer>,
        out: &Arc<UnifiedBuffer>,
    ) -> Result<(), StageError> {
        self.submit(0, pixels, &Completion::Done, out)?
            .wait(GPU_TIMEOUT)
            .map(|_| ())
    }
    /// How many times its thread has blocked on GPU work so far (see
    /// [`crate::chain::RunReport::host_waits_per_frame`]).
    fn host_waits(&self) -> u64 {
        0
    }
    /// The GPU it submits to, if any (for the chain's in-flight count and trace).
    fn gpu(&self) -> Option<&GpuContext> {
        None
    }
}

/// How long a stage waits for the GPU before calling it lost.
pub const GPU_TIMEOUT: Duration = Duration::from_secs(60);

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
    /// Returns once the output is complete, or an error after `timeout`; `Ok(true)` when it
    /// had to block (the work was not complete yet), which stages count as host waits.
    pub fn wait(&self, timeout: Duration) -> Result<bool, StageError> {
        use sync_timeline::Timeline;
        match self {
            Completion::Done => Ok(false),
            Completion::Gpu { timeline, value } => {
                if timeline.value()? >= *value {
                    return Ok(false);
                }
                timeline
                    .wait(*value, timeout)
                    .map_err(|e| format!("waiting for the GPU's completion value {value}: {e}"))?;
                Ok(true)
            }
        }
    }

    /// The timeline and value, for a GPU completion.
    pub fn timeline_value(&self) -> Option<(Arc<dyn sync_timeline::Timeline>, u64)> {
        match self {
            Completion::Done => None,
            Completion::Gpu { timeline, value } => Some((
                Arc::clone(timeline) as Arc<dyn sync_timeline::Timeline>,
                *value,
            )),
        }
    }
}

/// What one reply produced and how fast: the generation's own statistics, whether the image
/// was found unchanged from the last one (`skip_similar`) so its K/V were reused, and whether
/// the stage blocked its thread for the encoder's output (a host wait).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Generation {
    pub stats: crate::llm::GenerationStats,
    pub image_reused: bool,
    pub host_waited: bool,
    /// Tokens the decoder's KV cache held for its sequence when the reply ended.
    pub kv_tokens: usize,
    /// A running conversation (`keep_context`) started over before this reply, because the
    /// reply might not have fit the context.
    pub context_restarted: bool,
}

/// An image's embeddings as the encoder left them: `len` f32 values from the start of
/// `buffer` (a ring slot, unified memory), complete once `ready` is reached. When `unchanged`,
/// the encoder found the frame equal to the last one it encoded (`skip_similar`) and wrote
/// nothing: the buffer holds no embeddings of this frame, and the decoder reuses the last
/// image's.
#[derive(Clone, Copy, Debug)]
pub struct EncodedImage<'a> {
    pub buffer: &'a Arc<UnifiedBuffer>,
    pub len: usize,
    pub ready: &'a Completion,
    pub unchanged: bool,
}

impl EncodedImage<'_> {
    /// Waits on the host for the encoder, then calls `f` with the values (read in place,
    /// under a CPU read guard); returns its result and whether the wait blocked.
    pub fn read<R>(&self, f: impl FnOnce(&[f32]) -> R) -> Result<(R, bool), StageError> {
        let blocked = self.ready.wait(GPU_TIMEOUT)?;
        let guard = self.buffer.cpu_access(0..self.len * 4, Access::Read)?;
        Ok((f(guard.typed::<f32>()?), blocked))
    }
}

/// The decoder: image embeddings in, text out, streamed piece by piece.
pub trait DecoderStage: Send {
    /// `decoder-cpu`, `decoder-gpu`, ...
    fn name(&self) -> &'static str;
    /// Generates a reply for the image whose embeddings `image` holds, calling `on_text` with
    /// each decoded piece; stops early when `on_text` returns `false`. The embeddings may still
    /// be being written when this is called: read them only after `image.ready`, on the host
    /// ([`EncodedImage::read`]) or in a device queue that waits for it. Every device read of
    /// the buffer is complete when this returns (the ring slot is reused after).
    fn describe(
        &mut self,
        image: EncodedImage<'_>,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<Generation, StageError>;
    /// Fraction of the KV cache's pages in use now.
    fn kv_utilisation(&self) -> f64;
    /// Runs whatever the first replies would otherwise pay for once (pipeline compilation,
    /// program recording) on `image`, before the stream starts. No output is produced.
    fn warm_up(&mut self, image: EncodedImage<'_>) -> Result<(), StageError> {
        let _ = image;
        Ok(())
    }
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
    /// The unified buffers the stages have imported, each once: a frame pool's buffers and the
    /// rings' slots. Shared, so the ISP's write and the encoder's read of a slot go through
    /// one wgpu buffer and wgpu orders them in the queue.
    pub imports: Arc<ImportCache>,
    /// Signalled by the queue at the end of each [`GpuContext::submit_signalled`] batch.
    completion: Arc<sync_timeline::vulkan::VulkanTimeline>,
    /// The last value a submission will signal on `completion`, and what was submitted. Held
    /// across staging the signal and submitting, by every submitter of this queue: a signal
    /// staged on wgpu's queue goes with the next submission, whoever makes it.
    submissions: Arc<std::sync::Mutex<QueueLog>>,
    /// See [`GpuContext::limit_frames_in_flight`].
    in_flight_limit: Arc<std::sync::atomic::AtomicUsize>,
    /// See [`GpuContext::frames_ready_timeline`].
    frames_ready: Arc<std::sync::Mutex<Option<Arc<sync_timeline::vulkan::VulkanTimeline>>>>,
}

/// Imports a [`GpuContext`] keeps: two rings' slots and a source's pool, with room to spare.
const IMPORTS_KEPT: usize = 64;

/// What the GPU stages have submitted, for the in-flight count, the stage latencies and the
/// trace's GPU track.
#[derive(Debug, Default)]
struct QueueLog {
    /// The last value signalled on the completion timeline.
    last: u64,
    /// Submissions not yet seen complete, in submission (and so completion) order.
    open: std::collections::VecDeque<GpuSpan>,
    /// The most frames with GPU work submitted and not complete at once.
    in_flight_max: usize,
    /// Per stage (`isp`, `encoder`), its work's times on the queue (see [`QueueLog::retire`]).
    stages: Vec<StageTimes>,
    /// With tracing on, every completed submission.
    traced: Option<Vec<GpuSpan>>,
    /// When the frames' readiness timeline (ahead-of-time submission) was seen to reach each
    /// value, oldest first: a submission that waited for a frame started then, not when it was
    /// submitted.
    ready_at: std::collections::VecDeque<(u64, Instant)>,
    /// When the last batch of retired submissions was seen complete: the queue runs in order,
    /// so later work started no earlier.
    last_completed: Option<Instant>,
}

/// One stage's work's times on the queue.
#[derive(Debug)]
struct StageTimes {
    stage: &'static str,
    /// Submissions retired so far.
    count: u64,
    /// Milliseconds each, bounded as the chain's latency series are.
    ms: Vec<f64>,
    /// A moving average, for the stage's just-in-time lead.
    recent: crate::chain::demand::Latency,
}

/// Readiness times a log keeps (far more than the frames in flight).
const READY_KEPT: usize = 256;

/// Open submissions a log keeps when nothing retires them (no watcher running): past this,
/// the oldest are retired as complete when the timeline says so.
const OPEN_KEPT: usize = 1024;

impl QueueLog {
    fn stage(&self, stage: &str) -> Option<&StageTimes> {
        self.stages.iter().find(|t| t.stage == stage)
    }

    /// Retires the open submissions the queue has finished (`done` is the timeline's value),
    /// as finished at `now`.
    fn retire(&mut self, done: u64, now: Instant) {
        // Submissions seen complete together all finished by `now`; each started no earlier
        // than the previous batch's end.
        let previous = self.last_completed;
        while self.open.front().is_some_and(|s| s.value <= done) {
            let Some(mut span) = self.open.pop_front() else {
                break;
            };
            span.completed = Some(now);
            // The queue started it no earlier than its submission, the end of the work before
            // it, and for work that waited for its frame, the frame's signal.
            let mut started = span.submitted;
            if let Some(previous) = previous {
                started = started.max(previous);
            }
            if let Some((_, value)) = &span.waits_on
                && let Some(&(_, at)) = self.ready_at.iter().find(|(v, _)| v >= value)
            {
                started = started.max(at);
            }
            self.last_completed = Some(now);
            span.waits_on = None;
            let took = now.saturating_duration_since(started);
            let at = match self.stages.iter().position(|t| t.stage == span.stage) {
                Some(at) => at,
                None => {
                    self.stages.push(StageTimes {
                        stage: span.stage,
                        count: 0,
                        ms: Vec::new(),
                        recent: crate::chain::demand::Latency::default(),
                    });
                    self.stages.len() - 1
                }
            };
            let times = &mut self.stages[at];
            times.count += 1;
            times.recent.add(took);
            crate::chain::record(&mut times.ms, times.count, took.as_secs_f64() * 1e3);
            if let Some(traced) = &mut self.traced {
                traced.push(span);
            }
        }
    }

    /// Frames with a submission whose value is past `done`.
    fn frames_in_flight(&self, done: u64) -> usize {
        let mut frames: Vec<u64> = self
            .open
            .iter()
            .filter(|s| s.value > done)
            .map(|s| s.frame)
            .collect();
        frames.sort_unstable();
        frames.dedup();
        frames.len()
    }
}

/// One GPU submission of a chain stage: from when it was submitted to when the queue was seen
/// to have finished it.
#[derive(Clone, Debug)]
pub struct GpuSpan {
    pub stage: &'static str,
    pub frame: u64,
    /// The completion timeline value it signals.
    pub value: u64,
    pub submitted: Instant,
    pub completed: Option<Instant>,
    /// The timeline and value the submission waited for in the queue (ahead-of-time
    /// submission); the timeline is kept alive while the submission may still wait.
    pub waits_on: Option<(Arc<sync_timeline::vulkan::VulkanTimeline>, u64)>,
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
        let (desc, mut vision_options) = crate::vision_gpu::device_descriptor(&adapter);
        let (device, queue, caps) = uvm_alloc::vulkan::open_wgpu_device(&adapter, &desc)?;
        // The fragment attention where the device's accumulators are laid out for it; where
        // not, the WGSL tensor-core attention runs, as before.
        if vision_options.gemm == crate::vision_gpu::GemmKernel::Coop
            && let Ok(layout) = crate::vision_gpu::fragment_attention_support(&device, &queue)
        {
            vision_options.coop_attention = crate::vision_gpu::CoopAttention::Fragments(layout);
        }
        let completion = sync_timeline::vulkan::VulkanTimeline::from_wgpu(&device, 0)
            .map_err(|e| format!("creating the GPU stages' completion timeline: {e}"))?;
        Ok(GpuContext {
            imports: Arc::new(ImportCache::new(&device, caps, IMPORTS_KEPT)),
            device,
            queue,
            caps,
            vision_options,
            adapter: info.name,
            completion: Arc::new(completion),
            submissions: Arc::new(std::sync::Mutex::new(QueueLog::default())),
            in_flight_limit: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            frames_ready: Arc::new(std::sync::Mutex::new(None)),
        })
    }

    /// The timeline the queue signals as each stage submission finishes.
    pub fn completion_timeline(&self) -> &Arc<sync_timeline::vulkan::VulkanTimeline> {
        &self.completion
    }

    /// Whether `completion` is signalled by this context's queue: work submitted here after it
    /// is ordered after it in the queue, with no host wait.
    pub fn orders_after(&self, completion: &Completion) -> bool {
        match completion {
            Completion::Done => true,
            Completion::Gpu { timeline, .. } => Arc::ptr_eq(timeline, &self.completion),
        }
    }

    /// Starts keeping every submission's span, for the trace's GPU track.
    pub fn trace_submissions(&self) {
        if let Ok(mut log) = self.submissions.lock() {
            log.traced.get_or_insert_with(Vec::new);
        }
    }

    /// Timestamps submissions as the queue finishes them, until `stop` is raised: the thread
    /// that runs this wakes once per completed submission and once per frame signalled ready
    /// for work queued ahead of it (one driver wait on both timelines), and otherwise every
    /// 50 ms to look at `stop`. It is how the chain measures the GPU stages' latencies
    /// ([`GpuContext::latency_ms`]) and draws the trace's GPU track; no stage thread waits for
    /// the GPU.
    pub fn watch_completions(&self, stop: &std::sync::atomic::AtomicBool) {
        use sync_timeline::Timeline;
        let ready = self.frames_ready.lock().ok().and_then(|r| r.clone());
        let mut seen = self.completion.value().unwrap_or(0);
        let mut ready_seen = ready.as_ref().map_or(0, |r| r.value().unwrap_or(0));
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            let mut points = vec![(&*self.completion, seen + 1)];
            if let Some(r) = &ready {
                points.push((&**r, ready_seen + 1));
            }
            match sync_timeline::vulkan::wait_any(&points, Duration::from_millis(50)) {
                Ok(_) => {}
                Err(sync_timeline::Error::Timeout { .. }) => continue,
                // A lost device: the stages report it.
                Err(_) => return,
            }
            let now = Instant::now();
            let Ok(done) = self.completion.value() else {
                return;
            };
            let Ok(mut log) = self.submissions.lock() else {
                return;
            };
            if let Some(r) = &ready
                && let Ok(v) = r.value()
                && v > ready_seen
            {
                ready_seen = v;
                if log.ready_at.len() == READY_KEPT {
                    log.ready_at.pop_front();
                }
                log.ready_at.push_back((v, now));
            }
            log.retire(done, now);
            seen = done;
        }
    }

    /// The timeline a source mirrors its frames' readiness onto, for work queued ahead of a
    /// capture (one per context, made on first use).
    pub fn frames_ready_timeline(
        &self,
    ) -> Result<Arc<sync_timeline::vulkan::VulkanTimeline>, StageError> {
        let mut ready = self
            .frames_ready
            .lock()
            .map_err(|_| "a GPU submitter panicked")?;
        if let Some(r) = &*ready {
            return Ok(Arc::clone(r));
        }
        let r = Arc::new(
            sync_timeline::vulkan::VulkanTimeline::from_wgpu(&self.device, 0)
                .map_err(|e| format!("creating the frames' readiness timeline: {e}"))?,
        );
        *ready = Some(Arc::clone(&r));
        Ok(r)
    }

    /// The most frames that had GPU work submitted and not complete at one time.
    pub fn frames_in_flight_max(&self) -> usize {
        self.submissions.lock().map_or(0, |l| l.in_flight_max)
    }

    /// Milliseconds of `stage`'s work (`isp`, `encoder`) on the queue, per submission retired
    /// so far: from the latest of its submission, the previous work's completion and its
    /// frame's signal, to its completion.
    pub fn latency_ms(&self, stage: &str) -> Vec<f64> {
        self.submissions
            .lock()
            .ok()
            .and_then(|l| l.stage(stage).map(|t| t.ms.clone()))
            .unwrap_or_default()
    }

    /// A moving average of `stage`'s work's time on the queue, once some has completed.
    pub fn recent_latency(&self, stage: &str) -> Option<Duration> {
        self.submissions
            .lock()
            .ok()
            .and_then(|l| l.stage(stage).map(|t| t.recent.get()))
    }

    /// The completed submissions kept since [`GpuContext::trace_submissions`].
    pub fn traced_submissions(&self) -> Vec<GpuSpan> {
        self.submissions
            .lock()
            .ok()
            .and_then(|l| l.traced.clone())
            .unwrap_or_default()
    }

    /// The wgpu buffer over `buffer`, imported once per context.
    ///
    /// # Safety
    /// As [`ImportCache::get`]: no CPU guard of `buffer` may be alive or taken while device work
    /// that uses it may be executing.
    pub unsafe fn import(&self, buffer: &Arc<UnifiedBuffer>) -> Result<wgpu::Buffer, StageError> {
        // SAFETY: the caller's promise, passed on.
        Ok(unsafe { self.imports.get(buffer) }?)
    }

    /// Lets at most `frames` frames have GPU work in flight at once (`--depth`); 0 for no
    /// limit. A stage submitting a new frame's first work beyond it waits for the oldest
    /// frame in flight to complete: room on the GPU, backpressure like room in a ring.
    pub fn limit_frames_in_flight(&self, frames: usize) {
        self.in_flight_limit
            .store(frames, std::sync::atomic::Ordering::Relaxed);
    }

    /// Returns once a new frame may submit work without passing the in-flight limit.
    pub fn wait_for_room(&self) -> Result<(), StageError> {
        self.room_for(u64::MAX).map(|_| ())
    }

    /// The submission log, locked, once `frame` may submit (its frame is in flight already,
    /// or fewer than the limit are), and the completion value read then.
    fn room_for(
        &self,
        frame: u64,
    ) -> Result<(std::sync::MutexGuard<'_, QueueLog>, u64), StageError> {
        use sync_timeline::Timeline;
        let limit = self
            .in_flight_limit
            .load(std::sync::atomic::Ordering::Relaxed);
        let deadline = Instant::now() + GPU_TIMEOUT;
        loop {
            let log = self
                .submissions
                .lock()
                .map_err(|_| "a GPU submitter panicked")?;
            // Read under the lock, so no submission of another thread lands in between.
            let done = self.completion.value()?;
            let open = |s: &&GpuSpan| s.value > done;
            if limit == 0
                || log.open.iter().filter(open).any(|s| s.frame == frame)
                || log.frames_in_flight(done) < limit
            {
                return Ok((log, done));
            }
            // The oldest frame in flight: its last submission so far.
            let oldest = log.open.iter().find(open).map(|s| s.frame);
            let last = log
                .open
                .iter()
                .filter(|s| Some(s.frame) == oldest)
                .map(|s| s.value)
                .max()
                .unwrap_or(done + 1);
            drop(log);
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "no room on the GPU: frames in flight did not complete within {GPU_TIMEOUT:?}"
                )
                .into());
            }
            match self
                .completion
                .wait(last, left.min(Duration::from_millis(50)))
            {
                Ok(()) | Err(sync_timeline::Error::Timeout { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Submits `commands` (stage `stage`'s work on `frame`) plus the host-visibility barrier
    /// with a signal of the next value of the completion timeline on the GPU queue, and returns
    /// at once: the value is reached when the queue has finished the submission.
    ///
    /// With `wait`, the submission waits in the queue for that timeline value first (ahead-of-
    /// time submission: the host signals it once it has written what the work reads), behind a
    /// barrier that makes those host writes visible; the timeline is kept alive until the
    /// submission is seen complete.
    fn submit_signalled(
        &self,
        stage: &'static str,
        frame: u64,
        commands: wgpu::CommandBuffer,
        wait: Option<(Arc<sync_timeline::vulkan::VulkanTimeline>, u64)>,
    ) -> Result<Completion, StageError> {
        let barrier = host_read_barrier(&self.device)?;
        let host_writes = match wait {
            Some(_) => Some(uvm_alloc::vulkan::host_write_barrier(&self.device)?),
            None => None,
        };
        let value = {
            let (mut log, done) = self.room_for(frame)?;
            let value = log.last + 1;
            // Registered first, so the semaphore is not destroyed before the queue signals it.
            self.completion.expect_device_signal(value);
            // SAFETY: the hal queue is only used to stage a semaphore signal (and a wait) for
            // wgpu's next submission (nothing is destroyed, nothing is submitted behind wgpu's
            // back); the signalled semaphore lives in `self.completion`, whose drop waits for the
            // value registered above, and the waited one in the span below. Every submitter of
            // this queue holds `submissions` from staging to submitting, so both go with this
            // submission.
            let hal = unsafe { self.queue.as_hal::<wgpu::hal::api::Vulkan>() }
                .ok_or("the GPU stages run on wgpu's Vulkan backend only")?;
            hal.add_signal_semaphore(self.completion.semaphore(), Some(value));
            if let Some((timeline, ready)) = &wait {
                // Staged like the signal, for the same submission. The timeline outlives the
                // wait: the open span below holds it until the submission is seen complete.
                // Every stage waits, so the host-write barrier at the batch's start is ordered
                // after the host's signal too.
                hal.add_wait_semaphore(
                    timeline.semaphore(),
                    Some(*ready),
                    ash::vk::PipelineStageFlags::ALL_COMMANDS,
                );
            }
            drop(hal);
            match host_writes {
                Some(host_writes) => self.queue.submit([host_writes, commands, barrier]),
                None => self.queue.submit([commands, barrier]),
            };
            log.last = value;
            let now = Instant::now();
            if log.open.len() >= OPEN_KEPT {
                log.retire(done, now);
            }
            log.open.push_back(GpuSpan {
                stage,
                frame,
                value,
                submitted: now,
                completed: None,
                waits_on: wait,
            });
            log.in_flight_max = log.in_flight_max.max(log.frames_in_flight(done));
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

/// The fused ISP on the CPU ([`isp_v4l2::isp::preprocess`]), writing the tensor in place.
///
/// With frames announced ahead of their capture, on a machine with a DRM render node, the
/// source's readiness reaches it as points of a DRM syncobj timeline: it waits for a frame
/// not yet written in the kernel (`DRM_IOCTL_SYNCOBJ_TIMELINE_WAIT`), then reads it.
#[derive(Debug)]
pub struct CpuIsp {
    /// One pass per image the encoder takes (SmolVLM's tiles, then the global view), each
    /// writing its tensor after the previous one's.
    images: Vec<Preprocess>,
    /// The frame size the images' crops were planned for, when there are several.
    planned: Option<(usize, usize)>,
    frames_ready: Option<Arc<sync_timeline::drm::SyncobjTimeline>>,
    /// Frames it took before they were written (and waited for on the syncobj).
    ahead: u64,
}

impl CpuIsp {
    /// One image per frame.
    pub fn new(params: Preprocess) -> CpuIsp {
        CpuIsp {
            images: vec![params],
            planned: None,
            frames_ready: None,
            ahead: 0,
        }
    }

    /// Several images per frame, one pass each, their tensors back to back (the tiles of
    /// [`tile_passes`] for frames of `frame_size`; a frame of another size is refused).
    pub fn with_images(images: Vec<Preprocess>, frame_size: (usize, usize)) -> CpuIsp {
        CpuIsp {
            planned: (images.len() > 1).then_some(frame_size),
            images,
            frames_ready: None,
            ahead: 0,
        }
    }
}

/// The passes for `grid`'s images of frames shaped `desc`: `base` over each tile's crop,
/// then over the whole frame (the global view), in the order the prompt names them.
pub fn tile_passes(
    base: Preprocess,
    grid: isp_v4l2::isp::TileGrid,
    desc: &FrameDesc,
) -> Vec<Preprocess> {
    let whole = isp_v4l2::isp::Crop {
        x: 0,
        y: 0,
        width: desc.width,
        height: desc.height,
    };
    grid.crops(base.crop.unwrap_or(whole))
        .into_iter()
        .map(|crop| Preprocess {
            crop: Some(crop),
            ..base
        })
        .collect()
}

/// Refuses a frame whose size differs from the one a tiled ISP planned its crops for.
fn check_planned(planned: Option<(usize, usize)>, desc: &FrameDesc) -> Result<(), StageError> {
    match planned {
        Some((w, h)) if (w, h) != (desc.width, desc.height) => Err(format!(
            "a {}x{} frame, but the ISP's tiles were planned for {w}x{h} frames (the source \
             changed size mid-stream)",
            desc.width, desc.height
        )
        .into()),
        _ => Ok(()),
    }
}

impl IspStage for CpuIsp {
    fn name(&self) -> &'static str {
        "isp-cpu"
    }

    fn output_bytes(&self) -> usize {
        self.images.iter().map(|p| 3 * p.width * p.height * 4).sum()
    }

    fn frames_ready_timeline(
        &mut self,
    ) -> Result<Option<Arc<dyn sync_timeline::Timeline>>, StageError> {
        // Without a render node the frames are not announced to this ISP (a plain CPU
        // timeline wait would do, but there is nothing to gain over taking written frames).
        let Ok(node) = sync_timeline::drm::RenderNode::discover() else {
            return Ok(None);
        };
        let timeline = Arc::new(
            sync_timeline::drm::SyncobjTimeline::new(Arc::new(node))
                .map_err(|e| format!("creating the frames' syncobj timeline: {e}"))?,
        );
        self.frames_ready = Some(Arc::clone(&timeline));
        Ok(Some(timeline))
    }

    fn frames_submitted_ahead(&self) -> u64 {
        self.ahead
    }

    fn submit(
        &mut self,
        frame: &Frame,
        out: &Arc<UnifiedBuffer>,
    ) -> Result<Completion, StageError> {
        use sync_timeline::Timeline;
        if let Some(ready) = &self.frames_ready
            && ready.value()? < frame.ready
        {
            // Announced and not written yet: wait for the source's signal in the kernel (a
            // wait for input, not for the GPU).
            self.ahead += 1;
            ready
                .wait(frame.ready, GPU_TIMEOUT)
                .map_err(|e| format!("waiting for frame {} on its syncobj: {e}", frame.sequence))?;
        }
        check_planned(self.planned, &frame.desc)?;
        let len = frame.desc.byte_len();
        let input = frame.buffer.cpu_access(0..len, Access::Read)?;
        let mut output = out.cpu_access(0..self.output_bytes(), Access::Write)?;
        let mut rest = output.typed_mut::<f32>()?;
        for p in &self.images {
            let (image, after) = rest.split_at_mut(3 * p.width * p.height);
            isp_v4l2::isp::preprocess(&frame.desc, input.bytes(), p, image)?;
            rest = after;
        }
        Ok(Completion::Done)
    }
}

/// The fused ISP as isp-v4l2's WGSL pass ([`isp_v4l2::gpu::GpuIsp`]): the frame's buffer and
/// the output tensor are both imported into Vulkan as they are, each once.
pub struct GpuIsp {
    gpu: GpuContext,
    /// One pass per image the encoder takes, each writing its tensor after the previous
    /// one's, all in one command buffer.
    passes: Vec<isp_v4l2::gpu::GpuIsp>,
    /// The frame size the images' crops were planned for, when there are several.
    planned: Option<(usize, usize)>,
    /// The timeline its source mirrors frame readiness onto (ahead-of-time submission): a
    /// frame not ready yet is waited for in the queue.
    frames_ready: Option<Arc<sync_timeline::vulkan::VulkanTimeline>>,
    /// Frames whose work was submitted before the frame was written.
    ahead: u64,
}

impl std::fmt::Debug for GpuIsp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuIsp")
            .field("adapter", &self.gpu.adapter)
            .field("passes", &self.passes)
            .finish_non_exhaustive()
    }
}

impl GpuIsp {
    /// One image per frame.
    pub fn new(gpu: GpuContext, params: Preprocess) -> GpuIsp {
        GpuIsp::with_images(gpu, vec![params], (0, 0))
    }

    /// Several images per frame, one pass each, sharing one compiled pipeline (the tiles of
    /// [`tile_passes`] for frames of `frame_size`; a frame of another size is refused).
    ///
    /// # Panics
    /// When `images` is empty.
    pub fn with_images(
        gpu: GpuContext,
        images: Vec<Preprocess>,
        frame_size: (usize, usize),
    ) -> GpuIsp {
        let first = isp_v4l2::gpu::GpuIsp::new(&gpu.device, images[0], isp_v4l2::gpu::Elem::F32);
        let planned = (images.len() > 1).then_some(frame_size);
        let passes = images.iter().map(|p| first.with_params(*p)).collect();
        GpuIsp {
            gpu,
            passes,
            planned,
            frames_ready: None,
            ahead: 0,
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
        self.passes.iter().map(|p| p.output_bytes()).sum()
    }

    fn gpu(&self) -> Option<&GpuContext> {
        Some(&self.gpu)
    }

    fn frames_ready_timeline(
        &mut self,
    ) -> Result<Option<Arc<dyn sync_timeline::Timeline>>, StageError> {
        let timeline = self.gpu.frames_ready_timeline()?;
        self.frames_ready = Some(Arc::clone(&timeline));
        Ok(Some(timeline))
    }

    fn frames_submitted_ahead(&self) -> u64 {
        self.ahead
    }

    fn submit(
        &mut self,
        frame: &Frame,
        out: &Arc<UnifiedBuffer>,
    ) -> Result<Completion, StageError> {
        // SAFETY: a source writes a frame (under its own guard, dropped) before delivering it,
        // or, for a frame announced ahead, before it signals the readiness value the pass
        // waits for in the queue; it refills the buffer only once the frame's lease is free,
        // which the registration below holds until the pass is done.
        let input = unsafe { self.gpu.import(&frame.buffer) }?;
        // SAFETY: the output slot is the ISP's until it publishes it, and its reader (the
        // encoder, on this queue, or a CPU stage after the completion value) touches it only
        // after the pass.
        let output = unsafe { self.gpu.import(out) }?;
        check_planned(self.planned, &frame.desc)?;
        let mut encoder = self.gpu.device.create_command_encoder(&Default::default());
        let mut offset = 0;
        for pass in &mut self.passes {
            pass.record_at(&mut encoder, &frame.desc, &input, &output, offset)?;
            offset += pass.output_bytes() as u64;
        }
        // A frame announced before its capture: the queue waits for its readiness value.
        let wait = match &self.frames_ready {
            Some(t) if sync_timeline::Timeline::value(&**t)? < frame.ready => {
                Some((Arc::clone(t), frame.ready))
            }
            _ => None,
        };
        self.ahead += u64::from(wait.is_some());
        let done = self
            .gpu
            .submit_signalled("isp", frame.sequence, encoder.finish(), wait)?;
        if let Some((timeline, value)) = done.timeline_value() {
            frame.lease.release_after(timeline, value);
        }
        Ok(done)
    }
}

/// The SigLIP tower and connector on the CPU ([`VisionEncoder`]).
#[derive(Debug)]
pub struct CpuEncoder {
    encoder: VisionEncoder,
    images: usize,
    /// Times it blocked waiting for a GPU ISP's output.
    host_waits: u64,
}

impl CpuEncoder {
    /// One image per frame.
    pub fn new(encoder: VisionEncoder) -> CpuEncoder {
        CpuEncoder::with_images(encoder, 1)
    }

    /// `images` images per frame (at least one), encoded one after another.
    pub fn with_images(encoder: VisionEncoder, images: usize) -> CpuEncoder {
        CpuEncoder {
            encoder,
            images: images.max(1),
            host_waits: 0,
        }
    }
}

impl EncoderStage for CpuEncoder {
    fn name(&self) -> &'static str {
        "encoder-cpu"
    }

    fn config(&self) -> &crate::vision::VisionConfig {
        self.encoder.config()
    }

    fn host_waits(&self) -> u64 {
        self.host_waits
    }

    fn images(&self) -> usize {
        self.images
    }

    fn submit(
        &mut self,
        _frame: u64,
        pixels: &Arc<UnifiedBuffer>,
        pixels_ready: &Completion,
        out: &Arc<UnifiedBuffer>,
    ) -> Result<Completion, StageError> {
        self.host_waits += u64::from(pixels_ready.wait(GPU_TIMEOUT)?);
        let s = self.image_size();
        let per_input = 3 * s * s;
        let per_output = self.image_tokens() * self.text_hidden();
        let input = pixels.cpu_access(0..per_input * self.images * 4, Access::Read)?;
        let mut output = out.cpu_access(0..per_output * self.images * 4, Access::Write)?;
        let (input, output) = (input.typed::<f32>()?, output.typed_mut::<f32>()?);
        for (image, rows) in input
            .chunks_exact(per_input)
            .zip(output.chunks_exact_mut(per_output))
        {
            let result = self.encoder.encode(image)?;
            // The CPU encoder builds its result in a heap vector: moving it into the ring's
            // buffer is a real copy, and the ledger says so.
            CopyLedger::global()
                .stage("encoder-cpu-output")
                .copy(rows, &result)?;
        }
        Ok(Completion::Done)
    }
}

/// The WGSL encoder ([`GpuVisionEncoder`]): reads the ISP's tensor and writes the embeddings in
/// the ring's unified buffers, one command buffer per image.
pub struct GpuEncoder {
    gpu: GpuContext,
    encoder: GpuVisionEncoder,
    /// Times it blocked waiting for an ISP on another engine.
    host_waits: u64,
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
        GpuEncoder::with_images(gpu, cpu, 1)
    }

    /// Encodes `images` images per frame in one submission
    /// ([`GpuVisionEncoder::with_batch`]).
    pub fn with_images(
        gpu: GpuContext,
        cpu: &VisionEncoder,
        images: usize,
    ) -> Result<GpuEncoder, StageError> {
        let encoder = GpuVisionEncoder::with_batch(&gpu.device, cpu, gpu.vision_options, images)?;
        Ok(GpuEncoder {
            gpu,
            encoder,
            host_waits: 0,
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

    fn host_waits(&self) -> u64 {
        self.host_waits
    }

    fn images(&self) -> usize {
        self.encoder.batch()
    }

    fn gpu(&self) -> Option<&GpuContext> {
        Some(&self.gpu)
    }

    fn submit(
        &mut self,
        frame: u64,
        pixels: &Arc<UnifiedBuffer>,
        pixels_ready: &Completion,
        out: &Arc<UnifiedBuffer>,
    ) -> Result<Completion, StageError> {
        // Work on this queue is ordered after the ISP's in the queue (wgpu records the barrier
        // between the ISP's write and this read of the one import of the slot); anything else
        // is waited for here.
        if !self.gpu.orders_after(pixels_ready) {
            self.host_waits += u64::from(pixels_ready.wait(GPU_TIMEOUT)?);
        }
        // SAFETY: the input slot stays the encoder's until the returned completion (the chain
        // releases it with that value).
        let input = unsafe { self.gpu.import(pixels) }?;
        // SAFETY: the output slot is only read on the CPU after the returned completion.
        let output = unsafe { self.gpu.import(out) }?;
        let mut encoder = self.gpu.device.create_command_encoder(&Default::default());
        self.encoder
            .record(&self.gpu.device, &mut encoder, &input, &output)
            .map_err(|e| e.to_string())?;
        self.gpu
            .submit_signalled("encoder", frame, encoder.finish(), None)
    }
}

/// Stands for the image in a prompt's text until it is split around it.
const IMAGE_MARK: &str = "\u{1}IMAGE\u{1}";

/// What the encoder gives the prompt for each frame: the images of `grid` (its tiles, then the
/// global view; one image when the frame is not split), `tokens` embedding rows each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageShape {
    pub grid: isp_v4l2::isp::TileGrid,
    pub tokens: usize,
}

impl ImageShape {
    /// One image of `tokens` rows, not split.
    pub fn single(tokens: usize) -> ImageShape {
        ImageShape {
            grid: isp_v4l2::isp::TileGrid { rows: 0, cols: 0 },
            tokens,
        }
    }

    /// Embedding rows the encoder writes per frame.
    pub fn rows(&self) -> usize {
        self.grid.images() * self.tokens
    }
}

/// Where the image goes in the prompt: `before`, then the image's positions `image`, then
/// `after`. The encoder's rows replace the positions of `image` that `runs` name (all of them
/// when `runs` is empty); between the runs of a split image stand the tokens SmolVLM's
/// processor puts around each tile.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptLayout {
    pub before: Vec<u32>,
    pub image: Vec<u32>,
    pub runs: Vec<crate::decoder::SpliceRun>,
    pub after: Vec<u32>,
}

impl PromptLayout {
    /// Lays out `prompt` with an image shaped `shape` as SmolVLM's processor does when the
    /// tokenizer has its image tokens: before the text, for one image,
    /// `<fake_token_around_image><global-img><image>*N<fake_token_around_image>`; for a split
    /// one, each tile as `<fake_token_around_image><row_R_col_C><image>*N`, a newline after
    /// each row of tiles, then a newline and the global view as for one image. Without those
    /// tokens the image rows stand straight before the text, all images' rows in one run.
    /// With `chat`, the user turn goes through the model's chat template.
    pub fn new(
        tokenizer: &Tokenizer,
        prompt: &str,
        shape: ImageShape,
        chat: bool,
        add_bos: bool,
    ) -> Result<PromptLayout, StageError> {
        let user = format!("{IMAGE_MARK}{prompt}");
        let text = match (chat, tokenizer.chat_template()) {
            (true, Some(_)) => tokenizer.apply_chat_template(&[("user", user.as_str())], true)?,
            _ => user,
        };
        PromptLayout::from_text(tokenizer, &text, shape, add_bos)
    }

    /// The layout of the same question about a later image in one running conversation
    /// (`keep_context`): what follows a reply, from the end of the assistant's turn to the next
    /// generation prompt, as the chat template renders a second turn (no BOS); without a
    /// template, the question on a new line.
    pub fn next_turn(
        tokenizer: &Tokenizer,
        prompt: &str,
        shape: ImageShape,
        chat: bool,
    ) -> Result<PromptLayout, StageError> {
        const REPLY: &str = "\u{2}REPLY\u{2}";
        let user = format!("{IMAGE_MARK}{prompt}");
        let text = match (chat, tokenizer.chat_template()) {
            (true, Some(_)) => {
                let turns = [
                    ("user", user.as_str()),
                    ("assistant", REPLY),
                    ("user", user.as_str()),
                ];
                let all = tokenizer.apply_chat_template(&turns, true)?;
                all.split_once(REPLY)
                    .map(|(_, rest)| rest.to_string())
                    .ok_or("the chat template dropped the assistant's message")?
            }
            _ => format!("\n{user}"),
        };
        PromptLayout::from_text(tokenizer, &text, shape, false)
    }

    /// `text` with the image mark where the image goes.
    fn from_text(
        tokenizer: &Tokenizer,
        text: &str,
        shape: ImageShape,
        add_bos: bool,
    ) -> Result<PromptLayout, StageError> {
        const FAKE: &str = "<fake_token_around_image>";
        const GLOBAL: &str = "<global-img>";
        const IMAGE: &str = "<image>";
        let (a, b) = text
            .split_once(IMAGE_MARK)
            .ok_or("the chat template dropped the user's message")?;
        let id = |t: &str| tokenizer.token_to_id(t);
        let (Some(_), Some(_), Some(image)) = (id(FAKE), id(GLOBAL), id(IMAGE)) else {
            // No SmolVLM image tokens: the rows straight before the text, as one run.
            let before = tokenizer.encode(a, add_bos)?;
            let after = tokenizer.encode(b, false)?;
            let placeholder = id(IMAGE)
                .or(tokenizer.bos_id())
                .or(tokenizer.eos_id())
                .unwrap_or(0);
            return Ok(PromptLayout {
                before,
                image: vec![placeholder; shape.rows()],
                runs: Vec::new(),
                after,
            });
        };
        // SmolVLM's processor's text for the image (transformers' `_prompt_split_image` and
        // `_prompt_single_image`), tokenized with the text around it as the processor's
        // caller tokenizes the whole prompt.
        let n = shape.tokens;
        let images = IMAGE.repeat(n);
        let mut expanded = String::new();
        let grid = shape.grid;
        for r in 1..=grid.rows {
            for c in 1..=grid.cols {
                let tile = format!("<row_{r}_col_{c}>");
                if id(&tile).is_none() {
                    return Err(format!(
                        "the tokenizer has no {tile} token for a {}x{} grid of tiles: use \
                         fewer tiles (the model's vocabulary names the tiles it was trained on)",
                        grid.rows, grid.cols
                    )
                    .into());
                }
                expanded.push_str(FAKE);
                expanded.push_str(&tile);
                expanded.push_str(&images);
            }
            expanded.push('\n');
        }
        if grid.tiles() > 0 {
            expanded.push('\n');
        }
        expanded.push_str(FAKE);
        expanded.push_str(GLOBAL);
        expanded.push_str(&images);
        expanded.push_str(FAKE);
        if a.contains(IMAGE) || b.contains(IMAGE) {
            return Err(format!(
                "the prompt's text holds {IMAGE} itself; the image's tokens are placed for it"
            )
            .into());
        }
        let ids = tokenizer.encode(&format!("{a}{expanded}{b}"), add_bos)?;
        let first = ids.iter().position(|&t| t == image);
        let last = ids.iter().rposition(|&t| t == image);
        let (Some(first), Some(last)) = (first, last) else {
            return Err(format!("{IMAGE} did not encode to its one id").into());
        };
        let mut runs: Vec<crate::decoder::SpliceRun> = Vec::new();
        for (at, &t) in ids[first..=last].iter().enumerate() {
            match runs.last_mut() {
                _ if t != image => {}
                Some(run) if run.at + run.rows == at => run.rows += 1,
                _ => runs.push(crate::decoder::SpliceRun { at, rows: 1 }),
            }
        }
        if runs.len() != grid.images() || runs.iter().any(|r| r.rows != n) {
            return Err(format!(
                "the prompt's image tokens encoded to runs of {:?} rows, not {} runs of {n}",
                runs.iter().map(|r| r.rows).collect::<Vec<_>>(),
                grid.images()
            )
            .into());
        }
        if runs.len() == 1 {
            runs.clear();
        }
        Ok(PromptLayout {
            before: ids[..first].to_vec(),
            image: ids[first..=last].to_vec(),
            runs,
            after: ids[last + 1..].to_vec(),
        })
    }

    /// The whole token sequence and where the image starts.
    pub fn tokens(&self) -> (Vec<u32>, usize) {
        let t = [self.before.as_slice(), &self.image, &self.after].concat();
        (t, self.before.len())
    }
}

/// The decoder on an npu-hal device, sampling on the CPU.
///
/// Across frames it keeps what a stream repeats: the prompt's text before the image is
/// prefilled once and then taken from the KV prefix cache; with a drafter, each reply is
/// drafted from its own text and the previous replies; with image reuse (`skip_similar`), a
/// frame the encoder found unchanged is described from the last image's pinned K/V, with no
/// embeddings and no prefill of the image.
pub struct NpuDecoder {
    decoder: Decoder,
    tokenizer: Tokenizer,
    layout: PromptLayout,
    sampling: SamplingParams,
    max_tokens: usize,
    grammar: Option<crate::grammar::Grammar>,
    drafter: Option<(Box<dyn crate::speculative::Drafter + Send>, usize)>,
    reuse: Option<ImageReuse>,
    conversation: Option<Conversation>,
    images: u64,
}

/// One conversation across frames ([`NpuDecoder::with_kept_context`]).
#[derive(Debug)]
struct Conversation {
    /// The turn about each later image.
    next: PromptLayout,
    /// The last reply's tokens the decoder did not feed (the one sampled when the reply hit
    /// its length): they open the next turn.
    unfed: Vec<u32>,
}

impl std::fmt::Debug for NpuDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NpuDecoder")
            .field("decoder", &self.decoder)
            .field("layout", &self.layout)
            .field("max_tokens", &self.max_tokens)
            .field("drafter", &self.drafter)
            .field("image_reuse", &self.reuse.is_some())
            .finish_non_exhaustive()
    }
}

impl NpuDecoder {
    /// A decoder stage answering `layout`'s prompt for each image, `max_tokens` at most,
    /// optionally constrained by `grammar`. The prompt's prefix is reused across frames.
    pub fn new(
        mut decoder: Decoder,
        tokenizer: Tokenizer,
        layout: PromptLayout,
        sampling: SamplingParams,
        max_tokens: usize,
        grammar: Option<crate::grammar::Grammar>,
    ) -> NpuDecoder {
        decoder.set_prefix_reuse(true);
        NpuDecoder {
            decoder,
            tokenizer,
            layout,
            sampling,
            max_tokens,
            grammar,
            drafter: None,
            reuse: None,
            conversation: None,
            images: 0,
        }
    }

    /// Drafts up to `tokens` tokens per step with `drafter`, which also remembers each reply.
    pub fn with_drafter(
        mut self,
        drafter: Box<dyn crate::speculative::Drafter + Send>,
        tokens: usize,
    ) -> NpuDecoder {
        self.drafter = Some((drafter, tokens));
        self
    }

    /// Describes every frame in one running conversation: each image and question comes as
    /// the next turn (`next`, [`PromptLayout::next_turn`]) after the replies before it, so the
    /// replies see the earlier frames. With a KV budget ([`Decoder::set_pruning`]) the cache
    /// stays within it however long the stream runs; the conversation starts over only when a
    /// reply might not fit the context's positions.
    pub fn with_kept_context(mut self, next: PromptLayout) -> NpuDecoder {
        self.conversation = Some(Conversation {
            next,
            unfed: Vec::new(),
        });
        self
    }

    /// Keeps each image's K/V pinned in the cache (and the rows past its last whole page), so
    /// an image the encoder found unchanged ([`EncodedImage::unchanged`], `skip_similar`) is
    /// described from them without its embeddings.
    pub fn with_image_reuse(mut self) -> NpuDecoder {
        self.reuse = Some(ImageReuse::default());
        self
    }
}

/// What [`NpuDecoder::with_image_reuse`] keeps of the last encoded image.
#[derive(Debug, Default)]
struct ImageReuse {
    /// Its prefix-cache key, once an image was described.
    key: Option<u64>,
    /// The first row past the pinned pages (or the image's first row when nothing is pinned),
    /// and the image rows from there on: at most a page's worth, copied (and counted).
    tail_from: usize,
    tail: Vec<f32>,
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
        image: EncodedImage<'_>,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<Generation, StageError> {
        // A running conversation goes on with the next turn, after what the last reply left
        // unfed; it starts over when the next reply might not fit the context.
        let start_len = self.decoder.len();
        let mut context_restarted = false;
        let continues = match self.conversation.as_mut() {
            Some(c) if start_len > 0 => {
                let n = &c.next;
                let turn = c.unfed.len() + n.before.len() + n.image.len() + n.after.len();
                let fits = start_len + turn + self.max_tokens <= self.decoder.options().ctx;
                if !fits {
                    c.unfed.clear();
                    context_restarted = true;
                }
                fits
            }
            _ => false,
        };
        let (tokens, first, runs) = match self.conversation.as_ref().filter(|_| continues) {
            Some(c) => {
                let (turn, first) = c.next.tokens();
                let runs = c.next.runs.as_slice();
                (
                    [c.unfed.as_slice(), &turn].concat(),
                    c.unfed.len() + first,
                    runs,
                )
            }
            None => {
                let (tokens, first) = self.layout.tokens();
                (tokens, first, self.layout.runs.as_slice())
            }
        };
        let hidden = self.decoder.config().hidden;
        // The repetition penalty and the drafts look at text, not at the image placeholders.
        let mut history: Vec<u32> = self.layout.before.clone();
        history.extend_from_slice(&self.layout.after);
        let ready = image.ready.timeline_value();
        let mut host_waited = false;
        let splice = match (&self.reuse, image.unchanged) {
            (
                Some(ImageReuse {
                    key: Some(key),
                    tail_from,
                    tail,
                }),
                true,
            ) if runs.is_empty() => {
                // The image's pinned pages come from the cache, the rows after them from the
                // kept tail: nothing of the image is read or prefilled.
                crate::decoder::Splice {
                    key_from: first,
                    start: *tail_from,
                    data: npu_hal::EmbeddingData::Host(tail),
                    key: *key,
                    ready: None,
                    runs: &[],
                }
            }
            (Some(_), true) => {
                return Err("image reuse takes an image in one piece, not split into tiles".into());
            }
            (_, true) => {
                return Err(
                    "an unchanged frame with no image described before it to reuse (the \
                     encoder's skip_similar needs the decoder's image reuse)"
                        .into(),
                );
            }
            (_, false) => {
                self.images += 1;
                if self.reuse.is_some() {
                    // The last image's pages may go: this one replaces them.
                    self.decoder.unpin()?;
                }
                // The decoder's device reads the rows in place. It waits for the encoder in
                // its own queue where it can (a GPU decoder importing the encoder's timeline);
                // else here, once: the handoff's one host wait.
                let in_queue = ready
                    .as_ref()
                    .is_some_and(|(t, _)| self.decoder.device().waits_in_queue(&**t));
                if !in_queue {
                    host_waited = image.ready.wait(GPU_TIMEOUT)?;
                }
                crate::decoder::Splice {
                    key_from: first,
                    start: first,
                    data: npu_hal::EmbeddingData::Unified {
                        buffer: image.buffer,
                        offset: 0,
                        len: image.len,
                    },
                    key: self.images,
                    ready: ready
                        .as_ref()
                        .filter(|_| in_queue)
                        .map(|(t, v)| (&**t as &dyn sync_timeline::Timeline, *v)),
                    runs,
                }
            }
        };
        let key = splice.key;
        let prompt = crate::llm::Prompt {
            tokens: &tokens,
            splice: Some(splice),
            history: Some(&history),
            pin: self.reuse.is_some(),
            continues,
        };
        let mut stream = self.tokenizer.stream_decoder();
        let mut text_error = None;
        let mut reply_tokens = Vec::new();
        let speculation = self
            .drafter
            .as_mut()
            .map(|(drafter, k)| crate::llm::Speculation {
                drafter: &mut **drafter as &mut dyn crate::speculative::Drafter,
                control: crate::speculative::DraftControl::new(
                    *k,
                    crate::speculative::CPU_ROW_COST,
                ),
            });
        let stats = crate::llm::generate_from(
            &mut self.decoder,
            prompt,
            self.max_tokens,
            self.sampling.clone(),
            self.tokenizer.stop_ids(),
            self.grammar.as_ref(),
            speculation,
            |t| {
                reply_tokens.push(t);
                match stream.push(t) {
                    Ok(piece) => on_text(&piece),
                    Err(e) => {
                        text_error = Some(e);
                        false
                    }
                }
            },
        )?;
        if let Some(e) = text_error {
            return Err(e.into());
        }
        let rest = stream.finish()?;
        if !rest.is_empty() {
            on_text(&rest);
        }
        if let Some((drafter, _)) = self.drafter.as_mut() {
            drafter.remember(&reply_tokens);
        }
        if let Some(c) = self.conversation.as_mut() {
            // The token sampled last is not fed when the reply ends at its length.
            let fed_from = if continues { start_len } else { 0 };
            let expected = fed_from + tokens.len() + reply_tokens.len();
            let missing = expected.saturating_sub(self.decoder.len());
            c.unfed.clear();
            c.unfed
                .extend_from_slice(&reply_tokens[reply_tokens.len().saturating_sub(missing)..]);
        }
        if let Some(reuse) = self.reuse.as_mut().filter(|_| !image.unchanged) {
            // The rows past the pinned pages (a page at most, or the whole image when pruning
            // left nothing pinned), for the next unchanged frame. The device is done with the
            // buffer and the encoder's value was reached, so the read blocks nothing.
            let rows = image.len / hidden;
            let tail_from = self.decoder.pinned().clamp(first, first + rows);
            let ((), _) = image.read(|values| {
                reuse.tail.clear();
                reuse
                    .tail
                    .extend_from_slice(&values[(tail_from - first) * hidden..]);
            })?;
            uvm_alloc::CopyLedger::global()
                .stage("image-reuse-tail")
                .record(std::mem::size_of_val(reuse.tail.as_slice()));
            (reuse.key, reuse.tail_from) = (Some(key), tail_from);
        }
        Ok(Generation {
            stats,
            image_reused: image.unchanged,
            host_waited,
            kv_tokens: self.decoder.cached_len(),
            context_restarted,
        })
    }

    fn kv_utilisation(&self) -> f64 {
        let m = self.decoder.kv().manager();
        1.0 - m.available_blocks() as f64 / m.total_blocks().max(1) as f64
    }

    /// Two short replies: the first prefills the whole prompt, the second finds its text
    /// prefix cached and prefills from the image on (another batch shape), and both decode a
    /// step, so a GPU decoder has compiled and recorded those programs before the first frame
    /// (on the H200 the first reply that found the prefix cached stalled about 1.5 s without
    /// this). Drafting is off meanwhile and nothing of the warm-up is remembered.
    fn warm_up(&mut self, image: EncodedImage<'_>) -> Result<(), StageError> {
        let (max_tokens, drafter) = (self.max_tokens, self.drafter.take());
        self.max_tokens = max_tokens.min(2);
        let result = (0..2).try_for_each(|_| self.describe(image, &mut |_| true).map(|_| ()));
        (self.max_tokens, self.drafter) = (max_tokens, drafter);
        if let Some(reuse) = self.reuse.as_mut() {
            *reuse = ImageReuse::default();
            self.decoder.unpin()?;
        }
        if let Some(c) = self.conversation.as_mut() {
            // The stream's conversation starts with its first frame.
            c.unfed.clear();
            self.decoder.reset()?;
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny_smolvlm_tokenizer() -> Tokenizer {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/tiny-smolvlm/tokenizer/tokenizer.json");
        Tokenizer::from_file(&path).unwrap()
    }

    /// One image is laid out as before tiles existed: the text, `<fake_token_around_image>
    /// <global-img>`, the image rows, `<fake_token_around_image>`, the text.
    #[test]
    fn one_image_is_laid_out_as_smolvlms_processor_does() {
        let t = tiny_smolvlm_tokenizer();
        let id = |s: &str| t.token_to_id(s).unwrap();
        let layout = PromptLayout::new(&t, "Hi?", ImageShape::single(3), false, true).unwrap();
        let mut before = t.encode("", true).unwrap();
        before.extend([id("<fake_token_around_image>"), id("<global-img>")]);
        assert_eq!(layout.before, before);
        assert_eq!(layout.image, [id("<image>"); 3]);
        assert!(layout.runs.is_empty());
        let mut after = vec![id("<fake_token_around_image>")];
        after.extend(t.encode("Hi?", false).unwrap());
        assert_eq!(layout.after, after);
    }

    /// A frame split 2 x 3: transformers' `_prompt_split_image` text, the tiles row-major with
    /// their names, a newline after each row, a newline, then the global view; the encoder's
    /// rows go at the `<image>` runs, in the encoder's order.
    #[test]
    fn a_split_frame_is_laid_out_as_smolvlms_processor_does() {
        let t = tiny_smolvlm_tokenizer();
        let shape = ImageShape {
            grid: isp_v4l2::isp::TileGrid { rows: 2, cols: 3 },
            tokens: 4,
        };
        let layout = PromptLayout::new(&t, "Hi?", shape, true, true).unwrap();
        let image = "<image>".repeat(4);
        let mut text = String::new();
        for r in 1..=2 {
            for c in 1..=3 {
                text += &format!("<fake_token_around_image><row_{r}_col_{c}>{image}");
            }
            text += "\n";
        }
        text += &format!("\n<fake_token_around_image><global-img>{image}<fake_token_around_image>");
        let chat = t
            .apply_chat_template(&[("user", &format!("{text}Hi?"))], true)
            .unwrap();
        let (tokens, first) = layout.tokens();
        assert_eq!(tokens, t.encode(&chat, true).unwrap());
        let image_id = t.token_to_id("<image>").unwrap();
        assert_eq!(tokens[first], image_id);
        // Between tiles of a row: `<fake><row_r_col_c>` (2 tokens); after a row, "\n" too
        // (no merges in this vocabulary); before the global view, "\n\n<fake><global-img>".
        let at: Vec<usize> = layout.runs.iter().map(|r| r.at).collect();
        assert_eq!(at, [0, 6, 12, 19, 25, 31, 39]);
        assert!(layout.runs.iter().all(|r| r.rows == 4));
        assert_eq!(layout.image.len(), 43);
        assert_eq!(
            layout.after[0],
            t.token_to_id("<fake_token_around_image>").unwrap()
        );
        // A grid the vocabulary has no names for is refused by name.
        let big = ImageShape {
            grid: isp_v4l2::isp::TileGrid { rows: 7, cols: 1 },
            tokens: 4,
        };
        let err = PromptLayout::new(&t, "Hi?", big, true, true).unwrap_err();
        assert!(err.to_string().contains("<row_7_col_1>"), "{err}");
        // So is a prompt that holds `<image>` itself.
        let err = PromptLayout::new(&t, "<image>?", shape, true, true).unwrap_err();
        assert!(err.to_string().contains("holds <image>"), "{err}");
    }

    fn span(stage: &'static str, frame: u64, value: u64, submitted: Instant) -> GpuSpan {
        GpuSpan {
            stage,
            frame,
            value,
            submitted,
            completed: None,
            waits_on: None,
        }
    }

    /// Frames in flight count frames, not submissions; a stage's time on the queue starts no
    /// earlier than the previous batch's end, and never reads as zero for work seen complete
    /// together with the work before it.
    #[test]
    fn the_queue_log_counts_frames_in_flight_and_times_work_on_the_queue() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut log = QueueLog::default();
        log.open.push_back(span("isp", 0, 1, ms(0)));
        log.open.push_back(span("encoder", 0, 2, ms(1)));
        log.open.push_back(span("isp", 1, 3, ms(2)));
        assert_eq!(log.frames_in_flight(0), 2);
        assert_eq!(log.frames_in_flight(2), 1, "frame 0's work is done");
        // The ISP's and the encoder's work on frame 0 are seen complete together at 10 ms.
        log.retire(2, ms(10));
        assert_eq!(log.open.len(), 1);
        let series = |log: &QueueLog, stage: &str| log.stage(stage).unwrap().ms.clone();
        assert_eq!(series(&log, "isp"), [10.0]);
        assert_eq!(series(&log, "encoder"), [9.0]);
        // Frame 1's ISP work, submitted at 2 ms, started on the queue at 10 ms at the earliest.
        log.retire(3, ms(13));
        assert_eq!(series(&log, "isp"), [10.0, 3.0]);
        assert_eq!(log.frames_in_flight(3), 0);
    }
}
