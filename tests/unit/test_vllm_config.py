"""The vLLM hooks' configuration and the plugin's entry point (no vLLM needed)."""

from __future__ import annotations

import importlib.metadata as md
import json

import pytest

from kakeyaturbo.recipes import Recipe, default_recipe
from kakeyaturbo.vllm import VLLMHookConfig
from kakeyaturbo.vllm.config import CONFIG_ENV
from kakeyaturbo.vllm.hooks import layer_index
from kakeyaturbo.vllm.plugin import config_from_env


def test_defaults_are_the_recipes():
    cfg = VLLMHookConfig()
    assert (cfg.mode, cfg.hook, cfg.streams, cfg.sink_tokens) == ("snapshot", "pre-rope", "kv", 4)
    assert cfg.codec_params["k"] == default_recipe().k
    assert cfg.codec_params["v"] == default_recipe().v
    calibrated = VLLMHookConfig(calibration="some/bundle")
    assert calibrated.codec_params["k"] == default_recipe(True).k
    assert calibrated.codec_params["v"] == default_recipe(True).v


class _Bundle:
    """Stands in for a loaded Calibration: only its per-layer bit offsets are read."""

    def layer_bit_offsets(self, stream):
        return [0.5, -0.5] if stream == "k" else [-0.25, 0.25]


def test_recipe_carries_the_config():
    cfg = VLLMHookConfig(sink_tokens=2, k_params=default_recipe().k.replace(bits_per_value=2.0))
    r = cfg.recipe()
    assert isinstance(r, Recipe) and r == default_recipe().replace(
        k=cfg.codec_params["k"], sink_tokens=2
    )
    assert r.k.bits_per_value == 2.0 and r.v == default_recipe().v
    # With a loaded bundle the calibrated default's per-layer bits come along.
    r = VLLMHookConfig(calibration="some/bundle").recipe(_Bundle())
    assert r.k_layer_bits == (0.5, -0.5) and r.v_layer_bits == (-0.25, 0.25)
    assert r.params(0, "k").bits_per_value == r.k.bits_per_value + 0.5
    assert r.sink_tokens == 4


def test_json_overrides_fields_of_the_recipe(tmp_path):
    text = json.dumps(
        {
            "mode": "in-forward",
            "streams": "k",
            "skip_layers": [5, 0, 5],
            "k_params": {"bits_per_value": 2.0},
            "sink_tokens": 0,
            "stats_file": "s-{pid}.json",
        }
    )
    cfg = VLLMHookConfig.from_json(text)
    assert cfg.mode == "in-forward" and cfg.skip_layers == (0, 5) and cfg.sink_tokens == 0
    assert cfg.codec_params["k"] == default_recipe().k.replace(bits_per_value=2.0)
    assert cfg.codec_params["v"] == default_recipe().v
    assert cfg.codes(1, "k") and not cfg.codes(1, "v") and not cfg.codes(5, "k")
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert VLLMHookConfig.from_json(str(path)) == cfg


@pytest.mark.parametrize(
    "data, error, match",
    [
        ({"mode": "lazy"}, ValueError, "mode must be one of"),
        ({"hook": "mid-rope"}, ValueError, "hook must be one of"),
        ({"streams": "q"}, ValueError, "streams must be one of"),
        ({"bits": 2}, ValueError, "unknown config keys \\['bits'\\]"),
        ({"k_params": {"bit_widht": 2}}, ValueError, "k_params"),
        ({"k_params": {"block_size": 0}}, ValueError, "block_size"),
        ({"v_params": [1]}, TypeError, "v_params must be a JSON object"),
        ({"skip_layers": 3}, ValueError, "skip_layers must be a list"),
        ({"skip_layers": [-1]}, ValueError, "non-negative layer indices"),
        ({"sink_tokens": -2}, ValueError, "sink_tokens"),
        ({"min_tokens": 1}, ValueError, "min_tokens must be >= 2"),
        ({"calibration": "c", "hook": "post-rope"}, ValueError, "needs hook='pre-rope'"),
    ],
)
def test_bad_configs_name_the_problem(data, error, match):
    with pytest.raises(error, match=match):
        VLLMHookConfig.from_dict(data)


def test_bad_json_and_missing_files():
    with pytest.raises(ValueError, match="not valid JSON"):
        VLLMHookConfig.from_json("{mode: snapshot}")
    with pytest.raises(ValueError, match="neither JSON text"):
        VLLMHookConfig.from_json("/no/such/config.json")
    with pytest.raises(TypeError, match="JSON object"):
        VLLMHookConfig.from_dict([1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="CodecParams"):
        VLLMHookConfig(k_params={"bit_width": 2})  # type: ignore[arg-type]


def test_plugin_acts_only_when_asked():
    assert config_from_env({}) is None  # installed, VLLM_PLUGINS unset: vLLM loads every plugin
    assert config_from_env({"VLLM_PLUGINS": "other"}) is None
    assert config_from_env({"VLLM_PLUGINS": "other, kakeyaturbo"}) == VLLMHookConfig()
    cfg = config_from_env({CONFIG_ENV: '{"mode": "in-forward"}'})
    assert cfg is not None and cfg.mode == "in-forward"
    with pytest.raises(ValueError, match="unknown config keys"):
        config_from_env({CONFIG_ENV: '{"modes": "x"}'})


def test_entry_point_is_registered_for_vllm():
    eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "kakeyaturbo"]
    assert len(eps) == 1, "reinstall the package (maturin develop) to register the entry point"
    from kakeyaturbo.vllm.plugin import register

    assert eps[0].load() is register


def test_layer_index_from_vllm_layer_names():
    assert layer_index("model.layers.3.self_attn.attn") == 3
    assert layer_index("language_model.model.layers.17.self_attn.attn") == 17
    for bad in ("model.attn", "model.layers.1.experts.2.attn"):
        with pytest.raises(ValueError, match="layer index"):
            layer_index(bad)
