//! A chain of stages connected by timelines, running ahead of each other like hardware queues.
//!
//! Stage `k` processes items `1, 2, ...` in order. For item `v` it waits until its upstream
//! timeline reaches `v` (the input is ready) and, with a ring of `depth` buffers between stages,
//! until its downstream timeline reaches `v - depth` (the slot it will overwrite has been
//! consumed); then it runs its work and signals its own timeline to `v`. Every wait is a timeline
//! wait; there is no mutex or condition variable between stages, and every stage runs ahead as
//! far as the ring allows, so item `v + 1` is being produced while item `v` is consumed.
//!
//! A stage whose work fails stops the chain: the others notice within [`ABORT_POLL`] and stop;
//! [`run`] returns the first failure with the stage and item. Completed items stay completed.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::{Error, Timeline};

/// How often a waiting stage checks whether another stage failed.
pub const ABORT_POLL: Duration = Duration::from_millis(20);

/// The error type of a stage's work.
pub type WorkError = Box<dyn std::error::Error + Send + Sync>;

/// One stage: its name, the timeline it signals, and its work for item `v`.
pub struct Stage {
    pub name: String,
    pub timeline: Arc<dyn Timeline>,
    pub work: Box<dyn FnMut(u64) -> Result<(), WorkError> + Send>,
}

impl std::fmt::Debug for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stage")
            .field("name", &self.name)
            .field("timeline", &self.timeline)
            .finish()
    }
}

/// How a chain run ended badly.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChainError {
    /// A stage's work returned an error.
    #[error("stage {stage} failed on item {item}: {error}")]
    Work {
        stage: String,
        item: u64,
        error: WorkError,
    },
    /// A timeline operation failed (a wait timed out, a signal went backwards, a device error).
    #[error("stage {stage}, item {item}: {error}")]
    Timeline {
        stage: String,
        item: u64,
        error: Error,
    },
    /// Another stage failed first; this one stopped.
    #[error("stage {stage} stopped at item {item} because another stage failed")]
    Aborted { stage: String, item: u64 },
    /// The chain's arguments make no sense.
    #[error("{0}")]
    BadArgument(&'static str),
}

