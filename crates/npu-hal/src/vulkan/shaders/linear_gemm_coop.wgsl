// linear_gemm.wgsl on tensor cores: the same y[t][row] = sum_k W[row][k] x[t][k] over the same
// 64-row x 64-token tiles, grid and split-K layout, with the products as cooperative matrices
// (Vulkan's VK_KHR_cooperative_matrix; 16x16x16, f16 inputs, f32 sums). The weights are decoded
// from their format and x goes through its input stage in f32, as in the SIMT kernel; both are
// rounded to f16 only as they are staged in workgroup memory, and every sum is f32. (So an input
// beyond f16's range, 65504, becomes infinite: the backend keeps f32 weights, whose policies
// promise f32 arithmetic, on the SIMT kernel.)
//
// A workgroup is 4 subgroups of 32 lanes (the backend runs this kernel only on such devices);
// each computes 32 tokens x 32 rows as 2 x 2 accumulator tiles. Columns advance BK = 32 at a
// time through two staged buffers of each tile: every invocation holds its four slots of the
// next step in registers (stage_load) while the subgroups multiply the current one, and
// stores them into the other buffer before the next step's barrier, so a step takes one
// barrier. The module declares W_FORMAT, SPLIT_K, the linear_io.wgsl constants and
// linear_gemm_stage.wgsl; the module source opens with `enable f16; enable
// wgpu_cooperative_matrix;`.
//
// Every workgroup variable of this module (linear_gemm_stage.wgsl's too) is a whole number of
// 16-byte vectors. On the H200 a 4-byte variable among them (the token count, as a u32) made
// every output come from the neighbouring column, through the scratch, and zeroed some columns
// of the tiles; with it widened to a vec4 every output is right. (Cooperative loads and stores
// want 16-byte aligned rows, and the driver lays the variables out at their own alignment.)
//
// The cooperative loads read 16 rows of 16 f16s from the element they point at, with a stride
// of LDT vectors; every pointer below is row 0, 16, 32 or 48 of a 64-row tile at an offset of 0
// or 4 vectors (of KQ = 8), so each load stays inside its buffer.
const BM: u32 = 64u;
const BN: u32 = 64u;
const BK: u32 = 32u;
const KQ: u32 = BK / 4u;
const THREADS: u32 = 128u;
// Each invocation stages four of a step's 64 KQ slots.
const_assert 4u * THREADS == 64u * KQ;
// A staged row: BK f16s as vec4<f16> (cooperative loads count offsets and strides in the
// pointee type), plus two vectors of padding, so the rows one load reads start on different
// banks.
const LDT: u32 = KQ + 2u;
const TILE: u32 = 64u * LDT;
// [buffer][row][k] of W and [buffer][token][k] of x.
var<workgroup> wt: array<vec4<f16>, 2u * TILE>;
var<workgroup> xt: array<vec4<f16>, 2u * TILE>;
// Each subgroup's 16 x 16 scratch for its accumulators' output stage.
var<workgroup> ct: array<f32, 4u * 256u>;
var<workgroup> tokens_uniform: vec4<u32>;

// Decodes slot `idx`'s loads into buffer `buf` of the tiles, rounded to f16.
fn stage_store_f16(s: Staged, buf: u32, row0: u32, tok0: u32, span: vec2<u32>, idx: u32) {
    let r = idx / KQ;
    let at = buf * TILE + r * LDT + idx % KQ;
    wt[at] = vec4<f16>(staged_w(s, row0, r));
    xt[at] = vec4<f16>(staged_x(s, tok0, span, r));
}

// Stores `c` row-major at ct[at ..]. A function of its own because naga 30 lowers coopStore
// without first emitting the expressions its operands are computed from: computed in place
// (`&y[t0 * pc.rows + r0]` with stride `pc.rows`, tried) the module fails to compile
// ("Expression is not cached"). Here the pointer's index is an argument, which needs no emitting.
fn store_scratch(c: coop_mat16x16<f32, C>, at: u32) {
    coopStoreT(c, &ct[at], 16u);
}

