// MX dequant-GEMV for GPUs: y[row] = sum_k W[row][k] * x[k], with W in mx-quant's linear layout.
// The decoding functions (mx_*) follow this file in GEMV_SOURCE: shaders/mx_decode.wgsl.
//
// The linear layout is a little-endian bit stream per row (FP4: 4 bits, FP6: 6, FP8/INT8: 8 per
// element), read here as u32 words; scales are one E8M0 byte per (row, 32-column block), four to
// a word. One workgroup per row: each invocation takes every 64th block of the row, decodes its
// codes, and the workgroup sums the partial results in shared memory. The format is chosen with
// pipeline-overridable constants (see `mx_quant::wgsl::override_constants`).

override MX_ELEM_BITS: u32 = 4u;
override MX_MANT_BITS: u32 = 1u;
override MX_EXP_BIAS: i32 = 1;
// 0: plain FP element; 1: FP8 E4M3 (S.1111.111 is NaN); 2: FP8 E5M2 (top exponent Inf/NaN);
// 3: INT8 (two's complement k, value k / 64).
override MX_KIND: u32 = 0u;

struct Params {
    rows: u32,
    cols: u32,
}

@group(0) @binding(0) var<storage, read> mx_codes: array<u32>;
@group(0) @binding(1) var<storage, read> mx_scales: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<uniform> params: Params;

const WORKGROUP: u32 = 64u;
var<workgroup> partial: array<f32, WORKGROUP>;

@compute @workgroup_size(64)
fn gemv(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    // Rows beyond 65535 continue in the dispatch's y dimension.
    let row = wg.x + wg.y * 65535u;
    let blocks = params.cols / 32u;
    var acc = 0.0;
    if (row < params.rows) {
        let row_bit = row * params.cols * MX_ELEM_BITS;
        for (var b = lid; b < blocks; b += WORKGROUP) {
            var dot = 0.0;
            for (var i = 0u; i < 32u; i++) {
                let k = b * 32u + i;
                dot += mx_decode(mx_code_at(row_bit + k * MX_ELEM_BITS)) * x[k];
            }
            acc += dot * mx_scale_at(row * blocks + b);
        }
    }
    partial[lid] = acc;
    workgroupBarrier();
    for (var stride = WORKGROUP / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) {
            partial[lid] += partial[lid + stride];
        }
        workgroupBarrier();
    }
    if (lid == 0u && row < params.rows) {
        y[row] = partial[0];
    }
}
