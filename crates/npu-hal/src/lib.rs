//! The accelerator abstraction for transformer decoding: devices, buffers (uvm-alloc), fences
//! (sync-timeline) and submission of op sequences, with a CPU reference NPU that every machine
//! can run.
//!
//! The trait family, the op set and the backends arrive with issue #6; until then this crate
//! exports only [`sys`], the generated DRM core UAPI used to identify `/dev/accel/accel*` devices.
//!
//! # Design
//! - Backends implement a small trait family with an object-safe mirror, so the pipeline holds
//!   `Box<dyn ...>` without generics leaking upward (the wgpu-hal `Api` / `dynamic` split).
//! - The CPU reference NPU keeps a persistent worker pool sized to the cores and dispatches SIMD
//!   kernels at run time; it is always compiled, so every test runs everywhere.
//! - Accel devices are opened and asked `DRM_IOCTL_VERSION`; a driver without an execution backend
//!   here is reported as present and unsupported, never as working.
//!
//! # Unsafe
//! Only [`sys`] (generated bindings) and, with issue #6, the thin ioctl wrappers beside it.

#![deny(unsafe_code)]

pub mod sys;
