//! Timelines instead of locks: one contract, a `u64` that only grows, over a CPU timeline, Vulkan
//! timeline semaphores and DRM syncobj timelines, so pipeline stages hand work to each other the
//! way hardware queues do.
//!
//! The timeline trait, its backends and the bridges between them arrive with issue #4; until then
//! this crate exports only [`sys`], the generated kernel UAPI (sync_file, DRM syncobj) it will call.
//!
//! # Design
//! - The contract: values only grow; `wait(v)` returns once the timeline reaches or passes `v`; a
//!   signal that would go backwards is an error; every wait has a timeout.
//! - CPU timeline: an atomic `u64` and a futex (rustix), with a bounded spin before parking so a
//!   hot waiter hands off in well under a microsecond and an idle one costs no CPU.
//! - Vulkan: timeline semaphores (ash), host and device side. DRM: syncobj timelines on a render
//!   node with sync_file export/import. A Vulkan timeline cannot be exported as a sync_file, so
//!   that bridge goes through a syncobj transfer or a binary semaphore.
//!
//! # Invariants
//! - A worker blocks only in a timeline wait, never on a mutex or condition variable.
//!
//! # Unsafe
//! Only [`sys`] (generated bindings) and, with issue #4, the thin ioctl wrappers beside it.

#![deny(unsafe_code)]

pub mod sys;
