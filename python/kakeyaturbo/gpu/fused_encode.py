"""Coding a span of streams on a GPU as ``device_encode.py``'s torch encoder does, byte for
byte, in four Triton launches (three without outliers: ``encode_kernels.py``) where the torch
ops take about 85.

The torch encoder makes 2,580 of the 6,032 ops and launches that a SmolLM2 prefill at 4k
queues for its cache (``reports/device_op_counts.txt``), and its temporaries (a few dozen
bytes per value) make coding many layers' flushes together cost memory. The kernels plan each
stream-block (mean, scales, the greedy allocation of bits), write its codes into the packed
stream, total where each part's codes and outliers start, and gather the outliers.

Several layers' spans coded in one call come back as their parts, a run per layer laid out as
``PackedRun.split`` lays them out (its own codes and padding, offsets from its own start), each
part's tensors views of the call's: no op splits them.

Float32 steps are IEEE-rounded (``div_rn``, no fused multiply-adds), so a GPU gives the
torch encoder's bytes but for the order float64 sums are added in, as the torch encoder
gives the codec's. Used on CUDA devices where Triton imports, unless ``KAKEYATURBO_TRITON=0``;
its first span on each device is checked against the torch encoder, byte for byte, and a
kernel that fails to build or disagrees there is not used again in the process (a warning
says so). ``tests/gpu/test_fused_encode.py`` runs the kernels in Triton's interpreter on the CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import encode_kernels, fused_decode
from .device_decode import PAD, SKELETON_DTYPES, PackedRun
from .triton_support import CheckedKernel, triton

__all__ = ["KERNEL", "encode", "usable"]

#: The kernels' standing per device (their first span there is checked byte for byte).
KERNEL = CheckedKernel("encoder")
#: Components per program step (the plan's: its allocation bisects over them all, best in
#: one step), and vectors per step of the plan's sums.
MAX_BLOCK_D = 128
MAX_PLAN_BLOCK_D = 256
PLAN_BLOCK_N = 16
#: Entries per step of the kernels' running sums (stream sizes, outlier counts).
SUM_BLOCK = 1024
#: The skeleton dtypes' numbers in the kernels.
_SKELETONS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def usable(
    y: torch.Tensor,
    with_torch: Callable[[], Any],
    with_kernels: Callable[[], Any],
    check_range: Callable[[torch.Tensor], None],
) -> bool:
    """Whether the kernels code spans on ``y``'s device: a CUDA device, with Triton, not
    disabled, and checked there (the first call on each device compares ``with_kernels()``'s
    runs with ``with_torch()``'s, field by field). ``check_range(y)`` runs before that check:
    a span the codec refuses raises there as bad input, never counted against the kernels."""
    if KERNEL.pending(y.device):
        check_range(y)
    return KERNEL.usable(y.device, lambda: same_runs(with_kernels(), with_torch()))


def same_run(got: Any, want: Any) -> bool:
    """Whether two ``PackedRun`` hold the same tensors (dtype, shape, every value)."""
    if got.n != want.n:
        return False
    for field in dataclasses.fields(got):
        a, b = getattr(got, field.name), getattr(want, field.name)
        if isinstance(a, torch.Tensor):
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                return False
    return True


def encode(
    y: torch.Tensor,
    budgets: Sequence[int],
    params: Any,
    tables: dict[str, torch.Tensor],
    check_range: Callable[[torch.Tensor], None],
    parts: Sequence[int],
) -> list[PackedRun]:
    """``y`` ``[K, n, d]`` float32 (checked, contiguous) coded by the kernels, stream ``i`` with
    ``budgets[i]`` bits per vector, in consecutive ``parts`` of stream-blocks: the runs the
    torch encoder's ``PackedRun`` gives split so (``PackedRun.split``), each part's tensors
    views of the call's. ``tables`` holds on ``y``'s device ``drops`` (float64 ``[8]``, what
    each width's next bit removes of a unit variance's distortion), ``bounds`` (float32
    ``[9, 255]``, the codebooks' midpoints by width, +inf-padded) and ``gains`` (float32
    ``[9]``, copied into each run). Input that is not finite or past the codec's range (the
    kernels flag it) is refused by ``check_range(y)``, which raises the codec's error."""
    if triton is None:
        raise RuntimeError("the fused encoder needs Triton, which is not installed")
    k, n, d = y.shape
    dev = y.device
    width = tables["drops"].numel()
    mean = torch.empty(k, d, dtype=SKELETON_DTYPES[params.skeleton_dtype], device=dev)
    sigma = torch.empty(k, d, dtype=torch.float16, device=dev)
    bits = torch.empty(k, d, dtype=torch.uint8, device=dev)
    per_vector = torch.empty(k, dtype=torch.int64, device=dev)
    bad = torch.empty(k, dtype=torch.int32, device=dev)
    # What the host knows of the streams, in one copy: their budgets, each one's part and its
    # part's first stream-block, and where the parts start.
    edges = [0]
    for count in parts:
        edges.append(edges[-1] + count)
    part = [p for p, count in enumerate(parts) for _ in range(count)]
    info = torch.tensor(
        [*budgets, *part, *(edges[p] for p in part), *edges], dtype=torch.int64, device=dev
    )
    budget, part_of, part_first, edge = (
        info[:k],
        info[k : 2 * k],
        info[2 * k : 3 * k],
        info[3 * k :],
    )
    block_d = min(triton.next_power_of_2(d), MAX_BLOCK_D)
    encode_kernels.plan_kernel[(k,)](
        y,
        budget,
        tables["drops"],
        mean.view(torch.int16) if mean.dtype == torch.bfloat16 else mean,
        sigma,
        bits,
        per_vector,
        bad,
        n,
        d,
        SKELETON=_SKELETONS[mean.dtype],
        WIDTH=width,
        BLOCK_N=PLAN_BLOCK_N,
        BLOCK_D=min(triton.next_power_of_2(d), MAX_PLAN_BLOCK_D),
        enable_fp_fusion=False,  # (x * w) and (c * w) * c rounded apart, as torch does
    )
    # The packed streams' room, known here without waiting: no stream has more bits per
    # vector than its budget or 8 per component (usually exactly its budget).
    room = sum((min(b, width * d) * n + 7) // 8 for b in budgets) + PAD * len(parts)
    words = torch.zeros((room + 3) // 4, dtype=torch.int32, device=dev)
    tiles = triton.cdiv(n, fused_decode.BLOCK_N)
    base = torch.empty(k, dtype=torch.int64, device=dev)
    counts = torch.empty(k * tiles, dtype=torch.int32, device=dev)
    threshold = float(params.outlier_threshold)
    encode_kernels.codes_kernel[(k, tiles)](
        y,
        mean,
        sigma,
        bits,
        per_vector,
        tables["bounds"],
        part_of,
        part_first,
        base,
        words,
        words.numel(),
        counts,
        n,
        d,
        threshold,
        LEVELS=tables["bounds"].shape[1],
        BLOCK_N=fused_decode.BLOCK_N,
        BLOCK_D=block_d,
        PAD=PAD,
        BLOCK_K=SUM_BLOCK,
        enable_fp_fusion=False,
    )
    starts = torch.empty(k * tiles + len(parts), dtype=torch.int64, device=dev)
    offsets = torch.empty(2 * len(parts) + 3, dtype=torch.int64, device=dev)
    encode_kernels.totals_kernel[(1,)](
        per_vector,
        counts,
        bad,
        edge,
        starts,
        offsets,
        n,
        k,
        len(parts),
        tiles,
        PAD=PAD,
        BLOCK=SUM_BLOCK,
    )
    *ends, refused = offsets.tolist()  # the one wait
    if refused:  # a value non-finite or past the codec's range: the check says which
        check_range(y)
        raise RuntimeError("the encoder flagged a value out of range that check_range passed")
    byte, outlier = ends[: len(parts) + 1], ends[len(parts) + 1 :]
    codes = words.view(torch.uint8)[: byte[-1]]
    if words.numel() * 4 - codes.numel() > 3:  # fewer bits than budgeted: hold only these
        codes = codes.clone()
    outlier_pos = torch.empty(outlier[-1], dtype=torch.int64, device=dev)
    outlier_dec = torch.empty(outlier[-1], dtype=torch.float32, device=dev)
    if outlier[-1]:
        encode_kernels.outliers_kernel[(k, tiles)](
            y,
            mean,
            sigma,
            part_of,
            part_first,
            starts,
            offsets,
            outlier_pos,
            outlier_dec,
            n,
            d,
            len(parts),
            threshold,
            BLOCK_N=fused_decode.BLOCK_N,
            BLOCK_D=block_d,
            enable_fp_fusion=False,  # mean + (float16(z) * sigma): two roundings, as torch
        )
    gains = tables["gains"].expand(len(parts), -1).clone()  # each run counts what it holds
    return [
        PackedRun(
            codes=codes[byte[p] : byte[p + 1]],
            base=base[lo:hi],
            per_vector=per_vector[lo:hi],
            bits=bits[lo:hi],
            sigma=sigma[lo:hi],
            mean=mean[lo:hi],
            gains=gains[p],
            outlier_pos=outlier_pos[outlier[p] : outlier[p + 1]],
            outlier_dec=outlier_dec[outlier[p] : outlier[p + 1]],
            outlier_tiles=starts[lo * tiles + p : hi * tiles + p + 1],
            n=n,
        )
        for p, (lo, hi) in enumerate(zip(edges[:-1], edges[1:]))
    ]


def same_runs(got: Sequence[Any], want: Sequence[Any]) -> bool:
    """Whether two lists of ``PackedRun`` hold the same tensors, run by run."""
    return len(got) == len(want) and all(same_run(a, b) for a, b in zip(got, want))
