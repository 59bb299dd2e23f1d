//! 32-point Walsh-Hadamard rotations, one per MX block.
//!
//! A weight row and the activation it meets are both rotated block by block; the dot product
//! is unchanged, but an outlier in a block is spread over all 32 of its elements, so the block's
//! shared power-of-two scale fits the other 31 better. One rotation per 32-element block (not
//! per whole row) keeps the cost at five butterfly stages per block and leaves every block
//! independent, as MX's scales are.
//!
//! With `H` the unnormalized 32x32 Sylvester Hadamard matrix (`H * H = 32 I`, symmetric):
//! - activations become `H x` ([`rotate_activations`]): additions and subtractions only, in a
//!   fixed butterfly order, so every implementation that keeps that order (the WGSL one in
//!   [`crate::wgsl`] does) gets the same bits;
//! - weight rows become `H w / 32` ([`rotate_weights`]), and `(H w / 32) . (H x) = w . x`;
//! - [`unrotate_weights`] undoes [`rotate_weights`] (`H (H w / 32) = w`), up to f32 rounding.
//!
//! The factor 1/32 is a power of two, so it is exact in f32 (away from subnormals), and in an MX
//! matrix it only moves the shared exponents.

use crate::Error;
use crate::format::BLOCK;
use crate::layout::check_block_multiple;

/// The in-place fast Walsh-Hadamard transform of one block (`v <- H v`, unnormalized), in the
/// butterfly order every implementation here follows: strides 1, 2, 4, 8, 16; within a stride,
/// pairs `(j, j + h)` in increasing `j`.
pub fn fwht32(v: &mut [f32; BLOCK]) {
    butterflies(v);
}

/// [`fwht32`]'s butterflies over one block of any element type (f32 for data, f64 for
/// Hessians).
fn butterflies<T: Copy + std::ops::Add<Output = T> + std::ops::Sub<Output = T>>(v: &mut [T]) {
    debug_assert_eq!(v.len(), BLOCK);
    let mut h = 1;
    while h < BLOCK {
        for i in (0..BLOCK).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (v[j], v[j + h]);
                v[j] = a + b;
                v[j + h] = a - b;
            }
        }
        h *= 2;
    }
}

fn each_block(data: &mut [f32], f: impl Fn(&mut [f32; BLOCK])) -> Result<(), Error> {
    check_block_multiple(data.len())?;
    for block in data.chunks_exact_mut(BLOCK) {
        f(block.try_into().expect("chunks_exact yields whole blocks"));
    }
    Ok(())
}

/// Rotates activations in place, block by block: `x <- H x`.
///
/// # Errors
/// [`Error::NotBlockMultiple`] when the length is not a multiple of 32.
pub fn rotate_activations(x: &mut [f32]) -> Result<(), Error> {
    each_block(x, fwht32)
}

/// Rotates weight values in place, block by block: `w <- H w / 32` (rows laid end to end; the
/// row length must be a multiple of 32, so blocks never straddle rows).
///
/// # Errors
/// [`Error::NotBlockMultiple`] when the length is not a multiple of 32.
pub fn rotate_weights(w: &mut [f32]) -> Result<(), Error> {
    each_block(w, |b| {
        fwht32(b);
        b.iter_mut().for_each(|v| *v /= BLOCK as f32);
    })
}

/// Undoes [`rotate_weights`] in place: `w <- H w`.
///
/// # Errors
/// [`Error::NotBlockMultiple`] when the length is not a multiple of 32.
pub fn unrotate_weights(w: &mut [f32]) -> Result<(), Error> {
    each_block(w, fwht32)
}

/// Rotates a symmetric `n x n` second-moment matrix `X^T X` (row-major, f64) to the rotated
/// activations' `(X R)^T (X R) = R^T X^T X R`, `R` block-diagonal with one `H` per 32 columns.
///
/// # Errors
/// [`Error::NotBlockMultiple`] when `n` is not a multiple of 32; [`Error::LengthMismatch`] when
/// `hessian` is not `n * n`.
pub fn rotate_hessian(hessian: &mut [f64], n: usize) -> Result<(), Error> {
    check_block_multiple(n)?;
    crate::layout::check_len(
        "hessian",
        n.checked_mul(n).ok_or(Error::TooLarge)?,
        hessian.len(),
    )?;
    // Rows: each row's blocks (right multiplication by R).
    for row in hessian.chunks_exact_mut(n) {
        row.chunks_exact_mut(BLOCK).for_each(butterflies);
    }
    // Columns: the same on the transpose (left multiplication by R^T = R).
    let mut column = vec![0f64; n];
    for c in 0..n {
        for (r, v) in column.iter_mut().enumerate() {
            *v = hessian[r * n + c];
        }
        column.chunks_exact_mut(BLOCK).for_each(butterflies);
        for (r, v) in column.iter().enumerate() {
            hessian[r * n + c] = *v;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lcg;

    #[test]
    fn the_transform_is_hadamard_and_the_rotation_keeps_dot_products() {
        // H's row i, column j is (-1)^popcount(i & j) (Sylvester order).
        for i in 0..BLOCK {
            let mut e = [0f32; BLOCK];
            e[i] = 1.0;
            fwht32(&mut e);
            for (j, &v) in e.iter().enumerate() {
                let want = if (i & j).count_ones() % 2 == 0 {
                    1.0
                } else {
                    -1.0
                };
                assert_eq!(v, want, "H[{j}][{i}]");
            }
        }
        let mut seed = 7;
        let w: Vec<f32> = (0..96).map(|_| lcg(&mut seed)).collect();
        let x: Vec<f32> = (0..96).map(|_| lcg(&mut seed)).collect();
        let (mut rw, mut rx) = (w.clone(), x.clone());
        rotate_weights(&mut rw).unwrap();
        rotate_activations(&mut rx).unwrap();
        let dot =
            |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(a, b)| f64::from(a * b)).sum::<f64>();
        assert!((dot(&w, &x) - dot(&rw, &rx)).abs() < 1e-5);
        unrotate_weights(&mut rw).unwrap();
        for (a, b) in w.iter().zip(&rw) {
            assert!((a - b).abs() < 1e-6);
        }
        assert!(rotate_activations(&mut [0.0; 31]).is_err());
    }

    #[test]
    fn the_hessian_rotates_as_the_activations_do() {
        let (n, tokens) = (64, 40);
        let mut seed = 3;
        let x: Vec<f32> = (0..n * tokens).map(|_| lcg(&mut seed)).collect();
        let gram = |x: &[f32]| {
            let mut h = vec![0f64; n * n];
            for t in x.chunks_exact(n) {
                for i in 0..n {
                    for j in 0..n {
                        h[i * n + j] += f64::from(t[i]) * f64::from(t[j]);
                    }
                }
            }
            h
        };
        let mut h = gram(&x);
        rotate_hessian(&mut h, n).unwrap();
        let mut rx = x.clone();
        rotate_activations(&mut rx).unwrap();
        let want = gram(&rx);
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        // The rotated activations were rounded to f32; the rotated Hessian was not.
        for (a, b) in h.iter().zip(&want) {
            assert!((a - b).abs() < 1e-5 * scale, "{a} vs {b}");
        }
    }
}
