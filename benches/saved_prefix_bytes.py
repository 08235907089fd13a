"""Bytes on disk of a prefilled prefix: ``KakeyaCache.save``'s file against the same prefix's
``DynamicCache`` saved with safetensors (the keys and values of every layer, as
``l{i}.keys`` / ``l{i}.values`` in the model's dtype). Writes reports/saved_prefix_bytes.json.

    python benches/saved_prefix_bytes.py [--lengths 512 1024 2048 4096] [--calibration auto]
        [--dtype float32]

Each length is its own prefill from the text's first token, one for each cache. The
KakeyaCache is ``KakeyaCache.from_model(model, calibration=...)`` with no other setting (the
default recipe, residual length, int8 hot values); ``--calibration auto`` (from_model's
default) is the model's own bundle from ``$KAKEYATURBO_CACHE/bundles``, fitted there on first
use (a few minutes), ``none`` codes without one, anything else is a bundle folder.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench_args import add_model_and_text  # (benches/, beside this script)
from kakeyaturbo.hf import CACHE_ARG, KakeyaCache
from kakeyaturbo.hf.cache_identity import calibration_identity
from kakeyaturbo.modeling import load_model, read_text, tokenize_text

REPO = Path(__file__).resolve().parents[1]


def calibration(name: str, model):
    """``--calibration`` as ``from_model`` takes it, resolved once for every length."""
    from kakeyaturbo.calibration import Calibration
    from kakeyaturbo.calibration.auto import AUTO, auto_calibration

    if name == "none":
        return None
    if name == AUTO:
        return auto_calibration(model)
    return Calibration.load(name, model)


@torch.inference_mode()
def dynamic_bytes(model, ids: torch.Tensor, path: Path) -> int:
    """The prefix's DynamicCache, every layer's keys and values, saved with safetensors."""
    cache = getattr(model(ids, use_cache=True, logits_to_keep=1), CACHE_ARG)
    tensors = {}
    for i, layer in enumerate(cache.layers):
        tensors[f"l{i}.keys"] = layer.keys.contiguous()
        tensors[f"l{i}.values"] = layer.values.contiguous()
    save_file(tensors, path)
    return path.stat().st_size


@torch.inference_mode()
def kakeya_bytes(model, ids: torch.Tensor, bundle, path: Path) -> tuple[int, dict]:
    """The prefix's KakeyaCache saved by ``cache.save``: the file's size and the cache's
    memory report."""
    cache = KakeyaCache.from_model(model, calibration=bundle)
    try:
        model(ids, **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1)
        size = cache.save(path)
        if size != path.stat().st_size:
            raise RuntimeError(f"save returned {size} bytes, the file holds {path.stat().st_size}")
        return size, cache.memory_report()
    finally:
        cache.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_and_text(ap)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument(
        "--calibration", default="auto", help="auto (default), none, or a bundle folder"
    )
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the model's dtype, and so the DynamicCache's and the hot window's (float32)",
    )
    ap.add_argument("--out", default=str(REPO / "reports" / "saved_prefix_bytes.json"))
    a = ap.parse_args()

    torch.set_num_threads(1)
    model, tok = load_model(a.model, dtype=a.dtype)
    ids = tokenize_text(tok, read_text(a.text))[None]
    if ids.shape[1] < max(a.lengths):
        raise SystemExit(f"{a.text} holds {ids.shape[1]} tokens, fewer than {max(a.lengths)}")
    bundle = calibration(a.calibration, model)
    dtype = str(model.dtype).removeprefix("torch.")
    print(
        f"model {Path(a.model).name} ({dtype}), text {Path(a.text).name}, calibration "
        f"{a.calibration}; DynamicCache: safetensors of every layer's keys and values in {dtype}",
        flush=True,
    )
    print(f"{'tokens':>7} {'kakeya bytes':>14} {'DynamicCache bytes':>19} {'ratio':>7}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for n in a.lengths:
            prefix = ids[:, :n]
            dense = dynamic_bytes(model, prefix, Path(d) / f"dynamic-{n}.safetensors")
            coded, report = kakeya_bytes(model, prefix, bundle, Path(d) / f"kakeya-{n}.kt")
            rows.append(
                {
                    "tokens": n,
                    "kakeya_file_bytes": coded,
                    "dynamic_safetensors_bytes": dense,
                    "ratio": dense / coded,
                    "kakeya_memory_bytes": report["total_bytes"],
                    "kakeya_compressed_bytes": report["compressed_bytes"],
                    "kakeya_full_precision_bytes": report["full_precision_bytes"],
                }
            )
            print(f"{n:>7} {coded:>14,} {dense:>19,} {dense / coded:>6.2f}x", flush=True)
    report = {
        "command": shlex.join(["python", "benches/saved_prefix_bytes.py", *sys.argv[1:]]),
        "model": Path(a.model).name,
        "dtype": dtype,
        "text": Path(a.text).name,
        "calibration": a.calibration,
        "bundle_sha256": calibration_identity(bundle),
        "dynamic_cache_file": f"safetensors, l{{i}}.keys / l{{i}}.values in {dtype}",
        "rows": rows,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
