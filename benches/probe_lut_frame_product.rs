//! Probe: would table lookups make the key frame product cheaper than multiply-adds?
//!
//! The product `k_t = sum_j y_tj M[j]` over a block's varying coordinates is the largest part
//! of a decode step on the CPU (docs/speed.md). Each coordinate takes one of `2^b_j` levels, so
//! a pair of coordinates `(j1, j2)` takes at most `2^(b1 + b2)` value pairs, and a table of
//! `v1 M[j1] + v2 M[j2]` for each (built once per block) turns two multiply-adds per output
//! channel into one add of a looked-up row, as LUT-based low-bit matrix products do. Here,
//! over a SmolLM2-like joint key block (256 tokens, 192 channels, 148 varying coordinates of 2
//! to 3 bits, so pairs of at most 6 bits: 64 entries), one core:
//!
//! - "fma": the crate's 6-token x 16-channel tile (`columns_6x16_avx_fma`), frame rows read in
//!   place and each coordinate broadcast;
//! - "table build": every pair's 64 rows of 192 channels, laid out per 16-channel slice;
//! - "lookups, all pairs per tile": the same 6 x 16 register tile adding one table row per
//!   pair and token (each slice's tables, 74 x 4 KB, come from L2);
//! - "lookups, 4 pairs per pass": the tile's sums go through memory after every 4 pairs, so
//!   the tables a pass reads (16 KB) stay in L1.
//!
//! Standalone (no crate), with the SIMD a runtime-detected kernel gets:
//!
//!     rustc -O -C target-feature=+avx2,+fma benches/probe_lut_frame_product.rs -o /tmp/probe_lut
//!     /tmp/probe_lut
use std::arch::x86_64::*;
use std::time::Instant;

const D: usize = 192;
const TOKENS: usize = 256;
const VARYING: usize = 148;
const PAIRS: usize = VARYING / 2;
/// Entries of a pair's table: two codes of up to 3 bits each.
const ENTRIES: usize = 64;
const SLICES: usize = D / 16;
const TILE: usize = 6;
const TILED: usize = TOKENS - TOKENS % TILE;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn uniform(&mut self) -> f32 {
        (self.next() % 20_000) as f32 / 10_000.0 - 1.0
    }
}

/// The block: its varying coordinates' codes and levels, decoded values, the frame.
struct Block {
    frame: Vec<f32>,       // D x D
    varying: Vec<usize>,   // VARYING coordinates
    bits: Vec<u32>,        // per varying coordinate
    levels: Vec<Vec<f32>>, // per varying coordinate, 2^bits values
    codes: Vec<u8>,        // TOKENS x VARYING
    y: Vec<f32>,           // TOKENS x D decoded (the fixed coordinates zero)
}

fn block() -> Block {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let frame = (0..D * D).map(|_| rng.uniform()).collect();
    let varying: Vec<usize> = (0..VARYING).map(|j| j * D / VARYING).collect();
    let bits: Vec<u32> = (0..VARYING).map(|j| [3, 3, 2, 3, 2, 3, 3, 2][j % 8]).collect();
    let levels: Vec<Vec<f32>> = bits
        .iter()
        .map(|&b| (0..1 << b).map(|_| rng.uniform()).collect())
        .collect();
    let mut codes = vec![0u8; TOKENS * VARYING];
    let mut y = vec![0.0f32; TOKENS * D];
    for t in 0..TOKENS {
        for (c, &j) in varying.iter().enumerate() {
            let code = (rng.next() % (1 << bits[c])) as u8;
            codes[t * VARYING + c] = code;
            y[t * D + j] = levels[c][code as usize];
        }
    }
    Block {
        frame,
        varying,
        bits,
        levels,
        codes,
        y,
    }
}

/// The crate's tile: `out[t] = y_t M` over the varying rows, 6 tokens x 16 channels.
#[target_feature(enable = "avx,fma")]
unsafe fn fma_product(b: &Block, out: &mut [f32]) {
    unsafe {
        for t0 in (0..TILED).step_by(TILE) {
            for col in (0..D).step_by(16) {
                let mut acc = [[_mm256_setzero_ps(); 2]; TILE];
                for &j in &b.varying {
                    let row = b.frame.as_ptr().add(j * D + col);
                    let (m0, m1) = (_mm256_loadu_ps(row), _mm256_loadu_ps(row.add(8)));
                    for (r, a) in acc.iter_mut().enumerate() {
                        let p = _mm256_broadcast_ss(&b.y[(t0 + r) * D + j]);
                        a[0] = _mm256_fmadd_ps(p, m0, a[0]);
                        a[1] = _mm256_fmadd_ps(p, m1, a[1]);
                    }
                }
                for (r, a) in acc.iter().enumerate() {
                    let o = out.as_mut_ptr().add((t0 + r) * D + col);
                    _mm256_storeu_ps(o, a[0]);
                    _mm256_storeu_ps(o.add(8), a[1]);
                }
            }
        }
    }
}

