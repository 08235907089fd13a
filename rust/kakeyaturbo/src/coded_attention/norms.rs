//! Token norms of coded streams, as floats or as the one-byte codes `KakeyaCache` holds.
//!
//! The codes are those of `python/kakeyaturbo/norm_codes.py`: per block and stream, the
//! smallest and largest nonzero norm as float16 (`lo`, `hi`) and per token a byte, 0 for an
//! exact zero and `c` in 1..=255 for `2^(log2 lo + (c - 1) (log2 hi - log2 lo) / 254)`.
//! Decoding them here, block by block inside the kernels, spares a per-step decode of every
//! block's norms in torch. The arithmetic is the Python decoder's, operation for operation.

use std::borrow::Cow;

use half::f16;

use super::checks::check_len;
use super::streams::CodedStreams;
use crate::error::{Error, Result};

/// Log steps between a stream's smallest and largest norm (codes 1..=255).
const STEPS: f32 = 254.0;

/// Token norms of every stream of a [`CodedStreams`].
pub enum Norms<'a> {
    /// `[streams, tokens]` floats.
    Values(&'a [f32]),
    /// Per block, its codes `[streams, block tokens]` and float16 bounds `[streams, 2]`
    /// (smallest, largest nonzero norm).
    Codes(Vec<(&'a [u8], &'a [f16])>),
}

impl Norms<'_> {
    /// Checks the norms against the streams' layout and, for codes, that every bound is a
    /// positive finite float16 (hostile bounds would decode to NaN or infinity).
    pub fn check(&self, coded: &CodedStreams<'_>) -> Result<()> {
        let (s_n, t_n) = (coded.streams(), coded.tokens());
        match self {
            Norms::Values(v) => check_len("norms", v.len(), &[s_n, t_n], "streams x tokens"),
            Norms::Codes(blocks) => {
                if blocks.len() != coded.blocks() {
                    return Err(Error::Shape(format!(
                        "norm codes: {} blocks, the streams have {}",
                        blocks.len(),
                        coded.blocks()
                    )));
                }
                for (b, (codes, bounds)) in blocks.iter().enumerate() {
                    let n = coded.offsets[b + 1] - coded.offsets[b];
                    let what = format!("norm codes of block {b}");
                    check_len(&what, codes.len(), &[s_n, n], "streams x tokens")?;
                    check_bounds(&what, bounds, s_n)?;
                }
                Ok(())
            }
        }
    }

    /// The norms of stream `s`'s block `b` (after [`Norms::check`]).
    pub(super) fn block(
        &self,
        coded: &CodedStreams<'_>,
        s: usize,
        b: usize,
    ) -> Result<Cow<'_, [f32]>> {
        let (t0, n) = (coded.offsets[b], coded.offsets[b + 1] - coded.offsets[b]);
        match self {
            Norms::Values(v) => Ok(Cow::Borrowed(&v[s * coded.tokens() + t0..][..n])),
            Norms::Codes(blocks) => {
                let (codes, bounds) = blocks[b];
                let mut norms = Vec::with_capacity(n);
                decode_stream(&codes[s * n..][..n], &bounds[2 * s..][..2], &mut norms);
                Ok(Cow::Owned(norms))
            }
        }
    }
}

/// A block's bounds must be `[streams, 2]` positive finite float16 (hostile bounds would
/// decode to NaN or infinity).
fn check_bounds(what: &str, bounds: &[f16], streams: usize) -> Result<()> {
    check_len(what, bounds.len(), &[streams, 2], "streams x 2 bounds")?;
    match bounds.iter().find(|v| !(v.is_finite() && v.to_f32() > 0.0)) {
        Some(v) => Err(Error::Format(format!(
            "{what}: bound {v} is not a positive finite float16"
        ))),
        None => Ok(()),
    }
}

/// Appends to `out` the norms of one stream's block: its codes and its two bounds.
fn decode_stream(codes: &[u8], bounds: &[f16], out: &mut Vec<f32>) {
    let (lo, hi) = (bounds[0].to_f32().log2(), bounds[1].to_f32().log2());
    let step = (hi - lo) / STEPS;
    out.extend(codes.iter().map(|&c| {
        if c == 0 {
            0.0
        } else {
            ((c as f32 - 1.0) * step + lo).exp2()
        }
    }));
}

/// The norms `[streams, tokens]` of consecutive blocks given as their codes `[streams, block
/// tokens]` and float16 bounds `[streams, 2]` (the blocks' tokens side by side per stream).
/// Hostile input is refused: lengths that do not split into `streams` rows, bounds that are
/// not positive finite float16.
pub fn decode_codes(blocks: &[(&[u8], &[f16])], streams: usize) -> Result<Vec<f32>> {
    let mut lens = Vec::with_capacity(blocks.len());
    for (b, (codes, bounds)) in blocks.iter().enumerate() {
        let what = format!("norm codes of block {b}");
        if streams == 0 || codes.len() % streams != 0 {
            return Err(Error::Shape(format!(
                "{what}: {} codes do not split into {streams} streams",
                codes.len()
            )));
        }
        check_bounds(&what, bounds, streams)?;
        lens.push(codes.len() / streams);
    }
    let mut out = Vec::with_capacity(streams * lens.iter().sum::<usize>());
    for s in 0..streams {
        for ((codes, bounds), &n) in blocks.iter().zip(&lens) {
            decode_stream(&codes[s * n..][..n], &bounds[2 * s..][..2], &mut out);
        }
    }
    Ok(out)
}
