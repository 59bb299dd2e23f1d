//! VK_NV_cooperative_matrix2 for the encoder's GEMM ([`super::CoopGemmSource::Coopmat2`]):
//! opening a wgpu device with the extension and the features `gemm_cm2.comp` uses, and what the
//! driver offers. wgpu does not know the extension: the device is opened through wgpu-hal's
//! creation callback, and the kernel runs through SPIR-V passthrough.
//!
//! ash 0.38 (Vulkan 1.3.281) predates the extension, so its two structures are declared here
//! from the Vulkan headers (1.4.x), with their layouts asserted.

use std::ffi::{CStr, c_void};

use ash::vk;

/// The extension's name.
pub const EXTENSION: &CStr = c"VK_NV_cooperative_matrix2";

/// `VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_2_FEATURES_NV`.
const FEATURES_TYPE: vk::StructureType = vk::StructureType::from_raw(1_000_593_000);
/// `VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_FLEXIBLE_DIMENSIONS_PROPERTIES_NV`.
const FLEXIBLE_TYPE: vk::StructureType = vk::StructureType::from_raw(1_000_593_001);

/// `VkPhysicalDeviceCooperativeMatrix2FeaturesNV`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Features {
    s_type: vk::StructureType,
    p_next: *mut c_void,
    workgroup_scope: vk::Bool32,
    flexible_dimensions: vk::Bool32,
    reductions: vk::Bool32,
    conversions: vk::Bool32,
    per_element_operations: vk::Bool32,
    tensor_addressing: vk::Bool32,
    block_loads: vk::Bool32,
}

const _: () = {
    assert!(std::mem::size_of::<Features>() == 48);
    assert!(std::mem::offset_of!(Features, workgroup_scope) == 16);
    assert!(std::mem::offset_of!(Features, block_loads) == 40);
};

impl Features {
    fn empty() -> Features {
        Features {
            s_type: FEATURES_TYPE,
            p_next: std::ptr::null_mut(),
            workgroup_scope: vk::FALSE,
            flexible_dimensions: vk::FALSE,
            reductions: vk::FALSE,
            conversions: vk::FALSE,
            per_element_operations: vk::FALSE,
            tensor_addressing: vk::FALSE,
            block_loads: vk::FALSE,
        }
    }

    /// What `gemm_cm2.comp` needs: workgroup-scope matrices of any multiple of the granularity,
    /// per-element operations (the epilogue) and tensor addressing (clamped loads and stores).
    fn needed() -> Features {
        Features {
            workgroup_scope: vk::TRUE,
            flexible_dimensions: vk::TRUE,
            per_element_operations: vk::TRUE,
            tensor_addressing: vk::TRUE,
            ..Features::empty()
        }
    }

    fn covers(&self, needed: &Features) -> bool {
        let pairs = [
            (self.workgroup_scope, needed.workgroup_scope),
            (self.flexible_dimensions, needed.flexible_dimensions),
            (self.per_element_operations, needed.per_element_operations),
            (self.tensor_addressing, needed.tensor_addressing),
        ];
        pairs
            .iter()
            .all(|&(have, want)| have == vk::TRUE || want == vk::FALSE)
    }
}

/// `VkCooperativeMatrixFlexibleDimensionsPropertiesNV`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct FlexibleDimensions {
    s_type: vk::StructureType,
    p_next: *mut c_void,
    m_granularity: u32,
    n_granularity: u32,
    k_granularity: u32,
    a_type: vk::ComponentTypeKHR,
    b_type: vk::ComponentTypeKHR,
    c_type: vk::ComponentTypeKHR,
    result_type: vk::ComponentTypeKHR,
    saturating_accumulation: vk::Bool32,
    scope: vk::ScopeKHR,
    workgroup_invocations: u32,
}

const _: () = {
    assert!(std::mem::size_of::<FlexibleDimensions>() == 56);
    assert!(std::mem::offset_of!(FlexibleDimensions, m_granularity) == 16);
    assert!(std::mem::offset_of!(FlexibleDimensions, workgroup_invocations) == 52);
};

/// `vkGetPhysicalDeviceCooperativeMatrixFlexibleDimensionsPropertiesNV`.
type GetFlexibleDimensions =
    unsafe extern "system" fn(vk::PhysicalDevice, *mut u32, *mut FlexibleDimensions) -> vk::Result;

/// The most workgroup-scope shapes [`Offered`] keeps.
const MAX_SHAPES: usize = 8;

