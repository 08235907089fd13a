//! Lloyd-Max scalar quantisation (Lloyd 1957/1982, Max 1960).
//!
//! For a density `p`, the MSE-optimal `L`-level quantiser satisfies two conditions:
//! every decision boundary is the midpoint of its neighbouring levels, and every level is
//! the conditional mean of `p` over its cell. Alternating the two (Lloyd's method I)
//! converges for log-concave densities such as the Gaussian. For N(0, 1) the cell moments
//! have closed forms in `phi` and `Phi`, so the Gaussian codebooks are computed exactly
//! (no sampling) the first time they are needed. Published optimum distortions
//! (Max 1960): 1 bit 0.3634, 2 bits 0.1175, 3 bits 0.03454, 4 bits 0.009497.
//!
//! [`Codebook::fit`] runs the same iteration on samples, for calibrated codebooks.

use std::sync::OnceLock;

use crate::error::{Error, Result};

/// Codebooks with at most this many decision bounds (a 4-bit book has 15) quantise by
/// counting the bounds below a value, not by searching them.
const SMALL_BOUNDS: usize = 16;

const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

fn phi(x: f64) -> f64 {
    if x.is_infinite() {
        0.0
    } else {
        // libm, not std: the same bits on every platform (golden files depend on it).
        INV_SQRT_2PI * libm::exp(-0.5 * x * x)
    }
}

fn big_phi(x: f64) -> f64 {
    0.5 * libm::erfc(-x / std::f64::consts::SQRT_2)
}

/// `x * phi(x)`, zero at ±inf.
fn x_phi(x: f64) -> f64 {
    if x.is_infinite() {
        0.0
    } else {
        x * phi(x)
    }
}

/// A sorted set of reconstruction levels and the midpoints between them.
#[derive(Debug, Clone, PartialEq)]
pub struct Codebook {
    levels: Vec<f32>,
    bounds: Vec<f32>,
    /// `bounds` padded with +inf to a fixed length when they fit (else `None`).
    small: Option<[f32; SMALL_BOUNDS]>,
}

impl Codebook {
    /// A codebook from strictly ascending, finite levels (at least 2, at most 65536).
    pub fn from_levels(levels: Vec<f32>) -> Result<Self> {
        if levels.len() < 2 || levels.len() > 1 << 16 {
            return Err(Error::InvalidParams(format!(
                "a codebook needs 2..=65536 levels, got {}",
                levels.len()
            )));
        }
        if levels.iter().any(|v| !v.is_finite()) || levels.windows(2).any(|w| w[0] >= w[1]) {
            return Err(Error::InvalidParams(
                "codebook levels must be finite and strictly ascending".into(),
            ));
        }
        let bounds: Vec<f32> = levels.windows(2).map(|w| 0.5 * (w[0] + w[1])).collect();
        let small = (bounds.len() <= SMALL_BOUNDS).then(|| {
            let mut padded = [f32::INFINITY; SMALL_BOUNDS];
            padded[..bounds.len()].copy_from_slice(&bounds);
            padded
        });
        Ok(Codebook {
            levels,
            bounds,
            small,
        })
    }

    /// The levels, ascending.
    pub fn levels(&self) -> &[f32] {
        &self.levels
    }

    /// Index of the nearest level (ties go up).
    #[inline]
    pub fn quantize(&self, v: f32) -> u16 {
        match &self.small {
            // Counting the bounds at or below `v` over a fixed length compiles to a few
            // vector compares: a binary search over a few bounds mispredicts on every value.
            // (The +inf padding never counts: inputs are finite.)
            Some(b) => b.iter().map(|&b| u16::from(b <= v)).sum(),
            None => self.bounds.partition_point(|&b| b <= v) as u16,
        }
    }

    /// The level of an index; indices are validated by the caller (the codec only
    /// produces indices below `levels().len()`, and the decoder checks bit widths).
    #[inline]
    pub fn level(&self, idx: u16) -> f32 {
        self.levels[idx as usize]
    }

    /// Mean squared error of this codebook for N(0, 1), in closed form.
    pub fn gaussian_distortion(&self) -> f64 {
        let lv: Vec<f64> = self.levels.iter().map(|&v| v as f64).collect();
        let mut b: Vec<f64> = vec![f64::NEG_INFINITY];
        b.extend(self.bounds.iter().map(|&v| v as f64));
        b.push(f64::INFINITY);
        cell_distortion(&lv, &b)
    }

