"""Attention for the ``in-forward-hot`` protocol: each query reads its newest tokens exact.

In ``in-forward`` mode every query of the prefill reads reconstructed K/V, its own token and
its neighbours included. No shipped path attends that way: ``KakeyaCache`` holds its newest
``residual_length`` tokens exact (its hot window) and codes only older ones, so in a long
generation each new token reads its recent context exact and everything older from codes that
were themselves computed from coded contexts. ``in-forward-hot`` measures that compounding in
one prefill: a query at position ``t`` reads the exact K/V of positions ``t - W < s <= t`` and
the reconstruction of older ones (``W`` = :data:`HOT_WINDOW`, ``KakeyaCache``'s default
window; its real window holds ``W`` to ``W + block_size - 1`` tokens, so this is the harder
case).

:func:`exact_window` makes a model use this attention for one forward; the
``CompressingCache`` of the harness hands each layer's exact K/V to it through
:func:`stash`. Layers with nothing stashed (sliding, uncompressed) run ``sdpa``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import kakeyaturbo.hf.int8_rows as int8_rows
from kakeyaturbo.hf.coded_bias import mask_bias
from kakeyaturbo.hf.hot_window import DEFAULT_RESIDUAL_LENGTH

__all__ = ["HOT_WINDOW", "NAME", "exact_window", "stash"]

NAME = "kakeyaturbo-eval-hot-window"

#: Newest tokens each query reads exact.
HOT_WINDOW = DEFAULT_RESIDUAL_LENGTH

# layer index -> its exact (keys, values) [B, H, T, D], for the forward in flight.
_EXACT: ContextVar[dict[int, tuple[torch.Tensor, torch.Tensor]] | None] = ContextVar(
    "kakeyaturbo_eval_exact", default=None
)


def stash(layer: int, keys: torch.Tensor, values: torch.Tensor, int8_values: bool) -> None:
    """Hand ``layer``'s exact K/V (as the cache received them; with ``int8_values`` the values
    as ``KakeyaCache``'s default window holds them, int8 rows) to this forward's attention;
    nothing happens outside :func:`exact_window`."""
    held = _EXACT.get()
    if held is not None:
        held[layer] = (keys, int8_rows.round_trip(values) if int8_values else values)


@contextmanager
def exact_window(model) -> Iterator[None]:
    """Run ``model`` with :func:`hot_window_attention` inside the block, then restore its
    attention implementation."""
    before = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    token = _EXACT.set({})
    try:
        yield
    finally:
        _EXACT.reset(token)
        model.set_attn_implementation(before)


def hot_window_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``softmax(S) V`` where query ``t`` scores key ``s`` with the exact key when
    ``t - s < HOT_WINDOW`` and with the reconstructed ``key`` otherwise, and reads the value
    the same way; ``sdpa`` for layers with no exact K/V stashed."""
    held = _EXACT.get() or {}
    exact = held.pop(getattr(module, "layer_idx", -1), None)
    if exact is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    k_exact, v_exact = exact
    if k_exact.shape != key.shape or v_exact.shape != value.shape:
        raise RuntimeError(
            f"layer {module.layer_idx}: exact K/V {tuple(k_exact.shape)} do not match the "
            f"cache's {tuple(key.shape)}: in-forward-hot runs the prefill in one forward"
        )
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise NotImplementedError("in-forward-hot does not support learned attention sinks")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    b, hq, tq, _ = query.shape
    t = key.shape[-2]
    groups = hq // key.shape[1]
    # Query i sits at cache slot t - tq + i; it reads slot s exact when (t - tq + i) - s < W.
    rows = torch.arange(t - tq, t, device=query.device)[:, None]
    near = (rows - torch.arange(t, device=query.device)[None, :]) < HOT_WINDOW
    exact_and_coded = (key, k_exact, value, v_exact)
    bias = mask_bias(attention_mask, tq, t, query.device)[..., :t]
    bias = bias.expand(b, *bias.shape[1:])
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    for r in range(b):  # one row at a time: [Hq, Tq, T] scores per row
        q = query[r].float()
        kc, ke, vc, ve = (repeat_kv(x[r : r + 1].float(), groups)[0] for x in exact_and_coded)
        scores = torch.where(near, q @ ke.transpose(-1, -2), q @ kc.transpose(-1, -2)) * scaling
        if kwargs.get("softcap") is not None:
            scores = torch.tanh(scores / kwargs["softcap"]) * kwargs["softcap"]
        p = torch.softmax(scores + bias[r], dim=-1).nan_to_num_(0.0)  # a padded row: zeros
        out[r] = torch.where(near, p, 0.0) @ ve + torch.where(near, 0.0, p) @ vc
    return out.transpose(1, 2).contiguous().to(query.dtype), None


AttentionInterface.register(NAME, hot_window_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
