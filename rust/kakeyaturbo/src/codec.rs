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
//! With `Allocation::Waterfill` steps 2-4 are replaced by transform coding of the PCA
//! coefficients (see [`crate::waterfill`]): per-block component scales and bit counts,
//! then `b_j`-bit Lloyd-Max codes per component. A basis may also come from outside
//! ([`ExternalBasis`], e.g. calibrated once per model): it is not stored, only its
//! fingerprint, and decoding requires the same basis.
//!
//! Decoding reverses it: `x_hat = mean + B^T (R^-1 [s v_hat] + t mu)`, truncated to
//! `d_eff` after the inverse rotation. Blocks are independent and run in parallel.

use half::{bf16, f16};
use nalgebra::{DMatrix, DMatrixView, DMatrixViewMut};
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::format::{read_layer, write_layer, ParsedLayer};
use crate::kmeans;
use crate::lloyd_max::{self, Codebook};
use crate::outliers;
use crate::params::{Allocation, CodecParams, InputDtype, Metric, PcaMethod, SkeletonDtype};
use crate::pca::{self, normalised_weights, PcaFit};
use crate::rsvd;
use crate::waterfill;
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
    /// Waterfill only: per-component scale (empty for uniform allocation).
    pub sigma: Vec<f16>,
    /// Waterfill only: bits per component, 0..=8 (empty for uniform allocation).
    pub comp_bits: Vec<u8>,
}

/// A basis supplied by the caller (e.g. calibrated once per model and head): `d_eff`
/// orthonormal rows of length `head_dim`. Encodings store only its fingerprint.
#[derive(Debug, Clone, PartialEq)]
pub struct ExternalBasis {
    d_eff: usize,
    head_dim: usize,
    rows: Vec<f32>,
    fingerprint: u64,
}

impl ExternalBasis {
    /// Validates shape, finiteness and orthonormality (`|B B^T - I|_max <= 1e-3`).
    pub fn new(rows: Vec<f32>, d_eff: usize, head_dim: usize) -> Result<Self> {
        if d_eff == 0 || head_dim == 0 || d_eff > head_dim || head_dim > crate::params::MAX_HEAD_DIM
        {
            return Err(Error::Shape(format!(
                "basis must be [d_eff, head_dim] with 1 <= d_eff <= head_dim <= {}, got [{d_eff}, {head_dim}]",
                crate::params::MAX_HEAD_DIM
            )));
        }
        if rows.len() != d_eff * head_dim {
            return Err(Error::Shape(format!(
                "basis holds {} values, expected {d_eff} x {head_dim}",
                rows.len()
            )));
        }
        if let Some(i) = rows.iter().position(|v| !v.is_finite()) {
            return Err(Error::NonFinite { index: i });
        }
        for a in 0..d_eff {
            for b in a..d_eff {
                let g = dot(
                    &rows[a * head_dim..(a + 1) * head_dim],
                    &rows[b * head_dim..(b + 1) * head_dim],
                );
                let want = if a == b { 1.0 } else { 0.0 };
                if (g - want).abs() > 1e-3 {
                    return Err(Error::InvalidParams(format!(
                        "basis rows must be orthonormal: <row {a}, row {b}> = {g}"
                    )));
                }
            }
        }
        // FNV-1a over the shape and the exact bits: a mismatch is caught at decode.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |bytes: &[u8]| {
            for &byte in bytes {
                h ^= byte as u64;
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        };
        eat(&(d_eff as u64).to_le_bytes());
        eat(&(head_dim as u64).to_le_bytes());
        for v in &rows {
            eat(&v.to_le_bytes());
        }
        Ok(ExternalBasis {
            d_eff,
            head_dim,
            rows,
            fingerprint: h,
        })
    }
    /// Number of rows.
    pub fn d_eff(&self) -> usize {
        self.d_eff
    }
    /// Row length.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// The rows, row-major.
    pub fn rows(&self) -> &[f32] {
        &self.rows
    }
    /// 64-bit fingerprint stored in encodings that use this basis.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
}

