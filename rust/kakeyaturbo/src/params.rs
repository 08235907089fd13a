//! Codec parameters and their validation. Every combination that cannot work is rejected
//! here, at construction, so the encoder never has to guess.

use half::{bf16, f16};

use crate::error::{Error, Result};

/// How the PCA basis is fitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PcaMethod {
    /// Eigendecomposition of the weighted covariance (D x D): exact, O(n D^2 + D^3).
    Exact,
    /// Halko-Martinsson-Tropp randomized range finder: O(n D r), for large D.
    Randomized,
    /// No basis: only the block mean is removed (identity basis, `d_eff = D`, nothing
    /// stored). The cheapest side information; the rotation alone decorrelates.
    None,
}

/// The error metric the encoder optimises for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    /// Minimise squared error: the per-vector scale is the least-squares fit of the
    /// dequantised residual to the true one (it shrinks towards zero, like any MSE-optimal
    /// quantiser).
    Mse,
    /// Preserve inner products with the original vector (for keys, whose error matters
    /// only through `q . k`): the per-vector scale makes `<r_hat, r> = |r|^2`, undoing the
    /// shrinkage of MSE quantisers that shrinks attention logits and flattens softmax.
    InnerProduct,
}

/// How bits are spent on the coefficients of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allocation {
    /// Skeleton, WHT rotation and `bit_width` bits on every rotated coordinate.
    Uniform,
    /// Reverse water-filling over the PCA components (see [`crate::waterfill`]):
    /// `bits_per_value * head_dim` bits per vector, spent where the variance is.
    Waterfill,
}

/// Storage precision of the side information (means, bases, centres).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkeletonDtype {
    /// IEEE half precision: 2 bytes.
    F16,
    /// bfloat16: 2 bytes, wider range, less precision.
    Bf16,
    /// IEEE single precision: 4 bytes.
    F32,
}

impl SkeletonDtype {
    /// Bytes per stored element.
    pub fn size(self) -> usize {
        match self {
            SkeletonDtype::F16 | SkeletonDtype::Bf16 => 2,
            SkeletonDtype::F32 => 4,
        }
    }

    /// `v` rounded to this precision (and back to f32): side information is rounded
    /// *before* use, so the decoder sees exactly what the encoder used.
    pub fn round(self, v: f32) -> f32 {
        match self {
            SkeletonDtype::F16 => f16::from_f32(v).to_f32(),
            SkeletonDtype::Bf16 => bf16::from_f32(v).to_f32(),
            SkeletonDtype::F32 => v,
        }
    }

    /// [`SkeletonDtype::round`] in place.
    pub fn round_all(self, v: &mut [f32]) {
        v.iter_mut().for_each(|x| *x = self.round(*x));
    }
}

/// The dtype of the tensor that was encoded (decode returns the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputDtype {
    /// float32.
    F32,
    /// float16.
    F16,
    /// bfloat16.
    Bf16,
}

/// Largest head dimension accepted (WHT length is the next power of two of `d_eff`).
pub const MAX_HEAD_DIM: usize = 4096;
/// Largest block size accepted.
pub const MAX_BLOCK_SIZE: usize = 65_536;
/// Largest number of k-means centres.
pub const MAX_K: usize = 4096;
/// Largest number of k-means iterations (the wire stores it in 32 bits).
pub const MAX_KMEANS_ITERS: usize = 1 << 16;
/// Largest randomized-PCA oversampling.
pub const MAX_OVERSAMPLE: usize = 1024;
/// Largest number of randomized-PCA power iterations.
pub const MAX_POWER_ITERS: usize = 64;
/// Largest input magnitude, and largest magnitude of any f16 side value (f16's finite
/// range, with headroom).
pub const MAX_MAGNITUDE: f32 = 60_000.0;

/// Inclusive bounds of every integer field, in declaration order. [`CodecParams::validate`]
/// enforces them (with the rules that tie fields together on top, such as `k <= block_size`
/// and `bit_width` in {1, 2, 3, 4, 8}); bindings use them to name the range of a value that
/// does not even fit the field's type.
pub const INT_FIELD_BOUNDS: [(&str, u64, u64); 9] = [
    ("block_size", 1, MAX_BLOCK_SIZE as u64),
    ("bit_width", 1, 8),
    ("target_rank", 0, MAX_HEAD_DIM as u64),
    ("oversample", 0, MAX_OVERSAMPLE as u64),
    ("power_iters", 0, MAX_POWER_ITERS as u64),
    ("rank_cap", 0, MAX_HEAD_DIM as u64),
    ("k", 0, MAX_K as u64),
    ("kmeans_iters", 0, MAX_KMEANS_ITERS as u64),
    ("seed", 0, u64::MAX),
];

/// The bounds of the integer field `name` (None for other fields).
pub fn int_field_bounds(name: &str) -> Option<(u64, u64)> {
    INT_FIELD_BOUNDS
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|&(_, lo, hi)| (lo, hi))
}

