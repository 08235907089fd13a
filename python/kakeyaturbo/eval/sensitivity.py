"""The per-layer sensitivity scan behind a calibration bundle's per-layer bits: the KL of
compressing one layer's keys (or values) alone, on calibration text; the offsets follow in
:mod:`kakeyaturbo.calibration.sensitivity`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from kakeyaturbo.calibration.sensitivity import joint_offsets
from kakeyaturbo.eval.harness import evaluate_method, prepare_reference
from kakeyaturbo.eval.registry import build_method
from kakeyaturbo.modeling import cut_passages, read_text, tokenize_text

__all__ = ["scan"]


def scan(
    model,
    tokenizer,
    bundle_dir: str | Path,
    text_file: str | Path,
    passages: int = 4,
    ctx: int = 960,
    n_eval: int = 64,
    probe_bits: float = 2.0,
    progress: bool = True,
    mode: str = "snapshot",
) -> dict:
    """Per-layer KL of compressing one layer's K (or V) alone at ``probe_bits``; ``mode``
    "in-forward" measures each layer with its error carried through the layers above it, and
    "both" takes the geometric mean of the two protocols' KLs, so each layer's offset is the
    mean of the two protocols' offsets: bits for a cache that serves finished prefills and
    chunked prefills alike. (A sum lets the larger in-forward KLs decide: on SmolLM2 it left
    the copying test MARGINAL, where the geometric mean is ACCEPT; see docs/recipe.md.)"""
    if mode not in ("snapshot", "in-forward", "both"):
        raise ValueError(f"mode must be snapshot, in-forward or both, not {mode!r}")
    ids = tokenize_text(tokenizer, read_text(text_file))
    ps = cut_passages(ids, passages, ctx + n_eval + 1)
    ref = prepare_reference(model, ps, ctx, n_eval)
    n_layers = model.config.num_hidden_layers
    modes = ("snapshot", "in-forward") if mode == "both" else (mode,)
    per_mode: dict[str, dict[str, list[float]]] = {m: {"k": [], "v": []} for m in modes}
    jobs = [(s, i) for s in ("k", "v") for i in range(n_layers)]
    for s, i in tqdm(jobs, desc="sensitivity", disable=not progress):
        spec = (
            f"kakeya:calibration={bundle_dir},layer_bits=false,bits_per_value={probe_bits},"
            f"layers={i},streams={s},passthrough=exact"
        )
        method = build_method(spec)  # one bundle load per stream, whatever the modes
        for m in modes:
            per_mode[m][s].append(float(evaluate_method(model, ref, method, m)["kl"]))
    kl = {s: [_geomean(v) for v in zip(*(per_mode[m][s] for m in modes))] for s in ("k", "v")}
    out = {
        "mode": mode,
        "probe_bits": probe_bits,
        "passages": passages,
        "kl": kl,
        "offsets": joint_offsets(kl),
    }
    if mode == "both":  # each protocol's own KLs, so other blends need no second scan
        # Named, so a reader of the bundle can tell this blend from a sum of the two KLs.
        out["blend"] = "geometric mean"
        out["kl_by_mode"] = per_mode
    return out


def _geomean(values: tuple[float, ...]) -> float:
    # layer_offsets floors a KL at 1e-12 before its logarithm; the blend does the same.
    return float(np.exp(np.mean(np.log(np.maximum(values, 1e-12)))))
