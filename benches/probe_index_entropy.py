"""Probe, not shipped: how many bytes entropy coding the quantiser indices would save, measured.

    .venv/bin/python benches/probe_index_entropy.py --calibration artifacts/calib-smollm2

docs/recipe.md names entropy-coded indices as the next lever for in-forward quality at 5x, with a
textbook estimate (0.2-0.45 bits per component for Gaussian sources). This measures it on the
codes the calibrated default really writes for SmolLM2 (snapshot mode, WikiText-2, ctx 960): it
records every block the evaluation codes, reads each block's per-component widths and codes out
of the wire bytes (format v1, ``format/mod.rs``), and prints, per stream and in total:

- the fixed-rate code bits the format spends (sum of widths x tokens);
- ``static``: the cross-entropy of the indices under one probability table per (stream, width)
  fitted on the other passages (leave-one-passage-out), what a codec with fixed tables per width
  and no side information would spend (the tables would ship with the bundle);
- ``per-block``: the plug-in entropy of each (block, component), a bound no coder reaches (it
  ignores the cost of sending the table and is biased low on 256 samples);
- what the ``static`` saving would make of the ratio, every other byte unchanged (norms, block
  side information, sinks). Lossless: quality would be what the evaluation measures now.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

import smollm2_eval  # benches/, beside this script
from kakeyaturbo.eval.harness import evaluate_method
from kakeyaturbo.eval.registry import build_method

HEADER, BLOCK_HEADER = 80, 20  # format v1 (format/mod.rs)


def widths_and_codes(raw: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(widths [d], codes [n, d]) of a one-block water-filled layer with the identity basis
    and float16 skeleton (the recipe's streams); codes of 0-bit components are 0."""
    n, d_eff = np.frombuffer(raw, "<u4", 2, HEADER)
    o = HEADER + BLOCK_HEADER + 2 * d_eff  # block header, mean f16 x D (D = d_eff)
    o += 2 * d_eff  # sigma f16 x d_eff
    packed = np.frombuffer(raw, np.uint8, (d_eff + 1) // 2, o)
    widths = np.stack((packed & 15, packed >> 4), -1).reshape(-1)[:d_eff].astype(np.int64)
    o += (d_eff + 1) // 2
    per_vector = int(widths.sum())
    nbytes = (n * per_vector + 7) // 8
    bits = np.unpackbits(np.frombuffer(raw, np.uint8, nbytes, o), bitorder="little")
    bits = bits[: n * per_vector].reshape(n, per_vector).astype(np.int64)
    codes = np.zeros((n, d_eff), np.int64)
    start = np.concatenate(([0], np.cumsum(widths)[:-1]))
    for j in np.nonzero(widths)[0]:
        w = bits[:, start[j] : start[j] + widths[j]]
        codes[:, j] = (w << np.arange(widths[j])).sum(-1)
    return widths, codes


def entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def main(argv=None) -> None:
    args = smollm2_eval.parser(__doc__).parse_args(argv)
    setup = smollm2_eval.setup(args)
    method = build_method(f"kakeya:calibration={args.calibration}")
    method.recorded = {}
    r = evaluate_method(setup.model, setup.reference, method, "snapshot")
    print(f"calibrated default, snapshot: {smollm2_eval.scores(r)}")

    # (stream, width) -> passage -> histogram over the 2^width symbols
    hist: dict = defaultdict(lambda: defaultdict(lambda: None))
    fixed = defaultdict(float)
    plugin = defaultdict(float)
    items = []  # (stream, passage, width, counts)
    for (_layer, stream), per_passage in method.recorded.items():
        for p, blocks in enumerate(per_passage):
            for blk in blocks:
                for enc in blk.encs:
                    widths, codes = widths_and_codes(enc.to_bytes())
                    for j in np.nonzero(widths)[0]:
                        w = int(widths[j])
                        counts = np.bincount(codes[:, j], minlength=1 << w)
                        fixed[stream] += w * codes.shape[0]
                        plugin[stream] += entropy(counts) * codes.shape[0]
                        items.append((stream, p, w, counts))
                        h = hist[(stream, w)]
                        h[p] = counts if h[p] is None else h[p] + counts
    static = defaultdict(float)
    for stream, p, w, counts in items:
        others = [c for q, c in hist[(stream, w)].items() if q != p and c is not None]
        pooled = sum(others) if others else hist[(stream, w)][p]
        prob = (pooled + 0.5) / (pooled + 0.5).sum()  # add-half: no symbol costs infinity
        static[stream] += float(-(counts * np.log2(prob)).sum())

    print(f"\n{'stream':6s} {'code bits':>12s} {'static':>16s} {'per-block':>16s}")
    for s in ("k", "v"):
        f = fixed[s]
        print(
            f"{s:6s} {f:12.0f} {static[s]:12.0f} ({static[s] / f:5.1%}) "
            f"{plugin[s]:12.0f} ({plugin[s] / f:5.1%})"
        )
    f_all, s_all = sum(fixed.values()), sum(static.values())
    print(f"all    {f_all:12.0f} {s_all:12.0f} ({s_all / f_all:5.1%})")
    for s in ("k", "v"):
        ws = [i[2] for i in items if i[0] == s]
        print(f"{s}: mean width of the coded components {np.mean(ws):.2f} bits")
    # The ratio counts every byte of the bf16 prefix against every stored byte, per passage.
    passages = len(method.recorded[(0, "k")])
    saved = (f_all - s_all) / 8 / passages
    new_ratio = r["bf16_bytes"] / (r["stored_bytes"] - saved)
    print(
        f"static tables save {saved / 1e3:.1f} kB of {r['stored_bytes'] / 1e3:.1f} kB stored per "
        f"passage: ratio {r['ratio']:.2f}x -> {new_ratio:.2f}x at the same quality"
    )

if __name__ == "__main__":
    main()
