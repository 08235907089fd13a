//! One whole attention over coded blocks and an exact part, for few query rows (decoding).
//!
//! [`super::key_logits`] and [`super::value_sums`] leave the softmax between them to the
//! caller; in torch that is a dozen small ops per layer and step (concatenation, scaling,
//! bias, softmax, slices, the value frame, the exact part), 3-6% of a decode step. [`attend`]
//! does all of it: the coded logits, the exact part's logits, `scaling`, the optional softcap,
//! the additive bias, a softmax per query row over coded and exact tokens, the coded value
//! sums, the value frame and the exact values. The exact part's
//! products are plain dots, written for the few query rows of a decode step; prefill-sized
//! queries belong to a matrix library.
//!
//! Streams coded across heads ([`Joint`]: one stream of `H*D` coordinates per batch row) are
//! read as one KV head of width `H*D` whose query rows split into `H` groups, one per head:
//! the coded logits come from the wide queries (zero outside their head's channels), each
//! group's from its own head's scale, exact keys and values; the coded value sums of a group
//! leave the joint coordinates through its head's `[H*D, D]` slice of the value frame.

use super::api::{logits_with, value_sums};
use super::checks::{check_frames, check_len};
use super::cpu::with_avx_fma;
use super::frame::{axpy, dot, times_frame};
use super::inputs::{KeyInputs, Precision, RopeAngles};
use super::norms::Norms;
use super::prepared::PreparedKeys;
use super::streams::CodedStreams;
use crate::error::{Error, Result};
use crate::{int8_rows, parallel};
use std::borrow::Cow;

/// Exact keys or values of every stream, `[S, n, D]`: float32, or bfloat16 bits as a cache
/// holds its newest tokens, or int8 rows (read as they are held, with no float32 copy made by
/// the caller).
#[derive(Clone, Copy, Debug)]
pub enum Lanes<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    /// `[S, n, D + 2]` int8 rows ([`crate::int8_rows`]), as a cache holds its hot window's
    /// values: `D` codes and a bfloat16 scale per token.
    Int8Rows(&'a [i8]),
}

impl Lanes<'_> {
    fn len(&self) -> usize {
        match self {
            Lanes::F32(x) => x.len(),
            Lanes::Bf16(x) => x.len(),
            Lanes::Int8Rows(x) => x.len(),
        }
    }

    /// Entries held per token of `d` channels.
    fn width(&self, d: usize) -> usize {
        match self {
            Lanes::Int8Rows(_) => d + int8_rows::SCALE_BYTES,
            _ => d,
        }
    }

    /// Tokens per head of `u_n` heads of `d` channels.
    fn tokens(&self, u_n: usize, d: usize) -> usize {
        self.len() / (u_n * self.width(d)).max(1)
    }

    /// Appends head `u`'s `n` tokens of `d` channels as float32 to `out`.
    fn extend_head(&self, u: usize, n: usize, d: usize, out: &mut Vec<f32>) {
        match self {
            Lanes::F32(x) => out.extend_from_slice(&x[u * n * d..][..n * d]),
            Lanes::Bf16(x) => {
                let at = out.len();
                out.resize(at + n * d, 0.0);
                // bfloat16 is the top half of a float32: widening is exact (and vectorises).
                for (o, &b) in out[at..].iter_mut().zip(&x[u * n * d..][..n * d]) {
                    *o = f32::from_bits((b as u32) << 16);
                }
            }
            Lanes::Int8Rows(x) => {
                let w = d + int8_rows::SCALE_BYTES;
                int8_rows::decode_into(&x[u * n * w..][..n * w], d, out);
            }
        }
    }
}

/// One run of exact tokens, `[S, n, D]` keys and values; [`Attend::exact`] lists the runs in
/// token order (e.g. sinks, a hot window held in bfloat16, the new tokens in float32).
#[derive(Clone, Copy, Debug)]
pub struct ExactPiece<'a> {
    pub keys: Lanes<'a>,
    pub values: Lanes<'a>,
}

impl<'a> ExactPiece<'a> {
    /// A float32 run.
    pub fn f32(keys: &'a [f32], values: &'a [f32]) -> Self {
        Self {
            keys: Lanes::F32(keys),
            values: Lanes::F32(values),
        }
    }
}

