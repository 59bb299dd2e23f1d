//! The chain: frame source -> ISP -> vision encoder -> decoder, each stage on its own worker,
//! running ahead of the next through rings of unified buffers handed off by timeline values.
//!
//! ```text
//!  source thread      isp thread            encoder thread          calling thread
//!  next_frame() --> [frames ring] --> isp --> [pixels ring] --> encode --> [embeddings ring] --> describe
//!                   (source's own           (tensors in unified     (embeddings in unified
//!                    buffers)                buffers, depth D)       buffers, depth D)
//! ```
//!
//! While frame N is being decoded, frame N+1 is encoded and N+2 preprocessed: each ring lets
//! its producer run `depth` items ahead ([`sync_timeline::ring`]). A stage's output tensor is
//! written where the next stage reads it (the same unified buffer, imported into Vulkan once
//! when a GPU stage touches it), so the per-frame copy count is what the copy ledger says: zero
//! on the GPU path over unified memory.
//!
//! Completion: the ISP and the encoder publish their output as soon as its work is submitted,
//! with a [`Completion`]: on a GPU, a value of a Vulkan timeline semaphore that the queue
//! signals when the submission finishes. The GPU encoder runs behind the GPU ISP in the same
//! queue; the decoder waits on the encoder's value before reading the embeddings. A slot whose
//! reader's device work is still running goes back to its producer released after that work's
//! value, and a frame's buffer back to its source through the frame's lease, so no stage thread
//! blocks on the GPU. At most `depth` frames have GPU work in flight.
//!
//! Backpressure: a live source (a camera, or a pattern paced in real time) never waits. Its
//! rings are latest-wins: a producer replaces the oldest item not yet taken, and every consumer
//! takes the newest, each drop counted. Upstream of a slow stage, producers work just in time
//! for its next take (the `demand` module). A file source blocks instead, so every sampled frame is
//! decoded.
//!
//! Shutdown: the source ending (or `stop`, raised by Ctrl-C) closes the first ring; each stage
//! drains what it received and closes its own output, so frames already encoded are still
//! decoded unless `stop` is up. A failing stage drops its rings, which ends the stream
//! downstream after the items it had published and tells upstream nobody reads any more; the
//! failure comes back in [`RunReport::failure`] next to the statistics of everything that did
//! complete.

pub mod builder;
pub(crate) mod demand;
pub(crate) mod prefill_first;
#[allow(unsafe_code)]
pub mod stages;
pub mod trace;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use isp_v4l2::{Frame, FrameSource};
use uvm_alloc::{Access, Allocator, AllocatorDesc, BackendKind, CopyLedger, UnifiedBuffer};

use sync_timeline::ring::{self, Ended};
use sync_timeline::{CpuTimeline, Timeline};

/// The chain's rings: items of `T`, each slot with a unified buffer (or none).
type Producer<T> = ring::Producer<T, Arc<UnifiedBuffer>>;
type Consumer<T> = ring::Consumer<T, Arc<UnifiedBuffer>>;
pub use stages::{
    Completion, CpuEncoder, CpuIsp, DecoderStage, EncodedImage, EncoderStage, GPU_TIMEOUT,
    Generation, GpuContext, GpuEncoder, GpuIsp, GpuSpan, ImageShape, IspStage, NpuDecoder,
    PromptLayout, StageError, tile_passes,
};
use trace::TraceLog;

/// The stages of one chain, as trait objects.
pub struct Chain {
    pub source: Box<dyn FrameSource>,
    pub isp: Box<dyn IspStage>,
    pub encoder: Box<dyn EncoderStage>,
    pub decoder: Box<dyn DecoderStage>,
}

impl std::fmt::Debug for Chain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chain")
            .field("source", &self.source.desc())
            .field("isp", &self.isp.name())
            .field("encoder", &self.encoder.name())
            .field("decoder", &self.decoder.name())
            .finish()
    }
}

/// How the chain runs.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Take every `every`-th frame of the source (1 = all); the others are skipped, not dropped.
    pub every: u64,
    /// Stop after this many frames have come from the source.
    pub max_frames: Option<u64>,
    /// Slots per ring (how far a stage may run ahead of the next).
    pub depth: usize,
    /// Latest frame wins (drop and count older frames) instead of blocking the source.
    pub live: bool,
    /// Record trace events.
    pub trace: bool,
    /// Submit a frame's GPU work before the frame is captured, waiting in the queue for the
    /// source's signal, where the source and the ISP can (ahead-of-time submission). Off by
    /// default: it measured no faster on the H200 and slower on lavapipe (README).
    pub ahead: bool,
    /// Skip encoding a frame whose ISP output differs from the last encoded frame's by at most
    /// this relative RMS difference (over every 64th value, read in place once the ISP is
    /// done): the decoder then describes it from the last image's pinned K/V. The decoder stage
    /// must keep them ([`NpuDecoder::with_image_reuse`]).
    pub skip_similar: Option<f32>,
    /// Hold the encoder while the decoder prefills: it starts its next image at the reply's
    /// first token instead of when the last reply ended (see `prefill_first`). For an encoder
    /// that shares the decoder's cores: it shortens time to first token at the cost of
    /// encoding later.
    pub prefill_first: bool,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            every: 1,
            max_frames: None,
            depth: 2,
            live: false,
            trace: false,
            ahead: false,
            skip_similar: None,
            prefill_first: false,
        }
    }
}

