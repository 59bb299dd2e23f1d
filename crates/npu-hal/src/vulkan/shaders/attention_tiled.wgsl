// Causal grouped-query attention for long batches (prefill), tiled as flash attention: one
// workgroup per (block of BQ batch rows, query head). Keys are found by their index in the
// cache: earlier ones come from the pages, and this batch's from the k and v tensors when
// INBATCH is 1 (rotated here with ROPE_K and rounded to the page dtype as the KV write stores
// them, so the kernel need not wait for that write), else from the pages after the KV write.
// A block of BKEY keys and their values is staged in workgroup memory once and scored against
// all BQ rows, so a key is read from memory (and rotated) once per workgroup instead of once per
// row (the row kernel, attention.wgsl, reads it once per row and head).
//
// Invocation (r, c) = (lid / 8, lid % 8) works for row r of the block: it scores keys c, c + 8,
// c + 16 and c + 24 of each key block, and keeps output dims c, c + 8, ... of its row. The eight
// invocations of a row keep the row's online softmax (max m, sum l) in step, merging their
// partial maxima and sums through workgroup memory once per key block. The module declares HD
// (head_dim, a multiple of 8), ROPE, ROPE_Q (Q is rotated as it is loaded), ROPE_K and INBATCH
// as the row kernel does, and SPLITS; it keeps no attention statistics (programs that do take
// the row kernel).
//
// With SPLITS > 1 the key blocks a row block sees are cut into up to SPLITS contiguous ranges,
// one workgroup each (grid z), so the last row blocks of a long prompt, which see every key,
// no longer make the critical path alone: each range writes its rows' partial results (the
// unnormalised output, the maximum and the sum) to `partials` and counts itself done on the
// (layer, row block, head) counter, and the last to finish merges them, as the split decode
// attention does (attention.wgsl: device-scope publication around the counter's atomic, no
// workgroup waits on another). A row block whose keys fit fewer ranges takes fewer, and one
// with a single range writes its output directly.
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read> k: array<f32>;
@group(0) @binding(6) var<storage, read> v: array<f32>;
@group(0) @binding(9) var<storage, read_write> partials: array<f32>;
@group(0) @binding(10) var<storage, read_write> split_counters: array<atomic<u32>>;
// Whether this workgroup is the last of its (row block, head) to finish (SPLITS > 1).
var<workgroup> merges: u32;

const BQ: u32 = 32u;
const BKEY: u32 = 32u;
const LANES: u32 = 8u;
const WG: u32 = BQ * LANES;
const KEYS_PER_LANE: u32 = BKEY / LANES;
const DIMS_PER_LANE: u32 = HD / LANES;
// Row strides of one more than the width, so the rows a subgroup touches at once fall on
// distinct banks.
const QS: u32 = HD + 1u;
const PS: u32 = BKEY + 1u;

