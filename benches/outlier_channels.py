"""Outlier channels on a real model: SmolLM2 against the same model given a value channel and a
key channel pair 100x the others in every layer (``kakeyaturbo.eval.outlier_channels``: the
same function, so the same reference), each method's ratio and KL on both, by ``eval ppl``.
Writes reports/outlier_channels.json.

    python benches/outlier_channels.py [--passages 8] [--mode snapshot]
        [--method kakeya --method kivi:bits=4]

Each model is evaluated with the same command a user runs; ``kakeya`` with no option uses the
model's own bundle, fitted on first use (a few minutes for each of the two models).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench_args import add_model_and_text  # (benches/, beside this script)
from kakeyaturbo.eval.outlier_channels import with_outlier_channels
from kakeyaturbo.modeling import load_model
from variant_eval import cell, evaluate, rows, saved

REPO = Path(__file__).resolve().parents[1]
VALUE_CHANNEL, KEY_CHANNEL, FACTOR = 5, 7, 100.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_and_text(ap)
    ap.add_argument("--passages", type=int, default=8)
    ap.add_argument("--method", action="append", default=None)
    ap.add_argument("--mode", default="snapshot", choices=["snapshot", "in-forward"])
    ap.add_argument("--out", default=str(REPO / "reports" / "outlier_channels.json"))
    args = ap.parse_args()
    args.method = args.method or ["kakeya", "kivi:bits=4"]
    model, tok = load_model(args.model)
    skewed = with_outlier_channels(model, None, VALUE_CHANNEL, KEY_CHANNEL, FACTOR)
    result = {
        "outliers": {
            "value_channel": VALUE_CHANNEL,
            "key_channel_pair": KEY_CHANNEL,
            "factor": FACTOR,
            "layers": "all",
        },
        "passages": args.passages,
        "mode": args.mode,
        "methods": args.method,
    }
    with saved(skewed, tok) as folder:
        del model, skewed
        for which, where in (("original", args.model), ("outliers_100x", str(folder))):
            report = evaluate(
                where, args.text, args.passages, args.mode, args.method, folder / "r.json"
            )
            result[which] = rows(report)
    print(f"\n{'method':<16} {'original':>40}   {'100x channels':>40}")
    for m in result["original"]:
        cells = [cell(result[w][m]) for w in ("original", "outliers_100x")]
        print(f"{m:<16} {cells[0]:>40}   {cells[1]:>40}")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
