//! Golden files for wire format version 1.
//!
//! `tests/golden/<case>.bin` are encodings of deterministic inputs (see `common::kv_like`,
//! seeded `SplitMix64`, arithmetic only) and `<case>.decoded.f32` their decoded values as
//! little-endian f32. The tests check that
//! - (a) every golden file decodes to exactly (bit for bit) the stored values;
//! - (b) re-encoding the same input with the same parameters reproduces the golden bytes
//!   byte for byte: any accidental change to the encoder or the format fails here;
//! - (c) every truncation and 2,000 random single-bit flips of each file are rejected by
//!   `EncodedLayer::from_bytes` with an error for which `is_format_error()` is true.
//!
//! A *deliberate* change of the encoder's output must bump `FORMAT_VERSION` (and keep the
//! version-1 files readable) or, if the bytes change while the format does not, regenerate
//! the files and say why in the commit:
//!
//! ```text
//! KAKEYATURBO_REGEN_GOLDEN=1 cargo test -p kakeyaturbo --test golden
//! ```
//!
//! Regeneration rewrites every file in `tests/golden/` and then runs the checks on them.

mod common;

use std::fs;
use std::path::PathBuf;
use std::sync::OnceLock;

use kakeyaturbo::rng::SplitMix64;
use kakeyaturbo::{
    decode_layer, encode_layer, Allocation, CodecParams, EncodedLayer, InputDtype, Metric,
    PcaMethod, SkeletonDtype,
};

/// One golden encoding: its file stem, input and parameters.
struct Case {
    name: &'static str,
    n: usize,
    d: usize,
    seed: u64,
    dtype: InputDtype,
    weighted: bool,
    params: CodecParams,
}

fn cases() -> Vec<Case> {
    vec![
        // f32 input, per-block basis, 3 bits, 4 skeleton centres, f16 side information.
        Case {
            name: "v1_f32_block_b3_k4",
            n: 48,
            d: 16,
            seed: 1,
            dtype: InputDtype::F32,
            weighted: false,
            params: CodecParams {
                block_size: 64,
                bit_width: 3,
                k: 4,
                seed: 11,
                ..Default::default()
            },
        },
        // One shared basis for the layer, 4 bits, no skeleton, inner-product scales.
        Case {
            name: "v1_shared_b4_k0_ip",
            n: 40,
            d: 16,
            seed: 2,
            dtype: InputDtype::F32,
            weighted: false,
            params: CodecParams {
                block_size: 20,
                bit_width: 4,
                k: 0,
                share_basis: true,
                metric: Metric::InnerProduct,
                variance_ratio: 0.99,
                seed: 22,
                ..Default::default()
            },
        },
        // bf16 input, calibrated 2-bit centroids, f32 side information.
        Case {
            name: "v1_bf16_custom_b2_skf32",
            n: 32,
            d: 8,
            seed: 3,
            dtype: InputDtype::Bf16,
            weighted: false,
            params: CodecParams {
                block_size: 32,
                bit_width: 2,
                k: 2,
                skeleton_dtype: SkeletonDtype::F32,
                centroids: Some(vec![-1.5, -0.5, 0.5, 1.5]),
                seed: 33,
                ..Default::default()
            },
        },
        // Several blocks with a short last one, randomized PCA with a rank cap, 8 bits,
        // bf16 side information, f16 input, token weights and a low outlier threshold.
        Case {
            name: "v1_multiblock_rsvd_b8",
            n: 70,
            d: 16,
            seed: 4,
            dtype: InputDtype::F16,
            weighted: true,
            params: CodecParams {
                block_size: 32,
                bit_width: 8,
                k: 2,
                pca_method: PcaMethod::Randomized,
                target_rank: 6,
                oversample: 4,
                power_iters: 1,
                rank_cap: 4,
                outlier_threshold: 2.0,
                skeleton_dtype: SkeletonDtype::Bf16,
                seed: 44,
                ..Default::default()
            },
        },
        // 1 bit, several full blocks and a one-vector last block.
        Case {
            name: "v1_b1_last_block_single",
            n: 33,
            d: 8,
            seed: 5,
            dtype: InputDtype::F32,
            weighted: false,
            params: CodecParams {
                block_size: 16,
                bit_width: 1,
                k: 3,
                variance_ratio: 0.9,
                seed: 55,
                ..Default::default()
            },
        },
        // Water-filling over a shared basis truncated at 99% variance (the default recipe).
        Case {
            name: "v1_waterfill_shared_vr99",
            n: 40,
            d: 16,
            seed: 6,
            dtype: InputDtype::F32,
            weighted: false,
            params: CodecParams {
                block_size: 16,
                k: 0,
                allocation: Allocation::Waterfill,
                bits_per_value: 2.0,
                share_basis: true,
                variance_ratio: 0.99,
                seed: 66,
                ..Default::default()
            },
        },
        // Water-filling without a basis (pca 'none'), f16 input, outliers on.
        Case {
            name: "v1_waterfill_none_f16",
            n: 24,
            d: 8,
            seed: 7,
            dtype: InputDtype::F16,
            weighted: false,
            params: CodecParams {
                block_size: 32,
                k: 0,
                allocation: Allocation::Waterfill,
                bits_per_value: 1.5,
                pca_method: PcaMethod::None,
                outlier_threshold: 2.0,
                seed: 77,
                ..Default::default()
            },
        },
    ]
}

