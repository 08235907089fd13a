"""``KakeyaCache`` on the tiny Gemma 3-style and Qwen3-style models of ``tiny_archs``: each layer
gets the cache layer its attention type calls for, generation runs, the memory report counts the
blocks, and at 8 bits per value the logits match a DynamicCache run (self-fitted frames and a
calibration alike)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from tiny_archs import ARCHS, BLOCK, P8, WINDOW, bundle, sliding_layers, tiny, token_ids
from transformers import DynamicCache

from kakeyaturbo.hf import CACHE_ARG, KakeyaCache
from kakeyaturbo.hf.layer import KakeyaLayer
from kakeyaturbo.hf.layer_plan import LayerKind
from kakeyaturbo.recipes import default_recipe

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]  # see conftest


def teacher_forced(model, cache, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """Prefill ``prefix`` tokens, then the rest in one forward and then one at a time; the
    continuation's logits [B, T - prefix, V]."""
    with torch.inference_mode():
        model(ids[:, :prefix], **{CACHE_ARG: cache}, use_cache=True)
        mid = prefix + (ids.shape[1] - prefix) // 2
        out = [model(ids[:, prefix:mid], **{CACHE_ARG: cache}, use_cache=True).logits]
        for i in range(mid, ids.shape[1]):
            out.append(model(ids[:, i : i + 1], **{CACHE_ARG: cache}, use_cache=True).logits)
    return torch.cat(out, dim=1).float()


def check_plan(cache: KakeyaCache, model) -> None:
    sliding = sliding_layers(model)
    kinds = [s.kind for s in cache.layer_plan]
    assert kinds == [LayerKind.SLIDING if i in sliding else LayerKind.COMPRESSED for i in range(4)]
    for spec, layer in zip(cache.layer_plan, cache.layers):
        if spec.kind is LayerKind.SLIDING:
            assert type(layer) is tf.cache_utils.DynamicSlidingWindowLayer
            assert spec.window == WINDOW
        else:
            assert isinstance(layer, KakeyaLayer)


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_generate_and_memory_report(arch):
    model = tiny(arch)
    recipe = default_recipe(block_size=BLOCK)
    cache = KakeyaCache.from_model(model, recipe=recipe, residual_length=64)
    assert cache.pre_rope  # each layer type's RoPE is invertible
    check_plan(cache, model)
    ids = token_ids(1, 320, seed=3)
    with torch.inference_mode():
        out = model.generate(ids, **{CACHE_ARG: cache}, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, 328) and torch.equal(out[:, :320], ids)
    rep = cache.memory_report()
    assert rep["compressed_bytes"] > 0 and rep["ratio"] > 1.0
    for spec, lrep in zip(cache.layer_plan, rep["layers"]):
        assert cache.get_seq_length(spec.index) == 327  # the last new token is never fed back
        if spec.kind is LayerKind.SLIDING:
            assert lrep["compressed_bytes"] == 0 and lrep["full_precision_bytes"] > 0
        else:
            assert lrep["compressed_tokens"] == 2 * BLOCK  # (327 - 64) // 128 blocks
            assert lrep["compressed_bytes"] > 0


@pytest.mark.parametrize("calibrated", [False, True], ids=["self-fitted", "calibrated"])
@pytest.mark.parametrize("arch", ARCHS)
def test_cache_near_lossless_matches_dynamic_cache(arch, calibrated, tmp_path):
    """At 8 bits per value, teacher-forced logits over a continuation match a DynamicCache
    run (prefill, a multi-token forward, then single-token steps over compressed blocks)."""
    model = tiny(arch)
    calibration = str(bundle(arch).save(tmp_path / "bundle")) if calibrated else None
    cache = KakeyaCache.from_model(
        model, calibration=calibration, k_params=P8, v_params=P8, residual_length=32
    )
    check_plan(cache, model)
    assert cache.pre_rope and (cache.calibration is not None) == calibrated
    ids = token_ids(2, 352, seed=4)
    got = teacher_forced(model, cache, ids, 320)
    want = teacher_forced(model, DynamicCache(config=model.config), ids, 320)
    assert torch.isfinite(got).all()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.95, agree
    kl = (
        torch.nn.functional.kl_div(
            got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="batchmean"
        ).item()
        / got.shape[1]
    )
    assert kl < 1e-3, kl
    rep = cache.memory_report()
    assert rep["compressed_bytes"] > 0
    assert all(
        lrep["compressed_tokens"] == 2 * BLOCK
        for spec, lrep in zip(cache.layer_plan, rep["layers"])
        if spec.kind is LayerKind.COMPRESSED
    )
