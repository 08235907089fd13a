"""A fixed-size stand-in for a chunk whose coded form does not fit its budget: each
(token, head) row of ``head_dim`` values as ``bits``-bit uniform codes, its minimum and step
in float32. Its size depends on the shape alone, so the serde's size bound always holds.

Both sides work in float64: a row's range can reach twice float32's largest value (KV of
both signs near a bfloat16's or float32's limits), which float32 arithmetic would turn into an
infinite step and then NaN codes."""

from __future__ import annotations

import numpy as np
import torch

_F32_MAX = float(np.finfo(np.float32).max)


def fallback_bytes(values: int, rows: int, bits: int) -> int:
    return (values * bits + 7) // 8 + 8 * rows


def fallback_bits(values: int, rows: int, budget: int) -> int:
    """The most bits per value (1..8) that fit ``budget`` bytes, or 0 where none does."""
    for bits in range(8, 0, -1):
        if fallback_bytes(values, rows, bits) <= budget:
            return bits
    return 0


def encode_fallback(x: torch.Tensor, head_dim: int, bits: int) -> bytes:
    rows = x.double().reshape(-1, head_dim)
    levels = (1 << bits) - 1
    lo = rows.amin(dim=1, keepdim=True)
    hi = rows.amax(dim=1, keepdim=True)
    # The step as stored (float32, at most its largest), so that the codes fit what decodes.
    step = ((hi - lo) / max(levels, 1)).clamp(max=_F32_MAX).float().double()
    q = ((rows - lo) / step.clamp_min(1e-30)).round().clamp(0, levels)
    codes = q.to(torch.uint8).numpy()
    bitplanes = np.unpackbits(codes[..., None], axis=-1)[..., 8 - bits :]
    packed = np.packbits(bitplanes.reshape(-1))
    return packed.tobytes() + torch.cat([lo, step], 1).float().numpy().tobytes()


def decode_fallback(data: memoryview, values: int, head_dim: int, bits: int) -> torch.Tensor:
    rows = values // head_dim
    nbits = (values * bits + 7) // 8
    if len(data) != nbits + 8 * rows:
        raise ValueError(f"fallback payload of {len(data)} bytes, expected {nbits + 8 * rows}")
    planes = np.unpackbits(np.frombuffer(data[:nbits], np.uint8))[: values * bits]
    planes = planes.reshape(values, bits)
    codes = np.packbits(np.concatenate([np.zeros((values, 8 - bits), np.uint8), planes], 1), 1)
    ls = np.frombuffer(data[nbits:], np.float32).reshape(rows, 2).astype(np.float64)
    with np.errstate(all="ignore"):  # a forged object's inf or NaN: the caller rejects NaN
        out = codes.reshape(rows, head_dim).astype(np.float64) * ls[:, 1:2] + ls[:, 0:1]
        out = np.clip(out, -_F32_MAX, _F32_MAX).astype(np.float32)
    return torch.from_numpy(out)
