//! Speculative decoding on the tiny LLaMA fixture (fixtures/tiny-llama): greedy output token for
//! token equal to plain decoding, with n-gram and model drafts, under exact and MX policies; and
//! sampled output with the target's distribution (chi-square against the exact distribution,
//! enumerated from the model's own probabilities).

use std::path::PathBuf;

use kv_paged::PageDtype;
use npu_hal::sampling::{Sampler, SamplingParams};
use pipeline::decoder::{Decoder, DecoderOptions, WeightPolicy};
use pipeline::speculative::{DraftControl, Drafter, ModelDrafter, NgramDrafter};

mod common;
use common::generate_ids;

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/tiny-llama")
        .join(rel)
}

fn open(model: &str, policy: &str) -> Decoder {
    let options = DecoderOptions {
        policy: WeightPolicy::parse(policy).unwrap(),
        ctx: 128,
        max_batch: 128,
        max_logit_rows: 16,
        kv_dtype: PageDtype::F16,
        cache: None,
    };
    pipeline::llm::open_decoder(&fixture(model), options, 2)
        .unwrap()
        .0
}

/// Prompts with repeats for the n-gram drafter to find, and one without.
fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![1, 17, 42, 99, 17, 42, 99, 17, 42],
        (0..24).map(|i| 1 + (i * 7) % 31).collect(),
        vec![1, 250, 3, 77, 140, 5],
    ]
}

#[test]
fn greedy_output_is_plain_greedy_token_for_token() {
    let greedy = SamplingParams::default();
    for policy in ["exact-f32", "default", "fp4"] {
        let mut target = open("tiny.gguf", policy);
        let mut ngram = NgramDrafter::default();
        let draft_decoder = open("draft-1layer.gguf", policy);
        let mut model = ModelDrafter::new(draft_decoder, &greedy, 0.0).unwrap();
        let (mut drafted, mut accepted) = (0, 0);
        for prompt in prompts() {
            let (plain, _) = generate_ids(&mut target, &prompt, 60, &greedy, None);
            let drafters: [&mut dyn Drafter; 2] = [&mut ngram, &mut model];
            for (name, drafter) in ["ngram", "model"].into_iter().zip(drafters) {
                for k in [1, 4, 15] {
                    let control = DraftControl::new(k, 0.0);
                    let (spec, stats) =
                        generate_ids(&mut target, &prompt, 60, &greedy, Some((drafter, control)));
                    assert_eq!(
                        spec, plain,
                        "{policy}, {name} drafts, k = {k}, prompt {prompt:?}"
                    );
                    drafted += stats.draft.drafted;
                    accepted += stats.draft.accepted;
                }
            }
        }
        // The comparison means something only if drafts were both kept and rolled back.
        assert!(
            accepted > 0 && accepted < drafted,
            "{policy}: {accepted} of {drafted} drafts accepted"
        );
    }
}

/// The probability of each token `sampling` gives after `context`, exactly.
fn next_distribution(d: &mut Decoder, context: &[u32], sampling: &SamplingParams) -> Vec<f64> {
    d.reset().unwrap();
    let mut logits = d.forward_last(context).unwrap();
    let mut dist = Vec::new();
    Sampler::new(sampling.clone())
        .unwrap()
        .distribution(&mut logits, context, &mut dist)
        .unwrap();
    let mut p = vec![0f64; d.config().vocab_size];
    for (t, q) in dist {
        p[t as usize] = q;
    }
    p
}

/// Pearson's chi-square of `counts` against `probs` (bins expecting fewer than 5 are pooled),
/// and its degrees of freedom.
fn chi_square(counts: &[usize], probs: &[f64], n: usize) -> (f64, usize) {
    let (mut stat, mut bins, mut pooled_o, mut pooled_e) = (0.0, 0, 0.0, 0.0);
    for (&o, &p) in counts.iter().zip(probs) {
        let e = p * n as f64;
        if e < 5.0 {
            pooled_o += o as f64;
            pooled_e += e;
        } else {
            stat += (o as f64 - e).powi(2) / e;
            bins += 1;
        }
    }
    if pooled_e > 0.0 {
        stat += (pooled_o - pooled_e).powi(2) / pooled_e.max(1.0);
        bins += 1;
    }
    (stat, bins - 1)
}

