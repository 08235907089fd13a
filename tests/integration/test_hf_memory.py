"""`memory_report()` is exact: checked against an independent walk of everything the cache holds,
and against a DynamicCache filled with the same 2,000 tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DynamicCache

import kakeyaturbo as kt
from kakeyaturbo.hf import CACHE_ARG, KakeyaCache, KakeyaOptions, int8_rows
from kakeyaturbo.pipeline import CodedBlock

N_TOKENS = 2000

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),  # see conftest
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def ids(wikitext_ids):
    out = wikitext_ids(0, 120_000)[:, :N_TOKENS]
    assert out.shape[1] == N_TOKENS
    return out


def held_bytes(obj, skip=None) -> tuple[int, int, int, int]:
    """Walk what `obj` holds: (tensor storage bytes outside coded blocks, encoded-stream bytes,
    encoded streams, tensor storage bytes inside coded blocks (token norms)). Storages and
    streams reachable twice are counted once; views count their whole storage. ``skip``: an
    object not to walk into."""
    storages, encs, seen = {}, {}, {id(skip)} if skip is not None else set()

    def walk(x, in_block=False):
        if id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            storages[st.data_ptr(), x.device] = (st.nbytes(), in_block)
        elif isinstance(x, kt.EncodedLayer):
            encs[id(x)] = x.nbytes
        elif isinstance(x, (list, tuple, set)):
            for y in x:
                walk(y, in_block)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y, in_block)
        elif type(x).__module__.startswith(
            (
                "kakeyaturbo.hf",
                "kakeyaturbo.pipeline",
                "kakeyaturbo.coded_block",
                "kakeyaturbo.norm_codes",
                "kakeyaturbo.gpu.device_decode",
                "transformers.cache_utils",
            )
        ):
            inside = in_block or isinstance(x, CodedBlock)
            for y in vars(x).values():
                walk(y, inside)

    walk(obj)
    outside = sum(n for n, b in storages.values() if not b)
    inside = sum(n for n, b in storages.values() if b)
    return outside, sum(encs.values()), len(encs), inside


def dynamic_bytes(cache: DynamicCache) -> int:
    return sum(
        t.untyped_storage().nbytes() for layer in cache.layers for t in (layer.keys, layer.values)
    )


@torch.inference_mode()
def fill(model, ids, cache, steps: int = 8):
    """Prefill all but `steps` tokens, then decode the rest one by one (exercises streaming)."""
    model(ids[:, : N_TOKENS - steps], **{CACHE_ARG: cache}, use_cache=True)
    for i in range(N_TOKENS - steps, N_TOKENS):
        model(ids[:, i : i + 1], **{CACHE_ARG: cache}, use_cache=True)
    return cache


@pytest.fixture(scope="module")
def dynamic(model, ids):
    return fill(model, ids, DynamicCache(config=model.config))


@pytest.mark.parametrize("pre_rope", [False, True])
def test_report_is_exact_and_beats_dynamic_cache(model, ids, dynamic, pre_rope):
    cache = fill(model, ids, KakeyaCache.from_model(model, pre_rope=pre_rope))
    rep = cache.memory_report()
    # The shared pipeline's self-fitted frames are taken at their reported size here
    # (test_the_pipeline_holds_what_it_reports checks that size against what it holds).
    pipe = cache._ctx.pipeline
    tensors, enc_bytes, n_encs, norms = held_bytes(cache, skip=pipe)
    frames = pipe.frame_bytes()
    assert frames == 6 * 2 * 2 * 64 * 64 * 2  # layers * K/V * heads, float16 [D, D]

    # Compressed bytes are exactly the encoded streams and token norms held, and each stream's
    # size is its wire size.
    assert enc_bytes > 0 and norms > 0  # the default recipe holds value norms
    assert rep["compressed_bytes"] == enc_bytes + norms
    some = cache.layers[0]._blocks[0].k.encs[0]
    assert some.nbytes == len(some.to_bytes())
    # Every tensor held is accounted for: nothing decoded is hidden beside the blocks, and the
    # self-fitted frames are in the aux bytes.
    assert rep["decoded_cache_bytes"] == 0
    assert rep["full_precision_bytes"] + rep["aux_bytes"] == tensors + frames
    held = tensors + frames + enc_bytes + norms
    assert rep["total_bytes"] == held
    assert sum(layer["total_bytes"] for layer in rep["layers"]) == rep["total_bytes"]

    # The ratio is the measured one against a DynamicCache holding the same tokens.
    dyn = dynamic_bytes(dynamic)
    assert rep["dense_bytes"] == dyn
    assert rep["ratio"] == pytest.approx(dyn / held, rel=1e-12)
    assert rep["ratio"] > 2.0  # float32 model: the default recipe must save real memory
    assert rep["bf16_equivalent_bytes"] == dyn // 2
    assert rep["tokens"] == 6 * N_TOKENS

    # The hot window is bounded: only the newest (< residual + block) tokens stay exact.
    layer = cache.layers[0]
    hot = layer._hot_k.shape[-2]
    assert cache.residual_length <= hot < cache.residual_length + layer.block_size
    assert layer.compressed_length + hot == N_TOKENS
    assert n_encs == 6 * 2 * 2 * (
        layer.compressed_length // layer.block_size
    )  # layers * K/V * heads * blocks


@torch.inference_mode()
def test_blocks_held_on_the_device_are_held_once_and_counted(model, ids, monkeypatch):
    # Off the CPU kernels (a model on a GPU; here forced on the CPU) attention decodes the
    # blocks where the model runs, so the layer holds them there, as stored, and nowhere else:
    # no stream on the host, and the bytes it reports are the tensors it holds.
    from kakeyaturbo.hf import coded_attention

    on_host = fill(model, ids, KakeyaCache.from_model(model, pre_rope=True)).memory_report()
    monkeypatch.setattr(coded_attention, "CPU_KERNELS", False)
    cache = fill(model, ids, KakeyaCache.from_model(model, pre_rope=True))
    rep, pipe = cache.memory_report(), cache._ctx.pipeline
    tensors, enc_bytes, n_encs, norms = held_bytes(cache, skip=pipe)
    assert n_encs == 0 and enc_bytes == 0 and norms == 0
    held = sum(run.nbytes for layer in cache.layers for run in layer._on_device.values())
    assert rep["device_copy_bytes"] == 0 and rep["compressed_bytes"] == held
    assert rep["total_bytes"] == tensors + pipe.frame_bytes()
    # The same blocks as the host holds, within what laying them out for the device adds.
    assert rep["compressed_tokens"] == on_host["compressed_tokens"] > 0
    assert 0.9 < rep["compressed_bytes"] / on_host["compressed_bytes"] < 1.1


@torch.inference_mode()
def test_the_pipeline_holds_what_it_reports(model, ids):
    cache = KakeyaCache.from_model(model, pre_rope=True, residual_length=64)
    model(ids[:, :600], **{CACHE_ARG: cache}, use_cache=True)
    pipe = cache._ctx.pipeline
    assert pipe.frame_bytes() > 0
    # The pipeline holds its frames and the RoPE tables the cache layers report as theirs.
    rope_tables = sum(layer._rope.inv_freq.numel() * 4 for layer in cache.layers)
    assert held_bytes(pipe)[0] == pipe.frame_bytes() + rope_tables
    tensors, enc_bytes, _, norms = held_bytes(cache)
    assert cache.memory_report()["total_bytes"] == tensors + enc_bytes + norms
    # Consecutive RoPE positions are held as each row's first one, and read back in full.
    layer, bs = cache.layers[0], cache.recipe.block_size
    assert layer._blocks and all(blk.pos.shape == (1, 1) for blk in layer._blocks)
    for i, blk in enumerate(layer._blocks):
        assert torch.equal(blk.positions[0], torch.arange(i * bs, (i + 1) * bs, dtype=torch.int32))


def test_decoded_budget_is_bounded_and_counted(model, ids):
    k = kt.CodecParams(block_size=256)
    # Room for exactly 3 decoded blocks (K+V, 2 heads, 64 dims, fp32) across the cache.
    per_block = 2 * 2 * 256 * 64 * 4
    cache = fill(
        model,
        ids,
        KakeyaCache.from_model(
            model, k_params=k, options=KakeyaOptions(decoded_cache_bytes=3 * per_block + 7)
        ),
        steps=4,
    )
    rep = cache.memory_report()
    pipe = cache._ctx.pipeline
    tensors, enc_bytes, _, norms = held_bytes(cache, skip=pipe)
    assert rep["decoded_cache_bytes"] == 3 * per_block
    assert rep["total_bytes"] == tensors + pipe.frame_bytes() + enc_bytes + norms
    assert rep["decoded_cache_budget_bytes"] == 3 * per_block + 7

    # Decoded blocks kept under the budget give the same attention inputs as decoding afresh
    # (the codec's attention over the codes, in float32 arithmetic).
    no_budget = fill(
        model,
        ids,
        KakeyaCache.from_model(
            model, k_params=k, options=KakeyaOptions(attention_precision="float32")
        ),
        steps=4,
    )
    with torch.inference_mode():
        a = model(ids[:, -1:], **{CACHE_ARG: cache}, use_cache=True).logits
        b = model(ids[:, -1:], **{CACHE_ARG: no_budget}, use_cache=True).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    cache.reset()
    rep = cache.memory_report()
    assert rep["decoded_cache_bytes"] == rep["compressed_bytes"] == 0
    assert rep["full_precision_bytes"] == 0 and cache._ctx.budget.used == 0


def test_whole_layer_budget_uses_one_decoded_buffer(model, ids):
    """A budget that holds every layer switches to the contiguous decoded buffer: same values
    as decoding every step, every byte of it counted, and freed by crop/reset."""
    # 64-token blocks, residual 32: one block is compressed during the 60 decode steps, so the
    # buffer's deferred decode of new blocks is exercised too.
    k = kt.CodecParams(block_size=64)
    # Exact hot values: the buffer reads a forward's own new tokens as the window holds them
    # (int8 rows by default), decoding every step reads them as they came.
    # The codec's attention over the codes (without the buffer) in float32 arithmetic.
    kw = dict(k_params=k, residual_length=32, int8_hot_values=False)
    f32 = KakeyaOptions(attention_precision="float32")
    big_budget = dataclasses.replace(f32, decoded_cache_bytes=1 << 30)
    big = fill(model, ids, KakeyaCache.from_model(model, options=big_budget, **kw), steps=60)
    none = fill(model, ids, KakeyaCache.from_model(model, options=f32, **kw), steps=60)
    rep = big.memory_report()
    pipe = big._ctx.pipeline
    tensors, enc_bytes, _, norms = held_bytes(big, skip=pipe)
    assert rep["total_bytes"] == tensors + pipe.frame_bytes() + enc_bytes + norms
    layer = big.layers[0]
    assert layer._buf_k is not None and layer._buf_k.shape[-2] >= N_TOKENS
    assert layer.compressed_length == 1920 and not layer._buf_pending  # 1856 after the prefill
    assert rep["decoded_cache_bytes"] == big._ctx.budget.used >= rep["dense_bytes"]
    with torch.inference_mode():
        a = model(ids[:, -3:], **{CACHE_ARG: big}, use_cache=True).logits
        b = model(ids[:, -3:], **{CACHE_ARG: none}, use_cache=True).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    big.crop(-3)
    assert big.layers[0]._buf_k is None
    assert big.memory_report()["decoded_cache_bytes"] == big._ctx.budget.used == 0


def test_skip_layers_hold_exact_full_precision(model, ids, dynamic):
    cache = fill(model, ids, KakeyaCache.from_model(model, skip_layers=[0, 5]))
    rep = cache.memory_report()
    for i in (0, 5):
        assert rep["layers"][i]["kind"] == "full_precision"
        assert rep["layers"][i]["compressed_bytes"] == 0
        assert cache.layers[i].keys.shape == dynamic.layers[i].keys.shape
        assert rep["layers"][i]["full_precision_bytes"] == rep["layers"][i]["dense_bytes"]
    # Layer 0 sees the same inputs as in the DynamicCache run, so it holds the same bits.
    assert torch.equal(cache.layers[0].keys, dynamic.layers[0].keys)
    assert torch.equal(cache.layers[0].values, dynamic.layers[0].values)
    assert rep["layers"][1]["kind"] == "compressed" and rep["layers"][1]["compressed_bytes"] > 0

    # Skipping every layer is exactly DynamicCache (and says so).
    with pytest.warns(UserWarning, match="no compressible"):
        everything = KakeyaCache.from_model(model, skip_layers=range(6))
    fill(model, ids, everything)
    for mine, ref in zip(everything.layers, dynamic.layers):
        assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)
    assert everything.memory_report()["ratio"] == 1.0


def test_hot_dtype_halves_the_exact_tokens(model, ids):
    """bfloat16 hot window and sinks on a float32 model: half their bytes, counted exactly, the
    same codes' share of the bytes, and outputs within bfloat16 rounding of the float32 ones."""
    caches = {
        dt: fill(model, ids, KakeyaCache.from_model(model, hot_dtype=dt, int8_hot_values=False))
        for dt in (None, torch.bfloat16)
    }
    full, half = (caches[dt].memory_report() for dt in (None, torch.bfloat16))
    assert half["full_precision_bytes"] * 2 == full["full_precision_bytes"] > 0
    assert half["dense_bytes"] == full["dense_bytes"]  # the model's dtype, not the hot one
    tensors, enc_bytes, _, norms = held_bytes(caches[torch.bfloat16])
    assert half["total_bytes"] == tensors + enc_bytes + norms
    layer = caches[torch.bfloat16].layers[0]
    assert layer._hot_k.dtype == layer._sink_k.dtype == torch.bfloat16
    with torch.inference_mode():
        a, b = (
            model(ids[:, -1:], **{CACHE_ARG: caches[dt]}, use_cache=True).logits
            for dt in (None, torch.bfloat16)
        )
    assert a.dtype == b.dtype == torch.float32
    torch.testing.assert_close(b, a, rtol=0, atol=0.05 * float(a.abs().max()))
    assert not torch.equal(a, b)  # the hot window really is held rounded
    with pytest.raises(TypeError, match="hot_dtype"):
        KakeyaCache(model.config, hot_dtype=torch.int8)


