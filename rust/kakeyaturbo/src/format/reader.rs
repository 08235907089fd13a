//! Parses an encoded layer, treating every byte as hostile: each count is checked against
//! its limit and against the bytes left *before* anything is allocated for it.
//!
//! The parse borrows from the bytes: side values (means, bases, scales, outliers) are
//! decoded and checked, and a water-filled block's codes stay packed (their length and
//! padding checked), to be read straight from the wire by [`crate::waterfill::decode_into`].
//! Uniform blocks are unpacked here.

use half::{bf16, f16};

use super::codes::WireCode;
use super::layout::{
    check_decode_size, BLOCK_HEADER_LEN, CRC_LEN, FLAG_EXTERNAL_BASIS, FLAG_SHARED_BASIS,
    HEADER_LEN, KNOWN_FLAGS, MAGIC, MAX_TOKENS,
};
use super::version::READABLE_VERSIONS;
use crate::bitpack::{packed_len, unpack};
use crate::error::{Error, Result};
use crate::kmeans::{label_bits, SkeletonCodes};
use crate::params::{
    Allocation, CodecParams, InputDtype, Metric, PcaMethod, SkeletonDtype, MAX_BLOCK_SIZE,
    MAX_HEAD_DIM, MAX_MAGNITUDE,
};
use crate::pca::SharedBasis;
use crate::uniform::UniformBody;
use crate::waterfill::{WaterfillCodes, MAX_COMPONENT_BITS};
use crate::wht::padded_len;

/// Largest |mean| accepted (the encoder's own input limit).
const MEAN_LIMIT: f32 = MAX_MAGNITUDE;
/// Largest |entry| of basis rows and centres: unit vectors, with rounding headroom.
const UNIT_LIMIT: f32 = 1.01;
/// Largest |calibrated centroid| (they live in units of the scaled coordinates, ~N(0, 1)).
const CENTROID_LIMIT: f32 = 1_000.0;

/// A block as read from the wire.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedBlock<'a> {
    /// Vectors in the block.
    pub n: usize,
    /// Kept PCA components.
    pub d_eff: usize,
    /// Block mean (empty with a shared basis).
    pub mean: Vec<f32>,
    /// Block basis rows (empty with a shared or external basis, or `pca_method = none`).
    pub basis: Vec<f32>,
    /// The coded coefficients; the variant follows the layer's [`Allocation`].
    pub body: ParsedBody<'a>,
}

/// A block body as read from the wire.
#[derive(Debug, Clone, PartialEq)]
pub enum ParsedBody<'a> {
    /// Skeleton, scales and codes, unpacked.
    Uniform(UniformBody),
    /// Component scales and bits, codes still packed.
    Waterfill(WaterfillCodes<'a>),
}

/// A fully validated layer, borrowing the bytes it was read from.
#[derive(Debug, Clone)]
pub struct ParsedLayer<'a> {
    /// The parameters the layer was encoded with.
    pub params: CodecParams,
    /// Number of vectors.
    pub n_tokens: usize,
    /// Vector length.
    pub head_dim: usize,
    /// Dtype of the original input.
    pub input_dtype: InputDtype,
    /// The shared basis, if the layer has one.
    pub shared: Option<SharedBasis>,
    /// `(d_eff, fingerprint)` of the caller-supplied basis the layer needs, if any.
    pub external: Option<(usize, u64)>,
    /// The blocks in token order.
    pub blocks: Vec<ParsedBlock<'a>>,
}

