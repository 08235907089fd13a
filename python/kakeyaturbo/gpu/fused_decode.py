"""Triton kernels that decode what coded blocks hold on a GPU: a run of blocks
(``device_decode.PackedRun``) and their token norms (``norm_codes.StackedNorms``).

The torch decoder of ``device_decode.py`` takes 27 small ops per run of blocks. On a GPU each
is a kernel launch the host queues one by one, and on an H100 the host's queueing, not the
device's work, sets a decode step's pace (``reports/gpu_h100.txt``): those ops, 60 runs per
step, are 1,620 of a SmolLM2 decode step's 4,183 launches. This kernel
does a run's whole decode in one launch: each program reads its vectors' codes from the
packed stream (a code spans at most two bytes), looks their levels up and writes ``mean +
(level * sigma) * gain``, the torch decoder's float32 operations in its order, with fused
multiply-adds off, so the bits are the codec's; then, once its threads have written the tile,
it puts the exact values of the outliers in the tile in place (``PackedRun`` holds them by
tile), where the torch decoder takes one more op per run.

Used on CUDA devices where Triton imports, unless ``KAKEYATURBO_TRITON=0``. Its first decode
on each device is checked against the torch decoder bit for bit; a kernel that fails to build
or disagrees there is not used again in the process (a warning says so) and the torch ops
decode instead. ``tests/gpu/test_fused_decode.py`` runs the kernel in Triton's interpreter on the
CPU (``TRITON_INTERPRET=1``).

The token norms of a run of blocks took 7 torch ops per run (one run of value norms per layer
in the default recipe: 210 of a SmolLM2 decode step's launches): :func:`decode_norms` takes one,
``exp2((code - 1) * step + low)`` with zero for code 0, the torch ops' float32 operations in
their order. Its first call on each device is checked against them to
:data:`NORM_TOLERANCE` (a GPU's exp2 in Triton need not round as torch's does).
"""

from __future__ import annotations

from typing import Any

import torch

from .triton_support import CheckedKernel, program_tile, tl, triton

__all__ = [
    "KERNEL",
    "NORMS",
    "decode",
    "decode_norms",
    "norms_close",
    "norms_usable",
    "same_bits",
    "usable",
]

#: Vectors and components per program: 32 x 128 values, 16 KB of output. (``PackedRun``
#: holds the outliers by tiles of BLOCK_N vectors.)
BLOCK_N = 32
MAX_BLOCK_D = 128
#: Outliers a program puts at a time.
BLOCK_OUTLIERS = 64

#: The kernel's standing per device (its first decode there is checked bit for bit).
KERNEL = CheckedKernel("decoder")
#: The norm kernel's standing per device, and how far its norms may be from torch's (relative).
NORMS = CheckedKernel("norm decoder")
NORM_TOLERANCE = 1e-6
#: Tokens per program of the norm kernel.
NORM_BLOCK = 256


def usable(run: Any) -> bool:
    """Whether ``run`` (a ``device_decode.PackedRun``) decodes with the kernel: on a CUDA
    device, with Triton, not disabled by ``KAKEYATURBO_TRITON=0``, and checked there (its
    first call on each device checks)."""
    return KERNEL.usable(run.codes.device, lambda: same_bits(run))


def same_bits(run: Any) -> bool:
    """Whether the kernel decodes ``run`` as the torch decoder does, bit for bit."""
    return torch.equal(decode(run), run.decode_with_torch())


def norms_usable(codes: torch.Tensor, low: torch.Tensor, step: torch.Tensor, with_torch) -> bool:
    """Whether :func:`decode_norms` runs the kernel for a run's norms (arguments as there):
    on a CUDA device, with Triton, not disabled, and checked there against ``with_torch``
    (the same arguments' norms by torch ops: ``norm_codes.decode_run_with_torch``)."""
    return NORMS.usable(codes.device, lambda: norms_close(codes, low, step, with_torch))


def norms_close(codes, low, step, with_torch) -> bool:
    """Whether :func:`decode_norms` gives ``with_torch``'s norms to :data:`NORM_TOLERANCE`,
    zeros where they are zero (the check :func:`norms_usable` runs once per device)."""
    got, want = decode_norms(codes, low, step), with_torch(codes, low, step)
    if got.shape != want.shape or not torch.equal(got == 0, want == 0):
        return False
    return bool(((got - want).abs() <= NORM_TOLERANCE * want.abs()).all())


