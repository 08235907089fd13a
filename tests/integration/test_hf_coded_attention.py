"""Attention over the codes (``hf/coded_attention.py``, the "kakeya" attention) computes what
decoding every block into dense K/V computes: the same codes, another order of operations.

What would catch real bugs: a wrong frame (transposed, another head's), RoPE at the wrong
positions, the sinks read from their coded slots or counted twice, padding masks shifted by the
exact part's new layout, grouped query heads mapped to the wrong KV head, token norms applied
twice, a forward whose flush adds blocks the attention then reads. Each comparison runs the real
model with ``coded_attention=False`` (decode every block, transformers' sdpa) against the
default, checks that the coded path really ran, and compares every forward's logits.
"""

from __future__ import annotations

import pytest
import torch

kt = pytest.importorskip("kakeyaturbo")
pytest.importorskip("kakeyaturbo.hf")
from transformers import DynamicCache  # noqa: E402

from kakeyaturbo.eval.outlier_channels import with_outlier_channels  # noqa: E402
from kakeyaturbo.hf import CACHE_ARG, KakeyaCache, KakeyaOptions  # noqa: E402
from kakeyaturbo.hf.coded_attention import CodedView  # noqa: E402
from kakeyaturbo.modeling import kv_geometry, load_model  # noqa: E402
from kakeyaturbo.recipes import default_recipe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest


@pytest.fixture(scope="module")
def model(model_dir):
    # Its own copy: from_model switches the model's attention implementation.
    return load_model(model_dir)[0]


@pytest.fixture(params=["kernels", "kernel-sums", "torch"])
def cpu_path(request, monkeypatch):
    """Every way attention over the codes computes: the codec's kernels (the CPU default; the
    whole attention in one call for few query rows, the logits and the value sums around a
    torch softmax for more), the latter for every query length, and torch ops over decoded
    frame coordinates (what other devices run)."""
    import kakeyaturbo.hf.coded_attention as coded_attention

    path = request.param
    monkeypatch.setattr(coded_attention, "CPU_KERNELS", path != "torch")
    if path == "kernel-sums":
        monkeypatch.setattr(coded_attention, "WHOLE_ATTENTION_ROWS", 0)
    calls = kernel_calls(monkeypatch)
    yield path
    # The path asked for is the one that ran (the whole attention: at least in decode steps).
    want = {"kernels": "attend", "kernel-sums": "key_logits", "torch": None}[path]
    assert (want in calls) if want else not calls
    if path == "kernel-sums":
        assert set(calls) == {"key_logits", "value_sums"}


def kernel_calls(monkeypatch) -> list[str]:
    """The names of the codec's attention calls made from now on (the real methods, counted)."""
    from kakeyaturbo.pipeline import Pipeline

    calls: list[str] = []
    for name in ("attend", "key_logits", "value_sums"):
        real = getattr(Pipeline, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(Pipeline, name, counted)
    return calls


@pytest.fixture
def attend_calls(monkeypatch):
    """How many times the coded path ran (the real method, counted)."""
    calls = []
    real = CodedView.attend

    def counted(self, *args, **kwargs):
        calls.append(self.coded_length)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CodedView, "attend", counted)
    return calls


def padded_batch(vocab: int, n: int = 700, pad: int = 37):
    """Two rows, the second left-padded: its sinks sit at other slots than the first's."""
    ids = torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, :pad] = 0
    return ids, mask


@torch.inference_mode()
def forwards(model, cache, ids, mask, prefill: int, chunk: int = 25, steps: int = 3):
    """Logits of a prefill, multi-token forwards over compressed blocks, then single steps."""
    out = [model(ids[:, :prefill], attention_mask=mask[:, :prefill], **{CACHE_ARG: cache})]
    t = prefill
    while t + chunk <= ids.shape[1] - steps:
        out.append(
            model(ids[:, t : t + chunk], attention_mask=mask[:, : t + chunk], **{CACHE_ARG: cache})
        )
        t += chunk
    for _ in range(steps):
        out.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], **{CACHE_ARG: cache}))
        t += 1
    return [o.logits for o in out]


