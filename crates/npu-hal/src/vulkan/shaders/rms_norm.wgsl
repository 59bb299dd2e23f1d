// out[row] = x[row] / sqrt(mean(x[row]^2) + eps) * gain; one workgroup per row.
struct Params {
    width: u32,
    eps: f32,
}
var<immediate> pc: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> gain: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

const WG: u32 = 256u;
var<workgroup> red: array<f32, WG>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wg.x;
    if (row >= step_n()) {
        return;
    }
    let base = row * pc.width;
    var s = 0.0;
    for (var i = lid; i < pc.width; i += WG) {
        let v = x[base + i];
        s += v * v;
    }
    red[lid] = s;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) {
            red[lid] += red[lid + stride];
        }
        workgroupBarrier();
    }
    let inv = 1.0 / sqrt(red[0] / f32(pc.width) + pc.eps);
    for (var i = lid; i < pc.width; i += WG) {
        y[base + i] = x[base + i] * inv * gain[i];
    }
}
