//! Does the overlap work? Runs the same chain twice over the same frames: first each stage
//! alone, one after the other (no overlap: the time of each stage by itself), then composed by
//! `pipeline::chain::run`. Prints one JSON line with each stage's median alone, the chain's
//! frames/s, and the chain's throughput as a fraction of the slowest stage's.
//!
//! `cargo run --release -p pipeline --example chain_overlap -- MODEL [SOURCE] [FRAMES]
//! [MAX_TOKENS] [DECODER_THREADS]`
//!
//! On a 2-core machine with lavapipe every "engine" shares the same two cores, so run it with
//! `LP_NUM_THREADS=1` and 1 decoder thread to give the GPU and the NPU one core each, as they
//! would have their own silicon on a SoC.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use pipeline::chain::builder::{ChainSpec, build};
use pipeline::chain::percentile;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let model = PathBuf::from(
        args.get(1)
            .ok_or("usage: chain_overlap MODEL [SOURCE] ...")?,
    );
    let source = args
        .get(2)
        .cloned()
        .unwrap_or_else(|| "pattern:1280x720@30".into());
    let frames: u64 = args.get(3).map_or(Ok(8), |s| s.parse())?;
    let max_tokens: usize = args.get(4).map_or(Ok(32), |s| s.parse())?;
    let threads: usize = args.get(5).map_or(Ok(0), |s| s.parse())?;
    let spec = ChainSpec {
        source: Some(source),
        model: Some(model),
        max_frames: Some(frames + 1),
        max_tokens: Some(max_tokens),
        threads: Some(threads),
        // Greedy sampling: both runs see the same frames and write the same replies.
        ..ChainSpec::default()
    };

    // Each stage alone, the stages one after another.
    let built = build(&spec, false).map_err(|e| e.to_string())?;
    let mut chain = built.chain;
    let allocator = uvm_alloc::Allocator::new(Default::default())?;
    let pixels = Arc::new(allocator.allocate(chain.isp.output_bytes())?);
    let rows = chain.encoder.image_tokens() * chain.encoder.text_hidden();
    let embeddings = Arc::new(allocator.allocate(rows * 4)?);
    let (mut isp, mut enc, mut dec) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..=frames {
        let frame = chain.source.next_frame()?.ok_or("the source ended early")?;
        let t = Instant::now();
        chain
            .isp
            .process(&frame, &pixels)
            .map_err(|e| e.to_string())?;
        let t_isp = t.elapsed();
        let t = Instant::now();
        chain
            .encoder
            .encode(&pixels, &embeddings)
            .map_err(|e| e.to_string())?;
        let t_enc = t.elapsed();
        let t = Instant::now();
        let image = pipeline::chain::EncodedImage {
            buffer: &embeddings,
            len: rows,
            ready: &pipeline::chain::Completion::Done,
            unchanged: false,
        };
        chain
            .decoder
            .describe(image, &mut |_| true)
            .map_err(|e| e.to_string())?;
        let t_dec = t.elapsed();
        // The first frame warms caches and compiles pipelines: not counted.
        if i > 0 {
            isp.push(t_isp.as_secs_f64() * 1e3);
            enc.push(t_enc.as_secs_f64() * 1e3);
            dec.push(t_dec.as_secs_f64() * 1e3);
        }
    }
    drop(chain);

    // The composed chain over the same number of frames (plus one warm-up frame).
    let built = build(&spec, false).map_err(|e| e.to_string())?;
    let mut first_done = None;
    let report = pipeline::chain::run(
        built.chain,
        &built.options,
        Arc::new(AtomicBool::new(false)),
        |e| {
            if let pipeline::chain::Event::FrameDone { .. } = e {
                first_done.get_or_insert_with(Instant::now);
            }
        },
    )
    .map_err(|e| e.to_string())?;
    if let Some(f) = &report.failure {
        return Err(f.to_string().into());
    }
    let first_done = first_done.ok_or("no frame was decoded")?;
    let chain_ms_per_frame =
        first_done.elapsed().as_secs_f64() * 1e3 / (report.frames_decoded - 1).max(1) as f64;
    let medians = [
        percentile(&isp, 50.0),
        percentile(&enc, 50.0),
        percentile(&dec, 50.0),
    ];
    let slowest = medians.iter().copied().fold(0.0, f64::max);
    println!(
        "{}",
        serde_json::json!({
            "frames": frames,
            "stages": report.stage_names,
            "alone_ms_p50": { "isp": medians[0], "encoder": medians[1], "decoder": medians[2] },
            "serial_ms_per_frame": medians.iter().sum::<f64>(),
            "chain_ms_per_frame": chain_ms_per_frame,
            "chain_frames_per_s": 1e3 / chain_ms_per_frame,
            "throughput_vs_slowest_stage": slowest / chain_ms_per_frame,
            "bytes_copied_per_frame": report.bytes_copied_per_frame(),
            "tokens_per_s": report.tokens_per_s(),
        })
    );
    Ok(())
}