/// The 0.9999 quantile of chi-square with `df` degrees of freedom (Wilson-Hilferty).
fn chi_square_quantile_9999(df: usize) -> f64 {
    let k = df.max(1) as f64;
    let z = 3.719; // the standard normal's 0.9999 quantile
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

#[test]
fn sampled_output_keeps_the_target_distribution() {
    let sampling = SamplingParams {
        temperature: 1.0,
        top_k: 4,
        top_p: 1.0,
        ..SamplingParams::default()
    };
    let prompt = [1u32, 17, 42, 99, 17, 42];
    let mut target = open("tiny.gguf", "exact-f32");
    let vocab = target.config().vocab_size;
    // The exact distributions of the second and third tokens, from the model's conditionals.
    let p1 = next_distribution(&mut target, &prompt, &sampling);
    let (mut p2, mut p3) = (vec![0f64; vocab], vec![0f64; vocab]);
    for t1 in (0..vocab).filter(|&t| p1[t] > 0.0) {
        let c1: Vec<u32> = prompt.iter().copied().chain([t1 as u32]).collect();
        let q2 = next_distribution(&mut target, &c1, &sampling);
        for t2 in (0..vocab).filter(|&t| q2[t] > 0.0) {
            p2[t2] += p1[t1] * q2[t2];
            let c2: Vec<u32> = c1.iter().copied().chain([t2 as u32]).collect();
            let q3 = next_distribution(&mut target, &c2, &sampling);
            for t3 in 0..vocab {
                p3[t3] += p1[t1] * q2[t2] * q3[t3];
            }
        }
    }
    // The same model in MXFP4: a draft distribution close to the target's but not equal, so
    // drafts are often accepted and the rejections' residual draws matter. (The 1-layer
    // fixture's top 4 hardly meets the target's.)
    let draft_decoder = open("tiny.gguf", "fp4");
    let mut model = ModelDrafter::new(draft_decoder, &sampling, 0.0).unwrap();
    // Lookup drafts from a remembered text that pairs each possible first token with the
    // target's likeliest successor, so deterministic drafts are often right, and often not.
    let mut ngram = NgramDrafter::new(1, 1);
    let mut pairs = Vec::new();
    for t1 in (0..vocab).filter(|&t| p1[t] > 0.0) {
        let c1: Vec<u32> = prompt.iter().copied().chain([t1 as u32]).collect();
        let q2 = next_distribution(&mut target, &c1, &sampling);
        let likeliest = (0..vocab).max_by(|&a, &b| q2[a].total_cmp(&q2[b])).unwrap();
        pairs.extend([t1 as u32, likeliest as u32]);
    }
    ngram.remember(&pairs);
    let drafters: [&mut dyn Drafter; 2] = [&mut model, &mut ngram];
    const RUNS: usize = 3000;
    for (name, drafter) in ["model", "ngram"].into_iter().zip(drafters) {
        let (mut c2, mut c3) = (vec![0usize; vocab], vec![0usize; vocab]);
        let (mut drafted, mut accepted) = (0, 0);
        for seed in 0..RUNS as u64 {
            let s = SamplingParams {
                seed,
                ..sampling.clone()
            };
            let control = DraftControl::new(2, 0.0);
            let (out, stats) =
                generate_ids(&mut target, &prompt, 3, &s, Some((&mut *drafter, control)));
            c2[out[1] as usize] += 1;
            c3[out[2] as usize] += 1;
            drafted += stats.draft.drafted;
            accepted += stats.draft.accepted;
        }
        assert!(
            accepted > RUNS / 10 && accepted < drafted,
            "{name}: {accepted} of {drafted} drafts accepted: the rule was hardly exercised"
        );
        // Sensitivity, measured by breaking the rule on purpose: accepting lookup drafts with
        // twice the right probability gives the second token a chi-square of 775 on 10 degrees
        // of freedom, and redrawing from p without removing the rejected draft gives 326.
        for (which, counts, probs) in [("second", &c2, &p2), ("third", &c3, &p3)] {
            let (stat, df) = chi_square(counts, probs, RUNS);
            let limit = chi_square_quantile_9999(df);
            assert!(
                stat < limit,
                "{name} drafts: the {which} token's chi-square is {stat:.1} on {df} degrees of \
                 freedom, past the 0.9999 quantile {limit:.1}"
            );
        }
    }
}
