use super::*;
use crate::codec::{decode_layer, encode_layer};
use crate::params::{CodecParams, InputDtype, PcaMethod};
use crate::rng::SplitMix64;
use crate::test_data::{kv_like, waterfill};

/// `streams` streams of blocks `lens` long (`d` wide), coded frame-free as the pipeline codes
/// them, with the decoded streams `[streams, tokens, d]`.
fn coded(streams: usize, lens: &[usize], d: usize) -> (Vec<EncodedLayer>, Vec<f32>) {
    let p = CodecParams {
        pca_method: PcaMethod::None,
        ..waterfill(2.5)
    };
    let (mut encs, mut dec) = (Vec::new(), Vec::new());
    for s in 0..streams {
        for (b, &n) in lens.iter().enumerate() {
            let x = kv_like(n, d, (s * 31 + b) as u64);
            let pb = CodecParams {
                block_size: n,
                ..p.clone()
            };
            encs.push(encode_layer(&x, n, d, None, &pb, InputDtype::F32).unwrap());
        }
    }
    for s in 0..streams {
        for b in 0..lens.len() {
            dec.extend(decode_layer(&encs[s * lens.len() + b]).unwrap());
        }
    }
    (encs, dec)
}

fn normals(n: usize, seed: u64) -> Vec<f32> {
    let mut g = SplitMix64::new(seed, 3);
    (0..n).map(|_| g.normal() as f32).collect()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1.0);
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * scale,
            "{what}[{i}]: {a} vs {b} (scale {scale})"
        );
    }
}

/// The logits written out the slow way: frame product, RoPE on pairs, norms, dot.
#[allow(clippy::too_many_arguments)]
fn reference_logits(
    y: &[f32],
    streams: usize,
    t_n: usize,
    d: usize,
    frames: &[f32],
    heads: usize,
    rot: &[f32],
    rot_rows: usize,
    pairs: usize,
    norms: &[f32],
    q: &[f32],
    g: usize,
) -> Vec<f32> {
    let mut out = vec![0.0f32; streams * g * t_n];
    for s in 0..streams {
        let m = &frames[(s % heads) * d * d..][..d * d];
        let row = if rot_rows == 1 { 0 } else { s / heads };
        for t in 0..t_n {
            let yt = &y[(s * t_n + t) * d..][..d];
            let mut k: Vec<f64> = (0..d)
                .map(|c| (0..d).map(|j| yt[j] as f64 * m[j * d + c] as f64).sum())
                .collect();
            let cs = &rot[(row * t_n + t) * 2 * pairs..];
            for i in 0..pairs {
                let (c, sn) = (cs[i] as f64, cs[pairs + i] as f64);
                let (a, b) = (k[i], k[pairs + i]);
                k[i] = a * c - b * sn;
                k[pairs + i] = a * sn + b * c;
            }
            let len = yt.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
            let scale = norms[s * t_n + t] as f64 / len.max(1e-12);
            for j in 0..g {
                let qj = &q[(s * g + j) * d..][..d];
                let dot: f64 = qj.iter().zip(&k).map(|(a, b)| *a as f64 * b).sum();
                out[(s * g + j) * t_n + t] = (dot * scale) as f32;
            }
        }
    }
    out
}

