"""Cache operations on the real reference model: crop (and assisted decoding that relies on it),
batch select/repeat, beam reorder, reset; what pre-RoPE mode hands the pipeline and its exact
inverse RoPE; clear errors for bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import kakeyaturbo as kt
from kakeyaturbo.hf import CACHE_ARG, KakeyaCache, KakeyaOptions, int8_rows
from kakeyaturbo.hf.rope import rotary_spec_from_config
from kakeyaturbo.recipes import default_recipe

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),  # see conftest
    pytest.mark.slow,
]

# 8-bit over 64-token blocks: close to lossless, so structural bugs (wrong rows, wrong order,
# missing inverse) stand out against codec error.
P8 = dict(block_size=64, bit_width=8)


@pytest.fixture(scope="module")
def ids(wikitext_ids):
    return wikitext_ids(5000, 40000)[:, :400]


def kakeya(model, **kw):
    p = kt.CodecParams(**P8)
    kw.setdefault("residual_length", 32)
    return KakeyaCache.from_model(model, k_params=p, v_params=p, **kw)


@torch.inference_mode()
def step(model, cache, tokens):
    return model(tokens, **{CACHE_ARG: cache}, use_cache=True).logits[:, -1].float()


# ---- crop ---------------------------------------------------------------------------------------


@torch.inference_mode()
def test_crop_within_hot_window_is_exact(model, ids):
    # Two caches fed the same 290 tokens hold the same bits; one then sees 10 more tokens (they
    # stay in the hot window) and crops them: it must continue exactly like the other.
    a, b = kakeya(model), kakeya(model)
    step(model, a, ids[:, :290])
    step(model, b, ids[:, :290])
    blocks = list(a.layers[0]._blocks)
    step(model, a, ids[:, 290:300])
    a.crop(-10)
    assert a.get_seq_length() == b.get_seq_length() == 290
    assert a.layers[0]._blocks == blocks and a.layers[0].compressed_length == 256
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la._hot_k, lb._hot_k) and torch.equal(la._hot_v, lb._hot_v)
    torch.testing.assert_close(
        step(model, a, ids[:, 290:300]), step(model, b, ids[:, 290:300]), rtol=0, atol=0
    )


@torch.inference_mode()
def test_crop_into_compressed_blocks(model, ids):
    cache, dyn = kakeya(model), DynamicCache(config=model.config)
    for c in (cache, dyn):
        step(model, c, ids[:, :300])
        c.crop(-100)
    layer = cache.layers[0]
    assert cache.get_seq_length() == 200
    assert layer.compressed_length + layer._hot_k.shape[-2] == 200
    assert (
        layer.compressed_length == 192
    )  # 3 whole blocks kept, block 4's head is back in the hot window
    torch.testing.assert_close(
        step(model, cache, ids[:, 200:210]), step(model, dyn, ids[:, 200:210]), atol=0.1, rtol=0.05
    )
    with pytest.raises(ValueError, match="negative"):
        cache.crop(5)

    # Cropping into block 0 brings its sinks back into the hot window: exact, not the block
    # mean they were encoded as.
    for c in (cache, dyn):
        c.crop(-(c.get_seq_length() - 30))
    assert cache.layers[0].compressed_length == 0
    torch.testing.assert_close(
        cache.layers[0]._hot_k[:, :, :4], dyn.layers[0].keys[:, :, :4], rtol=0, atol=0
    )
    # Values as the hot window holds them (int8 rows of the exact sinks).
    torch.testing.assert_close(
        cache.layers[0]._hot_values()[:, :, :4],
        int8_rows.round_trip(dyn.layers[0].values[:, :, :4]),
        rtol=0,
        atol=0,
    )


@torch.inference_mode()
def test_assisted_decoding_uses_crop(model, ids):
    prompt = ids[:, :200]
    cache = kakeya(model)
    out = model.generate(
        prompt,
        max_new_tokens=20,
        do_sample=False,
        prompt_lookup_num_tokens=4,
        **{CACHE_ARG: cache},
    )
    ref = model.generate(prompt, max_new_tokens=20, do_sample=False, prompt_lookup_num_tokens=4)
    assert out.shape == ref.shape
    assert (out == ref).float().mean().item() >= 0.95


# ---- batch operations ---------------------------------------------------------------------------


@torch.inference_mode()
def test_batch_repeat_select_and_reorder(model, ids):
    rows = torch.stack([ids[0, :250], ids[0, 100:350]])
    cache = kakeya(model)
    step(model, cache, rows)
    before = cache.memory_report()
    cache.batch_repeat_interleave(2)  # rows: 0 0 1 1
    after = cache.memory_report()
    # Repeated rows share their compressed streams (no stream is re-encoded or copied); only
    # the token norms beside them are held once per row.
    norms = sum(
        coded.norm_bytes
        for layer in cache.layers
        for blk in layer._blocks
        for coded in (blk.k, blk.v)
    )
    assert norms > 0
    assert after["compressed_bytes"] == before["compressed_bytes"] + norms // 2
    blk = cache.layers[0]._blocks[0]  # 2 kv heads: streams of rows 0 and 1 are the same objects
    assert blk.k.encs[0] is blk.k.encs[2] and blk.v.encs[5] is blk.v.encs[7]
    assert torch.equal(blk.v.norms.codes[0], blk.v.norms.codes[1])
    assert torch.equal(blk.v.norms.bounds[0], blk.v.norms.bounds[1])
    assert after["full_precision_bytes"] == 2 * before["full_precision_bytes"]
    nxt = torch.stack([ids[0, 250:251], ids[0, 250:251], ids[0, 350:351], ids[0, 350:351]])
    out = step(model, cache, nxt)
    torch.testing.assert_close(out[0], out[1])
    torch.testing.assert_close(out[2], out[3])
    assert not torch.allclose(out[0], out[2])

    cache.reorder_cache(torch.tensor([3, 2, 1, 0]))  # rows now: 1 1 0 0
    out2 = step(model, cache, nxt.flip(0))
    # The same cache never reordered (frames are fitted over the batch's rows, so the reference
    # is the same batch, not a one-row cache): reordering only permutes the rows.
    twin = kakeya(model)
    step(model, twin, rows)
    twin.batch_repeat_interleave(2)
    step(model, twin, nxt)
    ref = step(model, twin, nxt)
    torch.testing.assert_close(out2, ref.flip(0), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(out2, ref, atol=1e-2)

    # Float or bool row indices are refused (DynamicCache's index_select refuses them too)
    # instead of being truncated to rows, and leave the cache untouched.
    layer = cache.layers[0]
    hot, blocks = layer._hot_k.clone(), [blk.k.encs for blk in layer._blocks]
    with pytest.raises(TypeError, match="beam_idx"):
        cache.reorder_cache(torch.tensor([3.0, 2.0, 1.0, 0.0]))
    with pytest.raises(TypeError, match="beam_idx"):
        cache.reorder_cache(torch.tensor([True, False, True, False]))
    with pytest.raises(TypeError, match="indices"):
        cache.batch_select_indices(torch.tensor([2.0]))
    with pytest.raises(ValueError, match="repeats"):
        cache.batch_repeat_interleave(0)
    assert layer._rows == 4 and torch.equal(layer._hot_k, hot)
    assert [blk.k.encs for blk in layer._blocks] == blocks

    cache.batch_select_indices(torch.tensor([2]))  # keep one row-0 copy
    assert cache.layers[0]._rows == 1
    assert step(model, cache, ids[:, 251:252]).shape == (1, model.config.vocab_size)


@pytest.mark.parametrize("coded", [True, False])
@torch.inference_mode()
def test_blocks_held_only_on_the_device_follow_every_cache_operation(
    model, ids, coded, monkeypatch
):
    # Where attention decodes the blocks on the model's device (off the CPU kernels: a GPU;
    # forced here on the CPU), the layer holds them there only, and a flush, a beam's reorder,
    # a batch repeat or select and a crop into the blocks are done on that copy. The twin holds
    # its blocks on the host and copies them over each time they change, as before; both then
    # decode the same packed codes with the same ops, so their logits must be equal.
    from kakeyaturbo.hf import coded_attention

    rows = torch.stack([ids[0, :250], ids[0, 100:350]])
    caches = []
    for on_device in (False, True):
        monkeypatch.setattr(coded_attention, "CPU_KERNELS", not on_device)
        cache = KakeyaCache.from_model(
            model, recipe=default_recipe(block_size=64), residual_length=32, coded_attention=coded
        )
        step(model, cache, rows)  # the first flush decides where the blocks are held
        caches.append(cache)
    host, device = caches
    assert all(layer._on_device is None for layer in host.layers)
    assert all(blk.k is None for layer in device.layers for blk in layer._blocks)

    def same(tokens):
        a, b = step(model, host, tokens), step(model, device, tokens)
        assert torch.equal(a, b)

    nxt = torch.stack([ids[0, 250:251], ids[0, 350:351]])
    same(nxt)
    for cache in caches:
        cache.batch_repeat_interleave(2)
    same(nxt.repeat_interleave(2, dim=0))
    for cache in caches:
        cache.reorder_cache(torch.tensor([3, 2, 1, 0]))
    same(torch.stack([ids[0, 251:331], ids[0, 251:331], ids[0, 300:380], ids[0, 300:380]]))
    layer = device.layers[0]
    assert layer.compressed_length == 256 and layer._on_device["k"].blocks == 4  # a flush: 3 -> 4
    for cache in caches:
        cache.crop(-100)  # into block 4: its head back in the hot window
    assert layer.compressed_length == 192 and layer._on_device["v"].blocks == 3
    same(torch.stack([ids[0, 231:232]] * 4))
    for cache in caches:
        cache.batch_select_indices(torch.tensor([2]))
    same(ids[:, 232:240])
    assert layer._rows == 1 and layer._on_device["k"].streams == 2  # one row of 2 KV heads
    rep = device.memory_report()
    assert rep["device_copy_bytes"] == 0
    assert rep["compressed_bytes"] == sum(
        run.nbytes for lay in device.layers for run in lay._on_device.values()
    )


@torch.inference_mode()
def test_layers_holding_blocks_on_the_device_flush_together_at_the_forwards_end(
    model, ids, monkeypatch
):
    # Such layers' flushes wait for the forward's end (the model hook's) and are coded there
    # in one call per stream kind for every layer; past flush_together_bytes of waiting tokens
    # they are coded at once, and without the hook each layer flushes in its own update. Each
    # way every layer holds the same tensors (and with the hook, attending over the codes,
    # the logits are the same; without it the model attends over decoded blocks).
    from kakeyaturbo.hf import coded_attention
    from kakeyaturbo.pipeline import Pipeline

    monkeypatch.setattr(coded_attention, "CPU_KERNELS", False)
    calls = []
    real = Pipeline.encode_layers_on_device

    def spy(self, spans, stream):
        calls.append(len(spans))
        return real(self, spans, stream)

    monkeypatch.setattr(Pipeline, "encode_layers_on_device", spy)
    runs = {}
    for way in ("together", "at once", "unhooked"):
        alone = {"options": KakeyaOptions(flush_together_bytes=0)} if way == "at once" else {}
        cache = KakeyaCache.from_model(model, recipe=default_recipe(block_size=64), **alone)
        if way == "unhooked":
            cache.detach()
        calls.clear()
        logits = [step(model, cache, ids[:, :300])]
        layers = len(cache.layers)
        assert calls == ([layers, layers] if way == "together" else [1, 1] * layers)
        logits += [step(model, cache, ids[:, i : i + 1]) for i in range(300, 304)]
        runs[way] = cache, torch.cat(logits)
    ref, ref_logits = runs.pop("together")
    for way, (cache, logits) in runs.items():
        assert way == "unhooked" or torch.equal(logits, ref_logits)
        for lay, ref_lay in zip(cache.layers, ref.layers):
            assert lay.compressed_length == ref_lay.compressed_length == 128
            for s in ("k", "v"):
                got, want = lay._on_device[s], ref_lay._on_device[s]
                (run, _), (ref_run, _) = got.runs[0], want.runs[0]
                assert all(
                    torch.equal(getattr(run, f), getattr(ref_run, f))
                    for f in ("codes", "base", "bits", "sigma", "mean", "outlier_pos")
                )
    # What the layers hold after a flush together: the views of one coding split exactly.
    rep = ref.memory_report()
    assert rep["compressed_bytes"] == sum(
        run.nbytes for lay in ref.layers for run in lay._on_device.values()
    )


@torch.inference_mode()
def test_deepcopy_for_prompt_reuse(model, ids):
    prompt_cache = kakeya(model, pre_rope=True)
    step(model, prompt_cache, ids[:, :200])
    reused = copy.deepcopy(prompt_cache)
    assert not reused._hook_handles and len(prompt_cache._hook_handles) == 2
    reused.attach(model)
    a = step(model, reused, ids[:, 200:210])
    b = step(model, prompt_cache, ids[:, 200:210])
    torch.testing.assert_close(a, b)
    reused.detach()  # must not unhook the original
    assert prompt_cache._hook_handles[0].id in model.model._forward_pre_hooks
    assert prompt_cache.get_seq_length() == reused.get_seq_length() == 210


@torch.inference_mode()
def test_reset_empties_the_cache(model, ids):
    cache = kakeya(model)
    step(model, cache, ids[:, :200])
    cache.reset()
    assert cache.get_seq_length() == 0
    assert cache.memory_report()["total_bytes"] == 0
    fresh = kakeya(model)
    torch.testing.assert_close(step(model, cache, ids[:, :150]), step(model, fresh, ids[:, :150]))


# ---- pre-RoPE --------------------------------------------------------------------------------


@torch.inference_mode()
def test_pre_rope_encodes_the_unrotated_keys_of_padded_rows(model, ids):
    """In pre-RoPE mode the codec must see k_proj's output (before RoPE), at the positions
    generate gave each left-padded row."""
    captured = []
    handle = model.model.layers[0].self_attn.k_proj.register_forward_hook(
        lambda m, i, o: captured.append(o)
    )
    tokens = torch.full((2, 200), 1)
    mask = torch.ones((2, 200), dtype=torch.long)
    tokens[0] = ids[0, :200]
    tokens[1, 40:], mask[1, :40] = ids[0, 200:360], 0
    cache = kakeya(model, pre_rope=True, sink_tokens=0)
    pipe = cache._ctx.pipeline
    calls, framed = [], []  # (layer 0 keys given to encode, positions); what enters the frame
    encode, into_frame = pipe.encode, pipe._into_frame

    def spy_encode(x, layer, stream, positions=None, sinks=None, newer=None):
        if (layer, stream) == (0, "k"):
            calls.append((x.clone(), None if positions is None else positions.clone()))
        return encode(x, layer, stream, positions, sinks, newer)

    def spy_frame(x, layer, stream):
        if (layer, stream) == (0, "k"):
            framed.append(x.clone())
        return into_frame(x, layer, stream)

    pipe.encode, pipe._into_frame = spy_encode, spy_frame
    try:
        model.generate(
            tokens,
            attention_mask=mask,
            **{CACHE_ARG: cache},
            max_new_tokens=2,
            do_sample=False,
            pad_token_id=1,
        )
    finally:
        handle.remove()
    pre = captured[0].view(2, 200, 2, 64).transpose(1, 2)  # [B, H, T, D] before RoPE
    x, positions = calls[0]
    encoded = framed[0]
    t = encoded.shape[-2]
    assert t == x.shape[-2] == 128  # (200 - 32) // 64 whole blocks
    # The cache hands post-RoPE keys with each row's own positions (row 1 starts after padding).
    assert torch.equal(positions[0], torch.arange(t, dtype=positions.dtype))
    assert torch.equal(positions[1, 40:], torch.arange(t - 40, dtype=positions.dtype))
    assert not torch.allclose(x[0], pre[0, :, :t], atol=1e-2)
    # Pad slots (row 1, first 40) carry arbitrary positions; every real token must match.
    torch.testing.assert_close(encoded[0], pre[0, :, :t], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(encoded[1, :, 40:], pre[1, :, 40:t], atol=2e-5, rtol=1e-5)


def test_inverse_rope_matches_the_model(model):
    spec = rotary_spec_from_config(model.config)
    x = torch.randn(2, 2, 50, 64)
    pos = torch.stack([torch.arange(50), torch.arange(1000, 1050)])
    cos, sin = model.model.rotary_emb(x, pos)
    rotated, _ = apply_rotary_pos_emb(x, x, cos, sin)
    torch.testing.assert_close(spec.rotate(x, pos), rotated, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(spec.unrotate(rotated, pos), x, atol=1e-5, rtol=1e-5)


# ---- bad input -------------------------------------------------------------------------------


def test_bad_parameters_raise_clearly(model):
    cfg = model.config
    with pytest.raises(ValueError, match="residual_length"):
        KakeyaCache(cfg, residual_length=-1)
    with pytest.raises(ValueError, match="sink_tokens"):
        KakeyaCache(cfg, sink_tokens="4")
    with pytest.raises(ValueError, match="out of range"):
        KakeyaCache(cfg, skip_layers=[6])
    with pytest.raises(TypeError, match="skip_layers"):
        KakeyaCache(cfg, skip_layers=3)
    with pytest.raises(TypeError, match="k_params"):
        KakeyaCache(cfg, k_params={"bit_width": 3})
    with pytest.raises(ValueError, match="block_size"):
        KakeyaCache(
            cfg, k_params=kt.CodecParams(block_size=128), v_params=kt.CodecParams(block_size=256)
        )
    with pytest.raises(ValueError, match="decoded_cache_bytes"):
        KakeyaOptions(decoded_cache_bytes=-1)
    with pytest.raises(ValueError, match="flush_together_bytes"):
        KakeyaOptions(flush_together_bytes=-1)
    with pytest.raises(TypeError, match="options"):
        KakeyaCache(cfg, options={"decoded_cache_bytes": 0})
    with pytest.raises(TypeError, match="PretrainedConfig"):
        KakeyaCache({"num_hidden_layers": 6})
    with pytest.raises(TypeError, match="transformers model"):
        KakeyaCache.from_model(cfg)


@torch.inference_mode()
def test_batch_change_without_select_is_refused(model, ids):
    cache = kakeya(model)
    step(model, cache, ids[:, :50])
    with pytest.raises(ValueError, match="batch_select_indices"):
        step(model, cache, torch.cat([ids[:, 50:51]] * 2))


def test_each_layer_holds_its_own_sinks_picked_once_per_forward_from_the_mask(model, ids):
    # Every layer picks the same sink slots from a forward's attention mask (made once), each
    # layer holding its own copy; the next sequence's mask, of the same shape, picks anew.
    cache = kakeya(model, sink_tokens=4)
    for pad in (3, 9):
        cache.reset()
        mask = torch.ones(2, 80, dtype=torch.long)
        mask[1, :pad] = 0
        with torch.inference_mode():
            model(ids[:, :80].repeat(2, 1), attention_mask=mask, **{CACHE_ARG: cache})
        slots = [layer._sink_idx for layer in cache.layers]
        assert all(s.tolist() == [[0, 1, 2, 3], list(range(pad, pad + 4))] for s in slots), pad
        assert len({s.data_ptr() for s in slots}) == len(slots)


def test_sinks_hold_the_states_at_their_slots_captured_across_forwards(model, ids):
    # The sinks are the exact states each layer was given at their slots: rows alike (a copy
    # each, also after equal padding), a padded row (scattered), and a prompt shorter than the
    # sinks, the rest captured by the next forward.
    for pads, cut in (((0, 0), 2), ((0, 5), 2), ((3, 3), 30), ((0, 0), 30)):
        cache, given = kakeya(model, sink_tokens=4), {}
        for layer in cache.layers:
            seen = given[layer] = []

            def spy(k, v, *args, _real=layer.update, _seen=seen, **kw):
                _seen.append((k.clone(), v.clone()))
                return _real(k, v, *args, **kw)

            layer.update = spy
        mask = torch.ones(2, 40, dtype=torch.long)
        for r, pad in enumerate(pads):
            mask[r, :pad] = 0
        tokens = ids[:, :40].repeat(2, 1)
        with torch.inference_mode():
            for lo, hi in ((0, cut), (cut, 40)):
                model(tokens[:, lo:hi], attention_mask=mask[:, :hi], **{CACHE_ARG: cache})
        for layer, seen in given.items():
            idx = layer._sink_idx
            for held, i in ((layer._sink_k, 0), (layer._sink_v, 1)):
                states = torch.cat([s[i] for s in seen], dim=2)
                for r in range(2):
                    exact = states[r, :, idx[r]].transpose(0, 1).to(held.dtype)
                    assert torch.equal(held[r], exact), (pads, cut, layer.layer_idx, i)


def test_what_layers_ask_alike_is_made_once_per_equal_arguments():
    # Every layer of a forward asks which sinks a span holds, from its own copy of the slots:
    # one answer while the arguments are equal, a new one as soon as they are not (another
    # batch's slots), never a stale one.
    from kakeyaturbo.hf.context import StepInputs

    step, made = StepInputs(), []

    def ask(slots: torch.Tensor):
        key = (0, 8, slots.numpy().tobytes())
        return step.once("sink mask", key, lambda: made.append(slots.clone()) or len(made))

    a, b = torch.tensor([[0, 1], [2, 3]]), torch.tensor([[0, 1], [2, 4]])
    assert [ask(a), ask(a.clone()), ask(b), ask(b), ask(a)] == [1, 1, 2, 2, 3]
    assert step.once("positions", 1, lambda: "p") == "p"  # kinds apart
    assert ask(a) == 3
