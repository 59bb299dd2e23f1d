//! Token sampling from logits: repetition penalty, then greedy (temperature 0) or top-k, top-p
//! and temperature followed by a seeded draw, in llama.cpp's default order so the same settings
//! mean the same thing in both.

/// Sampling settings.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `top_p` (1.0 = all).
    pub top_p: f32,
    /// Divides positive and multiplies negative logits of recently seen tokens (1.0 = off).
    pub repetition_penalty: f32,
    /// How many of the most recent tokens the penalty looks at.
    pub penalty_window: usize,
    /// Seed of the draw.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 40,
            top_p: 0.95,
            repetition_penalty: 1.0,
            penalty_window: 64,
            seed: 0x5eed,
        }
    }
}

/// Why sampling failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SamplingError {
    #[error("the logits are empty or all NaN: the model produced no usable distribution")]
    NoCandidates,
    #[error("invalid sampling setting: {0}")]
    BadParam(&'static str),
}

/// A sampler with its own random state, so a seed reproduces a generation.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
    candidates: Vec<(f32, u32)>,
    /// [`Sampler::sample`]'s distribution, kept to reuse its allocation.
    dist: Vec<(u32, f64)>,
}

impl Sampler {
    /// Checks `params` and seeds the generator.
    pub fn new(params: SamplingParams) -> Result<Sampler, SamplingError> {
        if !(params.temperature >= 0.0 && params.temperature.is_finite()) {
            return Err(SamplingError::BadParam(
                "temperature must be finite and >= 0",
            ));
        }
        if !(params.top_p > 0.0 && params.top_p <= 1.0) {
            return Err(SamplingError::BadParam("top_p must be in (0, 1]"));
        }
        if !(params.repetition_penalty > 0.0 && params.repetition_penalty.is_finite()) {
            return Err(SamplingError::BadParam(
                "repetition_penalty must be finite and > 0",
            ));
        }
        Ok(Sampler {
            rng: SplitMix64(params.seed),
            params,
            candidates: Vec::new(),
            dist: Vec::new(),
        })
    }

    /// The settings.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits` (modified in place by the penalty) given the tokens so
    /// far in `history`.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> Result<u32, SamplingError> {
        if self.params.temperature == 0.0 {
            self.penalise(logits, history);
            return crate::kernels::argmax(logits)
                .map(|(i, _)| i as u32)
                .ok_or(SamplingError::NoCandidates);
        }
        let mut dist = std::mem::take(&mut self.dist);
        let picked = self
            .distribution(logits, history, &mut dist)
            .map(|()| self.draw(&dist));
        self.dist = dist;
        picked
    }

    /// The distribution [`Sampler::sample`] draws from, into `out`: `(token, probability)` pairs,
    /// most likely first, probabilities summing to 1, after the penalty, top-k, top-p and
    /// temperature. Greedy settings give the argmax with probability 1. Speculative decoding's
    /// acceptance rule compares these between the target and the draft.
    pub fn distribution(
        &mut self,
        logits: &mut [f32],
        history: &[u32],
        out: &mut Vec<(u32, f64)>,
    ) -> Result<(), SamplingError> {
        self.penalise(logits, history);
        let p = &self.params;
        out.clear();
        if p.temperature == 0.0 {
            let (i, _) = crate::kernels::argmax(logits).ok_or(SamplingError::NoCandidates)?;
            out.push((i as u32, 1.0));
            return Ok(());
        }
        let c = &mut self.candidates;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, l)| !l.is_nan())
                .map(|(i, &l)| (l, i as u32)),
        );
        if c.is_empty() {
            return Err(SamplingError::NoCandidates);
        }
        let by_logit = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        let k = if p.top_k == 0 {
            c.len()
        } else {
            p.top_k.min(c.len())
        };
        if k < c.len() {
            c.select_nth_unstable_by(k - 1, by_logit);
            c.truncate(k);
        }
        c.sort_unstable_by(by_logit);
        // Softmax at temperature 1 for top-p (as llama.cpp does), then temperature.
        let max = c[0].0;
        let total: f64 = c.iter().map(|&(l, _)| f64::from(l - max).exp()).sum();
        let mut keep = c.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, &(l, _)) in c.iter().enumerate() {
                cum += f64::from(l - max).exp() / total;
                if cum >= f64::from(p.top_p) {
                    keep = i + 1;
                    break;
                }
            }
        }
        let inv_t = 1.0 / f64::from(p.temperature);
        out.extend(
            c[..keep]
                .iter()
                .map(|&(l, id)| (id, (f64::from(l - max) * inv_t).exp())),
        );
        let total: f64 = out.iter().map(|&(_, q)| q).sum();
        for (_, q) in out.iter_mut() {
            *q /= total;
        }
        Ok(())
    }

    /// Draws a token from `dist` (as [`Sampler::distribution`] makes it), using one uniform draw
    /// of this sampler's generator. An empty distribution gives token 0.
    pub fn draw(&mut self, dist: &[(u32, f64)]) -> u32 {
        let total: f64 = dist.iter().map(|&(_, q)| q).sum();
        let mut r = self.uniform() * total;
        for &(id, q) in dist {
            r -= q;
            if r <= 0.0 {
                return id;
            }
        }
        dist.last().map_or(0, |&(id, _)| id)
    }

    /// A uniform draw in `[0, 1)` from this sampler's generator (an acceptance test's coin).
    pub fn uniform(&mut self) -> f64 {
        self.rng.next_f64()
    }

    /// The repetition penalty, applied to `logits` in place.
    fn penalise(&self, logits: &mut [f32], history: &[u32]) {
        let p = &self.params;
        if p.repetition_penalty == 1.0 {
            return;
        }
        let start = history.len().saturating_sub(p.penalty_window);
        let mut seen: Vec<u32> = history[start..].to_vec();
        seen.sort_unstable();
        seen.dedup();
        for &t in &seen {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = if *l > 0.0 {
                    *l / p.repetition_penalty
                } else {
                    *l * p.repetition_penalty
                };
            }
        }
    }
}

