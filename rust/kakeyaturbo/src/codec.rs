//! The layer and block driver: cuts a layer into blocks, runs each block through the
//! pipeline stages in parallel, and hands the blocks to the wire format.
//!
//! Encoding a block of `n` vectors `x_i` (length `D`):
//! 1. mean and basis (`d_eff x D`): fitted on the block, on the whole layer
//!    (`share_basis`), or supplied by the caller ([`crate::basis`]); coefficients
//!    `c_i = B (x_i - mean)` ([`crate::pca`]).
//! 2. The coefficients are coded by the layer's [`Allocation`]: uniformly, with a k-means
//!    skeleton, a WHT rotation and `bit_width` Lloyd-Max bits per rotated coordinate
//!    ([`crate::uniform`]), or by reverse water-filling over the components
//!    ([`crate::waterfill`]). The block body ([`BlockBody`]) is the one variant or the other.
//!
//! Decoding reverses it: the body gives `c_hat_i`, and `x_hat_i = mean + B^T c_hat_i`.
//! Blocks are independent and run in parallel; a layer in memory is exactly its wire bytes
//! ([`crate::format`]). Decoding reads from those bytes: a water-filled block's codes are
//! read straight from the packed stream, and with the identity basis (`pca_method =
//! none`) the mean is folded into the level tables, so each output row is written once
//! ([`crate::waterfill::decode_into`]). [`decode_layer_into`] decodes into a caller's
//! buffer (a batch decodes every layer into its slice of one output).

use std::borrow::Cow;

use crate::basis::{BasisRef, ExternalBasis};
use crate::error::{Error, Result};
use crate::format::{
    check_decode_size, read_held_layer, read_layer, write_layer, ParsedBlock, ParsedBody,
    ParsedLayer,
};
use crate::parallel;
use crate::params::{Allocation, CodecParams, InputDtype, MAX_HEAD_DIM, MAX_MAGNITUDE};
use crate::pca::{fit_basis, normalised_weights, project, rounded_mean, unproject, SharedBasis};
use crate::uniform;
use crate::waterfill::{self, WaterfillCodes};

pub(crate) mod block;
pub use block::{BlockBody, EncodedBlock};

/// Per-block statistics, available after encode and after `from_bytes`.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStats {
    /// Vectors in the block.
    pub n: usize,
    /// Kept PCA components.
    pub d_eff: usize,
    /// k-means centres used.
    pub k_used: usize,
    /// k-means iterations run.
    pub kmeans_iters: u32,
    /// Outliers stored.
    pub n_outliers: usize,
}

/// An encoded layer. It holds its wire bytes and nothing else of size: what a cache keeps
/// in memory is exactly what `to_bytes` returns.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedLayer {
    bytes: Vec<u8>,
    params: CodecParams,
    n_tokens: usize,
    head_dim: usize,
    input_dtype: InputDtype,
    stats: Vec<BlockStats>,
    external: Option<u64>,
}

impl EncodedLayer {
    /// Validates `bytes` completely (checksum, limits, every field) and wraps them.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        let p = read_layer(&bytes)?;
        let (stats, params) = (p.blocks.iter().map(parsed_stats).collect(), p.params);
        let (n_tokens, head_dim, input_dtype) = (p.n_tokens, p.head_dim, p.input_dtype);
        let external = p.external.map(|(_, fp)| fp);
        Ok(EncodedLayer {
            stats,
            params,
            n_tokens,
            head_dim,
            input_dtype,
            external,
            bytes,
        })
    }

    /// The wire bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }
    /// Exact encoded size in bytes.
    pub fn nbytes(&self) -> usize {
        self.bytes.len()
    }
    /// Parameters the layer was encoded with.
    pub fn params(&self) -> &CodecParams {
        &self.params
    }
    /// `(n_tokens, head_dim)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.n_tokens, self.head_dim)
    }
    /// Dtype of the original input.
    pub fn input_dtype(&self) -> InputDtype {
        self.input_dtype
    }
    /// Per-block statistics.
    pub fn stats(&self) -> &[BlockStats] {
        &self.stats
    }
    /// Fingerprint of the external basis this layer needs to decode, if any.
    pub fn external_fingerprint(&self) -> Option<u64> {
        self.external
    }
}

