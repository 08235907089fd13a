"""Calibration bundles: exact whitening round trips, the query-aware metric, save/load,
and rejection of bundles made for another model."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import kakeyaturbo as kt
from kakeyaturbo.calibration import Calibration, CalibrationError, KVTransforms, calibrate


@pytest.fixture(scope="module")
def bundle(model_and_tok, calib_text, tmp_path_factory):
    model, tok = model_and_tok
    # Per-head frames (tests/integration/test_joint_heads.py has the default's frames across heads).
    calib = calibrate(model, tok, calib_text, tokens=4096, progress=False, joint_heads=False)
    path = calib.save(tmp_path_factory.mktemp("calib"))
    return calib, path


def test_transforms_round_trip_exactly(bundle, real_kv):
    calib, _ = bundle
    t = KVTransforms(calib)
    for layer in range(calib.num_layers):
        for stream in ("k_pre_rope", "v"):
            x = torch.from_numpy(real_kv[f"layer{layer}.{stream}"])[None]
            s = stream[0]
            back = t.inverse(t.forward(x, layer, s), layer, s)
            torch.testing.assert_close(back, x, rtol=1e-4, atol=1e-4 * float(x.abs().max()))


def test_whitened_error_is_the_expected_logit_error(bundle):
    """|e @ L|^2 = e^T M e = E[(q . e)^2] over calibration queries (up to the ridge)."""
    calib, _ = bundle
    m = calib.tensors["q_second_moment"].astype(np.float64)
    tk = calib.tensors["k_transform"].astype(np.float64)
    ridge = calib.meta["ridge"]
    rng = np.random.default_rng(0)
    for layer in range(calib.num_layers):
        for h in range(m.shape[1]):
            e = rng.standard_normal((100, m.shape[-1]))
            lhs = ((e @ tk[layer, h]) ** 2).sum(1)
            mr = m[layer, h] + ridge * np.trace(m[layer, h]) / m.shape[-1] * np.eye(m.shape[-1])
            rhs = np.einsum("nd,de,ne->n", e, mr, e)
            np.testing.assert_allclose(lhs, rhs, rtol=2e-3)


def test_output_weighted_value_frame_weighs_errors_as_the_output_sees_them(
    model_and_tok, calib_text, real_kv, tmp_path
):
    """With ``value_metric="output"``: |e @ T_v|^2 = e^T M e for M = sum_j W_j^T W_j over the
    query heads reading the KV head (scaled to mean eigenvalue 1, ridged), the saved bundle
    holds T_v's inverse, and values round-trip through it."""
    from kakeyaturbo.calibration.fit import value_output_metrics

    model, tok = model_and_tok
    calib = calibrate(model, tok, calib_text, tokens=2048, progress=False, value_metric="output")
    loaded = Calibration.load(calib.save(tmp_path), model)
    assert loaded.meta["value_metric"] == "output"
    tv, inv = loaded.tensors["v_transform"].astype(np.float64), loaded.tensors["v_inverse"]
    metrics = value_output_metrics(model)
    d = tv.shape[-1]
    # Query head j reads KV head j // group (HF's repeat_kv); its columns of o_proj are j's.
    w = model.model.layers[0].self_attn.o_proj.weight.detach().double().numpy()
    group = model.config.num_attention_heads // tv.shape[1]
    for h in range(tv.shape[1]):
        cols = [w[:, j * d : (j + 1) * d] for j in range(h * group, (h + 1) * group)]
        np.testing.assert_allclose(metrics[0][h], sum(c.T @ c for c in cols), rtol=1e-10)
    rng = np.random.default_rng(1)
    for layer in (0, calib.num_layers - 1):
        for h in range(tv.shape[1]):
            m = metrics[layer][h] / (np.trace(metrics[layer][h]) / d)
            m = m + calib.meta["ridge"] * np.eye(d)
            e = rng.standard_normal((50, d))
            lhs = ((e @ tv[layer, h]) ** 2).sum(1)
            np.testing.assert_allclose(lhs, np.einsum("nd,de,ne->n", e, m, e), rtol=2e-3)
            np.testing.assert_allclose(tv[layer, h] @ inv[layer, h], np.eye(d), atol=1e-4)
        t = KVTransforms(loaded)
        x = torch.from_numpy(real_kv[f"layer{layer}.v"])[None]
        back = t.inverse(t.forward(x, layer, "v"), layer, "v")
        torch.testing.assert_close(back, x, rtol=1e-4, atol=1e-4 * float(x.abs().max()))
    assert loaded.meta["joint_heads"] is False  # joint frames by default, never with this metric
    # Values as they are: the orthonormal frame and no inverse beside it.
    plain = calibrate(model, tok, calib_text, tokens=1024, progress=False, value_metric="none")
    assert "v_inverse" not in plain.tensors and plain.meta["value_metric"] == "none"


