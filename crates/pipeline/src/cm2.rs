//! NVIDIA's cooperative matrices 2 (`VK_NV_cooperative_matrix2`) through wgpu's SPIR-V
//! passthrough: issue 21's probe of whether the driver's own tile staging (workgroup-scope
//! matrices loaded through tensor layouts) beats the WGSL tensor-core GEMM on the encoder's
//! shapes. naga has no such matrices, so the kernels are GLSL compiled to SPIR-V ahead of time
//! (`src/shaders/cm2/build.sh`, sources and hashes beside them) and handed to the driver as
//! they are.
//!
//! One product, `Y[M, N] = X[M, K] * W[N, K]^T` (f16 in, f32 sums and output), in two
//! kernels with the same bindings: [`Kernel::Plain`] (one output per invocation, any Vulkan
//! device; it proves the host side on lavapipe in CI) and [`Kernel::Cm2`] (the extension's
//! workgroup-scope matrices, one module per [`Blocking`]). [`Support::query`] reports what the
//! adapter offers (the extension, its features, properties and flexible dimensions) without
//! opening anything; [`GemmDevice::open`] opens a device with the extension where it is
//! offered. The probe is `examples/cm2_probe.rs`.
//!
//! # Invariants
//! - Passthrough modules are not validated by wgpu: every dispatch's sizes are checked here
//!   against the kernel's contract (each shader states it) before anything is bound.
//! - The Vulkan structures the ash release in use does not define are declared here with
//!   layout asserts.

use std::ffi::{CStr, c_void};
use std::time::{Duration, Instant};

use ash::vk;
use wgpu::util::DeviceExt;

/// The extension's name.
pub const EXTENSION: &CStr = c"VK_NV_cooperative_matrix2";

/// `VkPhysicalDeviceCooperativeMatrix2FeaturesNV` (Vulkan 1.4.303; ash 0.38 predates it).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Features2Raw {
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

const _: () = assert!(size_of::<Features2Raw>() == 48);
const _: () = assert!(std::mem::offset_of!(Features2Raw, workgroup_scope) == 16);
const _: () = assert!(std::mem::offset_of!(Features2Raw, block_loads) == 40);

/// `VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_2_FEATURES_NV`.
const FEATURES_2: vk::StructureType = vk::StructureType::from_raw(1_000_593_000);
/// `VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_FLEXIBLE_DIMENSIONS_PROPERTIES_NV`.
const FLEXIBLE_DIMENSIONS: vk::StructureType = vk::StructureType::from_raw(1_000_593_001);
/// `VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_2_PROPERTIES_NV`.
const PROPERTIES_2: vk::StructureType = vk::StructureType::from_raw(1_000_593_002);

impl Features2Raw {
    fn empty() -> Features2Raw {
        Features2Raw {
            s_type: FEATURES_2,
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
}

/// `VkPhysicalDeviceCooperativeMatrix2PropertiesNV`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Properties2Raw {
    s_type: vk::StructureType,
    p_next: *mut c_void,
    workgroup_scope_max_workgroup_size: u32,
    flexible_dimensions_max_dimension: u32,
    workgroup_scope_reserved_shared_memory: u32,
}

const _: () = assert!(size_of::<Properties2Raw>() == 32);
const _: () =
    assert!(std::mem::offset_of!(Properties2Raw, workgroup_scope_max_workgroup_size) == 16);

/// `VkCooperativeMatrixFlexibleDimensionsPropertiesNV`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct FlexibleRaw {
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

const _: () = assert!(size_of::<FlexibleRaw>() == 56);
const _: () = assert!(std::mem::offset_of!(FlexibleRaw, workgroup_invocations) == 52);

/// `vkGetPhysicalDeviceCooperativeMatrixFlexibleDimensionsPropertiesNV`.
type GetFlexibleDimensions =
    unsafe extern "system" fn(vk::PhysicalDevice, *mut u32, *mut FlexibleRaw) -> vk::Result;

/// The extension's features that these kernels use, as the adapter reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Features {
    pub workgroup_scope: bool,
    pub flexible_dimensions: bool,
    pub tensor_addressing: bool,
    pub reductions: bool,
    pub per_element_operations: bool,
}

