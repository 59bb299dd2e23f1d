// MX decoding for WGSL kernels (mx_quant::wgsl::DECODE_SOURCE): elements of mx-quant's linear
// layout, a little-endian bit stream (FP4: 4 bits, FP6: 6, FP8/INT8: 8 per element) read as u32
// words, and E8M0 scales, one byte per 32-element block, four to a word.
//
// The including module declares the format as constants or pipeline overrides (see
// `mx_quant::wgsl::decode_constants` and `override_constants`):
//   MX_ELEM_BITS: u32, MX_MANT_BITS: u32, MX_EXP_BIAS: i32,
//   MX_KIND: u32 (0: plain FP element; 1: FP8 E4M3, S.1111.111 is NaN; 2: FP8 E5M2, top
//   exponent Inf/NaN; 3: INT8, two's complement k, value k / 64)
// and two storage bindings: `mx_codes: array<u32>` and `mx_scales: array<u32>`. `mx_load4` and
// `mx_vec4` read one word past the element's, so their `mx_codes` carries a spare word.

const MX_NAN_BITS: u32 = 0x7FC00000u;

// 2^e built from its bits (exact, unlike exp2); below the normal range the one value used,
// 2^-127, is an f32 subnormal, which a GPU may flush to zero.
fn mx_pow2(e: i32) -> f32 {
    if (e < -126) {
        return bitcast<f32>(0x00400000u >> u32(-127 - e));
    }
    return bitcast<f32>(u32(e + 127) << 23u);
}

// The value of one element code (before its block's scale), without branches: normal and
// subnormal elements are both mm * 2^(max(e, 1) - bias - mantissa bits), mm being the mantissa
// with its implicit one when e > 0, and that power of two is always a normal f32 for the MX
// element formats (2^-16 .. 2^13).
fn mx_decode(code: u32) -> f32 {
    if (MX_KIND == 3u) {
        return f32(bitcast<i32>(code << 24u) >> 24u) * (1.0 / 64.0);
    }
    let sign_bit = 1u << (MX_ELEM_BITS - 1u);
    let mag = code & (sign_bit - 1u);
    let e = mag >> MX_MANT_BITS;
    let m = mag & ((1u << MX_MANT_BITS) - 1u);
    let mm = m + select(0u, 1u << MX_MANT_BITS, e != 0u);
    let p = i32(max(e, 1u)) - MX_EXP_BIAS - i32(MX_MANT_BITS);
    var v = f32(mm) * bitcast<f32>(u32(p + 127) << 23u);
    if (MX_KIND == 1u) {
        v = select(v, bitcast<f32>(MX_NAN_BITS), mag == 0x7Fu);
    } else if (MX_KIND == 2u) {
        let special = select(bitcast<f32>(MX_NAN_BITS), bitcast<f32>(0x7F800000u), m == 0u);
        v = select(v, special, e == 31u);
    }
    return select(v, -v, (code & sign_bit) != 0u);
}

// The code whose first bit is bit `p` of the stream.
fn mx_code_at(p: u32) -> u32 {
    let w = p >> 5u;
    let s = p & 31u;
    var v = mx_codes[w] >> s;
    if (s + MX_ELEM_BITS > 32u) {
        v = v | (mx_codes[w + 1u] << (32u - s));
    }
    return v & ((1u << MX_ELEM_BITS) - 1u);
}

// The scale of block `i` (elements 32i .. 32i + 31 of the stream); 0xFF is NaN.
fn mx_scale_at(i: u32) -> f32 {
    let b = (mx_scales[i >> 2u] >> ((i & 3u) * 8u)) & 0xFFu;
    if (b == 255u) {
        return bitcast<f32>(MX_NAN_BITS);
    }
    return mx_pow2(i32(b) - 127);
}

// The words behind elements `first` .. `first + 3` (`first` a multiple of 4, so all four share
// one block and span at most two words): (the code word holding the first bit, the next one,
// the scale word, first). The loads alone, so that a kernel can issue them early and decode
// with `mx_unpack4` when the values are due. For 6-bit codes it reads one word past the element's: give
// `mx_codes` a spare word at the end (mx_quant::wgsl::code_words).
fn mx_load4(first: u32) -> vec4<u32> {
    let w = (first * MX_ELEM_BITS) >> 5u;
    // 4- and 8-bit codes: four aligned codes never cross a word, so the next word is not read
    // (a load per four elements saved; `mx_unpack4` does not look at it then).
    if ((32u % (4u * MX_ELEM_BITS)) == 0u) {
        return vec4<u32>(mx_codes[w], 0u, mx_scales[first / 128u], first);
    }
    return vec4<u32>(mx_codes[w], mx_codes[w + 1u], mx_scales[first / 128u], first);
}

// The four values `mx_load4` fetched, scaled.
fn mx_unpack4(raw: vec4<u32>) -> vec4<f32> {
    let first = raw.w;
    let s = (first * MX_ELEM_BITS) & 31u;
    // The 32 bits from bit s of the two words (4 codes take at most 32).
    let window = select((raw.x >> s) | (raw.y << (32u - s)), raw.x, s == 0u);
    let mask = (1u << MX_ELEM_BITS) - 1u;
    let values = vec4<f32>(
        mx_decode(window & mask),
        mx_decode((window >> MX_ELEM_BITS) & mask),
        mx_decode((window >> (2u * MX_ELEM_BITS)) & mask),
        mx_decode((window >> (3u * MX_ELEM_BITS)) & mask),
    );
    let block = first / 32u;
    let b = (raw.z >> ((block & 3u) * 8u)) & 0xFFu;
    let scale = select(mx_pow2(i32(b) - 127), bitcast<f32>(MX_NAN_BITS), b == 255u);
    return values * scale;
}

// Elements `first` .. `first + 3` of the stream, scaled (see `mx_load4`).
fn mx_vec4(first: u32) -> vec4<f32> {
    return mx_unpack4(mx_load4(first));
}
