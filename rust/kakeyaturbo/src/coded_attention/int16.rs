//! The key kernel's frame product `y_t M` in 16-bit integers with exact int32 sums, on CPUs
//! with AVX512-VNNI (`vpdpwssd`: two 16-bit products per int32 lane, twice the float32 FMA
//! rate of the same CPU, the rate of the bfloat16 product) or AVX2 (`vpmaddwd` and `vpaddd`:
//! the same int32 sums, so the same bits; about 1.55x the float32 FMA peak on a Zen 3, where
//! a 4k layer's key logits across heads took 0.7-0.87x the float32 path's time and an 8k
//! decode step 0.90x: `docs/speed.md`, 44th session; on a Zen 1 no faster, 27th session).
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
//!
//! A block in its own coordinates (no basis) decodes each coordinate from a small table of
//! values, so its extremes are known before any token is read. [`Grid`] takes `c_j` as their
//! midpoint and `a_j` as their half-range over `R`, and maps the tables to levels, so a block
//! decodes straight to its integer levels ([`product_levels`]): no pass over its values for
//! the centre, the spreads or the levels (`docs/speed.md`, 45th session). The bound is the
//! same with the tables' spread, which 256-token blocks mostly fill. A coordinate whose table
//! holds one value varies only at its outliers: they are added after the tiles in float32
//! (one frame row each), so its pair is not multiplied for every token (46th session).

use super::bf16::{centre_product, split_pairs};
use std::cell::RefCell;
use std::mem::MaybeUninit;

/// The largest `R`: 13-bit integers, beyond which the rounding is far below the float32
/// sums' own.
const MAX_LEVEL: i32 = 4095;

thread_local! {
    /// A block's integer residuals `[n, d / 2]` and its scaled frame `[active pairs, d]`, as
    /// pairs of 16-bit integers, reused by every block this thread multiplies.
    static BUFFERS: RefCell<(Vec<u32>, Vec<u32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// The instructions that run [`product`]'s integer tiles on this CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Isa {
    /// AVX512-VNNI's `vpdpwssd`: a pair's two products and their sum into an int32 lane, 16
    /// lanes an instruction.
    Vnni512,
    /// AVX2's `vpmaddwd` (the same pair sums, 8 lanes) and a `vpaddd` beside it: on a Zen 3
    /// about 1.55x the float32 FMA peak (`benches/probe_fma_rate.rs`), half the frame bytes
    /// read.
    Avx2,
}

/// Whether this CPU has the instructions of `isa` (and AVX2 and FMA, which the block's
/// integer form is made with either way).
pub(super) fn runs(isa: Isa) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        avx2 && match isa {
            Isa::Vnni512 => {
                is_x86_feature_detected!("avx512vnni")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512f")
            }
            Isa::Avx2 => true,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        false
    }
}

/// The [`Isa`] that runs [`product`] on this CPU, if any: the widest it has.
pub(super) fn isa() -> Option<Isa> {
    [Isa::Vnni512, Isa::Avx2].into_iter().find(|&i| runs(i))
}

/// Whether this CPU runs [`product`].
pub(super) fn available() -> bool {
    isa().is_some()
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
    // Each coordinate's largest residual in the block.
    let mut spread = vec![0.0f32; d];
    for yt in y.chunks_exact(d) {
        for ((s, &v), &c) in spread.iter_mut().zip(yt).zip(&centre) {
            *s = s.max((v - c).abs());
        }
    }
    quantise_about(y, d, m, (active, &centre, fixed, &spread))
}

