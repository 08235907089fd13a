//! The float32 arithmetic of the kernels: multiply-adds, dots and the frame product of a
//! decoded block ([`BlockFrame`]), compiled for the baseline target and with AVX + FMA.

#[cfg(target_arch = "x86_64")]
use super::avx::{columns_6x16_avx_fma, dot_avx_fma, AVX_TILE_TOKENS};

#[inline(always)]
pub(super) fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `y += a x`.
#[inline(always)]
pub(super) fn axpy<const FMA: bool>(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = madd::<FMA>(a, x, *y);
    }
}

/// `a . b`. The baseline build sums 8 independent lanes (the compiler vectorises that only
/// two lanes wide: a float reduction is not reassociated), the FMA build is written with AVX
/// intrinsics.
#[inline(always)]
pub(super) fn dot<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if FMA {
        #[allow(unsafe_code)]
        // SAFETY: `FMA` builds run only inside the AVX + FMA `kernel`s below, which are called
        // right after `avx_fma()` found those features.
        return unsafe { dot_avx_fma(a, b) };
    }
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] = madd::<FMA>(x[l], y[l], acc[l]);
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `out[col..col + W] = y . m[:, col..col + W]` (`m` is `len(y) x d` row-major), the `W` sums
/// in registers across the whole of `y`.
#[inline(always)]
pub(super) fn frame_tile<const W: usize, const FMA: bool>(
    y: &[f32],
    m: &[f32],
    col: usize,
    out: &mut [f32],
) {
    let d = out.len();
    let mut acc = [0.0f32; W];
    for (j, &a) in y.iter().enumerate() {
        let row = &m[j * d + col..][..W];
        for c in 0..W {
            acc[c] = madd::<FMA>(a, row[c], acc[c]);
        }
    }
    out[col..col + W].copy_from_slice(&acc);
}

/// `out = y M` for one row `y` (`M` is `len(y) x out.len()`), in column tiles of 64, 16 and 1.
#[inline(always)]
pub(super) fn times_frame<const FMA: bool>(y: &[f32], m: &[f32], out: &mut [f32]) {
    let d = out.len();
    let mut col = 0;
    while col + 64 <= d {
        frame_tile::<64, FMA>(y, m, col, out);
        col += 64;
    }
    while col + 16 <= d {
        frame_tile::<16, FMA>(y, m, col, out);
        col += 16;
    }
    while col < d {
        frame_tile::<1, FMA>(y, m, col, out);
        col += 1;
    }
}

/// A frame reduced to the coordinates that vary within one decoded block. Water-filling gives
/// many components no bits in a block (with a calibration bundle about a fifth of the key
/// components, up to 0.6 in some layers); such a coordinate is the same for every token of
/// the block, so its share of `y_t M` is one vector for the whole block, and the per-token
/// product runs over the varying rows only.
pub(super) struct BlockFrame<'m> {
    /// Indices of the varying coordinates.
    pub(super) varying: Vec<usize>,
    /// `M` (`d x d`), whose varying rows the product reads in place: packing them per block
    /// copied 130 KB per block and step for a frame across three heads.
    pub(super) m: &'m [f32],
    /// `sum` over the fixed coordinates `j` of `y_j M[j]`.
    pub(super) fixed: Vec<f32>,
}

impl<'m> BlockFrame<'m> {
    #[inline(always)]
    pub(super) fn new<const FMA: bool>(y: &[f32], d: usize, m: &'m [f32]) -> Self {
        let first = &y[..d];
        let varies = varying_mask(y, d);
        let varying: Vec<usize> = (0..d).filter(|&j| varies[j]).collect();
        let mut fixed = vec![0.0f32; d];
        for j in (0..d).filter(|&j| !varies[j] && first[j] != 0.0) {
            axpy::<FMA>(first[j], &m[j * d..][..d], &mut fixed);
        }
        Self { varying, m, fixed }
    }

    /// `out[t] = y_t M` for every token of the block (`y` and `out` are `n x d`), in tiles of
    /// a few tokens (the last few in one tile padded with zero rows, a last single token alone)
    /// by 16 (then 8, then 1) columns whose sums stay
    /// in registers across the varying rows: a row of `M` is loaded once per tile rather than
    /// once per token, which bounded the one-token product by loads. Each sum adds the same
    /// terms in the same order as a product token by token.
    #[inline(always)]
    pub(super) fn product<const FMA: bool>(&self, y: &[f32], d: usize, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if FMA {
            return self.tiles::<AVX_TILE_TOKENS, FMA>(y, d, out);
        }
        // 4 x 16 in the portable build: wider tiles left the compiler's accumulators in memory.
        self.tiles::<4, FMA>(y, d, out)
    }