/// Every knob of the codec. Construct with [`CodecParams::default`] and adjust, then
/// call [`CodecParams::validate`] (the encoder does it too).
#[derive(Debug, Clone, PartialEq)]
pub struct CodecParams {
    /// Vectors per block; the last block of a layer may be shorter.
    pub block_size: usize,
    /// Bits per rotated residual coordinate: 1, 2, 3, 4 or 8.
    pub bit_width: u8,
    /// Exact or randomized PCA.
    pub pca_method: PcaMethod,
    /// Randomized PCA: components sought (0 means "head_dim").
    pub target_rank: usize,
    /// Randomized PCA: extra random directions beyond `target_rank`.
    pub oversample: usize,
    /// Randomized PCA: power iterations (sharpen a slowly decaying spectrum).
    pub power_iters: usize,
    /// Keep the fewest leading components whose variance share reaches this (0, 1].
    pub variance_ratio: f32,
    /// Upper bound on kept components (0 means "no cap").
    pub rank_cap: usize,
    /// Fit one pooled basis per layer and store it once, instead of one per block.
    pub share_basis: bool,
    /// Number of spherical k-means centres; 0 disables the skeleton.
    pub k: usize,
    /// Maximum Lloyd iterations of the spherical k-means.
    pub kmeans_iters: usize,
    /// Error metric (see [`Metric`]).
    pub metric: Metric,
    /// Scaled coordinates with |v| above this are stored exactly; `inf` disables.
    pub outlier_threshold: f32,
    /// Precision of means, bases and centres.
    pub skeleton_dtype: SkeletonDtype,
    /// Seed for the WHT signs, k-means initialisation and randomized PCA.
    pub seed: u64,
    /// Calibrated Lloyd-Max centroids (2^bit_width, strictly ascending); `None` uses the
    /// Gaussian codebook.
    pub centroids: Option<Vec<f32>>,
    /// Uniform bits per rotated coordinate, or water-filling over components.
    pub allocation: Allocation,
    /// Water-filling budget in bits per input value (0 < b <= 8).
    pub bits_per_value: f32,
}

impl Default for CodecParams {
    fn default() -> Self {
        CodecParams {
            block_size: 512,
            bit_width: 3,
            pca_method: PcaMethod::Exact,
            target_rank: 0,
            oversample: 8,
            power_iters: 2,
            variance_ratio: 1.0,
            rank_cap: 0,
            share_basis: false,
            k: 16,
            kmeans_iters: 8,
            metric: Metric::Mse,
            outlier_threshold: 4.0,
            skeleton_dtype: SkeletonDtype::F16,
            seed: 0,
            centroids: None,
            allocation: Allocation::Uniform,
            bits_per_value: 2.0,
        }
    }
}

fn invalid<T>(msg: String) -> Result<T> {
    Err(Error::InvalidParams(msg))
}

/// The error for an integer field outside `lo..=hi`; `got` is the value as the caller can
/// print it (a binding may hold one that no Rust integer type fits).
pub fn int_bound_error(name: &str, lo: u64, hi: u64, got: impl std::fmt::Display) -> Error {
    Error::InvalidParams(format!("{name} must be in {lo}..={hi}, got {got}"))
}

impl CodecParams {
    /// The integer fields with their values, in the order of [`INT_FIELD_BOUNDS`].
    fn int_fields(&self) -> [u64; 9] {
        [
            self.block_size as u64,
            self.bit_width as u64,
            self.target_rank as u64,
            self.oversample as u64,
            self.power_iters as u64,
            self.rank_cap as u64,
            self.k as u64,
            self.kmeans_iters as u64,
            self.seed,
        ]
    }

