//! The AVX512-VNNI and AVX2 builds of the int16 frame product.

use super::super::bf16::split_pairs;
use super::grid::{level, Grid, Isa};
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
/// time: the reference's `quantise` bit for bit, for either tile kind (on a
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

/// [`centre_product`](super::super::bf16::centre_product) in 8-lane AVX2.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn centre_product(centre: &[f32], d: usize, m: &[f32]) -> Vec<f32> {
    super::super::bf16::centre_product(centre, d, m)
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
                (Isa::Avx2, TILE_AVX2, _) => tile_avx2::<TILE_AVX2, 2>(active, cols, ys, half, o),
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
