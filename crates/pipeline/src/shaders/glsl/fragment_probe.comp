#version 460
// Where a 16x16 f32 accumulator's elements live: one subgroup sets element i of invocation
// `lane` to lane * 64 + i and stores the matrix row-major at binding 0 (256 values), then its
// element count at 256. `vision_gpu::fragment_attention_support` reads this to check what
// attention_fragments.comp assumes.
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_shader_subgroup_basic : require

layout(local_size_x = 32, local_size_y = 1, local_size_z = 1) in;

layout(set = 0, binding = 0, std430) writeonly buffer Out { float v[]; };

void main() {
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> m =
        coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
    for (int i = 0; i < m.length(); i++) {
        m[i] = float(gl_SubgroupInvocationID * 64u + uint(i));
    }
    coopMatStore(m, v, 0, 16, gl_CooperativeMatrixLayoutRowMajor);
    if (gl_SubgroupInvocationID == 0u) {
        v[256] = float(m.length());
    }
}
