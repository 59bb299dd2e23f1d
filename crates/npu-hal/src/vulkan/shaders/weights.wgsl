// Weight access for the linear and embedding kernels: `w4(row, k, cols)` is elements
// k .. k + 3 of row `row` (k a multiple of 4) of a `rows x cols` matrix stored as one of the
// formats below, selected by the constant W_FORMAT the including module declares:
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

fn w4(row: u32, k: u32, cols: u32) -> vec4<f32> {
    let e = row * cols + k;
    if (W_FORMAT == 0u) {
        return mx_vec4(e);
    } else if (W_FORMAT == 1u) {
        return vec4<f32>(
            bitcast<f32>(mx_codes[e]),
            bitcast<f32>(mx_codes[e + 1u]),
            bitcast<f32>(mx_codes[e + 2u]),
            bitcast<f32>(mx_codes[e + 3u]),
        );
    } else if (W_FORMAT == 2u) {
        let i = e / 2u;
        return vec4<f32>(unpack2x16float(mx_codes[i]), unpack2x16float(mx_codes[i + 1u]));
    } else if (W_FORMAT == 3u) {
        let i = e / 2u;
        let a = mx_codes[i];
        let b = mx_codes[i + 1u];
        return vec4<f32>(
            bitcast<f32>(a << 16u),
            bitcast<f32>(a & 0xFFFF0000u),
            bitcast<f32>(b << 16u),
            bitcast<f32>(b & 0xFFFF0000u),
        );
    } else if (W_FORMAT == 4u) {
        return w4_i8(mx_codes[e / 4u]) * bitcast<f32>(mx_scales[e / 32u]);
    }
    // Q4_0 / Q4_1: element j < 16 of a block is the low nibble of byte j, j >= 16 the high
    // nibble of byte j - 16.
    let block = e / 32u;
    let j = e % 32u;
    let word = mx_codes[block * 4u + (j % 16u) / 4u];
    let q = w4_nibbles(word >> select(0u, 4u, j >= 16u));
    if (W_FORMAT == 5u) {
        return (q - 8.0) * bitcast<f32>(mx_scales[block]);
    }
    return q * bitcast<f32>(mx_scales[2u * block]) + bitcast<f32>(mx_scales[2u * block + 1u]);
}