/// What the chain tells its caller as it runs (on the calling thread).
#[derive(Debug)]
pub enum Event<'a> {
    /// Decoding of `frame` (the source's sequence number) starts.
    FrameStart { frame: u64 },
    /// A piece of the reply for `frame`.
    Text { frame: u64, text: &'a str },
    /// The reply for `frame` is complete.
    FrameDone {
        frame: u64,
        generation: &'a Generation,
    },
}

/// A stage that stopped the chain, and why.
#[derive(Debug)]
pub struct StageFailure {
    pub stage: String,
    pub error: String,
}

impl std::fmt::Display for StageFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "stage {} failed: {}", self.stage, self.error)
    }
}

/// Per-stage latencies in milliseconds, in completion order.
#[derive(Clone, Debug, Default)]
pub struct Latencies {
    pub isp: Vec<f64>,
    pub encoder: Vec<f64>,
    pub decoder: Vec<f64>,
    /// Capture to last token.
    pub end_to_end: Vec<f64>,
}

/// Everything a run measured.
#[derive(Debug, Default)]
pub struct RunReport {
    pub frames_in: u64,
    pub frames_skipped: u64,
    pub frames_dropped: u64,
    /// Frames the source lost before delivering them (a camera's driver had no free buffer, or
    /// flagged the frame as bad): not in `frames_in`.
    pub frames_dropped_at_capture: u64,
    pub frames_preprocessed: u64,
    pub frames_encoded: u64,
    pub frames_decoded: u64,
    pub tokens: u64,
    /// Sum of the decode phases (first token to last).
    pub decode_time: Duration,
    pub ttft_ms: Vec<f64>,
    pub latency: Latencies,
    pub wall: Duration,
    /// Bytes the copy ledger recorded during the run.
    pub bytes_copied: u64,
    /// The same, per ledger stage (`y4m-read`, `encoder-cpu-output`, ...), stages with copies only.
    pub bytes_copied_by_stage: Vec<(String, u64)>,
    pub kv_utilisation: f64,
    /// The most frames whose GPU work was submitted and not yet complete at one time.
    pub gpu_in_flight_max: usize,
    /// Frames whose ISP work was submitted before the frame was written (ahead of time; for a
    /// CPU ISP, frames it took before they were written and waited for on a DRM syncobj).
    pub frames_submitted_ahead: u64,
    /// Per stage (ISP, encoder, decoder), the times its thread blocked waiting for GPU work to
    /// complete (a fence, a timeline value, a device poll). Waiting for input or for room in a
    /// ring is backpressure and not counted, nor are the GPU decoder's per-token waits for its
    /// logits (the CPU's wake to sample).
    pub host_waits: [u64; 3],
    /// Capture to the start of its description, per decoded frame: how old the frame a reply
    /// describes was when the decoder took it.
    pub staleness_ms: Vec<f64>,
    /// Speculative decoding's counters over every reply.
    pub draft: crate::speculative::DraftStats,
    /// Prompt tokens taken from the KV prefix cache instead of computed, over every reply.
    pub prefix_cached_tokens: u64,
    /// Frames whose image K/V were reused from the previous frame (`skip_similar`).
    pub frames_reused: u64,
    /// KV pages dropped by the decoder's budget (`kv_budget`).
    pub kv_pages_pruned: u64,
    /// The most tokens the decoder's KV cache held for its sequence at the end of a reply.
    pub kv_tokens_max: usize,
    /// Times a running conversation (`keep_context`) started over for lack of context.
    pub context_restarts: u64,
    pub stage_names: [String; 3],
    pub traces: Vec<TraceLog>,
    /// Set when the user stopped the run (Ctrl-C).
    pub interrupted: bool,
    pub failure: Option<StageFailure>,
}

/// The record that travels with each item through the rings.
#[derive(Clone, Debug)]
struct Item {
    frame: u64,
    /// When the frame was in its buffer: set by the source thread once it has written it,
    /// which for a frame announced ahead of its capture is after the item was published.
    captured: Arc<std::sync::OnceLock<Instant>>,
    /// When the item was published (the capture time's stand-in until it is set).
    published: Instant,
    /// The value the source's timeline reaches once the frame is written.
    ready: u64,
}

impl Item {
    fn captured(&self) -> Instant {
        self.captured.get().copied().unwrap_or(self.published)
    }
}

/// An item of the pixels and embeddings rings: published as soon as its stage has submitted
/// the work that writes the slot, with the completion that says when the slot is written.
#[derive(Clone, Debug)]
struct Ready {
    item: Item,
    ready: Completion,
    /// The encoder skipped this frame as unchanged (`skip_similar`): the slot holds nothing.
    unchanged: bool,
}

