"""The logits of keys coded across heads in one Triton kernel, on a GPU.

Off the CPU, attention over blocks coded across heads (``hf/coded_attention.py``) took a
layer's decoded coordinates ``y`` to each head's pre-RoPE keys (a product with the joint
frame, a reshape, each head's inverse transform), turned them by RoPE over halves and scored
them against the queries: about ten torch ops per layer and step, each a kernel launch the
host queues one by one, and a dense copy of the layer's keys written and read back. On an H100
the host's queueing, not the device's work, sets a decode step's pace (``reports/gpu_h100.txt``).
This kernel does it in one launch: each program takes a tile of tokens, multiplies their
coordinates by the frame (the bundle's joint frame, its columns in the order where RoPE pairs
are ``(i, i + P)`` across all heads), turns the pairs by the tokens' angles and takes the dot
with every query row, never writing the keys. The arithmetic is float32 throughout (products
in IEEE float32, not TF32), in another order of sums than torch's, so it agrees with
:func:`joint_key_logits_with_torch` to float32 rounding, not bit for bit.

Used on CUDA devices where Triton imports, unless ``KAKEYATURBO_TRITON=0``; its first call on
each device is checked against :func:`joint_key_logits_with_torch` in float64 (to
:data:`TOLERANCE`), and a kernel that fails or disagrees there is not used again in the process.
``tests/gpu/test_fused_attention.py`` runs it in Triton's interpreter on the CPU.
"""

from __future__ import annotations

import torch

from .triton_support import CheckedKernel, program_tile, tl, triton, within_tolerance

__all__ = [
    "KERNEL",
    "MAX_ROWS",
    "close",
    "joint_key_logits",
    "joint_key_logits_with_torch",
    "usable",
    "wide_queries",
]

#: The most query rows (query heads x query tokens) one program scores: a decode step's. A
#: longer query (a prefill chunk) scores with torch, which is a few large GEMMs there anyway.
MAX_ROWS = 64
#: Tokens per program, and the frame's rows and pair columns per inner product.
BLOCK_T = 32
BLOCK_C = 32
MAX_BLOCK_P = 64
#: The kernel's logits may differ from torch's by this much relative to the largest logit of
#: the call (float32 sums in another order: about 1e-6 here; TF32 products would be 1e-3).
TOLERANCE = 1e-4

#: The kernel's standing per device (its first call there is checked against torch).
KERNEL = CheckedKernel("key logits")


def usable(y, frame, rotation, q, order) -> bool:
    """Whether :func:`joint_key_logits` (arguments as there) runs the kernel for these inputs:
    few enough query rows, on a CUDA device where the kernel has passed its check (run on
    these inputs if it has not been checked there yet)."""
    if q.shape[1] * q.shape[2] > MAX_ROWS:
        return False
    return KERNEL.usable(y.device, lambda: close(y, frame, rotation, q, order))


def close(y, frame, rotation, q, order) -> bool:
    """Whether :func:`joint_key_logits` agrees with its torch twin in float64 on these inputs
    (the check :func:`usable` runs once per device)."""
    got = joint_key_logits(y, frame, rotation, q, order)
    # The reference in float64: torch's own float32 products may be TF32 where a user has
    # allowed it (torch.set_float32_matmul_precision), which the kernel's must not be taken for.
    args = (x.double() for x in (y, frame, rotation, q))
    return within_tolerance(got, joint_key_logits_with_torch(*args, order).float(), TOLERANCE)


