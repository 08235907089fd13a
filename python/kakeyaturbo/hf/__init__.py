"""Hugging Face transformers integration: a compressed KV cache.

>>> from kakeyaturbo.hf import KakeyaCache
>>> cache = KakeyaCache.from_model(model)                      # default recipe
>>> out = model.generate(input_ids, cache=cache, max_new_tokens=200)
>>> cache.memory_report()["ratio"]

``KakeyaCache.from_model`` changes the model it is given: it hooks its decoder and switches its
attention to the ``"kakeya"`` implementation (``coded_attention=False`` leaves the attention
as it is). Speed knobs go in :class:`KakeyaOptions` (``options=``).

Supports transformers >=5.18,<6 (the v5 layered cache API). Before 5.24 the keyword is
``past_key_values=cache``; ``CACHE_ARG`` names the one the installed release takes.

The parts are importable from their own modules: ``layer`` (``KakeyaLayer``), ``layer_plan``
(``LayerKind``, ``LayerSpec``, ``build_layer_plan``), ``rope`` (``RotarySpec``,
``rotary_spec_from_config``), ``budget`` (``DecodedBudget``), ``_compat``
(``MIN_TRANSFORMERS``, ``MAX_TRANSFORMERS_EXCLUSIVE``).
"""

from ._compat import CACHE_ARG
from .cache import KakeyaCache
from .cache_file import CacheFileError, CacheMismatchError
from .options import KakeyaOptions

__all__ = ["KakeyaCache", "KakeyaOptions", "CACHE_ARG", "CacheFileError", "CacheMismatchError"]
