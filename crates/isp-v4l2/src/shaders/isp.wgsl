// The fused ISP pass on the GPU: one invocation per output pixel (two for f16 output) reads the
// frame's own bytes (NV12, I420, YUYV, 4:2:2 / 4:4:4 planar or RGB24, as 32-bit words), resizes
// each channel on its own plane with swscale's bilinear or area filter (luma and chroma each at
// their own resolution, chroma centre-sited), converts YUV to RGB, normalises with mean/std and
// writes f32 or packed f16 in CHW or HWC. It is the CPU reference in isp.rs, operation for
// operation: the same windows (placed with the same integer arithmetic), weights, edge folding
// and per-axis normalisation; the tests hold it to that reference on a real driver.

struct Params {
    format: u32, src_w: u32, src_h: u32, luma_stride: u32,
    c0: u32, c1: u32, c_stride: u32, is_rgb: u32,
    crop_x: u32, crop_y: u32, crop_w: u32, crop_h: u32,
    out_w: u32, out_h: u32, resize: u32, out_layout: u32,
    y_offset: f32, y_scale: f32, c_scale: f32, r_cr: f32,
    g_cb: f32, g_cr: f32, b_cb: f32, out_f16: u32,
    chr_x: u32, chr_y: u32, chr_w: u32, chr_h: u32,
    // Per axis (luma x, luma y, chroma x, chroma y): swscale's 16.16 step, window size, and
    // construction (0 windowed, 1 linear, 2 unscaled).
    inc: vec4<i32>,
    taps: vec4<i32>,
    mode: vec4<u32>,
    scale: vec4<f32>,
    bias: vec4<f32>,
};

@group(0) @binding(0) var<storage, read> frame: array<u32>;
// f32 values as their bits, or two f16 values per word.
@group(0) @binding(1) var<storage, read_write> out: array<u32>;
@group(0) @binding(2) var<uniform> p: Params;

fn byte_at(i: u32) -> f32 {
    let w = frame[i >> 2u];
    return f32((w >> ((i & 3u) * 8u)) & 0xffu);
}

// The first channel (Y, or R for RGB24) at frame coordinates (x, y).
fn luma(x: u32, y: u32) -> f32 {
    let ls = p.luma_stride;
    switch p.format {
        case 2u: { return byte_at(y * ls + 2u * x); } // YUYV
        case 5u: { return byte_at(y * ls + 3u * x); } // RGB24
        default: { return byte_at(y * ls + x); }
    }
}

// The other two channels (U and V, or G and B) at chroma-plane coordinates (x, y).
fn chroma(x: u32, y: u32) -> vec2<f32> {
    let ls = p.luma_stride;
    switch p.format {
        case 0u: { // NV12
            let c = p.c0 + y * ls + 2u * x;
            return vec2<f32>(byte_at(c), byte_at(c + 1u));
        }
        case 2u: { // YUYV
            let c = y * ls + 4u * x;
            return vec2<f32>(byte_at(c + 1u), byte_at(c + 3u));
        }
        case 5u: { // RGB24
            let c = y * ls + 3u * x;
            return vec2<f32>(byte_at(c + 1u), byte_at(c + 2u));
        }
        default: { // I420, 4:2:2 and 4:4:4 planar
            let c = y * p.c_stride + x;
            return vec2<f32>(byte_at(p.c0 + c), byte_at(p.c1 + c));
        }
    }
}

// Output o's window on axis a: its first source index (possibly outside the source) and its
// centre relative to that index, in 2^-17 source pixels (windowed) or 2^-16 (linear).
fn window(a: u32, o: u32) -> vec2<i32> {
    let inc = p.inc[a];
    let oi = i32(o);
    if (p.mode[a] == 2u) {
        return vec2<i32>(oi, 0);
    }
    if (p.mode[a] == 1u) {
        let pos = (inc >> 1u) - 0x8000 + oi * inc;
        let first = pos >> 16u;
        return vec2<i32>(first, pos - first * 0x10000);
    }
    let pos = (2 * oi + 1) * inc - 0x10000;
    // WGSL's i32 division truncates toward zero, as C's does in swscale.
    let first = (pos - (p.taps[a] - 2) * 0x10000) / 0x20000;
    return vec2<i32>(first, pos - first * 0x20000);
}

// The unnormalised weight of tap j of a window with relative centre rel on axis a; ratio is
// output / source samples.
fn weight(a: u32, j: i32, rel: i32, ratio: f32) -> f32 {
    if (p.mode[a] == 2u) {
        return 1.0;
    }
    if (p.mode[a] == 1u) {
        return max(1.0 - f32(abs(j * 0x10000 - rel)) / 65536.0, 0.0);
    }
    var d = f32(abs(j * 0x20000 - rel)) / 131072.0;
    if (p.inc[a] > 0x10000) {
        d = d * ratio; // shrinking: distance in output pixels
    }
    if (p.resize == 0u) {
        return max(1.0 - d, 0.0);
    }
    return clamp(0.5 - (d - 0.5) * f32(p.inc[a]) / 65536.0, 0.0, 1.0);
}

