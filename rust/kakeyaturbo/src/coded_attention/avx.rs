//! The AVX + FMA kernels written with intrinsics, where the compiler's own code was slower:
//! a dot product, a 6 x 16 tile of the frame product and four tokens' dots with query rows.

/// Tokens per tile of [`BlockFrame::product`](super::frame::BlockFrame::product) in the AVX + FMA
/// build: 6 tokens by 16 columns are 12 accumulators, with the row's two registers and a broadcast
/// 15 of the 16.
#[cfg(target_arch = "x86_64")]
pub(super) const AVX_TILE_TOKENS: usize = 6;

/// [`BlockFrame::columns`](super::frame::BlockFrame::columns) of 6 tokens by 16 columns, written
/// with AVX intrinsics (the compiler left a 6 x 16 array of sums in memory).
///
/// # Safety
/// The CPU has AVX and FMA and every `varying` is below `d` (`BlockFrame::new`); the
/// other bounds (`6 d` values in `ys` and `out`, `col + 16 <= d`, `d x d` in `m`) are
/// asserted.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,fma")]
#[allow(unsafe_code)]
pub(super) unsafe fn columns_6x16_avx_fma(
    fixed: &[f32],
    varying: &[usize],
    m: &[f32],
    ys: &[f32],
    col: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let d = fixed.len();
    assert!(ys.len() >= 6 * d && out.len() >= 6 * d && m.len() >= d * d && col + 16 <= d);
    let fixed = &fixed[col..col + 16];
    let (f0, f1) = unsafe { (_mm256_loadu_ps(&fixed[0]), _mm256_loadu_ps(&fixed[8])) };
    let mut acc = [[f0, f1]; AVX_TILE_TOKENS];
    let (y, m) = (ys.as_ptr(), m.as_ptr());
    for &j in varying {
        // SAFETY (every load): the caller's bounds on `ys`, `m`, `varying` and `col`.
        let row = unsafe { m.add(j * d + col) };
        let (m0, m1) = unsafe { (_mm256_loadu_ps(row), _mm256_loadu_ps(row.add(8))) };
        for (r, a) in acc.iter_mut().enumerate() {
            let p = unsafe { _mm256_broadcast_ss(&*y.add(r * d + j)) };
            a[0] = _mm256_fmadd_ps(p, m0, a[0]);
            a[1] = _mm256_fmadd_ps(p, m1, a[1]);
        }
    }
    for (r, a) in acc.iter().enumerate() {
        let o = &mut out[r * d + col..][..16];
        unsafe {
            _mm256_storeu_ps(&mut o[0], a[0]);
            _mm256_storeu_ps(&mut o[8], a[1]);
        }
    }
}

/// How many tokens ahead [`dots4_avx_fma`] asks for the keys' lines. A block made ahead
/// was written by the other core, and its dots wait on memory: 16 tokens ahead was faster
/// than 8, than row by row and than groups without prefetching (`docs/performance.md`).
pub(super) const PREFETCH_TOKENS: usize = 16;

/// `a . b` in two 8-lane AVX accumulators, then the tail.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,fma")]
#[allow(unsafe_code)]
pub(super) fn dot_avx_fma(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    // SAFETY (every load): `i + 8 <= n` (or `i + 16 <= n`), within both slices.
    while i + 16 <= n {
        let (x0, y0) = unsafe { (_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i))) };
        let (x1, y1) = unsafe {
            (
                _mm256_loadu_ps(pa.add(i + 8)),
                _mm256_loadu_ps(pb.add(i + 8)),
            )
        };
        acc0 = _mm256_fmadd_ps(x0, y0, acc0);
        acc1 = _mm256_fmadd_ps(x1, y1, acc1);
        i += 16;
    }
    if i + 8 <= n {
        let (x0, y0) = unsafe { (_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i))) };
        acc0 = _mm256_fmadd_ps(x0, y0, acc0);
        i += 8;
    }
    let acc = _mm256_add_ps(acc0, acc1);
    let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    let mut sum = _mm_cvtss_f32(s);
    for j in i..n {
        sum = a[j].mul_add(b[j], sum);
    }
    sum
}

/// `out[r, t] = q_r . keys[t]` for `R` query rows (`q` `[R, d]`, `out` `[R, n]`) sharing
/// `chunks`, over the first `tokens` keys (a multiple of 4) in fours, each key chunk loaded
/// once for the `R` rows: one 8-lane accumulator per row and token, the lanes reduced by
/// horizontal adds (one reduction per sum cost more than its products).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,fma")]
#[allow(unsafe_code)]
pub(super) fn dots4_avx_fma<const R: usize>(
    q: &[f32],
    chunks: &[usize],
    keys: &[f32],
    tokens: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let d = q.len() / R;
    let n = out.len() / R;
    assert!(q.len() == R * d && d.is_multiple_of(8) && tokens.is_multiple_of(4));
    assert!(tokens <= n && keys.len() >= tokens * d);
    assert!(chunks.iter().all(|&c| c + 8 <= d));
    for t0 in (0..tokens).step_by(4) {
        let mut acc = [[_mm256_setzero_ps(); 4]; R];
        if t0 + PREFETCH_TOKENS + 4 <= tokens {
            for t in t0 + PREFETCH_TOKENS..t0 + PREFETCH_TOKENS + 4 {
                // A 64-byte line holds two chunks of 8 floats.
                for &c in chunks.iter().step_by(2) {
                    // SAFETY: `t < tokens` and `c < d`: an address inside `keys`.
                    let at = unsafe { keys.as_ptr().add(t * d + c) };
                    _mm_prefetch::<_MM_HINT_T0>(at.cast());
                }
            }
        }
        for &c in chunks {
            // SAFETY (every load): `c + 8 <= d`, `q` holds `R` rows of `d` and `keys` at least
            // `tokens` rows of `d`, `t0 + 3 < tokens`.
            let qv: [__m256; R] =
                std::array::from_fn(|r| unsafe { _mm256_loadu_ps(q.as_ptr().add(r * d + c)) });
            for t in 0..4 {
                let kv = unsafe { _mm256_loadu_ps(keys.as_ptr().add((t0 + t) * d + c)) };
                for (a, &qr) in acc.iter_mut().zip(&qv) {
                    a[t] = _mm256_fmadd_ps(qr, kv, a[t]);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            // Pairwise horizontal adds: lanes 0-3 then hold tokens' sums of their lanes 0-3,
            // lanes 4-7 of their lanes 4-7.
            let h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
            let sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
            // SAFETY: `r < R` and `t0 + 4 <= tokens <= n`.
            unsafe { _mm_storeu_ps(out.as_mut_ptr().add(r * n + t0), sums) };
        }
    }
}