def compare(model, ids, mask, prefill, attend_calls, tol=1e-4, **kw):
    """The logits of every forward with the coded attention against decoding every block, with
    the codec's arithmetic in float32 (the bfloat16 frame product has its own test)."""
    dense = forwards(
        model, KakeyaCache.from_model(model, coded_attention=False, **kw), ids, mask, prefill
    )
    assert not attend_calls
    cache = KakeyaCache.from_model(
        model, **{"options": KakeyaOptions(attention_precision="float32"), **kw}
    )
    assert model.config._attn_implementation == "kakeya"
    coded = forwards(model, cache, ids, mask, prefill)
    assert attend_calls and min(attend_calls) > 0  # every forward after the prefill read codes
    for a, b in zip(dense, coded):
        torch.testing.assert_close(b, a, rtol=tol, atol=tol)
    return cache


# 64-token blocks: the prefill leaves 8 blocks and 88 hot tokens, and a later multi-token
# forward flushes a block while its attention reads the blocks held before it.
RECIPE = default_recipe(block_size=64)


@pytest.mark.parametrize(
    "kw",
    [
        {"recipe": RECIPE},
        {"recipe": RECIPE, "pre_rope": False},
        {"recipe": RECIPE.replace(k_token_norms=True)},
        {"recipe": RECIPE, "sink_tokens": 0},
        {"recipe": RECIPE, "hot_dtype": torch.bfloat16},
        {"recipe": RECIPE, "int8_hot_values": False},
    ],
    ids=["default", "post-rope", "key-norms", "no-sinks", "bf16-hot", "exact-hot-values"],
)
def test_coded_attention_matches_decoding(model, attend_calls, cpu_path, kw):
    ids, mask = padded_batch(model.config.vocab_size)
    # The hot window's int8 values (the default) or a bfloat16 window round each new token: a
    # 1e-6 difference between the two paths' hidden states can flip a rounding (4e-3
    # relative), so the later logits drift more apart: up to 1.1e-3 on an AVX-512 machine, whose
    # torch kernels round otherwise than AVX2's (a wrong coded path moves them by 1e-2 and more).
    exact = kw.get("hot_dtype") is not torch.bfloat16 and kw.get("int8_hot_values") is False
    tol = 1e-4 if exact else 2e-3
    cache = compare(model, ids, mask, 600, attend_calls, tol, residual_length=64, **kw)
    assert cache.layers[0].compressed_length == 576 and cache.get_seq_length() == 678
    assert set(attend_calls) == {512, 576}


def test_coded_attention_over_values_coded_without_token_norms(model, attend_calls, cpu_path):
    """Values of one layer put nearly all their energy in one channel (100x the others): that
    layer's values are coded without token norms, other layers' with them, and the coded
    attention still computes what decoding computes."""
    skewed = with_outlier_channels(model, layers=[1])
    ids, mask = padded_batch(model.config.vocab_size)
    cache = compare(skewed, ids, mask, 600, attend_calls, 2e-3, residual_length=64, recipe=RECIPE)
    normed = [
        (layer._on_device["v"].norms if layer._on_device else layer._blocks[0].v.norms) is not None
        for layer in cache.layers
    ]
    assert not normed[1] and any(normed), normed


