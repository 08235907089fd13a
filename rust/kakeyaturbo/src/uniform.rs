//! Uniform allocation (the `allocation = Uniform` path): skeleton residual, rotation and
//! `bit_width` Lloyd-Max bits on every rotated coordinate.
//!
//! For a block's PCA coefficients `c_i` (length `d_eff`):
//! 1. Skeleton (k > 0, see [`crate::kmeans::apply`]): residual `r_i = c_i - t_i mu_{a_i}`.
//! 2. `u_i = R [r_i, 0...]` with the orthonormal WHT rotation `R` of length
//!    `W = next_pow2(d_eff)` ([`crate::wht`]); `s0_i = |u_i| / sqrt(W)`, so `v_i = u_i / s0_i`
//!    has unit mean square (the Lloyd-Max tables assume N(0, 1)).
//! 3. Codes `q = Q(v_i)`; coordinates with `|v| > threshold` are outliers kept in f16
//!    ([`crate::outliers`]). The stored scale is refit given the dequantised `v_hat`: for
//!    `Metric::Mse` the least-squares `s0 <v, v_hat> / |v_hat|^2`; for
//!    `Metric::InnerProduct` `s0 |v|^2 / <v, v_hat>`, which makes `<r_hat, r> = |r|^2` (no
//!    shrinkage of `q . k`).
//!
//! Decoding: `c_hat_i = R^-1 [s_i v_hat_i]` truncated to `d_eff`, plus `t_i mu_{a_i}`.

use half::f16;

use crate::error::Result;
use crate::kmeans::{self, dot, SkeletonCodes};
use crate::lloyd_max::{self, Codebook};
use crate::outliers;
use crate::params::{CodecParams, Metric, MAX_MAGNITUDE};
use crate::wht::{padded_len, Rotation};

/// A uniformly allocated block body, codes unpacked (the wire form packs them).
#[derive(Debug, Clone, PartialEq)]
pub struct UniformBody {
    /// The block's skeleton (no centres when `k = 0`).
    pub skeleton: SkeletonCodes,
    /// Per-vector dequantisation scale.
    pub scales: Vec<f16>,
    /// `n x W` quantiser indices.
    pub codes: Vec<u16>,
    /// `(position i * W + j, value)` of exactly stored scaled coordinates, ascending.
    pub outliers: Vec<(u32, f16)>,
}

/// The scalar codebook of `p`: its calibrated centroids, else the Gaussian Lloyd-Max one.
pub fn codebook(p: &CodecParams) -> Result<Codebook> {
    match &p.centroids {
        Some(c) => Codebook::from_levels(c.clone()),
        None => Ok(lloyd_max::gaussian(p.bit_width)?.clone()),
    }
}

/// Codes `n` coefficient rows of length `d_eff` (weights `w`) of block `block_index`.
pub fn encode(
    mut coeffs: Vec<f32>,
    n: usize,
    d_eff: usize,
    w: &[f64],
    p: &CodecParams,
    block_index: usize,
) -> Result<UniformBody> {
    let seed = kmeans::block_seed(p.seed, block_index);
    let skeleton = kmeans::apply(&mut coeffs, n, d_eff, w, p, seed);
    let wl = padded_len(d_eff);
    let rot = Rotation::new(wl, p.seed);
    let cb = codebook(p)?;
    let mut codes = Vec::with_capacity(n * wl);
    let mut scales = Vec::with_capacity(n);
    let mut outl = Vec::new();
    let mut u = vec![0.0f32; wl];
    let mut vhat = vec![0.0f32; wl];
    for i in 0..n {
        u.fill(0.0);
        u[..d_eff].copy_from_slice(&coeffs[i * d_eff..(i + 1) * d_eff]);
        rot.forward(&mut u);
        let norm2 = dot(&u, &u);
        let s0 = (norm2 / wl as f32).sqrt();
        if s0 <= 0.0 || s0.is_nan() {
            let zero = cb.quantize(0.0);
            codes.extend(std::iter::repeat_n(zero, wl));
            scales.push(f16::ZERO);
            continue;
        }
        for (vh, v) in vhat.iter_mut().zip(u.iter_mut()) {
            *v /= s0;
            let q = cb.quantize(*v);
            codes.push(q);
            *vh = cb.level(q);
        }
        let first = outl.len();
        outliers::collect(&u, p.outlier_threshold, (i * wl) as u32, &mut outl);
        for (pos, val) in &outl[first..] {
            vhat[*pos as usize - i * wl] = val.to_f32();
        }
        let uv = dot(&u, &vhat);
        let vv = dot(&vhat, &vhat);
        let s = match p.metric {
            Metric::Mse if vv > 0.0 => s0 * uv / vv,
            Metric::InnerProduct if uv > 0.0 => s0 * dot(&u, &u) / uv,
            _ => s0,
        };
        scales.push(f16::from_f32(s.clamp(-MAX_MAGNITUDE, MAX_MAGNITUDE)));
    }
    Ok(UniformBody {
        skeleton,
        scales,
        codes,
        outliers: outl,
    })
}

