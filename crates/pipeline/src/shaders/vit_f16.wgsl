// The register GEMM of vit.wgsl (`linear_reg`) with f16 weights, for GPUs that have f16 shaders
// but no cooperative matrices (the common case on phone and laptop SoCs): y[m][n] (op)= x[m][k]
// . w[n][k] (+ b[n]), x f32, w f16 (half the weight memory and traffic), f32 accumulation.
//
// Contract: k a multiple of 4; x holds m*k values, w n*k, b n, y m*n. Rows past m or n read the
// last row (their results are not stored).

enable f16;

struct F16LinearParams { m: u32, n: u32, k: u32, flags: u32 };
// flags: 1 = add bias, 2 = tanh-GELU, 4 = accumulate into y (residual)

@group(0) @binding(0) var<storage, read> hl_x4: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> hl_w4: array<vec4<f16>>;
@group(0) @binding(2) var<storage, read> hl_b: array<f32>;
@group(0) @binding(3) var<storage, read_write> hl_y: array<f32>;
@group(0) @binding(4) var<uniform> hl_p: F16LinearParams;

fn hl_gelu_tanh(x: f32) -> f32 {
    let c = 0.7978845608028654;
    return 0.5 * x * (1.0 + tanh(c * (x + 0.044715 * x * x * x)));
}

@compute @workgroup_size(8, 8, 1)
fn linear_reg_f16(@builtin(global_invocation_id) gid: vec3<u32>) {
    let row0 = gid.y * 4u;
    let col0 = gid.x * 4u;
    let p = hl_p;
    if (row0 >= p.m || col0 >= p.n) { return; }
    let k4 = p.k / 4u;
    var xr: array<u32, 4>;
    var wr: array<u32, 4>;
    for (var i = 0u; i < 4u; i++) {
        xr[i] = min(row0 + i, p.m - 1u) * k4;
        wr[i] = min(col0 + i, p.n - 1u) * k4;
    }
    var acc: array<vec4<f32>, 4>;
    for (var i = 0u; i < 4u; i++) { acc[i] = vec4<f32>(0.0); }
    for (var t = 0u; t < k4; t++) {
        let w0 = vec4<f32>(hl_w4[wr[0] + t]);
        let w1 = vec4<f32>(hl_w4[wr[1] + t]);
        let w2 = vec4<f32>(hl_w4[wr[2] + t]);
        let w3 = vec4<f32>(hl_w4[wr[3] + t]);
        for (var i = 0u; i < 4u; i++) {
            let xv = hl_x4[xr[i] + t];
            acc[i] += vec4<f32>(dot(xv, w0), dot(xv, w1), dot(xv, w2), dot(xv, w3));
        }
    }
    for (var i = 0u; i < 4u; i++) {
        let row = row0 + i;
        if (row >= p.m) { break; }
        for (var j = 0u; j < 4u; j++) {
            let col = col0 + j;
            if (col >= p.n) { break; }
            var v = acc[i][j];
            if ((p.flags & 1u) != 0u) { v += hl_b[col]; }
            if ((p.flags & 2u) != 0u) { v = hl_gelu_tanh(v); }
            let o = row * p.n + col;
            if ((p.flags & 4u) != 0u) { v += hl_y[o]; }
            hl_y[o] = v;
        }
    }
}