/// Workgroup-scope f16 x f16 -> f32 shapes the driver offers: `(M, N, K granularity,
/// invocations per workgroup)`, the first [`MAX_SHAPES`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Offered {
    shapes: [(u32, u32, u32, u32); MAX_SHAPES],
    count: usize,
}

impl Offered {
    /// The offered shapes.
    pub fn shapes(&self) -> &[(u32, u32, u32, u32)] {
        &self.shapes[..self.count]
    }

    /// Whether a kernel with `rows x cols` blocks, k steps of `k`, and `threads` invocations
    /// runs: some offered shape has that workgroup size and granularities dividing the block.
    pub fn fits(&self, rows: u32, cols: u32, k: u32, threads: u32) -> bool {
        self.shapes().iter().any(|&(gm, gn, gk, invocations)| {
            invocations == threads
                && gm > 0
                && gn > 0
                && gk > 0
                && rows.is_multiple_of(gm)
                && cols.is_multiple_of(gn)
                && k.is_multiple_of(gk)
        })
    }
}

/// The adapter's instance and physical device (wgpu's Vulkan backend), or why not.
fn hal_adapter(
    adapter: &wgpu::Adapter,
) -> Result<impl std::ops::Deref<Target = wgpu::hal::vulkan::Adapter> + '_, String> {
    // SAFETY: the hal adapter is only borrowed while the caller uses it.
    unsafe { adapter.as_hal::<wgpu::hal::api::Vulkan>() }
        .ok_or_else(|| "the adapter does not run on wgpu's Vulkan backend".to_string())
}

/// Whether `adapter` offers the extension and the features the GEMM needs, and the
/// workgroup-scope f16 shapes it offers.
///
/// # Errors
/// What is missing.
pub fn offered(adapter: &wgpu::Adapter) -> Result<Offered, String> {
    let hal = hal_adapter(adapter)?;
    if !hal
        .physical_device_capabilities()
        .supports_extension(EXTENSION)
    {
        return Err(format!(
            "{} does not offer {EXTENSION:?}",
            adapter.get_info().name
        ));
    }
    let shared = hal.shared_instance();
    let instance = shared.raw_instance();
    let physical = hal.raw_physical_device();
    let mut features = Features::empty();
    let mut features2 = vk::PhysicalDeviceFeatures2::default();
    features2.p_next = (&raw mut features).cast();
    // SAFETY: `features2` chains one structure of the layout the extension defines (asserted
    // above) with a null p_next; both outlive the call, and the extension is offered.
    unsafe { instance.get_physical_device_features2(physical, &mut features2) };
    if !features.covers(&Features::needed()) {
        return Err(format!(
            "{EXTENSION:?} lacks a feature the GEMM needs (workgroup scope, flexible dimensions, \
             per-element operations, tensor addressing): {features:?}"
        ));
    }
    let name = c"vkGetPhysicalDeviceCooperativeMatrixFlexibleDimensionsPropertiesNV";
    // SAFETY: a query of an instance-level entry point by its name.
    let entry = unsafe {
        (shared.entry().static_fn().get_instance_proc_addr)(instance.handle(), name.as_ptr())
    }
    .ok_or_else(|| format!("the driver has no {name:?}"))?;
    // SAFETY: the entry point the name denotes has this signature (Vulkan headers).
    let get: GetFlexibleDimensions = unsafe { std::mem::transmute(entry) };
    let blank = FlexibleDimensions {
        s_type: FLEXIBLE_TYPE,
        p_next: std::ptr::null_mut(),
        m_granularity: 0,
        n_granularity: 0,
        k_granularity: 0,
        a_type: vk::ComponentTypeKHR::FLOAT16,
        b_type: vk::ComponentTypeKHR::FLOAT16,
        c_type: vk::ComponentTypeKHR::FLOAT32,
        result_type: vk::ComponentTypeKHR::FLOAT32,
        saturating_accumulation: vk::FALSE,
        scope: vk::ScopeKHR::WORKGROUP,
        workgroup_invocations: 0,
    };
    let mut count = 0u32;
    // SAFETY: the count query of a two-call enumeration.
    let r = unsafe { get(physical, &mut count, std::ptr::null_mut()) };
    if r != vk::Result::SUCCESS {
        return Err(format!("counting the flexible dimensions: {r:?}"));
    }
    if count > 4096 {
        return Err(format!("the driver reports {count} flexible dimensions"));
    }
    let mut all = vec![blank; count as usize];
    // SAFETY: `all` holds `count` initialised structures with their sType set.
    let r = unsafe { get(physical, &mut count, all.as_mut_ptr()) };
    if r != vk::Result::SUCCESS && r != vk::Result::INCOMPLETE {
        return Err(format!("reading the flexible dimensions: {r:?}"));
    }
    all.truncate(count as usize);
    let mut offered = Offered::default();
    let shapes = all
        .iter()
        .filter(|p| {
            p.scope == vk::ScopeKHR::WORKGROUP
                && p.a_type == vk::ComponentTypeKHR::FLOAT16
                && p.b_type == vk::ComponentTypeKHR::FLOAT16
                && p.c_type == vk::ComponentTypeKHR::FLOAT32
                && p.result_type == vk::ComponentTypeKHR::FLOAT32
                && p.saturating_accumulation == vk::FALSE
        })
        .map(|p| {
            (
                p.m_granularity,
                p.n_granularity,
                p.k_granularity,
                p.workgroup_invocations,
            )
        });
    for shape in shapes.take(MAX_SHAPES) {
        offered.shapes[offered.count] = shape;
        offered.count += 1;
    }
    Ok(offered)
}

