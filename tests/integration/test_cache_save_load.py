"""KakeyaCache.save / KakeyaCache.load: a loaded cache continues exactly as the original
(same greedy tokens, same logits), in this process on kt-ref-a and in a fresh process on
SmolLM2; damaged files and files of another model or settings are refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from kakeyaturbo.eval.outlier_channels import with_outlier_channels
from kakeyaturbo.hf import CACHE_ARG, CacheFileError, CacheMismatchError, KakeyaCache, KakeyaOptions
from kakeyaturbo.hf.cache_file import CACHE_FILE_VERSION
from kakeyaturbo.modeling import load_model, read_text, tokenize_text
from kakeyaturbo.recipes import default_recipe

# Small blocks and window on kt-ref-a: a 200-token prefix holds several blocks, and the
# continuation flushes more after the load.
SMALL = {"recipe": default_recipe(None, 32), "residual_length": 16}
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def prompt(model_and_tok, eval_text):
    tok = model_and_tok[1]
    return torch.as_tensor(tokenize_text(tok, read_text(eval_text))[1000:1200])[None].clone()


def _prefill(model, ids, **kwargs):
    cache = KakeyaCache.from_model(model, **kwargs)
    with torch.no_grad():
        model(ids[:, :-1], **{CACHE_ARG: cache})
    return cache


def _generate(model, ids, cache):
    out = model.generate(
        ids,
        **{CACHE_ARG: cache},
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        min_new_tokens=NEW_TOKENS,
    )
    return out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def saved(model_and_tok, prompt, tmp_path_factory, one_torch_thread):
    model = model_and_tok[0]
    cache = _prefill(model, prompt, **SMALL)
    path = tmp_path_factory.mktemp("cache") / "prefix.kt"
    size = cache.save(path)
    assert size == path.stat().st_size
    return cache, path


def test_loaded_cache_generates_the_same_tokens(model_and_tok, prompt, saved):
    model = model_and_tok[0]
    cache, path = saved
    loaded = KakeyaCache.load(path, model, **SMALL)
    assert loaded.get_seq_length() == cache.get_seq_length() == prompt.shape[1] - 1
    before = [len(layer._blocks) for layer in loaded.layers]
    assert min(before) >= 4  # blocks are coded in the saved prefix
    report = cache.memory_report()
    assert loaded.memory_report()["compressed_bytes"] == report["compressed_bytes"]
    original = _generate(model, prompt, cache)
    assert _generate(model, prompt, loaded) == original
    # The continuation flushed new blocks, coded in the loaded (self-fitted) frames.
    assert all(len(layer._blocks) > b for layer, b in zip(loaded.layers, before))


def test_loaded_cache_gives_identical_logits(model_and_tok, prompt, saved):
    model = model_and_tok[0]
    _, path = saved
    a, b = (KakeyaCache.load(path, model, **SMALL) for _ in range(2))
    fresh = _prefill(model, prompt, **SMALL)
    step = prompt[:, -1:]
    with torch.no_grad():
        logits = [model(step, **{CACHE_ARG: c}).logits for c in (a, b, fresh)]
    assert torch.equal(logits[0], logits[2])
    assert torch.equal(logits[1], logits[2])


def test_values_coded_without_token_norms_load_and_continue(model_and_tok, prompt, tmp_path):
    """A layer whose values are dominated by one channel is coded without token norms (the
    others with them): its file loads, continues as the original does, and the blocks coded
    after the load keep the layer's choice."""
    skewed = with_outlier_channels(model_and_tok[0], layers=[1])
    cache = _prefill(skewed, prompt, **SMALL)
    assert [layer._blocks[0].v.norms is None for layer in cache.layers[:3]] == [False, True, False]
    path = tmp_path / "skewed.kt"
    cache.save(path)
    loaded = KakeyaCache.load(path, skewed, **SMALL)
    before = len(loaded.layers[1]._blocks)
    assert _generate(skewed, prompt, loaded) == _generate(skewed, prompt, cache)
    assert len(loaded.layers[1]._blocks) > before
    assert all(blk.v.norms is None for blk in loaded.layers[1]._blocks)


def _flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x10
    return bytes(b)


