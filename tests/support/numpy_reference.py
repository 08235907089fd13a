"""A plain numpy re-implementation of the kakeyaturbo block pipeline (uniform allocation).

**This is a reference for testing and benchmarking, not a product path**, and it is not
shipped in the package: it lives beside the tests so that the Rust codec can be checked
against an independent, readable implementation of the same algorithm
(``tests/unit/test_reference.py``), and ``benches/codec_speed.py`` can use it as a
vectorised-numpy baseline. Use :func:`kakeyaturbo.encode_layer` /
:func:`kakeyaturbo.decode_layer` for real work. The stages that mirror the core's building
blocks (random streams, WHT, PCA, k-means) are in ``reference_stages.py``.

Per block of ``n`` vectors ``x_i`` of length ``D`` (see ``rust/kakeyaturbo/src/pca.rs``,
``kmeans.rs`` and ``uniform.rs``):

1. Weighted exact PCA: ``mu = sum w_i x_i``, ``C = sum w_i (x_i - mu)(x_i - mu)^T``
   (``np.linalg.eigh``). ``d_eff`` is the fewest leading components holding
   ``variance_ratio`` of the trace, capped by ``rank_cap``. Mean and basis are rounded to
   the skeleton dtype *before* use; coefficients ``c_i = B (x_i - mu)``.
2. Skeleton (``k > 0``): spherical k-means on the coefficients, k-means++ seeding with
   distance ``1 - cos^2`` weighted by ``w_i |c_i|^2``, signed assignment
   ``a_i = argmax_j |<c_i, mu_j>|`` and one power step per iteration
   (``mu_j <- normalise(sum_{i in j} w_i <c_i, mu_j> c_i)``). Centres are rounded, then
   ``t_i = f16(<c_i, mu>/|mu|^2)`` and the residual ``r_i = c_i - t_i mu_{a_i}``.
3. Orthonormal randomised WHT ``R = H diag(s) / sqrt(W)``, ``W = next_pow2(d_eff)``:
   ``u_i = R [r_i, 0...]``, ``s0_i = |u_i| / sqrt(W)``, ``v_i = u_i / s0_i``.
4. Gaussian Lloyd-Max codes ``q = Q(v)`` (``kt.gaussian_codebook``, or the calibrated
   ``centroids``); ``|v| > outlier_threshold`` is kept exactly (f16, 6 bytes each). The
   stored f16 scale is refit: MSE ``s0 <v, v_hat> / |v_hat|^2``, inner product
   ``s0 |v|^2 / <v, v_hat>``.

Decoding is ``x_hat = mu + B^T (R^-1 [s v_hat] [:d_eff] + t mu_a)``, computed only from what
the wire format stores. Byte counts follow ``rust/kakeyaturbo/src/format/mod.rs`` exactly.

The random streams (WHT signs, k-means++ draws) use the same SplitMix64 generator and
stream ids as the Rust core, so the rotation is identical; everything else differs only by
floating-point summation order, so distortion agrees statistically, not bit for bit.
``pca_method="none"`` (mean removal only; identity basis, ``d_eff = D``, no basis bytes) is
supported. Not implemented here, and refused with ``NotImplementedError`` rather than
silently coded another way: randomized PCA (``pca_method="randomized"``) and transform
coding by reverse water-filling (``allocation="waterfill"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
from reference_stages import (  # tests/support, beside this module
    GOLDEN,
    MASK64,
    SplitMix64,
    assign,
    f16,
    fit_basis,
    fwht,
    kmeans,
    next_pow2,
    round_skeleton,
    wht_signs,
)

from kakeyaturbo import CodecParams, gaussian_codebook

__all__ = [
    "RefBlock",
    "RefLayer",
    "SplitMix64",
    "block_nbytes",
    "decode_block",
    "decode_layer",
    "encode_block",
    "encode_decode_block",
    "encode_decode_layer",
    "encode_layer",
    "fwht",
    "label_bits",
    "layer_nbytes",
    "wht_signs",
]

# Wire-format constants (rust/kakeyaturbo/src/format/mod.rs).
HEADER_LEN = 80
BLOCK_HEADER_LEN = 20
CRC_LEN = 4
OUTLIER_BYTES = 6
F16_LIMIT = 60_000.0


# --------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------


def label_bits(k_used: int) -> int:
    """Bits per centre label on the wire: 0 for at most one centre."""
    return 0 if k_used <= 1 else (k_used - 1).bit_length()


def _packed(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


def _skeleton_size(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def _codebook(p: CodecParams) -> np.ndarray:
    if p.centroids is not None:
        return np.asarray(p.centroids, dtype=np.float32)
    return gaussian_codebook(p.bit_width)


def _weights(n: int, weights: Any) -> np.ndarray:
    if weights is None:
        return np.full(n, 1.0 / n)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n,) or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError("weights: need n finite values >= 0 with a positive sum")
    return w / w.sum()


def _check(p: CodecParams) -> None:
    if not isinstance(p, CodecParams):
        raise TypeError(f"params: expected CodecParams, got {type(p).__name__}")
    if p.pca_method not in ("exact", "none"):
        raise NotImplementedError(
            f"the numpy reference implements pca_method 'exact' and 'none', not {p.pca_method!r}"
        )
    if p.allocation != "uniform":
        raise NotImplementedError(
            f"the numpy reference implements allocation 'uniform', not {p.allocation!r}"
        )


def _basis_rows(p: CodecParams, d_eff: int) -> int:
    """Basis rows the wire format stores: none for pca_method 'none' (identity)."""
    return 0 if p.pca_method == "none" else d_eff


# --------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------


@dataclass
class RefBlock:
    """Exactly what the wire format stores for one block (codes unpacked)."""

    n: int
    d_eff: int
    mean: Optional[np.ndarray]  # [D], None with a shared basis
    basis: Optional[np.ndarray]  # [d_eff, D], None with a shared basis
    centres: np.ndarray  # [k_used, d_eff]
    labels: np.ndarray  # [n] (empty when k_used == 0)
    t: np.ndarray  # [n] f16 values (empty when k_used == 0)
    scales: np.ndarray  # [n] f16 values
    codes: np.ndarray  # [n, W] level indices
    outlier_pos: np.ndarray  # flat positions into codes, ascending
    outlier_val: np.ndarray  # f16 values of the scaled coordinates
    kmeans_iters: int = 0

    @property
    def k_used(self) -> int:
        return len(self.centres)

    @property
    def n_outliers(self) -> int:
        return len(self.outlier_pos)

    @property
    def stats(self) -> dict:
        """Same keys as ``kt.EncodedLayer.stats`` entries."""
        return {
            "n": self.n,
            "d_eff": self.d_eff,
            "k_used": self.k_used,
            "kmeans_iters": self.kmeans_iters,
            "n_outliers": self.n_outliers,
        }

    def nbytes(self, p: CodecParams, head_dim: int) -> int:
        """Bytes of this block on the wire (block header included)."""
        return block_nbytes(
            p, head_dim, self.n, self.d_eff, self.k_used, self.n_outliers, self.mean is not None
        )


def block_nbytes(
    p: CodecParams,
    head_dim: int,
    n: int,
    d_eff: int,
    k_used: int,
    n_outliers: int,
    own_basis: bool = True,
) -> int:
    """Wire bytes of one block (``format/mod.rs``): header, [mean, basis], centres, packed
    labels, t, scales, packed codes of ``W = next_pow2(d_eff)`` per vector, outliers."""
    _check(p)
    s = _skeleton_size(p.skeleton_dtype)
    size = BLOCK_HEADER_LEN
    if own_basis:
        size += s * head_dim * (1 + _basis_rows(p, d_eff))
    size += s * k_used * d_eff
    lb = label_bits(k_used)
    if lb:
        size += _packed(n, lb)
    if k_used:
        size += 2 * n  # t, f16
    size += 2 * n  # scales, f16
    size += _packed(n * next_pow2(d_eff), p.bit_width)
    return size + OUTLIER_BYTES * n_outliers


def encode_block(
    x: Any,
    params: CodecParams,
    weights: Any = None,
    *,
    block_index: int = 0,
    shared: Optional[tuple[np.ndarray, np.ndarray]] = None,
) -> RefBlock:
    """Encodes ``x`` [n, D] as one block; ``shared`` is a layer's (mean, basis), if any."""
    p = params
    _check(p)
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[0] == 0 or not np.all(np.isfinite(x)):
        raise ValueError("x: expected a non-empty, finite [n, D] array")
    n = x.shape[0]
    w = _weights(n, weights)
    mean, basis = shared if shared is not None else fit_basis(x, w, p)
    d_eff = basis.shape[0]
    coeffs = (x - mean) @ basis.T  # [n, d_eff]

    block_seed = p.seed ^ ((block_index * GOLDEN) & MASK64)
    centres = np.zeros((0, d_eff), np.float32)
    labels = t = np.zeros(0, np.float32)
    iters = 0
    if p.k > 0:
        centres, iters = kmeans(coeffs, w, p.k, p.kmeans_iters, block_seed)
        centres = round_skeleton(centres, p.skeleton_dtype)
        if len(centres):
            labels = assign(coeffs, centres)
            mu = centres[labels]
            mu2 = np.maximum(np.einsum("ij,ij->i", mu, mu), np.finfo(np.float32).tiny)
            t = f16(np.clip(np.einsum("ij,ij->i", coeffs, mu) / mu2, -F16_LIMIT, F16_LIMIT))
            coeffs = coeffs - t[:, None] * mu

    # Rotation and per-vector unit-RMS scaling.
    wl = next_pow2(d_eff)
    signs = wht_signs(wl, p.seed)
    u = np.zeros((n, wl), np.float32)
    u[:, :d_eff] = coeffs
    u = fwht(u * signs) / np.float32(np.sqrt(wl))
    s0 = np.sqrt(np.einsum("ij,ij->i", u, u) / wl)
    live = s0 > 0
    v = np.zeros_like(u)
    v[live] = u[live] / s0[live, None]

    # Lloyd-Max codes (nearest level, ties up) and exact outliers.
    levels = _codebook(p)
    bounds = 0.5 * (levels[1:] + levels[:-1])
    codes = np.searchsorted(bounds, v, side="right").astype(np.uint16)
    vhat = levels[codes]
    thr = p.outlier_threshold
    mask = (np.abs(v) > thr) & live[:, None] if np.isfinite(thr) else np.zeros(v.shape, bool)
    pos = np.flatnonzero(mask)
    val = f16(v.reshape(-1)[pos])
    vhat.reshape(-1)[pos] = val

    # Scale refit given the dequantised vector.
    uv = np.einsum("ij,ij->i", v, vhat)
    vv = np.einsum("ij,ij->i", vhat, vhat)
    if p.metric == "mse":
        ok = vv > 0
        s = np.where(ok, s0 * uv / np.where(ok, vv, 1), s0)
    else:
        ok = uv > 0
        s = np.where(ok, s0 * np.einsum("ij,ij->i", v, v) / np.where(ok, uv, 1), s0)
    s = np.where(live, s, 0.0)
    scales = f16(np.clip(s, -F16_LIMIT, F16_LIMIT))

    own = shared is None
    return RefBlock(
        n=n,
        d_eff=d_eff,
        mean=mean if own else None,
        basis=basis if own else None,
        centres=centres,
        labels=labels,
        t=t,
        scales=scales,
        codes=codes,
        outlier_pos=pos,
        outlier_val=val,
        kmeans_iters=iters,
    )


