//! Stage diagnostics: how much of a layer's error each pipeline stage causes.
//!
//! All errors are relative Frobenius norms `|x - x_hat|_F / |x|_F` (the absolute norm
//! when `x = 0`). The PCA stage reconstructs `mean + B^T c` with every coefficient kept;
//! the skeleton stage keeps only `t_i mu_{a_i}` of each coefficient vector (the residual
//! dropped), so it shows what the skeleton alone captures; the quantised stage is the full
//! codec with outliers off (`outlier_threshold = inf`), and the full stage is what
//! [`crate::encode_layer`] produces. Per-block bases, block seeds and rounding are the
//! encoder's own, so the stages are those of the real encoding.

use crate::codec::{check_input, decode_layer, encode_layer};
use crate::error::Result;
use crate::kmeans;
use crate::params::{CodecParams, InputDtype};
use crate::pca::{fit_basis, normalised_weights, project, unproject};

/// Relative Frobenius error `|x - x_hat| / |x|` after each stage, to attribute loss.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageErrors {
    /// PCA projection alone (mean + `d_eff` components, rounded side info).
    pub pca: f64,
    /// PCA + skeleton with the residual dropped: what the skeleton alone captures.
    pub skeleton: f64,
    /// Full pipeline with outlier compensation off.
    pub quantised: f64,
    /// Full pipeline (what `encode_layer` produces).
    pub full: f64,
}

/// `|x - y|_F / |x|_F` (or `|x - y|_F` when `x = 0`).
pub fn rel_err(x: &[f32], y: &[f32]) -> f64 {
    let num: f64 = x.iter().zip(y).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let den: f64 = x.iter().map(|&a| (a as f64).powi(2)).sum();
    if den > 0.0 {
        (num / den).sqrt()
    } else {
        num.sqrt()
    }
}

/// Error after each stage of the pipeline for the layer `x`.
pub fn stage_errors(x: &[f32], n: usize, d: usize, p: &CodecParams) -> Result<StageErrors> {
    p.validate()?;
    check_input(x, n, d)?;
    let shared = if p.share_basis {
        Some(fit_basis(x, n, d, None, p)?)
    } else {
        None
    };
    let mut pca_out = vec![0.0f32; n * d];
    let mut skel_out = vec![0.0f32; n * d];
    let bs = p.block_size;
    for bi in 0..n.div_ceil(bs) {
        let (lo, hi) = (bi * bs, ((bi + 1) * bs).min(n));
        let xb = &x[lo * d..hi * d];
        let own;
        let sb = match &shared {
            Some(s) => s,
            None => {
                own = fit_basis(xb, hi - lo, d, None, p)?;
                &own
            }
        };
        let (mean, basis) = (&sb.mean, &sb.basis);
        let mut coeffs = project(xb, hi - lo, d, mean, basis, sb.d_eff);
        unproject(
            &coeffs,
            hi - lo,
            d,
            mean,
            basis,
            sb.d_eff,
            &mut pca_out[lo * d..hi * d],
        );
        let w = normalised_weights(hi - lo, None)?;
        let orig = coeffs.clone();
        kmeans::apply(
            &mut coeffs,
            hi - lo,
            sb.d_eff,
            &w,
            p,
            kmeans::block_seed(p.seed, bi),
        );
        // What the skeleton removed (exactly zero with k = 0).
        let skel: Vec<f32> = orig.iter().zip(&coeffs).map(|(o, r)| o - r).collect();
        unproject(
            &skel,
            hi - lo,
            d,
            mean,
            basis,
            sb.d_eff,
            &mut skel_out[lo * d..hi * d],
        );
    }
    let no_outliers = CodecParams {
        outlier_threshold: f32::INFINITY,
        ..p.clone()
    };
    let q = decode_layer(&encode_layer(x, n, d, None, &no_outliers, InputDtype::F32)?)?;
    let full = decode_layer(&encode_layer(x, n, d, None, p, InputDtype::F32)?)?;
    Ok(StageErrors {
        pca: rel_err(x, &pca_out),
        skeleton: rel_err(x, &skel_out),
        quantised: rel_err(x, &q),
        full: rel_err(x, &full),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_data::{kv_like, params};

    #[test]
    fn stage_errors_are_ordered() {
        let (n, d) = (512, 32);
        let x = kv_like(n, d, 11);
        let p = params(|p| p.variance_ratio = 0.95);
        let s = stage_errors(&x, n, d, &p).unwrap();
        assert!(s.pca > 0.0 && s.pca <= s.quantised + 1e-9);
        assert!(s.skeleton >= s.pca);
        assert!(s.full <= s.quantised + 1e-6);
    }
}
