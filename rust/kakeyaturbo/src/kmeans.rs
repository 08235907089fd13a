//! Spherical k-means "skeleton" over PCA coefficient vectors.
//!
//! Each coefficient vector `c_i` is approximated by `t_i * mu_{a_i}`, a signed multiple of
//! one of `k` unit centres; the codec then codes only the residual `c_i - t_i mu_{a_i}`.
//! For a fixed assignment the best `t_i` is `<c_i, mu>` and the captured energy is
//! `sum_i <c_i, mu>^2`, so:
//! - assignment: `a_i = argmax_j |<c_i, mu_j>|` (sign folded into `t_i`, so antipodal
//!   vectors share a centre);
//! - update: `mu_j` is the top eigenvector of `sum_{i in j} w_i c_i c_i^T`; one power step
//!   per Lloyd iteration, started from the current centre, never decreases the objective.
//!
//! Initialisation is k-means++ (Arthur & Vassilvitskii 2007) on the sphere, with distance
//! `1 - cos^2`, seeded for reproducibility.
//!
//! Applying the skeleton to a block ([`apply`]) rounds the centres to the skeleton dtype
//! *before* use, stores `t_i = <c_i, mu_{a_i}> / |mu_{a_i}|^2` rounded to f16 (the rounded
//! centres are unit only approximately) and leaves the residual `r_i = c_i - t_i mu_{a_i}`
//! in place; decoding adds `t_i mu_{a_i}` back ([`SkeletonCodes::add_back`]).

use half::f16;

use crate::params::{CodecParams, MAX_MAGNITUDE};
use crate::rng::SplitMix64;

const KMEANS_STREAM: u64 = 0x4B4D_4541; // "KMEA"

/// The fitted skeleton of one block.
#[derive(Debug, Clone, PartialEq)]
pub struct Skeleton {
    /// Unit centres, `k_used x d`, row-major.
    pub centres: Vec<f32>,
    /// Number of centres actually used (`<= k`; fewer when few vectors are non-zero).
    pub k_used: usize,
    /// Lloyd iterations run before the assignment stopped changing (or the limit).
    pub iters: usize,
}

/// A block's skeleton as stored: rounded centres, and per vector a centre id and `t`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SkeletonCodes {
    /// `k_used x d_eff` unit centres, rounded to the skeleton dtype.
    pub centres: Vec<f32>,
    /// Centres stored (0: no skeleton).
    pub k_used: usize,
    /// k-means iterations run (statistics only).
    pub iters: u32,
    /// Centre id per vector (empty when `k_used == 0`).
    pub labels: Vec<u16>,
    /// Skeleton coefficient per vector (empty when `k_used == 0`).
    pub t: Vec<f16>,
}

impl SkeletonCodes {
    /// Adds `t_i mu_{a_i}` back to the residual `c` of vector `i` (length `d_eff`).
    pub fn add_back(&self, i: usize, c: &mut [f32]) {
        if self.k_used == 0 {
            return;
        }
        let d_eff = c.len();
        let a = self.labels[i] as usize;
        let t = self.t[i].to_f32();
        for (cj, &m) in c.iter_mut().zip(&self.centres[a * d_eff..(a + 1) * d_eff]) {
            *cj += t * m;
        }
    }
}

/// Bits per centre label: 0 for at most one centre.
pub fn label_bits(k_used: usize) -> u32 {
    if k_used <= 1 {
        0
    } else {
        usize::BITS - (k_used - 1).leading_zeros()
    }
}

