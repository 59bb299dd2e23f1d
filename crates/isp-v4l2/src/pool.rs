//! Frame buffers that go round: a source fills the same few unified buffers again and again,
//! so a GPU stage imports each one once (`uvm_alloc::vulkan::ImportCache`, feature `wgpu`) instead of once
//! per frame.
//!
//! A buffer is refilled only when nobody can still be reading it. Two things say so, and a
//! [`Lease`] carries both:
//! - every clone of a delivered [`crate::Frame`] holds the lease, so the buffer is busy while
//!   any stage holds the frame;
//! - a stage that hands the frame's memory to device work and lets the frame go before that
//!   work is known to be done calls [`Lease::release_after`] with the timeline value that says
//!   so; the buffer stays busy until the timeline gets there. Nobody blocks to find out: the
//!   source checks the value when it next needs a buffer, and waits on it only when every
//!   buffer is busy (backpressure).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sync_timeline::Timeline;
use uvm_alloc::{Allocator, UnifiedBuffer};

use crate::Error;

/// How many buffers a file or pattern source cycles through by default: the frames ring, the
/// ISP's frame in flight and a few held by device work, with room to spare.
pub const DEFAULT_POOL_FRAMES: usize = 8;

/// How long a source waits for a busy buffer before calling the chain stalled.
pub const POOL_TIMEOUT: Duration = Duration::from_secs(30);

/// The device work still reading a buffer: done once `timeline` reaches `value`.
struct PendingRead {
    timeline: Arc<dyn Timeline>,
    value: u64,
}

/// A frame's claim on its buffer (see the module notes). Clones share one claim.
#[derive(Clone, Default)]
pub struct Lease(Arc<Mutex<Option<PendingRead>>>);

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("holders", &(Arc::strong_count(&self.0) - 1))
            .finish_non_exhaustive()
    }
}

impl Lease {
    /// A lease nobody holds yet (its owner, the pool or the camera's slot, keeps this one).
    pub fn new() -> Lease {
        Lease::default()
    }

    /// Keeps the buffer busy until `timeline` reaches `value`: device work submitted on it
    /// that no thread waits for. A later call replaces an earlier one (work on one queue
    /// completes in order, so the later value covers the earlier).
    pub fn release_after(&self, timeline: Arc<dyn Timeline>, value: u64) {
        if let Ok(mut pending) = self.0.lock() {
            *pending = Some(PendingRead { timeline, value });
        }
    }

    /// Whether clones other than this one exist (frames still hold the buffer).
    pub fn is_held(&self) -> bool {
        Arc::strong_count(&self.0) > 1
    }

    /// Whether the buffer may be refilled now: no frame holds it and the device work
    /// registered on it has finished. Never blocks.
    pub fn is_free(&self) -> bool {
        !self.is_held() && self.device_done(Duration::ZERO).unwrap_or(false)
    }

    /// Waits up to `timeout` for the registered device work; `Ok(true)` once it is done.
    fn device_done(&self, timeout: Duration) -> Result<bool, Error> {
        let Ok(mut pending) = self.0.lock() else {
            return Ok(false);
        };
        let Some(p) = pending.as_ref() else {
            return Ok(true);
        };
        let done = if timeout.is_zero() {
            p.timeline.value().map_err(Error::Timeline)? >= p.value
        } else {
            match p.timeline.wait(p.value, timeout) {
                Ok(()) => true,
                Err(sync_timeline::Error::Timeout { .. }) => false,
                Err(e) => return Err(Error::Timeline(e)),
            }
        };
        if done {
            *pending = None;
        }
        Ok(done)
    }
}

/// The buffers one source fills in turn.
#[derive(Debug)]
pub(crate) struct FramePool {
    allocator: Allocator,
    bytes: usize,
    capacity: usize,
    slots: Vec<(Arc<UnifiedBuffer>, Lease)>,
    /// Where the search for a free slot starts: the slot after the last one handed out, so
    /// buffers go round in order.
    next: usize,
}

