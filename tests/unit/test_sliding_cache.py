"""``KakeyaCache(code_sliding=True)``: sliding-window layers hold their window as codec blocks
(``hf/sliding_layer.py``). On a tiny Gemma 3-style model whose window spans several blocks: at 8
bits the logits match a DynamicCache run, the window's bytes stay bounded however long the
sequence, block positions are the tokens' own, rolling back past what the window forgot is
refused, and saving is refused."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from tiny_archs import tiny_gemma3, token_ids
from transformers import DynamicCache

import kakeyaturbo as kt
from kakeyaturbo.hf import CACHE_ARG, KakeyaCache
from kakeyaturbo.hf.layer_plan import LayerKind
from kakeyaturbo.hf.sliding_layer import SlidingKakeyaLayer
from kakeyaturbo.recipes import SLIDING_EXTRA_BITS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]  # see conftest

WINDOW, BLOCK, RESIDUAL = 96, 32, 16
P8 = kt.CodecParams(
    allocation="waterfill", k=0, bits_per_value=8, block_size=BLOCK, pca_method="none"
)


def model():
    return tiny_gemma3(WINDOW)


def ids(rows: int, n: int) -> torch.Tensor:
    return token_ids(rows, n, seed=4)


def coded_cache(on=None, **kw) -> KakeyaCache:
    kw = {"k_params": P8, "v_params": P8, **kw}
    return KakeyaCache.from_model(
        model() if on is None else on,
        calibration=None,
        residual_length=RESIDUAL,
        code_sliding=True,
        **kw,
    )


@torch.inference_mode()
def teacher_forced(cache, x: torch.Tensor, prefix: int, m) -> torch.Tensor:
    """Prefill, a 40-token forward, then one token at a time: the continuation's logits."""
    m(x[:, :prefix], **{CACHE_ARG: cache}, use_cache=True)
    out = [m(x[:, prefix : prefix + 40], **{CACHE_ARG: cache}, use_cache=True).logits]
    for i in range(prefix + 40, x.shape[1]):
        out.append(m(x[:, i : i + 1], **{CACHE_ARG: cache}, use_cache=True).logits)
    return torch.cat(out, dim=1).float()


def sliding(cache) -> list[SlidingKakeyaLayer]:
    return [layer for layer in cache.layers if isinstance(layer, SlidingKakeyaLayer)]


def test_plan_and_window_bits():
    cache = coded_cache(k_params=None, v_params=None)
    kinds = [s.kind for s in cache.layer_plan]
    assert kinds == [LayerKind.SLIDING_COMPRESSED, LayerKind.COMPRESSED] * 2
    assert len(sliding(cache)) == 2 and sliding(cache)[0].sliding_window == WINDOW
    # The default recipe codes the windows SLIDING_EXTRA_BITS above the full layers.
    full, window = (cache.recipe.params(i, "v").bits_per_value for i in (1, 0))
    assert window == pytest.approx(full + SLIDING_EXTRA_BITS)
    skipped = KakeyaCache.from_model(model(), calibration=None, code_sliding=True, skip_layers=[0])
    assert skipped.layer_plan[0].kind is LayerKind.SLIDING
    assert type(skipped.layers[0]) is tf.cache_utils.DynamicSlidingWindowLayer
    with pytest.raises(TypeError, match="code_sliding"):
        KakeyaCache(model().config, code_sliding="yes")


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_near_lossless_matches_dynamic_cache(device):
    """Forgotten blocks are never needed and the mask's offset is right: at 8 bits the
    continuation's logits are DynamicCache's (a wrong offset gives top-1 ~20%). On a GPU the
    blocks are held there only, and forgetting takes them out of the device's runs."""
    m = model() if device == "cpu" else copy.deepcopy(model()).to(device)
    x = ids(2, 400).to(device)
    cache = coded_cache(on=m)
    got = teacher_forced(cache, x, 300, m)
    want = teacher_forced(DynamicCache(config=m.config), x, 300, m)
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    kl = (
        torch.nn.functional.kl_div(
            got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="batchmean"
        ).item()
        / got.shape[1]
    )
    assert agree >= 0.95 and kl < 1e-3, (agree, kl)
    for layer in sliding(cache):
        assert layer.get_seq_length() == 400 and layer.compressed_length > 0
        # Each block holds the positions of its own tokens (RoPE is undone and redone there).
        first = layer._offset
        for i, blk in enumerate(layer._blocks):
            want_pos = torch.arange(first + i * BLOCK, first + (i + 1) * BLOCK, dtype=torch.int32)
            assert torch.equal(blk.positions[0].cpu(), want_pos)
    if device == "cuda":
        assert all(layer._on_device is not None for layer in sliding(cache))


def test_window_bytes_stay_bounded():
    """However long the sequence, a coded window holds at most window + block - 2 tokens and its
    bytes stop growing, while full layers keep growing; its ratio counts only the window."""
    x = ids(1, 700)
    p3 = P8.replace(bits_per_value=3)
    cache = coded_cache(k_params=p3, v_params=p3)
    m, seen = model(), []
    with torch.inference_mode():
        m(x[:, :200], **{CACHE_ARG: cache}, use_cache=True)
        for i in range(200, 700):
            m(x[:, i : i + 1], **{CACHE_ARG: cache}, use_cache=True)
            for layer in sliding(cache):
                assert layer.get_seq_length() - layer._offset <= WINDOW + BLOCK - 2
            if i in (400, 699):
                seen.append(cache.memory_report()["layers"])
    for early, late in zip(*seen):
        if early["kind"] == LayerKind.SLIDING_COMPRESSED.value:
            assert late["tokens"] == 700 and late["compressed_bytes"] > 0
            assert late["total_bytes"] <= 1.2 * early["total_bytes"]
            # dense bytes: the window - 1 tokens transformers' own layer holds (fp32, 1 head)
            assert late["dense_bytes"] == (WINDOW - 1) * 2 * 256 * 4
        else:
            assert late["total_bytes"] > 1.3 * early["total_bytes"]


def test_crop_refused_past_the_window_unless_recording():
    """Right after a flush the window has forgotten what a rollback would need: crop is
    refused and changes nothing. With past recording (assisted decoding) nothing is forgotten
    until the crop, and after it the next token's logits are DynamicCache's."""
    x = ids(1, 380)
    cache = coded_cache()
    m = model()
    with torch.inference_mode():
        m(x[:, :300], **{CACHE_ARG: cache}, use_cache=True)
        layer = sliding(cache)[0]
        start = layer._offset
        assert start > 0
        with pytest.raises(RuntimeError, match="forgotten"):
            layer.crop(-3)
        assert layer.get_seq_length() == 300 and layer._offset == start
        cache.activate_past_recording()
        for i in range(300, 360):
            m(x[:, i : i + 1], **{CACHE_ARG: cache}, use_cache=True)
        assert layer._offset == start  # nothing forgotten while recording
        for each in cache.layers:
            each.crop(-10)
        assert layer.get_seq_length() == 350 and layer._offset > start
        got = m(x[:, 350:351], **{CACHE_ARG: cache}, use_cache=True).logits[0, -1]
        want = m(x[:, :351]).logits[0, -1]
    assert torch.allclose(got.log_softmax(-1), want.log_softmax(-1), atol=0.05)


def test_save_refused(tmp_path):
    cache = coded_cache()
    with torch.inference_mode():
        model()(ids(1, 200), **{CACHE_ARG: cache}, use_cache=True)
    with pytest.raises(NotImplementedError, match="sliding_compressed"):
        cache.save(tmp_path / "c.kt")
