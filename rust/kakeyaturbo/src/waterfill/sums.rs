//! Weighted sums of a water-filled block's vectors straight from its codes (AVX2 and FMA):
//! `out[r, j] = sum_t w[r, t] y[t, j]` for the few query rows of a decode step, without
//! writing the decoded block anywhere.
//!
//! Decoding first (`gather.rs`) writes 8 x 8 tiles of values row-major, with a branch on each
//! component's kind per tile and a transpose, and the sums then read them back: in a decode
//! step that decode cost more than twice the sums that followed it (`docs/performance.md`). Here
//! the decoder's gathers run first, for every group of 8
//! vectors, and their words are kept (shifted to their first bit); then each component, one
//! after another (its kind fixed for the whole block: no branch per tile), takes its codes
//! from its word by a shift and a mask, turns them into values in registers (the decoder's
//! permutes, or its gather from the component's values) and adds them straight into `R` sums
//! whose 8 lanes are tokens. The sums add the same terms as decoding and then summing, in
//! another order (8 lanes of tokens, reduced at the end): they agree to float32 rounding.
//! The outliers are added afterwards as their differences to the values their codes decode to.

use std::arch::x86_64::*;

use super::gather::{load8, Kind, Plan};

/// Most query rows summed in one pass: 12 sums in registers beside a component's tables, its
/// codes and its values (AVX2's 16 registers).
pub(super) const MAX_ROWS: usize = 12;

/// A thread's buffers for [`sums`], kept between blocks.
#[derive(Default)]
pub(super) struct SumsBuffers {
    /// Per word of the plan and group of 8 vectors, the group's gathered words shifted to
    /// their first bit: `words[base * groups + group]`.
    words: Vec<__m256i>,
    /// The weights, `R x n8` (`n8` the tokens rounded up to 8), zero past the block's tokens.
    weights: Vec<f32>,
    /// The groups of 8 vectors of the last block [`sums`] took.
    groups: usize,
}

impl SumsBuffers {
    pub(super) fn bytes(&self) -> usize {
        32 * self.words.capacity() + 4 * self.weights.capacity()
    }

    /// Component `j`'s code of vector `t` in the last block [`sums`] took with `plan` (0
    /// without bits: its one value).
    pub(super) fn code(&self, plan: &Plan, j: usize, t: usize) -> usize {
        let c = &plan.comps[j];
        let word = self.words[c.word * self.groups + t / 8];
        // SAFETY: a 256-bit vector is 8 u32s, every bit pattern valid.
        #[allow(unsafe_code)]
        let lanes: [u32; 8] = unsafe { std::mem::transmute(word) };
        ((lanes[t % 8] >> c.rel) & c.mask) as usize
    }
}

/// The codes of a block for [`sums`]: `groups` groups of 8 vectors from `codes` (whose gathers
/// stay within it: `Plan::vectors_within`), then `tail_groups` from `tail` (the last vectors'
/// codes, zero-padded as the decoder pads them).
pub(super) struct CodeRuns<'a> {
    pub codes: &'a [u8],
    pub groups: usize,
    pub tail: &'a [u8],
    pub tail_groups: usize,
}

/// Row `r`'s weights of the block's `n` tokens are `weights[r * stride..][..n]`.
pub(super) struct Weights<'a> {
    pub weights: &'a [f32],
    pub stride: usize,
    pub rows: usize,
    pub n: usize,
}

/// `out[r * d + j] = sum_t w[r, t] y[t, j]` over the block's vectors `y` (`d` components as the
/// plan has them), every output written.
///
/// # Safety
/// The CPU has AVX2 and FMA; `plan` was last built from `values` for this block; `runs` are
/// as [`CodeRuns`] says; `1 <= w.rows <= MAX_ROWS`, `w.n <= 8 (groups + tail_groups)`,
/// `w.weights` holds `(rows - 1) stride + n` values and `out` `rows x d`.
#[target_feature(enable = "avx,avx2,fma")]
#[allow(unsafe_code)]
pub(super) unsafe fn sums(
    plan: &Plan,
    runs: &CodeRuns<'_>,
    values: &[f32],
    w: &Weights<'_>,
    buf: &mut SumsBuffers,
    out: &mut [f32],
) {
    let d = plan.comps.len();
    let groups = runs.groups + runs.tail_groups;
    let n8 = 8 * groups;
    buf.groups = groups;
    // SAFETY: the caller's.
    unsafe { gather_words(plan, runs, &mut buf.words) };
    buf.weights.clear();
    for r in 0..w.rows {
        buf.weights
            .extend_from_slice(&w.weights[r * w.stride..][..w.n]);
        buf.weights.resize((r + 1) * n8, 0.0);
    }
    let (words, weights) = (&buf.words[..], &buf.weights[..]);
    for (j, c) in plan.comps.iter().enumerate() {
        let comp = Comp {
            words: &words[c.word * groups..][..groups],
            rel: _mm_cvtsi32_si128(c.rel as i32),
            mask: _mm256_set1_epi32(c.mask as i32),
            weights,
            n8,
        };
        let zero = _mm256_setzero_ps();
        let (kind, t0, t1, vals) = match c.kind {
            Kind::Fixed(v) => (FIXED, _mm256_set1_ps(v), zero, 0),
            Kind::Permute(i) => (PERMUTE, load8(&plan.tables[i]), zero, 0),
            Kind::Permute2(i) => (
                PERMUTE2,
                load8(&plan.tables[i]),
                load8(&plan.tables[i + 1]),
                0,
            ),
            Kind::Gather(off) => (GATHER, zero, zero, off),
        };
        let table = Table {
            t0,
            t1,
            vals: &values[vals..],
        };
        macro_rules! by_rows {
            ($($r:literal)*) => {
                match (w.rows, kind) {
                    $(
                        ($r, FIXED) => comp_sums::<$r, FIXED>(&comp, &table, out, d, j),
                        ($r, PERMUTE) => comp_sums::<$r, PERMUTE>(&comp, &table, out, d, j),
                        ($r, PERMUTE2) => comp_sums::<$r, PERMUTE2>(&comp, &table, out, d, j),
                        ($r, _) => comp_sums::<$r, GATHER>(&comp, &table, out, d, j),
                    )*
                    _ => unreachable!("1 to MAX_ROWS rows"),
                }
            };
        }
        // SAFETY: the caller's features and row count; codes of width b are below 2^b and
        // a gathered component has 2^b values from `vals` on.
        unsafe { by_rows!(1 2 3 4 5 6 7 8 9 10 11 12) };
    }
}

