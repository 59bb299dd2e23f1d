// Causal grouped-query attention of each batch row over its sequence's KV pages (read through
// the block table in the step buffer), one workgroup per (row, query head). Keys go 64 at a
// time: each invocation scores one, then every invocation folds the tile into its own output
// dimensions with an online softmax (m, l rescaled per tile), so any context length works.
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

const WG: u32 = 64u;
// Output dimensions per invocation: head_dim <= 256.
const DPT: u32 = 4u;
var<workgroup> qs: array<f32, 256>;
var<workgroup> sc: array<f32, WG>;

fn kv_elem(page: u32, token: u32, d: u32) -> f32 {
    if (KV_DTYPE == 0u) {
        return bitcast<f32>(kv_word((page + token * 4u * pc.head_dim) / 4u + d));
    } else if (KV_DTYPE == 1u) {
        let pair = unpack2x16float(kv_word((page + token * 2u * pc.head_dim) / 4u + d / 2u));
        return select(pair.x, pair.y, (d & 1u) != 0u);
    } else if (KV_DTYPE == 2u) {
        let w = kv_word((page + token * 2u * pc.head_dim) / 4u + d / 2u);
        return bitcast<f32>(select(w << 16u, w & 0xFFFF0000u, (d & 1u) != 0u));
    }
    return kv_mx_elem(page, token, d);
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wg.x;
    let h = wg.y;
    if (row >= step_n()) {
        return;
    }
    let hd = pc.head_dim;
    let qw = pc.q_heads * hd;
    let kvh = h / (pc.q_heads / pc.kv_heads);
    for (var d = lid; d < hd; d += WG) {
        qs[d] = q[row * qw + h * hd + d] * pc.scale;
    }
    workgroupBarrier();
    let keys = step_first_pos() + row + 1u;
    var m = -3.0e38;
    var l = 0.0;
    var acc: array<f32, DPT>;
    for (var t0 = 0u; t0 < keys; t0 += WG) {
        let j = t0 + lid;
        var s = -3.0e38;
        if (j < keys) {
            let page = kv_page(step_block(j / pc.block_tokens), 0u, kvh);
            let token = j % pc.block_tokens;
            s = 0.0;
            for (var d = 0u; d < hd; d++) {
                s += qs[d] * kv_elem(page, token, d);
            }
        }
        sc[lid] = s;
        workgroupBarrier();
        var mt = m;
        let count = min(WG, keys - t0);
        for (var i = 0u; i < count; i++) {
            mt = max(mt, sc[i]);
        }
        workgroupBarrier();
        sc[lid] = exp(s - mt);
        workgroupBarrier();
        let corr = exp(m - mt);
        l *= corr;
        for (var c = 0u; c < DPT; c++) {
            acc[c] *= corr;
        }
        for (var i = 0u; i < count; i++) {
            let p = sc[i];
            l += p;
            let jj = t0 + i;
            let page = kv_page(step_block(jj / pc.block_tokens), 1u, kvh);
            let token = jj % pc.block_tokens;
            for (var c = 0u; c < DPT; c++) {
                let d = lid + c * WG;
                if (d < hd) {
                    acc[c] += p * kv_elem(page, token, d);
                }
            }
        }
        m = mt;
        workgroupBarrier();
    }
    for (var c = 0u; c < DPT; c++) {
        let d = lid + c * WG;
        if (d < hd) {
            out[row * qw + h * hd + d] = acc[c] / l;
        }
    }
}
