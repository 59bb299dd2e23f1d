// The fused ISP pass on the GPU: one invocation per output pixel reads the frame's own bytes
// (NV12, I420, YUYV, 4:2:2 / 4:4:4 planar or RGB24, as 32-bit words), converts YUV to RGB,
// resizes (bilinear or area) from the crop rectangle, normalises with mean/std and writes f32 in
// CHW or HWC. It is the CPU reference in isp.rs, operation for operation; the tests hold it to
// that reference on a real driver.

struct Params {
    format: u32, src_w: u32, src_h: u32, luma_stride: u32,
    c0: u32, c1: u32, c_stride: u32, is_rgb: u32,
    crop_x: u32, crop_y: u32, crop_w: u32, crop_h: u32,
    out_w: u32, out_h: u32, resize: u32, out_layout: u32,
    y_offset: f32, y_scale: f32, c_scale: f32, r_cr: f32,
    g_cb: f32, g_cr: f32, b_cb: f32, sx: f32,
    sy: f32, pad0: u32, pad1: u32, pad2: u32,
    scale: vec4<f32>,
    bias: vec4<f32>,
};

@group(0) @binding(0) var<storage, read> frame: array<u32>;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<uniform> p: Params;

fn byte_at(i: u32) -> f32 {
    let w = frame[i >> 2u];
    return f32((w >> ((i & 3u) * 8u)) & 0xffu);
}

// The frame's own sample (YUV, or RGB for RGB24) at crop-relative (x, y).
fn sample(cx: u32, cy: u32) -> vec3<f32> {
    let x = p.crop_x + cx;
    let y = p.crop_y + cy;
    let ls = p.luma_stride;
    switch p.format {
        case 0u: { // NV12
            let c = p.c0 + (y / 2u) * ls + (x / 2u) * 2u;
            return vec3<f32>(byte_at(y * ls + x), byte_at(c), byte_at(c + 1u));
        }
        case 1u: { // I420
            let c = (y / 2u) * p.c_stride + x / 2u;
            return vec3<f32>(byte_at(y * ls + x), byte_at(p.c0 + c), byte_at(p.c1 + c));
        }
        case 2u: { // YUYV
            let row = y * ls + (x / 2u) * 4u;
            return vec3<f32>(byte_at(row + (x % 2u) * 2u), byte_at(row + 1u), byte_at(row + 3u));
        }
        case 3u: { // 4:2:2 planar
            let c = y * p.c_stride + x / 2u;
            return vec3<f32>(byte_at(y * ls + x), byte_at(p.c0 + c), byte_at(p.c1 + c));
        }
        case 4u: { // 4:4:4 planar
            let c = y * p.c_stride + x;
            return vec3<f32>(byte_at(y * ls + x), byte_at(p.c0 + c), byte_at(p.c1 + c));
        }
        default: { // RGB24
            let o = y * ls + 3u * x;
            return vec3<f32>(byte_at(o), byte_at(o + 1u), byte_at(o + 2u));
        }
    }
}

fn to_rgb(s: vec3<f32>) -> vec3<f32> {
    if (p.is_rgb != 0u) {
        return s;
    }
    let y = (s.x - p.y_offset) * p.y_scale;
    let cb = (s.y - 128.0) * p.c_scale;
    let cr = (s.z - 128.0) * p.c_scale;
    return vec3<f32>(y + p.r_cr * cr, y + p.g_cb * cb + p.g_cr * cr, y + p.b_cb * cb);
}

struct Taps { i0: u32, i1: u32, a: f32 };

fn taps(o: u32, s: f32, len: u32) -> Taps {
    let f = clamp((f32(o) + 0.5) * s - 0.5, 0.0, f32(len - 1u));
    let i0 = u32(f);
    return Taps(i0, min(i0 + 1u, len - 1u), f - f32(i0));
}

@compute @workgroup_size(8, 8, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let ox = gid.x;
    let oy = gid.y;
    if (ox >= p.out_w || oy >= p.out_h) {
        return;
    }
    var rgb: vec3<f32>;
    if (p.resize == 0u) {
        let tx = taps(ox, p.sx, p.crop_w);
        let ty = taps(oy, p.sy, p.crop_h);
        let a = sample(tx.i0, ty.i0);
        let b = sample(tx.i1, ty.i0);
        let c = sample(tx.i0, ty.i1);
        let d = sample(tx.i1, ty.i1);
        let top = a + (b - a) * tx.a;
        let bottom = c + (d - c) * tx.a;
        rgb = to_rgb(top + (bottom - top) * ty.a);
    } else {
        let x0 = u32(f32(ox) * p.sx);
        let x1 = max(min(u32(ceil(f32(ox + 1u) * p.sx)), p.crop_w), x0 + 1u);
        let y0 = u32(f32(oy) * p.sy);
        let y1 = max(min(u32(ceil(f32(oy + 1u) * p.sy)), p.crop_h), y0 + 1u);
        var sum = vec3<f32>(0.0);
        for (var y = y0; y < y1; y++) {
            for (var x = x0; x < x1; x++) {
                sum += clamp(to_rgb(sample(x, y)), vec3<f32>(0.0), vec3<f32>(255.0));
            }
        }
        rgb = sum / f32((x1 - x0) * (y1 - y0));
    }
    let v = clamp(rgb, vec3<f32>(0.0), vec3<f32>(255.0)) * p.scale.xyz + p.bias.xyz;
    let o = oy * p.out_w + ox;
    let n = p.out_w * p.out_h;
    if (p.out_layout == 0u) {
        out[o] = v.x;
        out[n + o] = v.y;
        out[2u * n + o] = v.z;
    } else {
        out[3u * o] = v.x;
        out[3u * o + 1u] = v.y;
        out[3u * o + 2u] = v.z;
    }
}
