"""The codec's whole-attention call over every layer of a prefilled KakeyaCache, back to back
and with other work between the calls, as a decode step has (the model's own products).

    .venv/bin/python benches/attend_between_layers.py \\
        --model ../shared/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --calibration artifacts/calib-smollm2

Between two layers' calls: nothing (``warm``), a 2 ms ``time.sleep`` (``sleep``), a 2 ms
busy-wait in Python (``spin``), or two MLP forwards of the model (``mlp``, which also pushes
the codes out of the caches). Each line is the best of ``--reps`` sums of the calls' own times
(the work between is not counted): how far a call slows down when it does not follow another
one. ``docs/performance.md`` has what it showed and why.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from kakeyaturbo.calibration import Calibration
from kakeyaturbo.hf import CACHE_ARG, KakeyaCache
from kakeyaturbo.modeling import load_model, read_text, tokenize_text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", default="../shared/data/wikitext-2-raw-test.txt")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--calibration", default=None)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(args.model)
    ids = torch.as_tensor(tokenize_text(tok, read_text(args.text)))[: args.context][None]
    cal = Calibration.load(args.calibration, model) if args.calibration else None
    cache = KakeyaCache.from_model(model, calibration=cal, hot_dtype=torch.bfloat16)
    with torch.inference_mode():
        model(ids, **{CACHE_ARG: cache}, use_cache=True)
    gen = torch.Generator().manual_seed(0)
    calls = []
    for li, layer in enumerate(cache.layers):
        pipe, blocks = layer._ctx.pipeline, layer._blocks
        b, h, _, d = layer._hot_k.shape
        g = model.config.num_attention_heads // h
        exact = (torch.randn(b, h, 100, d, generator=gen), torch.randn(b, h, 100, d, generator=gen))
        rotation = torch.randn(1, sum(blk.k.tokens for blk in blocks), 2, d // 2, generator=gen)
        q = torch.randn(b, h, g, d, generator=gen)
        kb, vb = [blk.k for blk in blocks], [blk.v for blk in blocks]
        frames = pipe.frame_inverse(li, "k"), pipe.frame_inverse(li, "v")
        kwargs = dict(key_frames=frames[0], rotation=rotation, value_frames=frames[1])
        calls.append(functools.partial(pipe.attend, (kb, vb), b, q, exact, d**-0.5, **kwargs))
    mlps = [layer.mlp for layer in model.model.layers]
    x = torch.randn(1, 1, model.config.hidden_size, generator=gen)

    def between(kind: str, i: int) -> None:
        if kind == "sleep":
            time.sleep(0.002)
        elif kind == "spin":
            t = time.perf_counter()
            while time.perf_counter() - t < 0.002:
                pass
        elif kind == "mlp":
            with torch.inference_mode():
                mlps[i - 1](x), mlps[i - 2](x)

    def step(kind: str) -> float:
        total = 0.0
        for i, call in enumerate(calls):
            between(kind, i)
            t = time.perf_counter()
            call()
            total += time.perf_counter() - t
        return total * 1e3

    print(f"{len(calls)} layers, {args.context} tokens, bundle {args.calibration}")
    for kind in ("warm", "sleep", "spin", "mlp"):
        best = min(step(kind) for _ in range(args.reps))
        print(f"{kind:6s} sum of the calls {best:7.1f} ms", flush=True)


if __name__ == "__main__":
    main()
