#version 460
// The encoder's tensor-core GEMM in GLSL (`vision_gpu::CoopGemmSource::Glsl`), with the
// contract and bindings of `gemm_coop` (vit_coop.wgsl) for f16 weights:
//   y[m][n] (op)= x[m][k] . w[n][k] (+ b[n]), x and w f16, sums in f32.
// What GLSL reaches that naga's WGSL does not: the accumulators' elements. The epilogue works
// on them in registers: the bias is the accumulators' starting value, GELU runs element by
// element, the residual is loaded as an accumulator and added, and the result is stored
// straight from the accumulator (converted to f16 where asked), with no trip through workgroup
// memory and no workgroup barrier. Loads are 16 bytes wide (8 f16s).
//
// A workgroup computes a BM x BN block of y with WM x WN subgroups, each a (BM / WM) x (BN / WN)
// block as TM x TN tiles of 16x16. K advances BK at a time through double-buffered workgroup
// memory: every invocation loads its share of the next step's x and w tiles into registers
// before it multiplies the current one and stages them after, so each step costs one workgroup
// barrier.
//
// Split k: workgroup z of the dispatch takes k's columns [z k_chunk, (z + 1) k_chunk) and
// writes its product into plane z of y (m*n values from z*m*n on); a dispatch of one plane
// (z = 0, k_chunk >= k) is the whole product.
//
// Contract (the host checks it before it dispatches, `vision_gpu`): n and k multiples of 8
// (any m); k_chunk a multiple of BK, and z k_chunk < k for every z of the dispatch; x holds
// m*k, w n*k, b n (when flagged) and y m*n values per plane (f32, or f16 with flag 8).
// Rows past m or n are clamped onto the last one when loaded and never written; columns past
// the workgroup's slice of k read as zeros. Tiles that reach past m or n are finished through
// the subgroup's 16x16 scratch, element by element.
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
#ifndef WM
#define WM 2
#endif
#ifndef WN
#define WN 2
#endif
#ifndef BK
#define BK 32
#endif
#define TM (BM / (16 * WM))
#define TN (BN / (16 * WN))
#define THREADS (WM * WN * 32)
// A staged row: BK f16s plus 8 (16 bytes), so the 8 rows a tile load touches at once fall on
// distinct banks; in 16-byte vectors.
#define LDV (BK / 8 + 1)
// 16-byte vectors per staged row and per invocation and step, of x and of w.
#define ROW_V (BK / 8)
#define A_PER (BM * ROW_V / THREADS)
#define B_PER (BN * ROW_V / THREADS)

#if (BM * ROW_V) % THREADS != 0 || (BN * ROW_V) % THREADS != 0 || BM % (16 * WM) != 0 || BN % (16 * WN) != 0 || BK % 16 != 0
#error "the blocking must split evenly among the subgroups and invocations"
#endif

layout(local_size_x = THREADS, local_size_y = 1, local_size_z = 1) in;

layout(set = 0, binding = 0, std430) readonly buffer X { uvec4 gx[]; };
layout(set = 0, binding = 1, std430) readonly buffer W { uvec4 gw[]; };
layout(set = 0, binding = 2, std430) readonly buffer Bias { float gb[]; };
// y is f32, or f16 with flag 8: one binding seen as either.
layout(set = 0, binding = 3, std430) buffer Y32 { float gy32[]; };
layout(set = 0, binding = 3, std430) buffer Y16 { float16_t gy16[]; };
layout(set = 0, binding = 4, std140) uniform Params {
    uint m;
    uint n;
    uint k;
    uint flags;
    uint k_chunk;
    uint p0;
    uint p1;
    uint p2;
} gp;

#define FLAG_BIAS 1u
#define FLAG_GELU 2u
#define FLAG_RESIDUAL 4u
#define FLAG_F16 8u

shared uvec4 ta[2 * BM * LDV];
shared uvec4 tb[2 * BN * LDV];
// Per subgroup: the bias rows the accumulators start from, and the tiles that reach past
// m or n on their way out.
shared float scratch[WM * WN * 256];

