"""`eval bytes`: what a method stores per layer, measured at several context lengths, and its
projection to long contexts.

The K/V come from one real prefill of the text (run in chunks, so it can exceed what fits in
one forward). For each context length T, layer and stream, the method compresses the first T
tokens (a sliding-window layer holds min(T, window) of them) and the stored bytes are counted
exactly as `eval ppl` counts them. Layers are split into full-attention, sliding and skipped
(kept bf16 by `skip_layers`/`layers`).

Projection. Every stream is stored as independent units of U tokens (`Method.block_tokens`: a
codec block, a token group, or 1), counted from the start of the compressed span (after `sink`
tokens; the last `window` tokens stay full precision), so with o = sink + window,
bytes(T) = bytes(T1) + ((T - T1) / U) * c_unit when U divides T - o and T1 = o + U, plus, when it
leaves a remainder r, the measured cost of the partial unit, bytes(T1 + r) - bytes(T1). c_unit
comes from two measured lengths T1 < T2 <= `fit_max`. For
formats whose unit cost does not depend on the data (all the peers) the projection is
byte-exact; for data-dependent ones (outliers, adaptive rank) it carries the measured mean.
Each report checks the projection against a measured run longer than the fit.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import DynamicCache

from kakeyaturbo.eval.harness import compress_stream
from kakeyaturbo.eval.hf_baselines import HFQuantizedCache
from kakeyaturbo.eval.methods import Method
from kakeyaturbo.eval.registry import build_method
from kakeyaturbo.hf import CACHE_ARG
from kakeyaturbo.hf.rope import ModelRope
from kakeyaturbo.modeling import KVGeometry, kv_geometry

__all__ = ["capture_kv", "measure", "project", "bytes_result"]

DEFAULT_CONTEXTS = [512, 1024, 2048, 4096]
DEFAULT_PROJECT = [32768, 65536, 131072, 262144]


@torch.inference_mode()
def capture_kv(
    model, ids: torch.Tensor, chunk: int = 1024
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prefill `ids` (1-D) in chunks; per layer (K, V) of shape [1, kv_heads, cached, head_dim]."""
    cache = DynamicCache(config=model.config)
    ids = ids.view(1, -1)
    for start in range(0, ids.shape[1], chunk):
        model(
            input_ids=ids[:, start : start + chunk],
            **{CACHE_ARG: cache},
            use_cache=True,
            logits_to_keep=1,
        )
    return [(layer.keys, layer.values) for layer in cache.layers]


def _layer_type(method: Method, geom: KVGeometry, layer: int) -> str:
    o = method.options
    if layer in o.skip_layers or (o.layers is not None and layer not in o.layers):
        return "skipped"
    return "sliding" if geom.layer_types[layer] == "sliding_attention" else "full"


@torch.inference_mode()
def measure(
    method: Method, kv, geom: KVGeometry, config, tokens: int, rope: ModelRope | None = None
) -> list[dict[str, Any]]:
    """Stored bytes of each layer and stream for a prefix of `tokens` tokens."""
    out = []
    for layer, (k, v) in enumerate(kv):
        t_eff = geom.cached_tokens(layer, tokens)
        if geom.layer_types[layer] == "sliding_attention":
            ks, vs = k[:, :, -t_eff:], v[:, :, -t_eff:]
        else:
            if k.shape[2] < tokens:
                raise ValueError(f"only {k.shape[2]} tokens captured, {tokens} asked")
            ks, vs = k[:, :, :tokens], v[:, :, :tokens]
        bf16 = 2 * (ks.numel() + vs.numel())
        if isinstance(method, HFQuantizedCache):
            cache = method.make_cache(config)
            cache.update(ks.contiguous(), vs.contiguous(), 0)
            counted, _ = method.count(cache.layers[0])
            kb, vb = sum(counted["k"].values()), sum(counted["v"].values())
        else:
            kb = sum(compress_stream(method, ks.contiguous(), layer, "k", rope)[1][0].values())
            vb = sum(compress_stream(method, vs.contiguous(), layer, "v", rope)[1][0].values())
        out.append(
            {
                "layer": layer,
                "type": _layer_type(method, geom, layer),
                "tokens": t_eff,
                "k": kb,
                "v": vb,
                "bf16": bf16,
            }
        )
    return out


def _unit(method: Method, stream: str) -> int:
    if isinstance(method, HFQuantizedCache):
        # per-token groups, but HQQ's bit packing needs whole rows of 4 (2-bit) or 8 (1-bit)
        return 64
    return max(1, int(method.block_tokens(stream)))


