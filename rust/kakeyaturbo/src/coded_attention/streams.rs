//! [`CodedStreams`]: the layout of the coded blocks the kernels read, and the parallel walk
//! over them.

use super::int16;
use super::scratch::Decoded;
use crate::codec::{decode_layer_into, decode_layer_mapped, EncodedLayer};
use crate::error::{Error, Result};
use crate::parallel;

/// Coded streams as the kernels take them: `streams` streams one after the other, each
/// stream's blocks in token order, every stream with the same block lengths and head dim.
pub struct CodedStreams<'a> {
    pub(super) encs: &'a [&'a EncodedLayer],
    pub(super) streams: usize,
    /// Token offset of each block within its stream (`blocks + 1` entries).
    pub(super) offsets: Vec<usize>,
    pub(super) d: usize,
}

impl<'a> CodedStreams<'a> {
    /// Checks the layout: a non-empty whole number of blocks per stream, equal block lengths
    /// across streams, one head dim, no external basis.
    pub fn new(encs: &'a [&'a EncodedLayer], streams: usize) -> Result<Self> {
        if streams == 0 || encs.is_empty() || !encs.len().is_multiple_of(streams) {
            return Err(Error::Shape(format!(
                "{} blocks do not split into {streams} streams",
                encs.len()
            )));
        }
        let blocks = encs.len() / streams;
        let d = encs[0].shape().1;
        let mut offsets = Vec::with_capacity(blocks + 1);
        offsets.push(0);
        for e in &encs[..blocks] {
            offsets.push(offsets[offsets.len() - 1] + e.shape().0);
        }
        for (i, e) in encs.iter().enumerate() {
            let (n, di) = e.shape();
            let b = i % blocks;
            if di != d || n != offsets[b + 1] - offsets[b] {
                return Err(Error::Shape(format!(
                    "block {b} of stream {} is {n} x {di}, stream 0's is {} x {d}: streams must \
                     have equal blocks",
                    i / blocks,
                    offsets[b + 1] - offsets[b]
                )));
            }
            if e.external_fingerprint().is_some() {
                return Err(Error::InvalidParams(
                    "a block uses an external basis, which attention over codes does not take"
                        .into(),
                ));
            }
        }
        Ok(Self {
            encs,
            streams,
            offsets,
            d,
        })
    }

    /// Tokens per stream.
    pub fn tokens(&self) -> usize {
        self.offsets[self.offsets.len() - 1]
    }

    /// Head dim.
    pub fn head_dim(&self) -> usize {
        self.d
    }

    /// Streams.
    pub fn streams(&self) -> usize {
        self.streams
    }

    pub(super) fn blocks(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Runs `f(stream, block, decoded block, grid, its first token, out)` on every block in
    /// parallel, each writing its own `out` of `parts` (one per block, in (stream, block)
    /// order), where `ready(stream, block, out)` may fill a block's part without decoding it
    /// (keys prepared beforehand, value sums from the codes; Some with how that went); the
    /// others are decoded by `decode(i, scratch)` into a per-thread scratch buffer, which may
    /// return how (an int16 grid: [`Self::decode_keys`]).
    pub(super) fn map_blocks_or(
        &self,
        parts: Vec<&mut [f32]>,
        ready: impl Fn(usize, usize, &mut [f32]) -> Option<Result<()>> + Sync,
        decode: impl Fn(usize, &mut Vec<f32>) -> Result<Option<int16::Grid>> + Sync,
        f: impl Fn(usize, usize, &[f32], Option<&int16::Grid>, usize, &mut [f32]) -> Result<()> + Sync,
    ) -> Result<()> {
        assert_eq!(parts.len(), self.encs.len(), "one part per block");
        let nb = self.blocks();
        let done = parallel::map_init_parts(parts, Decoded::lend, |scratch, i, out| {
            let (s, b) = (i / nb, i % nb);
            if let Some(r) = ready(s, b, out) {
                return r;
            }
            let grid = decode(i, &mut scratch.0)?;
            f(s, b, &scratch.0, grid.as_ref(), self.offsets[b], out)
        });
        done.into_iter().collect()
    }

    /// Each block's part of a buffer of `per_token` values per token of every stream
    /// (`[streams, tokens, per_token]`), in (stream, block) order: `out[i]` is block `i`'s
    /// `[n_i, per_token]`.
    pub(super) fn token_parts<'o>(
        &self,
        buf: &'o mut [f32],
        per_token: usize,
    ) -> Vec<&'o mut [f32]> {
        let nb = self.blocks();
        let tokens = |b: usize| self.offsets[b + 1] - self.offsets[b];
        let lens = (0..self.streams * nb).map(|i| per_token * tokens(i % nb));
        parallel::split_parts(buf, lens)
    }

    /// Block `i` (stream-major) decoded into `scratch`.
    pub(super) fn decode(&self, i: usize, scratch: &mut Vec<f32>) -> Result<()> {
        decode_layer_into(self.encs[i], None, self.sized(i, scratch))
    }

    /// Block `i` decoded into `scratch` for its keys: as int16 levels straight from its codes
    /// where `levels` and the block is in its own coordinates (the grid returned: no pass over
    /// its values to find their centres, spreads and levels), else as its values (None).
    pub(super) fn decode_keys(
        &self,
        i: usize,
        scratch: &mut Vec<f32>,
        levels: bool,
    ) -> Result<Option<int16::Grid>> {
        if !levels {
            return self.decode(i, scratch).map(|()| None);
        }
        let (grid, level) = (int16::Grid::new, int16::Grid::level);
        decode_layer_mapped(self.encs[i], self.sized(i, scratch), grid, level)
    }

    /// `scratch` resized to block `i`'s `n x d` values (the callers read its whole length).
    pub(super) fn sized<'s>(&self, i: usize, scratch: &'s mut Vec<f32>) -> &'s mut [f32] {
        let b = i % self.blocks();
        scratch.resize((self.offsets[b + 1] - self.offsets[b]) * self.d, 0.0);
        scratch
    }
}