fn block_stats(b: &EncodedBlock) -> BlockStats {
    BlockStats {
        n: b.n,
        d_eff: b.d_eff,
        k_used: b.body.k_used(),
        kmeans_iters: b.body.kmeans_iters(),
        n_outliers: b.body.outliers().len(),
    }
}

/// The same statistics as [`block_stats`], read from a parsed block: only uniform blocks
/// carry a skeleton.
fn parsed_stats(b: &ParsedBlock<'_>) -> BlockStats {
    let (k_used, kmeans_iters, n_outliers) = match &b.body {
        ParsedBody::Uniform(u) => (u.skeleton.k_used, u.skeleton.iters, u.outliers.len()),
        ParsedBody::Waterfill(w) => (0, 0, w.outliers.len()),
    };
    BlockStats {
        n: b.n,
        d_eff: b.d_eff,
        k_used,
        kmeans_iters,
        n_outliers,
    }
}

/// Checks a `[n, d]` input: shape, limits, finiteness and magnitude.
pub(crate) fn check_input(x: &[f32], n: usize, d: usize) -> Result<()> {
    if n == 0 || d == 0 {
        return Err(Error::Shape(format!(
            "empty input: {n} vectors of length {d}"
        )));
    }
    if d > MAX_HEAD_DIM {
        return Err(Error::Shape(format!(
            "head_dim {d} exceeds the limit {MAX_HEAD_DIM}"
        )));
    }
    if n > crate::format::MAX_TOKENS {
        return Err(Error::Shape(format!("{n} tokens exceed the limit")));
    }
    if x.len() != n * d {
        return Err(Error::Shape(format!(
            "buffer holds {} values, expected {n} x {d}",
            x.len()
        )));
    }
    // One pass the compiler vectorises; NaN fails `<=` too. Only bad input is scanned again,
    // for the position the error names.
    let in_range = x
        .chunks(1024)
        .all(|c| c.iter().fold(true, |ok, v| ok & (v.abs() <= MAX_MAGNITUDE)));
    if in_range {
        return Ok(());
    }
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        return Err(Error::NonFinite {
            token: i / d,
            dim: i % d,
        });
    }
    if let Some(i) = x.iter().position(|v| v.abs() > MAX_MAGNITUDE) {
        return Err(Error::InvalidParams(format!(
            "input magnitude {} at token {}, dim {} exceeds the supported range (|x| <= {MAX_MAGNITUDE})",
            x[i],
            i / d,
            i % d
        )));
    }
    Ok(())
}

/// Encodes one block of `n` vectors with the basis from `basis`.
pub fn encode_block(
    x: &[f32],
    n: usize,
    d: usize,
    weights: Option<&[f32]>,
    p: &CodecParams,
    basis: BasisRef<'_>,
    block_index: usize,
) -> Result<EncodedBlock> {
    check_input(x, n, d)?;
    encode_checked_block(x, n, d, weights, p, basis, block_index)
}

