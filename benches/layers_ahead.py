"""Decode steps with the keys of 0, 1, 2, ... following layers made ahead, interleaved in one
process over one prefilled cache.

    .venv/bin/python benches/layers_ahead.py --calibration artifacts/calib-smollm2-joint-both \
        --context 4096 --ahead 1 2 >> reports/layers_ahead.txt

The cache is prefilled once; each round then times ``--steps`` decode steps for every value of
``--ahead`` in turn (``coded_attention.LAYERS_AHEAD``; 0 turns ``prepare_keys_ahead`` off), with
the new token cropped after each step, so every setting attends over the same blocks. Prints
each round's milliseconds per step and, per setting, the median over rounds and its ratio to
the first setting's. torch on 1 thread (the codec's worker is idle only then).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from bench_args import add_model_and_text  # benches/, beside this script
from kakeyaturbo.calibration import Calibration
from kakeyaturbo.hf import CACHE_ARG, KakeyaCache, coded_attention
from kakeyaturbo.modeling import load_model, read_text, tokenize_text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_and_text(ap)
    ap.add_argument("--calibration", help="a calibration bundle (default: none)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--ahead", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=30, help="decode steps per setting and round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if min(args.ahead) < 0:
        raise SystemExit("--ahead takes layer counts of 0 or more")

    torch.set_num_threads(1)
    model, tok = load_model(args.model)
    cal = Calibration.load(args.calibration, model) if args.calibration else None
    ids = torch.as_tensor(tokenize_text(tok, read_text(args.text))).reshape(1, -1)
    if ids.shape[1] < args.context + 1:
        raise SystemExit(f"the text has {ids.shape[1]} tokens, fewer than --context + 1")
    ids = ids[:, : args.context + 1]
    print(f"model {args.model}, bundle {args.calibration}, context {args.context}, 1 torch thread")
    print(f"{args.steps} decode steps per setting and round, {args.rounds} rounds, interleaved")
    times: dict[int, list[float]] = {a: [] for a in args.ahead}
    with torch.inference_mode():
        cache = KakeyaCache.from_model(model, calibration=cal, hot_dtype=torch.bfloat16)
        model(ids[:, : args.context], **{CACHE_ARG: cache})
        new = ids[:, args.context :]
        for _ in tqdm(range(args.rounds), desc="rounds", unit="round"):
            for ahead in args.ahead:
                coded_attention.LAYERS_AHEAD = max(ahead, 1)
                cache._ctx.prepare_keys_ahead = ahead > 0
                model(new, **{CACHE_ARG: cache})  # one step to settle, not timed
                cache.crop(-1)
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    model(new, **{CACHE_ARG: cache})
                    cache.crop(-1)
                times[ahead].append(1000 * (time.perf_counter() - t0) / args.steps)
            tqdm.write("  ".join(f"ahead {a}: {times[a][-1]:6.1f} ms" for a in args.ahead))
    first = statistics.median(times[args.ahead[0]])
    for a in args.ahead:
        med = statistics.median(times[a])
        ratio = f"{med / first:.3f}x ahead {args.ahead[0]}'s"
        print(f"layers ahead {a}: median {med:6.1f} ms per step, {ratio}")


if __name__ == "__main__":
    main()