var<workgroup> qs: array<f32, BQ * QS>;
var<workgroup> ks: array<f32, BKEY * QS>;
var<workgroup> vs: array<f32, BKEY * QS>;
var<workgroup> ps: array<f32, BQ * PS>;
// Each invocation's partial maximum and sum for its row, per key block.
var<workgroup> red_m: array<f32, WG>;
var<workgroup> red_l: array<f32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let n = step_n();
    let row0 = wg.x * BQ;
    let h = wg.y;
    if (row0 >= n) {
        return;
    }
    let qw = pc.q_heads * HD;
    let kvh = h / (pc.q_heads / pc.kv_heads);
    let kvw = pc.kv_heads * HD;
    let first = step_first_pos();
    let cached = step_first_cached();
    let r = lid / LANES;
    let c = lid % LANES;
    let row = row0 + r;

    // The block's queries, scaled (and rotated), zeros past the batch.
    for (var e = lid; e < BQ * HD / 2u; e += WG) {
        let rr = e / (HD / 2u);
        let i = e % (HD / 2u);
        let qrow = (row0 + rr) * qw + h * HD;
        var ab = vec2<u32>(2u * i, 2u * i + 1u);
        var x = vec2<f32>(0.0);
        if (ROPE_Q != 0u) {
            ab = rope_pair(i);
        }
        if (row0 + rr < n) {
            x = vec2<f32>(q[qrow + ab.x], q[qrow + ab.y]);
            if (ROPE_Q != 0u) {
                let cs = rope_cs(first + row0 + rr, i);
                x = vec2<f32>(x.x * cs.x - x.y * cs.y, x.x * cs.y + x.y * cs.x);
            }
        }
        qs[rr * QS + ab.x] = x.x * pc.scale;
        qs[rr * QS + ab.y] = x.y * pc.scale;
    }

    // Keys every row of the block may see: up to the last row's own (causal).
    let last_row = min(row0 + BQ, n) - 1u;
    let keys = cached + last_row + 1u;
    // This workgroup's range of key blocks (all of them when SPLITS is 1): `used` ranges of
    // `chunk` blocks hold every key; a workgroup past them has none and is not counted.
    let blocks = (keys + BKEY - 1u) / BKEY;
    let chunk = (blocks + SPLITS - 1u) / SPLITS;
    let used = (blocks + chunk - 1u) / chunk;
    if (wg.z >= used) {
        return;
    }
    let k_lo = wg.z * chunk * BKEY;
    let k_hi = min(keys, k_lo + chunk * BKEY);
    // This row's last key (rows past the batch see key 0 only, and write nothing).
    let own = cached + min(row, last_row);
    var m = -3.0e38;
    var l = 0.0;
    var acc: array<f32, DIMS_PER_LANE>;
    for (var i = 0u; i < DIMS_PER_LANE; i++) {
        acc[i] = 0.0;
    }
    for (var k0 = k_lo; k0 < k_hi; k0 += BKEY) {
        // The previous block's tiles, probabilities and partial sums are no longer read (and
        // the queries are written). Four barriers per key block in all.
        workgroupBarrier();
        for (var e = lid; e < BKEY * HD / 2u; e += WG) {
            let kk = e / (HD / 2u);
            let p = e % (HD / 2u);
            let j = k0 + kk;
            // Where the key's two values go: elements 2p and 2p + 1 from a page, rotary pair p
            // from the k tensor.
            var at = vec2<u32>(2u * p, 2u * p + 1u);
            var k2 = vec2<f32>(0.0);
            var v2 = vec2<f32>(0.0);
            if (j < k_hi && INBATCH != 0u && j >= cached) {
                at = rope_pair(p);
                k2 = batch_key_pair(j - cached, p, kvh, kvw, j - cached + first);
                let base = (j - cached) * kvw + kvh * HD;
                v2 = as_stored(vec2<f32>(v[base + 2u * p], v[base + 2u * p + 1u]));
            } else if (j < k_hi) {
                let block = step_block(j / pc.block_tokens);
                let token = j % pc.block_tokens;
                k2 = kv_pair(kv_page(block, 0u, kvh), token, p);
                v2 = kv_pair(kv_page(block, 1u, kvh), token, p);
            }
            ks[kk * QS + at.x] = k2.x;
            ks[kk * QS + at.y] = k2.y;
            vs[kk * QS + 2u * p] = v2.x;
            vs[kk * QS + 2u * p + 1u] = v2.y;
        }
        workgroupBarrier();
        // Each query element is read once for this invocation's KEYS_PER_LANE keys.
        var s: array<f32, KEYS_PER_LANE>;
        for (var t = 0u; t < KEYS_PER_LANE; t++) {
            s[t] = 0.0;
        }
        for (var d = 0u; d < HD; d++) {
            let qd = qs[r * QS + d];
            for (var t = 0u; t < KEYS_PER_LANE; t++) {
                s[t] += qd * ks[(c + t * LANES) * QS + d];
            }
        }
        var local_max = -3.0e38;
        for (var t = 0u; t < KEYS_PER_LANE; t++) {
            // Keys past this row's own are masked out.
            if (k0 + c + t * LANES > own) {
                s[t] = -3.0e38;
            }
            local_max = max(local_max, s[t]);
        }
        red_m[lid] = local_max;
        workgroupBarrier();
        var block_max = -3.0e38;
        for (var t = 0u; t < LANES; t++) {
            block_max = max(block_max, red_m[r * LANES + t]);
        }
        // Block 0 holds key 0, which every row sees: m is finite from then on, and a block
        // this row sees none of leaves it unchanged. A later range's rows may see none of its
        // keys: they keep m = -3e38 and l = 0, weight 0 in the merge.
        let m_new = max(m, block_max);
        let corr = exp(m - m_new);
        var local_sum = 0.0;
        for (var t = 0u; t < KEYS_PER_LANE; t++) {
            let kk = c + t * LANES;
            var e = 0.0;
            if (k0 + kk <= own) {
                e = exp(s[t] - m_new);
            }
            ps[r * PS + kk] = e;
            local_sum += e;
        }
        red_l[lid] = local_sum;
        workgroupBarrier();
        var block_sum = 0.0;
        for (var t = 0u; t < LANES; t++) {
            block_sum += red_l[r * LANES + t];
        }
        l = l * corr + block_sum;
        // Each probability is read once for this invocation's DIMS_PER_LANE dims.
        for (var i = 0u; i < DIMS_PER_LANE; i++) {
            acc[i] *= corr;
        }
        for (var kk = 0u; kk < BKEY; kk++) {
            let p = ps[r * PS + kk];
            for (var i = 0u; i < DIMS_PER_LANE; i++) {
                acc[i] += p * vs[kk * QS + c + i * LANES];
            }
        }
        m = m_new;
    }
    let orow = row * qw + h * HD;
    if (used == 1u) {
        if (row < n) {
            for (var i = 0u; i < DIMS_PER_LANE; i++) {
                out[orow + c + i * LANES] = acc[i] / l;
            }
        }
        return;
    }
    // Row `row`'s partial result for this range: HD values, then m and l.
    let parts = (row * pc.q_heads + h) * SPLITS * (HD + 2u);
    if (row < n) {
        let mine = parts + wg.z * (HD + 2u);
        for (var i = 0u; i < DIMS_PER_LANE; i++) {
            partials[mine + c + i * LANES] = acc[i];
        }
        if (c == 0u) {
            partials[mine + HD] = m;
            partials[mine + HD + 1u] = l;
        }
    }
    // Release: this range's partials are visible device-wide before it counts itself.
    storageBarrier();
    if (lid == 0u) {
        let counter = (pc.layer * ((n + BQ - 1u) / BQ) + wg.x) * pc.q_heads + h;
        merges = u32(atomicAdd(&split_counters[counter], 1u) == used - 1u);
    }
    if (workgroupUniformLoad(&merges) == 0u) {
        return;
    }
    // Acquire: every other range's partials, published before its count, are seen here.
    storageBarrier();
    if (row < n) {
        let scale = merge_scale(parts, used);
        for (var i = 0u; i < DIMS_PER_LANE; i++) {
            let d = c + i * LANES;
            out[orow + d] = merged_output(parts, used, scale, d);
        }
    }
}