/// [`encode_block`] on input already checked (a layer checks its whole input once).
fn encode_checked_block(
    x: &[f32],
    n: usize,
    d: usize,
    weights: Option<&[f32]>,
    p: &CodecParams,
    basis: BasisRef<'_>,
    block_index: usize,
) -> Result<EncodedBlock> {
    // A block whose tokens all have weight zero (e.g. padding) is coded unweighted: the
    // layer's weights were checked as a whole, and zero everywhere says nothing.
    let weights = weights.filter(|w| w.iter().any(|&v| v != 0.0));
    let w = normalised_weights(n, weights)?;
    // A frame of the block's own is stored with it; a shared one is stored once per layer.
    let frame: Cow<'_, SharedBasis> = match basis {
        BasisRef::Shared(s) => Cow::Borrowed(s),
        BasisRef::PerBlock => Cow::Owned(fit_basis(x, n, d, weights, p)?),
        BasisRef::External(e) => Cow::Owned(SharedBasis {
            d_eff: e.d_eff(),
            mean: rounded_mean(x, n, d, &w, p),
            basis: Vec::new(), // the caller holds the rows: not stored
        }),
    };
    let rows = match basis {
        BasisRef::External(e) => e.rows(),
        _ => &frame.basis,
    };
    let d_eff = frame.d_eff;
    let coeffs = project(x, n, d, &frame.mean, rows, d_eff);
    let body = match p.allocation {
        Allocation::Uniform => {
            BlockBody::Uniform(uniform::encode(coeffs, n, d_eff, &w, p, block_index)?)
        }
        Allocation::Waterfill => {
            BlockBody::Waterfill(waterfill::encode(&coeffs, n, d_eff, d, &w, p))
        }
    };
    let (mean, basis) = match frame {
        Cow::Owned(own) => (own.mean, own.basis),
        Cow::Borrowed(_) => (Vec::new(), Vec::new()),
    };
    Ok(EncodedBlock {
        n,
        d_eff,
        mean,
        basis,
        body,
    })
}

/// Decodes one block into `out` (`n x d`) given its mean and basis rows (empty: identity),
/// and checks that every value is finite.
pub fn decode_block(
    b: &ParsedBlock<'_>,
    d: usize,
    p: &CodecParams,
    mean: &[f32],
    basis: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let (n, d_eff) = (b.n, b.d_eff);
    let basis_ok = basis.len() == d_eff * d || (basis.is_empty() && d_eff == d);
    if out.len() != n * d || mean.len() != d || !basis_ok {
        return Err(Error::Format(
            "block sections disagree with the layer shape".into(),
        ));
    }
    let coeffs = match &b.body {
        // Identity basis: the mean goes into the tables and the rows straight into `out`;
        // the kernel bounds every value it writes.
        ParsedBody::Waterfill(w) if basis.is_empty() => {
            return waterfill::decode_into(w, n, d_eff, p.metric, Some(mean), out);
        }
        ParsedBody::Waterfill(w) => {
            let mut c = vec![0.0f32; n * d_eff];
            waterfill::decode_into(w, n, d_eff, p.metric, None, &mut c)?;
            c
        }
        ParsedBody::Uniform(u) => uniform::decode(u, n, d_eff, p)?,
    };
    unproject(&coeffs, n, d, mean, basis, d_eff, out);
    // (The reader bounds every stored value so that decoding stays finite; this check is
    // the belt to those braces.)
    if out.iter().any(|v| !v.is_finite()) {
        return Err(Error::Format("decoded values are not finite".into()));
    }
    Ok(())
}

/// Encodes a layer (`n x d`, row-major) block by block, in parallel.
pub fn encode_layer(
    x: &[f32],
    n: usize,
    d: usize,
    weights: Option<&[f32]>,
    p: &CodecParams,
    input_dtype: InputDtype,
) -> Result<EncodedLayer> {
    encode_layer_with(x, n, d, weights, p, input_dtype, None)
}

/// [`encode_layer`] with an optional caller-supplied basis (not stored; fingerprinted).
pub fn encode_layer_with(
    x: &[f32],
    n: usize,
    d: usize,
    weights: Option<&[f32]>,
    p: &CodecParams,
    input_dtype: InputDtype,
    external: Option<&ExternalBasis>,
) -> Result<EncodedLayer> {
    p.validate()?;
    check_input(x, n, d)?;
    if let Some(w) = weights {
        normalised_weights(n, Some(w))?;
    }
    if let Some(e) = external {
        if e.head_dim() != d {
            return Err(Error::Shape(format!(
                "basis rows have length {}, vectors have {d}",
                e.head_dim()
            )));
        }
        if p.share_basis {
            return Err(Error::InvalidParams(
                "share_basis and an external basis are exclusive".into(),
            ));
        }
    }
    let shared = if p.share_basis {
        Some(fit_basis(x, n, d, weights, p)?)
    } else {
        None
    };
    let basis = match (&shared, external) {
        (Some(s), _) => BasisRef::Shared(s),
        (None, Some(e)) => BasisRef::External(e),
        (None, None) => BasisRef::PerBlock,
    };
    let bs = p.block_size;
    let blocks: Vec<EncodedBlock> = parallel::map(n.div_ceil(bs), |bi| {
        let lo = bi * bs;
        let hi = (lo + bs).min(n);
        encode_checked_block(
            &x[lo * d..hi * d],
            hi - lo,
            d,
            weights.map(|w| &w[lo..hi]),
            p,
            basis,
            bi,
        )
    })
    .into_iter()
    .collect::<Result<_>>()?;
    let ext = external.map(|e| (e.d_eff(), e.fingerprint()));
    let bytes = write_layer(p, n, d, input_dtype, shared.as_ref(), ext, &blocks);
    Ok(EncodedLayer {
        stats: blocks.iter().map(block_stats).collect(),
        params: p.clone(),
        n_tokens: n,
        head_dim: d,
        input_dtype,
        external: ext.map(|(_, fp)| fp),
        bytes,
    })
}

