//! Timelines instead of locks: one contract, a `u64` that only grows, over a CPU timeline, Vulkan
//! timeline semaphores and DRM syncobj timelines, so pipeline stages hand work to each other the
//! way hardware queues do.
//!
//! # The contract ([`Timeline`])
//! - Values only grow. A signal to a smaller value is [`Error::Backwards`]; a signal to the
//!   current value is a no-op.
//! - `wait(v, timeout)` returns once the timeline reaches or passes `v`, or fails with
//!   [`Error::Timeout`] carrying the value it did reach. Every wait has a timeout.
//! - [`wait_all`] and [`wait_any`] wait across timelines, of any backend mix.
//!
//! # Backends
//! - [`CpuTimeline`]: an atomic `u64` plus a futex (rustix), with a bounded, adaptive spin
//!   before parking ([`SpinPolicy`]); a hot handoff costs a cache-line transfer, an idle waiter
//!   costs nothing.
//! - `vulkan::VulkanTimeline` (feature `vulkan`): a Vulkan timeline semaphore (ash), signalled
//!   and waited on by the host, and by queue submissions on the device.
//! - `drm::SyncobjTimeline` (feature `drm`): a DRM syncobj timeline on a render node through
//!   the drm crate, with sync_file export/import of a point. A Vulkan timeline cannot be
//!   exported as a sync_file; where one is needed, transfer the point into a syncobj.
//!
//! # Bridges and rings
//! A CPU stage waits on a GPU value by waiting on the Vulkan timeline itself (the host wait is
//! the driver's); a GPU submission waits on a CPU stage by waiting on a Vulkan timeline value
//! that the CPU stage signals from the host when it finishes (timeline semaphores allow the wait
//! to be submitted before the signal): [`bridge::Fanout`] makes one signal reach both. No thread
//! sits in between. [`ring`] hands items (and the buffers they live in) from one stage worker
//! to the next over two CPU timelines, lossless or latest-wins, with slots that device work
//! holds until its own timeline value; workers block only in timeline waits.
//!
//! # Invariants
//! - A timeline's value never decreases; every wait has a timeout.
//!
//! # Unsafe
//! The Vulkan backend calls ash (every Vulkan call is `unsafe`: each says which handle validity
//! makes it sound); the DRM backend makes one raw ioctl the drm crate lacks; [`ring`] shares its
//! slots between two threads through `UnsafeCell`s, each access ordered by its timelines or its
//! slot states. Everything else is safe code over rustix and the drm crate; [`sys`] holds the
//! generated sync_file/syncobj UAPI.

#![deny(unsafe_code)]

pub mod bridge;
mod cpu;
#[cfg(feature = "drm")]
pub mod drm;
#[allow(unsafe_code)]
pub mod ring;
pub mod sys;
#[cfg(feature = "vulkan")]
#[allow(unsafe_code)]
pub mod vulkan;

use std::time::{Duration, Instant};

pub use cpu::{CpuTimeline, SpinPolicy};

/// The README's example, compiled and run as a doctest so it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExample;

/// Why a timeline operation failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A signal asked for a value below the current one.
    #[error(
        "signal would move the timeline backwards: it is at {current}, the signal asked for {requested}"
    )]
    Backwards { current: u64, requested: u64 },
    /// The wait's timeout passed before the timeline reached the value.
    #[error(
        "timed out after {timeout:?} waiting for value {wanted}; the timeline reached {reached}"
    )]
    Timeout {
        wanted: u64,
        reached: u64,
        timeout: Duration,
    },
    /// A system call failed.
    #[error("{call} failed: {errno}")]
    Os {
        call: &'static str,
        errno: rustix::io::Errno,
    },
    /// A Vulkan call failed.
    #[error("{call} failed: {result}")]
    Vulkan {
        call: &'static str,
        result: VkResult,
    },
    /// The operation needs something this machine or device lacks.
    #[error("unsupported: {what}: {why}")]
    Unsupported { what: &'static str, why: String },
    /// A list argument was empty or too long.
    #[error("{what}")]
    BadArgument { what: &'static str },
}

/// A Vulkan result code as a plain number (`VkResult`), so [`Error`] does not depend on ash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VkResult(pub i32);

impl std::fmt::Display for VkResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "VkResult {}", self.0)
    }
}

/// What a timeline is underneath, for operations that can do better than the generic path
/// (one `futex_waitv` over several CPU timelines, say).
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub enum Backend<'a> {
    Cpu(&'a CpuTimeline),
    #[cfg(feature = "vulkan")]
    Vulkan(&'a vulkan::VulkanTimeline),
    /// A backend this crate does not know (implemented elsewhere).
    Other,
}

/// A monotonically increasing `u64`, signalled and waited on. Object-safe, so stages hold
/// `Arc<dyn Timeline>` without caring which engine signals it.
pub trait Timeline: Send + Sync + std::fmt::Debug {
    /// The current value.
    fn value(&self) -> Result<u64, Error>;
    /// Moves the timeline to `value` (no-op if already there; [`Error::Backwards`] if past it).
    fn signal(&self, value: u64) -> Result<(), Error>;
    /// Returns once the timeline reaches or passes `value`, or [`Error::Timeout`].
    fn wait(&self, value: u64, timeout: Duration) -> Result<(), Error>;
    /// The backend underneath.
    fn backend(&self) -> Backend<'_> {
        Backend::Other
    }
}

/// Waits until every `(timeline, value)` is reached, within one shared `timeout`.
pub fn wait_all(points: &[(&dyn Timeline, u64)], timeout: Duration) -> Result<(), Error> {
    let start = Instant::now();
    // Values only grow, so waiting on each in turn is waiting on all of them.
    for (timeline, value) in points {
        let left = timeout.saturating_sub(start.elapsed());
        timeline.wait(*value, left).map_err(|e| match e {
            Error::Timeout {
                wanted, reached, ..
            } => Error::Timeout {
                wanted,
                reached,
                timeout,
            },
            other => other,
        })?;
    }
    Ok(())
}

/// Waits until any `(timeline, value)` is reached; returns the index of one that was.
///
/// CPU timelines are waited on with one `futex_waitv` (Linux 5.16+); other mixes are polled with
/// a backoff that starts at 1 us and is capped at 1 ms, so the answer can be that late.
pub fn wait_any(points: &[(&dyn Timeline, u64)], timeout: Duration) -> Result<usize, Error> {
    if points.is_empty() {
        return Err(Error::BadArgument {
            what: "wait_any needs at least one timeline",
        });
    }
    let start = Instant::now();
    let cpu: Option<Vec<&CpuTimeline>> = points
        .iter()
        .map(|(t, _)| match t.backend() {
            Backend::Cpu(c) => Some(c),
            _ => None,
        })
        .collect();
    let mut backoff = Duration::from_micros(1);
    loop {
        for (i, (t, v)) in points.iter().enumerate() {
            if t.value()? >= *v {
                return Ok(i);
            }
        }
        let elapsed = start.elapsed();
        if elapsed >= timeout {
            let (t, v) = points[0];
            return Err(Error::Timeout {
                wanted: v,
                reached: t.value()?,
                timeout,
            });
        }
        let left = timeout - elapsed;
        match &cpu {
            Some(cpu) if cpu.len() <= 128 => cpu::wait_any_epochs(cpu, points, left)?,
            _ => {
                std::thread::sleep(backoff.min(left));
                backoff = (backoff * 2).min(Duration::from_millis(1));
            }
        }
    }
}