/// The k-means seed of block `block_index`: blocks draw independent initialisations.
pub fn block_seed(seed: u64, block_index: usize) -> u64 {
    seed ^ (block_index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Fits the skeleton of `n` coefficient rows (length `d_eff`, weights `w`), stores it and
/// turns `coeffs` into the residuals. `p.k == 0` stores nothing and leaves `coeffs` as is.
pub fn apply(
    coeffs: &mut [f32],
    n: usize,
    d_eff: usize,
    w: &[f64],
    p: &CodecParams,
    seed: u64,
) -> SkeletonCodes {
    if p.k == 0 {
        return SkeletonCodes::default();
    }
    let sk = fit(coeffs, n, d_eff, p.k, p.kmeans_iters, w, seed);
    let mut centres = sk.centres;
    p.skeleton_dtype.round_all(&mut centres);
    let mut codes = SkeletonCodes {
        centres,
        k_used: sk.k_used,
        iters: sk.iters as u32,
        labels: Vec::new(),
        t: Vec::new(),
    };
    if sk.k_used == 0 {
        return codes;
    }
    codes.labels.reserve(n);
    codes.t.reserve(n);
    let assigned = assign_all(coeffs, n, d_eff, &codes.centres, sk.k_used);
    for (c, &a) in coeffs.chunks_exact_mut(d_eff).zip(&assigned) {
        let mu = &codes.centres[a * d_eff..(a + 1) * d_eff];
        // Centres were rounded, so |mu| is 1 only approximately: project exactly.
        let t = f16::from_f32(
            (dot(c, mu) / dot(mu, mu).max(f32::MIN_POSITIVE)).clamp(-MAX_MAGNITUDE, MAX_MAGNITUDE),
        );
        let tf = t.to_f32();
        for (v, &m) in c.iter_mut().zip(mu) {
            *v -= tf * m;
        }
        codes.labels.push(a as u16);
        codes.t.push(t);
    }
    codes
}

/// `<a, b>` in f32.
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn normalise(v: &mut [f32]) -> bool {
    let n = dot(v, v).sqrt();
    if n > 0.0 && n.is_finite() {
        v.iter_mut().for_each(|x| *x /= n);
        true
    } else {
        false
    }
}

/// Index of the centre with the largest `|<c, mu>|` (first on ties).
pub fn assign(c: &[f32], centres: &[f32], d: usize) -> usize {
    let mut best = 0;
    let mut best_v = -1.0f32;
    for (j, mu) in centres.chunks_exact(d).enumerate() {
        let v = dot(c, mu).abs();
        if v > best_v {
            best_v = v;
            best = j;
        }
    }
    best
}

/// `assign` for every row at once: the `n x k` score matrix is one matrix product.
pub fn assign_all(coeffs: &[f32], n: usize, d: usize, centres: &[f32], k: usize) -> Vec<usize> {
    if k == 0 {
        return vec![0; n];
    }
    // scores^T (k x n) = M (k x d, column-major copy) * C^T (the row-major rows, read as d x n).
    let m = nalgebra::DMatrix::from_row_slice(k, d, &centres[..k * d]);
    let ct = nalgebra::DMatrixView::from_slice(&coeffs[..n * d], d, n);
    let scores = m * ct;
    scores
        .column_iter()
        .map(|col| {
            let mut best = 0;
            let mut best_v = -1.0f32;
            for (j, &v) in col.iter().enumerate() {
                if v.abs() > best_v {
                    best_v = v.abs();
                    best = j;
                }
            }
            best
        })
        .collect()
}

/// Fits up to `k` centres to `n` coefficient rows of length `d` with weights `w`.
pub fn fit(
    coeffs: &[f32],
    n: usize,
    d: usize,
    k: usize,
    max_iters: usize,
    w: &[f64],
    seed: u64,
) -> Skeleton {
    let dirs: Vec<usize> = (0..n)
        .filter(|&i| dot(&coeffs[i * d..(i + 1) * d], &coeffs[i * d..(i + 1) * d]) > 0.0)
        .collect();
    let k = k.min(dirs.len());
    if k == 0 {
        return Skeleton {
            centres: Vec::new(),
            k_used: 0,
            iters: 0,
        };
    }
    let unit: Vec<Vec<f32>> = dirs
        .iter()
        .map(|&i| {
            let mut v = coeffs[i * d..(i + 1) * d].to_vec();
            normalise(&mut v);
            v
        })
        .collect();

    // k-means++ seeding with distance 1 - cos^2 weighted by the vector's energy.
    let mut g = SplitMix64::new(seed, KMEANS_STREAM);
    let energy: Vec<f64> = dirs
        .iter()
        .map(|&i| w[i] * dot(&coeffs[i * d..(i + 1) * d], &coeffs[i * d..(i + 1) * d]) as f64)
        .collect();
    let mut centres: Vec<f32> = Vec::with_capacity(k * d);
    let first = pick(&energy, &mut g).unwrap_or(0);
    centres.extend_from_slice(&unit[first]);
    let mut dist: Vec<f64> = unit
        .iter()
        .map(|u| 1.0 - (dot(u, &centres[..d]) as f64).powi(2))
        .collect();
    while centres.len() < k * d {
        let score: Vec<f64> = dist
            .iter()
            .zip(&energy)
            .map(|(a, e)| a.max(0.0) * e)
            .collect();
        let Some(next) = pick(&score, &mut g) else {
            break;
        };
        let start = centres.len();
        centres.extend_from_slice(&unit[next]);
        for (dv, u) in dist.iter_mut().zip(&unit) {
            *dv = dv.min(1.0 - (dot(u, &centres[start..start + d]) as f64).powi(2));
        }
    }
    let k_used = centres.len() / d;

    let mut labels = vec![usize::MAX; dirs.len()];
    let mut iters = 0;
    for _ in 0..max_iters {
        iters += 1;
        let mut changed = false;
        let best = assign_all(coeffs, n, d, &centres, k_used);
        for (li, &i) in dirs.iter().enumerate() {
            if best[i] != labels[li] {
                labels[li] = best[i];
                changed = true;
            }
        }
        if !changed {
            break;
        }
        // One power step per centre on its cluster's weighted scatter matrix.
        let mut acc = vec![0.0f32; k_used * d];
        for (li, &i) in dirs.iter().enumerate() {
            let j = labels[li];
            let c = &coeffs[i * d..(i + 1) * d];
            let proj = w[i] as f32 * dot(c, &centres[j * d..(j + 1) * d]);
            for (a, &v) in acc[j * d..(j + 1) * d].iter_mut().zip(c) {
                *a += proj * v;
            }
        }
        for j in 0..k_used {
            let row = &mut acc[j * d..(j + 1) * d];
            if normalise(row) {
                centres[j * d..(j + 1) * d].copy_from_slice(row);
            }
        }
    }
    Skeleton {
        centres,
        k_used,
        iters,
    }
}

/// Index drawn with probability proportional to `weights` (None if all are zero).
fn pick(weights: &[f64], g: &mut SplitMix64) -> Option<usize> {
    let total: f64 = weights.iter().sum();
    if total.is_nan() || total <= 0.0 {
        return None;
    }
    let mut r = g.next_f64() * total;
    for (i, &v) in weights.iter().enumerate() {
        if r < v {
            return Some(i);
        }
        r -= v;
    }
    weights.iter().rposition(|&v| v > 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_data::{normal_samples, params, uniform_weights};

    fn captured(coeffs: &[f32], n: usize, d: usize, sk: &Skeleton) -> f64 {
        (0..n)
            .map(|i| {
                let c = &coeffs[i * d..(i + 1) * d];
                let j = assign(c, &sk.centres, d);
                (dot(c, &sk.centres[j * d..(j + 1) * d]) as f64).powi(2)
            })
            .sum()
    }

    #[test]
    fn recovers_planted_directions_with_signs() {
        let (n, d) = (200, 8);
        let mut g = SplitMix64::new(1, 1);
        let mut x = vec![0.0f32; n * d];
        for i in 0..n {
            let axis = i % 2; // two planted directions, random signs and lengths
            let t = (g.normal() * 3.0) as f32;
            x[i * d + axis] = t;
            for c in 0..d {
                x[i * d + c] += 0.01 * g.normal() as f32;
            }
        }
        let w = uniform_weights(n);
        let sk = fit(&x, n, d, 2, 20, &w, 7);
        assert_eq!(sk.k_used, 2);
        let total: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum();
        assert!(captured(&x, n, d, &sk) > 0.99 * total);
    }

    #[test]
    fn zero_vectors_and_small_blocks() {
        let w = vec![0.5, 0.5];
        let sk = fit(&[0.0; 8], 2, 4, 3, 5, &w, 0);
        assert_eq!(sk.k_used, 0);
        let sk = fit(&[1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], 2, 4, 3, 5, &w, 0);
        assert_eq!(sk.k_used, 1);
    }

    #[test]
    fn more_iterations_never_capture_less() {
        let (n, d) = (300, 6);
        let x = normal_samples(n * d, 3, 3);
        let w = uniform_weights(n);
        let one = fit(&x, n, d, 4, 1, &w, 5);
        let many = fit(&x, n, d, 4, 30, &w, 5);
        assert!(captured(&x, n, d, &many) >= captured(&x, n, d, &one) * 0.999);
    }

    #[test]
    fn label_bits_cover_every_centre() {
        let want = [
            (0, 0),
            (1, 0),
            (2, 1),
            (3, 2),
            (4, 2),
            (16, 4),
            (17, 5),
            (4096, 12),
        ];
        for (k, bits) in want {
            assert_eq!(label_bits(k), bits, "k = {k}");
        }
    }

    #[test]
    fn apply_then_add_back_restores_the_coefficients() {
        let (n, d) = (64, 6);
        let x = normal_samples(n * d, 4, 4);
        let w = uniform_weights(n);
        let p = params(|p| p.k = 4);
        let mut r = x.clone();
        let sk = apply(&mut r, n, d, &w, &p, block_seed(p.seed, 3));
        assert_eq!((sk.k_used, sk.labels.len(), sk.t.len()), (4, n, n));
        let removed: f64 = r.iter().map(|&v| (v as f64).powi(2)).sum();
        let total: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum();
        assert!(removed < total);
        for (i, c) in r.chunks_exact_mut(d).enumerate() {
            sk.add_back(i, c);
        }
        let err = x
            .iter()
            .zip(&r)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(err < 1e-5, "{err}");
        let none = params(|p| p.k = 0);
        let mut same = x.clone();
        assert_eq!(
            apply(&mut same, n, d, &w, &none, 0),
            SkeletonCodes::default()
        );
        assert_eq!(same, x);
    }
}
