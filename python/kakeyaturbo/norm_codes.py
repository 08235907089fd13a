"""Token norms in one byte each: log-spaced codes over each block stream's own range.

A stream coded with token norms (``v_token_norms``, ``k_token_norms``) holds, per batch row and
KV head, its smallest and largest nonzero norm as float16 and each token's norm as one code:
0 is an exact zero (a zero vector stays zero), 1..255 are evenly spaced in log2 between the two
bounds. The relative error is at most half a step: 1.1% for a stream whose norms span 8 octaves
(256x), less for narrower ones: far below the codec's own error per token, for half the bytes
of a float16 norm.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ._runs import equal_runs
from .gpu import fused_decode, fused_norm_encode

__all__ = ["NormCodes", "StackedNorms", "decode_norms", "encode_norms", "scaled_norms"]

#: Codes 1..STEPS + 1 span a stream's [smallest, largest] norm; code 0 is zero.
STEPS = 254
_HALF_TINY = float(torch.finfo(torch.float16).smallest_normal) * 2.0**-10  # smallest subnormal


@dataclass(eq=False)
class NormCodes:
    """Token norms of one block: ``codes`` ``[rows, heads, tokens]`` uint8 and ``bounds``
    ``[rows, heads, 2]`` float16 (smallest and largest nonzero norm of each stream)."""

    codes: torch.Tensor
    bounds: torch.Tensor
    _arrays: tuple[np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False)

    @property
    def nbytes(self) -> int:
        """Exact bytes held: a byte per token and two float16 per stream."""
        return self.codes.numel() + 2 * self.bounds.numel()

    def select_rows(self, order: torch.Tensor) -> NormCodes:
        return NormCodes(self.codes[order], self.bounds[order])

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The codes ``[streams, tokens]`` uint8 and bounds ``[streams, 2]`` float16 as numpy
        views (streams = rows x heads), the form the codec's kernels decode themselves; made
        once per block (views of the tensors: no bytes beyond :attr:`nbytes`)."""
        if self._arrays is None:
            codes = self.codes.contiguous()
            bounds = self.bounds.contiguous()
            self._arrays = (
                codes.reshape(-1, codes.shape[-1]).numpy(),
                bounds.reshape(-1, 2).numpy(),
            )
        return self._arrays

    def decode(self) -> torch.Tensor:
        """The norms ``[rows, heads, tokens]`` float32."""
        return decode_norms([self])


