//! `CodecParams`: an immutable, validated Python view of the core parameters.
//!
//! The core's `CodecParams::default()` is the one source of the defaults:
//! `codec_params_defaults()` returns it as a dict, and `tests/unit/test_params_defaults.py`
//! checks the constructor's signature, `to_dict()`, the stub and the `bench` flags against
//! it. The constructor builds the core struct whole and `to_dict` destructures it whole, so
//! a core field missing from either does not compile.

use kakeyaturbo::coded_attention::Precision;
use kakeyaturbo::params::{int_bound_error, int_field_bounds};
use kakeyaturbo::{Allocation, CodecParams, Metric, PcaMethod, SkeletonDtype};
use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyTuple};

use crate::errors::to_py;

/// Every knob of the codec, validated at construction (ValueError names the field).
#[pyclass(name = "CodecParams", module = "kakeyaturbo._core", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyCodecParams {
    pub inner: CodecParams,
}

/// The Python names of an enum's values: `name(v)` and `parse(s)` from one table (the
/// first name of each value is canonical, the others are accepted aliases).
macro_rules! py_names {
    ($parse:ident, $name:ident, $ty:ident, $field:literal, $expected:literal,
     { $($variant:ident => $canon:literal $(| $alias:literal)*),+ $(,)? }) => {
        fn $parse(s: &str) -> PyResult<$ty> {
            match s {
                $($canon $(| $alias)* => Ok($ty::$variant),)+
                _ => Err(PyValueError::new_err(format!(
                    concat!($field, " must be ", $expected, ", got {:?}"),
                    s
                ))),
            }
        }

        pub fn $name(v: $ty) -> &'static str {
            match v {
                $($ty::$variant => $canon,)+
            }
        }
    };
}

py_names!(parse_pca, pca_name, PcaMethod, "pca_method", "'exact', 'randomized' or 'none'", {
    Exact => "exact",
    Randomized => "randomized",
    None => "none",
});
py_names!(parse_metric, metric_name, Metric, "metric", "'mse' or 'inner_product'", {
    Mse => "mse",
    InnerProduct => "inner_product",
});
py_names!(parse_skeleton, skeleton_name, SkeletonDtype, "skeleton_dtype", "'fp16', 'bf16' or 'fp32'", {
    F16 => "fp16" | "float16",
    Bf16 => "bf16" | "bfloat16",
    F32 => "fp32" | "float32",
});
py_names!(parse_allocation, allocation_name, Allocation, "allocation", "'uniform' or 'waterfill'", {
    Uniform => "uniform",
    Waterfill => "waterfill",
});

/// The Python type name of `obj`, for messages.
fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_default()
}

/// An integer field: an int (not a bool) within the core's bounds for `name`. A value that
/// fits no Rust integer is a ValueError naming the range, like any other out of range.
fn int_arg(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    if obj.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "{name} must be an int, not bool"
        )));
    }
    let (lo, hi) = int_field_bounds(name).expect("an integer field of CodecParams");
    match obj.extract::<u64>() {
        Ok(v) if (lo..=hi).contains(&v) => Ok(v),
        Ok(v) => Err(to_py(int_bound_error(name, lo, hi, v))),
        Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => {
            Err(to_py(int_bound_error(name, lo, hi, obj.str()?)))
        }
        Err(_) => Err(PyTypeError::new_err(format!(
            "{name} must be an int, got {}",
            type_name(obj)
        ))),
    }
}

/// A float field: a real number (an int is fine, a bool is not).
fn float_arg(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<f64> {
    if obj.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "{name} must be a float, not bool"
        )));
    }
    obj.extract().map_err(|_| {
        PyTypeError::new_err(format!("{name} must be a float, got {}", type_name(obj)))
    })
}

/// One extractor per numeric field, so that its errors can name it (`from_py_with` takes
/// a function of the object alone, and PyO3 does not add the argument's name).
macro_rules! numeric_args {
    (int: $($int:ident),+; optional int: $($opt:ident),+; float: $($float:ident),+) => {
        mod arg {
            use super::*;
            $(pub fn $int(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
                int_arg(stringify!($int), obj)
            })+
            $(pub fn $opt(obj: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
                if obj.is_none() {
                    return Ok(None);
                }
                int_arg(stringify!($opt), obj).map(Some)
            })+
            $(pub fn $float(obj: &Bound<'_, PyAny>) -> PyResult<f64> {
                float_arg(stringify!($float), obj)
            })+
        }
    };
}

numeric_args!(
    int: block_size, bit_width, oversample, power_iters, k, kmeans_iters, seed;
    optional int: target_rank, rank_cap;
    float: variance_ratio, outlier_threshold, bits_per_value
);

