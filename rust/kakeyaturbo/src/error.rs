//! The crate's single error type. Variants are coarse on purpose: a caller needs to
//! know *which kind* of thing went wrong (bad parameters, bad input, bad bytes), and the
//! message says exactly what.

use thiserror::Error;

use crate::format::version::FORMAT_VERSION;

/// Everything that can go wrong in the codec.
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// A parameter, or a combination of parameters, is invalid.
    #[error("invalid parameter: {0}")]
    InvalidParams(String),
    /// The input array has the wrong shape or size.
    #[error("invalid input shape: {0}")]
    Shape(String),
    /// The `[tokens, head_dim]` input holds NaN or infinity.
    #[error("input contains a non-finite value (NaN or Inf) at token {token}, dim {dim}")]
    NonFinite {
        /// Row of the first offending element.
        token: usize,
        /// Column of the first offending element.
        dim: usize,
    },
    /// The byte string is not a valid encoding (corrupt, truncated, out of limits).
    #[error("corrupt or invalid encoded data: {0}")]
    Format(String),
    /// The byte string ends before the data it declares.
    #[error("truncated encoded data: need {needed} bytes, have {available}")]
    Truncated {
        /// Bytes the header declares.
        needed: usize,
        /// Bytes present.
        available: usize,
    },
    /// The CRC-32 at the end of the blob does not match its contents.
    #[error("checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Checksum {
        /// Checksum stored in the blob.
        stored: u32,
        /// Checksum of the bytes read.
        computed: u32,
    },
    /// The blob was written by a format version this build cannot read (it reads the
    /// versions in [`crate::format::version::READABLE_VERSIONS`]).
    #[error("unsupported format version {0} (this build reads version {max})", max = FORMAT_VERSION)]
    UnsupportedVersion(u16),
}

/// Shorthand for `Result<T, kakeyaturbo::Error>`.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// True for every error raised while reading bytes (as opposed to encoding input).
    pub fn is_format_error(&self) -> bool {
        matches!(
            self,
            Error::Format(_)
                | Error::Truncated { .. }
                | Error::Checksum { .. }
                | Error::UnsupportedVersion(_)
        )
    }
}
