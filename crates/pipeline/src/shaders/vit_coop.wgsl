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

// FlashAttention on tensor cores: one subgroup per 16 queries of one head. Key blocks of 64:
// S = Q K^T as 4 coop tiles (f16 in, f32 out) into workgroup memory, an online softmax per query
// row in f32 (running max and sum, as the f32 kernel does), P rounded to f16, and P V as coop
// tiles added into the f32 output accumulator after rescaling. The score matrix never exists
// beyond one 16 x 64 block. n must be a multiple of 64, head_dim of 16 and at most 64.
struct AttnParams { n: u32, heads: u32, hd: u32, h: u32, scale: f32, p0: u32, p1: u32, p2: u32 };

@group(0) @binding(0) var<storage, read> q16: array<f16>;
@group(0) @binding(1) var<storage, read> k16: array<f16>;
@group(0) @binding(2) var<storage, read> v16: array<f16>;
@group(0) @binding(3) var<storage, read_write> att_out: array<f32>;
@group(0) @binding(4) var<uniform> ap: AttnParams;

var<workgroup> s_ws: array<f32, 1024>; // 16 x 64 scores, then 16 x 64 of P V (stride 64)
var<workgroup> p_ws: array<f16, 1024>; // 16 x 64 probabilities
var<workgroup> o_ws: array<f32, 1024>; // 16 x 64 output accumulator (stride 64)
var<workgroup> z_ws: array<f32, 256>;  // never written: zero accumulators load from here
var<workgroup> m_ws: array<f32, 16>;
var<workgroup> l_ws: array<f32, 16>;
var<workgroup> a_ws: array<f32, 16>;
var<workgroup> part: array<f32, 32>;

// P V for the 16-wide column tile `dt` of the head: the four 16-key slices of P (already
// loaded) times the matching rows of V.
fn pv_tile(p0: coop_mat16x16<f16, A>, p1: coop_mat16x16<f16, A>, p2: coop_mat16x16<f16, A>,
           p3: coop_mat16x16<f16, A>, v0: u32) -> coop_mat16x16<f32, C> {
    let h = ap.h;
    var acc = coopLoadT<coop_mat16x16<f32, C>>(&z_ws[0], 16u);
    acc = coopMultiplyAdd(p0, coopLoadT<coop_mat16x16<f16, B>>(&v16[v0], h), acc);
    acc = coopMultiplyAdd(p1, coopLoadT<coop_mat16x16<f16, B>>(&v16[v0 + 16u * h], h), acc);
    acc = coopMultiplyAdd(p2, coopLoadT<coop_mat16x16<f16, B>>(&v16[v0 + 32u * h], h), acc);
    acc = coopMultiplyAdd(p3, coopLoadT<coop_mat16x16<f16, B>>(&v16[v0 + 48u * h], h), acc);
    return acc;
}

// Coop loads and stores into workgroup arrays use constant offsets only (naga 30's SPIR-V
// writer cannot bounds-restrict a dynamic index there), hence the unrolled tiles below.
@compute @workgroup_size(32, 1, 1)
fn attention_coop(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let q0 = wid.x * 16u;
    let h = ap.h;
    let hd = ap.hd;
    let col = wid.y * hd;
    if (lid < 16u) {
        m_ws[lid] = -3.0e38;
        l_ws[lid] = 0.0;
    }
    for (var i = lid; i < 1024u; i += 32u) {
        o_ws[i] = 0.0;
    }
    workgroupBarrier();
    for (var j0 = 0u; j0 < ap.n; j0 += 64u) {
        var s0 = coopLoadT<coop_mat16x16<f32, C>>(&z_ws[0], 16u);
        var s1 = s0;
        var s2 = s0;
        var s3 = s0;
        for (var d0 = 0u; d0 < hd; d0 += 16u) {
            let a = coopLoadT<coop_mat16x16<f16, A>>(&q16[q0 * h + col + d0], h);
            let kb = j0 * h + col + d0;
            s0 = coopMultiplyAdd(a, coopLoad<coop_mat16x16<f16, B>>(&k16[kb], h), s0);
            s1 = coopMultiplyAdd(a, coopLoad<coop_mat16x16<f16, B>>(&k16[kb + 16u * h], h), s1);
            s2 = coopMultiplyAdd(a, coopLoad<coop_mat16x16<f16, B>>(&k16[kb + 32u * h], h), s2);
            s3 = coopMultiplyAdd(a, coopLoad<coop_mat16x16<f16, B>>(&k16[kb + 48u * h], h), s3);
        }
        coopStoreT(s0, &s_ws[0], 64u);
        coopStoreT(s1, &s_ws[16], 64u);
        coopStoreT(s2, &s_ws[32], 64u);
        coopStoreT(s3, &s_ws[48], 64u);
        workgroupBarrier();
        // Online softmax, two lanes per query row (32 keys each), partials through `part`.
        let r = lid / 2u;
        let base = r * 64u + (lid % 2u) * 32u;
        var mx = -3.0e38;
        for (var j = 0u; j < 32u; j++) {
            mx = max(mx, s_ws[base + j] * ap.scale);
        }
        part[lid] = mx;
        workgroupBarrier();
        let m_new = max(m_ws[r], max(part[r * 2u], part[r * 2u + 1u]));
        workgroupBarrier();
        var sum = 0.0;
        for (var j = 0u; j < 32u; j++) {
            let p = exp(s_ws[base + j] * ap.scale - m_new);
            sum += p;
            p_ws[base + j] = f16(p);
        }
        part[lid] = sum;
        workgroupBarrier();
        if (lid % 2u == 0u) {
            let alpha = exp(m_ws[r] - m_new);
            a_ws[r] = alpha;
            l_ws[r] = l_ws[r] * alpha + part[lid] + part[lid + 1u];
            m_ws[r] = m_new;
        }
        workgroupBarrier();
        let p0 = coopLoadT<coop_mat16x16<f16, A>>(&p_ws[0], 64u);
        let p1 = coopLoadT<coop_mat16x16<f16, A>>(&p_ws[16], 64u);
        let p2 = coopLoadT<coop_mat16x16<f16, A>>(&p_ws[32], 64u);
        let p3 = coopLoadT<coop_mat16x16<f16, A>>(&p_ws[48], 64u);
        let v0 = j0 * h + col;
        coopStoreT(pv_tile(p0, p1, p2, p3, v0), &s_ws[0], 64u);
        if (hd > 16u) {
            coopStoreT(pv_tile(p0, p1, p2, p3, v0 + 16u), &s_ws[16], 64u);
        }
        if (hd > 32u) {
            coopStoreT(pv_tile(p0, p1, p2, p3, v0 + 32u), &s_ws[32], 64u);
        }
        if (hd > 48u) {
            coopStoreT(pv_tile(p0, p1, p2, p3, v0 + 48u), &s_ws[48], 64u);
        }
        workgroupBarrier();
        for (var i = lid; i < 1024u; i += 32u) {
            o_ws[i] = o_ws[i] * a_ws[i / 64u] + s_ws[i];
        }
        workgroupBarrier();
    }
    for (var i = lid; i < 16u * hd; i += 32u) {
        let r = i / hd;
        let d = i % hd;
        att_out[(q0 + r) * h + col + d] = o_ws[r * 64u + d] / l_ws[r];
    }
}
