"""Probe, not shipped: value token norms held in 8 bits instead of float16.

    .venv/bin/python benches/probe_norm_bits.py --calibration artifacts/calib-smollm2

Each block stream's norms are stored as log2 steps of 1/32 octave (at most 1.1% relative
error) above its smallest norm, which is kept as float16: 1 byte per token plus 2 per stream
instead of 2 per token. The probe swaps the norms the pipeline stores for their 8-bit
reconstruction and counts those bytes, then scores the default recipes (snapshot mode, 16
passages) both ways, so the change can be judged before the wire format carries it.
"""

from __future__ import annotations

import torch

import kakeyaturbo.pipeline as pipeline_module
import smollm2_eval  # benches/, beside this script
from kakeyaturbo.eval.harness import evaluate_method
from kakeyaturbo.eval.registry import build_method

STEPS_PER_OCTAVE = 32.0


def log8(norms: torch.Tensor) -> torch.Tensor:
    """``norms`` [B, H, T] rounded to 8-bit log steps above each stream's smallest norm."""
    n = norms.float()
    real = n > 0
    lg = torch.where(real, n.clamp_min(1e-30).log2(), torch.full_like(n, 1e9))
    lo = lg.amin(dim=-1, keepdim=True).half().float()
    q = ((lg - lo) * STEPS_PER_OCTAVE).round().clamp(0, 255)
    return torch.where(real, torch.exp2(lo + q / STEPS_PER_OCTAVE), torch.zeros_like(n)).half()


def use_8bit_norms() -> None:
    code_blocks = pipeline_module._code_blocks

    def coded(*args, **kwargs):
        blocks = code_blocks(*args, **kwargs)
        for blk in blocks:
            if blk.norms is not None:
                blk.norms = log8(blk.norms)
        return blocks

    def norm_bytes(blk) -> int:
        if blk.norms is None:
            return 0
        return blk.norms.numel() + 2 * blk.norms.shape[0] * blk.norms.shape[1]

    pipeline_module._code_blocks = coded
    pipeline_module.CodedBlock.norm_bytes = property(norm_bytes)


def main(argv=None) -> None:
    args = smollm2_eval.parser(__doc__).parse_args(argv)
    setup = smollm2_eval.setup(args)
    specs = (f"kakeya:calibration={args.calibration}", "kakeya")
    print(f"{args.passages} passages, ctx 960 + 64, snapshot")
    for label in ("float16 norms", "8-bit norms"):
        if label == "8-bit norms":
            use_8bit_norms()
        for spec in specs:
            r = evaluate_method(setup.model, setup.reference, build_method(spec), "snapshot")
            print(f"{label:14s} {spec:44s} {smollm2_eval.scores(r, digits=3)}", flush=True)


if __name__ == "__main__":
    main()