/// Head `u`'s exact keys (or values) of all runs (of `u_n` heads of `d` channels), `[E, D]`
/// float32: borrowed when there is one float32 run, else gathered (and widened) into one
/// buffer.
fn head_lanes<'a>(
    runs: &'a [ExactPiece<'a>],
    pick: fn(&ExactPiece<'a>) -> Lanes<'a>,
    u: usize,
    u_n: usize,
    d: usize,
) -> Cow<'a, [f32]> {
    if let [run] = runs {
        if let Lanes::F32(x) = pick(run) {
            let n = x.len() / u_n;
            return Cow::Borrowed(&x[u * n..][..n]);
        }
    }
    let total: usize = runs.iter().map(|r| pick(r).tokens(u_n, d) * d).sum();
    let mut out = Vec::with_capacity(total);
    for run in runs {
        let lanes = pick(run);
        lanes.extend_head(u, lanes.tokens(u_n, d), d, &mut out);
    }
    Cow::Owned(out)
}

/// Streams coded across heads (a recipe's `joint_heads`): each of the `S` streams holds
/// `heads` KV heads side by side, `W = heads * D` coordinates, and its `R` query rows are
/// `heads` groups of `R / heads`, one per head in order. [`Attend::queries`] are then the
/// wide queries `[S, R, W]` in the key frame's coordinates, the exact runs hold `S * heads`
/// heads (`[S * heads, n, D]`) and the value frames are per head `[heads, W, D]`.
pub struct Joint<'a> {
    pub heads: usize,
    /// `[S, R, D]`: each query row over its own head's channels, in the exact keys' order.
    pub exact_queries: &'a [f32],
    /// `[S, heads, T]`: each head's scale of every coded key (None: 1), applied to its logits.
    pub key_scales: Option<&'a [f32]>,
    /// `[S, heads, T]`: each head's scale of every coded value (None: 1).
    pub value_scales: Option<&'a [f32]>,
}

