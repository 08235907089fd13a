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
//! The budget is `bits_per_value * D` bits per vector. Scaled coefficients beyond the
//! outlier threshold are stored exactly in f16 ([`crate::outliers`]). Decoding is
//! `c_hat_j = g_{b_j} s_j Q^-1(q_j)` with the inner-product gain `g` ([`ip_gain`]) for
//! `Metric::InnerProduct` and 1 otherwise; components with `b_j = 0` decode to 0. The
//! decoder reads the codes straight from the wire, a table lookup per few components
//! ([`decode_into`], in `waterfill/decode.rs`).

use half::f16;

use crate::lloyd_max::{gaussian_distortion, Codebook};
use crate::outliers;
use crate::params::{CodecParams, MAX_MAGNITUDE};

mod books;
mod decode;
#[cfg(target_arch = "x86_64")]
mod gather;
#[cfg(target_arch = "x86_64")]
mod sums;

pub(crate) use books::book;
pub use books::{ip_gain, MAX_COMPONENT_BITS};
pub use decode::{decode_into, decode_mapped, weighted_sums, weighted_sums_rows, WaterfillCodes};

/// Greedy integer water-filling of `total_bits` over components with `variances`.
pub fn allocate(variances: &[f32], total_bits: usize) -> Vec<u8> {
    let mut bits = vec![0u8; variances.len()];
    // What the next bit of each component removes; 0 once it is full (never picked).
    let next_gain = |v: f32, b: u8| {
        if b >= MAX_COMPONENT_BITS {
            0.0
        } else {
            v as f64 * (gaussian_distortion(b) - gaussian_distortion(b + 1))
        }
    };
    let mut gains: Vec<f64> = variances.iter().map(|&v| next_gain(v, 0)).collect();
    let cap = total_bits.min(variances.len() * MAX_COMPONENT_BITS as usize);
    for _ in 0..cap {
        // The first of the largest gains, as a scan in order finds it.
        let mut best = None;
        let mut best_gain = 0.0f64;
        for (j, &g) in gains.iter().enumerate() {
            if g > best_gain {
                best_gain = g;
                best = Some(j);
            }
        }
        let Some(j) = best else {
            break; // every remaining component has zero variance
        };
        bits[j] += 1;
        gains[j] = next_gain(variances[j], bits[j]);
    }
    bits
}

/// Widths of the codes one vector stores: the non-zero entries of `bits`, in order (the
/// writer and the reader both walk a vector's codes with these).
pub fn coded_widths(bits: &[u8]) -> Vec<u32> {
    bits.iter().filter(|&&b| b > 0).map(|&b| b as u32).collect()
}

/// A water-filled block body, codes unpacked (the wire form packs them).
#[derive(Debug, Clone, PartialEq)]
pub struct WaterfillBody {
    /// Per-component scale `s_j`.
    pub sigma: Vec<f16>,
    /// Bits per component `b_j`, 0..=8.
    pub comp_bits: Vec<u8>,
    /// For each vector, one code per component with `b_j > 0`.
    pub codes: Vec<u16>,
    /// `(position i * d_eff + j, value)` of exactly stored scaled coefficients, ascending.
    pub outliers: Vec<(u32, f16)>,
}

/// The stored scale of a component of variance `var`: its square root, bounded, rounded to
/// f16 through f32. (`half`'s `f16::from_f64` rounds through f32 where the CPU has F16C and
/// once elsewhere, so the same input gave other bytes on other machines; an encoder outside
/// the codec, `device_encode.py`, rounds as this does.)
fn scale_of(var: f64) -> f16 {
    f16::from_f32(var.sqrt().min(MAX_MAGNITUDE as f64) as f32)
}

