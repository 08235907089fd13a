"""``KakeyaCache.save`` / ``KakeyaCache.load``: a cache's state in one file (``cache_file.py``).

What is saved, per compressed layer ``i`` (tensor names ``l{i}.*``; lengths in the header):

* ``k.bytes`` / ``v.bytes``: every block's streams as the codec's own bytes (``to_bytes``),
  block-major, and ``k.sizes`` / ``v.sizes`` (int64) each stream's length;
* ``k.norm_codes`` / ``k.norm_bounds`` (and ``v.``): the blocks' token-norm codes (uint8)
  and bounds (float16), where the layer's stream was coded with token norms;
* ``pos``: each block's stored RoPE positions (int32; pre-RoPE mode);
* ``hot.k``, ``hot.v``, ``hot.pos``: the hot window as held (keys in the hot dtype, values as
  int8 rows or in the hot dtype, int32 positions);
* ``sink.slots`` (int64), ``sink.k``, ``sink.v`` (the hot dtype): the sinks;
* ``frame.k`` / ``frame.v``: the self-fitted coding frames (float16) where one was fitted.

Full-precision layers (``skip_layers``) save ``l{i}.keys`` / ``l{i}.values``. The header holds
the model's identity, the cache's settings (recipe, residual length, layer plan, hot dtype,
options, the calibration bundle's sha256) and each layer's lengths. Decoded blocks kept under
a decoded budget are not saved (they are remade on demand).
"""

from __future__ import annotations

import os
from typing import Any

import torch

import kakeyaturbo as kt
from kakeyaturbo.decode_limit import check_decode_limit

from ..gpu import device_decode
from ..norm_codes import NormCodes
from ..pipeline import CodedBlock
from . import cache_file
from .blocks import Block
from .cache_file import CacheFileError
from .cache_identity import cache_settings, check_same, model_identity
from .layer import KakeyaLayer
from .layer_plan import LayerKind

_STREAMS = ("k", "v")


def save_cache(cache: Any, model: torch.nn.Module, path: str | os.PathLike) -> int:
    """Write ``cache`` (built for ``model``) to ``path``; the file's size in bytes."""
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for spec, layer in zip(cache.layer_plan, cache.layers):
        if spec.kind is LayerKind.COMPRESSED:
            layers.append(_save_compressed(cache, layer, tensors))
        elif spec.kind is LayerKind.FULL_PRECISION:
            layers.append(_save_plain(spec.index, layer, tensors))
        else:
            raise NotImplementedError(
                f"KakeyaCache.save: layer {spec.index} is a {spec.kind.value} layer; only "
                "compressed and full-precision (skipped) layers are saved"
            )
    header = {
        "model": model_identity(model),
        "settings": cache_settings(cache),
        "layers": layers,
    }
    return cache_file.write(path, header, tensors)


