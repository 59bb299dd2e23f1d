//! The CPU NPU's element-wise kernels and the dense f32 GEMM, each with a scalar definition the
//! tests hold the fast paths to.
//!
//! The element-wise ops work on one token's vector (a few hundred to a few thousand floats) and
//! are written as plain loops with independent accumulators, which the compiler vectorises. The
//! dense GEMM (the `exact` weight policy's linear layers) has an AVX2+FMA build picked at run time.

/// Root-mean-square normalisation: `out[i] = x[i] / sqrt(mean(x^2) + eps) * w[i]`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    debug_assert!(x.len() == w.len() && x.len() == out.len());
    // The sum of squares in f64, as ggml does (`sum += (ggml_float)(x * x)`: each square
    // rounded to f32 first): one token's vector is a few hundred values, so the cost is nothing.
    let mut acc = [0f64; 4];
    let chunks = x.chunks_exact(4);
    let tail: f64 = chunks.remainder().iter().map(|&v| f64::from(v * v)).sum();
    for c in chunks {
        for i in 0..4 {
            acc[i] += f64::from(c[i] * c[i]);
        }
    }
    let mean = ((acc.iter().sum::<f64>() + tail) / x.len() as f64) as f32;
    let inv = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * inv * g;
    }
}

/// How the rotary embedding pairs a head's dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i + 1)`: llama.cpp's `LLAMA_ROPE_TYPE_NORM`, which GGUF LLaMA files
    /// use (the converter permutes Q and K rows to match).
    Interleaved,
    /// Pairs `(i, i + d/2)`: Hugging Face's `rotate_half`, as safetensors checkpoints expect.
    HalfSplit,
}

/// The frequencies of one RoPE configuration, in the form each style's reference computes them.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeFreqs {
    /// `theta^(-2i/d)` for `i < d/2` (computed in f64, stored as f32): Hugging Face's
    /// `inv_freq`, angle `pos * inv_freq[i]` in f32.
    pub inv_freq: Vec<f32>,
    /// `powf(theta, -2/d)` in f32: ggml's `theta_scale`, angle `i` reached by multiplying
    /// `pos` by it `i` times in f32 (`ggml_rope_cache_init`).
    pub theta_scale: f32,
}

/// The frequencies for `head_dim` and base `theta`.
pub fn rope_freqs(head_dim: usize, theta: f32) -> RopeFreqs {
    RopeFreqs {
        inv_freq: (0..head_dim / 2)
            .map(|i| (f64::from(theta).powf(-((2 * i) as f64) / head_dim as f64)) as f32)
            .collect(),
        theta_scale: theta.powf(-2.0 / head_dim as f32),
    }
}

/// Rotates every head of one token's `x` (`heads * head_dim` values) to position `pos`. The
/// angles are computed as the style's reference runtime computes them (ggml for
/// [`RopeStyle::Interleaved`], transformers for [`RopeStyle::HalfSplit`]), so each agrees with
/// the numbers its model files were checked against.
///
/// With [`Numerics::Ggml`] each rotated value fuses its first product into the sum, as ggml's
/// `rotate_pairs` does once GCC contracts it (its default `-ffp-contract=fast`):
/// `fma(x0, cos, -(x1 * sin))` and `fma(x0, sin, x1 * cos)`; llama.cpp's logits are
/// bit-identical only so (pipeline's `smollm2` tests, both builds).
pub fn rope(
    x: &mut [f32],
    head_dim: usize,
    pos: usize,
    freqs: &RopeFreqs,
    style: RopeStyle,
    numerics: Numerics,
) {
    let half = head_dim / 2;
    debug_assert_eq!(freqs.inv_freq.len(), half);
    // The angles are the same for every head: compute them once.
    let mut cs = [(0f32, 0f32); MAX_ROPE_HEAD_DIM / 2];
    let cs = &mut cs[..half.min(MAX_ROPE_HEAD_DIM / 2)];
    match style {
        RopeStyle::Interleaved => {
            let mut theta = pos as f32;
            for c in cs.iter_mut() {
                *c = (theta.cos(), theta.sin());
                theta *= freqs.theta_scale;
            }
        }
        RopeStyle::HalfSplit => {
            for (c, &f) in cs.iter_mut().zip(&freqs.inv_freq) {
                let angle = pos as f32 * f;
                *c = (angle.cos(), angle.sin());
            }
        }
    }
    for head in x.chunks_exact_mut(head_dim) {
        for (i, &(cos, sin)) in cs.iter().enumerate() {
            let (a, b) = match style {
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                RopeStyle::HalfSplit => (i, i + half),
            };
            let (x0, x1) = (head[a], head[b]);
            (head[a], head[b]) = match numerics {
                Numerics::Standard => (x0 * cos - x1 * sin, x0 * sin + x1 * cos),
                Numerics::Ggml(_) => (x0.mul_add(cos, -(x1 * sin)), x0.mul_add(sin, x1 * cos)),
            };
        }
    }
}

