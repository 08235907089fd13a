"""The default codec recipe of the Hugging Face cache (see :mod:`kakeyaturbo.recipes`).

The cache always codes in a PCA frame with water-filling: the calibration bundle's frames
when one is given, else frames fitted per layer and KV head on the first tokens it
compresses (held once per layer, counted in ``memory_report()["aux_bytes"]``). Keys are
stored pre-RoPE.
"""

from __future__ import annotations

import kakeyaturbo as kt
from kakeyaturbo.recipes import DEFAULT_SINK_TOKENS, calibrated_recipe

#: Defaults of ``KakeyaCache`` besides the codec parameters (sinks: the project recipe's).
DEFAULT_RESIDUAL_LENGTH = 256
__all__ = [
    "DEFAULT_RESIDUAL_LENGTH",
    "DEFAULT_SINK_TOKENS",
    "default_kv_params",
    "default_pre_rope",
    "resolve_kv_params",
]


def default_pre_rope() -> bool:
    """Whether the default recipe stores keys pre-RoPE."""
    return calibrated_recipe().pre_rope


def default_kv_params(block_size: int | None = None) -> tuple[kt.CodecParams, kt.CodecParams]:
    """(k_params, v_params) of the default recipe: frame-free water-filling parameters (the
    cache supplies the frame)."""
    r = calibrated_recipe() if block_size is None else calibrated_recipe(block_size=block_size)
    return r.k, r.v


def resolve_kv_params(
    k_params: kt.CodecParams | None, v_params: kt.CodecParams | None
) -> tuple[kt.CodecParams, kt.CodecParams]:
    """Fill the missing side from the default recipe (at the given side's block size) and check
    that K and V stream in the same blocks."""
    for name, p in (("k_params", k_params), ("v_params", v_params)):
        if p is not None and not isinstance(p, kt.CodecParams):
            raise TypeError(f"{name} must be a kakeyaturbo.CodecParams, got {type(p).__name__}")
    given = k_params if k_params is not None else v_params
    dk, dv = default_kv_params(None if given is None else int(given.block_size))
    k = k_params if k_params is not None else dk
    v = v_params if v_params is not None else dv
    if int(k.block_size) != int(v.block_size):
        raise ValueError(
            f"k_params.block_size ({k.block_size}) and v_params.block_size ({v.block_size}) "
            "must be equal: "
            "keys and values are compressed in the same token blocks"
        )
    return k, v
