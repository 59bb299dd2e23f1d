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

// The rotary angle of pair i at position `pos` for this op's pairing (rope_angle.wgsl).
fn rope_cs(pos: u32, i: u32) -> vec2<f32> {
    return rope_angle_cs(f32(pos), i, ROPE == 1u, pc.theta_scale);
}

// A value rounded to bf16 (to nearest, ties to even), as its 16 bits.
fn bf16_bits(x: f32) -> u32 {
    let u = bitcast<u32>(x);
    return (u + 0x7FFFu + ((u >> 16u) & 1u)) >> 16u;
}

// The two elements rotary pair i joins: (2i, 2i + 1) interleaved, (i, i + half) half-split.
fn rope_pair(i: u32) -> vec2<u32> {
    if (ROPE == 2u) {
        return vec2<u32>(i, i + pc.head_dim / 2u);
    }
    return vec2<u32>(2u * i, 2u * i + 1u);
}