def test_key_frame_variances_are_sorted_and_match(bundle, real_kv):
    calib, _ = bundle
    var = calib.tensors["k_variances"]
    assert (np.diff(var, axis=-1) <= 1e-6 * var.max()).all()
    # On held-out text the frame still concentrates energy in the leading components.
    t = KVTransforms(calib)
    y = t.forward(torch.from_numpy(real_kv["layer2.k_pre_rope"])[None], 2, "k")[0]
    energy = (y.double() ** 2).mean(1)  # [heads, D]
    head_share = energy[:, :16].sum(1) / energy.sum(1)
    assert (head_share > 0.5).all(), head_share


def test_saved_and_loaded_bundle_gives_identical_encodes(bundle, real_kv, model_and_tok):
    calib, path = bundle
    loaded = Calibration.load(path, model_and_tok[0])
    assert loaded.fingerprint == calib.fingerprint
    for name, arr in calib.tensors.items():
        np.testing.assert_array_equal(loaded.tensors[name], arr.astype(np.float32))
    x = torch.from_numpy(real_kv["layer1.k_pre_rope"])[None]
    p = kt.CodecParams(allocation="waterfill", k=0, pca_method="none", bits_per_value=2.0)
    enc_a = kt.encode_batch(KVTransforms(calib).forward(x, 1, "k")[0], p)
    enc_b = kt.encode_batch(KVTransforms(loaded).forward(x, 1, "k")[0], p)
    assert [e.to_bytes() for e in enc_a] == [e.to_bytes() for e in enc_b]


def test_bundle_for_another_model_is_rejected(bundle, model_and_tok, tmp_path):
    from transformers import LlamaConfig

    _, path = bundle
    other = LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=6,
        intermediate_size=256,
        vocab_size=100,
    )
    with pytest.raises(CalibrationError, match="another model"):
        Calibration.load(path, other)
    model = model_and_tok[0]
    w = model.model.layers[0].self_attn.k_proj.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.mul_(1.01)  # same architecture, other weights
        with pytest.raises(CalibrationError, match="k_proj0_probe"):
            Calibration.load(path, model)
        for dtype in (torch.bfloat16, torch.float16):  # the same checkpoint in another dtype
            with torch.no_grad():
                w.copy_(saved.to(dtype).float())
            Calibration.load(path, model)
    finally:
        with torch.no_grad():
            w.copy_(saved)
    Calibration.load(path, model)
    # A fine-tune of the values (or queries) alone, here the last layer's: another model.
    v = model.model.layers[-1].self_attn.v_proj.weight
    saved = v.detach().clone()
    try:
        with torch.no_grad():
            v.mul_(1.01)
        with pytest.raises(CalibrationError, match="qkv_probe"):
            Calibration.load(path, model)
    finally:
        with torch.no_grad():
            v.copy_(saved)
    Calibration.load(path, model)


