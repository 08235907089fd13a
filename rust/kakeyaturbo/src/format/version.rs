//! The wire format's version numbers: what this build writes and what it reads (the error
//! type names them too, so they sit below both).

/// The format version this build writes.
pub const FORMAT_VERSION: u16 = 1;
/// The format versions this build reads.
pub const READABLE_VERSIONS: &[u16] = &[FORMAT_VERSION];
