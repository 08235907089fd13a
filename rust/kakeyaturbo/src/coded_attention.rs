//! Attention arithmetic over coded blocks, without a decoded copy of the layer.
//!
//! `KakeyaCache`'s attention (`python/kakeyaturbo/hf/coded_attention.py`) needs, per layer
//! and step, the logits of the queries against the coded keys and the attention-weighted sum
//! of the coded values. Decoding every block into one array and finishing in torch writes the
//! whole decoded layer to memory and reads it back once per pass (frame product, RoPE, logits;
//! norms, weighted sum). These kernels decode one block at a time into a scratch buffer that
//! stays in cache and finish the arithmetic there, blocks in parallel:
//!
//! - [`key_logits`]: `logit[s, j, t] = q[s, j] . rope_t(y_t M_h) * scale_t`: decode, frame
//!   product (one `[D, D]` matrix per head), RoPE on channel pairs `(i, i + pairs)` (the
//!   "rotate half" layout, so it runs over contiguous halves), a dot with every query row.
//! - [`value_sums`]: `out[s, j] = sum_t w[s, j, t] scale_t y_t`, still in frame coordinates
//!   (the caller applies the frame once per query row).
//!
//! `scale_t = norm_t / |y_t|` when the stream stores token norms (the decoded vector is a unit
//! direction whose length the quantiser shrank), 1 otherwise. Streams are stream-major lists of
//! encoded blocks ([`CodedStreams`]); stream `s` is row `s / heads`, head `s % heads`.
//!
//! The products are written so the compiler vectorises them (independent lanes, no float
//! reassociation needed) and are compiled twice: for the baseline target (SSE2 on x86-64,
//! what a portable wheel is built for) and, picked at run time, with AVX and FMA, whose dot
//! product is written with AVX intrinsics (the compiler's own was two lanes wide).

use std::cell::RefCell;

use crate::codec::{decode_layer_into, decode_layer_mapped, EncodedLayer};
use crate::error::{Error, Result};
use crate::parallel;

mod attend;
mod bf16;
mod int16;
mod norms;
mod prepared;

pub use attend::{attend, Attend, ExactPiece, Joint, Lanes};
pub use norms::{decode_codes as decode_norm_codes, Norms};
use prepared::BlockKeys;
pub use prepared::PreparedKeys;

/// Smallest `|y_t|` a token-norm scale divides by (as the Python path clamps it).
const MIN_NORM: f32 = 1e-12;

/// The arithmetic of [`key_logits`]' frame product, its costliest part.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// float32 products and sums.
    #[default]
    F32,
    /// The coordinates less their block mean, and the frame, rounded to bfloat16 (to nearest
    /// even); the mean's product and all sums in float32: twice the rate where the CPU
    /// multiplies bfloat16 pairs natively (AVX512-BF16) and the head dim is a multiple of 16;
    /// float32 everywhere else (`bf16.rs`, [`bf16_products`]).
    Bf16,
    /// The coordinates less their block mean, and the frame, as 16-bit integers with scales
    /// per block (11-13 bits of each), exact int32 sums, the mean's product in float32: twice
    /// the float32 rate where the CPU has AVX512-VNNI, the same bits with AVX2 (about 1.55x
    /// the float32 peak on a Zen 3), where the head dim is a multiple of 16; float32 elsewhere
    /// (`int16.rs`, [`int16_products`]).
    I16,
}

/// Whether [`Precision::Bf16`] multiplies in bfloat16 on this CPU for head dim `d` (else it
/// runs the float32 product).
pub fn bf16_products(d: usize) -> bool {
    bf16::available() && bf16::fits(d)
}

/// Whether [`Precision::I16`] multiplies in 16-bit integers on this CPU for head dim `d` (else
/// it runs the float32 product).
pub fn int16_products(d: usize) -> bool {
    int16::available() && int16::fits(d)
}

/// How one block's frame product runs ([`Precision`] as this CPU takes it).
#[derive(Clone, Copy)]
enum Product<'a> {
    F32,
    /// The frame as bfloat16 pairs ([`bf16::pack_pairs`]).
    Bf16(&'a [u32]),
    I16,
}

/// Coded streams as the kernels take them: `streams` streams one after the other, each
/// stream's blocks in token order, every stream with the same block lengths and head dim.
pub struct CodedStreams<'a> {
    encs: &'a [&'a EncodedLayer],
    streams: usize,
    /// Token offset of each block within its stream (`blocks + 1` entries).
    offsets: Vec<usize>,
    d: usize,
}