def load_cache(cache: Any, model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Fill ``cache`` (fresh, built for ``model`` as the saved one was) from ``path``."""
    where = str(path)
    header, tensors = cache_file.read(path)
    check_same("model", header.get("model"), model_identity(model), where)
    check_same("cache settings", header.get("settings"), cache_settings(cache), where)
    saved = header.get("layers")
    if not isinstance(saved, list) or len(saved) != len(cache.layers):
        raise CacheFileError(f"{where}: the header's layer list does not match the model")
    # Every layer is checked and built before any is filled: a bad file leaves the cache empty.
    restores = []
    for spec, layer, meta in zip(cache.layer_plan, cache.layers, saved):
        if not isinstance(meta, dict) or meta.get("index") != spec.index:
            raise CacheFileError(f"{where}: damaged header for layer {spec.index}")
        device = _layer_device(model, spec.index)
        if isinstance(layer, KakeyaLayer):
            restores.append(_compressed_restore(cache, layer, meta, tensors, device, where))
        else:
            restores.append(_plain_restore(layer, meta, tensors, device, where))
    for restore in restores:
        restore()


# ---- the decode budget -------------------------------------------------------------------------


def _check_decode_budget(encoded_layers: list[bytes]) -> list[kt.EncodedLayer]:
    """The one place a loaded file's coded streams (one layer's stream kind, all its blocks)
    meet the codec's limits: each is parsed by ``EncodedLayer.from_bytes``, which validates it
    in full and applies the per-stream decode limit, then all together meet the total one
    (:mod:`kakeyaturbo.decode_limit`), as one decode of them would."""
    out = []
    for blob in encoded_layers:
        try:
            out.append(kt.EncodedLayer.from_bytes(blob))
        except kt.KakeyaTurboError as exc:
            raise CacheFileError(f"a coded stream is refused by the codec: {exc}") from None
    try:
        check_decode_limit("the coded streams", out)
    except kt.KakeyaTurboError as exc:
        raise CacheFileError(str(exc)) from None
    return out


# ---- compressed layers -------------------------------------------------------------------------


def _save_compressed(cache: Any, layer: KakeyaLayer, tensors: dict) -> dict:
    i = layer.layer_idx
    meta: dict[str, Any] = {"index": i, "kind": "compressed", "initialized": layer.is_initialized}
    if not layer.is_initialized:
        return meta
    if layer._on_device is not None:
        raise NotImplementedError(
            f"KakeyaCache.save: layer {i} holds its blocks on {layer.device} only, in the "
            "device decoder's layout, which has no codec bytes to save (saving a cache on a "
            "GPU is not supported yet; a file saved on the CPU loads onto a GPU model)"
        )
    p = f"l{i}."
    blocks = layer._blocks
    meta.update(
        tokens=layer._len,
        rows=layer._rows,
        heads=layer._heads,
        head_dim=int(layer._hot_k.shape[-1]),
        v_dim=layer._v_dim,
        dtype=str(layer.dtype),
        hot_dtype=str(layer._hot_float),
        blocks=len(blocks),
        sink_end=layer._sink_end,
        sinks=layer._sink_slots is not None,
        sink_values=layer._sink_k is not None,
    )
    tensors[p + "hot.k"] = layer._hot_k
    tensors[p + "hot.v"] = layer._hot_v
    if layer._hot_pos is not None:
        tensors[p + "hot.pos"] = layer._hot_pos
    if layer._sink_slots is not None:
        tensors[p + "sink.slots"] = layer._sink_slots
    if layer._sink_k is not None:
        tensors[p + "sink.k"], tensors[p + "sink.v"] = layer._sink_k, layer._sink_v
    for s in _STREAMS:
        coded = [getattr(blk, s) for blk in blocks]
        blobs = [e.to_bytes() for blk in coded for e in blk.encs]
        sizes = torch.tensor([len(b) for b in blobs], dtype=torch.int64)
        joined = bytearray(b"".join(blobs))
        raw = (
            torch.frombuffer(joined, dtype=torch.uint8)
            if joined
            else torch.zeros(0, dtype=torch.uint8)
        )
        tensors[p + f"{s}.bytes"] = raw
        tensors[p + f"{s}.sizes"] = sizes
        if coded and coded[0].norms is not None:
            tensors[p + f"{s}.norm_codes"] = torch.stack([c.norms.codes for c in coded])
            tensors[p + f"{s}.norm_bounds"] = torch.stack([c.norms.bounds for c in coded])
        frame = cache._ctx.pipeline._frames.get((i, s))
        meta[f"frame_{s}"] = None if frame is None else bool(frame.numel())
        if frame is not None and frame.numel():
            tensors[p + f"frame.{s}"] = frame
    if blocks and blocks[0].pos is not None:
        widths = {blk.pos.shape[-1] for blk in blocks}
        full = len(widths) > 1  # mixed: every block's positions in full
        tensors[p + "pos"] = torch.stack([blk.positions if full else blk.pos for blk in blocks])
    return meta


def _compressed_restore(cache, layer: KakeyaLayer, meta: dict, tensors: dict, device, where):
    """Check layer ``meta``'s tensors; a function that fills ``layer`` with them."""
    i, p = layer.layer_idx, f"l{layer.layer_idx}."
    at = f"{where}: layer {i}"
    if not meta.get("initialized"):
        return lambda: None
    pipe = cache._ctx.pipeline
    recipe = pipe.recipe
    ints = {k: meta.get(k) for k in ("tokens", "rows", "heads", "head_dim", "v_dim", "blocks")}
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in ints.values()):
        raise CacheFileError(f"{at}: damaged lengths {ints}")
    b, h, d, dv, n = (ints[k] for k in ("rows", "heads", "head_dim", "v_dim", "blocks"))
    bs = layer.block_size
    hot_len = ints["tokens"] - n * bs
    if hot_len < 0:
        raise CacheFileError(f"{at}: {ints['tokens']} tokens cannot hold {n} blocks of {bs}")
    dtype, hot = _dtype(meta.get("dtype"), at), _dtype(meta.get("hot_dtype"), at)
    int8 = cache._ctx.int8_hot_values
    _expect(tensors, p + "hot.k", (b, h, hot_len, d), hot, at)
    v_shape, v_dtype = ((b, h, hot_len, dv + 2), torch.int8) if int8 else ((b, h, hot_len, dv), hot)
    _expect(tensors, p + "hot.v", v_shape, v_dtype, at)
    if recipe.pre_rope:
        _expect(tensors, p + "hot.pos", (b, hot_len), torch.int32, at)
    s_tok = layer.sink_tokens
    if meta.get("sinks"):
        _expect(tensors, p + "sink.slots", (b, s_tok), torch.int64, at)
    if meta.get("sink_values"):
        _expect(tensors, p + "sink.k", (b, s_tok, h, d), hot, at)
        _expect(tensors, p + "sink.v", (b, s_tok, h, dv), hot, at)
    coded: dict[str, list[CodedBlock]] = {}
    for s in _STREAMS:
        per = b if recipe.joint(s) else b * h  # streams per block: across heads, or per head
        sizes = _expect(tensors, p + f"{s}.sizes", (n * per,), torch.int64, at)
        raw = tensors.get(p + f"{s}.bytes")
        if raw is None or raw.dtype != torch.uint8 or raw.dim() != 1:
            raise CacheFileError(f"{at}: {s}.bytes missing or damaged")
        if bool((sizes < 0).any()) or int(sizes.sum()) != raw.numel():
            raise CacheFileError(f"{at}: {s}.sizes do not add up to {s}.bytes")
        data, blobs, start = raw.numpy().tobytes(), [], 0
        for size in sizes.tolist():
            blobs.append(data[start : start + size])
            start += size
        encs = _check_decode_budget(blobs)
        width = h * (d if s == "k" else dv) if recipe.joint(s) else (d if s == "k" else dv)
        bad = [e.shape for e in encs if tuple(e.shape) != (bs, width)]
        if bad:
            raise CacheFileError(f"{at}: {s} streams of shape {bad[0]}, expected {(bs, width)}")
        norms: list[Any] = [None] * n
        if p + f"{s}.norm_codes" in tensors:  # the pipeline's choice for this layer
            if not recipe.token_norms(s):
                raise CacheFileError(f"{at}: {s} token norms, which the recipe never codes")
            codes = _expect(tensors, p + f"{s}.norm_codes", (n, b, h, bs), torch.uint8, at)
            bounds = _expect(tensors, p + f"{s}.norm_bounds", (n, b, h, 2), torch.float16, at)
            norms = [NormCodes(codes[j].clone(), bounds[j].clone()) for j in range(n)]
        coded[s] = [CodedBlock(encs[j * per : (j + 1) * per], norms[j], bs) for j in range(n)]
    positions = None
    if recipe.pre_rope and n:
        positions = tensors.get(p + "pos")
        ok = positions is not None and positions.dtype == torch.int32
        if not ok or tuple(positions.shape) not in ((n, b, 1), (n, b, bs)):
            raise CacheFileError(f"{at}: block positions missing or damaged")
    frames = {}
    for s in _STREAMS:
        kind = meta.get(f"frame_{s}")
        if kind:
            w = dv if s == "v" else d
            frames[s] = _expect(tensors, p + f"frame.{s}", (h, w, w), torch.float16, at)
        elif kind is False:
            frames[s] = torch.empty(0, dtype=torch.float16)

    def restore() -> None:
        layer.dtype, layer.device = dtype, device
        layer._rows, layer._heads, layer._v_dim, layer._hot_float = b, h, dv, hot
        pos = tensors.get(p + "hot.pos")
        layer._set_hot(
            tensors[p + "hot.k"].to(device),
            tensors[p + "hot.v"].to(device),
            None if pos is None else pos.to(device),
        )
        if meta.get("sinks"):
            layer._set_sink_slots(tensors[p + "sink.slots"].clone())
            layer._sink_end = int(meta.get("sink_end", 0))
        if meta.get("sink_values"):
            layer._sink_k = tensors[p + "sink.k"].to(device)
            layer._sink_v = tensors[p + "sink.v"].to(device)
        for j in range(n):
            blk = Block(k=coded["k"][j], v=coded["v"][j], tokens=bs, pos=None)
            if positions is not None:
                blk.place(positions[j].to(device))
            layer._blocks.append(blk)
        for s, frame in frames.items():
            pipe._frames[(i, s)] = frame.clone()
        for s, held in coded.items():
            if held:  # blocks the layer codes next keep their token-norm choice
                pipe.token_norms.restore(i, s, held[0].norms is not None)
        layer._len = ints["tokens"]
        layer.is_initialized = True
        if n and layer._holds_on_device():
            # A layer on a GPU reads its blocks there only: the file's blocks go there.
            layer._on_device = {
                s: device_decode.DeviceBlocks.of(coded[s], device) for s in _STREAMS
            }
            for blk in layer._blocks:
                blk.k = blk.v = None

    return restore