/// One matrix shape family the adapter multiplies with flexible dimensions: M, N and K in
/// multiples of their granularity, at `workgroup_invocations` (workgroup scope).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct FlexibleShape {
    pub granularity: (u32, u32, u32),
    /// `VkComponentTypeKHR` of A, B, C and the result (0 f16, 1 f32, ...).
    pub types: (i32, i32, i32, i32),
    /// `VkScopeKHR` (2 workgroup, 3 subgroup).
    pub scope: i32,
    pub workgroup_invocations: u32,
}

/// What an adapter offers of the extension.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Support {
    pub extension: bool,
    pub features: Features,
    pub max_workgroup_size: u32,
    pub max_dimension: u32,
    pub reserved_shared_memory: u32,
    pub flexible: Vec<FlexibleShape>,
}

impl Support {
    /// Reads `adapter`'s support (nothing is opened).
    pub fn query(adapter: &wgpu::Adapter) -> Support {
        // SAFETY: the hal adapter is only borrowed within this function.
        let Some(hal) = (unsafe { adapter.as_hal::<wgpu::hal::api::Vulkan>() }) else {
            return Support::default();
        };
        if !hal
            .physical_device_capabilities()
            .supports_extension(EXTENSION)
        {
            return Support::default();
        }
        let shared = hal.shared_instance();
        let instance = shared.raw_instance();
        let pd = hal.raw_physical_device();
        let mut features = Features2Raw::empty();
        let mut features2 = vk::PhysicalDeviceFeatures2 {
            p_next: (&raw mut features).cast(),
            ..Default::default()
        };
        // SAFETY: the chain is one structure of the extension the device reports, with its
        // sType set and a null pNext; both outlive the call.
        unsafe { instance.get_physical_device_features2(pd, &mut features2) };
        let mut properties = Properties2Raw {
            s_type: PROPERTIES_2,
            p_next: std::ptr::null_mut(),
            workgroup_scope_max_workgroup_size: 0,
            flexible_dimensions_max_dimension: 0,
            workgroup_scope_reserved_shared_memory: 0,
        };
        let mut properties2 = vk::PhysicalDeviceProperties2 {
            p_next: (&raw mut properties).cast(),
            ..Default::default()
        };
        // SAFETY: as above, for the properties structure.
        unsafe { instance.get_physical_device_properties2(pd, &mut properties2) };
        let flexible = flexible_shapes(shared.entry(), instance, pd);
        let on = |b: vk::Bool32| b == vk::TRUE;
        Support {
            extension: true,
            features: Features {
                workgroup_scope: on(features.workgroup_scope),
                flexible_dimensions: on(features.flexible_dimensions),
                tensor_addressing: on(features.tensor_addressing),
                reductions: on(features.reductions),
                per_element_operations: on(features.per_element_operations),
            },
            max_workgroup_size: properties.workgroup_scope_max_workgroup_size,
            max_dimension: properties.flexible_dimensions_max_dimension,
            reserved_shared_memory: properties.workgroup_scope_reserved_shared_memory,
            flexible,
        }
    }

    /// Whether [`Kernel::Cm2`] can run: the extension with workgroup scope, flexible
    /// dimensions and tensor addressing.
    pub fn runs_cm2(&self) -> bool {
        let f = &self.features;
        self.extension && f.workgroup_scope && f.flexible_dimensions && f.tensor_addressing
    }

