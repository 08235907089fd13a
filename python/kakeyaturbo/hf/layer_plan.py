"""Which decoder layers the codec compresses, read from a transformers config.

Full-attention layers grow with the context, so they are compressed. Sliding-window and
chunked layers are bounded by their window and are kept exactly as transformers keeps them,
unless the cache is told to code sliding ones too (``code_sliding``).
KV-sharing consumers (Gemma 3n/4 style) hold nothing: they read the producer's cache. Layers
named in ``skip_layers`` stay full precision. Anything else (linear attention, hybrid and
sparse-indexed layers, encoder-decoder models) is refused with an explanation rather than
guessed at.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from transformers import PretrainedConfig

from ._compat import DummyLayer


class LayerKind(str, enum.Enum):
    """How one decoder layer's KV cache is held."""

    COMPRESSED = "compressed"  # full attention, block-compressed by the codec
    FULL_PRECISION = "full_precision"  # full attention, kept exact (skip_layers)
    SLIDING = "sliding"  # sliding-window attention, kept as transformers keeps it
    SLIDING_COMPRESSED = "sliding_compressed"  # sliding-window attention, its window coded
    CHUNKED = "chunked"  # chunked attention, kept as transformers keeps it
    SHARED = "shared"  # KV-sharing consumer: no cache of its own


@dataclass(frozen=True)
class LayerSpec:
    """The plan for one decoder layer."""

    index: int
    kind: LayerKind
    #: Window for sliding/chunked layers, else None.
    window: int | None = None
    #: The config's layer type ("full_attention", "sliding_attention", ...), used to pick the
    #: RoPE parameters of that layer type.
    layer_type: str = "full_attention"


_BOUNDED = {"sliding_attention": LayerKind.SLIDING, "chunked_attention": LayerKind.CHUNKED}
_NO_KV = {"moe", "mlp"}


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder (text) config of ``config``; multimodal wrappers nest it."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def attention_kinds(cfg: PretrainedConfig) -> list[str]:
    n = int(cfg.num_hidden_layers)
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        types = list(types)
        if len(types) != n:
            raise ValueError(f"config.layer_types has {len(types)} entries for {n} layers")
        return types
    # Same inference as transformers' get_layer_types_and_kwargs for configs without layer_types.
    if getattr(cfg, "sliding_window", None) is not None:
        return ["sliding_attention"] * n
    if getattr(cfg, "attention_chunk_size", None) is not None:
        return ["chunked_attention"] * n
    return ["full_attention"] * n


def _shared_consumers(cfg: PretrainedConfig, n: int) -> set[int]:
    modes = getattr(cfg, "kv_sharing_modes", None)
    if modes is not None:
        return {i for i, mode in enumerate(modes) if mode == "reuse"}
    shared = getattr(cfg, "num_kv_shared_layers", None) or 0
    return set(range(n - int(shared), n))


def _window(cfg: PretrainedConfig, kind: LayerKind) -> int:
    name = "attention_chunk_size" if kind is LayerKind.CHUNKED else "sliding_window"
    window = getattr(cfg, name, None)
    if window is None:
        raise ValueError(f"config has {kind.value} layers but no `{name}`")
    return int(window)


#: The kinds whose layers hold codec blocks.
CODED_KINDS = (LayerKind.COMPRESSED, LayerKind.SLIDING_COMPRESSED)


def build_layer_plan(
    config: PretrainedConfig, skip_layers: Iterable[int] | None = None, code_sliding: bool = False
) -> list[LayerSpec]:
    """Plan every decoder layer of ``config``.

    Args:
        config: a transformers model config (multimodal configs: the text config is used).
        skip_layers: layer indices kept full precision instead of compressed.
        code_sliding: sliding-window layers hold their window coded too (skipped ones exact).

    Raises:
        NotImplementedError: the model has layer types this cache cannot hold.
        ValueError: a bad ``skip_layers`` entry or an inconsistent config.
    """
    cfg = text_config(config)
    if getattr(cfg, "is_encoder_decoder", False):
        raise NotImplementedError(
            "KakeyaCache supports decoder-only models; encoder-decoder models are not supported"
        )
    n = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(n, int) or n <= 0:
        raise ValueError("config.num_hidden_layers must be a positive integer")
    skip = _check_skip_layers(skip_layers, n)
    types = attention_kinds(cfg)
    shared = _shared_consumers(cfg, n)

    plan = []
    for i, layer_type in enumerate(types):
        if i in shared:
            plan.append(LayerSpec(i, LayerKind.SHARED, layer_type=layer_type))
        elif layer_type in _BOUNDED:
            kind = _BOUNDED[layer_type]
            if kind is LayerKind.SLIDING and code_sliding and i not in skip:
                kind = LayerKind.SLIDING_COMPRESSED
            plan.append(LayerSpec(i, kind, window=_window(cfg, kind), layer_type=layer_type))
        elif layer_type == "full_attention":
            kind = LayerKind.FULL_PRECISION if i in skip else LayerKind.COMPRESSED
            plan.append(LayerSpec(i, kind, layer_type=layer_type))
        elif layer_type in _NO_KV:
            plan.append(LayerSpec(i, LayerKind.SHARED, layer_type=layer_type))
        else:
            raise NotImplementedError(
                f"layer {i} has type {layer_type!r}; KakeyaCache supports full_attention, "
                "sliding_attention and "
                "chunked_attention layers (and KV-sharing consumers)"
            )
    # skip_layers naming a chunked or shared layer is a no-op: those are never compressed.
    return plan


def cache_layer_count(plan: list[LayerSpec]) -> int:
    """How many entries the cache needs. Before transformers 5.23 KV-sharing consumers are
    dropped from the end of the cache rather than kept as placeholders."""
    if DummyLayer is not None:
        return len(plan)
    n = len(plan)
    while n > 0 and plan[n - 1].kind is LayerKind.SHARED:
        n -= 1
    return n


def _check_skip_layers(skip_layers: Iterable[int] | None, n: int) -> set[int]:
    if skip_layers is None:
        return set()
    if isinstance(skip_layers, (str, bytes)) or not isinstance(skip_layers, Iterable):
        raise TypeError(
            f"skip_layers must be an iterable of layer indices, got {type(skip_layers).__name__}"
        )
    out = set()
    for i in skip_layers:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"skip_layers entries must be int, got {i!r}")
        if not 0 <= i < n:
            raise ValueError(f"skip_layers entry {i} is out of range for a model with {n} layers")
        out.add(i)
    return out
