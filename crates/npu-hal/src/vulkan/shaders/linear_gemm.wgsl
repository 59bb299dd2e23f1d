// y[t][row] = sum_k W[row][k] x[t][k] for prefill batches: 64 rows x 64 tokens per workgroup,
// BK columns per step staged in workgroup memory (the weights decoded once per tile), 4 x 4
// outputs per invocation. Holding the next step's loads in registers while a step computes
// measured slower on the H200 (pp512 47.5k against 50.1k tokens/s at BK 32: the registers cost
// more occupancy than the overlap won), so each step loads, then computes. The module declares
// W_FORMAT, SPLIT_K and the linear_io.wgsl constants.
//
// Split-K (SPLIT_K 1): the grid's z dimension cuts the columns into that many ranges of whole
// BK steps, one workgroup each, for layers whose tiles are too few to fill the GPU. Each
// stores its raw sums to y laid out [z][token][row] (a scratch tensor), and split_reduce.wgsl
// adds them up (and does the output stage) in a second pass, in a fixed order.
const BM: u32 = 64u;
const BN: u32 = 64u;
// Columns per step (a multiple of 16), and each step's four-column groups. 16 was the fastest
// of 16, 32 and 64 on the H200 (pp512 51.5-51.6k tokens/s against 50.3-50.5k at 32 and 42.2k
// at 64, alternating in one call; README, "Decoder on the GPU", sixth sitting): a smaller tile of workgroup memory leaves room for more
// workgroups per core.
const BK: u32 = 16u;
const KQ: u32 = BK / 4u;
const THREADS: u32 = 256u;
// [k][row / 4] and [k][token / 4]: each element packs four neighbouring rows (tokens).
var<workgroup> ws: array<vec4<f32>, BK * 16u>;
var<workgroup> xs: array<vec4<f32>, BK * 16u>;

@compute @workgroup_size(THREADS)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let span = step_linear_rows(pc.selected);
    let row0 = wg.x * BM;
    let tok0 = wg.y * BN;
    if (tok0 >= span.y) {
        return;
    }
    if (IN_MODE == 1u) {
        tile_inv_rms(tok0, span, lid);
    }
    let tr = lid % 16u;
    let tt = lid / 16u;
    var acc: array<vec4<f32>, 4>;
    // This workgroup's columns: all of them, or its split's share.
    let per = ((pc.cols + groups.z - 1u) / groups.z + BK - 1u) / BK * BK;
    let k_lo = min(pc.cols, wg.z * per);
    let k_hi = min(pc.cols, k_lo + per);
    for (var k0 = k_lo; k0 < k_hi; k0 += BK) {
        for (var i = 0u; i < BK / 16u; i++) {
            let idx = lid + i * 256u;
            stage_store(stage_load(row0, tok0, span, k0, k_hi, idx), row0, tok0, span, idx);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk++) {
            let a = ws[kk * 16u + tr];
            let b = xs[kk * 16u + tt];
            acc[0] += a.x * b;
            acc[1] += a.y * b;
            acc[2] += a.z * b;
            acc[3] += a.w * b;
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let row = row0 + tr * 4u + i;
        for (var j = 0u; j < 4u; j++) {
            let t = tok0 + tt * 4u + j;
            if (row < pc.rows && t < span.y) {
                if (SPLIT_K != 0u) {
                    y[(wg.z * span.y + t) * pc.rows + row] = acc[i][j];
                } else {
                    store_y(t * pc.rows + row, acc[i][j]);
                }
            }
        }
    }
}

// Decodes slot `idx`'s loads into the tiles: each element of `ws` packs four neighbouring
// rows, of `xs` four neighbouring tokens.
fn stage_store(s: Staged, row0: u32, tok0: u32, span: vec2<u32>, idx: u32) {
    let r = idx / KQ;
    let kq = idx % KQ;
    let w = staged_w(s, row0, r);
    for (var j = 0u; j < 4u; j++) {
        ws[(kq * 4u + j) * 16u + r / 4u][r % 4u] = w[j];
    }
    let v = staged_x(s, tok0, span, r);
    for (var j = 0u; j < 4u; j++) {
        xs[(kq * 4u + j) * 16u + r / 4u][r % 4u] = v[j];
    }
}