    /// Whether `b` fits a reported f16 x f16 -> f32 workgroup-scope shape family and the
    /// workgroup-size limit (`None`: no family of that type, so the driver's word is unknown).
    pub fn admits(&self, b: Blocking) -> Option<bool> {
        let family = self
            .flexible
            .iter()
            .filter(|s| s.scope == vk::ScopeKHR::WORKGROUP.as_raw() && s.types == (0, 0, 1, 1))
            .collect::<Vec<_>>();
        if family.is_empty() {
            return None;
        }
        Some(
            b.workgroup <= self.max_workgroup_size
                && family.iter().any(|s| {
                    let (gm, gn, gk) = s.granularity;
                    s.workgroup_invocations == b.workgroup
                        && b.m.is_multiple_of(gm.max(1))
                        && b.n.is_multiple_of(gn.max(1))
                        && b.k.is_multiple_of(gk.max(1))
                }),
        )
    }
}

/// The adapter's flexible-dimension shape families (empty when the entry point is missing).
fn flexible_shapes(
    entry: &ash::Entry,
    instance: &ash::Instance,
    pd: vk::PhysicalDevice,
) -> Vec<FlexibleShape> {
    let name = c"vkGetPhysicalDeviceCooperativeMatrixFlexibleDimensionsPropertiesNV";
    // SAFETY: a lookup by name on a live instance.
    let Some(f) = (unsafe { entry.get_instance_proc_addr(instance.handle(), name.as_ptr()) })
    else {
        return Vec::new();
    };
    // SAFETY: the entry point of that name has this signature (the extension's definition).
    let f: GetFlexibleDimensions = unsafe { std::mem::transmute(f) };
    let mut count = 0u32;
    // SAFETY: a count query with a null array, as the Vulkan two-call idiom allows.
    if unsafe { f(pd, &mut count, std::ptr::null_mut()) } != vk::Result::SUCCESS {
        return Vec::new();
    }
    let blank = FlexibleRaw {
        s_type: FLEXIBLE_DIMENSIONS,
        p_next: std::ptr::null_mut(),
        m_granularity: 0,
        n_granularity: 0,
        k_granularity: 0,
        a_type: vk::ComponentTypeKHR::FLOAT16,
        b_type: vk::ComponentTypeKHR::FLOAT16,
        c_type: vk::ComponentTypeKHR::FLOAT16,
        result_type: vk::ComponentTypeKHR::FLOAT16,
        saturating_accumulation: vk::FALSE,
        scope: vk::ScopeKHR::SUBGROUP,
        workgroup_invocations: 0,
    };
    // A driver's count is trusted only up to a bound.
    let mut raw = vec![blank; count.min(1024) as usize];
    let mut count = raw.len() as u32;
    // SAFETY: `raw` holds `count` initialised structures with their sType set.
    if unsafe { f(pd, &mut count, raw.as_mut_ptr()) } != vk::Result::SUCCESS {
        return Vec::new();
    }
    raw.truncate(count as usize);
    raw.iter()
        .map(|r| FlexibleShape {
            granularity: (r.m_granularity, r.n_granularity, r.k_granularity),
            types: (
                r.a_type.as_raw(),
                r.b_type.as_raw(),
                r.c_type.as_raw(),
                r.result_type.as_raw(),
            ),
            scope: r.scope.as_raw(),
            workgroup_invocations: r.workgroup_invocations,
        })
        .collect()
}

/// A workgroup-scope blocking: `m x n` outputs per workgroup of `workgroup` invocations, K
/// advancing `k` at a time. One SPIR-V module each (`build.sh`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Blocking {
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub workgroup: u32,
}

/// The blockings `build.sh` compiles, with their modules.
const CM2_MODULES: [(Blocking, &[u8]); 3] = [
    (
        Blocking {
            m: 64,
            n: 64,
            k: 64,
            workgroup: 128,
        },
        include_bytes!("shaders/cm2/gemm_cm2_64x64x64_w128.spv"),
    ),
    (
        Blocking {
            m: 128,
            n: 128,
            k: 64,
            workgroup: 256,
        },
        include_bytes!("shaders/cm2/gemm_cm2_128x128x64_w256.spv"),
    ),
    (
        Blocking {
            m: 128,
            n: 256,
            k: 64,
            workgroup: 256,
        },
        include_bytes!("shaders/cm2/gemm_cm2_128x256x64_w256.spv"),
    ),
];

