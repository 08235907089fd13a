//! Attention over coded blocks (`kakeyaturbo.coded_key_logits`, `kakeyaturbo.coded_value_sums`):
//! the bindings of `kakeyaturbo::coded_attention`, run with the GIL released.

use kakeyaturbo::coded_attention::{self as core, CodedStreams, RopeAngles};
use kakeyaturbo::EncodedLayer;
use numpy::ndarray::Dimension;
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::codec::PyEncodedLayer;
use crate::errors::{to_py, type_error};

/// A float32 array of `D` dims, C-contiguous, or a TypeError naming `arg`.
fn f32_array<'py, D: Dimension>(
    obj: &Bound<'py, PyAny>,
    arg: &str,
) -> PyResult<PyReadonlyArray<'py, f32, D>> {
    let want = || {
        format!(
            "expected a C-contiguous float32 array of {} dims",
            D::NDIM.unwrap_or(0)
        )
    };
    let a = obj
        .extract::<PyReadonlyArray<'py, f32, D>>()
        .map_err(|_| type_error(arg, want()))?;
    if !a.is_c_contiguous() {
        return Err(type_error(arg, want()));
    }
    Ok(a)
}

fn layers<'a>(encs: &'a [Bound<'_, PyEncodedLayer>]) -> Vec<&'a EncodedLayer> {
    encs.iter().map(|e| &e.get().inner).collect()
}

fn output<'py>(py: Python<'py>, v: Vec<f32>, shape: [usize; 3]) -> PyResult<Bound<'py, PyAny>> {
    Ok(PyArray1::from_vec(py, v).reshape(shape)?.into_any())
}

/// Logits `[streams, g, tokens]` of `queries` `[streams, g, head_dim]` against the keys coded
/// in `encs` (`streams` streams, stream-major, each stream's blocks in token order):
/// `q . rope_t(y_t @ frames[s % heads]) * norms[s, t] / |y_t|`. `frames`: `[heads, head_dim,
/// head_dim]` (None: identity); `rotation`: `[rows or 1, tokens, 2, pairs]`, the cosines then
/// the sines turning channel pairs `(i, i + pairs)` (None: no RoPE); `norms`: `[streams,
/// tokens]` (None: scale 1).
#[pyfunction]
#[pyo3(signature = (encs, streams, queries, frames=None, rotation=None, norms=None))]
pub fn coded_key_logits<'py>(
    py: Python<'py>,
    encs: Vec<Bound<'py, PyEncodedLayer>>,
    streams: usize,
    queries: &Bound<'py, PyAny>,
    frames: Option<&Bound<'py, PyAny>>,
    rotation: Option<&Bound<'py, PyAny>>,
    norms: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let refs = layers(&encs);
    let coded = CodedStreams::new(&refs, streams).map_err(to_py)?;
    let q = f32_array::<numpy::Ix3>(queries, "queries")?;
    let g = q.shape()[1];
    let frames = frames
        .map(|f| f32_array::<numpy::Ix3>(f, "frames"))
        .transpose()?;
    let rotation = rotation
        .map(|r| f32_array::<numpy::Ix4>(r, "rotation"))
        .transpose()?;
    let norms = norms
        .map(|n| f32_array::<numpy::Ix2>(n, "norms"))
        .transpose()?;
    let heads = frames.as_ref().map(|f| f.shape()[0]);
    let rot = rotation.as_ref().map(|r| (r.shape()[0], r.shape()[3]));
    let (qs, fs) = (
        q.as_slice()?,
        frames.as_ref().map(|f| f.as_slice()).transpose()?,
    );
    let rs = rotation.as_ref().map(|r| r.as_slice()).transpose()?;
    let ns = norms.as_ref().map(|n| n.as_slice()).transpose()?;
    let t_n = coded.tokens();
    let out = py
        .detach(|| {
            let rotation = rs.zip(rot).map(|(values, (rows, pairs))| RopeAngles {
                values,
                rows,
                pairs,
            });
            core::key_logits(&coded, fs.zip(heads), rotation, ns, qs, g)
        })
        .map_err(to_py)?;
    output(py, out, [streams, g, t_n])
}

/// Weighted sums `[streams, g, head_dim]` of the values coded in `encs` (laid out as for
/// `coded_key_logits`), in frame coordinates: `sum_t weights[s, j, t] * norms[s, t] / |y_t| *
/// y_t`. `weights`: `[streams, g, tokens]`; `norms`: `[streams, tokens]` (None: scale 1).
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
    let w = f32_array::<numpy::Ix3>(weights, "weights")?;
    let g = w.shape()[1];
    let norms = norms
        .map(|n| f32_array::<numpy::Ix2>(n, "norms"))
        .transpose()?;
    let (ws, ns) = (
        w.as_slice()?,
        norms.as_ref().map(|n| n.as_slice()).transpose()?,
    );
    let d = coded.head_dim();
    let out = py
        .detach(|| core::value_sums(&coded, ws, ns, g))
        .map_err(to_py)?;
    output(py, out, [streams, g, d])
}
