//! `cargo xtask devices`: what hardware this machine offers the workspace, found, not assumed.
//!
//! Each class of device is probed the way the crates that drive it will open it: Vulkan through
//! the loader (wgpu's Vulkan backend), DMA-BUF heaps, udmabuf, DRM render nodes, V4L2 capture
//! nodes and accel nodes through `/dev` and sysfs. A class that is absent is reported with the
//! reason, so a device lab reads "absent: /dev/dma_heap does not exist", never a silent gap.
//! `device-test` reads the same report to decide which hardware tests can run.

use std::path::Path;

use serde_json::{Value, json};

/// Probes every device class, prints a report, and optionally writes it as JSON.
pub(crate) fn run(json_out: Option<&Path>) -> Result<(), std::io::Error> {
    let report = probe();
    print_report(&report);
    if let Some(path) = json_out {
        let text = serde_json::to_string_pretty(&report).expect("a json! value always serialises");
        std::fs::write(path, text + "\n")?;
        println!("report written to {}", path.display());
    }
    Ok(())
}

/// The report: one entry per device class, each `{present, reason}` or `{items: [...]}`.
pub(crate) fn probe() -> Value {
    json!({
        "vulkan": vulkan_adapters(),
        "dma_heaps": dir_entries("/dev/dma_heap", |name| Some(format!("heap {name}"))),
        "udmabuf": node("/dev/udmabuf"),
        "drm_render_nodes": dir_entries("/dev/dri", |name| {
            name.starts_with("renderD").then(|| sysfs_driver(&format!("/sys/class/drm/{name}/device/driver")))
        }),
        "v4l2_devices": dir_entries("/dev", |name| {
            name.starts_with("video").then(|| {
                std::fs::read_to_string(format!("/sys/class/video4linux/{name}/name"))
                    .map(|s| s.trim().to_owned())
                    .unwrap_or_default()
            })
        }),
        "accel_devices": dir_entries("/dev/accel", |name| {
            Some(sysfs_driver(&format!("/sys/class/accel/{name}/device/driver")))
        }),
    })
}

pub(crate) fn print_report(report: &Value) {
    let Some(classes) = report.as_object() else {
        return;
    };
    for (class, value) in classes {
        match value.get("present").and_then(Value::as_bool) {
            Some(false) => println!(
                "{class:18} absent: {}",
                value.get("reason").and_then(Value::as_str).unwrap_or("")
            ),
            _ => match value.get("items").and_then(Value::as_array) {
                Some(items) if !items.is_empty() => {
                    println!("{class:18} present:");
                    for item in items {
                        let field = |k: &str| item.get(k).and_then(Value::as_str).unwrap_or("");
                        let line = if item.get("name").is_some() {
                            format!(
                                "{} ({}, driver {} {})",
                                field("name"),
                                field("device_type"),
                                field("driver"),
                                field("driver_info")
                            )
                        } else {
                            format!("{} ({})", field("path"), field("description"))
                        };
                        println!("{:18}   {line}", "");
                    }
                }
                _ => println!("{class:18} present"),
            },
        }
    }
}

fn node(path: &str) -> Value {
    match std::fs::metadata(path) {
        Ok(_) => json!({ "present": true, "path": path }),
        Err(e) => json!({ "present": false, "reason": format!("{path}: {e}") }),
    }
}

/// Entries of `dir` that `describe` accepts (returning a description), sorted by name.
fn dir_entries(dir: &str, describe: impl Fn(&str) -> Option<String>) -> Value {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) => return json!({ "present": false, "reason": format!("{dir}: {e}") }),
    };
    let mut items: Vec<(String, String)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            describe(&name).map(|d| (name, d))
        })
        .collect();
    items.sort();
    if items.is_empty() {
        return json!({ "present": false, "reason": format!("{dir}: no matching device nodes") });
    }
    let items: Vec<Value> = items
        .into_iter()
        .map(|(name, desc)| json!({ "path": format!("{dir}/{name}"), "description": desc }))
        .collect();
    json!({ "present": true, "items": items })
}

/// The kernel driver bound to a device, from its sysfs `driver` symlink; a device no driver
/// binds (vgem's platform device) is named by its own sysfs name.
fn sysfs_driver(link: &str) -> String {
    let name = |p: &Path| {
        std::fs::read_link(p)
            .ok()
            .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
    };
    let link = Path::new(link);
    name(link)
        .or_else(|| link.parent().and_then(name))
        .unwrap_or_else(|| "driver unknown".into())
}

fn vulkan_adapters() -> Value {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::VULKAN,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::VULKAN));
    if adapters.is_empty() {
        return json!({
            "present": false,
            "reason": "no Vulkan adapter: install a Vulkan driver \
                       (Debian/Ubuntu: mesa-vulkan-drivers libvulkan1 for lavapipe)",
        });
    }
    let items: Vec<Value> = adapters
        .iter()
        .map(|a| {
            // What both tensor-core paths take (pipeline's encoder, npu-hal's prefill GEMM):
            // a 16x16x16 f16 x f16 -> f32 shape and subgroups of exactly 32 lanes, so a device
            // with other shapes or lane counts reads as without them, not as a failure. The
            // same test as `pipeline::vision_gpu::coop_features`, which xtask does not link
            // (it would build the whole pipeline crate for one probe).
            let info = a.get_info();
            let coop = a
                .features()
                .contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
                && a.cooperative_matrix_properties().iter().any(|p| {
                    (p.m_size, p.n_size, p.k_size) == (16, 16, 16)
                        && p.ab_type == wgpu::CooperativeScalarType::F16
                        && p.cr_type == wgpu::CooperativeScalarType::F32
                })
                && info.subgroup_min_size == 32
                && info.subgroup_max_size == 32;
            json!({
                "name": info.name,
                "device_type": format!("{:?}", info.device_type),
                "driver": info.driver,
                "driver_info": info.driver_info,
                "shader_f16": a.features().contains(wgpu::Features::SHADER_F16),
                "cooperative_matrix": coop,
                // Another device (npu-hal's GPU decoder) can wait on its timelines in its queue.
                "exports_timelines": sync_timeline::vulkan::adapter_exports_timelines(a),
                // A GPU ISP reads a camera's dma-bufs in place.
                "imports_dma_bufs": uvm_alloc::vulkan::adapter_import_caps(a).dma_buf,
            })
        })
        .collect();
    json!({ "present": true, "items": items })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory's entries are listed (a heap directory once listed none, so heaps read as
    /// absent on every machine that had them).
    #[test]
    fn directory_classes_list_their_nodes() {
        let dir = std::env::temp_dir().join(format!("xtask-devices-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("system"), "").unwrap();
        let found = dir_entries(dir.to_str().unwrap(), |name| Some(format!("heap {name}")));
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(found["present"], true);
        assert_eq!(found["items"][0]["description"], "heap system");
        let absent = dir_entries("/nonexistent-xtask-dir", |_| Some(String::new()));
        assert_eq!(absent["present"], false);
    }
}
