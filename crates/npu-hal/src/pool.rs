//! A persistent worker pool for the CPU NPU: threads are spawned once, sized to the cores, and
//! each op is a broadcast of one borrowed closure to every worker.
//!
//! A decode step is a few hundred short parallel ops (one per linear layer, a few microseconds
//! each), so the cost of handing out work is what matters: a futex wake-up on the VMs this
//! project runs on costs about 23 µs (the sync-timeline bench), longer than many of the ops. Workers
//! therefore spin on an epoch counter for the pool's spin budget after each job before they sleep on
//! a condition variable, as llama.cpp's thread pool does; back-to-back ops never sleep.
//!
//! Invariants:
//! - [`WorkerPool::run`] returns only after every worker has finished with the closure, also when
//!   a part panics (the panic is re-raised on the caller after the others finish), so the
//!   closure's borrows outlive every use of it. That is what makes the lifetime erasure sound.
//! - One `run` at a time: a lock serialises callers; the pool is not re-entrant (a job must not
//!   call `run` on the same pool, which would deadlock on that lock, never corrupt state).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A job as the workers see it: the closure with its lifetime erased.
#[derive(Clone, Copy)]
struct JobPtr(*const (dyn Fn(usize) + Sync + 'static));

// SAFETY: the pointee is `Sync` (so shared use from several threads is fine) and `run` keeps it
// alive until every worker has stopped using it (module invariant).
unsafe impl Send for JobPtr {}

struct Shared {
    /// Bumped once per job; workers compare it with the last epoch they ran.
    epoch: AtomicU64,
    /// The current job; valid while `pending > 0` for the epoch it was published with.
    job: Mutex<Option<JobPtr>>,
    /// Workers that have not finished the current job.
    pending: AtomicUsize,
    /// Workers asleep on `wake` (so `run` only takes the lock when someone sleeps).
    sleepers: AtomicUsize,
    wake: Condvar,
    sleep_lock: Mutex<()>,
    /// A worker's part panicked during the current job.
    panicked: AtomicBool,
    stop: AtomicBool,
    spin: Duration,
}

/// A fixed set of worker threads that run one broadcast job at a time.
#[derive(Debug)]
pub struct WorkerPool {
    shared: Arc<Shared>,
    handles: Vec<std::thread::JoinHandle<()>>,
    run_lock: Mutex<()>,
    threads: usize,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("epoch", &self.epoch.load(Ordering::Relaxed))
            .field("spin", &self.spin)
            .finish_non_exhaustive()
    }
}

impl WorkerPool {
    /// How long an idle worker spins before it sleeps, unless [`WorkerPool::with_spin`] says
    /// otherwise: longer than the gaps between the ops of one decode step (single-threaded
    /// element-wise ops, sampling), far shorter than a human-visible pause.
    pub const DEFAULT_SPIN: Duration = Duration::from_micros(300);

    /// A pool of `threads` parts (the caller runs part 0, so `threads - 1` threads are spawned);
    /// `threads == 0` means one per available core.
    pub fn new(threads: usize) -> std::io::Result<WorkerPool> {
        WorkerPool::with_spin(threads, WorkerPool::DEFAULT_SPIN)
    }

    /// [`WorkerPool::new`] with an explicit idle spin budget.
    pub fn with_spin(threads: usize, spin: Duration) -> std::io::Result<WorkerPool> {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: Mutex::new(None),
            pending: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            wake: Condvar::new(),
            sleep_lock: Mutex::new(()),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            spin,
        });
        let mut handles = Vec::with_capacity(threads - 1);
        for part in 1..threads {
            let shared = Arc::clone(&shared);
            handles.push(
                std::thread::Builder::new()
                    .name(format!("npu-cpu-{part}"))
                    .spawn(move || worker(&shared, part))?,
            );
        }
        Ok(WorkerPool {
            shared,
            handles,
            run_lock: Mutex::new(()),
            threads,
        })
    }

    /// Parts per job (worker threads plus the caller).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Calls `job(part)` once for every part in `0..threads()`, part 0 on the calling thread, and
    /// returns when all have finished. A panic in any part is re-raised here after the others end.
    pub fn run(&self, job: &(dyn Fn(usize) + Sync)) {
        if self.threads == 1 {
            job(0);
            return;
        }
        let _serial = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: only the lifetime is changed. The pointer is published to the workers below
        // and `run` does not return (nor unwind) before `pending` drops to zero, i.e. before the
        // last worker has finished calling it, so it never outlives the borrow it came from.
        let erased: *const (dyn Fn(usize) + Sync + 'static) = unsafe {
            std::mem::transmute::<
                *const (dyn Fn(usize) + Sync + '_),
                *const (dyn Fn(usize) + Sync + 'static),
            >(job)
        };
        let s = &*self.shared;
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(JobPtr(erased));
        s.pending.store(self.threads - 1, Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(0)));
        let mut spins = 0u32;
        while s.pending.load(Ordering::Acquire) != 0 {
            // Spin briefly, then give the core away: when the machine is oversubscribed the
            // worker we wait for may be waiting for this very core.
            spins = spins.wrapping_add(1);
            if spins > 256 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
        if let Err(payload) = mine {
            std::panic::resume_unwind(payload);
        }
        if s.panicked.swap(false, Ordering::SeqCst) {
            panic!("an npu-hal CPU worker panicked while running a job (see its message above)");
        }
    }

    /// Splits `0..len` into `threads()` contiguous shares aligned to `align` and returns part
    /// `part`'s share (possibly empty).
    pub fn share(&self, part: usize, len: usize, align: usize) -> std::ops::Range<usize> {
        share(part, self.threads, len, align)
    }
}

/// Part `part` of `parts` contiguous shares of `0..len`, share boundaries multiples of `align`.
pub fn share(part: usize, parts: usize, len: usize, align: usize) -> std::ops::Range<usize> {
    let align = align.max(1);
    let units = len.div_ceil(align);
    let per = units.div_ceil(parts.max(1));
    let start = (part * per * align).min(len);
    let end = ((part + 1) * per * align).min(len);
    start..end
}

fn worker(s: &Shared, part: usize) {
    let mut seen = 0u64;
    loop {
        // Spin for new work, then sleep.
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.stop.load(Ordering::Acquire) {
                return;
            }
            if s.epoch.load(Ordering::Acquire) != seen {
                break;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && spins > 1024 {
                // Past a short spin, share the core (see `run`).
                std::thread::yield_now();
            }
            if spins.is_multiple_of(64) && started.elapsed() > s.spin {
                let guard = s.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
                s.sleepers.fetch_add(1, Ordering::SeqCst);
                let mut guard = guard;
                while s.epoch.load(Ordering::SeqCst) == seen && !s.stop.load(Ordering::SeqCst) {
                    guard = s.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
                }
                s.sleepers.fetch_sub(1, Ordering::SeqCst);
                drop(guard);
                break;
            }
            std::hint::spin_loop();
        }
        if s.stop.load(Ordering::Acquire) {
            return;
        }
        seen = s.epoch.load(Ordering::Acquire);
        let job = *s.job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(JobPtr(ptr)) = job {
            // SAFETY: `run` published `ptr` for this epoch and waits for `pending` to reach zero
            // before the closure can go away; we decrement `pending` only after this call.
            let f = unsafe { &*ptr };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(part))).is_err() {
                s.panicked.store(true, Ordering::SeqCst);
            }
            s.pending.fetch_sub(1, Ordering::Release);
        }
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _g = self
                .shared
                .sleep_lock
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_runs_once_per_job() {
        let pool = WorkerPool::new(3).unwrap();
        let counts: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
        for _ in 0..1000 {
            pool.run(&|part| {
                counts[part].fetch_add(1, Ordering::Relaxed);
            });
        }
        for c in &counts {
            assert_eq!(c.load(Ordering::Relaxed), 1000);
        }
    }

    #[test]
    fn sleeping_workers_wake_up() {
        let pool = WorkerPool::with_spin(2, Duration::ZERO).unwrap();
        let total = AtomicUsize::new(0);
        for _ in 0..50 {
            std::thread::sleep(Duration::from_millis(1));
            pool.run(&|_| {
                total.fetch_add(1, Ordering::Relaxed);
            });
        }
        assert_eq!(total.load(Ordering::Relaxed), 100);
    }

    #[test]
    fn a_worker_panic_reaches_the_caller_and_the_pool_survives() {
        let pool = WorkerPool::new(2).unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(&|part| assert!(part != 1, "part 1 fails on purpose"));
        }));
        assert!(r.is_err());
        let ran = AtomicUsize::new(0);
        pool.run(&|_| {
            ran.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(ran.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn shares_cover_the_range_without_overlap() {
        for parts in 1..5 {
            for len in 0..70 {
                let mut next = 0;
                for p in 0..parts {
                    let r = share(p, parts, len, 16);
                    assert_eq!(r.start.min(len), next.min(len));
                    assert!(r.start.is_multiple_of(16) || r.start == len);
                    next = r.end.max(next);
                }
                assert_eq!(next, len);
            }
        }
    }
}
