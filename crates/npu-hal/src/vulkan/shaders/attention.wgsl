// Causal grouped-query attention of each batch row over its sequence's KV pages (read through
// the block table in the step buffer), one workgroup per (row, query head). Keys are found by
// their index in the cache (which KV pruning compacts), rotations use positions. The module
// declares HD (head_dim), WG, LPG, KG and PPL (below), ROPE (0, or the pairing of a rotary
// embedding folded in: 1 interleaved, 2 half-split), ROPE_Q (1: rotate q here), ROPE_K (1:
// rotate this batch's keys here), INBATCH (1: keys of this batch come from the k and v
// tensors, rounded to the page dtype as the KV write stores them, so this kernel does not wait
// for that write) and SPLITS.
//
// Keys go in blocks of WG. Each invocation scores one key of the block; the block's maximum
// and sum are taken across the workgroup (subgroup shuffles, then workgroup memory), so the
// online softmax (maximum m, sum l) advances a block at a time and is the same in every
// invocation. The products with V are taken the other way round: an invocation owns pairs of
// output elements (LPG lanes a group, each lane PPL pairs, LPG apart), and the KG groups take
// every KG-th key of the block, so consecutive lanes read consecutive elements of a key's V
// row and no invocation holds a whole output row. The groups' sums are added once, at the end.
//
// With SPLITS > 1 (decode, flash-decoding style) the keys of each (row, head) are cut into
// SPLITS contiguous ranges, one workgroup each (grid z), so a head's keys are read by SPLITS
// workgroups at once instead of one. Each writes its partial result (the unnormalised output,
// its maximum and its sum) to `partials`, then counts itself done on the (layer, row, head)
// counter; the workgroup that finishes last merges the SPLITS partials into `out`. The
// counters are zeroed at the start of every run and each layer has its own, so none is reused
// within a run. The partials are published at device scope (storageBarrier, a device-scope
// release and acquire) around the counter's atomic, the pattern of CUDA's threadfence
// reduction; nothing waits on another workgroup, so no forward-progress guarantee is needed.
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read> k: array<f32>;
@group(0) @binding(6) var<storage, read> v: array<f32>;

var<workgroup> qs: array<f32, HD>;
// This batch's keys (INBATCH, batches of at most STAGED_KEYS rows), rotated and rounded as the
// pages hold them once per workgroup, so no invocation rotates a whole key alone. Longer
// batches (the row kernel where the tiled one is not taken) rotate each key where it is scored.
const STAGED_KEYS: u32 = 8u;
var<workgroup> kb: array<f32, STAGED_KEYS * HD>;
// The block's probabilities, then the subgroups' maxima and sums (at most WG subgroups).
var<workgroup> probs: array<f32, WG>;
var<workgroup> red_m: array<f32, WG>;
var<workgroup> red_l: array<f32, WG>;
// Each V group's unnormalised output, added at the end.
var<workgroup> group_out: array<f32, KG * HD>;
// Whether this workgroup is the last of its (row, head) to finish (SPLITS > 1).
var<workgroup> merges: u32;

