"""``KakeyaLayer``: one full-attention layer's KV cache, block-compressed by the codec.

Layout of a layer holding ``L`` tokens (per batch row, per kv-head)::

    [ block 0 | block 1 | ... | block n-1 | hot window ]
      compressed, block_size tokens each    >= residual_length tokens: keys in the hot
                                            dtype, values as int8 rows (or in the hot dtype)

New tokens land in the hot window (``hot_window.py``: token-major stores with a little room, so
a decode step appends in place). The layer composes one class per job, each in its own module,
all reading the state ``_clear`` sets up here:

* :class:`~.sinks.SinkSlots` (``sinks.py``): the first ``sink_tokens`` real tokens of each row,
  held exact beside the codes;
* :class:`~.flushing.Flushing` (``flushing.py``): coding the window's oldest whole blocks, alone
  or with the other layers at a forward's end;
* :class:`~.device_held.DeviceHeld` (``device_held.py``): blocks held on the model's device only;
* :class:`~.decoded.DecodedBlocks` (``decoded.py``): decoding blocks for callers that want dense
  keys and values, under the decoded budget;
* :class:`~.report.LayerMemory` (``report.py``): the bytes held.

Blocks are coded by the model's :class:`~kakeyaturbo.pipeline.Pipeline` (the same round trip the
evaluation measures).

Attention over the codes (the default with ``KakeyaCache.from_model`` on an sdpa model): the model
attends through the "kakeya" attention, and ``update`` returns only the new tokens and hands the
blocks and the other exact tokens (sinks held in blocks, hot window) to that attention
(``coded_attention.py``), which reads the codes without building dense keys or values. Where it
reads them on the model's device (a GPU), the layer holds its blocks there only, from the first
flush on (``_on_device``: coded there by the torch encoder, ``device_encode.py``, the host
keeps none), and decodes them there when a caller wants them dense.

Decoding (every other caller, or a decoded budget): every step returns the whole
``[B, H, L, D]`` keys and values (transformers' attention needs them; ``decoded.py``). Tokens
that arrive in a forward are attended at full precision in that forward, before they are
compressed; every budget setting returns the same values, except that the contiguous buffer
holds a forward's own new tokens as the hot window does (hot dtype, int8 values) already in
that forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..gpu import device_decode
from . import int8_rows
from ._compat import CacheLayerMixin
from .blocks import Block, storage_bytes
from .coded_attention import CodedView, LayerBlocks
from .context import APPEND_TOGETHER_TOKENS, CacheContext
from .decoded import DecodedBlocks
from .device_held import DeviceHeld
from .flushing import Flushing
from .hot_window import HotWindow, append_together, keep_together
from .report import LayerMemory
from .rope import RotarySpec
from .sinks import SinkSlots


class KakeyaLayer(SinkSlots, Flushing, DeviceHeld, DecodedBlocks, LayerMemory, CacheLayerMixin):
    """A full-attention cache layer whose old tokens are held as codec blocks."""

    is_sliding = False
    is_compileable = False
    # Blocks only ever hold tokens older than the hot window, so rolling back fewer than
    # `residual_length` tokens (assisted decoding) never touches compressed data.
    is_croppable = True

    def __init__(
        self,
        layer_idx: int,
        residual_length: int,
        sink_tokens: int,
        context: CacheContext,
        rope: RotarySpec | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.block_size = context.pipeline.recipe.block_size
        self.residual_length = residual_length
        self.sink_tokens = sink_tokens
        self._ctx = context
        self._rope = rope
        self._clear()

    def __repr__(self) -> str:
        return (
            f"KakeyaLayer(layer={self.layer_idx}, tokens={self._len}, blocks={len(self._blocks)}, "
            f"hot={0 if self._hot_k is None else self._hot_k.shape[-2]})"
        )

    # ---- state ---------------------------------------------------------------------------------

    def _clear(self) -> None:
        # Tensors below are None until the first update (typed Any: set by lazy_initialization).
        self.keys = self.values = None  # transformers' attribute; this layer holds no dense copy
        self.is_initialized = False
        # The hot window (hot_window.py), read through _hot_k, _hot_v and _hot_pos.
        self._hot: HotWindow | None = None
        self._blocks: list[Block] = []
        # Where attention reads the blocks off the CPU kernels (a model on a GPU), their only
        # copy, on that device: {"k": DeviceBlocks, "v": DeviceBlocks}; None where they are
        # held on the host (the CPU kernels read them there). Set at the first flush.
        self._on_device: dict[str, device_decode.DeviceBlocks] | None = None
        self._held: LayerBlocks | None = None  # the blocks as attention reads them (lazy)
        self._sink_idx: Any = None  # [B, S] long: cache slot of each row's s-th sink token
        # The same on the host (the same tensor on the CPU): which slots are sinks is asked in
        # every layer of a prompt, and on a GPU each question would wait for the device.
        self._sink_slots: Any = None
        self._sink_end = 0  # past the last sink slot (rows selected later may end sooner)
        self._sink_k: Any = None  # [B, S, H, D] exact sink keys/values
        self._sink_v: Any = None
        self._len = 0
        self._rows = self._heads = 0
        self._v_dim = 0
        self._hot_float: Any = None  # the hot dtype (keys, sinks; values unless int8 rows)
        # Contiguous decoded buffer ([B, H, capacity, D]), held under the decoded budget.
        self._buf_k: Any = None
        self._buf_v: Any = None
        self._buf_pending: list[Block] = []  # blocks compressed but not yet decoded into it
        self._buf_refused = False  # the budget could not hold it; retried after crop/reset

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dim() != 4 or value_states.dim() != 4:
            raise ValueError(
                "KakeyaLayer expects [batch, kv_heads, tokens, head_dim] states, got keys "
                f"{tuple(key_states.shape)} "
                f"and values {tuple(value_states.shape)}"
            )
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, _ = key_states.shape
        self._rows, self._heads, self._v_dim = b, h, value_states.shape[-1]
        hot = self._ctx.hot_dtype or key_states.dtype
        self._hot_float = hot
        pos = None
        if self._rope is not None:
            pos = torch.empty((b, 0), dtype=torch.int32, device=self.device)
        self._set_hot(key_states[:, :, :0].to(hot), self._held_values(value_states[:, :, :0]), pos)
        self.is_initialized = True

    @property
    def _offset(self) -> int:
        """Position of the first token held (a sliding layer forgets the oldest)."""
        return 0

    @property
    def compressed_length(self) -> int:
        """Tokens held in compressed blocks."""
        return len(self._blocks) * self.block_size

    @property
    def _hot_k(self) -> Any:
        """The hot window's keys ``[B, H, T_hot, D]`` in the hot dtype (the model's unless
        set); a view, None before the first update."""
        return None if self._hot is None else self._hot.keys

    @property
    def _hot_v(self) -> Any:
        """Its values as held: in the hot dtype, or int8 rows ``[B, H, T_hot, D + 2]`` with
        int8_hot_values (read them through _hot_values)."""
        return None if self._hot is None else self._hot.values

    @property
    def _hot_pos(self) -> Any:
        """Its ``[B, T_hot]`` int32 positions, pre-RoPE mode only (else None)."""
        return None if self._hot is None else self._hot.positions

    def _set_hot(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor | None) -> None:
        """Make copies of ``k``, ``v`` (as held), ``pos`` the hot window."""
        self._hot = HotWindow.of(k, v, pos)

    def _held_values(self, v: torch.Tensor) -> torch.Tensor:
        """Values ``[..., D]`` as the hot window holds them (a new tensor)."""
        encode = self._value_encoder()
        if encode is not None:
            return encode(v)
        return v.to(self._hot_float, copy=True, memory_format=torch.contiguous_format)

    def _read_values(self, held: torch.Tensor) -> torch.Tensor:
        """Values as the hot window holds them -> ``[..., D]`` as attention reads them: in the
        hot dtype, or decoded from int8 rows to float32."""
        return int8_rows.decode(held) if self._ctx.int8_hot_values else held

    def _hot_values(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Hot values ``lo..hi`` ``[B, H, n, D]`` as attention reads them."""
        return self._read_values(self._hot_v[:, :, lo:hi])

    def _keep_hot(self, lo: int, hi: int) -> None:
        """Keep hot tokens ``lo..hi`` only (copied: a view would keep the whole window)."""
        self._hot = keep_together([(self._hot, lo, hi)])[0]

    def _append_hot(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor | None) -> None:
        """Append tokens to the hot window, as it holds them (the hot dtype, int8 rows)."""
        append_together([(self._hot, k, v, pos)], self._value_encoder())

    def _value_encoder(self) -> Callable[..., torch.Tensor] | None:
        """What turns values into the hot window's int8 rows (None: held as they are)."""
        return int8_rows.encode if self._ctx.int8_hot_values else None

    def _held_blocks(self) -> LayerBlocks:
        """The blocks as attention over the codes reads them, built once per change of them."""
        if self._held is None:
            self._held = LayerBlocks.of(self, self._sinks_in_blocks())
        return self._held

    # ---- CacheLayerMixin API ---------------------------------------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new states; return all keys and values of this layer (decoded + exact), or,
        when the model attends over the codes, only the new ones (that attention reads the
        blocks and the held exact tokens from this forward's CodedView)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_states(key_states, value_states)
        q = key_states.shape[-2]
        start = self._len
        if q and self.sink_tokens and self._sink_idx is None:
            self._init_sinks(q)
        if q and self._sink_idx is not None:
            self._capture_sinks(key_states, value_states, start)
        positions = None
        if self._rope is not None:
            positions = self._step_positions(q, self._offset + start)

        # A sliding layer (sliding_layer.py) forgets its oldest tokens: no buffer, no codes
        # handed to attention (the window's mask is the model's attention's).
        if self._ctx.budget.limit and not self.is_sliding and self._buffer_ready(start + q):
            # As the hot window holds them (rounded to the hot dtype, if one is set).
            self._buf_k[:, :, start : start + q] = key_states.to(self._hot_k.dtype)
            self._buf_v[:, :, start : start + q] = self._read_values(
                self._held_values(value_states)
            )
            full_k, full_v = self._buf_k[:, :, : start + q], self._buf_v[:, :, : start + q]
        elif (
            self._ctx.step.coded_attention
            and self._blocks
            and not self._ctx.budget.limit
            and not self.is_sliding
        ):
            # Attention reads the blocks' codes itself (hf/coded_attention.py): hand it the
            # blocks and the held exact tokens as they are now (this forward's flush and append
            # come after) and return only the new tokens. (A decoded budget asks for decoded
            # blocks to be kept: the dense path.)
            view = CodedView(self, self._held_blocks())
            self._ctx.step.coded[self.layer_idx] = view
            full_k, full_v = view.exact_part(key_states, value_states)
        elif not self._blocks and not self._hot_k.shape[-2]:
            # Nothing held yet (a prompt's first forward): attention reads the forward's own
            # states, as DynamicCache's first update returns them, with no copy.
            full_k, full_v = key_states, value_states
        else:
            old_k, old_v = self._materialize()
            hot_k, hot_v = self._hot_k.to(self.dtype), self._hot_values().to(self.dtype)
            full_k = torch.cat([*old_k, hot_k, key_states], dim=-2)
            full_v = torch.cat([*old_v, hot_v, value_states], dim=-2)
            self._overwrite_sinks(full_k, full_v, 0, self.compressed_length, 0)

        self._len += q
        step = self._ctx.step
        if step.hooked and 0 < q <= APPEND_TOGETHER_TOKENS:
            # Appended, and flushed if due, at the forward's end with every layer's new tokens
            # (finish_forward): this forward's attention reads them from `update`'s return.
            step.appends.append((self, key_states, value_states, positions))
            return full_k, full_v
        self._append_hot(key_states, value_states, positions)
        self._flush(value_states)
        return full_k, full_v

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        """(kv_length, kv_offset) for the attention mask: every held token is visible."""
        if isinstance(query_length, torch.Tensor):  # pre-5.5 passed cache_position
            query_length = query_length.shape[0]
        return self._len + int(query_length), 0

    def get_seq_length(self) -> int:
        """Tokens held (compressed + exact)."""
        return self._len

    def get_max_length(self) -> int:
        """No maximum: the layer grows with the context."""
        return -1

    def reset(self) -> None:
        """Drop every token and release the decoded budget this layer held."""
        self._release_decoded()
        self._drop_buffer()
        self._ctx.pipeline.forget(self.layer_idx)
        self._clear()

    def offload(self) -> None:  # KakeyaCache never enables offloading
        pass

    def prefetch(self) -> None:
        pass

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (transformers >= 5.15 convention).

        Cropping into a compressed block decodes that block and keeps its surviving head as
        full-precision hot tokens; they are re-encoded (a second lossy pass) when the window
        flushes again.
        """
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise TypeError(f"crop takes an int, got {type(tokens_to_remove).__name__}")
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache "
                "instead."
            )
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._drop_buffer()  # rebuilt lazily by the next update
        self._buf_refused = False
        self._held = None
        new_len = max(self._len + tokens_to_remove, 0)
        clen = self.compressed_length
        if new_len >= clen:
            self._keep_hot(0, new_len - clen)
        else:
            whole, rest = divmod(new_len, self.block_size)
            tail = self._blocks[whole] if rest else None
            if tail is not None:
                tk, tv = self._decode_blocks([tail])
            self._keep_blocks(0, whole)
            if tail is not None:
                tk, tv = tk[:, :, :rest].clone(), tv[:, :, :rest].clone()
                # Sinks were encoded as the block mean: put the exact ones back.
                lo = whole * self.block_size
                self._overwrite_sinks(tk, tv, lo, new_len, lo)
                self._set_hot(
                    tk.to(self._hot_k.dtype),
                    self._held_values(tv),
                    None if self._hot_pos is None else tail.positions[:, :rest],
                )
            else:
                self._keep_hot(0, 0)
        # Sinks at slots >= new_len are re-captured when those slots are written again.
        self._len = new_len

    def _keep_blocks(self, lo: int, hi: int) -> None:
        """Keep blocks ``lo..hi`` only: the others' decoded copies released, the device's runs
        cut to the kept ones (the tokens' count is the caller's)."""
        for blk in self._blocks[:lo] + self._blocks[hi:]:
            self._drop_decoded(blk)
        self._blocks = self._blocks[lo:hi]
        self._held = None
        if self._on_device is not None:
            held, self._on_device = self._on_device, None
            if hi > lo:
                self._on_device = {s: run.take(range(lo, hi)) for s, run in held.items()}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder batch rows for beam search (streams are re-pointed, not re-encoded)."""
        if self.is_initialized:
            self._select_rows(_row_index(beam_idx, "beam_idx"))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times (rows share their compressed streams)."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be a positive int, got {repeats!r}")
        if self.is_initialized:
            self._select_rows(torch.arange(self._rows).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows in ``indices``."""
        if self.is_initialized:
            self._select_rows(_row_index(indices, "indices").cpu())

    # ---- internals -----------------------------------------------------------------------

    def _check_states(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(
                f"keys {tuple(k.shape)} and values {tuple(v.shape)} must be [B, H, T, D] "
                "with equal B, H, T"
            )
        want = (self._rows, self._heads, self._hot_k.shape[-1], self._v_dim)
        got = (k.shape[0], k.shape[1], k.shape[-1], v.shape[-1])
        if got != want:
            raise ValueError(
                f"layer {self.layer_idx}: states of (batch, kv_heads, k_dim, v_dim) = {got} do "
                f"not match the cache's {want}; use batch_select_indices / "
                "batch_repeat_interleave to change the batch"
            )

    def _step_positions(self, q: int, start: int) -> torch.Tensor:
        """RoPE positions of the tokens arriving now: the forward's position_ids when the model
        hook saw them, else start..start+q (what the model itself uses without position_ids).
        Every layer of a forward asks for the same ones: made once (never written to)."""
        key = (q, start, self._rows, str(self.device))
        return self._ctx.step.once("positions", key, lambda: self._new_positions(q, start))

    def _new_positions(self, q: int, start: int) -> torch.Tensor:
        pos = self._ctx.step.position_ids
        if pos is not None:
            if pos.dim() != 2:
                raise NotImplementedError(
                    "pre_rope supports 2-D position_ids; got shape "
                    f"{tuple(pos.shape)} (multimodal RoPE?)"
                )
            if pos.shape[-1] == q and pos.shape[0] in (1, self._rows):
                return pos.to(device=self.device, dtype=torch.int32).expand(self._rows, q).clone()
        return (
            torch.arange(start, start + q, dtype=torch.int32, device=self.device)
            .expand(self._rows, q)
            .clone()
        )

    def _select_rows(self, rows: torch.Tensor) -> None:
        """Rebuild every per-row structure for batch rows ``rows`` (reorder, select, repeat)."""
        rows_dev = rows.to(self.device)
        before, order = self._rows, rows.tolist()
        self._held = None
        if self._buf_k is not None:
            if len(order) == self._rows:  # beam reorder: same bytes, keep the buffer
                self._buf_k = self._buf_k.index_select(0, rows_dev)
                self._buf_v = self._buf_v.index_select(0, rows_dev)
            else:
                self._drop_buffer()
                self._buf_refused = False
        self._hot = self._hot.select_rows(rows_dev)
        if self._sink_idx is not None:
            self._set_sink_slots(self._sink_slots.index_select(0, rows.cpu()))
            self._sink_k = self._sink_k.index_select(0, rows_dev)
            self._sink_v = self._sink_v.index_select(0, rows_dev)
        if self._on_device is not None:
            every = range(len(self._blocks))
            self._on_device = {
                s: held.take(every, before, order) for s, held in self._on_device.items()
            }
        for blk in self._blocks:
            if blk.k is not None:
                blk.k = blk.k.select_rows(order, before)
                blk.v = blk.v.select_rows(order, before)
            if blk.pos is not None:
                blk.place(blk.pos.index_select(0, rows_dev))
            if blk.decoded is not None:
                old = blk.decoded
                self._drop_decoded(blk)
                new = tuple(t.index_select(0, rows_dev) for t in old)
                if self._ctx.budget.try_reserve(sum(storage_bytes(t) for t in new)):
                    blk.decoded = new
        self._rows = len(order)


def _row_index(index: Any, name: str) -> torch.Tensor:
    """A 1-D long tensor of batch rows; float or bool indices are refused (as DynamicCache's
    index_select refuses them) instead of being truncated."""
    t = torch.as_tensor(index)
    if t.dtype in (torch.bool,) or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{name} must hold integer row indices, got dtype {t.dtype}")
    return t.to(torch.long).reshape(-1)