def decode_block(
    b: RefBlock,
    params: CodecParams,
    shared: Optional[tuple[np.ndarray, np.ndarray]] = None,
) -> np.ndarray:
    """Reconstructs [n, D] float32 from the stored block."""
    mean, basis = shared if shared is not None else (b.mean, b.basis)
    wl = b.codes.shape[1]
    v = _codebook(params)[b.codes]
    v.reshape(-1)[b.outlier_pos] = b.outlier_val
    v *= b.scales[:, None]
    r = (fwht(v) * wht_signs(wl, params.seed) / np.float32(np.sqrt(wl)))[:, : b.d_eff]
    if b.k_used:
        r += b.t[:, None] * b.centres[b.labels]
    return mean + r @ basis


# --------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------


@dataclass
class RefLayer:
    """A layer encoded by the reference: its blocks, the shared basis if any, the shape."""

    params: CodecParams
    shape: tuple[int, int]
    blocks: list = field(default_factory=list)
    shared: Optional[tuple[np.ndarray, np.ndarray]] = None

    @property
    def stats(self) -> list[dict]:
        return [b.stats for b in self.blocks]

    @property
    def nbytes(self) -> int:
        """Size the Rust wire format would have for exactly this content."""
        p, d = self.params, self.shape[1]
        size = HEADER_LEN + CRC_LEN
        if p.centroids is not None:
            size += 4 * len(p.centroids)
        if self.shared is not None:
            rows = _basis_rows(p, self.shared[1].shape[0])
            size += 4 + _skeleton_size(p.skeleton_dtype) * d * (1 + rows)
        return size + sum(b.nbytes(p, d) for b in self.blocks)


