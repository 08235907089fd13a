//! Decoding a water-filled block straight from its packed code stream.
//!
//! Every vector stores its codes in the same layout: component `j`'s `b_j`-bit code at bit
//! `o_j = sum_{k<j} b_k` of the vector's run, and vector `i`'s run at bit `i P` of the
//! block's stream (`P = sum_j b_j`, LSB first). So a block is decoded by a small *program*,
//! built once from `b_j` and `s_j`, and run on each vector:
//! - a **lane** covers 1 to [`LANE_VALUES`] consecutive components whose codes together
//!   take at most [`JOINT_BITS`] bits (or one component of any width, with any zero-width
//!   components after it). Its table has one entry per joint code, and each entry holds the
//!   lane's output values with the mean, `s_j` and the gain folded in: decoding a lane is
//!   one shift, one mask, one 16-byte load and one 16-byte store.
//! - lanes go [`CHUNK_LANES`] to a **chunk**: seven lanes of at most 8 bits take at most
//!   56 bits, so one unaligned 64-bit peek at the chunk's first byte (shift <= 7) holds
//!   all of their codes.
//!
//! A lane always stores [`LANE_VALUES`] values; the next lane of the row overwrites the
//! unused ones. Past the row's last lane (and from the lanes that pad the last chunk) up
//! to `LANE_VALUES` values spill beyond the row: into the next row, decoded afterwards, or
//! for the last rows into a scratch row. Each row is decoded through a window of a fixed
//! (power-of-two) length, so that the stores need no bounds checks. Every value written
//! is a copy of a per-component value `m_j + Q^-1(q) s_j g`, computed exactly as the
//! direct formula does, so the output is bit-identical to it.
//!
//! On a CPU with AVX2 the program decodes only blocks the gather decoder cannot take
//! (`gather.rs`, eight vectors per component at once, which decodes the same values bit for
//! bit); it takes a block whole, its last vectors from a zero-padded copy of their codes.
//!
//! Nothing here trusts the block: the tables cover every code a width can hold, the
//! stream's length is checked against `n P`, a peek past its end reads zeros, and each
//! component's values and each outlier are checked finite before use.

use std::cell::RefCell;

use half::f16;

use super::books::{book, ip_gain, MAX_COMPONENT_BITS};
#[cfg(target_arch = "x86_64")]
use super::{gather, sums};
use crate::bitpack::peek_u64;
use crate::error::{Error, Result};
use crate::params::Metric;

/// Output values one lane stores (one 16-byte entry; the table build below spells out
/// all four).
const LANE_VALUES: usize = 4;
/// Lanes read from one 64-bit peek (7 lanes x 8 bits + a shift of up to 7 < 64).
const CHUNK_LANES: usize = 7;
/// Widest joint code of a lane of several coded components (64 entries, 1 KiB).
const JOINT_BITS: u32 = 6;
/// Blocks with fewer vectors than this join only zero-width components: their tables
/// would cost more to build than the vectors to decode.
const JOINT_MIN_VECTORS: usize = 32;

/// A water-filled block body as read from the wire: the side values decoded, the codes
/// left packed. [`decode_into`] reads each code straight from the packed stream.
#[derive(Debug, Clone, PartialEq)]
pub struct WaterfillCodes<'a> {
    /// Per-component scale `s_j` (finite, >= 0).
    pub sigma: Vec<f16>,
    /// Bits per component `b_j`, 0..=8.
    pub comp_bits: Vec<u8>,
    /// The packed code stream of the block: `n x sum_j b_j` bits, zero-padded to a byte
    /// (the reader has checked its length and its padding).
    pub codes: &'a [u8],
    /// `(position i * d_eff + j, value)` of exactly stored scaled coefficients, ascending,
    /// every position below `n * d_eff`.
    pub outliers: Vec<(u32, f16)>,
}

/// One lane of a chunk: where its joint code sits and where its values go.
#[derive(Debug, Clone, Copy, Default)]
struct Lane {
    /// Bit offset of the joint code within the chunk's peek.
    rel: u32,
    /// `2^width - 1`.
    mask: u32,
    /// First entry of the lane's table.
    table: u32,
    /// First component of the lane (its output offset within the row).
    out: u32,
}

/// [`CHUNK_LANES`] lanes read from one peek at bit `bit` of the vector's run.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    bit: u32,
    lanes: [Lane; CHUNK_LANES],
}

