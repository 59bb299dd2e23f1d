#version 460
// The encoder's tensor-core GEMM in GLSL (`vision_gpu`, `GpuVisionOptions::glsl_gemm`):
// y[m][n] (op)= x[m][k] . w[n][k] (+ b[n]), x and w f16, f32 sums; gemm_coop's bindings,
// flags and grid. What GLSL gives that naga's WGSL does not: 16-byte loads and workgroup-memory
// stores (a cooperative load may read f16 tiles from uvec4 workgroup memory), and an epilogue
// on each invocation's own accumulator elements, written straight to y in pairs (no scratch, no
// barrier), where `vision_gpu::fragment_attention_support` has checked the layout.
//
// A workgroup computes a BM x BN block of y with (BM / (16 TM)) x (BN / (16 TN)) subgroups, each
// TM x TN tiles of 16x16. K advances 32 at a time through two buffers of workgroup memory:
// every invocation holds its share of the x and w tiles of the next PF steps in registers
// (16-byte loads, coalesced along k) and stores each into a buffer just before its step; one
// barrier per step.
//
// Contract (checked by the host): k a multiple of 32, n even; x holds m*k, w n*k, b n (when
// flagged) and y m*n values (f32, or f16 pairs packed into u32s with flag 8); workgroups
// (ceil(n / BN), ceil(m / BM), 1). Rows past m or n are clamped onto the last one (their
// results are never written).
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_control_flow_attributes : require

#ifndef BM
#define BM 64
#endif
#ifndef BN
#define BN 64
#endif
#ifndef TM
#define TM 2
#endif
#ifndef TN
#define TN 2
#endif
#ifndef PF
#define PF 4
#endif
#define BK 32
#define SGN (BN / (16 * TN))
#define THREADS ((BM / (16 * TM)) * SGN * 32)
// A staged row: BK f16s as 4 uvec4s, plus 1 so the 8 rows a tile load touches fall on
// distinct banks.
#define LDT 5
#define A_VECS (BM * 4)
#define B_VECS (BN * 4)
#define A_PER ((A_VECS + THREADS - 1) / THREADS)
#define B_PER ((B_VECS + THREADS - 1) / THREADS)

layout(local_size_x = THREADS, local_size_y = 1, local_size_z = 1) in;

layout(set = 0, binding = 0, std430) readonly buffer X { uvec4 gx[]; };
layout(set = 0, binding = 1, std430) readonly buffer W { uvec4 gw[]; };
layout(set = 0, binding = 2, std430) readonly buffer Bias { float gb[]; };
layout(set = 0, binding = 3, std430) buffer Y { uint gy[]; };
layout(set = 0, binding = 4, std140) uniform Params { uint m; uint n; uint k; uint flags; } gp;

shared uvec4 ta[2 * BM * LDT];
shared uvec4 tb[2 * BN * LDT];
// Per subgroup, a 16x16 f16 matrix whose every element is its row number: loaded row-major it
// gives each accumulator element's row, column-major its column (the epilogue's).
shared float16_t idx[(THREADS / 32) * 256];

#define ACC coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
#define ACC16 coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
#define MAT_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define MAT_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define E 8

float gelu_tanh(float x) {
    const float c = 0.7978845608028654;
    return 0.5 * x * (1.0 + tanh(c * (x + 0.044715 * x * x * x)));
}

