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
mod layout;
mod reader;
pub mod version;
mod writer;

pub use layout::{
    check_decode_size, BLOCK_HEADER_LEN, CRC_LEN, DECODE_AMPLIFICATION, DECODE_FLOOR,
    FLAG_EXTERNAL_BASIS, FLAG_SHARED_BASIS, HEADER_LEN, KNOWN_FLAGS, MAGIC, MAX_TOKENS,
};
pub(crate) use reader::read_held_layer;
pub use reader::{read_layer, ParsedBlock, ParsedBody, ParsedLayer};
pub use version::{FORMAT_VERSION, READABLE_VERSIONS};
pub use writer::write_layer;
