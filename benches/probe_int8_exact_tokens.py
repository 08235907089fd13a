"""Probe, not shipped: what holding cached keys or values as int8 rows costs the next token.

    .venv/bin/python benches/probe_int8_exact_tokens.py > reports/probe_int8_exact_tokens.txt

``KakeyaCache`` holds its newest tokens (the hot window, 128 to 383 of them) exact, in 16 bits:
at 4k tokens about a third of its bytes. This measures the cost of holding them as int8 rows
(``kakeyaturbo.hf.int8_rows``: one bfloat16 scale per token and head) by the most demanding
case, every cached token so held: each attention layer of SmolLM2 reads keys and/or values
rounded that way for every position (in-forward), and the last 64 positions' next-token
distributions are compared with the unrounded model's (KL, top-1), on WikiText passages.
Rows: values only, keys only, both, both after an orthonormal Walsh-Hadamard rotation of each
head (which spreads a key's outlier channels over the row), and float8 e4m3 (the ``fp8``
peer) for scale. The hot window is a few hundred of the thousands of tokens a query reads, so
this bounds what it costs there.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from bench_args import add_model_and_text  # benches/, beside this script
from kakeyaturbo.hf import int8_rows
from kakeyaturbo.modeling import cut_passages, load_model, read_text, tokenize_text

NAME = "kakeyaturbo-probe-int8"
SCORED = 64


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def rotated_int8(x: torch.Tensor) -> torch.Tensor:
    h = hadamard(x.shape[-1]).to(x)
    return int8_rows.round_trip(x @ h) @ h.T


def fp8(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).to(x.dtype)


def same(x: torch.Tensor) -> torch.Tensor:
    return x


# name -> (keys, values) as the attention reads them
VARIANTS = {
    "int8 values": (same, int8_rows.round_trip),
    "int8 keys": (int8_rows.round_trip, same),
    "int8 keys and values": (int8_rows.round_trip, int8_rows.round_trip),
    "int8 after Hadamard, both": (rotated_int8, rotated_int8),
    "fp8 e4m3, both": (fp8, fp8),
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_and_text(ap)
    ap.add_argument("--passages", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=960)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    ids = tokenize_text(tok, read_text(args.text))
    passages = cut_passages(ids, args.passages, args.ctx)
    active: list = [None]

    def attention(module, q, k, v, mask, **kw):
        if active[0] is not None:
            k, v = active[0][0](k), active[0][1](v)
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register(NAME, attention)
    model.set_attn_implementation(NAME)
    sums = {name: [0.0, 0.0] for name in VARIANTS}
    with torch.no_grad():
        for p in tqdm(passages, desc="passages"):
            x = p.ids[None, : args.ctx]
            active[0] = None
            ref = model(x).logits[0, -SCORED:].float().log_softmax(-1)
            for name, variant in VARIANTS.items():
                active[0] = variant
                got = model(x).logits[0, -SCORED:].float().log_softmax(-1)
                sums[name][0] += float((ref.exp() * (ref - got)).sum(-1).mean())
                sums[name][1] += float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    n = len(passages)
    print(
        f"{Path(args.model).name}: {n} WikiText passages of {args.ctx} tokens, every cached "
        f"token rounded as named (in-forward), the last {SCORED} positions scored against the "
        "unrounded model"
    )
    print(f"{'held as':28s} {'KL':>9s} {'top-1':>7s}")
    for name, (kl, top1) in sums.items():
        print(f"{name:28s} {kl / n:9.2e} {top1 / n:7.4f}")


if __name__ == "__main__":
    main()
