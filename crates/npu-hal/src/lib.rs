//! The accelerator abstraction for transformer decoding: devices, buffers (uvm-alloc), fences
//! (sync-timeline) and submission of op programs, with a CPU reference NPU that every machine can
//! run, a GPU backend on Vulkan (feature `vulkan`) and honest discovery of Linux accel devices.
//!
//! # Design
//! - A model is compiled once into a straight-line list of [`Op`]s (embedding, RMSNorm, MX or
//!   dense linear, RoPE, SwiGLU, residual add, paged attention over kv-paged) over device tensors
//!   and weights; each [`Submission`] replays it over a [`Batch`] of tokens, after waiting for a
//!   timeline value and before signalling one. Record once, replay per step: the shape NPU
//!   runtimes want, and no per-token graph building on the CPU.
//! - [`Device`] is object-safe, so the pipeline holds `Box<dyn Device>` and chooses the backend at
//!   run time; [`Backend`] is the discovery half of the family (`probe`, `open`).
//! - Activation tensors live in [`uvm_alloc::UnifiedBuffer`]s, one per tensor, so another engine
//!   (a GPU encoder writing image embeddings, an accel device) can import them without a copy.
//! - The CPU reference NPU ([`CpuNpu`]) keeps a persistent, spinning worker pool sized to the
//!   cores ([`pool::WorkerPool`]) and runs mx-quant's runtime-dispatched SIMD kernels; it is always
//!   compiled, so every test runs everywhere.
//! - The GPU backend ([`VulkanNpu`], feature `vulkan`) records a program once per batch shape and
//!   replays it, with kernels written in WGSL and compiled by naga at run time, weights in their
//!   own format and the KV pages in device memory; row-wise ops fold into the kernels next to
//!   them where the program's data flow allows. It never falls back to the CPU.
//! - Accel devices (`/dev/accel/accel*`) are opened and asked `DRM_IOCTL_VERSION`; a driver
//!   without an execution backend here is reported as present and unsupported, never as working
//!   ([`accel`]). [`EmptyDevice`] is the device that accepts nothing, for wiring tests.
//! - [`sampling`] turns logits into tokens (greedy, temperature, top-k, top-p, repetition penalty,
//!   seeded), in llama.cpp's order.
//!
//! # Unsafe
//! - [`sys`]: generated bindings, and the `DRM_IOCTL_VERSION` wrapper beside them.
//! - [`accel`]: the one call of that wrapper, with buffers it owns.
//! - [`pool`]: erasing the lifetime of the job closure that `WorkerPool::run` broadcasts, sound
//!   because `run` does not return before every worker is done with it.
//! - [`kernels`]: calling the AVX2+FMA build of the dense GEMM after detecting those features.
//! - [`attention`]: calling the FMA build of the f16 flash-attention kernel after detecting FMA.
//! - [`ggml`]: SIMD loads and stores in the block dot products, and calling the AVX2 / AVX-512
//!   VNNI builds after detecting those features.
//! - `vulkan` (feature): every Vulkan call (handles it owns, queue access under a mutex, command
//!   buffers resubmitted only once their last run completed, nothing destroyed before the queue
//!   is idle), and host access to mapped memory through bounds-checked `GpuBuffer` methods.

pub mod accel;
pub mod attention;
mod cpu;
mod device;
pub mod ggml;
pub mod kernels;
pub mod pool;
pub mod sampling;
pub mod sys;
#[cfg(feature = "vulkan")]
mod vulkan;

pub use cpu::{CpuBackend, CpuConfig, CpuNpu};
pub use device::{
    Backend, Batch, Device, DeviceInfo, DeviceKind, DeviceStats, EmbeddingData, Embeddings, Held,
    KernelTime, Op, Probe, Rows, Submission, TensorId, Weight, WeightId,
};
pub use kernels::{ActivationRounding, DenseMatrix, GgmlBuild, Numerics, RopeStyle};
#[cfg(feature = "vulkan")]
pub use vulkan::{AdapterChoice, HostWait, VulkanBackend, VulkanConfig, VulkanNpu};

/// The README's example, compiled and run as a doctest so it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExample;

