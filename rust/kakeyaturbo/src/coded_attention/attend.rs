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

use super::{
    axpy, check_frames, check_len, dot, frame_of, key_logits, times_frame, value_sums,
    with_avx_fma, CodedStreams, Norms, RopeAngles,
};
use crate::error::{Error, Result};
use crate::parallel;
use std::borrow::Cow;

/// Exact keys or values of every stream, `[S, n, D]`: float32, or bfloat16 bits as a cache
/// holds its newest tokens (read as they are held, with no float32 copy made by the caller).
#[derive(Clone, Copy, Debug)]
pub enum Lanes<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl Lanes<'_> {
    fn len(&self) -> usize {
        match self {
            Lanes::F32(x) => x.len(),
            Lanes::Bf16(x) => x.len(),
        }
    }

    /// Appends values `lo..lo + n` as float32 to `out`.
    fn extend_into(&self, lo: usize, n: usize, out: &mut Vec<f32>) {
        match self {
            Lanes::F32(x) => out.extend_from_slice(&x[lo..][..n]),
            Lanes::Bf16(x) => {
                let at = out.len();
                out.resize(at + n, 0.0);
                // bfloat16 is the top half of a float32: widening is exact (and vectorises).
                for (o, &b) in out[at..].iter_mut().zip(&x[lo..][..n]) {
                    *o = f32::from_bits((b as u32) << 16);
                }
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

/// Stream `s`'s exact keys (or values) of all runs, `[E, D]` float32: borrowed when there is
/// one float32 run, else gathered (and widened) into one buffer.
fn stream_lanes<'a>(
    runs: &'a [ExactPiece<'a>],
    pick: fn(&ExactPiece<'a>) -> Lanes<'a>,
    s: usize,
    s_n: usize,
) -> Cow<'a, [f32]> {
    if let [run] = runs {
        if let Lanes::F32(x) = pick(run) {
            let n = x.len() / s_n;
            return Cow::Borrowed(&x[s * n..][..n]);
        }
    }
    let total: usize = runs.iter().map(|r| pick(r).len() / s_n).sum();
    let mut out = Vec::with_capacity(total);
    for run in runs {
        let lanes = pick(run);
        let n = lanes.len() / s_n;
        lanes.extend_into(s * n, n, &mut out);
    }
    Cow::Owned(out)
}

/// The inputs of [`attend`] besides the coded streams. `S` streams, `R` query rows per stream,
/// `T` coded and `E` exact tokens per stream, head dim `D`.
pub struct Attend<'a> {
    /// `[S, R, D]`.
    pub queries: &'a [f32],
    pub rows: usize,
    /// Key frames `[heads, D, D]` and `heads` (None: identity), as for [`key_logits`].
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
}

/// The attention output `[S, R, D]`: `softmax(scaling * [coded logits | q . k_exact] + bias)`
/// times `[coded values | exact values]`. A row whose every token is masked gets zeros.
pub fn attend(
    keys: &CodedStreams<'_>,
    values: &CodedStreams<'_>,
    a: &Attend<'_>,
) -> Result<Vec<f32>> {
    let (s_n, t_n, d, r) = (keys.streams(), keys.tokens(), keys.head_dim(), a.rows);
    if (values.streams(), values.tokens(), values.head_dim()) != (s_n, t_n, d) {
        return Err(Error::Shape(format!(
            "values: {} streams of {} tokens x {}, keys: {s_n} of {t_n} x {d}",
            values.streams(),
            values.tokens(),
            values.head_dim()
        )));
    }
    if t_n == 0 || d == 0 {
        return Err(Error::Shape(format!("coded streams of {t_n} tokens x {d}")));
    }
    let mut e_n = 0;
    for run in a.exact {
        let n = run.keys.len() / (s_n * d);
        let shape = "streams x exact x head_dim";
        check_len("exact_keys", run.keys.len(), &[s_n, n, d], shape)?;
        check_len("exact_values", run.values.len(), &[s_n, n, d], shape)?;
        e_n += n;
    }
    check_frames("value_frames", a.value_frames, s_n, d)?;
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
    let mut weights = key_logits(
        keys,
        a.key_frames,
        a.rotation.as_ref(),
        a.key_norms.as_ref(),
        a.queries,
        r,
    )?;
    if r == 0 {
        return Ok(Vec::new());
    }
    // Per stream: the coded logits become their weights in place, the exact weights return.
    let exact_p: Vec<Vec<f32>> = parallel::map_chunks(&mut weights, r * t_n, |s, coded| {
        let mut exact = vec![0.0f32; r * e_n];
        let keys = stream_lanes(a.exact, |run| run.keys, s, s_n);
        let args = Scores {
            coded,
            exact: &mut exact,
            q: &a.queries[s * r * d..][..r * d],
            keys: &keys,
            bias: a
                .bias
                .map(|(b, sb)| &b[(s / (s_n / sb)) * r * l_n..][..r * l_n]),
            d,
            scaling: a.scaling,
            softcap: a.softcap,
        };
        run_softmax(args);
        exact
    });
    let sums = value_sums(values, &weights, a.value_norms.as_ref(), r)?;
    let mut out = vec![0.0f32; s_n * r * d];
    parallel::map_chunks(&mut out, r * d, |s, out| {
        let m = frame_of(a.value_frames, s, d);
        let values = stream_lanes(a.exact, |run| run.values, s, s_n);
        let args = Outputs {
            sums: &sums[s * r * d..][..r * d],
            frame: m,
            p: &exact_p[s],
            values: &values,
            d,
        };
        run_outputs(args, out);
    });
    Ok(out)
}

/// One stream's scores: `coded` `[R, T]` holds the coded logits and gets their softmax
/// weights, `exact` `[R, E]` the exact tokens' weights.
struct Scores<'a> {
    coded: &'a mut [f32],
    exact: &'a mut [f32],
    q: &'a [f32],
    keys: &'a [f32],
    bias: Option<&'a [f32]>,
    d: usize,
    scaling: f32,
    softcap: Option<f32>,
}

/// One stream's outputs from its coded sums `[R, D]` (frame coordinates) and exact weights.
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
    let (t_n, e_n) = (a.coded.len() / r, a.exact.len() / r);
    let mut row = vec![0.0f32; t_n + e_n];
    for j in 0..r {
        let q = &a.q[j * d..][..d];
        row[..t_n].copy_from_slice(&a.coded[j * t_n..][..t_n]);
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
    let e_n = a.p.len() / r.max(1);
    for (j, o) in out.chunks_exact_mut(d).enumerate() {
        let s = &a.sums[j * d..][..d];
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
