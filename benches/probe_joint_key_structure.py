"""Probe, not shipped: could a cheaper frame keep what coding keys across heads gains?

    .venv/bin/python benches/probe_joint_key_structure.py --model MODEL --bundle DIR \
        > reports/probe_joint_key_structure.txt

Keys coded in one frame across a layer's KV heads halve the in-forward KL at equal bytes, and
make the key frame product of attention over the codes ``H`` times the per-head one (every
head's keys from all ``H*D`` coordinates: the default's whole decode-speed cost,
docs/speed.md). This asks, per layer, where that gain comes from, with the Gaussian
rate-distortion of reverse water-filling as the measure (a proxy: no model runs on the codes),
at the bundle's rate for the layer (2.6 bits plus its scanned offset), in the query-aware metric
the keys are coded in:

- ``joint``: one frame across the heads (what the default codes), distortion over per-head
  frames;
- ``pooled``: per-head frames with the bits pooled across the heads (a block-diagonal joint
  frame: the per-head product, no decorrelation across heads);
- ``top m``: the first ``m`` joint components, then per-head frames of what they leave
  (``m`` rows of the frame across heads, the rest per head); ``cost`` is its frame product
  (multiply-adds of the coded components) over the joint frame's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from bench_args import CALIBRATION_TEXT, add_model_and_text  # benches/, beside this script
from kakeyaturbo.calibration.fit import _block_diagonal, _eig_desc, collect_moments
from kakeyaturbo.modeling import load_model
from kakeyaturbo.recipes import CALIBRATED_BITS


def reverse_waterfill(lam: np.ndarray, bits: float) -> tuple[float, np.ndarray]:
    """Distortion of components of variances ``lam`` at ``bits`` per component on average,
    and which components get bits."""
    lam = np.maximum(lam, 1e-12)
    lo, hi = 1e-14, float(lam.max())
    for _ in range(200):  # bisection on the water level
        level = np.sqrt(lo * hi)
        if np.maximum(0.0, 0.5 * np.log2(lam / level)).sum() > bits * lam.size:
            lo = level
        else:
            hi = level
    return float(np.minimum(lam, level).sum()), lam > level


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_and_text(ap, CALIBRATION_TEXT)
    ap.add_argument("--bundle", required=True, help="a bundle fitted with --joint-heads")
    ap.add_argument("--tokens", type=int, default=12_000)
    ap.add_argument("--top", type=int, nargs="+", default=[8, 16, 32, 64])
    args = ap.parse_args()

    from safetensors.numpy import load_file

    meta = json.loads((Path(args.bundle) / "calibration.json").read_text())
    offsets = meta["sensitivity"]["offsets"]["k"]
    transform = load_file(str(Path(args.bundle) / "tensors.safetensors"))["k_transform"]
    model, tok = load_model(args.model)
    text = Path(args.text).read_text(encoding="utf-8")
    ids = tok(text[: args.tokens * 12], add_special_tokens=False)["input_ids"][: args.tokens]
    moments = collect_moments(model, ids, ctx=1024, joint=True)
    print(f"model {args.model}, bundle {args.bundle}, {len(ids)} calibration tokens")
    print("distortion over per-head frames' (lower is better); cost: frame product over joint's")
    heads, d = transform.shape[1], transform.shape[-1]
    rows = []
    for li, m in enumerate(moments):
        bits = CALIBRATED_BITS[0] + offsets[li]
        frame = _block_diagonal(transform[li].astype(np.float64))
        mean = m.k.reshape(-1) / m.n
        cov = frame.T @ (m.kk_joint / m.n - np.outer(mean, mean)) @ frame
        lam, vecs = _eig_desc(cov)
        own = [slice(h * d, (h + 1) * d) for h in range(heads)]
        blocks = [cov[o, o] for o in own]
        per_head = sum(reverse_waterfill(np.linalg.eigvalsh(b), bits)[0] for b in blocks)
        joint, coded = reverse_waterfill(lam, bits)
        pooled, _ = reverse_waterfill(np.concatenate([np.linalg.eigvalsh(b) for b in blocks]), bits)
        cols = [f"L{li:2d} {bits:.2f} bits", f"joint {joint / per_head:.2f}"]
        cols.append(f"pooled {pooled / per_head:.2f}")
        row = [joint / per_head, pooled / per_head]
        for top in args.top:
            p = vecs[:, :top]
            rest = (np.eye(heads * d) - p @ p.T) @ cov @ (np.eye(heads * d) - p @ p.T)
            parts = [lam[:top]] + [np.linalg.eigvalsh(rest[o, o]) for o in own]
            # The same bits per vector over heads * d + top components.
            per_component = bits * heads * d / (heads * d + top)
            dist, on = reverse_waterfill(np.concatenate(parts), per_component)
            cost = (on[:top].sum() * heads * d + on[top:].sum() * d) / (coded.sum() * heads * d)
            cols.append(f"top {top}: {dist / per_head:.2f} cost {cost:.2f}")
            row.append(dist / per_head)
        rows.append(row)
        print("  ".join(cols))
    mean_row = np.mean(rows, axis=0)
    print(
        f"mean over layers: joint {mean_row[0]:.2f}, pooled {mean_row[1]:.2f}, "
        + ", ".join(f"top {t} {v:.2f}" for t, v in zip(args.top, mean_row[2:]))
    )


if __name__ == "__main__":
    main()
