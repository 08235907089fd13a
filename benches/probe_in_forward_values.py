"""Probe, not shipped: where the calibrated default loses in in-forward mode.

    .venv/bin/python benches/probe_in_forward_values.py --calibration artifacts/calib-smollm2

In snapshot mode the calibrated default is ACCEPT at 5.17x; in in-forward mode (every prefix
token attends to reconstructed K/V, so errors compound with depth) it is REJECT. This prints
1. each method's per-token relative error of the values, ``|v_hat - v| / |v|``, over the
   coded tokens of every layer of two passages (RMS and quantiles: a heavy tail would point
   at a few badly coded tokens, a high median at the rate);
2. in-forward and snapshot scores of the default with only keys or only values coded, beside
   KIVI-style 4-bit, to show which stream compounds;
3. an oracle: the 5% of value tokens with the largest error (picked with the exact values)
   re-coded at 2 more bits, against 5% picked at random. If a tail drove the loss, the first
   would close much of it.
"""

from __future__ import annotations

import torch

import smollm2_eval  # benches/, beside this script
from kakeyaturbo.eval.harness import _rope, compress_stream, evaluate_method
from kakeyaturbo.eval.kakeya import Kakeya
from kakeyaturbo.eval.methods import register
from kakeyaturbo.eval.registry import build_method

PEERS = ("kivi:bits=4", "kivi:bits=3", "turboquant:bits=4")


def token_errors(setup, spec: str) -> str:
    """Per-token relative value error of `spec` over every layer of the first batch."""
    method = build_method(spec)
    cache = setup.reference.batches[0].cache
    rope = _rope(setup.model, method)
    sinks, recent = method.options.sink_tokens, 64
    rel = []
    for li, layer in enumerate(cache.layers):
        x = layer.values[:2].float()
        y, _ = compress_stream(method, x, li, "v", rope)
        err = (y.float() - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-6)
        rel.append(err[:, :, sinks:-recent].flatten())  # coded at the base rate
    r = torch.cat(rel)
    q = torch.quantile(r, torch.tensor([0.5, 0.9, 0.99]))
    return (
        f"RMS {r.pow(2).mean().sqrt():.3f}  median {q[0]:.3f}  q90 {q[1]:.3f}  "
        f"q99 {q[2]:.3f}  max {r.max():.3f}"
    )


@register("kakeya-oracle-boost", "probe: the worst-coded value tokens re-coded at more bits")
class OracleBoost(Kakeya):
    """The default, with a share of each value stream's tokens (the worst-coded ones, or a
    random pick) replaced by their coding at `extra` more bits; bytes add that share of the
    difference plus a 2-byte index per token."""

    name = "kakeya-oracle-boost"

    def __init__(self, params):
        p = dict(params)
        self.share = float(p.pop("share", 0.05))
        self.pick = str(p.pop("pick", "worst"))
        extra = float(p.pop("extra", 2.0))
        super().__init__(p)
        self.wider = Kakeya({**p, "bits_per_value": self.recipe.v.bits_per_value + extra})

    def compress(self, x, layer, stream):
        y, rows = super().compress(x, layer, stream)
        if stream != "v":
            return y, rows
        self.wider.options = self.options
        y_wide, rows_wide = self.wider.compress(x, layer, stream)
        err = (y.float() - x.float()).norm(dim=-1) / x.float().norm(dim=-1).clamp_min(1e-6)
        if self.pick == "random":
            err = torch.rand(err.shape, generator=torch.Generator().manual_seed(layer))
        err[:, :, : self.options.sink_tokens] = -1.0
        count = round(self.share * x.shape[2])
        picked = torch.zeros_like(err, dtype=torch.bool)
        picked.scatter_(-1, err.topk(count, dim=-1).indices, True)
        y = torch.where(picked[..., None], y_wide, y)
        index_bytes = 2 * count * x.shape[1]
        for r, w in zip(rows, rows_wide):
            r["encoded"] += round(self.share * (w["encoded"] - r["encoded"])) + index_bytes
        return y, rows


def main(argv=None) -> None:
    args = smollm2_eval.parser(__doc__).parse_args(argv)
    setup = smollm2_eval.setup(args)
    cal = f"calibration={args.calibration}"
    print("1. per-token relative error of values (2 passages, every layer, base-rate tokens)")
    for spec in (f"kakeya:{cal}", "kakeya", *PEERS):
        print(f"  {spec:44s} {token_errors(setup, spec)}", flush=True)
    print(f"\n2-3. {args.passages} passages, ctx 960 + 64")
    rows = [
        (mode, spec)
        for mode in ("in-forward", "snapshot")
        for spec in (f"kakeya:{cal}", f"kakeya:{cal},streams=k", f"kakeya:{cal},streams=v")
        + ("kivi:bits=4", "kivi:bits=4,streams=k", "kivi:bits=4,streams=v")
    ] + [
        ("in-forward", f"kakeya-oracle-boost:{cal}"),
        ("in-forward", f"kakeya-oracle-boost:{cal},pick=random"),
    ]
    for mode, spec in rows:
        r = evaluate_method(setup.model, setup.reference, build_method(spec), mode)
        print(f"  {mode:10s} {spec:52s} {smollm2_eval.scores(r)}", flush=True)


if __name__ == "__main__":
    main()
