//! Causal grouped-query attention over a paged KV cache, split over the CPU NPU's pool, in two
//! numerics:
//!
//! - [`Numerics::Standard`]: scores, softmax and the weighted sum of V in f32 (kv-paged's
//!   kernels; decode streams K/V page by page).
//! - [`Numerics::Ggml`]: what ggml's CPU flash attention computes in the named build's order
//!   (and an NPU with f16 accumulators would): the query rounded to f16, f32 dot products of
//!   f16 values, an online softmax, and the V accumulator held in f16 and rounded after every
//!   update, divided by the softmax sum at the end. It exists so a model run here can reproduce llama.cpp's logits (the
//!   `exact` weight policy), not because it is more accurate: it is less.
//!
//! Work is split by query head: each pool part owns a contiguous head range, gathers the K/V of
//! the groups those heads read once per op, and writes only its heads' slices of every output row.

use std::ops::Range;
use std::sync::Mutex;

use half::f16;
use kv_paged::{KvCache, SeqId};

use crate::Error;
use crate::kernels::{GgmlBuild, Numerics};
use crate::pool::{WorkerPool, share};

/// Batches of at most this many queries (a decode step, a speculative verification) are
/// computed by kv-paged's streaming decode kernel, which gives each query the bits it would get
/// alone; longer ones (prefill) gather each group's K/V once and use [`attend_f32`].
pub(crate) const STREAMED_QUERIES: usize = 16;

