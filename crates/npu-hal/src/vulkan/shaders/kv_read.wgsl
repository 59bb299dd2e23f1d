// Reading KV pages, for the attention kernels (attention.wgsl, attention_tiled.wgsl): the module
// declares HD and binds the pages as `kv_word` and `kv_mx_elem` (shaders.rs).

// Elements 2p and 2p + 1 of a token's vector in a page.
fn kv_pair(page: u32, token: u32, p: u32) -> vec2<f32> {
    if (KV_DTYPE == 0u) {
        let at = (page + token * 4u * HD) / 4u + 2u * p;
        return vec2<f32>(bitcast<f32>(kv_word(at)), bitcast<f32>(kv_word(at + 1u)));
    } else if (KV_DTYPE == 1u) {
        return unpack2x16float(kv_word((page + token * 2u * HD) / 4u + p));
    } else if (KV_DTYPE == 2u) {
        let w = kv_word((page + token * 2u * HD) / 4u + p);
        return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xFFFF0000u));
    }
    return vec2<f32>(kv_mx_elem(page, token, 2u * p), kv_mx_elem(page, token, 2u * p + 1u));
}

// Two values as a page of the cache's dtype would give them back (f32, f16 or bf16).
fn as_stored(x: vec2<f32>) -> vec2<f32> {
    if (KV_DTYPE == 1u) {
        return unpack2x16float(pack2x16float(x));
    } else if (KV_DTYPE == 2u) {
        return vec2<f32>(bitcast<f32>(bf16_bits(x.x) << 16u), bitcast<f32>(bf16_bits(x.y) << 16u));
    }
    return x;
}

// Rotary pair i of batch row b's key for KV head kvh, from the k tensor (both attention
// modules, which bind `k`; `kvw` is its width): rotated with ROPE_K at position `pos` and
// rounded as the KV write stores it. Returns the elements `rope_pair(i)` names.
fn batch_key_pair(b: u32, i: u32, kvh: u32, kvw: u32, pos: u32) -> vec2<f32> {
    let ab = rope_pair(i);
    let base = b * kvw + kvh * HD;
    var k2 = vec2<f32>(k[base + ab.x], k[base + ab.y]);
    if (ROPE_K != 0u) {
        let cs = rope_cs(pos, i);
        k2 = vec2<f32>(k2.x * cs.x - k2.y * cs.y, k2.x * cs.y + k2.y * cs.x);
    }
    return as_stored(k2);
}

// Merging split attention's partial results (both attention modules, which bind `partials`):
// `count` partials of HD + 2 values from `parts` on, each a range's unnormalised output, then
// its maximum and its sum. `merge_scale` gives (the largest maximum, the sums scaled to it and
// added); `merged_output` element d of the merged, normalised output.
fn merge_scale(parts: u32, count: u32) -> vec2<f32> {
    var big = -3.0e38;
    for (var z = 0u; z < count; z++) {
        big = max(big, partials[parts + z * (HD + 2u) + HD]);
    }
    var sum = 0.0;
    for (var z = 0u; z < count; z++) {
        let at = parts + z * (HD + 2u);
        sum += partials[at + HD + 1u] * exp(partials[at + HD] - big);
    }
    return vec2<f32>(big, sum);
}

fn merged_output(parts: u32, count: u32, scale: vec2<f32>, d: u32) -> f32 {
    var o = 0.0;
    for (var z = 0u; z < count; z++) {
        let at = parts + z * (HD + 2u);
        o += partials[at + d] * exp(partials[at + HD] - scale.x);
    }
    return o / scale.y;
}
