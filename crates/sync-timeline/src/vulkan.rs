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
//!
//! Another `VkDevice` on the same GPU (a second engine's own device, such as npu-hal's GPU
//! backend) waits on a timeline in its queue through an opaque-fd export
//! (`VK_KHR_external_semaphore_fd`): [`VulkanTimeline::export_opaque_fd`] on the signalling
//! side, [`VulkanTimeline::import_opaque_fd`] on the waiting side; both semaphores then share
//! one payload. [`VulkanTimeline::export_target`] names the devices that can import it.

use std::any::Any;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
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
    /// Unique in this process, so a cache of imports never mistakes a new timeline for a
    /// dropped one whose handle the driver reused.
    id: u64,
    /// Set when the semaphore was created exportable.
    export: Option<Export>,
    owner: Arc<dyn Any + Send + Sync>,
}

/// Which devices can import a timeline's opaque fd: those whose `VkPhysicalDeviceIDProperties`
/// carry the same device and driver UUIDs (the same GPU under the same driver build).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExportTarget {
    pub device_uuid: [u8; 16],
    pub driver_uuid: [u8; 16],
}

impl ExportTarget {
    /// The UUIDs of `physical`.
    pub fn of(instance: &ash::Instance, physical: vk::PhysicalDevice) -> ExportTarget {
        let mut id = vk::PhysicalDeviceIDProperties::default();
        let mut props = vk::PhysicalDeviceProperties2::default().push_next(&mut id);
        // SAFETY: a physical device of this (Vulkan 1.1+) instance; the chain is built above.
        unsafe { instance.get_physical_device_properties2(physical, &mut props) };
        ExportTarget {
            device_uuid: id.device_uuid,
            driver_uuid: id.driver_uuid,
        }
    }
}

