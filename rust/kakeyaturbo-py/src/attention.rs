//! Attention over coded blocks (`coded_key_logits`, `coded_value_sums`, `coded_attend`): the
//! bindings of `kakeyaturbo::coded_attention`, run with the GIL released.

use half::f16;
use kakeyaturbo::coded_attention::{
    self as core, Attend, CodedStreams, ExactPiece, Joint, Lanes, Norms, RopeAngles,
};
use kakeyaturbo::EncodedLayer;
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::arrays::opt_f32_array;
use crate::codec::PyEncodedLayer;
use crate::errors::{to_py, to_py_in, type_error};
use crate::finite::{self, finite_array, opt_finite_array};
use crate::params::precision_arg;
use crate::prepared::PyPreparedKeys;
use crate::workers;

/// One run of exact keys or values, `[streams, n, head_dim]`, C-contiguous: float32, raw
/// bfloat16 bits as uint16, or int8 rows `[streams, n, head_dim + 2]`.
enum ExactRun<'py> {
    F32(PyReadonlyArray<'py, f32, numpy::Ix3>),
    Bf16(PyReadonlyArray<'py, u16, numpy::Ix3>),
    Int8Rows(PyReadonlyArray<'py, i8, numpy::Ix3>),
}

impl ExactRun<'_> {
    fn lanes(&self) -> PyResult<Lanes<'_>> {
        Ok(match self {
            ExactRun::F32(a) => Lanes::F32(a.as_slice()?),
            ExactRun::Bf16(a) => Lanes::Bf16(a.as_slice()?),
            ExactRun::Int8Rows(a) => Lanes::Int8Rows(a.as_slice()?),
        })
    }

    /// NaN or infinity (an int8 row's scale out of range) is a ValueError naming `arg`.
    fn check_finite(&self, arg: &str) -> PyResult<()> {
        match self {
            ExactRun::F32(a) => finite::check_f32(arg, a.as_slice()?, a.shape(), false),
            ExactRun::Bf16(a) => finite::check_bf16(arg, a.as_slice()?, a.shape()),
            ExactRun::Int8Rows(a) => finite::check_int8_rows(arg, a.as_slice()?, a.shape()),
        }
    }
}

/// The runs of `exact_keys` or `exact_values`: one array, or a list or tuple of them in token
/// order; a TypeError naming `arg` for anything else, a ValueError for values that are not
/// finite (naming the run of a list: `arg[i]`).
fn exact_runs<'py>(obj: &Bound<'py, PyAny>, arg: &str) -> PyResult<Vec<ExactRun<'py>>> {
    let want = "expected a C-contiguous 3-D float32 array, uint16 of raw bfloat16 bits or int8 \
                rows (or a list of them, in token order)";
    let one = |o: &Bound<'py, PyAny>| -> PyResult<ExactRun<'py>> {
        let run = if let Ok(a) = o.extract::<PyReadonlyArray<'py, f32, numpy::Ix3>>() {
            a.is_c_contiguous().then_some(ExactRun::F32(a))
        } else if let Ok(a) = o.extract::<PyReadonlyArray<'py, u16, numpy::Ix3>>() {
            a.is_c_contiguous().then_some(ExactRun::Bf16(a))
        } else if let Ok(a) = o.extract::<PyReadonlyArray<'py, i8, numpy::Ix3>>() {
            a.is_c_contiguous().then_some(ExactRun::Int8Rows(a))
        } else {
            None
        };
        run.ok_or_else(|| type_error(arg, want))
    };
    if obj.is_instance_of::<pyo3::types::PyList>() || obj.is_instance_of::<pyo3::types::PyTuple>() {
        let runs = obj
            .try_iter()?
            .map(|o| one(&o?))
            .collect::<PyResult<Vec<_>>>()?;
        for (i, run) in runs.iter().enumerate() {
            run.check_finite(&format!("{arg}[{i}]"))?;
        }
        Ok(runs)
    } else {
        let run = one(obj)?;
        run.check_finite(arg)?;
        Ok(vec![run])
    }
}

/// The rotation `[rows, tokens, 2, pairs]`, its angles repeated `repeats` times across the
/// channel pairs, as the kernels take it.
fn rope_angles<'a>(
    r: &'a Option<PyReadonlyArray<'_, f32, numpy::Ix4>>,
    repeats: usize,
) -> PyResult<Option<RopeAngles<'a>>> {
    r.as_ref()
        .map(|r| {
            Ok(RopeAngles {
                values: r.as_slice()?,
                rows: r.shape()[0],
                pairs: r.shape()[3],
                repeats,
            })
        })
        .transpose()
}