def test_bundles_with_the_legacy_weight_hash_still_check_it(bundle, model_and_tok, tmp_path):
    """Bundles written before the probe hold a hash of the float32 weights instead: they load
    for those weights and name the hash for any others."""
    calib, _ = bundle
    model = model_and_tok[0]
    w = model.model.layers[0].self_attn.k_proj.weight
    fp = {k: v for k, v in calib.fingerprint.items() if k != "k_proj0_probe"}
    bits = np.ascontiguousarray(w.detach().float().numpy()).tobytes()
    fp["k_proj0_sha256"] = hashlib.sha256(bits).hexdigest()[:16]
    path = replace(calib, fingerprint=fp).save(tmp_path / "legacy")
    Calibration.load(path, model)
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.copy_(saved.bfloat16().float())
        with pytest.raises(CalibrationError, match="k_proj0_sha256.*recalibrate"):
            Calibration.load(path, model)
    finally:
        with torch.no_grad():
            w.copy_(saved)


def test_malformed_bundles_are_clear_errors(bundle, tmp_path):
    _, path = bundle
    with pytest.raises(CalibrationError, match="not a calibration bundle"):
        Calibration.load(tmp_path)
    bad = tmp_path / "v2"
    shutil.copytree(path, bad)
    meta = json.loads((bad / "calibration.json").read_text())
    meta["version"] = 2
    (bad / "calibration.json").write_text(json.dumps(meta))
    with pytest.raises(CalibrationError, match="version 2"):
        Calibration.load(bad)
    (bad / "calibration.json").write_text("{not json")
    with pytest.raises(CalibrationError, match="JSON"):
        Calibration.load(bad)


@torch.inference_mode()
def test_hf_cache_with_calibration_tracks_dynamic_cache(bundle, model_and_tok, eval_text):
    from transformers import DynamicCache

    from kakeyaturbo.capture import read_tokens
    from kakeyaturbo.hf import CACHE_ARG, KakeyaCache

    model, tok = model_and_tok
    _, path = bundle
    ids = torch.tensor([read_tokens(tok, eval_text, 664, offset_chars=50_000)])
    cache = KakeyaCache.from_model(model, calibration=path, residual_length=64)
    assert cache.pre_rope and cache.calibration is not None
    ref = DynamicCache(config=model.config)
    model(ids[:, :600], **{CACHE_ARG: cache})
    model(ids[:, :600], **{CACHE_ARG: ref})
    a = model(ids[:, 600:], **{CACHE_ARG: cache}).logits.argmax(-1)
    b = model(ids[:, 600:], **{CACHE_ARG: ref}).logits.argmax(-1)
    assert (a == b).float().mean() >= 0.9
    rep = cache.memory_report()
    assert rep["compressed_bytes"] > 0 and rep["ratio_vs_bf16"] > 1.5
    # The bundle's frames are used: no frame is fitted or held per sequence.
    assert cache._ctx.pipeline.calibration is cache.calibration
    assert cache._ctx.pipeline.frame_bytes() == 0
    with pytest.raises(ValueError, match="pre_rope=False contradicts"):
        KakeyaCache.from_model(model, calibration=path, pre_rope=False)


def test_layer_offsets_follow_sensitivity_with_zero_mean_and_clip():
    from kakeyaturbo.calibration.sensitivity import MAX_OFFSET, joint_offsets, layer_offsets

    off = layer_offsets([1e-2, 1e-3, 1e-4, 1e-5, 1e-6])
    assert abs(sum(off)) < 1e-3 and max(map(abs, off)) <= MAX_OFFSET
    # 10x the KL is worth log2(10) / 2 = 1.66 bits; the clip holds both ends.
    assert off == [MAX_OFFSET, MAX_OFFSET, 0.0, -MAX_OFFSET, -MAX_OFFSET]
    assert layer_offsets([4e-4, 1e-4]) == [1.0 / 2, -1.0 / 2]
    # Jointly, the more sensitive stream gets the bits.
    j = joint_offsets({"k": [1e-4, 1e-4], "v": [4e-4, 4e-4]})
    assert j["v"][0] - j["k"][0] == pytest.approx(1.0, abs=1e-3)
    # Layers held exact (KL 0) get no offset and leave the coded layers' bits alone: with
    # their KL floored into the mean they would take -1.5 and push the others to +1.5.
    kl = {"k": [1e-4, 0.0, 0.0, 2e-4], "v": [4e-4, 0.0, 0.0, 1e-4]}
    held = joint_offsets(kl, frozenset({1, 2}))
    alone = joint_offsets({s: [kl[s][0], kl[s][3]] for s in "kv"})
    assert held == {s: [alone[s][0], 0.0, 0.0, alone[s][1]] for s in "kv"}
    assert max(joint_offsets(kl)["k"]) == MAX_OFFSET


