//! Unified buffers: memory that the CPU, the GPU, the ISP and the NPU all map, so that a frame or
//! a tensor moves between engines without being copied.
//!
//! The buffer allocator, its backends and the copy ledger arrive with issue #4; until then this
//! crate exports only [`sys`], the generated kernel UAPI it will call.
//!
//! # Design
//! - Backends, best first: DMA-BUF heaps (`/dev/dma_heap/*`), udmabuf (a sealed memfd turned into
//!   a dma-buf by `/dev/udmabuf`), GBM buffer objects on a DRM render node (feature `gbm`, which
//!   links libgbm), memfd (shareable host memory), aligned host memory. The allocator takes the
//!   first that works and, when it falls back, says which it tried and why each refused.
//! - CPU access to a dma-buf is scoped: a guard issues `DMA_BUF_IOCTL_SYNC` START on creation and
//!   END on drop, so caches are coherent exactly while the CPU holds the guard.
//! - Every copy any stage makes is reported to a copy ledger, so "0 bytes copied" is measured.
//!
//! # Invariants
//! - Sizes are rounded up to the page and to the cache line, with overflow checked; size 0 is an
//!   error, never an empty mapping.
//! - Callers never see a raw fd: `OwnedFd` out, `BorrowedFd`/`impl AsFd` in.
//!
//! # Features
//! - `gbm`: GBM buffer objects. Needs libgbm at build time (Debian/Ubuntu: `libgbm-dev`).
//!
//! # Unsafe
//! Only [`sys`] (generated bindings, no unsafe code today) and, with issue #4, one thin
//! `unsafe fn` per ioctl beside it. Everything above is safe code over typed handles.

#![deny(unsafe_code)]

pub mod sys;
