// Attention statistics for KV pruning that ranks pages by attention (npu-hal's
// `Submission::attention`): every (row, head) workgroup adds each cache key's probability to
// `stats`, laid out [layer][mass | last][step[11] keys]: `mass` sums over heads and rows, `last`
// is the batch's last row averaged over heads. The host zeroes it before the submission and
// reads it after. Float adds go through compare-and-swap on the bits, so their order (and the
// last bits of a sum) vary from run to run.
@group(0) @binding(8) var<storage, read_write> stats: array<atomic<u32>>;

fn add_stat(i: u32, v: f32) {
    var old = atomicLoad(&stats[i]);
    loop {
        let r = atomicCompareExchangeWeak(&stats[i], old, bitcast<u32>(bitcast<f32>(old) + v));
        if (r.exchanged) {
            break;
        }
        old = r.old_value;
    }
}

fn record_stats(
    row: u32,
    keys: u32,
    mx: f32,
    total: f32,
    lid: u32,
    first: u32,
    cached: u32,
    kvh: u32,
    kvw: u32,
) {
    let stride = step[11u];
    let base = pc.layer * 2u * stride;
    let last = row + 1u == step_n();
    for (var j = lid; j < keys; j += WG) {
        let p = exp(key_score(j, first, cached, kvh, kvw) - mx) / total;
        add_stat(base + j, p);
        if (last) {
            add_stat(base + stride + j, p / f32(pc.q_heads));
        }
    }
}
