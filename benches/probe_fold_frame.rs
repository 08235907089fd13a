//! Probe: is a key cheaper as a sum of table entries with the frame folded in, than as the
//! water-filled decoder's 4-value lanes followed by a 64 x 64 frame product?
//!
//! One 4k SmolLM2 layer's keys: 15 blocks x 3 heads of 256 tokens, D = 64, 16 lanes of 4
//! components (widths 2, 2, 1, 1: 64 joint codes per lane). "folded" builds, per block and
//! head, each lane's 64 entries as D-vectors (two partial tables of two components each, one
//! D-vector add per entry) and sums 16 entries per token; "decode" writes 4 values per lane
//! from a table (as `waterfill/decode.rs` does) and "frame product" multiplies by the frame
//! (a plain loop here; the product runs it as torch's GEMM). Each prints its time per layer,
//! and the largest difference of the two results. Standalone (no crate), with the SIMD a
//! runtime-detected kernel would get:
//!
//!     rustc -O -C target-feature=+avx2,+fma benches/probe_fold_frame.rs -o /tmp/probe_fold_frame
//!     /tmp/probe_fold_frame
use std::time::Instant;

const D: usize = 64;
const LANES: usize = 16;
const ENTRIES: usize = 64;
const TOKENS: usize = 256;
const BLOCKS: usize = 15 * 3;
const REPEATS: usize = 20;

/// Component `k` of a lane's joint code `e` (widths 2, 2, 1, 1, the first lowest).
fn part(e: usize, k: usize) -> usize {
    [e & 3, (e >> 2) & 3, (e >> 4) & 1, e >> 5][k]
}

/// A lane's 4 output values for joint code `e`: level times the component's scale.
fn values(scale: &[f32; 4], e: usize) -> [f32; 4] {
    std::array::from_fn(|k| (part(e, k) as f32 - 1.5) * scale[k])
}

#[inline(never)]
fn folded(scales: &[[f32; 4]], frame: &[f32], codes: &[u8], tables: &mut [f32], out: &mut [f32]) {
    let mut low = [[0f32; D]; 16]; // components 0 and 1 of a lane, by their 4-bit code
    let mut high = [[0f32; D]; 4]; // components 2 and 3
    for (l, scale) in scales.iter().enumerate() {
        let row = |k: usize| &frame[(l * 4 + k) * D..][..D];
        for (e, t) in low.iter_mut().enumerate() {
            let v = values(scale, e);
            for c in 0..D {
                t[c] = v[0] * row(0)[c] + v[1] * row(1)[c];
            }
        }
        for (e, t) in high.iter_mut().enumerate() {
            let v = values(scale, e << 4);
            for c in 0..D {
                t[c] = v[2] * row(2)[c] + v[3] * row(3)[c];
            }
        }
        for e in 0..ENTRIES {
            let t = &mut tables[(l * ENTRIES + e) * D..][..D];
            for c in 0..D {
                t[c] = low[e & 15][c] + high[e >> 4][c];
            }
        }
    }
    let tables: &[[f32; D]] = tables.as_chunks().0;
    for (o, code) in out
        .as_chunks_mut::<D>()
        .0
        .iter_mut()
        .zip(codes.chunks_exact(LANES))
    {
        *o = [0.0; D];
        for (l, &e) in code.iter().enumerate() {
            let t = &tables[l * ENTRIES + e as usize];
            for c in 0..D {
                o[c] += t[c];
            }
        }
    }
}

/// The decoder as `waterfill/decode.rs` runs it: one 4-value table entry per lane and token.
#[inline(never)]
fn decode(scales: &[[f32; 4]], codes: &[u8], small: &mut [[f32; 4]], y: &mut [f32]) {
    for (l, scale) in scales.iter().enumerate() {
        for e in 0..ENTRIES {
            small[l * ENTRIES + e] = values(scale, e);
        }
    }
    for (i, row) in y.chunks_exact_mut(D).enumerate() {
        for l in 0..LANES {
            row[l * 4..][..4].copy_from_slice(&small[l * ENTRIES + codes[i * LANES + l] as usize]);
        }
    }
}

#[inline(never)]
fn frame_product(frame: &[f32], y: &[f32], out: &mut [f32]) {
    let frame: &[[f32; D]] = frame.as_chunks().0; // fixed-length rows: no bounds checks
    for (o, row) in out
        .as_chunks_mut::<D>()
        .0
        .iter_mut()
        .zip(y.as_chunks::<D>().0)
    {
        *o = [0.0; D];
        for (m, &a) in frame.iter().zip(row) {
            for c in 0..D {
                o[c] += a * m[c];
            }
        }
    }
}

fn main() {
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let scales: Vec<[f32; 4]> = (0..LANES)
        .map(|_| std::array::from_fn(|_| (next() % 100) as f32 / 50.0))
        .collect();
    let frame: Vec<f32> = (0..D * D)
        .map(|_| (next() % 200) as f32 / 100.0 - 1.0)
        .collect();
    let codes: Vec<u8> = (0..BLOCKS * TOKENS * LANES)
        .map(|_| (next() % ENTRIES as u64) as u8)
        .collect();
    let mut tables = vec![0f32; LANES * ENTRIES * D];
    let (mut a, mut b) = (
        vec![0f32; BLOCKS * TOKENS * D],
        vec![0f32; BLOCKS * TOKENS * D],
    );
    for round in 0..5 {
        let t = Instant::now();
        for _ in 0..REPEATS {
            for (blk, out) in a.chunks_exact_mut(TOKENS * D).enumerate() {
                folded(
                    &scales,
                    &frame,
                    &codes[blk * TOKENS * LANES..][..TOKENS * LANES],
                    &mut tables,
                    out,
                );
            }
        }
        let fold_ms = t.elapsed().as_secs_f64() / REPEATS as f64 * 1e3;
        let mut small = vec![[0f32; 4]; LANES * ENTRIES];
        let mut y = vec![0f32; BLOCKS * TOKENS * D];
        let t = Instant::now();
        for _ in 0..REPEATS {
            for (blk, rows) in y.chunks_exact_mut(TOKENS * D).enumerate() {
                decode(
                    &scales,
                    &codes[blk * TOKENS * LANES..][..TOKENS * LANES],
                    &mut small,
                    rows,
                );
            }
        }
        let decode_ms = t.elapsed().as_secs_f64() / REPEATS as f64 * 1e3;
        let t = Instant::now();
        for _ in 0..REPEATS {
            frame_product(&frame, &y, &mut b);
        }
        let frame_ms = t.elapsed().as_secs_f64() / REPEATS as f64 * 1e3;
        let diff = a
            .iter()
            .zip(&b)
            .map(|(x, z)| (x - z).abs())
            .fold(0f32, f32::max);
        println!(
            "round {round}: folded {fold_ms:.2} ms; decode {decode_ms:.2} ms + frame product \
             {frame_ms:.2} ms per layer (max diff {diff:.1e})"
        );
    }
}
