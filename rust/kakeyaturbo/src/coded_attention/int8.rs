//! The key kernel's frame product `y_t M` in 16- and 8-bit integers with exact int32 sums, on
//! CPUs with AVX512-VNNI: the block's largest coordinates as `int16.rs` multiplies them
//! (`vpdpwssd`, two products per int32 lane), the rest in bytes (`vpdpbusd`, four), so the
//! product issues about two thirds of `int16.rs`'s instructions.
//!
//! Bytes alone (7 bits and a sign of each residual and frame entry) moved SmolLM2's
//! teacher-forced KL by +23% at 4k: every coordinate's residuals span the whole byte, so each
//! adds the frame's rounding at the scale of the column's largest entry. Keeping in 16 bits the
//! fours of coordinates whose scaled frame rows are largest, and giving the other coordinates
//! coarser residual steps where that balances the two roundings, keeps the logits within about
//! bfloat16's reach of float32's (`docs/speed.md`, 42nd session):
//!
//! - `y_t M = c M + (y_t - c) M` with `c` the block's centre (as in `int16.rs`);
//! - the active fours (coordinates `4q .. 4q + 3`) ranked by their largest `spread_j |M_jc|`;
//!   the top [`WIDE_SHARE`] are *wide*: integers of `int16.rs`'s level `R` for both the
//!   residuals and the frame's rows, with their own column scales;
//! - the other fours are *narrow*: residuals as bytes `n_tj + 128` with
//!   `|n_tj| <= 127` at step `a_j = max(spread_j / 127, (s_j B / S_j)^(1/4))` (`s_j` the
//!   coordinate's mean squared residual, `S_j` its frame row's sum of squares, `B` the sum of
//!   the columns' squared byte scales at `a = spread / 127`: the step that balances the
//!   residual's rounding against the frame's), and the frame's rows as signed bytes over each
//!   column's largest narrow entry;
//! - `out_tc = (c M)_c + w_c * wide_tc + b_c * (narrow_tc - 128 sum_j M'_jc)`, each sum exact
//!   in int32.

use super::int16::level;
use std::cell::RefCell;

/// The byte level of narrow residuals and frame entries.
const BYTE: i32 = 127;

/// The share of a block's active fours multiplied wide (rounded up). Over the blocks of a
/// SmolLM2 decode step at 4k, a third kept the logits at 1.3x bfloat16's RMS error from float32
/// (a half: 0.9x; none: 5x, and 10x without the balanced steps).
const WIDE_SHARE: (usize, usize) = (1, 3);

thread_local! {
    /// A block's wide residual pairs `[n, d / 2]`, narrow residual fours `[n, d / 4]`, wide
    /// frame pairs and narrow frame fours `[fours, d]`, reused by every block this thread
    /// multiplies.
    static BUFFERS: RefCell<[Vec<u32>; 4]> = const { RefCell::new([Vec::new(), Vec::new(), Vec::new(), Vec::new()]) };
}

/// Whether this CPU runs [`product`].
pub(super) fn available() -> bool {
    super::int16::available()
}

/// Whether [`product`] takes a head dim: whole tiles of 16 columns.
pub(super) fn fits(d: usize) -> bool {
    d > 0 && d.is_multiple_of(16)
}

/// How a block splits and scales, shared by the vector code and its reference (made by the
/// same plain code from [`Stats`] that both compute alike, so they agree bit for bit).
pub(super) struct Plan {
    /// `c M`.
    pub fixed: Vec<f32>,
    pub centre: Vec<f32>,
    /// Wide pairs `p` (coordinates `2p, 2p + 1`) and narrow fours `q`, ascending.
    pub wide: Vec<usize>,
    pub narrow: Vec<usize>,
    /// Each coordinate's residual step (wide: `spread / R`, narrow: `a_j`; 0: constant).
    pub step: Vec<f32>,
    /// The wide integers' level `R`.
    pub level: i32,
}

/// `x` over `s` where `s > 0`, else 0 (a constant coordinate's or column's inverse).
#[inline(always)]
fn inverse(x: f32, s: f32) -> f32 {
    if s > 0.0 {
        x / s
    } else {
        0.0
    }
}

