"""`eval layers`: where a method's error comes from, for tuning.

- per-layer sensitivity: the codec on one layer at a time (snapshot mode);
- depth compounding: the codec on the first k layers, in-forward mode, so each layer's K/V are
  computed from the reconstructed K/V of the layers before it;
- K-only / V-only attribution: one stream compressed, the other not, in both modes.

What is not compressed is left exactly as computed (`passthrough=exact`, still counted at bf16
bytes), so each row measures the codec's error alone. Every row is an ordinary `eval ppl` row
whose `options` say what was compressed.
"""

from __future__ import annotations

import time
from typing import Any

from kakeyaturbo.eval.ppl import Setup, environment, run_methods
from kakeyaturbo.modeling import kv_geometry

__all__ = ["layer_diagnostics"]


def layer_diagnostics(setup: Setup, spec: str, progress: bool = True) -> dict[str, Any]:
    n = kv_geometry(setup.model.config).num_layers
    t0 = time.perf_counter()

    def one(mode: str, extra: dict[str, Any], label: str) -> dict[str, Any]:
        extra = {"passthrough": "exact", **extra}
        return run_methods(setup, [spec], mode, extra, progress, label=label)[0]

    per_layer = [one("snapshot", {"layers": [layer]}, f"layer {layer}") for layer in range(n)]
    depth = [one("in-forward", {"layers": f"0-{k - 1}"}, f"first {k}") for k in range(1, n + 1)]
    streams = [
        one(mode, {"streams": s}, f"{mode} {s}")
        for mode in ("snapshot", "in-forward")
        for s in ("kv", "k", "v")
    ]
    ppl_ref = next((r["ppl_ref"] for r in per_layer + depth if r.get("ppl_ref") is not None), None)
    return {
        "method": spec,
        "ppl_ref": ppl_ref,
        "per_layer": per_layer,
        "depth": depth,
        "streams": streams,
        "seconds": round(time.perf_counter() - t0, 1),
        "environment": environment(),
    }