/// Token norms as passed in: float32 `[streams, tokens]`, or per block its uint8 codes
/// `[streams, tokens]` and float16 bounds `[streams, 2]` (a pair of lists).
enum NormsIn<'py> {
    Values(PyReadonlyArray<'py, f32, numpy::Ix2>),
    Codes(
        Vec<(
            PyReadonlyArray<'py, u8, numpy::Ix2>,
            PyReadonlyArray<'py, f16, numpy::Ix2>,
        )>,
    ),
}

impl<'py> NormsIn<'py> {
    fn extract(obj: &Bound<'py, PyAny>, arg: &str) -> PyResult<Self> {
        if let Ok((codes, bounds)) =
            obj.extract::<(Vec<Bound<'py, PyAny>>, Vec<Bound<'py, PyAny>>)>()
        {
            if codes.len() != bounds.len() {
                return Err(type_error(
                    arg,
                    format!(
                        "{} code arrays for {} bound arrays",
                        codes.len(),
                        bounds.len()
                    ),
                ));
            }
            let want = "expected (codes, bounds): lists of C-contiguous 2-D uint8 codes and float16 bounds";
            let pairs = codes
                .iter()
                .zip(&bounds)
                .map(|(c, b)| {
                    let c = c
                        .extract::<PyReadonlyArray<'py, u8, numpy::Ix2>>()
                        .map_err(|_| type_error(arg, want))?;
                    let b = b
                        .extract::<PyReadonlyArray<'py, f16, numpy::Ix2>>()
                        .map_err(|_| type_error(arg, want))?;
                    if !(c.is_c_contiguous() && b.is_c_contiguous()) {
                        return Err(type_error(arg, want));
                    }
                    Ok((c, b))
                })
                .collect::<PyResult<_>>()?;
            return Ok(NormsIn::Codes(pairs));
        }
        // (Codes' bounds are the core's to check: positive finite float16, else a FormatError.)
        Ok(NormsIn::Values(finite_array::<numpy::Ix2>(
            obj, arg, false,
        )?))
    }

    fn view(&self) -> PyResult<Norms<'_>> {
        Ok(match self {
            NormsIn::Values(v) => Norms::Values(v.as_slice()?),
            NormsIn::Codes(pairs) => Norms::Codes(
                pairs
                    .iter()
                    .map(|(c, b)| Ok((c.as_slice()?, b.as_slice()?)))
                    .collect::<PyResult<_>>()?,
            ),
        })
    }
}

/// Each head's scales of streams coded across heads as passed in: float32 `[streams, heads,
/// tokens]`, or decoded here from their codes (`(codes, bounds)` lists as for norms, `streams *
/// heads` rows per block): a cache hands its blocks' codes over as they are held, with no
/// separate call (and its Python) per layer and step to decode them.
enum ScalesIn<'py> {
    Values(PyReadonlyArray<'py, f32, numpy::Ix3>),
    Decoded(Vec<f32>),
}

impl ScalesIn<'_> {
    fn values(&self) -> PyResult<&[f32]> {
        Ok(match self {
            ScalesIn::Values(v) => v.as_slice()?,
            ScalesIn::Decoded(v) => v,
        })
    }
}

fn scales_arg<'py>(
    obj: Option<&Bound<'py, PyAny>>,
    rows: usize,
    arg: &str,
) -> PyResult<Option<ScalesIn<'py>>> {
    let Some(obj) = obj else { return Ok(None) };
    if obj.is_instance_of::<pyo3::types::PyTuple>() {
        let decoded = decoded_codes(obj, rows, arg)?.map_err(|e| to_py_in(arg, e))?;
        return Ok(Some(ScalesIn::Decoded(decoded)));
    }
    Ok(Some(ScalesIn::Values(finite_array::<numpy::Ix3>(
        obj, arg, false,
    )?)))
}

/// `(codes, bounds)` lists (argument `arg`) decoded as the kernels decode token norms,
/// `[streams, tokens]`: a TypeError naming `arg` for anything else, the decoder's own error
/// for codes that do not fit (the caller names it).
fn decoded_codes(
    obj: &Bound<'_, PyAny>,
    streams: usize,
    arg: &str,
) -> PyResult<kakeyaturbo::Result<Vec<f32>>> {
    let norms = NormsIn::extract(obj, arg)?;
    let Norms::Codes(blocks) = norms.view()? else {
        return Err(type_error(arg, "expected (codes, bounds) lists"));
    };
    Ok(core::decode_norm_codes(&blocks, streams))
}

