//! Paged attention on the CPU: decode (one query per sequence) and causal prefill, grouped-query
//! attention, multi-threaded over query heads.
//!
//! Decode reads each K and V vector of the sequence once per thread, page by page through the
//! block table, dequantizing into one L1-resident vector (mx-quant's SIMD kernels for MX pages),
//! and serves every query head of its group from it: scores, a max-subtracted softmax in f32,
//! then the probability-weighted sum of V. [`contiguous_decode`] is the same computation over
//! plain contiguous f32 K/V, the baseline the benches compare against.

use crate::Error;
use crate::cache::KvCache;
use crate::pool::SeqId;

/// `1 / sqrt(head_dim)`, the usual attention scale.
pub fn default_scale(head_dim: usize) -> f32 {
    1.0 / (head_dim as f32).sqrt()
}

/// The dot product of every attention kernel here, public so that other attention kernels
/// (npu-hal's prefill) compute scores with the same bits: a query's output then does not depend
/// on which kernel, or which batch, computed it.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent sums so the compiler vectorises the loop. Plain `a * b + c`, not
    // `mul_add`: without FMA in the baseline target, `mul_add` is a libm call per element.
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

fn axpy(out: &mut [f32], a: f32, x: &[f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o += a * v;
    }
}

/// Softmax of `scores` in place (max-subtracted).
fn softmax(scores: &mut [f32]) {
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    let mut sum = 0.0;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    let inv = 1.0 / sum;
    for s in scores.iter_mut() {
        *s *= inv;
    }
}

/// Decode attention for `seq` at `layer`: `q` holds `q_heads * head_dim` values, `out` receives
/// the same. `q_heads` must be a multiple of the cache's `kv_heads` (GQA); `threads` splits the
/// query heads. Returns the attention probabilities when `probs` is given (`q_heads * len`), for
/// pruning policies that accumulate them.
pub fn decode(
    cache: &KvCache,
    seq: SeqId,
    layer: usize,
    q_heads: usize,
    q: &[f32],
    out: &mut [f32],
    threads: usize,
    probs: Option<&mut Vec<f32>>,
) -> Result<(), Error> {
    let l = *cache.layout();
    let hd = l.head_dim;
    if q_heads == 0
        || !q_heads.is_multiple_of(l.kv_heads)
        || q.len() != q_heads * hd
        || out.len() != q_heads * hd
    {
        return Err(Error::BadConfig {
            what: "decode: q_heads must be a multiple of kv_heads, q and out q_heads * head_dim long",
        });
    }
    if layer >= l.layers {
        return Err(Error::BadConfig {
            what: "decode: layer out of range",
        });
    }
    let table = cache.manager().block_table(seq)?.to_vec();
    let len = cache.manager().len(seq)?;
    if len == 0 {
        out.fill(0.0);
        return Ok(());
    }
    let guard = cache
        .buffer()
        .cpu_access(0..cache.buffer().len(), uvm_alloc::Access::Read)
        .map_err(Error::Memory)?;
    let ctx = DecodeCtx {
        cache,
        bytes: guard.bytes(),
        table: &table,
        len,
        layer,
        group: q_heads / l.kv_heads,
        q,
    };
    let threads = threads.clamp(1, q_heads);
    let per = q_heads.div_ceil(threads);
    let mut all_probs = vec![0f32; if probs.is_some() { q_heads * len } else { 0 }];
    let want_probs = probs.is_some();
    let work = |heads: std::ops::Range<usize>,
                out: &mut [f32],
                probs_out: &mut [f32]|
     -> Result<(), Error> {
        ctx.queries(heads, len - 1, &mut [out], want_probs.then_some(probs_out))
    };
    if threads == 1 {
        work(0..q_heads, out, &mut all_probs)?;
    } else {
        let prob_chunk = if want_probs { per * len } else { 0 };
        let mut prob_chunks: Vec<&mut [f32]> = if want_probs {
            all_probs.chunks_mut(prob_chunk).collect()
        } else {
            (0..threads).map(|_| &mut [][..]).collect()
        };
        std::thread::scope(|s| {
            let handles: Vec<_> = out
                .chunks_mut(per * hd)
                .zip(prob_chunks.iter_mut())
                .enumerate()
                .map(|(i, (o, p))| {
                    let heads = i * per..((i + 1) * per).min(q_heads);
                    let work = &work;
                    s.spawn(move || work(heads, o, p))
                })
                .collect();
            handles
                .into_iter()
                .try_for_each(|h| h.join().expect("attention worker does not panic"))
        })?;
    }
    if let Some(p) = probs {
        *p = all_probs;
    }
    Ok(())
}

/// Decode attention for query heads `heads` only (`out` holds `heads.len() * head_dim` values):
/// the building block for callers that split heads over their own worker pool instead of
/// letting [`decode`] spawn threads. Arguments as in [`decode`].
pub fn decode_heads(
    cache: &KvCache,
    seq: SeqId,
    layer: usize,
    q_heads: usize,
    heads: std::ops::Range<usize>,
    q: &[f32],
    out: &mut [f32],
) -> Result<(), Error> {
    let len = cache.manager().len(seq)?;
    decode_queries(
        cache,
        seq,
        layer,
        q_heads,
        heads,
        len.saturating_sub(1),
        q,
        &mut [out],
        None,
    )
}

