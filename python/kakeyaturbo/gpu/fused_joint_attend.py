"""A decode step's softmax and value sums over blocks coded across heads in two Triton kernels,
on a GPU (the kernels themselves: ``joint_attend_kernels.py``).

Off the CPU, once the keys' logits are scored (``fused_attention.py``), a layer's attention
over blocks coded across heads takes about twenty more torch ops per decode step
(``reports/device_op_counts.txt``): the exact tokens' int8 rows decoded, the exact keys and
values concatenated, their logits, the scores joined, scaled and biased, the softmax, the
weights times the values' scales, the sums over the joint coordinates, each head's frame, the
exact values' sums and the output's copy. Each is a launch the host queues one by one, and on
an H100 the host's queueing sets a decode step's pace (``reports/gpu_h100.txt``). Here it is
two launches, split over the coded tokens as flash-decoding splits them: partial sums per span
of coded tokens and per KV head's exact tokens, then their combination per KV head. The coded
tokens' scales may come as their one-byte codes (:class:`ScaleCodes`), decoded as they load.

The arithmetic is float32 (products in IEEE float32, not TF32) in another order than torch's,
so it agrees with :func:`attend_with_torch` to float32 rounding. A query row with every key
masked gets zeros, as the torch path's ``nan_to_num`` gives.

Used on CUDA devices where Triton imports, unless ``KAKEYATURBO_TRITON=0``; its first call on
each device is checked against :func:`attend_with_torch` in float64 (to :data:`TOLERANCE`),
and a kernel that fails or disagrees there is not used again in the process: the torch twin
runs instead. ``tests/gpu/test_fused_joint_attend.py`` runs it in Triton's interpreter on the CPU
and compiles each launch there for sm_90 and sm_80 (``tests/support/triton_launches.py``), which
catches what only the compiler refuses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..norm_codes import StackedNorms
from . import joint_attend_kernels
from .triton_support import CheckedKernel, triton, within_tolerance

__all__ = [
    "KERNEL",
    "MAX_ROWS",
    "MAX_RUNS",
    "Coded",
    "ScaleCodes",
    "attend",
    "attend_with_torch",
    "close",
    "usable",
]

#: The most query rows (query heads x query tokens) the kernels take: a decode step's.
MAX_ROWS = 64
#: The most runs of exact tokens (sinks, hot window, new tokens) the kernels read.
MAX_RUNS = 3
#: The widest head the kernels take.
MAX_HEAD_DIM = 256
#: Coded tokens per tile, exact tokens per tile, joint coordinates per program.
BLOCK_T = 64
BLOCK_N = 32
BLOCK_C = 64
#: Coded tokens per program at least, and the most programs per batch row over the coded
#: tokens (times the coordinate slices): enough to fill a GPU's cores at long contexts.
MIN_SPAN = 256
MAX_SPANS = 32
#: The kernels' output may differ from torch's by this much relative to its largest entry
#: (float32 sums in another order: about 1e-6 here).
TOLERANCE = 1e-4

#: The kernels' standing per device (their first call there is checked against torch).
KERNEL = CheckedKernel("joint attention")


@dataclass(frozen=True)
class ScaleCodes:
    """Each head's token scales as the blocks hold them, one byte a token
    (``norm_codes.StackedNorms``, one run of equally long blocks): the kernels decode them as
    they load them, where decoding them first took a launch per layer and stream."""

    codes: torch.Tensor  # uint8 [B, H, blocks, tokens]
    low: torch.Tensor  # float32 [B, H, blocks]: log2 of each block stream's smallest scale
    step: torch.Tensor  # float32 [B, H, blocks]: its log2 step per code

    def decode(self) -> torch.Tensor:
        """``[B, H, T]`` float32, as the blocks' norms decode (``StackedNorms.decode``: on a
        GPU by the norm kernel, where it passed its check)."""
        return StackedNorms([(self.codes, self.low, self.step)]).decode()


@dataclass(frozen=True)
class Coded:
    """What attention reads of a layer's blocks coded across heads (``H`` KV heads, ``rows``
    query rows each, ``T`` coded tokens, ``C = H*D`` joint coordinates). Token scales are
    ``[B, H, T]`` tensors or their codes."""

    logits: torch.Tensor  # [B, H*rows, T] the keys' logits, before their scales
    key_scales: torch.Tensor | ScaleCodes | None  # each head's key scale (token norms), or None
    values: torch.Tensor  # [B, T, C] the values' joint coordinates
    value_scales: torch.Tensor | ScaleCodes | None
    frames: torch.Tensor  # [H, C, D] each head's slice of the joint value frame

    def decoded(self) -> Coded:
        """The same with the scales decoded."""
        ks, vs = (
            x.decode() if isinstance(x, ScaleCodes) else x
            for x in (self.key_scales, self.value_scales)
        )
        return Coded(self.logits, ks, self.values, vs, self.frames)

    def fields(self) -> tuple:
        """The fields in their order (to rebuild one with each field changed)."""
        return self.logits, self.key_scales, self.values, self.value_scales, self.frames


def usable(coded: Coded, q: torch.Tensor, keys: list, values: list, *args) -> bool:
    """Whether :func:`attend` (arguments as there) runs the kernels for these inputs: a decode
    step's few query rows, at most :data:`MAX_RUNS` exact runs as the kernels read them, on a
    CUDA device where the kernels have passed their check (run on these inputs if they have
    not been checked there yet)."""
    b, h, rows, d = q.shape
    fits = h * rows <= MAX_ROWS and d <= MAX_HEAD_DIM and 0 < len(keys) <= MAX_RUNS
    if not fits or len(values) != len(keys):
        return False
    if any(not k.is_floating_point() for k in keys):
        return False
    if any(not (v.is_floating_point() or v.dtype is torch.int8) for v in values):
        return False
    return KERNEL.usable(q.device, lambda: close(coded, q, keys, values, *args))


def close(coded: Coded, q, keys, values, bias, scaling, softcap, tq, dtype) -> bool:
    """Whether :func:`attend` agrees with :func:`attend_with_torch` in float64 on these inputs
    (the check :func:`usable` runs once per device)."""
    got = attend(coded, q, keys, values, bias, scaling, softcap, tq, torch.float32)
    # The reference in float64: torch's own float32 products may be TF32 where a user has
    # allowed it (torch.set_float32_matmul_precision), which the kernels' must not be taken for.
    wide = Coded(*(None if x is None else x.double() for x in coded.decoded().fields()))
    runs = (
        [k.double() for k in keys],
        [v if v.dtype is torch.int8 else v.double() for v in values],
    )
    want = attend_with_torch(wide, q.double(), *runs, bias, scaling, softcap, tq, torch.float64)
    return within_tolerance(got, want.float(), TOLERANCE)


def _joined(runs: list, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Exact runs ``[B, H, n_i, D]`` in one ``dtype`` tensor, int8 rows decoded: one copy for
    the rest (``cat`` promotes a narrower dtype). (``hf/int8_rows.decode``'s arithmetic, not
    imported: hf imports this module, and the package has no import cycles.)"""
    floats = []
    for run in runs:
        if run.dtype is torch.int8:
            run = run[..., :d] * run[..., d:].contiguous().view(torch.bfloat16).to(dtype)
        floats.append(run)
    return torch.cat(floats, dim=-2).to(dtype)