/// The `n x d_eff` coefficients of a body.
pub fn decode(b: &UniformBody, n: usize, d_eff: usize, p: &CodecParams) -> Result<Vec<f32>> {
    let wl = padded_len(d_eff);
    let rot = Rotation::new(wl, p.seed);
    let cb = codebook(p)?;
    let mut coeffs = vec![0.0f32; n * d_eff];
    let mut v = vec![0.0f32; wl];
    let mut next_outlier = 0;
    for i in 0..n {
        let s = b.scales[i].to_f32();
        for (vj, &q) in v.iter_mut().zip(&b.codes[i * wl..(i + 1) * wl]) {
            *vj = cb.level(q);
        }
        while next_outlier < b.outliers.len()
            && (b.outliers[next_outlier].0 as usize) < (i + 1) * wl
        {
            let (pos, val) = b.outliers[next_outlier];
            v[pos as usize - i * wl] = val.to_f32();
            next_outlier += 1;
        }
        v.iter_mut().for_each(|x| *x *= s);
        rot.inverse(&mut v);
        let c = &mut coeffs[i * d_eff..(i + 1) * d_eff];
        c.copy_from_slice(&v[..d_eff]);
        b.skeleton.add_back(i, c);
    }
    Ok(coeffs)
}

#[cfg(test)]
mod tests {
    use crate::params::{CodecParams, Metric};
    use crate::stages::rel_err;
    use crate::test_data::{edited, kv_like, normal_samples, params, roundtrip};

    #[test]
    fn error_falls_with_bit_width() {
        let (n, d) = (700, 64);
        let x = kv_like(n, d, 1);
        let mut last = f64::INFINITY;
        for bits in [1u8, 2, 3, 4, 8] {
            let p = params(|p| p.bit_width = bits);
            let (y, enc) = roundtrip(&x, n, d, &p);
            let e = rel_err(&x, &y);
            assert!(e < last, "{bits} bits: {e} not below {last}");
            assert_eq!(enc.nbytes(), enc.as_bytes().len());
            last = e;
        }
        assert!(last < 0.01, "8-bit error {last}");
    }

    #[test]
    fn four_bit_full_rank_error_matches_lloyd_max_theory() {
        // With d_eff = D the only loss is quantisation: relative error ~ sqrt(0.0095) of the
        // residual energy (below 0.1 of the total, since the mean carries energy too).
        let (n, d) = (512, 64);
        let x = kv_like(n, d, 2);
        let p = params(|p| (p.bit_width, p.k) = (4, 0));
        let (y, _) = roundtrip(&x, n, d, &p);
        let e = rel_err(&x, &y);
        assert!(e < 0.1, "relative error {e}");
    }

    #[test]
    fn inner_product_metric_preserves_norms_better() {
        // MSE scales shrink reconstructions; the inner-product scale removes that bias.
        let (n, d) = (512, 64);
        let x = kv_like(n, d, 8);
        let bias = |metric| {
            let p = CodecParams {
                bit_width: 2,
                k: 0,
                metric,
                ..Default::default()
            };
            let (y, _) = roundtrip(&x, n, d, &p);
            let xy: f64 = x.iter().zip(&y).map(|(a, b)| (a * b) as f64).sum();
            let xx: f64 = x.iter().map(|a| (a * a) as f64).sum();
            (xy / xx - 1.0).abs()
        };
        assert!(bias(Metric::InnerProduct) < bias(Metric::Mse));
    }

    #[test]
    fn outliers_are_restored_exactly() {
        // Isotropic data: rotated coordinates are close to N(0, 1), so a low threshold flags
        // a few percent of them, and storing those exactly must lower the error.
        let (n, d) = (256, 16);
        let x = normal_samples(n * d, 9, 9);
        let with = params(|p| (p.outlier_threshold, p.k, p.bit_width) = (1.5, 0, 2));
        let without = edited(&with, |p| p.outlier_threshold = f32::INFINITY);
        let (yw, ew) = roundtrip(&x, n, d, &with);
        let (yo, eo) = roundtrip(&x, n, d, &without);
        let count = ew.stats()[0].n_outliers;
        assert!(count > n * d / 50, "{count} outliers");
        assert_eq!(
            ew.nbytes() - eo.nbytes(),
            count * crate::outliers::OUTLIER_BYTES
        );
        assert!(rel_err(&x, &yw) < 0.9 * rel_err(&x, &yo));
    }
}
