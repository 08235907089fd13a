//! The int16 product's building blocks shared by its portable and x86 parts: the
//! instruction sets it runs on, the integer level rule, and a block's grid of levels.

/// The instructions that run [`product`](super::product)'s integer tiles on this CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::coded_attention) enum Isa {
    /// AVX512-VNNI's `vpdpwssd`: a pair's two products and their sum into an int32 lane, 16
    /// lanes an instruction.
    Vnni512,
    /// AVX2's `vpmaddwd` (the same pair sums, 8 lanes) and a `vpaddd` beside it: on a Zen 3
    /// about 1.55x the float32 FMA peak (`docs/performance.md`), half the frame bytes
    /// read.
    Avx2,
}

/// The largest `R`: 13-bit integers, beyond which the rounding is far below the float32
/// sums' own.
const MAX_LEVEL: i32 = 4095;

/// The largest integer level `R` with `coords * R^2 < 2^31` (at most [`MAX_LEVEL`]).
pub(in crate::coded_attention) fn level(coords: usize) -> i32 {
    let limit = (i32::MAX as f64 / coords.max(1) as f64).sqrt().floor() as i32;
    limit.clamp(1, MAX_LEVEL)
}

/// How a block's coordinates become integer levels as they are decoded from its codes,
/// where the codes' tables bound every value before any token is read: about each
/// coordinate's midrange, in steps of its half-range over `R`. So a level is a table lookup,
/// and the data passes of [`product`](super::product) (the centre, the spreads, the levels) go.
pub(in crate::coded_attention) struct Grid {
    pub(super) centre: Vec<f32>,
    pub(super) spread: Vec<f32>,
    /// `R / spread_j` (0 where the coordinate cannot vary).
    pub(super) inv: Vec<f32>,
    /// The pairs with a coordinate that can vary.
    pub(super) active: Vec<usize>,
    /// `(token, coordinate, value - centre)` of the outliers of coordinates whose table holds
    /// one value (level 0 for every token): added after the product.
    pub(super) sparse: Vec<(usize, usize, f32)>,
    pub(super) r: i32,
}

impl Grid {
    /// The grid of coordinates whose tables' values lie in `[table_lo_j, table_hi_j]`, with
    /// `outliers` (position in the block's `n x d` values, value) besides (all finite, `d`
    /// even).
    pub(in crate::coded_attention) fn new(
        table_lo: &[f32],
        table_hi: &[f32],
        outliers: &[(usize, f32)],
    ) -> Grid {
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
    /// outside [`x86::correct`](super::x86::correct) it is the tests' reference: the same fused
    /// steps, one value at a time.
    #[inline(always)]
    pub(in crate::coded_attention) fn correct(&self, d: usize, m: &[f32], out: &mut [f32]) {
        for &(t, j, v) in &self.sparse {
            super::super::frame::axpy::<true>(v, &m[j * d..][..d], &mut out[t * d..][..d]);
        }
    }

    #[cfg(test)]
    /// How many outliers the levels leave out.
    pub(in crate::coded_attention) fn sparse(&self) -> usize {
        self.sparse.len()
    }

    /// Coordinate `j`'s `values` as their levels, integers within `+-R` (as floats), in
    /// place.
    pub(in crate::coded_attention) fn level(&self, j: usize, values: &mut [f32]) {
        let (c, inv, r) = (self.centre[j], self.inv[j], self.r as f32);
        for v in values {
            *v = round_even((*v - c) * inv).clamp(-r, r);
        }
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
