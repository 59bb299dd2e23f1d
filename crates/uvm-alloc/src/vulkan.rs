//! Import into Vulkan and wgpu over the same memory (features `vulkan` and `wgpu`).
//!
//! A dma-buf is imported as a dma-buf fd (`VK_EXT_external_memory_dma_buf`); memfd and host
//! buffers by address (`VK_EXT_external_memory_host`), which on a unified-memory GPU (lavapipe,
//! SoC GPUs) means the shader reads and writes the very pages the CPU mapped. Opaque fds are
//! only meaningful for memory a Vulkan driver exported itself (another device or process of the
//! same driver), so [`import_opaque_fd`] takes such an fd rather than a [`UnifiedBuffer`].
//!
//! wgpu does not enable those extensions on its own, so [`open_wgpu_device`] opens the wgpu
//! device through wgpu-hal with them added; wgpu and raw Vulkan then share one `VkDevice`.
//! [`import_wgpu_buffer`] wraps the imported `VkBuffer` as a `wgpu::Buffer` whose drop releases
//! the Vulkan objects and, last, the [`UnifiedBuffer`] it keeps alive.
//!
//! Host visibility: a fence or queue wait makes device writes available, not visible to the
//! host; [`host_read_barrier`] is the memory barrier (shader write -> host read) that a CPU
//! read of the original mapping needs, on every driver, even where lavapipe would forgive its
//! absence.

use std::ffi::CStr;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use ash::vk;

use crate::{Error, UnifiedBuffer};

/// How a buffer reached Vulkan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImportPath {
    /// `VK_EXT_external_memory_dma_buf`: the dma-buf fd itself.
    DmaBuf,
    /// `VK_KHR_external_memory_fd` opaque fd: memory exported by a Vulkan driver.
    OpaqueFd,
    /// `VK_EXT_external_memory_host`: the CPU mapping's address.
    HostPointer,
}

/// Which imports a device opened by [`open_wgpu_device`] supports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImportCaps {
    pub dma_buf: bool,
    pub opaque_fd: bool,
    pub host_pointer: bool,
    /// `minImportedHostPointerAlignment`: address and size of host imports must be multiples.
    pub host_pointer_alignment: u64,
}

impl ImportCaps {
    /// Whether this device can import a buffer of `kind` without a copy.
    pub fn imports(&self, kind: crate::BackendKind) -> bool {
        if kind.is_dma_buf() {
            self.dma_buf
        } else {
            self.host_pointer
        }
    }

    /// The allocatable backends this device imports, in the allocator's preference order: what
    /// an [`crate::AllocatorDesc`] for buffers this device shares should list. A driver without
    /// dma-buf import (lavapipe before Mesa 23.1) gets memfd and host memory, never a heap
    /// buffer it would refuse.
    pub fn importable_backends(&self) -> Vec<crate::BackendKind> {
        crate::BackendKind::ALL
            .into_iter()
            .filter(|&k| self.imports(k))
            .collect()
    }
}

const EXT_HOST: &CStr = ash::ext::external_memory_host::NAME;
const KHR_FD: &CStr = ash::khr::external_memory_fd::NAME;
const EXT_DMA_BUF: &CStr = ash::ext::external_memory_dma_buf::NAME;

fn vk_error(call: &str) -> impl Fn(vk::Result) -> Error + '_ {
    move |r| Error::Vulkan(format!("{call} failed: {r}"))
}

/// The external-memory device extensions an import may use, in the order they are enabled.
pub const IMPORT_EXTENSIONS: [&CStr; 3] = [EXT_HOST, KHR_FD, EXT_DMA_BUF];

impl ImportCaps {
    /// What a device of `physical` with `enabled` device extensions can import (ash-level:
    /// for a `VkDevice` made outside wgpu, such as npu-hal's GPU backend).
    pub fn query(
        instance: &ash::Instance,
        physical: vk::PhysicalDevice,
        enabled: &[&CStr],
    ) -> ImportCaps {
        let has = |e: &CStr| enabled.contains(&e);
        let host_pointer_alignment = if has(EXT_HOST) {
            let mut host_props = vk::PhysicalDeviceExternalMemoryHostPropertiesEXT::default();
            let mut props = vk::PhysicalDeviceProperties2::default().push_next(&mut host_props);
            // SAFETY: a valid physical device of this instance; the chain is built above.
            unsafe { instance.get_physical_device_properties2(physical, &mut props) };
            host_props.min_imported_host_pointer_alignment
        } else {
            0
        };
        ImportCaps {
            dma_buf: has(EXT_DMA_BUF) && has(KHR_FD),
            opaque_fd: has(KHR_FD),
            host_pointer: has(EXT_HOST),
            host_pointer_alignment,
        }
    }
}

