// The SigLIP tower and SmolVLM connector's kernels. Every kernel is one entry point of this
// module; the Rust side (vision_gpu.rs) records them into one command encoder per image.
// f32 throughout; the score matrix of attention is never stored (online softmax per query).

struct LinearParams { m: u32, n: u32, k: u32, flags: u32 };
// flags: 1 = add bias, 2 = tanh-GELU, 4 = accumulate into y (residual)

@group(0) @binding(0) var<storage, read> lin_x: array<f32>;
@group(0) @binding(1) var<storage, read> lin_w: array<f32>;
@group(0) @binding(2) var<storage, read> lin_b: array<f32>;
@group(0) @binding(3) var<storage, read_write> lin_y: array<f32>;
@group(0) @binding(4) var<uniform> lp: LinearParams;

fn gelu_tanh(x: f32) -> f32 {
    let c = 0.7978845608028654;
    return 0.5 * x * (1.0 + tanh(c * (x + 0.044715 * x * x * x)));
}

// y[m][n] (+)= x[m][k] . w[n][k] (+ b[n]): a 64x64 output tile per workgroup of 16x16 threads,
// each thread a 4x4 block in registers, k in steps of 16 staged in workgroup memory (rows padded
// to 17 to spread the banks).
var<workgroup> a_tile: array<array<f32, 17>, 64>;
var<workgroup> b_tile: array<array<f32, 17>, 64>;

