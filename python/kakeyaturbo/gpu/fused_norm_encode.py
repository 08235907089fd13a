"""A Triton kernel that codes token norms on a GPU: ``norm_codes.StackedNorms.encoded`` in one
launch.

A flush on the device codes the norms of its layers' blocks, the token norms or the heads'
scales, by :func:`norm_codes.encode_norms` and the log2 of its bounds: about 18 small torch ops
per call, each a launch the host queues (540 of a 4k prefill's 2,520 cache ops on SmolLM2 with
the default flush, ``reports/device_op_counts.txt``). The kernel does a block
stream's whole coding in one program: its smallest nonzero and largest norm, the bounds rounded
to float16 as the decoder reads them, their log2 and step, and each token's code, the torch ops'
float32 operations in their order (divisions IEEE-rounded, ties of the rounding to even).

Its log2 is Triton's, which on a GPU need not round as torch's does, so its first call on each
device is checked against the torch ops to a tolerance (:func:`close`): every code within one
of theirs (a log2 an ulp away can move a token across a half step), zeros where theirs are, the
bounds' logs to :data:`TOLERANCE`. A kernel that fails or disagrees there is dropped
(``_triton.CheckedKernel``) and the torch ops code instead. ``tests/gpu/test_fused_norm_encode.py``
runs it in Triton's interpreter on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .triton_support import CheckedKernel, round_half_even, tl, triton, within_tolerance

__all__ = ["KERNEL", "TOLERANCE", "close", "encode", "usable"]

#: The kernel's standing per device (its first call there is checked against the torch ops).
KERNEL = CheckedKernel("norm encoder")
#: How far the bounds' log2 and step may be from torch's (relative to their largest).
TOLERANCE = 1e-5
#: Codes 1..STEPS + 1 span a stream's [smallest, largest] norm (``norm_codes.STEPS``).
STEPS = 254
_HALF_TINY = float(torch.finfo(torch.float16).smallest_normal) * 2.0**-10
#: The most tokens a block stream may have (one program holds them all).
MAX_TOKENS = 4096

Coded = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (codes, log2 low, step)


def usable(
    norms: torch.Tensor,
    tokens: int,
    with_torch: Callable[[], Coded],
    divisor: torch.Tensor | None = None,
) -> bool:
    """Whether :func:`encode` codes ``norms`` (arguments as there): on a CUDA device, with
    Triton, not disabled, a block of at most :data:`MAX_TOKENS`, and checked there against
    ``with_torch()`` (the same norms coded by the torch ops)."""
    if tokens > MAX_TOKENS:
        return False
    check = lambda: close(encode(norms, tokens, divisor), with_torch())  # noqa: E731
    return KERNEL.usable(norms.device, check)


def close(got: Coded, want: Coded) -> bool:
    """Whether the kernel's ``got`` codes the norms as the torch ops' ``want`` (both
    ``(codes, log2 low, step)``) do, to the tolerance a log2's rounding leaves."""
    (codes, low, step), (codes_t, low_t, step_t) = got, want
    if codes.dtype != codes_t.dtype or codes.shape != codes_t.shape:
        return False
    if not torch.equal(codes == 0, codes_t == 0):
        return False
    if bool(((codes.int() - codes_t.int()).abs() > 1).any()):
        return False
    return within_tolerance(low, low_t, TOLERANCE) and within_tolerance(step, step_t, TOLERANCE)


