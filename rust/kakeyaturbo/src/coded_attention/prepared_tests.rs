//! Keys made ahead ([`PreparedKeys`]) give the key logits bit for bit, whichever thread made
//! which block.

use super::api::logits_with;
use super::tests::{coded_at, normals, rotation_table};
use super::*;
use crate::codec::EncodedLayer;

#[test]
fn prepared_keys_give_the_same_logits_bit_for_bit() {
    let (d, streams, heads, g, lens) = (64, 6, 3, 3, [32usize, 32, 17]);
    // 0.75 bits: some coordinates get none, so the products' fixed share is in the keys.
    let (encs, _) = coded_at(streams, &lens, d, 0.75);
    let refs: Vec<&EncodedLayer> = encs.iter().collect();
    let c = CodedStreams::new(&refs, streams).unwrap();
    let n = refs.len();
    let frames = normals(heads * d * d, 1);
    let rot = rotation_table(c.tokens(), d / 2);
    let rotation = RopeAngles {
        values: &rot,
        rows: 1,
        pairs: d / 2,
        repeats: 1,
    };
    // Token norms: the prepared path divides by the lengths it kept of the decoded tokens.
    let norms: Vec<f32> = normals(streams * c.tokens(), 2)
        .iter()
        .map(|v| v.abs() + 0.1)
        .collect();
    let norms = Norms::Values(&norms);
    let q = normals(streams * g * d, 3);
    // Made for norms; made without (int16 levels skip the lengths, so attention with norms
    // makes those blocks again); no norms at all.
    let cases = [(Some(&norms), true), (Some(&norms), false), (None, false)];
    let layouts = [
        (Some((frames.as_slice(), heads)), Some(&rotation)),
        (None, None), // the decoded codes are the keys
    ];
    for precision in [Precision::F32, Precision::Bf16, Precision::I16] {
        for (norms, token_norms) in cases {
            for (frames, rotation) in layouts {
                let keys = KeyInputs {
                    frames,
                    rotation,
                    precision,
                };
                let logits =
                    |p: Option<&PreparedKeys>| logits_with(&c, &keys, norms, &q, g, p).unwrap();
                let want = logits(None);
                let what = format!(
                    "{precision:?}, frames {}, norms {}, made for norms {token_norms}",
                    frames.is_some(),
                    norms.is_some()
                );

                let all = PreparedKeys::new(n);
                assert_eq!(all.prepare(&c, &keys, token_norms).unwrap(), n, "{what}");
                assert_eq!(all.prepared(), n);
                assert_eq!(logits(Some(&all)), want, "{what}: every block prepared");

                // Blocks attention took first are left to it.
                let some = PreparedKeys::new(n);
                for i in (1..n).step_by(2) {
                    assert!(some.take(i).is_none());
                }
                assert_eq!(
                    some.prepare(&c, &keys, token_norms).unwrap(),
                    n.div_ceil(2),
                    "{what}"
                );
                assert_eq!(logits(Some(&some)), want, "{what}: half prepared");

                // Made on another thread while attention runs: they meet somewhere.
                for _ in 0..4 {
                    let racing = PreparedKeys::new(n);
                    std::thread::scope(|scope| {
                        scope.spawn(|| racing.prepare(&c, &keys, token_norms).unwrap());
                        assert_eq!(logits(Some(&racing)), want, "{what}: racing");
                    });
                }

                let cancelled = PreparedKeys::new(n);
                cancelled.cancel();
                assert_eq!(cancelled.prepare(&c, &keys, token_norms).unwrap(), 0);
                assert_eq!(logits(Some(&cancelled)), want);
            }
        }
    }
    // Made for another number of blocks: refused by both.
    let keys = KeyInputs {
        frames: None,
        rotation: None,
        precision: Precision::F32,
    };
    let other = PreparedKeys::new(n - 1);
    let err = other.prepare(&c, &keys, false).unwrap_err().to_string();
    assert!(err.contains("prepared keys of 17 blocks for 18"), "{err}");
    assert!(logits_with(&c, &keys, None, &q, g, Some(&other)).is_err());
}
