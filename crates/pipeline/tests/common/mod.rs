//! Helpers shared by the integration tests (a module, not a test target of its own).

use std::path::{Path, PathBuf};

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