impl<'a> CodedStreams<'a> {
    /// Checks the layout: a non-empty whole number of blocks per stream, equal block lengths
    /// across streams, one head dim, no external basis.
    pub fn new(encs: &'a [&'a EncodedLayer], streams: usize) -> Result<Self> {
        if streams == 0 || encs.is_empty() || !encs.len().is_multiple_of(streams) {
            return Err(Error::Shape(format!(
                "{} blocks do not split into {streams} streams",
                encs.len()
            )));
        }
        let blocks = encs.len() / streams;
        let d = encs[0].shape().1;
        let mut offsets = Vec::with_capacity(blocks + 1);
        offsets.push(0);
        for e in &encs[..blocks] {
            offsets.push(offsets[offsets.len() - 1] + e.shape().0);
        }
        for (i, e) in encs.iter().enumerate() {
            let (n, di) = e.shape();
            let b = i % blocks;
            if di != d || n != offsets[b + 1] - offsets[b] {
                return Err(Error::Shape(format!(
                    "block {b} of stream {} is {n} x {di}, stream 0's is {} x {d}: streams must \
                     have equal blocks",
                    i / blocks,
                    offsets[b + 1] - offsets[b]
                )));
            }
            if e.external_fingerprint().is_some() {
                return Err(Error::InvalidParams(
                    "a block uses an external basis, which attention over codes does not take"
                        .into(),
                ));
            }
        }
        Ok(Self {
            encs,
            streams,
            offsets,
            d,
        })
    }

    /// Tokens per stream.
    pub fn tokens(&self) -> usize {
        self.offsets[self.offsets.len() - 1]
    }

    /// Head dim.
    pub fn head_dim(&self) -> usize {
        self.d
    }

    /// Streams.
    pub fn streams(&self) -> usize {
        self.streams
    }

    fn blocks(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Runs `f(stream, block, decoded block, grid, its first token, out)` on every block in
    /// parallel, each writing its own `out` of `parts` (one per block, in (stream, block)
    /// order), where `ready(stream, block, out)` may fill a block's part without decoding it
    /// (keys prepared beforehand, value sums from the codes; Some with how that went); the
    /// others are decoded by `decode(i, scratch)` into a per-thread scratch buffer, which may
    /// return how (an int16 grid: [`Self::decode_keys`]).
    fn map_blocks_or(
        &self,
        parts: Vec<&mut [f32]>,
        ready: impl Fn(usize, usize, &mut [f32]) -> Option<Result<()>> + Sync,
        decode: impl Fn(usize, &mut Vec<f32>) -> Result<Option<int16::Grid>> + Sync,
        f: impl Fn(usize, usize, &[f32], Option<&int16::Grid>, usize, &mut [f32]) -> Result<()> + Sync,
    ) -> Result<()> {
        assert_eq!(parts.len(), self.encs.len(), "one part per block");
        let nb = self.blocks();
        let done = parallel::map_init_parts(parts, Decoded::lend, |scratch, i, out| {
            let (s, b) = (i / nb, i % nb);
            if let Some(r) = ready(s, b, out) {
                return r;
            }
            let grid = decode(i, &mut scratch.0)?;
            f(s, b, &scratch.0, grid.as_ref(), self.offsets[b], out)
        });
        done.into_iter().collect()
    }

    /// Each block's part of a buffer of `per_token` values per token of every stream
    /// (`[streams, tokens, per_token]`), in (stream, block) order: `out[i]` is block `i`'s
    /// `[n_i, per_token]`.
    fn token_parts<'o>(&self, buf: &'o mut [f32], per_token: usize) -> Vec<&'o mut [f32]> {
        let nb = self.blocks();
        let tokens = |b: usize| self.offsets[b + 1] - self.offsets[b];
        let lens = (0..self.streams * nb).map(|i| per_token * tokens(i % nb));
        parallel::split_parts(buf, lens)
    }

    /// Block `i` (stream-major) decoded into `scratch`.
    fn decode(&self, i: usize, scratch: &mut Vec<f32>) -> Result<()> {
        decode_layer_into(self.encs[i], None, self.sized(i, scratch))
    }

    /// Block `i` decoded into `scratch` for its keys: as int16 levels straight from its codes
    /// where `levels` and the block is in its own coordinates (the grid returned: no pass over
    /// its values to find their centres, spreads and levels), else as its values (None).
    fn decode_keys(
        &self,
        i: usize,
        scratch: &mut Vec<f32>,
        levels: bool,
    ) -> Result<Option<int16::Grid>> {
        if !levels {
            return self.decode(i, scratch).map(|()| None);
        }
        let (grid, level) = (int16::Grid::new, int16::Grid::level);
        decode_layer_mapped(self.encs[i], self.sized(i, scratch), grid, level)
    }

    /// `scratch` resized to block `i`'s `n x d` values (the callers read its whole length).
    fn sized<'s>(&self, i: usize, scratch: &'s mut Vec<f32>) -> &'s mut [f32] {
        let b = i % self.blocks();
        scratch.resize((self.offsets[b + 1] - self.offsets[b]) * self.d, 0.0);
        scratch
    }
}

/// A thread's buffer for decoded blocks, lent to a call's tasks on that thread and kept by
/// the thread that drops it: a fresh one per call was a 196 KB allocation, zeroed, twice per
/// layer and step.
struct Decoded(Vec<f32>);

thread_local! {
    static DECODED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

impl Decoded {
    fn lend() -> Self {
        Decoded(DECODED.take())
    }
}

impl Drop for Decoded {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        // The larger buffer stays (none while the thread is exiting).
        let _ = DECODED.try_with(|c| {
            if c.borrow().capacity() < v.capacity() {
                c.replace(v);
            }
        });
    }
}

