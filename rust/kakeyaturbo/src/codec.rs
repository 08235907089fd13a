//! The block and layer pipeline: PCA -> skeleton -> rotation -> Lloyd-Max + outliers.
//!
//! Encoding a block of `n` vectors `x_i` (length `D`):
//! 1. `mean`, `basis` (`d_eff x D`) from weighted PCA (or the layer's shared basis), both
//!    rounded to the skeleton dtype *before* use, so the decoder sees exactly what the
//!    encoder used; coefficients `c_i = B (x_i - mean)`.
//! 2. Skeleton (k > 0): centres rounded likewise, `t_i = <c_i, mu_{a_i}>` rounded to f16,
//!    residual `r_i = c_i - t_i mu_{a_i}`.
//! 3. `u_i = R [r_i, 0...]` with the orthonormal WHT rotation `R` of length
//!    `W = next_pow2(d_eff)`; `s0_i = |u_i| / sqrt(W)`, so `v_i = u_i / s0_i` has unit mean
//!    square (the Lloyd-Max tables assume N(0, 1)).
//! 4. Codes `q = Q(v_i)`; coordinates with `|v| > threshold` are outliers kept in f16. The
//!    stored scale is refit given the dequantised `v_hat`: for `Metric::Mse` the
//!    least-squares `s0 <v, v_hat> / |v_hat|^2`; for `Metric::InnerProduct`
//!    `s0 |v|^2 / <v, v_hat>`, which makes `<r_hat, r> = |r|^2` (no shrinkage of `q . k`).
//!
//! Decoding reverses it: `x_hat = mean + B^T (R^-1 [s v_hat] + t mu)`, truncated to
//! `d_eff` after the inverse rotation. Blocks are independent and run in parallel.

use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::format::{read_layer, write_layer, ParsedLayer};
use crate::kmeans;
use crate::lloyd_max::{self, Codebook};
use crate::outliers;
use crate::params::{CodecParams, InputDtype, Metric, PcaMethod, SkeletonDtype};
use crate::pca::{self, normalised_weights, PcaFit};
use crate::rsvd;
use crate::wht::{padded_len, Rotation};

/// A basis fitted once per layer and stored once (`share_basis`).
#[derive(Debug, Clone, PartialEq)]
pub struct SharedBasis {
    /// Kept components.
    pub d_eff: usize,
    /// Mean (length `D`), already rounded to the skeleton dtype.
    pub mean: Vec<f32>,
    /// `d_eff x D` rows, already rounded to the skeleton dtype.
    pub basis: Vec<f32>,
}

/// One encoded block, with its codes unpacked (the wire form packs them).
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedBlock {
    /// Vectors in the block.
    pub n: usize,
    /// Kept PCA components.
    pub d_eff: usize,
    /// k-means iterations run (statistics only).
    pub kmeans_iters: u32,
    /// Block mean (empty with a shared basis).
    pub mean: Vec<f32>,
    /// Block basis rows (empty with a shared basis).
    pub basis: Vec<f32>,
    /// Centres actually stored.
    pub k_used: usize,
    /// `k_used x d_eff` unit centres.
    pub centres: Vec<f32>,
    /// Centre id per vector (empty when `k_used == 0`).
    pub labels: Vec<u16>,
    /// Skeleton coefficient per vector (empty when `k_used == 0`).
    pub t: Vec<f16>,
    /// Per-vector dequantisation scale.
    pub scales: Vec<f16>,
    /// `n x W` quantiser indices.
    pub codes: Vec<u16>,
    /// `(flat position, value)` of exactly stored scaled coordinates.
    pub outliers: Vec<(u32, f16)>,
}

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
}

impl EncodedLayer {
    /// Validates `bytes` completely (checksum, limits, every field) and wraps them.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        let parsed = read_layer(&bytes)?;
        Ok(Self::from_parsed(bytes, &parsed))
    }

    fn from_parsed(bytes: Vec<u8>, p: &ParsedLayer) -> Self {
        EncodedLayer {
            stats: p.blocks.iter().map(block_stats).collect(),
            params: p.params.clone(),
            n_tokens: p.n_tokens,
            head_dim: p.head_dim,
            input_dtype: p.input_dtype,
            bytes,
        }
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
}

