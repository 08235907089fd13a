"""The hot window (hf/hot_window.py): appends in place that hold what concatenation would, views
that keep what they saw, room within its bound, and a hooked forward's appends made together at
its end in one copy per kind (one launch each on a GPU), with the same cache as layer by layer."""

from __future__ import annotations

import pytest
import torch

import kakeyaturbo as kt
from kakeyaturbo.capture import read_tokens
from kakeyaturbo.hf import CACHE_ARG, KakeyaCache, hot_window, int8_rows
from kakeyaturbo.hf import layer as layer_module
from kakeyaturbo.hf.hot_window import ROOM, HotWindow, append_together, keep_together, launches


def model_states(b: int, h: int, q: int, d: int, seed: int) -> torch.Tensor:
    """``[B, H, q, D]`` laid out as a model makes them (``[B, q, H, D]``, transposed)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, q, h, d, generator=g).transpose(1, 2)


def empty(b: int, h: int, d: int, int8: bool, pos: bool = True) -> HotWindow:
    vd = d + int8_rows.SCALE_BYTES if int8 else d
    return HotWindow.of(
        torch.empty(b, h, 0, d, dtype=torch.bfloat16),
        torch.empty(b, h, 0, vd, dtype=torch.int8 if int8 else torch.bfloat16),
        torch.empty(b, 0, dtype=torch.int32) if pos else None,
    )


@pytest.mark.parametrize("int8", [True, False])
def test_appends_hold_what_concatenation_would(int8):
    # Three layers (one with other heads and width) take steps of 1, 3 and 16 tokens across
    # several growths; each holds bit for bit the concatenation of what it was given, cast or
    # encoded alone, and never more than ROOM slots spare.
    shapes = [(2, 3, 8), (2, 3, 8), (2, 1, 16)]
    windows = [empty(b, h, d, int8) for b, h, d in shapes]
    given: list[list] = [[] for _ in shapes]
    at, seed = 0, 0
    for q in [5, 1, 1, 3, 16, 1, 7, 1, 16, 2] * 3:
        items = []
        for i, (b, h, d) in enumerate(shapes):
            k, v = model_states(b, h, q, d, seed), model_states(b, h, q, d, seed + 1)
            pos = (torch.arange(at, at + q, dtype=torch.int32) + 7 * i).expand(b, q)
            items.append((windows[i], k, v, pos))
            given[i].append((k, v, pos))
            seed += 2
        append_together(items, int8_rows.encode if int8 else None)
        at += q
        for w in windows:
            assert w.length == at and 0 <= w.keys_store.shape[0] - at <= ROOM
    for w, parts in zip(windows, given):
        keys = torch.cat([k for k, _, _ in parts], dim=-2).to(torch.bfloat16)
        values = torch.cat([v for _, v, _ in parts], dim=-2)
        held = int8_rows.encode(values) if int8 else values.to(torch.bfloat16)
        assert torch.equal(w.keys, keys) and torch.equal(w.values, held)
        assert torch.equal(w.positions, torch.cat([p for _, _, p in parts], dim=-1))


def test_views_keep_what_they_saw():
    # A flush's spans and an attention's runs are views: appends (in place, or growing),
    # keeping a tail and selecting rows never change what they show.
    w = empty(2, 3, 8, int8=True)
    first = torch.arange(14, dtype=torch.int32).expand(2, 14)
    append_together(
        [(w, model_states(2, 3, 14, 8, 0), model_states(2, 3, 14, 8, 1), first)], int8_rows.encode
    )
    keys, values, pos = w.keys, w.values, w.positions
    saw = [t.clone() for t in (keys, values, pos)]
    for i in range(2 * ROOM):  # into the room, then past it
        k, v = model_states(2, 3, 1, 8, 2 + i), model_states(2, 3, 1, 8, 40 + i)
        at = torch.full((2, 1), 14 + i, dtype=torch.int32)
        append_together([(w, k, v, at)], int8_rows.encode)
    kept = keep_together([(w, 10, w.length)])[0]
    picked = kept.select_rows(torch.tensor([1, 1, 0]))
    for t, before in zip((keys, values, pos), saw):
        assert torch.equal(t, before)
    assert torch.equal(kept.keys, w.keys[:, :, 10:]) and kept.length == w.length - 10
    assert kept.keys_store.shape[0] - kept.length in range(1, ROOM + 1)
    assert torch.equal(picked.values, kept.values[[1, 1, 0]])
    assert torch.equal(picked.positions, kept.positions[[1, 1, 0]])


def test_stores_made_in_inference_mode_are_not_written_outside_it():
    with torch.inference_mode():
        w = empty(1, 2, 4, int8=False, pos=False)
        append_together([(w, model_states(1, 2, 3, 4, 0), model_states(1, 2, 3, 4, 1), None)])
    assert w.room() == 0  # torch would refuse the write: the window grows instead
    k, v = model_states(1, 2, 1, 4, 2), model_states(1, 2, 1, 4, 3)
    append_together([(w, k, v, None)])
    assert w.length == 4 and torch.equal(w.keys[:, :, 3:], k.to(torch.bfloat16))
    assert not w.keys_store.is_inference() and w.room() > 0


def test_positions_go_with_a_windows_tokens_and_only_there():
    k = model_states(1, 2, 1, 4, 0)
    with pytest.raises(ValueError, match="positions"):
        append_together([(empty(1, 2, 4, int8=False), k, k, None)])
    with pytest.raises(ValueError, match="positions"):
        append_together([(empty(1, 2, 4, int8=False, pos=False), k, k, torch.zeros(1, 1))])


def test_launches_follows_cudas_fast_route():
    store = torch.empty(20, 2, 3, 8, dtype=torch.bfloat16)
    k = model_states(2, 3, 1, 8, 0)  # float32: the copy casts, as the route allows
    assert launches([store[5:6]] * 3, [k.permute(2, 0, 1, 3)] * 3) == 1
    # Batch-major slots have gaps: a copy per pair.
    slots = torch.empty(2, 3, 20, 8, dtype=torch.bfloat16)[:, :, 5:6]
    assert launches([slots] * 3, [k] * 3) == 3
    # Strides that differ where a size is not 1, or dtypes mixed in a list: a copy per pair.
    q3 = model_states(2, 3, 3, 8, 1).permute(2, 0, 1, 3)  # [3, 2, 3, 8] with the B stride 3*H*D
    assert launches([store[5:8]], [q3]) == 1
    assert launches([store[5:8]], [q3.contiguous()]) == 1
    assert launches([store[5:8]], [q3.transpose(2, 3).contiguous().transpose(2, 3)]) == 1
    assert launches([store[5:8]], [torch.empty(2, 3, 3, 8).permute(2, 0, 1, 3)]) == 1
    assert launches([store[5:8]] * 2, [q3, q3.double()]) == 2
    assert launches([], []) == 0


# ---- in a hooked forward (the reference model) ------------------------------------------------


@pytest.fixture(scope="module")
def model(model_and_tok):
    return model_and_tok[0]


@pytest.fixture(scope="module")
def ids(model_and_tok, eval_text):
    return torch.tensor([read_tokens(model_and_tok[1], eval_text, 300, offset_chars=5000)])


def cache_for(model) -> KakeyaCache:
    p = kt.CodecParams(block_size=64, bit_width=4)
    kw = dict(k_params=p, v_params=p, residual_length=32, pre_rope=True, hot_dtype=torch.bfloat16)
    return KakeyaCache.from_model(model, **kw)


def run_alone(model, cache, tokens, position_ids):
    """:func:`run` with every layer appending in its own update."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(layer_module, "APPEND_TOGETHER_TOKENS", 0)
        return run(model, cache, tokens, position_ids)


