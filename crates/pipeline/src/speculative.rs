//! Speculative decoding: a cheap drafter proposes the next few tokens, the decoder scores all of
//! them in one batched forward pass, and the longest prefix the target model agrees with is
//! kept. Decode reads every weight once per step whatever the batch, so verifying K drafts
//! costs little more than generating one token.
//!
//! # Drafters
//! - [`NgramDrafter`]: prompt lookup. The most recent earlier occurrence of the context's last
//!   n-gram (longest first) proposes the tokens that followed it, in the context or in texts
//!   it was given ([`Drafter::remember`]: `pipeline run` gives it the previous replies).
//! - [`ModelDrafter`]: a smaller model with the same vocabulary, decoding on its own KV cache,
//!   which it keeps in step with the target's accepted tokens by truncating (never copying).
//!
//! # Why the output does not change
//! - Greedy: a draft is kept only where it equals the target's argmax, and the batched pass
//!   gives each row the bits a one-token step would (kv-paged's `decode_queries`; batches of up
//!   to [`MAX_DRAFT_TOKENS`] + 1 rows), so the tokens are those of plain greedy decoding.
//! - Sampling: the standard rule (Leviathan et al. 2023; Chen et al. 2023). Draft `d` drawn
//!   from `q` is accepted with probability `min(1, p(d) / q(d))`, where `p` is the target's
//!   distribution after the same penalty, top-k, top-p and temperature; on rejection the token
//!   is drawn from `max(0, p - q)` renormalised. Lookup drafts are deterministic (`q` is one-hot
//!   on `d`), so they are accepted with probability `p(d)` and replaced by a draw from `p`
//!   without `d`. Either way each emitted token is distributed exactly as under `p`.
//! - Rejected drafts are rolled back by [`Decoder::truncate`]: the block table is cut.
//!
//! # Turning itself down
//! [`DraftControl`] keeps a running estimate of how often a draft is accepted and drafts the
//! number of tokens that maximises the expected tokens per unit of step cost. When even one
//! draft does not pay, it stops drafting for a while (a cool-down that doubles while drafting
//! keeps failing), then tries one token again.

use crate::decoder::{DecodeError, Decoder};
use npu_hal::sampling::{Sampler, SamplingParams};

/// The most tokens one step drafts: the verification batch (drafts + 1) stays within the
/// attention kernel's bit-exact streaming path (npu-hal's 16-query batches).
pub const MAX_DRAFT_TOKENS: usize = 15;

/// A source of draft tokens.
pub trait Drafter: std::fmt::Debug {
    /// Proposes up to `k` tokens to follow `context` (the prompt and every token so far; the
    /// target has not yet seen the last one). Fills `draft.tokens`, and `draft.dists` with
    /// each token's draft distribution when the drafter samples (left empty for deterministic
    /// proposals). Proposing fewer than `k`, or none, is always allowed.
    fn draft(&mut self, context: &[u32], k: usize, draft: &mut Draft) -> Result<(), DecodeError>;

    /// The cost of drafting one token, as a fraction of one target decode step; what
    /// [`DraftControl`] weighs against the acceptance rate. Lookups cost 0.
    fn cost_per_token(&self) -> f64;

    /// Called when a generation starts, so state from an earlier one does not leak in.
    fn reset(&mut self) -> Result<(), DecodeError> {
        Ok(())
    }

    /// Offered each finished reply (`pipeline run`), for drafters that draw on earlier text.
    fn remember(&mut self, _reply: &[u32]) {}
}

/// One step's drafts.
#[derive(Clone, Debug, Default)]
pub struct Draft {
    pub tokens: Vec<u32>,
    /// For a sampling drafter, the distribution each token was drawn from (`(token, p)` pairs
    /// summing to 1); empty when the proposals are deterministic.
    pub dists: Vec<Vec<(u32, f64)>>,
}

impl Draft {
    fn clear(&mut self) {
        self.tokens.clear();
        self.dists.clear();
    }
}

/// Prompt-lookup drafting from n-grams of the context and of remembered texts.
#[derive(Clone, Debug)]
pub struct NgramDrafter {
    /// The longest n-gram matched (tried first).
    pub max_ngram: usize,
    /// The shortest n-gram matched.
    pub min_ngram: usize,
    remembered: std::collections::VecDeque<Vec<u32>>,
    /// How many remembered texts are kept (oldest dropped first).
    pub keep: usize,
}

impl Default for NgramDrafter {
    fn default() -> Self {
        NgramDrafter {
            max_ngram: 3,
            min_ngram: 2,
            remembered: Default::default(),
            keep: 8,
        }
    }
}