#[cfg(test)]
/// [`Quantised`] of `y` against `m` about `centre`, in steps of `spread / R` (`R` from the
/// active pairs' count), one value at a time: [`quantise`]'s and [`product_levels`]'
/// reference, with their centres and spreads.
pub(super) fn quantise_about(
    y: &[f32],
    d: usize,
    m: &[f32],
    (active, centre, fixed, spread): (Vec<usize>, &[f32], Vec<f32>, &[f32]),
) -> Quantised {
    let r = level(2 * active.len());
    let rf = r as f32;
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
/// `M` `d x d`), as the module describes: the same bits with either [`Isa`].
///
/// Panics unless [`available`] and [`fits`]`(d)` hold and the lengths match: the caller
/// checks the first two, the shapes are the kernel's own.
pub(super) fn product(y: &[f32], d: usize, m: &[f32], out: &mut [f32]) {
    let isa = isa().expect("int16 products need AVX2 and FMA");
    product_with(isa, y, d, m, out);
}

/// [`product`] with the tiles of `isa` (the tests run each one the CPU has).
///
/// Panics unless [`runs`]`(isa)` and [`fits`]`(d)` hold and the lengths match.
pub(super) fn product_with(isa: Isa, y: &[f32], d: usize, m: &[f32], out: &mut [f32]) {
    assert!(runs(isa) && fits(d));
    assert!(y.len().is_multiple_of(d) && out.len() == y.len() && m.len() == d * d);
    #[cfg(target_arch = "x86_64")]
    BUFFERS.with_borrow_mut(|(ys, ms)| {
        #[allow(unsafe_code)]
        // SAFETY: `runs(isa)` found AVX2 and FMA, and AVX512-VNNI, -BW, -VL and -F for
        // `Isa::Vnni512`; the shapes are asserted above. The tiles write only initialised
        // values, so `out` may be seen as possibly uninitialised memory.
        unsafe {
            let block = x86::quantise(y, d, m, ys, ms);
            let out = &mut *(out as *mut [f32] as *mut [MaybeUninit<f32>]);
            x86::tiles(isa, &block, ys, ms, d, out);
        }
    });
}

/// How a block's coordinates become integer levels as they are decoded from its codes,
/// where the codes' tables bound every value before any token is read: about each
/// coordinate's midrange, in steps of its half-range over `R`. So a level is a table lookup,
/// and the data passes of [`product`] (the centre, the spreads, the levels) go.
pub(super) struct Grid {
    centre: Vec<f32>,
    spread: Vec<f32>,
    /// `R / spread_j` (0 where the coordinate cannot vary).
    inv: Vec<f32>,
    /// The pairs with a coordinate that can vary.
    active: Vec<usize>,
    /// `(token, coordinate, value - centre)` of the outliers of coordinates whose table holds
    /// one value (level 0 for every token): added after the product.
    sparse: Vec<(usize, usize, f32)>,
    r: i32,
}

impl Grid {
    /// The grid of coordinates whose tables' values lie in `[table_lo_j, table_hi_j]`, with
    /// `outliers` (position in the block's `n x d` values, value) besides (all finite, `d`
    /// even).
    pub(super) fn new(table_lo: &[f32], table_hi: &[f32], outliers: &[(usize, f32)]) -> Grid {
        let d = table_lo.len();
        let (mut lo, mut hi) = (table_lo.to_vec(), table_hi.to_vec());
        let mut sparse = Vec::new();
        for &(pos, v) in outliers {
            let j = pos % d;
            if table_lo[j] == table_hi[j] {
                sparse.push((pos / d, j, v));
            } else {
                (lo[j], hi[j]) = (lo[j].min(v), hi[j].max(v));
            }
        }
        let centre: Vec<f32> = lo
            .iter()
            .zip(&hi)
            .map(|(&a, &b)| if a == b { a } else { 0.5 * a + 0.5 * b })
            .collect();
        let spread: Vec<f32> = (lo.iter().zip(&hi).zip(&centre))
            .map(|((&a, &b), &c)| (b - c).max(c - a))
            .collect();
        let active: Vec<usize> = (0..lo.len() / 2)
            .filter(|&p| spread[2 * p] > 0.0 || spread[2 * p + 1] > 0.0)
            .collect();
        let r = level(2 * active.len());
        let rf = r as f32;
        let inv = spread
            .iter()
            .map(|&s| if s > 0.0 { rf / s } else { 0.0 })
            .collect();
        for (_, j, v) in &mut sparse {
            *v -= centre[*j];
        }
        Grid {
            centre,
            spread,
            inv,
            active,
            sparse,
            r,
        }
    }

    /// Adds the outliers the levels leave out (`out` holds `y_t M` of `n x d` from levels):
    /// their differences to the centre times their frame rows, fused, in order. Called
    /// outside [`x86::correct`] it is the tests' reference: the same fused steps, one value
    /// at a time.
    #[inline(always)]
    pub(super) fn correct(&self, d: usize, m: &[f32], out: &mut [f32]) {
        for &(t, j, v) in &self.sparse {
            super::axpy::<true>(v, &m[j * d..][..d], &mut out[t * d..][..d]);
        }
    }

    #[cfg(test)]
    /// How many outliers the levels leave out.
    pub(super) fn sparse(&self) -> usize {
        self.sparse.len()
    }

    /// Coordinate `j`'s `values` as their levels, integers within `+-R` (as floats), in
    /// place.
    pub(super) fn level(&self, j: usize, values: &mut [f32]) {
        let (c, inv, r) = (self.centre[j], self.inv[j], self.r as f32);
        for v in values {
            *v = round_even((*v - c) * inv).clamp(-r, r);
        }
    }

    #[cfg(test)]
    /// [`quantise_about`]'s arguments for this grid and frame.
    pub(super) fn reference(&self, y: &[f32], d: usize, m: &[f32]) -> Quantised {
        let fixed = centre_product(&self.centre, d, m);
        let about = (
            self.active.clone(),
            &self.centre[..],
            fixed,
            &self.spread[..],
        );
        quantise_about(y, d, m, about)
    }
}

/// `x` rounded to the nearest integer, ties to even, as the CPU converts (and
/// `f32::round_ties_even`, a libm call here), for `|x| < 2^22`; larger ones are clamped to
/// `R` anyway.
#[inline(always)]
fn round_even(x: f32) -> f32 {
    // Adding 1.5 * 2^23 leaves no fraction bits: the sum rounds to nearest even.
    const MAGIC: f32 = 12_582_912.0;
    if x.abs() < 4_194_304.0 {
        (x + MAGIC) - MAGIC
    } else {
        x
    }
}

/// `out[t] = y_t M` for a block decoded as `grid`'s levels (`levels` is `n x d`, each
/// [`Grid::level`] of the block's value): [`product`]'s tiles and bits for the levels it
/// would have made with this grid's centres and spreads, then the outliers the levels leave
/// out. `out` is cleared and holds the `n x d` products after: the tiles write every value,
/// so its memory is not zeroed first (that was 2-3% of an 8k step's samples, 45th session).
///
/// Panics unless [`available`] and [`fits`]`(d)` hold and the lengths match.
pub(super) fn product_levels(levels: &[f32], grid: &Grid, d: usize, m: &[f32], out: &mut Vec<f32>) {
    let isa = isa().expect("int16 products need AVX2 and FMA");
    assert!(fits(d) && grid.centre.len() == d);
    assert!(levels.len().is_multiple_of(d) && m.len() == d * d);
    let len = levels.len();
    out.clear();
    out.reserve(len);
    #[cfg(target_arch = "x86_64")]
    BUFFERS.with_borrow_mut(|(ys, ms)| {
        #[allow(unsafe_code)]
        // SAFETY: `isa()` found AVX2 and FMA (and the rest of `isa`'s); shapes asserted above.
        // The tiles write each of `out`'s first `len` values (whole tiles, then tokens alone,
        // over every column), so they are initialised when the length is set.
        unsafe {
            x86::pack_levels(levels, d, ys);
            let rf = grid.r as f32;
            let step: Vec<f32> = grid.spread.iter().map(|&s| s / rf).collect();
            let block = x86::Block {
                col_scale: x86::scaled_frame(&grid.active, &step, m, d, grid.r, ms),
                active: grid.active.clone(),
                fixed: x86::centre_product(&grid.centre, d, m),
            };
            x86::tiles(isa, &block, ys, ms, d, &mut out.spare_capacity_mut()[..len]);
            out.set_len(len);
            x86::correct(grid, d, m, out);
        }
    });
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod x86 {
    use super::{level, split_pairs, Grid, Isa};
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    /// A block's integer form beside the pairs in the thread's buffers: the active pairs, the
    /// centre's product `c M` and each column's scale `b_c`.
    pub(super) struct Block {
        pub active: Vec<usize>,
        pub fixed: Vec<f32>,
        pub col_scale: Vec<f32>,
    }

    /// The block's integer pairs into `ys` (`n x d / 2`) and `ms` (`active x d`), grown as
    /// needed, never cleared (every value the tiles read is written first), 8 lanes at a
    /// time: the reference's [`super::quantise`] bit for bit, for either tile kind (on a
    /// Zen 4 512-bit vectors run as two halves anyway, and this is a few percent of the
    /// product).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `d` is a multiple of 16; `y` holds `n x d`, `m` `d x d`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn quantise(
        y: &[f32],
        d: usize,
        m: &[f32],
        ys: &mut Vec<u32>,
        ms: &mut Vec<u32>,
    ) -> Block {
        let (active, centre, fixed) = split_pairs(y, d, m);
        let (half, n) = (d / 2, y.len() / d);
        assert!(active.iter().all(|&p| p < half) && m.len() == d * d && d.is_multiple_of(8));
        let r = level(2 * active.len());
        let st = Steps::new(r);
        // SAFETY (every load and store below): offsets within the asserted shapes.
        let load = |v: &[f32], c: usize| unsafe { _mm256_loadu_ps(v.as_ptr().add(c)) };
        // A token's residuals `y_t - c` at columns `c..c + 8`.
        let residual = |yt: &[f32], c: usize| _mm256_sub_ps(load(yt, c), load(&centre, c));
        let mut spread = vec![0.0f32; d];
        for yt in y.chunks_exact(d) {
            for c in (0..d).step_by(8) {
                let s = _mm256_max_ps(load(&spread, c), abs(residual(yt, c)));
                unsafe { _mm256_storeu_ps(spread.as_mut_ptr().add(c), s) };
            }
        }
        let (mut step, mut inv) = (vec![0.0f32; d], vec![0.0f32; d]);
        for c in (0..d).step_by(8) {
            let s = load(&spread, c);
            unsafe {
                _mm256_storeu_ps(step.as_mut_ptr().add(c), _mm256_div_ps(s, st.rf));
                _mm256_storeu_ps(inv.as_mut_ptr().add(c), st.inverse(s));
            }
        }
        if ys.len() < n * half {
            ys.resize(n * half, 0);
        }
        for (yt, o) in y.chunks_exact(d).zip(ys.chunks_exact_mut(half)) {
            for c in (0..d).step_by(8) {
                let q = st.levels(residual(yt, c), load(&inv, c));
                // 8 int32 within +-4095 as 8 int16 in order (the pack saturates nothing).
                let q = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
                unsafe { _mm_storeu_si128(o.as_mut_ptr().add(c / 2).cast(), q) };
            }
        }
        let col_scale = scaled_frame(&active, &step, m, d, r, ms);
        Block {
            active,
            fixed,
            col_scale,
        }
    }

    /// [`Grid::correct`] with fused multiply-adds in 8-lane AVX2.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn correct(grid: &Grid, d: usize, m: &[f32], out: &mut [f32]) {
        grid.correct(d, m, out);
    }

    /// [`super::centre_product`] in 8-lane AVX2.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn centre_product(centre: &[f32], d: usize, m: &[f32]) -> Vec<f32> {
        super::centre_product(centre, d, m)
    }

    /// A block's integer steps at level `r`, 8 lanes at a time.
    #[derive(Clone, Copy)]
    struct Steps {
        rf: __m256,
        lo: __m256i,
        hi: __m256i,
    }

    impl Steps {
        /// # Safety
        /// The CPU has AVX2 (inlined into the `avx2,fma` functions here).
        #[inline(always)]
        unsafe fn new(r: i32) -> Self {
            Self {
                rf: _mm256_set1_ps(r as f32),
                lo: _mm256_set1_epi32(-r),
                hi: _mm256_set1_epi32(r),
            }
        }

        /// `x * inv` rounded to nearest even (the MXCSR default), clamped to `+-r`, as int32.
        ///
        /// # Safety
        /// As [`Steps::new`].
        #[inline(always)]
        unsafe fn levels(self, x: __m256, inv: __m256) -> __m256i {
            let i = _mm256_cvtps_epi32(_mm256_mul_ps(x, inv));
            _mm256_min_epi32(_mm256_max_epi32(i, self.lo), self.hi)
        }

        /// `r / x` where `x > 0`, else 0 (as the scalar reference).
        ///
        /// # Safety
        /// As [`Steps::new`].
        #[inline(always)]
        unsafe fn inverse(self, x: __m256) -> __m256 {
            let pos = _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_setzero_ps());
            _mm256_and_ps(_mm256_div_ps(self.rf, x), pos)
        }
    }

    /// `|x|` in 8 lanes.
    ///
    /// # Safety
    /// As [`Steps::new`].
    #[inline(always)]
    unsafe fn abs(x: __m256) -> __m256 {
        _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX)))
    }

    /// Levels (`n x d` integers within `+-4095`, as floats) as pairs into `ys` (`n x d / 2`),
    /// grown as needed.
    ///
    /// # Safety
    /// The CPU has AVX2; `d` is a multiple of 8.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn pack_levels(levels: &[f32], d: usize, ys: &mut Vec<u32>) {
        assert!(d.is_multiple_of(8) && levels.len().is_multiple_of(d));
        let half = d / 2;
        if ys.len() < levels.len() / 2 {
            ys.resize(levels.len() / 2, 0);
        }
        for (yt, o) in levels.chunks_exact(d).zip(ys.chunks_exact_mut(half)) {
            for c in (0..d).step_by(8) {
                // SAFETY: `c + 8 <= d` values of `yt`, `c / 2 + 4 <= half` of `o`.
                unsafe {
                    let q = _mm256_cvtps_epi32(_mm256_loadu_ps(yt.as_ptr().add(c)));
                    let lo = _mm256_castsi256_si128(q);
                    let q = _mm_packs_epi32(lo, _mm256_extracti128_si256(q, 1));
                    _mm_storeu_si128(o.as_mut_ptr().add(c / 2).cast(), q);
                }
            }
        }
    }

    /// The frame's active rows scaled by their `step`s, each column over its largest entry,
    /// as level pairs into `ms` (`active x d`, grown as needed); returns each column's scale.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `d` is a multiple of 8; `m` holds `d x d`, `step` `d`, and
    /// every active pair is below `d / 2`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scaled_frame(
        active: &[usize],
        step: &[f32],
        m: &[f32],
        d: usize,
        r: i32,
        ms: &mut Vec<u32>,
    ) -> Vec<f32> {
        assert!(active.iter().all(|&p| p < d / 2) && m.len() == d * d && step.len() == d);
        let st = Steps::new(r);
        // SAFETY (every load and store below): offsets within the asserted shapes.
        let load = |v: &[f32], c: usize| unsafe { _mm256_loadu_ps(v.as_ptr().add(c)) };
        let mut col_max = vec![0.0f32; d];
        for &p in active {
            for j in [2 * p, 2 * p + 1] {
                let a = _mm256_set1_ps(step[j]);
                for c in (0..d).step_by(8) {
                    let v = _mm256_mul_ps(a, load(m, j * d + c));
                    let x = _mm256_max_ps(load(&col_max, c), abs(v));
                    unsafe { _mm256_storeu_ps(col_max.as_mut_ptr().add(c), x) };
                }
            }
        }
        let (mut col_scale, mut col_inv) = (vec![0.0f32; d], vec![0.0f32; d]);
        for c in (0..d).step_by(8) {
            let x = load(&col_max, c);
            unsafe {
                _mm256_storeu_ps(col_scale.as_mut_ptr().add(c), _mm256_div_ps(x, st.rf));
                _mm256_storeu_ps(col_inv.as_mut_ptr().add(c), st.inverse(x));
            }
        }
        if ms.len() < active.len() * d {
            ms.resize(active.len() * d, 0);
        }
        let low = _mm256_set1_epi32(0xFFFF);
        for (&p, o) in active.iter().zip(ms.chunks_exact_mut(d)) {
            let (j0, j1) = (2 * p, 2 * p + 1);
            let (a0, a1) = (_mm256_set1_ps(step[j0]), _mm256_set1_ps(step[j1]));
            for c in (0..d).step_by(8) {
                let ci = load(&col_inv, c);
                // (step * m) * col_inv, in the reference's order; the pair as lo | hi << 16.
                let lo = st.levels(_mm256_mul_ps(a0, load(m, j0 * d + c)), ci);
                let hi = st.levels(_mm256_mul_ps(a1, load(m, j1 * d + c)), ci);
                let pair = _mm256_or_si256(_mm256_and_si256(lo, low), _mm256_slli_epi32(hi, 16));
                unsafe { _mm256_storeu_si256(o.as_mut_ptr().add(c).cast(), pair) };
            }
        }
        col_scale
    }

    /// `width` output columns from `col` on: their centre product, their scales and the
    /// scaled frame's pairs from these columns on (`ms[k * d..][..width]` is active pair `k`'s).
    struct Columns<'a> {
        fixed: &'a [f32],
        scale: &'a [f32],
        ms: &'a [u32],
        d: usize,
    }

    /// Tokens per AVX-512 tile: 8 tokens by 32 columns (16 where only 16 are left), one
    /// 512-bit int32 accumulator per token and 16 columns: 16 of AVX-512's 32 registers.
    const TILE_VNNI: usize = 8;

    /// Tokens per AVX2 tile: 6 tokens by 16 columns, two 256-bit int32 accumulators per token
    /// beside the frame's two vectors, the broadcast and a product, in AVX2's 16 registers
    /// (measured on a Zen 3: 3 and 4 tokens, and 2 or 3 by 32 columns, ran slower).
    const TILE_AVX2: usize = 6;

    /// The product's sums from a quantised block with `isa`'s tiles: whole tiles of its
    /// tokens, then the rest one token each, by its widest columns where they fit and 16
    /// where not (`d` a multiple of 16).
    ///
    /// # Safety
    /// The CPU has `isa`'s instructions ([`super::runs`]); `ys`, `ms` and `block` are
    /// [`quantise`]'s for this `d` and `out` (`n x d`).
    pub(super) unsafe fn tiles(
        isa: Isa,
        block: &Block,
        ys: &[u32],
        ms: &[u32],
        d: usize,
        out: &mut [MaybeUninit<f32>],
    ) {
        let (rows, wide) = match isa {
            Isa::Vnni512 => (TILE_VNNI, 32),
            Isa::Avx2 => (TILE_AVX2, 16),
        };
        let (active, half, n) = (&block.active[..], d / 2, out.len() / d);
        // One tile of `r` tokens (`rows` or 1) and `cols`' width; `ys` and `o` from its first.
        let tile = |r: usize, cols: &Columns<'_>, ys: &[u32], o: &mut [MaybeUninit<f32>]| {
            // SAFETY: the caller's features; the shapes are this loop's.
            unsafe {
                match (isa, r, cols.fixed.len()) {
                    (Isa::Vnni512, TILE_VNNI, 32) => {
                        tile_vnni::<TILE_VNNI, 2>(active, cols, ys, half, o)
                    }
                    (Isa::Vnni512, TILE_VNNI, _) => {
                        tile_vnni::<TILE_VNNI, 1>(active, cols, ys, half, o)
                    }
                    (Isa::Vnni512, _, 32) => tile_vnni::<1, 2>(active, cols, ys, half, o),
                    (Isa::Vnni512, ..) => tile_vnni::<1, 1>(active, cols, ys, half, o),
                    (Isa::Avx2, TILE_AVX2, _) => {
                        tile_avx2::<TILE_AVX2, 2>(active, cols, ys, half, o)
                    }
                    (Isa::Avx2, ..) => tile_avx2::<1, 2>(active, cols, ys, half, o),
                }
            }
        };
        let mut t = 0;
        while t < n {
            let r = (n - t).min(rows);
            let yt = &ys[t * half..][..r * half];
            let o = &mut out[t * d..][..r * d];
            let mut col = 0;
            while col < d {
                let width = if d - col >= wide { wide } else { 16 };
                let cols = Columns {
                    fixed: &block.fixed[col..col + width],
                    scale: &block.col_scale[col..col + width],
                    ms: &ms[col..],
                    d,
                };
                if r == rows {
                    tile(r, &cols, yt, &mut o[col..]);
                } else {
                    for (i, o) in o.chunks_exact_mut(d).enumerate() {
                        tile(1, &cols, &yt[i * half..], &mut o[col..]);
                    }
                }
                col += width;
            }
            t += r;
        }
    }

    /// `tile::<Vnni512, R, W>`: `16 W` columns.
    ///
    /// # Safety
    /// As [`tiles`] with `Isa::Vnni512`; as [`tile`].
    #[target_feature(enable = "avx512vnni,avx512bw,avx512vl,avx512f,avx2,fma")]
    unsafe fn tile_vnni<const R: usize, const W: usize>(
        active: &[usize],
        cols: &Columns<'_>,
        ys: &[u32],
        half: usize,
        out: &mut [MaybeUninit<f32>],
    ) {
        // SAFETY: the caller's; this function's features inline `Vnni512`'s intrinsics.
        unsafe { tile::<Vnni512, R, W>(active, cols, ys, half, out) }
    }

    /// `tile::<Avx2, R, W>`: `8 W` columns.
    ///
    /// # Safety
    /// As [`tiles`] with `Isa::Avx2`; as [`tile`].
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile_avx2<const R: usize, const W: usize>(
        active: &[usize],
        cols: &Columns<'_>,
        ys: &[u32],
        half: usize,
        out: &mut [MaybeUninit<f32>],
    ) {
        // SAFETY: the caller's; this function's features inline `Avx2`'s intrinsics.
        unsafe { tile::<Avx2, R, W>(active, cols, ys, half, out) }
    }

    /// The vector operations of a tile, for one instruction set: `LANES` int32 sums a
    /// vector. Each is inlined into a `#[target_feature]` tile function of that set.
    trait Lanes {
        type I: Copy;
        const LANES: usize;
        /// A zero accumulator.
        unsafe fn zero() -> Self::I;
        /// `LANES` pairs from `p`.
        unsafe fn load(p: *const u32) -> Self::I;
        /// One pair in every lane.
        unsafe fn splat(x: u32) -> Self::I;
        /// `acc` plus each lane's pair sum `m.lo * b.lo + m.hi * b.hi` (int32, wrapping).
        unsafe fn dot(acc: Self::I, m: Self::I, b: Self::I) -> Self::I;
        /// `out[..LANES] = scale * acc + fixed` (one rounding: a fused multiply-add).
        unsafe fn finish(acc: Self::I, scale: *const f32, fixed: *const f32, out: *mut f32);
    }

    /// AVX512-VNNI: `vpdpwssd` makes the pair sum and adds it in one instruction.
    struct Vnni512;

    impl Lanes for Vnni512 {
        type I = __m512i;
        const LANES: usize = 16;
        #[inline(always)]
        unsafe fn zero() -> __m512i {
            _mm512_setzero_si512()
        }
        #[inline(always)]
        unsafe fn load(p: *const u32) -> __m512i {
            unsafe { _mm512_loadu_si512(p.cast()) }
        }
        #[inline(always)]
        unsafe fn splat(x: u32) -> __m512i {
            _mm512_set1_epi32(x as i32)
        }
        #[inline(always)]
        unsafe fn dot(acc: __m512i, m: __m512i, b: __m512i) -> __m512i {
            _mm512_dpwssd_epi32(acc, m, b)
        }
        #[inline(always)]
        unsafe fn finish(acc: __m512i, scale: *const f32, fixed: *const f32, out: *mut f32) {
            unsafe {
                let (s, f) = (_mm512_loadu_ps(scale), _mm512_loadu_ps(fixed));
                _mm512_storeu_ps(out, _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(acc), f));
            }
        }
    }

    /// AVX2: `vpmaddwd` makes the pair sums exactly as `vpdpwssd` does, `vpaddd` adds them.
    struct Avx2;

    impl Lanes for Avx2 {
        type I = __m256i;
        const LANES: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> __m256i {
            _mm256_setzero_si256()
        }
        #[inline(always)]
        unsafe fn load(p: *const u32) -> __m256i {
            unsafe { _mm256_loadu_si256(p.cast()) }
        }
        #[inline(always)]
        unsafe fn splat(x: u32) -> __m256i {
            _mm256_set1_epi32(x as i32)
        }
        #[inline(always)]
        unsafe fn dot(acc: __m256i, m: __m256i, b: __m256i) -> __m256i {
            _mm256_add_epi32(acc, _mm256_madd_epi16(m, b))
        }
        #[inline(always)]
        unsafe fn finish(acc: __m256i, scale: *const f32, fixed: *const f32, out: *mut f32) {
            unsafe {
                let (s, f) = (_mm256_loadu_ps(scale), _mm256_loadu_ps(fixed));
                _mm256_storeu_ps(out, _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(acc), f));
            }
        }
    }

    /// `out[r * d..][..LANES W] = fixed + scale * sum over active pairs k of ys[r, p_k] . ms[k]`
    /// for `R` tokens (`ys` holds `R` rows of `half` pairs): `R W` accumulators, each frame
    /// vector loaded once for the `R` tokens, each token's pair broadcast once for the `W`
    /// vectors.
    ///
    /// # Safety
    /// Called only from a `#[target_feature]` function of `L`'s instruction set (the tiles
    /// above); every active pair is below `half`; the lengths are asserted.
    #[inline(always)]
    unsafe fn tile<L: Lanes, const R: usize, const W: usize>(
        active: &[usize],
        cols: &Columns<'_>,
        ys: &[u32],
        half: usize,
        out: &mut [MaybeUninit<f32>],
    ) {
        let (d, width) = (cols.d, L::LANES * W);
        assert!(ys.len() >= R * half && out.len() >= (R - 1) * d + width);
        assert!(active.is_empty() || cols.ms.len() >= (active.len() - 1) * d + width);
        assert!(cols.fixed.len() == width && cols.scale.len() == width);
        // SAFETY (every load and store): the bounds asserted above; the caller's features.
        // (No closures here: one would be compiled without those features.)
        let zero = unsafe { L::zero() };
        let (mut acc, mut mrow) = ([[zero; W]; R], [zero; W]);
        for (k, &p) in active.iter().enumerate() {
            for (w, m) in mrow.iter_mut().enumerate() {
                *m = unsafe { L::load(cols.ms.as_ptr().add(k * d + L::LANES * w)) };
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let b = unsafe { L::splat(*ys.as_ptr().add(r * half + p)) };
                for (a, &m) in a.iter_mut().zip(&mrow) {
                    *a = unsafe { L::dot(*a, m, b) };
                }
            }
        }
        for w in 0..W {
            let at = L::LANES * w;
            for (r, a) in acc.iter().enumerate() {
                unsafe {
                    let (s, f) = (cols.scale.as_ptr().add(at), cols.fixed.as_ptr().add(at));
                    L::finish(a[w], s, f, out.as_mut_ptr().add(r * d + at).cast());
                }
            }
        }
    }
}
