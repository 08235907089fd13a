//! Arbitrary small shapes and parameters -> `encode_layer_with` -> `from_bytes` ->
//! `decode_layer_with`. Contract under test: for valid parameters and finite input within
//! the supported range, every step succeeds, the parsed layer matches the encoder's
//! (parameters, shape, dtype, stats), and the output has `n * d` finite values. Invalid
//! parameters must be rejected with `Error::InvalidParams`, never a panic.
#![no_main]

use arbitrary::Arbitrary;
use kakeyaturbo::rng::SplitMix64;
use kakeyaturbo::{
    decode_layer, decode_layer_with, encode_layer_with, Allocation, CodecParams, EncodedLayer,
    Error, ExternalBasis, InputDtype, Metric, PcaMethod, SkeletonDtype,
};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Case {
    n: u8,
    d: u8,
    block_size: u8,
    bit_sel: u8,
    k: u8,
    kmeans_iters: u8,
    pca_sel: u8,
    target_rank: u8,
    oversample: u8,
    power_iters: u8,
    variance_pct: u8,
    rank_cap: u8,
    share_basis: bool,
    inner_product: bool,
    outlier_sel: u8,
    skeleton_sel: u8,
    dtype_sel: u8,
    seed: u64,
    centroid_scale: Option<u8>,
    /// Water-filling budget in 1/16 bit per value (0 selects uniform allocation).
    waterfill_sixteenths: u8,
    /// Rows of an identity-like external basis (`None`: fit a basis).
    external_rows: Option<u8>,
    weights: Option<Vec<u8>>,
    magnitude_sel: u8,
    data_seed: u64,
    /// Raw values overriding the seeded data, element by element (lets the fuzzer build
    /// constant, repeated, zero and low-rank inputs).
    raw: Vec<i16>,
}

fuzz_target!(|c: Case| {
    let n = 1 + c.n as usize; // 1..=256
    let d = 1 + (c.d % 96) as usize; // 1..=96
    let bit_width = [1u8, 2, 3, 4, 8][c.bit_sel as usize % 5];
    let pca_method =
        [PcaMethod::Exact, PcaMethod::Randomized, PcaMethod::None][c.pca_sel as usize % 3];
    let waterfill = c.waterfill_sixteenths % 129 != 0;
    let centroids = c.centroid_scale.filter(|_| !waterfill).map(|s| {
        let g = kakeyaturbo::lloyd_max::gaussian(bit_width).unwrap();
        let f = 0.25 + s as f32 / 64.0;
        g.levels().iter().map(|v| v * f).collect::<Vec<f32>>()
    });
    let p = CodecParams {
        block_size: 1 + c.block_size as usize,
        bit_width,
        pca_method,
        target_rank: if pca_method == PcaMethod::Randomized {
            (c.target_rank % 100) as usize
        } else {
            0
        },
        oversample: (c.oversample % 16) as usize,
        power_iters: (c.power_iters % 4) as usize,
        // 'none' keeps every dimension: it requires variance_ratio 1 and no rank cap.
        variance_ratio: if pca_method == PcaMethod::None {
            1.0
        } else {
            (1 + c.variance_pct % 100) as f32 / 100.0
        },
        rank_cap: if pca_method == PcaMethod::None {
            0
        } else {
            (c.rank_cap % 100) as usize
        },
        share_basis: c.share_basis,
        // Water-filling codes PCA components directly: no skeleton.
        k: if waterfill { 0 } else { (c.k % 33) as usize },
        kmeans_iters: (c.kmeans_iters % 10) as usize,
        metric: if c.inner_product {
            Metric::InnerProduct
        } else {
            Metric::Mse
        },
        outlier_threshold: [0.5, 2.0, 4.0, f32::INFINITY][c.outlier_sel as usize % 4],
        skeleton_dtype: [SkeletonDtype::F16, SkeletonDtype::Bf16, SkeletonDtype::F32]
            [c.skeleton_sel as usize % 3],
        seed: c.seed,
        centroids,
        allocation: if waterfill {
            Allocation::Waterfill
        } else {
            Allocation::Uniform
        },
        bits_per_value: if waterfill {
            (c.waterfill_sixteenths % 129) as f32 / 16.0
        } else {
            CodecParams::default().bits_per_value
        },
        ..Default::default()
    };
    let external = c.external_rows.filter(|_| !c.share_basis).map(|r| {
        // Identity rows e_0 .. e_{d_eff-1}: orthonormal by construction.
        let d_eff = 1 + r as usize % d;
        let mut rows = vec![0.0f32; d_eff * d];
        for j in 0..d_eff {
            rows[j * d + j] = 1.0;
        }
        ExternalBasis::new(rows, d_eff, d).expect("identity rows are a valid basis")
    });
    let input_dtype =
        [InputDtype::F32, InputDtype::F16, InputDtype::Bf16][c.dtype_sel as usize % 3];
    let magnitude = [1e-3f32, 1.0, 100.0, 30_000.0][c.magnitude_sel as usize % 4];
    let mut g = SplitMix64::new(c.data_seed, 0);
    let mut x: Vec<f32> = (0..n * d)
        .map(|_| ((g.next_f64() * 2.0 - 1.0) as f32) * magnitude)
        .collect();
    for (v, &r) in x.iter_mut().zip(&c.raw) {
        *v = r as f32 / i16::MAX as f32 * magnitude;
    }
    let weights: Option<Vec<f32>> = c.weights.map(|w| {
        (0..n)
            .map(|i| w.get(i).copied().unwrap_or(1) as f32)
            .collect()
    });

    if let Err(e) = p.validate() {
        assert!(matches!(e, Error::InvalidParams(_)), "{e:?}");
        return;
    }
    let encode = || {
        encode_layer_with(
            &x,
            n,
            d,
            weights.as_deref(),
            &p,
            input_dtype,
            external.as_ref(),
        )
    };
    // Weights that are zero everywhere are invalid for the layer (a clear error); a block
    // whose weights are all zero is fine (it is coded unweighted).
    if weights.as_ref().is_some_and(|w| w.iter().all(|&v| v == 0.0)) {
        let r = encode();
        assert!(matches!(r, Err(Error::InvalidParams(_))), "{r:?}");
        return;
    }
    let enc = encode().unwrap_or_else(|e| panic!("encode failed: {e:?}\nparams {p:?}"));
    let parsed = EncodedLayer::from_bytes(enc.as_bytes().to_vec())
        .unwrap_or_else(|e| panic!("from_bytes of a fresh encoding failed: {e:?}\nparams {p:?}"));
    assert_eq!(parsed.params(), enc.params());
    assert_eq!(parsed.shape(), (n, d));
    assert_eq!(parsed.input_dtype(), input_dtype);
    assert_eq!(parsed.stats(), enc.stats());
    assert_eq!(parsed.external_fingerprint(), enc.external_fingerprint());
    if external.is_some() {
        // Without its basis the layer must refuse to decode, not guess.
        assert!(matches!(
            decode_layer(&parsed),
            Err(Error::InvalidParams(_))
        ));
    }
    let out = decode_layer_with(&parsed, external.as_ref())
        .unwrap_or_else(|e| panic!("decode failed: {e:?}\nparams {p:?}"));
    assert_eq!(out.len(), n * d);
    if let Some(i) = out.iter().position(|v| !v.is_finite()) {
        panic!("non-finite decoded value {} at {i}\nparams {p:?}", out[i]);
    }
});
