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

const TILE: u32 = 16u;
var<workgroup> xs: array<array<f32, 16>, 16>;
var<workgroup> ws: array<array<f32, 16>, 16>;

fn gelu_tanh(x: f32) -> f32 {
    let c = 0.7978845608028654;
    return 0.5 * x * (1.0 + tanh(c * (x + 0.044715 * x * x * x)));
}

// y[m][n] (+)= x[m][k] . w[n][k] (+ b[n]), 16x16 output tile per workgroup, 16-wide k steps
// staged in workgroup memory.
@compute @workgroup_size(16, 16, 1)
fn linear(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let row = wid.y * TILE + lid.y;
    let col = wid.x * TILE + lid.x;
    let wrow = wid.x * TILE + lid.y;
    var acc = 0.0;
    for (var t = 0u; t < lp.k; t += TILE) {
        let kk = t + lid.x;
        var xv = 0.0;
        if (row < lp.m && kk < lp.k) { xv = lin_x[row * lp.k + kk]; }
        var wv = 0.0;
        if (wrow < lp.n && kk < lp.k) { wv = lin_w[wrow * lp.k + kk]; }
        xs[lid.y][lid.x] = xv;
        ws[lid.y][lid.x] = wv;
        workgroupBarrier();
        for (var i = 0u; i < TILE; i++) {
            acc += xs[lid.y][i] * ws[lid.x][i];
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
