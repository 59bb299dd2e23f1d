//! The CPU timeline: an atomic `u64` and a futex, with a bounded spin before parking.
//!
//! # How a handoff works
//! A signal stores the new value, bumps a 32-bit `epoch` (the futex word) and, only if some
//! thread is parked, wakes them with one `FUTEX_WAKE`. A waiter first checks the value, then
//! spins (per its [`SpinPolicy`]) re-reading it, then registers as a sleeper, re-checks, and
//! sleeps on the epoch it last saw. Every step is `SeqCst`, so either the signaller sees the
//! sleeper and wakes it, or the sleeper sees the new value (or the new epoch, and the futex call
//! returns at once): no wakeup is lost.
//!
//! # The spin budget
//! Spinning turns a handoff to a hot waiter into a cache-line transfer (well under a microsecond)
//! instead of a syscall and a reschedule (several microseconds), at the price of burning the
//! waiting core for the budget. [`SpinPolicy::Adaptive`] spins up to its budget only while the
//! last wait was released within that budget, and parks at once after a wait that took longer,
//! so a stage that idles for long stretches parks at once and costs no CPU.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

use rustix::thread::futex;

use crate::{Backend, Error, Timeline};

/// How long a waiter spins before it parks in the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpinPolicy {
    /// Park at once: no CPU burnt, every handoff pays a futex wake-up.
    Never,
    /// Spin up to this long on every wait.
    Fixed(Duration),
    /// Spin up to this long while spinning pays off: after a wait that parked and was released
    /// later than this budget, the next wait parks at once; after any wait released within the
    /// budget (spinning or parked), the next one spins again.
    Adaptive(Duration),
}

impl Default for SpinPolicy {
    /// Adaptive, 20 microseconds: on the order of a futex wake-up (25 us one way on the CI VM,
    /// 3.1 us in the futex measurement issue #4 quotes; `cargo bench -p benches --bench
    /// bench_main -- sync_` prints it), so a handoff that is about to happen is caught spinning,
    /// and short enough that a wrong guess costs little.
    fn default() -> SpinPolicy {
        SpinPolicy::Adaptive(Duration::from_micros(20))
    }
}

/// A timeline in process memory: any thread signals, any thread waits.
#[derive(Debug)]
pub struct CpuTimeline {
    value: AtomicU64,
    /// The futex word: bumped after every value change.
    epoch: AtomicU32,
    /// Threads parked or about to park on `epoch`; zero means a signal makes no syscall.
    sleepers: AtomicU32,
    spin: SpinPolicy,
    /// For [`SpinPolicy::Adaptive`]: whether the last wait was satisfied without parking.
    spin_paid_off: std::sync::atomic::AtomicBool,
}

impl CpuTimeline {
    /// A timeline at `initial`, with the default spin policy.
    pub fn new(initial: u64) -> CpuTimeline {
        CpuTimeline::with_spin(initial, SpinPolicy::default())
    }

    /// A timeline at `initial` whose waiters spin per `spin`.
    pub fn with_spin(initial: u64, spin: SpinPolicy) -> CpuTimeline {
        CpuTimeline {
            value: AtomicU64::new(initial),
            epoch: AtomicU32::new(0),
            sleepers: AtomicU32::new(0),
            spin,
            spin_paid_off: std::sync::atomic::AtomicBool::new(true),
        }
    }

    /// The current value (never fails; the trait's [`Timeline::value`] wraps it).
    pub fn current(&self) -> u64 {
        self.value.load(SeqCst)
    }

    fn spin_budget(&self) -> Option<Duration> {
        match self.spin {
            SpinPolicy::Never => None,
            SpinPolicy::Fixed(d) => Some(d),
            SpinPolicy::Adaptive(d) => self.spin_paid_off.load(SeqCst).then_some(d),
        }
    }

    /// Spins until the value reaches `value` or the budget runs out; true if it was reached.
    fn spin_until(&self, value: u64, budget: Duration, deadline: Instant) -> bool {
        let stop = (Instant::now() + budget).min(deadline);
        loop {
            // Check the clock only every few dozen iterations: reading it costs more than a load.
            for _ in 0..64 {
                if self.value.load(SeqCst) >= value {
                    return true;
                }
                std::hint::spin_loop();
            }
            if Instant::now() >= stop {
                return false;
            }
        }
    }
}

