//! Bit packing of small unsigned integers, LSB first: value `i` occupies bits
//! `[i * bits, (i + 1) * bits)` of the little-endian bit stream. The unused high bits of
//! the last byte are zero, and the reader insists on it (no hidden data in padding).
//!
//! Three readers: [`unpack`] for fixed-width sections, [`BitReader`] for a variable-width
//! stream read in order, and [`peek_u64`] for decoders that know each value's bit offset
//! in advance and read it directly (`(peek_u64(b, p / 8) >> (p % 8)) & mask`, any width
//! up to 57 bits) without a pass that unpacks the stream first.

use crate::error::{Error, Result};

/// Bytes needed for `count` values of `bits` bits.
pub fn packed_len(count: usize, bits: u32) -> usize {
    (count * bits as usize).div_ceil(8)
}

/// Appends `values` (each < 2^bits, bits in 1..=16) to `out`.
pub fn pack_into(values: &[u16], bits: u32, out: &mut Vec<u8>) {
    debug_assert!((1..=16).contains(&bits));
    let start = out.len();
    out.resize(start + packed_len(values.len(), bits), 0);
    let buf = &mut out[start..];
    let mut acc: u32 = 0;
    let mut nacc: u32 = 0;
    let mut pos = 0;
    for &v in values {
        debug_assert!((v as u32) < (1u32 << bits));
        acc |= (v as u32) << nacc;
        nacc += bits;
        while nacc >= 8 {
            buf[pos] = acc as u8;
            pos += 1;
            acc >>= 8;
            nacc -= 8;
        }
    }
    if nacc > 0 {
        buf[pos] = acc as u8;
    }
}

/// Reads `count` values of `bits` bits from `bytes` (which must be exactly
/// `packed_len(count, bits)` long, padding bits zero).
pub fn unpack(bytes: &[u8], count: usize, bits: u32) -> Result<Vec<u16>> {
    if !(1..=16).contains(&bits) {
        return Err(Error::Format(format!("bit width {bits} out of range")));
    }
    if bytes.len() != packed_len(count, bits) {
        return Err(Error::Format("packed section has the wrong length".into()));
    }
    let mask = (1u32 << bits) - 1;
    let mut out = Vec::with_capacity(count);
    let mut acc: u32 = 0;
    let mut nacc: u32 = 0;
    let mut pos = 0;
    for _ in 0..count {
        while nacc < bits {
            acc |= (bytes[pos] as u32) << nacc;
            pos += 1;
            nacc += 8;
        }
        out.push((acc & mask) as u16);
        acc >>= bits;
        nacc -= bits;
    }
    if acc != 0 {
        return Err(Error::Format(
            "non-zero padding bits in packed section".into(),
        ));
    }
    Ok(out)
}

/// The 64 bits that start at byte `at`, little-endian; bytes beyond the end of `bytes`
/// read as zero (so a decoder may peek past the last value of a stream without a check).
#[inline(always)]
pub fn peek_u64(bytes: &[u8], at: usize) -> u64 {
    match bytes.get(at..at.saturating_add(8)) {
        Some(s) => u64::from_le_bytes(s.try_into().expect("8 bytes")),
        None => peek_tail(bytes, at),
    }
}

/// [`peek_u64`] within 8 bytes of the end (and beyond it).
#[cold]
fn peek_tail(bytes: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    let tail = bytes.get(at..).unwrap_or_default();
    w[..tail.len()].copy_from_slice(tail);
    u64::from_le_bytes(w)
}

/// Writes values of varying widths (0..=16 bits) into one LSB-first bit stream.
#[derive(Debug, Default)]
pub struct BitWriter {
    out: Vec<u8>,
    acc: u64,
    n: u32,
}

impl BitWriter {
    /// An empty stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends the low `bits` bits of `v`.
    #[inline]
    pub fn put(&mut self, v: u16, bits: u32) {
        debug_assert!(bits <= 16 && (bits == 16 || (v as u32) < (1 << bits)));
        // Fewer than 32 bits wait in `acc` between calls, so 16 more always fit; flushing
        // four bytes at a time keeps the byte loop (and its branch) off the hot path.
        self.acc |= (v as u64) << self.n;
        self.n += bits;
        if self.n >= 32 {
            self.out.extend_from_slice(&(self.acc as u32).to_le_bytes());
            self.acc >>= 32;
            self.n -= 32;
        }
    }

