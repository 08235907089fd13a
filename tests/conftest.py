"""Shared fixtures: paths to the real model and text in ../shared, and real K/V."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
MODEL_DIR = SHARED / "models" / "kt-ref-a"
EVAL_TEXT = SHARED / "data" / "wikitext-2-raw-test.txt"
CALIB_TEXT = SHARED / "data" / "calibration-text.txt"


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"{path} is missing: tests need ../shared beside the repository")
    return path


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch's OpenMP workers spin-wait against the codec's own worker threads; on a 2-core
    box that makes small forwards ~10x slower. Modules that run the model use one thread."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return _require(MODEL_DIR)


@pytest.fixture(scope="session")
def eval_text() -> Path:
    return _require(EVAL_TEXT)


@pytest.fixture(scope="session")
def calib_text() -> Path:
    return _require(CALIB_TEXT)


@pytest.fixture(scope="session")
def real_kv(model_dir, eval_text):
    """K (post- and pre-RoPE) and V of every layer of kt-ref-a over 1,024 tokens of
    WikiText-2: ``{"layer{i}.k" | ".k_pre_rope" | ".v": [kv_heads, 1024, 64] float32}``."""
    from kakeyaturbo.capture import capture_kv, load_model, read_tokens

    model, tok = load_model(model_dir)
    ids = read_tokens(tok, eval_text, 1024, offset_chars=10_000)
    return capture_kv(model, ids)