fn norms_arg<'py>(obj: Option<&Bound<'py, PyAny>>, arg: &str) -> PyResult<Option<NormsIn<'py>>> {
    obj.map(|o| NormsIn::extract(o, arg)).transpose()
}

/// [`NormsIn::view`] of an optional argument.
fn norms_view<'a>(n: &'a Option<NormsIn<'_>>) -> PyResult<Option<Norms<'a>>> {
    n.as_ref().map(|n| n.view()).transpose()
}

/// A 3-D array's values and its leading dim (frames and their heads, bias and its rows).
fn with_lead<'a>(
    a: &'a Option<PyReadonlyArray<'_, f32, numpy::Ix3>>,
) -> PyResult<Option<(&'a [f32], usize)>> {
    a.as_ref()
        .map(|a| Ok((a.as_slice()?, a.shape()[0])))
        .transpose()
}

fn layers<'a>(encs: &'a [Bound<'_, PyEncodedLayer>]) -> Vec<&'a EncodedLayer> {
    encs.iter().map(|e| &e.get().inner).collect()
}

/// Whether `precision="bfloat16"` multiplies in bfloat16 on this CPU for coded streams of
/// `head_dim` coordinates (AVX512-BF16 and a multiple of 16); where not, it runs float32.
#[pyfunction]
pub fn bf16_products(head_dim: usize) -> bool {
    core::bf16_products(head_dim)
}

/// Whether `precision="int16"` multiplies in 16-bit integers on this CPU for coded streams of
/// `head_dim` coordinates (AVX512-VNNI or AVX2, and a multiple of 16); where not, it runs
/// float32.
#[pyfunction]
pub fn int16_products(head_dim: usize) -> bool {
    core::int16_products(head_dim)
}

fn output<'py>(py: Python<'py>, v: Vec<f32>, shape: [usize; 3]) -> PyResult<Bound<'py, PyAny>> {
    Ok(PyArray1::from_vec(py, v).reshape(shape)?.into_any())
}

/// Logits `[streams, g, tokens]` of `queries` `[streams, g, head_dim]` against the keys coded
/// in `encs` (`streams` streams, stream-major, each stream's blocks in token order):
/// `q . rope_t(y_t @ frames[s % heads]) * norms[s, t] / |y_t|`. `frames`: `[heads, head_dim,
/// head_dim]` (None: identity); `rotation`: `[rows or 1, tokens, 2, pairs]`, the cosines then
/// the sines turning channel pairs `(i, i + P)` (None: no RoPE), `P = pairs *
/// rotation_repeats`, pair `i` by angle `i % pairs` (every head's pairs side by side, for
/// streams coded across heads); `norms`: `[streams,
/// tokens]` or norm codes (None: scale 1). `precision`: the frame product's arithmetic,
/// "float32", "int16" (the coordinates less their block mean and the frame as 16-bit integers
/// with per-block scales, exact int32 sums, where `int16_products`) or "bfloat16" (both
/// rounded to bfloat16, float32 sums, where `bf16_products`).
#[pyfunction]
#[pyo3(signature = (encs, streams, queries, frames=None, rotation=None, norms=None,
    precision="float32", rotation_repeats=1))]
#[allow(clippy::too_many_arguments)]
pub fn coded_key_logits<'py>(
    py: Python<'py>,
    encs: Vec<Bound<'py, PyEncodedLayer>>,
    streams: usize,
    queries: &Bound<'py, PyAny>,
    frames: Option<&Bound<'py, PyAny>>,
    rotation: Option<&Bound<'py, PyAny>>,
    norms: Option<&Bound<'py, PyAny>>,
    precision: &str,
    rotation_repeats: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let precision = precision_arg(precision)?;
    let refs = layers(&encs);
    let coded = CodedStreams::new(&refs, streams).map_err(to_py)?;
    let q = finite_array::<numpy::Ix3>(queries, "queries", false)?;
    let g = q.shape()[1];
    let frames = opt_finite_array::<numpy::Ix3>(frames, "frames", false)?;
    let rotation = opt_finite_array::<numpy::Ix4>(rotation, "rotation", false)?;
    let norms = norms_arg(norms, "norms")?;
    let rot = rope_angles(&rotation, rotation_repeats)?;
    let (qs, fs) = (q.as_slice()?, with_lead(&frames)?);
    let ns = norms_view(&norms)?;
    let t_n = coded.tokens();
    let out = workers::detach(py, || {
        core::key_logits(&coded, fs, rot.as_ref(), ns.as_ref(), qs, g, precision)
    })
    .map_err(to_py)?;
    output(py, out, [streams, g, t_n])
}

