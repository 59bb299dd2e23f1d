//! Just in time, on a live stream: a stage upstream of a slow one produces its next item only
//! when that item will still be the newest when the slow stage takes it.
//!
//! A live ring keeps the newest item and drops older ones, so a slow decoder describes a fresh
//! frame. Left alone, the stages before it would still process every frame the source makes
//! and throw most of the results away: on a 2-core machine whose GPU is the CPU (lavapipe),
//! that work starves the decoder, and on a device it burns power. Instead, each consumer says
//! when it expects to take its next item ([`Demand::taking_at`]); while its producer's output
//! ring already holds an item ready, the producer sleeps until its own latency before that
//! moment ([`Demand::wait_until_due`]), then takes the newest input and produces. The consumer
//! wakes a sleeping producer early by signalling the demand's timeline whenever it takes an
//! item or changes its estimate.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sync_timeline::{CpuTimeline, Timeline};

/// Headroom before the consumer's expected take, on top of the producer's latency.
const MARGIN: Duration = Duration::from_millis(1);

/// Weight of the newest sample in a stage's latency estimate.
const EMA_WEIGHT: f64 = 0.25;

/// One ring's consumer's expected next take, shared with its producer.
#[derive(Debug)]
pub(crate) struct Demand {
    origin: Instant,
    /// Nanoseconds after `origin` when the consumer expects to take its next item; 0 when it
    /// wants one now.
    taking_at_ns: AtomicU64,
    /// Signalled whenever the consumer takes an item or moves its estimate.
    changed: CpuTimeline,
}

impl Demand {
    pub(crate) fn new(origin: Instant) -> Demand {
        Demand {
            origin,
            taking_at_ns: AtomicU64::new(0),
            changed: CpuTimeline::new(0),
        }
    }

    /// The consumer expects to take its next item at `at` (`None`: now).
    pub(crate) fn taking_at(&self, at: Option<Instant>) {
        let ns = at.map_or(0, |at| {
            u64::try_from(at.saturating_duration_since(self.origin).as_nanos())
                .unwrap_or(u64::MAX)
                .max(1)
        });
        self.taking_at_ns.store(ns, Ordering::SeqCst);
        let _ = self
            .changed
            .signal(self.changed.current().saturating_add(1));
    }

    /// When the consumer expects to take its next item, if not now.
    pub(crate) fn due(&self) -> Option<Instant> {
        match self.taking_at_ns.load(Ordering::SeqCst) {
            0 => None,
            ns => Some(self.origin + Duration::from_nanos(ns)),
        }
    }

    /// Returns once the producer should produce its next item, `false` if `stopped()` says
    /// the run ends:
    /// - when the consumer wants an item now and none is waiting (`ready_waiting()`);
    /// - `lead` before the consumer's expected take, once per expected take (`served`
    ///   remembers the last one produced for), so a consumer running late does not make the
    ///   producer produce over and over.
    ///
    /// Otherwise it sleeps until one of these or until the consumer moves its estimate. A wait
    /// for demand (backpressure), not for the GPU. `upstream` hears when this producer will
    /// take its own next input (the consumer's take less `lead`; `None` for now) each time that
    /// moves, so the stage before it can produce in time too.
    pub(crate) fn wait_until_due(
        &self,
        lead: Duration,
        served: &mut Option<Instant>,
        ready_waiting: impl Fn() -> bool,
        stopped: impl Fn() -> bool,
        upstream: Option<&Demand>,
    ) -> bool {
        let mut told = None;
        loop {
            if stopped() {
                return false;
            }
            let seen = self.changed.current();
            let now = Instant::now();
            if let Some(up) = upstream {
                let take = self.due().and_then(|due| due.checked_sub(lead + MARGIN));
                if told != Some(take) {
                    up.taking_at(take);
                    told = Some(take);
                }
            }
            let left = match self.due() {
                None if !ready_waiting() => return true,
                // The consumer is about to take the item waiting.
                None => Duration::from_millis(50),
                Some(due) if *served == Some(due) => Duration::from_millis(50),
                Some(due) => match due.checked_sub(lead + MARGIN).filter(|&w| w > now) {
                    None => {
                        *served = Some(due);
                        return true;
                    }
                    Some(wake) => (wake - now).min(Duration::from_millis(50)),
                },
            };
            // Woken early when the consumer takes its item or moves its estimate.
            let _ = self.changed.wait(seen + 1, left);
        }
    }
}

/// A stage's latency estimate (an exponential moving average).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Latency(Option<f64>);

impl Latency {
    pub(crate) fn add(&mut self, sample: Duration) {
        let s = sample.as_secs_f64();
        self.0 = Some(match self.0 {
            Some(v) => v + EMA_WEIGHT * (s - v),
            None => s,
        });
    }

    pub(crate) fn get(&self) -> Duration {
        Duration::from_secs_f64(self.0.unwrap_or(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_producer_sleeps_until_its_latency_before_the_take_and_wakes_when_the_consumer_takes() {
        let origin = Instant::now();
        let demand = Demand::new(origin);
        let mut served = None;
        let never = || false;
        // The consumer wants an item and none is waiting: produce now.
        assert!(demand.wait_until_due(Duration::ZERO, &mut served, || false, never, None));
        // The consumer takes its next item in 60 ms: a producer with a 10 ms latency sleeps
        // until about 49 ms before, then produces once for that take.
        let take = Instant::now() + Duration::from_millis(60);
        demand.taking_at(Some(take));
        assert!(demand.wait_until_due(
            Duration::from_millis(10),
            &mut served,
            || true,
            never,
            None
        ));
        assert!(Instant::now() + Duration::from_millis(11) >= take);
        assert_eq!(served, Some(take));
        // Once served, it waits for the consumer: here the consumer takes its item and wants
        // the next one at once, which wakes the producer.
        let d = &demand;
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                d.taking_at(None);
            });
            let waiting = std::sync::atomic::AtomicBool::new(true);
            let start = Instant::now();
            let ready = || waiting.swap(false, std::sync::atomic::Ordering::SeqCst);
            assert!(d.wait_until_due(Duration::ZERO, &mut served, ready, never, None));
            assert!(start.elapsed() >= Duration::from_millis(15));
        });
        assert!(!demand.wait_until_due(Duration::ZERO, &mut served, || true, || true, None));
    }
}
