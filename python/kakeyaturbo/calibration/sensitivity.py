"""Sensitive layers: measure how much each layer's keys and values move the output when
compressed alone, then shift bits towards the sensitive ones under a fixed average.

With distortion ``D_i ~ s_i 2^(-2 b_i)`` per layer, the total ``sum_i D_i`` at a fixed mean
bit rate is smallest when every layer ends at the same ``s_i 2^(-2 b_i)``, i.e.
``b_i = B + 1/2 log2(s_i / geomean(s))`` (the same reverse water-filling as within a
vector, one level up). The scan that measures it runs the evaluation and lives in
:mod:`kakeyaturbo.eval.sensitivity`. The sensitivity ``s_i`` is the KL divergence to the
uncompressed model when only layer ``i``'s stream is compressed at a probe rate, measured on
calibration text (never the evaluation text). Keys and values are allocated jointly: the
offsets have mean zero over all ``2 x layers`` streams, so a model whose values are more
sensitive than its keys gets more bits on values.
"""

from __future__ import annotations

import numpy as np

#: Offsets are kept within this many bits of the mean.
MAX_OFFSET = 1.5


def layer_offsets(kl: list[float], max_offset: float = MAX_OFFSET) -> list[float]:
    """Bit offsets (mean zero, clipped to +-max_offset) from per-layer sensitivities."""
    s = np.maximum(np.asarray(kl, dtype=np.float64), 1e-12)
    off = 0.5 * np.log2(s / np.exp(np.log(s).mean()))
    for _ in range(20):  # clip, then restore a zero mean among the unclipped
        off = np.clip(off, -max_offset, max_offset)
        free = np.abs(off) < max_offset
        if not free.any() or abs(off.mean()) < 1e-9:
            break
        off[free] -= off.sum() / free.sum()
    return [round(float(v), 4) for v in off]


def joint_offsets(
    kl: dict[str, list[float]], uncoded: frozenset[int] = frozenset()
) -> dict[str, list[float]]:
    """Offsets over keys and values together (mean zero over all 2 x layers streams), so the
    scan also decides how the bits split between keys and values. Layers in ``uncoded`` (held
    exact: sliding-window layers) get offset 0 and no share of the mean, which would otherwise
    hand their bits to the coded layers."""
    n = len(kl["k"])
    coded = [li for li in range(n) if li not in uncoded]
    off = layer_offsets([kl[s][li] for s in "kv" for li in coded]) if coded else []
    out = {s: [0.0] * n for s in "kv"}
    for i, (s, li) in enumerate((s, li) for s in "kv" for li in coded):
        out[s][li] = off[i]
    return out
