"""Where a decode step of the default KakeyaCache goes, beside DynamicCache's, in one process.

    .venv/bin/python benches/decode_step_parts.py \\
        --model ../shared/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --context 4096 --calibration artifacts/calib-smollm2-joint-both

Each repetition prefills a fresh DynamicCache and a fresh KakeyaCache (hot window's keys in
bfloat16, as ``benches/hf_generate.py --hot-dtype bfloat16`` measures), then times ``--steps``
single-token forwards of each, with timers around the model's attention function and around
the parts of the cache's path named in ``PARTS`` (a part's time includes the parts it calls:
``_joint_logits`` includes ``key_logits``). Prints milliseconds per step; ``vs dyn`` is
DynamicCache's step over the cache's within the repetition (only ratios in one run mean
anything on a shared machine).

Each step's process CPU (every thread's, ``time.process_time``) is printed beside its wall
time, with the best ratio to DynamicCache that any schedule of the cache's work could reach on
this process's cores (its CPU a step spread evenly over them, against DynamicCache's wall
time): a bound the wall-time ratio cannot pass without fewer operations. Spinning OpenMP
workers count as CPU; run with ``OMP_WAIT_POLICY=PASSIVE`` when torch has several threads.
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import contextmanager

import torch
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from bench_args import add_model_and_text  # benches/, beside this script
from kakeyaturbo.hf import CACHE_ARG, KakeyaCache
from kakeyaturbo.hf import cache as hf_cache
from kakeyaturbo.hf.attention import NAME as KAKEYA_ATTENTION
from kakeyaturbo.hf.coded_attention import CodedView
from kakeyaturbo.hf.layer import KakeyaLayer
from kakeyaturbo.modeling import load_model, read_text, tokenize_text
from kakeyaturbo.pipeline import Pipeline

# (class, methods) timed: the codec's kernels and the Python around them.
PARTS = (
    (Pipeline, ("key_logits", "value_sums", "attend", "joint_scales")),
    (CodedView, ("attend", "_joint_logits", "_joint_value_sums", "_codec_logits")),
    (KakeyaLayer, ("update", "_append_hot", "_flush")),
    # A hooked forward's end: the layers' appends together, the flushes they make due.
    (hf_cache, ("finish_forward",)),
)


@contextmanager
def timers(seconds: dict):
    """Wraps the methods (and module functions) of ``PARTS`` and the models' attention
    functions so each adds its time to ``seconds[name]`` (restored on exit)."""
    saved = []

    def wrap(name, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start

        return timed

    for cls, names in PARTS:
        for n in names:
            saved.append((cls, n, cls.__dict__[n]))
            label = cls.__name__.rsplit(".", 1)[-1]  # a class's name, or a module's last
            setattr(cls, n, wrap(f"{label}.{n}", cls.__dict__[n]))
    attention = {n: ALL_ATTENTION_FUNCTIONS[n] for n in ("sdpa", KAKEYA_ATTENTION)}
    for n, fn in attention.items():
        ALL_ATTENTION_FUNCTIONS[n] = wrap(f"attention ({n})", fn)
    try:
        yield
    finally:
        for cls, n, fn in saved:
            setattr(cls, n, fn)
        for n, fn in attention.items():
            ALL_ATTENTION_FUNCTIONS[n] = fn


@torch.inference_mode()
def time_steps(model, ids, ctx: int, steps: int, cache) -> tuple[float, float, dict]:
    """Prefill ``ctx`` tokens into ``cache``, two untimed steps, then ``steps`` timed ones:
    (wall ms per step, the process's CPU ms per step, ms per step of each part)."""
    model(ids[:, :ctx], **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1)
    for i in range(ctx, ctx + 2):
        model(ids[:, i : i + 1], **{CACHE_ARG: cache}, use_cache=True)
    seconds: dict = {}
    with timers(seconds):
        start, cpu = time.perf_counter(), time.process_time()
        for i in range(ctx + 2, ctx + 2 + steps):
            model(ids[:, i : i + 1], **{CACHE_ARG: cache}, use_cache=True)
        total, cpu = time.perf_counter() - start, time.process_time() - cpu
    per_step = {k: v / steps * 1e3 for k, v in seconds.items()}
    return total / steps * 1e3, cpu / steps * 1e3, per_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_and_text(ap)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--calibration", default=None, help="a bundle (default: none)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    # The cores this process may run on (Linux); elsewhere every core the machine has.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    model, tok = load_model(args.model)
    need = args.context + 2 + args.steps
    ids = tokenize_text(tok, read_text(args.text))[:need][None]
    print(
        f"model {args.model}, context {args.context}, torch threads {args.threads}, "
        f"bundle {args.calibration}, {args.steps} steps per repetition, {cores} cores, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"
    )
    for rep in range(args.reps):
        dyn, dyn_cpu, dyn_parts = time_steps(
            model, ids, args.context, args.steps, DynamicCache(config=model.config)
        )
        cache = KakeyaCache.from_model(
            model, calibration=args.calibration, hot_dtype=torch.bfloat16
        )
        step, cpu, parts = time_steps(model, ids, args.context, args.steps, cache)
        print(
            f"rep {rep}: DynamicCache step {dyn:.1f} ms (attention {sum(dyn_parts.values()):.1f}, "
            f"CPU {dyn_cpu:.1f}); KakeyaCache step {step:.1f} ms (CPU {cpu:.1f}), "
            f"vs dyn {dyn / step:.2f}x; its CPU {cpu / dyn_cpu:.2f}x DynamicCache's, so at "
            f"best {dyn / (cpu / cores):.2f}x on {cores} cores"
        )
        for name, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"    {name:32s} {ms:7.1f} ms")


if __name__ == "__main__":
    main()
