//! Error-compensating MX quantization: GPTQ (Frantar et al., 2022) with MX's shared
//! power-of-two block scales.
//!
//! Round-to-nearest picks each weight's code alone. GPTQ rounds a row's columns one at a time
//! and pushes each rounding error onto the columns not yet rounded, weighted by the layer's
//! input statistics, so the layer's *output* error `||X W^T - X Q^T||^2` is what gets
//! minimized, not the weights' error. Inputs:
//! - the weights, `rows x cols` row-major f32 (`cols` a multiple of 32);
//! - the Hessian `X^T X` of the layer's inputs over calibration data (`cols x cols`, f64),
//!   which the caller accumulates ([`accumulate_hessian`] does it).
//!
//! MX specifics:
//! - Each 32-column block's E8M0 scale is chosen when the first of its columns comes up
//!   (natural order), from the block's values as the error feedback has left them, with
//!   [`GptqOptions::scale`] ([`ScaleRule::Floor`] is OCP's rule, [`ScaleRule::MseSearch`] the
//!   best of three exponents by squared error).
//! - With [`ColumnOrder::ActOrder`] columns are rounded in order of decreasing Hessian
//!   diagonal (the inputs with the most energy first), and the scales are fixed beforehand
//!   from the original weights, since the blocks are no longer visited whole.
//! - After GPTQ, [`GptqOptions::refine_passes`] passes of coordinate descent on the same loss
//!   (QuantEase's idea) move single codes, scales fixed, while that lowers the loss.
//!
//! Everything is deterministic: the same inputs give the same bytes, on any thread count.
//! Rows are independent once the Hessian is factored, so [`Prepared`] can be shared between
//! threads that each quantize a share of the rows.

use crate::Error;
use crate::format::{BLOCK, ElemFormat, QuantOptions, Rounding, SCALE_BIAS, ScaleRule};
use crate::layout::{check_block_multiple, check_len, pack_codes, packed_len};
use crate::reference::{self, decode_elem, encode_elem, pow2};

/// In which order a row's columns are rounded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ColumnOrder {
    /// Left to right; each block's scale is chosen from its values as the feedback left them.
    #[default]
    Natural,
    /// Decreasing Hessian diagonal ("act order"), with scales fixed from the original weights.
    ActOrder,
}

/// GPTQ's knobs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GptqOptions {
    /// How each block's shared exponent is chosen.
    pub scale: ScaleRule,
    /// How a scaled element is rounded to the element grid.
    pub rounding: Rounding,
    /// Added to the Hessian's diagonal, as a fraction of its mean (GPTQ's `percdamp`).
    pub damp: f64,
    pub order: ColumnOrder,
    /// In natural order, pick each block's exponent among the rule's choice and its two
    /// neighbours by GPTQ's own loss: the block rounded column by column with the error fed
    /// forward inside it, each column costing `(w - q)^2 / [H^-1]_cc`, the rise of the layer's
    /// output error once the columns after it compensate. The rule alone only sees the block's
    /// values, not what the compensation can absorb.
    pub scale_by_loss: bool,
    /// After GPTQ, up to this many passes of coordinate descent on the same (damped) loss,
    /// scales fixed: each column in turn takes the code that minimizes the loss with every
    /// other column as it stands (QuantEase, Behdin et al., 2023). GPTQ rounds each column
    /// once, against the columns before it only; a pass lets a column answer the columns
    /// rounded after it. The loss never rises. 0: GPTQ alone; the default is 8.
    pub refine_passes: u32,
}

impl Default for GptqOptions {
    fn default() -> Self {
        GptqOptions {
            scale: ScaleRule::MseSearch,
            rounding: Rounding::NearestEven,
            damp: 0.01,
            order: ColumnOrder::Natural,
            scale_by_loss: false,
            refine_passes: 8,
        }
    }
}

/// Why the Hessian cannot be used.
fn bad(reason: &'static str) -> Error {
    Error::BadHessian { reason }
}

/// Adds `x`'s rows (`tokens x n`, row-major) to the lower triangle of `hessian` (`n x n` f64):
/// `H += x^T x`. Call [`symmetrize`] once after the last batch. Accumulated in f64, in blocks of
/// rows, so a long calibration run loses nothing to rounding.
///
/// # Errors
/// [`Error::LengthMismatch`] when `x` is not whole rows of `n` or `hessian` is not `n * n`.
pub fn accumulate_hessian(hessian: &mut [f64], n: usize, x: &[f32]) -> Result<(), Error> {
    accumulate_hessian_threads(hessian, n, x, 1)
}

