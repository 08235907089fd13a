"""How ``KakeyaCache``'s arguments become what it codes with: the calibration bundle, the
recipe (its overrides, pre-RoPE where the model's RoPE inverts) and the bits of coded windows."""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import PretrainedConfig

import kakeyaturbo as kt

from ..calibration.auto import AUTO, auto_calibration
from ..recipes import SLIDING_EXTRA_BITS, Recipe, default_recipe
from .layer_plan import CODED_KINDS, LayerKind, LayerSpec, build_layer_plan, text_config
from .options import non_negative_int
from .rope import rotary_spec_from_config


def with_window_bits(recipe: Recipe, plan: list[LayerSpec]) -> Recipe:
    """``recipe`` with ``SLIDING_EXTRA_BITS`` more on the sliding layers whose windows it codes."""
    windows = {s.index for s in plan if s.kind is LayerKind.SLIDING_COMPRESSED}
    return recipe.with_more_bits(windows, SLIDING_EXTRA_BITS, len(plan))


def load_calibration(calibration: Any, model_or_config: Any):
    """A Calibration from a bundle folder (checked against the model) or as given."""
    if calibration is None:
        return None
    from ..calibration import Calibration

    if isinstance(calibration, str) and calibration == AUTO:
        if not isinstance(model_or_config, torch.nn.Module):
            raise ValueError(
                'calibration="auto" fits a bundle on text the model samples: build the cache '
                "with KakeyaCache.from_model(model), or pass a bundle folder"
            )
        return auto_calibration(model_or_config)

    if isinstance(calibration, Calibration):
        calibration.check_model(model_or_config)
        return calibration
    if isinstance(calibration, (str, os.PathLike)):
        return Calibration.load(calibration, model_or_config)
    raise TypeError(
        f"calibration must be a bundle folder or a Calibration, got {type(calibration).__name__}"
    )


def resolve_recipe(
    config, recipe, calibration, k_params, v_params, sink_tokens, pre_rope, code_sliding
):
    """The recipe the cache codes with: the given or default one, with the overrides."""
    changes: dict[str, Any] = {}
    for name, p in (("k", k_params), ("v", v_params)):
        if p is not None:
            if not isinstance(p, kt.CodecParams):
                raise TypeError(
                    f"{name}_params must be a kakeyaturbo.CodecParams, got {type(p).__name__}"
                )
            changes[name] = p
    if recipe is None:
        # The default recipe, streaming in the given parameters' blocks.
        given = changes.get("k", changes.get("v"))
        if given is None:
            recipe = default_recipe(calibration)
        else:
            recipe = default_recipe(calibration, block_size=int(given.block_size))
    elif not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a kakeyaturbo.recipes.Recipe, got {type(recipe).__name__}")
    if sink_tokens is not None:
        changes["sink_tokens"] = non_negative_int("sink_tokens", sink_tokens)
    if pre_rope is not None and not isinstance(pre_rope, bool):
        raise TypeError(f"pre_rope must be a bool, got {type(pre_rope).__name__}")
    if calibration is not None:
        if pre_rope is False:
            raise ValueError("a calibration codes keys pre-RoPE: pre_rope=False contradicts it")
        changes["pre_rope"] = True
    elif pre_rope is None:
        # The recipe's choice where this model's RoPE can be inverted exactly.
        changes["pre_rope"] = recipe.pre_rope and _rope_invertible(config, code_sliding)
    else:
        changes["pre_rope"] = pre_rope
    return recipe.replace(**changes)


def _rope_invertible(config: PretrainedConfig, code_sliding: bool) -> bool:
    try:
        for spec in build_layer_plan(config, None, code_sliding):
            if spec.kind in CODED_KINDS:
                rotary_spec_from_config(text_config(config), spec.layer_type)
    except (NotImplementedError, ValueError):
        return False
    return True