fn bad<T>(msg: impl Into<String>) -> Result<T> {
    Err(Error::Format(msg.into()))
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, len: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(len).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(Error::Truncated {
                needed: self.pos.saturating_add(len).saturating_add(CRC_LEN),
                available: self.buf.len() + CRC_LEN,
            }),
        }
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }
    fn u32(&mut self) -> Result<usize> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()) as usize)
    }
    fn f32(&mut self) -> Result<f32> {
        Ok(f32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    /// `count` elements of `size` bytes, with the size product checked first.
    fn array(&mut self, count: usize, size: usize, what: &str) -> Result<&'a [u8]> {
        let len = count
            .checked_mul(size)
            .ok_or_else(|| Error::Format(format!("{what}: size overflows")))?;
        self.take(len)
    }
    /// Side values bounded by `limit` in magnitude (finite, and small enough that decoding
    /// cannot overflow f32).
    fn skeleton(
        &mut self,
        count: usize,
        dt: SkeletonDtype,
        limit: f32,
        what: &str,
    ) -> Result<Vec<f32>> {
        let raw = self.array(count, dt.size(), what)?;
        let vals: Vec<f32> = match dt {
            SkeletonDtype::F16 => raw
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            SkeletonDtype::Bf16 => raw
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            SkeletonDtype::F32 => raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        };
        finite(&vals, what)?;
        if vals.iter().any(|v| v.abs() > limit) {
            return bad(format!("{what}: value beyond {limit}"));
        }
        Ok(vals)
    }
    fn f16s(&mut self, count: usize, what: &str) -> Result<Vec<f16>> {
        let raw = self.array(count, 2, what)?;
        let vals: Vec<f16> = raw
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]))
            .collect();
        if vals.iter().any(|v| !v.is_finite()) {
            return bad(format!("{what}: non-finite value"));
        }
        Ok(vals)
    }
}

fn finite(vals: &[f32], what: &str) -> Result<()> {
    if vals.iter().any(|v| !v.is_finite()) {
        return bad(format!("{what}: non-finite value"));
    }
    Ok(())
}

/// Parses and validates a whole layer.
pub fn read_layer(bytes: &[u8]) -> Result<ParsedLayer<'_>> {
    read(bytes, true)
}

/// [`read_layer`] of the bytes of an [`crate::EncodedLayer`], which verified their checksum
/// when it wrapped them (or wrote it) and holds them immutable: every field is checked as
/// there, but the checksum is not computed again on each decode (a measurable share of a
/// decode step, `docs/performance.md`).
pub(crate) fn read_held_layer(bytes: &[u8]) -> Result<ParsedLayer<'_>> {
    read(bytes, false)
}

