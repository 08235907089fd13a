"""What the hooks assume of vLLM, checked against the installed vLLM (skipped without it),
and an end-to-end run of a real vLLM engine where a CUDA GPU is present."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed (optional extra: pip install kakeyaturbo[vllm])"
)

from kakeyaturbo.vllm import VLLMHookConfig, install_hooks  # noqa: E402
from kakeyaturbo.vllm.config import CONFIG_ENV  # noqa: E402
from kakeyaturbo.vllm.engine import EagerModeError, check_eager  # noqa: E402


def _body(fn) -> str:
    return "\n".join(line.strip() for line in inspect.getsource(fn).splitlines())


@pytest.mark.parametrize(
    "module, cls",
    [
        ("vllm.model_executor.models.llama", "LlamaAttention"),
        ("vllm.model_executor.models.qwen2", "Qwen2Attention"),
    ],
)
def test_pre_rope_families_call_rotary_then_attention(module, cls):
    import importlib

    attn_cls = getattr(importlib.import_module(module), cls)
    body = _body(attn_cls.forward)
    assert list(inspect.signature(attn_cls.forward).parameters)[1:3] == [
        "positions",
        "hidden_states",
    ]
    # the key the hook replaces goes through self.rotary_emb, then straight into self.attn
    assert "q, k = self.rotary_emb(positions, q, k)" in body
    assert "self.attn(q, k, v)" in body
    assert body.index("self.rotary_emb(") < body.index("self.attn(")


def test_attention_layer_contract():
    from vllm.model_executor.layers.attention import Attention

    params = list(inspect.signature(Attention.forward).parameters)
    assert params[1:4] == ["query", "key", "value"]
    init = inspect.signature(Attention.__init__).parameters
    assert {"num_heads", "head_size", "num_kv_heads", "prefix", "attn_type"} <= set(init)
    src = inspect.getsource(Attention.__init__)
    for attr in ("self.layer_name", "self.num_kv_heads", "self.head_size", "self.impl"):
        assert attr in src


def test_model_forward_and_loader_contract():
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.models.llama import LlamaForCausalLM

    assert "positions" in inspect.signature(LlamaForCausalLM.forward).parameters
    assert list(inspect.signature(BaseModelLoader.load_model).parameters)[1:3] == [
        "vllm_config",
        "model_config",
    ]
    from vllm.forward_context import is_forward_context_available

    assert not is_forward_context_available()


def test_plugin_group_and_register_patch_the_loader(monkeypatch):
    import vllm.plugins
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from kakeyaturbo.vllm.plugin import register

    assert vllm.plugins.DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"
    original = BaseModelLoader.load_model
    monkeypatch.setenv(CONFIG_ENV, '{"mode": "in-forward"}')
    try:
        register()
        patched = BaseModelLoader.load_model
        assert patched is not original
        assert patched._kakeyaturbo_config == VLLMHookConfig(mode="in-forward")
        register()  # vLLM may call it again in the same process
        assert BaseModelLoader.load_model is patched
    finally:
        BaseModelLoader.load_model = original
    monkeypatch.delenv(CONFIG_ENV)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    register()  # not asked to act: nothing patched
    assert BaseModelLoader.load_model is original


def test_eager_check_reads_vllm_compilation_configs():
    from types import SimpleNamespace

    from vllm.config import CompilationConfig

    # A whole VllmConfig needs a device to resolve; the check reads only this part of it.
    compiled = SimpleNamespace(compilation_config=CompilationConfig(mode=3))
    with pytest.raises(EagerModeError, match="--enforce-eager"):
        check_eager(compiled)
    graphs = SimpleNamespace(compilation_config=CompilationConfig(mode=0, cudagraph_mode="FULL"))
    with pytest.raises(EagerModeError, match="CUDA graphs"):
        check_eager(graphs)
    eager = CompilationConfig(mode=0, cudagraph_mode="NONE")
    check_eager(SimpleNamespace(compilation_config=eager))


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a vLLM engine needs a CUDA GPU")
def test_engine_end_to_end(model_dir, eval_text, monkeypatch):
    from vllm import LLM, SamplingParams

    from kakeyaturbo.capture import read_tokens
    from kakeyaturbo.modeling import load_model

    monkeypatch.setitem(os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    _, tok = load_model(model_dir)
    prompts = [read_tokens(tok, eval_text, 700, offset_chars=o) for o in (20_000, 60_000)]
    llm = LLM(model=str(model_dir), enforce_eager=True, dtype="float32", gpu_memory_utilization=0.3)
    sp = SamplingParams(max_tokens=32, temperature=0.0)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    exact = [o.outputs[0].token_ids for o in llm.generate(inputs, sp)]
    hooks = install_hooks(llm, VLLMHookConfig(mode="snapshot"))
    coded = [o.outputs[0].token_ids for o in llm.generate(inputs, sp)]
    stats = hooks.stats()
    hooks.remove()
    assert stats["coded_tokens"] == 2 * 6 * 2 * (700 - 4)  # seqs x layers x streams
    assert stats["d2h_bytes"] > 0 and stats["ratio_vs_bf16"] > 4
    agree = sum(a == b for x, y in zip(exact, coded) for a, b in zip(x, y)) / 64
    assert agree >= 0.5
    again = [o.outputs[0].token_ids for o in llm.generate(inputs, sp)]
    assert again == exact