impl FramePool {
    /// Up to `capacity` buffers of `bytes` each from `allocator`, allocated as first needed.
    pub(crate) fn new(allocator: Allocator, bytes: usize, capacity: usize) -> FramePool {
        FramePool {
            allocator,
            bytes,
            capacity: capacity.max(1),
            slots: Vec::new(),
            next: 0,
        }
    }

    /// A buffer to fill and its lease: the next free one, a new one while the pool is below
    /// its capacity, or else the oldest busy one once it frees up (backpressure: the chain
    /// holds every buffer).
    pub(crate) fn take(&mut self) -> Result<(Arc<UnifiedBuffer>, Lease), Error> {
        let n = self.slots.len();
        if let Some(i) = (0..n)
            .map(|k| (self.next + k) % n)
            .find(|&i| self.slots[i].1.is_free())
        {
            return Ok(self.hand_out(i));
        }
        if n < self.capacity {
            let buffer = Arc::new(self.allocator.allocate(self.bytes).map_err(Error::Memory)?);
            self.slots.push((buffer, Lease::new()));
            return Ok(self.hand_out(n));
        }
        // Every buffer is busy: wait for the one handed out longest ago.
        let i = self.next % n;
        let deadline = Instant::now() + POOL_TIMEOUT;
        let lease = &self.slots[i].1;
        while lease.is_held() {
            if Instant::now() >= deadline {
                return Err(Error::Io {
                    what: "taking a frame buffer".into(),
                    error: format!(
                        "all {n} frame buffers stayed held by frames for {POOL_TIMEOUT:?}: a \
                         consumer keeps frames it should let go"
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if !lease.device_done(left)? {
            return Err(Error::Io {
                what: "taking a frame buffer".into(),
                error: format!("device work reading it did not finish within {POOL_TIMEOUT:?}"),
            });
        }
        Ok(self.hand_out(i))
    }

    fn hand_out(&mut self, i: usize) -> (Arc<UnifiedBuffer>, Lease) {
        self.next = i + 1;
        let (buffer, lease) = &self.slots[i];
        (Arc::clone(buffer), lease.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sync_timeline::CpuTimeline;
    use uvm_alloc::{AllocatorDesc, BackendKind};

    fn pool(capacity: usize) -> FramePool {
        let allocator = Allocator::new(AllocatorDesc {
            backends: vec![BackendKind::Host],
            ..AllocatorDesc::default()
        })
        .unwrap();
        FramePool::new(allocator, 4096, capacity)
    }

    #[test]
    fn buffers_are_reused_once_their_frames_and_device_work_are_done() {
        let mut p = pool(2);
        let (a, lease_a) = p.take().unwrap();
        let (b, lease_b) = p.take().unwrap();
        assert!(!Arc::ptr_eq(&a, &b));
        // `a`'s frame is gone but device work still reads it until value 1.
        let gpu = Arc::new(CpuTimeline::new(0));
        lease_a.release_after(gpu.clone(), 1);
        drop(lease_a);
        drop(lease_b);
        // `b` is free now, `a` is not: the pool hands out `b` again.
        let (b2, lease_b2) = p.take().unwrap();
        assert!(Arc::ptr_eq(&b, &b2));
        // Both busy: the pool waits for the oldest, `a`, whose work the "GPU" finishes.
        let signaller = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            gpu.signal(1).unwrap();
        });
        let (a2, _lease) = p.take().unwrap();
        signaller.join().unwrap();
        assert!(Arc::ptr_eq(&a, &a2));
        drop(lease_b2);
    }

    #[test]
    fn a_pool_below_capacity_grows_instead_of_waiting() {
        let mut p = pool(3);
        let held: Vec<_> = (0..3).map(|_| p.take().unwrap()).collect();
        assert_eq!(p.slots.len(), 3);
        drop(held);
        let again = p.take().unwrap();
        assert_eq!(p.slots.len(), 3);
        drop(again);
    }
}