# ---- full-precision layers ----------------------------------------------------------------------


def _save_plain(index: int, layer: Any, tensors: dict) -> dict:
    initialized = bool(getattr(layer, "is_initialized", False))
    meta = {"index": index, "kind": "full_precision", "initialized": initialized}
    if initialized:
        tensors[f"l{index}.keys"], tensors[f"l{index}.values"] = layer.keys, layer.values
    return meta


def _plain_restore(layer: Any, meta: dict, tensors: dict, device, where: str):
    index = meta["index"]
    if not meta.get("initialized"):
        return lambda: None
    k, v = tensors.get(f"l{index}.keys"), tensors.get(f"l{index}.values")
    if k is None or v is None or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise CacheFileError(f"{where}: layer {index}: keys/values missing or damaged")

    def restore() -> None:
        layer.lazy_initialization(k.to(device), v.to(device))
        layer.keys, layer.values = k.to(device), v.to(device)

    return restore


# ---- helpers ------------------------------------------------------------------------------------


def _expect(tensors: dict, name: str, shape: tuple, dtype, at: str) -> torch.Tensor:
    """``tensors[name]``, checked to have ``shape`` and ``dtype``."""
    t = tensors.get(name)
    if t is None:
        raise CacheFileError(f"{at}: {name} missing")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise CacheFileError(
            f"{at}: {name} is {t.dtype} {tuple(t.shape)}, expected {dtype} {tuple(shape)}"
        )
    return t


def _dtype(name: Any, at: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CacheFileError(f"{at}: unknown dtype {name!r}")
    return dtype


def _layer_device(model: torch.nn.Module, index: int) -> torch.device:
    """Where decoder layer ``index`` runs (its K/V are made there), else the model's device."""
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    try:
        return next(layers[index].parameters()).device
    except (TypeError, IndexError, StopIteration):
        return next(model.parameters()).device