/// [`accumulate_hessian`] on `threads` threads, each summing a band of the Hessian's rows (the
/// bands hold equal shares of the lower triangle). The result does not depend on `threads`.
///
/// # Errors
/// As [`accumulate_hessian`].
pub fn accumulate_hessian_threads(
    hessian: &mut [f64],
    n: usize,
    x: &[f32],
    threads: usize,
) -> Result<(), Error> {
    check_len(
        "hessian",
        n.checked_mul(n).ok_or(Error::TooLarge)?,
        hessian.len(),
    )?;
    if n == 0 || !x.len().is_multiple_of(n) {
        return Err(Error::LengthMismatch {
            what: "activations (whole rows)",
            expected: x.len().next_multiple_of(n.max(1)),
            got: x.len(),
        });
    }
    let mut x64 = vec![0f64; HESSIAN_TOKENS * n];
    // Band edges: row i costs i + 1, so cut where the running cost reaches each share.
    let threads = threads.clamp(1, n);
    let total = n * (n + 1) / 2;
    let mut edges = vec![0];
    let mut cost = 0;
    for i in 0..n {
        cost += i + 1;
        if cost * threads >= total * edges.len() && edges.len() < threads {
            edges.push(i + 1);
        }
    }
    edges.push(n);
    edges.dedup();
    for chunk in x.chunks(n * HESSIAN_TOKENS) {
        let t = chunk.len() / n;
        for (dst, &v) in x64.iter_mut().zip(chunk) {
            *dst = f64::from(v);
        }
        // A short last chunk is padded with zero tokens.
        x64[t * n..].fill(0.0);
        let x64 = &x64;
        if edges.len() <= 2 {
            hessian_band(x64, n, 0..n, hessian);
            continue;
        }
        std::thread::scope(|scope| {
            let mut rest = &mut *hessian;
            for w in edges.windows(2) {
                let (mine, tail) = rest.split_at_mut((w[1] - w[0]) * n);
                rest = tail;
                let rows = w[0]..w[1];
                scope.spawn(move || hessian_band(x64, n, rows, mine));
            }
        });
    }
    Ok(())
}

/// Tokens [`accumulate_hessian_threads`] adds per pass over the Hessian.
const HESSIAN_TOKENS: usize = 8;

/// Adds `x64`'s [`HESSIAN_TOKENS`] tokens (row-major `HESSIAN_TOKENS x n` f64) to Hessian rows
/// `rows`, whose lower-triangle parts `h` holds (row `i` at `(i - rows.start) * n`). Eight
/// columns at a time, the tokens' products of an element added in order in registers (no
/// horizontal sums). Neither wider vectors (the same code compiled for AVX2 or AVX-512) nor 32
/// tokens per pass measured faster (`cargo bench -p benches -- gptq_hessian`, 2026-12-02).
fn hessian_band(x64: &[f64], n: usize, rows: std::ops::Range<usize>, h: &mut [f64]) {
    for i in rows.clone() {
        let xi: [f64; HESSIAN_TOKENS] = std::array::from_fn(|k| x64[k * n + i]);
        let at = (i - rows.start) * n;
        add_products(&xi, x64, n, &mut h[at..at + i + 1]);
    }
}

/// `out[j] += sum_k xi[k] * y64[k * n + j]` for `j < out.len()`, each element's products added
/// in token order, eight elements at a time in registers.
fn add_products(xi: &[f64; HESSIAN_TOKENS], y64: &[f64], n: usize, out: &mut [f64]) {
    const J: usize = 8;
    let whole = out.len() / J * J;
    let (head, tail) = out.split_at_mut(whole);
    for (c, acc) in head.chunks_exact_mut(J).enumerate() {
        let j = c * J;
        let mut a: [f64; J] = (&*acc).try_into().expect("J values");
        for (k, &xk) in xi.iter().enumerate() {
            let yj: &[f64; J] = y64[k * n + j..k * n + j + J].try_into().expect("J values");
            for l in 0..J {
                a[l] += xk * yj[l];
            }
        }
        acc.copy_from_slice(&a);
    }
    for (l, o) in tail.iter_mut().enumerate() {
        let j = whole + l;
        for (k, &xk) in xi.iter().enumerate() {
            *o += xk * y64[k * n + j];
        }
    }
}