/// The inputs of [`attend`] besides the coded streams. `S` streams, `R` query rows per stream,
/// `T` coded and `E` exact tokens per stream, head dim `D` (streams across heads: see [`Joint`]).
pub struct Attend<'a> {
    /// `[S, R, D]`.
    pub queries: &'a [f32],
    pub rows: usize,
    /// Key frames `[heads, D, D]` and `heads` (None: identity), as for
    /// [`key_logits`](super::key_logits).
    pub key_frames: Option<(&'a [f32], usize)>,
    pub rotation: Option<RopeAngles<'a>>,
    pub key_norms: Option<Norms<'a>>,
    /// Value frames `[heads, D, D]` (None: identity): `v = y M`.
    pub value_frames: Option<(&'a [f32], usize)>,
    pub value_norms: Option<Norms<'a>>,
    /// Keys and values held exact, in the coordinates of the output: runs of `[S, n_i, D]`
    /// each, `E = sum n_i` tokens in the order listed.
    pub exact: &'a [ExactPiece<'a>],
    /// Additive bias `[Sb, R, T + E]` and `Sb` (dividing `S`: stream `s` reads bias row
    /// `s / (S / Sb)`); None: none. `-inf` masks a token.
    pub bias: Option<(&'a [f32], usize)>,
    pub scaling: f32,
    /// `tanh(x / c) c` on the scaled logits, before the bias.
    pub softcap: Option<f32>,
    /// Streams coded across heads (None: a stream is one head).
    pub joint: Option<Joint<'a>>,
    /// The arithmetic of the key frame product (see [`super::key_logits`]).
    pub precision: Precision,
    /// The coded keys made ahead of this call with the same frames, rotation and precision
    /// ([`PreparedKeys::prepare`]), or None.
    pub prepared: Option<&'a PreparedKeys>,
}

/// The attention output `[S, R, D]`: `softmax(scaling * [coded logits | q . k_exact] + bias)`
/// times `[coded values | exact values]`. A row whose every token is masked gets zeros.
pub fn attend(
    keys: &CodedStreams<'_>,
    values: &CodedStreams<'_>,
    a: &Attend<'_>,
) -> Result<Vec<f32>> {
    let (s_n, t_n, w, r) = (keys.streams(), keys.tokens(), keys.head_dim(), a.rows);
    if (values.streams(), values.tokens(), values.head_dim()) != (s_n, t_n, w) {
        return Err(Error::Shape(format!(
            "values: {} streams of {} tokens x {}, keys: {s_n} of {t_n} x {w}",
            values.streams(),
            values.tokens(),
            values.head_dim()
        )));
    }
    if t_n == 0 || w == 0 {
        return Err(Error::Shape(format!("coded streams of {t_n} tokens x {w}")));
    }
    let hs = a.joint.as_ref().map_or(1, |j| j.heads);
    if hs == 0 || !w.is_multiple_of(hs) || !r.is_multiple_of(hs) {
        return Err(Error::Shape(format!(
            "joint: {w} coordinates and {r} query rows per stream do not split over {hs} heads"
        )));
    }
    // Per head: `d` channels out, `rg` query rows; `u_n` heads in all.
    let (d, rg, u_n) = (w / hs, r / hs, s_n * hs);
    let mut e_n = 0;
    for run in a.exact {
        let n = run.keys.tokens(u_n, d);
        for (name, lanes) in [("exact_keys", run.keys), ("exact_values", run.values)] {
            let shape = match lanes {
                Lanes::Int8Rows(_) => "heads x exact x (head_dim + 2) int8 rows",
                _ => "heads x exact x head_dim",
            };
            check_len(name, lanes.len(), &[u_n, n, lanes.width(d)], shape)?;
        }
        e_n += n;
    }
    check_frames("value_frames", a.value_frames, u_n, w, d)?;
    if hs > 1 && a.value_frames.is_none() {
        return Err(Error::Shape(
            "value_frames: streams coded across heads need each head's [W, D] frame".into(),
        ));
    }
    if let Some(j) = &a.joint {
        check_len(
            "exact_queries",
            j.exact_queries.len(),
            &[s_n, r, d],
            "streams x rows x head_dim",
        )?;
        for (name, sc) in [
            ("key_scales", j.key_scales),
            ("value_scales", j.value_scales),
        ] {
            if let Some(sc) = sc {
                check_len(name, sc.len(), &[s_n, hs, t_n], "streams x heads x tokens")?;
            }
        }
    }
    let l_n = t_n + e_n;
    if let Some((bias, sb)) = a.bias {
        if sb == 0 || s_n % sb != 0 {
            return Err(Error::Shape(format!(
                "bias: {sb} rows do not group {s_n} streams"
            )));
        }
        check_len(
            "bias",
            bias.len(),
            &[sb, r, l_n],
            "bias rows x query rows x tokens",
        )?;
    }
    // (key_logits checks the queries, the key frames, the rotation and the key norms.)
    let key_inputs = KeyInputs {
        frames: a.key_frames,
        rotation: a.rotation.as_ref(),
        precision: a.precision,
    };
    let mut weights = logits_with(
        keys,
        &key_inputs,
        a.key_norms.as_ref(),
        a.queries,
        r,
        a.prepared,
    )?;
    if r == 0 {
        return Ok(Vec::new());
    }
    let exact_q = a.joint.as_ref().map_or(a.queries, |j| j.exact_queries);
    let (key_scales, value_scales) = a
        .joint
        .as_ref()
        .map_or((None, None), |j| (j.key_scales, j.value_scales));
    // Per stream: the coded logits become their weights in place, the exact weights return.
    let exact_p: Vec<Vec<f32>> = parallel::map_chunks(&mut weights, r * t_n, |s, coded| {
        let mut exact = vec![0.0f32; r * e_n];
        let bias = a
            .bias
            .map(|(b, sb)| &b[(s / (s_n / sb)) * r * l_n..][..r * l_n]);
        for i in 0..hs {
            let u = s * hs + i;
            let keys = head_lanes(a.exact, |run| run.keys, u, u_n, d);
            let args = Scores {
                coded: &mut coded[i * rg * t_n..][..rg * t_n],
                exact: &mut exact[i * rg * e_n..][..rg * e_n],
                q: &exact_q[(s * r + i * rg) * d..][..rg * d],
                keys: &keys,
                bias: bias.map(|b| &b[i * rg * l_n..][..rg * l_n]),
                key_scales: head_scales(key_scales, u, t_n),
                value_scales: head_scales(value_scales, u, t_n),
                d,
                scaling: a.scaling,
                softcap: a.softcap,
            };
            run_softmax(args);
        }
        exact
    });
    let sums = value_sums(values, &weights, a.value_norms.as_ref(), r)?;
    let mut out = vec![0.0f32; s_n * r * d];
    parallel::map_chunks(&mut out, r * d, |s, out| {
        for i in 0..hs {
            let u = s * hs + i;
            let values = head_lanes(a.exact, |run| run.values, u, u_n, d);
            let args = Outputs {
                sums: &sums[(s * r + i * rg) * w..][..rg * w],
                frame: a
                    .value_frames
                    .map(|(m, heads)| &m[(u % heads) * w * d..][..w * d]),
                p: &exact_p[s][i * rg * e_n..][..rg * e_n],
                values: &values,
                d,
            };
            run_outputs(args, &mut out[i * rg * d..][..rg * d]);
        }
    });
    Ok(out)
}

/// Head `u`'s `[T]` slice of `[S, heads, T]` scales.
fn head_scales(scales: Option<&[f32]>, u: usize, t_n: usize) -> Option<&[f32]> {
    scales.map(|v| &v[u * t_n..][..t_n])
}

/// One head's scores: `coded` `[R, T]` holds the coded logits and gets their softmax
/// weights (times `value_scales`), `exact` `[R, E]` the exact tokens' weights.
struct Scores<'a> {
    coded: &'a mut [f32],
    exact: &'a mut [f32],
    q: &'a [f32],
    keys: &'a [f32],
    bias: Option<&'a [f32]>,
    /// `[T]`: the coded logits' scales, and the coded weights' (None: 1).
    key_scales: Option<&'a [f32]>,
    value_scales: Option<&'a [f32]>,
    d: usize,
    scaling: f32,
    softcap: Option<f32>,
}