@pytest.mark.parametrize("where", ["length", "header", "middle", "last"])
def test_bit_flip_is_refused(model_and_tok, saved, tmp_path, where):
    data = saved[1].read_bytes()
    at = {"length": 2, "header": 40, "middle": len(data) // 2, "last": len(data) - 1}[where]
    bad = tmp_path / "flipped.kt"
    bad.write_bytes(_flip(data, at))
    with pytest.raises(CacheFileError):
        KakeyaCache.load(bad, model_and_tok[0], **SMALL)


@pytest.mark.parametrize("keep", [0, 7, 100, "half", -1])
def test_truncated_file_is_refused(model_and_tok, saved, tmp_path, keep):
    data = saved[1].read_bytes()
    n = {"half": len(data) // 2, -1: len(data) - 1}.get(keep, keep)
    bad = tmp_path / "short.kt"
    bad.write_bytes(data[:n])
    with pytest.raises(CacheFileError, match="truncated|damaged|not a kakeyaturbo"):
        KakeyaCache.load(bad, model_and_tok[0], **SMALL)


def test_other_version_and_foreign_files_are_refused(model_and_tok, saved, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(saved[1], "pt") as f:
        meta = dict(f.metadata())
    future = tmp_path / "future.kt"
    save_file(
        load_file(saved[1]), future, metadata={**meta, "version": str(CACHE_FILE_VERSION + 1)}
    )
    with pytest.raises(CacheFileError, match=f"version '{CACHE_FILE_VERSION + 1}'"):
        KakeyaCache.load(future, model_and_tok[0], **SMALL)
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(3)}, plain)
    with pytest.raises(CacheFileError, match="not a kakeyaturbo cache"):
        KakeyaCache.load(plain, model_and_tok[0], **SMALL)
    with pytest.raises(CacheFileError, match="cannot read"):
        KakeyaCache.load(tmp_path / "missing.kt", model_and_tok[0], **SMALL)


def test_other_settings_are_named(model_and_tok, saved):
    model, path = model_and_tok[0], saved[1]
    with pytest.raises(CacheMismatchError, match="residual_length: file 16, here 128"):
        KakeyaCache.load(path, model, recipe=SMALL["recipe"])
    with pytest.raises(CacheMismatchError, match="recipe.k.bits_per_value"):
        KakeyaCache.load(
            path,
            model,
            **{
                **SMALL,
                "recipe": SMALL["recipe"].replace(k=SMALL["recipe"].k.replace(bits_per_value=2.0)),
            },
        )
    with pytest.raises(CacheMismatchError, match="options.decoded_cache_bytes"):
        KakeyaCache.load(path, model, **SMALL, options=KakeyaOptions(decoded_cache_bytes=1 << 20))
    with pytest.raises(CacheMismatchError, match="int8_hot_values"):
        KakeyaCache.load(path, model, **SMALL, int8_hot_values=False)


def test_another_model_is_named(model_dir, saved):
    other = load_model(model_dir)[0]
    with torch.no_grad():
        other.model.layers[3].mlp.up_proj.weight.mul_(1.01)
    with pytest.raises(CacheMismatchError, match="weights_sha256"):
        KakeyaCache.load(saved[1], other, **SMALL)
    half = load_model(model_dir)[0].to(torch.bfloat16)
    with pytest.raises(CacheMismatchError, match="dtype"):
        KakeyaCache.load(saved[1], half, **SMALL)


# ---- SmolLM2, continued in a fresh process ------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    torch.set_num_threads(1)
    from kakeyaturbo.hf import CACHE_ARG, KakeyaCache
    from kakeyaturbo.modeling import load_model
    model_dir, path, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    model = load_model(model_dir)[0]
    cache = KakeyaCache.load(path, model)
    ids = torch.tensor([ids])
    out = model.generate(ids, **{CACHE_ARG: cache}, max_new_tokens=%d, min_new_tokens=%d,
                         do_sample=False)
    print(json.dumps(out[0, ids.shape[1]:].tolist()))
    """
).replace("%d", str(NEW_TOKENS))


@pytest.mark.slow
def test_smollm2_fresh_process_continues_identically(smollm2_dir, eval_text, tmp_path):
    from safetensors.torch import save_file
    from transformers import DynamicCache

    model, tok = load_model(smollm2_dir)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # 630 tokens with 256-token blocks and a 128-token window: one block coded in the
        # prefix, the next flushed while the continuation runs.
        ids = torch.as_tensor(tokenize_text(tok, read_text(eval_text))[2000:2630])[None].clone()
        cache = _prefill(model, ids)
        path = tmp_path / "smollm2.kt"
        size = cache.save(path)
        dense = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :-1], **{CACHE_ARG: dense})
        tensors = {}
        for i, layer in enumerate(dense.layers):
            tensors[f"{i}.k"], tensors[f"{i}.v"] = (
                layer.keys.contiguous(),
                layer.values.contiguous(),
            )
        save_file(tensors, tmp_path / "dense.safetensors")
        dense_size = (tmp_path / "dense.safetensors").stat().st_size
        print(
            f"\nprefix {ids.shape[1] - 1} tokens: kakeya file {size} B, DynamicCache "
            f"safetensors {dense_size} B ({dense_size / size:.2f}x)"
        )
        assert all(len(layer._blocks) == 1 for layer in cache.layers)
        assert size < dense_size
        original = _generate(model, ids, cache)
        assert all(len(layer._blocks) == 2 for layer in cache.layers)
    finally:
        torch.set_num_threads(n)
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(smollm2_dir), str(path), json.dumps(ids[0].tolist())],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert json.loads(child.stdout.strip().splitlines()[-1]) == original


def test_bundle_and_skipped_layer_round_trip(model_and_tok, prompt, joint_bundle, tmp_path):
    """Joint-heads streams (one per row), a calibration's identity and a full-precision layer."""
    model = model_and_tok[0]
    kw = {"calibration": joint_bundle, "skip_layers": [2], "residual_length": 16}
    kw["recipe"] = default_recipe(True, 32).replace(joint_heads="kv")
    cache = _prefill(model, prompt, **kw)
    path = tmp_path / "bundle.kt"
    cache.save(path)
    without = {k: v for k, v in kw.items() if k != "calibration"}
    with pytest.raises(CacheMismatchError, match="calibration"):
        KakeyaCache.load(path, model, **{**without, "recipe": kw["recipe"].replace(joint_heads="")})
    loaded = KakeyaCache.load(path, model, **kw)
    assert loaded.layers[2].keys.shape == cache.layers[2].keys.shape
    assert _generate(model, prompt, loaded) == _generate(model, prompt, cache)
