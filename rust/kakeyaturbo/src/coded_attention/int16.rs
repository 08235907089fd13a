//! The key kernel's frame product `y_t M` in 16-bit integers with exact int32 sums, on CPUs
//! with AVX512-VNNI (`vpdpwssd`: two 16-bit products per int32 lane, twice the float32 FMA
//! rate of the same CPU, the rate of the bfloat16 product).
//!
//! bfloat16 keeps 8 significant bits of each residual and frame entry (on SmolLM2 that moved
//! the teacher-forced KL by less than its noise, -1% +- 1.4% over 6 passages at 4k,
//! `benches/probe_attention_precision.py`). Integers with scales chosen per block keep 11-13
//! bits of both at the same rate (the logits move 5-15x less than with bfloat16):
//!
//! - `y_t M = c M + (y_t - c) M` with `c` the block's centre (as in `bf16.rs`); `c M` in
//!   float32;
//! - each varying coordinate `j`'s residuals as `n_tj = round((y_tj - c_j) / a_j)` with `a_j`
//!   its largest residual in the block over `R`;
//! - the frame's rows scaled by `a_j` and each column `c` as `round(a_j M_jc / b_c)` with
//!   `b_c` the column's largest scaled entry over `R` (once per block: a few percent of the
//!   product);
//! - `out_tc = (c M)_c + b_c * sum_j n_tj M'_jc`, the sum exact in int32: `R` is the largest
//!   (up to 4095) for which `J R^2` (`J` coordinates multiplied) stays below `2^31`.
//!
//! So each product moves by at most about `1 / R` of the coordinate's spread in the block
//! (`R` 4095 for up to 128 multiplied coordinates, 3344 for 192, 1448 for 1024), where
//! bfloat16 moved it by `2^-8` of itself. Coordinates pair as `(2p, 2p + 1)`, the layout
//! `vpdpwssd` reads; a pair is multiplied when either coordinate varies within the block.

use super::bf16::split_pairs;
use std::cell::RefCell;

/// The largest `R`: 13-bit integers, beyond which the rounding is far below the float32
/// sums' own.
const MAX_LEVEL: i32 = 4095;

