//! The Vulkan context under the GPU backend: instance, the chosen physical device, one compute
//! queue, memory types, and buffers with their memory.
//!
//! Everything here is owned: [`Context`] destroys the device and instance when the last
//! reference goes, and [`GpuBuffer`]s are destroyed explicitly by their owner (the device) before
//! that, after the queue is idle.

use std::ffi::CStr;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use ash::vk;

use crate::Error;

pub(crate) fn vk_err(call: &'static str) -> impl Fn(vk::Result) -> Error {
    move |r| Error::Vulkan { call, result: r }
}

/// One Vulkan adapter as discovery sees it.
#[derive(Clone, Debug)]
pub(crate) struct Adapter {
    pub(crate) index: usize,
    pub(crate) name: String,
    pub(crate) kind: vk::PhysicalDeviceType,
    pub(crate) api: u32,
    /// Why the backend cannot run on it, if it cannot.
    pub(crate) unusable: Option<String>,
}

impl Adapter {
    /// Lower is preferred: discrete, integrated, virtual, then CPU implementations.
    pub(crate) fn rank(&self) -> u32 {
        match self.kind {
            vk::PhysicalDeviceType::DISCRETE_GPU => 0,
            vk::PhysicalDeviceType::INTEGRATED_GPU => 1,
            vk::PhysicalDeviceType::VIRTUAL_GPU => 2,
            vk::PhysicalDeviceType::CPU => 3,
            _ => 4,
        }
    }

    pub(crate) fn is_cpu(&self) -> bool {
        self.kind == vk::PhysicalDeviceType::CPU
    }

    pub(crate) fn kind_name(&self) -> &'static str {
        match self.kind {
            vk::PhysicalDeviceType::DISCRETE_GPU => "discrete GPU",
            vk::PhysicalDeviceType::INTEGRATED_GPU => "integrated GPU",
            vk::PhysicalDeviceType::VIRTUAL_GPU => "virtual GPU",
            vk::PhysicalDeviceType::CPU => "CPU (software Vulkan)",
            _ => "other",
        }
    }
}

/// A loaded instance, before any device is chosen.
pub(crate) struct Instance {
    // Drop order: the instance is destroyed explicitly (in `Drop`), before the entry (the
    // loaded library) goes.
    pub(crate) instance: ash::Instance,
    /// The loaded library, kept until the instance is gone.
    entry: ash::Entry,
}

/// The process's one instance ([`Instance::shared`]), made on first use and kept.
static SHARED_INSTANCE: Mutex<Option<Arc<Instance>>> = Mutex::new(None);

impl Instance {
    /// The process's instance: every device and probe shares it, and it lives until the
    /// process ends, so the loader loads the driver once. NVIDIA's driver takes static TLS each
    /// time the loader loads it, which glibc does not give back: a process that made and
    /// destroyed an instance per device ran out (`gpu_vs_cpu` on an H100:
    /// vkCreateInstance "Unable to find a Vulkan driver" from the eleventh test on, and every
    /// test passing with `GLIBC_TUNABLES=glibc.rtld.optional_static_tls=262144`). A failure is
    /// not kept: the next call tries again.
    pub(crate) fn shared() -> Result<Arc<Instance>, Error> {
        let mut slot = SHARED_INSTANCE
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(instance) = slot.as_ref() {
            return Ok(Arc::clone(instance));
        }
        let instance = Arc::new(Instance::new()?);
        *slot = Some(Arc::clone(&instance));
        Ok(instance)
    }