/// Per word of the plan and group of 8 vectors, the decoder's gather of that word, shifted
/// right by each lane's in-byte offset (so a component's code is at its `rel`), into `words`
/// (`words[base * groups + group]`).
///
/// # Safety
/// As [`sums`].
#[target_feature(enable = "avx,avx2")]
#[allow(unsafe_code)]
unsafe fn gather_words(plan: &Plan, runs: &CodeRuns<'_>, words: &mut Vec<__m256i>) {
    let groups = runs.groups + runs.tail_groups;
    words.resize(plan.bases.len() * groups, _mm256_setzero_si256());
    let p = plan.per_vector as i32;
    let lanes = _mm256_mullo_epi32(
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        _mm256_set1_epi32(p),
    );
    let seven = _mm256_set1_epi32(7);
    let mut at = 0;
    for (src, count) in [(runs.codes, runs.groups), (runs.tail, runs.tail_groups)] {
        for g in 0..count {
            let start = _mm256_add_epi32(lanes, _mm256_set1_epi32(8 * g as i32 * p));
            for (i, &base) in plan.bases.iter().enumerate() {
                let bit = _mm256_add_epi32(start, _mm256_set1_epi32(base as i32));
                // SAFETY: every byte read is within `src` (the caller's).
                let word = unsafe {
                    _mm256_i32gather_epi32::<1>(
                        src.as_ptr() as *const i32,
                        _mm256_srli_epi32::<3>(bit),
                    )
                };
                let shifted = _mm256_srlv_epi32(word, _mm256_and_si256(bit, seven));
                words[i * groups + at] = shifted;
            }
            at += 1;
        }
    }
}

const FIXED: u8 = 0;
const PERMUTE: u8 = 1;
const PERMUTE2: u8 = 2;
const GATHER: u8 = 3;

/// One component: its words (one per group of 8 vectors), where its code sits in them and
/// its mask, and the padded weights (`R x n8`).
struct Comp<'a> {
    words: &'a [__m256i],
    rel: __m128i,
    mask: __m256i,
    weights: &'a [f32],
    n8: usize,
}

/// How a component's codes become values: its permute tables (`t0`, `t1`), its constant
/// (`t0`, no bits), or its values by code (`vals`).
struct Table<'a> {
    t0: __m256,
    t1: __m256,
    vals: &'a [f32],
}

/// `out[r * d + j]` for `R` rows from one component of kind `K`.
///
/// # Safety
/// AVX2 and FMA; `c.weights` holds `R x c.n8` values and `out` `R x d`; with `GATHER`, every
/// code indexes `t.vals`.
#[inline(always)]
#[allow(unsafe_code)]
unsafe fn comp_sums<const R: usize, const K: u8>(
    c: &Comp<'_>,
    t: &Table<'_>,
    out: &mut [f32],
    d: usize,
    j: usize,
) {
    assert!(c.weights.len() >= R * c.n8 && 8 * c.words.len() == c.n8 && out.len() >= R * d);
    // SAFETY (every load): `g + 8 <= n8` and the lengths asserted above.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); R];
        let mut g = 0;
        for &word in c.words {
            let v = if K == FIXED {
                t.t0
            } else {
                let code = _mm256_and_si256(_mm256_srl_epi32(word, c.rel), c.mask);
                match K {
                    PERMUTE => _mm256_permutevar8x32_ps(t.t0, code),
                    PERMUTE2 => {
                        let lo = _mm256_permutevar8x32_ps(t.t0, code);
                        let hi = _mm256_permutevar8x32_ps(t.t1, code);
                        let high = _mm256_castsi256_ps(_mm256_slli_epi32::<28>(code));
                        _mm256_blendv_ps(lo, hi, high)
                    }
                    _ => _mm256_i32gather_ps::<4>(t.vals.as_ptr(), code),
                }
            };
            for (r, a) in acc.iter_mut().enumerate() {
                let wv = _mm256_loadu_ps(c.weights.as_ptr().add(r * c.n8 + g));
                *a = _mm256_fmadd_ps(wv, v, *a);
            }
            g += 8;
        }
        for (r, a) in acc.iter().enumerate() {
            let s = _mm_add_ps(_mm256_castps256_ps128(*a), _mm256_extractf128_ps::<1>(*a));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_movehdup_ps(s));
            *out.get_unchecked_mut(r * d + j) = _mm_cvtss_f32(s);
        }
    }
}
