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
//!
//! The codec's use of a fit ([`fit_basis`], [`project`], [`unproject`]): the mean and the
//! `d_eff x D` basis `B` are rounded to the skeleton dtype *before* use, so the decoder sees
//! exactly what the encoder used; coefficients are `c_i = B (x_i - mean)` and the
//! reconstruction is `x_hat_i = mean + B^T c_hat_i`. `pca_method = none` keeps an empty
//! basis: the identity, `d_eff = D`, only the mean removed.

use nalgebra::{DMatrix, DMatrixView, DMatrixViewMut, SymmetricEigen};

use crate::error::Result;
use crate::params::{CodecParams, PcaMethod};
use crate::rsvd;
pub use crate::weighted::{
    centred_weighted, choose_rank, normalised_weights, weighted_mean, PcaFit,
};

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

/// A fitted mean and basis as the codec uses them (rounded to the skeleton dtype). Stored
/// once per layer with `share_basis`, else per block.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedBasis {
    /// Kept components.
    pub d_eff: usize,
    /// Mean (length `D`), already rounded to the skeleton dtype.
    pub mean: Vec<f32>,
    /// `d_eff x D` rows, already rounded to the skeleton dtype (empty: the identity).
    pub basis: Vec<f32>,
}

/// Fits the (rounded) mean and basis of `n` vectors of length `d` by `p.pca_method`.
pub fn fit_basis(
    x: &[f32],
    n: usize,
    d: usize,
    w: Option<&[f32]>,
    p: &CodecParams,
) -> Result<SharedBasis> {
    let max_rank = p.max_rank(d);
    let fit: PcaFit = match p.pca_method {
        PcaMethod::None => {
            let w = normalised_weights(n, w)?;
            return Ok(SharedBasis {
                d_eff: d,
                mean: rounded_mean(x, n, d, &w, p),
                basis: Vec::new(),
            });
        }
        PcaMethod::Exact => fit_exact(x, n, d, w, p.variance_ratio, max_rank)?,
        PcaMethod::Randomized => rsvd::fit_randomized(
            x,
            n,
            d,
            w,
            p.variance_ratio,
            max_rank,
            p.target_rank,
            p.oversample,
            p.power_iters,
            p.seed,
        )?,
    };
    let mut mean = fit.mean;
    let mut basis = fit.basis;
    p.skeleton_dtype.round_all(&mut mean);
    p.skeleton_dtype.round_all(&mut basis);
    Ok(SharedBasis {
        d_eff: fit.d_eff,
        mean,
        basis,
    })
}

/// Weighted mean rounded to the skeleton dtype (the mean of an identity or external basis).
pub fn rounded_mean(x: &[f32], n: usize, d: usize, w: &[f64], p: &CodecParams) -> Vec<f32> {
    let mut mean: Vec<f32> = weighted_mean(x, n, d, w)
        .iter()
        .map(|&m| m as f32)
        .collect();
    p.skeleton_dtype.round_all(&mut mean);
    mean
}

/// `n x d_eff` coefficients `B (x_i - mean)` (an empty basis is the identity).
pub fn project(
    x: &[f32],
    n: usize,
    d: usize,
    mean: &[f32],
    basis: &[f32],
    d_eff: usize,
) -> Vec<f32> {
    let mut centred = x[..n * d].to_vec();
    for row in centred.chunks_exact_mut(d) {
        for (v, m) in row.iter_mut().zip(mean) {
            *v -= m;
        }
    }
    if basis.is_empty() {
        return centred;
    }
    // Row-major buffers read column-major are transposes: C^T (d_eff x n) = B (d_eff x d)
    // X_c^T (d x n). B must be column-major for that, so transpose it once (small).
    let b_cm = DMatrix::from_row_slice(d_eff, d, basis);
    let xt = DMatrixView::from_slice(&centred, d, n);
    let ct = b_cm * xt;
    debug_assert_eq!(ct.nrows(), d_eff);
    ct.data.into()
}