    fn new() -> Result<Instance, Error> {
        // SAFETY: loading the Vulkan loader runs its initialisers; the library is the system's
        // `libvulkan.so.1`, which is built to be loaded this way.
        let entry = unsafe { ash::Entry::load() }.map_err(|e| Error::Unsupported {
            what: "the Vulkan backend",
            why: format!("no Vulkan loader: {e}"),
        })?;
        let app = vk::ApplicationInfo::default()
            .application_name(c"npu-hal")
            .api_version(vk::API_VERSION_1_2);
        let info = vk::InstanceCreateInfo::default().application_info(&app);
        // SAFETY: a valid create info with no extensions or layers.
        let instance =
            unsafe { entry.create_instance(&info, None) }.map_err(vk_err("vkCreateInstance"))?;
        Ok(Instance { instance, entry })
    }

    pub(crate) fn adapters(&self) -> Result<Vec<(vk::PhysicalDevice, Adapter)>, Error> {
        // SAFETY: a live instance.
        let devices = unsafe { self.instance.enumerate_physical_devices() }
            .map_err(vk_err("vkEnumeratePhysicalDevices"))?;
        Ok(devices
            .into_iter()
            .enumerate()
            .map(|(index, pd)| {
                // SAFETY: a physical device of this instance.
                let props = unsafe { self.instance.get_physical_device_properties(pd) };
                // SAFETY: `device_name` is a NUL-terminated array filled by the driver.
                let name = unsafe { CStr::from_ptr(props.device_name.as_ptr()) }
                    .to_string_lossy()
                    .into_owned();
                let unusable = self.unusable(pd, &props);
                (
                    pd,
                    Adapter {
                        index,
                        name,
                        kind: props.device_type,
                        api: props.api_version,
                        unusable,
                    },
                )
            })
            .collect())
    }

    fn unusable(
        &self,
        pd: vk::PhysicalDevice,
        props: &vk::PhysicalDeviceProperties,
    ) -> Option<String> {
        if props.api_version < vk::API_VERSION_1_2 {
            return Some(format!(
                "Vulkan {}.{} (1.2 needed, for timeline semaphores)",
                vk::api_version_major(props.api_version),
                vk::api_version_minor(props.api_version)
            ));
        }
        let mut v12 = vk::PhysicalDeviceVulkan12Features::default();
        let mut features = vk::PhysicalDeviceFeatures2::default().push_next(&mut v12);
        // SAFETY: a physical device of this 1.2 instance; the chain is valid.
        unsafe {
            self.instance
                .get_physical_device_features2(pd, &mut features)
        };
        if v12.timeline_semaphore == 0 {
            return Some("no timeline semaphores".into());
        }
        if props.limits.max_push_constants_size < PUSH_BYTES {
            return Some(format!(
                "{} bytes of push constants ({PUSH_BYTES} needed)",
                props.limits.max_push_constants_size
            ));
        }
        if compute_queue_family(&self.instance, pd).is_none() {
            return Some("no compute queue".into());
        }
        // The GEMV kernels add each row's lanes by subgroup shuffles (linear_gemv.wgsl).
        let mut subgroups = vk::PhysicalDeviceSubgroupProperties::default();
        let mut props2 = vk::PhysicalDeviceProperties2::default().push_next(&mut subgroups);
        // SAFETY: a physical device of this 1.2 instance; the chain is valid.
        unsafe {
            self.instance
                .get_physical_device_properties2(pd, &mut props2)
        };
        let shuffles = vk::SubgroupFeatureFlags::BASIC | vk::SubgroupFeatureFlags::SHUFFLE;
        if !subgroups
            .supported_stages
            .contains(vk::ShaderStageFlags::COMPUTE)
            || !subgroups.supported_operations.contains(shuffles)
        {
            return Some(format!(
                "no subgroup shuffles in compute shaders (stages {:?}, operations {:?})",
                subgroups.supported_stages, subgroups.supported_operations
            ));
        }
        None
    }

