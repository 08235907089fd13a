"""Hugging Face transformers integration: a compressed KV cache.

>>> from kakeyaturbo.hf import KakeyaCache
>>> cache = KakeyaCache.from_model(model)                      # default recipe
>>> out = model.generate(input_ids, cache=cache, max_new_tokens=200)
>>> cache.memory_report()["ratio"]

Supports transformers >=5.18,<6 (the v5 layered cache API). Before 5.24 the keyword is
``past_key_values=cache``; ``CACHE_ARG`` names the one the installed release takes.
"""

from ._compat import CACHE_ARG, MAX_TRANSFORMERS_EXCLUSIVE, MIN_TRANSFORMERS
from .budget import DecodedBudget
from .cache import KakeyaCache
from .layer import KakeyaLayer
from .layer_plan import LayerKind, LayerSpec, build_layer_plan
from .rope import RotarySpec, rotary_spec_from_config

__all__ = [
    "KakeyaCache",
    "KakeyaLayer",
    "LayerKind",
    "LayerSpec",
    "build_layer_plan",
    "DecodedBudget",
    "RotarySpec",
    "rotary_spec_from_config",
    "MIN_TRANSFORMERS",
    "MAX_TRANSFORMERS_EXCLUSIVE",
    "CACHE_ARG",
]
