"""One coding frame across a layer's KV heads (``calibrate --joint-heads``): the bundle's
frames are rotations and are checked as such on load, the pipeline codes a layer's heads as one
stream and decodes them back, and ``KakeyaCache`` stores and generates with it (attention over
such codes against decoding: ``tests/integration/test_hf_coded_attention.py``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kakeyaturbo.calibration import Calibration, CalibrationError, KVTransforms, calibrate
from kakeyaturbo.gpu.device_decode import DeviceBlocks
from kakeyaturbo.hf import CACHE_ARG, KakeyaCache
from kakeyaturbo.pipeline import Pipeline
from kakeyaturbo.recipes import default_recipe

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def joint_bundle(model_and_tok, calib_text, tmp_path_factory):
    model, tok = model_and_tok
    calib = calibrate(model, tok, calib_text, tokens=4096, progress=False, joint_heads=True)
    return calib, calib.save(tmp_path_factory.mktemp("joint"))


def test_joint_frames_are_rotations_and_survive_save_and_load(joint_bundle, model_and_tok):
    calib, path = joint_bundle
    heads, d = calib.fingerprint["num_key_value_heads"], calib.fingerprint["head_dim"]
    loaded = Calibration.load(path, model_and_tok[0])
    assert loaded.joint_heads and loaded.meta["joint_heads"] is True
    assert default_recipe(loaded).joint_heads
    for name in ("k_joint", "v_joint"):
        j = loaded.tensors[name].astype(np.float64)
        assert j.shape == (calib.num_layers, heads * d, heads * d)
        eye = np.broadcast_to(np.eye(heads * d), j.shape)
        np.testing.assert_allclose(np.swapaxes(j, -1, -2) @ j, eye, atol=1e-4)
        np.testing.assert_array_equal(loaded.tensors[name], calib.tensors[name])


@pytest.mark.parametrize("damage", ["scaled", "unpaired", "shape"])
def test_a_bundle_with_a_bad_joint_frame_is_refused(joint_bundle, damage):
    calib, _ = joint_bundle
    tensors = dict(calib.tensors)
    if damage == "scaled":  # not a rotation: decoding by its transpose would be wrong
        tensors["v_joint"] = tensors["v_joint"] * 1.01
    elif damage == "unpaired":
        del tensors["v_joint"]
    else:
        tensors["k_joint"] = tensors["k_joint"][:, :-1, :-1]
    bad = Calibration(calib.fingerprint, tensors, calib.meta)
    with pytest.raises(CalibrationError, match="joint"):
        bad._check_tensors()


def _coding_error(pipe: Pipeline, transforms: KVTransforms, real_kv, layers: int):
    """Summed over the layers: keys' squared error in the query-aware frame (the expected
    squared logit error), values' squared error, relative to the signals; the bytes."""
    err = {"k": [0.0, 0.0], "v": [0.0, 0.0]}
    nbytes = 0
    for layer in range(layers):
        for s, name in (("k", "k_pre_rope"), ("v", "v")):
            x = torch.from_numpy(real_kv[f"layer{layer}.{name}"])[None]
            y, blocks = pipe.roundtrip(x, layer, s)
            e, ref = y - x, x
            if s == "k":
                e, ref = transforms.forward(e, layer, "k"), transforms.forward(x, layer, "k")
            err[s][0] += float((e**2).sum())
            err[s][1] += float((ref**2).sum())
            nbytes += sum(b.nbytes for b in blocks)
    return {s: num / den for s, (num, den) in err.items()}, nbytes


def test_one_frame_across_heads_codes_better_at_equal_bits(joint_bundle, real_kv):
    calib, _ = joint_bundle
    transforms = KVTransforms(calib)
    recipe = default_recipe(calib)
    per_head, per_head_bytes = _coding_error(
        Pipeline(recipe.replace(joint_heads=False), calib), transforms, real_kv, calib.num_layers
    )
    joint, joint_bytes = _coding_error(
        Pipeline(recipe, calib), transforms, real_kv, calib.num_layers
    )
    # Same bits per value: the bytes differ only by the streams' headers (one per row, not
    # one per head) and the water-filling's rounding.
    assert abs(joint_bytes - per_head_bytes) <= 0.01 * per_head_bytes
    # kt-ref-a (2 KV heads, calibration text only): keys -10%, values -35% measured.
    assert joint["k"] < 0.97 * per_head["k"]
    assert joint["v"] < 0.85 * per_head["v"]


