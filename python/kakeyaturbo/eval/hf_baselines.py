"""Peer KV codecs that run transformers' own `QuantizedCache` as it ships (the `hf-*`
methods: backends hqq, optimum-quanto, fp8), counted by the byte rule of `baselines`: codes
bit-packed densely, scales as the backend stores them."""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import torch

from kakeyaturbo.eval.methods import ByteCount, Method, nominal_bytes, register

__all__ = ["HFFp8", "HFHqq", "HFQuantizedCache", "HFQuanto"]


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
