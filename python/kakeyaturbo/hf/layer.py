"""``KakeyaLayer``: one full-attention layer's KV cache, block-compressed by the codec.

Layout of a layer holding ``L`` tokens (per batch row, per kv-head)::

    [ block 0 | block 1 | ... | block n-1 | hot window ]
      compressed, block_size tokens each    >= residual_length tokens: keys in the hot
                                            dtype, values as int8 rows (or in the hot dtype)

New tokens land in the hot window (``hot_window.py``: token-major stores with a little room, so
a decode step appends in place). In a forward the cache's model hook sees, a few new tokens per
row (a decode step's) wait for its end and go into every layer's window together
(:func:`finish_forward`), in one copy per kind: on a GPU each layer's append was four small
launches of its own. Whenever the hot window holds ``block_size`` tokens more than
``residual_length``, its oldest whole blocks are encoded in one batched codec call (one stream per
(block, batch row, kv-head)) and their full-precision copy is dropped. A long prompt therefore
compresses in one pass, from the values the prompt brought; tokens that waited in the window
(blocks flushed while generating) are coded from what it held. Blocks are coded by the model's
:class:`~kakeyaturbo.pipeline.Pipeline` (the same round trip the evaluation measures). The
first ``sink_tokens`` real tokens of each row (attention sinks, found from the prefill's
attention mask, so left padding is skipped) are held exact beside the streams; the pipeline
codes their block's mean in their place and they are written over their decoded slots.

Attention over the codes (the default with ``KakeyaCache.from_model`` on an sdpa model): the model
attends through the "kakeya" attention, and ``update`` returns only the new tokens and hands the
blocks and the other exact tokens (sinks held in blocks, hot window) to that attention
(``coded_attention.py``), which reads the codes without building dense keys or values. Where it
reads them on the model's device (a GPU), the layer holds its blocks there only, from the first
flush on (``_on_device``: coded there by the torch encoder, ``device_encode.py``, the host
keeps none), and decodes them there when a caller wants them dense. Such layers' flushes in a
forward wait for its end and are coded together (:func:`flush_together`): on a GPU a flush is
hundreds of small ops per layer otherwise, and sets a prompt's prefill time.

Decoding (every other caller, or a decoded budget): every step returns the whole
``[B, H, L, D]`` keys and values (transformers' attention needs them). Blocks are decoded on
demand; a decoded block is kept only while it fits the
cache's explicit ``decoded_cache_bytes`` budget (default 0: nothing decoded is kept, every step
decodes every block in one batched call). When the budget can hold the whole layer, the layer
keeps one contiguous decoded buffer instead: each block is decoded once (at the step after it
was compressed), new tokens are written in place, and ``update`` returns views of it, so a step
costs no decode and no O(L) copy. Otherwise single decoded blocks are kept while they fit.
Tokens that arrive in a forward are attended at full precision in that forward, before they are
compressed; every budget setting returns the same values, except that the contiguous buffer
holds a forward's own new tokens as the hot window does (hot dtype, int8 values) already in
that forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..gpu import device_decode
from ..pipeline import CodedBlock, Pipeline
from . import heap, int8_rows
from ._compat import CacheLayerMixin
from .budget import DecodedBudget
from .coded_attention import CodedView, LayerBlocks, reads_on_device
from .hot_window import HotWindow, append_together, keep_together
from .rope import RotarySpec

#: ``KakeyaCache``'s default ``flush_together_bytes``: exact tokens (and their forwards'
#: values) that flushes waiting for a forward's end may keep before they are coded together.
DEFERRED_FLUSH_BYTES = 8 << 20
#: A hooked forward of at most this many tokens per row (a decode step, a draft's check)
#: appends them to the hot windows at its end, every layer's together (:func:`finish_forward`).
APPEND_TOGETHER_TOKENS = 16


@dataclass
class StepInputs:
    """What the model hook saw for the forward in flight (position ids, 2-D attention mask),
    and what this forward's attention over the codes shares between layers."""

    position_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    # The model attends through kakeyaturbo's "kakeya" attention: a layer with blocks hands
    # the codes to it (`coded`, by layer index) instead of decoding them into dense K/V.
    coded_attention: bool = False
    coded: dict = field(default_factory=dict)
    # What every layer's attention over the codes would compute alike (RoPE angles of the
    # coded positions, the mask's bias): computed once per forward.
    shared: list = field(default_factory=list)
    # What every layer of a forward computes alike from equal arguments (the arriving tokens'
    # RoPE positions, the sinks' places in a span): per kind, (arguments, value) as the last
    # layer to ask made it (`once`).
    alike: dict = field(default_factory=dict)
    # Keys made ahead for a layer's attention (CodedView.prepare_next), by layer index:
    # (the LayerBlocks they were made from, the codec's PreparedKeys).
    prepared: dict = field(default_factory=dict)
    # The cache's model hook made this forward's inputs, and calls finish_forward at its
    # end: `appends` (layer, keys, values, positions: new tokens waiting to be appended to
    # its hot window), then `flushes` (layers, with their forward's values, waiting to flush).
    hooked: bool = False
    appends: list = field(default_factory=list)
    flushes: list = field(default_factory=list)

    def once(self, kind: str, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, made once for the layers asking ``kind`` with an equal ``key`` in turn
        (the value is shared: never written to)."""
        hit = self.alike.get(kind)
        if hit is None or hit[0] != key:
            hit = self.alike[kind] = (key, make())
        return hit[1]


@dataclass
class CacheContext:
    """State shared by all compressed layers of one cache."""

    budget: DecodedBudget
    pipeline: Pipeline  # frames fitted on a layer's first flushed tokens live here (aux bytes)
    step: StepInputs = field(default_factory=StepInputs)
    hot_dtype: torch.dtype | None = None  # exact tokens' storage dtype (None: the model's)
    # The hot window's values held as int8 rows (int8_rows.py) instead of in the hot dtype.
    int8_hot_values: bool = False
    # The arithmetic of the codec's key frame product on the CPU (cache.ATTENTION_PRECISIONS).
    attention_precision: str = "int16"
    # Make the next layer's keys on the codec's idle worker during a decode step.
    prepare_keys_ahead: bool = True
    # Device-held layers' flushes wait for the forward's end up to this many bytes waiting.
    flush_together_bytes: int = DEFERRED_FLUSH_BYTES
    # The compressed layer the model runs after each (weak references), by layer index.
    following: dict = field(default_factory=dict)


@dataclass(eq=False)  # identity: blocks are compared by `is`, never by content
class _Block:
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


def _storage_bytes(t: torch.Tensor | None) -> int:
    # Storage, not numel: a view would keep its whole base alive.
    return 0 if t is None else t.untyped_storage().nbytes()


class KakeyaLayer(CacheLayerMixin):
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
        self._blocks: list[_Block] = []
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
        self._buf_pending: list[_Block] = []  # blocks compressed but not yet decoded into it
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
        positions = self._step_positions(q, start) if self._rope is not None else None

        if self._ctx.budget.limit and self._buffer_ready(start + q):
            # As the hot window holds them (rounded to the hot dtype, if one is set).
            self._buf_k[:, :, start : start + q] = key_states.to(self._hot_k.dtype)
            self._buf_v[:, :, start : start + q] = self._read_values(
                self._held_values(value_states)
            )
            full_k, full_v = self._buf_k[:, :, : start + q], self._buf_v[:, :, : start + q]
        elif self._ctx.step.coded_attention and self._blocks and not self._ctx.budget.limit:
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
            for blk in self._blocks[whole:]:
                self._drop_decoded(blk)
            self._blocks = self._blocks[:whole]
            if self._on_device is not None:
                held, self._on_device = self._on_device, None
                if whole:
                    self._on_device = {s: run.take(range(whole)) for s, run in held.items()}
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

    # ---- accounting ------------------------------------------------------------------------------

    def memory_report(self) -> dict:
        """Bytes this layer holds, measured from what it holds."""
        seen, compressed = set(), 0
        if self._on_device is not None:  # the only copy, as the device holds it
            compressed = sum(held.nbytes for held in self._on_device.values())
        for blk in self._blocks:
            for coded in (blk.k, blk.v) if blk.k is not None else ():
                compressed += coded.norm_bytes
                for enc in coded.encs:
                    if id(enc) not in seen:  # rows repeated by batch_repeat_interleave share
                        seen.add(id(enc))
                        compressed += int(enc.nbytes)
        full = sum(
            _storage_bytes(t) for t in (self._hot_k, self._hot_v, self._sink_k, self._sink_v)
        )
        aux = _storage_bytes(self._hot_pos) + _storage_bytes(self._sink_idx)
        if self._sink_slots is not self._sink_idx:  # the host's copy (a model off the CPU)
            aux += _storage_bytes(self._sink_slots)
        # A flush's blocks hold views of one tensor of their positions: each storage once.
        held_pos = {
            b.pos.untyped_storage().data_ptr(): b.pos for b in self._blocks if b.pos is not None
        }
        aux += sum(_storage_bytes(p) for p in held_pos.values())
        device_copy = 0
        if self._held is not None:  # which sinks sit in blocks, kept for attention
            aux += _storage_bytes(self._held.sinks)
            device_copy = sum(held.nbytes for held in self._held.on_device.values())
        # The constant RoPE table counts while the layer holds tokens (reset frees the rest).
        if self._rope is not None and self.is_initialized:
            aux += _storage_bytes(self._rope.inv_freq)
        aux += self._ctx.pipeline.frame_bytes(self.layer_idx)
        decoded = sum(_storage_bytes(t) for b in self._blocks if b.decoded for t in b.decoded)
        decoded += _storage_bytes(self._buf_k) + _storage_bytes(self._buf_v)
        if self.is_initialized:
            per_token = self._rows * self._heads * (self._hot_k.shape[-1] + self._v_dim)
            dense = per_token * self._len * self.dtype.itemsize
            bf16 = per_token * self._len * 2
        else:
            dense = bf16 = 0
        return _report(
            "compressed",
            self._len,
            self.compressed_length,
            compressed,
            full,
            aux,
            decoded,
            bf16,
            dense,
            device_copy,
        )

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

    def _init_sinks(self, q: int) -> None:
        """Pick each row's sink slots: its first `sink_tokens` real (unpadded) tokens when the
        prefill's 2-D attention mask is known, else the first slots."""
        s, b, start = self.sink_tokens, self._rows, self._len
        mask = self._ctx.step.attention_mask
        # Every layer of a forward picks alike: once (the memo holds the mask, so its id stays).
        key = (s, b, start, q, id(mask))
        idx, end, _ = self._ctx.step.once(
            "sink slots", key, lambda: _sink_slots(s, b, start, q, mask)
        )
        self._set_sink_slots(idx.clone())  # the layer's own (its bytes counted per layer)
        self._sink_end = end
        self._held = None
        self._sink_k = self._sink_v = None  # made by the first capture (_capture_sinks)

    def _set_sink_slots(self, idx: torch.Tensor) -> None:
        """``idx`` (host, ``[B, S]`` long) as the sinks' slots, on the host and the device."""
        self._sink_slots = idx
        self._sink_idx = idx.to(self.device)

    def _capture_sinks(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        if start >= self._sink_end:  # every sink slot is written (a decode step's case)
            return
        lo, hi = start, start + k.shape[-2]
        run = self._sink_run(lo, hi)
        if self._sink_k is None:
            if run is not None and run[2] == self.sink_tokens:
                # Every sink arrives now (a prompt's first forward): the sinks are their copies.
                at, n, dtype = run[1], run[2], self._hot_k.dtype
                same = {"memory_format": torch.contiguous_format, "copy": True}
                self._sink_k = k[:, :, at : at + n].transpose(1, 2).to(dtype, **same)
                self._sink_v = v[:, :, at : at + n].transpose(1, 2).to(dtype, **same)
                return
            b, s, h = self._rows, self.sink_tokens, self._heads
            self._sink_k = self._hot_k.new_zeros((b, s, h, self._hot_k.shape[-1]))
            self._sink_v = self._hot_k.new_zeros((b, s, h, self._v_dim))
        if run is not None:  # the usual case: a copy each, converting as it goes
            first, at, n = run
            self._sink_k[:, first : first + n].copy_(k[:, :, at : at + n].transpose(1, 2))
            self._sink_v[:, first : first + n].copy_(v[:, :, at : at + n].transpose(1, 2))
            return
        places = self._sink_places(lo, hi, start, self.device)
        if places is not None:
            rows, slots, t = places
            self._sink_k[rows, slots] = k[rows, :, t].to(self._sink_k.dtype)
            self._sink_v[rows, slots] = v[rows, :, t].to(self._sink_v.dtype)

    def _sink_run(self, lo: int, hi: int) -> tuple | None:
        """(first sink, its slot - ``lo``, how many) where every row's sinks at cache slots
        [lo, hi) are the same consecutive sinks at the same consecutive slots (a prompt
        without padding, or padded alike), else None. Asked alike by every layer of a forward:
        made once."""
        at = self._sink_slots

        def make() -> tuple | None:
            sel = (at >= lo) & (at < hi)
            picked = sel[0].nonzero().flatten()
            if not picked.numel() or not bool((sel == sel[0]).all()):
                return None
            first, n = int(picked[0]), picked.numel()
            slots = at[:, first : first + n]
            if not bool(sel[0, first : first + n].all()):
                return None  # the picked sinks are not consecutive
            if not bool((slots == slots[0, 0] + torch.arange(n)).all()):
                return None
            return first, int(slots[0, 0]) - lo, n

        return self._ctx.step.once("sink run", (lo, hi, *self._slots_key()), make)

    def _overwrite_sinks(
        self, k: torch.Tensor, v: torch.Tensor, lo: int, hi: int, base: int
    ) -> None:
        """Write the exact sinks at cache slots in [lo, hi) into ``k``/``v`` (in place), whose
        index 0 is cache slot ``base``."""
        if self._sink_slots is None or hi <= lo:
            return
        places = self._sink_places(lo, hi, base, self.device)
        if places is not None:
            rows, slots, t = places
            k[rows, :, t] = self._sink_k[rows, slots].to(k.dtype)
            v[rows, :, t] = self._sink_v[rows, slots].to(v.dtype)

    def _sink_places(self, lo: int, hi: int, base: int, device: torch.device) -> tuple | None:
        """The sinks at cache slots [lo, hi) as (rows, which sinks, slots - ``base``) on
        ``device``, or None. Asked alike by every layer of a forward (equal slots): made once
        per device, from the host's copy of the slots."""
        at = self._sink_slots

        def make() -> tuple | None:
            sel = (at >= lo) & (at < hi)
            if not bool(sel.any()):
                return None
            rows, slots = sel.nonzero(as_tuple=True)
            return tuple(i.to(device) for i in (rows, slots, at[rows, slots] - base))

        key = (lo, hi, base, *self._slots_key())
        return self._ctx.step.once(f"sink places on {device}", key, make)

    def _slots_key(self) -> tuple:
        """The sinks' slots as a memo's key (their values: another batch's slots differ)."""
        return tuple(self._sink_slots.shape), self._sink_slots.numpy().tobytes()

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

    def _sinks_in_blocks(self) -> torch.Tensor | None:
        """[B, S] bool: which sinks sit in a compressed block (their coded slot holds the block
        mean; attention over the codes reads them exact instead), or None."""
        if self._sink_slots is None:
            return None
        inside = self._sink_slots < self.compressed_length
        return inside.to(self.device) if bool(inside.any()) else None

    def _sink_mask(self, start: int, t: int) -> torch.Tensor | None:
        """[B, t] bool: which of cache slots start..start+t are sinks (held exact)."""
        if self._sink_slots is None:
            return None

        def make() -> torch.Tensor | None:
            places = self._sink_places(start, start + t, start, torch.device("cpu"))
            if places is None:
                return None
            rows, _, slots = places
            mask = torch.zeros((self._rows, t), dtype=torch.bool)
            mask[rows, slots] = True
            return mask

        key = (start, t, self._rows, *self._slots_key())
        return self._ctx.step.once("sink mask", key, make)

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
        return sum(_storage_bytes(t) for t in (self._hot_k, self._hot_v, new_v))

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
            placed = _block_positions(pos, host_pos, n, bs, self._ctx.step)
        for j, (at, key) in enumerate(placed):
            blk = _Block(k=enc_k[j], v=enc_v[j], tokens=bs, pos=at, pos_key=key)
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

    def _holds_on_device(self) -> bool:
        """Whether the layer's blocks go to its device only: where attention over the codes
        decodes them there (off the CPU kernels) and the device's decoder reads them (the
        recipes' water-filled blocks, not every ``CodecParams``). Decided at a first flush."""
        recipe, li = self._ctx.pipeline.recipe, self.layer_idx
        readable = all(device_decode.reads(recipe.params(li, s)) for s in ("k", "v"))
        return readable and reads_on_device(self.device)

    def _hold_on_device(self, added: dict[str, device_decode.DeviceBlocks]) -> None:
        """Add a flush's blocks, coded on the layer's device (attention reads them there, off
        the CPU kernels), to those it holds there: joined to the held ones; the host never
        holds them, so the codes are held once."""
        if self._on_device is not None:
            held = self._on_device
            added = {s: device_decode.DeviceBlocks.joined([held[s], added[s]]) for s in added}
        self._on_device = added

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

    def _decode_blocks(self, blocks: list[_Block]) -> tuple[torch.Tensor, torch.Tensor]:
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
            self._ctx.budget.release(_storage_bytes(self._buf_k) + _storage_bytes(self._buf_v))
        self._buf_k = self._buf_v = None
        self._buf_pending = []

    def _drop_decoded(self, blk: _Block) -> None:
        if blk.decoded is not None:
            self._ctx.budget.release(sum(_storage_bytes(t) for t in blk.decoded))
            blk.decoded = None

    def _release_decoded(self) -> None:
        for blk in self._blocks:
            self._drop_decoded(blk)

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
                if self._ctx.budget.try_reserve(sum(_storage_bytes(t) for t in new)):
                    blk.decoded = new
        self._rows = len(order)


def _sink_slots(s: int, b: int, start: int, q: int, mask: torch.Tensor | None) -> tuple:
    """(host ``[b, s]`` cache slots of each row's sinks, past the last of them, ``mask``) for a
    forward of ``q`` tokens from slot ``start``: each row's first ``s`` real (unpadded) tokens
    where its 2-D attention mask is known, else the first slots."""
    idx = torch.arange(start, start + s).expand(b, s).clone()
    if mask is not None and mask.dim() == 2 and mask.shape == (b, start + q):
        new = mask[:, start:].bool().cpu()
        for r in range(b):
            real = new[r].nonzero().flatten()[:s]
            pad_after = torch.arange(q, q + s - real.numel())  # sinks still to come
            idx[r] = start + torch.cat([real, pad_after])
    return idx, int(idx.max()) + 1, mask


def _block_positions(pos: torch.Tensor, host: torch.Tensor, n: int, bs: int, step) -> list:
    """Each of ``n`` flushed blocks' stored positions (``_Block.pos``) and their bytes, from the
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


def flush_together(waiting: list[tuple[KakeyaLayer, torch.Tensor]]) -> None:
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


def _commit_flushes(done: list[tuple[KakeyaLayer, int, list, list]]) -> None:
    """Hold each ``(layer, n, enc_k, enc_v)``'s ``n`` flushed blocks (:meth:`KakeyaLayer.
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


def _host_positions(flushed: list[tuple[KakeyaLayer, int]]) -> list:
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
    layer's append was four), the flushes that makes due, and every flush waiting
    (:func:`flush_together`)."""
    appends, step.appends = step.appends, []
    if appends:
        encode = appends[0][0]._value_encoder()
        append_together([(layer._hot, k, v, pos) for layer, k, v, pos in appends], encode)
        for layer, _, v, _ in appends:
            layer._flush(v)
    flushes, step.flushes = step.flushes, []
    flush_together(flushes)


def _row_index(index: Any, name: str) -> torch.Tensor:
    """A 1-D long tensor of batch rows; float or bool indices are refused (as DynamicCache's
    index_select refuses them) instead of being truncated."""
    t = torch.as_tensor(index)
    if t.dtype in (torch.bool,) or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{name} must hold integer row indices, got dtype {t.dtype}")
    return t.to(torch.long).reshape(-1)


def _report(
    kind, tokens, compressed_tokens, compressed, full, aux, decoded, bf16, dense, device_copy=0
) -> dict:
    total = compressed + full + aux + decoded + device_copy
    return {
        "kind": kind,
        "tokens": tokens,
        "compressed_tokens": compressed_tokens,
        "compressed_bytes": compressed,
        "full_precision_bytes": full,
        "aux_bytes": aux,
        "decoded_cache_bytes": decoded,
        "device_copy_bytes": device_copy,
        "total_bytes": total,
        "bf16_equivalent_bytes": bf16,
        "dense_bytes": dense,
        "ratio": dense / total if total else 1.0,
        "ratio_vs_bf16": bf16 / total if total else 1.0,
    }
