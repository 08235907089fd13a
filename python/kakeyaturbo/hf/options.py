"""``KakeyaOptions``: how fast a :class:`~kakeyaturbo.hf.KakeyaCache` runs, never what it codes.

Every option trades speed for memory or threads; none changes the recipe. The defaults suit
both a CPU and a GPU model, so most users never build one::

    from kakeyaturbo.hf import KakeyaCache, KakeyaOptions

    cache = KakeyaCache.from_model(model, options=KakeyaOptions(decoded_cache_bytes=1 << 30))
"""

from __future__ import annotations

from dataclasses import dataclass

from .context import DEFERRED_FLUSH_BYTES

#: The arithmetic of the codec's key frame product on the CPU (``attention_precision``).
ATTENTION_PRECISIONS = ("bfloat16", "float32", "int16")


def flag(name: str, value: object) -> bool:
    """``value``, checked to be a bool (``name`` is the argument's, for the error)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def non_negative_int(name: str, value: object) -> int:
    """``value``, checked to be a non-negative int (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


@dataclass(frozen=True)
class KakeyaOptions:
    """Speed knobs of a :class:`~kakeyaturbo.hf.KakeyaCache` (validated when built).

    Args:
        decoded_cache_bytes: explicit budget for keeping decoded blocks between steps (speed for
            memory; counted in ``memory_report``). 0 (default) keeps none.
        attention_precision: arithmetic of the frame product in the codec's attention over
            coded keys on the CPU, the costliest part of a decode step. ``"int16"``
            (default): the coordinates (less a centre per block) and the frame as 16-bit
            integers with scales per block (11-13 bits of each), exact int32 sums, where the
            CPU has AVX512-VNNI or AVX2, float32 elsewhere. ``"float32"``: float32
            throughout. ``"bfloat16"``: both rounded to bfloat16, float32 sums, where the CPU
            has AVX512-BF16. Neither narrow product moves the teacher-forced KL measurably;
            int16 moves the logits several times less than bfloat16 (docs/performance.md).
        prepare_keys_ahead: in a decode step, make the next layers' coded keys (decoding,
            frame product, RoPE: everything of their attention that needs no query) on the
            codec's idle worker while the model runs this layer's MLP and the next layers'
            projections and attention (default; ``coded_attention.LAYERS_AHEAD`` layers at a
            time). Only where a worker would be idle: torch on one thread. The same bits
            either way; about 3 MB per 4k tokens of each such layer live meanwhile.
        flush_together_bytes: where the layers hold their blocks on the model's device (a
            GPU), their flushes in a forward wait for its end and are coded together, in one
            set of ops (``hf/flushing.py``), until the exact tokens waiting (with the
            forward's values) pass this many bytes (default 8 MiB). On a GPU each small op is
            a launch the host queues, and a flush one layer at a time is a few hundred of them
            per layer; coding layers together keeps their spans and the coding's temporaries,
            several times this, alive at once. 0: each layer flushes in its own update.
    """

    decoded_cache_bytes: int = 0
    attention_precision: str = "int16"
    prepare_keys_ahead: bool = True
    flush_together_bytes: int = DEFERRED_FLUSH_BYTES

    def __post_init__(self) -> None:
        non_negative_int("decoded_cache_bytes", self.decoded_cache_bytes)
        if not isinstance(self.attention_precision, str):
            raise TypeError(f"attention_precision must be a str, got {self.attention_precision!r}")
        if self.attention_precision not in ATTENTION_PRECISIONS:
            raise ValueError(
                f"attention_precision must be one of {ATTENTION_PRECISIONS}, "
                f"got {self.attention_precision!r}"
            )
        flag("prepare_keys_ahead", self.prepare_keys_ahead)
        non_negative_int("flush_together_bytes", self.flush_together_bytes)
