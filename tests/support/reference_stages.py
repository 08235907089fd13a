"""The numpy reference's stages that mirror the Rust core's own building blocks: its random
streams (SplitMix64 with the same seeding and stream ids, so the rotation's signs are the same),
the Walsh-Hadamard transform, rounding to the skeleton dtype, the weighted exact PCA and the
spherical k-means skeleton. ``numpy_reference.py`` codes blocks with them."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from kakeyaturbo import CodecParams

__all__ = [
    "GOLDEN",
    "MASK64",
    "SplitMix64",
    "assign",
    "f16",
    "fit_basis",
    "fwht",
    "kmeans",
    "next_pow2",
    "round_skeleton",
    "wht_signs",
]

# Random streams (bit-compatible with rust/kakeyaturbo/src/rng.rs).
MASK64 = (1 << 64) - 1
GOLDEN = 0x9E37_79B9_7F4A_7C15
_SIGN_STREAM = 0x5748_5400  # "WHT"
_KMEANS_STREAM = 0x4B4D_4541  # "KMEA"


class SplitMix64:
    """SplitMix64 with the Rust core's seeding: ``state = seed ^ stream * C``, one warm-up."""

    def __init__(self, seed: int, stream: int):
        self.state = (seed ^ (stream * 0xD1B5_4A32_D192_ED03)) & MASK64
        self.next_u64()

    def next_u64(self) -> int:
        self.state = (self.state + GOLDEN) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & MASK64
        return z ^ (z >> 31)

    def next_f64(self) -> float:
        return (self.next_u64() >> 11) * (1.0 / (1 << 53))


def wht_signs(n: int, seed: int) -> np.ndarray:
    """The ±1 sign vector of the length-``n`` rotation for ``seed`` (as the Rust core)."""
    g = SplitMix64(seed, _SIGN_STREAM ^ n)
    return np.array([1.0 if g.next_u64() >> 63 == 0 else -1.0 for _ in range(n)], np.float32)


def next_pow2(d: int) -> int:
    return 1 << (max(d, 1) - 1).bit_length()


def f16(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).astype(np.float16).astype(np.float32)


def _bf16(a: Any) -> np.ndarray:
    """Round-to-nearest-even to bfloat16 (inputs are finite), returned as float32."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return u.view(np.float32)


def round_skeleton(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "fp16":
        return f16(a)
    if dtype == "bf16":
        return _bf16(a)
    return np.asarray(a, dtype=np.float32)


def fwht(x: np.ndarray) -> np.ndarray:
    """Unnormalised Walsh-Hadamard transform ``H x`` along the last axis (a power of two),
    vectorised over the leading axes; returns a new array."""
    x = np.array(x, dtype=np.float32, copy=True)
    lead, n = x.shape[:-1], x.shape[-1]
    m = int(np.prod(lead, dtype=np.int64))
    h = 1
    while h < n:
        y = x.reshape(m, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        x = np.stack((a + b, a - b), axis=2)
        h *= 2
    return x.reshape(*lead, n)


def fit_basis(x: np.ndarray, w: np.ndarray, p: CodecParams) -> tuple[np.ndarray, np.ndarray]:
    """Weighted exact PCA -> (mean [D], basis [d_eff, D]), both rounded to the skeleton dtype.
    With pca_method 'none' the basis is the identity (not stored on the wire)."""
    d = x.shape[1]
    x64 = x.astype(np.float64)
    mu = w @ x64
    if p.pca_method == "none":
        return round_skeleton(mu, p.skeleton_dtype), np.eye(d, dtype=np.float32)
    a = np.sqrt(w)[:, None] * (x64 - mu)
    evals, evecs = np.linalg.eigh(a.T @ a)
    order = np.argsort(-evals, kind="stable")
    evals = np.maximum(evals[order], 0.0)
    max_rank = max(1, min(d, p.rank_cap or d))
    total = evals.sum()
    if total <= 0:
        d_eff = 1
    else:
        # Same tolerance as pca::choose_rank: ratio 1.0 stops at numerical full rank.
        target = max(float(np.float32(p.variance_ratio)) - 1e-7, 0.0) * total
        reached = np.nonzero(np.cumsum(evals[:max_rank]) >= target)[0]
        d_eff = int(reached[0]) + 1 if reached.size else max_rank
    basis = evecs[:, order[:d_eff]].T
    return round_skeleton(mu, p.skeleton_dtype), round_skeleton(basis, p.skeleton_dtype)


def _pick(weights: np.ndarray, g: SplitMix64) -> Optional[int]:
    """Index drawn with probability proportional to ``weights`` (None if all zero)."""
    total = weights.sum()
    if not total > 0:
        return None
    i = int(np.searchsorted(np.cumsum(weights), g.next_f64() * total, side="right"))
    return i if i < len(weights) else int(np.nonzero(weights > 0)[0][-1])


def assign(c: np.ndarray, centres: np.ndarray) -> np.ndarray:
    """Signed assignment: argmax_j |<c_i, mu_j>| (first on ties)."""
    return np.argmax(np.abs(c @ centres.T), axis=1)


def kmeans(c: np.ndarray, w: np.ndarray, k: int, max_iters: int, seed: int):
    """Spherical k-means skeleton -> (centres [k_used, d] unit rows, iterations run)."""
    d = c.shape[1]
    sq = np.einsum("ij,ij->i", c, c)
    dirs = np.nonzero(sq > 0)[0]
    k = min(k, dirs.size)
    if k == 0:
        return np.zeros((0, d), np.float32), 0
    cd, wd = c[dirs], w[dirs]
    unit = cd / np.sqrt(sq[dirs])[:, None]
    energy = wd * sq[dirs].astype(np.float64)

    # k-means++ on the sphere, distance 1 - cos^2, weighted by energy.
    g = SplitMix64(seed, _KMEANS_STREAM)
    first = _pick(energy, g)
    chosen = [unit[0 if first is None else first]]
    dist = 1.0 - (unit @ chosen[0]).astype(np.float64) ** 2
    while len(chosen) < k:
        nxt = _pick(np.maximum(dist, 0.0) * energy, g)
        if nxt is None:
            break
        chosen.append(unit[nxt])
        dist = np.minimum(dist, 1.0 - (unit @ chosen[-1]).astype(np.float64) ** 2)
    centres = np.array(chosen, dtype=np.float32)
    k_used = len(centres)

    labels = np.full(dirs.size, -1)
    iters = 0
    for _ in range(max_iters):
        iters += 1
        new = assign(cd, centres)
        if np.array_equal(new, labels):
            break
        labels = new
        # One power step per centre on its cluster's weighted scatter matrix.
        proj = wd.astype(np.float32) * np.einsum("ij,ij->i", cd, centres[labels])
        onehot = np.zeros((dirs.size, k_used), np.float32)
        onehot[np.arange(dirs.size), labels] = proj
        acc = onehot.T @ cd
        norm = np.linalg.norm(acc, axis=1)
        ok = (norm > 0) & np.isfinite(norm)
        centres[ok] = acc[ok] / norm[ok, None]
    return centres, iters
