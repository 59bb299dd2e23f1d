//! Pruning policies: which whole pages of a sequence's KV cache to drop when it grows past what
//! the cache (or the latency budget) allows. One trait, three policies, each reporting what it
//! dropped and why; [`apply`] removes the pages from the block table.
//!
//! Policies work on full pages (blocks): the block table is page-granular, so a page is the unit
//! that frees memory. Attention-driven policies read an [`AttentionTracker`], which accumulates
//! the probabilities [`crate::attention::decode`] returns, per layer and token.

use crate::Error;
use crate::pool::{BlockManager, SeqId};

/// Accumulated attention mass per layer and token of one sequence.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AttentionTracker {
    /// `[layer][token]`: summed probability over heads and decode steps.
    pub mass: Vec<Vec<f32>>,
    /// `[layer]`: the latest step's attention distribution (averaged over heads), for entropy.
    pub last: Vec<Vec<f32>>,
    /// `[layer][token]`: how many queries could see the token, when the kernel that added the
    /// mass said ([`AttentionTracker::accumulate`]); empty otherwise.
    pub seen: Vec<Vec<f32>>,
}

impl AttentionTracker {
    /// A tracker for `layers` layers.
    pub fn new(layers: usize) -> AttentionTracker {
        AttentionTracker {
            mass: vec![Vec::new(); layers],
            last: vec![Vec::new(); layers],
            seen: vec![Vec::new(); layers],
        }
    }

    /// Adds one decode step's probabilities for `layer` (`heads * len`, as `decode` returns).
    pub fn observe(
        &mut self,
        layer: usize,
        heads: usize,
        len: usize,
        probs: &[f32],
    ) -> Result<(), Error> {
        if layer >= self.mass.len() || heads == 0 || probs.len() != heads * len {
            return Err(Error::BadConfig {
                what: "observe: layer out of range or probabilities not heads * len",
            });
        }
        let mass = &mut self.mass[layer];
        mass.resize(len, 0.0);
        let last = &mut self.last[layer];
        last.clear();
        last.resize(len, 0.0);
        for head in probs.chunks_exact(len) {
            for ((m, l), &p) in mass.iter_mut().zip(last.iter_mut()).zip(head) {
                *m += p;
                *l += p / heads as f32;
            }
        }
        Ok(())
    }

    /// Adds attention observed by a kernel that summed it itself over the `queries` last
    /// tokens of the sequence (causally: query `i` of them sees the tokens up to its own):
    /// `mass[t]`, the probability token `t` received summed over heads and queries, and
    /// `last[t]`, the latest query's distribution averaged over heads (both as long as the
    /// sequence). Each token's count of queries that saw it grows to match.
    pub fn accumulate(
        &mut self,
        layer: usize,
        queries: usize,
        mass: &[f32],
        last: &[f32],
    ) -> Result<(), Error> {
        let len = mass.len();
        if layer >= self.mass.len() || last.len() != len || queries > len {
            return Err(Error::BadConfig {
                what: "accumulate: layer out of range, mass and last of different lengths, or more queries than tokens",
            });
        }
        let m = &mut self.mass[layer];
        m.resize(len, 0.0);
        for (a, &b) in m.iter_mut().zip(mass) {
            *a += b;
        }
        let seen = &mut self.seen[layer];
        seen.resize(len, 0.0);
        for (t, s) in seen.iter_mut().enumerate() {
            *s += queries.min(len - t) as f32;
        }
        self.last[layer].clear();
        self.last[layer].extend_from_slice(last);
        Ok(())
    }

    /// Forgets tokens from `len` on (a truncated sequence).
    pub fn truncate(&mut self, len: usize) {
        for per_layer in self
            .mass
            .iter_mut()
            .chain(self.last.iter_mut())
            .chain(self.seen.iter_mut())
        {
            per_layer.truncate(len);
        }
    }

    /// Forgets the tokens of dropped pages, so token indices stay aligned with the sequence.
    pub fn drop_pages(&mut self, block_tokens: usize, logical: &[usize]) {
        let mut sorted = logical.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        for per_layer in self
            .mass
            .iter_mut()
            .chain(self.last.iter_mut())
            .chain(self.seen.iter_mut())
        {
            for &b in sorted.iter().rev() {
                let start = b * block_tokens;
                if start + block_tokens <= per_layer.len() {
                    per_layer.drain(start..start + block_tokens);
                }
            }
        }
    }

