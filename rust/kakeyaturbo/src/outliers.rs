//! Sparse outlier compensation.
//!
//! After rotation and scaling the coordinates are close to N(0, 1), but heavy-tailed
//! inputs (attention sinks, outlier channels) still produce a few large values that the
//! outermost Lloyd-Max level clips badly. Coordinates with `|v| > threshold` are stored
//! exactly as `(flat position u32, value f16)` — 6 bytes each — and overwrite the
//! dequantised value at decode. At threshold 4 a Gaussian coordinate is an outlier with
//! probability 6.3e-5, so the cost is negligible unless the data really is heavy-tailed.

use half::f16;

/// Bytes one stored outlier costs on the wire.
pub const OUTLIER_BYTES: usize = 6;

/// Appends the outliers of one scaled, rotated vector (`base` is the flat position of its
/// first coordinate); returns how many were added.
pub fn collect(scaled: &[f32], threshold: f32, base: u32, out: &mut Vec<(u32, f16)>) -> usize {
    // Outliers are rare: one branch-free pass first, the ordered scan only when one is there.
    if !threshold.is_finite()
        || !scaled
            .iter()
            .fold(false, |any, v| any | (v.abs() > threshold))
    {
        return 0;
    }
    let before = out.len();
    for (j, &v) in scaled.iter().enumerate() {
        if v.abs() > threshold {
            out.push((base + j as u32, f16::from_f32(v)));
        }
    }
    out.len() - before
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collects_only_beyond_threshold() {
        let mut out = Vec::new();
        let n = collect(&[0.1, -5.0, 3.9, 4.5], 4.0, 100, &mut out);
        assert_eq!(n, 2);
        assert_eq!(out[0], (101, f16::from_f32(-5.0)));
        assert_eq!(out[1].0, 103);
        assert_eq!(collect(&[1e9], f32::INFINITY, 0, &mut out), 0);
    }
}
