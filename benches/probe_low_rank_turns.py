"""Probe, not shipped: how much of the key frame product could low-rank RoPE turns save?

    .venv/bin/python benches/probe_low_rank_turns.py > reports/probe_low_rank_turns.txt

Pure arithmetic, no model. Attention over pre-RoPE codes makes every token's keys (`H*D`
channels of `r` coded coordinates: `H*D*r` multiply-adds per token) and then turns them by
RoPE. Over a span of `S` tokens the slowest RoPE pairs barely turn, so their turns
``cos(t theta_i)``, ``sin(t theta_i)`` (a matrix over the span's offsets and those pairs) are
close to a matrix of low rank ``K``: their share of the logits is then ``K`` products of the
coordinates per query head with vectors made once per span from the query and the frame
(``sum_k u_k(t) (w_hk . y_t)``), instead of their keys. Per token and in units of ``r``
multiply-adds that costs

    2 H (D/2 - P)      the keys of the fast pairs (as now)
  + Hq K               the slow pairs' share, K products per query head
  + Hq K 2P / S        the vectors, made once per span (each from a head's 2P slow channels)

against ``H D`` now, for the `P` slowest pairs and the smallest ``K`` whose turns stay within
``--tolerance`` of the exact ones (largest absolute error of a cosine or sine, the rank's best
fit by SVD over centred offsets). Printed: the best `P` and ``K`` per span, and the cost as a
share of today's product.
"""

from __future__ import annotations

import argparse

import numpy as np


def cost(heads: int, q_heads: int, d: int, span: int, slow: int, rank: int) -> float:
    """Multiply-adds per token and coordinate, in the units of the module docstring."""
    return 2 * heads * (d // 2 - slow) + q_heads * rank * (1 + 2 * slow / span)


def smallest_rank(offsets: np.ndarray, theta: np.ndarray, tol: float) -> int:
    """The smallest rank whose best fit keeps every turn of `theta` at `offsets` within `tol`."""
    turns = np.concatenate([np.cos(np.outer(offsets, theta)), np.sin(np.outer(offsets, theta))], 1)
    u, s, vt = np.linalg.svd(turns, full_matrices=False)
    for k in range(1, len(s) + 1):
        if np.abs((u[:, :k] * s[:k]) @ vt[:k] - turns).max() <= tol:
            return k
    return len(s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tolerance", type=float, default=1e-4)
    args = ap.parse_args()
    # (name, RoPE base, head dim, KV heads, query heads)
    models = [
        ("SmolLM2-135M", 1e5, 64, 3, 9),
        ("Llama-3-8B", 5e5, 128, 8, 32),
        ("Qwen3-8B", 1e6, 128, 8, 32),
        ("head_dim 64, base 1e4", 1e4, 64, 4, 16),
    ]
    print(f"turns within {args.tolerance:g} of the exact ones; cost = product per token / today's")
    print(f"{'model':24} {'span':>5} {'slow pairs':>10} {'rank':>5} {'cost':>6}")
    for name, base, d, h, hq in models:
        theta = base ** (-np.arange(d // 2) * 2.0 / d)
        for span in (64, 128, 256):
            offsets = np.arange(span) - (span - 1) / 2
            best = (1.0, 0, 0)
            for slow in range(1, d // 2 + 1):
                k = smallest_rank(offsets, theta[d // 2 - slow :], args.tolerance)
                share = cost(h, hq, d, span, slow, k) / (h * d)
                best = min(best, (share, slow, k))
            print(f"{name:24} {span:5d} {best[1]:10d} {best[2]:5d} {best[0]:6.2f}")


if __name__ == "__main__":
    main()
