// The register GEMM of vit.wgsl (`linear_reg`) with its weights in MX: y[m][n] (op)= x[m][k] .
// w[n][k] (+ b[n]), where each vector of w is decoded from mx-quant's linear layout as it is
// read (`mx_vec4`). vision_gpu.rs compiles this file after the format's constants and
// mx_quant::wgsl::DECODE_SOURCE (`mx_decode`, `mx_code_at`, `mx_scale_at`, `mx_vec4`).
//
// Contract: k a multiple of 32 (whole MX blocks per row of w); x holds m*k values, the codes
// and scales n*k elements, b n, y m*n. Rows past m or n read the last row (their results are
// not stored).

struct MxLinearParams { m: u32, n: u32, k: u32, flags: u32 };
// flags: 1 = add bias, 2 = tanh-GELU, 4 = accumulate into y (residual)

@group(0) @binding(0) var<storage, read> mxl_x4: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> mx_codes: array<u32>;
@group(0) @binding(2) var<storage, read> mxl_b: array<f32>;
@group(0) @binding(3) var<storage, read_write> mxl_y: array<f32>;
@group(0) @binding(4) var<uniform> mxl_p: MxLinearParams;
@group(0) @binding(5) var<storage, read> mx_scales: array<u32>;

fn mxl_gelu_tanh(x: f32) -> f32 {
    let c = 0.7978845608028654;
    return 0.5 * x * (1.0 + tanh(c * (x + 0.044715 * x * x * x)));
}

@compute @workgroup_size(8, 8, 1)
fn linear_reg_mx(@builtin(global_invocation_id) gid: vec3<u32>) {
    let row0 = gid.y * 4u;
    let col0 = gid.x * 4u;
    let p = mxl_p;
    if (row0 >= p.m || col0 >= p.n) { return; }
    let k4 = p.k / 4u;
    var xr: array<u32, 4>;
    var wr: array<u32, 4>; // first element of each w row in the MX stream
    for (var i = 0u; i < 4u; i++) {
        xr[i] = min(row0 + i, p.m - 1u) * k4;
        wr[i] = min(col0 + i, p.n - 1u) * p.k;
    }
    var acc: array<vec4<f32>, 4>;
    for (var i = 0u; i < 4u; i++) { acc[i] = vec4<f32>(0.0); }
    for (var t = 0u; t < k4; t++) {
        let w0 = mx_vec4(wr[0] + 4u * t);
        let w1 = mx_vec4(wr[1] + 4u * t);
        let w2 = mx_vec4(wr[2] + 4u * t);
        let w3 = mx_vec4(wr[3] + 4u * t);
        for (var i = 0u; i < 4u; i++) {
            let xv = mxl_x4[xr[i] + t];
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
            if ((p.flags & 1u) != 0u) { v += mxl_b[col]; }
            if ((p.flags & 2u) != 0u) { v = mxl_gelu_tanh(v); }
            let o = row * p.n + col;
            if ((p.flags & 4u) != 0u) { v += mxl_y[o]; }
            mxl_y[o] = v;
        }
    }
}