    /// The bytes, the last one zero-padded.
    pub fn finish(mut self) -> Vec<u8> {
        while self.n > 0 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.n = self.n.saturating_sub(8);
        }
        self.out
    }
}

/// Reads a stream written by [`BitWriter`]; `finish` insists on zero padding.
#[derive(Debug)]
pub struct BitReader<'a> {
    bytes: &'a [u8],
    pos: usize,
    acc: u64,
    n: u32,
}

impl<'a> BitReader<'a> {
    /// A reader over exactly the stream's bytes.
    pub fn new(bytes: &'a [u8]) -> Self {
        BitReader {
            bytes,
            pos: 0,
            acc: 0,
            n: 0,
        }
    }

    /// The next `bits` bits (`bits <= 16`).
    #[inline]
    pub fn get(&mut self, bits: u32) -> Result<u16> {
        while self.n < bits {
            let Some(&b) = self.bytes.get(self.pos) else {
                return Err(Error::Format("bit stream ends early".into()));
            };
            self.acc |= (b as u64) << self.n;
            self.pos += 1;
            self.n += 8;
        }
        let v = (self.acc & ((1u64 << bits) - 1)) as u16;
        self.acc >>= bits;
        self.n -= bits;
        Ok(v)
    }

    /// Checks that every byte was consumed and the padding bits are zero.
    pub fn finish(self) -> Result<()> {
        if self.pos != self.bytes.len() || self.acc != 0 {
            return Err(Error::Format(
                "bit stream has trailing or non-zero padding bits".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn roundtrip(bits in 1u32..=16, raw in proptest::collection::vec(any::<u16>(), 0..300)) {
            let vals: Vec<u16> = raw.iter().map(|v| (*v as u32 & ((1u32 << bits) - 1)) as u16).collect();
            let mut buf = vec![0xAB];
            pack_into(&vals, bits, &mut buf);
            prop_assert_eq!(buf.len(), 1 + packed_len(vals.len(), bits));
            let back = unpack(&buf[1..], vals.len(), bits).unwrap();
            prop_assert_eq!(back, vals);
        }
    }

    /// `(width, value)` items cut to their widths, and the bytes a `BitWriter` makes of them.
    fn written(items: Vec<(u32, u16)>) -> (Vec<(u32, u16)>, Vec<u8>) {
        let cut = |b: u32, v: u16| {
            if b == 16 {
                v
            } else {
                (v as u32 & ((1u32 << b) - 1)) as u16
            }
        };
        let items: Vec<(u32, u16)> = items.into_iter().map(|(b, v)| (b, cut(b, v))).collect();
        let mut w = BitWriter::new();
        for &(b, v) in &items {
            w.put(v, b);
        }
        (items, w.finish())
    }

    proptest! {
        #[test]
        fn varwidth_roundtrip(items in proptest::collection::vec((0u32..=16, any::<u16>()), 0..200)) {
            let (items, bytes) = written(items);
            let total: u32 = items.iter().map(|i| i.0).sum();
            prop_assert_eq!(bytes.len(), (total as usize).div_ceil(8));
            let mut r = BitReader::new(&bytes);
            for &(b, v) in &items {
                prop_assert_eq!(r.get(b).unwrap(), v);
            }
            prop_assert!(r.finish().is_ok());
        }
    }

    proptest! {
        #[test]
        fn peek_reads_every_offset(
            items in proptest::collection::vec((0u32..=16, any::<u16>()), 0..200),
        ) {
            let (items, bytes) = written(items);
            let mut p = 0usize;
            for &(b, v) in &items {
                let got = (peek_u64(&bytes, p / 8) >> (p % 8)) & ((1u64 << b) - 1);
                prop_assert_eq!(got, v as u64);
                p += b as usize;
            }
            // Past the end: zeros, never a panic.
            prop_assert_eq!(peek_u64(&bytes, bytes.len()), 0);
            prop_assert_eq!(peek_u64(&bytes, usize::MAX), 0);
        }
    }

    #[test]
    fn rejects_dirty_padding_and_bad_length() {
        let mut buf = Vec::new();
        pack_into(&[1, 2, 3], 3, &mut buf); // 9 bits -> 2 bytes, 7 padding bits
        assert_eq!(buf.len(), 2);
        let mut dirty = buf.clone();
        dirty[1] |= 0x80;
        assert!(unpack(&dirty, 3, 3).is_err());
        assert!(unpack(&buf[..1], 3, 3).is_err());
        assert_eq!(unpack(&buf, 3, 3).unwrap(), vec![1, 2, 3]);
    }
}
