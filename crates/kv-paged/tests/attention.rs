//! Paged attention against a dense f64 reference, for every page dtype and GQA ratio: decode
//! (one thread and several), causal prefill, copy-on-write of written pages, and the error each
//! dtype's storage adds (measured against exact f32 K/V).

use kv_paged::attention::{contiguous_decode, decode, default_scale, prefill};
use kv_paged::{KvCache, KvLayout, PageDtype};

/// xorshift64* values in [-1, 1).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// Dense attention in f64 for one query head over `len` tokens of `k`/`v` (`[t][head_dim]`).
fn reference(q: &[f32], k: &[f32], v: &[f32], len: usize, hd: usize) -> Vec<f64> {
    let scale = f64::from(default_scale(hd));
    let scores: Vec<f64> = (0..len)
        .map(|t| {
            q.iter()
                .zip(&k[t * hd..(t + 1) * hd])
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum::<f64>()
                * scale
        })
        .collect();
    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    let mut out = vec![0f64; hd];
    for t in 0..len {
        for (o, x) in out.iter_mut().zip(&v[t * hd..(t + 1) * hd]) {
            *o += e[t] / sum * f64::from(*x);
        }
    }
    out
}

/// Attention output is a convex combination of V rows, so absolute errors are compared with
/// V's magnitude (about 1 here). The kernel sums in f32: a few hundred terms, each rounded.
const F32_KERNEL_TOLERANCE: f64 = 2e-4;