    /// [`Self::product`] in tiles of `R` tokens.
    #[inline(always)]
    pub(super) fn tiles<const R: usize, const FMA: bool>(
        &self,
        y: &[f32],
        d: usize,
        out: &mut [f32],
    ) {
        let tiles = y.chunks_exact(R * d);
        let rest = tiles.remainder();
        let (out, out_rest) = out.split_at_mut(y.len() - rest.len());
        for (ys, out) in tiles.zip(out.chunks_exact_mut(R * d)) {
            self.tile::<R, FMA>(ys, out);
        }
        if R > 1 && rest.len() >= 2 * d {
            // A whole tile over the last tokens and zero rows: a one-token tile loads a row of
            // `M` per two multiply-adds, so the 4 tokens a 256-token block leaves after tiles of
            // 6 cost more than a tile of 6. Each token's sum is the same either way.
            let mut pad = vec![0.0f32; 2 * R * d];
            let (ys, sums) = pad.split_at_mut(R * d);
            ys[..rest.len()].copy_from_slice(rest);
            self.tile::<R, FMA>(ys, sums);
            out_rest.copy_from_slice(&sums[..rest.len()]);
            return;
        }
        for (ys, out) in rest.chunks_exact(d).zip(out_rest.chunks_exact_mut(d)) {
            self.tile::<1, FMA>(ys, out);
        }
    }

    /// [`Self::product`] of `R` tokens (`ys` and `out` are `R x d`).
    #[inline(always)]
    pub(super) fn tile<const R: usize, const FMA: bool>(&self, ys: &[f32], out: &mut [f32]) {
        let d = self.fixed.len();
        let mut col = 0;
        while col + 16 <= d {
            #[cfg(target_arch = "x86_64")]
            if FMA && R == AVX_TILE_TOKENS {
                #[allow(unsafe_code)]
                // SAFETY: `FMA` builds run only inside the AVX + FMA `kernel`s (see `dot`);
                // `ys` and `out` are `R x d` and `col + 16 <= d`; `varying` holds coordinates
                // below `d` and `m` is `d x d` (`BlockFrame::new`).
                unsafe {
                    columns_6x16_avx_fma(&self.fixed, &self.varying, self.m, ys, col, out)
                };
                col += 16;
                continue;
            }
            self.columns::<R, 16, FMA>(ys, col, out);
            col += 16;
        }
        while col + 8 <= d {
            self.columns::<R, 8, FMA>(ys, col, out);
            col += 8;
        }
        while col < d {
            self.columns::<R, 1, FMA>(ys, col, out);
            col += 1;
        }
    }

    /// `out[r, col..col + W] = fixed[col..col + W] + sum_j ys[r, varying[j]] rows[j, col..col +
    /// W]`.
    #[inline(always)]
    pub(super) fn columns<const R: usize, const W: usize, const FMA: bool>(
        &self,
        ys: &[f32],
        col: usize,
        out: &mut [f32],
    ) {
        let d = self.fixed.len();
        let mut acc = [[0.0f32; W]; R];
        for a in &mut acc {
            a.copy_from_slice(&self.fixed[col..col + W]);
        }
        for &j in &self.varying {
            let row = &self.m[j * d + col..][..W];
            for (r, a) in acc.iter_mut().enumerate() {
                let p = ys[r * d + j];
                for c in 0..W {
                    a[c] = madd::<FMA>(p, row[c], a[c]);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            out[r * d + col..][..W].copy_from_slice(a);
        }
    }
}

/// Which of a decoded block's `d` coordinates (`y` is `n x d`) are not the same for every token.
#[inline(always)]
pub(super) fn varying_mask(y: &[f32], d: usize) -> Vec<bool> {
    let first = &y[..d];
    let mut varies = vec![false; d];
    for yt in y.chunks_exact(d).skip(1) {
        for ((v, &a), &b) in varies.iter_mut().zip(yt).zip(first) {
            // `!=` also marks NaN as varying: it then reaches the product as before.
            *v |= a != b;
        }
    }
    varies
}