/// Codes `n` coefficient rows of length `d_eff` (weights `w`, input length `d`).
pub fn encode(
    coeffs: &[f32],
    n: usize,
    d_eff: usize,
    d: usize,
    w: &[f64],
    p: &CodecParams,
) -> WaterfillBody {
    let mut var = vec![0.0f64; d_eff];
    for (i, row) in coeffs.chunks_exact(d_eff).enumerate() {
        for (v, &c) in var.iter_mut().zip(row) {
            *v += w[i] * (c as f64) * (c as f64);
        }
    }
    let sigma: Vec<f16> = var.iter().map(|&v| scale_of(v)).collect();
    let sig: Vec<f32> = sigma.iter().map(|s| s.to_f32()).collect();
    let budget = (p.bits_per_value as f64 * d as f64).round() as usize;
    let comp_bits = allocate(&sig.iter().map(|s| s * s).collect::<Vec<_>>(), budget);
    // The coded components with their codebooks, in order: one code each per vector.
    let coded: Vec<(usize, &Codebook)> = comp_bits
        .iter()
        .enumerate()
        .filter(|&(_, &b)| b > 0)
        .map(|(j, &b)| (j, book(b)))
        .collect();
    let divisor: Vec<f32> = sig.iter().map(|&s| if s > 0.0 { s } else { 1.0 }).collect();
    let mut codes = Vec::with_capacity(n * coded.len());
    let mut outl = Vec::new();
    let mut z = vec![0.0f32; d_eff];
    for (i, row) in coeffs.chunks_exact(d_eff).enumerate() {
        // Bounded so that outliers stay finite in f16 (tokens of weight zero do not shape
        // sigma and may sit far outside it). Dividing by 1 where sigma is 0 and selecting
        // after keeps the loop free of branches, so it runs in vector lanes.
        for (((zj, &c), &s), &div) in z.iter_mut().zip(row).zip(&sig).zip(&divisor) {
            let q = (c / div).clamp(-MAX_MAGNITUDE, MAX_MAGNITUDE);
            *zj = if s > 0.0 { q } else { 0.0 };
        }
        codes.extend(coded.iter().map(|&(j, cb)| cb.quantize(z[j])));
        outliers::collect(&z, p.outlier_threshold, (i * d_eff) as u32, &mut outl);
    }
    WaterfillBody {
        sigma,
        comp_bits,
        codes,
        outliers: outl,
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::codec::{decode_layer, encode_layer_with, EncodedLayer};
    use crate::params::{InputDtype, Metric, PcaMethod};
    use crate::stages::rel_err;
    use crate::test_data::{
        assert_corruptions_are_safe, edited, encode_f32, kv_like, params, roundtrip, waterfill,
    };

    #[test]
    fn scales_round_through_f32_on_every_machine() {
        // Just past the f16 midpoint 1 + 2^-11 by less than f32 resolves: rounded once it is
        // 1 + 2^-10, through f32 it lands on the midpoint and then on the even 1.0.
        let root = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
        assert_eq!(scale_of(root * root), f16::ONE);
        assert_eq!(scale_of(9.0), f16::from_f32(3.0));
        assert_eq!(scale_of(1e12), f16::from_f32(MAX_MAGNITUDE));
    }

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

    #[test]
    fn waterfill_error_falls_with_budget_and_beats_uniform_at_equal_bytes() {
        let (n, d) = (1024, 64);
        let x = kv_like(n, d, 13);
        let mut last = f64::INFINITY;
        for bpv in [0.5f32, 1.0, 2.0, 3.0, 4.0] {
            let (y, enc) = roundtrip(&x, n, d, &waterfill(bpv));
            let e = rel_err(&x, &y);
            assert!(e < last, "{bpv} bits: {e}");
            last = e;
            let s = &enc.stats()[0];
            assert_eq!(s.d_eff, d);
        }
        // Same budget of code bits per vector (2 * 64): water-filling wins on a decaying spectrum.
        let uniform = params(|p| (p.bit_width, p.k) = (2, 0));
        let (yu, eu) = roundtrip(&x, n, d, &uniform);
        let (yw, ew) = roundtrip(&x, n, d, &waterfill(2.0));
        assert!(ew.nbytes() <= eu.nbytes());
        assert!(
            rel_err(&x, &yw) < 0.8 * rel_err(&x, &yu),
            "{} vs {}",
            rel_err(&x, &yw),
            rel_err(&x, &yu)
        );
    }

    #[test]
    fn waterfill_bytes_are_accounted_exactly() {
        let (n, d) = (300, 16);
        let x = kv_like(n, d, 14);
        let p = edited(&waterfill(1.5), |p| {
            (p.outlier_threshold, p.pca_method) = (f32::INFINITY, PcaMethod::None)
        });
        let enc = encode_f32(&x, n, d, &p);
        // header + block header + mean (16 f16) + sigma (16 f16) + 16 nibbles + codes + crc;
        // 1.5 bits/value * 16 = 24 bits per vector.
        let want = crate::format::HEADER_LEN + 20 + 32 + 32 + 8 + (300 * 24usize).div_ceil(8) + 4;
        assert_eq!(enc.nbytes(), want);
    }

    #[test]
    fn inner_product_waterfill_removes_shrinkage() {
        let (n, d) = (1024, 32);
        let x = kv_like(n, d, 15);
        let bias = |metric| {
            let (y, _) = roundtrip(
                &x,
                n,
                d,
                &CodecParams {
                    metric,
                    ..waterfill(1.0)
                },
            );
            let mean: Vec<f64> = (0..d)
                .map(|j| (0..n).map(|i| x[i * d + j] as f64).sum::<f64>() / n as f64)
                .collect();
            let (mut xy, mut xx) = (0.0, 0.0);
            for i in 0..n {
                for j in 0..d {
                    let (a, b) = (x[i * d + j] as f64 - mean[j], y[i * d + j] as f64 - mean[j]);
                    xy += a * b;
                    xx += a * a;
                }
            }
            (xy / xx - 1.0).abs()
        };
        assert!(bias(Metric::InnerProduct) < bias(Metric::Mse));
    }

    #[test]
    fn corrupt_waterfill_bytes_never_panic() {
        let (n, d) = (300, 16);
        let x = kv_like(n, d, 17);
        let fit = crate::pca::fit_exact(&x, n, d, None, 1.0, d).unwrap();
        let basis = crate::basis::ExternalBasis::new(fit.basis, d, d).unwrap();
        let p = edited(&waterfill(1.7), |p| {
            (p.block_size, p.outlier_threshold) = (128, 2.5)
        });
        let identity = edited(&p, |p| p.pca_method = PcaMethod::None);
        for (ext, p) in [(None, &p), (Some(&basis), &p), (None, &identity)] {
            let enc = encode_layer_with(&x, n, d, None, p, InputDtype::F32, ext).unwrap();
            assert_corruptions_are_safe(enc.as_bytes(), ext, 3);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        #[test]
        fn waterfill_roundtrip_is_bounded(
            n in 1usize..80, d in 1usize..24, bpv in 0.25f32..6.0, seed in any::<u64>(),
            none in any::<bool>(),
        ) {
            let x = kv_like(n, d, seed);
            let pca_method = if none { PcaMethod::None } else { PcaMethod::Exact };
            let p = CodecParams { block_size: 32, seed, pca_method, ..waterfill(bpv) };
            let enc = encode_f32(&x, n, d, &p);
            let y = decode_layer(&enc).unwrap();
            let back = EncodedLayer::from_bytes(enc.as_bytes().to_vec()).unwrap();
            prop_assert_eq!(decode_layer(&back).unwrap(), y.clone());
            // Below one bit per value some components get no bits: error <= the signal itself.
            prop_assert!(rel_err(&x, &y) < 1.0);
            prop_assert!(y.iter().all(|v| v.is_finite()));
        }
    }
}
