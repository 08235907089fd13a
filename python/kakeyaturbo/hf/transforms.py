"""The key-transform hook: an invertible map applied to keys before encoding and undone
after decoding (for example query-aware whitening fitted by calibration).

In pre-RoPE mode the transform sees pre-RoPE keys: encode runs ``unrotate -> forward -> codec``
and decode runs ``codec -> inverse -> rotate``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class KeyTransform(Protocol):
    """An invertible per-layer map of keys.

    Both methods take and return float32 tensors shaped ``[batch, kv_heads, tokens, head_dim]``
    (the same shape out as in) and must not modify their input in place. ``inverse(forward(x))``
    should equal ``x``: the cache cannot check it, a wrong inverse silently corrupts attention.
    """

    def forward(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor: ...

    def inverse(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor: ...


def check_key_transform(transform: object) -> KeyTransform | None:
    """Validate a user-supplied key transform (None passes through)."""
    if transform is None:
        return None
    for name in ("forward", "inverse"):
        if not callable(getattr(transform, name, None)):
            raise TypeError(
                "key_transform must have callable forward(keys, layer_idx) and "
                "inverse(keys, layer_idx); "
                f"{type(transform).__name__} has no {name}"
            )
    return transform  # type: ignore[return-value]


def apply_checked(fn, keys: torch.Tensor, layer_idx: int, what: str) -> torch.Tensor:
    """Call one direction of a key transform and check it kept the shape."""
    out = fn(keys, layer_idx)
    if not isinstance(out, torch.Tensor) or out.shape != keys.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"key_transform.{what} must return a tensor shaped {tuple(keys.shape)}, got {got}"
        )
    return out.float()
