"""The default codec recipe of the Hugging Face cache."""

from __future__ import annotations

import kakeyaturbo as kt

#: Defaults of ``KakeyaCache`` besides the codec parameters.
DEFAULT_RESIDUAL_LENGTH = 256
DEFAULT_SINK_TOKENS = 4


def default_kv_params(block_size: int | None = None) -> tuple[kt.CodecParams, kt.CodecParams]:
    """(k_params, v_params) of the default recipe.

    The project-wide recipe (``kakeyaturbo.recipes.default_kv_params()``) wins when it exists;
    the built-in fallback below is used otherwise.

    Keys use the inner-product metric (attention only sees ``q . k``, and the MSE quantiser's
    shrinkage flattens the softmax); values use MSE. Both keep every PCA component and spend
    3 bits per rotated coordinate over 512-token blocks, with sparse outliers.
    """
    project = _project_recipe()
    if project is not None:
        k, v = project
        if block_size is not None:
            k, v = k.replace(block_size=block_size), v.replace(block_size=block_size)
        return k, v
    bs = 512 if block_size is None else block_size
    k = kt.CodecParams(block_size=bs, bit_width=3, metric="inner_product", variance_ratio=1.0)
    v = kt.CodecParams(block_size=bs, bit_width=3, metric="mse", variance_ratio=1.0)
    return k, v


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
            f"k_params.block_size ({k.block_size}) and v_params.block_size ({v.block_size}) must be equal: "
            "keys and values are compressed in the same token blocks"
        )
    return k, v


def _project_recipe() -> tuple[kt.CodecParams, kt.CodecParams] | None:
    try:
        from kakeyaturbo.recipes import default_kv_params as project_default
    except ImportError:
        return None
    rec = project_default()
    if isinstance(rec, tuple) and len(rec) == 2 and all(isinstance(x, kt.CodecParams) for x in rec):
        return rec
    kv = rec[0] if isinstance(rec, tuple) else rec  # (KVCodecParams, options) or KVCodecParams
    return kv.k, kv.v
