"""Keys made ahead of attention (``codec.prepare_keys``, ``KakeyaOptions(prepare_keys_ahead=...)``):
the next layer's coded keys made on the codec's idle worker while the model runs. What would
catch real bugs: keys made with another frame, rotation or precision than attention's, stale
keys read after the blocks changed, a block made twice or by neither side, a preparation still
running when its inputs are gone. Each check compares bits with the same call unprepared."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kakeyaturbo as kt
from kakeyaturbo.codec import coded_attend, prepare_keys
from kakeyaturbo.hf import CACHE_ARG, KakeyaCache, KakeyaOptions, coded_attention
from kakeyaturbo.hf.coded_attention import CodedView
from kakeyaturbo.hf.rope import RotarySpec
from kakeyaturbo.modeling import load_model
from kakeyaturbo.recipes import default_recipe

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # a worker idle beside torch's one

STREAMS, D, G = 6, 64, 3
LENS = (64, 64, 64, 20)
PARAMS = kt.CodecParams(
    allocation="waterfill", k=0, bits_per_value=2.5, block_size=64, pca_method="none"
)


def coded(seed: int) -> list:
    """Blocks of ``STREAMS`` random streams, stream-major."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(STREAMS, sum(LENS), D, generator=g) * torch.linspace(3, 0.2, D)
    per_block, t0 = [], 0
    for n in LENS:
        per_block.append(kt.encode_batch(x[:, t0 : t0 + n].contiguous(), PARAMS))
        t0 += n
    return [per_block[b][s] for s in range(STREAMS) for b in range(len(LENS))]


@pytest.fixture(scope="module")
def inputs():
    kencs, vencs = coded(1), coded(2)
    g = torch.Generator().manual_seed(3)
    rope = RotarySpec(
        inv_freq=10000.0 ** (-torch.arange(0, D, 2).float() / D), rot_dim=D, adjacent_pairs=False
    )
    pos = torch.arange(sum(LENS))[None]
    return {
        "kencs": kencs,
        "vencs": vencs,
        "q": torch.randn(STREAMS, G, D, generator=g).numpy(),
        "exact": torch.randn(STREAMS, 5, D, generator=g).numpy(),
        "frames": (torch.randn(3, D, D, generator=g) / 8).numpy(),
        "rotation": rope.split_rotation(pos, torch.device("cpu")).numpy(),
    }


def attend(inp, precision, prepared=None, **kw):
    return coded_attend(
        inp["kencs"],
        inp["vencs"],
        STREAMS,
        inp["q"],
        inp["exact"],
        inp["exact"],
        0.125,
        key_frames=kw.get("frames", inp["frames"]),
        rotation=kw.get("rotation", inp["rotation"]),
        precision=precision,
        prepared=prepared,
        rotation_repeats=kw.get("repeats", 1),
    )


def prepare(inp, precision, background, **kw):
    return prepare_keys(
        kw.get("kencs", inp["kencs"]),
        STREAMS,
        key_frames=kw.get("frames", inp["frames"]),
        rotation=kw.get("rotation", inp["rotation"]),
        precision=precision,
        background=background,
        rotation_repeats=kw.get("repeats", 1),
    )


@pytest.mark.parametrize("precision", ["float32", "int16", "bfloat16"])
def test_prepared_keys_give_the_same_bits(inputs, precision):
    want = attend(inputs, precision)
    made = prepare(inputs, precision, background=False)
    assert made.prepared() == len(made) == len(inputs["kencs"])
    np.testing.assert_array_equal(attend(inputs, precision, made), want)
    # On the idle worker, attention right after: each side makes what the other has not.
    assert kt._core._workers() == ("rayon", kt._core._workers()[1])
    for _ in range(5):
        made = prepare(inputs, precision, background=True)
        if kt._core._workers()[1] == 1:
            assert made is None  # a pool of one thread has no idle worker
            return
        np.testing.assert_array_equal(attend(inputs, precision, made), want)


