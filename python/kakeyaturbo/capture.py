"""Capture real keys and values from a Hugging Face causal LM, pre- and post-RoPE.

Post-RoPE keys and the values are read from the model's own ``DynamicCache`` after a
forward pass; pre-RoPE keys from a forward hook on the module whose output RoPE rotates
(:func:`~kakeyaturbo.modeling.pre_rope_modules`: ``k_norm`` where the model has one, else
``k_proj``), the same keys calibration fits its frames on.
Tensors are saved per layer as ``[kv_heads, tokens, head_dim]`` float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

__all__ = ["capture_kv", "load_tensor", "read_tokens", "save_tensors"]


def read_tokens(tok, text_file: str | Path, n_tokens: int, offset_chars: int = 0) -> list[int]:
    """The first ``n_tokens`` token ids of ``text_file`` (from ``offset_chars`` on)."""
    text = Path(text_file).read_text(encoding="utf-8")[offset_chars:]
    # Tokenise a generous prefix only: the whole WikiText file takes seconds to encode.
    ids = tok(text[: n_tokens * 12], add_special_tokens=False)["input_ids"]
    if len(ids) < n_tokens:
        raise ValueError(f"{text_file}: only {len(ids)} tokens available, {n_tokens} requested")
    return ids[:n_tokens]


def capture_kv(model, input_ids: list[int], last_queries: int = 0) -> dict[str, np.ndarray]:
    """Runs one forward pass; returns ``{"layer{i}.k", "layer{i}.k_pre_rope", "layer{i}.v"}``,
    and with ``last_queries`` > 0 the pre-RoPE queries of the last that many tokens as
    ``"layer{i}.q_pre_rope"`` ``[query_heads, last_queries, head_dim]``."""
    import torch
    from transformers import DynamicCache

    from kakeyaturbo.hf import CACHE_ARG

    from .modeling import heads_first, kv_geometry, pre_rope_modules

    head_dim = kv_geometry(model.config).head_dim
    pre: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        q_mod, k_mod, _ = pre_rope_modules(layer.self_attn)
        wanted = {"k": (k_mod, len(input_ids))}
        if last_queries > 0:
            wanted["q"] = (q_mod, last_queries)
        for name, (mod, keep) in wanted.items():

            def hook(_mod, _inp, out, i=i, name=name, keep=keep):
                pre[(i, name)] = heads_first(out.detach(), len(input_ids), head_dim)[0, :, -keep:]

            hooks.append(mod.register_forward_hook(hook))
    cache = DynamicCache(config=model.config)
    try:
        with torch.no_grad():
            model(torch.tensor([input_ids]), **{CACHE_ARG: cache}, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    out: dict[str, np.ndarray] = {}
    for i, layer in enumerate(cache.layers):
        out[f"layer{i}.k"] = layer.keys[0].float().numpy().copy()
        out[f"layer{i}.v"] = layer.values[0].float().numpy().copy()
        for name in "kq":
            if (i, name) in pre:
                out[f"layer{i}.{name}_pre_rope"] = pre[(i, name)].float().numpy().copy()
    return out


def save_tensors(tensors: dict[str, np.ndarray], out: str | Path) -> Path:
    """Writes ``.safetensors`` (or one ``.npy`` per tensor into a folder for other suffixes),
    each file whole or not at all (a temporary file, then a rename)."""
    from .cli_args import atomic_path

    out = Path(out)
    if out.suffix == ".safetensors":
        from safetensors.numpy import save_file

        with atomic_path(out) as tmp:
            save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp))
        return out
    out.mkdir(parents=True, exist_ok=True)
    for k, v in tensors.items():
        with atomic_path(out / f"{k}.npy") as tmp:
            np.save(tmp, v)
    return out


def load_tensor(path: str | Path, name: Optional[str] = None) -> np.ndarray:
    """Reads one tensor from ``.npy`` or ``.safetensors`` (``name`` picks one of several)."""
    path = Path(path)
    if path.suffix == ".npy":
        return np.load(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: expected a .npy or .safetensors file")
    from safetensors.numpy import load_file

    tensors = load_file(str(path))
    if name is None:
        if len(tensors) != 1:
            raise ValueError(
                f"{path} holds {len(tensors)} tensors; pick one with --tensor "
                f"(one of: {', '.join(sorted(tensors)[:8])}...)"
            )
        name = next(iter(tensors))
    if name not in tensors:
        raise KeyError(f"{path} has no tensor {name!r}")
    return tensors[name]
