//! The copy ledger: every copy helper in the workspace reports its bytes here, per stage, so a
//! pipeline run can print "bytes copied: 0" and mean it.
//!
//! A stage asks the ledger for its counter once ([`CopyLedger::stage`]) and copies through it
//! ([`StageCopies::copy`]); the counters are atomics, so the hot path takes no lock. A run
//! reads a [`LedgerReport`] at the end and divides by its frame count.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::Error;

/// Bytes and copies recorded by one stage.
#[derive(Debug, Default)]
pub struct StageCopies {
    bytes: AtomicU64,
    copies: AtomicU64,
}

impl StageCopies {
    /// Records a copy of `bytes` bytes made elsewhere (a DMA, a device transfer).
    pub fn record(&self, bytes: usize) {
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.copies.fetch_add(1, Ordering::Relaxed);
    }

    /// Copies `src` into `dst` (equal lengths) and records it.
    pub fn copy<T: bytemuck::Pod>(&self, dst: &mut [T], src: &[T]) -> Result<(), Error> {
        if dst.len() != src.len() {
            return Err(Error::CopyLength {
                dst: dst.len(),
                src: src.len(),
            });
        }
        dst.copy_from_slice(src);
        self.record(std::mem::size_of_val(src));
        Ok(())
    }

    /// Bytes recorded so far.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Copies recorded so far.
    pub fn copies(&self) -> u64 {
        self.copies.load(Ordering::Relaxed)
    }
}

/// One stage's line in a [`LedgerReport`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageReport {
    pub stage: String,
    pub bytes: u64,
    pub copies: u64,
}

/// A snapshot of every stage's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LedgerReport {
    pub stages: Vec<StageReport>,
}

impl LedgerReport {
    /// All stages' bytes.
    pub fn total_bytes(&self) -> u64 {
        self.stages.iter().map(|s| s.bytes).sum()
    }

    /// Bytes per frame over `frames` frames (0 frames: 0).
    pub fn bytes_per_frame(&self, frames: u64) -> f64 {
        if frames == 0 {
            0.0
        } else {
            self.total_bytes() as f64 / frames as f64
        }
    }
}

impl std::fmt::Display for LedgerReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "bytes copied: {}", self.total_bytes())?;
        for s in &self.stages {
            writeln!(
                f,
                "  {:16} {:>12} bytes in {} copies",
                s.stage, s.bytes, s.copies
            )?;
        }
        Ok(())
    }
}

/// Per-stage copy counters.
#[derive(Debug, Default)]
pub struct CopyLedger {
    stages: Mutex<Vec<(String, Arc<StageCopies>)>>,
}

impl CopyLedger {
    /// An empty ledger (tests and embedders that want their own).
    pub fn new() -> CopyLedger {
        CopyLedger::default()
    }

    /// The process-wide ledger that the workspace's copy helpers report to.
    pub fn global() -> &'static CopyLedger {
        static GLOBAL: OnceLock<CopyLedger> = OnceLock::new();
        GLOBAL.get_or_init(CopyLedger::new)
    }

    /// The counter for `stage`, created on first use. Keep it: this takes a lock, counting
    /// does not.
    pub fn stage(&self, stage: &str) -> Arc<StageCopies> {
        let mut stages = self.stages.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, c)) = stages.iter().find(|(name, _)| name == stage) {
            return Arc::clone(c);
        }
        let c = Arc::new(StageCopies::default());
        stages.push((stage.to_owned(), Arc::clone(&c)));
        c
    }

    /// Every stage's counters now.
    pub fn report(&self) -> LedgerReport {
        let stages = self.stages.lock().unwrap_or_else(|p| p.into_inner());
        LedgerReport {
            stages: stages
                .iter()
                .map(|(name, c)| StageReport {
                    stage: name.clone(),
                    bytes: c.bytes(),
                    copies: c.copies(),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_counted_per_stage() {
        let ledger = CopyLedger::new();
        let isp = ledger.stage("isp");
        let mut dst = [0u32; 8];
        isp.copy(&mut dst, &[7; 8]).unwrap();
        ledger.stage("gpu").record(100);
        assert!(isp.copy(&mut dst, &[1; 4]).is_err());
        let report = ledger.report();
        assert_eq!(report.total_bytes(), 132);
        assert_eq!(
            report.stages[0],
            StageReport {
                stage: "isp".into(),
                bytes: 32,
                copies: 1
            }
        );
        assert_eq!(report.bytes_per_frame(4), 33.0);
        assert!(report.to_string().starts_with("bytes copied: 132"));
    }
}