/// Where a block's basis comes from.
#[derive(Debug, Clone, Copy)]
pub enum BasisRef<'a> {
    /// Fitted on the block and stored with it.
    PerBlock,
    /// Fitted once on the layer and stored once (`share_basis`).
    Shared(&'a SharedBasis),
    /// Supplied by the caller; only the block mean is stored.
    External(&'a ExternalBasis),
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
    external: Option<u64>,
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
            external: p.external.map(|(_, fp)| fp),
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
    /// Fingerprint of the external basis this layer needs to decode, if any.
    pub fn external_fingerprint(&self) -> Option<u64> {
        self.external
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
        PcaMethod::None => {
            let w = normalised_weights(n, w)?;
            let mut mean: Vec<f32> = pca::weighted_mean(x, n, d, &w)
                .iter()
                .map(|&m| m as f32)
                .collect();
            round_all(&mut mean, p.skeleton_dtype);
            return Ok(SharedBasis {
                d_eff: d,
                mean,
                basis: Vec::new(),
            });
        }
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

/// `n x d_eff` coefficients `B (x_i - mean)` (an empty basis is the identity).
fn project(x: &[f32], n: usize, d: usize, sb: &SharedBasis) -> Vec<f32> {
    let centred: Vec<f32> = x
        .chunks_exact(d)
        .flat_map(|row| row.iter().zip(&sb.mean).map(|(v, m)| v - m))
        .collect();
    if sb.basis.is_empty() {
        return centred;
    }
    // Row-major buffers read column-major are transposes: C^T (d_eff x n) = B (d_eff x d)
    // X_c^T (d x n). B must be column-major for that, so transpose it once (small).
    let d_eff = sb.d_eff;
    let b_cm = DMatrix::from_row_slice(d_eff, d, &sb.basis);
    let xt = DMatrixView::from_slice(&centred, d, n);
    let ct = b_cm * xt;
    debug_assert_eq!(ct.nrows(), d_eff);
    ct.data.into()
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
    if basis.is_empty() {
        // Identity basis (pca_method 'none'): d_eff == d.
        for (row, c) in out.chunks_exact_mut(d).zip(coeffs.chunks_exact(d_eff)) {
            for ((o, &m), &v) in row.iter_mut().zip(mean).zip(c) {
                *o = m + v;
            }
        }
        return;
    }
    // X_hat^T (d x n) = B^T (d x d_eff, the row-major basis read column-major) C^T.
    let bt = DMatrixView::from_slice(basis, d, d_eff);
    let ct = DMatrixView::from_slice(coeffs, d_eff, n);
    let mut xt = DMatrixViewMut::from_slice(out, d, n);
    xt.gemm(1.0, &bt, &ct, 0.0);
    for row in out.chunks_exact_mut(d) {
        for (o, &m) in row.iter_mut().zip(mean) {
            *o += m;
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
    let assigned = kmeans::assign_all(coeffs, n, d_eff, &sk.centres, sk.k_used);
    for i in 0..n {
        let c = &mut coeffs[i * d_eff..(i + 1) * d_eff];
        let a = assigned[i];
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

/// Weighted block mean rounded to the skeleton dtype (for external bases).
fn block_mean(x: &[f32], n: usize, d: usize, w: &[f64], p: &CodecParams) -> Vec<f32> {
    let mut mean: Vec<f32> = pca::weighted_mean(x, n, d, w)
        .iter()
        .map(|&m| m as f32)
        .collect();
    round_all(&mut mean, p.skeleton_dtype);
    mean
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
    // A block whose tokens all have weight zero (e.g. padding) is coded unweighted: the
    // layer's weights were checked as a whole, and zero everywhere says nothing.
    let weights = weights.filter(|w| w.iter().any(|&v| v != 0.0));
    let w = normalised_weights(n, weights)?;
    let own;
    let sb = match basis {
        BasisRef::Shared(s) => s,
        BasisRef::PerBlock => {
            own = fit_basis(x, n, d, weights, p)?;
            &own
        }
        BasisRef::External(e) => {
            own = SharedBasis {
                d_eff: e.d_eff,
                mean: block_mean(x, n, d, &w, p),
                basis: e.rows.clone(),
            };
            &own
        }
    };
    let coeffs = project(x, n, d, sb);
    let mut block = match p.allocation {
        Allocation::Uniform => encode_uniform(coeffs, n, sb.d_eff, &w, p, block_index)?,
        Allocation::Waterfill => encode_waterfill(&coeffs, n, sb.d_eff, d, &w, p),
    };
    match basis {
        BasisRef::PerBlock => {
            block.mean = sb.mean.clone();
            block.basis = sb.basis.clone();
        }
        BasisRef::External(_) => block.mean = sb.mean.clone(),
        BasisRef::Shared(_) => {}
    }
    Ok(block)
}

/// Skeleton + rotation + `bit_width` Lloyd-Max codes per coordinate.
fn encode_uniform(
    mut coeffs: Vec<f32>,
    n: usize,
    d_eff: usize,
    w: &[f64],
    p: &CodecParams,
    block_index: usize,
) -> Result<EncodedBlock> {
    let block_seed = p.seed ^ (block_index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let (sk, labels, t) = if p.k > 0 {
        apply_skeleton(&mut coeffs, n, d_eff, w, p, block_seed)?
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
    Ok(EncodedBlock {
        n,
        d_eff,
        kmeans_iters: sk.iters as u32,
        mean: Vec::new(),
        basis: Vec::new(),
        k_used: sk.k_used,
        centres: sk.centres,
        labels,
        t,
        scales,
        codes,
        outliers: outl,
        sigma: Vec::new(),
        comp_bits: Vec::new(),
    })
}

/// Transform coding: per-component scales, water-filled bits, per-component codes.
fn encode_waterfill(
    coeffs: &[f32],
    n: usize,
    d_eff: usize,
    d: usize,
    w: &[f64],
    p: &CodecParams,
) -> EncodedBlock {
    let mut var = vec![0.0f64; d_eff];
    for (i, row) in coeffs.chunks_exact(d_eff).enumerate() {
        for (v, &c) in var.iter_mut().zip(row) {
            *v += w[i] * (c as f64) * (c as f64);
        }
    }
    let sigma: Vec<f16> = var
        .iter()
        .map(|&v| f16::from_f64(v.sqrt().min(F16_LIMIT as f64)))
        .collect();
    let sig: Vec<f32> = sigma.iter().map(|s| s.to_f32()).collect();
    let budget = (p.bits_per_value as f64 * d as f64).round() as usize;
    let comp_bits = waterfill::allocate(&sig.iter().map(|s| s * s).collect::<Vec<_>>(), budget);
    let books: Vec<Option<&Codebook>> = comp_bits
        .iter()
        .map(|&b| (b > 0).then(|| lloyd_max::gaussian(b).expect("1..=8 bits")))
        .collect();
    let coded = comp_bits.iter().filter(|&&b| b > 0).count();
    let mut codes = Vec::with_capacity(n * coded);
    let mut outl = Vec::new();
    let mut z = vec![0.0f32; d_eff];
    for i in 0..n {
        for j in 0..d_eff {
            // Bounded so that outliers stay finite in f16 (tokens of weight zero do not
            // shape sigma and may sit far outside it).
            z[j] = if sig[j] > 0.0 {
                (coeffs[i * d_eff + j] / sig[j]).clamp(-F16_LIMIT, F16_LIMIT)
            } else {
                0.0
            };
            if let Some(cb) = books[j] {
                codes.push(cb.quantize(z[j]));
            }
        }
        outliers::collect(&z, p.outlier_threshold, (i * d_eff) as u32, &mut outl);
    }
    EncodedBlock {
        n,
        d_eff,
        kmeans_iters: 0,
        mean: Vec::new(),
        basis: Vec::new(),
        k_used: 0,
        centres: Vec::new(),
        labels: Vec::new(),
        t: Vec::new(),
        scales: Vec::new(),
        codes,
        outliers: outl,
        sigma,
        comp_bits,
    }
}

/// Decodes one block into `out` (`n x d`) given its mean and basis rows (empty: identity).
pub fn decode_block(
    b: &EncodedBlock,
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
    let coeffs = match p.allocation {
        Allocation::Uniform => decode_uniform(b, p)?,
        Allocation::Waterfill => decode_waterfill(b, p),
    };
    unproject(&coeffs, n, d, mean, basis, d_eff, out);
    Ok(())
}

fn decode_uniform(b: &EncodedBlock, p: &CodecParams) -> Result<Vec<f32>> {
    let (n, d_eff) = (b.n, b.d_eff);
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
    Ok(coeffs)
}

fn decode_waterfill(b: &EncodedBlock, p: &CodecParams) -> Vec<f32> {
    let (n, d_eff) = (b.n, b.d_eff);
    let sig: Vec<f32> = b.sigma.iter().map(|s| s.to_f32()).collect();
    // Level tables pre-multiplied by sigma (and the inner-product gain).
    let tables: Vec<Vec<f32>> = b
        .comp_bits
        .iter()
        .zip(&sig)
        .map(|(&bits, &s)| {
            if bits == 0 {
                return Vec::new();
            }
            let g = if p.metric == Metric::InnerProduct {
                waterfill::ip_gain(bits)
            } else {
                1.0
            };
            let cb = lloyd_max::gaussian(bits).expect("1..=8 bits");
            cb.levels().iter().map(|&l| l * s * g).collect()
        })
        .collect();
    let mut coeffs = vec![0.0f32; n * d_eff];
    let mut k = 0;
    for row in coeffs.chunks_exact_mut(d_eff) {
        for (c, t) in row.iter_mut().zip(&tables) {
            if !t.is_empty() {
                *c = t[b.codes[k] as usize];
                k += 1;
            }
        }
    }
    for &(pos, val) in &b.outliers {
        let j = pos as usize % d_eff;
        coeffs[pos as usize] = val.to_f32() * sig[j];
    }
    coeffs
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
        if e.head_dim != d {
            return Err(Error::Shape(format!(
                "basis rows have length {}, vectors have {d}",
                e.head_dim
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
                basis,
                bi,
            )
        })
        .collect::<Result<_>>()?;
    let ext = external.map(|e| (e.d_eff, e.fingerprint));
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
    decode_bytes(enc.as_bytes(), None).map(|(v, _)| v)
}

/// [`decode_layer`] for layers that may need an external basis.
pub fn decode_layer_with(enc: &EncodedLayer, external: Option<&ExternalBasis>) -> Result<Vec<f32>> {
    decode_bytes(enc.as_bytes(), external).map(|(v, _)| v)
}

/// Parses and decodes raw bytes; returns the values and the parsed header.
pub fn decode_bytes(
    bytes: &[u8],
    external: Option<&ExternalBasis>,
) -> Result<(Vec<f32>, ParsedLayer)> {
    let parsed = read_layer(bytes)?;
    let d = parsed.head_dim;
    // (The reader bounds every stored value so that decoding stays finite; the check after
    // decoding below is the belt to those braces.)
    let ext_rows: Option<&[f32]> = match (parsed.external, external) {
        (None, None) => None,
        (Some((d_eff, fp)), Some(e)) if e.fingerprint == fp && e.d_eff == d_eff && e.head_dim == d => {
            Some(&e.rows)
        }
        (Some((_, fp)), Some(e)) => {
            return Err(Error::InvalidParams(format!(
                "basis mismatch: the layer was encoded with basis {fp:#018x}, got {:#018x}",
                e.fingerprint
            )))
        }
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
    let mut out = vec![0.0f32; parsed.n_tokens * d];
    let bs = parsed.params.block_size;
    out.par_chunks_mut(bs * d)
        .zip(parsed.blocks.par_iter())
        .try_for_each(|(chunk, b)| {
            let (mean, basis): (&[f32], &[f32]) = match (&parsed.shared, ext_rows) {
                (Some(s), _) => (&s.mean, &s.basis),
                (None, Some(rows)) => (&b.mean, rows),
                (None, None) => (&b.mean, &b.basis),
            };
            decode_block(b, d, &parsed.params, mean, basis, chunk)
        })?;
    if out.iter().any(|v| !v.is_finite()) {
        return Err(Error::Format("decoded values are not finite".into()));
    }
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
