// y[t][row] = sum_k W[row][k] x[t][k] for up to NT tokens per workgroup row (decode and short
// batches): lane groups of LANES invocations striding RPL neighbouring rows four elements at a
// time (each x value read once for the RPL rows), 256 / LANES groups per workgroup, every
// decoded weight used for all NT tokens, the lanes' sums added by subgroup shuffles and, for
// rows wider than a subgroup, through workgroup memory. The module declares NT, LANES, RPL,
// W_FORMAT and the linear_io.wgsl constants.
//
// A folded RMSNorm (IN_MODE 1) costs no pass of its own: rms_norm(x) * gain = (x * gain) / rms,
// and 1 / rms is the same for every output row, so the loop takes dot(w, x * gain) and the
// sum of squares of x together (a row's lanes see all of x between them), the reduction adds both,
// and the scale is applied to the sum. The step waits on one round of loads, not two.
//
// The module also declares `gemv_argmax` (linear_gemv_argmax.wgsl for the output head's
// variant, else an empty function) and NO_ROW.
const WG: u32 = 256u;
// Row groups per workgroup; each takes RPL neighbouring rows.
const GROUPS: u32 = WG / LANES;
const ROWS_PER_WG: u32 = GROUPS * RPL;
// Loop steps whose weight loads are in flight together: 3 (a 576-column row's whole share at
// 64 lanes) was the fastest of 2, 3 and 4 on the H200 (README, "Decoder on the GPU").
const UNROLL: u32 = 3u;
// Each row's subgroup sums (at most LANES per row and token), then the row's total in its
// first slot.
var<workgroup> red: array<f32, NT * WG * RPL>;
// The same for the first group's sums of squares (IN_MODE 1).
var<workgroup> red_ss: array<f32, NT * LANES>;

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_size) sg_size: u32,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let lane = lid % LANES;
    let group = lid / LANES;
    let row0 = (wg.x * GROUPS + group) * RPL;
    let span = step_linear_rows(pc.selected);
    let t0 = wg.y * NT;
    if (t0 >= span.y) {
        return;
    }
    let nt = min(NT, span.y - t0);
    let k4s = pc.cols / 4u;
    var acc: array<f32, NT * RPL>;
    var ss: array<f32, NT>;
    if (row0 < pc.rows) {
        let rows_here = min(RPL, pc.rows - row0);
        // UNROLL steps at a time: every weight load of the group is issued before the first
        // is decoded, so a lane waits on memory once per group rather than once per step.
        for (var base = lane; base < k4s; base += LANES * UNROLL) {
            var raw: array<vec4<u32>, UNROLL * RPL>;
            for (var u = 0u; u < UNROLL; u++) {
                let k4 = base + u * LANES;
                for (var r = 0u; r < RPL; r++) {
                    if (k4 < k4s && r < rows_here) {
                        raw[u * RPL + r] = w4_load(row0 + r, k4 * 4u, pc.cols);
                    }
                }
            }
            for (var u = 0u; u < UNROLL; u++) {
                let k4 = base + u * LANES;
                if (k4 < k4s) {
                    for (var t = 0u; t < NT; t++) {
                        if (t < nt) {
                            // A folded norm's input stage scales by 1 here, by 1 / rms below.
                            let xv = load_x(span.x + t0 + t, k4, 1.0);
                            for (var r = 0u; r < RPL; r++) {
                                acc[t * RPL + r] += dot(w4_unpack(raw[u * RPL + r]), xv);
                            }
                            if (IN_MODE == 1u) {
                                let v = x[(span.x + t0 + t) * k4s + k4];
                                ss[t] += dot(v, v);
                            }
                        }
                    }
                }
            }
        }
    }
    // Each row's lanes add their sums by subgroup shuffles (a butterfly within aligned groups
    // of min(LANES, subgroup size) lanes), then across subgroups through workgroup memory. A
    // one-dimensional workgroup's subgroups are runs of consecutive invocations, so a row's
    // LANES invocations (also consecutive, from a multiple of LANES) fill whole aligned groups.
    let width = min(LANES, sg_size);
    for (var t = 0u; t < NT; t++) {
        var a: array<f32, RPL>;
        for (var r = 0u; r < RPL; r++) {
            a[r] = acc[t * RPL + r];
        }
        var q = ss[t];
        // One butterfly for the rows and the sum of squares together, so their shuffles
        // overlap rather than wait on each other.
        for (var mask = width / 2u; mask > 0u; mask >>= 1u) {
            for (var r = 0u; r < RPL; r++) {
                a[r] += subgroupShuffleXor(a[r], mask);
            }
            if (IN_MODE == 1u) {
                q += subgroupShuffleXor(q, mask);
            }
        }
        if (lane % width == 0u) {
            for (var r = 0u; r < RPL; r++) {
                red[((group * RPL + r) * NT + t) * LANES + lane / width] = a[r];
            }
            if (IN_MODE == 1u && group == 0u) {
                red_ss[t * LANES + lane / width] = q;
            }
        }
    }
    workgroupBarrier();
    if (LANES > width && lane == 0u) {
        for (var t = 0u; t < NT; t++) {
            for (var r = 0u; r < RPL; r++) {
                let i = ((group * RPL + r) * NT + t) * LANES;
                var a = red[i];
                for (var g = 1u; g < LANES / width; g++) {
                    a += red[i + g];
                }
                red[i] = a;
            }
            if (IN_MODE == 1u && group == 0u) {
                var q = red_ss[t * LANES];
                for (var g = 1u; g < LANES / width; g++) {
                    q += red_ss[t * LANES + g];
                }
                red_ss[t * LANES] = q;
            }
        }
    }
    workgroupBarrier();
    // The workgroup's invocations store its results, neighbouring rows from neighbouring
    // invocations, so each token's outputs go out as one run of values. The last one stored
    // (the only one, where the argmax variant runs) is offered to `gemv_argmax` unless NaN.
    var offered = 0.0;
    var offered_row = NO_ROW;
    for (var i = lid; i < ROWS_PER_WG * nt; i += WG) {
        let t = i / ROWS_PER_WG;
        let r = i % ROWS_PER_WG;
        let out_row = wg.x * ROWS_PER_WG + r;
        if (out_row < pc.rows) {
            var sum = red[(r * NT + t) * LANES];
            if (IN_MODE == 1u) {
                sum /= sqrt(red_ss[t * LANES] / f32(pc.cols) + pc.eps);
            }
            store_y((t0 + t) * pc.rows + out_row, sum);
            if (sum == sum) {
                offered = sum;
                offered_row = out_row;
            }
        }
    }
    gemv_argmax(lid, sg_size, wg.x, nwg.x, t0, nt, offered, offered_row);
}