fn block_stats(b: &EncodedBlock) -> BlockStats {
    BlockStats {
        n: b.n,
        d_eff: b.d_eff,
        k_used: b.k_used,
        kmeans_iters: b.kmeans_iters,
        n_outliers: b.outliers.len(),
    }
}

/// Bits per centre label: 0 for at most one centre.
pub fn label_bits(k_used: usize) -> u32 {
    if k_used <= 1 {
        0
    } else {
        usize::BITS - (k_used - 1).leading_zeros()
    }
}

fn round_to(v: f32, dt: SkeletonDtype) -> f32 {
    match dt {
        SkeletonDtype::F16 => f16::from_f32(v).to_f32(),
        SkeletonDtype::Bf16 => bf16::from_f32(v).to_f32(),
        SkeletonDtype::F32 => v,
    }
}

fn round_all(v: &mut [f32], dt: SkeletonDtype) {
    v.iter_mut().for_each(|x| *x = round_to(*x, dt));
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Largest magnitude an f16 side value may take (its finite range, with headroom).
const F16_LIMIT: f32 = 60_000.0;

fn codebook(p: &CodecParams) -> Result<Codebook> {
    match &p.centroids {
        Some(c) => Codebook::from_levels(c.clone()),
        None => Ok(lloyd_max::gaussian(p.bit_width)?.clone()),
    }
}

fn check_input(x: &[f32], n: usize, d: usize) -> Result<()> {
    if n == 0 || d == 0 {
        return Err(Error::Shape(format!(
            "empty input: {n} vectors of length {d}"
        )));
    }
    if d > crate::params::MAX_HEAD_DIM {
        return Err(Error::Shape(format!(
            "head_dim {d} exceeds the limit {}",
            crate::params::MAX_HEAD_DIM
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
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        return Err(Error::NonFinite { index: i });
    }
    if let Some(i) = x.iter().position(|v| v.abs() > F16_LIMIT) {
        return Err(Error::InvalidParams(format!(
            "input magnitude {} at flat index {i} exceeds the supported range (|x| <= {F16_LIMIT})",
            x[i]
        )));
    }
    Ok(())
}

/// Fits the (rounded) mean and basis of a set of vectors.
fn fit_basis(
    x: &[f32],
    n: usize,
    d: usize,
    w: Option<&[f32]>,
    p: &CodecParams,
) -> Result<SharedBasis> {
    let max_rank = p.max_rank(d);
    let fit: PcaFit = match p.pca_method {
        PcaMethod::Exact => pca::fit_exact(x, n, d, w, p.variance_ratio, max_rank)?,
        PcaMethod::Randomized => rsvd::fit_randomized(
            x,
            n,
            d,
            w,
            p.variance_ratio,
            max_rank,
            p.target_rank,
            p.oversample,
            p.power_iters,
            p.seed,
        )?,
    };
    let mut mean = fit.mean;
    let mut basis = fit.basis;
    round_all(&mut mean, p.skeleton_dtype);
    round_all(&mut basis, p.skeleton_dtype);
    Ok(SharedBasis {
        d_eff: fit.d_eff,
        mean,
        basis,
    })
}

/// `n x d_eff` coefficients `B (x_i - mean)`.
fn project(x: &[f32], n: usize, d: usize, sb: &SharedBasis) -> Vec<f32> {
    let mut coeffs = vec![0.0f32; n * sb.d_eff];
    let mut centred = vec![0.0f32; d];
    for i in 0..n {
        for (c, (&v, &m)) in centred
            .iter_mut()
            .zip(x[i * d..(i + 1) * d].iter().zip(&sb.mean))
        {
            *c = v - m;
        }
        for j in 0..sb.d_eff {
            coeffs[i * sb.d_eff + j] = dot(&centred, &sb.basis[j * d..(j + 1) * d]);
        }
    }
    coeffs
}

/// `x_i = mean + B^T c_i`, written into `out` (n x d).
fn unproject(
    coeffs: &[f32],
    n: usize,
    d: usize,
    mean: &[f32],
    basis: &[f32],
    d_eff: usize,
    out: &mut [f32],
) {
    for i in 0..n {
        let row = &mut out[i * d..(i + 1) * d];
        row.copy_from_slice(mean);
        for j in 0..d_eff {
            let c = coeffs[i * d_eff + j];
            if c != 0.0 {
                for (o, &b) in row.iter_mut().zip(&basis[j * d..(j + 1) * d]) {
                    *o += c * b;
                }
            }
        }
    }
}

/// Skeleton fit + removal: returns (centres, labels, t) and turns `coeffs` into residuals.
fn apply_skeleton(
    coeffs: &mut [f32],
    n: usize,
    d_eff: usize,
    w: &[f64],
    p: &CodecParams,
    block_seed: u64,
) -> Result<(kmeans::Skeleton, Vec<u16>, Vec<f16>)> {
    let mut sk = kmeans::fit(coeffs, n, d_eff, p.k, p.kmeans_iters, w, block_seed);
    round_all(&mut sk.centres, p.skeleton_dtype);
    if sk.k_used == 0 {
        return Ok((sk, Vec::new(), Vec::new()));
    }
    let mut labels = Vec::with_capacity(n);
    let mut ts = Vec::with_capacity(n);
    for i in 0..n {
        let c = &mut coeffs[i * d_eff..(i + 1) * d_eff];
        let a = kmeans::assign(c, &sk.centres, d_eff);
        let mu = &sk.centres[a * d_eff..(a + 1) * d_eff];
        // Centres were rounded, so |mu| is 1 only approximately: project exactly.
        let t = f16::from_f32(
            (dot(c, mu) / dot(mu, mu).max(f32::MIN_POSITIVE)).clamp(-F16_LIMIT, F16_LIMIT),
        );
        let tf = t.to_f32();
        for (v, &m) in c.iter_mut().zip(mu) {
            *v -= tf * m;
        }
        labels.push(a as u16);
        ts.push(t);
    }
    Ok((sk, labels, ts))
}

/// Encodes one block of `n` vectors; `shared` replaces the per-block PCA when given.
pub fn encode_block(
    x: &[f32],
    n: usize,
    d: usize,
    weights: Option<&[f32]>,
    p: &CodecParams,
    shared: Option<&SharedBasis>,
    block_index: usize,
) -> Result<EncodedBlock> {
    check_input(x, n, d)?;
    let w = normalised_weights(n, weights)?;
    let own;
    let sb = match shared {
        Some(s) => s,
        None => {
            own = fit_basis(x, n, d, weights, p)?;
            &own
        }
    };
    let d_eff = sb.d_eff;
    let mut coeffs = project(x, n, d, sb);
    let block_seed = p.seed ^ (block_index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let (sk, labels, t) = if p.k > 0 {
        apply_skeleton(&mut coeffs, n, d_eff, &w, p, block_seed)?
    } else {
        (
            kmeans::Skeleton {
                centres: Vec::new(),
                k_used: 0,
                iters: 0,
            },
            Vec::new(),
            Vec::new(),
        )
    };
    let wl = padded_len(d_eff);
    let rot = Rotation::new(wl, p.seed);
    let cb = codebook(p)?;
    let mut codes = Vec::with_capacity(n * wl);
    let mut scales = Vec::with_capacity(n);
    let mut outl = Vec::new();
    let mut u = vec![0.0f32; wl];
    let mut vhat = vec![0.0f32; wl];
    for i in 0..n {
        u.fill(0.0);
        u[..d_eff].copy_from_slice(&coeffs[i * d_eff..(i + 1) * d_eff]);
        rot.forward(&mut u);
        let norm2 = dot(&u, &u);
        let s0 = (norm2 / wl as f32).sqrt();
        if s0 <= 0.0 || s0.is_nan() {
            let zero = cb.quantize(0.0);
            codes.extend(std::iter::repeat_n(zero, wl));
            scales.push(f16::ZERO);
            continue;
        }
        for (vh, v) in vhat.iter_mut().zip(u.iter_mut()) {
            *v /= s0;
            let q = cb.quantize(*v);
            codes.push(q);
            *vh = cb.level(q);
        }
        let first = outl.len();
        outliers::collect(&u, p.outlier_threshold, (i * wl) as u32, &mut outl);
        for (pos, val) in &outl[first..] {
            vhat[*pos as usize - i * wl] = val.to_f32();
        }
        let uv = dot(&u, &vhat);
        let vv = dot(&vhat, &vhat);
        let s = match p.metric {
            Metric::Mse if vv > 0.0 => s0 * uv / vv,
            Metric::InnerProduct if uv > 0.0 => s0 * dot(&u, &u) / uv,
            _ => s0,
        };
        scales.push(f16::from_f32(s.clamp(-F16_LIMIT, F16_LIMIT)));
    }
    let (mean, basis) = if shared.is_some() {
        (Vec::new(), Vec::new())
    } else {
        (sb.mean.clone(), sb.basis.clone())
    };
    Ok(EncodedBlock {
        n,
        d_eff,
        kmeans_iters: sk.iters as u32,
        mean,
        basis,
        k_used: sk.k_used,
        centres: sk.centres,
        labels,
        t,
        scales,
        codes,
        outliers: outl,
    })
}

/// Decodes one block into `out` (`n x d`).
pub fn decode_block(
    b: &EncodedBlock,
    d: usize,
    p: &CodecParams,
    shared: Option<&SharedBasis>,
    out: &mut [f32],
) -> Result<()> {
    let (mean, basis) = match shared {
        Some(s) => (&s.mean[..], &s.basis[..]),
        None => (&b.mean[..], &b.basis[..]),
    };
    let (n, d_eff) = (b.n, b.d_eff);
    if out.len() != n * d || mean.len() != d || basis.len() != d_eff * d {
        return Err(Error::Format(
            "block sections disagree with the layer shape".into(),
        ));
    }
    let wl = padded_len(d_eff);
    let rot = Rotation::new(wl, p.seed);
    let cb = codebook(p)?;
    let mut coeffs = vec![0.0f32; n * d_eff];
    let mut v = vec![0.0f32; wl];
    let mut next_outlier = 0;
    for i in 0..n {
        let s = b.scales[i].to_f32();
        for (vj, &q) in v.iter_mut().zip(&b.codes[i * wl..(i + 1) * wl]) {
            *vj = cb.level(q);
        }
        while next_outlier < b.outliers.len()
            && (b.outliers[next_outlier].0 as usize) < (i + 1) * wl
        {
            let (pos, val) = b.outliers[next_outlier];
            v[pos as usize - i * wl] = val.to_f32();
            next_outlier += 1;
        }
        v.iter_mut().for_each(|x| *x *= s);
        rot.inverse(&mut v);
        let c = &mut coeffs[i * d_eff..(i + 1) * d_eff];
        c.copy_from_slice(&v[..d_eff]);
        if b.k_used > 0 {
            let a = b.labels[i] as usize;
            let t = b.t[i].to_f32();
            for (cj, &m) in c.iter_mut().zip(&b.centres[a * d_eff..(a + 1) * d_eff]) {
                *cj += t * m;
            }
        }
    }
    unproject(&coeffs, n, d, mean, basis, d_eff, out);
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
    p.validate()?;
    check_input(x, n, d)?;
    if let Some(w) = weights {
        normalised_weights(n, Some(w))?;
    }
    let shared = if p.share_basis {
        Some(fit_basis(x, n, d, weights, p)?)
    } else {
        None
    };
    let bs = p.block_size;
    let blocks: Vec<EncodedBlock> = (0..n.div_ceil(bs))
        .into_par_iter()
        .map(|bi| {
            let lo = bi * bs;
            let hi = (lo + bs).min(n);
            encode_block(
                &x[lo * d..hi * d],
                hi - lo,
                d,
                weights.map(|w| &w[lo..hi]),
                p,
                shared.as_ref(),
                bi,
            )
        })
        .collect::<Result<_>>()?;
    let bytes = write_layer(p, n, d, input_dtype, shared.as_ref(), &blocks);
    Ok(EncodedLayer {
        stats: blocks.iter().map(block_stats).collect(),
        params: p.clone(),
        n_tokens: n,
        head_dim: d,
        input_dtype,
        bytes,
    })
}

/// Decodes a layer into a fresh `n x d` buffer (blocks in parallel).
pub fn decode_layer(enc: &EncodedLayer) -> Result<Vec<f32>> {
    decode_bytes(enc.as_bytes()).map(|(v, _)| v)
}

/// Parses and decodes raw bytes; returns the values and the parsed header.
pub fn decode_bytes(bytes: &[u8]) -> Result<(Vec<f32>, ParsedLayer)> {
    let parsed = read_layer(bytes)?;
    let d = parsed.head_dim;
    let mut out = vec![0.0f32; parsed.n_tokens * d];
    let bs = parsed.params.block_size;
    out.par_chunks_mut(bs * d)
        .zip(parsed.blocks.par_iter())
        .try_for_each(|(chunk, b)| {
            decode_block(b, d, &parsed.params, parsed.shared.as_ref(), chunk)
        })?;
    Ok((out, parsed))
}

/// Relative Frobenius error `|x - x_hat| / |x|` after each stage, to attribute loss.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageErrors {
    /// PCA projection alone (mean + `d_eff` components, rounded side info).
    pub pca: f64,
    /// PCA + skeleton with the residual dropped: what the skeleton alone captures.
    pub skeleton: f64,
    /// Full pipeline with outlier compensation off.
    pub quantised: f64,
    /// Full pipeline (what `encode_layer` produces).
    pub full: f64,
}

fn rel_err(x: &[f32], y: &[f32]) -> f64 {
    let num: f64 = x.iter().zip(y).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let den: f64 = x.iter().map(|&a| (a as f64).powi(2)).sum();
    if den > 0.0 {
        (num / den).sqrt()
    } else {
        num.sqrt()
    }
}

/// Error after each stage of the pipeline for the layer `x`.
pub fn stage_errors(x: &[f32], n: usize, d: usize, p: &CodecParams) -> Result<StageErrors> {
    p.validate()?;
    check_input(x, n, d)?;
    let shared = if p.share_basis {
        Some(fit_basis(x, n, d, None, p)?)
    } else {
        None
    };
    let mut pca_out = vec![0.0f32; n * d];
    let mut skel_out = vec![0.0f32; n * d];
    let bs = p.block_size;
    for bi in 0..n.div_ceil(bs) {
        let (lo, hi) = (bi * bs, ((bi + 1) * bs).min(n));
        let xb = &x[lo * d..hi * d];
        let own;
        let sb = match &shared {
            Some(s) => s,
            None => {
                own = fit_basis(xb, hi - lo, d, None, p)?;
                &own
            }
        };
        let mut coeffs = project(xb, hi - lo, d, sb);
        unproject(
            &coeffs,
            hi - lo,
            d,
            &sb.mean,
            &sb.basis,
            sb.d_eff,
            &mut pca_out[lo * d..hi * d],
        );
        let w = normalised_weights(hi - lo, None)?;
        let block_seed = p.seed ^ (bi as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let skel: Vec<f32> = if p.k > 0 {
            let orig = coeffs.clone();
            apply_skeleton(&mut coeffs, hi - lo, sb.d_eff, &w, p, block_seed)?;
            orig.iter().zip(&coeffs).map(|(o, r)| o - r).collect()
        } else {
            vec![0.0; coeffs.len()]
        };
        unproject(
            &skel,
            hi - lo,
            d,
            &sb.mean,
            &sb.basis,
            sb.d_eff,
            &mut skel_out[lo * d..hi * d],
        );
    }
    let no_outliers = CodecParams {
        outlier_threshold: f32::INFINITY,
        ..p.clone()
    };
    let q = decode_layer(&encode_layer(x, n, d, None, &no_outliers, InputDtype::F32)?)?;
    let full = decode_layer(&encode_layer(x, n, d, None, p, InputDtype::F32)?)?;
    Ok(StageErrors {
        pca: rel_err(x, &pca_out),
        skeleton: rel_err(x, &skel_out),
        quantised: rel_err(x, &q),
        full: rel_err(x, &full),
    })
}

#[cfg(test)]
mod tests;