impl NgramDrafter {
    /// A drafter matching n-grams of `min_ngram..=max_ngram` tokens, longest first, keeping
    /// the default 8 remembered texts.
    pub fn new(min_ngram: usize, max_ngram: usize) -> NgramDrafter {
        NgramDrafter {
            min_ngram,
            max_ngram,
            ..NgramDrafter::default()
        }
    }

    /// The continuation of the most recent earlier occurrence of `context`'s last `n` tokens
    /// inside `text` (`text` = `context` itself: the occurrence must end before the last token).
    fn lookup<'t>(pattern: &[u32], text: &'t [u32], is_context: bool) -> Option<&'t [u32]> {
        let n = pattern.len();
        let last_start = if is_context {
            // The pattern itself ends the context; an occurrence must end before it.
            text.len().checked_sub(n + 1)?
        } else {
            text.len().checked_sub(n)?
        };
        (0..=last_start)
            .rev()
            .find(|&s| &text[s..s + n] == pattern && s + n < text.len())
            .map(|s| &text[s + n..])
    }
}

impl Drafter for NgramDrafter {
    /// Adds a text (token ids) to search after the context: `pipeline run` adds each reply, so
    /// a frame's reply can draft from the previous frames' replies.
    fn remember(&mut self, tokens: &[u32]) {
        if tokens.is_empty() || self.keep == 0 {
            return;
        }
        if self.remembered.len() == self.keep {
            self.remembered.pop_front();
        }
        self.remembered.push_back(tokens.to_vec());
    }

    fn draft(&mut self, context: &[u32], k: usize, draft: &mut Draft) -> Result<(), DecodeError> {
        draft.clear();
        if k == 0 {
            return Ok(());
        }
        for n in (self.min_ngram.max(1)..=self.max_ngram).rev() {
            let Some(pattern) = context.len().checked_sub(n).map(|s| &context[s..]) else {
                continue;
            };
            let found = NgramDrafter::lookup(pattern, context, true).or_else(|| {
                self.remembered
                    .iter()
                    .rev()
                    .find_map(|t| NgramDrafter::lookup(pattern, t, false))
            });
            if let Some(next) = found {
                draft.tokens.extend(next.iter().take(k));
                return Ok(());
            }
        }
        Ok(())
    }

    fn cost_per_token(&self) -> f64 {
        0.0
    }
}

/// A smaller model with the same vocabulary, drafting greedily, or by sampling with the
/// target's settings when the target samples.
#[derive(Debug)]
pub struct ModelDrafter {
    decoder: Decoder,
    sampler: Sampler,
    /// The tokens whose K/V the draft model's cache holds.
    cached: Vec<u32>,
    logits: Vec<f32>,
    cost: f64,
}

impl ModelDrafter {
    /// A drafter over `decoder` (a model whose vocabulary is the target's), sampling with
    /// `sampling` (the target's settings; its seed is varied so the two draw independently),
    /// costing `cost_per_token` of a target step per drafted token (the ratio of the two
    /// models' streamed weight bytes is a fair estimate for bandwidth-bound decoding).
    pub fn new(
        decoder: Decoder,
        sampling: &SamplingParams,
        cost_per_token: f64,
    ) -> Result<ModelDrafter, DecodeError> {
        let params = SamplingParams {
            seed: sampling.seed ^ 0xd4af_7000_0000_0001,
            ..sampling.clone()
        };
        Ok(ModelDrafter {
            decoder,
            sampler: Sampler::new(params).map_err(|e| DecodeError::Sampling(e.to_string()))?,
            cached: Vec::new(),
            logits: Vec::new(),
            cost: cost_per_token,
        })
    }

    /// The draft model.
    pub fn decoder(&self) -> &Decoder {
        &self.decoder
    }
}

impl Drafter for ModelDrafter {
    fn draft(&mut self, context: &[u32], k: usize, draft: &mut Draft) -> Result<(), DecodeError> {
        draft.clear();
        let room = self.decoder.options().ctx.saturating_sub(context.len());
        let k = k.min(room);
        if k == 0 || context.is_empty() {
            return Ok(());
        }
        // Keep the cache's longest prefix shared with the context, less one token when the
        // whole context is cached (its logits are needed again).
        let common = self
            .cached
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count()
            .min(context.len() - 1);
        self.decoder.truncate(common)?;
        self.cached.truncate(common);
        let greedy = self.sampler.params().temperature == 0.0;
        let mut feed: Vec<u32> = context[common..].to_vec();
        // The context and the drafts so far, for the repetition penalty.
        let mut history = context.to_vec();
        for i in 0..k {
            self.decoder.forward_last_into(&feed, &mut self.logits)?;
            self.cached.extend_from_slice(&feed);
            let token = if greedy {
                self.sampler
                    .sample(&mut self.logits, &history)
                    .map_err(|e| DecodeError::Sampling(e.to_string()))?
            } else {
                let mut dist = Vec::new();
                self.sampler
                    .distribution(&mut self.logits, &history, &mut dist)
                    .map_err(|e| DecodeError::Sampling(e.to_string()))?;
                let t = self.sampler.draw(&dist);
                draft.dists.push(dist);
                t
            };
            draft.tokens.push(token);
            history.push(token);
            if i + 1 < k {
                feed.clear();
                feed.push(token);
            }
        }
        Ok(())
    }