/// `got` must be the product of `dims` (checked: a zero-sized array may declare dims whose
/// product overflows).
fn check_len(name: &str, got: usize, dims: &[usize], shape: &str) -> Result<()> {
    match dims.iter().try_fold(1usize, |p, &x| p.checked_mul(x)) {
        Some(want) if want == got => Ok(()),
        want => Err(Error::Shape(format!(
            "{name}: {got} values, expected {} ({shape} = {dims:?})",
            want.map_or("more than fit in memory".into(), |w| w.to_string())
        ))),
    }
}

/// Per-head frames `[heads, rows, cols]` (with `heads`) must split `streams` streams (or
/// heads) into equal groups and hold `heads` matrices of `rows x cols`.
fn check_frames(
    name: &str,
    frames: Option<(&[f32], usize)>,
    streams: usize,
    rows: usize,
    cols: usize,
) -> Result<()> {
    let Some((m, heads)) = frames else {
        return Ok(());
    };
    if heads == 0 || !streams.is_multiple_of(heads) {
        return Err(Error::Shape(format!(
            "{name}: {streams} streams do not group over {heads} heads"
        )));
    }
    check_len(
        name,
        m.len(),
        &[heads, rows, cols],
        "heads x coordinates x head_dim",
    )
}

/// Stream `s`'s frame (head `s % heads`), after [`check_frames`].
fn frame_of(frames: Option<(&[f32], usize)>, s: usize, d: usize) -> Option<&[f32]> {
    frames.map(|(m, heads)| &m[(s % heads) * d * d..][..d * d])
}

/// The RoPE rotation of [`key_logits`]: at every coded token the cosines, then the sines, of
/// the angles of channel pairs `(i, i + P)`, `[rows, tokens, 2, pairs]` (`rows` 1: shared
/// by every row), `P = pairs * repeats`: pair `i` turns by angle `i % pairs`. Keys coded
/// across heads lay every head's pairs side by side, each with the same angles, so the
/// table holds one head's (a third of the memory each key block reads with three heads).
pub struct RopeAngles<'a> {
    pub values: &'a [f32],
    pub rows: usize,
    pub pairs: usize,
    /// How many times the angles repeat across the channel pairs (at least 1).
    pub repeats: usize,
}

impl RopeAngles<'_> {
    /// Channel pairs turned: `pairs * repeats`.
    fn turned(&self) -> usize {
        self.pairs.saturating_mul(self.repeats)
    }
}

/// Logits `[streams, g, tokens]` of the queries `[streams, g, d]` against the coded keys:
/// `q[s, j] . rope_t(y_t M_h) * scale_t` with `M_h` the `h`-th of `frames` (`[heads, d, d]`,
/// `None`: the identity), RoPE turning channels `(i, i + pairs)` for `i < pairs` as complex
/// numbers, and `scale_t = norm_t / |y_t|` when `norms` is given. `precision`: the frame
/// product's arithmetic.
pub fn key_logits(
    coded: &CodedStreams<'_>,
    frames: Option<(&[f32], usize)>,
    rotation: Option<&RopeAngles<'_>>,
    norms: Option<&Norms<'_>>,
    queries: &[f32],
    g: usize,
    precision: Precision,
) -> Result<Vec<f32>> {
    let keys = KeyInputs {
        frames,
        rotation,
        precision,
    };
    logits_with(coded, &keys, norms, queries, g, None)
}

/// What makes a coded block's keys besides its codes: the frames, RoPE's rotation and the frame
/// product's arithmetic (as [`key_logits`] takes them).
#[derive(Clone, Copy)]
pub struct KeyInputs<'a> {
    pub frames: Option<(&'a [f32], usize)>,
    pub rotation: Option<&'a RopeAngles<'a>>,
    pub precision: Precision,
}