/// Attention for the last `n = q.len() / (q_heads * head_dim)` tokens of `seq`, whose K/V are
/// already in the cache: query `i` sees the cache's tokens up to and including its own. Indices
/// are the cache's, not positions: once pruning has dropped pages the two differ (RoPE keeps
/// the positions). `out` has `q`'s shape. With `stats`, the probabilities every cached token
/// received (summed over heads and queries, and the last query's averaged over heads) are added
/// to the tracker for `layer`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend(
    pool: &WorkerPool,
    kv: &KvCache,
    seq: SeqId,
    layer: usize,
    q_heads: usize,
    q: &[f32],
    out: &mut [f32],
    numerics: Numerics,
    stats: Option<&mut kv_paged::prune::AttentionTracker>,
) -> Result<(), Error> {
    let l = *kv.layout();
    let hd = l.head_dim;
    let stride = q_heads * hd;
    let n = q.len() / stride;
    let len = kv.manager().len(seq)?;
    // The cache index of the first query's token.
    let first_pos = len.checked_sub(n).ok_or_else(|| Error::BadOp {
        op: 0,
        what: format!("attention over {n} queries of a sequence with fewer cached tokens"),
    })?;
    let parts = pool.threads().min(q_heads).max(1);
    let spans: Vec<Range<usize>> = (0..pool.threads())
        .map(|p| {
            if p < parts {
                share(p, parts, q_heads, 1)
            } else {
                0..0
            }
        })
        .collect();
    // Per part, its heads' slice of every output row.
    let mut per_part: Vec<Mutex<Vec<&mut [f32]>>> = spans
        .iter()
        .map(|_| Mutex::new(Vec::with_capacity(n)))
        .collect();
    for row in out.chunks_exact_mut(stride) {
        let mut rest = row;
        for (span, part) in spans.iter().zip(per_part.iter_mut()) {
            let (mine, tail) = rest.split_at_mut(span.len() * hd);
            part.get_mut().unwrap_or_else(|e| e.into_inner()).push(mine);
            rest = tail;
        }
    }
    // Per part, when asked: the mass each token received from its heads over every query, and
    // from its heads for the last query.
    let want_stats = stats.is_some();
    let sums: Vec<Mutex<(Vec<f32>, Vec<f32>)>> = spans
        .iter()
        .map(|_| {
            let size = if want_stats { len } else { 0 };
            Mutex::new((vec![0f32; size], vec![0f32; size]))
        })
        .collect();
    let streamed = n <= STREAMED_QUERIES && numerics == Numerics::Standard;
    let result = if streamed {
        // Decode and verification batches: stream the pages, no gather, each query exactly
        // as it would be alone.
        run_parts(pool, &spans, |p, span| {
            let mut rows = per_part[p].lock().unwrap_or_else(|e| e.into_inner());
            let mut probs = vec![0f32; if want_stats { n * span.len() * len } else { 0 }];
            kv_paged::attention::decode_queries(
                kv,
                seq,
                layer,
                q_heads,
                span.clone(),
                first_pos,
                q,
                &mut rows,
                want_stats.then_some(&mut probs[..]),
            )?;
            if want_stats {
                let mut guard = sums[p].lock().unwrap_or_else(|e| e.into_inner());
                let (mass, last) = &mut *guard;
                for (row, per_head) in probs.chunks_exact(len).enumerate() {
                    let is_last = row / span.len().max(1) == n - 1;
                    for (t, &x) in per_head.iter().enumerate() {
                        mass[t] += x;
                        if is_last {
                            last[t] += x;
                        }
                    }
                }
            }
            Ok(())
        })
    } else {
        let group = q_heads / l.kv_heads;
        let scale = kv_paged::attention::default_scale(hd);
        run_parts(pool, &spans, |p, span| {
            let mut rows = per_part[p].lock().unwrap_or_else(|e| e.into_inner());
            let mut guard = sums[p].lock().unwrap_or_else(|e| e.into_inner());
            let (mass, last) = &mut *guard;
            let (mut k, mut v) = (Vec::new(), Vec::new());
            let mut loaded = usize::MAX;
            let mut scores = Vec::new();
            let mut qh16 = vec![0f32; hd];
            let mut unused_out = vec![0f32; hd];
            for h in span.clone() {
                let g = h / group;
                if g != loaded {
                    kv.gather(seq, layer, g, false, &mut k)?;
                    kv.gather(seq, layer, g, true, &mut v)?;
                    loaded = g;
                }
                for (i, row) in rows.iter_mut().enumerate() {
                    let visible = first_pos + i + 1;
                    let qv = &q[i * stride + h * hd..i * stride + (h + 1) * hd];
                    let o = &mut row[(h - span.start) * hd..(h - span.start + 1) * hd];
                    match numerics {
                        Numerics::Standard => {
                            attend_f32(qv, &k, &v, visible, hd, scale, &mut scores, o)
                        }
                        Numerics::Ggml(build) => {
                            for (d, &s) in qh16.iter_mut().zip(qv) {
                                *d = f16::from_f32(s).to_f32();
                            }
                            flash_f16(&qh16, &k, &v, visible, hd, scale, build, o);
                            if want_stats {
                                // ggml's kernel keeps no probabilities: f32 ones for the
                                // statistics only.
                                attend_f32(
                                    qv,
                                    &k,
                                    &v,
                                    visible,
                                    hd,
                                    scale,
                                    &mut scores,
                                    &mut unused_out,
                                );
                            }
                        }
                    }
                    if want_stats {
                        // `scores` holds the softmax's exponentials, summed in this order.
                        let inv = 1.0 / scores.iter().sum::<f32>();
                        for (t, &e) in scores.iter().enumerate() {
                            mass[t] += e * inv;
                            if i == n - 1 {
                                last[t] += e * inv;
                            }
                        }
                    }
                }
            }
            Ok(())
        })
    };
    result?;
    if let Some(tracker) = stats {
        let (mut mass, mut last) = (vec![0f32; len], vec![0f32; len]);
        for part in sums {
            let (m, l) = part.into_inner().unwrap_or_else(|e| e.into_inner());
            for (a, b) in mass.iter_mut().zip(&m) {
                *a += b;
            }
            for (a, b) in last.iter_mut().zip(&l) {
                *a += b;
            }
        }
        for x in &mut last {
            *x /= q_heads as f32;
        }
        tracker.accumulate(layer, n, &mass, &last)?;
    }
    Ok(())
}

