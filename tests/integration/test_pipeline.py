"""One pipeline: what the evaluation measures is what ``KakeyaCache`` stores.

The evaluation's bare ``kakeya`` method (and with a calibration bundle) and
``KakeyaCache.from_model(model)`` must store byte-identical encodings for the same prefix, on
the small reference model and on SmolLM2; plus the pipeline's own round-trip properties.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kakeyaturbo as kt
from kakeyaturbo.eval.harness import compress_stream
from kakeyaturbo.eval.registry import build_method
from kakeyaturbo.hf import CACHE_ARG, KakeyaCache
from kakeyaturbo.hf.rope import ModelRope
from kakeyaturbo.modeling import load_model, read_text, tokenize_text
from kakeyaturbo.pipeline import Pipeline
from kakeyaturbo.recipes import DEFAULT_BLOCK_SIZE, Recipe, default_recipe, waterfill_params

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# A prefix the cache compresses into exactly one whole block: (T - residual) == block_size.
PREFIX, RESIDUAL = 1000, 1000 - DEFAULT_BLOCK_SIZE


def _ids(tokenizer, eval_text) -> torch.Tensor:
    return tokenize_text(tokenizer, read_text(eval_text))[5_000 : 5_000 + PREFIX][None]


@torch.inference_mode()
def _cache_blocks(model, ids, calibration=None):
    # The default cache: its window holds values as int8 rows, but a prompt's blocks are coded
    # from the values the prompt brought, as the evaluation codes them.
    cache = KakeyaCache.from_model(model, residual_length=RESIDUAL, calibration=calibration)
    assert cache.int8_hot_values
    model(input_ids=ids, **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1)
    return cache


@torch.inference_mode()
def _eval_blocks(model, ids, spec):
    ref = DynamicCache(config=model.config)
    model(input_ids=ids, **{CACHE_ARG: ref}, use_cache=True, logits_to_keep=1)
    method = build_method(spec)
    method.recorded = {}
    rope = ModelRope(model.config) if method.options.pre_rope else None
    for li, layer in enumerate(ref.layers):
        compress_stream(method, layer.keys, li, "k", rope)
        compress_stream(method, layer.values, li, "v", rope)
    return method


def _assert_identical(cache, method):
    layers = [layer for layer in cache.layers if getattr(layer, "_blocks", None)]
    assert len(layers) == len(cache.layers)
    for li, layer in enumerate(layers):
        assert len(layer._blocks) == 1
        for stream in ("k", "v"):
            stored = getattr(layer._blocks[0], stream)
            (measured,) = method.recorded[(li, stream)][0]  # row 0: one block
            assert [e.to_bytes() for e in stored.encs] == [e.to_bytes() for e in measured.encs]
            if stored.norms is None:
                assert measured.norms is None
            else:
                assert torch.equal(stored.norms.codes, measured.norms.codes)
                assert torch.equal(stored.norms.bounds, measured.norms.bounds)
        # The frames both fitted are held once per layer by the cache and counted by the eval.
        assert cache._ctx.pipeline.frame_bytes(li) == (
            0 if cache.calibration is not None else 2 * 2 * layer._heads * 64 * 64
        )


def _assert_default_recipe_identical(model_dir, eval_text):
    """The default recipe (no bundle) on ``model_dir``: the same bytes in the eval and cache."""
    model, tok = load_model(model_dir)
    ids = _ids(tok, eval_text)
    _assert_identical(
        _cache_blocks(model, ids), _eval_blocks(model, ids, f"kakeya:residual_length={RESIDUAL}")
    )


@pytest.mark.slow
def test_eval_and_cache_store_identical_bytes_kt_ref_a(model_dir, eval_text):
    _assert_default_recipe_identical(model_dir, eval_text)


@pytest.mark.slow
@pytest.mark.parametrize("joint_heads", [False, True], ids=["per-head", "joint-heads"])
def test_eval_and_cache_store_identical_bytes_with_calibration(
    model_dir, eval_text, calib_text, tmp_path_factory, joint_heads
):
    from kakeyaturbo.calibration import calibrate

    model, tok = load_model(model_dir)
    bundle = tmp_path_factory.mktemp("calib") / "bundle"
    calib = calibrate(
        model, tok, calib_text, tokens=4096, ctx=512, progress=False, joint_heads=joint_heads
    )
    calib.save(bundle)
    ids = _ids(tok, eval_text)
    spec = f"kakeya:calibration={bundle},residual_length={RESIDUAL}"
    _assert_identical(_cache_blocks(model, ids, str(bundle)), _eval_blocks(model, ids, spec))


@pytest.mark.slow
def test_eval_and_cache_store_identical_bytes_smollm2(smollm2_dir, eval_text):
    _assert_default_recipe_identical(smollm2_dir, eval_text)


# ---- the pipeline alone ------------------------------------------------------------------


def _kv(b=2, h=3, t=700, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(3.0, 0.05, d)  # a decaying spectrum, as real K/V have
    x = torch.randn(b, h, t, d, generator=g) * scale
    # Per-token norms spread over two orders of magnitude (small-norm sink-like tokens).
    return x * torch.exp(torch.randn(b, h, t, 1, generator=g))


def test_roundtrip_shapes_bytes_and_relative_error():
    pipe = Pipeline(default_recipe())
    x = _kv()
    y, blocks = pipe.roundtrip(x, 0, "v")
    assert y.shape == x.shape and y.dtype == x.dtype
    assert DEFAULT_BLOCK_SIZE == 256
    assert [b.tokens for b in blocks] == [256, 256, 188]  # whole blocks, then the rest
    # Bytes: every serialized stream, a norm byte per (row, head, token) and two float16
    # bounds per (block, row, head), exactly.
    streams = sum(len(e.to_bytes()) for b in blocks for e in b.encs)
    assert sum(b.nbytes for b in blocks) == streams + 2 * 3 * 700 + 3 * 2 * 3 * 2 * 2
    assert pipe.frame_bytes() == pipe.frame_bytes(0) == 3 * 64 * 64 * 2
    # Token norms make the error relative per token: the smallest-norm tokens keep it too.
    rel = (y - x).norm(dim=-1) / x.norm(dim=-1)
    small = x.norm(dim=-1) < x.norm(dim=-1).quantile(0.05)
    assert rel.mean() < 0.25 and rel[small].mean() < 0.3


def test_token_norms_protect_small_tokens():
    x = _kv(seed=1)
    with_norms = Pipeline(default_recipe()).roundtrip(x, 0, "v")[0]
    without = Pipeline(default_recipe().replace(v_token_norms=False)).roundtrip(x, 0, "v")[0]
    small = x.norm(dim=-1) < x.norm(dim=-1).quantile(0.1)

    def rel(y):
        return ((y - x).norm(dim=-1) / x.norm(dim=-1))[small].mean()

    assert rel(with_norms) < 0.5 * rel(without)


def test_sinks_are_neutralised_and_written_back():
    x = _kv(b=1, t=512, seed=2)
    x[:, :, :4] *= 100  # huge sink vectors
    sinks = torch.zeros(1, 512, dtype=torch.bool)
    sinks[:, :4] = True
    y, _ = Pipeline(default_recipe()).roundtrip(x, 0, "k", sinks=sinks)
    assert torch.equal(y[:, :, :4], x[:, :, :4])
    # Coded as the block mean, the sinks did not spend the rest of the block's precision.
    y_raw, _ = Pipeline(default_recipe()).roundtrip(x, 0, "k")
    err = (y - x)[:, :, 4:].norm() / x[:, :, 4:].norm()
    err_raw = (y_raw - x)[:, :, 4:].norm() / x[:, :, 4:].norm()
    assert err < 0.9 * err_raw


def test_neutralising_replaces_each_sink_by_its_blocks_other_tokens_mean():
    from kakeyaturbo.pipeline import _neutralise

    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 2, 150, 8, generator=g)
    sinks = torch.zeros(3, 150, dtype=torch.bool)
    sinks[0, [0, 1, 3]] = True  # a prompt's sinks
    sinks[1, [70, 140, 149]] = True  # a padded row's, one in the shorter last block
    sinks[2, 64:128] = True  # a block of sinks only: their mean is of nothing, zero
    want = x.clone()
    for r, i in sinks.nonzero().tolist():
        lo = i - i % 64
        others = [j for j in range(lo, min(lo + 64, 150)) if not sinks[r, j]]
        want[r, :, i] = x[r, :, others].mean(1) if others else 0.0
    got = _neutralise(x, sinks, 64)
    assert torch.allclose(got, want, atol=1e-6)
    kept = ~sinks[:, None].expand(-1, 2, -1)
    assert torch.equal(got[kept], x[kept])  # every other token as it was
    assert _neutralise(x, torch.zeros_like(sinks), 64) is x  # no sinks: nothing made
    short = _neutralise(x[:, :, :40], sinks[:, :40], 64)  # a span shorter than a block
    assert torch.allclose(short[0, :, 0], x[0, :, [2, *range(4, 40)]].mean(1), atol=1e-6)


def test_pre_rope_keys_are_unrotated_and_rotated_back(model_dir):
    from transformers import AutoConfig

    rope = ModelRope(AutoConfig.from_pretrained(model_dir))
    x = _kv(b=1, h=2, t=256, seed=3)
    pos = torch.arange(100, 356, dtype=torch.int32)[None]
    rotated = rope(0).rotate(x, pos)
    hi = default_recipe().replace(k=waterfill_params(8.0))
    y, _ = Pipeline(hi, rope=rope).roundtrip(rotated, 0, "k", positions=pos)
    assert (y - rotated).norm() / rotated.norm() < 0.02
    # Without the positions the pipeline codes the keys as given (already pre-RoPE).
    y2, _ = Pipeline(hi, rope=rope).roundtrip(x, 0, "k")
    assert (y2 - x).norm() / x.norm() < 0.02


def test_per_layer_bits_move_bytes_between_layers():
    r = default_recipe().replace(k_layer_bits=(1.0, -1.0))
    assert r.params(0, "k").bits_per_value == r.k.bits_per_value + 1.0
    assert r.params(1, "k").bits_per_value == r.k.bits_per_value - 1.0
    assert r.params(1, "v").bits_per_value == r.v.bits_per_value
    pipe = Pipeline(r)
    x = _kv(b=1, seed=4)
    b0 = sum(b.nbytes for b in pipe.encode(x, 0, "k"))
    b1 = sum(b.nbytes for b in pipe.encode(x, 1, "k"))
    assert b0 > 1.5 * b1
    with pytest.raises(ValueError, match="k_layer_bits cover 2"):
        r.params(2, "k")


def test_recipe_and_pipeline_reject_bad_input():
    with pytest.raises(ValueError, match="must be equal"):
        Recipe(k=waterfill_params(2.0, 256), v=waterfill_params(2.0, 512))
    with pytest.raises(TypeError, match="Recipe"):
        Pipeline({"k": 3})  # type: ignore[arg-type]
    pipe = Pipeline(default_recipe())
    with pytest.raises(ValueError, match="batch, kv_heads, tokens, head_dim"):
        pipe.encode(torch.zeros(3, 64), 0, "k")
    with pytest.raises(ValueError, match="stream"):
        pipe.encode(torch.zeros(1, 1, 8, 64), 0, "q")
    x = torch.zeros(1, 1, 8, 64)
    x[0, 0, 3, 5] = float("nan")
    with pytest.raises(ValueError, match="layer 0 v"):
        pipe.encode(x, 0, "v")
    with pytest.raises(ValueError, match="need the model's RoPE"):
        pipe.encode(torch.ones(1, 1, 8, 64), 0, "k", positions=torch.zeros(1, 8, dtype=torch.int32))
    assert isinstance(default_recipe().k, kt.CodecParams)
    # Norms near 8e4, beyond float16, where norms are stored (spread over many directions:
    # a stream dominated by one is coded without token norms)
    big = 1e4 * torch.randn(1, 1, 8, 64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="exceeds float16"):
        pipe.encode(big, 0, "v")
    assert pipe.encode(big, 0, "k")  # keys carry no token norms by default


def test_newest_tokens_get_their_own_blocks_only_when_they_get_more_bits():
    x = _kv(b=1, t=600, seed=5)
    blocks = Pipeline(default_recipe()).encode(x, 0, "v", newer=0)
    assert [b.tokens for b in blocks] == [256, 256, 24, 64]  # the newest 64 apart, at +3 bits
    flat = default_recipe().replace(recent_bits=0.0)
    assert [b.tokens for b in Pipeline(flat).encode(x, 0, "v", newer=0)] == [256, 256, 88]
