//! What both PCA fits (exact, [`crate::pca`]; randomized, [`crate::rsvd`]) are made of: the
//! normalised weights, the weighted mean, the centred weighted matrix, the rank rule, and the
//! fit they return.

use nalgebra::DMatrix;

use crate::error::{Error, Result};

/// A fitted PCA: mean, orthonormal basis rows and the spectrum.
#[derive(Debug, Clone, PartialEq)]
pub struct PcaFit {
    /// Weighted mean, length `d`.
    pub mean: Vec<f32>,
    /// `d_eff` orthonormal rows of length `d`, row-major, by descending variance.
    pub basis: Vec<f32>,
    /// Number of kept components.
    pub d_eff: usize,
    /// Variances of the computed components, descending (all `d` for exact PCA).
    pub eigenvalues: Vec<f64>,
    /// Total variance (trace of the covariance).
    pub total_variance: f64,
}

/// Normalised weights (sum 1), or uniform when `weights` is `None`.
pub fn normalised_weights(n: usize, weights: Option<&[f32]>) -> Result<Vec<f64>> {
    match weights {
        None => Ok(vec![1.0 / n as f64; n]),
        Some(w) => {
            if w.len() != n {
                return Err(Error::Shape(format!(
                    "weights has {} entries for {n} vectors",
                    w.len()
                )));
            }
            if let Some(i) = w.iter().position(|v| !v.is_finite() || *v < 0.0) {
                return Err(Error::InvalidParams(format!(
                    "weights must be finite and >= 0 (index {i} is {})",
                    w[i]
                )));
            }
            let s: f64 = w.iter().map(|&v| v as f64).sum();
            if s <= 0.0 {
                return Err(Error::InvalidParams("weights sum to zero".into()));
            }
            Ok(w.iter().map(|&v| v as f64 / s).collect())
        }
    }
}

/// Weighted mean of `n` rows of length `d`.
pub fn weighted_mean(x: &[f32], n: usize, d: usize, w: &[f64]) -> Vec<f64> {
    let mut mu = vec![0.0f64; d];
    for i in 0..n {
        let row = &x[i * d..(i + 1) * d];
        for (m, &v) in mu.iter_mut().zip(row) {
            *m += w[i] * v as f64;
        }
    }
    mu
}

/// The `sqrt(w_i) (x_i - mu)` matrix (n x d): its Gram matrix is the weighted covariance.
pub fn centred_weighted(x: &[f32], n: usize, d: usize, w: &[f64], mu: &[f64]) -> DMatrix<f64> {
    DMatrix::from_fn(n, d, |i, j| w[i].sqrt() * (x[i * d + j] as f64 - mu[j]))
}

/// Fewest leading components reaching `ratio` of `total`, within `1..=max_rank`.
pub fn choose_rank(eigenvalues: &[f64], total: f64, ratio: f32, max_rank: usize) -> usize {
    let max_rank = max_rank.min(eigenvalues.len()).max(1);
    if total <= 0.0 {
        return 1;
    }
    // A relative tolerance so that ratio 1.0 stops at numerical full rank instead of
    // keeping components that hold only rounding noise.
    let target = (ratio as f64 - 1e-7).max(0.0) * total;
    let mut cum = 0.0;
    for (k, &ev) in eigenvalues.iter().enumerate().take(max_rank) {
        cum += ev.max(0.0);
        if cum >= target {
            return k + 1;
        }
    }
    max_rank
}