def test_joint_round_trip_is_near_exact_at_high_bits(joint_bundle, real_kv):
    calib, _ = joint_bundle
    recipe = default_recipe(calib)
    recipe = recipe.replace(
        k=recipe.k.replace(bits_per_value=8.0), v=recipe.v.replace(bits_per_value=8.0)
    )
    pipe = Pipeline(recipe.replace(k_layer_bits=(), v_layer_bits=()), calib)
    for s, name in (("k", "k_pre_rope"), ("v", "v")):
        x = torch.from_numpy(real_kv[f"layer1.{name}"])[None]
        y, blocks = pipe.roundtrip(x, 1, s)
        assert all(len(b.encs) == 1 for b in blocks)  # one stream per row: the heads together
        assert float((y - x).norm() / x.norm()) < 0.02
        if s == "v":  # each head's norm is stored and given back (norm codes: within 1.1%)
            ratio = y.norm(dim=-1) / x.norm(dim=-1)
            assert float((ratio - 1).abs().max()) < 0.012


def test_blocks_coded_on_the_device_are_those_coded_on_the_host(joint_bundle, real_kv):
    # A cache holding its blocks on the model's device codes them there
    # (Pipeline.encode_on_device): across heads, each head's scale (the values' token norms)
    # from the device's own decode, the same tensors as the host's blocks copied over.
    # Every layer at once (a cache's flush at a forward's end), each at its own rate: each
    # layer's blocks are those it codes alone.
    calib, _ = joint_bundle
    layers = range(calib.num_layers)
    offsets = tuple(0.5 * (li % 3) - 0.5 for li in layers)  # as a sensitivity scan gives
    recipe = default_recipe(calib).replace(k_layer_bits=offsets, v_layer_bits=offsets[::-1])
    assert len({recipe.params(li, "k").bits_per_value for li in layers}) > 1
    for s, name in (("k", "k_pre_rope"), ("v", "v")):
        xs = [torch.from_numpy(real_kv[f"layer{li}.{name}"])[None] for li in layers]
        spans = [(x, li, None, None) for li, x in zip(layers, xs)]
        together = Pipeline(recipe, calib).encode_layers_on_device(spans, s)
        for li, x, held in zip(layers, xs, together):
            host = DeviceBlocks.of(Pipeline(recipe, calib).encode(x, li, s), torch.device("cpu"))
            assert (held.streams, held.tokens, held.blocks) == (1, 1024, 4)
            run, ref = held.runs[0][0], host.runs[0][0]
            for f in dataclasses.fields(run):
                a, b = getattr(run, f.name), getattr(ref, f.name)
                assert not isinstance(a, torch.Tensor) or torch.equal(a, b), (li, f.name)
            assert (held.norms is None) == (host.norms is None) == (not recipe.token_norms(s))
            if held.norms is not None:
                for a, b in zip(held.norms.runs[0], host.norms.runs[0]):
                    assert torch.equal(a, b)


def test_one_stream_across_heads_leaves_the_other_per_head(joint_bundle, real_kv):
    """``joint_heads="v"`` (or ``"k"``): that stream is coded exactly as the joint recipe
    codes it, the other exactly as the per-head recipe does, bit for bit."""
    calib, _ = joint_bundle
    recipe = default_recipe(calib)
    assert recipe.joint_heads == "kv" and recipe.replace(joint_heads=False).joint_heads == ""
    per_head, joint = Pipeline(recipe.replace(joint_heads=""), calib), Pipeline(recipe, calib)
    for mixed in ("k", "v"):
        pipe = Pipeline(recipe.replace(joint_heads=mixed), calib)
        for s, name in (("k", "k_pre_rope"), ("v", "v")):
            x = torch.from_numpy(real_kv[f"layer1.{name}"])[None]
            y, blocks = pipe.roundtrip(x, 1, s)
            same_as = joint if s == mixed else per_head
            y_ref, ref_blocks = same_as.roundtrip(x, 1, s)
            assert torch.equal(y, y_ref)
            assert [len(b.encs) for b in blocks] == [len(b.encs) for b in ref_blocks]
            assert all(len(b.encs) == (1 if s == mixed else x.shape[1]) for b in blocks)
    with pytest.raises(ValueError, match="joint_heads must be"):
        recipe.replace(joint_heads="q")
    # only coded keys are read in the query-aware frame the joint key frames are fitted in
    Pipeline(recipe.replace(joint_heads="v", whiten=False), calib)