const PLAIN_MODULE: &[u8] = include_bytes!("shaders/cm2/gemm_plain.spv");

/// The GLSL sources and `build.sh`'s record of what each module was built from, for the test
/// that holds them together.
pub const SOURCES: [(&str, &str); 2] = [
    ("gemm_cm2.comp", include_str!("shaders/cm2/gemm_cm2.comp")),
    (
        "gemm_plain.comp",
        include_str!("shaders/cm2/gemm_plain.comp"),
    ),
];
pub const SOURCE_RECORD: &str = include_str!("shaders/cm2/SOURCES.sha256");

/// Which kernel computes the product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Kernel {
    Plain,
    Cm2(Blocking),
}

/// What went wrong.
#[derive(Debug, thiserror::Error)]
pub enum Cm2Error {
    #[error("{0}")]
    Device(String),
    #[error("kernel {kernel:?} does not take M {m}, N {n}, K {k}: {why}")]
    Shape {
        kernel: Kernel,
        m: u32,
        n: u32,
        k: u32,
        why: String,
    },
    #[error(
        "{kernel:?} is not on this device (VK_NV_cooperative_matrix2 with workgroup scope, flexible dimensions and tensor addressing is needed)"
    )]
    Unavailable { kernel: Kernel },
    #[error("a SPIR-V module is not whole 32-bit words with SPIR-V's magic number")]
    BadModule,
}

/// A device with the probe's pipelines.
pub struct GemmDevice {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub support: Support,
    layout: wgpu::BindGroupLayout,
    plain: wgpu::ComputePipeline,
    cm2: Vec<(Blocking, wgpu::ComputePipeline)>,
}

