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

fn dot(a: &[f32], b: &[f32]) -> f32 {
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
        let w = vec![1.0 / n as f64; n];
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
        let mut g = SplitMix64::new(3, 3);
        let x: Vec<f32> = (0..n * d).map(|_| g.normal() as f32).collect();
        let w = vec![1.0 / n as f64; n];
        let one = fit(&x, n, d, 4, 1, &w, 5);
        let many = fit(&x, n, d, 4, 30, &w, 5);
        assert!(captured(&x, n, d, &many) >= captured(&x, n, d, &one) * 0.999);
    }
}
