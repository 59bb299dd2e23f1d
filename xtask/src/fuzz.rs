//! `cargo xtask fuzz [--seconds N] [TARGET...]`: every cargo-fuzz target of
//! `crates/pipeline/fuzz` (the parsers of untrusted input) for a bounded time each, from its
//! committed seeds, under a 2 GiB address-space limit with libFuzzer's own RSS, malloc and
//! per-input time limits. Any crash, abort, timeout or out-of-memory fails the command; the
//! executions and coverage of each target go to `target/fuzz-report.json` and stdout, its
//! libFuzzer output to `target/fuzz-logs/TARGET.log`.
//!
//! The targets build on the stable toolchain without a sanitizer (`--sanitizer none`): Rust's
//! own checks (bounds, overflow in debug assertions, `unsafe` contracts) are what catch bugs,
//! and the address-space limit turns an unbounded allocation into a failure.
//!
//! A libFuzzer process uses one core, so the targets run as many at a time as the machine has
//! cores: each still gets its `seconds`, and CI's 2 cores fuzz seven targets in four rounds
//! instead of seven.

use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};

/// Every fuzz target, as `crates/pipeline/fuzz/Cargo.toml` names them.
pub(crate) const TARGETS: &[&str] = &[
    "gguf",
    "safetensors_config",
    "y4m",
    "npy",
    "grammar",
    "chat_template",
    "calibration",
];

/// Address space each fuzzer process gets (`ulimit -v`, KiB).
const ADDRESS_SPACE_KIB: u64 = 2 << 20;

/// Runs `targets` (all when empty) for `seconds` each.
pub(crate) fn run(
    root: &Path,
    seconds: u64,
    targets: &[String],
) -> Result<(), Box<dyn std::error::Error>> {
    let fuzz_dir = root.join("crates/pipeline/fuzz");
    let chosen: Vec<&str> = if targets.is_empty() {
        TARGETS.to_vec()
    } else {
        targets.iter().map(String::as_str).collect()
    };
    if let Some(unknown) = chosen.iter().find(|t| !TARGETS.contains(t)) {
        return Err(format!("no fuzz target {unknown}; the targets are {TARGETS:?}").into());
    }
    let have_cargo_fuzz = Command::new("cargo")
        .args(["fuzz", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !have_cargo_fuzz {
        return Err("cargo-fuzz is not installed: cargo install cargo-fuzz --locked".into());
    }
    println!("building the fuzz targets (cargo fuzz build --sanitizer none -O)");
    let status = Command::new("cargo")
        .current_dir(&fuzz_dir)
        .args(["fuzz", "build", "--sanitizer", "none", "-O"])
        .status()?;
    if !status.success() {
        return Err("building the fuzz targets failed".into());
    }
    let mut report = Vec::new();
    let mut failed = Vec::new();
    let at_once = std::thread::available_parallelism().map_or(1, usize::from);
    for round in chosen.chunks(at_once) {
        let mut running = Vec::new();
        for target in round {
            match start(root, &fuzz_dir, target, seconds) {
                Ok(child) => running.push((*target, child)),
                Err(e) => {
                    // Stop the round's other fuzzers (their `cargo fuzz run`) before returning.
                    for (_, mut child) in running {
                        let _ = child.kill();
                        let _ = child.wait();
                    }
                    return Err(format!("starting the {target} fuzzer: {e}").into());
                }
            }
        }
        for (target, mut child) in running {
            let status = child.wait()?;
            let log = std::fs::read(log_path(root, target))?;
            let entry = summarize(target, seconds, status, &String::from_utf8_lossy(&log));
            if !status.success() {
                failed.push(target);
            }
            report.push(entry);
        }
    }
    std::fs::write(
        root.join("target/fuzz-report.json"),
        serde_json::to_string_pretty(&Value::Array(report))? + "\n",
    )?;
    println!("report in target/fuzz-report.json");
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "fuzzing found failures in {failed:?}; reproducers are under target/fuzz-artifacts"
        )
        .into())
    }
}