/// The per-block decoding program.
struct Program {
    chunks: Vec<Chunk>,
    table: Vec<[f32; LANE_VALUES]>,
    /// Bits per vector, `P`.
    per_vector: usize,
}

impl Program {
    /// Builds the program; `values[offsets[j]..][..2^b_j]` are component `j`'s outputs
    /// by code.
    fn new(bits: &[u8], joint_bits: u32, values: &[f32], offsets: &[usize]) -> Program {
        let d = bits.len();
        // Entry 0 is all zeros: the padding lanes of the last chunk read it.
        let mut table = vec![[0.0f32; LANE_VALUES]];
        let mut lanes = Vec::with_capacity(d);
        let (mut j, mut bit) = (0usize, 0u32);
        while j < d {
            let (mut count, mut width) = (1usize, bits[j] as u32);
            while count < LANE_VALUES && j + count < d {
                let b = bits[j + count] as u32;
                if b > 0 && width + b > joint_bits {
                    break;
                }
                width += b;
                count += 1;
            }
            lanes.push(Lane {
                rel: bit,
                mask: (1u32 << width) - 1,
                table: table.len() as u32,
                out: j as u32,
            });
            // Entry `code` holds, in slot k, component j + k's value for its bits of
            // `code` (the first component's bits lowest): an odometer over the
            // components' values, the first one fastest. Unused slots hold 0.
            let vals = |k: usize| -> &[f32] {
                if k < count {
                    &values[offsets[j + k]..][..1 << bits[j + k]]
                } else {
                    &[0.0]
                }
            };
            table.reserve(1 << width);
            for &v3 in vals(3) {
                for &v2 in vals(2) {
                    for &v1 in vals(1) {
                        table.extend(vals(0).iter().map(|&v0| [v0, v1, v2, v3]));
                    }
                }
            }
            bit += width;
            j += count;
        }
        let pad = Lane {
            out: d as u32,
            ..Lane::default()
        };
        let chunks = lanes
            .chunks(CHUNK_LANES)
            .map(|group| {
                let start = group[0].rel;
                let mut lanes = [pad; CHUNK_LANES];
                for (l, g) in lanes.iter_mut().zip(group) {
                    *l = Lane {
                        rel: g.rel - start,
                        ..*g
                    };
                }
                Chunk { bit: start, lanes }
            })
            .collect();
        Program {
            chunks,
            table,
            per_vector: bit as usize,
        }
    }

    /// Decodes `n` vectors of `d` values into `out` (`n x d`), with the window length
    /// picked for `d` (`P`: the power of two above `d`, `d <= 8191`).
    fn run_rows(&self, codes: &[u8], n: usize, d: usize, out: &mut [f32]) -> Result<()> {
        macro_rules! by_width {
            ($($p:literal)*) => {
                match (d + 1).next_power_of_two().max(4) {
                    $($p => self.rows::<{ 2 * $p }>(codes, n, d, out),)*
                    _ => return Err(Error::Format(format!("d_eff {d} beyond the limit"))),
                }
            };
        }
        by_width!(4 8 16 32 64 128 256 512 1024 2048 4096 8192);
        Ok(())
    }

    /// [`Program::run_rows`] through windows of `W = 2P` values: each row is decoded in
    /// place in a window that starts at the row (the spill past the row lands in the rows
    /// after it, decoded later); the last rows, without `W` values left, go through a
    /// scratch window.
    fn rows<const W: usize>(&self, codes: &[u8], n: usize, d: usize, out: &mut [f32]) {
        let mut scratch = Vec::new();
        for i in 0..n {
            let (at, start) = (i * d, i * self.per_vector);
            let window = out.get_mut(at..at.saturating_add(W));
            match window.and_then(|w| <&mut [f32; W]>::try_from(w).ok()) {
                Some(w) => self.run(codes, start, w),
                None => {
                    scratch.resize(W, 0.0);
                    let w = <&mut [f32; W]>::try_from(&mut scratch[..]).expect("W values");
                    self.run(codes, start, w);
                    out[at..at + d].copy_from_slice(&w[..d]);
                }
            }
        }
    }