struct Setup {
    cache: KvCache,
    /// Exact K and V as written: `[layer][t][kv_head][head_dim]`.
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

fn setup(dtype: PageDtype, kv_heads: usize, len: usize) -> Setup {
    let layout = KvLayout {
        layers: 2,
        kv_heads,
        head_dim: 64,
        block_tokens: 16,
        dtype,
    };
    let mut cache = KvCache::new(layout, 64, None).unwrap();
    let prompt: Vec<u32> = (0..len as u32).collect();
    let slots = cache.add_sequence(1, &prompt).unwrap().slots;
    let mut rng = Rng(7 + kv_heads as u64);
    let n = kv_heads * 64;
    let (mut k, mut v) = (vec![Vec::new(); 2], vec![Vec::new(); 2]);
    for layer in 0..2 {
        for slot in &slots {
            let (kt, vt) = (rng.vec(n), rng.vec(n));
            cache.write(layer, *slot, &kt, &vt).unwrap();
            k[layer].extend(kt);
            v[layer].extend(vt);
        }
    }
    Setup { cache, k, v }
}

fn head_rows(all: &[f32], kv_heads: usize, g: usize, len: usize) -> Vec<f32> {
    (0..len)
        .flat_map(|t| {
            all[(t * kv_heads + g) * 64..(t * kv_heads + g + 1) * 64]
                .iter()
                .copied()
        })
        .collect()
}

#[test]
fn decode_matches_reference_for_every_dtype_and_gqa_ratio() {
    for dtype in PageDtype::ALL {
        for (q_heads, kv_heads) in [(3, 3), (9, 3), (4, 1)] {
            let len = 150;
            let s = setup(dtype, kv_heads, len);
            let q = Rng(99).vec(q_heads * 64);
            for threads in [1, 2, 3] {
                let mut out = vec![0f32; q_heads * 64];
                decode(&s.cache, 1, 1, q_heads, &q, &mut out, threads, None).unwrap();
                let (mut kg, mut vg) = (Vec::new(), Vec::new());
                for h in 0..q_heads {
                    let g = h / (q_heads / kv_heads);
                    // Against the values the pages hold (dequantized): kernel error only.
                    s.cache.gather(1, 1, g, false, &mut kg).unwrap();
                    s.cache.gather(1, 1, g, true, &mut vg).unwrap();
                    let want = reference(&q[h * 64..(h + 1) * 64], &kg, &vg, len, 64);
                    for (i, (o, w)) in out[h * 64..(h + 1) * 64].iter().zip(&want).enumerate() {
                        assert!(
                            (f64::from(*o) - w).abs() <= F32_KERNEL_TOLERANCE,
                            "{dtype:?} q{q_heads}/kv{kv_heads} {threads}t head {h} [{i}]: {o} vs {w}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn prefill_is_causal_and_matches_reference() {
    for dtype in [PageDtype::F32, PageDtype::Mxfp8] {
        let (q_heads, kv_heads, len) = (6, 3, 70);
        let s = setup(dtype, kv_heads, len);
        let n = 20;
        let first = len - n;
        let q = Rng(5).vec(n * q_heads * 64);
        let mut out = vec![0f32; q.len()];
        prefill(&s.cache, 1, 0, q_heads, first, &q, &mut out).unwrap();
        let (mut kg, mut vg) = (Vec::new(), Vec::new());
        for i in 0..n {
            for h in 0..q_heads {
                let g = h / 2;
                s.cache.gather(1, 0, g, false, &mut kg).unwrap();
                s.cache.gather(1, 0, g, true, &mut vg).unwrap();
                let off = (i * q_heads + h) * 64;
                let want = reference(&q[off..off + 64], &kg, &vg, first + i + 1, 64);
                for (o, w) in out[off..off + 64].iter().zip(&want) {
                    assert!(
                        (f64::from(*o) - w).abs() <= F32_KERNEL_TOLERANCE,
                        "{dtype:?} query {i} head {h}"
                    );
                }
            }
        }
    }
}

#[test]
fn storage_error_per_dtype_is_measured() {
    // Output error of each dtype against exact f32 K/V: RMS over all heads of layer 0.
    let (q_heads, kv_heads, len) = (9, 3, 200);
    let q = Rng(11).vec(q_heads * 64);
    let mut rms = Vec::new();
    for dtype in PageDtype::ALL {
        let s = setup(dtype, kv_heads, len);
        let mut out = vec![0f32; q_heads * 64];
        decode(&s.cache, 1, 0, q_heads, &q, &mut out, 1, None).unwrap();
        let mut err2 = 0.0;
        for h in 0..q_heads {
            let g = h / 3;
            let want = reference(
                &q[h * 64..(h + 1) * 64],
                &head_rows(&s.k[0], kv_heads, g, len),
                &head_rows(&s.v[0], kv_heads, g, len),
                len,
                64,
            );
            err2 += out[h * 64..(h + 1) * 64]
                .iter()
                .zip(&want)
                .map(|(o, w)| (f64::from(*o) - w).powi(2))
                .sum::<f64>();
        }
        let e = (err2 / (q_heads * 64) as f64).sqrt();
        eprintln!(
            "{dtype:?}: {:.1} bytes/token, attention output RMS error {e:.2e}",
            s.cache.bytes_per_token()
        );
        rms.push((dtype, e, s.cache.bytes_per_token()));
    }
    let get = |d: PageDtype| *rms.iter().find(|r| r.0 == d).unwrap();
    assert!(get(PageDtype::F32).1 < 1e-5);
    assert!(get(PageDtype::F16).1 < get(PageDtype::Bf16).1);
    assert!(get(PageDtype::Mxfp8).1 < get(PageDtype::Mxfp4).1);
    // MXFP8 pages hold 8.25 bits per value against f16's 16: about half the bytes.
    let ratio = get(PageDtype::Mxfp8).2 / get(PageDtype::F16).2;
    assert!(
        (ratio - 8.25 / 16.0).abs() < 1e-9,
        "MXFP8/F16 bytes {ratio}"
    );
}

#[test]
fn copy_on_write_copies_the_written_page() {
    let s = setup(PageDtype::F32, 3, 40);
    let mut cache = s.cache;
    cache.fork(1, 2).unwrap();
    let slot = cache.append(2, &[7]).unwrap().slots[0];
    let (mut parent, mut child) = (Vec::new(), Vec::new());
    cache.gather(1, 0, 1, false, &mut parent).unwrap();
    cache.gather(2, 0, 1, false, &mut child).unwrap();
    // The child's copy of the shared partial page holds the parent's 40 tokens.
    assert_eq!(&child[..40 * 64], &parent[..]);
    assert_ne!(cache.manager().block_table(1).unwrap()[2], slot.block);
}

#[test]
fn paged_decode_equals_contiguous_decode() {
    let (q_heads, kv_heads, len) = (9, 3, 300);
    let s = setup(PageDtype::F32, kv_heads, len);
    let q = Rng(3).vec(q_heads * 64);
    let mut paged = vec![0f32; q_heads * 64];
    decode(&s.cache, 1, 0, q_heads, &q, &mut paged, 1, None).unwrap();
    let mut contiguous = vec![0f32; q_heads * 64];
    contiguous_decode(
        &s.k[0],
        &s.v[0],
        len,
        kv_heads,
        64,
        q_heads,
        &q,
        &mut contiguous,
    );
    // Same arithmetic in the same order: bit for bit.
    assert_eq!(paged, contiguous);
}

#[test]
fn decode_returns_probabilities_a_tracker_accepts() {
    let (q_heads, kv_heads, len) = (9, 3, 90);
    let s = setup(PageDtype::Bf16, kv_heads, len);
    let q = Rng(8).vec(q_heads * 64);
    let mut out = vec![0f32; q_heads * 64];
    for threads in [1, 2] {
        let mut probs = Vec::new();
        decode(
            &s.cache,
            1,
            0,
            q_heads,
            &q,
            &mut out,
            threads,
            Some(&mut probs),
        )
        .unwrap();
        assert_eq!(probs.len(), q_heads * len);
        for head in probs.chunks_exact(len) {
            assert!((head.iter().sum::<f32>() - 1.0).abs() < 1e-4);
        }
        let mut tracker = kv_paged::prune::AttentionTracker::new(2);
        tracker.observe(0, q_heads, len, &probs).unwrap();
        assert!((tracker.mass[0].iter().sum::<f32>() - q_heads as f32).abs() < 1e-3);
    }
}

#[test]
fn a_batch_of_queries_gets_the_bits_each_gets_alone() {
    use kv_paged::attention::{decode_heads, decode_queries};
    for dtype in [PageDtype::F16, PageDtype::Mxfp8] {
        let (q_heads, kv_heads, n, len) = (6, 2, 5, 37);
        let mut s = setup(dtype, kv_heads, len);
        let mut rng = Rng(99);
        let stride = q_heads * 64;
        let q = rng.vec(n * stride);
        let heads = 1..5;
        let mut batch = vec![vec![0f32; heads.len() * 64]; n];
        let mut rows: Vec<&mut [f32]> = batch.iter_mut().map(Vec::as_mut_slice).collect();
        decode_queries(
            &s.cache,
            1,
            1,
            q_heads,
            heads.clone(),
            len - n,
            &q,
            &mut rows,
            None,
        )
        .unwrap();
        // The same queries one at a time, each with the cache cut after its own token.
        for i in (0..n).rev() {
            s.cache.truncate(1, len - n + i + 1).unwrap();
            let mut alone = vec![0f32; heads.len() * 64];
            decode_heads(
                &s.cache,
                1,
                1,
                q_heads,
                heads.clone(),
                &q[i * stride..(i + 1) * stride],
                &mut alone,
            )
            .unwrap();
            assert!(
                alone
                    .iter()
                    .zip(&batch[i])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{dtype:?}: query {i} differs from its batched result"
            );
        }
    }
}
