// The tensor-core path of the vision encoder: cooperative matrices (wgpu's experimental
// `wgpu_cooperative_matrix`, Vulkan's VK_KHR_cooperative_matrix), f16 activations and weights,
// f32 accumulation and an f32 residual stream. Built only on devices with SHADER_F16,
// SUBGROUP, EXPERIMENTAL_COOPERATIVE_MATRIX, a 16x16x16 f16 -> f32 configuration and a fixed
// subgroup size of 32; vision_gpu.rs checks all of that, and before it compiles this module
// substitutes the tile constants marked below, writes out the code at the `// <...>` markers
// (the GEMM's blocking and k loop, attention's registers) and, for MX weights, swaps the GEMM's
// weight source (<w-source>).
//
// Scratch that one subgroup writes and reads (the GEMM epilogue's, attention's scores and
// probabilities) is still handed between its lanes with workgroupBarrier. subgroupBarrier would
// let subgroups run apart (0.5-1% faster per image on an H200, README), but naga emits it with
// subgroup-memory semantics, which Vulkan's memory model ignores: it would not order the
// lanes' workgroup-memory accesses.
//
// Every kernel here trusts its parameters: the module is compiled without runtime bounds
// checks, so vision_gpu.rs validates each dispatch's sizes against its buffers (the contract
// of each kernel says what it needs).

enable f16;
enable wgpu_cooperative_matrix;

// ---------------------------------------------------------------------------------------------
// GEMM: y[m][n] (op)= x[m][k] . w[n][k] (+ b[n]), x and w f16.
//
// A workgroup computes a BM x BN block of y with (BM / (16 TM)) x (BN / (16 TN)) subgroups,
// each a 16 TM x 16 TN block as TM x TN tiles of 16x16 (vision_gpu.rs sets the five tile
// constants below and writes the accumulators, the products and the epilogue for TM x TN
// where the markers stand). K advances 32 at a time through workgroup memory,
// double-buffered: every invocation keeps its share of the x and w tiles of the next
// CoopTile::prefetch steps in flight (8-byte vector loads, coalesced along k, into named
// registers) while the subgroups multiply the current step, and stores each into a buffer
// just before its step; one barrier per step. (With cooperative loads
// straight from the storage buffers instead, the GEMMs took 5.9 against 3.7 ms per image on an
// H200.) The epilogue (bias, GELU, residual, f16 conversion) goes through a 16x16 workgroup
// scratch per subgroup.
//
// Split k: workgroup z of the dispatch takes k's columns [z k_chunk, (z + 1) k_chunk) and writes
// its product into plane z of y (m*n values from z*m*n on); a dispatch of one plane (z = 0,
// k_chunk >= k) is the whole product. layer_norm_add_f16 sums the planes into the residual
// stream in a fixed order, so results do not depend on which workgroup finishes first.
//
// Contract: n even, k a multiple of 4 (any m); k_chunk a multiple of BK, and z k_chunk < k
// for every z of the dispatch; x holds m*k, w n*k, b n (when flagged) and y m*n values per
// plane (f32, or f16 pairs packed into u32s with flag 8). Rows past m or n are clamped onto the
// last one (their results are never written), columns past the workgroup's slice of k read as
// zeros.

const BM: u32 = 64u; // substituted: rows of y per workgroup
const BN: u32 = 64u; // substituted: columns of y per workgroup
const TM: u32 = 2u; // substituted: 16-row tiles per subgroup
const TN: u32 = 2u; // substituted: 16-column tiles per subgroup
const SGN: u32 = 2u; // substituted: subgroups across BN (= BN / (16 TN))
const BK: u32 = 32u;
// Tiles are held as vec4<f16>: cooperative loads take their offsets and strides in units of
// the pointee type. A staged row is BK + 8 f16s: 16-byte aligned, and the 8 rows a tile load
// touches at once fall on distinct banks.
const LDT: u32 = BK / 4u + 2u;
const ROW_VECS: u32 = BK / 4u;
const GEMM_THREADS: u32 = (BM / (16u * TM)) * SGN * 32u;
const A_TILE: u32 = BM * LDT;
const B_TILE: u32 = BN * LDT;

