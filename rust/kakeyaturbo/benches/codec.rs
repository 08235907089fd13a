//! Criterion benchmarks: each pipeline stage on one block, then whole layers.
//!
//! Every benchmark reports `Throughput::Bytes` of the f32 input it processes (`n x D x 4`),
//! so stages and whole-layer numbers compare directly. Ids are parameterised by the head
//! dimension (`D64`, `D128`) and, where it matters, the bit width (`b2`, `b4`). One block
//! is 512 vectors; a layer is 4,096 vectors (8 blocks, encoded in parallel).
//!
//! Data: synthetic KV-like vectors (`tests/common`: decaying spectrum, per-channel offset,
//! one large channel), seeded by `SplitMix64`. Measurement is kept short so the whole run
//! takes a few minutes on two cores:
//!
//! ```text
//! cargo bench -p kakeyaturbo                 # everything
//! cargo bench -p kakeyaturbo -- encode_layer # one group
//! cargo bench -p kakeyaturbo -- recipe_waterfill # the shipped recipe, as a ratio to memcpy
//! cargo bench -p kakeyaturbo -- coded_attention  # attention kernels, as a ratio to decoding
//! ```

use std::hint::black_box;
use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, Throughput,
};
use kakeyaturbo::bitpack::{pack_into, packed_len, unpack};
use kakeyaturbo::coded_attention::{
    attend, key_logits, value_sums, Attend, CodedStreams, ExactPiece, Norms, Precision, RopeAngles,
};
use kakeyaturbo::lloyd_max::gaussian;
use kakeyaturbo::wht::Rotation;
use kakeyaturbo::{
    decode_layer, decode_layer_into, encode_block, encode_layer, kmeans, pca, rsvd, Allocation,
    BasisRef, CodecParams, EncodedLayer, InputDtype, PcaMethod,
};

#[path = "../tests/common/mod.rs"]
mod common;

const BLOCK: usize = 512;
/// The shipped recipe's block (`kakeyaturbo.recipes.DEFAULT_BLOCK_SIZE`).
const RECIPE_BLOCK: usize = 256;
const LAYER_TOKENS: usize = 4096;
const DIMS: [usize; 2] = [64, 128];
const BITS: [u8; 2] = [2, 4];
const SEED: u64 = 0xBE7C;

fn group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut g = c.benchmark_group(name);
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    g
}

/// One benchmark `id` of `f` in a group `name` of its own, `throughput` per call.
fn bench_alone<O>(
    c: &mut Criterion,
    name: &str,
    id: BenchmarkId,
    throughput: Throughput,
    mut f: impl FnMut() -> O,
) {
    let mut g = group(c, name);
    g.throughput(throughput);
    g.bench_function(id, |b| b.iter(&mut f));
    g.finish();
}

fn f32_bytes(n: usize, d: usize) -> Throughput {
    Throughput::Bytes((n * d * std::mem::size_of::<f32>()) as u64)
}

fn block(d: usize) -> Vec<f32> {
    common::kv_like(BLOCK, d, SEED ^ d as u64)
}

fn bench_pca(c: &mut Criterion) {
    let mut g = group(c, "pca_exact");
    for d in DIMS {
        let x = block(d);
        g.throughput(f32_bytes(BLOCK, d));
        g.bench_with_input(BenchmarkId::from_parameter(format!("D{d}")), &x, |b, x| {
            b.iter(|| pca::fit_exact(black_box(x), BLOCK, d, None, 1.0, d).unwrap())
        });
    }
    g.finish();

    let mut g = group(c, "pca_randomized");
    for d in DIMS {
        let x = block(d);
        let rank = d / 4;
        g.throughput(f32_bytes(BLOCK, d));
        g.bench_with_input(
            BenchmarkId::from_parameter(format!("D{d}_r{rank}")),
            &x,
            |b, x| {
                b.iter(|| {
                    rsvd::fit_randomized(black_box(x), BLOCK, d, None, 1.0, d, rank, 8, 2, SEED)
                        .unwrap()
                })
            },
        );
    }
    g.finish();
}

