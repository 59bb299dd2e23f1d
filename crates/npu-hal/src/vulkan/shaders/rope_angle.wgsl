// The rotary angle of pair i at position `pos`, as (cos, sin): shared by the Rope kernel, the KV
// write and the attention (the including module binds `inv_freq`).
// - Interleaved pairs scale the position by theta_scale^i, llama.cpp's recurrence within an ulp
//   or two. The power is taken by squaring in a fixed eight steps (i < 256), so no loop runs a
//   lane-dependent number of times: llvmpipe (Mesa 22.3) miscomputes such a loop when every lane
//   of a SIMD batch takes it.
// - Half-split pairs take pos * inv_freq[i], Hugging Face's.
// The angle is reduced to [-pi, pi] in two steps (2 pi = C1 + C2, C1 exact in few bits, so k * C1
// is exact for the k that occur), so long positions keep their accuracy.
fn rope_angle_cs(pos: f32, i: u32, interleaved: bool, theta_scale: f32) -> vec2<f32> {
    var angle: f32;
    if (interleaved) {
        var scale_i = 1.0;
        var square = theta_scale;
        for (var bit = 0u; bit < 8u; bit++) {
            scale_i = select(scale_i, scale_i * square, ((i >> bit) & 1u) != 0u);
            square = square * square;
        }
        angle = pos * scale_i;
    } else {
        angle = pos * inv_freq[i];
    }
    let k = round(angle * 0.15915494309189535);
    let r = (angle - k * 6.28125) - k * 0.0019353071795864769;
    return vec2<f32>(cos(r), sin(r));
}
