"""A fixed-size stand-in for a chunk whose coded form does not fit its budget: each
(token, head) row of ``head_dim`` values as ``bits``-bit uniform codes, its minimum and step
in float32. Its size depends on the shape alone, so the serde's size bound always holds."""

from __future__ import annotations

import numpy as np
import torch


def fallback_bytes(values: int, rows: int, bits: int) -> int:
    return (values * bits + 7) // 8 + 8 * rows


def fallback_bits(values: int, rows: int, budget: int) -> int:
    """The most bits per value (1..8) that fit ``budget`` bytes, or 0 where none does."""
    for bits in range(8, 0, -1):
        if fallback_bytes(values, rows, bits) <= budget:
            return bits
    return 0


def encode_fallback(x: torch.Tensor, head_dim: int, bits: int) -> bytes:
    rows = x.float().reshape(-1, head_dim)
    levels = (1 << bits) - 1
    lo = rows.amin(dim=1, keepdim=True)
    hi = rows.amax(dim=1, keepdim=True)
    step = (hi - lo) / max(levels, 1)
    q = ((rows - lo) / step.clamp_min(1e-30)).round().clamp(0, levels)
    codes = q.to(torch.uint8).numpy()
    bitplanes = np.unpackbits(codes[..., None], axis=-1)[..., 8 - bits :]
    packed = np.packbits(bitplanes.reshape(-1))
    return packed.tobytes() + torch.cat([lo, step], 1).numpy().tobytes()


def decode_fallback(data: memoryview, values: int, head_dim: int, bits: int) -> torch.Tensor:
    rows = values // head_dim
    nbits = (values * bits + 7) // 8
    if len(data) != nbits + 8 * rows:
        raise ValueError(f"fallback payload of {len(data)} bytes, expected {nbits + 8 * rows}")
    planes = np.unpackbits(np.frombuffer(data[:nbits], np.uint8))[: values * bits]
    planes = planes.reshape(values, bits)
    codes = np.packbits(np.concatenate([np.zeros((values, 8 - bits), np.uint8), planes], 1), 1)
    ls = np.frombuffer(data[nbits:], np.float32).reshape(rows, 2)
    out = codes.reshape(rows, head_dim).astype(np.float32) * ls[:, 1:2] + ls[:, 0:1]
    return torch.from_numpy(out)
