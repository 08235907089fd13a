"""What a saved cache must match to be loaded: the model (config shapes, dtype, a hash of
sampled weights) and the cache's settings (recipe, hot window, layer plan, options,
calibration bundle). Any difference is a :class:`~.cache_file.CacheMismatchError` naming it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import numpy as np
import torch

from .cache_file import CacheMismatchError
from .layer_plan import text_config

#: Entries sampled from each parameter for the weights hash: a fine-tune or another
#: checkpoint changes nearly every parameter, so a few entries each tell them apart cheaply.
_SAMPLES = 64
_CONFIG_FIELDS = (
    "model_type",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "vocab_size",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
)


def model_identity(model: torch.nn.Module) -> dict[str, Any]:
    """The model's config fields that shape its K/V, its dtype and its weights hash."""
    cfg = text_config(model.config)
    ident: dict[str, Any] = {}
    for name in _CONFIG_FIELDS:
        value = getattr(cfg, name, None)
        if value is not None:
            ident[name] = json.loads(json.dumps(value, sort_keys=True, default=str))
    ident["dtype"] = str(next(model.parameters()).dtype)
    ident["weights_sha256"] = _weights_hash(model)
    return ident


def _weights_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        # Integer spacing: float32 steps overshoot the last index of a large parameter.
        at = torch.arange(_SAMPLES, dtype=torch.int64) * max(flat.numel() - 1, 0) // (_SAMPLES - 1)
        picked = flat[at.to(flat.device)].float().cpu() if flat.numel() else flat.float().cpu()
        h.update(f"{name}\0{tuple(p.shape)}\0{p.dtype}\0".encode())
        h.update(picked.numpy().tobytes())
    return h.hexdigest()


def cache_settings(cache: Any) -> dict[str, Any]:
    """Everything of ``cache``'s construction that decides what its state means."""
    ctx = cache._ctx
    return {
        "recipe": cache.recipe.describe(),
        "residual_length": cache.residual_length,
        "layer_plan": [[s.index, s.kind.value, s.window] for s in cache.layer_plan],
        "hot_dtype": None if ctx.hot_dtype is None else str(ctx.hot_dtype),
        "int8_hot_values": ctx.int8_hot_values,
        "options": dataclasses.asdict(cache.options),
        "calibration": calibration_identity(cache.calibration),
    }


def calibration_identity(calibration: Any) -> str | None:
    """sha256 of a calibration bundle's fingerprint, meta and tensors (None without one)."""
    if calibration is None:
        return None
    h = hashlib.sha256()
    h.update(json.dumps(calibration.fingerprint, sort_keys=True, default=str).encode())
    h.update(json.dumps(calibration.meta, sort_keys=True, default=str).encode())
    for name in sorted(calibration.tensors):
        arr = np.ascontiguousarray(calibration.tensors[name], dtype=np.float32)
        h.update(f"{name}\0{arr.shape}\0".encode() + arr.tobytes())
    return h.hexdigest()


def check_same(section: str, saved: Any, here: Any, where: str) -> None:
    """Raise CacheMismatchError naming every field of ``section`` where the file differs."""
    diffs = _diffs(saved, here, section)
    if diffs:
        raise CacheMismatchError(
            f"{where}: the cache file was saved for another {section}: " + "; ".join(diffs)
        )


def _diffs(saved: Any, here: Any, path: str) -> list[str]:
    here = json.loads(json.dumps(here, sort_keys=True, default=str))  # as the header holds it
    if isinstance(saved, dict) and isinstance(here, dict):
        out = []
        for key in sorted(set(saved) | set(here)):
            if key not in saved or key not in here:
                out.append(f"{path}.{key}: file {saved.get(key)!r}, here {here.get(key)!r}")
            else:
                out += _diffs(saved[key], here[key], f"{path}.{key}")
        return out
    return [] if saved == here else [f"{path}: file {saved!r}, here {here!r}"]