/// A `VkBuffer` bound to imported memory, made by [`import_raw`] on a device the caller owns.
/// It keeps the [`UnifiedBuffer`] it was imported from alive; [`RawImport::destroy`] releases
/// the Vulkan objects and then that buffer. Dropped without `destroy`, it leaks both (a queue
/// may still read the pages, so they stay mapped).
pub struct RawImport {
    pub buffer: vk::Buffer,
    pub memory: vk::DeviceMemory,
    pub size: u64,
    pub path: ImportPath,
    /// Whether the memory type is `HOST_COHERENT`.
    pub host_coherent: bool,
    keep_alive: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl std::fmt::Debug for RawImport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawImport")
            .field("buffer", &self.buffer)
            .field("size", &self.size)
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl RawImport {
    /// Destroys the buffer, frees the memory, then releases what owns the imported pages.
    ///
    /// # Safety
    /// `device` is the device the import was made on, and no pending queue work uses the buffer.
    pub unsafe fn destroy(mut self, device: &ash::Device) {
        // SAFETY: the caller guarantees the device and that the queue no longer uses them.
        unsafe { device.destroy_buffer(self.buffer, None) };
        // SAFETY: as above; the buffer bound to the memory is destroyed.
        unsafe { device.free_memory(self.memory, None) };
        drop(self.keep_alive.take());
    }
}

impl Drop for RawImport {
    fn drop(&mut self) {
        // Not destroyed: the device may still read the pages, so they stay mapped (leaked).
        if let Some(k) = self.keep_alive.take() {
            std::mem::forget(k);
        }
    }
}

/// How [`import_raw`] and [`import_wgpu_buffer`] bring `source` to Vulkan: a dma-buf through
/// its fd, memfd or host memory through its address.
fn unified_memory(
    source: &UnifiedBuffer,
    caps: &ImportCaps,
) -> Result<(Memory, ImportPath), Error> {
    let size = source.mapped_len() as u64;
    if source.is_dma_buf() && caps.dma_buf {
        let fd = source.fd().expect("dma-bufs have an fd");
        let dup = rustix::io::fcntl_dupfd_cloexec(fd, 0)
            .map_err(|e| Error::Vulkan(format!("dup(dma-buf) failed: {e}")))?;
        let memory = Memory::Fd(dup, vk::ExternalMemoryHandleTypeFlags::DMA_BUF_EXT);
        return Ok((memory, ImportPath::DmaBuf));
    }
    if caps.host_pointer && !source.is_dma_buf() {
        let alignment = caps.host_pointer_alignment;
        if alignment == 0
            || !size.is_multiple_of(alignment)
            || !(source.as_ptr() as u64).is_multiple_of(alignment)
        {
            return Err(Error::Vulkan(format!(
                "host import needs address and size aligned to {alignment} bytes; allocate with that alignment"
            )));
        }
        return Ok((Memory::Host(source.as_ptr()), ImportPath::HostPointer));
    }
    Err(Error::Vulkan(format!(
        "no import path for a {:?} buffer: dma-buf import {}, host-pointer import {}",
        source.backend(),
        if caps.dma_buf {
            "available"
        } else {
            "missing (VK_EXT_external_memory_dma_buf)"
        },
        if caps.host_pointer {
            "available"
        } else {
            "missing (VK_EXT_external_memory_host)"
        },
    )))
}

/// Imports `source` (its whole mapped length) into a `VkDevice` the caller made (with the
/// extensions `caps` reports, from [`ImportCaps::query`]) as a storage buffer: the ash-level
/// import under [`import_wgpu_buffer`], for engines that are not wgpu.
///
/// # Safety
/// - `instance`, `physical` and `device` belong together and are live until the import is
///   destroyed;
/// - as [`import_wgpu_buffer`]: while device work that writes the buffer may be executing, no
///   [`UnifiedBuffer::cpu_access`] guard of `source` may be alive or taken. Device reads race
///   nothing the CPU holds as a reference, but a CPU writer meanwhile gives them torn data.
pub unsafe fn import_raw(
    instance: &ash::Instance,
    device: &ash::Device,
    physical: vk::PhysicalDevice,
    caps: &ImportCaps,
    source: Arc<UnifiedBuffer>,
) -> Result<RawImport, Error> {
    let size = source.mapped_len() as u64;
    let (memory, path) = unified_memory(&source, caps)?;
    // SAFETY: the caller guarantees the handles; `source` owns the memory and rides along.
    unsafe {
        import_memory(
            instance,
            device,
            physical,
            memory,
            size,
            Box::new(source),
            path,
        )
    }
}

/// What an import hands to Vulkan.
enum Memory {
    /// The start of a live host mapping, suitably aligned.
    Host(*mut u8),
    /// An fd Vulkan takes ownership of on success, and its handle type.
    Fd(OwnedFd, vk::ExternalMemoryHandleTypeFlags),
}

/// Creates a `VkBuffer` on `raw` bound to imported memory. `keep_alive` owns the imported
/// pages and rides in the result until it is destroyed.
///
/// # Safety
/// `instance`, `physical` and `raw` belong together and are live; a host pointer is the start
/// of a live mapping of at least `size` bytes that `keep_alive` owns.
unsafe fn import_memory(
    instance: &ash::Instance,
    raw: &ash::Device,
    physical: vk::PhysicalDevice,
    memory: Memory,
    size: u64,
    keep_alive: Box<dyn std::any::Any + Send + Sync>,
    path: ImportPath,
) -> Result<RawImport, Error> {
    let handle_type = match &memory {
        Memory::Host(_) => vk::ExternalMemoryHandleTypeFlags::HOST_ALLOCATION_EXT,
        Memory::Fd(_, t) => *t,
    };

    // Which memory types can hold the import.
    let import_types = match &memory {
        Memory::Host(ptr) => {
            let ext = ash::ext::external_memory_host::Device::new(instance, raw);
            let mut props = vk::MemoryHostPointerPropertiesEXT::default();
            let query = ext.fp().get_memory_host_pointer_properties_ext;
            // SAFETY: the function pointer was loaded for this device; the pointer is the start
            // of a live host mapping (the caller's `keep_alive` owns it); `props` is valid.
            unsafe { query(ext.device(), handle_type, ptr.cast(), &mut props) }
                .result()
                .map_err(vk_error("vkGetMemoryHostPointerPropertiesEXT"))?;
            props.memory_type_bits
        }
        Memory::Fd(fd, _) if handle_type == vk::ExternalMemoryHandleTypeFlags::DMA_BUF_EXT => {
            use std::os::fd::AsRawFd;
            let ext = ash::khr::external_memory_fd::Device::new(instance, raw);
            let mut props = vk::MemoryFdPropertiesKHR::default();
            // SAFETY: a valid open dma-buf fd, only inspected.
            unsafe { ext.get_memory_fd_properties(handle_type, fd.as_raw_fd(), &mut props) }
                .map_err(vk_error("vkGetMemoryFdPropertiesKHR"))?;
            props.memory_type_bits
        }
        // Opaque fds carry no queryable properties: the buffer's own requirements decide.
        Memory::Fd(..) => u32::MAX,
    };

    let mut external = vk::ExternalMemoryBufferCreateInfo::default().handle_types(handle_type);
    let buffer_info = vk::BufferCreateInfo::default()
        .size(size)
        .usage(
            vk::BufferUsageFlags::STORAGE_BUFFER
                | vk::BufferUsageFlags::TRANSFER_SRC
                | vk::BufferUsageFlags::TRANSFER_DST
                | vk::BufferUsageFlags::UNIFORM_BUFFER,
        )
        .sharing_mode(vk::SharingMode::EXCLUSIVE)
        .push_next(&mut external);
    // SAFETY: a valid device and create info.
    let vk_buffer =
        unsafe { raw.create_buffer(&buffer_info, None) }.map_err(vk_error("vkCreateBuffer"))?;
    // From here on, failures must destroy what was created.
    let destroy_buffer = |raw: &ash::Device| {
        // SAFETY: the buffer was created above and is not in use.
        unsafe { raw.destroy_buffer(vk_buffer, None) }
    };
    // SAFETY: a valid buffer of this device.
    let reqs = unsafe { raw.get_buffer_memory_requirements(vk_buffer) };
    // SAFETY: a valid physical device of this instance.
    let mem_props = unsafe { instance.get_physical_device_memory_properties(physical) };
    let candidates = reqs.memory_type_bits & import_types;
    let wanted_flags = match path {
        // The CPU reads these through its own mapping, so the memory must be host-visible.
        ImportPath::HostPointer | ImportPath::DmaBuf => vk::MemoryPropertyFlags::HOST_VISIBLE,
        ImportPath::OpaqueFd => vk::MemoryPropertyFlags::empty(),
    };
    let fits = |i: u32, flags: vk::MemoryPropertyFlags| {
        candidates & (1 << i) != 0
            && mem_props.memory_types[i as usize]
                .property_flags
                .contains(flags)
    };
    // Host memory imported by address is read and written through the buffer's own mapping,
    // which has no Vulkan flush or invalidate: only a coherent type keeps the CPU and the device
    // in agreement, so nothing else is accepted. A dma-buf's CPU access brackets itself with
    // DMA_BUF_IOCTL_SYNC, whose exporter does the cache maintenance, so any host-visible type
    // serves, coherent first.
    let coherent = wanted_flags | vk::MemoryPropertyFlags::HOST_COHERENT;
    let chosen = (0..mem_props.memory_type_count)
        .find(|&i| fits(i, coherent))
        .or_else(|| {
            (path != ImportPath::HostPointer)
                .then(|| (0..mem_props.memory_type_count).find(|&i| fits(i, wanted_flags)))
                .flatten()
        });
    let Some(type_index) = chosen else {
        destroy_buffer(raw);
        return Err(Error::Vulkan(format!(
            "no suitable memory type accepts this import (buffer types {:#x}, import types {:#x})",
            reqs.memory_type_bits, import_types
        )));
    };
    let host_coherent = mem_props.memory_types[type_index as usize]
        .property_flags
        .contains(vk::MemoryPropertyFlags::HOST_COHERENT);

    let allocated = match memory {
        Memory::Host(ptr) => {
            let mut import = vk::ImportMemoryHostPointerInfoEXT::default()
                .handle_type(handle_type)
                .host_pointer(ptr.cast());
            let info = vk::MemoryAllocateInfo::default()
                .allocation_size(size)
                .memory_type_index(type_index)
                .push_next(&mut import);
            // SAFETY: the pointer and size are aligned (checked by the caller) and cover a live
            // mapping that `keep_alive` owns until the memory is freed in the drop callback.
            unsafe { raw.allocate_memory(&info, None) }
        }
        Memory::Fd(fd, _) => {
            use std::os::fd::{FromRawFd, IntoRawFd};
            let raw_fd = fd.into_raw_fd();
            let mut import = vk::ImportMemoryFdInfoKHR::default()
                .handle_type(handle_type)
                .fd(raw_fd);
            let info = vk::MemoryAllocateInfo::default()
                .allocation_size(size)
                .memory_type_index(type_index)
                .push_next(&mut import);
            // SAFETY: `raw_fd` is memory of the given handle type and at least `size` bytes;
            // Vulkan owns it on success.
            let result = unsafe { raw.allocate_memory(&info, None) };
            if result.is_err() {
                // SAFETY: on failure Vulkan did not take the fd; it is still ours to close.
                drop(unsafe { OwnedFd::from_raw_fd(raw_fd) });
            }
            result
        }
    };
    let vk_memory = allocated.map_err(|e| {
        destroy_buffer(raw);
        vk_error("vkAllocateMemory(import)")(e)
    })?;
    // SAFETY: buffer and memory of this device; the memory type was chosen from the buffer's
    // requirements and the import covers the buffer's size.
    if let Err(e) = unsafe { raw.bind_buffer_memory(vk_buffer, vk_memory, 0) } {
        destroy_buffer(raw);
        // SAFETY: the memory was allocated above and is bound to nothing.
        unsafe { raw.free_memory(vk_memory, None) };
        return Err(vk_error("vkBindBufferMemory")(e));
    }

    Ok(RawImport {
        buffer: vk_buffer,
        memory: vk_memory,
        size,
        path,
        host_coherent,
        keep_alive: Some(keep_alive),
    })
}

#[cfg(feature = "wgpu")]
pub use self::wgpu_interop::*;

#[cfg(feature = "wgpu")]
mod wgpu_interop {
    use super::*;

