//! `cargo xtask device-test [--vm]`: discover the hardware, then run every hardware test whose
//! needs the machine meets, and report each as passed, failed or unsupported (with the reason), so
//! a device lab sees exactly which real paths ran. An absent device is "unsupported", never a pass.
//!
//! The test binaries are built once on the host (`cargo test --no-run`) and each hardware test is
//! run from its binary by exact name. With `--vm` they run inside a qemu guest that boots Debian's
//! Linux 6.12 with vivid, udmabuf, DMA-BUF heaps, vgem and virtio-gpu ([`crate::vm`]): the guest
//! mounts the host's root read-only, so the same binaries run there unchanged, and the guest half
//! of this module (`--guest PLAN`, started by the guest's init) probes the guest's devices and
//! runs the plan. Results from the VM come from real kernel drivers over virtual devices, not real
//! silicon, and the report's `environment` says so.
//!
//! The report goes to `target/device-report.json` (environment, the discovery report and the
//! results) and `target/device-report.md` (a table). The command fails when any test that ran
//! failed, and with `--vm` also when the guest ended before it had run every test.
//!
//! Every `#[ignore = "hardware: ..."]` test in the workspace must be listed in [`TESTS`]; a test
//! of this module scans the sources and fails on one that is not, so no hardware path is
//! silently left out of device runs.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// What a hardware test needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Need {
    DmaHeap,
    Udmabuf,
    DrmRenderNode,
    /// A vgem render node (real kernel fences on a virtual GEM device).
    Vgem,
    Camera,
    Accel,
    Vulkan,
    /// A Vulkan adapter with cooperative matrices (tensor cores) and f16 shaders.
    VulkanCoopMatrix,
    /// A Vulkan adapter whose timeline semaphores other devices can import (opaque fds).
    VulkanTimelineExport,
    /// A Vulkan adapter that imports dma-bufs (`VK_EXT_external_memory_dma_buf`).
    VulkanDmaBufImport,
}

/// Where a test lives: the package's library tests or an integration-test target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Target {
    Lib,
    Test(&'static str),
}

#[derive(Clone, Copy, Debug)]
struct HardwareTest {
    package: &'static str,
    target: Target,
    /// The test's full name as the harness prints it.
    name: &'static str,
    /// Every need must be met for the test to run.
    needs: &'static [Need],
    /// Ignored unless a device is there (`--ignored`), or run everywhere a driver exists.
    ignored: bool,
    /// Run in the VM lab's guest too. Off for GPU tests with no kernel driver in their path
    /// (host memory on lavapipe): the guest would only repeat the host's run, on the same
    /// lavapipe under emulated CPUs, which took most of the lab's time.
    in_vm: bool,
}

/// A hardware test that also runs in CI's ordinary `cargo test` (lavapipe): listed so a device
/// report names it, run without `--ignored`.
const fn in_ci(
    package: &'static str,
    target: Target,
    name: &'static str,
    needs: &'static [Need],
) -> HardwareTest {
    HardwareTest {
        ignored: false,
        ..hw(package, target, name, needs)
    }
}

/// An [`in_ci`] GPU test that the VM lab skips (see [`HardwareTest::in_vm`]).
const fn host_gpu(
    package: &'static str,
    target: Target,
    name: &'static str,
    needs: &'static [Need],
) -> HardwareTest {
    HardwareTest {
        in_vm: false,
        ..in_ci(package, target, name, needs)
    }
}

const fn hw(
    package: &'static str,
    target: Target,
    name: &'static str,
    needs: &'static [Need],
) -> HardwareTest {
    HardwareTest {
        package,
        target,
        name,
        needs,
        ignored: true,
        in_vm: true,
    }
}

