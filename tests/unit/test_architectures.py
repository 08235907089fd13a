"""Architecture generality: the evaluation, the calibration and ``KakeyaCache`` (its cache
tests in ``test_architectures_cache.py``) on tiny randomly initialised Gemma 3-style models
(sliding and full layers with their own RoPE, head_dim 256, one KV head, q/k norms applied
after the head transpose) and Qwen3-style models (q_norm/k_norm before RoPE, applied before
the head transpose).

What would catch real bugs:

- pre-RoPE keys: the module ``pre_rope_modules(attn)[1]`` outputs must equal the cached keys
  with ``ModelRope(config)`` undone at the right positions, for every layer type (Gemma 3's full
  and sliding layers use different rope thetas); the harness, the cache's pipeline, the
  calibration and the capture must all see exactly those keys;
- accuracy: 8 bits per value must agree with the uncompressed model far better than 1 bit
  (note a wrong RoPE table alone would not show here: un-rotating and re-rotating with the same
  wrong table is still an identity, hence the direct pre-RoPE checks);
- bytes: the ratio counts what the cache holds.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

kt = pytest.importorskip("kakeyaturbo")
pytest.importorskip("kakeyaturbo.hf")
from tiny_archs import (  # noqa: E402
    ARCH_MODES,
    ARCHS,
    BLOCK,
    CALIB_CTX,
    CALIB_TOKENS,
    CTX,
    GEMMA3_TYPES,
    MODES,
    N_EVAL,
    P8,
    WINDOW,
    bundle,
    hand_moments,
    pre_rope_qkv,
    sliding_layers,
    tiny,
    token_ids,
)
from transformers import DynamicCache  # noqa: E402

from kakeyaturbo.calibration import Calibration  # noqa: E402
from kakeyaturbo.calibration.fit import collect_moments  # noqa: E402
from kakeyaturbo.eval import hot_window  # noqa: E402
from kakeyaturbo.eval.harness import evaluate_method, prepare_reference  # noqa: E402
from kakeyaturbo.eval.methods import Method, MethodOptions  # noqa: E402
from kakeyaturbo.hf import KakeyaCache  # noqa: E402
from kakeyaturbo.hf.layer_plan import LayerKind  # noqa: E402
from kakeyaturbo.hf.rope import ModelRope  # noqa: E402
from kakeyaturbo.modeling import Passage, pre_rope_modules  # noqa: E402

try:  # build_method is moving from eval.methods to eval.registry
    from kakeyaturbo.eval.registry import build_method  # noqa: E402
except ImportError:  # pragma: no cover
    from kakeyaturbo.eval.methods import build_method  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]  # see conftest


@functools.cache
def reference(arch: str):
    ids = token_ids(2, CTX + N_EVAL + 1)
    passages = [Passage(i, 0, ids[i]) for i in range(2)]
    return prepare_reference(tiny(arch), passages, CTX, N_EVAL, batch=2)


def evaluate(arch: str, spec: str, mode: str, method=None):
    method = method if method is not None else build_method(spec)
    return evaluate_method(tiny(arch), reference(arch), method, mode)


def test_configs_exercise_what_they_claim():
    g = tiny("gemma3").config
    assert (g.head_dim, g.num_key_value_heads) == (256, 1)
    thetas = {t: g.rope_parameters[t]["rope_theta"] for t in set(GEMMA3_TYPES)}
    assert thetas["sliding_attention"] != thetas["full_attention"]  # per-layer-type RoPE
    rope = ModelRope(g)
    assert not torch.equal(rope(0).inv_freq, rope(1).inv_freq)
    assert torch.equal(rope(1).inv_freq, rope(3).inv_freq)
    for arch in ARCHS:
        attn = tiny(arch).model.layers[0].self_attn
        assert pre_rope_modules(attn)[1] is attn.k_norm


# ---- 2. pre-RoPE keys ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_model_rope_undoes_each_layers_rope(arch):
    """``ModelRope(config).unrotate`` of the DynamicCache's keys equals k_norm's output, for
    every layer type; a sliding layer holds the last window-1 tokens."""
    model = tiny(arch)
    t = 200  # more than the sliding window
    cache = DynamicCache(config=model.config)
    pre = pre_rope_qkv(model, token_ids(1, t), cache)
    rope = ModelRope(model.config)
    sliding = sliding_layers(model)
    for li, layer in enumerate(cache.layers):
        keys = layer.keys
        held = keys.shape[2]
        assert held == (WINDOW - 1 if li in sliding else t)
        k_pre = pre[li][1][:, :, t - held :]
        torch.testing.assert_close(rope.unrotate(keys, li, t - held), k_pre, atol=1e-4, rtol=0)
        torch.testing.assert_close(rope.rotate(k_pre, li, t - held), keys, atol=1e-4, rtol=0)
    if sliding:
        # The test discriminates: the other layer type's table does not undo a full layer.
        wrong = rope(sliding[0]).unrotate(cache.layers[1].keys, torch.arange(t)[None])
        assert (wrong - pre[1][1]).abs().max() > 0.1


class _Record(Method):
    """Hands every stream back unchanged and keeps the keys it was given."""

    name = "record"

    def __init__(self, sliding: str = "exact"):
        super().__init__({})
        self.spec = "record"
        self.options = MethodOptions(pre_rope=True, passthrough="exact", sliding=sliding)
        self.keys: dict[int, torch.Tensor] = {}

    def compress(self, x, layer, stream):
        if stream == "k":
            self.keys[layer] = x.clone()
        return x, [{"codes": 0} for _ in range(x.shape[0])]


@pytest.mark.parametrize("sliding", ["exact", "code"])
@pytest.mark.parametrize("arch, mode", ARCH_MODES)
def test_harness_hands_pre_rope_keys(arch, mode, sliding):
    """With pre_rope=true the method receives exactly k_norm's output, for every layer it codes:
    the full-attention ones (sliding layers are held as computed, as KakeyaCache holds them),
    and with sliding=code the sliding ones too, their window at its own positions (the last
    call of an in-forward prefill is the window the layer keeps)."""
    model, ref = tiny(arch), reference(arch)
    method = _Record(sliding)
    row = evaluate(arch, "", mode, method)
    # exact but for the float rounding of un-rotating and re-rotating
    assert row["kl"] < 1e-9 and row["top1"] == 1.0
    pre = pre_rope_qkv(model, torch.cat([b.prefix for b in ref.batches]))
    windows = sliding_layers(model)
    coded = [i for i in range(len(model.model.layers)) if sliding == "code" or i not in windows]
    assert sorted(method.keys) == coded
    for li, got in method.keys.items():
        held = got.shape[2]
        assert held == (WINDOW - 1 if li in windows else CTX)
        torch.testing.assert_close(got, pre[li][1][:, :, CTX - held :], atol=1e-4, rtol=0)


@pytest.mark.parametrize("mode", MODES)
def test_eval_codes_sliding_windows_and_counts_what_they_hold(mode):
    """With sliding=code the sliding layers' windows are coded and only what they hold is
    counted: in every protocol the bytes are the snapshot's (KIVI's bytes follow the tokens
    held), below the windows held exact, and the error grows."""
    held = evaluate("gemma3", "kivi:bits=4", mode)
    coded = evaluate("gemma3", "kivi:bits=4,sliding=code", mode)
    snapshot = evaluate("gemma3", "kivi:bits=4,sliding=code", "snapshot")
    assert coded["stored_bytes"] == snapshot["stored_bytes"] < held["stored_bytes"]
    assert coded["bf16_bytes"] == held["bf16_bytes"]
    assert coded["kl"] > held["kl"]
    with pytest.raises(ValueError, match="sliding must be exact or code"):
        build_method("kivi:bits=4,sliding=yes")


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_codes_pre_rope_keys(arch, monkeypatch):
    """KakeyaCache's pipeline puts exactly k_norm's output into the coding frame, for the
    compressed (full-attention) layers only."""
    model = tiny(arch)
    cache = KakeyaCache.from_model(
        model, k_params=P8, v_params=P8, residual_length=64, sink_tokens=0, pre_rope=True
    )
    pipe = cache._ctx.pipeline
    into = pipe._into_frame
    seen: dict[int, list[torch.Tensor]] = {}

    def spy(x, layer, stream):
        if stream == "k":
            seen.setdefault(layer, []).append(x.clone())
        return into(x, layer, stream)

    monkeypatch.setattr(pipe, "_into_frame", spy)
    ids = token_ids(2, 320)
    pre = pre_rope_qkv(model, ids, cache)
    compressed = [s.index for s in cache.layer_plan if s.kind is LayerKind.COMPRESSED]
    assert sorted(seen) == compressed == [i for i in range(4) if i not in sliding_layers(model)]
    for li in compressed:
        got = torch.cat(seen[li], dim=2)
        assert got.shape[2] == 2 * BLOCK  # (320 - 64) // 128 whole blocks
        torch.testing.assert_close(got, pre[li][1][:, :, : 2 * BLOCK], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_capture_kv_pre_rope(arch):
    from kakeyaturbo.capture import capture_kv

    model = tiny(arch)
    ids = token_ids(1, 100)
    out = capture_kv(model, ids[0].tolist())
    pre = pre_rope_qkv(model, ids)
    for li in range(4):
        torch.testing.assert_close(
            torch.from_numpy(out[f"layer{li}.k_pre_rope"]), pre[li][1][0], atol=1e-4, rtol=0
        )


# ---- 1. evaluation ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_eval_kakeya_accuracy_orders_with_bits(arch, mode):
    """`kakeya` codes every full-attention layer (Gemma 3's sliding ones are held, as in
    KakeyaCache) and 8 bits per value agree with the uncompressed model far better than 1 bit."""
    method = build_method(f"kakeya:block_size={BLOCK}")
    method.recorded = {}
    base = evaluate(arch, "", mode, method)
    assert math.isfinite(base["kl"]) and 0.0 <= base["top1"] <= 1.0
    assert base["tokens"] == 2 * N_EVAL
    assert base["bytes_breakdown"]["encoded"] > 0
    # Every full layer's K and V was coded, every prefix token in one of its blocks.
    full = [li for li in range(4) if li not in sliding_layers(tiny(arch))]
    assert sorted({li for li, _ in method.recorded}) == full
    assert all(sum(b.tokens for b in method.recorded[(li, "k")][0]) == CTX for li in full)
    hi = evaluate(arch, f"kakeya:block_size={BLOCK},bits_per_value=8", mode)
    lo = evaluate(arch, f"kakeya:block_size={BLOCK},bits_per_value=1", mode)
    assert hi["kl"] < 1e-3 and hi["top1"] >= 0.9, hi
    assert hi["kl"] * 20 < lo["kl"], (hi["kl"], lo["kl"])
    assert hi["stored_bytes"] > lo["stored_bytes"]


@pytest.mark.parametrize("mode", MODES)
def test_eval_gemma3_codes_full_layers_and_holds_sliding_ones(mode):
    """Sliding layers are never coded (as in KakeyaCache): asking for them alone changes
    nothing. Full layers are, accurately at 8 bits and clearly worse at 1 bit."""
    sliding = sliding_layers(tiny("gemma3"))
    full = [i for i in range(4) if i not in sliding]
    sel = f"layers={'+'.join(map(str, sliding))},passthrough=exact"
    lo = evaluate("gemma3", f"kakeya:block_size={BLOCK},bits_per_value=1,{sel}", mode)
    assert lo["kl"] < 1e-9 and lo["top1"] == 1.0
    sel = f"layers={'+'.join(map(str, full))},passthrough=exact"
    hi = evaluate("gemma3", f"kakeya:block_size={BLOCK},bits_per_value=8,{sel}", mode)
    lo = evaluate("gemma3", f"kakeya:block_size={BLOCK},bits_per_value=1,{sel}", mode)
    assert hi["kl"] < 1e-4 and hi["top1"] >= 0.9, (hi["kl"], hi["top1"])
    assert hi["kl"] * 10 < lo["kl"], (hi["kl"], lo["kl"])


@pytest.mark.parametrize("arch, mode", ARCH_MODES)
def test_eval_ratio_above_one(arch, mode):
    """The default `kakeya` stores fewer bytes than bf16. Gemma 3's sliding layers are left
    full precision as KakeyaCache leaves them: a self-fitted frame (head_dim^2 float16 per
    stream, 128 KiB at head_dim 256) costs more than a 63-token sliding cache."""
    skip = sliding_layers(tiny(arch))
    spec = f"kakeya:block_size={BLOCK}" + (
        f",skip_layers={'+'.join(map(str, skip))}" if skip else ""
    )
    r = evaluate(arch, spec, mode)
    assert r["ratio"] > 1.0, r["bytes_breakdown"]


@pytest.mark.parametrize("arch, mode", ARCH_MODES)
def test_eval_bf16_bytes_equal_the_baseline(arch, mode):
    """`bf16` stores exactly the bf16 baseline in both modes (ratio 1)."""
    assert evaluate(arch, "bf16", mode)["ratio"] == 1.0


# ---- 3. calibration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch",
    [
        "gemma3",
        "qwen3",
    ],
)
def test_collect_moments_sees_pre_rope_qkv(arch):
    """collect_moments' moments are those of the pre-RoPE q, k, v (checked against hooks that
    know each family's layout)."""
    model = tiny(arch)
    ids = token_ids(1, CALIB_TOKENS, seed=2)[0].tolist()
    # the last token is never a window start (range(0, len - 1, ctx)), so windows match
    got = collect_moments(model, ids, ctx=CALIB_CTX, progress=False)
    want = hand_moments(model)
    for g, w in zip(got, want):
        assert (g.n, g.nq) == (w.n, w.nq)
        for name in ("qq", "kk", "vv", "k", "v"):
            torch.testing.assert_close(
                torch.from_numpy(getattr(g, name)),
                torch.from_numpy(getattr(w, name)),
                rtol=1e-6,
                atol=1e-8,
            )