    /// Checks every field and every combination; the message names the field.
    pub fn validate(&self) -> Result<()> {
        for ((name, lo, hi), v) in INT_FIELD_BOUNDS.iter().zip(self.int_fields()) {
            if v < *lo || v > *hi {
                return Err(int_bound_error(name, *lo, *hi, v));
            }
        }
        if !matches!(self.bit_width, 1 | 2 | 3 | 4 | 8) {
            return invalid(format!(
                "bit_width must be 1, 2, 3, 4 or 8, got {}",
                self.bit_width
            ));
        }
        if !(self.variance_ratio > 0.0 && self.variance_ratio <= 1.0) {
            return invalid(format!(
                "variance_ratio must be in (0, 1], got {}",
                self.variance_ratio
            ));
        }
        if self.k > 0 && self.kmeans_iters == 0 {
            return invalid("kmeans_iters must be >= 1 when k > 0".into());
        }
        if self.k > self.block_size {
            return invalid(format!(
                "k ({}) cannot exceed block_size ({})",
                self.k, self.block_size
            ));
        }
        if self.outlier_threshold.is_nan() || self.outlier_threshold <= 0.0 {
            return invalid(format!(
                "outlier_threshold must be > 0 (inf disables), got {}",
                self.outlier_threshold
            ));
        }
        if self.pca_method == PcaMethod::None && (self.variance_ratio < 1.0 || self.rank_cap != 0) {
            return invalid(
                "pca_method='none' keeps every dimension: variance_ratio must be 1.0 and rank_cap unset"
                    .into(),
            );
        }
        if self.pca_method != PcaMethod::Randomized && self.target_rank != 0 {
            return invalid("target_rank applies only to pca_method='randomized'".into());
        }
        if !(self.bits_per_value > 0.0 && self.bits_per_value <= 8.0) {
            return invalid(format!(
                "bits_per_value must be in (0, 8], got {}",
                self.bits_per_value
            ));
        }
        if self.allocation == Allocation::Waterfill {
            if self.k != 0 {
                return invalid(
                    "allocation='waterfill' codes PCA components directly: set k=0 (no skeleton)"
                        .into(),
                );
            }
            if self.centroids.is_some() {
                return invalid(
                    "allocation='waterfill' uses Gaussian codebooks per component: centroids must be None"
                        .into(),
                );
            }
        }
        if let Some(c) = &self.centroids {
            let want = 1usize << self.bit_width;
            if c.len() != want {
                return invalid(format!(
                    "centroids must hold 2**bit_width = {want} values, got {}",
                    c.len()
                ));
            }
            if c.iter().any(|v| !v.is_finite()) {
                return invalid("centroids must be finite".into());
            }
            if c.windows(2).any(|w| w[0] >= w[1]) {
                return invalid("centroids must be strictly ascending".into());
            }
        }
        Ok(())
    }

    /// Components kept for a head dimension `d` before the variance rule.
    pub fn max_rank(&self, d: usize) -> usize {
        let mut r = d;
        if self.rank_cap > 0 {
            r = r.min(self.rank_cap);
        }
        if self.pca_method == PcaMethod::Randomized && self.target_rank > 0 {
            r = r.min(self.target_rank);
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_data::{edited, params};

    #[test]
    fn default_is_valid() {
        CodecParams::default().validate().unwrap();
    }

    #[test]
    fn rejects_bad_fields() {
        // Each edit of the defaults makes them invalid.
        let bad: [fn(&mut CodecParams); 12] = [
            |p| p.bit_width = 5,
            |p| p.block_size = 0,
            |p| p.variance_ratio = 0.0,
            |p| p.variance_ratio = 1.5,
            |p| p.outlier_threshold = f32::NAN,
            |p| (p.k, p.block_size) = (1000, 64),
            |p| p.target_rank = 8,
            |p| p.centroids = Some(vec![0.0, 1.0]),
            |p| (p.bit_width, p.centroids) = (1, Some(vec![1.0, -1.0])),
            |p| p.kmeans_iters = MAX_KMEANS_ITERS + 1,
            |p| p.oversample = MAX_OVERSAMPLE + 1,
            |p| (p.k, p.block_size) = (MAX_K + 1, MAX_BLOCK_SIZE),
        ];
        for edit in bad {
            let mut p = CodecParams::default();
            edit(&mut p);
            assert!(
                matches!(p.validate(), Err(Error::InvalidParams(_))),
                "{p:?}"
            );
        }
    }

    #[test]
    fn int_bounds_name_the_field_and_range() {
        assert_eq!(int_field_bounds("k"), Some((0, MAX_K as u64)));
        assert_eq!(int_field_bounds("seed"), Some((0, u64::MAX)));
        assert_eq!(int_field_bounds("variance_ratio"), None);
        let p = params(|p| p.power_iters = 65);
        let msg = p.validate().unwrap_err().to_string();
        assert!(
            msg.contains("power_iters must be in 0..=64, got 65"),
            "{msg}"
        );
        // Every bounded field is checked: its upper bound plus one is rejected by name.
        let d = CodecParams::default();
        for (i, (name, _, hi)) in INT_FIELD_BOUNDS.iter().enumerate() {
            if *hi == u64::MAX {
                continue;
            }
            let mut vals = d.int_fields();
            vals[i] = hi + 1;
            let p = edited(&d, |p| {
                (
                    p.block_size,
                    p.bit_width,
                    p.target_rank,
                    p.oversample,
                    p.power_iters,
                    p.rank_cap,
                    p.k,
                    p.kmeans_iters,
                    p.seed,
                    p.pca_method,
                ) = (
                    vals[0] as usize,
                    vals[1].min(255) as u8,
                    vals[2] as usize,
                    vals[3] as usize,
                    vals[4] as usize,
                    vals[5] as usize,
                    vals[6] as usize,
                    vals[7] as usize,
                    vals[8],
                    PcaMethod::Randomized,
                )
            });
            let msg = p.validate().unwrap_err().to_string();
            assert!(msg.contains(name), "{name}: {msg}");
        }
    }
}
