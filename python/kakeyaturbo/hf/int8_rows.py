"""Vectors held as 8-bit integer codes with one bfloat16 scale each (the hot window's values).

A row ``x`` of ``D`` entries is held as ``round(x / s)`` in int8, clamped to +-127, with
``s = max|x| / 127`` rounded to bfloat16, both in one int8 tensor ``[..., D + 2]`` (the scale's
two bytes last), so slicing, concatenating and selecting rows work on it as on any tensor.
Each entry is off by at most half a step (0.4% of the row's largest entry; the bfloat16 scale
can clip that largest entry by as much again). Decoding gives float32, where ``code * scale``
is exact.

Why values and not keys (``docs/performance.md``): on SmolLM2, holding every
cached value so moves the next-token distribution by a KL of 4e-5, holding every key so by
4.5e-4 (a few channels carry most of a key's magnitude, so the per-row step is coarse for the
rest), against 1.8e-3 for the default recipe's codes.

A row that is not finite decodes as NaN (its scale is not finite and its codes are 0), so a
model's overflow stays visible as it would in an exact copy, and the codec refuses it when
the row is flushed into a block.

On the CPU the codec encodes (``_core.int8_rows_encode``, one call where torch takes a dozen
small ops) and its attention reads the rows as they are
held; the torch code here, which gives the same bits, serves other devices (on a GPU, one Triton
kernel does, ``fused_int8_rows.py``).
"""

from __future__ import annotations

import torch

from .. import _core
from ..gpu import fused_int8_rows

#: Bytes each row carries beyond its ``D`` codes (the bfloat16 scale).
SCALE_BYTES = 2
_LEVELS = 127


def encode(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[..., D]`` floating -> ``[..., D + 2]`` int8 (codes, then the scale's bytes), written
    into ``out`` where given (contiguous, of that shape: a hot window's slots) and returned."""
    if not x.is_floating_point():
        raise TypeError(f"int8 rows encode floating tensors, got {x.dtype}")
    _check_out(x, out)
    if x.device.type == "cpu" and x.shape[-1] > 0:
        xf = x.detach().float().contiguous()
        rows = torch.from_numpy(_core.int8_rows_encode(xf.numpy()))
        return rows if out is None else out.copy_(rows)
    if fused_int8_rows.usable(x, encode_torch):  # a GPU: one Triton kernel, the same bytes
        return fused_int8_rows.encode(x, out)
    return encode_torch(x, out)


def encode_torch(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`encode` in torch ops (any device): the same bits as the codec's."""
    _check_out(x, out)
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / _LEVELS).to(torch.bfloat16)
    # A zero row gives 0/0, a row that is not finite inf/inf or x/inf: codes 0 either way.
    codes = (xf / scale.float()).nan_to_num_(0.0, 0.0, 0.0)
    codes = codes.round_().clamp_(-_LEVELS, _LEVELS).to(torch.int8)
    # Through a flat copy: a tensor of no rows has no stride a dtype view accepts.
    scale_bytes = scale.reshape(-1).view(torch.int8).view(*scale.shape[:-1], SCALE_BYTES)
    if out is None:
        return torch.cat((codes, scale_bytes), dim=-1)
    return torch.cat((codes, scale_bytes), dim=-1, out=out)


def _check_out(x: torch.Tensor, out: torch.Tensor | None) -> None:
    """Refuse an ``out`` that cannot hold ``x``'s rows as they are written (in order)."""
    if out is None:
        return
    want = (*x.shape[:-1], x.shape[-1] + SCALE_BYTES)
    if out.dtype != torch.int8 or tuple(out.shape) != want or not out.is_contiguous():
        raise ValueError(
            f"int8 rows of {tuple(x.shape)} go into a contiguous int8 {want}, got "
            f"{out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ' (strided)'}"
        )
    if out.device != x.device:
        raise ValueError(f"int8 rows of a tensor on {x.device} go to {x.device}, not {out.device}")


def decode(held: torch.Tensor) -> torch.Tensor:
    """``[..., D + 2]`` int8 (from :func:`encode`) -> ``[..., D]`` float32."""
    if held.dtype != torch.int8 or held.shape[-1] <= SCALE_BYTES:
        raise ValueError(
            f"int8 rows are int8 [..., D + {SCALE_BYTES}], got {held.dtype} {tuple(held.shape)}"
        )
    d = held.shape[-1] - SCALE_BYTES
    scale = held[..., d:].reshape(-1).view(torch.bfloat16).view(*held.shape[:-1], 1).float()
    return held[..., :d] * scale  # int8 times float32 is float32: one op, code * scale exact


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` as int8 rows hold it, in ``x``'s dtype and shape."""
    return decode(encode(x)).to(x.dtype)
