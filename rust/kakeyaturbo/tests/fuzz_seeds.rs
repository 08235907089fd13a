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

use kakeyaturbo::{encode_layer, CodecParams, InputDtype, Metric, PcaMethod, SkeletonDtype};

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
}