    /// Why `pd` cannot run the tensor-core GEMM (`shaders/linear_gemm_coop.wgsl`), or `None`
    /// when it can. It needs VK_KHR_cooperative_matrix with a 16x16x16 f16 x f16 -> f32
    /// subgroup configuration; f16 arithmetic and 16-bit storage access (naga declares both
    /// for any module with an f16 type); the Vulkan memory model (naga writes cooperative-matrix
    /// modules in it); 32-lane subgroups (the kernel's 128 invocations are 4 subgroups); and
    /// the workgroup memory it declares.
    pub(crate) fn tensor_core_gap(
        &self,
        pd: vk::PhysicalDevice,
        offered: &[vk::ExtensionProperties],
    ) -> Option<String> {
        let coop = ash::khr::cooperative_matrix::NAME;
        if !offered
            .iter()
            .any(|e| e.extension_name_as_c_str().is_ok_and(|n| n == coop))
        {
            return Some(format!("no {}", coop.to_string_lossy()));
        }
        let mut v11 = vk::PhysicalDeviceVulkan11Features::default();
        let mut v12 = vk::PhysicalDeviceVulkan12Features::default();
        let mut coop_features = vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default();
        let mut features = vk::PhysicalDeviceFeatures2::default()
            .push_next(&mut v11)
            .push_next(&mut v12)
            .push_next(&mut coop_features);
        // SAFETY: a physical device of this 1.2 instance that offers the extension whose
        // feature struct is chained; the chain is valid.
        unsafe {
            self.instance
                .get_physical_device_features2(pd, &mut features)
        };
        let missing = [
            (coop_features.cooperative_matrix, "cooperativeMatrix"),
            (v12.shader_float16, "shaderFloat16"),
            (v11.storage_buffer16_bit_access, "storageBuffer16BitAccess"),
            (
                v11.uniform_and_storage_buffer16_bit_access,
                "uniformAndStorageBuffer16BitAccess",
            ),
            (v12.vulkan_memory_model, "vulkanMemoryModel"),
            (
                v12.vulkan_memory_model_device_scope,
                "vulkanMemoryModelDeviceScope",
            ),
        ]
        .into_iter()
        .filter(|&(on, _)| on == vk::FALSE)
        .map(|(_, name)| name)
        .collect::<Vec<_>>();
        if !missing.is_empty() {
            return Some(format!("no {}", missing.join(", ")));
        }
        let mut subgroups = vk::PhysicalDeviceSubgroupProperties::default();
        let mut props2 = vk::PhysicalDeviceProperties2::default().push_next(&mut subgroups);
        // SAFETY: as above.
        unsafe {
            self.instance
                .get_physical_device_properties2(pd, &mut props2)
        };
        let shared = props2.properties.limits.max_compute_shared_memory_size;
        if subgroups.subgroup_size != 32 {
            return Some(format!(
                "{}-lane subgroups (the kernel takes 32)",
                subgroups.subgroup_size
            ));
        }
        let needed = super::shaders::TENSOR_CORE_GEMM_SHARED_BYTES;
        if shared < needed {
            return Some(format!(
                "{shared} bytes of workgroup memory (the kernel declares {needed})"
            ));
        }
        let loader = ash::khr::cooperative_matrix::Instance::new(&self.entry, &self.instance);
        // SAFETY: a physical device of this instance, which offers the extension.
        let shapes = unsafe { loader.get_physical_device_cooperative_matrix_properties(pd) }
            .unwrap_or_default();
        let f16 = vk::ComponentTypeKHR::FLOAT16;
        let f32 = vk::ComponentTypeKHR::FLOAT32;
        let fits = shapes.iter().any(|p| {
            (p.m_size, p.n_size, p.k_size) == (16, 16, 16)
                && (p.a_type, p.b_type, p.c_type, p.result_type) == (f16, f16, f32, f32)
                && p.scope == vk::ScopeKHR::SUBGROUP
        });
        if !fits {
            return Some("no 16x16x16 f16 x f16 -> f32 subgroup cooperative matrix".into());
        }
        None
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        // SAFETY: every device of this instance was destroyed by its `Context` (each holds the
        // instance it was created from, so the last is dropped first).
        unsafe { self.instance.destroy_instance(None) };
    }
}

