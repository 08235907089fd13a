//! The key kernel's frame product `y_t M` with bfloat16 inputs and float32 sums, on CPUs that
//! multiply bfloat16 pairs natively (AVX512-BF16's `vdpbf16ps`: two products per float32
//! lane, twice the float32 FMA rate of the same CPU).
//!
//! For frames across heads the product is about two thirds of a decode step's key kernel
//! (~150 varying coordinates x 192 columns per token), and the float32 build already runs it
//! near the FMA units' rate, so halving the instructions is the one way to make it faster.
//!
//! The product is split as `c M + (y_t - c) M` with `c` the block's centre (each varying
//! coordinate's block mean): `c M` once per block in float32, the residuals `y_t - c` and `M`
//! rounded to bfloat16 (to nearest even), the sums in float32. Each product then moves by at
//! most about `2^-8` of itself, relative to the coordinate's spread within the block (which
//! the codec's own error of several percent scales with), not to a large mean: rounding
//! `y_t` itself measured a 9% higher teacher-forced KL on SmolLM2 at 4k than float32.
//!
//! Coordinates pair as `(2p, 2p + 1)`, the layout `vdpbf16ps` reads: a pair is multiplied
//! when either coordinate varies within the block; the other pairs' residuals are zero.

use super::frame::axpy;
use std::cell::RefCell;

thread_local! {
    /// A block's coordinates as bfloat16 pairs, reused by every block this thread multiplies
    /// (as `KEYS`, a fresh buffer per block cost an allocation and its page faults).
    static PAIRS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// `x` rounded to bfloat16 (nearest, ties to even; NaN stays NaN), as its 16 bits.
#[inline(always)]
pub(super) fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// Frames `[heads, d, d]` as bfloat16 pairs `[heads, d / 2, d]`: entry `(p, c)` holds
/// `M[2p, c]` in its low half and `M[2p + 1, c]` in its high half (`d` even). Converted 16
/// at a time by the CPU where [`product`] runs, else one by one (the same bits).
pub(super) fn pack_pairs(frames: &[f32], d: usize) -> Vec<u32> {
    #[cfg(target_arch = "x86_64")]
    if available() && fits(d) && frames.len().is_multiple_of(d * d) {
        #[allow(unsafe_code)]
        // SAFETY: `available()` found the features; `d` is a multiple of 16 and `frames`
        // whole `d x d` matrices.
        return unsafe { x86::pack_pairs(frames, d) };
    }
    pack_pairs_scalar(frames, d)
}

/// [`pack_pairs`] one value at a time.
pub(super) fn pack_pairs_scalar(frames: &[f32], d: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(frames.len() / 2);
    for m in frames.chunks_exact(d * d) {
        for rows in m.chunks_exact(2 * d) {
            let (lo, hi) = rows.split_at(d);
            out.extend(
                lo.iter()
                    .zip(hi)
                    .map(|(&a, &b)| bf16_bits(a) as u32 | (bf16_bits(b) as u32) << 16),
            );
        }
    }
    out
}

/// Whether this CPU runs [`product`].
pub(super) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512bf16")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx2")
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

/// `out[t] = y_t M` for every token of a decoded block (`y` and `out` are `n x d`, `n >= 1`),
/// `M` given in float32 (`d x d`, for the centre's product) and as [`pack_pairs`] (`d / 2 x d`,
/// for the residuals').
///
/// Panics unless [`available`] and [`fits`]`(d)` hold and the lengths match: the caller
/// checks the first two, the shapes are the kernel's own.
pub(super) fn product(y: &[f32], d: usize, m: &[f32], pairs: &[u32], out: &mut [f32]) {
    assert!(available() && fits(d));
    assert!(y.len().is_multiple_of(d) && out.len() == y.len());
    assert!(m.len() == d * d && pairs.len() == d * d / 2);
    #[cfg(target_arch = "x86_64")]
    {
        PAIRS.with_borrow_mut(|yb| {
            // Grown, never cleared: the product writes all of its first `n d / 2`.
            if yb.len() < y.len() / 2 {
                yb.resize(y.len() / 2, 0);
            }
            #[allow(unsafe_code)]
            // SAFETY: `available()` found AVX512-BF16, AVX512-VL, AVX512-F and AVX2; the
            // shapes are asserted above.
            unsafe {
                x86::product(y, d, m, pairs, &mut yb[..y.len() / 2], out)
            };
        });
    }
}

