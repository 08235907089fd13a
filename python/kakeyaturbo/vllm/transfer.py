"""Crossing between torch tensors (wherever vLLM keeps them) and the Rust codec, via DLPack.

The codec runs on the CPU and has no GPU-resident path. So:

* a CPU tensor crosses with no copy: :func:`host_array` is ``np.from_dlpack`` of the tensor
  itself, and the decoded numpy array comes back through ``torch.from_dlpack``;
* a CUDA tensor takes an explicit device-to-host copy before and a host-to-device copy after.
  Both are timed (after a device synchronisation, so that kernels still queued are not charged
  to the copy) and counted in :class:`TransferStats`, which the hooks report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["TransferStats", "from_host_array", "host_array", "to_device", "to_host"]


@dataclass
class TransferStats:
    """Bytes and seconds spent moving tensors between the device and the host codec."""

    d2h_bytes: int = 0
    h2d_bytes: int = 0
    d2h_seconds: float = 0.0
    h2d_seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "d2h_bytes": self.d2h_bytes,
            "h2d_bytes": self.h2d_bytes,
            "d2h_seconds": self.d2h_seconds,
            "h2d_seconds": self.h2d_seconds,
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_host(x: torch.Tensor, stats: TransferStats) -> torch.Tensor:
    """``x`` on the CPU: the tensor itself when it is there already, else a timed copy."""
    if x.device.type == "cpu":
        return x
    _sync(x.device)
    t0 = time.perf_counter()
    host = x.to("cpu")
    stats.d2h_seconds += time.perf_counter() - t0
    stats.d2h_bytes += host.numel() * host.element_size()
    return host


def to_device(x: torch.Tensor, device: torch.device, stats: TransferStats) -> torch.Tensor:
    """``x`` (on the CPU) moved to ``device``, timed when that is a copy."""
    if device.type == "cpu":
        return x
    t0 = time.perf_counter()
    out = x.to(device)
    _sync(device)
    stats.h2d_seconds += time.perf_counter() - t0
    stats.h2d_bytes += x.numel() * x.element_size()
    return out


def host_array(x: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous float32 CPU tensor, through DLPack (no copy)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(
            f"host_array takes a contiguous float32 CPU tensor, got {x.dtype} on {x.device}"
        )
    return np.from_dlpack(x.detach())


def from_host_array(a: np.ndarray) -> torch.Tensor:
    """A torch view of a numpy array, through DLPack (no copy)."""
    return torch.from_dlpack(np.ascontiguousarray(a))