    /// Lloyd-Max codebook of `2^bits` levels fitted to `samples` (empirical density),
    /// starting from the Gaussian codebook scaled to the samples' RMS.
    pub fn fit(samples: &[f32], bits: u8, iters: usize) -> Result<Self> {
        if samples.len() < (1usize << bits) {
            return Err(Error::InvalidParams(format!(
                "need at least {} samples to fit a {bits}-bit codebook, got {}",
                1usize << bits,
                samples.len()
            )));
        }
        if let Some(i) = samples.iter().position(|v| !v.is_finite()) {
            return Err(Error::InvalidParams(format!(
                "samples must be finite: index {i} is {}",
                samples[i]
            )));
        }
        let mut xs: Vec<f32> = samples.to_vec();
        xs.sort_by(|a, b| a.total_cmp(b));
        let rms = (xs.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / xs.len() as f64).sqrt();
        let rms = if rms > 0.0 { rms } else { 1.0 };
        let mut levels: Vec<f64> = gaussian(bits)?
            .levels
            .iter()
            .map(|&v| v as f64 * rms)
            .collect();
        // Prefix sums over the sorted samples make each iteration O(L log n).
        let mut pre = Vec::with_capacity(xs.len() + 1);
        pre.push(0.0f64);
        for &v in &xs {
            pre.push(pre.last().unwrap() + v as f64);
        }
        for _ in 0..iters {
            let mut changed = false;
            let mut lo = 0usize;
            let l = levels.len();
            for i in 0..l {
                let hi = if i + 1 == l {
                    xs.len()
                } else {
                    let bnd = 0.5 * (levels[i] + levels[i + 1]);
                    xs.partition_point(|&v| (v as f64) < bnd)
                };
                if hi > lo {
                    let m = (pre[hi] - pre[lo]) / (hi - lo) as f64;
                    if (m - levels[i]).abs() > 1e-9 * rms {
                        changed = true;
                    }
                    levels[i] = m;
                }
                lo = hi;
            }
            if !changed {
                break;
            }
        }
        let mut out: Vec<f32> = levels.iter().map(|&v| v as f32).collect();
        // Empty cells can leave duplicate levels; nudge them apart to stay strictly ascending.
        for i in 1..out.len() {
            if out[i] <= out[i - 1] {
                out[i] = out[i - 1] + f32::EPSILON * out[i - 1].abs().max(1.0) * 4.0;
            }
        }
        Codebook::from_levels(out)
    }
}

fn cell_distortion(levels: &[f64], b: &[f64]) -> f64 {
    let mut d = 0.0;
    for (i, &c) in levels.iter().enumerate() {
        let (lo, hi) = (b[i], b[i + 1]);
        let m0 = big_phi(hi) - big_phi(lo);
        let m1 = phi(lo) - phi(hi);
        let m2 = m0 + x_phi(lo) - x_phi(hi);
        d += m2 - 2.0 * c * m1 + c * c * m0;
    }
    d
}

/// Lloyd-Max iteration on the exact N(0, 1) density.
fn solve_gaussian(levels_n: usize) -> Vec<f64> {
    // Start from evenly spaced levels over a range that grows slowly with L.
    let span = 1.0 + (levels_n as f64).log2();
    let mut lv: Vec<f64> = (0..levels_n)
        .map(|i| -span + 2.0 * span * (i as f64 + 0.5) / levels_n as f64)
        .collect();
    for _ in 0..20_000 {
        let mut b = vec![f64::NEG_INFINITY];
        b.extend(lv.windows(2).map(|w| 0.5 * (w[0] + w[1])));
        b.push(f64::INFINITY);
        let mut delta: f64 = 0.0;
        for i in 0..levels_n {
            let m0 = big_phi(b[i + 1]) - big_phi(b[i]);
            let m1 = phi(b[i]) - phi(b[i + 1]);
            let c = if m0 > 1e-300 { m1 / m0 } else { lv[i] };
            delta = delta.max((c - lv[i]).abs());
            lv[i] = c;
        }
        if delta < 1e-12 {
            break;
        }
    }
    lv
}

/// The Gaussian Lloyd-Max codebook for `bits` in 1..=8 (computed once, cached). The
/// uniform-allocation path accepts 1, 2, 3, 4 and 8; water-filling uses all of them.
pub fn gaussian(bits: u8) -> Result<&'static Codebook> {
    static BOOKS: [OnceLock<Codebook>; 8] = [const { OnceLock::new() }; 8];
    if !(1..=8).contains(&bits) {
        return Err(Error::InvalidParams(format!(
            "no Gaussian codebook for bit_width {bits}"
        )));
    }
    Ok(BOOKS[bits as usize - 1].get_or_init(|| {
        let lv = solve_gaussian(1usize << bits);
        Codebook::from_levels(lv.iter().map(|&v| v as f32).collect())
            .expect("Gaussian levels are finite and ascending")
    }))
}