/// Each pair's table, `[slice][pair][entry][16]`, and each token's entry per pair.
#[target_feature(enable = "avx,fma")]
unsafe fn build_tables(b: &Block, tables: &mut [f32], index: &mut [u8]) {
    unsafe {
        for p in 0..PAIRS {
            let (c1, c2) = (2 * p, 2 * p + 1);
            let (j1, j2) = (b.varying[c1], b.varying[c2]);
            for (e2, &v2) in b.levels[c2].iter().enumerate() {
                for (e1, &v1) in b.levels[c1].iter().enumerate() {
                    let entry = e1 | (e2 << b.bits[c1]);
                    for s in 0..SLICES {
                        let dst = tables.as_mut_ptr().add(((s * PAIRS + p) * ENTRIES + entry) * 16);
                        for h in 0..2 {
                            let a = _mm256_loadu_ps(b.frame.as_ptr().add(j1 * D + s * 16 + h * 8));
                            let c = _mm256_loadu_ps(b.frame.as_ptr().add(j2 * D + s * 16 + h * 8));
                            let sum = _mm256_fmadd_ps(
                                _mm256_set1_ps(v2),
                                c,
                                _mm256_mul_ps(_mm256_set1_ps(v1), a),
                            );
                            _mm256_storeu_ps(dst.add(h * 8), sum);
                        }
                    }
                }
            }
        }
        for t in 0..TOKENS {
            for p in 0..PAIRS {
                let codes = &b.codes[t * VARYING..];
                index[t * PAIRS + p] = codes[2 * p] | (codes[2 * p + 1] << b.bits[2 * p]);
            }
        }
    }
}

/// Lookups over pairs `pairs` for every 6 x 16 tile, the sums starting from `out` unless
/// `first` (then zero).
#[target_feature(enable = "avx,fma")]
unsafe fn lookups(tables: &[f32], index: &[u8], pairs: std::ops::Range<usize>, first: bool, out: &mut [f32]) {
    unsafe {
        for s in 0..SLICES {
            let col = s * 16;
            for t0 in (0..TILED).step_by(TILE) {
                let mut acc = [[_mm256_setzero_ps(); 2]; TILE];
                if !first {
                    for (r, a) in acc.iter_mut().enumerate() {
                        let o = out.as_ptr().add((t0 + r) * D + col);
                        *a = [_mm256_loadu_ps(o), _mm256_loadu_ps(o.add(8))];
                    }
                }
                for p in pairs.clone() {
                    let table = tables.as_ptr().add((s * PAIRS + p) * ENTRIES * 16);
                    for (r, a) in acc.iter_mut().enumerate() {
                        let row = table.add(*index.get_unchecked((t0 + r) * PAIRS + p) as usize * 16);
                        a[0] = _mm256_add_ps(a[0], _mm256_loadu_ps(row));
                        a[1] = _mm256_add_ps(a[1], _mm256_loadu_ps(row.add(8)));
                    }
                }
                for (r, a) in acc.iter().enumerate() {
                    let o = out.as_mut_ptr().add((t0 + r) * D + col);
                    _mm256_storeu_ps(o, a[0]);
                    _mm256_storeu_ps(o.add(8), a[1]);
                }
            }
        }
    }
}

fn micros(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    for _ in 0..reps {
        f();
    }
    start.elapsed().as_secs_f64() / reps as f64 * 1e6
}

fn main() {
    assert!(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"));
    let b = block();
    let mut tables = vec![0.0f32; SLICES * PAIRS * ENTRIES * 16];
    let mut index = vec![0u8; TOKENS * PAIRS];
    let (mut want, mut got) = (vec![0.0f32; TOKENS * D], vec![0.0f32; TOKENS * D]);
    let reps = 300;
    // SAFETY (every call): AVX2 and FMA are present (asserted); the buffers are sized above.
    let fma = micros(reps, || unsafe { fma_product(&b, &mut want) });
    let build = micros(reps, || unsafe { build_tables(&b, &mut tables, &mut index) });
    let all = micros(reps, || unsafe { lookups(&tables, &index, 0..PAIRS, true, &mut got) });
    let err_all = max_diff(&want, &got);
    let passes = micros(reps, || unsafe {
        for p0 in (0..PAIRS).step_by(4) {
            lookups(&tables, &index, p0..(p0 + 4).min(PAIRS), p0 == 0, &mut got);
        }
    });
    let err_passes = max_diff(&want, &got);
    println!("one block (256 tokens, 192 channels, 148 varying coordinates of 2-3 bits), us:");
    println!("fma (the crate's 6x16 tile):          {fma:7.1}");
    println!("table build (74 pairs x 64 rows):      {build:7.1}");
    println!("lookups, all pairs per tile (L2):      {all:7.1}  (+ build: {:.2}x the fma time; max diff {err_all:.1e})", (build + all) / fma);
    println!("lookups, 4 pairs per pass (L1):        {passes:7.1}  (+ build: {:.2}x the fma time; max diff {err_passes:.1e})", (build + passes) / fma);
}

/// Largest difference over the tokens both products cover (the tiles' whole tokens).
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a[..TILED * D].iter().zip(&b[..TILED * D]).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}
