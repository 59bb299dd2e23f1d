// The input of a linear layer whose weights are block-rotated (mx_quant::hadamard): each
// 32-element block of the input stage's output (linear_io.wgsl: x, rms_norm(x) * gain, or
// silu(gate) * up) goes through the unnormalized 32-point Walsh-Hadamard transform and is
// written to y, the rotated copy the linear kernel then reads as it is. One workgroup per row,
// one invocation per block; the butterflies run in mx_quant::hadamard::fwht32's order (strides
// 1, 2, 4, 8, 16, pairs in increasing index), additions and subtractions only, so the result
// has the CPU's bits for the same input.
const WG: u32 = 256u;
var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let span = step_linear_rows(pc.selected);
    if (wg.x >= span.y) {
        return;
    }
    let t = span.x + wg.x;
    var inv = 1.0;
    if (IN_MODE == 1u) {
        red[lid] = sum_squares(t, lid, WG);
        workgroupBarrier();
        for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
            if (lid < stride) {
                red[lid] += red[lid + stride];
            }
            workgroupBarrier();
        }
        inv = 1.0 / sqrt(red[0] / f32(pc.cols) + pc.eps);
    }
    for (var b = lid; b < pc.cols / 32u; b += WG) {
        var v: array<f32, 32>;
        for (var j = 0u; j < 8u; j++) {
            let q = load_x(t, b * 8u + j, inv);
            v[4u * j] = q.x;
            v[4u * j + 1u] = q.y;
            v[4u * j + 2u] = q.z;
            v[4u * j + 3u] = q.w;
        }
        for (var h = 1u; h < 32u; h <<= 1u) {
            for (var i = 0u; i < 32u; i += 2u * h) {
                for (var j = i; j < i + h; j++) {
                    let a = v[j];
                    let c = v[j + h];
                    v[j] = a + c;
                    v[j + h] = a - c;
                }
            }
        }
        for (var i = 0u; i < 32u; i++) {
            y[t * pc.cols + b * 32u + i] = v[i];
        }
    }
}