fn bench_kmeans(c: &mut Criterion) {
    let mut g = group(c, "kmeans_fit");
    for d in DIMS {
        // Cluster the centred PCA coefficients, as the codec does.
        let x = block(d);
        let fit = pca::fit_exact(&x, BLOCK, d, None, 1.0, d).unwrap();
        let mut coeffs = vec![0.0f32; BLOCK * fit.d_eff];
        for (i, row) in x.chunks_exact(d).enumerate() {
            for j in 0..fit.d_eff {
                let basis = &fit.basis[j * d..(j + 1) * d];
                coeffs[i * fit.d_eff + j] = row
                    .iter()
                    .zip(&fit.mean)
                    .zip(basis)
                    .map(|((v, m), b)| (v - m) * b)
                    .sum();
            }
        }
        let w = vec![1.0 / BLOCK as f64; BLOCK];
        g.throughput(f32_bytes(BLOCK, d));
        g.bench_with_input(
            BenchmarkId::from_parameter(format!("D{d}_k16")),
            &coeffs,
            |b, cf| b.iter(|| kmeans::fit(black_box(cf), BLOCK, fit.d_eff, 16, 8, &w, SEED)),
        );
    }
    g.finish();
}

fn bench_wht(c: &mut Criterion) {
    let mut g = group(c, "wht_forward");
    for d in DIMS {
        let rot = Rotation::new(d, SEED);
        let mut x = block(d);
        g.throughput(f32_bytes(BLOCK, d));
        g.bench_function(BenchmarkId::from_parameter(format!("D{d}")), |b| {
            // The rotation is orthonormal, so repeating it in place keeps values bounded.
            b.iter(|| {
                for row in x.chunks_exact_mut(d) {
                    rot.forward(black_box(row));
                }
            })
        });
    }
    g.finish();
}

fn bench_quantise_pack(c: &mut Criterion) {
    for d in DIMS {
        // Unit-variance values, as the codec feeds the quantiser after rotation and scaling.
        let x: Vec<f32> = common::kv_like(BLOCK, d, SEED)
            .chunks_exact(d)
            .flat_map(|row| {
                let rms = (row.iter().map(|v| v * v).sum::<f32>() / d as f32).sqrt();
                row.iter().map(move |v| v / rms).collect::<Vec<_>>()
            })
            .collect();
        for bits in BITS {
            let cb = gaussian(bits).unwrap();
            let id = BenchmarkId::from_parameter(format!("D{d}_b{bits}"));
            let codes: Vec<u16> = x.iter().map(|&v| cb.quantize(v)).collect();
            let mut packed = Vec::new();
            pack_into(&codes, bits as u32, &mut packed);
            assert_eq!(packed.len(), packed_len(codes.len(), bits as u32));

            let bytes = || f32_bytes(BLOCK, d);
            let mut out = Vec::with_capacity(x.len());
            bench_alone(c, "lloyd_max_quantise", id.clone(), bytes(), || {
                out.clear();
                out.extend(black_box(&x).iter().map(|&v| cb.quantize(v)));
                black_box(&out);
            });
            let mut buf = Vec::with_capacity(packed.len());
            bench_alone(c, "bit_pack", id.clone(), bytes(), || {
                buf.clear();
                pack_into(black_box(&codes), bits as u32, &mut buf);
                black_box(&buf);
            });
            bench_alone(c, "bit_unpack", id, bytes(), || {
                unpack(black_box(&packed), codes.len(), bits as u32).unwrap()
            });
        }
    }
}

fn layer_params(bits: u8) -> CodecParams {
    CodecParams {
        block_size: BLOCK,
        bit_width: bits,
        seed: SEED,
        ..Default::default()
    }
}

fn bench_block(c: &mut Criterion) {
    let mut g = group(c, "encode_block");
    for d in DIMS {
        let x = block(d);
        let p = layer_params(4);
        g.throughput(f32_bytes(BLOCK, d));
        g.bench_function(BenchmarkId::from_parameter(format!("D{d}_b4")), |b| {
            b.iter(|| {
                encode_block(black_box(&x), BLOCK, d, None, &p, BasisRef::PerBlock, 0).unwrap()
            })
        });
    }
    g.finish();
}

fn bench_layer(c: &mut Criterion) {
    for d in DIMS {
        let x = common::kv_like(LAYER_TOKENS, d, SEED ^ 0x1A7E ^ d as u64);
        for bits in BITS {
            let p = layer_params(bits);
            let id = BenchmarkId::from_parameter(format!("D{d}_b{bits}"));
            let enc = encode_layer(&x, LAYER_TOKENS, d, None, &p, InputDtype::F32).unwrap();

            let values = || f32_bytes(LAYER_TOKENS, d);
            bench_alone(c, "encode_layer", id.clone(), values(), || {
                encode_layer(black_box(&x), LAYER_TOKENS, d, None, &p, InputDtype::F32).unwrap()
            });
            bench_alone(c, "decode_layer", id.clone(), values(), || {
                decode_layer(black_box(&enc)).unwrap()
            });
            let bytes = enc.as_bytes().to_vec();
            bench_alone(c, "from_bytes", id, values(), || {
                EncodedLayer::from_bytes(black_box(bytes.clone())).unwrap()
            });
        }
    }
}

