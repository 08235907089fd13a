//! Wire format, version 1. Everything little-endian; the layout reads like a spec.
//!
//! ```text
//! layer   := header [centroids] [shared_basis] block* crc32
//! header  := magic "KKTB" | version u16 | flags u16 | n_tokens u32 | head_dim u32
//!            | n_blocks u32 | input_dtype u8 | skeleton_dtype u8 | bit_width u8 | metric u8
//!            | pca_method u8 | custom_centroids u8 | reserved u16 (= 0)
//!            | block_size u32 | variance_ratio f32 | rank_cap u32 | k u32 | kmeans_iters u32
//!            | target_rank u32 | oversample u32 | power_iters u32 | outlier_threshold f32
//!            | seed u64 | allocation u8 | reserved u8 x 3 (= 0) | bits_per_value f32
//!                                                                           (80 bytes)
//! centroids      := f32 x 2^bit_width                       (if custom_centroids = 1)
//! shared_basis   := d_eff u32 | mean S x D | basis S x d_eff x D    (if FLAG_SHARED_BASIS)
//! external_basis := d_eff u32 | fingerprint u64                   (if FLAG_EXTERNAL_BASIS)
//! block   := n u32 | d_eff u32 | k_used u32 | n_outliers u32 | kmeans_iters u32
//!            | [mean S x D]                                      (unless shared basis)
//!            | [basis S x d_eff x D]              (unless shared or external basis)
//!            | uniform_body (allocation 0) | waterfill_body (allocation 1)
//! uniform_body :=
//!              centres S x k_used x d_eff
//!            | labels: ceil(log2 k_used) bits x n, packed            (if k_used > 1)
//!            | t: f16 x n                                              (if k_used > 0)
//!            | scales: f16 x n
//!            | codes: bit_width bits x n x W, packed, W = next_pow2(d_eff)
//!            | outliers: (position u32, value f16) x n_outliers, positions ascending
//! waterfill_body := (k_used = 0)
//!              sigma: f16 x d_eff | bits: 4 bits x d_eff, packed (each 0..=8)
//!            | codes: for each vector, for each component j with bits_j > 0, a
//!              bits_j-bit code, one LSB-first stream, zero-padded to a byte
//!            | outliers: (position u32 = vector * d_eff + j, value f16) x n_outliers
//! crc32   := CRC-32 (IEEE) of every preceding byte
//! ```
//! With `pca_method = 2` ('none') the basis sections are empty (identity, `d_eff = D`).
//! `S` is the skeleton dtype's size (2 for f16/bf16, 4 for f32). Packed sections are LSB
//! first with zero padding bits. Blocks hold `block_size` vectors except the last.
//! The reader checks the checksum, every enum value, every reserved bit, every declared
//! count against its limit and against the bytes actually left before allocating, and
//! every stored float for finiteness. The enum codes (`input_dtype`, `skeleton_dtype`,
//! `metric`, `pca_method`, `allocation`) are in one table, [`codes`], that both the
//! writer and the reader use.

pub mod codes;
mod reader;
mod writer;

pub(crate) use reader::read_held_layer;
pub use reader::{read_layer, ParsedBlock, ParsedBody, ParsedLayer};
pub use writer::write_layer;

use crate::error::{Error, Result};

/// The four bytes every encoded layer starts with.
pub const MAGIC: [u8; 4] = *b"KKTB";
/// The format version this build writes.
pub const FORMAT_VERSION: u16 = 1;
/// The format versions this build reads.
pub const READABLE_VERSIONS: &[u16] = &[FORMAT_VERSION];
/// Header flag: one basis for the whole layer, stored once before the blocks.
pub const FLAG_SHARED_BASIS: u16 = 1 << 0;
/// Header flag: the basis was supplied by the caller; only its fingerprint is stored.
pub const FLAG_EXTERNAL_BASIS: u16 = 1 << 1;
/// Flags this version knows; any other set bit is an error.
pub const KNOWN_FLAGS: u16 = FLAG_SHARED_BASIS | FLAG_EXTERNAL_BASIS;
/// Size of the fixed header.
pub const HEADER_LEN: usize = 80;
/// Size of a block's fixed header.
pub const BLOCK_HEADER_LEN: usize = 20;
/// Size of the trailing checksum.
pub const CRC_LEN: usize = 4;
/// Largest token count in one encoded layer.
pub const MAX_TOKENS: usize = 1 << 31;
/// Decoded bytes a blob may declare per stored byte, beyond [`DECODE_FLOOR`]: a bound on
/// amplification, far above real encodings (0.25 bits per value is 128x).
pub const DECODE_AMPLIFICATION: usize = 256;
/// Decoded bytes always allowed, whatever the blob's size.
pub const DECODE_FLOOR: usize = 64 << 20;

/// The decode limit: `decoded` bytes (f32 output) from `stored` bytes may exceed neither
/// [`DECODE_FLOOR`] nor `stored * DECODE_AMPLIFICATION`, whichever is larger. `what` names
/// the thing decoded, for the message.
pub fn check_decode_size(
    decoded: usize,
    stored: usize,
    what: impl FnOnce() -> String,
) -> Result<()> {
    if decoded > DECODE_FLOOR.max(stored.saturating_mul(DECODE_AMPLIFICATION)) {
        return Err(Error::Format(format!(
            "{} would decode to {decoded} bytes from {stored} stored: beyond the decode limit",
            what()
        )));
    }
    Ok(())
}