@pytest.mark.parametrize("arch", ARCHS)
def test_calibrated_eval(arch, tmp_path):
    """`kakeya:calibration=DIR` runs in both modes, stores no frames, is accurate at 8 bits
    and compresses (ratio > 1 in snapshot mode, where bytes are counted right)."""
    path = bundle(arch).save(tmp_path / "bundle")
    loaded = Calibration.load(path, tiny(arch))  # fingerprint matches the model
    assert loaded.num_layers == 4
    for mode in MODES:
        hi = evaluate(arch, f"kakeya:block_size={BLOCK},bits_per_value=8,calibration={path}", mode)
        lo = evaluate(arch, f"kakeya:block_size={BLOCK},bits_per_value=1,calibration={path}", mode)
        base = evaluate(arch, f"kakeya:block_size={BLOCK},calibration={path}", mode)
        for r in (hi, lo, base):
            assert r["bytes_breakdown"].get("frames", 0) == 0 and r["bytes_breakdown"]["encoded"]
            assert math.isfinite(r["kl"])
        assert hi["kl"] < 1e-3 and hi["top1"] >= 0.9, (mode, hi["kl"], hi["top1"])
        assert hi["kl"] * 20 < lo["kl"], (mode, hi["kl"], lo["kl"])
        if mode == "snapshot":
            assert base["ratio"] > 2.0 and hi["ratio"] > 1.0