    const KHR_SEMAPHORE_FD: &CStr = ash::khr::external_semaphore_fd::NAME;

    /// The imports a device opened on `adapter` with [`open_wgpu_device`] would do (nothing
    /// when the adapter is not on wgpu's Vulkan backend), without opening one.
    pub fn adapter_import_caps(adapter: &wgpu::Adapter) -> ImportCaps {
        // SAFETY: the hal adapter is only borrowed for these queries.
        let Some(hal_adapter) = (unsafe { adapter.as_hal::<wgpu::hal::api::Vulkan>() }) else {
            return ImportCaps {
                dma_buf: false,
                opaque_fd: false,
                host_pointer: false,
                host_pointer_alignment: 0,
            };
        };
        caps_with(&hal_adapter, &offered_extensions(&hal_adapter, &[]))
    }

    /// The import extensions (and `extra`) that `adapter` offers.
    fn offered_extensions(
        adapter: &wgpu::hal::vulkan::Adapter,
        extra: &[&'static CStr],
    ) -> Vec<&'static CStr> {
        IMPORT_EXTENSIONS
            .into_iter()
            .chain(extra.iter().copied())
            .filter(|e| adapter.physical_device_capabilities().supports_extension(e))
            .collect()
    }

    /// The imports a device on `adapter` with `extensions` enabled can do.
    fn caps_with(adapter: &wgpu::hal::vulkan::Adapter, extensions: &[&'static CStr]) -> ImportCaps {
        ImportCaps::query(
            adapter.shared_instance().raw_instance(),
            adapter.raw_physical_device(),
            extensions,
        )
    }

    /// Opens a wgpu device on `adapter` (Vulkan backend) with the external-memory extensions the
    /// adapter offers added (and `VK_KHR_external_semaphore_fd`, so its timelines can be waited on
    /// by another device), and reports which imports it can do.
    pub fn open_wgpu_device(
        adapter: &wgpu::Adapter,
        desc: &wgpu::DeviceDescriptor<'_>,
    ) -> Result<(wgpu::Device, wgpu::Queue, ImportCaps), Error> {
        // SAFETY: the hal adapter is only borrowed for the duration of this function.
        let hal_adapter =
            unsafe { adapter.as_hal::<wgpu::hal::api::Vulkan>() }.ok_or_else(|| {
                Error::Vulkan("the adapter does not run on wgpu's Vulkan backend".into())
            })?;
        let wanted = offered_extensions(&hal_adapter, &[KHR_SEMAPHORE_FD]);
        let caps = caps_with(&hal_adapter, &wanted);
        let extra = wanted.clone();
        let callback = Box::new(
            move |args: wgpu::hal::vulkan::CreateDeviceCallbackArgs<'_, '_, '_>| {
                for e in extra {
                    if !args.extensions.contains(&e) {
                        args.extensions.push(e);
                    }
                }
            },
        );
        // SAFETY: the callback only adds extensions the adapter reports; features, limits and
        // hints are the caller's, as `request_device` would pass them.
        let open = unsafe {
            hal_adapter.open_with_callback(
                desc.required_features,
                &desc.required_limits,
                &desc.memory_hints,
                Some(callback),
            )
        }
        .map_err(|e| Error::Vulkan(format!("opening the device: {e}")))?;
        drop(hal_adapter);
        // SAFETY: `open` was created from this adapter's hal adapter just above.
        let (device, queue) = unsafe { adapter.create_device_from_hal(open, desc) }
            .map_err(|e| Error::Vulkan(format!("wrapping the device: {e}")))?;
        Ok((device, queue, caps))
    }

