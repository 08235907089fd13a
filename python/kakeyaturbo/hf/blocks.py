"""A compressed layer's blocks as it holds them (:class:`Block`), and the stored positions of a
flush's blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..pipeline import CodedBlock


@dataclass(eq=False)  # identity: blocks are compared by `is`, never by content
class Block:
    """One compressed block: ``block_size`` tokens of every (batch row, kv-head) stream."""

    # The coded streams held on the host, or None where the layer holds its blocks on the
    # device attention reads them on (KakeyaLayer._on_device), and only there.
    k: CodedBlock | None
    v: CodedBlock | None
    tokens: int
    # RoPE positions (pre-RoPE mode only, else None), int32: [B, 1] each row's first position
    # when every row's positions run on consecutively (the usual case: 4 bytes per row, not
    # per token), else [B, block_size].
    pos: Any
    decoded: Any = None  # (K, V) [B, H, bs, D] held under the decoded budget, or None
    # `pos` as bytes (b"" without): layers of a forward compare their blocks' positions by
    # these, without a tensor op per layer (CodedView._rotation). Set with `pos` by `place`.
    pos_key: bytes = b""

    def place(self, pos: torch.Tensor) -> None:
        """Holds (a copy of) ``pos`` as the block's stored positions."""
        self.pos = pos.clone()
        self.pos_key = self.pos.cpu().numpy().tobytes()

    @property
    def positions(self) -> torch.Tensor | None:
        """``[B, block_size]`` int32 RoPE positions, or None."""
        if self.pos is None or self.pos.shape[-1] == self.tokens:
            return self.pos
        run = torch.arange(self.tokens, dtype=self.pos.dtype, device=self.pos.device)
        return self.pos + run


def storage_bytes(t: torch.Tensor | None) -> int:
    # Storage, not numel: a view would keep its whole base alive.
    return 0 if t is None else t.untyped_storage().nbytes()


def block_positions(pos: torch.Tensor, host: torch.Tensor, n: int, bs: int, step) -> list:
    """Each of ``n`` flushed blocks' stored positions (``Block.pos``) and their bytes, from the
    flush's ``pos`` ``[B, n * bs]`` (``host``: the same on the host): where every block's run
    on consecutively (the usual case), each row's first position of each block, all blocks' in
    one tensor (one op on the device) that the blocks hold views of; else each block's own
    copy. The layers of a forward flush equal positions: what the host reads of them is made
    once (``step``, the forward's :class:`StepInputs`)."""
    key = (n, bs, tuple(host.shape), host.numpy().tobytes())
    runs, keys = step.once("block positions", key, lambda: _position_keys(host, n, bs))
    if all(runs):
        firsts = pos[:, ::bs].clone()
        return [(firsts[:, j : j + 1], keys[j]) for j in range(n)]
    return [(pos[:, _stored(j, bs, run)].clone(), keys[j]) for j, run in enumerate(runs)]


def _stored(j: int, bs: int, run: bool) -> slice:
    """Block ``j``'s stored positions: its first where they run on consecutively, else all."""
    return slice(j * bs, j * bs + 1) if run else slice(j * bs, (j + 1) * bs)


def _position_keys(host: torch.Tensor, n: int, bs: int) -> tuple[list[bool], list[bytes]]:
    """Whether each block's positions (``host`` ``[B, n * bs]``) run on consecutively, and the
    bytes of what each block stores of them."""
    b = host.shape[0]
    starts = host[:, ::bs]
    steps = torch.arange(bs, dtype=host.dtype)
    runs = (host.view(b, n, bs) == starts[..., None] + steps).all(dim=2).all(dim=0).tolist()
    keys = [host[:, _stored(j, bs, run)].numpy().tobytes() for j, run in enumerate(runs)]
    return runs, keys
