//! `cargo xtask soak --minutes N`: the whole chain on a live source for N minutes, watched from
//! outside: the `pipeline run` process's resident memory and open file descriptors, and the
//! frames it has described, sampled over time. A chain that leaks (buffers, imports, fds,
//! threads) shows it as growth; the command fails when RSS or the fd count grows more than 5%
//! after the warm-up (the first quarter of the run), and writes every sample to
//! `target/soak-report.json`.
//!
//! The chain: `pattern:320x240@30 --realtime` (live: frames drop when the decoder is busy),
//! every frame sampled, the tiny SmolVLM fixture as vision tower and decoder (committed, so the
//! soak needs no download), the ISP and encoder on the first Vulkan adapter. It stops the way a
//! user does, with SIGINT, and reads the run's own report.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// Allowed growth of RSS and fds after the warm-up.
const GROWTH_LIMIT: f64 = 0.05;

pub(crate) fn run(root: &Path, minutes: f64) -> Result<(), Box<dyn std::error::Error>> {
    if !(minutes > 0.0 && minutes.is_finite()) {
        return Err(format!("--minutes {minutes}: give a positive number").into());
    }
    let duration = Duration::from_secs_f64(minutes * 60.0);
    println!("building the pipeline binary (the test profile, as `cargo test` does)");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(&cargo)
        .current_dir(root)
        .args([
            "build",
            "--profile",
            "test",
            "--all-features",
            "-p",
            "pipeline",
            "--bin",
            "pipeline",
        ])
        .status()?;
    if !status.success() {
        return Err("building the pipeline binary failed".into());
    }
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let binary = target.join("debug").join("pipeline");
    let dir = target.join("soak");
    std::fs::create_dir_all(&dir)?;
    let model = tiny_model(root, &dir)?;
    let stats = dir.join("stats.json");
    let mut child = Command::new(&binary)
        .args(["run", "--source", "pattern:320x240@30", "--realtime"])
        .arg("--model")
        .arg(&model)
        .arg("--vlm")
        .arg(&model)
        .args(["--every", "1", "--max-tokens", "8", "--policy", "exact-f32"])
        .arg("--cache-dir")
        .arg(dir.join("cache"))
        .arg("--stats-json")
        .arg(&stats)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let pid = child.id();
    let described = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&described);
    let stdout = child.stdout.take().expect("piped");
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if line.starts_with("[frame ") {
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    let stderr = child.stderr.take().expect("piped");
    let err_thread = std::thread::spawn(move || {
        let mut text = String::new();
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            text.push_str(&line);
            text.push('\n');
        }
        text
    });

    let interval = (duration / 12).clamp(Duration::from_secs(2), Duration::from_secs(60));
    println!(
        "soaking `pipeline run` (pid {pid}) for {minutes} min, a sample every {:.0} s",
        interval.as_secs_f64()
    );
    let start = Instant::now();
    let mut samples: Vec<Value> = Vec::new();
    while start.elapsed() < duration {
        std::thread::sleep(interval.min(duration.saturating_sub(start.elapsed())));
        if let Ok(Some(status)) = child.try_wait() {
            let stderr = err_thread.join().unwrap_or_default();
            return Err(format!("pipeline run ended early ({status}):\n{stderr}").into());
        }
        let (rss, fds) = (rss_kib(pid)?, fd_count(pid)?);
        let sample = json!({
            "t_s": (start.elapsed().as_secs_f64() * 10.0).round() / 10.0,
            "rss_kib": rss,
            "fds": fds,
            "frames_described": described.load(Ordering::Relaxed),
        });
        println!(
            "  t {:6.0} s  rss {:7} KiB  fds {:3}  described {}",
            start.elapsed().as_secs_f64(),
            rss,
            fds,
            sample["frames_described"]
        );
        samples.push(sample);
    }
    // Stop as a user does: Ctrl-C, after which the run writes its report.
    let _ = Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status();
    let status = child.wait()?;
    let stderr = err_thread.join().unwrap_or_default();
    if !status.success() {
        return Err(format!("pipeline run failed ({status}):\n{stderr}").into());
    }
    let run: Value = serde_json::from_str(&std::fs::read_to_string(&stats)?)?;

    let verdict = flatness(&samples);
    let report = json!({
        "minutes": minutes,
        "command": format!(
            "pipeline run --source pattern:320x240@30 --realtime --model {m} --vlm {m} --every 1 \
             --max-tokens 8 --policy exact-f32",
            m = model.display()
        ),
        "samples": samples,
        "frames_in": run["frames_in"],
        "frames_described": run["frames_decoded"],
        "frames_dropped": run["frames_dropped"],
        "bytes_copied_per_frame": run["bytes_copied_per_frame"],
        "rss_growth_after_warmup": verdict.rss_growth,
        "fd_growth_after_warmup": verdict.fd_growth,
        "flat": verdict.flat,
    });
    std::fs::write(
        target.join("soak-report.json"),
        serde_json::to_string_pretty(&report)? + "\n",
    )?;
    println!(
        "{} frames in, {} described, {} dropped; after warm-up RSS grew {:+.1}%, fds {:+.1}%; \
         report in target/soak-report.json",
        run["frames_in"],
        run["frames_decoded"],
        run["frames_dropped"],
        verdict.rss_growth * 100.0,
        verdict.fd_growth * 100.0
    );
    if !verdict.flat {
        return Err(format!(
            "RSS or fds grew more than {:.0}% after the warm-up",
            GROWTH_LIMIT * 100.0
        )
        .into());
    }
    Ok(())
}