/// Every hardware test of the workspace.
const TESTS: &[HardwareTest] = &[
    hw(
        "uvm-alloc",
        Target::Test("alloc"),
        "dma_heap_buffers_sync_cpu_access",
        &[Need::DmaHeap],
    ),
    hw(
        "uvm-alloc",
        Target::Test("alloc"),
        "a_dma_buf_from_a_heap_imports_and_reads_back_what_was_written",
        &[Need::DmaHeap],
    ),
    hw(
        "uvm-alloc",
        Target::Test("alloc"),
        "udmabuf_buffers_sync_cpu_access",
        &[Need::Udmabuf],
    ),
    hw(
        "sync-timeline",
        Target::Test("drm"),
        "syncobj_timeline_signal_wait_query",
        &[Need::DrmRenderNode],
    ),
    hw(
        "sync-timeline",
        Target::Test("drm"),
        "sync_file_round_trip_of_a_point",
        &[Need::DrmRenderNode],
    ),
    hw(
        "sync-timeline",
        Target::Test("drm"),
        "transfer_between_timelines",
        &[Need::DrmRenderNode],
    ),
    hw(
        "sync-timeline",
        Target::Test("drm"),
        "a_vgem_fence_bridges_into_a_syncobj_timeline_point",
        &[Need::Vgem, Need::DrmRenderNode],
    ),
    hw(
        "isp-v4l2",
        Target::Lib,
        "v4l2::tests::a_camera_streams_frames_into_exported_dma_bufs",
        &[Need::Camera],
    ),
    hw(
        "isp-v4l2",
        Target::Lib,
        "v4l2::tests::announced_frames_are_the_frames_the_camera_delivers",
        &[Need::Camera],
    ),
    hw(
        "isp-v4l2",
        Target::Lib,
        "v4l2::tests::a_camera_captures_into_imported_dma_heap_buffers",
        &[Need::Camera, Need::DmaHeap],
    ),
    hw(
        "pipeline",
        Target::Test("chain"),
        "the_chain_describes_camera_frames",
        &[Need::Camera],
    ),
    hw(
        "pipeline",
        Target::Test("chain"),
        "camera_frames_are_submitted_ahead_to_the_gpu_isp",
        &[Need::Camera, Need::VulkanDmaBufImport],
    ),
    hw(
        "pipeline",
        Target::Test("chain"),
        "the_frames_handoff_rides_a_drm_syncobj_timeline",
        &[Need::DrmRenderNode],
    ),
    hw(
        "npu-hal",
        Target::Lib,
        "accel::tests::every_accel_node_identifies_its_driver",
        &[Need::Accel],
    ),
    // Real GPU paths that also run in CI (lavapipe): listed so a device report names them.
    in_ci(
        "uvm-alloc",
        Target::Test("zero_copy"),
        "shader_writes_the_pages_the_cpu_mapped",
        &[Need::Vulkan],
    ),
    in_ci(
        "pipeline",
        Target::Test("vision"),
        "gpu_encoder_matches_the_cpu_reference_on_a_wider_tower",
        &[Need::Vulkan],
    ),
    in_ci(
        "pipeline",
        Target::Test("chain"),
        "the_gpu_chain_decodes_every_sampled_frame_with_zero_copies",
        &[Need::Vulkan],
    ),
    hw(
        "pipeline",
        Target::Test("vision"),
        "the_coop_matrix_encoder_matches_the_cpu_reference",
        &[Need::VulkanCoopMatrix],
    ),
    // The decoder on npu-hal's GPU backend against the CPU NPU.
    host_gpu(
        "npu-hal",
        Target::Test("gpu_vs_cpu"),
        "mx_weights_match_the_cpu",
        &[Need::Vulkan],
    ),
    host_gpu(
        "npu-hal",
        Target::Test("gpu_vs_cpu"),
        "dense_and_ggml_weights_match_the_cpu",
        &[Need::Vulkan],
    ),
    host_gpu(
        "npu-hal",
        Target::Test("gpu_vs_cpu"),
        "every_kv_dtype_matches_the_cpu",
        &[Need::Vulkan],
    ),
    host_gpu(
        "npu-hal",
        Target::Test("gpu_vs_cpu"),
        "block_rotated_mx_weights_match_the_cpu",
        &[Need::Vulkan],
    ),
    host_gpu(
        "npu-hal",
        Target::Test("gpu_vs_cpu"),
        "the_gpu_rotates_activations_with_the_cpus_bits",
        &[Need::Vulkan],
    ),
    host_gpu(
        "npu-hal",
        Target::Test("gpu_vs_cpu"),
        "unified_embeddings_are_read_in_place",
        &[Need::Vulkan],
    ),
    host_gpu(
        "npu-hal",
        Target::Test("gpu_vs_cpu"),
        "attention_statistics_match_the_cpu",
        &[Need::Vulkan],
    ),
    host_gpu(
        "npu-hal",
        Target::Test("gpu_vs_cpu"),
        "a_long_batch_linear_matches_the_cpu",
        &[Need::Vulkan],
    ),
    host_gpu(
        "npu-hal",
        Target::Test("gpu_vs_cpu"),
        "a_split_k_gemm_matches_the_cpu",
        &[Need::Vulkan],
    ),
    host_gpu(
        "npu-hal",
        Target::Test("gpu_vs_cpu"),
        "every_gemv_lane_count_matches_the_cpu",
        &[Need::Vulkan],
    ),
    host_gpu(
        "npu-hal",
        Target::Test("gpu_vs_cpu"),
        "every_host_wait_reads_the_same_logits",
        &[Need::Vulkan],
    ),
    host_gpu(
        "npu-hal",
        Target::Test("gpu_vs_cpu"),
        "a_held_step_runs_on_release_as_a_plain_one",
        &[Need::Vulkan],
    ),
    host_gpu(
        "npu-hal",
        Target::Test("gpu_vs_cpu"),
        "row_argmax_is_the_argmax_of_the_row",
        &[Need::Vulkan],
    ),
    hw(
        "npu-hal",
        Target::Test("gpu_vs_cpu"),
        "tensor_core_gemms_match_the_cpu_and_the_simt_gemm",
        &[Need::VulkanCoopMatrix],
    ),
    hw(
        "npu-hal",
        Target::Test("gpu_vs_cpu"),
        "a_gpu_waits_on_another_devices_timeline_in_its_queue",
        &[Need::VulkanTimelineExport],
    ),
    in_ci(
        "pipeline",
        Target::Test("chain"),
        "the_gpu_decoder_reads_the_encoders_embeddings_in_place",
        &[Need::Vulkan],
    ),
    hw(
        "pipeline",
        Target::Test("chain"),
        "the_gpu_decoder_waits_for_the_encoder_in_its_queue",
        &[Need::VulkanTimelineExport],
    ),
    host_gpu(
        "pipeline",
        Target::Test("gpu_decoder"),
        "gpu_decoder_logits_match_the_cpu_on_tiny_llama",
        &[Need::Vulkan],
    ),
    host_gpu(
        "pipeline",
        Target::Test("gpu_decoder"),
        "gpu_decoder_greedy_ids_agree_with_the_cpu",
        &[Need::Vulkan],
    ),
    host_gpu(
        "pipeline",
        Target::Test("gpu_decoder"),
        "gpu_speculative_greedy_output_is_plain_greedy_output",
        &[Need::Vulkan],
    ),
    host_gpu(
        "pipeline",
        Target::Test("gpu_decoder"),
        "gpu_decoder_prunes_under_every_policy_as_the_cpu_does",
        &[Need::Vulkan],
    ),
    host_gpu(
        "pipeline",
        Target::Test("gpu_decoder"),
        "queued_decode_steps_show_the_plain_loops_logits",
        &[Need::Vulkan],
    ),
];