/// Weighted sums `[streams, g, head_dim]` of the values coded in `encs` (laid out as for
/// `coded_key_logits`), in frame coordinates: `sum_t weights[s, j, t] * norms[s, t] / |y_t| *
/// y_t`. `weights`: `[streams, g, tokens]`; `norms`: `[streams, tokens]` or norm codes (None:
/// scale 1).
#[pyfunction]
#[pyo3(signature = (encs, streams, weights, norms=None))]
pub fn coded_value_sums<'py>(
    py: Python<'py>,
    encs: Vec<Bound<'py, PyEncodedLayer>>,
    streams: usize,
    weights: &Bound<'py, PyAny>,
    norms: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let refs = layers(&encs);
    let coded = CodedStreams::new(&refs, streams).map_err(to_py)?;
    let w = finite_array::<numpy::Ix3>(weights, "weights", false)?;
    let g = w.shape()[1];
    let norms = norms_arg(norms, "norms")?;
    let (ws, ns) = (w.as_slice()?, norms_view(&norms)?);
    let d = coded.head_dim();
    let out =
        workers::detach(py, || core::value_sums(&coded, ws, ns.as_ref(), g)).map_err(to_py)?;
    output(py, out, [streams, g, d])
}

/// The attention output `[streams, rows, head_dim]` of `queries` `[streams, rows, head_dim]`
/// over the coded keys and values (`key_encs`, `value_encs`, laid out as for
/// `coded_key_logits`) and the exact `exact_keys` / `exact_values` `[streams, exact,
/// head_dim]` (or lists of such runs in token order; each float32, or uint16 of raw bfloat16
/// bits, read as held): `softmax(scaling * logits (softcapped) + bias) @ values`, coded tokens
/// first.
/// `bias`: `[bias rows, rows, tokens + exact]`, stream `s` reading row `s / (streams / bias
/// rows)`; norms: float32 `[streams, tokens]` or `(codes, bounds)` lists per block; frames and
/// rotation (`rotation_repeats`) as for `coded_key_logits`, `value_frames` turning the sums
/// out of the frame.
/// Streams coded across `heads` KV heads (`heads` > 1): `queries` are the wide queries
/// `[streams, rows, heads * head_dim]`, rows in `heads` equal groups, one per head;
/// `exact_queries` `[streams, rows, head_dim]` each row over its own head's channels; the exact
/// runs `[streams * heads, exact, head_dim]`; `value_frames` `[heads, heads * head_dim,
/// head_dim]`; `key_scales` / `value_scales` `[streams, heads, tokens]` each head's scale of
/// the coded keys / values, or their one-byte codes as for norms (decoded here; None: 1).
/// The output is then `[streams, rows, head_dim]`.
/// `precision`: the key frame product's arithmetic, as for `coded_key_logits`.
#[pyfunction]
#[pyo3(signature = (key_encs, value_encs, streams, queries, exact_keys, exact_values, scaling, *,
    key_frames=None, rotation=None, key_norms=None, value_frames=None, value_norms=None,
    bias=None, softcap=None, heads=1, exact_queries=None, key_scales=None, value_scales=None,
    precision="float32", prepared=None, rotation_repeats=1))]