@pytest.mark.slow
def test_sensitivity_scan_modes(bundle, model_and_tok, calib_text):
    from kakeyaturbo.calibration.sensitivity import joint_offsets
    from kakeyaturbo.eval.sensitivity import scan

    model, tok = model_and_tok
    kw = dict(passages=1, ctx=128, n_eval=16, progress=False)
    snap = scan(model, tok, bundle[1], calib_text, mode="snapshot", **kw)
    fwd = scan(model, tok, bundle[1], calib_text, mode="in-forward", **kw)
    both = scan(model, tok, bundle[1], calib_text, mode="both", **kw)
    n = model.config.num_hidden_layers
    geo = {s: [(a * b) ** 0.5 for a, b in zip(snap["kl"][s], fwd["kl"][s])] for s in "kv"}
    for s in "kv":
        assert len(snap["kl"][s]) == n and min(snap["kl"][s]) > 0
        # The top layer's error reaches no layer above it: both protocols agree there.
        assert fwd["kl"][s][-1] == pytest.approx(snap["kl"][s][-1], rel=1e-4)
        assert both["kl"][s] == pytest.approx(geo[s])
        assert both["kl_by_mode"]["in-forward"][s] == pytest.approx(fwd["kl"][s])
    # Errors carried through the layers above cost more than one layer's error alone.
    assert sum(fwd["kl"]["k"] + fwd["kl"]["v"]) > sum(snap["kl"]["k"] + snap["kl"]["v"])
    assert abs(sum(both["offsets"]["k"] + both["offsets"]["v"])) < 1e-3
    assert both["blend"] == "geometric mean" and "blend" not in snap
    want = joint_offsets(geo)
    for s in "kv":
        assert both["offsets"][s] == pytest.approx(want[s], abs=2e-4)
    with pytest.raises(ValueError, match="mode"):
        scan(model, tok, bundle[1], calib_text, mode="chunked", **kw)
    # Measured in-forward KLs (a prefill per stream; the estimate's accuracy is test_fisher.py's).
    measured = scan(model, tok, bundle[1], calib_text, mode="in-forward", exact=True, **kw)
    for s in "kv":
        assert measured["kl"][s][-1] == pytest.approx(snap["kl"][s][-1], rel=1e-4)
    assert sum(measured["kl"]["k"] + measured["kl"]["v"]) > sum(snap["kl"]["k"] + snap["kl"]["v"])


def test_post_rope_moments_rotate_queries_and_keys_only(model_and_tok, calib_text):
    # collect_moments(rope=...) (the post-RoPE key-frame probe): RoPE is a rotation, so each
    # head's second moments keep their trace while the matrices change; values are untouched.
    from kakeyaturbo.calibration.fit import collect_moments
    from kakeyaturbo.hf.rope import ModelRope

    model, tok = model_and_tok
    ids = tok(Path(calib_text).read_text()[:20000], add_special_tokens=False)["input_ids"][:512]
    pre = collect_moments(model, ids, ctx=256, progress=False)
    post = collect_moments(model, ids, ctx=256, progress=False, rope=ModelRope(model.config))
    for a, b in zip(pre, post):
        np.testing.assert_array_equal(a.vv, b.vv)
        for x, y in ((a.kk, b.kk), (a.qq, b.qq)):
            trace = np.trace(x, axis1=1, axis2=2)
            np.testing.assert_allclose(np.trace(y, axis1=1, axis2=2), trace, rtol=1e-5)
            assert np.abs(x - y).max() > 1e-3 * np.abs(x).max()
