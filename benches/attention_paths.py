"""One decode step's time with DynamicCache and with KakeyaCache's CPU attention paths,
interleaved in one process so the shared machine's drift falls on every path alike.

    .venv/bin/python benches/attention_paths.py \\
        --model ../shared/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --contexts 4096 8064 --calibration artifacts/calib-smollm2

Paths of KakeyaCache (the same cache, the same codes; ``hf/coded_attention.py``):
- ``whole``: the codec computes a decode step's whole attention in one call per layer
  (``Pipeline.attend``: logits, softmax, value sums, exact part), the default;
- ``two-kernels``: the codec's logits and value-sum kernels around a torch softmax, bias and
  exact part (``WHOLE_ATTENTION_ROWS = 0``), the default before ``attend``;
- ``own-pool`` (with ``--threads`` above 1): ``whole`` with the codec on its own rayon pool
  (``kakeyaturbo.share_torch_threads(False)``) instead of torch's OpenMP threads;
- ``whole-f32`` / ``whole-int16`` / ``whole-bf16``: ``whole`` with the key frame product in
  each ``attention_precision`` other than the cache's default, which the other paths run (the
  narrow ones run float32 where the CPU lacks AVX2 or AVX512-VNNI / AVX512-BF16);
- ``not-ahead``: ``whole`` without the next layer's keys made ahead on the codec's idle worker
  (``prepare_keys_ahead=False``; with more than one torch thread no worker is idle, and the
  two are the same).

With ``--joint-calibration`` (a bundle fitted with ``calibrate --joint-heads``), two more caches
coded across heads: ``joint`` attends over their codes (one virtual head of width heads x
head_dim: the whole attention in one call, each head's exact part, scales and value frame in
it; ``joint-two-kernels``: the logits and value-sum kernels around torch; ``joint-f32`` /
``joint-int16`` / ``joint-bf16``: the frame product in each other precision;
``joint-not-ahead``: no keys made ahead), ``joint-decode`` decodes every block each step
(``coded_attention=False``); ``--joint-heads v`` (or ``k``) adds ``joint-v``, the same bundle
with only that stream coded across heads (the recipe's ``joint_heads``).

Each context is prefilled once per cache; then each repetition times ``--steps`` single-token
forwards per path in turn (each forward's token cropped again, so every step sees the same
cache). Prints each repetition and the medians' ratios to DynamicCache's step, and splits each
median step into the time inside the model's attention function (sdpa for DynamicCache, the
``kakeya`` attention for the cache's paths) and the rest (projections, MLP, cache updates).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import kakeyaturbo
import kakeyaturbo.hf.coded_attention as coded_attention
from kakeyaturbo.hf import CACHE_ARG, KakeyaCache, KakeyaOptions
from kakeyaturbo.hf.attention import NAME as KAKEYA_ATTENTION
from kakeyaturbo.modeling import load_model, read_text, tokenize_text
from kakeyaturbo.recipes import default_recipe

# The precisions' short names in path names.
PRECISIONS = {"float32": "f32", "int16": "int16", "bfloat16": "bf16"}
DEFAULT_PRECISION = KakeyaOptions().attention_precision
# name: (WHOLE_ATTENTION_ROWS, whether the codec runs on torch's threads, attention_precision,
# prepare_keys_ahead)
PATHS = {
    "whole": (coded_attention.WHOLE_ATTENTION_ROWS, True, DEFAULT_PRECISION, True),
    **{
        f"whole-{short}": (coded_attention.WHOLE_ATTENTION_ROWS, True, name, True)
        for name, short in PRECISIONS.items()
        if name != DEFAULT_PRECISION
    },
    "not-ahead": (coded_attention.WHOLE_ATTENTION_ROWS, True, DEFAULT_PRECISION, False),
    "two-kernels": (0, True, DEFAULT_PRECISION, True),
    "own-pool": (coded_attention.WHOLE_ATTENTION_ROWS, False, DEFAULT_PRECISION, True),
}


class AttentionTimer:
    """Adds up the seconds spent inside the models' attention functions (``names``) while
    entered, by wrapping their entries in transformers' registry (restored on exit)."""

    def __init__(self, names=("sdpa", KAKEYA_ATTENTION)):
        self.seconds = 0.0
        self._saved = {name: ALL_ATTENTION_FUNCTIONS[name] for name in names}

    def __enter__(self) -> AttentionTimer:
        for name, fn in self._saved.items():

            def timed(*args, _fn=fn, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t0

            ALL_ATTENTION_FUNCTIONS[name] = timed
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            ALL_ATTENTION_FUNCTIONS[name] = fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", default="../shared/data/wikitext-2-raw-test.txt")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096])
    ap.add_argument("--calibration", default=None, help="a calibration bundle directory")
    ap.add_argument(
        "--joint-calibration", default=None, help="a bundle fitted with --joint-heads (optional)"
    )
    ap.add_argument(
        "--joint-heads",
        choices=["k", "v"],
        default=None,
        help="also time the joint bundle with only this stream coded across heads",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    from kakeyaturbo.calibration import Calibration

    calibration, joint = (
        Calibration.load(path, model) if path else None
        for path in (args.calibration, args.joint_calibration)
    )
    ids = torch.as_tensor(tokenize_text(tok, read_text(args.text))).reshape(1, -1)
    print(f"model {args.model}, torch threads {args.threads}, bundle {args.calibration}")
    if joint is not None:
        print(f"coded across heads: {args.joint_calibration}")
    for ctx in args.contexts:
        run_context(model, ids[:, : ctx + 1], ctx, calibration, joint, args)


@torch.inference_mode()
def run_context(model, ids, ctx, calibration, joint, args) -> None:
    model.set_attn_implementation("sdpa")
    dense = DynamicCache()
    model(ids[:, :ctx], **{CACHE_ARG: dense})

    def prefilled(bundle, coded_attention=None, **kw):
        cache = KakeyaCache.from_model(
            model,
            calibration=bundle,
            hot_dtype=torch.bfloat16,
            coded_attention=coded_attention,
            **kw,
        )
        model(ids[:, :ctx], **{CACHE_ARG: cache})
        return cache

    coded = prefilled(calibration)
    paths = {p: v for p, v in PATHS.items() if p != "own-pool" or args.threads > 1}
    runs = {"DynamicCache": (dense, None)} | {p: (coded, v) for p, v in paths.items()}
    if joint is not None:
        runs["joint"] = (prefilled(joint), PATHS["whole"])
        runs["joint-two-kernels"] = (runs["joint"][0], PATHS["two-kernels"])
        for name, short in PRECISIONS.items():
            if name != DEFAULT_PRECISION:
                runs[f"joint-{short}"] = (runs["joint"][0], PATHS[f"whole-{short}"])
        runs["joint-not-ahead"] = (runs["joint"][0], PATHS["not-ahead"])
        runs["joint-decode"] = (prefilled(joint, coded_attention=False), PATHS["whole"])
        if args.joint_heads:
            recipe = default_recipe(joint).replace(joint_heads=args.joint_heads)
            runs[f"joint-{args.joint_heads}"] = (prefilled(joint, recipe=recipe), PATHS["whole"])
    times: dict[str, list[float]] = {name: [] for name in runs}
    attention: dict[str, list[float]] = {name: [] for name in runs}
    for _ in tqdm(range(args.reps), desc=f"ctx {ctx}", leave=False):
        for name, (cache, path) in runs.items():
            if path is not None:
                coded_attention.WHOLE_ATTENTION_ROWS = path[0]
                kakeyaturbo.share_torch_threads(path[1])
                cache._ctx.attention_precision = path[2]
                cache._ctx.prepare_keys_ahead = path[3]
            with AttentionTimer() as timer:
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    model(ids[:, ctx : ctx + 1], **{CACHE_ARG: cache})
                    cache.crop(-1)
                times[name].append(1e3 * (time.perf_counter() - t0) / args.steps)
            attention[name].append(1e3 * timer.seconds / args.steps)
    coded_attention.WHOLE_ATTENTION_ROWS = PATHS["whole"][0]
    kakeyaturbo.share_torch_threads(True)
    base = statistics.median(times["DynamicCache"])
    for name, ts in times.items():
        med, att = statistics.median(ts), statistics.median(attention[name])
        reps = " ".join(f"{t:6.1f}" for t in ts)
        print(
            f"ctx {ctx:5d} {name:17s} step ms {reps}  median {med:6.1f}  "
            f"speed vs dyn {base / med:.2f}x  attention {att:5.1f}  rest {med - att:5.1f}"
        )


if __name__ == "__main__":
    main()
