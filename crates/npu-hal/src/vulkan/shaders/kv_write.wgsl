// Writes each batch row's K and V into its KV slot, converting to the page dtype (what
// kv-paged's KvCache::write does on the CPU). One workgroup per (row, KV head, K or V):
// invocations over elements (f32), pairs (f16, bf16) or 32-element blocks (MX, which take the
// OCP scale floor(log2(amax)) - emax and round to nearest even, saturating).
// With ROPE 1 (interleaved pairs) or 2 (half-split pairs) the rotary embedding of K is applied
// here, as the Rope op folded into this one would have (same angles as rope.wgsl).
@group(0) @binding(1) var<storage, read> k: array<f32>;
@group(0) @binding(2) var<storage, read> v: array<f32>;

// Element d of the head vector starting at `base`, for the row at position `pos`.
fn src(is_v: u32, base: u32, d: u32, pos: u32) -> f32 {
    if (is_v != 0u) {
        return v[base + d];
    }
    if (ROPE == 0u) {
        return k[base + d];
    }
    let half_dim = pc.head_dim / 2u;
    var i: u32;
    var a: u32;
    var b: u32;
    if (ROPE == 1u) {
        i = d / 2u;
        a = 2u * i;
        b = a + 1u;
    } else {
        i = d % half_dim;
        a = i;
        b = i + half_dim;
    }
    let cs = rope_cs(pos, i);
    let x0 = k[base + a];
    let x1 = k[base + b];
    if (d == a) {
        return x0 * cs.x - x1 * cs.y;
    }
    return x0 * cs.y + x1 * cs.x;
}

fn floor_log2(a: f32) -> i32 {
    // Only called on normal values and zero (zero gives -127).
    return i32((bitcast<u32>(a) >> 23u) & 0xFFu) - 127;
}

fn pow2(e: i32) -> f32 {
    return bitcast<f32>(u32(clamp(e, -126, 127) + 127) << 23u);
}

// One element, already divided by its block's scale, as a code of the page's MX format.
fn mx_encode(x: f32) -> u32 {
    let sign = select(0u, 1u << (MX_ELEM_BITS - 1u), x < 0.0);
    let a = min(abs(x), MX_MAXV);
    let min_e = 1 - MX_EXP_BIAS;
    let e = max(floor_log2(a), min_e);
    let q = pow2(e - i32(MX_MANT_BITS));
    let r = round(a / q) * q;
    var code: u32;
    if (r < pow2(min_e)) {
        code = u32(r / pow2(min_e - i32(MX_MANT_BITS)));
    } else {
        let e2 = floor_log2(r);
        let mant = u32(r / pow2(e2 - i32(MX_MANT_BITS))) - (1u << MX_MANT_BITS);
        code = (u32(e2 + MX_EXP_BIAS) << MX_MANT_BITS) | mant;
    }
    return sign | code;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wg.x;
    let head = wg.y;
    let is_v = wg.z;
    if (row >= step_n()) {
        return;
    }
    let slot = step_slot(row);
    let block = slot / pc.block_tokens;
    let token = slot % pc.block_tokens;
    let hd = pc.head_dim;
    let src_at = row * pc.kv_heads * hd + head * hd;
    let pos = step_first_pos() + row;
    let page = kv_page(block, is_v, head);
    let at = (page + token * kv_vector_bytes()) / 4u;
    if (KV_DTYPE == 0u) {
        for (var d = lid; d < hd; d += 64u) {
            kv_store(at + d, bitcast<u32>(src(is_v, src_at, d, pos)));
        }
    } else if (KV_DTYPE == 1u) {
        for (var p = lid; p < hd / 2u; p += 64u) {
            let pair = vec2<f32>(src(is_v, src_at, 2u * p, pos), src(is_v, src_at, 2u * p + 1u, pos));
            kv_store(at + p, pack2x16float(pair));
        }
    } else if (KV_DTYPE == 2u) {
        for (var p = lid; p < hd / 2u; p += 64u) {
            let lo = bf16_bits(src(is_v, src_at, 2u * p, pos));
            let hi = bf16_bits(src(is_v, src_at, 2u * p + 1u, pos));
            kv_store(at + p, lo | (hi << 16u));
        }
    } else {
        let b = lid;
        if (b >= hd / 32u) {
            return;
        }
        var amax = 0.0;
        for (var i = 0u; i < 32u; i++) {
            amax = max(amax, abs(src(is_v, src_at, b * 32u + i, pos)));
        }
        var x = -127;
        if (amax > 0.0) {
            x = clamp(floor_log2(amax) - MX_EMAX, -127, 127);
        }
        let inv = pow2(-x);
        // Codes: 32 elements of MX_ELEM_BITS are whole words, and a token's codes start on a
        // word (head_dim * bits / 8 is a multiple of 4 for head_dim a multiple of 32).
        let code_bits = (page + token * hd * MX_ELEM_BITS / 8u) * 8u + b * 32u * MX_ELEM_BITS;
        var word = 0u;
        var filled = 0u;
        var w = code_bits / 32u;
        for (var i = 0u; i < 32u; i++) {
            word |= mx_encode(src(is_v, src_at, b * 32u + i, pos) * inv) << filled;
            filled += MX_ELEM_BITS;
            if (filled >= 32u) {
                kv_store(w, word);
                w += 1u;
                filled -= 32u;
                // The bits of the last code that did not fit (FP6 straddles words).
                word = select(0u, mx_encode(src(is_v, src_at, b * 32u + i, pos) * inv) >> (MX_ELEM_BITS - filled), filled > 0u);
            }
        }
        // The scale byte shares its word with other tokens' scales: set it atomically.
        let sb = page + pc.block_tokens * hd * MX_ELEM_BITS / 8u + token * (hd / 32u) + b;
        let shift = (sb % 4u) * 8u;
        kv_set_byte(sb / 4u, shift, u32(x + 127));
    }
}