    /// Attention mass of page `block` in `layer` (0 where nothing was observed). Where the
    /// tracker knows how many queries saw each token, a token's mass is divided by that count:
    /// the mean attention it received, so old tokens do not outrank new ones merely by having
    /// been seen by more queries.
    fn page_mass(&self, layer: usize, block: usize, block_tokens: usize) -> f32 {
        let m = &self.mass[layer];
        let end = ((block + 1) * block_tokens).min(m.len());
        let Some(page) = m.get(block * block_tokens..end) else {
            return 0.0;
        };
        match self.seen[layer].get(block * block_tokens..end) {
            Some(seen) if seen.len() == page.len() => page
                .iter()
                .zip(seen)
                .map(|(&x, &n)| if n > 0.0 { x / n } else { 0.0 })
                .sum(),
            _ => page.iter().sum(),
        }
    }
}

/// What a policy sees of one sequence.
#[derive(Clone, Copy, Debug)]
pub struct PruneInput<'a> {
    pub seq: SeqId,
    /// Tokens in the sequence.
    pub len: usize,
    pub block_tokens: usize,
    pub attention: &'a AttentionTracker,
}

impl PruneInput<'_> {
    fn full_blocks(&self) -> usize {
        self.len / self.block_tokens
    }
}

/// A policy's decision, with its reason, for the record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PruneReport {
    pub policy: &'static str,
    pub seq: SeqId,
    /// Logical pages to drop, ascending.
    pub dropped: Vec<usize>,
    pub reason: String,
}

/// A pruning policy.
pub trait PruningPolicy {
    /// The policy's name in reports.
    fn name(&self) -> &'static str;
    /// The pages to drop from the sequence (full pages only).
    fn select(&mut self, input: &PruneInput<'_>) -> PruneReport;
}

/// Pages kept regardless of policy: those holding the first `sink_tokens` tokens and the last
/// `recent_tokens` tokens.
fn protected(
    input: &PruneInput<'_>,
    sink_tokens: usize,
    recent_tokens: usize,
    block: usize,
) -> bool {
    let (start, end) = (block * input.block_tokens, (block + 1) * input.block_tokens);
    start < sink_tokens || end > input.len.saturating_sub(recent_tokens)
}

/// StreamingLLM: keep the attention-sink pages at the start and a recent window; drop the rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SinkWindow {
    pub sink_tokens: usize,
    pub window_tokens: usize,
}

impl PruningPolicy for SinkWindow {
    fn name(&self) -> &'static str {
        "sink+window"
    }

    fn select(&mut self, input: &PruneInput<'_>) -> PruneReport {
        let dropped: Vec<usize> = (0..input.full_blocks())
            .filter(|&b| !protected(input, self.sink_tokens, self.window_tokens, b))
            .collect();
        PruneReport {
            policy: self.name(),
            seq: input.seq,
            reason: format!(
                "keep the first {} tokens (sinks) and the last {} (window) of {}",
                self.sink_tokens, self.window_tokens, input.len
            ),
            dropped,
        }
    }
}

/// H2O at page granularity: keep sinks, the recent window and the `budget_pages` pages with the
/// most accumulated attention (over all layers); drop the rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeavyHitters {
    pub budget_pages: usize,
    pub sink_tokens: usize,
    pub recent_tokens: usize,
}

impl PruningPolicy for HeavyHitters {
    fn name(&self) -> &'static str {
        "heavy-hitters"
    }

    fn select(&mut self, input: &PruneInput<'_>) -> PruneReport {
        let layers = input.attention.mass.len();
        let mut candidates: Vec<(usize, f32)> = (0..input.full_blocks())
            .filter(|&b| !protected(input, self.sink_tokens, self.recent_tokens, b))
            .map(|b| {
                (
                    b,
                    (0..layers)
                        .map(|l| input.attention.page_mass(l, b, input.block_tokens))
                        .sum(),
                )
            })
            .collect();
        // Heaviest first; ties keep the later page (more recent context).
        candidates.sort_by(|a, b| b.1.total_cmp(&a.1).then(b.0.cmp(&a.0)));
        let mut dropped: Vec<usize> = candidates
            .iter()
            .skip(self.budget_pages)
            .map(|c| c.0)
            .collect();
        dropped.sort_unstable();
        PruneReport {
            policy: self.name(),
            seq: input.seq,
            reason: format!(
                "keep sinks, the recent window and the {} heaviest of {} candidate pages",
                self.budget_pages,
                candidates.len()
            ),
            dropped,
        }
    }
}

