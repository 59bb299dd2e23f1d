#version 460
// FlashAttention on tensor cores with the softmax in the accumulator fragments: the encoder's
// attention for heads of 64 dimensions (`vision_gpu::CoopAttention::Fragments`). The WGSL
// kernel (`attention_coop`, vit_coop.wgsl) cannot touch a cooperative matrix's elements, so
// its scores, probabilities and every key block's P V go through workgroup memory; here each
// invocation reads and rescales its own elements of S and of the output, which stay in
// registers for the whole pass over the keys. Only P goes through workgroup memory (an
// accumulator cannot be an A operand in GL_KHR_cooperative_matrix), 2 KB per subgroup and key
// block.
//
// The elements an invocation holds are found, not assumed: each subgroup loads a matrix whose
// every element is its row number, with the accumulators' type and use, so `rows[i]` is the
// row of element i of every accumulator here. What the kernel does assume, and what
// `vision_gpu::fragment_attention_support` checks on the device before it is used: an
// accumulator has 8 elements per invocation, an invocation's elements lie in 2 rows, and
// the 4 invocations of each aligned group (lane / 4) hold the same 2 rows, all 16 columns of
// them (so a row's max and sum are two shuffles away). NVIDIA's 16x16 f32 accumulator is
// laid out so.
//
// A workgroup takes 16 * QSUB queries of one head (16 per subgroup) and walks all keys in
// blocks of 64; every invocation stages its share of the next block's K and V (8-byte vector
// loads) into the other half of double-buffered workgroup memory while the subgroups compute,
// so each block costs one workgroup barrier. Per subgroup and block: S = Q K^T (4 tiles,
// f16 in, f32 sums), the online softmax in f32 (base-2 exponents, log2(e) / sqrt(64) folded
// into the scale), P rounded to f16, O = O * alpha + P V (4 tiles).
//
// Contract (checked by the host before it dispatches, `vision_gpu`): q, k and v are the
// columns [0, h), [h, 2h), [2h, 3h) of one f16 buffer of n rows of 3h (the fused QKV
// projection), bound at binding 0 and again at 3; head_dim 64; h a multiple of 64; n a multiple
// of 64 and of 16 * QSUB; the output, binding 1, is n x h f16; workgroups
// (n / (16 * QSUB), heads, 1). The bindings are attention_coop's.
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_EXT_control_flow_attributes : require

#ifndef QSUB
#define QSUB 4
#endif
#define THREADS (QSUB * 32)
// A staged K or V row: 64 f16s as 16 vectors, plus 2 so the 8 rows a tile load touches fall on
// distinct banks.
#define LDK 18
#define BLOCK (64 * LDK)
// Per-subgroup P rows (f16), 64 + 8 apart for the same reason.
#define LDP 72
// Each invocation's share of a 64 x 16-vector block.
#define PER (64 * 16 / THREADS)

layout(local_size_x = THREADS, local_size_y = 1, local_size_z = 1) in;

layout(set = 0, binding = 0, std430) readonly buffer Qkv { float16_t qkv[]; };
layout(set = 0, binding = 1, std430) writeonly buffer Out { float16_t att_out[]; };
layout(set = 0, binding = 2, std140) uniform Params {
    uint n;
    uint heads;
    uint hd;
    uint h;
    float scale_log2;
    uint p0;
    uint p1;
    uint p2;
} ap;
layout(set = 0, binding = 3, std430) readonly buffer Qkv4 { f16vec4 qkv4[]; };

shared f16vec4 kv_k[2 * BLOCK];
shared f16vec4 kv_v[2 * BLOCK];
shared float16_t p_ws[QSUB * 16 * LDP];

#define ACC coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
#define ACC16 coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
#define MAT_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define MAT_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
// Elements of an accumulator per invocation (checked on the device, above).
#define E 8

void subgroup_handoff() {
    controlBarrier(gl_ScopeSubgroup, gl_ScopeSubgroup, gl_StorageSemanticsShared,
                   gl_SemanticsAcquireRelease);
}