    /// A wgpu buffer over a [`UnifiedBuffer`]'s memory.
    #[derive(Debug)]
    pub struct ImportedBuffer {
        pub buffer: wgpu::Buffer,
        pub path: ImportPath,
        /// Whether the memory type is `HOST_COHERENT` (else reads after device writes also need an
        /// invalidate of the range).
        pub host_coherent: bool,
    }

    /// Imports `source` (its whole mapped length) into `device` as a wgpu buffer with `usage`:
    /// a dma-buf through its fd, memfd or host memory through its address. The wgpu buffer keeps
    /// `source` alive; drop every wgpu use of it before expecting the memory back. `device` must
    /// come from [`open_wgpu_device`], whose `caps` are passed in. Host memory is imported only into
    /// a `HOST_COHERENT` memory type (its CPU mapping has no flush or invalidate).
    ///
    /// # Safety
    /// The device and the CPU must not race on the memory: while device work that reads or writes
    /// the returned buffer may be executing (from when it can start until it is known complete, by
    /// a fence, a timeline value or a device poll), no [`UnifiedBuffer::cpu_access`] guard of
    /// `source` may be alive, and none may be taken. Work can start at its submission, or, when it
    /// waits in the queue for a timeline value, once that value is signalled; a guard held while such work is submitted must
    /// be dropped first. The CPU guards hand out plain `&[u8]`/`&mut [u8]`, so a device write under
    /// one would be a data race.
    pub unsafe fn import_wgpu_buffer(
        device: &wgpu::Device,
        caps: &ImportCaps,
        source: Arc<UnifiedBuffer>,
        usage: wgpu::BufferUsages,
        label: Option<&str>,
    ) -> Result<ImportedBuffer, Error> {
        let size = source.mapped_len() as u64;
        let (memory, path) = unified_memory(&source, caps)?;
        import(device, memory, size, usage, label, Box::new(source), path)
    }