/// Decode attention for `n = out.len()` queries at positions `first_pos..first_pos + n` of
/// `seq` (their K/V already in the cache), query heads `heads` only: query `i` is
/// `q[i * q_heads * head_dim..]` and sees tokens `0..=first_pos + i`; `out[i]` receives its
/// `heads.len() * head_dim` values. `probs`, when given, receives the attention probabilities,
/// `[query][head][token]` over `first_pos + n` tokens (zero past each query's own).
///
/// Each query is computed with exactly the arithmetic [`decode_heads`] uses for it alone, so
/// its output is bit-identical to decoding the queries one at a time, while the pages are read
/// once for all of them. Speculative decoding verifies its drafts this way: the batch gives the
/// same logits as the steps it replaces.
pub fn decode_queries(
    cache: &KvCache,
    seq: SeqId,
    layer: usize,
    q_heads: usize,
    heads: std::ops::Range<usize>,
    first_pos: usize,
    q: &[f32],
    out: &mut [&mut [f32]],
    probs: Option<&mut [f32]>,
) -> Result<(), Error> {
    let l = *cache.layout();
    let hd = l.head_dim;
    let n = out.len();
    if q_heads == 0
        || !q_heads.is_multiple_of(l.kv_heads)
        || q.len() != n * q_heads * hd
        || heads.start > heads.end
        || heads.end > q_heads
        || out.iter().any(|o| o.len() != heads.len() * hd)
    {
        return Err(Error::BadConfig {
            what: "decode_queries: q_heads must be a multiple of kv_heads, q n * q_heads * head_dim long, heads within q_heads and each out heads.len() * head_dim long",
        });
    }
    if layer >= l.layers {
        return Err(Error::BadConfig {
            what: "decode: layer out of range",
        });
    }
    let table = cache.manager().block_table(seq)?;
    let len = cache.manager().len(seq)?;
    if first_pos.checked_add(n).is_none_or(|end| end > len) {
        return Err(Error::BadConfig {
            what: "decode_queries: the queries' positions run past the sequence",
        });
    }
    if len == 0 || heads.is_empty() || n == 0 {
        for o in out.iter_mut() {
            o.fill(0.0);
        }
        return Ok(());
    }
    let guard = cache
        .buffer()
        .cpu_access(0..cache.buffer().len(), uvm_alloc::Access::Read)
        .map_err(Error::Memory)?;
    let ctx = DecodeCtx {
        cache,
        bytes: guard.bytes(),
        table,
        len: first_pos + n,
        layer,
        group: q_heads / l.kv_heads,
        q,
    };
    if let Some(p) = &probs
        && p.len() != n * heads.len() * (first_pos + n)
    {
        return Err(Error::BadConfig {
            what: "decode_queries: probs must hold queries * heads * (first_pos + queries) values",
        });
    }
    ctx.queries(heads, first_pos, out, probs)
}

struct DecodeCtx<'a> {
    cache: &'a KvCache,
    bytes: &'a [u8],
    table: &'a [crate::BlockId],
    len: usize,
    layer: usize,
    group: usize,
    q: &'a [f32],
}

impl DecodeCtx<'_> {
    /// Attention for query heads `heads` of queries at consecutive positions from `first_pos`
    /// (query `i` sees `first_pos + i + 1` tokens) into `out[i]` (`heads.len() * head_dim`).
    /// Every query goes through the same operations in the same order whatever the others, so
    /// each result is bit-identical to the one-query computation, and each page is read once
    /// for all of them. The probabilities go to `probs_out` (`queries * heads.len() * len`,
    /// zero past each query's visible tokens) when given.
    fn queries(
        &self,
        heads: std::ops::Range<usize>,
        first_pos: usize,
        out: &mut [&mut [f32]],
        probs_out: Option<&mut [f32]>,
    ) -> Result<(), Error> {
        let hd = self.cache.layout().head_dim;
        let (len, group) = (self.len, self.group);
        let n = out.len();
        let stride = self.q.len() / n;
        let scale = default_scale(hd);
        let visible = |i: usize| first_pos + i + 1;
        let mut scratch = Vec::new();
        // scores[(i * heads + h) * len + t]
        let mut scores = vec![0f32; n * heads.len() * len];
        let at = |i: usize, qh: usize| (i * heads.len() + qh - heads.start) * len;
        let mut h = heads.start;
        while h < heads.end {
            let g = h / group;
            let last = heads.end.min((g + 1) * group);
            let hs = h..last;
            self.cache.for_each_vector(
                self.bytes,
                self.table,
                len,
                self.layer,
                g,
                false,
                &mut scratch,
                |t, k| {
                    for i in (0..n).filter(|&i| t < visible(i)) {
                        let q = &self.q[i * stride..(i + 1) * stride];
                        for qh in hs.clone() {
                            scores[at(i, qh) + t] = dot(&q[qh * hd..(qh + 1) * hd], k) * scale;
                        }
                    }
                },
            )?;
            for (i, o) in out.iter_mut().enumerate() {
                for qh in hs.clone() {
                    softmax(&mut scores[at(i, qh)..at(i, qh) + visible(i)]);
                    o[(qh - heads.start) * hd..(qh - heads.start + 1) * hd].fill(0.0);
                }
            }
            self.cache.for_each_vector(
                self.bytes,
                self.table,
                len,
                self.layer,
                g,
                true,
                &mut scratch,
                |t, v| {
                    for (i, o) in out.iter_mut().enumerate() {
                        if t >= visible(i) {
                            continue;
                        }
                        for qh in hs.clone() {
                            let p = scores[at(i, qh) + t];
                            axpy(
                                &mut o[(qh - heads.start) * hd..(qh - heads.start + 1) * hd],
                                p,
                                v,
                            );
                        }
                    }
                },
            )?;
            h = last;
        }
        if let Some(p) = probs_out {
            p.copy_from_slice(&scores);
        }
        Ok(())
    }
}

