//! The entry points: [`key_logits`] and [`value_sums`] over coded streams.

use super::checks::check_len;
use super::inputs::{KeyInputs, Precision, RopeAngles};
use super::kernels::{nonzero_chunks, run_block_logits, run_block_sums, Coords};
use super::norms::Norms;
use super::prepared::{run_prepared_logits, PreparedKeys};
use super::streams::CodedStreams;
use crate::error::Result;

/// Logits `[streams, g, tokens]` of the queries `[streams, g, d]` against the coded keys:
/// `q[s, j] . rope_t(y_t M_h) * scale_t` with `M_h` the `h`-th of `frames` (`[heads, d, d]`,
/// `None`: the identity), RoPE turning channels `(i, i + pairs)` for `i < pairs` as complex
/// numbers, and `scale_t = norm_t / |y_t|` when `norms` is given. `precision`: the frame
/// product's arithmetic.
pub fn key_logits(
    coded: &CodedStreams<'_>,
    frames: Option<(&[f32], usize)>,
    rotation: Option<&RopeAngles<'_>>,
    norms: Option<&Norms<'_>>,
    queries: &[f32],
    g: usize,
    precision: Precision,
) -> Result<Vec<f32>> {
    let keys = KeyInputs {
        frames,
        rotation,
        precision,
    };
    logits_with(coded, &keys, norms, queries, g, None)
}

/// [`key_logits`], reading the blocks `prepared` holds (made with the same `keys`) instead of
/// decoding them.
pub(crate) fn logits_with(
    coded: &CodedStreams<'_>,
    keys: &KeyInputs<'_>,
    norms: Option<&Norms<'_>>,
    queries: &[f32],
    g: usize,
    prepared: Option<&PreparedKeys>,
) -> Result<Vec<f32>> {
    let (s_n, t_n, d) = (coded.streams, coded.tokens(), coded.d);
    check_len(
        "queries",
        queries.len(),
        &[s_n, g, d],
        "streams x rows x head_dim",
    )?;
    keys.check(coded)?;
    if let Some(nm) = norms {
        nm.check(coded)?;
    }
    if let Some(p) = prepared {
        p.check(coded)?;
    }
    let products = keys.products(d);
    let nb = coded.blocks();
    // The queries' non-zero 8-channel chunks, once per row rather than once per block.
    let chunks: Vec<Vec<usize>> = queries.chunks_exact(d).map(nonzero_chunks).collect();
    let rows = |s: usize| (&queries[s * g * d..][..g * d], &chunks[s * g..][..g]);
    let ready = |s: usize, b: usize, out: &mut [f32]| {
        let bk = prepared?.take(s * nb + b)?;
        if norms.is_some() && bk.lengths.len() != bk.tokens(d) {
            return None; // made without the lengths that norms need: made again here
        }
        Some((|| {
            let nm = norms.map(|nm| nm.block(coded, s, b)).transpose()?;
            run_prepared_logits((bk, d, nm.as_deref(), rows(s)), out);
            Ok(())
        })())
    };
    let levels = keys.levels(&products, norms.is_none());
    let decode = |i: usize, scratch: &mut Vec<f32>| coded.decode_keys(i, scratch, levels);
    // Each block's `[g, n]` logits, block after block, then rearranged into `[s, g, t]`.
    let mut parts = vec![0.0f32; s_n * g * t_n];
    let blocks = coded.token_parts(&mut parts, g);
    coded.map_blocks_or(blocks, ready, decode, |s, b, y, grid, _t0, out| {
        let (m, product, rot) = keys.block(coded, &products, s, b);
        let nm = norms.map(|nm| nm.block(coded, s, b)).transpose()?;
        let y = Coords::of(y, grid);
        run_block_logits(((y, d, m, product, rot), nm.as_deref(), rows(s)), out);
        Ok(())
    })?;
    let mut logits = vec![0.0f32; s_n * g * t_n];
    for (i, part) in coded.token_parts(&mut parts, g).into_iter().enumerate() {
        let (s, b) = (i / nb, i % nb);
        let (t0, n) = (coded.offsets[b], part.len() / g.max(1));
        for j in 0..g {
            logits[(s * g + j) * t_n + t0..][..n].copy_from_slice(&part[j * n..][..n]);
        }
    }
    Ok(logits)
}

/// Weighted sums `[streams, g, d]` of the coded values, in frame coordinates:
/// `sum_t weights[s, j, t] * scale_t * y_t` with `scale_t = norm_t / |y_t|` when `norms` is
/// given. `weights` is `[streams, g, tokens]`.
pub fn value_sums(
    coded: &CodedStreams<'_>,
    weights: &[f32],
    norms: Option<&Norms<'_>>,
    g: usize,
) -> Result<Vec<f32>> {
    let (s_n, t_n, d) = (coded.streams, coded.tokens(), coded.d);
    check_len(
        "weights",
        weights.len(),
        &[s_n, g, t_n],
        "streams x rows x tokens",
    )?;
    if let Some(nm) = norms {
        nm.check(coded)?;
    }
    if g * d == 0 {
        return Ok(Vec::new());
    }
    // Each block's `[g, d]` sums (zeros on entry), block after block. Without token norms
    // (whose scales need each decoded vector's length) a decode step's few rows are summed
    // straight from the codes, with no decoded block written (`codec::layer_weighted_sums`).
    let mut parts = vec![0.0f32; coded.encs.len() * g * d];
    let blocks = parts.chunks_mut(g * d).collect();
    let nb = coded.blocks();
    let from_codes = |s: usize, b: usize, out: &mut [f32]| {
        if norms.is_some() {
            return None;
        }
        let w = &weights[s * g * t_n + coded.offsets[b]..];
        match crate::codec::layer_weighted_sums(coded.encs[s * nb + b], (w, t_n, g), out) {
            Ok(false) => None,
            done => Some(done.map(|_| ())),
        }
    };
    let decode = |i: usize, scratch: &mut Vec<f32>| coded.decode(i, scratch).map(|()| None);
    coded.map_blocks_or(blocks, from_codes, decode, |s, b, y, _, t0, out| {
        let w = &weights[s * g * t_n..][..g * t_n];
        let nm = norms.map(|nm| nm.block(coded, s, b)).transpose()?;
        run_block_sums((y, d, w, t_n, t0, nm.as_deref(), g), out);
        Ok(())
    })?;
    // Blocks add up in token order, so the result does not depend on the thread count.
    let mut sums = vec![0.0f32; s_n * g * d];
    for (i, part) in parts.chunks_exact(g * d).enumerate() {
        let acc = &mut sums[(i / nb) * g * d..][..g * d];
        acc.iter_mut().zip(part).for_each(|(a, p)| *a += p);
    }
    Ok(sums)
}
