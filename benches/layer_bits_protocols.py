"""Per-layer bit offsets under both evaluation protocols: the calibrated default with its
sensitivity offsets at full strength, at half strength, clipped tighter, and switched off, each
scored in snapshot and in-forward mode on the same passages (same average bits, same bytes).

    .venv/bin/python benches/layer_bits_protocols.py --calibration artifacts/calib-smollm2

The offsets come from a scan that codes one layer at a time on exact inputs (snapshot); in
in-forward mode every layer's error reaches the layers above it, which that scan never sees.
This measures how much of the in-forward loss a gentler allocation buys back, and what it costs
in snapshot mode.
"""

from __future__ import annotations

import smollm2_eval  # benches/, beside this script
from kakeyaturbo.calibration.sensitivity import layer_offsets
from kakeyaturbo.eval.harness import evaluate_method
from kakeyaturbo.eval.registry import build_method
from kakeyaturbo.pipeline import Pipeline


def variants(kl: dict[str, list[float]]) -> dict[str, dict]:
    n = len(kl["k"])

    def split(off: list[float]) -> dict:
        return {"k_layer_bits": tuple(off[:n]), "v_layer_bits": tuple(off[n:])}

    joint = kl["k"] + kl["v"]
    return {
        "full (default)": {},
        "half strength": split([0.5 * x for x in layer_offsets(joint)]),
        "clipped +-0.75": split(layer_offsets(joint, 0.75)),
        "none": {"k_layer_bits": (), "v_layer_bits": ()},
    }


def main(argv=None) -> None:
    args = smollm2_eval.parser(__doc__).parse_args(argv)
    setup = smollm2_eval.setup(args)
    spec = f"kakeya:calibration={args.calibration}"
    base = build_method(spec)
    scan = base.calibration.meta.get("sensitivity")
    if scan is None:
        raise SystemExit(f"{args.calibration} has no sensitivity scan")
    print(f"{args.passages} passages, ctx 960 + 64, {spec}")
    default = base.recipe
    for name, change in variants(scan["kl"]).items():
        # One method (one bundle load), its recipe and pipeline swapped per variant.
        base.recipe = default.replace(**change)
        base.pipeline = Pipeline(base.recipe, base.calibration)
        for mode in ("snapshot", "in-forward"):
            r = evaluate_method(setup.model, setup.reference, base, mode)
            print(f"{name:16s} {mode:10s} {smollm2_eval.scores(r)}", flush=True)


if __name__ == "__main__":
    main()