#[allow(clippy::too_many_arguments)]
pub fn coded_attend<'py>(
    py: Python<'py>,
    key_encs: Vec<Bound<'py, PyEncodedLayer>>,
    value_encs: Vec<Bound<'py, PyEncodedLayer>>,
    streams: usize,
    queries: &Bound<'py, PyAny>,
    exact_keys: &Bound<'py, PyAny>,
    exact_values: &Bound<'py, PyAny>,
    scaling: f32,
    key_frames: Option<&Bound<'py, PyAny>>,
    rotation: Option<&Bound<'py, PyAny>>,
    key_norms: Option<&Bound<'py, PyAny>>,
    value_frames: Option<&Bound<'py, PyAny>>,
    value_norms: Option<&Bound<'py, PyAny>>,
    bias: Option<&Bound<'py, PyAny>>,
    softcap: Option<f32>,
    heads: usize,
    exact_queries: Option<&Bound<'py, PyAny>>,
    key_scales: Option<&Bound<'py, PyAny>>,
    value_scales: Option<&Bound<'py, PyAny>>,
    precision: &str,
    prepared: Option<&Bound<'py, PyPreparedKeys>>,
    rotation_repeats: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let precision = precision_arg(precision)?;
    let (krefs, vrefs) = (layers(&key_encs), layers(&value_encs));
    let keys = CodedStreams::new(&krefs, streams).map_err(|e| to_py_in("key_encs", e))?;
    let values = CodedStreams::new(&vrefs, streams).map_err(|e| to_py_in("value_encs", e))?;
    let q = finite_array::<numpy::Ix3>(queries, "queries", false)?;
    let (ek, ev) = (
        exact_runs(exact_keys, "exact_keys")?,
        exact_runs(exact_values, "exact_values")?,
    );
    if ek.len() != ev.len() {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "exact_values: {} runs for the {} runs of exact_keys",
            ev.len(),
            ek.len()
        )));
    }
    let exact = ek
        .iter()
        .zip(&ev)
        .map(|(k, v)| {
            Ok(ExactPiece {
                keys: k.lanes()?,
                values: v.lanes()?,
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    let (kf, vf, bias) = (
        opt_finite_array::<numpy::Ix3>(key_frames, "key_frames", false)?,
        opt_finite_array::<numpy::Ix3>(value_frames, "value_frames", false)?,
        opt_finite_array::<numpy::Ix3>(bias, "bias", true)?, // -inf: a mask
    );
    // Keys made ahead hold what prepare_keys read (and checked) of the rotation.
    let rotation = match prepared {
        Some(_) => opt_f32_array::<numpy::Ix4>(rotation, "rotation")?,
        None => opt_finite_array::<numpy::Ix4>(rotation, "rotation", false)?,
    };
    finite::check_scalar("scaling", Some(scaling))?;
    finite::check_scalar("softcap", softcap)?;
    let (kn, vn) = (
        norms_arg(key_norms, "key_norms")?,
        norms_arg(value_norms, "value_norms")?,
    );
    let (eq, ks, vs) = (
        opt_finite_array::<numpy::Ix3>(exact_queries, "exact_queries", false)?,
        scales_arg(key_scales, streams * heads, "key_scales")?,
        scales_arg(value_scales, streams * heads, "value_scales")?,
    );
    let joint = match (heads, &eq) {
        (0, _) => {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "heads: a stream holds at least one head",
            ))
        }
        (1, None) if ks.is_none() && vs.is_none() => None,
        (_, None) => {
            return Err(type_error(
                "exact_queries",
                "streams coded across heads need each row's query over its own head",
            ))
        }
        (_, Some(eq)) => Some(Joint {
            heads,
            exact_queries: eq.as_slice()?,
            key_scales: ks.as_ref().map(ScalesIn::values).transpose()?,
            value_scales: vs.as_ref().map(ScalesIn::values).transpose()?,
        }),
    };
    let rows = q.shape()[1];
    let (key_frames, rotation) = (with_lead(&kf)?, rope_angles(&rotation, rotation_repeats)?);
    let prepared = prepared.map(|p| p.get());
    let prepared = prepared
        .map(|p| p.matching(&krefs, streams, key_frames, rotation.as_ref(), precision))
        .transpose()?;
    let a = Attend {
        queries: q.as_slice()?,
        rows,
        key_frames,
        rotation,
        key_norms: norms_view(&kn)?,
        value_frames: with_lead(&vf)?,
        value_norms: norms_view(&vn)?,
        exact: &exact,
        bias: with_lead(&bias)?,
        scaling,
        softcap,
        joint,
        precision,
        prepared,
    };
    let d = keys.head_dim() / heads; // heads >= 1: refused above
    let out = workers::detach(py, || core::attend(&keys, &values, &a)).map_err(to_py)?;
    output(py, out, [streams, rows, d])
}

/// Token norms `[streams, tokens]` float32 of consecutive blocks from their one-byte codes:
/// `norms` is `(codes, bounds)`, per block its uint8 codes `[streams, block tokens]` and
/// float16 bounds `[streams, 2]`, as the kernels take them. Blocks coded across heads keep a
/// norm per head, which attention over their codes applies itself.
#[pyfunction]
pub fn decode_norm_codes<'py>(
    py: Python<'py>,
    norms: &Bound<'py, PyAny>,
    streams: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let out = decoded_codes(norms, streams, "norms")?.map_err(to_py)?;
    let tokens = out.len() / streams.max(1);
    Ok(PyArray1::from_vec(py, out)
        .reshape([streams, tokens])?
        .into_any())
}