def _bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def run(model, cache, tokens, position_ids):
    with torch.inference_mode():
        out = model(tokens, **{CACHE_ARG: cache}, position_ids=position_ids, use_cache=True)
    return out.logits[:, -1]


@pytest.mark.usefixtures("one_torch_thread")
def test_a_forwards_appends_wait_for_its_end_and_go_together(model, ids, monkeypatch):
    # Decode steps through a hooked cache: each layer's hot window is unchanged until the
    # forward's end, where every layer's new tokens go in one copy per kind (keys, int8 rows,
    # positions), each one launch on a GPU; and the cache holds the same bits as one whose
    # layers append in their own updates, through flushes (64-token blocks, 32 kept hot).
    hooked, alone = cache_for(model), cache_for(model)
    t = 150
    positions = torch.arange(ids.shape[1])[None]
    run(model, hooked, ids[:, :t], positions[:, :t])
    run_alone(model, alone, ids[:, :t], positions[:, :t])
    calls, lengths = [], []
    real = torch._foreach_copy_

    def spy(dsts, srcs, *args, **kw):
        calls.append(launches(dsts, srcs))
        return real(dsts, srcs, *args, **kw)

    monkeypatch.setattr(torch, "_foreach_copy_", spy)
    layer0 = hooked.layers[0]
    seen = layer0.update

    def update(*args, **kwargs):
        out = seen(*args, **kwargs)
        lengths.append(layer0._hot.length)  # in the forward: not yet appended
        return out

    monkeypatch.setattr(layer0, "update", update)
    for i in range(t, t + 120):
        calls.clear()
        before = layer0._hot.length
        want = run_alone(model, alone, ids[:, i : i + 1], positions[:, i : i + 1])
        got = run(model, hooked, ids[:, i : i + 1], positions[:, i : i + 1])
        assert torch.equal(got, want)
        assert lengths[-1] == before
        # Keys, values, positions, each in one launch; so are a growth's and a flush's tails.
        assert len(calls) >= 3 and set(calls) == {1}, calls
    n = len(hooked.layers)
    for a, b in zip(hooked.layers, alone.layers):
        assert a._len == b._len == t + 120 and len(a._blocks) == len(b._blocks) > 2
        for x, y in [(a._hot_k, b._hot_k), (a._hot_v, b._hot_v), (a._hot_pos, b._hot_pos)]:
            assert torch.equal(x, y)
        assert a._hot.keys_store.shape[0] - a._hot.length <= hot_window.ROOM
        # The room is bytes held, and counted so.
        stores = [*a._hot.stores(), a._sink_k, a._sink_v]
        held = sum(s.untyped_storage().nbytes() for s in stores if s is not None)
        report = a.memory_report()
        assert report["full_precision_bytes"] + _bytes(a._hot.pos_store) == held
    assert n > 1


@pytest.mark.usefixtures("one_torch_thread")
def test_a_failed_forward_still_appends_what_its_layers_took(model, ids, monkeypatch):
    # Layers count a forward's tokens as they take them; the appends that wait for its end
    # happen even where it raises, so every layer holds what it counts.
    cache = cache_for(model)
    positions = torch.arange(ids.shape[1])[None]
    run(model, cache, ids[:, :100], positions[:, :100])
    mlp = model.model.layers[1].mlp

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(mlp, "forward", broken)
    with pytest.raises(RuntimeError, match="boom"):
        run(model, cache, ids[:, 100:101], positions[:, 100:101])
    for layer in cache.layers:
        assert layer._len == layer.compressed_length + layer._hot.length
    assert cache.layers[0]._len == 101 and cache.layers[-1]._len == 100
