//! Vulkan timeline semaphores (feature `vulkan`): the same contract, kept by the driver.
//!
//! The host signals (`vkSignalSemaphore`), waits (`vkWaitSemaphores`) and reads
//! (`vkGetSemaphoreCounterValue`); queue submissions wait on and signal values on the device
//! ([`submit_wait_signal`]). A submission may wait on a value nobody has signalled yet, which is
//! what lets a GPU stage be queued before the CPU stage it depends on has finished: the CPU
//! stage's host signal releases it, with no thread in between.
//!
//! The semaphore borrows a `VkDevice` it does not own, so [`VulkanTimeline::new`] is `unsafe`
//! and takes an `owner` (a `wgpu::Device` clone, say) that keeps the device alive as long as the
//! timeline. [`VulkanTimeline::from_wgpu`] does this for a wgpu device on the Vulkan backend, so
//! wgpu and raw Vulkan share one device.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ash::vk;

use crate::{Backend, Error, Timeline, VkResult};

/// A Vulkan timeline semaphore.
pub struct VulkanTimeline {
    // Drop order: `Drop::drop` destroys the semaphore first; `owner`, which keeps the device
    // alive, is dropped after it.
    device: ash::Device,
    semaphore: vk::Semaphore,
    /// Host signals are serialised: two racing `vkSignalSemaphore` calls could reach the driver
    /// out of order, and a signal below the current value is invalid usage.
    host_signal: Mutex<()>,
    /// The largest value a queue submission was registered to signal
    /// ([`VulkanTimeline::expect_device_signal`]): until the semaphore reaches it, a queue may
    /// still use the semaphore, so it is not destroyed.
    device_signals: AtomicU64,
    owner: Arc<dyn Any + Send + Sync>,
}

/// How long dropping a timeline waits for registered device signals before it leaks the
/// semaphore instead of destroying one a queue may still signal.
const DROP_WAIT: Duration = Duration::from_secs(5);

impl std::fmt::Debug for VulkanTimeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VulkanTimeline")
            .field("semaphore", &self.semaphore)
            .finish_non_exhaustive()
    }
}

fn vk_err(call: &'static str) -> impl Fn(vk::Result) -> Error {
    move |r| Error::Vulkan {
        call,
        result: VkResult(r.as_raw()),
    }
}

impl VulkanTimeline {
    /// Creates a timeline semaphore at `initial` on `device`.
    ///
    /// # Safety
    /// - `device` is a valid `VkDevice` created with the `timelineSemaphore` feature (core in
    ///   Vulkan 1.2), and stays valid for as long as `owner` is alive;
    /// - every queue submission that signals the semaphore was first registered with
    ///   [`VulkanTimeline::expect_device_signal`] (drop waits for those values), and none that
    ///   only waits on it is still pending when the timeline is dropped.
    pub unsafe fn new(
        device: ash::Device,
        owner: Arc<dyn Any + Send + Sync>,
        initial: u64,
    ) -> Result<VulkanTimeline, Error> {
        let mut type_info = vk::SemaphoreTypeCreateInfo::default()
            .semaphore_type(vk::SemaphoreType::TIMELINE)
            .initial_value(initial);
        let info = vk::SemaphoreCreateInfo::default().push_next(&mut type_info);
        // SAFETY: the caller guarantees `device` is valid with timeline semaphores enabled; the
        // create info is a valid chain built above.
        let semaphore =
            unsafe { device.create_semaphore(&info, None) }.map_err(vk_err("vkCreateSemaphore"))?;
        Ok(VulkanTimeline {
            device,
            semaphore,
            host_signal: Mutex::new(()),
            device_signals: AtomicU64::new(0),
            owner,
        })
    }

