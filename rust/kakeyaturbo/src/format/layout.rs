//! The wire format's fixed numbers (magic, flags, section sizes, limits) and the decode
//! limit's check, which the reader and the writer share.

use crate::error::{Error, Result};

/// The four bytes every encoded layer starts with.
pub const MAGIC: [u8; 4] = *b"KKTB";
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
