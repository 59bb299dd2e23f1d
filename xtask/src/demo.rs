//! `cargo xtask demo`: the whole chain on a committed clip with a real decoder, in one command.
//!
//! It fetches SmolLM2-135M-Instruct if it is missing, builds the `pipeline` binary (release),
//! and runs `pipeline run` on `fixtures/clips/testsrc2-256x144.y4m` (a moving ffmpeg test
//! pattern): the GPU ISP and encoder on the first Vulkan adapter (lavapipe on a machine without
//! a GPU), the decoder on the CPU reference NPU. No trained SmolVLM vision tower is among the
//! sources this project can fetch, so without `--vlm DIR` the encoder is the documented
//! synthetic tower and the binary says so before any text: the replies are SmolLM2 talking
//! about meaningless image embeddings. With `--vlm DIR` (a SmolVLM checkpoint directory) the
//! tower, connector and text model all come from it and the replies describe the frames.

use std::path::{Path, PathBuf};
use std::process::Command;

/// What `cargo xtask demo` takes.
#[derive(clap::Args, Debug)]
pub(crate) struct DemoArgs {
    /// A SmolVLM checkpoint directory (vision tower, connector and text model).
    #[arg(long)]
    vlm: Option<PathBuf>,
    /// Another source instead of the committed clip (file:..., pattern:..., camera:...).
    #[arg(long)]
    source: Option<String>,
    /// Describe every N-th frame.
    #[arg(long, default_value_t = 5)]
    every: u64,
    /// Most tokens per reply.
    #[arg(long, default_value_t = 24)]
    max_tokens: usize,
    /// Extra arguments passed to `pipeline run` as they are.
    #[arg(last = true)]
    extra: Vec<String>,
}

pub(crate) fn run(root: &Path, args: &DemoArgs) -> Result<(), Box<dyn std::error::Error>> {
    let model = match &args.vlm {
        Some(dir) => dir.clone(),
        None => crate::fetch::fetch(root, "smollm2-135m")?,
    };
    eprintln!("building the pipeline binary (release)...");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(&cargo)
        .current_dir(root)
        .args(["build", "--release", "-p", "pipeline", "--bin", "pipeline"])
        .status()?;
    if !status.success() {
        return Err("building the pipeline binary failed".into());
    }
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let binary = target.join("release").join("pipeline");
    let source = args.source.clone().unwrap_or_else(|| {
        format!(
            "file:{}",
            root.join("fixtures/clips/testsrc2-256x144.y4m").display()
        )
    });
    let stats = target.join("demo-stats.json");
    let trace = target.join("demo-trace.json");
    let mut command = Command::new(&binary);
    command
        .args(["run", "--source", &source, "--model"])
        .arg(&model)
        .args(["--prompt", "Describe the scene."])
        .args(["--every", &args.every.to_string()])
        .args(["--max-tokens", &args.max_tokens.to_string()])
        .arg("--stats-json")
        .arg(&stats)
        .arg("--trace")
        .arg(&trace);
    if let Some(dir) = &args.vlm {
        command.arg("--vlm").arg(dir);
    }
    command.args(&args.extra);
    eprintln!("running {command:?}");
    let status = command.status()?;
    if !status.success() {
        return Err(format!("pipeline run failed ({status})").into());
    }
    eprintln!(
        "statistics: {}\ntrace: {} (open in ui.perfetto.dev)",
        stats.display(),
        trace.display()
    );
    Ok(())
}