/// Fields the core stores as 0 for "unset" and Python shows as None.
fn unset_if_zero(v: usize) -> Option<usize> {
    (v > 0).then_some(v)
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
        #[pyo3(from_py_with = arg::block_size)] block_size: u64,
        #[pyo3(from_py_with = arg::bit_width)] bit_width: u64,
        pca_method: &str,
        #[pyo3(from_py_with = arg::target_rank)] target_rank: Option<u64>,
        #[pyo3(from_py_with = arg::oversample)] oversample: u64,
        #[pyo3(from_py_with = arg::power_iters)] power_iters: u64,
        #[pyo3(from_py_with = arg::variance_ratio)] variance_ratio: f64,
        #[pyo3(from_py_with = arg::rank_cap)] rank_cap: Option<u64>,
        share_basis: bool,
        #[pyo3(from_py_with = arg::k)] k: u64,
        #[pyo3(from_py_with = arg::kmeans_iters)] kmeans_iters: u64,
        metric: &str,
        #[pyo3(from_py_with = arg::outlier_threshold)] outlier_threshold: f64,
        skeleton_dtype: &str,
        #[pyo3(from_py_with = arg::seed)] seed: u64,
        centroids: Option<Vec<f32>>,
        allocation: &str,
        #[pyo3(from_py_with = arg::bits_per_value)] bits_per_value: f64,
    ) -> PyResult<Self> {
        // Every integer is within its field's bounds here, so the casts are exact.
        let inner = CodecParams {
            block_size: block_size as usize,
            bit_width: bit_width as u8,
            pca_method: parse_pca(pca_method)?,
            target_rank: target_rank.unwrap_or(0) as usize,
            oversample: oversample as usize,
            power_iters: power_iters as usize,
            variance_ratio: variance_ratio as f32,
            rank_cap: rank_cap.unwrap_or(0) as usize,
            share_basis,
            k: k as usize,
            kmeans_iters: kmeans_iters as usize,
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
        unset_if_zero(self.inner.target_rank)
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
        unset_if_zero(self.inner.rank_cap)
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

    /// All fields as a dict that `CodecParams(**d)` accepts, in constructor order.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        // Destructured without `..`: a field added to the core does not compile until it
        // is added here.
        let CodecParams {
            block_size,
            bit_width,
            pca_method,
            target_rank,
            oversample,
            power_iters,
            variance_ratio,
            rank_cap,
            share_basis,
            k,
            kmeans_iters,
            metric,
            outlier_threshold,
            skeleton_dtype,
            seed,
            centroids,
            allocation,
            bits_per_value,
        } = &self.inner;
        let d = PyDict::new(py);
        d.set_item("block_size", block_size)?;
        d.set_item("bit_width", bit_width)?;
        d.set_item("pca_method", pca_name(*pca_method))?;
        d.set_item("target_rank", unset_if_zero(*target_rank))?;
        d.set_item("oversample", oversample)?;
        d.set_item("power_iters", power_iters)?;
        d.set_item("variance_ratio", *variance_ratio as f64)?;
        d.set_item("rank_cap", unset_if_zero(*rank_cap))?;
        d.set_item("share_basis", share_basis)?;
        d.set_item("k", k)?;
        d.set_item("kmeans_iters", kmeans_iters)?;
        d.set_item("metric", metric_name(*metric))?;
        d.set_item("outlier_threshold", *outlier_threshold as f64)?;
        d.set_item("skeleton_dtype", skeleton_name(*skeleton_dtype))?;
        d.set_item("seed", seed)?;
        d.set_item("centroids", centroids.clone())?;
        d.set_item("allocation", allocation_name(*allocation))?;
        d.set_item("bits_per_value", *bits_per_value as f64)?;
        Ok(d)
    }

    /// A copy with some fields changed (validated like the constructor; an unknown field
    /// is a TypeError, as in the constructor).
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
                    return Err(PyTypeError::new_err(format!(
                        "CodecParams.replace() got an unexpected keyword argument {key:?}: \
                         CodecParams has no field {key:?}"
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

/// The core's default parameters (`CodecParams::default()` in Rust) as a `to_dict()` dict:
/// the one source of truth the constructor's defaults, the stub and the CLI are checked
/// against.
#[pyfunction]
pub fn codec_params_defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    PyCodecParams {
        inner: CodecParams::default(),
    }
    .to_dict(py)
}

/// The key frame product's arithmetic from its Python name.
pub(crate) fn precision_arg(name: &str) -> PyResult<Precision> {
    match name {
        "float32" => Ok(Precision::F32),
        "bfloat16" => Ok(Precision::Bf16),
        "int16" => Ok(Precision::I16),
        _ => Err(pyo3::exceptions::PyValueError::new_err(format!(
            "precision must be 'float32', 'int16' or 'bfloat16', got {name:?}"
        ))),
    }
}
