#version 460
// The encoder's GEMM on VK_NV_cooperative_matrix2 (`vision_gpu::CoopGemmSource::Coopmat2`), with
// the contract, bindings and grid of `gemm_coop` (vit_coop.wgsl) for f16 weights:
//   y[m][n] (op)= x[m][k] . w[n][k] (+ b[n]), x and w f16, sums in f32.
// Each workgroup holds its whole BM x BN block of y as one workgroup-scope matrix and walks k in
// steps of BK, loading BM x BK of x and BK x BN of w^T (w's rows read as columns) through
// tensor layouts: the driver decides how the tiles are staged, double-buffered and fed to the
// tensor cores. Loads past m, n or the workgroup's slice of k read zeros (clamp mode
// "constant"), stores past m or n are dropped. The epilogue: bias and GELU per element, the
// residual loaded as a matrix and added, f16 conversion, one store.
//
// Split k: workgroup z takes k's columns [z k_chunk, (z + 1) k_chunk) and writes plane z of y
// (m*n values from z*m*n on).
//
// Contract (the host checks it, `vision_gpu`): n and k multiples of 8; k_chunk a multiple of BK
// and z k_chunk < k for every z of the dispatch; x holds m*k, w n*k, b n (when flagged) and y
// m*n values per plane (f32, or f16 with flag 8); a device opened with the extension's
// workgroup-scope, flexible-dimension, per-element and tensor-addressing features, offering f16
// workgroup matrices for THREADS invocations with granularities dividing BM, BN and BK.
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_NV_cooperative_matrix2 : require
#extension GL_EXT_control_flow_attributes : require

#ifndef BM
#define BM 128
#endif
#ifndef BN
#define BN 128
#endif
#ifndef BK
#define BK 32
#endif
#ifndef THREADS
#define THREADS 256
#endif

layout(local_size_x = THREADS, local_size_y = 1, local_size_z = 1) in;

layout(set = 0, binding = 0, std430) readonly buffer X { float16_t gx[]; };
layout(set = 0, binding = 1, std430) readonly buffer W { float16_t gw[]; };
layout(set = 0, binding = 2, std430) readonly buffer Bias { float gb[]; };
layout(set = 0, binding = 3, std430) buffer Y32 { float gy32[]; };
layout(set = 0, binding = 3, std430) buffer Y16 { float16_t gy16[]; };
layout(set = 0, binding = 4, std140) uniform Params {
    uint m; uint n; uint k; uint flags; uint k_chunk; uint p0; uint p1; uint p2;
} gp;

#define ACC coopmat<float, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator>
#define ACC16 coopmat<float16_t, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator>

float gelu_tanh(float v) {
    const float c = 0.7978845608028654;
    return 0.5 * v * (1.0 + tanh(c * (v + 0.044715 * v * v * v)));
}

// The first column of this workgroup's block (the per-element function's coordinates are
// within the block).
uint col_base;

float bias_gelu(const in uint r, const in uint c, const in float v, const in uint flags) {
    float o = v;
    if ((flags & 1u) != 0u) { o += gb[min(col_base + c, gp.n - 1u)]; }
    if ((flags & 2u) != 0u) { o = gelu_tanh(o); }
    return o;
}

void main() {
    const uint m = gp.m;
    const uint n = gp.n;
    const uint k = gp.k;
    const uint flags = gp.flags;
    const uint row0 = gl_WorkGroupID.y * BM;
    const uint col0 = gl_WorkGroupID.x * BN;
    col_base = col0;
    const uint k_begin = gl_WorkGroupID.z * gp.k_chunk;
    const uint k_end = min(k, k_begin + gp.k_chunk);
    const uint plane = gl_WorkGroupID.z * m * n;

    tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> la = createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
    tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> lb = createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
    tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> ly = createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
    la = setTensorLayoutDimensionNV(la, m, k_end);
    la = setTensorLayoutStrideNV(la, k, 1);
    lb = setTensorLayoutDimensionNV(lb, n, k_end);
    lb = setTensorLayoutStrideNV(lb, k, 1);
    ly = setTensorLayoutDimensionNV(ly, m, n);
    ly = setTensorLayoutStrideNV(ly, n, 1);
    tensorViewNV<2, false, 1, 0> transpose = createTensorViewNV(2, false, 1, 0);

    ACC acc = ACC(0.0);
    for (uint kb = k_begin; kb < k_end; kb += BK) {
        coopmat<float16_t, gl_ScopeWorkgroup, BM, BK, gl_MatrixUseA> a;
        coopmat<float16_t, gl_ScopeWorkgroup, BK, BN, gl_MatrixUseB> b;
        coopMatLoadTensorNV(a, gx, 0, sliceTensorLayoutNV(la, row0, BM, kb, BK));
        coopMatLoadTensorNV(b, gw, 0, sliceTensorLayoutNV(lb, col0, BN, kb, BK), transpose);
        acc = coopMatMulAdd(a, b, acc);
    }
    if ((flags & 3u) != 0u) {
        coopMatPerElementNV(acc, acc, bias_gelu, flags);
    }
    if ((flags & 8u) != 0u) {
        ACC16 h = ACC16(acc);
        coopMatStoreTensorNV(h, gy16, 0, sliceTensorLayoutNV(ly, row0, BM, col0, BN));
    } else {
        if ((flags & 4u) != 0u) {
            ACC y;
            coopMatLoadTensorNV(y, gy32, plane, sliceTensorLayoutNV(ly, row0, BM, col0, BN));
            acc = acc + y;
        }
        coopMatStoreTensorNV(acc, gy32, plane, sliceTensorLayoutNV(ly, row0, BM, col0, BN));
    }
}
