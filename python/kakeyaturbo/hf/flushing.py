"""Flushing: whenever a layer's hot window holds ``block_size`` tokens more than
``residual_length``, its oldest whole blocks are encoded in one batched codec call (one stream
per (block, batch row, kv-head)) and their full-precision copy is dropped. A long prompt
therefore compresses in one pass, from the values the prompt brought; tokens that waited in the
window (blocks flushed while generating) are coded from what it held.

In a forward the cache's model hook sees, a few new tokens per row (a decode step's) wait for its
end and go into every layer's window together (:func:`finish_forward`). Layers that hold their
blocks on the model's device (a GPU) also wait for the forward's end and are coded together
(:func:`flush_together`): there a flush is hundreds of small ops per layer otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

from . import heap
from .blocks import Block, block_positions, storage_bytes
from .context import StepInputs
from .hot_window import append_together, keep_together


class Flushing:
    """A :class:`~kakeyaturbo.hf.layer.KakeyaLayer`'s flushes: coding its oldest hot tokens into
    blocks (on the host, or with :class:`~kakeyaturbo.hf.device_held.DeviceHeld` on its
    device)."""

    def _flush(self, new_v: torch.Tensor) -> None:
        """Encode every whole block of hot tokens older than the residual window (``new_v``: the
        values of the forward that just appended its tokens). A layer holding its blocks on its
        device, in a forward the cache's model hook sees, waits for the forward's end and is
        flushed there with the other layers (:func:`flush_together`), up to the cache's
        ``flush_together_bytes`` of exact tokens waiting."""
        n = self._whole_blocks()
        if n == 0:
            return
        if not (self._on_device is not None or (not self._blocks and self._holds_on_device())):
            pipe, li = self._ctx.pipeline, self.layer_idx
            sinks, spans = self._flush_spans(n, new_v)
            enc_k, enc_v = (pipe.encode(x, li, s, p, sinks) for s, (x, p) in spans.items())
            _commit_flushes([(self, n, enc_k, enc_v)])
            return
        step = self._ctx.step
        if not step.hooked:
            flush_together([(self, new_v)])
            return
        step.flushes.append((self, new_v))
        waiting = sum(layer._flush_bytes(v) for layer, v in step.flushes)
        if waiting > self._ctx.flush_together_bytes:
            flushes, step.flushes = step.flushes, []
            flush_together(flushes)

    def _whole_blocks(self) -> int:
        """Whole blocks of hot tokens older than the residual window (what a flush codes)."""
        return max(self._hot_k.shape[-2] - self.residual_length, 0) // self.block_size

    def _flush_bytes(self, new_v: torch.Tensor) -> int:
        """Bytes a waiting flush keeps: the hot window and the forward's values."""
        return sum(storage_bytes(t) for t in (self._hot_k, self._hot_v, new_v))

    def _flush_spans(self, n: int, new_v: torch.Tensor) -> tuple:
        """(sink mask, ``{"k": (keys, positions), "v": (values, None)}``) of a flush of ``n``
        blocks: the oldest tokens, as they are coded."""
        t = n * self.block_size
        pos = self._hot_pos[:, :t] if self._hot_pos is not None else None
        sinks = self._sink_mask(self.compressed_length, t)
        # Whole blocks of bs tokens only: the recipe's newest-token bits never apply here (the
        # newest residual_length tokens are held exact instead).
        return sinks, {
            "k": (self._hot_k[:, :, :t], pos),
            "v": (self._flushed_values(t, new_v), None),
        }

    def _add_blocks(self, n: int, enc_k: list, enc_v: list, host_pos: Any) -> None:
        """Hold ``n`` flushed blocks, the oldest hot tokens (their host streams, or None each
        where the layer holds them on its device, added there already); ``host_pos``: their
        positions on the host (None without positions). :func:`_commit_flushes` then drops
        their tokens from the hot window."""
        bs = self.block_size
        t = n * bs
        self._held = None
        pos = self._hot_pos[:, :t] if self._hot_pos is not None else None
        placed = [(None, b"")] * n
        if pos is not None:
            placed = block_positions(pos, host_pos, n, bs, self._ctx.step)
        for j, (at, key) in enumerate(placed):
            blk = Block(k=enc_k[j], v=enc_v[j], tokens=bs, pos=at, pos_key=key)
            self._blocks.append(blk)
            if self._buf_k is not None:
                # Decoded into the buffer at the next update: the forward in flight still
                # attends to the exact tokens, as it does without a buffer.
                self._buf_pending.append(blk)

    def _flushed_bytes(self, n: int) -> int:
        """Bytes of exact tokens ``n`` flushed blocks held in the hot window."""
        k, v = self._hot_k, self._hot_v
        per_row = k.shape[-1] * k.element_size() + v.shape[-1] * v.element_size()
        return n * self.block_size * self._rows * self._heads * per_row

    def _flushed_values(self, t: int, new_v: torch.Tensor) -> torch.Tensor:
        """Values of the oldest ``t`` hot tokens, as they are coded. A forward's own tokens are
        coded from the values it brought (in the hot dtype), not from their int8 rows, so a
        prompt's blocks are the ones the evaluation measures (it codes a prefix's values exact);
        tokens that waited in the window (the blocks flushed while generating) exist only as
        their int8 rows and are coded from them."""
        first_new = self._hot_v.shape[-2] - new_v.shape[-2]
        if not self._ctx.int8_hot_values or first_new >= t:
            return self._hot_values(0, t)
        exact = new_v[:, :, : t - first_new].to(self._hot_float)
        if first_new == 0:
            return exact
        return torch.cat([self._hot_values(0, first_new), exact.float()], dim=-2)