/// Push-constant bytes every kernel's layout declares (Vulkan guarantees 128).
pub(crate) const PUSH_BYTES: u32 = 32;

fn compute_queue_family(instance: &ash::Instance, pd: vk::PhysicalDevice) -> Option<u32> {
    // SAFETY: a physical device of this instance.
    let families = unsafe { instance.get_physical_device_queue_family_properties(pd) };
    // Prefer a compute queue without graphics (the async compute engine), then any.
    let pick = |want_graphics: bool| {
        families.iter().position(|f| {
            f.queue_flags.contains(vk::QueueFlags::COMPUTE)
                && f.queue_flags.contains(vk::QueueFlags::GRAPHICS) == want_graphics
        })
    };
    pick(false).or_else(|| pick(true)).map(|i| i as u32)
}

/// Where a buffer's memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Memory {
    /// Device-local (weights, activations, KV pages); host-mapped as well on unified memory.
    Device,
    /// Host-visible and coherent, device-local where it can be, written by the host before a
    /// submission (step values, spliced embeddings).
    Upload,
    /// Host-visible, cached where possible, read by the host after a submission.
    Readback,
}

/// The device, its queue and what the backend needs to know about its memory.
pub(crate) struct Context {
    pub(crate) device: ash::Device,
    pub(crate) physical: vk::PhysicalDevice,
    pub(crate) queue_family: u32,
    pub(crate) adapter: Adapter,
    pub(crate) memory: vk::PhysicalDeviceMemoryProperties,
    pub(crate) timestamp_period_ns: f32,
    /// Device-local memory the host can map coherently: a unified-memory device, whose
    /// tensors the host reads in place.
    pub(crate) unified: bool,
    pub(crate) max_workgroups: [u32; 3],
    pub(crate) max_shared_bytes: u32,
    pub(crate) max_storage_range: u32,
    /// Which unified buffers the device imports (extensions enabled at creation).
    pub(crate) imports: uvm_alloc::vulkan::ImportCaps,
    /// Whether it imports other devices' timeline semaphores (opaque fds).
    pub(crate) imports_timelines: bool,
    /// Why the tensor-core GEMM cannot run here (`None`: it can, and the device was created
    /// with what it needs).
    pub(crate) tensor_core_gap: Option<String>,
    /// The GPU and driver, as exporters of timelines name the devices that can import them.
    pub(crate) export_target: sync_timeline::vulkan::ExportTarget,
    // The instance outlives the device (destroyed in `Drop` below; the shared instance
    // lives until the process ends).
    pub(crate) instance: Arc<Instance>,
}

// SAFETY: the handles are plain identifiers; Vulkan objects reachable from them are used under
// the external-synchronisation rules by their owners (the queue behind a mutex, command pools
// and descriptor pools behind `&mut`).
unsafe impl Send for Context {}
// SAFETY: as above; `&Context` only reads immutable properties or calls thread-safe entry points.
unsafe impl Sync for Context {}

