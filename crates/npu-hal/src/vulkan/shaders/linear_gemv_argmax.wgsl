// The output head's per-workgroup maxima (a one-token or short-batch GEMV whose output the host
// takes the argmax of): each workgroup writes, for each token row it computed, the largest of
// its rows' outputs and that row's index, so greedy decoding reads `num_workgroups` pairs per
// token instead of the whole vocabulary (npu-hal's `Device::row_argmax`).
//
// Contract (checked by the host before it picks this variant): ROWS_PER_WG * NT <= WG, so
// each invocation stored at most one output (that of row lid % ROWS_PER_WG, token
// lid / ROWS_PER_WG); ROWS_PER_WG is a power of two; row indices are below 2^24 (exact as
// f32); y has room for the pairs at `pc.partials`: pair (t * num_workgroups + wg) holds the
// value and the index as an f32, -1 where the workgroup saw no value that is not NaN.
// The order is that of the host's `kernels::argmax`: the larger value wins, then the smaller
// index; NaN never counts (an output that is NaN is not offered).
const NO_ROW: u32 = 0xffffffffu;
// One candidate per aligned run of min(ROWS_PER_WG, subgroup size) invocations.
var<workgroup> best_v: array<f32, WG>;
var<workgroup> best_i: array<u32, WG>;

// Whether candidate (bv, bi) beats (av, ai).
fn beats(av: f32, ai: u32, bv: f32, bi: u32) -> bool {
    return bi != NO_ROW && (ai == NO_ROW || bv > av || (bv == av && bi < ai));
}

// `wg` and `groups`: this workgroup's index along the rows and their count; `t0`, `nt`: its
// first token row and how many it computed; (v0, i0): the output this invocation stored.
fn gemv_argmax(lid: u32, sg_size: u32, wg: u32, groups: u32, t0: u32, nt: u32, v0: f32, i0: u32) {
    var v = v0;
    var i = i0;
    // A butterfly within aligned runs of `width` invocations: a token's rows are a run of
    // ROWS_PER_WG invocations from a multiple of ROWS_PER_WG, so a run never mixes tokens.
    let width = min(ROWS_PER_WG, sg_size);
    for (var mask = width / 2u; mask > 0u; mask >>= 1u) {
        let ov = subgroupShuffleXor(v, mask);
        let oi = subgroupShuffleXor(i, mask);
        if (beats(v, i, ov, oi)) {
            v = ov;
            i = oi;
        }
    }
    if (lid % width == 0u) {
        best_v[lid / width] = v;
        best_i[lid / width] = i;
    }
    workgroupBarrier();
    let runs = ROWS_PER_WG / width;
    if (lid < nt) {
        var bv = best_v[lid * runs];
        var bi = best_i[lid * runs];
        for (var r = 1u; r < runs; r++) {
            let ov = best_v[lid * runs + r];
            let oi = best_i[lid * runs + r];
            if (beats(bv, bi, ov, oi)) {
                bv = ov;
                bi = oi;
            }
        }
        let at = pc.partials + ((t0 + lid) * groups + wg) * 2u;
        y[at] = bv;
        y[at + 1u] = select(f32(bi), -1.0, bi == NO_ROW);
    }
}
