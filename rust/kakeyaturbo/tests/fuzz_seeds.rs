//! Writes valid encodings into the fuzz corpus (`fuzz/corpus/decode/`, git-ignored) so the
//! `decode` fuzz target starts from inputs that reach every section parser. Not part of the
//! normal test run:
//!
//! ```text
//! cargo test -p kakeyaturbo --test fuzz_seeds -- --ignored
//! ```

mod common;

use std::fs;
use std::path::PathBuf;

use kakeyaturbo::{
    encode_layer, encode_layer_with, Allocation, CodecParams, ExternalBasis, InputDtype, Metric,
    PcaMethod, SkeletonDtype,
};

#[test]
#[ignore = "writes the fuzz seed corpus; run explicitly"]
fn write_fuzz_seeds() {
    let out = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/decode");
    fs::create_dir_all(&out).unwrap();
    let base = CodecParams {
        block_size: 16,
        k: 2,
        ..Default::default()
    };
    let variants: Vec<(&str, CodecParams, usize, usize, InputDtype)> = vec![
        ("default", base.clone(), 20, 8, InputDtype::F32),
        (
            "b1",
            CodecParams {
                bit_width: 1,
                ..base.clone()
            },
            24,
            8,
            InputDtype::F16,
        ),
        (
            "b2_custom",
            CodecParams {
                bit_width: 2,
                centroids: Some(vec![-2.0, -0.5, 0.5, 2.0]),
                ..base.clone()
            },
            17,
            4,
            InputDtype::Bf16,
        ),
        (
            "b4_shared",
            CodecParams {
                bit_width: 4,
                share_basis: true,
                ..base.clone()
            },
            40,
            8,
            InputDtype::F32,
        ),
        (
            "b8_k0",
            CodecParams {
                bit_width: 8,
                k: 0,
                ..base.clone()
            },
            9,
            4,
            InputDtype::F32,
        ),
        (
            "ip_f32",
            CodecParams {
                metric: Metric::InnerProduct,
                skeleton_dtype: SkeletonDtype::F32,
                ..base.clone()
            },
            12,
            6,
            InputDtype::F32,
        ),
        (
            "bf16_sk",
            CodecParams {
                skeleton_dtype: SkeletonDtype::Bf16,
                k: 5,
                ..base.clone()
            },
            33,
            8,
            InputDtype::F32,
        ),
        (
            "rsvd",
            CodecParams {
                pca_method: PcaMethod::Randomized,
                target_rank: 3,
                oversample: 2,
                power_iters: 1,
                ..base.clone()
            },
            20,
            8,
            InputDtype::F32,
        ),
        (
            "outliers",
            CodecParams {
                outlier_threshold: 0.8,
                rank_cap: 3,
                ..base.clone()
            },
            10,
            8,
            InputDtype::F32,
        ),
        (
            "vr",
            CodecParams {
                variance_ratio: 0.8,
                k: 1,
                ..base.clone()
            },
            16,
            12,
            InputDtype::F16,
        ),
        (
            "tiny",
            CodecParams {
                block_size: 1,
                k: 0,
                ..base.clone()
            },
            3,
            2,
            InputDtype::F32,
        ),
        (
            "pca_none",
            CodecParams {
                pca_method: PcaMethod::None,
                ..base.clone()
            },
            20,
            8,
            InputDtype::F32,
        ),
        (
            "pca_none_shared",
            CodecParams {
                pca_method: PcaMethod::None,
                share_basis: true,
                k: 0,
                ..base.clone()
            },
            24,
            4,
            InputDtype::F16,
        ),
        (
            "wide",
            CodecParams {
                block_size: 64,
                k: 4,
                rank_cap: 8,
                ..base
            },
            64,
            32,
            InputDtype::F32,
        ),
    ];
    for (i, (name, p, n, d, dt)) in variants.into_iter().enumerate() {
        let x = common::kv_like(n, d, 100 + i as u64);
        let enc = encode_layer(&x, n, d, None, &p, dt).unwrap();
        fs::write(out.join(format!("seed_{name}.bin")), enc.as_bytes()).unwrap();
    }

    // Water-filling allocation, and a caller-supplied basis (only its fingerprint stored).
    let (n, d) = (20, 8);
    let x = common::kv_like(n, d, 200);
    for (name, alloc) in [
        ("waterfill", Allocation::Waterfill),
        ("external", Allocation::Uniform),
    ] {
        let p = CodecParams {
            block_size: 16,
            k: 0,
            allocation: alloc,
            bits_per_value: 2.5,
            ..Default::default()
        };
        let external = (name == "external").then(|| {
            let d_eff = 4;
            let mut rows = vec![0.0f32; d_eff * d];
            for j in 0..d_eff {
                rows[j * d + j] = 1.0;
            }
            ExternalBasis::new(rows, d_eff, d).unwrap()
        });
        let enc =
            encode_layer_with(&x, n, d, None, &p, InputDtype::F32, external.as_ref()).unwrap();
        fs::write(out.join(format!("seed_{name}.bin")), enc.as_bytes()).unwrap();
    }
}
