use proptest::prelude::*;

use super::*;
use crate::bitpack::{BitReader, BitWriter};

/// The direct formula, code by code: `c_hat_j = Q^-1(q_j) s_j g`, outliers, then `+ m_j`.
fn reference(
    b: &WaterfillCodes<'_>,
    n: usize,
    d: usize,
    metric: Metric,
    mean: Option<&[f32]>,
) -> Vec<f32> {
    let mut c = vec![0.0f32; n * d];
    let mut r = BitReader::new(b.codes);
    for row in c.chunks_exact_mut(d) {
        for (j, v) in row.iter_mut().enumerate() {
            let bits = b.comp_bits[j];
            if bits > 0 {
                let q = r.get(bits as u32).unwrap();
                let s = b.sigma[j].to_f32();
                *v = book(bits).levels()[q as usize] * s * gain(metric, bits);
            }
        }
    }
    r.finish().unwrap();
    for &(pos, val) in &b.outliers {
        c[pos as usize] = val.to_f32() * b.sigma[pos as usize % d].to_f32();
    }
    if let Some(m) = mean {
        for row in c.chunks_exact_mut(d) {
            for (v, &m) in row.iter_mut().zip(m) {
                *v += m;
            }
        }
    }
    c
}

/// Random codes of `n` vectors of widths `bits`, packed, and an outlier at about one
/// position in `every`.
/// [`component_values`] into new vectors.
fn tables(
    body: &WaterfillCodes<'_>,
    metric: Metric,
    fold: impl Fn(usize, f32) -> f32,
) -> (Vec<f32>, Vec<usize>) {
    let (mut values, mut offsets) = (Vec::new(), Vec::new());
    component_values(body, metric, fold, &mut values, &mut offsets).unwrap();
    (values, offsets)
}

fn random_codes(
    g: &mut crate::rng::SplitMix64,
    bits: &[u8],
    n: usize,
    every: usize,
) -> (Vec<u8>, Vec<(u32, f16)>) {
    let mut w = BitWriter::new();
    for _ in 0..n {
        for &b in bits {
            w.put((g.below(1 << b)) as u16, b as u32);
        }
    }
    let mut outliers = Vec::new();
    for pos in 0..n * bits.len() {
        if g.below(every) == 0 {
            outliers.push((pos as u32, f16::from_f64(g.normal() * 8.0)));
        }
    }
    (w.finish(), outliers)
}

