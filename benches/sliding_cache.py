"""Sliding-window layers in ``KakeyaCache`` itself: their windows held exact (the default) or
coded (``code_sliding=True``), on SmolLM2 run with Gemma 3's layer pattern
(``kakeyaturbo.eval.sliding_variant``). Each passage is prefilled through the cache and its
continuation scored in one forward over what the cache holds, against the model without a
cache; the bytes are the cache's ``memory_report`` after the prefill, every layer counted, exact
tokens at bfloat16 (``hot_dtype=torch.bfloat16``; layers transformers holds, at their bfloat16
size). Writes reports/sliding_cache.json.

    python benches/sliding_cache.py [--passages 8] [--window 512] [--ctx 960]

The cache uses the variant's own bundle (fitted on first use, a few minutes). ``windows coded``
is ``code_sliding=True`` as it is (windows one bit above the layer's bits,
``recipes.SLIDING_EXTRA_BITS``); ``coded, own bits`` gives the windows the layer's bits.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from bench_args import add_model_and_text  # (benches/, beside this script)
from kakeyaturbo.calibration.auto import auto_calibration
from kakeyaturbo.eval.metrics import passage_scores, summarize
from kakeyaturbo.eval.sliding_variant import FULL_EVERY, WINDOW, with_sliding_layers
from kakeyaturbo.hf import CACHE_ARG, KakeyaCache
from kakeyaturbo.hf.layer_plan import LayerKind
from kakeyaturbo.modeling import cut_passages, load_model, read_text, tokenize_text
from kakeyaturbo.recipes import default_recipe

REPO = Path(__file__).resolve().parents[1]
N_EVAL = 64
#: (name, code_sliding, windows at the layer's own bits)
CONFIGS = [
    ("windows exact", False, False),
    ("coded, own bits", True, True),
    ("windows coded", True, False),
]
#: Layers held as transformers holds them: their bytes count at bfloat16.
PLAIN = {LayerKind.SLIDING.value, LayerKind.FULL_PRECISION.value}


def cache_for(model, calibration, code_sliding: bool, own_bits: bool) -> KakeyaCache:
    """The cache of a passage; ``own_bits``: its windows at the recipe's bits for the layer (the
    default recipe, given, gets no extra bits)."""
    recipe = default_recipe(calibration) if own_bits else None
    return KakeyaCache.from_model(
        model,
        recipe=recipe,
        calibration=calibration,
        code_sliding=code_sliding,
        hot_dtype=torch.bfloat16,
    )


def bf16_bytes(report: dict) -> tuple[int, int]:
    """(bytes held, every layer's held tokens at bfloat16) of a memory report."""
    held = sum(
        r["bf16_equivalent_bytes"] if r["kind"] in PLAIN else r["total_bytes"]
        for r in report["layers"]
    )
    return held, report["bf16_equivalent_bytes"]


@torch.inference_mode()
def run(model, calibration, passages, ctx: int, bar) -> dict:
    out = {}
    for name, code_sliding, own_bits in CONFIGS:
        scores, held, dense = [], 0, 0
        for p in passages:
            ids = p.ids[None]  # [1, ctx + N_EVAL + 1]
            want = model(ids[:, : ctx + N_EVAL]).logits[:, ctx:].float()
            cache = cache_for(model, calibration, code_sliding, own_bits)
            model(ids[:, :ctx], **{CACHE_ARG: cache}, use_cache=True)
            h, d = bf16_bytes(cache.memory_report())
            held, dense = held + h, dense + d
            got = model(ids[:, ctx : ctx + N_EVAL], **{CACHE_ARG: cache}, use_cache=True)
            scores += passage_scores(want, got.logits.float(), ids[:, ctx + 1 : ctx + N_EVAL + 1])
            cache.detach()
            bar.update(1)
        s = summarize(scores)
        out[name] = {
            "ratio": dense / held,
            "delta_ppl": s.delta_ppl,
            "kl": s.kl,
            "top1": s.top1,
            "verdict": s.verdict,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_and_text(ap)
    ap.add_argument("--passages", type=int, default=8)
    ap.add_argument("--window", type=int, default=WINDOW)
    ap.add_argument("--ctx", type=int, default=960)
    ap.add_argument("--out", default=str(REPO / "reports" / "sliding_cache.json"))
    args = ap.parse_args()
    model, tok = load_model(args.model)
    variant = with_sliding_layers(model, args.window, FULL_EVERY)
    del model
    variant.set_attn_implementation("sdpa")
    calibration = auto_calibration(variant)
    ids = tokenize_text(tok, read_text(args.text))
    passages = cut_passages(ids, args.passages, args.ctx + N_EVAL + 1)
    total = len(passages) * len(CONFIGS)
    with tqdm(total=total, desc="passages", unit="passage", file=sys.stderr) as bar:
        rows = run(variant, calibration, passages, args.ctx, bar)
    result = {
        "layers": {"window": args.window, "full_every": FULL_EVERY},
        "ctx": args.ctx,
        "n_eval": N_EVAL,
        "passages": args.passages,
        "configs": rows,
    }
    print(f"\n{'KakeyaCache':<16} ratio  delta-ppl  KL        top-1   verdict")
    for name, r in rows.items():
        print(
            f"{name:<16} {r['ratio']:.2f}x {r['delta_ppl']:+.2%}    {r['kl']:.2e}  "
            f"{r['top1']:.1%}  {r['verdict']}"
        )
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