/// A block's split of `y_t M` into `c M + (y_t - c) M`: the pairs with a varying coordinate,
/// the centre `c` (`[d]`: a varying coordinate's block mean, summed in token order in float32
/// and divided by `n`; another's value) and `c M` in float32.
///
/// Inlined, so that its two passes over the block compile with the caller's vector width: as
/// its own function with a branch per coordinate it was a tenth of a decode step's cycles.
#[inline(always)]
pub(super) fn split_pairs(y: &[f32], d: usize, m: &[f32]) -> (Vec<usize>, Vec<f32>, Vec<f32>) {
    let first = &y[..d];
    // One pass: which coordinates differ from the first token's (`!=` also marks NaN), and
    // every coordinate's sum in token order (kept only for the varying ones).
    let mut differs = vec![0u32; d];
    let mut sum = first.to_vec();
    for yt in y.chunks_exact(d).skip(1) {
        for (((v, s), &a), &b) in differs.iter_mut().zip(sum.iter_mut()).zip(yt).zip(first) {
            *v |= (a != b) as u32;
            *s += a;
        }
    }
    let n = (y.len() / d) as f32;
    let centre: Vec<f32> = sum
        .iter()
        .zip(first)
        .zip(&differs)
        .map(|((&s, &a), &v)| if v != 0 { s / n } else { a })
        .collect();
    let active: Vec<usize> = (0..d / 2)
        .filter(|&p| differs[2 * p] | differs[2 * p + 1] != 0)
        .collect();
    let fixed = centre_product(&centre, d, m);
    (active, centre, fixed)
}