/// The largest head dimension [`rope`] supports.
pub const MAX_ROPE_HEAD_DIM: usize = 512;

/// Which arithmetic the ops whose rounding is a choice use.
///
/// - `Standard`: IEEE f32 with the platform's `expf`; f32 attention.
/// - `Ggml(build)`: what one x86 build of ggml's CPU backend computes, step for step: its
///   vectorised `expf` approximation inside SiLU, and its f16 flash attention (query rounded to
///   f16, dot products summed in its register order, V accumulated in f16), with the
///   multiply-adds GCC fuses in ggml's C (RoPE's rotation, the softmax's running sum), on any
///   x86 CPU with FMA: the orders are computed, not taken from the host's vector unit. With the
///   block weights of [`crate::ggml`], a GGUF model's logits on a prompt under 64 tokens and a
///   context under 512 are bit-identical to those of llama.cpp built as `build` (pipeline's
///   `smollm2` tests check both builds; ggml switches attention kernels past those sizes). That is what makes them comparable token for token. It is not more
///   accurate; it is comparable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Numerics {
    #[default]
    Standard,
    Ggml(GgmlBuild),
}

/// The x86 build of ggml whose arithmetic [`Numerics::Ggml`] reproduces. Its f32 vector width
/// sets two orders of operations: the running sums of its f16 dot products (32 with AVX2, 64 with
/// AVX-512) and which `expf` its SiLU uses. Its integer block dot products give the same bits in
/// both builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlBuild {
    /// Built for a CPU with AVX2, FMA and F16C but not AVX-512: 8-lane f32 vectors.
    Avx2,
    /// Built for a CPU with AVX-512 F and DQ: 16-lane f32 vectors.
    Avx512,
}

impl GgmlBuild {
    /// The build `GGML_NATIVE` (llama.cpp's default, and llama-cpp-python's) makes on this CPU:
    /// [`GgmlBuild::Avx512`] where it has AVX-512 F and DQ, else [`GgmlBuild::Avx2`] (also off
    /// x86, where no build is reproduced).
    pub fn native() -> GgmlBuild {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512dq")
        {
            return GgmlBuild::Avx512;
        }
        GgmlBuild::Avx2
    }

    /// Parses `avx2` or `avx512`, the names [`GgmlBuild::name`] gives.
    pub fn parse(name: &str) -> Option<GgmlBuild> {
        match name {
            "avx2" => Some(GgmlBuild::Avx2),
            "avx512" => Some(GgmlBuild::Avx512),
            _ => None,
        }
    }

    /// `avx2` or `avx512`.
    pub fn name(self) -> &'static str {
        match self {
            GgmlBuild::Avx2 => "avx2",
            GgmlBuild::Avx512 => "avx512",
        }
    }
}

/// `out = silu(gate) * up`, with `silu(g) = g / (1 + e^-g)`.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32], numerics: Numerics) {
    match numerics {
        Numerics::Standard => {
            for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                *o = g / (1.0 + (-g).exp()) * u;
            }
        }
        Numerics::Ggml(build) => {
            let wide = build == GgmlBuild::Avx512;
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU has FMA (checked just above), the only requirement of the build.
                unsafe { swiglu_ggml_fma(gate, up, out, wide) };
                return;
            }
            swiglu_ggml(gate, up, out, wide);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