#[test]
fn key_logits_match_the_decoded_keys_for_every_tile_width() {
    // d 64 takes the 64-wide tile, 80 adds a 16-wide one, 26 the 16 and 1-wide ones; the last
    // block is shorter, two rows of three heads, rows with their own rotations.
    for (d, pairs) in [(64usize, 32usize), (80, 40), (26, 8)] {
        let (streams, heads, g, lens) = (6, 3, 3, [32usize, 32, 17]);
        let (encs, y) = coded(streams, &lens, d);
        let refs: Vec<&EncodedLayer> = encs.iter().collect();
        let c = CodedStreams::new(&refs, streams).unwrap();
        let t_n = c.tokens();
        assert_eq!(t_n, 81);
        let frames = normals(heads * d * d, 1);
        // Per row and token: the cosines, then the sines, of `pairs` angles.
        let rot: Vec<f32> = (0..2 * t_n)
            .flat_map(|rt| {
                let angle = move |i: usize| (rt * pairs + i) as f32 * 0.37;
                let cos = (0..pairs).map(move |i| angle(i).cos());
                cos.chain((0..pairs).map(move |i| angle(i).sin()))
                    .collect::<Vec<_>>()
            })
            .collect();
        let norms: Vec<f32> = normals(streams * t_n, 2)
            .iter()
            .map(|v| v.abs() + 0.1)
            .collect();
        let q = normals(streams * g * d, 3);
        let rotation = RopeAngles {
            values: &rot,
            rows: 2,
            pairs,
        };
        let got = key_logits(
            &c,
            Some((&frames, heads)),
            Some(rotation),
            Some(&norms),
            &q,
            g,
        )
        .unwrap();
        let want = reference_logits(
            &y, streams, t_n, d, &frames, heads, &rot, 2, pairs, &norms, &q, g,
        );
        assert_close(&got, &want, &format!("logits d={d}"));

        // No frame, no rotation, no norms: plain dots with the decoded codes.
        let got = key_logits(&c, None, None, None, &q, g).unwrap();
        for s in 0..streams {
            for j in 0..g {
                for t in 0..t_n {
                    let want: f32 = (0..d)
                        .map(|i| q[(s * g + j) * d + i] * y[(s * t_n + t) * d + i])
                        .sum();
                    let v = got[(s * g + j) * t_n + t];
                    assert!(
                        (v - want).abs() <= 1e-4 * want.abs().max(1.0),
                        "plain d={d}: {v} vs {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn value_sums_match_the_decoded_values() {
    for d in [64usize, 26] {
        let (streams, g, lens) = (3, 2, [40usize, 9]);
        let (encs, y) = coded(streams, &lens, d);
        let refs: Vec<&EncodedLayer> = encs.iter().collect();
        let c = CodedStreams::new(&refs, streams).unwrap();
        let t_n = c.tokens();
        let mut w: Vec<f32> = normals(streams * g * t_n, 4)
            .iter()
            .map(|v| v.abs())
            .collect();
        w[5] = 0.0; // a masked token
        let norms: Vec<f32> = normals(streams * t_n, 5)
            .iter()
            .map(|v| v.abs() + 0.1)
            .collect();
        for with_norms in [false, true] {
            let got = value_sums(&c, &w, with_norms.then_some(&norms[..]), g).unwrap();
            let mut want = vec![0.0f64; streams * g * d];
            for s in 0..streams {
                for t in 0..t_n {
                    let yt = &y[(s * t_n + t) * d..][..d];
                    let len = yt.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
                    let scale = if with_norms {
                        norms[s * t_n + t] as f64 / len
                    } else {
                        1.0
                    };
                    for j in 0..g {
                        let wt = w[(s * g + j) * t_n + t] as f64 * scale;
                        for i in 0..d {
                            want[(s * g + j) * d + i] += wt * yt[i] as f64;
                        }
                    }
                }
            }
            let want: Vec<f32> = want.iter().map(|v| *v as f32).collect();
            assert_close(&got, &want, &format!("sums d={d} norms={with_norms}"));
        }
    }
}

#[test]
fn fused_and_separate_multiply_adds_agree() {
    // The AVX + FMA build and the baseline build run the same arithmetic up to rounding (a CPU
    // without AVX and FMA has only the baseline build).
    if !avx_fma() {
        return;
    }
    let (d, g) = (80usize, 3usize);
    let y = normals(7 * d, 6);
    let m = normals(d * d, 7);
    let rot: Vec<f32> = (0..7 * 40)
        .map(|i| ((i / 20) as f32 * 0.3 + (i % 20) as f32).sin())
        .collect();
    let norms = [1.5f32; 7];
    let q = normals(g * d, 8);
    let args = (
        &y[..],
        d,
        Some(&m[..]),
        Some((&rot[..], 20)),
        Some(&norms[..]),
        &q[..],
        g,
    );
    let (mut a, mut b) = (vec![0.0f32; g * 7], vec![0.0f32; g * 7]);
    run_block_logits(args, &mut a);
    block_logits::<false>(args, &mut b);
    assert_close(&a, &b, "fma vs mul+add logits");
    let w = normals(g * 7, 9);
    let args = (&y[..], d, &w[..], 7, 0, Some(&norms[..]), g);
    let (mut a, mut b) = (vec![0.0f32; g * d], vec![0.0f32; g * d]);
    run_block_sums(args, &mut a);
    block_sums::<false>(args, &mut b);
    assert_close(&a, &b, "fma vs mul+add sums");
}

#[test]
fn mismatched_layouts_and_lengths_are_refused() {
    let (encs, _) = coded(2, &[16, 8], 64);
    let refs: Vec<&EncodedLayer> = encs.iter().collect();
    assert!(matches!(CodedStreams::new(&refs, 3), Err(Error::Shape(_))));
    assert!(matches!(CodedStreams::new(&[], 1), Err(Error::Shape(_))));
    // Stream 1's blocks in the other order: 8 then 16 tokens against stream 0's 16 then 8.
    let swapped = [refs[0], refs[1], refs[3], refs[2]];
    let e = CodedStreams::new(&swapped, 2).err().unwrap();
    assert!(e.to_string().contains("equal blocks"), "{e}");

    let c = CodedStreams::new(&refs, 2).unwrap();
    let q = vec![0.0f32; 2 * 64];
    assert!(key_logits(&c, None, None, None, &q[1..], 1).is_err());
    let frames = vec![0.0f32; 3 * 64 * 64];
    assert!(key_logits(&c, Some((&frames, 3)), None, None, &q, 1).is_err());
    let rot = vec![0.0f32; 24 * 33 * 2];
    let too_many = RopeAngles {
        values: &rot,
        rows: 1,
        pairs: 33,
    };
    assert!(key_logits(&c, None, Some(too_many), None, &q, 1).is_err());
    let short = RopeAngles {
        values: &rot[2..],
        rows: 1,
        pairs: 33,
    };
    assert!(key_logits(&c, None, Some(short), None, &q, 1).is_err());
    assert!(key_logits(&c, None, None, Some(&[1.0; 3]), &q, 1).is_err());
    assert!(value_sums(&c, &[0.0; 47], None, 1).is_err());
    assert!(value_sums(&c, &[0.0; 48], Some(&[1.0; 47]), 1).is_err());
    assert!(value_sums(&c, &[0.0; 48], None, 1).is_ok());
}
