//! `int8_rows_encode`: the binding of `kakeyaturbo::int8_rows::encode` (a cache's hot-window
//! values as int8 rows, one call per decode step instead of a dozen torch ops).

use kakeyaturbo::int8_rows;
use numpy::ndarray::IxDyn;
use numpy::{PyArray, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::errors::{to_py, type_error};

/// `x` `[..., D]` float32 (C-contiguous, at least one dim, `D > 0`) as int8 rows `[..., D + 2]`:
/// per row `D` codes and the two bytes of its bfloat16 scale, the bits of the torch encoder
/// (`kakeyaturbo.hf.int8_rows`). A row holding NaN or infinity is a `ValueError` naming it: its
/// scale would not be finite, and every attention over it would give NaN.
#[pyfunction]
pub fn int8_rows_encode<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let want = "expected a C-contiguous float32 array of 1 or more dims, the last not empty";
    let a = x
        .extract::<PyReadonlyArrayDyn<'py, f32>>()
        .map_err(|_| type_error("x", want))?;
    let mut shape = a.shape().to_vec();
    let d = shape.last().copied().unwrap_or(0);
    if !a.is_c_contiguous() || d == 0 {
        return Err(type_error("x", want));
    }
    let values = a.as_slice()?;
    // One pass the compiler vectorises; only a bad input is scanned again for the place.
    if !values.iter().all(|v| v.is_finite()) {
        let i = values.iter().position(|v| !v.is_finite()).unwrap_or(0);
        return Err(PyValueError::new_err(format!(
            "x: row {} holds {} at column {}: int8 rows hold finite values only",
            i / d,
            values[i],
            i % d
        )));
    }
    let held = py.detach(|| int8_rows::encode(values, d)).map_err(to_py)?;
    *shape.last_mut().expect("one dim") = d + int8_rows::SCALE_BYTES;
    Ok(PyArray::from_vec(py, held)
        .reshape(IxDyn(&shape))?
        .into_any())
}