    fn cost_per_token(&self) -> f64 {
        self.cost
    }

    fn reset(&mut self) -> Result<(), DecodeError> {
        self.decoder.reset()?;
        self.cached.clear();
        Ok(())
    }
}

/// How many tokens to draft next, from the acceptance seen so far.
#[derive(Clone, Debug)]
pub struct DraftControl {
    /// The most tokens a step drafts (`--draft-tokens`).
    pub max_tokens: usize,
    /// Extra cost of each verified row, as a fraction of a one-token decode step.
    pub row_cost: f64,
    /// Running estimate of the chance that a drafted token is accepted.
    acceptance: f64,
    /// Steps left without drafting, and the next cool-down's length.
    resting: usize,
    next_rest: usize,
}

/// The extra cost of one more verified row on the CPU NPU, relative to a one-token step:
/// SmolLM2-135M, default policy, 2 threads, 256-token context, 4.82 ms for one row and 27.03 ms
/// for 16 (`cargo bench -p benches --bench bench_main -- decode_verify`, 2026-12-01). On two
/// cores the batched linear layers are compute-bound, so rows are far from free. `generate` and
/// `run` use it on every device: the GPU backend's row cost is not measured yet, and a
/// bandwidth-bound GPU's is lower, so there it errs toward drafting too little.
pub const CPU_ROW_COST: f64 = 0.31;

impl DraftControl {
    /// A controller drafting at most `max_tokens` (clamped to [`MAX_DRAFT_TOKENS`]) per step.
    pub fn new(max_tokens: usize, row_cost: f64) -> DraftControl {
        DraftControl {
            max_tokens: max_tokens.min(MAX_DRAFT_TOKENS),
            row_cost,
            acceptance: 0.6,
            resting: 0,
            next_rest: 4,
        }
    }

    /// The estimated chance that a drafted token is accepted.
    pub fn acceptance(&self) -> f64 {
        self.acceptance
    }

    /// How many tokens to draft this step, for a drafter costing `draft_cost` per token.
    pub fn tokens(&mut self, draft_cost: f64) -> usize {
        if self.resting > 0 {
            self.resting -= 1;
            // The rest's last step probes with one token (when a draft is there to try).
            return usize::from(self.resting == 0);
        }
        let a = self.acceptance.clamp(0.0, 0.999);
        // Expected tokens per step with k drafts: 1 + a + ... + a^k (the last is the target's
        // own token), over the cost of verifying k more rows and drafting them.
        let value = |k: usize| {
            let tokens = (1.0 - a.powi(k as i32 + 1)) / (1.0 - a);
            tokens / (1.0 + (self.row_cost + draft_cost) * k as f64)
        };
        let best = (0..=self.max_tokens)
            .max_by(|&x, &y| value(x).total_cmp(&value(y)))
            .unwrap_or(0);
        if best == 0 && self.max_tokens > 0 {
            // Drafting does not pay now: rest, then probe with one token.
            self.resting = self.next_rest;
            self.next_rest = (self.next_rest * 2).min(64);
            return 0;
        }
        best
    }

    /// Records a step's outcome: `accepted` of `drafted` tokens.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        // Tokens after the first rejection were never tested; count the rejection once.
        let tested = (accepted + 1).min(drafted);
        let rate = accepted as f64 / tested as f64;
        self.acceptance = 0.7 * self.acceptance + 0.3 * rate;
        if accepted > 0 {
            self.next_rest = 4;
        }
    }
}

/// Speculative decoding's counters for one generation.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DraftStats {
    /// Decoder passes after the prompt's.
    pub steps: usize,
    /// Drafted tokens verified.
    pub drafted: usize,
    /// Drafted tokens accepted.
    pub accepted: usize,
}

impl DraftStats {
    /// Accepted over drafted (0 when nothing was drafted).
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    /// Drafted tokens per decoder pass.
    pub fn drafted_per_step(&self) -> f64 {
        self.drafted as f64 / self.steps.max(1) as f64
    }

