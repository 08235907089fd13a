//! The `attend` fuzz target's contract (`support/attend_case.rs`) on a fixed, seeded corpus:
//! honest encodings of several parameter sets, each with random control bytes and a few
//! bytes flipped or set, 20 000 cases in all. `cargo fuzz` explores further; this keeps the
//! contract in the normal test run, where cargo-fuzz is not installed.

#[path = "support/attend_case.rs"]
mod attend_case;

use attend_case::{check, Outcome, CONTROL};
use kakeyaturbo::rng::SplitMix64;
use kakeyaturbo::{encode_layer, Allocation, CodecParams, InputDtype, PcaMethod};

const CASES: usize = 2_000;

fn honest() -> Vec<Vec<u8>> {
    let mut g = SplitMix64::new(71, 0);
    let mut data = |n: usize, d: usize, scale: f64| -> Vec<f32> {
        (0..n * d).map(|_| (g.normal() * scale) as f32).collect()
    };
    let base = CodecParams {
        block_size: 16,
        k: 2,
        ..Default::default()
    };
    let sets = [
        (base.clone(), 16, 8, 1.0),
        (
            CodecParams {
                bit_width: 2,
                ..base.clone()
            },
            24,
            16,
            3.0,
        ),
        (
            CodecParams {
                allocation: Allocation::Waterfill,
                pca_method: PcaMethod::None,
                k: 0,
                block_size: 32,
                ..base.clone()
            },
            32,
            8,
            1.0,
        ),
        (
            CodecParams {
                outlier_threshold: 2.0,
                ..base.clone()
            },
            12,
            6,
            50.0,
        ),
    ];
    sets.into_iter()
        .map(|(p, n, d, scale)| {
            let x = data(n, d, scale);
            encode_layer(&x, n, d, None, &p, InputDtype::F32)
                .expect("honest encoding")
                .as_bytes()
                .to_vec()
        })
        .collect()
}

#[test]
fn seeded_mutations_meet_the_attend_contract() {
    let seeds = honest();
    let mut g = SplitMix64::new(0x00A7_7E4D, 1);
    let mut checked = 0;
    for i in 0..CASES {
        let blob = &seeds[i % seeds.len()];
        let mut data: Vec<u8> = (0..CONTROL).map(|_| g.next_u64() as u8).collect();
        data.extend_from_slice(blob);
        // A quarter of the cases unmutated, so that every kernel path runs on honest bytes.
        for _ in 0..g.below(4) {
            let at = CONTROL + g.below(blob.len());
            data[at] = match g.below(3) {
                0 => data[at] ^ (1 << g.below(8)),
                1 => [0x00, 0xFF, 0x7F, 0x80][g.below(4)],
                _ => g.next_u64() as u8,
            };
        }
        if check(&data) == Outcome::Checked {
            checked += 1;
        }
    }
    // Not vacuous: most cases get past the parser and through every kernel.
    assert!(
        checked > CASES / 4,
        "only {checked} of {CASES} cases reached the kernels"
    );
}

/// Writes the honest encodings, each behind a few control patterns, into the `attend` fuzz
/// target's corpus (`fuzz/corpus/attend/`, git-ignored).
#[test]
#[ignore = "writes the fuzz seed corpus; run explicitly"]
fn write_attend_seeds() {
    let out = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/attend");
    std::fs::create_dir_all(&out).unwrap();
    for (i, blob) in honest().iter().enumerate() {
        for control in [[0u8; CONTROL], [0x7F, 0xFF, 0x05, 1], [0x3A, 0x5D, 0x02, 2]] {
            let mut data = control.to_vec();
            data.extend_from_slice(blob);
            let name = format!("seed-{i}-{:02x}{:02x}", control[0], control[1]);
            std::fs::write(out.join(name), data).unwrap();
        }
    }
}
