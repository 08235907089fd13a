//! Python exception classes, one per kind of core error.

use kakeyaturbo::Error;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::PyErr;

create_exception!(
    _core,
    KakeyaTurboError,
    PyException,
    "Base class of every error raised by kakeyaturbo."
);
create_exception!(
    _core,
    FormatError,
    KakeyaTurboError,
    "Encoded bytes are corrupt, truncated, or violate a format limit."
);
create_exception!(
    _core,
    ChecksumError,
    FormatError,
    "The CRC-32 stored in the encoded bytes does not match their contents."
);
create_exception!(
    _core,
    UnsupportedVersionError,
    FormatError,
    "The encoded bytes use a format version this build cannot read."
);

/// Maps a core error onto its Python exception: input problems become `ValueError`
/// (as Python users expect), byte problems the `FormatError` family.
pub fn to_py(err: Error) -> PyErr {
    let msg = err.to_string();
    match err {
        Error::InvalidParams(_) | Error::Shape(_) | Error::NonFinite { .. } => {
            PyValueError::new_err(msg)
        }
        Error::Checksum { .. } => ChecksumError::new_err(msg),
        Error::UnsupportedVersion(_) => UnsupportedVersionError::new_err(msg),
        Error::Format(_) | Error::Truncated { .. } => FormatError::new_err(msg),
        _ => KakeyaTurboError::new_err(msg),
    }
}

/// A `TypeError` naming the argument.
pub fn type_error(arg: &str, msg: impl std::fmt::Display) -> PyErr {
    PyTypeError::new_err(format!("{arg}: {msg}"))
}