def test_int8_hot_values_hold_rows_of_codes(model, ids):
    """Hot values as int8 rows: D + 2 bytes a row instead of 4 D (float32 model), counted
    exactly; keys and sinks stay in the hot dtype; each value within half a step; and
    the next token's logits move less than the blocks' codes move them."""
    exact = fill(model, ids, KakeyaCache.from_model(model, int8_hot_values=False))
    rows = fill(model, ids, KakeyaCache.from_model(model))  # the default
    saved = 0
    for a, b in zip(exact.layers, rows.layers):
        bsz, h, t, d = a._hot_v.shape
        assert b._hot_v.shape == (bsz, h, t, d + 2) and b._hot_v.dtype == torch.int8
        assert b._hot_k.dtype == b._sink_v.dtype == torch.float32  # the model's
        saved += bsz * h * t * (4 * d - (d + 2))
    # Layer 0's values come from the tokens alone (later layers' from what the rounded values
    # changed): within half a step of the exact window's.
    ref, got = exact.layers[0]._hot_v.float(), rows.layers[0]._hot_values()
    step = ref.abs().amax(-1, keepdim=True) / 127
    assert bool(((got - ref).abs() <= 0.51 * step).all())
    assert torch.equal(exact.layers[0]._hot_k, rows.layers[0]._hot_k)
    rep_a, rep_b = exact.memory_report(), rows.memory_report()
    assert rep_a["full_precision_bytes"] - rep_b["full_precision_bytes"] == saved > 0
    assert rep_a["compressed_bytes"] == pytest.approx(rep_b["compressed_bytes"], rel=0.01)
    tensors, enc_bytes, _, norms = held_bytes(rows)
    assert rep_b["total_bytes"] == tensors + enc_bytes + norms
    with torch.inference_mode():
        dense = fill(model, ids, DynamicCache(config=model.config))
        a, b, ref = (
            model(ids[:, -1:], **{CACHE_ARG: c}, use_cache=True).logits[:, -1].log_softmax(-1)
            for c in (exact, rows, dense)
        )
    assert not torch.equal(a, b)  # the values really are held as codes

    def kl(p, q):
        return float((p.exp() * (p - q)).sum(-1).mean())

    # On this small model's one token the codes move it by 1.7e-5, the int8 values by 7e-6
    # (on SmolLM2 in in-forward-hot mode: 1.8e-3 and 5e-5).
    assert kl(a, b) < kl(ref, a)


