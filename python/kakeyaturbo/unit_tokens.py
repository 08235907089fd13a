"""Whether a layer's stream is coded as unit vectors with their norms beside (token norms).

The recipe chooses token norms per stream (``v_token_norms``: values by default). A stream whose
tokens put most of their energy in one direction of its coding frame (a value channel 100x
the others that the output projection does not read down, a large bias) is coded without them
all the same: as unit vectors its other coordinates are divided by
that one coordinate, heavy-tailed where it crosses zero, and they fill the sparse outliers (on a
100x channel, 19% more bytes and 3.8x the error on the other channels, ``tests/unit/
test_outlier_channels.py``). The pipeline decides once per sequence and layer, on the first
tokens it codes; decoders read the choice from the blocks (they hold norms or none).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from .coded_block import STREAMS

#: Tokens putting more than this share of their energy in one direction are coded without
#: token norms. High, since token norms are what keeps small-norm tokens that draw attention
#: exact on real models: SmolLM2's values reach 0.61 (layer 0); a channel 30x the others
#: (a share of 0.96) passes it.
DOMINANT_SHARE = 0.9


def dominant_share(x: torch.Tensor, sinks: Optional[torch.Tensor] = None) -> Optional[float]:
    """The largest share of ``x`` ``[B, H, T, D]``'s energy one direction holds, over its heads:
    the top eigenvalue of each head's second moment over its trace (basis-free; the caller's
    exact ``sinks`` ``[B, T]`` are left out). None where ``x`` is not finite (the codec
    refuses it by name)."""
    x = x.detach().double()
    if sinks is not None:
        x = x * (~sinks.to(x.device).bool())[:, None, :, None]
    top = x.abs().amax()
    if not bool(torch.isfinite(top)):
        return None
    if float(top) == 0.0:
        return 0.0
    x = x / top  # the share is scale-free; this keeps the moments in range
    moment = torch.einsum("bhtd,bhte->hde", x, x)
    trace = moment.diagonal(dim1=-2, dim2=-1).sum(-1)
    largest = torch.linalg.eigvalsh(moment)[:, -1]
    return float((largest / trace.clamp_min(1e-300)).max())


def holds_norms(blocks: Any) -> bool:
    """Whether ``blocks`` (a list of coded blocks, a block run or blocks held on a device) were
    coded with token norms (a run across heads holds them as per-head scales)."""
    if isinstance(blocks, (list, tuple)):
        return bool(blocks) and blocks[0].norms is not None
    return getattr(blocks, "norms", None) is not None or getattr(blocks, "scales", None) is not None


class TokenNormChoice:
    """One sequence's choice per (layer, stream): coded with token norms or not. The recipe's
    choice, unless the first tokens coded put more than ``DOMINANT_SHARE`` of their energy in
    one direction; decided once, on the first call of :meth:`decide`."""

    def __init__(self, recipe: Any) -> None:
        self._recipe = recipe
        self._made: dict[tuple[int, str], bool] = {}

    def decide(
        self,
        x: torch.Tensor,
        layer: int,
        stream: str,
        sinks: Optional[torch.Tensor] = None,
        into_frame: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ) -> bool:
        """The choice for ``layer``'s ``stream``, made on ``x`` ``[B, H, T, D]`` (``sinks``
        left out; taken into the coding frame by ``into_frame`` where given, since a
        bundle's frame may weigh channels) if it is not made yet."""
        key = (layer, stream)
        if key not in self._made:
            if not self._recipe.token_norms(stream):
                self._made[key] = False
            else:
                share = dominant_share(x if into_frame is None else into_frame(x), sinks)
                if share is None:  # not finite: the codec refuses it, nothing is decided
                    return True
                self._made[key] = share <= DOMINANT_SHARE
        return self._made[key]

    def of(self, layer: int, stream: str) -> bool:
        """The choice made, or the recipe's where none is made yet."""
        return self._made.get((layer, stream), self._recipe.token_norms(stream))

    def restore(self, layer: int, stream: str, norms: bool) -> None:
        """Take the choice blocks already coded show (a loaded cache)."""
        self._made[(layer, stream)] = norms

    def forget(self, layer: int) -> None:
        """Drop ``layer``'s choices (a new sequence makes its own)."""
        for stream in STREAMS:
            self._made.pop((layer, stream), None)
