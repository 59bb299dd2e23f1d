//! Vulkan timeline semaphores on a real driver (lavapipe in CI): host signal and wait across
//! threads, timeouts, the backwards rule, and device-side waits released by a host signal.
//!
//! Without a Vulkan adapter the tests fail when `CI=true` and otherwise print a visible skip.
#![cfg(feature = "wgpu")]

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sync_timeline::vulkan::{VulkanTimeline, submit_wait_signal};
use sync_timeline::{CpuTimeline, Error, Timeline, wait_all, wait_any};

fn device() -> Option<(wgpu::Device, wgpu::Queue)> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::VULKAN,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let adapter = pollster::block_on(instance.request_adapter(&Default::default())).ok();
    let Some(adapter) = adapter else {
        let msg = "no Vulkan adapter; install mesa-vulkan-drivers libvulkan1 (lavapipe)";
        let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
        assert!(!ci, "{msg}: CI must run the Vulkan path for real");
        let _ = writeln!(std::io::stderr(), "\nSKIPPED (no Vulkan): {msg}\n");
        return None;
    };
    pollster::block_on(adapter.request_device(&Default::default())).ok()
}

#[test]
fn host_signal_wait_value_and_errors() {
    let Some((device, _queue)) = device() else {
        return;
    };
    let t = Arc::new(VulkanTimeline::from_wgpu(&device, 3).unwrap());
    assert_eq!(t.value().unwrap(), 3);
    t.signal(3).unwrap();
    t.signal(7).unwrap();
    assert_eq!(
        t.signal(5),
        Err(Error::Backwards {
            current: 7,
            requested: 5
        })
    );
    let start = Instant::now();
    let err = t.wait(8, Duration::from_millis(30)).unwrap_err();
    assert!(start.elapsed() >= Duration::from_millis(25));
    assert!(
        matches!(
            err,
            Error::Timeout {
                wanted: 8,
                reached: 7,
                ..
            }
        ),
        "{err}"
    );
    let waiter = {
        let t = Arc::clone(&t);
        std::thread::spawn(move || t.wait(20, Duration::from_secs(10)))
    };
    std::thread::sleep(Duration::from_millis(10));
    t.signal(20).unwrap();
    waiter.join().unwrap().unwrap();
}

#[test]
fn device_wait_is_released_by_a_host_signal() {
    let Some((device, queue)) = device() else {
        return;
    };
    let cpu_done = VulkanTimeline::from_wgpu(&device, 0).unwrap();
    let gpu_done = VulkanTimeline::from_wgpu(&device, 0).unwrap();
    // SAFETY: this test is the only user of the queue while it submits.
    let raw_queue = unsafe { queue.as_hal::<wgpu::hal::api::Vulkan>() }
        .expect("vulkan queue")
        .as_raw();
    for v in 1..=5u64 {
        // Queue the GPU stage before the CPU stage has produced its value...
        // SAFETY: exclusive queue use (above); gpu_done's values increase.
        unsafe { submit_wait_signal(raw_queue, &[(&cpu_done, v)], &[(&gpu_done, v)]) }.unwrap();
        assert_eq!(
            gpu_done.value().unwrap(),
            v - 1,
            "the device must not run ahead of its wait"
        );
        // ...then the CPU stage finishes and the device follows.
        cpu_done.signal(v).unwrap();
        gpu_done.wait(v, Duration::from_secs(10)).unwrap();
    }
}

#[test]
fn wait_any_and_all_across_backends() {
    let Some((device, _queue)) = device() else {
        return;
    };
    let vk = Arc::new(VulkanTimeline::from_wgpu(&device, 0).unwrap());
    let cpu = Arc::new(CpuTimeline::new(0));
    let (vk2, cpu2) = (Arc::clone(&vk), Arc::clone(&cpu));
    let signaller = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(10));
        vk2.signal(2).unwrap();
        std::thread::sleep(Duration::from_millis(10));
        cpu2.signal(4).unwrap();
    });
    let points: [(&dyn Timeline, u64); 2] = [(cpu.as_ref(), 4), (vk.as_ref(), 2)];
    assert_eq!(wait_any(&points, Duration::from_secs(10)).unwrap(), 1);
    wait_all(&points, Duration::from_secs(10)).unwrap();
    signaller.join().unwrap();
}

#[test]
fn a_cpu_stage_releases_a_queued_gpu_stage_through_a_fanout() {
    let Some((device, queue)) = device() else {
        return;
    };
    let cpu = Arc::new(CpuTimeline::new(0));
    let vk_in = Arc::new(VulkanTimeline::from_wgpu(&device, 0).unwrap());
    let vk_out = VulkanTimeline::from_wgpu(&device, 0).unwrap();
    let stage = sync_timeline::bridge::Fanout {
        primary: cpu.clone(),
        mirrors: vec![vk_in.clone()],
    };
    // SAFETY: this test is the only user of the queue while it submits.
    let raw_queue = unsafe { queue.as_hal::<wgpu::hal::api::Vulkan>() }
        .expect("vulkan queue")
        .as_raw();
    // SAFETY: exclusive queue use; vk_out's values increase.
    unsafe { submit_wait_signal(raw_queue, &[(&vk_in, 1)], &[(&vk_out, 1)]) }.unwrap();
    stage.signal(1).unwrap();
    vk_out.wait(1, Duration::from_secs(10)).unwrap();
    assert_eq!(cpu.value().unwrap(), 1);
}