/// Copies the lower triangle of an `n x n` matrix onto its upper triangle.
pub fn symmetrize(hessian: &mut [f64], n: usize) {
    for i in 0..n {
        for j in 0..i {
            hessian[j * n + i] = hessian[i * n + j];
        }
    }
}

/// The layer's output error `sum_rows (w - q)^T H (w - q)`: what GPTQ minimizes (with `H` the
/// undamped Hessian), for comparing quantizers. `weights` and `dequantized` are `rows x n`.
pub fn output_error(weights: &[f32], dequantized: &[f32], hessian: &[f64], n: usize) -> f64 {
    let mut total = 0.0;
    let mut d = vec![0f64; n];
    for (w, q) in weights.chunks_exact(n).zip(dequantized.chunks_exact(n)) {
        for ((d, &w), &q) in d.iter_mut().zip(w).zip(q) {
            *d = f64::from(w) - f64::from(q);
        }
        for i in 0..n {
            let hi = &hessian[i * n..(i + 1) * n];
            total += d[i] * hi.iter().zip(&d).map(|(h, d)| h * d).sum::<f64>();
        }
    }
    total
}

/// A factored Hessian, ready to quantize any number of rows against it.
#[derive(Clone, Debug)]
pub struct Prepared {
    cols: usize,
    options: GptqOptions,
    /// `perm[p]`: the column rounded `p`-th.
    perm: Vec<usize>,
    /// Columns whose Hessian diagonal is zero (no calibration input reached them): their weights
    /// are rounded as they are, and their error goes nowhere.
    dead: Vec<bool>,
    /// The upper Cholesky factor of the inverse of the damped, permuted Hessian, row-major f32:
    /// row `p` holds how column `p`'s error spreads onto the columns after it.
    u: Vec<f32>,
    /// The damped Hessian in column order, f64, with dead columns' rows and columns zero:
    /// the loss [`GptqOptions::refine_passes`] descends. Empty when no pass is asked for.
    damped: Vec<f64>,
}

impl Prepared {
    /// Damps, orders and factors `hessian` (`cols x cols`, row-major, symmetric).
    ///
    /// # Errors
    /// [`Error::NotBlockMultiple`] when `cols` is not a multiple of 32;
    /// [`Error::LengthMismatch`] for a Hessian of the wrong size; [`Error::BadHessian`] when it
    /// holds non-finite values or is not positive definite even after damping.
    pub fn new(hessian: &[f64], cols: usize, options: GptqOptions) -> Result<Prepared, Error> {
        check_block_multiple(cols)?;
        let n = cols;
        check_len(
            "hessian",
            n.checked_mul(n).ok_or(Error::TooLarge)?,
            hessian.len(),
        )?;
        if hessian.iter().any(|v| !v.is_finite()) {
            return Err(bad("it holds NaN or infinite values"));
        }
        if !options.damp.is_finite() || options.damp < 0.0 {
            return Err(bad("the damping must be a finite fraction >= 0"));
        }
        let diag: Vec<f64> = (0..n).map(|i| hessian[i * n + i]).collect();
        let dead: Vec<bool> = diag.iter().map(|&d| d <= 0.0).collect();
        let mut perm: Vec<usize> = (0..n).collect();
        if options.order == ColumnOrder::ActOrder {
            // Stable: equal diagonals keep their left-to-right order.
            perm.sort_by(|&a, &b| diag[b].total_cmp(&diag[a]));
        }
        let live = diag.iter().zip(&dead).filter(|(_, d)| !**d);
        let (sum, count) = live.fold((0.0, 0usize), |(s, c), (v, _)| (s + v, c + 1));
        let mean = if count == 0 { 1.0 } else { sum / count as f64 };
        let damp = options.damp * mean;
        // The permuted, damped Hessian, reversed (row and column order both), so that its lower
        // Cholesky factor, inverted and reversed back, is the upper factor of the inverse:
        // with J the reversal, J H J = L L^T gives H = V V^T for the upper V = J L J, and
        // H^-1 = (V^-1)^T V^-1 with V^-1 = J L^-1 J upper triangular.
        let mut a = vec![0f64; n * n];
        for i in 0..n {
            for j in 0..n {
                let (pi, pj) = (perm[n - 1 - i], perm[n - 1 - j]);
                a[i * n + j] = if dead[pi] || dead[pj] {
                    if pi == pj { 1.0 } else { 0.0 }
                } else {
                    hessian[pi * n + pj] + if pi == pj { damp } else { 0.0 }
                };
            }
        }
        let damped = if options.refine_passes == 0 {
            Vec::new()
        } else {
            let mut h = vec![0f64; n * n];
            for i in (0..n).filter(|&i| !dead[i]) {
                for j in (0..n).filter(|&j| !dead[j]) {
                    h[i * n + j] = hessian[i * n + j] + if i == j { damp } else { 0.0 };
                }
            }
            h
        };
        cholesky_lower(&mut a, n)?;
        let inv = invert_lower(&a, n);
        let mut u = vec![0f32; n * n];
        for i in 0..n {
            for j in i..n {
                u[i * n + j] = inv[(n - 1 - i) * n + (n - 1 - j)] as f32;
            }
        }
        Ok(Prepared {
            cols,
            options,
            perm,
            dead,
            u,
            damped,
        })
    }