struct GemmParams { m: u32, n: u32, k: u32, flags: u32, k_chunk: u32, p0: u32, p1: u32, p2: u32 };
// flags: 1 = add bias, 2 = tanh-GELU, 4 = add into y (f32 residual), 8 = write f16 pairs

@group(0) @binding(0) var<storage, read> gx: array<vec4<f16>>;
// <w-source>: f16 weights. With MX weights, vision_gpu.rs replaces this block with bindings
// `mx_codes` (1) and `mx_scales` (5), WRaw = the words `mx_load4` fetches, and `w_decode` =
// `mx_unpack4` (mx_quant::wgsl::DECODE_SOURCE; every GEMM's k is then a multiple of 32).
// Fetching and decoding are apart so the loads stay in flight while the tile multiplies.
@group(0) @binding(1) var<storage, read> gw: array<vec4<f16>>;
alias WRaw = vec4<f16>;
// What holds elements at .. at + 3 of w (row-major n x k; at a multiple of 4).
fn w_load(at: u32) -> WRaw {
    return gw[at / 4u];
}
fn w_decode(raw: WRaw) -> vec4<f16> {
    return raw;
}
// </w-source>
@group(0) @binding(2) var<storage, read> gb: array<f32>;
@group(0) @binding(3) var<storage, read_write> gy: array<u32>;
@group(0) @binding(4) var<uniform> gp: GemmParams;

// This workgroup's slice of k, [k_begin, k_end), and where its plane of y starts.
var<private> k_begin: u32;
var<private> k_end: u32;
var<private> plane: u32;

var<workgroup> ta: array<vec4<f16>, 2u * A_TILE>;
var<workgroup> tb: array<vec4<f16>, 2u * B_TILE>;
var<workgroup> tc: array<f32, (GEMM_THREADS / 32u) * 256u>;

fn gelu_tanh(x: f32) -> f32 {
    let c = 0.7978845608028654;
    return 0.5 * x * (1.0 + tanh(c * (x + 0.044715 * x * x * x)));
}

// Vector `e` of the rows x BK tile of x at (row0, t) of the workgroup's slice of k: the last
// row stands in for rows past the end, zeros for columns past the slice.
fn fetch_x(e: u32, row0: u32, t: u32) -> vec4<f16> {
    let r = min(row0 + e / ROW_VECS, gp.m - 1u);
    let c = k_begin + t + (e % ROW_VECS) * 4u;
    if (c >= k_end) {
        return vec4<f16>(0.0h);
    }
    return gx[(r * gp.k + c) / 4u];
}

// The same for w (still raw: `w_decode` makes it values), zeros past the slice.
fn fetch_w(e: u32, col0: u32, t: u32) -> WRaw {
    let r = min(col0 + e / ROW_VECS, gp.n - 1u);
    let c = k_begin + t + (e % ROW_VECS) * 4u;
    if (c >= k_end) {
        return WRaw();
    }
    return w_load(r * gp.k + c);
}

