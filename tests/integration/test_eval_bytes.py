"""Byte reports: per-layer split, and the long-context projection against a measured run."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kakeyaturbo.eval.bytes_report import capture_kv, measure, project
from kakeyaturbo.eval.registry import build_method
from kakeyaturbo.hf.rope import ModelRope
from kakeyaturbo.modeling import kv_geometry, load_model, read_text, tokenize_text

MEASURED = 1536


@pytest.fixture(scope="module")
def captured(model_dir, eval_text):
    model, tok = load_model(model_dir)
    ids = tokenize_text(tok, read_text(eval_text))
    kv = capture_kv(model, ids[:MEASURED], chunk=512)
    return model, kv, kv_geometry(model.config)


def _total(rows):
    return sum(r["k"] + r["v"] for r in rows)


@pytest.mark.parametrize(
    "spec",
    [
        "kivi:bits=2",
        "kivi:bits=3,sink_tokens=4,residual_length=20",
        "turboquant:bits=3,k_qjl=1",
        "fp8",
        "hf-fp8",
        "hf-hqq:bits=2",
    ],
)
def test_peer_projection_is_byte_exact(captured, spec):
    model, kv, geom = captured
    m = build_method(spec)
    if getattr(m, "reason", None):
        pytest.skip(m.reason)
    proj = project(m, kv, geom, model.config, fit_max=256, targets=[])
    for t in (1000, MEASURED):  # 1000: KIVI's last key group is partial
        assert proj["predict"](t)["stored_bytes"] == _total(measure(m, kv, geom, model.config, t))


def test_kakeya_projection_is_close(captured):
    model, kv, geom = captured
    m = build_method("kakeya")
    rope = ModelRope(model.config) if m.options.pre_rope else None
    proj = project(m, kv, geom, model.config, fit_max=1024, targets=[], rope=rope)
    measured = _total(measure(m, kv, geom, model.config, MEASURED, rope))
    predicted = proj["predict"](MEASURED)["stored_bytes"]
    # The default recipe's sizes depend on the data (adaptive rank and bit allocation, one
    # shared basis per stream), so this is a projection, not a byte-exact count.
    print(f"kakeya projection error at {MEASURED}: {(predicted - measured) / measured:+.4%}")
    assert abs(predicted - measured) / measured < 1e-2


def test_skipped_and_sliding_layers(captured):
    model, kv, geom = captured
    m = build_method("kivi:bits=2,skip_layers=0")
    rows = measure(m, kv, geom, model.config, 512)
    assert rows[0]["type"] == "skipped" and rows[1]["type"] == "full"
    assert (
        rows[0]["k"] + rows[0]["v"]
        == rows[0]["bf16"]
        == 2 * geom.kv_heads * 512 * geom.head_dim * 2
    )
    # the same model seen as sliding-window on layer 1 (window 256): its bytes stop growing
    types = list(geom.layer_types)
    types[1] = "sliding_attention"
    sliding = replace(geom, layer_types=tuple(types), sliding_window=256)
    proj = project(m, kv, sliding, model.config, fit_max=512, targets=[262144])
    p = proj["projection"][0]
    at_window = measure(m, kv, sliding, model.config, 256)[1]
    assert p["by_type"]["sliding"] == at_window["k"] + at_window["v"]
    assert p["by_type"]["skipped"] == 2 * geom.kv_heads * 262144 * geom.head_dim * 2
