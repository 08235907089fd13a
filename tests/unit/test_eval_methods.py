"""Method specs, per-stream overrides, shared options, the registry."""

from __future__ import annotations

import math

import pytest

from kakeyaturbo.eval.methods import METHODS, MethodOptions, parse_spec, stream_params
from kakeyaturbo.eval.registry import build_method


def test_parse_spec_types():
    name, p = parse_spec(
        "kakeya:bit_width=3,variance_ratio=0.99,k=0,share_basis=true,rank_cap=none"
    )
    assert name == "kakeya"
    assert p == {
        "bit_width": 3,
        "variance_ratio": 0.99,
        "k": 0,
        "share_basis": True,
        "rank_cap": None,
    }
    assert parse_spec("bf16") == ("bf16", {})
    _, p = parse_spec("x:skip_layers=0+5,outlier_threshold=inf,metric=inner_product")
    assert p["skip_layers"] == [0, 5]
    assert math.isinf(p["outlier_threshold"])
    assert p["metric"] == "inner_product"


@pytest.mark.parametrize("bad", ["", ":bits=2", "kivi:bits", "kivi:bits=2,bits=3", "kivi:=2"])
def test_parse_spec_rejects(bad):
    with pytest.raises(ValueError):
        parse_spec(bad)


def test_stream_overrides():
    p = {"bits": 2, "v_bits": 4, "k_group": 16, "k": 8}
    assert stream_params(p, "k") == {"bits": 2, "group": 16, "k": 8}
    assert stream_params(p, "v") == {"bits": 4, "k": 8}


def test_kivi_per_stream_bits():
    m = build_method("kivi:bits=2,v_bits=4")
    assert m.cfg == {"k": (2, 32), "v": (4, 32)}


def test_options_from_spec():
    m = build_method("kivi:bits=2,sink_tokens=4,residual_length=16,skip_layers=0+5,streams=v")
    o = m.options
    assert (o.sink_tokens, o.residual_length, o.skip_layers, o.streams) == (4, 16, (0, 5), "v")
    assert not o.compresses(0, "v") and not o.compresses(3, "k") and o.compresses(3, "v")
    m = build_method("kivi:layers=1-3", {"streams": "k"})
    assert m.options.layers == (1, 2, 3) and m.options.streams == "k"
    assert m.options.compresses(2, "k") and not m.options.compresses(4, "k")
    assert MethodOptions().is_default()


def test_unknown_method_and_parameter():
    with pytest.raises(ValueError, match="unknown method"):
        build_method("nope:bits=2")
    with pytest.raises(ValueError, match="unknown parameter"):
        build_method("kivi:bitz=2")
    with pytest.raises(ValueError, match="streams"):
        build_method("kivi:streams=q")


def test_registry_has_every_peer():
    build_method("bf16")  # loads the built-in methods
    for name in (
        "identity",
        "bf16",
        "fp8",
        "kivi",
        "turboquant",
        "hf-hqq",
        "hf-quanto",
        "hf-fp8",
        "kakeya",
    ):
        assert name in METHODS