    /// Quantizes `weights` (`rows x cols`, row-major) into the linear MX layout: `scales`
    /// (`rows * cols / 32`, row-major) and `packed` (the rows' codes back to back), the input of
    /// [`crate::gemv::MxMatrix::from_linear`].
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] for slices of the wrong size; [`Error::BadWeights`] when a weight
    /// is NaN or infinite.
    pub fn quantize(
        &self,
        format: ElemFormat,
        weights: &[f32],
        scales: &mut [u8],
        packed: &mut [u8],
    ) -> Result<(), Error> {
        let n = self.cols;
        if !weights.len().is_multiple_of(n) {
            return Err(Error::LengthMismatch {
                what: "weights (whole rows)",
                expected: weights.len().next_multiple_of(n),
                got: weights.len(),
            });
        }
        let rows = weights.len() / n;
        let per_row = n / BLOCK;
        check_len("scales", rows * per_row, scales.len())?;
        check_len("packed codes", packed_len(format, rows * n), packed.len())?;
        if weights.iter().any(|v| !v.is_finite()) {
            return Err(Error::BadWeights);
        }
        let row_bytes = packed_len(format, n);
        // Rows in tiles, so each row of `u` is read once per tile rather than once per row.
        const TILE: usize = 8;
        let mut work = vec![0f32; TILE * n];
        let mut exps = vec![0i32; TILE * per_row];
        let mut codes = vec![0u8; TILE * n];
        for (t, tile) in weights.chunks(TILE * n).enumerate() {
            let r_count = tile.len() / n;
            for r in 0..r_count {
                let w = &tile[r * n..(r + 1) * n];
                for (p, &c) in self.perm.iter().enumerate() {
                    work[r * n + p] = w[c];
                }
                if self.options.order == ColumnOrder::ActOrder {
                    for b in 0..per_row {
                        exps[r * per_row + b] =
                            self.exponent(format, &w[b * BLOCK..(b + 1) * BLOCK]);
                    }
                }
            }
            for p in 0..n {
                let c = self.perm[p];
                let (d, spread) = (self.u[p * n + p], &self.u[p * n + p + 1..(p + 1) * n]);
                for r in 0..r_count {
                    let row = &mut work[r * n..(r + 1) * n];
                    if self.options.order == ColumnOrder::Natural && p.is_multiple_of(BLOCK) {
                        let mut e = self.exponent(format, &row[p..p + BLOCK]);
                        if self.options.scale_by_loss {
                            e = self.exponent_by_loss(format, &row[p..p + BLOCK], p, e);
                        }
                        exps[r * per_row + p / BLOCK] = e;
                    }
                    let e = exps[r * per_row + c / BLOCK];
                    let x = row[p];
                    let code = encode_elem(format, f64::from(x) * pow2(-e), self.options.rounding);
                    let q = (f64::from(decode_elem(format, code)) * pow2(e)) as f32;
                    codes[r * n + c] = code;
                    if self.dead[c] {
                        continue;
                    }
                    let err = (x - q) / d;
                    for (v, &s) in row[p + 1..].iter_mut().zip(spread) {
                        *v -= err * s;
                    }
                }
            }
            for r in 0..r_count {
                self.refine(
                    format,
                    &tile[r * n..(r + 1) * n],
                    &exps[r * per_row..(r + 1) * per_row],
                    &mut codes[r * n..(r + 1) * n],
                );
                let row = t * TILE + r;
                for b in 0..per_row {
                    scales[row * per_row + b] = (exps[r * per_row + b] + SCALE_BIAS) as u8;
                }
                pack_codes(
                    format,
                    &codes[r * n..(r + 1) * n],
                    &mut packed[row * row_bytes..(row + 1) * row_bytes],
                )?;
            }
        }
        Ok(())
    }

    /// Coordinate descent on one row's damped loss `(w - q)^T H (w - q)`, block exponents
    /// `exps` fixed, for [`GptqOptions::refine_passes`] passes or until a pass changes nothing.
    /// With `g = H (w - q)`, moving column `c`'s error by `t` changes the loss by
    /// `2 t g_c + t^2 H_cc`, least at `t = -g_c / H_cc`: the column's best value is
    /// `q_c + g_c / H_cc`, and the loss is quadratic in it, so the nearest code on the block's
    /// grid is the best code.
    fn refine(&self, format: ElemFormat, w: &[f32], exps: &[i32], codes: &mut [u8]) {
        if self.options.refine_passes == 0 {
            return;
        }
        let n = self.cols;
        let h = &self.damped;
        let value =
            |c: usize, code: u8| f64::from(decode_elem(format, code)) * pow2(exps[c / BLOCK]);
        let mut err: Vec<f64> = (0..n)
            .map(|c| {
                if self.dead[c] {
                    0.0
                } else {
                    f64::from(w[c]) - value(c, codes[c])
                }
            })
            .collect();
        let mut g: Vec<f64> = (0..n)
            .map(|i| {
                h[i * n..(i + 1) * n]
                    .iter()
                    .zip(&err)
                    .map(|(a, b)| a * b)
                    .sum()
            })
            .collect();
        for _ in 0..self.options.refine_passes {
            let mut changed = false;
            for c in (0..n).filter(|&c| !self.dead[c]) {
                let q = f64::from(w[c]) - err[c];
                let best = q + g[c] / h[c * n + c];
                let e = exps[c / BLOCK];
                let code = encode_elem(format, best * pow2(-e), self.options.rounding);
                if code == codes[c] {
                    continue;
                }
                let new_err = f64::from(w[c]) - value(c, code);
                let step = new_err - err[c];
                // Only a strict fall is taken, so a pass cannot cycle between two codes.
                if 2.0 * step * g[c] + step * step * h[c * n + c] >= 0.0 {
                    continue;
                }
                codes[c] = code;
                err[c] = new_err;
                // H is symmetric: column c is row c.
                for (gi, &hc) in g.iter_mut().zip(&h[c * n..(c + 1) * n]) {
                    *gi += step * hc;
                }
                changed = true;
            }
            if !changed {
                break;
            }
        }
    }

    /// Of `start - 1`, `start` and `start + 1`, the exponent whose rounding of the block at
    /// column `p` (error fed forward within the block) costs the least GPTQ loss; `start` on a
    /// tie.
    fn exponent_by_loss(&self, format: ElemFormat, block: &[f32], p: usize, start: i32) -> i32 {
        let n = self.cols;
        let loss = |e: i32| {
            let mut w: [f32; BLOCK] = block.try_into().expect("a whole block");
            let mut total = 0f64;
            for c in 0..BLOCK {
                let code = encode_elem(format, f64::from(w[c]) * pow2(-e), self.options.rounding);
                let q = (f64::from(decode_elem(format, code)) * pow2(e)) as f32;
                let row = &self.u[(p + c) * n..(p + c + 1) * n];
                let err = (w[c] - q) / row[p + c];
                total += f64::from(err) * f64::from(err);
                for (v, &s) in w[c + 1..].iter_mut().zip(&row[p + c + 1..p + BLOCK]) {
                    *v -= err * s;
                }
            }
            total
        };
        let mut best = (loss(start), start);
        for e in [start - 1, start + 1] {
            let e = e.clamp(-SCALE_BIAS, SCALE_BIAS);
            let l = loss(e);
            if l < best.0 {
                best = (l, e);
            }
        }
        best.1
    }

    /// The shared exponent of one block of (finite) values under the options' scale rule.
    fn exponent(&self, format: ElemFormat, block: &[f32]) -> i32 {
        let block: &[f32; BLOCK] = block.try_into().expect("a whole block");
        let options = QuantOptions {
            scale: self.options.scale,
            rounding: self.options.rounding,
        };
        i32::from(reference::quantize_block_with(format, options, block).0) - SCALE_BIAS
    }
}

