//! `CodecParams`: an immutable, validated Python view of the core parameters.

use kakeyaturbo::{Allocation, CodecParams, Metric, PcaMethod, SkeletonDtype};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::errors::to_py;

/// Every knob of the codec, validated at construction (ValueError names the field).
#[pyclass(name = "CodecParams", module = "kakeyaturbo._core", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyCodecParams {
    pub inner: CodecParams,
}

fn parse_pca(s: &str) -> PyResult<PcaMethod> {
    match s {
        "exact" => Ok(PcaMethod::Exact),
        "randomized" => Ok(PcaMethod::Randomized),
        "none" => Ok(PcaMethod::None),
        _ => Err(PyValueError::new_err(format!(
            "pca_method must be 'exact', 'randomized' or 'none', got {s:?}"
        ))),
    }
}

fn parse_metric(s: &str) -> PyResult<Metric> {
    match s {
        "mse" => Ok(Metric::Mse),
        "inner_product" => Ok(Metric::InnerProduct),
        _ => Err(PyValueError::new_err(format!(
            "metric must be 'mse' or 'inner_product', got {s:?}"
        ))),
    }
}

fn parse_skeleton(s: &str) -> PyResult<SkeletonDtype> {
    match s {
        "fp16" | "float16" => Ok(SkeletonDtype::F16),
        "bf16" | "bfloat16" => Ok(SkeletonDtype::Bf16),
        "fp32" | "float32" => Ok(SkeletonDtype::F32),
        _ => Err(PyValueError::new_err(format!(
            "skeleton_dtype must be 'fp16', 'bf16' or 'fp32', got {s:?}"
        ))),
    }
}

fn parse_allocation(s: &str) -> PyResult<Allocation> {
    match s {
        "uniform" => Ok(Allocation::Uniform),
        "waterfill" => Ok(Allocation::Waterfill),
        _ => Err(PyValueError::new_err(format!(
            "allocation must be 'uniform' or 'waterfill', got {s:?}"
        ))),
    }
}

pub fn allocation_name(a: Allocation) -> &'static str {
    match a {
        Allocation::Uniform => "uniform",
        Allocation::Waterfill => "waterfill",
    }
}

pub fn pca_name(m: PcaMethod) -> &'static str {
    match m {
        PcaMethod::Exact => "exact",
        PcaMethod::Randomized => "randomized",
        PcaMethod::None => "none",
    }
}

pub fn metric_name(m: Metric) -> &'static str {
    match m {
        Metric::Mse => "mse",
        Metric::InnerProduct => "inner_product",
    }
}

pub fn skeleton_name(d: SkeletonDtype) -> &'static str {
    match d {
        SkeletonDtype::F16 => "fp16",
        SkeletonDtype::Bf16 => "bf16",
        SkeletonDtype::F32 => "fp32",
    }
}

fn non_negative(name: &str, v: i64) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| PyValueError::new_err(format!("{name} must be >= 0, got {v}")))
}