/// Whether the discovery `report` shows what `need` asks for; `Err` says why not.
fn need_met(report: &Value, need: Need) -> Result<String, String> {
    let class = match need {
        Need::DmaHeap => "dma_heaps",
        Need::Udmabuf => "udmabuf",
        Need::DrmRenderNode | Need::Vgem => "drm_render_nodes",
        Need::Camera => "v4l2_devices",
        Need::Accel => "accel_devices",
        Need::Vulkan
        | Need::VulkanCoopMatrix
        | Need::VulkanTimelineExport
        | Need::VulkanDmaBufImport => "vulkan",
    };
    let entry = &report[class];
    if entry.get("present").and_then(Value::as_bool) == Some(false) {
        return Err(format!(
            "{class} absent: {}",
            entry
                .get("reason")
                .and_then(Value::as_str)
                .unwrap_or("not found")
        ));
    }
    let items = entry.get("items").and_then(Value::as_array);
    // Needs met by an adapter whose `xtask devices` entry has every one of these keys true:
    // the keys, what a match is, and what no match means.
    let capability: Option<(&[&str], &str, &str)> = match need {
        Need::VulkanCoopMatrix => Some((
            &["cooperative_matrix", "shader_f16"],
            "with cooperative matrices",
            "offers cooperative matrices with f16 shaders",
        )),
        Need::VulkanTimelineExport => Some((
            &["exports_timelines"],
            "export timeline semaphores",
            "exports timeline semaphores as opaque fds",
        )),
        Need::VulkanDmaBufImport => Some((
            &["imports_dma_bufs"],
            "import dma-bufs",
            "imports dma-bufs (VK_EXT_external_memory_dma_buf)",
        )),
        _ => None,
    };
    if let Some((keys, found_what, missing_what)) = capability {
        let found = items.map_or(0, |items| {
            items
                .iter()
                .filter(|i| keys.iter().all(|k| i[*k] == Value::Bool(true)))
                .count()
        });
        return if found > 0 {
            Ok(format!("vulkan: {found} adapter(s) {found_what}"))
        } else {
            Err(format!("vulkan: no adapter {missing_what}"))
        };
    }
    if need == Need::Vgem {
        let vgem = items.and_then(|items| items.iter().find(|i| i["description"] == "vgem"));
        return match vgem {
            Some(node) => Ok(format!("vgem: {}", node["path"].as_str().unwrap_or("?"))),
            None => Err("drm_render_nodes: no vgem node (modprobe vgem)".into()),
        };
    }
    match items {
        Some(items) if items.is_empty() => Err(format!("{class}: none found")),
        Some(items) => Ok(format!("{class}: {} found", items.len())),
        // A single node (udmabuf) reports present without items.
        None => Ok(format!("{class}: present")),
    }
}