impl KeyInputs<'_> {
    /// Checks the frames and the rotation against `coded`.
    pub fn check(&self, coded: &CodedStreams<'_>) -> Result<()> {
        let (s_n, t_n, d) = (coded.streams, coded.tokens(), coded.d);
        check_frames("frames", self.frames, s_n, d, d)?;
        if let Some(r) = self.rotation {
            let bad_rows = r.rows == 0 || (r.rows != 1 && r.rows * (s_n / r.rows) != s_n);
            if r.repeats == 0 || r.turned() > d / 2 || bad_rows {
                return Err(Error::Shape(format!(
                    "rotation: {} rows of {} pairs repeated {} times for {s_n} streams of \
                     head dim {d}",
                    r.rows, r.pairs, r.repeats
                )));
            }
            check_len(
                "rotation",
                r.values.len(),
                &[r.rows, t_n, 2, r.pairs],
                "rows x tokens x 2 x pairs",
            )?;
        }
        Ok(())
    }

    /// The frame product's form on this CPU: the frames as bfloat16 pairs when they are
    /// multiplied so (once per call: a few microseconds for 192 x 192), or whether in int16.
    fn products(&self, d: usize) -> Products {
        Products {
            pairs: self
                .frames
                .filter(|_| self.precision == Precision::Bf16 && bf16_products(d))
                .map(|(m, heads)| (bf16::pack_pairs(m, d), heads)),
            int16: self.precision == Precision::I16 && int16_products(d),
        }
    }

    /// Whether blocks go to the int16 product as levels decoded straight from their codes
    /// ([`int16::Grid`]): where the frames are multiplied in int16 and nothing needs the
    /// decoded values themselves (`values_unneeded`: no token norms, which divide by `|y_t|`).
    fn levels(&self, products: &Products, values_unneeded: bool) -> bool {
        products.int16 && self.frames.is_some() && values_unneeded
    }

    /// Block `(s, b)`'s arguments of [`block_keys`]: its frame and RoPE's angles of its
    /// tokens.
    fn block<'p>(
        &'p self,
        coded: &CodedStreams<'_>,
        products: &'p Products,
        s: usize,
        b: usize,
    ) -> BlockInputs<'p> {
        let (s_n, t_n, d) = (coded.streams, coded.tokens(), coded.d);
        let (t0, n) = (coded.offsets[b], coded.offsets[b + 1] - coded.offsets[b]);
        let product = match &products.pairs {
            Some((p, heads)) => Product::Bf16(&p[(s % heads) * d * d / 2..][..d * d / 2]),
            None if products.int16 => Product::I16,
            None => Product::F32,
        };
        let rot = self.rotation.map(|r| {
            let row = if r.rows == 1 { 0 } else { s / (s_n / r.rows) };
            let w = 2 * r.pairs;
            (
                &r.values[(row * t_n + t0) * w..][..n * w],
                r.pairs,
                r.repeats,
            )
        });
        (frame_of(self.frames, s, d), product, rot)
    }
}

/// RoPE's angles of a block's tokens, `[n, 2, pairs]`, their pairs and repeats
/// ([`RopeAngles`]).
type BlockAngles<'a> = (&'a [f32], usize, usize);

/// One block's frame, how its product runs, and RoPE's angles of its tokens.
type BlockInputs<'a> = (Option<&'a [f32]>, Product<'a>, Option<BlockAngles<'a>>);

/// [`KeyInputs::products`].
struct Products {
    pairs: Option<(Vec<u32>, usize)>,
    int16: bool,
}

/// [`key_logits`], reading the blocks `prepared` holds (made with the same `keys`) instead of
/// decoding them.
pub(crate) fn logits_with(
    coded: &CodedStreams<'_>,
    keys: &KeyInputs<'_>,
    norms: Option<&Norms<'_>>,
    queries: &[f32],
    g: usize,
    prepared: Option<&PreparedKeys>,
) -> Result<Vec<f32>> {
    let (s_n, t_n, d) = (coded.streams, coded.tokens(), coded.d);
    check_len(
        "queries",
        queries.len(),
        &[s_n, g, d],
        "streams x rows x head_dim",
    )?;
    keys.check(coded)?;
    if let Some(nm) = norms {
        nm.check(coded)?;
    }
    if let Some(p) = prepared {
        p.check(coded)?;
    }
    let products = keys.products(d);
    let nb = coded.blocks();
    // The queries' non-zero 8-channel chunks, once per row rather than once per block.
    let chunks: Vec<Vec<usize>> = queries.chunks_exact(d).map(nonzero_chunks).collect();
    let rows = |s: usize| (&queries[s * g * d..][..g * d], &chunks[s * g..][..g]);
    let ready = |s: usize, b: usize, out: &mut [f32]| {
        let bk = prepared?.take(s * nb + b)?;
        if norms.is_some() && bk.lengths.len() != bk.tokens(d) {
            return None; // made without the lengths that norms need: made again here
        }
        Some((|| {
            let nm = norms.map(|nm| nm.block(coded, s, b)).transpose()?;
            run_prepared_logits((bk, d, nm.as_deref(), rows(s)), out);
            Ok(())
        })())
    };
    let levels = keys.levels(&products, norms.is_none());
    let decode = |i: usize, scratch: &mut Vec<f32>| coded.decode_keys(i, scratch, levels);
    // Each block's `[g, n]` logits, block after block, then rearranged into `[s, g, t]`.
    let mut parts = vec![0.0f32; s_n * g * t_n];
    let blocks = coded.token_parts(&mut parts, g);
    coded.map_blocks_or(blocks, ready, decode, |s, b, y, grid, _t0, out| {
        let (m, product, rot) = keys.block(coded, &products, s, b);
        let nm = norms.map(|nm| nm.block(coded, s, b)).transpose()?;
        let y = Coords::of(y, grid);
        run_block_logits((y, d, m, product, rot, nm.as_deref(), rows(s)), out);
        Ok(())
    })?;
    let mut logits = vec![0.0f32; s_n * g * t_n];
    for (i, part) in coded.token_parts(&mut parts, g).into_iter().enumerate() {
        let (s, b) = (i / nb, i % nb);
        let (t0, n) = (coded.offsets[b], part.len() / g.max(1));
        for j in 0..g {
            logits[(s * g + j) * t_n + t0..][..n].copy_from_slice(&part[j * n..][..n]);
        }
    }
    Ok(logits)
}

