// The second pass of a split-K GEMM (linear_gemm.wgsl with SPLIT_K 1): y = (or +=, OUT_ACC)
// the sum over the splits of the partial sums, laid out [split][token][row], added in split
// order so a result does not depend on which workgroup finished first. One invocation per
// output; the grid is (rows / 256, tokens).
struct Params {
    rows: u32,
    splits: u32,
    selected: u32,
}
var<immediate> pc: Params;
@group(0) @binding(1) var<storage, read> parts: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let tokens = step_linear_rows(pc.selected).y;
    let row = gid.x;
    let t = gid.y;
    if (row >= pc.rows || t >= tokens) {
        return;
    }
    let i = t * pc.rows + row;
    var sum = 0.0;
    for (var z = 0u; z < pc.splits; z++) {
        sum += parts[z * tokens * pc.rows + i];
    }
    if (OUT_ACC != 0u) {
        y[i] += sum;
    } else {
        y[i] = sum;
    }
}