impl Context {
    pub(crate) fn open(
        instance: Arc<Instance>,
        pd: vk::PhysicalDevice,
        adapter: Adapter,
    ) -> Result<Context, Error> {
        let queue_family =
            compute_queue_family(&instance.instance, pd).ok_or_else(|| Error::Unsupported {
                what: "the Vulkan backend",
                why: format!("{} has no compute queue", adapter.name),
            })?;
        let priorities = [1.0f32];
        let queues = [vk::DeviceQueueCreateInfo::default()
            .queue_family_index(queue_family)
            .queue_priorities(&priorities)];
        // What another engine's buffers and timelines need: external memory (an encoder's
        // output read in place) and external semaphores (waits on its timeline in the queue).
        // SAFETY: a physical device of this instance.
        let offered = unsafe { instance.instance.enumerate_device_extension_properties(pd) }
            .map_err(vk_err("vkEnumerateDeviceExtensionProperties"))?;
        let tensor_core_gap = instance.tensor_core_gap(pd, &offered);
        let tensor_cores = tensor_core_gap.is_none();
        let mut extensions: Vec<&'static CStr> = uvm_alloc::vulkan::IMPORT_EXTENSIONS
            .into_iter()
            .chain([ash::khr::external_semaphore_fd::NAME])
            .filter(|want| {
                offered
                    .iter()
                    .any(|e| e.extension_name_as_c_str().is_ok_and(|n| n == *want))
            })
            .collect();
        // The tensor-core GEMM's needs (`Instance::tensor_core_gap`), where all are there.
        if tensor_cores {
            extensions.push(ash::khr::cooperative_matrix::NAME);
        }
        let mut v11 = vk::PhysicalDeviceVulkan11Features::default()
            .storage_buffer16_bit_access(tensor_cores)
            .uniform_and_storage_buffer16_bit_access(tensor_cores);
        let mut v12 = vk::PhysicalDeviceVulkan12Features::default()
            .timeline_semaphore(true)
            .shader_float16(tensor_cores)
            .vulkan_memory_model(tensor_cores)
            .vulkan_memory_model_device_scope(tensor_cores);
        let mut coop =
            vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default().cooperative_matrix(true);
        let extension_ptrs: Vec<*const std::ffi::c_char> =
            extensions.iter().map(|e| e.as_ptr()).collect();
        let mut info = vk::DeviceCreateInfo::default()
            .queue_create_infos(&queues)
            .enabled_extension_names(&extension_ptrs)
            .push_next(&mut v11)
            .push_next(&mut v12);
        if tensor_cores {
            info = info.push_next(&mut coop);
        }
        // SAFETY: a physical device of this instance, a valid create info asking for one queue
        // of a family it has, features `Instance::unusable` and `Instance::tensor_core_gap`
        // checked, and extensions it offers.
        let device = unsafe { instance.instance.create_device(pd, &info, None) }
            .map_err(vk_err("vkCreateDevice"))?;
        // SAFETY: a physical device of this instance.
        let memory = unsafe { instance.instance.get_physical_device_memory_properties(pd) };
        // SAFETY: as above.
        let props = unsafe { instance.instance.get_physical_device_properties(pd) };
        let imports = uvm_alloc::vulkan::ImportCaps::query(&instance.instance, pd, &extensions);
        let imports_timelines = extensions.contains(&ash::khr::external_semaphore_fd::NAME)
            && sync_timeline::vulkan::exports_timelines(&instance.instance, pd);
        let mut ctx = Context {
            device,
            physical: pd,
            imports,
            imports_timelines,
            export_target: sync_timeline::vulkan::ExportTarget::of(&instance.instance, pd),
            queue_family,
            adapter,
            memory,
            timestamp_period_ns: props.limits.timestamp_period,
            unified: false,
            max_workgroups: props.limits.max_compute_work_group_count,
            max_shared_bytes: props.limits.max_compute_shared_memory_size,
            max_storage_range: props.limits.max_storage_buffer_range,
            tensor_core_gap,
            instance,
        };
        let coherent_local = vk::MemoryPropertyFlags::DEVICE_LOCAL
            | vk::MemoryPropertyFlags::HOST_VISIBLE
            | vk::MemoryPropertyFlags::HOST_COHERENT;
        ctx.unified = matches!(
            ctx.adapter.kind,
            vk::PhysicalDeviceType::INTEGRATED_GPU | vk::PhysicalDeviceType::CPU
        ) && ctx
            .memory_type(u32::MAX, coherent_local, vk::MemoryPropertyFlags::empty())
            .is_some();
        Ok(ctx)
    }

    pub(crate) fn queue(&self) -> vk::Queue {
        // SAFETY: queue 0 of the family the device was created with.
        unsafe { self.device.get_device_queue(self.queue_family, 0) }
    }