impl std::fmt::Debug for GemmDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GemmDevice")
            .field("support", &self.support)
            .field("cm2", &self.cm2.iter().map(|(b, _)| b).collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// A product's result and time.
#[derive(Clone, Debug)]
pub struct GemmRun {
    pub y: Vec<f32>,
    /// Median time per dispatch over the timed submissions.
    pub per_dispatch: Duration,
}

fn words(bytes: &[u8]) -> Result<Vec<u32>, Cm2Error> {
    if !bytes.len().is_multiple_of(4) || bytes.len() < 20 {
        return Err(Cm2Error::BadModule);
    }
    let w: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    if w[0] != 0x0723_0203 {
        return Err(Cm2Error::BadModule);
    }
    Ok(w)
}

impl GemmDevice {
    /// Opens a device on `adapter` with SPIR-V passthrough and f16 shaders, and, where the
    /// adapter offers what [`Support::runs_cm2`] needs, the extension with those features and
    /// wgpu's cooperative matrices (which enable the KHR matrices and the Vulkan memory model
    /// the modules declare); then makes the plain pipeline and one per blocking.
    ///
    /// # Errors
    /// [`Cm2Error::Device`] when the adapter lacks passthrough or f16 shaders, or a device or
    /// pipeline cannot be made.
    pub fn open(adapter: &wgpu::Adapter) -> Result<GemmDevice, Cm2Error> {
        let support = Support::query(adapter);
        let needed = wgpu::Features::PASSTHROUGH_SHADERS | wgpu::Features::SHADER_F16;
        if !adapter.features().contains(needed) {
            return Err(Cm2Error::Device(format!(
                "{} lacks {:?}",
                adapter.get_info().name,
                needed - adapter.features()
            )));
        }
        let cm2 = support.runs_cm2()
            && adapter
                .features()
                .contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX);
        let mut desc = wgpu::DeviceDescriptor {
            label: Some("cm2 probe"),
            required_features: needed,
            required_limits: adapter.limits(),
            ..Default::default()
        };
        if cm2 {
            desc.required_features |= wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
            // SAFETY: the token acknowledges wgpu's experimental features; the one used is the
            // KHR cooperative matrices the modules build on, checked against the CPU here.
            desc.experimental_features = unsafe { wgpu::ExperimentalFeatures::enabled() };
        }
        // SAFETY: the hal adapter is only borrowed until the device is wrapped below.
        let hal = unsafe { adapter.as_hal::<wgpu::hal::api::Vulkan>() }.ok_or_else(|| {
            Cm2Error::Device("the adapter is not on wgpu's Vulkan backend".into())
        })?;
        // The extension's features, chained into the device's create info; boxed so that the
        // structure outlives the callback that links it (the device is created after it
        // returns, inside `open_with_callback`, while the box is alive).
        let mut features = Box::new(Features2Raw {
            workgroup_scope: vk::TRUE,
            flexible_dimensions: vk::TRUE,
            tensor_addressing: vk::TRUE,
            ..Features2Raw::empty()
        });
        let chained: *mut Features2Raw = &raw mut *features;
        let callback = Box::new(
            move |args: wgpu::hal::vulkan::CreateDeviceCallbackArgs<'_, '_, '_>| {
                if !cm2 {
                    return;
                }
                args.extensions.push(EXTENSION);
                // SAFETY: `chained` points at the boxed structure, alive until after the
                // device is created; it is linked at the head of the chain the driver reads.
                unsafe {
                    (*chained).p_next = args.create_info.p_next.cast_mut();
                }
                args.create_info.p_next = chained.cast_const().cast();
            },
        );
        // SAFETY: the callback adds an extension the adapter reports and that extension's
        // features structure; features, limits and hints are the descriptor's.
        let open = unsafe {
            hal.open_with_callback(
                desc.required_features,
                &desc.required_limits,
                &desc.memory_hints,
                Some(callback),
            )
        }
        .map_err(|e| Cm2Error::Device(format!("opening the device: {e}")))?;
        drop(hal);
        // SAFETY: `open` was made from this adapter's hal adapter just above.
        let (device, queue) = unsafe { adapter.create_device_from_hal(open, &desc) }
            .map_err(|e| Cm2Error::Device(format!("wrapping the device: {e}")))?;
        drop(features);
        let storage = |binding, read_only| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage { read_only },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        };
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("cm2 gemm"),
            entries: &[
                storage(0, true),
                storage(1, true),
                storage(2, false),
                wgpu::BindGroupLayoutEntry {
                    binding: 3,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Uniform,
                        has_dynamic_offset: false,
                        min_binding_size: None,
                    },
                    count: None,
                },
            ],
        });
        let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some("cm2 gemm"),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        let pipeline = |name: &str, bytes: &[u8], size: (u32, u32, u32)| {
            let spirv = words(bytes)?;
            let entry = [wgpu::PassthroughShaderEntryPoint {
                name: "main".into(),
                workgroup_size: size,
            }];
            // SAFETY: the module is one of this crate's, built by build.sh and checked by
            // spirv-val there; its bindings are `layout`'s, and every dispatch is checked
            // against its contract before it is recorded (`run`).
            let module = unsafe {
                device.create_shader_module_passthrough(wgpu::ShaderModuleDescriptorPassthrough {
                    label: Some(name),
                    entry_points: entry[..].into(),
                    spirv: Some(spirv.into()),
                    ..Default::default()
                })
            };
            Ok::<_, Cm2Error>(
                device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(name),
                    layout: Some(&pipeline_layout),
                    module: &module,
                    entry_point: Some("main"),
                    compilation_options: Default::default(),
                    cache: None,
                }),
            )
        };
        let plain = pipeline("gemm_plain", PLAIN_MODULE, (16, 16, 1))?;
        let mut cm2_pipelines = Vec::new();
        if cm2 {
            for (b, bytes) in CM2_MODULES {
                cm2_pipelines.push((b, pipeline("gemm_cm2", bytes, (b.workgroup, 1, 1))?));
            }
        }
        Ok(GemmDevice {
            device,
            queue,
            support,
            layout,
            plain,
            cm2: cm2_pipelines,
        })
    }

    /// The kernels this device runs.
    pub fn kernels(&self) -> Vec<Kernel> {
        std::iter::once(Kernel::Plain)
            .chain(self.cm2.iter().map(|(b, _)| Kernel::Cm2(*b)))
            .collect()
    }

    /// `Y = X W^T` for `x` (`m x k`, row-major f16 bits) and `w` (`n x k`), run once, then
    /// `reps` dispatches per submission over `rounds` timed submissions.
    ///
    /// # Errors
    /// [`Cm2Error::Shape`] for sizes outside the kernel's contract or the device's limits,
    /// [`Cm2Error::Unavailable`] for a kernel the device has no pipeline for.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        kernel: Kernel,
        x: &[u16],
        w: &[u16],
        (m, n, k): (u32, u32, u32),
        reps: u32,
        rounds: u32,
    ) -> Result<GemmRun, Cm2Error> {
        let bad = |why: String| Cm2Error::Shape {
            kernel,
            m,
            n,
            k,
            why,
        };
        let (mu, nu, ku) = (m as usize, n as usize, k as usize);
        if m == 0 || n == 0 || k == 0 || x.len() != mu * ku || w.len() != nu * ku {
            return Err(bad(format!(
                "x holds {} and w {} values for {m}x{k} and {n}x{k}",
                x.len(),
                w.len()
            )));
        }
        let limit = self.device.limits().max_storage_buffer_binding_size;
        let out_bytes = (mu * nu * 4) as u64;
        if out_bytes > limit || (mu.max(nu) * ku * 2) as u64 > limit {
            return Err(bad(format!(
                "a buffer over the binding limit of {limit} bytes"
            )));
        }
        let (pipeline, groups) = match kernel {
            Kernel::Plain => (&self.plain, (n.div_ceil(16), m.div_ceil(16))),
            Kernel::Cm2(b) => {
                let p = self
                    .cm2
                    .iter()
                    .find(|(have, _)| *have == b)
                    .map(|(_, p)| p)
                    .ok_or(Cm2Error::Unavailable { kernel })?;
                if m % b.m != 0 || n % b.n != 0 || k % b.k != 0 {
                    return Err(bad(format!(
                        "the blocking {}x{}x{} must divide M, N and K",
                        b.m, b.n, b.k
                    )));
                }
                (p, (n / b.n, m / b.m))
            }
        };
        let max = self.device.limits().max_compute_workgroups_per_dimension;
        if groups.0 > max || groups.1 > max {
            return Err(bad(format!("more than {max} workgroups along a dimension")));
        }
        let d = &self.device;
        let upload = |label, data: &[u16]| {
            d.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents: bytemuck::cast_slice(data),
                usage: wgpu::BufferUsages::STORAGE,
            })
        };
        let xb = upload("x", x);
        let wb = upload("w", w);
        let yb = d.create_buffer(&wgpu::BufferDescriptor {
            label: Some("y"),
            size: out_bytes,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let shape = d.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("shape"),
            contents: bytemuck::cast_slice(&[m, n, k, 0u32]),
            usage: wgpu::BufferUsages::UNIFORM,
        });
        let bind = d.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("cm2 gemm"),
            layout: &self.layout,
            entries: &[
                wgpu::BindGroupEntry {
                    binding: 0,
                    resource: xb.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 1,
                    resource: wb.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 2,
                    resource: yb.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 3,
                    resource: shape.as_entire_binding(),
                },
            ],
        });
        let submit = |times: u32| -> Result<Duration, Cm2Error> {
            let mut encoder = d.create_command_encoder(&Default::default());
            {
                let mut pass = encoder.begin_compute_pass(&Default::default());
                pass.set_pipeline(pipeline);
                pass.set_bind_group(0, &bind, &[]);
                for _ in 0..times {
                    pass.dispatch_workgroups(groups.0, groups.1, 1);
                }
            }
            let start = Instant::now();
            self.queue.submit([encoder.finish()]);
            d.poll(wgpu::PollType::wait_indefinitely())
                .map_err(|e| Cm2Error::Device(format!("waiting for the GEMM: {e}")))?;
            Ok(start.elapsed())
        };
        submit(1)?;
        let mut times = Vec::new();
        for _ in 0..rounds {
            times.push(submit(reps.max(1))? / reps.max(1));
        }
        times.sort();
        let per_dispatch = times.get(times.len() / 2).copied().unwrap_or_default();
        let read = d.create_buffer(&wgpu::BufferDescriptor {
            label: Some("y read"),
            size: out_bytes,
            usage: wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::MAP_READ,
            mapped_at_creation: false,
        });
        let mut encoder = d.create_command_encoder(&Default::default());
        encoder.copy_buffer_to_buffer(&yb, 0, &read, 0, out_bytes);
        self.queue.submit([encoder.finish()]);
        read.slice(..).map_async(wgpu::MapMode::Read, |_| {});
        d.poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| Cm2Error::Device(format!("reading the GEMM back: {e}")))?;
        let view = read
            .slice(..)
            .get_mapped_range()
            .map_err(|e| Cm2Error::Device(format!("mapping the GEMM's output: {e}")))?;
        let y = bytemuck::cast_slice(&view).to_vec();
        Ok(GemmRun { y, per_dispatch })
    }
}

