"""The bundle every user gets (kakeyaturbo.calibration.auto): fitted on first use from text
the model samples, kept in the cache and reused, on kt-ref-a (code paths; SmolLM2's quality is
in test_smollm2_quality.py)."""

from __future__ import annotations

import pytest
import torch

from kakeyaturbo.calibration import Calibration
from kakeyaturbo.calibration import auto as auto_mod
from kakeyaturbo.calibration.auto import auto_bundle_dir, auto_calibration
from kakeyaturbo.calibration.sampled_text import OPENINGS, opening_ids, sample_sequences
from kakeyaturbo.eval.outlier_channels import with_outlier_channels
from kakeyaturbo.eval.registry import build_method
from kakeyaturbo.hf import KakeyaCache

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def auto_on(monkeypatch, tmp_path):
    monkeypatch.setenv("KAKEYATURBO_AUTO_CALIBRATION", "1")
    monkeypatch.setenv("KAKEYATURBO_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def test_sampled_sequences_are_repeatable_full_length_and_leave_the_rng_alone(model):
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = sample_sequences(model, tokens=64, batch=4, seed=7, progress=False)
    after = torch.rand(1)
    assert torch.equal(before, after)  # the caller's random stream is untouched
    b = sample_sequences(model, tokens=64, batch=4, seed=7, progress=False)
    c = sample_sequences(model, tokens=64, batch=4, seed=8, progress=False)
    assert a == b and a != c
    assert len(a) == 4 and all(len(s) == 16 for s in a)
    assert all(s[0] == model.config.bos_token_id for s in a)
    eos = model.config.eos_token_id
    assert not any(t == eos for s in a for t in s[1:])
    assert len({t for s in a for t in s}) > 20  # sampled, not one token repeated


def test_every_other_sampled_sequence_starts_from_an_opening(model, monkeypatch, tmp_path):
    openings = opening_ids(model)  # the tokenizer beside the weights
    assert openings is not None and len(openings) == len(OPENINGS)
    seqs = sample_sequences(model, tokens=96, batch=4, seed=7, progress=False, openings=openings)
    assert all(len(s) == 24 and s[0] == model.config.bos_token_id for s in seqs)
    for row, opening in ((1, openings[0]), (3, openings[1])):
        assert seqs[row][1 : 1 + len(opening)] == opening
    plain = sample_sequences(model, tokens=96, batch=4, seed=7, progress=False)
    assert seqs[0] == plain[0] and seqs[2] == plain[2]  # the others drawn as without openings
    assert seqs[1] != plain[1]
    monkeypatch.setattr(model, "name_or_path", str(tmp_path))  # no tokenizer there
    assert opening_ids(model) is None


def test_from_model_fits_once_then_reuses_the_cached_bundle(model, auto_on, monkeypatch):
    cache = KakeyaCache.from_model(model, coded_attention=False)
    cache.detach()
    where = auto_bundle_dir(model)
    assert where.parent == auto_on / "bundles"
    assert cache.calibration is not None and cache.calibration.joint_heads
    assert cache.recipe.joint_heads == "kv"  # the recipe codes in the bundle's joint frames
    saved = Calibration.load(where, model)  # a whole, valid bundle for this model
    assert saved.meta["text_file"] == "sampled from the model, half from code openings"
    assert saved.meta["tokens"] == auto_mod.AUTO_TOKENS
    # Per-layer bits from the scan on sampled passages, both protocols, and the recipe takes
    # them: the streams' rates differ by layer around the mean.
    scan = saved.meta["sensitivity"]
    assert scan["mode"] == "both" and scan["passages"] == auto_mod.SCAN_PASSAGES
    offsets = scan["offsets"]["k"] + scan["offsets"]["v"]
    assert abs(sum(offsets)) < 1e-3 and max(offsets) - min(offsets) > 0.1
    assert cache.recipe.k_layer_bits == tuple(scan["offsets"]["k"])
    # The second cache reads the bundle from disk: sampling again would raise.
    monkeypatch.setattr(auto_mod, "fit_sampled", _no_fit)
    again = KakeyaCache.from_model(model, coded_attention=False)
    again.detach()
    for name, t in cache.calibration.tensors.items():
        assert (again.calibration.tensors[name] == t).all(), name


def test_one_bundle_for_the_checkpoint_in_float32_and_bfloat16(model, auto_on, monkeypatch):
    import copy

    half = copy.deepcopy(model).to(torch.bfloat16)
    half.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq  # as loaded: float32
    buffers = {n: b.dtype for n, b in half.named_buffers()}
    assert auto_bundle_dir(half) == auto_bundle_dir(model)
    # Values fine-tuned alone (a value channel 100x, the same function) are another model.
    skewed = with_outlier_channels(model, value_channel=5, key_channel=None)
    assert auto_bundle_dir(skewed) != auto_bundle_dir(model)
    # Fitted in float32 whichever copy asks first; the model gets its own dtypes back, also
    # where the fit fails.
    seen = []

    def failing_fit(m, **_):
        seen.append({p.dtype for p in m.parameters()})
        raise RuntimeError("stop here")

    monkeypatch.setattr(auto_mod, "fit_sampled", failing_fit)
    with pytest.warns(UserWarning, match="stop here"):
        assert auto_calibration(half, progress=False) is None
    assert seen == [{torch.float32}]
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert torch.equal(half.lm_head.weight, model.lm_head.weight.bfloat16())
    assert {n: b.dtype for n, b in half.named_buffers()} == buffers


def test_a_damaged_cached_bundle_is_fitted_again(model, auto_on):
    first = auto_calibration(model, progress=False)
    where = auto_bundle_dir(model)
    (where / "tensors.safetensors").write_bytes(b"not a safetensors file")
    with pytest.warns(UserWarning, match="fitting it again"):
        second = auto_calibration(model, progress=False)
    assert Calibration.load(where, model).tensors.keys() == first.tensors.keys()
    assert (second.tensors["k_transform"] == first.tensors["k_transform"]).all()


def test_the_switch_and_the_explicit_none(model, auto_on, monkeypatch):
    monkeypatch.setattr(auto_mod, "fit_sampled", _no_fit)
    assert (
        KakeyaCache.from_model(model, calibration=None, coded_attention=False).calibration is None
    )
    monkeypatch.setenv("KAKEYATURBO_AUTO_CALIBRATION", "0")
    assert KakeyaCache.from_model(model, coded_attention=False).calibration is None
    monkeypatch.setenv("KAKEYATURBO_AUTO_CALIBRATION", "maybe")
    with pytest.raises(ValueError, match="KAKEYATURBO_AUTO_CALIBRATION='maybe'"):
        KakeyaCache.from_model(model, coded_attention=False)
    with pytest.raises(ValueError, match="from_model"):
        KakeyaCache(model.config, calibration="auto")
    assert not (auto_on / "bundles").exists()


def test_the_eval_method_takes_the_bundle_when_given_the_model(model, auto_on):
    method = build_method("kakeya")
    assert method.needs_model and method.calibration is None
    method.prepare(model)
    assert method.calibration is not None and "auto bundle" in method.label
    assert method.recipe.joint_heads == "kv"
    plain = build_method("kakeya:calibration=none")
    plain.prepare(model)
    assert plain.calibration is None and not plain.needs_model


def _no_fit(*_a, **_k):
    raise AssertionError("the bundle was fitted again instead of read from the cache")