fn input(c: &Case) -> (Vec<f32>, Option<Vec<f32>>) {
    let mut x = common::kv_like(c.n, c.d, c.seed);
    match c.dtype {
        InputDtype::F32 => {}
        InputDtype::F16 => common::round_f16(&mut x),
        InputDtype::Bf16 => common::round_bf16(&mut x),
    }
    let w = c.weighted.then(|| common::weights(c.n, c.seed));
    (x, w)
}

fn encode(c: &Case) -> EncodedLayer {
    let (x, w) = input(c);
    encode_layer(&x, c.n, c.d, w.as_deref(), &c.params, c.dtype)
        .unwrap_or_else(|e| panic!("{}: encode failed: {e}", c.name))
}

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("golden")
}

fn f32s_to_le(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn le_to_f32s(b: &[u8]) -> Vec<f32> {
    assert_eq!(b.len() % 4, 0, "decoded file length is not a multiple of 4");
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Rewrites every golden file, once per test binary, when `KAKEYATURBO_REGEN_GOLDEN=1`.
fn regenerate_if_asked() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        if std::env::var_os("KAKEYATURBO_REGEN_GOLDEN").is_none_or(|v| v != "1") {
            return;
        }
        fs::create_dir_all(dir()).unwrap();
        for c in cases() {
            let enc = encode(&c);
            let dec = decode_layer(&enc).unwrap();
            fs::write(dir().join(format!("{}.bin", c.name)), enc.as_bytes()).unwrap();
            fs::write(
                dir().join(format!("{}.decoded.f32", c.name)),
                f32s_to_le(&dec),
            )
            .unwrap();
        }
    });
}

/// The golden bytes and the stored decoded values of a case.
fn load(c: &Case) -> (Vec<u8>, Vec<f32>) {
    regenerate_if_asked();
    let read = |file: String| {
        fs::read(dir().join(&file)).unwrap_or_else(|e| {
            panic!("{file}: {e} (regenerate with KAKEYATURBO_REGEN_GOLDEN=1, see tests/golden.rs)")
        })
    };
    let bytes = read(format!("{}.bin", c.name));
    let decoded = le_to_f32s(&read(format!("{}.decoded.f32", c.name)));
    (bytes, decoded)
}

#[test]
fn golden_files_are_small() {
    for c in cases() {
        let (bytes, _) = load(&c);
        assert!(bytes.len() <= 8 * 1024, "{}: {} bytes", c.name, bytes.len());
    }
}

#[test]
fn golden_decodes_to_stored_values() {
    for c in cases() {
        let (bytes, want) = load(&c);
        let layer = EncodedLayer::from_bytes(bytes).unwrap_or_else(|e| panic!("{}: {e}", c.name));
        assert_eq!(layer.shape(), (c.n, c.d), "{}", c.name);
        assert_eq!(layer.input_dtype(), c.dtype, "{}", c.name);
        assert_eq!(layer.params(), &c.params, "{}", c.name);
        assert_eq!(
            layer.stats().len(),
            c.n.div_ceil(c.params.block_size),
            "{}",
            c.name
        );
        let got = decode_layer(&layer).unwrap();
        assert_eq!(got.len(), want.len(), "{}", c.name);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{}: value {i}: decoded {g}, stored {w}",
                c.name
            );
        }
    }
}

#[test]
fn golden_reencodes_byte_for_byte() {
    for c in cases() {
        let (bytes, _) = load(&c);
        let enc = encode(&c);
        assert_eq!(
            enc.nbytes(),
            bytes.len(),
            "{}: encoded size changed",
            c.name
        );
        if let Some(i) = enc.as_bytes().iter().zip(&bytes).position(|(a, b)| a != b) {
            panic!(
                "{}: re-encoding differs from the golden file first at byte {i} \
                 (0x{:02x} != 0x{:02x})",
                c.name,
                enc.as_bytes()[i],
                bytes[i]
            );
        }
    }
}

#[test]
fn golden_truncations_fail() {
    for c in cases() {
        let (bytes, _) = load(&c);
        for len in 0..bytes.len() {
            let err = EncodedLayer::from_bytes(bytes[..len].to_vec())
                .expect_err(&format!("{}: truncation to {len} bytes accepted", c.name));
            assert!(
                err.is_format_error(),
                "{}: truncation to {len}: {err:?}",
                c.name
            );
        }
    }
}

#[test]
fn golden_bit_flips_fail() {
    for (ci, c) in cases().iter().enumerate() {
        let (bytes, _) = load(c);
        let mut g = SplitMix64::new(0xF11B, ci as u64);
        for _ in 0..2000 {
            let bit = g.below(bytes.len() * 8);
            let mut flipped = bytes.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            let err = EncodedLayer::from_bytes(flipped)
                .expect_err(&format!("{}: flip of bit {bit} accepted", c.name));
            assert!(
                err.is_format_error(),
                "{}: flip of bit {bit}: {err:?}",
                c.name
            );
        }
    }
}