// The scaled score of cache key `j` against the query in `qs`: from the k tensor when the key
// is this batch's (`in_batch`, rotated here with ROPE_K), else from its page.
fn key_score(j: u32, first: u32, cached: u32, kvh: u32, kvw: u32) -> f32 {
    var s = 0.0;
    let in_batch = INBATCH != 0u && j >= cached;
    if (in_batch && step_n() <= STAGED_KEYS) {
        let at = (j - cached) * HD;
        for (var i = 0u; i < HD / 2u; i++) {
            let ab = rope_pair(i);
            s += qs[ab.x] * kb[at + ab.x] + qs[ab.y] * kb[at + ab.y];
        }
        return s;
    }
    if (in_batch) {
        for (var i = 0u; i < HD / 2u; i++) {
            let ab = rope_pair(i);
            let k2 = batch_key_pair(j - cached, i, kvh, kvw, j - cached + first);
            s += qs[ab.x] * k2.x + qs[ab.y] * k2.y;
        }
    } else {
        let block = step_block(j / pc.block_tokens);
        let token = j % pc.block_tokens;
        let kp = kv_page(block, 0u, kvh);
        for (var p = 0u; p < HD / 2u; p++) {
            let k2 = kv_pair(kp, token, p);
            s += qs[2u * p] * k2.x + qs[2u * p + 1u] * k2.y;
        }
    }
    return s;
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_size) sg_size: u32,
) {
    let row = wg.x;
    let h = wg.y;
    if (row >= step_n()) {
        return;
    }
    let qw = pc.q_heads * HD;
    let kvw = pc.kv_heads * HD;
    let kvh = h / (pc.q_heads / pc.kv_heads);
    let first = step_first_pos();
    // The cache index of this batch's first key; key j of the cache is at position
    // j + first - cached when it is in the batch.
    let cached = step_first_cached();
    let qrow = row * qw + h * HD;
    if (ROPE_Q != 0u) {
        for (var i = lid; i < HD / 2u; i += WG) {
            let ab = rope_pair(i);
            let cs = rope_cs(first + row, i);
            let x0 = q[qrow + ab.x];
            let x1 = q[qrow + ab.y];
            qs[ab.x] = (x0 * cs.x - x1 * cs.y) * pc.scale;
            qs[ab.y] = (x0 * cs.y + x1 * cs.x) * pc.scale;
        }
    } else {
        for (var d = lid; d < HD; d += WG) {
            qs[d] = q[qrow + d] * pc.scale;
        }
    }
    if (INBATCH != 0u && step_n() <= STAGED_KEYS) {
        for (var e = lid; e < step_n() * HD / 2u; e += WG) {
            let b = e / (HD / 2u);
            let i = e % (HD / 2u);
            let ab = rope_pair(i);
            let k2 = batch_key_pair(b, i, kvh, kvw, first + b);
            kb[b * HD + ab.x] = k2.x;
            kb[b * HD + ab.y] = k2.y;
        }
    }
    workgroupBarrier();
    let keys = cached + row + 1u;
    // This workgroup's contiguous range of the keys (all of them when SPLITS is 1).
    let per = (keys + SPLITS - 1u) / SPLITS;
    let lo = min(keys, wg.z * per);
    let hi = min(keys, lo + per);
    // Reductions add within aligned runs of `width` lanes by shuffles, then across the runs
    // through workgroup memory: a one-dimensional workgroup's subgroups are runs of
    // consecutive invocations (as in linear_gemv.wgsl).
    let width = min(WG, sg_size);
    let runs = WG / width;
    let group = lid / LPG;
    let lane = lid % LPG;
    var m = -3.0e38;
    var l = 0.0;
    var acc: array<vec2<f32>, PPL>;
    for (var j0 = lo; j0 < hi; j0 += WG) {
        let n = min(WG, hi - j0);
        var s = -3.0e38;
        if (lid < n) {
            s = key_score(j0 + lid, first, cached, kvh, kvw);
        }
        var bm = s;
        for (var mask = width / 2u; mask > 0u; mask >>= 1u) {
            bm = max(bm, subgroupShuffleXor(bm, mask));
        }
        if (lid % width == 0u) {
            red_m[lid / width] = bm;
        }
        workgroupBarrier();
        var m_new = m;
        for (var r = 0u; r < runs; r++) {
            m_new = max(m_new, red_m[r]);
        }
        let corr = exp(m - m_new);
        var e = 0.0;
        if (lid < n) {
            e = exp(s - m_new);
        }
        probs[lid] = e;
        var bl = e;
        for (var mask = width / 2u; mask > 0u; mask >>= 1u) {
            bl += subgroupShuffleXor(bl, mask);
        }
        if (lid % width == 0u) {
            red_l[lid / width] = bl;
        }
        workgroupBarrier();
        var block_sum = 0.0;
        for (var r = 0u; r < runs; r++) {
            block_sum += red_l[r];
        }
        l = l * corr + block_sum;
        m = m_new;
        if (group < KG) {
            for (var pp = 0u; pp < PPL; pp++) {
                acc[pp] *= corr;
            }
            for (var i = group; i < n; i += KG) {
                let j = j0 + i;
                let pj = probs[i];
                let in_batch = INBATCH != 0u && j >= cached;
                let vp = kv_page(step_block(j / pc.block_tokens), 1u, kvh);
                let token = j % pc.block_tokens;
                let base = (j - min(j, cached)) * kvw + kvh * HD;
                for (var pp = 0u; pp < PPL; pp++) {
                    let p = lane + pp * LPG;
                    if (p < HD / 2u) {
                        var v2: vec2<f32>;
                        if (in_batch) {
                            v2 = as_stored(vec2<f32>(v[base + 2u * p], v[base + 2u * p + 1u]));
                        } else {
                            v2 = kv_pair(vp, token, p);
                        }
                        acc[pp] += pj * v2;
                    }
                }
            }
        }
        // The next block rewrites probs, red_m and red_l.
        workgroupBarrier();
    }
    if (group < KG) {
        for (var pp = 0u; pp < PPL; pp++) {
            let p = lane + pp * LPG;
            if (p < HD / 2u) {
                group_out[group * HD + 2u * p] = acc[pp].x;
                group_out[group * HD + 2u * p + 1u] = acc[pp].y;
            }
        }
    }
    workgroupBarrier();
    let mx = m;
    let total = l;
    // This split's partial result (SPLITS > 1). An empty range (a short context) leaves
    // mx = -3e38 and total = 0: weight 0 in the merge.
    let mine = ((row * pc.q_heads + h) * SPLITS + wg.z) * (HD + 2u);
    for (var d = lid; d < HD; d += WG) {
        var o = 0.0;
        for (var g = 0u; g < KG; g++) {
            o += group_out[g * HD + d];
        }
        if (SPLITS == 1u) {
            out[qrow + d] = o / total;
        } else {
            partials[mine + d] = o;
        }
    }
    if (SPLITS > 1u) {
        if (lid == 0u) {
            partials[mine + HD] = mx;
            partials[mine + HD + 1u] = total;
        }
        // Release: this workgroup's partial is visible device-wide before it counts itself.
        storageBarrier();
        if (lid == 0u) {
            let counter = (pc.layer * SPLIT_ROWS + row) * pc.q_heads + h;
            merges = u32(atomicAdd(&split_counters[counter], 1u) == SPLITS - 1u);
        }
        if (workgroupUniformLoad(&merges) == 0u) {
            return;
        }
        // Acquire: every other split's partial, published before its count, is seen here.
        storageBarrier();
        let parts = (row * pc.q_heads + h) * SPLITS * (HD + 2u);
        let scale = merge_scale(parts, SPLITS);
        for (var d = lid; d < HD; d += WG) {
            out[qrow + d] = merged_output(parts, SPLITS, scale, d);
        }
    }
    // The stats variant adds each key's probability to the program's attention statistics
    // (the other variants' record_stats is empty).
    record_stats(row, keys, mx, total, lid, first, cached, kvh, kvw);
}
