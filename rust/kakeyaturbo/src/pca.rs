//! Weighted principal component analysis (exact).
//!
//! With weights `w_i >= 0` normalised to sum to one, the weighted mean is
//! `mu = sum_i w_i x_i` and the weighted covariance `C = sum_i w_i (x_i - mu)(x_i - mu)^T`.
//! Its eigenvectors, by descending eigenvalue, are the orthonormal basis; the eigenvalues
//! are the variances along them. Keeping the leading `d_eff` components minimises the
//! weighted squared projection error among all rank-`d_eff` affine subspaces
//! (Eckart-Young). Weights let a caller favour tokens that attention actually reads.
//!
//! `d_eff` is the fewest components whose variance share reaches `variance_ratio`
//! (capped by the caller's maximum). `variance_ratio = 1.0` keeps every component with
//! non-negligible variance: a lossless projection. Hard truncation at 95% looked cheap in
//! an earlier codec and threw away energy attention needed; the default here is 1.0.

use nalgebra::{DMatrix, SymmetricEigen};

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

/// Exact weighted PCA by symmetric eigendecomposition of the `d x d` covariance.
pub fn fit_exact(
    x: &[f32],
    n: usize,
    d: usize,
    weights: Option<&[f32]>,
    variance_ratio: f32,
    max_rank: usize,
) -> Result<PcaFit> {
    let w = normalised_weights(n, weights)?;
    let mu = weighted_mean(x, n, d, &w);
    let a = centred_weighted(x, n, d, &w, &mu);
    let cov = a.tr_mul(&a);
    let eig = SymmetricEigen::new(cov);
    let mut order: Vec<usize> = (0..d).collect();
    order.sort_by(|&i, &j| eig.eigenvalues[j].total_cmp(&eig.eigenvalues[i]));
    let eigenvalues: Vec<f64> = order.iter().map(|&i| eig.eigenvalues[i].max(0.0)).collect();
    let total: f64 = eigenvalues.iter().sum();
    let d_eff = choose_rank(&eigenvalues, total, variance_ratio, max_rank);
    let mut basis = Vec::with_capacity(d_eff * d);
    for &col in order.iter().take(d_eff) {
        let v = eig.eigenvectors.column(col);
        basis.extend(v.iter().map(|&e| e as f32));
    }
    Ok(PcaFit {
        mean: mu.iter().map(|&m| m as f32).collect(),
        basis,
        d_eff,
        eigenvalues,
        total_variance: total,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    /// Rows with variance `scales[j]^2` along a random orthonormal frame.
    pub(crate) fn anisotropic(n: usize, d: usize, seed: u64) -> Vec<f32> {
        let mut g = SplitMix64::new(seed, 9);
        let frame = DMatrix::from_fn(d, d, |_, _| g.normal()).qr().q();
        let mut x = vec![0.0f32; n * d];
        for i in 0..n {
            let z: Vec<f64> = (0..d)
                .map(|j| g.normal() * 4.0 / (1.0 + j as f64))
                .collect();
            for c in 0..d {
                let mut v = 1.5;
                for (j, zj) in z.iter().enumerate() {
                    v += frame[(c, j)] * zj;
                }
                x[i * d + c] = v as f32;
            }
        }
        x
    }

    #[test]
    fn basis_is_orthonormal_and_spectrum_sorted() {
        let (n, d) = (300, 16);
        let x = anisotropic(n, d, 1);
        let fit = fit_exact(&x, n, d, None, 1.0, d).unwrap();
        assert_eq!(fit.d_eff, d);
        for a in 0..d {
            for b in 0..d {
                let dot: f32 = (0..d)
                    .map(|c| fit.basis[a * d + c] * fit.basis[b * d + c])
                    .sum();
                let want = if a == b { 1.0 } else { 0.0 };
                assert!((dot - want).abs() < 1e-4);
            }
        }
        assert!(fit.eigenvalues.windows(2).all(|w| w[0] >= w[1]));
    }

    #[test]
    fn variance_ratio_picks_fewest_components() {
        let ev = [5.0, 3.0, 1.5, 0.5];
        assert_eq!(choose_rank(&ev, 10.0, 0.5, 4), 1);
        assert_eq!(choose_rank(&ev, 10.0, 0.8, 4), 2);
        assert_eq!(choose_rank(&ev, 10.0, 0.95, 4), 3);
        assert_eq!(choose_rank(&ev, 10.0, 0.96, 4), 4);
        assert_eq!(choose_rank(&ev, 10.0, 1.0, 3), 3);
        assert_eq!(choose_rank(&[1.0, 0.0, 0.0], 1.0, 1.0, 3), 1);
    }

    #[test]
    fn weights_move_the_mean() {
        let x = [0.0f32, 0.0, 10.0, 10.0];
        let fit = fit_exact(&x, 2, 2, Some(&[3.0, 1.0]), 1.0, 2).unwrap();
        assert!((fit.mean[0] - 2.5).abs() < 1e-5);
        assert!(fit_exact(&x, 2, 2, Some(&[1.0, -1.0]), 1.0, 2).is_err());
        assert!(fit_exact(&x, 2, 2, Some(&[1.0]), 1.0, 2).is_err());
    }
}
