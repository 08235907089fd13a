"""The ``kakeya`` serde's configuration: the ``"serde"`` dict of an LMCache L2 adapter.

Required: ``bundle`` (a calibration bundle directory, ``kakeyaturbo calibrate``), the model's
``num_layers``, ``num_kv_heads`` and ``head_dim`` (checked against the chunks and the bundle),
and its RoPE: ``rope_theta`` (plain RoPE over the whole head) or ``model`` (a Hugging Face
folder whose config gives it, scaling included). Optional: ``chunk_size`` (LMCache's, 256),
``max_positions`` (the context the start search covers, 8192), ``bits`` (bits per value of
keys and values, 3.0), ``budget_bits`` (bits per value
the fixed object size allows), ``max_workers`` (serde threads, 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

#: Bits per value of keys and values: the lowest at which SmolLM2's continuation on loaded
#: chunks beat LMCache's fp8 in KL (docs/lmcache.md).
DEFAULT_BITS = 3.0
#: Bits per value of the fixed object size: a 256-token SmolLM2 chunk coded at 3.0 takes
#: 3.24 (side information and token norms), 3.49 with its sinks exact; 3.55 leaves margin.
DEFAULT_BUDGET_BITS = 3.55

_INTS = ("num_layers", "num_kv_heads", "head_dim", "chunk_size", "max_positions", "max_workers")


@dataclass(frozen=True)
class SerdeOptions:
    bundle: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rope_theta: Optional[float] = None
    model: Optional[str] = None
    chunk_size: int = 256
    max_positions: int = 8192
    budget_bits: float = DEFAULT_BUDGET_BITS
    bits: float = DEFAULT_BITS
    max_workers: int = 1

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> SerdeOptions:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"kakeya serde: unknown options {unknown} (known: {sorted(known)})")
        missing = [
            k for k in ("bundle", "num_layers", "num_kv_heads", "head_dim") if k not in kwargs
        ]
        if missing:
            raise ValueError(f"kakeya serde: missing required options {missing}")
        for k in _INTS:
            v = kwargs.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"kakeya serde: {k} must be a positive integer, got {v!r}")
        if (kwargs.get("rope_theta") is None) == (kwargs.get("model") is None):
            raise ValueError("kakeya serde: give exactly one of rope_theta and model (for RoPE)")
        bb = kwargs.get("budget_bits", DEFAULT_BUDGET_BITS)
        if isinstance(bb, bool) or not isinstance(bb, (int, float)) or not 0.5 <= bb <= 16:
            raise ValueError(f"kakeya serde: budget_bits must be in [0.5, 16], got {bb!r}")
        bits = kwargs.get("bits", DEFAULT_BITS)
        if (
            isinstance(bits, bool)
            or not isinstance(bits, (int, float))
            or not 0.5 <= bits <= 8
            or bits >= bb
        ):
            raise ValueError(
                f"kakeya serde: bits must be in [0.5, 8] and below budget_bits, got {bits!r}"
            )
        theta = kwargs.get("rope_theta")
        if theta is not None and (
            isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 1
        ):
            raise ValueError(f"kakeya serde: rope_theta must be a number > 1, got {theta!r}")
        return cls(**{**kwargs, "budget_bits": float(bb), "bits": float(bits)})
