"""Peer KV codecs, reimplemented so they run in the same harness and are counted the same way.

Every codec here is a reimplementation from the papers' descriptions, not the authors' code
(the `hf-*` methods, which run transformers' own `QuantizedCache` as it ships, are in
`hf_baselines`). They exist to put kakeyaturbo's numbers next to well-known alternatives under
one protocol.

Byte accounting, identical for every method (one passage's prefix, per layer and stream):

- codes are bit-packed densely: ceil(elements * bits / 8) bytes;
- side information (scales, zero-points, vector norms) is fp16, 2 bytes per value, except the
  fp8 scales, which are fp32 as vLLM stores them;
- anything derived from a fixed seed or from (head_dim, bits) alone - random rotations, QJL
  projections, Lloyd-Max codebooks - is part of the method, like code, and is not counted;
- full-precision parts (sinks, windows, skipped layers) are bf16, 2 bytes per element.

Side values are rounded to their stored dtype before they are used, so what is decoded is
exactly what the counted bytes could hold.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from kakeyaturbo.eval.methods import Method, nominal_bytes, register, stream_params

__all__ = [
    "Bf16",
    "Fp8",
    "Identity",
    "Kivi",
    "TurboQuant",
    "Zero",
    "lloyd_max_sphere",
    "minmax_quantize",
]

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


def _check_keys(params: dict[str, Any], allowed: set[str], name: str) -> None:
    for key in params:
        base = key[2:] if key[:2] in ("k_", "v_") and len(key) > 2 else key
        if base not in allowed:
            raise ValueError(
                f"{name}: unknown parameter {key!r} (known: {', '.join(sorted(allowed))})"
            )


def _rows(x: torch.Tensor) -> int:
    return x.shape[0]


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


# --------------------------------------------------------------------------------------------
# identity, bf16, zero


class _Fixed(Method):
    """A method with no parameters of its own and a fixed number of bits (None: no such knob)."""

    fixed_bits: int | None = None

    def __init__(self, params: dict[str, Any]):
        _check_keys(params, set(), self.name)
        super().__init__(params)

    @property
    def bits(self):
        return self.fixed_bits


@register("identity", "no-op: the cache as computed (bytes at the model's dtype); for checks")
class Identity(_Fixed):
    name = "identity"

    def compress(self, x, layer, stream):
        per_row = x[0].numel() * x.element_size()
        return x, [{"full_precision": per_row} for _ in range(_rows(x))]


@register("bf16", "bf16 storage: the baseline every ratio is measured against")
class Bf16(_Fixed):
    name = "bf16"
    fixed_bits = 16

    def compress(self, x, layer, stream):
        return bf16_round(x), [{"full_precision": x[0].numel() * 2} for _ in range(_rows(x))]


@register("zero", "drops the stream: stores nothing, decodes zeros (a lower bound; use streams=)")
class Zero(_Fixed):
    name = "zero"
    fixed_bits = 0

    def compress(self, x, layer, stream):
        return torch.zeros_like(x), [{"codes": 0} for _ in range(_rows(x))]


# --------------------------------------------------------------------------------------------
# fp8


@register(
    "fp8", "fp8 e4m3 with an fp32 scale per head (granularity=head|tensor), as vLLM stores it"
)
class Fp8(Method):
    """fp8 e4m3: x / scale rounded to e4m3 (saturating), scale = amax / 448 over the head's tokens.

    vLLM keeps fp8 caches with fp32 scales, per tensor by default and per attention head with an
    `attn_head` scheme; here the scale is measured on the prefix itself (dynamic), which is the
    best case for a calibrated static scale.
    """

    name = "fp8"

    def __init__(self, params: dict[str, Any]):
        _check_keys(params, {"granularity"}, self.name)
        super().__init__(params)
        self.granularity = {
            s: stream_params(params, s).get("granularity", "head") for s in ("k", "v")
        }
        for g in self.granularity.values():
            if g not in ("head", "tensor"):
                raise ValueError(f"fp8: granularity must be head or tensor, not {g!r}")

    @property
    def bits(self):
        return 8

    def resolved_params(self):
        return {"granularity_k": self.granularity["k"], "granularity_v": self.granularity["v"]}

    def compress(self, x, layer, stream):
        b, h, t, d = x.shape
        per_head = self.granularity[stream] == "head"
        dims = (2, 3) if per_head else (1, 2, 3)
        amax = x.abs().amax(dim=dims, keepdim=True).float()
        scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        x_hat = (q.float() * scale).to(x.dtype)
        n_scales = h if per_head else 1
        return x_hat, [{"codes": h * t * d, "scales": 4 * n_scales} for _ in range(b)]


# --------------------------------------------------------------------------------------------
# KIVI


def minmax_quantize(x: torch.Tensor, bits: int, group: int, dim: int) -> tuple[torch.Tensor, int]:
    """Asymmetric min/max quantization in groups of `group` along `dim`; returns (x_hat, groups).

    Each group stores a scale and a zero-point (its minimum), both rounded to fp16, and
    `bits`-bit codes q = clamp(round((x - zero) / scale), 0, 2^bits - 1); x_hat = q * scale + zero.
    A last, shorter group takes what is left. `groups` counts the groups of one batch row.
    """
    dim = dim % x.dim()
    n = x.shape[dim]
    n_groups = math.ceil(n / group)
    pad = n_groups * group - n
    xf = x.float()
    if pad:
        # repeating the last element leaves each group's min and max unchanged
        last = xf.narrow(dim, n - 1, 1)
        xf = torch.cat(
            [xf, last.expand(*[pad if i == dim else s for i, s in enumerate(xf.shape)])], dim=dim
        )
    shape = list(xf.shape)
    g = xf.reshape(shape[:dim] + [n_groups, group] + shape[dim + 1 :])
    gdim = dim + 1
    lo = g.amin(dim=gdim, keepdim=True).half().float()
    hi = g.amax(dim=gdim, keepdim=True)
    levels = 2**bits - 1
    scale = ((hi - lo) / levels).half().float()
    # A constant group (or one whose range underflows fp16) decodes to its zero-point.
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round((g - lo) / safe), 0, levels)
    g_hat = torch.where(scale > 0, q * scale + lo, lo.expand_as(g))
    x_hat = g_hat.reshape(shape).narrow(dim, 0, n)
    groups_per_row = x[0].numel() // n * n_groups
    return x_hat.to(x.dtype), groups_per_row


@register("kivi", "KIVI-style: keys per-channel, values per-token, min/max groups (bits=, group=)")
class Kivi(Method):
    """KIVI (Liu et al., 2024), reimplemented: asymmetric integer quantization with keys grouped
    per channel along tokens and values grouped per token along channels, `group` elements per
    group, fp16 scale and zero-point per group. KIVI's full-precision residual window is the
    shared `window=` option (0 by default, so every prefix token is quantized).
    """

    name = "kivi"

    def __init__(self, params: dict[str, Any]):
        _check_keys(params, {"bits", "group"}, self.name)
        super().__init__(params)
        self.cfg = {}
        for s in ("k", "v"):
            p = stream_params(params, s)
            bits, group = int(p.get("bits", 2)), int(p.get("group", 32))
            if not 1 <= bits <= 8 or group < 1:
                raise ValueError("kivi: need 1 <= bits <= 8 and group >= 1")
            self.cfg[s] = (bits, group)

    @property
    def bits(self):
        return (self.cfg["k"][0] + self.cfg["v"][0]) / 2

    def resolved_params(self):
        return {f"{s}_{n}": v for s in ("k", "v") for n, v in zip(("bits", "group"), self.cfg[s])}

    def block_tokens(self, stream):
        return self.cfg["k"][1] if stream == "k" else 1

    def compress(self, x, layer, stream):
        bits, group = self.cfg[stream]
        # keys: per channel, groups along tokens (dim 2); values: per token, along channels (dim 3)
        x_hat, groups = minmax_quantize(x, bits, group, dim=2 if stream == "k" else 3)
        row = {"codes": nominal_bytes(x[0].numel(), bits), "scales": 4 * groups}
        return x_hat, [dict(row) for _ in range(_rows(x))]


# --------------------------------------------------------------------------------------------
# TurboQuant


@lru_cache(maxsize=64)
def lloyd_max_sphere(dim: int, bits: int, grid: int = 200_001, iters: int = 300) -> np.ndarray:
    """Lloyd-Max centroids (ascending, 2^bits) for one coordinate of a uniform point on S^{dim-1}.

    That coordinate has density proportional to (1 - t^2)^((dim - 3) / 2) on [-1, 1]; the
    quantizer minimising its mean squared error is found by Lloyd's iterations on a fine grid.
    """
    t = np.linspace(-1.0, 1.0, grid)
    w = np.clip(1.0 - t * t, 0.0, None) ** ((dim - 3) / 2.0)
    w /= w.sum()
    cw, cwt = np.concatenate([[0.0], np.cumsum(w)]), np.concatenate([[0.0], np.cumsum(w * t)])
    n = 2**bits
    # start from equal-mass cells
    edges = np.searchsorted(cw[1:], np.arange(1, n) / n)
    c = np.empty(n)
    for _ in range(iters):
        idx = np.concatenate([[0], edges, [grid]])
        mass = cw[idx[1:]] - cw[idx[:-1]]
        c_new = (cwt[idx[1:]] - cwt[idx[:-1]]) / np.maximum(mass, 1e-300)
        if np.allclose(c_new, c, atol=1e-12, rtol=0):
            break
        c = c_new
        edges = np.searchsorted(t, (c[1:] + c[:-1]) / 2.0)
    return c


@lru_cache(maxsize=16)
def _rotation(dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(dim, dim, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return (q * torch.sign(torch.diagonal(r))).float()  # Haar-distributed orthogonal matrix


@lru_cache(maxsize=16)
def _gaussian(dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(dim, dim, generator=g, dtype=torch.float32)


@register(
    "turboquant", "TurboQuant-style: rotation + Lloyd-Max per coordinate + norm (bits=, qjl=0|1)"
)
class TurboQuant(Method):
    """TurboQuant (Zandieh et al., 2025), reimplemented.

    Each vector x is stored as its norm (fp16) and the unit vector u = x / |x| rotated by a fixed
    random orthogonal matrix R; every coordinate of Ru is quantized with the `bits`-bit Lloyd-Max
    quantizer of a coordinate of a uniform point on the sphere. With `qjl=1` (TurboQuant-prod),
    `bits - 1` bits go to that quantizer and one bit per coordinate to a QJL sketch of the
    residual r = u - u_mse: sign(S r) for a Gaussian S, plus |r| in fp16, decoded as
    sqrt(pi/2) / d * |r| * S^T sign(S r), which is unbiased for inner products.
    """

    name = "turboquant"

    def __init__(self, params: dict[str, Any]):
        _check_keys(params, {"bits", "qjl", "seed"}, self.name)
        super().__init__(params)
        self.cfg = {}
        for s in ("k", "v"):
            p = stream_params(params, s)
            bits, qjl, seed = (
                int(p.get("bits", 3)),
                int(bool(p.get("qjl", 0))),
                int(p.get("seed", 0)),
            )
            if not 1 <= bits <= 8 or bits - qjl < 0:
                raise ValueError("turboquant: need 1 <= bits <= 8")
            self.cfg[s] = (bits, qjl, seed)

    @property
    def bits(self):
        return (self.cfg["k"][0] + self.cfg["v"][0]) / 2

    def resolved_params(self):
        return {
            f"{s}_{n}": v for s in ("k", "v") for n, v in zip(("bits", "qjl", "seed"), self.cfg[s])
        }

    def compress(self, x, layer, stream):
        bits, qjl, seed = self.cfg[stream]
        b, h, t, d = x.shape
        xf = x.float()
        norm = xf.norm(dim=-1, keepdim=True)
        u = xf / norm.clamp_min(1e-30)
        norm16 = norm.half().float()
        mse_bits = bits - qjl
        if mse_bits > 0:
            rot = _rotation(d, seed)
            centroids = torch.from_numpy(lloyd_max_sphere(d, mse_bits)).float()
            y = u @ rot.T
            idx = torch.bucketize(y, (centroids[1:] + centroids[:-1]) / 2)
            u_hat = centroids[idx] @ rot
        else:
            u_hat = torch.zeros_like(u)
        side = 1
        if qjl:
            s_mat = _gaussian(d, seed + 1)
            r = u - u_hat
            rnorm16 = r.norm(dim=-1, keepdim=True).half().float()
            signs = torch.where(r @ s_mat.T >= 0, 1.0, -1.0)
            u_hat = u_hat + math.sqrt(math.pi / 2) / d * rnorm16 * (signs @ s_mat)
            side = 2
        x_hat = (norm16 * u_hat).to(x.dtype)
        row = {"codes": nominal_bytes(h * t * d, bits), "scales": 2 * side * h * t}
        return x_hat, [dict(row) for _ in range(b)]