fn swiglu_ggml_fma(gate: &[f32], up: &[f32], out: &mut [f32], wide: bool) {
    swiglu_ggml(gate, up, out, wide);
}

/// ggml's `ggml_vec_swiglu_f32`: whole vectors (16 lanes with AVX-512, 8 with AVX2) through its
/// `ggml_v_silu`, the tail through the scalar `ggml_silu_f32` (libm `expf`).
#[inline(always)]
fn swiglu_ggml(gate: &[f32], up: &[f32], out: &mut [f32], wide: bool) {
    let lanes = if wide { 16 } else { 8 };
    let whole = gate.len() / lanes * lanes;
    for i in 0..gate.len() {
        let g = gate[i];
        let silu = if i < whole {
            g / (1.0 + ggml_v_expf(0.0 - g, wide))
        } else {
            g / (1.0 + (-g).exp())
        };
        out[i] = silu * up[i];
    }
}

/// One lane of ggml's vectorised `expf` (`ggml_v_expf`, after Arm's optimized routines): the
/// AVX-512 build scales with `scalef`, the AVX2 build by building `2^n` in the exponent bits.
#[inline(always)]
fn ggml_v_expf(x: f32, wide: bool) -> f32 {
    let r = f32::from_bits(0x4b40_0000); // 0x1.8p23
    let z = x.mul_add(f32::from_bits(0x3fb8_aa3b), r); // 0x1.715476p+0
    let n = z - r;
    let b = (-n).mul_add(
        f32::from_bits(0x35bf_be8e),                  // 0x1.7f7d1cp-20
        (-n).mul_add(f32::from_bits(0x3f31_7200), x), // 0x1.62e4p-1
    );
    let u = b * b;
    let c4 = f32::from_bits(0x3c07_2010); // 0x1.0e4020p-7
    let c3 = f32::from_bits(0x3d2b_9f17); // 0x1.573e2ep-5
    let c2 = f32::from_bits(0x3e2a_af33); // 0x1.555e66p-3
    let c1 = f32::from_bits(0x3eff_fedb); // 0x1.fffdb6p-2
    let c0 = f32::from_bits(0x3f7f_fff6); // 0x1.ffffecp-1
    let poly_hi = c4.mul_add(b, c3).mul_add(u, c2.mul_add(b, c1));
    if wide {
        let j = poly_hi.mul_add(u, c0.mul_add(b, 1.0));
        if n.abs() > 192.0 {
            return if n <= 0.0 { 0.0 } else { f32::INFINITY };
        }
        // scalef(j, n) = j * 2^floor(n); n is integral here.
        j * 2f32.powi(n as i32)
    } else {
        let j = poly_hi.mul_add(u, c0 * b);
        if n.abs() > 126.0 {
            // ggml's AVX2 build takes a slower exact-scaling path out here (|x| > 87); SiLU only
            // sees 1 + e^-g there, which is 1 or infinity either way.
            return if n <= 0.0 { 0.0 } else { f32::INFINITY };
        }
        let k = f32::from_bits((z.to_bits() << 23).wrapping_add(1f32.to_bits()));
        j.mul_add(k, k)
    }
}

/// `acc += x`.
pub fn add_in_place(acc: &mut [f32], x: &[f32]) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += v;
    }
}

