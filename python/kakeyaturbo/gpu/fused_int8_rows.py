"""The hot window's int8 rows (``hf/int8_rows.py``) encoded by one Triton kernel on a GPU.

Every decode step appends each layer's new value row to the hot window as int8 codes and a
bfloat16 scale. Off the CPU that took ``int8_rows.encode_torch``'s dozen small ops per layer
(about 360 kernel launches of a SmolLM2 step, each queued by the host); this kernel takes one.
It gives ``encode_torch``'s bytes: the scale is ``max|x| / 127`` divided in IEEE float32 and
rounded to bfloat16 (to nearest even, by its bits), each code ``x / scale`` divided the same
way, clamped to +-127 and rounded half to even (the same as clamping after rounding), codes
of 0 where the quotient is not finite, and a row holding NaN gets a NaN scale, as torch's
``amax`` gives (a quiet NaN: its other bits need not be torch's, which differ between devices
too).

Used on CUDA devices where Triton imports, unless ``KAKEYATURBO_TRITON=0``; its first call on
each device is checked against ``encode_torch`` byte for byte (:func:`same_rows`), and a
kernel that fails or disagrees there is not used again in the process.
``tests/unit/test_int8_rows.py`` runs it in Triton's interpreter on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .triton_support import CheckedKernel, bf16_bits, round_half_even, tl, triton

__all__ = ["KERNEL", "encode", "same_rows", "usable"]

#: Rows per program.
BLOCK_ROWS = 16
#: The widest row the kernel takes in one tile (wider rows encode with torch).
MAX_WIDTH = 1024

#: The kernel's standing per device (its first call there is checked byte for byte).
KERNEL = CheckedKernel("int8 row encoder")


def usable(x: torch.Tensor, with_torch: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether :func:`encode` runs the kernel for ``x`` ``[..., D]``: rows no wider than
    :data:`MAX_WIDTH`, on a CUDA device where the kernel has given ``with_torch``'s bytes
    (``int8_rows.encode_torch``; checked on the first call there)."""
    if not 0 < x.shape[-1] <= MAX_WIDTH:
        return False
    return KERNEL.usable(x.device, lambda: same_rows(encode(x), with_torch(x)))


def same_rows(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether int8 rows ``got`` are ``want`` byte for byte, but for a NaN scale's bits."""
    if got.shape != want.shape:
        return False
    scales = [t[..., -2:].contiguous().view(torch.bfloat16) for t in (got, want)]
    nan = scales[0].isnan() & scales[1].isnan()
    same = torch.cat((got[..., :-2] == want[..., :-2], (got[..., -2:] == want[..., -2:]) | nan), -1)
    return bool(same.all())


def encode(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[..., D]`` floating -> ``[..., D + 2]`` int8: the codes, then the scale's two bytes
    (little-endian), by the kernel; written into ``out`` where given (contiguous, of that
    shape, as ``int8_rows.encode`` checks)."""
    if triton is None:
        raise RuntimeError("the fused int8 row encoder needs Triton, which is not installed")
    d = x.shape[-1]
    rows = x.reshape(-1, d).contiguous()
    if out is None:
        out = torch.empty(*x.shape[:-1], d + 2, dtype=torch.int8, device=x.device)
    if rows.shape[0]:
        encode_kernel[(triton.cdiv(rows.shape[0], BLOCK_ROWS),)](
            rows,
            out,
            rows.shape[0],
            d,
            BLOCK_ROWS=BLOCK_ROWS,
            BLOCK_D=triton.next_power_of_2(d),
        )
    return out


if triton is not None:

    @triton.jit
    def encode_kernel(x, out, n, D, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
        r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        j = tl.arange(0, BLOCK_D)
        ok = (r < n)[:, None] & (j < D)[None, :]
        row = r.to(tl.int64)[:, None]
        v = tl.load(x + row * D + j[None, :], mask=ok, other=0.0).to(tl.float32)
        top = tl.max(tl.abs(v), axis=1)
        nans = tl.sum((v != v).to(tl.int32), axis=1)
        top = tl.where(nans > 0, float("nan"), top)  # amax propagates NaN
        # The scale to bfloat16 by its bits, as torch rounds it; NaN stays a quiet NaN.
        bits = bf16_bits(tl.math.div_rn(top, 127.0))
        s = (bits << 16).to(tl.float32, bitcast=True)[:, None]
        q = tl.math.div_rn(v, s)
        q = tl.where((q != q) | (tl.abs(q) == float("inf")), 0.0, q)  # nan_to_num(0, 0, 0)
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        q = round_half_even(q)  # (|q| <= 127)
        tl.store(out + row * (D + 2) + j[None, :], q.to(tl.int8), mask=ok)
        live = r < n
        at = out + r.to(tl.int64) * (D + 2) + D
        tl.store(at, (bits & 0xFF).to(tl.uint8).to(tl.int8, bitcast=True), mask=live)
        tl.store(at + 1, (bits >> 8).to(tl.uint8).to(tl.int8, bitcast=True), mask=live)