/// Why a device operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An op of a submitted program does not fit what it names or the batch.
    #[error("op {op} of the program is invalid: {what}")]
    BadOp { op: usize, what: String },
    /// A count or size past what the device can index.
    #[error("too many {what} for one device")]
    Limit { what: &'static str },
    /// The device cannot do this at all.
    #[error("{what} is not supported by this device: {why}")]
    Unsupported { what: &'static str, why: String },
    #[error("MX kernel: {0}")]
    Mx(#[from] mx_quant::Error),
    #[error("KV cache: {0}")]
    Kv(#[from] kv_paged::Error),
    #[error("unified memory: {0}")]
    Memory(#[from] uvm_alloc::Error),
    #[error("timeline: {0}")]
    Timeline(#[from] sync_timeline::Error),
    #[error("could not start the CPU worker pool: {0}")]
    Threads(std::io::Error),
    /// A Vulkan call failed.
    #[cfg(feature = "vulkan")]
    #[error("{call} failed: {result}")]
    Vulkan {
        call: &'static str,
        result: ash::vk::Result,
    },
    /// A GPU kernel did not compile (a bug in the kernel source or the compiler, not in input).
    #[cfg(feature = "vulkan")]
    #[error("GPU kernel compilation failed: {message}")]
    Shader { message: String },
}

/// A device that accepts nothing: every call fails with [`Error::Unsupported`]. It lets wiring be
/// tested without an engine and stands in for an accel device that has no backend yet.
#[derive(Debug, Default)]
pub struct EmptyDevice {
    /// What the device would have been (shown in its errors).
    pub name: String,
}

impl EmptyDevice {
    fn refuse<T>(&self, what: &'static str) -> Result<T, Error> {
        Err(Error::Unsupported {
            what,
            why: format!("{} has no execution backend", self.name_or_default()),
        })
    }

    fn name_or_default(&self) -> &str {
        if self.name.is_empty() {
            "the empty device"
        } else {
            &self.name
        }
    }
}

impl Device for EmptyDevice {
    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            kind: DeviceKind::Empty,
            name: self.name_or_default().to_string(),
            parallelism: 0,
            isa: "none".into(),
        }
    }
    fn load_weight(&mut self, _: Weight) -> Result<WeightId, Error> {
        self.refuse("loading weights")
    }
    fn weight_shape(&self, _: WeightId) -> Option<(usize, usize)> {
        None
    }
    fn weight_bytes(&self) -> usize {
        0
    }
    fn create_tensor(&mut self, _: usize, _: usize) -> Result<TensorId, Error> {
        self.refuse("creating tensors")
    }
    fn tensor_shape(&self, _: TensorId) -> Option<(usize, usize)> {
        None
    }
    fn submit(&mut self, _: Submission<'_>) -> Result<(), Error> {
        self.refuse("running ops")
    }
    fn read_tensor(
        &self,
        _: TensorId,
        _: std::ops::Range<usize>,
        _: &mut [f32],
    ) -> Result<(), Error> {
        self.refuse("reading tensors")
    }
    fn write_tensor(
        &mut self,
        _: TensorId,
        _: std::ops::Range<usize>,
        _: &[f32],
    ) -> Result<(), Error> {
        self.refuse("writing tensors")
    }
}

/// Linux accel devices as a backend: discovery works, execution does not exist yet.
#[derive(Clone, Copy, Debug, Default)]
pub struct AccelBackend;

impl Backend for AccelBackend {
    fn name(&self) -> &'static str {
        "accel"
    }

    fn probe(&self) -> Vec<Probe> {
        accel::discover()
            .into_iter()
            .map(|d| match d.state {
                accel::AccelState::Identified {
                    driver,
                    version,
                    description,
                    family,
                    unsupported,
                } => Probe {
                    backend: "accel",
                    name: format!(
                        "{}: {driver} {}.{}.{} ({}){}",
                        d.path.display(),
                        version.0,
                        version.1,
                        version.2,
                        description,
                        family.map(|f| format!(", {f}")).unwrap_or_default()
                    ),
                    usable: Err(unsupported),
                },
                accel::AccelState::Unreachable { error } => Probe {
                    backend: "accel",
                    name: d.path.display().to_string(),
                    usable: Err(error),
                },
            })
            .collect()
    }

    fn open(&self) -> Result<Box<dyn Device>, Error> {
        let found = accel::discover();
        Err(Error::Unsupported {
            what: "running ops on an accel device",
            why: if found.is_empty() {
                "no /dev/accel/accel* node on this machine".into()
            } else {
                format!(
                    "{} accel node(s) found, but no driver has an execution backend yet",
                    found.len()
                )
            },
        })
    }
}
