"""The data arguments the benches share: SmolLM2 and the texts in ``../shared`` by default."""

from __future__ import annotations

import argparse
from pathlib import Path

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared"
SMOLLM2 = str(SHARED / "models" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf")
WIKITEXT = str(SHARED / "data" / "wikitext-2-raw-test.txt")
CALIBRATION_TEXT = str(SHARED / "data" / "calibration-text.txt")


def add_model_and_text(ap: argparse.ArgumentParser, text: str = WIKITEXT) -> None:
    """``--model`` (default SmolLM2) and ``--text`` (default ``text``)."""
    ap.add_argument("--model", default=SMOLLM2, help="a model folder or GGUF file")
    ap.add_argument("--text", default=text, help="a text file")
