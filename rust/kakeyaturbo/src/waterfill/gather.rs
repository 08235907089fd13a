//! The AVX2 decoder of water-filled blocks: eight vectors at a time, one component at a time.
//!
//! Component `j`'s code sits at bit `i P + o_j` of vector `i` (see `decode.rs`), so for eight
//! consecutive vectors one gather of 32-bit words at those bits' bytes, a per-lane shift and a
//! mask give eight codes. A word holds at least 25 bits past the shift, so one gather serves
//! every following component whose code ends within them (a whole group of 8 components at
//! the recipe's 2.5 bits). Codes become values by a register permute (up to 3 bits: one
//! `vpermps` over 8 entries; 4 bits: two and a blend) or, wider, a gather from the
//! component's values. Eight components of eight vectors are then transposed in registers and
//! stored as eight rows, so the output is the row-major block `decode.rs` writes, value for
//! value: every value is the same per-component table entry, so the result is bit-identical.
//!
//! Against the lane tables of `decode.rs` (a table of every joint code built per block, then
//! about 28 lookups per 64-value vector at 2.5 bits) it decodes SmolLM2's coded keys and
//! values about 1.5x as fast (`docs/performance.md`).
//!
//! Nothing is read out of bounds: a group of vectors goes through here only when its last
//! gather ends within the code stream (the caller decodes the rest), and bit positions fit
//! in 31 bits (checked by [`Plan::build`]).

use std::arch::x86_64::*;

/// Bits a gathered word holds past the largest in-byte shift (32 - 7).
const WORD_BITS: u32 = 25;

/// Per component: how its codes are read and turned into values. Rebuilt for each block in
/// the same vectors ([`Plan::build`]), so that decoding a block allocates nothing.
#[derive(Default)]
pub(super) struct Plan {
    /// Bit offsets within a vector of the words gathered for each group of vectors.
    pub(super) bases: Vec<u32>,
    pub(super) comps: Vec<Comp>,
    /// 8-entry value tables of the components of up to 4 bits (two for 4 bits).
    pub(super) tables: Vec<[f32; 8]>,
    pub(super) per_vector: u32,
    /// A group's gathered words and their in-byte shifts, one per base ([`Plan::rows`]).
    words: Vec<[__m256i; 2]>,
}

#[derive(Clone, Copy)]
pub(super) struct Comp {
    /// The gathered word (index into `bases`) that holds the code, and the code's bit in it.
    pub(super) word: usize,
    pub(super) rel: u32,
    pub(super) mask: u32,
    pub(super) kind: Kind,
}

#[derive(Clone, Copy)]
pub(super) enum Kind {
    /// No bits: this value for every vector.
    Fixed(f32),
    /// Up to 3 bits: `tables[i]`.
    Permute(usize),
    /// 4 bits: `tables[i]` for codes 0..8, `tables[i + 1]` for 8..16.
    Permute2(usize),
    /// 5 to 8 bits: the component's values from this offset of `values`.
    Gather(usize),
}

impl Plan {
    /// Rebuilds the plan for a block whose component `j` has `bits[j]` bits and its values
    /// (one per code) at `values[offsets[j]..]`; false (the plan unusable) when `n` vectors
    /// of `per_vector` bits have bit positions beyond `i32`.
    pub(super) fn build(
        &mut self,
        bits: &[u8],
        values: &[f32],
        offsets: &[usize],
        n: usize,
        per_vector: usize,
    ) -> bool {
        let total = n.checked_mul(per_vector).and_then(|t| t.checked_add(64));
        if total.is_none_or(|t| t > i32::MAX as usize) {
            return false;
        }
        let Plan {
            bases,
            comps,
            tables,
            ..
        } = self;
        bases.clear();
        comps.clear();
        tables.clear();
        bases.push(0);
        let mut o = 0u32;
        for (&b, &off) in bits.iter().zip(offsets) {
            let b32 = b as u32;
            if b32 > 0 && o + b32 - bases[bases.len() - 1] > WORD_BITS {
                bases.push(o);
            }
            let base = bases[bases.len() - 1];
            let own = &values[off..][..1 << b];
            let kind = match b {
                0 => Kind::Fixed(own[0]),
                1..=3 => {
                    let mut t = [0.0f32; 8];
                    t[..own.len()].copy_from_slice(own);
                    tables.push(t);
                    Kind::Permute(tables.len() - 1)
                }
                4 => {
                    tables.push(own[..8].try_into().expect("8 values"));
                    tables.push(own[8..].try_into().expect("8 values"));
                    Kind::Permute2(tables.len() - 2)
                }
                _ => Kind::Gather(off),
            };
            comps.push(Comp {
                word: bases.len() - 1,
                rel: o - base,
                mask: (1u32 << b) - 1,
                kind,
            });
            o += b32;
        }
        self.per_vector = per_vector as u32;
        true
    }

    /// Vectors from the first whose groups of eight can be decoded here: every gather of the
    /// group's last vector (at most 4 bytes from its last code's first byte) within `len`
    /// bytes of codes.
    pub(super) fn vectors_within(&self, len: usize, n: usize) -> usize {
        let p = self.per_vector as usize;
        // Vector i's gathers read bytes below (i P + P) / 8 + 4.
        let fits = |i: usize| ((i + 1) * p).div_ceil(8) + 4 <= len;
        let mut groups = n / 8;
        while groups > 0 && !fits(groups * 8 - 1) {
            groups -= 1;
        }
        groups * 8
    }