void main() {
    const uint tid = gl_LocalInvocationIndex;
    const uint sg = gl_SubgroupID;
    const uint lane = gl_SubgroupInvocationID;
    const uint row0 = gl_WorkGroupID.y * BM;
    const uint col0 = gl_WorkGroupID.x * BN;
    const uint k4 = gp.k / 8u; // uvec4s per row
    const uint steps = gp.k / BK;
    const uint sr = sg / SGN;
    const uint sc = sg % SGN;

    // Where each staged vector comes from: vector e of a tile is row e / 4, k vector e % 4.
    uint a_src[A_PER];
    uint b_src[B_PER];
    [[unroll]] for (uint i = 0; i < A_PER; i++) {
        const uint e = min(tid + i * THREADS, A_VECS - 1u);
        a_src[i] = min(row0 + e / 4u, gp.m - 1u) * k4 + e % 4u;
    }
    [[unroll]] for (uint i = 0; i < B_PER; i++) {
        const uint e = min(tid + i * THREADS, B_VECS - 1u);
        b_src[i] = min(col0 + e / 4u, gp.n - 1u) * k4 + e % 4u;
    }
    uvec4 ra[PF][A_PER];
    uvec4 rb[PF][B_PER];
    [[unroll]] for (uint p = 0; p < PF; p++) {
        if (p < steps) {
            [[unroll]] for (uint i = 0; i < A_PER; i++) { ra[p][i] = gx[a_src[i] + p * 4u]; }
            [[unroll]] for (uint i = 0; i < B_PER; i++) { rb[p][i] = gw[b_src[i] + p * 4u]; }
        }
    }

    ACC c[TM][TN];
    [[unroll]] for (uint i = 0; i < TM; i++) {
        [[unroll]] for (uint j = 0; j < TN; j++) { c[i][j] = ACC(0.0); }
    }
    for (uint base = 0u; base < steps; base += PF) {
        [[unroll]] for (uint p = 0; p < PF; p++) {
            const uint s = base + p;
            if (s < steps) {
                const uint buf = s % 2u;
                [[unroll]] for (uint i = 0; i < A_PER; i++) {
                    const uint e = tid + i * THREADS;
                    if (A_VECS % THREADS == 0 || e < A_VECS) {
                        ta[buf * BM * LDT + (e / 4u) * LDT + e % 4u] = ra[p][i];
                    }
                }
                [[unroll]] for (uint i = 0; i < B_PER; i++) {
                    const uint e = tid + i * THREADS;
                    if (B_VECS % THREADS == 0 || e < B_VECS) {
                        tb[buf * BN * LDT + (e / 4u) * LDT + e % 4u] = rb[p][i];
                    }
                }
                controlBarrier(gl_ScopeWorkgroup, gl_ScopeWorkgroup, gl_StorageSemanticsShared,
                               gl_SemanticsAcquireRelease);
                if (s + PF < steps) {
                    [[unroll]] for (uint i = 0; i < A_PER; i++) {
                        ra[p][i] = gx[a_src[i] + (s + PF) * 4u];
                    }
                    [[unroll]] for (uint i = 0; i < B_PER; i++) {
                        rb[p][i] = gw[b_src[i] + (s + PF) * 4u];
                    }
                }
                [[unroll]] for (uint kk = 0; kk < 2; kk++) {
                    MAT_A a[TM];
                    [[unroll]] for (uint i = 0; i < TM; i++) {
                        coopMatLoad(a[i], ta, buf * BM * LDT + (sr * 16u * TM + 16u * i) * LDT + 2u * kk,
                                    LDT, gl_CooperativeMatrixLayoutRowMajor);
                    }
                    [[unroll]] for (uint j = 0; j < TN; j++) {
                        MAT_B b;
                        coopMatLoad(b, tb, buf * BN * LDT + (sc * 16u * TN + 16u * j) * LDT + 2u * kk,
                                    LDT, gl_CooperativeMatrixLayoutColumnMajor);
                        [[unroll]] for (uint i = 0; i < TM; i++) {
                            c[i][j] = coopMatMulAdd(a[i], b, c[i][j]);
                        }
                    }
                }
            }
        }
    }

    // The epilogue on this invocation's own elements: element i of every accumulator is at
    // (rows[i], cols[i]) of its tile, elements 2j and 2j + 1 side by side (checked on the
    // device), so each pair is one 8-byte (f32) or 4-byte (f16) store.
    const uint ix = sg * 256u;
    for (uint e = lane; e < 256u; e += 32u) {
        idx[ix + e] = float16_t(e / 16u);
    }
    controlBarrier(gl_ScopeSubgroup, gl_ScopeSubgroup, gl_StorageSemanticsShared,
                   gl_SemanticsAcquireRelease);
    ACC16 rows16;
    ACC16 cols16;
    coopMatLoad(rows16, idx, ix, 16, gl_CooperativeMatrixLayoutRowMajor);
    coopMatLoad(cols16, idx, ix, 16, gl_CooperativeMatrixLayoutColumnMajor);
    const ACC rows = ACC(rows16);
    const ACC cols = ACC(cols16);
    const uint flags = gp.flags;
    const uint r0 = row0 + sr * 16u * TM;
    const uint c0 = col0 + sc * 16u * TN;
    [[unroll]] for (uint i = 0; i < TM; i++) {
        [[unroll]] for (uint j = 0; j < TN; j++) {
            [[unroll]] for (int e = 0; e < E; e += 2) {
                const uint row = r0 + 16u * i + uint(rows[e]);
                const uint col = c0 + 16u * j + uint(cols[e]);
                if (row < gp.m && col < gp.n) {
                    vec2 v = vec2(c[i][j][e], c[i][j][e + 1]);
                    if ((flags & 1u) != 0u) { v += vec2(gb[col], gb[col + 1u]); }
                    if ((flags & 2u) != 0u) { v = vec2(gelu_tanh(v.x), gelu_tanh(v.y)); }
                    const uint o = row * gp.n + col;
                    if ((flags & 8u) != 0u) {
                        gy[o / 2u] = packFloat2x16(f16vec2(v));
                    } else {
                        if ((flags & 4u) != 0u) {
                            v += vec2(uintBitsToFloat(gy[o]), uintBitsToFloat(gy[o + 1u]));
                        }
                        gy[o] = floatBitsToUint(v.x);
                        gy[o + 1u] = floatBitsToUint(v.y);
                    }
                }
            }
        }
    }
}