/// Weighted sums `[streams, g, d]` of the coded values, in frame coordinates:
/// `sum_t weights[s, j, t] * scale_t * y_t` with `scale_t = norm_t / |y_t|` when `norms` is
/// given. `weights` is `[streams, g, tokens]`.
pub fn value_sums(
    coded: &CodedStreams<'_>,
    weights: &[f32],
    norms: Option<&Norms<'_>>,
    g: usize,
) -> Result<Vec<f32>> {
    let (s_n, t_n, d) = (coded.streams, coded.tokens(), coded.d);
    check_len(
        "weights",
        weights.len(),
        &[s_n, g, t_n],
        "streams x rows x tokens",
    )?;
    if let Some(nm) = norms {
        nm.check(coded)?;
    }
    if g * d == 0 {
        return Ok(Vec::new());
    }
    // Each block's `[g, d]` sums (zeros on entry), block after block. Without token norms
    // (whose scales need each decoded vector's length) a decode step's few rows are summed
    // straight from the codes, with no decoded block written (`codec::layer_weighted_sums`).
    let mut parts = vec![0.0f32; coded.encs.len() * g * d];
    let blocks = parts.chunks_mut(g * d).collect();
    let nb = coded.blocks();
    let from_codes = |s: usize, b: usize, out: &mut [f32]| {
        if norms.is_some() {
            return None;
        }
        let w = &weights[s * g * t_n + coded.offsets[b]..];
        match crate::codec::layer_weighted_sums(coded.encs[s * nb + b], (w, t_n, g), out) {
            Ok(false) => None,
            done => Some(done.map(|_| ())),
        }
    };
    let decode = |i: usize, scratch: &mut Vec<f32>| coded.decode(i, scratch).map(|()| None);
    coded.map_blocks_or(blocks, from_codes, decode, |s, b, y, _, t0, out| {
        let w = &weights[s * g * t_n..][..g * t_n];
        let nm = norms.map(|nm| nm.block(coded, s, b)).transpose()?;
        run_block_sums((y, d, w, t_n, t0, nm.as_deref(), g), out);
        Ok(())
    })?;
    // Blocks add up in token order, so the result does not depend on the thread count.
    let mut sums = vec![0.0f32; s_n * g * d];
    for (i, part) in parts.chunks_exact(g * d).enumerate() {
        let acc = &mut sums[(i / nb) * g * d..][..g * d];
        acc.iter_mut().zip(part).for_each(|(a, p)| *a += p);
    }
    Ok(sums)
}

#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `y += a x`.
#[inline(always)]
fn axpy<const FMA: bool>(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = madd::<FMA>(a, x, *y);
    }
}