    /// Decodes vectors `0..m` (`m` from [`Plan::vectors_within`], a multiple of 8) into
    /// `out` (`m x d` row-major, `d = bits.len()`).
    ///
    /// # Safety
    /// The CPU has AVX2; `m` comes from `vectors_within(codes.len(), ..)`, `out.len() >= m d`
    /// and `values` is the slice the plan was last built from.
    #[target_feature(enable = "avx,avx2")]
    #[allow(unsafe_code)]
    pub(super) unsafe fn rows(&mut self, codes: &[u8], values: &[f32], m: usize, out: &mut [f32]) {
        let Plan {
            bases,
            comps,
            tables,
            per_vector,
            words,
        } = self;
        let d = comps.len();
        let p = *per_vector as i32;
        let lanes = _mm256_mullo_epi32(
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            _mm256_set1_epi32(p),
        );
        let seven = _mm256_set1_epi32(7);
        let mut cols = [_mm256_setzero_ps(); 8];
        words.resize(bases.len(), [_mm256_setzero_si256(); 2]);
        let mut t0 = 0;
        while t0 < m {
            let start = _mm256_add_epi32(lanes, _mm256_set1_epi32(t0 as i32 * p));
            // All gathers first: they are independent, so their loads overlap.
            for (w, &base) in words.iter_mut().zip(bases.iter()) {
                let bit = _mm256_add_epi32(start, _mm256_set1_epi32(base as i32));
                // SAFETY: every byte read is below `codes.len()` (`vectors_within`).
                let word = unsafe {
                    _mm256_i32gather_epi32::<1>(
                        codes.as_ptr() as *const i32,
                        _mm256_srli_epi32::<3>(bit),
                    )
                };
                *w = [word, _mm256_and_si256(bit, seven)];
            }
            let mut j0 = 0;
            while j0 < d {
                let w = (d - j0).min(8);
                for (k, col) in cols.iter_mut().enumerate().take(w) {
                    let c = comps[j0 + k];
                    if let Kind::Fixed(v) = c.kind {
                        *col = _mm256_set1_ps(v);
                        continue;
                    }
                    let [word, sh] = words[c.word];
                    let shift = _mm256_add_epi32(sh, _mm256_set1_epi32(c.rel as i32));
                    let code = _mm256_and_si256(
                        _mm256_srlv_epi32(word, shift),
                        _mm256_set1_epi32(c.mask as i32),
                    );
                    *col = match c.kind {
                        Kind::Permute(i) => _mm256_permutevar8x32_ps(load8(&tables[i]), code),
                        Kind::Permute2(i) => {
                            let lo = _mm256_permutevar8x32_ps(load8(&tables[i]), code);
                            let hi = _mm256_permutevar8x32_ps(load8(&tables[i + 1]), code);
                            let high = _mm256_castsi256_ps(_mm256_slli_epi32::<28>(code));
                            _mm256_blendv_ps(lo, hi, high)
                        }
                        // SAFETY: codes are below 2^b, and the component has 2^b values.
                        Kind::Gather(off) => unsafe {
                            _mm256_i32gather_ps::<4>(values.as_ptr().add(off), code)
                        },
                        Kind::Fixed(_) => unreachable!("handled above"),
                    };
                }
                let rows = transpose(cols);
                for (r, row) in rows.iter().enumerate() {
                    let at = (t0 + r) * d + j0;
                    if w == 8 {
                        // SAFETY: `at + 8 <= m d <= out.len()`.
                        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(at), *row) };
                    } else {
                        let mut lane = [0.0f32; 8];
                        // SAFETY: `lane` holds 8 floats.
                        unsafe { _mm256_storeu_ps(lane.as_mut_ptr(), *row) };
                        out[at..at + w].copy_from_slice(&lane[..w]);
                    }
                }
                j0 += 8;
            }
            t0 += 8;
        }
    }
}

#[target_feature(enable = "avx")]
#[inline]
pub(super) fn load8(t: &[f32; 8]) -> __m256 {
    // SAFETY: an `[f32; 8]` is 8 readable floats.
    #[allow(unsafe_code)]
    unsafe {
        _mm256_loadu_ps(t.as_ptr())
    }
}

/// Rows of the 8 x 8 matrix whose columns are `c`.
#[target_feature(enable = "avx")]
#[inline]
fn transpose(c: [__m256; 8]) -> [__m256; 8] {
    {
        let t0 = _mm256_unpacklo_ps(c[0], c[1]);
        let t1 = _mm256_unpackhi_ps(c[0], c[1]);
        let t2 = _mm256_unpacklo_ps(c[2], c[3]);
        let t3 = _mm256_unpackhi_ps(c[2], c[3]);
        let t4 = _mm256_unpacklo_ps(c[4], c[5]);
        let t5 = _mm256_unpackhi_ps(c[4], c[5]);
        let t6 = _mm256_unpacklo_ps(c[6], c[7]);
        let t7 = _mm256_unpackhi_ps(c[6], c[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ]
    }
}
