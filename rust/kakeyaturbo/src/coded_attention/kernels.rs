//! The per-block kernels: a block's keys (frame product, RoPE), their logits against the
//! query rows, and the weighted sums of its values.

#[cfg(target_arch = "x86_64")]
use super::avx::dots4_avx_fma;
use super::cpu::with_avx_fma;
use super::frame::{dot, madd, BlockFrame};
use super::inputs::{BlockAngles, Product};
use super::scratch::{KEYS, SCALES, WEIGHTS};
use super::{bf16, int16};

/// Smallest `|y_t|` a token-norm scale divides by (as the Python path clamps it).
pub(super) const MIN_NORM: f32 = 1e-12;

#[inline(always)]
pub(super) fn token_scale<const FMA: bool>(norms: Option<&[f32]>, t: usize, y: &[f32]) -> f32 {
    match norms {
        None => 1.0,
        Some(nm) => nm[t] / length::<FMA>(y),
    }
}

/// `|y|`, at least [`MIN_NORM`]: what a token-norm scale divides by.
#[inline(always)]
pub(super) fn length<const FMA: bool>(y: &[f32]) -> f32 {
    dot::<FMA>(y, y).sqrt().max(MIN_NORM)
}

/// A decoded block as the key kernels take it: its values (`n x d`), or its int16 levels
/// decoded straight from its codes on `grid`
/// ([`CodedStreams::decode_keys`](super::streams::CodedStreams::decode_keys); only for the int16
/// frame product, where nothing reads the values themselves).
#[derive(Clone, Copy)]
pub(super) enum Coords<'a> {
    Values(&'a [f32]),
    Levels(&'a [f32], &'a int16::Grid),
}

impl<'a> Coords<'a> {
    pub(super) fn of(decoded: &'a [f32], grid: Option<&'a int16::Grid>) -> Self {
        match grid {
            Some(g) => Coords::Levels(decoded, g),
            None => Coords::Values(decoded),
        }
    }

    /// `n x d` numbers: the values, or the levels.
    pub(super) fn len(&self) -> usize {
        match self {
            Coords::Values(y) | Coords::Levels(y, _) => y.len(),
        }
    }

    /// The values; levels only where [`KeyInputs::levels`](super::inputs::KeyInputs::levels) found
    /// nothing needs them.
    pub(super) fn values(&self) -> &'a [f32] {
        match self {
            Coords::Values(y) => y,
            Coords::Levels(..) => unreachable!("levels are decoded only where no value is read"),
        }
    }
}

/// `(decoded block, head dim, frame, how its product runs, angles)`: what makes a block's keys.
pub(super) type KeyArgs<'a> = (
    Coords<'a>,
    usize,
    Option<&'a [f32]>,
    Product<'a>,
    Option<BlockAngles<'a>>,
);

/// `(what makes the keys, norms, query rows)`.
pub(super) type LogitArgs<'a> = (KeyArgs<'a>, Option<&'a [f32]>, Rows<'a>);

/// `g` query rows `[g, d]` and each one's [`nonzero_chunks`].
pub(super) type Rows<'a> = (&'a [f32], &'a [Vec<usize>]);

/// `(decoded block, head dim, weights, tokens, first token, norms, query rows)`.
pub(super) type SumArgs<'a> = (
    &'a [f32],
    usize,
    &'a [f32],
    usize,
    usize,
    Option<&'a [f32]>,
    usize,
);

/// Logits of one decoded block: `out` is `[g, n]`. The keys of the whole block are made first
/// (frame product, RoPE), then every query row is dotted with them eight tokens at a time.
#[inline(always)]
pub(super) fn block_logits<const FMA: bool>(args: LogitArgs<'_>, out: &mut [f32]) {
    // Taken and put back, not borrowed in a closure: a closure does not inherit the `kernel`'s
    // target features, and where the compiler kept it out of line (the criterion binary) every
    // `mul_add` in it became a call to libm's `fmaf`, a third of `key_logits`' time.
    let mut buf = KEYS.take();
    block_logits_in::<FMA>(args, out, &mut buf);
    KEYS.set(buf);
}

