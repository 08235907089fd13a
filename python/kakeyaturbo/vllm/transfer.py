"""Moving vLLM's tensors to the host codec and back, timed.

The codec runs on the CPU and has no GPU-resident path. So:

* a CPU tensor crosses with no copy: ``kt.encode_batch`` reads it through DLPack
  (``kakeyaturbo._arrays.to_core``) and ``kt.decode_batch(out="torch")`` wraps the decoded
  array without a copy;
* a CUDA tensor takes an explicit device-to-host copy before and a host-to-device copy after.
  Both are timed (after a device synchronisation, so that kernels still queued are not charged
  to the copy) and counted in :class:`TransferStats`, which the hooks report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = ["TransferStats", "to_device", "to_host"]


@dataclass
class TransferStats:
    """Bytes and seconds spent moving tensors between the device and the host codec."""

    d2h_bytes: int = 0
    h2d_bytes: int = 0
    d2h_seconds: float = 0.0
    h2d_seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return dict(vars(self))


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
