"""Peak process memory of `generate` with each cache, each measured in a fresh process.

    .venv/bin/python benches/peak_memory.py --model GGUF --contexts 4096 8064 \\
        --calibration artifacts/calib-smollm2 --hot-dtype bfloat16

For each context and cache (DynamicCache, transformers' QuantizedCache, KakeyaCache) a child
process loads the model, warms the cache type up on a short prompt, then prefills the context
and generates `--new-tokens` greedily while the kernel's peak-RSS mark (VmHWM, reset just
before) records the process's peak. A fresh process per measurement, because the peak of one
call depends on what the allocator kept from the calls before it (`benches/hf_generate.py`
runs every method in one process, so its peak column reads that state too).

Each measurement is repeated (`--repeats`): a peak moves by up to a few hundred MiB between
fresh processes (DynamicCache's most: its cache grows by a copy per step, and where the
allocator puts those copies varies). Printed per context: each cache's median peak rise during
the call and its range, the KV bytes it holds after it, and how far its peak falls below
DynamicCache's as a share of the KV bytes it saves, from the medians and, pessimistically, from
DynamicCache's lowest peak and this cache's highest (the speed issue's bar: at least 70% at 8k,
i.e. no hidden dense copy and no freed memory kept).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from hf_generate import (  # noqa: E402
    DEFAULT_MODEL,
    DEFAULT_TEXT,
    held_bytes,
    kakeya_factory,
    kakeya_options,
    run,
)

METHODS = ("DynamicCache", "QuantizedCache(quanto,4b)", "kakeya")


def child(args) -> dict:
    """One measurement in this process: the peak rise and the bytes held."""
    from transformers import DynamicCache, QuantizedCache

    from kakeyaturbo.modeling import load_model

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    text = args.text.read_text(encoding="utf-8")
    ids = tok(text[: 8 * args.child_ctx], return_tensors="pt").input_ids[:, : args.child_ctx]
    if args.child == "kakeya":
        options = kakeya_options(model, args.calibration, args.hot_dtype)
        make = kakeya_factory(model, 0, True, options)  # as hf_generate builds "kakeya"
    else:
        model.set_attn_implementation("sdpa")
        if args.child == "DynamicCache":

            def make():
                return DynamicCache(config=model.config)
        else:

            def make():
                return QuantizedCache(backend="quanto", config=model.config, nbits=4)

    run(model, ids[:, :64], make, 2)  # warm-up (quanto JIT, first-call allocations)
    *_, cache, peak = run(model, ids, make, args.new_tokens)
    return {"peak": peak, "held": held_bytes(cache)}


def measure(args, method: str, ctx: int) -> dict:
    cmd = [sys.executable, __file__, "--child", method, "--child-ctx", str(ctx)]
    cmd += ["--model", str(args.model), "--text", str(args.text)]
    cmd += ["--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
    cmd += ["--hot-dtype", args.hot_dtype]
    if args.calibration is not None:
        cmd += ["--calibration", str(args.calibration)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{method} at {ctx} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8064])
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--calibration", type=Path, default=None)
    ap.add_argument("--hot-dtype", choices=["model", "bfloat16", "float16"], default="model")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per measurement")
    ap.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    ap.add_argument("--child-ctx", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return

    print(
        f"model {args.model.name}, torch threads {args.threads}, {args.new_tokens} new tokens, "
        f"kakeya hot window in {args.hot_dtype}, bundle {args.calibration}"
    )
    # Interleaved (every method once, then again), so drift over the run spreads evenly.
    jobs = [(ctx, m) for _ in range(args.repeats) for ctx in args.contexts for m in METHODS]
    peaks: dict = {}
    held: dict = {}
    for ctx, m in tqdm(jobs, desc="fresh processes"):
        r = measure(args, m, ctx)
        peaks.setdefault((ctx, m), []).append(r["peak"])
        held[ctx, m] = r["held"]  # the same every time: the cache's bytes are deterministic
    mib = 2**20
    head = (
        f"{'ctx':>5} {'method':26s} {'peak MiB':>9} {'range':>15} {'KV MiB':>8} "
        f"{'KV saved':>9} {'share':>6} {'worst':>6}"
    )
    print(head + "\n" + "-" * len(head))
    for ctx in args.contexts:
        dyn = peaks[ctx, "DynamicCache"]
        for m in METHODS:
            p = peaks[ctx, m]
            saved = held[ctx, "DynamicCache"] - held[ctx, m]
            share = worst = "     -"
            if m != "DynamicCache" and saved > 0:
                share = f"{(statistics.median(dyn) - statistics.median(p)) / saved:6.0%}"
                worst = f"{(min(dyn) - max(p)) / saved:6.0%}"
            span = f"{min(p) / mib:.0f}-{max(p) / mib:.0f}"
            print(
                f"{ctx:5d} {m:26s} {statistics.median(p) / mib:9.1f} {span:>15} "
                f"{held[ctx, m] / mib:8.2f} {saved / mib:9.1f} {share} {worst}"
            )
    print(
        f"\npeak MiB: median rise of the process's peak RSS during generate (prefill "
        f"activations included) over {args.repeats} fresh processes, range: lowest-highest; "
        "KV MiB: bytes the cache holds after it; share: (DynamicCache's median peak - this "
        "median) / (DynamicCache's KV bytes - these); worst: the same from DynamicCache's "
        "lowest peak and this cache's highest."
    )


if __name__ == "__main__":
    main()
