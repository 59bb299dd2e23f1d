//! Bridges: one signal, several engines' timelines.
//!
//! A [`Fanout`] is a timeline whose signal moves a primary timeline and every mirror to the same
//! value, in order, from the signalling thread itself. A CPU stage that signals
//! `Fanout { primary: CpuTimeline, mirrors: [VulkanTimeline] }` releases both its CPU waiters
//! and a GPU submission already queued on the Vulkan value, with no thread parked in between.
//! The other direction needs no bridge: a CPU stage waits on a Vulkan (or syncobj) timeline
//! directly, since every backend implements [`Timeline::wait`].

use std::sync::Arc;
use std::time::Duration;

use crate::{Backend, Error, Timeline};

/// A timeline whose signals are repeated on mirrors; waits and values use the primary.
#[derive(Debug)]
pub struct Fanout {
    pub primary: Arc<dyn Timeline>,
    pub mirrors: Vec<Arc<dyn Timeline>>,
}

impl Timeline for Fanout {
    fn value(&self) -> Result<u64, Error> {
        self.primary.value()
    }

    /// Signals the mirrors first and the primary last, so a waiter released by the primary
    /// finds every mirror already at the value.
    fn signal(&self, value: u64) -> Result<(), Error> {
        for m in &self.mirrors {
            m.signal(value)?;
        }
        self.primary.signal(value)
    }

    fn wait(&self, value: u64, timeout: Duration) -> Result<(), Error> {
        self.primary.wait(value, timeout)
    }

    fn backend(&self) -> Backend<'_> {
        self.primary.backend()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuTimeline;

    #[test]
    fn signals_reach_every_mirror_and_backwards_is_refused() {
        let primary = Arc::new(CpuTimeline::new(0));
        let mirror = Arc::new(CpuTimeline::new(0));
        let f = Fanout {
            primary: primary.clone(),
            mirrors: vec![mirror.clone()],
        };
        f.signal(3).unwrap();
        assert_eq!((primary.current(), mirror.current()), (3, 3));
        assert_eq!(
            f.signal(2),
            Err(Error::Backwards {
                current: 3,
                requested: 2
            })
        );
        f.wait(3, Duration::ZERO).unwrap();
    }
}