thread_local! {
    /// A block's integer residuals `[n, d / 2]` and its scaled frame `[active pairs, d]`, as
    /// pairs of 16-bit integers, reused by every block this thread multiplies.
    static BUFFERS: RefCell<(Vec<u32>, Vec<u32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Whether this CPU runs [`product`].
pub(super) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether [`product`] takes a head dim: whole tiles of 16 columns.
pub(super) fn fits(d: usize) -> bool {
    d > 0 && d.is_multiple_of(16)
}

/// The largest integer level `R` with `coords * R^2 < 2^31` (at most [`MAX_LEVEL`]).
pub(super) fn level(coords: usize) -> i32 {
    let limit = (i32::MAX as f64 / coords.max(1) as f64).sqrt().floor() as i32;
    limit.clamp(1, MAX_LEVEL)
}

#[cfg(test)]
/// A block's integer form: the centre's product, the active pairs, the integer residuals
/// `[n, d / 2]` and scaled frame `[active, d]` as pairs (low half: the even coordinate), and
/// each column's scale `b_c`.
pub(super) struct Quantised {
    pub fixed: Vec<f32>,
    pub active: Vec<usize>,
    pub ys: Vec<u32>,
    pub ms: Vec<u32>,
    pub col_scale: Vec<f32>,
}

#[cfg(test)]
/// `x` rounded to nearest (ties to even, as the CPU converts) and clamped to `±r`, as the
/// low 16 bits of its two's complement.
#[inline(always)]
fn to_level(x: f32, r: i32) -> u32 {
    (x.round_ties_even() as i32).clamp(-r, r) as i16 as u16 as u32
}

#[cfg(test)]
/// [`Quantised`] of one decoded block `y` (`n x d`) against the frame `m` (`d x d`), one value
/// at a time: the reference the vector code of [`product`] reproduces bit for bit.
pub(super) fn quantise(y: &[f32], d: usize, m: &[f32]) -> Quantised {
    let (active, centre, fixed) = split_pairs(y, d, m);
    let r = level(2 * active.len());
    let rf = r as f32;
    // Each coordinate's largest residual in the block, and its integer step `a_j`.
    let mut spread = vec![0.0f32; d];
    for yt in y.chunks_exact(d) {
        for ((s, &v), &c) in spread.iter_mut().zip(yt).zip(&centre) {
            *s = s.max((v - c).abs());
        }
    }
    let step: Vec<f32> = spread.iter().map(|&s| s / rf).collect();
    let inv: Vec<f32> = spread
        .iter()
        .map(|&s| if s > 0.0 { rf / s } else { 0.0 })
        .collect();
    let mut ys = Vec::with_capacity(y.len() / 2);
    for yt in y.chunks_exact(d) {
        for p in 0..d / 2 {
            let lo = to_level((yt[2 * p] - centre[2 * p]) * inv[2 * p], r);
            let hi = to_level((yt[2 * p + 1] - centre[2 * p + 1]) * inv[2 * p + 1], r);
            ys.push(lo | hi << 16);
        }
    }
    let mut col_max = vec![0.0f32; d];
    for &p in &active {
        for j in [2 * p, 2 * p + 1] {
            for (c, mx) in col_max.iter_mut().enumerate() {
                *mx = mx.max((step[j] * m[j * d + c]).abs());
            }
        }
    }
    let col_scale: Vec<f32> = col_max.iter().map(|&x| x / rf).collect();
    let col_inv: Vec<f32> = col_max
        .iter()
        .map(|&x| if x > 0.0 { rf / x } else { 0.0 })
        .collect();
    let mut ms = Vec::with_capacity(active.len() * d);
    for &p in &active {
        let (j0, j1) = (2 * p, 2 * p + 1);
        for c in 0..d {
            let lo = to_level(step[j0] * m[j0 * d + c] * col_inv[c], r);
            let hi = to_level(step[j1] * m[j1 * d + c] * col_inv[c], r);
            ms.push(lo | hi << 16);
        }
    }
    Quantised {
        fixed,
        active,
        ys,
        ms,
        col_scale,
    }
}

#[cfg(test)]
/// `out[t] = y_t M` from a block's [`Quantised`] form, one value at a time (the reference).
pub(super) fn product_scalar(q: &Quantised, d: usize, out: &mut [f32]) {
    let half = d / 2;
    let low = |x: u32| x as u16 as i16 as i32;
    let high = |x: u32| (x >> 16) as u16 as i16 as i32;
    for (t, o) in out.chunks_exact_mut(d).enumerate() {
        for (c, o) in o.iter_mut().enumerate() {
            let mut acc = 0i32;
            for (k, &p) in q.active.iter().enumerate() {
                let (yp, mp) = (q.ys[t * half + p], q.ms[k * d + c]);
                acc = acc.wrapping_add(low(yp) * low(mp) + high(yp) * high(mp));
            }
            *o = q.col_scale[c].mul_add(acc as f32, q.fixed[c]);
        }
    }
}

/// `out[t] = y_t M` for every token of a decoded block (`y` and `out` are `n x d`, `n >= 1`,
/// `M` `d x d`), as the module describes.
///
/// Panics unless [`available`] and [`fits`]`(d)` hold and the lengths match: the caller
/// checks the first two, the shapes are the kernel's own.
pub(super) fn product(y: &[f32], d: usize, m: &[f32], out: &mut [f32]) {
    assert!(available() && fits(d));
    assert!(y.len().is_multiple_of(d) && out.len() == y.len() && m.len() == d * d);
    #[cfg(target_arch = "x86_64")]
    BUFFERS.with_borrow_mut(|(ys, ms)| {
        #[allow(unsafe_code)]
        // SAFETY: `available()` found AVX512-VNNI, -BW, -VL and -F; the shapes are asserted
        // above.
        unsafe {
            x86::product(y, d, m, ys, ms, out)
        }
    });
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod x86 {
    use super::{level, split_pairs};
    use std::arch::x86_64::*;

    /// Tokens per tile: 8 tokens by 32 columns (16 where only 16 are left), one 512-bit int32
    /// accumulator per token and 16 columns: 16 of AVX-512's 32 registers.
    const TILE: usize = 8;

    /// [`super::product`], with `ys` and `ms` to hold the block's integer pairs (grown as
    /// needed, never cleared: every value read is written first).
    ///
    /// # Safety
    /// The CPU has AVX512-VNNI, -BW, -VL and -F; `d` is a multiple of 16; `y` and `out` hold
    /// `n x d`, `m` `d x d`.
    #[target_feature(enable = "avx512vnni,avx512bw,avx512vl,avx512f,avx2,fma")]
    pub(super) unsafe fn product(
        y: &[f32],
        d: usize,
        m: &[f32],
        ys: &mut Vec<u32>,
        ms: &mut Vec<u32>,
        out: &mut [f32],
    ) {
        let (active, centre, fixed) = split_pairs(y, d, m);
        let (half, n) = (d / 2, y.len() / d);
        assert!(active.iter().all(|&p| p < half));
        let r = level(2 * active.len());
        let rf = _mm512_set1_ps(r as f32);
        let (lo_r, hi_r) = (_mm512_set1_epi32(-r), _mm512_set1_epi32(r));
        let abs = |x: __m512| {
            _mm512_castsi512_ps(_mm512_and_si512(
                _mm512_castps_si512(x),
                _mm512_set1_epi32(0x7FFF_FFFF),
            ))
        };
        // x * inv rounded to nearest even (the MXCSR default), clamped to +-r, as 16 int16.
        let levels = |x: __m512, inv: __m512| {
            let i = _mm512_cvtps_epi32(_mm512_mul_ps(x, inv));
            _mm512_cvtepi32_epi16(_mm512_min_epi32(_mm512_max_epi32(i, lo_r), hi_r))
        };
        // rf / x where x > 0, else 0 (as the scalar reference).
        let inverse = |x: __m512| {
            let pos = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_setzero_ps());
            _mm512_maskz_div_ps(pos, rf, x)
        };
        // SAFETY (every load and store below): offsets within the asserted shapes.
        // A token's residuals `y_t - c` at columns `c..c + 16`.
        let residual = |yt: &[f32], c: usize| unsafe {
            _mm512_sub_ps(
                _mm512_loadu_ps(yt.as_ptr().add(c)),
                _mm512_loadu_ps(centre.as_ptr().add(c)),
            )
        };
        let mut spread = vec![0.0f32; d];
        for yt in y.chunks_exact(d) {
            for c in (0..d).step_by(16) {
                let v = residual(yt, c);
                unsafe {
                    let s = _mm512_loadu_ps(spread.as_ptr().add(c));
                    _mm512_storeu_ps(spread.as_mut_ptr().add(c), _mm512_max_ps(s, abs(v)));
                }
            }
        }
        let mut step = vec![0.0f32; d];
        let mut inv = vec![0.0f32; d];
        for c in (0..d).step_by(16) {
            unsafe {
                let s = _mm512_loadu_ps(spread.as_ptr().add(c));
                _mm512_storeu_ps(step.as_mut_ptr().add(c), _mm512_div_ps(s, rf));
                _mm512_storeu_ps(inv.as_mut_ptr().add(c), inverse(s));
            }
        }
        if ys.len() < n * half {
            ys.resize(n * half, 0);
        }
        for (yt, o) in y.chunks_exact(d).zip(ys.chunks_exact_mut(half)) {
            for c in (0..d).step_by(16) {
                let v = residual(yt, c);
                unsafe {
                    let q = levels(v, _mm512_loadu_ps(inv.as_ptr().add(c)));
                    _mm256_storeu_si256(o.as_mut_ptr().add(c / 2).cast(), q);
                }
            }
        }
        // The frame's active rows scaled by their steps, each column over its largest entry.
        let mut col_max = vec![0.0f32; d];
        for &p in &active {
            for j in [2 * p, 2 * p + 1] {
                let a = _mm512_set1_ps(step[j]);
                for c in (0..d).step_by(16) {
                    unsafe {
                        let v = _mm512_mul_ps(a, _mm512_loadu_ps(m.as_ptr().add(j * d + c)));
                        let x = _mm512_loadu_ps(col_max.as_ptr().add(c));
                        _mm512_storeu_ps(col_max.as_mut_ptr().add(c), _mm512_max_ps(x, abs(v)));
                    }
                }
            }
        }
        let mut col_scale = vec![0.0f32; d];
        let mut col_inv = vec![0.0f32; d];
        for c in (0..d).step_by(16) {
            unsafe {
                let x = _mm512_loadu_ps(col_max.as_ptr().add(c));
                _mm512_storeu_ps(col_scale.as_mut_ptr().add(c), _mm512_div_ps(x, rf));
                _mm512_storeu_ps(col_inv.as_mut_ptr().add(c), inverse(x));
            }
        }
        if ms.len() < active.len() * d {
            ms.resize(active.len() * d, 0);
        }
        for (&p, o) in active.iter().zip(ms.chunks_exact_mut(d)) {
            let (j0, j1) = (2 * p, 2 * p + 1);
            let (a0, a1) = (_mm512_set1_ps(step[j0]), _mm512_set1_ps(step[j1]));
            for c in (0..d).step_by(16) {
                unsafe {
                    let ci = _mm512_loadu_ps(col_inv.as_ptr().add(c));
                    // (step * m) * col_inv, in the reference's order.
                    let lo = levels(
                        _mm512_mul_ps(a0, _mm512_loadu_ps(m.as_ptr().add(j0 * d + c))),
                        ci,
                    );
                    let hi = levels(
                        _mm512_mul_ps(a1, _mm512_loadu_ps(m.as_ptr().add(j1 * d + c))),
                        ci,
                    );
                    // Per 128-bit lane: columns 0-3 | 8-11 interleaved, then 4-7 | 12-15.
                    let (l, h) = (_mm256_unpacklo_epi16(lo, hi), _mm256_unpackhi_epi16(lo, hi));
                    let dst = o.as_mut_ptr().add(c);
                    _mm256_storeu_si256(dst.cast(), _mm256_permute2x128_si256::<0x20>(l, h));
                    _mm256_storeu_si256(dst.add(8).cast(), _mm256_permute2x128_si256::<0x31>(l, h));
                }
            }
        }
        let mut t = 0;
        while t < n {
            let rows = (n - t).min(TILE);
            let yt = &ys[t * half..][..rows * half];
            let o = &mut out[t * d..][..rows * d];
            // Tiles 32 columns wide where they fit: each token's broadcast feeds two products.
            let mut col = 0;
            while col < d {
                let width = if d - col >= 32 { 32 } else { 16 };
                let cols = Columns {
                    fixed: &fixed[col..col + width],
                    scale: &col_scale[col..col + width],
                    ms: &ms[col..],
                    d,
                };
                // SAFETY: the caller's features; `col + width <= d`, `rows` rows of `yt`, `o`.
                unsafe {
                    match (rows, width) {
                        (TILE, 32) => tile::<TILE, 2>(&active, &cols, yt, half, &mut o[col..]),
                        (TILE, _) => tile::<TILE, 1>(&active, &cols, yt, half, &mut o[col..]),
                        _ => {
                            for (i, o) in o.chunks_exact_mut(d).enumerate() {
                                let (yi, o) = (&yt[i * half..], &mut o[col..]);
                                match width {
                                    32 => tile::<1, 2>(&active, &cols, yi, half, o),
                                    _ => tile::<1, 1>(&active, &cols, yi, half, o),
                                }
                            }
                        }
                    }
                }
                col += width;
            }
            t += rows;
        }
    }

    /// `16 W` output columns: their centre product, their scales and the scaled frame's pairs
    /// from these columns on (`ms[k * d..][..16 W]` is active pair `k`'s).
    struct Columns<'a> {
        fixed: &'a [f32],
        scale: &'a [f32],
        ms: &'a [u32],
        d: usize,
    }

    /// `out[r * d..][..16 W] = fixed + scale * sum over active pairs k of ys[r, p_k] . ms[k]`
    /// for `R` tokens (`ys` holds `R` rows of `half` pairs).
    ///
    /// # Safety
    /// As [`product`]; every active pair is below `half`; the lengths are asserted.
    #[target_feature(enable = "avx512vnni,avx512bw,avx512vl,avx512f,avx2,fma")]
    unsafe fn tile<const R: usize, const W: usize>(
        active: &[usize],
        cols: &Columns<'_>,
        ys: &[u32],
        half: usize,
        out: &mut [f32],
    ) {
        let (d, width) = (cols.d, 16 * W);
        assert!(ys.len() >= R * half && out.len() >= (R - 1) * d + width);
        assert!(active.is_empty() || cols.ms.len() >= (active.len() - 1) * d + width);
        assert!(cols.fixed.len() == width && cols.scale.len() == width);
        let mut acc = [[_mm512_setzero_si512(); W]; R];
        for (k, &p) in active.iter().enumerate() {
            // SAFETY (every load and store): the bounds asserted above.
            let mrow: [__m512i; W] = std::array::from_fn(|w| unsafe {
                _mm512_loadu_si512(cols.ms.as_ptr().add(k * d + 16 * w).cast())
            });
            for (r, a) in acc.iter_mut().enumerate() {
                let b = _mm512_set1_epi32(unsafe { *ys.as_ptr().add(r * half + p) } as i32);
                for (a, &m) in a.iter_mut().zip(&mrow) {
                    *a = _mm512_dpwssd_epi32(*a, m, b);
                }
            }
        }
        for w in 0..W {
            let (f, s) = unsafe {
                (
                    _mm512_loadu_ps(cols.fixed.as_ptr().add(16 * w)),
                    _mm512_loadu_ps(cols.scale.as_ptr().add(16 * w)),
                )
            };
            for (r, a) in acc.iter().enumerate() {
                let v = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(a[w]), f);
                unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(r * d + 16 * w), v) };
            }
        }
    }
}