def scaled_norms(norms: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """``norms`` over ``divisor`` (at least 1e-3) as float16, at most its largest: the scale a
    head of a stream coded across heads stores (its norm over its decoded unit vector's)."""
    scale = norms.float() / divisor.clamp_min(1e-3)
    return scale.clamp_max(torch.finfo(torch.float16).max).half()


def _log_bounds(bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log2 of the smallest norm and the log2 span per step, float32 ``[rows, heads]``."""
    lg = bounds.float().log2()
    return lg[..., 0], (lg[..., 1] - lg[..., 0]) / STEPS


def encode_norms(norms: torch.Tensor) -> NormCodes:
    """Code ``norms`` ``[rows, heads, tokens]`` (nonnegative, finite, within float16)."""
    n = norms.float()
    real = n > 0
    big = torch.finfo(torch.float32).max
    lo = torch.where(real, n, big).amin(dim=-1)
    hi = n.amax(dim=-1)
    empty = ~real.any(dim=-1)  # an all-zero stream: any positive bounds decode nothing
    lo = torch.where(empty, 1.0, lo)
    hi = torch.where(empty, 1.0, hi)
    # Bounds are what the decoder reads: the codes are placed against their float16 values.
    bounds = torch.stack((lo, hi), dim=-1).half().clamp_min(_HALF_TINY)
    llo, step = _log_bounds(bounds)
    rel = n.clamp_min(_HALF_TINY).log2() - llo[..., None]
    pos = torch.where(step[..., None] > 0, rel / step[..., None], torch.zeros_like(rel))
    codes = (pos.round() + 1).clamp(1, STEPS + 1)
    codes = torch.where(real, codes, torch.zeros_like(codes))
    return NormCodes(codes.to(torch.uint8).contiguous(), bounds.contiguous())


def decode_norms(parts: list[NormCodes]) -> torch.Tensor:
    """The norms of consecutive blocks, concatenated: ``[rows, heads, sum(tokens)]`` float32."""
    return StackedNorms.of(parts).decode()


@dataclass(eq=False)
class StackedNorms:
    """Consecutive blocks' norms laid out to decode in a few ops per step: each run of equally
    long blocks' codes stacked ``[rows, heads, blocks, tokens]``, beside the log2 of its
    smallest norm and its step (what the bounds give, computed once)."""

    runs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (codes, log2 low, step)

    @classmethod
    def of(cls, parts: Sequence[NormCodes], device: torch.device | None = None) -> StackedNorms:
        runs = []
        for run in equal_runs(parts, lambda p: p.codes.shape[-1]):
            codes = torch.stack([p.codes for p in run], dim=-2)
            llo, step = _log_bounds(torch.stack([p.bounds for p in run], dim=-2))
            # Contiguous: the low bounds are a view of both bounds' logs (held whole otherwise).
            runs.append(tuple(t.to(device).contiguous() for t in (codes, llo, step)))
        return cls(runs)

    @classmethod
    def encoded(
        cls, norms: torch.Tensor, tokens: int, divisor: torch.Tensor | None = None
    ) -> StackedNorms:
        """``norms`` ``[rows, heads, T]`` (over ``divisor`` where given: :func:`scaled_norms`)
        coded in blocks of ``tokens`` (``T`` a multiple), stacked on their device as :meth:`of`
        stacks the blocks' :func:`encode_norms`."""
        with_torch = lambda: encoded_with_torch(norms, tokens, divisor)  # noqa: E731
        if fused_norm_encode.usable(norms, tokens, with_torch, divisor):
            return cls([fused_norm_encode.encode(norms, tokens, divisor)])  # a GPU: one launch
        return cls([with_torch()])

    def split(self, rows: Sequence[int]) -> list[StackedNorms]:
        """The norms of consecutive parts of ``rows`` batch rows (several layers' rows coded
        at once, one part per layer), as views."""
        parts = [[] for _ in rows]
        for run in self.runs:
            for i, piece in enumerate(zip(*(t.split(list(rows)) for t in run))):
                parts[i].append(piece)
        return [StackedNorms(p) for p in parts]

    def take(
        self, groups: Sequence[tuple[list[int], torch.Tensor]], rows: torch.Tensor | None
    ) -> StackedNorms:
        """Runs made of these: for each ``(sources, blocks)`` of ``groups``, the runs
        ``sources`` joined along their blocks, then blocks ``blocks`` of them (an index into
        the joined blocks), for batch rows ``rows`` (None: every row)."""
        out = []
        for sources, blocks in groups:
            parts = zip(*(self.runs[r] for r in sources))
            joined = [torch.cat(part, dim=2) if len(sources) > 1 else part[0] for part in parts]
            dev = joined[0].device
            if rows is not None:
                joined = [t.index_select(0, rows.to(dev)) for t in joined]
            out.append(tuple(t.index_select(2, blocks.to(dev)).contiguous() for t in joined))
        return StackedNorms(out)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for run in self.runs for t in run)

    def decode(self) -> torch.Tensor:
        """The norms ``[rows, heads, sum(tokens)]`` float32 (on a GPU by one Triton kernel per
        run, ``fused_decode.decode_norms``)."""
        out = [_decode_run(*run) for run in self.runs]
        return torch.cat(out, dim=-1) if len(out) > 1 else out[0]


def encoded_with_torch(
    norms: torch.Tensor, tokens: int, divisor: torch.Tensor | None = None
) -> tuple:
    """:meth:`StackedNorms.encoded`'s one run ``(codes, log2 low, step)`` by torch ops."""
    if divisor is not None:
        norms = scaled_norms(norms, divisor)
    r, h, t = norms.shape
    coded = encode_norms(norms.reshape(r, h, t // tokens, tokens))
    llo, step = _log_bounds(coded.bounds)
    return coded.codes, llo.contiguous(), step.contiguous()


def _decode_run(codes: torch.Tensor, llo: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    if fused_decode.norms_usable(codes, llo, step, decode_run_with_torch):
        return fused_decode.decode_norms(codes, llo, step)
    return decode_run_with_torch(codes, llo, step)


def decode_run_with_torch(
    codes: torch.Tensor, llo: torch.Tensor, step: torch.Tensor
) -> torch.Tensor:
    """A run's norms ``[R, H, blocks * tokens]`` by torch ops: ``codes`` ``[R, H, blocks,
    tokens]``, each block's bounds (``llo``, ``step``: ``[R, H, blocks]``) broadcast over its
    tokens."""
    norms = codes.float().sub_(1).mul_(step[..., None]).add_(llo[..., None]).exp2_()
    return norms.masked_fill_(codes == 0, 0.0).flatten(-2)