/// Runs `chain` until its source ends, `options.max_frames` frames have come in, `stop` is
/// raised, or a stage fails; `on_event` sees the replies as they stream. The run's figures come
/// back even when a stage failed.
///
/// # Errors
/// Only setup errors (allocating the rings' buffers); a stage failing mid-run is reported in
/// [`RunReport::failure`].
pub fn run(
    chain: Chain,
    options: &RunOptions,
    stop: Arc<AtomicBool>,
    mut on_event: impl FnMut(Event<'_>),
) -> Result<RunReport, StageError> {
    let Chain {
        mut source,
        mut isp,
        mut encoder,
        mut decoder,
    } = chain;
    let depth = options.depth.max(1);
    let every = options.every.max(1);
    // Each ring's buffers come from a backend both of its stages use in place (a GPU stage
    // whose driver cannot import dma-bufs gets host memory it imports by address).
    let allocator_for = |a: Option<Vec<BackendKind>>,
                         b: Option<Vec<BackendKind>>|
     -> Result<Allocator, StageError> {
        let backends: Vec<BackendKind> = BackendKind::ALL
            .into_iter()
            .filter(|k| a.as_ref().is_none_or(|a| a.contains(k)))
            .filter(|k| b.as_ref().is_none_or(|b| b.contains(k)))
            .collect();
        if backends.is_empty() {
            return Err("no buffer backend both neighbouring stages can use in place".into());
        }
        Ok(Allocator::new(AllocatorDesc {
            backends,
            ..AllocatorDesc::default()
        })?)
    };
    let pixels_allocator = allocator_for(isp.buffer_backends(), encoder.buffer_backends())?;
    let embed_allocator = allocator_for(encoder.buffer_backends(), None)?;
    // A live ring has one slot more than `depth`: the newest item waits there, ready, while
    // the producer writes the next and the consumer reads the last.
    let slots = if options.live { depth + 1 } else { depth };
    let buffers =
        |allocator: &Allocator, bytes: usize| -> Result<Vec<Arc<UnifiedBuffer>>, StageError> {
            (0..slots)
                .map(|_| Ok(Arc::new(allocator.allocate(bytes)?)))
                .collect()
        };
    let pixels_bytes = isp.output_bytes();
    let s = encoder.image_size();
    let images = encoder.images();
    if pixels_bytes != images * 3 * s * s * 4 {
        return Err(format!(
            "the ISP writes {pixels_bytes} bytes but the encoder reads {images} x 3 x {s} x {s} \
             f32"
        )
        .into());
    }
    let embed_len = images * encoder.image_tokens() * encoder.text_hidden();
    let pixel_buffers = buffers(&pixels_allocator, pixels_bytes)?;
    let embed_buffers = buffers(&embed_allocator, embed_len * 4)?;
    // On a ring slot not yet written (zeros), before any frame: nothing of it is counted.
    decoder.warm_up(EncodedImage {
        buffer: &embed_buffers[0],
        len: embed_len,
        ready: &Completion::Done,
        unchanged: false,
    })?;

    let ledger_before = CopyLedger::global().report();
    let origin = Instant::now();
    let ring = |name, buffers| (name, options.live, slots, buffers, Arc::clone(&stop));
    let (mut frames_tx, mut frames_rx) = open_ring::<(Frame, Item)>(ring("frames", Vec::new()));
    let (mut pixels_tx, mut pixels_rx) = open_ring::<Ready>(ring("pixels", pixel_buffers));
    let (mut embed_tx, mut embed_rx) = open_ring::<Ready>(ring("embeddings", embed_buffers));
    // The GPUs the stages submit to (one, when the ISP and the encoder share a device): a
    // watcher per GPU timestamps completions for the latencies and the trace.
    let mut gpus: Vec<GpuContext> = Vec::new();
    for gpu in [isp.gpu(), encoder.gpu()].into_iter().flatten() {
        if !gpus
            .iter()
            .any(|g| Arc::ptr_eq(g.completion_timeline(), gpu.completion_timeline()))
        {
            gpus.push(gpu.clone());
        }
    }
    for gpu in &gpus {
        gpu.limit_frames_in_flight(depth);
        if options.trace {
            gpu.trace_submissions();
        }
    }
    let watch_stop = AtomicBool::new(false);
    // Live streams: when each slow stage will take its next input (see `demand`).
    let embed_demand = &demand::Demand::new(origin);
    let pixels_demand = &demand::Demand::new(origin);
    // Prefill first: shared by the decoder (here) and the encoder thread, when asked for.
    let prefill_gate = &options.prefill_first.then(prefill_first::PrefillGate::new);
    // Ahead-of-time submission: the source mirrors its frames' readiness onto a timeline the
    // ISP waits on in its queue, and announces each frame before writing it.
    let ahead = options.ahead
        && match isp.frames_ready_timeline()? {
            Some(timeline) => source.mirror_timeline(timeline),
            None => false,
        };
    // Counts the pixels items the encoder has handled (submitted, or dropped by a live ring):
    // before the ISP queues work that waits for a capture, everything earlier is in the queue,
    // so the wait holds up nothing but that frame.
    let encoder_handled = &CpuTimeline::new(0);
    let source_timeline = source.timeline();
    let frames_written = Arc::clone(&source_timeline);
    let isp_on_gpu = isp.gpu().is_some();
    let stage_names = [
        isp.name().to_string(),
        encoder.name().to_string(),
        decoder.name().to_string(),
    ];

    let mut report = RunReport {
        stage_names: stage_names.clone(),
        ..RunReport::default()
    };
    let live = options.live;
    let max_frames = options.max_frames;
    let trace = options.trace;

    std::thread::scope(|scope| {
        let source_stop = Arc::clone(&stop);
        let source_thread = scope.spawn(move || {
            let mut log = TraceLog::new(origin, 1, "source", trace);
            let mut counts = SourceCounts::default();
            let result = feed(
                &mut *source,
                &mut frames_tx,
                &source_stop,
                (every, max_frames, ahead),
                &mut counts,
                &mut log,
            );
            frames_tx.close();
            counts.lost_at_capture = source.dropped();
            (counts, log, result.err().map(|e| ("source".to_string(), e)))
        });
        let isp_name = stage_names[0].clone();
        let isp_thread = scope.spawn(move || {
            let mut log = TraceLog::new(origin, 2, "isp", trace);
            let mut done = StageCounts::default();
            // Only work that waits in a GPU queue can hold up the encoder's behind it.
            let gate = (ahead && isp_on_gpu).then_some((&*source_timeline, encoder_handled));
            let result = pump_isp(
                &mut frames_rx,
                &mut pixels_tx,
                live.then_some(pixels_demand),
                &mut done,
                &mut log,
                &mut *isp,
                gate,
            );
            pixels_tx.close();
            frames_rx.abandon();
            done.host_waits = isp.host_waits();
            done.ahead = isp.frames_submitted_ahead();
            // A live ring's drops, counted once its consumer is done with it.
            done.dropped += frames_rx.dropped();
            (done, log, result.err().map(|e| (isp_name, e)))
        });
        let encoder_name = stage_names[1].clone();
        let encoder_thread = scope.spawn(move || {
            let mut log = TraceLog::new(origin, 3, "encoder", trace);
            let mut done = StageCounts::default();
            let result = pump_encoder(
                &mut pixels_rx,
                &mut embed_tx,
                live.then_some((pixels_demand, embed_demand)),
                &mut done,
                &mut log,
                &mut *encoder,
                (encoder_handled, ahead.then_some(&*frames_written)),
                options.skip_similar,
                prefill_gate.as_ref(),
            );
            // Nothing more will be handled: an ISP waiting on this count goes on (and ends).
            let _ = encoder_handled.signal(u64::MAX);
            done.host_waits += encoder.host_waits();
            embed_tx.close();
            pixels_rx.abandon();
            done.dropped += pixels_rx.dropped();
            (done, log, result.err().map(|e| (encoder_name, e)))
        });

        let watchers: Vec<_> = gpus
            .iter()
            .map(|gpu| {
                let watch_stop = &watch_stop;
                scope.spawn(move || gpu.watch_completions(watch_stop))
            })
            .collect();

        // The decoder runs here, so replies stream on the caller's thread.
        let mut log = TraceLog::new(origin, 4, "decoder", trace);
        let mut decoder_failure = None;
        let mut decode_time = demand::Latency::default();
        loop {
            // Free: the encoder may produce now (live streams).
            embed_demand.taking_at(None);
            // Waiting for an image: the encoder has the cores. With one waiting, they stay
            // the next prefill's.
            if let Some(gate) = prefill_gate
                && !embed_rx.has_ready()
            {
                gate.open();
            }
            // A live ring hands over its newest item and counts the older ones as dropped.
            let received = match embed_rx.receive() {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(Ended::Stopped | Ended::Closed) => break,
            };
            let (
                Ready {
                    item,
                    ready,
                    unchanged,
                },
                buffer,
            ) = received;
            let buffer = buffer.expect("the embeddings ring has buffers");
            let start = Instant::now();
            // Busy until about then: the encoder's next item should be ready just before.
            embed_demand.taking_at(Some(start + decode_time.get()));
            record(
                &mut report.staleness_ms,
                report.frames_decoded + 1,
                ms(start.saturating_duration_since(item.captured())),
            );
            on_event(Event::FrameStart { frame: item.frame });
            // The decoder waits for the encoder's completion value itself: in its device's
            // queue where it can, else once on the host.
            let image = EncodedImage {
                buffer: &buffer,
                len: embed_len,
                ready: &ready,
                unchanged,
            };
            if let Some(gate) = prefill_gate {
                gate.close();
            }
            let result = decoder.describe(image, &mut |text| {
                // The first token: the prefill is over.
                if let Some(gate) = prefill_gate {
                    gate.open();
                }
                on_event(Event::Text {
                    frame: item.frame,
                    text,
                });
                !stop.load(Ordering::SeqCst)
            });
            // Before the slot goes back: the encoder must not start on it during the next
            // prefill.
            if let Some(gate) = prefill_gate {
                gate.close();
            }
            embed_rx.release();
            let elapsed = start.elapsed();
            decode_time.add(elapsed);
            log.span("decode", Some(item.frame), start, elapsed);
            match result {
                Ok(generation) => {
                    report.frames_decoded += 1;
                    report.host_waits[2] += u64::from(generation.host_waited);
                    let stats = &generation.stats;
                    report.tokens += stats.generated as u64;
                    report.decode_time += stats.decode_time;
                    report.draft.add(&stats.draft);
                    report.prefix_cached_tokens += stats.prefix_cached_tokens as u64;
                    report.frames_reused += u64::from(generation.image_reused);
                    report.kv_pages_pruned += stats.kv_pages_pruned;
                    report.kv_tokens_max = report.kv_tokens_max.max(generation.kv_tokens);
                    report.context_restarts += u64::from(generation.context_restarted);
                    let n = report.frames_decoded;
                    record(
                        &mut report.ttft_ms,
                        n,
                        stats.time_to_first_token.as_secs_f64() * 1e3,
                    );
                    record(&mut report.latency.decoder, n, ms(elapsed));
                    record(
                        &mut report.latency.end_to_end,
                        n,
                        ms(item.captured().elapsed()),
                    );
                    report.kv_utilisation = report.kv_utilisation.max(decoder.kv_utilisation());
                    on_event(Event::FrameDone {
                        frame: item.frame,
                        generation: &generation,
                    });
                }
                Err(e) => {
                    decoder_failure = Some((stage_names[2].clone(), e));
                    break;
                }
            }
            if stop.load(Ordering::SeqCst) {
                break;
            }
        }
        // Whatever ended the loop, upstream must stop waiting for this consumer.
        embed_rx.abandon();
        if let Some(gate) = prefill_gate {
            gate.open();
        }
        report.frames_dropped += embed_rx.dropped();

        // A stage that panicked (a bug in its implementation) fails the run like an error;
        // its counts and trace are lost, everything else is reported.
        let panicked = |stage: &str| -> (Option<(String, StageError)>, TraceLog) {
            (
                Some((stage.to_string(), format!("{stage} panicked").into())),
                TraceLog::new(origin, 0, "lost", false),
            )
        };
        let (source_counts, source_log, source_failure) =
            source_thread.join().unwrap_or_else(|_| {
                let (failure, log) = panicked("source");
                (SourceCounts::default(), log, failure)
            });
        let (isp_counts, isp_log, isp_failure) = isp_thread.join().unwrap_or_else(|_| {
            let (failure, log) = panicked(&stage_names[0]);
            (StageCounts::default(), log, failure)
        });
        let (encoder_counts, encoder_log, encoder_failure) =
            encoder_thread.join().unwrap_or_else(|_| {
                let (failure, log) = panicked(&stage_names[1]);
                (StageCounts::default(), log, failure)
            });
        watch_stop.store(true, Ordering::SeqCst);
        for w in watchers {
            let _ = w.join();
        }
        report.frames_in = source_counts.frames_in;
        report.frames_dropped_at_capture = source_counts.lost_at_capture;
        report.frames_skipped = source_counts.skipped;
        report.frames_dropped += isp_counts.dropped + encoder_counts.dropped;
        report.frames_preprocessed = isp_counts.done;
        report.frames_encoded = encoder_counts.done;
        report.host_waits[0] = isp_counts.host_waits;
        report.frames_submitted_ahead = isp_counts.ahead;
        report.host_waits[1] = encoder_counts.host_waits;
        report.latency.isp = isp_counts.latency_ms;
        report.latency.encoder = encoder_counts.latency_ms;
        // A GPU stage's latency is its work's time on the queue, as the watcher saw it.
        for gpu in &gpus {
            report.gpu_in_flight_max = report.gpu_in_flight_max.max(gpu.frames_in_flight_max());
            for (stage, series) in [
                ("isp", &mut report.latency.isp),
                ("encoder", &mut report.latency.encoder),
            ] {
                let gpu_series = gpu.latency_ms(stage);
                if !gpu_series.is_empty() {
                    *series = gpu_series;
                }
            }
        }
        report.traces = vec![source_log, isp_log, encoder_log, log];
        if trace {
            let mut gpu_log = TraceLog::new(origin, 5, "gpu", true);
            for span in gpus.iter().flat_map(GpuContext::traced_submissions) {
                if let Some(end) = span.completed {
                    gpu_log.async_span(span.stage, span.frame, span.value, span.submitted, end);
                }
            }
            report.traces.push(gpu_log);
        }
        // The first failure in chain order is the cause; later stages only saw the stream end.
        report.failure = [
            source_failure,
            isp_failure,
            encoder_failure,
            decoder_failure,
        ]
        .into_iter()
        .flatten()
        .next()
        .map(|(stage, error)| StageFailure {
            stage,
            error: error.to_string(),
        });
    });
    report.wall = origin.elapsed();
    report.interrupted = stop.load(Ordering::SeqCst);
    for stage in CopyLedger::global().report().stages {
        let before = ledger_before
            .stages
            .iter()
            .find(|s| s.stage == stage.stage)
            .map_or(0, |s| s.bytes);
        let bytes = stage.bytes.saturating_sub(before);
        if bytes > 0 {
            report.bytes_copied += bytes;
            report.bytes_copied_by_stage.push((stage.stage, bytes));
        }
    }
    Ok(report)
}

/// A lossless ring, or for a live stream a latest-wins one.
#[allow(clippy::type_complexity)]
fn open_ring<T: Send>(
    (name, live, slots, buffers, stop): (
        &'static str,
        bool,
        usize,
        Vec<Arc<UnifiedBuffer>>,
        Arc<AtomicBool>,
    ),
) -> (Producer<T>, Consumer<T>) {
    if live {
        ring::live_ring(name, slots, buffers, stop)
    } else {
        ring::ring(name, slots, buffers, stop)
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The most latency samples a series keeps: a stream that runs for days must not grow its
/// report without bound. Up to here every sample is kept (percentiles are exact); past it,
/// reservoir sampling keeps a uniform sample of them all.
pub const MAX_LATENCY_SAMPLES: usize = 65_536;

/// Records the `n`-th value (1-based) of a series into `samples` (see [`MAX_LATENCY_SAMPLES`]).
pub(crate) fn record(samples: &mut Vec<f64>, n: u64, value: f64) {
    if samples.len() < MAX_LATENCY_SAMPLES {
        samples.push(value);
        return;
    }
    // Algorithm R with a splitmix64 hash of `n` as its random draw: deterministic per run.
    let mut z = n.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    let j = (z % n.max(1)) as usize;
    if let Some(slot) = samples.get_mut(j) {
        *slot = value;
    }
}

#[derive(Debug, Default)]
struct SourceCounts {
    frames_in: u64,
    skipped: u64,
    lost_at_capture: u64,
}

#[derive(Debug, Default)]
struct StageCounts {
    done: u64,
    dropped: u64,
    latency_ms: Vec<f64>,
    host_waits: u64,
    /// Frames submitted ahead of their capture (the ISP).
    ahead: u64,
}

/// The source worker: pulls frames, samples every `every`-th, and feeds the first ring: a
/// file blocks until the ISP frees a slot; a live source never waits (its ring keeps the
/// newest frames and drops older ones). With `ahead`, a frame that will be sampled is
/// published when the source announces it, before it is written, so the ISP's GPU work for it
/// is queued while the capture is still coming; the frame is always written afterwards (also
/// when the run stops), so no queued wait is left hanging.
fn feed(
    source: &mut dyn FrameSource,
    tx: &mut Producer<(Frame, Item)>,
    stop: &AtomicBool,
    (every, max_frames, ahead): (u64, Option<u64>, bool),
    counts: &mut SourceCounts,
    log: &mut TraceLog,
) -> Result<(), StageError> {
    let mut open = true;
    while open && !stop.load(Ordering::SeqCst) && max_frames.is_none_or(|m| counts.frames_in < m) {
        let index = counts.frames_in;
        let sampled = index.is_multiple_of(every);
        let captured = Arc::new(std::sync::OnceLock::new());
        let mut announced = None;
        if ahead
            && sampled
            && let Some(frame) = source.announce_next()?
        {
            let item = Item {
                frame: frame.sequence,
                captured: Arc::clone(&captured),
                published: Instant::now(),
                ready: frame.ready,
            };
            announced = Some((frame.ready, Arc::clone(&frame.buffer)));
            open = publish(tx, (frame, item), log);
        }
        let start = Instant::now();
        let delivered = source.next_frame();
        if let (Some((ready, _)), Ok(None) | Err(_)) = (&announced, &delivered) {
            // Work queued for the announced frame waits for its signal: give it, so the queue
            // goes on (the run ends here anyway).
            let _ = source.timeline().signal(*ready);
        }
        let Some(frame) = delivered? else {
            break;
        };
        let _ = captured.set(Instant::now());
        counts.frames_in += 1;
        if !sampled {
            counts.skipped += 1;
            continue;
        }
        log.span("capture", Some(frame.sequence), start, start.elapsed());
        // The announced frame is the one whose readiness the queued work waits on: its value
        // and buffer. (A camera predicts its sequence number, which a drop makes lag.)
        if let Some((ready, buffer)) = &announced {
            if frame.ready != *ready || !Arc::ptr_eq(&frame.buffer, buffer) {
                return Err(format!(
                    "the source announced the frame it signals at {ready} and delivered the one \
                     it signals at {}, or another buffer",
                    frame.ready
                )
                .into());
            }
            continue;
        }
        let item = Item {
            frame: frame.sequence,
            captured,
            published: Instant::now(),
            ready: frame.ready,
        };
        open = publish(tx, (frame, item), log);
    }
    Ok(())
}

/// Publishes a frame; `false` when the ring ended (stop raised, or the ISP gone): the source
/// then stops, which is not a failure of its own.
fn publish(tx: &mut Producer<(Frame, Item)>, w: (Frame, Item), log: &mut TraceLog) -> bool {
    let frame = w.1.frame;
    let Ok(slot) = tx.reserve() else {
        return false;
    };
    let value = tx.publish(slot, w);
    log.signal("frames", value, Some(frame));
    true
}

/// The ISP worker's loop: frames in, tensors out. A tensor is published as soon as its work
/// is submitted, with its completion; the frame goes back to the source at once, its lease
/// keeping the buffer from a refill until the device work reading it is done.
fn pump_isp(
    rx: &mut Consumer<(Frame, Item)>,
    tx: &mut Producer<Ready>,
    demand: Option<&demand::Demand>,
    counts: &mut StageCounts,
    log: &mut TraceLog,
    isp: &mut dyn IspStage,
    ahead: Option<(&dyn Timeline, &CpuTimeline)>,
) -> Result<(), StageError> {
    let mut served = None;
    let mut own = demand::Latency::default();
    loop {
        // Room first (a ring slot, room on the GPU), then the newest frame: a frame never
        // ages while the stage waits.
        let Ok(slot) = tx.reserve() else {
            return Ok(());
        };
        isp.wait_for_room()?;
        // Live: while the encoder has a tensor waiting, produce the next one only in time for
        // its next take.
        if let Some(demand) = demand {
            let lead = isp
                .gpu()
                .and_then(|g| g.recent_latency("isp"))
                .unwrap_or_else(|| own.get());
            if !demand.wait_until_due(lead, &mut served, || tx.has_ready(), || rx.stopped(), None) {
                return Ok(());
            }
        }
        let Ok(Some(((frame, item), _))) = rx.receive() else {
            return Ok(());
        };
        let out = Arc::clone(slot.buffer().expect("the ISP's output ring has buffers"));
        // A frame not captured yet: its work will wait in the queue, so first let the encoder
        // queue its work on everything published before (the GPU runs one queue in order).
        if let Some((source, encoder_handled)) = ahead
            && source.value()? < frame.ready
            && !wait_for(encoder_handled, tx.next_index(), rx)
        {
            return Ok(());
        }
        let start = Instant::now();
        let result = isp.submit(&frame, &out);
        drop(frame);
        rx.release();
        let ready = result?;
        let elapsed = start.elapsed();
        own.add(elapsed);
        log.span("isp", Some(item.frame), start, elapsed);
        counts.done += 1;
        // Work done on this thread: its latency is the call's (a GPU stage's comes from its
        // completion, measured by the chain's watcher).
        if matches!(ready, Completion::Done) {
            record(&mut counts.latency_ms, counts.done, ms(elapsed));
        }
        let written = ready.timeline_value();
        let frame_number = item.frame;
        let ready = Ready {
            item,
            ready,
            unchanged: false,
        };
        let value = tx.publish_written_after(slot, ready, written);
        log.signal(tx.name(), value, Some(frame_number));
    }
}

/// Waits until `timeline` reaches `value`, giving up (`false`) when the ring `rx` reads from
/// is stopped. A wait on another stage's CPU progress (or a source's capture), not on the GPU.
fn wait_for<T>(timeline: &dyn Timeline, value: u64, rx: &Consumer<T>) -> bool {
    loop {
        if timeline.wait(value, Duration::from_millis(50)).is_ok() {
            return true;
        }
        if rx.stopped() {
            return false;
        }
    }
}

/// The encoder worker's loop: tensors in, embeddings out, both in ring buffers. The output is
/// published as soon as the work is submitted, with its completion value, so the decoder waits
/// on that value itself (on a GPU, a timeline the queue signals); the input slot goes back to
/// the ISP released after that value, so nobody blocks on it here.
/// Every 64th value of an ISP output: enough to tell an unchanged frame from a changed one.
fn pixel_signature(pixels: &[f32]) -> Vec<f32> {
    pixels.iter().step_by(64).copied().collect()
}

/// `rms(a - b) / rms(b)` (0 when both are zero): how much a frame moved.
fn relative_rms_difference(a: &[f32], b: &[f32]) -> f32 {
    let (mut diff, mut norm) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        diff += f64::from(x - y).powi(2);
        norm += f64::from(y).powi(2);
    }
    if norm == 0.0 {
        return if diff == 0.0 { 0.0 } else { f32::INFINITY };
    }
    (diff / norm).sqrt() as f32
}

#[allow(clippy::too_many_arguments)]
fn pump_encoder(
    rx: &mut Consumer<Ready>,
    tx: &mut Producer<Ready>,
    demands: Option<(&demand::Demand, &demand::Demand)>,
    counts: &mut StageCounts,
    log: &mut TraceLog,
    encoder: &mut dyn EncoderStage,
    (handled, frames_written): (&CpuTimeline, Option<&dyn Timeline>),
    skip_similar: Option<f32>,
    prefill_gate: Option<&prefill_first::PrefillGate>,
) -> Result<(), StageError> {
    let mut received = 0u64;
    // The last encoded frame's pixel signature (`skip_similar`).
    let mut last: Option<Vec<f32>> = None;
    let mut own = demand::Latency::default();
    let mut served = None;
    loop {
        // Room first, then the newest tensor (as the ISP does).
        let Ok(slot) = tx.reserve() else {
            return Ok(());
        };
        // Live: while the decoder has embeddings waiting, encode the next image only in time
        // for its next take, and tell the ISP when that will be.
        if let Some((pixels, embeddings)) = demands {
            let lead = encoder
                .gpu()
                .and_then(|g| g.recent_latency("encoder"))
                .unwrap_or_else(|| own.get());
            let due = embeddings.wait_until_due(
                lead,
                &mut served,
                || tx.has_ready(),
                || rx.stopped(),
                Some(pixels),
            );
            if !due {
                return Ok(());
            }
            pixels.taking_at(None);
        }
        let Ok(Some((
            Ready {
                item,
                ready: pixels_ready,
                ..
            },
            input,
        ))) = rx.receive()
        else {
            return Ok(());
        };
        let input = input.expect("the pixels ring has buffers");
        received += 1;
        // A frame announced ahead: the ISP's work on it waits in the queue for the capture.
        // Work queued behind a waiting submission can block the submitting thread in the
        // driver (lavapipe's does), so the encoder submits once the frame is written: a wait
        // for input, on the source's CPU timeline, not for the GPU.
        if let Some(written) = frames_written
            && written.value()? < item.ready
            && !wait_for(written, item.ready, rx)
        {
            return Ok(());
        }
        let mut start = Instant::now();
        if let Some(threshold) = skip_similar {
            // The ISP's output, read in place once it is complete (a host wait when the ISP
            // runs on a GPU): an unchanged frame is not encoded, and the decoder reuses the last
            // image's K/V.
            counts.host_waits += u64::from(pixels_ready.wait(GPU_TIMEOUT)?);
            let signature = {
                let guard = input.cpu_access(0..input.len(), Access::Read)?;
                pixel_signature(guard.typed::<f32>()?)
            };
            if last
                .as_ref()
                .is_some_and(|l| relative_rms_difference(&signature, l) <= threshold)
            {
                rx.release();
                log.span("skip similar", Some(item.frame), start, start.elapsed());
                let _ = handled.signal(received + rx.dropped());
                let frame_number = item.frame;
                let ready = Ready {
                    item,
                    ready: Completion::Done,
                    unchanged: true,
                };
                let value = tx.publish(slot, ready);
                log.signal(tx.name(), value, Some(frame_number));
                continue;
            }
            // Kept until the next encoded frame: a copy, counted.
            CopyLedger::global()
                .stage("skip-similar-signature")
                .record(std::mem::size_of_val(signature.as_slice()));
            last = Some(signature);
        }
        // Prefill first: not while the decoder prefills.
        if let Some(gate) = prefill_gate {
            let before = Instant::now();
            if !gate.wait_open(|| rx.stopped()) {
                return Ok(());
            }
            let waited = before.elapsed();
            if waited > Duration::from_micros(100) {
                log.span("wait for prefill", Some(item.frame), before, waited);
                // The encoder's latency counts from here: the wait was for the decoder.
                start = Instant::now();
            }
        }
        let out = Arc::clone(slot.buffer().expect("the embeddings ring has buffers"));
        let ready = match encoder.submit(item.frame, &input, &pixels_ready, &out) {
            Ok(ready) => ready,
            Err(e) => {
                // The work may have been submitted before the failure: the ISP gets the slot
                // back only once everything submitted on it is done.
                match pixels_ready.timeline_value() {
                    Some((timeline, value)) => rx.release_after(timeline, value),
                    None => rx.release(),
                }
                return Err(e);
            }
        };
        let elapsed = start.elapsed();
        own.add(elapsed);
        match ready.timeline_value() {
            Some((timeline, value)) => rx.release_after(timeline, value),
            None => rx.release(),
        }
        log.span("encode", Some(item.frame), start, elapsed);
        // Every pixels item so far is submitted or was dropped.
        let _ = handled.signal(received + rx.dropped());
        counts.done += 1;
        if matches!(ready, Completion::Done) {
            record(&mut counts.latency_ms, counts.done, ms(elapsed));
        }
        let written = ready.timeline_value();
        let frame_number = item.frame;
        let ready = Ready {
            item,
            ready,
            unchanged: false,
        };
        let value = tx.publish_written_after(slot, ready, written);
        log.signal(tx.name(), value, Some(frame_number));
    }
}

/// `p`-th percentile (0..=100) of `values` by nearest rank; 0 when empty.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// The process's peak resident set (`VmHWM`), if /proc says.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

impl RunReport {
    /// Decode tokens per second over the decode phases.
    pub fn tokens_per_s(&self) -> f64 {
        let t = self.decode_time.as_secs_f64();
        if t > 0.0 { self.tokens as f64 / t } else { 0.0 }
    }

    /// Frames decoded per second of wall time.
    pub fn frames_per_s(&self) -> f64 {
        self.frames_decoded as f64 / self.wall.as_secs_f64().max(1e-9)
    }

    /// Stage `stage`'s (0 ISP, 1 encoder, 2 decoder) host waits per frame it handled.
    pub fn host_waits_per_frame(&self, stage: usize) -> f64 {
        let frames = [
            self.frames_preprocessed,
            self.frames_encoded,
            self.frames_decoded,
        ][stage];
        self.host_waits[stage] as f64 / frames.max(1) as f64
    }

    /// Bytes the ledger recorded per frame that reached the decoder.
    pub fn bytes_copied_per_frame(&self) -> f64 {
        self.bytes_copied as f64 / self.frames_decoded.max(1) as f64
    }

    /// The `--stats-json` document.
    pub fn to_json(&self) -> serde_json::Value {
        let lat = |v: &[f64]| {
            serde_json::json!({
                "p50": percentile(v, 50.0),
                "p99": percentile(v, 99.0),
                "n": v.len(),
            })
        };
        serde_json::json!({
            "frames_in": self.frames_in,
            "frames_skipped": self.frames_skipped,
            "frames_dropped": self.frames_dropped,
            "frames_dropped_at_capture": self.frames_dropped_at_capture,
            "frames_preprocessed": self.frames_preprocessed,
            "frames_encoded": self.frames_encoded,
            "frames_decoded": self.frames_decoded,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens_per_s(),
            "ttft_ms": lat(&self.ttft_ms),
            "frames_per_s": self.frames_per_s(),
            "wall_s": self.wall.as_secs_f64(),
            "bytes_copied": self.bytes_copied,
            "bytes_copied_per_frame": self.bytes_copied_per_frame(),
            "bytes_copied_by_stage": self
                .bytes_copied_by_stage
                .iter()
                .map(|(stage, bytes)| (stage.clone(), serde_json::Value::from(*bytes)))
                .collect::<serde_json::Map<_, _>>(),
            "peak_rss_bytes": peak_rss_bytes(),
            "kv_utilisation": self.kv_utilisation,
            "gpu_in_flight_max": self.gpu_in_flight_max,
            "frames_submitted_ahead": self.frames_submitted_ahead,
            "host_waits_per_frame": {
                "isp": self.host_waits_per_frame(0),
                "encoder": self.host_waits_per_frame(1),
                "decoder": self.host_waits_per_frame(2),
            },
            "staleness_ms": lat(&self.staleness_ms),
            "draft_acceptance": self.draft.acceptance(),
            "draft_tokens_per_step": self.draft.drafted_per_step(),
            "prefix_cached_tokens": self.prefix_cached_tokens,
            "frames_reused": self.frames_reused,
            "kv_pages_pruned": self.kv_pages_pruned,
            "kv_tokens_max": self.kv_tokens_max,
            "context_restarts": self.context_restarts,
            "stages": {
                "isp": self.stage_names[0],
                "encoder": self.stage_names[1],
                "decoder": self.stage_names[2],
            },
            "stage_latency_ms": {
                "isp": lat(&self.latency.isp),
                "encoder": lat(&self.latency.encoder),
                "decoder": lat(&self.latency.decoder),
                "end_to_end": lat(&self.latency.end_to_end),
            },
            "interrupted": self.interrupted,
            "failure": self.failure.as_ref().map(|f| f.to_string()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A series keeps every sample up to the cap, then stays at the cap with a sample spread
    /// over the whole run (not only its start).
    #[test]
    fn latency_series_are_bounded() {
        let mut samples = Vec::new();
        let total = 3 * MAX_LATENCY_SAMPLES as u64;
        for n in 1..=total {
            record(&mut samples, n, n as f64);
        }
        assert_eq!(samples.len(), MAX_LATENCY_SAMPLES);
        let late = samples
            .iter()
            .filter(|&&v| v > 2.0 * MAX_LATENCY_SAMPLES as f64)
            .count();
        // About a third of a uniform sample comes from the last third of the run.
        assert!(late > MAX_LATENCY_SAMPLES / 4, "{late}");
        let median = percentile(&samples, 50.0);
        assert!(
            (median / (total as f64 / 2.0) - 1.0).abs() < 0.05,
            "{median}"
        );
    }
}
