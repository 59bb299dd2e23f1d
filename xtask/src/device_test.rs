//! `cargo xtask device-test`: discover the hardware, then run every hardware test whose needs this
//! machine meets, and report each as passed, failed or unsupported (with the reason), so a device
//! lab sees exactly which real paths ran. An absent device is "unsupported", never a pass.
//!
//! The report goes to `target/device-report.json` (the discovery report plus the results) and
//! `target/device-report.md` (a table). The command fails when any test that ran failed.
//!
//! Every `#[ignore = "hardware: ..."]` test in the workspace must be listed in [`TESTS`]; a test
//! of this module scans the sources and fails on one that is not, so no hardware path is
//! silently left out of device runs.

use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};

/// What a hardware test needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Need {
    DmaHeap,
    Udmabuf,
    DrmRenderNode,
    Camera,
    Accel,
    Vulkan,
    /// A Vulkan adapter with cooperative matrices (tensor cores) and f16 shaders.
    VulkanCoopMatrix,
}

/// Where a test lives: the package's library tests or an integration-test target.
#[derive(Clone, Copy, Debug)]
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
    need: Need,
    /// Ignored unless a device is there (`--ignored`), or run everywhere a driver exists.
    ignored: bool,
}

const fn hw(package: &'static str, target: Target, name: &'static str, need: Need) -> HardwareTest {
    HardwareTest {
        package,
        target,
        name,
        need,
        ignored: true,
    }
}

/// Every hardware test of the workspace.
const TESTS: &[HardwareTest] = &[
    hw(
        "uvm-alloc",
        Target::Test("alloc"),
        "dma_heap_buffers_sync_cpu_access",
        Need::DmaHeap,
    ),
    hw(
        "uvm-alloc",
        Target::Test("alloc"),
        "a_dma_buf_from_a_heap_imports_and_reads_back_what_was_written",
        Need::DmaHeap,
    ),
    hw(
        "uvm-alloc",
        Target::Test("alloc"),
        "udmabuf_buffers_sync_cpu_access",
        Need::Udmabuf,
    ),
    hw(
        "sync-timeline",
        Target::Test("drm"),
        "syncobj_timeline_signal_wait_query",
        Need::DrmRenderNode,
    ),
    hw(
        "sync-timeline",
        Target::Test("drm"),
        "sync_file_round_trip_of_a_point",
        Need::DrmRenderNode,
    ),
    hw(
        "sync-timeline",
        Target::Test("drm"),
        "transfer_between_timelines",
        Need::DrmRenderNode,
    ),
    hw(
        "isp-v4l2",
        Target::Lib,
        "v4l2::tests::a_camera_streams_frames_into_exported_dma_bufs",
        Need::Camera,
    ),
    hw(
        "pipeline",
        Target::Test("chain"),
        "the_chain_describes_camera_frames",
        Need::Camera,
    ),
    hw(
        "npu-hal",
        Target::Lib,
        "accel::tests::every_accel_node_identifies_its_driver",
        Need::Accel,
    ),
    // Real GPU paths that also run in CI (lavapipe): listed so a device report names them.
    HardwareTest {
        ignored: false,
        ..hw(
            "uvm-alloc",
            Target::Test("zero_copy"),
            "shader_writes_the_pages_the_cpu_mapped",
            Need::Vulkan,
        )
    },
    HardwareTest {
        ignored: false,
        ..hw(
            "pipeline",
            Target::Test("vision"),
            "gpu_encoder_matches_the_cpu_reference_on_a_wider_tower",
            Need::Vulkan,
        )
    },
    HardwareTest {
        ignored: false,
        ..hw(
            "pipeline",
            Target::Test("chain"),
            "the_gpu_chain_decodes_every_sampled_frame_with_zero_copies",
            Need::Vulkan,
        )
    },
    hw(
        "pipeline",
        Target::Test("vision"),
        "the_coop_matrix_encoder_matches_the_cpu_reference",
        Need::VulkanCoopMatrix,
    ),
];

