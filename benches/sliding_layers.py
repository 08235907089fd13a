"""Sliding-window layers, coded or held exact: SmolLM2 run with Gemma 3's layer pattern (five
of every six layers attend to the newest 512 tokens; ``kakeyaturbo.eval.sliding_variant``), each
method with its windows held exact (the default) and coded (``sliding=code``), by ``eval
ppl``. Every layer's bytes count in the ratio. Writes reports/sliding_layers.json.

    python benches/sliding_layers.py [--passages 8] [--mode snapshot] [--window 512]

``kakeya`` with no option uses the variant's own bundle, fitted on first use (a few minutes).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench_args import add_model_and_text  # (benches/, beside this script)
from kakeyaturbo.eval.sliding_variant import FULL_EVERY, WINDOW, with_sliding_layers
from kakeyaturbo.modeling import load_model
from variant_eval import cell, evaluate, rows, saved

REPO = Path(__file__).resolve().parents[1]
METHODS = ["kakeya", "kivi:bits=4"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_and_text(ap)
    ap.add_argument("--passages", type=int, default=8)
    ap.add_argument("--mode", default="snapshot", choices=["snapshot", "in-forward"])
    ap.add_argument("--window", type=int, default=WINDOW)
    ap.add_argument("--out", default=str(REPO / "reports" / "sliding_layers.json"))
    args = ap.parse_args()
    model, tok = load_model(args.model)
    variant = with_sliding_layers(model, args.window, FULL_EVERY)
    methods = []
    for m in METHODS:
        methods += [m, f"{m}{',' if ':' in m else ':'}sliding=code"]
    result = {
        "layers": {"window": args.window, "full_every": FULL_EVERY},
        "passages": args.passages,
        "mode": args.mode,
    }
    with saved(variant, tok) as folder:
        del model, variant
        report = evaluate(
            str(folder), args.text, args.passages, args.mode, methods, folder / "r.json"
        )
    result["methods"] = rows(report)
    print(f"\n{'method':<28} result (every layer's bytes counted)")
    for m, r in result["methods"].items():
        print(f"{m:<28} {cell(r)}")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