criterion_group!(
    stages,
    bench_pca,
    bench_kmeans,
    bench_wht,
    bench_quantise_pack
);

/// The shipped recipe (`recipes.waterfill_params`): water-filling at 2.5 bits per value,
/// identity basis (the frame is applied outside the codec), no skeleton, 256-token blocks.
fn recipe_params() -> CodecParams {
    CodecParams {
        block_size: RECIPE_BLOCK,
        allocation: Allocation::Waterfill,
        pca_method: PcaMethod::None,
        k: 0,
        bits_per_value: 2.5,
        seed: SEED,
        ..Default::default()
    }
}

/// The shipped recipe on a 4,096-token layer, with a `memcpy` of the same number of f32
/// bytes in the same group, so that every speed reads as a ratio to memory bandwidth
/// measured in the same run. `decode_layer` runs its blocks on the global rayon pool;
/// `decode_layer_1t` runs them inside a one-thread pool (the per-core speed);
/// `decode_into_1t` is that into a reused buffer, as the Python bindings decode. Every id
/// reports the f32 bytes decoded (or, for `encode_layer`, encoded).
fn bench_recipe(c: &mut Criterion) {
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a one-thread pool");
    let mut g = group(c, "recipe_waterfill");
    for d in DIMS {
        let x = common::kv_like(LAYER_TOKENS, d, SEED ^ 0x2EC1 ^ d as u64);
        let p = recipe_params();
        let enc = encode_layer(&x, LAYER_TOKENS, d, None, &p, InputDtype::F32).unwrap();
        let id = |name: &str| BenchmarkId::new(name, format!("D{d}"));
        g.throughput(f32_bytes(LAYER_TOKENS, d));

        let mut dst = vec![0.0f32; x.len()];
        g.bench_function(id("memcpy"), |b| {
            b.iter(|| {
                dst.copy_from_slice(black_box(&x));
                black_box(&dst);
            })
        });
        g.bench_function(id("decode_layer"), |b| {
            b.iter(|| decode_layer(black_box(&enc)).unwrap())
        });
        g.bench_function(id("decode_layer_1t"), |b| {
            one.install(|| b.iter(|| decode_layer(black_box(&enc)).unwrap()))
        });
        // What the Python bindings' batch decode does: a caller's buffer, no fresh zeroed Vec.
        let mut out = vec![0.0f32; x.len()];
        g.bench_function(id("decode_into_1t"), |b| {
            one.install(|| b.iter(|| decode_layer_into(black_box(&enc), None, &mut out).unwrap()))
        });
        g.bench_function(id("encode_layer"), |b| {
            b.iter(|| {
                encode_layer(black_box(&x), LAYER_TOKENS, d, None, &p, InputDtype::F32).unwrap()
            })
        });
    }
    g.finish();
}

/// Decodes each of `encs` into `out` in turn (a block's worth, reused).
fn decode_each(encs: &[&EncodedLayer], out: &mut [f32]) {
    for e in encs {
        decode_layer_into(black_box(e), None, out).unwrap();
    }
}

