// The barrier-free register GEMM: y[m][n] (op)= x[m][k] . w[n][k] (+ b[n]), x f32, f32
// accumulation. Each invocation keeps a 4x4 output block in registers and reads its four x rows
// and four w rows straight from the buffers as vec4s. No workgroup memory and no barriers: what
// a CPU-hosted driver (lavapipe runs each workgroup as SIMD loops, paying a context switch per
// barrier) and caches serve best.
//
// One kernel, three weight formats: vision_gpu.rs compiles this file as it is (f32 weights,
// entry `linear_reg`) or with the marked <w-source> swapped for f16 weights (`linear_reg_f16`)
// or for MX codes and scales decoded by mx_quant::wgsl::DECODE_SOURCE (`linear_reg_mx`).
//
// Contract: k a multiple of 4 (of 32 with MX weights: whole blocks per row); x holds m*k
// values, w n*k, b n, y m*n. Rows past m or n read the last row (their results are not
// stored).

struct RegParams { m: u32, n: u32, k: u32, flags: u32 };
// flags: 1 = add bias, 2 = tanh-GELU, 4 = accumulate into y (residual)

@group(0) @binding(0) var<storage, read> rg_x4: array<vec4<f32>>;
// <w-source>: f32 weights.
@group(0) @binding(1) var<storage, read> rg_w4: array<vec4<f32>>;
// Elements at .. at + 3 of w (row-major n x k; at a multiple of 4).
fn w_vec4(at: u32) -> vec4<f32> {
    return rg_w4[at / 4u];
}
// </w-source>
@group(0) @binding(2) var<storage, read> rg_b: array<f32>;
@group(0) @binding(3) var<storage, read_write> rg_y: array<f32>;
@group(0) @binding(4) var<uniform> rg_p: RegParams;

fn rg_gelu_tanh(x: f32) -> f32 {
    let c = 0.7978845608028654;
    return 0.5 * x * (1.0 + tanh(c * (x + 0.044715 * x * x * x)));
}

@compute @workgroup_size(8, 8, 1)
fn linear_reg(@builtin(global_invocation_id) gid: vec3<u32>) {
    let row0 = gid.y * 4u;
    let col0 = gid.x * 4u;
    let p = rg_p;
    if (row0 >= p.m || col0 >= p.n) { return; }
    let k4 = p.k / 4u;
    // Rows past the edge read the last valid row (their results are not stored).
    var xr: array<u32, 4>;
    var wr: array<u32, 4>; // first element of each w row
    for (var i = 0u; i < 4u; i++) {
        xr[i] = min(row0 + i, p.m - 1u) * k4;
        wr[i] = min(col0 + i, p.n - 1u) * p.k;
    }
    var acc: array<vec4<f32>, 4>;
    for (var i = 0u; i < 4u; i++) { acc[i] = vec4<f32>(0.0); }
    for (var t = 0u; t < k4; t++) {
        let w0 = w_vec4(wr[0] + 4u * t);
        let w1 = w_vec4(wr[1] + 4u * t);
        let w2 = w_vec4(wr[2] + 4u * t);
        let w3 = w_vec4(wr[3] + 4u * t);
        for (var i = 0u; i < 4u; i++) {
            let xv = rg_x4[xr[i] + t];
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
            if ((p.flags & 1u) != 0u) { v += rg_b[col]; }
            if ((p.flags & 2u) != 0u) { v = rg_gelu_tanh(v); }
            let o = row * p.n + col;
            if ((p.flags & 4u) != 0u) { v += rg_y[o]; }
            rg_y[o] = v;
        }
    }
}
