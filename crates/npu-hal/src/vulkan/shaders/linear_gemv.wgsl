// y[t][row] = sum_k W[row][k] x[t][k] for up to NT tokens per workgroup row (decode and short
// batches): LANES invocations per row striding it four elements at a time, 256 / LANES rows per
// workgroup, every decoded weight used for all NT tokens, the lanes' sums added by subgroup
// shuffles and, for rows wider than a subgroup, through workgroup memory. The module declares
// NT, LANES, W_FORMAT and the linear_io.wgsl constants.
//
// A folded RMSNorm (IN_MODE 1) costs no pass of its own: rms_norm(x) * gain = (x * gain) / rms,
// and 1 / rms is the same for every output row, so the loop takes dot(w, x * gain) and the
// sum of squares of x together (a row's lanes see all of x between them), the reduction adds both,
// and the scale is applied to the sum. The step waits on one round of loads, not two.
const WG: u32 = 256u;
const ROWS_PER_WG: u32 = WG / LANES;
// Loop steps whose weight loads are in flight together: 3 (a 576-column row's whole share at
// 64 lanes) was the fastest of 2, 3 and 4 on the H200 (README, "Decoder on the GPU").
const UNROLL: u32 = 3u;
// Each row's subgroup sums (at most LANES per row and token), then the row's total in its
// first slot.
var<workgroup> red: array<f32, NT * WG>;
// The same for the first row's sums of squares (IN_MODE 1).
var<workgroup> red_ss: array<f32, NT * LANES>;

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_size) sg_size: u32,
) {
    let lane = lid % LANES;
    let local_row = lid / LANES;
    let row = wg.x * ROWS_PER_WG + local_row;
    let span = step_linear_rows(pc.selected);
    let t0 = wg.y * NT;
    if (t0 >= span.y) {
        return;
    }
    let nt = min(NT, span.y - t0);
    let k4s = pc.cols / 4u;
    var acc: array<f32, NT>;
    var ss: array<f32, NT>;
    if (row < pc.rows) {
        // UNROLL steps at a time: every weight load of the group is issued before the first
        // is decoded, so a lane waits on memory once per group rather than once per step.
        for (var base = lane; base < k4s; base += LANES * UNROLL) {
            var raw: array<vec4<u32>, UNROLL>;
            for (var u = 0u; u < UNROLL; u++) {
                let k4 = base + u * LANES;
                if (k4 < k4s) {
                    raw[u] = w4_load(row, k4 * 4u, pc.cols);
                }
            }
            for (var u = 0u; u < UNROLL; u++) {
                let k4 = base + u * LANES;
                if (k4 < k4s) {
                    let w = w4_unpack(raw[u]);
                    for (var t = 0u; t < NT; t++) {
                        if (t < nt) {
                            // A folded norm's input stage scales by 1 here, by 1 / rms below.
                            acc[t] += dot(w, load_x(span.x + t0 + t, k4, 1.0));
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
        var a = acc[t];
        var q = ss[t];
        for (var mask = width / 2u; mask > 0u; mask >>= 1u) {
            a += subgroupShuffleXor(a, mask);
            if (IN_MODE == 1u) {
                q += subgroupShuffleXor(q, mask);
            }
        }
        if (lane % width == 0u) {
            red[(local_row * NT + t) * LANES + lane / width] = a;
            if (IN_MODE == 1u && local_row == 0u) {
                red_ss[t * LANES + lane / width] = q;
            }
        }
    }
    workgroupBarrier();
    if (LANES > width && lane == 0u) {
        for (var t = 0u; t < NT; t++) {
            let i = (local_row * NT + t) * LANES;
            var a = red[i];
            var q = red_ss[t * LANES];
            for (var g = 1u; g < LANES / width; g++) {
                a += red[i + g];
                q += red_ss[t * LANES + g];
            }
            red[i] = a;
            if (IN_MODE == 1u && local_row == 0u) {
                red_ss[t * LANES] = q;
            }
        }
    }
    workgroupBarrier();
    // The workgroup's first invocations store its results, neighbouring rows from
    // neighbouring invocations, so each token's outputs go out as one run of values.
    if (lid < ROWS_PER_WG * nt) {
        let t = lid / ROWS_PER_WG;
        let r = lid % ROWS_PER_WG;
        let out_row = wg.x * ROWS_PER_WG + r;
        if (out_row < pc.rows) {
            var sum = red[(r * NT + t) * LANES];
            if (IN_MODE == 1u) {
                sum /= sqrt(red_ss[t * LANES] / f32(pc.cols) + pc.eps);
            }
            store_y((t0 + t) * pc.rows + out_row, sum);
        }
    }
}
