"""A model given outlier channels without changing what it computes: the stress a Qwen2-style
bias or a massive activation puts on a KV codec, on any Llama-style checkpoint at hand.

Value channel ``c`` of every KV head is scaled up by ``factor`` in the value projection and the
output projection's columns that read it are scaled down by as much. A key channel pair (the
two channels RoPE turns together, ``i`` and ``i + head_dim / 2``) is scaled up in the key
projection and down in the query projection: RoPE turns the pair by one angle, so every logit
stays the same. The logits move by float rounding only; the cache sees a channel ``factor``
times the others (with its spread, zero-centred, the hard case for values coded as unit vectors).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Optional

import torch


def with_outlier_channels(
    model,
    layers: Optional[Iterable[int]] = None,
    value_channel: Optional[int] = 5,
    key_channel: Optional[int] = None,
    factor: float = 100.0,
):
    """A copy of ``model`` (a transformers Llama-style model: ``model.model.layers[i].self_attn``
    with ``q_proj``/``k_proj``/``v_proj``/``o_proj``, no biases) whose ``layers`` (default all)
    hold value channel ``value_channel`` and key channel pair ``key_channel`` (None: none)
    ``factor`` times larger, computing the same function."""
    out = copy.deepcopy(model)
    cfg = out.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    stack = out.model.layers
    chosen = range(len(stack)) if layers is None else list(layers)
    with torch.no_grad():
        for i in chosen:
            attn = stack[i].self_attn
            if any(getattr(p, "bias", None) is not None for p in (attn.q_proj, attn.k_proj)):
                raise ValueError(f"layer {i}: projections with biases are not supported")
            if value_channel is not None:
                attn.v_proj.weight[value_channel::d] *= factor
                attn.o_proj.weight[:, value_channel::d] /= factor
            if key_channel is not None:
                for c in (key_channel, key_channel + d // 2):
                    attn.k_proj.weight[c::d] *= factor
                    attn.q_proj.weight[c::d] /= factor
    return out
