// Rotary position embedding in place: row r is at position first_pos + r, its angles those of
// rope_angle.wgsl (the CPU reference's, within an ulp or two).
struct Params {
    width: u32,
    head_dim: u32,
    interleaved: u32,
    theta_scale: f32,
}
var<immediate> pc: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> inv_freq: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let half_dim = pc.head_dim / 2u;
    let pair = gid.x;
    let row = gid.y;
    if (pair >= pc.width / 2u || row >= step_n()) {
        return;
    }
    let head = pair / half_dim;
    let i = pair % half_dim;
    let pos = f32(step_first_pos() + row);
    var a: u32;
    var b: u32;
    if (pc.interleaved != 0u) {
        a = 2u * i;
        b = 2u * i + 1u;
    } else {
        a = i;
        b = i + half_dim;
    }
    let cs = rope_angle_cs(pos, i, pc.interleaved != 0u, pc.theta_scale);
    let c = cs.x;
    let s = cs.y;
    let base = row * pc.width + head * pc.head_dim;
    let x0 = x[base + a];
    let x1 = x[base + b];
    x[base + a] = x0 * c - x1 * s;
    x[base + b] = x0 * s + x1 * c;
}