/// Per-layer attention-entropy pruning: layers whose latest attention distribution has low
/// normalised entropy (`H / ln(len)` below `entropy_threshold`) attend to few tokens; a page that
/// every such layer gives less than `mass_threshold` of its attention is dropped. With no
/// low-entropy layer nothing is dropped (every layer looks everywhere).
///
/// With `budget_pages`, the policy instead keeps that many candidate pages (besides sinks and
/// the recent window): those with the most attention, each layer's accumulated mass weighted by
/// how focused the layer is (`1 -` its normalised entropy), so that the layers that attend to
/// few tokens decide which tokens stay.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EntropyPages {
    pub entropy_threshold: f32,
    pub mass_threshold: f32,
    pub sink_tokens: usize,
    pub recent_tokens: usize,
    pub budget_pages: Option<usize>,
}

impl PruningPolicy for EntropyPages {
    fn name(&self) -> &'static str {
        "attention-entropy"
    }

    fn select(&mut self, input: &PruneInput<'_>) -> PruneReport {
        if let Some(budget) = self.budget_pages {
            return self.select_within(input, budget);
        }
        let low: Vec<usize> = input
            .attention
            .last
            .iter()
            .enumerate()
            .filter(|(_, p)| p.len() > 1 && normalised_entropy(p) < self.entropy_threshold)
            .map(|(l, _)| l)
            .collect();
        let dropped: Vec<usize> = if low.is_empty() {
            Vec::new()
        } else {
            (0..input.full_blocks())
                .filter(|&b| !protected(input, self.sink_tokens, self.recent_tokens, b))
                .filter(|&b| {
                    low.iter().all(|&l| {
                        let p = &input.attention.last[l];
                        let end = ((b + 1) * input.block_tokens).min(p.len());
                        p.get(b * input.block_tokens..end)
                            .map_or(0.0, |s| s.iter().sum::<f32>())
                            < self.mass_threshold
                    })
                })
                .collect()
        };
        PruneReport {
            policy: self.name(),
            seq: input.seq,
            reason: format!(
                "low-entropy layers {low:?} (normalised entropy < {}) give these pages < {} of their attention",
                self.entropy_threshold, self.mass_threshold
            ),
            dropped,
        }
    }
}

impl EntropyPages {
    /// The budgeted form: keep the `budget` candidate pages with the most entropy-weighted mass.
    fn select_within(&self, input: &PruneInput<'_>, budget: usize) -> PruneReport {
        let weights: Vec<f32> = input
            .attention
            .last
            .iter()
            .map(|p| {
                if p.len() > 1 {
                    (1.0 - normalised_entropy(p)).max(0.0)
                } else {
                    0.0
                }
            })
            .collect();
        let mut candidates: Vec<(usize, f32)> = (0..input.full_blocks())
            .filter(|&b| !protected(input, self.sink_tokens, self.recent_tokens, b))
            .map(|b| {
                let score = weights
                    .iter()
                    .enumerate()
                    .map(|(l, w)| w * input.attention.page_mass(l, b, input.block_tokens))
                    .sum();
                (b, score)
            })
            .collect();
        candidates.sort_by(|a, b| b.1.total_cmp(&a.1).then(b.0.cmp(&a.0)));
        let mut dropped: Vec<usize> = candidates.iter().skip(budget).map(|c| c.0).collect();
        dropped.sort_unstable();
        PruneReport {
            policy: self.name(),
            seq: input.seq,
            reason: format!(
                "keep sinks, the recent window and the {budget} of {} candidate pages with the most attention in focused layers (weights {weights:.2?})",
                candidates.len()
            ),
            dropped,
        }
    }
}

/// `H(p) / ln(len)`: 1 for uniform attention, 0 for attention on one token.
pub fn normalised_entropy(p: &[f32]) -> f32 {
    let h: f32 = p.iter().filter(|&&x| x > 0.0).map(|&x| -x * x.ln()).sum();
    h / (p.len() as f32).ln()
}

/// Drops the report's pages from the sequence and the tracker; returns the physical blocks.
pub fn apply(
    manager: &mut BlockManager,
    tracker: &mut AttentionTracker,
    report: &PruneReport,
) -> Result<Vec<crate::BlockId>, Error> {
    let blocks = manager.drop_blocks(report.seq, &report.dropped)?;
    tracker.drop_pages(manager.block_tokens(), &report.dropped);
    Ok(blocks)
}
