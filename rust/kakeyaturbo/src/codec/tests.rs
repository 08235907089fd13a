use super::*;
use crate::rng::SplitMix64;
use proptest::prelude::*;

/// KV-like data: a mean offset, a decaying spectrum and one outlier channel.
fn kv_like(n: usize, d: usize, seed: u64) -> Vec<f32> {
    let mut g = SplitMix64::new(seed, 77);
    let mut x = vec![0.0f32; n * d];
    for i in 0..n {
        let shared = g.normal();
        for j in 0..d {
            let scale = 2.0 / (1.0 + j as f64 * 0.2);
            let mut v = 0.3 + scale * g.normal() + 0.5 * shared;
            if j == 3 {
                v += 8.0;
            }
            x[i * d + j] = v as f32;
        }
    }
    x
}

fn roundtrip(x: &[f32], n: usize, d: usize, p: &CodecParams) -> (Vec<f32>, EncodedLayer) {
    let enc = encode_layer(x, n, d, None, p, InputDtype::F32).unwrap();
    (decode_layer(&enc).unwrap(), enc)
}

#[test]
fn error_falls_with_bit_width() {
    let (n, d) = (700, 64);
    let x = kv_like(n, d, 1);
    let mut last = f64::INFINITY;
    for bits in [1u8, 2, 3, 4, 8] {
        let p = CodecParams {
            bit_width: bits,
            ..Default::default()
        };
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
    let p = CodecParams {
        bit_width: 4,
        k: 0,
        ..Default::default()
    };
    let (y, _) = roundtrip(&x, n, d, &p);
    let e = rel_err(&x, &y);
    assert!(e < 0.1, "relative error {e}");
}

#[test]
fn deterministic_for_fixed_seed_and_seed_matters() {
    let (n, d) = (300, 32);
    let x = kv_like(n, d, 3);
    let p = CodecParams::default();
    let a = encode_layer(&x, n, d, None, &p, InputDtype::F32).unwrap();
    let b = encode_layer(&x, n, d, None, &p, InputDtype::F32).unwrap();
    assert_eq!(a.as_bytes(), b.as_bytes());
    let c = encode_layer(
        &x,
        n,
        d,
        None,
        &CodecParams { seed: 9, ..p },
        InputDtype::F32,
    )
    .unwrap();
    assert_ne!(a.as_bytes(), c.as_bytes());
}

#[test]
fn from_bytes_reproduces_decode_and_stats() {
    let (n, d) = (1100, 16);
    let x = kv_like(n, d, 4);
    let p = CodecParams {
        block_size: 256,
        share_basis: true,
        ..Default::default()
    };
    let (y, enc) = roundtrip(&x, n, d, &p);
    let again = EncodedLayer::from_bytes(enc.as_bytes().to_vec()).unwrap();
    assert_eq!(again, enc);
    assert_eq!(decode_layer(&again).unwrap(), y);
    assert_eq!(enc.stats().len(), 5);
    assert_eq!(enc.stats()[4].n, 1100 - 4 * 256);
}

#[test]
fn shared_basis_is_smaller_than_per_block_bases() {
    let (n, d) = (2048, 64);
    let x = kv_like(n, d, 5);
    let per_block = encode_layer(&x, n, d, None, &CodecParams::default(), InputDtype::F32).unwrap();
    let shared_p = CodecParams {
        share_basis: true,
        ..Default::default()
    };
    let shared = encode_layer(&x, n, d, None, &shared_p, InputDtype::F32).unwrap();
    // Three fewer D x D fp16 bases and means, minus the shared section's d_eff field;
    // codes, labels and scales have the same sizes, outlier counts may differ.
    let outliers = |e: &EncodedLayer| {
        e.stats()
            .iter()
            .map(|s| s.n_outliers as isize)
            .sum::<isize>()
    };
    let diff = per_block.nbytes() as isize - shared.nbytes() as isize;
    assert_eq!(
        diff,
        3 * (64 * 64 + 64) * 2 - 4 + 6 * (outliers(&per_block) - outliers(&shared))
    );
}

#[test]
fn variance_ratio_and_rank_cap_bound_d_eff() {
    let (n, d) = (512, 64);
    let x = kv_like(n, d, 6);
    let p = CodecParams {
        rank_cap: 20,
        ..Default::default()
    };
    let enc = encode_layer(&x, n, d, None, &p, InputDtype::F32).unwrap();
    assert_eq!(enc.stats()[0].d_eff, 20);
    let p = CodecParams {
        variance_ratio: 0.5,
        ..Default::default()
    };
    let enc = encode_layer(&x, n, d, None, &p, InputDtype::F32).unwrap();
    assert!(enc.stats()[0].d_eff < 40);
}

#[test]
fn randomized_pca_close_to_exact() {
    let (n, d) = (512, 64);
    let x = kv_like(n, d, 7);
    let ex = CodecParams {
        bit_width: 4,
        ..Default::default()
    };
    let rp = CodecParams {
        pca_method: PcaMethod::Randomized,
        ..ex.clone()
    };
    let (ye, _) = roundtrip(&x, n, d, &ex);
    let (yr, _) = roundtrip(&x, n, d, &rp);
    let (ee, er) = (rel_err(&x, &ye), rel_err(&x, &yr));
    assert!(er < ee * 1.1 + 1e-3, "randomized {er} vs exact {ee}");
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
    let mut g = SplitMix64::new(9, 9);
    let x: Vec<f32> = (0..n * d).map(|_| g.normal() as f32).collect();
    let with = CodecParams {
        outlier_threshold: 1.5,
        k: 0,
        bit_width: 2,
        ..Default::default()
    };
    let without = CodecParams {
        outlier_threshold: f32::INFINITY,
        ..with.clone()
    };
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

#[test]
fn constant_and_tiny_inputs() {
    let x = vec![1.5f32; 10 * 8];
    let (y, _) = roundtrip(&x, 10, 8, &CodecParams::default());
    assert!(rel_err(&x, &y) < 1e-3);
    let x = vec![0.25f32, -1.0, 3.0];
    let (y, _) = roundtrip(
        &x,
        1,
        3,
        &CodecParams {
            k: 1,
            block_size: 1,
            ..Default::default()
        },
    );
    assert!(rel_err(&x, &y) < 1e-2);
}

#[test]
fn bad_input_is_rejected() {
    let p = CodecParams::default();
    assert!(matches!(
        encode_layer(&[1.0, f32::NAN], 1, 2, None, &p, InputDtype::F32),
        Err(Error::NonFinite { index: 1 })
    ));
    assert!(matches!(
        encode_layer(&[1.0; 5], 2, 3, None, &p, InputDtype::F32),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        encode_layer(&[], 0, 3, None, &p, InputDtype::F32),
        Err(Error::Shape(_))
    ));
    let bad = CodecParams { bit_width: 7, ..p };
    assert!(matches!(
        encode_layer(&[1.0; 4], 2, 2, None, &bad, InputDtype::F32),
        Err(Error::InvalidParams(_))
    ));
}

#[test]
fn corrupt_bytes_never_panic() {
    let (n, d) = (300, 16);
    let x = kv_like(n, d, 10);
    let p = CodecParams {
        block_size: 128,
        ..Default::default()
    };
    let enc = encode_layer(&x, n, d, None, &p, InputDtype::F32).unwrap();
    let good = enc.as_bytes().to_vec();
    for cut in 0..good.len() {
        assert!(EncodedLayer::from_bytes(good[..cut].to_vec()).is_err());
    }
    let mut g = SplitMix64::new(1, 2);
    for _ in 0..2000 {
        let mut b = good.clone();
        let i = g.below(b.len());
        b[i] ^= 1 << g.below(8);
        assert!(EncodedLayer::from_bytes(b).unwrap_err().is_format_error());
    }
}

#[test]
fn stage_errors_are_ordered() {
    let (n, d) = (512, 32);
    let x = kv_like(n, d, 11);
    let p = CodecParams {
        variance_ratio: 0.95,
        ..Default::default()
    };
    let s = stage_errors(&x, n, d, &p).unwrap();
    assert!(s.pca > 0.0 && s.pca <= s.quantised + 1e-9);
    assert!(s.skeleton >= s.pca);
    assert!(s.full <= s.quantised + 1e-6);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn roundtrip_error_is_bounded(
        n in 1usize..80, d in 1usize..24, bits in prop::sample::select(vec![2u8, 3, 4, 8]),
        k in 0usize..5, seed in any::<u64>(), share in any::<bool>(),
    ) {
        let x = kv_like(n, d, seed);
        let p = CodecParams { bit_width: bits, k: k.min(16), block_size: 32, seed, share_basis: share, ..Default::default() };
        let enc = encode_layer(&x, n, d, None, &p, InputDtype::F32).unwrap();
        let y = decode_layer(&enc).unwrap();
        let back = EncodedLayer::from_bytes(enc.as_bytes().to_vec()).unwrap();
        prop_assert_eq!(decode_layer(&back).unwrap(), y.clone());
        // Loose, bit-width-dependent bound: catches scale bugs (which give errors >= 1).
        let bound = match bits { 2 => 0.45, 3 => 0.3, 4 => 0.2, _ => 0.05 };
        let e = rel_err(&x, &y);
        prop_assert!(e < bound, "n={} d={} bits={} err={}", n, d, bits, e);
    }
}

#[test]
fn pca_none_stores_no_basis_and_roundtrips() {
    let (n, d) = (1024, 64);
    let x = kv_like(n, d, 12);
    let none = CodecParams {
        pca_method: PcaMethod::None,
        k: 0,
        bit_width: 3,
        ..Default::default()
    };
    let exact = CodecParams {
        pca_method: PcaMethod::Exact,
        ..none.clone()
    };
    let (yn, en) = roundtrip(&x, n, d, &none);
    let (_, ee) = roundtrip(&x, n, d, &exact);
    assert_eq!(en.stats()[0].d_eff, d);
    // Two blocks' D x D fp16 bases are not stored.
    let outl = |e: &EncodedLayer| {
        e.stats()
            .iter()
            .map(|s| s.n_outliers as isize)
            .sum::<isize>()
    };
    let diff = ee.nbytes() as isize - en.nbytes() as isize;
    assert_eq!(diff, 2 * (d * d * 2) as isize + 6 * (outl(&ee) - outl(&en)));
    assert!(rel_err(&x, &yn) < 0.2);
    let back = EncodedLayer::from_bytes(en.as_bytes().to_vec()).unwrap();
    assert_eq!(decode_layer(&back).unwrap(), yn);
    let bad = CodecParams {
        variance_ratio: 0.9,
        ..none
    };
    assert!(bad.validate().is_err());
}

fn waterfill(bpv: f32) -> CodecParams {
    CodecParams {
        allocation: Allocation::Waterfill,
        bits_per_value: bpv,
        k: 0,
        ..Default::default()
    }
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
    let uniform = CodecParams {
        bit_width: 2,
        k: 0,
        ..Default::default()
    };
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
    let p = CodecParams {
        outlier_threshold: f32::INFINITY,
        pca_method: PcaMethod::None,
        ..waterfill(1.5)
    };
    let enc = encode_layer(&x, n, d, None, &p, InputDtype::F32).unwrap();
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
fn external_basis_is_not_stored_and_must_match() {
    let (n, d) = (1024, 32);
    let x = kv_like(n, d, 16);
    let fit = crate::pca::fit_exact(&x, n, d, None, 1.0, d).unwrap();
    let basis = ExternalBasis::new(fit.basis.clone(), d, d).unwrap();
    let p = waterfill(2.0);
    let with = encode_layer_with(&x, n, d, None, &p, InputDtype::F32, Some(&basis)).unwrap();
    let own = encode_layer(&x, n, d, None, &p, InputDtype::F32).unwrap();
    assert!(with.nbytes() + 2 * d * d * 2 - 12 - 200 <= own.nbytes());
    assert_eq!(with.external_fingerprint(), Some(basis.fingerprint()));
    assert!(matches!(decode_layer(&with), Err(Error::InvalidParams(_))));
    let mut other = fit.basis.clone();
    other.swap(0, d); // swap two entries: a different (non-orthonormal) basis is rejected
    assert!(ExternalBasis::new(other, d, d).is_err());
    let mut flipped = fit.basis.clone();
    flipped[..d].iter_mut().for_each(|v| *v = -*v);
    let wrong = ExternalBasis::new(flipped, d, d).unwrap();
    assert!(matches!(
        decode_layer_with(&with, Some(&wrong)),
        Err(Error::InvalidParams(_))
    ));
    let y = decode_layer_with(&with, Some(&basis)).unwrap();
    assert!(rel_err(&x, &y) < 0.15);
    let back = EncodedLayer::from_bytes(with.as_bytes().to_vec()).unwrap();
    assert_eq!(decode_layer_with(&back, Some(&basis)).unwrap(), y);
    assert!(ExternalBasis::new(vec![1.0; 4], 2, 2).is_err());
}

#[test]
fn corrupt_waterfill_bytes_never_panic() {
    let (n, d) = (300, 16);
    let x = kv_like(n, d, 17);
    let fit = crate::pca::fit_exact(&x, n, d, None, 1.0, d).unwrap();
    let basis = ExternalBasis::new(fit.basis, d, d).unwrap();
    let p = CodecParams {
        block_size: 128,
        outlier_threshold: 2.5,
        ..waterfill(1.7)
    };
    for ext in [None, Some(&basis)] {
        let enc = encode_layer_with(&x, n, d, None, &p, InputDtype::F32, ext).unwrap();
        let good = enc.as_bytes().to_vec();
        for cut in 0..good.len() {
            assert!(EncodedLayer::from_bytes(good[..cut].to_vec()).is_err());
        }
        let mut g = SplitMix64::new(3, 4);
        for _ in 0..2000 {
            let mut b = good.clone();
            let i = g.below(b.len());
            b[i] ^= 1 << g.below(8);
            assert!(EncodedLayer::from_bytes(b).unwrap_err().is_format_error());
        }
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
        let enc = encode_layer(&x, n, d, None, &p, InputDtype::F32).unwrap();
        let y = decode_layer(&enc).unwrap();
        let back = EncodedLayer::from_bytes(enc.as_bytes().to_vec()).unwrap();
        prop_assert_eq!(decode_layer(&back).unwrap(), y.clone());
        // Below one bit per value some components get no bits: error <= the signal itself.
        prop_assert!(rel_err(&x, &y) < 1.0);
        prop_assert!(y.iter().all(|v| v.is_finite()));
    }
}

#[test]
fn zero_weight_blocks_and_far_out_tokens_encode_and_decode() {
    // Found by fuzzing: a block whose weights are all zero, and a zero-weight token far
    // outside the weighted scale, must still round-trip through the wire format.
    let p = CodecParams {
        block_size: 1,
        k: 0,
        ..Default::default()
    };
    let enc = encode_layer(&[1.0, 2.0], 2, 1, Some(&[0.0, 1.0]), &p, InputDtype::F32).unwrap();
    EncodedLayer::from_bytes(enc.as_bytes().to_vec()).unwrap();
    let p = CodecParams {
        k: 0,
        allocation: Allocation::Waterfill,
        bits_per_value: 4.0,
        ..Default::default()
    };
    let x = [1000.0, -1000.0, 500.0, 0.0, 0.001, 0.002, -0.001, 0.0];
    let enc = encode_layer(&x, 2, 4, Some(&[0.0, 1.0]), &p, InputDtype::F32).unwrap();
    let back = EncodedLayer::from_bytes(enc.as_bytes().to_vec()).unwrap();
    assert!(decode_layer(&back).unwrap().iter().all(|v| v.is_finite()));
}
