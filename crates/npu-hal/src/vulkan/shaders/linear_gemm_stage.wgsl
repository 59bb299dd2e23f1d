// The prefill GEMMs' loads (linear_gemm.wgsl, linear_gemm_coop.wgsl): a step of BK columns of
// a 64-row x 64-token tile as 64 KQ slots, each four neighbouring columns of one weight row and
// of one token's x. The module declares KQ (= BK / 4), THREADS (its workgroup size, a multiple
// of 64) and the linear_io.wgsl and weights.wgsl functions.

// One invocation's share of a step's tile, loaded and not yet decoded: the words behind four
// weights of a row, and four values of a token's x with their input-stage operand.
struct Staged {
    w: vec4<u32>,
    x: vec4<f32>,
    a: vec4<f32>,
}

// Slot `idx` (0 .. 64 KQ - 1) of the step at column k0: row (and token) idx / KQ, columns
// k0 + 4 (idx % KQ) .. + 3.
fn stage_load(row0: u32, tok0: u32, span: vec2<u32>, k0: u32, k_hi: u32, idx: u32) -> Staged {
    let r = idx / KQ;
    let kq = idx % KQ;
    var s: Staged;
    // Past the columns (a last step of a range not a whole BK): zeros.
    if (k0 + kq * 4u >= k_hi) {
        return s;
    }
    if (row0 + r < pc.rows) {
        s.w = w4_load(row0 + r, k0 + kq * 4u, pc.cols);
    }
    if (tok0 + r < span.y) {
        let t = span.x + tok0 + r;
        s.x = x[t * (pc.cols / 4u) + k0 / 4u + kq];
        s.a = load_aux(t, k0 / 4u + kq);
    }
    return s;
}

// Slot row `r`'s four weights, decoded (zeros past the matrix's rows).
fn staged_w(s: Staged, row0: u32, r: u32) -> vec4<f32> {
    if (row0 + r < pc.rows) {
        return w4_unpack(s.w);
    }
    return vec4<f32>(0.0);
}

// Slot row `r`'s four values of x through the input stage (zeros past the batch; the fused
// RMSNorm's 1 / rms from `inv_s`).
fn staged_x(s: Staged, tok0: u32, span: vec2<u32>, r: u32) -> vec4<f32> {
    if (tok0 + r >= span.y) {
        return vec4<f32>(0.0);
    }
    var inv = 1.0;
    if (IN_MODE == 1u) {
        inv = inv_s[r];
    }
    return stage_x(s.x, s.a, inv);
}

// The fused RMSNorm (IN_MODE 1): 1 / rms of each of the tile's 64 tokens into `inv_s`,
// THREADS / 64 invocations per token, each summing its share of the squares. Called by the
// whole workgroup.
var<workgroup> sq: array<f32, THREADS>;
var<workgroup> inv_s: array<f32, 64>;
fn tile_inv_rms(tok0: u32, span: vec2<u32>, lid: u32) {
    let per = THREADS / 64u;
    let r = lid / per;
    var s = 0.0;
    if (tok0 + r < span.y) {
        s = sum_squares(span.x + tok0 + r, lid % per, per);
    }
    sq[lid] = s;
    workgroupBarrier();
    if (lid < 64u) {
        var total = 0.0;
        for (var i = 0u; i < per; i++) {
            total += sq[per * lid + i];
        }
        inv_s[lid] = 1.0 / sqrt(total / f32(pc.cols) + pc.eps);
    }
    workgroupBarrier();
}
