"""The ``"kakeya"`` attention implementation: transformers' ``AttentionInterface`` seam through
which a model attends over a :class:`~kakeyaturbo.hf.KakeyaCache`'s codes directly.

``KakeyaCache.from_model`` switches a model that uses ``sdpa`` attention to it (only ``sdpa``:
its masks are the ones this implementation reads; other implementations are left alone).
For a layer that handed its blocks over in this forward (see ``coded_attention.py``) it runs
:meth:`CodedView.attend`; for everything else (other caches, sliding-window or full-precision
layers, no cache) it is transformers' ``sdpa`` attention with ``sdpa``'s masks, so a model
switched to it computes what it computed before.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

#: The name models are switched to (``model.set_attn_implementation(NAME)``).
NAME = "kakeya"

#: The forward in flight's StepInputs of the KakeyaCache it uses (set by the cache's hook).
ACTIVE_STEP: ContextVar[Any] = ContextVar("kakeyaturbo_active_step", default=None)


def kakeya_attention(module: torch.nn.Module, query, key, value, attention_mask, **kwargs: Any):
    """transformers' attention interface (``dropout``, ``scaling`` and the rest by keyword, as
    models pass them): over a layer's codes where the cache handed them over, else ``sdpa``."""
    step = ACTIVE_STEP.get()
    view = None
    if step is not None and step.coded:
        idx = getattr(module, "layer_idx", None)
        if idx is None:
            raise RuntimeError(
                f"kakeya attention: {type(module).__name__} has no layer_idx, so its compressed "
                "blocks cannot be found; build the cache with coded_attention=False"
            )
        view = step.coded.pop(idx, None)
    if view is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if kwargs.get("dropout") and module.training:
        raise NotImplementedError("kakeya attention is for inference: attention dropout is on")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise NotImplementedError("kakeya attention does not support learned attention sinks")
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = view.attend(query, key, value, attention_mask, scaling, kwargs.get("softcap"))
    return out, None


AttentionInterface.register(NAME, kakeya_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
