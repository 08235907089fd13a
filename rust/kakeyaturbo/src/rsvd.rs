//! Randomized PCA by the Halko-Martinsson-Tropp range finder (HMT 2011, Alg. 4.4 + 5.1).
//!
//! With `A = sqrt(W) (X - mu)` (n x d), draw a Gaussian test matrix `Omega` (d x l,
//! `l = target_rank + oversample`), form `Y = A Omega` and orthonormalise it (`Q`). Each
//! power iteration replaces `Q` by `orth(A orth(A^T Q))`, which raises the singular values
//! to the power `2q + 1` and sharpens slowly decaying spectra. Then `B = Q^T A` (l x d) is
//! small; its SVD `B = U S V^T` gives the leading right singular vectors of `A` (the PCA
//! basis) and `S^2` the variances. The variance ratio is measured against the exact total
//! `|A|_F^2`, so components the sketch missed count as lost, never as kept.

use nalgebra::DMatrix;

use crate::error::Result;
use crate::rng::SplitMix64;
use crate::weighted::{centred_weighted, choose_rank, normalised_weights, weighted_mean, PcaFit};

const RSVD_STREAM: u64 = 0x5253_5644; // "RSVD"

/// Randomized weighted PCA; `target_rank` 0 means `d`.
#[allow(clippy::too_many_arguments)]
pub fn fit_randomized(
    x: &[f32],
    n: usize,
    d: usize,
    weights: Option<&[f32]>,
    variance_ratio: f32,
    max_rank: usize,
    target_rank: usize,
    oversample: usize,
    power_iters: usize,
    seed: u64,
) -> Result<PcaFit> {
    let w = normalised_weights(n, weights)?;
    let mu = weighted_mean(x, n, d, &w);
    let a = centred_weighted(x, n, d, &w, &mu);
    let rank = if target_rank == 0 {
        d
    } else {
        target_rank.min(d)
    };
    let l = (rank + oversample).min(d).min(n.max(1));
    let mut g = SplitMix64::new(seed, RSVD_STREAM);
    let omega = DMatrix::from_fn(d, l, |_, _| g.normal());
    let mut q = (&a * omega).qr().q();
    for _ in 0..power_iters {
        let z = a.tr_mul(&q).qr().q();
        q = (&a * z).qr().q();
    }
    let b = q.tr_mul(&a); // l x d
    let svd = b.svd(false, true);
    let v_t = svd.v_t.expect("requested V^T");
    let mut order: Vec<usize> = (0..svd.singular_values.len()).collect();
    order.sort_by(|&i, &j| svd.singular_values[j].total_cmp(&svd.singular_values[i]));
    let eigenvalues: Vec<f64> = order
        .iter()
        .map(|&i| svd.singular_values[i] * svd.singular_values[i])
        .collect();
    let total = a.norm_squared();
    let cap = max_rank.min(rank).min(eigenvalues.len());
    let d_eff = choose_rank(&eigenvalues, total, variance_ratio, cap);
    let mut basis = Vec::with_capacity(d_eff * d);
    for &r in order.iter().take(d_eff) {
        basis.extend(v_t.row(r).iter().map(|&e| e as f32));
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
mod tests {
    use super::*;
    use crate::test_data::anisotropic;

    #[test]
    fn seed_is_deterministic() {
        let x = anisotropic(64, 16, 2);
        let a = fit_randomized(&x, 64, 16, None, 0.9, 16, 6, 4, 1, 42).unwrap();
        let b = fit_randomized(&x, 64, 16, None, 0.9, 16, 6, 4, 1, 42).unwrap();
        assert_eq!(a, b);
    }
}
