"""A decode step's softmax and value sums over blocks coded across heads in two Triton kernels,
on a GPU.

Off the CPU, once the keys' logits are scored (``fused_attention.py``), a layer's attention
over blocks coded across heads took about twenty more torch ops per decode step
(``reports/device_op_counts.txt``): the exact tokens' int8 rows decoded, the exact keys and
values concatenated, their logits, the scores joined, scaled and biased, the softmax, the
weights times the values' scales, the sums over the joint coordinates, each head's frame, the
exact values' sums and the output's copy. Each is a launch the host queues one by one, and on
an H100 the host's queueing sets a decode step's pace (``reports/gpu_h100.txt``). Here it is
two launches, split over the coded tokens as flash-decoding splits them:

- ``_partials_kernel``: each program takes a span of the coded tokens for all query rows and
  a slice of the joint coordinates, or one KV head's exact tokens (the sinks, the hot window,
  the new tokens, read where they are held: int8 rows decoded as they load), and writes its
  largest score, its sum of exponentials and its weighted sum; the coded tokens' scales may
  come as their one-byte codes (:class:`ScaleCodes`), decoded as they load;
- ``_combine_kernel``: per KV head, the spans' sums rescaled to the common largest score,
  turned out of the joint coordinates by the head's slice of the value frame, the exact part
  added, divided by the sum of exponentials and written in the layout and dtype attention
  returns.

The arithmetic is float32 (products in IEEE float32, not TF32) in another order than torch's,
so it agrees with :func:`attend_with_torch` to float32 rounding. A query row with every key
masked gets zeros, as the torch path's ``nan_to_num`` gives.

Used on CUDA devices where Triton imports, unless ``KAKEYATURBO_TRITON=0``; its first call on
each device is checked against :func:`attend_with_torch` in float64 (to :data:`TOLERANCE`),
and a kernel that fails or disagrees there is not used again in the process: the torch twin
runs instead. ``tests/gpu/test_fused_joint_attend.py`` runs it in Triton's interpreter on the CPU
and compiles each launch there for sm_90 and sm_80 (``tests/support/triton_launches.py``); its first
GPU run found two errors only the compiler sees (reports/gpu_h100.txt, 43rd session).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..norm_codes import StackedNorms
from .triton_support import CheckedKernel, bf16_bits, tl, triton, within_tolerance

__all__ = [
    "KERNEL",
    "MAX_ROWS",
    "MAX_RUNS",
    "Coded",
    "ScaleCodes",
    "attend",
    "attend_with_torch",
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
    return KERNEL.usable(q.device, lambda: _close(coded, q, keys, values, *args))


def _close(coded: Coded, q, keys, values, bias, scaling, softcap, tq, dtype) -> bool:
    got = attend(coded, q, keys, values, bias, scaling, softcap, tq, torch.float32)
    # The reference in float64: torch's own float32 products may be TF32 where a user has
    # allowed it (torch.set_float32_matmul_precision), which the kernels' must not be taken for.
    wide = Coded(*(None if x is None else x.double() for x in _fields(coded.decoded())))
    runs = (
        [k.double() for k in keys],
        [v if v.dtype is torch.int8 else v.double() for v in values],
    )
    want = attend_with_torch(wide, q.double(), *runs, bias, scaling, softcap, tq, torch.float64)
    return within_tolerance(got, want.float(), TOLERANCE)


def _fields(coded: Coded) -> tuple:
    return coded.logits, coded.key_scales, coded.values, coded.value_scales, coded.frames


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


def attend(
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
    """:func:`attend_with_torch` by the kernels (on the inputs' device; on the CPU only in
    Triton's interpreter): two launches, whatever the runs and the context."""
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
    m_c = torch.empty(b, spans, qr, dtype=f32, device=dev)
    l_c = torch.empty_like(m_c)
    acc_c = torch.empty(b, spans, qr, c, dtype=f32, device=dev)
    m_e = torch.empty(b, h, rows, dtype=f32, device=dev)
    l_e = torch.empty_like(m_e)
    acc_e = torch.empty(b, h, rows, d, dtype=f32, device=dev)
    out = torch.empty(b, tq, h * (rows // tq), d, dtype=dtype, device=dev)
    (k0, v0, n0), (k1, v1, n1), (k2, v2, n2) = runs
    block_q = max(16, triton.next_power_of_2(qr))
    block_r = max(16, triton.next_power_of_2(rows))
    block_d = max(16, triton.next_power_of_2(d))
    _partials_kernel[(b, spans * slices + h)](
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
        m_c,
        l_c,
        acc_c,
        m_e,
        l_e,
        acc_e,
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
    _combine_kernel[(b, h)](
        m_c,
        l_c,
        acc_c,
        m_e,
        l_e,
        acc_e,
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


if triton is not None:

    @triton.jit
    def _scored(
        raw, scaling, softcap, bias_at, ok, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr
    ):
        """Scores as torch makes them: scaled, capped (tanh), biased; -inf outside ``ok``."""
        s = raw * scaling
        if HAS_SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1): what the interpreter and every GPU have.
            s = (1.0 - 2.0 / (tl.exp(2.0 * (s / softcap)) + 1.0)) * softcap
        if HAS_BIAS:
            s += tl.load(bias_at, mask=ok, other=0.0)
        return tl.where(ok, s, float("-inf"))

    @triton.jit
    def _scales(scales, low, step, at, blk, ok, CODES: tl.constexpr):
        """Token scales at ``at`` (``blk``: their blocks' low and step): float32 as given, or
        decoded from their codes as ``fused_decode``'s norm kernel does, ``exp2((code - 1) *
        step + low)``, zero for code 0."""
        # One return of one type: Triton compiles every return, the constexpr branch too.
        if CODES:
            code = tl.load(scales + at, mask=ok, other=0).to(tl.float32)
            lg = (code - 1.0) * tl.load(step + blk, mask=ok, other=0.0)
            lg += tl.load(low + blk, mask=ok, other=0.0)
            x = tl.where(code == 0.0, 0.0, tl.exp2(lg))
        else:
            x = tl.load(scales + at, mask=ok, other=0.0).to(tl.float32)
        return x

    @triton.jit
    def _values_tile(at, jm, dd, dm, D, INT8: tl.constexpr):
        """Exact values from the rows starting at ``at`` as float32: int8 rows decoded
        (``code * scale``, the scale's bfloat16 bits after the ``D`` codes)."""
        x = tl.load(at[:, None] + dd[None, :], mask=jm[:, None] & dm[None, :], other=0)
        x = x.to(tl.float32)
        if INT8:
            lo = tl.load(at + D, mask=jm, other=0).to(tl.int32) & 0xFF
            hi = tl.load(at + D + 1, mask=jm, other=0).to(tl.int32) & 0xFF
            scale = ((hi << 24) | (lo << 16)).to(tl.float32, bitcast=True)
            x = x * scale[:, None]
        return x

    @triton.jit
    def _exact_run(
        acc,
        m,
        total,
        qv,
        rm,
        dd,
        dm,
        k,
        k_sb,
        k_sh,
        k_sn,
        v,
        v_sb,
        v_sh,
        v_sn,
        n,
        col,
        bias_row,
        b,
        head,
        D,
        scaling,
        softcap,
        HAS_BIAS: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        INT8: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """The online softmax's ``acc``, ``m``, ``total`` after a run of ``n`` exact tokens whose
        scores are the bias's columns from ``col``."""
        for n0 in range(0, n, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            jm = j < n
            jj = j.to(tl.int64)
            kt = tl.load(
                k + b * k_sb + head * k_sh + jj[:, None] * k_sn + dd[None, :],
                mask=jm[:, None] & dm[None, :],
                other=0.0,
            ).to(tl.float32)
            raw = tl.dot(qv, tl.trans(kt), input_precision="ieee")
            ok = rm[:, None] & jm[None, :]
            s = _scored(
                raw, scaling, softcap, bias_row + col + j[None, :], ok, HAS_BIAS, HAS_SOFTCAP
            )
            top = tl.maximum(m, tl.max(s, axis=1))
            base = tl.where(top == float("-inf"), 0.0, top)
            p = tl.exp(s - base[:, None])
            alpha = tl.exp(m - base)
            total = total * alpha + tl.sum(p, axis=1)
            at = v + b * v_sb + head * v_sh + jj * v_sn
            vt = _values_tile(at, jm, dd, dm, D, INT8)
            acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
            m = top
        return acc, m, total

    @triton.jit
    def _span_partials(
        logits,
        key_scales,
        key_low,
        key_step,
        values,
        value_scales,
        value_low,
        value_step,
        bias,
        bias_sb,
        bias_sq,
        m_c,
        l_c,
        acc_c,
        b,
        pid,
        T,
        C,
        H,
        ROWS,
        SPAN,
        SPANS,
        SLICES,
        scaling,
        softcap,
        TOKENS,
        HAS_KEY_SCALES: tl.constexpr,
        HAS_VALUE_SCALES: tl.constexpr,
        KEY_CODES: tl.constexpr,
        VALUE_CODES: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_Q: tl.constexpr,
    ):
        """A partials program over a span of the coded tokens, for all query rows and a slice
        of the joint coordinates."""
        Q = H * ROWS
        span = pid // SLICES
        cc = (pid % SLICES) * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = cc < C
        r = tl.arange(0, BLOCK_Q)
        rm = r < Q
        head = (r // ROWS).to(tl.int64)
        lo = span * SPAN
        hi = tl.minimum(lo + SPAN, T)
        row_logits = logits + (b * Q + r)[:, None] * T
        row_bias = bias + b * bias_sb + r[:, None] * bias_sq
        scales_at = (b * H + head)[:, None] * T
        blocks_at = (b * H + head)[:, None] * (T // TOKENS)
        m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        for t0 in range(lo, hi, BLOCK_T):  # the span's largest score
            t = t0 + tl.arange(0, BLOCK_T)
            # Each token's scale, and its block's low and step for scales as codes.
            at, blk = scales_at + t[None, :], blocks_at + (t // TOKENS)[None, :]
            ok = rm[:, None] & (t < hi)[None, :]
            raw = tl.load(row_logits + t[None, :], mask=ok, other=0.0)
            if HAS_KEY_SCALES:
                raw *= _scales(key_scales, key_low, key_step, at, blk, ok, KEY_CODES)
            s = _scored(raw, scaling, softcap, row_bias + t[None, :], ok, HAS_BIAS, HAS_SOFTCAP)
            m = tl.maximum(m, tl.max(s, axis=1))
        base = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros([BLOCK_Q], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q, BLOCK_C], dtype=tl.float32)
        for t0 in range(lo, hi, BLOCK_T):  # its exponentials and weighted sums
            t = t0 + tl.arange(0, BLOCK_T)
            at, blk = scales_at + t[None, :], blocks_at + (t // TOKENS)[None, :]
            tm = t < hi
            ok = rm[:, None] & tm[None, :]
            raw = tl.load(row_logits + t[None, :], mask=ok, other=0.0)
            if HAS_KEY_SCALES:
                raw *= _scales(key_scales, key_low, key_step, at, blk, ok, KEY_CODES)
            s = _scored(raw, scaling, softcap, row_bias + t[None, :], ok, HAS_BIAS, HAS_SOFTCAP)
            p = tl.exp(s - base[:, None])
            total += tl.sum(p, axis=1)
            if HAS_VALUE_SCALES:
                p *= _scales(value_scales, value_low, value_step, at, blk, ok, VALUE_CODES)
            yv = tl.load(
                values + (b * T + t.to(tl.int64))[:, None] * C + cc[None, :],
                mask=tm[:, None] & cm[None, :],
                other=0.0,
            )
            acc += tl.dot(p, yv, input_precision="ieee")
        at = (b * SPANS + span) * Q + r
        tl.store(
            acc_c + at.to(tl.int64)[:, None] * C + cc[None, :],
            acc,
            mask=rm[:, None] & cm[None, :],
        )
        if pid % SLICES == 0:
            tl.store(m_c + at, m, mask=rm)
            tl.store(l_c + at, total, mask=rm)

    @triton.jit
    def _exact_partials(
        q,
        q_sb,
        q_sh,
        q_sr,
        k0,
        k0_sb,
        k0_sh,
        k0_sn,
        v0,
        v0_sb,
        v0_sh,
        v0_sn,
        n0,
        k1,
        k1_sb,
        k1_sh,
        k1_sn,
        v1,
        v1_sb,
        v1_sh,
        v1_sn,
        n1,
        k2,
        k2_sb,
        k2_sh,
        k2_sn,
        v2,
        v2_sb,
        v2_sh,
        v2_sn,
        n2,
        bias,
        bias_sb,
        bias_sq,
        m_e,
        l_e,
        acc_e,
        b,
        head,
        T,
        H,
        ROWS,
        D,
        scaling,
        softcap,
        HAS_BIAS: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        INT8_0: tl.constexpr,
        INT8_1: tl.constexpr,
        INT8_2: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """A partials program over one KV head's exact tokens: the sinks, the hot window, the
        new tokens."""
        rr = tl.arange(0, BLOCK_R)
        rm = rr < ROWS
        dd = tl.arange(0, BLOCK_D)
        dm = dd < D
        qv = tl.load(
            q + b * q_sb + head * q_sh + rr[:, None] * q_sr + dd[None, :],
            mask=rm[:, None] & dm[None, :],
            other=0.0,
        ).to(tl.float32)
        bias_row = bias + b * bias_sb + (head * ROWS + rr)[:, None] * bias_sq
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        acc, m, total = _exact_run(
            acc, m, total, qv, rm, dd, dm, k0, k0_sb, k0_sh, k0_sn, v0, v0_sb, v0_sh, v0_sn,
            n0, T, bias_row, b, head, D, scaling, softcap, HAS_BIAS, HAS_SOFTCAP, INT8_0,
            BLOCK_N,
        )  # fmt: skip
        acc, m, total = _exact_run(
            acc, m, total, qv, rm, dd, dm, k1, k1_sb, k1_sh, k1_sn, v1, v1_sb, v1_sh, v1_sn,
            n1, T + n0, bias_row, b, head, D, scaling, softcap, HAS_BIAS, HAS_SOFTCAP, INT8_1,
            BLOCK_N,
        )  # fmt: skip
        acc, m, total = _exact_run(
            acc, m, total, qv, rm, dd, dm, k2, k2_sb, k2_sh, k2_sn, v2, v2_sb, v2_sh, v2_sn,
            n2, T + n0 + n1, bias_row, b, head, D, scaling, softcap, HAS_BIAS, HAS_SOFTCAP,
            INT8_2, BLOCK_N,
        )  # fmt: skip
        at = (b * H + head) * ROWS + rr
        tl.store(acc_e + at[:, None] * D + dd[None, :], acc, mask=rm[:, None] & dm[None, :])
        tl.store(m_e + at, m, mask=rm)
        tl.store(l_e + at, total, mask=rm)

    @triton.jit
    def _partials_kernel(
        logits,  # float32 [B, Q, T]: the coded keys' logits (Q = H * ROWS query rows)
        key_scales,  # float32 [B, H, T], or uint8 codes (KEY_CODES)
        key_low,  # float32 [B, H, T / TOKENS]: with codes, each block's log2 low and step
        key_step,
        values,  # float32 [B, T, C]: the coded values' joint coordinates
        value_scales,  # as the key scales
        value_low,
        value_step,
        q,  # [B, H, ROWS, D] the queries (exact keys' logits)
        q_sb,
        q_sh,
        q_sr,
        k0,
        k0_sb,
        k0_sh,
        k0_sn,
        v0,
        v0_sb,
        v0_sh,
        v0_sn,
        n0,
        k1,
        k1_sb,
        k1_sh,
        k1_sn,
        v1,
        v1_sb,
        v1_sh,
        v1_sn,
        n1,
        k2,
        k2_sb,
        k2_sh,
        k2_sn,
        v2,
        v2_sb,
        v2_sh,
        v2_sn,
        n2,
        bias,  # float32 [B or 1, 1, Q, T + n0 + n1 + n2]
        bias_sb,
        bias_sq,
        m_c,  # float32 [B, SPANS, Q]: each span's largest score,
        l_c,  # its sum of exponentials,
        acc_c,  # [B, SPANS, Q, C] and its weighted sum of the coordinates
        m_e,  # float32 [B, H, ROWS]: the same of each head's exact tokens
        l_e,
        acc_e,  # [B, H, ROWS, D]
        T,
        C,
        H,
        ROWS,
        D,
        SPAN,
        SPANS,
        SLICES,
        scaling,
        softcap,
        TOKENS,  # tokens per block of the scale codes
        HAS_KEY_SCALES: tl.constexpr,
        HAS_VALUE_SCALES: tl.constexpr,
        KEY_CODES: tl.constexpr,
        VALUE_CODES: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        INT8_0: tl.constexpr,
        INT8_1: tl.constexpr,
        INT8_2: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        pid = tl.program_id(1)
        # Each branch is a function of its own: Triton wants a name assigned in both branches
        # of a runtime `if` to have one type, and the two programs' tiles differ.
        if pid < SPANS * SLICES:  # a span of the coded tokens, a slice of the coordinates
            _span_partials(
                logits, key_scales, key_low, key_step, values, value_scales, value_low,
                value_step, bias, bias_sb, bias_sq, m_c, l_c, acc_c, b, pid, T, C, H, ROWS, SPAN,
                SPANS, SLICES, scaling, softcap, TOKENS, HAS_KEY_SCALES, HAS_VALUE_SCALES,
                KEY_CODES, VALUE_CODES, HAS_BIAS, HAS_SOFTCAP, BLOCK_T, BLOCK_C, BLOCK_Q,
            )  # fmt: skip
        else:  # one KV head's exact tokens
            _exact_partials(
                q, q_sb, q_sh, q_sr, k0, k0_sb, k0_sh, k0_sn, v0, v0_sb, v0_sh, v0_sn, n0, k1,
                k1_sb, k1_sh, k1_sn, v1, v1_sb, v1_sh, v1_sn, n1, k2, k2_sb, k2_sh, k2_sn, v2,
                v2_sb, v2_sh, v2_sn, n2, bias, bias_sb, bias_sq, m_e, l_e, acc_e, b,
                (pid - SPANS * SLICES).to(tl.int64), T, H, ROWS, D, scaling, softcap, HAS_BIAS,
                HAS_SOFTCAP, INT8_0, INT8_1, INT8_2, BLOCK_N, BLOCK_R, BLOCK_D,
            )  # fmt: skip

    @triton.jit
    def _combine_kernel(
        m_c,
        l_c,
        acc_c,
        m_e,
        l_e,
        acc_e,
        frames,  # float32 [H, C, D]: each head's slice of the joint value frame
        out,  # [B, TQ, H * G, D] attention's output, in its dtype
        SPANS,
        C,
        H,
        ROWS,
        D,
        TQ,
        OUT_BF16: tl.constexpr,  # out is bfloat16's bits as int16
        BLOCK_C: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        rr = tl.arange(0, BLOCK_R)
        rm = rr < ROWS
        dd = tl.arange(0, BLOCK_D)
        dm = dd < D
        Q = H * ROWS
        qr = head * ROWS + rr  # the head's rows among all query rows
        exact = (b * H + head) * ROWS + rr
        top = tl.load(m_e + exact, mask=rm, other=float("-inf"))
        for span in range(SPANS):
            top = tl.maximum(
                top, tl.load(m_c + (b * SPANS + span) * Q + qr, mask=rm, other=float("-inf"))
            )
        base = tl.where(top == float("-inf"), 0.0, top)
        w_e = tl.exp(tl.load(m_e + exact, mask=rm, other=float("-inf")) - base)
        total = w_e * tl.load(l_e + exact, mask=rm, other=0.0)
        for span in range(SPANS):
            at = (b * SPANS + span) * Q + qr
            w = tl.exp(tl.load(m_c + at, mask=rm, other=float("-inf")) - base)
            total += w * tl.load(l_c + at, mask=rm, other=0.0)
        res = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        ci = tl.arange(0, BLOCK_C)
        for c0 in range(0, C, BLOCK_C):
            cc = c0 + ci
            cm = cc < C
            sums = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
            for span in range(SPANS):
                at = (b * SPANS + span) * Q + qr
                w = tl.exp(tl.load(m_c + at, mask=rm, other=float("-inf")) - base)
                part = tl.load(
                    acc_c + at[:, None] * C + cc[None, :], mask=rm[:, None] & cm[None, :], other=0.0
                )
                sums += w[:, None] * part
            f = tl.load(
                frames + (head * C + cc.to(tl.int64))[:, None] * D + dd[None, :],
                mask=cm[:, None] & dm[None, :],
                other=0.0,
            )
            res += tl.dot(sums, f, input_precision="ieee")
        ex = tl.load(
            acc_e + exact[:, None] * D + dd[None, :], mask=rm[:, None] & dm[None, :], other=0.0
        )
        res += w_e[:, None] * ex
        res = tl.where(total[:, None] > 0.0, res / tl.where(total > 0.0, total, 1.0)[:, None], 0.0)
        # Row j * TQ + t is query head head * G + j at token t.
        g = ROWS // TQ
        at = ((b * TQ + rr % TQ) * (H * g) + head * g + rr // TQ) * D
        if OUT_BF16:  # rounded by the bits, as torch rounds (the interpreter truncates)
            res = bf16_bits(res).to(tl.uint16).to(tl.int16, bitcast=True)
        tl.store(
            out + at[:, None] + dd[None, :],
            res.to(out.dtype.element_ty),
            mask=rm[:, None] & dm[None, :],
        )