/// Whether every need of `test` is met: the joined findings, or the first reason it is not.
fn needs_met(report: &Value, test: &HardwareTest) -> Result<String, String> {
    let found: Result<Vec<String>, String> =
        test.needs.iter().map(|&n| need_met(report, n)).collect();
    found.map(|f| f.join("; "))
}

/// `cargo xtask device-test`'s options.
#[derive(Debug, Default)]
pub(crate) struct Options {
    /// Run the tests inside the qemu lab instead of on this machine.
    pub(crate) vm: bool,
    /// Internal: the guest half, run by the VM's init with the plan the host wrote.
    pub(crate) guest: Option<PathBuf>,
    /// How long one test may run before it is killed and reported failed.
    pub(crate) test_timeout: Duration,
}

/// One planned test run: what to execute, from where, and what it needs.
#[derive(Clone, Debug)]
struct Planned {
    test: HardwareTest,
    executable: PathBuf,
    /// The package's directory: cargo runs test binaries from there.
    cwd: PathBuf,
}

impl Planned {
    fn to_json(&self) -> Value {
        json!({
            "package": self.test.package,
            "name": self.test.name,
            "executable": self.executable,
            "cwd": self.cwd,
        })
    }
}

/// Runs `cargo xtask device-test` (host or VM) or, with `guest`, its guest half.
pub(crate) fn run(root: &Path, options: &Options) -> Result<(), Box<dyn std::error::Error>> {
    if let Some(plan) = &options.guest {
        return guest(plan, options.test_timeout);
    }
    let plan = build_plan(root)?;
    let target = root.join("target");
    std::fs::create_dir_all(&target)?;
    let (environment, report, results) = if options.vm {
        let (in_vm, host_only): (Vec<Planned>, Vec<Planned>) =
            plan.into_iter().partition(|p| p.test.in_vm);
        let lab = crate::vm::Lab::prepare(root)?;
        let out = lab.run_plan(&plan_json(&in_vm, options.test_timeout))?;
        let mut results = merge_guest_results(&in_vm, &out.results);
        results.extend(host_only.iter().map(|p| {
            result_json(
                &p.test,
                "skipped",
                "not run in the VM lab: no kernel driver in its path, and the host runs it on \
                 the same lavapipe",
                0.0,
            )
        }));
        (out.environment, out.devices, results)
    } else {
        let report = crate::devices::probe();
        crate::devices::print_report(&report);
        println!();
        let results = plan
            .iter()
            .map(|p| run_one(&report, p, options.test_timeout))
            .collect();
        (host_environment(), report, results)
    };
    write_report(&target, &environment, &report, &results)?;
    let count = |s: &str| results.iter().filter(|r| r["status"] == s).count();
    let skipped = match count("skipped") {
        0 => String::new(),
        n => format!(", {n} skipped in the VM (host-only GPU tests)"),
    };
    println!(
        "\n{} passed, {} failed, {} unsupported{skipped}; report in target/device-report.json and .md",
        count("passed"),
        count("failed"),
        count("unsupported")
    );
    if count("failed") > 0 {
        return Err(format!("{} hardware test(s) failed", count("failed")).into());
    }
    Ok(())
}

