"""``kakeyaturbo calibrate``: fit a calibration bundle for a local model."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from ..cli_args import (
    add_model_argument,
    add_text_argument,
    command_line,
    int_at_least,
    positive_float,
)
from .schema import DEFAULT_RIDGE, DEFAULT_VALUE_METRIC, VALUE_METRICS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="fit a calibration bundle (query-aware key frames, bases)")
    add_model_argument(p)
    add_text_argument(p, "calibration text (never the evaluation text)")
    p.add_argument("--out", required=True, type=Path, help="bundle folder to write")
    p.add_argument("--tokens", type=int_at_least(1), default=30_000, help="calibration tokens")
    p.add_argument(
        "--ctx", type=int_at_least(1), default=1024, help="window length of each forward pass"
    )
    p.add_argument(
        "--sensitivity-passages",
        type=int_at_least(0),
        default=4,
        help="passages of the per-layer sensitivity scan (0: skip it)",
    )
    p.add_argument(
        "--sensitivity-mode",
        choices=["snapshot", "in-forward", "both"],
        default="both",
        help="protocol of the scan: snapshot (each layer alone on exact inputs), in-forward "
        "(each layer's error carried through the layers above it, estimated from one pass) or "
        "both (the geometric mean of their KLs, the default: the bits then hold in both modes)",
    )
    p.add_argument(
        "--sensitivity-samples",
        type=int_at_least(1),
        default=4,
        help="draws per passage of the in-forward estimate (kakeyaturbo.eval.fisher)",
    )
    p.add_argument(
        "--sensitivity-exact",
        action="store_true",
        help="measure the in-forward KLs instead of estimating them: a prefill per layer's "
        "stream and passage (about 20 minutes for SmolLM2 on 2 cores, against 1 for the "
        "estimate; see docs/calibration.md for what it buys)",
    )
    p.add_argument(
        "--value-metric",
        choices=VALUE_METRICS,
        default=DEFAULT_VALUE_METRIC,
        help="frame of the values: fitted with each channel weighted by what the output "
        "projection reads of it (channel: a channel rescaled against o_proj costs its share), "
        "on the values as they are (none), or weighted by the whole output projection "
        "(output: not better on SmolLM2, and per KV head only)",
    )
    p.add_argument(
        "--joint-heads",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fit one coding frame across each layer's KV heads, which recipes built from the "
        "bundle then code with: better quality per byte (docs/recipe.md item 11), slower "
        "attention over the codes. Default: on for layers of 2 or more KV heads "
        "at most 512 values wide, unless --value-metric output; --no-joint-heads keeps a frame "
        "per KV head",
    )
    p.add_argument(
        "--ridge",
        type=positive_float,
        default=DEFAULT_RIDGE,
        help="ridge added to the query second moment, relative to its mean eigenvalue",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..modeling import load_model
    from .fit import calibrate

    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    calib = calibrate(
        model,
        tok,
        args.text,
        tokens=args.tokens,
        ctx=args.ctx,
        ridge=args.ridge,
        value_metric=args.value_metric,
        joint_heads=args.joint_heads,
        command=command_line(args),
    )
    print(f"frames fitted on {calib.meta['tokens']} tokens ({_since(t0)} so far)")
    if args.sensitivity_passages > 0:
        from ..eval.sensitivity import scan

        # The scan reads the bundle from disk: a scratch copy, so that a failed scan leaves
        # no bundle at --out.
        args.out.parent.mkdir(parents=True, exist_ok=True)
        scratch = tempfile.mkdtemp(prefix=f".{args.out.name}.", dir=args.out.parent)
        try:
            calib.meta["sensitivity"] = scan(
                model,
                tok,
                calib.save(scratch),
                args.text,
                passages=args.sensitivity_passages,
                mode=args.sensitivity_mode,
                samples=args.sensitivity_samples,
                exact=args.sensitivity_exact,
            )
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        print("per-layer bit offsets:", calib.meta["sensitivity"]["offsets"])
    calib.meta["fit_seconds"] = round(time.perf_counter() - t0, 1)
    out = calib.save(args.out)
    print(
        f"wrote calibration bundle {out} ({calib.meta['tokens']} tokens, "
        f"{calib.nbytes / 1e6:.2f} MB of tensors) in {_since(t0)}"
    )
    return 0


def _since(t0: float) -> str:
    s = time.perf_counter() - t0
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"
