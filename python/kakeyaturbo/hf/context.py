"""What one cache's compressed layers share: the cache's settings (:class:`CacheContext`) and
what the model hook saw of the forward in flight (:class:`StepInputs`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..pipeline import Pipeline
from .budget import DecodedBudget

#: ``KakeyaOptions``' default ``flush_together_bytes``: exact tokens (and their forwards'
#: values) that flushes waiting for a forward's end may keep before they are coded together.
DEFERRED_FLUSH_BYTES = 8 << 20
#: A hooked forward of at most this many tokens per row (a decode step, a draft's check)
#: appends them to the hot windows at its end, every layer's together (``flushing.finish_forward``).
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
    # The arithmetic of the codec's key frame product on the CPU (options.ATTENTION_PRECISIONS).
    attention_precision: str = "int16"
    # Make the next layer's keys on the codec's idle worker during a decode step.
    prepare_keys_ahead: bool = True
    # Device-held layers' flushes wait for the forward's end up to this many bytes waiting.
    flush_together_bytes: int = DEFERRED_FLUSH_BYTES
    # The compressed layer the model runs after each (weak references), by layer index.
    following: dict = field(default_factory=dict)