def test_frames_across_heads_are_derived_once_per_bundle(joint_bundle):
    """What attention reads (the joint frame times the heads' inverse frames) is bundle data:
    every pipeline on one bundle, every cache and sequence, shares one tensor; none holds
    its own (8.8 MB per cache on SmolLM2 when each did)."""
    calib, _ = joint_bundle
    a, b = Pipeline(default_recipe(calib), calib), Pipeline(default_recipe(calib), calib)
    assert a.joint_frame(1, "k") is b.joint_frame(1, "k") is a.fresh().joint_frame(1, "k")
    assert a.joint_frame(1, "v") is not a.joint_frame(1, "k")
    # Its columns in attention's RoPE layout, and each head's slice of the value frame, too.
    whole = a.joint_frame(1, "k")
    flipped = ("flipped", torch.arange(whole.shape[1]).flip(0))
    assert a.joint_frame(1, "k", flipped) is b.joint_frame(1, "k", flipped)
    assert torch.equal(a.joint_frame(1, "k", flipped), whole.flip(1))
    heads = a.joint_head_frames(1, "v")
    assert heads is b.joint_head_frames(1, "v") and heads.is_contiguous()
    assert torch.equal(torch.cat(list(heads), dim=1), a.joint_frame(1, "v"))
    # So are the bundle's matrices copied to the device a model runs on.
    m = a._transforms.matrix(1, "k", "inv")
    meta = torch.device("meta")
    on_a = a._transforms.on(m, (1, "k", "inv"), meta)
    assert on_a.device == meta and on_a is b._transforms.on(m, (1, "k", "inv"), meta)
    assert "derived" not in repr(calib)


def test_joint_heads_needs_a_bundle_with_joint_frames(model_and_tok, calib_text, joint_bundle):
    calib, _ = joint_bundle
    with pytest.raises(ValueError, match="--joint-heads"):
        Pipeline(default_recipe(calib))
    tensors = {k: v for k, v in calib.tensors.items() if not k.endswith("_joint")}
    plain = Calibration(calib.fingerprint, tensors, calib.meta)
    with pytest.raises(ValueError, match="--joint-heads"):
        Pipeline(default_recipe(calib), plain)
    with pytest.raises(ValueError, match="whitened"):
        Pipeline(default_recipe(calib).replace(whiten=False), calib)
    model, tok = model_and_tok
    with pytest.raises(ValueError, match="value_metric"):
        calibrate(
            model,
            tok,
            calib_text,
            tokens=1024,
            progress=False,
            joint_heads=True,
            value_metric="output",
        )


@pytest.mark.parametrize("beams", [1, 3])
def test_cache_with_joint_frames_generates_and_accounts_its_bytes(
    model_and_tok, joint_bundle, eval_text, beams
):
    from kakeyaturbo.capture import read_tokens

    model, tok = model_and_tok
    _, path = joint_bundle
    ids = torch.tensor([read_tokens(tok, eval_text, 700, offset_chars=20_000)])
    cache = KakeyaCache.from_model(model, calibration=str(path))
    with torch.inference_mode():
        got = model.generate(
            ids, **{CACHE_ARG: cache}, max_new_tokens=6, do_sample=False, num_beams=beams
        )
        ref = model.generate(ids, max_new_tokens=6, do_sample=False, num_beams=beams)
    # Greedy on kt-ref-a: the first new tokens agree with the exact cache.
    assert got[0, ids.shape[1] : ids.shape[1] + 3].tolist() == ref[0, ids.shape[1] :][:3].tolist()
    layer = cache.layers[0]
    assert layer._blocks and all(len(b.k.encs) == layer._rows for b in layer._blocks)
    held = sum(b.k.nbytes + b.v.nbytes for lay in cache.layers for b in lay._blocks)
    if beams == 1:  # (beams may share a block's streams, which the report counts once)
        assert cache.memory_report()["compressed_bytes"] == held > 0


def test_calibrate_command_defaults_to_joint_frames_and_both_scans(tmp_path):
    """What `kakeyaturbo calibrate` fits with no flags: joint frames (resolved by calibrate(),
    off with --value-metric output) and per-layer bits from both scans."""
    from kakeyaturbo.cli import build_parser

    (tmp_path / "m").mkdir()  # the command checks that the model folder and the text exist
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "t").write_text("text")
    model, text = str(tmp_path / "m"), str(tmp_path / "t")
    data = ["calibrate", "--model", model, "--text", text, "--out", str(tmp_path / "o")]
    args = build_parser("calibrate").parse_args(data)
    assert args.joint_heads is None and args.sensitivity_mode == "both"
    assert build_parser("calibrate").parse_args([*data, "--no-joint-heads"]).joint_heads is False
    assert build_parser("calibrate").parse_args([*data, "--joint-heads"]).joint_heads is True


@pytest.mark.parametrize(
    ("kv_heads", "head_dim", "joint"),
    [(3, 64, True), (2, 64, True), (8, 64, True), (1, 256, False), (8, 128, False)],
    ids=["smollm2", "kt-ref-a", "llama-3.2-1b", "gemma-3-1b", "llama-3-8b"],
)
def test_frames_across_heads_by_default_where_they_fit(kv_heads, head_dim, joint):
    """One KV head has nothing to share; past 512 values a layer keeps per-head frames (the
    frames grow with the square of the width, attention's frame product with the heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kakeyaturbo.calibration.fit import default_joint_heads

    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=48 * kv_heads,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=kv_heads * 2,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
    )
    assert default_joint_heads(LlamaForCausalLM(cfg)) is joint