/// What this machine is, for the report.
fn host_environment() -> Value {
    json!({
        "kind": "host",
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_owned())
            .unwrap_or_default(),
    })
}

/// Builds every test binary (all features, the test profile) and pairs each listed test with its
/// executable.
fn build_plan(root: &Path) -> Result<Vec<Planned>, Box<dyn std::error::Error>> {
    println!("building the test binaries (cargo test --workspace --all-features --no-run)");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut child = Command::new(cargo)
        .current_dir(root)
        .args([
            "test",
            "--workspace",
            "--all-features",
            "--no-run",
            "--message-format=json-render-diagnostics",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let stdout = child.stdout.take().expect("stdout was piped");
    // (package, target) -> (executable, package directory)
    let mut binaries: HashMap<(String, Target), (PathBuf, PathBuf)> = HashMap::new();
    for line in std::io::BufReader::new(stdout).lines() {
        let msg: Value = match serde_json::from_str(&line?) {
            Ok(v) => v,
            Err(_) => continue,
        };
        if msg["reason"] != "compiler-artifact" || msg["profile"]["test"] != true {
            continue;
        }
        let (Some(exe), Some(manifest), Some(id)) = (
            msg["executable"].as_str(),
            msg["manifest_path"].as_str(),
            msg["package_id"].as_str(),
        ) else {
            continue;
        };
        let dir = Path::new(manifest)
            .parent()
            .ok_or("a manifest path without a directory")?;
        let package = package_name(id, dir);
        let kinds = msg["target"]["kind"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let target_name = msg["target"]["name"].as_str().unwrap_or("");
        for test in TESTS.iter().filter(|t| t.package == package) {
            let matches = match test.target {
                Target::Lib => kinds.iter().any(|k| k == "lib"),
                Target::Test(name) => kinds.iter().any(|k| k == "test") && target_name == name,
            };
            if matches {
                binaries.insert(
                    (package.clone(), test.target),
                    (PathBuf::from(exe), dir.to_owned()),
                );
            }
        }
    }
    if !child.wait()?.success() {
        return Err("building the test binaries failed (see cargo's output above)".into());
    }
    TESTS
        .iter()
        .map(|t| {
            let (executable, cwd) = binaries
                .get(&(t.package.to_owned(), t.target))
                .cloned()
                .ok_or_else(|| {
                    format!(
                        "no test binary for {} {:?}: renamed or removed?",
                        t.package, t.target
                    )
                })?;
            Ok(Planned {
                test: *t,
                executable,
                cwd,
            })
        })
        .collect()
}

/// A package's name from cargo's package id (`path+file:///dir#name@1.0` or, when the name is
/// the directory's, `path+file:///dir#1.0`).
fn package_name(id: &str, dir: &Path) -> String {
    match id
        .rsplit_once('#')
        .and_then(|(_, tail)| tail.split_once('@'))
    {
        Some((name, _)) => name.to_owned(),
        None => dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
    }
}

fn plan_json(plan: &[Planned], test_timeout: Duration) -> Value {
    json!({
        "test_timeout_s": test_timeout.as_secs(),
        "tests": plan.iter().map(Planned::to_json).collect::<Vec<_>>(),
    })
}

/// Runs one planned test if its needs are met; the result as the report records it.
fn run_one(report: &Value, planned: &Planned, timeout: Duration) -> Value {
    let t = &planned.test;
    let (status, detail, seconds) = match needs_met(report, t) {
        Err(why) => ("unsupported", why, 0.0),
        Ok(found) => {
            let start = Instant::now();
            let (status, detail) = match execute(planned, timeout) {
                Ok(details) if details.is_empty() => ("passed", found),
                Ok(details) => ("passed", format!("{found}; {details}")),
                Err(why) => ("failed", why),
            };
            (status, detail, start.elapsed().as_secs_f64())
        }
    };
    println!("{status:12} {}::{} ({detail})", t.package, t.name);
    result_json(t, status, &detail, seconds)
}

/// One result as the report records it.
fn result_json(t: &HardwareTest, status: &str, detail: &str, seconds: f64) -> Value {
    json!({
        "package": t.package,
        "test": t.name,
        "need": t.needs.iter().map(|n| format!("{n:?}")).collect::<Vec<_>>().join("+"),
        "status": status,
        "detail": detail,
        "seconds": (seconds * 10.0_f64).round() / 10.0,
    })
}

/// A test's output line that starts with this is a figure for the report's detail column.
const DETAIL_PREFIX: &str = "device-test detail:";

/// Runs the test binary for exactly this test: the detail lines it printed, or why it failed.
fn execute(planned: &Planned, timeout: Duration) -> Result<String, String> {
    let t = &planned.test;
    let mut cmd = Command::new(&planned.executable);
    // --nocapture: a test's `device-test detail:` lines (what it measured) reach the report.
    cmd.current_dir(&planned.cwd)
        .args(["--exact", t.name, "--test-threads=1", "--nocapture"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if t.ignored {
        cmd.arg("--ignored");
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", planned.executable.display()))?;
    // Drain both pipes on threads so a chatty test never blocks on a full pipe.
    let drain = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_string(&mut text);
            }
            text
        })
    };
    let out = drain(child.stdout.take().map(|p| Box::new(p) as _));
    let err = drain(child.stderr.take().map(|p| Box::new(p) as _));
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if start.elapsed() > timeout => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(format!("waiting for the test: {e}")),
        }
    };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    let Some(status) = status else {
        return Err(format!("timed out after {timeout:?} and was killed"));
    };
    if status.success() && stdout.contains("test result: ok. 1 passed") {
        // A test that found no device says so with a SKIPPED line and passes (cargo test's
        // only way out): here its device was found, so that is a failure, never a pass.
        if let Some(line) = stdout
            .lines()
            .chain(stderr.lines())
            .find(|l| l.trim_start().starts_with("SKIPPED"))
        {
            return Err(format!(
                "the test skipped itself although its device was found: {}",
                line.trim()
            ));
        }
        let details: Vec<&str> = stdout
            .lines()
            .chain(stderr.lines())
            .filter_map(|l| l.strip_prefix(DETAIL_PREFIX))
            .map(str::trim)
            .collect();
        return Ok(details.join("; "));
    }
    if status.success() {
        return Err("the test did not run (renamed or filtered out?)".into());
    }
    // A panic's message is the line after its "panicked at": kept with it, so the report
    // says what failed, not only where.
    let lines: Vec<&str> = stderr.lines().chain(stdout.lines()).collect();
    let tail: Vec<&str> = lines
        .iter()
        .enumerate()
        .filter(|(i, l)| {
            l.contains("panicked")
                || l.contains("error")
                || l.contains("FAILED")
                || (*i > 0 && lines[i - 1].contains("panicked"))
        })
        .map(|(_, l)| *l)
        .take(5)
        .collect();
    Err(if tail.is_empty() {
        format!("exited with {status}")
    } else {
        tail.join(" | ")
    })
}