def layer_nbytes(stats: list[dict], params: CodecParams, head_dim: int) -> int:
    """Wire size implied by per-block ``stats`` (as ``kt.EncodedLayer.stats``) without a
    shared basis: lets tests check the accounting against the Rust codec's ``nbytes``."""
    if params.share_basis:
        raise ValueError("layer_nbytes: the shared basis size is not in the stats")
    size = HEADER_LEN + CRC_LEN + (4 * len(params.centroids) if params.centroids else 0)
    for st in stats:
        size += block_nbytes(params, head_dim, st["n"], st["d_eff"], st["k_used"], st["n_outliers"])
    return size


def encode_layer(x: Any, params: CodecParams, weights: Any = None) -> RefLayer:
    """Encodes ``x`` [tokens, D] block by block (``params.block_size`` vectors each)."""
    _check(params)
    x = np.asarray(x, dtype=np.float32)
    n, d = x.shape
    shared = None
    if params.share_basis:
        shared = fit_basis(x, _weights(n, weights), params)
    bs = params.block_size
    blocks = []
    for bi, lo in enumerate(range(0, n, bs)):
        wb = None if weights is None else np.asarray(weights)[lo : lo + bs]
        blocks.append(encode_block(x[lo : lo + bs], params, wb, block_index=bi, shared=shared))
    return RefLayer(params=params, shape=(n, d), blocks=blocks, shared=shared)


def decode_layer(enc: RefLayer) -> np.ndarray:
    """Decodes a :class:`RefLayer` to [tokens, D] float32."""
    if not enc.blocks:
        return np.zeros(enc.shape, np.float32)
    return np.concatenate([decode_block(b, enc.params, enc.shared) for b in enc.blocks])


def encode_decode_block(x: Any, params: CodecParams, weights: Any = None) -> tuple[np.ndarray, int]:
    """Round trip of one block; ``nbytes`` equals ``kt.encode_block(x, params).nbytes`` for
    the same content (a one-block layer: header, block and checksum)."""
    n = np.shape(x)[0]
    if n > params.block_size:
        raise ValueError(f"x: {n} vectors exceed block_size={params.block_size}")
    enc = encode_layer(x, params, weights)
    return decode_layer(enc), enc.nbytes


def encode_decode_layer(x: Any, params: CodecParams, weights: Any = None) -> tuple[np.ndarray, int]:
    """Round trip of a layer; returns (x_hat float32, bytes the wire format would take)."""
    enc = encode_layer(x, params, weights)
    return decode_layer(enc), enc.nbytes