/// Runs `stages` over items `1..=items`: stage 0 waits on `source`, stage `k` on stage `k - 1`'s
/// timeline; `depth` buffers sit between neighbours (`depth >= 1`). Each wait gives up after
/// `timeout`. Returns when the last stage has signalled `items`, or with the first failure.
pub fn run(
    source: Arc<dyn Timeline>,
    stages: Vec<Stage>,
    items: u64,
    depth: u64,
    timeout: Duration,
) -> Result<(), ChainError> {
    if stages.is_empty() {
        return Err(ChainError::BadArgument("a chain needs at least one stage"));
    }
    if depth == 0 {
        return Err(ChainError::BadArgument(
            "a ring needs at least one buffer (depth >= 1)",
        ));
    }
    let abort = Arc::new(AtomicBool::new(false));
    let timelines: Vec<Arc<dyn Timeline>> =
        stages.iter().map(|s| Arc::clone(&s.timeline)).collect();
    let results: Vec<Result<(), ChainError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = stages
            .into_iter()
            .enumerate()
            .map(|(k, stage)| {
                let upstream = if k == 0 {
                    Arc::clone(&source)
                } else {
                    Arc::clone(&timelines[k - 1])
                };
                let downstream = timelines.get(k + 1).cloned();
                let abort = Arc::clone(&abort);
                scope.spawn(move || {
                    let result =
                        run_stage(stage, upstream, downstream, items, depth, timeout, &abort);
                    if result.is_err() {
                        abort.store(true, Ordering::SeqCst);
                    }
                    result
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("stage threads catch their errors"))
            .collect()
    });
    // The root cause, not the stages that stopped because of it.
    let mut aborted = None;
    for r in results {
        match r {
            Err(ChainError::Aborted { .. }) => aborted = aborted.or(Some(r)),
            Err(e) => return Err(e),
            Ok(()) => {}
        }
    }
    aborted.unwrap_or(Ok(()))
}

fn run_stage(
    mut stage: Stage,
    upstream: Arc<dyn Timeline>,
    downstream: Option<Arc<dyn Timeline>>,
    items: u64,
    depth: u64,
    timeout: Duration,
    abort: &AtomicBool,
) -> Result<(), ChainError> {
    for item in 1..=items {
        let wait = |t: &dyn Timeline, v: u64| -> Result<(), ChainError> {
            let start = Instant::now();
            loop {
                if abort.load(Ordering::SeqCst) {
                    return Err(ChainError::Aborted {
                        stage: stage.name.clone(),
                        item,
                    });
                }
                let left = timeout.saturating_sub(start.elapsed());
                match t.wait(v, left.min(ABORT_POLL)) {
                    Ok(()) => return Ok(()),
                    Err(Error::Timeout { .. }) if !left.is_zero() && left > ABORT_POLL => continue,
                    Err(Error::Timeout {
                        wanted, reached, ..
                    }) => {
                        let error = Error::Timeout {
                            wanted,
                            reached,
                            timeout,
                        };
                        return Err(ChainError::Timeline {
                            stage: stage.name.clone(),
                            item,
                            error,
                        });
                    }
                    Err(error) => {
                        return Err(ChainError::Timeline {
                            stage: stage.name.clone(),
                            item,
                            error,
                        });
                    }
                }
            }
        };
        wait(upstream.as_ref(), item)?;
        if let Some(down) = &downstream
            && item > depth
        {
            wait(down.as_ref(), item - depth)?;
        }
        (stage.work)(item).map_err(|error| ChainError::Work {
            stage: stage.name.clone(),
            item,
            error,
        })?;
        stage
            .timeline
            .signal(item)
            .map_err(|error| ChainError::Timeline {
                stage: stage.name.clone(),
                item,
                error,
            })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::CpuTimeline;

    #[test]
    fn stages_overlap_in_order_within_the_ring() {
        let source: Arc<dyn Timeline> = Arc::new(CpuTimeline::new(0));
        // Each stage records (stage, item, upstream progress, downstream progress) as it starts.
        let log = Arc::new(Mutex::new(Vec::new()));
        let timelines: Vec<Arc<dyn Timeline>> =
            (0..3).map(|_| Arc::new(CpuTimeline::new(0)) as _).collect();
        let stages = (0..3)
            .map(|k| {
                let log = Arc::clone(&log);
                let me: Arc<dyn Timeline> = Arc::clone(&timelines[k]);
                let next = timelines.get(k + 1).cloned();
                Stage {
                    name: format!("stage{k}"),
                    timeline: Arc::clone(&me),
                    work: Box::new(move |item| {
                        let done_below = next.as_ref().map_or(0, |n| n.value().unwrap());
                        log.lock().unwrap().push((k, item, done_below));
                        std::thread::sleep(Duration::from_micros(200));
                        Ok(())
                    }),
                }
            })
            .collect();
        source.signal(50).unwrap();
        run(Arc::clone(&source), stages, 50, 2, Duration::from_secs(10)).unwrap();
        for t in &timelines {
            assert_eq!(t.value().unwrap(), 50);
        }
        let log = log.lock().unwrap();
        for k in 0..3 {
            let items: Vec<u64> = log.iter().filter(|e| e.0 == k).map(|e| e.1).collect();
            assert_eq!(
                items,
                (1..=50).collect::<Vec<_>>(),
                "stage {k} runs items in order"
            );
        }
        // The ring bound: a stage starts item v only after its consumer finished v - depth.
        for &(k, item, done_below) in log.iter() {
            if k < 2 && item > 2 {
                assert!(
                    done_below >= item - 2,
                    "stage {k} item {item} ran ahead of the ring ({done_below})"
                );
            }
        }
        // Overlap: some stage-0 item started while stage 1 had not finished the previous one.
        assert!(
            log.iter()
                .any(|&(k, item, done_below)| k == 0 && item > 1 && done_below < item - 1)
        );
    }

    #[test]
    fn a_failing_stage_stops_the_chain_with_its_error() {
        let source: Arc<dyn Timeline> = Arc::new(CpuTimeline::new(10));
        let stages = vec![
            Stage {
                name: "ok".into(),
                timeline: Arc::new(CpuTimeline::new(0)),
                work: Box::new(|_| Ok(())),
            },
            Stage {
                name: "fails".into(),
                timeline: Arc::new(CpuTimeline::new(0)),
                work: Box::new(|item| {
                    if item == 3 {
                        Err("bad frame".into())
                    } else {
                        Ok(())
                    }
                }),
            },
            Stage {
                name: "after".into(),
                timeline: Arc::new(CpuTimeline::new(0)),
                work: Box::new(|_| Ok(())),
            },
        ];
        let err = run(source, stages, 10, 1, Duration::from_secs(10)).unwrap_err();
        match err {
            ChainError::Work { stage, item, error } => {
                assert_eq!(
                    (stage.as_str(), item, error.to_string().as_str()),
                    ("fails", 3, "bad frame")
                );
            }
            other => panic!("unexpected {other}"),
        }
    }
}
