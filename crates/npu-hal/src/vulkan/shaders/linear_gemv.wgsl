// y[t][row] = sum_k W[row][k] x[t][k] for up to NT tokens per workgroup row (decode and short
// batches): 8 rows per workgroup, 32 lanes per row striding the row four elements at a time,
// every decoded weight used for all NT tokens. The module declares NT and W_FORMAT.
struct Params {
    rows: u32,
    cols: u32,
    selected: u32,
}
var<immediate> pc: Params;
@group(0) @binding(3) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

const LANES: u32 = 32u;
const ROWS_PER_WG: u32 = 8u;
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
    let k4s = pc.cols / 4u;
    var acc: array<f32, NT>;
    if (row < pc.rows) {
        for (var k4 = lane; k4 < k4s; k4 += LANES) {
            let w = w4(row, k4 * 4u, pc.cols);
            for (var t = 0u; t < NT; t++) {
                if (t < nt) {
                    acc[t] += dot(w, x[(span.x + t0 + t) * k4s + k4]);
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
        y[(t0 + lane) * pc.rows + row] = s;
    }
}
