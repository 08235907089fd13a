"""`eval ppl`: one reference run, then every method scored against it; returns the JSON result."""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from kakeyaturbo.eval.harness import Reference, evaluate_method, prepare_reference
from kakeyaturbo.eval.registry import build_method
from kakeyaturbo.modeling import (
    copy_passages,
    cut_passages,
    kv_geometry,
    load_model,
    read_text,
    tokenize_text,
)

__all__ = ["Setup", "environment", "load_setup", "run_methods"]


@dataclass
class Setup:
    """A loaded model, its passages and the reference run they share."""

    model: Any
    model_dir: str
    text: str
    ctx: int
    n_eval: int
    reference: Reference
    protocol: str = "passages"  # or "copy": each window written twice, scored on the copy

    def config(self) -> dict[str, Any]:
        g = kv_geometry(self.model.config)
        return {
            "model": self.model_dir,
            "text": self.text,
            "ctx": self.ctx,
            "n_eval": self.n_eval,
            "protocol": self.protocol,
            "passages": len(self.reference.passages),
            "passage_starts": [p.start for p in self.reference.passages],
            "layers": g.num_layers,
            "kv_heads": g.kv_heads,
            "head_dim": g.head_dim,
            "layer_types": list(g.layer_types),
            "reference_seconds": round(self.reference.seconds, 3),
        }


def environment() -> dict[str, Any]:
    import transformers

    import kakeyaturbo

    return {
        "kakeyaturbo": kakeyaturbo.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def load_setup(
    model_dir: str,
    text: str,
    ctx: int,
    n_eval: int,
    passages: int,
    batch: int = 16,
    progress: bool = True,
    copy: bool = False,
) -> Setup:
    """Load the model, cut the passages (``copy``: the copying test, see
    :func:`~kakeyaturbo.modeling.copy_passages`) and run the reference."""
    if copy and n_eval >= ctx:
        raise ValueError("the copying test needs n_eval < ctx (scored tokens in the copy)")
    torch.manual_seed(0)
    model, tokenizer = load_model(model_dir)
    ids = tokenize_text(tokenizer, read_text(text))
    cut = copy_passages if copy else cut_passages
    chunks = cut(ids, passages, ctx + n_eval + 1)
    with tqdm(
        total=len(chunks), desc="reference", unit="passage", disable=not progress, file=sys.stderr
    ) as bar:
        ref = prepare_reference(model, chunks, ctx, n_eval, batch=batch, progress=bar)
    return Setup(model, str(model_dir), str(text), ctx, n_eval, ref, "copy" if copy else "passages")


def run_methods(
    setup: Setup,
    specs: list[str],
    mode: str = "snapshot",
    extra_options: dict[str, Any] | None = None,
    progress: bool = True,
    label: str = "methods",
) -> list[dict[str, Any]]:
    """Score each spec; a method that cannot run gives a row with `skipped` or `error`."""
    rows = []
    n = len(setup.reference.passages)
    with tqdm(
        total=n * len(specs), desc=label, unit="passage", disable=not progress, file=sys.stderr
    ) as bar:
        for spec in specs:
            bar.set_postfix_str(spec)
            start = bar.n
            try:
                method = build_method(spec, extra_options)
                rows.append(
                    evaluate_method(setup.model, setup.reference, method, mode, progress=bar)
                )
            except Exception as exc:  # noqa: BLE001 - one failing method must not lose the sweep
                rows.append({"method": spec, "mode": mode, "error": f"{type(exc).__name__}: {exc}"})
                bar.update(start + n - bar.n)
    return rows


def ppl_result(
    setup: Setup,
    specs: list[str],
    mode: str,
    streams: str | None,
    command: str,
    progress: bool = True,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    extra = {"streams": streams} if streams else None
    rows = run_methods(setup, specs, mode, extra, progress)
    return {
        "kind": "ppl",
        "command": command,
        **setup.config(),
        "mode": mode,
        "streams": streams or "method default",
        "ppl_ref": _ppl_ref(rows),
        "methods": rows,
        "seconds": round(time.perf_counter() - t0 + setup.reference.seconds, 1),
        "environment": environment(),
    }


def _ppl_ref(rows: list[dict[str, Any]]) -> float | None:
    for r in rows:
        if r.get("ppl_ref") is not None:
            return r["ppl_ref"]
    return None


def write_json(obj: dict[str, Any], path: str | Path) -> None:
    """Writes ``obj`` to ``path`` whole or not at all (a temporary file, then a rename)."""
    import json

    from kakeyaturbo.cli_args import atomic_path

    text = json.dumps(obj, indent=1, allow_nan=False) + "\n"
    with atomic_path(path) as tmp:
        tmp.write_text(text)