/// Index and value of the largest element (the first on ties); `None` for an empty slice or
/// when every element is NaN.
pub fn argmax(x: &[f32]) -> Option<(usize, f32)> {
    // Greedy decoding runs this over the vocabulary once per token, on the token's critical
    // path: the AVX2 build compares and selects 8 lanes per instruction where the baseline
    // x86-64 build (SSE2, no blend) takes 4 and three instructions per select.
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above), the only requirement of the
        // target-feature build; the function itself is safe code.
        return unsafe { argmax_avx2(x) };
    }
    argmax_portable(x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn argmax_avx2(x: &[f32]) -> Option<(usize, f32)> {
    argmax_portable(x)
}

/// The argmax body, inlined into each target-feature build.
#[inline(always)]
fn argmax_portable(x: &[f32]) -> Option<(usize, f32)> {
    // 16 independent lanes, each keeping its largest value and the chunk it came from; the
    // updates are selects with no branch, so the loop vectorises (`f32::max`'s NaN rules do
    // not, and a second pass to find the index cost as much again). A strict `>` keeps the
    // first of equal values and never takes a NaN.
    const LANES: usize = 16;
    let mut best = [f32::NEG_INFINITY; LANES];
    let mut chunk_of = [u32::MAX; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for (c, values) in chunks.enumerate() {
        for j in 0..LANES {
            let v = values[j];
            let greater = v > best[j];
            best[j] = if greater { v } else { best[j] };
            chunk_of[j] = if greater { c as u32 } else { chunk_of[j] };
        }
    }
    let mut found: Option<(usize, f32)> = None;
    for j in (0..LANES).filter(|&j| chunk_of[j] != u32::MAX) {
        let i = chunk_of[j] as usize * LANES + j;
        match found {
            Some((at, v)) if v > best[j] || (v == best[j] && at < i) => {}
            _ => found = Some((i, best[j])),
        }
    }
    let start = x.len() - tail.len();
    for (k, &v) in tail.iter().enumerate() {
        if found.is_none_or(|(_, b)| v > b) && v > f32::NEG_INFINITY {
            found = Some((start + k, v));
        }
    }
    // Nothing above minus infinity: the first minus infinity, if any (NaN never counts).
    found.or_else(|| {
        x.iter()
            .position(|&v| v == f32::NEG_INFINITY)
            .map(|i| (i, f32::NEG_INFINITY))
    })
}

/// `log(sum(exp(x)))`, max-subtracted, accumulated in f64 (perplexity sums thousands of these).
pub fn log_sum_exp(x: &[f32]) -> f64 {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if !max.is_finite() {
        return f64::from(max);
    }
    let sum: f64 = x.iter().map(|&v| f64::from(v - max).exp()).sum();
    f64::from(max) + sum.ln()
}

/// How activations are rounded before a dense GEMM, so a model runs with the activation precision
/// its source format implies in llama.cpp (whose results the `exact` policy is compared with):
/// ggml multiplies block-quantized weights with activations quantized to 8 bits per 32-block
/// (Q8_0/Q8_1), f16 weights with f16 activations, f32 weights with f32 ones.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ActivationRounding {
    /// f32 activations as they are.
    #[default]
    None,
    /// Rounded to f16.
    F16,
    /// Rounded to bf16.
    Bf16,
    /// ggml's x86 `quantize_row_q8_0`/`q8_1`: per 32-block `d = amax / 127`,
    /// `q = round_ties_even(x * 127 / amax)`, value `f16(d) * q`.
    Q8Block,
}

impl ActivationRounding {
    /// Rounds `x` into `out` (same length; a trailing partial block is quantized as a block).
    pub fn apply(self, x: &[f32], out: &mut [f32]) {
        match self {
            ActivationRounding::None => out.copy_from_slice(x),
            ActivationRounding::F16 => {
                for (o, &v) in out.iter_mut().zip(x) {
                    *o = half::f16::from_f32(v).to_f32();
                }
            }
            ActivationRounding::Bf16 => {
                for (o, &v) in out.iter_mut().zip(x) {
                    *o = half::bf16::from_f32(v).to_f32();
                }
            }
            ActivationRounding::Q8Block => {
                for (ob, xb) in out.chunks_mut(32).zip(x.chunks(32)) {
                    let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let d = half::f16::from_f32(amax / 127.0).to_f32();
                    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                    for (o, &v) in ob.iter_mut().zip(xb) {
                        *o = d * (v * id).round_ties_even();
                    }
                }
            }
        }
    }
}

/// A dense row-major f32 matrix (`rows x cols`): the `exact` weight policy's storage, holding a
/// model's source values without requantization, with the activation rounding that goes with
/// them.
#[derive(Clone, Debug)]
pub struct DenseMatrix {
    rows: usize,
    cols: usize,
    data: Vec<f32>,
    rounding: ActivationRounding,
}

impl DenseMatrix {
    /// Wraps `data` (`rows * cols` values); `None` when the length does not match.
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Option<DenseMatrix> {
        (rows.checked_mul(cols) == Some(data.len())).then_some(DenseMatrix {
            rows,
            cols,
            data,
            rounding: ActivationRounding::None,
        })
    }

    /// The same matrix, with activations rounded as `rounding` says before each product.
    pub fn with_activation_rounding(mut self, rounding: ActivationRounding) -> DenseMatrix {
        self.rounding = rounding;
        self
    }

    /// How activations are rounded before each product.
    pub fn activation_rounding(&self) -> ActivationRounding {
        self.rounding
    }

    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// The values, row-major.
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// Row `r`.
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// Bytes a GEMV streams.
    pub fn bytes(&self) -> usize {
        self.data.len() * 4
    }

    /// `ys[t][r - rows.start] = W[r] . x_t` for `r` in `rows`, over the `xs.len() / cols` tokens
    /// `x_t` of `xs`; each `ys[t]` holds `rows.len()` values (the same calling convention as
    /// mx-quant's `MxMatrix::gemm_q8`, so a pool splits either kind of weight the same way).
    pub fn gemm_rows(&self, xs: &[f32], rows: std::ops::Range<usize>, ys: &mut [&mut [f32]]) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above), the only requirement
            // of the target-feature build; the function itself is safe code.
            unsafe { gemm_rows_avx2(self, xs, rows, ys) };
            return;
        }
        gemm_rows_portable(self, xs, rows, ys);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn gemm_rows_avx2(
    m: &DenseMatrix,
    xs: &[f32],
    rows: std::ops::Range<usize>,
    ys: &mut [&mut [f32]],
) {
    gemm_rows_portable(m, xs, rows, ys);
}