/// Decodes a layer into a fresh `n x d` buffer (blocks in parallel).
pub fn decode_layer(enc: &EncodedLayer) -> Result<Vec<f32>> {
    decode_bytes(enc.as_bytes(), None)
}

/// [`decode_layer`] for layers that may need an external basis.
pub fn decode_layer_with(enc: &EncodedLayer, external: Option<&ExternalBasis>) -> Result<Vec<f32>> {
    decode_bytes(enc.as_bytes(), external)
}

/// [`decode_layer_with`] into `out`, which must hold exactly `n_tokens x head_dim` values
/// (`Error::Shape` otherwise). On error the contents of `out` are unspecified.
pub fn decode_layer_into(
    enc: &EncodedLayer,
    external: Option<&ExternalBasis>,
    out: &mut [f32],
) -> Result<()> {
    check_output(enc, out)?;
    decode_parsed(&read_held_layer(enc.as_bytes())?, external, out)
}

/// [`decode_layer_into`] without an external basis, with a layer of one water-filled block
/// in its own coordinates (no basis: `pca_method = none`) decoded with its values mapped as
/// [`waterfill::decode_mapped`] maps them, on the calling thread, returning what `choose`
/// chose; any other layer is decoded as its values (`Ok(None)`), from the same parse.
pub fn decode_layer_mapped<C>(
    enc: &EncodedLayer,
    out: &mut [f32],
    choose: impl FnOnce(&[f32], &[f32], &[(usize, f32)]) -> C,
    map: impl Fn(&C, usize, &mut [f32]),
) -> Result<Option<C>> {
    check_output(enc, out)?;
    let (n, d) = enc.shape();
    let parsed = read_held_layer(enc.as_bytes())?;
    if let Some((w, mean)) = own_waterfill(&parsed, n, d) {
        let metric = parsed.params.metric;
        return waterfill::decode_mapped(w, n, d, metric, Some(mean), choose, map, out).map(Some);
    }
    decode_parsed(&parsed, None, out).map(|()| None)
}

/// The codes and mean of a layer of `n` vectors of `d` values that is one water-filled block
/// in its own coordinates (no basis, shared or external), else None.
fn own_waterfill<'p, 'a>(
    parsed: &'p ParsedLayer<'a>,
    n: usize,
    d: usize,
) -> Option<(&'p WaterfillCodes<'a>, &'p [f32])> {
    let own = parsed.shared.is_none() && parsed.external.is_none();
    match &parsed.blocks[..] {
        [b] if own && b.basis.is_empty() && b.d_eff == d && b.n == n => match &b.body {
            ParsedBody::Waterfill(w) => Some((w, &b.mean[..])),
            ParsedBody::Uniform(_) => None,
        },
        _ => None,
    }
}