/// The largest error of `y` against an f64 reference of `x w^T` over `samples` evenly spread
/// outputs, relative to the largest |reference| among them.
pub fn sampled_error(
    x: &[u16],
    w: &[u16],
    y: &[f32],
    (m, n, k): (usize, usize, usize),
    samples: usize,
) -> f64 {
    let f = |h: u16| f64::from(half::f16::from_bits(h).to_f32());
    let total = m * n;
    let step = (total / samples.max(1)).max(1);
    let (mut worst, mut scale) = (0f64, 0f64);
    for i in (0..total).step_by(step) {
        let (r, c) = (i / n, i % n);
        let want: f64 = (0..k).map(|j| f(x[r * k + j]) * f(w[c * k + j])).sum();
        worst = worst.max((f64::from(y[i]) - want).abs());
        scale = scale.max(want.abs());
    }
    worst / scale.max(f64::MIN_POSITIVE)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each committed module was built from the GLSL as it stands: `build.sh` recorded each
    /// source's SHA-256, and editing a source without rebuilding fails here.
    #[test]
    fn cm2_spirv_is_built_from_its_sources() {
        use sha2::Digest;
        let mut checked = 0;
        for line in SOURCE_RECORD.lines() {
            let mut parts = line.split_whitespace();
            let (hash, name, source) = (parts.next(), parts.next(), parts.next());
            let (Some(hash), Some(name), Some(source)) = (hash, name, source) else {
                panic!("SOURCES.sha256 line {line:?}");
            };
            let text = SOURCES
                .iter()
                .find(|(s, _)| *s == source)
                .map(|(_, t)| t)
                .unwrap_or_else(|| panic!("{name} names an unknown source {source}"));
            let got: String = sha2::Sha256::digest(text.as_bytes())
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            assert_eq!(
                got, hash,
                "{source} changed since {name}.spv was built: run build.sh"
            );
            checked += 1;
        }
        assert_eq!(checked, 1 + CM2_MODULES.len());
        for (_, bytes) in CM2_MODULES {
            assert!(words(bytes).is_ok());
        }
        assert!(words(PLAIN_MODULE).is_ok());
        assert!(matches!(words(&[1, 2, 3]), Err(Cm2Error::BadModule)));
    }
}