/// The guest half: probe the guest's devices, run the plan, and write each result as a line of
/// `results.jsonl` beside the plan as soon as it is known, so a guest that dies mid-run still
/// leaves the results it had.
fn guest(plan_path: &Path, default_timeout: Duration) -> Result<(), Box<dyn std::error::Error>> {
    let plan: Value = serde_json::from_str(&std::fs::read_to_string(plan_path)?)?;
    let dir = plan_path.parent().ok_or("the plan has no directory")?;
    let report = crate::devices::probe();
    crate::devices::print_report(&report);
    std::fs::write(
        dir.join("devices.json"),
        serde_json::to_string_pretty(&report)? + "\n",
    )?;
    // The kernel and the modules it runs, as the guest sees them.
    let modules: Vec<String> = std::fs::read_to_string("/proc/modules")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect();
    let guest = json!({
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_owned())
            .unwrap_or_default(),
        "modules": modules,
    });
    std::fs::write(dir.join("guest.json"), guest.to_string() + "\n")?;
    let timeout = plan["test_timeout_s"]
        .as_u64()
        .map_or(default_timeout, Duration::from_secs);
    let mut results = std::fs::File::create(dir.join("results.jsonl"))?;
    for entry in plan["tests"].as_array().ok_or("the plan lists no tests")? {
        let (package, name) = (
            entry["package"].as_str().unwrap_or(""),
            entry["name"].as_str().unwrap_or(""),
        );
        let Some(test) = TESTS
            .iter()
            .find(|t| t.package == package && t.name == name)
        else {
            return Err(format!(
                "the plan names {package}::{name}, which this build does not list"
            )
            .into());
        };
        let planned = Planned {
            test: *test,
            executable: PathBuf::from(entry["executable"].as_str().unwrap_or("")),
            cwd: PathBuf::from(entry["cwd"].as_str().unwrap_or("/")),
        };
        let result = run_one(&report, &planned, timeout);
        writeln!(results, "{result}")?;
        results.sync_all()?;
    }
    Ok(())
}

