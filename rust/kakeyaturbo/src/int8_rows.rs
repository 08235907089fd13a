//! Vectors held as 8-bit integer codes with one bfloat16 scale each: how a cache holds its hot
//! window's values (`python/kakeyaturbo/hf/int8_rows.py` documents the format and why).
//!
//! A row `x` of `D` entries is `round(x / s)` (ties to even) in int8, clamped to +-127, with
//! `s = max|x| / 127` rounded to bfloat16 (to nearest even), then the scale's two bytes
//! (little-endian): `D + 2` bytes. These are the bits of the torch encoder, which other
//! devices keep; here one call encodes a decode step's token instead of a dozen torch ops.
//! A row that is not finite keeps a scale that is not finite and codes 0, so it decodes as
//! NaN: a model's overflow stays visible.

use crate::error::{Error, Result};
use half::bf16;

/// Bytes a row holds beyond its `D` codes: its bfloat16 scale.
pub const SCALE_BYTES: usize = 2;
const LEVELS: f32 = 127.0;

/// Rows of `d` entries (`x.len()` a multiple of `d`) as int8 rows, `d + 2` bytes each.
pub fn encode(x: &[f32], d: usize) -> Result<Vec<i8>> {
    if d == 0 || !x.len().is_multiple_of(d) {
        return Err(Error::Shape(format!(
            "int8 rows: {} values are not rows of {d}",
            x.len()
        )));
    }
    let mut out = Vec::with_capacity(x.len() / d * (d + SCALE_BYTES));
    for row in x.chunks_exact(d) {
        // NaN wins, as torch's amax propagates it.
        let top = row.iter().fold(0.0f32, |m, &v| {
            let a = v.abs();
            if a.is_nan() || a > m {
                a
            } else {
                m
            }
        });
        let scale = bf16::from_f32(top / LEVELS);
        let s = scale.to_f32();
        out.extend(row.iter().map(|&v| {
            // 0/0, inf/inf and x/inf give codes 0 (torch's nan_to_num to 0).
            let c = v / s;
            if c.is_finite() {
                c.round_ties_even().clamp(-LEVELS, LEVELS) as i8
            } else {
                0
            }
        }));
        out.extend(scale.to_bits().to_le_bytes().map(|b| b as i8));
    }
    Ok(out)
}

/// The scale of one row of `d` codes (`row.len() == d + 2`).
#[inline]
pub fn scale(row: &[i8], d: usize) -> f32 {
    let bits = u16::from_le_bytes([row[d] as u8, row[d + 1] as u8]);
    f32::from_bits((bits as u32) << 16)
}

/// Appends the float32 values of int8 rows of `d` codes (`x.len()` a multiple of `d + 2`):
/// `code * scale`, exact in float32 (8 bits of code times 8 of mantissa).
pub fn decode_into(x: &[i8], d: usize, out: &mut Vec<f32>) {
    for row in x.chunks_exact(d + SCALE_BYTES) {
        let s = scale(row, d);
        out.extend(row[..d].iter().map(|&c| c as f32 * s));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    #[test]
    fn rows_decode_within_half_a_step_of_their_scale() {
        let mut rng = SplitMix64::new(5, 0);
        let d = 64;
        let x: Vec<f32> = (0..16 * d)
            .map(|i| rng.normal() as f32 * (1.0 + (i / d) as f32))
            .collect();
        let held = encode(&x, d).unwrap();
        assert_eq!(held.len(), 16 * (d + SCALE_BYTES));
        let mut back = Vec::new();
        decode_into(&held, d, &mut back);
        for (row, (want, got)) in held
            .chunks_exact(d + SCALE_BYTES)
            .zip(x.chunks_exact(d).zip(back.chunks_exact(d)))
        {
            let s = scale(row, d);
            let top = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            // The bfloat16 scale can clip the largest entry by up to its rounding, 2^-8.
            assert!(
                (s * 127.0 - top).abs() <= top / 256.0,
                "scale {s} for max {top}"
            );
            for (w, g) in want.iter().zip(got) {
                assert!(
                    (w - g).abs() <= 0.5 * s + top / 256.0,
                    "{w} -> {g} (step {s})"
                );
            }
        }
    }

    #[test]
    fn ties_round_to_even_and_odd_rows_keep_their_meaning() {
        let d = 4;
        // Scale 1: 127 / 127. 2.5 -> 2, 3.5 -> 4, -0.5 -> 0.
        let held = encode(&[127.0, 2.5, 3.5, -0.5], d).unwrap();
        assert_eq!(&held[..d], &[127, 2, 4, 0]);
        assert_eq!(scale(&held, d), 1.0);
        // A zero row: scale 0, codes 0, values 0.
        let zero = encode(&[0.0; 4], d).unwrap();
        assert_eq!(&zero[..d], &[0; 4]);
        // Rows that are not finite decode as NaN (codes 0 and a scale that is not finite).
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let held = encode(&[1.0, bad, -2.0, 0.5], d).unwrap();
            assert_eq!(&held[..d], &[0; 4]);
            let mut back = Vec::new();
            decode_into(&held, d, &mut back);
            assert!(back.iter().all(|v| v.is_nan()), "{bad}: {back:?}");
        }
        assert!(encode(&[1.0; 5], d).is_err());
        assert!(encode(&[], 0).is_err());
    }
}