def wide_queries(q: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """The queries ``q`` ``[B, H, rows, D]`` as rows against keys coded across heads: ``[B,
    H*rows, H*D]``, row ``h*rows + i`` query ``i`` of head ``h`` on its own head's channels and
    zero elsewhere, the columns in ``order`` (indices into the heads' channels side by side;
    None: as they are)."""
    b, h, rows, d = q.shape
    # One copy into the diagonal of [B, H, rows, H, D], not a slice copy per head.
    wide = q.new_zeros(b, h, rows, h, d)
    wide.diagonal(dim1=1, dim2=3).copy_(q.permute(0, 2, 3, 1))
    wide = wide.view(b, h * rows, h * d)
    # index_select: one gather, lighter than advanced indexing on the queries.
    return wide if order is None else wide.index_select(-1, order)


def joint_key_logits_with_torch(
    y: torch.Tensor,
    frame: torch.Tensor,
    rotation: torch.Tensor,
    q: torch.Tensor,
    order: torch.Tensor,
) -> torch.Tensor:
    """``[B, H*rows, T]`` float32: ``wide_queries(q, order) @ turn(y @ frame)^T``. ``y`` ``[B,
    T, C]`` the blocks' coordinates; ``frame`` ``[C, W]``, ``W = 2P + R`` columns: every
    head's first halves of its RoPE pairs, then their second halves, then the unrotated
    channels; ``rotation`` ``[B or 1, T, 2, P]`` the cosines then the sines of each pair's
    angle; ``q`` ``[B, H, rows, D]`` each head's query rows; ``order`` ``[W]`` the heads'
    channel (``h*D + i``) each frame column is."""
    keys = y @ frame
    p = rotation.shape[-1]
    lo, hi = keys[..., :p], keys[..., p : 2 * p]
    c, s = rotation[:, :, 0], rotation[:, :, 1]
    turned = torch.empty_like(keys)
    torch.mul(lo, c, out=turned[..., :p]).addcmul_(hi, s, value=-1.0)
    torch.mul(hi, c, out=turned[..., p : 2 * p]).addcmul_(lo, s)
    if keys.shape[-1] > 2 * p:
        turned[..., 2 * p :] = keys[..., 2 * p :]
    return wide_queries(q.to(keys.dtype), order) @ turned.transpose(-1, -2)


def joint_key_logits(y, frame, rotation, q, order) -> torch.Tensor:
    """:func:`joint_key_logits_with_torch` by the kernel, arguments as there (on the inputs'
    device; on the CPU only in Triton's interpreter). It reads each head's queries where they
    are: no wide queries are built."""
    if triton is None:
        raise RuntimeError("the fused key logits need Triton, which is not installed")
    b, t, c = y.shape
    _, h, rows, d = q.shape
    w, p = frame.shape[1], rotation.shape[-1]
    fits = frame.shape[0] == c and order.shape == (w,) and w == h * d and w >= 2 * p
    if not fits or rotation.shape[0] not in (1, b) or rotation.shape[1] != t or q.shape[0] != b:
        raise ValueError(
            f"joint key logits: y {tuple(y.shape)}, frame {tuple(frame.shape)}, rotation "
            f"{tuple(rotation.shape)}, queries {tuple(q.shape)} and order {tuple(order.shape)} "
            "do not fit"
        )
    if h * rows > MAX_ROWS:
        raise ValueError(f"joint key logits: {h * rows} query rows, the kernel takes {MAX_ROWS}")
    y, frame, rotation, q = (x.float().contiguous() for x in (y, frame, rotation, q))
    out = torch.empty(b, h * rows, t, dtype=torch.float32, device=y.device)
    if out.numel():
        pow2 = lambda n, top: max(16, min(triton.next_power_of_2(max(n, 1)), top))  # noqa: E731
        key_logits_kernel[(b, triton.cdiv(t, BLOCK_T))](
            y,
            frame,
            rotation,
            q,
            order.to(device=y.device, dtype=torch.int64).contiguous(),
            out,
            t,
            c,
            p,
            w - 2 * p,
            rows,
            h * rows,
            d,
            0 if rotation.shape[0] == 1 else t * 2 * p,
            BLOCK_T=BLOCK_T,
            BLOCK_C=BLOCK_C,
            BLOCK_P=pow2(p, MAX_BLOCK_P),
            BLOCK_R=pow2(w - 2 * p, MAX_BLOCK_P),
            BLOCK_Q=pow2(h * rows, MAX_ROWS),
        )
    return out


if triton is not None:

    @triton.jit
    def _frame_columns(yb, cols, frame, c, w, cm, tm, C, BLOCK_C: tl.constexpr, acc):
        """``acc`` plus the tile's coordinates times the frame's columns ``cols`` (masked)."""
        for c0 in range(0, C, BLOCK_C):
            ci = c0 + c
            cin = ci < C
            yt = tl.load(yb + ci[None, :], mask=tm[:, None] & cin[None, :], other=0.0)
            ft = tl.load(
                frame + ci.to(tl.int64)[:, None] * w + cols[None, :],
                mask=cin[:, None] & cm[None, :],
                other=0.0,
            )
            acc += tl.dot(yt, ft, input_precision="ieee")
        return acc

    @triton.jit
    def _query_columns(qb, head, order, cols, cm, rm, D):
        """The query rows' values in frame columns ``cols``: a row reads its own head's channel
        of each column, and zero in the other heads' columns (the wide queries, unbuilt)."""
        src = tl.load(order + cols, mask=cm, other=0)
        own = (src // D)[None, :] == head
        return tl.load(qb + (src % D)[None, :], mask=rm[:, None] & cm[None, :] & own, other=0.0)

    @triton.jit
    def key_logits_kernel(
        y,  # float32 [B, T, C]: the blocks' coordinates
        frame,  # float32 [C, W]: first halves (P), second halves (P), unrotated (R)
        rotation,  # float32 [B or 1, T, 2, P]: cosines, then sines
        q,  # float32 [B, H, ROWS, D]: each head's query rows
        order,  # int64 [W]: the heads' channel (h * D + i) of each frame column
        out,  # float32 [B, H * ROWS, T]
        T,
        C,
        P,
        R,
        ROWS,
        Q,  # H * ROWS
        D,
        rot_batch_stride,  # 0 where every batch row has the same positions
        BLOCK_T: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_Q: tl.constexpr,
    ):
        b, t = program_tile(BLOCK_T)
        tm = t < T
        c = tl.arange(0, BLOCK_C)
        r = tl.arange(0, BLOCK_Q)
        rm = r < Q
        w = 2 * P + R
        yb = y + (b * T + t.to(tl.int64))[:, None] * C  # each token's row
        qb = q + (b * Q + r.to(tl.int64))[:, None] * D  # each query row (head r // ROWS)
        head = (r // ROWS)[:, None]
        rot = rotation + b * rot_batch_stride + t.to(tl.int64)[:, None] * (2 * P)
        logits = tl.zeros([BLOCK_T, BLOCK_Q], dtype=tl.float32)
        pi = tl.arange(0, BLOCK_P)
        for p0 in range(0, P, BLOCK_P):
            p = p0 + pi
            pm = p < P
            zero = tl.zeros([BLOCK_T, BLOCK_P], dtype=tl.float32)
            lo = _frame_columns(yb, p, frame, c, w, pm, tm, C, BLOCK_C, zero)
            hi = _frame_columns(yb, P + p, frame, c, w, pm, tm, C, BLOCK_C, zero)
            both = tm[:, None] & pm[None, :]
            cos = tl.load(rot + p[None, :], mask=both, other=0.0)
            sin = tl.load(rot + P + p[None, :], mask=both, other=0.0)
            # RoPE over halves, as torch turns them: lo cos - hi sin, hi cos + lo sin.
            first = lo * cos - hi * sin
            second = hi * cos + lo * sin
            q_first = _query_columns(qb, head, order, p, pm, rm, D)
            q_second = _query_columns(qb, head, order, P + p, pm, rm, D)
            logits += tl.dot(first, tl.trans(q_first), input_precision="ieee")
            logits += tl.dot(second, tl.trans(q_second), input_precision="ieee")
        ri = tl.arange(0, BLOCK_R)
        for r0 in range(0, R, BLOCK_R):  # channels RoPE leaves alone (partial rotary)
            u = r0 + ri
            um = u < R
            zero = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
            rest = _frame_columns(yb, 2 * P + u, frame, c, w, um, tm, C, BLOCK_C, zero)
            q_rest = _query_columns(qb, head, order, 2 * P + u, um, rm, D)
            logits += tl.dot(rest, tl.trans(q_rest), input_precision="ieee")
        dst = out + (b * Q + r.to(tl.int64))[None, :] * T + t[:, None]
        tl.store(dst, logits, mask=tm[:, None] & rm[None, :])