/// `c M` in float32 (`c` has `d` values, `m` is `d x d`), the rows of `c`'s zeros skipped
/// (inlined, so that it takes its caller's vector width).
#[inline(always)]
pub(super) fn centre_product(centre: &[f32], d: usize, m: &[f32]) -> Vec<f32> {
    let mut fixed = vec![0.0f32; d];
    for (j, &a) in centre.iter().enumerate().filter(|&(_, &a)| a != 0.0) {
        axpy::<false>(a, &m[j * d..][..d], &mut fixed);
    }
    fixed
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod x86 {
    use super::split_pairs;
    use std::arch::x86_64::*;

    /// Tokens per tile: 8 tokens by 16 columns are 16 accumulators, which AVX-512's 32
    /// registers hold beside the frame row and the broadcast (measured: 6 and 10 ran slower).
    const TILE: usize = 8;

    /// The same 256 bits as 16 bfloat16.
    #[inline(always)]
    fn bh(x: __m256i) -> __m256bh {
        // SAFETY: both are plain 256-bit vectors; every bit pattern is a valid value of each.
        unsafe { std::mem::transmute::<__m256i, __m256bh>(x) }
    }

    /// The same 256 bits as integers.
    #[inline(always)]
    fn bits(x: __m256bh) -> __m256i {
        // SAFETY: as for `bh`.
        unsafe { std::mem::transmute::<__m256bh, __m256i>(x) }
    }

    /// [`super::product`], with `yb` (`n x d / 2`) to hold the block as bfloat16 pairs.
    ///
    /// # Safety
    /// The CPU has AVX512-BF16, AVX512-VL, AVX512-F and AVX2; `d` is a multiple of 16;
    /// `y` and `out` hold `n x d`, `m` `d x d`, `pairs` `d / 2 x d`, `yb` `n x d / 2`.
    #[target_feature(enable = "avx512bf16,avx512vl,avx512f,avx2,fma")]
    pub(super) unsafe fn product(
        y: &[f32],
        d: usize,
        m: &[f32],
        pairs: &[u32],
        yb: &mut [u32],
        out: &mut [f32],
    ) {
        let (active, centre, fixed) = split_pairs(y, d, m);
        let half = d / 2;
        // What `tile` relies on, checked once per block.
        assert!(active.iter().all(|&p| p < half));
        // The block's coordinates less their centre as bfloat16 pairs, `[n, d / 2]`: 16
        // floats to 8 pairs. Centred, each rounding is relative to the coordinate's spread
        // in the block, which the codec's own error scales with, not to a large mean.
        for (i, (x, o)) in y.chunks_exact(16).zip(yb.chunks_exact_mut(8)).enumerate() {
            let c = &centre[i * 16 % d..][..16];
            // SAFETY: 16 floats in, 8 pairs (32 bytes) out.
            unsafe {
                let r = _mm512_sub_ps(_mm512_loadu_ps(x.as_ptr()), _mm512_loadu_ps(c.as_ptr()));
                _mm256_storeu_si256(o.as_mut_ptr().cast(), bits(_mm512_cvtneps_pbh(r)));
            }
        }
        let n = y.len() / d;
        let mut t = 0;
        while t < n {
            let r = (n - t).min(TILE);
            let ys = &yb[t * half..][..r * half];
            let o = &mut out[t * d..][..r * d];
            for col in (0..d).step_by(16) {
                // SAFETY: the caller's features and shapes; `col + 16 <= d`, `r` rows.
                unsafe {
                    match r {
                        TILE => tile::<TILE>(&active, &fixed, pairs, ys, d, col, o),
                        _ => {
                            for (i, o) in o.chunks_exact_mut(d).enumerate() {
                                tile::<1>(&active, &fixed, pairs, &ys[i * half..], d, col, o);
                            }
                        }
                    }
                }
            }
            t += r;
        }
    }

    /// [`super::pack_pairs`]: rows `2p` and `2p + 1` converted 16 columns at a time, then
    /// interleaved.
    ///
    /// # Safety
    /// The CPU has AVX512-BF16, AVX512-VL, AVX512-F and AVX2; `d` is a multiple of 16 and
    /// `frames` holds whole `d x d` matrices.
    #[target_feature(enable = "avx512bf16,avx512vl,avx512f,avx2,fma")]
    pub(super) unsafe fn pack_pairs(frames: &[f32], d: usize) -> Vec<u32> {
        let mut out = vec![0u32; frames.len() / 2];
        for (rows, o) in frames.chunks_exact(2 * d).zip(out.chunks_exact_mut(d)) {
            let (lo, hi) = rows.split_at(d);
            for c in (0..d).step_by(16) {
                // SAFETY: `c + 16 <= d` within both rows and the output row.
                unsafe {
                    let a = bits(_mm512_cvtneps_pbh(_mm512_loadu_ps(lo.as_ptr().add(c))));
                    let b = bits(_mm512_cvtneps_pbh(_mm512_loadu_ps(hi.as_ptr().add(c))));
                    // Per 128-bit lane: columns 0-3 | 8-11 interleaved, then 4-7 | 12-15.
                    let (l, h) = (_mm256_unpacklo_epi16(a, b), _mm256_unpackhi_epi16(a, b));
                    let p = o.as_mut_ptr().add(c);
                    _mm256_storeu_si256(p.cast(), _mm256_permute2x128_si256::<0x20>(l, h));
                    _mm256_storeu_si256(p.add(8).cast(), _mm256_permute2x128_si256::<0x31>(l, h));
                }
            }
        }
        out
    }

    /// `out[r, col..col + 16] = fixed[col..] + sum over active pairs p of ys[r, p] . pairs[p, col..]`
    /// for `R` tokens.
    ///
    /// # Safety
    /// As [`product`], and every active pair is below `d / 2` (asserted there); `ys` holds
    /// `R x d / 2`, `out` `R x d`, `col + 16 <= d` (asserted here).
    #[target_feature(enable = "avx512bf16,avx512vl,avx512f,avx2,fma")]
    unsafe fn tile<const R: usize>(
        active: &[usize],
        fixed: &[f32],
        pairs: &[u32],
        ys: &[u32],
        d: usize,
        col: usize,
        out: &mut [f32],
    ) {
        let half = d / 2;
        assert!(col + 16 <= d && ys.len() >= R * half && out.len() >= R * d);
        assert!(pairs.len() >= half * d);
        // SAFETY (every load and store): the bounds asserted above.
        let (f0, f1) = unsafe {
            (
                _mm256_loadu_ps(fixed.as_ptr().add(col)),
                _mm256_loadu_ps(fixed.as_ptr().add(col + 8)),
            )
        };
        let mut acc = [[f0, f1]; R];
        for &p in active {
            let row = unsafe { pairs.as_ptr().add(p * d + col) };
            let (m0, m1) = unsafe {
                (
                    bh(_mm256_loadu_si256(row.cast())),
                    bh(_mm256_loadu_si256(row.add(8).cast())),
                )
            };
            for (r, a) in acc.iter_mut().enumerate() {
                let b = bh(_mm256_set1_epi32(
                    unsafe { *ys.as_ptr().add(r * half + p) } as i32
                ));
                a[0] = _mm256_dpbf16_ps(a[0], m0, b);
                a[1] = _mm256_dpbf16_ps(a[1], m1, b);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            unsafe {
                _mm256_storeu_ps(out.as_mut_ptr().add(r * d + col), a[0]);
                _mm256_storeu_ps(out.as_mut_ptr().add(r * d + col + 8), a[1]);
            }
        }
    }
}