/// [`read_layer`], with the checksum verified where `verify`.
fn read(bytes: &[u8], verify: bool) -> Result<ParsedLayer<'_>> {
    if bytes.len() < 8 {
        return Err(Error::Truncated {
            needed: HEADER_LEN + CRC_LEN,
            available: bytes.len(),
        });
    }
    if bytes[..4] != MAGIC {
        return bad("bad magic: not a kakeyaturbo encoded layer");
    }
    let version = u16::from_le_bytes([bytes[4], bytes[5]]);
    if !READABLE_VERSIONS.contains(&version) {
        return Err(Error::UnsupportedVersion(version));
    }
    if bytes.len() < HEADER_LEN + CRC_LEN {
        return Err(Error::Truncated {
            needed: HEADER_LEN + CRC_LEN,
            available: bytes.len(),
        });
    }
    let (body, crc) = bytes.split_at(bytes.len() - CRC_LEN);
    if verify {
        let stored = u32::from_le_bytes(crc.try_into().unwrap());
        let computed = crc32fast::hash(body);
        if stored != computed {
            return Err(Error::Checksum { stored, computed });
        }
    }
    let mut c = Cursor { buf: body, pos: 6 };
    let flags = c.u16()?;
    if flags & !KNOWN_FLAGS != 0 {
        return bad(format!("unknown flag bits {flags:#06x}"));
    }
    let n_tokens = c.u32()?;
    let head_dim = c.u32()?;
    let n_blocks = c.u32()?;
    let in_dtype = InputDtype::from_code(c.u8()?)?;
    let sk_dtype = SkeletonDtype::from_code(c.u8()?)?;
    let bit_width = c.u8()?;
    let metric = Metric::from_code(c.u8()?)?;
    let pca_method = PcaMethod::from_code(c.u8()?)?;
    let custom = match c.u8()? {
        0 => false,
        1 => true,
        v => return bad(format!("custom-centroid flag must be 0 or 1, got {v}")),
    };
    if c.u16()? != 0 {
        return bad("reserved header bytes are not zero");
    }
    let mut params = CodecParams {
        block_size: c.u32()?,
        bit_width,
        pca_method,
        variance_ratio: c.f32()?,
        rank_cap: c.u32()?,
        k: c.u32()?,
        kmeans_iters: c.u32()?,
        target_rank: c.u32()?,
        oversample: c.u32()?,
        power_iters: c.u32()?,
        metric,
        outlier_threshold: c.f32()?,
        skeleton_dtype: sk_dtype,
        seed: c.u64()?,
        share_basis: flags & FLAG_SHARED_BASIS != 0,
        centroids: None,
        allocation: Allocation::from_code(c.u8()?)?,
        bits_per_value: {
            if c.take(3)? != [0, 0, 0] {
                return bad("reserved header bytes are not zero");
            }
            c.f32()?
        },
    };
    if params.share_basis && flags & FLAG_EXTERNAL_BASIS != 0 {
        return bad("shared and external basis flags are exclusive");
    }
    // validate() bounds every count below by its limit (block size, k, ranks).
    params
        .validate()
        .map_err(|e| Error::Format(format!("header parameters: {e}")))?;
    if custom {
        let n = 1usize << bit_width;
        let raw = c.array(n, 4, "centroids")?;
        let cents: Vec<f32> = raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        if cents.iter().any(|v| v.abs() > CENTROID_LIMIT) {
            return bad(format!("centroids: value beyond {CENTROID_LIMIT}"));
        }
        params.centroids = Some(cents);
        params
            .validate()
            .map_err(|e| Error::Format(format!("centroids: {e}")))?;
    }
    if head_dim == 0 || head_dim > MAX_HEAD_DIM {
        return bad(format!("head_dim {head_dim} outside 1..={MAX_HEAD_DIM}"));
    }
    if n_tokens == 0 || n_tokens > MAX_TOKENS {
        return bad(format!("n_tokens {n_tokens} outside 1..={MAX_TOKENS}"));
    }
    debug_assert!(params.block_size <= MAX_BLOCK_SIZE);
    if n_blocks != n_tokens.div_ceil(params.block_size) {
        return bad(format!(
            "{n_blocks} blocks cannot hold {n_tokens} tokens at block size {}",
            params.block_size
        ));
    }
    let decoded = n_tokens.saturating_mul(head_dim).saturating_mul(4);
    check_decode_size(decoded, bytes.len(), || {
        format!("{n_tokens} x {head_dim} values")
    })?;
    let max_rank = params.max_rank(head_dim);
    // pca_method 'none' stores no basis rows: the identity, with d_eff = head_dim.
    let identity = params.pca_method == PcaMethod::None;
    let basis_len = |d_eff: usize| if identity { 0 } else { d_eff * head_dim };
    let s = sk_dtype;
    let shared = if params.share_basis {
        let d_eff = c.u32()?;
        if d_eff == 0 || d_eff > max_rank || (identity && d_eff != head_dim) {
            return bad(format!("shared d_eff {d_eff} outside 1..={max_rank}"));
        }
        let mean = c.skeleton(head_dim, s, MEAN_LIMIT, "shared mean")?;
        let basis = c.skeleton(basis_len(d_eff), s, UNIT_LIMIT, "shared basis")?;
        Some(SharedBasis { d_eff, mean, basis })
    } else {
        None
    };
    let external = if flags & FLAG_EXTERNAL_BASIS != 0 {
        let d_eff = c.u32()?;
        if d_eff == 0 || d_eff > head_dim {
            return bad(format!(
                "external basis d_eff {d_eff} outside 1..={head_dim}"
            ));
        }
        Some((d_eff, c.u64()?))
    } else {
        None
    };
    // Each block needs at least its header, so a hostile n_blocks cannot allocate much.
    if n_blocks.saturating_mul(BLOCK_HEADER_LEN) > body.len() - c.pos {
        return Err(Error::Truncated {
            needed: c.pos + n_blocks * BLOCK_HEADER_LEN + CRC_LEN,
            available: bytes.len(),
        });
    }
    let mut blocks = Vec::with_capacity(n_blocks);
    for bi in 0..n_blocks {
        let want_n = if bi + 1 == n_blocks {
            n_tokens - bi * params.block_size
        } else {
            params.block_size
        };
        let n = c.u32()?;
        if n != want_n {
            return bad(format!("block {bi} holds {n} vectors, expected {want_n}"));
        }
        let d_eff = c.u32()?;
        let k_used = c.u32()?;
        let n_outliers = c.u32()?;
        let kmeans_iters = c.u32()?;
        let fixed_d_eff = shared.as_ref().map(|sb| sb.d_eff).or(external.map(|e| e.0));
        match fixed_d_eff {
            Some(fd) if d_eff != fd => {
                return bad(format!(
                    "block {bi}: d_eff {d_eff} differs from the layer basis"
                ))
            }
            None if d_eff == 0 || d_eff > max_rank || (identity && d_eff != head_dim) => {
                return bad(format!("block {bi}: d_eff {d_eff} outside 1..={max_rank}"))
            }
            _ => {}
        }
        if k_used > params.k.min(n) {
            return bad(format!(
                "block {bi}: {k_used} centres exceed k or the block size"
            ));
        }
        if kmeans_iters > params.kmeans_iters {
            return bad(format!(
                "block {bi}: k-means iteration count exceeds the limit"
            ));
        }
        let mean = if shared.is_none() {
            c.skeleton(head_dim, s, MEAN_LIMIT, "block mean")?
        } else {
            Vec::new()
        };
        let basis = if shared.is_none() && external.is_none() {
            c.skeleton(basis_len(d_eff), s, UNIT_LIMIT, "block basis")?
        } else {
            Vec::new()
        };
        let h = BlockHeader {
            index: bi,
            n,
            d_eff,
            k_used,
            n_outliers,
            kmeans_iters: kmeans_iters as u32,
        };
        let block_body = match params.allocation {
            Allocation::Uniform => {
                ParsedBody::Uniform(read_uniform_body(&mut c, &h, s, bit_width)?)
            }
            Allocation::Waterfill => ParsedBody::Waterfill(read_waterfill_body(&mut c, &h)?),
        };
        blocks.push(ParsedBlock {
            n,
            d_eff,
            mean,
            basis,
            body: block_body,
        });
    }
    if c.pos != body.len() {
        return bad(format!(
            "{} trailing bytes after the last block",
            body.len() - c.pos
        ));
    }
    Ok(ParsedLayer {
        params,
        n_tokens,
        head_dim,
        input_dtype: in_dtype,
        shared,
        external,
        blocks,
    })
}