/// One head's outputs `[R, D]` from its coded sums `[R, W]` (frame coordinates: `W` = `D`,
/// or every head's across heads, which `frame` `[W, D]` turns into this head's) and exact
/// weights.
struct Outputs<'a> {
    sums: &'a [f32],
    frame: Option<&'a [f32]>,
    p: &'a [f32],
    values: &'a [f32],
    d: usize,
}

#[inline(always)]
fn softmax_rows<const FMA: bool>(a: Scores<'_>) {
    let d = a.d;
    let r = a.q.len() / d;
    if r == 0 {
        return;
    }
    let (t_n, e_n) = (a.coded.len() / r, a.exact.len() / r);
    let mut row = vec![0.0f32; t_n + e_n];
    for j in 0..r {
        let q = &a.q[j * d..][..d];
        row[..t_n].copy_from_slice(&a.coded[j * t_n..][..t_n]);
        if let Some(ks) = a.key_scales {
            row.iter_mut().zip(ks).for_each(|(x, k)| *x *= k);
        }
        for (x, k) in row[t_n..].iter_mut().zip(a.keys.chunks_exact(d)) {
            *x = dot::<FMA>(q, k);
        }
        row.iter_mut().for_each(|x| *x *= a.scaling);
        if let Some(c) = a.softcap {
            row.iter_mut().for_each(|x| *x = (*x / c).tanh() * c);
        }
        if let Some(b) = a.bias {
            let b = &b[j * (t_n + e_n)..];
            row.iter_mut().zip(b).for_each(|(x, b)| *x += b);
        }
        softmax(&mut row);
        if let Some(vs) = a.value_scales {
            row.iter_mut().zip(vs).for_each(|(x, v)| *x *= v);
        }
        a.coded[j * t_n..][..t_n].copy_from_slice(&row[..t_n]);
        a.exact[j * e_n..][..e_n].copy_from_slice(&row[t_n..]);
    }
}

/// `x` turned into its softmax in place; all zeros when every entry is `-inf`.
#[inline(always)]
fn softmax(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if max == f32::NEG_INFINITY {
        x.fill(0.0);
        return;
    }
    x.iter_mut().for_each(|v| *v = exp_le0(*v - max));
    let sum: f32 = x.iter().sum();
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// `e^x` for `x <= 0` (0 below -87.3, where `e^x` leaves the normal floats), with the Cephes
/// polynomial of `expf` (relative error about 2e-7), branch-free so that a loop over it
/// vectorises: `x = n ln2 + f` with `n` rounded by the 1.5 * 2^23 trick, whose bits then
/// hold `n` for building `2^n`.
#[inline(always)]
pub(super) fn exp_le0(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.max(-87.3);
    let t = xc * std::f32::consts::LOG2_E + MAGIC;
    let n = t - MAGIC;
    let f = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        p = p * f + c;
    }
    let y = p * f * f + f + 1.0;
    let scale = f32::from_bits(((t.to_bits() as i32 - MAGIC.to_bits() as i32 + 127) << 23) as u32);
    if x < -87.3 {
        0.0
    } else {
        y * scale
    }
}

#[inline(always)]
fn outputs<const FMA: bool>(a: Outputs<'_>, out: &mut [f32]) {
    let d = a.d;
    let r = out.len() / d;
    let (w, e_n) = (a.sums.len() / r.max(1), a.p.len() / r.max(1));
    for (j, o) in out.chunks_exact_mut(d).enumerate() {
        let s = &a.sums[j * w..][..w];
        match a.frame {
            Some(m) => times_frame::<FMA>(s, m, o),
            None => o.copy_from_slice(s),
        }
        for (&p, v) in a.p[j * e_n..][..e_n].iter().zip(a.values.chunks_exact(d)) {
            if p != 0.0 {
                axpy::<FMA>(p, v, o);
            }
        }
    }
}

with_avx_fma! {
    /// [`softmax_rows`], built with AVX + FMA where this CPU has them.
    fn run_softmax(args: Scores<'_>) => softmax_rows
}

with_avx_fma! {
    /// [`outputs`], built with AVX + FMA where this CPU has them.
    fn run_outputs(args: Outputs<'_>, out: &mut [f32]) => outputs
}