/// A random block's scales and mean (each of `bits.len()` components) and its codes and
/// outliers ([`random_codes`]), drawn from `g` in that order.
#[allow(clippy::type_complexity)]
fn random_block(
    g: &mut crate::rng::SplitMix64,
    bits: &[u8],
    n: usize,
    every: usize,
) -> (Vec<f16>, Vec<f32>, Vec<u8>, Vec<(u32, f16)>) {
    let d = bits.len();
    let sigma: Vec<f16> = (0..d)
        .map(|_| f16::from_f64(g.normal().abs() * 3.0))
        .collect();
    let mean: Vec<f32> = (0..d).map(|_| g.normal() as f32 * 10.0).collect();
    let (codes, outliers) = random_codes(g, bits, n, every);
    (sigma, mean, codes, outliers)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Random widths (0..=8, runs of zeros included), scales, codes, outliers, both
    /// metrics, with and without a mean: the program matches the direct formula bit
    /// for bit. A mapped decode is the map of its values, every value lies within the
    /// ranges `choose` was given, and each range's ends are values the block could
    /// decode to (its table's extremes or an outlier).
    #[test]
    fn program_and_mapped_decode_match_the_direct_formula(
        n in 1usize..80,
        bits in proptest::collection::vec(prop_oneof![Just(0u8), 0u8..=8], 1..40),
        seed in any::<u64>(),
        ip in any::<bool>(),
        with_mean in any::<bool>(),
    ) {
        let d = bits.len();
        let mut g = crate::rng::SplitMix64::new(seed, 1);
        let (sigma, mean, codes, outliers) = random_block(&mut g, &bits, n, 20);
        let body = WaterfillCodes { sigma, comp_bits: bits, codes: &codes, outliers };
        let metric = if ip { Metric::InnerProduct } else { Metric::Mse };
        let mean = with_mean.then_some(&mean[..]);
        let mut out = vec![f32::NAN; n * d];
        decode_into(&body, n, d, metric, mean, &mut out).unwrap();
        let want = reference(&body, n, d, metric, mean);
        let same = out.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
        prop_assert!(same, "{:?}\nvs\n{:?}", out, want);

        let f = |j: usize, v: f32| 0.5 * v - j as f32;
        let (lo, hi) = decode_mapped(
            &body, n, d, metric, mean,
            |lo, hi, outliers| {
                let (mut lo, mut hi) = (lo.to_vec(), hi.to_vec());
                for &(pos, v) in outliers {
                    (lo[pos % d], hi[pos % d]) = (lo[pos % d].min(v), hi[pos % d].max(v));
                }
                (lo, hi)
            },
            |_, j, vs| vs.iter_mut().for_each(|v| *v = f(j, *v)),
            &mut out,
        ).unwrap();
        for (i, (&o, &w)) in out.iter().zip(&want).enumerate() {
            let j = i % d;
            prop_assert_eq!(o.to_bits(), f(j, w).to_bits(), "value {}", i);
            prop_assert!(lo[j] <= w && w <= hi[j], "value {} = {} outside [{}, {}]", i, w, lo[j], hi[j]);
        }
        let m = |j: usize| mean.map_or(0.0, |m| m[j]);
        let (values, offsets) = tables(&body, metric, |j, c| m(j) + c);
        for j in 0..d {
            let end = offsets.get(j + 1).copied().unwrap_or(values.len());
            let table = &values[offsets[j]..end];
            let stored = |x: f32| table.contains(&x) || body.outliers.iter().any(|&(p, v)| {
                p as usize % d == j && m(j) + v.to_f32() * body.sigma[j].to_f32() == x
            });
            prop_assert!(stored(lo[j]) && stored(hi[j]), "component {}", j);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// Random widths (0..=8: permuted, two-table and gathered codes), codes and outliers,
    /// 1..300 vectors (partial groups of 8, tails past the stream), 1..=12 rows with a
    /// stride beyond the block: the sums from the codes are the decoded vectors' weighted
    /// sums within float32 rounding of their terms (float64 reference).
    #[test]
    fn weighted_sums_match_the_decoded_vectors(
        n in 1usize..300,
        bits in proptest::collection::vec(prop_oneof![Just(0u8), 1u8..=4, 0u8..=8], 1..40),
        rows in 1usize..=12,
        pad in 0usize..5,
        seed in any::<u64>(),
        ip in any::<bool>(),
        with_mean in any::<bool>(),
    ) {
        let d = bits.len();
        let mut g = crate::rng::SplitMix64::new(seed, 3);
        let (sigma, mean, codes, outliers) = random_block(&mut g, &bits, n, 30);
        let body = WaterfillCodes { sigma, comp_bits: bits, codes: &codes, outliers };
        let metric = if ip { Metric::InnerProduct } else { Metric::Mse };
        let mean = with_mean.then_some(&mean[..]);
        let stride = n + pad;
        let w: Vec<f32> = (0..rows * stride).map(|_| g.normal().abs() as f32).collect();
        let mut y = vec![0.0f32; n * d];
        decode_into(&body, n, d, metric, mean, &mut y).unwrap();
        let mut out = vec![f32::NAN; rows * d];
        let ran = weighted_sums(&body, n, d, metric, mean, (&w, stride, rows), &mut out).unwrap();
        prop_assert_eq!(ran, weighted_sums_rows() > 0);
        if ran {
            for r in 0..rows {
                for j in 0..d {
                    let terms = (0..n).map(|t| w[r * stride + t] as f64 * y[t * d + j] as f64);
                    let (want, size) = terms.fold((0.0, 0.0), |(s, a), x| (s + x, a + x.abs()));
                    let got = out[r * d + j] as f64;
                    prop_assert!(
                        (got - want).abs() <= 1e-5 * size + 1e-30,
                        "row {} component {}: {} against {}", r, j, got, want
                    );
                }
            }
        }
    }
}

/// The sums check the block as decoding does: a truncated code stream, an outlier past
/// the block and outputs or weights of the wrong size are errors; no rows, or more than
/// the kernel takes, leave the block to the decoder.
#[test]
fn weighted_sums_reject_bad_blocks_and_decline_many_rows() {
    let (n, bits) = (40usize, vec![3u8, 0, 5, 2]);
    let d = bits.len();
    let mut g = crate::rng::SplitMix64::new(9, 3);
    let (codes, outliers) = random_codes(&mut g, &bits, n, 10);
    let sigma = vec![f16::from_f32(1.0); d];
    let body = WaterfillCodes {
        sigma,
        comp_bits: bits,
        codes: &codes,
        outliers,
    };
    let w = vec![0.5f32; 12 * n];
    let sums = |b: &WaterfillCodes<'_>, rows: usize, out: &mut [f32]| {
        weighted_sums(b, n, d, Metric::Mse, None, (&w, n, rows), out)
    };
    let mut out = vec![0.0f32; 3 * d];
    assert_eq!(
        sums(&body, 3, &mut out).unwrap(),
        (weighted_sums_rows() > 0)
    );
    assert!(
        sums(&body, 3, &mut out[..d]).is_err(),
        "outputs of the wrong size"
    );
    assert!(weighted_sums(&body, n, d, Metric::Mse, None, (&w[..n], n, 3), &mut out).is_err());
    let huge = (&w[..], usize::MAX / 2, 3);
    assert!(weighted_sums(&body, n, d, Metric::Mse, None, huge, &mut out).is_err());
    let short = WaterfillCodes {
        codes: &codes[..codes.len() - 1],
        ..body.clone()
    };
    if weighted_sums_rows() > 0 {
        assert!(sums(&short, 3, &mut out).is_err(), "a truncated stream");
        let mut past = body.clone();
        past.outliers.push(((n * d) as u32, f16::from_f32(1.0)));
        assert!(
            sums(&past, 3, &mut out).is_err(),
            "an outlier past the block"
        );
    }
    assert!(!sums(&body, 0, &mut []).unwrap(), "no rows");
    let mut many = vec![0.0f32; 13 * d];
    let w13 = vec![0.5f32; 13 * n];
    let r = weighted_sums(&body, n, d, Metric::Mse, None, (&w13, n, 13), &mut many);
    assert!(!r.unwrap(), "13 rows go to the decoder");
}

/// Blocks of 64 components (every width 0..=8, outliers) and 256, 203 or 5 vectors: the
/// AVX2 gather decoder, where this CPU has it, decodes every vector (the last ones from a
/// padded copy of their codes), and the block decodes bit for bit as the direct formula
/// says.
#[test]
fn gather_decoder_matches_the_direct_formula() {
    // 256: whole groups, the last past the stream's end; 203: a partial last group; 5: no
    // group within the stream.
    for (n, seed) in [(256usize, 2u64), (203, 3), (5, 4)] {
        let d = 64;
        let mut g = crate::rng::SplitMix64::new(11, seed);
        let bits: Vec<u8> = (0..d)
            .map(|j| [8, 0, 7, 6, 5, 4, 4, 3, 2, 3, 1, 0, 2, 1, 0, 2][j % 16])
            .collect();
        let sigma: Vec<f16> = (0..d)
            .map(|_| f16::from_f64(g.normal().abs() * 3.0))
            .collect();
        let mean: Vec<f32> = (0..d).map(|_| g.normal() as f32).collect();
        let (codes, outliers) = random_codes(&mut g, &bits, n, 50);
        let body = WaterfillCodes {
            sigma,
            comp_bits: bits,
            codes: &codes,
            outliers,
        };
        let want = reference(&body, n, d, Metric::Mse, Some(&mean));
        let mut out = vec![f32::NAN; n * d];
        decode_into(&body, n, d, Metric::Mse, Some(&mean), &mut out).unwrap();
        assert!(out
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits()));

        let (values, offsets) = tables(&body, Metric::Mse, |j, c| mean[j] + c);
        let per_vector = body.comp_bits.iter().map(|&b| b as usize).sum();
        let mut rows = vec![f32::NAN; n * d];
        let tables = (&values[..], &offsets[..]);
        let buffers = &mut RowBuffers::default();
        let took = gather_rows(&body, (n, per_vector), tables, &mut rows, buffers);
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") {
            assert!(
                took,
                "the gather decoder did not take the block of {n} vectors"
            );
        }
        let m = if took { n } else { 0 };
        // Its rows, before outliers: the direct formula's wherever no outlier sits.
        let hit: std::collections::HashSet<usize> =
            body.outliers.iter().map(|&(p, _)| p as usize).collect();
        for i in (0..m * d).filter(|i| !hit.contains(i)) {
            assert_eq!(rows[i].to_bits(), want[i].to_bits(), "value {i}");
        }
    }
}

