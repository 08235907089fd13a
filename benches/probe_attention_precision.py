"""What the key frame product in int16 or bfloat16 costs in quality, over many passages.

    .venv/bin/python benches/probe_attention_precision.py --calibration BUNDLE
        [--context 4096] [--passages 8] [--steps 64]

``KakeyaCache(attention_precision=...)`` changes only the arithmetic of attention over the
codes (the codes are the same), so one passage's 128 generated tokens (``hf_generate.py``) say
little about it: a few positions decide the difference. Here every passage of WikiText-2 is
prefilled to ``--context`` tokens and its true continuation is teacher-forced one token per
decode step through DynamicCache and through KakeyaCache in float32 and in each of
``--precisions`` (the same prompt, the same continuation), and the per-position KL to
DynamicCache and the top-1 agreement are compared pairwise: the mean difference against float32
with its standard error over passages, beside the codec's own KL, and how far each precision's
log-probs are from float32's against how far float32's are from DynamicCache's. The floor:
float32 through the two kernels around torch's softmax (``WHOLE_ATTENTION_ROWS = 0``), the same
arithmetic in another order, which moves the log-probs by float32 rounding alone.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from tqdm import tqdm

from bench_args import add_model_and_text
from hf_generate import agreement

FLOOR = "float32-two-kernels"


def teacher_forced(model, ids: torch.Tensor, ctx: int, cache) -> torch.Tensor:
    """Log-probs ``[steps, vocab]`` of the tokens after ``ids[:, :ctx]``: prefill the prompt,
    then one decode step per true next token."""
    out = []
    with torch.inference_mode():
        logits = model(ids[:, :ctx], past_key_values=cache, use_cache=True).logits[:, -1]
        out.append(logits[0].float().log_softmax(-1))
        for t in range(ctx, ids.shape[1] - 1):
            logits = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1]
            out.append(logits[0].float().log_softmax(-1))
    return torch.stack(out)


def mean_se(x: list[float]) -> tuple[float, float]:
    n = len(x)
    m = sum(x) / n
    var = sum((v - m) ** 2 for v in x) / max(n - 1, 1)
    return m, math.sqrt(var / n)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_and_text(ap)
    ap.add_argument("--calibration", type=Path, required=True, help="a calibration bundle")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--passages", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64, help="teacher-forced decode steps")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--precisions",
        nargs="+",
        default=["int16", "bfloat16"],
        choices=["int16", "bfloat16"],
        help="attention precisions compared with float32",
    )
    args = ap.parse_args(argv)

    from transformers import DynamicCache

    import kakeyaturbo as kt
    from kakeyaturbo.calibration import Calibration
    from kakeyaturbo.hf import KakeyaCache, coded_attention
    from kakeyaturbo.modeling import kv_geometry, load_model

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    span = args.context + args.steps
    text = Path(args.text).read_text(encoding="utf-8")
    ids = tok(text[: 6 * span * args.passages], return_tensors="pt").input_ids
    if ids.shape[1] < span * args.passages:
        raise SystemExit(f"{args.text}: {ids.shape[1]} tokens, need {span * args.passages}")
    calibration = Calibration.load(args.calibration, model)
    hd = kv_geometry(model.config).head_dim
    native = {"int16": kt.codec.int16_products(hd), "bfloat16": kt.codec.bf16_products(hd)}
    print(
        f"model {Path(args.model).name}, context {args.context}, {args.passages} passages x "
        f"{args.steps} teacher-forced steps, bundle {args.calibration}, torch threads "
        f"{args.threads}; native products on this CPU: "
        + ", ".join(f"{k} {'yes' if native[k] else 'NO (runs float32)'}" for k in args.precisions)
    )

    def kakeya(precision):
        return lambda: KakeyaCache.from_model(
            model,
            calibration=calibration,
            hot_dtype=torch.bfloat16,
            attention_precision=precision,
        )

    methods = {"dynamic": lambda: DynamicCache(config=model.config), "float32": kakeya("float32")}
    methods.update({name: kakeya(name) for name in args.precisions})
    # The floor: float32 again, through the two kernels around torch's softmax (the same
    # arithmetic in another order, float32 rounding apart), so a gap no larger than its
    # is what any rounding moves.
    methods[FLOOR] = kakeya("float32")
    kl: dict = {name: [] for name in methods if name != "dynamic"}
    compared = [*args.precisions, FLOOR]
    top1, gap = {name: [] for name in kl}, {name: [] for name in compared}
    whole_rows = coded_attention.WHOLE_ATTENTION_ROWS
    for p in tqdm(range(args.passages), desc="passages"):
        seg = ids[:, p * span : (p + 1) * span]
        lp = {}
        for name, make in methods.items():
            model.set_attn_implementation("sdpa")  # a KakeyaCache switches it to "kakeya"
            coded_attention.WHOLE_ATTENTION_ROWS = 0 if name == FLOOR else whole_rows
            lp[name] = teacher_forced(model, seg, args.context, make())
        ref = lp["dynamic"]
        codec = (lp["float32"] - ref).pow(2).mean().sqrt().item()
        for name in kl:  # float32 first
            t1, k = agreement(ref, lp[name])
            top1[name].append(t1)
            kl[name].append(k)
        line = f"passage {p}: KL float32 {kl['float32'][-1]:.3e}"
        for name in kl:
            if name in gap:
                # How far this precision's log-probs are from float32's, against the codec's.
                gap[name].append((lp[name] - lp["float32"]).pow(2).mean().sqrt().item() / codec)
                rel = (kl[name][-1] / kl["float32"][-1] - 1) * 100
                line += (
                    f", {name} {kl[name][-1]:.3e} ({rel:+.1f}%, log-prob gap "
                    f"{gap[name][-1]:.3f} of the codec's)"
                )
        tqdm.write(line)

    print(f"\nmean over {args.passages} passages (+- standard error over passages):")
    for name in kl:
        (m, se), t1 = mean_se(kl[name]), mean_se(top1[name])[0]
        print(f"  {name:9s} KL to DynamicCache {m:.3e} +- {se:.1e}, top-1 {t1:.4f}")
    for name in compared:
        diff = mean_se([b - a for a, b in zip(kl["float32"], kl[name])])
        rel = mean_se([b / a - 1 for a, b in zip(kl["float32"], kl[name])])
        g = mean_se(gap[name])
        print(
            f"  {name} - float32 (paired): KL {diff[0]:+.2e} +- {diff[1]:.1e} "
            f"({rel[0] * 100:+.2f}% +- {rel[1] * 100:.2f}% per passage); RMS log-prob gap "
            f"{g[0]:.3f} +- {g[1]:.3f} of float32's from DynamicCache"
        )


if __name__ == "__main__":
    main()