/// Attention over coded blocks as `KakeyaCache` runs it at 4k tokens: 3 KV-head streams of
/// 4,096 tokens in 256-token blocks, 3 query rows per stream (GQA), one thread; `D192` is a
/// stream's width with three heads of 64 coded together. `decode` is the floor (every block
/// decoded into a reused buffer); `key_logits` adds the frame product, RoPE and the dots
/// (`key_logits_bf16`: the frame product in bfloat16, where the CPU has AVX512-BF16),
/// `key_logits_no_frame` only RoPE and the dots, `value_sums` the norm scale and the weighted
/// sums (`value_sums_joint`, without token norms: summed straight from the codes, no block
/// decoded), `attend` both kernels with the softmax and an exact part between them (the decoded
/// bytes of keys and values: read it as twice `decode`). Every id reports the f32 bytes
/// decoded, so each reads as a ratio to `decode` in the same run.
fn bench_coded_attention(c: &mut Criterion) {
    const STREAMS: usize = 3;
    const ROWS: usize = 3;
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a one-thread pool");
    let mut g = group(c, "coded_attention");
    for d in [64, 128, 192] {
        let p = recipe_params();
        let blocks = LAYER_TOKENS / RECIPE_BLOCK;
        let encs: Vec<EncodedLayer> = (0..STREAMS * blocks)
            .map(|i| {
                let x = common::kv_like(RECIPE_BLOCK, d, SEED ^ (i * 131 + d) as u64);
                encode_layer(&x, RECIPE_BLOCK, d, None, &p, InputDtype::F32).unwrap()
            })
            .collect();
        let refs: Vec<&EncodedLayer> = encs.iter().collect();
        let coded = CodedStreams::new(&refs, STREAMS).unwrap();
        let t = LAYER_TOKENS;
        let frames = common::kv_like(STREAMS * d, d, SEED ^ 0xF7);
        let rot: Vec<f32> = (0..t * d).map(|i| (i as f32 * 0.01).sin()).collect();
        let q = common::kv_like(STREAMS * ROWS, d, SEED ^ 0x9);
        let w = vec![1.0 / t as f32; STREAMS * ROWS * t];
        let norms = vec![1.0f32; STREAMS * t];
        let id = |name: &str| BenchmarkId::new(name, format!("D{d}"));
        g.throughput(f32_bytes(STREAMS * t, d));

        let mut out = vec![0.0f32; RECIPE_BLOCK * d];
        g.bench_function(id("decode_1t"), |b| {
            one.install(|| b.iter(|| decode_each(&refs, &mut out)))
        });
        let rotation = RopeAngles {
            values: &rot,
            rows: 1,
            pairs: d / 2,
            repeats: 1,
        };
        let frame = Some((&frames[..], STREAMS));
        let logits = |frame, precision| {
            key_logits(&coded, frame, Some(&rotation), None, &q, ROWS, precision)
        };
        g.bench_function(id("key_logits_1t"), |b| {
            one.install(|| b.iter(|| logits(frame, Precision::F32)))
        });
        g.bench_function(id("key_logits_bf16_1t"), |b| {
            one.install(|| b.iter(|| logits(frame, Precision::Bf16)))
        });
        g.bench_function(id("key_logits_int16_1t"), |b| {
            one.install(|| b.iter(|| logits(frame, Precision::I16)))
        });
        g.bench_function(id("key_logits_no_frame_1t"), |b| {
            one.install(|| b.iter(|| logits(None, Precision::F32)))
        });
        g.bench_function(id("value_sums_1t"), |b| {
            one.install(|| b.iter(|| value_sums(&coded, &w, Some(&Norms::Values(&norms)), ROWS)))
        });
        if d == 192 {
            // The default recipe's shape: values coded across 3 heads of 64, one stream whose
            // 9 query rows all sum every coordinate (heads' scales are in the weights).
            let joint = CodedStreams::new(&refs[..blocks], 1).unwrap();
            let w9 = vec![1.0 / t as f32; 9 * t];
            g.throughput(f32_bytes(t, d));
            g.bench_function(id("value_sums_joint_1t"), |b| {
                one.install(|| b.iter(|| value_sums(&joint, &w9, None, 9)))
            });
            g.bench_function(id("decode_joint_1t"), |b| {
                one.install(|| b.iter(|| decode_each(&refs[..blocks], &mut out)))
            });
            g.throughput(f32_bytes(STREAMS * t, d));
        }
        // The whole attention of a decode step: both kernels (the same codes as keys and as
        // values), the softmax, the value frame and 64 exact tokens.
        let exact = common::kv_like(STREAMS * 64, d, SEED ^ 0xE);
        let exact_runs = [ExactPiece::f32(&exact, &exact)];
        let whole = || Attend {
            queries: &q,
            rows: ROWS,
            key_frames: frame,
            rotation: Some(RopeAngles { ..rotation }),
            key_norms: None,
            value_frames: frame,
            value_norms: Some(Norms::Values(&norms)),
            exact: &exact_runs,
            bias: None,
            scaling: 0.125,
            softcap: None,
            joint: None,
            precision: Precision::F32,
            prepared: None,
        };
        g.bench_function(id("attend_1t"), |b| {
            one.install(|| b.iter(|| attend(&coded, &coded, &whole())))
        });
    }
    g.finish();
}

criterion_group!(layers, bench_block, bench_layer);
criterion_group!(recipe, bench_recipe);
criterion_group!(attention, bench_coded_attention);
criterion_main!(stages, layers, recipe, attention);