    /// Imports `size` bytes of memory that a Vulkan driver exported as an opaque fd
    /// (`VK_KHR_external_memory_fd`; from another device or process with the same driver and
    /// device UUID) as a wgpu buffer. Vulkan owns `fd` once the import succeeds.
    pub fn import_opaque_fd(
        device: &wgpu::Device,
        caps: &ImportCaps,
        fd: OwnedFd,
        size: u64,
        usage: wgpu::BufferUsages,
        label: Option<&str>,
    ) -> Result<ImportedBuffer, Error> {
        if !caps.opaque_fd {
            return Err(Error::Vulkan(
                "opaque fd import needs VK_KHR_external_memory_fd".into(),
            ));
        }
        let memory = Memory::Fd(fd, vk::ExternalMemoryHandleTypeFlags::OPAQUE_FD);
        import(
            device,
            memory,
            size,
            usage,
            label,
            Box::new(()),
            ImportPath::OpaqueFd,
        )
    }

    /// Imports memory into `device` and wraps it as a wgpu buffer whose drop destroys the buffer,
    /// frees the memory and then drops `keep_alive` (what owns the imported pages).
    fn import(
        device: &wgpu::Device,
        memory: Memory,
        size: u64,
        usage: wgpu::BufferUsages,
        label: Option<&str>,
        keep_alive: Box<dyn std::any::Any + Send + Sync>,
        path: ImportPath,
    ) -> Result<ImportedBuffer, Error> {
        // SAFETY: the hal device is only borrowed while the Vulkan objects are created.
        let hal_device = unsafe { device.as_hal::<wgpu::hal::api::Vulkan>() }.ok_or_else(|| {
            Error::Vulkan("the device does not run on wgpu's Vulkan backend".into())
        })?;
        let raw = hal_device.raw_device().clone();
        let instance = hal_device.shared_instance().raw_instance().clone();
        let physical = hal_device.raw_physical_device();
        drop(hal_device);
        // SAFETY: the handles come from one live wgpu device, which the buffer below keeps alive.
        let mut imported =
            unsafe { import_memory(&instance, &raw, physical, memory, size, keep_alive, path) }?;
        let (vk_buffer, vk_memory) = (imported.buffer, imported.memory);
        let keep_alive = imported.keep_alive.take();
        let host_coherent = imported.host_coherent;
        let device_for_drop = raw.clone();
        let on_drop: wgpu::hal::DropCallback = Box::new(move || {
            // SAFETY: wgpu calls this once, after its last use of the buffer; buffer and memory are
            // ours, and `keep_alive` (dropped last) keeps the imported pages valid until then.
            unsafe { device_for_drop.destroy_buffer(vk_buffer, None) };
            // SAFETY: as above; the buffer bound to the memory is destroyed.
            unsafe { device_for_drop.free_memory(vk_memory, None) };
            drop(keep_alive);
        });
        // SAFETY: the buffer outlives the hal buffer (destroyed in its drop callback), and imported
        // memory is never mapped by wgpu (the CPU uses its own mapping).
        let hal_buffer =
            unsafe { wgpu::hal::vulkan::Buffer::from_raw_externally_owned(vk_buffer, on_drop) };
        let desc = wgpu::BufferDescriptor {
            label,
            size,
            usage,
            mapped_at_creation: false,
        };
        // SAFETY: `hal_buffer` was created on this device's `VkDevice` with usages covering every
        // wgpu usage allowed here (storage, uniform, copies), and its size is `size`.
        let buffer =
            unsafe { device.create_buffer_from_hal::<wgpu::hal::api::Vulkan>(hal_buffer, &desc) };
        Ok(ImportedBuffer {
            buffer,
            path,
            host_coherent,
        })
    }

