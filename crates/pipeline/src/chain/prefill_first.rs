//! Prefill first: the encoder leaves the cores to the decoder's prefill.
//!
//! Where the encoder and the decoder share the CPU's cores (a CPU encoder, or a GPU encoder
//! on a software driver such as lavapipe), encoding frame N+1 while the decoder prefills frame
//! N slows that prefill, and the prefill is the reply's time to first token. With a lossless
//! ring the collision is the rule, not bad luck: the decoder releases frame N-1's slot when
//! its reply ends, which is when the encoder can start on the next frame, and it takes frame N
//! at the same moment.
//!
//! [`PrefillGate`] closes when a reply ends (before its slot is released) and opens at the
//! next reply's first token, or as soon as the decoder has to wait for an image (the encoder
//! is then what it waits for). The encoder waits for it to be open before it starts encoding,
//! so it encodes during the decode phase, which is bound by memory bandwidth rather than by
//! the cores. Work already under way is never interrupted.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sync_timeline::{CpuTimeline, Timeline};

/// Whether the decoder is between replies or prefilling (closed), shared with the encoder.
#[derive(Debug)]
pub(crate) struct PrefillGate {
    closed: AtomicBool,
    /// Signalled on every change, so a waiting encoder wakes at once.
    changed: CpuTimeline,
}

impl PrefillGate {
    /// An open gate.
    pub(crate) fn new() -> PrefillGate {
        PrefillGate {
            closed: AtomicBool::new(false),
            changed: CpuTimeline::new(0),
        }
    }

    pub(crate) fn open(&self) {
        self.set_closed(false);
    }

    pub(crate) fn close(&self) {
        self.set_closed(true);
    }

    fn set_closed(&self, closed: bool) {
        if self.closed.swap(closed, Ordering::SeqCst) != closed {
            let _ = self
                .changed
                .signal(self.changed.current().saturating_add(1));
        }
    }

    /// Returns once the gate is open (`true`), or `false` as soon as `stopped()` says the run
    /// ends. A wait for the decoder, not for a device.
    pub(crate) fn wait_open(&self, stopped: impl Fn() -> bool) -> bool {
        loop {
            let seen = self.changed.current();
            if !self.closed.load(Ordering::SeqCst) {
                return true;
            }
            if stopped() {
                return false;
            }
            // Woken by the change; the timeout only bounds how late a stop is seen.
            let _ = self.changed.wait(seen + 1, Duration::from_millis(50));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_closed_gate_holds_the_encoder_until_it_opens_or_the_run_stops() {
        let gate = PrefillGate::new();
        assert!(gate.wait_open(|| false), "a new gate is open");
        gate.close();
        assert!(!gate.wait_open(|| true), "a stop ends the wait");
        std::thread::scope(|s| {
            let start = Instant::now();
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                gate.open();
            });
            assert!(gate.wait_open(|| false));
            assert!(start.elapsed() >= Duration::from_millis(15));
        });
    }
}