impl Timeline for CpuTimeline {
    fn value(&self) -> Result<u64, Error> {
        Ok(self.current())
    }

    fn signal(&self, value: u64) -> Result<(), Error> {
        let mut current = self.value.load(SeqCst);
        loop {
            if value < current {
                return Err(Error::Backwards {
                    current,
                    requested: value,
                });
            }
            if value == current {
                return Ok(());
            }
            match self
                .value
                .compare_exchange_weak(current, value, SeqCst, SeqCst)
            {
                Ok(_) => break,
                Err(now) => current = now,
            }
        }
        self.epoch.fetch_add(1, SeqCst);
        if self.sleepers.load(SeqCst) > 0 {
            futex::wake(&self.epoch, futex::Flags::PRIVATE, u32::MAX).map_err(|errno| {
                Error::Os {
                    call: "futex(FUTEX_WAKE)",
                    errno,
                }
            })?;
        }
        Ok(())
    }

    fn wait(&self, value: u64, timeout: Duration) -> Result<(), Error> {
        if self.value.load(SeqCst) >= value {
            return Ok(());
        }
        let start = Instant::now();
        let deadline = start
            .checked_add(timeout)
            .unwrap_or(start + Duration::from_secs(u32::MAX.into()));
        if let Some(budget) = self.spin_budget()
            && self.spin_until(value, budget, deadline)
        {
            self.spin_paid_off.store(true, SeqCst);
            return Ok(());
        }
        let result = self.park_until(value, deadline, timeout);
        // Had the value come within the budget, spinning would have caught it: spin next time.
        if let SpinPolicy::Adaptive(budget) = self.spin {
            self.spin_paid_off.store(start.elapsed() <= budget, SeqCst);
        }
        result
    }

    fn backend(&self) -> Backend<'_> {
        Backend::Cpu(self)
    }
}

impl CpuTimeline {
    /// The parking half of [`Timeline::wait`]: sleep on the futex until the value or deadline.
    fn park_until(&self, value: u64, deadline: Instant, timeout: Duration) -> Result<(), Error> {
        loop {
            self.sleepers.fetch_add(1, SeqCst);
            let seen = self.epoch.load(SeqCst);
            let reached = self.value.load(SeqCst);
            let now = Instant::now();
            if reached >= value || now >= deadline {
                self.sleepers.fetch_sub(1, SeqCst);
                return if reached >= value {
                    Ok(())
                } else {
                    Err(Error::Timeout {
                        wanted: value,
                        reached,
                        timeout,
                    })
                };
            }
            let left = deadline - now;
            let ts = futex::Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: i64::from(left.subsec_nanos()),
            };
            let result = futex::wait(&self.epoch, futex::Flags::PRIVATE, seen, Some(&ts));
            self.sleepers.fetch_sub(1, SeqCst);
            match result {
                // Woken, the epoch moved before we slept, a signal interrupted us, or time ran
                // out: all are answered by re-checking at the top.
                Ok(()) => {}
                Err(e) if e == rustix::io::Errno::AGAIN || e == rustix::io::Errno::INTR => {}
                Err(e) if e == rustix::io::Errno::TIMEDOUT => {}
                Err(errno) => {
                    return Err(Error::Os {
                        call: "futex(FUTEX_WAIT)",
                        errno,
                    });
                }
            }
        }
    }
}