/// [`block_logits`] with `buf` to hold the keys.
#[inline(always)]
pub(super) fn block_logits_in<const FMA: bool>(
    args: LogitArgs<'_>,
    out: &mut [f32],
    buf: &mut Vec<f32>,
) {
    let ((y, d, m, product, rot), norms, (q, chunks)) = args;
    let (n, g) = (y.len() / d, chunks.len());
    let keys: &[f32] = match block_keys::<FMA>(y, d, m, product, rot, buf) {
        true => &buf[..y.len()],
        false => y.values(),
    };
    dots_rows::<FMA>(q, chunks, keys, out);
    if norms.is_some() {
        for (t, yt) in y.values().chunks_exact(d).enumerate() {
            let scale = token_scale::<FMA>(norms, t, yt);
            for j in 0..g {
                out[j * n + t] *= scale;
            }
        }
    }
}

/// A decoded block's keys (`y` is `n x d`): its frame product and RoPE into `buf`'s first
/// `n d` values (grown as needed). False where neither applies: the decoded block is the
/// keys.
#[inline(always)]
pub(super) fn block_keys<const FMA: bool>(
    y: Coords<'_>,
    d: usize,
    m: Option<&[f32]>,
    product: Product<'_>,
    rot: Option<BlockAngles<'_>>,
    buf: &mut Vec<f32>,
) -> bool {
    let rot = rot.filter(|&(_, pairs, repeats)| pairs * repeats > 0);
    if m.is_none() && rot.is_none() {
        return false;
    }
    if let (Some(m), Product::I16, Coords::Levels(l, grid)) = (m, product, y) {
        // Sized to the block and written whole, its memory not zeroed first.
        int16::product_levels(l, grid, d, m, buf);
    } else {
        // Grown, never cleared: the product or the copy writes all of its first `n d`.
        if buf.len() < y.len() {
            buf.resize(y.len(), 0.0);
        }
        let own = &mut buf[..y.len()];
        match (m, product) {
            (Some(m), Product::Bf16(mp)) => bf16::product(y.values(), d, m, mp, own),
            (Some(m), Product::I16) => int16::product(y.values(), d, m, own),
            (Some(m), Product::F32) => {
                let y = y.values();
                BlockFrame::new::<FMA>(y, d, m).product::<FMA>(y, d, own)
            }
            (None, _) => own.copy_from_slice(y.values()),
        }
    }
    let own = &mut buf[..y.len()];
    if let Some((r, pairs, repeats)) = rot {
        let turned = pairs * repeats;
        for (k, rt) in own.chunks_exact_mut(d).zip(r.chunks_exact(2 * pairs)) {
            let (cos, sin) = rt.split_at(pairs);
            let (re, rest) = k.split_at_mut(turned);
            let im = &mut rest[..turned];
            for (re, im) in re.chunks_exact_mut(pairs).zip(im.chunks_exact_mut(pairs)) {
                for (((a, b), &c), &s) in re.iter_mut().zip(im).zip(cos).zip(sin) {
                    (*a, *b) = (*a * c - *b * s, *a * s + *b * c);
                }
            }
        }
    }
    true
}

/// The first channels of the 8-channel chunks where `q` is not zero (none unless its length
/// is a multiple of 8): a wide query of streams coded across heads is zero outside its own
/// head's channels (two thirds of them with three heads), which [`dots_rows`] skips.
pub(super) fn nonzero_chunks(q: &[f32]) -> Vec<usize> {
    if !q.len().is_multiple_of(8) {
        return Vec::new();
    }
    (0..q.len())
        .step_by(8)
        .filter(|&c| q[c..c + 8].iter().any(|&x| x != 0.0))
        .collect()
}