    /// A timeline on the Vulkan device under `device` (which must run on wgpu's Vulkan backend).
    /// Feature `wgpu`.
    /// The timeline keeps a clone of `device`, so the `VkDevice` outlives it.
    #[cfg(feature = "wgpu")]
    pub fn from_wgpu(device: &wgpu::Device, initial: u64) -> Result<VulkanTimeline, Error> {
        // SAFETY: `as_hal` only borrows the hal device; we clone the ash function table, whose
        // handle stays valid while a clone of the wgpu device (stored as `owner`) is alive.
        let raw = unsafe { device.as_hal::<wgpu::hal::api::Vulkan>() }
            .map(|hal| hal.raw_device().clone())
            .ok_or_else(|| Error::Unsupported {
                what: "Vulkan timeline on a wgpu device",
                why: "the device does not run on wgpu's Vulkan backend".into(),
            })?;
        // SAFETY: wgpu-hal enables timeline semaphores on every Vulkan device it creates (it
        // uses them for its own fences); the owner below keeps the device alive.
        unsafe { VulkanTimeline::new(raw, Arc::new(device.clone()), initial) }
    }

    /// The raw semaphore, for submissions made elsewhere (an `unsafe` Vulkan call): register
    /// each value such a submission signals with [`VulkanTimeline::expect_device_signal`]
    /// first, so the semaphore outlives it.
    pub fn semaphore(&self) -> vk::Semaphore {
        self.semaphore
    }

    /// Records that a queue submission will signal `value`: dropping the timeline waits (up to
    /// 5 s) for the semaphore to reach the largest such value, and leaks the semaphore rather
    /// than destroy it under a queue that has not got there. [`submit_wait_signal`] registers
    /// its signals itself.
    pub fn expect_device_signal(&self, value: u64) {
        self.device_signals.fetch_max(value, Ordering::SeqCst);
    }

    /// The device the semaphore lives on.
    pub fn device(&self) -> &ash::Device {
        &self.device
    }

    /// Whatever keeps the device alive (for types that build on this one).
    pub fn owner(&self) -> &Arc<dyn Any + Send + Sync> {
        &self.owner
    }
}

impl Drop for VulkanTimeline {
    fn drop(&mut self) {
        let pending = self.device_signals.load(Ordering::SeqCst);
        if pending > 0 && self.wait(pending, DROP_WAIT).is_err() {
            // A registered submission has not signalled (a lost device, or a wait upstream
            // that never came): the queue may still touch the semaphore, so it is leaked.
            return;
        }
        // SAFETY: the semaphore was created on this device, the device is alive (`owner` is
        // dropped after this), every registered device signal has landed (above), and `new`'s
        // contract covers submissions that only wait on it.
        unsafe { self.device.destroy_semaphore(self.semaphore, None) }
    }
}

impl Timeline for VulkanTimeline {
    fn value(&self) -> Result<u64, Error> {
        // SAFETY: a valid timeline semaphore of this device.
        unsafe { self.device.get_semaphore_counter_value(self.semaphore) }
            .map_err(vk_err("vkGetSemaphoreCounterValue"))
    }

    fn signal(&self, value: u64) -> Result<(), Error> {
        let _serial = self.host_signal.lock().unwrap_or_else(|p| p.into_inner());
        let current = self.value()?;
        if value < current {
            return Err(Error::Backwards {
                current,
                requested: value,
            });
        }
        if value == current {
            return Ok(());
        }
        let info = vk::SemaphoreSignalInfo::default()
            .semaphore(self.semaphore)
            .value(value);
        // SAFETY: a valid semaphore; the value is greater than the current one and, host
        // signals being serialised, than any earlier host signal. (A device signal racing past
        // it would be the submitter's invalid usage, as with any Vulkan timeline.)
        unsafe { self.device.signal_semaphore(&info) }.map_err(vk_err("vkSignalSemaphore"))
    }

    fn wait(&self, value: u64, timeout: Duration) -> Result<(), Error> {
        let semaphores = [self.semaphore];
        let values = [value];
        let info = vk::SemaphoreWaitInfo::default()
            .semaphores(&semaphores)
            .values(&values);
        let ns = u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX);
        // SAFETY: a valid semaphore and arrays of equal length that outlive the call.
        match unsafe { self.device.wait_semaphores(&info, ns) } {
            Ok(()) => Ok(()),
            Err(vk::Result::TIMEOUT) => Err(Error::Timeout {
                wanted: value,
                reached: self.value()?,
                timeout,
            }),
            Err(e) => Err(vk_err("vkWaitSemaphores")(e)),
        }
    }

    fn backend(&self) -> Backend<'_> {
        Backend::Vulkan(self)
    }
}