/// The counts of a block's fixed header that its body needs.
struct BlockHeader {
    index: usize,
    n: usize,
    d_eff: usize,
    k_used: usize,
    n_outliers: usize,
    kmeans_iters: u32,
}

/// Skeleton, scales, fixed-width codes and outliers.
fn read_uniform_body(
    c: &mut Cursor<'_>,
    h: &BlockHeader,
    s: SkeletonDtype,
    bit_width: u8,
) -> Result<UniformBody> {
    let (n, d_eff, k_used) = (h.n, h.d_eff, h.k_used);
    let centres = c.skeleton(k_used * d_eff, s, UNIT_LIMIT, "centres")?;
    let lb = label_bits(k_used);
    let labels = if lb > 0 {
        let raw = c.take(packed_len(n, lb))?;
        let l = unpack(raw, n, lb)?;
        if l.iter().any(|&v| v as usize >= k_used) {
            return bad(format!("block {}: centre label out of range", h.index));
        }
        l
    } else if k_used == 1 {
        vec![0; n]
    } else {
        Vec::new()
    };
    let t = if k_used > 0 {
        c.f16s(n, "t")?
    } else {
        Vec::new()
    };
    let scales = c.f16s(n, "scales")?;
    let n_codes = n * padded_len(d_eff);
    let raw = c.take(packed_len(n_codes, bit_width as u32))?;
    let codes = unpack(raw, n_codes, bit_width as u32)?;
    Ok(UniformBody {
        skeleton: SkeletonCodes {
            centres,
            k_used,
            iters: h.kmeans_iters,
            labels,
            t,
        },
        scales,
        codes,
        outliers: read_outliers(c, h, n_codes)?,
    })
}

