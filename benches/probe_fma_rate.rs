//! Probe: how many float32 multiply-adds per second does one core of this CPU make, and how
//! close does the key frame product's tile come to that?
//!
//! Attention over keys coded across heads spends most of a decode step in the key frame
//! product (`BlockFrame` in `rust/kakeyaturbo/src/coded_attention.rs`): per coded token, the
//! varying coordinates times the `H*D x H*D` frame. This probe measures the ceiling that
//! product runs against, so a step's time can be read against the CPU rather than against
//! another machine's:
//!
//! - "peak": 12 independent chains of 8-lane FMAs, no loads (the core's FMA issue rate);
//! - "int16 peak": 8 chains of `vpmaddwd` + `vpaddd` (16 int16 products an instruction, as
//!   the int16 product's AVX2 tiles make them, `coded_attention/int16.rs`), no loads;
//! - "tile 6x16": the product's AVX tile as the crate runs it (6 tokens by 16 columns, 12
//!   accumulators, the frame's rows read in place, the coordinates broadcast from the block)
//!   over a SmolLM2-like joint key block: 256 tokens of 192 coordinates, 148 of them varying
//!   (23% of the default bundle's key components get no bits,
//!   `reports/probe_component_widths.txt`);
//! - and what a 4k decode step's key products need at each rate: 30 layers x 3,840 coded
//!   tokens x 148 x 192 multiply-adds.
//!
//! Standalone (no crate), with the SIMD a runtime-detected kernel gets:
//!
//!     rustc -O -C target-feature=+avx2,+fma benches/probe_fma_rate.rs -o /tmp/probe_fma_rate
//!     /tmp/probe_fma_rate
use std::arch::x86_64::*;
use std::time::Instant;

const D: usize = 192;
const VARYING: usize = 148;
const TOKENS: usize = 256;
const STEP_MACS: f64 = 30.0 * 3840.0 * VARYING as f64 * D as f64;

