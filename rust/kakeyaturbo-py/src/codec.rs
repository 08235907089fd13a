//! Encode / decode entry points. The work runs with the GIL released; batched calls run
//! their streams (and each stream's blocks) in parallel (where: `workers.rs`).

use kakeyaturbo::{self as core, parallel, EncodedLayer, ExternalBasis, InputDtype};
use numpy::ndarray::{Ix1, Ix2, Ix3};
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::arrays::ArrayIn;
use crate::errors::{to_py, to_py_in, type_error};
use crate::params::PyCodecParams;
use crate::workers;

/// One encoded `[tokens, head_dim]` stream: exactly its wire bytes in memory.
#[pyclass(name = "EncodedLayer", module = "kakeyaturbo._core", frozen)]
pub struct PyEncodedLayer {
    pub inner: EncodedLayer,
}

fn dtype_name(d: InputDtype) -> &'static str {
    match d {
        InputDtype::F32 => "float32",
        InputDtype::F16 => "float16",
        InputDtype::Bf16 => "bfloat16",
    }
}

#[pymethods]
impl PyEncodedLayer {
    /// Validates `data` completely (checksum, limits, every field); raises FormatError.
    #[staticmethod]
    fn from_bytes(py: Python<'_>, data: &[u8]) -> PyResult<Self> {
        let owned = data.to_vec();
        let inner = py
            .detach(|| EncodedLayer::from_bytes(owned))
            .map_err(to_py)?;
        Ok(PyEncodedLayer { inner })
    }

    /// The wire bytes (a copy).
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.inner.as_bytes())
    }

    /// Exact size of `to_bytes()`.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }

    /// `(tokens, head_dim)`.
    #[getter]
    fn shape(&self) -> (usize, usize) {
        self.inner.shape()
    }

    /// Dtype of the encoded input: 'float32', 'float16' or 'bfloat16'.
    #[getter]
    fn dtype(&self) -> &'static str {
        dtype_name(self.inner.input_dtype())
    }

    /// Fingerprint of the external basis needed to decode, or None.
    #[getter]
    fn basis_fingerprint(&self) -> Option<u64> {
        self.inner.external_fingerprint()
    }

    /// Parameters the layer was encoded with.
    #[getter]
    fn params(&self) -> PyCodecParams {
        PyCodecParams {
            inner: self.inner.params().clone(),
        }
    }

    /// One dict per block: n, d_eff, k_used, kmeans_iters, n_outliers.
    #[getter]
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for s in self.inner.stats() {
            let d = PyDict::new(py);
            d.set_item("n", s.n)?;
            d.set_item("d_eff", s.d_eff)?;
            d.set_item("k_used", s.k_used)?;
            d.set_item("kmeans_iters", s.kmeans_iters)?;
            d.set_item("n_outliers", s.n_outliers)?;
            list.append(d)?;
        }
        Ok(list)
    }

    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyBytes>,))> {
        let from_bytes = slf.get_type().getattr("from_bytes")?;
        Ok((from_bytes, (slf.get().to_bytes(slf.py()),)))
    }

    fn __repr__(&self) -> String {
        let (n, d) = self.inner.shape();
        format!(
            "EncodedLayer(shape=({n}, {d}), dtype={}, nbytes={}, blocks={})",
            dtype_name(self.inner.input_dtype()),
            self.inner.nbytes(),
            self.inner.stats().len()
        )
    }
}

/// An orthonormal basis supplied by the caller (e.g. from a calibration bundle): rows
/// `[d_eff, head_dim]`. Encodings store only its fingerprint; decoding needs it again.
#[pyclass(name = "Basis", module = "kakeyaturbo._core", frozen)]
pub struct PyBasis {
    pub inner: ExternalBasis,
}

