//! KV pruning in the decoder (`--kv-budget`, `--prune`), on the tiny LLaMA fixture: the cache
//! stays within its budget under every policy while positions go on, pages are dropped and
//! counted, a budget that is never reached changes no bit, and a budget too small is refused.

use std::path::PathBuf;

use kv_paged::PageDtype;
use pipeline::decoder::{Decoder, DecoderOptions, PrunePolicy, Pruning, WeightPolicy};

fn open(ctx: usize) -> Decoder {
    let options = DecoderOptions {
        policy: WeightPolicy::parse("default").unwrap(),
        ctx,
        max_batch: 64,
        max_logit_rows: 4,
        kv_dtype: PageDtype::F16,
        cache: None,
    };
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-llama/tiny.gguf");
    pipeline::llm::open_decoder(&path, options, 2).unwrap().0
}

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 1 + (i * 37 + i / 7) % 300).collect()
}

#[test]
fn every_policy_keeps_the_cache_within_its_budget() {
    for policy in [
        PrunePolicy::Sinks,
        PrunePolicy::HeavyHitters,
        PrunePolicy::Entropy,
    ] {
        let mut d = open(256);
        d.set_pruning(Some(Pruning { budget: 96, policy })).unwrap();
        d.reset().unwrap();
        let text = tokens(240);
        // A prompt past the budget, then one token at a time.
        d.forward_last(&text[..150]).unwrap();
        for &t in &text[150..] {
            let logits = d.forward_last(&[t]).unwrap();
            assert!(logits.iter().all(|x| x.is_finite()), "{policy:?}");
            let cached = d
                .kv()
                .manager()
                .len(d.kv().manager().sequences().next().unwrap())
                .unwrap();
            assert!(
                cached <= 96,
                "{policy:?}: {cached} tokens cached, budget 96"
            );
        }
        assert_eq!(d.len(), 240, "positions go on counting");
        assert!(
            d.pages_pruned() >= (240 - 96) as u64 / 16,
            "{policy:?}: {} pages",
            d.pages_pruned()
        );
        d.kv().manager().check_invariants().unwrap();
    }
}

#[test]
fn a_budget_never_reached_changes_no_bit() {
    let text = tokens(100);
    let mut plain = open(128);
    let mut budgeted = open(128);
    budgeted
        .set_pruning(Some(Pruning {
            budget: 128,
            policy: PrunePolicy::HeavyHitters,
        }))
        .unwrap();
    let mut a = Vec::new();
    let mut b = Vec::new();
    plain
        .forward(&text, 0..100, |_, l| a.extend_from_slice(l))
        .unwrap();
    budgeted
        .forward(&text, 0..100, |_, l| b.extend_from_slice(l))
        .unwrap();
    assert_eq!(budgeted.pages_pruned(), 0);
    assert!(
        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
        "a budget that never prunes changed the logits (its smaller steps must not)"
    );
}

#[test]
fn budgets_too_small_or_past_the_context_are_refused() {
    let mut d = open(128);
    for budget in [0, 63, 129] {
        let err = d
            .set_pruning(Some(Pruning {
                budget,
                policy: PrunePolicy::Sinks,
            }))
            .unwrap_err();
        assert!(err.to_string().contains("KV budget"), "{err}");
    }
    assert!("lru".parse::<PrunePolicy>().is_err());
}
