"""Probe, not shipped: could keys coded relative to their block's first position keep quality?

    .venv/bin/python benches/probe_block_relative_keys.py \
        --model ../shared/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf \
        > reports/probe_block_relative_keys.txt

The default codes keys pre-RoPE, so attention over the codes turns every token's key out of
the frame before RoPE: the key frame product (tokens x coded components x heads x head_dim
multiply-adds per step), most of a decode step on a 2-core CPU (docs/speed.md). Keys coded
after turning them back only to their block's first position ``p0`` (``R(p - p0) k``) would let
a query turn into each block's frame once, ``(M R(p0)^T q) . y_t``: a multiply-add per coded
component and query head per token, about 20 times fewer for SmolLM2's frame across heads.
What it would cost: within a block the pairs of channels turn by up to ``255 theta_i``, so the
structure a fixed frame captures is smeared, as post-RoPE coding smears it over all positions.

Measured here per layer with the Gaussian rate-distortion of reverse water-filling (a proxy, no
model runs on codes), at 2.6 bits per value, relative to per-head frames of pre-RoPE keys. The
covariances come from pre-RoPE calibration moments, turned analytically by every offset in the
window (``E R(d) C R(d)^T`` minus the turned mean's outer product); every variant is measured in
one metric, the queries' second moment averaged over the turns between a query and the keys it
reads (offsets 0..4095), which is what the score error sees whichever frame codes the keys:

- ``pre``: the pre-RoPE keys (what the default codes);
- ``rel256`` / ``rel64``: turned by their offset in a block of 256 (the default block) / 64;
- ``post``: turned by offsets 0..1023 (post-RoPE keys over a 1024-token window).

Each as one frame across the heads (``joint``) and per head (``per``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench_args import CALIBRATION_TEXT, add_model_and_text  # benches/, beside this script
from kakeyaturbo.calibration.fit import collect_moments
from kakeyaturbo.hf.rope import ModelRope
from kakeyaturbo.modeling import load_model
from probe_joint_key_structure import reverse_waterfill

BITS = 2.6
QUERY_OFFSETS = 4096
VARIANTS = {
    "pre": np.zeros(1),
    "rel256": np.arange(256.0),
    "rel64": np.arange(64.0),
    "post": np.arange(1024.0),
}


def turns(offsets: np.ndarray, inv_freq: np.ndarray, heads: int, d: int) -> np.ndarray:
    """``[n, heads*d, heads*d]``: RoPE's turn by each offset, channel pairs ``(i, i + d/2)``
    of every head (the half-split pairing of Llama-style models)."""
    half = len(inv_freq)
    out = np.zeros((len(offsets), heads * d, heads * d))
    i = np.arange(half)
    for n, off in enumerate(offsets):
        c, s = np.cos(off * inv_freq), np.sin(off * inv_freq)
        for h in range(heads):
            a, b = h * d + i, h * d + i + half
            out[n, a, a], out[n, b, b], out[n, a, b], out[n, b, a] = c, c, -s, s
    return out


def turned_covariance(second: np.ndarray, mean: np.ndarray, offsets, inv_freq, heads, d):
    """Covariance of ``R(o) x`` over ``x`` (second moment ``second``, mean ``mean``) and the
    offsets ``o`` equally likely."""
    acc, m = np.zeros_like(second), np.zeros_like(mean)
    for lo in range(0, len(offsets), 64):
        r = turns(offsets[lo : lo + 64], inv_freq, heads, d)
        acc += (r @ second @ r.transpose(0, 2, 1)).sum(0)
        m += (r @ mean).sum(0)
    acc, m = acc / len(offsets), m / len(offsets)
    return acc - np.outer(m, m)


def probe_arguments(doc: str) -> argparse.Namespace:
    """``--model``, ``--text`` (the calibration text) and ``--tokens``, described by ``doc``'s
    first line."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    add_model_and_text(ap, CALIBRATION_TEXT)
    ap.add_argument("--tokens", type=int, default=12_000)
    return ap.parse_args()


def turned_moments(args: argparse.Namespace) -> tuple[list[int], np.ndarray, list]:
    """The calibration tokens of ``args`` (``--model``, ``--text``, ``--tokens``), RoPE's
    inverse frequencies and every layer's moments across heads."""
    model, tok = load_model(args.model)
    text = Path(args.text).read_text(encoding="utf-8")
    ids = tok(text[: args.tokens * 12], add_special_tokens=False)["input_ids"][: args.tokens]
    spec = ModelRope(model.config)(0)
    if spec.adjacent_pairs or spec.rot_dim != model.config.head_dim:
        raise SystemExit("this probe turns half-split pairs over the whole head")
    inv_freq = spec.inv_freq.double().numpy()
    return ids, inv_freq, collect_moments(model, ids, ctx=1024, joint=True)


def query_metric(m, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A layer's query metric (its queries' second moment, each head on its own channels,
    averaged over the turns by offsets 0..QUERY_OFFSETS-1) and its symmetric square root."""
    heads, d = m.qq.shape[0], m.qq.shape[-1]
    q = np.zeros((heads * d, heads * d))
    for h in range(heads):
        q[h * d : (h + 1) * d, h * d : (h + 1) * d] = m.qq[h] / m.nq
    offsets = np.linspace(0, QUERY_OFFSETS - 1, 256)
    metric = turned_covariance(q, np.zeros(heads * d), offsets, inv_freq, heads, d)
    w, v = np.linalg.eigh(metric)
    return metric, v @ np.diag(np.sqrt(np.maximum(w, 0))) @ v.T


def main() -> None:
    args = probe_arguments(__doc__)

    ids, inv_freq, moments = turned_moments(args)
    heads, d = moments[0].qq.shape[0], moments[0].qq.shape[-1]
    print(f"model {args.model}, {len(ids)} calibration tokens, {BITS} bits per value")
    print("distortion over per-head pre-RoPE frames' (lower is better), in the turned query metric")
    print("layer " + "  ".join(f"{v:>6} joint/per" for v in VARIANTS))
    rows = []
    for li, m in enumerate(tqdm(moments, desc="layers", unit="layer")):
        _, root = query_metric(m, inv_freq)
        second, mean = m.kk_joint / m.n, m.k.reshape(-1) / m.n
        row = []
        for offsets in VARIANTS.values():
            cov = root @ turned_covariance(second, mean, offsets, inv_freq, heads, d) @ root
            own = [slice(h * d, (h + 1) * d) for h in range(heads)]
            row.append(reverse_waterfill(np.linalg.eigvalsh(cov), BITS)[0])
            row.append(sum(reverse_waterfill(np.linalg.eigvalsh(cov[o, o]), BITS)[0] for o in own))
        row = np.array(row) / row[1]
        rows.append(row)
        tqdm.write(f"{li:5d} " + "  ".join(f"{a:6.2f} / {b:4.2f}" for a, b in row.reshape(-1, 2)))
    mean_row = np.mean(rows, axis=0).reshape(-1, 2)
    print("mean  " + "  ".join(f"{a:6.2f} / {b:4.2f}" for a, b in mean_row))


if __name__ == "__main__":
    main()