// The epilogue of one 16x16 accumulator tile at (r0, c0) of y, through the subgroup's
// scratch: lane l finishes columns 2 (l % 8) and 2 (l % 8) + 1 of rows 4 (l / 8) .. + 4, so each
// step's reads fall on distinct bank pairs and 8 lanes write one contiguous row segment.
fn finish_tile(acc: coop_mat16x16<f32, C>, sg: u32, lane: u32, r0: u32, c0: u32) {
    coopStoreT(acc, &tc[sg * 256u], 16u);
    workgroupBarrier();
    let pair = (lane % 8u) * 2u;
    let col = c0 + pair;
    let flags = gp.flags;
    for (var j = 0u; j < 4u; j++) {
        let rt = (lane / 8u) * 4u + j;
        let row = r0 + rt;
        if (row < gp.m && col < gp.n) {
            var v = vec2<f32>(tc[sg * 256u + rt * 16u + pair], tc[sg * 256u + rt * 16u + pair + 1u]);
            if ((flags & 1u) != 0u) { v += vec2<f32>(gb[col], gb[col + 1u]); }
            if ((flags & 2u) != 0u) { v = vec2<f32>(gelu_tanh(v.x), gelu_tanh(v.y)); }
            let o = plane + row * gp.n + col;
            if ((flags & 8u) != 0u) {
                gy[o / 2u] = pack2x16float(v);
            } else {
                if ((flags & 4u) != 0u) {
                    v += vec2<f32>(bitcast<f32>(gy[o]), bitcast<f32>(gy[o + 1u]));
                }
                gy[o] = bitcast<u32>(v.x);
                gy[o + 1u] = bitcast<u32>(v.y);
            }
        }
    }
    workgroupBarrier();
}

@compute @workgroup_size(GEMM_THREADS, 1, 1)
fn gemm_coop(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let row0 = wid.y * BM;
    let col0 = wid.x * BN;
    k_begin = wid.z * gp.k_chunk;
    k_end = min(gp.k, k_begin + gp.k_chunk);
    plane = wid.z * gp.m * gp.n;
    let steps = (k_end - k_begin + BK - 1u) / BK;
    // This subgroup's 16 TM x 16 TN block of the workgroup's.
    let sr = sg / SGN;
    let sc = sg % SGN;
    // <accumulators>
    // <k-loop>
    let r0 = row0 + sr * 16u * TM;
    let c0 = col0 + sc * 16u * TN;
    // <epilogue>
}

// ---------------------------------------------------------------------------------------------
// f32 to f16 (the patch embedding's and the connector's inputs). Contract: cv_len.x values in
// and out.
@group(0) @binding(0) var<storage, read> cv_in: array<f32>;
@group(0) @binding(1) var<storage, read_write> cv_out: array<f16>;
@group(0) @binding(2) var<uniform> cv_len: vec4<u32>;

@compute @workgroup_size(64, 1, 1)
fn to_f16(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.y * 65535u * 64u + gid.x;
    if (i < cv_len.x) {
        cv_out[i] = f16(cv_in[i]);
    }
}

// ---------------------------------------------------------------------------------------------
// LayerNorm of f32 rows into f16 rows (the next GEMM's input): one subgroup per row, 4 rows per
// workgroup. Each lane loads its share of the row once, as vectors into named registers, and
// the mean and variance are taken from them (sums in f32 by subgroupAdd), so the row is read
// from memory once and the kernel waits on memory once. Contract: ln_p = (rows, width, eps
// bits, _), width a multiple of 4 and at most 128 * LN_VECS; x and y hold rows * width values.
const LN_VECS: u32 = 6u; // substituted: vectors per lane, the tower's width / 128 rounded up
@group(0) @binding(0) var<storage, read> ln_x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> ln_w: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> ln_b: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> ln_y: array<vec2<u32>>;
@group(0) @binding(4) var<uniform> ln_p: vec4<u32>;

@compute @workgroup_size(128, 1, 1)
fn layer_norm_f16(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let row = wid.x * 4u + sg;
    if (row >= ln_p.x) {
        return;
    }
    let w4 = ln_p.y / 4u;
    let base = row * w4;
    var s = 0.0;
    // <ln-load>
    let mean = subgroupAdd(s) / f32(ln_p.y);
    var q = 0.0;
    // <ln-square>
    let inv = inverseSqrt(subgroupAdd(q) / f32(ln_p.y) + bitcast<f32>(ln_p.z));
    // <ln-store>
}