    /// Decodes the vector whose run starts at bit `start` into `row[..d]`, and up to
    /// [`LANE_VALUES`] values of spill after it. Lane offsets are at most `d < W/2`, so
    /// masking them with `W/2 - 1` changes nothing and bounds every store (the compiler
    /// drops the check).
    #[inline(always)]
    fn run<const W: usize>(&self, codes: &[u8], start: usize, row: &mut [f32; W]) {
        for ch in &self.chunks {
            let p = start + ch.bit as usize;
            let word = peek_u64(codes, p >> 3) >> (p & 7);
            for l in &ch.lanes {
                let code = (word >> l.rel) as u32 & l.mask;
                let entry = &self.table[(l.table + code) as usize];
                let o = l.out as usize & (W / 2 - 1);
                row[o..o + LANE_VALUES].copy_from_slice(entry);
            }
        }
    }
}

/// Decodes `n` vectors of `d_eff` values into `out` (`n x d_eff`).
///
/// With `mean = Some(m)` (the identity basis, `d_eff = D`) the output is the reconstruction
/// `m_j + c_hat_j`; with `None` it is the coefficients `c_hat_j` (for a basis to map back).
/// The values are bit-identical to computing `c_hat_j = Q^-1(q_j) s_j g` (0 for `b_j = 0`,
/// `s_j` times the stored value for an outlier) and then adding `m_j`.
///
/// Every output value is a table value or an outlier value, and both are checked here, so
/// success guarantees finite output; non-finite values are an `Error::Format`, and so are
/// sections that disagree with `n` and `d_eff`.
pub fn decode_into(
    b: &WaterfillCodes<'_>,
    n: usize,
    d_eff: usize,
    metric: Metric,
    mean: Option<&[f32]>,
    out: &mut [f32],
) -> Result<()> {
    check_shape(b, d_eff, mean)?;
    let fold = |j: usize, c: f32| mean.map_or(c, |m| m[j] + c);
    with_scratch(|s| {
        component_values(b, metric, fold, &mut s.values, &mut s.offsets)?;
        outlier_values(b, d_eff, fold, &mut s.outliers)?;
        let tables = (&s.values[..], &s.offsets[..]);
        decode_tables(b, n, d_eff, tables, &s.outliers, out, &mut s.buffers)
    })
}

/// [`decode_into`] with each value mapped as it is written: `choose(lo, hi, outliers)` gets
/// each component's smallest and largest table value (every code of its width) and the
/// block's outliers (position in the `n x d_eff` output, value): every value the block can
/// decode to. Then `map(&chosen, j, values)` rewrites component `j`'s
/// values in place (its table, then each outlier alone) before any vector is decoded. So the
/// rows cost what they cost unmapped. Every mapped value must be finite (checked: an
/// `Error::Format` otherwise). Returns what `choose` chose.
#[allow(clippy::too_many_arguments)]
pub fn decode_mapped<C>(
    b: &WaterfillCodes<'_>,
    n: usize,
    d_eff: usize,
    metric: Metric,
    mean: Option<&[f32]>,
    choose: impl FnOnce(&[f32], &[f32], &[(usize, f32)]) -> C,
    map: impl Fn(&C, usize, &mut [f32]),
    out: &mut [f32],
) -> Result<C> {
    check_shape(b, d_eff, mean)?;
    let fold = |j: usize, c: f32| mean.map_or(c, |m| m[j] + c);
    with_scratch(|s| {
        let Scratch {
            values,
            offsets,
            outliers,
            lo,
            hi,
            buffers,
        } = s;
        component_values(b, metric, fold, values, offsets)?;
        outlier_values(b, d_eff, fold, outliers)?;
        let total = values.len();
        let table = |j: usize| offsets[j]..offsets.get(j + 1).copied().unwrap_or(total);
        // A table is `m_j + l s_j g` over a codebook's ascending levels with `s_j >= 0` (the
        // reader's bound), so it is monotone: its ends are its extremes.
        lo.clear();
        hi.clear();
        for j in 0..d_eff {
            let t = &values[table(j)];
            let (a, b) = (t[0], t[t.len() - 1]);
            lo.push(a.min(b));
            hi.push(a.max(b));
        }
        let chosen = choose(lo, hi, outliers);
        for j in 0..d_eff {
            let t = table(j);
            map(&chosen, j, &mut values[t]);
        }
        for (pos, v) in outliers.iter_mut() {
            map(&chosen, *pos % d_eff, std::slice::from_mut(v));
        }
        if !all_finite(values) || !outliers.iter().all(|(_, v)| v.is_finite()) {
            return Err(not_finite());
        }
        decode_tables(b, n, d_eff, (values, offsets), outliers, out, buffers)?;
        Ok(chosen)
    })
}