def decode_norms(codes: torch.Tensor, low: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """A run's token norms ``[R, H, blocks * tokens]`` float32 by the kernel: ``codes`` uint8
    ``[R, H, blocks, tokens]``, ``low`` and ``step`` float32 ``[R, H, blocks]`` (the log2 of
    each block stream's smallest norm, and its step)."""
    if triton is None:
        raise RuntimeError("the fused norm decoder needs Triton, which is not installed")
    tokens = codes.shape[-1]
    codes, low, step = codes.contiguous(), low.contiguous(), step.contiguous()
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    if out.numel():
        streams = low.numel()
        norms_kernel[(streams, triton.cdiv(tokens, NORM_BLOCK))](
            codes,
            low,
            step,
            out,
            tokens,
            BLOCK=NORM_BLOCK,
            enable_fp_fusion=False,  # (code - 1) * step, then + low: two roundings, as torch
        )
    return out.flatten(-2)


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
        decode_kernel[grid](
            run.codes,
            run.base,
            run.per_vector,
            run.bits,
            run.sigma,
            run.mean,
            run.gains,
            levels,
            run.outlier_pos,
            run.outlier_dec,
            run.outlier_tiles,
            out,
            run.n,
            d,
            LEVELS=levels.shape[1],
            HAS_OUTLIERS=run.outlier_pos.numel() > 0,
            BLOCK_N=BLOCK_N,
            BLOCK_D=block_d,
            BLOCK_O=BLOCK_OUTLIERS,
            enable_fp_fusion=False,  # mean + (level * sigma) * gain rounded as the codec does
        )
    return out


if triton is not None:

    @triton.jit
    def decode_kernel(
        codes,  # uint8: the run's packed code streams, zero-padded
        base,  # int64 [K]: the byte where each stream-block's codes start
        per_vector,  # int64 [K]: bits of one vector
        bits,  # uint8 [K, d]
        sigma,  # float16 [K, d]
        mean,  # [K, d], the skeleton dtype
        gains,  # float32 [widths]
        levels,  # float32 [widths, LEVELS]: the Gaussian codebooks, by width
        outlier_pos,  # int64 [m]: into out, flattened, in order of tile
        outlier_dec,  # float32 [m]: their values
        outlier_tiles,  # int64 [K * tiles + 1]: where each tile of BLOCK_N vectors' start
        out,  # float32 [K, n, d]
        n,
        d,
        LEVELS: tl.constexpr,
        HAS_OUTLIERS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_O: tl.constexpr,
    ):
        k, t = program_tile(BLOCK_N)
        j = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
        jm = j < d
        side = k * d + j
        b = tl.load(bits + side, mask=jm, other=0).to(tl.int32)
        s = tl.load(sigma + side, mask=jm, other=0).to(tl.float32)
        m = tl.load(mean + side, mask=jm, other=0).to(tl.float32)
        g = tl.load(gains + b, mask=jm, other=0.0)
        # Component j of vector 0 starts after the stream-block's first bit and the widths of
        # the components before j: those of the column blocks before this program's, then a
        # running sum over its own.
        first = tl.load(base + k) * 8
        for c in range(0, tl.program_id(2) * BLOCK_D, BLOCK_D):
            cc = c + tl.arange(0, BLOCK_D)
            first += tl.sum(tl.load(bits + k * d + cc, mask=cc < d, other=0).to(tl.int64), axis=0)
        start = (first + (tl.cumsum(b, axis=0) - b).to(tl.int64))[None, :]
        start += t.to(tl.int64)[:, None] * tl.load(per_vector + k)
        ok = (t < n)[:, None] & jm[None, :]
        byte = start >> 3
        lo = tl.load(codes + byte, mask=ok, other=0).to(tl.int32)
        hi = tl.load(codes + byte + 1, mask=ok, other=0).to(tl.int32)
        code = ((lo | (hi << 8)) >> (start & 7).to(tl.int32)) & ((1 << b) - 1)[None, :]
        level = tl.load(levels + (b * LEVELS)[None, :] + code, mask=ok, other=0.0)
        y = m[None, :] + (level * s[None, :]) * g[None, :]
        tl.store(out + (k * n + t.to(tl.int64))[:, None] * d + j[None, :], y, mask=ok)
        if HAS_OUTLIERS:  # the tile's outliers in its components, over what was just written
            tl.debug_barrier()
            tile = k * tl.num_programs(1) + tl.program_id(1)
            lo = tl.load(outlier_tiles + tile)
            hi = tl.load(outlier_tiles + tile + 1)
            j0 = tl.program_id(2) * BLOCK_D
            for o0 in range(lo, hi, BLOCK_O):
                o = o0 + tl.arange(0, BLOCK_O)
                om = o < hi
                at = tl.load(outlier_pos + o, mask=om, other=0)
                col = at % d
                om = om & (col >= j0) & (col < j0 + BLOCK_D)
                tl.store(out + at, tl.load(outlier_dec + o, mask=om, other=0.0), mask=om)

    @triton.jit
    def norms_kernel(
        codes,  # uint8 [streams, tokens]: one block stream's norm codes per row
        low,  # float32 [streams]: log2 of its smallest norm
        step,  # float32 [streams]: its log2 step per code
        out,  # float32 [streams, tokens]
        tokens,
        BLOCK: tl.constexpr,
    ):
        s, t = program_tile(BLOCK)
        ok = t < tokens
        code = tl.load(codes + s * tokens + t, mask=ok, other=0).to(tl.float32)
        lg = (code - 1.0) * tl.load(step + s) + tl.load(low + s)
        tl.store(out + s * tokens + t, tl.where(code == 0.0, 0.0, tl.exp2(lg)), mask=ok)