fn norm(sum: f32) -> f32 {
    return select(1.0, sum, sum > 0.0);
}

// Luma (or R) of output (ox, oy), filtered on its plane.
fn filter_luma(ox: u32, oy: u32) -> f32 {
    let wx = window(0u, ox);
    let wy = window(1u, oy);
    let rx = f32(p.out_w) / f32(p.crop_w);
    let ry = f32(p.out_h) / f32(p.crop_h);
    var sum_x = 0.0;
    for (var j = 0; j < p.taps.x; j++) {
        sum_x += weight(0u, j, wx.y, rx);
    }
    var sum_y = 0.0;
    var acc = 0.0;
    for (var k = 0; k < p.taps.y; k++) {
        let w = weight(1u, k, wy.y, ry);
        sum_y += w;
        if (w == 0.0) {
            continue;
        }
        let y = p.crop_y + u32(clamp(wy.x + k, 0, i32(p.crop_h) - 1));
        var row = 0.0;
        for (var j = 0; j < p.taps.x; j++) {
            let x = p.crop_x + u32(clamp(wx.x + j, 0, i32(p.crop_w) - 1));
            row += weight(0u, j, wx.y, rx) * luma(x, y);
        }
        acc += w * row;
    }
    return acc / (norm(sum_x) * norm(sum_y));
}

// Chroma (or G, B) of output (ox, oy), filtered on the chroma plane at its own resolution.
fn filter_chroma(ox: u32, oy: u32) -> vec2<f32> {
    let wx = window(2u, ox);
    let wy = window(3u, oy);
    let rx = f32(p.out_w) / f32(p.chr_w);
    let ry = f32(p.out_h) / f32(p.chr_h);
    var sum_x = 0.0;
    for (var j = 0; j < p.taps.z; j++) {
        sum_x += weight(2u, j, wx.y, rx);
    }
    var sum_y = 0.0;
    var acc = vec2<f32>(0.0);
    for (var k = 0; k < p.taps.w; k++) {
        let w = weight(3u, k, wy.y, ry);
        sum_y += w;
        if (w == 0.0) {
            continue;
        }
        let y = p.chr_y + u32(clamp(wy.x + k, 0, i32(p.chr_h) - 1));
        var row = vec2<f32>(0.0);
        for (var j = 0; j < p.taps.z; j++) {
            let x = p.chr_x + u32(clamp(wx.x + j, 0, i32(p.chr_w) - 1));
            row += weight(2u, j, wx.y, rx) * chroma(x, y);
        }
        acc += w * row;
    }
    return acc / (norm(sum_x) * norm(sum_y));
}

// The normalised output values of pixel (ox, oy).
fn pixel(ox: u32, oy: u32) -> vec3<f32> {
    let s = vec3<f32>(filter_luma(ox, oy), filter_chroma(ox, oy));
    var rgb = s;
    if (p.is_rgb == 0u) {
        let y = (s.x - p.y_offset) * p.y_scale;
        let cb = (s.y - 128.0) * p.c_scale;
        let cr = (s.z - 128.0) * p.c_scale;
        rgb = vec3<f32>(y + p.r_cr * cr, y + p.g_cb * cb + p.g_cr * cr, y + p.b_cb * cb);
    }
    return clamp(rgb, vec3<f32>(0.0), vec3<f32>(255.0)) * p.scale.xyz + p.bias.xyz;
}

@compute @workgroup_size(8, 8, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let oy = gid.y;
    let n = p.out_w * p.out_h;
    if (p.out_f16 != 0u) {
        // Two horizontally adjacent pixels (the width is even), packed as f16 pairs; element 2k
        // is the low half of word k.
        let ox = 2u * gid.x;
        if (ox >= p.out_w || oy >= p.out_h) {
            return;
        }
        let a = pixel(ox, oy);
        let b = pixel(ox + 1u, oy);
        let o = oy * p.out_w + ox;
        if (p.out_layout == 0u) {
            out[o / 2u] = pack2x16float(vec2<f32>(a.x, b.x));
            out[(n + o) / 2u] = pack2x16float(vec2<f32>(a.y, b.y));
            out[(2u * n + o) / 2u] = pack2x16float(vec2<f32>(a.z, b.z));
        } else {
            let w = 3u * o / 2u;
            out[w] = pack2x16float(a.xy);
            out[w + 1u] = pack2x16float(vec2<f32>(a.z, b.x));
            out[w + 2u] = pack2x16float(b.yz);
        }
        return;
    }
    let ox = gid.x;
    if (ox >= p.out_w || oy >= p.out_h) {
        return;
    }
    let v = pixel(ox, oy);
    let o = oy * p.out_w + ox;
    if (p.out_layout == 0u) {
        out[o] = bitcast<u32>(v.x);
        out[n + o] = bitcast<u32>(v.y);
        out[2u * n + o] = bitcast<u32>(v.z);
    } else {
        out[3u * o] = bitcast<u32>(v.x);
        out[3u * o + 1u] = bitcast<u32>(v.y);
        out[3u * o + 2u] = bitcast<u32>(v.z);
    }
}