/// Proof that a device was opened by [`open_device`], so with the extension's features the
/// GEMM needs: the only way to ask for [`super::CoopGemmSource::Coopmat2`], which the encoder
/// takes only on the device this names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Coopmat2Device {
    raw: u64,
    /// What the driver offers ([`offered`]).
    pub offered: Offered,
}

impl Coopmat2Device {
    /// Whether this names `device` (and the device has the extension enabled).
    pub(super) fn is(self, device: &wgpu::Device) -> bool {
        raw_handle(device) == Some(self.raw) && enabled(device)
    }
}

/// The Vulkan handle of `device`, on wgpu's Vulkan backend.
fn raw_handle(device: &wgpu::Device) -> Option<u64> {
    use ash::vk::Handle;
    // SAFETY: the hal device is only borrowed to read its handle.
    unsafe { device.as_hal::<wgpu::hal::api::Vulkan>() }
        .map(|hal| hal.raw_device().handle().as_raw())
}

/// Opens `adapter`'s device as `desc` asks, with VK_NV_cooperative_matrix2 and the features
/// the GEMM needs enabled as well, where the adapter offers them ([`offered`]).
///
/// # Errors
/// What the adapter lacks, or where the device cannot be opened.
pub fn open_device(
    adapter: &wgpu::Adapter,
    desc: &wgpu::DeviceDescriptor<'_>,
) -> Result<(wgpu::Device, wgpu::Queue, Coopmat2Device), String> {
    let offered = offered(adapter)?;
    let hal = hal_adapter(adapter)?;
    let mut features = Features::needed();
    let chained: *mut Features = &raw mut features;
    let callback = Box::new(
        move |args: wgpu::hal::vulkan::CreateDeviceCallbackArgs<'_, '_, '_>| {
            if !args.extensions.contains(&EXTENSION) {
                args.extensions.push(EXTENSION);
            }
            // wgpu chains its own feature structures in front of whatever p_next holds when
            // it creates the device, so this one stays at the end of the chain.
            // SAFETY: `features` outlives the device creation (open_with_callback returns
            // after it) and its p_next is null, so it ends the chain.
            unsafe { (*chained).p_next = args.create_info.p_next.cast_mut() };
            args.create_info.p_next = chained.cast_const().cast();
        },
    );
    // SAFETY: the callback adds an extension the adapter offers and features it supports
    // (`offered` checked both) and turns none off.
    let open = unsafe {
        hal.open_with_callback(
            desc.required_features,
            &desc.required_limits,
            &desc.memory_hints,
            Some(callback),
        )
    }
    .map_err(|e| format!("opening the device with {EXTENSION:?}: {e}"))?;
    drop(hal);
    // SAFETY: `open` was created from this adapter's hal adapter just above.
    let (device, queue) = unsafe { adapter.create_device_from_hal(open, desc) }
        .map_err(|e| format!("wrapping the device: {e}"))?;
    let raw = raw_handle(&device).ok_or("the device is not on wgpu's Vulkan backend")?;
    Ok((device, queue, Coopmat2Device { raw, offered }))
}

/// Whether `device` has the extension enabled.
fn enabled(device: &wgpu::Device) -> bool {
    // SAFETY: the hal device is only borrowed for the check.
    unsafe { device.as_hal::<wgpu::hal::api::Vulkan>() }
        .is_some_and(|hal| hal.enabled_device_extensions().contains(&EXTENSION))
}
