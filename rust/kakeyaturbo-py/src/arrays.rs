//! Array inputs: float32 and float16 numpy arrays, and bfloat16 passed as its raw uint16
//! bits (numpy has no bfloat16; torch tensors are viewed as int16 without a copy).
//! float32 C-contiguous input is read in place; other dtypes are widened to f32 once.

use half::{bf16, f16};
use kakeyaturbo::InputDtype;
use numpy::ndarray::Dimension;
use numpy::{Element, PyReadonlyArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use std::borrow::Cow;

use crate::errors::type_error;

/// An array of any supported dtype and dimensionality `D`.
pub enum ArrayIn<'py, D: Dimension> {
    F32(PyReadonlyArray<'py, f32, D>),
    F16(PyReadonlyArray<'py, f16, D>),
    U16(PyReadonlyArray<'py, u16, D>),
}

impl<'a, 'py, D: Dimension> FromPyObject<'a, 'py> for ArrayIn<'py, D> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(a) = obj.extract::<PyReadonlyArray<'py, f32, D>>() {
            return Ok(ArrayIn::F32(a));
        }
        if let Ok(a) = obj.extract::<PyReadonlyArray<'py, f16, D>>() {
            return Ok(ArrayIn::F16(a));
        }
        if let Ok(a) = obj.extract::<PyReadonlyArray<'py, u16, D>>() {
            return Ok(ArrayIn::U16(a));
        }
        let ty = obj
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default();
        let dims = D::NDIM.map(|n| format!("{n}-D ")).unwrap_or_default();
        Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "expected a {dims}numpy array of float32, float16 or (bfloat16 bits as) uint16, got {ty}"
        )))
    }
}

/// Values as f32 (borrowed when possible), the shape, and the dtype to restore.
pub struct Values<'a> {
    pub data: Cow<'a, [f32]>,
    pub shape: Vec<usize>,
    pub dtype: InputDtype,
}

fn widen<T: Element + Copy, D: Dimension>(
    a: &PyReadonlyArray<'_, T, D>,
    f: impl Fn(T) -> f32,
) -> Vec<f32> {
    match a.as_slice() {
        Ok(s) => s.iter().map(|&v| f(v)).collect(),
        Err(_) => a.as_array().iter().map(|&v| f(v)).collect(),
    }
}

impl<D: Dimension> ArrayIn<'_, D> {
    /// Reads the array (zero-copy for contiguous float32); `bf16_bits` says a uint16
    /// array holds bfloat16 bit patterns (and uint16 is accepted only then).
    pub fn values(&self, arg: &str, bf16_bits: bool) -> PyResult<Values<'_>> {
        let is_u16 = matches!(self, ArrayIn::U16(_));
        if bf16_bits && !is_u16 {
            return Err(type_error(
                arg,
                "bf16_bits=True needs a uint16 array of raw bfloat16 bits",
            ));
        }
        if is_u16 && !bf16_bits {
            return Err(type_error(
                arg,
                "uint16 input is accepted only as raw bfloat16 bits (bf16_bits=True)",
            ));
        }
        Ok(match self {
            ArrayIn::F32(a) => Values {
                data: match a.as_slice() {
                    Ok(s) => Cow::Borrowed(s),
                    Err(_) => Cow::Owned(a.as_array().iter().copied().collect()),
                },
                shape: a.shape().to_vec(),
                dtype: InputDtype::F32,
            },
            ArrayIn::F16(a) => Values {
                data: Cow::Owned(widen(a, f16::to_f32)),
                shape: a.shape().to_vec(),
                dtype: InputDtype::F16,
            },
            ArrayIn::U16(a) => Values {
                data: Cow::Owned(widen(a, |b| bf16::from_bits(b).to_f32())),
                shape: a.shape().to_vec(),
                dtype: InputDtype::Bf16,
            },
        })
    }
}

/// A float32 array of `D` dims, C-contiguous, or a TypeError naming `arg`.
pub(crate) fn f32_array<'py, D: Dimension>(
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

/// [`f32_array`] of an optional argument.
pub(crate) fn opt_f32_array<'py, D: Dimension>(
    obj: Option<&Bound<'py, PyAny>>,
    arg: &str,
) -> PyResult<Option<PyReadonlyArray<'py, f32, D>>> {
    obj.map(|o| f32_array::<D>(o, arg)).transpose()
}
