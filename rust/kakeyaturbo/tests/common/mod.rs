//! Deterministic synthetic KV-like data shared by the integration tests and the benches.
//!
//! Real key/value heads have a quickly decaying spectrum, a non-zero per-channel offset and
//! a few channels far larger than the rest. The generator builds exactly that from
//! [`SplitMix64`] with arithmetic only (sums of uniforms, no `ln`/`cos`), so a seed gives
//! the same bits on every platform: golden files depend on it.

#![allow(dead_code)]

use kakeyaturbo::rng::SplitMix64;

/// Roughly standard normal from the sum of four uniforms (Irwin-Hall, variance matched).
fn approx_normal(g: &mut SplitMix64) -> f32 {
    let s: f64 = (0..4).map(|_| g.next_f64()).sum();
    // Sum of 4 U(0,1) has mean 2 and variance 1/3.
    ((s - 2.0) * 1.732_050_807_568_877_2) as f32
}

/// `n x d` row-major KV-like vectors: `offset + sum_r z_ir s_r v_r + noise`, with
/// `s_r = 1 / (1 + r)` (decaying spectrum), random directions `v_r`, a per-channel offset
/// and channel `d / 3` scaled up eightfold (the "massive activation" channel).
pub fn kv_like(n: usize, d: usize, seed: u64) -> Vec<f32> {
    let mut g = SplitMix64::new(seed, 0x4B56_4441); // "KVDA"
    let rank = d.clamp(1, 16);
    let dirs: Vec<f32> = (0..rank * d)
        .map(|_| approx_normal(&mut g) / (d as f32).sqrt())
        .collect();
    let offset: Vec<f32> = (0..d).map(|_| 0.5 * approx_normal(&mut g)).collect();
    let big = d / 3;
    let mut x = vec![0.0f32; n * d];
    for row in x.chunks_exact_mut(d) {
        row.copy_from_slice(&offset);
        for r in 0..rank {
            let z = approx_normal(&mut g) * 4.0 / (1.0 + r as f32);
            for (v, &u) in row.iter_mut().zip(&dirs[r * d..(r + 1) * d]) {
                *v += z * u;
            }
        }
        for v in row.iter_mut() {
            *v += 0.02 * approx_normal(&mut g);
        }
        row[big] *= 8.0;
    }
    x
}

/// Positive per-token weights (e.g. attention mass), deterministic.
pub fn weights(n: usize, seed: u64) -> Vec<f32> {
    let mut g = SplitMix64::new(seed, 0x5745_4947); // "WEIG"
    (0..n).map(|_| 0.1 + g.next_f64() as f32).collect()
}

/// Rounds every value to bfloat16 and back (what a bf16 tensor handed to the codec holds).
pub fn round_bf16(x: &mut [f32]) {
    for v in x.iter_mut() {
        *v = half::bf16::from_f32(*v).to_f32();
    }
}

/// Rounds every value to IEEE half and back.
pub fn round_f16(x: &mut [f32]) {
    for v in x.iter_mut() {
        *v = half::f16::from_f32(*v).to_f32();
    }
}