struct Flatness {
    rss_growth: f64,
    fd_growth: f64,
    flat: bool,
}

/// Growth from the first sample after the warm-up (the first quarter) to the largest later one.
fn flatness(samples: &[Value]) -> Flatness {
    let warm = samples.len() / 4;
    let series = |key: &str| -> Vec<f64> {
        samples[warm.min(samples.len())..]
            .iter()
            .filter_map(|s| s[key].as_f64())
            .collect()
    };
    let growth = |v: &[f64]| match (v.first(), v.iter().copied().reduce(f64::max)) {
        (Some(&first), Some(max)) if first > 0.0 => (max - first) / first,
        _ => 0.0,
    };
    let (rss, fds) = (series("rss_kib"), series("fds"));
    let (rss_growth, fd_growth) = (growth(&rss), growth(&fds));
    // An fd count is small: one more fd is within the limit only if it is within 5%.
    Flatness {
        rss_growth,
        fd_growth,
        flat: rss_growth <= GROWTH_LIMIT && fd_growth <= GROWTH_LIMIT,
    }
}

fn rss_kib(pid: u32) -> Result<u64, Box<dyn std::error::Error>> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| "no VmRSS in /proc/PID/status".into())
}

fn fd_count(pid: u32) -> Result<usize, Box<dyn std::error::Error>> {
    Ok(std::fs::read_dir(format!("/proc/{pid}/fd"))?.count())
}

/// The tiny SmolVLM fixture (tower, connector, text model) with its tokenizer, as one model
/// directory of links.
fn tiny_model(root: &Path, dir: &Path) -> Result<PathBuf, Box<dyn std::error::Error>> {
    let model = dir.join("tiny-smolvlm");
    std::fs::create_dir_all(&model)?;
    for (from, name) in [
        ("tiny-smolvlm/hf/config.json", "config.json"),
        ("tiny-smolvlm/hf/model.safetensors", "model.safetensors"),
        ("tiny-smolvlm/tokenizer/tokenizer.json", "tokenizer.json"),
        (
            "tiny-smolvlm/tokenizer/tokenizer_config.json",
            "tokenizer_config.json",
        ),
    ] {
        let to = model.join(name);
        if !to.exists() {
            std::os::unix::fs::symlink(root.join("fixtures").join(from).canonicalize()?, &to)?;
        }
    }
    Ok(model)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_is_measured_after_the_warm_up() {
        let s = |rss: u64, fds: u64| json!({"rss_kib": rss, "fds": fds});
        // A big warm-up, then flat: flat.
        let flat = [
            s(10, 5),
            s(100, 9),
            s(100, 9),
            s(101, 9),
            s(102, 9),
            s(101, 9),
        ];
        assert!(flatness(&flat).flat);
        // Steady growth after the warm-up: not flat.
        let leak = [
            s(100, 9),
            s(100, 9),
            s(104, 9),
            s(108, 9),
            s(112, 9),
            s(116, 10),
        ];
        let v = flatness(&leak);
        assert!(!v.flat && v.rss_growth > 0.1, "{}", v.rss_growth);
    }
}
