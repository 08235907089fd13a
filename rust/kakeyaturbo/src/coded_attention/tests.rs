use super::cpu::*;
use super::frame::*;
use super::inputs::*;
use super::kernels::*;
use super::*;
use crate::codec::{decode_layer, decode_layer_mapped, EncodedLayer};
use crate::error::Error;
use crate::params::PcaMethod;
use crate::test_data::{edited, encode_f32, kv_like, normal_samples, waterfill};
use half::f16;

/// `streams` streams of blocks `lens` long (`d` wide), coded frame-free as the pipeline codes
/// them, with the decoded streams `[streams, tokens, d]`.
fn coded(streams: usize, lens: &[usize], d: usize) -> (Vec<EncodedLayer>, Vec<f32>) {
    coded_at(streams, lens, d, 2.5)
}

/// [`coded`] at `bits` per value.
pub(super) fn coded_at(
    streams: usize,
    lens: &[usize],
    d: usize,
    bits: f32,
) -> (Vec<EncodedLayer>, Vec<f32>) {
    let p = edited(&waterfill(bits), |p| p.pca_method = PcaMethod::None);
    let (mut encs, mut dec) = (Vec::new(), Vec::new());
    for s in 0..streams {
        for (b, &n) in lens.iter().enumerate() {
            let x = kv_like(n, d, (s * 31 + b) as u64);
            let pb = edited(&p, |p| p.block_size = n);
            encs.push(encode_f32(&x, n, d, &pb));
        }
    }
    for s in 0..streams {
        for b in 0..lens.len() {
            dec.extend(decode_layer(&encs[s * lens.len() + b]).unwrap());
        }
    }
    (encs, dec)
}

pub(super) fn normals(n: usize, seed: u64) -> Vec<f32> {
    normal_samples(n, seed, 3)
}

