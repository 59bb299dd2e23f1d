//! Helpers shared by the integration tests (a module, not a test target of its own).

// Each test target uses some of these.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use npu_hal::sampling::SamplingParams;
use pipeline::decoder::Decoder;
use pipeline::llm::{GenerationStats, Speculation};
use pipeline::speculative::{DraftControl, Drafter};

/// `max_tokens` tokens after `prompt` (no stop tokens), drafted by `drafter` under `control`
/// when given, and the generation's statistics.
pub(crate) fn generate_ids(
    d: &mut Decoder,
    prompt: &[u32],
    max_tokens: usize,
    sampling: &SamplingParams,
    drafter: Option<(&mut dyn Drafter, DraftControl)>,
) -> (Vec<u32>, GenerationStats) {
    let mut out = Vec::new();
    let speculation = drafter.map(|(drafter, control)| Speculation { drafter, control });
    let stats = pipeline::llm::generate_speculative(
        d,
        prompt,
        max_tokens,
        sampling.clone(),
        &[],
        None,
        speculation,
        |t| {
            out.push(t);
            true
        },
    )
    .unwrap();
    (out, stats)
}

/// The committed fixtures.
pub(crate) fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// The tiny SmolVLM checkpoint (tower, connector, text model) with the fixture tokenizer beside
/// it, as one model directory of links under the test target's temp dir, named `name`.
pub(crate) fn tiny_vlm(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for (from, to) in [
        ("tiny-smolvlm/hf/config.json", "config.json"),
        ("tiny-smolvlm/hf/model.safetensors", "model.safetensors"),
        ("tiny-smolvlm/tokenizer/tokenizer.json", "tokenizer.json"),
        (
            "tiny-smolvlm/tokenizer/tokenizer_config.json",
            "tokenizer_config.json",
        ),
    ] {
        let to = dir.join(to);
        if !to.exists() {
            std::os::unix::fs::symlink(fixtures().join(from).canonicalize().unwrap(), &to).unwrap();
        }
    }
    dir
}
