"""Peer KV codecs, reimplemented so they run in the same harness and are counted the same way.

Every codec here is a reimplementation from the papers' descriptions, not the authors' code
(except the `hf-*` methods, which run transformers' own `QuantizedCache` as it ships). They
exist to put kakeyaturbo's numbers next to well-known alternatives under one protocol.

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
import os
import sys
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from kakeyaturbo.eval.methods import ByteCount, Method, nominal_bytes, register, stream_params

__all__ = [
    "Bf16",
    "Fp8",
    "HFQuantizedCache",
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


@register("identity", "no-op: the cache as computed (bytes at the model's dtype); for checks")
class Identity(Method):
    name = "identity"

    def __init__(self, params: dict[str, Any]):
        _check_keys(params, set(), self.name)
        super().__init__(params)

    def compress(self, x, layer, stream):
        per_row = x[0].numel() * x.element_size()
        return x, [{"full_precision": per_row} for _ in range(_rows(x))]


@register("bf16", "bf16 storage: the baseline every ratio is measured against")
class Bf16(Method):
    name = "bf16"

    def __init__(self, params: dict[str, Any]):
        _check_keys(params, set(), self.name)
        super().__init__(params)

    @property
    def bits(self):
        return 16

    def compress(self, x, layer, stream):
        return bf16_round(x), [{"full_precision": x[0].numel() * 2} for _ in range(_rows(x))]


@register("zero", "drops the stream: stores nothing, decodes zeros (a lower bound; use streams=)")
class Zero(Method):
    name = "zero"

    def __init__(self, params: dict[str, Any]):
        _check_keys(params, set(), self.name)
        super().__init__(params)

    @property
    def bits(self):
        return 0

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


# --------------------------------------------------------------------------------------------
# transformers' QuantizedCache, as it ships


def _make_ninja_visible() -> None:
    # optimum-quanto JIT-compiles its CPU kernels with ninja, which pip installs next to python.
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


class HFQuantizedCache(Method):
    """transformers' `QuantizedCache` (backends quanto, hqq, fp8), run as it ships.

    The prefix is written into the cache with `update` exactly as the model's prefill does (the
    first update quantizes everything), and the continuation goes through the cache's own
    residual path. It cannot run in-forward (the shipped cache returns the unquantized states on
    the first update) and takes none of the shared options. Rows are run one passage at a time so
    that per-tensor scales never mix passages. Bytes are counted by the common rule from the
    quantized tensors' shapes; `allocated` is what the backend's tensors actually occupy.
    """

    supports_in_forward = False
    backend = ""

    def __init__(self, params: dict[str, Any]):
        super().__init__(params)
        self.reason = self.unavailable()

    def unavailable(self) -> str | None:
        return None

    def cache_kwargs(self) -> dict[str, Any]:
        return {}

    def make_cache(self, config):
        from transformers import QuantizedCache

        return QuantizedCache(self.backend, config, **self.cache_kwargs())

    def count(self, layer) -> tuple[dict[str, ByteCount], int]:
        """({"k": counted, "v": counted}, allocated bytes) of one layer of a one-passage cache."""
        raise NotImplementedError

    def compress(self, x, layer, stream):
        raise TypeError(f"{self.spec} runs through transformers' QuantizedCache, not compress()")


class _GroupWiseHF(HFQuantizedCache):
    default_axis = 0
    allowed_bits: tuple[int, ...] = ()

    def __init__(self, params: dict[str, Any]):
        _check_keys_plain(
            params, {"bits", "group", "axis_key", "axis_value", "residual"}, self.backend
        )
        self.nbits = int(params.get("bits", 4))
        self.group = int(params.get("group", 64))
        self.axis_key = int(params.get("axis_key", self.default_axis))
        self.axis_value = int(params.get("axis_value", self.default_axis))
        self.residual = int(params.get("residual", 128))
        super().__init__(params)

    @property
    def bits(self):
        return self.nbits

    def resolved_params(self):
        return {
            "backend": self.backend,
            "bits": self.nbits,
            "group": self.group,
            "axis_key": self.axis_key,
            "axis_value": self.axis_value,
            "residual": self.residual,
        }

    def cache_kwargs(self):
        return {
            "nbits": self.nbits,
            "axis_key": self.axis_key,
            "axis_value": self.axis_value,
            "q_group_size": self.group,
            "residual_length": self.residual,
        }

    def count(self, layer):
        counted: dict[str, ByteCount] = {}
        allocated = 0
        for stream, q in (("k", layer._quantized_keys), ("v", layer._quantized_values)):
            numel, alloc = self._numel_and_alloc(q)
            counted[stream] = {
                "codes": nominal_bytes(numel, self.nbits),
                "scales": 4 * math.ceil(numel / self.group),
            }
            allocated += alloc
        return counted, allocated


def _check_keys_plain(params: dict[str, Any], allowed: set[str], name: str) -> None:
    for key in params:
        if key not in allowed:
            raise ValueError(
                f"hf-{name}: unknown parameter {key!r} (known: {', '.join(sorted(allowed))})"
            )


@register(
    "hf-hqq",
    "transformers QuantizedCache, HQQ backend, as shipped (bits=1|2|3|4|8, group=, axis_*)",
)
class HFHqq(_GroupWiseHF):
    name = "hf-hqq"
    backend = "hqq"
    default_axis = 1  # the axis transformers' docs recommend for HQQ; per-token groups

    def unavailable(self):
        from transformers.utils import is_hqq_available

        if not is_hqq_available():
            return "hqq is not installed (pip install hqq)"
        if self.nbits == 3 and 1 in (self.axis_key, self.axis_value):
            return (
                "hqq 0.2.8 3-bit packing fails on axis=1 (dequantize returns an empty tensor);"
                " axis_key=0,axis_value=0 works"
            )
        return None

    @staticmethod
    def _numel_and_alloc(q):
        w, meta = q
        numel = math.prod(meta["shape"])
        alloc = w.numel() * w.element_size() + sum(
            meta[k].numel() * meta[k].element_size()
            for k in ("scale", "zero")
            if torch.is_tensor(meta.get(k))
        )
        return numel, alloc


@register(
    "hf-quanto",
    "transformers QuantizedCache, optimum-quanto backend, as shipped (bits=2|4, group=)",
)
class HFQuanto(_GroupWiseHF):
    name = "hf-quanto"
    backend = "quanto"
    default_axis = 0

    def unavailable(self):
        from transformers.utils import is_optimum_quanto_available

        if not is_optimum_quanto_available():
            return "optimum-quanto is not installed (pip install optimum-quanto)"
        if self.nbits not in (2, 4):
            return f"quanto supports 2 and 4 bits only, not {self.nbits}"
        _make_ninja_visible()
        return None

    @staticmethod
    def _numel_and_alloc(q):
        numel = q.numel()
        alloc = 0
        for name in ("_data", "_scale", "_shift"):
            t = getattr(q, name, None)
            if t is None:
                continue
            inner = getattr(t, "_data", t)  # packed tensors wrap their bytes
            alloc += inner.numel() * inner.element_size()
        return numel, alloc


# As shipped, the fp8 backend has no residual window: the teacher-forced continuation is
# quantized too (with the prefix's scale), unlike every other method here.
@register(
    "hf-fp8",
    "transformers QuantizedCache, fp8 backend (e4m3, one fp32 scale per tensor), as shipped",
)
class HFFp8(HFQuantizedCache):
    name = "hf-fp8"
    backend = "fp8"

    def __init__(self, params: dict[str, Any]):
        _check_keys_plain(params, set(), "fp8")
        super().__init__(params)

    @property
    def bits(self):
        return 8

    def count(self, layer):
        counted: dict[str, ByteCount] = {}
        allocated = 0
        for stream, (q, scale) in (("k", layer._quantized_keys), ("v", layer._quantized_values)):
            counted[stream] = {"codes": q.numel(), "scales": 4}
            allocated += q.numel() * q.element_size() + scale.numel() * scale.element_size()
        return counted, allocated
