"""Layer plans and end-to-end forwards on small randomly initialised Llama, Mistral, Qwen2/3 and
Gemma 2/3 models built locally: full-attention layers compress, sliding layers stay exactly as
transformers keeps them, unsupported models are refused clearly."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import transformers as tf
from transformers import AutoModelForCausalLM, DynamicCache

import kakeyaturbo as kt
from kakeyaturbo.hf import CACHE_ARG, KakeyaCache
from kakeyaturbo.hf.layer import KakeyaLayer
from kakeyaturbo.hf.layer_plan import LayerKind, build_layer_plan

# A tiny decoder: 4 query heads over 2 KV heads of 16 dimensions.
TINY = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)
TINY.update(hidden_size=64, intermediate_size=128, max_position_embeddings=512)
N_LAYERS = 4
WINDOW = 24


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest


def config(name: str):
    sliding = dict(sliding_window=WINDOW)
    qwen2 = dict(use_sliding_window=True, max_window_layers=2, **sliding)
    gemma3 = dict(layer_types=["sliding_attention", "full_attention"] * 2, **sliding)
    cls, extra = {
        "llama": (tf.LlamaConfig, {}),
        "mistral_full": (tf.MistralConfig, dict(sliding_window=None)),
        "mistral_sliding": (tf.MistralConfig, sliding),
        "qwen2": (tf.Qwen2Config, qwen2),
        "qwen3": (tf.Qwen3Config, {}),
        "gemma2": (tf.Gemma2Config, sliding),
        "gemma3": (tf.Gemma3TextConfig, gemma3),
    }[name]
    return cls(num_hidden_layers=N_LAYERS, **extra, **TINY)


EXPECTED = {
    "llama": ["compressed"] * 4,
    "mistral_full": ["compressed"] * 4,
    "mistral_sliding": ["sliding"] * 4,
    "qwen2": ["compressed", "compressed", "sliding", "sliding"],
    "qwen3": ["compressed"] * 4,
    "gemma2": ["sliding", "compressed"] * 2,
    "gemma3": ["sliding", "compressed"] * 2,
}

# Near-lossless 8-bit codec over 16-token blocks so a 100-token prompt streams several blocks.
P8 = dict(block_size=16, bit_width=8, k=0)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_layer_plan(name):
    plan = build_layer_plan(config(name))
    assert [spec.kind.value for spec in plan] == EXPECTED[name]
    for spec in plan:
        assert (spec.window == WINDOW) == (spec.kind is LayerKind.SLIDING)


def test_layer_plan_kv_sharing_and_skip():
    cfg = tf.Gemma3nTextConfig(
        num_hidden_layers=10, sliding_window=8, num_kv_shared_layers=4, **TINY
    )
    kinds = [spec.kind for spec in build_layer_plan(cfg, skip_layers=[4])]
    assert kinds[6:] == [LayerKind.SHARED] * 4
    assert kinds[4] is LayerKind.FULL_PRECISION  # the full-attention producer, skipped
    assert kinds[:4] == [LayerKind.SLIDING] * 4 and kinds[5] is LayerKind.SLIDING


@pytest.mark.parametrize("name", sorted(EXPECTED))
@torch.inference_mode()
def test_forward_matches_dynamic_cache(name):
    torch.manual_seed(0)
    cfg = config(name)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 100))
    p = kt.CodecParams(**P8)
    ctx = (
        pytest.warns(UserWarning, match="no compressible")
        if name == "mistral_sliding"
        else nullcontext()
    )
    with ctx:
        cache = KakeyaCache.from_model(
            model, k_params=p, v_params=p, residual_length=8, sink_tokens=2
        )
    dyn = DynamicCache(config=cfg)

    logits_k, logits_d = [], []
    for cache_, out in ((cache, logits_k), (dyn, logits_d)):
        out.append(model(ids[:, :90], **{CACHE_ARG: cache_}, use_cache=True).logits[:, -1])
        for i in range(90, 100):
            out.append(
                model(ids[:, i : i + 1], **{CACHE_ARG: cache_}, use_cache=True).logits[:, -1]
            )
    lk, ld = torch.stack(logits_k), torch.stack(logits_d)
    assert torch.isfinite(lk).all()
    torch.testing.assert_close(lk, ld, atol=0.05, rtol=0.05)

    rep = cache.memory_report()
    for spec, layer, lrep in zip(cache.layer_plan, cache.layers, rep["layers"]):
        if spec.kind is LayerKind.SLIDING:
            assert type(layer) is tf.cache_utils.DynamicSlidingWindowLayer
            assert lrep["compressed_bytes"] == 0
            assert layer.keys.shape[-2] == WINDOW - 1  # bounded exactly as transformers bounds it
        else:
            assert isinstance(layer, KakeyaLayer)
            assert lrep["compressed_tokens"] > 0
        assert cache.get_seq_length(spec.index) == dyn.get_seq_length(spec.index) == 100
    # Layer 0 sees identical inputs in both runs: a sliding layer 0 must hold identical bits.
    if cache.layer_plan[0].kind is LayerKind.SLIDING:
        assert torch.equal(cache.layers[0].keys, dyn.layers[0].keys)
        assert torch.equal(cache.layers[0].values, dyn.layers[0].values)


@torch.inference_mode()
def test_generate_gemma3_hybrid():
    torch.manual_seed(0)
    cfg = config("gemma3")
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 60))
    p = kt.CodecParams(**P8)
    cache = KakeyaCache.from_model(model, k_params=p, v_params=p, residual_length=8, pre_rope=True)
    out = model.generate(ids, **{CACHE_ARG: cache}, max_new_tokens=12, do_sample=False)
    ref = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert out.shape == ref.shape == (1, 72)
    assert (out == ref).float().mean().item() >= 0.9


def test_unsupported_models_are_refused():
    with pytest.raises(NotImplementedError, match="linear_attention"):
        KakeyaCache(tf.Qwen3NextConfig(num_hidden_layers=4, **TINY))
    with pytest.raises(NotImplementedError, match="encoder-decoder"):
        KakeyaCache(tf.T5Config())
    # A RoPE type whose inverse is not implemented, only in pre-RoPE mode.
    cfg = tf.LlamaConfig(
        num_hidden_layers=2,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        **TINY,
    )
    assert KakeyaCache(cfg).pre_rope is False  # the default falls back to post-RoPE
    with pytest.raises(NotImplementedError, match="yarn"):
        KakeyaCache(cfg, pre_rope=True)


@torch.inference_mode()
def test_bfloat16_model():
    torch.manual_seed(0)
    cfg = config("qwen3")
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 80))
    p = kt.CodecParams(**P8)
    cache = KakeyaCache.from_model(model, k_params=p, v_params=p, residual_length=8, pre_rope=True)
    got = model(ids, **{CACHE_ARG: cache}, use_cache=True).logits
    nxt = model(ids[:, -1:], **{CACHE_ARG: cache}, use_cache=True).logits
    assert got.dtype == nxt.dtype == torch.bfloat16 and torch.isfinite(nxt).all()
    ref_cache = DynamicCache(config=cfg)
    model(ids, **{CACHE_ARG: ref_cache}, use_cache=True)
    ref = model(ids[:, -1:], **{CACHE_ARG: ref_cache}, use_cache=True).logits
    torch.testing.assert_close(nxt.float(), ref.float(), atol=0.1, rtol=0.05)
    rep = cache.memory_report()
    assert rep["dense_bytes"] == rep["bf16_equivalent_bytes"] > 0
    assert cache.layers[0]._hot_k.dtype == torch.bfloat16


@torch.inference_mode()
def test_generate_gemma3n_kv_sharing():
    """KV-sharing consumers hold nothing (a placeholder on transformers >= 5.23, dropped from
    the cache before) and read the producer's decoded states."""
    torch.manual_seed(0)
    cfg = tf.Gemma3nTextConfig(
        num_hidden_layers=10,
        sliding_window=16,
        num_kv_shared_layers=4,
        vocab_size_per_layer_input=TINY["vocab_size"],
        hidden_size_per_layer_input=8,
        laurel_rank=4,
        altup_num_inputs=2,
        **TINY,
    )
    model = tf.Gemma3nForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 80))
    p = kt.CodecParams(**P8)
    cache = KakeyaCache.from_model(model, k_params=p, v_params=p, residual_length=8)
    out = model.generate(ids, **{CACHE_ARG: cache}, max_new_tokens=8, do_sample=False)
    ref = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert (out == ref).float().mean().item() >= 0.9
    rep = cache.memory_report()
    kinds = [layer["kind"] for layer in rep["layers"]]
    assert kinds[4] == "compressed" and rep["layers"][4]["compressed_tokens"] > 0
    assert all(k == "sliding" for i, k in enumerate(kinds) if i != 4 and i < 6)
    assert all(
        k == "shared" and r["total_bytes"] == 0 for k, r in zip(kinds[6:], rep["layers"][6:])
    )
