"""One Triton kernel for a run of coded blocks held on a GPU (``device_decode.PackedRun``).

The torch decoder of ``device_decode.py`` takes 27 small ops per run of blocks. On a GPU each
is a kernel launch the host queues one by one, and an H100 decode step of SmolLM2 was about
80 ms of host work around under 18 ms of device work (``reports/gpu_h100.txt``, 31st
session): those ops, 60 runs per step, were 1,620 of the step's 4,183 launches. This kernel
does a run's whole decode in one launch (the outliers' exact values are then put in place by
one more op): each program reads its vectors' codes from the packed stream (a code spans at
most two bytes), looks their levels up and writes ``mean + (level * sigma) * gain``, the
torch decoder's float32 operations in its order, with fused multiply-adds off, so the bits
are the codec's.

Used on CUDA devices where Triton imports, unless ``KAKEYATURBO_TRITON=0``. Its first decode
on each device is checked against the torch decoder bit for bit; a kernel that fails to build
or disagrees there is not used again in the process (a warning says so) and the torch ops
decode instead. ``tests/test_fused_decode.py`` runs the kernel in Triton's interpreter on the
CPU (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # not installed (CPU-only torch builds) or broken: the torch ops decode
    triton = None

__all__ = ["decode", "usable"]

#: Vectors and components per program: 32 x 128 values, 16 KB of output.
BLOCK_N = 32
MAX_BLOCK_D = 128

# Per device: True once the first decode matched the torch decoder, False if it did not.
_CHECKED: dict[str, bool] = {}


def usable(run: Any) -> bool:
    """Whether ``run`` (a ``device_decode.PackedRun``) decodes with the kernel: on a CUDA
    device, with Triton, not disabled by ``KAKEYATURBO_TRITON=0``, and checked there (its
    first call on each device checks)."""
    dev = run.codes.device
    if triton is None or dev.type != "cuda" or os.environ.get("KAKEYATURBO_TRITON") == "0":
        return False
    key = str(dev)
    if key not in _CHECKED:
        _CHECKED[key] = _agrees(run)
    return _CHECKED[key]


def _agrees(run: Any) -> bool:
    """Whether the kernel decodes ``run`` as the torch decoder does, bit for bit (once per
    device: this waits for the device)."""
    try:
        same = torch.equal(decode(run), run.decode_with_torch())
    except Exception as err:  # a build or launch failure on this device: say so, go on
        warnings.warn(
            f"kakeyaturbo: the Triton decoder failed on {run.codes.device} ({err!r}); "
            "decoding with torch ops",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    if not same:
        warnings.warn(
            f"kakeyaturbo: the Triton decoder disagrees with the torch decoder on "
            f"{run.codes.device}; decoding with torch ops",
            RuntimeWarning,
            stacklevel=3,
        )
    return same


def decode(run: Any) -> torch.Tensor:
    """``[K, n, d]`` float32: ``run`` (a ``device_decode.PackedRun``) decoded by the kernel
    (on its device; on the CPU only in Triton's interpreter)."""
    if triton is None:
        raise RuntimeError("the fused decoder needs Triton, which is not installed")
    levels = run.level_rows()  # [widths, entries]: row b the b-bit codebook, zero-padded
    k, d = run.bits.shape
    out = torch.empty(k, run.n, d, dtype=torch.float32, device=run.codes.device)
    if out.numel():
        block_d = min(triton.next_power_of_2(d), MAX_BLOCK_D)
        grid = (k, triton.cdiv(run.n, BLOCK_N), triton.cdiv(d, block_d))
        _decode_kernel[grid](
            run.codes,
            run.first,
            run.per_vector,
            run.bits,
            run.sigma,
            run.mean,
            run.gains,
            levels,
            out,
            run.n,
            d,
            LEVELS=levels.shape[1],
            BLOCK_N=BLOCK_N,
            BLOCK_D=block_d,
            enable_fp_fusion=False,  # mean + (level * sigma) * gain rounded as the codec does
        )
    return run.put_outliers(out)


if triton is not None:

    @triton.jit
    def _decode_kernel(
        codes,  # uint8: the run's packed code streams, zero-padded
        first,  # int32 or int64 [K, d]: the bit of component j of a stream-block's vector 0
        per_vector,  # int64 [K]: bits of one vector
        bits,  # uint8 [K, d]
        sigma,  # float16 [K, d]
        mean,  # [K, d], the skeleton dtype
        gains,  # float32 [widths]
        levels,  # float32 [widths, LEVELS]: the Gaussian codebooks, by width
        out,  # float32 [K, n, d]
        n,
        d,
        LEVELS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        k = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        j = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
        jm = j < d
        side = k * d + j
        b = tl.load(bits + side, mask=jm, other=0).to(tl.int32)
        s = tl.load(sigma + side, mask=jm, other=0).to(tl.float32)
        m = tl.load(mean + side, mask=jm, other=0).to(tl.float32)
        g = tl.load(gains + b, mask=jm, other=0.0)
        start = tl.load(first + side, mask=jm, other=0).to(tl.int64)[None, :]
        start += t.to(tl.int64)[:, None] * tl.load(per_vector + k)
        ok = (t < n)[:, None] & jm[None, :]
        byte = start >> 3
        lo = tl.load(codes + byte, mask=ok, other=0).to(tl.int32)
        hi = tl.load(codes + byte + 1, mask=ok, other=0).to(tl.int32)
        code = ((lo | (hi << 8)) >> (start & 7).to(tl.int32)) & ((1 << b) - 1)[None, :]
        level = tl.load(levels + (b * LEVELS)[None, :] + code, mask=ok, other=0.0)
        y = m[None, :] + (level * s[None, :]) * g[None, :]
        tl.store(out + (k * n + t.to(tl.int64))[:, None] * d + j[None, :], y, mask=ok)
