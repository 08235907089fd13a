"""What the SmolLM2 evaluation probes in benches/ share: their data arguments, the loaded
reference (ctx 960 + 64 scored tokens, the protocol of reports/) and their result lines."""

from __future__ import annotations

import argparse

import torch

from bench_args import add_model_and_text  # benches/, beside this script
from kakeyaturbo.eval.ppl import Setup, load_setup


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser with --model, --text, --calibration, --passages and --threads."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_model_and_text(ap)
    ap.add_argument("--calibration", required=True, help="calibration bundle folder")
    ap.add_argument("--passages", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    return ap


def setup(args: argparse.Namespace) -> Setup:
    torch.set_num_threads(args.threads)
    return load_setup(args.model, args.text, 960, 64, args.passages, progress=False)


def scores(r: dict, digits: int = 2) -> str:
    """One evaluated method's row (``evaluate_method``) as a line: ratio and KL to ``digits``."""
    return (
        f"ratio {r['ratio']:.{digits}f}x  delta-ppl {100 * r['delta_ppl']:+.2f}%  "
        f"KL {r['kl']:.{digits}e}  top-1 {r['top1']:.3f}  {r['verdict']}"
    )