/// Most query rows [`weighted_sums`] takes on this CPU (more are cheaper decoded once and then
/// summed): 0 where it does not run (no x86-64 with AVX2 and FMA), so callers can decline a
/// block before parsing it.
pub fn weighted_sums_rows() -> usize {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        return sums::MAX_ROWS;
    }
    0
}

/// The weighted sums `out[r, j] = sum_t w[r, t] y[t, j]` of the block's vectors `y` as
/// [`decode_into`] decodes them (with `mean`), for `rows` rows of weights, row `r`'s at
/// `weights[r * stride..][..n]`, read straight from the codes: no decoded vector is written
/// (`sums.rs`). They agree with decoding and then summing to float32 rounding (the terms are
/// added in another order). `Ok(false)`, with `out` untouched, where this CPU has no AVX2 and
/// FMA or `rows` is 0 or above [`weighted_sums_rows`]: the caller decodes instead. Checks
/// the block as [`decode_into`] does.
pub fn weighted_sums(
    b: &WaterfillCodes<'_>,
    n: usize,
    d_eff: usize,
    metric: Metric,
    mean: Option<&[f32]>,
    (weights, stride, rows): (&[f32], usize, usize),
    out: &mut [f32],
) -> Result<bool> {
    check_shape(b, d_eff, mean)?;
    let end = |r: usize| r.checked_mul(stride).and_then(|x| x.checked_add(n));
    let fits = rows == 0 || end(rows - 1).is_some_and(|e| e <= weights.len());
    if Some(out.len()) != rows.checked_mul(d_eff) || !fits || (rows > 1 && stride < n) {
        return Err(Error::Shape(format!(
            "weighted sums of {n} vectors by {rows} rows: {} weights with stride {stride} and \
             {} outputs for {d_eff} values per row",
            weights.len(),
            out.len()
        )));
    }
    #[cfg(target_arch = "x86_64")]
    if (1..=weighted_sums_rows()).contains(&rows) {
        let fold = |j: usize, c: f32| mean.map_or(c, |m| m[j] + c);
        return with_scratch(|s| {
            component_values(b, metric, fold, &mut s.values, &mut s.offsets)?;
            outlier_values(b, d_eff, fold, &mut s.outliers)?;
            let per_vector = check_stream(b, n)?;
            if s.outliers.iter().any(|&(pos, _)| pos >= n * d_eff) {
                return Err(Error::Format("outlier position out of range".into()));
            }
            let RowBuffers {
                tail, plan, sums, ..
            } = &mut s.buffers;
            if !plan.build(&b.comp_bits, &s.values, &s.offsets, n, per_vector) {
                return Ok(false);
            }
            let Some((m, groups)) = split_tail(plan, b, (n, per_vector), tail) else {
                return Ok(false);
            };
            let runs = sums::CodeRuns {
                codes: b.codes,
                groups: m / 8,
                tail,
                tail_groups: groups / 8,
            };
            let w = sums::Weights {
                weights,
                stride,
                rows,
                n,
            };
            #[allow(unsafe_code)]
            // SAFETY: AVX2 and FMA were just found; the plan was built from these values for
            // these codes, `m` is from `vectors_within` on them and the tail's groups on the
            // padded copy; the rows and lengths were checked above.
            unsafe {
                sums::sums(plan, &runs, &s.values, &w, sums, out)
            };
            // Each outlier replaces the value its code decodes to.
            for &(pos, v) in s.outliers.iter() {
                let (t, j) = (pos / d_eff, pos % d_eff);
                let code = sums.code(plan, j, t);
                let delta = v - s.values[s.offsets[j] + code];
                for r in 0..rows {
                    let o = &mut out[r * d_eff + j];
                    *o = weights[r * stride + t].mul_add(delta, *o);
                }
            }
            Ok(true)
        });
    }
    let _ = (metric, weights);
    Ok(false)
}

/// The code stream's bits per vector, checked against its length for `n` vectors.
fn check_stream(b: &WaterfillCodes<'_>, n: usize) -> Result<usize> {
    let per_vector: usize = b.comp_bits.iter().map(|&v| v as usize).sum();
    if n.checked_mul(per_vector).map(|t| t.div_ceil(8)) != Some(b.codes.len()) {
        return Err(Error::Format(
            "water-filled code stream has the wrong length".into(),
        ));
    }
    Ok(per_vector)
}

