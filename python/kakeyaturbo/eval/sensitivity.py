"""The per-layer sensitivity scan behind a calibration bundle's per-layer bits: the KL of
compressing one layer's keys (or values) alone, on calibration text; the offsets follow in
:mod:`kakeyaturbo.calibration.sensitivity`.

Every layer is coded once per passage. The snapshot KL of each stream is then measured
exactly: the scored continuation is run again with only that stream's prefix replaced by its
reconstruction (a forward pass of the continuation alone). The in-forward KL, where the error
also travels through the prefill of the layers above, would take a whole prefill per stream;
it is the snapshot KL times the amplification that :mod:`kakeyaturbo.eval.fisher` estimates
for all streams from one pass (its second-order estimates of the two protocols, on the same
draws)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from kakeyaturbo.calibration.sensitivity import joint_offsets
from kakeyaturbo.eval.fisher import fisher_along
from kakeyaturbo.eval.harness import (
    codes_layer,
    compress_stream,
    continue_logits,
    evaluate_method,
    prepare_reference,
)
from kakeyaturbo.eval.kakeya_codec import KakeyaCodec
from kakeyaturbo.eval.methods import attach_options
from kakeyaturbo.eval.metrics import passage_scores, summarize
from kakeyaturbo.hf.rope import ModelRope
from kakeyaturbo.modeling import Passage, cut_passages, read_text, tokenize_text

__all__ = ["scan", "scan_passages"]

MODES = ("snapshot", "in-forward", "both")


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
    samples: int = 4,
    exact: bool = False,
) -> dict:
    """The scan on ``passages`` windows of ``text_file`` (see :func:`scan_passages`)."""
    ids = tokenize_text(tokenizer, read_text(text_file))
    ps = cut_passages(ids, passages, ctx + n_eval + 1)
    return scan_passages(
        model, bundle_dir, ps, ctx, n_eval, probe_bits, progress, mode, samples, exact
    )


def scan_passages(
    model,
    bundle_dir: str | Path,
    passages: list[Passage],
    ctx: int,
    n_eval: int,
    probe_bits: float = 2.0,
    progress: bool = True,
    mode: str = "snapshot",
    samples: int = 4,
    exact: bool = False,
) -> dict:
    """Per-layer KL of compressing one layer's K (or V) alone at ``probe_bits``. ``mode``
    "in-forward" scales each snapshot KL by its estimated in-forward amplification, and "both"
    takes the geometric mean of the two protocols' KLs, so each layer's offset is the mean of
    the two protocols' offsets: bits for a cache that serves finished prefills and chunked
    prefills alike. (A sum lets the larger in-forward KLs decide: on SmolLM2 it left the
    copying test MARGINAL, where the geometric mean is ACCEPT; see docs/recipe.md.)
    ``samples``: the draws of the amplification estimate, per passage. ``exact``: measure the
    in-forward KLs instead, a prefill of every passage per stream (on SmolLM2 about 10x the
    time of the rest of the scan)."""
    if mode not in MODES:
        raise ValueError(f"mode must be snapshot, in-forward or both, not {mode!r}")
    ref = prepare_reference(model, passages, ctx, n_eval, batch=2)
    method = _probe(bundle_dir, probe_bits)
    rope = ModelRope(model.config) if method.options.pre_rope else None
    streams = [(li, s) for s in ("k", "v") for li in range(model.config.num_hidden_layers)]
    scores: dict[tuple[int, str], list] = {w: [] for w in streams}
    fisher = {"cached": dict.fromkeys(streams, 0.0), "carried": dict.fromkeys(streams, 0.0)}
    # Sliding-window layers held exact (as in KakeyaCache) have no error to measure: KL 0,
    # offset 0, no continuation run for them.
    first = ref.batches[0].cache
    uncoded = frozenset(li for li, _ in streams if not codes_layer(method, first, li))
    streams = [w for w in streams if w[0] not in uncoded]
    steps = len(ref.batches) * (len(streams) + (mode != "snapshot" and not exact))
    bar = tqdm(total=steps, desc="sensitivity", disable=not progress)
    for batch in ref.batches:
        coded = {}
        for w in streams:
            held = _exact(batch.cache, w)
            start = ctx - held.shape[-2]  # a sliding layer holds the newest tokens only
            coded[w] = compress_stream(method, held, *w, rope, start)[0]
        for w in streams:
            with torch.inference_mode():
                logits = _continue_with(model, batch.cache, batch.cont, w, coded[w])
            scores[w].extend(passage_scores(batch.logits, logits, batch.targets))
            bar.update()
        if mode != "snapshot" and not exact:
            errors = {w: coded[w] - _exact(batch.cache, w) for w in streams}
            est = fisher_along(model, batch.prefix, batch.cont, batch.cache, errors, samples)
            for p in fisher:
                for w in streams:
                    fisher[p][w] += est[p][w] * len(batch.passages)
            bar.update()
    bar.close()
    layers = range(model.config.num_hidden_layers)
    snap = {
        s: [summarize(scores[(li, s)]).kl if li not in uncoded else 0.0 for li in layers]
        for s in "kv"
    }
    per_mode = {"snapshot": snap}
    if mode != "snapshot" and exact:
        per_mode["in-forward"] = _measured_in_forward(model, ref, streams, bundle_dir, probe_bits)
    elif mode != "snapshot":
        per_mode["in-forward"] = {
            s: [
                kl * _amplification(fisher["carried"][(li, s)], fisher["cached"][(li, s)])
                for li, kl in enumerate(snap[s])
            ]
            for s in "kv"
        }
    modes = ("snapshot", "in-forward") if mode == "both" else (mode,)
    kl = {s: [_geomean(v) for v in zip(*(per_mode[m][s] for m in modes))] for s in ("k", "v")}
    out = {
        "mode": mode,
        "probe_bits": probe_bits,
        "passages": len(passages),
        "kl": kl,
        "offsets": joint_offsets(kl, uncoded),
    }
    if mode == "both":  # each protocol's own KLs, so other blends need no second scan
        # Named, so a reader of the bundle can tell this blend from a sum of the two KLs.
        out["blend"] = "geometric mean"
        out["kl_by_mode"] = per_mode
    return out


def _measured_in_forward(model, ref, streams, bundle_dir, probe_bits) -> dict[str, list[float]]:
    """In-forward KLs of ``streams`` (the others 0: not coded)."""
    n = model.config.num_hidden_layers
    kl: dict[str, list[float]] = {"k": [0.0] * n, "v": [0.0] * n}
    for li, s in tqdm(streams, desc="in-forward, measured"):
        method = _probe(bundle_dir, probe_bits, layers=li, streams=s)
        kl[s][li] = float(evaluate_method(model, ref, method, "in-forward")["kl"])
    return kl


def _probe(bundle_dir, probe_bits: float, **only) -> KakeyaCodec:
    """The codec in the bundle's frames at ``probe_bits`` everywhere (no per-layer bits), what
    it does not code left exact; ``only``: the shared ``layers`` / ``streams`` options."""
    params = {"calibration": str(bundle_dir), "layer_bits": False, "bits_per_value": probe_bits}
    spec = f"kakeya:calibration={bundle_dir},layer_bits=false,bits_per_value={probe_bits}"
    return attach_options(KakeyaCodec(params), spec, {"passthrough": "exact", **only})


def _exact(cache, w: tuple[int, str]) -> torch.Tensor:
    layer = cache.layers[w[0]]
    return layer.keys if w[1] == "k" else layer.values


def _continue_with(model, cache, cont, w: tuple[int, str], coded: torch.Tensor) -> torch.Tensor:
    """The continuation's logits with stream ``w`` of the prefix replaced by ``coded`` (the
    other layers' tensors are shared with ``cache``, which is left as it was)."""
    mixed = copy.copy(cache)
    mixed.layers = [copy.copy(layer) for layer in cache.layers]
    layer = mixed.layers[w[0]]
    if w[1] == "k":
        layer.keys = coded
    else:
        layer.values = coded
    return continue_logits(model, mixed, cont)


def _amplification(carried: float, cached: float) -> float:
    """How much more the error costs carried through the prefill than read from the cache; 1
    where there is no error to read (a layer that is not coded)."""
    return carried / cached if cached > 0 else 1.0


def _geomean(values: tuple[float, ...]) -> float:
    # layer_offsets floors a KL at 1e-12 before its logarithm; the blend does the same.
    return float(np.exp(np.mean(np.log(np.maximum(values, 1e-12)))))