/// Distortion of the Gaussian Lloyd-Max quantiser for N(0, 1) at `bits` in 0..=8
/// (`bits = 0` reconstructs the mean: distortion 1). Cached.
pub fn gaussian_distortion(bits: u8) -> f64 {
    static TABLE: OnceLock<[f64; 9]> = OnceLock::new();
    let t = TABLE.get_or_init(|| {
        let mut t = [1.0f64; 9];
        for (b, slot) in t.iter_mut().enumerate().skip(1) {
            *slot = gaussian(b as u8).expect("1..=8 bits").gaussian_distortion();
        }
        t
    });
    t[bits.min(8) as usize]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;
    use crate::test_data::normal_samples;

    #[test]
    fn gaussian_distortion_matches_published_optimum() {
        // Max (1960): the bar is 2%; the closed-form iteration lands far inside it.
        for (bits, want) in [(1u8, 0.3634), (2, 0.1175), (3, 0.03454), (4, 0.009497)] {
            let got = gaussian(bits).unwrap().gaussian_distortion();
            assert!(
                (got - want).abs() / want < 0.005,
                "{bits} bits: distortion {got}, published {want}"
            );
        }
    }

    #[test]
    fn empirical_distortion_on_normal_samples_within_two_percent() {
        let xs = normal_samples(400_000, 11, 1);
        for (bits, want) in [(1u8, 0.3634), (2, 0.1175), (3, 0.03454), (4, 0.009497)] {
            let cb = gaussian(bits).unwrap();
            let mse: f64 = xs
                .iter()
                .map(|&x| ((x - cb.level(cb.quantize(x))) as f64).powi(2))
                .sum::<f64>()
                / xs.len() as f64;
            assert!(
                (mse - want).abs() / want < 0.02,
                "{bits} bits: {mse} vs {want}"
            );
        }
    }

    #[test]
    fn distortion_table_decreases_about_four_fold_per_bit() {
        assert_eq!(gaussian_distortion(0), 1.0);
        for b in 1..8u8 {
            let r = gaussian_distortion(b) / gaussian_distortion(b + 1);
            assert!(r > 3.0 && r < 4.5, "{b} -> {}: ratio {r}", b + 1);
        }
    }

    #[test]
    fn eight_bit_codebook_is_fine() {
        let cb = gaussian(8).unwrap();
        assert_eq!(cb.levels().len(), 256);
        // Panter-Dite asymptote: D ~ (sqrt(3) pi / 2) 4^-b ≈ 4.15e-5 at 8 bits.
        let d = cb.gaussian_distortion();
        assert!(d < 5e-5 && d > 3e-5, "8-bit distortion {d}");
    }

    #[test]
    fn counting_and_searching_quantisers_agree_on_every_width() {
        for bits in 1..=8u8 {
            let cb = gaussian(bits).unwrap();
            // A dense grid plus every bound and its neighbours (ties go up in both).
            let mut vals: Vec<f32> = (-6000..=6000).map(|i| i as f32 / 1000.0).collect();
            for &b in &cb.bounds {
                vals.extend([b, b - 1e-6, b + 1e-6]);
            }
            vals.extend([-60_000.0, 60_000.0]);
            for v in vals {
                let searched = cb.bounds.partition_point(|&b| b <= v) as u16;
                assert_eq!(cb.quantize(v), searched, "{bits} bits, value {v}");
            }
        }
    }

    #[test]
    fn quantize_picks_nearest_level() {
        let cb = gaussian(2).unwrap();
        for i in -400..400 {
            let v = i as f32 / 100.0;
            let q = cb.quantize(v);
            let best = (0..4u16)
                .min_by(|&a, &b| (cb.level(a) - v).abs().total_cmp(&(cb.level(b) - v).abs()))
                .unwrap();
            assert!((cb.level(q) - v).abs() <= (cb.level(best) - v).abs() + 1e-6);
        }
    }

    #[test]
    fn fit_on_gaussian_samples_recovers_gaussian_codebook() {
        let xs = normal_samples(200_000, 5, 2);
        let fitted = Codebook::fit(&xs, 3, 200).unwrap();
        let gauss = gaussian(3).unwrap();
        for (a, b) in fitted.levels().iter().zip(gauss.levels()) {
            assert!((a - b).abs() < 0.03, "{a} vs {b}");
        }
    }

    #[test]
    fn fit_on_uniform_beats_gaussian_codebook() {
        let mut g = SplitMix64::new(9, 3);
        let xs: Vec<f32> = (0..100_000)
            .map(|_| (g.next_f64() * 2.0 * 3f64.sqrt() - 3f64.sqrt()) as f32)
            .collect();
        let mse = |cb: &Codebook| -> f64 {
            xs.iter()
                .map(|&x| ((x - cb.level(cb.quantize(x))) as f64).powi(2))
                .sum::<f64>()
                / xs.len() as f64
        };
        let fitted = Codebook::fit(&xs, 2, 200).unwrap();
        assert!(mse(&fitted) < 0.9 * mse(gaussian(2).unwrap()));
    }
}