/// `x_i = mean + B^T c_i`, written into `out` (n x d).
pub fn unproject(
    coeffs: &[f32],
    n: usize,
    d: usize,
    mean: &[f32],
    basis: &[f32],
    d_eff: usize,
    out: &mut [f32],
) {
    if basis.is_empty() {
        // Identity basis (pca_method 'none'): d_eff == d.
        for (row, c) in out.chunks_exact_mut(d).zip(coeffs.chunks_exact(d_eff)) {
            for ((o, &m), &v) in row.iter_mut().zip(mean).zip(c) {
                *o = m + v;
            }
        }
        return;
    }
    // X_hat^T (d x n) = B^T (d x d_eff, the row-major basis read column-major) C^T.
    let bt = DMatrixView::from_slice(basis, d, d_eff);
    let ct = DMatrixView::from_slice(coeffs, d_eff, n);
    let mut xt = DMatrixViewMut::from_slice(out, d, n);
    xt.gemm(1.0, &bt, &ct, 0.0);
    for row in out.chunks_exact_mut(d) {
        for (o, &m) in row.iter_mut().zip(mean) {
            *o += m;
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::codec::{decode_layer, EncodedLayer};
    use crate::stages::rel_err;
    use crate::test_data::{
        anisotropic, edited, encode_f32, kv_like, params, roundtrip, total_outliers,
    };

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
    fn randomized_fit_matches_exact_spectrum_on_decaying_data() {
        let (n, d) = (400, 32);
        let x = anisotropic(n, d, 4);
        let exact = fit_exact(&x, n, d, None, 1.0, d).unwrap();
        let approx = crate::rsvd::fit_randomized(&x, n, d, None, 1.0, 8, 8, 8, 2, 1).unwrap();
        assert_eq!(approx.d_eff, 8);
        for k in 0..4 {
            let rel = (approx.eigenvalues[k] - exact.eigenvalues[k]).abs() / exact.eigenvalues[k];
            assert!(rel < 0.01, "component {k}: rel err {rel}");
        }
        // The leading subspaces agree: |<u_k, v_k>| ~ 1 for well-separated components.
        for k in 0..3 {
            let dot: f32 = (0..d)
                .map(|c| approx.basis[k * d + c] * exact.basis[k * d + c])
                .sum();
            assert!(dot.abs() > 0.99, "component {k}: |cos| {}", dot.abs());
        }
        assert!((approx.total_variance - exact.total_variance).abs() < 1e-6 * exact.total_variance);
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

    #[test]
    fn variance_ratio_and_rank_cap_bound_d_eff() {
        let (n, d) = (512, 64);
        let x = kv_like(n, d, 6);
        let p = params(|p| p.rank_cap = 20);
        let enc = encode_f32(&x, n, d, &p);
        assert_eq!(enc.stats()[0].d_eff, 20);
        let p = params(|p| p.variance_ratio = 0.5);
        let enc = encode_f32(&x, n, d, &p);
        assert!(enc.stats()[0].d_eff < 40);
    }

    #[test]
    fn randomized_pca_close_to_exact() {
        let (n, d) = (512, 64);
        let x = kv_like(n, d, 7);
        let ex = params(|p| p.bit_width = 4);
        let rp = edited(&ex, |p| p.pca_method = PcaMethod::Randomized);
        let (ye, _) = roundtrip(&x, n, d, &ex);
        let (yr, _) = roundtrip(&x, n, d, &rp);
        let (ee, er) = (rel_err(&x, &ye), rel_err(&x, &yr));
        assert!(er < ee * 1.1 + 1e-3, "randomized {er} vs exact {ee}");
    }

    #[test]
    fn pca_none_stores_no_basis_and_roundtrips() {
        let (n, d) = (1024, 64);
        let x = kv_like(n, d, 12);
        let none = params(|p| (p.pca_method, p.k, p.bit_width) = (PcaMethod::None, 0, 3));
        let exact = edited(&none, |p| p.pca_method = PcaMethod::Exact);
        let (yn, en) = roundtrip(&x, n, d, &none);
        let (_, ee) = roundtrip(&x, n, d, &exact);
        assert_eq!(en.stats()[0].d_eff, d);
        // Two blocks' D x D fp16 bases are not stored.
        let diff = ee.nbytes() as isize - en.nbytes() as isize;
        let outliers = total_outliers(&ee) - total_outliers(&en);
        assert_eq!(diff, 2 * (d * d * 2) as isize + 6 * outliers);
        assert!(rel_err(&x, &yn) < 0.2);
        let back = EncodedLayer::from_bytes(en.as_bytes().to_vec()).unwrap();
        assert_eq!(decode_layer(&back).unwrap(), yn);
        let bad = CodecParams {
            variance_ratio: 0.9,
            ..none
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn project_then_unproject_is_exact_at_full_rank() {
        let (n, d) = (40, 8);
        let x = anisotropic(n, d, 4);
        let p = params(|p| p.skeleton_dtype = crate::params::SkeletonDtype::F32);
        let sb = fit_basis(&x, n, d, None, &p).unwrap();
        assert_eq!(sb.d_eff, d);
        let c = project(&x, n, d, &sb.mean, &sb.basis, sb.d_eff);
        let mut y = vec![0.0; n * d];
        unproject(&c, n, d, &sb.mean, &sb.basis, sb.d_eff, &mut y);
        assert!(rel_err(&x, &y) < 1e-5, "{}", rel_err(&x, &y));
    }
}