    /// A command buffer holding only the memory barrier that makes compute-shader and transfer
    /// writes visible to host reads (`SHADER_WRITE | TRANSFER_WRITE` -> `HOST_READ`). Submit it
    /// after the work, in the same `queue.submit`, before a CPU reads an imported buffer's original
    /// mapping. (It is its own command buffer because wgpu does not mix raw and wgpu commands in
    /// one encoder; a barrier orders everything earlier in submission order.)
    pub fn host_read_barrier(device: &wgpu::Device) -> Result<wgpu::CommandBuffer, Error> {
        memory_barrier(
            device,
            "host-read barrier",
            (
                vk::PipelineStageFlags::COMPUTE_SHADER | vk::PipelineStageFlags::TRANSFER,
                vk::AccessFlags::SHADER_WRITE | vk::AccessFlags::TRANSFER_WRITE,
            ),
            (vk::PipelineStageFlags::HOST, vk::AccessFlags::HOST_READ),
        )
    }

    /// A command buffer holding only the memory barrier that makes host writes visible to compute
    /// shaders and transfers (`HOST_WRITE` -> `SHADER_READ | TRANSFER_READ`). Submit it before work
    /// that reads memory the host writes after the submission: work that waits in the queue for a
    /// timeline value the host signals once it has written (queue submission itself only covers
    /// host writes made before it).
    pub fn host_write_barrier(device: &wgpu::Device) -> Result<wgpu::CommandBuffer, Error> {
        memory_barrier(
            device,
            "host-write barrier",
            (vk::PipelineStageFlags::HOST, vk::AccessFlags::HOST_WRITE),
            (
                vk::PipelineStageFlags::COMPUTE_SHADER | vk::PipelineStageFlags::TRANSFER,
                vk::AccessFlags::SHADER_READ | vk::AccessFlags::TRANSFER_READ,
            ),
        )
    }

