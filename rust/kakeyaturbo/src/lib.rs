//! # kakeyaturbo
//!
//! A lossy codec for the key/value cache of transformer language models. A layer's
//! vectors (one attention head's keys or values, `[tokens, head_dim]`) are cut into
//! blocks; each block goes through:
//!
//! 1. **Weighted PCA** ([`pca`], [`rsvd`]): mean and an orthonormal basis of `d_eff`
//!    components, exact or by the Halko-Martinsson-Tropp randomized range finder, and the
//!    projection onto it; or a caller-supplied basis ([`basis`]).
//! 2. **Spherical k-means skeleton** ([`kmeans`]): each coefficient vector stores a
//!    centre id and a scalar `t`; the residual is `coeff - t * centre`.
//! 3. **Rotation** ([`wht`]): seeded random signs and an *orthonormal* Walsh-Hadamard
//!    transform, then a per-vector scale so the coordinates have unit second moment.
//! 4. **Lloyd-Max scalar quantisation** ([`lloyd_max`]) with Gaussian or calibrated
//!    codebooks, and **sparse outliers** ([`outliers`]) for coordinates beyond a threshold.
//!    Steps 2-4 are the uniform allocation ([`uniform`]). With `Allocation::Waterfill`
//!    they become transform coding instead: bits are spent per PCA component by reverse
//!    water-filling ([`waterfill`]).
//! 5. **Bit packing** ([`bitpack`]) into a versioned, checksummed wire format
//!    ([`format`](mod@format)).
//!
//! The layer and block driver lives in [`codec`], parameters in [`params`], per-stage error
//! diagnostics in [`stages`]; [`coded_attention`] computes attention logits and value sums
//! over coded blocks without a decoded copy of the layer. The decoder treats every byte as hostile:
//! decoding either succeeds or returns [`Error`], never panics.
// The only unsafe code is the run-time dispatch to AVX + FMA builds of the attention kernels
// and their intrinsics (`coded_attention/cpu.rs`, `avx.rs`, `frame.rs`, `kernels.rs`), to its
// AVX512-BF16, AVX512-VNNI and AVX2 frame products (`coded_attention/bf16.rs`,
// `coded_attention/int16.rs` and `int16/x86.rs`) and to the AVX2 decoders of water-filled
// blocks (`waterfill/decode.rs`, `gather.rs`, `sums.rs`), allowed there alone.
#![deny(unsafe_code)]

pub mod basis;
pub mod bitpack;
pub mod codec;
pub mod coded_attention;
pub mod error;
pub mod format;
pub mod int8_rows;
pub mod kmeans;
pub mod lloyd_max;
pub mod outliers;
pub mod parallel;
pub mod params;
pub mod pca;
pub mod rng;
pub mod rsvd;
pub mod stages;
#[cfg(test)]
mod test_data;
pub mod uniform;
pub mod waterfill;
mod weighted;
pub mod wht;

pub use basis::{BasisRef, ExternalBasis};
pub use codec::{
    check_batch_decode, decode_layer, decode_layer_into, decode_layer_with, encode_block,
    encode_layer, encode_layer_with, BlockBody, BlockStats, EncodedBlock, EncodedLayer,
};
pub use error::{Error, Result};
pub use params::{Allocation, CodecParams, InputDtype, Metric, PcaMethod, SkeletonDtype};
pub use pca::SharedBasis;
pub use stages::{stage_errors, StageErrors};