/// The dense GEMM body, inlined into each target-feature build. Four tokens share each weight
/// row while it is in L1.
#[inline(always)]
fn gemm_rows_portable(
    m: &DenseMatrix,
    xs: &[f32],
    rows: std::ops::Range<usize>,
    ys: &mut [&mut [f32]],
) {
    let cols = m.cols;
    let tokens = (xs.len() / cols).min(ys.len());
    for t0 in (0..tokens).step_by(4) {
        let tn = (tokens - t0).min(4);
        for r in rows.clone() {
            let w = m.row(r);
            for t in t0..t0 + tn {
                ys[t][r - rows.start] = dot(w, &xs[t * cols..(t + 1) * cols]);
            }
        }
    }
}

/// Dot product with sixteen independent sums (vectorises to two 8-lane chains with AVX2). Plain
/// `a * b + c`, not `mul_add`: where FMA is not in the target (the baseline x86-64 build, which
/// the attention kernels use), `mul_add` is a libm call per element.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_the_definition() {
        let x: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.3).collect();
        let w: Vec<f32> = (0..37).map(|i| 1.0 + i as f32 * 0.01).collect();
        let mut out = vec![0.0; 37];
        rms_norm(&x, &w, 1e-5, &mut out);
        let ms: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / 37.0;
        for i in 0..37 {
            let want = f64::from(x[i]) / (ms + 1e-5).sqrt() * f64::from(w[i]);
            assert!((f64::from(out[i]) - want).abs() < 1e-5, "{i}");
        }
    }

    #[test]
    fn rope_styles_rotate_the_documented_pairs() {
        let inv = rope_freqs(8, 10000.0);
        let base: Vec<f32> = (0..16).map(|i| i as f32 + 1.0).collect();
        for (style, numerics) in [
            (RopeStyle::Interleaved, Numerics::Standard),
            (RopeStyle::HalfSplit, Numerics::Standard),
            (RopeStyle::Interleaved, Numerics::Ggml(GgmlBuild::Avx2)),
        ] {
            let mut x = base.clone();
            rope(&mut x, 8, 3, &inv, style, numerics);
            for h in 0..2 {
                for i in 0..4 {
                    let (a, b) = match style {
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                        RopeStyle::HalfSplit => (i, i + 4),
                    };
                    let ang = 3.0 * 10000f64.powf(-(2.0 * i as f64) / 8.0);
                    let (x0, x1) = (f64::from(base[h * 8 + a]), f64::from(base[h * 8 + b]));
                    let want0 = x0 * ang.cos() - x1 * ang.sin();
                    let want1 = x0 * ang.sin() + x1 * ang.cos();
                    assert!((f64::from(x[h * 8 + a]) - want0).abs() < 1e-4);
                    assert!((f64::from(x[h * 8 + b]) - want1).abs() < 1e-4);
                }
            }
            // Position 0 is the identity.
            let mut y = base.clone();
            rope(&mut y, 8, 0, &inv, style, numerics);
            assert_eq!(y, base);
        }
    }

    #[test]
    fn dense_gemm_matches_naive() {
        let (rows, cols, tokens) = (37, 70, 6);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 101) as f32 / 50.0 - 1.0)
            .collect();
        let x: Vec<f32> = (0..tokens * cols)
            .map(|i| ((i * 104729) % 97) as f32 / 40.0 - 1.2)
            .collect();
        let m = DenseMatrix::new(rows, cols, w.clone()).unwrap();
        let span = 5..30;
        let mut out = vec![0f32; tokens * span.len()];
        let mut ys: Vec<&mut [f32]> = out.chunks_mut(span.len()).collect();
        m.gemm_rows(&x, span.clone(), &mut ys);
        for t in 0..tokens {
            for r in span.clone() {
                let want: f64 = (0..cols)
                    .map(|k| f64::from(w[r * cols + k]) * f64::from(x[t * cols + k]))
                    .sum();
                let got = out[t * span.len() + r - span.start];
                assert!((f64::from(got) - want).abs() < 1e-4, "{t} {r}");
            }
        }
    }

    #[test]
    fn argmax_and_lse() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, f32::NAN]), Some((1, 3.0)));
        assert_eq!(argmax(&[]), None);
        assert_eq!(argmax(&[f32::NAN; 40]), None);
        assert_eq!(
            argmax(&[f32::NEG_INFINITY; 3]),
            Some((0, f32::NEG_INFINITY))
        );
        // Past the 16-lane body, with the maximum in the tail and in the body, ties first.
        let mut x: Vec<f32> = (0..37).map(|i| (i % 7) as f32).collect();
        assert_eq!(argmax(&x), Some((6, 6.0)));
        x[36] = 9.0;
        x[20] = f32::NAN;
        assert_eq!(argmax(&x), Some((36, 9.0)));
        // Against the plain definition (the first index of the largest non-NaN value), on
        // lengths around the lane width, with ties, NaNs and infinities.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for len in 0..100 {
            let v: Vec<f32> = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    match state % 11 {
                        0 => f32::NAN,
                        1 => f32::NEG_INFINITY,
                        n => (n % 4) as f32,
                    }
                })
                .collect();
            let plain = v.iter().enumerate().filter(|(_, x)| !x.is_nan()).fold(
                None,
                |best: Option<(usize, f32)>, (i, &x)| match best {
                    Some((_, b)) if b >= x => best,
                    _ => Some((i, x)),
                },
            );
            assert_eq!(argmax(&v), plain, "{v:?}");
            assert_eq!(argmax_portable(&v), plain, "{v:?}");
        }
        let lse = log_sum_exp(&[0.0, 0.0]);
        assert!((lse - 2f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn swiglu_is_silu_times_up() {
        let mut out = [0f32; 3];
        swiglu(
            &[0.0, 1.0, -2.0],
            &[2.0, 3.0, 4.0],
            &mut out,
            Numerics::Standard,
        );
        assert_eq!(out[0], 0.0);
        assert!((out[1] - 3.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
        assert!((out[2] - 4.0 * -2.0 / (1.0 + 2f32.exp())).abs() < 1e-6);
    }
}
