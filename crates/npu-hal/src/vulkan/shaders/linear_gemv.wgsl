// y[t][row] = sum_k W[row][k] x[t][k] for up to NT tokens per workgroup row (decode and short
// batches): LANES invocations per row striding it four elements at a time, 256 / LANES rows per
// workgroup, every decoded weight used for all NT tokens, the lanes' sums added as a tree. The
// module declares NT, LANES, W_FORMAT and the linear_io.wgsl constants.
//
// A folded RMSNorm (IN_MODE 1) costs no pass of its own: rms_norm(x) * gain = (x * gain) / rms,
// and 1 / rms is the same for every output row, so the loop takes dot(w, x * gain) and the
// sum of squares of x together (a row's lanes see all of x between them), the tree adds both,
// and the scale is applied to the sum. The step waits on one round of loads, not two.
const WG: u32 = 256u;
const ROWS_PER_WG: u32 = WG / LANES;
// Loop steps whose weight loads are in flight together: 2 was the fastest of 1, 2 and 4 on
// the H200 (README, "Decoder on the GPU").
const UNROLL: u32 = 2u;
var<workgroup> red: array<f32, NT * WG>;
// The sums of squares of the first row's lanes (IN_MODE 1).
var<workgroup> red_ss: array<f32, NT * LANES>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
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
    for (var t = 0u; t < NT; t++) {
        red[(local_row * NT + t) * LANES + lane] = acc[t];
        if (IN_MODE == 1u && local_row == 0u) {
            red_ss[t * LANES + lane] = ss[t];
        }
    }
    workgroupBarrier();
    for (var stride = LANES / 2u; stride > 0u; stride >>= 1u) {
        if (lane < stride) {
            for (var t = 0u; t < NT; t++) {
                let i = (local_row * NT + t) * LANES + lane;
                red[i] += red[i + stride];
                if (IN_MODE == 1u && local_row == 0u) {
                    red_ss[t * LANES + lane] += red_ss[t * LANES + lane + stride];
                }
            }
        }
        workgroupBarrier();
    }
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
