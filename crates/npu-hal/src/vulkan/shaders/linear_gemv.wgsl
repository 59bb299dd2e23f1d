// y[t][row] = sum_k W[row][k] x[t][k] for up to NT tokens per workgroup row (decode and short
// batches): LANES invocations per row striding it four elements at a time, 256 / LANES rows per
// workgroup, every decoded weight used for all NT tokens, the lanes' sums added as a tree. The
// module declares NT, LANES, W_FORMAT and the linear_io.wgsl constants.
const WG: u32 = 256u;
const ROWS_PER_WG: u32 = WG / LANES;
var<workgroup> red: array<f32, 2048>;

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
    // The fused RMSNorm's 1 / rms per token, reduced across the workgroup.
    var inv: array<f32, NT>;
    if (IN_MODE == 1u) {
        for (var t = 0u; t < NT; t++) {
            var s = 0.0;
            if (t < nt) {
                s = sum_squares(span.x + t0 + t, lid, WG);
            }
            red[t * WG + lid] = s;
        }
        workgroupBarrier();
        for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
            if (lid < stride) {
                for (var t = 0u; t < NT; t++) {
                    red[t * WG + lid] += red[t * WG + lid + stride];
                }
            }
            workgroupBarrier();
        }
        for (var t = 0u; t < NT; t++) {
            inv[t] = 1.0 / sqrt(red[t * WG] / f32(pc.cols) + pc.eps);
        }
        workgroupBarrier();
    }
    let k4s = pc.cols / 4u;
    var acc: array<f32, NT>;
    if (row < pc.rows) {
        for (var k4 = lane; k4 < k4s; k4 += LANES) {
            let w = w4(row, k4 * 4u, pc.cols);
            for (var t = 0u; t < NT; t++) {
                if (t < nt) {
                    acc[t] += dot(w, load_x(span.x + t0 + t, k4, inv[t]));
                }
            }
        }
    }
    for (var t = 0u; t < NT; t++) {
        red[(local_row * NT + t) * LANES + lane] = acc[t];
    }
    workgroupBarrier();
    for (var stride = LANES / 2u; stride > 0u; stride >>= 1u) {
        if (lane < stride) {
            for (var t = 0u; t < NT; t++) {
                let i = (local_row * NT + t) * LANES + lane;
                red[i] += red[i + stride];
            }
        }
        workgroupBarrier();
    }
    if (lane < nt && row < pc.rows) {
        store_y((t0 + lane) * pc.rows + row, red[(local_row * NT + lane) * LANES]);
    }
}