def test_int8_hot_values_code_a_prompt_exact_and_a_waiting_window_from_its_rows(model):
    """A prompt's blocks are coded from the values it brought (what the evaluation measures, and
    what a cache holding exact values stores); a block flushed while generating is coded from the
    window's int8 rows, the only copy of those values the cache kept."""
    g = torch.Generator().manual_seed(3)
    cfg = model.config
    heads, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    k, v = (torch.randn(1, heads, 544, d, generator=g) for _ in range(2))
    caches = [KakeyaCache(cfg, residual_length=32, int8_hot_values=f) for f in (False, True)]
    for cache in caches:
        cache.update(k[:, :, :300], v[:, :, :300], 0)  # the prompt: one block of 256 flushed
        for i in range(300, 544):  # a token at a time: the window's oldest 256 flushed at 544
            cache.update(k[:, :, i : i + 1], v[:, :, i : i + 1], 0)
    exact, rows = (c.layers[0] for c in caches)
    assert len(exact._blocks) == len(rows._blocks) == 2

    def stored(values: CodedBlock):  # the streams' bytes and the token norms' codes
        norms = None if values.norms is None else values.norms.codes.tolist()
        return [e.to_bytes() for e in values.encs], norms

    def coded(x, start):
        (values,) = rows._ctx.pipeline.encode(x, 0, "v", None, rows._sink_mask(start, 256))
        return stored(values)

    (a0, a1), (b0, b1) = ([stored(blk.v) for blk in lay._blocks] for lay in (exact, rows))
    assert a0 == b0 == coded(v[:, :, :256], 0)
    waited = v[:, :, 256:512]
    assert b1 == coded(int8_rows.round_trip(waited), 256)
    assert a1 == coded(waited, 256) != b1


def test_report_says_why_a_short_prompt_is_not_compressed(model, ids):
    """Before a layer holds a block more than its hot window nothing is coded, and the report's
    note says so in words: how many tokens are held exact as sinks and hot window, and after how
    many tokens blocks start being coded."""
    cache = KakeyaCache.from_model(model)
    with torch.inference_mode():
        model(ids[:, :20], **{CACHE_ARG: cache}, use_cache=True)
    rep = cache.memory_report()
    assert rep["compressed_tokens"] == 0 and rep["ratio"] < 1
    bs, window, sinks = cache.recipe.block_size, cache.residual_length, cache.sink_tokens
    note = rep["note"]
    assert note.startswith("nothing is compressed yet"), note
    assert "all 20 tokens exact" in note and f"the first {sinks} as attention sinks" in note
    assert f"the newest {window} as the hot window" in note
    assert f"once a layer holds {window + bs} tokens" in note
    coded = fill(model, ids, KakeyaCache.from_model(model)).memory_report()
    assert coded["compressed_tokens"] > 0 and "are coded in blocks" in coded["note"]
