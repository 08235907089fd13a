"""Probe, not shipped: could a key frame that commutes with RoPE keep the frame's gain?

    .venv/bin/python benches/probe_rope_commuting_frames.py \
        --model ../shared/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf \
        > reports/probe_rope_commuting_frames.txt

Attention over pre-RoPE codes turns every token's coordinates into keys with the frame (its
product, `H*D` outputs per coded component and token, is most of a CPU decode step:
docs/speed.md) before RoPE, because RoPE does not commute with a frame that mixes channels of
different frequencies. A frame that mixes only the channels RoPE turns by the same angle (the
pair `(i, i + D/2)` of every KV head: `2H` channels per frequency) commutes with RoPE up to a
`2H x 2H` product per group, so its keys would cost `D/2` such products per token: about 25x
fewer multiply-adds than SmolLM2's frame across heads. What it gives up is the correlation
across frequencies.

Measured per layer with the Gaussian rate-distortion of reverse water-filling (a proxy, no model
runs on codes) at 2.6 bits per value, relative to per-head frames, every variant in one metric
(the queries' second moment averaged over the turns between a query and the keys it reads,
offsets 0..4095, as `probe_block_relative_keys.py`), the correlation a variant's frame cannot
see left out as `per` leaves out the correlation across heads:

- ``joint``: one frame across heads (the default), ``per``: one per head;
- ``freq``: one frame per frequency across heads (commutes with RoPE);
- ``freq/head``: one per frequency and head (a 2 x 2 frame per pair);
- ``diag``: no frame (each channel alone).

``offgroup`` is the share of the metric's squared entries outside the frequency groups (how far
the metric itself is from commuting with RoPE).
"""

from __future__ import annotations

import numpy as np
from tqdm import tqdm

from probe_block_relative_keys import (  # benches/, beside this script
    probe_arguments,
    query_metric,
    turned_moments,
)
from probe_joint_key_structure import reverse_waterfill

BITS = 2.6


def pooled(cov: np.ndarray, groups: list[np.ndarray]) -> float:
    """Distortion with one frame per group of channels and the bits pooled over the groups."""
    lam = np.concatenate([np.linalg.eigvalsh(cov[np.ix_(g, g)]) for g in groups])
    return reverse_waterfill(lam, BITS)[0]


def main() -> None:
    args = probe_arguments(__doc__)

    ids, inv_freq, moments = turned_moments(args)
    heads, d = moments[0].qq.shape[0], moments[0].qq.shape[-1]
    half = d // 2
    freq = [np.array([h * d + i + s for s in (0, half) for h in range(heads)]) for i in range(half)]
    pairs = [np.array([h * d + i, h * d + i + half]) for i in range(half) for h in range(heads)]
    own = [np.arange(h * d, (h + 1) * d) for h in range(heads)]
    in_groups = np.zeros((heads * d, heads * d), dtype=bool)
    for g in freq:
        in_groups[np.ix_(g, g)] = True

    print(f"model {args.model}, {len(ids)} calibration tokens, {BITS} bits per value")
    print("distortion over per-head frames' (lower is better), in the turned query metric")
    print("layer  joint    per   freq  freq/head   diag | offgroup")
    rows = []
    for li, m in enumerate(tqdm(moments, desc="layers", unit="layer")):
        metric, root = query_metric(m, inv_freq)
        offgroup = float((metric[~in_groups] ** 2).sum() / (metric**2).sum())
        mean = m.k.reshape(-1) / m.n
        cov = root @ (m.kk_joint / m.n - np.outer(mean, mean)) @ root

        per = sum(reverse_waterfill(np.linalg.eigvalsh(cov[np.ix_(o, o)]), BITS)[0] for o in own)
        row = np.array(
            [
                reverse_waterfill(np.linalg.eigvalsh(cov), BITS)[0],
                per,
                pooled(cov, freq),
                pooled(cov, pairs),
                reverse_waterfill(np.diag(cov).copy(), BITS)[0],
            ]
        )
        row /= per
        rows.append(row)
        tqdm.write(f"{li:5d} " + " ".join(f"{x:6.2f}" for x in row) + f"     | {offgroup:.3f}")
    print("mean  " + " ".join(f"{x:6.2f}" for x in np.mean(rows, axis=0)))


if __name__ == "__main__":
    main()