/// Waits until any of `points` (timelines of one device) reaches its value, in one driver wait
/// (`VK_SEMAPHORE_WAIT_ANY_BIT`, no polling); returns the index of one that did.
pub fn wait_any(points: &[(&VulkanTimeline, u64)], timeout: Duration) -> Result<usize, Error> {
    let Some((first, _)) = points.first() else {
        return Err(Error::BadArgument {
            what: "wait_any needs at least one timeline",
        });
    };
    if points
        .iter()
        .any(|(t, _)| t.device.handle() != first.device.handle())
    {
        return Err(Error::BadArgument {
            what: "vulkan::wait_any waits on timelines of one device",
        });
    }
    let semaphores: Vec<vk::Semaphore> = points.iter().map(|(t, _)| t.semaphore).collect();
    let values: Vec<u64> = points.iter().map(|&(_, v)| v).collect();
    let info = vk::SemaphoreWaitInfo::default()
        .flags(vk::SemaphoreWaitFlags::ANY)
        .semaphores(&semaphores)
        .values(&values);
    let ns = u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX);
    // SAFETY: valid semaphores of one device (checked above) and arrays of equal length that
    // outlive the call.
    match unsafe { first.device.wait_semaphores(&info, ns) } {
        Ok(()) => {
            for (i, (t, v)) in points.iter().enumerate() {
                if t.value()? >= *v {
                    return Ok(i);
                }
            }
            Err(Error::Unsupported {
                what: "vkWaitSemaphores(ANY)",
                why: "the driver returned success with no timeline at its value".into(),
            })
        }
        Err(vk::Result::TIMEOUT) => Err(Error::Timeout {
            wanted: points[0].1,
            reached: first.value()?,
            timeout,
        }),
        Err(e) => Err(vk_err("vkWaitSemaphores")(e)),
    }
}

/// Submits to `queue` a batch with no work that waits for every `(timeline, value)` in `waits`
/// and then signals every one in `signals`: a device-side handoff between timelines.
///
/// # Safety
/// - `queue` is a queue of the timelines' device, and no other thread submits to it (or uses it
///   otherwise) during the call: Vulkan requires queue access to be externally synchronised;
/// - the signalled values are greater than the timelines' values when the batch executes.
pub unsafe fn submit_wait_signal(
    queue: vk::Queue,
    waits: &[(&VulkanTimeline, u64)],
    signals: &[(&VulkanTimeline, u64)],
) -> Result<(), Error> {
    let Some((first, _)) = waits.first().or(signals.first()) else {
        return Err(Error::BadArgument {
            what: "a submission needs a wait or a signal",
        });
    };
    for (t, v) in signals {
        t.expect_device_signal(*v);
    }
    let wait_sems: Vec<vk::Semaphore> = waits.iter().map(|(t, _)| t.semaphore).collect();
    let wait_vals: Vec<u64> = waits.iter().map(|(_, v)| *v).collect();
    let stages = vec![vk::PipelineStageFlags::ALL_COMMANDS; waits.len()];
    let signal_sems: Vec<vk::Semaphore> = signals.iter().map(|(t, _)| t.semaphore).collect();
    let signal_vals: Vec<u64> = signals.iter().map(|(_, v)| *v).collect();
    let mut timeline_info = vk::TimelineSemaphoreSubmitInfo::default()
        .wait_semaphore_values(&wait_vals)
        .signal_semaphore_values(&signal_vals);
    let submit = vk::SubmitInfo::default()
        .wait_semaphores(&wait_sems)
        .wait_dst_stage_mask(&stages)
        .signal_semaphores(&signal_sems)
        .push_next(&mut timeline_info);
    // SAFETY: the caller guarantees exclusive use of a queue of this device and increasing
    // signal values; every array lives until the call returns.
    unsafe {
        first
            .device
            .queue_submit(queue, &[submit], vk::Fence::null())
    }
    .map_err(vk_err("vkQueueSubmit"))
}