/// `out[j, t] = q_j . keys[t]` for every query row `j` of `q` (`[g, d]`, `out` `[g, n]`) and
/// every row of `keys` (`[n, d]`); `chunks` are each row's [`nonzero_chunks`], which the AVX
/// form skips (two thirds of a wide query across three heads is zero). Up to [`GROUP_ROWS`]
/// rows with the same chunks (one KV head's query rows, or its share of a wide query) go
/// together, so that each key is read once per group rather than once per row: row by row,
/// a decode step read each made block (196 KB for SmolLM2) three times, with a load per
/// multiply-add.
#[inline(always)]
pub(super) fn dots_rows<const FMA: bool>(
    q: &[f32],
    chunks: &[Vec<usize>],
    keys: &[f32],
    out: &mut [f32],
) {
    let g = chunks.len();
    if g == 0 || out.is_empty() {
        return;
    }
    let (d, n) = (q.len() / g, out.len() / g);
    #[cfg(target_arch = "x86_64")]
    if FMA && d.is_multiple_of(8) {
        // The tokens up to the last multiple of 8 go through the horizontal adds (four at a
        // time), the rest through `dot`: where the row-by-row form drew that line, so each
        // token's sum keeps its bits.
        let whole = n / 8 * 8;
        let mut j = 0;
        while j < g {
            let same = chunks[j..].iter().take(GROUP_ROWS);
            let k = j + same.take_while(|c| **c == chunks[j]).count();
            let (qg, og) = (&q[j * d..k * d], &mut out[j * n..k * n]);
            #[allow(unsafe_code)]
            // SAFETY: `FMA` builds run only inside the AVX + FMA `kernel`s (see `dot`).
            unsafe {
                match k - j {
                    1 => dots4_avx_fma::<1>(qg, &chunks[j], keys, whole, og),
                    2 => dots4_avx_fma::<2>(qg, &chunks[j], keys, whole, og),
                    _ => dots4_avx_fma::<3>(qg, &chunks[j], keys, whole, og),
                }
            }
            for (qr, o) in qg.chunks_exact(d).zip(og.chunks_exact_mut(n)) {
                for (t, o) in o.iter_mut().enumerate().skip(whole) {
                    *o = dot::<FMA>(qr, &keys[t * d..][..d]);
                }
            }
            j = k;
        }
        return;
    }
    for (qj, o) in q.chunks_exact(d).zip(out.chunks_exact_mut(n)) {
        for (k, o) in keys.chunks_exact(d).zip(o) {
            *o = dot::<FMA>(qj, k);
        }
    }
}

/// The most query rows [`dots_rows`] takes together: with 4 tokens, 12 sums in registers
/// besides the rows' query chunks and a key (16 AVX registers).
pub(super) const GROUP_ROWS: usize = 3;

/// The most query rows [`block_sums`] sums in one tile: with 8 columns, 12 sums in registers
/// besides a token's values and a broadcast weight (16 AVX registers).
pub(super) const TILE_ROWS: usize = 12;