/// The weighted sums `out[r, j] = sum_t w[r, t] x[t, j]` of the layer's decoded vectors `x`,
/// row `r`'s weights at `weights[r * stride..][..n_tokens]`, read straight from the codes
/// ([`waterfill::weighted_sums`]) for a layer that [`decode_layer_mapped`] maps (one
/// water-filled block in its own coordinates); `Ok(false)`, with `out` untouched, for any
/// other layer, or where that kernel does not run: the caller decodes the layer instead.
pub fn layer_weighted_sums(
    enc: &EncodedLayer,
    (weights, stride, rows): (&[f32], usize, usize),
    out: &mut [f32],
) -> Result<bool> {
    let (n, d) = enc.shape();
    // Declined before the parse where the kernel does not run: the caller's decode parses.
    if !(1..=waterfill::weighted_sums_rows()).contains(&rows) {
        return Ok(false);
    }
    let parsed = read_held_layer(enc.as_bytes())?;
    match own_waterfill(&parsed, n, d) {
        Some((w, mean)) => {
            let (metric, sums) = (parsed.params.metric, (weights, stride, rows));
            waterfill::weighted_sums(w, n, d, metric, Some(mean), sums, out)
        }
        None => Ok(false),
    }
}

/// `out` holds exactly the layer's `n_tokens x head_dim` values (`Error::Shape` otherwise).
fn check_output(enc: &EncodedLayer, out: &[f32]) -> Result<()> {
    let (n, d) = enc.shape();
    if out.len() != n * d {
        return Err(Error::Shape(format!(
            "output holds {} values, the layer decodes to {n} x {d}",
            out.len()
        )));
    }
    Ok(())
}

/// Checks that decoding `layers` together stays within the decode limit that each layer
/// meets on its own, applied to their totals (decoded bytes per stored byte, beyond a
/// floor): many small hostile layers, each within the per-layer floor, must not add up to
/// an allocation that no single layer could make.
pub fn check_batch_decode(layers: &[&EncodedLayer]) -> Result<()> {
    let decoded = layers
        .iter()
        .map(|e| e.n_tokens.saturating_mul(e.head_dim).saturating_mul(4))
        .fold(0, usize::saturating_add);
    let stored = layers
        .iter()
        .map(|e| e.nbytes())
        .fold(0, usize::saturating_add);
    check_decode_size(decoded, stored, || format!("{} layers", layers.len()))
}

/// Parses and decodes raw bytes into a fresh `n_tokens x head_dim` buffer.
pub fn decode_bytes(bytes: &[u8], external: Option<&ExternalBasis>) -> Result<Vec<f32>> {
    let parsed = read_layer(bytes)?;
    let mut out = vec![0.0f32; parsed.n_tokens * parsed.head_dim];
    decode_parsed(&parsed, external, &mut out)?;
    Ok(out)
}

/// Decodes a parsed layer into `out` (`n_tokens x head_dim`), blocks in parallel.
fn decode_parsed(
    parsed: &ParsedLayer<'_>,
    external: Option<&ExternalBasis>,
    out: &mut [f32],
) -> Result<()> {
    let d = parsed.head_dim;
    debug_assert_eq!(out.len(), parsed.n_tokens * d);
    let ext_rows: Option<&[f32]> = match (parsed.external, external) {
        (None, None) => None,
        (Some((d_eff, fp)), Some(e)) => Some(e.rows_for(d_eff, fp, d)?),
        (Some((_, fp)), None) => {
            return Err(Error::InvalidParams(format!(
                "the layer was encoded with an external basis ({fp:#018x}): pass the same basis to decode"
            )))
        }
        (None, Some(_)) => {
            return Err(Error::InvalidParams(
                "the layer does not use an external basis, but one was given".into(),
            ))
        }
    };
    let bs = parsed.params.block_size;
    parallel::map_chunks(out, bs * d, |i, chunk| {
        let b = &parsed.blocks[i];
        let (mean, basis): (&[f32], &[f32]) = match (&parsed.shared, ext_rows) {
            (Some(s), _) => (&s.mean, &s.basis),
            (None, Some(rows)) => (&b.mean, rows),
            (None, None) => (&b.mean, &b.basis),
        };
        decode_block(b, d, &parsed.params, mean, basis, chunk)
    })
    .into_iter()
    .collect()
}

#[cfg(test)]
mod tests;
