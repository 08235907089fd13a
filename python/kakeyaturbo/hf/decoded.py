"""Decoded blocks, for every caller that wants dense keys and values (not attention over the
codes). Blocks are decoded on demand; a decoded block is kept only while it fits the cache's
explicit ``decoded_cache_bytes`` budget (default 0: nothing decoded is kept, every step decodes
every block in one batched call). When the budget can hold the whole layer, the layer keeps one
contiguous decoded buffer instead: each block is decoded once (at the step after it was
compressed), new tokens are written in place, and ``update`` returns views of it, so a step
costs no decode and no O(L) copy. Otherwise single decoded blocks are kept while they fit."""

from __future__ import annotations

import torch

from .blocks import Block, storage_bytes


class DecodedBlocks:
    """A :class:`~kakeyaturbo.hf.layer.KakeyaLayer`'s decoded blocks and contiguous decoded
    buffer (``_buf_k``, ``_buf_v``), held under the cache's decoded budget."""

    def _decode_blocks(self, blocks: list[Block]) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode ``blocks`` (one batched call per K/V) -> [B, H, n*bs, D] in the model dtype;
        sink slots hold their block's mean (callers write the exact sinks over them)."""
        pipe, li, b = self._ctx.pipeline, self.layer_idx, self._rows
        pos = None
        if self._rope is not None:
            pos = torch.cat([blk.positions for blk in blocks], dim=-1)
        if self._on_device is None:
            ks, vs = [blk.k for blk in blocks], [blk.v for blk in blocks]
        elif len(blocks) == len(self._blocks):  # all of them, in order (blocks are unique)
            ks, vs = self._on_device["k"], self._on_device["v"]
        else:
            at = {id(blk): i for i, blk in enumerate(self._blocks)}
            picked = [at[id(blk)] for blk in blocks]
            ks, vs = (self._on_device[s].take(picked) for s in ("k", "v"))
        dk = pipe.decode(ks, li, "k", b, pos)
        dv = pipe.decode(vs, li, "v", b)
        return (
            dk.to(device=self.device, dtype=self.dtype),
            dv.to(device=self.device, dtype=self.dtype),
        )

    def _materialize(self, keep: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Keys and values of all blocks, in order, as lists of pieces to concatenate; with
        ``keep``, freshly decoded blocks are kept while the budget allows."""
        if not self._blocks:
            return [], []
        need = [blk for blk in self._blocks if blk.decoded is None]
        if not need:
            return [blk.decoded[0] for blk in self._blocks], [
                blk.decoded[1] for blk in self._blocks
            ]
        dk, dv = self._decode_blocks(need)
        bs = self.block_size
        fresh = {}
        for i, blk in enumerate(need):
            pk, pv = dk[:, :, i * bs : (i + 1) * bs], dv[:, :, i * bs : (i + 1) * bs]
            fresh[id(blk)] = (pk, pv)
            nbytes = (pk.numel() + pv.numel()) * pk.element_size()
            if keep and self._ctx.budget.limit and self._ctx.budget.try_reserve(nbytes):
                blk.decoded = (pk.clone(), pv.clone())
        if len(need) == len(self._blocks):
            return [dk], [dv]  # common no-budget case: already one tensor in block order
        pieces = [
            blk.decoded if blk.decoded is not None else fresh[id(blk)] for blk in self._blocks
        ]
        return [p[0] for p in pieces], [p[1] for p in pieces]

    def _buffer_ready(self, need: int) -> bool:
        """Make the contiguous decoded buffer hold ``need`` tokens and be up to date; False
        (and no buffer) when the budget cannot hold it."""
        per_token = self._rows * self._heads * (self._hot_k.shape[-1] + self._v_dim)
        per_token *= self.dtype.itemsize
        budget = self._ctx.budget
        if self._buf_k is None:
            if self._buf_refused:
                return False
            cap = need + self._buf_headroom
            if not budget.try_reserve(cap * per_token):
                self._buf_refused = True
                return False
            self._release_decoded()  # single kept blocks are superseded by the buffer
            b, h = self._rows, self._heads
            buf_k = self._hot_k.new_empty((b, h, cap, self._hot_k.shape[-1]), dtype=self.dtype)
            buf_v = self._hot_k.new_empty((b, h, cap, self._v_dim), dtype=self.dtype)
            clen = self.compressed_length
            if self._blocks:
                pieces_k, pieces_v = self._materialize(keep=False)
                at = 0
                for pk, pv in zip(pieces_k, pieces_v):
                    buf_k[:, :, at : at + pk.shape[-2]] = pk
                    buf_v[:, :, at : at + pv.shape[-2]] = pv
                    at += pk.shape[-2]
                self._overwrite_sinks(buf_k, buf_v, 0, clen, 0)
            buf_k[:, :, clen : self._len] = self._hot_k
            buf_v[:, :, clen : self._len] = self._hot_values()
            self._buf_k, self._buf_v, self._buf_pending = buf_k, buf_v, []
            return True
        cap = self._buf_k.shape[-2]
        if cap < need:
            # Grow by a fixed headroom, not geometrically: headroom is budget spent on nothing,
            # and the O(L) copy happens once per `_buf_headroom` tokens.
            new_cap = need + self._buf_headroom
            if not budget.try_reserve((new_cap - cap) * per_token):
                self._drop_buffer()
                self._buf_refused = True
                return False
            for name in ("_buf_k", "_buf_v"):
                old = getattr(self, name)
                new = old.new_empty((*old.shape[:2], new_cap, old.shape[-1]))
                new[:, :, : self._len] = old[:, :, : self._len]
                setattr(self, name, new)
        if self._buf_pending:
            first = next(i for i, b in enumerate(self._blocks) if b is self._buf_pending[0])
            lo = first * self.block_size
            hi = lo + len(self._buf_pending) * self.block_size
            dk, dv = self._decode_blocks(self._buf_pending)
            self._buf_k[:, :, lo:hi] = dk
            self._buf_v[:, :, lo:hi] = dv
            self._overwrite_sinks(self._buf_k, self._buf_v, lo, hi, 0)
            self._buf_pending = []
        return True

    @property
    def _buf_headroom(self) -> int:
        # Spare tokens per (re)allocation: enough that decoding reallocates once per this
        # many steps, small enough that little of the budget holds nothing.
        return min(self.block_size, 128)

    def _drop_buffer(self) -> None:
        if self._buf_k is not None:
            self._ctx.budget.release(storage_bytes(self._buf_k) + storage_bytes(self._buf_v))
        self._buf_k = self._buf_v = None
        self._buf_pending = []

    def _drop_decoded(self, blk: Block) -> None:
        if blk.decoded is not None:
            self._ctx.budget.release(sum(storage_bytes(t) for t in blk.decoded))
            blk.decoded = None

    def _release_decoded(self) -> None:
        for blk in self._blocks:
            self._drop_decoded(blk)