#[pymethods]
impl PyCodecParams {
    #[new]
    #[pyo3(signature = (*, block_size=512, bit_width=3, pca_method="exact", target_rank=None,
        oversample=8, power_iters=2, variance_ratio=1.0, rank_cap=None, share_basis=false,
        k=16, kmeans_iters=8, metric="mse", outlier_threshold=4.0, skeleton_dtype="fp16",
        seed=0, centroids=None, allocation="uniform", bits_per_value=2.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        block_size: i64,
        bit_width: i64,
        pca_method: &str,
        target_rank: Option<i64>,
        oversample: i64,
        power_iters: i64,
        variance_ratio: f64,
        rank_cap: Option<i64>,
        share_basis: bool,
        k: i64,
        kmeans_iters: i64,
        metric: &str,
        outlier_threshold: f64,
        skeleton_dtype: &str,
        seed: u64,
        centroids: Option<Vec<f32>>,
        allocation: &str,
        bits_per_value: f64,
    ) -> PyResult<Self> {
        let bit_width = u8::try_from(bit_width).map_err(|_| {
            PyValueError::new_err(format!(
                "bit_width must be 1, 2, 3, 4 or 8, got {bit_width}"
            ))
        })?;
        let inner = CodecParams {
            block_size: non_negative("block_size", block_size)?,
            bit_width,
            pca_method: parse_pca(pca_method)?,
            target_rank: non_negative("target_rank", target_rank.unwrap_or(0))?,
            oversample: non_negative("oversample", oversample)?,
            power_iters: non_negative("power_iters", power_iters)?,
            variance_ratio: variance_ratio as f32,
            rank_cap: non_negative("rank_cap", rank_cap.unwrap_or(0))?,
            share_basis,
            k: non_negative("k", k)?,
            kmeans_iters: non_negative("kmeans_iters", kmeans_iters)?,
            metric: parse_metric(metric)?,
            outlier_threshold: outlier_threshold as f32,
            skeleton_dtype: parse_skeleton(skeleton_dtype)?,
            seed,
            centroids,
            allocation: parse_allocation(allocation)?,
            bits_per_value: bits_per_value as f32,
        };
        inner.validate().map_err(to_py)?;
        Ok(PyCodecParams { inner })
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size
    }
    #[getter]
    fn bit_width(&self) -> u8 {
        self.inner.bit_width
    }
    #[getter]
    fn pca_method(&self) -> &'static str {
        pca_name(self.inner.pca_method)
    }
    #[getter]
    fn target_rank(&self) -> Option<usize> {
        (self.inner.target_rank > 0).then_some(self.inner.target_rank)
    }
    #[getter]
    fn oversample(&self) -> usize {
        self.inner.oversample
    }
    #[getter]
    fn power_iters(&self) -> usize {
        self.inner.power_iters
    }
    #[getter]
    fn variance_ratio(&self) -> f32 {
        self.inner.variance_ratio
    }
    #[getter]
    fn rank_cap(&self) -> Option<usize> {
        (self.inner.rank_cap > 0).then_some(self.inner.rank_cap)
    }
    #[getter]
    fn share_basis(&self) -> bool {
        self.inner.share_basis
    }
    #[getter]
    fn k(&self) -> usize {
        self.inner.k
    }
    #[getter]
    fn kmeans_iters(&self) -> usize {
        self.inner.kmeans_iters
    }
    #[getter]
    fn metric(&self) -> &'static str {
        metric_name(self.inner.metric)
    }
    #[getter]
    fn outlier_threshold(&self) -> f32 {
        self.inner.outlier_threshold
    }
    #[getter]
    fn skeleton_dtype(&self) -> &'static str {
        skeleton_name(self.inner.skeleton_dtype)
    }
    #[getter]
    fn seed(&self) -> u64 {
        self.inner.seed
    }
    #[getter]
    fn centroids(&self) -> Option<Vec<f32>> {
        self.inner.centroids.clone()
    }
    #[getter]
    fn allocation(&self) -> &'static str {
        allocation_name(self.inner.allocation)
    }
    #[getter]
    fn bits_per_value(&self) -> f32 {
        self.inner.bits_per_value
    }

    /// All fields as a dict that `CodecParams(**d)` accepts.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("block_size", self.block_size())?;
        d.set_item("bit_width", self.bit_width())?;
        d.set_item("pca_method", self.pca_method())?;
        d.set_item("target_rank", self.target_rank())?;
        d.set_item("oversample", self.oversample())?;
        d.set_item("power_iters", self.power_iters())?;
        d.set_item("variance_ratio", self.variance_ratio() as f64)?;
        d.set_item("rank_cap", self.rank_cap())?;
        d.set_item("share_basis", self.share_basis())?;
        d.set_item("k", self.k())?;
        d.set_item("kmeans_iters", self.kmeans_iters())?;
        d.set_item("metric", self.metric())?;
        d.set_item("outlier_threshold", self.outlier_threshold() as f64)?;
        d.set_item("skeleton_dtype", self.skeleton_dtype())?;
        d.set_item("seed", self.seed())?;
        d.set_item("centroids", self.centroids())?;
        d.set_item("allocation", self.allocation())?;
        d.set_item("bits_per_value", self.bits_per_value() as f64)?;
        Ok(d)
    }

    /// A copy with some fields changed (validated like the constructor).
    #[pyo3(signature = (**changes))]
    fn replace<'py>(
        slf: &Bound<'py, Self>,
        changes: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let d = slf.get().to_dict(slf.py())?;
        if let Some(c) = changes {
            for (k, v) in c.iter() {
                let key: String = k.extract()?;
                if !d.contains(&key)? {
                    return Err(PyValueError::new_err(format!(
                        "CodecParams has no field {key:?}"
                    )));
                }
                d.set_item(key, v)?;
            }
        }
        slf.get_type().call((), Some(&d))
    }

    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        // The constructor is keyword-only, so pickle goes through a helper taking a dict.
        let py = slf.py();
        let helper = py
            .import("kakeyaturbo._core")?
            .getattr("_params_from_dict")?;
        let args = PyTuple::new(py, [slf.get().to_dict(py)?])?;
        Ok((helper, args))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let d = self.to_dict(py)?;
        let mut parts = Vec::new();
        for (k, v) in d.iter() {
            parts.push(format!("{}={}", k, v.repr()?));
        }
        Ok(format!("CodecParams({})", parts.join(", ")))
    }
}

/// Rebuilds params from `to_dict()` output (used by pickle).
#[pyfunction]
pub fn _params_from_dict<'py>(
    py: Python<'py>,
    d: &Bound<'py, PyDict>,
) -> PyResult<Bound<'py, PyAny>> {
    py.get_type::<PyCodecParams>().call((), Some(d))
}