@compute @workgroup_size(16, 16, 1)
fn linear(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let row0 = wid.y * 64u;
    let col0 = wid.x * 64u;
    let tid = lid.y * 16u + lid.x;
    var acc: array<array<f32, 4>, 4>;
    for (var i = 0u; i < 4u; i++) {
        for (var j = 0u; j < 4u; j++) { acc[i][j] = 0.0; }
    }
    for (var t = 0u; t < lp.k; t += 16u) {
        for (var i = 0u; i < 4u; i++) {
            let e = tid + 256u * i;
            let r = e / 16u;
            let kk = e % 16u;
            let gk = t + kk;
            var xv = 0.0;
            if (row0 + r < lp.m && gk < lp.k) { xv = lin_x[(row0 + r) * lp.k + gk]; }
            a_tile[r][kk] = xv;
            var wv = 0.0;
            if (col0 + r < lp.n && gk < lp.k) { wv = lin_w[(col0 + r) * lp.k + gk]; }
            b_tile[r][kk] = wv;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < 16u; kk++) {
            var av: array<f32, 4>;
            var bv: array<f32, 4>;
            for (var i = 0u; i < 4u; i++) {
                av[i] = a_tile[lid.y * 4u + i][kk];
                bv[i] = b_tile[lid.x * 4u + i][kk];
            }
            for (var i = 0u; i < 4u; i++) {
                for (var j = 0u; j < 4u; j++) { acc[i][j] += av[i] * bv[j]; }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let row = row0 + lid.y * 4u + i;
        if (row >= lp.m) { continue; }
        for (var j = 0u; j < 4u; j++) {
            let col = col0 + lid.x * 4u + j;
            if (col >= lp.n) { continue; }
            var v = acc[i][j];
            if ((lp.flags & 1u) != 0u) { v += lin_b[col]; }
            if ((lp.flags & 2u) != 0u) { v = gelu_tanh(v); }
            let o = row * lp.n + col;
            if ((lp.flags & 4u) != 0u) { v += lin_y[o]; }
            lin_y[o] = v;
        }
    }
}

// The simple variant: a 16x16 output tile per workgroup, one output per thread.
var<workgroup> xs16: array<array<f32, 16>, 16>;
var<workgroup> ws16: array<array<f32, 16>, 16>;

@compute @workgroup_size(16, 16, 1)
fn linear_small(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let row = wid.y * 16u + lid.y;
    let col = wid.x * 16u + lid.x;
    let wrow = wid.x * 16u + lid.y;
    var acc = 0.0;
    for (var t = 0u; t < lp.k; t += 16u) {
        let kk = t + lid.x;
        var xv = 0.0;
        if (row < lp.m && kk < lp.k) { xv = lin_x[row * lp.k + kk]; }
        var wv = 0.0;
        if (wrow < lp.n && kk < lp.k) { wv = lin_w[wrow * lp.k + kk]; }
        xs16[lid.y][lid.x] = xv;
        ws16[lid.y][lid.x] = wv;
        workgroupBarrier();
        for (var i = 0u; i < 16u; i++) {
            acc += xs16[lid.y][i] * ws16[lid.x][i];
        }
        workgroupBarrier();
    }
    if (row < lp.m && col < lp.n) {
        var v = acc;
        if ((lp.flags & 1u) != 0u) { v += lin_b[col]; }
        if ((lp.flags & 2u) != 0u) { v = gelu_tanh(v); }
        let o = row * lp.n + col;
        if ((lp.flags & 4u) != 0u) { v += lin_y[o]; }
        lin_y[o] = v;
    }
}

// The barrier-free register GEMM (`linear_reg`) is its own module, shaders/gemm_reg.wgsl, so
// that it can be compiled for f32, f16 and MX weights.

struct NormParams { rows: u32, width: u32, eps: f32, pad: u32 };
@group(0) @binding(0) var<storage, read> ln_x: array<f32>;
@group(0) @binding(1) var<storage, read> ln_w: array<f32>;
@group(0) @binding(2) var<storage, read> ln_b: array<f32>;
@group(0) @binding(3) var<storage, read_write> ln_y: array<f32>;
@group(0) @binding(4) var<uniform> np: NormParams;
var<workgroup> red: array<f32, 64>;

// One workgroup per row: mean, then variance, by tree reduction in workgroup memory.
@compute @workgroup_size(64, 1, 1)
fn layer_norm(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let row = wid.x;
    let base = row * np.width;
    var s = 0.0;
    for (var i = lid.x; i < np.width; i += 64u) { s += ln_x[base + i]; }
    red[lid.x] = s;
    workgroupBarrier();
    for (var step = 32u; step > 0u; step >>= 1u) {
        if (lid.x < step) { red[lid.x] += red[lid.x + step]; }
        workgroupBarrier();
    }
    let mean = red[0] / f32(np.width);
    workgroupBarrier();
    var q = 0.0;
    for (var i = lid.x; i < np.width; i += 64u) {
        let d = ln_x[base + i] - mean;
        q += d * d;
    }
    red[lid.x] = q;
    workgroupBarrier();
    for (var step = 32u; step > 0u; step >>= 1u) {
        if (lid.x < step) { red[lid.x] += red[lid.x + step]; }
        workgroupBarrier();
    }
    let inv = inverseSqrt(red[0] / f32(np.width) + np.eps);
    for (var i = lid.x; i < np.width; i += 64u) {
        ln_y[base + i] = (ln_x[base + i] - mean) * inv * ln_w[i] + ln_b[i];
    }
}

struct AttnParams { n: u32, heads: u32, hd: u32, width: u32, scale: f32, pad0: u32, pad1: u32, pad2: u32 };
@group(0) @binding(0) var<storage, read> at_q: array<f32>;
@group(0) @binding(1) var<storage, read> at_k: array<f32>;
@group(0) @binding(2) var<storage, read> at_v: array<f32>;
@group(0) @binding(3) var<storage, read_write> at_o: array<f32>;
@group(0) @binding(4) var<uniform> ap: AttnParams;

// One invocation per (query, head): a single pass over the keys with an online softmax, so the
// n x n score matrix never exists. head_dim <= 128.
@compute @workgroup_size(64, 1, 1)
fn attention(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let h = gid.y;
    if (i >= ap.n || h >= ap.heads) { return; }
    let qb = i * ap.width + h * ap.hd;
    var acc: array<f32, 128>;
    for (var d = 0u; d < ap.hd; d++) { acc[d] = 0.0; }
    var m = -3.0e38;
    var l = 0.0;
    for (var j = 0u; j < ap.n; j++) {
        let kb = j * ap.width + h * ap.hd;
        var s = 0.0;
        for (var d = 0u; d < ap.hd; d++) { s += at_q[qb + d] * at_k[kb + d]; }
        s *= ap.scale;
        let m_new = max(m, s);
        let c = exp(m - m_new);
        let p = exp(s - m_new);
        l = l * c + p;
        for (var d = 0u; d < ap.hd; d++) { acc[d] = acc[d] * c + p * at_v[kb + d]; }
        m = m_new;
    }
    for (var d = 0u; d < ap.hd; d++) { at_o[qb + d] = acc[d] / l; }
}

// Attention for head_dim <= 64, FlashAttention-style: a workgroup takes 16 queries of one head,
// walks the keys 16 at a time through workgroup memory, and keeps each query's running max, sum
// and output in registers (thread (q, x) owns output dims 4x..4x+3 of query q).
var<workgroup> fq: array<array<f32, 64>, 16>;
var<workgroup> fk: array<array<f32, 64>, 16>;
var<workgroup> fv: array<array<f32, 64>, 16>;
var<workgroup> fs: array<array<f32, 17>, 16>;

@compute @workgroup_size(16, 16, 1)
fn attention_tiled(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let h = wid.y;
    let q0 = wid.x * 16u;
    let qi = q0 + lid.y;
    let tid = lid.y * 16u + lid.x;
    for (var e = tid; e < 16u * ap.hd; e += 256u) {
        let r = e / ap.hd;
        let d = e % ap.hd;
        var v = 0.0;
        if (q0 + r < ap.n) { v = at_q[(q0 + r) * ap.width + h * ap.hd + d]; }
        fq[r][d] = v;
    }
    var m = -3.0e38;
    var l = 0.0;
    var acc = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < ap.n; k0 += 16u) {
        workgroupBarrier();
        for (var e = tid; e < 16u * ap.hd; e += 256u) {
            let r = e / ap.hd;
            let d = e % ap.hd;
            var kv = 0.0;
            var vv = 0.0;
            if (k0 + r < ap.n) {
                let base = (k0 + r) * ap.width + h * ap.hd + d;
                kv = at_k[base];
                vv = at_v[base];
            }
            fk[r][d] = kv;
            fv[r][d] = vv;
        }
        workgroupBarrier();
        var s = -3.0e38;
        if (k0 + lid.x < ap.n) {
            s = 0.0;
            for (var d = 0u; d < ap.hd; d++) { s += fq[lid.y][d] * fk[lid.x][d]; }
            s *= ap.scale;
        }
        fs[lid.y][lid.x] = s;
        workgroupBarrier();
        var tile_max = -3.0e38;
        for (var j = 0u; j < 16u; j++) { tile_max = max(tile_max, fs[lid.y][j]); }
        let m_new = max(m, tile_max);
        let c = exp(m - m_new);
        l = l * c;
        acc = acc * c;
        let d0 = lid.x * 4u;
        for (var j = 0u; j < 16u; j++) {
            if (k0 + j < ap.n) {
                let p = exp(fs[lid.y][j] - m_new);
                l += p;
                if (d0 < ap.hd) {
                    acc += p * vec4<f32>(fv[j][d0], fv[j][min(d0 + 1u, 63u)], fv[j][min(d0 + 2u, 63u)], fv[j][min(d0 + 3u, 63u)]);
                }
            }
        }
        m = m_new;
    }
    let d0 = lid.x * 4u;
    if (qi < ap.n && d0 < ap.hd) {
        let o = qi * ap.width + h * ap.hd + d0;
        let r = acc / l;
        at_o[o] = r.x;
        if (d0 + 1u < ap.hd) { at_o[o + 1u] = r.y; }
        if (d0 + 2u < ap.hd) { at_o[o + 2u] = r.z; }
        if (d0 + 3u < ap.hd) { at_o[o + 3u] = r.w; }
    }
}

struct PatchParams { side: u32, patch_size: u32, image: u32, pad: u32 };
@group(0) @binding(0) var<storage, read> pe_pixels: array<f32>;
@group(0) @binding(1) var<storage, read_write> pe_patches: array<f32>;
@group(0) @binding(2) var<uniform> pp: PatchParams;

// patches[t][c * p * p + ky * p + kx] = pixels[c][py * p + ky][px * p + kx] (CHW input).
@compute @workgroup_size(64, 1, 1)
fn im2col(@builtin(global_invocation_id) gid: vec3<u32>) {
    let per = 3u * pp.patch_size * pp.patch_size;
    let total = pp.side * pp.side * per;
    let idx = gid.x + gid.y * 65535u * 64u;
    if (idx >= total) { return; }
    let t = idx / per;
    let r = idx % per;
    let c = r / (pp.patch_size * pp.patch_size);
    let ky = (r / pp.patch_size) % pp.patch_size;
    let kx = r % pp.patch_size;
    let y = (t / pp.side) * pp.patch_size + ky;
    let x = (t % pp.side) * pp.patch_size + kx;
    pe_patches[idx] = pe_pixels[c * pp.image * pp.image + y * pp.image + x];
}

struct AddParams { len: u32, pad0: u32, pad1: u32, pad2: u32 };
@group(0) @binding(0) var<storage, read> add_src: array<f32>;
@group(0) @binding(1) var<storage, read_write> add_dst: array<f32>;
@group(0) @binding(2) var<uniform> adp: AddParams;

@compute @workgroup_size(64, 1, 1)
fn add(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x + gid.y * 65535u * 64u;
    if (i < adp.len) { add_dst[i] += add_src[i]; }
}

struct ShuffleParams { side: u32, dim: u32, factor: u32, pad: u32 };
@group(0) @binding(0) var<storage, read> ps_src: array<f32>;
@group(0) @binding(1) var<storage, read_write> ps_dst: array<f32>;
@group(0) @binding(2) var<uniform> sp: ShuffleParams;

// transformers' pixel_shuffle: token (hp, wp) of the (side / f)^2 grid gathers the f x f block
// below it, in its element order.
@compute @workgroup_size(64, 1, 1)
fn pixel_shuffle(@builtin(global_invocation_id) gid: vec3<u32>) {
    let f = sp.factor;
    let os = sp.side / f;
    let width = sp.dim * f * f;
    let idx = gid.x + gid.y * 65535u * 64u;
    if (idx >= os * os * width) { return; }
    let tok = idx / width;
    let k = idx % width;
    let hp = tok / os;
    let wp = tok % os;
    let h = hp * f + k / (sp.dim * f);
    let j = k % (sp.dim * f);
    let w = wp * f + j / sp.dim;
    ps_dst[idx] = ps_src[(h * sp.side + w) * sp.dim + j % sp.dim];
}
