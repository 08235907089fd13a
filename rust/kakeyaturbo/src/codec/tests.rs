use proptest::prelude::*;

use super::*;
use crate::stages::rel_err;
use crate::test_data::{
    assert_corruptions_are_safe, encode_f32, kv_like, params, roundtrip, total_outliers,
};

#[test]
fn deterministic_for_fixed_seed_and_seed_matters() {
    let (n, d) = (300, 32);
    let x = kv_like(n, d, 3);
    let p = CodecParams::default();
    let a = encode_f32(&x, n, d, &p);
    let b = encode_f32(&x, n, d, &p);
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
    let p = params(|p| (p.block_size, p.share_basis) = (256, true));
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
    let shared_p = params(|p| p.share_basis = true);
    let shared = encode_f32(&x, n, d, &shared_p);
    // Three fewer D x D fp16 bases and means, minus the shared section's d_eff field;
    // codes, labels and scales have the same sizes, outlier counts may differ.
    let diff = per_block.nbytes() as isize - shared.nbytes() as isize;
    let outliers = total_outliers(&per_block) - total_outliers(&shared);
    assert_eq!(diff, 3 * (64 * 64 + 64) * 2 - 4 + 6 * outliers);
}

#[test]
fn constant_and_tiny_inputs() {
    let x = vec![1.5f32; 10 * 8];
    let (y, _) = roundtrip(&x, 10, 8, &CodecParams::default());
    assert!(rel_err(&x, &y) < 1e-3);
    let x = vec![0.25f32, -1.0, 3.0];
    let (y, _) = roundtrip(&x, 1, 3, &params(|p| (p.k, p.block_size) = (1, 1)));
    assert!(rel_err(&x, &y) < 1e-2);
}

#[test]
fn bad_input_is_rejected() {
    let p = CodecParams::default();
    assert!(matches!(
        encode_layer(&[1.0, f32::NAN], 1, 2, None, &p, InputDtype::F32),
        Err(Error::NonFinite { token: 0, dim: 1 })
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
fn decode_into_matches_decode_and_checks_the_length() {
    let (n, d) = (700, 16);
    let x = kv_like(n, d, 11);
    for p in [
        params(|p| p.block_size = 256),
        params(|p| {
            (
                p.block_size,
                p.allocation,
                p.pca_method,
                p.k,
                p.bits_per_value,
            ) = (
                256,
                crate::params::Allocation::Waterfill,
                crate::params::PcaMethod::None,
                0,
                2.5,
            )
        }),
    ] {
        let (y, enc) = roundtrip(&x, n, d, &p);
        let mut out = vec![f32::NAN; n * d];
        decode_layer_into(&enc, None, &mut out).unwrap();
        assert_eq!(out, y);
        let e = decode_layer_into(&enc, None, &mut out[1..]).unwrap_err();
        assert!(matches!(e, Error::Shape(_)), "{e:?}");
    }
}

#[test]
fn corrupt_bytes_never_panic() {
    let (n, d) = (300, 16);
    let x = kv_like(n, d, 10);
    let p = params(|p| p.block_size = 128);
    let enc = encode_f32(&x, n, d, &p);
    assert_corruptions_are_safe(enc.as_bytes(), None, 1);
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
        let enc = encode_f32(&x, n, d, &p);
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
fn zero_weight_blocks_and_far_out_tokens_encode_and_decode() {
    // Found by fuzzing: a block whose weights are all zero, and a zero-weight token far
    // outside the weighted scale, must still round-trip through the wire format.
    let p = params(|p| (p.block_size, p.k) = (1, 0));
    let enc = encode_layer(&[1.0, 2.0], 2, 1, Some(&[0.0, 1.0]), &p, InputDtype::F32).unwrap();
    EncodedLayer::from_bytes(enc.as_bytes().to_vec()).unwrap();
    let p = params(|p| (p.k, p.allocation, p.bits_per_value) = (0, Allocation::Waterfill, 4.0));
    let x = [1000.0, -1000.0, 500.0, 0.0, 0.001, 0.002, -0.001, 0.0];
    let enc = encode_layer(&x, 2, 4, Some(&[0.0, 1.0]), &p, InputDtype::F32).unwrap();
    let back = EncodedLayer::from_bytes(enc.as_bytes().to_vec()).unwrap();
    assert!(decode_layer(&back).unwrap().iter().all(|v| v.is_finite()));
}

#[test]
fn non_finite_input_is_located_by_token_and_dim() {
    let mut x = kv_like(10, 8, 18);
    x[7 * 8 + 3] = f32::NAN;
    let p = CodecParams::default();
    let err = encode_layer(&x, 10, 8, None, &p, InputDtype::F32).unwrap_err();
    assert_eq!(err, Error::NonFinite { token: 7, dim: 3 });
    assert!(err.to_string().contains("token 7, dim 3"), "{err}");
}

#[test]
fn batch_decode_limit_applies_to_the_total() {
    let (n, d) = (64, 8);
    let x = kv_like(n, d, 19);
    let enc = encode_layer(&x, n, d, None, &CodecParams::default(), InputDtype::F32).unwrap();
    check_batch_decode(&[&enc, &enc, &enc]).unwrap();
    // A layer that decodes to the whole per-layer floor from few bytes passes alone; two of
    // them do not, although each would.
    let big = EncodedLayer {
        n_tokens: crate::format::DECODE_FLOOR / 4 / d,
        ..enc.clone()
    };
    check_batch_decode(&[&big]).unwrap();
    let err = check_batch_decode(&[&big, &big]).unwrap_err();
    assert!(
        err.is_format_error() && err.to_string().contains("decode limit"),
        "{err}"
    );
    check_batch_decode(&[]).unwrap();
}