/// Whether the discovery `report` shows what `need` asks for; `Err` says why not.
fn need_met(report: &Value, need: Need) -> Result<String, String> {
    let class = match need {
        Need::DmaHeap => "dma_heaps",
        Need::Udmabuf => "udmabuf",
        Need::DrmRenderNode => "drm_render_nodes",
        Need::Camera => "v4l2_devices",
        Need::Accel => "accel_devices",
        Need::Vulkan | Need::VulkanCoopMatrix => "vulkan",
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
    if need == Need::VulkanCoopMatrix {
        let items = entry.get("items").and_then(Value::as_array);
        let found = items.map_or(0, |items| {
            items
                .iter()
                .filter(|i| {
                    i["cooperative_matrix"] == Value::Bool(true)
                        && i["shader_f16"] == Value::Bool(true)
                })
                .count()
        });
        return if found > 0 {
            Ok(format!(
                "vulkan: {found} adapter(s) with cooperative matrices"
            ))
        } else {
            Err("vulkan: no adapter offers cooperative matrices with f16 shaders".into())
        };
    }
    match entry.get("items").and_then(Value::as_array) {
        Some(items) if items.is_empty() => Err(format!("{class}: none found")),
        Some(items) => Ok(format!("{class}: {} found", items.len())),
        // A single node (udmabuf) reports present without items.
        None => Ok(format!("{class}: present")),
    }
}

/// Runs the discovery, the tests, and writes the reports.
pub(crate) fn run(root: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let report = crate::devices::probe();
    crate::devices::print_report(&report);
    println!();
    let mut results = Vec::new();
    let mut failed = 0;
    for t in TESTS {
        let (status, detail) = match need_met(&report, t.need) {
            Err(why) => ("unsupported", why),
            Ok(found) => {
                let mut cmd =
                    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
                cmd.current_dir(root)
                    .args(["test", "-p", t.package, "--all-features"]);
                match t.target {
                    Target::Lib => cmd.arg("--lib"),
                    Target::Test(name) => cmd.args(["--test", name]),
                };
                cmd.args(["--", "--exact", t.name]);
                if t.ignored {
                    cmd.arg("--ignored");
                }
                let out = cmd.output()?;
                let stdout = String::from_utf8_lossy(&out.stdout);
                let ran = stdout.contains("test result: ok. 1 passed");
                if out.status.success() && ran {
                    ("passed", found)
                } else {
                    failed += 1;
                    let tail: String = String::from_utf8_lossy(&out.stderr)
                        .lines()
                        .chain(stdout.lines())
                        .filter(|l| {
                            l.contains("panicked") || l.contains("error") || l.contains("FAILED")
                        })
                        .take(3)
                        .collect::<Vec<_>>()
                        .join(" | ");
                    let why = if out.status.success() {
                        "the test did not run (renamed or filtered out?)".to_string()
                    } else {
                        tail
                    };
                    ("failed", why)
                }
            }
        };
        println!("{status:12} {}::{} ({detail})", t.package, t.name);
        results.push(json!({
            "package": t.package,
            "test": t.name,
            "need": format!("{:?}", t.need),
            "status": status,
            "detail": detail,
        }));
    }
    let target = root.join("target");
    std::fs::create_dir_all(&target)?;
    let full = json!({ "devices": report, "tests": results });
    std::fs::write(
        target.join("device-report.json"),
        serde_json::to_string_pretty(&full)? + "\n",
    )?;
    let mut md = String::from(
        "# Device test report\n\n| package | test | needs | result | detail |\n|---|---|---|---|---|\n",
    );
    for r in &results {
        let f = |k: &str| r[k].as_str().unwrap_or("").replace('|', "/");
        md += &format!(
            "| {} | {} | {} | {} | {} |\n",
            f("package"),
            f("test"),
            f("need"),
            f("status"),
            f("detail")
        );
    }
    std::fs::write(target.join("device-report.md"), md)?;
    let count = |s: &str| results.iter().filter(|r| r["status"] == s).count();
    println!(
        "\n{} passed, {} failed, {} unsupported; report in target/device-report.json and .md",
        count("passed"),
        count("failed"),
        count("unsupported")
    );
    if failed > 0 {
        return Err(format!("{failed} hardware test(s) failed").into());
    }
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
        });
        assert!(
            need_met(&report, Need::DmaHeap)
                .unwrap_err()
                .contains("does not exist")
        );
        assert!(need_met(&report, Need::Vulkan).is_ok());
        assert!(need_met(&report, Need::Accel).is_err());
    }
}
