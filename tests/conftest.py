"""Shared fixtures: paths to the real model and text in ../shared, and real K/V."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests pin the recipe they test: the model's own bundle, fitted on first use
# (kakeyaturbo.calibration.auto), only where a test asks for it (tests/integration/
# test_auto_calibration.py and the SmolLM2 quality test), so that the suite neither fits one per
# tiny model nor reads a bundle a developer's cache already holds.
os.environ.setdefault("KAKEYATURBO_AUTO_CALIBRATION", "0")

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
MODEL_DIR = SHARED / "models" / "kt-ref-a"
EVAL_TEXT = SHARED / "data" / "wikitext-2-raw-test.txt"
CALIB_TEXT = SHARED / "data" / "calibration-text.txt"
SMOLLM2_GGUF = SHARED / "models" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _require(path: Path) -> Path:
    """``path``, or a one-line skip naming what is missing (a failure under CI, where
    ../shared is always laid beside the clone, so a lost file cannot pass as a skip)."""
    if not path.exists():
        why = f"needs ../{path.relative_to(REPO.parent)} (../shared beside the repository)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return path


@pytest.fixture(scope="module")
def one_torch_thread():
    """Modules that run the model use one torch thread: their bounds were measured so, and
    the codec then keeps to its own rayon pool (with more, it runs on torch's OpenMP team;
    ``tests/integration/test_threading.py`` covers that)."""
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
def joint_bundle(model_dir, calib_text, tmp_path_factory) -> Path:
    """kt-ref-a's bundle with keys and values coded across heads, calibrated once per session
    on 2,048 tokens, saved where Triton's interpreter (a fresh process) can load it."""
    from transformers import AutoTokenizer

    from kakeyaturbo.calibration import calibrate
    from kakeyaturbo.modeling import load_model

    model = load_model(model_dir)[0]
    tok = AutoTokenizer.from_pretrained(model_dir)
    bundle = calibrate(model, tok, calib_text, tokens=2048, progress=False, joint_heads=True)
    path = tmp_path_factory.mktemp("bundles") / "joint"
    bundle.save(path)
    return path


@pytest.fixture(scope="module")
def model_and_tok(model_dir):
    """kt-ref-a and its tokenizer, loaded once per test module (tests may switch its attention
    implementation, so modules do not share one)."""
    from kakeyaturbo.modeling import load_model

    return load_model(model_dir)


@pytest.fixture(scope="session")
def real_kv(model_dir, eval_text):
    """K (post- and pre-RoPE) and V of every layer of kt-ref-a over 1,024 tokens of
    WikiText-2: ``{"layer{i}.k" | ".k_pre_rope" | ".v": [kv_heads, 1024, 64] float32}``."""
    from kakeyaturbo.capture import capture_kv, read_tokens
    from kakeyaturbo.modeling import load_model

    model, tok = load_model(model_dir)
    ids = read_tokens(tok, eval_text, 1024, offset_chars=10_000)
    return capture_kv(model, ids)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return _require(SMOLLM2_GGUF)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf, tmp_path_factory):
    """SmolLM2-135M as a float32 Hugging Face folder: the GGUF converted once per session (about
    30 s) into a temporary kakeyaturbo cache, ``<cache>/models/<stem>-<sha256 prefix>``, removed
    at the end of the session (it holds 540 MB)."""
    import shutil

    from kakeyaturbo.modeling import resolve_model_dir

    cache = tmp_path_factory.mktemp("kakeyaturbo-cache")
    yield resolve_model_dir(smollm2_gguf, cache=cache)
    shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(scope="module")
def model(model_dir):
    """kt-ref-a as transformers loads it, in eval mode, once per test module (a module that
    defines its own ``model`` fixture uses that one)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="session")
def wikitext_ids(model_dir, eval_text):
    """``ids(start, stop)``: kt-ref-a's token ids ``[1, n]`` of WikiText-2 test's characters
    ``start..stop``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = eval_text.read_text(encoding="utf-8")
    return lambda start, stop: tok(text[start:stop], return_tensors="pt").input_ids
