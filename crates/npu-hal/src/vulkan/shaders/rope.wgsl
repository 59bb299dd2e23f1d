// Rotary position embedding in place: row r is at position first_pos + r. Angles follow the CPU
// reference: interleaved pairs scale the position by theta_scale^i (llama.cpp's recurrence,
// within an ulp or two), half-split pairs take position * inv_freq[i] (Hugging Face's); sin and
// cos work on the angle reduced to [-pi, pi] in two steps, so long positions keep their accuracy.
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
    var angle: f32;
    var a: u32;
    var b: u32;
    if (pc.interleaved != 0u) {
        // theta_scale^i by squaring, a fixed eight steps (see kv_common.wgsl's rope_cs).
        var scale_i = 1.0;
        var square = pc.theta_scale;
        for (var bit = 0u; bit < 8u; bit++) {
            scale_i = select(scale_i, scale_i * square, ((i >> bit) & 1u) != 0u);
            square = square * square;
        }
        angle = pos * scale_i;
        a = 2u * i;
        b = 2u * i + 1u;
    } else {
        angle = pos * inv_freq[i];
        a = i;
        b = i + half_dim;
    }
    // 2 pi = C1 + C2, C1 exact in few bits, so k * C1 is exact for the k that occur.
    let k = round(angle * 0.15915494309189535);
    let r = (angle - k * 6.28125) - k * 0.0019353071795864769;
    let c = cos(r);
    let s = sin(r);
    let base = row * pc.width + head * pc.head_dim;
    let x0 = x[base + a];
    let x1 = x[base + b];
    x[base + a] = x0 * c - x1 * s;
    x[base + b] = x0 * s + x1 * c;
}