/// Wrong lengths, and a map that makes a value not finite, are format errors, not
/// silent garbage.
#[test]
fn wrong_lengths_and_mapped_values_not_finite_are_format_errors() {
    let codes = [0u8; 3];
    let body = WaterfillCodes {
        sigma: vec![f16::ONE; 3],
        comp_bits: vec![2, 0, 2],
        codes: &codes,
        outliers: vec![],
    };
    let mut out = vec![0.0f32; 6 * 3];
    // 6 vectors x 4 bits need 3 bytes; 4 vectors (2 bytes) or a short output do not fit.
    assert!(decode_into(&body, 6, 3, Metric::Mse, None, &mut out).is_ok());
    let e = decode_into(&body, 4, 3, Metric::Mse, None, &mut out[..12]).unwrap_err();
    assert!(e.is_format_error());
    let e = decode_into(&body, 6, 3, Metric::Mse, None, &mut out[..15]).unwrap_err();
    assert!(e.is_format_error());
    let far = WaterfillCodes {
        outliers: vec![(18, f16::ONE)],
        ..body.clone()
    };
    let e = decode_into(&far, 6, 3, Metric::Mse, None, &mut out).unwrap_err();
    assert!(e.is_format_error());
    let nan_at_2 = |_: &(), j: usize, vs: &mut [f32]| {
        if j == 2 {
            vs[0] = f32::NAN;
        }
    };
    let nothing = |_: &[f32], _: &[f32], _: &[(usize, f32)]| ();
    let e = decode_mapped(&body, 6, 3, Metric::Mse, None, nothing, nan_at_2, &mut out);
    let e = e.unwrap_err();
    assert!(e.is_format_error());
}
