"""What the variant benches share (``outlier_channels.py``, ``sliding_layers.py``): a model
folder evaluated by ``kakeyaturbo eval ppl``, as a user runs it, and the rows they report."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROW_KEYS = ("ratio", "delta_ppl", "kl", "top1", "verdict")


@contextmanager
def saved(model, tokenizer) -> Iterator[Path]:
    """A temporary model folder holding ``model`` and ``tokenizer`` (what ``eval`` loads)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        yield folder


def evaluate(model_dir: str, text: str, passages: int, mode: str, methods: list[str], out: Path):
    """``eval ppl`` of ``methods`` on ``model_dir`` (its progress shown); its JSON report."""
    cmd = [sys.executable, "-m", "kakeyaturbo", "eval", "ppl", "--model", model_dir]
    cmd += ["--text", text, "--passages", str(passages), "--mode", mode, "--out", str(out)]
    for m in methods:
        cmd += ["--method", m]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def rows(report: dict) -> dict:
    """``{method: {ratio, delta_ppl, kl, top1, verdict}}`` of an ``eval ppl`` report."""
    return {r["method"]: {k: r[k] for k in ROW_KEYS} for r in report["methods"]}


def cell(row: dict) -> str:
    """One method's result in a table cell."""
    return f"{row['ratio']:.2f}x {row['delta_ppl']:+.2%} KL {row['kl']:.2e} {row['verdict']}"