/// Splits the block's `n` vectors for the gather plan: the first `m` (a multiple of 8) are
/// read in place, their gathers within the stream; the rest, whose gathers would read past
/// it, go from a zero-padded copy of their codes in `tail` (vector `m` starts on a byte), in
/// whole groups of 8. Returns `(m, vectors in tail's groups)`, or None where the padding does
/// not cover the tail's gathers (not reached: it is sized for them).
#[cfg(target_arch = "x86_64")]
fn split_tail(
    plan: &gather::Plan,
    b: &WaterfillCodes<'_>,
    (n, per_vector): (usize, usize),
    tail: &mut Vec<u8>,
) -> Option<(usize, usize)> {
    let m = plan.vectors_within(b.codes.len(), n);
    let groups = (n - m).div_ceil(8) * 8;
    let codes = &b.codes[m * per_vector / 8..];
    tail.clear();
    tail.extend_from_slice(codes);
    tail.resize(codes.len().max((groups * per_vector).div_ceil(8) + 4), 0);
    (plan.vectors_within(tail.len(), groups) == groups).then_some((m, groups))
}

/// A thread's buffers for decoding a block, kept between blocks: fresh ones per block were
/// several allocations above glibc's per-thread cache (a block's tables alone are about
/// 12 KB), whose freed chunks `malloc` then sorted: most of the allocator's share of a decode
/// step (`docs/performance.md`).
#[derive(Default)]
struct Scratch {
    /// Every component's output per code ([`component_values`]), and where each starts.
    values: Vec<f32>,
    offsets: Vec<usize>,
    /// The block's outliers ([`outlier_values`]).
    outliers: Vec<(usize, f32)>,
    /// Each component's extremes ([`decode_mapped`]).
    lo: Vec<f32>,
    hi: Vec<f32>,
    buffers: RowBuffers,
}

/// What [`decode_tables`] decodes the vectors with (the AVX2 decoder's: unused elsewhere).
#[derive(Default)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct RowBuffers {
    /// The last vectors' codes, zero-padded, and their rows ([`gather_rows`]).
    tail: Vec<u8>,
    rows: Vec<f32>,
    #[cfg(target_arch = "x86_64")]
    plan: gather::Plan,
    #[cfg(target_arch = "x86_64")]
    sums: sums::SumsBuffers,
}

/// A scratch kept past a block only while it is at most this many bytes (a hostile block's
/// tables can take megabytes).
const SCRATCH_KEPT: usize = 1 << 20;

impl Scratch {
    /// Its vectors' bytes (the gather plan's aside: they are bounded by the head dimension).
    fn bytes(&self) -> usize {
        let r = &self.buffers;
        #[cfg(target_arch = "x86_64")]
        let sums = r.sums.bytes();
        #[cfg(not(target_arch = "x86_64"))]
        let sums = 0;
        4 * (self.values.capacity() + self.lo.capacity() + self.hi.capacity() + r.rows.capacity())
            + 8 * self.offsets.capacity()
            + 16 * self.outliers.capacity()
            + r.tail.capacity()
            + sums
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// `f` with this thread's [`Scratch`] (a fresh one where it is in use: `choose` or `map` of
/// [`decode_mapped`] decoding another block).
fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut s) => {
            let r = f(&mut s);
            if s.bytes() > SCRATCH_KEPT {
                *s = Scratch::default();
            }
            r
        }
        Err(_) => f(&mut Scratch::default()),
    })
}

/// Whether every value is finite, with no exit per value (a block's tables hold thousands).
fn all_finite(values: &[f32]) -> bool {
    // A finite value's bits below the sign are below infinity's.
    let widest = values
        .iter()
        .fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
    widest < f32::INFINITY.to_bits()
}

/// Checks the block's side sections against `d_eff` and the mean's length.
fn check_shape(b: &WaterfillCodes<'_>, d_eff: usize, mean: Option<&[f32]>) -> Result<()> {
    let shape_ok = d_eff > 0
        && b.sigma.len() == d_eff
        && b.comp_bits.len() == d_eff
        && mean.is_none_or(|m| m.len() == d_eff);
    if !shape_ok || b.comp_bits.iter().any(|&v| v > MAX_COMPONENT_BITS) {
        return Err(Error::Format(
            "water-filled block sections disagree with its shape".into(),
        ));
    }
    Ok(())
}

/// Each outlier's position and value, `fold(j, stored value s_j)`, checked finite, into `out`.
fn outlier_values(
    b: &WaterfillCodes<'_>,
    d_eff: usize,
    fold: impl Fn(usize, f32) -> f32,
    out: &mut Vec<(usize, f32)>,
) -> Result<()> {
    out.clear();
    for &(pos, val) in &b.outliers {
        let (pos, j) = (pos as usize, pos as usize % d_eff);
        let v = fold(j, val.to_f32() * b.sigma[j].to_f32());
        if !v.is_finite() {
            return Err(not_finite());
        }
        out.push((pos, v));
    }
    Ok(())
}