/// Causal prefill attention: `n = q.len() / (q_heads * head_dim)` queries at positions
/// `first_pos..first_pos + n` of `seq` (whose K/V for those positions are already written); query
/// `i` attends to tokens `0..=first_pos + i`. Queries are processed in chunks of `CHUNK`, so the
/// score scratch stays `CHUNK * len` per head.
pub fn prefill(
    cache: &KvCache,
    seq: SeqId,
    layer: usize,
    q_heads: usize,
    first_pos: usize,
    q: &[f32],
    out: &mut [f32],
) -> Result<(), Error> {
    const CHUNK: usize = 64;
    let l = *cache.layout();
    let hd = l.head_dim;
    let stride = q_heads * hd;
    if q_heads == 0
        || !q_heads.is_multiple_of(l.kv_heads)
        || !q.len().is_multiple_of(stride)
        || out.len() != q.len()
    {
        return Err(Error::BadConfig {
            what: "prefill: q_heads must be a multiple of kv_heads, q and out n * q_heads * head_dim long",
        });
    }
    let n = q.len() / stride;
    let len = cache.manager().len(seq)?;
    if first_pos + n > len {
        return Err(Error::BadConfig {
            what: "prefill: queries past the sequence's written tokens",
        });
    }
    let group = q_heads / l.kv_heads;
    let scale = default_scale(hd);
    let (mut k, mut v) = (Vec::new(), Vec::new());
    let mut scores = vec![0f32; CHUNK * len];
    for g in 0..l.kv_heads {
        cache.gather(seq, layer, g, false, &mut k)?;
        cache.gather(seq, layer, g, true, &mut v)?;
        for qh in g * group..(g + 1) * group {
            for chunk_start in (0..n).step_by(CHUNK) {
                let chunk = CHUNK.min(n - chunk_start);
                for i in 0..chunk {
                    let qi = chunk_start + i;
                    let visible = first_pos + qi + 1;
                    let qv = &q[qi * stride + qh * hd..qi * stride + (qh + 1) * hd];
                    let row = &mut scores[i * len..i * len + visible];
                    for (t, s) in row.iter_mut().enumerate() {
                        *s = dot(qv, &k[t * hd..(t + 1) * hd]) * scale;
                    }
                    softmax(row);
                    let o = &mut out[qi * stride + qh * hd..qi * stride + (qh + 1) * hd];
                    o.fill(0.0);
                    for (t, &p) in row.iter().enumerate() {
                        axpy(o, p, &v[t * hd..(t + 1) * hd]);
                    }
                }
            }
        }
    }
    Ok(())
}

/// The same decode computation over contiguous f32 K and V (`[token][kv_head][head_dim]`), the
/// baseline paged decode is measured against.
pub fn contiguous_decode(
    k: &[f32],
    v: &[f32],
    len: usize,
    kv_heads: usize,
    head_dim: usize,
    q_heads: usize,
    q: &[f32],
    out: &mut [f32],
) {
    let group = q_heads / kv_heads;
    let scale = default_scale(head_dim);
    let mut scores = vec![0f32; len];
    for qh in 0..q_heads {
        let g = qh / group;
        let qv = &q[qh * head_dim..(qh + 1) * head_dim];
        for (t, s) in scores.iter_mut().enumerate() {
            let off = (t * kv_heads + g) * head_dim;
            *s = dot(qv, &k[off..off + head_dim]) * scale;
        }
        softmax(&mut scores);
        let o = &mut out[qh * head_dim..(qh + 1) * head_dim];
        o.fill(0.0);
        for (t, &p) in scores.iter().enumerate() {
            let off = (t * kv_heads + g) * head_dim;
            axpy(o, p, &v[off..off + head_dim]);
        }
    }
}
