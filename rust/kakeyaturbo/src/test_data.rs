//! Inputs and helpers shared by the unit tests of several stages.

use crate::basis::ExternalBasis;
use crate::codec::{
    decode_layer, decode_layer_into, decode_layer_with, encode_layer, EncodedLayer,
};
use nalgebra::DMatrix;

use crate::params::{Allocation, CodecParams, InputDtype};
use crate::rng::SplitMix64;

/// KV-like data: a mean offset, a decaying spectrum and one outlier channel.
pub(crate) fn kv_like(n: usize, d: usize, seed: u64) -> Vec<f32> {
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

/// Rows with variance `scales[j]^2` along a random orthonormal frame.
pub(crate) fn anisotropic(n: usize, d: usize, seed: u64) -> Vec<f32> {
    let mut g = SplitMix64::new(seed, 9);
    let frame = DMatrix::from_fn(d, d, |_, _| g.normal()).qr().q();
    let mut x = vec![0.0f32; n * d];
    for i in 0..n {
        let z: Vec<f64> = (0..d)
            .map(|j| g.normal() * 4.0 / (1.0 + j as f64))
            .collect();
        for c in 0..d {
            let mut v = 1.5;
            for (j, zj) in z.iter().enumerate() {
                v += frame[(c, j)] * zj;
            }
            x[i * d + c] = v as f32;
        }
    }
    x
}

/// `len` standard normal samples from the generator `(seed, stream)`.
pub(crate) fn normal_samples(len: usize, seed: u64, stream: u64) -> Vec<f32> {
    let mut g = SplitMix64::new(seed, stream);
    (0..len).map(|_| g.normal() as f32).collect()
}

/// Equal weights (sum 1) for `n` vectors.
pub(crate) fn uniform_weights(n: usize) -> Vec<f64> {
    vec![1.0 / n as f64; n]
}

/// Encodes `x` (`n x d`, f32, unweighted).
pub(crate) fn encode_f32(x: &[f32], n: usize, d: usize, p: &CodecParams) -> EncodedLayer {
    encode_layer(x, n, d, None, p, InputDtype::F32).unwrap()
}

/// Encodes `x` (`n x d`, f32) and decodes it again.
pub(crate) fn roundtrip(
    x: &[f32],
    n: usize,
    d: usize,
    p: &CodecParams,
) -> (Vec<f32>, EncodedLayer) {
    let enc = encode_f32(x, n, d, p);
    (decode_layer(&enc).unwrap(), enc)
}

/// Default parameters with water-filling at `bpv` bits per value.
pub(crate) fn waterfill(bpv: f32) -> CodecParams {
    CodecParams {
        allocation: Allocation::Waterfill,
        bits_per_value: bpv,
        k: 0,
        ..Default::default()
    }
}

/// `base` with `edit` applied: a test's parameters, changed in a field or two.
pub(crate) fn edited(base: &CodecParams, edit: impl FnOnce(&mut CodecParams)) -> CodecParams {
    let mut p = base.clone();
    edit(&mut p);
    p
}

/// The default parameters with `edit` applied.
pub(crate) fn params(edit: impl FnOnce(&mut CodecParams)) -> CodecParams {
    edited(&CodecParams::default(), edit)
}

/// Outliers stored in all of a layer's blocks.
pub(crate) fn total_outliers(e: &EncodedLayer) -> isize {
    e.stats().iter().map(|s| s.n_outliers as isize).sum()
}

/// Every truncation of a valid encoding and 2,000 random single-bit flips (drawn from
/// `seed`) are rejected by `from_bytes`, the flips with a format error; none panics.
pub(crate) fn assert_corruption_is_rejected(good: &[u8], seed: u64) {
    for cut in 0..good.len() {
        assert!(EncodedLayer::from_bytes(good[..cut].to_vec()).is_err());
    }
    let mut g = SplitMix64::new(seed, seed + 1);
    for _ in 0..2000 {
        let mut b = good.to_vec();
        let i = g.below(b.len());
        b[i] ^= 1 << g.below(8);
        assert!(EncodedLayer::from_bytes(b).unwrap_err().is_format_error());
    }
}

/// Both corruption checks of a valid encoding: [`assert_corruption_is_rejected`] drawn from
/// `seed`, [`assert_resealed_corruption_is_safe`] (with `external`) from `seed + 1`.
pub(crate) fn assert_corruptions_are_safe(
    good: &[u8],
    external: Option<&ExternalBasis>,
    seed: u64,
) {
    assert_corruption_is_rejected(good, seed);
    assert_resealed_corruption_is_safe(good, external, seed + 1);
}

/// 2,000 random corruptions of a valid encoding (1 to 4 bytes overwritten, drawn from
/// `seed`), each resealed with the right CRC-32 so that it reaches the section parsers and
/// the decoder (as the `decode` fuzz target does): `from_bytes` fails with a format error
/// or yields a layer that decodes (with `external` where it needs one) to finite values of
/// the right length, or refuses with an error; nothing panics.
pub(crate) fn assert_resealed_corruption_is_safe(
    good: &[u8],
    external: Option<&ExternalBasis>,
    seed: u64,
) {
    let mut g = SplitMix64::new(seed, seed ^ 0x5EA1);
    let body = good.len() - crate::format::CRC_LEN;
    for _ in 0..2000 {
        let mut b = good.to_vec();
        for _ in 0..1 + g.below(4) {
            let i = g.below(body);
            b[i] = g.below(256) as u8;
        }
        let crc = crc32fast::hash(&b[..body]);
        b[body..].copy_from_slice(&crc.to_le_bytes());
        let layer = match EncodedLayer::from_bytes(b) {
            Ok(layer) => layer,
            Err(e) => {
                assert!(e.is_format_error(), "{e:?}");
                continue;
            }
        };
        let (n, d) = layer.shape();
        let y = decode_layer_with(&layer, external);
        if let Ok(y) = &y {
            assert_eq!(y.len(), n * d);
            assert!(y.iter().all(|v| v.is_finite()));
        }
        // Decoding into a buffer parses the held bytes without their checksum: the same
        // checks, so the same outcome and the same bits.
        let mut into = vec![f32::NAN; n * d];
        match (decode_layer_into(&layer, external, &mut into), &y) {
            (Ok(()), Ok(y)) => assert!(into.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits())),
            (Err(_), Err(_)) => {}
            (a, b) => panic!(
                "decode_layer_into {a:?}, decode_layer_with {:?}",
                b.as_ref().map(|_| ())
            ),
        }
    }
}