    /// The first memory type allowed by `bits` with every `want` flag, preferring one with
    /// every `prefer` flag too.
    fn memory_type(
        &self,
        bits: u32,
        want: vk::MemoryPropertyFlags,
        prefer: vk::MemoryPropertyFlags,
    ) -> Option<u32> {
        let types = &self.memory.memory_types[..self.memory.memory_type_count as usize];
        let ok = |i: usize, flags: vk::MemoryPropertyFlags| {
            bits & (1 << i) != 0 && types[i].property_flags.contains(flags)
        };
        (0..types.len())
            .find(|&i| ok(i, want | prefer))
            .or_else(|| (0..types.len()).find(|&i| ok(i, want)))
            .map(|i| i as u32)
    }

    /// A storage buffer of `size` bytes (at least 4) in `memory`, mapped when host-visible.
    pub(crate) fn buffer(&self, size: u64, memory: Memory) -> Result<GpuBuffer, Error> {
        let size = size.max(4).next_multiple_of(4);
        let info = vk::BufferCreateInfo::default()
            .size(size)
            .usage(
                vk::BufferUsageFlags::STORAGE_BUFFER
                    | vk::BufferUsageFlags::TRANSFER_SRC
                    | vk::BufferUsageFlags::TRANSFER_DST,
            )
            .sharing_mode(vk::SharingMode::EXCLUSIVE);
        // SAFETY: a valid create info on a live device.
        let raw =
            unsafe { self.device.create_buffer(&info, None) }.map_err(vk_err("vkCreateBuffer"))?;
        let mut buffer = GpuBuffer {
            raw,
            memory: vk::DeviceMemory::null(),
            size,
            map: None,
        };
        if let Err(e) = self.back(&mut buffer, memory) {
            self.destroy(buffer);
            return Err(e);
        }
        Ok(buffer)
    }

    fn back(&self, buffer: &mut GpuBuffer, memory: Memory) -> Result<(), Error> {
        use vk::MemoryPropertyFlags as F;
        // SAFETY: a buffer of this device.
        let req = unsafe { self.device.get_buffer_memory_requirements(buffer.raw) };
        let host = F::HOST_VISIBLE | F::HOST_COHERENT;
        let (want, prefer) = match memory {
            Memory::Device if self.unified => (F::DEVICE_LOCAL | host, F::HOST_CACHED),
            Memory::Device => (F::DEVICE_LOCAL, F::empty()),
            // Device-local where the host can map it (a resizable BAR): every kernel reads the
            // step values first, and across the bus each read costs a round trip.
            Memory::Upload => (host, F::DEVICE_LOCAL),
            Memory::Readback => (host, F::HOST_CACHED),
        };
        let index = self
            .memory_type(req.memory_type_bits, want, prefer)
            .ok_or_else(|| Error::Unsupported {
                what: "GPU memory",
                why: format!(
                    "no memory type with {want:?} for a {} byte buffer",
                    buffer.size
                ),
            })?;
        let alloc = vk::MemoryAllocateInfo::default()
            .allocation_size(req.size)
            .memory_type_index(index);
        // SAFETY: a valid allocate info for a memory type the buffer accepts.
        buffer.memory = unsafe { self.device.allocate_memory(&alloc, None) }
            .map_err(vk_err("vkAllocateMemory"))?;
        // SAFETY: fresh memory of a compatible type and size, bound once at offset 0.
        unsafe { self.device.bind_buffer_memory(buffer.raw, buffer.memory, 0) }
            .map_err(vk_err("vkBindBufferMemory"))?;
        let flags = self.memory.memory_types[index as usize].property_flags;
        if flags.contains(F::HOST_VISIBLE) {
            // SAFETY: host-visible memory, mapped once for its whole size and never unmapped
            // before it is freed.
            let ptr = unsafe {
                self.device.map_memory(
                    buffer.memory,
                    0,
                    vk::WHOLE_SIZE,
                    vk::MemoryMapFlags::empty(),
                )
            }
            .map_err(vk_err("vkMapMemory"))?;
            buffer.map = NonNull::new(ptr.cast::<u8>());
        }
        Ok(())
    }

