// The tensor-core GEMM of the vision encoder: cooperative matrices (wgpu's experimental
// `wgpu_cooperative_matrix`, Vulkan's VK_KHR_cooperative_matrix), f16 inputs, f32 accumulation.
// Compiled only on devices that offer SHADER_F16 and EXPERIMENTAL_COOPERATIVE_MATRIX with a
// 16x16x16 f16 -> f32 configuration; vision_gpu.rs checks that before it builds this module.
//
// y[m][n] (+)= x[m][k] . w[n][k] (+ b[n]), GELU optional: the same contract as `linear` in
// vit.wgsl. One subgroup of 32 invocations computes a 32x32 block of y as 2x2 tiles of 16x16;
// the accumulators go through workgroup memory for the epilogue (bias, GELU, residual), which
// every invocation applies to 32 of the block's values. m and n must be multiples of 32 and k of
// 16 (the Rust side runs the f32 kernel otherwise).

enable f16;
enable wgpu_cooperative_matrix;

struct LinearParams { m: u32, n: u32, k: u32, flags: u32 };
// flags: 1 = add bias, 2 = tanh-GELU, 4 = accumulate into y (residual)

@group(0) @binding(0) var<storage, read> x16: array<f16>;
@group(0) @binding(1) var<storage, read> w16: array<f16>;
@group(0) @binding(2) var<storage, read> lin_b: array<f32>;
@group(0) @binding(3) var<storage, read_write> lin_y: array<f32>;
@group(0) @binding(4) var<uniform> lp: LinearParams;

fn gelu_tanh(x: f32) -> f32 {
    let c = 0.7978845608028654;
    return 0.5 * x * (1.0 + tanh(c * (x + 0.044715 * x * x * x)));
}

var<workgroup> block: array<f32, 1024>;

@compute @workgroup_size(32, 1, 1)
fn linear_coop(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let row0 = wid.y * 32u;
    let col0 = wid.x * 32u;
    let k = lp.k;
    // Zero accumulators, loaded from workgroup memory (which starts zeroed).
    var c00 = coopLoadT<coop_mat16x16<f32, C>>(&block[0], 32u);
    var c01 = c00;
    var c10 = c00;
    var c11 = c00;
    for (var t = 0u; t < k; t += 16u) {
        // A: rows of x, row-major with stride k. B = w^T: w is n x k row-major, so B (k x n) is
        // column-major with stride k.
        let a0 = coopLoadT<coop_mat16x16<f16, A>>(&x16[row0 * k + t], k);
        let a1 = coopLoadT<coop_mat16x16<f16, A>>(&x16[(row0 + 16u) * k + t], k);
        let b0 = coopLoad<coop_mat16x16<f16, B>>(&w16[col0 * k + t], k);
        let b1 = coopLoad<coop_mat16x16<f16, B>>(&w16[(col0 + 16u) * k + t], k);
        c00 = coopMultiplyAdd(a0, b0, c00);
        c01 = coopMultiplyAdd(a0, b1, c01);
        c10 = coopMultiplyAdd(a1, b0, c10);
        c11 = coopMultiplyAdd(a1, b1, c11);
    }
    coopStoreT(c00, &block[0], 32u);
    coopStoreT(c01, &block[16], 32u);
    coopStoreT(c10, &block[512], 32u);
    coopStoreT(c11, &block[528], 32u);
    workgroupBarrier();
    // Invocation `lid` finishes row `lid` of the block.
    let row = row0 + lid;
    for (var j = 0u; j < 32u; j++) {
        let col = col0 + j;
        var v = block[lid * 32u + j];
        if ((lp.flags & 1u) != 0u) { v += lin_b[col]; }
        if ((lp.flags & 2u) != 0u) { v = gelu_tanh(v); }
        let o = row * lp.n + col;
        if ((lp.flags & 4u) != 0u) { v += lin_y[o]; }
        lin_y[o] = v;
    }
}

// f32 activations to f16, the GEMM's input format.
@group(0) @binding(0) var<storage, read> cv_in: array<f32>;
@group(0) @binding(1) var<storage, read_write> cv_out: array<f16>;
@group(0) @binding(2) var<uniform> cv_len: vec4<u32>;

@compute @workgroup_size(64, 1, 1)
fn to_f16(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.y * 65535u * 64u + gid.x;
    if (i < cv_len.x) {
        cv_out[i] = f16(cv_in[i]);
    }
}