/// Component scales and bits, variable-width codes (left packed) and outliers.
fn read_waterfill_body<'a>(c: &mut Cursor<'a>, h: &BlockHeader) -> Result<WaterfillCodes<'a>> {
    let (n, d_eff, bi) = (h.n, h.d_eff, h.index);
    if h.k_used != 0 || h.kmeans_iters != 0 {
        return bad(format!("block {bi}: water-filled blocks have no skeleton"));
    }
    let sigma = c.f16s(d_eff, "sigma")?;
    if sigma.iter().any(|v| v.to_f32() < 0.0) {
        return bad(format!("block {bi}: negative component scale"));
    }
    let raw = c.take(packed_len(d_eff, 4))?;
    let comp_bits: Vec<u8> = unpack(raw, d_eff, 4)?.iter().map(|&v| v as u8).collect();
    if comp_bits.iter().any(|&v| v > MAX_COMPONENT_BITS) {
        return bad(format!(
            "block {bi}: component bit count above {MAX_COMPONENT_BITS}"
        ));
    }
    // Every code of b bits indexes one of 2^b levels, so only the stream's length and its
    // padding need checking (n <= MAX_BLOCK_SIZE and per_vector <= 8 x MAX_HEAD_DIM).
    let per_vector: usize = comp_bits.iter().map(|&v| v as usize).sum();
    let total = n * per_vector;
    let codes = c.take(total.div_ceil(8))?;
    if codes
        .last()
        .is_some_and(|&last| !total.is_multiple_of(8) && last >> (total % 8) != 0)
    {
        return bad("bit stream has trailing or non-zero padding bits");
    }
    Ok(WaterfillCodes {
        sigma,
        comp_bits,
        codes,
        outliers: read_outliers(c, h, n * d_eff)?,
    })
}

/// The block's `(position u32, value f16)` outlier entries: positions strictly ascending
/// and below `n_coords`, values finite.
fn read_outliers(c: &mut Cursor<'_>, h: &BlockHeader, n_coords: usize) -> Result<Vec<(u32, f16)>> {
    let (n_outliers, bi) = (h.n_outliers, h.index);
    if n_outliers > n_coords {
        return bad(format!("block {bi}: more outliers than coordinates"));
    }
    let raw = c.array(n_outliers, 6, "outliers")?;
    let mut out: Vec<(u32, f16)> = Vec::with_capacity(n_outliers);
    for o in raw.chunks_exact(6) {
        let pos = u32::from_le_bytes(o[..4].try_into().unwrap());
        let v = f16::from_le_bytes([o[4], o[5]]);
        let ascending = out.last().is_none_or(|&(last, _)| pos > last);
        if pos as usize >= n_coords || !ascending || !v.is_finite() {
            return bad(format!("block {bi}: invalid outlier entry"));
        }
        out.push((pos, v));
    }
    Ok(out)
}