    /// Destroys a buffer and frees its memory. The queue must no longer use it.
    pub(crate) fn destroy(&self, buffer: GpuBuffer) {
        // SAFETY: the buffer and memory belong to this device, and the caller guarantees no
        // pending work uses them (the device waits for its queue to be idle first).
        unsafe {
            self.device.destroy_buffer(buffer.raw, None);
        }
        if buffer.memory != vk::DeviceMemory::null() {
            // SAFETY: as above; freeing memory also unmaps it.
            unsafe { self.device.free_memory(buffer.memory, None) };
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every object created on the device was destroyed by its owner (the GPU NPU
        // and the timeline, both of which hold this context until then); waiting for idle
        // first covers work the driver may still be finishing.
        unsafe {
            let _ = self.device.device_wait_idle();
        }
        // SAFETY: as above; the device is not used after this.
        unsafe { self.device.destroy_device(None) };
    }
}

/// A buffer and its memory (mapped for its whole size when host-visible).
#[derive(Debug)]
pub(crate) struct GpuBuffer {
    pub(crate) raw: vk::Buffer,
    memory: vk::DeviceMemory,
    pub(crate) size: u64,
    map: Option<NonNull<u8>>,
}

// SAFETY: the mapping is memory this buffer owns; its bytes are only reached through `&self` /
// `&mut self` methods below, whose callers order them against GPU use with the timeline.
unsafe impl Send for GpuBuffer {}

impl GpuBuffer {
    pub(crate) fn is_mapped(&self) -> bool {
        self.map.is_some()
    }

    /// Writes `bytes` at `offset` of a mapped buffer. The GPU must not be using those bytes.
    pub(crate) fn write(&mut self, offset: usize, bytes: &[u8]) -> Result<(), Error> {
        let map = self.check(offset, bytes.len())?;
        // SAFETY: `check` proved `offset` lies inside the mapping.
        let dst = unsafe { map.as_ptr().add(offset) };
        // SAFETY: `check` proved the range lies inside the mapping, which stays valid while the
        // buffer lives; `&mut self` excludes other host access, and the caller orders it after
        // the GPU's last use of the range.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len()) };
        Ok(())
    }

    /// Reads `out.len()` bytes at `offset` of a mapped buffer. The GPU's writes to them must
    /// have completed.
    pub(crate) fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), Error> {
        out.copy_from_slice(self.bytes(offset, out.len())?);
        Ok(())
    }

    /// The `len` bytes at `offset` of a mapped buffer, in place. The GPU's writes to them must
    /// have completed, and no submission may write them while the borrow lives.
    pub(crate) fn bytes(&self, offset: usize, len: usize) -> Result<&[u8], Error> {
        let map = self.check(offset, len)?;
        // SAFETY: `check` proved `offset` lies inside the mapping.
        let src = unsafe { map.as_ptr().add(offset) };
        // SAFETY: `check` proved the range lies inside the mapping, which stays valid while the
        // buffer (and so the borrow) lives; host writes need `&mut self`, so none happens while
        // the slice is borrowed; the caller waited for the GPU's writes and submits none that
        // write the range while the slice lives (coherent memory needs no invalidation).
        Ok(unsafe { std::slice::from_raw_parts(src, len) })
    }

    fn check(&self, offset: usize, len: usize) -> Result<NonNull<u8>, Error> {
        let map = self.map.ok_or(Error::Unsupported {
            what: "host access to a device-only buffer",
            why: "the buffer is not host-visible".into(),
        })?;
        match offset.checked_add(len) {
            Some(end) if end as u64 <= self.size => Ok(map),
            _ => Err(Error::Limit {
                what: "bytes past the end of a GPU buffer",
            }),
        }
    }
}