/// Where `target`'s fuzzer writes its output (stdout and stderr).
fn log_path(root: &Path, target: &str) -> std::path::PathBuf {
    root.join("target/fuzz-logs").join(format!("{target}.log"))
}

/// Starts fuzzing `target` for `seconds` from its seeds (copied into its corpus under
/// `target/fuzz-corpus`), its output to [`log_path`] (a file, so that no fuzzer waits on a
/// full pipe while another one is waited for).
fn start(
    root: &Path,
    fuzz_dir: &Path,
    target: &str,
    seconds: u64,
) -> std::io::Result<std::process::Child> {
    let corpus = root.join("target/fuzz-corpus").join(target);
    std::fs::create_dir_all(&corpus)?;
    for seed in std::fs::read_dir(fuzz_dir.join("seeds").join(target))? {
        let seed = seed?.path();
        if let Some(name) = seed.file_name() {
            std::fs::copy(&seed, corpus.join(name))?;
        }
    }
    let artifacts = root.join("target/fuzz-artifacts").join(target);
    std::fs::create_dir_all(&artifacts)?;
    let script = format!(
        "ulimit -v {ADDRESS_SPACE_KIB} && exec cargo fuzz run --sanitizer none -O {target} \
             '{corpus}' -- -max_total_time={seconds} -rss_limit_mb=2048 -malloc_limit_mb=1024 \
             -timeout=20 -print_final_stats=1 -artifact_prefix='{artifacts}/'",
        corpus = corpus.display(),
        artifacts = artifacts.display(),
    );
    println!("fuzzing {target} for {seconds} s");
    let log = log_path(root, target);
    std::fs::create_dir_all(log.parent().expect("a log directory"))?;
    let log = std::fs::File::create(log)?;
    Command::new("sh")
        .current_dir(fuzz_dir)
        .args(["-c", &script])
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
}

/// The report entry of one finished target (executions, coverage, status), printed; the log's
/// tail goes to stderr when it failed.
fn summarize(target: &str, seconds: u64, status: std::process::ExitStatus, log: &str) -> Value {
    let stat = |key: &str| -> Option<u64> {
        log.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_start_matches(':').trim().parse().ok())
    };
    // The last status line ("#N DONE cov: C ft: F corp: ...") carries the coverage.
    let last = log
        .lines()
        .rev()
        .find(|l| l.contains(" cov: "))
        .unwrap_or("");
    let field = |name: &str| -> Option<u64> {
        last.split_whitespace()
            .skip_while(|w| *w != name)
            .nth(1)
            .and_then(|v| v.parse().ok())
    };
    let entry = json!({
        "target": target,
        "seconds": seconds,
        "executions": stat("stat::number_of_executed_units"),
        "executions_per_s": stat("stat::average_exec_per_sec"),
        "coverage_edges": field("cov:"),
        "features": field("ft:"),
        "corpus_units": field("corp:").or(stat("stat::new_units_added")),
        "peak_rss_mb": stat("stat::peak_rss_mb"),
        "status": if status.success() { "ok" } else { "failed" },
    });
    println!(
        "{target:20} {}: {} executions, cov {} ft {}",
        entry["status"].as_str().unwrap_or(""),
        entry["executions"],
        entry["coverage_edges"],
        entry["features"]
    );
    if !status.success() {
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        eprintln!("{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
    }
    entry
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every target listed here is a `[[bin]]` of the fuzz crate with seeds, and the other way
    /// round.
    #[test]
    fn the_target_list_matches_the_fuzz_crate() {
        let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crates/pipeline/fuzz");
        let manifest = std::fs::read_to_string(fuzz.join("Cargo.toml")).unwrap();
        let bins: Vec<&str> = manifest
            .lines()
            .filter_map(|l| l.strip_prefix("name = \""))
            .filter_map(|l| l.strip_suffix('"'))
            .filter(|n| *n != "pipeline-fuzz")
            .collect();
        assert_eq!(bins, TARGETS);
        for t in TARGETS {
            let seeds = std::fs::read_dir(fuzz.join("seeds").join(t))
                .unwrap()
                .count();
            assert!(seeds > 0, "{t} has no seeds");
        }
    }
}
