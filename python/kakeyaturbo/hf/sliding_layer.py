"""``SlidingKakeyaLayer``: a sliding-window layer's KV cache, block-compressed by the codec.

A sliding layer attends to its newest ``window`` tokens only, so it holds a bounded span::

    [ dropped ... | block i | block i+1 | hot window ]
      forgotten     the blocks any later query still sees, then the exact newest tokens

It is a :class:`~kakeyaturbo.hf.layer.KakeyaLayer` (same hot window, flushes, decoding) with
three differences. At the end of each update it forgets every whole block (and, before any block
is coded, every hot token) that no later query can see; every sliding layer forgets alike, since
the model's mask is made from the first one's sizes. It holds no attention sinks (the sequence's
first tokens leave the window). It always returns dense keys and values, so the model's own
attention applies the window's mask (``get_mask_sizes`` gives the first held token's position
as the mask's offset).
Coding pays only where the window is long against ``block_size + residual_length``: a layer
holds up to ``window - 1`` tokens, of which the newest ``residual_length`` and more stay exact.
"""

from __future__ import annotations

import torch

from .context import CacheContext
from .layer import KakeyaLayer
from .rope import RotarySpec


class SlidingKakeyaLayer(KakeyaLayer):
    """A sliding-window cache layer whose older tokens in the window are held as codec blocks."""

    # KakeyaLayer.update reads it too: no codes handed to attention, no decoded buffer.
    is_sliding = True

    def __init__(
        self,
        layer_idx: int,
        window: int,
        residual_length: int,
        context: CacheContext,
        rope: RotarySpec | None = None,
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        self.sliding_window = window
        super().__init__(layer_idx, residual_length, 0, context, rope)

    def __repr__(self) -> str:
        return (
            f"Sliding{super().__repr__()[:-1]}, window={self.sliding_window}, from={self._start})"
        )

    def reset(self) -> None:
        recording = self.record_past
        super().reset()
        self.record_past = recording

    def _clear(self) -> None:
        super()._clear()
        self._start = 0  # position of the first token held (tokens before it are forgotten)
        # transformers' name: assisted decoding sets it (activate_past_recording) so that the
        # tokens it may roll back stay held until its crop.
        self.record_past = False

    def activate_past_recording(self) -> None:
        """Forget nothing until the next :meth:`crop` (which then forgets what the window left),
        as transformers' sliding layers do for assisted decoding."""
        self.record_past = True

    @property
    def _offset(self) -> int:
        return self._start

    # ---- forgetting what the window left -------------------------------------------------------

    def _first_visible(self) -> int:
        """Position of the oldest token a later query sees: the next one's window starts there."""
        return self._start + self._len - self.sliding_window + 1

    def _forget(self, tokens: int) -> None:
        self._start += tokens
        self._len -= tokens

    def _forget_outside(self) -> None:
        """Forget the blocks, and while no block is held the hot tokens, no later query sees."""
        first, bs = self._first_visible(), self.block_size
        gone = max(min((first - self._start) // bs, len(self._blocks)), 0)
        if gone:
            self._keep_blocks(gone, len(self._blocks))
            self._forget(gone * bs)
        if not self._blocks:
            stale = min(first - self._start, self._hot_k.shape[-2])
            if stale > 0:
                self._keep_hot(stale, self._hot_k.shape[-2])
                self._forget(stale)

    def _flush(self, new_v: torch.Tensor) -> None:
        # Every update ends here, after its attention (forgetting sooner would break the mask
        # this forward was given). Tokens outside the window go first (a long prompt's are
        # never coded), then the coding, then the blocks left outside.
        if not self.record_past:
            self._forget_outside()
        held = self._hot_v.shape[-2]
        super()._flush(new_v[:, :, max(new_v.shape[-2] - held, 0) :])
        if not self.record_past:
            self._forget_outside()

    # ---- CacheLayerMixin API -------------------------------------------------------------------

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        """(kv_length, kv_offset): the held tokens and the new ones, from the first held."""
        if isinstance(query_length, torch.Tensor):  # pre-5.5 passed cache_position
            query_length = query_length.shape[0]
        return self._len + int(query_length), self._start

    def get_seq_length(self) -> int:
        """Tokens seen (as transformers' sliding layers count them), not the ones held."""
        return self._start + self._len

    def get_max_length(self) -> int:
        return self.sliding_window

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens, as long as the window that leaves still
        holds every token its next query sees; then forget what it no longer sees."""
        if isinstance(tokens_to_remove, int) and not isinstance(tokens_to_remove, bool):
            after = self.get_seq_length() + min(tokens_to_remove, 0)
            if self._start and after - self.sliding_window + 1 < self._start:
                raise RuntimeError(
                    f"layer {self.layer_idx}: cannot remove {-tokens_to_remove} tokens: this "
                    f"sliding layer has forgotten the tokens before position {self._start}, "
                    "which the window would then need"
                )
        super().crop(tokens_to_remove)
        if self.is_initialized:
            self._forget_outside()

    def _dense_tokens(self) -> int:
        # What DynamicSlidingWindowLayer holds: the ratio never counts the extra tokens held.
        return min(self._len, self.sliding_window - 1)