@pytest.mark.parametrize(
    ("precision", "native", "share"),
    # Measured: int16 0.004-0.013, bfloat16 0.05-0.10 of the codec's RMS movement.
    [("int16", kt.codec.int16_products, 0.03), ("bfloat16", kt.codec.bf16_products, 0.15)],
)
def test_narrow_frame_products_move_logits_far_less_than_the_codec(
    model, attend_calls, precision, native, share
):
    """``attention_precision="int16"`` (the default) or ``"bfloat16"`` narrows the key frame
    product's inputs where the CPU multiplies them natively: every forward's logits then move
    (RMS) by a small fraction of what the codec itself moves them against DynamicCache, and not
    at all on a CPU without it. Anything else is refused by name."""
    ids, mask = padded_batch(model.config.vocab_size)
    kw = {"recipe": RECIPE, "residual_length": 64}
    exact = forwards(model, DynamicCache(), ids, mask, 600)
    full_cache = KakeyaCache.from_model(
        model, options=KakeyaOptions(attention_precision="float32"), **kw
    )
    full = forwards(model, full_cache, ids, mask, 600)
    cache = KakeyaCache.from_model(
        model, options=KakeyaOptions(attention_precision=precision), **kw
    )
    assert KakeyaCache(model.config).attention_precision == "int16"
    narrow = forwards(model, cache, ids, mask, 600)
    assert attend_calls
    head_dim = kv_geometry(model.config).head_dim
    for e, f, r in list(zip(exact, full, narrow))[1:]:  # the prefill reads no codes
        if not native(head_dim):
            assert torch.equal(r, f)
            continue
        rms = [float((a - b).pow(2).mean().sqrt()) for a, b in ((r, f), (f, e))]
        assert 0 < rms[0] <= share * rms[1], rms
    with pytest.raises(ValueError, match="attention_precision"):
        KakeyaOptions(attention_precision="float16")
    with pytest.raises(TypeError, match="attention_precision"):
        KakeyaOptions(attention_precision=torch.bfloat16)


@pytest.fixture(scope="module")
def joint_calibration(model, model_dir, calib_text):
    from transformers import AutoTokenizer

    from kakeyaturbo.calibration import calibrate

    tok = AutoTokenizer.from_pretrained(model_dir)
    return calibrate(model, tok, calib_text, tokens=4096, progress=False, joint_heads=True)


@pytest.mark.parametrize(
    ("joint", "key_norms"),
    [("kv", False), ("kv", True), ("k", False), ("v", False)],
    ids=["default", "key-norms", "keys-only", "values-only"],
)
@pytest.mark.parametrize("path", ["kernels", "kernel-sums", "torch"])
def test_coded_attention_across_heads_matches_decoding(
    model, attend_calls, joint_calibration, monkeypatch, path, joint, key_norms
):
    """Blocks coded across heads (one stream of H*D per row, per-head scales): the virtual
    wide head of the kernels (RoPE pairs regrouped, zero-padded queries, scales folded into
    the weights; the whole attention in one call for a decode step's rows when both streams
    are coded across heads, each head's exact part and value frame in it), the kernels'
    sums around a torch softmax, or the decoded keys and values off the CPU, against decoding
    every block; one stream across heads beside the other per head, too."""
    import kakeyaturbo.hf.coded_attention as coded_attention

    monkeypatch.setattr(coded_attention, "CPU_KERNELS", path != "torch")
    if path == "kernel-sums":
        monkeypatch.setattr(coded_attention, "WHOLE_ATTENTION_ROWS", 0)
    calls = kernel_calls(monkeypatch)
    recipe = default_recipe(joint_calibration, block_size=64)
    assert recipe.joint_heads == "kv"
    recipe = recipe.replace(k_token_norms=key_norms, joint_heads=joint)
    ids, mask = padded_batch(model.config.vocab_size)
    kw = {"recipe": recipe, "calibration": joint_calibration, "residual_length": 64}
    # The window's int8 values: the tolerance of test_coded_attention_matches_decoding.
    cache = compare(model, ids, mask, 600, attend_calls, 5e-4, **kw)
    heads, layer = model.config.num_key_value_heads, cache.layers[0]
    # Off the CPU kernels the layer holds its blocks on the model's device only.
    assert (layer._on_device is not None) == (path == "torch")
    for stream in ("k", "v"):  # one stream per row across heads, else per head
        if layer._on_device is not None:
            streams = {layer._on_device[stream].streams}
        else:
            streams = {len(getattr(blk, stream).encs) for blk in layer._blocks}
        assert streams == {2 if stream in joint else 2 * heads}
    sums = {"key_logits", "value_sums"}
    if path == "kernels" and joint == "kv":  # the whole attention: at least in decode steps
        assert "attend" in calls and set(calls) <= sums | {"attend"}
    else:
        assert set(calls) == (set() if path == "torch" else sums)


