//! The key kernel's frame product `y_t M` in 16-bit integers with exact int32 sums, on CPUs
//! with AVX512-VNNI (`vpdpwssd`: two 16-bit products per int32 lane, twice the float32 FMA
//! rate of the same CPU, the rate of the bfloat16 product) or AVX2 (`vpmaddwd` and `vpaddd`:
//! the same int32 sums, so the same bits; faster than the float32 path on a Zen 3, no faster
//! on a Zen 1: `docs/performance.md`).
//!
//! bfloat16 keeps 8 significant bits of each residual and frame entry (on SmolLM2 that moved
//! the teacher-forced KL by less than its noise, -1% +- 1.4% over 6 passages at 4k,
//! `docs/performance.md`). Integers with scales chosen per block keep 11-13
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
//! the centre, the spreads or the levels (`docs/performance.md`). The bound is the
//! same with the tables' spread, which 256-token blocks mostly fill. A coordinate whose table
//! holds one value varies only at its outliers: they are added after the tiles in float32
//! (one frame row each), so its pair is not multiplied for every token.

#[cfg(test)]
use super::bf16::{centre_product, split_pairs};
use std::cell::RefCell;
use std::mem::MaybeUninit;

mod grid;
#[cfg(test)]
pub(super) use grid::level;
pub(super) use grid::{Grid, Isa};

thread_local! {
    /// A block's integer residuals `[n, d / 2]` and its scaled frame `[active pairs, d]`, as
    /// pairs of 16-bit integers, reused by every block this thread multiplies.
    static BUFFERS: RefCell<(Vec<u32>, Vec<u32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
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

#[cfg(test)]
impl Grid {
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

/// `out[t] = y_t M` for a block decoded as `grid`'s levels (`levels` is `n x d`, each
/// [`Grid::level`] of the block's value): [`product`]'s tiles and bits for the levels it
/// would have made with this grid's centres and spreads, then the outliers the levels leave
/// out. `out` is cleared and holds the `n x d` products after: the tiles write every value,
/// so its memory is not zeroed first (zeroing it showed in a decode step's profile).
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
mod x86;
