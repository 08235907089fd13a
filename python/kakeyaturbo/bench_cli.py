"""``kakeyaturbo bench``: encode/decode one tensor file and print a JSON report.

Every ``CodecParams`` field is a flag, so a user can try a setting on their own capture
without writing code. ``--stages`` attributes the loss to PCA, skeleton, quantisation and
outliers.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import _core, codec
from ._core import CodecParams
from .capture import load_tensor
from .cli_args import UsageError, atomic_path, existing_path, int_at_least


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None


# One flag per CodecParams field, in the core's order; the defaults are the core's
# (`_core.codec_params_defaults()`), and tests/unit/test_params_defaults.py checks that these
# names are exactly its fields.
_PARAM_FLAGS: dict[str, tuple[Any, str]] = {
    # name: (type, help); bool is an on-switch
    "block_size": (int, "vectors per block"),
    "bit_width": (int, "bits per rotated residual coordinate (1, 2, 3, 4, 8)"),
    "pca_method": (str, "exact | randomized | none"),
    "target_rank": (int, "randomized PCA: components sought"),
    "oversample": (int, "randomized PCA: extra random directions"),
    "power_iters": (int, "randomized PCA: power iterations"),
    "variance_ratio": (float, "keep the fewest components holding this variance share"),
    "rank_cap": (int, "upper bound on kept components"),
    "share_basis": (bool, "one PCA basis per layer, stored once"),
    "k": (int, "k-means skeleton centres (0: off)"),
    "kmeans_iters": (int, "k-means iterations"),
    "metric": (str, "mse | inner_product"),
    "outlier_threshold": (float, "scaled |value| stored exactly above this (inf: off)"),
    "skeleton_dtype": (str, "fp16 | bf16 | fp32"),
    "seed": (int, "seed for signs, k-means and randomized PCA"),
    "centroids": (_floats, "2**bit_width calibrated Lloyd-Max levels: --centroids=-1.2,0.3"),
    "allocation": (str, "uniform | waterfill (bits per PCA component by reverse water-filling)"),
    "bits_per_value": (float, "waterfill budget in bits per stored value"),
}


def add_param_flags(p: argparse.ArgumentParser) -> None:
    """One ``--flag`` per CodecParams field; a flag not given leaves the core's default."""
    defaults = _core.codec_params_defaults()
    for name, (typ, help_) in _PARAM_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        help_ = f"{help_} (default: {defaults[name]})"
        if typ is bool:
            p.add_argument(flag, dest=name, action="store_true", default=None, help=help_)
        else:
            p.add_argument(flag, dest=name, type=typ, default=None, help=help_)


def params_from_args(args: argparse.Namespace) -> CodecParams:
    """The flags' ``CodecParams``; an invalid value is a `UsageError` naming it."""
    kw = {n: getattr(args, n) for n in _PARAM_FLAGS if getattr(args, n) is not None}
    try:
        return CodecParams(**kw)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from exc


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="encode/decode a .npy/.safetensors tensor, print JSON",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "tensor_file",
        type=existing_path("tensor file", "file"),
        help=".npy or .safetensors; the last two dims are [tokens, head_dim]",
    )
    p.add_argument("--tensor", default=None, help="name of the tensor inside a .safetensors file")
    p.add_argument(
        "--dump-decoded", type=Path, default=None, help="write the reconstruction (.npy)"
    )
    p.add_argument("--stages", action="store_true", help="report the error after each stage")
    p.add_argument(
        "--repeats", type=int_at_least(1), default=3, help="timing repeats (best is reported)"
    )
    add_param_flags(p)
    p.set_defaults(func=run)


def _best_time(fn, repeats: int):
    best, out = math.inf, None
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def run(args: argparse.Namespace) -> int:
    params = params_from_args(args)
    if args.dump_decoded is not None and args.dump_decoded.suffix != ".npy":
        raise UsageError(f"--dump-decoded {str(args.dump_decoded)!r}: expected a .npy path")
    if args.tensor_file.suffix not in (".npy", ".safetensors"):
        raise UsageError(f"{args.tensor_file}: expected a .npy or .safetensors file")
    try:
        x = load_tensor(args.tensor_file, args.tensor)
    except KeyError as exc:
        raise UsageError(exc.args[0]) from exc
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if x.ndim < 2:
        raise UsageError(f"{args.tensor_file}: need at least 2 dimensions, got shape {x.shape}")
    if x.dtype not in (np.float32, np.float16):
        x = x.astype(np.float32)
    shape = x.shape
    x3 = np.ascontiguousarray(x.reshape(-1, shape[-2], shape[-1]))
    t_enc, encs = _best_time(lambda: codec.encode_batch(x3, params), args.repeats)
    t_dec, y = _best_time(lambda: codec.decode_batch(encs), args.repeats)
    y = np.asarray(y, dtype=np.float32)
    xf = x3.astype(np.float32)
    err = xf - y
    stored = sum(e.nbytes for e in encs)
    bf16_bytes = xf.size * 2
    mb = xf.size * 4 / 1e6
    report = {
        "file": str(args.tensor_file),
        "tensor": args.tensor,
        "shape": list(shape),
        "params": params.to_dict(),
        "stored_bytes": stored,
        "bf16_bytes": bf16_bytes,
        "ratio_vs_bf16": bf16_bytes / stored,
        "bits_per_value": 8 * stored / xf.size,
        "mse": float(np.mean(err**2)),
        "relative_error": float(np.linalg.norm(err) / max(np.linalg.norm(xf), 1e-30)),
        "encode_s": t_enc,
        "decode_s": t_dec,
        "encode_mb_per_s": mb / t_enc,
        "decode_mb_per_s": mb / t_dec,
        "blocks": sum(len(e.stats) for e in encs),
        "mean_d_eff": float(np.mean([s["d_eff"] for e in encs for s in e.stats])),
        "outliers": int(sum(s["n_outliers"] for e in encs for s in e.stats)),
    }
    if args.stages:
        per = [codec.stage_errors(np.ascontiguousarray(xf[i]), params) for i in range(len(xf))]
        report["stages"] = {k: float(np.sqrt(np.mean([p[k] ** 2 for p in per]))) for k in per[0]}
    if args.dump_decoded:
        with atomic_path(args.dump_decoded) as tmp:
            np.save(tmp, y.reshape(shape).astype(x.dtype))
        report["decoded_file"] = str(args.dump_decoded)
    print(json.dumps(report, indent=2))
    return 0