    /// Adds another generation's counters.
    pub fn add(&mut self, other: &DraftStats) {
        self.steps += other.steps;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
    }
}

/// The verdict on one drafted token under the acceptance rule.
pub(crate) enum Verdict {
    Accept,
    /// Rejected; emit this token instead.
    Replace(u32),
}

/// The acceptance rule for draft `d` against the target distribution `p`, with `q` the draft
/// distribution it was drawn from (`None`: deterministic, one-hot on `d`). Greedy targets (`p`
/// one-hot) accept exactly the argmax.
pub(crate) fn verify(
    sampler: &mut Sampler,
    p: &[(u32, f64)],
    d: u32,
    q: Option<&[(u32, f64)]>,
) -> Verdict {
    let prob = |dist: &[(u32, f64)], t: u32| {
        dist.iter()
            .find(|&&(id, _)| id == t)
            .map_or(0.0, |&(_, x)| x)
    };
    let (pd, qd) = (prob(p, d), q.map_or(1.0, |q| prob(q, d)));
    if p.len() == 1 {
        // Greedy (or a distribution with one candidate): no coin is drawn.
        return if p[0].0 == d {
            Verdict::Accept
        } else {
            Verdict::Replace(p[0].0)
        };
    }
    if qd > 0.0 && sampler.uniform() < pd / qd {
        return Verdict::Accept;
    }
    // The residual max(0, p - q), renormalised by the draw. (q by id: both may hold the whole
    // vocabulary when top-k is off.)
    let q_by_id: std::collections::HashMap<u32, f64> =
        q.unwrap_or(&[(d, 1.0)]).iter().copied().collect();
    let residual: Vec<(u32, f64)> = p
        .iter()
        .map(|&(id, x)| (id, (x - q_by_id.get(&id).copied().unwrap_or(0.0)).max(0.0)))
        .filter(|&(_, r)| r > 0.0)
        .collect();
    if residual.is_empty() {
        // p <= q everywhere means p == q, where every draft is accepted; rounding got here.
        return Verdict::Accept;
    }
    Verdict::Replace(sampler.draw(&residual))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_takes_the_longest_most_recent_match_then_remembered_texts() {
        let mut d = NgramDrafter::new(1, 3);
        let mut draft = Draft::default();
        // "5 6" occurs twice; the later occurrence (followed by 9) wins over the earlier (7).
        d.draft(&[5, 6, 7, 1, 5, 6, 9, 2, 5, 6], 3, &mut draft)
            .unwrap();
        assert_eq!(draft.tokens, vec![9, 2, 5]);
        // The 3-gram "1 5 6" beats the more recent 2-gram "5 6".
        d.draft(&[1, 5, 6, 7, 8, 5, 6, 3, 1, 5, 6], 2, &mut draft)
            .unwrap();
        assert_eq!(draft.tokens, vec![7, 8]);
        // No match in the context: a remembered reply drafts.
        d.draft(&[40, 41, 42], 4, &mut draft).unwrap();
        assert!(draft.tokens.is_empty());
        d.remember(&[41, 42, 43, 44]);
        d.draft(&[40, 41, 42], 4, &mut draft).unwrap();
        assert_eq!(draft.tokens, vec![43, 44]);
        assert!(draft.dists.is_empty(), "lookup drafts are deterministic");
    }

    #[test]
    fn control_drafts_less_while_drafts_fail_and_probes_again() {
        let mut c = DraftControl::new(8, 0.1);
        let first = c.tokens(0.0);
        assert!(
            first > 1,
            "a fresh controller drafts several tokens, got {first}"
        );
        for _ in 0..8 {
            let k = c.tokens(0.0).max(1);
            c.record(k, 0);
        }
        // After a run of rejections it rests, then tries a single token.
        let resting: Vec<usize> = (0..80).map(|_| c.tokens(0.0)).collect();
        assert!(
            resting.iter().filter(|&&k| k == 0).count() > 40,
            "{resting:?}"
        );
        assert!(resting.iter().all(|&k| k <= 1), "{resting:?}");
        // Once drafts are accepted again it drafts more (after the rest it is in).
        for _ in 0..200 {
            let k = c.tokens(0.0);
            c.record(k, k);
        }
        assert!(c.tokens(0.0) >= 4, "acceptance {}", c.acceptance());
        // An expensive drafter drafts fewer tokens at the same acceptance.
        let fresh = || DraftControl::new(8, 0.1);
        assert!(fresh().tokens(0.3) < fresh().tokens(0.0));
    }
}
