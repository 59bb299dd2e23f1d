//! The CPU timeline across threads: wait_any over many timelines (futex_waitv), wait_all, and
//! shared deadlines.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sync_timeline::{CpuTimeline, Error, SpinPolicy, Timeline, wait_all, wait_any};

#[test]
fn wait_any_returns_the_timeline_that_moved() {
    let timelines: Vec<Arc<CpuTimeline>> = (0..5)
        .map(|_| Arc::new(CpuTimeline::with_spin(0, SpinPolicy::Never)))
        .collect();
    let t3 = Arc::clone(&timelines[3]);
    let signaller = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        t3.signal(1).unwrap();
    });
    let points: Vec<(&dyn Timeline, u64)> = timelines
        .iter()
        .map(|t| (t.as_ref() as &dyn Timeline, 1))
        .collect();
    let start = Instant::now();
    assert_eq!(wait_any(&points, Duration::from_secs(10)).unwrap(), 3);
    assert!(start.elapsed() >= Duration::from_millis(15));
    signaller.join().unwrap();
    assert!(matches!(
        wait_any(&[], Duration::ZERO),
        Err(Error::BadArgument { .. })
    ));
}

#[test]
fn wait_any_and_all_time_out() {
    let a = CpuTimeline::new(1);
    let b = CpuTimeline::new(2);
    let points: [(&dyn Timeline, u64); 2] = [(&a, 5), (&b, 2)];
    // b is already there: wait_any succeeds at once, wait_all times out on a.
    assert_eq!(wait_any(&points, Duration::from_millis(10)).unwrap(), 1);
    let start = Instant::now();
    let err = wait_all(&points, Duration::from_millis(30)).unwrap_err();
    assert!(start.elapsed() >= Duration::from_millis(30));
    assert_eq!(
        err,
        Error::Timeout {
            wanted: 5,
            reached: 1,
            timeout: Duration::from_millis(30)
        }
    );
    let none: [(&dyn Timeline, u64); 1] = [(&a, 9)];
    assert!(matches!(
        wait_any(&none, Duration::from_millis(10)),
        Err(Error::Timeout { wanted: 9, .. })
    ));
}
