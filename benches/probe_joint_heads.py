"""Probe, not shipped: what one frame across a layer's KV heads would save over a frame per head.

    .venv/bin/python benches/probe_joint_heads.py --calibration artifacts/calib-smollm2

The codec codes each KV head in its own frame (keys: the bundle's query-aware whitened PCA;
values: the bundle's PCA, as unit vectors). KVTC (ICLR 2026) decorrelates across heads too.
This measures, on SmolLM2, how much rate that leaves on the table: the keys and values of
calibration text are taken into the bundle's frames exactly as the pipeline codes them, the
covariance of all heads' coordinates together (``heads x head_dim``) is fitted there, and on
WikiText the variances along its eigenvectors are compared with the variances along the
per-head axes. Rates are Gaussian reverse water-filling bounds at the same distortion, so the
saving is what an ideal coder would gain; the codec's per-block sigma and mean, its Lloyd-Max
quantiser and its side information are left out on both sides alike. Distortion is measured in
the coding frame, the metric the codec already minimises (for keys, the query-aware one).

A joint frame would also cost attention over the codes: each query head's key logits and value
sums would run over all heads' components instead of its own head's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from bench_args import CALIBRATION_TEXT, SMOLLM2, WIKITEXT  # benches/, beside this script
from kakeyaturbo.calibration import Calibration
from kakeyaturbo.capture import capture_kv, read_tokens
from kakeyaturbo.modeling import load_model
from kakeyaturbo.pipeline import Pipeline
from kakeyaturbo.recipes import default_recipe
from probe_joint_frames_eval import joint_coordinates  # benches/, beside this script

RATES = (1.5, 2.5, 3.5)


def waterfill_distortion(variances: np.ndarray, bits: float) -> float:
    """Reverse water-filling: the distortion (a fraction of the total variance) at ``bits``
    per component on average, for independent Gaussian components of these variances."""
    lam = np.maximum(variances, 1e-20)
    budget = bits * lam.size
    lo, hi = 1e-20, float(lam.max())
    for _ in range(200):
        level = np.sqrt(lo * hi)
        rate = np.maximum(0.0, 0.5 * np.log2(lam / level)).sum()
        lo, hi = (level, hi) if rate > budget else (lo, level)
    return float(np.minimum(level, lam).sum() / lam.sum())


def rate_for(variances: np.ndarray, distortion: float) -> float:
    """The bits per component at which water-filling reaches ``distortion``."""
    lo, hi = 0.0, 16.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if waterfill_distortion(variances, mid) <= distortion else (mid, hi)
    return hi


def variances_along(fit: np.ndarray, test: np.ndarray, blocks: list[slice]) -> tuple:
    """Test-set variances along the fit set's eigenvectors, per block of coordinates (one
    block per head: a frame per head) and over all of them at once (one joint frame)."""
    mean = fit.mean(0)

    def along(cols: slice) -> np.ndarray:
        _, vecs = np.linalg.eigh(np.cov(fit[:, cols] - mean[cols], rowvar=False))
        return ((test[:, cols] - mean[cols]) @ vecs).var(0)

    per_head = np.concatenate([along(b) for b in blocks])
    return per_head, along(slice(None))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=SMOLLM2)
    ap.add_argument("--calibration", required=True, help="calibration bundle folder")
    ap.add_argument("--fit-text", default=CALIBRATION_TEXT)
    ap.add_argument("--test-text", default=WIKITEXT)
    ap.add_argument("--chunks", type=int, default=4, help="1024-token forwards per text")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    calib = Calibration.load(args.calibration)
    pipe = Pipeline(default_recipe(calib), calibration=calib)

    def capture(text: str) -> list[dict]:
        ids = read_tokens(tok, text, 1024 * args.chunks)
        return [capture_kv(model, ids[i * 1024 : (i + 1) * 1024]) for i in range(args.chunks)]

    fit_kv, test_kv = capture(args.fit_text), capture(args.test_text)
    cfg = model.config
    heads = cfg.num_key_value_heads
    d = cfg.hidden_size // cfg.num_attention_heads
    blocks = [slice(h * d, (h + 1) * d) for h in range(heads)]
    print(f"model {Path(args.model).name}: {cfg.num_hidden_layers} layers, {heads} KV heads x {d}")
    print(
        f"fit on {args.chunks * 1024} tokens of {Path(args.fit_text).name}, measured on "
        f"{args.chunks * 1024} tokens of {Path(args.test_text).name}"
    )
    print("saving = bits per value a joint frame saves at the per-head frames' distortion")
    head = "layer stream " + "  ".join(f"D@{r}b sep/joint  saving" for r in RATES)
    print(head)
    totals = {s: np.zeros(len(RATES)) for s in "kv"}
    for layer in range(cfg.num_hidden_layers):
        for stream in "kv":
            fit = np.concatenate([joint_coordinates(pipe, kv, layer, stream) for kv in fit_kv])
            test = np.concatenate([joint_coordinates(pipe, kv, layer, stream) for kv in test_kv])
            sep, joint = variances_along(fit, test, blocks)
            cells = []
            for i, bits in enumerate(RATES):
                dist = waterfill_distortion(sep, bits)
                saving = bits - rate_for(joint, dist)
                totals[stream][i] += saving / cfg.num_hidden_layers
                cells.append(f"{dist:.4f}/{waterfill_distortion(joint, bits):.4f}  {saving:+.3f}")
            print(f"{layer:5d} {stream:6s} " + "  ".join(cells))
    for stream in "kv":
        mean = "  ".join(f"{bits}b {s:+.3f}" for bits, s in zip(RATES, totals[stream]))
        print(f"mean saving over layers, {stream}: {mean} bits per value")


if __name__ == "__main__":
    main()