/// Weighted sums of one decoded block into `out` (`[g, d]`, zeros on entry), in tiles of
/// query rows by a few columns whose sums stay in registers across the block's tokens: a
/// token's values are loaded once per tile rather than once per row, and no sum goes through
/// memory per token. Each sum adds the same terms in token order.
///
/// The rows go in as few tiles as fit ([`TILE_ROWS`]), so the block is read once per tile:
/// the 9 rows of SmolLM2's values coded across heads read it once, where tiles of 4 rows read
/// it three times (`docs/performance.md`).
#[inline(always)]
pub(super) fn block_sums<const FMA: bool>(args: SumArgs<'_>, out: &mut [f32]) {
    let (y, d, w, t_n, t0, norms, g) = args;
    let n = y.len() / d;
    // Taken and put back, as `block_logits` does its keys: a tile's weights (9 KB for 9 rows
    // of 256 tokens) were an allocation per block above glibc's per-thread cache.
    let (mut scales, mut wt) = (SCALES.take(), WEIGHTS.take());
    scales.clear();
    if norms.is_some() {
        scales.extend((0..n).map(|t| token_scale::<FMA>(norms, t, &y[t * d..][..d])));
    }
    // Each tile's weights with the token scales in, token-major: `[n, R]`.
    let weights = |rows: std::ops::Range<usize>, wt: &mut Vec<f32>| {
        wt.clear();
        for t in 0..n {
            let scale = scales.get(t).copied().unwrap_or(1.0);
            wt.extend(rows.clone().map(|j| w[j * t_n + t0 + t] * scale));
        }
    };
    // Equal tiles (within a row) of at most TILE_ROWS rows.
    let tiles = g.div_ceil(TILE_ROWS);
    let mut j0 = 0;
    for i in 0..tiles {
        let j1 = g * (i + 1) / tiles;
        weights(j0..j1, &mut wt);
        let o = &mut out[j0 * d..j1 * d];
        // Columns wide enough to keep 6-12 independent sums in flight.
        match j1 - j0 {
            1 => sums_tile::<1, 64, FMA>(y, &wt, o),
            2 => sums_tile::<2, 32, FMA>(y, &wt, o),
            3 => sums_tile::<3, 16, FMA>(y, &wt, o),
            4 => sums_tile::<4, 16, FMA>(y, &wt, o),
            5 => sums_tile::<5, 16, FMA>(y, &wt, o),
            6 => sums_tile::<6, 16, FMA>(y, &wt, o),
            7 => sums_tile::<7, 8, FMA>(y, &wt, o),
            8 => sums_tile::<8, 8, FMA>(y, &wt, o),
            9 => sums_tile::<9, 8, FMA>(y, &wt, o),
            10 => sums_tile::<10, 8, FMA>(y, &wt, o),
            11 => sums_tile::<11, 8, FMA>(y, &wt, o),
            _ => sums_tile::<TILE_ROWS, 8, FMA>(y, &wt, o),
        }
        j0 = j1;
    }
    SCALES.set(scales);
    WEIGHTS.set(wt);
}

/// `out[r] = sum_t wt[t, r] y_t` for `R` rows (`wt` is `[n, R]`, `out` `R x d`), in column
/// tiles of `W`, 8 and 1.
#[inline(always)]
pub(super) fn sums_tile<const R: usize, const W: usize, const FMA: bool>(
    y: &[f32],
    wt: &[f32],
    out: &mut [f32],
) {
    let d = out.len() / R;
    let mut col = 0;
    while col + W <= d {
        sums_columns::<R, W, FMA>(y, wt, col, out);
        col += W;
    }
    while col + 8 <= d {
        sums_columns::<R, 8, FMA>(y, wt, col, out);
        col += 8;
    }
    while col < d {
        sums_columns::<R, 1, FMA>(y, wt, col, out);
        col += 1;
    }
}

/// [`sums_tile`] over columns `col..col + W`.
#[inline(always)]
pub(super) fn sums_columns<const R: usize, const W: usize, const FMA: bool>(
    y: &[f32],
    wt: &[f32],
    col: usize,
    out: &mut [f32],
) {
    let d = out.len() / R;
    let mut acc = [[0.0f32; W]; R];
    for (yt, wr) in y.chunks_exact(d).zip(wt.chunks_exact(R)) {
        let yv = &yt[col..col + W];
        for (a, &p) in acc.iter_mut().zip(wr) {
            for c in 0..W {
                a[c] = madd::<FMA>(p, yv[c], a[c]);
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        out[r * d + col..][..W].copy_from_slice(a);
    }
}

with_avx_fma! {
    /// [`block_logits`], built with AVX + FMA where this CPU has them.
    pub(super) fn run_block_logits(args: LogitArgs<'_>, out: &mut [f32]) => block_logits
}

with_avx_fma! {
    /// [`block_sums`], built with AVX + FMA where this CPU has them.
    pub(super) fn run_block_sums(args: SumArgs<'_>, out: &mut [f32]) => block_sums
}