/// The largest `|x|`.
fn largest(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// The largest `|a - b|` of two equally long slices.
fn largest_gap(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = largest(want).max(1.0);
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

/// Coordinates that are the same for every token of their block, over all blocks of `y`
/// (streams of blocks `lens` long, `d` wide).
fn fixed_coordinates(y: &[f32], d: usize, lens: &[usize]) -> usize {
    let mut fixed = 0;
    let mut rest = y;
    while !rest.is_empty() {
        for &n in lens {
            let (block, tail) = rest.split_at(n * d);
            fixed += (0..d)
                .filter(|&j| block.chunks_exact(d).all(|t| t[j] == block[j]))
                .count();
            rest = tail;
        }
    }
    fixed
}

#[test]
fn key_logits_match_the_decoded_keys_for_every_tile_width() {
    // d 64 takes the 64-wide tile, 80 adds a 16-wide one, 26 the 16 and 1-wide ones; the last
    // block is shorter, two rows of three heads, rows with their own rotations.
    for (d, pairs) in [(64usize, 32usize), (80, 40), (26, 8)] {
        let (streams, heads, g, lens) = (6, 3, 3, [32usize, 32, 17]);
        // At 0.75 bits water-filling leaves some coordinates without bits in some blocks, so
        // the kernel's fixed-coordinate share of the frame product (`BlockFrame`) is tested.
        let (encs, y) = coded_at(streams, &lens, d, 0.75);
        let refs: Vec<&EncodedLayer> = encs.iter().collect();
        let c = CodedStreams::new(&refs, streams).unwrap();
        let t_n = c.tokens();
        assert_eq!(t_n, 81);
        let fixed = fixed_coordinates(&y, d, &lens);
        assert!(
            fixed > 0 && fixed < streams * lens.len() * d,
            "d={d}: {fixed} fixed"
        );
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
            repeats: 1,
        };
        let got = key_logits(
            &c,
            Some((&frames, heads)),
            Some(&rotation),
            Some(&Norms::Values(&norms)),
            &q,
            g,
            Precision::F32,
        )
        .unwrap();
        let want = reference_logits(
            &y, streams, t_n, d, &frames, heads, &rot, 2, pairs, &norms, &q, g,
        );
        assert_close(&got, &want, &format!("logits d={d}"));

        // No frame, no rotation, no norms: plain dots with the decoded codes.
        let got = key_logits(&c, None, None, None, &q, g, Precision::F32).unwrap();
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
    // One tile of 1, 2, 3, 5 (16 columns), 7 and 9 rows (8 columns: SmolLM2's values across
    // heads); 13 rows: tiles of 6 and 7; 25: of 8, 8 and 9. Widths with column tails.
    let cases = [
        (64usize, 1usize),
        (64, 2),
        (26, 3),
        (40, 5),
        (80, 7),
        (64, 9),
        (26, 13),
        (40, 25),
    ];
    for (d, g) in cases {
        let (streams, lens) = (3, [40usize, 9]);
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
            let got = value_sums(&c, &w, with_norms.then_some(&Norms::Values(&norms)), g).unwrap();
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
    let chunks: Vec<Vec<usize>> = q.chunks_exact(d).map(nonzero_chunks).collect();
    let keys = (
        Coords::Values(&y[..]),
        d,
        Some(&m[..]),
        Product::F32,
        Some((&rot[..], 20, 1)),
    );
    let args = (keys, Some(&norms[..]), (&q[..], &chunks[..]));
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

/// `out[t] = q . keys[t]` for every row of `keys` (`out.len() x q.len()`); `chunks` are `q`'s
/// [`nonzero_chunks`]: one query row at a time, as the dots ran before [`dots_rows`] took
/// rows together, which must give the same bits.
#[inline(always)]
fn dots<const FMA: bool>(q: &[f32], chunks: &[usize], keys: &[f32], out: &mut [f32]) {
    let d = q.len();
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if FMA && d.is_multiple_of(8) {
        for (k8, o8) in keys.chunks_exact(8 * d).zip(out.chunks_exact_mut(8)) {
            #[allow(unsafe_code)]
            // SAFETY: `FMA` builds run only inside `run_dots`' AVX + FMA `kernel`.
            let sums = unsafe { dots8_avx_fma(q, k8, chunks) };
            o8.copy_from_slice(&sums);
            done += 8;
        }
    }
    for (k, o) in keys[done * d..].chunks_exact(d).zip(&mut out[done..]) {
        *o = dot::<FMA>(q, k);
    }
}

/// `q . k_t` for the eight rows `k_t` of `keys` (`8 x d`, `d = q.len()` a multiple of 8) over
/// the 8-channel `chunks` of `q` that are not zero (their first channels; the others add
/// nothing to a finite key's dot): one accumulator per row, the eight reduced together by
/// horizontal adds (one reduction per row cost more than the row's products).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,fma")]
#[allow(unsafe_code)]
fn dots8_avx_fma(q: &[f32], keys: &[f32], chunks: &[usize]) -> [f32; 8] {
    use std::arch::x86_64::*;
    let d = q.len();
    assert!(d.is_multiple_of(8) && keys.len() >= 8 * d);
    assert!(chunks.iter().all(|&c| c + 8 <= d));
    let mut acc = [_mm256_setzero_ps(); 8];
    for &c in chunks {
        // SAFETY (every load): `c + 8 <= d`, and row `t < 8` of `keys` holds `d` values.
        let qv = unsafe { _mm256_loadu_ps(q.as_ptr().add(c)) };
        for (t, a) in acc.iter_mut().enumerate() {
            let kv = unsafe { _mm256_loadu_ps(keys.as_ptr().add(t * d + c)) };
            *a = _mm256_fmadd_ps(qv, kv, *a);
        }
    }
    // Pairwise horizontal adds: lanes 0-3 then hold rows' sums of their lanes 0-3, lanes
    // 4-7 of their lanes 4-7, in row order 0-3 | 0-3 and 4-7 | 4-7.
    let h01 = _mm256_hadd_ps(acc[0], acc[1]);
    let h23 = _mm256_hadd_ps(acc[2], acc[3]);
    let h45 = _mm256_hadd_ps(acc[4], acc[5]);
    let h67 = _mm256_hadd_ps(acc[6], acc[7]);
    let h0123 = _mm256_hadd_ps(h01, h23);
    let h4567 = _mm256_hadd_ps(h45, h67);
    let sums = _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(h0123, h4567),
        _mm256_permute2f128_ps::<0x31>(h0123, h4567),
    );
    let mut out = [0.0f32; 8];
    // SAFETY: `out` holds 8 floats.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), sums) };
    out
}

with_avx_fma! {
    /// [`dots_rows`], built as the kernels build it.
    fn run_dots_rows(q: &[f32], chunks: &[Vec<usize>], keys: &[f32], out: &mut [f32]) => dots_rows
}

with_avx_fma! {
    /// [`dots`] of one row, built as the kernels build it.
    fn run_dots(q: &[f32], chunks: &[usize], keys: &[f32], out: &mut [f32]) => dots
}

#[test]
fn query_rows_dotted_together_give_each_row_own_bits() {
    // Rows that share their chunks go through the keys together, in groups of up to three: a
    // wide query across three heads (each row zero outside its head), four rows of one head
    // (a group of three and one alone), rows of mixed widths, token counts off the eights.
    if !avx_fma() {
        return;
    }
    let wide = |rows: &[usize], d: usize, heads: usize| {
        let mut q = normals(rows.len() * d, 12);
        for (r, &h) in rows.iter().enumerate() {
            for (c, x) in q[r * d..][..d].iter_mut().enumerate() {
                if c / (d / heads) != h {
                    *x = 0.0;
                }
            }
        }
        q
    };
    let cases = [
        (wide(&[0, 0, 0, 1, 1, 1, 2, 2, 2], 192, 3), 192),
        (wide(&[0, 0, 0, 0, 1, 2, 2, 0], 192, 3), 192),
        (normals(4 * 64, 13), 64),
        (normals(2 * 40, 14), 40),
    ];
    let mut grouped = 0;
    for (q, d) in &cases {
        let (d, g) = (*d, q.len() / d);
        let chunks: Vec<Vec<usize>> = q.chunks_exact(d).map(nonzero_chunks).collect();
        grouped += chunks.windows(2).filter(|w| w[0] == w[1]).count();
        for n in [0usize, 3, 8, 13, 256] {
            let keys = normals(n * d, 15 + n as u64);
            let mut got = vec![f32::NAN; g * n];
            run_dots_rows(q, &chunks, &keys, &mut got);
            let mut want = vec![0.0f32; g * n];
            for ((qj, cj), o) in q
                .chunks_exact(d)
                .zip(&chunks)
                .zip(want.chunks_exact_mut(n.max(1)))
            {
                run_dots(qj, cj, &keys, o);
            }
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "d={d} g={g} n={n}: grouped rows differ from rows alone"
            );
        }
    }
    assert!(grouped > 0, "no case put rows together");
}

#[test]
fn bf16_bits_round_to_nearest_even() {
    let up = |b: u32| f32::from_bits(b);
    assert_eq!(bf16::bf16_bits(1.0), 0x3F80);
    // Exactly halfway between 0x3F80 and 0x3F81: to the even one; just above: up.
    assert_eq!(bf16::bf16_bits(up(0x3F80_8000)), 0x3F80);
    assert_eq!(bf16::bf16_bits(up(0x3F81_8000)), 0x3F82);
    assert_eq!(bf16::bf16_bits(up(0x3F80_8001)), 0x3F81);
    assert_eq!(bf16::bf16_bits(-2.5), 0xC020);
    assert_eq!(bf16::bf16_bits(f32::INFINITY), 0x7F80);
    assert_eq!(bf16::bf16_bits(f32::MAX), 0x7F80); // rounds past the largest bfloat16
    assert!(f32::from_bits((bf16::bf16_bits(f32::NAN) as u32) << 16).is_nan());
    let packed = bf16::pack_pairs(&[1.0, 2.0, -3.0, 0.5], 2);
    // Column 0 pairs M[0, 0] = 1 (low) with M[1, 0] = -3 (high); column 1 pairs 2 with 0.5.
    assert_eq!(packed, vec![0xC040_3F80, 0x3F00_4000]);
}

/// `c M + (y_t - c) M` with the block's centre `c` in float32 and the residuals and `M`
/// rounded to bfloat16, float64 sums; `sum_j |y_tj M_jc|`; `sum_j |(y_tj - c_j) M_jc|`.
fn bf16_reference(y: &[f32], m: &[f32], d: usize) -> [Vec<f64>; 3] {
    let round = |x: f32| f32::from_bits((bf16::bf16_bits(x) as u32) << 16) as f64;
    let (_, centre, _) = bf16::split_pairs(y, d, m);
    let mut out = [(); 3].map(|_| vec![0.0f64; y.len()]);
    for (t, yt) in y.chunks_exact(d).enumerate() {
        for (j, (&a, &c)) in yt.iter().zip(&centre).enumerate() {
            let r = a - c; // as the kernel subtracts, in float32
            for (k, &x) in m[j * d..][..d].iter().enumerate() {
                let i = t * d + k;
                out[0][i] += c as f64 * x as f64 + round(r) * round(x);
                out[1][i] += (a as f64 * x as f64).abs();
                out[2][i] += (r as f64 * x as f64).abs();
            }
        }
    }
    out
}

#[test]
fn frame_product_sums_every_token_as_alone_whatever_its_tile() {
    // The AVX + FMA build tiles 6 tokens and runs the last 2-5 as a tile padded with zero
    // rows; the portable build tiles 4 (its last 2-3 padded the same way). Either way each
    // token's keys are bit for bit its product alone (a one-token tile) with the same block
    // frame: after tiles of 6, 17 tokens leave 5 (padded), 13 and 7 leave 1 (alone), 8 and 14
    // leave 2 (padded); after tiles of 4, 7 leaves 3 and 14 leaves 2 (padded), 17, 13 and 5
    // leave 1; d 40 adds an 8-wide column tile, and d 16 is one tile wide.
    let fma = avx_fma();
    for (n, d) in [(17, 48), (13, 48), (8, 48), (7, 48), (14, 40), (5, 16)] {
        let mut y = normals(n * d, 41 + n as u64);
        for yt in y.chunks_exact_mut(d) {
            (yt[1], yt[6]) = (0.5, 0.0); // fixed coordinates, one of them zero
        }
        let m = normals(d * d, 42);
        let mut whole = vec![f32::NAN; n * d];
        let mut alone = vec![f32::NAN; n * d];
        if fma {
            let frame = BlockFrame::new::<true>(&y, d, &m);
            frame.product::<true>(&y, d, &mut whole);
            for (yt, o) in y.chunks_exact(d).zip(alone.chunks_exact_mut(d)) {
                frame.product::<true>(yt, d, o);
            }
            assert_eq!(whole, alone, "n={n} d={d}, AVX + FMA");
        }
        let frame = BlockFrame::new::<false>(&y, d, &m);
        frame.product::<false>(&y, d, &mut whole);
        for (yt, o) in y.chunks_exact(d).zip(alone.chunks_exact_mut(d)) {
            frame.product::<false>(yt, d, o);
        }
        assert_eq!(whole, alone, "n={n} d={d}, portable");
        // And the sums are the product's: each within float32 rounding of float64.
        for (i, &v) in whole.iter().enumerate() {
            let exact: f64 = (0..d)
                .map(|j| y[i / d * d + j] as f64 * m[j * d + i % d] as f64)
                .sum();
            assert!(
                (v as f64 - exact).abs() < 1e-4 * (1.0 + exact.abs()),
                "[{i}] {v} {exact}"
            );
        }
    }
}

#[test]
fn bf16_frame_product_sums_rounded_pairs_in_float32() {
    if !bf16::available() {
        eprintln!("skipped: this CPU has no AVX512-BF16 (Precision::Bf16 runs float32 here)");
        return;
    }
    // 13 tokens: a tile of 8, then five alone. Coordinates held fixed across the block: a whole
    // pair (4, 5), one of a pair (8), a zero pair (10, 11); two varying on a large mean (2, 3).
    for d in [16, 64, 192] {
        let n = 13;
        let mut y = normals(n * d, 21 + d as u64);
        for yt in y.chunks_exact_mut(d) {
            (yt[4], yt[5], yt[8], yt[10], yt[11]) = (0.75, -1.25, 2.0, 0.0, 0.0);
            (yt[2], yt[3]) = (yt[2] + 300.0, yt[3] - 200.0);
        }
        let m = normals(d * d, 22);
        let pairs = bf16::pack_pairs(&m, d);
        // The CPU's conversion, 16 at a time, rounds as `bf16_bits`.
        assert_eq!(pairs, bf16::pack_pairs_scalar(&m, d), "d={d}");
        let mut out = vec![0.0f32; n * d];
        bf16::product(&y, d, &m, &pairs, &mut out);
        let [want, mass, spread] = bf16_reference(&y, &m, d);
        let (mut worst_rounding, mut worst_sum) = (0.0f64, 0.0f64);
        for i in 0..n * d {
            let exact: f64 = y[i / d * d..][..d]
                .iter()
                .enumerate()
                .map(|(j, &a)| a as f64 * m[j * d + i % d] as f64)
                .sum();
            // Each product of a residual is within 2^-8 of its float32 value (the large means
            // are not rounded); the sums are float32.
            let err = (out[i] as f64 - exact).abs();
            assert!(
                err <= 2f64.powi(-8) * spread[i] + 1e-5 * mass[i],
                "d={d} [{i}]: {} vs {exact}",
                out[i]
            );
            worst_sum = worst_sum.max((out[i] as f64 - want[i]).abs() / mass[i]);
            worst_rounding = worst_rounding.max(err / spread[i]);
        }
        // Exactly the bfloat16 products of the residuals, summed in float32.
        assert!(worst_sum < 1e-5, "d={d}: {worst_sum}");
        // And not float32 products: the rounding shows.
        assert!(worst_rounding > 1e-4, "d={d}: {worst_rounding}");
    }
}

/// Head dim of [`frame_logits`].
const FRAME_D: usize = 64;

/// Logits of two streams of coded keys (16 and 13 tokens) through random frames, 3 query rows,
/// with the frame product in `precision`.
fn frame_logits(precision: Precision) -> Vec<f32> {
    let (d, g) = (FRAME_D, 3);
    let (encs, _) = coded(2, &[16, 13], d);
    let refs: Vec<&EncodedLayer> = encs.iter().collect();
    let c = CodedStreams::new(&refs, 2).unwrap();
    let frames = normals(2 * d * d, 5);
    let q = normals(2 * g * d, 6);
    key_logits(&c, Some((&frames, 2)), None, None, &q, g, precision).unwrap()
}

/// The float32 [`frame_logits`] and their largest gap to those in `precision`, where this CPU
/// runs it (`multiplied`); None where it runs float32, after checking it gives the same.
fn precision_gap(
    precision: Precision,
    multiplied: bool,
    fallback: &str,
) -> Option<(Vec<f32>, f32)> {
    let (exact, other) = (frame_logits(Precision::F32), frame_logits(precision));
    if !multiplied {
        assert_eq!(exact, other, "{fallback}");
        return None;
    }
    let gap = largest_gap(&exact, &other);
    Some((exact, gap))
}

#[test]
fn bf16_precision_keeps_logits_within_bfloat16_rounding() {
    let fallback = "without AVX512-BF16 the bfloat16 precision is float32";
    let Some((exact, worst)) = precision_gap(Precision::Bf16, bf16_products(FRAME_D), fallback)
    else {
        return;
    };
    let scale = largest(&exact);
    assert!(worst > 0.0 && worst <= 2e-2 * scale, "{worst} of {scale}");
}

#[test]
fn int16_level_keeps_the_sums_within_int32() {
    assert_eq!(int16::level(0), 4095);
    assert_eq!(int16::level(128), 4095);
    assert_eq!(int16::level(192), 3344);
    assert_eq!(int16::level(1024), 1448);
    for coords in [1, 2, 64, 129, 192, 512, 1024, 4096] {
        let r = int16::level(coords) as i64;
        assert!(coords as i64 * r * r <= i32::MAX as i64, "{coords}: {r}");
        assert!(r == 4095 || coords as i64 * (r + 1) * (r + 1) > i32::MAX as i64);
    }
}

/// A block whose coordinates vary around large means, with fixed coordinates as in the bf16
/// test: a whole pair (4, 5), one of a pair (8), a zero pair (10, 11).
fn block_with_fixed_coordinates(n: usize, d: usize, seed: u64) -> Vec<f32> {
    let mut y = normals(n * d, seed);
    for yt in y.chunks_exact_mut(d) {
        (yt[4], yt[5], yt[8], yt[10], yt[11]) = (0.75, -1.25, 2.0, 0.0, 0.0);
        (yt[2], yt[3]) = (yt[2] + 300.0, yt[3] - 200.0);
        yt[d - 1] *= 1e-3; // a coordinate with a small spread keeps its own scale
    }
    y
}

#[test]
fn int16_frame_product_is_its_integer_reference_within_the_level() {
    // 13 tokens: a tile of 8, then five alone; tiles of 16 columns, 32, and 32 + 16.
    for d in [16, 48, 64, 192] {
        let n = 13;
        let y = block_with_fixed_coordinates(n, d, 31 + d as u64);
        let m = normals(d * d, 32);
        let q = int16::quantise(&y, d, &m);
        let mut reference = vec![0.0f32; n * d];
        int16::product_scalar(&q, d, &mut reference);
        // Each tile kind this CPU has (on AVX-512 machines the AVX2 tiles too).
        for isa in [int16::Isa::Vnni512, int16::Isa::Avx2] {
            if int16::runs(isa) {
                let mut out = vec![0.0f32; n * d];
                int16::product_with(isa, &y, d, &m, &mut out);
                assert_eq!(
                    out, reference,
                    "d={d}, {isa:?}: the CPU's product is its reference's"
                );
            } else {
                eprintln!("skipped: this CPU has no {isa:?} for the int16 product");
            }
        }
        let (_, centre, _) = bf16::split_pairs(&y, d, &m);
        let r = int16::level(2 * q.active.len()) as f64;
        let (mut worst, mut worst_rel) = (0.0f64, 0.0f64);
        for c in 0..d {
            // Worst case of the module's bound: J / R of the largest scaled entry.
            let big = (0..d)
                .map(|j| {
                    let spread = y
                        .chunks_exact(d)
                        .map(|yt| (yt[j] - centre[j]).abs() as f64)
                        .fold(0.0, f64::max);
                    spread * (m[j * d + c] as f64).abs()
                })
                .fold(0.0, f64::max);
            for t in 0..n {
                let exact: f64 = (0..d)
                    .map(|j| y[t * d + j] as f64 * m[j * d + c] as f64)
                    .sum();
                let mass: f64 = (0..d)
                    .map(|j| (y[t * d + j] as f64 * m[j * d + c] as f64).abs())
                    .sum();
                let err = (reference[t * d + c] as f64 - exact).abs();
                assert!(
                    err <= 2.0 * q.active.len() as f64 / r * big + 1e-5 * mass,
                    "d={d} [{t}, {c}]: {} vs {exact}",
                    reference[t * d + c]
                );
                worst = worst.max(err);
                worst_rel = worst_rel.max(err / big);
            }
        }
        // Far inside the worst case (roundings add up as a random walk), and not float32.
        assert!(
            worst > 0.0 && worst_rel < 4.0 * (d as f64).sqrt() / r,
            "d={d}: {worst_rel}"
        );
    }
}

#[test]
fn int16_levels_decoded_from_codes_are_their_grids_reference_bit_for_bit() {
    if !int16::available() {
        eprintln!("skipped: this CPU has no int16 product");
        return;
    }
    // A cache's block of 256 tokens and one of 13 (a tile, then tokens alone), with spikes
    // that the codec stores as outliers, some on a pair of coordinates that is otherwise
    // constant (no bits: their outliers are added after the product).
    let mut sparse = 0;
    for (d, n) in [(64, 256), (192, 256), (192, 13)] {
        let mut x = kv_like(n, d, 40 + d as u64);
        for t in (0..n).step_by(5) {
            x[t * d + (t * 7) % (d - 2)] *= 30.0;
        }
        // Faint noise (no bits at this rate) with a spike far beyond 4 of its deviations.
        let faint = normals(2 * n, 42);
        for (t, xt) in x.chunks_exact_mut(d).enumerate() {
            xt[d - 2] = 0.25 + 0.01 * faint[2 * t];
            xt[d - 1] = 0.01 * faint[2 * t + 1] + if t == 3 { 0.2 } else { 0.0 };
        }
        let p = edited(&waterfill(2.5), |p| {
            (p.pca_method, p.block_size) = (PcaMethod::None, n)
        });
        let enc = encode_f32(&x, n, d, &p);
        let y = decode_layer(&enc).unwrap();
        let mut levels = vec![0.0f32; n * d];
        let grid = decode_layer_mapped(&enc, &mut levels, int16::Grid::new, int16::Grid::level)
            .unwrap()
            .expect("a block in its own coordinates");
        // The levels decoded from the codes are the decoded values' levels.
        let mut mapped = y.clone();
        for (i, v) in mapped.iter_mut().enumerate() {
            grid.level(i % d, std::slice::from_mut(v));
        }
        assert_eq!(levels, mapped, "d={d} n={n}");
        assert!(levels.iter().all(|&l| l.abs() <= 4095.0 && l == l.round()));
        let m = normals(d * d, 41);
        let mut out = vec![f32::NAN; 7];
        int16::product_levels(&levels, &grid, d, &m, &mut out);
        let mut reference = vec![0.0f32; n * d];
        int16::product_scalar(&grid.reference(&y, d, &m), d, &mut reference);
        grid.correct(d, &m, &mut reference);
        assert_eq!(
            out, reference,
            "d={d} n={n}: the product is its reference's"
        );
        // And close to the float product, about as close as levels of the decoded values'
        // own spreads come (tables span more than 13 tokens use, and less than outliers).
        let mut exact = vec![0.0f32; n * d];
        for (yt, o) in y.chunks_exact(d).zip(exact.chunks_exact_mut(d)) {
            times_frame::<false>(yt, &m, o);
        }
        let mut own = vec![0.0f32; n * d];
        int16::product(&y, d, &m, &mut own);
        let (scale, gap) = (largest(&exact), largest_gap(&exact, &out));
        let own_gap = largest_gap(&exact, &own);
        assert!(
            gap > 0.0 && gap <= 3e-3 * scale,
            "d={d} n={n}: {gap} of {scale}"
        );
        assert!(gap <= 2.0 * own_gap, "d={d} n={n}: {gap} against {own_gap}");
        sparse += grid.sparse();
    }
    assert!(sparse > 0, "no outlier was left to the sparse correction");
}

/// Layers the int16 levels cannot take (a basis of their own) decode as values instead.
#[test]
fn int16_levels_leave_blocks_with_a_basis_to_their_values() {
    let (n, d) = (64, 64);
    let x = kv_like(n, d, 3);
    let p = edited(&waterfill(2.5), |p| p.block_size = n);
    assert_ne!(p.pca_method, PcaMethod::None);
    let enc = encode_f32(&x, n, d, &p);
    let mut out = vec![7.0f32; n * d];
    let grid = decode_layer_mapped(&enc, &mut out, int16::Grid::new, int16::Grid::level).unwrap();
    assert!(grid.is_none());
    assert_eq!(
        out,
        decode_layer(&enc).unwrap(),
        "its values, from the same parse"
    );
}

#[test]
fn int16_precision_keeps_logits_far_closer_than_bfloat16() {
    let fallback = "without AVX2 or AVX512-VNNI the int16 precision is float32";
    let Some((exact, w16)) = precision_gap(Precision::I16, int16_products(FRAME_D), fallback)
    else {
        return;
    };
    let scale = largest(&exact);
    assert!(w16 > 0.0 && w16 <= 2e-3 * scale, "{w16} of {scale}");
    if bf16_products(FRAME_D) {
        let wbf = largest_gap(&exact, &frame_logits(Precision::Bf16));
        assert!(w16 * 4.0 < wbf, "int16 {w16} against bfloat16 {wbf}");
    }
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
    assert!(key_logits(&c, None, None, None, &q[1..], 1, Precision::F32).is_err());
    let frames = vec![0.0f32; 3 * 64 * 64];
    assert!(key_logits(&c, Some((&frames, 3)), None, None, &q, 1, Precision::F32).is_err());
    let rot = vec![0.0f32; 24 * 33 * 2];
    let too_many = RopeAngles {
        values: &rot,
        rows: 1,
        pairs: 33,
        repeats: 1,
    };
    assert!(key_logits(&c, None, Some(&too_many), None, &q, 1, Precision::F32).is_err());
    let short = RopeAngles {
        values: &rot[2..],
        rows: 1,
        pairs: 33,
        repeats: 1,
    };
    assert!(key_logits(&c, None, Some(&short), None, &q, 1, Precision::F32).is_err());
    // 11 pairs repeated 3 times turn 33 pairs: more than the 32 of head dim 64.
    let repeated = RopeAngles {
        values: &rot[..24 * 11 * 2],
        rows: 1,
        pairs: 11,
        repeats: 3,
    };
    assert!(key_logits(&c, None, Some(&repeated), None, &q, 1, Precision::F32).is_err());
    let none = RopeAngles {
        repeats: 0,
        ..repeated
    };
    assert!(key_logits(&c, None, Some(&none), None, &q, 1, Precision::F32).is_err());
    assert!(key_logits(
        &c,
        None,
        None,
        Some(&Norms::Values(&[1.0; 3])),
        &q,
        1,
        Precision::F32
    )
    .is_err());
    assert!(value_sums(&c, &[0.0; 47], None, 1).is_err());
    assert!(value_sums(&c, &[0.0; 48], Some(&Norms::Values(&[1.0; 47])), 1).is_err());
    assert!(value_sums(&c, &[0.0; 48], None, 1).is_ok());
}

/// `codes` and float16 `bounds` of `norms` per block, as `norm_codes.py` codes them.
fn norm_codes(norms: &[f32], streams: usize, lens: &[usize]) -> Vec<(Vec<u8>, Vec<f16>)> {
    let t_n: usize = lens.iter().sum();
    let mut t0 = 0;
    let mut out = Vec::new();
    for &n in lens {
        let (mut codes, mut bounds) = (Vec::new(), Vec::new());
        for s in 0..streams {
            let x = &norms[s * t_n + t0..][..n];
            let lo = f16::from_f32(
                x.iter()
                    .cloned()
                    .filter(|&v| v > 0.0)
                    .fold(f32::MAX, f32::min),
            );
            let hi = f16::from_f32(x.iter().cloned().fold(0.0, f32::max));
            let (llo, lhi) = (lo.to_f32().log2(), hi.to_f32().log2());
            let step = (lhi - llo) / 254.0;
            codes.extend(x.iter().map(|&v| {
                if v == 0.0 {
                    0
                } else {
                    ((v.log2() - llo) / step).round().clamp(0.0, 254.0) as u8 + 1
                }
            }));
            bounds.extend([lo, hi]);
        }
        out.push((codes, bounds));
        t0 += n;
    }
    out
}

/// What the norm codes decode to, the formula written out.
fn decoded_norms(codes: &[(Vec<u8>, Vec<f16>)], streams: usize, lens: &[usize]) -> Vec<f32> {
    let t_n: usize = lens.iter().sum();
    let mut out = vec![0.0f32; streams * t_n];
    let mut t0 = 0;
    for ((c, bnd), &n) in codes.iter().zip(lens) {
        for s in 0..streams {
            let (lo, hi) = (bnd[2 * s].to_f32().log2(), bnd[2 * s + 1].to_f32().log2());
            for t in 0..n {
                let code = c[s * n + t];
                out[s * t_n + t0 + t] = if code == 0 {
                    0.0
                } else {
                    ((code as f32 - 1.0) * ((hi - lo) / 254.0) + lo).exp2()
                };
            }
        }
        t0 += n;
    }
    out
}

#[test]
fn norm_codes_decode_as_the_python_decoder_and_refuse_bad_bounds() {
    let (streams, lens) = (2, [16usize, 8]);
    let (encs, _) = coded(streams, &lens, 64);
    let refs: Vec<&EncodedLayer> = encs.iter().collect();
    let c = CodedStreams::new(&refs, streams).unwrap();
    let mut norms: Vec<f32> = normals(streams * 24, 9)
        .iter()
        .map(|v| v.abs() * 3.0 + 0.01)
        .collect();
    norms[5] = 0.0; // an exact zero stays zero
    let codes = norm_codes(&norms, streams, &lens);
    let want = decoded_norms(&codes, streams, &lens);
    assert_eq!(want[5], 0.0);
    let view = Norms::Codes(codes.iter().map(|(c, b)| (&c[..], &b[..])).collect());
    view.check(&c).unwrap();
    for s in 0..streams {
        for (b, t0) in [(0usize, 0usize), (1, 16)] {
            let got = view.block(&c, s, b).unwrap();
            assert_eq!(&got[..], &want[s * 24 + t0..][..lens[b]]);
            // Within half a log step of the coded norm.
            for (g, n) in got.iter().zip(&norms[s * 24 + t0..]) {
                assert!((g - n).abs() <= 0.03 * n, "{g} vs {n}");
            }
        }
    }
    for bad in [f16::NAN, f16::INFINITY, f16::ZERO, f16::from_f32(-1.0)] {
        let mut hostile = codes.clone();
        hostile[1].1[2] = bad;
        let view = Norms::Codes(hostile.iter().map(|(c, b)| (&c[..], &b[..])).collect());
        let e = view.check(&c).err().unwrap();
        assert!(e.to_string().contains("not a positive finite"), "{e}");
    }
    let short = Norms::Codes(vec![(&codes[0].0[..], &codes[0].1[..])]);
    assert!(short.check(&c).is_err());
    let cut = Norms::Codes(vec![
        (&codes[0].0[1..], &codes[0].1[..]),
        (&codes[1].0[..], &codes[1].1[..]),
    ]);
    assert!(cut.check(&c).is_err());
}

/// RoPE-like angles `[t_n, 2, pairs]` (cosines, then sines) at positions `0..t_n`.
pub(super) fn rotation_table(t_n: usize, pairs: usize) -> Vec<f32> {
    (0..t_n)
        .flat_map(|t| {
            let angle = move |i: usize| t as f32 * 10f32.powf(-(i as f32) / pairs as f32);
            (0..pairs)
                .map(move |i| angle(i).cos())
                .chain((0..pairs).map(move |i| angle(i).sin()))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Exact tokens `[heads, e_n, d]` in two runs, as a cache hands them over: each head's first
/// 3 tokens in bfloat16 (its hot window, as held), then the rest in float32 (the new tokens).
fn held_and_new(x: &[f32], e_n: usize, d: usize) -> (Vec<u16>, Vec<f32>) {
    let (mut held, mut new) = (Vec::new(), Vec::new());
    for row in x.chunks_exact(e_n * d) {
        held.extend(
            row[..3 * d]
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits()),
        );
        new.extend_from_slice(&row[3 * d..]);
    }
    (held, new)
}

/// The runs of [`held_and_new`] keys and values as [`attend`] takes them.
fn two_runs<'a>(k: (&'a [u16], &'a [f32]), v: (&'a [u16], &'a [f32])) -> [ExactPiece<'a>; 2] {
    [
        ExactPiece {
            keys: Lanes::Bf16(k.0),
            values: Lanes::Bf16(v.0),
        },
        ExactPiece::f32(k.1, v.1),
    ]
}

/// Int8 rows of `d` codes decoded the slow way (not [`crate::int8_rows::decode_into`], which
/// the kernel reads them with): code times the row's bfloat16 scale.
fn int8_rows_decoded(x: &[i8], d: usize) -> Vec<f32> {
    let mut out = Vec::new();
    for row in x.chunks_exact(d + 2) {
        let s = half::bf16::from_bits(u16::from_le_bytes([row[d] as u8, row[d + 1] as u8]));
        out.extend(row[..d].iter().map(|&c| c as f32 * s.to_f32()));
    }
    out
}

/// The attention written out the slow way in f64 over decoded keys and values: `logits`
/// `[S, R, T]` of the coded keys (before any [`Joint`] scale), `yv` the decoded values `[S, T,
/// W]`, `vnorms` their token norms (None: scale 1), `vframes` `[fheads, W, D]`.
#[allow(clippy::too_many_arguments)]
fn reference_attend(
    logits: &[f32],
    yv: &[f32],
    vnorms: Option<&[f32]>,
    vframes: &[f32],
    fheads: usize,
    a: &Attend<'_>,
    streams: usize,
    t_n: usize,
    w: usize,
) -> Vec<f32> {
    let hs = a.joint.as_ref().map_or(1, |j| j.heads);
    let (d, units) = (w / hs, streams * hs);
    // The exact runs gathered per head in float32 (bfloat16 widened), as the kernel reads them.
    let gather = |values: bool| -> Vec<Vec<f32>> {
        (0..units)
            .map(|u| {
                let mut out = Vec::new();
                for run in a.exact {
                    let lanes = if values { run.values } else { run.keys };
                    let n = match lanes {
                        Lanes::F32(x) => x.len(),
                        Lanes::Bf16(x) => x.len(),
                        Lanes::Int8Rows(x) => x.len(),
                    } / units;
                    match lanes {
                        Lanes::F32(x) => out.extend_from_slice(&x[u * n..][..n]),
                        Lanes::Bf16(x) => out.extend(
                            x[u * n..][..n]
                                .iter()
                                .map(|&b| half::bf16::from_bits(b).to_f32()),
                        ),
                        Lanes::Int8Rows(x) => out.extend(int8_rows_decoded(&x[u * n..][..n], d)),
                    }
                }
                out
            })
            .collect()
    };
    let (ek, ev) = (gather(false), gather(true));
    let (r, e_n) = (a.rows, ek[0].len() / d);
    let (rg, l_n) = (r / hs, t_n + e_n);
    let exact_q = a.joint.as_ref().map_or(a.queries, |j| j.exact_queries);
    let scale = |sc: Option<&[f32]>, u: usize, t: usize| sc.map_or(1.0, |v| v[u * t_n + t] as f64);
    let mut out = vec![0.0f32; streams * r * d];
    for s in 0..streams {
        for j in 0..r {
            let u = s * hs + j / rg;
            let m = &vframes[(u % fheads) * w * d..][..w * d];
            let (ks, vs) = (
                a.joint.as_ref().and_then(|jt| jt.key_scales),
                a.joint.as_ref().and_then(|jt| jt.value_scales),
            );
            let q = &exact_q[(s * r + j) * d..][..d];
            let mut x: Vec<f64> = (0..l_n)
                .map(|t| {
                    if t < t_n {
                        logits[(s * r + j) * t_n + t] as f64 * scale(ks, u, t)
                    } else {
                        let k = &ek[u][(t - t_n) * d..][..d];
                        q.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum()
                    }
                })
                .collect();
            for (t, v) in x.iter_mut().enumerate() {
                *v *= a.scaling as f64;
                if let Some(c) = a.softcap {
                    *v = (*v / c as f64).tanh() * c as f64;
                }
                if let Some((b, sb)) = a.bias {
                    *v += b[((s / (streams / sb)) * r + j) * l_n + t] as f64;
                }
            }
            let max = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = if max == f64::NEG_INFINITY {
                vec![0.0; l_n]
            } else {
                let e: Vec<f64> = x.iter().map(|v| (v - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                e.iter().map(|v| v / sum).collect()
            };
            let mut acc = vec![0.0f64; d];
            for t in 0..t_n {
                let y = &yv[(s * t_n + t) * w..][..w];
                let len = y.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
                let norm = vnorms.map_or(1.0, |n| n[s * t_n + t] as f64 / len.max(1e-12));
                let wt = p[t] * norm * scale(vs, u, t);
                for c in 0..d {
                    let v: f64 = (0..w).map(|i| y[i] as f64 * m[i * d + c] as f64).sum();
                    acc[c] += wt * v;
                }
            }
            for e in 0..e_n {
                let v = &ev[u][e * d..][..d];
                acc.iter_mut()
                    .zip(v)
                    .for_each(|(o, v)| *o += p[t_n + e] * *v as f64);
            }
            for c in 0..d {
                out[(s * r + j) * d + c] = acc[c] as f32;
            }
        }
    }
    out
}

#[test]
fn attend_matches_the_softmax_over_decoded_keys_and_values() {
    let (streams, heads, r, e_n, d, pairs, lens) = (6, 3, 4, 5, 64, 32, [32usize, 17]);
    let (kenc, yk) = coded(streams, &lens, d);
    let (venc, yv) = coded(streams, &lens, d);
    let (krefs, vrefs): (Vec<&EncodedLayer>, Vec<&EncodedLayer>) =
        (kenc.iter().collect(), venc.iter().collect());
    let (kc, vc) = (
        CodedStreams::new(&krefs, streams).unwrap(),
        CodedStreams::new(&vrefs, streams).unwrap(),
    );
    let t_n = kc.tokens();
    let kframes = normals(heads * d * d, 11)
        .iter()
        .map(|v| v * 0.2)
        .collect::<Vec<_>>();
    let vframes = normals(heads * d * d, 12)
        .iter()
        .map(|v| v * 0.2)
        .collect::<Vec<_>>();
    let rot = rotation_table(t_n, pairs);
    let knorms: Vec<f32> = normals(streams * t_n, 13)
        .iter()
        .map(|v| v.abs() + 0.5)
        .collect();
    let vnorms: Vec<f32> = normals(streams * t_n, 14)
        .iter()
        .map(|v| v.abs() + 0.1)
        .collect();
    let vcodes = norm_codes(&vnorms, streams, &lens);
    let vdecoded = decoded_norms(&vcodes, streams, &lens);
    let q = normals(streams * r * d, 15);
    let ek = normals(streams * e_n * d, 16);
    let ev = normals(streams * e_n * d, 17);
    let ((hk, nk), (hv, nv)) = (held_and_new(&ek, e_n, d), held_and_new(&ev, e_n, d));
    let exact = two_runs((&hk, &nk), (&hv, &nv));
    // Batch-row bias (2 rows of 3 streams): some coded tokens masked, one row masked whole.
    let l_n = t_n + e_n;
    let mut bias = vec![0.0f32; 2 * r * l_n];
    for (i, b) in bias.iter_mut().enumerate() {
        if i % 7 == 3 {
            *b = f32::NEG_INFINITY;
        } else if i % 5 == 1 {
            *b = -0.75;
        }
    }
    bias[(r + 2) * l_n..][..l_n].fill(f32::NEG_INFINITY);
    for softcap in [None, Some(7.5f32)] {
        let a = Attend {
            queries: &q,
            rows: r,
            key_frames: Some((&kframes, heads)),
            rotation: Some(RopeAngles {
                values: &rot,
                rows: 1,
                pairs,
                repeats: 1,
            }),
            key_norms: Some(Norms::Values(&knorms)),
            value_frames: Some((&vframes, heads)),
            value_norms: Some(Norms::Codes(
                vcodes.iter().map(|(c, b)| (&c[..], &b[..])).collect(),
            )),
            exact: &exact,
            bias: Some((&bias, 2)),
            scaling: 0.125,
            softcap,
            joint: None,
            precision: Precision::F32,
            prepared: None,
        };
        let got = attend(&kc, &vc, &a).unwrap();
        let logits = reference_logits(
            &yk, streams, t_n, d, &kframes, heads, &rot, 1, pairs, &knorms, &q, r,
        );
        let want = reference_attend(
            &logits,
            &yv,
            Some(&vdecoded),
            &vframes,
            heads,
            &a,
            streams,
            t_n,
            d,
        );
        assert_close(&got, &want, &format!("attend softcap={softcap:?}"));
        // The fully masked row (batch row 1, query row 2) is zeros for each of its streams.
        for s in 3..6 {
            assert!(got[(s * r + 2) * d..][..d].iter().all(|&v| v == 0.0));
        }
    }
}

#[test]
fn attend_reads_int8_rows_as_their_decoded_values_bit_for_bit() {
    // A cache holds its hot window's values as int8 rows: read as held, they must give the
    // bits of the same rows decoded to float32 by the caller, keys or values, alone or beside
    // other runs.
    let (streams, r, e_n, d, lens) = (3, 4, 6, 64, [32usize, 17]);
    let (kenc, _) = coded(streams, &lens, d);
    let (venc, _) = coded(streams, &lens, d);
    let (krefs, vrefs): (Vec<&EncodedLayer>, Vec<&EncodedLayer>) =
        (kenc.iter().collect(), venc.iter().collect());
    let (kc, vc) = (
        CodedStreams::new(&krefs, streams).unwrap(),
        CodedStreams::new(&vrefs, streams).unwrap(),
    );
    let q = normals(streams * r * d, 21);
    let mut ek = normals(streams * e_n * d, 22);
    let mut ev = normals(streams * e_n * d, 23);
    ev[5 * d..6 * d].fill(0.0); // a zero row: scale 0, codes 0
    ek.iter_mut().for_each(|v| *v *= 3.0);
    let (k8, v8) = (
        crate::int8_rows::encode(&ek, d).unwrap(),
        crate::int8_rows::encode(&ev, d).unwrap(),
    );
    let (kd, vd) = (int8_rows_decoded(&k8, d), int8_rows_decoded(&v8, d));
    let new_k = normals(streams * d, 24);
    let new_v = normals(streams * d, 25);
    let base = |exact| Attend {
        queries: &q,
        rows: r,
        key_frames: None,
        rotation: None,
        key_norms: None,
        value_frames: None,
        value_norms: None,
        exact,
        bias: None,
        scaling: 0.125,
        softcap: None,
        joint: None,
        precision: Precision::F32,
        prepared: None,
    };
    let held = [
        ExactPiece {
            keys: Lanes::Int8Rows(&k8),
            values: Lanes::Int8Rows(&v8),
        },
        ExactPiece::f32(&new_k, &new_v),
    ];
    let decoded = [ExactPiece::f32(&kd, &vd), ExactPiece::f32(&new_k, &new_v)];
    let values_only = [ExactPiece {
        keys: Lanes::F32(&kd),
        values: Lanes::Int8Rows(&v8),
    }];
    let got = attend(&kc, &vc, &base(&held)).unwrap();
    let want = attend(&kc, &vc, &base(&decoded)).unwrap();
    assert_eq!(got, want);
    let got = attend(&kc, &vc, &base(&values_only)).unwrap();
    let want = attend(&kc, &vc, &base(&decoded[..1])).unwrap();
    assert_eq!(got, want);
    // The rows were not read as float32 codes: the decoded values differ from the raw ones.
    assert_ne!(vd, ev);
    // A run whose rows are not D + 2 bytes wide is refused, naming it.
    let short = [ExactPiece {
        keys: Lanes::F32(&kd),
        values: Lanes::Int8Rows(&v8[1..]),
    }];
    let e = attend(&kc, &vc, &base(&short))
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains("exact_values") && e.contains("head_dim + 2"),
        "{e}"
    );
}

#[test]
fn attend_across_heads_matches_each_heads_softmax_over_decoded_keys_and_values() {
    // Two batch rows, each one stream of 3 heads x 16 channels coded together; 2 query rows
    // per head, laid out as the cache lays them: wide queries over the joint coordinates
    // (zero outside their head's channels), the exact part per head.
    let (streams, hs, rg, e_n, d, lens) = (2, 3, 2, 5, 16, [32usize, 17]);
    let (w, r) = (hs * d, hs * rg);
    let (kenc, yk) = coded(streams, &lens, w);
    let (venc, yv) = coded(streams, &lens, w);
    let (krefs, vrefs): (Vec<&EncodedLayer>, Vec<&EncodedLayer>) =
        (kenc.iter().collect(), venc.iter().collect());
    let (kc, vc) = (
        CodedStreams::new(&krefs, streams).unwrap(),
        CodedStreams::new(&vrefs, streams).unwrap(),
    );
    let (t_n, pairs) = (kc.tokens(), w / 2);
    let scaled = |n: usize, seed: u64, f: fn(f32) -> f32| -> Vec<f32> {
        normals(n, seed).into_iter().map(f).collect()
    };
    let kframe = scaled(w * w, 21, |v| v * 0.2);
    let vframes = scaled(hs * w * d, 22, |v| v * 0.2);
    let rot = rotation_table(t_n, pairs);
    let key_scales = scaled(streams * hs * t_n, 23, |v| v.abs() + 0.5);
    let value_scales = scaled(streams * hs * t_n, 24, |v| v.abs() + 0.1);
    let mut wide = scaled(streams * r * w, 25, |v| v);
    for (k, q) in wide.iter_mut().enumerate() {
        let (row, c) = ((k / w) % r, k % w);
        if c / d != row / rg {
            *q = 0.0;
        }
    }
    let exact_q = scaled(streams * r * d, 26, |v| v);
    let units = streams * hs;
    let (ek, ev) = (
        scaled(units * e_n * d, 27, |v| v),
        scaled(units * e_n * d, 28, |v| v),
    );
    let ((hk, nk), (hv, nv)) = (held_and_new(&ek, e_n, d), held_and_new(&ev, e_n, d));
    let exact = two_runs((&hk, &nk), (&hv, &nv));
    let l_n = t_n + e_n;
    let mut bias = vec![0.0f32; r * l_n];
    for (i, b) in bias.iter_mut().enumerate() {
        if i % 7 == 3 {
            *b = f32::NEG_INFINITY;
        }
    }
    bias[3 * l_n..][..l_n].fill(f32::NEG_INFINITY); // head 1's second row, masked whole
                                                    // No token norms across heads: the reference's
                                                    // norm over |y| is then 1.
    let unit: Vec<f32> = yk
        .chunks_exact(w)
        .map(|y| y.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt() as f32)
        .collect();
    let logits = reference_logits(
        &yk, streams, t_n, w, &kframe, 1, &rot, 1, pairs, &unit, &wide, r,
    );
    let joint = || Joint {
        heads: hs,
        exact_queries: &exact_q,
        key_scales: Some(&key_scales),
        value_scales: Some(&value_scales),
    };
    let base = |softcap| Attend {
        queries: &wide,
        rows: r,
        key_frames: Some((&kframe, 1)),
        rotation: Some(RopeAngles {
            values: &rot,
            rows: 1,
            pairs,
            repeats: 1,
        }),
        key_norms: None,
        value_frames: Some((&vframes, hs)),
        value_norms: None,
        exact: &exact,
        bias: Some((&bias, 1)),
        scaling: 0.25,
        softcap,
        joint: Some(joint()),
        precision: Precision::F32,
        prepared: None,
    };
    for softcap in [None, Some(6.0f32)] {
        let a = base(softcap);
        let got = attend(&kc, &vc, &a).unwrap();
        let want = reference_attend(&logits, &yv, None, &vframes, hs, &a, streams, t_n, w);
        assert_close(&got, &want, &format!("joint attend softcap={softcap:?}"));
        for s in 0..streams {
            assert!(got[(s * r + 3) * d..][..d].iter().all(|&v| v == 0.0));
        }
    }
    // What does not fit the heads is refused, naming the argument.
    let short = &exact_q[1..];
    let cases = [
        (
            Attend {
                joint: Some(Joint {
                    heads: 5,
                    ..joint()
                }),
                ..base(None)
            },
            "joint",
        ),
        (
            Attend {
                joint: Some(Joint {
                    exact_queries: short,
                    ..joint()
                }),
                ..base(None)
            },
            "exact_queries",
        ),
        (
            Attend {
                joint: Some(Joint {
                    key_scales: Some(short),
                    ..joint()
                }),
                ..base(None)
            },
            "key_scales",
        ),
        (
            Attend {
                joint: Some(Joint {
                    value_scales: Some(short),
                    ..joint()
                }),
                ..base(None)
            },
            "value_scales",
        ),
        (
            Attend {
                value_frames: None,
                ..base(None)
            },
            "value_frames",
        ),
        (
            Attend {
                value_frames: Some((&kframe, 1)),
                ..base(None)
            },
            "value_frames",
        ),
    ];
    for (a, what) in &cases {
        let e = attend(&kc, &vc, a).expect_err("refused").to_string();
        assert!(e.contains(what), "{what}: {e}");
    }
}

#[test]
fn attend_refuses_mismatched_inputs() {
    let (kenc, _) = coded(2, &[16, 8], 64);
    let (venc, _) = coded(2, &[16, 8], 64);
    let (other, _) = coded(2, &[16, 9], 64);
    let kr: Vec<&EncodedLayer> = kenc.iter().collect();
    let vr: Vec<&EncodedLayer> = venc.iter().collect();
    let or: Vec<&EncodedLayer> = other.iter().collect();
    let (kc, vc) = (
        CodedStreams::new(&kr, 2).unwrap(),
        CodedStreams::new(&vr, 2).unwrap(),
    );
    let q = vec![0.5f32; 2 * 64];
    let ex = vec![0.0f32; 2 * 3 * 64];
    let whole = [ExactPiece::f32(&ex, &ex)];
    let short_values = [ExactPiece::f32(&ex, &ex[64..])];
    let odd_keys = [ExactPiece::f32(&ex[1..], &ex)];
    let base = || Attend {
        queries: &q,
        rows: 1,
        key_frames: None,
        rotation: None,
        key_norms: None,
        value_frames: None,
        value_norms: None,
        exact: &whole,
        bias: None,
        scaling: 1.0,
        softcap: None,
        joint: None,
        precision: Precision::F32,
        prepared: None,
    };
    let out = attend(&kc, &vc, &base()).unwrap();
    assert_eq!(out.len(), 2 * 64);
    let oc = CodedStreams::new(&or, 2).unwrap();
    // The error names what is wrong.
    let refused = |v: &CodedStreams<'_>, a: &Attend<'_>, what: &str| {
        let e = attend(&kc, v, a).expect_err("refused").to_string();
        assert!(e.contains(what), "{what}: {e}");
    };
    refused(&oc, &base(), "values");
    let (bias, long_bias) = (vec![0.0f32; 26], vec![0.0f32; 3 * 27]);
    let frames = vec![0.0f32; 64 * 64 - 1];
    let cases = [
        (
            Attend {
                exact: &short_values,
                ..base()
            },
            "exact_values",
        ),
        (
            Attend {
                exact: &odd_keys,
                ..base()
            },
            "exact_keys",
        ),
        (
            Attend {
                bias: Some((&bias, 1)),
                ..base()
            },
            "bias",
        ),
        (
            Attend {
                bias: Some((&long_bias, 3)),
                ..base()
            },
            "bias",
        ),
        (
            Attend {
                value_frames: Some((&frames, 1)),
                ..base()
            },
            "value_frames",
        ),
        (
            Attend {
                queries: &q[1..],
                ..base()
            },
            "queries",
        ),
    ];
    for (a, what) in &cases {
        refused(&vc, a, what);
    }
}

#[test]
fn the_softmax_exponential_is_within_float_rounding() {
    let mut worst = 0.0f64;
    for i in 0..=200_000 {
        let x = -87.0 * i as f32 / 200_000.0;
        let (got, want) = (attend::exp_le0(x) as f64, (x as f64).exp());
        worst = worst.max((got - want).abs() / want);
    }
    assert!(worst < 4e-7, "worst relative error {worst}");
    assert_eq!(attend::exp_le0(0.0), 1.0);
    assert_eq!(attend::exp_le0(f32::NEG_INFINITY), 0.0);
    assert_eq!(attend::exp_le0(-100.0), 0.0);
}

/// Angles repeated across the channel pairs (keys coded across heads: every head's pairs side
/// by side, each turned by the same angles) give the logits of the table spelled out, bit for
/// bit, with every frame product.
#[test]
fn repeated_angles_turn_as_the_table_spelled_out() {
    let (d, streams, g, pairs, repeats) = (48, 2, 3, 8, 3);
    let (encs, _) = coded_at(streams, &[32, 17], d, 2.0);
    let refs: Vec<&EncodedLayer> = encs.iter().collect();
    let c = CodedStreams::new(&refs, streams).unwrap();
    let one = rotation_table(c.tokens(), pairs);
    let spelled_out: Vec<f32> = one
        .chunks_exact(2 * pairs)
        .flat_map(|rt| {
            let (cos, sin) = rt.split_at(pairs);
            [cos.repeat(repeats), sin.repeat(repeats)].concat()
        })
        .collect();
    let frames = normals(d * d, 1);
    let q = normals(streams * g * d, 3);
    let tiled = RopeAngles {
        values: &one,
        rows: 1,
        pairs,
        repeats,
    };
    let spelled = RopeAngles {
        values: &spelled_out,
        rows: 1,
        pairs: pairs * repeats,
        repeats: 1,
    };
    for precision in [Precision::F32, Precision::Bf16, Precision::I16] {
        for frames in [Some((frames.as_slice(), 1)), None] {
            let logits =
                |r: &RopeAngles<'_>| key_logits(&c, frames, Some(r), None, &q, g, precision);
            let want = logits(&spelled).unwrap();
            assert_eq!(logits(&tiled).unwrap(), want, "{precision:?}");
            // And not the logits of the angles applied to one head's pairs only.
            let first = RopeAngles {
                repeats: 1,
                ..tiled
            };
            assert_ne!(logits(&first).unwrap(), want, "{precision:?}");
        }
    }
}
