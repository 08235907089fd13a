//! Python exception classes, one per kind of core error. Errors that carry data keep it
//! as attributes: `ChecksumError.stored` / `.computed` (ints), and
//! `UnsupportedVersionError.version` (int) / `.supported` (tuple of the readable versions).

use kakeyaturbo::format::READABLE_VERSIONS;
use kakeyaturbo::Error;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

create_exception!(
    kakeyaturbo._core,
    KakeyaTurboError,
    PyException,
    "Base class of every error raised by kakeyaturbo."
);
create_exception!(
    kakeyaturbo._core,
    FormatError,
    KakeyaTurboError,
    "Encoded bytes are corrupt, truncated, or violate a format limit."
);
create_exception!(
    kakeyaturbo._core,
    ChecksumError,
    FormatError,
    "The CRC-32 stored in the encoded bytes does not match their contents (`stored`,\n\
     `computed`: the two checksums, as ints)."
);
create_exception!(
    kakeyaturbo._core,
    UnsupportedVersionError,
    FormatError,
    "The encoded bytes use a format version this build cannot read (`version`: the\n\
     blob's, `supported`: the versions this build reads)."
);

/// Maps a core error onto its Python exception: input problems become `ValueError`
/// (as Python users expect), byte problems the `FormatError` family.
pub fn to_py(err: Error) -> PyErr {
    raise(err.to_string(), &err)
}

/// [`to_py`] with `context` (which stream, which argument) before the message.
pub fn to_py_in(context: &str, err: Error) -> PyErr {
    raise(format!("{context}: {err}"), &err)
}

fn raise(msg: String, err: &Error) -> PyErr {
    match *err {
        Error::InvalidParams(_) | Error::Shape(_) | Error::NonFinite { .. } => {
            PyValueError::new_err(msg)
        }
        Error::Checksum { stored, computed } => with_attrs(ChecksumError::new_err(msg), |e| {
            e.setattr("stored", stored)?;
            e.setattr("computed", computed)
        }),
        Error::UnsupportedVersion(version) => {
            with_attrs(UnsupportedVersionError::new_err(msg), |e| {
                e.setattr("version", version)?;
                e.setattr("supported", PyTuple::new(e.py(), READABLE_VERSIONS)?)
            })
        }
        Error::Format(_) | Error::Truncated { .. } => FormatError::new_err(msg),
        _ => KakeyaTurboError::new_err(msg),
    }
}

/// Sets attributes on the exception instance (they survive pickling: `BaseException`
/// pickles its `__dict__`).
fn with_attrs(err: PyErr, set: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<()>) -> PyErr {
    Python::attach(|py| match set(err.value(py).as_any()) {
        Ok(()) => err,
        Err(e) => e,
    })
}

/// A `TypeError` naming the argument.
pub fn type_error(arg: &str, msg: impl std::fmt::Display) -> PyErr {
    PyTypeError::new_err(format!("{arg}: {msg}"))
}