#define ACC coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
#define ACC16 coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
#define MAT_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define MAT_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>

void subgroup_handoff() {
    controlBarrier(gl_ScopeSubgroup, gl_ScopeSubgroup, gl_StorageSemanticsShared,
                   gl_SemanticsAcquireRelease);
}

void workgroup_handoff() {
    controlBarrier(gl_ScopeWorkgroup, gl_ScopeWorkgroup, gl_StorageSemanticsShared,
                   gl_SemanticsAcquireRelease);
}

float gelu_tanh(float v) {
    const float c = 0.7978845608028654;
    return 0.5 * v * (1.0 + tanh(c * (v + 0.044715 * v * v * v)));
}

void main() {
    const uint tid = gl_LocalInvocationIndex;
    const uint sg = gl_SubgroupID;
    const uint lane = gl_SubgroupInvocationID;
    const uint m = gp.m;
    const uint n = gp.n;
    const uint k = gp.k;
    const uint flags = gp.flags;
    const uint row0 = gl_WorkGroupID.y * BM;
    const uint col0 = gl_WorkGroupID.x * BN;
    const uint k_begin = gl_WorkGroupID.z * gp.k_chunk;
    const uint k_end = min(k, k_begin + gp.k_chunk);
    const uint plane = gl_WorkGroupID.z * m * n;
    const uint steps = (k_end - k_begin + BK - 1u) / BK;
    // This subgroup's block of the workgroup's, and its first row and column of y.
    const uint sr = sg / WN;
    const uint sc = sg % WN;
    const uint r0 = row0 + sr * 16u * TM;
    const uint c0 = col0 + sc * 16u * TN;
    const uint ws = sg * 256u;

    // Accumulators start at the bias (each of the 16 rows of scratch holds the tile's 16
    // values) or at zero.
    ACC acc[TM][TN];
    [[unroll]] for (uint j = 0; j < TN; j++) {
        ACC start = ACC(0.0);
        if ((flags & FLAG_BIAS) != 0u) {
            for (uint e = lane; e < 256u; e += 32u) {
                scratch[ws + e] = gb[min(c0 + 16u * j + e % 16u, n - 1u)];
            }
            subgroup_handoff();
            coopMatLoad(start, scratch, ws, 16u, gl_CooperativeMatrixLayoutRowMajor);
            subgroup_handoff();
        }
        [[unroll]] for (uint i = 0; i < TM; i++) {
            acc[i][j] = start;
        }
    }

    // Vector e = tid + i * THREADS of a step's tile: row e / ROW_V, vector e % ROW_V of the
    // row's BK columns. Vectors past the slice of k are zeros (k_end is a multiple of 8).
    const uint vrow = tid / ROW_V;
    const uint vcol = (tid % ROW_V) * 8u;
    uvec4 ra[A_PER];
    uvec4 rb[B_PER];
    [[unroll]] for (uint i = 0; i < A_PER; i++) {
        const uint r = min(row0 + vrow + i * (THREADS / ROW_V), m - 1u);
        const uint c = k_begin + vcol;
        ra[i] = c < k_end ? gx[(r * k + c) / 8u] : uvec4(0u);
    }
    [[unroll]] for (uint i = 0; i < B_PER; i++) {
        const uint r = min(col0 + vrow + i * (THREADS / ROW_V), n - 1u);
        const uint c = k_begin + vcol;
        rb[i] = c < k_end ? gw[(r * k + c) / 8u] : uvec4(0u);
    }

    for (uint step = 0u; step < steps; step++) {
        const uint buf = step & 1u;
        // Stage this step. Buffer `buf` was last read in step - 2, which every invocation
        // finished before it passed the previous step's barrier.
        [[unroll]] for (uint i = 0; i < A_PER; i++) {
            ta[buf * BM * LDV + (vrow + i * (THREADS / ROW_V)) * LDV + tid % ROW_V] = ra[i];
        }
        [[unroll]] for (uint i = 0; i < B_PER; i++) {
            tb[buf * BN * LDV + (vrow + i * (THREADS / ROW_V)) * LDV + tid % ROW_V] = rb[i];
        }
        workgroup_handoff();
        // Load the next step while this one multiplies.
        const uint c = k_begin + (step + 1u) * BK + vcol;
        [[unroll]] for (uint i = 0; i < A_PER; i++) {
            const uint r = min(row0 + vrow + i * (THREADS / ROW_V), m - 1u);
            ra[i] = c < k_end ? gx[(r * k + c) / 8u] : uvec4(0u);
        }
        [[unroll]] for (uint i = 0; i < B_PER; i++) {
            const uint r = min(col0 + vrow + i * (THREADS / ROW_V), n - 1u);
            rb[i] = c < k_end ? gw[(r * k + c) / 8u] : uvec4(0u);
        }
        const uint abase = buf * BM * LDV + sr * 16u * TM * LDV;
        const uint bbase = buf * BN * LDV + sc * 16u * TN * LDV;
        [[unroll]] for (uint kk = 0; kk < ROW_V; kk += 2u) {
            MAT_A a[TM];
            [[unroll]] for (uint i = 0; i < TM; i++) {
                coopMatLoad(a[i], ta, abase + 16u * i * LDV + kk, LDV,
                            gl_CooperativeMatrixLayoutRowMajor);
            }
            [[unroll]] for (uint j = 0; j < TN; j++) {
                // B = w^T: a column of B is a row of w, so w's staged rows are columns.
                MAT_B b;
                coopMatLoad(b, tb, bbase + 16u * j * LDV + kk, LDV,
                            gl_CooperativeMatrixLayoutColumnMajor);
                [[unroll]] for (uint i = 0; i < TM; i++) {
                    acc[i][j] = coopMatMulAdd(a[i], b, acc[i][j]);
                }
            }
        }
    }

    // The epilogue, tile by tile: GELU in registers, then the residual and the store.
    [[unroll]] for (uint i = 0; i < TM; i++) {
        [[unroll]] for (uint j = 0; j < TN; j++) {
            ACC v = acc[i][j];
            if ((flags & FLAG_GELU) != 0u) {
                for (int e = 0; e < v.length(); e++) {
                    v[e] = gelu_tanh(v[e]);
                }
            }
            const uint row = r0 + 16u * i;
            const uint col = c0 + 16u * j;
            const uint at = plane + row * n + col;
            if (row + 16u <= m && col + 16u <= n) {
                if ((flags & FLAG_F16) != 0u) {
                    coopMatStore(ACC16(v), gy16, at, n, gl_CooperativeMatrixLayoutRowMajor);
                } else {
                    if ((flags & FLAG_RESIDUAL) != 0u) {
                        ACC y;
                        coopMatLoad(y, gy32, at, n, gl_CooperativeMatrixLayoutRowMajor);
                        v = v + y;
                    }
                    coopMatStore(v, gy32, at, n, gl_CooperativeMatrixLayoutRowMajor);
                }
            } else {
                coopMatStore(v, scratch, ws, 16u, gl_CooperativeMatrixLayoutRowMajor);
                subgroup_handoff();
                for (uint e = lane; e < 256u; e += 32u) {
                    const uint rr = row + e / 16u;
                    const uint cc = col + e % 16u;
                    if (rr < m && cc < n) {
                        const uint o = plane + rr * n + cc;
                        const float s = scratch[ws + e];
                        if ((flags & FLAG_F16) != 0u) {
                            gy16[o] = float16_t(s);
                        } else if ((flags & FLAG_RESIDUAL) != 0u) {
                            gy32[o] += s;
                        } else {
                            gy32[o] = s;
                        }
                    }
                }
                subgroup_handoff();
            }
        }
    }
}
