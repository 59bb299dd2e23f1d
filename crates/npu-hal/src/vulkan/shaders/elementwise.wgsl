// Row-wise element ops over the batch's rows: x over a row's elements, y over rows.
// OP 0: acc += x (binding 1 acc, read-write; binding 2 x)
// OP 1: out = silu(gate) * up (binding 1 out; binding 2 gate; binding 3 up)
struct Params {
    width: u32,
}
var<immediate> pc: Params;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<storage, read> a: array<f32>;
@group(0) @binding(3) var<storage, read> b: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let row = gid.y;
    if (gid.x >= pc.width || row >= step_n()) {
        return;
    }
    let i = row * pc.width + gid.x;
    if (OP == 0u) {
        out[i] += a[i];
    } else {
        let g = a[i];
        out[i] = g / (1.0 + exp(-g)) * b[i];
    }
}
