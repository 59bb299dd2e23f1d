//! Unified buffers: memory that the CPU, the GPU, the ISP and the NPU all map, so that a frame or
//! a tensor moves between engines without being copied.
//!
//! # What is here
//! - [`UnifiedBuffer`] over real backends: DMA-BUF heaps (`/dev/dma_heap/*`), udmabuf (a sealed
//!   memfd turned into a dma-buf by `/dev/udmabuf`), GBM buffer objects on a render node
//!   (feature `gbm`), memfd (shareable host memory) and anonymous host memory.
//! - [`Allocator`]: takes the first backend that works and remembers why the others refused.
//! - Scoped CPU access ([`UnifiedBuffer::cpu_access`]): `DMA_BUF_IOCTL_SYNC` START on creation and
//!   END on drop for dma-bufs, nothing for host memory; writers exclusive; typed views through
//!   bytemuck.
//! - The copy ledger ([`CopyLedger`]): every copy any stage makes is counted, per stage.
//! - `vulkan` (features `vulkan`/`wgpu`): import into Vulkan (dma-buf fd or host pointer) and
//!   into wgpu over the same memory.
//!
//! # Invariants
//! - Sizes are rounded up to the page and the cache line (64 or 128 B), overflow-checked; size 0
//!   is an error. Mappings start page aligned.
//! - Callers never see a raw fd they must close: `OwnedFd` inside, `BorrowedFd` out.
//! - A backend whose device is absent answers [`Error::Unavailable`] naming it; nothing is faked.
//!
//! # Features
//! - `gbm`: GBM buffer objects. Needs libgbm at build time (Debian/Ubuntu: `libgbm-dev`).
//! - `vulkan`: import through ash (the Vulkan loader is opened at run time).
//! - `wgpu`: import into wgpu buffers (implies `vulkan`).
//!
//! # Unsafe
//! In [`sys`] (one thin function per ioctl), in the mapping code (`mmap`/`munmap`), in the CPU
//! access guard (slices over the mapping, made exclusive by an atomic state word) and in the
//! Vulkan import. Each block says why it is sound.

#![deny(unsafe_code)]

#[allow(unsafe_code)]
mod alloc;
#[allow(unsafe_code)]
mod buffer;
mod ledger;
#[allow(unsafe_code)]
pub mod sys;
#[cfg(feature = "vulkan")]
#[allow(unsafe_code)]
pub mod vulkan;

/// The README's example, compiled and run as a doctest so it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExample;

pub use alloc::{Allocator, AllocatorDesc, rounded_size};
pub use buffer::{Access, Backend, BackendKind, CpuAccess, Refusal, UnifiedBuffer};
pub use ledger::{CopyLedger, LedgerReport, StageCopies, StageReport};

/// Why an allocation, access or import failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Size 0 was asked for.
    #[error("a unified buffer cannot be empty: ask for at least one byte")]
    ZeroSize,
    /// Rounding the size up to the page and cache line overflowed.
    #[error("size {size} overflows when rounded up to the page and cache line")]
    TooLarge { size: usize },
    /// The cache line setting is not 64 or 128.
    #[error("cache line must be 64 or 128 bytes, not {cache_line}")]
    BadCacheLine { cache_line: usize },
    /// A backend's device or facility is absent or refused.
    #[error("{backend} unavailable: {why}")]
    Unavailable { backend: BackendKind, why: String },
    /// Every backend refused.
    #[error("no backend could allocate: {}", refusals.iter().map(|r| r.to_string()).collect::<Vec<_>>().join("; "))]
    NoBackend { refusals: Vec<Refusal> },
    /// A system call failed.
    #[error("{call} failed: {errno}")]
    Os {
        call: &'static str,
        errno: rustix::io::Errno,
    },
    /// A range reaches past the buffer.
    #[error("range {start}..{end} is outside the buffer of {len} bytes")]
    OutOfBounds {
        start: usize,
        end: usize,
        len: usize,
    },
    /// Another CPU access conflicts (a writer excludes everyone).
    #[error("CPU access conflicts with one already held by {held}")]
    AccessConflict { held: String },
    /// Writing through a read guard.
    #[error("this CPU access was begun for reading; begin it with Access::Write or ReadWrite")]
    ReadOnlyAccess,
    /// A typed view does not fit the range's alignment or length.
    #[error("typed view does not fit: {reason}")]
    BadView { reason: String },
    /// A ledger copy between slices of different lengths.
    #[error("copy between slices of {src} and {dst} elements")]
    CopyLength { dst: usize, src: usize },
    /// A Vulkan call failed or the device lacks what an import needs.
    #[error("Vulkan: {0}")]
    Vulkan(String),
}
