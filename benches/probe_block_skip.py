"""Probe, not shipped: could attention over the codes skip whole blocks that the softmax ignores?

    .venv/bin/python benches/probe_block_skip.py

A decode step's attention over the codes costs the same for every block. Where a block's
largest logit sits far below the largest logit of the exact tokens (the sinks and the hot
window), its softmax mass is negligible and the block could be skipped, as Quest-style sparse
attention does. This measures, on SmolLM2's real queries (the last 64 positions of a WikiText
context) and exact keys, the fraction of 256-token blocks that could be skipped:

- ``oracle``: the block's true largest logit plus ``log(256)`` lies ``--margin`` below the
  exact tokens' largest (its mass is below ``e^-margin`` of the largest term): no bound can
  skip more;
- ``norm bound``: the same test with the bound a block can store cheaply,
  ``scale |q| max_t |k_t|`` (RoPE turns keys but keeps their norms).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import torch

from bench_args import add_model_and_text  # benches/, beside this script
from kakeyaturbo.capture import capture_kv, read_tokens
from kakeyaturbo.hf.rope import ModelRope
from kakeyaturbo.modeling import kv_geometry, load_model

SINKS, HOT, BLOCK, QUERIES = 4, 128, 256, 64


def skippable(
    logits: torch.Tensor,
    key_norms: torch.Tensor,
    q_norms: torch.Tensor,
    scale: float,
    margin: float,
) -> tuple[float, float]:
    """(oracle, norm bound) fractions of the coded blocks one query head could skip.
    ``logits`` ``[n, T]`` (scaled), ``key_norms`` ``[T]``, ``q_norms`` ``[n]``."""
    t = logits.shape[1]
    exact = torch.cat([logits[:, :SINKS], logits[:, t - HOT :]], 1).amax(1, keepdim=True)
    blocks = (t - SINKS - HOT) // BLOCK
    span = slice(SINKS, SINKS + blocks * BLOCK)
    slack = math.log(BLOCK)
    true_max = logits[:, span].reshape(-1, blocks, BLOCK).amax(-1)
    bound = scale * q_norms[:, None] * key_norms[span].reshape(blocks, BLOCK).amax(-1)[None]
    oracle = (true_max + slack < exact - margin).float().mean().item()
    by_norm = (bound + slack < exact - margin).float().mean().item()
    return oracle, by_norm


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_and_text(ap)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--margin", type=float, default=12.0, help="skip below e^-margin of the max")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    geo = kv_geometry(model.config)
    group, d = geo.query_heads // geo.kv_heads, geo.head_dim
    ids = read_tokens(tok, args.text, args.context)
    kv = capture_kv(model, ids, last_queries=QUERIES)
    rope = ModelRope(model.config)
    scale = d**-0.5
    print(
        f"{Path(args.model).name}, context {args.context}, last {QUERIES} queries, "
        f"{BLOCK}-token blocks between {SINKS} sinks and a {HOT}-token hot window, margin "
        f"e^-{args.margin:g}"
    )
    print("layer  oracle  norm bound   (fraction of blocks skippable, mean over query heads)")
    means = []
    with torch.no_grad():
        for li in range(geo.num_layers):
            q_pre = torch.from_numpy(kv[f"layer{li}.q_pre_rope"])[None]
            q = rope.rotate(q_pre, li, args.context - QUERIES)[0]  # [query_heads, n, d]
            keys = torch.from_numpy(kv[f"layer{li}.k"])  # [kv_heads, T, d], post-RoPE
            # Queries near the end see every key (the causal mask differs by at most 63 of them).
            rows = [
                skippable(
                    (q[j] @ keys[j // group].T) * scale,
                    keys[j // group].norm(dim=-1),
                    q[j].norm(dim=-1),
                    scale,
                    args.margin,
                )
                for j in range(geo.query_heads)
            ]
            oracle, by_norm = np.mean(rows, axis=0)
            means.append((oracle, by_norm))
            print(f"{li:5d}  {oracle:6.3f}  {by_norm:10.3f}")
    oracle, by_norm = np.mean(means, axis=0)
    print(f"all    {oracle:6.3f}  {by_norm:10.3f}")


if __name__ == "__main__":
    main()
