// KV page addressing, as kv-paged lays blocks out: a block holds, for each layer, K then V,
// each [kv_head][token][head_dim]; one head's page is block_tokens vectors. f32/f16/bf16
// vectors are raw little-endian values; MX pages are planar (every token's packed codes, then
// every token's E8M0 scales, one per 32 elements). The module declares KV_DTYPE
// (0 f32, 1 f16, 2 bf16, 3 MX with the MX_* constants of mx_decode.wgsl).
struct KvParams {
    layer: u32,
    kv_heads: u32,
    head_dim: u32,
    block_tokens: u32,
    block_bytes: u32,
    q_heads: u32,
    scale: f32,
    theta_scale: f32,
}
var<immediate> pc: KvParams;

// Bytes of one token-head vector.
fn kv_vector_bytes() -> u32 {
    if (KV_DTYPE == 0u) {
        return 4u * pc.head_dim;
    } else if (KV_DTYPE == 3u) {
        return pc.head_dim * MX_ELEM_BITS / 8u + pc.head_dim / 32u;
    }
    return 2u * pc.head_dim;
}

// Byte offset of the page of (block, K or V, head) for this op's layer.
fn kv_page(block: u32, is_v: u32, head: u32) -> u32 {
    return block * pc.block_bytes
        + ((pc.layer * 2u + is_v) * pc.kv_heads + head) * pc.block_tokens * kv_vector_bytes();
}

// The rotary angle of pair i at position `pos` as (cos, sin), as rope.wgsl computes it: ROPE 1
// multiplies the position by theta_scale i times (interleaved pairs), ROPE 2 takes
// pos * inv_freq[i] (half-split pairs); the angle is reduced to [-pi, pi] in two steps.
fn rope_cs(pos: u32, i: u32) -> vec2<f32> {
    var angle: f32;
    if (ROPE == 1u) {
        // theta_scale^i by squaring, a fixed eight steps (i < 256), so no loop runs a
        // lane-dependent number of times: llvmpipe (Mesa 22.3) miscomputes such a loop when
        // every lane of a SIMD batch takes it. Within an ulp or two of the CPU's recurrence.
        var p = 1.0;
        var b = pc.theta_scale;
        for (var bit = 0u; bit < 8u; bit++) {
            p = select(p, p * b, ((i >> bit) & 1u) != 0u);
            b = b * b;
        }
        angle = f32(pos) * p;
    } else {
        angle = f32(pos) * inv_freq[i];
    }
    let t = round(angle * 0.15915494309189535);
    let r = (angle - t * 6.28125) - t * 0.0019353071795864769;
    return vec2<f32>(cos(r), sin(r));
}

// The two elements rotary pair i joins: (2i, 2i + 1) interleaved, (i, i + half) half-split.
fn rope_pair(i: u32) -> vec2<u32> {
    if (ROPE == 2u) {
        return vec2<u32>(i, i + pc.head_dim / 2u);
    }
    return vec2<u32>(2u * i, 2u * i + 1u);
}