// The same LayerNorm after finishing a residual GEMM split over k: each row of x becomes
// x + b + the sum of the GEMM's planes (in plane order), is written back, and is normalised
// into y. Contract: as layer_norm_f16, with ln_p.w planes of rows * width values in lna_parts
// and width values in lna_bias.
@group(0) @binding(0) var<storage, read_write> lna_x: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> lna_parts: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> lna_bias: array<vec4<f32>>;

@compute @workgroup_size(128, 1, 1)
fn layer_norm_add_f16(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let row = wid.x * 4u + sg;
    if (row >= ln_p.x) {
        return;
    }
    let w4 = ln_p.y / 4u;
    let base = row * w4;
    let plane4 = ln_p.x * w4;
    var s = 0.0;
    // <lna-load>
    let mean = subgroupAdd(s) / f32(ln_p.y);
    var q = 0.0;
    // <lna-square>
    let inv = inverseSqrt(subgroupAdd(q) / f32(ln_p.y) + bitcast<f32>(ln_p.z));
    // <lna-store>
}

// ---------------------------------------------------------------------------------------------
// FlashAttention on tensor cores. A workgroup takes 16 * QSUB queries of one head, 16 per
// subgroup, and walks all keys in blocks of 64: every invocation stages its share of the
// block's K and V (8-byte vector loads) into workgroup memory, shared by the subgroups, and
// fetches the next block's into registers while the subgroups compute. Per subgroup and block:
// S = Q K^T as 4 coop tiles (f16 in, f32 out) into its workgroup scratch; the online softmax
// in f32 with two lanes per query row, which keep the row's running max and sum in registers
// (base-2 exponents, log2(e) folded into the scale); P rounded to f16; P V as coop tiles into
// the scratch; and each lane rescales and adds two columns of the output, held in registers.
// The score matrix never exists beyond 16 x 64 per subgroup.
//
// Contract: q, k and v are the columns [0, h), [h, 2h), [2h, 3h) of one f16 buffer of n rows
// of 3h (the fused QKV projection); n a multiple of 16 * QSUB and of 64; head_dim a multiple
// of 16, at most 64; h a multiple of 4; the output is n x h f16 (pairs packed into u32s).

const QSUB: u32 = 4u; // substituted: subgroups (16 queries each) per workgroup, 2 or 4
// Staged K and V rows: up to 64 f16s as 16 vectors, plus 2 so the 8 rows a tile load touches
// fall on distinct banks.
const LDK: u32 = 18u;

struct AttnParams { n: u32, heads: u32, hd: u32, h: u32, scale_log2: f32, p0: u32, p1: u32, p2: u32 };

@group(0) @binding(0) var<storage, read> qkv: array<f16>;
@group(0) @binding(1) var<storage, read_write> att_out: array<u32>;
@group(0) @binding(2) var<uniform> ap: AttnParams;
@group(0) @binding(3) var<storage, read> qkv4: array<vec4<f16>>;

var<workgroup> kv_k: array<vec4<f16>, 64u * LDK>;
var<workgroup> kv_v: array<vec4<f16>, 64u * LDK>;
// Per subgroup, 16 rows of LDS: the 16 x 64 scores, then P V (f32), and the probabilities
// (f16). Rows are 64 + 8 values apart, so the 8 rows an accumulator store or a tile load
// touches at once fall on distinct banks (at 64 they all hit the same 8 banks).
const LDS: u32 = 72u;
var<workgroup> s_ws: array<f32, QSUB * 16u * LDS>;
var<workgroup> p_ws: array<f16, QSUB * 16u * LDS>;

const ATT_THREADS: u32 = QSUB * 32u;

// Vector `e` (row e / 16, vector e % 16) of the K (`part` 1) or V (`part` 2) block at key j0:
// zeros past head_dim.
fn fetch_kv(part: u32, e: u32, j0: u32, col: u32) -> vec4<f16> {
    let c = (e % 16u) * 4u;
    if (c >= ap.hd) {
        return vec4<f16>(0.0h);
    }
    return qkv4[((j0 + e / 16u) * 3u * ap.h + part * ap.h + col + c) / 4u];
}