/// `a . b`. The baseline build sums 8 independent lanes (the compiler vectorises that only
/// two lanes wide: a float reduction is not reassociated), the FMA build is written with AVX
/// intrinsics.
#[inline(always)]
fn dot<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
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
fn frame_tile<const W: usize, const FMA: bool>(y: &[f32], m: &[f32], col: usize, out: &mut [f32]) {
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
fn times_frame<const FMA: bool>(y: &[f32], m: &[f32], out: &mut [f32]) {
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
struct BlockFrame<'m> {
    /// Indices of the varying coordinates.
    varying: Vec<usize>,
    /// `M` (`d x d`), whose varying rows the product reads in place: packing them per block
    /// copied 130 KB per block and step for a frame across three heads.
    m: &'m [f32],
    /// `sum` over the fixed coordinates `j` of `y_j M[j]`.
    fixed: Vec<f32>,
}

impl<'m> BlockFrame<'m> {
    #[inline(always)]
    fn new<const FMA: bool>(y: &[f32], d: usize, m: &'m [f32]) -> Self {
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
    fn product<const FMA: bool>(&self, y: &[f32], d: usize, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if FMA {
            return self.tiles::<AVX_TILE_TOKENS, FMA>(y, d, out);
        }
        // 4 x 16 in the portable build: wider tiles left the compiler's accumulators in memory.
        self.tiles::<4, FMA>(y, d, out)
    }

    /// [`Self::product`] in tiles of `R` tokens.
    #[inline(always)]
    fn tiles<const R: usize, const FMA: bool>(&self, y: &[f32], d: usize, out: &mut [f32]) {
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
    fn tile<const R: usize, const FMA: bool>(&self, ys: &[f32], out: &mut [f32]) {
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
                    columns_6x16_avx_fma(self, ys, col, out)
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

    /// `out[r, col..col + W] = fixed[col..col + W] + sum_j ys[r, varying[j]] rows[j, col..col + W]`.
    #[inline(always)]
    fn columns<const R: usize, const W: usize, const FMA: bool>(
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
fn varying_mask(y: &[f32], d: usize) -> Vec<bool> {
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

/// Tokens per tile of [`BlockFrame::product`] in the AVX + FMA build: 6 tokens by 16 columns
/// are 12 accumulators, with the row's two registers and a broadcast 15 of the 16.
#[cfg(target_arch = "x86_64")]
const AVX_TILE_TOKENS: usize = 6;

/// [`BlockFrame::columns`] of 6 tokens by 16 columns, written with AVX intrinsics (the
/// compiler left a 6 x 16 array of sums in memory).
///
/// # Safety
/// The CPU has AVX and FMA and every `frame.varying` is below `d` (`BlockFrame::new`); the
/// other bounds (`6 d` values in `ys` and `out`, `col + 16 <= d`, `d x d` in `m`) are
/// asserted.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,fma")]
#[allow(unsafe_code)]
unsafe fn columns_6x16_avx_fma(frame: &BlockFrame, ys: &[f32], col: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let d = frame.fixed.len();
    assert!(ys.len() >= 6 * d && out.len() >= 6 * d && frame.m.len() >= d * d && col + 16 <= d);
    let fixed = &frame.fixed[col..col + 16];
    let (f0, f1) = unsafe { (_mm256_loadu_ps(&fixed[0]), _mm256_loadu_ps(&fixed[8])) };
    let mut acc = [[f0, f1]; AVX_TILE_TOKENS];
    let (y, m) = (ys.as_ptr(), frame.m.as_ptr());
    for &j in &frame.varying {
        // SAFETY (every load): the caller's bounds on `ys`, `m`, `varying` and `col`.
        let row = unsafe { m.add(j * d + col) };
        let (m0, m1) = unsafe { (_mm256_loadu_ps(row), _mm256_loadu_ps(row.add(8))) };
        for (r, a) in acc.iter_mut().enumerate() {
            let p = unsafe { _mm256_broadcast_ss(&*y.add(r * d + j)) };
            a[0] = _mm256_fmadd_ps(p, m0, a[0]);
            a[1] = _mm256_fmadd_ps(p, m1, a[1]);
        }
    }
    for (r, a) in acc.iter().enumerate() {
        let o = &mut out[r * d + col..][..16];
        unsafe {
            _mm256_storeu_ps(&mut o[0], a[0]);
            _mm256_storeu_ps(&mut o[8], a[1]);
        }
    }
}

#[inline(always)]
fn token_scale<const FMA: bool>(norms: Option<&[f32]>, t: usize, y: &[f32]) -> f32 {
    match norms {
        None => 1.0,
        Some(nm) => nm[t] / length::<FMA>(y),
    }
}

/// `|y|`, at least [`MIN_NORM`]: what a token-norm scale divides by.
#[inline(always)]
fn length<const FMA: bool>(y: &[f32]) -> f32 {
    dot::<FMA>(y, y).sqrt().max(MIN_NORM)
}

/// A decoded block as the key kernels take it: its values (`n x d`), or its int16 levels
/// decoded straight from its codes on `grid` ([`CodedStreams::decode_keys`]; only for the
/// int16 frame product, where nothing reads the values themselves).
#[derive(Clone, Copy)]
enum Coords<'a> {
    Values(&'a [f32]),
    Levels(&'a [f32], &'a int16::Grid),
}

impl<'a> Coords<'a> {
    fn of(decoded: &'a [f32], grid: Option<&'a int16::Grid>) -> Self {
        match grid {
            Some(g) => Coords::Levels(decoded, g),
            None => Coords::Values(decoded),
        }
    }

    /// `n x d` numbers: the values, or the levels.
    fn len(&self) -> usize {
        match self {
            Coords::Values(y) | Coords::Levels(y, _) => y.len(),
        }
    }

    /// The values; levels only where [`KeyInputs::levels`] found nothing needs them.
    fn values(&self) -> &'a [f32] {
        match self {
            Coords::Values(y) => y,
            Coords::Levels(..) => unreachable!("levels are decoded only where no value is read"),
        }
    }
}

/// `(decoded block, head dim, frame, how its product runs, angles, norms, query rows)`.
type LogitArgs<'a> = (
    Coords<'a>,
    usize,
    Option<&'a [f32]>,
    Product<'a>,
    Option<BlockAngles<'a>>,
    Option<&'a [f32]>,
    Rows<'a>,
);

/// `g` query rows `[g, d]` and each one's [`nonzero_chunks`].
type Rows<'a> = (&'a [f32], &'a [Vec<usize>]);

/// `(decoded block, head dim, weights, tokens, first token, norms, query rows)`.
type SumArgs<'a> = (
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
fn block_logits<const FMA: bool>(args: LogitArgs<'_>, out: &mut [f32]) {
    // Taken and put back, not borrowed in a closure: a closure does not inherit the `kernel`'s
    // target features, and where the compiler kept it out of line (the criterion binary) every
    // `mul_add` in it became a call to libm's `fmaf`, a third of `key_logits`' time.
    let mut buf = KEYS.take();
    block_logits_in::<FMA>(args, out, &mut buf);
    KEYS.set(buf);
}

thread_local! {
    /// A block's keys, reused by every block this thread computes: a fresh buffer per block
    /// (192 KB for 256 tokens across three heads) was an allocation the size of an `mmap`,
    /// page faults and zeroing, about a tenth of a decode step's cycles.
    static KEYS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// A block's token scales and a tile's weights in [`block_sums`].
    static SCALES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static WEIGHTS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// [`block_logits`] with `buf` to hold the keys.
#[inline(always)]
fn block_logits_in<const FMA: bool>(args: LogitArgs<'_>, out: &mut [f32], buf: &mut Vec<f32>) {
    let (y, d, m, product, rot, norms, (q, chunks)) = args;
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
fn block_keys<const FMA: bool>(
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

/// `(decoded block, head dim, frame, how its product runs, angles)`.
type KeyArgs<'a> = (
    Coords<'a>,
    usize,
    Option<&'a [f32]>,
    Product<'a>,
    Option<BlockAngles<'a>>,
);

/// A block's [`BlockKeys`]: its keys as [`block_logits`] makes them, and every token's
/// [`length`] for a token-norm scale (none from levels: their values are not decoded).
#[inline(always)]
fn prepare_block<const FMA: bool>(args: KeyArgs<'_>, out: &mut BlockKeys) {
    let (y, d, m, product, rot) = args;
    if !block_keys::<FMA>(y, d, m, product, rot, &mut out.keys) {
        out.keys.clear();
        out.keys.extend_from_slice(y.values());
    }
    out.keys.truncate(y.len());
    out.lengths = match y {
        Coords::Values(y) => y.chunks_exact(d).map(length::<FMA>).collect(),
        Coords::Levels(..) => Vec::new(), // no token norms read them
    };
}

/// `(prepared keys, head dim, norms, query rows)`.
type PreparedArgs<'a> = (&'a BlockKeys, usize, Option<&'a [f32]>, Rows<'a>);

/// [`block_logits`] of a block whose keys were prepared: the same dots and scales.
#[inline(always)]
fn prepared_logits<const FMA: bool>(args: PreparedArgs<'_>, out: &mut [f32]) {
    let (bk, d, norms, (q, chunks)) = args;
    let (n, g) = (bk.tokens(d), chunks.len());
    dots_rows::<FMA>(q, chunks, &bk.keys, out);
    if let Some(nm) = norms {
        for (t, &len) in bk.lengths.iter().enumerate() {
            let scale = nm[t] / len;
            for j in 0..g {
                out[j * n + t] *= scale;
            }
        }
    }
}

/// The first channels of the 8-channel chunks where `q` is not zero (none unless its length
/// is a multiple of 8): a wide query of streams coded across heads is zero outside its own
/// head's channels (two thirds of them with three heads), which [`dots`] skips.
fn nonzero_chunks(q: &[f32]) -> Vec<usize> {
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
fn dots_rows<const FMA: bool>(q: &[f32], chunks: &[Vec<usize>], keys: &[f32], out: &mut [f32]) {
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

/// How many tokens ahead [`dots4_avx_fma`] asks for the keys' lines. A block made ahead
/// was written by the other core, and its dots wait on memory: in a decode step at 8k
/// (SmolLM2, in-process timing of each call) a block's dots took 24.3 us with 16 tokens
/// ahead, 27.3 with 8, 32.0 row by row and 37.7 in groups without prefetching (48th-49th
/// sessions, `docs/speed.md`).
const PREFETCH_TOKENS: usize = 16;

/// The most query rows [`dots_rows`] takes together: with 4 tokens, 12 sums in registers
/// besides the rows' query chunks and a key (16 AVX registers).
const GROUP_ROWS: usize = 3;

/// The most query rows [`block_sums`] sums in one tile: with 8 columns, 12 sums in registers
/// besides a token's values and a broadcast weight (16 AVX registers).
const TILE_ROWS: usize = 12;

/// Weighted sums of one decoded block into `out` (`[g, d]`, zeros on entry), in tiles of
/// query rows by a few columns whose sums stay in registers across the block's tokens: a
/// token's values are loaded once per tile rather than once per row, and no sum goes through
/// memory per token. Each sum adds the same terms in token order.
///
/// The rows go in as few tiles as fit ([`TILE_ROWS`]), so the block is read once per tile:
/// the 9 rows of SmolLM2's values coded across heads read it once, where tiles of 4 rows read
/// it three times. Hot in criterion that is 5% of the sums; in a decode step 2-3% of the whole
/// step (`docs/speed.md`, 41st session).
#[inline(always)]
fn block_sums<const FMA: bool>(args: SumArgs<'_>, out: &mut [f32]) {
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
fn sums_tile<const R: usize, const W: usize, const FMA: bool>(
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
fn sums_columns<const R: usize, const W: usize, const FMA: bool>(
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

// Run-time dispatch to AVX + FMA builds of the kernels: the only unsafe code of the crate.
// Each `kernel` is the generic kernel (`#[inline(always)]`, so it is compiled inside `kernel`
// with its target features); it is called only right after `avx_fma()` found them.

/// Whether this CPU runs the AVX + FMA builds.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // elsewhere only the tests ask
fn avx_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `fn $name(args) { $generic::<FMA>(args) }` with `FMA` true, in a build with AVX + FMA
/// enabled, where this CPU has them: the one place the kernels' dispatch is written.
macro_rules! with_avx_fma {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) => $generic:ident) => {
        $(#[$doc])*
        #[allow(unsafe_code)]
        fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            if $crate::coded_attention::avx_fma() {
                #[target_feature(enable = "avx,fma")]
                fn kernel($($arg: $ty),*) {
                    $generic::<true>($($arg),*)
                }
                // SAFETY: `avx_fma()` just found AVX and FMA on this CPU.
                return unsafe { kernel($($arg),*) };
            }
            $generic::<false>($($arg),*)
        }
    };
}
pub(crate) use with_avx_fma;

with_avx_fma! {
    /// [`block_logits`], built with AVX + FMA where this CPU has them.
    fn run_block_logits(args: LogitArgs<'_>, out: &mut [f32]) => block_logits
}

with_avx_fma! {
    /// [`prepare_block`], built with AVX + FMA where this CPU has them.
    fn run_prepare_block(args: KeyArgs<'_>, out: &mut BlockKeys) => prepare_block
}

with_avx_fma! {
    /// [`prepared_logits`], built with AVX + FMA where this CPU has them.
    fn run_prepared_logits(args: PreparedArgs<'_>, out: &mut [f32]) => prepared_logits
}

with_avx_fma! {
    /// [`block_sums`], built with AVX + FMA where this CPU has them.
    fn run_block_sums(args: SumArgs<'_>, out: &mut [f32]) => block_sums
}

/// `a . b` in two 8-lane AVX accumulators, then the tail.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,fma")]
#[allow(unsafe_code)]
fn dot_avx_fma(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    // SAFETY (every load): `i + 8 <= n` (or `i + 16 <= n`), within both slices.
    while i + 16 <= n {
        let (x0, y0) = unsafe { (_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i))) };
        let (x1, y1) = unsafe {
            (
                _mm256_loadu_ps(pa.add(i + 8)),
                _mm256_loadu_ps(pb.add(i + 8)),
            )
        };
        acc0 = _mm256_fmadd_ps(x0, y0, acc0);
        acc1 = _mm256_fmadd_ps(x1, y1, acc1);
        i += 16;
    }
    if i + 8 <= n {
        let (x0, y0) = unsafe { (_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i))) };
        acc0 = _mm256_fmadd_ps(x0, y0, acc0);
        i += 8;
    }
    let acc = _mm256_add_ps(acc0, acc1);
    let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    let mut sum = _mm_cvtss_f32(s);
    for j in i..n {
        sum = a[j].mul_add(b[j], sum);
    }
    sum
}

/// `out[r, t] = q_r . keys[t]` for `R` query rows (`q` `[R, d]`, `out` `[R, n]`) sharing
/// `chunks`, over the first `tokens` keys (a multiple of 4) in fours, each key chunk loaded
/// once for the `R` rows: one 8-lane accumulator per row and token, the lanes reduced by
/// horizontal adds (one reduction per sum cost more than its products).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,fma")]
#[allow(unsafe_code)]
fn dots4_avx_fma<const R: usize>(
    q: &[f32],
    chunks: &[usize],
    keys: &[f32],
    tokens: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let d = q.len() / R;
    let n = out.len() / R;
    assert!(q.len() == R * d && d.is_multiple_of(8) && tokens.is_multiple_of(4));
    assert!(tokens <= n && keys.len() >= tokens * d);
    assert!(chunks.iter().all(|&c| c + 8 <= d));
    for t0 in (0..tokens).step_by(4) {
        let mut acc = [[_mm256_setzero_ps(); 4]; R];
        if t0 + PREFETCH_TOKENS + 4 <= tokens {
            for t in t0 + PREFETCH_TOKENS..t0 + PREFETCH_TOKENS + 4 {
                // A 64-byte line holds two chunks of 8 floats.
                for &c in chunks.iter().step_by(2) {
                    // SAFETY: `t < tokens` and `c < d`: an address inside `keys`.
                    let at = unsafe { keys.as_ptr().add(t * d + c) };
                    _mm_prefetch::<_MM_HINT_T0>(at.cast());
                }
            }
        }
        for &c in chunks {
            // SAFETY (every load): `c + 8 <= d`, `q` holds `R` rows of `d` and `keys` at least
            // `tokens` rows of `d`, `t0 + 3 < tokens`.
            let qv: [__m256; R] =
                std::array::from_fn(|r| unsafe { _mm256_loadu_ps(q.as_ptr().add(r * d + c)) });
            for t in 0..4 {
                let kv = unsafe { _mm256_loadu_ps(keys.as_ptr().add((t0 + t) * d + c)) };
                for (a, &qr) in acc.iter_mut().zip(&qv) {
                    a[t] = _mm256_fmadd_ps(qr, kv, a[t]);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            // Pairwise horizontal adds: lanes 0-3 then hold tokens' sums of their lanes 0-3,
            // lanes 4-7 of their lanes 4-7.
            let h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
            let sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
            // SAFETY: `r < R` and `t0 + 4 <= tokens <= n`.
            unsafe { _mm_storeu_ps(out.as_mut_ptr().add(r * n + t0), sums) };
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod prepared_tests;
