"""Probe, not shipped: keys coded post-RoPE in a calibrated query-aware frame.

    .venv/bin/python benches/probe_post_rope_frames.py --calibration artifacts/calib-smollm2

Post-RoPE keys would let attention over the codes score a block without the per-token frame
product and RoPE turn (the query goes into the frame once: ``q M^T . y``), the product that
bounds decode speed today (docs/speed.md). Earlier, post-RoPE keys in self-fitted frames cost
2.5x the KL. This fits the bundle's key frame (whitened by the post-RoPE query second moment)
on post-RoPE queries and keys of the same calibration text, keeps the bundle's values and
per-layer bits, and scores both bundles in snapshot mode on WikiText.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

import smollm2_eval  # benches/, beside this script
from bench_args import CALIBRATION_TEXT  # benches/, beside this script
from kakeyaturbo.calibration import Calibration
from kakeyaturbo.calibration.fit import collect_moments, fit_bundle
from kakeyaturbo.eval.harness import evaluate_method
from kakeyaturbo.eval.registry import build_method
from kakeyaturbo.hf.rope import ModelRope
from kakeyaturbo.modeling import resolve_model_dir

KEY_TENSORS = ("q_second_moment", "k_whiten", "k_transform", "k_inverse", "k_variances", "k_pca")


def post_rope_bundle(model, tokenizer, bundle: Calibration, text: str, out: Path) -> Path:
    ids = tokenizer(Path(text).read_text()[: bundle.meta["tokens"] * 12], add_special_tokens=False)[
        "input_ids"
    ][: bundle.meta["tokens"]]
    moments = collect_moments(model, ids, ctx=bundle.meta["ctx"], rope=ModelRope(model.config))
    fitted = fit_bundle(moments, bundle.meta["ridge"])
    tensors = {k: (fitted[k] if k in KEY_TENSORS else v) for k, v in bundle.tensors.items()}
    Calibration(fingerprint=bundle.fingerprint, tensors=tensors, meta=dict(bundle.meta)).save(out)
    return out


def main(argv=None) -> None:
    ap = smollm2_eval.parser(__doc__)
    ap.add_argument("--calib-text", default=CALIBRATION_TEXT)
    ap.add_argument("--out", default="artifacts/calib-smollm2-post-rope")
    args = ap.parse_args(argv)
    setup = smollm2_eval.setup(args)
    bundle = Calibration.load(args.calibration)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(args.model))
    post = post_rope_bundle(setup.model, tokenizer, bundle, args.calib_text, Path(args.out))
    print(f"{args.passages} passages, ctx 960 + 64, snapshot")
    for spec in (
        f"kakeya:calibration={args.calibration}",
        f"kakeya:calibration={post},pre_rope=false",
        "kakeya",
        "kakeya:pre_rope=false",
    ):
        method = build_method(spec)
        # The bundle lives in the method's pipeline; clearing the attribute only lifts the
        # method's "calibration needs pre_rope" check, which this probe's bundle would fail.
        method.calibration = None
        r = evaluate_method(setup.model, setup.reference, method, "snapshot")
        print(f"{spec:60s} {smollm2_eval.scores(r, digits=3)}", flush=True)


if __name__ == "__main__":
    main()
