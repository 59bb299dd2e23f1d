// out[row] = table[token[row]], or the spliced row (another engine's embedding) for rows in
// [step[4], step[5]), read from `splice` at value step[9] on; one workgroup per row. The module
// declares W_FORMAT.
struct Params {
    width: u32,
    vocab: u32,
}
var<immediate> pc: Params;
@group(0) @binding(3) var<storage, read> splice: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wg.x;
    if (row >= step_n()) {
        return;
    }
    let base = row * pc.width;
    if (row >= step[4u] && row < step[5u]) {
        let src_at = step[9u] + (row - step[4u]) * pc.width;
        for (var i = lid; i < pc.width; i += 64u) {
            y[base + i] = splice[src_at + i];
        }
        return;
    }
    // The host checked every id against the vocabulary; the clamp keeps a bad one in bounds.
    let token = min(step_token(row), pc.vocab - 1u);
    for (var k4 = lid; k4 < pc.width / 4u; k4 += 64u) {
        let v = w4(token, k4 * 4u, pc.width);
        let o = base + k4 * 4u;
        y[o] = v.x;
        y[o + 1u] = v.y;
        y[o + 2u] = v.z;
        y[o + 3u] = v.w;
    }
}
