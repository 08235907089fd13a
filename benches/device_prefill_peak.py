"""Peak memory of a prompt's prefill where the cache codes and holds its blocks on the model's
device, as on a GPU, simulated on the CPU: layers flushed together at the forward's end
(``KakeyaOptions(flush_together_bytes=...)``) against each layer flushed alone, beside
DynamicCache, each measured in a fresh process.

    .venv/bin/python benches/device_prefill_peak.py --calibration artifacts/calib-smollm2-joint-both

Attention runs off the CPU kernels (``CPU_KERNELS = False``), so the layers hold their blocks
"on the device" (here the CPU) and code them with the torch encoder (``device_encode.py``), as
they would on a GPU. The process's peak-RSS mark (VmHWM, reset before the call) gives the peak
rise of one prefill after a warm-up prefill of 600 tokens: on a GPU the caching allocator's
peak plays this part, so read the rows against each other, not as a GPU's bytes. Coding layers
together keeps their spans and the coding's temporaries alive at once: the price of its fewer
ops (``benches/device_op_counts.py --prefill``). Results: reports/device_prefill_peak.txt.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

from bench_args import add_model_and_text


def _hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def child(args) -> dict:
    """One prefill in this process: its peak rise and the cache's bytes after it."""
    import torch
    from transformers import DynamicCache

    from kakeyaturbo.calibration import Calibration
    from kakeyaturbo.hf import CACHE_ARG, KakeyaCache, KakeyaOptions, coded_attention
    from kakeyaturbo.modeling import load_model, read_text, tokenize_text

    torch.set_num_threads(1)
    coded_attention.CPU_KERNELS = False  # blocks coded and held where the model runs
    model, tok = load_model(args.model, dtype="float32")
    ids = tokenize_text(tok, read_text(args.text))[: args.child_ctx][None]
    bundle = Calibration.load(args.calibration, model) if args.calibration else None

    def make():
        if args.child == "DynamicCache":
            model.set_attn_implementation("sdpa")
            return DynamicCache(config=model.config)
        return KakeyaCache.from_model(
            model,
            calibration=bundle,
            hot_dtype=torch.bfloat16,
            options=KakeyaOptions(flush_together_bytes=int(float(args.child) * 2**20)),
        )

    with torch.inference_mode():
        model(ids[:, :600], **{CACHE_ARG: make()}, use_cache=True, logits_to_keep=1)
        cache = make()
        Path("/proc/self/clear_refs").write_text("5")  # the peak mark back to the RSS now
        before = _rss_mib()
        model(ids, **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1)
        peak = _hwm_mib() - before
    if args.child == "DynamicCache":
        held = sum(
            t.numel() * t.element_size() for lay in cache.layers for t in (lay.keys, lay.values)
        )
    else:
        held = cache.memory_report()["total_bytes"]
    return {"peak_mib": peak, "held_mib": held / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_and_text(ap)
    ap.add_argument("--calibration", default=None, help="a bundle (default: none)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8064])
    ap.add_argument(
        "--together-mib",
        type=float,
        nargs="+",
        default=[0, 8, 16, 32],
        help="KakeyaCache's flush_together_bytes to measure, in MiB (0: each layer alone)",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-ctx", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    print(f"model {Path(args.model).name}, bundle {args.calibration}, one torch thread")
    modes = ["DynamicCache", *(f"{mib:g}" for mib in args.together_mib)]
    runs = [(ctx, mode) for ctx in args.contexts for mode in modes]
    rows = []
    for ctx, mode in tqdm(runs, desc="prefills", unit="process"):
        cmd = [sys.executable, __file__, "--model", args.model, "--text", args.text]
        cmd += ["--child", mode, "--child-ctx", str(ctx)]
        cmd += ["--calibration", args.calibration] if args.calibration else []
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append((ctx, mode, json.loads(out.strip().splitlines()[-1])))
    print(f"{'ctx':>5} {'cache':<40} {'peak rise MiB':>13} {'held MiB':>9}")
    for ctx, mode, got in rows:
        name = mode if mode == "DynamicCache" else f"kakeya, flush_together_bytes {mode} MiB"
        print(f"{ctx:5d} {name:<40} {got['peak_mib']:13.1f} {got['held_mib']:9.2f}")


if __name__ == "__main__":
    main()
