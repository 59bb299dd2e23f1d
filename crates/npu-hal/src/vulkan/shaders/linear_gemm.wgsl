// y[t][row] = sum_k W[row][k] x[t][k] for prefill batches: BM rows x BN tokens per workgroup,
// 4 x 4 outputs per invocation, the columns taken BK at a time into workgroup memory (the
// weights decoded once per tile). With KS > 1 the workgroup's invocations form KS groups, each
// summing its own BK-column slices of every KS * BK, added together at the end: a small tile
// with the depth split inside the workgroup, for layers whose outputs make too few tiles to
// fill the GPU. The module declares BM, BN, KS (with (BM / 4) (BN / 4) KS = 256 and BN <= BK
// when KS > 1), W_FORMAT and the linear_io.wgsl constants.
const BK: u32 = 32u;
// Invocations per K group, and how many row (token) quads a tile has.
const TPG: u32 = (BM / 4u) * (BN / 4u);
const RQ: u32 = BM / 4u;
const TQ: u32 = BN / 4u;
// [group][k][row / 4] and [group][k][token / 4]: each element packs four neighbouring rows
// (tokens). `ws` also holds the groups' partial sums at the end.
var<workgroup> ws: array<vec4<f32>, KS * BK * RQ>;
var<workgroup> xs: array<vec4<f32>, KS * BK * TQ>;
// The fused RMSNorm: partial sums, then 1 / rms per token of the tile.
var<workgroup> sq: array<f32, 256>;
var<workgroup> inv_s: array<f32, BN>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let span = step_linear_rows(pc.selected);
    let row0 = wg.x * BM;
    let tok0 = wg.y * BN;
    if (tok0 >= span.y) {
        return;
    }
    if (IN_MODE == 1u) {
        // 256 / BN invocations per token row, each a share of the columns.
        let per = 256u / BN;
        let r = lid / per;
        var s = 0.0;
        if (tok0 + r < span.y) {
            s = sum_squares(span.x + tok0 + r, lid % per, per);
        }
        sq[lid] = s;
        workgroupBarrier();
        if (lid < BN) {
            var total = 0.0;
            for (var i = 0u; i < per; i++) {
                total += sq[per * lid + i];
            }
            inv_s[lid] = 1.0 / sqrt(total / f32(pc.cols) + pc.eps);
        }
        workgroupBarrier();
    }
    let g = lid / TPG;
    let l = lid % TPG;
    let tr = l % RQ;
    let tt = l / RQ;
    let wbase = g * BK * RQ;
    let xbase = g * BK * TQ;
    var acc: array<vec4<f32>, 4>;
    for (var kb = 0u; kb < pc.cols; kb += KS * BK) {
        // Every group runs every step (the barriers need it); one past the columns loads zeros.
        let k0 = kb + g * BK;
        let live = k0 < pc.cols;
        for (var i = 0u; i < BM * BK / 4u / TPG; i++) {
            let idx = l + i * TPG;
            let r = idx / (BK / 4u);
            let kq = idx % (BK / 4u);
            var w = vec4<f32>(0.0);
            if (live && row0 + r < pc.rows) {
                w = w4(row0 + r, k0 + kq * 4u, pc.cols);
            }
            for (var j = 0u; j < 4u; j++) {
                ws[wbase + (kq * 4u + j) * RQ + r / 4u][r % 4u] = w[j];
            }
        }
        for (var i = 0u; i < BN * BK / 4u / TPG; i++) {
            let idx = l + i * TPG;
            let r = idx / (BK / 4u);
            let kq = idx % (BK / 4u);
            var v = vec4<f32>(0.0);
            if (live && tok0 + r < span.y) {
                var inv = 1.0;
                if (IN_MODE == 1u) {
                    inv = inv_s[r];
                }
                v = load_x(span.x + tok0 + r, k0 / 4u + kq, inv);
            }
            for (var j = 0u; j < 4u; j++) {
                xs[xbase + (kq * 4u + j) * TQ + r / 4u][r % 4u] = v[j];
            }
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk++) {
            let a = ws[wbase + kk * RQ + tr];
            let b = xs[xbase + kk * TQ + tt];
            acc[0] += a.x * b;
            acc[1] += a.y * b;
            acc[2] += a.z * b;
            acc[3] += a.w * b;
        }
        workgroupBarrier();
    }
    if (KS > 1u) {
        for (var i = 0u; i < 4u; i++) {
            ws[(g * TPG + l) * 4u + i] = acc[i];
        }
        workgroupBarrier();
        if (g == 0u) {
            for (var h = 1u; h < KS; h++) {
                for (var i = 0u; i < 4u; i++) {
                    acc[i] += ws[(h * TPG + l) * 4u + i];
                }
            }
        }
    }
    if (g != 0u) {
        return;
    }
    for (var i = 0u; i < 4u; i++) {
        let row = row0 + tr * 4u + i;
        for (var j = 0u; j < 4u; j++) {
            let t = tok0 + tt * 4u + j;
            if (row < pc.rows && t < span.y) {
                store_y(t * pc.rows + row, acc[i][j]);
            }
        }
    }
}