void workgroup_handoff() {
    controlBarrier(gl_ScopeWorkgroup, gl_ScopeWorkgroup, gl_StorageSemanticsShared,
                   gl_SemanticsAcquireRelease);
}

void main() {
    const uint tid = gl_LocalInvocationIndex;
    const uint sg = gl_SubgroupID;
    const uint lane = gl_SubgroupInvocationID;
    const uint h = ap.h;
    const uint stride = 3u * h;
    const uint col = gl_WorkGroupID.y * 64u;
    const uint q0 = gl_WorkGroupID.x * (16u * QSUB) + sg * 16u;
    const uint ws = sg * 16u * LDP;

    // The row of each of this invocation's accumulator elements.
    for (uint e = lane; e < 256u; e += 32u) {
        p_ws[ws + (e / 16u) * LDP + e % 16u] = float16_t(e / 16u);
    }
    subgroup_handoff();
    ACC16 rows16;
    coopMatLoad(rows16, p_ws, ws, LDP, gl_CooperativeMatrixLayoutRowMajor);
    ACC rows = ACC(rows16);
    // Slot a: the lower of the invocation's rows; slot b: the other.
    float row_a = rows[0];
    [[unroll]] for (int i = 1; i < E; i++) {
        row_a = min(row_a, rows[i]);
    }
    bool in_b[E];
    [[unroll]] for (int i = 0; i < E; i++) {
        in_b[i] = rows[i] != row_a;
    }

    // This subgroup's 16 queries as 4 tiles of 16 dimensions.
    MAT_A qa[4];
    [[unroll]] for (uint d = 0; d < 4; d++) {
        coopMatLoad(qa[d], qkv, q0 * stride + col + 16u * d, stride,
                    gl_CooperativeMatrixLayoutRowMajor);
    }

    // Vector e = tid + i * THREADS of a block: key e / 16, vector e % 16 of the head's 64 dims.
    f16vec4 rk[PER];
    f16vec4 rv[PER];
    [[unroll]] for (uint i = 0; i < PER; i++) {
        const uint e = tid + i * THREADS;
        const uint at = ((e / 16u) * stride + col) / 4u + e % 16u;
        rk[i] = qkv4[at + h / 4u];
        rv[i] = qkv4[at + 2u * h / 4u];
    }
    [[unroll]] for (uint i = 0; i < PER; i++) {
        const uint e = tid + i * THREADS;
        kv_k[(e / 16u) * LDK + e % 16u] = rk[i];
        kv_v[(e / 16u) * LDK + e % 16u] = rv[i];
    }
    workgroup_handoff();

    const float scale = ap.scale_log2;
    float m_a = -3.0e38;
    float m_b = -3.0e38;
    float l_a = 0.0;
    float l_b = 0.0;
    ACC o[4];
    [[unroll]] for (uint t = 0; t < 4; t++) {
        o[t] = ACC(0.0);
    }
    uint buf = 0u;
    for (uint j0 = 0u; j0 < ap.n; j0 += 64u) {
        const bool more = j0 + 64u < ap.n;
        if (more) {
            [[unroll]] for (uint i = 0; i < PER; i++) {
                const uint e = tid + i * THREADS;
                const uint at = ((j0 + 64u + e / 16u) * stride + col) / 4u + e % 16u;
                rk[i] = qkv4[at + h / 4u];
                rv[i] = qkv4[at + 2u * h / 4u];
            }
        }
        const uint kv = buf * BLOCK;
        // S for keys j0 + 16t: B = K^T, column-major (a column is a row of K).
        ACC s[4];
        [[unroll]] for (uint t = 0; t < 4; t++) {
            s[t] = ACC(0.0);
            [[unroll]] for (uint d = 0; d < 4; d++) {
                MAT_B kb;
                coopMatLoad(kb, kv_k, kv + 16u * t * LDK + 4u * d, LDK,
                            gl_CooperativeMatrixLayoutColumnMajor);
                s[t] = coopMatMulAdd(qa[d], kb, s[t]);
            }
        }
        // Online softmax over the block, per row slot; a row's 4 invocations combine by
        // shuffles.
        float mx_a = -3.0e38;
        float mx_b = -3.0e38;
        [[unroll]] for (uint t = 0; t < 4; t++) {
            [[unroll]] for (int i = 0; i < E; i++) {
                const float v = s[t][i];
                mx_a = in_b[i] ? mx_a : max(mx_a, v);
                mx_b = in_b[i] ? max(mx_b, v) : mx_b;
            }
        }
        mx_a = max(mx_a, subgroupShuffleXor(mx_a, 1u));
        mx_a = max(mx_a, subgroupShuffleXor(mx_a, 2u));
        mx_b = max(mx_b, subgroupShuffleXor(mx_b, 1u));
        mx_b = max(mx_b, subgroupShuffleXor(mx_b, 2u));
        const float new_a = max(m_a, mx_a * scale);
        const float new_b = max(m_b, mx_b * scale);
        float sum_a = 0.0;
        float sum_b = 0.0;
        [[unroll]] for (uint t = 0; t < 4; t++) {
            [[unroll]] for (int i = 0; i < E; i++) {
                const float p = exp2(s[t][i] * scale - (in_b[i] ? new_b : new_a));
                s[t][i] = p;
                sum_a += in_b[i] ? 0.0 : p;
                sum_b += in_b[i] ? p : 0.0;
            }
        }
        sum_a += subgroupShuffleXor(sum_a, 1u);
        sum_a += subgroupShuffleXor(sum_a, 2u);
        sum_b += subgroupShuffleXor(sum_b, 1u);
        sum_b += subgroupShuffleXor(sum_b, 2u);
        const float alpha_a = exp2(m_a - new_a);
        const float alpha_b = exp2(m_b - new_b);
        l_a = l_a * alpha_a + sum_a;
        l_b = l_b * alpha_b + sum_b;
        m_a = new_a;
        m_b = new_b;
        [[unroll]] for (uint t = 0; t < 4; t++) {
            [[unroll]] for (int i = 0; i < E; i++) {
                o[t][i] *= in_b[i] ? alpha_b : alpha_a;
            }
            ACC16 p16 = ACC16(s[t]);
            coopMatStore(p16, p_ws, ws + 16u * t, LDP, gl_CooperativeMatrixLayoutRowMajor);
        }
        subgroup_handoff();
        MAT_A pa[4];
        [[unroll]] for (uint t = 0; t < 4; t++) {
            coopMatLoad(pa[t], p_ws, ws + 16u * t, LDP, gl_CooperativeMatrixLayoutRowMajor);
        }
        // O += P V, 16 dimensions at a time: B = V, row-major (a row is one key's values).
        [[unroll]] for (uint dt = 0; dt < 4; dt++) {
            [[unroll]] for (uint t = 0; t < 4; t++) {
                MAT_B vb;
                coopMatLoad(vb, kv_v, kv + 16u * t * LDK + 4u * dt, LDK,
                            gl_CooperativeMatrixLayoutRowMajor);
                o[dt] = coopMatMulAdd(pa[t], vb, o[dt]);
            }
        }
        if (more) {
            const uint next = (buf ^ 1u) * BLOCK;
            [[unroll]] for (uint i = 0; i < PER; i++) {
                const uint e = tid + i * THREADS;
                kv_k[next + (e / 16u) * LDK + e % 16u] = rk[i];
                kv_v[next + (e / 16u) * LDK + e % 16u] = rv[i];
            }
        }
        // The next block is staged, and every subgroup is done with this one (and with its P).
        workgroup_handoff();
        buf ^= 1u;
    }
    const float inv_a = 1.0 / l_a;
    const float inv_b = 1.0 / l_b;
    [[unroll]] for (uint t = 0; t < 4; t++) {
        [[unroll]] for (int i = 0; i < E; i++) {
            o[t][i] *= in_b[i] ? inv_b : inv_a;
        }
        ACC16 o16 = ACC16(o[t]);
        coopMatStore(o16, att_out, q0 * h + col + 16u * t, h, gl_CooperativeMatrixLayoutRowMajor);
    }
}
