//! Shared pieces of the criterion suites: the read-bandwidth ceiling every memory-bound kernel is
//! quoted against.
//!
//! Each suite measures its kernel and this ceiling in the same run (`Throughput::Bytes`), so a
//! figure reads as a fraction of what this machine's memory can deliver right now, not of a number
//! copied from a data sheet on a quieter day.

#![forbid(unsafe_code)]

pub mod dfa_grammar;

use std::hint::black_box;

/// Bytes in the buffer the bandwidth benches stream: 4x a 32 MiB L3, so reads come from DRAM.
pub const STREAM_BYTES: usize = 128 << 20;

/// Sums `words` with eight independent accumulators, so the loop is bound by loads, not by an
/// add chain; the compiler vectorises it. This is the STREAM-like read kernel: every byte is read
/// once, nothing is written.
pub fn read_sum(words: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let chunks = words.chunks_exact(8);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (a, w) in acc.iter_mut().zip(chunk) {
            *a = a.wrapping_add(*w);
        }
    }
    let mut total = tail.iter().fold(0u64, |t, w| t.wrapping_add(*w));
    for a in acc {
        total = total.wrapping_add(a);
    }
    total
}

/// [`read_sum`] over `threads` contiguous parts of `words` in parallel (scoped threads spawned per
/// call: tens of microseconds against the 3.5-5 ms the `bandwidth` group measured for a 128 MiB
/// pass, so the ceiling it reports is at most a few percent low).
pub fn read_sum_parallel(words: &[u64], threads: usize) -> u64 {
    let threads = threads.max(1);
    let part = words.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        let handles: Vec<_> = words
            .chunks(part)
            .map(|c| s.spawn(move || read_sum(black_box(c))))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("read_sum does not panic"))
            .fold(0, u64::wrapping_add)
    })
}

/// Median and 99th percentile of `samples` (sorted in place).
pub fn median_p99(
    samples: &mut [std::time::Duration],
) -> (std::time::Duration, std::time::Duration) {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_sum_matches_a_plain_fold() {
        let words: Vec<u64> = (0..1037u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        let expect = words.iter().fold(0u64, |t, w| t.wrapping_add(*w));
        assert_eq!(read_sum(&words), expect);
        for threads in 1..=5 {
            assert_eq!(read_sum_parallel(&words, threads), expect);
        }
    }
}