/// SplitMix64 (Steele, Lea, Flood 2014): a tiny, fast, well-distributed generator; sampling
/// needs reproducibility, not cryptographic strength.
#[derive(Clone, Debug)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_argmax_after_the_penalty() {
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        assert_eq!(s.sample(&mut [0.1, 2.0, 1.9], &[]).unwrap(), 1);
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 1.1,
            ..SamplingParams::default()
        })
        .unwrap();
        assert_eq!(s.sample(&mut [0.1, 2.0, 1.9], &[1]).unwrap(), 2);
    }

    #[test]
    fn top_k_one_is_greedy_and_seeds_reproduce() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 100) as f32 / 10.0).collect();
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 1,
            ..SamplingParams::default()
        })
        .unwrap();
        let best = crate::kernels::argmax(&logits).unwrap().0 as u32;
        assert_eq!(s.sample(&mut logits.clone(), &[]).unwrap(), best);
        let params = SamplingParams {
            temperature: 0.8,
            top_k: 0,
            top_p: 1.0,
            ..SamplingParams::default()
        };
        let draw = |seed| {
            let mut s = Sampler::new(SamplingParams {
                seed,
                ..params.clone()
            })
            .unwrap();
            (0..20)
                .map(|_| s.sample(&mut logits.clone(), &[]).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn draws_follow_the_distribution() {
        // Two tokens with probabilities 0.75 / 0.25 at temperature 1.
        let logits = [3f32.ln(), 0.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            ..SamplingParams::default()
        })
        .unwrap();
        let n = 20_000;
        let zeros = (0..n)
            .filter(|_| s.sample(&mut logits.clone(), &[]).unwrap() == 0)
            .count();
        let share = zeros as f64 / f64::from(n);
        assert!((share - 0.75).abs() < 0.02, "{share}");
    }

    #[test]
    fn top_p_cuts_the_tail() {
        let logits = [10.0f32, 0.0, 0.0, 0.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 5.0,
            top_k: 0,
            top_p: 0.9,
            ..SamplingParams::default()
        })
        .unwrap();
        for _ in 0..200 {
            assert_eq!(s.sample(&mut logits.clone(), &[]).unwrap(), 0);
        }
    }

    #[test]
    fn bad_settings_and_nan_logits_are_errors() {
        assert!(
            Sampler::new(SamplingParams {
                temperature: -1.0,
                ..SamplingParams::default()
            })
            .is_err()
        );
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        assert_eq!(
            s.sample(&mut [f32::NAN], &[]),
            Err(SamplingError::NoCandidates)
        );
    }
}
