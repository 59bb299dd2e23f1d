//! The vision encoder's latency inside the chain against the same encoder alone, at the same
//! frame pacing, in one process: issue 16's H200 figure.
//!
//! `cargo run --release -p pipeline --example encoder_in_chain -- CONFIG MODEL [FRAMES]`
//!
//! Runs the chain `CONFIG` (a chain TOML, e.g. `fixtures/chains/h200-headline.toml`) over
//! `FRAMES` source frames (default 600) twice: first with a decoder that returns at once (the
//! ISP and the encoder alone, paced by the same source and `every`), then whole. A GPU stage's
//! latency is its work's, from submission to the completion value its queue signals, as the
//! chain's watcher timestamps it. Prints one JSON object with both runs and the ratio of the
//! encoder's p50s.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use pipeline::chain::builder::{ChainSpec, build};
use pipeline::chain::{DecoderStage, EncodedImage, Generation, RunReport, StageError, percentile};

/// A decoder that describes nothing, at once.
struct NullDecoder;

impl DecoderStage for NullDecoder {
    fn name(&self) -> &'static str {
        "none"
    }

    fn describe(
        &mut self,
        image: EncodedImage<'_>,
        _on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<Generation, StageError> {
        let ((), host_waited) = image.read(|_| ())?;
        Ok(Generation {
            host_waited,
            ..Generation::default()
        })
    }

    fn kv_utilisation(&self) -> f64 {
        0.0
    }
}

fn summary(r: &RunReport) -> serde_json::Value {
    let p =
        |v: &[f64]| serde_json::json!({ "p50": percentile(v, 50.0), "p99": percentile(v, 99.0) });
    serde_json::json!({
        "stages": r.stage_names,
        "frames_decoded": r.frames_decoded,
        "frames_dropped": r.frames_dropped,
        "isp_ms": p(&r.latency.isp),
        "encoder_ms": p(&r.latency.encoder),
        "decoder_ms": p(&r.latency.decoder),
        "capture_to_reply_ms": p(&r.latency.end_to_end),
        "staleness_ms": p(&r.staleness_ms),
        "gpu_in_flight_max": r.gpu_in_flight_max,
        "host_waits_per_frame": [
            r.host_waits_per_frame(0),
            r.host_waits_per_frame(1),
            r.host_waits_per_frame(2),
        ],
        "tokens_per_s": r.tokens_per_s(),
        "bytes_copied_per_frame": r.bytes_copied_per_frame(),
        "failure": r.failure.as_ref().map(|f| f.to_string()),
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: encoder_in_chain CONFIG MODEL [FRAMES]";
    let config = PathBuf::from(args.get(1).ok_or(usage)?);
    let model = PathBuf::from(args.get(2).ok_or(usage)?);
    let frames: u64 = args.get(3).map_or(Ok(600), |s| s.parse())?;
    let mut spec = ChainSpec::from_toml_file(&config).map_err(|e| e.to_string())?;
    spec.model = Some(model);
    spec.max_frames = Some(frames);

    let mut runs = Vec::new();
    let mut spans = Vec::new();
    for alone in [true, false] {
        let mut built = build(&spec, false).map_err(|e| e.to_string())?;
        if alone {
            built.chain.decoder = Box::new(NullDecoder);
        }
        // For lining the run up with a clock log (nvidia-smi's timestamps).
        let unix = || {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64())
        };
        let started = unix();
        let report = pipeline::chain::run(
            built.chain,
            &built.options,
            Arc::new(AtomicBool::new(false)),
            |_| {},
        )
        .map_err(|e| e.to_string())?;
        if let Some(f) = &report.failure {
            return Err(f.to_string().into());
        }
        spans.push((started, unix()));
        runs.push(report);
    }
    let encoder_p50 = |r: &RunReport| percentile(&r.latency.encoder, 50.0);
    println!(
        "{}",
        serde_json::to_string_pretty(&serde_json::json!({
            "config": config,
            "frames": frames,
            "alone": summary(&runs[0]),
            "chain": summary(&runs[1]),
            "unix_spans": spans,
            "encoder_p50_chain_over_alone": encoder_p50(&runs[1]) / encoder_p50(&runs[0]).max(1e-9),
        }))?
    );
    Ok(())
}