/// Parks until the epoch of any of `cpu` moves, or `left` passes; the caller re-checks the
/// values. `points` are the same timelines with the values wanted, checked once more after the
/// sleepers are registered so that a signal in between is not missed.
pub(crate) fn wait_any_epochs(
    cpu: &[&CpuTimeline],
    points: &[(&dyn Timeline, u64)],
    left: Duration,
) -> Result<(), Error> {
    use rustix::time::{ClockId, clock_gettime};
    for t in cpu {
        t.sleepers.fetch_add(1, SeqCst);
    }
    let waits: Vec<futex::Wait> = cpu
        .iter()
        .map(|t| {
            let mut w = futex::Wait::new();
            w.uaddr = futex::WaitPtr::new(t.epoch.as_ptr().cast());
            w.val = u64::from(t.epoch.load(SeqCst));
            w.flags = futex::WaitFlags::SIZE_U32 | futex::WaitFlags::PRIVATE;
            w
        })
        .collect();
    let reached = points.iter().any(|(t, v)| t.value().is_ok_and(|x| x >= *v));
    let result = if reached {
        Ok(0)
    } else {
        // futex_waitv takes an absolute deadline on the given clock.
        let now = clock_gettime(ClockId::Monotonic);
        let end = Duration::new(now.tv_sec as u64, now.tv_nsec as u32).saturating_add(left);
        let deadline = futex::Timespec {
            tv_sec: end.as_secs() as i64,
            tv_nsec: i64::from(end.subsec_nanos()),
        };
        futex::waitv(
            &waits,
            futex::WaitvFlags::empty(),
            Some(&deadline),
            ClockId::Monotonic,
        )
    };
    for t in cpu {
        t.sleepers.fetch_sub(1, SeqCst);
    }
    match result {
        Ok(_) => Ok(()),
        Err(e)
            if [
                rustix::io::Errno::AGAIN,
                rustix::io::Errno::INTR,
                rustix::io::Errno::TIMEDOUT,
            ]
            .contains(&e) =>
        {
            Ok(())
        }
        // Kernels before 5.16 have no futex_waitv: sleep briefly and let the caller poll.
        Err(e) if e == rustix::io::Errno::NOSYS => {
            std::thread::sleep(left.min(Duration::from_millis(1)));
            Ok(())
        }
        Err(errno) => Err(Error::Os {
            call: "futex_waitv",
            errno,
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn values_only_grow() {
        let t = CpuTimeline::new(5);
        assert_eq!(t.value().unwrap(), 5);
        t.signal(5).unwrap();
        t.signal(9).unwrap();
        assert_eq!(
            t.signal(8),
            Err(Error::Backwards {
                current: 9,
                requested: 8
            })
        );
        assert_eq!(t.value().unwrap(), 9);
        t.wait(3, Duration::ZERO).unwrap();
        t.wait(9, Duration::ZERO).unwrap();
    }

    #[test]
    fn waits_time_out_with_the_numbers() {
        for spin in [
            SpinPolicy::Never,
            SpinPolicy::Fixed(Duration::from_micros(50)),
            SpinPolicy::default(),
        ] {
            let t = CpuTimeline::with_spin(1, spin);
            let start = Instant::now();
            let err = t.wait(2, Duration::from_millis(20)).unwrap_err();
            assert!(start.elapsed() >= Duration::from_millis(20));
            assert_eq!(
                err,
                Error::Timeout {
                    wanted: 2,
                    reached: 1,
                    timeout: Duration::from_millis(20)
                }
            );
        }
    }

    #[test]
    fn parked_and_spinning_waiters_are_released() {
        for spin in [
            SpinPolicy::Never,
            SpinPolicy::Fixed(Duration::from_millis(5)),
            SpinPolicy::default(),
        ] {
            let t = Arc::new(CpuTimeline::with_spin(0, spin));
            let waiters: Vec<_> = (1..=4u64)
                .map(|v| {
                    let t = Arc::clone(&t);
                    std::thread::spawn(move || t.wait(v * 10, Duration::from_secs(10)))
                })
                .collect();
            std::thread::sleep(Duration::from_millis(20));
            for v in 1..=4u64 {
                t.signal(v * 10).unwrap();
            }
            for w in waiters {
                w.join().unwrap().unwrap();
            }
        }
    }

    #[test]
    fn ping_pong_never_loses_a_wakeup() {
        // Two threads hand a token back and forth many times; a lost wakeup would hang (and
        // then fail on the timeout) instead of finishing.
        for spin in [SpinPolicy::Never, SpinPolicy::default()] {
            let ping = Arc::new(CpuTimeline::with_spin(0, spin));
            let pong = Arc::new(CpuTimeline::with_spin(0, spin));
            let (ping2, pong2) = (Arc::clone(&ping), Arc::clone(&pong));
            let rounds = 5_000;
            let other = std::thread::spawn(move || {
                for i in 1..=rounds {
                    ping2.wait(i, Duration::from_secs(10)).unwrap();
                    pong2.signal(i).unwrap();
                }
            });
            for i in 1..=rounds {
                ping.signal(i).unwrap();
                pong.wait(i, Duration::from_secs(10)).unwrap();
            }
            other.join().unwrap();
        }
    }
}