def flush_together(waiting: list[tuple[Flushing, torch.Tensor]]) -> None:
    """Flush layers that hold their blocks on their device (``(layer, its forward's values)``,
    of one cache): their spans coded together, one set of ops per stream kind for all of them
    (``Pipeline.encode_layers_on_device``), each layer's blocks the same as flushed alone. On a
    GPU a prompt's flush is otherwise a few hundred small ops per layer, each queued by the
    host, and sets the prefill's time."""
    jobs = []
    for layer, new_v in waiting:
        n = layer._whole_blocks()
        if n:
            jobs.append((layer, n, *layer._flush_spans(n, new_v)))
    if not jobs:
        return
    pipe = jobs[0][0]._ctx.pipeline
    coded = {
        s: pipe.encode_layers_on_device(
            [(spans[s][0], layer.layer_idx, spans[s][1], sinks) for layer, _, sinks, spans in jobs],
            s,
        )
        for s in ("k", "v")
    }
    for i, (layer, _, _, _) in enumerate(jobs):
        layer._hold_on_device({s: coded[s][i] for s in coded})
    _commit_flushes([(layer, n, [None] * n, [None] * n) for layer, n, _, _ in jobs])


def _commit_flushes(done: list[tuple[Flushing, int, list, list]]) -> None:
    """Hold each ``(layer, n, enc_k, enc_v)``'s ``n`` flushed blocks (:meth:`Flushing.
    _add_blocks`) and drop their tokens from its hot window: their positions read to the host
    in one copy, the windows' tails kept in one copy per kind, the heap trimmed once after."""
    hosts = _host_positions([(layer, n * layer.block_size) for layer, n, _, _ in done])
    for (layer, n, enc_k, enc_v), host in zip(done, hosts):
        layer._add_blocks(n, enc_k, enc_v, host)
    coded = sum(layer._flushed_bytes(n) for layer, n, _, _ in done)
    tails = [(layer._hot, n * layer.block_size, layer._hot.length) for layer, n, _, _ in done]
    for (layer, _, _, _), kept in zip(done, keep_together(tails)):
        layer._hot = kept
    heap.release_after(coded)  # a prompt's temporaries, left in the heap otherwise


def _host_positions(flushed: list[tuple[Flushing, int]]) -> list:
    """The positions of each ``(layer, t)``'s oldest ``t`` hot tokens on the host, ``[B,
    t]`` (None each without positions): from a device, in one copy for all of them (a wait
    each on a GPU otherwise)."""
    stores = [layer._hot.pos_store for layer, _ in flushed]
    if any(s is None for s in stores):
        return [None] * len(flushed)
    pieces = [s[:t] for s, (_, t) in zip(stores, flushed)]
    if pieces[0].device.type == "cpu":
        return [p.t() for p in pieces]
    host = torch.cat([p.reshape(-1) for p in pieces]).cpu()
    split = host.split([p.numel() for p in pieces])
    return [h.view(p.shape).t() for h, p in zip(split, pieces)]


def finish_forward(step: StepInputs) -> None:
    """A hooked forward's end: the layers' new tokens that waited, appended to their hot windows
    together (``hot_window.append_together``: a handful of ops for all layers, where each
    layer's own append is four), the flushes that makes due, and every flush waiting
    (:func:`flush_together`)."""
    appends, step.appends = step.appends, []
    if appends:
        encode = appends[0][0]._value_encoder()
        append_together([(layer._hot, k, v, pos) for layer, k, v, pos in appends], encode)
        for layer, _, v, _ in appends:
            layer._flush(v)
    flushes, step.flushes = step.flushes, []
    flush_together(flushes)