/// The block's vectors from its components' tables (`values` from `offsets[j]` on: one
/// value per code), then its outliers' values over theirs.
fn decode_tables(
    b: &WaterfillCodes<'_>,
    n: usize,
    d_eff: usize,
    (values, offsets): (&[f32], &[usize]),
    outliers: &[(usize, f32)],
    out: &mut [f32],
    buffers: &mut RowBuffers,
) -> Result<()> {
    if out.len() != n * d_eff {
        return Err(Error::Format(
            "water-filled block sections disagree with its shape".into(),
        ));
    }
    let per_vector = check_stream(b, n)?;
    if !gather_rows(b, (n, per_vector), (values, offsets), out, buffers) {
        let joint = if n >= JOINT_MIN_VECTORS {
            JOINT_BITS
        } else {
            0
        };
        let prog = Program::new(&b.comp_bits, joint, values, offsets);
        prog.run_rows(b.codes, n, d_eff, out)?;
    }
    for &(pos, v) in outliers {
        match out.get_mut(pos) {
            Some(o) => *o = v,
            None => return Err(Error::Format("outlier position out of range".into())),
        }
    }
    Ok(())
}

/// Per component, its output for each code, `fold(j, l s_j g)` (`fold(j, 0)` without bits),
/// all in `values`, and where each component's values start in it (`offsets`). Fails on a
/// value that is not finite.
fn component_values(
    b: &WaterfillCodes<'_>,
    metric: Metric,
    fold: impl Fn(usize, f32) -> f32,
    values: &mut Vec<f32>,
    offsets: &mut Vec<usize>,
) -> Result<()> {
    values.clear();
    offsets.clear();
    // Sized up front: grown level by level, it was reallocated several times per block.
    values.reserve(b.comp_bits.iter().map(|&v| 1usize << v).sum());
    for (j, (&bits, s)) in b.comp_bits.iter().zip(&b.sigma).enumerate() {
        offsets.push(values.len());
        if bits == 0 {
            values.push(fold(j, 0.0));
        } else {
            let (s, g) = (s.to_f32(), gain(metric, bits));
            values.extend(book(bits).levels().iter().map(|&l| fold(j, l * s * g)));
        }
    }
    if !all_finite(values) {
        return Err(not_finite());
    }
    Ok(())
}

/// Decodes the block's vectors (`(n, per_vector)`: its vectors and the bits of each) with the
/// AVX2 gather decoder (`gather.rs`) where this CPU has AVX2, and returns whether it did (all
/// of them; none elsewhere).
fn gather_rows(
    b: &WaterfillCodes<'_>,
    (n, per_vector): (usize, usize),
    (values, offsets): (&[f32], &[usize]),
    out: &mut [f32],
    buffers: &mut RowBuffers,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        let RowBuffers {
            tail, rows, plan, ..
        } = buffers;
        if plan.build(&b.comp_bits, values, offsets, n, per_vector) {
            let d = b.comp_bits.len();
            // The last vectors go from the padded tail, whole groups of 8 into a scratch of rows.
            let Some((m, groups)) = split_tail(plan, b, (n, per_vector), tail) else {
                return false;
            };
            let rest = n - m;
            #[allow(unsafe_code)]
            // SAFETY: AVX2 was just found; `m` is from `vectors_within` on these codes and
            // `groups` on `tail`, `out` holds `n x d` values, `rows` `groups x d`, and
            // `values` built the plan.
            unsafe {
                plan.rows(b.codes, values, m, out);
                if rest > 0 {
                    rows.resize(groups * d, 0.0);
                    plan.rows(tail, values, groups, rows);
                    out[m * d..].copy_from_slice(&rows[..rest * d]);
                }
            }
            return true;
        }
    }
    let _ = (b, n, per_vector, values, offsets, out, buffers);
    false
}

/// The decoding gain of a `bits`-bit component under `metric`.
fn gain(metric: Metric, bits: u8) -> f32 {
    if metric == Metric::InnerProduct {
        ip_gain(bits)
    } else {
        1.0
    }
}

fn not_finite() -> Error {
    Error::Format("decoded values are not finite".into())
}

#[cfg(test)]
mod tests;