struct Export {
    target: ExportTarget,
    fd: ash::khr::external_semaphore_fd::Device,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Whether timelines made by [`VulkanTimeline::from_wgpu`] on a device of `adapter` (opened
/// with `VK_KHR_external_semaphore_fd`, as uvm-alloc's `open_wgpu_device` does) can be waited
/// on by another device of the same GPU. Feature `wgpu`.
#[cfg(feature = "wgpu")]
pub fn adapter_exports_timelines(adapter: &wgpu::Adapter) -> bool {
    // SAFETY: the hal adapter is only borrowed for these queries.
    let Some(hal) = (unsafe { adapter.as_hal::<wgpu::hal::api::Vulkan>() }) else {
        return false;
    };
    hal.physical_device_capabilities()
        .supports_extension(ash::khr::external_semaphore_fd::NAME)
        && exports_timelines(
            hal.shared_instance().raw_instance(),
            hal.raw_physical_device(),
        )
}

/// Whether `physical` can export timeline semaphores as opaque fds and import them back.
pub fn exports_timelines(instance: &ash::Instance, physical: vk::PhysicalDevice) -> bool {
    let mut type_info =
        vk::SemaphoreTypeCreateInfo::default().semaphore_type(vk::SemaphoreType::TIMELINE);
    let info = vk::PhysicalDeviceExternalSemaphoreInfo::default()
        .handle_type(vk::ExternalSemaphoreHandleTypeFlags::OPAQUE_FD)
        .push_next(&mut type_info);
    let mut props = vk::ExternalSemaphoreProperties::default();
    // SAFETY: a physical device of this instance; the chain is built above.
    unsafe {
        instance.get_physical_device_external_semaphore_properties(physical, &info, &mut props)
    };
    props.external_semaphore_features.contains(
        vk::ExternalSemaphoreFeatureFlags::EXPORTABLE
            | vk::ExternalSemaphoreFeatureFlags::IMPORTABLE,
    )
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
        // SAFETY: the caller's contract is `create`'s, with no export.
        unsafe { VulkanTimeline::create(device, owner, initial, None) }
    }

    /// Creates a timeline at `initial` on `device` whose semaphore another device of the same
    /// GPU can wait on in its queue ([`VulkanTimeline::export_opaque_fd`]).
    /// [`Error::Unsupported`] where `physical` cannot export timeline semaphores.
    ///
    /// # Safety
    /// As [`VulkanTimeline::new`]; also, `device` was created from `physical` of `instance`
    /// with `VK_KHR_external_semaphore_fd` enabled.
    pub unsafe fn new_exportable(
        instance: &ash::Instance,
        physical: vk::PhysicalDevice,
        device: ash::Device,
        owner: Arc<dyn Any + Send + Sync>,
        initial: u64,
    ) -> Result<VulkanTimeline, Error> {
        if !exports_timelines(instance, physical) {
            return Err(Error::Unsupported {
                what: "exportable Vulkan timelines",
                why: "the driver cannot export timeline semaphores as opaque fds".into(),
            });
        }
        let export = Export {
            target: ExportTarget::of(instance, physical),
            fd: ash::khr::external_semaphore_fd::Device::new(instance, &device),
        };
        // SAFETY: the caller's contract; the driver exports timelines (checked above).
        unsafe { VulkanTimeline::create(device, owner, initial, Some(export)) }
    }

    /// A timeline on `device` sharing the payload of a semaphore another device exported
    /// (`fd`, from [`VulkanTimeline::export_opaque_fd`]): waits in this device's queue then
    /// follow the other device's signals. Vulkan owns `fd` once the import succeeds.
    ///
    /// # Safety
    /// As [`VulkanTimeline::new`]; also, `device` has `VK_KHR_external_semaphore_fd` enabled
    /// and its physical device has the exporter's [`ExportTarget`].
    pub unsafe fn import_opaque_fd(
        instance: &ash::Instance,
        device: ash::Device,
        owner: Arc<dyn Any + Send + Sync>,
        fd: OwnedFd,
    ) -> Result<VulkanTimeline, Error> {
        // SAFETY: the caller's contract; the value is replaced by the imported payload.
        let timeline = unsafe { VulkanTimeline::create(device, owner, 0, None) }?;
        let ext = ash::khr::external_semaphore_fd::Device::new(instance, &timeline.device);
        let raw_fd = fd.into_raw_fd();
        let info = vk::ImportSemaphoreFdInfoKHR::default()
            .semaphore(timeline.semaphore)
            .handle_type(vk::ExternalSemaphoreHandleTypeFlags::OPAQUE_FD)
            .fd(raw_fd);
        // SAFETY: a semaphore of this device, not in use yet; `raw_fd` is an opaque semaphore
        // fd (the caller's contract), owned by Vulkan on success.
        if let Err(e) = unsafe { ext.import_semaphore_fd(&info) } {
            // SAFETY: on failure Vulkan did not take the fd; it is still ours to close.
            drop(unsafe { OwnedFd::from_raw_fd(raw_fd) });
            return Err(vk_err("vkImportSemaphoreFdKHR")(e));
        }
        Ok(timeline)
    }

    /// # Safety
    /// As [`VulkanTimeline::new`]; with `export`, as [`VulkanTimeline::new_exportable`].
    unsafe fn create(
        device: ash::Device,
        owner: Arc<dyn Any + Send + Sync>,
        initial: u64,
        export: Option<Export>,
    ) -> Result<VulkanTimeline, Error> {
        let mut type_info = vk::SemaphoreTypeCreateInfo::default()
            .semaphore_type(vk::SemaphoreType::TIMELINE)
            .initial_value(initial);
        let mut export_info = vk::ExportSemaphoreCreateInfo::default()
            .handle_types(vk::ExternalSemaphoreHandleTypeFlags::OPAQUE_FD);
        let mut info = vk::SemaphoreCreateInfo::default().push_next(&mut type_info);
        if export.is_some() {
            info = info.push_next(&mut export_info);
        }
        // SAFETY: the caller guarantees `device` is valid with timeline semaphores enabled (and
        // the export extension when exporting); the create info is a valid chain built above.
        let semaphore =
            unsafe { device.create_semaphore(&info, None) }.map_err(vk_err("vkCreateSemaphore"))?;
        Ok(VulkanTimeline {
            device,
            semaphore,
            host_signal: Mutex::new(()),
            device_signals: AtomicU64::new(0),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            export,
            owner,
        })
    }

    /// This timeline's id, unique in the process.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The devices that can import this timeline, when it was created exportable.
    pub fn export_target(&self) -> Option<ExportTarget> {
        self.export.as_ref().map(|e| e.target)
    }

    /// A new opaque fd referring to this timeline's payload, for
    /// [`VulkanTimeline::import_opaque_fd`] on another device with the same
    /// [`ExportTarget`]. [`Error::Unsupported`] when the timeline is not exportable.
    pub fn export_opaque_fd(&self) -> Result<OwnedFd, Error> {
        let Some(export) = &self.export else {
            return Err(Error::Unsupported {
                what: "exporting a Vulkan timeline",
                why: "it was not created exportable (VulkanTimeline::new_exportable)".into(),
            });
        };
        let info = vk::SemaphoreGetFdInfoKHR::default()
            .semaphore(self.semaphore)
            .handle_type(vk::ExternalSemaphoreHandleTypeFlags::OPAQUE_FD);
        // SAFETY: an exportable semaphore of this device (created with the opaque-fd type).
        let fd =
            unsafe { export.fd.get_semaphore_fd(&info) }.map_err(vk_err("vkGetSemaphoreFdKHR"))?;
        // SAFETY: the driver returned a new fd that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// A timeline on the Vulkan device under `device` (which must run on wgpu's Vulkan backend).
    /// Feature `wgpu`. It is exportable where the device has `VK_KHR_external_semaphore_fd`
    /// enabled (uvm-alloc's `open_wgpu_device` enables it) and the driver exports timelines.
    /// The timeline keeps a clone of `device`, so the `VkDevice` outlives it.
    #[cfg(feature = "wgpu")]
    pub fn from_wgpu(device: &wgpu::Device, initial: u64) -> Result<VulkanTimeline, Error> {
        // SAFETY: `as_hal` only borrows the hal device; we clone the ash function table, whose
        // handle stays valid while a clone of the wgpu device (stored as `owner`) is alive.
        let hal = unsafe { device.as_hal::<wgpu::hal::api::Vulkan>() }.ok_or_else(|| {
            Error::Unsupported {
                what: "Vulkan timeline on a wgpu device",
                why: "the device does not run on wgpu's Vulkan backend".into(),
            }
        })?;
        let raw = hal.raw_device().clone();
        let instance = hal.shared_instance().raw_instance().clone();
        let physical = hal.raw_physical_device();
        let exportable = hal
            .enabled_device_extensions()
            .contains(&ash::khr::external_semaphore_fd::NAME)
            && exports_timelines(&instance, physical);
        drop(hal);
        let owner: Arc<dyn Any + Send + Sync> = Arc::new(device.clone());
        if exportable {
            // SAFETY: as below; the export extension is enabled on the device (checked above)
            // and the handles come from one live wgpu device.
            return unsafe {
                VulkanTimeline::new_exportable(&instance, physical, raw, owner, initial)
            };
        }
        // SAFETY: wgpu-hal enables timeline semaphores on every Vulkan device it creates (it
        // uses them for its own fences); the owner below keeps the device alive.
        unsafe { VulkanTimeline::new(raw, owner, initial) }
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
