//! Randomised orthonormal Walsh-Hadamard rotation.
//!
//! `R x = H (s ⊙ x) / sqrt(n)` where `H` is the n x n Sylvester-Hadamard matrix (entries
//! ±1, `H H = n I`) and `s` a seeded vector of random signs. Dividing by `sqrt(n)` makes
//! `R` orthonormal: `|R x| = |x|` and `R^-1 y = s ⊙ (H y) / sqrt(n)`.
//!
//! Why it matters: after the rotation every coordinate is a ±-weighted sum of all inputs,
//! so for a vector of norm `r` each coordinate has second moment `r^2 / n` and is close
//! to Gaussian. The codec divides by `r / sqrt(n)` to feed the quantiser N(0, 1)-like
//! values. An *unnormalised* transform (no `1/sqrt(n)`) yields coordinates of variance
//! `n r^2 / n = r^2`, i.e. `n` times too large once scaled, and every coordinate saturates
//! the outermost quantiser level: that bug once raised perplexity 300-fold.

use crate::rng::SplitMix64;

/// Stream id for the sign generator (distinct from k-means and randomized PCA).
const SIGN_STREAM: u64 = 0x5748_5400; // "WHT"

/// In-place unnormalised fast Walsh-Hadamard transform (`x <- H x`); `x.len()` must be a
/// power of two. O(n log n).
pub fn fwht_in_place(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let a = x[j];
                let b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
}

/// Smallest power of two >= `d` (and >= 1).
pub fn padded_len(d: usize) -> usize {
    d.max(1).next_power_of_two()
}

/// A seeded orthonormal rotation of length `n` (a power of two).
#[derive(Debug, Clone)]
pub struct Rotation {
    signs: Vec<f32>,
    norm: f32,
}

impl Rotation {
    /// The rotation for length `n` and `seed`; the same pair always gives the same signs.
    pub fn new(n: usize, seed: u64) -> Self {
        assert!(n.is_power_of_two(), "WHT length must be a power of two");
        let mut g = SplitMix64::new(seed, SIGN_STREAM ^ n as u64);
        let signs = (0..n).map(|_| g.sign()).collect();
        Rotation {
            signs,
            norm: 1.0 / (n as f32).sqrt(),
        }
    }

    /// Length of the rotation.
    pub fn len(&self) -> usize {
        self.signs.len()
    }

    /// True for the degenerate zero-length rotation (never constructed by the codec).
    pub fn is_empty(&self) -> bool {
        self.signs.is_empty()
    }

    /// `x <- R x`.
    pub fn forward(&self, x: &mut [f32]) {
        for (v, s) in x.iter_mut().zip(&self.signs) {
            *v *= s;
        }
        fwht_in_place(x);
        for v in x.iter_mut() {
            *v *= self.norm;
        }
    }

    /// `y <- R^-1 y` (= `R^T y`).
    pub fn inverse(&self, y: &mut [f32]) {
        fwht_in_place(y);
        for (v, s) in y.iter_mut().zip(&self.signs) {
            *v *= s * self.norm;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn hadamard_squared_is_n_identity() {
        for n in [1usize, 2, 4, 8, 64, 128] {
            for i in 0..n {
                let mut e = vec![0.0f32; n];
                e[i] = 1.0;
                fwht_in_place(&mut e);
                fwht_in_place(&mut e);
                for (j, v) in e.iter().enumerate() {
                    let want = if i == j { n as f32 } else { 0.0 };
                    assert!((v - want).abs() < 1e-4);
                }
            }
        }
    }

    #[test]
    fn unit_vector_spreads_to_unit_variance_after_scaling() {
        // The scale the codec uses: coordinates / (|x| / sqrt(n)) have mean square 1.
        let n = 64;
        let rot = Rotation::new(n, 3);
        let mut x = vec![0.0f32; n];
        x[5] = 2.5;
        rot.forward(&mut x);
        let norm = 2.5f32;
        let scale = norm / (n as f32).sqrt();
        let ms: f32 = x.iter().map(|v| (v / scale).powi(2)).sum::<f32>() / n as f32;
        assert!((ms - 1.0).abs() < 1e-5, "mean square {ms}");
        // A one-hot input maps to equal magnitudes: exactly ±1 after scaling.
        assert!(x.iter().all(|v| ((v / scale).abs() - 1.0).abs() < 1e-5));
    }

    proptest! {
        #[test]
        fn rotation_is_orthonormal_and_invertible(
            log_n in 0u32..9, seed in any::<u64>(),
            vals in proptest::collection::vec(-100.0f32..100.0, 256)
        ) {
            let n = 1usize << log_n;
            let rot = Rotation::new(n, seed);
            let x: Vec<f32> = vals[..n].to_vec();
            let mut y = x.clone();
            rot.forward(&mut y);
            let nx: f32 = x.iter().map(|v| v * v).sum();
            let ny: f32 = y.iter().map(|v| v * v).sum();
            prop_assert!((nx - ny).abs() <= 1e-4 * nx.max(1.0));
            rot.inverse(&mut y);
            for (a, b) in x.iter().zip(&y) {
                prop_assert!((a - b).abs() <= 1e-3 * a.abs().max(1.0));
            }
        }
    }
}
