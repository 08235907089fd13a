//! Refusing NaN and infinity at the attention entry points, before the kernels see them.
//!
//! The kernels' softmax takes its maximum with `f32::max`, which skips NaN, and clamps its
//! exponent, so a NaN query, key, norm, scale or bias would silently mask tokens or zero a
//! row. One pass per array here (integer tests on the bits, which vectorise; the place is
//! searched for only once something is wrong) turns that into a `ValueError` naming the
//! argument and the index. A bias may hold `-inf` (a mask) and nothing else non-finite.

use kakeyaturbo::int8_rows;
use numpy::ndarray::Dimension;
use numpy::{PyReadonlyArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::arrays::f32_array;

const F32_EXPONENT: u32 = 0x7F80_0000;
const F32_NEG_INF: u32 = 0xFF80_0000;
const BF16_EXPONENT: u16 = 0x7F80;
/// Largest int8 row scale taken: a row decodes to `code * scale` with codes up to 127, and the
/// codec's range is `|x| <= 60000` (`params.rs` `MAX_MAGNITUDE`); a scale far past it (bytes
/// 0x7F7F: 3.4e38) overflows the value sums to NaN. 1% over it allows the bfloat16 rounding.
const INT8_SCALE_MAX: f32 = 60000.0 / 127.0 * 1.01;

/// Whether any of `values` is NaN or infinite (`-inf` allowed with `neg_inf_ok`).
fn any_bad_f32(values: &[f32], neg_inf_ok: bool) -> bool {
    values.chunks(256).any(|chunk| {
        chunk.iter().fold(false, |acc, v| {
            let b = v.to_bits();
            acc | ((b & F32_EXPONENT == F32_EXPONENT) & !(neg_inf_ok & (b == F32_NEG_INF)))
        })
    })
}

/// `shape`'s index of flat position `i`, as Python writes it: "1, 0, 3".
fn index(mut i: usize, shape: &[usize]) -> String {
    let mut at = vec![0; shape.len()];
    for (a, &n) in at.iter_mut().zip(shape).rev() {
        *a = i % n.max(1);
        i /= n.max(1);
    }
    at.iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// `v` as Python's `str` of a float writes the values this reports: nan, inf, 3.39e+38.
fn py_float(v: f32) -> String {
    if v.is_nan() {
        "nan".into()
    } else if v.is_infinite() {
        if v > 0.0 { "inf" } else { "-inf" }.into()
    } else if v != 0.0 && !(1e-4..1e16).contains(&v.abs()) {
        let s = format!("{v:e}");
        match s.split_once('e') {
            Some((m, e)) if !e.starts_with('-') => format!("{m}e+{e:0>2}"),
            Some((m, e)) => format!("{m}e-{:0>2}", &e[1..]),
            None => s,
        }
    } else {
        v.to_string()
    }
}

/// A float32 array `arg` of `shape`: NaN or infinity (but `-inf` with `neg_inf_ok`) is a
/// `ValueError` naming the first place.
pub fn check_f32(arg: &str, values: &[f32], shape: &[usize], neg_inf_ok: bool) -> PyResult<()> {
    if !any_bad_f32(values, neg_inf_ok) {
        return Ok(());
    }
    let i = values
        .iter()
        .position(|v| v.is_nan() || (v.is_infinite() && !(neg_inf_ok && *v < 0.0)))
        .unwrap_or(0);
    let what = if neg_inf_ok {
        "must be finite or -inf (a mask)"
    } else {
        "must be finite"
    };
    Err(PyValueError::new_err(format!(
        "{arg}[{}] is {}: {what}",
        index(i, shape),
        py_float(values[i])
    )))
}

/// Raw bfloat16 bits `arg` of `shape`: NaN or infinity is a `ValueError` naming the place.
pub fn check_bf16(arg: &str, bits: &[u16], shape: &[usize]) -> PyResult<()> {
    let bad = |b: &u16| b & BF16_EXPONENT == BF16_EXPONENT;
    if !bits
        .chunks(256)
        .any(|c| c.iter().fold(false, |acc, b| acc | bad(b)))
    {
        return Ok(());
    }
    let i = bits.iter().position(bad).unwrap_or(0);
    let value = py_float(f32::from_bits(u32::from(bits[i]) << 16));
    Err(PyValueError::new_err(format!(
        "{arg}[{}] is {value}: bfloat16 values must be finite",
        index(i, shape)
    )))
}

/// Int8 rows `arg` of `shape` (`[..., D + 2]`): a scale that is not finite or is beyond the
/// codec's range is a `ValueError` naming the row.
pub fn check_int8_rows(arg: &str, rows: &[i8], shape: &[usize]) -> PyResult<()> {
    let w = shape.last().copied().unwrap_or(0);
    if w <= int8_rows::SCALE_BYTES {
        return Ok(()); // no codes: the shape check names it
    }
    let d = w - int8_rows::SCALE_BYTES;
    let bad = |row: &[i8]| {
        let s = int8_rows::scale(row, d);
        s.is_nan() || s.abs() > INT8_SCALE_MAX
    };
    let Some(r) = rows.chunks_exact(w).position(bad) else {
        return Ok(());
    };
    let scale = int8_rows::scale(&rows[r * w..][..w], d);
    Err(PyValueError::new_err(format!(
        "{arg} scales[{}] is {}: int8 rows' scales must be finite and at most \
         {INT8_SCALE_MAX:.1} (values within the codec's range, |x| <= 60000)",
        index(r, &shape[..shape.len() - 1]),
        py_float(scale)
    )))
}

/// A number `arg` that is NaN or infinite is a `ValueError`.
pub fn check_scalar(arg: &str, v: Option<f32>) -> PyResult<()> {
    match v {
        Some(v) if !v.is_finite() => Err(PyValueError::new_err(format!(
            "{arg} is {}: must be finite",
            py_float(v)
        ))),
        _ => Ok(()),
    }
}

/// [`f32_array`] refusing NaN and infinity (`-inf` too unless `neg_inf_ok`) by place.
pub(crate) fn finite_array<'py, D: Dimension>(
    obj: &Bound<'py, PyAny>,
    arg: &str,
    neg_inf_ok: bool,
) -> PyResult<PyReadonlyArray<'py, f32, D>> {
    let a = f32_array::<D>(obj, arg)?;
    check_f32(arg, a.as_slice()?, a.shape(), neg_inf_ok)?;
    Ok(a)
}

/// [`finite_array`] of an optional argument.
pub(crate) fn opt_finite_array<'py, D: Dimension>(
    obj: Option<&Bound<'py, PyAny>>,
    arg: &str,
    neg_inf_ok: bool,
) -> PyResult<Option<PyReadonlyArray<'py, f32, D>>> {
    obj.map(|o| finite_array::<D>(o, arg, neg_inf_ok))
        .transpose()
}