#[pymethods]
impl PyBasis {
    #[new]
    fn new(rows: ArrayIn<'_, Ix2>) -> PyResult<Self> {
        let v = rows.values("rows", false)?;
        let (r, d) = (v.shape[0], v.shape[1]);
        let inner = ExternalBasis::new(v.data.into_owned(), r, d).map_err(to_py)?;
        Ok(PyBasis { inner })
    }
    /// The rows as a float32 `[d_eff, head_dim]` array.
    #[getter]
    fn rows<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let e = &self.inner;
        Ok(PyArray1::from_slice(py, e.rows())
            .reshape([e.d_eff(), e.head_dim()])?
            .into_any())
    }
    /// Number of rows.
    #[getter]
    fn d_eff(&self) -> usize {
        self.inner.d_eff()
    }
    /// Row length.
    #[getter]
    fn head_dim(&self) -> usize {
        self.inner.head_dim()
    }
    /// The 64-bit fingerprint stored in encodings.
    #[getter]
    fn fingerprint(&self) -> u64 {
        self.inner.fingerprint()
    }
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyAny>,))> {
        Ok((slf.get_type().into_any(), (slf.get().rows(slf.py())?,)))
    }
    fn __repr__(&self) -> String {
        format!(
            "Basis(d_eff={}, head_dim={}, fingerprint={:#018x})",
            self.inner.d_eff(),
            self.inner.head_dim(),
            self.inner.fingerprint()
        )
    }
}

/// One basis for every stream, or one per stream.
fn bases_for<'a>(
    bases: &'a Option<Vec<Bound<'_, PyBasis>>>,
    streams: usize,
) -> PyResult<Vec<Option<&'a ExternalBasis>>> {
    match bases {
        None => Ok(vec![None; streams]),
        Some(list) if list.len() == 1 => Ok(vec![Some(&list[0].get().inner); streams]),
        Some(list) if list.len() == streams => {
            Ok(list.iter().map(|b| Some(&b.get().inner)).collect())
        }
        Some(list) => Err(PyValueError::new_err(format!(
            "bases: {} bases for {streams} streams (give one, or one per stream)",
            list.len()
        ))),
    }
}

fn weights_slice<'a>(
    w: &'a Option<PyReadonlyArray1<'_, f32>>,
    n: usize,
) -> PyResult<Option<&'a [f32]>> {
    match w {
        None => Ok(None),
        Some(a) => {
            let s = a
                .as_slice()
                .map_err(|_| type_error("weights", "must be a contiguous float32 array"))?;
            if s.len() != n {
                return Err(PyValueError::new_err(format!(
                    "weights: has {} entries for {n} tokens",
                    s.len()
                )));
            }
            Ok(Some(s))
        }
    }
}

/// Encodes one `[tokens, head_dim]` array (with an optional caller-supplied basis).
#[pyfunction]
#[pyo3(signature = (x, params, weights=None, bf16_bits=false, basis=None))]
pub fn encode_layer(
    py: Python<'_>,
    x: ArrayIn<'_, Ix2>,
    params: &PyCodecParams,
    weights: Option<PyReadonlyArray1<'_, f32>>,
    bf16_bits: bool,
    basis: Option<Bound<'_, PyBasis>>,
) -> PyResult<PyEncodedLayer> {
    let v = x.values("x", bf16_bits)?;
    let (n, d) = (v.shape[0], v.shape[1]);
    let w = weights_slice(&weights, n)?;
    let p = &params.inner;
    let ext = basis.as_ref().map(|b| &b.get().inner);
    let inner = workers::detach(py, || {
        core::encode_layer_with(&v.data, n, d, w, p, v.dtype, ext)
    })
    .map_err(to_py)?;
    Ok(PyEncodedLayer { inner })
}

/// Encodes `[streams, tokens, head_dim]`: one EncodedLayer per stream, in parallel.
#[pyfunction]
#[pyo3(signature = (x, params, bf16_bits=false, bases=None))]
pub fn encode_batch(
    py: Python<'_>,
    x: ArrayIn<'_, Ix3>,
    params: &PyCodecParams,
    bf16_bits: bool,
    bases: Option<Vec<Bound<'_, PyBasis>>>,
) -> PyResult<Vec<PyEncodedLayer>> {
    let v = x.values("x", bf16_bits)?;
    let (s, n, d) = (v.shape[0], v.shape[1], v.shape[2]);
    if s == 0 {
        return Err(PyValueError::new_err("x: the batch holds no streams"));
    }
    let p = &params.inner;
    let data: &[f32] = &v.data;
    let dtype = v.dtype;
    let ext = bases_for(&bases, s)?;
    let layers = workers::detach(py, || {
        parallel::map(s, |i| {
            let xi = &data[i * n * d..(i + 1) * n * d];
            core::encode_layer_with(xi, n, d, None, p, dtype, ext[i]).map_err(|e| (i, e))
        })
        .into_iter()
        .collect::<Result<Vec<_>, _>>()
    })
    .map_err(|(i, e)| to_py_in(&format!("x: stream {i}"), e))?;
    Ok(layers
        .into_iter()
        .map(|inner| PyEncodedLayer { inner })
        .collect())
}