/// One query of f32 attention: scores, max-subtracted softmax, weighted sum of V. Compiled a
/// second time with AVX2 and FMA (picked at run time), since the crate's baseline target has
/// only SSE2 and this loop is most of a long prompt's attention time.
#[allow(clippy::too_many_arguments)]
fn attend_f32(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    len: usize,
    hd: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked just above), the only requirement of the
        // target-feature build; the body is safe code.
        unsafe { attend_f32_avx2(q, k, v, len, hd, scale, scores, out) };
        return;
    }
    attend_f32_body(q, k, v, len, hd, scale, scores, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
fn attend_f32_avx2(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    len: usize,
    hd: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_f32_body(q, k, v, len, hd, scale, scores, out);
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_f32_body(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    len: usize,
    hd: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    scores.clear();
    // kv-paged's dot and the same softmax and weighted sum as its streaming kernel, operation
    // for operation: a query's output is the same whichever path computed it.
    scores.extend((0..len).map(|t| kv_paged::attention::dot(q, &k[t * hd..(t + 1) * hd]) * scale));
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    let mut sum = 0.0;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    out.fill(0.0);
    let inv = 1.0 / sum;
    for (t, &p) in scores.iter().enumerate() {
        let w = p * inv;
        for (a, &x) in out.iter_mut().zip(&v[t * hd..(t + 1) * hd]) {
            *a += w * x;
        }
    }
}

/// One query of ggml's CPU flash attention with an f16 V accumulator (its
/// `ggml_compute_forward_flash_attn_ext_f16_one_chunk` for f16 V) as `build` orders it, `q`
/// already f16-rounded.
#[allow(clippy::too_many_arguments)]
fn flash_f16(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    len: usize,
    hd: usize,
    scale: f32,
    build: GgmlBuild,
    out: &mut [f32],
) {
    let wide = build == GgmlBuild::Avx512;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has FMA (checked just above), the only requirement of this build.
        unsafe { flash_f16_fma(q, k, v, len, hd, scale, wide, out) };
        return;
    }
    flash_f16_body(q, k, v, len, hd, scale, wide, out);
}

/// [`flash_f16_body`] compiled with FMA, so `mul_add` is one instruction as in ggml's build.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
#[allow(clippy::too_many_arguments)]
fn flash_f16_fma(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    len: usize,
    hd: usize,
    scale: f32,
    wide: bool,
    out: &mut [f32],
) {
    flash_f16_body(q, k, v, len, hd, scale, wide, out);
}

/// ggml's `ggml_vec_dot_f16` on x86 with F16C and FMA: `lanes` running sums (32 for its AVX2
/// build, 64 for AVX-512: four registers of 8 or 16 lanes), element `i` of each step fused into
/// sum `i % lanes`, then the registers reduced as its `GGML_F32x8_REDUCE` / `GGML_F32x16_REDUCE`
/// do; a tail past the last whole step is added last, in f64, as ggml does. Reproducing the order
/// makes the scores bit-identical to llama.cpp's on the same build.
#[inline(always)]
fn dot_ggml(a: &[f32], b: &[f32], wide: bool) -> f32 {
    let lanes = if wide { 64 } else { 32 };
    let mut acc = [0f32; 64];
    let whole = a.len() / lanes * lanes;
    for (ca, cb) in a[..whole]
        .chunks_exact(lanes)
        .zip(b[..whole].chunks_exact(lanes))
    {
        for i in 0..lanes {
            acc[i] = ca[i].mul_add(cb[i], acc[i]);
        }
    }
    let reg = lanes / 4;
    // x0 += x2, x1 += x3, then x0 += x1, lane by lane.
    let mut x = [0f32; 16];
    for l in 0..reg {
        x[l] = (acc[l] + acc[2 * reg + l]) + (acc[reg + l] + acc[3 * reg + l]);
    }
    let total = if wide {
        // _mm512_reduce_add_ps: 256-bit halves, 128-bit halves, then pairs.
        let t3: [f32; 8] = std::array::from_fn(|l| x[8 + l] + x[l]);
        let t6: [f32; 4] = std::array::from_fn(|l| t3[4 + l] + t3[l]);
        (t6[0] + t6[2]) + (t6[1] + t6[3])
    } else {
        // 128-bit halves, then two horizontal adds.
        let t: [f32; 4] = std::array::from_fn(|l| x[l] + x[4 + l]);
        (t[0] + t[1]) + (t[2] + t[3])
    };
    let mut sum = f64::from(total);
    for (x, y) in a[whole..].iter().zip(&b[whole..]) {
        sum += f64::from(x * y);
    }
    sum as f32
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn flash_f16_body(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    len: usize,
    hd: usize,
    scale: f32,
    wide: bool,
    out: &mut [f32],
) {
    let round = |x: f32| f16::from_f32(x).to_f32();
    let (mut m, mut sum) = (f32::NEG_INFINITY, 0f32);
    out.fill(0.0);
    for t in 0..len {
        let s = dot_ggml(q, &k[t * hd..(t + 1) * hd], wide) * scale;
        let (mut ms, mut vs) = (1f32, 1f32);
        if s > m {
            ms = (m - s).exp();
            m = s;
            for a in out.iter_mut() {
                *a = round(*a * ms);
            }
        } else {
            vs = (s - m).exp();
        }
        for (a, &x) in out.iter_mut().zip(&v[t * hd..(t + 1) * hd]) {
            *a = round(x.mul_add(vs, *a));
        }
        // ggml's `S = S*ms + vs`, which GCC contracts into one fused multiply-add.
        sum = sum.mul_add(ms, vs);
    }
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    for a in out.iter_mut() {
        *a *= inv;
    }
}

/// Runs `work(part, heads)` for every part with a non-empty head span; the first error wins.
fn run_parts(
    pool: &WorkerPool,
    spans: &[Range<usize>],
    work: impl Fn(usize, Range<usize>) -> Result<(), Error> + Sync,
) -> Result<(), Error> {
    let failure: Mutex<Option<Error>> = Mutex::new(None);
    pool.run(&|p| {
        let Some(span) = spans.get(p).filter(|s| !s.is_empty()) else {
            return;
        };
        if let Err(e) = work(p, span.clone()) {
            failure
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(e);
        }
    });
    match failure.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flash_f16_is_softmax_attention_up_to_f16_rounding() {
        let (hd, len) = (16, 40);
        let f = |i: usize, s: usize| (((i * s) % 97) as f32 / 48.0 - 1.0) * 0.5;
        let q: Vec<f32> = (0..hd).map(|i| f16::from_f32(f(i, 7)).to_f32()).collect();
        let k: Vec<f32> = (0..len * hd).map(|i| f(i, 13)).collect();
        let v: Vec<f32> = (0..len * hd).map(|i| f(i, 31)).collect();
        let scale = 0.25;
        let scores: Vec<f64> = (0..len)
            .map(|t| {
                (0..hd)
                    .map(|d| f64::from(q[d]) * f64::from(k[t * hd + d]))
                    .sum::<f64>()
                    * f64::from(scale)
            })
            .collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = w.iter().sum();
        for build in [GgmlBuild::Avx2, GgmlBuild::Avx512] {
            let mut got = vec![0f32; hd];
            flash_f16(&q, &k, &v, len, hd, scale, build, &mut got);
            for d in 0..hd {
                let want: f64 = (0..len)
                    .map(|t| w[t] * f64::from(v[t * hd + d]))
                    .sum::<f64>()
                    / total;
                assert!(
                    (f64::from(got[d]) - want).abs() < 5e-3,
                    "{build:?} {d}: {} vs {want}",
                    got[d]
                );
            }
        }
    }
}
