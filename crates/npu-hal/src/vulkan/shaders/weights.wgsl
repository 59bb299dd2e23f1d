// Weight access for the linear and embedding kernels: `w4(row, k, cols)` is elements
// k .. k + 3 of row `row` (k a multiple of 4) of a `rows x cols` matrix stored as one of the
// formats below (`w4_load` then `w4_unpack`, for kernels that issue loads ahead), selected by
// the constant W_FORMAT the including module declares:
//   0 MX (mx-quant's linear layout, decoded by mx_decode.wgsl, appended after this file)
//   1 dense f32   2 dense f16   3 dense bf16
//   4 ggml Q8_0   5 ggml Q4_0   6 ggml Q4_1
// The ggml blocks are kept bit for bit but split into planes so every load is a whole word:
// `mx_codes` holds the quants (32 per block: 8 words for Q8_0, 4 for Q4_0/Q4_1, in ggml's
// order), `mx_scales` the block's f32 scale (and, for Q4_1, its f32 minimum after it).
@group(0) @binding(1) var<storage, read> mx_codes: array<u32>;
@group(0) @binding(2) var<storage, read> mx_scales: array<u32>;

fn w4_i8(w: u32) -> vec4<f32> {
    return vec4<f32>(
        f32(bitcast<i32>(w << 24u) >> 24u),
        f32(bitcast<i32>(w << 16u) >> 24u),
        f32(bitcast<i32>(w << 8u) >> 24u),
        f32(bitcast<i32>(w) >> 24u),
    );
}

fn w4_nibbles(w: u32) -> vec4<f32> {
    return vec4<f32>(
        f32(w & 0xFu),
        f32((w >> 8u) & 0xFu),
        f32((w >> 16u) & 0xFu),
        f32((w >> 24u) & 0xFu),
    );
}

// The words behind elements k .. k + 3 of row `row`, loaded and not yet decoded, so a kernel
// can issue the loads of several steps before it waits on any (`w4_unpack` decodes them):
//   MX: mx_load4's (code word, next word, scale word, element index);
//   f32: the four values' bits;  f16 / bf16: two words of pairs, then 0, 0;
//   Q8_0: the quant word, the scale, 0, 0;  Q4_0: the quant word, the scale, 0, the nibble
//   shift;  Q4_1: the quant word, the scale, the minimum, the nibble shift.
fn w4_load(row: u32, k: u32, cols: u32) -> vec4<u32> {
    let e = row * cols + k;
    if (W_FORMAT == 0u) {
        return mx_load4(e);
    } else if (W_FORMAT == 1u) {
        return vec4<u32>(mx_codes[e], mx_codes[e + 1u], mx_codes[e + 2u], mx_codes[e + 3u]);
    } else if (W_FORMAT == 2u || W_FORMAT == 3u) {
        let i = e / 2u;
        return vec4<u32>(mx_codes[i], mx_codes[i + 1u], 0u, 0u);
    } else if (W_FORMAT == 4u) {
        return vec4<u32>(mx_codes[e / 4u], mx_scales[e / 32u], 0u, 0u);
    }
    // Q4_0 / Q4_1: element j < 16 of a block is the low nibble of byte j, j >= 16 the high
    // nibble of byte j - 16.
    let block = e / 32u;
    let j = e % 32u;
    let word = mx_codes[block * 4u + (j % 16u) / 4u];
    let shift = select(0u, 4u, j >= 16u);
    if (W_FORMAT == 5u) {
        return vec4<u32>(word, mx_scales[block], 0u, shift);
    }
    return vec4<u32>(word, mx_scales[2u * block], mx_scales[2u * block + 1u], shift);
}

// The four weights `w4_load` fetched.
fn w4_unpack(raw: vec4<u32>) -> vec4<f32> {
    if (W_FORMAT == 0u) {
        return mx_unpack4(raw);
    } else if (W_FORMAT == 1u) {
        return bitcast<vec4<f32>>(raw);
    } else if (W_FORMAT == 2u) {
        return vec4<f32>(unpack2x16float(raw.x), unpack2x16float(raw.y));
    } else if (W_FORMAT == 3u) {
        return vec4<f32>(
            bitcast<f32>(raw.x << 16u),
            bitcast<f32>(raw.x & 0xFFFF0000u),
            bitcast<f32>(raw.y << 16u),
            bitcast<f32>(raw.y & 0xFFFF0000u),
        );
    } else if (W_FORMAT == 4u) {
        return w4_i8(raw.x) * bitcast<f32>(raw.y);
    }
    let q = w4_nibbles(raw.x >> raw.w);
    if (W_FORMAT == 5u) {
        return (q - 8.0) * bitcast<f32>(raw.y);
    }
    return q * bitcast<f32>(raw.y) + bitcast<f32>(raw.z);
}

fn w4(row: u32, k: u32, cols: u32) -> vec4<f32> {
    return w4_unpack(w4_load(row, k, cols));
}
