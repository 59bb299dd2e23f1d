#version 460
// Y[M, N] = X[M, K] * W[N, K]^T: f16 activations and weights (weights as PyTorch's Linear
// keeps them, a row per output), f32 sums and output, on NVIDIA's cooperative matrices 2
// (GL_NV_cooperative_matrix2): workgroup-scope matrices loaded through tensor layouts, so the
// driver stages the tiles (and pipelines their loads) itself. A probe of issue 21: does this
// path beat the WGSL tensor-core GEMM on the encoder's shapes? (`examples/cm2_probe.rs`.)
//
// Contract (checked by the host before it dispatches): M % BM == 0, N % BN == 0, K % BK == 0,
// the buffers hold M*K, N*K and M*N values; workgroups (N / BN, M / BM, 1). BM, BN, BK and the
// workgroup size WG are compile-time (`build.sh` makes one module per blocking).
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_NV_cooperative_matrix2 : require

layout(local_size_x = WG, local_size_y = 1, local_size_z = 1) in;

layout(set = 0, binding = 0, std430) readonly buffer Activations { float16_t x[]; };
layout(set = 0, binding = 1, std430) readonly buffer Weights { float16_t w[]; };
layout(set = 0, binding = 2, std430) writeonly buffer Output { float y[]; };
layout(set = 0, binding = 3, std140) uniform Shape { uint M; uint N; uint K; uint unused; } s;

void main() {
    const uint m0 = gl_WorkGroupID.y * BM;
    const uint n0 = gl_WorkGroupID.x * BN;
    tensorLayoutNV<2> lx = createTensorLayoutNV(2);
    lx = setTensorLayoutDimensionNV(lx, s.M, s.K);
    tensorLayoutNV<2> lw = createTensorLayoutNV(2);
    lw = setTensorLayoutDimensionNV(lw, s.N, s.K);
    tensorLayoutNV<2> ly = createTensorLayoutNV(2);
    ly = setTensorLayoutDimensionNV(ly, s.M, s.N);
    // B[k][n] = W[n][k]: the weight slice read transposed.
    tensorViewNV<2, false, 1, 0> transposed = createTensorViewNV(2, false, 1, 0);

    coopmat<float, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator> acc =
        coopmat<float, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator>(0.0);
    for (uint k = 0; k < s.K; k += BK) {
        coopmat<float16_t, gl_ScopeWorkgroup, BM, BK, gl_MatrixUseA> a;
        coopmat<float16_t, gl_ScopeWorkgroup, BK, BN, gl_MatrixUseB> b;
        coopMatLoadTensorNV(a, x, 0, sliceTensorLayoutNV(lx, m0, BM, k, BK));
        coopMatLoadTensorNV(b, w, 0, sliceTensorLayoutNV(lw, n0, BN, k, BK), transposed);
        acc = coopMatMulAdd(a, b, acc);
    }
    coopMatStoreTensorNV(acc, y, 0, sliceTensorLayoutNV(ly, m0, BM, n0, BN));
}
