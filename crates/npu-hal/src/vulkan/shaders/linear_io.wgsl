// Input and output stages shared by the linear kernels, chosen by constants the module
// declares, so a linear layer can absorb the row-wise op before and after it:
//   IN_MODE 0: x as it is;
//           1: rms_norm(x) * gain (the RMSNorm whose output only linear layers read); `aux` is
//              the gain, push constant `eps`;
//           2: silu(x) * up (the SwiGLU whose output only this layer reads); `aux` is `up`;
//   OUT_ACC 0: y = W x;  1: y += W x (the residual add that follows).
struct Params {
    rows: u32,
    cols: u32,
    selected: u32,
    eps: f32,
    // Where the output head's per-workgroup maxima go in y (linear_gemv_argmax.wgsl); unused
    // by the other variants.
    partials: u32,
}
var<immediate> pc: Params;
@group(0) @binding(3) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<storage, read> aux: array<vec4<f32>>;

// Elements 4 k4 .. 4 k4 + 3 of input row `t` (an absolute row of the x tensor), with `inv`
// that row's 1 / rms when IN_MODE is 1.
fn load_x(t: u32, k4: u32, inv: f32) -> vec4<f32> {
    let i = t * (pc.cols / 4u) + k4;
    return stage_x(x[i], load_aux(t, k4), inv);
}

// The input stage's second operand for elements 4 k4 .. 4 k4 + 3 of row `t` (the gain, or
// `up`); unused (zero) when IN_MODE is 0. Loaded apart from `stage_x` so a kernel can issue
// the loads ahead of their use.
fn load_aux(t: u32, k4: u32) -> vec4<f32> {
    if (IN_MODE == 1u) {
        return aux[k4];
    } else if (IN_MODE == 2u) {
        return aux[t * (pc.cols / 4u) + k4];
    }
    return vec4<f32>(0.0);
}

// The input stage applied to loaded values `v` of x and `a` of `load_aux`.
fn stage_x(v: vec4<f32>, a: vec4<f32>, inv: f32) -> vec4<f32> {
    if (IN_MODE == 1u) {
        return v * inv * a;
    } else if (IN_MODE == 2u) {
        return v / (1.0 + exp(-v)) * a;
    }
    return v;
}

// The sum of squares of input row `t` over the k4 slots this invocation takes.
fn sum_squares(t: u32, first: u32, stride: u32) -> f32 {
    var s = 0.0;
    for (var k4 = first; k4 < pc.cols / 4u; k4 += stride) {
        let v = x[t * (pc.cols / 4u) + k4];
        s += dot(v, v);
    }
    return s;
}

fn store_y(i: u32, v: f32) {
    if (OUT_ACC != 0u) {
        y[i] += v;
    } else {
        y[i] = v;
    }
}
