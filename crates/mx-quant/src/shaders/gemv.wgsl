// MX dequant-GEMV for GPUs: y[row] = sum_k W[row][k] * x[k], with W in mx-quant's linear layout.
//
// The linear layout is a little-endian bit stream per row (FP4: 4 bits, FP6: 6, FP8/INT8: 8 per
// element), read here as u32 words; scales are one E8M0 byte per (row, 32-column block), four to
// a word. One workgroup per row: each invocation takes every 64th block of the row, decodes its
// codes, and the workgroup sums the partial results in shared memory. The format is chosen with
// pipeline-overridable constants (see `mx_quant::wgsl::override_constants`).

override ELEM_BITS: u32 = 4u;
override MANT_BITS: u32 = 1u;
override EXP_BIAS: i32 = 1;
// 0: plain FP element; 1: FP8 E4M3 (S.1111.111 is NaN); 2: FP8 E5M2 (top exponent Inf/NaN);
// 3: INT8 (two's complement k, value k / 64).
override KIND: u32 = 0u;

struct Params {
    rows: u32,
    cols: u32,
}

@group(0) @binding(0) var<storage, read> codes: array<u32>;
@group(0) @binding(1) var<storage, read> scales: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<uniform> params: Params;

const WORKGROUP: u32 = 64u;
const NAN_BITS: u32 = 0x7FC00000u;
var<workgroup> partial: array<f32, WORKGROUP>;

// 2^e built from its bits (exact, unlike exp2); below the normal range the one value used,
// 2^-127, is an f32 subnormal, which a GPU may flush to zero.
fn pow2(e: i32) -> f32 {
    if (e < -126) {
        return bitcast<f32>(0x00400000u >> u32(-127 - e));
    }
    return bitcast<f32>(u32(e + 127) << 23u);
}

fn decode(code: u32) -> f32 {
    if (KIND == 3u) {
        return f32(bitcast<i32>(code << 24u) >> 24u) * (1.0 / 64.0);
    }
    let sign_bit = 1u << (ELEM_BITS - 1u);
    let mag = code & (sign_bit - 1u);
    let e = mag >> MANT_BITS;
    let m = mag & ((1u << MANT_BITS) - 1u);
    var v: f32;
    if (KIND == 1u && mag == 0x7Fu) {
        v = bitcast<f32>(NAN_BITS);
    } else if (KIND == 2u && e == 31u) {
        v = select(bitcast<f32>(NAN_BITS), bitcast<f32>(0x7F800000u), m == 0u);
    } else if (e == 0u) {
        v = f32(m) * pow2(1 - EXP_BIAS - i32(MANT_BITS));
    } else {
        v = f32((1u << MANT_BITS) + m) * pow2(i32(e) - EXP_BIAS - i32(MANT_BITS));
    }
    return select(v, -v, (code & sign_bit) != 0u);
}

// Element k of the row whose first bit is `row_bit`.
fn code_at(row_bit: u32, k: u32) -> u32 {
    let p = row_bit + k * ELEM_BITS;
    let w = p >> 5u;
    let s = p & 31u;
    var v = codes[w] >> s;
    if (s + ELEM_BITS > 32u) {
        v = v | (codes[w + 1u] << (32u - s));
    }
    return v & ((1u << ELEM_BITS) - 1u);
}

fn scale_at(i: u32) -> f32 {
    let b = (scales[i >> 2u] >> ((i & 3u) * 8u)) & 0xFFu;
    if (b == 255u) {
        return bitcast<f32>(NAN_BITS);
    }
    return pow2(i32(b) - 127);
}

@compute @workgroup_size(64)
fn gemv(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    // Rows beyond 65535 continue in the dispatch's y dimension.
    let row = wg.x + wg.y * 65535u;
    let blocks = params.cols / 32u;
    var acc = 0.0;
    if (row < params.rows) {
        let row_bit = row * params.cols * ELEM_BITS;
        for (var b = lid; b < blocks; b += WORKGROUP) {
            var dot = 0.0;
            for (var i = 0u; i < 32u; i++) {
                let k = b * 32u + i;
                dot += decode(code_at(row_bit, k)) * x[k];
            }
            acc += dot * scale_at(row * blocks + b);
        }
    }
    partial[lid] = acc;
    workgroupBarrier();
    for (var stride = WORKGROUP / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) {
            partial[lid] += partial[lid + stride];
        }
        workgroupBarrier();
    }
    if (lid == 0u && row < params.rows) {
        y[row] = partial[0];
    }
}
