"""Coded blocks as the pipeline holds them (:class:`CodedBlock`) and as the codec's attention
kernels take them (:class:`BlockRun`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .norm_codes import NormCodes

STREAMS = ("k", "v")


@dataclass(eq=False)
class CodedBlock:
    """One block of one stream: ``tokens`` tokens of every (batch row, kv head)."""

    encs: list  # rows * heads kt.EncodedLayer, row-major over (batch row, kv head); one per row
    # coded across heads (joint_heads)
    # Token norms of streams coded with them (across heads: each head's scale), or None.
    norms: Optional[NormCodes]
    tokens: int

    @property
    def encoded_bytes(self) -> int:
        """Exact serialized size of the streams."""
        return sum(int(e.nbytes) for e in self.encs)

    @property
    def norm_bytes(self) -> int:
        return 0 if self.norms is None else self.norms.nbytes

    @property
    def nbytes(self) -> int:
        """Exact bytes held: serialized streams plus token norms."""
        return self.encoded_bytes + self.norm_bytes

    def select_rows(self, order: list[int], rows: int) -> CodedBlock:
        """The block for batch rows ``order`` of its ``rows`` (streams are shared, not
        re-encoded)."""
        per = len(self.encs) // rows  # streams per row: its KV heads, or one across them
        encs = [self.encs[r * per + j] for r in order for j in range(per)]
        norms = None if self.norms is None else self.norms.select_rows(torch.tensor(order))
        return CodedBlock(encs, norms, self.tokens)


@dataclass(frozen=True, eq=False)
class BlockRun:
    """Blocks of one stream kind as the codec's attention kernels take them
    (``Pipeline.run_of``): a cache whose blocks are immutable once written builds it when
    its blocks change and hands the same run over on every step, instead of laying the blocks
    out again per layer and step."""

    layers: Any  # codec.CoreLayers, stream-major (each stream's blocks in token order)
    streams: int
    norms: Any  # (codes, bounds) lists as the kernels take token norms, or None
    tokens: int
    blocks: tuple = ()  # the CodedBlocks laid out
    # Blocks coded across heads with token norms: each head's scale codes as (codes, bounds)
    # lists (Pipeline.joint_scales; attention decodes them itself), else None.
    scales: Any = None


def stream_major(blocks: Sequence[CodedBlock]) -> tuple[list, int]:
    """The blocks' encodings stream-major (each (row, head) stream's blocks in token order),
    the layout the codec's batch calls take, and the number of streams."""
    streams = len(blocks[0].encs)
    return [blk.encs[s] for s in range(streams) for blk in blocks], streams


def norm_code_lists(blocks: Sequence[CodedBlock]) -> tuple[list, list]:
    """The blocks' token-norm codes as the codec takes them: ``(codes, bounds)`` lists, per
    block uint8 ``[streams, tokens]`` and float16 ``[streams, 2]``."""
    arrays = [blk.norms.arrays() for blk in blocks]  # type: ignore[union-attr]
    return [c for c, _ in arrays], [b for _, b in arrays]