def encode(norms: torch.Tensor, tokens: int, divisor: torch.Tensor | None = None) -> Coded:
    """``norms`` ``[R, H, T]`` (float16 or float32, nonnegative, finite, within float16; any
    strides), over ``divisor`` (float32 ``[R, H, T]``, any strides) where given as
    ``norm_codes.scaled_norms`` divides, coded in blocks of ``tokens`` (``T`` a multiple) by
    the kernel: the codes ``[R, H, T // tokens, tokens]`` uint8 and each block stream's log2 of
    its smallest norm and step ``[R, H, T // tokens]`` float32, as ``StackedNorms.encoded``
    holds them."""
    if triton is None:
        raise RuntimeError("the fused norm encoder needs Triton, which is not installed")
    r, h, t = norms.shape
    blocks = t // tokens
    dev = norms.device
    codes = torch.empty(r, h, blocks, tokens, dtype=torch.uint8, device=dev)
    low = torch.empty(r, h, blocks, dtype=torch.float32, device=dev)
    step = torch.empty(r, h, blocks, dtype=torch.float32, device=dev)
    if codes.numel():
        over = norms if divisor is None else divisor  # (read only where given)
        norm_codes_kernel[(r * h, blocks)](
            norms,
            over,
            codes,
            low,
            step,
            h,
            blocks,
            tokens,
            *norms.stride(),
            *over.stride(),
            HAS_DIVISOR=divisor is not None,
            BLOCK=triton.next_power_of_2(tokens),
            enable_fp_fusion=False,  # each float32 step rounded as torch's are
        )
    return codes, low, step


if triton is not None:
    _TINY = tl.constexpr(_HALF_TINY)
    _STEPS = tl.constexpr(float(STEPS))
    _BIG = tl.constexpr(float(torch.finfo(torch.float32).max))
    _HALF_MAX = tl.constexpr(float(torch.finfo(torch.float16).max))

    @triton.jit
    def norm_codes_kernel(
        norms,  # [R, H, T] float16 or float32, strides (sr, sh, st)
        divisor,  # [R, H, T] float32, strides (dr, dh, dt): norms over it (HAS_DIVISOR)
        codes,  # uint8 [R * H * blocks, tokens]
        low,  # float32 [R * H * blocks]: log2 of each block stream's smallest nonzero norm
        step,  # float32 [R * H * blocks]: its log2 step per code
        heads,
        blocks,
        tokens,
        sr,
        sh,
        st,
        dr,
        dh,
        dt,
        HAS_DIVISOR: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        stream = tl.program_id(0).to(tl.int64)  # a batch row's head
        j = tl.program_id(1).to(tl.int64)  # its block
        t = tl.arange(0, BLOCK)
        ok = t < tokens
        at = (stream // heads) * sr + (stream % heads) * sh + (j * tokens + t) * st
        n = tl.load(norms + at, mask=ok, other=0.0).to(tl.float32)
        if HAS_DIVISOR:  # a head's scale: float16, the divisor at least 1e-3 (scaled_norms)
            at = (stream // heads) * dr + (stream % heads) * dh + (j * tokens + t) * dt
            den = tl.maximum(tl.load(divisor + at, mask=ok, other=1.0), 1e-3)
            n = tl.minimum(tl.math.div_rn(n, den), _HALF_MAX).to(tl.float16).to(tl.float32)
        real = (n > 0.0) & ok
        lo = tl.min(tl.where(real, n, _BIG), axis=0)
        hi = tl.max(tl.where(ok, n, 0.0), axis=0)
        empty = lo == _BIG  # an all-zero stream: any positive bounds decode nothing
        lo = tl.where(empty, 1.0, lo)
        hi = tl.where(empty, 1.0, hi)
        # The bounds as the decoder reads them: float16, at least its smallest subnormal.
        lo = tl.maximum(lo.to(tl.float16).to(tl.float32), _TINY)
        hi = tl.maximum(hi.to(tl.float16).to(tl.float32), _TINY)
        lg_lo = tl.log2(lo)
        per = tl.math.div_rn(tl.log2(hi) - lg_lo, _STEPS)
        rel = tl.log2(tl.maximum(n, _TINY)) - lg_lo
        pos = tl.where(per > 0.0, tl.math.div_rn(rel, tl.where(per > 0.0, per, 1.0)), 0.0)
        # Held within the rounding's range first: any position past it codes as its end.
        pos = tl.minimum(tl.maximum(pos, -2.0), _STEPS + 2.0)
        code = tl.minimum(tl.maximum(round_half_even(pos) + 1.0, 1.0), 255.0)
        code = tl.where(real, code, 0.0)
        out = stream * blocks + j
        tl.store(codes + out * tokens + t, code.to(tl.uint8), mask=ok)
        tl.store(low + out, lg_lo)
        tl.store(step + out, per)
