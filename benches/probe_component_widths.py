"""Probe, not shipped: how the default cache's blocks spread their components over code widths,
and what a table-lookup frame product could save.

    .venv/bin/python benches/probe_component_widths.py \\
        --calibration artifacts/calib-smollm2-joint-both

On the CPU a decode step's largest part is the keys' frame product: every token's key is taken
out of the frame, one multiply-add row per component that varies within its block (components
water-filling gave no bits are folded once per block). A component of ``b`` bits takes only
``2^b`` values, so consecutive components whose codes together take at most ``--table-bits``
bits could share one table of their ``2^bits`` summed rows, built once per block: one row added
per token and group instead of one per component. This prefills SmolLM2 through the default
cache and counts, over every layer's blocks, the components by width and the rows per token
of the product both ways (components grouped greedily in their stored order, as the decoder's
lanes group them; a table's ``2^bits`` rows are built once per block, spread over its tokens).
A ratio near 1 means the tables would not pay for themselves.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from bench_args import add_model_and_text  # benches/, beside this script
from kakeyaturbo import _core
from kakeyaturbo.hf import CACHE_ARG, KakeyaCache
from kakeyaturbo.modeling import load_model, read_text, tokenize_text


def table_rows(bits: list[int], table_bits: int, tokens: int) -> float:
    """Rows added per token with tables: consecutive coded components grouped while their
    codes fit in ``table_bits`` bits (a wider component alone, as one row per token), plus
    each table's ``2^bits`` rows built once for the block's ``tokens``."""
    widths: list[int] = []
    for b in (b for b in bits if b > 0):
        if widths and widths[-1] + b <= table_bits:
            widths[-1] += b
        else:
            widths.append(b)
    return sum(1 + (2**w / tokens if w <= table_bits else 0) for w in widths)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_and_text(ap)
    ap.add_argument("--calibration", required=True, help="a calibration bundle folder")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--table-bits", type=int, nargs="+", default=[4, 6])
    args = ap.parse_args(argv)
    model, tok = load_model(args.model)
    ids = tokenize_text(tok, read_text(args.text))[: args.context][None]
    cache = KakeyaCache.from_model(model, calibration=args.calibration)
    with torch.inference_mode():
        model(ids, **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1)
    print(f"{args.model}, {args.context} tokens, bundle {args.calibration}")
    for stream in ("k", "v"):
        widths: Counter = Counter()
        grouped: Counter = Counter()
        varying = 0
        for layer in cache.layers:
            for blk in layer._blocks:
                for enc in getattr(blk, stream).encs:
                    for section in _core.waterfill_sections(enc._raw):
                        bits = [int(b) for b in section["bits"]]
                        widths.update(bits)
                        varying += sum(b > 0 for b in bits)
                        for t in args.table_bits:
                            grouped[t] += table_rows(bits, t, section["n"])
        total = sum(widths.values())
        spread = "  ".join(f"{b}:{widths[b] / total:.3f}" for b in sorted(widths))
        print(f"{stream}: components by width  {spread}")
        for t in args.table_bits:
            print(
                f"{stream}: rows per token, one per varying component {varying / total:.3f} of "
                f"the components; with {t}-bit tables {grouped[t] / total:.3f} "
                f"({varying / grouped[t]:.2f}x fewer)"
            )


if __name__ == "__main__":
    main()