/// The VM's results in the plan's order; a test the guest never reported is a failure, since the
/// guest ended (crashed, hung, ran out of time) before it could run it.
fn merge_guest_results(plan: &[Planned], reported: &[Value]) -> Vec<Value> {
    plan.iter()
        .map(|p| {
            reported
                .iter()
                .find(|r| r["test"] == p.test.name && r["package"] == p.test.package)
                .cloned()
                .unwrap_or_else(|| {
                    result_json(
                        &p.test,
                        "failed",
                        "the VM ended before this test reported (see target/vm/console.log)",
                        0.0,
                    )
                })
        })
        .collect()
}

fn write_report(
    target: &Path,
    environment: &Value,
    devices: &Value,
    results: &[Value],
) -> Result<(), Box<dyn std::error::Error>> {
    let full = json!({ "environment": environment, "devices": devices, "tests": results });
    std::fs::write(
        target.join("device-report.json"),
        serde_json::to_string_pretty(&full)? + "\n",
    )?;
    let mut md = String::from("# Device test report\n\n");
    if let Some(env) = environment.as_object() {
        for (k, v) in env {
            let v = match v {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            md += &format!("- {k}: {v}\n");
        }
        md += "\n";
    }
    md += "| package | test | needs | result | seconds | detail |\n|---|---|---|---|---|---|\n";
    for r in results {
        let f = |k: &str| r[k].as_str().unwrap_or("").replace('|', "/");
        md += &format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            f("package"),
            f("test"),
            f("need"),
            f("status"),
            r["seconds"],
            f("detail")
        );
    }
    std::fs::write(target.join("device-report.md"), md)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `#[ignore = "hardware: ..."]` test in the workspace is in [`TESTS`].
    #[test]
    fn every_hardware_test_is_listed() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let mut missing = Vec::new();
        let mut stack = vec![root.join("crates")];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).unwrap().filter_map(Result::ok) {
                let path = entry.path();
                if path.is_dir() {
                    stack.push(path);
                    continue;
                }
                if path.extension().is_none_or(|e| e != "rs") {
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap();
                let lines: Vec<&str> = text.lines().collect();
                for (i, line) in lines.iter().enumerate() {
                    if !line.contains("#[ignore = \"hardware:") {
                        continue;
                    }
                    let name = lines[i + 1..]
                        .iter()
                        .find_map(|l| {
                            l.trim()
                                .strip_prefix("fn ")
                                .and_then(|r| r.split('(').next())
                        })
                        .unwrap_or("?");
                    if !TESTS.iter().any(|t| t.name.ends_with(name)) {
                        missing.push(format!("{}: {name}", path.display()));
                    }
                }
            }
        }
        assert!(
            missing.is_empty(),
            "hardware tests missing from xtask/src/device_test.rs TESTS: {missing:?}"
        );
    }

    #[test]
    fn absent_classes_are_unsupported_with_the_reason() {
        let report = json!({
            "dma_heaps": {"present": false, "reason": "/dev/dma_heap does not exist"},
            "vulkan": {"items": [{"name": "llvmpipe"}]},
            "accel_devices": {"items": []},
            "drm_render_nodes": {"present": true, "items": [
                {"path": "/dev/dri/renderD128", "description": "virtio_gpu"}]},
        });
        assert!(
            need_met(&report, Need::DmaHeap)
                .unwrap_err()
                .contains("does not exist")
        );
        assert!(need_met(&report, Need::Vulkan).is_ok());
        assert!(need_met(&report, Need::Accel).is_err());
        assert!(need_met(&report, Need::DrmRenderNode).is_ok());
        assert!(need_met(&report, Need::Vgem).unwrap_err().contains("vgem"));
        let camera_and_heap = TESTS
            .iter()
            .find(|t| t.needs == [Need::Camera, Need::DmaHeap])
            .unwrap();
        assert!(needs_met(&report, camera_and_heap).is_err());
    }

    #[test]
    fn package_names_come_from_cargo_package_ids() {
        let dir = Path::new("/w/crates/uvm-alloc");
        assert_eq!(
            package_name("path+file:///w/crates/uvm-alloc#0.1.0", dir),
            "uvm-alloc"
        );
        assert_eq!(
            package_name("path+file:///w/crates/x#uvm-alloc@0.1.0", dir),
            "uvm-alloc"
        );
    }

    /// The guest finds a planned test by package and name: each pair names one test.
    #[test]
    fn listed_tests_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for t in TESTS {
            assert!(
                seen.insert((t.package, t.name)),
                "{}::{} twice",
                t.package,
                t.name
            );
        }
    }

    /// A test that passed by skipping itself (its device was found, or it would not have
    /// run) is a failure; one that ran passes with its details.
    #[test]
    fn a_test_that_skipped_itself_fails() {
        let dir = std::env::temp_dir().join(format!("device-test-skip-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let run = |name: &str, stderr: &str| {
            let exe = dir.join(name);
            std::fs::write(
                &exe,
                format!("#!/bin/sh\necho '{stderr}' >&2\necho 'test result: ok. 1 passed'\n"),
            )
            .unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
            let planned = Planned {
                test: TESTS[0],
                executable: exe,
                cwd: dir.clone(),
            };
            execute(&planned, Duration::from_secs(30))
        };
        let skipped = run("skips", "SKIPPED: no Vulkan device").unwrap_err();
        assert!(skipped.contains("skipped itself"), "{skipped}");
        assert_eq!(
            run("runs", "device-test detail: 3 frames").unwrap(),
            "3 frames"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A test the guest never reported is a failure, never silently missing.
    #[test]
    fn unreported_guest_tests_fail() {
        let plan = vec![Planned {
            test: TESTS[0],
            executable: PathBuf::from("/x"),
            cwd: PathBuf::from("/"),
        }];
        let merged = merge_guest_results(&plan, &[]);
        assert_eq!(merged[0]["status"], "failed");
    }
}