@compute @workgroup_size(ATT_THREADS, 1, 1)
fn attention_coop(
    @builtin(local_invocation_index) tid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let h = ap.h;
    let stride = 3u * h;
    let hd = ap.hd;
    let col = wid.y * hd;
    let q0 = wid.x * 16u * QSUB + sg * 16u;
    // This subgroup's 16 queries as up to 4 tiles of 16 dimensions.
    let qa = coopLoadT<coop_mat16x16<f16, A>>(&qkv[q0 * stride + col], stride);
    var qb = qa;
    var qc = qa;
    var qd = qa;
    if (hd > 16u) { qb = coopLoadT<coop_mat16x16<f16, A>>(&qkv[q0 * stride + col + 16u], stride); }
    if (hd > 32u) { qc = coopLoadT<coop_mat16x16<f16, A>>(&qkv[q0 * stride + col + 32u], stride); }
    if (hd > 48u) { qd = coopLoadT<coop_mat16x16<f16, A>>(&qkv[q0 * stride + col + 48u], stride); }
    // Lane pair (2r, 2r + 1) owns query row r's softmax: its running max and sum.
    let r = lane / 2u;
    let half = lane % 2u;
    // Lane l visits its 32 keys starting at rot: with rows LDS apart, each step's 32 reads then
    // fall on banks (j + l) % 32, all distinct.
    let rot = (lane + 32u - (8u * r) % 32u) % 32u;
    var m_run = -3.0e38;
    var l_run = 0.0;
    // <o-registers>
    let ws = sg * 16u * LDS;
    // <kv-registers>
    for (var j0 = 0u; j0 < ap.n; j0 += 64u) {
        // <kv-stage>
        workgroupBarrier();
        if (j0 + 64u < ap.n) {
            // <kv-refill>
        }
        // S for keys j0 + 16t: B = K^T, column-major (a column is a row of K).
        var s0 = coopMultiplyAdd(qa, coopLoad<coop_mat16x16<f16, B>>(&kv_k[0], LDK), coop_mat16x16<f32, C>());
        var s1 = coopMultiplyAdd(qa, coopLoad<coop_mat16x16<f16, B>>(&kv_k[16u * LDK], LDK), coop_mat16x16<f32, C>());
        var s2 = coopMultiplyAdd(qa, coopLoad<coop_mat16x16<f16, B>>(&kv_k[32u * LDK], LDK), coop_mat16x16<f32, C>());
        var s3 = coopMultiplyAdd(qa, coopLoad<coop_mat16x16<f16, B>>(&kv_k[48u * LDK], LDK), coop_mat16x16<f32, C>());
        if (hd > 16u) {
            s0 = coopMultiplyAdd(qb, coopLoad<coop_mat16x16<f16, B>>(&kv_k[4u], LDK), s0);
            s1 = coopMultiplyAdd(qb, coopLoad<coop_mat16x16<f16, B>>(&kv_k[16u * LDK + 4u], LDK), s1);
            s2 = coopMultiplyAdd(qb, coopLoad<coop_mat16x16<f16, B>>(&kv_k[32u * LDK + 4u], LDK), s2);
            s3 = coopMultiplyAdd(qb, coopLoad<coop_mat16x16<f16, B>>(&kv_k[48u * LDK + 4u], LDK), s3);
        }
        if (hd > 32u) {
            s0 = coopMultiplyAdd(qc, coopLoad<coop_mat16x16<f16, B>>(&kv_k[8u], LDK), s0);
            s1 = coopMultiplyAdd(qc, coopLoad<coop_mat16x16<f16, B>>(&kv_k[16u * LDK + 8u], LDK), s1);
            s2 = coopMultiplyAdd(qc, coopLoad<coop_mat16x16<f16, B>>(&kv_k[32u * LDK + 8u], LDK), s2);
            s3 = coopMultiplyAdd(qc, coopLoad<coop_mat16x16<f16, B>>(&kv_k[48u * LDK + 8u], LDK), s3);
        }
        if (hd > 48u) {
            s0 = coopMultiplyAdd(qd, coopLoad<coop_mat16x16<f16, B>>(&kv_k[12u], LDK), s0);
            s1 = coopMultiplyAdd(qd, coopLoad<coop_mat16x16<f16, B>>(&kv_k[16u * LDK + 12u], LDK), s1);
            s2 = coopMultiplyAdd(qd, coopLoad<coop_mat16x16<f16, B>>(&kv_k[32u * LDK + 12u], LDK), s2);
            s3 = coopMultiplyAdd(qd, coopLoad<coop_mat16x16<f16, B>>(&kv_k[48u * LDK + 12u], LDK), s3);
        }
        coopStoreT(s0, &s_ws[ws], LDS);
        coopStoreT(s1, &s_ws[ws + 16u], LDS);
        coopStoreT(s2, &s_ws[ws + 32u], LDS);
        coopStoreT(s3, &s_ws[ws + 48u], LDS);
        workgroupBarrier();
        // Online softmax: this lane's 32 keys of row r, the pair combined by a shuffle, visited
        // from `rot` on so each step's 32 reads hit 32 banks.
        let base = ws + r * LDS + half * 32u;
        var mx = -3.0e38;
        for (var j = 0u; j < 32u; j++) {
            mx = max(mx, s_ws[base + (j + rot) % 32u]);
        }
        mx = max(mx, subgroupShuffleXor(mx, 1u));
        let m_new = max(m_run, mx * ap.scale_log2);
        var sum = 0.0;
        for (var j = 0u; j < 32u; j++) {
            let at = base + (j + rot) % 32u;
            let p = exp2(s_ws[at] * ap.scale_log2 - m_new);
            sum += p;
            p_ws[at] = f16(p);
        }
        sum += subgroupShuffleXor(sum, 1u);
        let alpha = exp2(m_run - m_new);
        l_run = l_run * alpha + sum;
        m_run = m_new;
        workgroupBarrier();
        let p0 = coopLoadT<coop_mat16x16<f16, A>>(&p_ws[ws], LDS);
        let p1 = coopLoadT<coop_mat16x16<f16, A>>(&p_ws[ws + 16u], LDS);
        let p2 = coopLoadT<coop_mat16x16<f16, A>>(&p_ws[ws + 32u], LDS);
        let p3 = coopLoadT<coop_mat16x16<f16, A>>(&p_ws[ws + 48u], LDS);
        // P V, 16 dimensions at a time: B = V, row-major (a row is one key's values).
        for (var dt = 0u; dt < hd; dt += 16u) {
            let d4 = dt / 4u;
            var acc = coopMultiplyAdd(p0, coopLoadT<coop_mat16x16<f16, B>>(&kv_v[d4], LDK), coop_mat16x16<f32, C>());
            acc = coopMultiplyAdd(p1, coopLoadT<coop_mat16x16<f16, B>>(&kv_v[16u * LDK + d4], LDK), acc);
            acc = coopMultiplyAdd(p2, coopLoadT<coop_mat16x16<f16, B>>(&kv_v[32u * LDK + d4], LDK), acc);
            acc = coopMultiplyAdd(p3, coopLoadT<coop_mat16x16<f16, B>>(&kv_v[48u * LDK + d4], LDK), acc);
            coopStoreT(acc, &s_ws[ws + dt], LDS);
        }
        workgroupBarrier();
        // Lane l accumulates output columns 2l and 2l + 1 of all 16 rows (o{row}, a vec2);
        // row r's rescale factor comes from lane 2r.
        // <o-update>
    }
    // <o-write>
}
