#version 460
// The same product as gemm_cm2.comp, one output per invocation, with the same bindings: the
// probe's reference path on any Vulkan device (lavapipe in CI), which proves the host side
// (device, passthrough module, layout, dispatch, read-back) on drivers without the extension.
//
// Contract: workgroups (ceil(N / 16), ceil(M / 16), 1); the buffers hold M*K, N*K, M*N values.
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require

layout(local_size_x = 16, local_size_y = 16, local_size_z = 1) in;

layout(set = 0, binding = 0, std430) readonly buffer Activations { float16_t x[]; };
layout(set = 0, binding = 1, std430) readonly buffer Weights { float16_t w[]; };
layout(set = 0, binding = 2, std430) writeonly buffer Output { float y[]; };
layout(set = 0, binding = 3, std140) uniform Shape { uint M; uint N; uint K; uint unused; } s;

void main() {
    const uint n = gl_GlobalInvocationID.x;
    const uint m = gl_GlobalInvocationID.y;
    if (m >= s.M || n >= s.N) {
        return;
    }
    float sum = 0.0;
    for (uint k = 0; k < s.K; k++) {
        sum += float(x[m * s.K + k]) * float(w[n * s.K + k]);
    }
    y[m * s.N + n] = sum;
}
