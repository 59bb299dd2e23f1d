// y[t][row] = sum_k W[row][k] x[t][k] for up to NT tokens per workgroup row (decode and short
// batches): 8 rows per workgroup, 32 lanes per row striding the row four elements at a time,
// every decoded weight used for all NT tokens. The module declares NT, W_FORMAT and the
// linear_io.wgsl constants.
const LANES: u32 = 32u;
const ROWS_PER_WG: u32 = 8u;
const WG: u32 = 256u;
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
    if (lane < nt && row < pc.rows) {
        var s = 0.0;
        for (var i = 0u; i < LANES; i++) {
            s += red[(local_row * NT + lane) * LANES + i];
        }
        store_y((t0 + lane) * pc.rows + row, s);
    }
}