/// In-place lower Cholesky factor of a symmetric positive definite `n x n` matrix (row-major;
/// the strict upper triangle is left as it was and never read again).
fn cholesky_lower(a: &mut [f64], n: usize) -> Result<(), Error> {
    for i in 0..n {
        for j in 0..=i {
            let (head, tail) = a.split_at_mut(i * n);
            let row_i = &mut tail[..n];
            let row_j: &[f64] = if j == i {
                &row_i[..]
            } else {
                &head[j * n..j * n + n]
            };
            let dot: f64 = row_i[..j].iter().zip(&row_j[..j]).map(|(a, b)| a * b).sum();
            let s = row_i[j] - dot;
            if j == i {
                if s.is_nan() || s <= 0.0 {
                    return Err(bad("it is not positive definite; raise the damping"));
                }
                row_i[i] = s.sqrt();
            } else {
                row_i[j] = s / head[j * n + j];
            }
        }
    }
    Ok(())
}

/// The inverse of a lower triangular `n x n` matrix (only its lower triangle is read).
fn invert_lower(l: &[f64], n: usize) -> Vec<f64> {
    let mut inv = vec![0f64; n * n];
    for i in 0..n {
        // Row i of L^-1: (e_i - sum_{k<i} L[i][k] * row k of L^-1) / L[i][i].
        let (done, rest) = inv.split_at_mut(i * n);
        let row = &mut rest[..n];
        row[i] = 1.0;
        for k in 0..i {
            let f = l[i * n + k];
            if f != 0.0 {
                for (v, &o) in row[..=k].iter_mut().zip(&done[k * n..k * n + k + 1]) {
                    *v -= f * o;
                }
            }
        }
        let d = l[i * n + i];
        row[..=i].iter_mut().for_each(|v| *v /= d);
    }
    inv
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bulk;
    use crate::lcg;

    /// A fixed random layer whose inputs are correlated and have a few loud channels, as a
    /// transformer's do: `x = z A` with a random mixing `A`, and every 37th channel x8.
    fn layer(rows: usize, cols: usize, tokens: usize) -> (Vec<f32>, Vec<f32>, Vec<f64>) {
        let mut seed = 42;
        let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed) * 0.05).collect();
        let k = 16;
        let a: Vec<f32> = (0..k * cols).map(|_| lcg(&mut seed)).collect();
        let mut x = vec![0f32; tokens * cols];
        for t in 0..tokens {
            let z: Vec<f32> = (0..k).map(|_| lcg(&mut seed)).collect();
            for c in 0..cols {
                let mut v = 0.3 * lcg(&mut seed);
                for (i, zi) in z.iter().enumerate() {
                    v += zi * a[i * cols + c];
                }
                x[t * cols + c] = if c % 37 == 0 { v * 8.0 } else { v };
            }
        }
        let mut h = vec![0f64; cols * cols];
        accumulate_hessian(&mut h, cols, &x).unwrap();
        symmetrize(&mut h, cols);
        (w, x, h)
    }

    fn dequantized(format: ElemFormat, scales: &[u8], packed: &[u8], len: usize) -> Vec<f32> {
        let mut out = vec![0f32; len];
        bulk::dequantize(format, scales, packed, &mut out).unwrap();
        out
    }

    #[test]
    fn the_hessian_is_x_transpose_x() {
        let (n, tokens) = (32, 11);
        let mut seed = 1;
        let x: Vec<f32> = (0..n * tokens).map(|_| lcg(&mut seed)).collect();
        let mut h = vec![0f64; n * n];
        accumulate_hessian(&mut h, n, &x[..n * 5]).unwrap();
        accumulate_hessian(&mut h, n, &x[n * 5..]).unwrap();
        symmetrize(&mut h, n);
        let mut threaded = vec![0f64; n * n];
        accumulate_hessian_threads(&mut threaded, n, &x, 3).unwrap();
        symmetrize(&mut threaded, n);
        assert_eq!(h, threaded, "bands on three threads sum the same");
        for i in 0..n {
            for j in 0..n {
                let want: f64 = (0..tokens)
                    .map(|t| f64::from(x[t * n + i]) * f64::from(x[t * n + j]))
                    .sum();
                assert!((h[i * n + j] - want).abs() < 1e-9, "H[{i}][{j}]");
            }
        }
        assert!(accumulate_hessian(&mut h, n, &x[..n + 1]).is_err());
    }

    #[test]
    fn gptq_beats_round_to_nearest_in_every_format_and_order() {
        let (rows, cols) = (48, 128);
        let (w, _, h) = layer(rows, cols, 512);
        for format in ElemFormat::ALL {
            for scale in [ScaleRule::Floor, ScaleRule::MseSearch] {
                let mut s = vec![0u8; rows * cols / BLOCK];
                let mut p = vec![0u8; packed_len(format, rows * cols)];
                let rtn_options = QuantOptions {
                    scale,
                    ..QuantOptions::default()
                };
                bulk::quantize(format, rtn_options, &w, &mut s, &mut p).unwrap();
                let rtn = output_error(&w, &dequantized(format, &s, &p, w.len()), &h, cols);
                for (order, scale_by_loss, refine_passes) in [
                    (ColumnOrder::Natural, false, 0),
                    (ColumnOrder::Natural, true, 0),
                    (ColumnOrder::ActOrder, false, 0),
                    (ColumnOrder::Natural, false, 8),
                    (ColumnOrder::ActOrder, false, 8),
                ] {
                    let options = GptqOptions {
                        scale,
                        order,
                        scale_by_loss,
                        refine_passes,
                        ..GptqOptions::default()
                    };
                    let prepared = Prepared::new(&h, cols, options).unwrap();
                    prepared.quantize(format, &w, &mut s, &mut p).unwrap();
                    let gptq = output_error(&w, &dequantized(format, &s, &p, w.len()), &h, cols);
                    assert!(
                        gptq < 0.8 * rtn,
                        "{format} {scale:?} {order:?} {refine_passes} passes: GPTQ {gptq:.4e} vs \
                         round-to-nearest {rtn:.4e}"
                    );
                }
            }
        }
    }

    /// Coordinate descent after GPTQ lowers the damped loss it descends, in every format and
    /// both orders, and gives the same bytes on a second run.
    #[test]
    fn refinement_passes_lower_gptq_loss_in_every_format() {
        let (rows, cols) = (48, 128);
        let (w, _, h) = layer(rows, cols, 512);
        let damp = 0.01;
        let mean = (0..cols).map(|i| h[i * cols + i]).sum::<f64>() / cols as f64;
        let mut damped = h.clone();
        for i in 0..cols {
            damped[i * cols + i] += damp * mean;
        }
        for format in ElemFormat::ALL {
            for order in [ColumnOrder::Natural, ColumnOrder::ActOrder] {
                let run = |refine_passes| {
                    let options = GptqOptions {
                        damp,
                        order,
                        refine_passes,
                        ..GptqOptions::default()
                    };
                    let mut s = vec![0u8; rows * cols / BLOCK];
                    let mut p = vec![0u8; packed_len(format, rows * cols)];
                    let prepared = Prepared::new(&h, cols, options).unwrap();
                    prepared.quantize(format, &w, &mut s, &mut p).unwrap();
                    (s, p)
                };
                let loss = |(s, p): &(Vec<u8>, Vec<u8>)| {
                    output_error(&w, &dequantized(format, s, p, w.len()), &damped, cols)
                };
                let (gptq, refined) = (run(0), run(8));
                assert_eq!(gptq.0, refined.0, "{format}: the scales stay GPTQ's");
                let (before, after) = (loss(&gptq), loss(&refined));
                assert!(
                    after < 0.98 * before,
                    "{format} {order:?}: refined {after:.4e} vs GPTQ {before:.4e}"
                );
                assert!(run(8) == refined, "{format}: deterministic");
            }
        }
    }

    #[test]
    fn scales_chosen_by_loss_beat_scales_chosen_by_the_rule() {
        let (rows, cols) = (48, 128);
        let (w, _, h) = layer(rows, cols, 512);
        for format in [ElemFormat::Fp4E2M1, ElemFormat::Fp6E2M3, ElemFormat::Int8] {
            let error = |scale_by_loss| {
                let options = GptqOptions {
                    scale_by_loss,
                    refine_passes: 0,
                    ..GptqOptions::default()
                };
                let mut s = vec![0u8; rows * cols / BLOCK];
                let mut p = vec![0u8; packed_len(format, rows * cols)];
                let prepared = Prepared::new(&h, cols, options).unwrap();
                prepared.quantize(format, &w, &mut s, &mut p).unwrap();
                output_error(&w, &dequantized(format, &s, &p, w.len()), &h, cols)
            };
            let (rule, by_loss) = (error(false), error(true));
            // INT8's 255 levels leave the exponent little to decide: never worse is enough.
            let better = if format == ElemFormat::Int8 {
                by_loss <= rule
            } else {
                by_loss < rule
            };
            assert!(better, "{format}: by loss {by_loss:.4e} vs rule {rule:.4e}");
        }
    }

    #[test]
    fn gptq_is_deterministic_and_splits_rows_freely() {
        let (rows, cols) = (24, 64);
        let (w, _, h) = layer(rows, cols, 200);
        let format = ElemFormat::Fp4E2M1;
        let prepared = Prepared::new(&h, cols, GptqOptions::default()).unwrap();
        let run = |w: &[f32]| {
            let r = w.len() / cols;
            let mut s = vec![0u8; r * cols / BLOCK];
            let mut p = vec![0u8; packed_len(format, r * cols)];
            prepared.quantize(format, w, &mut s, &mut p).unwrap();
            (s, p)
        };
        let whole = run(&w);
        assert_eq!(whole, run(&w));
        // Rows quantized in two shares (as two threads would) give the same bytes.
        let (a, b) = (run(&w[..9 * cols]), run(&w[9 * cols..]));
        assert_eq!(whole.0, [a.0, b.0].concat());
        assert_eq!(whole.1, [a.1, b.1].concat());
    }

    #[test]
    fn block_rotations_beat_round_to_nearest_on_outlier_weights() {
        let (rows, cols) = (32, 128);
        let (mut w, _, h) = layer(rows, cols, 256);
        // Weight outliers, one per block in a few rows, which the rotation spreads out.
        for r in (0..rows).step_by(3) {
            for b in 0..cols / BLOCK {
                w[r * cols + b * BLOCK + (r + b) % BLOCK] *= 25.0;
            }
        }
        let format = ElemFormat::Fp4E2M1;
        let options = QuantOptions {
            scale: ScaleRule::MseSearch,
            ..QuantOptions::default()
        };
        let quantize = |w: &[f32]| {
            let mut s = vec![0u8; rows * cols / BLOCK];
            let mut p = vec![0u8; packed_len(format, rows * cols)];
            bulk::quantize(format, options, w, &mut s, &mut p).unwrap();
            dequantized(format, &s, &p, w.len())
        };
        let plain = output_error(&w, &quantize(&w), &h, cols);
        let mut rotated = w.clone();
        crate::hadamard::rotate_weights(&mut rotated).unwrap();
        let mut back = quantize(&rotated);
        crate::hadamard::unrotate_weights(&mut back).unwrap();
        let with_rotation = output_error(&w, &back, &h, cols);
        assert!(
            with_rotation < 0.8 * plain,
            "rotated {with_rotation:.4e} vs plain {plain:.4e}"
        );
    }

    #[test]
    fn a_bad_hessian_is_refused_with_its_reason() {
        let n = 32;
        let mut h = vec![0f64; n * n];
        h[0] = f64::NAN;
        assert!(matches!(
            Prepared::new(&h, n, GptqOptions::default()),
            Err(Error::BadHessian { .. })
        ));
        // All-zero (no calibration reached the layer): every column is dead, rounding is plain.
        let zero = vec![0f64; n * n];
        let prepared = Prepared::new(&zero, n, GptqOptions::default()).unwrap();
        let w: Vec<f32> = (0..n).map(|i| i as f32 * 0.01).collect();
        let (mut s, mut p) = (vec![0u8; 1], vec![0u8; packed_len(ElemFormat::Int8, n)]);
        prepared
            .quantize(ElemFormat::Int8, &w, &mut s, &mut p)
            .unwrap();
        let mut nan_w = w.clone();
        nan_w[3] = f32::INFINITY;
        assert_eq!(
            prepared.quantize(ElemFormat::Int8, &nan_w, &mut s, &mut p),
            Err(Error::BadWeights)
        );
        assert!(Prepared::new(&zero, 31, GptqOptions::default()).is_err());
    }
}