def project(
    method: Method,
    kv,
    geom: KVGeometry,
    config,
    fit_max: int,
    targets: list[int],
    rope: ModelRope | None = None,
) -> dict[str, Any]:
    """Per-layer, per-stream unit costs from lengths <= fit_max, and projected totals."""
    captured = min(k.shape[2] for k, _ in kv)
    cache: dict[int, list[dict[str, Any]]] = {}

    def at(t: int) -> list[dict[str, Any]]:
        if t not in cache:
            cache[t] = measure(method, kv, geom, config, t, rope)
        return cache[t]

    # Units are counted from the start of the compressed span (after the sinks, before the window).
    opts = method.options
    offset = 0 if isinstance(method, HFQuantizedCache) else opts.sink_tokens + opts.residual_length
    costs = []
    for stream in ("k", "v"):
        u = _unit(method, stream)
        t1 = offset + u
        t2 = offset + max(2 * u, ((fit_max - offset) // u) * u)
        if t2 > captured:
            raise ValueError(f"fitting needs {t2} captured tokens, have {captured}")
        for layer in range(len(kv)):
            b1, b2 = at(t1)[layer][stream], at(t2)[layer][stream]
            costs.append(
                {
                    "layer": layer,
                    "stream": stream,
                    "unit_tokens": u,
                    "offset": offset,
                    "t1": t1,
                    "t2": t2,
                    "bytes_t1": b1,
                    "per_unit": (b2 - b1) / ((t2 - t1) // u),
                }
            )

    def predict(t: int) -> dict[str, Any]:
        by_type: dict[str, float] = {}
        total = bf16 = 0.0
        for c in costs:
            layer, stream, u = c["layer"], c["stream"], c["unit_tokens"]
            t_eff = geom.cached_tokens(layer, t)
            if t_eff <= captured and geom.layer_types[layer] == "sliding_attention":
                b = at(t_eff)[layer][stream]
            elif t_eff < c["t1"]:
                b = at(t_eff)[layer][stream]
            else:
                q, r = divmod(t_eff - c["offset"], u)
                b = c["bytes_t1"] + (q - 1) * c["per_unit"]
                if r:
                    b += at(c["t1"] + r)[layer][stream] - c["bytes_t1"]
            typ = _layer_type(method, geom, layer)
            by_type[typ] = by_type.get(typ, 0) + b
            total += b
            bf16 += 2 * geom.kv_heads * t_eff * geom.head_dim
        return {
            "tokens": t,
            "stored_bytes": round(total),
            "bf16_bytes": round(bf16),
            "ratio": bf16 / total if total else None,
            "by_type": {k: round(v) for k, v in by_type.items()},
        }

    return {"costs": costs, "projection": [predict(t) for t in targets], "predict": predict}


def _totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_type: dict[str, int] = {}
    for r in rows:
        by_type[r["type"]] = by_type.get(r["type"], 0) + r["k"] + r["v"]
    total = sum(r["k"] + r["v"] for r in rows)
    bf16 = sum(r["bf16"] for r in rows)
    return {
        "stored_bytes": total,
        "bf16_bytes": bf16,
        "ratio": bf16 / total if total else None,
        "by_type": by_type,
    }


def bytes_result(
    model,
    ids: torch.Tensor,
    specs: list[str],
    contexts: list[int],
    fit_max: int,
    targets: list[int],
    command: str,
    progress: bool = True,
) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from kakeyaturbo.eval.ppl import environment

    t0 = time.perf_counter()
    contexts = sorted(set(contexts))
    need = max(contexts)
    if ids.numel() < need:
        raise ValueError(f"text has {ids.numel()} tokens, {need} needed")
    kv = capture_kv(model, ids[:need])
    geom = kv_geometry(model.config)
    methods = []
    for spec in tqdm(specs, desc="bytes", disable=not progress):
        t_method = time.perf_counter()
        try:
            method = build_method(spec)
            method.prepare(model)
            if getattr(method, "reason", None):
                methods.append({**method.describe(), "skipped": method.reason})
                continue
            rope = ModelRope(model.config) if method.options.pre_rope else None
            measured = {t: measure(method, kv, geom, model.config, t, rope) for t in contexts}
            proj = project(method, kv, geom, model.config, fit_max, targets, rope)
            checks = []
            for t in contexts:
                if t > fit_max:
                    m = _totals(measured[t])["stored_bytes"]
                    p = proj["predict"](t)["stored_bytes"]
                    checks.append(
                        {"tokens": t, "measured": m, "projected": p, "rel_error": (p - m) / m}
                    )
            methods.append(
                {
                    **method.describe(),
                    "per_layer": {str(t): measured[t] for t in contexts},
                    "totals": {str(t): _totals(measured[t]) for t in contexts},
                    "costs": proj["costs"],
                    "projection": proj["projection"],
                    "validation": checks,
                    "seconds": round(time.perf_counter() - t_method, 1),
                }
            )
        except Exception as exc:  # noqa: BLE001 - report and go on with the other methods
            methods.append({"method": spec, "error": f"{type(exc).__name__}: {exc}"})
    return {
        "kind": "bytes",
        "command": command,
        "contexts": contexts,
        "fit_max": fit_max,
        "targets": targets,
        "layers": geom.num_layers,
        "kv_heads": geom.kv_heads,
        "head_dim": geom.head_dim,
        "layer_types": list(geom.layer_types),
        "methods": methods,
        "seconds": round(time.perf_counter() - t0, 1),
        "environment": environment(),
    }