/// Decodes to a float32 `[tokens, head_dim]` array.
#[pyfunction]
#[pyo3(signature = (enc, basis=None))]
pub fn decode_layer<'py>(
    py: Python<'py>,
    enc: &PyEncodedLayer,
    basis: Option<Bound<'py, PyBasis>>,
) -> PyResult<Bound<'py, PyAny>> {
    let (n, d) = enc.inner.shape();
    let ext = basis.as_ref().map(|b| &b.get().inner);
    let out = workers::detach(py, || core::decode_layer_with(&enc.inner, ext)).map_err(to_py)?;
    Ok(PyArray1::from_vec(py, out).reshape([n, d])?.into_any())
}

/// Decodes equally shaped layers to one float32 `[streams, tokens, head_dim]` array.
#[pyfunction]
#[pyo3(signature = (encs, bases=None))]
pub fn decode_batch<'py>(
    py: Python<'py>,
    encs: Vec<Bound<'py, PyEncodedLayer>>,
    bases: Option<Vec<Bound<'py, PyBasis>>>,
) -> PyResult<Bound<'py, PyAny>> {
    let refs: Vec<&EncodedLayer> = encs.iter().map(|e| &e.get().inner).collect();
    let Some(first) = refs.first() else {
        return Err(PyValueError::new_err("encs: the list is empty"));
    };
    let (n, d) = first.shape();
    if let Some(i) = refs.iter().position(|e| e.shape() != (n, d)) {
        return Err(PyValueError::new_err(format!(
            "encs[{i}] has shape {:?}, encs[0] has {:?}: decode_batch needs equal shapes",
            refs[i].shape(),
            (n, d)
        )));
    }
    let s = refs.len();
    let ext = bases_for(&bases, s)?;
    // Each layer met the decode limit on its own; the batch must meet it in total before
    // its output is allocated.
    core::check_batch_decode(&refs).map_err(|e| to_py_in("encs", e))?;
    let out = workers::detach(py, || -> Result<Vec<f32>, (usize, kakeyaturbo::Error)> {
        let mut out = vec![0.0f32; s * n * d];
        parallel::map_chunks(&mut out, n * d, |i, chunk| {
            core::decode_layer_into(refs[i], ext[i], chunk).map_err(|err| (i, err))
        })
        .into_iter()
        .collect::<Result<(), _>>()?;
        Ok(out)
    })
    .map_err(|(i, e)| to_py_in(&format!("encs[{i}]"), e))?;
    Ok(PyArray1::from_vec(py, out).reshape([s, n, d])?.into_any())
}

/// Relative Frobenius error after each pipeline stage (pca, skeleton, quantised, full).
#[pyfunction]
pub fn stage_errors<'py>(
    py: Python<'py>,
    x: ArrayIn<'_, Ix2>,
    params: &PyCodecParams,
) -> PyResult<Bound<'py, PyDict>> {
    let v = x.values("x", false)?;
    let (n, d) = (v.shape[0], v.shape[1]);
    let p = &params.inner;
    let s = py
        .detach(|| core::stage_errors(&v.data, n, d, p))
        .map_err(to_py)?;
    let out = PyDict::new(py);
    out.set_item("pca", s.pca)?;
    out.set_item("skeleton", s.skeleton)?;
    out.set_item("quantised", s.quantised)?;
    out.set_item("full", s.full)?;
    Ok(out)
}

/// The Gaussian Lloyd-Max levels for `bits` in 1..=8.
#[pyfunction]
pub fn gaussian_codebook(bits: u8) -> PyResult<Vec<f32>> {
    Ok(kakeyaturbo::lloyd_max::gaussian(bits)
        .map_err(to_py)?
        .levels()
        .to_vec())
}

/// The Gaussian Lloyd-Max codebooks' distortions `D(b)` for `b` in 0..=8 (`D(0) = 1`): the
/// table water-filling spends bits by, for an encoder outside the codec (`device_encode.py`).
#[pyfunction]
pub fn gaussian_distortions() -> Vec<f64> {
    (0..=kakeyaturbo::waterfill::MAX_COMPONENT_BITS)
        .map(kakeyaturbo::lloyd_max::gaussian_distortion)
        .collect()
}

