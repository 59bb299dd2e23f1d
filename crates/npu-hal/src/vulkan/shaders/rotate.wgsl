// The input of a linear layer whose weights are block-rotated (mx_quant::hadamard): each
// 32-element block of the input stage's output (linear_io.wgsl: x, rms_norm(x) * gain, or
// silu(gate) * up) goes through the unnormalized 32-point Walsh-Hadamard transform and is
// written to y, the rotated copy the linear kernel then reads as it is.
//
// One workgroup per row. The row is staged in workgroup memory; each of the five butterfly
// stages (strides 1, 2, 4, 8, 16) is spread over the invocations, with a barrier between
// stages. A stage's pairs are disjoint, so every pair gets the same two operands, and the same
// one addition and one subtraction, as in mx_quant::hadamard::fwht32: the result has the CPU's
// bits for the same input.
// 13 KiB of workgroup memory in all, under the 16 KiB every Vulkan device offers; rows up to
// 3072 wide (the host refuses wider ones).
const WG: u32 = 256u;
var<workgroup> red: array<f32, 256>;
var<workgroup> row: array<f32, 3072>;

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
    for (var k4 = lid; k4 < pc.cols / 4u; k4 += WG) {
        let q = load_x(t, k4, inv);
        row[4u * k4] = q.x;
        row[4u * k4 + 1u] = q.y;
        row[4u * k4 + 2u] = q.z;
        row[4u * k4 + 3u] = q.w;
    }
    workgroupBarrier();
    for (var h = 1u; h < 32u; h <<= 1u) {
        // Pair p of this stage: its lower element e (bit h clear) and e + h.
        for (var p = lid; p < pc.cols / 2u; p += WG) {
            let e = (p / h) * 2u * h + p % h;
            let a = row[e];
            let b = row[e + h];
            row[e] = a + b;
            row[e + h] = a - b;
        }
        workgroupBarrier();
    }
    for (var i = lid; i < pc.cols; i += WG) {
        y[t * pc.cols + i] = row[i];
    }
}