@pytest.mark.parametrize(
    "arch",
    [
        "gemma3",
        "qwen3",
    ],
)
def test_calibrated_snapshot_no_worse_than_in_forward(arch, tmp_path):
    """Snapshot mode codes exact K/V, in-forward compounds errors over depth: with the same
    bundle, snapshot must not be much worse (it is when keys reach the calibrated pre-RoPE
    frame at the wrong positions)."""
    path = bundle(arch).save(tmp_path / "bundle")
    spec = f"kakeya:block_size={BLOCK},bits_per_value=1,calibration={path}"
    snap, fwd = (evaluate(arch, spec, mode)["kl"] for mode in MODES)
    assert snap <= 2 * fwd, (snap, fwd)


@pytest.mark.parametrize("arch", ARCHS)
def test_in_forward_hot_spans_snapshot_to_in_forward(arch, monkeypatch):
    """The in-forward-hot attention on Gemma 3 (sliding layers, softcap-free, one KV head) and
    Qwen3: with a window over the whole prefix it is snapshot mode, with none in-forward (to
    rounding), and in between it lies between them."""
    spec = f"kakeya:block_size={BLOCK},bits_per_value=1"
    snap, fwd = (evaluate(arch, spec, mode)["kl"] for mode in MODES)
    kl = {}
    for window in (CTX, CTX // 4, 0):
        monkeypatch.setattr(hot_window, "HOT_WINDOW", window)
        kl[window] = evaluate(arch, spec, "in-forward-hot")["kl"]
    assert kl[CTX] == pytest.approx(snap, rel=0.05) and kl[0] == pytest.approx(fwd, rel=0.05)
    assert snap < kl[CTX // 4] < fwd, (snap, kl, fwd)
