"""One cap on the memory a call may decode or prepare from coded layers, for every entry point.

The rule is the codec's (``rust/kakeyaturbo/src/format/layout.rs``, ``check_decode_size``):
the layers of one call may declare at most ``max(DECODE_FLOOR, stored * DECODE_AMPLIFICATION)``
decoded float32 bytes, ``stored`` being their encoded size. A single blob meets it when it is
parsed and ``decode_batch`` checks its whole batch in the core; this applies the same rule to
what ``prepare_keys`` and the attention calls take, and to a saved cache being loaded, so that
many small honest-looking blobs cannot add up to an allocation no single blob could make.

``KAKEYATURBO_MAX_DECODED_BYTES`` (bytes) or :func:`set_decode_limit` lowers the cap further
for every call: a server's ceiling on what one request may make the codec allocate. Neither
raises it: the rule is the bound the reader holds each blob to.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from ._core import FormatError

__all__ = [
    "DECODE_AMPLIFICATION",
    "DECODE_FLOOR",
    "check_decode_limit",
    "check_totals",
    "decode_limit",
    "layer_totals",
    "set_decode_limit",
]

#: Decoded bytes always allowed, whatever the stored size (layout.rs DECODE_FLOOR).
DECODE_FLOOR = 64 << 20
#: Decoded bytes allowed per stored byte beyond the floor (layout.rs DECODE_AMPLIFICATION).
DECODE_AMPLIFICATION = 256
ENV = "KAKEYATURBO_MAX_DECODED_BYTES"
_ceiling: int | None = None


def set_decode_limit(max_bytes: int | None) -> None:
    """Lowers the cap to ``max_bytes`` decoded bytes per call, process-wide, beside ``ENV``
    (the lower of the two holds); None removes this ceiling."""
    global _ceiling
    if max_bytes is not None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
            raise TypeError(f"max_bytes: expected an int or None, got {type(max_bytes).__name__}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes: {max_bytes} must be >= 0")
    _ceiling = max_bytes


def decode_limit(stored: int) -> int:
    """The decoded bytes allowed from ``stored`` encoded bytes, ``ENV`` and
    :func:`set_decode_limit` applied."""
    limit = max(DECODE_FLOOR, stored * DECODE_AMPLIFICATION)
    if _ceiling is not None:
        limit = min(limit, _ceiling)
    ceiling = os.environ.get(ENV)
    if ceiling:
        try:
            cap = int(ceiling)
        except ValueError:
            raise ValueError(f"{ENV}={ceiling!r}: expected a whole number of bytes") from None
        if cap < 0:
            raise ValueError(f"{ENV}={ceiling!r}: must be >= 0")
        limit = min(limit, cap)
    return limit


def layer_totals(layers: Sequence[Any]) -> tuple[int, int]:
    """(decoded float32 bytes declared, stored bytes) of ``layers``: objects with ``shape``
    ``(tokens, head_dim)`` and ``nbytes`` (:class:`~kakeyaturbo.EncodedLayer` or the core's)."""
    decoded = stored = 0
    for e in layers:
        n, d = e.shape
        decoded += n * d * 4
        stored += e.nbytes
    return decoded, stored


def check_totals(decoded: int, stored: int, what: str) -> None:
    """A ``FormatError`` naming ``what`` when ``decoded`` bytes from ``stored`` pass the cap."""
    limit = decode_limit(stored)
    if decoded > limit:
        raise FormatError(
            f"{what} would decode to {decoded} bytes from {stored} stored: beyond the decode "
            f"limit ({limit} bytes; {ENV} or set_decode_limit lowers it)"
        )


def check_decode_limit(what: str, *runs: Sequence[Any]) -> None:
    """:func:`check_totals` of every layer of ``runs`` together (see :func:`layer_totals`):
    what one call may decode or prepare. A run that carries its ``totals`` (the codec's
    ``CoreLayers``, counted once when made) is not counted again."""
    decoded = stored = 0
    for run in runs:
        d, s = getattr(run, "totals", None) or layer_totals(run)
        decoded += d
        stored += s
    check_totals(decoded, stored, f"{what}: {sum(len(r) for r in runs)} layers")