    /// A command buffer holding one global memory barrier from `src` to `dst` (stages, accesses).
    fn memory_barrier(
        device: &wgpu::Device,
        label: &str,
        src: (vk::PipelineStageFlags, vk::AccessFlags),
        dst: (vk::PipelineStageFlags, vk::AccessFlags),
    ) -> Result<wgpu::CommandBuffer, Error> {
        // SAFETY: only the raw device handle is read.
        let raw = unsafe { device.as_hal::<wgpu::hal::api::Vulkan>() }
            .map(|d| d.raw_device().clone())
            .ok_or_else(|| {
                Error::Vulkan("the device does not run on wgpu's Vulkan backend".into())
            })?;
        let barrier = vk::MemoryBarrier::default()
            .src_access_mask(src.1)
            .dst_access_mask(dst.1);
        let mut encoder =
            device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(label) });
        let record = |hal: Option<&mut wgpu::hal::vulkan::CommandEncoder>| {
            let Some(hal) = hal else { return false };
            // SAFETY: the handle is only used to record into while the encoder is open.
            let cb = unsafe { hal.raw_handle() };
            // SAFETY: the command buffer is recording (the encoder is open) on this device, and the
            // barrier array lives for the call.
            unsafe {
                raw.cmd_pipeline_barrier(
                    cb,
                    src.0,
                    dst.0,
                    vk::DependencyFlags::empty(),
                    &[barrier],
                    &[],
                    &[],
                )
            };
            true
        };
        // SAFETY: `record` records one barrier into the encoder's open command buffer, does not end
        // it, and touches nothing wgpu tracks (a global memory barrier names no resource).
        let recorded = unsafe { encoder.as_hal_mut::<wgpu::hal::api::Vulkan, _, _>(record) };
        if recorded {
            Ok(encoder.finish())
        } else {
            Err(Error::Vulkan("the encoder is not a Vulkan encoder".into()))
        }
    }

    /// Imports of [`UnifiedBuffer`]s into one wgpu device, made once per buffer and kept: the
    /// buffers a pipeline cycles through (a source's frame pool, a ring's slots) are imported the
    /// first time they are seen, and every later use gets the same `wgpu::Buffer`.
    ///
    /// One import per buffer per device also matters for correctness: wgpu orders the work of
    /// different submissions on one buffer (it records the barriers between a write and a later
    /// read), but two imports of the same memory are two buffers to it, and nothing would order
    /// a write through one against a read through the other. Stages that share memory on one
    /// device share one cache.
    ///
    /// The cache holds at most `capacity` imports; past that, the oldest is dropped (wgpu destroys
    /// it once its last submission has finished, so an eviction never pulls memory from under
    /// running work).
    #[derive(Debug)]
    pub struct ImportCache {
        device: wgpu::Device,
        caps: ImportCaps,
        capacity: usize,
        /// Oldest first. The pointer identifies an `Arc<UnifiedBuffer>` that the entry's import
        /// keeps alive, so it cannot be reused by another buffer while the entry exists.
        entries: std::sync::Mutex<std::collections::VecDeque<(usize, wgpu::Buffer)>>,
    }

    impl ImportCache {
        /// A cache over `device` (from [`open_wgpu_device`], with its `caps`) keeping at most
        /// `capacity` imports (at least 1).
        pub fn new(device: &wgpu::Device, caps: ImportCaps, capacity: usize) -> ImportCache {
            ImportCache {
                device: device.clone(),
                caps,
                capacity: capacity.max(1),
                entries: std::sync::Mutex::new(std::collections::VecDeque::new()),
            }
        }

        /// Imports made so far and still held.
        pub fn len(&self) -> usize {
            self.entries.lock().map_or(0, |e| e.len())
        }

        /// Whether nothing is imported.
        pub fn is_empty(&self) -> bool {
            self.len() == 0
        }

        /// The wgpu buffer over `buffer`'s memory (storage, uniform and copy usages), imported now
        /// if this cache has not seen `buffer` before.
        ///
        /// # Safety
        /// As [`import_wgpu_buffer`]: while device work that uses the returned buffer may be
        /// executing, no CPU guard of `buffer` may be alive or taken.
        pub unsafe fn get(&self, buffer: &Arc<UnifiedBuffer>) -> Result<wgpu::Buffer, Error> {
            let key = Arc::as_ptr(buffer) as usize;
            let mut entries = self
                .entries
                .lock()
                .map_err(|_| Error::Vulkan("a thread panicked while importing".into()))?;
            if let Some((_, imported)) = entries.iter().find(|(k, _)| *k == key) {
                return Ok(imported.clone());
            }
            // SAFETY: the caller upholds the CPU/device exclusion for every use of the import.
            let imported = unsafe {
                import_wgpu_buffer(
                    &self.device,
                    &self.caps,
                    Arc::clone(buffer),
                    wgpu::BufferUsages::STORAGE
                        | wgpu::BufferUsages::UNIFORM
                        | wgpu::BufferUsages::COPY_SRC
                        | wgpu::BufferUsages::COPY_DST,
                    Some("unified buffer"),
                )
            }?;
            if entries.len() == self.capacity {
                entries.pop_front();
            }
            entries.push_back((key, imported.buffer.clone()));
            Ok(imported.buffer)
        }
    }
}