/// Multiply-adds per second of `body` (`macs` a call), the best of 3 runs of 50M calls.
fn rate(macs: usize, body: impl Fn()) -> f64 {
    const ITERS: usize = 50_000_000;
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        for _ in 0..ITERS {
            body();
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    (ITERS * macs) as f64 / best
}

/// Lanes of multiply-add per second with no loads: 12 independent chains of
/// `vfmadd231ps` on ymm registers, written as assembly so the compiler keeps every one.
fn peak() -> f64 {
    rate(12 * 8, || {
        #[allow(unsafe_code)]
        // SAFETY: register-only arithmetic on ymm0-ymm11 (declared clobbered) from
        // ymm14-ymm15; compiled with AVX2 + FMA (see the header).
        unsafe {
            std::arch::asm!(
                "vfmadd231ps ymm0, ymm14, ymm15",
                "vfmadd231ps ymm1, ymm14, ymm15",
                "vfmadd231ps ymm2, ymm14, ymm15",
                "vfmadd231ps ymm3, ymm14, ymm15",
                "vfmadd231ps ymm4, ymm14, ymm15",
                "vfmadd231ps ymm5, ymm14, ymm15",
                "vfmadd231ps ymm6, ymm14, ymm15",
                "vfmadd231ps ymm7, ymm14, ymm15",
                "vfmadd231ps ymm8, ymm14, ymm15",
                "vfmadd231ps ymm9, ymm14, ymm15",
                "vfmadd231ps ymm10, ymm14, ymm15",
                "vfmadd231ps ymm11, ymm14, ymm15",
                out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
                out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                options(nomem, nostack),
            )
        };
    })
}

/// Multiply-adds per second of 16-bit pairs into int32 lanes, no loads: 8 independent
/// chains of `vpmaddwd` (16 products) and the `vpaddd` that accumulates it.
fn int16_peak() -> f64 {
    rate(8 * 16, || {
        #[allow(unsafe_code)]
        // SAFETY: register-only arithmetic on ymm0-ymm11 (declared clobbered) from
        // ymm14-ymm15; compiled with AVX2 (see the header).
        unsafe {
            std::arch::asm!(
                "vpmaddwd ymm8, ymm14, ymm15",
                "vpaddd ymm0, ymm0, ymm8",
                "vpmaddwd ymm9, ymm14, ymm15",
                "vpaddd ymm1, ymm1, ymm9",
                "vpmaddwd ymm10, ymm14, ymm15",
                "vpaddd ymm2, ymm2, ymm10",
                "vpmaddwd ymm11, ymm14, ymm15",
                "vpaddd ymm3, ymm3, ymm11",
                "vpmaddwd ymm8, ymm14, ymm15",
                "vpaddd ymm4, ymm4, ymm8",
                "vpmaddwd ymm9, ymm14, ymm15",
                "vpaddd ymm5, ymm5, ymm9",
                "vpmaddwd ymm10, ymm14, ymm15",
                "vpaddd ymm6, ymm6, ymm10",
                "vpmaddwd ymm11, ymm14, ymm15",
                "vpaddd ymm7, ymm7, ymm11",
                out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
                out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                options(nomem, nostack),
            )
        };
    })
}

/// The crate's 6 x 16 tile over one block: `out[t] = sum_j y[t, j] m[j]` over the varying `j`
/// (the crate starts from the fixed coordinates' vector), the frame's rows read in place
/// (`columns_6x16_avx_fma`).
fn tile_6x16(y: &[f32], m: &[f32], varying: &[usize], out: &mut [f32]) {
    for t in (0..TOKENS / 6 * 6).step_by(6) {
        for col in (0..D).step_by(16) {
            #[allow(unsafe_code)]
            // SAFETY: AVX2 + FMA (the header); `t + 6 <= TOKENS`, `col + 16 <= D`, and
            // every `j < D`, so each load and store is within `y`, `m` and `out`.
            unsafe {
                let mut acc = [[_mm256_setzero_ps(); 2]; 6];
                for &j in varying {
                    let row = m.as_ptr().add(j * D + col);
                    let (m0, m1) = (_mm256_loadu_ps(row), _mm256_loadu_ps(row.add(8)));
                    for (r, a) in acc.iter_mut().enumerate() {
                        let p = _mm256_broadcast_ss(&*y.as_ptr().add((t + r) * D + j));
                        a[0] = _mm256_fmadd_ps(p, m0, a[0]);
                        a[1] = _mm256_fmadd_ps(p, m1, a[1]);
                    }
                }
                for (r, a) in acc.iter().enumerate() {
                    let o = out.as_mut_ptr().add((t + r) * D + col);
                    _mm256_storeu_ps(o, a[0]);
                    _mm256_storeu_ps(o.add(8), a[1]);
                }
            }
        }
    }
}

fn main() {
    if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
        println!("this CPU lacks AVX2 + FMA: nothing to measure");
        return;
    }
    // Deterministic values; every 4th to 5th coordinate fixed, as in a bundle's key blocks.
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let y: Vec<f32> = (0..TOKENS * D).map(|_| next()).collect();
    let m: Vec<f32> = (0..D * D).map(|_| next()).collect();
    let varying: Vec<usize> = (0..D)
        .filter(|j| j * VARYING / D != (j + 1) * VARYING / D)
        .collect();
    assert_eq!(varying.len(), VARYING);
    let mut out = vec![0.0f32; TOKENS * D];

    let p = peak();
    let reps = 200;
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..reps {
            tile_6x16(&y, &m, &varying, &mut out);
            std::hint::black_box(&mut out);
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    let tile = (reps * (TOKENS / 6 * 6) * VARYING * D) as f64 / best;
    println!(
        "peak (12 FMA chains, no loads): {:6.2} G multiply-adds/s",
        p / 1e9
    );
    let i16 = int16_peak();
    println!(
        "int16 peak (vpmaddwd + vpaddd):  {:6.2} G multiply-adds/s ({:.2}x the FMA peak)",
        i16 / 1e9,
        i16 / p
    );
    println!(
        "tile 6x16 (joint key block):     {:6.2} G multiply-adds/s ({:.0}% of peak)",
        tile / 1e9,
        100.0 * tile / p
    );
    println!(
        "a 4k step's key products ({:.2} G multiply-adds): {:.0} ms of one core at peak, {:.0} ms at the tile's rate",
        STEP_MACS / 1e9,
        1e3 * STEP_MACS / p,
        1e3 * STEP_MACS / tile
    );
}
