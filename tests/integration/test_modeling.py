"""Model loading: Hugging Face folders, and GGUF files converted once into the model cache."""

from __future__ import annotations

import json

import pytest
import torch

from kakeyaturbo import modeling
from kakeyaturbo.modeling import cache_dir, find_gguf, kv_geometry, load_model, resolve_model_dir

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@pytest.fixture
def fake_converter(monkeypatch):
    """Replaces the 30 s dequantisation by a stub that writes a config and counts its calls."""
    calls = []

    def convert(gguf, out):
        calls.append(gguf)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(modeling, "_convert_gguf", convert)
    return calls


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KAKEYATURBO_CACHE", str(tmp_path / "kt"))
    assert cache_dir() == tmp_path / "kt"
    monkeypatch.delenv("KAKEYATURBO_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "kakeyaturbo"


def test_find_gguf_tells_folders_from_gguf_files(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "extra.gguf").write_bytes(b"GGUF")
    assert find_gguf(hf) is None  # a config.json wins: a Hugging Face folder
    assert resolve_model_dir(hf) == hf
    one = tmp_path / "one"
    one.mkdir()
    (one / "m.gguf").write_bytes(b"GGUF")
    assert find_gguf(one) == one / "m.gguf" == find_gguf(one / "m.gguf")
    (one / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match="2 .gguf files"):
        find_gguf(one)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        find_gguf(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such"):
        find_gguf(tmp_path / "absent")
    with pytest.raises(ValueError, match=".gguf"):
        find_gguf(hf / "config.json")


def test_a_gguf_is_converted_once_per_content(tmp_path, fake_converter):
    gguf = tmp_path / "src" / "tiny.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF v1")
    first = resolve_model_dir(gguf, cache=tmp_path / "cache")
    assert first.parent == tmp_path / "cache" / "models"
    assert first.name.startswith("tiny-") and len(first.name) == len("tiny-") + 12
    assert resolve_model_dir(gguf.parent, cache=tmp_path / "cache") == first
    assert len(fake_converter) == 1
    source = json.loads((first / "kakeyaturbo-source.json").read_text())
    assert source["sha256"].startswith(first.name[-12:])
    gguf.write_bytes(b"GGUF v2")  # new content, new conversion
    second = resolve_model_dir(gguf, cache=tmp_path / "cache")
    assert second != first and len(fake_converter) == 2


def test_an_interrupted_conversion_leaves_no_folder(tmp_path, monkeypatch):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")

    def killed(gguf, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(modeling, "_convert_gguf", killed)
    with pytest.raises(KeyboardInterrupt):
        resolve_model_dir(gguf, cache=tmp_path / "cache")
    assert list((tmp_path / "cache" / "models").iterdir()) == []


@pytest.mark.slow
def test_smollm2_loads_from_its_gguf_file_and_folder(smollm2_gguf, smollm2_dir, monkeypatch):
    cache = smollm2_dir.parents[1]
    assert smollm2_dir == cache / "models" / f"SmolLM2-135M-Instruct.Q4_1-{SMOLLM2_SHA256[:12]}"
    assert [p.name for p in smollm2_dir.parent.iterdir()] == [smollm2_dir.name]  # no leftovers
    assert "quantization_config" not in json.loads((smollm2_dir / "config.json").read_text())
    assert (smollm2_dir / "tokenizer.json").is_file()

    # Both spellings of the model load the conversion the session fixture made: no second one.
    def convert_again(gguf, out):
        raise AssertionError(f"converted {gguf} again")

    monkeypatch.setattr(modeling, "_convert_gguf", convert_again)
    monkeypatch.setenv("KAKEYATURBO_CACHE", str(cache))
    for path in (smollm2_gguf, smollm2_gguf.parent):
        model, tok = load_model(path)
        geo = kv_geometry(model.config)
        assert (geo.num_layers, geo.kv_heads, geo.head_dim) == (30, 3, 64)
    assert next(model.parameters()).dtype == torch.float32

    # Real weights: finite logits, and the model copies a passage it has just read.
    passage = (
        "The lighthouse keeper walked down to the harbour every morning, counted the boats that "
        "had come in overnight and wrote their names in a green ledger kept under the stairs."
    )
    ids = tok(passage + " " + passage, return_tensors="pt").input_ids
    half = len(tok(passage)["input_ids"])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]
    assert torch.isfinite(logits).all()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
    assert nll[half + 2 :].mean() < 0.25 * nll[1:half].mean()
