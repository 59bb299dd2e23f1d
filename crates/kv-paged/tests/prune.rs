//! Pruning policies on scripted attention patterns, and their effect on a live block table.

use kv_paged::BlockManager;
use kv_paged::prune::{
    AttentionTracker, EntropyPages, HeavyHitters, PruneInput, PruningPolicy, SinkWindow,
    normalised_entropy,
};

/// Attention of one head over `len` tokens with `weights[t]` (normalised).
fn dist(len: usize, weight: impl Fn(usize) -> f32) -> Vec<f32> {
    let w: Vec<f32> = (0..len).map(weight).collect();
    let s: f32 = w.iter().sum();
    w.iter().map(|x| x / s).collect()
}

fn tracker(layers: &[Vec<f32>]) -> AttentionTracker {
    let mut t = AttentionTracker::new(layers.len());
    for (l, p) in layers.iter().enumerate() {
        t.observe(l, 1, p.len(), p).unwrap();
    }
    t
}

#[test]
fn sink_window_keeps_the_start_and_the_end() {
    let t = AttentionTracker::new(1);
    let input = PruneInput {
        seq: 1,
        len: 100,
        block_tokens: 16,
        attention: &t,
    };
    let r = SinkWindow {
        sink_tokens: 16,
        window_tokens: 32,
    }
    .select(&input);
    // Pages 0..6 are full (0..96); page 0 holds the sinks; 68..100 overlaps pages 4, 5 (and 6).
    assert_eq!(r.dropped, vec![1, 2, 3]);
    assert_eq!(r.policy, "sink+window");
}

#[test]
fn heavy_hitters_keep_the_heaviest_pages() {
    // Attention piles onto tokens 40..48 (page 2) and a little onto page 4.
    let p = dist(128, |t| {
        if (40..48).contains(&t) {
            50.0
        } else if (64..80).contains(&t) {
            5.0
        } else {
            1.0
        }
    });
    let t = tracker(&[p.clone(), p]);
    let input = PruneInput {
        seq: 1,
        len: 128,
        block_tokens: 16,
        attention: &t,
    };
    let r = HeavyHitters {
        budget_pages: 2,
        sink_tokens: 16,
        recent_tokens: 16,
    }
    .select(&input);
    // Candidates are pages 1..=6; the two heaviest are 2 and 4.
    assert_eq!(r.dropped, vec![1, 3, 5, 6]);
}

#[test]
fn entropy_pruning_drops_what_focused_layers_ignore() {
    let len = 96;
    // Layer 0 looks everywhere (high entropy), layer 1 only at page 2 (low entropy).
    let uniform = dist(len, |_| 1.0);
    let focused = dist(len, |t| if (32..48).contains(&t) { 1000.0 } else { 0.01 });
    assert!(normalised_entropy(&uniform) > 0.99);
    assert!(normalised_entropy(&focused) < 0.7);
    let t = tracker(&[uniform.clone(), focused]);
    let input = PruneInput {
        seq: 1,
        len,
        block_tokens: 16,
        attention: &t,
    };
    let mut policy = EntropyPages {
        entropy_threshold: 0.7,
        mass_threshold: 0.01,
        sink_tokens: 16,
        recent_tokens: 16,
        budget_pages: None,
    };
    let r = policy.select(&input);
    assert_eq!(r.dropped, vec![1, 3, 4]);
    assert!(r.reason.contains("[1]"), "{}", r.reason);
    // With every layer looking everywhere, nothing goes.
    let t = tracker(&[uniform.clone(), uniform]);
    let input = PruneInput {
        seq: 1,
        len,
        block_tokens: 16,
        attention: &t,
    };
    assert!(policy.select(&input).dropped.is_empty());
}

#[test]
fn applying_a_report_frees_pages_and_realigns_the_tracker() {
    let mut m = BlockManager::new(16, 16).unwrap();
    m.add_sequence(1, &(0..100).collect::<Vec<u32>>()).unwrap();
    let mut t = tracker(&[dist(100, |x| x as f32 + 1.0)]);
    let input = PruneInput {
        seq: 1,
        len: 100,
        block_tokens: 16,
        attention: &t,
    };
    let report = SinkWindow {
        sink_tokens: 16,
        window_tokens: 32,
    }
    .select(&input);
    let before = m.accounting().used_blocks;
    let freed = kv_paged::prune::apply(&mut m, &mut t, &report).unwrap();
    assert_eq!(freed, vec![3, 2, 1]);
    assert_eq!(m.accounting().used_blocks, before - 3);
    assert_eq!(m.len(1).unwrap(), 100 - 48);
    assert_eq!(t.mass[0].len(), 100 - 48);
    m.check_invariants().unwrap();
}

#[test]
fn budgeted_entropy_keeps_the_pages_focused_layers_attend_to() {
    use kv_paged::prune::{AttentionTracker, EntropyPages, PruneInput, PruningPolicy};
    // Two layers over 6 pages of 4 tokens: layer 0 attends evenly (no say), layer 1 focuses on
    // page 3, then page 1.
    let mut t = AttentionTracker::new(2);
    let even = vec![1.0 / 24.0; 24];
    let mut focused = vec![0.0; 24];
    focused[13] = 0.7;
    focused[5] = 0.3;
    t.accumulate(0, 1, &even, &even).unwrap();
    t.accumulate(1, 1, &focused, &focused).unwrap();
    let input = PruneInput {
        seq: 1,
        len: 24,
        block_tokens: 4,
        attention: &t,
    };
    let mut policy = EntropyPages {
        entropy_threshold: 1.0,
        mass_threshold: 0.0,
        sink_tokens: 4,
        recent_tokens: 4,
        budget_pages: Some(2),
    };
    // Candidates are pages 1..=4 (page 0 sinks, page 5 recent); pages 3 and 1 stay.
    assert_eq!(policy.select(&input).dropped, vec![2, 4]);
    t.truncate(10);
    assert!(
        t.mass
            .iter()
            .chain(&t.last)
            .chain(&t.seen)
            .all(|v| v.len() == 10)
    );
}