/// Each `d x d` frame's rows' largest entry, then their sums of squares: `[frames, 2, d]`,
/// what [`product`] reads of a frame besides the frame (once per call, not per block).
pub(super) fn frame_rows(frames: &[f32], d: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(2 * frames.len() / d);
    for m in frames.chunks_exact(d * d) {
        let mut energy = Vec::with_capacity(d);
        for row in m.chunks_exact(d) {
            out.push(row.iter().fold(0.0f32, |a, &x| a.max(x.abs())));
            energy.push(row.iter().map(|&x| x * x).sum::<f32>());
        }
        out.extend(energy);
    }
    out
}

/// The larger of `a` and `b` (`b` where either is NaN), one vector instruction where
/// `f32::max`'s NaN rule takes three.
#[inline(always)]
fn larger(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// What a block's plan reads of its coordinates.
struct Stats {
    /// The pairs `p` with a coordinate `2p` or `2p + 1` that varies within the block.
    pairs: Vec<usize>,
    /// Each coordinate's mean (a constant one: its value), and `c M`.
    centre: Vec<f32>,
    fixed: Vec<f32>,
    /// Each coordinate's largest `|y_tj - c_j|` and mean `(y_tj - c_j)^2`.
    spread: Vec<f32>,
    square: Vec<f32>,
}

/// [`Stats`] of block `y` (`n x d`) against frame `m`, one value at a time: the reference of
/// the vector code's (the same operations in the same order per coordinate; the mean square
/// from the sum of squares).
#[cfg(test)]
fn stats(y: &[f32], d: usize, m: &[f32]) -> Stats {
    let first = &y[..d];
    let n = (y.len() / d) as f32;
    let mut differs = vec![false; d];
    let mut centre = first.to_vec();
    let (mut spread, mut square) = (vec![0.0f32; d], vec![0.0f32; d]);
    for j in 0..d {
        let (mut s, mut q, mut lo, mut hi) = (first[j], first[j] * first[j], first[j], first[j]);
        for yt in y.chunks_exact(d).skip(1) {
            let v = yt[j];
            differs[j] |= v != first[j];
            s += v;
            q += v * v;
            lo = if v < lo { v } else { lo };
            hi = larger(v, hi);
        }
        if differs[j] {
            let c = s / n;
            centre[j] = c;
            (spread[j], square[j]) = settle(c, lo, hi, q, n);
        }
    }
    Stats::new(&differs, centre, spread, square, d, m)
}

/// A varying coordinate's spread and mean square from its mean `c`, its least and largest
/// value and its sum of squares over `n` tokens.
#[inline(always)]
fn settle(c: f32, lo: f32, hi: f32, squares: f32, n: f32) -> (f32, f32) {
    (larger(hi - c, c - lo), larger(squares / n - c * c, 0.0))
}

impl Stats {
    /// The block's statistics from each coordinate's: its varying pairs, and `c M` summed in
    /// coordinate order (a product and a sum each, not fused).
    #[inline(always)]
    fn new(
        differs: &[bool],
        centre: Vec<f32>,
        spread: Vec<f32>,
        square: Vec<f32>,
        d: usize,
        m: &[f32],
    ) -> Self {
        let mut fixed = vec![0.0f32; d];
        for (j, &c) in centre.iter().enumerate().filter(|&(_, &c)| c != 0.0) {
            for (f, &x) in fixed.iter_mut().zip(&m[j * d..][..d]) {
                *f += c * x;
            }
        }
        let pairs = (0..d / 2)
            .filter(|&p| differs[2 * p] || differs[2 * p + 1])
            .collect();
        Stats {
            pairs,
            centre,
            fixed,
            spread,
            square,
        }
    }
}

/// The [`Plan`] of a block of [`Stats`] `stats` against frame `m` (`d x d`) and its
/// [`frame_rows`].
#[inline(always)]
fn plan(stats: Stats, d: usize, m: &[f32], rows: &[f32]) -> Plan {
    let Stats {
        pairs,
        centre,
        fixed,
        spread,
        square,
    } = stats;
    let (row_max, row_energy) = rows.split_at(d);
    let mut fours: Vec<usize> = pairs.iter().map(|&p| p / 2).collect();
    fours.dedup();
    let size = |q: usize| {
        (4 * q..4 * q + 4)
            .map(|j| spread[j] * row_max[j])
            .fold(0.0f32, f32::max)
    };
    let mut ranked = fours.clone();
    ranked.sort_by(|&a, &b| size(b).total_cmp(&size(a)).then(a.cmp(&b)));
    let wide_count = (fours.len() * WIDE_SHARE.0).div_ceil(WIDE_SHARE.1);
    let mut wide_fours = ranked[..wide_count].to_vec();
    wide_fours.sort_unstable();
    let narrow: Vec<usize> = fours
        .iter()
        .copied()
        .filter(|q| wide_fours.binary_search(q).is_err())
        .collect();
    let wide: Vec<usize> = wide_fours
        .iter()
        .flat_map(|&q| [2 * q, 2 * q + 1])
        .filter(|p| pairs.binary_search(p).is_ok())
        .collect();
    let level = level(2 * wide.len());
    let mut step: Vec<f32> = spread.iter().map(|&s| s / BYTE as f32).collect();
    for j in wide.iter().flat_map(|&p| [2 * p, 2 * p + 1]) {
        step[j] = spread[j] / level as f32;
    }
    // The narrow columns' byte scales at these steps, then each narrow step balanced.
    let narrow_rows = || narrow.iter().flat_map(|&q| 4 * q..4 * q + 4);
    let scales = column_scales(narrow_rows(), &step, m, d, BYTE);
    let balance: f32 = scales.iter().map(|&b| b * b).sum();
    for j in narrow_rows() {
        let even = inverse(square[j] * balance, row_energy[j]).sqrt().sqrt();
        step[j] = step[j].max(even);
    }
    Plan {
        fixed,
        centre,
        wide,
        narrow,
        step,
        level,
    }
}

#[cfg(test)]
/// A block's integer form: its [`Plan`], the wide residual pairs `[n, d / 2]` (low half: the
/// even coordinate) and narrow residual fours `[n, d / 4]` (lowest byte first), the wide frame
/// pairs and narrow frame fours `[wide or narrow, d]`, each column's scales and the narrow
/// bytes' offset `-128 sum_j M'_jc`.
pub(super) struct Quantised {
    pub plan: Plan,
    pub ys16: Vec<u32>,
    pub ys8: Vec<u32>,
    pub ms16: Vec<u32>,
    pub ms8: Vec<u32>,
    pub wide_scale: Vec<f32>,
    pub narrow_scale: Vec<f32>,
    pub offset: Vec<i32>,
}

#[cfg(test)]
/// `x` rounded to nearest (ties to even, as the CPU converts) and clamped to `±r`.
fn to_level(x: f32, r: i32) -> i32 {
    (x.round_ties_even() as i32).clamp(-r, r)
}

/// Each column's largest `|step_j M_jc|` over `rows`, over `r`: the column scales.
#[inline(always)]
fn column_scales(
    rows: impl Iterator<Item = usize>,
    step: &[f32],
    m: &[f32],
    d: usize,
    r: i32,
) -> Vec<f32> {
    let mut col_max = vec![0.0f32; d];
    for j in rows {
        for (mx, &x) in col_max.iter_mut().zip(&m[j * d..][..d]) {
            *mx = larger((step[j] * x).abs(), *mx);
        }
    }
    col_max.iter().map(|&x| x / r as f32).collect()
}

#[cfg(test)]
/// [`Quantised`] of one decoded block `y` (`n x d`) against the frame `m` (`d x d`), one value
/// at a time: the reference the vector code of [`product`] reproduces bit for bit.
pub(super) fn quantise(y: &[f32], d: usize, m: &[f32]) -> Quantised {
    let plan = plan(stats(y, d, m), d, m, &frame_rows(m, d));
    let (r, step, centre) = (plan.level, &plan.step, &plan.centre);
    let wide_rows: Vec<usize> = plan.wide.iter().flat_map(|&p| [2 * p, 2 * p + 1]).collect();
    let narrow_rows: Vec<usize> = plan.narrow.iter().flat_map(|&q| 4 * q..4 * q + 4).collect();
    let level_of =
        |j: usize, v: f32, lv: i32| to_level((v - centre[j]) * inverse(1.0, step[j]), lv);
    let (mut ys16, mut ys8) = (Vec::new(), Vec::new());
    for yt in y.chunks_exact(d) {
        for p in 0..d / 2 {
            let l = |j: usize| level_of(j, yt[j], r) as i16 as u16 as u32;
            ys16.push(l(2 * p) | l(2 * p + 1) << 16);
        }
        for q in 0..d / 4 {
            ys8.push((0..4).fold(0u32, |w, k| {
                let j = 4 * q + k;
                w | (((level_of(j, yt[j], BYTE) + 128) as u32) & 0xFF) << (8 * k)
            }));
        }
    }
    let wide_scale = column_scales(wide_rows.iter().copied(), step, m, d, r);
    let narrow_scale = column_scales(narrow_rows.iter().copied(), step, m, d, BYTE);
    let frame = |j: usize, c: usize, scale: &[f32], lv: i32| {
        to_level(step[j] * m[j * d + c] * inverse(1.0, scale[c]), lv)
    };
    let mut ms16 = Vec::new();
    for &p in &plan.wide {
        for c in 0..d {
            let l = |j| frame(j, c, &wide_scale, r) as i16 as u16 as u32;
            ms16.push(l(2 * p) | l(2 * p + 1) << 16);
        }
    }
    let (mut ms8, mut offset) = (Vec::new(), vec![0i32; d]);
    for &q in &plan.narrow {
        for (c, off) in offset.iter_mut().enumerate() {
            let (mut w, mut sum) = (0u32, 0i32);
            for k in 0..4 {
                let l = frame(4 * q + k, c, &narrow_scale, BYTE);
                (w, sum) = (w | ((l as u32) & 0xFF) << (8 * k), sum + l);
            }
            ms8.push(w);
            *off -= 128 * sum;
        }
    }
    Quantised {
        plan,
        ys16,
        ys8,
        ms16,
        ms8,
        wide_scale,
        narrow_scale,
        offset,
    }
}

#[cfg(test)]
/// `out[t] = y_t M` from a block's [`Quantised`] form, one value at a time (the reference).
pub(super) fn product_scalar(q: &Quantised, d: usize, out: &mut [f32]) {
    let (half, quarter) = (d / 2, d / 4);
    let lo16 = |x: u32| x as u16 as i16 as i32;
    let hi16 = |x: u32| (x >> 16) as u16 as i16 as i32;
    let unsigned = |x: u32, k: usize| ((x >> (8 * k)) & 0xFF) as i32;
    let signed = |x: u32, k: usize| (x >> (8 * k)) as u8 as i8 as i32;
    for (t, o) in out.chunks_exact_mut(d).enumerate() {
        for (c, o) in o.iter_mut().enumerate() {
            let mut wide = 0i32;
            for (k, &p) in q.plan.wide.iter().enumerate() {
                let (yp, mp) = (q.ys16[t * half + p], q.ms16[k * d + c]);
                wide += lo16(yp) * lo16(mp) + hi16(yp) * hi16(mp);
            }
            let mut narrow = q.offset[c];
            for (k, &f) in q.plan.narrow.iter().enumerate() {
                let (yq, mq) = (q.ys8[t * quarter + f], q.ms8[k * d + c]);
                narrow += (0..4).map(|b| unsigned(yq, b) * signed(mq, b)).sum::<i32>();
            }
            let partial = q.wide_scale[c].mul_add(wide as f32, q.plan.fixed[c]);
            *o = q.narrow_scale[c].mul_add(narrow as f32, partial);
        }
    }
}

/// `out[t] = y_t M` for every token of a decoded block (`y` and `out` are `n x d`, `n >= 1`,
/// `M` `d x d` with its [`frame_rows`] `rows`), as the module describes.
///
/// Panics unless [`available`] and [`fits`]`(d)` hold and the lengths match: the caller
/// checks the first two, the shapes are the kernel's own.
pub(super) fn product(y: &[f32], d: usize, m: &[f32], rows: &[f32], out: &mut [f32]) {
    assert!(available() && fits(d));
    assert!(y.len().is_multiple_of(d) && out.len() == y.len() && m.len() == d * d);
    assert!(rows.len() == 2 * d);
    #[cfg(target_arch = "x86_64")]
    BUFFERS.with_borrow_mut(|buffers| {
        #[allow(unsafe_code)]
        // SAFETY: `available()` found AVX512-VNNI, -BW, -VL and -F; the shapes are asserted
        // above.
        unsafe {
            x86::product(y, d, m, rows, buffers, out)
        }
    });
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod x86 {
    use super::{column_scales, plan, settle, Stats, BYTE};
    use std::arch::x86_64::*;

    /// Tokens per tile: 8 tokens by 32 columns, one 512-bit int32 accumulator per 16.
    const TILE: usize = 8;

    /// [`super::product`], with `buffers` to hold the block's integers (grown as needed, never
    /// cleared: every value read is written first).
    ///
    /// # Safety
    /// The CPU has AVX512-VNNI, -BW, -VL and -F; `d` is a multiple of 16; `y` and `out` hold
    /// `n x d`, `m` `d x d`, `rows` `2 d`.
    #[target_feature(enable = "avx512vnni,avx512bw,avx512vl,avx512f,avx2,fma")]
    pub(super) unsafe fn product(
        y: &[f32],
        d: usize,
        m: &[f32],
        rows: &[f32],
        buffers: &mut [Vec<u32>; 4],
        out: &mut [f32],
    ) {
        // SAFETY: the caller's features and shapes.
        let plan = plan(unsafe { stats(y, d, m) }, d, m, rows);
        let (half, quarter, n) = (d / 2, d / 4, y.len() / d);
        assert!(plan.wide.iter().all(|&p| p < half) && plan.narrow.iter().all(|&q| q < quarter));
        let [ys16, ys8, ms16, ms8] = buffers;
        let r = plan.level;
        let (lo_r, hi_r) = (_mm512_set1_epi32(-r), _mm512_set1_epi32(r));
        let (lo_b, hi_b) = (_mm512_set1_epi32(-BYTE), _mm512_set1_epi32(BYTE));
        let clamp =
            |i: __m512i, lo: __m512i, hi: __m512i| _mm512_min_epi32(_mm512_max_epi32(i, lo), hi);
        // x * inv rounded to nearest even (the MXCSR default) as int32, unclamped.
        let round = |x: __m512, inv: __m512| _mm512_cvtps_epi32(_mm512_mul_ps(x, inv));
        // 1 / x where x > 0, else 0 (as the reference's `inverse`).
        let inverse = |x: __m512| {
            let pos = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_setzero_ps());
            _mm512_maskz_div_ps(pos, _mm512_set1_ps(1.0), x)
        };
        let mut inv = vec![0.0f32; d];
        // SAFETY (every load and store below): offsets within the asserted shapes.
        for c in (0..d).step_by(16) {
            unsafe {
                let s = _mm512_loadu_ps(plan.step.as_ptr().add(c));
                _mm512_storeu_ps(inv.as_mut_ptr().add(c), inverse(s));
            }
        }
        // Every coordinate's residual levels both ways: the tiles read only their own.
        if ys16.len() < n * half {
            ys16.resize(n * half, 0);
        }
        if ys8.len() < n * quarter {
            ys8.resize(n * quarter, 0);
        }
        let (low16, byte_bias) = (_mm512_set1_epi32(0xFFFF), _mm512_set1_epi32(128));
        for ((yt, o16), o8) in y
            .chunks_exact(d)
            .zip(ys16.chunks_exact_mut(half))
            .zip(ys8.chunks_exact_mut(quarter))
        {
            for c in (0..d).step_by(16) {
                unsafe {
                    let v = _mm512_sub_ps(
                        _mm512_loadu_ps(yt.as_ptr().add(c)),
                        _mm512_loadu_ps(plan.centre.as_ptr().add(c)),
                    );
                    let i = round(v, _mm512_loadu_ps(inv.as_ptr().add(c)));
                    // 16 int16 in coordinate order are 8 pairs, the even coordinate low.
                    let w = _mm512_cvtepi32_epi16(clamp(i, lo_r, hi_r));
                    _mm256_storeu_si256(o16.as_mut_ptr().add(c / 2).cast(), w);
                    let b = _mm512_cvtepi32_epi8(_mm512_add_epi32(clamp(i, lo_b, hi_b), byte_bias));
                    _mm_storeu_si128(o8.as_mut_ptr().add(c / 4).cast(), b);
                }
            }
        }
        let wide_rows = || plan.wide.iter().flat_map(|&p| [2 * p, 2 * p + 1]);
        let narrow_rows = || plan.narrow.iter().flat_map(|&q| 4 * q..4 * q + 4);
        let wide_scale = column_scales(wide_rows(), &plan.step, m, d, r);
        let narrow_scale = column_scales(narrow_rows(), &plan.step, m, d, BYTE);
        let wide_inv: Vec<f32> = wide_scale.iter().map(|&s| super::inverse(1.0, s)).collect();
        let narrow_inv: Vec<f32> = narrow_scale
            .iter()
            .map(|&s| super::inverse(1.0, s))
            .collect();
        // The frame's levels at column `c..c + 16` of row `j`: (step * m) * inverse scale.
        let frame = |j: usize, c: usize, cinv: &[f32], lo: __m512i, hi: __m512i| unsafe {
            let a = _mm512_set1_ps(plan.step[j]);
            let v = _mm512_mul_ps(a, _mm512_loadu_ps(m.as_ptr().add(j * d + c)));
            clamp(round(v, _mm512_loadu_ps(cinv.as_ptr().add(c))), lo, hi)
        };
        if ms16.len() < plan.wide.len() * d {
            ms16.resize(plan.wide.len() * d, 0);
        }
        for (&p, o) in plan.wide.iter().zip(ms16.chunks_exact_mut(d)) {
            for c in (0..d).step_by(16) {
                let lo = _mm512_and_si512(frame(2 * p, c, &wide_inv, lo_r, hi_r), low16);
                let hi = _mm512_slli_epi32::<16>(frame(2 * p + 1, c, &wide_inv, lo_r, hi_r));
                unsafe {
                    _mm512_storeu_si512(o.as_mut_ptr().add(c).cast(), _mm512_or_si512(lo, hi))
                };
            }
        }
        if ms8.len() < plan.narrow.len() * d {
            ms8.resize(plan.narrow.len() * d, 0);
        }
        let mut level_sum = vec![0i32; d];
        let low_byte = _mm512_set1_epi32(0xFF);
        for (&q, o) in plan.narrow.iter().zip(ms8.chunks_exact_mut(d)) {
            for c in (0..d).step_by(16) {
                let (mut word, mut sum) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                for k in 0..4 {
                    let l = frame(4 * q + k, c, &narrow_inv, lo_b, hi_b);
                    sum = _mm512_add_epi32(sum, l);
                    let shift = _mm512_set1_epi32(8 * k as i32);
                    word = _mm512_or_si512(
                        word,
                        _mm512_sllv_epi32(_mm512_and_si512(l, low_byte), shift),
                    );
                }
                unsafe {
                    _mm512_storeu_si512(o.as_mut_ptr().add(c).cast(), word);
                    let s = _mm512_loadu_si512(level_sum.as_ptr().add(c).cast());
                    _mm512_storeu_si512(
                        level_sum.as_mut_ptr().add(c).cast(),
                        _mm512_add_epi32(s, sum),
                    );
                }
            }
        }
        let offset: Vec<i32> = level_sum.iter().map(|&s| -128 * s).collect();
        let block = Block {
            plan: &plan,
            ys16,
            ys8,
            ms16,
            ms8,
            wide_scale: &wide_scale,
            narrow_scale: &narrow_scale,
            offset: &offset,
            d,
        };
        let mut t = 0;
        while t < n {
            let rows = (n - t).min(TILE);
            let o = &mut out[t * d..][..rows * d];
            // Tiles 32 columns wide where they fit: each broadcast feeds two products.
            let mut col = 0;
            while col < d {
                let width = if d - col >= 32 { 32 } else { 16 };
                // SAFETY: the caller's features; `col + width <= d`, `rows` tokens from `t`.
                unsafe {
                    match (rows, width) {
                        (TILE, 32) => tile::<TILE, 2>(&block, t, col, &mut o[col..]),
                        (TILE, _) => tile::<TILE, 1>(&block, t, col, &mut o[col..]),
                        _ => {
                            for (i, o) in o.chunks_exact_mut(d).enumerate() {
                                match width {
                                    32 => tile::<1, 2>(&block, t + i, col, &mut o[col..]),
                                    _ => tile::<1, 1>(&block, t + i, col, &mut o[col..]),
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

    /// [`super::stats`] in 16 lanes: each coordinate's sums in token order, as the reference.
    #[inline(always)]
    unsafe fn stats(y: &[f32], d: usize, m: &[f32]) -> Stats {
        assert!(d.is_multiple_of(16) && y.len() >= d && m.len() == d * d);
        let n = (y.len() / d) as f32;
        let mut differs = vec![false; d];
        let mut centre = y[..d].to_vec();
        let (mut spread, mut square) = (vec![0.0f32; d], vec![0.0f32; d]);
        let (mut c16, mut hi16, mut lo16, mut q16) =
            ([0.0f32; 16], [0.0f32; 16], [0.0f32; 16], [0.0f32; 16]);
        for c0 in (0..d).step_by(16) {
            // SAFETY (every load): `c0 + 16 <= d` within each token of `y`.
            let first = unsafe { _mm512_loadu_ps(y.as_ptr().add(c0)) };
            let (mut s, mut q) = (first, _mm512_mul_ps(first, first));
            let (mut lo, mut hi, mut f) = (first, first, 0u16);
            for yt in y.chunks_exact(d).skip(1) {
                let v = unsafe { _mm512_loadu_ps(yt.as_ptr().add(c0)) };
                f |= _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(v, first);
                s = _mm512_add_ps(s, v);
                q = _mm512_add_ps(q, _mm512_mul_ps(v, v));
                // As the reference's `if v < lo { v } else { lo }` and `larger(v, hi)`.
                lo = _mm512_mask_mov_ps(lo, _mm512_cmp_ps_mask::<_CMP_LT_OQ>(v, lo), v);
                hi = _mm512_mask_mov_ps(hi, _mm512_cmp_ps_mask::<_CMP_GT_OQ>(v, hi), v);
            }
            let c = _mm512_div_ps(s, _mm512_set1_ps(n));
            unsafe {
                _mm512_storeu_ps(c16.as_mut_ptr(), c);
                _mm512_storeu_ps(hi16.as_mut_ptr(), hi);
                _mm512_storeu_ps(lo16.as_mut_ptr(), lo);
                _mm512_storeu_ps(q16.as_mut_ptr(), q);
            }
            for k in (0..16).filter(|&k| f >> k & 1 != 0) {
                let (j, c) = (c0 + k, c16[k]);
                (differs[j], centre[j]) = (true, c);
                (spread[j], square[j]) = settle(c, lo16[k], hi16[k], q16[k], n);
            }
        }
        Stats::new(&differs, centre, spread, square, d, m)
    }

    /// `acc[r][w] = op(acc[r][w], ys[r * stride + i_k] broadcast, ms[k * d + col + 16 w..])`
    /// for each `(k, i_k)` of `items` in turn: one group's products (`op`: `vpdpwssd` or
    /// `vpdpbusd`), each frame row loaded once for the `R` tokens.
    ///
    /// # Safety
    /// Every `i_k` is below `stride`; `ys` holds `R` rows of `stride` and `ms` `items` rows of
    /// `d` from column `col + 16 W` on (`tile` asserts both).
    #[inline(always)]
    unsafe fn accumulate<const R: usize, const W: usize>(
        acc: &mut [[__m512i; W]; R],
        (items, ms, ys, stride): (&[usize], &[u32], &[u32], usize),
        col: usize,
        d: usize,
        op: impl Fn(__m512i, __m512i, __m512i) -> __m512i,
    ) {
        for (k, &i) in items.iter().enumerate() {
            let mrow: [__m512i; W] = std::array::from_fn(|w| unsafe {
                _mm512_loadu_si512(ms.as_ptr().add(k * d + col + 16 * w).cast())
            });
            for (r, a) in acc.iter_mut().enumerate() {
                let y = _mm512_set1_epi32(unsafe { *ys.as_ptr().add(r * stride + i) } as i32);
                for (a, &m) in a.iter_mut().zip(&mrow) {
                    *a = op(*a, y, m);
                }
            }
        }
    }

    /// A block's integers and scales, as the tiles read them.
    struct Block<'a> {
        plan: &'a super::Plan,
        ys16: &'a [u32],
        ys8: &'a [u32],
        ms16: &'a [u32],
        ms8: &'a [u32],
        wide_scale: &'a [f32],
        narrow_scale: &'a [f32],
        offset: &'a [i32],
        d: usize,
    }

    /// `out[r * d..][..16 W]` for `R` tokens from `t` and the columns from `col`: the centre's
    /// product plus the wide sum times its scale, plus the narrow sum (from its offset) times
    /// its scale.
    ///
    /// # Safety
    /// As [`product`]; `t + R` tokens and `col + 16 W` columns within the block.
    #[target_feature(enable = "avx512vnni,avx512bw,avx512vl,avx512f,avx2,fma")]
    unsafe fn tile<const R: usize, const W: usize>(
        b: &Block<'_>,
        t: usize,
        col: usize,
        out: &mut [f32],
    ) {
        let (d, width) = (b.d, 16 * W);
        let (half, quarter) = (d / 2, d / 4);
        assert!(col + width <= d && out.len() >= (R - 1) * d + width);
        assert!(b.ys16.len() >= (t + R) * half && b.ys8.len() >= (t + R) * quarter);
        assert!(b.ms16.len() >= b.plan.wide.len() * d && b.ms8.len() >= b.plan.narrow.len() * d);
        let (ys16, ys8) = (&b.ys16[t * half..], &b.ys8[t * quarter..]);
        // SAFETY (every load and store): the bounds asserted above; wide pairs are below
        // `half` and narrow fours below `quarter` (asserted by `product`).
        let mut acc = [[_mm512_setzero_si512(); W]; R];
        let wide = (b.plan.wide.as_slice(), b.ms16, ys16, half);
        unsafe {
            accumulate(&mut acc, wide, col, d, |a, y, m| {
                _mm512_dpwssd_epi32(a, m, y)
            })
        };
        for w in 0..W {
            let c = col + 16 * w;
            let (f, s) = unsafe {
                (
                    _mm512_loadu_ps(b.plan.fixed.as_ptr().add(c)),
                    _mm512_loadu_ps(b.wide_scale.as_ptr().add(c)),
                )
            };
            for (r, a) in acc.iter().enumerate() {
                let v = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(a[w]), f);
                unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(r * d + 16 * w), v) };
            }
        }
        let start: [__m512i; W] = std::array::from_fn(|w| unsafe {
            _mm512_loadu_si512(b.offset.as_ptr().add(col + 16 * w).cast())
        });
        let mut acc = [start; R];
        let narrow = (b.plan.narrow.as_slice(), b.ms8, ys8, quarter);
        unsafe {
            accumulate(&mut acc, narrow, col, d, |a, y, m| {
                _mm512_dpbusd_epi32(a, y, m)
            })
        };
        for w in 0..W {
            let s = unsafe { _mm512_loadu_ps(b.narrow_scale.as_ptr().add(col + 16 * w)) };
            for (r, a) in acc.iter().enumerate() {
                unsafe {
                    let o = out.as_mut_ptr().add(r * d + 16 * w);
                    _mm512_storeu_ps(
                        o,
                        _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(a[w]), _mm512_loadu_ps(o)),
                    );
                }
            }
        }
    }
}