def test_prepared_keys_refuse_other_inputs_by_name(inputs):
    made = prepare(inputs, "float32", background=False)
    for kw, name in [
        ({"frames": inputs["frames"] + 1}, "key_frames"),
        ({"frames": None}, "key_frames"),
        ({"rotation": inputs["rotation"].copy()}, "rotation"),  # equal values, another array
        ({"rotation": None}, "rotation"),
    ]:
        with pytest.raises(ValueError, match=f"prepared: the keys were made with other {name}"):
            attend(inputs, "float32", made, **kw)
    with pytest.raises(ValueError, match="other precision"):
        attend(inputs, "int16", made)
    other = prepare(inputs, "float32", background=False, kencs=coded(1))  # equal bytes, new blocks
    with pytest.raises(ValueError, match="other key blocks"):
        attend(inputs, "float32", other)
    # Bad input raises in the caller, not on a worker.
    with pytest.raises(ValueError, match="rotation"):
        prepare(inputs, "float32", background=True, rotation=inputs["rotation"][:, :-1].copy())
    with pytest.raises(ValueError, match="frames"):
        prepare(inputs, "float32", background=True, frames=inputs["frames"][:, 1:].copy())
    with pytest.raises(ValueError, match="precision"):
        prepare(inputs, "int8", background=True)


def test_repeated_rotation_turns_as_the_table_spelled_out(inputs):
    """Keys coded across heads lay every head's RoPE pairs side by side, turned alike: one
    head's table repeated by the kernels (``rotation_repeats``) gives the bits of the table
    spelled out, prepared or not, and keys prepared with other repeats are refused."""
    one = np.ascontiguousarray(inputs["rotation"][..., : D // 4])  # 16 of the 32 pairs
    spelled = np.ascontiguousarray(np.concatenate([one, one], axis=-1))
    for precision in ("float32", "int16"):
        want = attend(inputs, precision, rotation=spelled)
        assert not np.array_equal(attend(inputs, precision, rotation=one), want)
        np.testing.assert_array_equal(attend(inputs, precision, rotation=one, repeats=2), want)
        made = prepare(inputs, precision, background=False, rotation=one, repeats=2)
        got = attend(inputs, precision, made, rotation=one, repeats=2)
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="other rotation"):
        attend(inputs, "int16", made, rotation=one)
    with pytest.raises(ValueError, match="repeated 3 times"):  # 48 pairs of 32
        attend(inputs, "float32", rotation=one, repeats=3)


def test_no_background_preparation_on_torch_threads(inputs):
    """With torch on several threads the codec runs on torch's team: no worker is idle."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert prepare(inputs, "float32", background=True) is None
        made = prepare(inputs, "float32", background=False)  # made now, on the team
        np.testing.assert_array_equal(attend(inputs, "float32", made), attend(inputs, "float32"))
    finally:
        torch.set_num_threads(before)


@torch.inference_mode()
def test_keys_prepared_ahead_change_no_bit_of_generation(model_dir, monkeypatch):
    """Decode steps over a real model's blocks, with the next one or two layers' keys made
    ahead and without: the same logits bit for bit, and the prepared keys were read (a flush in
    between drops them: the blocks changed)."""
    model = load_model(model_dir)[0]
    used = []
    real = CodedView._prepared

    def counted(self):
        made = real(self)
        used.append(made is not None)
        return made

    monkeypatch.setattr(CodedView, "_prepared", counted)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, model.config.vocab_size, (1, 420), generator=g)
    runs = {}
    for ahead in (0, 1, 2):
        used.clear()
        monkeypatch.setattr(coded_attention, "LAYERS_AHEAD", max(ahead, 1))
        cache = KakeyaCache.from_model(
            model,
            recipe=default_recipe(block_size=64),
            options=KakeyaOptions(prepare_keys_ahead=ahead > 0),
        )
        out = [model(ids[:, :300], **{CACHE_ARG: cache}, use_cache=True).logits]
        for t in range(300, 420):  # 120 steps: flushes at 64-token boundaries
            out.append(model(ids[:, t : t + 1], **{CACHE_ARG: cache}, use_cache=True).logits)
        runs[ahead] = out
        assert any(used) == (ahead > 0 and kt._core._workers()[1] > 1)
    for ahead in (1, 2):
        for a, b in zip(runs[0], runs[ahead]):
            assert torch.equal(a, b)
    with pytest.raises(TypeError, match="prepare_keys_ahead"):
        KakeyaOptions(prepare_keys_ahead="yes")
