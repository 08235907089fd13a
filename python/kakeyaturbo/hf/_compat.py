"""The one place that knows which transformers versions this adapter speaks to.

The v5 cache API moved between minor releases (``get_mask_sizes(cache_position)`` became
``get_mask_sizes(query_length)`` in 5.5, ``get_max_length`` appeared in 5.13, ``crop`` switched
from "keep this many" to "remove this many" in 5.14/5.15, KV-shared layers became
``DummyLayer`` entries in 5.23, the models' ``past_key_values`` argument became ``cache`` in
5.24). We support the releases that have all of the current shape
and check it once, at import, instead of failing deep inside ``generate``.
"""

from __future__ import annotations

import importlib
import importlib.metadata

_INSTALL_HINT = "pip install 'kakeyaturbo[hf]'"


def _require(module: str) -> None:
    """Import `module`, or fail naming the extra that installs it (not a bare "No module")."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        raise ModuleNotFoundError(
            f"kakeyaturbo.hf needs {module}, which is not installed: {_INSTALL_HINT}", name=module
        ) from exc


for _module in ("torch", "packaging", "transformers"):
    _require(_module)

from packaging.version import Version  # noqa: E402

#: Inclusive lower bound / exclusive upper bound of the supported transformers releases.
MIN_TRANSFORMERS = Version("5.18.0")
MAX_TRANSFORMERS_EXCLUSIVE = Version("6.0.0")


def _installed_version() -> Version:
    try:
        return Version(importlib.metadata.version("transformers"))
    except importlib.metadata.PackageNotFoundError as exc:  # pragma: no cover - import guard
        raise ImportError(f"kakeyaturbo.hf needs transformers: {_INSTALL_HINT}") from exc


TRANSFORMERS_VERSION = _installed_version()
if not (MIN_TRANSFORMERS <= TRANSFORMERS_VERSION < MAX_TRANSFORMERS_EXCLUSIVE):
    raise ImportError(
        f"kakeyaturbo.hf supports transformers >={MIN_TRANSFORMERS},<{MAX_TRANSFORMERS_EXCLUSIVE} "
        f"(the v5 layered cache API); found {TRANSFORMERS_VERSION}: {_INSTALL_HINT}"
    )

from transformers import cache_utils  # noqa: E402  (after the version gate on purpose)

Cache = cache_utils.Cache
CacheLayerMixin = cache_utils.CacheLayerMixin
DynamicLayer = cache_utils.DynamicLayer
DynamicSlidingWindowLayer = cache_utils.DynamicSlidingWindowLayer
#: 5.23+ keeps one placeholder layer per KV-sharing consumer; older releases drop them from the
#: end of the cache instead (the consumers never call ``update``).
DummyLayer = getattr(cache_utils, "DummyLayer", None)
#: The keyword a model's ``forward`` and ``generate`` take the cache by: ``cache`` from 5.24
#: (``past_key_values`` still works there, with a FutureWarning, until 5.40).
CACHE_ARG = "cache" if TRANSFORMERS_VERSION >= Version("5.24.0") else "past_key_values"

__all__ = [
    "TRANSFORMERS_VERSION",
    "MIN_TRANSFORMERS",
    "MAX_TRANSFORMERS_EXCLUSIVE",
    "Cache",
    "CacheLayerMixin",
    "DynamicLayer",
    "DynamicSlidingWindowLayer",
    "DummyLayer",
    "CACHE_ARG",
]
