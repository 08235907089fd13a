"""Turning user arrays (numpy, torch, anything with ``__dlpack__``) into what the Rust core
reads, and decoded float32 back into the caller's framework, dtype and device.

float32 and float16 CPU inputs cross without a copy (DLPack / the buffer protocol);
bfloat16 crosses as its raw 16-bit pattern (numpy has no bfloat16). float64, numpy's default,
is converted to float32 (one copy; the codec computes in float32 and decodes to float32). CUDA
tensors take an explicit device-to-host copy: the codec runs on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

_NUMPY_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}
_F16_MAX = float(np.finfo(np.float16).max)
_MISALIGNED = "not contiguous or is misaligned"  # rust-numpy's slice error, which names no arg


@dataclass(frozen=True)
class Origin:
    """Where an input came from, so decode can hand back the same kind of array."""

    framework: str  # "numpy" or "torch"
    dtype: str  # "float32", "float16" or "bfloat16"
    device: Optional[str] = None  # torch device string


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is an optional extra
        return None
    return torch


def _is_torch_tensor(x: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def to_core(x: Any, name: str, ndim: int) -> tuple[np.ndarray, bool, Origin]:
    """Returns ``(array, bf16_bits, origin)`` for the Rust core, validating dtype and rank.
    float64 is converted to float32 here (the core reads no float64), so its origin, and what
    decoding it gives back, is float32."""
    if _is_torch_tensor(x):
        arr, bf16, origin = _from_torch(x, name)
    elif isinstance(x, np.ndarray):
        if x.dtype == np.float64:
            x = x.astype(np.float32)
        if x.dtype not in _NUMPY_DTYPES:
            raise TypeError(
                f"{name}: dtype {x.dtype} is not supported; use a float dtype (32, 16 or 64 bits)"
            )
        arr, bf16, origin = np.ascontiguousarray(x), False, Origin("numpy", _NUMPY_DTYPES[x.dtype])
    elif hasattr(x, "__dlpack__"):
        return to_core(np.from_dlpack(x), name, ndim)
    else:
        raise TypeError(f"{name}: expected a numpy array or torch tensor, got {type(x).__name__}")
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(arr.shape)}")
    if any(s == 0 for s in arr.shape):
        raise ValueError(f"{name}: empty shape {tuple(arr.shape)}")
    return arr, bf16, origin


def _from_torch(t: Any, name: str) -> tuple[np.ndarray, bool, Origin]:
    torch = _torch()
    names = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
    if t.dtype == torch.float64:
        t = t.to(torch.float32)
    if t.dtype not in names:
        raise TypeError(
            f"{name}: dtype {t.dtype} is not supported; use float32, float16, bfloat16 or float64"
        )
    origin = Origin("torch", names[t.dtype], str(t.device))
    # The codec runs on the CPU: CUDA tensors take one explicit device-to-host copy.
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return bf16_bits(t), True, origin
    return np.from_dlpack(t), False, origin


def bf16_bits(t: Any) -> np.ndarray:
    """A contiguous CPU bfloat16 tensor's raw bits as a uint16 numpy view, no copy (numpy has
    no bfloat16)."""
    # .numpy() shares the memory as from_dlpack does, in half its time (per layer and step).
    return t.view(_torch().int16).numpy().view(np.uint16)


def from_core(values: np.ndarray, dtype: str, origin: Optional[Origin], out: Optional[str]) -> Any:
    """Decoded float32 -> the requested framework ('numpy' or 'torch'), dtype and device.
    float16 saturates at +-65504: decoding stays within the codec's error of honest input near
    float16's limit, and a blob's stored scales (validated, finite) cannot make it infinite.
    bfloat16 needs no bound: decoded values stay far inside float32's range, which it shares."""
    if dtype == "float16":
        # In place where the core's fresh output allows: one pass, no second buffer.
        out_arr = values if values.flags.writeable else None
        values = np.clip(values, -_F16_MAX, _F16_MAX, out=out_arr)
    framework = out or (origin.framework if origin else None)
    if framework is None:
        framework = "torch" if dtype == "bfloat16" and _torch() is not None else "numpy"
    if framework == "numpy":
        if dtype == "float16":
            return values.astype(np.float16)
        return values  # float32, and bfloat16 widened: numpy has no bfloat16
    if framework != "torch":
        raise ValueError(f"out must be 'numpy' or 'torch', got {out!r}")
    torch = _torch()
    if torch is None:
        raise ImportError("out='torch' needs torch installed")
    t = torch.from_numpy(values).to(getattr(torch, dtype))
    device = origin.device if origin and origin.framework == "torch" else None
    return t.to(device) if device and device != "cpu" else t


def aligned_copies(args: dict) -> Optional[dict]:
    """``args`` with every numpy array misaligned in memory (inside lists and tuples too)
    replaced by an aligned C-contiguous copy, or None where there is none."""
    fixed = {k: _aligned(v) for k, v in args.items()}
    return fixed if any(fixed[k] is not v for k, v in args.items()) else None


def _aligned(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v if v.flags.aligned else np.require(v, requirements=["C", "A"])
    if isinstance(v, (list, tuple)):
        items = [_aligned(i) for i in v]
        if all(a is b for a, b in zip(items, v)):
            return v
        return items if isinstance(v, list) else tuple(items)
    return v


def count_arg(v: Any, name: str) -> Any:
    # PyO3 reads True as 1: a bool here is a mistake, not a count.
    if isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an int, got bool {v}")
    return v


def call_core(fn: Any, keep: tuple = (), **args: Any) -> Any:
    """``fn(**args)``; where the core cannot read an array misaligned in memory (its
    C-contiguous check passes, its slice view refuses, naming nothing), again with aligned
    copies, except of ``keep``, which must be the caller's own array (a TypeError names it)."""
    try:
        return fn(**args)
    except TypeError as e:
        fixed = aligned_copies(args) if _MISALIGNED in str(e) else None
        if fixed is None:
            raise
    for name in keep:
        if fixed[name] is not args[name]:
            raise TypeError(
                f"{name}: the array is misaligned in memory; prepared keys read it in place, so"
                f" pass one aligned copy (np.require({name}, requirements='CA')) to both"
                " prepare_keys and coded_attend"
            ) from None
    return fn(**fixed)