def attend_with_torch(
    coded: Coded,
    q: torch.Tensor,
    keys: list,
    values: list,
    bias: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
    tq: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Attention's output ``[B, Tq, H*g, D]`` in ``dtype`` of the queries ``q`` ``[B, H, rows,
    D]`` (row ``j*Tq + t``: query head ``h*g + j`` at token ``t``) over the coded tokens and
    the exact runs ``keys`` / ``values`` (``[B, H, n_i, D]`` in token order after the coded
    ones; values may be int8 rows) with the additive ``bias`` ``[B or 1, 1, H*rows, T + n]``
    (None: none), in torch ops, in the dtype of ``coded.logits``."""
    b, h, rows, d = q.shape
    coded = coded.decoded()
    work, t = coded.logits.dtype, coded.logits.shape[-1]
    logits = coded.logits.view(b, h, rows, t)
    if coded.key_scales is not None:
        logits = logits * coded.key_scales[:, :, None]
    k, v = _joined(keys, d, work), _joined(values, d, work)
    scores = torch.cat((logits, q.to(work) @ k.transpose(-1, -2)), dim=-1) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias.view(bias.shape[0], h, rows, -1)
    # A query row with every key masked (a padded row) gets zeros, not NaN.
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    weights = probs[..., :t]
    if coded.value_scales is not None:
        weights = weights * coded.value_scales[:, :, None]
    sums = weights.reshape(b, h * rows, t) @ coded.values.to(work)
    out = sums.view(b, h, rows, -1) @ coded.frames.to(work) + probs[..., t:] @ v
    g = rows // tq
    return (
        out.view(b, h * g, tq, d).transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
    )


def attend(coded, q, keys, values, bias, scaling, softcap, tq, dtype) -> torch.Tensor:
    """:func:`attend_with_torch` by the kernels, arguments as there (on the inputs' device; on
    the CPU only in Triton's interpreter): two launches, whatever the runs and the context."""
    if triton is None:
        raise RuntimeError("the fused joint attention needs Triton, which is not installed")
    b, h, rows, d = q.shape
    _, t, c = coded.values.shape
    if coded.logits.shape != (b, h * rows, t) or coded.frames.shape != (h, c, d) or rows % tq:
        raise ValueError(
            f"joint attention: logits {tuple(coded.logits.shape)}, values "
            f"{tuple(coded.values.shape)}, frames {tuple(coded.frames.shape)}, queries "
            f"{tuple(q.shape)} and {tq} query tokens do not fit"
        )
    if not 0 < len(keys) == len(values) <= MAX_RUNS:
        raise ValueError(f"joint attention: {len(keys)} key and {len(values)} value runs")
    dev, f32 = q.device, torch.float32
    logits, values_c, frames = (
        x.to(f32).contiguous() for x in (coded.logits, coded.values, coded.frames)
    )
    dummy = logits  # read by no program where a tensor is absent
    (ks, k_low, k_step, k_tokens), (vs, v_low, v_step, v_tokens) = (
        _scale_args(x, b, h, t, dummy) for x in (coded.key_scales, coded.value_scales)
    )
    if k_tokens and v_tokens and k_tokens != v_tokens:
        raise ValueError("joint attention: the key and value scales' blocks differ")
    q = q if q.stride(-1) == 1 else q.contiguous()
    runs = [_run(k, v, b, h, d) for k, v in zip(keys, values)]
    n_exact = sum(n for *_, n in runs)
    runs += [runs[0][:2] + (0,)] * (MAX_RUNS - len(runs))  # absent runs: no tokens to read
    if bias is not None:
        if bias.shape[1:] != (1, h * rows, t + n_exact) or bias.shape[0] not in (1, b):
            raise ValueError(f"joint attention: bias {tuple(bias.shape)} does not fit")
        bias = bias.to(f32)  # read by its strides: the layers' shared bias is an expanded view
        bias = bias if bias.stride(-1) == 1 else bias.contiguous()
    span = max(MIN_SPAN, triton.cdiv(triton.cdiv(max(t, 1), MAX_SPANS), BLOCK_T) * BLOCK_T)
    spans, slices = triton.cdiv(max(t, 1), span), triton.cdiv(c, BLOCK_C)
    qr = h * rows
    # Each span's largest score, sum of exponentials and weighted sum; each head's exact part's.
    m_c = torch.empty(b, spans, qr, dtype=f32, device=dev)
    coded_part = (m_c, torch.empty_like(m_c), torch.empty(b, spans, qr, c, dtype=f32, device=dev))
    m_e = torch.empty(b, h, rows, dtype=f32, device=dev)
    exact_part = (m_e, torch.empty_like(m_e), torch.empty(b, h, rows, d, dtype=f32, device=dev))
    out = torch.empty(b, tq, h * (rows // tq), d, dtype=dtype, device=dev)
    (k0, v0, n0), (k1, v1, n1), (k2, v2, n2) = runs
    block_q = max(16, triton.next_power_of_2(qr))
    block_r = max(16, triton.next_power_of_2(rows))
    block_d = max(16, triton.next_power_of_2(d))
    joint_attend_kernels.partials_kernel[(b, spans * slices + h)](
        logits,
        dummy if ks is None else ks,
        k_low,
        k_step,
        values_c,
        dummy if vs is None else vs,
        v_low,
        v_step,
        q,
        *q.stride()[:3],
        *k0,
        *v0,
        n0,
        *k1,
        *v1,
        n1,
        *k2,
        *v2,
        n2,
        dummy if bias is None else bias,
        0 if bias is None or bias.shape[0] == 1 else bias.stride(0),
        0 if bias is None else bias.stride(2),
        *coded_part,
        *exact_part,
        t,
        c,
        h,
        rows,
        d,
        span,
        spans,
        slices,
        float(scaling),
        1.0 if softcap is None else float(softcap),
        max(k_tokens, v_tokens, 1),
        HAS_KEY_SCALES=ks is not None,
        HAS_VALUE_SCALES=vs is not None,
        KEY_CODES=k_tokens > 0,
        VALUE_CODES=v_tokens > 0,
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=softcap is not None,
        INT8_0=v0[0].dtype is torch.int8,
        INT8_1=v1[0].dtype is torch.int8,
        INT8_2=v2[0].dtype is torch.int8,
        BLOCK_T=BLOCK_T,
        BLOCK_N=BLOCK_N,
        BLOCK_C=BLOCK_C,
        BLOCK_Q=block_q,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
    )
    joint_attend_kernels.combine_kernel[(b, h)](
        *exact_part,
        *coded_part,
        frames,
        out.view(torch.int16) if dtype is torch.bfloat16 else out,
        spans,
        c,
        h,
        rows,
        d,
        tq,
        OUT_BF16=dtype is torch.bfloat16,
        BLOCK_C=BLOCK_C,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
    )
    return out


def _scale_args(x, b: int, h: int, t: int, dummy: torch.Tensor) -> tuple:
    """Token scales as the kernel reads them: ``(scales or codes, low, step, tokens per
    block)``: a ``[B, H, T]`` tensor (``tokens`` 0), or :class:`ScaleCodes`, or None."""
    if not isinstance(x, ScaleCodes):
        return (None if x is None else x.to(torch.float32).contiguous()), dummy, dummy, 0
    blocks, tokens = x.codes.shape[-2:]
    fits = x.codes.shape == (b, h, blocks, tokens) and blocks * tokens == t
    if not fits or x.low.shape != (b, h, blocks) or x.step.shape != (b, h, blocks):
        raise ValueError(
            f"joint attention: scale codes {tuple(x.codes.shape)} do not fit {b} rows of {h} "
            f"heads over {t} tokens"
        )
    low, step = (y.to(torch.float32).contiguous() for y in (x.low, x.step))
    return x.codes.contiguous(), low, step, tokens


def _run(k: torch.Tensor, v: torch.Tensor, b: int, h: int, d: int) -> tuple:
    """An exact run as the kernel reads it: ``((keys, 3 strides), (values, 3 strides), n)``,
    the tensors where they are (a view of the sinks' held layout is read in place)."""
    n = k.shape[-2]
    wide = d + 2 if v.dtype is torch.int8 else d
    if k.shape != (b, h, n, d) or v.shape != (b, h, n, wide):
        raise ValueError(
            f"joint attention: an exact run of keys {tuple(k.shape)} and values "
            f"{tuple(v.shape)} does not fit {b} rows of {h} heads of {d} channels"
        )
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    return (k, *k.stride()[:3]), (v, *v.stride()[:3]), n