/// Lloyd-Max levels fitted to `samples` (for calibrated codebooks).
#[pyfunction]
#[pyo3(signature = (samples, bits, iters=100))]
pub fn fit_codebook(
    py: Python<'_>,
    samples: ArrayIn<'_, Ix1>,
    bits: u8,
    iters: usize,
) -> PyResult<Vec<f32>> {
    let v = samples.values("samples", false)?;
    if !matches!(bits, 1 | 2 | 3 | 4 | 8) {
        return Err(PyValueError::new_err(format!(
            "bits must be 1, 2, 3, 4 or 8, got {bits}"
        )));
    }
    let cb = py
        .detach(|| kakeyaturbo::lloyd_max::Codebook::fit(&v.data, bits, iters))
        .map_err(to_py)?;
    Ok(cb.levels().to_vec())
}

/// Applies the codec's orthonormal randomized WHT (length a power of two) to a copy.
#[pyfunction]
#[pyo3(signature = (x, seed, inverse=false))]
pub fn wht_rotate(x: Vec<f32>, seed: u64, inverse: bool) -> PyResult<Vec<f32>> {
    if x.is_empty() || !x.len().is_power_of_two() {
        return Err(PyValueError::new_err(format!(
            "x: length must be a power of two, got {}",
            x.len()
        )));
    }
    let rot = kakeyaturbo::wht::Rotation::new(x.len(), seed);
    let mut y = x;
    if inverse {
        rot.inverse(&mut y);
    } else {
        rot.forward(&mut y);
    }
    Ok(y)
}

/// The sections of a water-filled layer coded without a basis (`pca_method = 'none'`, what
/// the pipeline's recipes write), one dict per block, for a decoder outside the codec (torch
/// on an accelerator, `kakeyaturbo/device_decode.py`): `n`; `mean`, `sigma` float32 `[d]`
/// (exactly their stored float16/bfloat16 values); `bits` uint8 `[d]`; `gains` float32 `[9]`,
/// the reconstruction gain per width; `codes` uint8, the packed code stream as stored;
/// `outlier_pos` int64 (`vector * d + component`, ascending) and `outlier_val` float32.
/// A vector's value `j` is `mean_j + (level_{bits_j}(code) * sigma_j) * gains[bits_j]`
/// (`mean_j` where `bits_j = 0`), and an outlier's `mean_j + val * sigma_j`: the codec's own
/// arithmetic, in its order. The layer is read (checksum and every field) as `decode_layer` reads it.
#[pyfunction]
pub fn waterfill_sections<'py>(
    py: Python<'py>,
    enc: &PyEncodedLayer,
) -> PyResult<Bound<'py, PyList>> {
    use kakeyaturbo::format::{read_layer, ParsedBody};
    use kakeyaturbo::waterfill::ip_gain;
    let parsed = read_layer(enc.inner.as_bytes()).map_err(to_py)?;
    let p = &parsed.params;
    if p.pca_method != core::PcaMethod::None || parsed.shared.is_some() {
        return Err(PyValueError::new_err(
            "enc: waterfill_sections reads layers coded without a basis (pca_method='none')",
        ));
    }
    let gains: Vec<f32> = (0..=core::waterfill::MAX_COMPONENT_BITS)
        .map(|b| match p.metric {
            core::Metric::InnerProduct => ip_gain(b),
            _ => 1.0,
        })
        .collect();
    let list = PyList::empty(py);
    for b in &parsed.blocks {
        let ParsedBody::Waterfill(w) = &b.body else {
            return Err(PyValueError::new_err(
                "enc: waterfill_sections reads water-filled layers (allocation='waterfill')",
            ));
        };
        let d = PyDict::new(py);
        d.set_item("n", b.n)?;
        d.set_item("mean", PyArray1::from_slice(py, &b.mean))?;
        let sigma: Vec<f32> = w.sigma.iter().map(|s| s.to_f32()).collect();
        d.set_item("sigma", PyArray1::from_vec(py, sigma))?;
        d.set_item("bits", PyArray1::from_slice(py, &w.comp_bits))?;
        d.set_item("gains", PyArray1::from_slice(py, &gains))?;
        d.set_item("codes", PyArray1::from_slice(py, w.codes))?;
        let pos: Vec<i64> = w.outliers.iter().map(|&(i, _)| i as i64).collect();
        let val: Vec<f32> = w.outliers.iter().map(|&(_, v)| v.to_f32()).collect();
        d.set_item("outlier_pos", PyArray1::from_vec(py, pos))?;
        d.set_item("outlier_val", PyArray1::from_vec(py, val))?;
        list.append(d)?;
    }
    Ok(list)
}