def test_generate_is_unchanged(model):
    ids, mask = padded_batch(model.config.vocab_size, n=650)
    runs = []
    for coded in (False, True):
        # Exact hot values: a 1e-6 difference between the paths can flip an int8 rounding;
        # the codec's arithmetic in float32, as in `compare`.
        cache = KakeyaCache.from_model(
            model,
            coded_attention=coded,
            residual_length=64,
            int8_hot_values=False,
            options=KakeyaOptions(attention_precision="float32"),
        )
        with torch.inference_mode():
            runs.append(
                model.generate(
                    ids,
                    attention_mask=mask,
                    **{CACHE_ARG: cache},
                    max_new_tokens=12,
                    do_sample=False,
                    output_scores=True,
                    return_dict_in_generate=True,
                )
            )
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    for a, b in zip(runs[0].scores, runs[1].scores):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_switched_model_is_sdpa_for_other_caches(model):
    ids = torch.randint(0, model.config.vocab_size, (1, 300))
    KakeyaCache.from_model(model)
    assert model.config._attn_implementation == "kakeya"
    switched = model(ids, **{CACHE_ARG: DynamicCache(config=model.config)}).logits
    model.set_attn_implementation("sdpa")
    try:
        plain = model(ids, **{CACHE_ARG: DynamicCache(config=model.config)}).logits
    finally:
        model.set_attn_implementation("kakeya")
    torch.testing.assert_close(switched, plain, rtol=0, atol=0)


def test_coded_attention_needs_sdpa(model_dir):
    eager = load_model(model_dir, attn="eager")[0]
    with pytest.raises(ValueError, match="coded_attention=True needs a model using 'sdpa'"):
        KakeyaCache.from_model(eager, coded_attention=True)
    KakeyaCache.from_model(eager)  # the default leaves it alone: the dense path
    assert eager.config._attn_implementation == "eager"
    KakeyaCache.from_model(model := load_model(model_dir)[0], coded_attention=False)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.slow
@pytest.mark.parametrize("calibrated", [False, True], ids=["self-fitted", "calibrated"])
@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_coded_attention_other_architectures(arch, calibrated, attend_calls, cpu_path, tmp_path):
    """Gemma 3 (sliding layers stay sdpa, head_dim 256, one KV head, its own query scaling)
    and Qwen3 (q/k norms before RoPE), with self-fitted and calibrated frames."""
    from tiny_archs import BLOCK, bundle, tiny

    model = tiny(arch)
    calibration = str(bundle(arch).save(tmp_path / "bundle")) if calibrated else None
    ids, mask = padded_batch(model.config.vocab_size, n=360, pad=5)
    p = kt.CodecParams(
        allocation="waterfill", k=0, bits_per_value=3, block_size=BLOCK, pca_method="none"
    )
    compare(
        model,
        ids,
        mask,
        300,
        attend_calls,
        calibration=calibration,
        k_params=p,
        v_params=p,
        residual_length=32,
    )


@torch.inference_mode()
def test_crop_into_blocks_after_coded_steps_matches_decoding(model, attend_calls):
    """A forward over the codes keeps the layer's blocks as attention reads them; cropping into
    the blocks must drop that, or the next forward reads blocks that are gone."""
    ids, mask = padded_batch(model.config.vocab_size)
    kw = {
        "recipe": RECIPE,
        "residual_length": 64,
        "options": KakeyaOptions(attention_precision="float32"),
    }
    runs = []
    for coded in (False, True):
        cache = KakeyaCache.from_model(model, coded_attention=coded, **kw)
        model(ids[:, :600], attention_mask=mask[:, :600], **{CACHE_ARG: cache})
        model(ids[:, 600:601], attention_mask=mask[:, :601], **{CACHE_ARG: cache})
        cache.crop(-(601 - 450))  # into block 7 (slots 448..511): two of its tokens back hot
        assert cache.layers[0].compressed_length == 448
        runs.append(
            [
                model(
                    ids[:, t : t + 1], attention_mask=mask[:, : t + 1], **{CACHE_ARG: cache}
                ).logits
                for t in range(450, 453)
            ]
        )
    layers = model.config.num_hidden_layers
    assert attend_calls == [512] * layers + [448] * (3 * layers)  # before the crop, and after
    for a, b in zip(*runs):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
