//! Encode / decode entry points. The work runs with the GIL released; batched calls run
//! their streams (and each stream's blocks) in parallel on rayon's pool.

use kakeyaturbo::{self as core, EncodedLayer, InputDtype};
use numpy::ndarray::{Ix1, Ix2, Ix3};
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use rayon::prelude::*;

use crate::arrays::ArrayIn;
use crate::errors::{to_py, type_error};
use crate::params::PyCodecParams;

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

/// Encodes one `[tokens, head_dim]` array.
#[pyfunction]
#[pyo3(signature = (x, params, weights=None, bf16_bits=false))]
pub fn encode_layer(
    py: Python<'_>,
    x: ArrayIn<'_, Ix2>,
    params: &PyCodecParams,
    weights: Option<PyReadonlyArray1<'_, f32>>,
    bf16_bits: bool,
) -> PyResult<PyEncodedLayer> {
    let v = x.values("x", bf16_bits)?;
    let (n, d) = (v.shape[0], v.shape[1]);
    let w = weights_slice(&weights, n)?;
    let p = &params.inner;
    let inner = py
        .detach(|| core::encode_layer(&v.data, n, d, w, p, v.dtype))
        .map_err(to_py)?;
    Ok(PyEncodedLayer { inner })
}

/// Encodes `[streams, tokens, head_dim]`: one EncodedLayer per stream, in parallel.
#[pyfunction]
#[pyo3(signature = (x, params, bf16_bits=false))]
pub fn encode_batch(
    py: Python<'_>,
    x: ArrayIn<'_, Ix3>,
    params: &PyCodecParams,
    bf16_bits: bool,
) -> PyResult<Vec<PyEncodedLayer>> {
    let v = x.values("x", bf16_bits)?;
    let (s, n, d) = (v.shape[0], v.shape[1], v.shape[2]);
    if s == 0 {
        return Err(PyValueError::new_err("x: the batch holds no streams"));
    }
    let p = &params.inner;
    let data: &[f32] = &v.data;
    let dtype = v.dtype;
    let layers = py
        .detach(|| {
            (0..s)
                .into_par_iter()
                .map(|i| {
                    core::encode_layer(&data[i * n * d..(i + 1) * n * d], n, d, None, p, dtype)
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .map_err(to_py)?;
    Ok(layers
        .into_iter()
        .map(|inner| PyEncodedLayer { inner })
        .collect())
}

/// Decodes to a float32 `[tokens, head_dim]` array.
#[pyfunction]
pub fn decode_layer<'py>(py: Python<'py>, enc: &PyEncodedLayer) -> PyResult<Bound<'py, PyAny>> {
    let (n, d) = enc.inner.shape();
    let out = py
        .detach(|| core::decode_layer(&enc.inner))
        .map_err(to_py)?;
    Ok(PyArray1::from_vec(py, out).reshape([n, d])?.into_any())
}

/// Decodes equally shaped layers to one float32 `[streams, tokens, head_dim]` array.
#[pyfunction]
pub fn decode_batch<'py>(
    py: Python<'py>,
    encs: Vec<Bound<'py, PyEncodedLayer>>,
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
    let out = py
        .detach(|| -> Result<Vec<f32>, kakeyaturbo::Error> {
            let mut out = vec![0.0f32; s * n * d];
            out.par_chunks_mut(n * d)
                .zip(refs.par_iter())
                .try_for_each(|(chunk, e)| {
                    chunk.copy_from_slice(&core::decode_layer(e)?);
                    Ok(())
                })?;
            Ok(out)
        })
        .map_err(to_py)?;
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

/// The Gaussian Lloyd-Max levels for `bits` (1, 2, 3, 4, 8).
#[pyfunction]
pub fn gaussian_codebook(bits: u8) -> PyResult<Vec<f32>> {
    Ok(kakeyaturbo::lloyd_max::gaussian(bits)
        .map_err(to_py)?
        .levels()
        .to_vec())
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
