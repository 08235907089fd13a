"""Bytes KakeyaCache holds where attention decodes its blocks on the model's device (a GPU),
measured on the CPU with attention off the CPU kernels, as on a GPU.

    python benches/device_bytes.py --calibration artifacts/calib-smollm2-joint-both

Two layouts of the same blocks, each filled with the same prompt and then two decode steps:
``host + copy`` (the codec's blocks on the host, and attention's copy of them on the device,
``device_copy_bytes``), made here by filling the cache with the CPU kernels and attending off
them afterwards; and ``device only`` (the default: the blocks held on the device alone).
Both attend with the same torch path over the same packed codes, so their last
logits must be equal: the bench says so. Results: reports/device_bytes.txt.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench_args import add_model_and_text  # (benches/, beside this script)
from kakeyaturbo.calibration import Calibration
from kakeyaturbo.hf import CACHE_ARG, KakeyaCache, coded_attention
from kakeyaturbo.modeling import load_model, read_text, tokenize_text

MIB = 2**20


@torch.inference_mode()
def filled(model, ids, ctx: int, bundle, device_only: bool) -> tuple[dict, torch.Tensor]:
    """The memory report after a ``ctx``-token prompt and two decode steps, and the last
    step's logits."""
    coded_attention.CPU_KERNELS = not device_only  # where the first flush puts the blocks
    cache = KakeyaCache.from_model(model, calibration=bundle, hot_dtype=torch.bfloat16)
    model(ids[:, :ctx], **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1)
    coded_attention.CPU_KERNELS = False  # both attend as on a GPU from here
    for t in range(ctx, ctx + 2):
        logits = model(ids[:, t : t + 1], **{CACHE_ARG: cache}, use_cache=True).logits
    return cache.memory_report(), logits[0, -1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_and_text(ap)
    ap.add_argument("--calibration", type=Path, default=None, help="a bundle (default: none)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8064])
    args = ap.parse_args()

    torch.set_num_threads(1)
    model, tok = load_model(args.model, dtype="float32")
    ids = tokenize_text(tok, read_text(args.text))[: max(args.contexts) + 2][None]
    bundle = None if args.calibration is None else Calibration.load(args.calibration, model)
    print(f"model {Path(args.model).name}, bundle {args.calibration}, hot window in bfloat16")
    print(
        f"{'ctx':>6} {'layout':<14} {'codes MiB':>10} {'copy MiB':>9} {'total MiB':>10} "
        f"{'bf16 MiB':>9} {'vs bf16':>8}"
    )
    for ctx in args.contexts:
        logits = []
        for label, device_only in (("host + copy", False), ("device only", True)):
            rep, last = filled(model, ids, ctx, bundle, device_only)
            logits.append(last)
            print(
                f"{ctx:>6} {label:<14} {rep['compressed_bytes'] / MIB:>10.2f} "
                f"{rep['device_copy_bytes'] / MIB:>9.2f} {rep['total_bytes'] / MIB:>10.2f} "
                f"{rep['bf16_equivalent_bytes'] / MIB:>9.2f} {rep['ratio_vs_bf16']:>7.2f}x",
                flush=True,
            )
        same = torch.equal(*logits)
        print(f"{ctx:>6} last logits of the two layouts {'equal' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
