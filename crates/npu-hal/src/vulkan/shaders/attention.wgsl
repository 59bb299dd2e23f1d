// Causal grouped-query attention of each batch row over its sequence's KV pages (read through
// the block table in the step buffer), one workgroup per (row, query head). Keys are found by
// their index in the cache (which KV pruning compacts), rotations use positions. Each invocation
// takes every WG-th key and keeps its own online softmax (max m, sum l, output acc), so keys
// are scored and folded in parallel, with no barrier per key; one reduction across the
// workgroup merges the partial results at the end. The module declares HD (head_dim), WG,
// ROPE (0, or the pairing of a rotary embedding folded in: 1 interleaved, 2 half-split),
// ROPE_Q (1: rotate q here), ROPE_K (1: rotate this batch's keys here) and INBATCH (1: keys of
// this batch come from the k and v tensors, rounded to the page dtype as the KV write stores
// them, so this kernel does not wait for that write) and SPLITS.
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
var<workgroup> red_m: array<f32, WG>;
var<workgroup> red_l: array<f32, WG>;
// Each invocation's acc, with a stride of HD + 1 so the writes hit distinct banks.
var<workgroup> accs: array<f32, WG * (HD + 1u)>;
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
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
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
    var m = -3.0e38;
    var l = 0.0;
    var acc: array<f32, HD>;
    for (var j = lo + lid; j < hi; j += WG) {
        let s = key_score(j, first, cached, kvh, kvw);
        let in_batch = INBATCH != 0u && j >= cached;
        let block = step_block(j / pc.block_tokens);
        let token = j % pc.block_tokens;
        let base = (j - min(j, cached)) * kvw + kvh * HD;
        let m_new = max(m, s);
        let corr = exp(m - m_new);
        let e = exp(s - m_new);
        l = l * corr + e;
        let vp = kv_page(block, 1u, kvh);
        for (var p = 0u; p < HD / 2u; p++) {
            var v2: vec2<f32>;
            if (in_batch) {
                v2 = as_stored(vec2<f32>(v[base + 2u * p], v[base + 2u * p + 1u]));
            } else {
                v2 = kv_pair(vp, token, p);
            }
            acc[2u * p] = acc[2u * p] * corr + e * v2.x;
            acc[2u * p + 1u] = acc[2u * p + 1u] * corr + e * v2.y;
        }
        m = m_new;
    }
    // Only the first `busy` invocations saw a key (a decode step's split range is often a
    // handful of keys); the others hold m = -3e38, l = 0 and acc = 0, which would add exact
    // zeros, so the reductions below skip them: the same sums, without up to WG serial
    // workgroup-memory reads each.
    let busy = min(WG, hi - lo);
    red_m[lid] = m;
    workgroupBarrier();
    var mx = -3.0e38;
    for (var t = 0u; t < busy; t++) {
        mx = max(mx, red_m[t]);
    }
    let f = exp(m - mx);
    red_l[lid] = l * f;
    if (lid < busy) {
        for (var d = 0u; d < HD; d++) {
            accs[lid * (HD + 1u) + d] = acc[d] * f;
        }
    }
    workgroupBarrier();
    var total = 0.0;
    for (var t = 0u; t < busy; t++) {
        total += red_l[t];
    }
    // This split's partial result (SPLITS > 1). An empty range (a short context) leaves
    // mx = -3e38 and total = 0: weight 0 in the merge.
    let mine = ((row * pc.q_heads + h) * SPLITS + wg.z) * (HD + 2u);
    for (var d = lid; d < HD; d += WG) {
        var o = 0.0;
        for (var t = 0u; t < busy; t++) {
            o += accs[t * (HD + 1u) + d];
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
