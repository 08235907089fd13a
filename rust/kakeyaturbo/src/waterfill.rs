//! Transform coding with reverse water-filling (the `allocation = Waterfill` path).
//!
//! After the decorrelating PCA the coefficients `c_j` have very different variances
//! `s_j^2`. For independent Gaussian components at a total rate of `B` bits, the optimal
//! allocation is reverse water-filling: `b_j = max(0, 1/2 log2(s_j^2 / theta))`, with
//! components below the water level `theta` getting no bits at all (Cover & Thomas,
//! Thm. 10.3.3). With integer bits and real Lloyd-Max quantisers the same idea is done
//! greedily: each next bit goes where it removes the most distortion,
//! `s_j^2 (D(b_j) - D(b_j + 1))`, with `D` the Gaussian Lloyd-Max distortion table.
//! This spends fewer bits than truncating at a variance ratio and coding every kept
//! coordinate alike, and it never throws a component away that is worth a bit.
//!
//! Each coded coefficient is quantised as `Q_{b_j}(c_j / s_j)`; `s_j` (fp16) and `b_j`
//! (4 bits) are stored per block, so the allocation follows the block's own statistics.

use crate::lloyd_max::gaussian_distortion;

/// Largest number of bits one component may take.
pub const MAX_COMPONENT_BITS: u8 = 8;

/// Greedy integer water-filling of `total_bits` over components with `variances`.
pub fn allocate(variances: &[f32], total_bits: usize) -> Vec<u8> {
    let mut bits = vec![0u8; variances.len()];
    let cap = total_bits.min(variances.len() * MAX_COMPONENT_BITS as usize);
    for _ in 0..cap {
        let mut best = None;
        let mut best_gain = 0.0f64;
        for (j, (&v, &b)) in variances.iter().zip(&bits).enumerate() {
            if b >= MAX_COMPONENT_BITS {
                continue;
            }
            let gain = v as f64 * (gaussian_distortion(b) - gaussian_distortion(b + 1));
            if gain > best_gain {
                best_gain = gain;
                best = Some(j);
            }
        }
        match best {
            Some(j) => bits[j] += 1,
            None => break, // every remaining component has zero variance
        }
    }
    bits
}

/// Widths of the codes one vector stores: the non-zero entries of `bits`, in order (the
/// writer and the reader both walk a vector's codes with these).
pub fn coded_widths(bits: &[u8]) -> Vec<u32> {
    bits.iter().filter(|&&b| b > 0).map(|&b| b as u32).collect()
}

/// Per-bit-width reconstruction gain: 1 for MSE; `1 / (1 - D(b))` for inner products,
/// which undoes the Lloyd-Max shrinkage `E[x x_hat] = (1 - D) E[x^2]` so that
/// `E[<x_hat, x>] = E[|x|^2]` component by component.
pub fn ip_gain(bits: u8) -> f32 {
    if bits == 0 {
        1.0
    } else {
        (1.0 / (1.0 - gaussian_distortion(bits))) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn high_variance_components_get_more_bits() {
        let v = [16.0f32, 4.0, 1.0, 0.25, 0.0];
        let b = allocate(&v, 8);
        assert_eq!(b.iter().map(|&x| x as usize).sum::<usize>(), 8);
        assert!(b.windows(2).all(|w| w[0] >= w[1]), "{b:?}");
        assert_eq!(b[4], 0);
        // Each factor 4 in variance is worth about one bit.
        assert!(b[0] - b[2] >= 1);
    }

    #[test]
    fn equal_variances_share_bits_evenly_and_caps_hold() {
        let b = allocate(&[1.0; 8], 16);
        assert!(b.iter().all(|&x| x == 2), "{b:?}");
        let b = allocate(&[1.0, 0.0], 100);
        assert_eq!(b, vec![MAX_COMPONENT_BITS, 0]);
    }

    #[test]
    fn allocation_beats_uniform_on_decaying_spectrum() {
        let v: Vec<f32> = (0..64).map(|j| (-(j as f32) / 8.0).exp()).collect();
        let d = |bits: &[u8]| -> f64 {
            v.iter()
                .zip(bits)
                .map(|(&s, &b)| s as f64 * gaussian_distortion(b))
                .sum()
        };
        let wf = allocate(&v, 128);
        let uniform = vec![2u8; 64];
        assert!(d(&wf) < 0.5 * d(&uniform), "{} vs {}", d(&wf), d(&uniform));
    }
}