// The output stage of one accumulator tile (tokens t0.., rows r0..) through the subgroup's
// scratch: lane l stores row r0 + l % 16 of tokens t0 + l / 16, + 2, .., so 16 lanes store
// one run of neighbouring rows. Called by the whole workgroup (it holds barriers).
fn finish(c: coop_mat16x16<f32, C>, sg: u32, lane: u32, t0: u32, r0: u32, span: vec2<u32>, z: u32) {
    store_scratch(c, sg * 256u);
    workgroupBarrier();
    let row = r0 + lane % 16u;
    for (var j = 0u; j < 8u; j++) {
        let tt = lane / 16u + 2u * j;
        let t = t0 + tt;
        if (row < pc.rows && t < span.y) {
            let v = ct[sg * 256u + tt * 16u + lane % 16u];
            if (SPLIT_K != 0u) {
                y[(z * span.y + t) * pc.rows + row] = v;
            } else {
                store_y(t * pc.rows + row, v);
            }
        }
    }
    workgroupBarrier();
}

@compute @workgroup_size(THREADS)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let span = step_linear_rows(pc.selected);
    let row0 = wg.x * BM;
    let tok0 = wg.y * BN;
    // Cooperative operations need uniform control flow, and naga counts a value read from a
    // storage buffer as varying: the token count goes through workgroup memory to be uniform.
    if (lid == 0u) {
        tokens_uniform = vec4<u32>(span.y);
    }
    if (tok0 >= workgroupUniformLoad(&tokens_uniform).x) {
        return;
    }
    if (IN_MODE == 1u) {
        tile_inv_rms(tok0, span, lid);
    }
    // This subgroup's 32 tokens and 32 rows of the tile.
    let st = (sg / 2u) * 32u;
    let sr = (sg % 2u) * 32u;
    // Tokens st.. (A: x, row-major [token][k]) times rows sr.. (B = W^T, column-major: W's
    // rows are its columns), as 2 x 2 tiles.
    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    // This workgroup's columns: all of them, or its split's share, in whole steps.
    let per = ((pc.cols + groups.z - 1u) / groups.z + BK - 1u) / BK * BK;
    let k_lo = min(pc.cols, wg.z * per);
    let k_hi = min(pc.cols, k_lo + per);
    var s0 = stage_load(row0, tok0, span, k_lo, k_hi, lid);
    var s1 = stage_load(row0, tok0, span, k_lo, k_hi, lid + THREADS);
    var s2 = stage_load(row0, tok0, span, k_lo, k_hi, lid + 2u * THREADS);
    var s3 = stage_load(row0, tok0, span, k_lo, k_hi, lid + 3u * THREADS);
    var buf = 0u;
    for (var k0 = k_lo; k0 < k_hi; k0 += BK) {
        stage_store_f16(s0, buf, row0, tok0, span, lid);
        stage_store_f16(s1, buf, row0, tok0, span, lid + THREADS);
        stage_store_f16(s2, buf, row0, tok0, span, lid + 2u * THREADS);
        stage_store_f16(s3, buf, row0, tok0, span, lid + 3u * THREADS);
        workgroupBarrier();
        // The next step's loads, in flight while this one multiplies (past k_hi: zeros).
        let next = k0 + BK;
        s0 = stage_load(row0, tok0, span, next, k_hi, lid);
        s1 = stage_load(row0, tok0, span, next, k_hi, lid + THREADS);
        s2 = stage_load(row0, tok0, span, next, k_hi, lid + 2u * THREADS);
        s3 = stage_load(row0, tok0, span, next, k_hi, lid + 3u * THREADS);
        let xb = buf * TILE + st * LDT;
        let wb = buf * TILE + sr * LDT;
        for (var kk = 0u; kk < KQ; kk += 4u) {
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&xt[xb + kk], LDT);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&xt[xb + 16u * LDT + kk], LDT);
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&wt[wb + kk], LDT);
            let b1 = coopLoad<coop_mat16x16<f16, B>>(&wt[wb + 16u * LDT + kk], LDT);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
        }
        buf ^= 1u;
    }
    finish(c00, sg, lane, tok0 + st, row0 + sr, span, wg.z);
    finish(c01, sg, lane, tok0 + st, row0 + sr + 16u, span, wg.z);
    finish(c10, sg, lane, tok0 + st + 16u, row0 + sr, span, wg.z);
    finish(c11, sg, lane, tok0 + st + 16u, row0 + sr + 16u, span, wg.z);
}
